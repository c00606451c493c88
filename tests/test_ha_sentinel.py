"""Redis Sentinel failover under load (issue 24), with real processes on loopback: a redis-server
master and its replica, three redis-sentinels (quorum 2, ``down-after-milliseconds`` 1000,
``failover-timeout`` 3000), leasing daemons given the Sentinel URL, steady GET load with every ID
recorded. The master is SIGKILLed; Sentinel promotes the replica (measured: 2.3 to 3.3 s).

Lease timings go with the failover time: a holder keeps serving through the failover if it renews on
the new master before its deadline, at most ttl - ttl/10 after its last confirmed renew, which came up
to a renew interval before the kill. So ttl - ttl/10 - renew must exceed the failover time, with room
to spare: ttl 9 s, renew 1 s leave 7.1 s for a 3 s failover (and, in the lagging-replica tests, the
second or so during which the replica was cut off before the kill). The doubt window after a failover
is ttl + 2 x clock-skew-max = 10 s.

One replica, ``min-replicas-to-write 0`` and ``allow=no-min-replicas`` in the URL: each lease write
waits for every replica the master has had (issue 32's fallback rule), which these tests measure.

The figures each test prints (run with ``-s``) are the ones docs/leasing.md quotes.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, DaemonFactory, decode, free_port
from id_recorder import Recorder
from lease_helpers import (
    RENEW_HA,
    TTL_HA,
    check_followed_without_a_failed_request,
    run_tool,
    stats,
    wait_serving,
    wait_until,
)
from redis_servers import RedisServer, SentinelSetup, start_redis, start_sentinel_setup

pytestmark = pytest.mark.once

TTL, RENEW, SKEW = TTL_HA, RENEW_HA, 0.5
DOUBT = TTL + 2 * SKEW  # nobody newly leasing serves for this long after a failover is seen
TIMINGS = ("--lease-ttl", "9s", "--lease-renew", "1s", "--lease-delay", "2s")
SKEW_ARGS = ("--clock-skew-max", "0.5s", "--clock-skew-warn", "0.5s")


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = start_sentinel_setup(tmp_path / "redis")
    try:
        yield setup
    finally:
        setup.stop()


def with_ns(url: str, ns: str = "t") -> str:
    """The URL with the namespace, accepting ``min-replicas-to-write 0``: one replica cannot be both
    required (1) and survive the master's failover (the promoted one has none left): see the module's
    docstring. tests/test_redis_settings.py runs the recommended two replicas with 1."""
    return f"{url}{'&' if '?' in url else '?'}ns={ns}&allow=no-min-replicas"


def lease_init(url: str, high: int) -> None:
    """``katsubushi-py lease init`` over the Sentinel URL: a pool that serves at once."""
    result = run_tool("lease", "init", "--redis", with_ns(url), "--min", "1", "--max", str(high))
    assert result.returncode == 0 and "created" in result.stdout, result.stderr


def start_ha(daemons: DaemonFactory, url: str, *more: str, wait: bool = True) -> Daemon:
    d = daemons.start("--redis", with_ns(url), *TIMINGS, *SKEW_ARGS, *more, worker_id=None)
    if wait:
        wait_serving(d)
    return d


def pool_field(server: RedisServer, field: str) -> int:
    return int(server.client().hget("{t}:pool", field) or 0)


def counter(server: RedisServer, name: str) -> int:
    return int(server.client().hget("{t}:stats", name) or 0)


def followed(daemons: list[Daemon], new: RedisServer) -> bool:
    """Every daemon renewed on the new master (after renews that failed)."""
    fields = [stats(d) for d in daemons]
    return all(f["lease_redis_address"] == new.address and int(f["lease_renew_outages"]) >= 1 for f in fields)


def failed(recorder: Recorder, daemon: int) -> int:
    return len(recorder.errors(daemon))


def test_sentinel_failover_under_load_fails_no_request(daemons: DaemonFactory, sentinels: SentinelSetup) -> None:
    """Three daemons serve through the master's death: each keeps issuing under its lease, follows the
    master Sentinel names, and renews there (its record is as it wrote it, so it vouches for it)."""
    url = sentinels.url
    lease_init(url, 4)
    http_port = free_port()  # the first daemon's metrics
    loaded = [start_ha(daemons, url, "--http-port", str(http_port)), *(start_ha(daemons, url) for _ in range(2))]
    # Each acquire was acknowledged by the replica, and each daemon now waits for it.
    assert all(stats(d)["lease_replicas_expected"] == "1" for d in loaded)
    old = sentinels.master.address
    recorder = Recorder(loaded).start()
    try:
        time.sleep(1.5)
        killed, failover = sentinels.kill_master()
        wait_until(lambda: followed(loaded, sentinels.replica), timeout=RENEW * 3 + 5, step=0.1)
        time.sleep(1)
    finally:
        recorder.stop()
    new = sentinels.replica.address
    fields = check_followed_without_a_failed_request(recorder, loaded, killed, failover, old, new, "Sentinel failover")
    assert all(f["lease_replicas_expected"] == "0" for f in fields)  # the new master has no replica yet
    summary = json.loads(run_tool("lease", "stats", "--redis", with_ns(url)).stdout)
    assert summary["redis_changes"] == 1 and summary["ids_in_use"] == 3
    assert summary["redis_identity"] == summary["pool_identity"]
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    assert "katsubushi_lease_master_changes_total 1.0" in metrics
    assert "katsubushi_lease_renew_outages_total 1.0" in metrics
    since = re.search(r"^katsubushi_lease_since_renew_seconds (\S+)$", metrics, re.M)
    assert since is not None and 0 <= float(since.group(1)) < RENEW * 2, metrics


def test_failover_to_a_replica_that_missed_writes(daemons: DaemonFactory, sentinels: SentinelSetup) -> None:
    """Replication is cut, then the master dies: the promoted replica lacks the last renews of three
    holders and the acquires of a daemon that started meanwhile. Writes the replica did not acknowledge
    never counted: the holders, whose records on the new master are ones they wrote, keep serving; the
    daemon whose acquires were not acknowledged never served on the old master; it and a daemon that
    joins right after the promotion wait out the doubt window (they are the ids in doubt)."""
    url = sentinels.url
    lease_init(url, 5)
    holders = [start_ha(daemons, url) for _ in range(3)]
    recorder = Recorder(list(holders)).start()
    try:
        time.sleep(1)
        sentinels.cut_replication()
        cut = time.monotonic()
        late = start_ha(daemons, url, wait=False)
        recorder.add(late)
        wait_until(lambda: "acquire not acknowledged by the replicas" in late.stderr(), timeout=15)
        wait_until(lambda: time.monotonic() - cut >= RENEW * 1.2, timeout=5)  # a renew each, not acknowledged
        # The replica really lacks them (otherwise this test would prove nothing).
        master, replica = sentinels.master, sentinels.replica
        written, known = pool_field(master, "version"), pool_field(replica, "version")
        acquired, acquired_known = counter(master, "acquire_success"), counter(replica, "acquire_success")
        renewed, renewed_known = counter(master, "renew_success"), counter(replica, "renew_success")
        assert written > known and acquired > acquired_known and renewed >= renewed_known + 3
        killed, failover = sentinels.kill_master()
        joined = start_ha(daemons, url, wait=False)
        recorder.add(joined)
        wait_until(lambda: recorder.served(3, killed) and recorder.served(4, killed), timeout=DOUBT + 20, step=0.1)
        time.sleep(0.5)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    holder_failures = [failed(recorder, d) for d in range(3)]
    waited = {d: recorder.served(d, killed)[0].received - killed for d in (3, 4)}
    print(
        f"failover to a lagging replica: {recorder.summary()}; the promoted replica lacked"
        f" {written - known} writes ({acquired - acquired_known} acquires, {renewed - renewed_known} renews);"
        f" failover {failover:.2f} s; failed requests: holders {holder_failures}, the daemon that started"
        f" during the cut {failed(recorder, 3)}, the one that joined {failed(recorder, 4)}; those two served"
        f" {waited[3]:.1f} and {waited[4]:.1f} s after the kill"
    )
    assert holder_failures == [0, 0, 0]  # not in doubt: never stopped
    for d in holders:
        fields = stats(d)
        assert fields["lease_kept_through_change"] == "1" and fields["worker_id_changes"] == "0", fields
    # The ids in doubt: not served before the window that opened when the failover was seen.
    assert min(waited.values()) >= failover + DOUBT - 0.5, waited
    assert not recorder.served(3, 0, killed)  # never served under an acquire the replica lacked


def test_a_lost_acquire_whose_holder_cannot_reach_the_new_master(
    daemons: DaemonFactory, sentinels: SentinelSetup
) -> None:
    """The case detection must not leave to the holder: a daemon told to wait for no replica
    (``replica_acks=0``, the setting under which the issue saw it) and given the master's own address
    leases an id while replication is cut, and serves. The master dies; that daemon cannot reach the
    new master, which never heard of its lease. A daemon joining through Sentinel finds the id free:
    it must not serve under it before the old holder has certainly stopped."""
    url = sentinels.url
    lease_init(url, 3)
    holders = [start_ha(daemons, url) for _ in range(2)]
    recorder = Recorder(list(holders)).start()
    try:
        time.sleep(1)
        sentinels.cut_replication()
        lost = start_ha(daemons, f"redis://127.0.0.1:{sentinels.master.port}/0?replica_acks=0")
        recorder.add(lost)
        assert stats(lost)["lease_worker_id"] == "3"
        wait_until(lambda: recorder.served(2), timeout=5)
        time.sleep(RENEW)
        master, replica = sentinels.master, sentinels.replica
        assert master.client().hget("{t}:owners", 3) and replica.client().hget("{t}:owners", 3) is None
        killed, failover = sentinels.kill_master()
        joined = start_ha(daemons, url, wait=False)
        recorder.add(joined)
        wait_until(lambda: recorder.served(3, killed), timeout=DOUBT + 20, step=0.1)
        time.sleep(0.5)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    old_last = recorder.served(2)[-1].received - killed
    new_first = recorder.served(3)[0].received - killed
    assert {decode(i)[1] for r in recorder.served(3) for i in r.ids} == {3}  # the id whose acquire was lost
    print(
        f"lost acquire, its holder cut off: {recorder.summary()}; failover {failover:.2f} s; the old holder"
        f" served until {old_last:.1f} s after the kill, the new one from {new_first:.1f} s; failed requests:"
        f" holders {[failed(recorder, d) for d in range(2)]}, the joiner {failed(recorder, 3)}"
    )
    assert old_last <= TTL  # fenced at its own deadline
    assert new_first >= failover + DOUBT - 0.5
    assert [failed(recorder, d) for d in range(2)] == [0, 0]
    assert "DATA LOSS" not in "".join(d.stderr() for d in holders)


def test_the_old_master_back_as_a_replica_changes_nothing(
    daemons: DaemonFactory, sentinels: SentinelSetup, tmp_path: Path
) -> None:
    """After a failover the old master is started again (as a crashed host comes back, without its
    data); Sentinel makes it a replica of the new master (within its 10 s INFO period). The daemons,
    which follow Sentinel's master, see nothing of it."""
    url = sentinels.url
    lease_init(url, 4)
    loaded = [start_ha(daemons, url) for _ in range(3)]
    recorder = Recorder(loaded).start()
    old = sentinels.master
    back: RedisServer | None = None
    try:
        time.sleep(1)
        _, failover = sentinels.kill_master()
        wait_until(lambda: followed(loaded, sentinels.replica), timeout=RENEW * 3 + 5, step=0.1)
        restarted = time.monotonic()
        back = start_redis(old.workdir, "--repl-diskless-sync-delay", "0", port=old.port)
        wait_until(lambda: back.client().info("replication")["role"] == "slave", timeout=25, step=0.1)
        reconfigured = time.monotonic() - restarted
        new = sentinels.replica.client()
        wait_until(lambda: new.execute_command("WAIT", 1, 100) == 1, timeout=10)
        time.sleep(RENEW * 2)
    finally:
        recorder.stop()
        if back is not None:
            back.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert [r.error for r in recorder.replies if r.error] == []
    served = [len(recorder.served(d, restarted + reconfigured)) for d in range(3)]
    print(
        f"old master back as a replica: {recorder.summary()}; failover {failover:.2f} s; Sentinel made the old"
        f" master a replica {reconfigured:.1f} s after it started; replies since, per daemon {served}"
    )
    assert all(served)
    for d in loaded:
        fields = stats(d)
        assert fields["lease_master_changes"] == "1" and fields["worker_id_changes"] == "0", fields
        assert fields["lease_redis_address"] == sentinels.replica.address
        assert fields["lease_data_loss_events"] == "0" and fields["lease_redis_changes"] == "1", fields

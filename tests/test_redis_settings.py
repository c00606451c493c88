"""What start-up refuses, and what a lease write waits for, from the Redis settings (issue 32).

Real processes: redis-servers (masters, replicas, three sentinels) on loopback, leasing daemons as
subprocesses, steady GET load with every ID recorded.

- Refused at start, one line on stderr and exit 2: a URL parameter nobody reads (at once), an
  unreachable port and a database Redis does not have (after ``--lease-start-timeout``), a master with
  a replica whose ``min-replicas-to-write`` is 0, an ``allkeys-*`` ``maxmemory-policy``; each unsafe
  setting accepted with ``allow=`` in the URL; ``CONFIG`` renamed: one warning, the daemon serves.
- ``min-replicas-to-write`` M set: a lease write waits for M acknowledgements. Two replicas and M = 1,
  one SIGKILLed under load: no failed request. One replica and M = 1, killed: the daemon says so in
  one line while it still serves, then stops at its deadline (the documented behaviour), and serves
  again once the replica is back.
- Sentinel, two replicas, M = 1: a failover, then the old master comes back and fully resyncs a
  dataset filled with ``DEBUG POPULATE`` (slowed to about 10 s with ``rdb-key-save-delay``): no failed
  request (the every-replica rule waited for it, and stopped every daemon for as long).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, free_port
from id_recorder import Recorder
from lease_helpers import TTL, get, init_pool, run_tool, start_leased, stats, wait_serving, wait_until
from redis_servers import RedisServer, SentinelSetup, start_redis, start_sentinel_setup

pytestmark = pytest.mark.once

FAST = ("--repl-diskless-sync-delay", "0")
SHORT_START = ("--lease-start-timeout", "1s")


def refused(*args: str, at_once: bool = False) -> tuple[str, float]:
    """Run the daemon expecting exit 2 with one error line on stderr, its last (``at_once``: its only
    line, nothing else logged); that line and how long it took."""
    started = time.monotonic()
    result = run_tool(*args, "--port", str(free_port()))
    took = time.monotonic() - started
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and lines[-1].startswith("katsubushi-py: error: "), result.stderr
    assert [line for line in lines if "error:" in line] == lines[-1:], result.stderr
    assert len(lines) == 1 or not at_once, result.stderr
    return lines[-1], took


def with_replicas(tmp_path: Path, count: int, *settings: str) -> tuple[RedisServer, list[RedisServer]]:
    """A master (with ``settings``) and ``count`` replicas, streaming."""
    master = start_redis(tmp_path / "master", *FAST, *settings)
    following = ("--replicaof", "127.0.0.1", str(master.port))
    replicas = [start_redis(tmp_path / f"replica{i}", *FAST, *following) for i in range(count)]
    wait_until(lambda: master.client().execute_command("WAIT", count, 100) == count, timeout=15, step=0)
    return master, replicas


# -- refused at start --------------------------------------------------------------------------------
def test_a_url_typo_is_refused_at_once() -> None:
    line, took = refused("--redis", "redis://127.0.0.1:1/0?nz=myapp", at_once=True)
    assert "unknown parameter 'nz' in Redis URL (known: ns, replica_acks, allow" in line, line
    assert took < 5.0  # not retried as an outage
    line, _ = refused("--redis", "redis://127.0.0.1:1/0?ns=a&allow=everything", at_once=True)
    assert "unknown allow=everything in Redis URL (known: no-min-replicas, evicting)" in line


def test_nothing_on_the_port_exits_2_after_the_start_timeout() -> None:
    port = free_port()
    line, took = refused("--redis", f"redis://127.0.0.1:{port}/0", *SHORT_START)
    assert "within --lease-start-timeout 1s" in line and f"connecting to 127.0.0.1:{port}" in line, line
    assert 1.0 <= took < 15.0


def test_a_missing_database_exits_2_after_the_start_timeout(redis_server: RedisServer) -> None:
    line, took = refused("--redis", f"redis://127.0.0.1:{redis_server.port}/99", *SHORT_START)
    assert "within --lease-start-timeout 1s" in line and "DB index is out of range" in line, line
    assert 1.0 <= took < 15.0


def test_min_replicas_to_write_0_beside_a_replica_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    master, replicas = with_replicas(tmp_path, 1)
    try:
        init_pool(master.url)
        line, _ = refused("--redis", f"{master.url}?ns=t", *SHORT_START)
        assert "refusing to lease from" in line and "min-replicas-to-write is 0" in line, line
        assert "a master with 1 replica(s)" in line and "allow=no-min-replicas" in line
        # Accepted when the URL says so: every replica the master has had is waited for (the fallback).
        d = start_leased(daemons, f"{master.url}", init=False, ns="t&allow=no-min-replicas")
        fields = stats(d)
        assert fields["lease_redis_settings_unsafe"] == "0" and fields["lease_replicas_expected"] == "1", fields
        assert fields["lease_redis_min_replicas_to_write"] == "0"
    finally:
        for r in replicas:
            r.stop()
        master.stop()


def test_an_evicting_redis_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    server = start_redis(tmp_path / "lru", "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    try:
        init_pool(server.url)
        line, _ = refused("--redis", f"{server.url}?ns=t", *SHORT_START)
        assert "maxmemory-policy is allkeys-lru" in line and "allow=evicting" in line, line
        # volatile-*: evicts only keys with a TTL, and no lease key has one.
        server.client().config_set("maxmemory-policy", "volatile-lru")
        d = start_leased(daemons, server.url, init=False)
        assert stats(d)["lease_redis_settings_unsafe"] == "0"
        # Set to evict while the daemon runs: not refused (it holds a lease), but logged and in the metric
        # at the next check (every minute; here sooner: a refused write, NOREPLICAS, forces one).
        server.client().config_set("maxmemory-policy", "allkeys-random")
        assert isinstance(get(d), list)
        server.client().config_set("min-replicas-to-write", 1)
        wait_until(lambda: stats(d)["lease_redis_settings_unsafe"] == "1", timeout=3 * TTL)
        server.client().config_set("min-replicas-to-write", 0)
        assert "ERROR unsafe Redis setting: maxmemory-policy is allkeys-random" in d.stderr()
        wait_serving(d)
    finally:
        server.stop()


def test_config_renamed_is_one_warning_and_the_daemon_serves(daemons: DaemonFactory, tmp_path: Path) -> None:
    server = start_redis(tmp_path / "noconfig", "--rename-command", "CONFIG", "")
    try:
        d = start_leased(daemons, server.url)
        log = d.stderr()
        assert log.count("cannot read Redis's settings") == 1, log
        assert "min-replicas-to-write" in log and "maxmemory-policy" in log
        fields = stats(d)
        assert fields["lease_redis_settings_unreadable"] == "1" and fields["lease_redis_min_replicas_to_write"] == "-1"
        assert isinstance(get(d), list)
    finally:
        server.stop()


# -- how many acknowledgements ---------------------------------------------------------------------------
def test_one_of_two_replicas_killed_under_load_costs_no_request(daemons: DaemonFactory, tmp_path: Path) -> None:
    """M = 1, two replicas: a lease write waits for one acknowledgement, so losing a replica changes
    nothing. (Under the every-replica rule both daemons stopped within a ttl of the kill.)"""
    master, replicas = with_replicas(tmp_path, 2, "--min-replicas-to-write", "1")
    try:
        loaded = [start_leased(daemons, master.url, init=i == 0) for i in range(2)]
        assert all(stats(d)["lease_replicas_expected"] == "1" for d in loaded)
        recorder = Recorder(loaded).start()
        try:
            time.sleep(1.0)
            killed = time.monotonic()
            replicas[0].stop()
            time.sleep(2 * TTL)  # two lease lifetimes: every holder renewed several times since
        finally:
            recorder.stop()
        errors = [r.error for r in recorder.replies if r.error]
        after = [len(recorder.served(i, killed + TTL)) for i in range(2)]
        print(f"one of two replicas killed (M=1): {recorder.summary()}; replies a ttl after the kill {after}")
        assert recorder.duplicates() == 0, recorder.summary()
        assert errors == [] and all(after)
        assert all(stats(d)["lease_replica_ack_failures"] == "0" for d in loaded)
        summary = json.loads(run_tool("lease", "stats", "--redis", f"{master.url}?ns=t").stdout)
        assert summary["replicas_expected"] == 1 and summary["min_replicas_to_write"] == 1, summary
    finally:
        for r in replicas:
            r.stop()
        master.stop()


def test_the_only_replica_killed_is_said_before_any_holder_stops(daemons: DaemonFactory, tmp_path: Path) -> None:
    """M = 1, one replica, killed: the master refuses lease writes (WAIT 1 times out, then NOREPLICAS).
    The daemon logs one line naming it while it still serves, counts it (lease_redis_replicas_good 0),
    stops at its deadline, and serves again once the replica is back."""
    master, replicas = with_replicas(tmp_path, 1, "--min-replicas-to-write", "1")
    try:
        d = start_leased(daemons, master.url)
        recorder = Recorder([d]).start()
        said = "has 0 of the 1 replicas its min-replicas-to-write needs"
        try:
            time.sleep(1.0)
            killed = time.monotonic()
            replicas[0].stop()
            wait_until(lambda: said in d.stderr(), timeout=3 * TTL, step=0.02)
            logged = time.monotonic()
            wait_until(lambda: recorder.first_error(0, killed) is not None, timeout=3 * TTL, step=0.1)
            assert stats(d)["lease_redis_replicas_good"] == "0"
            replicas[0] = replicas[0].restart_from(None)
            back = time.monotonic()
            wait_until(lambda: recorder.resumed(0, back) is not None, timeout=30, step=0.1)
        finally:
            recorder.stop()
        first_error = recorder.first_error(0, killed)
        assert first_error is not None
        print(
            f"the only replica killed (M=1): said {logged - killed:.2f} s after the kill, first refused request"
            f" {first_error.sent - killed:.2f} s after; {recorder.summary()}"
        )
        assert logged < first_error.sent  # said before the holder stopped
        assert recorder.duplicates() == 0
        log = d.stderr()
        assert log.count(said) == 1, log
        wait_until(lambda: "replicas again (min-replicas-to-write 1)" in d.stderr(), timeout=10)
    finally:
        for r in replicas:
            r.stop()
        master.stop()


# -- a failover, and the old master's full resync ------------------------------------------------------
KEYS = 80_000
KEY_DELAY_US = 20  # rdb-key-save-delay: measured about 125 us a key with the sleep, so about 10 s


@pytest.fixture
def two_replica_sentinels(tmp_path: Path) -> Iterator[SentinelSetup]:
    setup = start_sentinel_setup(
        tmp_path / "redis",
        replicas=2,
        extra=("--min-replicas-to-write", "1", "--min-replicas-max-lag", "10"),
        before_replicas=lambda master: master.client().execute_command("DEBUG", "POPULATE", KEYS, "filler", 8),
    )
    try:
        yield setup
    finally:
        setup.stop()


def test_the_old_masters_full_resync_costs_no_request(
    daemons: DaemonFactory, two_replica_sentinels: SentinelSetup
) -> None:
    setup = two_replica_sentinels
    url = f"{setup.url}?ns=t"
    result = run_tool("lease", "init", "--redis", url, "--min", "1", "--max", "8")
    assert result.returncode == 0, result.stderr
    timings = ("--lease-ttl", "9s", "--lease-renew", "1s", "--lease-delay", "2s", "--clock-skew-max", "0.5s")
    loaded = [daemons.start("--redis", url, *timings, worker_id=None) for _ in range(2)]
    for d in loaded:
        wait_serving(d)
    recorder = Recorder(loaded).start()
    old = setup.master
    try:
        time.sleep(1.0)
        old.stop()
        wait_until(lambda: setup.master_port() not in (None, old.port), timeout=30, step=0.05)
        new = next(r for r in [setup.replica, *setup.more] if r.port == setup.master_port())
        wait_until(lambda: all(stats(d)["lease_redis_address"] == new.address for d in loaded), timeout=20)
        new.client().config_set("rdb-key-save-delay", KEY_DELAY_US)  # a slow full sync of KEYS keys
        setup.master = old = old.restart_from(None)  # empty: Sentinel makes it a replica, a full resync
        wait_until(lambda: _syncing(new, old.port), timeout=30, step=0.05)
        sync_started = time.monotonic()
        wait_until(lambda: _state(new, old.port) == "online", timeout=60, step=0.1)
        resync = time.monotonic() - sync_started
        time.sleep(1.0)
    finally:
        recorder.stop()
    errors = [r.error for r in recorder.replies if r.error]
    print(f"old master's full resync ({KEYS} keys): {resync:.1f} s; {recorder.summary()}; errors {len(errors)}")
    assert recorder.duplicates() == 0, recorder.summary()
    assert errors == []
    assert resync >= 5.0  # long enough that waiting for it would have stopped the daemons (ttl 9 s)
    assert all(stats(d)["lease_replicas_expected"] == "1" for d in loaded)


def _state(master: RedisServer, port: int) -> str:
    info = master.client().info("replication")
    for i in range(int(info["connected_slaves"])):
        replica = info[f"slave{i}"]
        if int(replica["port"]) == port:
            return str(replica["state"])
    return ""


def _syncing(master: RedisServer, port: int) -> bool:
    return _state(master, port) in ("wait_bgsave", "send_bulk")

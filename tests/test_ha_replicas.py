"""What a lease write waits for (issue 24), and the URLs that name a highly available Redis.

Without ``min-replicas-to-write`` (M = 0, accepted with ``allow=no-min-replicas`` in the URL, or CONFIG
unreadable), a write counts only once every replica the master has had since it last started or was
promoted has acknowledged it (the count is recorded in the pool under the master's identity, and read by every
lease write in its own script): a replica that vanishes lowers nothing. Shown here rule by rule against
real redis-servers, then as the fault it is for: two masters at once (the old one cut off from its
replica, which was promoted), with daemons on each side and every ID recorded, also seconds after the
replica joined. (With M set, a write waits for M acknowledgements: tests/test_redis_settings.py.)
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, DaemonFactory, free_port
from id_recorder import Recorder
from lease_helpers import get, init_pool, lease_args, run_tool, stats, wait_serving, wait_until
from redis_servers import RedisServer, start_redis

from katsubushi_py.leasing import LeaseError, lua_parts, parse_redis_url
from katsubushi_py.leasing.scripts import REPLICAS_LUA, counted

KEYS = [f"{{t}}:{name}" for name in ("ids", "owners", "last_ms", "released", "stats", "pool")]
FAST = ("--repl-diskless-sync-delay", "0")


# -- URLs -------------------------------------------------------------------------------------------
def test_sentinel_urls() -> None:
    target = parse_redis_url("redis+sentinel://u:secret@10.0.0.1:26379,10.0.0.2,[::1]:26380/mymaster?ns=app&db=2")
    assert target.sentinel and not target.cluster and target.service == "mymaster" and target.namespace == "app"
    assert target.seeds == (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 26380))
    assert target.node_url("10.0.0.9", 6380) == "redis://u:secret@10.0.0.9:6380/2"
    assert "secret" not in target.display
    assert target.display == "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379,[::1]:26380/mymaster?db=2 (ns=app)"
    assert target.replica_acks is None
    # TLS to the master (either spelling), TLS and credentials for the sentinels, other redis-py options.
    tls = parse_redis_url(
        "rediss+sentinel://h:1/m?ns=a&sentinel_password=pw&sentinel_ssl=true&sentinel_ssl_ca_certs=/ca.pem"
        "&ssl_ca_certs=/ca.pem&socket_keepalive=true&replica_acks=2"
    )
    assert tls.node_url("m", 2) == "rediss://m:2/0?ssl_ca_certs=%2Fca.pem&socket_keepalive=true"
    assert dict(tls.sentinel_options) == {"password": "pw", "ssl": True, "ssl_ca_certs": "/ca.pem"}
    assert tls.replica_acks == 2
    assert parse_redis_url("redis+sentinel://h/m/3?ssl=yes").node_url("m", 2) == "rediss://m:2/3"


def test_cluster_urls_take_several_seed_nodes() -> None:
    target = parse_redis_url("rediscluster://:pw@10.0.0.1:7000,10.0.0.2:7001?ns=c&replica_acks=0")
    assert target.cluster and target.seeds == (("10.0.0.1", 7000), ("10.0.0.2", 7001)) and target.replica_acks == 0
    assert target.node_url("10.0.0.3", 7002) == "redis://:pw@10.0.0.3:7002"
    assert target.display == "rediscluster://10.0.0.1:7000,10.0.0.2:7001 (ns=c)"
    assert parse_redis_url("rediscluster://h:7000?ns=c").seeds == (("h", 7000),)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h:26379?ns=a", "names no Sentinel service"),
        ("redis+sentinel://h:26379/m?sentinel_pasword=x", "unknown Sentinel option 'sentinel_pasword'"),
        ("redis+sentinel://h:26379/m?sentinel_ssl=maybe", "invalid sentinel_ssl='maybe'"),
        ("redis+sentinel://h:26379/m?db=x", "invalid database"),
        ("redis+sentinel://h:port/m", "invalid port"),
        ("redis://h1:6379,h2:6379/0", "names several hosts"),
        ("redis://h/0?replica_acks=most", "invalid replica_acks"),
    ],
)
def test_bad_ha_urls(url: str, message: str) -> None:
    with pytest.raises(LeaseError, match=message):
        parse_redis_url(url)


def test_a_bad_sentinel_url_is_one_line_and_exit_2() -> None:
    result = run_tool("--redis", "redis+sentinel://127.0.0.1:1?ns=a", "--port", str(free_port()))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "names no Sentinel service" in result.stderr


# -- the replica count a write waits for -----------------------------------------------------------
@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica, streaming."""
    master = start_redis(tmp_path / "master", *FAST)
    replica = start_redis(tmp_path / "replica", *FAST, "--replicaof", "127.0.0.1", str(master.port))
    try:
        wait_until(lambda: master.client().execute_command("WAIT", 1, 100) == 1, timeout=15, step=0)
        yield master, replica
    finally:
        replica.stop()
        master.stop()


def expected(server: RedisServer) -> int:
    return int(server.client().eval(REPLICAS_LUA, len(KEYS), *KEYS))


def test_a_replica_that_vanishes_is_still_waited_for(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair
    assert expected(master) == 1  # no pool yet: what is connected, recorded nowhere
    init_pool(master.url, "t", 1, 4)
    assert expected(master) == 1 and master.client().hget(KEYS[5], "replicas") == b"1"
    replica.client().config_set("masterauth", "cut-off")  # it cannot come back
    master.client().client_kill_filter(_type="replica")
    wait_until(lambda: master.client().info("replication")["connected_slaves"] == 0, timeout=5)
    assert expected(master) == 1  # never fewer because one vanished
    summary = json.loads(run_tool("lease", "stats", "--redis", f"{master.url}?ns=t").stdout)
    assert summary["replicas_expected"] == 1 and summary["replicas_connected"] == 0


def test_a_promoted_replica_counts_its_own(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair
    init_pool(master.url, "t", 1, 4)
    assert expected(master) == 1
    wait_until(lambda: replica.client().hget(KEYS[5], "replicas") == b"1", timeout=5)
    replica.client().execute_command("REPLICAOF", "NO", "ONE")  # a failover: a new master_replid
    assert expected(replica) == 0


def test_every_lease_write_counts_the_replicas_in_its_own_run(pair: tuple[RedisServer, RedisServer]) -> None:
    """A counted script returns {count, its reply}: the count read after its write, recorded; a write on a
    connection that wrote before trusts a record under this master's replication id, a connection's
    first write compares the whole identity (a restart that kept the replication id starts afresh)."""
    master, _ = pair
    init_pool(master.url, "t", 1, 4)
    client = master.client()
    write = counted(lua_parts.NOW + lua_parts.HELPERS + "redis.call('HINCRBY', KEYS[5], 'w', 1)\nreturn {7}\n")
    assert client.eval(write, len(KEYS), *KEYS, "0") == [1, [7]]
    assert client.hget(KEYS[4], "w") == b"1" and client.hget(KEYS[5], "replicas") == b"1"
    replid = client.info("replication")["master_replid"]
    client.hset(KEYS[5], mapping={"replicas_under": f"another-run/{replid}", "replicas": 3})
    assert client.eval(write, len(KEYS), *KEYS, "0") == [3, [7]]  # never fewer than recorded
    assert client.eval(write, len(KEYS), *KEYS, "1") == [1, [7]]  # another process: its own count
    assert client.hget(KEYS[5], "replicas_under").decode().endswith(replid)
    assert client.hget(KEYS[5], "replicas") == b"1"


@pytest.mark.once
def test_a_master_short_of_min_replicas_to_write_says_so(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A master whose ``min-replicas-to-write`` is not met refuses every write (NOREPLICAS): it is up and
    answering, so the daemon says that it refuses writes and why (not that it is unreachable), and waits
    for its lease (an acquire) or fails the renew, as for any write that did not happen."""
    master = start_redis(tmp_path / "master")
    try:
        init_pool(master.url, "t", 1, 2)
        master.client().config_set("min-replicas-to-write", 1)  # and no replica
        d = daemons.start(*lease_args(master.url, "t"), worker_id=None)
        said = "refuses writes: fewer replicas than min-replicas-to-write are connected (NOREPLICAS"
        where = parse_redis_url(f"{master.url}?ns=t").display
        wait_until(lambda: f"Redis at {where} {said}" in d.stderr(), timeout=15)
        reply = get(d)
        assert isinstance(reply, bytes) and reply.startswith(b"SERVER_ERROR") and said.encode() in reply, reply
        assert stats(d)["lease_state"] == "connecting"  # as before: no lease write has got through yet
        assert "unreachable" not in d.stderr()
        # Met again: the waiting acquire goes through. Then not met while it holds the id: the renew fails.
        master.client().config_set("min-replicas-to-write", 0)
        wait_serving(d)
        master.client().config_set("min-replicas-to-write", 1)
        renew = re.compile(rf"renewing worker id \d+ failed: {re.escape(f'Redis at {where} {said}')}")
        wait_until(lambda: renew.search(d.stderr()), timeout=15)
        assert "unreachable" not in d.stderr()
    finally:
        master.stop()


# -- two masters at once ---------------------------------------------------------------------------
def lease_daemon(daemons: DaemonFactory, server: RedisServer, max_worker_id: int) -> Daemon:
    """A daemon leasing from ``server`` (namespace t, ids 1..max_worker_id) with short leases (ttl 3 s,
    renewed every second) and a tight clock check: what the two-masters tests run on either side."""
    timings = ("--lease-ttl", "3s", "--lease-renew", "1s", "--lease-delay", "2s")
    skew = ("--clock-skew-max", "0.5s", "--clock-skew-warn", "0.5s")
    ids = ("--min-worker-id", "1", "--max-worker-id", str(max_worker_id))
    url = f"{server.url}?ns=t&allow=no-min-replicas"  # these measure the every-replica fallback rule
    return daemons.start("--redis", url, *timings, *skew, *ids, worker_id=None)


def first_holder(daemons: DaemonFactory, master: RedisServer, max_worker_id: int, replicas: str) -> Daemon:
    """The pool made on ``master`` and a daemon serving from it, which counted ``replicas`` replicas."""
    init_pool(master.url, "t", 1, max_worker_id)
    holder = lease_daemon(daemons, master, max_worker_id)
    wait_serving(holder)
    assert stats(holder)["lease_replicas_expected"] == replicas
    return holder


def partition(master: RedisServer, replica: RedisServer) -> float:
    """The replica stops hearing from the old master and is promoted (as Sentinel does on the other side
    of a partition); the old master keeps running. Returns the moment of the split (monotonic)."""
    replica.client().config_set("masterauth", "cut-off")
    master.client().client_kill_filter(_type="replica")
    replica.client().execute_command("REPLICAOF", "NO", "ONE")
    return time.monotonic()


@pytest.mark.once
def test_two_masters_at_once(daemons: DaemonFactory, pair: tuple[RedisServer, RedisServer]) -> None:
    """The old master is cut off from its replica, which is promoted (as Sentinel does on the other
    side of a partition): one daemon keeps talking to the old master, a second starts there, a third
    starts on the new one. The old master still accepts writes, counts no replica and so, before,
    waited for none: its daemons went on issuing while the new master handed their ids out again.
    Now no write there counts: the holder stops at its deadline, the newcomer never serves."""
    master, replica = pair
    old_side = first_holder(daemons, master, 2, replicas="1")
    recorder = Recorder([old_side]).start()
    try:
        time.sleep(1)
        split = partition(master, replica)
        late = lease_daemon(daemons, master, 2)
        recorder.add(late)
        new_side = lease_daemon(daemons, replica, 2)
        recorder.add(new_side)
        # The new side serves once what is in doubt has certainly stopped.
        wait_until(lambda: len(recorder.served(2, split)) > 0, timeout=30, step=0.1)
        time.sleep(2)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert "acquire not acknowledged by the replicas" in late.stderr()
    assert recorder.overlapping_holders() == []
    old_last = recorder.served(0)[-1].received - split
    print(
        f"two masters at once: {recorder.summary()}; the old side's holder served until {old_last:.1f} s after"
        f" the split, the newcomer there never; the new side from {recorder.served(2)[0].received - split:.1f} s"
    )
    assert old_last <= 3.0  # its deadline: the last renew the replica acknowledged, plus the ttl minus margin
    assert not recorder.served(1)  # a daemon that comes to the old master knows the replica count from the pool
    assert "replicas acknowledged it" in old_side.stderr()
    assert stats(late)["lease_replicas_expected"] == "1"


# -- a replica that joined seconds before the partition -----------------------------------------------
@pytest.mark.once
@pytest.mark.parametrize("guard", ["counted", "min-replicas-to-write"])
def test_two_masters_seconds_after_a_replica_joined(daemons: DaemonFactory, tmp_path: Path, guard: str) -> None:
    """A master started without replicas, a daemon holding the pool's one id on it; a replica joins, and
    seconds later (well inside the minute the daemons once took to count a master's replicas again) the
    master is cut off from it and it is promoted; a daemon on the promoted side leases the same id.

    ``counted``: the holder renews (every second) after the replica joined and before the cut, and that
    renew counts the replica in its own script: from then on no write on the old master counts without
    it, and the holder stops at its deadline. Before, the holder had counted 0 replicas at its start and
    would not ask again for a minute: it went on issuing beside the new side's holder (duplicates).
    ``min-replicas-to-write``: the residual case, the cut right after the replica synced (no lease
    write need have seen it), closed by Redis's own ``min-replicas-to-write 1`` on the master: it
    refuses the writes at once."""
    master = start_redis(tmp_path / "master", *FAST)
    replica: RedisServer | None = None
    try:
        old_side = first_holder(daemons, master, 1, replicas="0")
        recorder = Recorder([old_side]).start()
        try:
            replica = start_redis(tmp_path / "replica", *FAST, "--replicaof", "127.0.0.1", str(master.port))
            wait_until(lambda: master.client().execute_command("WAIT", 1, 100) == 1, timeout=15, step=0)
            joined = time.monotonic()
            if guard == "counted":
                time.sleep(2.2)  # two renews of the holder
            else:
                master.client().config_set("min-replicas-to-write", 1)
            split = partition(master, replica)
            new_side = lease_daemon(daemons, replica, 1)
            recorder.add(new_side)
            wait_until(lambda: len(recorder.served(1, split)) > 0, timeout=40, step=0.1)
            time.sleep(2)  # both sides under load
        finally:
            recorder.stop()
        old_last = recorder.served(0)[-1].received - split
        print(
            f"a replica joined, cut off {split - joined:.1f} s later ({guard}): {recorder.summary()}; the old"
            f" side's holder served until {old_last:+.1f} s after the cut, the new side from"
            f" {recorder.served(1)[0].received - split:.1f} s"
        )
        assert recorder.duplicates() == 0, recorder.summary()
        assert recorder.overlapping_holders() == [], recorder.summary()
        assert old_last <= 3.0  # its deadline: the last renew the replica acknowledged, plus the ttl
        if guard == "counted":
            assert "replicas acknowledged it" in old_side.stderr()
        else:
            assert "NOREPLICAS" in old_side.stderr()
    finally:
        if replica is not None:
            replica.stop()
        master.stop()

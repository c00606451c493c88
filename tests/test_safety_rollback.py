"""Never a duplicate when Redis's data is rolled back in place (issue 32), shown with real processes: a
redis-server whose data set is replaced by an older one without a restart, so ``run_id`` and
``master_replid`` stay the same and no identity check sees it (``DEBUG RELOAD NOSAVE`` after the older
``dump.rdb`` is put back; ``FLUSHALL`` then ``RESTORE`` of the pool's keys DUMPed earlier), leasing
daemons as subprocesses under steady GET load, every ID recorded and checked together. The figure is
the duplicate count: 0.

Default lease timings (ttl 30 s, renew 10 s, clock skew max 5 s): the overlap the unfixed code had is
up to a renew interval, and every holder renews within one, so recording for a renew interval and a
bit after the rollback covers it. The doubt window it opens (40 s) is not waited out here: what
matters is that nobody serves an id twice meanwhile.

The pool is ids 1..3: A holds 1 from before the snapshot, B and C lease 2 and 3 after it, so in the
rolled-back data 2 and 3 look free (released, clean) while B and C serve under them. Holders only: the
first of B and C to renew finds its owner entry gone, and the unfixed code leased again at once, taking
the other's id. With a joiner: a daemon that starts after the rollback took 2 at once. The rollback is
made right after B renewed, so that B serves for most of a renew interval before it can notice.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, DaemonFactory, free_port
from id_recorder import Recorder
from lease_helpers import init_pool, run_tool, stats, wait_serving, wait_until
from redis_servers import RedisServer, redis_binary, start_redis

RENEW_DEFAULT = 10.0
KEYS = ("ids", "owners", "last_ms", "released", "stats", "pool")

pytestmark = pytest.mark.once


def redis_7() -> bool:
    """Whether the redis-server the tests run is 7 or later (sharded pub/sub; DEBUG off by default)."""
    version = subprocess.run([redis_binary(), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\d+)", version)
    return found is not None and int(found.group(1)) >= 7


def debug_args() -> tuple[str, ...]:
    """Redis 7 refuses DEBUG unless it is enabled; Redis 6 has no such setting."""
    return ("--enable-debug-command", "local") if redis_7() else ()


@pytest.fixture
def rdb_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "rollback-redis", *debug_args())
    try:
        yield server
    finally:
        server.stop()


def start(daemons: DaemonFactory, url: str, *more: str, wait: bool = True) -> Daemon:
    """A leasing daemon with the default lease timings on ids 1..3."""
    args = ("--redis", f"{url}?ns=t", "--min-worker-id", "1", "--max-worker-id", "3", *more)
    d = daemons.start(*args, worker_id=None, wait=wait)  # type: ignore[arg-type]
    if wait:
        wait_serving(d)
    return d


def just_renewed(server: RedisServer, worker_id: int) -> None:
    """Return right after the holder of ``worker_id`` renewed (its expiry score moved)."""
    client = server.client()
    before = client.zscore("{t}:ids", worker_id)
    wait_until(lambda: client.zscore("{t}:ids", worker_id) != before, timeout=RENEW_DEFAULT + 5, step=0.002)


def reload_older(server: RedisServer, old: Path) -> None:
    """Rollback in place: the older RDB put back as the server's own, loaded without saving first."""
    shutil.copyfile(old, server.workdir / "dump.rdb")
    server.client().execute_command("DEBUG", "RELOAD", "NOSAVE")


def restore_dumped(server: RedisServer, dumped: dict[str, bytes]) -> None:
    """Rollback in place: everything flushed, then the pool's keys RESTOREd from an earlier DUMP."""
    client = server.client()
    client.flushall()
    pipe = client.pipeline(transaction=False)
    for key, value in dumped.items():
        pipe.restore(key, 0, value, replace=True)
    pipe.execute()


def identity(server: RedisServer) -> tuple[str, str]:
    client = server.client()
    return str(client.info("server")["run_id"]), str(client.info("replication")["master_replid"])


def pool_counters(server: RedisServer) -> dict[str, object]:
    result = run_tool("lease", "stats", "--redis", f"{server.url}?ns=t")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def run_rollback(daemons: DaemonFactory, server: RedisServer, how: str, joiner: bool) -> None:
    init_pool(server.url, low=1, high=3)
    a = start(daemons, server.url)
    assert stats(a)["worker_id"] == "1"
    client = server.client()
    dumped = {f"{{t}}:{k}": client.dump(f"{{t}}:{k}") for k in KEYS}
    old = server.snapshot("old.rdb")
    http_port = free_port()  # B's metrics
    b = start(daemons, server.url, "--http-port", str(http_port))
    c = start(daemons, server.url)
    assert (stats(b)["worker_id"], stats(c)["worker_id"]) == ("2", "3")
    recorder = Recorder([a, b, c]).start()
    everyone = [a, b, c]
    before = identity(server)
    try:
        time.sleep(0.5)
        just_renewed(server, 2)
        rolled_at = time.monotonic()
        if how == "reload":
            reload_older(server, old)
        else:
            restore_dumped(server, {k: v for k, v in dumped.items() if v is not None})
        assert identity(server) == before  # nothing an identity check could see
        if joiner:
            j = start(daemons, server.url, wait=False)
            everyone.append(j)
            recorder.add(j)
        # Every holder renews within a renew interval: each of B and C has found its loss by then.
        time.sleep(RENEW_DEFAULT + 2)
    finally:
        recorder.stop()
    print(f"rollback in place ({how}, joiner: {joiner}): {recorder.summary()}")
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    logs = "".join(d.stderr() for d in everyone)
    assert "DATA LOSS" in logs
    lost = sum(int(stats(d)["lease_lost_writes"]) for d in everyone)
    assert lost >= 1
    pool = pool_counters(server)
    assert pool["lost_writes_seen"] >= 1
    # Lost writes are not a restart: nobody says Redis restarted, nor that a lease was kept through
    # one; the pool tells them apart (the window's lost-writes stamp, no restart stamp).
    assert "restarted or failed over" not in logs, logs
    assert "kept through" not in logs, logs
    assert pool["last_lost_writes_ms"] and not pool["last_change_ms"], pool
    # B found its own acquire undone (its owner entry gone under a live lease): logged and counted.
    assert "DATA LOSS" in b.stderr() and int(stats(b)["lease_lost_writes"]) >= 1
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    found = re.search(r"^katsubushi_lease_lost_writes_total (\S+)$", metrics, re.M)
    assert found is not None and float(found.group(1)) >= 1, metrics
    # Nobody but A (whose record predates the snapshot) served under a lost id after its holder found
    # the loss: the doubt window bars every new lease, the holder's own next one included.
    for d in range(1, len(everyone)):
        late = [r for r in recorder.served(d, rolled_at + RENEW_DEFAULT + 1)]
        assert not late, f"daemon {d} served during the doubt window"


def test_reload_of_an_older_rdb_with_holders_only(daemons: DaemonFactory, rdb_redis: RedisServer) -> None:
    run_rollback(daemons, rdb_redis, "reload", joiner=False)


def test_reload_of_an_older_rdb_with_a_daemon_joining(daemons: DaemonFactory, rdb_redis: RedisServer) -> None:
    run_rollback(daemons, rdb_redis, "reload", joiner=True)


def test_flushall_and_restore_with_a_daemon_joining(daemons: DaemonFactory, rdb_redis: RedisServer) -> None:
    run_rollback(daemons, rdb_redis, "restore", joiner=True)


def test_flushall_and_restore_with_holders_only(daemons: DaemonFactory, rdb_redis: RedisServer) -> None:
    run_rollback(daemons, rdb_redis, "restore", joiner=False)


def test_a_dropped_holder_subscription_comes_back_and_the_lease_is_renewed_at_once(
    daemons: DaemonFactory, rdb_redis: RedisServer
) -> None:
    """Redis drops the holder channel's connection (``CLIENT KILL TYPE pubsub``, as a network blip
    would): the holder subscribes again and renews at once, not at its next renew (up to 10 s), so it is
    off its channel, where an acquire after a rollback would not see it, for a round trip or two."""
    init_pool(rdb_redis.url, low=1, high=3)
    d = start(daemons, rdb_redis.url)
    worker = stats(d)["worker_id"]
    client = rdb_redis.client()
    channel = f"{{t}}:holder:{worker}"

    def subscribers() -> int:
        counts = client.execute_command("PUBSUB", "NUMSUB", channel)
        shard = client.execute_command("PUBSUB", "SHARDNUMSUB", channel) if redis_7() else [channel, 0]
        return int(counts[1]) + int(shard[1])

    wait_until(lambda: subscribers() == 1, timeout=5)
    time.sleep(0.5)
    renewals = int(stats(d)["lease_renewals"])
    killed_at = time.monotonic()
    assert client.client_kill_filter(_type="pubsub") >= 1
    wait_until(lambda: int(stats(d)["lease_renewals"]) > renewals, timeout=RENEW_DEFAULT - 2, step=0.01)
    renewed_after = time.monotonic() - killed_at
    assert subscribers() == 1
    print(f"holder channel subscription dropped: subscribed again and renewed {renewed_after:.3f} s later")
    assert renewed_after < 2.0
    assert "holder channel subscription dropped; renewing at once" in d.stderr()
    assert stats(d)["lease_state"] == "held"

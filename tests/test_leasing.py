"""Worker ids leased from real redis-server processes, with real daemons."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory, decode, free_port, wait_for_port
from lease_helpers import (
    DELAY,
    FAKETIME_LIB,
    RENEW,
    TTL,
    get,
    ids,
    init_pool,
    lease_score,
    run_tool,
    start_leased,
    stats,
    wait_serving,
    wait_until,
)
from redis_servers import RedisServer, redis_binary, start_redis

from katsubushi_py.leasing import parse_redis_url
from katsubushi_py.leasing.keeper import init_pool as keeper_init_pool


@pytest.mark.once  # twenty processes starting: the lease keeper's logic, whichever hot path serves
def test_two_then_twenty_daemons_get_distinct_worker_ids(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    # Twenty Python processes starting at once load a 2-core CI machine for seconds: longer timings
    # than the other tests' so that a renew delayed by that load does not fence a daemon mid-test.
    slow = ("--lease-ttl", "9s", "--lease-renew", "3s", "--lease-delay", "6s")
    first, second = (start_leased(daemons, redis_server.url, *slow) for _ in range(2))
    workers = {decode(ids(first)[0])[1], decode(ids(second)[0])[1]}
    assert workers == {1, 2}  # a fresh pool hands out the lowest ids first
    more = [start_leased(daemons, redis_server.url, *slow, wait=False) for _ in range(18)]
    for d in more:
        wait_for_port(d.port, d.proc, timeout=60)  # type: ignore[arg-type]
        wait_serving(d, timeout=60)
    every = [first, second, *more]
    worker_ids = [int(stats(d)["worker_id"]) for d in every]
    assert len(set(worker_ids)) == 20
    for d, wid in zip(every, worker_ids, strict=True):
        assert {decode(i)[1] for i in ids(d, 5)} == {wid}
        assert stats(d)["lease_state"] == "held"


def test_pool_of_three_with_four_daemons(daemons: DaemonFactory, redis_server: RedisServer, tmp_path: Path) -> None:
    small = ("--min-worker-id", "1", "--max-worker-id", "3")
    three = [start_leased(daemons, redis_server.url, *small) for _ in range(3)]
    assert sorted(int(stats(d)["worker_id"]) for d in three) == [1, 2, 3]
    # A fourth that may not wait says so and exits.
    impatient = start_leased(daemons, redis_server.url, *small, "--no-wait-for-lease", wait=False)
    assert impatient.proc.wait(20) == 1
    assert "no free worker id in 1..3" in impatient.stderr()
    # A fourth that waits listens meanwhile, and says why it cannot serve.
    fourth = start_leased(daemons, redis_server.url, *small, wait=False)
    wait_for_port(fourth.port, fourth.proc)  # type: ignore[arg-type]
    wait_until(lambda: stats(fourth)["lease_state"] == "waiting", timeout=10)
    assert get(fourth) == b"SERVER_ERROR waiting for a worker id lease: no free worker id in 1..3\r\n"
    assert "no free worker id" in fourth.stderr()
    # One more waiting daemon stops promptly and cleanly on SIGTERM.
    fifth = start_leased(daemons, redis_server.url, *small, wait=False)
    wait_until(lambda: "no free worker id" in fifth.stderr(), timeout=10)
    started = time.monotonic()
    assert fifth.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 2.0
    assert "Traceback" not in fifth.stderr() and "Unclosed" not in fifth.stderr()
    freed = int(stats(three[1])["worker_id"])
    last_before = max(ids(three[1], 10))
    assert three[1].stop() == 0  # a clean stop releases its id
    wait_serving(fourth, timeout=20)
    assert int(stats(fourth)["worker_id"]) == freed
    assert min(ids(fourth, 10)) > last_before


def test_clean_shutdown_releases_the_id_for_immediate_reuse(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    one = ("--min-worker-id", "5", "--max-worker-id", "5")
    first = start_leased(daemons, redis_server.url, *one)
    issued = ids(first, 100)
    assert first.stop() == 0
    client = redis_server.client()
    assert client.hget("{t}:owners", 5) is None
    seconds, micros = client.time()
    assert lease_score(redis_server, "t", 5) <= seconds * 1000 + micros // 1000  # free
    assert int(client.hget("{t}:last_ms", 5)) >= decode(max(issued))[0]
    started = time.monotonic()
    second = start_leased(daemons, redis_server.url, *one)
    assert time.monotonic() - started < DELAY  # released cleanly: no delay
    assert min(ids(second, 10)) > max(issued)
    assert "released worker id 5" in first.stderr()


def test_a_daemon_that_issued_nothing_releases_cleanly_too(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    """Its renews reserved a mark a ttl ahead; the release replaces it with what it really issued
    (nothing), so the next daemon takes the id at once instead of finding a mark later than the
    release (a damaged-looking record, quarantined for ttl + 2 x skew)."""
    one = ("--min-worker-id", "6", "--max-worker-id", "6")
    idle = start_leased(daemons, redis_server.url, *one)
    wait_until(lambda: int(stats(idle)["lease_renewals"]) >= 2, timeout=10)
    assert idle.stop() == 0
    assert int(redis_server.client().hget("{t}:last_ms", 6)) == 0
    started = time.monotonic()
    second = start_leased(daemons, redis_server.url, *one)
    assert time.monotonic() - started < DELAY
    assert {decode(i)[1] for i in ids(second, 5)} == {6}
    assert "DATA LOSS" not in second.stderr()


def test_killed_daemon_frees_its_id_after_expiry_and_a_quarantine(
    daemons: DaemonFactory, redis_server: RedisServer
) -> None:
    """A holder killed (no release): its lease expires, and an id that was never released is not free
    (its holder may be alive: paused, cut off, its record damaged): the next daemon quarantines it for
    ttl + 2 x skew, then leases it and issues greater IDs."""
    one = ("--min-worker-id", "9", "--max-worker-id", "9", "--clock-skew-max", "1s")
    first = start_leased(daemons, redis_server.url, *one)
    issued = []
    for _ in range(20):
        issued += ids(first, 50)
    first.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    second = start_leased(daemons, redis_server.url, *one, wait=False)
    wait_for_port(second.port, second.proc, timeout=30)  # type: ignore[arg-type]
    wait_serving(second, timeout=30)
    # It could only quarantine the id once the lease expired, and then waited out the quarantine.
    assert time.monotonic() - killed_at >= TTL - 1.0 + TTL + 2 * 1.0
    later = ids(second, 50)
    assert {decode(i)[1] for i in later} == {9}
    assert min(later) > max(issued)
    assert "worker id 9's lease in" in second.stderr() and "ended without a release" in second.stderr()
    assert stats(second)["lease_quarantined_ids"] == "1" and stats(second)["lease_data_loss_events"] == "0"


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed (apt-get install faketime)")
def test_next_holder_with_a_slow_clock_still_issues_greater_ids(
    daemons: DaemonFactory, redis_server: RedisServer
) -> None:
    """The previous holder's last millisecond is handed over: a successor whose clock is 4 s behind
    waits, fenced and saying why, until its clock passes it (it does not claim to serve and answer
    ``clock moved backwards``), and never issues a smaller ID."""
    one = ("--min-worker-id", "3", "--max-worker-id", "3")
    first = start_leased(daemons, redis_server.url, *one)
    issued = ids(first, 100)
    assert first.stop() == 0
    slow = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "-4"}
    second = start_leased(daemons, redis_server.url, *one, env=slow, wait=False)
    wait_for_port(second.port, second.proc)  # type: ignore[arg-type]
    wait_until(lambda: stats(second)["lease_state"] == "delay", timeout=10)
    reply = get(second)
    assert isinstance(reply, bytes) and reply.startswith(
        b"SERVER_ERROR worker id lease not confirmed: waiting for this host's clock to pass the handover mark"
    ), reply
    wait_serving(second, timeout=10)
    assert min(ids(second, 10)) > max(issued)
    log = second.stderr()
    assert "s for this host's clock to pass the handover mark before serving" in log
    assert log.index("leased worker id 3") < log.index("serving worker id 3")


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed (apt-get install faketime)")
def test_clock_far_from_redis_time_is_refused(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    skewed = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "+30"}
    d = start_leased(daemons, redis_server.url, env=skewed, wait=False)
    assert d.proc.wait(20) == 1
    assert re.search(r"differs from Redis TIME by \+(29\.9|30\.0)", d.stderr()), d.stderr()


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed (apt-get install faketime)")
def test_clock_somewhat_off_redis_time_is_a_warning(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    ahead = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "+2"}
    d = start_leased(daemons, redis_server.url, env=ahead)
    assert ids(d)
    assert re.search(r"WARNING local clock differs from Redis TIME by \+(1\.9|2\.0)", d.stderr()), d.stderr()


def test_redis_unreachable_fences_before_expiry_and_resumes(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    d = start_leased(daemons, redis_server.url)
    worker = int(stats(d)["worker_id"])
    assert ids(d)
    time.sleep(RENEW * 1.5)
    client = redis_server.client()
    expiry_ms = lease_score(redis_server, "t", worker)
    redis_server.pause()
    try:
        issued: list[int] = []
        first_error_at = None
        deadline = time.monotonic() + TTL + 2
        while time.monotonic() < deadline:
            reply = get(d)
            if isinstance(reply, bytes):
                assert reply == b"SERVER_ERROR worker id lease not confirmed\r\n"
                first_error_at = time.time() * 1000
                break
            issued += reply
            time.sleep(0.02)
        assert first_error_at is not None, "the daemon kept issuing while Redis was unreachable"
        # Every ID was issued before the lease as last seen in Redis could expire; it stopped before that.
        assert expiry_ms is not None
        assert all(decode(i)[0] < expiry_ms for i in issued)
        assert first_error_at < expiry_ms
        assert stats(d)["lease_state"] == "unconfirmed"
    finally:
        redis_server.resume()
    resumed = wait_until(lambda: (r := get(d)) and isinstance(r, list) and r, timeout=10)
    assert decode(resumed[0])[1] == worker
    assert int(stats(d)["lease_renew_failures"]) >= 1
    assert int(client.hget("{t}:stats", "renew_after_expiry") or 0) >= 0


def test_overwritten_owner_token_stops_issuing_and_moves_to_a_new_id(
    daemons: DaemonFactory, redis_server: RedisServer
) -> None:
    d = start_leased(daemons, redis_server.url)
    old = int(stats(d)["worker_id"])
    before = ids(d, 10)
    redis_server.client().hset("{t}:owners", old, "intruder")
    changed_at = time.monotonic()
    last_old_at = changed_at
    replies: list[list[int] | bytes] = []
    while time.monotonic() - changed_at < RENEW + 3:
        reply = get(d)
        replies.append(reply)
        if isinstance(reply, list):
            if decode(reply[0])[1] == old:
                last_old_at = time.monotonic()
            else:
                break
        else:  # fenced at once, then leasing a new id
            assert reply.startswith(
                (b"SERVER_ERROR worker id lease not confirmed", b"SERVER_ERROR waiting for a worker id")
            ), reply
        time.sleep(0.005)
    # The daemon noticed at its next renew, stopped issuing under the old id, and moved to another:
    # after the doubt window, as an id taken over under a lease that never lapsed is lost writes (issue
    # 32: a hand edit cannot be told from a rollback of Redis's data in place).
    assert last_old_at - changed_at <= RENEW + 0.5
    wait_serving(d, timeout=40)
    after = ids(d, 5)
    new = decode(after[0])[1]
    assert new != old and {decode(i)[1] for i in after} == {new}
    assert min(after) > max(before)
    fields = stats(d)
    assert fields["worker_id"] == str(new) and fields["worker_id_changes"] == "1"
    assert redis_server.client().hget("{t}:owners", old) == b"intruder"
    assert f"DATA LOSS: worker id {old} is leased to another daemon" in d.stderr()
    assert fields["lease_lost_writes"] == "1"


def test_the_replica_is_waited_for(daemons: DaemonFactory, redis_server: RedisServer, tmp_path: Path) -> None:
    replica = start_redis(tmp_path / "replica", "--replicaof", "127.0.0.1", str(redis_server.port))
    try:
        wait_until(lambda: redis_server.client().execute_command("WAIT", 1, 100) == 1, timeout=15, step=0)
        redis_server.client().config_set("min-replicas-to-write", 1)  # required beside a replica (issue 32)
        d = start_leased(daemons, redis_server.url)
        assert stats(d)["lease_replicas_expected"] == "1"
        assert ids(d)
        time.sleep(RENEW * 1.5)
        assert ids(d)  # renewals acknowledged by the replica
        replica.pause()  # still connected, but it acknowledges nothing
        saw = wait_until(lambda: (r := get(d)) and isinstance(r, bytes) and r, timeout=TTL + 3)
        assert saw == b"SERVER_ERROR worker id lease not confirmed\r\n"
        # (The line may follow the first refusal by a moment on a loaded machine.)
        assert wait_until(lambda: "replicas acknowledged" in d.stderr(), timeout=10), d.stderr()
        replica.resume()
        assert wait_until(lambda: (r := get(d)) and isinstance(r, list) and r, timeout=10)
    finally:
        replica.stop()


def test_three_node_redis_cluster(daemons: DaemonFactory, tmp_path: Path) -> None:
    nodes = [
        start_redis(
            tmp_path / f"node{i}",
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(tmp_path / f"node{i}" / "nodes.conf"),
            "--cluster-node-timeout",
            "2000",
        )
        for i in range(3)
    ]
    try:
        created = subprocess.run(
            [
                redis_binary("redis-cli"),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in nodes),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert created.returncode == 0, created.stdout + created.stderr
        wait_until(lambda: all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes), timeout=20)
        url = f"rediscluster://127.0.0.1:{nodes[0].port}"
        init_pool(url, "clu")
        a = daemons.start("--redis", f"{url}?ns=clu", "--lease-ttl", "3s", worker_id=None)
        b = daemons.start("--redis", f"{url}?ns=clu", "--lease-ttl", "3s", worker_id=None)
        wait_serving(a)
        wait_serving(b)
        wa, wb = int(stats(a)["worker_id"]), int(stats(b)["worker_id"])
        assert {wa, wb} == {1, 2}
        assert {decode(i)[1] for i in ids(a, 5)} == {wa}
        # The namespace's keys live in one slot on one node.
        holders = [
            n for n in nodes if n.client().cluster("countkeysinslot", n.client().cluster("keyslot", "{clu}:ids"))
        ]
        assert len(holders) == 1
        assert a.stop() == 0
    finally:
        for n in nodes:
            n.stop()


def test_lease_tools(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    url = f"{redis_server.url}?ns=tools"
    first = run_tool("lease", "init", "--redis", url, "--min", "1", "--max", "10")
    assert first.returncode == 0, first.stderr
    assert "created" in first.stdout and "10" in first.stdout
    fresh = json.loads(run_tool("lease", "stats", "--redis", url).stdout)
    assert fresh["pool_mark_hw_ms"] == 0 and fresh["pool_mark_ahead_ms"] == 0  # nothing issued yet
    again = run_tool("lease", "init", "--redis", url, "--min", "1", "--max", "10")
    assert again.returncode == 0 and "already exists" in again.stdout
    d = daemons.start("--redis", url, "--lease-ttl", "3s", worker_id=None)
    wait_serving(d)
    issued = ids(d, 3)
    time.sleep(RENEW * 1.5)
    summary = json.loads(run_tool("lease", "stats", "--redis", url).stdout)
    assert summary["ids_in_use"] == 1 and summary["ids_free"] == 9
    assert summary["acquire_success"] == 1 and summary["renew_success"] >= 1
    assert 0 < summary["lease_ttl_left_ms_max"] <= 3000
    rows = [json.loads(line) for line in run_tool("lease", "list", "--redis", url).stdout.splitlines()]
    assert [r["worker_id"] for r in rows] == list(range(1, 11))
    held = [r for r in rows if r["in_use"]]
    assert len(held) == 1 and held[0]["worker_id"] == decode(issued[0])[1] and held[0]["owner"]
    assert [r["state"] for r in rows].count("held") == 1 and [r["state"] for r in rows].count("free") == 9
    assert summary["redis_identity"] == summary["pool_identity"] and not summary["redis_changed_unseen"]
    assert held[0]["last_ms"] >= decode(issued[-1])[0]
    # The pool's high-water mark: the holder's clock plus the ttl at its last renew (about a second ago).
    assert summary["pool_mark_hw_ms"] >= decode(issued[-1])[0]
    assert 0 < summary["pool_mark_ahead_ms"] <= 3000 + 200
    # A mark a minute ahead of Redis's clock (a daemon whose clock was that far ahead) shows as such.
    other = f"{redis_server.url}?ns=tools-hw"
    assert run_tool("lease", "init", "--redis", other, "--min", "1", "--max", "2").returncode == 0
    seconds, micros = redis_server.client().time()
    redis_server.client().hset("{tools-hw}:pool", "mark_hw_ms", seconds * 1000 + micros // 1000 + 60_000)
    ahead = json.loads(run_tool("lease", "stats", "--redis", other).stdout)["pool_mark_ahead_ms"]
    assert 55_000 < ahead <= 60_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--redis", "http://x"), "invalid scheme"),
        (("--redis", "redis://127.0.0.1:1/0", "--worker-id", "3"), "either --worker-id or --redis"),
        (("--redis", "redis://127.0.0.1:1/0", "--lease-ttl", "3s", "--lease-renew", "2s"), "unsafe"),
        (("--redis", "redis://127.0.0.1:1/0", "--lease-renew", "1s", "--lease-delay", "1s"), "at least twice"),
        (("--redis", "redis://127.0.0.1:1/0", "--min-worker-id", "9", "--max-worker-id", "3"), "greater than"),
        (("--redis", "redis://127.0.0.1:1/0", "--max-worker-id", "1024"), "invalid max worker id"),
        (("--redis", "rediscluster://127.0.0.1:1/2"), "cannot select a database"),
        (("--lease-ttl", "3s", "--worker-id", "1"), "needs --redis"),
    ],
)
def test_bad_lease_configuration(args: tuple[str, ...], message: str) -> None:
    result = run_tool(*args, "--port", str(free_port()))
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unreachable_redis_at_start_is_one_line_and_exit_2() -> None:
    """Exit 2: a Redis URL that led nowhere for the whole start timeout is a configuration to fix (the
    systemd unit restarts on anything but 2)."""
    port = free_port()
    result = run_tool(
        "--redis", f"redis://127.0.0.1:{port}/0", "--port", str(free_port()), "--lease-start-timeout", "1s"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("katsubushi-py: error: cannot lease a worker id from redis://127.0.0.1:")
    assert "Traceback" not in result.stderr


def test_katsubushi_redis_spellings_and_environment(daemons: DaemonFactory, redis_server: RedisServer) -> None:
    port = free_port()
    init_pool(redis_server.url, "env")
    d = daemons.start(
        worker_id=None,
        port=None,
        wait=False,
        env={
            "REDIS": f"{redis_server.url}?ns=env",
            "MIN_WORKER_ID": "7",
            "MAX_WORKER_ID": "8",
            "PORT": str(port),
            "WORKER_ID": "0",
        },
    )
    d.port = port
    wait_for_port(port, d.proc)
    wait_serving(d)
    assert int(stats(d)["worker_id"]) == 7
    e = daemons.start(
        "-redis", f"{redis_server.url}?ns=env", "-min-worker-id", "7", "-max-worker-id", "8", worker_id=None
    )
    wait_serving(e)
    assert int(stats(e)["worker_id"]) == 8


def test_unix_socket_redis_url(daemons: DaemonFactory, tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    server = start_redis(tmp_path / "unixredis", "--unixsocket", str(sock), "--unixsocketperm", "700")
    try:
        asyncio.run(keeper_init_pool(parse_redis_url(f"unix://{sock}?db=3&ns=u"), 1, 1023))
        d = daemons.start("--redis", f"unix://{sock}?db=3&ns=u", "--lease-ttl", "3s", worker_id=None)
        wait_serving(d)
        assert int(stats(d)["worker_id"]) == 1
        assert server.client().zcard("{u}:ids") == 0  # database 0 is untouched
        import redis

        direct = redis.Redis(unix_socket_path=str(sock), db=3)
        assert direct.zcard("{u}:ids") == 1023
    finally:
        server.stop()

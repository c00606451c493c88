"""Redis's own clock steps (issue 21): the Lua scripts read Redis's TIME, so a Redis whose wall clock
jumps makes live leases look expired (forward) or released ids look damaged (backward). Under steady
GET load, with Redis's clock stepped +5 s, back, -30 s and back (+30 s) while daemons hold, release
and wait for ids: no duplicate, no renewing holder loses its id, a released id goes to the daemon
waiting for one, the log names Redis's clock, and nothing is reported as data loss.

Redis's clock is moved by tests/clock_shim.c (an LD_PRELOAD shim offsetting only its wall clock;
libfaketime hangs Debian's redis-server 7.0 at start).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, decode
from id_recorder import Recorder
from lease_helpers import FAKETIME_LIB, RENEW, init_pool, start_leased, stats, wait_until
from redis_servers import ClockShim, RedisServer, start_redis

pytestmark = [
    pytest.mark.once,
    pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="needs a C compiler for the shim"),
]

# Daemons accept 5 s between their clock and Redis's at start; renew 1 s, ttl 3 s: a forward step of
# 5 s (more than ttl - renew) makes every lease look expired.
SKEW = ("--clock-skew-max", "5s", "--clock-skew-warn", "1s")
THREE = ("--min-worker-id", "1", "--max-worker-id", "3", *SKEW)


@pytest.fixture
def shifted_redis(tmp_path: Path) -> Iterator[tuple[RedisServer, ClockShim]]:
    shim = ClockShim.create(tmp_path)
    server = start_redis(tmp_path / "redis", env=shim.env)
    try:
        yield server, shim
    finally:
        server.stop()
        shim.close()


def test_redis_clock_steps_under_load(daemons: DaemonFactory, shifted_redis: tuple[RedisServer, ClockShim]) -> None:
    server, shim = shifted_redis
    init_pool(server.url, low=1, high=3)
    holders = [start_leased(daemons, server.url, *THREE, init=False) for _ in range(3)]
    waiting = [start_leased(daemons, server.url, *THREE, init=False, wait=False) for _ in range(2)]
    for d in waiting:
        wait_until(lambda d=d: "no free worker id" in d.stderr(), timeout=15)
    recorder = Recorder([*holders, *waiting]).start()
    steps = []
    try:
        time.sleep(RENEW)
        for offset, hold in ((+5, 2.5), (0, 2.5), (-30, 0.0)):
            shim.set(offset)
            steps.append(time.monotonic())
            time.sleep(hold)
        # While Redis is 30 s behind: a clean release goes to a waiting daemon, and promptly.
        released = int(stats(holders[0])["worker_id"])
        assert holders[0].stop() == 0
        stopped_at = time.monotonic()
        wait_until(lambda: any(stats(d)["lease_state"] == "held" for d in waiting), timeout=10)
        took = time.monotonic() - stopped_at
        time.sleep(1.5)
        shim.set(0)  # +30 s: every lease written meanwhile looks 30 s expired
        steps.append(time.monotonic())
        time.sleep(3)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    print(f"Redis clock +5, -5, -30, +30 s: {recorder.summary()}; released id taken after {took:.2f} s")
    # No renewing holder lost its id.
    for d in holders[1:]:
        fields = stats(d)
        assert fields["worker_id_changes"] == "0" and fields["lease_state"] == "held", fields
    # The released id went to one waiting daemon; the other still waits (it took no live lease).
    serving = [d for d in waiting if stats(d)["lease_state"] == "held"]
    assert len(serving) == 1 and stats(serving[0])["worker_id"] == str(released)
    assert {decode(i)[1] for r in recorder.served(3 + waiting.index(serving[0])) for i in r.ids} == {released}
    assert took < 3
    logs = {d.pid: d.stderr() for d in [*holders, *waiting]}
    assert not any("DATA LOSS" in log or "damaged" in log for log in logs.values()), logs
    assert all("Redis's clock" in logs[d.pid] for d in holders[1:]), logs
    assert sum(int(stats(d)["lease_redis_clock_steps"]) for d in holders[1:]) >= 2 * 4


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed (apt-get install faketime)")
def test_a_host_synced_to_a_redis_clock_that_was_off(
    daemons: DaemonFactory, shifted_redis: tuple[RedisServer, ClockShim]
) -> None:
    """Issue 23's clock gap (the lease simulation's seed 1015, here in its mirror image): Redis's clock
    is 8 s ahead, and so is a host whose NTP source is the Redis host: its daemon passes the clock check
    (--clock-skew-max 0.5 s) and issues IDs 8 s ahead of true time. It is killed; its record loses its
    handover mark and expiry (an edit, a bad restore); Redis's clock is put right; a daemon with a right
    clock finds the id never released, quarantines it and takes it. Bounded by Redis's clock and its
    own, it would issue below the first daemon's IDs (it did, before the pool's high-water mark); it
    must wait, fenced, until its clock passes what the first daemon may have issued. A daemon with a
    right clock, holding the other id meanwhile, reports the first's clock (STATS, a WARNING)."""
    server, shim = shifted_redis
    shim.set(8)
    init_pool(server.url, low=1, high=2)
    two = ("--min-worker-id", "1", "--max-worker-id", "2", "--clock-skew-max", "0.5s", "--clock-skew-warn", "0.25s")
    ahead = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "+8"}
    first = start_leased(daemons, server.url, *two, init=False, env=ahead)
    assert stats(first)["worker_id"] == "1"
    recorder = Recorder([first]).start()
    try:
        time.sleep(RENEW)
        shim.set(0)  # Redis's clock put right; the first daemon's IDs stay 8 s ahead
        # A daemon with a right clock, on id 2, sees the first's clock in the pool's high-water mark.
        witness = start_leased(daemons, server.url, *two, init=False)
        assert stats(witness)["worker_id"] == "2"
        wait_until(lambda: int(stats(witness)["lease_pool_mark_ahead_ms"]) > 7000, timeout=3 * RENEW)
        first.stop(signal.SIGKILL)
        client = server.client()
        client.zadd("{t}:ids", {"1": 0})
        client.hset("{t}:last_ms", "1", 0)
        lost_at = time.monotonic()
        second = start_leased(daemons, server.url, *two, init=False, wait=False)
        recorder.add(second)
        wait_until(lambda: recorder.served(1), timeout=40, step=0.1)
        time.sleep(1)
    finally:
        recorder.stop()
    assert recorder.duplicates() == 0, recorder.summary()
    before, after = recorder.served(0), recorder.served(1)
    assert before and after, recorder.summary()
    assert {decode(i)[1] for r in [*before, *after] for i in r.ids} == {1}
    first_ms, second_ms = max(max(r.ids) for r in before), min(min(r.ids) for r in after)
    assert second_ms > first_ms, f"{(first_ms - second_ms) >> 22} ms below: {recorder.summary()}"
    waited = after[0].received - lost_at
    print(f"host and Redis 8 s ahead, record lost, Redis put right: {recorder.summary()}; served after {waited:.2f} s")
    log = second.stderr()
    assert "ended without a release" in log and "for this host's clock to pass the handover mark" in log, log
    assert "holds a high-water mark 8." in witness.stderr() or "holds a high-water mark 7." in witness.stderr()

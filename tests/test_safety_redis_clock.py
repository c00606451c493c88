"""Redis's own clock steps (issue 21): the Lua scripts read Redis's TIME, so a Redis whose wall clock
jumps makes live leases look expired (forward) or released ids look damaged (backward). Under steady
GET load, with Redis's clock stepped +5 s, back, -30 s and back (+30 s) while daemons hold, release
and wait for ids: no duplicate, no renewing holder loses its id, a released id goes to the daemon
waiting for one, the log names Redis's clock, and nothing is reported as data loss.

Redis's clock is moved by tests/clock_shim.c (an LD_PRELOAD shim offsetting only its wall clock;
libfaketime hangs Debian's redis-server 7.0 at start).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, decode
from id_recorder import Recorder
from lease_helpers import RENEW, init_pool, start_leased, stats, wait_until
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

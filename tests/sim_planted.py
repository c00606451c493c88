"""Bugs planted on purpose in the production code, to show the leasing simulation (tests/sim_leasing.py)
finds them (tests/test_sim_leasing.py runs each on a seed that reaches it). A simulation that finds no
planted bug proves nothing by passing.

Each plant swaps one method of a production class for a broken one while the context is open, and puts
it back after: the production code itself is never edited.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing import link as link_module
from katsubushi_py.leasing.keeper import LeaseKeeper
from katsubushi_py.leasing.link import RedisLink
from katsubushi_py.leasing.scripts import REPLICAS_LUA


@contextlib.contextmanager
def planted_bug(name: str | None) -> Iterator[None]:
    """Break the production code on purpose, to show the simulation finds the break: ``no-fence`` (the
    generator ignores its lease deadline: a daemon paused or cut off past its lease keeps issuing),
    ``wall-clock-check`` (the start-up clock check reads the wall clock as it is now, not the generator's
    clock: the bug seed 1 found, fixed in keeper.check_clock), ``replicas-once-a-minute`` (the replica
    count asked once a minute, not by every lease write: the two-masters window, fixed in link.py)."""
    global _PLANTED
    if name is None:
        yield
        return
    if name not in PLANTED_BUGS:
        raise ValueError(f"no planted bug called {name!r}: {', '.join(PLANTED_BUGS)}")
    _PLANTED = name
    try:
        with _plant(name):
            yield
    finally:
        _PLANTED = None


_PLANTED: str | None = None


def planted_now() -> str | None:
    """The bug planted while this world runs (a run's Result records it, for the replay command)."""
    return _PLANTED


@contextlib.contextmanager
def _replaced(owner: type, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` is ``replacement`` while the context is open; the original is put back after."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _plant(name: str) -> contextlib.AbstractContextManager[None]:
    if name == "no-fence":
        original = Generator.set_fence

        def set_fence(self: Generator, deadline_ns: int | None, reason: str | None = None) -> None:
            original(self, None if deadline_ns else deadline_ns, reason)

        return _replaced(Generator, "set_fence", set_fence)
    if name == "wall-clock-check":
        check = LeaseKeeper.check_clock

        async def check_clock(self: LeaseKeeper) -> float:
            generator, self.generator = self.generator, None  # the keeper falls back on time.time()
            try:
                return await check(self)
            finally:
                self.generator = generator

        return _replaced(LeaseKeeper, "check_clock", check_clock)
    if name == "replicas-once-a-minute":
        return _replaced(RedisLink, "run", _run_counting_once_a_minute)
    raise ValueError(f"no planted bug called {name!r}: {', '.join(PLANTED_BUGS)}")


async def _run_counting_once_a_minute(
    self: RedisLink, script: str, args: list[Any], durable: bool = True
) -> tuple[list[Any], str, bool]:
    """``RedisLink.run`` before the two-masters window was closed (issue 23): the replica count asked
    (``REPLICAS_LUA``) on a new connection and then once a minute (3 ttl here, as the simulation had
    it), not by every lease write."""
    client = await self.connected()
    keys, wait_ms, now = self.keys.all, int(self.timings.renew * 250), link_module.time.monotonic()
    fixed = self.target.replica_acks
    asked = getattr(self, "_asked", -math.inf)
    refresh = durable and fixed is None and (self._replicas is None or now - asked >= 3 * self.timings.ttl)
    needed = fixed if fixed is not None else (self._replicas or 0)
    pipe = client.pipeline(transaction=False)
    pipe.eval(script, len(keys), *keys, *args)
    pipe.execute_command("CLIENT", "ID")
    if refresh:
        pipe.eval(REPLICAS_LUA, len(keys), *keys)
    elif durable and needed:
        pipe.execute_command("WAIT", needed, wait_ms)
    replies = await pipe.execute()
    self.stats.round_trips += 1
    result, connection = replies[0], int(replies[1])
    new_connection, self.connection_id = connection != self.connection_id, connection
    if not durable:
        return result, "", new_connection
    if refresh:
        needed = self._replicas = int(replies[2])
        self._asked = now  # type: ignore[attr-defined]
        if not needed:
            return result, "", new_connection
        acked = int(await client.execute_command("WAIT", needed, wait_ms))
    elif needed:
        acked = int(replies[2])
    else:
        return result, "", new_connection
    if acked < needed:
        self._replicas = None
        return result, f"only {acked} of {needed} replicas acknowledged it within {wait_ms} ms", new_connection
    return result, "", new_connection


PLANTED_BUGS = ("no-fence", "wall-clock-check", "replicas-once-a-minute")

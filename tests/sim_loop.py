"""The simulator's world clock and event loop: one asyncio loop whose time is virtual, processes whose
callbacks can be held back (a process paused), and per-host clocks that drift and step.

**Virtual time.** :class:`VirtualLoop` is asyncio's own selector loop with two changes: ``time()``
returns the simulation's true time, and its selector, instead of blocking for the time until the next
timer, moves true time forward by exactly that much. So ``asyncio.sleep``, ``wait_for`` and every timer
work unchanged, a simulated minute passes in microseconds, and a run is a pure function of its seed
(timers fire in a fixed order; nothing depends on the real clock). A loop with nothing ready and no
timer would block forever in a real process: here it is a :class:`Deadlock`.

**Processes.** Each simulated daemon runs its tasks in a :mod:`contextvars` context that names its
:class:`Process`. Every callback scheduled from that context (a task step, a timer, a future's done
callback) goes through a gate: while the process is paused it is held back until the pause ends (a
callback cancelled meanwhile stays cancelled), so a paused daemon runs no code at all, as under
SIGSTOP or a VM freeze, while the rest of the world (Redis, the other daemons) goes on. The Redis side
schedules its callbacks from a root context, which is never paused.

**Host clocks.** :class:`HostClock` gives a host a monotonic clock (true time at the host's rate) and a
wall clock (the same rate, plus an offset that steps). It is the generator's ``Clock`` and, through
:data:`SIM_TIME`, what the leasing modules read as ``time.monotonic()``/``time.time()`` while they run
for that host's process (the simulator installs it as those modules' ``time``; see sim_world.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The simulated process whose code is running (None: the world itself, Redis, the driver).
PROCESS: contextvars.ContextVar[Any] = contextvars.ContextVar("sim_process", default=None)


class Deadlock(RuntimeError):
    """Nothing ready and no timer: in a real process, a hang."""


class _AdvancingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls the loop's own self-pipe without blocking, and moves virtual time instead of waiting."""

    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Deadlock("no callback ready and no timer scheduled")
        if timeout > 0:
            self._loop.now += timeout
        return super().select(0)


class VirtualLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop on virtual time, with processes that can be paused."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        super().__init__(selector=_AdvancingSelector(self))
        self.set_exception_handler(self._exception)
        self.errors: list[str] = []

    def time(self) -> float:
        return self.now

    def _exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        # A task of a crashed process destroyed while pending is how a crash ends; anything else is a bug
        # the simulation reports.
        message = str(context.get("message", ""))
        if "Task was destroyed but it is pending" in message:
            return
        exc = context.get("exception")
        self.errors.append(f"{message}: {exc!r}" if exc is not None else message)

    # -- the gate ------------------------------------------------------------------------------------
    def call_soon(self, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None) -> Any:
        process = PROCESS.get() if context is None else context.get(PROCESS)
        if process is None:
            return super().call_soon(callback, *args, context=context)
        ctx = context if context is not None else contextvars.copy_context()
        cell: list[asyncio.Handle] = []
        handle = super().call_soon(self._gated, process, cell, ctx, callback, args, context=ctx)
        cell.append(handle)
        return handle

    def call_at(
        self, when: float, callback: Callable[..., Any], *args: Any, context: contextvars.Context | None = None
    ) -> Any:
        process = PROCESS.get() if context is None else context.get(PROCESS)
        if process is None:
            return super().call_at(when, callback, *args, context=context)
        ctx = context if context is not None else contextvars.copy_context()
        cell: list[asyncio.Handle] = []
        handle = super().call_at(when, self._gated, process, cell, ctx, callback, args, context=ctx)
        cell.append(handle)
        return handle

    def _gated(
        self,
        process: Any,
        cell: list[asyncio.Handle],
        ctx: contextvars.Context,
        callback: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        if cell[0].cancelled():  # cancelled while it was held back
            return
        if process.paused_until > self.now:
            # Resumed a microsecond after the pause ends: what waited in its sockets (the requests the
            # simulator serves at the end of the pause) comes first, as asyncio runs I/O before timers.
            resume = process.paused_until + 1e-6
            super().call_at(resume, self._gated, process, cell, ctx, callback, args, context=ctx)
            return
        callback(*args)


ROOT = contextvars.Context()  # the world's own context: PROCESS is None there


@dataclass
class HostClock:
    """One host's clocks. The monotonic clock starts at ``mono_start``, runs ``rate`` faster than true
    time (1e-4: 100 ppm) and never steps; the wall clock is kept to true time (by NTP, say) plus
    ``offset``, which :meth:`step` changes at once (an NTP step, ``date -s``)."""

    loop: VirtualLoop
    base: float  # the unix time that true time 0 is
    offset: float = 0.0
    rate: float = 0.0
    mono_start: float = 1000.0
    steps: list[tuple[float, float]] = field(default_factory=list)  # (true time, seconds)

    def mono(self) -> float:
        return self.mono_start + self.loop.now * (1 + self.rate)

    def wall(self) -> float:
        return self.base + self.loop.now + self.offset

    def step(self, seconds: float) -> None:
        self.offset += seconds
        self.steps.append((self.loop.now, seconds))

    # The generator's Clock protocol.
    def wall_ns(self) -> int:
        return int(self.wall() * 1e9)

    def monotonic_ns(self) -> int:
        return int(self.mono() * 1e9)

    def sleep(self, seconds: float) -> None:
        """A blocking sleep in a simulated process (the generator waiting out a millisecond: at most a
        few ms with ``block_on_clock=False``): the whole world stalls that long, as if every other
        process was descheduled meanwhile."""
        self.loop.now += max(seconds, 1e-6)


class _SimTime:
    """What a leasing module sees as its ``time`` module inside the simulation: the clocks of the
    host whose process is running. Called outside any process it raises: a clock read the simulation
    does not control would make runs irreproducible."""

    @staticmethod
    def _clock() -> HostClock:
        process = PROCESS.get()
        if process is None:
            raise RuntimeError("a leasing module read the clock outside a simulated process")
        clock: HostClock = process.host.clock
        return clock

    def monotonic(self) -> float:
        return self._clock().mono()

    def perf_counter(self) -> float:
        return self._clock().mono()

    def time(self) -> float:
        return self._clock().wall()

    def monotonic_ns(self) -> int:
        return self._clock().monotonic_ns()

    def time_ns(self) -> int:
        return self._clock().wall_ns()

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the simulation's time has no {name!r}: add it to tests/sim_loop.py")


SIM_TIME = _SimTime()

"""The ID generator: one per worker id, strictly increasing, never a duplicate.

Time is read from a monotonic clock anchored to the wall clock when the generator starts, so an NTP
step or a manual ``date -s`` while running cannot move IDs backwards (the drift between the two clocks
is reported by :meth:`Generator.drift_ms` so an operator can see it grow). Time can still be behind
the last issued millisecond after :meth:`Generator.reanchor` or a restart; then the generator waits
when the gap is small and raises :class:`ClockMovedBackwardsError` when it is not, and it never
reissues.

With a state file, a restart after the clock stepped back cannot reissue either: see
:mod:`.statefile`. The generator holds the file's lock while it may issue under it, and refuses a file
written for another worker id unless told the change is deliberate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..compiled import FREE_THREADED, speedups
from ..ids.layout import DEFAULT_LAYOUT, Layout, format_time, ms_to_datetime
from .bucket import PyGeneratorCore
from .errors import (
    ClockMovedBackwardsError,
    ClockWait,
    GenerationError,
    GeneratorClosedError,
    LayoutExhaustedError,
    LeaseNotConfirmedError,
    StateFileError,
)
from .statefile import StateFile, StateFileInUse

__all__ = [
    "Clock",
    "ClockMovedBackwardsError",
    "ClockWait",
    "GenerationError",
    "Generator",
    "GeneratorClosedError",
    "LayoutExhaustedError",
    "LeaseNotConfirmedError",
    "StateFileError",
    "StateFileInUse",
    "SystemClock",
]

# Sleep for waits longer than this, then spin on the clock for the rest: a sleep overshoots by
# tens of microseconds, which at the end of a millisecond would cost a tenth of the format's ceiling.
_SPIN_BELOW_NS = 200_000
_SLEEP_MARGIN_NS = 100_000

# A generator made with block_on_clock=False still blocks for waits this short (the same order as a
# used-up millisecond); longer ones raise ClockWait so the caller can wait without blocking its thread.
_BLOCK_AT_MOST_NS = 2_000_000

# The bucket and the fast path: compiled where built, else the pure-Python reference (same behaviour).
_GeneratorCore = PyGeneratorCore if TYPE_CHECKING or speedups is None else speedups.GeneratorCore


class Clock(Protocol):
    """Where the generator gets time from. Tests inject one they can step back and forth."""

    def wall_ns(self) -> int: ...

    def monotonic_ns(self) -> int: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clocks."""

    wall_ns = staticmethod(time.time_ns)
    monotonic_ns = staticmethod(time.monotonic_ns)
    sleep = staticmethod(time.sleep)


class Generator(_GeneratorCore):
    """Issues IDs for one worker id of one layout.

    ``max_backwards_wait`` (seconds) is how far behind the last issued millisecond the clock may be
    for the generator to wait rather than fail. With ``state_file``, a window of ``reserve_window``
    seconds is durably reserved ahead of the IDs issued (one fsync per window, never per ID), and
    ``max_start_wait`` bounds how long the constructor waits for the clock to pass the stored mark
    (before anything is served: a daemon makes its generator before its event loop runs). The file
    is locked for as long as the generator uses it (:class:`StateFileInUse` if another process holds
    it), and a file written for another worker id is refused unless ``allow_worker_id_change``.

    How it stays fast and thread-safe: the current millisecond's unused IDs are the "bucket"
    (:mod:`.bucket`, compiled where built), valid until the monotonic instant at which that
    millisecond ends (or the lease fence, if sooner). ``next_id`` compares one clock reading with that
    instant and takes the next ID, atomically under the GIL and without a lock. Everything else (a
    new millisecond, a used-up one, a clock behind, a state-file reservation) happens under a lock in
    :meth:`_refill`; the compiled core also sets a new millisecond's bucket itself when that refill
    would decide nothing, as :meth:`_refill` arms it to. On a free-threaded CPython every ID takes the lock.
    """

    def __init__(
        self,
        worker_id: int,
        layout: Layout = DEFAULT_LAYOUT,
        *,
        clock: Clock | None = None,
        max_backwards_wait: float = 1.0,
        state_file: str | StateFile | None = None,
        reserve_window: float = 2.0,
        max_start_wait: float | None = None,
        block_on_clock: bool = True,
        free_threaded: bool = FREE_THREADED,
        allow_worker_id_change: bool = False,
    ) -> None:
        layout.check_worker_id(worker_id)
        if max_backwards_wait < 0:
            raise ValueError("max_backwards_wait must not be negative")
        if reserve_window <= 0:
            raise ValueError("reserve_window must be positive")
        self.layout = layout
        self.worker_id = worker_id
        self._clock = clock or SystemClock()
        self._mono = self._clock.monotonic_ns
        self._use_clock(None if self._mono is time.monotonic_ns else self._mono)
        self._lock = threading.Lock()
        self._time_shift = layout.time_shift
        self._worker_part = worker_id << layout.worker_shift
        self._bucket_size = layout.max_sequence + 1
        self._epoch_ms = layout.epoch_ms
        self._max_backwards_ms = int(max_backwards_wait * 1000)
        self._reserve_ms = max(1, int(reserve_window * 1000))
        self._block_on_clock = block_on_clock
        self.clock_backwards_events = 0
        self.sequence_overflow_waits = 0
        self._behind_counted = -1  # the last millisecond a backwards event was counted against
        self._closed = False
        # The last state-file write that failed (None once one succeeds): health checks report it.
        self.state_error: StateFileError | None = None
        if free_threaded:
            # Without the GIL, taking from the shared bucket is not atomic: every ID takes the lock.
            self.next_id = self._next_id_locked  # type: ignore[method-assign]
        self._anchor()
        # Offset (ms since the layout's epoch) of the last millisecond handed out; its unused IDs are
        # the bucket, valid until _bucket_end_ns (-1: refill first).
        self._last = -1
        self._drop_bucket()
        # With a leased worker id: IDs may be issued only while the monotonic clock is before this,
        # and the reason given when it is not.
        self._fence_ns: int | None = None
        self._fence_reason: str | None = None
        self._state: StateFile | None = None
        self._reserved = layout.max_time_ms  # without a state file, only the layout limits us
        self.high_water_ms: int | None = None
        if state_file is not None:
            state = state_file if isinstance(state_file, StateFile) else StateFile(state_file)
            state.lock()
            self._state = state
            if max_start_wait is None:
                max_start_wait = reserve_window + max_backwards_wait
            try:
                self._resume_from_state(max_start_wait, allow_worker_id_change)
            except BaseException:
                state.unlock()
                raise
        self._limit = min(self._reserved, layout.max_time_ms)
        if self._state is not None:
            # Reserve the first window now: an unwritable state file fails at start, not at the first GET.
            self._cross_limit(max(self._now(), self._last + 1))

    # -- time ------------------------------------------------------------------------------------
    def _anchor(self) -> None:
        self._anchor_mono = self._mono()
        self._anchor_off = self._clock.wall_ns() // 1_000_000 - self._epoch_ms

    def _now(self) -> int:
        return self._anchor_off + (self._mono() - self._anchor_mono) // 1_000_000

    def _offset_at(self, mono: int) -> int:
        """The millisecond (offset from the epoch) that a monotonic reading falls in."""
        return self._anchor_off + (mono - self._anchor_mono) // 1_000_000

    def now_ms(self) -> int:
        """The generator's idea of now, in unix ms."""
        return self._now() + self._epoch_ms

    def drift_ms(self) -> int:
        """Wall clock minus the generator's clock, in ms: grows when NTP or a person steps the clock."""
        return self._clock.wall_ns() // 1_000_000 - self.now_ms()

    def reanchor(self) -> None:
        """Take the wall clock's current time as the generator's. If that is behind the last issued
        millisecond, later calls wait or fail as for any backwards clock; nothing is reissued."""
        with self._lock:
            self._disarm_roll()
            self._anchor()
            self._bucket_end_ns = -1

    def _wait_until(self, target: int) -> int:
        """Block until the clock reads ``target`` (an offset) or later; return the monotonic reading
        that showed it (one reading: the caller derives the millisecond and checks the fence from it)."""
        sleep = self._clock.sleep
        while True:
            mono = self._mono()
            if self._offset_at(mono) >= target:
                return mono
            remaining = (target - self._anchor_off) * 1_000_000 + self._anchor_mono - mono
            if remaining > _SPIN_BELOW_NS:
                sleep((remaining - _SLEEP_MARGIN_NS) / 1e9)
            else:
                sleep(0)  # a short spin that still lets other threads run

    # -- state file ------------------------------------------------------------------------------
    def _resume_from_state(self, max_start_wait: float, allow_worker_id_change: bool) -> None:
        assert self._state is not None
        mark = self._state.load()
        if mark is None:
            return
        recorded = self._state.recorded_worker_id
        if recorded != self.worker_id and not allow_worker_id_change:
            raise StateFileError(
                f"state file {self._state.path} was written by worker id {recorded}, not {self.worker_id}:"
                " two daemons may be sharing it, or this daemon's worker id was changed. Give each daemon"
                " its own state file; if you changed the worker id on purpose, start once with"
                " --state-file-new-worker-id"
            )
        self.high_water_ms = mark
        mark_off = mark - self._epoch_ms
        gap = mark_off - self._now()
        if gap >= 0:
            if gap > max_start_wait * 1000:
                raise ClockMovedBackwardsError(
                    f"clock is {gap} ms behind the state file's mark {format_time(ms_to_datetime(mark))}"
                    f" (more than the {max_start_wait:g} s we may wait): IDs up to that time may already"
                    " have been issued; fix the clock or wait"
                )
            self._wait_until(mark_off + 1)  # bounded above; at start-up nothing else runs yet
        # Everything up to and including the mark's millisecond counts as issued.
        self._last = mark_off
        self._reserved = mark_off

    def _cross_limit(self, now: int) -> None:
        """Called when ``now`` passes the reserved mark or the layout's end: reserve or fail."""
        if now > self.layout.max_time_ms:
            raise LayoutExhaustedError(
                f"layout {self.layout.describe()} ran out of time bits at {format_time(self.layout.lifetime_end)}"
            )
        if self._state is None:
            return
        reserved = min(now + self._reserve_ms, self.layout.max_time_ms)
        try:
            self._state.store(reserved + self._epoch_ms, self.worker_id)
        except StateFileError as exc:
            self.state_error = exc
            raise
        self.state_error = None
        self._reserved = reserved
        self.high_water_ms = reserved + self._epoch_ms
        self._limit = min(reserved, self.layout.max_time_ms)

    # -- issuing ---------------------------------------------------------------------------------
    def _refill(self) -> None:
        """With the lock held: make the bucket hold unused IDs of the current millisecond, waiting
        (bounded) when the last one is used up or the clock is behind (:meth:`_refill_bucket`).

        The compiled core may then set the following milliseconds' buckets itself, as this method
        would without waiting (``gen_roll`` in ``_speedups_generator.h``), until something changes
        what it decided with: so the roll is disarmed first (nothing may set a bucket while this
        waits with the GIL released, nor after it failed) and armed again with the values used."""
        self._disarm_roll()
        self._refill_bucket()
        self._arm_roll(
            self._anchor_mono,
            self._anchor_off,
            self._time_shift,
            self._worker_part,
            self._bucket_size,
            self._limit,
            self._fence_ns,
        )

    def _refill_bucket(self) -> None:
        """:meth:`_refill`'s decisions.

        One monotonic reading decides both whether the lease fence allows issuing and which
        millisecond the bucket is for, so a pause anywhere (GC, SIGSTOP, a VM freeze) cannot slip a
        bucket past the fence; after any wait the fence is checked again against the reading that
        ended the wait, and the bucket never outlives the fence.
        """
        if self._closed:
            raise GeneratorClosedError("generator is closed")
        fence = self._fence_ns
        mono = self._mono()
        if fence is not None and mono >= fence:
            raise LeaseNotConfirmedError(*self._fence_why())
        now = self._offset_at(mono)
        last = self._last
        if now == last and self._bucket_left() > 0:
            return  # another thread refilled it, or this millisecond still has IDs
        if now < last:
            gap = last - now
            if self._behind_counted != last:
                self._behind_counted = last
                self.clock_backwards_events += 1
            if gap > self._max_backwards_ms:
                raise ClockMovedBackwardsError(
                    f"clock moved backwards by {gap} ms (more than the {self._max_backwards_ms} ms we may wait)"
                )
            if not self._block_on_clock:
                wait_ns = (last + 1 - self._anchor_off) * 1_000_000 + self._anchor_mono - mono
                if wait_ns > _BLOCK_AT_MOST_NS:
                    raise ClockWait(wait_ns / 1e9)
            mono = self._wait_until(last + 1)
        elif now == last:
            self.sequence_overflow_waits += 1
            mono = self._wait_until(last + 1)
        else:
            mono = -1  # no wait: the reading above stands
        if mono >= 0:
            if fence is not None and mono >= fence:
                raise LeaseNotConfirmedError(*self._fence_why())
            now = self._offset_at(mono)
        if now > self._limit:
            self._cross_limit(now)
        base = (now << self._time_shift) | self._worker_part
        self._last = now
        end = self._anchor_mono + (now + 1 - self._anchor_off) * 1_000_000
        self._set_bucket(base, self._bucket_size, end if fence is None else min(end, fence))

    def _next_id_slow(self) -> int:
        """:meth:`next_id` when the bucket is used up or no longer valid."""
        with self._lock:
            while True:
                self._refill()
                id_ = self._take()
                if id_ is not None:
                    return id_
                # drained by other threads between refill and here: refill again

    def _next_id_locked(self) -> int:
        """:meth:`next_id` for free-threaded CPython: the same steps, every one under the lock."""
        with self._lock:
            if self._mono() < self._bucket_end_ns:
                id_ = self._take()
                if id_ is not None:
                    return id_
            while True:
                self._refill()
                id_ = self._take()
                if id_ is not None:
                    return id_

    def _next_ids_slow(self, n: int) -> list[int]:
        """``n`` increasing IDs: one clock reading per millisecond, consecutive sequence numbers."""
        if n <= 0:
            return []
        with self._lock:
            out = self._take_many(n) if self._mono() < self._bucket_end_ns else []
            while len(out) < n:
                self._refill()
                out.extend(self._take_many(n - len(out)))
            return out

    if _GeneratorCore is PyGeneratorCore:
        next_ids = _next_ids_slow  # the pure core has no faster path: save it a call

    def check(self) -> GenerationError | None:
        """Why no ID could be issued right now, without issuing one (None: one could). For health
        checks. A failing state file is retried here, so a probe sees recovery without traffic."""
        with self._lock:
            if self._closed:
                return GeneratorClosedError("generator is closed")
            mono = self._mono()
            if self._fence_ns is not None and mono >= self._fence_ns:
                return LeaseNotConfirmedError(*self._fence_why())
            now = self._offset_at(mono)
            if now > self.layout.max_time_ms:
                return LayoutExhaustedError(f"layout {self.layout.describe()} ran out of time bits")
            gap = self._last - now
            if gap > self._max_backwards_ms:
                return ClockMovedBackwardsError(
                    f"clock moved backwards by {gap} ms (more than the {self._max_backwards_ms} ms we may wait)"
                )
            if self.state_error is not None:
                try:
                    self._cross_limit(max(now, self._last + 1))
                except GenerationError as exc:
                    return exc
            return None

    # -- leased worker ids -----------------------------------------------------------------------
    def set_fence(self, deadline_ns: int | None, reason: str | None = None) -> None:
        """Allow IDs only while ``monotonic_ns() < deadline_ns`` (None: no limit); past it, requests
        fail with :class:`LeaseNotConfirmedError` and ``reason`` (default: "worker id lease not
        confirmed"). The current bucket is cut at the deadline, so the check costs the fast path nothing."""
        with self._lock:
            self._disarm_roll()  # the compiled core's next milliseconds were cut at the old fence
            self._fence_ns = deadline_ns
            self._fence_reason = reason
            if deadline_ns is not None:
                self._bucket_end_ns = min(self._bucket_end_ns, deadline_ns)

    def _fence_why(self) -> tuple[str, ...]:
        return () if self._fence_reason is None else (self._fence_reason,)

    def switch_worker(self, worker_id: int, after_unix_ms: int = 0, state_file: StateFile | None = None) -> None:
        """Issue under another worker id from now on, strictly after ``after_unix_ms`` (the previous
        holder's last millisecond) and after everything this generator issued.

        With ``state_file`` (that worker id's own file, locked by the caller or here), also strictly
        after the mark stored in it: the last millisecond any daemon of this host may have issued
        under that id. The file then takes the reservations, and the previous one is retired. Never
        waits: if the clock is behind the new mark, requests wait or fail as for any clock behind."""
        self.layout.check_worker_id(worker_id)
        mark: int | None = None
        if state_file is not None:
            state_file.lock()
            mark = state_file.load()
            recorded = state_file.recorded_worker_id
            if mark is not None and recorded != worker_id:
                state_file.unlock()
                raise StateFileError(
                    f"state file {state_file.path} was written by worker id {recorded}, not {worker_id};"
                    " refusing to guess which IDs were issued under it"
                )
        with self._lock:
            self._disarm_roll()  # first: nothing may roll on with the old worker id meanwhile
            if state_file is not None:
                self._retire_state()
                self._state = state_file
                self.high_water_ms = mark
                # The first bucket past the mark reserves a window in the new file before issuing.
                self._limit = -1 if mark is None else min(mark - self._epoch_ms, self.layout.max_time_ms)
            self.worker_id = worker_id
            self._worker_part = worker_id << self.layout.worker_shift
            self._last = max(self._last, after_unix_ms - self._epoch_ms, -1 if mark is None else mark - self._epoch_ms)
            self._drop_bucket()

    def retire_worker(self, reason: str | None = None) -> None:
        """Stop issuing under the current worker id (fenced until the next :meth:`set_fence`): store the
        last millisecond issued in its state file, and let the file go for another daemon."""
        with self._lock:
            self._disarm_roll()
            self._fence_ns = 0
            self._fence_reason = reason
            self._drop_bucket()
            self._retire_state()

    def _retire_state(self) -> None:
        """With the lock held: leave the current state file with the exact last millisecond issued (a
        failed write leaves the reserved mark, which is later still) and unlock it."""
        state, self._state = self._state, None
        self._limit = self.layout.max_time_ms
        if state is None:
            return
        try:
            if self._last >= 0:
                state.store(self._last + self._epoch_ms, self.worker_id)
        except StateFileError:
            pass  # the mark reserved ahead covers every ID issued
        finally:
            state.unlock()
        self.high_water_ms = None

    @property
    def monotonic_ns(self) -> Callable[[], int]:
        """The monotonic clock it issues by. A front end measures its own rates (the gRPC frame budget)
        by it too, so that a test's fake clock drives both and a conversation replays byte for byte
        whatever the machine's speed."""
        return self._mono

    @property
    def state_path(self) -> str | None:
        """The state file in use (None without one)."""
        return None if self._state is None else str(self._state.path)

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def last_issued_ms(self) -> int | None:
        """Unix ms of the latest millisecond an ID may have been issued in (None before the first)."""
        return None if self._last < 0 else self._last + self._epoch_ms

    def close(self) -> None:
        """Stop issuing and store the last issued millisecond as the mark, so that a clean restart
        does not have to wait out the reserved window; then release the state file's lock."""
        with self._lock:
            if self._closed:
                return
            self._disarm_roll()
            self._closed = True
            self._drop_bucket()
            state = self._state
            if state is None:
                return
            try:
                if self._last >= 0:
                    state.store(self._last + self._epoch_ms, self.worker_id)
                    self.high_water_ms = self._last + self._epoch_ms
            finally:
                state.unlock()

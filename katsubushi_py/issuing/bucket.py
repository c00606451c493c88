"""The generator's hot path: the current millisecond's unused IDs (the "bucket") and taking from it.

:class:`PyGeneratorCore` is the pure-Python reference; ``katsubushi_py._speedups.GeneratorCore`` is
its compiled twin with the same methods, and :class:`~.generator.Generator` derives from whichever
:mod:`katsubushi_py.compiled` selects. Everything that is not "take the next ID of a valid bucket"
(a new millisecond, the lease fence, the state file, waiting for the clock) is the generator's
``_refill``, reached through ``_next_id_slow`` / ``_next_ids_slow`` under the generator's lock. The
compiled twin has one step more: when the bucket's millisecond has ended and the next one needs no
decision (no wait, no fence, no state-file write), it sets that bucket itself, exactly as ``_refill``
would (``_arm_roll``), so that a request a millisecond does not leave C; here ``_refill`` does it.

Why this is thread-safe without a lock on the fast path: here the bucket is a ``range`` iterator, and
``next()`` on it is one atomic step under the GIL; in the compiled twin the whole fast path runs with
the GIL held. A free-threaded CPython uses neither (see ``Generator(free_threaded=...)``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from operator import length_hint


class PyGeneratorCore:
    """The bucket as a range iterator, valid while the monotonic clock is before ``_bucket_end_ns``."""

    _mono: Callable[[], int]
    _bucket: Iterator[int] = iter(())
    _bucket_end_ns = -1

    def _use_clock(self, mono: Callable[[], int] | None) -> None:
        """The compiled twin reads CLOCK_MONOTONIC itself unless given an injected clock; this one
        always calls ``self._mono``."""

    def _set_bucket(self, base: int, count: int, end_ns: int) -> None:
        if base < 0 or count < 0 or base + count >= 2**63:  # as the compiled twin, whose IDs are int64
            raise ValueError("_set_bucket: base and count must be >= 0 and base + count < 2**63")
        self._bucket = iter(range(base, base + count))
        self._bucket_end_ns = end_ns

    def _drop_bucket(self) -> None:
        self._bucket_end_ns = -1
        self._bucket = iter(())

    def _arm_roll(
        self,
        anchor_mono: int,
        anchor_off: int,
        time_shift: int,
        worker_part: int,
        size: int,
        limit: int,
        fence: int | None,
    ) -> None:
        """The compiled twin sets the next millisecond's bucket itself, as the generator's ``_refill``
        would without waiting, with what that refill decided with; here ``_refill`` always does it
        (under the generator's lock: a roll in Python would not be atomic), with the same result."""

    def _disarm_roll(self) -> None:
        """See :meth:`_arm_roll`."""

    def _bucket_left(self) -> int:
        return length_hint(self._bucket)

    def _take(self) -> int | None:
        return next(self._bucket, None)

    def _take_many(self, k: int) -> list[int]:
        return list(islice(self._bucket, k))

    def next_id(self) -> int:
        """One ID, greater than every ID this generator issued before."""
        if self._mono() < self._bucket_end_ns:
            try:
                return next(self._bucket)
            except StopIteration:
                pass
        return self._next_id_slow()

    def _next_id_slow(self) -> int:
        raise NotImplementedError

    def _next_ids_slow(self, n: int) -> list[int]:
        raise NotImplementedError

    def next_ids(self, n: int) -> list[int]:
        """``n`` increasing IDs: one clock reading per millisecond, consecutive sequence numbers."""
        return self._next_ids_slow(n)

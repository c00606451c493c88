"""How the 63 bits of an ID are divided, and the arithmetic between IDs and instants.

The default layout is go-katsubushi's, so IDs are interchangeable with the Go daemon's:
41 bits of milliseconds since 2015-01-01T00:00:00Z, then a 10-bit worker id, then a 12-bit
sequence number. A :class:`Layout` is immutable and validated once, so the hot path never
re-checks it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import NamedTuple

#: go-katsubushi's epoch, 2015-01-01T00:00:00Z, in unix milliseconds.
KATSUBUSHI_EPOCH_MS = 1_420_070_400_000

#: IDs are signed-64-bit safe: the sign bit is never used.
MAX_TOTAL_BITS = 63

#: A layout must stay usable for at least this long from now.
MIN_LIFETIME_MS = 365 * 24 * 3600 * 1000


class LayoutError(ValueError):
    """A layout, a worker id, an ID or an instant that does not fit the layout."""


class DecodedID(NamedTuple):
    """The parts of one ID."""

    id: int
    time: datetime
    worker_id: int
    sequence: int

    @property
    def unix_ms(self) -> int:
        return datetime_to_ms(self.time)


def format_time(moment: datetime) -> str:
    """ISO-8601 UTC with milliseconds and a ``Z``, as katsubushi-dump prints it."""
    moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def ms_to_datetime(unix_ms: int) -> datetime:
    """Exact conversion (no float rounding) from unix milliseconds to an aware UTC datetime."""
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=unix_ms)


def datetime_to_ms(moment: datetime) -> int:
    """Exact conversion to unix milliseconds, truncating below the millisecond.

    A naive datetime is taken as UTC, which is what every ID tool here means by a bare date.
    """
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


@dataclass(frozen=True, slots=True)
class Layout:
    """An ID format: epoch and bit widths, checked when created.

    ``now_ms`` is only for validation (epoch not in the future, lifetime not ending within a year);
    tests pass it to make validation independent of today's date.
    """

    epoch_ms: int = KATSUBUSHI_EPOCH_MS
    time_bits: int = 41
    worker_bits: int = 10
    sequence_bits: int = 12
    now_ms: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("time_bits", "worker_bits", "sequence_bits"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{name.replace('_', ' ')} must be a non-negative integer, got {value!r}")
        if self.time_bits < 1:
            raise LayoutError("time bits must be at least 1")
        if self.sequence_bits < 1:
            raise LayoutError("sequence bits must be at least 1")
        total = self.time_bits + self.worker_bits + self.sequence_bits
        if total > MAX_TOTAL_BITS:
            raise LayoutError(
                f"layout uses {total} bits ({self.time_bits}+{self.worker_bits}+{self.sequence_bits});"
                f" at most {MAX_TOTAL_BITS} fit in a signed 64-bit ID"
            )
        now = self.now_ms if self.now_ms is not None else time.time_ns() // 1_000_000
        if self.epoch_ms > now:
            raise LayoutError(f"epoch {format_time(ms_to_datetime(self.epoch_ms))} is in the future")
        if self.lifetime_end_ms - now < MIN_LIFETIME_MS:
            raise LayoutError(
                f"layout runs out of time bits at {format_time(self.lifetime_end)},"
                " less than a year from now; use more time bits or a later epoch"
            )

    # Derived figures. Properties rather than fields so that the dataclass stays a plain value.
    @property
    def worker_shift(self) -> int:
        return self.sequence_bits

    @property
    def time_shift(self) -> int:
        return self.sequence_bits + self.worker_bits

    @property
    def max_worker_id(self) -> int:
        return (1 << self.worker_bits) - 1

    @property
    def max_sequence(self) -> int:
        return (1 << self.sequence_bits) - 1

    @property
    def max_time_ms(self) -> int:
        """The largest millisecond offset from the epoch that the time bits can hold."""
        return (1 << self.time_bits) - 1

    @property
    def max_id(self) -> int:
        return (1 << (self.time_bits + self.worker_bits + self.sequence_bits)) - 1

    @property
    def lifetime_end_ms(self) -> int:
        """Unix ms of the first instant that no longer fits: IDs cannot be made from then on."""
        return self.epoch_ms + (1 << self.time_bits)

    @property
    def lifetime_end(self) -> datetime:
        return ms_to_datetime(self.lifetime_end_ms)

    @property
    def ids_per_second_ceiling(self) -> int:
        """What the format allows one worker to issue: every sequence number of every ms."""
        return (self.max_sequence + 1) * 1000

    def describe(self) -> str:
        return f"{self.time_bits}/{self.worker_bits}/{self.sequence_bits}"

    def check_worker_id(self, worker_id: int) -> int:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int):
            raise LayoutError(f"worker id must be an integer, got {worker_id!r}")
        if not 0 <= worker_id <= self.max_worker_id:
            raise LayoutError(
                f"worker id {worker_id} does not fit in {self.worker_bits} bits (0..{self.max_worker_id})"
            )
        return worker_id

    def compose(self, unix_ms: int, worker_id: int, sequence: int) -> int:
        """Build the ID for an instant (unix ms), worker and sequence, checking every part."""
        offset = unix_ms - self.epoch_ms
        if offset < 0:
            raise LayoutError(f"{format_time(ms_to_datetime(unix_ms))} is before the layout's epoch")
        if offset > self.max_time_ms:
            raise LayoutError(f"{format_time(ms_to_datetime(unix_ms))} is past the layout's lifetime end")
        self.check_worker_id(worker_id)
        if not 0 <= sequence <= self.max_sequence:
            raise LayoutError(f"sequence {sequence} does not fit in {self.sequence_bits} bits")
        return (offset << self.time_shift) | (worker_id << self.worker_shift) | sequence

    def check_id(self, id_: int) -> int:
        if isinstance(id_, bool) or not isinstance(id_, int):
            raise LayoutError(f"an ID must be an integer, got {id_!r}")
        if not 0 <= id_ <= self.max_id:
            raise LayoutError(f"{id_} is not an ID of this layout (0..{self.max_id})")
        return id_

    def unix_ms_of(self, id_: int) -> int:
        return (self.check_id(id_) >> self.time_shift) + self.epoch_ms

    def decompose(self, id_: int) -> DecodedID:
        """Time (UTC, ms), worker id and sequence of an ID."""
        self.check_id(id_)
        return DecodedID(
            id=id_,
            time=ms_to_datetime((id_ >> self.time_shift) + self.epoch_ms),
            worker_id=(id_ >> self.worker_shift) & self.max_worker_id,
            sequence=id_ & self.max_sequence,
        )

    def id_at(self, moment: datetime | int | float) -> int:
        """The smallest ID of an instant (worker 0, sequence 0), for range scans and partitions.

        ``moment`` is an aware datetime (naive means UTC) or unix seconds, possibly fractional;
        anything below the millisecond is truncated, so every ID made at that instant is >= the result.
        """
        unix_ms = datetime_to_ms(moment) if isinstance(moment, datetime) else _seconds_to_ms(moment)
        return self.compose(unix_ms, 0, 0)


def _seconds_to_ms(seconds: int | float) -> int:
    if isinstance(seconds, int):
        return seconds * 1000
    # repr keeps the digits the user typed (1465276650.777 -> 1465276650777, not ...776).
    return int((Decimal(repr(seconds)) * 1000).to_integral_value(rounding="ROUND_FLOOR"))


DEFAULT_LAYOUT = Layout()

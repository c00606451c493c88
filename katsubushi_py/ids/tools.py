"""ID tools that need no daemon: decode IDs, the ID at an instant, MySQL partition boundaries.

Each function returns text and raises ``ValueError`` subclasses with a message meant for a person;
:mod:`katsubushi_py.cli` turns those into a line on stderr and an exit status.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation

from .encodings import EncodingError, decode
from .layout import Layout, LayoutError, datetime_to_ms, format_time

_UNIX_SECONDS = re.compile(r"^[+-]?\d+(\.\d+)?$")


class ToolError(ValueError):
    """Input a tool cannot use; the message says why."""


def parse_time(text: str) -> int:
    """Unix ms of ISO-8601 text (a bare date or naive time means UTC) or unix seconds like
    ``1465276650.777``; below the millisecond is truncated."""
    text = text.strip()
    if _UNIX_SECONDS.match(text):
        try:
            return int((Decimal(text) * 1000).to_integral_value(rounding="ROUND_FLOOR"))
        except InvalidOperation:
            pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ToolError(f"{text!r} is not an ISO-8601 time or unix seconds") from None
    return datetime_to_ms(moment)


def parse_epoch(text: str) -> int:
    """An epoch given as ISO-8601 or as unix milliseconds (katsubushi's Epoch is 1420070400000)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    return parse_time(text)


def decode_record(layout: Layout, id_: int) -> str:
    """One katsubushi-dump style JSON line (plus the ID itself, as a string for JavaScript)."""
    parts = layout.decompose(id_)
    return json.dumps(
        {
            "id": str(id_),
            "time": format_time(parts.time),
            "worker_id": parts.worker_id,
            "sequence": parts.sequence,
        },
        separators=(",", ":"),
    )


def decode_many(layout: Layout, texts: Iterable[str], encoding: str = "dec") -> Iterator[tuple[str, bool]]:
    """For each non-blank input, a (line, ok) pair: the JSON record, or an error message."""
    for raw in texts:
        text = raw.strip()
        if not text:
            continue
        try:
            yield decode_record(layout, layout.check_id(decode(text, encoding))), True
        except (EncodingError, LayoutError) as exc:
            yield f"katsubushi-py decode: {exc}", False


def id_at(layout: Layout, text: str) -> int:
    return layout.compose(parse_time(text), 0, 0)


def partitions(layout: Layout, start: str, days: int, *, table: str | None = None, column: str = "id") -> str:
    """MySQL ``PARTITION BY RANGE COLUMNS(id)`` with one partition per day from ``start`` and pmax.

    Partition ``pYYYYMMDD`` holds the IDs issued on that day (in the start's UTC offset), so dropping it
    drops that day's rows. The first one also holds anything older.
    """
    if days < 1:
        raise ToolError("--days must be at least 1")
    if days > 8192:
        raise ToolError("--days must be at most 8192 (MySQL allows 8192 partitions)")
    start_ms = parse_time(start)
    text = start.strip()
    if _UNIX_SECONDS.match(text):
        first = datetime.fromtimestamp(start_ms / 1000, UTC)
    else:
        first = datetime.fromisoformat(text)
        if first.tzinfo is None:
            first = first.replace(tzinfo=UTC)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]*", column):
        raise ToolError(f"{column!r} is not a plain column name")
    lines = []
    for day in range(days):
        begin = first + timedelta(days=day)
        end = begin + timedelta(days=1)
        try:
            bound = layout.compose(datetime_to_ms(end), 0, 0)
        except LayoutError as exc:
            raise ToolError(str(exc)) from None
        lines.append(f"  PARTITION p{begin:%Y%m%d} VALUES LESS THAN ({bound}), -- before {format_time(end)}")
    lines.append("  PARTITION pmax VALUES LESS THAN (MAXVALUE)")
    head = f"ALTER TABLE {table} " if table else ""
    return f"{head}PARTITION BY RANGE COLUMNS({column}) (\n" + "\n".join(lines) + "\n);"

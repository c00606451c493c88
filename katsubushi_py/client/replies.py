"""What the clients send and how they check what comes back, sans-IO (bytes in, values out).

Every reply is checked before an ID reaches the application: each value is a decimal integer in
``1 .. 2**64-1``, there is exactly one per key asked for, and the IDs of one reply increase (a daemon
hands out one reply's IDs in key order). A reply that fails a check is treated like a failed server:
the connection is dropped and the next server is asked.
"""

from __future__ import annotations

import operator
from itertools import islice

from ..issuing.issuer import MAX_IDS_PER_REQUEST

MAX_ID = 2**64 - 1

#: Keys of a multi-key GET: their names do not matter to a daemon, which echoes them.
KEYS = tuple(b"%d" % i for i in range(MAX_IDS_PER_REQUEST))
ONE_KEY = b"id"

_ERROR_WORDS = (b"SERVER_ERROR", b"CLIENT_ERROR", b"ERROR")


class ReplyError(Exception):
    """The server answered, but not with what was asked for."""


class ServerErrorReply(ReplyError):
    """The server said it cannot answer: ``SERVER_ERROR <why>`` (our daemons: clock or lease trouble,
    an unwritable state file, too many connections) or a bare ``ERROR`` (go-katsubushi's way)."""


def check_count(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n must be an int, not {type(n).__name__}")
    if not 1 <= n <= MAX_IDS_PER_REQUEST:
        raise ValueError(f"n must be from 1 to {MAX_IDS_PER_REQUEST}, got {n}")


def get_request(n: int) -> bytes:
    """The one ``get`` line that asks for ``n`` IDs."""
    if n == 1:
        return b"get " + ONE_KEY + b"\r\n"
    return b"get " + b" ".join(KEYS[:n]) + b"\r\n"


def ids_from_values(values: list[bytes | None], n: int) -> list[int]:
    """Check the values of one reply (None where a key got none) and return them as IDs."""
    if n == 1 and len(values) == 1:  # fetch(): the common case, first
        value = values[0]
        if value is not None and value.isdigit() and len(value) <= 20 and 0 < (id_ := int(value)) <= MAX_ID:
            return [id_]
    if len(values) != n or None in values:
        raise ReplyError(f"{sum(v is not None for v in values)} values for {n} keys")
    raw: list[bytes] = values  # type: ignore[assignment]
    # Checked in bulk (the common case costs a few C-level passes, not a Python loop per value):
    # ASCII digits only, at most 20 of them per value, so int() cannot accept a sign, spaces or "_".
    if not (b"".join(raw).isdigit() and max(map(len, raw)) <= 20 and min(map(len, raw)) > 0):
        bad = next(v for v in raw if not (v.isdigit() and len(v) <= 20))
        raise ReplyError(f"not an ID: {bad[:40]!r}")
    ids = list(map(int, raw))
    if n > 1 and not all(map(operator.lt, ids, islice(ids, 1, None))):
        at = next(i for i in range(1, n) if ids[i] <= ids[i - 1])
        raise ReplyError(f"IDs of one reply do not increase: {ids[at - 1]} then {ids[at]}")
    if ids[0] < 1 or ids[-1] > MAX_ID:  # increasing: the ends bound the rest
        raise ReplyError(f"ID out of range: {ids[0] if ids[0] < 1 else ids[-1]}")
    return ids


def error_line(line: bytes) -> ServerErrorReply | ReplyError:
    """The exception for a reply line that is not what a request expects."""
    text = line[:200].decode("ascii", "replace")
    if line.startswith(_ERROR_WORDS):
        return ServerErrorReply(text)
    return ReplyError(f"unexpected line {text!r}")


def reply_complete(buffer: bytes) -> bool:
    """Whether ``buffer`` holds a whole reply to a GET or STATS: up to ``END``, or an error line."""
    if buffer.endswith(b"END\r\n"):
        return len(buffer) == 5 or buffer[-7:-5] == b"\r\n"
    return buffer.startswith(_ERROR_WORDS) and buffer.endswith(b"\r\n")


def parse_ids(reply: bytes, n: int) -> list[int]:
    """The IDs of a whole reply to :func:`get_request`\\ ``(n)``."""
    lines = reply.split(b"\r\n")
    if len(lines) != 2 * n + 2 or lines[-2] != b"END" or lines[-1]:
        if not reply.startswith(b"VALUE") and reply != b"END\r\n":
            raise error_line(lines[0])
        count = reply.count(b"\r\nVALUE ") + reply.startswith(b"VALUE ")
        raise ReplyError(f"{count} values for {n} keys")
    values: list[bytes | None] = []
    for i in range(0, 2 * n, 2):
        header = lines[i].split(b" ")
        value = lines[i + 1]
        if len(header) < 4 or header[0] != b"VALUE" or header[3] != b"%d" % len(value):
            raise error_line(lines[i])
        values.append(value)
    return ids_from_values(values, n)


def stat_value(value: object) -> int | str:
    """A STAT value as an int when it is one, else as text."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, int):
        return value
    text = str(value)
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isdigit() else text


def parse_stats(reply: bytes) -> dict[str, int | str]:
    """The ``STAT name value`` lines of a whole reply to ``stats``."""
    lines = reply.split(b"\r\n")
    if lines[-2:] != [b"END", b""]:
        raise error_line(lines[0])
    stats: dict[str, int | str] = {}
    for line in lines[:-2]:
        parts = line.split(b" ", 2)
        if len(parts) < 2 or parts[0] != b"STAT":
            raise error_line(line)
        stats[parts[1].decode("utf-8", "replace")] = stat_value(parts[2] if len(parts) == 3 else b"")
    return stats


def describe(exc: BaseException, seconds: float) -> str:
    """One short phrase for what went wrong at a server (``seconds``: how long the attempt took)."""
    if isinstance(exc, TimeoutError):
        return f"timed out after {seconds:.2f} s"
    if isinstance(exc, ServerErrorReply):
        return str(exc)
    if isinstance(exc, ReplyError):
        return f"invalid reply: {exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, FileNotFoundError):
        return "no such socket file"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__

"""Values shared by every part of the configuration: the defaults, the one-line error, and the parsers
of durations, sizes and bounded integers (Go's spellings, which go-katsubushi users already write)."""

from __future__ import annotations

import re
from collections.abc import Mapping

DEFAULT_PORT = 11212
DEFAULT_IDLE_TIMEOUT = 600.0
DEFAULT_MAX_CONNECTIONS = 4096
#: Bytes of a connection's requests read (and held unanswered) while its client is behind with
#: reading the replies; see daemon/connection.py.
DEFAULT_READ_AHEAD = 1024 * 1024
#: How long a request may take to arrive once begun (a TLS handshake, a command line, an HTTP head).
DEFAULT_REQUEST_TIMEOUT = 5.0

LOG_LEVELS = {
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
    "fatal": "CRITICAL",
    "panic": "CRITICAL",
    "critical": "CRITICAL",
}


class ConfigError(ValueError):
    """Configuration that cannot work; the message is the one line the user sees."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from a Go duration (``600s``, ``10m``, ``1h30m``, ``1.5h``, ``300ms``, ``0``) or bare
    seconds (``600``, ``0.5``), which katsubushi v1 took and v2 rejects."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ConfigError(
            f"invalid {name} {text!r}: must not be negative (0, seconds, or a Go duration such as 1s or 500ms)"
        )
    if re.fullmatch(r"\d+(\.\d*)?|\.\d+", raw):
        return float(raw)
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or not raw:
        raise ConfigError(f"invalid {name} {text!r}: use seconds or a Go duration such as 600s, 10m or 1h30m")
    return total


_SIZE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib)", re.IGNORECASE)


def parse_size(text: str, name: str) -> int:
    """Bytes from ``1048576``, ``1024k``, ``1m``, ``1MiB`` (k, m and g are powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ConfigError(f"invalid {name} {text!r}: use bytes such as 1048576, 1024k or 1m")
    unit = match.group(2).lower()[:1]
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit]


def bounded_int(value: object, name: str, low: int, high: int | None = None) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ConfigError(f"invalid {name} {value!r}: not an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"invalid {name} {number}: must be {bound}")
    return number


def env_value(environ: Mapping[str, str], name: str) -> str | None:
    for key in (name.upper(), name.lower()):
        value = environ.get(key)
        if value:
            return value
    return None

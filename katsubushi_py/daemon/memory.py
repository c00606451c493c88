"""Memory given back to the system after a burst of closed connections (issue 33).

Why: glibc's malloc keeps what it has freed in its heaps and arenas for reuse, and gives the top of a
heap back only when it is free to the end; a flood of connections (TLS handshakes, HTTP/2 frames held
by h2, OpenSSL's buffers) leaves freed memory scattered under live objects, so the daemon's RSS stayed
at the flood's peak after every connection had closed (1.5 GB in issue 33), which matters under a
container's memory limit. ``malloc_trim(0)`` returns the free pages of every arena (``madvise``), and
costs a few milliseconds for a large heap: so it runs at most once every :data:`TRIM_DELAY` seconds,
:data:`TRIM_DELAY` after at least :data:`TRIM_AFTER` connections (or TLS handshakes) have closed, never
on the hot path. Where the C library has no ``malloc_trim`` (musl, macOS) nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from typing import Any

log = logging.getLogger("katsubushi_py")

#: Closes before memory is given back.
TRIM_AFTER = 64
#: Seconds from the close that reached TRIM_AFTER to the trim (the rest of the burst closes meanwhile).
TRIM_DELAY = 1.0


def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class Trimmer:
    """Counts closes and gives memory back after a burst of them (see the module's docstring)."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._closed = 0
        self._handle: asyncio.TimerHandle | None = None
        self.trims = 0
        self.last_ms = 0.0  # how long the last one took

    def closed(self) -> None:
        """A connection or a TLS handshake has closed."""
        self._closed += 1
        if self._closed >= TRIM_AFTER and self._handle is None and self._trim is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._handle = loop.call_later(TRIM_DELAY, self._run)

    def _run(self) -> None:
        self._handle = None
        self._closed = 0
        started = time.perf_counter()
        self._trim(0)
        self.trims += 1
        self.last_ms = (time.perf_counter() - started) * 1000

    def stat_fields(self) -> list[tuple[str, object]]:
        return [("memory_trims", self.trims), ("memory_trim_ms", f"{self.last_ms:.1f}")]

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


#: The process's one trimmer (glibc's heaps are the process's).
TRIMMER = Trimmer()

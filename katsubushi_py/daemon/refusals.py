"""Log lines for refusals a client can cause at will, rate-limited, and the route of Python's
"unraisable" exceptions into the log.

A hostile client can make the daemon refuse something on every connection (a handshake with a bad
server name, an accept() that fails for want of descriptors): each refusal is worth a line, but a line
per attempt would let the client fill the disk and bury everything else. :class:`RateLimitedLog`
(katsubushi_py/ratelimit.py, shared with the issuer and the admission) says the first at once, then at
most one line per ``every`` seconds for the same kind, with how many were left unsaid in between.

An exception raised where nobody can catch it (CPython's own TLS server-name callback, which decodes
the name a client sent as ASCII before ours is called) goes to ``sys.unraisablehook``, whose default
prints a multi-line traceback on stderr: past the log's format (``--log-format json`` must stay one
JSON object a line) and once per handshake. :func:`install_unraisable_hook` sends them to the log
instead, the non-ASCII server name as one rate-limited line (the handshake is refused: OpenSSL answers
the client with an ``internal_error`` alert).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import sys
from collections.abc import Callable
from typing import Any

from ..ratelimit import RateLimitedLog, refusals

__all__ = ["DescriptorWatch", "RateLimitedLog", "install_unraisable_hook", "refusals"]

log = logging.getLogger("katsubushi_py")


class DescriptorWatch:
    """Says in the log when the descriptor table is full, whichever listener meets it.

    Our socket transport's accept loop sees ``EMFILE`` and logs it; the event loop's own servers
    (uvloop's libuv) do not: libuv then accepts and closes the waiting connections with a descriptor it
    keeps in reserve, and says nothing. So once a second this opens and closes ``/dev/null`` (two
    system calls): refused with ``EMFILE`` or ``ENFILE``, the table is full and new clients are being
    refused, which is logged (rate-limited, the same kind of line as the accept loop's)."""

    INTERVAL = 1.0

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: Callable[[], int]) -> None:
        self._loop = loop
        self._connections = connections
        #: Probes that found the table full.
        self.full = 0
        self._handle: asyncio.TimerHandle | None = loop.call_later(self.INTERVAL, self._probe)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _probe(self) -> None:
        try:
            os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self.full += 1
                soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                refusals(
                    "accept",
                    logging.WARNING,
                    "out of file descriptors (%s; %d client connections open, limit %d): new connections"
                    " are refused until some close (see --max-connections and LimitNOFILE)",
                    exc.strerror or exc,
                    self._connections(),
                    soft,
                )
        self._handle = self._loop.call_later(self.INTERVAL, self._probe)


def _unraisable(unraisable: Any) -> None:
    exc = unraisable.exc_value
    obj = unraisable.object
    if isinstance(exc, UnicodeError) and isinstance(obj, bytes):
        # CPython's _ssl servername callback: the name is not ASCII (RFC 6066 says it must be, as an
        # A-label), so it never reaches our callback and the handshake fails.
        refusals(
            "tls-server-name",
            logging.WARNING,
            "TLS handshake refused: the client's server name (SNI) is not ASCII: %r",
            obj[:64],
        )
        return
    kind = f"unraisable-{type(exc).__name__}"
    where = unraisable.err_msg or "Exception ignored in"
    if refusals(kind, logging.ERROR, "%s: %r: %s: %s", where, obj, type(exc).__name__, exc):
        log.debug("the traceback", exc_info=(unraisable.exc_type, exc, unraisable.exc_traceback))


def install_unraisable_hook() -> None:
    """Send exceptions Python cannot raise anywhere to the log (see the module's docstring)."""
    sys.unraisablehook = _unraisable

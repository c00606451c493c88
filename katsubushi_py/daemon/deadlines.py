"""The request deadline (``--request-timeout``): a request that has begun must arrive in full within it.

Without it a client that sends a command line, or an HTTP request's head, a byte every few seconds
holds its connection for the whole idle timeout (10 minutes by default), since each byte counts as
activity; enough of them use up ``--max-connections``. (A TLS handshake has its own deadline, the
same duration: see :mod:`.tls`. After it, a TLS record begun and not finished, which the protocol
never sees, counts as a partial request: the transport's ``_tls_partial``.)

Cost: nothing per request. One sweep over the open connections runs every quarter of the deadline
(at most once a second, at least four times a second): a connection holding part of a request
(:func:`holds_partial_request`) that has completed no request since the sweep that first saw it
partial is closed once the deadline has passed since that sweep. So a request is closed between the
deadline and the deadline plus one sweep interval after it began; a client that keeps completing
requests (a pipeline whose reads end mid-command) is never closed. Input held back on purpose (a
command waiting for the clock, a client behind with reading its replies) is not a partial request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connection import ConnectionHandler
    from .server import Daemon

log = logging.getLogger("katsubushi_py")

#: What an HTTP client whose request head did not arrive in time is told before the close.
HTTP_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def holds_partial_request(conn: Any) -> bool:
    """The protocol object holds the start of a request whose end has not arrived: an unfinished
    memcached line or binary packet (``_buffer``), a get line or data block in progress (``_state``,
    text and binary), an HTTP head in progress (``_in_head``), an unfinished HTTP/2 frame or header
    block (``_block``: HEADERS and CONTINUATIONs without END_HEADERS, which h2 holds whole)."""
    if conn.wait or getattr(conn, "backlog", False) or conn.closing:
        return False
    return bool(
        getattr(conn, "_in_head", False)
        or getattr(conn, "_state", 0)
        or getattr(conn, "_buffer", b"")
        or getattr(conn, "_block", 0)
    )


class RequestDeadlines:
    """The sweep (see the module's docstring)."""

    def __init__(self, daemon: Daemon, timeout: float) -> None:
        self._daemon = daemon
        self.timeout = timeout
        self.interval = min(1.0, max(0.25, timeout / 4))
        self._seen: dict[ConnectionHandler, tuple[int, float]] = {}
        self.closed = 0  # connections closed by the deadline (STATS request_timeouts)
        self._handle: asyncio.TimerHandle | None = daemon.loop.call_later(self.interval, self._sweep)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._seen.clear()

    def stat_fields(self) -> list[tuple[str, object]]:
        return [("request_timeout", f"{self.timeout:g}"), ("request_timeouts", self.closed)]

    def _sweep(self) -> None:
        loop = self._daemon.loop
        now = loop.time()
        seen = self._seen
        still: dict[ConnectionHandler, tuple[int, float]] = {}
        for handler in self._daemon.connections:
            conn = handler._conn
            if handler._write_paused or handler._wait_handle is not None:
                continue
            if not holds_partial_request(conn) and not getattr(handler._transport, "_tls_partial", False):
                continue
            before = seen.get(handler)
            if before is None or before[0] != conn.activity:
                still[handler] = (conn.activity, now)
            elif now - before[1] >= self.timeout:
                self._expire(handler, conn)
            else:
                still[handler] = before
        self._seen = still
        self._handle = loop.call_later(self.interval, self._sweep)

    def _expire(self, handler: ConnectionHandler, conn: Any) -> None:
        transport = handler._transport
        if transport is None or transport.is_closing():
            return
        self.closed += 1
        log.debug("closing a connection whose request did not arrive within %g s", self.timeout)
        if getattr(conn, "_in_head", False):
            transport.write(HTTP_TIMEOUT)
        expire = getattr(conn, "expire", None)  # gRPC: its GOAWAY
        if expire is not None:
            farewell = expire()
            if farewell:
                transport.write(farewell)
        transport.close()

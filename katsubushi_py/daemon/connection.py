"""One client connection: thin glue between an asyncio transport and a sans-IO protocol.

The protocol object turns bytes into reply bytes; this class only does what needs the event loop:
flow control (stop reading from a client that does not read its replies), the idle timeout, the
connection limit, and waiting for the clock without blocking anyone else (the protocol says how long
a command must wait; reading pauses meanwhile, so replies stay in order and memory bounded).

Flow control, for a client that sends faster than it reads its replies:

- The protocol stops taking commands once one read's reply has reached its budget, holding the rest
  of that read (``backlog``); this class writes the reply and calls ``resume`` for more, so one read
  that asks for a great deal (a get of thousands of keys) is answered a piece at a time.
- When the transport cannot send the replies as fast (``pause_writing``: unsent replies above its
  high-water mark), the memcached protocols take no more commands (``backlog`` is set for them) and
  what arrives is held unanswered, up to ``--read-ahead`` bytes, and then reading stops; on
  ``resume_writing`` the held commands are answered, again a piece at a time. Reading ahead lets a
  client that writes a whole large request before it reads anything (what most memcached clients do
  with a multi-get) finish writing it even over a unix socket, whose buffers are small; memory stays
  bounded by the read-ahead limit plus one read, the transport's high-water mark plus one reply.
  Other protocols (HTTP, gRPC) stop reading at once.
- Fairness: what a backlog holds is answered in slices of about :data:`SLICE` (2 ms) of work; between
  two slices the connection yields to the event loop (``call_soon``), so every other connection with
  something to read is served in between. Without this a client that reads its replies as fast as
  they come (so writing never pauses) had a 1 MiB ``get`` line of 524k keys answered in one go, and
  every other client waited about 410 ms. gRPC's connections do the same with a read of many calls
  (:data:`~katsubushi_py.frontends.grpc_frames.PIECE_BUDGET` a ``receive`` or ``resume``), and read
  nothing more until the read is answered: HTTP/2 has its own flow control, so there is no read-ahead.

On a memcached listener the first byte a client sends picks the protocol for the rest of the
connection, as in memcached and go-katsubushi: ``0x80`` (the binary request magic) the binary
protocol, anything else the text one. That choice is made once: the first ``data_received`` rebinds
the receive function to the chosen protocol object, so later reads cost exactly what they cost
before binary support existed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from ..auth.gate import AuthGate
from ..compiled import speedups
from ..frontends.binary import REQUEST_MAGIC, BinaryConnection
from ..frontends.fastpath import COMPILED
from ..frontends.text import TextConnection

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("katsubushi_py")

TOO_MANY_CONNECTIONS = b"SERVER_ERROR too many connections\r\n"


class SansIOConnection(Protocol):
    """What this glue drives: see :class:`~katsubushi_py.frontends.text.TextConnection`."""

    closing: bool
    wait: float
    backlog: bool
    activity: int

    def receive(self, data: bytes) -> bytes: ...

    def resume(self) -> bytes: ...


class _Closed:
    """The protocol of a connection that is refused, not yet made, or lost: it answers nothing."""

    closing = True
    wait = 0.0
    backlog = False
    activity = 0

    @staticmethod
    def receive(data: bytes) -> bytes:
        return b""

    resume = receive


_CLOSED = _Closed()

# The protocols that hold input while their client is behind with its replies (see pause_writing).
_HOLDS_INPUT = (TextConnection, BinaryConnection)


#: The work one connection's backlog may take before the event loop serves the others (seconds).
SLICE = 0.002


class PyProtocolCore:
    """The connection's sans-IO object (``_conn``), what takes its bytes (``_receive``) and the
    transport's write (``_write``). ``_speedups.ProtocolCore`` is the compiled twin: it keeps the
    three in C and implements ``data_received`` itself, calling a compiled connection's receive
    directly, so a request costs no Python frame at all on the hot path."""

    __slots__ = ("_conn", "_receive", "_write")

    def _use(self, conn: SansIOConnection) -> None:
        """From now on hand every read to ``conn``."""
        self._conn = conn
        self._receive = conn.receive


ProtocolCore = speedups.ProtocolCore if COMPILED and speedups is not None and not TYPE_CHECKING else PyProtocolCore


class ConnectionHandler(ProtocolCore, asyncio.Protocol):
    """A client connection: memcached (text or binary, as its first byte says) unless
    ``open_protocol`` makes another sans-IO protocol object (HTTP), whose listener also says what a
    refused connection is told."""

    __slots__ = (
        "_daemon",
        "_eof",
        "_idle_handle",
        "_last_activity",
        "_login_handle",
        "_open_protocol",
        "_refusal",
        "_slice_handle",
        "_token_login",
        "_transport",
        "_unauthenticated",
        "_wait_handle",
        "_write_paused",
    )

    def __init__(
        self,
        daemon: Daemon,
        open_protocol: Callable[[], SansIOConnection] | None = None,
        refusal: bytes = TOO_MANY_CONNECTIONS,
        token_login: bool = False,
    ) -> None:
        self._daemon = daemon
        self._open_protocol = open_protocol
        self._refusal = refusal
        #: HTTP or gRPC with --token-file: unauthenticated until a request with a good token (issue 33).
        self._token_login = token_login
        self._transport: asyncio.Transport | None = None
        self._conn: SansIOConnection = _CLOSED
        self._idle_handle: asyncio.TimerHandle | None = None
        self._wait_handle: asyncio.TimerHandle | None = None
        #: The next slice of a backlog, when one is due (see the module's docstring: fairness).
        self._slice_handle: asyncio.Handle | None = None
        self._write_paused = False
        self._eof = False
        self._last_activity = 0
        self._unauthenticated = False  # counted in daemon.admission.unauthenticated
        #: --login-timeout's timer, cancelled once authenticated or closed (a busy HTTP port opens and
        #: closes thousands of connections a second: their timers would wait out the timeout).
        self._login_handle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check here.
        tcp: asyncio.Transport = transport  # type: ignore[assignment]
        daemon = self._daemon
        stats = daemon.stats
        self._transport = tcp
        credentials = daemon.credentials
        needs_login = self._token_login or (
            self._open_protocol is None and credentials is not None and credentials.users_enabled
        )
        if daemon.stopping or not daemon.admission.admit(needs_login):
            if daemon.stopping:
                stats.rejected_connections += 1
            self._receive = _CLOSED.receive
            tcp.write(self._refusal)
            tcp.close()
            return
        if self._open_protocol is not None:
            conn = self._open_protocol()
            self._use(conn)
            if self._token_login:
                # Its first request with a good token calls _authenticated (the protocol knows when).
                assert credentials is not None
                conn.on_login = self._authenticated  # type: ignore[union-attr]
                self._login_handle = daemon.loop.call_later(credentials.config.login_timeout, self._login_deadline)
                self._unauthenticated = True
                daemon.admission.unauthenticated += 1
        elif needs_login:
            # --auth-file: the login first; the real protocol (compiled where built) once it succeeds.
            assert credentials is not None
            self._use(AuthGate(credentials, daemon.issuer.version, self._logged_in))
            self._login_handle = daemon.loop.call_later(credentials.config.login_timeout, self._login_deadline)
            self._unauthenticated = True
            daemon.admission.unauthenticated += 1
        else:
            # Text until the first byte says otherwise (the idle timer may read its activity before that).
            self._conn = TextConnection(daemon.issuer, gets_cas=daemon.config.gets_cas)
            self._receive = self._first_data
        self._write = tcp.write
        daemon.connections.add(self)
        stats.curr_connections += 1
        stats.total_connections += 1
        if daemon.config.idle_timeout > 0:
            self._idle_handle = daemon.loop.call_later(daemon.config.idle_timeout, self._check_idle)

    def _first_data(self, data: bytes) -> bytes:
        """The first read on a memcached connection: pick the protocol, and bind its receive for
        every later read."""
        conn = BinaryConnection(self._daemon.issuer) if data[0] == REQUEST_MAGIC else self._conn
        self._use(conn)
        return conn.receive(data)

    def _logged_in(self, protocol: str, rest: bytes) -> bytes:
        """The client has authenticated: from now on its reads go to the real protocol, exactly as on
        a connection without authentication; the reply to what followed the login in the same read."""
        daemon = self._daemon
        self._authenticated()
        if protocol == "binary":
            conn: TextConnection | BinaryConnection = BinaryConnection(daemon.issuer)
        else:
            conn = TextConnection(daemon.issuer, gets_cas=daemon.config.gets_cas)
        self._use(conn)
        return conn.receive(rest) if rest else b""

    def _authenticated(self) -> None:
        """No longer counted as unauthenticated, and no login deadline: the memcached login succeeded,
        an HTTP request or gRPC call carried a good token (the protocol calls its ``on_login``), or the
        connection is gone."""
        if self._unauthenticated:
            self._unauthenticated = False
            self._daemon.admission.unauthenticated -= 1
        if self._login_handle is not None:
            self._login_handle.cancel()
            self._login_handle = None

    def _login_deadline(self) -> None:
        """--login-timeout: a connection still not logged in (memcached) or that has sent no request
        with a good token (HTTP, gRPC) is closed: it would hold a place under --max-unauthenticated and
        --max-connections for the whole idle timeout. HTTP is told 408 first, gRPC a GOAWAY."""
        self._login_handle = None
        transport = self._transport
        if not self._unauthenticated or transport is None or transport.is_closing():
            return
        log.debug("closing a connection that did not authenticate within --login-timeout")
        self._daemon.admission.login_timeouts += 1
        farewell = getattr(self._conn, "login_expired", None)
        if farewell is not None:
            last_words = farewell()
            if last_words:
                transport.write(last_words)
        transport.close()

    def _data_received(self, data: bytes) -> None:
        reply = self._receive(data)
        if reply:
            self._write(reply)
        conn = self._conn
        if conn.closing or conn.wait or conn.backlog:
            self._after_receive()

    if not COMPILED:  # else the compiled ProtocolCore's data_received: the same steps in C
        data_received = _data_received

    def _after_receive(self) -> None:
        """After a read (or a resume) whose reply asks for more than a write: answer what the protocol
        held back, as far as the client takes the replies; close; or wait for the clock. Reading goes
        on unless one of these holds it, or the input held is over ``--read-ahead``."""
        conn = self._conn
        transport = self._transport
        if self._slice_handle is None and conn.backlog:
            # One slice: resume until the backlog is answered, the client lags, or SLICE has passed;
            # then the rest after every other connection has had its turn.
            end = time.perf_counter() + SLICE
            while conn.backlog and not (conn.closing or conn.wait or self._write_paused):
                reply = conn.resume()
                if reply:
                    self._write(reply)
                if conn.backlog and time.perf_counter() >= end:
                    self._slice_handle = self._daemon.loop.call_soon(self._next_slice)
                    break
        if conn.closing:
            transport.close()  # type: ignore[union-attr]
        elif conn.wait:
            self._wait_for_clock(conn.wait)
        elif conn.backlog:  # the client is behind with its replies: read ahead, up to the limit
            if (
                not isinstance(conn, _HOLDS_INPUT)  # gRPC: the rest of a read, answered a slice at a time
                or len(conn._buffer) >= self._daemon.config.read_ahead  # type: ignore[attr-defined]
                or self._eof
            ):
                transport.pause_reading()  # type: ignore[union-attr]
            else:
                transport.resume_reading()  # type: ignore[union-attr]
        elif self._eof:
            transport.close()  # type: ignore[union-attr]  # everything the client sent is answered
        elif not self._write_paused and self._wait_handle is None:
            transport.resume_reading()  # type: ignore[union-attr]

    def _next_slice(self) -> None:
        self._slice_handle = None
        transport = self._transport
        if transport is not None and not transport.is_closing():
            self._after_receive()

    def _wait_for_clock(self, seconds: float) -> None:
        """A command waits for the clock: read nothing more until it is answered."""
        if self._wait_handle is None:
            self._transport.pause_reading()  # type: ignore[union-attr]
        self._wait_handle = self._daemon.loop.call_later(seconds, self._resume)

    def _resume(self) -> None:
        self._wait_handle = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        conn = self._conn
        if self._write_paused and isinstance(conn, _HOLDS_INPUT):
            conn.wait = 0.0  # what waited is answered once the client takes its replies
        else:
            reply = conn.resume()
            if reply:
                self._write(reply)
        self._after_receive()

    def _check_idle(self) -> None:
        """Runs once per idle-timeout period, not per request: close only if no command completed
        since the previous check, otherwise look again one period later."""
        conn = self._conn
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if conn.activity == self._last_activity and self._wait_handle is None:
            log.debug("closing idle connection")
            self._say_goodbye()
            transport.close()
            return
        self._last_activity = conn.activity
        self._idle_handle = self._daemon.loop.call_later(self._daemon.config.idle_timeout, self._check_idle)

    def pause_writing(self) -> None:
        # The client is not reading its replies: answer nothing more until it catches up. A
        # memcached connection holds what arrives meanwhile (reading ahead, see _after_receive);
        # any other stops reading.
        self._write_paused = True
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        conn = self._conn
        if isinstance(conn, _HOLDS_INPUT):
            conn.backlog = True
            if len(conn._buffer) >= self._daemon.config.read_ahead:
                transport.pause_reading()
        else:
            transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        transport = self._transport
        if transport is None or transport.is_closing() or self._wait_handle is not None:
            return
        if self._conn.backlog:
            self._after_receive()  # the rest of what was read, as far as the client takes it
        else:
            transport.resume_reading()

    def eof_received(self) -> bool:
        # Close our side too once everything already answered is written. A command still waiting
        # for the clock, or input held back while the client takes its replies, keeps the connection
        # half-open until it is answered.
        self._eof = True
        return self._wait_handle is not None or self._conn.backlog

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._slice_handle is not None:
            self._slice_handle.cancel()
            self._slice_handle = None
        if self._wait_handle is not None:
            self._wait_handle.cancel()
            self._wait_handle = None
        self._authenticated()  # (uncounted: it is gone)
        if self in self._daemon.connections:
            self._daemon.connections.discard(self)
            self._daemon.stats.curr_connections -= 1
            self._daemon.connection_closed()
        release = getattr(self._conn, "release", None)  # gRPC: h2's reference cycle, broken now
        if release is not None:
            release()
        # Nothing of the protocol object stays reachable (its receive is bound here too), and this
        # handler and its transport stop referring to each other: a cycle that only the collector frees,
        # late, and the protocol object may hold much (a gRPC header block; issue 33).
        self._use(_CLOSED)
        self._write = _CLOSED.receive
        self._transport = None

    def _say_goodbye(self) -> None:
        """A protocol with last words before a close (gRPC's GOAWAY) says them now."""
        goodbye = getattr(self._conn, "goodbye", None)
        transport = self._transport
        if goodbye is not None and transport is not None and not transport.is_closing():
            farewell = goodbye()
            if farewell:
                transport.write(farewell)

    def close(self) -> None:
        """Close once everything already received is answered and written (the daemon's stop, whose
        grace period aborts what is still open): at once, unless the protocol holds input back while
        the client takes its replies; then it reads nothing more and closes when that is answered."""
        transport = self._transport
        if transport is None:
            return
        conn = self._conn
        if isinstance(conn, _HOLDS_INPUT) and conn.backlog and not (conn.closing or conn.wait):
            self._eof = True  # as if the input had ended: _after_receive closes once the rest is answered
            transport.pause_reading()
            return
        self._say_goodbye()
        transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

"""Memcached listeners served on their sockets directly: the event loop's ``add_reader`` calls the
compiled read, and the compiled write sends, with no event-loop stream object in between.

Why: with uvloop's streams every request also pays for uvloop's read callback, a context switch
into the protocol and ``transport.write``'s bookkeeping, which measured as much as our whole
protocol (about 0.5 us of user time per request, the "uvloop floor" of ``bench/RESULTS.md``). A
request here is one ``recv``, the compiled ``data_received`` and one ``send``.

:class:`SocketTransport` offers exactly the transport methods that
:class:`~katsubushi_py.daemon.connection.ConnectionHandler` uses (``write``, ``close``, ``abort``,
``pause_reading``, ``resume_reading``, ``is_closing``, ``get_extra_info``) and calls the protocol's
``connection_made``, ``data_received``, ``eof_received``, ``pause_writing``, ``resume_writing`` and
``connection_lost`` as asyncio does, so the connection glue is the same on either transport.

Its read and write are :class:`PySocketCore` (the reference, here) or ``_speedups.SocketCore``
(the compiled twin). The daemon serves plain memcached this way only when the compiled hot path runs
(:data:`DIRECT`); without it, uvloop's own streams are faster than Python-level ``recv`` and ``send``,
so the pure-Python daemon keeps them. Plain HTTP always uses the loop's streams. TLS connections, on
every listener kind and on both hot paths, are served here too (the handshake by
:class:`~katsubushi_py.daemon.tls.TlsHandshake`, then reads and writes through OpenSSL's object of the
``SSLSocket``, see :class:`PySocketCore`): cheaper than the loop's TLS transport on either path.

Worst-case memory: one 256 KiB read buffer per process (a TLS read allocates at most 64 KiB, then
shrinks to what it got), plus per connection the replies the client
has not read, bounded by the write high-water mark (above it the protocol takes no more commands) plus
one reply, and what the connection glue reads ahead meanwhile (``--read-ahead``; see
:mod:`~katsubushi_py.daemon.connection`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

from ..compiled import speedups
from .memory import TRIMMER
from .refusals import refusals
from .tls import TlsHandshake

log = logging.getLogger("katsubushi_py")

#: Replies queued for a client that does not read them: above HIGH_WATER the protocol is told to
#: stop reading (``pause_writing``); below LOW_WATER it resumes. asyncio's defaults.
HIGH_WATER = 64 * 1024
LOW_WATER = 16 * 1024
READ_SIZE = 256 * 1024  # one read per readiness event, uvloop's size (the C core's buffer)
#: The most a TLS read asks OpenSSL for: more than a record holds (16 KiB), so a read returns a whole
#: record; what OpenSSL still holds decrypted (``pending()``) is read on the next turn of the loop.
TLS_READ_SIZE = 64 * 1024
#: Unread input discarded before a close, so that the kernel ends the connection with FIN, after
#: the last reply, rather than with a reset that can destroy it (a client that sent an overlong line).
DRAIN_AT_CLOSE = 1024 * 1024
#: Connections accepted per readiness event of a listener, so that a burst of connects cannot hold
#: the loop; the rest are accepted on the next turn.
ACCEPT_BATCH = 64
#: accept() errors that mean "out of resources now": stop accepting for a moment, as asyncio does.
_ACCEPT_PAUSE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class PySocketCore:
    """The reference read and write of :class:`SocketTransport` (``_speedups.SocketCore`` is the
    compiled twin: the same steps in C).

    On a TLS connection ``_tls`` is the connection's OpenSSL object (the ``SSLSocket``'s ``_sslobj``,
    with ``read``, ``write`` and ``pending``): the read is its ``read`` (one record decrypted, at most
    ``_tls_read_size`` bytes), the write its ``write``; what they raise goes to the transport's
    ``_tls_failed`` (a read) or ``_tls_write_failed`` (a write), which decide in Python."""

    __slots__ = ("_closing", "_data_received", "_fd", "_pending", "_tls", "_tls_partial", "_tls_read_size")

    _fd: int
    _sock: socket.socket  # the subclass's
    _pending: bool
    _closing: bool
    _data_received: Any
    _tls: Any
    _tls_partial: bool
    _tls_read_size: int

    def _readable(self) -> None:
        """The loop's reader callback: one read, handed to the protocol."""
        if self._closing or self._data_received is None:
            return
        tls = self._tls
        if tls is not None:
            try:
                data = tls.read(self._tls_read_size)
            except OSError as exc:  # SSLError and its kinds are OSErrors
                self._tls_failed(exc)
                return
            if data:
                self._tls_partial = False
                self._data_received(data)
                # A read that got less than it asked for emptied OpenSSL's record: nothing is pending.
                full = len(data) == self._tls_read_size
                if full and not self._closing and self._data_received is not None and tls.pending():
                    self._tls_more()
            else:
                self._eof_received()
            return
        try:
            data = self._sock.recv(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fatal(exc.errno or errno.EIO)
            return
        if data:
            self._data_received(data)
        else:
            self._eof_received()

    def _tls_pending(self) -> bool:
        """Whether OpenSSL holds decrypted bytes of this connection (the fd will not announce them)."""
        return self._tls is not None and bool(self._tls.pending())

    def write(self, data: bytes) -> None:
        """Send now when nothing is queued; what the kernel does not take is queued."""
        if self._closing:
            return
        if self._pending or type(data) is not bytes:
            self._queue(data)
            return
        if not data:
            return
        tls = self._tls
        if tls is not None:
            try:
                sent = tls.write(data)
            except OSError as exc:
                self._tls_write_failed(exc, data)
                return
        else:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._fatal(exc.errno or errno.EIO)
                return
        if sent < len(data):
            self._queue(data[sent:])

    # What the core calls back (implemented by SocketTransport).
    def _queue(self, data: bytes) -> None:
        raise NotImplementedError

    def _eof_received(self) -> None:
        raise NotImplementedError

    def _fatal(self, err: int) -> None:
        raise NotImplementedError

    def _tls_failed(self, exc: OSError) -> None:
        raise NotImplementedError

    def _tls_write_failed(self, exc: OSError, data: bytes) -> None:
        raise NotImplementedError

    def _tls_more(self) -> None:
        raise NotImplementedError


#: True when memcached listeners are served with :class:`SocketTransport` (the compiled hot path runs).
DIRECT = speedups is not None


def _ssl_reports_a_reset_as_eof() -> bool:
    """How this Python's ``_ssl`` reports a read that failed with a system error (errno set, nothing
    in OpenSSL's queue: a reset): ``SSLEOFError`` (CPython 3.10 to 3.12) or the ``OSError`` of errno
    (3.13, gh-115627). The direct calls must raise what the object raises (``_tls_failed`` makes the
    first an end of file and the second a failed connection), so it is asked, once: a TLS client on a
    socket pair whose peer closes with the ClientHello unread (the next read fails with ECONNRESET)."""
    a, b = socket.socketpair()
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        client = ctx.wrap_socket(a, do_handshake_on_connect=False)
    except (OSError, ValueError):
        a.close()
        b.close()
        return True
    try:
        client.setblocking(False)
        obj = client._sslobj  # type: ignore[attr-defined]
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.read(1)  # sends the ClientHello, finds nothing to read
        b.close()
        try:
            obj.read(1)
        except ssl.SSLEOFError:
            return True
        except OSError:
            return False
        return True
    finally:
        client.close()
        b.close()


#: How this Python's ``_ssl`` reports a reset (see :func:`_ssl_reports_a_reset_as_eof`); None until asked.
SSL_RESET_IS_EOF: bool | None = None


def _tls_direct_setup() -> bool:
    """Let the compiled core call OpenSSL directly on TLS connections (``_tls_direct.h``: the OpenSSL
    of Python's own ``_ssl`` module, found in its shared object). Off without the compiled core, with
    ``KATSUBUSHI_TLS_DIRECT=0`` (a diagnostic switch: the object's methods are used, slower, the same
    behaviour), or where ``_ssl`` is not a shared object of its own."""
    setup = getattr(speedups, "tls_direct_setup", None)
    if setup is None:
        return False
    if os.environ.get("KATSUBUSHI_TLS_DIRECT", "") == "0":
        return bool(setup(None))
    path = getattr(ssl._ssl, "__file__", None)  # type: ignore[attr-defined]
    if path is None:
        return bool(setup(None))
    global SSL_RESET_IS_EOF
    SSL_RESET_IS_EOF = _ssl_reports_a_reset_as_eof()
    return bool(setup(path, SSL_RESET_IS_EOF))


#: True when TLS connections on the compiled core call OpenSSL directly (see :func:`_tls_direct_setup`).
TLS_DIRECT = _tls_direct_setup()

_TRANSPORT_SLOTS = (
    "_aborted",
    "_eof",
    "_extra",
    "_loop",
    "_lost",
    "_out",
    "_out_size",
    "_paused_protocol",
    "_protocol",
    "_reading",
    "_sock",
    "_writing",
)


_TLS_EXTRA: dict[str, Any] = {
    "ssl_object": lambda sock: sock,
    "sslcontext": lambda sock: sock.context,
    "peercert": lambda sock: sock.getpeercert(),
    "cipher": lambda sock: sock.cipher(),
    "compression": lambda sock: sock.compression(),
}


class _Transport:
    """A connected, non-blocking stream socket driven by the loop's reader and writer callbacks:
    everything but the read and the first attempt of a write, which are the core's."""

    __slots__ = ()

    _fd: int
    _data_received: Any
    _pending: bool
    _closing: bool
    _readable: Any
    _tls_pending: Any

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: asyncio.Protocol) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._data_received = None
        self._pending = False
        self._closing = False
        self._out: deque[bytes] = deque()
        self._out_size = 0
        self._reading = False
        self._writing = False
        self._eof = False
        self._lost = False
        self._paused_protocol = False
        self._aborted = False
        self._extra: dict[str, Any] = {"socket": sock}
        self._tls = None
        self._tls_partial = False
        self._tls_read_size = TLS_READ_SIZE
        if isinstance(sock, ssl.SSLSocket):
            # The handshake is done (see TlsHandshake): read and write through OpenSSL's object itself,
            # what SSLSocket.read and .write call after their Python-level checks.
            self._tls = sock._sslobj  # type: ignore[attr-defined]

    def start(self) -> None:
        """Tell the protocol, then start reading (unless it closed the connection at once)."""
        self._protocol.connection_made(self)
        self._data_received = self._protocol.data_received
        self.resume_reading()
        if self._reading and self._tls is None:
            # Read at once: a client that connected and already closed (a port probe) is lost now,
            # before the next accepted connection is counted against --max-connections; one that
            # already sent its first request is answered without waiting for the next poll. (Not
            # over TLS: there a read that finds nothing would look like a record begun.)
            self._readable()

    # -- the transport API the connection glue uses ---------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """asyncio's names: ``socket``, ``peername``, ``sockname``, and over TLS ``ssl_object`` (the
        SSLSocket), ``sslcontext``, ``peercert``, ``cipher``, ``compression``, as uvloop gives them."""
        if name not in self._extra:
            sock = self._sock
            try:
                if name in ("peername", "sockname"):
                    self._extra[name] = sock.getpeername() if name == "peername" else sock.getsockname()
                elif self._tls is not None and name in _TLS_EXTRA:
                    self._extra[name] = _TLS_EXTRA[name](sock)
            except (OSError, ValueError):
                return default
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        # Never after end of file: a socket at EOF is always readable, so its reader would spin.
        if not self._reading and not self._closing and not self._eof:
            self._reading = True
            self._loop.add_reader(self._fd, self._readable)
            if self._tls is not None and self._tls_pending():
                self._tls_more()  # decrypted while reading was paused: the fd may never be readable for it

    def close(self) -> None:
        """Stop reading; close once every queued reply is sent (then ``connection_lost(None)``)."""
        if self._closing:
            return
        self.pause_reading()
        self._closing = True
        if not self._out:
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        """Close now, dropping what is queued (over TLS without a close_notify, as uvloop aborts)."""
        self.pause_reading()
        self._closing = True
        self._aborted = True
        self._out.clear()
        self._out_size = 0
        self._loop.call_soon(self._connection_lost, None)

    # -- what the read and write core call back --------------------------------------------------
    def _queue(self, data: bytes) -> None:
        if self._closing or not data:
            return
        self._out.append(bytes(data))
        self._out_size += len(data)
        self._pending = True
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._writable)
        if self._out_size > HIGH_WATER and not self._paused_protocol:
            self._paused_protocol = True
            self._protocol.pause_writing()

    def _writable(self) -> None:
        out = self._out
        # Over TLS a write that OpenSSL could not finish (SSLWantWriteError) is retried with the same
        # bytes, as OpenSSL requires: the chunk stays at the head of the queue until it is all sent.
        send = self._sock.send if self._tls is None else self._tls.write
        while out:
            chunk = out[0]
            try:
                sent = send(chunk)
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except OSError as exc:
                self._out.clear()
                self._out_size = 0
                self._fatal(exc.errno or errno.EIO)
                return
            self._out_size -= sent
            if sent < len(chunk):
                out[0] = chunk[sent:]
                return
            out.popleft()
        self._writing = False
        self._pending = False
        self._loop.remove_writer(self._fd)
        if self._closing:
            self._connection_lost(None)
            return
        if self._paused_protocol and self._out_size <= LOW_WATER:
            self._paused_protocol = False
            self._protocol.resume_writing()

    def _eof_received(self) -> None:
        self.pause_reading()
        self._eof = True
        if not self._protocol.eof_received():
            # Not inside a protocol callback any more, so the connection may be lost at once: a
            # client that connected and closed stops counting against --max-connections now.
            self._closing = True
            if not self._out:
                self._connection_lost(None)

    def _fatal(self, err: int) -> None:
        """The connection failed (reset by the peer, a broken pipe): close it without flushing."""
        log.debug("connection error: %s", os.strerror(err))
        self.abort()

    # -- TLS: what the core hands back to Python ------------------------------------------------------
    def _tls_failed(self, exc: OSError) -> None:
        """A TLS read raised. Want-read: the fd was readable but OpenSSL holds only part of a record,
        so the request deadline starts (``_tls_partial``; see :mod:`.deadlines`): a record trickled
        in a byte at a time is closed within --request-timeout, not the idle timeout. The peer's
        close_notify, or its TCP close without one: end of file. Anything else: a failed connection."""
        if isinstance(exc, ssl.SSLWantReadError):
            self._tls_partial = True
        elif isinstance(exc, ssl.SSLWantWriteError | BlockingIOError | InterruptedError):
            return
        elif isinstance(exc, ssl.SSLZeroReturnError | ssl.SSLEOFError):
            self._eof_received()
        else:
            log.debug("TLS connection error: %s", exc)
            self.abort()

    def _tls_write_failed(self, exc: OSError, data: bytes) -> None:
        """A TLS write raised: OpenSSL could not send the record now (queued, retried as it is when
        the fd is writable), or the connection failed."""
        if isinstance(exc, ssl.SSLWantWriteError | ssl.SSLWantReadError | BlockingIOError | InterruptedError):
            self._queue(data)
        else:
            log.debug("TLS connection error: %s", exc)
            self.abort()

    def _tls_more(self) -> None:
        self._loop.call_soon(self._tls_drain)

    def _tls_drain(self) -> None:
        """Read what OpenSSL holds decrypted (``pending()``), unless reading has stopped meanwhile or
        the reader callback has read it already (then a read would find nothing: not a record begun)."""
        if self._reading and not self._closing and self._tls is not None and self._tls_pending():
            self._readable()

    def _connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self.pause_reading()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        self._data_received = None
        try:
            self._protocol.connection_lost(exc)
        finally:
            if self._tls is not None and not self._aborted:
                # A graceful close says close_notify (one record, no wait for the peer's): clients
                # then see a clean end of the stream, as from uvloop's TLS transport.
                with contextlib.suppress(OSError, ValueError):
                    self._tls.shutdown()
            drained = 0
            recv = socket.socket.recv  # (the raw socket's: unread TLS records are not decrypted)
            with contextlib.suppress(OSError):  # BlockingIOError when nothing is left
                while drained < DRAIN_AT_CLOSE:
                    chunk = recv(self._sock, 65536)
                    if not chunk:
                        break
                    drained += len(chunk)
            self._sock.close()


class PySocketTransport(_Transport, PySocketCore):
    """The transport on the reference core."""

    __slots__ = _TRANSPORT_SLOTS


if speedups is not None:

    class SocketTransport(_Transport, speedups.SocketCore):  # type: ignore[misc,name-defined]
        """The transport on the compiled core."""

        __slots__ = _TRANSPORT_SLOTS

else:
    SocketTransport = PySocketTransport  # type: ignore[misc]


class SocketServer:
    """Accepts on one listening socket and serves each connection with a :class:`SocketTransport`;
    with ``tls_context``, each after its TLS handshake (:class:`TlsHandshake`).

    Has the two methods of ``asyncio.Server`` the daemon uses (``close``, ``wait_closed``) and
    ``sockets``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        protocol_factory: Any,
        backlog: int,
        transport: type = SocketTransport,
        tls_context: ssl.SSLContext | None = None,
        handshake_timeout: float | None = None,
        admit: Callable[[], bool] | None = None,
    ) -> None:
        self._loop = loop
        self._admit = admit  # may a TLS handshake begin? (else the socket is closed at once)
        self._transport = transport
        self._tls_context = tls_context
        self._handshake_timeout = handshake_timeout
        self._handshakes: set[TlsHandshake] = set()  # (TlsHandshake adds and removes itself)
        self._sock = sock
        self._factory = protocol_factory
        self._tcp = sock.family in (socket.AF_INET, socket.AF_INET6)
        self._closed = False
        self._resume_handle: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        sock.listen(backlog)
        loop.add_reader(sock.fileno(), self._accept)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return () if self._closed else (self._sock,)

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_PAUSE_ERRNOS:
                    # Out of file descriptors or memory: try again in a second rather than spin. Said
                    # at most once every 10 s (every listener, every second, would flood the log).
                    refusals(
                        "accept",
                        logging.WARNING,
                        "cannot accept connections now: %s; retrying every second (new clients wait in the"
                        " backlog; see --max-connections and LimitNOFILE)",
                        exc.strerror or exc,
                    )
                    self._loop.remove_reader(self._sock.fileno())
                    self._resume_handle = self._loop.call_later(1.0, self._resume_accepting)
                    return
                continue  # the client gave up before we accepted (ECONNABORTED, EPROTO, ...)
            try:
                conn.setblocking(False)
                if self._tcp:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls_context is not None:
                    if self._admit is not None and not self._admit():
                        conn.close()
                        TRIMMER.closed()
                        continue
                    tls = self._tls_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                    TlsHandshake(self, tls, self._handshake_timeout)
                    continue
                self._transport(self._loop, conn, self._factory()).start()
            except OSError as exc:  # the client reset the connection at once
                log.debug("dropped a new connection: %s", exc)
                conn.close()

    def _resume_accepting(self) -> None:
        self._resume_handle = None
        if not self._closed:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._resume_handle is not None:
            self._resume_handle.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        for handshake in list(self._handshakes):
            handshake.close()

    async def wait_closed(self) -> None:
        return None


def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Listening-ready TCP sockets for ``host:port``, one per address the host resolves to (as
    ``loop.create_server`` binds them: ``SO_REUSEADDR``, IPv6 sockets IPv6-only). On failure every
    socket made so far is closed and the OSError raised."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    made: list[socket.socket] = []
    seen = set()
    try:
        for family, type_, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, type_, proto)
            made.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in made:
            sock.close()
        raise
    return made


def bind_unix(path: str, mode: int | None = None) -> socket.socket:
    """A unix stream socket bound at ``path`` (which must not exist), not yet listening.

    With ``mode`` (``--sock-mode``) the file never has a wider mode than that, not even for an
    instant: it is created under a umask that also masks every bit ``mode`` lacks (only ever
    narrower than the process's own, so a file another thread creates meanwhile is never wider than
    it would be), then set to exactly ``mode``, and only then may the caller listen. Binding with the
    process's umask and chmodding after ``listen`` let another local user connect (and take IDs) in
    between. Until ``listen`` a connect is refused whatever the mode."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if mode is None:
            sock.bind(path)
        else:
            old = os.umask(0o777)  # reading the umask means setting it: this value only narrows
            try:
                os.umask(old | (0o777 & ~mode))
                sock.bind(path)
            finally:
                os.umask(old)
            os.chmod(path, mode)
    except OSError:
        sock.close()
        raise
    return sock

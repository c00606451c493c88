"""The asyncio client: a small asyncio Protocol per connection, the sans-IO checks of :mod:`.replies`,
and the same failover as the blocking client (:mod:`.servers`).

Why not aiomcache, the well-kept asyncio memcached client: it cannot reach a unix socket; its
``multi_get`` sends ``GETS`` and needs a CAS field that katsubushi's replies do not carry (so one
round trip for n IDs is out of reach through its public API); its pool waits without a bound when
exhausted; and a call cancelled by a timeout puts its connection back into the pool with the reply
still unread (it marks connections broken on ``Exception`` only, and cancellation is not one), so the
next call on it would read someone else's reply. What an ID client needs from the protocol is one
request line and a reply that ends at ``END`` or an error line: a few lines here, with the framing and
every check shared with the blocking client.

Each call runs under ``asyncio.timeout`` per server; a connection whose call was cancelled or failed
is closed, never reused. Idle connections (up to ``pool_size`` per server) belong to the event loop
that made them: used from another loop (a second ``asyncio.run``) or in a forked child, the client
drops them and connects again. One AsyncClient serves any number of tasks of one event loop; it is
not meant to be shared between threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TypeVar

from .replies import (
    ReplyError,
    check_count,
    describe,
    get_request,
    parse_ids,
    parse_stats,
    reply_complete,
)
from .servers import DEFAULT_SERVERS, Failover, ServerAddress, ServerState, ServerStatus

T = TypeVar("T")

#: Longer than any reply to 1,000 keys or to STATS: a server sending more is not a katsubushi.
MAX_REPLY = 256 * 1024

_STALE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_ONE = get_request(1)
_STATS = b"stats\r\n"


class _Connection(asyncio.Protocol):
    """One connection: one request at a time, its reply collected until it is whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._buffer = b""
        self._waiter: asyncio.Future[bytes] | None = None
        self._used = False  # a request was sent
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        waiter = self._waiter
        if waiter is None:
            if self._used:  # bytes nobody asked for: the connection cannot be trusted any more
                self.close()
            else:  # a refusal sent on accept ("too many connections"): the first request's reply
                self._buffer = buffer
            return
        if reply_complete(buffer):
            self._waiter = None
            self._buffer = b""
            if not waiter.done():
                waiter.set_result(buffer)
        elif len(buffer) > MAX_REPLY:
            self._fail(ReplyError(f"reply longer than {MAX_REPLY} bytes"))
            self.close()
        else:
            self._buffer = buffer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("connection closed by the server"))

    def _fail(self, exc: Exception) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    async def request(self, line: bytes) -> bytes:
        if self._buffer and reply_complete(self._buffer):  # the server spoke first (a refusal)
            self._used = True
            buffer, self._buffer = self._buffer, b""
            return buffer
        if self.closed or self._transport is None:
            raise ConnectionResetError("connection closed by the server")
        self._used = True
        waiter = self._waiter = self._loop.create_future()
        self._transport.write(line)
        return await waiter

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # its event loop is already closed
                self._transport.close()


def _ids(n: int) -> Callable[[bytes], list[int]]:
    return lambda reply: parse_ids(reply, n)


def _one_id(reply: bytes) -> list[int]:
    return parse_ids(reply, 1)


class AsyncClient:
    """The asyncio twin of :class:`~katsubushi_py.client.Client`: same arguments, same failover,
    ``await`` on each call. Share one between all tasks of an event loop."""

    def __init__(
        self,
        servers: str | Iterable[str] = DEFAULT_SERVERS,
        *,
        timeout: float = 1.0,
        server_timeout: float | None = None,
        backoff: float = 0.2,
        max_backoff: float = 10.0,
        pool_size: int = 4,
    ) -> None:
        self._failover = Failover(servers, timeout, server_timeout, backoff, max_backoff)
        if pool_size < 0:
            raise ValueError("pool_size must not be negative")
        self._pool_size = pool_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()

    # -- the API ---------------------------------------------------------------------------------
    async def fetch(self) -> int:
        """One ID."""
        return (await self._call(_ONE, _one_id))[0]

    async def fetch_many(self, n: int) -> list[int]:
        """``n`` increasing IDs (1 <= n <= 1000) in one round trip: one ``GET`` with ``n`` keys."""
        check_count(n)
        return await self._call(get_request(n), _ids(n))

    async def stats(self) -> dict[str, int | str]:
        """The STATS of the server the next fetch would use (the same failover), numbers as ints."""
        return await self._call(_STATS, parse_stats)

    def server_status(self) -> list[ServerStatus]:
        """How each server is doing: failures in a row, seconds until it is asked again, last error."""
        return self._failover.statuses()

    async def close(self) -> None:
        """Close the idle connections. The client stays usable: a later call connects again."""
        for server in self._failover.servers:
            _drain(server)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        servers = ", ".join(s.address.text for s in self._failover.servers)
        return f"AsyncClient([{servers}], timeout={self._failover.timeout:g})"

    # -- failover --------------------------------------------------------------------------------
    async def _call(self, line: bytes, parse: Callable[[bytes], T]) -> T:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._pid != os.getpid():
            self._adopt(loop)
        call = self._failover.call()
        for server, seconds in call:
            start = time.monotonic()
            try:
                async with asyncio.timeout(seconds):
                    result = await self._attempt(server, line, parse, loop)
            except Exception as exc:
                call.failed(server, describe(exc, time.monotonic() - start))
                continue
            call.succeeded(server)
            return result
        raise call.error()

    async def _attempt(
        self, server: ServerState, line: bytes, parse: Callable[[bytes], T], loop: asyncio.AbstractEventLoop
    ) -> T:
        """Ask one server, on a pooled connection or a new one; if a pooled connection turns out to
        have been closed by the server, reconnect once."""
        connection = _take(server)
        reused = connection is not None
        if connection is None:
            connection = await _connect(server.address, loop)
        try:
            result = parse(await connection.request(line))
        except _STALE:
            connection.close()
            if not reused:
                raise
            _drain(server)  # the others were probably closed by the same restart
            connection = await _connect(server.address, loop)
            try:
                result = parse(await connection.request(line))
            except BaseException:
                connection.close()
                raise
        except BaseException:  # including cancellation by the timeout: the reply may still come
            connection.close()
            raise
        if len(server.idle) < self._pool_size:
            server.idle.append(connection)
        else:
            connection.close()
        return result

    def _adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """First use, a new event loop, or a forked child: connections made elsewhere are dropped."""
        for server in self._failover.servers:
            _drain(server)
        self._loop = loop
        self._pid = os.getpid()


def _take(server: ServerState) -> _Connection | None:
    """An idle connection the server has not closed meanwhile, if there is one."""
    idle = server.idle
    while idle:
        connection: _Connection = idle.pop()
        if not connection.closed:
            return connection
    return None


def _drain(server: ServerState) -> None:
    idle = server.idle
    while idle:
        idle.pop().close()


async def _connect(address: ServerAddress, loop: asyncio.AbstractEventLoop) -> _Connection:
    if address.path is not None:
        _, connection = await loop.create_unix_connection(lambda: _Connection(loop), address.path)
    else:
        _, connection = await loop.create_connection(lambda: _Connection(loop), address.host, address.port)
    return connection

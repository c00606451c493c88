"""The blocking client: pymemcache for each connection, our failover around it.

Why pymemcache: it is a well-kept memcached client that speaks the text protocol the way every
katsubushi does, with timeouts and unix sockets; writing another one by hand would add nothing. What
it lacks for an ID service is added here: failover with backoff (:mod:`.servers`), a deadline for the
whole call, checked IDs (:mod:`.replies`), a pool per server that threads share, and fork safety.

**The deadline.** pymemcache's ``timeout`` bounds each socket operation, so a server that trickles a
byte just within it could hold a call forever. Through pymemcache's ``socket_module`` hook each
connection gets sockets whose every connect, send and receive ends at the attempt's deadline (within
a millisecond).

**Threads.** Each server keeps up to ``pool_size`` idle connections in a deque (whose ``pop`` and
``append`` are atomic); a call takes one or opens one, and puts it back only after a complete,
correct reply, so a connection that timed out or failed mid-reply is never reused. More concurrent
calls than ``pool_size`` open extra connections instead of waiting, and close them afterwards.

**fork().** Each call compares ``os.getpid()`` with the pid that filled the pools; in a child the
inherited connections are closed (only the child's copies of the sockets: the parent's connections
are untouched) and new ones are opened on demand, so parent and child never share a socket.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TypeVar

from pymemcache.client.base import Client as PymemcacheClient
from pymemcache.exceptions import (
    MemcacheClientError,
    MemcacheServerError,
    MemcacheUnexpectedCloseError,
    MemcacheUnknownCommandError,
    MemcacheUnknownError,
)

from .replies import (
    KEYS,
    ONE_KEY,
    ReplyError,
    ServerErrorReply,
    check_count,
    describe,
    ids_from_values,
    stat_value,
)
from .servers import DEFAULT_SERVERS, Failover, ServerAddress, ServerState, ServerStatus

T = TypeVar("T")

_SLACK = 0.001  # seconds a socket call may end after the deadline (see _DeadlineSocket)

# What a connection taken from the pool shows when the server closed it meanwhile (idle timeout,
# restart): worth one reconnect within the same call.
_STALE = (MemcacheUnexpectedCloseError, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _DeadlineSocket(socket.socket):
    """A socket whose blocking calls end by its connection's current deadline (give or take
    ``_SLACK``: ``settimeout`` costs a system call, so the timeout is re-armed only when the time left
    has shrunk by more than that since it was set; in a quick exchange it is not re-armed at all)."""

    __slots__ = ("connection",)
    connection: _Connection

    def _arm(self) -> None:
        remaining = self.connection.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        timeout = self.gettimeout()
        if timeout is None or timeout > remaining + _SLACK:
            self.settimeout(remaining)

    def connect(self, address: object) -> None:  # type: ignore[override]
        self._arm()
        super().connect(address)  # type: ignore[arg-type]

    def sendall(self, data: bytes, flags: int = 0) -> None:  # type: ignore[override]
        self._arm()
        super().sendall(data, flags)

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)


class _Connection:
    """One pymemcache connection to one server. It is also the ``socket_module`` pymemcache uses,
    so the sockets it makes know this connection's deadline."""

    __slots__ = ("deadline", "memcache")

    def __init__(self, address: ServerAddress, timeout: float) -> None:
        self.deadline = 0.0
        server: str | tuple[str, int] = address.path if address.path else (address.host, address.port)  # type: ignore[assignment]
        self.memcache = PymemcacheClient(
            server,
            connect_timeout=timeout,
            timeout=timeout,
            no_delay=True,
            socket_module=self,  # type: ignore[arg-type]
        )

    def socket(self, family: int = -1, type: int = -1, proto: int = -1) -> _DeadlineSocket:
        sock = _DeadlineSocket(family, type, proto)
        sock.connection = self
        return sock

    def __getattr__(self, name: str) -> object:  # the rest of the socket module: constants, getaddrinfo
        return getattr(socket, name)

    def close(self) -> None:
        self.memcache.close()


def _get_one(memcache: PymemcacheClient) -> list[int]:
    return ids_from_values([memcache.get(ONE_KEY)], 1)


def _get_many(n: int) -> Callable[[PymemcacheClient], list[int]]:
    keys = KEYS[:n]

    def get(memcache: PymemcacheClient) -> list[int]:
        found = memcache.get_many(keys)
        if len(found) != n:
            raise ReplyError(f"{len(found)} values for {n} keys")
        return ids_from_values([found.get(key) for key in keys], n)

    return get


def _stats(memcache: PymemcacheClient) -> dict[str, int | str]:
    return {
        (name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)): stat_value(value)
        for name, value in memcache.stats().items()
    }


class Client:
    """Fetch IDs from katsubushi daemons, falling over between them; safe to share between threads
    and across ``fork()``.

    ``servers``: ``host:port`` or ``unix:/path`` strings, in order of preference (a list, or one
    string separated by commas). ``timeout``: the most a call may take, across all servers.
    ``server_timeout``: the most one server may take of it (default: all of it with one server, half
    with more). ``backoff``/``max_backoff``: how long a failed server is left alone, doubling with
    each failure in a row. ``pool_size``: idle connections kept per server.
    """

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
        self._pid = os.getpid()

    # -- the API ---------------------------------------------------------------------------------
    def fetch(self) -> int:
        """One ID."""
        return self._call(_get_one)[0]

    def fetch_many(self, n: int) -> list[int]:
        """``n`` increasing IDs (1 <= n <= 1000) in one round trip: one ``GET`` with ``n`` keys."""
        check_count(n)
        return self._call(_get_one if n == 1 else _get_many(n))

    def stats(self) -> dict[str, int | str]:
        """The STATS of the server the next fetch would use (the same failover), numbers as ints."""
        return self._call(_stats)

    def server_status(self) -> list[ServerStatus]:
        """How each server is doing: failures in a row, seconds until it is asked again, last error."""
        return self._failover.statuses()

    def close(self) -> None:
        """Close the idle connections. The client stays usable: a later call connects again."""
        for server in self._failover.servers:
            self._drain(server)

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        servers = ", ".join(s.address.text for s in self._failover.servers)
        return f"Client([{servers}], timeout={self._failover.timeout:g})"

    # -- failover --------------------------------------------------------------------------------
    def _call(self, request: Callable[[PymemcacheClient], T]) -> T:
        if self._pid != os.getpid():
            self._forget_parent_connections()
        call = self._failover.call()
        for server, seconds in call:
            start = time.monotonic()
            try:
                result = self._attempt(server, start + seconds, request)
            except Exception as exc:
                call.failed(server, describe(_ours(exc), time.monotonic() - start))
                continue
            call.succeeded(server)
            return result
        raise call.error()

    def _attempt(self, server: ServerState, deadline: float, request: Callable[[PymemcacheClient], T]) -> T:
        """Ask one server, on a pooled connection or a new one; if a pooled connection turns out to
        have been closed by the server, reconnect once."""
        try:
            connection = server.idle.pop()
            reused = True
        except IndexError:
            connection = _Connection(server.address, self._failover.server_timeout)
            reused = False
        connection.deadline = deadline
        try:
            result = request(connection.memcache)
        except _STALE:
            connection.close()
            if not reused:
                raise
            self._drain(server)  # the others were probably closed by the same restart
            connection = _Connection(server.address, self._failover.server_timeout)
            connection.deadline = deadline
            try:
                result = request(connection.memcache)
            except BaseException:
                connection.close()
                raise
        except BaseException:
            connection.close()
            raise
        if len(server.idle) < self._pool_size:
            server.idle.append(connection)
        else:
            connection.close()
        return result

    @staticmethod
    def _drain(server: ServerState) -> None:
        while True:
            try:
                server.idle.pop().close()
            except IndexError:
                return

    def _forget_parent_connections(self) -> None:
        """In a forked child: drop the connections inherited from the parent. Closing them here
        closes only this process's copies of the sockets."""
        self._pid = os.getpid()
        for server in self._failover.servers:
            self._drain(server)


def _ours(exc: Exception) -> Exception:
    """pymemcache's error replies as ours, so both clients describe them alike. (Its exception
    classes nest: an unexpected close is a server error, ERROR is a client error.)"""
    if isinstance(exc, MemcacheUnexpectedCloseError):
        return ConnectionResetError("connection closed by the server")
    if isinstance(exc, MemcacheServerError):
        return ServerErrorReply("SERVER_ERROR " + _text(exc))
    if isinstance(exc, MemcacheUnknownCommandError):
        return ServerErrorReply("ERROR")
    if isinstance(exc, MemcacheClientError):
        return ServerErrorReply("CLIENT_ERROR " + _text(exc))
    if isinstance(exc, MemcacheUnknownError):
        return ReplyError(f"unexpected line {_text(exc)!r}")
    if isinstance(exc, (KeyError, ValueError)) and not isinstance(exc, ReplyError):
        return ReplyError(str(exc))  # pymemcache could not parse a VALUE line
    return exc


def _text(exc: Exception) -> str:
    arg = exc.args[0] if exc.args else b""
    return arg.decode("ascii", "replace") if isinstance(arg, bytes) else str(arg)

"""Server addresses, each server's failure memory, and the failover plan both clients follow.

The rules, the same for :class:`~katsubushi_py.client.Client` and
:class:`~katsubushi_py.client.AsyncClient`:

- **Order.** Servers are tried in the order given. Any daemon may serve any call: each has its own
  worker id, so falling back never risks a duplicate.
- **Backoff.** A server that fails is not asked again for ``backoff`` seconds, doubled with each
  further failure in a row up to ``max_backoff``; one success forgets its failures. While it backs
  off, the servers after it are asked first. Servers still backing off are the last resort: they are
  tried (soonest retry first) only when no other server answered, so a short outage of every server
  costs calls only while it lasts.
- **Deadline.** A call never takes longer than ``timeout`` in all (plus name resolution of a host
  name). Each server gets at most ``server_timeout`` of it, so that one server that swallows packets
  leaves time for the next. A server not reached before the deadline is reported as not tried.
- **One error.** When every server fails, :class:`AllServersFailed` says what happened at each.

State is shared by the threads (or tasks) of one client without a lock: an update lost to a race only
blurs a failure count, never the IDs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

DEFAULT_PORT = 11212
DEFAULT_SERVERS = ("127.0.0.1:11212",)

#: The environment variable the ``get`` command (and applications, if they like) read servers from.
SERVERS_ENV = "KATSUBUSHI_SERVERS"


# Less time than this left is no attempt at all (event loops such as uvloop time in whole ms, so a
# timer may fire a hair before the deadline).
_MIN_ATTEMPT = 0.001


class ClientError(Exception):
    """Base class of the client's own errors."""


class AllServersFailed(ClientError):
    """No server issued the IDs in time. ``errors`` maps each server (in the order they were
    considered) to what happened there."""

    def __init__(self, errors: dict[str, str], timeout: float) -> None:
        self.errors = errors
        self.timeout = timeout
        detail = "; ".join(f"{server}: {error}" for server, error in errors.items())
        which = "the katsubushi server" if len(errors) == 1 else f"all {len(errors)} katsubushi servers"
        super().__init__(f"{which} failed: {detail}")

    def __reduce__(self) -> tuple[type[AllServersFailed], tuple[dict[str, str], float]]:
        return AllServersFailed, (self.errors, self.timeout)  # picklable, e.g. across multiprocessing


@dataclass(frozen=True)
class ServerAddress:
    """``host:port`` (TCP; IPv6 hosts in brackets) or ``unix:/path``."""

    text: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    def __str__(self) -> str:
        return self.text


def parse_server(text: str) -> ServerAddress:
    """``host:port``, ``host`` (port 11212), ``[::1]:11212`` or ``unix:/path``; ValueError otherwise."""
    spec = text.strip()
    if spec.startswith("unix:"):
        path = spec[5:]
        if path.startswith("//"):  # unix:///run/k.sock, URL style
            path = path[2:]
        if not path:
            raise ValueError(f"server {text!r}: no socket path after 'unix:'")
        return ServerAddress(f"unix:{path}", path=path)
    if spec.startswith("["):
        end = spec.find("]")
        if end < 0:
            raise ValueError(f"server {text!r}: no ']' after the IPv6 address")
        host, rest = spec[1:end], spec[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"server {text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else ""
    else:
        host, colon, port_text = spec.rpartition(":")
        if not colon:
            host, port_text = spec, ""
        elif ":" in host:
            raise ValueError(f"server {text!r}: write IPv6 addresses in brackets, e.g. [::1]:{DEFAULT_PORT}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"server {text!r}: expected host:port or unix:/path")
    if port_text == "":
        port = DEFAULT_PORT
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise ValueError(f"server {text!r}: port must be a number from 1 to 65535")
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return ServerAddress(shown, host=host, port=port)


def parse_servers(servers: str | Iterable[str]) -> list[ServerAddress]:
    """A list of servers, or one string of them separated by commas or whitespace."""
    items = servers.replace(",", " ").split() if isinstance(servers, str) else list(servers)
    if not items:
        raise ValueError("no katsubushi server given")
    return [parse_server(item) for item in items]


class ServerStatus(NamedTuple):
    """A snapshot of one server's health as the client sees it."""

    server: str
    failures: int  # failures in a row; 0 once it answers again
    retry_in: float  # seconds until it is asked again (0: not backing off)
    last_error: str | None


class ServerState:
    """One server of one client: its address, its failure memory and its idle connections."""

    __slots__ = ("address", "failures", "idle", "last_error", "retry_at")

    def __init__(self, address: ServerAddress) -> None:
        self.address = address
        self.failures = 0
        self.retry_at = 0.0  # time.monotonic() from which it may be asked again
        self.last_error: str | None = None
        self.idle: deque[Any] = deque()  # connections not in use; pop/append are atomic

    def status(self, now: float) -> ServerStatus:
        return ServerStatus(self.address.text, self.failures, max(0.0, self.retry_at - now), self.last_error)


class Failover:
    """The servers of one client and the rules for trying them (see the module docstring)."""

    def __init__(
        self,
        servers: str | Iterable[str],
        timeout: float,
        server_timeout: float | None,
        backoff: float,
        max_backoff: float,
    ) -> None:
        self.servers = [ServerState(address) for address in parse_servers(servers)]
        if not timeout > 0:
            raise ValueError("timeout must be positive")
        if server_timeout is None:
            # With a fallback, a server that swallows packets may use at most half of the call.
            server_timeout = timeout if len(self.servers) == 1 else timeout / 2
        if not server_timeout > 0:
            raise ValueError("server_timeout must be positive")
        if backoff < 0 or max_backoff < backoff:
            raise ValueError("need 0 <= backoff <= max_backoff")
        self.timeout = float(timeout)
        self.server_timeout = min(float(server_timeout), self.timeout)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)

    def call(self) -> Call:
        return Call(self)

    def order(self, now: float) -> list[ServerState]:
        """Servers not backing off in the given order, then those backing off, soonest retry first."""
        servers = self.servers
        waiting = [s for s in servers if s.retry_at > now]
        if not waiting:
            return servers
        waiting.sort(key=lambda s: s.retry_at)
        return [s for s in servers if s.retry_at <= now] + waiting

    def statuses(self) -> list[ServerStatus]:
        now = time.monotonic()
        return [server.status(now) for server in self.servers]


class Call:
    """One call's way through the servers: iterate for ``(server, seconds this attempt may take)``,
    report each outcome with :meth:`failed` or :meth:`succeeded`, and raise :meth:`error` when the
    iteration ends without a success."""

    __slots__ = ("deadline", "errors", "failover")

    def __init__(self, failover: Failover) -> None:
        self.failover = failover
        self.deadline = time.monotonic() + failover.timeout
        self.errors: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple[ServerState, float]]:
        failover = self.failover
        for server in failover.order(time.monotonic()):
            remaining = self.deadline - time.monotonic()
            if remaining < _MIN_ATTEMPT:
                self.errors[server.address.text] = f"not tried: the call's {failover.timeout:g} s timeout had passed"
                continue
            yield server, min(remaining, failover.server_timeout)

    def failed(self, server: ServerState, message: str) -> None:
        """Remember the failure and back the server off (longer after each failure in a row)."""
        failover = self.failover
        failures = server.failures + 1
        server.failures = failures
        server.last_error = message
        delay = min(failover.max_backoff, failover.backoff * 2 ** min(failures - 1, 32))
        server.retry_at = time.monotonic() + delay
        self.errors[server.address.text] = message

    @staticmethod
    def succeeded(server: ServerState) -> None:
        if server.failures:
            server.failures = 0
            server.retry_at = 0.0

    def error(self) -> AllServersFailed:
        return AllServersFailed(self.errors, self.failover.timeout)

"""Who may take a place in the daemon before it knows who they are (issue 33).

Two bounds, checked when a connection is accepted (a TLS handshake begins) and when a connection is
made (its protocol object is created, after the handshake on a TLS port):

- ``--max-connections`` counts connections and TLS handshakes in progress, as memcached's ``-c``
  counts its ``-Z`` connections from ``accept``. Before, a handshake took no slot: an idle TCP
  connection to a TLS port cost ~48 KB and was not counted, and 12,000 of them took 616 MB.
- ``--max-unauthenticated`` (default: half of ``--max-connections``) counts what has not
  authenticated yet: TLS handshakes in progress; with ``--auth-file``, memcached connections that
  have not logged in; with ``--token-file``, HTTP and gRPC connections that have not yet sent a
  request (a call) with a good bearer token (requests to the open routes, /healthz and /livez, or
  refused ones do not count). Both kinds are closed by ``--login-timeout`` (HTTP with a 408, gRPC
  with a GOAWAY). Connections that never authenticate can hold at most this share, so they cannot
  push out the clients that have: those keep the other half. Without ``--token-file`` an HTTP or
  gRPC connection has nothing to authenticate and counts as authenticated once made.

A refusal closes the socket at once (before any TLS byte: the client sees a reset or an EOF, and
clients retry with backoff), counts in ``rejected_connections``, and is logged at most once every
:data:`LOG_EVERY` seconds with how many were refused since.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

from ..ratelimit import RateLimitedLog

log = logging.getLogger("katsubushi_py")

#: Seconds between two log lines about refused connections.
LOG_EVERY = 10.0


class Admission:
    """The two counts and their limits (see the module's docstring)."""

    def __init__(
        self,
        max_connections: int,
        max_unauthenticated: int,
        connections: Collection[Any],
        servers: Callable[[], Iterable[Any]],
        stats: Any,
    ) -> None:
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self._connections = connections
        self._servers = servers  # the listeners; a TLS one has the set of its handshakes in progress
        self._stats = stats
        self.unauthenticated = 0  # connections made and not authenticated yet (memcached, HTTP, gRPC)
        self.login_timeouts = 0  # connections closed by --login-timeout
        self.refused_unauthenticated = 0  # refused because the unauthenticated share was full
        self._refusals = RateLimitedLog(every=LOG_EVERY)  # one kind: both limits share the line

    def handshakes(self) -> int:
        """TLS handshakes in progress, on every listener."""
        return sum(len(getattr(server, "_handshakes", ())) for server in self._servers())

    def admit_handshake(self) -> bool:
        """A TCP connection to a TLS port: may its handshake begin?"""
        handshakes = self.handshakes()
        if len(self._connections) + handshakes >= self.max_connections:
            return self._refuse("--max-connections", False)
        if handshakes + self.unauthenticated >= self.max_unauthenticated:
            return self._refuse("--max-unauthenticated", True)
        return True

    def admit(self, needs_login: bool) -> bool:
        """A connection about to be made (a plain one, or a TLS one whose handshake is done): may it?
        ``needs_login``: it must still log in (``--auth-file``)."""
        handshakes = self.handshakes()
        if len(self._connections) + handshakes >= self.max_connections:
            return self._refuse("--max-connections", False)
        if needs_login and handshakes + self.unauthenticated >= self.max_unauthenticated:
            return self._refuse("--max-unauthenticated", True)
        return True

    def _refuse(self, limit: str, unauthenticated: bool) -> bool:
        self._stats.rejected_connections += 1
        if unauthenticated:
            self.refused_unauthenticated += 1
        due = self._refusals.due("connections")
        if due is not None:
            unsaid, since = due
            log.warning(
                "refused %d connection(s) in the last %ds: %s reached (%d connections, %d TLS handshakes in"
                " progress, %d not authenticated; --max-connections %d, --max-unauthenticated %d)",
                unsaid + 1,
                round(min(since, LOG_EVERY)),
                limit,
                len(self._connections),
                self.handshakes(),
                self.unauthenticated,
                self.max_connections,
                self.max_unauthenticated,
            )
        return False

    def stat_fields(self) -> list[tuple[str, object]]:
        return [
            ("max_unauthenticated", self.max_unauthenticated),
            ("tls_handshakes", self.handshakes()),
            ("unauthenticated_connections", self.unauthenticated),
            ("rejected_unauthenticated", self.refused_unauthenticated),
            ("login_timeouts", self.login_timeouts),
        ]

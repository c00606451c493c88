"""The issuing core: the one object every front end asks for IDs.

Front ends (memcached text and binary, HTTP, gRPC) differ only in how they frame requests and
replies. What a request for IDs means is decided here, once:

- **IDs or a failure.** :meth:`Issuer.issue` returns the IDs, or a :class:`Failure` with a short
  ``reason`` (``clock_backwards``, ``lease_unconfirmed``, ``state_file``, ``layout_exhausted``,
  ``closed``, ``internal``) and a message for the client. Never a partial batch. An unexpected
  exception is a failure too (``internal``), logged with its traceback, so a bug answers one request
  with an error instead of dropping the connection.
- **Waiting without blocking.** When the clock is a little behind the last issued millisecond the
  generator raises :class:`~.errors.ClockWait`; a front end on the event loop retries that request
  later (:meth:`Issuer.issue_async`, or the text and binary connections' own resume) while every other
  connection and the lease renewals go on.
- **One set of counters.** Each protocol has a :class:`Counters` (commands, IDs issued, failures by
  reason); go-katsubushi's ``cmd_get``/``get_hits``/``get_misses`` are their sums.

The memcached front ends sit on the hottest path there is, so they bind :attr:`Issuer.next_id` (the
generator's own method, no wrapper) and bump their :class:`Counters` inline; only failures come back
here through :meth:`Issuer.failed`. Slower front ends call :meth:`Issuer.issue`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from ..compiled import speedups
from ..ratelimit import RateLimitedLog
from .errors import ClockWait, GenerationError
from .generator import Generator

log = logging.getLogger("katsubushi_py")

#: A request for more IDs than this at once is refused by every front end that takes a count.
MAX_IDS_PER_REQUEST = 1000

# An unexpected exception is logged with its traceback at most this often per exception type.
_LOG_INTERVAL_S = 10.0

# Requests refused for a reason the daemon would otherwise not log: one line when refusals of that kind
# start, then at most one this often while they go on (with how many there were since). Refusals
# while the lease is not confirmed are not among them: the lease keeper logs why it has no lease,
# when issuing stops at its deadline and when it resumes.
_REFUSAL_LOG_INTERVAL_S = 10.0
_REFUSALS_LOGGED_ELSEWHERE = frozenset({"lease_unconfirmed"})
_REFUSAL_HINTS = {
    "state_file": "requests for IDs are refused until it can be written (a full disk, permissions, a read-only"
    " file system)",
    "clock_backwards": "this host's clock went back (the daemon counts on its monotonic clock, so a VM restored"
    " or migrated, or a clock set by hand); requests for IDs are refused until it passes the last issued"
    " millisecond",
    "layout_exhausted": "no ID fits the layout any more",
    "closed": "the daemon is shutting down",
}


class Failure(NamedTuple):
    """Why a request got no IDs: ``reason`` for counters and metrics, ``message`` for the client."""

    reason: str
    message: str


class PyCounters:
    """One protocol's counters. Plain attributes: the event loop is one thread, and a front end in
    another thread (gRPC) has counters of its own. ``_speedups.Counters`` is the compiled twin (C
    integers, so the compiled text path counts without touching Python objects)."""

    __slots__ = ("commands", "failures", "ids", "protocol")

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.commands = 0  # requests for IDs (GET/GETS lines, binary GETs, /id, Fetch, ...)
        self.ids = 0  # IDs issued
        self.failures: dict[str, int] = {}  # requests that got no IDs, by reason


Counters = PyCounters if TYPE_CHECKING or speedups is None else speedups.Counters


class Issuer:
    """Issues IDs from one :class:`Generator` to every front end, and keeps their counters.

    ``stats_fields`` is what STATS-like commands of every front end report; the daemon replaces it
    with its full set (connections, lease). ``settings_fields`` is what ``stats settings`` reports;
    the daemon replaces it with its configuration. ``unavailable``, when set (shutting down, acquiring a
    lease), is reported by :meth:`health` before anything else.
    """

    def __init__(self, generator: Generator, version: str) -> None:
        self.version = version
        self._generator = generator
        self.next_id = generator.next_id
        self.next_ids = generator.next_ids
        self._counters: dict[str, Counters] = {}
        self.unavailable: str | None = None
        self.stats_fields: Callable[[], list[tuple[str, object]]] = self._basic_fields
        self.settings_fields: Callable[[], list[tuple[str, object]]] = self._basic_settings
        self._logged: dict[type, float] = {}
        self._refusals = RateLimitedLog(every=_REFUSAL_LOG_INTERVAL_S)

    @property
    def generator(self) -> Generator:
        return self._generator

    def counters(self, protocol: str) -> Counters:
        """The counters of one protocol, made on first use and shared by all its connections."""
        counters = self._counters.get(protocol)
        if counters is None:
            counters = self._counters[protocol] = Counters(protocol)
        return counters

    def all_counters(self) -> list[Counters]:
        return list(self._counters.values())

    def totals(self) -> tuple[int, int, int]:
        """(commands, IDs issued, failed commands) over every protocol: katsubushi's cmd_get,
        get_hits and get_misses."""
        commands = ids = failures = 0
        for c in self._counters.values():
            commands += c.commands
            ids += c.ids
            failures += sum(c.failures.values())
        return commands, ids, failures

    # -- issuing ---------------------------------------------------------------------------------
    def failed(self, counters: Counters, exc: BaseException) -> Failure:
        """Count a request that got no IDs and say why. Unexpected exceptions are logged with their
        traceback (at most every few seconds per type) and answered as ``internal``."""
        if isinstance(exc, GenerationError):
            reason, message = exc.reason, " ".join(str(exc).split()) or type(exc).__name__
            if reason not in _REFUSALS_LOGGED_ELSEWHERE:
                self._refused(reason, message)
        else:
            reason, message = "internal", f"internal error ({type(exc).__name__}); see the daemon's log"
            now = time.monotonic()
            if now - self._logged.get(type(exc), -_LOG_INTERVAL_S) >= _LOG_INTERVAL_S:
                self._logged[type(exc)] = now
                log.error("unexpected error while issuing IDs (%s request)", counters.protocol, exc_info=exc)
        counters.failures[reason] = counters.failures.get(reason, 0) + 1
        return Failure(reason, message)

    def _refused(self, reason: str, message: str) -> None:
        """Say why requests are refused: a state file that cannot be written or a clock behind refused
        every request for seconds without a line in the log (issue 32). Rate-limited per reason."""
        due = self._refusals.due(reason)
        if due is None:
            return
        unsaid, since = due
        more = f" ({unsaid} more refused in the last {since:.0f}s)" if unsaid else ""
        hint = _REFUSAL_HINTS.get(reason)
        log.warning("refusing requests for IDs (%s): %s%s%s", reason, message, f"; {hint}" if hint else "", more)

    def issue(self, counters: Counters, n: int = 1) -> list[int] | Failure:
        """``n`` increasing IDs (1 <= n), or why not. Raises :class:`ClockWait` (nothing counted) when
        the request should be retried a little later."""
        counters.commands += 1
        try:
            ids = [self.next_id()] if n == 1 else self.next_ids(n)
        except ClockWait:
            counters.commands -= 1
            raise
        except Exception as exc:
            return self.failed(counters, exc)
        counters.ids += n
        return ids

    async def issue_async(self, counters: Counters, n: int = 1) -> list[int] | Failure:
        """:meth:`issue` for coroutines: a clock wait sleeps this request only."""
        while True:
            try:
                return self.issue(counters, n)
            except ClockWait as wait:
                await asyncio.sleep(wait.seconds)

    def health(self) -> Failure | None:
        """None when an ID could be issued now; otherwise why not."""
        if self.unavailable is not None:
            return Failure("unavailable", self.unavailable)
        problem = self._generator.check()
        if problem is None:
            return None
        return Failure(problem.reason, " ".join(str(problem).split()))

    def _basic_fields(self) -> list[tuple[str, object]]:
        commands, ids, failures = self.totals()
        return [
            ("version", self.version),
            ("cmd_get", commands),
            ("get_hits", ids),
            ("get_misses", failures),
            ("worker_id", self._generator.worker_id),
        ]

    def _basic_settings(self) -> list[tuple[str, object]]:
        layout = self._generator.layout
        return [("layout", layout.describe()), ("epoch_ms", layout.epoch_ms)]

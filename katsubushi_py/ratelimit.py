"""Log lines about refusals, rate-limited: one implementation for every layer.

A refusal a client (or a fault) can repeat at will is worth a line, but a line per attempt would fill
the disk and bury everything else. So: the first at once, then at most one line per ``every`` seconds
for the same kind, with how many were left unsaid in between. The connection admission
(daemon/admission.py), the issuer's refused requests (issuing/issuer.py), and the accept loop, state
file writes and bad TLS server names (daemon/refusals.py's shared instance) all count with
:class:`RateLimitedLog`; each keeps the words of its own line. Top-level, because issuing must not
import daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("katsubushi_py")


class RateLimitedLog:
    """At most one line per ``every`` seconds for each kind of refusal; the next one says how many
    were not logged since. ``clock``: seconds, monotonic (a parameter for tests)."""

    def __init__(self, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every = every
        self._clock = clock
        self._last: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}
        #: Every refusal seen, logged or not, by kind.
        self.counts: dict[str, int] = {}

    def due(self, kind: str) -> tuple[int, float] | None:
        """Count one refusal of ``kind``. None when a line of this kind was logged within ``every``
        seconds (it is left unsaid); else a line is due now: (how many were left unsaid since the last
        line, seconds since that line; ``every`` for the first line of the kind)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return None
        self._last[kind] = now
        return self._unsaid.pop(kind, 0), now - last if last is not None else self.every

    def __call__(self, kind: str, level: int, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line of this ``kind`` was logged within ``every`` seconds;
        whether it was."""
        due = self.due(kind)
        if due is None:
            return False
        unsaid, since = due
        if unsaid:
            message += " (%d more like it not logged in the last %.0f s)"
            args = (*args, unsaid, since)
        log.log(level, message, *args)
        return True


#: The daemon's one instance: accept failures, state-file writes and bad server names share it.
refusals = RateLimitedLog()

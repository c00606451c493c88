"""Time without Redis, as an operator reads it: one ERROR line when a lease's deadline passes without a
confirmed renew (the daemon stops issuing), one INFO line when a renew lets it resume, and one when
renews succeed again after failing (on which node, after how long, whether issuing ever stopped); and
for STATS and the metrics the time since the last confirmed renew and the longest gap between two.

A failover (Sentinel, Cluster) is such a stretch: renews fail until the new master is named, then one
succeeds there. The keeper feeds this the outcome of every renew; the lines are rate-free (one per
stretch), the repeated "renewing failed" warnings are the keeper's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from ..ids.layout import format_time, ms_to_datetime
from .holder import Holding
from .recovery import LeaseStats
from .timings import LeaseTimings

log = logging.getLogger("katsubushi_py")


class RenewWatch:
    """``holding()`` gives the current lease (None between leases), ``stopping()`` whether the keeper
    is shutting down; ``display`` is the Redis URL (without its password) and ``node()`` the node the
    keeper talks to now (host:port: the master Sentinel or the cluster named), for messages."""

    def __init__(
        self,
        stats: LeaseStats,
        timings: LeaseTimings,
        holding: Callable[[], Holding | None],
        stopping: Callable[[], bool],
        display: str,
        node: Callable[[], str],
    ) -> None:
        self.stats = stats
        self.timings = timings
        self._holding = holding
        self._stopping = stopping
        self._display = display
        self._node = node
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._stopped_since = 0.0  # monotonic seconds; 0 while issuing (or not holding a lease)
        # Renews: when the last one was confirmed, and since when (and how often) they have failed.
        self._last_renewed = 0.0
        self._failing_since = 0.0
        self._failed = 0

    # -- renews ----------------------------------------------------------------------------------
    def new_lease(self) -> None:
        """Gaps are counted within one lease (the time spent leasing another id is no gap)."""
        self._last_renewed = self._failing_since = 0.0
        self._failed = 0

    def failed(self, sent: float) -> None:
        if not self._failing_since:
            self._failing_since = sent
        self._failed += 1

    def renewed(self, holding: Holding, received: float) -> None:
        """A renew confirmed the lease (``holding``'s deadline not yet moved): the gap since the one
        before, and, after renews that failed, one line saying Redis is back, where, and how long the
        daemon was without it."""
        stats = self.stats
        gap = received - self._last_renewed if self._last_renewed else 0.0
        stats.longest_renew_gap_ms = max(stats.longest_renew_gap_ms, int(gap * 1000))
        self._last_renewed = received
        if not self._failing_since:
            return
        stats.renew_outages += 1
        left = holding.deadline - received
        stopped = f"the lease had {left:.1f}s left, issuing never stopped" if left > 0 else "issuing had stopped"
        log.info(
            "renewed worker id %d on %s again: %.1fs without a confirmed renew (%d attempts failed; %s)",
            holding.worker_id,
            self._node() or self._display,
            gap or received - self._failing_since,
            self._failed,
            stopped,
        )
        self._failing_since = 0.0
        self._failed = 0

    def since_renew_ms(self) -> int:
        """Milliseconds since the last confirmed renew (-1 before the first under this lease)."""
        return int((time.monotonic() - self._last_renewed) * 1000) if self._last_renewed else -1

    # -- stopping and resuming at the lease's deadline -------------------------------------------
    def arm(self, now: float) -> None:
        """Say once when the deadline passes without a confirmed renew, and once when issuing resumes."""
        holding = self._holding()
        deadline = holding.deadline if holding is not None else 0.0
        if self._stopped_since and now < deadline:
            log.info(
                "resumed issuing under worker id %d: a renew confirmed the lease (stopped for %.1fs)",
                holding.worker_id if holding is not None else -1,
                now - self._stopped_since,
            )
            self._stopped_since = 0.0
        self.disarm()
        if deadline and not self._stopped_since:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the daemon's loop (a test of the fence alone): no line to log
                return
            self._expiry_timer = loop.call_later(max(0.0, deadline - now), self._expired)

    def disarm(self) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        if self._holding() is None:
            self._stopped_since = 0.0

    def _expired(self) -> None:
        self._expiry_timer = None
        now = time.monotonic()
        holding = self._holding()
        if holding is None or self._stopping() or not holding.deadline:
            return
        deadline = holding.deadline
        if now < deadline:  # renewed meanwhile (the timer was early): wait for the new deadline
            self._expiry_timer = asyncio.get_running_loop().call_later(deadline - now, self._expired)
            return
        self._stopped_since = now
        wall = time.time() - (now - deadline)
        confirmed = wall - (self.timings.ttl - self.timings.margin)
        log.error(
            "stopped issuing: lease on worker id %d expired at %s (no renew confirmed by %s since %s); requests"
            " answer SERVER_ERROR until a renew succeeds",
            holding.worker_id,
            format_time(ms_to_datetime(int(wall * 1000))),
            self._display,
            format_time(ms_to_datetime(int(confirmed * 1000))),
        )

"""The holder's side of one lease: when it may serve, until when, whether it can vouch for its record
in Redis, when to renew; and a watch on Redis's clock. Pure state, no I/O: the keeper feeds it the
monotonic times around each round trip and the scripts' answers, and applies its fence to the
generator.

**Self-fencing.** The holder keeps a local deadline, counted on its monotonic clock from when its last
successful renew was *sent*: expiry minus a safety margin. The generator's buckets never outlive it,
so past it every GET answers ``SERVER_ERROR worker id lease not confirmed`` until a renew succeeds.
Redis can only hand the id to someone else after the lease expired by Redis's clock, later than our
deadline. A new lease serves only after its first renew has stored a high-water mark in Redis (so a
successor knows how far we may have issued), after any barrier or doubt window the pool is in, and
once this host's clock has passed the handover mark (so that it never answers ``clock moved
backwards`` while claiming to serve).

**Vouching.** The holder remembers the range of handover marks its record may hold: from the one it
last saw confirmed up to the highest that a renew whose answer never came, or that no replica
acknowledged, may have written (every renew raises the mark to the holder's clock plus the ttl, so each
write leaves a higher value), and that its lease never lapsed (every renew sent before its deadline).
With both it can vouch for its record after Redis restarted or failed over: nobody else can have leased
the id while its lease was live, and Redis still holds a write of its own that covers every ID it
issued, so it keeps serving. A range, not a list: a failover can take seconds of renews retried every
fraction of a second, and a replica promoted may hold any of them.
"""

from __future__ import annotations

import random
import time

from ..ids.layout import format_time, ms_to_datetime
from .replies import Acquired, Lease, Renewed
from .timings import LeaseTimings

NOT_CONFIRMED = "worker id lease not confirmed"


class Holding:
    """One lease, from the acquire that took it until it is lost or released. Times are monotonic
    seconds (``time.monotonic()``) unless named ``_ms`` (Redis's clock, unix ms)."""

    def __init__(
        self, acquired: Acquired, timings: LeaseTimings, sent: float, received: float, local_ms: int, after_ms: int
    ) -> None:
        """``sent``/``received``: around the acquire; ``local_ms``: this host's clock (the generator's)
        when the answer came; ``after_ms``: the generator issues strictly after this (the handover
        mark, the id's state file's mark, what it issued itself): no serving before the clock is past."""
        self.lease: Lease = acquired.lease
        self.timings = timings
        self.since_ms = acquired.now_ms  # Redis's clock when we took it
        # The pool's write counter as of our last write: lower later means the pool went back in time.
        self.version_seen = acquired.version
        # The handover marks the record may hold: [the last confirmed] or [that, the highest since].
        self.marks: list[int] = [acquired.mark_ms]
        # Nobody else can lease the id before its expiry in Redis, which is later than this.
        self.good_until = sent + timings.ttl - timings.margin
        self.deadline = 0.0  # no ID before the first renew has stored our high-water mark
        self.recovering_until = received + max(0, acquired.barrier_ms - acquired.now_ms) / 1000
        self.handover_ms = after_ms
        self.clock_wait_until = received + max(0, after_ms + 1 - local_ms) / 1000
        self.next_renew = received
        self.spread_next = True
        # Whether the generator's fence is open under this lease: "held" only then, so a client that saw
        # "held" is never refused (a wait ends on the clock before the loop wakes to lift the fence).
        self.open = False
        self.lapsed = False  # the last renew sent was sent after the lease lapsed (good 0)
        self.kept_through = 0  # changed_ms of the restart or failover this lease was kept through
        # Until when the doubt window this lease already knows of lasts: the one it was taken in (it was
        # not kept through that restart: it came after), then one it was kept through. Only a restart or
        # failover stamps changed_ms; a window lost writes opened or extended answers 0 (no restart).
        self.window_until_ms = acquired.doubt_until_ms if acquired.doubt_until_ms > acquired.now_ms else 0
        # Subscribers the first renew may find on the id's holder channel: ours, and any a dead holder left
        # (stale: see scripts.py); more is a second claimant. 0 once the first renew succeeded: no check.
        self.expect_subscribers = 1 + acquired.stale

    @property
    def worker_id(self) -> int:
        return self.lease.worker_id

    @property
    def serve_after(self) -> float:
        """No ID before this: the pool's barrier, and this host's clock passing the handover mark."""
        return max(self.recovering_until, self.clock_wait_until)

    # -- renewing --------------------------------------------------------------------------------
    def vouch(self, now: float) -> tuple[str, int]:
        """(marks, good) for the renew script: the lowest and highest mark the record may hold,
        comma-separated (one when they are the same); good 1 while the lease has never lapsed (sent
        before the deadline)."""
        good = 1 if now < self.good_until else 0
        self.lapsed = not good
        return ",".join(map(str, self.marks)), good

    def _may_hold(self, mark_ms: int) -> None:
        confirmed, highest = self.marks[0], max(self.marks)
        self.marks = [confirmed] if max(highest, mark_ms) == confirmed else [confirmed, max(highest, mark_ms)]

    def unanswered(self, high_water_ms: int) -> None:
        """A renew that stores ``high_water_ms`` got no answer: it may or may not have been written."""
        self._may_hold(high_water_ms)

    def renewed(self, sent: float, received: float, reply: Renewed) -> None:
        timings = self.timings
        self.deadline = self.good_until = sent + timings.ttl - timings.margin
        self.marks = [reply.mark_ms]
        # Jittered, never later than the interval: the first renew after taking a lease comes anywhere in
        # it (so a fleet started at once is spread over the interval from then on), later ones after 80
        # to 100% of it (so the spread is kept).
        spread = (0.1, 1.0) if self.spread_next else (0.8, 1.0)
        self.spread_next = False
        self.next_renew = sent + timings.renew * random.uniform(*spread)
        if reply.barrier_ms > reply.now_ms:  # a pool-wide loss seen by another daemon since we acquired
            until = received + (reply.barrier_ms - reply.now_ms) / 1000
            self.recovering_until = max(self.recovering_until, until)

    def written(self, reply: Renewed) -> None:
        """A renew executed on the master (we saw its answer) but does not count: its replicas did not
        acknowledge it, so a replica promoted later may hold the mark before it, or this one. The
        deadline does not move."""
        self._may_hold(reply.mark_ms)

    def retry_soon(self, now: float) -> None:
        """Both attempts of a renew failed: again soon (a short blip must not fence us), with jitter."""
        self.next_renew = now + min(1.0, self.timings.renew / 4) * random.uniform(0.5, 1.0)

    def kept_after(self, reply: Renewed) -> bool:
        """Whether this renew shows the lease kept through a restart or failover seen since we took it
        (reported once per change: not for the window the lease was taken in, however often a later
        script re-stamps it)."""
        if reply.doubt_until_ms <= reply.now_ms or reply.changed_ms == self.kept_through:
            return False
        if reply.changed_ms <= self.window_until_ms:  # the window we know of, extended
            self.window_until_ms = max(self.window_until_ms, reply.doubt_until_ms)
            return False
        self.window_until_ms = reply.doubt_until_ms
        if reply.changed_ms > self.since_ms:
            self.kept_through = reply.changed_ms
            return True
        return False

    # -- serving ---------------------------------------------------------------------------------
    def fence(self, now: float) -> tuple[int, str | None]:
        """What the generator may do now: (deadline in monotonic ns, None) to serve until then, or (0,
        why not). Sets :attr:`open`."""
        self.open = False
        if now < self.recovering_until:
            until = format_time(ms_to_datetime(int((time.time() + self.recovering_until - now) * 1000)))
            return 0, f"{NOT_CONFIRMED}: pool recovering until {until} (Redis lost data, or the pool was new)"
        if now < self.clock_wait_until:
            mark = format_time(ms_to_datetime(self.handover_ms))
            return 0, f"{NOT_CONFIRMED}: waiting for this host's clock to pass the handover mark {mark}"
        self.open = True
        return int(self.deadline * 1e9), None

    def state(self, now: float) -> str:
        if now < self.recovering_until:
            return "recovering"
        if now < self.serve_after or not self.open:
            return "delay"  # or its end, before the keeper has woken to lift the fence
        if now >= self.deadline:
            return "unconfirmed"
        return "held"

    def time_left(self, now: float) -> float:
        return max(0.0, self.deadline - now)


class RedisClockWatch:
    """Redis's ``TIME`` against this host's clock across round trips: the offset between them should
    only drift slowly; a jump means one of the clocks stepped, and this host's generator clock (anchored
    to its monotonic clock at start) does not step. So a jump is Redis's clock stepping (an NTP step,
    ``date -s``, a VM restored from a snapshot, a failover to a host whose clock differs).

    Why it matters: leases expire by Redis's clock. A forward step makes live leases look expired (the
    acquire leaves those whose holder's mark is still ahead alone, see :mod:`.scripts`), a backward one
    makes them look longer; the log says which, so nobody hunts for a fault in the daemons.

    **A slow or paused Redis is not a step.** Redis read its clock somewhere within the round trip that
    carried the reading, so each reading bounds the offset only to within that round trip: a renew
    sent just before Redis was paused (a slow fork, a VM pause, SIGSTOP) and answered when it resumed
    read Redis's clock at the end of a round trip of seconds. Judged by its midpoint, the next quick
    reading looks like a backward step of half the pause. So a step counts only when the two readings'
    ranges are apart by more than the threshold: a long round trip, on either side, can never prove a
    step smaller than itself."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold  # seconds, beyond what the round trips explain
        self.offset_ms: float | None = None  # Redis minus this host, at the last observation (its midpoint)
        self._bounds: tuple[float, float] | None = None  # the least and most the offset can have been (ms)

    def seed(self, offset_ms: float, rtt: float) -> None:
        """The start's clock check: Redis minus this host, judged by a round trip of ``rtt`` seconds."""
        self.offset_ms = offset_ms
        self._bounds = (offset_ms - rtt * 500, offset_ms + rtt * 500)

    def observe(self, redis_ms: int, local_sent_ms: int, rtt: float) -> float | None:
        """Redis read its clock somewhere within the round trip that started at ``local_sent_ms`` on our
        clock and lasted ``rtt`` seconds; returns the step in seconds when the offset's range moved by
        more than the threshold since the last observation: the least step the two readings prove."""
        low, high = redis_ms - (local_sent_ms + rtt * 1000), float(redis_ms - local_sent_ms)
        previous = self._bounds
        if previous is None and self.offset_ms is not None:
            previous = (self.offset_ms, self.offset_ms)
        self._bounds, self.offset_ms = (low, high), (low + high) / 2
        if previous is None:
            return None
        # > 0: the two ranges do not overlap, and the offset moved at least this far (up, or down).
        up, down = low - previous[1], previous[0] - high
        if max(up, down) / 1000 <= self.threshold:
            return None
        return up / 1000 if up > down else -down / 1000

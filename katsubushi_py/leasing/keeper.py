"""Worker ids leased from Redis, so that no two daemons ever issue IDs under the same worker id.

The design is yaraus's (a sorted set of worker ids scored by lease expiry, changed only by Lua
scripts, every script reading Redis's own ``TIME`` so all daemons share one clock) without its holes.
The pieces, each with one concern:

- :mod:`.scripts`: the Lua scripts, the record checks they make and the recovery and quarantine rules
  (atomic, so they run inside Redis); :mod:`.replies` reads their answers.
- :mod:`.holder`: one lease's state (self-fencing deadline, when it may serve, what it can vouch for)
  and a watch on Redis's clock.
- :mod:`.recovery`: what the daemon counts and logs for each finding.
- :mod:`.link`: the connection (scripts and ``WAIT`` for the replicas in one round trip, reconnects
  noticed, release announcements, the clock check); :mod:`.nodes` finds the node (the URL's, the
  master Sentinel names, the cluster's slot master) and keeps what it learned across reconnects.
- :mod:`.outages`: time without Redis (stopping at the deadline, resuming, renews succeeding again).
- :mod:`.acquiring`: taking an id (the acquire, waiting for a free one, claiming its state file,
  starting fenced under it) and giving one back.
- this module: the keeper's life: starting, the renew loop, moving to a new id when a lease is lost,
  stopping, and what STATS shows.

**Handover.** Every renew stores, per id, the latest millisecond the holder may issue before its
deadline; a clean release stores the last one it did issue. The next holder starts strictly after it
(and waits, fenced, until its own clock has passed it).

**Local memory.** With a state directory, each leased id's state file (locked while we hold the id)
keeps the last millisecond this host may have issued under it; we never issue under the id at or
below that, whatever Redis says. An id whose file another daemon of this host holds is a conflict:
it is quarantined in Redis and another one leased.

**At fleet scale** (a thousand daemons on one Redis): the daemon listens while it waits for a lease
(GETs answer ``SERVER_ERROR`` with the reason, STATS shows the state and the wait); start-up retries
with exponential backoff and jitter for ``start_timeout`` before giving up; renews come at a jittered
interval (after taking a lease, anywhere in the first interval; then 80 to 100% of ``renew``) so a
fleet started at once does not renew in one burst, in one round trip each; a failed renew is retried
at once on a fresh connection; a daemon waiting for a free id subscribes to releases and tries again
as soon as one is announced (or when the next lease or quarantine ends).

All keys of a namespace share the hash tag ``{ns}``, so a Redis Cluster keeps them in one slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..issuing.generator import Generator
from ..issuing.statefile import StateFile
from .acquiring import _WAIT_LOG_INTERVAL, WAITING, Acquiring
from .holder import NOT_CONFIRMED, Holding, RedisClockWatch
from .link import NotSent, RedisLink, refusal, trouble
from .outages import RenewWatch
from .pool import init_pool
from .presence import Presence
from .recovery import LeaseStats, Reporter
from .replies import Lease, Renewed, RenewOutcome, parse_identity, parse_renew
from .scripts import IDENTITY_LUA, RENEW_LUA
from .settings import SettingsWatch
from .target import LeaseError, LeaseRefused, RedisTarget
from .timings import Backoff, LeaseTimings, describe, new_epoch

__all__ = ["NOT_CONFIRMED", "WAITING", "Lease", "LeaseKeeper", "LeaseStats", "LeaseTimings", "init_pool"]

log = logging.getLogger("katsubushi_py")

# How often the "pool nearly full" warning is repeated while it stays nearly full.
_FULL_WARN_INTERVAL = 300.0


class LeaseKeeper(Acquiring):
    """Leases a worker id for a generator and keeps it: acquires (waiting for a free id if need be),
    renews, fences the generator whenever the lease is not confirmed, and moves to a new id when the
    lease is lost. Runs on the daemon's event loop; :meth:`run` is its whole life.

    ``claim_state(worker_id)`` (a :meth:`StateDirectory.claim`) gives the locked state file of a leased
    id; None runs without local memory. ``on_change(reason)`` is told when the daemon has no lease
    (``reason``) and when it has one again (None): health checks report it."""

    def __init__(
        self,
        target: RedisTarget,
        timings: LeaseTimings,
        min_id: int,
        max_id: int,
        *,
        wait_for_free_id: bool = True,
        skew_warn: float = 0.5,
        skew_max: float = 5.0,
        start_timeout: float = 60.0,
        free_warn: float = 0.05,
        claim_state: Callable[[int], StateFile] | None = None,
        on_change: Callable[[str | None], None] | None = None,
    ) -> None:
        timings.check()
        self.target = target
        self.timings = timings
        self.min_id = min_id
        self.max_id = max_id
        self.wait_for_free_id = wait_for_free_id
        self.skew_warn = skew_warn
        self.skew_max = skew_max
        self.start_timeout = start_timeout
        self.free_warn = free_warn
        self.claim_state = claim_state
        self.on_change = on_change
        self.stats = LeaseStats()
        self.link = RedisLink(target, timings, self.stats)
        self.settings = SettingsWatch(target, self.link, timings.ttl)  # min-replicas-to-write, eviction
        self.report = Reporter(self.stats, target.display, self.recovery_wait, timings.unreleased_wait(skew_max))
        self.clock_watch = RedisClockWatch(max(0.25, skew_warn))
        # The holder's subscription to its id's channel: what a rollback of Redis's data leaves (presence.py).
        self.presence = Presence(target, lambda: self.link.finder, self._presence_dropped)
        self._nap: asyncio.Future[None] | None = None  # the renew loop's sleep (cut short: renew now)
        self.holding: Holding | None = None
        self.epoch = ""  # the pool identity we leased under ("" before the first acquire)
        self.generator: Generator | None = None
        self.serving = asyncio.Event()  # set while the generator may issue under a confirmed lease
        self._waiting_for = "connecting to Redis"  # what we wait for ("" when holding a lease)
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._logged: dict[str, float] = {}
        self._nearly_full = False
        # Time without Redis: the lines when issuing stops at the deadline, resumes, and renews succeed again.
        self.watch = RenewWatch(
            self.stats, timings, lambda: self.holding, lambda: self._stopping, target.display, lambda: self.link.address
        )

    @property
    def lease(self) -> Lease | None:
        return self.holding.lease if self.holding is not None else None

    async def _drop_client(self) -> None:
        await self.link.drop()

    async def check_clock(self) -> float:
        """Local clock minus Redis TIME, in seconds; refuse to go on above ``skew_max``, warn above
        ``skew_warn`` (judged by the least the offset can be, given the round trip).

        The local clock is the generator's (the wall clock as it read when the generator started,
        carried on by the monotonic clock): the clock the IDs carry. Not the wall clock as it reads now:
        a host whose clock NTP stepped between the daemon's start and this check (a boot before NTP
        synced, Redis unreachable for a while) would pass the check while issuing IDs as far ahead or
        behind as the step, beyond what every quarantine and barrier allows for."""
        skew, rtt = await self.link.clock_offset(self.skew_max, lambda: self._local_ms() / 1000)
        if abs(skew) - rtt / 2 > self.skew_warn:
            log.warning("local clock differs from Redis TIME by %+.3fs (round trip %.3fs)", skew, rtt)
        self.clock_watch.seed(-skew * 1000, rtt)
        return skew

    # -- renew -----------------------------------------------------------------------------------
    async def renew(self, high_water_ms: int, local_ms: int) -> RenewOutcome | None:
        """One renew, retried once at once on a fresh connection if the first attempt fails (a dropped
        connection, a failover). Returns the script's outcome, or None when both attempts failed."""
        holding = self.holding
        if holding is None:
            return None
        lease = holding.lease
        ttl_ms, wait_ms, skew_ms = self._ms()
        for attempt in (1, 2):
            marks, good = holding.vouch(time.monotonic())
            args = [lease.token, lease.worker_id, ttl_ms, high_water_ms, self.epoch, wait_ms, skew_ms]
            args += [holding.version_seen, self.min_id, self.max_id, new_epoch(), marks, good, local_ms]
            args += [self.presence.channel(lease.worker_id), holding.expect_subscribers]
            try:
                await self.presence.ensure(lease.worker_id, self.link)
                result, problem, new_connection = await self.link.run(RENEW_LUA, args)
                break
            except Exception as exc:
                if not isinstance(exc, NotSent):  # sent, maybe written: its mark may be in the record
                    holding.unanswered(high_water_ms)
                await self.link.drop()
                if attempt == 1:
                    self.stats.renew_retries += 1
                    continue
                if self._every("renew-failed", _WAIT_LOG_INTERVAL):
                    why = refusal(self.target.display, exc) or describe(exc)
                    log.warning("renewing worker id %d failed: %s", lease.worker_id, why)
                return None
        outcome = parse_renew(result)
        if not isinstance(outcome, Renewed):
            return outcome
        if problem:
            holding.written(outcome)
            if self._every("renew-failed", _WAIT_LOG_INTERVAL):
                log.warning(
                    "renewing worker id %d not confirmed: %s (a replica promoted now might not hold it)",
                    lease.worker_id,
                    problem,
                )
            return None
        holding.version_seen = max(holding.version_seen, outcome.version)
        holding.expect_subscribers = 0  # the first renew counted the claimants: no other can come
        self._occupancy(outcome.free, outcome.total)
        if new_connection:
            await self._check_identity()
        return outcome

    def _presence_dropped(self) -> None:
        """The subscription dropped: renew at once (subscribing again first), so that a rollback of Redis's
        data meanwhile is found at once."""
        if self.holding is not None and not self._stopping:
            self.holding.next_renew = time.monotonic()
            if self._nap is not None:
                self._nap.cancel()

    async def _check_identity(self) -> None:
        """After a reconnect: has Redis restarted or failed over? (The pool opens its doubt window at
        once, not at the next acquire.) Best effort: the next reconnect asks again."""
        ttl_ms, wait_ms, skew_ms = self._ms()
        try:
            args = [wait_ms, skew_ms, ttl_ms, self._local_ms()]
            result, _, _ = await self.link.run(IDENTITY_LUA, args, durable=False)
        except Exception:
            return
        self.report.news(parse_identity(result))

    def _occupancy(self, free: int, size: int) -> None:
        self.stats.pool_free, self.stats.pool_size = free, size
        nearly_full = size > 0 and free < self.free_warn * size
        if nearly_full and (not self._nearly_full or self._every("nearly-full", _FULL_WARN_INTERVAL)):
            log.warning(
                "worker id pool in %s is nearly full: %d of %d ids free (under %g%%). Daemons that crash or"
                " restart need a free id for about a lease ttl each; add ids (--max-worker-id, a wider"
                " --worker-bits) or another namespace before daemons have to wait",
                self.target.display,
                free,
                size,
                self.free_warn * 100,
            )
            self._logged["nearly-full"] = time.monotonic()
        elif self._nearly_full and not nearly_full:
            log.info("worker id pool in %s has %d of %d ids free again", self.target.display, free, size)
        self._nearly_full = nearly_full

    def _observe_clock(self, reply: Renewed, local_sent_ms: int, rtt: float) -> None:
        step = self.clock_watch.observe(reply.now_ms, local_sent_ms, rtt)
        offset = self.clock_watch.offset_ms or 0.0
        self.stats.redis_clock_offset_ms = int(offset)
        if step is not None:
            self.report.redis_clock_step(step, offset, self.skew_max)

    def _observe_pool_mark(self, reply: Renewed, high_water_ms: int) -> None:
        """The pool's high-water mark against ours: every holder writes its clock plus the ttl, so one
        far ahead of ours is a daemon whose clock is (or ours behind): clocks off true time together with
        Redis's, which the start check cannot see, and which only a loss of Redis's data makes unsafe."""
        ahead = max(0, reply.pool_mark_ms - high_water_ms)
        self.stats.pool_mark_ahead_ms = ahead
        if ahead > 2 * self.skew_max * 1000 + self.timings.margin * 1000 and self._every("mark-ahead", 60.0):
            self.report.pool_mark_ahead(ahead, self.skew_max)

    # -- the loop --------------------------------------------------------------------------------
    async def run(self, generator: Generator) -> None:
        """The keeper's whole life: check the clock and lease an id (Redis errors retried with backoff
        for ``start_timeout``, then LeaseError), then renew and re-lease until stopped. The generator
        is fenced, with the reason, whenever it may not issue."""
        self.generator = generator
        self._task = asyncio.current_task()
        deadline = time.monotonic() + self.start_timeout
        self._wait(f"connecting to Redis at {self.target.display}", quiet=True)
        backoff = Backoff(0.1, min(5.0, self.timings.renew))
        while True:
            try:
                skew = await self.check_clock()
                await self.settings.at_start()  # LeaseRefused: unsafe settings
                break
            except LeaseError:
                raise
            except Exception as exc:
                await self.link.drop()
                if time.monotonic() >= deadline:
                    raise LeaseRefused(
                        f"cannot lease a worker id from {self.target.display} within --lease-start-timeout"
                        f" {self.start_timeout:g}s: {describe(exc)}"
                    ) from None
                self._wait(trouble(self.target.display, exc))
                await asyncio.sleep(min(backoff.next(), deadline - time.monotonic()))  # last try at the deadline
        log.info("clock differs from Redis TIME by %+.3fs", skew)
        await self._lease_new_id(generator, deadline)
        await self._maintain(generator)

    def _fence(self, generator: Generator) -> None:
        holding = self.holding
        if holding is None:
            generator.set_fence(0, f"{WAITING}: {self._waiting_for}")
            self.serving.clear()
            return
        now = time.monotonic()
        deadline_ns, why = holding.fence(now)
        generator.set_fence(deadline_ns, why)
        if holding.open:
            if now < holding.deadline and not self.serving.is_set():
                self.serving.set()
                log.info("serving worker id %d", generator.worker_id)
            self.watch.arm(now)

    async def _maintain(self, generator: Generator) -> None:
        timings = self.timings
        while not self._stopping:
            holding = self.holding
            assert holding is not None
            self._fence(generator)
            now = time.monotonic()
            wake = holding.next_renew
            if now < holding.serve_after:
                wake = min(wake, holding.serve_after)
            self._nap = nap = asyncio.ensure_future(asyncio.sleep(max(0.0, wake - now)))
            try:
                await asyncio.wait({nap})
            finally:
                self._nap = None
                with contextlib.suppress(RuntimeError):  # the loop closed under a coroutine never finished
                    nap.cancel()
            if time.monotonic() < holding.next_renew or self._stopping:
                continue
            sent = time.monotonic()
            local_ms = generator.now_ms()
            high_water = local_ms + int(timings.ttl * 1000)
            try:
                outcome = await asyncio.wait_for(self.renew(high_water, local_ms), timeout=timings.renew)
            except TimeoutError:
                holding.unanswered(high_water)
                await self.link.drop()
                if self._every("renew-failed", _WAIT_LOG_INTERVAL):
                    log.warning("renewing worker id %d timed out", holding.worker_id)
                outcome = None
            received = time.monotonic()
            if isinstance(outcome, Renewed):
                self.stats.renewals += 1
                self.watch.renewed(holding, received)
                holding.renewed(sent, received, outcome)
                self._observe_clock(outcome, local_ms, received - sent)
                self._observe_pool_mark(outcome, high_water)
                self.report.news(outcome)
                if holding.kept_after(outcome):
                    self.report.kept(holding.worker_id)
            elif outcome is None:
                self.stats.renew_failures += 1
                self.watch.failed(sent)
                holding.retry_soon(time.monotonic())
            else:
                await self._lost(generator, outcome)
            self.settings.poke(forced=outcome is None)

    async def _lost(self, generator: Generator, outcome: RenewOutcome) -> None:
        """The id is not ours any more (or Redis forgot it): stop at once, say why, lease another."""
        old = self.holding.worker_id if self.holding is not None else -1
        lapsed = self.holding.lapsed if self.holding is not None else False
        generator.retire_worker(WAITING)
        self.holding = None
        await self.presence.release()
        self._wait("the previous one was lost", quiet=True)
        self.report.lost(old, outcome, lapsed)
        self.report.news(outcome)
        await self._lease_new_id(generator, None)
        self.stats.worker_id_changes += 1

    async def stop(self, last_ms: int) -> None:
        """Stop renewing (or waiting), then release the id with the last issued millisecond."""
        self._stopping = True
        self.watch.disarm()
        await self.settings.close()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.release(last_ms)

    # -- what STATS shows ------------------------------------------------------------------------
    def state(self) -> str:
        if self.holding is None:
            return "connecting" if self._waiting_for.startswith(("connecting", "Redis")) else "waiting"
        return self.holding.state(time.monotonic())

    def time_left(self) -> float:
        return self.holding.time_left(time.monotonic()) if self.holding is not None else 0.0

    def stat_fields(self) -> list[tuple[str, object]]:
        stats = self.stats
        waited = time.monotonic() - stats.waiting_since if stats.waiting_since else 0.0
        return [
            ("lease_state", self.state()),
            ("lease_worker_id", self.lease.worker_id if self.lease else -1),
            ("lease_wait_ms", int(waited * 1000)),
            ("lease_time_left_ms", int(self.time_left() * 1000)),
            ("lease_renewals", stats.renewals),
            ("lease_renew_failures", stats.renew_failures),
            ("lease_renew_retries", stats.renew_retries),
            ("lease_round_trips", stats.round_trips),
            ("worker_id_changes", stats.worker_id_changes),
            ("lease_data_loss_events", stats.data_loss_events),
            ("lease_lost_writes", stats.lost_writes),
            ("lease_state_file_conflicts", stats.state_file_conflicts),
            ("lease_pool_ids", stats.pool_size),
            ("lease_pool_free", stats.pool_free),
            ("lease_redis_changes", stats.redis_changes),
            ("lease_kept_through_change", stats.kept_through_change),
            ("lease_quarantined_ids", stats.quarantined_ids),
            ("lease_skipped_live_leases", stats.skipped_live_leases),
            ("lease_redis_clock_steps", stats.redis_clock_steps),
            ("lease_redis_clock_offset_ms", stats.redis_clock_offset_ms),
            ("lease_pool_mark_ahead_ms", stats.pool_mark_ahead_ms),
            ("lease_redis_address", stats.redis_address or "-"),
            ("lease_master_changes", stats.master_changes),
            ("lease_since_renew_ms", self.watch.since_renew_ms()),
            ("lease_longest_renew_gap_ms", stats.longest_renew_gap_ms),
            ("lease_renew_outages", stats.renew_outages),
            ("lease_replicas_expected", stats.replicas_expected),
            ("lease_replica_ack_failures", stats.replica_ack_failures),
            *self.settings.fields(),
        ]

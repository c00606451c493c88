"""The daemon's side of recovery and quarantine: what it counts and what it says when a script found
something wrong. The rules themselves run inside the scripts (:mod:`.scripts`: they must be atomic);
here each finding becomes one log line an operator can act on, and a counter that STATS, the metrics
and ``katsubushi-py lease stats`` (the pool's own counters) show.

Levels: ERROR for data loss (Redis forgot or was edited, and this daemon stopped under an id because of
it); WARNING for what is in doubt or suspicious but not known to be lost (a restart or failover seen,
an id whose holder never released it, Redis's clock stepping); INFO for what went right (a lease kept
through a restart).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..ids.layout import format_time, ms_to_datetime
from .replies import Acquired, PoolLost, PoolNews, RecordLost, RenewOutcome, TakenOver

log = logging.getLogger("katsubushi_py")


@dataclass
class LeaseStats:
    renewals: int = 0
    renew_failures: int = 0  # renews that failed even after the retry on a fresh connection
    renew_retries: int = 0  # renews retried at once on a fresh connection
    round_trips: int = 0  # to Redis, for acquires, renews, releases and identity checks
    worker_id_changes: int = 0
    acquires: int = 0
    data_loss_events: int = 0  # losses this daemon saw: a pool or record that Redis forgot or that was edited
    # Of those, proof that Redis lost lease writes while their holders were live (a rollback in place): an
    # owner entry gone or taken over under a lease that never lapsed, a live holder's subscription on
    # an id whose record says free, two claimants at a first renew, a release of an id not ours.
    lost_writes: int = 0
    state_file_conflicts: int = 0  # leased ids whose state file another local daemon held
    pool_size: int = 0  # ids in the pool, and how many were held by nobody, at the last renew
    pool_free: int = 0
    waiting_since: float = 0.0  # monotonic seconds: when we last started to wait for a lease (0: not waiting)
    redis_changes: int = 0  # restarts or failovers of Redis this daemon learned of
    kept_through_change: int = 0  # times its lease was kept through one (its record intact)
    quarantined_ids: int = 0  # ids this daemon quarantined: never released, damaged, in doubt, conflicts
    skipped_live_leases: int = 0  # leases expired by Redis's clock that it left to their holder
    redis_clock_steps: int = 0  # jumps of Redis's clock against this host's, seen across renews
    redis_clock_offset_ms: int = 0  # Redis TIME minus this host's clock, at the last renew
    # How far the pool's high-water mark is ahead of this holder's own (its clock plus the ttl), at the
    # last renew: more than twice --clock-skew-max means some daemon issued with a clock that far ahead.
    pool_mark_ahead_ms: int = 0
    # Following the master (Sentinel, Cluster): where the pool's Redis is now, how often that changed,
    # the longest time between two confirmed renews, and stretches of failed renews that ended.
    redis_address: str = ""
    master_changes: int = 0
    longest_renew_gap_ms: int = 0
    renew_outages: int = 0
    replicas_expected: int = 0  # replicas each lease write must reach (see link.py)
    replica_ack_failures: int = 0  # writes that not every one of them acknowledged in time


def _at(ms: int) -> str:
    return format_time(ms_to_datetime(ms))


_QUARANTINED = {
    "unreleased": (
        logging.WARNING,
        "worker id {id}'s lease in {where} ended without a release (its holder crashed, was paused or cut off,"
        " or its record was damaged): quarantined it, nobody leases it for {wait:.1f}s (max(lease ttl + 2 x"
        " clock skew max, lease delay)), in case its holder is still issuing",
    ),
    "damaged": (
        logging.ERROR,
        "DATA LOSS: worker id {id}'s lease record in {where} was damaged (no handover mark, an owner entry beside a"
        " release, or neither: edited by hand or partly lost). Quarantined it: nobody leases it for {wait:.1f}s"
        " (lease ttl + 2 x clock skew max), and its next holder starts after the latest millisecond an earlier"
        " holder can have issued",
    ),
}


@dataclass
class Reporter:
    """Turns findings into log lines and counters; ``where`` is the pool's Redis, for messages."""

    stats: LeaseStats
    where: str
    recovery_wait: float  # seconds
    unreleased_wait: float
    _changes_seen: int = 0  # changed_ms of the last restart or failover reported
    _window_until: int = 0  # when the doubt window of the last one reported ends (extended as it is)

    # -- the pool as a whole ---------------------------------------------------------------------
    def news(self, news: PoolNews) -> None:
        """A restart or failover of Redis, whether this daemon's script saw it first or learned of it.

        One restart is one event: only an identity check that sees it stamps ``changed_ms`` (and the end
        of the window it opened), and the scripts answer that stamp while the window lasts, so a stamp
        already reported, or within the window reported, is that event, not another; only this daemon's
        own script seeing the identity change (``change`` 'changed') is always a new one. A window opened
        or extended by lost writes (Redis's identity unchanged: a rollback in place, a record rewritten)
        is no restart: it stamps ``lost_writes_ms`` instead, only the daemon that found them says so (DATA
        LOSS), and ``lease stats`` shows when (``last_lost_writes_ms``)."""
        if not news.changed_ms or news.changed_ms == self._changes_seen:
            return
        first = news.change == "changed"
        if not first and news.doubt_until_ms <= news.now_ms:
            return  # an old one, over before we looked
        if not first and news.changed_ms <= self._window_until:
            self._changes_seen = news.changed_ms
            self._window_until = max(self._window_until, news.doubt_until_ms)
            return
        self._changes_seen = news.changed_ms
        self._window_until = news.doubt_until_ms
        self.stats.redis_changes += 1
        left = max(0.0, (news.doubt_until_ms - news.now_ms) / 1000)
        seen = "this daemon saw first" if first else f"seen at {_at(news.changed_ms)}"
        log.warning(
            "Redis at %s restarted or failed over (%s; %s): writes made shortly before may be lost. Ids that were"
            " free or whose holder cannot vouch for its lease record are not served until %s (%.1fs: lease ttl +"
            " 2 x clock skew max); holders whose record is exactly as they last wrote it keep serving. If Redis"
            " lost writes, consider appendfsync always for the lease namespace",
            self.where,
            seen,
            f"run_id/master_replid was {news.identity_before}" if first and news.identity_before else "new identity",
            _at(news.doubt_until_ms),
            left,
        )

    def kept(self, worker_id: int) -> None:
        self.stats.kept_through_change += 1
        log.info(
            "worker id %d: its lease record in %s is exactly as this daemon last wrote it and its lease never lapsed,"
            " so it was kept through Redis's restart or failover; still serving",
            worker_id,
            self.where,
        )

    def acquired(self, acquired: Acquired, min_id: int, max_id: int) -> None:
        """What an acquire found on the way (whether or not it got an id)."""
        until = _at(acquired.barrier_ms) if acquired.barrier_ms else ""
        left = max(0.0, (acquired.barrier_ms - acquired.now_ms) / 1000)
        if acquired.created == 1:
            log.warning(
                "created the worker id pool %d..%d in %s. A pool created by a daemon cannot be told apart from"
                " one Redis lost, so no daemon serves from it until %s (%.1fs: lease ttl + 2 x clock skew max);"
                " `katsubushi-py lease init` creates a pool that serves at once",
                min_id,
                max_id,
                self.where,
                until,
                left,
            )
        elif acquired.created == 2:
            self.stats.data_loss_events += 1
            log.error(
                "DATA LOSS: the worker id pool in %s is gone (it existed when this daemon last leased from it:"
                " FLUSHALL, a Redis restart without persistence, or a failover that lost writes). Re-created it;"
                " no daemon serves from it until %s (%.1fs: lease ttl + 2 x clock skew max)",
                self.where,
                until,
                left,
            )
        self.news(acquired)
        for worker_id, reason in acquired.quarantined:
            self.stats.quarantined_ids += 1
            level, message = _QUARANTINED.get(reason, _QUARANTINED["damaged"])
            if level == logging.ERROR:
                self.stats.data_loss_events += 1
            wait = self.unreleased_wait if reason == "unreleased" else self.recovery_wait
            log.log(level, message.format(id=worker_id, where=self.where, wait=wait))
        for worker_id in acquired.present:
            self.stats.data_loss_events += 1
            self.stats.lost_writes += 1
            log.error(
                "DATA LOSS: worker id %d looks free in %s, but a live holder is subscribed to its holder channel:"
                " Redis lost that holder's writes (its data rolled back in place: a reload of an older RDB, a"
                " FLUSHALL and RESTORE of a backup). Left it to its holder; no daemon serves a newly leased id until"
                " %s (%.1fs: lease ttl + 2 x clock skew max)",
                worker_id,
                self.where,
                _at(acquired.barrier_ms),
                max(0.0, (acquired.barrier_ms - acquired.now_ms) / 1000),
            )
        if acquired.skipped:
            self.stats.skipped_live_leases += len(acquired.skipped)
            log.warning(
                "worker id%s %s: lease expired by Redis's clock, but its holder reserved IDs past this host's clock"
                " (Redis's clock may have jumped forward, or this host's is behind): left to its holder",
                "s" if len(acquired.skipped) > 1 else "",
                ", ".join(map(str, acquired.skipped[:10])) + (" ..." if len(acquired.skipped) > 10 else ""),
            )

    # -- one lease -------------------------------------------------------------------------------
    def lost(self, worker_id: int, outcome: RenewOutcome, lapsed: bool = False) -> None:
        """The renew found the id no longer ours, or Redis lost or rewrote it: say what and why.
        ``lapsed``: the renew was sent after this daemon's lease had lapsed (a pause of this daemon or
        of Redis, a cut-off): then an owner entry gone is the ordinary quarantine of a lease that ended
        without a release, not lost data."""
        if lapsed and isinstance(outcome, RecordLost) and outcome.what == "owner entry vanished":
            self.stats.quarantined_ids += 1
            log.warning(
                "worker id %d's lease lapsed before this daemon could renew it (this daemon or Redis was paused,"
                " slow or cut off), and another daemon found it ended without a release and quarantined it:"
                " this daemon had stopped issuing under it at its deadline; leasing another",
                worker_id,
            )
            return
        if isinstance(outcome, TakenOver):
            if outcome.lost:
                self.stats.data_loss_events += 1
                self.stats.lost_writes += 1
                log.error(
                    "DATA LOSS: worker id %d is leased to another daemon in %s although this daemon's lease never"
                    " lapsed: Redis lost writes (its data rolled back in place, a restore, or a failover that lost"
                    " them) and the id was leased again. Stopped issuing under it at once; no daemon serves a newly"
                    " leased id until %s (%.1fs: lease ttl + 2 x clock skew max); leasing another",
                    worker_id,
                    self.where,
                    _at(outcome.doubt_until_ms),
                    max(0.0, (outcome.doubt_until_ms - outcome.now_ms) / 1000),
                )
            elif outcome.doubt_until_ms > outcome.now_ms:
                self.stats.data_loss_events += 1
                log.error(
                    "DATA LOSS: worker id %d is leased to another daemon in %s while the pool is in doubt (Redis"
                    " lost writes: a restart, a failover or a rollback; the acquire of this daemon's lease was lost,"
                    " or another daemon leased the id meanwhile). Stopped issuing under it at once; leasing another",
                    worker_id,
                    self.where,
                )
            else:
                log.error(
                    "worker id %d is no longer ours (its owner token changed in Redis); stopped issuing under it"
                    " and leasing another",
                    worker_id,
                )
            return
        self.stats.data_loss_events += 1
        if isinstance(outcome, PoolLost):
            scope, until_ms = "the pool", outcome.barrier_ms
            if outcome.what == "missing":
                found = (
                    f"Redis lost the worker id pool in {self.where} (FLUSHALL, a restart without persistence, or a"
                    " failover that lost writes)"
                )
            else:
                found = (
                    f"the worker id pool in {self.where} was created anew since this daemon leased worker id"
                    f" {worker_id} (Redis lost its data, then a daemon or `lease init` made a new pool)"
                )
        else:
            assert isinstance(outcome, RecordLost)
            self.stats.quarantined_ids += 1
            if outcome.what == "two claimants" or (
                outcome.what == "owner entry vanished" and outcome.doubt_until_ms == outcome.until_ms
            ):
                self.stats.lost_writes += 1
            scope, until_ms = "that id", outcome.until_ms
            found = self._record_lost(worker_id, outcome)
        log.error(
            "DATA LOSS: %s. Stopped issuing under worker id %d at once; no daemon serves under %s until %s (%.1fs"
            " from now; lease ttl + 2 x clock skew max from when the loss was seen); leasing a worker id again",
            found,
            worker_id,
            scope,
            _at(until_ms),
            max(0.0, (until_ms - outcome.now_ms) / 1000),
        )

    def _record_lost(self, worker_id: int, outcome: RecordLost) -> str:
        restarted = " after Redis restarted or failed over" if outcome.change == "changed" else ""
        # The window the pool is in: a restart's (changed_ms while it lasts) or one lost writes opened.
        window = " after Redis restarted or failed over" if outcome.changed_ms else " after Redis lost writes"
        expiry = _at(outcome.found_expiry_ms) if outcome.found_expiry_ms > 0 else str(outcome.found_expiry_ms)
        if outcome.what == "owner entry vanished":
            return (
                f"worker id {worker_id}'s lease record in {self.where} lost its owner entry (data loss, a hand edit,"
                " or another daemon found the record damaged or never released, and quarantined it)"
            )
        if outcome.what == "two claimants":
            return (
                f"worker id {worker_id} has two claimants in {self.where}: another daemon subscribed to its holder"
                " channel took it too (Redis lost the writes of one of the two acquires: a rollback in place). This"
                " daemon had not served under it yet"
            )
        if outcome.what == "in doubt":
            return (
                f"worker id {worker_id} is in doubt{restarted or window}: this"
                " daemon's lease lapsed meanwhile (or a renew's outcome was not seen), so it cannot vouch that"
                f" nobody leased the id in writes {self.where} lost"
            )
        return (
            f"worker id {worker_id}'s lease record in {self.where} is not what this daemon last wrote{restarted}"
            f" (found expiry {expiry},"
            f" mark {outcome.found_mark_ms}: Redis went back in time (a restart from an older snapshot, lost AOF"
            " writes, a failover to a replica that missed writes) or the record was edited)"
        )

    def lost_at_release(self, worker_id: int) -> None:
        self.stats.data_loss_events += 1
        self.stats.lost_writes += 1
        log.error(
            "DATA LOSS: worker id %d was no longer ours at release although this daemon's lease never lapsed:"
            " Redis at %s lost lease writes (its data rolled back in place, a restore, or a failover that lost"
            " them). No daemon serves a newly leased id for %.1fs (lease ttl + 2 x clock skew max)",
            worker_id,
            self.where,
            self.recovery_wait,
        )

    def conflict(self, worker_id: int, why: str) -> None:
        self.stats.state_file_conflicts += 1
        self.stats.quarantined_ids += 1
        log.error(
            "worker id %d was free in Redis, but %s: another daemon of this host issues under it (one with"
            " --worker-id %d sharing this state directory, or a leasing daemon whose lease Redis lost)."
            " Quarantined it in Redis for %.1fs and leasing another",
            worker_id,
            why,
            worker_id,
            self.recovery_wait,
        )

    # -- Redis's clock ---------------------------------------------------------------------------
    def pool_mark_ahead(self, ahead_ms: int, skew_max: float) -> None:
        log.warning(
            "the worker id pool in %s holds a high-water mark %.1fs ahead of this daemon's (its clock plus the"
            " lease ttl), more than 2 x --clock-skew-max %gs allows: a daemon of this pool issued IDs with a"
            " clock that far ahead of this host's (a host synced to a Redis clock that was off passes the clock"
            " check), or this host's clock is behind. Uniqueness holds (an id taken over from it waits for its"
            " mark) unless Redis loses its data while clocks are off: check NTP on every host, Redis's included",
            self.where,
            ahead_ms / 1000,
            skew_max,
        )

    def redis_clock_step(self, step: float, offset_ms: float, skew_max: float) -> None:
        self.stats.redis_clock_steps += 1
        beyond = abs(offset_ms) / 1000 > skew_max
        log.warning(
            "Redis's clock stepped %+.1fs against this host's between two renews (Redis TIME is now %+.1fs from"
            " this host's clock%s). Leases in Redis expire by Redis's clock: a forward step makes live leases look"
            " expired (their holders keep them), a backward one longer. Check the clock (NTP) of the Redis host%s",
            step,
            offset_ms / 1000,
            ", more than --clock-skew-max: daemons starting now refuse to start" if beyond else "",
            " and of this one" if beyond else "",
        )

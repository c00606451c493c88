"""The holder's state machine (katsubushi_py/leasing/holder.py), the watch on Redis's clock, the derived
waits (timings.py) and what the daemon reports for each finding (recovery.py): pure logic, no Redis."""

from __future__ import annotations

import logging

import pytest

from katsubushi_py.leasing.holder import Holding, RedisClockWatch
from katsubushi_py.leasing.recovery import LeaseStats, Reporter
from katsubushi_py.leasing.replies import Acquired, Lease, PoolNews, RecordLost, Renewed, TakenOver
from katsubushi_py.leasing.timings import LeaseTimings

TIMINGS = LeaseTimings(ttl=3.0, renew=1.0, delay=2.0)  # margin 0.3 s
NOW_MS = 1_800_000_000_000


def acquired(**fields: object) -> Acquired:
    base: dict[str, object] = {"now_ms": NOW_MS, "lease": Lease(5, "tok"), "expiry_ms": NOW_MS + 3000, "mark_ms": 7}
    return Acquired(**{**base, **fields})  # type: ignore[arg-type]


def renewed(now_ms: int = NOW_MS + 1000, mark: int = NOW_MS + 4000, **fields: object) -> Renewed:
    return Renewed(now_ms=now_ms, expiry_ms=now_ms + 3000, mark_ms=mark, **fields)  # type: ignore[arg-type]


# -- serving ----------------------------------------------------------------------------------------
def test_a_new_lease_serves_only_after_its_first_renew() -> None:
    h = Holding(acquired(), TIMINGS, sent=100.0, received=100.01, local_ms=NOW_MS, after_ms=0)
    assert h.fence(100.02) == (0, None) and h.open  # nothing stands in the way but the deadline...
    assert h.state(100.02) == "unconfirmed"  # ...which the first renew sets
    h.renewed(100.5, 100.51, renewed())
    assert h.deadline == pytest.approx(100.5 + 3.0 - 0.3)
    assert h.fence(100.6) == (int(h.deadline * 1e9), None) and h.state(100.6) == "held"
    assert h.state(h.deadline) == "unconfirmed"


def test_a_barrier_and_the_handover_mark_keep_it_fenced_saying_why() -> None:
    h = Holding(acquired(barrier_ms=NOW_MS + 2000), TIMINGS, 100.0, 100.0, local_ms=NOW_MS, after_ms=NOW_MS + 4000)
    deadline_ns, why = h.fence(101.0)
    assert deadline_ns == 0 and why is not None and "pool recovering until" in why and h.state(101.0) == "recovering"
    deadline_ns, why = h.fence(103.0)
    assert deadline_ns == 0 and why is not None and "waiting for this host's clock to pass the handover mark" in why
    assert h.state(103.0) == "delay"
    assert h.serve_after == pytest.approx(104.001)


def test_a_pool_wide_loss_seen_at_a_renew_fences_a_holder() -> None:
    h = Holding(acquired(), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    h.renewed(100.5, 100.5, renewed(barrier_ms=NOW_MS + 6000))
    assert h.state(101.0) == "recovering" and h.recovering_until == pytest.approx(100.5 + 5.0)


# -- vouching ----------------------------------------------------------------------------------------
def test_vouching_for_its_record() -> None:
    h = Holding(acquired(), TIMINGS, sent=100.0, received=100.0, local_ms=NOW_MS, after_ms=0)
    assert h.vouch(100.5) == ("7", 1)  # the mark it found, and its lease has not lapsed
    h.unanswered(NOW_MS + 3500)  # a renew that may or may not have been written
    assert h.vouch(100.6) == (f"7,{NOW_MS + 3500}", 1)
    h.renewed(101.0, 101.0, renewed(mark=NOW_MS + 4000))
    assert h.vouch(101.1) == (f"{NOW_MS + 4000}", 1)
    assert h.vouch(101.0 + 3.0 - 0.3) == (f"{NOW_MS + 4000}", 0)  # lapsed: it cannot vouch nobody else leased it


def test_a_renew_that_did_not_count_keeps_both_marks() -> None:
    """Written on the master, not acknowledged by its replicas: a promoted replica may hold the mark
    before it, or this one."""
    h = Holding(acquired(), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    h.written(renewed(mark=NOW_MS + 4000))
    assert h.vouch(100.1) == (f"7,{NOW_MS + 4000}", 1)
    assert h.deadline == 0.0  # and it does not confirm the lease


def test_many_unanswered_renews_keep_the_range_from_the_confirmed_mark() -> None:
    """A failover retried every fraction of a second for seconds: the record may hold the confirmed mark
    or any one written since, never loses track of the confirmed one (it was dropped after 16 before,
    and a holder whose record a promoted replica held as confirmed could not vouch for it)."""
    h = Holding(acquired(), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    for n in range(100):
        h.unanswered(NOW_MS + n)
        h.written(renewed(mark=NOW_MS + n + 1))
    assert h.vouch(100.1) == (f"7,{NOW_MS + 100}", 1)
    h.renewed(100.2, 100.2, renewed())
    assert h.vouch(100.3)[0] == str(NOW_MS + 4000)


def test_kept_through_a_change_is_reported_once() -> None:
    h = Holding(acquired(), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    window = {"doubt_until_ms": NOW_MS + 9000, "changed_ms": NOW_MS + 500}
    assert h.kept_after(renewed(**window))
    assert not h.kept_after(renewed(**window))
    assert not h.kept_after(renewed())  # no window
    later = Holding(acquired(now_ms=NOW_MS + 600), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    assert not later.kept_after(renewed(**window))  # leased after the change: nothing was kept


def test_a_lease_taken_in_a_doubt_window_is_not_kept_through_it() -> None:
    """Every script that extends a doubt window (a record found rewritten after the restart) re-stamps
    its changed_ms: a lease taken in the window, after the restart, saw a later changed_ms at its next
    renew and was logged as kept through the restart (issue 32). The same for a lease kept through it
    once: the re-stamp is the same event."""
    taken = Holding(acquired(doubt_until_ms=NOW_MS + 9000, changed_ms=NOW_MS - 100), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    restamped = {"doubt_until_ms": NOW_MS + 9500, "changed_ms": NOW_MS + 500}
    assert not taken.kept_after(renewed(**restamped))
    assert not taken.kept_after(renewed(now_ms=NOW_MS + 9000, doubt_until_ms=NOW_MS + 12_000, changed_ms=NOW_MS + 8000))
    # A restart after that window ended is one it was kept through.
    assert taken.kept_after(renewed(now_ms=NOW_MS + 20_000, doubt_until_ms=NOW_MS + 30_000, changed_ms=NOW_MS + 19_000))
    held = Holding(acquired(), TIMINGS, 100.0, 100.0, NOW_MS, 0)
    assert held.kept_after(renewed(doubt_until_ms=NOW_MS + 9000, changed_ms=NOW_MS + 500))
    assert not held.kept_after(renewed(now_ms=NOW_MS + 2000, doubt_until_ms=NOW_MS + 10_000, changed_ms=NOW_MS + 1900))


# -- Redis's clock -----------------------------------------------------------------------------------
def test_redis_clock_steps_are_told_from_round_trips() -> None:
    watch = RedisClockWatch(threshold=0.5)
    assert watch.observe(NOW_MS, NOW_MS, rtt=0.002) is None
    assert watch.observe(NOW_MS + 1000, NOW_MS + 1000, rtt=0.002) is None  # both moved a second
    assert watch.observe(NOW_MS + 2400, NOW_MS + 2000, rtt=0.002) is None  # 0.4 s: drift, or the loop
    assert watch.observe(NOW_MS + 3400, NOW_MS + 3000, rtt=0.9) is None  # a slow round trip explains it
    assert watch.observe(NOW_MS + 3500, NOW_MS + 3500, rtt=0.002) is None
    assert watch.observe(NOW_MS + 9500, NOW_MS + 4500, rtt=0.002) == pytest.approx(5.0, abs=0.01)
    assert watch.observe(NOW_MS - 25_000, NOW_MS + 5000, rtt=0.002) == pytest.approx(-35.0, abs=0.01)


def test_a_paused_redis_is_not_a_clock_step() -> None:
    """A renew in flight while Redis was paused, answered when it resumed: Redis read its clock at the
    end of a 4 s round trip. Its midpoint is 2 s off the true offset, and the next quick renew looked
    like a 2 s backward step (issue 32). Its range covers the true offset: no step."""
    watch = RedisClockWatch(threshold=0.5)
    watch.seed(0.0, rtt=0.002)
    assert watch.observe(NOW_MS + 1000, NOW_MS + 1000, rtt=0.002) is None
    assert watch.observe(NOW_MS + 6000, NOW_MS + 2000, rtt=4.0) is None  # sent at 2 s, read at 6 s
    assert watch.observe(NOW_MS + 7000, NOW_MS + 7000, rtt=0.002) is None
    # A step a long round trip cannot explain is still one, on either side of it.
    assert watch.observe(NOW_MS + 9000, NOW_MS + 8000, rtt=4.0) is None  # within its 4 s: unproven
    assert watch.observe(NOW_MS + 19_000, NOW_MS + 10_000, rtt=0.002) == pytest.approx(8.0, abs=0.01)  # at least
    assert watch.offset_ms == pytest.approx(8999, abs=1)


def test_the_start_check_seeds_the_watch_with_its_round_trip() -> None:
    watch = RedisClockWatch(threshold=0.5)
    watch.seed(-800.0, rtt=2.0)  # a slow start check: the offset was anywhere in -1.8 .. +0.2 s
    assert watch.observe(NOW_MS, NOW_MS, rtt=0.002) is None
    watch = RedisClockWatch(threshold=0.5)
    watch.seed(-800.0, rtt=0.002)
    assert watch.observe(NOW_MS, NOW_MS, rtt=0.002) == pytest.approx(0.8, abs=0.01)


def test_waits_derived_from_the_timings() -> None:
    assert TIMINGS.recovery_wait(1.0) == 5.0
    assert TIMINGS.unreleased_wait(1.0) == 5.0
    assert LeaseTimings(3.0, 1.0, 9.0).unreleased_wait(1.0) == 9.0  # a longer --lease-delay is honoured


# -- what is reported ----------------------------------------------------------------------------------
@pytest.fixture
def reporter() -> Reporter:
    return Reporter(LeaseStats(), "redis://r:6379/0 (ns=t)", recovery_wait=5.0, unreleased_wait=6.0)


def test_quarantines_found_by_an_acquire(reporter: Reporter, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "katsubushi_py")
    reporter.acquired(acquired(quarantined=[(1, "unreleased"), (2, "damaged")], skipped=[3, 4]), 1, 9)
    stats = reporter.stats
    assert (stats.quarantined_ids, stats.data_loss_events, stats.skipped_live_leases) == (2, 1, 2)
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert (
        lines[0][0] == "WARNING"
        and "worker id 1's lease in redis://r:6379/0 (ns=t) ended without a release" in lines[0][1]
    )
    assert "nobody leases it for 6.0s" in lines[0][1]
    assert lines[1][0] == "ERROR" and lines[1][1].startswith("DATA LOSS: worker id 2's lease record")
    assert lines[2][0] == "WARNING" and lines[2][1].startswith("worker ids 3, 4: lease expired by Redis's clock")


def test_a_restart_is_reported_once_per_change(reporter: Reporter, caplog: pytest.LogCaptureFixture) -> None:
    news = PoolNews(now_ms=NOW_MS, doubt_until_ms=NOW_MS + 5000, changed_ms=NOW_MS - 10, change="changed")
    reporter.news(news)
    reporter.news(PoolNews(now_ms=NOW_MS + 100, doubt_until_ms=NOW_MS + 5000, changed_ms=NOW_MS - 10))
    reporter.news(PoolNews(now_ms=NOW_MS + 9000, doubt_until_ms=NOW_MS + 5000, changed_ms=NOW_MS + 10))  # over
    assert reporter.stats.redis_changes == 1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "restarted or failed over (this daemon saw first" in messages[0]
    assert "(5.0s: lease ttl + 2 x clock skew max)" in messages[0]


def test_a_window_restamped_is_the_same_restart(reporter: Reporter, caplog: pytest.LogCaptureFixture) -> None:
    """One Redis restart was reported up to three times (issue 32): each script that extends its doubt
    window (a record found rewritten, a holder that cannot vouch) stamps changed_ms anew."""
    reporter.news(PoolNews(now_ms=NOW_MS, doubt_until_ms=NOW_MS + 5000, changed_ms=NOW_MS))
    reporter.news(PoolNews(now_ms=NOW_MS + 20, doubt_until_ms=NOW_MS + 5020, changed_ms=NOW_MS + 20))
    reporter.news(PoolNews(now_ms=NOW_MS + 900, doubt_until_ms=NOW_MS + 5900, changed_ms=NOW_MS + 900))
    assert reporter.stats.redis_changes == 1 and len(caplog.records) == 1
    # A restart after the window ended is another; this daemon's own script seeing a new identity too.
    reporter.news(PoolNews(now_ms=NOW_MS + 9000, doubt_until_ms=NOW_MS + 14_000, changed_ms=NOW_MS + 9000))
    reporter.news(
        PoolNews(now_ms=NOW_MS + 9500, doubt_until_ms=NOW_MS + 14_500, changed_ms=NOW_MS + 9500, change="changed")
    )
    assert reporter.stats.redis_changes == 3 and len(caplog.records) == 3


def test_a_lapsed_holder_quarantined_as_unreleased_is_no_data_loss(
    reporter: Reporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder paused past its lease finds its owner entry gone: another daemon quarantined the id as
    ended without a release, as it should. A WARNING, not DATA LOSS (issue 32); the same finding by a
    holder whose lease never lapsed is lost data."""
    vanished = RecordLost(now_ms=NOW_MS, what="owner entry vanished", until_ms=NOW_MS + 5000)
    reporter.lost(5, vanished, lapsed=True)
    assert caplog.records[0].levelname == "WARNING" and "DATA LOSS" not in caplog.records[0].getMessage()
    assert "lapsed" in caplog.records[0].getMessage() and reporter.stats.data_loss_events == 0
    reporter.lost(5, vanished, lapsed=False)
    assert caplog.records[1].getMessage().startswith("DATA LOSS") and reporter.stats.data_loss_events == 1


@pytest.mark.parametrize(
    ("outcome", "says", "loss"),
    [
        (TakenOver(now_ms=NOW_MS), "is no longer ours (its owner token changed", 0),
        (TakenOver(now_ms=NOW_MS, doubt_until_ms=NOW_MS + 1), "DATA LOSS: worker id 5 is leased to another", 1),
        (RecordLost(now_ms=NOW_MS, what="in doubt", until_ms=NOW_MS + 5000), "cannot vouch", 1),
        (RecordLost(now_ms=NOW_MS, what="record changed", until_ms=NOW_MS + 5000), "is not what this daemon", 1),
    ],
)
def test_a_lost_lease_says_why(
    reporter: Reporter, caplog: pytest.LogCaptureFixture, outcome: object, says: str, loss: int
) -> None:
    reporter.lost(5, outcome)  # type: ignore[arg-type]
    assert says in caplog.records[0].getMessage() and reporter.stats.data_loss_events == loss


def test_a_redis_clock_step_beyond_the_skew_says_what_follows(
    reporter: Reporter, caplog: pytest.LogCaptureFixture
) -> None:
    reporter.redis_clock_step(30.0, 30_000, skew_max=5.0)
    message = caplog.records[0].getMessage()
    assert message.startswith("Redis's clock stepped +30.0s against this host's between two renews")
    assert "daemons starting now refuse to start" in message and reporter.stats.redis_clock_steps == 1

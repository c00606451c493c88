"""Each rule of the lease scripts (katsubushi_py/leasing/scripts.py) on its own, against a real
redis-server: the record checks an acquire makes, quarantine, the Redis identity and the doubt window
after a restart or failover, a holder vouching for its record, and the occupancy count. Records are
written by hand to be exactly the case under test; the scripts are called directly (no daemon)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_servers import RedisServer, start_redis

from katsubushi_py.leasing.replies import Acquired, PoolNews, RecordLost, Renewed, parse_acquire, parse_identity
from katsubushi_py.leasing.replies import parse_renew as _parse_renew
from katsubushi_py.leasing.scripts import ACQUIRE_LUA, IDENTITY_LUA, INIT_LUA, RELEASE_LUA, RENEW_LUA

TTL, WAIT, SKEW, UNRELEASED = 3000, 5000, 1000, 6000  # ms
KEYS = [f"{{r}}:{name}" for name in ("ids", "owners", "last_ms", "released", "stats", "pool")]
IDS, OWNERS, MARKS, RELEASED, STATS, POOL = KEYS


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(Path(tmp_path_factory.mktemp("records")) / "redis")
    try:
        yield server
    finally:
        server.stop()


class Pool:
    def __init__(self, server: RedisServer) -> None:
        self.r = server.client()
        self.r.delete(*KEYS)
        self.epoch = "e1"
        assert self.r.eval(INIT_LUA, 6, *KEYS, 1, 4, self.epoch) == 4

    def now(self) -> int:
        seconds, micros = self.r.time()
        return seconds * 1000 + micros // 1000

    def acquire(self, token: str = "t-new", caller: int | None = None, lo: int = 1, hi: int = 4) -> Acquired:
        caller = self.now() if caller is None else caller
        args = [token, TTL, lo, hi, self.epoch, WAIT, SKEW, "e-new", caller, UNRELEASED]
        return parse_acquire(self.r.eval(ACQUIRE_LUA, 6, *KEYS, *args), token)

    def renew(
        self, token: str, worker_id: int, marks: str, good: int = 1, seen: int = 0, caller: int | None = None
    ) -> Any:
        caller = self.now() if caller is None else caller
        args = [token, worker_id, TTL, caller + TTL, self.epoch, WAIT, SKEW, seen, 1, 4, "e-new", marks, good, caller]
        return _parse_renew(self.r.eval(RENEW_LUA, 6, *KEYS, *args))

    def release(self, token: str, worker_id: int, last_ms: int) -> list[Any]:
        args = [token, worker_id, last_ms, self.epoch, "clean", WAIT, SKEW, TTL, self.now(), "{r}:released-channel"]
        return self.r.eval(RELEASE_LUA, 6, *KEYS, *args)

    def identity(self) -> PoolNews:
        return parse_identity(self.r.eval(IDENTITY_LUA, 6, *KEYS, WAIT, SKEW, TTL, self.now()))

    def record(self, worker_id: int, score: int, owner: str | None, mark: int | None, released: bool) -> None:
        """Write one id's record by hand."""
        self.r.zadd(IDS, {str(worker_id): score})
        for key, value in ((OWNERS, owner), (MARKS, mark), (RELEASED, 1 if released else None)):
            if value is None:
                self.r.hdel(key, worker_id)
            else:
                self.r.hset(key, worker_id, value)

    def busy(self, *worker_ids: int) -> None:
        """Held by others, unexpired: out of the acquire's way."""
        far = self.now() + 60_000
        for worker_id in worker_ids:
            self.record(worker_id, far, f"other-{worker_id}", far, False)

    def counter(self, name: str) -> int:
        return int(self.r.hget(STATS, name) or 0)

    def field(self, worker_id: int) -> tuple[float | None, bytes | None, int | None, bool]:
        mark = self.r.hget(MARKS, worker_id)
        return (
            self.r.zscore(IDS, worker_id),
            self.r.hget(OWNERS, worker_id),
            None if mark is None else int(mark),
            bool(self.r.hexists(RELEASED, worker_id)),
        )


@pytest.fixture
def pool(server: RedisServer) -> Pool:
    return Pool(server)


# -- record checks at acquire ---------------------------------------------------------------------
def test_a_fresh_pool_hands_out_its_lowest_id_released_and_clean(pool: Pool) -> None:
    got = pool.acquire()
    assert got.lease.worker_id == 1 and got.mark_ms == 0 and got.handover_ms == 0 and got.barrier_ms == 0
    assert got.change == "same" and not got.quarantined
    assert pool.field(1)[1:] == (b"t-new", 0, False)


def test_a_clean_release_is_taken_with_its_exact_mark(pool: Pool) -> None:
    pool.busy(1, 2, 3)
    now = pool.now()
    pool.record(4, now - 10, None, now - 20, True)
    got = pool.acquire()
    assert got.lease.worker_id == 4 and got.handover_ms == now - 20 and got.mark_ms == now - 20


def test_expired_never_released_is_quarantined_not_taken(pool: Pool) -> None:
    """An owner entry and no release: its holder may be alive (paused, cut off, its record wrong)."""
    pool.busy(2, 3, 4)
    now = pool.now()
    pool.record(1, now - 5000, "crashed", now - 5000, False)
    got = pool.acquire(caller=now)
    assert not got.got and got.quarantined == [(1, "unreleased")]
    score, owner, mark, released = pool.field(1)
    assert owner is None and released  # a live holder finds its owner entry gone
    assert score is not None and score >= now + UNRELEASED  # leased to nobody for the unreleased wait
    assert mark is not None and mark >= now + TTL + 2 * SKEW  # covers what its holder can have issued
    assert got.next_free_ms == score  # a waiting daemon knows when to look again
    assert pool.counter("quarantined_unreleased") == 1 and pool.counter("data_loss_events") == 0


def test_expired_by_redis_clock_but_its_holder_reserved_past_ours_is_left_alone(pool: Pool) -> None:
    """Redis's clock jumped forward (or ours is behind): the holder's own mark says it may be serving."""
    pool.busy(2, 3)
    now = pool.now()
    pool.record(1, now - 5000, "live", now + 2000, False)
    pool.record(4, now - 10, None, now - 10, True)
    got = pool.acquire(caller=now)
    assert got.lease.worker_id == 4 and got.skipped == [1] and not got.quarantined  # the released one instead
    assert pool.field(1)[1] == b"live"
    assert pool.counter("skipped_live_leases") == 1


@pytest.mark.parametrize(
    ("owner", "mark", "released"),
    [("h", None, False), (None, None, True), ("h", 0, True), (None, 1234, False)],
    ids=["no mark", "no mark, released", "owner entry beside a release", "neither owner entry nor release"],
)
def test_damaged_records_are_quarantined(pool: Pool, owner: str | None, mark: int | None, released: bool) -> None:
    pool.busy(2, 3, 4)
    now = pool.now()
    pool.record(1, now - 5000, owner, mark, released)
    got = pool.acquire(caller=now)
    assert not got.got and got.quarantined == [(1, "damaged")]
    assert pool.field(1)[0] >= now + WAIT  # type: ignore[operator]
    assert pool.counter("quarantined_damaged") == 1 and pool.counter("data_loss_events") == 1


def test_a_fresh_id_of_a_pool_made_before_the_release_entries(pool: Pool) -> None:
    """Pools made by 1.0 have no release entry for their fresh ids (mark 0, scored before the pool)."""
    pool.busy(2, 3, 4)
    pool.r.hdel(RELEASED, 1)
    pool.r.hdel(POOL, "format")
    assert pool.acquire().lease.worker_id == 1


def test_a_record_that_only_looks_like_an_old_pools_fresh_id_is_damaged(pool: Pool) -> None:
    """Found by the lease simulation (seed 83): a held id's expiry and mark set to 0, then its owner
    entry deleted, looked like a fresh id of a pool made before release entries, and was taken at once
    while its holder (paused) could still issue. A pool of this format has none: it is quarantined."""
    pool.busy(2, 3, 4)
    pool.record(1, 0, None, 0, False)
    got = pool.acquire()
    assert not got.got and got.quarantined == [(1, "damaged")]


def test_a_clean_id_whose_mark_is_ahead_of_our_clock_only_when_nothing_else(pool: Pool) -> None:
    pool.busy(3, 4)
    now = pool.now()
    pool.record(1, now - 50, None, now + 4000, True)  # released first, by a holder whose clock is ahead
    pool.record(2, now - 10, None, now - 10, True)
    assert pool.acquire(caller=now).lease.worker_id == 2
    got = pool.acquire(token="t2", caller=now)
    assert got.lease.worker_id == 1 and got.handover_ms == now + 4000  # its holder waits for its clock


def test_a_quarantine_is_never_shortened(pool: Pool) -> None:
    pool.busy(2, 3, 4)
    now = pool.now()
    pool.record(1, now + 60_000, None, now, True)  # quarantined for a minute already
    pool.record(1, now - 1, "h", now - 1, False)
    pool.r.zadd(IDS, {"1": now + 60_000}, xx=True)
    pool.r.hdel(OWNERS, 1)
    got = pool.renew("h", 1, str(now - 1))  # its owner entry is gone: quarantined again, not shorter
    assert isinstance(got, RecordLost) and got.what == "owner entry vanished"
    assert pool.field(1)[0] == now + 60_000


# -- quarantine marks: on both clocks --------------------------------------------------------------
def test_a_quarantine_mark_covers_the_callers_clock_when_redis_is_behind(pool: Pool) -> None:
    pool.busy(2, 3, 4)
    now = pool.now()
    pool.record(1, now - 5000, "crashed", now - 5000, False)
    caller = now + 30_000  # Redis's clock stepped 30 s back
    pool.acquire(caller=caller)
    assert pool.field(1)[2] == caller + TTL + 2 * SKEW


# -- the pool's high-water mark: clocks off together -------------------------------------------------
def test_every_renew_raises_the_pools_high_water_mark_never_lowers_it(pool: Pool) -> None:
    got = pool.acquire(token="h")
    caller = pool.now() + 18_000  # a holder whose clock is 18 s ahead (synced to a Redis clock that was)
    assert isinstance(pool.renew("h", 1, str(got.mark_ms), caller=caller), Renewed)
    assert int(pool.r.hget(POOL, "mark_hw_ms")) == caller + TTL
    later = pool.acquire(token="h2")
    assert isinstance(pool.renew("h2", later.lease.worker_id, str(later.mark_ms)), Renewed)
    assert int(pool.r.hget(POOL, "mark_hw_ms")) == caller + TTL  # a lower mark leaves it


def test_a_lost_mark_is_covered_by_the_pools_high_water_mark_whatever_the_clocks_say(pool: Pool) -> None:
    """Issue 23's clock gap (simulation seed 1015, here in its mirror image, which needs no step of this
    Redis's clock): a holder whose clock is 18 s ahead (its host synced to a Redis clock that was 18 s
    ahead, and passed the clock check) renews, then crashes; its record loses its mark; Redis's clock and
    the daemon that finds the id are right. Bounded by those two clocks alone, the quarantine mark falls
    18 s below what the holder issued; the pool's high-water mark keeps it above."""
    pool.busy(2, 3, 4)
    got = pool.acquire(token="h")
    ahead = pool.now() + 18_000
    assert isinstance(pool.renew("h", 1, str(got.mark_ms), caller=ahead), Renewed)  # issues below ahead + TTL
    pool.r.hset(MARKS, 1, 0)  # the mark lost (an edit, a bad restore)
    pool.r.zadd(IDS, {"1": 0})  # and the expiry
    right = pool.now()
    got = pool.acquire(token="n", caller=right)
    assert got.quarantined == [(1, "unreleased")]
    mark = pool.field(1)[2]
    assert mark is not None and mark >= ahead + TTL  # the holder's high-water mark
    assert right + TTL + 2 * SKEW < ahead + TTL  # which the clocks alone would not have given


def test_a_doubt_windows_mark_outlives_the_window(pool: Pool) -> None:
    """An id whose holder's writes a restart lost looks clean with an older mark: a daemon that takes it
    after the window, with a clock behind, starts after the window's mark, not the record's."""
    restart(pool)
    caller = pool.now()
    opened = pool.acquire(token="first", caller=caller)
    assert opened.change == "changed"
    window_mark = int(pool.r.hget(POOL, "doubt_mark_ms"))
    assert window_mark >= caller + TTL + 2 * SKEW
    pool.r.hset(POOL, "doubt_until_ms", 0)  # the window has ended
    pool.record(2, 0, None, 5, True)  # released, clean, an old mark
    pool.busy(3, 4)
    got = pool.acquire(token="later", caller=caller - 18_000)
    assert got.lease.worker_id == 2 and got.mark_ms == 5
    assert got.barrier_ms <= got.now_ms  # no barrier: the window is over
    assert got.handover_ms == window_mark  # but not below what a lost holder can have issued
    assert int(pool.r.hget(POOL, "mark_hw_ms")) >= window_mark


def test_a_pool_lost_and_made_again_starts_its_high_water_mark_from_the_recovery_mark(pool: Pool) -> None:
    pool.r.delete(*KEYS)
    caller = pool.now()
    got = pool.acquire(caller=caller)
    assert got.created == 2  # lost: this pool's daemons leased from it before
    assert int(pool.r.hget(POOL, "mark_hw_ms")) == int(pool.r.hget(POOL, "recovery_mark_ms")) >= caller + TTL


# -- the Redis identity and the doubt window -------------------------------------------------------
def restart(pool: Pool) -> None:
    """What a restart or failover looks like to the pool: it was stamped under another Redis."""
    pool.r.hset(POOL, "identity", "an-older-run-id/an-older-replid")


def test_a_pool_is_stamped_with_the_redis_it_is_written_under(pool: Pool, server: RedisServer) -> None:
    info = server.client().info("server")["run_id"], server.client().info("replication")["master_replid"]
    assert pool.r.hget(POOL, "identity").decode() == "/".join(info)
    assert pool.identity().change == "same"
    pool.r.hdel(POOL, "identity")  # a pool made by 1.0: stamped, no doubt
    assert pool.identity().change == "new" and pool.r.hget(POOL, "identity").decode() == "/".join(info)


def test_after_a_restart_an_acquire_opens_the_doubt_window(pool: Pool) -> None:
    restart(pool)
    caller = pool.now()
    got = pool.acquire(caller=caller)
    assert got.change == "changed" and got.identity_before == "an-older-run-id/an-older-replid"
    assert got.lease.worker_id == 1
    assert got.barrier_ms == got.doubt_until_ms >= got.now_ms + WAIT  # not served before the window ends
    assert got.handover_ms >= caller + TTL + 2 * SKEW  # and after what a lost holder can have issued
    assert pool.counter("redis_changes") == 1
    again = pool.acquire(token="t2")
    assert again.change == "same" and again.barrier_ms == got.doubt_until_ms  # one window, for everyone in it


def test_a_holder_that_vouches_keeps_its_id_through_a_restart(pool: Pool) -> None:
    got = pool.acquire(token="h")
    first = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(first, Renewed)
    restart(pool)
    assert pool.identity().change == "changed"
    kept = pool.renew("h", 1, str(first.mark_ms))  # its lease never lapsed, its record as it wrote it
    assert isinstance(kept, Renewed) and kept.doubt_until_ms > kept.now_ms and kept.changed_ms > 0
    assert pool.counter("quarantined_ids") == 0


@pytest.mark.parametrize(("marks", "good"), [("{mark}", 0), ("", 1)], ids=["its lease lapsed", "lost track"])
def test_a_holder_that_cannot_vouch_loses_its_id_in_the_window(pool: Pool, marks: str, good: int) -> None:
    got = pool.acquire(token="h")
    first = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(first, Renewed)
    restart(pool)
    lost = pool.renew("h", 1, marks.format(mark=first.mark_ms), good=good)
    assert isinstance(lost, RecordLost) and lost.what == "in doubt" and lost.change == "changed"
    assert lost.until_ms >= lost.now_ms + WAIT
    assert pool.field(1)[1] is None and pool.counter("quarantined_doubt") == 1


def test_a_lapsed_lease_resumes_when_nothing_was_lost(pool: Pool) -> None:
    """No restart, no rollback: its owner entry unchanged means nobody else leased the id."""
    got = pool.acquire(token="h")
    assert isinstance(pool.renew("h", 1, str(got.mark_ms), good=0), Renewed)
    assert isinstance(pool.renew("h", 1, "", good=1), Renewed)


def test_a_record_not_as_its_holder_wrote_it_is_quarantined_and_opens_a_window(pool: Pool) -> None:
    got = pool.acquire(token="h")
    first = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(first, Renewed)
    pool.r.hset(MARKS, 1, 0)  # an edit, or a rollback that lost the last renew
    lost = pool.renew("h", 1, str(first.mark_ms))
    assert isinstance(lost, RecordLost) and lost.what == "record changed" and lost.found_mark_ms == 0
    assert pool.counter("quarantined_rewritten") == 1
    assert pool.acquire(token="next").barrier_ms >= lost.now_ms + WAIT  # what else was lost is unknown


def test_a_renew_whose_answer_never_came_does_not_break_vouching(pool: Pool) -> None:
    """The holder sends each mark its record may hold: what it saw, and what an unanswered renew wrote."""
    got = pool.acquire(token="h")
    caller = pool.now()
    pool.renew("h", 1, str(got.mark_ms), caller=caller)  # its answer was lost
    written = max(got.mark_ms, caller + TTL)
    restart(pool)
    assert isinstance(pool.renew("h", 1, f"{got.mark_ms},{written}"), Renewed)


def test_any_mark_between_the_confirmed_one_and_the_highest_written_vouches(pool: Pool) -> None:
    """A failover retried for seconds leaves the record at the confirmed mark or at any unconfirmed one
    written since (a promoted replica holds a prefix of them): the holder sends the range, not a list."""
    got = pool.acquire(token="h")
    confirmed = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(confirmed, Renewed)
    highest = confirmed.mark_ms + 5000
    pool.r.hset(MARKS, 1, confirmed.mark_ms + 1234)  # one of the unconfirmed renews, as a replica kept it
    restart(pool)
    assert isinstance(pool.renew("h", 1, f"{confirmed.mark_ms},{highest}"), Renewed)
    pool.r.hset(MARKS, 1, confirmed.mark_ms - 1)  # before the confirmed one: it may have issued past it
    lost = pool.renew("h", 1, f"{confirmed.mark_ms},{highest}")
    assert isinstance(lost, RecordLost) and lost.what == "record changed"


def test_a_pool_gone_back_in_time_is_noticed_by_its_write_counter(pool: Pool) -> None:
    got = pool.acquire(token="h")
    lost = pool.renew("h", 1, str(got.mark_ms), seen=got.version + 10)
    assert isinstance(lost, RecordLost) and lost.what == "rolled back"


def test_a_vanished_owner_entry_is_quarantined(pool: Pool) -> None:
    got = pool.acquire(token="h")
    pool.r.hdel(OWNERS, 1)
    lost = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(lost, RecordLost) and lost.what == "owner entry vanished"
    assert pool.counter("quarantined_vanished") == 1


def test_a_release_sees_a_restart_too(pool: Pool) -> None:
    got = pool.acquire(token="h")
    restart(pool)
    assert pool.release("h", got.lease.worker_id, 0) == [1, b"changed"]
    assert pool.acquire(token="next").barrier_ms > pool.now()


def test_someone_elses_id_in_a_window_says_so(pool: Pool) -> None:
    pool.acquire(token="h")
    restart(pool)
    pool.identity()
    pool.r.hset(OWNERS, 1, "someone-else")
    taken = pool.renew("h", 1, "0")
    assert taken.doubt_until_ms > taken.now_ms  # the keeper reports it as data loss, not a plain takeover


# -- occupancy --------------------------------------------------------------------------------------
def test_free_counts_ids_held_by_nobody_whatever_redis_clock_says(pool: Pool) -> None:
    got = pool.acquire(token="h")
    pool.r.zadd(IDS, {"1": 0})  # looks long expired (a forward step of Redis's clock)
    renewed = pool.renew("h", 1, str(got.mark_ms))
    assert isinstance(renewed, Renewed) and (renewed.free, renewed.total) == (3, 4)


def test_lease_stats_measures_redis_clock_against_its_own(server: RedisServer, pool: Pool) -> None:
    import asyncio

    from katsubushi_py.leasing.pool import pool_snapshot, pool_stats
    from katsubushi_py.leasing.target import parse_redis_url

    stats = pool_stats(asyncio.run(pool_snapshot(parse_redis_url(f"{server.url}?ns=r"))))
    assert abs(stats["redis_clock_offset_ms"]) < 200 and stats["pool_size"] == 4

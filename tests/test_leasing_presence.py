"""The lease scripts' rules for lost writes and presence (issue 32), each on its own against a real
redis-server, with real subscriptions: every sign of lost writes opens the doubt window, an acquire
leaves an id that looks free to a subscribed live holder, a stale subscription costs one window, and a
first renew stops a second claimant. Records are written by hand; the scripts are called directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_servers import RedisServer, start_redis
from test_leasing_records import KEYS, POOL, SKEW, TTL, UNRELEASED, WAIT, Pool

from katsubushi_py.leasing.replies import Acquired, RecordLost, Renewed, TakenOver, parse_acquire, parse_renew
from katsubushi_py.leasing.scripts import ACQUIRE_LUA, RELEASE_LUA, RENEW_LUA

# The scripts against a real Redis: the same whichever hot path serves (conftest.py, the once marker).
pytestmark = pytest.mark.once

PREFIX = "{r}:holder:"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(Path(tmp_path_factory.mktemp("presence")) / "redis")
    try:
        yield server
    finally:
        server.stop()


class Presence(Pool):
    """The records' Pool, with the scripts' presence arguments, and holders' subscriptions."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__(server)
        self.subscriptions: list[Any] = []

    def acquire(self, token: str = "t-new", caller: int | None = None, lo: int = 1, hi: int = 4) -> Acquired:
        caller = self.now() if caller is None else caller
        args = [token, TTL, lo, hi, self.epoch, WAIT, SKEW, "e-new", caller, UNRELEASED, PREFIX]
        return parse_acquire(self.r.eval(ACQUIRE_LUA, 6, *KEYS, *args), token)

    def renew_first(self, token: str, worker_id: int, marks: str, expected: int, good: int = 1) -> Any:
        caller = self.now()
        args = [token, worker_id, TTL, caller + TTL, self.epoch, WAIT, SKEW, 0, 1, 4, "e-new", marks, good, caller]
        args += [f"{PREFIX}{worker_id}", expected]
        return parse_renew(self.r.eval(RENEW_LUA, 6, *KEYS, *args))

    def release_good(self, token: str, worker_id: int, good: int) -> list[Any]:
        args = [token, worker_id, 5, self.epoch, "clean", WAIT, SKEW, TTL, self.now(), "{r}:released-channel", good]
        return self.r.eval(RELEASE_LUA, 6, *KEYS, *args)

    def subscribe(self, server: RedisServer, worker_id: int) -> None:
        """A holder's subscription to the id's channel, confirmed (as leasing/presence.py waits for)."""
        pubsub = redis.Redis(host="127.0.0.1", port=server.port).pubsub()
        pubsub.subscribe(f"{PREFIX}{worker_id}")
        assert pubsub.get_message(timeout=2)["type"] == "subscribe"
        self.subscriptions.append(pubsub)

    def doubt_until(self) -> int:
        return int(self.r.hget(POOL, "doubt_until_ms") or 0)

    def close(self) -> None:
        for pubsub in self.subscriptions:
            pubsub.close()


@pytest.fixture
def pool(server: RedisServer) -> Iterator[Presence]:
    pool = Presence(server)
    try:
        yield pool
    finally:
        pool.close()


def held(pool: Presence, worker_id: int, token: str) -> int:
    """The id leased by ``token``, live, its mark as written; returns the mark."""
    mark = pool.now() + TTL
    pool.record(worker_id, pool.now() + TTL, token, mark, False)
    return mark


@pytest.mark.parametrize("good", [1, 0])
def test_an_owner_entry_gone_under_a_live_lease_opens_the_doubt_window(pool: Presence, good: int) -> None:
    mark = held(pool, 1, "A")
    pool.r.hdel("{r}:owners", 1)  # a rollback undid the acquire
    lost = pool.renew("A", 1, str(mark), good=good)
    assert isinstance(lost, RecordLost) and lost.what == "owner entry vanished"
    if good:  # lost writes: the doubt window, which the holder's own next acquire waits out
        assert lost.doubt_until_ms == lost.until_ms == pool.doubt_until() > lost.now_ms
        assert pool.counter("lost_writes_seen") == 1
        assert pool.acquire("A-again").barrier_ms >= lost.until_ms
    else:  # its lease lapsed: someone may have quarantined it (as before issue 32)
        assert pool.doubt_until() == 0 and pool.counter("lost_writes_seen") == 0


@pytest.mark.parametrize("good", [1, 0])
def test_taken_over_under_a_live_lease_is_lost_writes(pool: Presence, good: int) -> None:
    mark = held(pool, 1, "A")
    pool.r.hset("{r}:owners", 1, "J")
    lost = pool.renew("A", 1, str(mark), good=good)
    assert isinstance(lost, TakenOver) and lost.lost == bool(good)
    assert (pool.doubt_until() > lost.now_ms) == bool(good)
    assert pool.counter("lost_writes_seen") == good


@pytest.mark.parametrize("good", [1, 0])
def test_a_release_of_an_id_not_ours_under_a_live_lease_is_lost_writes(pool: Presence, good: int) -> None:
    held(pool, 1, "J")
    assert [int(x) if str(x).isdigit() else x for x in pool.release_good("A", 1, good)][::2] == [0, good]
    assert (pool.doubt_until() > 0) == bool(good)


def test_an_id_that_looks_free_with_a_live_holder_subscribed_is_left_to_it(pool: Presence, server: RedisServer) -> None:
    """The rollback undid A's acquire of 1: the record says free (released, clean); A's subscription
    survived. The acquire takes 2, and opens the doubt window, which bars what it took too."""
    pool.subscribe(server, 1)
    got = pool.acquire("J")
    assert got.lease.worker_id == 2 and got.present == [1]
    assert got.barrier_ms == pool.doubt_until() >= got.now_ms + WAIT
    assert pool.counter("lost_writes_seen") == 1 and pool.counter("data_loss_events") == 1
    # While the window lasts, the id is left alone without another window or count.
    assert pool.acquire("K").lease.worker_id == 3
    assert pool.counter("lost_writes_seen") == 1


def test_without_the_subscription_the_same_id_is_taken(pool: Presence) -> None:
    """The same record with nobody subscribed: a clean handover, at once (what the test above needs to fail)."""
    got = pool.acquire("J")
    assert got.lease.worker_id == 1 and got.present == [] and got.barrier_ms == 0 and pool.doubt_until() == 0


def test_a_stale_subscription_costs_one_window_and_the_first_renew_allows_for_it(
    pool: Presence, server: RedisServer
) -> None:
    """A dead host's subscription outlives the window it opened: the id is taken again, and its new
    holder's first renew allows for the stale subscriber, but not for one more (a second claimant)."""
    pool.subscribe(server, 1)
    pool.busy(2, 3, 4)
    assert pool.acquire("J").lease.worker_id == -1
    pool.r.hset(POOL, "presence_until:1", pool.now() - 1)  # the window it opened has ended
    pool.r.hset(POOL, "doubt_until_ms", pool.now() - 1)
    got = pool.acquire("J")
    assert got.lease.worker_id == 1 and got.stale == 1 and got.present == []
    assert pool.r.hget(POOL, "presence_until:1") is None
    pool.subscribe(server, 1)  # J's own
    first = pool.renew_first("J", 1, str(got.mark_ms), expected=1 + got.stale)
    assert isinstance(first, Renewed)
    pool.subscribe(server, 1)  # a second claimant
    lost = pool.renew_first("J", 1, str(first.mark_ms), expected=1 + got.stale)
    assert isinstance(lost, RecordLost) and lost.what == "two claimants"
    assert pool.doubt_until() > lost.now_ms and pool.counter("quarantined_claimants") == 1


def test_a_first_renew_with_two_claimants_stops_its_holder(pool: Presence, server: RedisServer) -> None:
    got = pool.acquire("J")
    pool.subscribe(server, got.lease.worker_id)
    pool.subscribe(server, got.lease.worker_id)  # A, whose acquire of the same id was undone
    lost = pool.renew_first("J", got.lease.worker_id, str(got.mark_ms), expected=1)
    assert isinstance(lost, RecordLost) and lost.what == "two claimants"
    # A later renew (no count asked) of a lease past its first renew pays nothing for it.
    again = pool.acquire("K")
    pool.subscribe(server, again.lease.worker_id)
    pool.subscribe(server, again.lease.worker_id)
    assert isinstance(pool.renew_first("K", again.lease.worker_id, str(again.mark_ms), expected=0), Renewed)


def test_inside_a_lost_pools_barrier_a_presence_opens_nothing_more(pool: Presence, server: RedisServer) -> None:
    """The pool was lost and made anew (its barrier holds every id until each live holder has found
    the loss): a holder still subscribed to its old id is left alone, without a window or a count."""
    pool.r.hset(POOL, "recovering_until_ms", pool.now() + WAIT)
    pool.subscribe(server, 1)
    got = pool.acquire("J")
    assert got.lease.worker_id == 2 and got.present == []
    assert pool.doubt_until() == 0 and pool.counter("lost_writes_seen") == 0

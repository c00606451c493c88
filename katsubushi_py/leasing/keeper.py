"""Worker ids leased from Redis, so that no two daemons ever issue IDs under the same worker id.

The design is yaraus's (a sorted set of worker ids scored by lease expiry, changed only by Lua
scripts, every script reading Redis's own ``TIME`` so all daemons share one clock) without its holes:

- **Self-fencing.** A daemon keeps a local deadline, counted on its monotonic clock from when its last
  successful renew was *sent*: expiry minus a safety margin. The generator's buckets never outlive
  that deadline, so past it every GET answers ``SERVER_ERROR worker id lease not confirmed`` until a
  renew succeeds. Redis can only hand the id to someone else after the lease has expired by Redis's
  clock, which is later than our deadline. (raus, under go-katsubushi, keeps issuing while Redis is
  unreachable.)
- **Handover.** Every renew stores, per id, the latest millisecond the holder may issue before its
  deadline; a clean release stores the last one it did issue. The next holder starts strictly after
  it, so its IDs are greater than every ID of the previous holder even if its clock is behind.
- **Delay.** After acquiring an id whose lease ended less than ``delay`` ago (by Redis time), wait out
  the rest before serving, so a previous holder that lost its lease has certainly fenced itself. A
  cleanly released id, or one unused for longer, needs no wait.
- **Data loss.** What Redis has forgotten is treated as unsafe (see :mod:`.scripts`): a pool that
  vanished or was created anew, a record that lost its owner entry or its mark: no daemon serves
  under the ids concerned until the lease TTL plus twice the allowed clock skew has passed on Redis's
  clock since the loss was seen. Each loss is logged as an ERROR and counted.
- **Local memory.** With a state directory, each leased id's state file (locked while we hold the id)
  keeps the last millisecond this host may have issued under it; we never issue under the id at or
  below that, whatever Redis says. An id whose file another daemon of this host holds is a conflict:
  it is quarantined in Redis and another one leased.
- **Replicas.** If the Redis master has replicas, each acquire and renew waits (``WAIT``, pipelined on
  the same connection as the script) for a majority of them; a failed wait is a failed renew, never a
  success. The replica count is checked every minute and after a failed wait, not on every renew.

**At fleet scale** (a thousand daemons on one Redis): the daemon listens while it waits for a lease
(GETs answer ``SERVER_ERROR`` with the reason, STATS shows the state and the wait); start-up retries
with exponential backoff and jitter for ``start_timeout`` before giving up; renews come at a jittered
interval (after taking a lease, anywhere in the first interval; then 80 to 100% of ``renew``) so a
fleet started at once does not renew in one burst, in one round trip each; a failed renew is retried
at once on a fresh connection; a daemon waiting for a free id subscribes to releases and tries again
as soon as one is announced (or when the next lease expires).

All keys of a namespace share the hash tag ``{ns}``, so a Redis Cluster keeps them in one slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ids.layout import format_time, ms_to_datetime
from ..issuing.errors import StateFileError
from ..issuing.generator import Generator
from ..issuing.statefile import StateFile, StateFileInUse
from .scripts import ACQUIRE_LUA, INIT_LUA, RELEASE_LUA, RENEW_LUA
from .target import LeaseError, NoFreeWorkerId, RedisTarget, connect, released_channel

log = logging.getLogger("katsubushi_py")

NOT_CONFIRMED = "worker id lease not confirmed"
WAITING = "waiting for a worker id lease"
# While waiting for a lease, say so in the log this often (not once, not on every attempt).
_WAIT_LOG_INTERVAL = 10.0
# How often the replica count is asked for (and after any WAIT that fell short).
_REPLICA_CHECK_INTERVAL = 60.0
# How often the "pool nearly full" warning is repeated while it stays nearly full.
_FULL_WARN_INTERVAL = 300.0
# Round trips of the clock check: the one with the shortest round trip tells the offset best.
_CLOCK_SAMPLES = 3


@dataclass(frozen=True)
class LeaseTimings:
    ttl: float = 30.0
    renew: float = 10.0
    delay: float = 20.0

    @property
    def margin(self) -> float:
        """How long before the Redis-side expiry we stop issuing: covers scheduling delays and clock
        rate differences, not clock offsets (Redis's clock alone decides expiry)."""
        return max(0.1, self.ttl / 10)

    def check(self) -> None:
        if self.ttl < 1:
            raise LeaseError("--lease-ttl must be at least 1s")
        if self.renew <= 0 or self.renew > self.ttl / 2:
            raise LeaseError(
                f"--lease-renew {self.renew:g}s is unsafe with --lease-ttl {self.ttl:g}s: renew at least twice"
                " per ttl (the default is a third of it)"
            )
        if self.renew >= self.ttl - self.margin:
            raise LeaseError("--lease-renew must be shorter than the ttl minus its safety margin")
        if self.delay < 2 * self.renew:
            raise LeaseError(f"--lease-delay {self.delay:g}s must be at least twice --lease-renew ({self.renew:g}s)")


@dataclass
class Lease:
    worker_id: int
    token: str


@dataclass
class Acquired:
    """One acquire's answer, on Redis's clock (unix ms)."""

    lease: Lease
    now_ms: int
    prev_expiry_ms: int  # when the previous holder's lease ended
    handover_ms: int  # issue strictly after this (previous holder's mark, or the recovery mark)
    clean: bool  # released cleanly (or quarantined): no delay needed
    recovering_until_ms: int  # the pool's barrier: nobody serves before it
    created: int  # 0, 1 (no pool existed) or 2 (re-created after a loss this daemon knew of)
    quarantined: list[int] = field(default_factory=list)


@dataclass
class LeaseStats:
    renewals: int = 0
    renew_failures: int = 0  # renews that failed even after the retry on a fresh connection
    renew_retries: int = 0  # renews retried at once on a fresh connection
    round_trips: int = 0  # to Redis, for acquires, renews and releases
    worker_id_changes: int = 0
    acquires: int = 0
    data_loss_events: int = 0  # losses this daemon saw: a pool or record that Redis forgot
    state_file_conflicts: int = 0  # leased ids whose state file another local daemon held
    pool_size: int = 0  # ids in the pool, and how many were free, at the last renew
    pool_free: int = 0
    deadline_mono: float = 0.0  # monotonic seconds: no ID may be issued from then on
    serve_after: float = 0.0  # monotonic seconds: the delay (or the recovery) after acquiring ends
    recovering_until: float = 0.0  # monotonic seconds: the pool's data-loss barrier
    next_renew: float = 0.0
    waiting_since: float = 0.0  # monotonic seconds: when we last started to wait for a lease (0: not waiting)


class Backoff:
    """Exponential backoff with jitter: first, 2 x first, 4 x first, ... up to ``cap``, each scaled
    by a random factor in [0.5, 1], so that daemons started together do not retry together."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.attempts = first, cap, 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2**self.attempts)
        self.attempts += 1
        return delay * random.uniform(0.5, 1.0)


def new_token() -> str:
    """Identifies this daemon as the holder: host, pid and randomness (never reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"


def new_epoch() -> str:
    """A pool's identity: random, so a pool created anew never looks like the one before."""
    return secrets.token_hex(8)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class LeaseKeeper:
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
        self.keys = target.keys()
        self.channel = released_channel(target)
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
        self.client: Any = None
        self.lease: Lease | None = None
        self.stats = LeaseStats()
        self.epoch = ""  # the pool identity we leased under ("" before the first acquire)
        self.version_seen = 0  # the pool's highest write counter we saw: lower later means rolled back
        self.generator: Generator | None = None
        self.serving = asyncio.Event()  # set while the generator may issue under a confirmed lease
        self._waiting_for = "connecting to Redis"  # what we wait for ("" when holding a lease)
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._replicas: int | None = None
        self._replicas_checked = 0.0
        self._pubsub: Any = None
        self._logged: dict[str, float] = {}
        self._nearly_full = False
        self._spread_next = True  # the next renew's interval is drawn from all of it (see _maintain)
        # Whether the generator's fence is open under the current lease: STATS says "held" only then,
        # so a client that saw "held" is never refused (the delay ends on the clock before the loop
        # wakes to lift the fence).
        self._open = False
        # Stopping to issue because no renew confirmed the lease in time: one ERROR line when the
        # deadline passes (a timer), one INFO line when a renew lets issuing resume.
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._stopped_since = 0.0  # monotonic seconds; 0 while issuing (or not holding a lease)

    @property
    def recovery_wait(self) -> float:
        """After data loss, how long nobody serves: every earlier holder's lease has run out (one TTL)
        and its last ID is below any holder's clock (the allowed skew, on both sides)."""
        return self.timings.ttl + 2 * self.skew_max

    def _ms(self) -> tuple[int, int, int]:
        """(ttl, recovery wait, skew) in ms, as the scripts take them."""
        return int(self.timings.ttl * 1000), int(self.recovery_wait * 1000), int(self.skew_max * 1000)

    def _every(self, key: str, seconds: float) -> bool:
        """True at most once per ``seconds`` for ``key``: rate-limits repeated log lines."""
        now = time.monotonic()
        if now - self._logged.get(key, -seconds) < seconds:
            return False
        self._logged[key] = now
        return True

    # -- connection ----------------------------------------------------------------------------
    async def _client(self) -> Any:
        if self.client is None:
            self.client = await connect(self.target, timeout=max(0.5, self.timings.renew / 2))
            self._replicas = None  # a new connection may be a new master: ask again
        return self.client

    async def _drop_client(self) -> None:
        client, self.client = self.client, None
        await self._unsubscribe()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def _run(self, script: str, args: list[Any]) -> tuple[list[Any], str]:
        """Run a script and, if the master has replicas, WAIT for a majority: one round trip (the
        script and the WAIT pipelined on one connection), two when the replica count is refreshed.

        Returns (result, problem): ``problem`` is "" or why the write cannot be counted as durable."""
        client = await self._client()
        keys = self.keys.all
        wait_ms = int(self.timings.renew * 250)
        now = time.monotonic()
        refresh = self._replicas is None or now - self._replicas_checked >= _REPLICA_CHECK_INTERVAL
        replicas = self._replicas or 0
        needed = replicas // 2 + 1
        pipe = client.pipeline(transaction=False)
        pipe.eval(script, len(keys), *keys, *args)
        if refresh:
            pipe.info("replication")
        elif replicas:
            pipe.execute_command("WAIT", needed, wait_ms)
        replies = await pipe.execute()
        self.stats.round_trips += 1
        result = replies[0]
        if refresh:
            replicas = self._replicas = int(replies[1].get("connected_slaves", 0))
            self._replicas_checked = now
            if not replicas:
                return result, ""
            needed = replicas // 2 + 1
            acked = int(await client.execute_command("WAIT", needed, wait_ms))
            self.stats.round_trips += 1
        elif replicas:
            acked = int(replies[1])
        else:
            return result, ""
        if acked < needed:
            self._replicas = None  # maybe a replica went away: count them again next time
            return result, f"only {acked} of {replicas} replicas acknowledged (needed {needed})"
        return result, ""

    # -- waiting ---------------------------------------------------------------------------------
    def _wait(self, why: str, quiet: bool = False) -> None:
        """No lease to serve under: fence the generator with ``why``, tell health checks, and say so
        in the log now and then (``quiet``: not now, as this is the normal first step)."""
        stats = self.stats
        if not stats.waiting_since:
            stats.waiting_since = time.monotonic()
        kind = why.split(" (")[0]  # without the details that vary from one attempt to the next
        if quiet:
            self._logged["waiting"] = time.monotonic()
        elif kind != self._waiting_for.split(" (")[0]:
            self._logged.pop("waiting", None)  # something new to wait for: say so now
        self._waiting_for = why
        self._open = False
        self._disarm_expiry()
        self.serving.clear()
        reason = f"{WAITING}: {why}"
        if self.generator is not None:
            self.generator.set_fence(0, reason)
        if self.on_change is not None:
            self.on_change(reason)
        if self._every("waiting", _WAIT_LOG_INTERVAL):
            waited = time.monotonic() - stats.waiting_since
            log.warning("%s from %s: %s (waited %.0fs)", WAITING, self.target.display, why, waited)

    async def check_clock(self) -> float:
        """Local wall clock minus Redis TIME, in seconds; refuse to go on above ``skew_max``.

        The offset is known only to within half the round trip (Redis read its clock somewhere in
        it), so it is judged by the sample with the shortest round trip, and what counts is the least
        the offset can be: a busy event loop (a long round trip) alone never looks like a skew."""
        client = await self._client()
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(_CLOCK_SAMPLES):
            sent_wall, sent = time.time(), time.perf_counter()
            seconds, micros = await client.time()
            rtt = time.perf_counter() - sent
            offset = sent_wall + rtt / 2 - (seconds + micros / 1e6)
            if best is None or rtt < best[0]:
                best = (rtt, offset)
        assert best is not None
        rtt, skew = best
        least = abs(skew) - rtt / 2
        if least > self.skew_max:
            raise LeaseError(
                f"local clock differs from Redis TIME by {skew:+.3f}s (more than --clock-skew-max"
                f" {self.skew_max:g}s): fix NTP on this host or on Redis before leasing a worker id"
            )
        if least > self.skew_warn:
            log.warning("local clock differs from Redis TIME by %+.3fs (round trip %.3fs)", skew, rtt)
        return skew

    async def _unsubscribe(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def _wait_for_release(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early when a release is announced. The first call only
        subscribes (the caller then tries again at once, so a release between its last try and the
        subscription is not missed)."""
        if self._pubsub is None:
            try:
                client = await self._client()
                pubsub = client.pubsub()
                await pubsub.subscribe(self.channel)
                self._pubsub = pubsub
                return
            except Exception:
                await self._unsubscribe()  # no subscription: poll instead
                await asyncio.sleep(seconds)
                return
        end = time.monotonic() + seconds
        try:
            while (left := end - time.monotonic()) > 0:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                if message is not None:
                    await asyncio.sleep(random.uniform(0, 0.05))  # not all waiters in the same millisecond
                    return
        except Exception:
            await self._unsubscribe()

    # -- acquire ---------------------------------------------------------------------------------
    async def acquire(self, deadline: float | None = None) -> Acquired:
        """Lease a worker id. While Redis cannot be reached, retries with backoff (giving up at
        ``deadline``, monotonic, if given); while no id is free, waits for a release or an expiry
        (or gives up at once without ``wait_for_free_id``). Logs and counts what it found lost."""
        ttl_ms, wait_ms, skew_ms = self._ms()
        backoff = Backoff(0.1, min(5.0, self.timings.renew))
        try:
            while True:
                token = new_token()
                try:
                    result, problem = await self._run(
                        ACQUIRE_LUA,
                        [token, ttl_ms, self.min_id, self.max_id, self.epoch, wait_ms, skew_ms, new_epoch()],
                    )
                except Exception as exc:  # Redis down, slow or unreachable: keep trying
                    await self._drop_client()
                    if self._stopping:
                        raise
                    pause = backoff.next()
                    if deadline is not None:
                        if time.monotonic() >= deadline:
                            raise LeaseError(
                                f"cannot lease a worker id from {self.target.display} within"
                                f" --lease-start-timeout {self.start_timeout:g}s: {_describe(exc)}"
                            ) from None
                        pause = min(pause, deadline - time.monotonic())  # one last try at the deadline
                    self._wait(f"Redis at {self.target.display} unreachable ({_describe(exc)})")
                    await asyncio.sleep(pause)
                    continue
                backoff = Backoff(0.1, min(5.0, self.timings.renew))
                code, now_ms, next_ms, prev_expiry, handover, clean, barrier, created = (int(x) for x in result[:8])
                epoch, quarantined, version = _text(result[8]), [int(x) for x in result[9]], int(result[10])
                self._report_found(created, barrier, now_ms, quarantined)
                if epoch != self.epoch:  # a new pool (the first, or one made after a loss): its own counter
                    self.epoch, self.version_seen = epoch, 0
                if code == -1:
                    message = f"no free worker id in {self.min_id}..{self.max_id}"
                    if not self.wait_for_free_id:
                        raise NoFreeWorkerId(f"{message} at {self.target.display}")
                    self._wait(message)
                    # Try again when one is released (announced), when the next lease runs out, and at
                    # the latest after a renew interval.
                    until_expiry = (next_ms - now_ms) / 1000 + 0.01 if next_ms > now_ms else self.timings.renew
                    await self._wait_for_release(min(self.timings.renew, until_expiry) * random.uniform(1.0, 1.1))
                    continue
                self.version_seen = max(self.version_seen, version)
                lease = Lease(code, token)
                if problem:
                    log.warning("worker id %d: acquire not durable (%s); releasing and retrying", code, problem)
                    with contextlib.suppress(Exception):
                        await self._release(lease, -1)
                    await asyncio.sleep(backoff.next())
                    continue
                self.stats.acquires += 1
                return Acquired(lease, now_ms, prev_expiry, handover, bool(clean), barrier, created, quarantined)
        finally:
            await self._unsubscribe()

    def _report_found(self, created: int, barrier_ms: int, now_ms: int, quarantined: list[int]) -> None:
        until = format_time(ms_to_datetime(barrier_ms)) if barrier_ms else ""
        left = max(0.0, (barrier_ms - now_ms) / 1000)
        if created == 1:
            log.warning(
                "created the worker id pool %d..%d in %s. A pool created by a daemon cannot be told apart from"
                " one Redis lost, so no daemon serves from it until %s (%.1fs: lease ttl + 2 x clock skew max);"
                " `katsubushi-py lease init` creates a pool that serves at once",
                self.min_id,
                self.max_id,
                self.target.display,
                until,
                left,
            )
        elif created == 2:
            self.stats.data_loss_events += 1
            log.error(
                "DATA LOSS: the worker id pool in %s is gone (it existed when this daemon last leased from it:"
                " FLUSHALL, a Redis restart without persistence, or a failover that lost writes). Re-created it;"
                " no daemon serves from it until %s (%.1fs: lease ttl + 2 x clock skew max)",
                self.target.display,
                until,
                left,
            )
        for worker_id in quarantined:
            self.stats.data_loss_events += 1
            log.error(
                "DATA LOSS: worker id %d's lease record in %s was damaged (its handover mark is missing, or its"
                " expiry is earlier than its mark allows: edited by hand or partly lost). Quarantined it: nobody"
                " leases it for %.1fs (lease ttl + 2 x clock skew max), and its next holder starts after the"
                " latest millisecond an earlier holder can have issued",
                worker_id,
                self.target.display,
                self.recovery_wait,
            )

    # -- renew -----------------------------------------------------------------------------------
    async def renew(self, high_water_ms: int) -> tuple[str, list[Any]]:
        """One renew, retried once at once on a fresh connection if the first attempt fails (a
        dropped connection, a failover). Returns ("ok", result), ("lost", result) (someone else owns
        the id), ("loss", result) (Redis lost the pool or this id's record) or ("failed", [])."""
        lease = self.lease
        if lease is None:
            return "lost", []
        ttl_ms, wait_ms, skew_ms = self._ms()
        args = [
            lease.token,
            lease.worker_id,
            ttl_ms,
            high_water_ms,
            self.epoch,
            wait_ms,
            skew_ms,
            self.version_seen,
            self.min_id,
            self.max_id,
            new_epoch(),
        ]
        for attempt in (1, 2):
            try:
                result, problem = await self._run(RENEW_LUA, args)
                break
            except Exception as exc:
                await self._drop_client()
                if attempt == 1:
                    self.stats.renew_retries += 1
                    continue
                if self._every("renew-failed", _WAIT_LOG_INTERVAL):
                    log.warning("renewing worker id %d failed: %s", lease.worker_id, _describe(exc))
                return "failed", []
        code = int(result[0])
        if code == -1:
            return "lost", list(result)
        if code in (-3, -4):
            return "loss", list(result)
        if problem:
            log.warning("renewing worker id %d not durable: %s", lease.worker_id, problem)
            return "failed", []
        self.version_seen = max(self.version_seen, int(result[4]))
        self._occupancy(int(result[5]), int(result[6]))
        return "ok", list(result)

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

    async def _release(self, lease: Lease, last_ms: int, quarantine: bool = False) -> bool:
        """``last_ms``: the latest millisecond issued or inherited under the lease (replaces the mark);
        -1 when the lease was never served under (the stored mark stays)."""
        ttl_ms, wait_ms, skew_ms = self._ms()
        client = await self._client()
        mode = "quarantine" if quarantine else "clean"
        args = [lease.token, lease.worker_id, last_ms, self.epoch, mode, wait_ms, ttl_ms + skew_ms, self.channel]
        result = await client.eval(RELEASE_LUA, len(self.keys.all), *self.keys.all, *args)
        self.stats.round_trips += 1
        return int(result) == 1

    async def release(self, last_ms: int) -> None:
        """Give the id back and store the last issued millisecond for the next holder: the generator's
        ``last_issued_ms`` (which includes what it inherited at the handover), 0 if none."""
        self._stopping = True
        lease, self.lease = self.lease, None
        try:
            if lease is None:
                return
            if await self._release(lease, last_ms):
                log.info("released worker id %d", lease.worker_id)
            else:
                log.warning("worker id %d was no longer ours at release", lease.worker_id)
        except Exception as exc:
            log.warning(
                "could not release worker id %d: %s (it frees itself when the lease expires)",
                lease.worker_id if lease else -1,
                _describe(exc),
            )
        finally:
            await self._drop_client()

    # -- taking an id ----------------------------------------------------------------------------
    async def _lease_new_id(self, generator: Generator, deadline: float | None) -> None:
        """Acquire an id, claim its state file, and point the generator at it (still fenced)."""
        while True:
            acquired = await self.acquire(deadline)
            lease = acquired.lease
            state: StateFile | None = None
            try:
                if self.claim_state is not None:
                    state = self.claim_state(lease.worker_id)
                generator.switch_worker(lease.worker_id, acquired.handover_ms, state)
            except StateFileInUse as exc:
                self.stats.state_file_conflicts += 1
                log.error(
                    "worker id %d was free in Redis, but %s: another daemon of this host issues under it (one with"
                    " --worker-id %d sharing this state directory, or a leasing daemon whose lease Redis lost)."
                    " Quarantined it in Redis for %.1fs and leasing another",
                    lease.worker_id,
                    exc,
                    lease.worker_id,
                    self.recovery_wait,
                )
                with contextlib.suppress(Exception):
                    await self._release(lease, 0, quarantine=True)
                continue
            except StateFileError:
                if state is not None:
                    state.unlock()
                with contextlib.suppress(Exception):
                    await self._release(lease, -1)
                raise
            self._take(acquired)
            return

    def _take(self, acquired: Acquired) -> None:
        """Start under a new lease: fenced until its first renew has stored a high-water mark in Redis
        (so that a successor knows how far we may have issued), and until the delay has passed."""
        self.lease = acquired.lease
        self._open = False
        self._waiting_for = ""
        self.stats.waiting_since = 0.0
        if self.on_change is not None:
            self.on_change(None)
        now = time.monotonic()
        delay_ms = 0 if acquired.clean else acquired.prev_expiry_ms + self.timings.delay * 1000 - acquired.now_ms
        recovery_ms = acquired.recovering_until_ms - acquired.now_ms
        self.stats.recovering_until = now + max(0.0, recovery_ms / 1000)
        self.stats.serve_after = now + max(0.0, delay_ms / 1000, recovery_ms / 1000)
        self.stats.deadline_mono = 0.0
        self.stats.next_renew = now
        self._spread_next = True
        wait = self.stats.serve_after - now
        state = self.generator.state_path if self.generator is not None else None
        log.info(
            "leased worker id %d from %s%s%s",
            acquired.lease.worker_id,
            self.target.display,
            f" (state file {state})" if state else "",
            f"; waiting {wait:.1f}s before serving" if wait > 0 else "",
        )

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
                break
            except LeaseError:
                raise
            except Exception as exc:
                await self._drop_client()
                if time.monotonic() >= deadline:
                    raise LeaseError(
                        f"cannot lease a worker id from {self.target.display} within --lease-start-timeout"
                        f" {self.start_timeout:g}s: {_describe(exc)}"
                    ) from None
                self._wait(f"Redis at {self.target.display} unreachable ({_describe(exc)})")
                await asyncio.sleep(min(backoff.next(), deadline - time.monotonic()))  # last try at the deadline
        log.info("clock differs from Redis TIME by %+.3fs", skew)
        await self._lease_new_id(generator, deadline)
        await self._maintain(generator)

    def _fence(self, generator: Generator) -> None:
        now = time.monotonic()
        stats = self.stats
        self._open = False
        if self.lease is None:
            generator.set_fence(0, f"{WAITING}: {self._waiting_for}")
            self.serving.clear()
        elif now < stats.recovering_until:
            until_ms = int((time.time() + stats.recovering_until - now) * 1000)
            until = format_time(ms_to_datetime(until_ms))
            generator.set_fence(
                0, f"{NOT_CONFIRMED}: pool recovering until {until} (Redis lost data, or the pool was new)"
            )
        elif now < stats.serve_after:
            generator.set_fence(0, f"{NOT_CONFIRMED}: waiting out the lease delay")
        else:
            generator.set_fence(int(stats.deadline_mono * 1e9))
            self._open = True
            if now < stats.deadline_mono and not self.serving.is_set():
                self.serving.set()
                log.info("serving worker id %d", generator.worker_id)
            self._arm_expiry(now)

    # -- stopping and resuming at the lease's deadline -------------------------------------------
    def _arm_expiry(self, now: float) -> None:
        """Say once when the deadline passes without a confirmed renew, and once when issuing resumes."""
        deadline = self.stats.deadline_mono
        if self._stopped_since and now < deadline:
            log.info(
                "resumed issuing under worker id %d: a renew confirmed the lease (stopped for %.1fs)",
                self.lease.worker_id if self.lease else -1,
                now - self._stopped_since,
            )
            self._stopped_since = 0.0
        self._disarm_expiry()
        if deadline and not self._stopped_since:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the daemon's loop (a test of the fence alone): no line to log
                return
            self._expiry_timer = loop.call_later(max(0.0, deadline - now), self._expired)

    def _disarm_expiry(self) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        if self.lease is None:
            self._stopped_since = 0.0

    def _expired(self) -> None:
        self._expiry_timer = None
        now = time.monotonic()
        deadline = self.stats.deadline_mono
        if self.lease is None or self._stopping or not deadline:
            return
        if now < deadline:  # renewed meanwhile (the timer was early): wait for the new deadline
            self._expiry_timer = asyncio.get_running_loop().call_later(deadline - now, self._expired)
            return
        self._stopped_since = now
        wall = time.time() - (now - deadline)
        confirmed = wall - (self.timings.ttl - self.timings.margin)
        log.error(
            "stopped issuing: lease on worker id %d expired at %s (no renew confirmed by %s since %s); requests"
            " answer SERVER_ERROR until a renew succeeds",
            self.lease.worker_id,
            format_time(ms_to_datetime(int(wall * 1000))),
            self.target.display,
            format_time(ms_to_datetime(int(confirmed * 1000))),
        )

    async def _maintain(self, generator: Generator) -> None:
        timings = self.timings
        while not self._stopping:
            self._fence(generator)
            now = time.monotonic()
            wake = self.stats.next_renew
            if now < self.stats.serve_after:
                wake = min(wake, self.stats.serve_after)
            await asyncio.sleep(max(0.0, wake - now))
            if time.monotonic() < self.stats.next_renew or self._stopping:
                continue
            sent = time.monotonic()
            high_water = generator.now_ms() + int(timings.ttl * 1000)
            try:
                outcome, result = await asyncio.wait_for(self.renew(high_water), timeout=timings.renew)
            except TimeoutError:
                await self._drop_client()
                if self._every("renew-failed", _WAIT_LOG_INTERVAL):
                    log.warning("renewing worker id %d timed out", self.lease.worker_id if self.lease else -1)
                outcome, result = "failed", []
            received = time.monotonic()
            if outcome == "ok":
                self.stats.renewals += 1
                self.stats.deadline_mono = sent + timings.ttl - timings.margin
                # Jittered, never later than the interval: the first renew after taking a lease comes
                # anywhere in it (so a fleet started at once is spread over the interval from then on),
                # later ones after 80 to 100% of it (so the spread is kept).
                spread = (0.1, 1.0) if self._spread_next else (0.8, 1.0)
                self._spread_next = False
                self.stats.next_renew = sent + timings.renew * random.uniform(*spread)
                now_ms, barrier_ms = int(result[1]), int(result[3])
                if barrier_ms > now_ms:  # a loss seen by another daemon since we acquired
                    until = received + (barrier_ms - now_ms) / 1000
                    self.stats.recovering_until = max(self.stats.recovering_until, until)
                    self.stats.serve_after = max(self.stats.serve_after, until)
            elif outcome == "failed":
                self.stats.renew_failures += 1
                # Both attempts failed: try again soon (a short blip must not fence us), with jitter.
                self.stats.next_renew = time.monotonic() + min(1.0, timings.renew / 4) * random.uniform(0.5, 1.0)
            else:
                await self._lost(generator, outcome, result)

    async def _lost(self, generator: Generator, outcome: str, result: list[Any]) -> None:
        """The id is not ours any more (or Redis forgot it): stop at once, say why, lease another."""
        old = self.lease.worker_id if self.lease else -1
        generator.retire_worker(WAITING)
        self.lease = None
        self._wait("the previous one was lost", quiet=True)
        if outcome == "lost":
            log.error(
                "worker id %d is no longer ours (its owner token changed in Redis); stopped issuing under it"
                " and leasing another",
                old,
            )
        else:
            self.stats.data_loss_events += 1
            what, now_ms, barrier_ms = _text(result[2]), int(result[1]), int(result[3])
            ends = format_time(ms_to_datetime(barrier_ms))
            if int(result[0]) == -4:
                found = (
                    f"worker id {old}'s lease record in {self.target.display} lost its owner entry (data loss, a"
                    " hand edit, or another daemon found the record damaged and quarantined it)"
                )
                scope = "that id"
            elif what == "missing":
                found = (
                    f"Redis lost the worker id pool in {self.target.display} (FLUSHALL, a restart without"
                    " persistence, or a failover that lost writes)"
                )
                scope = "the pool"
            elif what == "recreated":
                found = (
                    f"the worker id pool in {self.target.display} was created anew since this daemon leased worker"
                    f" id {old} (Redis lost its data, then a daemon or `lease init` made a new pool)"
                )
                scope = "the pool"
            else:
                found = (
                    f"the worker id pool in {self.target.display} went back in time (Redis restarted from an old"
                    " snapshot, or failed over to a replica that missed writes)"
                )
                scope = "the pool"
            log.error(
                "DATA LOSS: %s. Stopped issuing under worker id %d at once; no daemon serves under %s until"
                " %s (%.1fs from now; lease ttl + 2 x clock skew max from when the loss was seen); leasing a"
                " worker id again",
                found,
                old,
                scope,
                ends,
                max(0.0, (barrier_ms - now_ms) / 1000),
            )
        await self._lease_new_id(generator, None)
        self.stats.worker_id_changes += 1

    async def stop(self, last_ms: int) -> None:
        """Stop renewing (or waiting), then release the id with the last issued millisecond."""
        self._stopping = True
        self._disarm_expiry()
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.release(last_ms)

    def state(self) -> str:
        now = time.monotonic()
        if self.lease is None:
            return "connecting" if self._waiting_for.startswith(("connecting", "Redis")) else "waiting"
        if now < self.stats.recovering_until:
            return "recovering"
        if now < self.stats.serve_after or not self._open:
            return "delay"  # or its end, before the keeper has woken to lift the fence
        if now >= self.stats.deadline_mono:
            return "unconfirmed"
        return "held"

    def time_left(self) -> float:
        return max(0.0, self.stats.deadline_mono - time.monotonic()) if self.lease else 0.0

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
            ("lease_state_file_conflicts", stats.state_file_conflicts),
            ("lease_pool_ids", stats.pool_size),
            ("lease_pool_free", stats.pool_free),
        ]


async def init_pool(target: RedisTarget, min_id: int, max_id: int) -> int:
    """``lease init``: create the pool for [min, max], serving at once, if none exists; returns how
    many ids were created (0: a pool exists, unchanged)."""
    client = await connect(target, timeout=5)
    try:
        keys = target.keys().all
        return int(await client.eval(INIT_LUA, len(keys), *keys, min_id, max_id, new_epoch()))
    finally:
        await client.aclose()

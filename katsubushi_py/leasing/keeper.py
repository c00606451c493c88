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
- **Replicas.** If the Redis master has replicas, each acquire and renew waits (``WAIT``, on the same
  connection as the write) for a majority of them; a failed wait is a failed renew, never a success.

All keys of a namespace share the hash tag ``{ns}``, so a Redis Cluster keeps them in one slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .scripts import ACQUIRE_LUA, INIT_LUA, RELEASE_LUA, RENEW_LUA, run_script
from .target import LeaseError, NoFreeWorkerId, RedisTarget, connect

log = logging.getLogger("katsubushi_py")


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
class LeaseStats:
    renewals: int = 0
    renew_failures: int = 0
    worker_id_changes: int = 0
    acquires: int = 0
    deadline_mono: float = 0.0  # monotonic seconds: no ID may be issued from then on
    serve_after: float = 0.0  # monotonic seconds: the delay after acquiring ends
    next_renew: float = 0.0


def new_token() -> str:
    """Identifies this daemon as the holder: host, pid and randomness (never reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"


class LeaseKeeper:
    """Acquires a worker id, renews it, fences the generator when the lease is not confirmed, and
    moves to a new id when the lease is lost. Runs on the daemon's event loop."""

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
    ) -> None:
        timings.check()
        self.target = target
        self.keys = target.keys()
        self.timings = timings
        self.min_id = min_id
        self.max_id = max_id
        self.wait_for_free_id = wait_for_free_id
        self.skew_warn = skew_warn
        self.skew_max = skew_max
        self.client: Any = None
        self.lease: Lease | None = None
        self.stats = LeaseStats()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._confirmed = asyncio.Event()
        self.generator: Any = None

    # -- connection ----------------------------------------------------------------------------
    async def _client(self) -> Any:
        if self.client is None:
            self.client = await connect(self.target, timeout=max(0.5, self.timings.renew / 2))
        return self.client

    async def _drop_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def check_clock(self) -> float:
        """Local wall clock minus Redis TIME, in seconds; refuse to go on above ``skew_max``."""
        client = await self._client()
        before = time.time()
        seconds, micros = await client.time()
        after = time.time()
        skew = (before + after) / 2 - (seconds + micros / 1e6)
        if abs(skew) > self.skew_max:
            raise LeaseError(
                f"local clock differs from Redis TIME by {skew:+.3f}s (more than --clock-skew-max"
                f" {self.skew_max:g}s): fix NTP on this host or on Redis before leasing a worker id"
            )
        if abs(skew) > self.skew_warn:
            log.warning("local clock differs from Redis TIME by %+.3fs", skew)
        return skew

    async def init_pool(self) -> int:
        """Create the pool for [min, max] if it does not exist; returns how many ids were added."""
        client = await self._client()
        return int(await client.eval(INIT_LUA, 2, self.keys.ids, self.keys.stats, self.min_id, self.max_id))

    # -- acquire ---------------------------------------------------------------------------------
    async def acquire(self) -> tuple[Lease, int, float]:
        """Lease a worker id. Returns (lease, previous holder's last ms, seconds to wait before
        serving). Retries at the renew interval while the pool is empty, unless told not to wait."""
        keys = self.keys
        announced = False
        while True:
            token = new_token()
            try:
                client = await self._client()
                result, problem = await run_script(
                    client,
                    ACQUIRE_LUA,
                    [keys.ids, keys.owners, keys.last, keys.released, keys.stats],
                    [token, int(self.timings.ttl * 1000), self.min_id, self.max_id],
                    int(self.timings.renew * 250),
                )
            except Exception as exc:  # Redis down or unreachable: keep trying
                await self._drop_client()
                if self._stopping:
                    raise
                log.warning("cannot lease a worker id from %s: %s", self.target.display, exc)
                await asyncio.sleep(self.timings.renew)
                continue
            code = int(result[0])
            if code == -2:
                added = await self.init_pool()
                log.info(
                    "created worker id pool %d..%d in %s (%d ids)", self.min_id, self.max_id, self.target.display, added
                )
                continue
            if code == -1:
                message = f"no free worker id in {self.min_id}..{self.max_id} at {self.target.display}"
                if not self.wait_for_free_id:
                    raise NoFreeWorkerId(message)
                if not announced:
                    log.warning("%s; retrying every %gs", message, self.timings.renew)
                    announced = True
                await asyncio.sleep(self.timings.renew)
                continue
            worker_id, now_ms, _expiry, prev_expiry, prev_last, clean = (int(x) for x in result)
            lease = Lease(worker_id, token)
            if problem:
                log.warning("worker id %d: acquire not durable (%s); releasing and retrying", worker_id, problem)
                await self._release(lease, 0)
                await asyncio.sleep(self.timings.renew)
                continue
            self.stats.acquires += 1
            # The previous holder fenced itself before its lease expired; give it `delay` after that.
            wait = 0.0 if clean else max(0.0, (prev_expiry + self.timings.delay * 1000 - now_ms) / 1000)
            return lease, prev_last, wait

    # -- renew -----------------------------------------------------------------------------------
    async def renew(self, high_water_ms: int) -> str:
        """One renew. Returns "ok", "lost" (someone else owns the id) or "failed" (not confirmed)."""
        lease = self.lease
        if lease is None:
            return "lost"
        keys = self.keys
        try:
            client = await self._client()
            result, problem = await run_script(
                client,
                RENEW_LUA,
                [keys.ids, keys.owners, keys.last, keys.stats],
                [lease.token, lease.worker_id, int(self.timings.ttl * 1000), high_water_ms],
                int(self.timings.renew * 250),
            )
        except Exception as exc:
            await self._drop_client()
            log.warning("renewing worker id %d failed: %s", lease.worker_id, exc)
            return "failed"
        if int(result[0]) != 1:
            return "lost"
        if problem:
            log.warning("renewing worker id %d not durable: %s", lease.worker_id, problem)
            return "failed"
        return "ok"

    async def _release(self, lease: Lease, last_ms: int) -> bool:
        keys = self.keys
        client = await self._client()
        result = await client.eval(
            RELEASE_LUA,
            5,
            keys.ids,
            keys.owners,
            keys.last,
            keys.released,
            keys.stats,
            lease.token,
            lease.worker_id,
            last_ms,
        )
        return int(result) == 1

    async def release(self, last_ms: int) -> None:
        """Give the id back and store the last issued millisecond for the next holder."""
        self._stopping = True
        lease, self.lease = self.lease, None
        if lease is None:
            return
        try:
            if await self._release(lease, last_ms):
                log.info("released worker id %d", lease.worker_id)
            else:
                log.warning("worker id %d was no longer ours at release", lease.worker_id)
        except Exception as exc:
            log.warning(
                "could not release worker id %d: %s (it frees itself when the lease expires)", lease.worker_id, exc
            )
        finally:
            await self._drop_client()

    # -- the loop --------------------------------------------------------------------------------
    async def start(self, make_generator: Callable[[int], Any]) -> Any:
        """Check the clock, lease an id, make the generator for it (fenced), start renewing, and
        return the generator once the delay has passed and it may serve."""
        skew = await self.check_clock()
        log.info("clock differs from Redis TIME by %+.3fs", skew)
        lease, prev_last, wait = await self.acquire()
        try:
            generator = make_generator(lease.worker_id)
        except Exception:
            self.lease = lease
            await self.release(0)
            raise
        self.generator = generator
        generator.set_fence(0)
        generator.switch_worker(lease.worker_id, prev_last)
        self._take(lease, wait)
        log.info(
            "leased worker id %d from %s%s",
            lease.worker_id,
            self.target.display,
            f"; waiting {wait:.1f}s before serving" if wait > 0 else "",
        )
        self._task = asyncio.get_running_loop().create_task(self._maintain(generator))
        if wait > 0:
            await asyncio.sleep(wait)
        await self._confirmed.wait()
        return generator

    def _take(self, lease: Lease, wait: float) -> None:
        """Start under a new lease: fenced until its first renew has stored a high-water mark in Redis
        (so that a successor knows how far we may have issued), and until the delay has passed."""
        self.lease = lease
        self.stats.serve_after = time.monotonic() + wait
        self.stats.deadline_mono = 0.0
        self.stats.next_renew = time.monotonic()
        self._confirmed.clear()

    def _fence(self, generator: Any) -> None:
        now = time.monotonic()
        if now < self.stats.serve_after or self.lease is None:
            generator.set_fence(0)
        else:
            generator.set_fence(int(self.stats.deadline_mono * 1e9))

    async def _maintain(self, generator: Any) -> None:
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
                outcome = await asyncio.wait_for(self.renew(high_water), timeout=timings.renew)
            except TimeoutError:
                await self._drop_client()
                log.warning("renewing worker id %d timed out", self.lease.worker_id if self.lease else -1)
                outcome = "failed"
            if outcome == "ok":
                self.stats.renewals += 1
                self.stats.deadline_mono = sent + timings.ttl - timings.margin
                self.stats.next_renew = sent + timings.renew
                self._confirmed.set()
            elif outcome == "failed":
                self.stats.renew_failures += 1
                # Retry sooner than a full interval so that a short blip does not fence us.
                self.stats.next_renew = time.monotonic() + max(0.1, timings.renew / 4)
            else:
                old = self.lease.worker_id if self.lease else -1
                generator.set_fence(0)
                log.error(
                    "worker id %d is no longer ours (its owner token changed in Redis); stopped issuing"
                    " under it and leasing another",
                    old,
                )
                self.lease = None
                lease, prev_last, wait = await self.acquire()
                generator.switch_worker(lease.worker_id, prev_last)
                self._take(lease, wait)
                self.stats.worker_id_changes += 1
                log.info(
                    "now serving worker id %d%s", lease.worker_id, f" after a {wait:.1f}s delay" if wait > 0 else ""
                )

    async def stop(self, last_ms: int) -> None:
        """Stop renewing, then release the id with the last issued millisecond."""
        self._stopping = True
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.release(last_ms)

    def state(self) -> str:
        now = time.monotonic()
        if self.lease is None:
            return "acquiring"
        if now < self.stats.serve_after:
            return "delay"
        if now >= self.stats.deadline_mono:
            return "unconfirmed"
        return "held"

    def time_left(self) -> float:
        return max(0.0, self.stats.deadline_mono - time.monotonic()) if self.lease else 0.0

    def stat_fields(self) -> list[tuple[str, object]]:
        return [
            ("lease_state", self.state()),
            ("lease_time_left_ms", int(self.time_left() * 1000)),
            ("lease_renewals", self.stats.renewals),
            ("lease_renew_failures", self.stats.renew_failures),
            ("worker_id_changes", self.stats.worker_id_changes),
        ]

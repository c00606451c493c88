"""Taking a worker id and giving one back: the keeper's acquire side.

Apart from keeper.py (the keeper's life: starting, the renew loop, a lost lease, stopping) because
taking an id is its own concern with its own failure modes: Redis unreachable at start (retried with
backoff until ``--lease-start-timeout``), no free id (waiting for a release announced on the channel,
or the next expiry), an acquire the replicas did not acknowledge (released unused), an id whose local
state file another daemon of this host holds (quarantined), and starting fenced under the new lease
until its barriers, doubt window and handover mark have passed. :class:`Acquiring` is the half of
:class:`~.keeper.LeaseKeeper` that does this; the keeper's ``__init__`` sets the state declared here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from ..issuing.errors import StateFileError
from ..issuing.generator import Generator
from ..issuing.statefile import StateFile, StateFileInUse
from .holder import Holding
from .link import RedisLink, refusal, trouble
from .outages import RenewWatch
from .pool import searched_range
from .presence import Presence
from .recovery import LeaseStats, Reporter
from .replies import Acquired, Lease, parse_acquire
from .scripts import ACQUIRE_LUA, RELEASE_LUA
from .settings import SettingsWatch
from .target import LeaseRefused, NoFreeWorkerId, RedisTarget
from .timings import Backoff, LeaseTimings, describe, new_epoch, new_token

log = logging.getLogger("katsubushi_py")

WAITING = "waiting for a worker id lease"
# While waiting for a lease, say so in the log this often (not once, not on every attempt).
_WAIT_LOG_INTERVAL = 10.0


class Acquiring:
    """Acquire, take and release a worker id (see the module's docstring). Only a base of
    :class:`~.keeper.LeaseKeeper`, whose ``__init__`` sets every attribute below."""

    target: RedisTarget
    timings: LeaseTimings
    min_id: int
    max_id: int
    wait_for_free_id: bool
    skew_max: float
    start_timeout: float
    claim_state: Callable[[int], StateFile] | None
    on_change: Callable[[str | None], None] | None
    stats: LeaseStats
    link: RedisLink
    settings: SettingsWatch
    report: Reporter
    presence: Presence
    holding: Holding | None
    epoch: str
    generator: Generator | None
    serving: asyncio.Event
    watch: RenewWatch
    _waiting_for: str
    _stopping: bool
    _logged: dict[str, float]

    @property
    def recovery_wait(self) -> float:
        return self.timings.recovery_wait(self.skew_max)

    def _ms(self) -> tuple[int, int, int]:
        """(ttl, recovery wait, skew) in ms, as the scripts take them."""
        return int(self.timings.ttl * 1000), int(self.recovery_wait * 1000), int(self.skew_max * 1000)

    def _local_ms(self) -> int:
        """This host's clock as the generator keeps it (anchored to the monotonic clock: it does not step)."""
        return self.generator.now_ms() if self.generator is not None else int(time.time() * 1000)

    def _every(self, key: str, seconds: float) -> bool:
        """True at most once per ``seconds`` for ``key``: rate-limits repeated log lines."""
        now = time.monotonic()
        if now - self._logged.get(key, -seconds) < seconds:
            return False
        self._logged[key] = now
        return True

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
        self.watch.disarm()
        self.serving.clear()
        reason = f"{WAITING}: {why}"
        if self.generator is not None:
            self.generator.set_fence(0, reason)
        if self.on_change is not None:
            self.on_change(reason)
        if self._every("waiting", _WAIT_LOG_INTERVAL):
            waited = time.monotonic() - stats.waiting_since
            log.warning("%s from %s: %s (waited %.0fs)", WAITING, self.target.display, why, waited)

    # -- acquire ---------------------------------------------------------------------------------
    async def acquire(self, deadline: float | None = None) -> tuple[Acquired, float, float]:
        """Lease a worker id; returns it with the monotonic times around the round trip that took it.
        While Redis cannot be reached, retries with backoff (giving up at ``deadline``, monotonic, if
        given); while no id is free, waits for a release or an expiry (or gives up at once without
        ``wait_for_free_id``). Logs and counts what it found on the way."""
        ttl_ms, wait_ms, skew_ms = self._ms()
        unreleased_ms = int(self.timings.unreleased_wait(self.skew_max) * 1000)
        backoff = Backoff(0.1, min(5.0, self.timings.renew))
        try:
            while True:
                token = new_token()
                args = [token, ttl_ms, self.min_id, self.max_id, self.epoch, wait_ms, skew_ms, new_epoch()]
                sent = time.monotonic()
                try:
                    more = [self._local_ms(), unreleased_ms, self.presence.prefix]
                    result, problem, _ = await self.link.run(ACQUIRE_LUA, [*args, *more])
                except Exception as exc:  # Redis down, slow or unreachable: keep trying
                    await self.link.drop()
                    if self._stopping:
                        raise
                    pause = backoff.next()
                    if deadline is not None:
                        if time.monotonic() >= deadline:
                            raise LeaseRefused(
                                f"cannot lease a worker id from {self.target.display} within"
                                f" --lease-start-timeout {self.start_timeout:g}s:"
                                f" {refusal(self.target.display, exc) or describe(exc)}"
                            ) from None
                        pause = min(pause, deadline - time.monotonic())  # one last try at the deadline
                    self._wait(trouble(self.target.display, exc))
                    self.settings.poke(forced=True)  # min-replicas-to-write changed? (NOREPLICAS)
                    await asyncio.sleep(pause)
                    continue
                received = time.monotonic()
                backoff = Backoff(0.1, min(5.0, self.timings.renew))
                acquired = parse_acquire(result, token)
                self.report.acquired(acquired, self.min_id, self.max_id)
                self.epoch = acquired.epoch
                if not acquired.got:
                    message = f"no free worker id in {await searched_range(self.link, self.min_id, self.max_id)}"
                    if not self.wait_for_free_id:
                        raise NoFreeWorkerId(f"{message} at {self.target.display}")
                    self._wait(message)
                    # Try again when one is released (announced), when the next lease or quarantine
                    # ends, and at the latest after a renew interval.
                    now_ms, next_ms = acquired.now_ms, acquired.next_free_ms
                    until_free = (next_ms - now_ms) / 1000 + 0.01 if next_ms > now_ms else self.timings.renew
                    await self.presence.prepare()  # the holder channel's connection, ahead of a handover
                    await self.link.wait_for_release(min(self.timings.renew, until_free) * random.uniform(1.0, 1.1))
                    continue
                if problem:
                    # Not on every replica: a replica promoted now may not know of it. Never served under.
                    worker_id = acquired.lease.worker_id
                    if self._every("acquire-not-durable", _WAIT_LOG_INTERVAL):
                        log.warning(
                            "worker id %d: acquire not acknowledged by the replicas (%s); releasing it and retrying",
                            worker_id,
                            problem,
                        )
                    with contextlib.suppress(Exception):
                        await self._release(acquired.lease, -1)
                    where = self.link.address or self.target.display
                    self._wait(f"the replicas of {where} do not acknowledge ({problem})")
                    self.settings.poke(forced=True)
                    await asyncio.sleep(backoff.next())
                    continue
                self.stats.acquires += 1
                return acquired, sent, received
        finally:
            await self.link.unsubscribe()

    # -- release ---------------------------------------------------------------------------------
    async def _release(self, lease: Lease, last_ms: int, quarantine: bool = False, good: int = 0) -> bool:
        """``last_ms``: the latest millisecond issued or inherited under the lease (replaces the mark);
        -1 when the lease was never served under (the stored mark stays). ``good``: 1 when the lease
        never lapsed (then an id not ours is lost writes). Unsubscribes from the holder channel first, so
        that the next holder's acquire does not take this holder for a live one."""
        await self.presence.release()
        ttl_ms, wait_ms, skew_ms = self._ms()
        mode = "quarantine" if quarantine else "clean"
        args = [lease.token, lease.worker_id, last_ms, self.epoch, mode, wait_ms, skew_ms, ttl_ms, self._local_ms()]
        result, _, _ = await self.link.run(RELEASE_LUA, [*args, self.link.channel, good], durable=False)
        if int(result[0]) != 1 and len(result) > 2 and int(result[2]) == 1:
            self.report.lost_at_release(lease.worker_id)
        return int(result[0]) == 1

    async def release(self, last_ms: int) -> None:
        """Give the id back and store the last issued millisecond for the next holder: the generator's
        ``last_issued_ms`` (which includes what it inherited at the handover), 0 if none."""
        self._stopping = True
        lease = self.lease
        good = self.holding.vouch(time.monotonic())[1] if self.holding is not None else 0
        self.holding = None
        try:
            if lease is None:
                return
            if await self._release(lease, last_ms, good=good):
                log.info("released worker id %d", lease.worker_id)
            else:
                log.warning("worker id %d was no longer ours at release", lease.worker_id)
        except Exception as exc:
            log.warning(
                "could not release worker id %d: %s (it frees itself when the lease expires)",
                lease.worker_id if lease else -1,
                describe(exc),
            )
        finally:
            await self.presence.release(everything=True)
            await self.link.close()

    # -- taking an id ----------------------------------------------------------------------------
    async def _lease_new_id(self, generator: Generator, deadline: float | None) -> None:
        """Acquire an id, claim its state file, and point the generator at it (still fenced)."""
        while True:
            acquired, sent, received = await self.acquire(deadline)
            lease = acquired.lease
            state: StateFile | None = None
            try:
                if self.claim_state is not None:
                    state = self.claim_state(lease.worker_id)
                generator.switch_worker(lease.worker_id, acquired.handover_ms, state)
            except StateFileInUse as exc:
                self.report.conflict(lease.worker_id, str(exc))
                with contextlib.suppress(Exception):
                    await self._release(lease, 0, quarantine=True)
                continue
            except StateFileError:
                if state is not None:
                    state.unlock()
                with contextlib.suppress(Exception):
                    await self._release(lease, -1)
                raise
            self._take(acquired, sent, received)
            return

    def _take(self, acquired: Acquired, sent: float, received: float) -> None:
        """Start under a new lease: fenced until its first renew has stored a high-water mark in Redis
        (so that a successor knows how far we may have issued), until any barrier or doubt window of
        the pool has passed, and until this host's clock has passed everything issued under the id
        before (the handover mark, and its state file's)."""
        generator = self.generator
        assert generator is not None
        # What the generator will not issue at or below: the handover, its state file's mark, its own past.
        after_ms = max(acquired.handover_ms, generator.last_issued_ms or 0)
        holding = Holding(acquired, self.timings, sent, received, self._local_ms(), after_ms)
        self.holding = holding
        self.watch.new_lease()
        self._waiting_for = ""
        self.stats.waiting_since = 0.0
        if self.on_change is not None:
            self.on_change(None)
        now = time.monotonic()
        recovery, behind = holding.recovering_until - now, holding.clock_wait_until - now
        why = [
            *(["for the pool to recover"] if recovery > 0 else []),
            *(["for this host's clock to pass the handover mark"] if behind > 0.001 else []),
        ]
        state = generator.state_path
        log.info(
            "leased worker id %d from %s%s%s",
            acquired.lease.worker_id,
            self.target.display,
            f" (state file {state})" if state else "",
            f"; waiting {max(recovery, behind):.1f}s {' and '.join(why)} before serving" if why else "",
        )

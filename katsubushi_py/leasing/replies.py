"""What the scripts of :mod:`.scripts` answer, as typed values: one place that knows the reply layouts,
so the keeper and its tests read names, not positions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .timings import text


@dataclass
class Lease:
    worker_id: int
    token: str


@dataclass
class PoolNews:
    """What any acquire or renew may learn about the pool as a whole (all on Redis's clock, unix ms)."""

    now_ms: int
    barrier_ms: int = 0  # nobody newly leasing serves before this (a loss, or a doubt window)
    doubt_until_ms: int = 0  # the doubt window after a restart or failover ends then (0: none yet)
    changed_ms: int = 0  # when the last restart or failover was seen
    change: str = "same"  # 'changed': this very script saw the restart or failover first
    identity_before: str = ""


@dataclass
class Acquired(PoolNews):
    lease: Lease = field(default_factory=lambda: Lease(-1, ""))
    expiry_ms: int = 0
    mark_ms: int = 0  # the record's handover mark as stored: what the holder expects at its first renew
    handover_ms: int = 0  # issue strictly after this
    created: int = 0  # 0, 1 (no pool existed) or 2 (re-created after a loss this daemon knew of)
    epoch: str = ""
    version: int = 0
    quarantined: list[tuple[int, str]] = field(default_factory=list)  # (id, reason) found on the way
    skipped: list[int] = field(default_factory=list)  # expired by Redis's clock, its holder's mark ahead
    next_free_ms: int = 0  # none free: when the next lease or quarantine ends (0: unknown)
    # Ids that looked free with a live holder subscribed to their channel (lost writes: doubt opened).
    present: list[int] = field(default_factory=list)
    stale: int = 0  # subscribers on the taken id's channel left from a dead holder (its first renew allows them)

    @property
    def got(self) -> bool:
        return self.lease.worker_id >= 0


def parse_acquire(result: list[Any], token: str) -> Acquired:
    code = int(result[0])
    quarantined = []
    for item in result[8]:
        worker_id, _, reason = text(item).partition(":")
        quarantined.append((int(worker_id), reason))
    return Acquired(
        now_ms=int(result[1]),
        lease=Lease(code, token if code >= 0 else ""),
        expiry_ms=int(result[2]) if code >= 0 else 0,
        next_free_ms=int(result[2]) if code < 0 else 0,
        mark_ms=int(result[3]),
        handover_ms=int(result[4]),
        barrier_ms=int(result[5]),
        created=int(result[6]),
        epoch=text(result[7]),
        quarantined=quarantined,
        version=int(result[9]),
        skipped=[int(x) for x in result[10]],
        change=text(result[11]),
        identity_before=text(result[12]),
        doubt_until_ms=int(result[13]),
        changed_ms=int(result[14]),
        present=[int(x) for x in result[15]] if len(result) > 15 else [],
        stale=int(result[16]) if len(result) > 16 else 0,
    )


@dataclass
class Renewed(PoolNews):
    expiry_ms: int = 0
    version: int = 0
    free: int = 0  # ids held by nobody (free, or in quarantine)
    total: int = 0
    mark_ms: int = 0  # the handover mark as stored now
    pool_mark_ms: int = 0  # the pool's high-water mark: the highest mark any holder wrote, every bound


@dataclass
class TakenOver(PoolNews):
    """Another owner token holds the id (its lease had run out by Redis's clock, or a write was lost)."""

    lost: bool = False  # its holder vouched for its lease (never lapsed): writes were lost, doubt opened


@dataclass
class PoolLost(PoolNews):
    what: str = ""  # 'missing' or 'recreated'


@dataclass
class RecordLost(PoolNews):
    what: str = ""  # 'owner entry vanished', 'record changed', 'rolled back', 'in doubt'
    until_ms: int = 0  # the id is quarantined until then
    found_expiry_ms: int = -1
    found_mark_ms: int = -1


RenewOutcome = Renewed | TakenOver | PoolLost | RecordLost


def parse_renew(result: list[Any]) -> RenewOutcome:
    code, now_ms = int(result[0]), int(result[1])
    if code == 1:
        return Renewed(
            now_ms=now_ms,
            expiry_ms=int(result[2]),
            barrier_ms=int(result[3]),
            version=int(result[4]),
            free=int(result[5]),
            total=int(result[6]),
            mark_ms=int(result[7]),
            doubt_until_ms=int(result[8]),
            changed_ms=int(result[9]),
            change=text(result[10]),
            pool_mark_ms=int(result[11]) if len(result) > 11 else 0,
        )
    if code == -1:
        return TakenOver(now_ms=now_ms, doubt_until_ms=int(result[2]), lost=len(result) > 3 and int(result[3]) == 1)
    if code == -3:
        return PoolLost(now_ms=now_ms, what=text(result[2]), barrier_ms=int(result[3]))
    return RecordLost(
        now_ms=now_ms,
        what=text(result[2]),
        until_ms=int(result[3]),
        change=text(result[4]),
        found_expiry_ms=int(result[5]),
        found_mark_ms=int(result[6]),
        doubt_until_ms=int(result[7]),
        changed_ms=int(result[8]),
    )


def parse_identity(result: list[Any]) -> PoolNews:
    return PoolNews(
        change=text(result[0]), now_ms=int(result[1]), doubt_until_ms=int(result[2]), changed_ms=int(result[3])
    )

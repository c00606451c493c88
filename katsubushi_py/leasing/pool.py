"""The ``katsubushi-py lease`` tools' side of a pool: creating one (``lease init``) and one consistent
read of it, judged by Redis TIME, with the Redis it is served by now against the one it was last written
under (a restart or failover that no daemon has touched the pool since shows as a mismatch); and the
pool's own range, which a daemon waiting for a free id names (:func:`searched_range`)."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from .nodes import connect
from .scripts import INIT_LUA
from .settings import read_settings
from .target import RedisTarget
from .timings import new_epoch


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def init_pool(target: RedisTarget, min_id: int, max_id: int) -> int:
    """``lease init``: create the pool for [min, max], serving at once, if none exists; returns how
    many ids were created (0: a pool exists, unchanged)."""
    client = await connect(target, timeout=5)
    try:
        keys = target.keys().all
        return int(await client.eval(INIT_LUA, len(keys), *keys, min_id, max_id, new_epoch()))
    finally:
        await client.aclose()


async def searched_range(link: Any, min_id: int, max_id: int) -> str:
    """The ids a daemon found none free among, as its "no free worker id in ..." names them. The pool
    in Redis has its own range (``lease init --min-worker-id/--max-worker-id``, or the first daemon's),
    and a daemon takes only the ids of it within its own: a daemon left at 1..1023 beside a pool of 1..1
    must not say it searched 1023 ids. The daemon's range alone when the pool holds all of it, or when
    Redis does not answer at once (the message matters less than the wait)."""
    try:
        client = await asyncio.wait_for(link.get(), 1.0)
        lo, hi = await asyncio.wait_for(client.hmget(link.keys.pool, "min", "max"), 1.0)
        pool_lo, pool_hi = int(lo), int(hi)
    except Exception:
        return f"{min_id}..{max_id}"
    if pool_lo <= min_id and max_id <= pool_hi:  # every id of the daemon's range is in the pool
        return f"{min_id}..{max_id}"
    ours = f"--min-worker-id..--max-worker-id {min_id}..{max_id}"
    lo, hi = max(min_id, pool_lo), min(max_id, pool_hi)
    if lo > hi:
        return f"{min_id}..{max_id}: the pool in Redis holds {pool_lo}..{pool_hi}, none of them in {ours}"
    return f"{lo}..{hi} (the pool in Redis holds {pool_lo}..{pool_hi}; {ours})"


async def pool_snapshot(target: RedisTarget) -> dict[str, Any]:
    """Everything `lease stats` and `lease list` print, read in one go (a MULTI) with Redis TIME."""
    client = await connect(target, timeout=5)
    keys = target.keys()
    try:
        sent = time.time()
        async with client.pipeline(transaction=True) as pipe:
            pipe.time()
            pipe.zrange(keys.ids, 0, -1, withscores=True)
            pipe.hgetall(keys.owners)
            pipe.hgetall(keys.last)
            pipe.hgetall(keys.stats)
            pipe.hgetall(keys.pool)
            pipe.info("server")
            pipe.info("replication")
            (seconds, micros), members, owners, last, counters, pool, server, replication = await pipe.execute()
        received = time.time()
        settings = await read_settings(client)  # min-replicas-to-write (None: CONFIG unreadable)
    finally:
        await client.aclose()
    now_ms = seconds * 1000 + micros // 1000
    owners_t = {_text(k): _text(v) for k, v in owners.items()}
    last_t = {_text(k): int(v) for k, v in last.items()}
    pool_t = {_text(k): _text(v) for k, v in pool.items()}
    ids = []
    for member, score in members:
        wid = _text(member)
        expiry = int(score)
        in_use = expiry >= now_ms
        owner = owners_t.get(wid, "")
        # "expired": its lease ended by Redis's clock without a release: the next acquire that looks at it
        # quarantines it, or leaves it to its holder if the holder's mark is still ahead.
        state = ("held" if in_use else "expired") if owner else ("quarantined" if in_use else "free")
        ids.append(
            {
                "worker_id": int(wid),
                "state": state,
                "owner": owner,
                "in_use": in_use,
                # Leased to nobody until the quarantine ends (see leasing.scripts).
                "quarantined": state == "quarantined",
                "time_left_ms": max(0, expiry - now_ms) if in_use else 0,
                "last_ms": last_t.get(wid, 0),
            }
        )
    ids.sort(key=lambda row: row["worker_id"])
    return {
        "now_ms": now_ms,
        "ids": ids,
        "counters": {_text(k): int(v) for k, v in counters.items()},
        "pool": pool_t,
        "redis_identity": f"{server.get('run_id', '-')}/{replication.get('master_replid', '-')}",
        # A master whose replication id is new only because it created its backlog (a replica attached):
        # the scripts re-stamp the pool without a doubt window (see leasing.scripts, backlog_created).
        "backlog_only": replication.get("role") == "master"
        and str(replication.get("master_replid2", "")).strip("0") == ""
        and int(replication.get("second_repl_offset", 0)) == -1,
        "replicas_connected": int(replication.get("connected_slaves", 0)),
        "min_replicas_to_write": settings.min_replicas,
        # Redis TIME minus this host's clock (the middle of the round trip): a step of Redis's clock
        # shows here, and in the daemons' STATS lease_redis_clock_offset_ms.
        "redis_clock_offset_ms": now_ms - int((sent + received) * 500),
    }


def pool_stats(snapshot: dict[str, Any]) -> dict[str, Any]:
    ids = snapshot["ids"]
    left = sorted(row["time_left_ms"] for row in ids if row["in_use"] and not row["quarantined"])
    counters = snapshot["counters"]
    pool = snapshot["pool"]
    now_ms = snapshot["now_ms"]
    barrier = int(pool.get("recovering_until_ms", 0))
    free = sum(1 for row in ids if not row["in_use"])

    minimum = snapshot.get("min_replicas_to_write")

    def number(name: str) -> int | None:
        return int(pool[name]) if name in pool else None

    doubt = int(pool.get("doubt_until_ms", 0))
    mark_hw = int(pool.get("mark_hw_ms", 0))
    stamped = pool.get("identity")

    return {
        "pool_exists": bool(pool),
        "pool_epoch": pool.get("epoch"),
        "pool_origin": pool.get("origin"),  # init, implicit (made by a daemon) or lost (re-made after a loss)
        "pool_created_ms": number("created_ms"),
        "pool_min": number("min"),
        "pool_max": number("max"),
        "pool_size": len(ids),
        "ids_in_use": len(left),
        "ids_free": free,
        "free_percent": round(100 * free / len(ids), 1) if ids else 0.0,
        "ids_quarantined": sum(1 for row in ids if row["quarantined"]),
        "recovering_until_ms": barrier,
        "recovering_left_ms": max(0, barrier - now_ms),
        "data_loss_events": counters.get("data_loss_events", 0),
        # Of those, proof of lease writes lost under live holders (issue 32: a rollback in place): an owner
        # entry gone or taken over under a lease that never lapsed, a live holder's subscription on an id
        # that looked free, two claimants at a first renew, a release of an id not ours.
        "lost_writes_seen": counters.get("lost_writes_seen", 0),
        "quarantined_ids_total": counters.get("quarantined_ids", 0),
        "lease_ttl_left_ms_min": left[0] if left else None,
        "lease_ttl_left_ms_median": int(statistics.median(left)) if left else None,
        "lease_ttl_left_ms_max": left[-1] if left else None,
        "acquire_success": counters.get("acquire_success", 0),
        "acquire_no_free_id": counters.get("acquire_no_free_id", 0),
        "renew_count": counters.get("renew_count", 0),
        "renew_success": counters.get("renew_success", 0),
        "renew_ownership_error": counters.get("renew_ownership_error", 0),
        "renew_after_expiry": counters.get("renew_after_expiry", 0),
        "release": counters.get("release", 0),
        # Restarts and failovers (issue 21): the Redis the pool was last written under, the one serving it
        # now (a difference: a restart or failover no daemon has touched the pool since), how many were
        # seen, and the doubt window after the last one.
        "pool_identity": stamped,
        "redis_identity": snapshot["redis_identity"],
        "redis_changed_unseen": bool(stamped)
        and stamped != snapshot["redis_identity"]
        and not (
            snapshot.get("backlog_only") and str(stamped).split("/")[0] == str(snapshot["redis_identity"]).split("/")[0]
        ),
        "redis_changes": counters.get("redis_changes", 0),
        # New replication ids of the same master from its replication backlog being created (a replica
        # attached): not a restart or failover, no doubt window.
        "backlog_created": counters.get("backlog_created", 0),
        "last_change_ms": number("changed_ms"),
        # The last doubt window opened by lost writes with Redis's identity unchanged (a rollback in place,
        # a record rewritten, a live holder's presence on a free-looking id): not a restart or failover.
        "last_lost_writes_ms": number("lost_writes_ms"),
        "doubt_until_ms": doubt,
        "doubt_left_ms": max(0, doubt - now_ms),
        # Ids whose lease ended without a release, not yet looked at by an acquire.
        "ids_expired_unreleased": sum(1 for row in ids if row["state"] == "expired"),
        # Why ids were quarantined: unreleased (never released; its holder may be alive), damaged (record
        # inconsistent), doubt (its holder could not vouch for it after a restart or failover), rewritten
        # (not what its holder last wrote), vanished (owner entry gone), conflict (a local state file held),
        # claimants (a second subscriber on the holder channel at a first renew).
        **{
            f"quarantined_{why}": counters.get(f"quarantined_{why}", 0)
            for why in ("unreleased", "damaged", "doubt", "rewritten", "vanished", "conflict", "claimants")
        },
        # Leases expired by Redis's clock left to their holder, whose mark was ahead of the acquirer's clock.
        "skipped_live_leases": counters.get("skipped_live_leases", 0),
        "redis_clock_offset_ms": snapshot["redis_clock_offset_ms"],
        # The pool's high-water mark (scripts.py): the highest handover mark any holder wrote (its clock plus
        # the ttl, at every renew) or a quarantine, barrier or doubt window computed; never lowered. Ahead of
        # Redis's clock by about a ttl while holders renew; far more: a daemon's clock is ahead (or Redis's
        # behind). 0 ahead once it is behind Redis's clock (no holder renewed for a ttl).
        "pool_mark_hw_ms": mark_hw,
        "pool_mark_ahead_ms": max(0, mark_hw - now_ms),
        # The replica wait (issues 24, 32): how many replicas each lease write must reach (the master's
        # min-replicas-to-write when set; else the most this master has had since it started or was
        # promoted, as the daemons recorded it, null before any did), and how many are connected now.
        "replicas_expected": minimum
        if minimum
        else (number("replicas") if pool.get("replicas_under") == snapshot["redis_identity"] else None),
        "replicas_connected": snapshot["replicas_connected"],
        "min_replicas_to_write": minimum,
    }

"""Pool inspection for the ``katsubushi-py lease`` tools: one consistent read, judged by Redis TIME."""

from __future__ import annotations

import statistics
from typing import Any

from .target import RedisTarget, connect


async def pool_snapshot(target: RedisTarget) -> dict[str, Any]:
    """Everything `lease stats` and `lease list` print, read in one go with Redis TIME."""
    client = await connect(target, timeout=5)
    keys = target.keys()
    try:
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        members = await client.zrange(keys.ids, 0, -1, withscores=True)
        owners = await client.hgetall(keys.owners)
        last = await client.hgetall(keys.last)
        counters = await client.hgetall(keys.stats)
    finally:
        await client.aclose()

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    owners_t = {text(k): text(v) for k, v in owners.items()}
    last_t = {text(k): int(v) for k, v in last.items()}
    ids = []
    for member, score in members:
        wid = text(member)
        expiry = int(score)
        in_use = expiry >= now_ms
        ids.append(
            {
                "worker_id": int(wid),
                "owner": owners_t.get(wid, "") if in_use else "",
                "in_use": in_use,
                "time_left_ms": max(0, expiry - now_ms) if in_use else 0,
                "last_ms": last_t.get(wid, 0),
            }
        )
    ids.sort(key=lambda row: row["worker_id"])
    return {"now_ms": now_ms, "ids": ids, "counters": {text(k): int(v) for k, v in counters.items()}}


def pool_stats(snapshot: dict[str, Any]) -> dict[str, Any]:
    ids = snapshot["ids"]
    left = sorted(row["time_left_ms"] for row in ids if row["in_use"])
    counters = snapshot["counters"]
    return {
        "pool_min": counters.get("min"),
        "pool_max": counters.get("max"),
        "ids_in_use": len(left),
        "ids_free": len(ids) - len(left),
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
    }

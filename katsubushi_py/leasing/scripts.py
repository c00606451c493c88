"""The Lua scripts that are the only writers of a pool, and how they are run.

Every script reads ``TIME`` itself, so every daemon is judged by one clock (Redis's). After a write,
if the master has replicas, :func:`run_script` waits for a majority of them on the same connection.
"""

from __future__ import annotations

from typing import Any

# Every script reads TIME itself: one clock (Redis's) for every daemon. Effects replication (the
# default since Redis 5) keeps replicas consistent although TIME is not deterministic.
_NOW = """
pcall(redis.replicate_commands)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: ids stats. ARGV: min max. A fresh id's score is the id itself (a moment in 1970): free, and
# the lowest id has the lowest score, so a fresh pool hands out ids in numeric order.
INIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local n = 0
for id = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  redis.call('ZADD', KEYS[1], id, id)
  n = n + 1
end
redis.call('HSET', KEYS[2], 'min', ARGV[1], 'max', ARGV[2])
return n
"""

# KEYS: ids owners last released stats. ARGV: token ttl_ms min max.
# Returns {id, now, expiry, previous_expiry, previous_last_ms, released_cleanly} or {-1, now} (none
# free) or {-2, now} (no pool). Takes the free id whose lease ended longest ago.
ACQUIRE_LUA = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-2, now} end
local lo, hi = tonumber(ARGV[3]), tonumber(ARGV[4])
local free = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'WITHSCORES')
for i = 1, #free, 2 do
  local id = tonumber(free[i])
  if id >= lo and id <= hi then
    local expiry = now + tonumber(ARGV[2])
    redis.call('ZADD', KEYS[1], expiry, free[i])
    redis.call('HSET', KEYS[2], free[i], ARGV[1])
    local last = tonumber(redis.call('HGET', KEYS[3], free[i]) or '0')
    local clean = redis.call('HDEL', KEYS[4], free[i])
    redis.call('HINCRBY', KEYS[5], 'acquire_success', 1)
    return {id, now, expiry, tonumber(free[i + 1]), last, clean}
  end
end
redis.call('HINCRBY', KEYS[5], 'acquire_no_free_id', 1)
return {-1, now}
"""
)

# KEYS: ids owners last stats. ARGV: token id ttl_ms high_water_ms.
# Returns {1, now, expiry} or {-1, now} when the id is not ours any more.
RENEW_LUA = (
    _NOW
    + """
redis.call('HINCRBY', KEYS[4], 'renew_count', 1)
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[1] or not redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('HINCRBY', KEYS[4], 'renew_ownership_error', 1)
  return {-1, now}
end
if tonumber(redis.call('ZSCORE', KEYS[1], ARGV[2])) < now then
  redis.call('HINCRBY', KEYS[4], 'renew_after_expiry', 1)
end
local expiry = now + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], expiry, ARGV[2])
local last = tonumber(redis.call('HGET', KEYS[3], ARGV[2]) or '0')
if tonumber(ARGV[4]) > last then redis.call('HSET', KEYS[3], ARGV[2], ARGV[4]) end
redis.call('HINCRBY', KEYS[4], 'renew_success', 1)
return {1, now, expiry}
"""
)

# KEYS: ids owners last released stats. ARGV: token id last_ms (0: keep the stored mark).
# Returns 1, or 0 if not ours.
RELEASE_LUA = (
    _NOW
    + """
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[2])
-- A clean release knows exactly what it issued: that replaces the mark reserved ahead at the last renew.
if tonumber(ARGV[3]) > 0 then redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) end
redis.call('HSET', KEYS[4], ARGV[2], 1)
redis.call('HINCRBY', KEYS[5], 'release', 1)
return 1
"""
)


async def _replicas(client: Any) -> int:
    info = await client.info("replication")
    return int(info.get("connected_slaves", 0))


async def run_script(client: Any, script: str, keys: list[str], args: list[Any], wait_ms: int) -> tuple[Any, str]:
    """Run a script, then, if the node has replicas, WAIT for a majority on the same connection.

    Returns (result, problem): ``problem`` is "" or why the write cannot be counted as durable.
    """
    result = await client.eval(script, len(keys), *keys, *args)
    replicas = await _replicas(client)
    if replicas == 0:
        return result, ""
    needed = replicas // 2 + 1
    acked = int(await client.execute_command("WAIT", needed, wait_ms))
    if acked < needed:
        return result, f"only {acked} of {replicas} replicas acknowledged (needed {needed})"
    return result, ""

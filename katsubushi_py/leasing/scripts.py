"""The Lua scripts that are the only writers of a pool, and how they are run.

Every script reads ``TIME`` itself, so every daemon is judged by one clock (Redis's). After a write,
if the master has replicas, the keeper waits (``WAIT``, pipelined on the same connection) for a
majority of them.

**What Redis has forgotten is treated as unsafe.** A pool has an identity: the ``epoch`` in its
``pool`` hash, a random value written when the pool is created. A daemon remembers the epoch it
leased under and every renew compares it, so a pool that vanished (``FLUSHALL``, a restart without
persistence) or was created anew since is *data loss*, not a free pool. Likewise a lease record whose
owner entry vanished, whose handover mark is missing, or whose expiry is earlier than its mark could
be (an edited or partly lost record) is not a free id. Recovering from loss costs time, never
uniqueness:

- **Pool-wide loss**: the pool is (re)created with a *barrier*: ``recovering_until_ms`` = now +
  ``wait_ms`` (the lease TTL plus the allowed clock skew on both sides). Ids can be leased at once, but
  no daemon serves before Redis's clock passes the barrier (acquire and renew return it). By then every
  daemon that held an id before the loss has fenced itself (its lease ran out within one TTL of its
  last renew, which came before the loss was seen), and its last ID is below the new holder's clock
  (both clocks are within the skew of Redis's). As a second line, ``recovery_mark_ms`` (now + TTL +
  skew: the latest millisecond any earlier holder can have issued) is handed over like a released
  id's last millisecond, so a new holder whose clock is further behind than the skew allows refuses
  to issue instead of issuing duplicates.
- **One id**: the id is *quarantined*: leased to nobody until now + ``wait_ms``, its mark raised to
  now + TTL + skew, and its owner entry removed (so a holder that is still alive sees at its next
  renew that the id is no longer its own, and stops).
- A pool created by a daemon (not by ``lease init``) cannot be told apart from a pool Redis lost
  while no daemon was looking, so it is created with the same barrier. Only ``lease init``, an explicit
  operator step, makes a pool that serves at once.

Keys (all with the namespace's hash tag, so a Redis Cluster keeps them in one slot), in the order
every script takes them: ``ids`` (sorted set: worker id scored by lease expiry), ``owners`` (id ->
holder's token), ``last_ms`` (id -> handover mark), ``released`` (ids released cleanly), ``stats``
(counters), ``pool`` (epoch, created_ms, origin, min, max, recovering_until_ms, recovery_mark_ms,
version).
"""

from __future__ import annotations

# Every script reads TIME itself: one clock (Redis's) for every daemon. Effects replication (the
# default since Redis 5) keeps replicas consistent although TIME is not deterministic.
_NOW = """
pcall(redis.replicate_commands)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# create_pool: every id free since 1970 (a fresh id's score is the id itself, so a fresh pool hands
# out ids in numeric order) with a mark of 0 (nothing issued), so that "no mark" can mean "lost".
# barrier and mark are 0 for `lease init`. quarantine: the id is leased to nobody until now + wait.
_HELPERS = """
local function create_pool(lo, hi, epoch, origin, barrier, mark)
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6])
  for id = lo, hi do
    redis.call('ZADD', KEYS[1], id, id)
    redis.call('HSET', KEYS[3], id, 0)
  end
  redis.call('HSET', KEYS[6], 'epoch', epoch, 'created_ms', now, 'origin', origin, 'min', lo, 'max', hi,
    'recovering_until_ms', barrier, 'recovery_mark_ms', mark, 'version', 1)
end
local function raise_barrier(barrier, mark)
  local cur = redis.call('HMGET', KEYS[6], 'recovering_until_ms', 'recovery_mark_ms')
  if barrier > tonumber(cur[1] or '0') then redis.call('HSET', KEYS[6], 'recovering_until_ms', barrier) end
  if mark > tonumber(cur[2] or '0') then redis.call('HSET', KEYS[6], 'recovery_mark_ms', mark) end
end
local function quarantine(id, until_ms, mark)
  redis.call('ZADD', KEYS[1], until_ms, id)
  redis.call('HDEL', KEYS[2], id)
  local old = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  if mark > old then redis.call('HSET', KEYS[3], id, mark) end
  redis.call('HSET', KEYS[4], id, 1)
  redis.call('HINCRBY', KEYS[5], 'quarantined_ids', 1)
end
"""

# KEYS: the six. ARGV: min max epoch. Returns the number of ids, or 0 when a pool exists.
INIT_LUA = (
    _NOW
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[6]) == 1 then return 0 end
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
create_pool(lo, hi, ARGV[3], 'init', 0, 0)
return hi - lo + 1
"""
)

# KEYS: the six. ARGV: token ttl_ms min max known_epoch wait_ms skew_ms new_epoch.
# Returns {id, now, expiry, previous_expiry, handover_ms, released_cleanly, recovering_until_ms,
#          created, epoch, quarantined_ids, version}
#      or {-1, now, next_expiry, 0, 0, 0, recovering_until_ms, created, epoch, quarantined_ids, 0} (none free).
# created: 0 no, 1 created (no pool existed), 2 re-created after loss (the caller knew an epoch).
# Candidates are taken a few at a time, the one whose lease ended longest ago first (LIMIT: the cost
# does not grow with the pool). A candidate whose record is damaged is quarantined and skipped.
ACQUIRE_LUA = (
    _NOW
    + _HELPERS
    + """
local token, ttl, lo, hi = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local known, wait, skew = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local created = 0
local pool = redis.call('HMGET', KEYS[6], 'epoch', 'recovering_until_ms', 'recovery_mark_ms')
if not pool[1] then
  created = 1
  local origin = 'implicit'
  if known ~= '' then
    created = 2
    origin = 'lost'
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  end
  create_pool(lo, hi, ARGV[8], origin, now + wait, now + ttl + skew)
  pool = redis.call('HMGET', KEYS[6], 'epoch', 'recovering_until_ms', 'recovery_mark_ms')
end
local barrier, recovery_mark = tonumber(pool[2]), tonumber(pool[3])
local quarantined = {}
local offset = 0
while true do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', offset, 16)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local member, score = batch[i], tonumber(batch[i + 1])
    local id = tonumber(member)
    if id < lo or id > hi then
      offset = offset + 1
    else
      local mark = redis.call('HGET', KEYS[3], member)
      if (not mark) or tonumber(mark) > score + skew + 1000 then
        -- No mark, or a mark later than the expiry allows (holders' clocks are within the skew of
        -- Redis's): this record was edited or partly lost. Someone may still issue under it.
        quarantine(member, now + wait, now + ttl + skew)
        redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
        quarantined[#quarantined + 1] = id
      else
        local expiry = now + ttl
        redis.call('ZADD', KEYS[1], expiry, member)
        redis.call('HSET', KEYS[2], member, token)
        local clean = redis.call('HDEL', KEYS[4], member)
        redis.call('HINCRBY', KEYS[5], 'acquire_success', 1)
        local version = redis.call('HINCRBY', KEYS[6], 'version', 1)
        local handover = math.max(tonumber(mark), recovery_mark)
        return {id, now, expiry, score, handover, clean, barrier, created, pool[1], quarantined, version}
      end
    end
  end
end
redis.call('HINCRBY', KEYS[5], 'acquire_no_free_id', 1)
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local next_expiry = 0
if #first == 2 then next_expiry = tonumber(first[2]) end
return {-1, now, next_expiry, 0, 0, 0, barrier, created, pool[1], quarantined, 0}
"""
)

# KEYS: the six. ARGV: token id ttl_ms high_water_ms epoch wait_ms skew_ms version_seen min max new_epoch.
# Returns {1, now, expiry, recovering_until_ms, version, free, total}: renewed (not to be served before the
#          barrier); free and total count the pool's ids, for occupancy warnings
#      or {-1, now}: the id is someone else's now (its lease had expired by Redis's clock)
#      or {-3, now, what, barrier}: the pool was lost ('missing', 'recreated', 'rolled back')
#      or {-4, now, what, barrier}: this id's record was lost; the id is quarantined until barrier
# A pool re-created by a daemon already has a barrier that started after the loss (and counted it);
# one made by `lease init` while daemons still held ids of the lost pool gets one now.
RENEW_LUA = (
    _NOW
    + _HELPERS
    + """
local token, id, ttl, hw = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local epoch, wait, skew, seen = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
redis.call('HINCRBY', KEYS[5], 'renew_count', 1)
local pool = redis.call('HMGET', KEYS[6], 'epoch', 'recovering_until_ms', 'version', 'origin')
local lost = nil
if not pool[1] then
  create_pool(tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11], 'lost', now + wait, now + ttl + skew)
  lost = 'missing'
elseif pool[1] ~= epoch then
  lost = 'recreated'
  if pool[4] == 'init' then raise_barrier(now + wait, now + ttl + skew) end
elseif tonumber(pool[3]) < seen then
  lost = 'rolled back'
  redis.call('HSET', KEYS[6], 'version', seen + 1)
  raise_barrier(now + wait, now + ttl + skew)
end
if lost then
  if lost ~= 'recreated' or pool[4] ~= 'lost' then
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
    redis.call('HSET', KEYS[6], 'origin', 'lost')
  end
  return {-3, now, lost, tonumber(redis.call('HGET', KEYS[6], 'recovering_until_ms'))}
end
local owner = redis.call('HGET', KEYS[2], id)
if not owner then
  quarantine(id, now + wait, now + ttl + skew)
  redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  return {-4, now, 'owner entry vanished', now + wait}
end
if owner ~= token then
  redis.call('HINCRBY', KEYS[5], 'renew_ownership_error', 1)
  return {-1, now}
end
local score = redis.call('ZSCORE', KEYS[1], id)
if score and tonumber(score) < now then
  redis.call('HINCRBY', KEYS[5], 'renew_after_expiry', 1)
end
local expiry = now + ttl
redis.call('ZADD', KEYS[1], expiry, id)
local last = tonumber(redis.call('HGET', KEYS[3], id) or '0')
if hw > last then redis.call('HSET', KEYS[3], id, hw) end
redis.call('HINCRBY', KEYS[5], 'renew_success', 1)
local version = redis.call('HINCRBY', KEYS[6], 'version', 1)
local free = redis.call('ZCOUNT', KEYS[1], '-inf', '(' .. now)
return {1, now, expiry, tonumber(pool[2]), version, free, redis.call('ZCARD', KEYS[1])}
"""
)

# KEYS: the six. ARGV: token id last_ms epoch mode wait_ms mark_offset_ms channel.
# mode 'clean': we stopped issuing at last_ms, the exact latest millisecond we issued or inherited (0:
# none), which replaces the mark reserved ahead at the last renew; the next holder may start at once
# after it. last_ms -1: we never served under this lease; keep the stored mark.
# mode 'quarantine': we must not use this id and someone else may be issuing under it (its state file
# is locked by another daemon of our host): lease it to nobody for wait_ms (ARGV[6]), mark ARGV[7].
# Returns 1, or 0 if the id is not ours (or the pool is not the one we leased it from).
RELEASE_LUA = (
    _NOW
    + _HELPERS
    + """
if redis.call('HGET', KEYS[6], 'epoch') ~= ARGV[4] then return 0 end
if redis.call('HGET', KEYS[2], ARGV[2]) ~= ARGV[1] then return 0 end
if ARGV[5] == 'quarantine' then
  quarantine(ARGV[2], now + tonumber(ARGV[6]), now + tonumber(ARGV[7]))
  return 1
end
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('ZADD', KEYS[1], now, ARGV[2])
-- A clean release knows exactly what it issued: that replaces the mark reserved ahead at the last renew
-- (left there, a mark later than the release would make the record look damaged).
if tonumber(ARGV[3]) >= 0 then redis.call('HSET', KEYS[3], ARGV[2], ARGV[3]) end
redis.call('HSET', KEYS[4], ARGV[2], 1)
redis.call('HINCRBY', KEYS[5], 'release', 1)
redis.call('HINCRBY', KEYS[6], 'version', 1)
-- Daemons waiting for a free id listen here: they take it within a round trip instead of a poll interval.
redis.call('PUBLISH', ARGV[8], ARGV[2])
return 1
"""
)

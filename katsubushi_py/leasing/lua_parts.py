"""The Lua building blocks every lease script is assembled from (scripts.py holds the scripts).

Apart from the scripts because they are shared by all of them and are the pool's rules in one place:
what "now" is (Redis's own clock, read in the script), which Redis this is (its identity, and when a
changed one is a restart or failover rather than a replica attaching), how a doubt window is opened and
why (a restart, or writes found lost: the pool stamps them apart so that every daemon's signal says
which), how an id is quarantined, what an id that looks free must be to be taken (``CHECK_RECORD``),
and how many replicas a lease write must reach (``REPLICA_COUNT``). A script is ``NOW + HELPERS`` first
(``counted`` in scripts.py relies on that), then whichever of the others it calls, then its body.
The design these rules serve is in scripts.py's docstring and docs/leasing.md.
"""

from __future__ import annotations

# Every script reads TIME itself: one clock (Redis's) for every daemon. Effects replication (the
# default since Redis 5) keeps replicas consistent although TIME and INFO are not deterministic.
NOW = """
pcall(redis.replicate_commands)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

HELPERS = """
-- Which Redis this is: run_id changes on every start, master_replid on every promotion (a replica
-- shares its master's). ~20 us of INFO: paid by acquires, releases and renews that cannot vouch for
-- their record, not by a renew that can (see RENEW_LUA).
local function server_identity()
  local s = redis.call('INFO', 'server')
  local r = redis.call('INFO', 'replication')
  return (string.match(s, 'run_id:(%x+)') or '-') .. '/' .. (string.match(r, 'master_replid:(%x+)') or '-')
end

-- The pool's high-water mark: the highest handover mark any holder of the pool wrote (every renew's
-- high-water mark) and every bound below (quarantines, barriers, doubt windows). Never lowered.
local function raise_hw(mark)
  if mark > tonumber(redis.call('HGET', KEYS[6], 'mark_hw_ms') or '0') then
    redis.call('HSET', KEYS[6], 'mark_hw_ms', mark)
  end
end

-- The latest millisecond a holder that stops within a ttl from now can have issued: its clock is within
-- the skew of Redis's and within twice the skew of the caller's; and no holder issued past the pool's
-- high-water mark. The latest of the three, so that neither clock having stepped back, nor both being
-- off together (a host synced to a Redis clock that is off), lowers it below what a holder whose record
-- was lost or damaged issued. caller is 0 when unknown.
local function cover(ttl, skew, caller)
  local hw = tonumber(redis.call('HGET', KEYS[6], 'mark_hw_ms') or '0')
  return math.max(now + ttl + skew, caller + ttl + 2 * skew, hw)
end

local function create_pool(lo, hi, epoch, origin, barrier, mark, identity)
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[6])
  -- Fresh ids: free since 1970 (scored by their number, so a fresh pool hands them out in order),
  -- nothing issued (mark 0), released (free and clean). In chunks: a few commands, not three per id.
  local id = lo
  while id <= hi do
    local scores, marks, clean = {}, {}, {}
    local last = math.min(hi, id + 499)
    for n = id, last do
      scores[#scores + 1] = n
      scores[#scores + 1] = n
      marks[#marks + 1] = n
      marks[#marks + 1] = 0
      clean[#clean + 1] = n
      clean[#clean + 1] = 1
    end
    redis.call('ZADD', KEYS[1], unpack(scores))
    redis.call('HSET', KEYS[3], unpack(marks))
    redis.call('HSET', KEYS[4], unpack(clean))
    id = last + 1
  end
  redis.call('HSET', KEYS[6], 'epoch', epoch, 'created_ms', now, 'origin', origin, 'min', lo, 'max', hi,
    'recovering_until_ms', barrier, 'recovery_mark_ms', mark, 'version', 1, 'identity', identity, 'format', 2,
    'mark_hw_ms', mark)
end

local function raise_barrier(barrier, mark)
  local cur = redis.call('HMGET', KEYS[6], 'recovering_until_ms', 'recovery_mark_ms')
  if barrier > tonumber(cur[1] or '0') then redis.call('HSET', KEYS[6], 'recovering_until_ms', barrier) end
  if mark > tonumber(cur[2] or '0') then redis.call('HSET', KEYS[6], 'recovery_mark_ms', mark) end
  raise_hw(mark)
end

-- Leased to nobody until until_ms (never shortened), mark raised to mark, owner entry removed (a live
-- holder finds at its next renew that the id is not its own), free and clean once it ends.
local function quarantine(id, until_ms, mark, reason)
  local cur = tonumber(redis.call('ZSCORE', KEYS[1], id) or '0')
  redis.call('ZADD', KEYS[1], math.max(until_ms, cur), id)
  redis.call('HDEL', KEYS[2], id)
  local old = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  if mark > old then redis.call('HSET', KEYS[3], id, mark) end
  raise_hw(mark)
  redis.call('HSET', KEYS[4], id, 1)
  redis.call('HINCRBY', KEYS[5], 'quarantined_ids', 1)
  redis.call('HINCRBY', KEYS[5], 'quarantined_' .. reason, 1)
end

-- Writes may have been lost: until now + wait, ids leased are not served and start after mark. Why, so
-- that every daemon's signal says what happened: 'restart' (check_identity saw a restart or failover)
-- stamps changed_ms and the end of the window it opened (change_until_ms); anything else is writes
-- found lost with Redis's identity unchanged (a rollback in place, a record rewritten, a live holder's
-- presence on a free-looking id) and stamps lost_writes_ms: no daemon reports that as a restart.
local function open_doubt(wait, mark, why)
  local cur = redis.call('HMGET', KEYS[6], 'doubt_until_ms', 'doubt_mark_ms')
  local until_ms = math.max(tonumber(cur[1] or '0'), now + wait)
  redis.call('HSET', KEYS[6], 'doubt_until_ms', until_ms, 'doubt_mark_ms', math.max(tonumber(cur[2] or '0'), mark))
  if why == 'restart' then
    redis.call('HSET', KEYS[6], 'changed_ms', now, 'change_until_ms', now + wait)
  else
    redis.call('HSET', KEYS[6], 'lost_writes_ms', now)
  end
  raise_hw(mark)
  return until_ms
end

-- The changed_ms scripts answer: when the last restart or failover was seen, while the doubt window it
-- opened lasts, else 0 (a window opened or extended by lost writes is no restart). A pool stamped before
-- change_until_ms existed falls back on the doubt window's end.
local function restart_seen(changed, change_until, doubt)
  if tonumber(change_until or doubt or '0') > now then return tonumber(changed or '0') end
  return 0
end

-- Whether a change of identity from stored to cur is the master's own history going on: the same
-- process (run_id), a master now, whose replication id changed without a promotion. Redis gives a
-- master a new replication id when it creates its replication backlog (the first replica attaching,
-- or one attaching after repl-backlog-ttl freed it) and clears master_replid2 then; a promotion
-- (REPLICAOF NO ONE, a failover) keeps the id it had in master_replid2 instead. So a master that was
-- demoted, resynced from another (losing writes) and promoted again shows its old id, or another
-- master's, in master_replid2, and is a change. A restart is a new run_id.
local function backlog_created(stored, cur)
  local run = string.match(stored, '^(%x+)/')
  if not run or run ~= string.match(cur, '^(%x+)/') then return false end
  local r = redis.call('INFO', 'replication')
  return string.match(r, 'role:(%a+)') == 'master' and string.match(r, 'master_replid2:(%x+)') ==
    string.rep('0', 40) and string.match(r, 'second_repl_offset:(%-?%d+)') == '-1'
end

-- How many connections are subscribed to a holder channel (``{ns}:holder:<id>``): every holder keeps
-- one subscription to its id's channel from before its first renew until before its release. Only
-- connection state survives a rollback of Redis's data in place (run_id and master_replid unchanged),
-- so a subscriber on an id whose record says free is a live holder whose writes were lost. Sharded
-- (SSUBSCRIBE, Redis >= 7: counted on the slot's node in a cluster) and classic subscribers both count;
-- a Redis without SHARDNUMSUB has only the classic ones.
local function subscribers(channel)
  local n = tonumber(redis.call('PUBSUB', 'NUMSUB', channel)[2])
  local ok, shard = pcall(redis.call, 'PUBSUB', 'SHARDNUMSUB', channel)
  if ok and type(shard) == 'table' then n = n + tonumber(shard[2]) end
  return n
end

-- Compare the Redis the pool was last stamped under with this one: 'same' (or the same master with a
-- replication backlog created since: re-stamped, nothing was lost), 'new' (no stamp yet: a pool made
-- before this format) or 'changed' (a restart or a failover since: a doubt window opens).
-- Only for a pool that exists. Returns the state and the identity before.
local function check_identity(wait, mark)
  local cur = server_identity()
  local stored = redis.call('HGET', KEYS[6], 'identity')
  if stored == cur then return 'same', cur end
  redis.call('HSET', KEYS[6], 'identity', cur)
  if not stored then return 'new', '' end
  if backlog_created(stored, cur) then
    redis.call('HINCRBY', KEYS[5], 'backlog_created', 1)
    return 'same', cur
  end
  redis.call('HSET', KEYS[6], 'identity_before', stored)
  redis.call('HINCRBY', KEYS[5], 'redis_changes', 1)
  open_doubt(wait, mark, 'restart')
  return 'changed', stored
end
"""

# What an id that looks free (expired by Redis's clock) is, at acquire: 'take' (with its mark), 'skip'
# (leave it: 'live' a holder's mark is ahead of the caller's clock, 'later' clean but its mark is ahead
# of the caller's clock (with the mark: taken if nothing better is found), 'range' outside the caller's
# range) or 'quarantine' with the reason.
CHECK_RECORD = """
local function check_record(member, score, lo, hi, caller, created_ms, legacy)
  local id = tonumber(member)
  if id < lo or id > hi then return 'skip', 'range' end
  local owner = redis.call('HGET', KEYS[2], member)
  local mark = redis.call('HGET', KEYS[3], member)
  local released = redis.call('HEXISTS', KEYS[4], member) == 1
  if not mark then return 'quarantine', 'damaged' end
  mark = tonumber(mark)
  if owner and released then return 'quarantine', 'damaged' end
  if owner then
    if caller < mark then return 'skip', 'live' end
    return 'quarantine', 'unreleased'
  end
  if not released then
    -- Only a pool made before release entries (no 'format') has fresh ids without one: in a newer pool
    -- this is a damaged record (a holder's expiry, mark and owner entry lost), whose holder may be alive.
    if legacy and mark == 0 and score < created_ms then return 'take', mark end
    return 'quarantine', 'damaged'
  end
  if mark > caller then return 'skip', 'later', mark end
  return 'take', mark
end
"""


# The replica count a lease write must reach (see link.py): the most replicas this master has had
# connected since it last started or was promoted. Recorded in the pool under the master's identity
# (run_id/master_replid), so a daemon that connects to a master later, or again, knows it too: a master
# cut off from its replicas (connected_slaves 0) is still waited on for them. A new identity (a
# restart, a promotion) starts from its own count. ``full`` false (a lease write's own count, after its
# write, on a connection that has written before) skips the identity's INFO server when there is
# nothing to record: the record is under this master_replid and counts at least the replicas connected
# now. Only a process that kept another's replication id (a restart that kept it) could share the
# record; a new process means a new connection, whose first write compares the whole identity.
REPLICA_COUNT = """
local function replica_count(full)
  local r = redis.call('INFO', 'replication')
  local n = tonumber(string.match(r, 'connected_slaves:(%d+)') or '0')
  local cur = redis.call('HMGET', KEYS[6], 'replicas_under', 'replicas')
  local most = tonumber(cur[2] or '0')
  if not full and cur[1] and n <= most then
    local replid = '/' .. (string.match(r, 'master_replid:(%x+)') or '-')
    if string.sub(cur[1], -#replid) == replid then return most end
  end
  if redis.call('EXISTS', KEYS[6]) == 0 then return n end
  local id = server_identity()
  if cur[1] ~= id then
    redis.call('HSET', KEYS[6], 'replicas_under', id, 'replicas', n)
    return n
  end
  if n > most then
    redis.call('HSET', KEYS[6], 'replicas', n)
    return n
  end
  return most
end
"""

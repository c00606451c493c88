"""The Lua scripts that are the only writers of a pool (assembled from lua_parts.py's helpers).

Every script reads ``TIME`` itself, so every daemon is judged by one clock (Redis's); where a bound
protects uniqueness, the caller's own clock (its generator's, anchored to its monotonic clock) is
weighed too, so that a step of Redis's clock cannot lower it (see ``cover``). An acquire or a renew
counts only once every replica the master has had connected since it last started or was promoted has
acknowledged it: the write reads that count in its own run (``counted``: the most ``connected_slaves``
seen, recorded in the pool under the master's identity) and the keeper waits for all of them (``WAIT``,
pipelined on the same connection; a second ``WAIT`` when the write counted more than were asked for;
see link.py). ``replica_acks=N`` in the URL waits for exactly N instead. Releases and identity checks
are not waited for.

**What Redis has forgotten is treated as unsafe; recovering costs time, never uniqueness.**

- **A pool that vanished or was created anew** (``FLUSHALL``, a restart without persistence): the pool
  has an ``epoch`` (random, written at creation) that every renew compares with the one its holder
  leased under. The pool is (re)created with a *barrier*: no daemon serves before ``now + wait``
  (``wait`` = lease ttl + 2 x the allowed clock skew), and the *recovery mark* (``cover``: the latest
  millisecond an earlier holder can have issued) is handed over like a released id's last millisecond.
  A pool created by a daemon (not ``lease init``) cannot be told from one Redis lost, so it gets the
  same barrier.
- **A pool that went back in time** (Redis restarted from an older snapshot, AOF ``everysec`` lost its
  last second, a failover to a replica that missed writes): the pool records the Redis it was written
  under, ``identity`` = ``run_id`` (``INFO server``: new on every start) and ``master_replid`` (``INFO
  replication``: new on every promotion, and taken from its master by a replica). A script that finds
  another identity opens a *doubt window* until ``now + wait``: any id leased in it is not served
  before the window ends and starts after ``doubt_mark_ms``, and a holder that cannot vouch for its own
  record (below) loses its id. A holder that can vouch keeps serving: only what is in doubt stops.
- **A holder vouches for its record** at every renew: it sends the range of handover marks its record
  may hold (from the one it last saw confirmed to the highest that a renew whose answer never came, or
  that no replica acknowledged, may have written; every renew raises the mark) and whether its lease
  never lapsed on its own clock. A record whose mark is outside that range was rewritten (lost writes,
  an edit): the id is quarantined and a doubt window opened. A holder whose lease lapsed (Redis
  unreachable, a pause), renewing in a doubt window, loses its id too (someone may have leased it in
  the writes that were lost).
  docs/leasing.md gives the argument why that is enough.
- **Record checks at acquire** (what an id that looks free must be to be taken), in ``check_record``:
  released cleanly (a release entry, no owner entry, a handover mark): free. An owner entry and no
  release: *expired, never released*: its holder may be alive (paused, cut off, its record damaged,
  or Redis's clock jumped forward): if the holder's own mark is still ahead of the caller's clock it is
  left alone (a live holder keeps its id through a step of Redis's clock), else it is quarantined. No
  mark, or an owner entry beside a release entry, or neither owner entry nor release entry: damaged,
  quarantined. A fresh id of a pool made before this format (no ``format`` in the pool, no release
  entry, mark 0, expiry before the pool was created) is free; in a newer pool such a record is damaged.
- **Quarantine**: the id is leased to nobody until ``until`` (``now + wait``, from when it was found),
  its mark raised to ``cover``, its owner entry removed (a holder still alive finds at its next renew
  that the id is not its own, and stops), and it counts as released once the quarantine ends.

Keys (all with the namespace's hash tag, so a Redis Cluster keeps them in one slot), in the order
every script takes them: ``ids`` (sorted set: worker id scored by lease expiry), ``owners`` (id ->
holder's token), ``last_ms`` (id -> handover mark), ``released`` (ids released cleanly or whose
quarantine ends), ``stats`` (counters), ``pool`` (epoch, created_ms, origin, min, max,
recovering_until_ms, recovery_mark_ms, version, identity, identity_before, changed_ms and
change_until_ms (the last restart or failover seen and the end of its doubt window), lost_writes_ms
(the last time writes were found lost with Redis's identity unchanged), doubt_until_ms, doubt_mark_ms,
format, mark_hw_ms, and replicas / replicas_under: the replica count lease writes wait for, and the
master identity it was counted under).

- **The pool's high-water mark** (``mark_hw_ms``): the highest handover mark any holder wrote and every
  bound computed below, never lowered; ``cover`` never answers less. Clocks that are off true time
  *together* (a host synced to a Redis host whose clock is wrong passes the daemon's clock check) make
  the bounds from Redis's clock and the caller's too low: this one is in the holders' own clocks. A
  doubt window's mark stays the floor of every acquire after the window (an id whose holder's writes
  were lost looks clean with an older mark). Lost with the pool: across a loss of Redis's data the
  clocks at hand must be right (docs/guarantees.md, Clock).
"""

from __future__ import annotations

from .lua_parts import CHECK_RECORD, HELPERS, NOW, REPLICA_COUNT

# KEYS: the six. ARGV: min max epoch. Returns the number of ids, or 0 when a pool exists.
INIT_LUA = (
    NOW
    + HELPERS
    + """
if redis.call('EXISTS', KEYS[6]) == 1 then return 0 end
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
create_pool(lo, hi, ARGV[3], 'init', 0, 0, server_identity())
return hi - lo + 1
"""
)

# KEYS: the six. ARGV: token ttl_ms min max known_epoch wait_ms skew_ms new_epoch caller_now_ms
#       unreleased_wait_ms holder_prefix.
# holder_prefix: the holder channels' name before the id (``{ns}:holder:``; '' checks no presence).
# Returns {id, now, expiry, mark, handover_ms, barrier_ms, created, epoch, quarantined, version, skipped,
#          change, identity_before, doubt_until_ms, changed_ms, present, stale}
#      or {-1, now, next_free_ms, 0, 0, barrier_ms, created, epoch, quarantined, 0, skipped, change,
#          identity_before, doubt_until_ms, changed_ms, present, 0} (none free).
# present: ids that looked free while a live holder was subscribed to their channel (lost writes: each
# opened the doubt window, which bars and floors this very acquire too); stale: subscribers on the taken
# id's channel that a doubt window opened for them has outlived (a dead host's subscription that Redis
# has not dropped yet: see subscribers()), which the holder's first renew allows for.
# mark: the record's handover mark as stored (the holder's expectation); handover_ms: start after it
# (the mark, or the pool's recovery or doubt mark); barrier_ms: serve no sooner. created: 0 no, 1
# created (no pool existed), 2 re-created after a loss the caller knew of. quarantined: "id:reason".
# skipped: ids left to a holder whose mark is ahead of the caller's clock. change: 'same', 'new' or
# 'changed' (this acquire saw a restart or failover first). Candidates are looked at a few at a
# time, the one whose lease ended longest ago first (LIMIT: the cost does not grow with the pool); ids
# never released are quarantined on the way, so a clean one is what is taken.
ACQUIRE_LUA = (
    NOW
    + HELPERS
    + CHECK_RECORD
    + """
local token, ttl, lo, hi = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local known, wait, skew = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
local caller, unreleased_wait = tonumber(ARGV[9]), tonumber(ARGV[10])
local prefix = ARGV[11] or ''
local mark_cover = cover(ttl, skew, caller)
local created, change, before = 0, 'same', ''
if redis.call('EXISTS', KEYS[6]) == 0 then
  created = 1
  local origin = 'implicit'
  if known ~= '' then
    created = 2
    origin = 'lost'
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  end
  create_pool(lo, hi, ARGV[8], origin, now + wait, mark_cover, server_identity())
else
  change, before = check_identity(wait, mark_cover)
end
local pool = redis.call('HMGET', KEYS[6], 'epoch', 'recovering_until_ms', 'recovery_mark_ms', 'doubt_until_ms',
  'doubt_mark_ms', 'created_ms', 'changed_ms', 'format', 'change_until_ms')
local legacy = pool[8] == false
local barrier, floor = tonumber(pool[2]), tonumber(pool[3])
local doubt = tonumber(pool[4] or '0')
if doubt > now then barrier = math.max(barrier, doubt) end
-- The doubt window's mark outlives the window: an id whose holder's writes were lost (its release, its
-- later renews) looks clean with an older mark, and a daemon whose clock is behind (synced to a Redis
-- clock that is off) must not start below what that holder issued. Within the skew, time has passed it.
floor = math.max(floor, tonumber(pool[5] or '0'))
local created_ms, changed_ms = tonumber(pool[6] or '0'), restart_seen(pool[7], pool[9], pool[4])
local quarantined, skipped, present = {}, {}, {}
local later, later_mark, later_stale = nil, nil, 0
-- Whether a live holder is subscribed to the channel of an id that looks free, and how many subscribe:
-- the record was rolled back under a live holder (its acquire, or its renews, lost). First seen: open
-- the doubt window (so this acquire and every one until its end is barred, and starts after its mark)
-- and remember until when, in the pool. A subscription still there once that window has ended is no
-- live holder whose writes were lost: such a holder renews within the window, finds its record gone
-- and unsubscribes, or passes its deadline and stops (a dead host's subscription, which Redis drops
-- only at its tcp-keepalive): the id may be taken, and the new holder's first renew allows for it.
local function held_live(member)
  if prefix == '' then return false, 0 end
  local n = subscribers(prefix .. member)
  if n == 0 then return false, 0 end
  local field = 'presence_until:' .. member
  local seen = tonumber(redis.call('HGET', KEYS[6], field) or '0')
  -- A loss already seen (the pool lost and made anew): its barrier holds every id until each live
  -- holder has found it at a renew and stopped. Left alone, nothing more to open or count.
  if seen == 0 and tonumber(pool[2]) > now then return true, n end
  if seen == 0 then
    redis.call('HSET', KEYS[6], field, open_doubt(wait, mark_cover, 'lost'))
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
    redis.call('HINCRBY', KEYS[5], 'lost_writes_seen', 1)
    present[#present + 1] = tonumber(member)
    return true, n
  end
  return now < seen, n
end
local function take(member, mark, stale)
  local expiry = now + ttl
  redis.call('ZADD', KEYS[1], expiry, member)
  redis.call('HSET', KEYS[2], member, token)
  redis.call('HDEL', KEYS[4], member)
  redis.call('HDEL', KEYS[6], 'presence_until:' .. member)
  redis.call('HINCRBY', KEYS[5], 'acquire_success', 1)
  local version = redis.call('HINCRBY', KEYS[6], 'version', 1)
  -- A doubt window this very acquire opened (a live holder's presence) bars and floors it too.
  local cur = redis.call('HMGET', KEYS[6], 'doubt_until_ms', 'doubt_mark_ms')
  local bar, low = barrier, math.max(floor, tonumber(cur[2] or '0'))
  if tonumber(cur[1] or '0') > now then bar = math.max(bar, tonumber(cur[1])) end
  return {tonumber(member), now, expiry, mark, math.max(mark, low), bar, created, pool[1], quarantined, version,
    skipped, change, before, doubt, changed_ms, present, stale}
end
local offset = 0
while true do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. now, 'WITHSCORES', 'LIMIT', offset, 16)
  if #batch == 0 then break end
  for i = 1, #batch, 2 do
    local member, score = batch[i], tonumber(batch[i + 1])
    local verdict, what, mark = check_record(member, score, lo, hi, caller, created_ms, legacy)
    if verdict == 'take' then
      local live, n = held_live(member)
      if not live then return take(member, what, n) end
      offset = offset + 1
    elseif verdict == 'skip' then
      offset = offset + 1
      if what == 'live' then
        skipped[#skipped + 1] = tonumber(member)
        redis.call('HINCRBY', KEYS[5], 'skipped_live_leases', 1)
      elseif what == 'later' and (later_mark == nil or mark < later_mark) then
        local live, n = held_live(member)
        if not live then later, later_mark, later_stale = member, mark, n end
      end
    else
      local until_ms = now + wait
      if what == 'unreleased' then until_ms = now + unreleased_wait end
      quarantine(member, until_ms, mark_cover, what)
      if what == 'damaged' then redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1) end
      quarantined[#quarantined + 1] = member .. ':' .. what
    end
  end
end
if later then return take(later, later_mark, later_stale) end
redis.call('HINCRBY', KEYS[5], 'acquire_no_free_id', 1)
local first = redis.call('ZRANGEBYSCORE', KEYS[1], now, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
local next_free = 0
if #first == 2 then next_free = tonumber(first[2]) end
local cur = redis.call('HGET', KEYS[6], 'doubt_until_ms')
if #present > 0 and tonumber(cur) > now then barrier = math.max(barrier, tonumber(cur)) end
return {-1, now, next_free, 0, 0, barrier, created, pool[1], quarantined, 0, skipped, change, before, doubt, changed_ms,
  present, 0}
"""
)

# KEYS: the six. ARGV: token id ttl_ms high_water_ms epoch wait_ms skew_ms version_seen min max new_epoch
#       marks good caller_now_ms channel expected.
# channel: the id's holder channel; expected: on the first renew of a lease, how many subscribers it may
# have (the holder's own, and any stale ones its acquire saw), more is a second claimant (0: no check).
# marks: the handover marks the holder's record may hold, comma-separated: the one it last saw confirmed,
# and the highest that a renew whose answer never came (or that no replica acknowledged) may have
# written; any mark between them is one of its own ('': it lost track). good: 1 while its
# lease never lapsed on its own clock (every renew sent before its deadline).
# Returns {1, now, expiry, recovering_until_ms, version, free, total, mark, doubt_until_ms, changed_ms, change,
#          mark_hw_ms}: renewed; free and total count the pool's ids (free: held by nobody), for occupancy
#          warnings; mark_hw_ms the pool's high-water mark (a holder far ahead of it shows a clock off)
#      or {-1, now, doubt_until_ms, lost}: the id is someone else's now; lost 1 when its holder vouched that
#          its lease never lapsed (good): a live holder's id is never taken, so writes were lost (the
#          doubt window is open)
#      or {-3, now, what, barrier}: the pool was lost ('missing', 'recreated')
#      or {-4, now, what, until, change, found_expiry, found_mark, doubt_until_ms, changed_ms}: this id's
#          record was lost, rewritten or is in doubt ('owner entry vanished', 'record changed', 'rolled
#          back', 'in doubt', 'two claimants'); quarantined until ``until``. An owner entry gone while
#          its holder's lease never lapsed is lost writes: it opens the doubt window too.
# A holder that vouches for its record (its token, a mark it wrote, a lease that never lapsed) pays no
# INFO: nobody else can have leased its id, whatever Redis forgot of other ids (see docs/leasing.md).
RENEW_LUA = (
    NOW
    + HELPERS
    + """
local token, id, ttl, hw = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local epoch, wait, skew, seen = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local marks, good, caller = ARGV[12], ARGV[13] == '1', tonumber(ARGV[14])
redis.call('HINCRBY', KEYS[5], 'renew_count', 1)
local pool = redis.call('HMGET', KEYS[6], 'epoch', 'recovering_until_ms', 'version', 'origin', 'doubt_until_ms',
  'changed_ms', 'mark_hw_ms', 'change_until_ms')
local mark_cover = cover(ttl, skew, caller)
local lost = nil
if not pool[1] then
  create_pool(tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11], 'lost', now + wait, mark_cover, server_identity())
  lost = 'missing'
elseif pool[1] ~= epoch then
  lost = 'recreated'
  if pool[4] == 'init' then raise_barrier(now + wait, mark_cover) end
end
if lost then
  if lost ~= 'recreated' or pool[4] ~= 'lost' then
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
    redis.call('HSET', KEYS[6], 'origin', 'lost')
  end
  return {-3, now, lost, tonumber(redis.call('HGET', KEYS[6], 'recovering_until_ms'))}
end
local doubt, changed_ms = tonumber(pool[5] or '0'), restart_seen(pool[6], pool[8], pool[5])
local owner = redis.call('HGET', KEYS[2], id)
if not owner then
  -- Nobody removes a live holder's owner entry (an acquire quarantines only a lease that ran out): with
  -- its lease never lapsed, the entry was lost (a rollback in place: run_id and master_replid the same),
  -- and whatever else was written since then with it. Doubt for every id nobody vouches for; this
  -- holder's own next acquire is barred and floored by it too.
  local until_ms, d = now + wait, doubt
  if good then
    until_ms = open_doubt(wait, mark_cover, 'lost')
    d = until_ms
    redis.call('HINCRBY', KEYS[5], 'lost_writes_seen', 1)
  end
  quarantine(id, until_ms, mark_cover, 'vanished')
  redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  return {-4, now, 'owner entry vanished', until_ms, 'same', -1, -1, d, changed_ms}
end
if owner ~= token then
  redis.call('HINCRBY', KEYS[5], 'renew_ownership_error', 1)
  if good then
    -- Taken over while its lease never lapsed: an acquire never takes a live lease (check_record leaves
    -- it), so the record was rolled back under it (its acquire lost) and leased again: lost writes.
    local until_ms = open_doubt(wait, mark_cover, 'lost')
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
    redis.call('HINCRBY', KEYS[5], 'lost_writes_seen', 1)
    return {-1, now, until_ms, 1}
  end
  return {-1, now, doubt, 0}
end
local expiry_found = tonumber(redis.call('ZSCORE', KEYS[1], id) or '-1')
local mark = tonumber(redis.call('HGET', KEYS[3], id) or '-1')
-- The holder wrote every mark from the one it last saw confirmed up to the highest its unconfirmed
-- renews may have left (each renew raises the mark): a record holding one of them is its own.
local known, lo, hi = marks ~= '', nil, nil
for m in string.gmatch(marks, '[^,]+') do
  m = tonumber(m)
  if lo == nil or m < lo then lo = m end
  if hi == nil or m > hi then hi = m end
end
local written = known and mark >= lo and mark <= hi
local rolled = tonumber(pool[3]) < seen
if rolled or (known and not written) then
  -- Not what its holder wrote: writes were lost (a restart, a failover, a restore) or the record was
  -- edited. What else was lost is unknown: doubt about every id nobody vouches for.
  -- A restart or failover this very script saw has opened the window (and stamped it a restart);
  -- otherwise Redis is the same one and forgot writes: the window is lost writes'.
  local change = check_identity(wait, mark_cover)
  local until_ms = open_doubt(wait, mark_cover, change == 'changed' and 'restart' or 'lost')
  if change == 'changed' then changed_ms = now end
  if rolled then redis.call('HSET', KEYS[6], 'version', seen + 1) end
  quarantine(id, until_ms, mark_cover, 'rewritten')
  redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  local what = 'record changed'
  if rolled then what = 'rolled back' end
  return {-4, now, what, until_ms, change, expiry_found, mark, until_ms, changed_ms}
end
local change = 'same'
if not good or not known then
  -- The holder cannot vouch (its lease lapsed, or it lost track of what it wrote): in a doubt window,
  -- its id may have been leased by someone in the writes that were lost.
  change = check_identity(wait, mark_cover)
  if change == 'changed' then
    local cur = redis.call('HMGET', KEYS[6], 'doubt_until_ms', 'changed_ms')
    doubt, changed_ms = tonumber(cur[1]), tonumber(cur[2])
  end
  if now < doubt then
    local until_ms = math.max(doubt, now + wait)
    quarantine(id, until_ms, mark_cover, 'doubt')
    redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
    return {-4, now, 'in doubt', until_ms, change, expiry_found, mark, doubt, changed_ms}
  end
end
-- The first renew of a lease: its holder subscribed to the id's channel before sending it, and so did
-- any other claimant before its own first renew; in one single-threaded Redis the later of the two
-- renews sees both subscriptions and stops its holder (neither has served yet).
local expected = tonumber(ARGV[16] or '0')
if expected > 0 and subscribers(ARGV[15]) > expected then
  local until_ms = open_doubt(wait, mark_cover, 'lost')
  quarantine(id, until_ms, mark_cover, 'claimants')
  redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  redis.call('HINCRBY', KEYS[5], 'lost_writes_seen', 1)
  return {-4, now, 'two claimants', until_ms, 'same', expiry_found, mark, until_ms, changed_ms}
end
if expiry_found < now then redis.call('HINCRBY', KEYS[5], 'renew_after_expiry', 1) end
local expiry = now + ttl
redis.call('ZADD', KEYS[1], expiry, id)
if hw > mark then
  redis.call('HSET', KEYS[3], id, hw)
  mark = hw
end
if hw > tonumber(pool[7] or '0') then redis.call('HSET', KEYS[6], 'mark_hw_ms', hw) end
redis.call('HINCRBY', KEYS[5], 'renew_success', 1)
local version = redis.call('HINCRBY', KEYS[6], 'version', 1)
local total = redis.call('ZCARD', KEYS[1])
local free = total - redis.call('HLEN', KEYS[2])
return {1, now, expiry, tonumber(pool[2]), version, free, total, mark, doubt, changed_ms, change,
  math.max(tonumber(pool[7] or '0'), hw)}
"""
)

# KEYS: the six. ARGV: token id last_ms epoch mode wait_ms skew_ms ttl_ms caller_now_ms channel good.
# good: 1 when the holder's lease never lapsed (see RENEW_LUA): then an id not ours is lost writes.
# mode 'clean': we stopped issuing at last_ms, the exact latest millisecond we issued or inherited (0:
# none), which replaces the mark reserved ahead at the last renew; the next holder may start at once
# after it. last_ms -1: we never served under this lease; keep the stored mark.
# mode 'quarantine': we must not use this id and someone else may be issuing under it (its state file
# is locked by another daemon of our host): lease it to nobody for wait_ms.
# Returns {1, change} or {0, change, lost} if the id is not ours (or the pool is not the one we leased it
# from); lost 1: the holder vouched for its lease, so writes were lost and the doubt window is open.
RELEASE_LUA = (
    NOW
    + HELPERS
    + """
local id, wait, skew, ttl, caller = ARGV[2], tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
if redis.call('HGET', KEYS[6], 'epoch') ~= ARGV[4] then return {0, 'same'} end
local mark_cover = cover(ttl, skew, caller)
local change = check_identity(wait, mark_cover)
if redis.call('HGET', KEYS[2], id) ~= ARGV[1] then
  if ARGV[11] ~= '1' then return {0, change, 0} end
  open_doubt(wait, mark_cover, 'lost')
  redis.call('HINCRBY', KEYS[5], 'data_loss_events', 1)
  redis.call('HINCRBY', KEYS[5], 'lost_writes_seen', 1)
  return {0, change, 1}
end
if ARGV[5] == 'quarantine' then
  quarantine(id, now + wait, mark_cover, 'conflict')
  return {1, change}
end
redis.call('HDEL', KEYS[2], id)
redis.call('ZADD', KEYS[1], now, id)
-- A clean release knows exactly what it issued: that replaces the mark reserved ahead at the last renew.
if tonumber(ARGV[3]) >= 0 then redis.call('HSET', KEYS[3], id, ARGV[3]) end
redis.call('HSET', KEYS[4], id, 1)
redis.call('HINCRBY', KEYS[5], 'release', 1)
redis.call('HINCRBY', KEYS[6], 'version', 1)
-- Daemons waiting for a free id listen here: they take it within a round trip instead of a poll interval.
redis.call('PUBLISH', ARGV[10], id)
return {1, change}
"""
)

# KEYS: the six. ARGV: wait_ms skew_ms ttl_ms caller_now_ms. Run by a holder after its connection
# changed (a reconnect: perhaps a restarted or promoted Redis), so that a restart is seen, and its
# doubt window opened, within a round trip of the first holder reconnecting, not at the next acquire.
# Returns {change, now, doubt_until_ms, changed_ms} ('none' when no pool exists).
IDENTITY_LUA = (
    NOW
    + HELPERS
    + """
if redis.call('EXISTS', KEYS[6]) == 0 then return {'none', now, 0, 0} end
local wait, skew, ttl, caller = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local change = check_identity(wait, cover(ttl, skew, caller))
local cur = redis.call('HMGET', KEYS[6], 'doubt_until_ms', 'changed_ms', 'change_until_ms')
return {change, now, tonumber(cur[1] or '0'), restart_seen(cur[2], cur[3], cur[1])}
"""
)

# KEYS: the six. No ARGV. Returns the replica count (above): asked by ``lease stats`` and the tests.
REPLICAS_LUA = NOW + HELPERS + REPLICA_COUNT + "return replica_count(true)\n"


def counted(script: str) -> str:
    """``script`` as a lease write that counts the master's replicas in the same atomic run, after its
    write: the reply is ``{count, the script's reply}``, and link.py waits for ``count`` replicas. So a
    write is never counted as acknowledged by fewer replicas than the master had when it was written,
    and a replica the write saw is recorded for every later write on that master (see link.py). One
    more ARGV, after the script's own: '1' to compare the master's whole identity (a connection's
    first write), '0' otherwise."""
    prefix = NOW + HELPERS
    if not script.startswith(prefix):
        raise ValueError("only a lease script (TIME and the helpers first) can be counted")
    body = script[len(prefix) :]
    return (
        prefix
        + REPLICA_COUNT
        + "local function lease_write()\n"
        + body
        + "\nend\nlocal reply = lease_write()\nreturn {replica_count(ARGV[#ARGV] == '1'), reply}\n"
    )


# The lease writes that must reach the replicas (link.py runs these in place of the plain ones).
ACQUIRE_COUNTED_LUA = counted(ACQUIRE_LUA)
RENEW_COUNTED_LUA = counted(RENEW_LUA)
COUNTED = {ACQUIRE_LUA: ACQUIRE_COUNTED_LUA, RENEW_LUA: RENEW_COUNTED_LUA}

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
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

log = logging.getLogger("katsubushi_py")

DEFAULT_NAMESPACE = "katsubushi"


class LeaseError(RuntimeError):
    """Leasing cannot work as configured (bad URL, pool empty and told not to wait, ...)."""


class NoFreeWorkerId(LeaseError):
    """Every worker id of the range is leased."""


@dataclass(frozen=True)
class RedisTarget:
    """Where the pool lives: a Redis URL without our ``ns`` parameter, and the namespace."""

    url: str
    namespace: str
    cluster: bool

    @property
    def display(self) -> str:
        """The URL without a password, for logs."""
        parts = urlsplit(self.url)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, netloc, parts.path, "", "")) + f" (ns={self.namespace})"

    def keys(self) -> LeaseKeys:
        tag = "{" + self.namespace + "}"
        return LeaseKeys(
            ids=f"{tag}:ids",
            owners=f"{tag}:owners",
            last=f"{tag}:last_ms",
            released=f"{tag}:released",
            stats=f"{tag}:stats",
        )


@dataclass(frozen=True)
class LeaseKeys:
    ids: str
    owners: str
    last: str
    released: str
    stats: str


def parse_redis_url(url: str) -> RedisTarget:
    """``redis://[user:pass@]host[:port][/db]?ns=NAME``, ``rediss://`` (TLS), ``unix:///path?db=N&ns=NAME``
    and go-katsubushi's cluster form ``rediscluster://host:port?ns=NAME`` (no database)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix", "rediscluster"):
        raise LeaseError(f"invalid scheme in Redis URL {url!r}: use redis://, rediss://, unix:// or rediscluster://")
    query = parse_qsl(parts.query, keep_blank_values=True)
    namespace = DEFAULT_NAMESPACE
    rest = []
    for key, value in query:
        if key == "ns":
            namespace = value
        else:
            rest.append((key, value))
    if not namespace or any(ch in namespace for ch in "{}"):
        raise LeaseError(f"invalid namespace {namespace!r} in Redis URL: it must be non-empty, without braces")
    cluster = scheme == "rediscluster"
    if cluster:
        if parts.path not in ("", "/"):
            raise LeaseError("a rediscluster:// URL cannot select a database")
        scheme = "redis"
    if scheme in ("redis", "rediss", "rediscluster") and not parts.hostname:
        raise LeaseError(f"Redis URL {url!r} has no host")
    clean = urlunsplit((scheme, parts.netloc, parts.path, urlencode(rest), ""))
    return RedisTarget(url=clean, namespace=namespace, cluster=cluster)


# -- Lua --------------------------------------------------------------------------------------------
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


# -- connections ------------------------------------------------------------------------------------
async def connect(target: RedisTarget, timeout: float) -> Any:
    """A plain asyncio Redis client to the node that holds the namespace's keys.

    For a cluster, ask the cluster which master owns the namespace's slot and talk to that node
    directly: a script and the ``WAIT`` after it must go over one connection to one node.
    """
    import redis.asyncio as aioredis

    if not target.cluster:
        return aioredis.Redis.from_url(
            target.url, socket_timeout=timeout, socket_connect_timeout=timeout, single_connection_client=True
        )
    from redis.asyncio.cluster import RedisCluster

    cluster = RedisCluster.from_url(target.url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        await cluster.initialize()
        node = cluster.get_node_from_key(target.keys().ids)
        host, port = node.host, node.port
    finally:
        await cluster.aclose()
    parts = urlsplit(target.url)
    netloc = parts.netloc.rsplit("@", 1)
    auth = netloc[0] + "@" if len(netloc) == 2 else ""
    direct = urlunsplit((parts.scheme, f"{auth}{host}:{port}", "", parts.query, ""))
    return aioredis.Redis.from_url(
        direct, socket_timeout=timeout, socket_connect_timeout=timeout, single_connection_client=True
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


# -- the daemon's lease ------------------------------------------------------------------------------
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


# -- pool inspection (the `lease` tools) -------------------------------------------------------------
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

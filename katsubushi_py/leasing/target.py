"""Where a pool of worker ids lives: the Redis URL, the namespace and its keys, and a connection to
the node that holds them.

All keys of a namespace share the hash tag ``{ns}``, so a Redis Cluster keeps them in one slot, and
a script plus the ``WAIT`` after it can go over one connection to that slot's master.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
            pool=f"{tag}:pool",
        )


@dataclass(frozen=True)
class LeaseKeys:
    ids: str
    owners: str
    last: str
    released: str
    stats: str
    pool: str  # the pool's identity (epoch), range and recovery barrier

    @property
    def all(self) -> list[str]:
        """Every key, in the order every script takes them."""
        return [self.ids, self.owners, self.last, self.released, self.stats, self.pool]


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


async def connect(target: RedisTarget, timeout: float) -> Any:
    """A plain asyncio Redis client to the node that holds the namespace's keys.

    For a cluster, ask the cluster which master owns the namespace's slot and talk to that node
    directly: a script and the ``WAIT`` after it go in one pipeline, over one connection, to one node.
    The client does not retry by itself (redis-py's default retries a failed command up to ten times
    with backoff): the lease keeper decides when to retry, because a renew must fail fast.
    """
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if not target.cluster:
        return aioredis.Redis.from_url(target.url, **options)
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
    return aioredis.Redis.from_url(direct, **options)


def released_channel(target: RedisTarget) -> str:
    """The pub/sub channel a clean release announces itself on, so that waiting daemons wake at once."""
    return "{" + target.namespace + "}:released"

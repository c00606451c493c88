"""Finding the Redis node that holds a pool, and connecting to it: the one in the URL, the master that
Redis Sentinel names, or the master that owns the namespace's slot in a Redis Cluster.

The discovery is redis-py's (``redis.asyncio.sentinel.Sentinel.discover_master``, ``RedisCluster``'s
slot map); what this adds is keeping it for the keeper's whole life, so that a reconnect after a
failover asks what is already known: every sentinel of the URL, and every node the cluster has shown
(redis-py's ``RedisCluster`` adds each node it learns of to its startup nodes), so losing the one seed
node of the URL does not stop renewals.

The client it returns is a plain connection to that one node: a lease script and the ``WAIT`` after
it go in one pipeline, over one connection, to the master that runs them. It does not retry by itself
(redis-py's default retries a failed command with backoff): the keeper decides when to retry, because a
renew must fail fast. A failed round trip drops the client; the next one finds the node again (a
master demoted by a failover answers writes with READONLY, a cluster node that lost the slot with
MOVED: both fail the round trip).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from .target import RedisTarget


class NodeFinder:
    """Connects to the node that holds ``target``'s pool, keeping what it learned between connections."""

    def __init__(self, target: RedisTarget, timeout: float) -> None:
        self.target = target
        self.timeout = timeout
        self._sentinel: Any = None
        self._cluster: Any = None
        self._cluster_ready = False

    def _options(self) -> dict[str, Any]:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.timeout,
            "retry": Retry(NoBackoff(), 0),
        }

    async def connect(self) -> tuple[Any, str]:
        """A client for the node, and its address (``host:port``, or the socket path) for logs."""
        import redis.asyncio as aioredis

        target = self.target
        if target.sentinel:
            host, port = await self._discover_master()
            url = target.node_url(host, int(port))
        elif target.cluster:
            host, port = await self._slot_master()
            url = target.node_url(host, int(port))
        else:
            url = target.url
        parts = urlsplit(url)
        address = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path
        return aioredis.Redis.from_url(url, **self._options()), address

    async def _discover_master(self) -> tuple[str, int]:
        """The master as the first sentinel that answers names it (redis-py asks them in turn, and
        puts the one that answered first)."""
        if self._sentinel is None:
            from redis.asyncio.sentinel import Sentinel

            options = self._options()
            self._sentinel = Sentinel(
                list(self.target.seeds), sentinel_kwargs={**options, **dict(self.target.sentinel_options)}
            )
        host, port = await self._sentinel.discover_master(self.target.service)
        return str(host), int(port)

    async def _slot_master(self) -> tuple[str, int]:
        """The master of the namespace's slot, from the cluster's slot map read again from any node
        known so far (the URL's seeds and every node the cluster has shown)."""
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        if self._cluster is None:
            seeds = [ClusterNode(host, port) for host, port in self.target.seeds[1:]]
            self._cluster = RedisCluster.from_url(
                self.target.url,
                startup_nodes=seeds or None,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
            )
        if not self._cluster_ready:
            await self._cluster.initialize()
            self._cluster_ready = True
        else:
            await self._cluster.nodes_manager.initialize()
        node = self._cluster.get_node_from_key(self.target.keys().ids)
        return str(node.host), int(node.port)

    async def aclose(self) -> None:
        sentinel, self._sentinel = self._sentinel, None
        cluster, self._cluster = self._cluster, None
        self._cluster_ready = False
        if sentinel is not None:
            for client in sentinel.sentinels:
                await client.aclose()
        if cluster is not None:
            await cluster.aclose()


async def connect(target: RedisTarget, timeout: float) -> Any:
    """One client for the node that holds the pool (for the ``lease`` tools: asks once, keeps nothing)."""
    finder = NodeFinder(target, timeout)
    try:
        client, _ = await finder.connect()
    finally:
        await finder.aclose()
    return client

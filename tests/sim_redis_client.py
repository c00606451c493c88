"""The daemons' side of the simulator's Redis: stand-ins for the redis-py asyncio client and for the
Sentinel finder, with exactly the calls the production leasing code makes of them.

:class:`SimClient` is a connection to one simulated node with the calls ``leasing/link.py`` makes of
redis-py's asyncio client (a pipeline of ``EVAL``s and ``WAIT``, ``CLIENT ID``, ``TIME``, a pubsub for
release announcements, the connection pool the link asks for a connection); :class:`SimFinder` stands in
for ``leasing/nodes.py``'s NodeFinder and names the node Sentinel names. Both only carry requests and
timeouts the way redis-py would (a timeout or a reset drops the connection): what happens to a request on
its way and in the node is the world's, in sim_redis.py, and the lease scripts run in the real
redis-server of sim_redis_backend.py. The keeper, its link and its holder are the production code.

A module of its own because it is the part that must follow redis-py's interface as the production code
uses it, while sim_redis.py follows what Redis does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.sentinel import MasterNotFoundError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sim_loop import ROOT
from sim_redis import Conn, Node, RedisWorld, Subscription, settle


def _expire(fut: asyncio.Future[Any], message: str) -> None:
    if not fut.done():
        fut.set_exception(RedisTimeoutError(message))


class SimClient:
    """A connection to one node, with the calls ``leasing/link.py`` makes of redis-py's asyncio client."""

    def __init__(self, world: RedisWorld, process: Any, node: Node, timeout: float) -> None:
        self.world = world
        self.process = process
        self.node = node
        self.timeout = timeout
        self.conn: Conn | None = None
        self.connection_pool = _SimPool(self)

    async def connect(self) -> None:
        world, node = self.world, self.node
        if world.blocked(self.process, node):
            await asyncio.sleep(self.timeout)
            raise RedisTimeoutError("Timeout connecting to server")
        await asyncio.sleep(2 * world.latency())
        if not node.up:
            raise RedisConnectionError(f"Error 111 connecting to {node.address}. Connection refused.")
        node.client_ids += 1
        self.conn = Conn(node, node.generation, node.client_ids)

    async def round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        if self.conn is None:
            await self.connect()
        assert self.conn is not None
        loop = self.world.loop
        fut: asyncio.Future[Any] = loop.create_future()
        self.world.send(self.process, self.conn, commands, fut)
        timer = loop.call_at(loop.now + self.timeout, _expire, fut, "Timeout reading from socket", context=ROOT)
        try:
            replies: list[Any] = await fut
        except (RedisTimeoutError, RedisConnectionError):
            self.conn = None  # redis-py disconnects after either
            raise
        finally:
            timer.cancel()
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def pipeline(self, transaction: bool = False) -> _SimPipeline:
        return _SimPipeline(self)

    async def execute_command(self, *args: Any) -> Any:
        return (await self.round_trip([args]))[0]

    async def time(self) -> tuple[int, int]:
        result: tuple[int, int] = (await self.round_trip([("TIME",)]))[0]
        return result

    def pubsub(self) -> _SimPubSub:
        return _SimPubSub(self)

    async def aclose(self) -> None:
        self.conn = None


class _SimPool:
    def __init__(self, client: SimClient) -> None:
        self.client = client

    async def get_connection(self, *args: Any) -> Conn:
        if self.client.conn is None:
            await self.client.connect()
        assert self.client.conn is not None
        return self.client.conn

    async def release(self, connection: Conn) -> None:
        return None


class _SimPipeline:
    def __init__(self, client: SimClient) -> None:
        self.client = client
        self.commands: list[tuple[Any, ...]] = []

    def eval(self, script: str, numkeys: int, *keys_and_args: Any) -> _SimPipeline:
        self.commands.append(("EVAL", script, numkeys, *keys_and_args))
        return self

    def execute_command(self, *args: Any) -> _SimPipeline:
        self.commands.append(args)
        return self

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return await self.client.round_trip(self.commands)


class _SimPubSub:
    def __init__(self, client: SimClient) -> None:
        self.client = client
        self.sub: Subscription | None = None

    async def subscribe(self, channel: str) -> None:
        client = self.client
        if client.conn is None:
            await client.connect()
        assert client.conn is not None
        self.sub = Subscription(client.node, client.conn.generation, channel.encode())
        # Redis's confirmation, which the holder channel's subscriber waits for (leasing/presence.py).
        self.sub.queue.append({"type": "subscribe", "pattern": None, "channel": channel.encode(), "data": 1})
        client.world.subscriptions.append(self.sub)

    async def get_message(self, ignore_subscribe_messages: bool = True, timeout: float = 0.0) -> Any:
        sub = self.sub
        if sub is None or sub.broken:
            raise RedisConnectionError("Connection closed by server.")
        while sub.queue:
            message = sub.queue.pop(0)
            if not (ignore_subscribe_messages and message["type"] == "subscribe"):
                return message
        loop = self.client.world.loop
        fut: asyncio.Future[Any] = loop.create_future()
        sub.waiter = fut
        timer = loop.call_at(loop.now + timeout, settle, fut, None, context=ROOT)
        try:
            return await fut
        finally:
            timer.cancel()
            sub.waiter = None

    async def aclose(self) -> None:
        if self.sub is not None:
            self.sub.broken = True
            if self.sub in self.client.world.subscriptions:
                self.client.world.subscriptions.remove(self.sub)
            self.sub = None


class SimFinder:
    """``leasing/nodes.py``'s NodeFinder for the simulation: the node Sentinel names (or, in a
    partition, the old master this process is stuck with)."""

    def __init__(self, world: RedisWorld, process: Any, timeout: float) -> None:
        self.world = world
        self.process = process
        self.timeout = timeout

    async def connect(self) -> tuple[SimClient, str]:
        world = self.world
        node = world.master_for(self.process)
        await asyncio.sleep(2 * world.latency())
        if node is None:
            raise MasterNotFoundError("No master found for 'sim'")
        return SimClient(world, self.process, node, self.timeout), node.address

    async def aclose(self) -> None:
        return None

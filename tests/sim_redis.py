"""The simulator's Redis: what Redis itself would do around the real lease scripts (its clock, its
identity, replicas, restarts, failovers, the network), modelled.

**What is real** is in sim_redis_backend.py: every lease script the daemons send runs, as written in
``katsubushi_py/leasing/scripts.py``, in a real redis-server (one database per simulated node), with its
three reads of Redis's clock and identity (``TIME`` and ``INFO``) answered from the simulated node's.

**What is modelled** is here, in :class:`RedisWorld`: a node's clock (true time plus an offset that
steps), its identity (a new ``run_id`` on every start, a new ``master_replid`` on every promotion),
replication (after every write the master's six keys are DUMPed; a replica applies a write by
RESTOREing them, after its own lag, and ``WAIT`` counts the connected replicas that have applied the
writer's last write), snapshots (a restart loads the master's state as of some moment: an RDB older than
the ttl, the last second lost by an AOF, nothing, or everything), Sentinel (which node the daemons'
finders name), pauses of a node (requests wait, then run), and the network between each daemon and each
node (latency, lost requests and lost replies, partitions).

**The daemons' side** of the connection is in sim_redis_client.py: ``SimClient``, a stand-in for
redis-py's asyncio client with exactly the calls ``leasing/link.py`` makes, and ``SimFinder``, for
``leasing/nodes.py``'s finder. The client hands its requests to :meth:`RedisWorld.send` (replies come
back through :func:`settle`) and its subscriptions to ``RedisWorld.subscriptions``; the finder asks
:meth:`RedisWorld.master_for`. The keeper, its link and its holder are the production code.

Three modules so that each can be read alone: the world follows what Redis does, the client follows
redis-py's interface as the production code uses it, and the backend is the one part that is not a model.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from sim_loop import ROOT, VirtualLoop
from sim_redis_backend import ENV_KEY, SCRIPT_NAMES, Backend

from katsubushi_py.leasing import scripts as lease_scripts

Dumps = tuple[bytes | None, ...]


@dataclass
class _Waiter:
    """A ``WAIT`` in progress on a master."""

    index: int
    needed: int
    reply: Callable[[int], None]
    done: bool = False


@dataclass(eq=False)
class Node:
    """One simulated redis-server (a database of the backend)."""

    name: str
    db: int
    run_id: str
    replid: str
    clock_offset: float = 0.0  # Redis TIME minus true time, seconds
    # Redis keeps the replication id a promoted replica had (its master's) as master_replid2; a new
    # process, or a master creating its backlog, has none (all zeros). The scripts tell a promotion from
    # the backlog's new id by it.
    replid2: str = "0" * 40
    role: str = "master"
    up: bool = True
    paused_until: float = 0.0
    generation: int = 0  # a new process (a restart) or a role change: connections to the old one are gone
    client_ids: int = 2
    # As a master: writes since it started or was promoted, the state after each (for replicas and
    # snapshots), its replicas and the WAITs in progress.
    index: int = 0
    history: list[tuple[float, int, Dumps]] = field(default_factory=list)
    replicas: list[Node] = field(default_factory=list)
    waiters: list[_Waiter] = field(default_factory=list)
    # As a replica.
    master: Node | None = None
    link_up: bool = True
    applied: int = 0
    slow: bool = False  # applies writes after up to a second and a half, not in a millisecond
    # As a master: when each replica first attached since this node became master (started, promoted),
    # and the replicas a lease write's replica count (``replica_count`` in the scripts) has seen connected.
    joined: dict[str, float] = field(default_factory=dict)
    counted: set[str] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.name}:6379"

    def connected_replicas(self) -> list[Node]:
        return [r for r in self.replicas if r.up and r.link_up and r.master is self]


@dataclass
class Conn:
    node: Node
    generation: int
    client_id: int
    last_write: int = 0


@dataclass
class Subscription:
    """A client's SUBSCRIBE on one node (sim_redis_client.py's pubsub): the world delivers messages into
    ``queue``, or to ``waiter`` when a ``get_message`` waits."""

    node: Node
    generation: int
    channel: bytes
    queue: list[dict[str, Any]] = field(default_factory=list)
    waiter: asyncio.Future[Any] | None = None
    broken: bool = False


class RedisWorld:
    """The simulated Redis nodes, Sentinel's view of them, and the network to them."""

    def __init__(self, loop: VirtualLoop, rng: random.Random, backend: Backend, keys: list[str], base: float) -> None:
        self.loop = loop
        self.rng = rng
        self.backend = backend
        self.keys = keys
        self.base = base  # the unix time that true time 0 is
        self.nodes: list[Node] = []
        self.master: Node | None = None  # the node Sentinel names (None while it names none)
        self.subscriptions: list[Subscription] = []
        # Per process: (the node it is stuck with in a partition, or None), and its network outages.
        self.pinned: dict[Any, Node] = {}
        self.partitioned: Node | None = None  # the old master on the far side of a partition
        self.lost_reply_rate = 0.0
        self.lost_request_rate = 0.0
        self.slow_rate = 0.0  # a reply delayed past the socket timeout
        self.script_errors: list[str] = []
        self.last_clean_release = -1e9  # true time of the last clean release (the rollback fault's condition)
        self.writes = 0
        self.scripts = 0

    def hex_id(self) -> str:
        return f"{self.rng.getrandbits(160):040x}"

    # -- nodes -----------------------------------------------------------------------------------
    def add_node(self, clock_offset: float = 0.0) -> Node:
        db = len(self.nodes)
        node = Node(f"node{db}", db, self.hex_id(), self.hex_id(), clock_offset)
        self.backend.client(db).flushdb()
        self.nodes.append(node)
        if self.master is None:
            self.master = node
            node.history = [(self.loop.now, 0, self.read(node))]
        else:
            self.attach(node, self.master)
        return node

    def redis_time(self, node: Node) -> float:
        return self.base + self.loop.now + node.clock_offset

    def read(self, node: Node) -> Dumps:
        pipe = self.backend.client(node.db).pipeline(transaction=False)
        for key in self.keys:
            pipe.dump(key)
        return tuple(pipe.execute())

    def write(self, node: Node, dumps: Dumps) -> None:
        pipe = self.backend.client(node.db).pipeline(transaction=False)
        pipe.delete(*self.keys)
        for key, blob in zip(self.keys, dumps, strict=True):
            if blob is not None:
                pipe.restore(key, 0, blob)
        pipe.execute()

    def state_at(self, node: Node, true_time: float) -> Dumps:
        """The master's data as of ``true_time`` (what a snapshot taken then holds)."""
        chosen = node.history[0][2]
        for when, _, dumps in node.history:
            if when > true_time:
                break
            chosen = dumps
        return chosen

    def _written(self, node: Node) -> None:
        """After a script on a master: record the state, and send it to the replicas."""
        dumps = self.read(node)
        if node.history and node.history[-1][2] == dumps:
            return
        self.writes += 1
        node.index += 1
        node.history.append((self.loop.now, node.index, dumps))
        # Keep a minute of history (snapshots are at most seconds old), and what a replica still needs.
        horizon = self.loop.now - 60.0
        while len(node.history) > 2 and node.history[1][0] < horizon:
            node.history.pop(0)
        for replica in node.connected_replicas():
            lag = self.rng.uniform(0.05, 1.5) if replica.slow else self.rng.uniform(0.0002, 0.002)
            self.loop.call_at(self.loop.now + lag, self._apply, replica, node, node.index, context=ROOT)

    def _apply(self, replica: Node, master: Node, index: int) -> None:
        if replica.master is not master or not replica.up or not replica.link_up or not master.up:
            return
        if index <= replica.applied:
            return
        for _when, i, dumps in reversed(master.history):
            if i <= index:
                self.write(replica, dumps)
                replica.applied = i
                break
        self._check_waiters(master)

    def attach(self, replica: Node, master: Node) -> None:
        """A replica (re)connects to its master: a full resync."""
        if replica not in master.replicas:
            master.replicas.append(replica)
        replica.master = master
        replica.role = "replica"
        replica.link_up = True
        master.joined.setdefault(replica.name, self.loop.now)
        self.write(replica, master.history[-1][2] if master.history else self.read(master))
        replica.applied = master.index
        self._check_waiters(master)

    def _check_waiters(self, master: Node) -> None:
        for waiter in list(master.waiters):
            acked = sum(1 for r in master.connected_replicas() if r.applied >= waiter.index)
            if acked >= waiter.needed:
                self._finish_wait(master, waiter, acked)

    def _finish_wait(self, master: Node, waiter: _Waiter, acked: int) -> None:
        if waiter.done:
            return
        waiter.done = True
        if waiter in master.waiters:
            master.waiters.remove(waiter)
        waiter.reply(acked)

    def stop_node(self, node: Node) -> None:
        """The process dies: connections reset, subscriptions gone, WAITs never answered."""
        node.up = False
        node.generation += 1
        node.waiters.clear()
        for sub in self.subscriptions:
            if sub.node is node:
                self._break(sub)
        self.subscriptions = [sub for sub in self.subscriptions if not sub.broken]

    def start_node(self, node: Node, dumps: Dumps) -> None:
        """A new process on the node with ``dumps`` as its data (a master: its replicas resync from it)."""
        node.up = True
        node.paused_until = 0.0
        node.generation += 1
        node.run_id = self.hex_id()
        node.client_ids = 2
        self.write(node, dumps)
        if node.role == "master":
            node.replid = self.hex_id()
            node.replid2 = "0" * 40
            node.joined = {}
            node.counted = set()
            node.index = 0
            node.history = [(self.loop.now, 0, dumps)]
            for replica in list(node.replicas):
                if replica.up and replica.master is node:
                    self.attach(replica, node)
        elif node.master is not None:
            self.attach(node, node.master)

    def promote(self, replica: Node) -> None:
        """Sentinel promotes ``replica``: a new replication id, its own data, the other replicas follow."""
        old = replica.master
        if old is not None and replica in old.replicas:
            old.replicas.remove(replica)
        replica.role = "master"
        replica.master = None
        replica.replid2 = old.replid if old is not None else replica.replid
        replica.replid = self.hex_id()
        replica.generation += 1
        replica.index = 0
        replica.history = [(self.loop.now, 0, self.read(replica))]
        replica.replicas = []
        replica.joined = {}
        replica.counted = set()
        for other in self.nodes:
            if other is not replica and other.role == "replica" and other.up and other.master is old:
                if old is not None and other in old.replicas:
                    old.replicas.remove(other)
                self.attach(other, replica)
        self.master = replica

    def demote(self, node: Node, master: Node) -> None:
        """Sentinel turns a returning old master into a replica of the new one: its data replaced."""
        node.role = "replica"
        node.generation += 1
        node.waiters.clear()
        node.history = []
        node.replicas = []
        for sub in self.subscriptions:
            if sub.node is node:
                self._break(sub)
        self.attach(node, master)

    # -- scripts -----------------------------------------------------------------------------------
    def run_script(self, node: Node, text: str, keys: list[Any], args: list[Any]) -> Any:
        """Run one of the lease scripts on ``node`` now (the simulated TIME and INFO), and replicate."""
        now = self.redis_time(node)
        seconds = math.floor(now)
        server, replication = self.backend.info(node.run_id, node.replid, len(node.connected_replicas()), node.replid2)
        env: dict[str, Any] = {"s": seconds, "us": int((now - seconds) * 1e6), "server": server}
        env["replication"] = replication
        # The holder channels' subscribers on this node (what PUBSUB NUMSUB counts): stale ones included.
        for sub in self.subscriptions:
            if sub.node is node and not sub.broken:
                key = "sub:" + sub.channel.decode()
                env[key] = env.get(key, 0) + 1
        pipe = self.backend.client(node.db).pipeline(transaction=False)
        pipe.delete(ENV_KEY)
        pipe.hset(ENV_KEY, mapping=env)
        pipe.evalsha(self.backend.sha[text], len(keys), *keys, *args)
        replies = pipe.execute(raise_on_error=False)
        self.scripts += 1
        result = replies[2]
        if node.role == "master" and "replica_count(" in text:  # a lease write's count, or REPLICAS_LUA
            node.counted.update(r.name for r in node.connected_replicas())
        if isinstance(result, Exception):
            name = next(n for n in SCRIPT_NAMES if getattr(lease_scripts, n) == text)
            self.script_errors.append(f"{name} on {node.name} at {self.loop.now:.3f}: {result}")
            self._written(node)
            raise result
        self._written(node)
        return result

    # -- the network -------------------------------------------------------------------------------
    def latency(self) -> float:
        return self.rng.uniform(0.0001, 0.0015)

    def blocked(self, process: Any, node: Node) -> bool:
        if process.net_down_until > self.loop.now:
            return True
        pinned = self.pinned.get(process)
        if pinned is not None:
            return node is not pinned
        return node is self.partitioned

    def master_for(self, process: Any) -> Node | None:
        return self.pinned.get(process) or self.master

    def send(self, process: Any, conn: Conn, commands: list[tuple[Any, ...]], fut: asyncio.Future[Any]) -> None:
        if self.blocked(process, conn.node) or self.rng.random() < self.lost_request_rate:
            return  # lost: the client times out
        self.loop.call_at(self.loop.now + self.latency(), self._arrive, process, conn, commands, fut, context=ROOT)

    def _reply(self, process: Any, conn: Conn | None, fut: asyncio.Future[Any], value: Any) -> None:
        if conn is not None and (self.blocked(process, conn.node) or self.rng.random() < self.lost_reply_rate):
            return
        delay = self.latency()
        if self.rng.random() < self.slow_rate:
            delay += self.rng.uniform(0.2, 1.5)
        self.loop.call_at(self.loop.now + delay, settle, fut, value, context=ROOT)

    def _arrive(self, process: Any, conn: Conn, commands: list[tuple[Any, ...]], fut: asyncio.Future[Any]) -> None:
        node = conn.node
        if node.paused_until > self.loop.now:  # the request waits in the socket until the node runs again
            self.loop.call_at(node.paused_until, self._arrive, process, conn, commands, fut, context=ROOT)
            return
        if not node.up or node.generation != conn.generation:
            self._reply(process, None, fut, RedisConnectionError("Connection closed by server."))
            return
        replies: list[Any] = []
        wait: tuple[Any, ...] | None = None
        for i, command in enumerate(commands):
            name = str(command[0]).upper()
            if name == "WAIT":
                if i != len(commands) - 1:
                    raise NotImplementedError("the simulation answers WAIT only last in a pipeline")
                wait = command
            elif name == "EVAL":
                replies.append(self._eval(process, conn, command))
            elif name == "CLIENT" and str(command[1]).upper() == "ID":
                replies.append(conn.client_id)
            elif name == "TIME":
                now = self.redis_time(node)
                replies.append((math.floor(now), int((now - math.floor(now)) * 1e6)))
            else:
                raise NotImplementedError(f"the simulation does not answer {command!r}")
        if wait is None:
            self._reply(process, conn, fut, replies)
            return
        needed = int(wait[1])

        def answer(acked: int) -> None:
            if conn.generation == node.generation and node.up:
                self._reply(process, conn, fut, [*replies, acked])

        waiter = _Waiter(conn.last_write, needed, answer)
        acked = sum(1 for r in node.connected_replicas() if r.applied >= waiter.index)
        if acked >= needed:
            waiter.done = True
            answer(acked)
            return
        node.waiters.append(waiter)

        def timeout() -> None:
            count = sum(1 for r in node.connected_replicas() if r.applied >= waiter.index)
            self._finish_wait(node, waiter, count)

        self.loop.call_at(self.loop.now + int(wait[2]) / 1000, timeout, context=ROOT)

    def _eval(self, process: Any, conn: Conn, command: tuple[Any, ...]) -> Any:
        node = conn.node
        text, numkeys = command[1], int(command[2])
        keys, args = list(command[3 : 3 + numkeys]), list(command[3 + numkeys :])
        if node.role != "master":
            return ResponseError("READONLY You can't write against a read only replica.")
        try:
            result = self.run_script(node, text, keys, args)
        except ResponseError as exc:
            return exc
        conn.last_write = node.index
        if text == lease_scripts.RELEASE_LUA and args[4] == "clean" and int(result[0]) == 1:
            self.publish(node, str(args[9]).encode(), str(args[1]).encode())
            self.last_clean_release = self.loop.now
        return result

    # -- release announcements ---------------------------------------------------------------------
    def publish(self, node: Node, channel: bytes, data: bytes) -> None:
        for sub in self.subscriptions:
            if sub.node is node and sub.channel == channel and not sub.broken:
                message = {"type": "message", "pattern": None, "channel": channel, "data": data}
                self.loop.call_at(self.loop.now + self.latency(), self._deliver, sub, message, context=ROOT)

    def _deliver(self, sub: Subscription, message: dict[str, Any]) -> None:
        if sub.broken:
            return
        if sub.waiter is not None and not sub.waiter.done():
            sub.waiter.set_result(message)
        else:
            sub.queue.append(message)

    def _break(self, sub: Subscription) -> None:
        sub.broken = True
        if sub.waiter is not None and not sub.waiter.done():
            sub.waiter.set_exception(RedisConnectionError("Connection closed by server."))


def settle(fut: asyncio.Future[Any], value: Any) -> None:
    """Settle a client's pending future with ``value`` (an exception is raised in it), unless it is settled
    already (a request timed out, a message arrived before a ``get_message`` timed out)."""
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)

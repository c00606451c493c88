"""A holder's presence in Redis: a subscription to its id's holder channel (``{ns}:holder:<id>``), kept
from right after its acquire until right before its release, on a connection of its own to the node the
lease's scripts run on.

Why: a rollback of Redis's data in place (``DEBUG RELOAD`` of an older RDB, ``FLUSHALL`` and
``RESTORE`` of a backup) keeps ``run_id`` and ``master_replid``, so nothing tells a script that writes
were lost; what survives it is connection state. A live holder whose acquire (or whose renews) the
rollback undid still has its subscription, and the acquire script skips an id that looks free while
someone is subscribed to its channel, and opens the doubt window (see ``subscribers`` and ``held_live``
in scripts.py, and docs/leasing.md for the argument).

The order that makes it work: subscribe (and see Redis confirm it) before the lease's first renew, and
serve only after that renew; the first renew counts the channel's subscribers, so of two claimants of
one id the later first renew sees both and stops its holder. A subscription that dropped is made again
before the next renew, and that renew is sent at once (``on_drop``), so a holder is absent from its
channel for as short a time as its connection is.

Sharded pub/sub (``SSUBSCRIBE``, Redis >= 7) where the server has it, so that a Redis Cluster counts the
subscription on the node of the pool's slot; classic ``SUBSCRIBE`` where it does not (Redis 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from .link import NotSent, RedisLink
from .nodes import NodeFinder
from .target import RedisTarget, holder_prefix
from .timings import describe

log = logging.getLogger("katsubushi_py")

# How long a subscription may take to be confirmed before the holder counts it as not made.
_CONFIRM_TIMEOUT = 2.0
_KINDS = {b"ssubscribe", b"subscribe", "ssubscribe", "subscribe"}


class Presence:
    """One subscription at a time: the current lease's id, on the node ``address`` names."""

    def __init__(self, target: RedisTarget, finder: Callable[[], NodeFinder], on_drop: Callable[[], None]) -> None:
        self.prefix = holder_prefix(target)
        self.finder = finder  # the link's: what it learned of the nodes (sentinels, the cluster's map)
        self.on_drop = on_drop  # the subscription dropped: renew as soon as it is back
        self.worker_id = -1  # the id subscribed to (-1: none)
        self.address = ""  # the node it is subscribed on
        self.sharded = True  # until a server says it has no SSUBSCRIBE
        self._client: Any = None
        self._pubsub: Any = None
        self._watch: asyncio.Task[None] | None = None
        # A connection made ahead (prepare), for the next hold: (client, pubsub, node address).
        self._ready: tuple[Any, Any, str] | None = None

    def channel(self, worker_id: int) -> str:
        return f"{self.prefix}{worker_id}"

    def holds(self, worker_id: int, address: str) -> bool:
        """Subscribed to ``worker_id``'s channel on ``address`` (the node the lease scripts run on)."""
        return self._pubsub is not None and self.worker_id == worker_id and self.address == address

    async def ensure(self, worker_id: int, link: RedisLink) -> None:
        """Subscribed to ``worker_id``'s channel on the node ``link``'s renew goes to, before it goes (a
        new lease's first renew, after the subscription dropped, after a failover). Raises NotSent when
        that cannot be done: the renew must then not be sent."""
        try:
            await link.connected()
            held = self.holds(worker_id, link.address)
            if not held and await self.hold(worker_id) != link.address:
                raise ConnectionError("the holder channel's node is not the lease's: the master changed")
        except NotSent:
            raise
        except Exception as exc:
            raise NotSent(f"holder channel subscription: {describe(exc)}") from exc

    async def prepare(self) -> None:
        """Connect ahead, while waiting for a free id, so that a handover pays one round trip (the
        subscription) instead of a new connection too; and learn whether the node has sharded pub/sub.
        Best effort: the next hold connects anew if this fails or the node changed meanwhile."""
        if self._ready is not None:
            return
        try:
            client, address = await self.finder().connect()
        except Exception:
            return
        pubsub = client.pubsub()
        try:
            if hasattr(pubsub, "connect"):
                await pubsub.connect()
            if self.sharded and hasattr(pubsub, "ssubscribe"):
                try:
                    await client.execute_command("PUBSUB", "SHARDNUMSUB")
                except Exception as exc:
                    if "unknown" in str(exc).lower():
                        self.sharded = False  # Redis 6: no sharded pub/sub
        except Exception:
            await self._discard(client, pubsub)
            return
        self._ready = (client, pubsub, address)

    @staticmethod
    async def _discard(client: Any, pubsub: Any) -> None:
        for closing in (pubsub, client):
            with contextlib.suppress(Exception):
                await closing.aclose()

    async def hold(self, worker_id: int) -> str:
        """Subscribe to ``worker_id``'s channel (dropping any other subscription first) and return once
        Redis confirmed it, with the node's address. Raises when that cannot be done."""
        await self.release()
        ready, self._ready = self._ready, None
        if ready is not None:
            client, pubsub, address = ready
            try:
                pubsub = await self._subscribe(client, self.channel(worker_id), pubsub)
            except Exception:
                await self._discard(client, pubsub)  # gone stale while we waited: connect anew
            else:
                return self._held(worker_id, client, pubsub, address)
        client, address = await self.finder().connect()
        try:
            pubsub = await self._subscribe(client, self.channel(worker_id))
        except BaseException:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise
        return self._held(worker_id, client, pubsub, address)

    def _held(self, worker_id: int, client: Any, pubsub: Any, address: str) -> str:
        self._client, self._pubsub = client, pubsub
        self.worker_id, self.address = worker_id, address
        self._watch = asyncio.ensure_future(self._watch_drop(pubsub))
        return address

    async def _subscribe(self, client: Any, channel: str, pubsub: Any = None) -> Any:
        pubsub = pubsub if pubsub is not None else client.pubsub()
        if self.sharded and hasattr(pubsub, "ssubscribe"):
            try:
                await pubsub.ssubscribe(channel)
                await self._confirmed(pubsub)
                return pubsub
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                if "unknown command" not in str(exc).lower():
                    raise
                self.sharded = False  # Redis 6: no sharded pub/sub
            pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            await self._confirmed(pubsub)
        except BaseException:
            with contextlib.suppress(Exception):
                await pubsub.aclose()
            raise
        return pubsub

    @staticmethod
    async def _confirmed(pubsub: Any) -> None:
        """Until Redis's confirmation of the subscription arrives: only then does a script count it."""
        loop = asyncio.get_running_loop()
        end = loop.time() + _CONFIRM_TIMEOUT
        while (left := end - loop.time()) > 0:
            message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=left)
            if message is not None and message.get("type") in _KINDS:
                return
        raise TimeoutError("the holder channel subscription was not confirmed")

    async def _watch_drop(self, pubsub: Any) -> None:
        """Read the subscription's connection, so that its loss is seen at once (nothing is published)."""
        try:
            while self._pubsub is pubsub:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        except asyncio.CancelledError:
            raise
        except Exception:
            if self._pubsub is pubsub:
                await self._close()
                log.warning("worker id %d: holder channel subscription dropped; renewing at once", self.worker_id)
                self.on_drop()

    async def _close(self) -> None:
        pubsub, client, self._pubsub, self._client = self._pubsub, self._client, None, None
        for closing in (pubsub, client):
            if closing is not None:
                with contextlib.suppress(Exception):
                    await closing.aclose()

    async def release(self, everything: bool = False) -> None:
        """Unsubscribe (before the release script runs, so the next holder's acquire does not see us);
        ``everything``: the connection made ahead too (the daemon stops)."""
        watch, self._watch = self._watch, None
        await self._close()
        if everything and self._ready is not None:
            ready, self._ready = self._ready, None
            await self._discard(ready[0], ready[1])
        if watch is not None and watch is not asyncio.current_task():
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch

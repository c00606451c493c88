"""The keeper's connection to Redis: running a script (and ``WAIT`` for replicas) in one round trip,
noticing when the connection under it changed, following the master (:mod:`.nodes`), waiting for a
release to be announced, and the clock check at start.

**Replicas: how many acknowledgements a lease write needs.** A lease write counts (an acquire is
served, a renew moves the deadline) only once enough replicas acknowledged it (``WAIT``, pipelined on
the same connection as the script), so that a replica promoted after the master is lost holds every
lease that was served under. How many:

- ``replica_acks=N`` in the URL: N (0: none).
- Else, the master's ``min-replicas-to-write`` M when it is at least 1 (read by :mod:`.settings` at
  start and again while running): ``WAIT M``. Redis itself refuses every write unless M replicas are
  connected and lag less than ``min-replicas-max-lag``, so a master cut off from its replicas (the old
  master on the wrong side of a partition) stops taking writes, and a write on M replicas is on one
  Sentinel promotes (it promotes the replica with the most of the master's stream). A master with
  more replicas than M loses one, or has one resync for minutes after a failover, without a failed
  lease write; a master with exactly M that loses one refuses writes (``NOREPLICAS``), and its
  daemons stop when their leases run out (docs/leasing.md).
- Else (M is 0 and the URL said ``allow=no-min-replicas``, or the master has no replica, or CONFIG
  cannot be read): every replica the master has had since it last started or was promoted, the
  safe fallback. The number is the most replicas that master has had connected, recorded in the
  pool under the master's identity (``REPLICAS_LUA``): a replica that disconnects, or a link that is
  cut, lowers nothing, so a master cut off from its replicas cannot confirm a single lease. A new
  master (a promotion, a restart) starts from its own count. Its price: one replica down stops every
  lease write, and so the fleet, within a ttl.

**The every-replica count is read by the write itself**: the acquire and renew scripts run as
``COUNTED`` versions that read ``connected_slaves`` after their write, in the same atomic run, record
it, and return the count with their reply; the ``WAIT`` pipelined with the script waits for the count
the last write returned, and a write whose own count is higher (a replica joined since; the first
write on a connection) waits again for all of them (a second round trip) before it counts. So a write
is never counted as acknowledged by fewer replicas than the master had when it was written. What
remains: a replica that joins a master and is cut off from it before any lease write ran there was
never counted (``min-replicas-to-write`` closes that, which is why start-up refuses M = 0 beside
replicas unless told otherwise).

What that buys: every write the keeper counted is on the replicas that can be promoted, so whichever
of them is promoted holds every confirmed lease and renew; a write that was not acknowledged was never
served under, and the holder remembers the marks it may have left (see ``holder``).

**A new connection may be a new Redis.** ``CLIENT ID`` rides in the same pipeline: a different id
means the client reconnected, perhaps to a restarted or promoted Redis, and the keeper then asks the
pool to compare the Redis it was written under with this one (see ``IDENTITY_LUA``), so that a restart
is seen within a round trip of the first holder reconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from typing import TYPE_CHECKING, Any

from .nodes import NodeFinder
from .scripts import COUNTED
from .target import LeaseError, RedisTarget, released_channel
from .timings import LeaseTimings, describe

if TYPE_CHECKING:
    from collections.abc import Callable

    from .recovery import LeaseStats

log = logging.getLogger("katsubushi_py")


class NotSent(ConnectionError):
    """No connection to the node could be made (or the node could not be found): nothing was sent, so
    the write certainly did not happen."""


# A master that refuses writes while fewer replicas than its min-replicas-to-write are connected (the
# reply's text, wherever the client wraps it: a script's error inside a pipeline's).
_NOREPLICAS = re.compile(r"NOREPLICAS[^'\"]*")


def refusal(where: str, exc: BaseException) -> str:
    """Why Redis at ``where`` refused a write although it answered, or "": ``NOREPLICAS`` is a master
    up and reachable whose ``min-replicas-to-write`` is not met (a replica down, or cut off for longer
    than ``min-replicas-max-lag``): what to fix is the replicas, not the network."""
    found = _NOREPLICAS.search(describe(exc))
    if found is None:
        return ""
    return (
        f"Redis at {where} refuses writes: fewer replicas than min-replicas-to-write are connected"
        f" ({found.group(0).strip()})"
    )


def trouble(where: str, exc: BaseException) -> str:
    """What a failed round trip to Redis at ``where`` means, for the log and the fence's reason."""
    return refusal(where, exc) or f"Redis at {where} unreachable ({describe(exc)})"


# Round trips of the clock check: the one with the shortest round trip tells the offset best.
_CLOCK_SAMPLES = 3


class RedisLink:
    def __init__(self, target: RedisTarget, timings: LeaseTimings, stats: LeaseStats) -> None:
        self.target = target
        self.keys = target.keys()
        self.channel = released_channel(target)
        self.timings = timings
        self.stats = stats  # counts round trips
        self.client: Any = None
        self.connection_id: int | None = None  # CLIENT ID of the connection the last script ran on
        self.finder = NodeFinder(target, timeout=max(0.5, timings.renew / 2))
        self.address = ""  # the node the client talks to (host:port), "" before the first connection
        self._fresh = False  # a client not connected yet
        self._replicas: int | None = None  # the master's replica count at the last counted write
        self._whole = True  # the next count compares the master's whole identity (a new connection)
        self._pubsub: Any = None
        # The master's min-replicas-to-write, as :mod:`.settings` last read it (None: not read, or unreadable).
        self.min_replicas: int | None = None

    async def get(self) -> Any:
        if self.client is None:
            self.client, address = await self.finder.connect()
            self._fresh = True
            self._replicas = None  # a new connection may be a new master: ask again
            self._whole = True
            if address != self.address:
                if self.address:
                    self.stats.master_changes += 1
                    where = self.target.display
                    log.warning("Redis master for %s changed: %s -> %s; following it", where, self.address, address)
                self.address = address
                self.stats.redis_address = address
        return self.client

    async def connected(self) -> Any:
        """The client, connected to the node: raises :class:`NotSent` when a new client cannot find the
        node or connect to it, so that a caller knows nothing was sent. (Only for a new client: a failed
        round trip drops the client, so every retry after a failure comes here; on a client in use the
        check would cost a tenth of a renew's client time.)"""
        try:
            client = await self.get()
            if self._fresh:
                pool = client.connection_pool
                connection = await pool.get_connection()
                await pool.release(connection)  # the pipeline takes this very connection next
                self._fresh = False
        except Exception as exc:
            raise NotSent(describe(exc)) from exc
        return client

    async def close(self) -> None:
        """Drop the connection and what the finder keeps (Sentinel and cluster clients)."""
        await self.drop()
        with contextlib.suppress(Exception):
            await self.finder.aclose()

    async def drop(self) -> None:
        client, self.client = self.client, None
        await self.unsubscribe()
        if client is not None:
            with contextlib.suppress(Exception):
                await client.aclose()

    async def run(self, script: str, args: list[Any], durable: bool = True) -> tuple[list[Any], str, bool]:
        """Run a script and, with ``durable``, WAIT for the replicas it must reach (see the module's
        docstring): one round trip (the script and the WAIT pipelined on one connection), two when the
        master had more replicas at the write than were waited for (a connection's first write, a
        replica that joined). Raises :class:`NotSent` when no connection could be made.

        Returns (result, problem, new_connection): ``problem`` is "" or why the write cannot be counted
        as durable; ``new_connection`` whether it ran on another connection than the last script."""
        client = await self.connected()
        keys = self.keys.all
        wait_ms = int(self.timings.renew * 250)
        fixed = self.acks_needed()
        count = durable and fixed is None  # the script counts the master's replicas itself (COUNTED)
        waited = fixed if fixed is not None else (self._replicas or 0)
        if fixed is not None:
            self.stats.replicas_expected = fixed
        pipe = client.pipeline(transaction=False)
        whole = count and self._whole  # on a connection's first write (see scripts.counted)
        if count:
            pipe.eval(COUNTED[script], len(keys), *keys, *args, "1" if whole else "0")
        else:
            pipe.eval(script, len(keys), *keys, *args)
        pipe.execute_command("CLIENT", "ID")
        if durable and waited:
            pipe.execute_command("WAIT", waited, wait_ms)
        replies = await pipe.execute()
        self.stats.round_trips += 1
        result = replies[0]
        connection = int(replies[1])
        new_connection, self.connection_id = connection != self.connection_id, connection
        if whole:
            self._whole = False
        if new_connection and not whole:
            self._whole = True  # reconnected under the client (perhaps to another process)
        if not durable:
            return result, "", new_connection
        acked = int(replies[2]) if waited else 0
        needed = waited
        if count:
            # The replicas the master had when it wrote (read in the same atomic run): what counts. More
            # than were waited for (a replica joined; the first write on a connection): wait for them all.
            needed, result = int(result[0]), result[1]
            self._replicas = needed
            self.stats.replicas_expected = needed
            if needed > waited and acked < needed:
                acked = int(await client.execute_command("WAIT", needed, wait_ms))
                self.stats.round_trips += 1
        if acked < needed:
            self.stats.replica_ack_failures += 1
            return result, f"only {acked} of {needed} replicas acknowledged it within {wait_ms} ms", new_connection
        return result, "", new_connection

    def acks_needed(self) -> int | None:
        """The acknowledgements a lease write waits for: the URL's ``replica_acks``, else the master's
        ``min-replicas-to-write`` when it is set, else None (every replica the master has had)."""
        if self.target.replica_acks is not None:
            return self.target.replica_acks
        return self.min_replicas if self.min_replicas else None

    # -- the clock at start ----------------------------------------------------------------------
    async def clock_offset(self, skew_max: float, local: Callable[[], float] | None = None) -> tuple[float, float]:
        """Local wall clock (``local``, unix seconds) minus Redis TIME, in seconds, and the round trip it
        was judged by; refuse to go on above ``skew_max``.

        The offset is known only to within half the round trip (Redis read its clock somewhere in it),
        so it is judged by the sample with the shortest round trip, and what counts is the least the
        offset can be: a busy event loop (a long round trip) alone never looks like a skew."""
        local = local or time.time
        client = await self.get()
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(_CLOCK_SAMPLES):
            sent_wall, sent = local(), time.perf_counter()
            seconds, micros = await client.time()
            rtt = time.perf_counter() - sent
            offset = sent_wall + rtt / 2 - (seconds + micros / 1e6)
            if best is None or rtt < best[0]:
                best = (rtt, offset)
        assert best is not None
        rtt, skew = best
        if abs(skew) - rtt / 2 > skew_max:
            raise LeaseError(
                f"local clock differs from Redis TIME by {skew:+.3f}s (more than --clock-skew-max"
                f" {skew_max:g}s): fix NTP on this host or on Redis before leasing a worker id"
            )
        return skew, rtt

    # -- waiting for a release -------------------------------------------------------------------
    async def unsubscribe(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def wait_for_release(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early when a release is announced. The first call only
        subscribes (the caller then tries again at once, so a release between its last try and the
        subscription is not missed)."""
        if self._pubsub is None:
            try:
                client = await self.get()
                pubsub = client.pubsub()
                await pubsub.subscribe(self.channel)
                self._pubsub = pubsub
                return
            except Exception:
                await self.unsubscribe()  # no subscription: poll instead
                await asyncio.sleep(seconds)
                return
        end = time.monotonic() + seconds
        try:
            while (left := end - time.monotonic()) > 0:
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
                if message is not None:
                    await asyncio.sleep(random.uniform(0, 0.05))  # not all waiters in the same millisecond
                    return
        except Exception:
            await self.unsubscribe()

"""The Redis settings a lease relies on: refused at start when they cannot be safe, checked again while
the daemon runs, and the one that decides how many replicas a lease write waits for (issue 32).

- **min-replicas-to-write** (M). A master with replicas confirms a lease only once the write is on
  replicas too (``WAIT``): else a replica promoted after a crash or a partition would not know the
  lease, and hand its id out again while its holder still issues. Redis's own guarantee is
  ``min-replicas-to-write``: the master refuses every write unless M replicas are connected and lag
  less than ``min-replicas-max-lag``, so a master cut off from its replicas stops taking writes within
  that lag. So with M set, a lease write waits for M acknowledgements (``WAIT M``), and one replica
  more than M can be lost, or resync for minutes, without a failed request. With M = 0 there is
  nothing to stand on (a replica that joined and was cut off before any lease write saw it is a
  second master nobody knows of): a master with replicas, or any Sentinel master, whose M is 0 is
  refused at start unless the URL says ``allow=no-min-replicas``; with that, or with CONFIG
  unreadable, a write waits for every replica the master has had (the rule before: :mod:`.link`).
- **maxmemory-policy** ``allkeys-*`` evicts lease records when memory runs out: a lease forgotten
  while its holder issues. Refused unless ``allow=evicting``. ``volatile-*`` policies evict only keys
  with a TTL, and no lease key has one: allowed.

Where ``CONFIG`` is renamed or forbidden (an ACL), nothing can be checked: one warning names the
settings the operator must check, and the daemon goes on with the every-replica rule.

The result is in STATS and the metrics (``lease_redis_settings_*``, ``lease_redis_replicas_*``), read
again every minute, after the master changed and after a lease write the replicas did not acknowledge:
a master short of its M replicas is logged (one line) and alerted on before any holder stops, as
holders ride their fence for the rest of their ttl.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .nodes import connect
from .target import LeaseRefused, RedisTarget
from .timings import describe

if TYPE_CHECKING:
    from .link import RedisLink

log = logging.getLogger("katsubushi_py")

# How often the settings are read again while running, and at most how often a failed write forces it.
RECHECK_INTERVAL = 60.0
_FORCED_MIN_INTERVAL = 2.0


@dataclass(frozen=True)
class RedisSettings:
    """What one master said. ``min_replicas`` and ``policy`` are None when CONFIG could not be read
    (``unreadable`` says why); ``good`` is the replicas Redis counts for min-replicas-to-write (those
    lagging less than min-replicas-max-lag), or the connected ones when it counts none."""

    min_replicas: int | None
    max_lag: int | None
    policy: str | None
    replicas: int
    good: int
    unreadable: str = ""

    def problems(self, target: RedisTarget, where: str) -> list[str]:
        """The unsafe settings the URL does not accept, one sentence each."""
        found = []
        if self.min_replicas == 0 and (self.replicas > 0 or target.sentinel) and "no-min-replicas" not in target.allow:
            has = "a Sentinel master" if target.sentinel else f"a master with {self.replicas} replica(s)"
            found.append(
                f"min-replicas-to-write is 0 on {where}, {has}: a replica cut off from it could be promoted"
                " without the leases it confirmed alone, and hand their ids out again (duplicates). Set"
                " min-replicas-to-write 1 (or more) and min-replicas-max-lag on every node (docs/leasing.md),"
                " or add allow=no-min-replicas to the URL to accept it"
            )
        if self.policy is not None and self.policy.startswith("allkeys-") and "evicting" not in target.allow:
            found.append(
                f"maxmemory-policy is {self.policy} on {where}: Redis would evict lease records when memory"
                " runs out, a lease forgotten while its holder issues (duplicates). Use noeviction (or a"
                " volatile-* policy: lease keys have no TTL), or add allow=evicting to the URL to accept it"
            )
        return found


def _config(reply: Any, name: str) -> str | None:
    if isinstance(reply, BaseException) or not isinstance(reply, dict):
        return None
    value = reply.get(name, reply.get(name.encode()))
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _info_field(info: str, name: str) -> int | None:
    found = re.search(rf"^{name}:(\d+)", info, re.MULTILINE)
    return int(found.group(1)) if found else None


async def read_settings(client: Any) -> RedisSettings:
    """``CONFIG GET`` of the three settings and ``INFO replication``, in one round trip. CONFIG refused
    (renamed, forbidden by an ACL) is not an error: the settings are then unknown (None). A connection
    error is raised."""
    pipe = client.pipeline(transaction=False)
    for name in ("min-replicas-to-write", "min-replicas-max-lag", "maxmemory-policy"):
        pipe.execute_command("CONFIG", "GET", name)
    pipe.execute_command("INFO", "replication")
    replies = await pipe.execute(raise_on_error=False)
    from redis.exceptions import ConnectionError as LinkDown
    from redis.exceptions import TimeoutError as LinkSlow

    for reply in replies:
        if isinstance(reply, LinkDown | LinkSlow | ConnectionError | TimeoutError | OSError):
            raise reply  # not an answer: the start retries it
    info_reply = replies[3]
    if isinstance(info_reply, BaseException):
        info = ""
    elif isinstance(info_reply, dict):  # redis-py parses INFO
        info = "\n".join(f"{k}:{v}" for k, v in info_reply.items())
    else:
        info = info_reply.decode() if isinstance(info_reply, bytes) else str(info_reply)
    replicas = _info_field(info, "connected_slaves") or 0
    good = _info_field(info, "min_slaves_good_slaves")
    minimum, lag, policy = (
        _config(replies[i], n)
        for i, n in enumerate(("min-replicas-to-write", "min-replicas-max-lag", "maxmemory-policy"))
    )
    unreadable = ""
    if minimum is None or policy is None:
        errors = [describe(r) for r in replies[:3] if isinstance(r, BaseException)]
        unreadable = errors[0] if errors else "CONFIG GET returned nothing"
        minimum = policy = None
    return RedisSettings(
        min_replicas=int(minimum) if minimum is not None else None,
        max_lag=int(lag) if lag is not None and lag.isdigit() else None,
        policy=policy,
        replicas=replicas,
        good=good if good is not None else replicas,
        unreadable=unreadable,
    )


class SettingsWatch:
    """Reads the settings at start (refusing what cannot be safe) and again while running; tells the
    link how many acknowledgements a lease write needs; keeps what STATS shows."""

    def __init__(self, target: RedisTarget, link: RedisLink, ttl: float) -> None:
        self.target = target
        self.link = link
        self.ttl = ttl
        self.last: RedisSettings | None = None
        self.unsafe: list[str] = []  # what the last check found unsafe (not refused while running)
        self.checks = 0
        self._checked_at = -RECHECK_INTERVAL
        self._checked_address = ""
        self._task: asyncio.Task[None] | None = None
        self._warned_unreadable = False
        self._short = False  # the master had fewer good replicas than its min-replicas-to-write

    def _where(self) -> str:
        return self.link.address or self.target.display

    async def at_start(self) -> None:
        """Read the settings from the node the link reaches; raise :class:`LeaseRefused` (exit 2) for
        what cannot be safe. A connection error is raised as is (the start retries it)."""
        settings = await read_settings(await self.link.get())
        self._apply(settings)
        if self.unsafe:
            raise LeaseRefused(f"refusing to lease from {self.target.display}: {self.unsafe[0]}")

    def _apply(self, settings: RedisSettings) -> None:
        where = self._where()
        self.checks += 1
        self.last = settings
        self._checked_at = time.monotonic()
        self._checked_address = self.link.address
        if settings.unreadable and not self._warned_unreadable:
            self._warned_unreadable = True
            log.warning(
                "cannot read Redis's settings at %s (CONFIG GET: %s): check yourself that min-replicas-to-write"
                " is at least 1 on every node of a master with replicas (and min-replicas-max-lag set), and"
                " that maxmemory-policy is noeviction or volatile-*; until then each lease write waits for"
                " every replica the master has had (replica_acks=N in the URL waits for N instead)",
                where,
                settings.unreadable,
            )
        unsafe = settings.problems(self.target, where)
        if unsafe and unsafe != self.unsafe and self.checks > 1:
            for problem in unsafe:
                log.error("unsafe Redis setting: %s", problem)
        self.unsafe = unsafe
        self.link.min_replicas = settings.min_replicas
        minimum = settings.min_replicas or 0
        short = minimum > 0 and settings.good < minimum
        if short and not self._short:
            log.error(
                "Redis at %s has %d of the %d replicas its min-replicas-to-write needs (%d connected): it refuses"
                " lease writes, and every daemon leasing from it stops issuing when its lease runs out (within"
                " the lease ttl, %gs) unless a replica comes back",
                where,
                settings.good,
                minimum,
                settings.replicas,
                self.ttl,
            )
        elif self._short and not short:
            log.info("Redis at %s has %d replicas again (min-replicas-to-write %d)", where, settings.good, minimum)
        self._short = short

    def poke(self, forced: bool = False) -> None:
        """Read the settings again in the background when due: every minute, when the master changed,
        and (``forced``) after a lease write failed or was not acknowledged, or while the master is short
        of replicas (at most every 2 s). Never delays a renew."""
        if self._task is not None and not self._task.done():
            return
        forced = forced or self._short  # short of replicas: watch for them to come back
        now = time.monotonic()
        since = now - self._checked_at
        due = since >= RECHECK_INTERVAL or self.link.address != self._checked_address
        if not due and not (forced and since >= _FORCED_MIN_INTERVAL):
            return
        self._task = asyncio.get_running_loop().create_task(self._recheck())

    async def _recheck(self) -> None:
        """On the link's client, or (dropped after a failure, when this matters most) a client of our
        own, closed after: the link's is the keeper's to make, one at a time."""
        client, own = self.link.client, None
        with contextlib.suppress(Exception):
            if client is None:
                client = own = await asyncio.wait_for(connect(self.target, 1.0), timeout=2.0)
            self._apply(await asyncio.wait_for(read_settings(client), timeout=max(1.0, self.ttl / 10)))
        if own is not None:
            with contextlib.suppress(Exception):
                await own.aclose()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def fields(self) -> list[tuple[str, object]]:
        """For STATS (and so the metrics)."""
        last = self.last
        minimum = last.min_replicas if last is not None and last.min_replicas is not None else -1
        return [
            ("lease_redis_settings_unsafe", len(self.unsafe)),
            ("lease_redis_settings_unreadable", int(last is not None and bool(last.unreadable))),
            ("lease_redis_min_replicas_to_write", minimum),
            ("lease_redis_replicas_connected", last.replicas if last is not None else 0),
            ("lease_redis_replicas_good", last.good if last is not None else 0),
            ("lease_redis_settings_checks", self.checks),
        ]

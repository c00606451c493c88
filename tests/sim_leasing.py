"""A deterministic simulation of worker-id leasing under faults: several daemons, each running the real
lease keeper (``katsubushi_py/leasing``) and the real generator, against the real Lua scripts in a real
redis-server, on one event loop with a virtual clock; random interleavings of client requests and
faults; after every step, the invariants.

Run it::

    python tests/sim_leasing.py --seeds 20 --steps 5000          # 20 worlds of 5,000 steps each
    python tests/sim_leasing.py --seed 1234 --steps 5000 --trace # replay one world, with its log
    python tests/sim_leasing.py --seeds 20 --plant no-fence       # a bug planted on purpose: found?
    python tests/sim_leasing.py --seeds 20 --known-gaps           # faults reach the documented gaps

**The world** (drawn from the seed): 2 to 6 hosts, each with a clock that drifts (up to 200 ppm) and
steps, running one daemon at a time; a pool of 1 to 7 worker ids (often fewer than the hosts, so daemons
wait for ids); a master with 0 to 2 replicas, Sentinel naming it; a lease ttl of 3 to 6 s, renews at a
third of it, a clock-skew allowance of 0.25 to 1 s; replica acknowledgements as the default (every
replica) or ``replica_acks=0``; a pool made by ``lease init`` or by the first daemon.

**Steps**: a client request to a daemon (1 to 100 IDs, from its generator, as the front ends ask), a
tick of virtual time (1 to 40 ms in a storm, up to 250 ms in a calm stretch: the keepers renew, acquire,
time out, retry), or a fault. Faults come in storms (150 to 600 steps, 2 to 6% of steps a fault)
separated by calm stretches (no fault until every fault so far has played out, then NTP puts every
clock right, then a recovery window, a ttl and a renew interval so the fleet serves again); see
:class:`Faults` for the list: daemon pause (requests queued meanwhile served as it wakes), crash, clean
stop, a host's clock stepped, NTP putting it right, a host rebooting with its clock off until NTP syncs
and its network late, Redis's clock stepped, Redis restarted losing everything / from an RDB snapshot
up to 3 ttl old / losing the last second of an AOF / losing nothing, failover to a replica (up to date,
or cut off before the master died), two masters at once (a partition; only with replica
acknowledgements), a replica's link cut, a replica slow, Redis paused, a lease record damaged as
docs/leasing.md lists, a daemon cut off from Redis, replies lost or late. Topology faults (restart,
failover, two masters) play out one at a time.

**Inside the documented conditions** (docs/guarantees.md), which two guards keep the faults within:
clocks may be off true time together (a host synced to the Redis host's clock, off by seconds, its
daemon passing the clock check with IDs that far off) except across a loss of Redis's data: a restart
that loses data or a failover happens only while no running daemon's clock and no ID issued is off true
time by more than the skew, and until a script has seen the loss no daemon starts on a host whose clock
is (:meth:`Simulation.clocks_off_for_a_loss`); two masters happen at any time except while the master
has a replica that no lease write has seen connected since it joined (every lease write counts the
replicas; a replica cut off before any did is the residual case of condition 3).
``--known-gaps`` lifts both: runs may then find the gaps.

**Invariants**, checked after every step (a failure stops the world, prints the seed and the command
that replays it):

- no ID is issued twice;
- under one worker id, IDs only increase, whoever issues them;
- no two daemons issue under one worker id in overlapping time: after every step at most one daemon per
  worker id could issue (its generator's check passes), and a daemon that issued under a worker id
  never issues under it again once another daemon has;
- a daemon issues only under the lease its keeper holds (worker id and lease);
- no script fails in Redis, no keeper dies of anything but a refusal the daemon would exit with, no
  callback raises.

**Determinism**: everything random comes from the seed (the keepers' own jitter included: the global
``random`` is seeded), tokens and pool epochs are numbered, and virtual time only moves when the loop
has nothing to run; the same seed gives the same run, byte for byte (each run prints a digest of its
trace and of the IDs issued; tests/test_sim_leasing.py checks a seed gives the same digest twice).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import hashlib
import importlib
import logging
import math
import os
import pkgutil
import random
import re
import sys
import tempfile
import time as real_time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_loop import PROCESS, ROOT, SIM_TIME, HostClock, VirtualLoop
from sim_redis import Backend, RedisWorld, SimFinder

import katsubushi_py.leasing as leasing_pkg
from katsubushi_py.issuing.errors import GenerationError
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing import keeper as keeper_module
from katsubushi_py.leasing import link as link_module
from katsubushi_py.leasing.keeper import LeaseKeeper, LeaseTimings
from katsubushi_py.leasing.link import RedisLink
from katsubushi_py.leasing.scripts import INIT_LUA, REPLICAS_LUA
from katsubushi_py.leasing.target import LeaseError, RedisTarget

BASE_UNIX = 1_795_305_600.0  # true time 0: 2026-11-22T00:00:00Z
WORKER_SHIFT, WORKER_MASK = 12, 1023
log = logging.getLogger("katsubushi_py.sim")


class Violation(AssertionError):
    """An invariant broke."""


@dataclass
class Config:
    """One world, all drawn from its seed."""

    hosts: int
    min_id: int
    max_id: int
    replicas: int
    replica_acks: int | None
    ttl: float
    skew_max: float
    init_pool: bool
    fault_rate: float  # faults per step in a storm

    @property
    def timings(self) -> LeaseTimings:
        return LeaseTimings(ttl=self.ttl, renew=self.ttl / 3, delay=2 * self.ttl / 3)

    @property
    def recovery(self) -> float:
        return self.ttl + 2 * self.skew_max

    @classmethod
    def draw(cls, rng: random.Random) -> Config:
        hosts = rng.randint(2, 6)
        replicas = rng.choice((0, 1, 1, 2))
        return cls(
            hosts=hosts,
            min_id=1,
            max_id=rng.randint(1, hosts + 1),
            replicas=replicas,
            replica_acks=0 if replicas and rng.random() < 0.2 else None,
            ttl=rng.choice((3.0, 4.5, 6.0)),
            skew_max=rng.choice((0.25, 0.5, 1.0)),
            init_pool=rng.random() < 0.7,
            fault_rate=rng.uniform(0.02, 0.06),
        )


@dataclass(eq=False)
class Host:
    name: str
    clock: HostClock
    process: Process | None = None
    incarnations: int = 0
    restart_at: float = -1.0


@dataclass(eq=False)
class Process:
    """One daemon: its keeper and generator, run in a context that names it."""

    host: Host
    name: str
    ctx: contextvars.Context
    keeper: LeaseKeeper | None = None
    generator: Generator | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    state: str = "running"  # running, stopping, stopped, crashed, exited
    paused_until: float = 0.0
    net_down_until: float = 0.0
    crashed: bool = False
    tokens: int = 0
    together: bool = False  # its host's clock agreed with Redis's (within the skew) when it started
    exit: str = ""

    @property
    def live(self) -> bool:
        return self.state == "running"


def _ms_of(id_: int) -> str:
    """An ID's millisecond, as true time of the simulation (seconds)."""
    return f"t={((id_ >> 22) + 1_420_070_400_000) / 1000 - BASE_UNIX:.3f}"


def _clock_of(process: Process, now: float) -> str:
    """How far the process's generator clock is from true time."""
    generator = process.generator
    if generator is None:
        return "?"
    return f"{generator.now_ms() / 1000 - BASE_UNIX - now:+.3f}s"


class Checker:
    """The invariants over every ID issued, and over who could issue at each step."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.last: dict[int, int] = {}  # worker id -> the last ID issued under it
        self.last_by: dict[int, str] = {}  # worker id -> who issued it, when (true time), with what clock
        self.owner: dict[int, str] = {}  # worker id -> the lease token that issued under it last
        self.retired: set[tuple[int, str]] = set()
        self.ids = 0
        self.requests = 0
        self.refused: Counter[str] = Counter()
        self.serving_time: dict[int, float] = {}

    def issued(self, process: Process, ids: list[int], now: float) -> None:
        keeper, generator = process.keeper, process.generator
        assert keeper is not None and generator is not None
        holding = keeper.holding
        if holding is None:
            raise Violation(f"{process.name} issued {len(ids)} IDs without holding a lease")
        worker, token = holding.worker_id, holding.lease.token
        for id_ in ids:
            if (id_ >> WORKER_SHIFT) & WORKER_MASK != worker:
                raise Violation(
                    f"{process.name} issued {id_} (worker id {(id_ >> WORKER_SHIFT) & WORKER_MASK})"
                    f" under its lease on worker id {worker}"
                )
        before = len(self.seen)
        self.seen.update(ids)
        if len(self.seen) != before + len(ids):
            dup = [i for i in ids if ids.count(i) > 1] or ids
            raise Violation(f"DUPLICATE: {process.name} issued an ID issued before (one of {dup[:3]}...)")
        last = self.last.get(worker)
        if last is not None and ids[0] <= last:
            raise Violation(
                f"{process.name} issued {ids[0]} under worker id {worker} ({_ms_of(ids[0])}, clock"
                f" {_clock_of(process, now)}) after {last} ({_ms_of(last)}) was issued by {self.last_by[worker]}"
            )
        self.last[worker] = ids[-1]
        self.last_by[worker] = f"{process.name} at {now:.3f} (clock {_clock_of(process, now)})"
        owner = self.owner.get(worker)
        if owner != token:
            if (worker, token) in self.retired:
                raise Violation(f"OVERLAP: {process.name} issued under worker id {worker} again after lease {owner}")
            if owner is not None:
                self.retired.add((worker, owner))
            self.owner[worker] = token
        self.ids += len(ids)

    def could_issue(self, processes: list[Process], now: float) -> None:
        """At most one daemon per worker id could issue right now."""
        seen: dict[int, Process] = {}
        for process in processes:
            generator = process.generator
            if not process.live or process.paused_until > now or generator is None:
                continue
            if generator.check() is not None:
                continue
            worker = generator.worker_id
            other = seen.get(worker)
            if other is not None:
                raise Violation(f"OVERLAP: {other.name} and {process.name} could both issue under worker id {worker}")
            seen[worker] = process


class Faults:
    """What can go wrong, and when: storms (faults at ``config.fault_rate`` per step, for 150 to 600
    steps) and calm stretches (no new fault, every clock put right, and long enough after the last
    fault played out that the fleet serves again: a recovery window, a ttl and a renew interval).

    Topology faults (a Redis restart, a failover, two masters) are exclusive: one plays out to its end
    (the node back, the old master rejoined, the partition healed) before the next may start; the
    others (daemons, clocks, the network, records, replicas) overlap freely."""

    KINDS = (
        "pause",
        "crash",
        "stop",
        "host_clock",
        "host_ntp",
        "redis_clock",
        "restart",
        "failover",
        "two_masters",
        "replica_link",
        "slow_replica",
        "redis_pause",
        "damage",
        "net",
        "lost_replies",
        "reboot",
    )

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.rng = sim.rng
        self.counts: Counter[str] = Counter()
        self.phase = "calm"  # the world starts calm: the fleet leases its ids first
        self.storms = 0
        self.storm_until_step = 0
        self.calm_until = sim.config.recovery + sim.config.ttl
        self.settled_at = 0.0  # true time by which every fault so far has played out
        self.topology_busy: str | None = None  # the topology fault in progress: one at a time

    def weights(self) -> dict[str, float]:
        sim, config = self.sim, self.sim.config
        redis = sim.redis
        master = redis.master
        master_replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is master]
        has_replicas = master is not None and bool(master_replicas)
        topology = master is not None and master.up and redis.partitioned is None and self.topology_busy is None
        # Every lease write counts the master's replicas (docs/leasing.md): a replica is waited for from
        # the first lease write that sees it connected. Two masters before any has (a replica that joined,
        # cut off before a lease write on that master) are the residual gap (--known-gaps).
        if master is not None and not sim.known_gaps and any(r.name not in master.counted for r in master_replicas):
            has_two_masters_replicas = False
        else:
            has_two_masters_replicas = has_replicas
        w = {
            "pause": 3.0,
            "crash": 2.0,
            "stop": 2.0,
            "host_clock": 1.5,
            "host_ntp": 1.0,
            "reboot": 1.0,
            "redis_clock": 1.5,
            "restart": 1.0 if topology else 0.0,
            "failover": 1.0 if has_replicas and topology else 0.0,
            "two_masters": 2.0 if has_two_masters_replicas and topology and config.replica_acks is None else 0.0,
            "replica_link": 1.0 if any(n.role == "replica" and n.up and n.link_up for n in redis.nodes) else 0.0,
            "slow_replica": 0.5 if any(n.role == "replica" for n in redis.nodes) else 0.0,
            "redis_pause": 1.0 if master is not None and master.up else 0.0,
            "damage": 1.5 if master is not None and master.up else 0.0,
            "net": 2.0,
            "lost_replies": 1.0,
        }
        return {k: v for k, v in w.items() if v > 0}

    def step(self) -> None:
        sim = self.sim
        now = sim.loop.now
        if self.phase == "storm":
            if sim.step_no >= self.storm_until_step:
                self.phase = "calm"
                self.calm_until = self.settled_at  # then: every clock right, and the recovery (below)
                sim.trace(f"calm (storm {self.storms} over)")
            elif self.rng.random() < sim.config.fault_rate:
                weights = self.weights()
                kind = self.rng.choices(list(weights), list(weights.values()))[0]
                getattr(self, kind)()
            return
        if self.calm_until <= self.settled_at:
            # The last storm's faults have played out (or will, by settled_at): once they have, NTP puts
            # every clock right, and the calm goes on until the fleet has had time to serve again.
            if now < self.settled_at:
                return
            self.put_clocks_right()
            config = sim.config
            self.calm_until = now + config.recovery + config.ttl + config.timings.renew + 1.0
            return
        if now >= self.calm_until:
            if self.storms:
                sim.calm_ended()
            self.phase = "storm"
            self.storms += 1
            self.storm_until_step = sim.step_no + self.rng.randint(150, 600)
            sim.trace(f"storm {self.storms}")

    def put_clocks_right(self) -> None:
        """NTP on every host and node: clocks within a fifth (Redis) and two fifths (hosts) of the
        allowed skew of true time, so any daemon's within the skew of any node's."""
        skew = self.sim.config.skew_max
        for node in self.sim.redis.nodes:
            if abs(node.clock_offset) > 0.2 * skew:
                node.clock_offset = self.rng.uniform(-0.2, 0.2) * skew
                self.sim.trace(f"NTP: {node.name}'s clock to {node.clock_offset:+.3f}s")
        for host in self.sim.hosts:
            if abs(host.clock.offset) > 0.4 * skew:
                host.clock.step(self.rng.uniform(-0.4, 0.4) * skew - host.clock.offset)
                self.sim.trace(f"NTP: {host.name}'s clock to {host.clock.offset:+.3f}s")

    def _busy(self, seconds: float) -> None:
        """This fault plays out for ``seconds`` from now."""
        self.settled_at = max(self.settled_at, self.sim.loop.now + seconds)

    def _topology_done(self) -> None:
        self.topology_busy = None
        self._busy(0.0)

    def _event(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        self.sim.trace(f"FAULT {kind}: {what}")

    def _process(self) -> Process | None:
        live = [h.process for h in self.sim.hosts if h.process is not None and h.process.live]
        return self.rng.choice(live) if live else None

    def _later(self, delay: float, callback: Any, *args: Any) -> None:
        self._busy(delay)
        self.sim.loop.call_at(self.sim.loop.now + delay, callback, *args, context=ROOT)

    # -- daemons -------------------------------------------------------------------------------------
    def pause(self) -> None:
        process = self._process()
        if process is None:
            return
        ttl = self.sim.config.ttl
        rng = self.rng
        length = rng.choice((rng.uniform(0.05, 0.5), rng.uniform(0.5, ttl), rng.uniform(ttl, 4 * ttl)))
        until = max(process.paused_until, self.sim.loop.now + length)
        process.paused_until = until
        self._busy(length)
        self._event("pause", f"{process.name} for {length:.3f}s")
        # The requests that waited in its sockets meanwhile are served as it wakes, before any reply
        # from Redis can reach it (its own callbacks resume a microsecond later: sim_loop's gate).
        self._later(until - self.sim.loop.now, self.sim.woken, process, until)

    def crash(self) -> None:
        process = self._process()
        if process is None:
            return
        self._event("crash", process.name)
        self.sim.crash(process)
        delay = self.rng.uniform(0.1, 2 * self.sim.config.ttl)
        self._busy(delay)
        self.sim.restart_later(process.host, delay)

    def stop(self) -> None:
        process = self._process()
        if process is None or process.paused_until > self.sim.loop.now:
            return
        self._event("stop", process.name)
        self.sim.stop(process)
        delay = self.rng.uniform(0.0, self.sim.config.ttl)
        self._busy(delay + 1.5)
        self.sim.restart_later(process.host, delay)

    def host_clock(self) -> None:
        host = self.rng.choice(self.sim.hosts)
        step = self.rng.choice((-1, 1)) * self.rng.uniform(0.01, 2.5 * self.sim.config.skew_max)
        if self.rng.random() < 0.2:
            step = self.rng.choice((-1, 1)) * self.rng.uniform(5, 60)
        host.clock.step(step)
        self._event("host_clock", f"{host.name} {step:+.3f}s")

    def reboot(self) -> None:
        """A host reboots with its clock off (no RTC battery, a VM restored), and its daemon starts before
        NTP has synced and before the network is up; NTP then steps the clock right while the daemon is
        still connecting. The daemon must judge the clock its IDs carry (the generator's, taken at its
        start), not the wall clock as it reads when Redis answers at last."""
        sim, rng = self.sim, self.rng
        host = rng.choice(sim.hosts)
        if host.process is not None and host.process.state in ("running", "stopping"):
            sim.crash(host.process)
        step = rng.choice((-1, 1)) * rng.uniform(2 * sim.config.skew_max, 30.0)
        host.clock.step(step - host.clock.offset)
        host.restart_at = -1.0  # any restart already planned is this one
        sim.start(host)
        process = host.process
        if process is None or not process.live:
            return
        network = rng.uniform(0.3, 3.0)
        process.net_down_until = sim.loop.now + network
        ntp = rng.uniform(0.1, 0.9) * network

        def synced() -> None:
            host.clock.step(rng.uniform(-0.4, 0.4) * sim.config.skew_max - host.clock.offset)
            sim.trace(f"NTP: {host.name}'s clock to {host.clock.offset:+.3f}s")

        what = f"{host.name} with its clock {step:+.3f}s off; NTP in {ntp:.3f}s, network in {network:.3f}s"
        self._event("reboot", what)
        self._later(ntp, synced)
        self._busy(network)

    def host_ntp(self) -> None:
        """NTP puts a host's wall clock within two fifths of the allowed skew of its source: true time, or
        (half the time) the Redis host's clock, which may be off by seconds; its daemon then passes the
        clock check with IDs that far off true time (covered outside a loss of Redis's data; see
        Simulation.clocks_off_for_a_loss)."""
        host = self.rng.choice(self.sim.hosts)
        target = self.rng.uniform(-0.4, 0.4) * self.sim.config.skew_max
        master = self.sim.redis.master
        if master is not None and self.rng.random() < 0.5:
            target += master.clock_offset  # a host whose NTP source is the Redis host
        host.clock.step(target - host.clock.offset)
        self._event("host_ntp", f"{host.name} to {target:+.3f}s")

    # -- Redis -------------------------------------------------------------------------------------
    def redis_clock(self) -> None:
        node = self.sim.redis.master or self.rng.choice(self.sim.redis.nodes)
        size = self.rng.choice((self.rng.uniform(0.05, 1.0), self.rng.uniform(1.0, 5.0), self.rng.uniform(5.0, 30.0)))
        step = self.rng.choice((-1, 1)) * size
        node.clock_offset += step
        self._event("redis_clock", f"{node.name} {step:+.3f}s")

    def restart(self) -> None:
        redis, rng, ttl = self.sim.redis, self.rng, self.sim.config.ttl
        node = redis.master
        if node is None or not node.up:
            return
        mode = rng.choice(("flush", "rdb", "rdb", "aof", "clean"))
        if mode != "clean" and self.sim.loss_held("restart"):
            return
        age = {"flush": 0.0, "rdb": rng.uniform(0, 3 * ttl), "aof": rng.uniform(0, 1.0), "clean": 0.0}[mode]
        down = rng.choice((rng.uniform(0.01, 0.5), rng.uniform(0.5, ttl), rng.uniform(ttl, 2 * ttl)))
        dumps = tuple(None for _ in redis.keys) if mode == "flush" else redis.state_at(node, redis.loop.now - age)
        redis.stop_node(node)
        self.topology_busy = "restart"
        self._event("restart", f"{node.name} ({mode}, snapshot {age:.3f}s old, down {down:.3f}s)")

        def back() -> None:
            redis.start_node(node, dumps)
            self.sim.trace(f"{node.name} back (run_id {node.run_id[:8]})")
            self._topology_done()

        self._later(down, back)

    def failover(self) -> None:
        redis, rng = self.sim.redis, self.rng
        old = redis.master
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is old]
        if old is None or not replicas or self.sim.loss_held("failover"):
            return
        chosen = rng.choice(replicas)
        lag = rng.random() < 0.5
        cut = rng.uniform(0.05, 2.0) if lag else 0.0
        if lag:
            chosen.link_up = False
        self.topology_busy = "failover"
        self._event("failover", f"{old.name} -> {chosen.name}" + (f" (its link cut {cut:.3f}s before)" if lag else ""))

        def kill() -> None:
            if redis.master is not old or not old.up:
                chosen.link_up = True
                self._topology_done()
                return
            redis.stop_node(old)
            redis.master = None
            self.sim.trace(f"{old.name} killed; Sentinel promotes {chosen.name}")
            self._later(rng.uniform(0.2, 0.5 * self.sim.config.ttl), promote)

        def promote() -> None:
            if not chosen.up:
                chosen.link_up = True
                redis.master = old if old.up else None
                if redis.master is None:
                    redis.start_node(old, redis.state_at(old, redis.loop.now))
                    redis.master = old
                self._topology_done()
                return
            chosen.link_up = True
            redis.promote(chosen)
            self.sim.trace(f"{chosen.name} promoted (replid {chosen.replid[:8]})")
            self._later(rng.uniform(1.0, 4 * self.sim.config.ttl), rejoin)

        def rejoin() -> None:
            if not old.up and redis.master is not None:
                old.role = "replica"
                old.master = redis.master
                redis.start_node(old, tuple(None for _ in redis.keys))
                self.sim.trace(f"{old.name} back as a replica of {redis.master.name}")
            self._topology_done()

        self._later(cut, kill)

    def two_masters(self) -> None:
        """A partition: the master, cut off from its replicas and from Sentinel, keeps running with some
        daemons on its side; Sentinel promotes a replica for the others. Healed later: the old master
        becomes a replica of the new."""
        redis, rng, sim = self.sim.redis, self.rng, self.sim
        old = redis.master
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.master is old]
        if old is None or not replicas:
            return
        chosen = rng.choice(replicas)
        # Figures: two masters soon after a replica joined (inside the minute the daemons once took to
        # count it: 3 ttl in the simulation, plus 2 ttl), and with a replica no lease write had counted.
        if any(sim.loop.now - old.joined.get(r.name, -math.inf) < 5 * sim.config.ttl for r in replicas):
            sim.stats["two_masters_soon_after_a_replica_joined"] += 1
        if any(r.name not in old.counted for r in replicas):
            sim.stats["two_masters_with_an_uncounted_replica"] += 1
        for replica in replicas:
            replica.link_up = False
        stuck = [p for h in sim.hosts if (p := h.process) is not None and p.live and rng.random() < 0.5]
        for process in stuck:
            redis.pinned[process] = old
        redis.partitioned = old
        redis.master = None
        self.topology_busy = "two_masters"
        length = rng.uniform(0.5 * sim.config.ttl, 4 * sim.config.ttl)
        names = [p.name for p in stuck]
        self._event("two_masters", f"{old.name} cut off with {names}; {chosen.name} promoted; {length:.3f}s")

        def promote() -> None:
            if chosen.up:
                chosen.link_up = True
                redis.promote(chosen)

        def heal() -> None:
            redis.pinned.clear()
            redis.partitioned = None
            new = redis.master
            if new is None:
                self._topology_done()
                return
            if old.up:
                redis.demote(old, new)
            for replica in replicas:
                if replica is not new and replica.up and replica.master is not new:
                    redis.attach(replica, new)
            sim.trace(f"partition healed: {old.name} now a replica of {new.name}")
            self._topology_done()

        self._later(rng.uniform(0.2, 0.5 * sim.config.ttl), promote)
        self._later(length, heal)

    def replica_link(self) -> None:
        redis = self.sim.redis
        replicas = [n for n in redis.nodes if n.role == "replica" and n.up and n.link_up]
        if not replicas:
            return
        replica = self.rng.choice(replicas)
        replica.link_up = False
        length = self.rng.uniform(0.1, 2 * self.sim.config.ttl)
        self._event("replica_link", f"{replica.name} cut for {length:.3f}s")

        def restore() -> None:
            if replica.up and replica.master is not None and replica.role == "replica" and not replica.link_up:
                redis.attach(replica, replica.master)

        self._later(length, restore)

    def slow_replica(self) -> None:
        replicas = [n for n in self.sim.redis.nodes if n.role == "replica"]
        if replicas:
            replica = self.rng.choice(replicas)
            replica.slow = not replica.slow
            self._event("slow_replica", f"{replica.name} {'slow' if replica.slow else 'fast again'}")

    def redis_pause(self) -> None:
        node = self.sim.redis.master
        if node is None:
            return
        length = self.rng.choice((self.rng.uniform(0.05, 1.0), self.rng.uniform(1.0, 2 * self.sim.config.ttl)))
        node.paused_until = max(node.paused_until, self.sim.loop.now + length)
        self._busy(length)
        self._event("redis_pause", f"{node.name} for {length:.3f}s")

    def damage(self) -> None:
        """A held id's record damaged as docs/leasing.md lists (an edit, a bad restore, a script bug):
        expiry 0, mark 0, both, the mark deleted, the owner entry deleted, a release entry beside it."""
        redis = self.sim.redis
        node = redis.master
        if node is None or not node.up or node.paused_until > redis.loop.now:
            return
        ids, owners, marks, released = redis.keys[:4]
        client = redis.backend.client(node.db)
        held = sorted(int(k) for k in client.hkeys(owners))
        if not held:
            return
        worker = self.rng.choice(held)
        kind = self.rng.choice(("expiry0", "mark0", "expiry0+mark0", "mark_deleted", "owner_deleted", "released"))
        if "expiry0" in kind:
            client.zadd(ids, {str(worker): 0})
        if "mark0" in kind:
            client.hset(marks, str(worker), 0)
        if kind == "mark_deleted":
            client.hdel(marks, str(worker))
        if kind == "owner_deleted":
            client.hdel(owners, str(worker))
        if kind == "released":
            client.hset(released, str(worker), 1)
        redis._written(node)
        self._event("damage", f"worker id {worker}: {kind}")

    # -- the network ---------------------------------------------------------------------------------
    def net(self) -> None:
        process = self._process()
        if process is None:
            return
        ttl = self.sim.config.ttl
        rng = self.rng
        length = rng.choice((rng.uniform(0.05, 1.0), rng.uniform(1.0, ttl), rng.uniform(ttl, 4 * ttl)))
        process.net_down_until = max(process.net_down_until, self.sim.loop.now + length)
        self._busy(length)
        self._event("net", f"{process.name} cut off from Redis for {length:.3f}s")

    def lost_replies(self) -> None:
        redis = self.sim.redis
        redis.lost_reply_rate = self.rng.uniform(0.05, 0.5)
        redis.lost_request_rate = self.rng.uniform(0.0, 0.2)
        redis.slow_rate = self.rng.uniform(0.0, 0.3)
        length = self.rng.uniform(0.5, 3 * self.sim.config.ttl)
        self._event(
            "lost_replies", f"{redis.lost_reply_rate:.0%} of replies lost, {redis.slow_rate:.0%} late, {length:.3f}s"
        )

        def end() -> None:
            redis.lost_reply_rate = redis.lost_request_rate = redis.slow_rate = 0.0

        self._later(length, end)


class Simulation:
    """One world, from its seed."""

    def __init__(self, seed: int, steps: int, backend: Backend, trace: bool = False, known_gaps: bool = False) -> None:
        self.seed = seed
        self.steps = steps
        self.known_gaps = known_gaps  # let the faults reach the documented gaps (they then fail)
        self.rng = random.Random(seed)
        self.config = Config.draw(self.rng)
        self.loop = VirtualLoop()
        self.backend = backend
        self.tracing = trace
        self.digest = hashlib.sha256()
        self.target = RedisTarget(url="redis://sim:6379/0", namespace="sim", replica_acks=self.config.replica_acks)
        self.redis = RedisWorld(self.loop, self.rng, backend, self.target.keys().all, BASE_UNIX)
        self.checker = Checker()
        self.faults = Faults(self)
        self.hosts: list[Host] = []
        self.processes: list[Process] = []
        self.step_no = 0
        self.epochs = 0
        self.failure: str | None = None
        self.loss_unseen = False  # Redis lost (or may have lost) data, and no script has seen it yet
        self.calm_results: Counter[str] = Counter()
        self.stats: Counter[str] = Counter()

    # -- tracing -----------------------------------------------------------------------------------
    def trace(self, line: str) -> None:
        text = f"{self.loop.now:10.4f} {line}"
        self.digest.update(text.encode())
        if self.tracing:
            print(text)

    # -- building the world ------------------------------------------------------------------------
    def build(self) -> None:
        config, rng = self.config, self.rng
        master = self.redis.add_node()
        for _ in range(config.replicas):
            offset = rng.uniform(-0.2, 0.2) * config.skew_max if rng.random() < 0.8 else rng.uniform(-10, 10)
            self.redis.add_node(clock_offset=offset)
        if config.init_pool:
            self.redis.run_script(master, INIT_LUA, self.redis.keys, [config.min_id, config.max_id, "init-epoch"])
        for n in range(config.hosts):
            clock = HostClock(
                self.loop,
                BASE_UNIX,
                offset=rng.uniform(-0.8, 0.8) * config.skew_max,
                rate=rng.uniform(-2e-4, 2e-4),
                mono_start=rng.uniform(100, 10_000),
            )
            host = Host(f"h{n}", clock)
            self.hosts.append(host)
            self.start(host)
        self.trace(f"world {self.config}")

    # -- the clock condition across a loss of Redis's data (docs/guarantees.md, Clock) ---------------
    def clocks_off_for_a_loss(self) -> str | None:
        """Why Redis may not lose data now, or None. When Redis loses lease writes, what they allowed is
        bounded when a script first sees the loss, from Redis's clock and the clock of the daemon that
        runs it (the pool's high-water mark went with the data): so every daemon's clock within the skew
        of true time across the loss. Here: no running daemon's clock, and no ID issued so far, off true
        time by more than the skew (behind: a daemon that may see the loss; ahead: what a lost write may
        have covered). Counted: daemons whose clock agreed with Redis's at their start (off together);
        one that disagreed is refused by the clock check, and one that passes anyway is a bug the
        simulation must find (the planted ``wall-clock-check``)."""
        skew, now = self.config.skew_max, self.loop.now
        for process in self.processes:
            generator = process.generator
            if generator is None or not process.together:
                continue
            if process.state in ("running", "stopping"):
                off = generator.now_ms() / 1000 - BASE_UNIX - now
                if abs(off) > skew:
                    return f"{process.name}'s clock {off:+.3f}s"
            last = generator.last_issued_ms
            if last is not None and last / 1000 - BASE_UNIX - now > skew:
                return f"{process.name} issued {last / 1000 - BASE_UNIX - now:+.3f}s ahead"
        return None

    def loss_held(self, kind: str) -> bool:
        """Whether a fault that can lose Redis's data (a restart that loses some, a failover) is held by
        the clock condition; else it will happen: no daemon starts with an off clock until it is seen."""
        if self.known_gaps:
            return False
        why = self.clocks_off_for_a_loss()
        if why is not None:
            self.stats[f"{kind} held: a clock off across a loss"] += 1
            self.trace(f"{kind} held: {why}")
            return True
        self.loss_unseen = True
        return False

    def loss_seen(self) -> bool:
        """Whether a script has seen the last loss: the master's pool exists and is stamped with the
        master's identity (a restart's run_id, a promotion's replid)."""
        if self.loss_unseen:
            master = self.redis.master
            if master is None or not master.up:
                return False
            pool = self.redis.backend.client(master.db).hget(self.redis.keys[5], "identity")
            if pool is None or pool.decode() != f"{master.run_id}/{master.replid}":
                return False
            self.loss_unseen = False
        return True

    def start(self, host: Host) -> None:
        if host.process is not None and host.process.state in ("running", "stopping"):
            return
        config = self.config
        if abs(host.clock.offset) > config.skew_max and not self.known_gaps and not self.loss_seen():
            # Redis lost data no script has seen yet: the first to see it bounds what the lost writes
            # allowed from its own clock and Redis's, so its clock must be within the skew of true time
            # (docs/guarantees.md, Clock). The operator's start waits for NTP (systemd's time-sync.target,
            # `chronyc waitsync`): so here.
            self.stats["starts held: a clock off while a loss is unseen"] += 1
            self.restart_later(host, 1.0)
            return
        host.incarnations += 1
        ctx = contextvars.copy_context()
        process = Process(host, f"{host.name}.{host.incarnations}", ctx)
        master = self.redis.master
        process.together = master is not None and abs(host.clock.offset - master.clock_offset) <= config.skew_max
        if process.together and abs(host.clock.offset) > config.skew_max:
            self.stats["starts with the clock off true time together with Redis's"] += 1
        ctx.run(PROCESS.set, process)
        host.process = process
        self.processes.append(process)

        def build() -> None:
            generator = Generator(config.min_id, clock=host.clock, max_backwards_wait=1.0, block_on_clock=False)
            generator.set_fence(0, "waiting for a worker id lease")
            keeper = LeaseKeeper(
                self.target,
                config.timings,
                config.min_id,
                config.max_id,
                skew_warn=config.skew_max / 2,
                skew_max=config.skew_max,
                start_timeout=3 * config.ttl,
            )
            keeper.link.finder = SimFinder(self.redis, process, keeper.link.finder.timeout)  # type: ignore[assignment]
            process.keeper, process.generator = keeper, generator

        ctx.run(build)
        assert process.keeper is not None and process.generator is not None
        task = self.loop.create_task(process.keeper.run(process.generator), context=ctx)
        task.add_done_callback(lambda t, p=process: self._ended(p, t))
        process.tasks.append(task)
        self.trace(f"start {process.name} (clock {host.clock.offset:+.3f}s)")

    def _ended(self, process: Process, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or process.state != "running":
            return
        exc = task.exception()
        if isinstance(exc, LeaseError):
            process.state = "exited"
            process.exit = str(exc)
            self.stats["exited: " + re.sub(r"[-+]?\d[\d.]*s?", "N", str(exc).split(":")[0])[:70]] += 1
            self.trace(f"{process.name} exited: {exc}")
            self.restart_later(process.host, self.rng.uniform(0.5, self.config.ttl))
            return
        self.fail(f"{process.name}'s lease keeper died: {exc!r}" if exc else f"{process.name}'s lease keeper returned")

    def restart_later(self, host: Host, delay: float) -> None:
        when = self.loop.now + delay
        host.restart_at = when

        def again() -> None:
            if host.restart_at == when:
                self.start(host)

        self.loop.call_at(when, again, context=ROOT)

    def crash(self, process: Process) -> None:
        process.state = "crashed"
        process.crashed = True
        process.paused_until = 0.0
        if process.keeper is not None:
            process.ctx.run(process.keeper.watch.disarm)
        for task in process.tasks:
            task.cancel()

    def stop(self, process: Process) -> None:
        """A clean stop, as the daemon does it: stop serving, close the generator, release the id with
        the last millisecond issued (within 1.5 s)."""
        process.state = "stopping"
        keeper, generator = process.keeper, process.generator
        assert keeper is not None and generator is not None

        async def stopping() -> None:
            with contextlib.suppress(GenerationError):
                generator.close()
            last_ms = generator.last_issued_ms or 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(keeper.stop(last_ms), 1.5)
            if process.state == "stopping":
                process.state = "stopped"
            self.trace(f"{process.name} stopped")

        process.tasks.append(self.loop.create_task(stopping(), context=process.ctx))

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message

    # -- running -----------------------------------------------------------------------------------
    def request(self, process: Process | None = None) -> None:
        if process is None:
            live = [h.process for h in self.hosts if h.process is not None and h.process.live]
            ready = [p for p in live if p.paused_until <= self.loop.now]
            if not ready:
                return
            process = self.rng.choice(ready)
        generator = process.generator
        assert generator is not None
        count = self.rng.choice((1, 1, 1, 2, 5, 10, 100))
        self.checker.requests += 1
        try:
            ids = generator.next_ids(count) if count > 1 else [generator.next_id()]
        except GenerationError as exc:
            self.checker.refused[type(exc).__name__] += 1
            return
        self.checker.issued(process, ids, self.loop.now)
        self.digest.update(ids[-1].to_bytes(8, "big"))

    def woken(self, process: Process, until: float) -> None:
        """A paused daemon wakes: it serves the requests that queued up meanwhile (one to three)."""
        if process.paused_until != until or not process.live:
            return
        for _ in range(self.rng.randint(1, 3)):
            try:
                self.request(process)
            except Violation as exc:
                self.fail(str(exc))
                return

    def calm_ended(self) -> None:
        """At the end of a calm stretch the fleet should serve again: as many daemons as there are ids
        (or every daemon, if fewer), unless a host's clock is out of bounds or Redis is not back."""
        live = [h.process for h in self.hosts if h.process is not None and h.process.live]
        serving = sum(1 for p in live if p.generator is not None and p.generator.check() is None)
        expected = min(len(live), self.config.max_id - self.config.min_id + 1)
        self.calm_results["serving" if serving >= expected else "not serving"] += 1
        if serving < expected:
            self.trace(f"calm ended with {serving} of {expected} serving")

    async def drive(self) -> None:
        self.build()
        rng = self.rng
        for step_no in range(self.steps):
            self.step_no = step_no
            roll = rng.random()
            if roll < 0.5:
                self.request()
            else:
                # Time moves in small ticks in a storm, faster in a calm stretch (fewer steps to recover).
                await asyncio.sleep(rng.uniform(0.001, 0.04 if self.faults.phase == "storm" else 0.25))
            self.faults.step()
            self.checker.could_issue(self.processes, self.loop.now)
            if self.failure is not None:
                raise Violation(self.failure)
            if self.loop.errors:
                raise Violation(f"a callback raised: {self.loop.errors[0]}")
            if self.redis.script_errors:
                raise Violation(f"a lease script failed in Redis: {self.redis.script_errors[0]}")

    def run(self) -> Result:
        started = real_time.perf_counter()
        error: str | None = None
        with simulated_leasing(self):
            try:
                self.loop.run_until_complete(self.drive())
            except Violation as exc:
                error = str(exc)
            finally:
                self._collect()
                for process in self.processes:
                    for task in process.tasks:
                        task.cancel()
                with contextlib.suppress(Exception):
                    self.loop.run_until_complete(asyncio.sleep(0.01))
                self.loop.close()
        return Result(
            seed=self.seed,
            steps=self.step_no + 1,
            virtual_seconds=self.loop.now,
            wall_seconds=real_time.perf_counter() - started,
            ids=self.checker.ids,
            requests=self.checker.requests,
            refused=dict(self.checker.refused),
            faults=dict(self.faults.counts),
            stats=dict(self.stats),
            calm=dict(self.calm_results),
            scripts=self.redis.scripts,
            config=self.config,
            error=error,
            step_of_error=self.step_no if error else None,
            digest=self.digest.hexdigest()[:16],
            planted=_PLANTED,
            known_gaps=self.known_gaps,
        )

    def _collect(self) -> None:
        for process in self.processes:
            if process.keeper is None:
                continue
            s = process.keeper.stats
            for name in (
                "acquires",
                "renewals",
                "renew_failures",
                "worker_id_changes",
                "data_loss_events",
                "redis_changes",
                "kept_through_change",
                "quarantined_ids",
                "skipped_live_leases",
                "redis_clock_steps",
                "master_changes",
                "replica_ack_failures",
            ):
                self.stats[name] += getattr(s, name)


@dataclass
class Result:
    seed: int
    steps: int
    virtual_seconds: float
    wall_seconds: float
    ids: int
    requests: int
    refused: dict[str, int]
    faults: dict[str, int]
    stats: dict[str, int]
    calm: dict[str, int]
    scripts: int
    config: Config
    error: str | None
    step_of_error: int | None
    digest: str
    planted: str | None = None
    known_gaps: bool = False

    def replay(self, script: str = "tests/sim_leasing.py") -> str:
        plant = f" --plant {self.planted}" if self.planted else ""
        plant += " --known-gaps" if self.known_gaps else ""
        return f"python {script} --seed {self.seed} --steps {self.steps}{plant} --trace"


@contextlib.contextmanager
def simulated_leasing(sim: Simulation) -> Iterator[None]:
    """Point the leasing modules' clocks at the simulation (their ``time`` is the running process's
    host clocks), number tokens and pool epochs, and seed the global ``random`` the keepers jitter with;
    everything put back afterwards. The production code is not changed: only what it reads."""
    patched: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        patched.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for info in pkgutil.iter_modules(leasing_pkg.__path__):
        module = importlib.import_module(f"katsubushi_py.leasing.{info.name}")
        if getattr(module, "time", None) is real_time:
            patch(module, "time", SIM_TIME)

    def token() -> str:
        process = PROCESS.get()
        process.tokens += 1
        return f"{process.name}-{process.tokens}"

    def epoch() -> str:
        sim.epochs += 1
        return f"epoch-{sim.seed}-{sim.epochs}"

    patch(keeper_module, "new_token", token)
    patch(keeper_module, "new_epoch", epoch)
    state = random.getstate()
    random.seed(sim.seed)
    level = logging.getLogger("katsubushi_py").level
    handler: logging.Handler | None = None
    if sim.tracing:
        handler = _TraceHandler(sim)
        logging.getLogger("katsubushi_py").addHandler(handler)
        logging.getLogger("katsubushi_py").setLevel(logging.INFO)
    else:
        logging.getLogger("katsubushi_py").setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for obj, name, value in reversed(patched):
            setattr(obj, name, value)
        random.setstate(state)
        logging.getLogger("katsubushi_py").setLevel(level)
        if handler is not None:
            logging.getLogger("katsubushi_py").removeHandler(handler)


class _TraceHandler(logging.Handler):
    def __init__(self, sim: Simulation) -> None:
        super().__init__()
        self.sim = sim

    def emit(self, record: logging.LogRecord) -> None:
        process = PROCESS.get()
        who = process.name if process is not None else "-"
        self.sim.trace(f"[{who}] {record.levelname} {record.getMessage()}")


# -- planted bugs: the simulator must find them (tests/test_sim_leasing.py) --------------------------------
@contextlib.contextmanager
def planted_bug(name: str | None) -> Iterator[None]:
    """Break the production code on purpose, to show the simulation finds the break: ``no-fence`` (the
    generator ignores its lease deadline: a daemon paused or cut off past its lease keeps issuing),
    ``wall-clock-check`` (the start-up clock check reads the wall clock as it is now, not the generator's
    clock: the bug seed 1 found, fixed in keeper.check_clock), ``replicas-once-a-minute`` (the replica
    count asked once a minute, not by every lease write: the two-masters window, fixed in link.py)."""
    global _PLANTED
    if name is None:
        yield
        return
    if name not in PLANTED_BUGS:
        raise ValueError(f"no planted bug called {name!r}: {', '.join(PLANTED_BUGS)}")
    _PLANTED = name
    try:
        with _plant(name):
            yield
    finally:
        _PLANTED = None


_PLANTED: str | None = None


@contextlib.contextmanager
def _plant(name: str) -> Iterator[None]:
    if name == "no-fence":
        original = Generator.set_fence

        def set_fence(self: Generator, deadline_ns: int | None, reason: str | None = None) -> None:
            original(self, None if deadline_ns else deadline_ns, reason)

        Generator.set_fence = set_fence  # type: ignore[method-assign]
        try:
            yield
        finally:
            Generator.set_fence = original  # type: ignore[method-assign]
        return
    if name == "wall-clock-check":
        check = LeaseKeeper.check_clock

        async def check_clock(self: LeaseKeeper) -> float:
            generator, self.generator = self.generator, None  # the keeper falls back on time.time()
            try:
                return await check(self)
            finally:
                self.generator = generator

        LeaseKeeper.check_clock = check_clock  # type: ignore[method-assign]
        try:
            yield
        finally:
            LeaseKeeper.check_clock = check  # type: ignore[method-assign]
        return
    if name == "replicas-once-a-minute":
        run = RedisLink.run
        RedisLink.run = _run_counting_once_a_minute  # type: ignore[method-assign]
        try:
            yield
        finally:
            RedisLink.run = run  # type: ignore[method-assign]
        return
    raise ValueError(f"no planted bug called {name!r}: {', '.join(PLANTED_BUGS)}")


async def _run_counting_once_a_minute(
    self: RedisLink, script: str, args: list[Any], durable: bool = True
) -> tuple[list[Any], str, bool]:
    """``RedisLink.run`` before the two-masters window was closed (issue 23): the replica count asked
    (``REPLICAS_LUA``) on a new connection and then once a minute (3 ttl here, as the simulation had
    it), not by every lease write."""
    client = await self.connected()
    keys, wait_ms, now = self.keys.all, int(self.timings.renew * 250), link_module.time.monotonic()
    fixed = self.target.replica_acks
    asked = getattr(self, "_asked", -math.inf)
    refresh = durable and fixed is None and (self._replicas is None or now - asked >= 3 * self.timings.ttl)
    needed = fixed if fixed is not None else (self._replicas or 0)
    pipe = client.pipeline(transaction=False)
    pipe.eval(script, len(keys), *keys, *args)
    pipe.execute_command("CLIENT", "ID")
    if refresh:
        pipe.eval(REPLICAS_LUA, len(keys), *keys)
    elif durable and needed:
        pipe.execute_command("WAIT", needed, wait_ms)
    replies = await pipe.execute()
    self.stats.round_trips += 1
    result, connection = replies[0], int(replies[1])
    new_connection, self.connection_id = connection != self.connection_id, connection
    if not durable:
        return result, "", new_connection
    if refresh:
        needed = self._replicas = int(replies[2])
        self._asked = now  # type: ignore[attr-defined]
        if not needed:
            return result, "", new_connection
        acked = int(await client.execute_command("WAIT", needed, wait_ms))
    elif needed:
        acked = int(replies[2])
    else:
        return result, "", new_connection
    if acked < needed:
        self._replicas = None
        return result, f"only {acked} of {needed} replicas acknowledged it within {wait_ms} ms", new_connection
    return result, "", new_connection


PLANTED_BUGS = ("no-fence", "wall-clock-check", "replicas-once-a-minute")


# -- running worlds ------------------------------------------------------------------------------------
@contextlib.contextmanager
def backend() -> Iterator[Backend]:
    """A redis-server of our own (no persistence, 16 databases, a unix socket) for the scripts."""
    from redis_servers import start_redis

    with tempfile.TemporaryDirectory(prefix="kp-sim-") as tmp:
        sock = os.path.join(tmp, "redis.sock")
        server = start_redis(Path(tmp), "--unixsocket", sock, "--unixsocketperm", "700", "--databases", "16")
        try:
            b = Backend(sock)
            try:
                yield b
            finally:
                b.close()
        finally:
            server.stop()


def run_seeds(
    seeds: list[int], steps: int, trace: bool = False, out: Any = None, known_gaps: bool = False
) -> list[Result]:
    results = []
    with backend() as b:
        for seed in seeds:
            result = Simulation(seed, steps, b, trace=trace, known_gaps=known_gaps).run()
            results.append(result)
            if out is not None:
                print(summary_line(result), file=out, flush=True)
    return results


def summary_line(r: Result) -> str:
    c = r.config
    world = (
        f"{c.hosts} hosts, ids {c.min_id}..{c.max_id}, {c.replicas} replicas"
        f"{' acks=0' if c.replica_acks == 0 else ''}, ttl {c.ttl:g}s, skew {c.skew_max:g}s"
    )
    head = f"seed {r.seed}: {'FAILED' if r.error else 'ok'} ({world})"
    body = (
        f"{r.steps} steps, {r.virtual_seconds:.0f}s simulated in {r.wall_seconds:.1f}s, {r.ids} IDs,"
        f" {sum(r.faults.values())} faults, {r.scripts} scripts, digest {r.digest}"
    )
    if r.error:
        return f"{head}\n  at step {r.step_of_error}: {r.error}\n  replay: {r.replay()}"
    return f"{head}: {body}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seed", type=int, help="run this one seed (a failure prints it)")
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds to run (default 10)")
    parser.add_argument("--first-seed", type=int, help="the first of --seeds consecutive seeds (default: random)")
    parser.add_argument("--steps", type=int, default=5000, help="steps per seed (default 5000)")
    parser.add_argument("--trace", action="store_true", help="print every fault, daemon event and log line")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument(
        "--known-gaps",
        action="store_true",
        help="let faults reach the documented gaps (docs/guarantees.md): runs may then fail",
    )
    parser.add_argument("--plant", choices=PLANTED_BUGS, help="break the production code on purpose (see planted_bug)")
    args = parser.parse_args(argv)
    if args.seed is not None:
        seeds = [args.seed]
    else:
        first = args.first_seed if args.first_seed is not None else random.SystemRandom().randrange(1, 10**9)
        seeds = list(range(first, first + args.seeds))
    started = real_time.perf_counter()
    with planted_bug(args.plant):
        results = run_seeds(seeds, args.steps, trace=args.trace, out=sys.stdout, known_gaps=args.known_gaps)
    failed = [r for r in results if r.error]
    total_steps = sum(r.steps for r in results)
    faults: Counter[str] = Counter()
    stats: Counter[str] = Counter()
    calm: Counter[str] = Counter()
    for r in results:
        faults.update(r.faults)
        stats.update(r.stats)
        calm.update(r.calm)
    elapsed = real_time.perf_counter() - started
    print(
        f"\n{len(results)} seeds ({seeds[0]}..{seeds[-1]}), {total_steps} steps, "
        f"{sum(r.virtual_seconds for r in results):.0f}s simulated, {sum(r.ids for r in results)} IDs, "
        f"{sum(faults.values())} faults in {elapsed:.0f}s ({total_steps / elapsed:.0f} steps/s); "
        f"{len(failed)} failed"
    )
    print("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(faults.items())))
    print("keepers: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.items())))
    print("calm stretches: " + ", ".join(f"{k} {v}" for k, v in sorted(calm.items())))
    if args.json:
        import json
        from dataclasses import asdict

        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    for r in failed:
        print(f"FAILED seed {r.seed} at step {r.step_of_error}: {r.error}\n  replay: {r.replay()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The pieces of a simulated world (tests/sim_leasing.py): what a world is drawn as (:class:`Config`),
its hosts and the daemons they run (:class:`Host`, :class:`Process`), true time's origin, and the
exception an invariant raises.

Kept apart from the simulation that moves them (sim_world.py), the faults that strike them
(sim_faults.py) and the invariants over them (sim_checker.py) so that each of those can name these
types without importing the others: the one module everything in the simulator depends on, and that
depends on nothing of the simulator's but the host clock (sim_loop.py).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
from dataclasses import dataclass, field
from typing import Any

from sim_loop import HostClock

from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing.keeper import LeaseKeeper, LeaseTimings

BASE_UNIX = 1_795_305_600.0  # true time 0: 2026-11-22T00:00:00Z
WORKER_SHIFT, WORKER_MASK = 12, 1023


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

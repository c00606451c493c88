"""One world of the leasing simulation (tests/sim_leasing.py), from its seed: :class:`Simulation` builds it
(Redis nodes, hosts, a daemon on each), runs the daemons (start, crash, clean stop, restart, client
requests served from their generators), keeps the faults within the documented conditions (the guards
across a loss of Redis's data) and drives the steps, checking the invariants after each; it returns a
:class:`Result`. :func:`simulated_leasing` points the production leasing modules at the simulated
clocks while a world runs.

The daemons' model lives here, not with the faults (sim_faults.py), because the faults and the driver
both start and stop daemons through it, and the guards read the daemons' clocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import importlib
import logging
import pkgutil
import random
import re
import time as real_time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import sim_planted
from sim_checker import Checker
from sim_faults import Faults
from sim_loop import PROCESS, ROOT, SIM_TIME, HostClock, VirtualLoop
from sim_model import BASE_UNIX, Config, Host, Process, Violation
from sim_redis import RedisWorld
from sim_redis_backend import Backend
from sim_redis_client import SimFinder

import katsubushi_py.leasing as leasing_pkg
from katsubushi_py.issuing.errors import GenerationError
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing import acquiring as acquiring_module
from katsubushi_py.leasing import keeper as keeper_module
from katsubushi_py.leasing.keeper import LeaseKeeper
from katsubushi_py.leasing.scripts import INIT_LUA
from katsubushi_py.leasing.settings import SettingsWatch
from katsubushi_py.leasing.target import LeaseError, RedisTarget


class _Unchecked(SettingsWatch):
    """No check of Redis's settings (issue 32): the simulated nodes model the every-replica rule
    (``min-replicas-to-write`` 0, or ``replica_acks``), and no CONFIG round trip changes what a seed
    replays. What start-up refuses and the ``min-replicas-to-write`` rule are tested with real
    processes (tests/test_redis_settings.py)."""

    async def at_start(self) -> None:
        return None

    def poke(self, forced: bool = False) -> None:
        return None


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
            keeper.settings = _Unchecked(self.target, keeper.link, config.timings.ttl)
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
            planted=sim_planted.planted_now(),
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

    for module in (keeper_module, acquiring_module):  # the keeper and its acquire side
        if hasattr(module, "new_token"):
            patch(module, "new_token", token)
        patch(module, "new_epoch", epoch)
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

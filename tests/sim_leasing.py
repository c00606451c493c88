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

**Layout**: this file is the entry point (the command line above, and ``run_seeds`` and the names
tests/test_sim_leasing.py imports); the simulator is split by concern so that each part can be read
alone: sim_loop.py (the virtual clock and event loop, host clocks), sim_redis.py (Redis around the real
scripts; the scripts and the redis-server they run in are sim_redis_backend.py, the daemons' redis-py side
sim_redis_client.py), sim_model.py (a world's configuration, hosts and daemons), sim_world.py (one world:
building it, running its daemons, the guards, the steps), sim_faults.py (the faults and their schedule),
sim_checker.py (the invariants) and sim_planted.py (the bugs planted on purpose).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time as real_time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_faults import Faults
from sim_model import Config, Violation
from sim_planted import PLANTED_BUGS, planted_bug
from sim_redis_backend import Backend
from sim_world import Result, Simulation

__all__ = ["PLANTED_BUGS", "Config", "Faults", "Result", "Simulation", "Violation", "main", "planted_bug", "run_seeds"]


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

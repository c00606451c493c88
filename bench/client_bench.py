"""The Python client's cost per call, beside plain pymemcache on the same daemon, in one process.

    pip install -e '.[bench]'    (aiomcache, for the asyncio reference row, comes with '.[test]')
    python bench/client_bench.py [--runs 7] [--seconds 1] [--quick]

One katsubushi-py daemon (pinned to CPU 0, as in server_bench.py) serves every subject; this process
pins itself to CPU 0 too, since one request in flight makes a wake-up across CPUs the largest cost
on these VMs. Subjects run one call at a time, in alternation (A B C ... A B C ...) so that noise from
a shared machine lands on all of them alike, and the table shows the median of the runs, as wall time
per call and as this process's CPU time per call (the client's own cost; the daemon shares the CPU,
so the wall time also carries its work and any other load):

- pymemcache ``get`` (one ID) and ``get_many`` (100 IDs) on one connection: the floor a memcached
  client in Python sets;
- ``Client.fetch()`` and ``Client.fetch_many(100)``: the same work plus the pool, the failover plan,
  the deadline sockets and the reply checks; also ``fetch()`` with a dead first server backing off;
- ``AsyncClient.fetch()`` and, when installed, aiomcache's ``get`` on the same event loop (uvloop when
  installed), as the asyncio reference.

Every subject's IDs are checked to increase within a run (one daemon, one call at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import free_port, katsubushi_cmd, log, machine, start

from katsubushi_py.client import AsyncClient, Client
from katsubushi_py.client.replies import KEYS

BATCH = 100


Sample = tuple[float, float]  # (wall µs per call, this process's CPU µs per call)


def measure(step: Callable[[], list[int]], seconds: float) -> Sample:
    """Wall and CPU microseconds per call of ``step`` over ``seconds``; its IDs must keep increasing."""
    calls = 0
    last = 0
    clock = time.perf_counter
    cpu_start = time.process_time()
    start_time = clock()
    end = start_time + seconds
    while True:
        for _ in range(32):
            ids = step()
            if ids[0] <= last:
                raise SystemExit(f"IDs did not increase: {last} then {ids[0]}")
            last = ids[-1]
        calls += 32
        now = clock()
        if now >= end:
            return (now - start_time) / calls * 1e6, (time.process_time() - cpu_start) / calls * 1e6


def async_measure(loop: asyncio.AbstractEventLoop, fetch: Callable[[], object], seconds: float) -> Sample:
    """:func:`measure` for a coroutine function returning one ID, run on ``loop``."""

    async def run() -> Sample:
        calls = 0
        last = 0
        clock = time.perf_counter
        cpu_start = time.process_time()
        start_time = clock()
        end = start_time + seconds
        while True:
            for _ in range(32):
                id_ = int(await fetch())  # type: ignore[misc]
                if id_ <= last:
                    raise SystemExit(f"IDs did not increase: {last} then {id_}")
                last = id_
            calls += 32
            now = clock()
            if now >= end:
                return (now - start_time) / calls * 1e6, (time.process_time() - cpu_start) / calls * 1e6

    return loop.run_until_complete(run())


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main() -> None:
    parser = argparse.ArgumentParser(description="katsubushi_py.client vs pymemcache, per call")
    parser.add_argument("--runs", type=int, default=7, help="alternating runs per subject (default 7)")
    parser.add_argument("--seconds", type=float, default=1.0, help="seconds per run (default 1)")
    parser.add_argument("--quick", action="store_true", help="1 run of 0.2 s each: checks that everything works")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 0.2
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {0})

    from pymemcache.client.base import Client as Pymemcache

    port = free_port()
    server = start("katsubushi-py", katsubushi_cmd(port, None), port, None, True)
    address = f"127.0.0.1:{port}"
    dead = f"127.0.0.1:{free_port()}"
    loop = new_loop()
    try:
        plain = Pymemcache(("127.0.0.1", port), connect_timeout=1, timeout=1, no_delay=True)
        client = Client(address)
        behind_dead = Client([dead, address], backoff=3600, max_backoff=3600)
        aclient = AsyncClient(address)
        keys = list(KEYS[:BATCH])

        subjects: dict[str, Callable[[], Sample]] = {
            "pymemcache get, 1 ID": lambda: measure(lambda: [int(plain.get(b"id"))], args.seconds),
            "Client.fetch()": lambda: measure(lambda: [client.fetch()], args.seconds),
            "Client.fetch(), first server dead and backing off": lambda: measure(
                lambda: [behind_dead.fetch()], args.seconds
            ),
            f"pymemcache get_many, {BATCH} IDs": lambda: measure(
                lambda: [int(v) for v in plain.get_many(keys).values()], args.seconds
            ),
            f"Client.fetch_many({BATCH})": lambda: measure(lambda: client.fetch_many(BATCH), args.seconds),
            "AsyncClient.fetch()": lambda: async_measure(loop, aclient.fetch, args.seconds),
        }
        try:
            import aiomcache

            amc = aiomcache.Client("127.0.0.1", port, pool_size=1)
            subjects["aiomcache get, 1 ID"] = lambda: async_measure(loop, lambda: amc.get(b"id"), args.seconds)
        except ImportError:
            log("aiomcache is not installed: no asyncio reference row")

        for measure_once in subjects.values():  # warm up: connections, first-call costs
            measure_once()
        samples: dict[str, list[Sample]] = {name: [] for name in subjects}
        for run in range(args.runs):
            for name, measure_once in subjects.items():
                samples[name].append(measure_once())
            log(f"run {run + 1}/{args.runs} done")
    finally:
        server.stop()
        loop.close()

    wall = {name: statistics.median(w for w, _ in values) for name, values in samples.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in samples.items()}
    baselines = {
        "Client.fetch()": "pymemcache get, 1 ID",
        "Client.fetch(), first server dead and backing off": "pymemcache get, 1 ID",
        f"Client.fetch_many({BATCH})": f"pymemcache get_many, {BATCH} IDs",
        "AsyncClient.fetch()": "aiomcache get, 1 ID",
    }
    print(f"Client overhead per call: {args.runs} alternating runs of {args.seconds:g} s, medians")
    print(f"({machine()})\n")
    print("| subject | µs per call | client CPU µs per call | overhead vs reference (wall; CPU) |")
    print("|---|---:|---:|---|")
    for name in wall:
        base = baselines.get(name)
        if base in wall:
            versus = f"{wall[name] - wall[base]:+.1f} µs; {cpu[name] - cpu[base]:+.1f} µs CPU (vs {base})"
        else:
            versus = "reference"
        print(f"| {name} | {wall[name]:.1f} | {cpu[name]:.1f} | {versus} |")


if __name__ == "__main__":
    main()

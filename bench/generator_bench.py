"""In-process generator throughput, beside snowflake-id measured in the same run.

    pip install -e '.[bench]'
    taskset -c 0 python bench/generator_bench.py [--runs 7] [--seconds 0.5]

Subjects run in alternation (A B C D A B C D ...) so that noise from the shared machine lands on all
of them alike; the table shows the median of the runs and the ratio to the format ceiling
(4,096 IDs per millisecond) and to snowflake-id's ``next()``. Prints Markdown for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

from katsubushi_py import Generator, __version__

CEILING = 4_096_000


def measure(step: Callable[[], int], seconds: float) -> float:
    """IDs per second: call ``step`` (which returns how many IDs it made) for ``seconds``."""
    clock = time.perf_counter
    made = 0
    start = clock()
    deadline = start + seconds
    while True:
        for _ in range(64):
            made += step()
        now = clock()
        if now >= deadline:
            return made / (now - start)


def subjects() -> dict[str, Callable[[], int]]:
    gen = Generator(1)

    def one() -> int:
        gen.next_id()
        return 1

    def hundred() -> int:
        return len(gen.next_ids(100))

    def bulk() -> int:
        return len(gen.next_ids(4096))

    out = {"katsubushi-py next_id()": one, "katsubushi-py next_ids(100)": hundred, "katsubushi-py next_ids(4096)": bulk}
    try:
        from snowflake import SnowflakeGenerator
    except ImportError:
        print("snowflake-id is not installed: pip install -e '.[bench]'")
        return out
    peer = SnowflakeGenerator(1, epoch=1420070400000)

    def peer_one() -> int:
        # snowflake-id returns None when a millisecond is used up (the caller must retry): count IDs only.
        return 0 if next(peer) is None else 1

    out["snowflake-id 1.0.2 next()"] = peer_one
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    funcs = subjects()
    results: dict[str, list[float]] = {name: [] for name in funcs}
    for _ in range(args.runs):
        for name, step in funcs.items():
            results[name].append(measure(step, args.seconds))
    medians = {name: statistics.median(v) for name, v in results.items()}
    peer = medians.get("snowflake-id 1.0.2 next()")
    affinity = sorted(os.sched_getaffinity(0))
    print(
        f"katsubushi-py {__version__}, Python {platform.python_version()}, {os.cpu_count()} cores,"
        f" {platform.processor() or platform.machine()}, pinned to CPU(s) {affinity}; {args.runs} alternating"
        f" runs of {args.seconds} s each, medians\n"
    )
    print("| subject | IDs/s (median) | min | max | ratio to format ceiling | ratio to snowflake-id |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in results.items():
        ratio = f"{medians[name] / peer:.2f}" if peer else "n/a"
        print(
            f"| {name} | {medians[name]:,.0f} | {min(values):,.0f} | {max(values):,.0f} |"
            f" {medians[name] / CEILING:.3f} | {ratio} |"
        )


if __name__ == "__main__":
    main()

"""katsubushi-py's HTTP and gRPC front ends beside a plain reference, and the memcached path with them.

    pip install -e '.[test]'     # (or '.[grpc]') for the gRPC client
    python bench/http_bench.py [--runs 3] [--seconds 3] [--quick]

What it does:
- installs wrk (the HTTP load generator) from Debian's packages if it is missing and we are root,
  and compiles bench/loadgen.c (server_bench.py's memcached load generator);
- starts, each pinned to CPU 0: katsubushi-py with --http-port and --grpc-port, katsubushi-py with
  neither, and bench/http_floor.py (the same parser on the same loop answering a constant body);
- HTTP: ``/id`` and ``/ids?n=100`` with 1 and 16 keep-alive connections (wrk on CPU 1), alternating
  katsubushi-py and the reference, medians; then an untimed check that the IDs are unique;
- gRPC: ``Generator.Fetch`` calls per second from 16 concurrent calls (bench/grpc_load.py, CPU 1);
- memcached: loadgen's scenarios against the daemon without HTTP/gRPC listeners, with them enabled
  but idle, and with them busy (wrk on ``/id`` and the gRPC client running throughout), alternating.
  The machine has few CPUs: "busy" shares the server's one CPU between the three front ends (that is
  the point: the memcached path keeps its share) and the load generators share CPU 1.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from server_bench import Scenario, build_loadgen, free_port, log, machine, run_loadgen, start  # noqa: E402


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    if os.geteuid() != 0:
        sys.exit("wrk is not installed: apt-get install wrk (needs root)")
    log("wrk is missing: installing it from Debian's packages (apt-get install wrk)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, env=env)
    path = shutil.which("wrk")
    if not path:
        sys.exit("wrk could not be installed")
    return path


def katsubushi(port: int, http_port: int | None = None, grpc_port: int | None = None) -> list[str]:
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "katsubushi_py", "--worker-id", "1", "--port", str(port)]
    cmd += ["--log-level", "warn", "--idle-timeout", "0"]
    # Its own state directory: two daemons with worker id 1 run at once, and one state file is one daemon's.
    cmd += ["--state-dir", tempfile.mkdtemp(prefix="khttp-state-")]
    if http_port:
        cmd += ["--http-port", str(http_port)]
    if grpc_port:
        cmd += ["--grpc-port", str(grpc_port)]
    return cmd


_UNITS = {"us": 1.0, "ms": 1000.0, "s": 1_000_000.0}


def run_wrk(wrk: str, url: str, conns: int, seconds: float) -> dict[str, float]:
    cmd = ["taskset", "-c", "1", wrk, "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--latency", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    if "Non-2xx" in out or re.search(r"Socket errors: .*[1-9]", out):
        sys.exit(f"wrk saw errors against {url}:\n{out}")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not rps:
        sys.exit(f"could not read wrk's output:\n{out}")
    result = {"rps": float(rps.group(1))}
    for pct in ("50", "99"):
        match = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.MULTILINE)
        result[f"p{pct}_us"] = float(match.group(1)) * _UNITS[match.group(2)] if match else float("nan")
    return result


def grpc_load(port: int, seconds: float, concurrency: int = 16) -> dict[str, object]:
    cmd = ["taskset", "-c", "1", sys.executable, str(HERE / "grpc_load.py"), "--port", str(port)]
    cmd += ["--seconds", str(seconds), "--concurrency", str(concurrency)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        sys.exit(f"gRPC load client failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not result["unique"]:
        sys.exit("gRPC: duplicate IDs")
    return result


def verify_http_ids(port: int, requests: int = 300) -> int:
    """Untimed: IDs from /ids?n=100 on one keep-alive connection are unique and increasing."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    ids: list[int] = []
    for _ in range(requests):
        conn.request("GET", "/ids?n=100")
        ids += [int(x) for x in conn.getresponse().read().split(b"\n")]
    conn.close()
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        sys.exit("HTTP: duplicate or decreasing IDs")
    return len(ids)


def median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="HTTP and gRPC front ends, and the memcached path beside them")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per scenario (default 3)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per run (default 3; wrk rounds to whole)")
    parser.add_argument("--quick", action="store_true", help="1 run of 1 s each: checks that everything works")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 1.0
    wrk = ensure_wrk()
    workdir = Path(tempfile.mkdtemp(prefix="khttp-"))
    loadgen = build_loadgen(workdir)
    port, http_port, grpc_port, plain_port, floor_port = (free_port() for _ in range(5))
    servers = [
        start("katsubushi-py", katsubushi(port, http_port, grpc_port), port, None, True),
        start("katsubushi-py, no HTTP/gRPC", katsubushi(plain_port), plain_port, None, True),
        start(
            "reference",
            ["taskset", "-c", "0", sys.executable, str(HERE / "http_floor.py"), str(floor_port)],
            floor_port,
            None,
            False,
        ),
    ]
    full, plain, _ = servers
    http_rows: list[tuple[str, list[dict[str, float]], list[dict[str, float]]]] = []
    mc_rows: list[tuple[str, dict[str, list[dict[str, float]]]]] = []
    try:
        for path in ("/id", "/ids?n=100"):
            for conns in (1, 16):
                ours: list[dict[str, float]] = []
                ref: list[dict[str, float]] = []
                for run in range(args.runs):
                    pair = [(ours, http_port), (ref, floor_port)]
                    for rows, p in pair if run % 2 == 0 else pair[::-1]:
                        rows.append(run_wrk(wrk, f"http://127.0.0.1:{p}{path}", conns, args.seconds))
                name = f"HTTP {path}, {conns} connection{'s' if conns > 1 else ''}"
                ours_rps, ref_rps = median(ours, "rps"), median(ref, "rps")
                log(f"{name:36s} katsubushi-py {ours_rps:>9,.0f} req/s  reference {ref_rps:>9,.0f}")
                http_rows.append((name, ours, ref))
        verified = verify_http_ids(http_port)
        grpc_runs = [grpc_load(grpc_port, args.seconds) for _ in range(args.runs)]
        grpc_rps = statistics.median(float(r["calls_per_s"]) for r in grpc_runs)  # type: ignore[arg-type]
        log(f"gRPC Fetch, 16 concurrent calls: {grpc_rps:,.0f} calls/s")

        scenarios = [
            Scenario("1 connection, sequential GET", ["--conns", "1", "--depth", "1"], 1, "tcp", "rps"),
            Scenario("16 connections, sequential each", ["--conns", "16", "--depth", "1"], 1, "tcp", "rps"),
            Scenario("4 connections, 16 pipelined each", ["--conns", "4", "--depth", "16"], 1, "tcp", "rps"),
        ]
        busy_http: list[float] = []
        busy_grpc: list[float] = []
        for sc in scenarios:
            samples: dict[str, list[dict[str, float]]] = {"no listeners": [], "idle": [], "busy": []}
            for run in range(args.runs):
                order = ["no listeners", "idle", "busy"]
                for mode in order[run % 3 :] + order[: run % 3]:
                    if mode == "busy":
                        span = args.seconds + 2
                        background = [
                            subprocess.Popen(
                                [
                                    "taskset",
                                    "-c",
                                    "1",
                                    wrk,
                                    "-t1",
                                    "-c4",
                                    f"-d{round(span)}s",
                                    f"http://127.0.0.1:{http_port}/id",
                                ],
                                stdout=subprocess.PIPE,
                                text=True,
                            ),
                            subprocess.Popen(
                                [
                                    "taskset",
                                    "-c",
                                    "1",
                                    sys.executable,
                                    str(HERE / "grpc_load.py"),
                                    "--port",
                                    str(grpc_port),
                                    "--seconds",
                                    str(span),
                                    "--concurrency",
                                    "4",
                                ],
                                stdout=subprocess.PIPE,
                                text=True,
                            ),
                        ]
                        time.sleep(1.0)  # both loads under way
                        samples[mode].append(run_loadgen(loadgen, full, sc, args.seconds))
                        wrk_out, grpc_out = (p.communicate(timeout=span + 60)[0] for p in background)
                        rps = re.search(r"Requests/sec:\s+([\d.]+)", wrk_out)
                        busy_http.append(float(rps.group(1)) if rps else float("nan"))
                        busy_grpc.append(json.loads(grpc_out.strip().splitlines()[-1])["calls_per_s"])
                    else:
                        target = plain if mode == "no listeners" else full
                        samples[mode].append(run_loadgen(loadgen, target, sc, args.seconds))
                    log(f"memcached {sc.name:36s} {mode:12s} {samples[mode][-1]['rps']:>9,.0f} req/s")
            mc_rows.append((sc.name, samples))
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"Machine: {machine()}.")
    print(
        f"{args.runs} alternating runs of {args.seconds:g} s per scenario; medians. Servers pinned to CPU 0, load"
        " generators (wrk -t1, loadgen, the gRPC client) to CPU 1. The reference is bench/http_floor.py: httptools on"
        f" uvloop answering a constant body. An untimed check of {verified:,} IDs from /ids?n=100 found no duplicate.\n"
    )
    print("| HTTP scenario | katsubushi-py | reference | ratio | katsubushi-py p50 / p99 | reference p50 / p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ours, ref in http_rows:
        print(
            f"| {name} | {median(ours, 'rps'):,.0f} req/s | {median(ref, 'rps'):,.0f} req/s |"
            f" {median(ours, 'rps') / median(ref, 'rps'):.2f} |"
            f" {median(ours, 'p50_us'):.0f} / {median(ours, 'p99_us'):.0f} us |"
            f" {median(ref, 'p50_us'):.0f} / {median(ref, 'p99_us'):.0f} us |"
        )
    print(f"| gRPC Fetch, 16 concurrent calls | {grpc_rps:,.0f} calls/s | | | | |")
    print()
    print("| memcached scenario | no HTTP/gRPC listeners | listeners idle | listeners busy | busy / none |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in mc_rows:
        none, idle, busy = (median(samples[m], "rps") for m in ("no listeners", "idle", "busy"))
        print(f"| {name} | {none:,.0f} req/s | {idle:,.0f} req/s | {busy:,.0f} req/s | {busy / none:.2f} |")
    print(
        f"\nWhile busy, the HTTP /id load (wrk, 4 connections) got {statistics.median(busy_http):,.0f} req/s and"
        f" the gRPC Fetch load (4 concurrent calls) {statistics.median(busy_grpc):,.0f} calls/s (medians) from the"
        " same server CPU."
    )


if __name__ == "__main__":
    main()

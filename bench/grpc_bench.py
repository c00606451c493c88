"""The gRPC front end under h2load (Debian's nghttp2-client), beside the HTTP front end, and optionally
beside an older checkout (the grpcio server it replaced) in the same run.

    pip install -e '.[test]'
    python bench/grpc_bench.py [--runs 4] [--seconds 3] [--baseline DIR] [--pure] [--quick]

Each subject is a daemon with ``--grpc-port`` and ``--http-port``, pinned to CPU 0 with taskset;
h2load runs on CPU 1, one thread. gRPC calls are h2load's prior-knowledge HTTP/2 (h2c) POSTs with
``content-type: application/grpc`` and ``te: trailers``, the body the 5-byte gRPC prefix and the
message (empty for ``Fetch``; ``n = 100`` for ``FetchMulti``); HTTP requests are h2load ``--h1`` GETs
of ``/id`` and ``/ids?n=100``, so both front ends face the same client. The shapes are
connections x concurrent streams per connection (h2load ``-c`` and ``-m``; HTTP/1.1 has one request
in flight per connection). Rounds alternate: every subject runs a scenario before any runs it again.

Reported per scenario and subject: calls per second and the daemon's CPU time (user + system, read
from /proc before and after) per call, medians of the runs with their range, and per ID for the
scenarios that fetch 100. h2load counts HTTP statuses only, so every gRPC scenario is checked before
the timed runs: the response carries ``grpc-status: 0`` and IDs, unique across calls (curl, untimed).

``--baseline DIR``: also measure the katsubushi-py checked out in DIR (for example ``git archive`` of
the commit before the change, with ``python setup.py build_ext --inplace`` run there), which must
take the same flags. ``--pure``: also this checkout with ``KATSUBUSHI_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from server_bench import cpu_seconds, free_port, log, machine, wait_ready  # noqa: E402

FETCH = b"\x00\x00\x00\x00\x00"  # uncompressed, length 0: FetchRequest{}
FETCH_MULTI_100 = b"\x00\x00\x00\x00\x02\x08\x64"  # FetchMultiRequest{n: 100}


@dataclass
class Scenario:
    name: str
    kind: str  # "grpc" or "http"
    path: str
    conns: int
    streams: int
    ids_per_call: int = 1
    body: bytes = b""


SCENARIOS = [
    Scenario("gRPC Fetch, 1 x 1", "grpc", "/katsubushi.Generator/Fetch", 1, 1, body=FETCH),
    Scenario("gRPC Fetch, 1 x 8", "grpc", "/katsubushi.Generator/Fetch", 1, 8, body=FETCH),
    Scenario("gRPC Fetch, 8 x 1", "grpc", "/katsubushi.Generator/Fetch", 8, 1, body=FETCH),
    Scenario("gRPC FetchMulti n=100, 1 x 8", "grpc", "/katsubushi.Generator/FetchMulti", 1, 8, 100, FETCH_MULTI_100),
    Scenario("HTTP /id, 1 x 1", "http", "/id", 1, 1),
    Scenario("HTTP /id, 8 x 1", "http", "/id", 8, 1),
    Scenario("HTTP /ids?n=100, 8 x 1", "http", "/ids?n=100", 8, 1, 100),
]


@dataclass
class Subject:
    name: str
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    grpc_port: int = 0
    http_port: int = 0

    def start(self) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        cmd = ["taskset", "-c", "0", sys.executable, "-m", "katsubushi_py", "--worker-id", "1", "--port", "0"]
        cmd += ["--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port)]
        cmd += ["--log-level", "warn", "--idle-timeout", "0", "--max-connections", "4096"]
        cmd += ["--state-dir", tempfile.mkdtemp(prefix="kgrpc-state-")]
        env = {**os.environ, **self.env}
        if self.cwd is not None:
            env["PYTHONPATH"] = self.cwd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, cwd=self.cwd)
        wait_ready(self.grpc_port, None, self.proc)
        wait_ready(self.http_port, None, self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def h2load_cmd(h2load: str, subject: Subject, sc: Scenario, seconds: float, body_file: str) -> list[str]:
    cmd = ["taskset", "-c", "1", h2load, "-t", "1", "-c", str(sc.conns), "-m", str(sc.streams)]
    if sc.kind == "grpc":
        cmd += ["-H", "content-type: application/grpc", "-H", "te: trailers", "-d", body_file]
        url = f"http://127.0.0.1:{subject.grpc_port}{sc.path}"
    else:
        cmd += ["--h1"]
        url = f"http://127.0.0.1:{subject.http_port}{sc.path}"
    return [*cmd, "-D", f"{seconds:g}", url]


def run_h2load(h2load: str, subject: Subject, sc: Scenario, seconds: float, body_file: str) -> dict[str, float]:
    assert subject.proc is not None
    cmd = h2load_cmd(h2load, subject, sc, seconds, body_file)
    user0, sys0 = cpu_seconds(subject.proc.pid, split=True)  # type: ignore[misc]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    user1, sys1 = cpu_seconds(subject.proc.pid, split=True)  # type: ignore[misc]
    finished = re.search(r"finished in ([\d.]+)(ms|s), ([\d.]+) req/s", out)
    counts = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", out
    )
    if not finished or not counts:
        sys.exit(f"{subject.name} {sc.name}: could not read h2load's output:\n{out}")
    succeeded, failed, errored = int(counts.group(4)), int(counts.group(5)), int(counts.group(6))
    if failed or errored or not succeeded:
        sys.exit(f"{subject.name} {sc.name}: h2load saw {failed} failed and {errored} errored requests:\n{out}")
    cpu = (user1 - user0) + (sys1 - sys0)
    return {
        "calls_per_s": float(finished.group(3)),
        "calls": succeeded,
        "cpu_us_per_call": cpu * 1e6 / succeeded,
        "user_us_per_call": (user1 - user0) * 1e6 / succeeded,
        "sys_us_per_call": (sys1 - sys0) * 1e6 / succeeded,
    }


def check_grpc(subject: Subject, sc: Scenario, body_file: str, calls: int = 20) -> None:
    """Untimed: each call answers grpc-status 0 with the IDs asked for, all distinct (curl)."""
    curl = shutil.which("curl")
    if curl is None:
        log("curl is missing: the gRPC replies are not checked")
        return
    seen: set[int] = set()
    for _ in range(calls):
        cmd = [curl, "-s", "--http2-prior-knowledge", "-H", "content-type: application/grpc", "-H", "te: trailers"]
        cmd += ["--data-binary", f"@{body_file}", "-D", "-", "-o", body_file + ".out", "--raw"]
        cmd += [f"http://127.0.0.1:{subject.grpc_port}{sc.path}"]
        head = subprocess.run(cmd, capture_output=True, timeout=10).stdout.decode("latin-1")
        if "grpc-status: 0" not in head:
            sys.exit(f"{subject.name} {sc.name}: not grpc-status 0:\n{head}")
        message = Path(body_file + ".out").read_bytes()[5:]
        ids = decode_ids(message)
        if len(ids) != sc.ids_per_call or seen & set(ids) or len(set(ids)) != len(ids):
            sys.exit(f"{subject.name} {sc.name}: wrong or repeated IDs: {ids[:5]}")
        seen.update(ids)


def decode_ids(message: bytes) -> list[int]:
    """The IDs of a FetchResponse (field 1, a varint) or a FetchMultiResponse (field 1, packed)."""
    from katsubushi_py.frontends import katsubushi_pb2 as pb

    if not message:
        return []
    if message[0] == 0x08:
        return [pb.FetchResponse.FromString(message).id]
    return list(pb.FetchMultiResponse.FromString(message).ids)


def spread(values: list[float], fmt: str) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return format(mid, fmt)
    return f"{format(mid, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description="the gRPC front end under h2load, beside HTTP")
    parser.add_argument("--runs", type=int, default=4, help="alternating runs per scenario (default 4)")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per run (default 3)")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the katsubushi-py checked out in DIR")
    parser.add_argument("--pure", action="store_true", help="also measure this checkout's pure-Python hot path")
    parser.add_argument("--only", metavar="TEXT", help="only the scenarios whose name contains TEXT")
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures to FILE")
    parser.add_argument("--quick", action="store_true", help="1 run of 1 s each: checks that everything works")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 1.0
    h2load = shutil.which("h2load")
    if h2load is None:
        sys.exit("h2load is not installed: apt-get install nghttp2-client")
    scenarios = [sc for sc in SCENARIOS if not args.only or args.only in sc.name]
    subjects = [Subject("katsubushi-py")]
    if args.pure:
        subjects.append(Subject("pure Python", env={"KATSUBUSHI_NO_EXTENSIONS": "1"}))
    if args.baseline:
        subjects.append(Subject("baseline", cwd=str(Path(args.baseline).resolve())))
    log(machine())
    workdir = Path(tempfile.mkdtemp(prefix="kgrpc-bench-"))
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        sc.name: {s.name: [] for s in subjects} for sc in scenarios
    }
    try:
        for subject in subjects:
            subject.start()
        bodies = {}
        for sc in scenarios:
            body_file = workdir / f"body-{len(bodies)}.bin"
            body_file.write_bytes(sc.body)
            bodies[sc.name] = str(body_file)
            if sc.kind == "grpc":
                for subject in subjects:
                    check_grpc(subject, sc, str(body_file))
        started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for run in range(args.runs):
            for sc in scenarios:
                order = subjects if run % 2 == 0 else subjects[::-1]
                for subject in order:
                    row = run_h2load(h2load, subject, sc, args.seconds, bodies[sc.name])
                    results[sc.name][subject.name].append(row)
                    rate, cpu = row["calls_per_s"], row["cpu_us_per_call"]
                    user = row["user_us_per_call"]
                    log(f"run {run + 1} {sc.name} {subject.name}: {rate:,.0f}/s, {cpu:.1f} us CPU ({user:.1f} user)")
    finally:
        for subject in subjects:
            subject.stop()
    runs = f"{args.runs} alternating runs of {args.seconds:g} s"
    print(f"Run of {started}; {machine()}; {runs}, daemons on CPU 0, h2load on CPU 1.\n")
    head = "| scenario (connections x streams) | subject | calls/s | server CPU us per call | per ID |"
    print(head + "\n|---|---|---:|---:|---:|")
    for sc in scenarios:
        for subject in subjects:
            rows = results[sc.name][subject.name]
            rate = spread([r["calls_per_s"] for r in rows], ",.0f")
            cpu = spread([r["cpu_us_per_call"] for r in rows], ".1f")
            per_id = (
                f"{statistics.median(r['cpu_us_per_call'] for r in rows) / sc.ids_per_call:.2f}"
                if sc.ids_per_call > 1
                else ""
            )
            print(f"| {sc.name} | {subject.name} | {rate} | {cpu} | {per_id} |")
    if args.baseline:
        print("\n| scenario | calls/s, ours / baseline | CPU per call, baseline / ours |\n|---|---:|---:|")
        for sc in scenarios:
            ours, base = results[sc.name]["katsubushi-py"], results[sc.name]["baseline"]
            ratio_rate = statistics.median(r["calls_per_s"] for r in ours) / statistics.median(
                r["calls_per_s"] for r in base
            )
            ratio_cpu = statistics.median(r["cpu_us_per_call"] for r in base) / statistics.median(
                r["cpu_us_per_call"] for r in ours
            )
            print(f"| {sc.name} | {ratio_rate:.2f} | {ratio_cpu:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"started": started, "machine": machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()

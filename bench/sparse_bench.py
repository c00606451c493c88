#!/usr/bin/env python3
"""Sparse traffic: one 1-key GET every 2 ms on one connection, plain and TLS, beside memcached.

A daemon per application server mostly sees this: requests far apart, each in a millisecond of its
own, so each one meets a new millisecond's bucket (where bench/server_bench.py and bench/tls_bench.py,
at full speed, put a few dozen requests in each). The figure is the server's CPU per request over the
whole run, idle time between requests included (timers, sweeps, memcached's clock thread), read from
``/proc/<pid>/task/*/schedstat`` (nanoseconds, every thread; ``/proc/<pid>/stat`` counts 10 ms ticks,
too coarse for a run of a few thousand requests).

Servers: katsubushi-py plain and with ``--tls-cert``, memcached plain and with ``-Z`` (one worker
thread, preloaded with the key, a 19-byte value: the same reply size), and with ``--baseline DIR`` the
katsubushi-py checked out in DIR (``PYTHONPATH=DIR``, its compiled modules built there). All pinned to
CPU 0, the client (this process, paced by ``time.sleep``) to CPU 1. Each round measures every server,
in an order that rotates; medians over the rounds.

Usage: python bench/sparse_bench.py [--rounds 5] [--requests 2000] [--interval-ms 2] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from server_bench import ensure_memcached, free_port, machine, wait_ready  # noqa: E402
from tls_bench import make_certificate  # noqa: E402


def cpu_ns(pid: int) -> int:
    """Time on CPU of every thread of ``pid``, in ns (the first field of schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except OSError:
            continue  # a thread that ended meanwhile
    return total


def start(cmd: list[str], env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    proc = subprocess.Popen(
        [*pin, *cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )  # fmt: skip
    wait_ready(port, None, proc)
    return proc


def connect(port: int, ca: str | None) -> socket.socket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ca is None:
        return raw
    return ssl.create_default_context(cafile=ca).wrap_socket(raw, server_hostname="127.0.0.1")


def ask(s: socket.socket) -> None:
    s.sendall(b"get a\r\n")
    got = b""
    while not got.endswith(b"END\r\n"):
        chunk = s.recv(4096)
        if not chunk:
            sys.exit("the server closed the connection")
        got += chunk
    if not got.startswith(b"VALUE a 0 19\r\n"):
        sys.exit(f"unexpected reply {got[:60]!r}")


def measure(pid: int, port: int, ca: str | None, requests: int, interval: float) -> float:
    """Server CPU per request (us) of ``requests`` GETs paced ``interval`` seconds apart."""
    with connect(port, ca) as s:
        for _ in range(50):
            ask(s)
        time.sleep(interval)
        before = cpu_ns(pid)
        due = time.monotonic()
        for _ in range(requests):
            ask(s)
            due += interval
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        after = cpu_ns(pid)
    return (after - before) / 1000 / requests


def main() -> None:
    parser = argparse.ArgumentParser(description="sparse traffic beside memcached, plain and TLS")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000, help="requests per measurement (default 2000)")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="between requests (default 2)")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the katsubushi-py checked out in DIR")
    parser.add_argument("--python", default=sys.executable, help="interpreter for katsubushi-py")
    parser.add_argument("--quick", action="store_true", help="1 round of 100 requests: checks that it works")
    args = parser.parse_args()
    rounds, requests = (1, 100) if args.quick else (args.rounds, args.requests)
    interval = args.interval_ms / 1000
    if shutil.which("taskset"):
        os.sched_setaffinity(0, {1 % (os.cpu_count() or 1)})
    memcached = ensure_memcached()
    work = Path(tempfile.mkdtemp(prefix="kbench-sparse-"))
    ca, cert, key = make_certificate(work)
    variants = {"katsubushi-py": {}}
    if args.baseline:
        variants["baseline"] = {"PYTHONPATH": str(Path(args.baseline).resolve())}
    servers: dict[tuple[str, str], tuple[subprocess.Popen[bytes], int, str | None]] = {}
    try:
        for name, env in variants.items():
            for mode in ("plain", "TLS"):
                port = free_port()
                tls = ["--tls-cert", cert, "--tls-key", key] if mode == "TLS" else []
                state = tempfile.mkdtemp(prefix="kbench-sparse-state-")
                cmd = [args.python, "-m", "katsubushi_py", "--worker-id", "1", "--log-level", "warn",
                       "--state-dir", state, "--port", str(port), *tls]  # fmt: skip
                servers[(name, mode)] = (start(cmd, env, port), port, ca if tls else None)
        for mode in ("plain", "TLS"):
            port = free_port()
            tls = ["-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}"] if mode == "TLS" else []
            cmd = [memcached, "-t", "1", "-U", "0", "-m", "64", "-l", "127.0.0.1", "-p", str(port), *tls,
                   *(["-u", "root"] if os.geteuid() == 0 else [])]  # fmt: skip
            proc = start(cmd, {}, port)
            with connect(port, ca if tls else None) as s:
                s.sendall(b"set a 0 0 19\r\n%019d\r\n" % 7)
                if s.recv(100) != b"STORED\r\n":
                    sys.exit("memcached did not store the key")
            servers[("memcached", mode)] = (proc, port, ca if tls else None)
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in servers}
        names = list(servers)
        for round_ in range(rounds):
            shift = round_ % len(names)
            for server in names[shift:] + names[:shift]:
                proc, port, server_ca = servers[server]
                samples[server].append(measure(proc.pid, port, server_ca, requests, interval))
            print(f"round {round_ + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"Machine: {machine()}; OpenSSL {ssl.OPENSSL_VERSION.split()[1]}")
    print(f"{rounds} rounds of {requests} 1-key GETs on one connection, one every {args.interval_ms:g} ms;")
    print("servers on CPU 0, the client on CPU 1; server CPU per request (us, idle time included), medians\n")
    columns = [n for n in variants] + ["memcached"]
    print("| | " + " | ".join(columns) + " | memcached/katsubushi-py |")
    print("|---|" + "---:|" * (len(columns) + 1))
    for mode in ("plain", "TLS"):
        med = {n: statistics.median(samples[(n, mode)]) for n in columns}
        cells = " | ".join(f"{med[n]:.1f}" for n in columns)
        print(f"| {mode} | {cells} | {med['memcached'] / med['katsubushi-py']:.2f}x |")
    print("\nEvery sample, in round order:")
    for (name, mode), values in samples.items():
        print(f"- {name}, {mode}: " + ", ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()

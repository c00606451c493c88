#!/usr/bin/env python3
"""katsubushi-py over TLS beside ``memcached -Z``, in one run, with the same certificate.

Scenarios: 1 and 16 connections, GETs of 1 and 100 keys, one request in flight per connection
(bench/tls_loadgen.c: a thread per connection, blocking OpenSSL, every reply checked). memcached is
preloaded with the keys (values of 19 bytes, an ID's length), so both servers send the same bytes.
Each round runs every scenario against both servers, alternating which goes first; the figures are
medians over the rounds: requests/s, and server CPU (user + system, from /proc) per request, with
katsubushi-py/memcached ratios. Both servers are pinned to CPU 0 (taskset), the load generator to
CPU 1; memcached runs one worker thread (-t 1), the daemon one process: like for like.

``--baseline DIR`` also measures the katsubushi-py checked out in DIR (``PYTHONPATH=DIR``, its own
compiled modules built there), ``--pure`` the pure-Python hot path (``KATSUBUSHI_NO_EXTENSIONS=1``; with
``--baseline``, the baseline's too), ``--no-direct`` the compiled path calling OpenSSL through the ``_ssl``
object's methods (``KATSUBUSHI_TLS_DIRECT=0``): each in every round, in turn, with its own ratio to memcached.

Usage: python bench/tls_bench.py [--rounds 5] [--seconds 2] [--baseline DIR] [--pure] [--no-direct]
                                 [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
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
from server_bench import cpu_seconds, ensure_memcached, free_port, machine, wait_ready  # noqa: E402

SCENARIOS = [(1, 1), (1, 100), (16, 1), (16, 100)]  # (connections, keys per GET)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_certificate(directory: Path) -> tuple[str, str, str]:
    """A CA and a server certificate for 127.0.0.1 (EC P-256, what a modern deployment uses)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr, ext = (directory / n for n in ("server.pem", "server.key", "server.csr", "ext.cnf"))
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=bench-ca")
    run("req", "-new", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    for path in directory.iterdir():
        path.chmod(0o644)  # memcached may drop to another user
    return str(ca), str(cert), str(key)


def build_loadgen(workdir: Path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("no C compiler found: the load generator is bench/tls_loadgen.c")
    out = workdir / "tls_loadgen"
    cmd = [cc, "-O2", "-Wall", "-o", str(out), str(HERE / "tls_loadgen.c"), "-lssl", "-lcrypto", "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cannot build tls_loadgen (apt-get install libssl-dev): {done.stderr.strip()}")
    return str(out)


def variants(baseline: str | None, pure: bool, not_direct: bool = False) -> dict[str, dict[str, str]]:
    """The katsubushi-py variants to measure and their environments (see the module's docstring)."""
    found = {"katsubushi-py": {}}
    no_ext = {"KATSUBUSHI_NO_EXTENSIONS": "1"}
    if pure:
        found["katsubushi-py (pure)"] = no_ext
    if not_direct:
        found["katsubushi-py (no direct OpenSSL)"] = {"KATSUBUSHI_TLS_DIRECT": "0"}
    if baseline:
        found["baseline"] = {"PYTHONPATH": str(Path(baseline).resolve())}
        if pure:
            found["baseline (pure)"] = {**found["baseline"], **no_ext}
    return found


def start_servers(
    memcached: str, cert: str, key: str, python: str, envs: dict[str, dict[str, str]]
) -> dict[str, tuple[subprocess.Popen[bytes], int]]:
    ports = {name: free_port() for name in [*envs, "memcached"]}
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    cmds = {
        name: [*pin, python, "-m", "katsubushi_py", "--worker-id", "1", "--log-level", "warn",
               "--idle-timeout", "0", "--state-dir", tempfile.mkdtemp(prefix="kbench-tls-state-"),
               "--port", str(ports[name]), "--tls-cert", cert, "--tls-key", key]
        for name in envs
    }  # fmt: skip
    cmds["memcached"] = [*pin, memcached, "-t", "1", "-U", "0", "-c", "4096", "-m", "64", "-l", "127.0.0.1",
                         "-p", str(ports["memcached"]), "-Z", "-o", f"ssl_chain_cert={cert},ssl_key={key}",
                         *(["-u", "root"] if os.geteuid() == 0 else [])]  # fmt: skip
    servers = {}
    for name, cmd in cmds.items():
        quiet = subprocess.DEVNULL if name == "memcached" else None  # (memcached complains at its stop)
        env = {**os.environ, **envs.get(name, {})}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=quiet, env=env)
        wait_ready(ports[name], None, proc)
        servers[name] = (proc, ports[name])
    return servers


def preload(port: int, ca: str, keys: int = 100) -> None:
    ctx = ssl.create_default_context(cafile=ca)
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="127.0.0.1") as s:
        for i in range(keys):
            s.sendall(b"set k%d 0 0 19\r\n%019d\r\n" % (i, i))
        got = b""
        while got.count(b"STORED\r\n") < keys:
            chunk = s.recv(65536)
            if not chunk:
                sys.exit("memcached closed the connection while preloading")
            got += chunk


def measure(loadgen: str, proc: subprocess.Popen[bytes], port: int, conns: int, keys: int, seconds: float,
            ca: str) -> dict[str, float]:  # fmt: skip
    pin = ["taskset", "-c", "1"] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []
    before = cpu_seconds(proc.pid)
    done = subprocess.run(
        [*pin, loadgen, str(port), str(conns), str(keys), str(seconds), ca], capture_output=True, text=True
    )
    after = cpu_seconds(proc.pid)
    if done.returncode != 0:
        sys.exit(f"tls_loadgen failed: {done.stderr.strip()}")
    result = json.loads(done.stdout)
    if result["errors"]:
        sys.exit(f"tls_loadgen saw {result['errors']} bad replies from port {port}")
    requests = result["requests"]
    return {
        "rps": requests / result["seconds"],
        "cpu_us_per_request": (after - before) * 1e6 / max(1, requests),  # type: ignore[operator]
        "ids_per_cpu_second": requests * keys / max(1e-9, after - before),  # type: ignore[operator]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="katsubushi-py over TLS beside memcached -Z")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement (default 2)")
    parser.add_argument("--quick", action="store_true", help="1 round of 0.3 s: checks that everything works")
    parser.add_argument("--python", default=sys.executable, help="interpreter for katsubushi-py")
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the katsubushi-py checked out in DIR")
    parser.add_argument("--pure", action="store_true", help="also measure the pure-Python hot path")
    parser.add_argument(
        "--no-direct",
        action="store_true",
        help="also measure the compiled path with KATSUBUSHI_TLS_DIRECT=0 (OpenSSL through _ssl's methods)",
    )
    args = parser.parse_args()
    rounds, seconds = (1, 0.3) if args.quick else (args.rounds, args.seconds)
    memcached = ensure_memcached()
    work = Path(tempfile.mkdtemp(prefix="kbench-tls-"))
    ca, cert, key = make_certificate(work)
    loadgen = build_loadgen(work)
    envs = variants(args.baseline, args.pure, args.no_direct)
    servers = start_servers(memcached, cert, key, args.python, envs)
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        preload(servers["memcached"][1], ca)
        for round_ in range(rounds):
            for conns, keys in SCENARIOS:
                name = f"{conns} connection{'s' * (conns > 1)}, {keys}-key GET"
                names = [*envs, "memcached"]
                shift = round_ % len(names)
                order = names[shift:] + names[:shift]  # each goes first in turn
                for server in order:
                    proc, port = servers[server]
                    row = measure(loadgen, proc, port, conns, keys, seconds, ca)
                    samples.setdefault(name, {}).setdefault(server, []).append(row)
            log(f"round {round_ + 1}/{rounds} done")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print(f"Machine: {machine()}; TLS 1.3 (OpenSSL {ssl.OPENSSL_VERSION.split()[1]}), EC P-256 certificate")
    print(f"{rounds} alternating rounds of {seconds:g} s; servers pinned to CPU 0, load generator to CPU 1; medians\n")
    print("| scenario | katsubushi-py req/s | memcached req/s | ratio | katsubushi-py CPU us/req |"
          " memcached CPU us/req | CPU per request, memcached/ours |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, by_server in samples.items():
        k = {m: statistics.median(r[m] for r in by_server["katsubushi-py"]) for m in by_server["katsubushi-py"][0]}
        m = {m: statistics.median(r[m] for r in by_server["memcached"]) for m in by_server["memcached"][0]}
        print(
            f"| {name} | {k['rps']:,.0f} | {m['rps']:,.0f} | {k['rps'] / m['rps']:.2f}x |"
            f" {k['cpu_us_per_request']:.1f} | {m['cpu_us_per_request']:.1f} |"
            f" {m['cpu_us_per_request'] / k['cpu_us_per_request']:.2f}x |"
        )
    if len(envs) > 1:
        print("\nEvery variant: server CPU per request (us), and memcached's over it (medians):\n")
        print("| scenario | " + " | ".join(envs) + " |")
        print("|---|" + "---:|" * len(envs))
        for name, by_server in samples.items():
            mc = statistics.median(r["cpu_us_per_request"] for r in by_server["memcached"])
            cells = []
            for variant in envs:
                ours = statistics.median(r["cpu_us_per_request"] for r in by_server[variant])
                cells.append(f"{ours:.1f} ({mc / ours:.2f}x)")
            print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "samples": samples}, indent=1))


if __name__ == "__main__":
    started = time.monotonic()
    main()
    log(f"took {time.monotonic() - started:.0f} s")

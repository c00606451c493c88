"""katsubushi-py beside a real memcached, driven by the same load generator, in one run.

    pip install -e '.[bench]'
    python bench/server_bench.py [--runs 5] [--seconds 2] [--quick]

What it does:
- installs memcached from Debian's packages if it is missing and we are root (it says so), and
  compiles bench/loadgen.c with the system C compiler;
- starts katsubushi-py and memcached (``-t 1``: one worker thread, the same CPU budget as our one
  event loop) on free loopback ports and unix sockets, both pinned to CPU 0, and preloads memcached
  with 19-digit values under the keys the load generator asks for, so every GET hits and replies
  have the same size;
- runs each scenario alternately against both servers (A B A B ...) and prints medians and the ratio
  katsubushi-py / memcached. The load generator is pinned to CPU 0 too when one request is in flight
  (a wake-up across CPUs costs about 100 us on these VMs) and to CPU 1 when many are;
- checks every response, and that all IDs katsubushi-py returned in a run are unique;
- measures the binary protocol too, beside memcached's binary protocol: one GET at a time, GETs
  pipelined, and the quiet multi-get clients use (GETKQ per key, then NOOP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VALUE = b"1574026156804435968"  # a 19-digit value, as long as today's IDs
BINARY = ["--binary"]  # the load generator speaks memcached's binary protocol (see bench/loadgen.c)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_memcached() -> str:
    path = shutil.which("memcached")
    if path:
        return path
    if os.geteuid() != 0:
        sys.exit("memcached is not installed: apt-get install memcached (needs root)")
    log("memcached is missing: installing it from Debian's packages (apt-get install memcached)")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "memcached"],
        check=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    path = shutil.which("memcached")
    if not path:
        sys.exit("memcached could not be installed")
    return path


def build_loadgen(workdir: Path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("no C compiler found: the load generator is bench/loadgen.c")
    out = workdir / "loadgen"
    subprocess.run([cc, "-O2", "-Wall", "-o", str(out), str(HERE / "loadgen.c")], check=True)
    return str(out)


def wait_ready(port: int | None, sock: str | None, proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}")
        try:
            if port is not None:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            else:
                s = socket.socket(socket.AF_UNIX)
                s.connect(sock)  # type: ignore[arg-type]
                s.close()
            return
        except OSError:
            time.sleep(0.01)
    sys.exit("server did not start")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int | None
    sock: str | None
    is_ids: bool

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def katsubushi_cmd(port: int | None, sock: str | None, state_dir: Path | None = None) -> list[str]:
    """The daemon as a user starts it, state file included (in ``state_dir``, by default a new one:
    two daemons running at once cannot share worker id 1's state file)."""
    if state_dir is None:
        state_dir = Path(tempfile.mkdtemp(prefix="kbench-state-"))
    cmd = [
        "taskset",
        "-c",
        "0",
        sys.executable,
        "-m",
        "katsubushi_py",
        "--worker-id",
        "1",
        "--log-level",
        "warn",
        "--idle-timeout",
        "0",
        "--max-connections",
        "4096",
        "--state-dir",
        str(state_dir),
    ]
    if port is not None:
        cmd += ["--port", str(port)]
    if sock is not None:
        cmd += ["--sock", sock]
    return cmd


def memcached_cmd(binary: str, port: int | None, sock: str | None) -> list[str]:
    cmd = ["taskset", "-c", "0", binary, "-t", "1", "-U", "0", "-c", "4096", "-m", "64"]
    if os.geteuid() == 0:
        cmd += ["-u", "root"]
    cmd += ["-s", sock] if sock else ["-l", "127.0.0.1", "-p", str(port)]
    return cmd


def start(name: str, cmd: list[str], port: int | None, sock: str | None, is_ids: bool) -> Server:
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    wait_ready(port, sock, proc)
    return Server(name, proc, port, sock, is_ids)


def preload(server: Server, nkeys: int = 1024) -> None:
    if server.port is not None:
        s = socket.create_connection(("127.0.0.1", server.port))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.connect(server.sock)  # type: ignore[arg-type]
    with s:
        payload = b"".join(b"set k%d 0 0 %d noreply\r\n%s\r\n" % (i, len(VALUE), VALUE) for i in range(nkeys))
        s.sendall(payload + b"get k0\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            data += s.recv(4096)
        assert VALUE in data, data


@dataclass
class Scenario:
    name: str
    args: list[str]
    client_cpu: int
    transport: str  # "tcp" or "unix"
    metric: str  # "rps" or "values_per_s"
    floor: bool = False  # also run the trivial uvloop server (valid for one-key sequential GETs only)
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)


def run_loadgen(loadgen: str, server: Server, sc: Scenario, seconds: float, verify: bool = False) -> dict[str, float]:
    """One timed run. Against the ID server every connection must see strictly increasing IDs; with
    ``verify`` every ID is also kept and checked for duplicates (not timed: that costs the client)."""
    target = ["--port", str(server.port)] if sc.transport == "tcp" else ["--unix", str(server.sock)]
    cmd = ["taskset", "-c", str(sc.client_cpu), loadgen, *target, *sc.args, "--seconds", str(seconds)]
    if server.is_ids:
        cmd.append("--increasing")
        if verify:
            cmd.append("--unique")
    cpu_before = cpu_seconds(server.proc.pid)
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_cpu = cpu_seconds(server.proc.pid) - cpu_before
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "error" in result or out.returncode != 0:
        sys.exit(f"{server.name} {sc.name}: load generator failed: {out.stdout} {out.stderr}")
    if server.is_ids and (result["duplicates"] or result["not_increasing"]):
        sys.exit(
            f"{server.name} {sc.name}: {result['duplicates']} duplicate IDs,"
            f" {result['not_increasing']} not increasing on their connection"
        )
    client_cpu = (usage_after.ru_utime + usage_after.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime)
    result["server_cpu"] = server_cpu / result["elapsed"]
    result["client_cpu"] = client_cpu / result["elapsed"]
    return result


def idle_rss(server: Server, count: int) -> tuple[int, int]:
    """Server RSS (kB) before and with ``count`` idle connections, each of which made one GET."""
    before = rss_kb(server.proc.pid)
    socks = []
    try:
        for _ in range(count):
            if server.port is not None:
                s = socket.create_connection(("127.0.0.1", server.port))
            else:
                s = socket.socket(socket.AF_UNIX)
                s.connect(server.sock)  # type: ignore[arg-type]
            s.sendall(b"get k0\r\n")
            socks.append(s)
        for s in socks:
            data = b""
            while not data.endswith(b"END\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    sys.exit(f"{server.name} closed an idle connection")
                data += chunk
        time.sleep(0.2)
        return before, rss_kb(server.proc.pid)
    finally:
        for s in socks:
            s.close()


def startup_seconds(cmd_for_port: object, attempts: int = 1) -> float:
    """From exec to the first GET answered with a VALUE line (a miss counts for memcached)."""
    port = free_port()
    cmd = cmd_for_port(port)  # type: ignore[operator]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                    s.sendall(b"get k0\r\n")
                    data = b""
                    while not data.endswith(b"END\r\n"):
                        chunk = s.recv(4096)
                        if not chunk:
                            raise OSError("closed")
                        data += chunk
                    return time.perf_counter() - started
            except OSError:
                if proc.poll() is not None:
                    sys.exit("server exited during start-up measurement")
                time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


def machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    try:
        import uvloop

        uv = f"uvloop {uvloop.__version__}"
    except ImportError:
        uv = "no uvloop"
    mc = subprocess.run([shutil.which("memcached") or "memcached", "-V"], capture_output=True, text=True).stdout.strip()
    from katsubushi_py import __version__

    return (
        f"{os.cpu_count()} CPUs ({model}), {platform.system()} {platform.release()}, Python"
        f" {platform.python_version()}, {uv}, katsubushi-py {__version__}, {mc}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="katsubushi-py vs memcached, side by side")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs per scenario (default 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per load run (default 2)")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections for the RSS figure")
    parser.add_argument("--quick", action="store_true", help="1 run of 0.5 s each: checks that everything works")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 0.5
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 256)), hard))

    memcached = ensure_memcached()
    workdir = Path(tempfile.mkdtemp(prefix="kbench-"))
    loadgen = build_loadgen(workdir)
    kport, mport = free_port(), free_port()
    ksock, msock = str(workdir / "k.sock"), str(workdir / "m.sock")
    servers = {
        ("katsubushi-py", "tcp"): start(
            "katsubushi-py", katsubushi_cmd(kport, ksock, workdir / "state"), kport, None, True
        ),
        ("memcached", "tcp"): start("memcached", memcached_cmd(memcached, mport, None), mport, None, False),
        ("memcached", "unix"): start("memcached", memcached_cmd(memcached, None, msock), None, msock, False),
    }
    servers[("katsubushi-py", "unix")] = Server(
        "katsubushi-py", servers[("katsubushi-py", "tcp")].proc, None, ksock, True
    )
    fport = free_port()
    floor_cmd = ["taskset", "-c", "0", sys.executable, str(HERE / "uvloop_floor.py"), str(fport)]
    servers[("uvloop floor", "tcp")] = start("uvloop floor", floor_cmd, fport, None, False)
    try:
        preload(servers[("memcached", "tcp")])
        preload(servers[("memcached", "unix")])
        scenarios = [
            Scenario("1 connection, sequential GET", ["--conns", "1", "--depth", "1"], 0, "tcp", "rps", True),
            Scenario("16 connections, sequential each", ["--conns", "16", "--depth", "1"], 1, "tcp", "rps", True),
            Scenario("4 connections, 16 pipelined each", ["--conns", "4", "--depth", "16"], 1, "tcp", "rps"),
            Scenario("1 connection, GET of 100 keys", ["--conns", "1", "--keys", "100"], 0, "tcp", "values_per_s"),
            Scenario("unix: 1 connection, sequential GET", ["--conns", "1", "--depth", "1"], 0, "unix", "rps"),
            Scenario("unix: 16 connections, sequential each", ["--conns", "16", "--depth", "1"], 1, "unix", "rps"),
            Scenario("unix: 4 connections, 16 pipelined each", ["--conns", "4", "--depth", "16"], 1, "unix", "rps"),
            Scenario(
                "unix: 1 connection, GET of 100 keys", ["--conns", "1", "--keys", "100"], 0, "unix", "values_per_s"
            ),
            Scenario(
                "binary: 1 connection, sequential GET", [*BINARY, "--conns", "1", "--depth", "1"], 0, "tcp", "rps"
            ),
            Scenario(
                "binary: 4 connections, 16 pipelined each", [*BINARY, "--conns", "4", "--depth", "16"], 1, "tcp", "rps"
            ),
            Scenario(
                "binary: 1 connection, GETKQ x 100 + NOOP",
                [*BINARY, "--conns", "1", "--keys", "100"],
                0,
                "tcp",
                "values_per_s",
            ),
        ]
        verified = 0
        for sc in scenarios:
            check = run_loadgen(loadgen, servers[("katsubushi-py", sc.transport)], sc, min(args.seconds, 1.0), True)
            verified += int(check["checked_unique"])
            for run in range(args.runs):
                order = ["katsubushi-py", "memcached"] if run % 2 == 0 else ["memcached", "katsubushi-py"]
                if sc.floor:
                    order.append("uvloop floor")
                for name in order:
                    result = run_loadgen(loadgen, servers[(name, sc.transport)], sc, args.seconds)
                    sc.samples.setdefault(name, []).append(result)
                    log(
                        f"{sc.name:42s} {name:14s} {result[sc.metric]:>12,.0f}  p50 {result['p50_us']:.0f} us"
                        f"  p99 {result['p99_us']:.0f} us  server CPU {result['server_cpu']:.0%}"
                        f"  client CPU {result['client_cpu']:.0%}"
                    )
        idle: dict[str, list[int]] = {"katsubushi-py": [], "memcached": []}
        idle_base: dict[str, list[int]] = {"katsubushi-py": [], "memcached": []}
        for _ in range(max(1, min(args.runs, 3))):
            for name in ("katsubushi-py", "memcached"):
                before, during = idle_rss(servers[(name, "tcp")], args.idle)
                idle_base[name].append(before)
                idle[name].append(during)
                log(f"{args.idle} idle connections {name:14s} RSS {before} kB -> {during} kB")
        startups: dict[str, list[float]] = {"katsubushi-py": [], "memcached": []}
        for _ in range(args.runs):
            startups["katsubushi-py"].append(
                startup_seconds(lambda p: katsubushi_cmd(p, None, workdir / "state-startup"))
            )
            startups["memcached"].append(startup_seconds(lambda p: memcached_cmd(memcached, p, None)))
            log(
                f"start-up katsubushi-py {startups['katsubushi-py'][-1]:.3f} s, memcached"
                f" {startups['memcached'][-1]:.3f} s"
            )
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"Machine: {machine()}.")
    print(
        f"{args.runs} alternating runs of {args.seconds:g} s per scenario; medians. Server pinned to CPU 0"
        " (memcached with -t 1); client on CPU 0 for one-connection scenarios, CPU 1 otherwise. Every"
        " reply checked; every connection saw strictly increasing IDs; an untimed verification run per"
        f" scenario kept all {verified:,} IDs it received and found no duplicate.\n"
    )
    print(
        "| scenario | katsubushi-py | memcached | ratio | katsubushi-py p50 / p99 | memcached p50 / p99 |"
        " server CPU (k / m) | client CPU (k / m) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for sc in scenarios:
        k, m = sc.samples["katsubushi-py"], sc.samples["memcached"]

        def med(rows: list[dict[str, float]], key: str) -> float:
            return statistics.median(r[key] for r in rows)

        unit = "req/s" if sc.metric == "rps" else "IDs/s"
        print(
            f"| {sc.name} | {med(k, sc.metric):,.0f} {unit} | {med(m, sc.metric):,.0f} {unit} |"
            f" {med(k, sc.metric) / med(m, sc.metric):.2f} |"
            f" {med(k, 'p50_us'):.0f} / {med(k, 'p99_us'):.0f} us |"
            f" {med(m, 'p50_us'):.0f} / {med(m, 'p99_us'):.0f} us |"
            f" {med(k, 'server_cpu'):.0%} / {med(m, 'server_cpu'):.0%} |"
            f" {med(k, 'client_cpu'):.0%} / {med(m, 'client_cpu'):.0%} |"
        )
    kr, mr = statistics.median(idle["katsubushi-py"]), statistics.median(idle["memcached"])
    floor_rows = []
    for sc in scenarios:
        if sc.floor:
            f = statistics.median(r[sc.metric] for r in sc.samples["uvloop floor"])
            k = statistics.median(r[sc.metric] for r in sc.samples["katsubushi-py"])
            m = statistics.median(r[sc.metric] for r in sc.samples["memcached"])
            floor_rows.append(f"| {sc.name} | {f:,.0f} req/s | {f / m:.2f} | {k / f:.2f} |")
    print(
        f"| {args.idle} idle connections: server RSS | {kr / 1024:.1f} MB | {mr / 1024:.1f} MB | {kr / mr:.2f} |"
        f" (before: {statistics.median(idle_base['katsubushi-py']) / 1024:.1f} MB) |"
        f" (before: {statistics.median(idle_base['memcached']) / 1024:.1f} MB) | | |"
    )
    ks, ms = statistics.median(startups["katsubushi-py"]), statistics.median(startups["memcached"])
    print(f"| start-up, exec to first ID served | {ks * 1000:.0f} ms | {ms * 1000:.0f} ms | {ks / ms:.1f} | | | | |")

    if floor_rows:
        print(
            "\nThe one-key scenarios against bench/uvloop_floor.py, a uvloop server that answers every read with a"
            " constant reply and does nothing else (the most Python and uvloop allow here), in the same runs:\n"
        )
        print("| scenario | uvloop floor | floor / memcached | katsubushi-py / floor |")
        print("|---|---:|---:|---:|")
        print("\n".join(floor_rows))


if __name__ == "__main__":
    main()

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


def cpu_seconds(pid: int, split: bool = False) -> float | tuple[float, float]:
    """CPU time of a process and of its children processes (``--workers``): user + system, or
    (user, system) with ``split``."""
    user = system = 0.0
    pids = [pid]
    while pids:
        current = pids.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
        system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(child) for child in (task / "children").read_text().split()]
    return (user, system) if split else user + system


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
    pin = ["taskset", "-c", str(sc.client_cpu)] if sc.client_cpu >= 0 else []
    cmd = [*pin, loadgen, *target, *sc.args, "--seconds", str(seconds)]
    if server.is_ids:
        cmd.append("--increasing")
        if verify:
            cmd.append("--unique")
    user_before, sys_before = cpu_seconds(server.proc.pid, split=True)  # type: ignore[misc]
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    usage_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    user_after, sys_after = cpu_seconds(server.proc.pid, split=True)  # type: ignore[misc]
    server_cpu = (user_after - user_before) + (sys_after - sys_before)
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
    # Server CPU per request (per read of the load generator's requests: one GET, or one GET of
    # 100 keys), split into user space (our code and the runtime's) and the kernel.
    result["user_us"] = (user_after - user_before) * 1e6 / max(1, result["requests"])
    result["sys_us"] = (sys_after - sys_before) * 1e6 / max(1, result["requests"])
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


@dataclass
class Subject:
    """A katsubushi-py variant measured beside memcached: the compiled hot path (the default), the
    pure-Python one, an older checkout (``--baseline``), or several worker processes."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    extra: list[str] = field(default_factory=list)
    python: str = sys.executable
    cpus: str = "0"

    def serves(self, sc: Scenario) -> bool:
        """An older checkout (``--baseline``) may predate the binary protocol: then it sits those out."""
        return (
            self.cwd is None
            or BINARY[0] not in sc.args
            or (Path(self.cwd) / "katsubushi_py/frontends/binary.py").exists()
        )

    def cmd(self, port: int | None, sock: str | None, state_dir: Path) -> list[str]:
        """The command line; ``state_dir`` must be this instance's own (worker id 1's file is locked)."""
        cmd = katsubushi_cmd(port, sock, state_dir)
        cmd[2] = self.cpus
        cmd[3] = self.python
        if self.cwd is not None:  # an older checkout: it may predate --state-dir (it had no default state)
            at = cmd.index("--state-dir")
            del cmd[at : at + 2]
        return cmd + self.extra


def start_subject(subject: Subject, port: int | None, sock: str | None, state_dir: Path) -> Server:
    env = {**os.environ, **subject.env}
    if subject.cwd is not None:
        env["PYTHONPATH"] = subject.cwd
        # An older checkout is started without --state-dir; one that keeps state finds its own
        # directory here (two of them, compiled and pure, cannot share worker id 1's file).
        env["STATE_DIRECTORY"] = str(state_dir)
    proc = subprocess.Popen(
        subject.cmd(port, sock, state_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
        cwd=subject.cwd,
    )
    wait_ready(port, sock, proc)
    return Server(subject.name, proc, port, sock, True)


def scenarios_for(quick_binary: bool = True) -> list[Scenario]:
    binary = [
        Scenario("binary: 1 connection, sequential GET", [*BINARY, "--conns", "1", "--depth", "1"], 0, "tcp", "rps"),
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
    return [
        Scenario("1 connection, sequential GET", ["--conns", "1", "--depth", "1"], 0, "tcp", "rps", True),
        Scenario("16 connections, sequential each", ["--conns", "16", "--depth", "1"], 1, "tcp", "rps", True),
        Scenario("4 connections, 16 pipelined each", ["--conns", "4", "--depth", "16"], 1, "tcp", "rps"),
        Scenario("1 connection, GET of 100 keys", ["--conns", "1", "--keys", "100"], 0, "tcp", "values_per_s"),
        Scenario("unix: 1 connection, sequential GET", ["--conns", "1", "--depth", "1"], 0, "unix", "rps"),
        Scenario("unix: 16 connections, sequential each", ["--conns", "16", "--depth", "1"], 1, "unix", "rps", True),
        Scenario("unix: 4 connections, 16 pipelined each", ["--conns", "4", "--depth", "16"], 1, "unix", "rps"),
        Scenario("unix: 1 connection, GET of 100 keys", ["--conns", "1", "--keys", "100"], 0, "unix", "values_per_s"),
        *(binary if quick_binary else []),
    ]


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="katsubushi-py vs memcached, side by side")
    parser.add_argument("--runs", type=int, default=5, help="alternating runs per scenario (default 5)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per load run (default 2)")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections for the RSS figure")
    parser.add_argument("--quick", action="store_true", help="1 run of 0.5 s each: checks that everything works")
    parser.add_argument("--pure", action="store_true", help="also measure the pure-Python hot path")
    parser.add_argument("--baseline", metavar="DIR", help="also measure the katsubushi-py checked out in DIR")
    parser.add_argument("--python", metavar="EXE", default=sys.executable, help="interpreter for katsubushi-py")
    parser.add_argument(
        "--also-python", metavar="EXE", action="append", default=[], help="also measure katsubushi-py under EXE"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        metavar="N",
        help="instead: --workers N against memcached -t N, 64 connections",
    )
    parser.add_argument(
        "--only", metavar="TEXT", action="append", help="only the scenarios whose name contains TEXT (repeatable)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every sample as JSON (for bench/plot_results.py)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 0.5
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 256)), hard))

    memcached = ensure_memcached()
    workdir = Path(tempfile.mkdtemp(prefix="kbench-"))
    loadgen = build_loadgen(workdir)
    subjects = [Subject("katsubushi-py", python=args.python)]
    if args.pure:
        subjects.append(Subject("katsubushi-py (python)", {"KATSUBUSHI_NO_EXTENSIONS": "1"}, python=args.python))
    if args.baseline:
        subjects.append(Subject("baseline", cwd=str(Path(args.baseline).resolve()), python=args.python))
        if args.pure:
            subjects.append(
                Subject(
                    "baseline (python)",
                    {"KATSUBUSHI_NO_EXTENSIONS": "1"},
                    cwd=str(Path(args.baseline).resolve()),
                    python=args.python,
                )
            )
    for other in args.also_python:
        version = subprocess.run(
            [other, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        subjects.append(Subject(f"katsubushi-py on Python {version}", python=other))
        if args.pure:
            subjects.append(
                Subject(f"katsubushi-py (python) on Python {version}", {"KATSUBUSHI_NO_EXTENSIONS": "1"}, python=other)
            )
    threads = 1
    if args.workers:
        threads = args.workers
        cpus = ",".join(str(i) for i in range(min(args.workers, os.cpu_count() or 1)))
        subjects = [
            Subject(
                f"katsubushi-py --workers {args.workers}",
                extra=["--workers", str(args.workers)],
                cpus=cpus,
                python=args.python,
            )
        ]
    servers: dict[tuple[str, str], Server] = {}
    try:
        for subject in subjects:
            port, sock = free_port(), str(workdir / f"k{len(servers)}.sock")
            server = start_subject(subject, port, sock, workdir / f"state-{len(servers)}")
            servers[(subject.name, "tcp")] = server
            servers[(subject.name, "unix")] = Server(subject.name, server.proc, None, sock, True)
        mport, msock = free_port(), str(workdir / "m.sock")
        mcmd = memcached_cmd(memcached, mport, None)
        mucmd = memcached_cmd(memcached, None, msock)
        if args.workers:
            for cmd in (mcmd, mucmd):
                cmd[2] = subjects[0].cpus
                cmd[cmd.index("-t") + 1] = str(threads)
        servers[("memcached", "tcp")] = start("memcached", mcmd, mport, None, False)
        servers[("memcached", "unix")] = start("memcached", mucmd, None, msock, False)
        fport = free_port()
        floor_cmd = ["taskset", "-c", "0", args.python, str(HERE / "uvloop_floor.py"), str(fport)]
        servers[("uvloop floor", "tcp")] = start("uvloop floor", floor_cmd, fport, None, False)
        fsock = str(workdir / "f.sock")
        servers[("uvloop floor", "unix")] = start("uvloop floor", [*floor_cmd, fsock], None, fsock, False)
        preload(servers[("memcached", "tcp")])
        preload(servers[("memcached", "unix")])
        if args.workers:
            scenarios = [
                Scenario(
                    f"{threads} processes: 64 connections, sequential each",
                    ["--conns", "64", "--depth", "1"],
                    -1,
                    "tcp",
                    "rps",
                ),
                Scenario(
                    f"{threads} processes, unix: 64 connections, sequential",
                    ["--conns", "64", "--depth", "1"],
                    -1,
                    "unix",
                    "rps",
                ),
                Scenario(
                    f"{threads} processes: 16 connections, 16 pipelined each",
                    ["--conns", "16", "--depth", "16"],
                    -1,
                    "tcp",
                    "rps",
                ),
            ]
        else:
            scenarios = scenarios_for()
        if args.only:
            scenarios = [sc for sc in scenarios if any(text in sc.name for text in args.only)]
        names = [subject.name for subject in subjects]
        verified = 0
        for sc in scenarios:
            here = [subject.name for subject in subjects if subject.serves(sc)]
            for name in here:
                check = run_loadgen(loadgen, servers[(name, sc.transport)], sc, min(args.seconds, 1.0), True)
                verified += int(check["checked_unique"])
            for run in range(args.runs):
                order = [*here, "memcached"]
                order = order[run % len(order) :] + order[: run % len(order)]  # rotate: no subject always first
                if sc.floor:
                    order.append("uvloop floor")
                for name in order:
                    result = run_loadgen(loadgen, servers[(name, sc.transport)], sc, args.seconds)
                    sc.samples.setdefault(name, []).append(result)
                    log(
                        f"{sc.name:42s} {name:24s} {result[sc.metric]:>12,.0f}  p50 {result['p50_us']:.0f} us"
                        f"  p99 {result['p99_us']:.0f} us  server user {result['user_us']:.2f} us/req"
                        f" sys {result['sys_us']:.2f} us/req  client CPU {result['client_cpu']:.0%}"
                    )
        idle: dict[str, list[int]] = {}
        idle_base: dict[str, list[int]] = {}
        startups: dict[str, list[float]] = {}
        if not args.workers and not args.only:
            for _ in range(max(1, min(args.runs, 3))):
                for name in (names[0], "memcached"):
                    before, during = idle_rss(servers[(name, "tcp")], args.idle)
                    idle_base.setdefault(name, []).append(before)
                    idle.setdefault(name, []).append(during)
                    log(f"{args.idle} idle connections {name:24s} RSS {before} kB -> {during} kB")
            for _ in range(args.runs):
                startups.setdefault(names[0], []).append(
                    startup_seconds(
                        lambda p: subjects[0].cmd(p, None, Path(tempfile.mkdtemp(dir=workdir, prefix="state-")))
                    )
                )
                startups.setdefault("memcached", []).append(
                    startup_seconds(lambda p: memcached_cmd(memcached, p, None))
                )
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "runs": args.runs,
                    "seconds": args.seconds,
                    "subjects": names,
                    "scenarios": [{"name": sc.name, "metric": sc.metric, "samples": sc.samples} for sc in scenarios],
                },
                indent=1,
            )
        )
    print(f"Machine: {machine()}.")
    pinning = (
        f"katsubushi-py and memcached (-t {threads}) on CPUs {subjects[0].cpus}; client unpinned"
        if args.workers
        else "Servers pinned to CPU 0 (memcached with -t 1); client on CPU 0 for one-connection scenarios,"
        " CPU 1 otherwise"
    )
    print(
        f"{args.runs} alternating runs of {args.seconds:g} s per scenario (subjects rotated run by run); medians."
        f" {pinning}. Every reply checked; every connection saw strictly increasing IDs; an untimed"
        f" verification run per scenario and subject kept all {verified:,} IDs it received and found no duplicate.\n"
    )
    print("| scenario | server | throughput | ratio to memcached | p50 / p99 | server CPU per request: user / kernel |")
    print("|---|---|---:|---:|---:|---:|")
    for sc in scenarios:
        unit = "req/s" if sc.metric == "rps" else "IDs/s"
        m = med(sc.samples["memcached"], sc.metric)
        for name in [*names, "memcached", *(["uvloop floor"] if sc.floor else [])]:
            rows = sc.samples.get(name)
            if not rows:
                continue
            print(
                f"| {sc.name} | {name} | {med(rows, sc.metric):,.0f} {unit} | {med(rows, sc.metric) / m:.2f} |"
                f" {med(rows, 'p50_us'):.0f} / {med(rows, 'p99_us'):.0f} us |"
                f" {med(rows, 'user_us'):.2f} / {med(rows, 'sys_us'):.2f} us |"
            )
    if idle:
        kr, mr = statistics.median(idle[names[0]]), statistics.median(idle["memcached"])
        print(
            f"\n{args.idle} idle connections, server RSS: {names[0]} {kr / 1024:.1f} MB"
            f" (before: {statistics.median(idle_base[names[0]]) / 1024:.1f} MB), memcached {mr / 1024:.1f} MB"
            f" (before: {statistics.median(idle_base['memcached']) / 1024:.1f} MB)."
        )
    if startups:
        ks, ms = statistics.median(startups[names[0]]), statistics.median(startups["memcached"])
        print(f"Start-up, exec to first ID served: {names[0]} {ks * 1000:.0f} ms, memcached {ms * 1000:.0f} ms.")


if __name__ == "__main__":
    main()

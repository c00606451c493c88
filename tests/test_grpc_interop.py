"""The gRPC port of a real daemon against real clients: Node's @grpc/grpc-js (another language's gRPC),
h2load and curl (Debian's nghttp2-client and curl), and an h2 client on a plain socket for what the
others cannot send. tests/test_grpc.py covers grpcio's client.

grpc-js is installed from npm into a cache directory (``npm ci`` from tests/grpc_js/package-lock.json,
once per lock file); the test is skipped where node or npm is missing or the install fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from conftest import DaemonFactory, decode, free_port, recv_all, wait_for_port
from grpc_conversations import FETCH, Client, message, split_messages
from h2.errors import ErrorCodes
from test_daemon import stats as mc_stats

from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent / "katsubushi_py" / "frontends" / "katsubushi.proto"


def start_grpc(daemons: DaemonFactory, *args: str, **kwargs: object):
    port = free_port()
    d = daemons.start("--grpc-port", str(port), *args, **kwargs)  # type: ignore[arg-type]
    wait_for_port(port, d.proc)
    return d, port


def grpc_js_modules() -> Path:
    """node_modules with @grpc/grpc-js, installed by ``npm ci`` into a cache directory named after the
    lock file; skips the test when that cannot be done."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed (Debian: nodejs, npm)")
    lock = (HERE / "grpc_js" / "package-lock.json").read_bytes()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "katsubushi-py"
    target = cache / f"grpc-js-{hashlib.sha256(lock).hexdigest()[:16]}"
    if not (target / "node_modules" / "@grpc" / "grpc-js").is_dir():
        target.mkdir(parents=True, exist_ok=True)
        for name in ("package.json", "package-lock.json"):
            shutil.copy(HERE / "grpc_js" / name, target / name)
        result = subprocess.run(
            [npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"],
            cwd=target,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            pytest.skip(f"npm ci of @grpc/grpc-js failed: {result.stderr[-500:]}")
    return target / "node_modules"


def test_grpc_js_client(daemons: DaemonFactory) -> None:
    modules = grpc_js_modules()
    d, port = start_grpc(daemons)
    result = subprocess.run(
        ["node", str(HERE / "grpc_js" / "client.js"), f"127.0.0.1:{port}", str(PROTO)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "NODE_PATH": str(modules)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    fetched = [int(i) for i in out["fetch"]]
    assert fetched == sorted(fetched) and len(set(fetched)) == 20
    assert all(decode(i)[1] == 7 for i in fetched)
    concurrent = [int(i) for i in out["concurrent"]]  # an "error N" would not convert
    assert len(set(concurrent)) == 200 and min(concurrent) > fetched[-1]
    multi = [int(i) for i in out["multi"]]
    assert len(multi) == 100 and multi == sorted(multi) and multi[0] > max(concurrent)
    assert len(out["multi_default"]) == 1
    assert out["too_many"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert out["too_many"]["details"] == "too many IDs requested: 1001, n must be from 1 to 1000"
    assert out["unknown"]["code"] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    stats = out["stats"]
    assert int(stats["cmd_get"]) == 20 + 200 + 2 + 1 and int(stats["get_hits"]) == 20 + 200 + 100 + 1
    assert int(stats["pid"]) == d.pid


@pytest.mark.skipif(not shutil.which("h2load"), reason="h2load is not installed (Debian: nghttp2-client)")
def test_h2load_calls_are_all_answered(daemons: DaemonFactory, tmp_path: Path) -> None:
    """h2load's gRPC calls in the benchmark's shapes (connections x concurrent streams): every one a
    success, each one counted in STATS, as many IDs as asked."""
    d, port = start_grpc(daemons)
    fetch, multi = tmp_path / "fetch.bin", tmp_path / "multi.bin"
    fetch.write_bytes(message(b""))
    multi.write_bytes(message(b"\x08\x64"))  # n = 100
    grpc_args = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
    calls = 0
    for conns, streams, body, path in (
        (1, 1, fetch, "Fetch"),
        (1, 8, fetch, "Fetch"),
        (8, 1, fetch, "Fetch"),
        (2, 16, multi, "FetchMulti"),
    ):
        n = 2000 if path == "Fetch" else 200
        cmd = ["h2load", "-n", str(n), "-c", str(conns), "-m", str(streams), *grpc_args, "-d", str(body)]
        out = subprocess.run(
            [*cmd, f"http://127.0.0.1:{port}/katsubushi.Generator/{path}"], capture_output=True, text=True, timeout=60
        ).stdout
        assert f"requests: {n} total, {n} started, {n} done, {n} succeeded, 0 failed, 0 errored" in out, out
        assert f"status codes: {n} 2xx" in out, out
        calls += n
    with d.connect() as mc:
        fields = mc_stats(mc)
    assert int(fields["cmd_get"]) == calls and fields["get_misses"] == "0"
    assert int(fields["get_hits"]) == 3 * 2000 + 200 * 100
    assert int(fields["total_connections"]) >= 1 + 1 + 8 + 2  # gRPC connections are counted too


CURL = shutil.which("curl")


def curl(*args: str) -> tuple[str, bytes]:
    """(response headers and trailers, body) of one curl request; a hang fails (curl gives up after 5 s)."""
    with tempfile.NamedTemporaryFile() as body:
        cmd = [CURL, "-s", "-m", "5", "-D", "-", "-o", body.name, *args]
        result = subprocess.run(cmd, capture_output=True, timeout=30)  # type: ignore[list-item]
        assert result.returncode == 0, (result.returncode, result.stderr)
        return result.stdout.decode("latin-1"), Path(body.name).read_bytes()


@pytest.mark.skipif(not CURL, reason="curl is not installed")
def test_what_curl_gets(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A new user's first tries: each answered as the gRPC over HTTP/2 specification says, at once."""
    _, port = start_grpc(daemons)
    url = f"http://127.0.0.1:{port}"
    body = tmp_path / "fetch.bin"
    body.write_bytes(message(b""))
    grpc_call = ["--http2-prior-knowledge", "-H", "content-type: application/grpc", "--data-binary", f"@{body}"]

    started = time.monotonic()
    head, _ = curl("--http2-prior-knowledge", f"{url}/")
    assert head.startswith("HTTP/2 415")
    assert "grpc-status: 3" in head and 'grpc-message: invalid gRPC request content-type ""' in head
    assert time.monotonic() - started < 5

    head, _ = curl("--http2-prior-knowledge", "-H", "content-type: text/plain", "-d", "x", f"{url}/x")
    assert head.startswith("HTTP/2 415") and "grpc-status: 3" in head

    # A gRPC call without "te: trailers" (which gRPC asks clients to send) is served all the same.
    head, raw = curl(*grpc_call, f"{url}/katsubushi.Generator/Fetch")
    assert head.startswith("HTTP/2 200") and "content-type: application/grpc" in head and "grpc-status: 0" in head
    (reply,) = split_messages(raw)
    assert decode(pb.FetchResponse.FromString(reply).id)[1] == 7

    head, _ = curl(*grpc_call, "-H", "te: trailers", f"{url}/katsubushi.Generator/Nope")
    assert head.startswith("HTTP/2 200") and "grpc-status: 12" in head

    head, body_text = curl(f"{url}/")  # HTTP/1.1: told what this port speaks
    assert head.startswith("HTTP/1.1 505") and b"HTTP/2" in body_text
    head, _ = curl("--http2", f"{url}/")  # HTTP/1.1 asking to upgrade to h2c: the same
    assert head.startswith("HTTP/1.1 505")


def h2_socket(port: int) -> tuple[socket.socket, Client]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock, Client()


def exchange(sock: socket.socket, client: Client, quiet: float = 0.3) -> bytes:
    sock.sendall(client.pending())
    data = recv_all(sock, quiet)
    client.take(data)
    return data


def test_a_broken_connection_gets_goaway_and_a_close(daemons: DaemonFactory) -> None:
    _, port = start_grpc(daemons)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40)  # a TLS hello
        data = b""
        while chunk := sock.recv(4096):  # the server closes
            data += chunk
        assert time.monotonic() - started < 5
    client = Client()
    client.take(data)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.PROTOCOL_ERROR


def test_connections_over_the_limit_are_closed_and_clients_back_off(daemons: DaemonFactory) -> None:
    """Over --max-connections a gRPC connection is closed before the HTTP/2 preface: grpcio fails the
    call with UNAVAILABLE at once (a GOAWAY would have it reconnect in a loop until its deadline)."""
    d, port = start_grpc(daemons, "--max-connections", "2")
    kept = [h2_socket(port) for _ in range(2)]
    for sock, client in kept:
        client.call(FETCH)
        exchange(sock, client)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
        assert extra.recv(4096) == b""
    started = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5
    with d.connect() as mc:  # the memcached listener shares the limit: it is full too
        assert mc.recv(100).startswith(b"SERVER_ERROR too many connections")
    for sock, _ in kept:
        sock.close()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=10).id


def test_sigterm_says_goaway_to_open_connections(daemons: DaemonFactory) -> None:
    d, port = start_grpc(daemons)
    sock, client = h2_socket(port)
    sids = [client.call(FETCH) for _ in range(3)]
    exchange(sock, client)
    assert all(client.replies[sid].ended for sid in sids)
    os.kill(d.pid, signal.SIGTERM)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    client.take(data)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.NO_ERROR
    assert client.goaway.last_stream_id == sids[-1]
    assert d.proc.wait(10) == 0


@pytest.mark.once
def test_idle_connections_get_goaway_then_a_close(daemons: DaemonFactory) -> None:
    _, port = start_grpc(daemons, "--idle-timeout", "1s")
    sock, client = h2_socket(port)
    client.call(FETCH)
    exchange(sock, client)
    sock.settimeout(10)
    started = time.monotonic()
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    assert 0.5 < time.monotonic() - started < 5
    client.take(data)
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.NO_ERROR


@pytest.mark.once
def test_workers_share_the_grpc_port(daemons: DaemonFactory) -> None:
    """--workers 2: both processes answer gRPC on the one port (SO_REUSEPORT spreads connections)."""
    port = free_port()
    d = daemons.start("--workers", "2", "--grpc-port", str(port), worker_id=30)
    wait_for_port(port, d.proc)
    workers: set[int] = set()
    deadline = time.monotonic() + 20
    while len(workers) < 2 and time.monotonic() < deadline:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # a new connection each time
            workers.add(decode(pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=5).id)[1])
    assert workers == {30, 31}

"""With --token-file an HTTP or gRPC connection is unauthenticated until its first request with a good
token (issue 33): what counts as that request, and that nothing changes without --token-file. The
attack itself (never-authenticating TLS connections filling their share) is in tests/test_hostile.py."""

from __future__ import annotations

import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, free_port, wait_for_port
from hostile_clients import read_response

from katsubushi_py.frontends.grpc_frames import PREFACE, SETTINGS, frame

pytestmark = pytest.mark.once

TOKEN = secrets.token_urlsafe(24)


@pytest.fixture
def files() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kp-token-login-"))
    directory.chmod(0o755)
    (directory / "tokens").write_text(TOKEN + "\n")
    (directory / "users").write_text("alice:secret1\n")
    (directory / "users").chmod(0o644)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def get(sock: socket.socket, path: str, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n".encode())
    return read_response(sock)[0].split(b"\r\n")[0]


def rest(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything until the server closes, and when it closed (seconds from now)."""
    started = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    while piece := sock.recv(65536):
        data += piece
    return data, time.monotonic() - started


def stats(port: int, command: bytes = b"stats") -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command + b"\r\n")
        data = b""
        while not data.endswith(b"END\r\n"):
            data += sock.recv(65536)
    return dict(line.split(" ")[1:3] for line in data.decode().splitlines()[:-1])


def test_only_a_request_with_a_good_token_authenticates_an_http_connection(daemons: DaemonFactory, files: Path) -> None:
    port = free_port()
    d = daemons.start("--http-port", str(port), "--token-file", str(files / "tokens"), "--login-timeout", "1.5s")
    wait_for_port(port, d.proc)
    good, probe, wrong, idle = (socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4))
    assert get(good, "/id", TOKEN) == b"HTTP/1.1 200 OK"
    assert get(probe, "/healthz") == b"HTTP/1.1 200 OK"  # open, but not a login
    assert get(wrong, "/id", "x" * 20) == b"HTTP/1.1 401 Unauthorized"
    assert get(wrong, "/nowhere", TOKEN) == b"HTTP/1.1 404 Not Found"  # the token is not checked there
    assert stats(d.port)["unauthenticated_connections"] == "3"  # type: ignore[arg-type]
    for sock in (probe, wrong, idle):
        said, after = rest(sock, 5)
        assert said.startswith(b"HTTP/1.1 408 Request Timeout") and b"--login-timeout" in said
        assert after < 2.5
        sock.close()
    time.sleep(0.5)
    assert get(good, "/id", TOKEN) == b"HTTP/1.1 200 OK"  # past the deadline: still open
    fields = stats(d.port)  # type: ignore[arg-type]
    assert (fields["unauthenticated_connections"], fields["login_timeouts"]) == ("0", "3")
    assert stats(d.port, b"stats settings")["login_timeout"] == "1.5"  # type: ignore[arg-type]
    good.close()


def test_grpc_connection_without_a_good_call_gets_goaway_at_the_login_deadline(
    daemons: DaemonFactory, files: Path
) -> None:
    port = free_port()
    d = daemons.start("--grpc-port", str(port), "--token-file", str(files / "tokens"), "--login-timeout", "1s")
    wait_for_port(port, d.proc)
    grpc = pytest.importorskip("grpc")
    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    good = [("authorization", f"Bearer {TOKEN}")]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        generator = pb_grpc.GeneratorStub(channel)
        first = generator.Fetch(pb.FetchRequest(), timeout=5, metadata=good).id
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
        said, after = rest(sock, 5)
        assert b"did not send a call with a valid bearer token within --login-timeout" in said and after < 2
        sock.close()
        for _ in range(50):  # the authenticated channel's connection, past the deadline: served, never closed
            assert generator.Fetch(pb.FetchRequest(), timeout=5, metadata=good).id > first
        fields = stats(d.port)  # type: ignore[arg-type]
        assert (fields["login_timeouts"], fields["unauthenticated_connections"]) == ("1", "0")
        assert fields["curr_connections"] == "2"  # the channel's one connection, and this stats one


def test_without_token_file_http_connections_are_authenticated_once_made(daemons: DaemonFactory, files: Path) -> None:
    # --auth-file (memcached logins) with a short --login-timeout, and no --token-file: the HTTP
    # connection has nothing to authenticate and is not closed by the login deadline.
    port = free_port()
    d = daemons.start("--http-port", str(port), "--auth-file", str(files / "users"), "--login-timeout", "0.5s")
    wait_for_port(port, d.proc)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        time.sleep(1.2)
        assert get(sock, "/id") == b"HTTP/1.1 200 OK"

"""Authentication (issue 27): memcached's text auth file and SASL PLAIN, bearer tokens for HTTP and
gRPC, credentials reloaded on SIGHUP, bad input on the login paths. Real daemon processes, real
clients (pymemcache, python-binary-memcached, urllib, grpcio) and, for the bytes, a real memcached."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bmemcached
import pytest
from conftest import DAEMON_CMD, Daemon, DaemonFactory, decode, free_port, recv_all, wait_for_port
from pymemcache.client.base import Client as PymemcacheClient
from pymemcache.exceptions import MemcacheClientError

from katsubushi_py.auth.credentials import AuthConfig, Credentials
from katsubushi_py.auth.gate import MAX_FAILURES, MAX_UNAUTHENTICATED, AuthGate

USERS = "alice:secret1\nbob:pw:with:colons\n"
TOKEN = secrets.token_urlsafe(24)


def hdr(opcode: int, key: bytes = b"", value: bytes = b"", extras: bytes = b"", opaque: int = 0) -> bytes:
    """A binary request packet."""
    body = extras + key + value
    return struct.pack(">BBHBBHIIQ", 0x80, opcode, len(key), len(extras), 0, 0, len(body), opaque, 0) + body


def login(user: bytes, password: bytes) -> bytes:
    data = user + b" " + password
    return b"set auth 0 0 %d\r\n%b\r\n" % (len(data), data)


@pytest.fixture
def secrets_dir() -> Iterator[Path]:
    """Credential files readable by memcached's 'nobody' too (pytest's tmp_path is private)."""
    directory = Path(tempfile.mkdtemp(prefix="kp-auth-"))
    directory.chmod(0o755)
    (directory / "users").write_text(USERS)
    (directory / "users").chmod(0o644)
    (directory / "tokens").write_text(f"{secrets.token_urlsafe(24)}\n{TOKEN}\n")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def start_auth(daemons: DaemonFactory, secrets_dir: Path, *args: str) -> Daemon:
    return daemons.start("--auth-file", str(secrets_dir / "users"), *args)


def exchange(sock: socket.socket, data: bytes, quiet: float = 0.1) -> bytes:
    """Send; the reply: what arrives within 3 s of the send, up to a pause of ``quiet`` seconds."""
    sock.sendall(data)
    sock.settimeout(3)
    try:
        first = sock.recv(65536)
    except TimeoutError:
        return b""
    return first + recv_all(sock, quiet) if first else b""


def closed(sock: socket.socket, timeout: float = 3.0) -> bool:
    """Whether the peer closed: EOF (after whatever it still sent) within the timeout."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, TimeoutError):
        return False
    return True


class Memcached:
    """A real memcached with the same flags, to compare bytes with."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        if shutil.which("memcached") is None:
            pytest.skip("memcached is not installed")
        self.port = free_port()
        user = ["-u", "nobody"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            ["memcached", *user, "-U", "0", "-l", "127.0.0.1", "-p", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        wait_for_port(self.port, self.proc)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(5)


# -- the text protocol's auth file -------------------------------------------------------------------
TEXT_CONVERSATIONS = [
    # (what is sent, one piece at a time) -- both servers must answer each piece with the same bytes
    [b"get a\r\n", b"mg a v\r\n", b"stats\r\n", b"version\r\n", b"ms k 2\r\n", b"hi\r\n", b"gets a b\r\n"],
    [login(b"alice", b"wrong"), b"get a\r\n"],
    [login(b"mallory", b"secret1"), b"get a\r\n"],
    [b"set auth 0 0 5\r\nalice\r\n", b"get a\r\n"],  # no space: not a user and password
    [b"set auth 0 0 10\r\nalice wrong\r\n", b"get a\r\n"],  # data longer than said
    [b"set auth 0 0 abc\r\n", b"set\r\n", b"get a\r\n"],
    [login(b"alice", b"secret1")],
    [login(b"bob", b"pw:with:colons")],
]


@pytest.mark.once
def test_text_login_answers_byte_for_byte_as_memcached_does(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    memcached = Memcached("-Y", str(secrets_dir / "users"))
    try:
        for conversation in TEXT_CONVERSATIONS:
            ours, theirs = d.connect(), memcached.connect()
            try:
                for piece in conversation:
                    a, b = exchange(ours, piece), exchange(theirs, piece)
                    assert a == b, (conversation, piece, a, b)
                    assert a, (conversation, piece)  # each piece is answered (never a silent hang)
            finally:
                ours.close()
                theirs.close()
    finally:
        memcached.stop()


def test_text_no_id_before_login_then_ids_on_the_same_connection(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir, "--gets-cas")
    s = d.connect()
    try:
        assert exchange(s, b"get a b\r\nmg a v\r\n") == b"CLIENT_ERROR unauthenticated\r\n" * 2
        # A login with noreply is not answered when it succeeds (memcached answers STORED anyway).
        assert (
            exchange(s, b"set auth 0 0 13 noreply\r\nalice secret2\r\n") == b"CLIENT_ERROR authentication failure\r\n"
        )
        # The login and a get in one write: the get is answered by the real protocol.
        reply = exchange(s, b"set auth 0 0 13 noreply\r\nalice secret1\r\nget a b\r\n")
        assert reply.startswith(b"VALUE a 0 19\r\n") and reply.endswith(b"END\r\n")
        reply = exchange(s, b"mg x v\r\ngets k\r\n")
        assert reply.startswith(b"VA 19\r\n") and b"VALUE k 0 19 " in reply  # --gets-cas carried over
        stats = exchange(s, b"stats\r\n")
        assert b"STAT cmd_get 3\r\n" in stats  # no get before the login was counted (nothing issued)
        assert b"STAT auth_cmds 2\r\nSTAT auth_errors 1\r\n" in stats  # memcached's names and meaning
    finally:
        s.close()


def test_pymemcache_logs_in_with_set(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    client = PymemcacheClient(("127.0.0.1", d.port), timeout=5)
    try:
        with pytest.raises(MemcacheClientError, match="unauthenticated"):
            client.get("a")
        # pymemcache sends noreply by default: a login with noreply is not answered (memcached
        # answers STORED anyway, which the client then reads as the reply to its next command).
        assert client.set("auth", "alice secret1") is True
        one = int(client.get("a"))
        many = client.get_many(["a", "b", "c"])
        assert decode(one)[1] == 7 and all(int(v) > one for v in many.values()) and len(many) == 3
    finally:
        client.close()
    wrong = PymemcacheClient(("127.0.0.1", d.port), timeout=5)
    try:
        with pytest.raises(MemcacheClientError, match="authentication failure"):
            wrong.set("auth", "alice secret2", noreply=False)
        with pytest.raises(MemcacheClientError, match="unauthenticated"):
            wrong.get("a")
    finally:
        wrong.close()


# -- SASL PLAIN on the binary protocol ---------------------------------------------------------------
def test_bmemcached_sasl_plain_right_and_wrong_password(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    client = bmemcached.Client([f"127.0.0.1:{d.port}"], "alice", "secret1", socket_timeout=5)
    try:
        one = int(client.get("a"))
        many = client.get_multi(["a", "b", "c"])
        assert sorted(many) == ["a", "b", "c"] and min(int(v) for v in many.values()) > one
        assert decode(one)[1] == 7
    finally:
        client.disconnect_all()
    wrong = bmemcached.Client([f"127.0.0.1:{d.port}"], "alice", "nope", socket_timeout=5)
    try:
        # bmemcached knows status 0x08 as "invalid credentials"; memcached answers 0x20, and so do we.
        with pytest.raises(bmemcached.exceptions.MemcachedException, match="Auth failure"):
            wrong.get("a")
    finally:
        wrong.disconnect_all()
    anonymous = bmemcached.Client([f"127.0.0.1:{d.port}"], socket_timeout=5)
    try:
        with pytest.raises(bmemcached.exceptions.MemcachedException, match="Auth failure"):
            anonymous.get("a")  # refused and closed, as memcached -S does: no ID
    finally:
        anonymous.disconnect_all()


BINARY_CONVERSATIONS = [
    # Sent one packet at a time to both; memcached -S (cyrus SASL) and we must answer alike.
    [hdr(0x00, b"a", opaque=7)],  # a get before the login: Auth failure. and the close
    [hdr(0x21, b"PLAIN", b"\0alice\0wrong", opaque=9), hdr(0x0B, opaque=3), hdr(0x00, b"a", opaque=4)],
    [hdr(0x21, b"PLAIN", b"garbage"), hdr(0x22, b"PLAIN", b"\0alice\0wrong")],
    [hdr(0x21, b"PLAIN"), hdr(0x0A)],  # no initial response: "continue"; then NOOP is refused
    [hdr(0x21, b"PLAIN", b"\0alice\0secret1", extras=b"abcd")],  # extras: invalid arguments, closed
    [hdr(0x21, b"PLAIN", b"x" * 5000)],
]


@pytest.mark.once
def test_sasl_answers_as_memcached_does(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    pwdb = secrets_dir / "users"
    memcached = Memcached("-S", env={"MEMCACHED_SASL_PWDB": str(pwdb), "SASL_CONF_PATH": str(secrets_dir)})
    try:
        for conversation in BINARY_CONVERSATIONS:
            ours, theirs = d.connect(), memcached.connect()
            try:
                for piece in conversation:
                    a, b = exchange(ours, piece), exchange(theirs, piece)
                    if piece[1] == 0x0B:  # VERSION: the versions differ, the shape does not
                        a, b = a[:11], b[:11]
                    # The 5000-byte SASL body: memcached reads it and fails the login; we refuse it unread.
                    if len(piece) > 4096:
                        assert a[6:8] == b"\x00\x04" and b[6:8] == b"\x00\x20", (a, b)
                        continue
                    assert a == b, (conversation, piece, a, b)
            finally:
                ours.close()
                theirs.close()
    finally:
        memcached.stop()


def test_sasl_list_mechanisms_login_and_pipelined_get(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    s = d.connect()
    try:
        reply = exchange(s, hdr(0x20, opaque=5))
        assert reply == struct.pack(">BBHBBHI4sQ", 0x81, 0x20, 0, 0, 0, 0, 5, b"\0\0\0\x05", 0) + b"PLAIN"
        reply = exchange(s, hdr(0x21, b"PLAIN", b"alice\0alice\0secret1", opaque=6) + hdr(0x0C, b"k", opaque=8))
        assert reply[:24] == struct.pack(">BBHBBHI4sQ", 0x81, 0x21, 0, 0, 0, 0, 13, b"\0\0\0\x06", 0)
        assert reply[24:37] == b"Authenticated"
        get = reply[37:]
        assert get[1] == 0x0C and get[6:8] == b"\0\0" and get[12:16] == b"\0\0\0\x08" and get[28:29] == b"k"
        assert decode(int(get[29:]))[1] == 7
    finally:
        s.close()


# -- bad input on the login paths --------------------------------------------------------------------
@pytest.mark.once
def test_failed_login_flood_is_slowed_then_closed_and_the_daemon_serves_on(
    daemons: DaemonFactory, secrets_dir: Path
) -> None:
    d = start_auth(daemons, secrets_dir)
    # One write of many wrong passwords: answered one at a time (a delay each), then the close.
    s = d.connect()
    start = time.monotonic()
    s.sendall(login(b"alice", b"guess") * 1000)
    reply = b""
    s.settimeout(10)
    while chunk := s.recv(65536):
        reply += chunk
    assert reply == b"CLIENT_ERROR authentication failure\r\n" * MAX_FAILURES
    assert time.monotonic() - start >= 0.1 * MAX_FAILURES  # each failure was answered after a delay
    s.close()
    # Binary: the same.
    s = d.connect()
    s.sendall(hdr(0x21, b"PLAIN", b"\0alice\0guess") * 1000)
    assert closed(s, 10)
    s.close()
    # Commands without a login: answered, then the close (no unbounded reply to a flood of lines).
    s = d.connect()
    s.sendall(b"get a\r\n" * 10_000)
    assert closed(s)
    s.close()
    # Many connections failing in parallel do not stop a right login.
    socks = [d.connect() for _ in range(20)]
    for sock in socks:
        sock.sendall(login(b"bob", b"guess") * 3)
    good = d.connect()
    try:
        assert exchange(good, login(b"bob", b"pw:with:colons") + b"get a\r\n").startswith(b"STORED\r\nVALUE a ")
    finally:
        good.close()
        for sock in socks:
            sock.close()
    assert "Traceback" not in d.stderr()
    assert MAX_UNAUTHENTICATED < 10_000


@pytest.mark.parametrize(
    "attack",
    [
        b"x" * 100_000,  # a line that never ends
        b"set auth 0 0 100000000\r\n" + b"x" * 50_000,  # login data too long to be a password
        hdr(0x21, b"PLAIN", b"\0" * 5000),  # an oversized SASL payload
        struct.pack(">BBHBBHIIQ", 0x80, 0x21, 5, 0, 0, 0, 2**31, 0, 0) + b"PLAIN",  # a body of 2 GiB
        b"\x80" + b"\xff" * 30,  # garbage after the binary magic
    ],
    ids=["endless-line", "huge-login-data", "oversized-sasl", "2GiB-sasl", "garbage"],
)
def test_oversized_and_malformed_logins_are_refused_and_closed(
    daemons: DaemonFactory, secrets_dir: Path, attack: bytes
) -> None:
    d = start_auth(daemons, secrets_dir)
    s = d.connect()
    try:
        with __import__("contextlib").suppress(ConnectionResetError, BrokenPipeError):
            s.sendall(attack)
        assert closed(s)
    finally:
        s.close()
    s = d.connect()
    try:
        assert exchange(s, login(b"alice", b"secret1")) == b"STORED\r\n"  # the daemon still serves
    finally:
        s.close()
    assert "Traceback" not in d.stderr()


def test_gate_holds_no_issuer_and_hands_the_rest_over() -> None:
    """The sans-IO gate: it cannot issue (it has no issuer); a login's trailing bytes go to the callback."""
    directory = Path(tempfile.mkdtemp())
    try:
        (directory / "users").write_text(USERS)
        credentials = Credentials(AuthConfig(str(directory / "users")))
        handed: list[tuple[str, bytes]] = []
        gate = AuthGate(credentials, "1.0", lambda protocol, rest: handed.append((protocol, rest)) or b"<real>")
        assert not any("issuer" in name or "generator" in name for name in AuthGate.__slots__)
        assert gate.receive(b"set k 0 0 13\r\nalice sec") == b""
        assert gate.receive(b"ret1\r\nget a\r\n") == b"STORED\r\n<real>"
        assert handed == [("text", b"get a\r\n")]
        gate = AuthGate(credentials, "1.0", lambda protocol, rest: handed.append((protocol, rest)) or b"")
        packet = hdr(0x21, b"PLAIN", b"\0bob\0pw:with:colons")
        assert gate.receive(packet[:30]) == b""
        assert gate.receive(packet[30:] + b"\x80rest").endswith(b"Authenticated")
        assert handed[-1] == ("binary", b"\x80rest")
    finally:
        shutil.rmtree(directory)


# -- HTTP and gRPC bearer tokens ---------------------------------------------------------------------
def http_get(port: int, path: str, token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_http_bearer_token(daemons: DaemonFactory, secrets_dir: Path) -> None:
    port = free_port()
    d = daemons.start("--http-port", str(port), "--token-file", str(secrets_dir / "tokens"))
    wait_for_port(port, d.proc)
    status, headers, body = http_get(port, "/id")
    assert status == 401 and headers["WWW-Authenticate"] == 'Bearer realm="katsubushi-py"' and b"Bearer" in body
    status, headers, _ = http_get(port, "/ids?n=3", "x" * 32)
    assert status == 401 and 'error="invalid_token"' in headers["WWW-Authenticate"]
    assert http_get(port, "/metrics")[0] == 401 and http_get(port, "/stats")[0] == 401
    status, _, body = http_get(port, "/id", TOKEN)
    assert status == 200 and decode(int(body))[1] == 7
    assert http_get(port, "/metrics", TOKEN)[0] == 200
    assert http_get(port, "/healthz")[0] == 200  # open: load balancers and kubelets probe it
    assert http_get(port, "/livez")[0] == 200  # open too: the liveness probe
    stats = json.loads(http_get(port, "/stats", TOKEN)[2])
    assert stats["auth_token_errors"] == 4 and "auth_cmds" not in stats  # no --auth-file here
    # The memcached listener is not covered by --token-file (that is --auth-file's).
    s = d.connect()
    try:
        assert exchange(s, b"get a\r\n").startswith(b"VALUE a 0 19")
    finally:
        s.close()
    # --metrics-no-auth: /metrics open, the rest still closed.
    port = free_port()
    d = daemons.start(
        "--http-port", str(port), "--token-file", str(secrets_dir / "tokens"), "--metrics-no-auth", worker_id=8
    )
    wait_for_port(port, d.proc)
    assert http_get(port, "/metrics")[0] == 200 and http_get(port, "/id")[0] == 401


def test_grpc_bearer_token(daemons: DaemonFactory, secrets_dir: Path) -> None:
    grpc = pytest.importorskip("grpc")
    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    port = free_port()
    d = daemons.start("--grpc-port", str(port), "--token-file", str(secrets_dir / "tokens"))
    wait_for_port(port, d.proc)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        generator = pb_grpc.GeneratorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            generator.Fetch(pb.FetchRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in refused.value.details()
        with pytest.raises(grpc.RpcError) as wrong:
            generator.FetchMulti(
                pb.FetchMultiRequest(n=3), timeout=5, metadata=[("authorization", "Bearer " + "y" * 20)]
            )
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED and "invalid" in wrong.value.details()
        good = [("authorization", f"Bearer {TOKEN}")]
        one = generator.Fetch(pb.FetchRequest(), timeout=5, metadata=good).id
        many = generator.FetchMulti(pb.FetchMultiRequest(n=3), timeout=5, metadata=good).ids
        assert decode(one)[1] == 7 and len(many) == 3 and min(many) > one
        for _ in range(5):  # the same channel, calls the fast path serves between them: each is checked
            assert generator.Fetch(pb.FetchRequest(), timeout=5, metadata=good).id > one
            with pytest.raises(grpc.RpcError) as again:
                generator.Fetch(pb.FetchRequest(), timeout=5)
            assert again.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The token revoked by a reload: refused on the channel that used it a moment ago.
        new_token = secrets.token_urlsafe(24)
        (secrets_dir / "tokens").write_text(new_token + "\n")
        os.kill(d.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "credentials reloaded" not in d.stderr() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as revoked:
            generator.Fetch(pb.FetchRequest(), timeout=5, metadata=good)
        assert revoked.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert generator.Fetch(pb.FetchRequest(), timeout=5, metadata=[("authorization", f"Bearer {new_token}")]).id


# -- files: start and reload -------------------------------------------------------------------------
@pytest.mark.once
@pytest.mark.parametrize(
    ("flag", "content", "message"),
    [
        ("--auth-file", None, "cannot read --auth-file"),
        ("--auth-file", "\n\n", "is empty"),
        ("--auth-file", "alice\n", "line 1: expected user:password"),
        ("--token-file", "short\n", "at least 16 characters"),
        ("--token-file", "has space in it 0123456789\n", "line 1: a token is"),
    ],
    ids=["missing", "empty", "no-colon", "short-token", "bad-token"],
)
def test_a_bad_credentials_file_is_one_line_and_exit_2(
    daemons: DaemonFactory, tmp_path: Path, flag: str, content: str | None, message: str
) -> None:
    path = tmp_path / "creds"
    if content is not None:
        path.write_text(content)
    d = daemons.start(flag, str(path), wait=False)
    assert d.proc.wait(10) == 2
    lines = d.stderr().strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(path) in lines[0], lines


def test_sighup_reloads_credentials_without_dropping_connections(daemons: DaemonFactory, secrets_dir: Path) -> None:
    port = free_port()
    d = daemons.start(
        "--auth-file", str(secrets_dir / "users"), "--http-port", str(port), "--token-file", str(secrets_dir / "tokens")
    )
    wait_for_port(port, d.proc)
    kept = d.connect()
    try:
        assert exchange(kept, login(b"alice", b"secret1")) == b"STORED\r\n"
        new_token = secrets.token_urlsafe(24)
        (secrets_dir / "users").write_text("carol:new-password\n")
        (secrets_dir / "tokens").write_text(new_token + "\n")
        os.kill(d.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "credentials reloaded" not in d.stderr() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "credentials reloaded: 1 user(s)" in d.stderr()
        assert exchange(kept, b"get a\r\n").startswith(b"VALUE a 0 19")  # still logged in, still open
        s = d.connect()
        try:
            assert exchange(s, login(b"alice", b"secret1")) == b"CLIENT_ERROR authentication failure\r\n"
            assert exchange(s, login(b"carol", b"new-password")) == b"STORED\r\n"
        finally:
            s.close()
        assert http_get(port, "/id", TOKEN)[0] == 401 and http_get(port, "/id", new_token)[0] == 200
        # A broken file at reload: one log line, the credentials in use are kept.
        (secrets_dir / "users").write_text("no colon here\n")
        os.kill(d.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while "credentials not reloaded" not in d.stderr() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "line 1: expected user:password" in d.stderr()
        s = d.connect()
        try:
            assert exchange(s, login(b"carol", b"new-password") + b"get a\r\n").startswith(b"STORED\r\nVALUE a ")
        finally:
            s.close()
        assert exchange(kept, b"get b\r\n").startswith(b"VALUE b 0 19")
        assert d.proc.poll() is None and "Traceback" not in d.stderr()
    finally:
        kept.close()


def test_auth_over_a_unix_socket(daemons: DaemonFactory, secrets_dir: Path, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    daemons.start("--auth-file", str(secrets_dir / "users"), port=None, sock=path)
    client = bmemcached.Client([path], "bob", "pw:with:colons", socket_timeout=5)
    try:
        assert decode(int(client.get("a")))[1] == 7
    finally:
        client.disconnect_all()


@pytest.mark.once
def test_sighup_to_the_workers_supervisor_reloads_every_process(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = daemons.start("--auth-file", str(secrets_dir / "users"), "--workers", "2", worker_id=3)
    deadline = time.monotonic() + 10
    while d.stderr().count("serving worker id") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    (secrets_dir / "users").write_text("dave:another-password\n")
    os.kill(d.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while d.stderr().count("credentials reloaded") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.stderr().count("credentials reloaded: 1 user(s)") == 2
    for _ in range(4):  # whichever process takes the connection
        s = d.connect()
        try:
            assert exchange(s, login(b"dave", b"another-password")) == b"STORED\r\n"
        finally:
            s.close()
    assert d.proc.poll() is None


def test_the_beyond_loopback_warning_names_what_auth_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    from katsubushi_py.daemon import server

    monkeypatch.setattr(server, "IMPLEMENTATION", "compiled")
    addresses = ["0.0.0.0:11212", "http://0.0.0.0:8080", "grpc://0.0.0.0:50051"]
    [line] = server.startup_warnings(addresses)
    assert "no authentication" in line and "--auth-file (memcached), --token-file (HTTP, gRPC)" in line
    open_line, covered_line = server.startup_warnings(addresses, auth=AuthConfig(auth_file="users"))
    assert open_line.startswith("listening beyond loopback (http://0.0.0.0:8080, grpc://0.0.0.0:50051) with no")
    assert covered_line.startswith("listening beyond loopback (0.0.0.0:11212) with authentication but no encr")
    [line] = server.startup_warnings(addresses, auth=AuthConfig(auth_file="users", token_file="tokens"))
    assert "with authentication but no encryption" in line and "0.0.0.0:11212, http://0.0.0.0:8080" in line


def test_the_health_command_logs_in_with_the_auth_file(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir)
    base = [*DAEMON_CMD, "health", "--port", str(d.port)]
    ok = subprocess.run([*base, "--auth-file", str(secrets_dir / "users")], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and "issued" in ok.stdout + ok.stderr and "(worker 7)" in ok.stdout + ok.stderr
    by_pid = subprocess.run([*DAEMON_CMD, "health", "--pid", str(d.pid)], capture_output=True, text=True, timeout=30)
    assert by_pid.returncode == 0, by_pid.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert refused.returncode == 1 and "CLIENT_ERROR unauthenticated" in refused.stdout + refused.stderr


def test_a_connection_that_does_not_log_in_in_time_is_closed(daemons: DaemonFactory, secrets_dir: Path) -> None:
    d = start_auth(daemons, secrets_dir, "--login-timeout", "0.5s")
    idle, chatty, logged_in = d.connect(), d.connect(), d.connect()
    try:
        assert exchange(logged_in, login(b"alice", b"secret1")) == b"STORED\r\n"
        start = time.monotonic()
        chatty.sendall(b"version\r\n")
        assert closed(idle, 5) and closed(chatty, 5)
        assert time.monotonic() - start < 4
        time.sleep(0.3)
        assert exchange(logged_in, b"get a\r\n").startswith(b"VALUE a 0 19")  # logged in: kept
    finally:
        for s in (idle, chatty, logged_in):
            s.close()


async def test_after_the_login_the_connection_runs_the_usual_protocol_object(secrets_dir: Path) -> None:
    """In-process: before the login the connection's protocol is the gate (no issuer); after it, the
    very TextConnection / BinaryConnection a connection without authentication has, compiled where
    built (its receive the C method, so the compiled ProtocolCore calls it directly)."""
    import asyncio

    from katsubushi_py.config import ServerConfig
    from katsubushi_py.daemon.server import Daemon as InProcessDaemon
    from katsubushi_py.frontends.binary import BinaryConnection
    from katsubushi_py.frontends.fastpath import COMPILED, BinaryCore, TextCore
    from katsubushi_py.frontends.text import TextConnection
    from katsubushi_py.issuing.generator import Generator

    config = ServerConfig(worker_id=4, port=0, auth=AuthConfig(auth_file=str(secrets_dir / "users")))
    daemon = InProcessDaemon(config, Generator(4), asyncio.get_running_loop())
    await daemon.start()
    port = int(daemon.addresses[0].rsplit(":", 1)[1])
    try:
        for first, logged_in, core, cls in [
            (b"get a\r\n", login(b"alice", b"secret1"), TextCore, TextConnection),
            (hdr(0x0B), hdr(0x21, b"PLAIN", b"\0alice\0secret1"), BinaryCore, BinaryConnection),
        ]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(first)
            await reader.read(100)
            [handler] = daemon.connections
            assert isinstance(handler._conn, AuthGate)
            writer.write(logged_in)
            await reader.read(100)
            conn = handler._conn
            assert type(conn) is cls and handler._receive == conn.receive
            if COMPILED:
                assert isinstance(conn, core) and type(conn).receive is core.receive
            writer.close()
            await writer.wait_closed()
            for _ in range(100):
                if not daemon.connections:
                    break
                await asyncio.sleep(0.01)
    finally:
        await daemon.stop()


DALLI_SASL = """
require "dalli"
require "logger"
Dalli.logger = Logger.new($stderr)  # (its log goes to stdout by default)
address, user, password = ARGV
client = Dalli::Client.new(address, username: user, password: password, socket_max_failures: 1, down_retry_delay: 0)
begin
  puts client.get("a", raw: true)
  puts client.get_multi("a", "b", "c").values.join(" ")
rescue => e
  puts "error #{e.class}: #{e}"
end
"""


@pytest.mark.once
def test_ruby_dalli_sasl_plain(daemons: DaemonFactory, secrets_dir: Path, tmp_path: Path) -> None:
    ruby = shutil.which("ruby")
    if ruby is None or subprocess.run([ruby, "-e", 'require "dalli"'], capture_output=True).returncode != 0:
        pytest.skip("ruby and Dalli are missing (apt-get install ruby ruby-dalli)")
    d = start_auth(daemons, secrets_dir)
    script = tmp_path / "dalli.rb"
    script.write_text(DALLI_SASL)
    address = f"127.0.0.1:{d.port}"
    good = subprocess.run([ruby, str(script), address, "alice", "secret1"], capture_output=True, text=True, timeout=60)
    one, many = good.stdout.split("\n")[:2]
    assert decode(int(one))[1] == 7 and len(many.split()) == 3 and min(int(x) for x in many.split()) > int(one)
    bad = subprocess.run([ruby, str(script), address, "alice", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.stdout.startswith("error") and "0x20" in bad.stdout, bad.stdout + bad.stderr

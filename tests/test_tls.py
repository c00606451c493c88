"""TLS on every listener (issue 27), with real clients against the real daemon and, in the same test,
Debian's ``memcached -Z`` with the same certificates: pymemcache with a TLS context (and a client
certificate for mutual TLS), HTTP and gRPC over TLS, clients on the wrong kind of port, certificates
swapped and reloaded (SIGHUP, ``refresh_certs``) under an open connection, bad files at start, and
bad input where a handshake should be. Certificates are made by ``openssl`` (tests/tls_certs.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, DaemonFactory, daemon_env, decode, free_port, recv_until, wait_for_port
from pymemcache.client.base import Client
from tls_certs import Certs, issue, make_certs

from katsubushi_py.config import ConfigError, parse_server_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def client_context(certs: Certs, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca.cert)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def tls_args(certs: Certs, *extra: str, cert: str | None = None, key: str | None = None) -> list[str]:
    return ["--tls-cert", cert or certs.server.cert, "--tls-key", key or certs.server.key, *extra]


def start_memcached(certs: Certs, *options: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("memcached")
    if binary is None:
        pytest.skip("memcached is not installed (apt-get install memcached)")
    port = free_port()
    extended = ",".join([f"ssl_chain_cert={certs.server.cert}", f"ssl_key={certs.server.key}", *options])
    cmd = [binary, "-Z", "-o", extended, "-l", "127.0.0.1", "-p", str(port), "-U", "0", "-t", "1", "-m", "16"]
    if os.geteuid() == 0:
        cmd += ["-u", "root"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_port(port, proc)  # type: ignore[arg-type]
    return proc, port


@pytest.fixture
def memcached_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def fetch(port: int, ctx: ssl.SSLContext | None) -> tuple[str, bytes | None]:
    """('ok', the value of key 'a') or ('refused', None) for a pymemcache client on ``port``."""
    client = Client(("127.0.0.1", port), tls_context=ctx, connect_timeout=5, timeout=5)
    try:
        client.version()
        return "ok", client.get("a")
    except (ssl.SSLError, ConnectionError, OSError, Exception) as exc:  # pymemcache wraps some errors
        if isinstance(exc, AssertionError):
            raise
        return "refused", None
    finally:
        client.close()


@pytest.mark.parametrize("verify", ["none", "require"])
def test_pymemcache_over_tls_against_the_daemon_and_memcached(
    daemons: DaemonFactory, certs: Certs, memcached_procs: list[subprocess.Popen[bytes]], verify: str
) -> None:
    """Server TLS, and mutual TLS: the same clients get the same outcome from both servers; the daemon
    answers IDs, memcached a miss."""
    extra = ["--tls-ca", certs.ca.cert, "--tls-verify", verify] if verify != "none" else []
    d = daemons.start(*tls_args(certs, *extra))
    mc_options = [f"ssl_ca_cert={certs.ca.cert}", "ssl_verify_mode=2"] if verify == "require" else []
    proc, mc_port = start_memcached(certs, *mc_options)
    memcached_procs.append(proc)
    cases = {
        "no client certificate": client_context(certs),
        "a client certificate of our CA": client_context(certs, (certs.client.cert, certs.client.key)),
        "a client certificate of another CA": client_context(certs, (certs.stranger.cert, certs.stranger.key)),
    }
    for name, ctx in cases.items():
        ours, value = fetch(d.port, ctx)  # type: ignore[arg-type]
        theirs, missing = fetch(mc_port, ctx)
        assert ours == theirs, (name, ours, theirs)
        expected = "ok" if verify == "none" or name == "a client certificate of our CA" else "refused"
        assert ours == expected, name
        if ours == "ok":
            assert value is not None and decode(int(value))[1] == 7 and missing is None
    # A client that does not trust the daemon's CA refuses it, as it refuses memcached.
    untrusting = ssl.create_default_context(cafile=certs.other_ca.cert)
    assert fetch(d.port, untrusting) == fetch(mc_port, untrusting) == ("refused", None)  # type: ignore[arg-type]


def test_http_and_grpc_over_tls_and_a_plain_loopback_listener(daemons: DaemonFactory, certs: Certs) -> None:
    grpc = pytest.importorskip("grpc")
    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    http, grpc_port, plain = free_port(), free_port(), free_port()
    d = daemons.start(
        *tls_args(certs, "--http-port", str(http), "--grpc-port", str(grpc_port), "--plain-port", str(plain))
    )
    wait_for_port(grpc_port, d.proc)
    ctx = client_context(certs)
    with urllib.request.urlopen(f"https://localhost:{http}/ids?n=3", context=ctx, timeout=5) as reply:
        assert reply.status == 200
        body = reply.read().decode()
    ids = [int(x) for x in (json.loads(body) if body.startswith("[") else body.split())]
    assert len(ids) == 3 and decode(ids[0])[1] == 7
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP on the TLS port: closed
        urllib.request.urlopen(f"http://127.0.0.1:{http}/id", timeout=5)
    credentials = grpc.ssl_channel_credentials(root_certificates=Path(certs.ca.cert).read_bytes())
    with grpc.secure_channel(f"localhost:{grpc_port}", credentials) as channel:
        one = pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=5).id
        assert decode(one)[1] == 7
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # plain gRPC on the TLS port
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GeneratorStub(channel).Fetch(pb.FetchRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # --plain-port: plain memcached on loopback, beside the TLS listeners.
    with socket.create_connection(("127.0.0.1", plain), timeout=5) as s:
        s.sendall(b"get a\r\n")
        assert recv_until(s, b"END\r\n").startswith(b"VALUE a 0 ")


def test_a_plain_client_on_a_tls_port_and_a_tls_client_on_a_plain_port_fail_quickly(
    daemons: DaemonFactory, certs: Certs
) -> None:
    """Not after a deadline: the handshake fails at once (the deadline is 30 s here)."""
    plain = free_port()
    d = daemons.start(*tls_args(certs, "--plain-port", str(plain), "--request-timeout", "30s"))
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", d.port), timeout=10) as s:  # type: ignore[arg-type]
        s.sendall(b"get a\r\n")
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(100) == b""  # closed, nothing said in clear text
    with (
        pytest.raises((ssl.SSLError, ConnectionError)),
        socket.create_connection(("127.0.0.1", plain), timeout=10) as raw,
    ):
        client_context(certs).wrap_socket(raw, server_hostname="localhost")
    assert time.monotonic() - started < 10  # both failed well before any deadline
    assert d.proc.poll() is None and "Traceback" not in d.stderr()


def swap(live: Path, pair: object) -> None:
    """Replace the live certificate and key the way a certificate manager does (rename over)."""
    for source, name in ((pair.cert, "live.pem"), (pair.key, "live.key")):  # type: ignore[attr-defined]
        shutil.copyfile(source, live / (name + ".new"))
        os.replace(live / (name + ".new"), live / name)


def peer_cn(port: int, certs: Certs) -> str:
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    with client_context(certs).wrap_socket(raw, server_hostname="localhost") as s:
        subject = dict(x[0] for x in s.getpeercert()["subject"])  # type: ignore[index]
        return subject["commonName"]


def test_certificates_reloaded_by_sighup_and_refresh_certs_under_an_open_connection(
    daemons: DaemonFactory, certs: Certs, tmp_path: Path, memcached_procs: list[subprocess.Popen[bytes]]
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    swap(live, certs.server)
    d = daemons.start("--tls-cert", str(live / "live.pem"), "--tls-key", str(live / "live.key"))
    port: int = d.port  # type: ignore[assignment]
    held = client_context(certs).wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="localhost"
    )
    try:
        held.sendall(b"get a\r\n")
        assert recv_until(held, b"END\r\n").startswith(b"VALUE a")
        assert peer_cn(port, certs) == "localhost"

        swap(live, certs.server2)
        os.kill(d.pid, signal.SIGHUP)
        deadline = time.monotonic() + 5
        while peer_cn(port, certs) != "localhost-2" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peer_cn(port, certs) == "localhost-2"  # a new connection: the new certificate
        held.sendall(b"get b\r\n")  # the open one goes on with its session
        assert recv_until(held, b"END\r\n").startswith(b"VALUE b")

        swap(live, certs.server)
        held.sendall(b"refresh_certs\r\n")
        assert recv_until(held, b"\r\n") == b"OK\r\n"
        assert peer_cn(port, certs) == "localhost"

        # A bad key: one log line, the old certificate stays, the connection goes on.
        shutil.copyfile(certs.server2.key, live / "live.key")
        held.sendall(b"refresh_certs\r\n")
        error = recv_until(held, b"\r\n")
        assert error.startswith(b"Error ") and b"does not belong to the certificate" in error
        os.kill(d.pid, signal.SIGHUP)
        os.remove(live / "live.pem")
        held.sendall(b"refresh_certs noreply\r\nget c\r\n")
        reply = recv_until(held, b"END\r\n")
        assert reply.startswith(b"Error ") and b"VALUE c" in reply  # noreply hides OK only, as memcached
        assert peer_cn(port, certs) == "localhost"
    finally:
        held.close()
    time.sleep(0.2)
    log = d.stderr()
    assert log.count("TLS certificates not reloaded, the old ones stay in use") == 3, log
    assert log.count("TLS certificates reloaded from") == 2, log

    # memcached answers refresh_certs the same way: OK, then a line beginning "Error".
    mc_live = tmp_path / "mc"
    mc_live.mkdir()
    swap(mc_live, certs.server)
    mc_certs = Certs(certs.directory, certs.ca, type(certs.ca)(str(mc_live / "live.pem"), str(mc_live / "live.key")),
                     certs.server2, certs.client, certs.other_ca, certs.stranger)  # fmt: skip
    proc, mc_port = start_memcached(mc_certs)
    memcached_procs.append(proc)
    with client_context(certs).wrap_socket(
        socket.create_connection(("127.0.0.1", mc_port), timeout=5), server_hostname="localhost"
    ) as mc:
        mc.sendall(b"refresh_certs\r\n")
        assert recv_until(mc, b"\r\n") == b"OK\r\n"
        shutil.copyfile(certs.server2.key, mc_live / "live.key")
        mc.sendall(b"refresh_certs\r\n")
        assert recv_until(mc, b"\r\n").startswith(b"Error ")


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("missing", "nothing.pem: cannot read it: No such file or directory"),
        ("mismatch", "the key does not belong to the certificate"),
        ("expired", "the certificate expired on Jan  2 00:00:00 2020 GMT"),
        ("not pem", "not a PEM certificate or key"),
        ("verify without ca", "--tls-verify require needs --tls-ca"),
        ("plain port without tls", "--plain-port needs --tls-cert"),
    ],
)
def test_bad_tls_configuration_is_one_line(certs: Certs, tmp_path: Path, problem: str, message: str) -> None:
    args = ["--worker-id", "1", "--no-state-file"]
    if problem == "missing":
        args += tls_args(certs, cert=str(tmp_path / "nothing.pem"))
    elif problem == "mismatch":
        args += tls_args(certs, key=certs.server2.key)
    elif problem == "expired":
        expired = issue(tmp_path, certs.ca, "expired", expired=True)
        args += tls_args(certs, cert=expired.cert, key=expired.key)
    elif problem == "not pem":
        (tmp_path / "junk.pem").write_text("hello\n")
        args += tls_args(certs, cert=str(tmp_path / "junk.pem"))
    elif problem == "verify without ca":
        args += tls_args(certs, "--tls-verify", "require")
    else:
        args += ["--plain-port", "11299"]
    with pytest.raises(ConfigError) as error:
        parse_server_config(args, {})
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_bad_certificate_at_start_exits_2_with_one_line(certs: Certs, tmp_path: Path) -> None:
    argv = [*DAEMON_CMD, "--worker-id", "1", "--port", str(free_port()), *tls_args(certs, key=certs.server2.key)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=daemon_env(tmp_path / "state"))
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("katsubushi-py: error: --tls-cert ") and "does not belong to the certificate" in line


def client_hello() -> bytes:
    """The first bytes a real TLS client sends."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def closed_within(s: socket.socket, seconds: float) -> float:
    """How long until the daemon closed ``s`` (reading and discarding what it says)."""
    started = time.monotonic()
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def test_garbage_and_stalled_handshakes_are_closed(daemons: DaemonFactory, certs: Certs) -> None:
    plain = free_port()
    d = daemons.start(*tls_args(certs, "--plain-port", str(plain), "--request-timeout", "1s", "--idle-timeout", "60s"))
    port: int = d.port  # type: ignore[assignment]
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(os.urandom(3000))
    stalled = socket.create_connection(("127.0.0.1", port))  # sends nothing
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(client_hello()[:20])  # a handshake that stops
    for s in (garbage, stalled, half):
        with s:
            assert closed_within(s, 10) < 10  # (a socket timeout would raise instead)
    with socket.create_connection(("127.0.0.1", plain), timeout=5) as s:
        s.sendall(b"stats\r\n")
        stats = recv_until(s, b"END\r\n").decode()
    fields = dict(line.split(" ", 2)[1:] for line in stats.splitlines() if line.startswith("STAT "))
    assert fields["ssl_min_version"] == "tlsv1.2"
    assert fields["curr_connections"] == "1"  # only this one: handshakes never took a connection slot
    assert d.proc.poll() is None and "Traceback" not in d.stderr()


@pytest.mark.once
def test_workers_share_tls_listeners_and_reload_together(daemons: DaemonFactory, certs: Certs, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    swap(live, certs.server)
    plain = free_port()
    d = daemons.start(
        "--tls-cert", str(live / "live.pem"), "--tls-key", str(live / "live.key"), "--workers", "2",
        "--plain-port", str(plain),
    )  # fmt: skip
    port: int = d.port  # type: ignore[assignment]
    workers = set()
    for _ in range(20):
        status, value = fetch(port, client_context(certs))
        assert status == "ok" and value is not None
        workers.add(decode(int(value))[1])
    swap(live, certs.server2)
    with client_context(certs).wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="localhost"
    ) as s:
        s.sendall(b"refresh_certs\r\n")  # one process: it asks the supervisor to reload them all
        assert recv_until(s, b"\r\n") == b"OK\r\n"
    time.sleep(0.5)
    assert {peer_cn(port, certs) for _ in range(16)} == {"localhost-2"}
    with socket.create_connection(("127.0.0.1", plain), timeout=5) as s:
        s.sendall(b"get a\r\n")
        assert recv_until(s, b"END\r\n").startswith(b"VALUE a")
    assert workers <= {7, 8}


@pytest.mark.parametrize("plain", [False, True])
def test_the_health_command_checks_a_tls_daemon(daemons: DaemonFactory, certs: Certs, plain: bool) -> None:
    """``katsubushi-py health`` with the daemon's own flags: over TLS, or on --plain-port when it has one."""
    extra = ["--plain-port", str(free_port())] if plain else []
    d = daemons.start(*tls_args(certs, *extra))
    argv = [*DAEMON_CMD, "health", "--port", str(d.port), *tls_args(certs, *extra)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=daemon_env())
    assert done.returncode == 0, done.stderr
    where = f"127.0.0.1:{extra[1]}" if plain else f"127.0.0.1:{d.port}"
    assert done.stdout.startswith(f"katsubushi-py health: ok: {where} issued ")


@pytest.mark.once
def test_socket_activation_serves_tls_on_inherited_tcp_and_plain_on_the_unix_socket(
    certs: Certs, short_tmp: Path
) -> None:
    tool = shutil.which("systemd-socket-activate")
    if tool is None:
        pytest.skip("systemd-socket-activate is not installed (Debian package systemd)")
    port = free_port()
    path = str(short_tmp / "activated.sock")
    argv = [tool, "-l", f"127.0.0.1:{port}", "-l", path, "-E", f"STATE_DIRECTORY={short_tmp / 'state'}"]
    argv += [*DAEMON_CMD, "--worker-id", "12", *tls_args(certs)]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)  # starts the daemon
        with client_context(certs).wrap_socket(raw, server_hostname="localhost") as tls:
            tls.sendall(b"get a\r\n")
            assert recv_until(tls, b"END\r\n").startswith(b"VALUE a 0 ")
        with socket.socket(socket.AF_UNIX) as unix:
            unix.settimeout(10)
            unix.connect(path)
            unix.sendall(b"get b\r\n")
            assert recv_until(unix, b"END\r\n").startswith(b"VALUE b 0 ")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_tls_record_trickled_in_after_the_handshake_is_closed_by_the_request_deadline(
    daemons: DaemonFactory, certs: Certs
) -> None:
    """After a working request, a record header and then one byte a second: OpenSSL never has a whole
    record, the protocol never sees a byte, yet the connection is closed within the request deadline
    (1 s, swept every 0.25 s), not the idle timeout (60 s)."""
    plain = free_port()
    d = daemons.start(*tls_args(certs, "--plain-port", str(plain), "--request-timeout", "1s", "--idle-timeout", "60s"))
    tls = client_context(certs).wrap_socket(
        socket.create_connection(("127.0.0.1", d.port), timeout=5),  # type: ignore[arg-type]
        server_hostname="localhost",
    )
    with tls:
        tls.sendall(b"get a\r\n")
        assert recv_until(tls, b"END\r\n").startswith(b"VALUE a 0 ")
        started = time.monotonic()
        socket.socket.sendall(tls, b"\x17\x03\x03\x00\x40")  # application data, 64 bytes: never sent
        tls.settimeout(1.0)
        closed_after = None
        while time.monotonic() - started < 15:
            try:
                socket.socket.sendall(tls, b"\x00")
                while socket.socket.recv(tls, 4096):  # (our close_notify, then the end)
                    pass
                closed_after = time.monotonic() - started
                break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed_after = time.monotonic() - started
                break
    assert closed_after is not None and closed_after < 5, closed_after
    with socket.create_connection(("127.0.0.1", plain), timeout=5) as s:
        s.sendall(b"stats\r\n")
        stats = recv_until(s, b"END\r\n").decode()
    assert "STAT request_timeouts 1\r\n" in stats
    assert d.proc.poll() is None and "Traceback" not in d.stderr()

"""Hostile clients cannot exhaust the daemon (issue 33): one real daemon per attack, the attackers
written here (raw sockets, HTTP/2 frames by hand, ``ssl``), and for each the daemon's resident memory
(/proc/PID/status) and descriptors (/proc/PID/fd) during and after the attack, and a legitimate client
that logged in before it (tests/hostile_clients.py, a process of its own) asking for an ID every 2 ms
throughout: its median latency under 5 ms, no failed request, no ID twice. After each attack the
descriptors come back and the memory comes back to within 20 % of what it was before.

Scale: the issue's figures (1,000 parked header blocks, 12,000 idle TLS connections, 4 WINDOW_UPDATE
flooders) are used as they are; the never-authenticating TLS connections are 1,024 against
--max-connections 1024 instead of 4,096 against 4,096 (each is a full TLS handshake, ~3 ms of CPU for
the test and the daemon each on this 2-core machine: 4,096 would take most of the 30 s a test may
take), which exercises the same share, a half. The same with --token-file on the HTTP and gRPC ports
(256 against --max-connections 256, the legitimate client asking those ports with its token): before
issue 33's last part they counted as authenticated once made and held every place.

Baselines are taken after a warm-up (the attack once, or 300 handshakes): the first flood a process
sees grows the allocators' arenas for good (by ~10 MB for 1,000 header blocks), later ones give their
memory back; what is checked is that a flood's memory is given back, not the process's first growth.
"""

from __future__ import annotations

import contextlib
import resource
import selectors
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import DaemonFactory, free_port, wait_for_port
from hostile_clients import (
    Legit,
    LegitResult,
    connect,
    cpu_seconds,
    fd_count,
    login_line,
    read_response,
    read_until,
    rss_kib,
)
from tls_certs import Certs, make_certs

from katsubushi_py.frontends.grpc_frames import (
    CONTINUATION,
    HEADERS,
    PREFACE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
    literal_block,
)

pytestmark = pytest.mark.once

USER, PASSWORD = "alice", "secret1"
POD_LIMIT_KIB = 256 * 1024
ENHANCE_YOUR_CALM = 0xB


@pytest.fixture
def users() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kp-hostile-"))
    directory.chmod(0o755)
    path = directory / "users"
    path.write_text(f"{USER}:{PASSWORD}\n")
    path.chmod(0o644)
    try:
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


class Watch:
    """Samples the daemon's RSS and descriptors every 20 ms, for the peaks."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_rss = self.peak_fds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, AssertionError):
                self.peak_rss = max(self.peak_rss, rss_kib(self.pid))
                self.peak_fds = max(self.peak_fds, fd_count(self.pid))
            time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def baseline(pid: int) -> tuple[int, int]:
    time.sleep(1.5)  # past a trim after the warm-up
    return rss_kib(pid), fd_count(pid)


def settle(pid: int, rss: int, fds: int, timeout: float = 10.0) -> tuple[int, int]:
    """The daemon's RSS and descriptors once they are back (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        now_rss, now_fds = rss_kib(pid), fd_count(pid)
        if (now_rss <= rss * 1.2 and now_fds <= fds + 2) or time.monotonic() > deadline:
            return now_rss, now_fds
        time.sleep(0.2)


def report(
    name: str, base: tuple[int, int], watch: Watch, after: tuple[int, int], legit: LegitResult, **more: object
) -> None:
    extra = "".join(f", {key} {value}" for key, value in more.items())
    print(
        f"\n[{name}] RSS {base[0] / 1024:.1f} MiB before, {watch.peak_rss / 1024:.1f} peak, {after[0] / 1024:.1f}"
        f" after; fds {base[1]} before, {watch.peak_fds} peak, {after[1]} after; legit {len(legit.latencies_ms)}"
        f" requests, median {legit.median_ms:.2f} ms, p99 {legit.p99_ms:.2f} ms, {len(legit.failures)} failed{extra}"
    )


def check(base: tuple[int, int], watch: Watch, after: tuple[int, int], legit: LegitResult) -> None:
    assert watch.peak_rss < POD_LIMIT_KIB
    assert not legit.failures, legit.failures[:5]
    assert len(legit.ids) == len(set(legit.ids)) and len(legit.ids) > 100
    assert legit.median_ms < 5.0
    assert after[1] <= base[1] + 2, f"descriptors {after[1]} after, {base[1]} before"
    assert after[0] <= base[0] * 1.2, f"RSS {after[0]} KiB after, {base[0]} KiB before"


def goaway_code(data: bytes) -> int | None:
    """The error code of the first GOAWAY among these server frames (after nothing else: the server
    speaks first, no preface)."""
    pos = 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos : pos + 3], "big")
        if data[pos + 3] == 7 and len(data) >= pos + 9 + 8:
            return int.from_bytes(data[pos + 13 : pos + 17], "big")
        pos += 9 + length
    return None


def drain(socks: list[socket.socket] | list[ssl.SSLSocket], timeout: float) -> tuple[list[bytes], int]:
    """Read every socket to its end (the server's close); (what each said, how many are still open)."""
    sel = selectors.DefaultSelector()
    got: dict[int, bytearray] = {}
    for i, sock in enumerate(socks):
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)
        got[i] = bytearray()
    open_ = len(socks)
    deadline = time.monotonic() + timeout
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(0.2):
            try:
                piece = key.fileobj.recv(65536)  # type: ignore[union-attr]
            except (BlockingIOError, ssl.SSLWantReadError):
                continue
            except OSError:
                piece = b""
            if piece:
                got[key.data] += piece
            else:
                sel.unregister(key.fileobj)
                open_ -= 1
    sel.close()
    for sock in socks:
        sock.close()
    return [bytes(got[i]) for i in range(len(socks))], open_


# -- 1,000 parked header blocks -----------------------------------------------------------------------
def park(port: int, size: int) -> socket.socket:
    """A gRPC connection whose header block is begun (HEADERS, then CONTINUATIONs of up to 16 KB: ``size``
    bytes in all) and never ended."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    frames = [PREFACE, frame(SETTINGS, 0, 0, b""), frame(HEADERS, 0, 1, b"\x00" * min(size, 16384))]
    size -= 16384
    while size > 0:
        frames.append(frame(CONTINUATION, 0, 1, b"\x00" * min(size, 16384)))
        size -= 16384
    sock.sendall(b"".join(frames))
    return sock


def test_parked_header_blocks_are_bounded_and_closed_by_the_deadline(
    daemons: DaemonFactory, users: Path, tmp_path: Path
) -> None:
    gport = free_port()
    daemon = daemons.start("--auth-file", str(users), "--grpc-port", str(gport), "--request-timeout", "3s")
    wait_for_port(gport, daemon.proc)
    legit = Legit(daemon.port, USER, PASSWORD, tmp_path / "legit.json")  # type: ignore[arg-type]
    # Warm-up: the same attack once. The first flood leaves ~10 MB for good (the allocators' arenas and
    # free lists grow once and are reused: RSS after 1, 2, 3, 4 floods of 1,000 blocks was 46.4, 46.5,
    # 46.5, 46.5 MB from 36.2); what is measured is that a flood's memory is given back.
    drain([park(gport, 31 * 1024) for _ in range(1000)], 10)
    base = baseline(daemon.pid)
    watch = Watch(daemon.pid)
    started = time.monotonic()
    parked = [park(gport, 31 * 1024) for _ in range(1000)]  # under the 32 KB a block may take
    over = [park(gport, 40 * 1024) for _ in range(10)]
    attack_s = time.monotonic() - started
    said_over, open_over = drain(over, 5)
    assert open_over == 0 and all(goaway_code(s) == ENHANCE_YOUR_CALM for s in said_over)
    held = fd_count(daemon.pid)
    said, still_open = drain(parked, 3 + 1 + 6)  # the deadline, one sweep, and slack for a loaded machine
    closed_after = time.monotonic() - started
    watch.stop()
    after = settle(daemon.pid, *base)
    result = legit.stop()
    codes = [goaway_code(s) for s in said]
    report(
        "header blocks", base, watch, after, result,
        attack_s=f"{attack_s:.1f}", fds_while_parked=held, all_closed_s=f"{closed_after:.1f}",
    )  # fmt: skip
    assert still_open == 0
    assert codes.count(ENHANCE_YOUR_CALM) == 1000
    check(base, watch, after, result)


# -- 4 WINDOW_UPDATE flooders -------------------------------------------------------------------------
def flood_window_updates(
    port: int, until: float, goaways: list[int], frames_sent: list[int], connections: list[int]
) -> None:
    """Open a stream h2 keeps (a ``cookie`` header makes it no plain call), then WINDOW_UPDATEs on it and
    on the connection until the server says GOAWAY; again on a new connection, until ``until``."""
    block = literal_block(
        [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/katsubushi.Generator/Fetch"),
            (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"), (b"cookie", b"a"),
        ]
    )  # fmt: skip
    batch = b"".join(frame(WINDOW_UPDATE, 0, i % 2, b"\x00\x00\x00\x01") for i in range(1000))
    while time.monotonic() < until:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        connections[0] += 1
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b"") + frame(HEADERS, 0x4, 1, block))
        heard = b""
        try:
            while time.monotonic() < until:
                sock.sendall(batch)
                frames_sent[0] += 1000
                sock.setblocking(False)
                try:
                    piece = sock.recv(65536)
                    if not piece:
                        break
                    heard += piece
                except BlockingIOError:
                    pass
                sock.setblocking(True)
                if goaway_code(heard) is not None:
                    break
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sock.settimeout(1)
            while (piece := sock.recv(65536)) and goaway_code(heard) is None:
                heard += piece
        code = goaway_code(heard)
        if code is not None:
            goaways.append(code)
        sock.close()


def test_window_update_flooders_get_goaway_and_others_are_served(
    daemons: DaemonFactory, users: Path, tmp_path: Path
) -> None:
    gport = free_port()
    daemon = daemons.start("--auth-file", str(users), "--grpc-port", str(gport))
    wait_for_port(gport, daemon.proc)
    legit = Legit(daemon.port, USER, PASSWORD, tmp_path / "legit.json")  # type: ignore[arg-type]
    base = baseline(daemon.pid)
    watch = Watch(daemon.pid)
    goaways: list[int] = []
    sent = [0]
    connections = [0]
    cpu_before = cpu_seconds(daemon.pid)
    started = time.monotonic()
    flooders = [
        threading.Thread(target=flood_window_updates, args=(gport, started + 6, goaways, sent, connections))
        for _ in range(4)
    ]
    for t in flooders:
        t.start()
    for t in flooders:
        t.join()
    cpu_spent = cpu_seconds(daemon.pid) - cpu_before
    cpu = cpu_spent / (time.monotonic() - started)
    watch.stop()
    after = settle(daemon.pid, *base)
    result = legit.stop()
    report(
        "window updates", base, watch, after, result,
        frames=sent[0], connections=connections[0], goaways=len(goaways), daemon_cpu=f"{cpu:.0%}",
    )  # fmt: skip
    # (Most of what the flooders "sent" never reached the daemon: it sat in the kernel's buffers when
    # the daemon closed the connection, its budget spent. Some GOAWAYs are lost to the reset that a
    # close with unread input makes.)
    assert goaways and set(goaways) == {ENHANCE_YOUR_CALM}
    # What the budget bounds is the work one connection can get out of the slow path before its GOAWAY
    # (the flooders then reconnect, which is a connection flood: its CPU grows with how fast this machine
    # lets them reconnect, so the daemon's CPU share is reported, not judged). Before issue 33 a flooder
    # kept its one connection for the whole run: about 1.5 s of the daemon's CPU each.
    assert cpu_spent / connections[0] < 0.1, (cpu_spent, connections[0])
    check(base, watch, after, result)


# -- 12,000 idle TLS connections ----------------------------------------------------------------------
def tls_daemon(daemons: DaemonFactory, certs: Certs, users: Path, *args: str):
    return daemons.start(
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--auth-file", str(users), *args
    )  # fmt: skip


def test_idle_tls_connections_are_counted_and_bounded(
    daemons: DaemonFactory, certs: Certs, users: Path, tmp_path: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 12_500:
        pytest.skip(f"12,000 connections need more descriptors than the hard limit ({hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 12_500), hard))
    daemon = tls_daemon(daemons, certs, users, "--request-timeout", "4s")
    legit = Legit(daemon.port, USER, PASSWORD, tmp_path / "legit.json", certs.ca.cert)  # type: ignore[arg-type]
    base = baseline(daemon.pid)
    watch = Watch(daemon.pid)
    started = time.monotonic()
    idle: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(12_000):
            try:
                idle.append(socket.create_connection(("127.0.0.1", daemon.port), timeout=5))  # type: ignore[arg-type]
            except OSError:
                refused += 1
        attack_s = time.monotonic() - started
        time.sleep(0.5)
        held_fds = fd_count(daemon.pid)
        _, still_open = drain(idle, 4 + 6)
    finally:
        for sock in idle:
            sock.close()
    watch.stop()
    after = settle(daemon.pid, *base)
    result = legit.stop()
    report(
        "idle TLS", base, watch, after, result,
        connects=len(idle), connect_errors=refused, attack_s=f"{attack_s:.1f}", fds_while_held=held_fds,
    )  # fmt: skip
    # At most --max-unauthenticated (half of 4,096) handshakes held at once, and the rest closed at once.
    assert watch.peak_fds <= base[1] + 2048 + 64
    assert still_open == 0
    check(base, watch, after, result)


# -- never-authenticating TLS connections -------------------------------------------------------------
def test_never_authenticating_tls_connections_hold_only_their_share(
    daemons: DaemonFactory, certs: Certs, users: Path, tmp_path: Path
) -> None:
    daemon = tls_daemon(daemons, certs, users, "--max-connections", "1024", "--login-timeout", "8s")
    ctx = ssl.create_default_context(cafile=certs.ca.cert)
    # Authenticated clients first: 100 logged in, and the one that measures.
    logged_in = []
    for _ in range(100):
        sock = ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", daemon.port), timeout=5), server_hostname="localhost"
        )  # type: ignore[arg-type]
        sock.sendall(login_line(USER, PASSWORD))
        assert read_until(sock, b"\r\n") == b"STORED\r\n"
        logged_in.append(sock)
    legit = Legit(daemon.port, USER, PASSWORD, tmp_path / "legit.json", certs.ca.cert)  # type: ignore[arg-type]
    # Warm-up: 300 handshakes closed by the client (the allocators' arenas grow once; see the first test).
    for _ in range(300):
        raw = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)  # type: ignore[arg-type]
        ctx.wrap_socket(raw, server_hostname="localhost").close()
    base = baseline(daemon.pid)
    watch = Watch(daemon.pid)
    started = time.monotonic()
    held: list[ssl.SSLSocket] = []
    failed = 0
    for _ in range(1024):
        try:
            raw = socket.create_connection(("127.0.0.1", daemon.port), timeout=5)  # type: ignore[arg-type]
            held.append(ctx.wrap_socket(raw, server_hostname="localhost"))
        except OSError:
            failed += 1  # refused before the handshake (closed at accept)
    attack_s = time.monotonic() - started
    time.sleep(0.3)
    alive = [_alive(sock) for sock in held]
    still_held = sum(alive)
    refused = failed + len(held) - still_held  # refused at accept, or closed once the handshake was done
    # The authenticated ones were not pushed out: each still gets an ID.
    for sock in logged_in:
        sock.sendall(b"get id\r\n")
        assert read_until(sock, b"END\r\n").startswith(b"VALUE id ")
    _, still_open = drain(held, 8 + 6)  # the login timeout
    for sock in logged_in:
        sock.close()
    watch.stop()
    after = settle(daemon.pid, *base, timeout=12)
    result = legit.stop()
    report(
        "never logging in", base, watch, after, result,
        attempts=1024, held=still_held, refused=refused, attack_s=f"{attack_s:.1f}",
    )  # fmt: skip
    assert still_held <= 512  # --max-unauthenticated: half of --max-connections
    assert refused >= 1024 - 512
    assert still_open == 0
    check(base, watch, (after[0], after[1]), result)


def _alive(sock: ssl.SSLSocket) -> bool:
    """Still held: not closed, and not refused (``SERVER_ERROR too many connections`` then the close)."""
    try:
        sock.settimeout(0.001)
        said = sock.recv(64)
        return said != b"" and not said.startswith(b"SERVER_ERROR")
    except TimeoutError:
        return True
    except (OSError, ssl.SSLError):
        return False


# -- never-authenticating HTTP and gRPC connections (--token-file) -------------------------------------
TOKEN = "hostile-test-token-0123456789"
LOGIN_TIMEOUT = 4.0


def _token_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kp-hostile-tokens-"))
    (directory / "tokens").write_text(TOKEN + "\n")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


tokens = pytest.fixture(_token_dir)


def _http_request(path: str, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{auth}\r\n".encode()


def _unauthenticated_opening(kind: str, i: int) -> bytes:
    """What attacker ``i`` sends once its handshake is done: a third nothing at all; a third requests
    with no token or a wrong one; a third what needs no token (HTTP's /healthz) or only the HTTP/2
    preface and SETTINGS (gRPC)."""
    if i % 3 == 0:
        return b""
    if kind == "http":
        if i % 3 == 1:
            return _http_request("/id") + _http_request("/ids?n=5", "wrong-token-0123456789")
        return _http_request("/healthz")
    opening = PREFACE + frame(SETTINGS, 0, 0, b"")
    if i % 3 == 1:  # a Fetch with a wrong token: refused UNAUTHENTICATED, the stream ends there
        block = literal_block(
            [
                (b":method", b"POST"), (b":scheme", b"https"), (b":path", b"/katsubushi.Generator/Fetch"),
                (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
                (b"authorization", b"Bearer wrong-token-0123456789"),
            ]
        )  # fmt: skip
        opening += frame(HEADERS, 0x4 | 0x1, 1, block)
    return opening


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_never_authenticating_http_and_grpc_connections_hold_only_their_share(
    daemons: DaemonFactory, certs: Certs, tokens: Path, tmp_path: Path, kind: str
) -> None:
    http_port, grpc_port = free_port(), free_port()
    daemon = daemons.start(
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--token-file", str(tokens / "tokens"),
        "--http-port", str(http_port), "--grpc-port", str(grpc_port),
        "--max-connections", "256", "--login-timeout", f"{LOGIN_TIMEOUT:g}s",
    )  # fmt: skip
    port = http_port if kind == "http" else grpc_port
    wait_for_port(port, daemon.proc)
    ctx = ssl.create_default_context(cafile=certs.ca.cert)
    ctx.set_alpn_protocols(["http/1.1"] if kind == "http" else ["h2"])

    def handshake() -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", port), timeout=5)
        return ctx.wrap_socket(raw, server_hostname="localhost")

    # Authenticated first: 20 HTTP connections that each got an ID (gRPC: the legitimate client's
    # channel), and the client that measures; none of them is closed by the login deadline.
    authenticated: list[ssl.SSLSocket] = []
    if kind == "http":
        for _ in range(20):
            sock = handshake()
            sock.sendall(_http_request("/id", TOKEN))
            assert read_response(sock)[0].startswith(b"HTTP/1.1 200")
            authenticated.append(sock)
    legit = Legit(port, "", TOKEN, tmp_path / "legit.json", certs.ca.cert, kind)  # type: ignore[arg-type]
    for _ in range(100):  # warm-up (the allocators' arenas grow once; see the first test)
        handshake().close()
    base = baseline(daemon.pid)
    watch = Watch(daemon.pid)
    started = time.monotonic()
    held: list[ssl.SSLSocket] = []
    failed = 0
    for i in range(256):
        try:
            sock = handshake()
            opening = _unauthenticated_opening(kind, i)
            if opening:
                sock.sendall(opening)
            held.append(sock)
        except OSError:
            failed += 1  # refused before the handshake (closed at accept)
    attack_s = time.monotonic() - started
    time.sleep(0.3)
    still_held = sum(_alive(sock) for sock in held)
    refused = failed + len(held) - still_held
    if kind == "http":  # the authenticated connections outlive the login deadline and keep working
        time.sleep(max(0.0, started + LOGIN_TIMEOUT + 1 - time.monotonic()))
        for sock in authenticated:
            sock.sendall(_http_request("/id", TOKEN))
            assert read_response(sock)[0].startswith(b"HTTP/1.1 200")
    said, still_open = drain(held, LOGIN_TIMEOUT + 4)
    closed_s = time.monotonic() - started
    for sock in authenticated:
        sock.close()
    watch.stop()
    after = settle(daemon.pid, *base)
    result = legit.stop()
    told = [data for data in said if data]
    if kind == "http":
        timeouts = sum(b"HTTP/1.1 408 Request Timeout" in data for data in told)
    else:
        # (_alive read the start of what each said: the GOAWAY is found by its debug data)
        timeouts = sum(b"\x00\x00\x00\x0bdid not send a call with a valid bearer token" in data for data in told)
    with contextlib.closing(connect(daemon.port, certs.ca.cert)) as memcached:  # type: ignore[arg-type]
        memcached.sendall(b"stats\r\n")
        stats = dict(line.split(" ")[1:3] for line in read_until(memcached, b"END\r\n").decode().splitlines()[:-1])
    report(
        f"never authenticating ({kind})", base, watch, after, result,
        attempts=256, held=still_held, refused=refused, timeouts_told=timeouts, attack_s=f"{attack_s:.1f}",
        closed_s=f"{closed_s:.1f}", login_timeouts=stats["login_timeouts"],
    )  # fmt: skip
    assert still_held <= 128  # --max-unauthenticated: half of --max-connections
    assert refused >= 256 - 128
    assert still_open == 0
    assert closed_s >= LOGIN_TIMEOUT - 0.5  # closed by the login deadline, not before it
    assert timeouts >= still_held * 2 // 3 - 5  # told why (all but the gRPC ones that sent no preface)
    assert int(stats["login_timeouts"]) >= still_held
    check(base, watch, after, result)

"""Hostile clients, the smaller holes of issue 33, each against the real daemon process: a count of any
length in ``/ids?n=``, duplicate gRPC ``authorization`` metadata, the unix socket's mode from its first
instant, a non-ASCII SNI, descriptor exhaustion and the state file, and one large request's fairness."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import resource
import shutil
import signal
import socket
import ssl
import stat
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    Daemon,
    DaemonFactory,
    decode,
    free_port,
    parse_values,
    recv_all,
    recv_until,
    wait_for_port,
)
from lease_helpers import wait_until
from test_auth import TOKEN
from test_auth import secrets_dir as secrets_dir  # the fixture: credential files
from test_http import fetch, start_http
from test_http_protocol import parse_replies
from tls_certs import make_certs

from katsubushi_py.ratelimit import RateLimitedLog

BOTH_PATHS = pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])


def _env(pure: bool) -> dict[str, str]:
    return {"KATSUBUSHI_NO_EXTENSIONS": "1" if pure else "0"}


@BOTH_PATHS
def test_ids_count_of_any_length_is_a_400_without_a_traceback(daemons: DaemonFactory, pure: bool) -> None:
    d, port = start_http(daemons, env=_env(pure))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    for n in ("9" * 5000, "-" + "9" * 5000, "0" * 5000 + "7", "1" * 100_000):
        if len(n) > 8 * 1024:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            status, _, body = fetch(conn, f"/ids?n={n}")
            assert status == 414  # over the request-target bound, refused before any count is read
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            continue
        status, _, body = fetch(conn, f"/ids?n={n}")
        if n.startswith("0"):
            assert status == 200 and len(body.split(b"\n")) == 7
            continue
        assert status == 400, (status, body[:200])
        error = json.loads(body)["error"]
        assert "from 1 to 1000" in error and len(error) < 200
    # A Content-Length of thousands of digits is refused as too large, not a crash.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, _, body = fetch(conn, "/id", **{"Content-Length": "9" * 5000})
    assert status in (400, 413), (status, body)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, _, body = fetch(conn, "/id")
    assert status == 200 and body.isdigit()
    log = d.stderr()
    assert "Traceback" not in log and "Exceeds the limit" not in log, log


@BOTH_PATHS
def test_duplicate_authorization_metadata_is_refused_on_both_paths(
    daemons: DaemonFactory,
    secrets_dir: Path,
    pure: bool,
) -> None:
    """Two ``authorization`` values, the good token first or last: UNAUTHENTICATED whichever path
    (the compiled fast path judged the first value, the pure slow path the last), every time."""
    grpc = pytest.importorskip("grpc")
    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    port = free_port()
    d = daemons.start("--grpc-port", str(port), "--token-file", str(secrets_dir / "tokens"), env=_env(pure))
    wait_for_port(port, d.proc)
    good, bad = ("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer " + "y" * 20)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        generator = pb_grpc.GeneratorStub(channel)
        assert decode(generator.Fetch(pb.FetchRequest(), timeout=5, metadata=[good]).id)[1] == 7
        for metadata in ([good, bad], [bad, good], [good, good]) * 3:  # repeated: a remembered block too
            for method, request in (
                (generator.Fetch, pb.FetchRequest()),
                (generator.FetchMulti, pb.FetchMultiRequest(n=3)),
            ):
                with pytest.raises(grpc.RpcError) as refused:
                    method(request, timeout=5, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization metadata values" in refused.value.details()
        assert decode(generator.Fetch(pb.FetchRequest(), timeout=5, metadata=[good]).id)[1] == 7
    assert "Traceback" not in d.stderr()


# -- the unix socket's mode --------------------------------------------------------------------------
NOBODY = 65534
#: A python nobody can run (the venv's may live under /root): the prober needs only the socket module.
SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
#: Run as nobody: connect to the socket as fast as it can until told to stop; each connection that gets
#: through asks for an ID. Prints the replies it got (none, if the mode held).
PROBER = r"""
import os, socket, sys
path, stop = sys.argv[1], sys.argv[2]
got = []
while not os.path.exists(stop):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except OSError:
        s.close()
        continue
    s.settimeout(2)
    try:
        s.sendall(b"get id\r\n")
        got.append(s.recv(100))
    except OSError as exc:
        got.append(repr(exc).encode())
    s.close()
print(len(got), got[:3])
"""


def _watch_modes(path: Path, modes: set[int], stop: threading.Event) -> None:
    """Every mode the socket file has while the daemon starts (polled as fast as Python can)."""
    while not stop.is_set():
        with contextlib.suppress(FileNotFoundError):
            modes.add(stat.S_IMODE(os.lstat(path).st_mode))


@pytest.mark.once
@pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None, reason="needs root and a python nobody can run")
@pytest.mark.parametrize(("pure", "workers"), [(False, 1), (True, 1), (False, 2)], ids=["compiled", "pure", "workers"])
def test_unix_socket_never_reachable_with_a_wider_mode(
    daemons: DaemonFactory, short_tmp: Path, pure: bool, workers: int
) -> None:
    """umask 000 and --sock-mode 0600: from the socket file's first instant its mode is 0600, and a
    client running as another user (nobody), connecting in a loop while the daemon starts, never gets
    through (before, the socket listened with mode 0777 until the chmod: 8 of 8 starts leaked an ID)."""
    short_tmp.chmod(0o755)
    path = short_tmp / "k.sock"
    stop_file = short_tmp / "stop"
    for attempt in range(4):
        prober = subprocess.Popen(
            [SYSTEM_PYTHON, "-I", "-S", "-c", PROBER, str(path), str(stop_file)],
            stdout=subprocess.PIPE,
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
        )
        modes: set[int] = set()
        stop = threading.Event()
        watcher = threading.Thread(target=_watch_modes, args=(path, modes, stop), daemon=True)
        watcher.start()
        old = os.umask(0)
        try:
            args = ["--sock-mode", "0600"] + (["--workers", str(workers)] if workers > 1 else [])
            d = daemons.start(*args, port=None, sock=str(path), env=_env(pure))
        finally:
            os.umask(old)
        with d.connect() as own:  # root, the owner, is served
            own.sendall(b"get id\r\n")
            assert recv_until(own, b"END\r\n").startswith(b"VALUE id 0 ")
        time.sleep(0.2)
        stop_file.touch()
        out, _ = prober.communicate(timeout=10)
        stop.set()
        watcher.join()
        assert out.startswith(b"0 "), f"start {attempt}: nobody connected: {out!r}"
        assert modes == {0o600}, f"start {attempt}: modes seen {sorted(oct(m) for m in modes)}"
        assert d.stop() == 0
        stop_file.unlink()


# -- a non-ASCII TLS server name ---------------------------------------------------------------------
def _handshake_with_server_name(port: int, name: bytes) -> subprocess.CompletedProcess[bytes]:
    """``openssl s_client`` sends the server name's bytes as given (Python's ssl insists on ASCII)."""
    return subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-servername", os.fsdecode(name)],
        input=b"Q\n",
        capture_output=True,
        timeout=10,
    )


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
@BOTH_PATHS
def test_a_non_ascii_server_name_is_one_json_log_line_not_a_traceback(
    daemons: DaemonFactory, tmp_path: Path, pure: bool
) -> None:
    """CPython decodes the SNI as ASCII before our callback (the certificate reload's) is called and
    prints a traceback on stderr for each such handshake: with --log-format json the log stays one JSON
    object a line, the refusal logged once (rate-limited), and other clients are served, also after a
    reload."""
    certs = make_certs(tmp_path / "certs")
    http_port = free_port()
    d = daemons.start(
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key, "--http-port", str(http_port),
        "--log-format", "json", env=_env(pure),
    )  # fmt: skip
    wait_for_port(http_port, d.proc)
    assert d.port is not None
    for port in (d.port, http_port, d.port):
        refused = _handshake_with_server_name(port, "éx.example".encode())
        assert b"alert" in refused.stderr, refused.stderr  # the handshake fails; the daemon stays
    os.kill(d.pid, signal.SIGHUP)  # a reload: the callback now switches contexts
    d.wait_for_log("reload")
    refused = _handshake_with_server_name(d.port, b"\xff\xfe.example")
    ctx = ssl.create_default_context(cafile=certs.ca.cert)
    with ctx.wrap_socket(
        socket.create_connection(("127.0.0.1", d.port), timeout=5), server_hostname="localhost"
    ) as tls:
        tls.sendall(b"get id\r\n")
        assert recv_until(tls, b"END\r\n").startswith(b"VALUE id 0 ")
    assert d.stop() == 0
    lines = d.stderr().splitlines()
    records = [json.loads(line) for line in lines]  # every line one JSON object
    said = [r for r in records if "server name (SNI) is not ASCII" in r["msg"]]
    assert len(said) == 1 and said[0]["level"] == "warning", lines
    assert "Traceback" not in d.stderr()


def test_refusals_are_logged_at_most_once_per_period_with_the_count_left_unsaid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    limited = RateLimitedLog(every=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="katsubushi_py")
    assert limited("accept", logging.ERROR, "accept failed: %s", "EMFILE")
    for _ in range(5):
        now[0] += 1
        assert not limited("accept", logging.ERROR, "accept failed: %s", "EMFILE")
    assert limited("state", logging.ERROR, "state file: %s", "EMFILE")  # another kind: its own period
    now[0] += 5
    assert limited("accept", logging.ERROR, "accept failed: %s", "EMFILE")
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "accept failed: EMFILE",
        "state file: EMFILE",
        "accept failed: EMFILE (5 more like it not logged in the last 10 s)",
    ]
    assert limited.counts == {"accept": 7, "state": 1}


# -- descriptor exhaustion ---------------------------------------------------------------------------
def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _state_mark(d: Daemon) -> int:
    state = Path(d.stderr().split("state file ", 1)[1].split(" ", 1)[0])
    return json.loads(state.read_text())["high_water_ms"]


@BOTH_PATHS
def test_descriptor_exhaustion_never_stops_the_state_file_or_authenticated_clients(
    daemons: DaemonFactory,
    secrets_dir: Path,
    pure: bool,
) -> None:
    """Idle connections fill the daemon's descriptor table (RLIMIT_NOFILE lowered on the running
    daemon): clients that logged in before keep getting IDs for longer than two reservation windows
    (2 s each), so the state file is rewritten while no descriptor is free; every ID stays at or below
    the stored mark and is unique; the refusals are logged, rate-limited; once the idle connections go,
    new clients are served again."""
    http_port = free_port()
    d = daemons.start(
        "--http-port", str(http_port), "--auth-file", str(secrets_dir / "users"),
        "--token-file", str(secrets_dir / "tokens"), env=_env(pure),
    )  # fmt: skip
    wait_for_port(http_port, d.proc)
    assert d.port is not None
    mc = d.connect()
    mc.sendall(b"set auth 0 0 13\r\nalice secret1\r\n")
    assert recv_until(mc, b"\r\n") == b"STORED\r\n"
    web = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert fetch(web, "/id", **bearer)[0] == 200
    mark_before = _state_mark(d)

    limit = _open_descriptors(d.pid) + 16
    resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, limit))
    idle: list[socket.socket] = []
    try:
        for port in [d.port, http_port] * 40:  # more than the table holds: the rest wait in the backlog
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_until(lambda: _open_descriptors(d.pid) >= limit - 2, 5)  # (the reserve holds two)
        issued: list[int] = []
        deadline = time.monotonic() + 4.5
        while time.monotonic() < deadline:
            mc.sendall(b"get a b c\r\n")
            reply = recv_until(mc, b"END\r\n")
            assert reply.startswith(b"VALUE"), reply
            issued += [value for _, value in parse_values(reply)]
            status, _, body = fetch(web, "/ids?n=5", **bearer)
            assert status == 200, body
            issued += [int(x) for x in body.split(b"\n")]
            time.sleep(0.02)
        assert _open_descriptors(d.pid) >= limit - 2  # still exhausted all along
        mark = _state_mark(d)
        assert mark > mark_before + 2000  # rewritten at least once while exhausted
        assert len(issued) == len(set(issued)) > 300
        assert max(decode(i)[0] for i in issued) <= mark
    finally:
        for s in idle:
            s.close()
    log = d.stderr()
    assert "state file is written with a reserved one" in log
    # The listener's refusals (our accept loop's line, or the watch's for uvloop's listeners, which
    # drop them silently): one line in 10 s, rate-limited.
    refused = [line for line in log.splitlines() if "cannot accept connections now" in line or "are refused" in line]
    assert len(refused) == 1, log
    assert "cannot write state file" not in log and "Traceback" not in log, log
    wait_until(lambda: _open_descriptors(d.pid) < limit - 8, 10)
    fresh = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
    assert fetch(fresh, "/id", **bearer)[0] == 200
    mc.close()


# -- fairness ----------------------------------------------------------------------------------------
def _binary_ids(data: bytes) -> list[int]:
    """The values of the binary responses in ``data`` (each an ID in decimal), the final noop's none."""
    ids, at = [], 0
    while at + 24 <= len(data):
        key_length, extras_length = struct.unpack_from(">H", data, at + 2)[0], data[at + 4]
        body = struct.unpack_from(">I", data, at + 8)[0]
        value = data[at + 24 + extras_length + key_length : at + 24 + body]
        if value:
            ids.append(int(value))
        at += 24 + body
    assert at == len(data)
    return ids


def _large_request(kind: str, keys: int) -> tuple[bytes, bytes]:
    """A request for ``keys`` IDs at once, and what ends its reply."""
    if kind == "text get":
        return b"get" + b" k" * keys + b"\r\n", b"END\r\n"
    if kind == "http pipelined":  # /ids?n=1000 keys // 1000 times in one write (the end: the last ID)
        return b"GET /ids?n=1000 HTTP/1.1\r\nHost: k\r\n\r\n" * (keys // 1000), b""
    noop = struct.pack(">BBHBBHIIQ", 0x80, 0x0A, 0, 0, 0, 0, 0, 0, 0)
    getkq = struct.pack(">BBHBBHIIQ", 0x80, 0x0D, 1, 0, 0, 0, 1, 0, 0) + b"k"
    return getkq * keys + noop, b"\x81\x0a" + bytes(22)  # the noop's response: the last one


def _race(d: Daemon, kind: str, keys: int, http_port: int) -> tuple[list[int], list[int]]:
    """A's IDs, asked one at a time while B's one large request is answered, and B's IDs."""
    request, end = _large_request(kind, keys)
    big = d.connect(timeout=10) if http_port == 0 else socket.create_connection(("127.0.0.1", http_port), timeout=10)
    big.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    small = d.connect()
    small.sendall(b"get a\r\n")
    recv_until(small, b"END\r\n")  # connected and served before B starts
    served: list[int] = []
    done = threading.Event()

    def one_at_a_time() -> None:
        while not done.is_set():
            small.sendall(b"get a\r\n")
            served.extend(value for _, value in parse_values(recv_until(small, b"END\r\n")))

    asker = threading.Thread(target=one_at_a_time)
    asker.start()
    big.sendall(request)
    time.sleep(0.3)  # B reads nothing meanwhile: its reply waits in the socket buffers
    done.set()
    asker.join()
    if kind == "http pipelined":
        theirs = [int(i) for r in parse_replies(recv_all(big, 1.0)) for i in r.body.split(b"\n")]
    elif kind == "text get":
        theirs = [value for _, value in parse_values(recv_until(big, end))]
    else:
        theirs = _binary_ids(recv_until(big, end))
    big.close()
    small.close()
    return served, theirs


@BOTH_PATHS
@pytest.mark.parametrize("kind", ["text get", "binary multi-get", "http pipelined"])
def test_a_concurrent_client_is_served_between_the_slices_of_a_large_request(
    daemons: DaemonFactory, pure: bool, kind: str
) -> None:
    """A asks for one ID at a time, back to back, while B's one request asks for 40,000 (at least ten
    milliseconds of the generator's 4,096 IDs a millisecond, and a reply that fits in the socket
    buffers, so writing never pauses and nothing but the slicing lets anyone else in). The IDs say
    the order in which the requests were served: some of A's fall strictly inside B's range, so A was
    answered between two slices of B's. Before the slicing, B's request was answered in one go and
    every one of A's IDs was below or above all of B's."""
    http_port = free_port() if kind == "http pipelined" else 0
    d = daemons.start(*(["--http-port", str(http_port)] if http_port else []), env=_env(pure))
    if http_port:
        wait_for_port(http_port, d.proc)
    inside: list[int] = []
    for _ in range(5):  # A's first request may race ahead of B's: then try again
        served, theirs = _race(d, kind, 40_000, http_port)
        assert len(theirs) == 40_000 and len(set(theirs) | set(served)) == len(theirs) + len(served)
        inside = [i for i in served if min(theirs) < i < max(theirs)]
        if inside:
            break
    assert len(inside) >= 2, f"{kind}: none of A's {len(served)} requests was served between B's slices"

"""The daemon as a real process on real sockets."""

import itertools
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory, daemon_env, decode, free_port, parse_values, recv_all, recv_until

from katsubushi_py import __version__


def get(sock: socket.socket, *keys: bytes) -> list[int]:
    sock.sendall(b"GET " + b" ".join(keys) + b"\r\n")
    pairs = parse_values(recv_until(sock, b"END\r\n"))
    assert [k for k, _ in pairs] == list(keys)
    return [i for _, i in pairs]


def stats(sock: socket.socket) -> dict[str, str]:
    sock.sendall(b"STATS\r\n")
    lines = recv_until(sock, b"END\r\n").decode().split("\r\n")[:-2]
    return {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines}


def test_get_over_tcp_carries_worker_id_and_current_time(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=123)
    with d.connect() as s:
        ids = get(s, b"a") + get(s, b"a", b"b", b"c")
        now_ms = time.time() * 1000
    assert ids == sorted(ids) and len(set(ids)) == 4
    for id_ in ids:
        unix_ms, worker, _ = decode(id_)
        assert worker == 123
        assert abs(unix_ms - now_ms) < 1000


def test_transcript_shapes(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.connect() as s:
        s.sendall(b"GET a\r\nGETS b\r\nversion\r\n\r\n   \r\nFOO\r\nGET\r\nget x y\n")
        reply = recv_all(s)
    assert reply.count(b"ERROR\r\n") == 4
    assert b"VERSION %s\r\n" % __version__.encode() in reply
    assert reply.endswith(b"END\r\n")
    assert b"SERVER_ERROR" not in reply


def test_sixteen_connections_for_two_seconds_never_share_an_id(daemon) -> None:  # type: ignore[no-untyped-def]
    per_conn: list[list[int]] = [[] for _ in range(16)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 2.0

    stale: list[tuple[int, float]] = []

    def client(out: list[int], n: int) -> None:
        try:
            with daemon.connect() as s:
                while time.monotonic() < deadline:
                    keys = [b"k%d" % i for i in range(1 + n % 4)]
                    got = get(s, *keys)
                    now_ms = time.time() * 1000
                    # Every ID carries a time within 1 s of when it arrived.
                    stale.extend((i, now_ms) for i in got if abs(decode(i)[0] - now_ms) >= 1000)
                    out.extend(got)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(per_conn[n], n)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    every = [i for ids in per_conn for i in ids]
    assert len(every) > 1000
    assert len(every) == len(set(every))
    for ids in per_conn:
        assert all(a < b for a, b in itertools.pairwise(ids))
    assert not stale
    assert {decode(i)[1] for i in every} == {7}


def test_stats_counts(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.connect() as s, daemon.connect():
        get(s, b"a", b"b")
        s.sendall(b"GET\r\n")
        assert recv_until(s, b"\r\n") == b"ERROR\r\n"
        fields = stats(s)
    assert int(fields["pid"]) == daemon.pid
    assert fields["cmd_get"] == "2" and fields["get_hits"] == "2" and fields["get_misses"] == "0"
    assert fields["curr_connections"] == "2" and int(fields["total_connections"]) >= 2
    assert fields["worker_id"] == "7"


def test_unix_socket_only_and_removed_on_stop(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    d = daemons.start(port=None, sock=path, worker_id=2)
    with d.connect() as s:
        assert decode(get(s, b"a")[0])[1] == 2
    assert "11212" not in d.wait_for_log("serving worker id")
    assert d.stop() == 0
    assert not os.path.exists(path)


def test_unix_socket_and_explicit_port_listen_on_both(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    d = daemons.start(sock=path, worker_id=3)
    with d.connect() as tcp:
        a = get(tcp, b"a")[0]
    with socket.socket(socket.AF_UNIX) as unix:
        unix.connect(path)
        b = get(unix, b"b")[0]
    assert b > a


def test_sock_mode(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    daemons.start("--sock-mode", "0660", port=None, sock=path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660


def test_stale_socket_file_is_replaced(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    first = daemons.start(port=None, sock=path)
    first.stop(signal.SIGKILL)
    assert os.path.exists(path)  # a killed daemon leaves its socket file
    second = daemons.start(port=None, sock=path)
    with second.connect() as s:
        assert get(s, b"a")


def test_live_daemon_on_the_socket_is_not_replaced(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    first = daemons.start(port=None, sock=path)
    second = daemons.start(port=None, sock=path, wait=False)
    assert second.proc.wait(10) == 1
    assert "another daemon is listening on" in second.stderr()
    with first.connect() as s:
        assert get(s, b"a")


def test_idle_timeout_closes_quiet_connections_only(daemons: DaemonFactory) -> None:
    d = daemons.start("--idle-timeout", "1s")
    with d.connect() as idle, d.connect() as partial, d.connect() as busy:
        partial.sendall(b"GET a")  # an incomplete command is not activity
        for _ in range(12):
            get(busy, b"a")
            time.sleep(0.2)
        idle.settimeout(1)
        assert idle.recv(10) == b""
        partial.settimeout(1)
        assert partial.recv(10) == b""
        assert get(busy, b"still-open")


def test_idle_timeout_zero_means_never(daemons: DaemonFactory) -> None:
    d = daemons.start("-idle-timeout", "0")
    with d.connect() as s:
        time.sleep(1.5)
        assert get(s, b"a")


def test_max_connections(daemons: DaemonFactory) -> None:
    d = daemons.start("--max-connections", "2")
    with d.connect() as a, d.connect() as b:
        get(a, b"x")
        get(b, b"x")
        with d.connect() as c:
            c.settimeout(2)
            assert recv_all(c, 1.0) == b"SERVER_ERROR too many connections\r\n"
        assert get(a, b"y") and get(b, b"y")
        fields = stats(a)
        assert fields["rejected_connections"] == "1" and fields["curr_connections"] == "2"
    time.sleep(0.3)
    with d.connect() as again:
        assert get(again, b"z")


def test_overlong_line(daemon) -> None:  # type: ignore[no-untyped-def]
    with daemon.connect() as s:  # (a get line has no length limit: only its keys have, 250 bytes)
        s.sendall(b"FOO " + b"k" * 70_000 + b"\r\n")
        assert recv_all(s, 1.0) == b"CLIENT_ERROR line too long\r\n"
        s.settimeout(2)
        with pytest.raises((ConnectionResetError, BrokenPipeError, OSError)):
            # The server closed: further sends fail or reads see EOF.
            s.sendall(b"GET a\r\n")
            if s.recv(10) == b"":
                raise ConnectionResetError
    with daemon.connect() as s:
        assert get(s, b"a")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_client_that_never_reads_is_not_buffered_without_bound(daemon) -> None:  # type: ignore[no-untyped-def]
    request = b"GET " + b" ".join(b"k%03d" % i for i in range(200)) + b"\r\n"  # ~1 KB in, ~6 KB out
    rss_before = rss_kb(daemon.pid)
    sent = 0
    s = daemon.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(3.0)
    try:
        for _ in range(200_000):  # would be 200 MB of requests and 1.2 GB of replies
            s.sendall(request)
            sent += len(request)
    except TimeoutError:
        pass  # the server stopped reading from us: that is the point
    assert sent < 50_000_000
    # Another client is still served, and the server did not balloon.
    with daemon.connect() as other:
        assert get(other, b"a")
    assert rss_kb(daemon.pid) - rss_before < 50_000
    s.close()


def test_sigterm_answers_what_was_received_then_exits_zero(daemon) -> None:  # type: ignore[no-untyped-def]
    idle = daemon.connect()
    s = daemon.connect()
    keys = b" ".join(b"k%d" % i for i in range(2000))
    s.sendall(b"GET " + keys + b"\r\n")
    time.sleep(0.2)
    started = time.monotonic()
    os.kill(daemon.pid, signal.SIGTERM)
    reply = recv_all(s, 2.0)
    assert len(parse_values(reply)) == 2000
    assert daemon.proc.wait(5) == 0
    assert time.monotonic() - started < 1.5
    idle.settimeout(2)
    assert idle.recv(10) == b""
    with pytest.raises(OSError):
        daemon.connect(timeout=1)


def test_sigint_exits_zero(daemon) -> None:  # type: ignore[no-untyped-def]
    assert daemon.stop(signal.SIGINT) == 0
    assert "Traceback" not in daemon.stderr()


def test_katsubushi_single_dash_flags(daemons: DaemonFactory, short_tmp: Path) -> None:
    port = free_port()
    path = str(short_tmp / "k.sock")
    d = daemons.start(
        "-worker-id",
        "11",
        "-port",
        str(port),
        "-sock",
        path,
        "-idle-timeout",
        "10m",
        "-log-level",
        "warn",
        worker_id=None,
        port=port,
    )
    with d.connect() as s:
        assert decode(get(s, b"a")[0])[1] == 11
    with socket.socket(socket.AF_UNIX) as u:
        u.connect(path)
        assert decode(get(u, b"a")[0])[1] == 11


def test_katsubushi_environment_variables(daemons: DaemonFactory, short_tmp: Path) -> None:
    port = free_port()
    d = daemons.start(
        worker_id=None,
        port=None,
        wait=False,
        env={"WORKER_ID": "12", "PORT": str(port), "IDLE_TIMEOUT": "1s", "LOG_LEVEL": "warning"},
    )
    d.port = port
    from conftest import wait_for_port

    wait_for_port(port, d.proc)
    with d.connect() as s:
        assert decode(get(s, b"a")[0])[1] == 12
        assert stats(s)["idle_timeout"] == "1"


def test_flags_win_over_environment(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=13, env={"WORKER_ID": "99", "worker_id": "98"})
    with d.connect() as s:
        assert decode(get(s, b"a")[0])[1] == 13


def test_lower_case_environment_variable(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=None, env={"worker_id": "14"})
    with d.connect() as s:
        assert decode(get(s, b"a")[0])[1] == 14


def test_both_event_loops(daemons: DaemonFactory) -> None:
    for loop in ("asyncio", "uvloop"):
        d = daemons.start("--loop", loop)
        with d.connect() as s:
            assert len(get(s, b"a", b"b")) == 2
        d.wait_for_log(f"(loop {loop})")
        assert d.stop() == 0


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "katsubushi_py", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=daemon_env(None, env),
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "set --worker-id"),
        (("--worker-id", "1024"), "does not fit in 10 bits"),
        (("--worker-id", "-1"), "invalid worker id"),
        (("--worker-id", "abc"), "not an integer"),
        (("--worker-id", "1", "--idle-timeout", "ten"), "invalid idle timeout"),
        (("--worker-id", "1", "--port", "70000"), "invalid port"),
        (("--worker-id", "1", "--log-level", "loud"), "invalid log level"),
        (("--worker-id", "1", "--sock-mode", "0660"), "needs --sock"),
        (("--worker-id", "1", "--nonsense"), "unrecognized arguments"),
        (("--worker-id", "1", "--time-bits", "50"), "at most 63 fit"),
        (("--worker-id", "1", "--state-file", "/nonexistent-dir/state"), "directory /nonexistent-dir does not exist"),
    ],
)
def test_bad_configuration_is_one_line_and_nonzero(args: tuple[str, ...], message: str) -> None:
    result = run_cli(*args, "--port", str(free_port())) if "--port" not in args else run_cli(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert message in lines[0] and lines[0].startswith("katsubushi-py: error: ")


def test_port_in_use(daemon) -> None:  # type: ignore[no-untyped-def]
    result = run_cli("--worker-id", "1", "--port", str(daemon.port))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].endswith("address already in use")
    assert "Traceback" not in result.stderr


def test_state_file_survives_a_kill(daemons: DaemonFactory, tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    first = daemons.start("--state-file", state)
    with first.connect() as s:
        before = get(s, *[b"k"] * 50)
        mark = int(stats(s)["state_file_high_water_ms"])
    assert all(decode(i)[0] <= mark for i in before)
    first.stop(signal.SIGKILL)
    second = daemons.start("--state-file", state)
    with second.connect() as s:
        after = get(s, b"a")
    assert after[0] > max(before)
    assert decode(after[0])[0] > mark
    assert second.stop() == 0
    third = daemons.start("--state-file", state)
    started = time.monotonic()
    with third.connect() as s:
        assert get(s, b"a")[0] > after[0]
    assert time.monotonic() - started < 1.0


def run_with_nofile_limit(soft: int, hard: int) -> tuple[str, bytes, int]:
    """Start the daemon under an open-files limit with --max-connections 2000; return its soft limit
    once listening, its stderr and its exit status after SIGTERM."""
    import resource

    from conftest import wait_for_port

    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    cmd = [sys.executable, "-m", "katsubushi_py", "--worker-id", "1", "--port", str(port), "--max-connections", "2000"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, preexec_fn=limit, env=daemon_env())
    try:
        wait_for_port(port, proc)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        soft_now = next(row for row in limits.splitlines() if row.startswith("Max open files")).split()[3]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=5)
    return soft_now, err, proc.returncode


def test_open_files_limit_is_raised_for_the_connection_limit() -> None:
    soft, err, status = run_with_nofile_limit(64, 4096)
    assert soft == str(2000 + 32)  # raised to fit, within the hard limit
    assert b"open-files limit" not in err and status == 0


def test_too_low_hard_open_files_limit_is_a_warning() -> None:
    soft, err, status = run_with_nofile_limit(64, 128)
    assert soft == "128"
    assert b"open-files limit is 128 (hard limit 128)" in err and status == 0


def test_json_log_format(daemons: DaemonFactory) -> None:
    d = daemons.start("--log-format", "json")
    assert d.stop() == 0
    records = [json.loads(line) for line in d.stderr().splitlines()]
    assert records[0]["level"] == "info" and "serving worker id 7 from --worker-id" in records[0]["msg"]
    assert records[-1]["msg"] == "stopped"
    assert all(r["time"].endswith("Z") for r in records)


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_ipv6_host(daemons: DaemonFactory) -> None:
    port = free_port()
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", port))
    except OSError:
        pytest.skip("::1 is not available here")
    d = daemons.start("--host", "::1", port=port, wait=False)
    deadline = time.monotonic() + 10
    while True:
        try:
            s = socket.create_connection(("::1", port), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline and d.proc.poll() is None, d.stderr()
            time.sleep(0.05)
    with s:
        assert decode(get(s, b"a")[0])[1] == 7
    d.wait_for_log(f"[::1]:{port}")

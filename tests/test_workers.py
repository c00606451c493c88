"""``--workers N``: N real daemon processes behind one set of listeners, a worker id each, supervised."""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, Daemon, DaemonFactory, decode, free_port, recv_until
from id_recorder import Recorder


def children(pid: int) -> list[int]:
    """The supervisor's worker processes."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_for(predicate, timeout: float = 15.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def stats(d: Daemon) -> dict[str, str]:
    with d.connect() as s:
        s.sendall(b"stats\r\n")
        lines = recv_until(s, b"END\r\n").decode().split("\r\n")
    return {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines if line.startswith("STAT ")}


def worker_ids_seen(d: Daemon, connections: int = 40) -> set[int]:
    """Worker ids behind fresh connections (SO_REUSEPORT spreads new connections over the processes);
    a process that cannot issue yet (waiting for its lease) answers SERVER_ERROR and counts for none."""
    seen = set()
    for _ in range(connections):
        with d.connect() as s:
            s.sendall(b"get k\r\n")
            reply = recv_until(s, b"\r\n")
            if reply.startswith(b"VALUE"):
                while not reply.endswith(b"END\r\n"):
                    reply += recv_until(s, b"\r\n")
                seen.add(decode(int(reply.split(b"\r\n")[1]))[1])
    return seen


def test_two_processes_share_tcp_unix_and_http_with_a_worker_id_each(daemons: DaemonFactory, short_tmp: Path) -> None:
    sock = str(short_tmp / "k.sock")
    http_port = free_port()
    d = daemons.start("--workers", "2", "--http-port", str(http_port), worker_id=40, sock=sock)
    assert len(wait_for(lambda: len(children(d.pid)) == 2 and children(d.pid))) == 2
    assert worker_ids_seen(d) == {40, 41}
    unix = Daemon(d.proc, None, sock, 40, d.stderr_path)
    # Both processes accept from the one unix socket. Which one a new connection wakes is the kernel's
    # choice (no SO_REUSEPORT spreading here): one may win a run of them, so look until both answered.
    on_unix: set[int] = set()
    deadline = time.monotonic() + 30
    while on_unix != {40, 41} and time.monotonic() < deadline:
        on_unix |= worker_ids_seen(unix, 20)
    assert on_unix == {40, 41}
    http_ids = set()
    for _ in range(40):
        conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
        conn.request("GET", "/id")
        http_ids.add(decode(int(conn.getresponse().read()))[1])
        conn.close()
    assert http_ids == {40, 41}
    recorder = Recorder([d, unix], clients_per_daemon=4).start()
    time.sleep(1.5)
    recorder.stop()
    assert len(recorder.ids()) > 1000 and recorder.duplicates() == 0
    fields = wait_for(lambda: (f := stats(d)) and int(f["all_processes_get_hits"]) > int(f["get_hits"]) and f)
    assert fields["worker_processes"] == "2" and fields["worker_process"] in ("0", "1")
    assert int(fields["all_processes_curr_connections"]) >= 1


def test_a_killed_worker_process_is_restarted_and_no_id_repeats(daemons: DaemonFactory) -> None:
    d = daemons.start("--workers", "2", worker_id=10)
    first = wait_for(lambda: len(children(d.pid)) == 2 and children(d.pid))
    recorder = Recorder([d], clients_per_daemon=6).start()
    time.sleep(0.8)
    os.kill(first[0], signal.SIGKILL)
    replaced = wait_for(lambda: len(children(d.pid)) == 2 and set(children(d.pid)) != set(first) and children(d.pid))
    time.sleep(1.5)
    recorder.stop()
    assert first[1] in replaced and first[0] not in replaced
    assert "restarting it" in d.stderr()
    assert recorder.duplicates() == 0 and len(recorder.ids()) > 1000
    assert worker_ids_seen(d) == {10, 11}  # the restarted process took its worker id back


def test_sigterm_stops_every_process_and_removes_the_socket(daemons: DaemonFactory, short_tmp: Path) -> None:
    sock = short_tmp / "k.sock"
    d = daemons.start("--workers", "3", worker_id=1, sock=str(sock))
    pids = wait_for(lambda: len(children(d.pid)) == 3 and children(d.pid))
    assert d.stop(signal.SIGTERM) == 0
    assert not sock.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_worker_process_that_stops_cleanly_leaves_the_shared_socket(daemons: DaemonFactory, short_tmp: Path) -> None:
    """The unix socket is the supervisor's, shared by every process: one worker stopping cleanly (and
    being restarted) must not remove its file, as asyncio and uvloop do on close since Python 3.13."""
    sock = short_tmp / "k.sock"
    d = daemons.start("--workers", "2", worker_id=60, sock=str(sock))
    first = wait_for(lambda: len(children(d.pid)) == 2 and children(d.pid))
    os.kill(first[0], signal.SIGTERM)
    wait_for(lambda: len(children(d.pid)) == 2 and set(children(d.pid)) != set(first))
    assert sock.exists()
    unix = Daemon(d.proc, None, str(sock), 60, d.stderr_path)
    # both processes accept from it again (the restarted one once its clock and state file allow)
    wait_for(lambda: worker_ids_seen(unix, 30) == {60, 61})
    assert sock.exists()


def test_worker_processes_do_not_outlive_a_killed_supervisor(daemons: DaemonFactory) -> None:
    d = daemons.start("--workers", "2", worker_id=50)
    pids = wait_for(lambda: len(children(d.pid)) == 2 and children(d.pid))
    d.stop(signal.SIGKILL)

    def gone(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
        except OSError:
            return True

    wait_for(lambda: all(gone(pid) for pid in pids), timeout=10)


def test_leased_worker_processes_each_lease_their_own_id(daemons: DaemonFactory, tmp_path: Path) -> None:
    from lease_helpers import init_pool, lease_args
    from redis_servers import start_redis

    server = start_redis(tmp_path / "redis")
    try:
        init_pool(server.url, "w")
        d = daemons.start("--workers", "2", *lease_args(server.url, "w"), worker_id=None)
        seen = wait_for(lambda: (ids := worker_ids_seen(d, 30)) and len(ids) == 2 and ids, timeout=30)
        assert seen <= set(range(1, 1024))
    finally:
        server.stop()


def test_a_worker_process_refused_by_redis_stops_the_supervisor_with_status_2(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """Exit 2 (unsafe Redis settings, issue 32) is a configuration to fix: not restarted in a loop, and
    the supervisor exits 2 too, which the systemd unit does not restart."""
    from lease_helpers import init_pool, lease_args
    from redis_servers import start_redis

    server = start_redis(tmp_path / "redis", "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru")
    try:
        init_pool(server.url, "w")
        d = daemons.start("--workers", "2", *lease_args(server.url, "w"), worker_id=None, wait=False)
        assert d.proc.wait(20) == 2
        assert "refused to run (exited with status 2)" in d.stderr()
        assert "maxmemory-policy is allkeys-lru" in d.stderr()
    finally:
        server.stop()


def test_a_worker_process_that_cannot_start_stops_the_supervisor(daemons: DaemonFactory, tmp_path: Path) -> None:
    state = tmp_path / "shared-state"
    daemons.start("--state-dir", str(state), worker_id=21)  # holds worker-21.state
    d = daemons.start("--workers", "2", "--state-dir", str(state), worker_id=20, wait=False)
    assert d.proc.wait(20) == 1
    assert "worker process 1 could not start" in d.stderr()
    assert "in use by pid" in d.stderr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--worker-id", "1", "--workers", "0"], "invalid workers 0"),
        (["--worker-id", "1023", "--workers", "2"], "need worker ids 1023..1024"),
        (["--worker-id", "1", "--workers", "2", "--state-file", "/tmp/x.state"], "with --workers use --state-dir"),
        (["--worker-id-from", "ip", "--workers", "2"], "gives one worker id per host"),
    ],
)
def test_bad_worker_process_settings_are_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run([*DAEMON_CMD, *args], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_host_ordinals_spread_over_the_worker_processes(daemons: DaemonFactory) -> None:
    """Host k of a StatefulSet takes ids k x N + offset onwards: hosts 3 and 4 never overlap."""
    d = daemons.start(
        "--worker-id-from",
        "ordinal",
        "--hostname",
        "ids-3",
        "--workers",
        "2",
        "--worker-id-offset",
        "100",
        worker_id=None,
    )
    assert worker_ids_seen(d) == {106, 107}
    assert "ordinal 3 x 2 worker processes + offset 100" in d.stderr()


def test_workers_in_the_environment(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=30, env={"WORKERS": "2"})
    assert worker_ids_seen(d) == {30, 31}


def test_port_in_use_is_one_line(daemons: DaemonFactory) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        result = subprocess.run(
            [*DAEMON_CMD, "--worker-id", "1", "--workers", "2", "--port", str(port), "--no-state-file"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        busy.close()
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

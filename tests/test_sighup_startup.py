"""A reload (SIGHUP) that arrives while the daemon starts must not end it (issue 27).

The slow start is a real one: the state file's mark lies ahead of the clock (as after a restart that
follows a clock step back), so the daemon waits for the clock to pass it before it listens -- after
it has taken its state file's lock (the lock file then holds its pid), before its event loop and its
own SIGHUP handler exist. Hangups sent then are ignored; the daemon comes up, serves IDs past the
mark, reloads on a later SIGHUP, and stops with status 0. The same for ``--workers``: the supervisor
and its processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import DAEMON_CMD, daemon_env, decode, free_port, logged_process, parse_values, recv_until, wait_for_port

from katsubushi_py.issuing.statefile import StateFile

#: How far ahead of the clock the state files' marks are: the daemon waits this long before listening
#: (with --max-clock-wait 3s it may wait up to 5 s).
AHEAD_MS = 3000


def marks_ahead(state_dir: Path, *worker_ids: int) -> int:
    """State files whose marks are AHEAD_MS in the future; the mark (unix ms)."""
    state_dir.mkdir(mode=0o700, exist_ok=True)
    mark = time.time_ns() // 1_000_000 + AHEAD_MS
    for worker_id in worker_ids:
        StateFile(state_dir / f"worker-{worker_id}.state").store(mark, worker_id)
    return mark


def wait_for_lock(state_dir: Path, worker_id: int, proc: subprocess.Popen[bytes]) -> int:
    """The pid that holds worker_id's state file (written in its lock file once taken)."""
    lock = state_dir / f"worker-{worker_id}.state.lock"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode} before taking its state file"
        text = lock.read_text().strip() if lock.exists() else ""
        if text.isdigit():
            return int(text)
        time.sleep(0.005)
    raise AssertionError(f"{lock} was not taken")


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def hang_up_while_starting(pid: int, proc: subprocess.Popen[bytes], log: Path, port: int | None = None) -> None:
    """SIGHUP five times while no daemon process serves yet (none has logged that it serves; ``port``:
    nothing listens there yet either)."""
    for _ in range(5):
        assert "serving worker id" not in log.read_text(), "already serving: not a hangup during start-up"
        assert port is None or not listening(port), "already listening: not a hangup during start-up"
        os.kill(pid, signal.SIGHUP)
        time.sleep(0.05)
        assert proc.poll() is None, f"a SIGHUP during start-up ended the daemon (status {proc.returncode})"


def login_file(directory: Path) -> Path:
    users = directory / "users"
    users.write_text("app:secret1\n")
    return users


@pytest.mark.once
def test_sighup_during_start_up_is_ignored_and_the_daemon_serves(tmp_path: Path) -> None:
    state = tmp_path / "state"
    mark = marks_ahead(state, 7)
    port = free_port()
    log = tmp_path / "daemon.log"
    argv = [*DAEMON_CMD, "--worker-id", "7", "--port", str(port), "--state-dir", str(state), "--max-clock-wait", "3s"]
    argv += ["--auth-file", str(login_file(tmp_path))]  # something for a reload to reread once it runs
    with logged_process(argv, log, env=daemon_env()) as proc:
        assert wait_for_lock(state, 7, proc) == proc.pid
        hang_up_while_starting(proc.pid, proc, log, port)
        wait_for_port(port, proc, timeout=20)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"set auth 0 0 11\r\napp secret1\r\nget a\r\n")
            reply = recv_until(s, b"END\r\n")
        [(_, id_)] = parse_values(reply.removeprefix(b"STORED\r\n"))
        ms, worker, _ = decode(id_)
        assert worker == 7 and ms > mark, "issued after the stored mark"
        assert "SIGHUP: reloading" not in log.read_text(), "nothing was reloaded during start-up"
        os.kill(proc.pid, signal.SIGHUP)  # running: a reload
        deadline = time.monotonic() + 10
        while "SIGHUP: reloading" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "SIGHUP: reloading" in log.read_text()
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.once
def test_sighup_during_the_workers_start_up_is_ignored(tmp_path: Path) -> None:
    """``--workers 2``: SIGHUP to the supervisor while its processes wait for the clock (it passes the
    signal on to them); both processes come up and serve, and a later SIGHUP reloads both."""
    state = tmp_path / "state"
    mark = marks_ahead(state, 7, 8)
    port = free_port()
    log = tmp_path / "daemon.log"
    argv = [*DAEMON_CMD, "--worker-id", "7", "--workers", "2", "--port", str(port), "--state-dir", str(state)]
    argv += ["--max-clock-wait", "3s", "--auth-file", str(login_file(tmp_path))]
    with logged_process(argv, log, env=daemon_env()) as proc:
        children = {wait_for_lock(state, 7, proc), wait_for_lock(state, 8, proc)}
        assert proc.pid not in children
        # (the supervisor listens from the start: its processes accept once they serve)
        hang_up_while_starting(proc.pid, proc, log)
        for child in children:  # the processes got it too and are still there
            os.kill(child, 0)
        wait_for_port(port, proc, timeout=20)
        seen: set[int] = set()
        deadline = time.monotonic() + 15
        while seen != {7, 8} and time.monotonic() < deadline:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"set auth 0 0 11\r\napp secret1\r\nget a\r\n")
                [(_, id_)] = parse_values(recv_until(s, b"END\r\n").removeprefix(b"STORED\r\n"))
            ms, worker, _ = decode(id_)
            assert ms > mark
            seen.add(worker)
        assert seen == {7, 8}
        for child in children:  # the same processes: none was restarted after a hangup
            os.kill(child, 0)
        assert "restarting" not in log.read_text()
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while log.read_text().count("SIGHUP: reloading") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert log.read_text().count("SIGHUP: reloading") == 2
        proc.terminate()
        assert proc.wait(15) == 0
    assert "restarting" not in log.read_text()

"""The blocking client (katsubushi_py.client.Client) against real daemon processes and misbehaving
servers: failover, backoff, the per-call deadline, reply checks, threads, fork and the ``get`` command."""

from __future__ import annotations

import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from client_fakes import (
    FAKE_ID,
    FAKE_REPLY,
    Blackhole,
    FakeServer,
    address,
    hold_only_connection,
    refused_address,
    start_failing_state_file_daemon,
)
from conftest import Daemon, DaemonFactory, decode

from katsubushi_py.cli import main
from katsubushi_py.client import AllServersFailed, Client, parse_servers

# A server that closes at once: the client finds its request unread (reset) or reads the close.
CLOSED = ("connection reset by peer", "connection closed by the server")

# Generous slack for deadline checks on a loaded machine: they catch a client that waits for a
# server's own timeout (or forever), not a slow one.
SLACK = 1.5


def workers(ids: list[int]) -> set[int]:
    return {decode(i)[1] for i in ids}


def test_fetch_fetch_many_and_stats(daemon: Daemon) -> None:
    with Client(address(daemon)) as client:
        first = client.fetch()
        batch = client.fetch_many(5)
        big = client.fetch_many(1000)
        one = client.fetch_many(1)
        stats = client.stats()
    ids = [first, *batch, *big, *one]
    assert all(isinstance(i, int) for i in ids)
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert len(batch) == 5 and len(big) == 1000 and len(one) == 1
    assert workers(ids) == {7}
    assert stats["worker_id"] == 7 and stats["cmd_get"] == 4 and stats["get_hits"] == 1007
    assert isinstance(stats["version"], str)
    with pytest.raises(ValueError):
        Client(address(daemon)).fetch_many(0)
    with pytest.raises(ValueError):
        Client(address(daemon)).fetch_many(1001)


def test_server_strings() -> None:
    parsed = parse_servers("127.0.0.1:1, localhost [::1]:3,unix:/run/k.sock unix:///tmp/x.sock")
    assert [(s.host, s.port, s.path) for s in parsed] == [
        ("127.0.0.1", 1, None),
        ("localhost", 11212, None),
        ("::1", 3, None),
        (None, None, "/run/k.sock"),
        (None, None, "/tmp/x.sock"),
    ]
    for bad in ("", "host:0", "host:99999", "host:x", "::1:11212", "[::1", "unix:", ":11212"):
        with pytest.raises(ValueError):
            parse_servers(bad)
    with pytest.raises(ValueError):
        Client("127.0.0.1:1", timeout=0)


def test_dead_first_server_fails_over_and_backs_off(daemon: Daemon) -> None:
    dead = refused_address()
    with Client([dead, address(daemon)], backoff=30, max_backoff=30) as client:
        ids = [client.fetch() for _ in range(20)]
        status = client.server_status()
    assert workers(ids) == {7} and len(set(ids)) == 20
    assert status[0].server == dead and status[0].last_error == "connection refused"
    assert status[0].failures == 1  # skipped while it backs off, not asked 20 times
    assert status[1].failures == 0


def test_blackholed_first_server_costs_at_most_its_share(daemon: Daemon) -> None:
    with Blackhole() as hole, Client([hole.address, address(daemon)], timeout=2.0, server_timeout=0.3) as client:
        start = time.monotonic()
        first = client.fetch()
        elapsed = time.monotonic() - start
        assert workers([first]) == {7}
        assert 0.25 <= elapsed < 0.3 + SLACK
        assert "timed out" in (client.server_status()[0].last_error or "")


def test_deadline_holds_across_blackholed_servers() -> None:
    with Blackhole() as a, Blackhole() as b, Blackhole() as c:
        client = Client([a.address, b.address, c.address], timeout=0.6, server_timeout=0.4)
        start = time.monotonic()
        with pytest.raises(AllServersFailed) as caught:
            client.fetch()
        elapsed = time.monotonic() - start
    assert 0.55 <= elapsed < 0.6 + SLACK
    errors = caught.value.errors
    assert list(errors) == [a.address, b.address, c.address]
    assert re.fullmatch(r"timed out after 0\.4\d s", errors[a.address])
    assert re.fullmatch(r"timed out after 0\.[12]\d s", errors[b.address])  # what was left of the call
    assert errors[c.address].startswith("not tried")


def test_stalling_server_is_abandoned_and_its_late_reply_never_used(daemon: Daemon) -> None:
    with FakeServer(FAKE_REPLY, delay=1.5) as stall:
        with Client([stall.address, address(daemon)], timeout=1.0, server_timeout=0.3, backoff=0) as client:
            ids = [client.fetch() for _ in range(3)]  # backoff 0: the stalling server is asked every time
        assert FAKE_ID not in ids and workers(ids) == {7}
        assert stall.accepted == 3  # each abandoned connection was closed, never reused
        with pytest.raises(AllServersFailed, match="timed out"):
            Client(stall.address, timeout=0.3).fetch()


def test_trickling_server_cannot_stretch_the_deadline() -> None:
    """A reply sent one byte every 0.1 s would take 4 s; every socket timeout alone would be met."""
    with FakeServer(FAKE_REPLY, trickle=0.1) as trickle:
        start = time.monotonic()
        with pytest.raises(AllServersFailed, match="timed out"):
            Client(trickle.address, timeout=0.5).fetch()
        assert time.monotonic() - start < 0.5 + SLACK


def test_all_servers_down_lists_each(short_tmp: Path) -> None:
    dead = refused_address()
    missing = f"unix:{short_tmp}/none.sock"
    with FakeServer(None) as closer, pytest.raises(AllServersFailed) as caught:
        Client([dead, missing, closer.address]).fetch_many(3)
    errors = caught.value.errors
    assert list(errors) == [dead, missing, closer.address]
    assert errors[dead] == "connection refused" and errors[missing] == "no such socket file"
    assert errors[closer.address] in CLOSED
    text = str(caught.value)
    assert text.startswith("all 3 katsubushi servers failed: ")
    assert dead in text and missing in text and closer.address in text
    assert pickle.loads(pickle.dumps(caught.value)).errors == errors  # survives multiprocessing


def test_backoff_skips_then_retries_a_failed_server(daemon: Daemon) -> None:
    with FakeServer(None) as bad, Client([bad.address, address(daemon)], backoff=1.0, max_backoff=60) as client:
        client.fetch()
        assert bad.accepted == 1
        for _ in range(10):
            client.fetch()
        assert bad.accepted == 1  # backing off: the daemon after it serves
        while client.server_status()[0].retry_in > 0:
            time.sleep(0.05)
        assert workers([client.fetch()]) == {7}
        assert bad.accepted == 2  # asked again once the backoff ran out, failed again
        status = client.server_status()[0]
        assert status.failures == 2 and status.retry_in > 1.0  # the second backoff is twice as long


def test_servers_backing_off_are_the_last_resort() -> None:
    with FakeServer(None) as bad:
        client = Client(bad.address, backoff=60, max_backoff=60)
        for _ in range(3):
            with pytest.raises(AllServersFailed):
                client.fetch()
        assert bad.accepted == 3  # the only server: asked although it backs off


def test_server_error_from_state_file_fails_over(daemons: DaemonFactory, tmp_path: Path) -> None:
    sick = start_failing_state_file_daemon(daemons, tmp_path, worker_id=3)
    healthy = daemons.start(worker_id=4)
    with Client([address(sick), address(healthy)]) as client:
        ids = client.fetch_many(10)
        assert workers(ids) == {4}
        error = client.server_status()[0].last_error or ""
        assert error.startswith("SERVER_ERROR cannot write state file")
    with pytest.raises(AllServersFailed, match="SERVER_ERROR cannot write state file"):
        Client(address(sick)).fetch()


def test_server_error_too_many_connections_fails_over(daemons: DaemonFactory) -> None:
    full = daemons.start("--max-connections", "1", worker_id=3)
    healthy = daemons.start(worker_id=4)
    with hold_only_connection(full), Client([address(full), address(healthy)]) as client:
        assert workers(client.fetch_many(3)) == {4}
        with pytest.raises(AllServersFailed) as caught:
            Client(address(full)).fetch()
    # The refusal is written on accept; depending on timing the client reads it or finds the
    # connection already reset.
    assert caught.value.errors[address(full)] in ("SERVER_ERROR too many connections", *CLOSED)


@pytest.mark.parametrize(
    ("reply", "n", "error"),
    [
        (b"VALUE id 0 3\r\nabc\r\nEND\r\n", 1, "invalid reply: not an ID: b'abc'"),
        (b"END\r\n", 1, "invalid reply: 0 values for 1 keys"),
        (b"VALUE 0 0 1\r\n5\r\nEND\r\n", 2, "invalid reply: 1 values for 2 keys"),
        (b"VALUE 0 0 1\r\n5\r\nVALUE 1 0 1\r\n4\r\nEND\r\n", 2, "invalid reply: IDs of one reply do not increase"),
        (b"VALUE id 0 20\r\n18446744073709551616\r\nEND\r\n", 1, "invalid reply: ID out of range"),
        (b"VALUE id 0 1\r\n0\r\nEND\r\n", 1, "invalid reply: ID out of range"),
        (b"ERROR\r\n", 1, "ERROR"),
        (b"HELLO\r\n", 1, "invalid reply: unexpected line 'HELLO'"),
    ],
)
def test_invalid_replies_are_rejected(reply: bytes, n: int, error: str) -> None:
    with FakeServer(reply) as liar, pytest.raises(AllServersFailed) as caught:
        Client(liar.address, timeout=2).fetch_many(n)
    assert caught.value.errors[liar.address].startswith(error)


def test_restarted_daemon_reconnects_within_the_call(daemons: DaemonFactory) -> None:
    """Pooled connections closed by a restart cost one reconnect, not a failed call."""
    first = daemons.start(worker_id=5)
    client = Client(address(first), pool_size=4)
    before = threaded_fetches(client, threads=4, each=20)
    first.stop()
    second = daemons.start(worker_id=5, port=first.port)
    after = [client.fetch() for _ in range(5)]
    assert client.server_status()[0].failures == 0
    assert second.proc.poll() is None
    ids = before + after
    assert len(set(ids)) == len(ids) and workers(ids) == {5}


def test_daemon_killed_mid_run_and_restarted(daemons: DaemonFactory, tmp_path: Path) -> None:
    state = str(tmp_path / "a.state")
    a = daemons.start("--state-file", state, worker_id=1)
    b = daemons.start(worker_id=2)
    client = Client([address(a), address(b)], timeout=2.0, backoff=0.05, max_backoff=0.2)
    ids: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def fetch_forever(batch: int) -> None:
        while not stop.is_set():
            try:
                ids.extend(client.fetch_many(batch))
            except Exception as exc:
                failures.append(exc)

    threads = [threading.Thread(target=fetch_forever, args=(n,)) for n in (1, 1, 3, 7)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: count_worker(ids, 1) >= 200)
        a.stop(signal.SIGKILL)
        at_kill = count_worker(ids, 1)
        wait_for(lambda: count_worker(ids, 2) >= 200)
        daemons.start("--state-file", state, worker_id=1, port=a.port)
        wait_for(lambda: count_worker(ids, 1) >= at_kill + 100)  # back on the first daemon
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == []  # the second daemon covered every call meanwhile
    assert len(set(ids)) == len(ids)
    assert workers(ids) == {1, 2}


def test_threads_share_one_client(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=9)
    client = Client(address(d), pool_size=4)
    ids = threaded_fetches(client, threads=12, each=150)
    assert len(ids) == 12 * 150 * 3 // 2
    assert len(set(ids)) == len(ids) and workers(ids) == {9}
    # 12 threads with 4 pooled connections: extra connections were opened and closed, never leaked
    # (the daemon counts a close when it notices it, a moment later).
    wait_for(lambda: client.stats()["curr_connections"] <= 4)


def test_fork_child_uses_its_own_connections(daemons: DaemonFactory) -> None:
    d = daemons.start(worker_id=6)
    client = Client(address(d), pool_size=1)
    client.fetch()
    connections_before = client.stats()["total_connections"]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: fetch at the same time as the parent, report the IDs, exit
        status = 1
        try:
            os.close(read_end)
            child_ids = [client.fetch() for _ in range(300)] + client.fetch_many(50)
            os.write(write_end, ("\n".join(map(str, child_ids)) + "\n").encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    parent_ids = [client.fetch() for _ in range(300)] + client.fetch_many(50)
    with os.fdopen(read_end) as pipe:
        child_ids = [int(line) for line in pipe.read().split()]
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert len(child_ids) == len(parent_ids) == 350
    ids = parent_ids + child_ids
    assert len(set(ids)) == len(ids)
    # The parent kept its one connection; the child opened exactly one of its own.
    assert client.stats()["total_connections"] == connections_before + 1


def test_unix_socket_servers(daemons: DaemonFactory, short_tmp: Path) -> None:
    d = daemons.start(port=None, sock=str(short_tmp / "k.sock"), worker_id=11)
    with Client([f"unix:{short_tmp}/missing.sock", address(d)]) as client:
        ids = [client.fetch(), *client.fetch_many(20)]
        stats = client.stats()
    assert ids == sorted(ids) and workers(ids) == {11}
    assert stats["worker_id"] == 11


# -- the get command -------------------------------------------------------------------------------
def test_get_command(daemon: Daemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["get", "--servers", refused_address(), address(daemon)]) == 0
    one = capsys.readouterr().out.split()
    monkeypatch.setenv("KATSUBUSHI_SERVERS", f"{refused_address()},{address(daemon)}")
    assert main(["get", "-n", "2500"]) == 0
    many = [int(line) for line in capsys.readouterr().out.splitlines()]
    assert len(one) == 1 and len(many) == 2500
    assert len(set(many)) == 2500 and workers([int(one[0]), *many]) == {7}


def test_get_command_when_all_servers_fail(capsys: pytest.CaptureFixture[str]) -> None:
    dead = refused_address()
    assert main(["get", "-n", "3", "--servers", dead]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"katsubushi-py: error: the katsubushi server failed: {dead}: connection refused\n"
    assert main(["get", "--servers", "host:port"]) == 2
    assert main(["get", "-n", "0"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 2


# -- helpers ---------------------------------------------------------------------------------------
def count_worker(ids: list[int], worker: int) -> int:
    return sum(1 for i in list(ids) if decode(i)[1] == worker)


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def threaded_fetches(client: Client, threads: int, each: int) -> list[int]:
    """``threads`` threads, each alternating fetch() and fetch_many(2) ``each`` times in all."""
    results: list[list[int]] = [[] for _ in range(threads)]

    def run(out: list[int]) -> None:
        for i in range(each):
            if i % 2:
                out.extend(client.fetch_many(2))
            else:
                out.append(client.fetch())

    pool = [threading.Thread(target=run, args=(out,)) for out in results]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return [i for out in results for i in out]

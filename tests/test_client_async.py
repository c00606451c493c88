"""The asyncio client (katsubushi_py.client.AsyncClient) against real daemon processes and misbehaving
servers: the same failover as the blocking client, tasks sharing one client, cancellation."""

from __future__ import annotations

import asyncio
import signal
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

from katsubushi_py.client import AllServersFailed, AsyncClient

SLACK = 1.5  # see test_client.py
CLOSED = ("connection reset by peer", "connection closed by the server")


def workers(ids: list[int]) -> set[int]:
    return {decode(i)[1] for i in ids}


async def test_fetch_fetch_many_and_stats(daemon: Daemon) -> None:
    async with AsyncClient(address(daemon)) as client:
        first = await client.fetch()
        batch = await client.fetch_many(5)
        big = await client.fetch_many(1000)
        stats = await client.stats()
        with pytest.raises(ValueError):
            await client.fetch_many(0)
    ids = [first, *batch, *big]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) == 1006
    assert workers(ids) == {7}
    assert stats["worker_id"] == 7 and stats["cmd_get"] == 3 and stats["get_hits"] == 1006


async def test_unix_socket_and_dead_first_server(daemons: DaemonFactory, short_tmp: Path) -> None:
    d = daemons.start(port=None, sock=str(short_tmp / "k.sock"), worker_id=11)
    dead = refused_address()
    async with AsyncClient([dead, f"unix:{short_tmp}/missing.sock", address(d)], max_backoff=30, backoff=30) as client:
        ids = [await client.fetch() for _ in range(10)] + await client.fetch_many(10)
        status = client.server_status()
    assert ids == sorted(ids) and workers(ids) == {11}
    assert [s.last_error for s in status] == ["connection refused", "no such socket file", None]
    assert [s.failures for s in status] == [1, 1, 0]  # skipped while backing off


async def test_blackhole_and_the_deadline(daemon: Daemon) -> None:
    with Blackhole() as a, Blackhole() as b:
        async with AsyncClient([a.address, address(daemon)], timeout=2.0, server_timeout=0.3) as client:
            assert workers([await client.fetch()]) == {7}
            assert "timed out" in (client.server_status()[0].last_error or "")
        client = AsyncClient([a.address, b.address, address(daemon)], timeout=0.5, server_timeout=0.3)
        start = time.monotonic()
        with pytest.raises(AllServersFailed) as caught:
            await client.fetch()
        assert time.monotonic() - start < 0.5 + SLACK
    errors = caught.value.errors
    assert errors[a.address].startswith("timed out") and errors[b.address].startswith("timed out")
    assert errors[address(daemon)].startswith("not tried")


async def test_stalling_and_trickling_servers(daemon: Daemon) -> None:
    with FakeServer(FAKE_REPLY, delay=1.5) as stall, FakeServer(FAKE_REPLY, trickle=0.1) as trickle:
        servers = [stall.address, trickle.address, address(daemon)]
        async with AsyncClient(servers, timeout=2, server_timeout=0.3, backoff=0) as client:
            ids = [await client.fetch() for _ in range(2)]
        assert FAKE_ID not in ids and workers(ids) == {7}
        assert stall.accepted == 2 and trickle.accepted == 2  # abandoned connections are not reused
        start = time.monotonic()
        with pytest.raises(AllServersFailed, match="timed out"):
            await AsyncClient(trickle.address, timeout=0.5).fetch()
        assert time.monotonic() - start < 0.5 + SLACK


async def test_all_servers_down_lists_each(short_tmp: Path) -> None:
    dead = refused_address()
    missing = f"unix:{short_tmp}/none.sock"
    with FakeServer(None) as closer, pytest.raises(AllServersFailed) as caught:
        await AsyncClient([dead, missing, closer.address]).fetch_many(3)
    errors = caught.value.errors
    assert list(errors) == [dead, missing, closer.address]
    assert errors[dead] == "connection refused" and errors[missing] == "no such socket file"
    assert errors[closer.address] in CLOSED
    assert str(caught.value).startswith("all 3 katsubushi servers failed: ")


@pytest.mark.parametrize(
    ("reply", "n", "error"),
    [
        (b"VALUE id 0 3\r\nabc\r\nEND\r\n", 1, "invalid reply: not an ID: b'abc'"),
        (b"END\r\n", 1, "invalid reply: 0 values for 1 keys"),
        (b"VALUE 0 0 1\r\n5\r\nEND\r\n", 2, "invalid reply: 1 values for 2 keys"),
        (b"VALUE 0 0 1\r\n5\r\nVALUE 1 0 1\r\n4\r\nEND\r\n", 2, "invalid reply: IDs of one reply do not increase"),
        (b"VALUE id 0 5\r\n5\r\nEND\r\n", 1, "invalid reply: unexpected line 'VALUE id 0 5'"),
        (b"SERVER_ERROR clock moved backwards\r\n", 1, "SERVER_ERROR clock moved backwards"),
    ],
)
async def test_invalid_replies_are_rejected(reply: bytes, n: int, error: str) -> None:
    with FakeServer(reply) as liar, pytest.raises(AllServersFailed) as caught:
        await AsyncClient(liar.address, timeout=2).fetch_many(n)
    assert caught.value.errors[liar.address].startswith(error)


async def test_server_error_fails_over(daemons: DaemonFactory, tmp_path: Path) -> None:
    sick = start_failing_state_file_daemon(daemons, tmp_path, worker_id=3)
    full = daemons.start("--max-connections", "1", worker_id=4)
    healthy = daemons.start(worker_id=5)
    with hold_only_connection(full):
        async with AsyncClient([address(sick), address(full), address(healthy)]) as client:
            assert workers(await client.fetch_many(4)) == {5}
            errors = [s.last_error or "" for s in client.server_status()]
    assert errors[0].startswith("SERVER_ERROR cannot write state file")
    assert errors[1] == "SERVER_ERROR too many connections"


async def test_tasks_share_one_client(daemons: DaemonFactory) -> None:
    a = daemons.start(worker_id=1)
    b = daemons.start(worker_id=2)
    client = AsyncClient([address(a), address(b)], pool_size=4, timeout=10)  # no failover from mere load

    async def task(i: int) -> list[int]:
        out: list[int] = []
        for j in range(30):
            out.extend(await client.fetch_many(3) if (i + j) % 3 == 0 else [await client.fetch()])
        return out

    results = await asyncio.gather(*(task(i) for i in range(60)))
    ids = [i for r in results for i in r]
    assert len(set(ids)) == len(ids) == 60 * (20 * 1 + 10 * 3)
    assert workers(ids) == {1}  # the first server answered everything
    for result in results:
        assert result == sorted(result)  # one daemon: each task's IDs increase
    await client.close()


async def test_daemon_restarted_and_killed(daemons: DaemonFactory, tmp_path: Path) -> None:
    state = str(tmp_path / "a.state")
    a = daemons.start("--state-file", state, worker_id=1)
    b = daemons.start(worker_id=2)
    client = AsyncClient([address(a), address(b)], timeout=2, backoff=0.05, max_backoff=0.2, pool_size=8)
    ids = [i for r in await asyncio.gather(*(client.fetch_many(2) for _ in range(8))) for i in r]
    a.stop()  # graceful: the pooled connections are closed by the server
    a = daemons.start("--state-file", state, worker_id=1, port=a.port)
    ids += await client.fetch_many(2)  # a pooled, closed connection: one reconnect, same server
    assert workers(ids) == {1} and client.server_status()[0].failures == 0

    stop = asyncio.Event()

    async def fetch_until_stopped() -> None:
        while not stop.is_set():
            ids.append(await client.fetch())

    tasks = [asyncio.create_task(fetch_until_stopped()) for _ in range(4)]
    await wait_for(lambda: len(ids) > 500)
    a.stop(signal.SIGKILL)
    at_kill = count_worker(ids, 1)
    await wait_for(lambda: count_worker(ids, 2) > 300)
    daemons.start("--state-file", state, worker_id=1, port=a.port)
    await wait_for(lambda: count_worker(ids, 1) > at_kill + 100)
    stop.set()
    await asyncio.gather(*tasks)  # no task saw a failure: the second daemon covered
    assert len(set(ids)) == len(ids)
    await client.close()


async def test_cancelled_call_does_not_poison_the_pool(daemons: DaemonFactory) -> None:
    with FakeServer(FAKE_REPLY, delay=0.5) as slow:
        client = AsyncClient(slow.address, timeout=5)
        task = asyncio.create_task(client.fetch())
        await wait_for(lambda: slow.accepted == 1)
        await asyncio.sleep(0.1)  # the request is on its way; the reply comes 0.5 s later
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: slow.disconnects == 1)  # the cancelled call's connection was closed
        assert await client.fetch() == FAKE_ID
        assert slow.accepted == 2  # ... and not reused


def test_one_client_across_event_loops(daemon: Daemon) -> None:
    client = AsyncClient(address(daemon))
    first = asyncio.run(client.fetch())
    second = asyncio.run(client.fetch())  # connections of the closed loop are dropped
    assert first < second


# -- helpers ---------------------------------------------------------------------------------------
def count_worker(ids: list[int], worker: int) -> int:
    return sum(1 for i in ids if decode(i)[1] == worker)


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)

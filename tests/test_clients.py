"""Real memcached client libraries against the real daemon."""

import asyncio
from pathlib import Path

import aiomcache
import memcache  # python-memcached
from conftest import Daemon, DaemonFactory, decode
from pymemcache.client.base import Client as PymemcacheClient


def check(ids: list[int], worker: int) -> None:
    assert len(set(ids)) == len(ids)
    assert all(decode(i)[1] == worker for i in ids)


def test_pymemcache_get_and_get_many(daemon: Daemon) -> None:
    client = PymemcacheClient(("127.0.0.1", daemon.port), connect_timeout=5, timeout=5)
    try:
        first = int(client.get("a"))
        many = client.get_many(["a", "b", "c"])
        assert set(many) == {"a", "b", "c"}
        ids = [first] + [int(many[k]) for k in ("a", "b", "c")]
        assert ids == sorted(ids)
        check(ids, 7)
        version = client.version()
        assert version.startswith(b"0.")
        stats = client.stats()
        assert stats[b"cmd_get"] == 2 and stats[b"get_hits"] == 4
    finally:
        client.close()


def test_pymemcache_over_unix_socket(daemons: DaemonFactory, short_tmp: Path) -> None:
    path = str(short_tmp / "k.sock")
    daemons.start(port=None, sock=path, worker_id=4)
    client = PymemcacheClient(path, connect_timeout=5, timeout=5)
    try:
        ids = [int(client.get(f"k{i}")) for i in range(100)]
        assert ids == sorted(ids)
        check(ids, 4)
    finally:
        client.close()


def test_python_memcached(daemon: Daemon) -> None:
    client = memcache.Client([f"127.0.0.1:{daemon.port}"], socket_timeout=5)
    try:
        first = int(client.get("a"))
        many = client.get_multi(["x", "y", "z"])
        assert sorted(many) == ["x", "y", "z"]
        ids = [first, *(int(many[k]) for k in ("x", "y", "z"))]
        check(ids, 7)
        assert first < min(ids[1:])
    finally:
        client.disconnect_all()


def test_aiomcache_get(daemon: Daemon) -> None:
    async def main() -> list[int]:
        client = aiomcache.Client("127.0.0.1", daemon.port, pool_size=4)
        try:
            one = await client.get(b"a")
            parallel = await asyncio.gather(*(client.get(b"p%d" % i) for i in range(50)))
            return [int(one), *(int(v) for v in parallel)]
        finally:
            await client.close()

    ids = asyncio.run(main())
    assert len(ids) == 51
    check(ids, 7)


def test_aiomcache_multi_get_needs_gets_cas(daemons: DaemonFactory) -> None:
    """aiomcache's multi_get sends GETS and requires a CAS field, which katsubushi's GETS lacks."""

    async def multi(port: int) -> list[int]:
        client = aiomcache.Client("127.0.0.1", port)
        try:
            return [int(v) for v in await client.multi_get(b"a", b"b", b"c")]
        finally:
            await client.close()

    compatible = daemons.start()
    try:
        asyncio.run(multi(compatible.port))  # type: ignore[arg-type]
    except (IndexError, aiomcache.exceptions.ClientException):
        pass
    else:
        raise AssertionError("katsubushi-compatible GETS unexpectedly carried a CAS field")
    with_cas = daemons.start("--gets-cas", worker_id=8)
    ids = asyncio.run(multi(with_cas.port))  # type: ignore[arg-type]
    assert ids == sorted(ids)
    check(ids, 8)


def test_pymemcache_gets_with_cas(daemons: DaemonFactory) -> None:
    d = daemons.start("--gets-cas")
    client = PymemcacheClient(("127.0.0.1", d.port), connect_timeout=5, timeout=5)
    try:
        value, cas = client.gets("a")
        assert int(cas) == int(value)
        many = client.gets_many(["x", "y"])
        assert [int(v) for v, _ in many.values()] == sorted(int(v) for v, _ in many.values())
    finally:
        client.close()

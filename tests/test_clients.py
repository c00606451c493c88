"""Real memcached client libraries against the real daemon: text, binary and meta."""

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import aiomcache
import bmemcached
import memcache  # python-memcached
import pytest
from conftest import Daemon, DaemonFactory, decode
from pymemcache.client.base import Client as PymemcacheClient

from katsubushi_py import __version__


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
        assert version == __version__.encode()
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


# -- binary protocol clients ---------------------------------------------------------------------


@pytest.fixture(params=["tcp", "unix"])
def served(request: pytest.FixtureRequest, daemons: DaemonFactory, short_tmp: Path) -> tuple[Daemon, str]:
    """The daemon and the address a client names it by: host:port, or the unix socket's path."""
    if request.param == "unix":
        path = str(short_tmp / "k.sock")
        return daemons.start(port=None, sock=path, worker_id=5), path
    d = daemons.start(worker_id=5)
    return d, f"127.0.0.1:{d.port}"


def test_python_binary_memcached(served: tuple[Daemon, str]) -> None:
    _, address = served
    client = bmemcached.Client([address], socket_timeout=5)
    try:
        one = int(client.get("a"))
        many = client.get_multi(["a", "b", "c"])  # GETKQ a, GETKQ b, then GETK c
        assert sorted(many) == ["a", "b", "c"]
        ids = [one, *(int(many[k]) for k in ("a", "b", "c"))]
        assert ids[0] < min(ids[1:])
        check(ids, 5)
        [stats] = client.stats().values()
        # Every binary get is a command (a text GET line is one, whatever its keys).
        assert stats["cmd_get"] == b"4" and stats["get_hits"] == b"4" and stats["worker_id"] == b"5"
    finally:
        client.disconnect_all()


def test_pylibmc_binary(served: tuple[Daemon, str]) -> None:
    pylibmc = pytest.importorskip("pylibmc", reason="pylibmc needs libmemcached-dev to build")
    _, address = served
    client = pylibmc.Client([address], binary=True)
    one = int(client.get("a"))
    many = client.get_multi([f"k{i}" for i in range(100)])  # GETKQ x 100, then NOOP
    assert sorted(many) == sorted(f"k{i}" for i in range(100))
    ids = [one, *(int(v) for v in many.values())]
    check(ids, 5)
    [(_, stats)] = client.get_stats()
    assert stats["cmd_get"] == b"101" and stats["get_hits"] == b"101"
    with pytest.raises(pylibmc.Error):
        client.set("a", "1")  # not supported, and said so
    # libmemcached takes any status it has no name for (0x0083 here) as a failed server and waits
    # its retry timeout (about 2 s) before using it again; a new client does not wait.
    assert int(pylibmc.Client([address], binary=True).get("after")) > max(ids)


def libmemcached_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is missing (apt-get install libmemcached-tools)")
    return path


def test_memccat_binary(served: tuple[Daemon, str]) -> None:
    _, address = served
    out = subprocess.run(
        [libmemcached_tool("memccat"), f"--servers={address}", "--binary", "a", "b", "c"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    ids = [int(line) for line in out.stdout.split()]
    assert len(ids) == 3
    check(ids, 5)


@pytest.mark.parametrize("binary", [False, True])
def test_memcstat_and_memcping_see_the_daemon_up(served: tuple[Daemon, str], binary: bool) -> None:
    """libmemcached refuses a major version of 0 ("strtol() failed to parse major version"), so these
    reported a 0.x daemon as down."""
    _, address = served
    flags = ["--binary"] if binary else []
    stat = subprocess.run(
        [libmemcached_tool("memcstat"), f"--servers={address}", *flags], capture_output=True, text=True, timeout=30
    )
    assert stat.returncode == 0, stat.stderr
    assert f"version: {__version__}" in stat.stdout and "worker_id: 5" in stat.stdout
    ping = subprocess.run([libmemcached_tool("memcping"), f"--servers={address}"], capture_output=True, timeout=30)
    assert ping.returncode == 0, ping.stderr


DALLI_SCRIPT = """
require "dalli"
require "json"
client = Dalli::Client.new(ARGV[0], socket_timeout: 5)
one = client.get("a")
many = client.get_multi("a", "b", "c")
stats = client.stats.values.first
begin
  client.set("a", "1")
  set_error = nil
rescue Dalli::DalliError => e
  set_error = e.message
end
after = client.get("after")
puts JSON.generate({one: one, many: many, stats: stats, version: client.version.values.first,
                    set_error: set_error, after: after})
"""


def test_ruby_dalli(served: tuple[Daemon, str], tmp_path: Path) -> None:
    """Dalli 3.0 speaks only binary: go-katsubushi marks the daemon down after one timeout."""
    ruby = shutil.which("ruby")
    if ruby is None or subprocess.run([ruby, "-e", 'require "dalli"'], capture_output=True).returncode != 0:
        pytest.skip("ruby and Dalli are missing (apt-get install ruby ruby-dalli)")
    _, address = served
    script = tmp_path / "dalli.rb"
    script.write_text(DALLI_SCRIPT)
    out = subprocess.run([ruby, str(script), address], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert sorted(result["many"]) == ["a", "b", "c"]
    ids = [int(result["one"]), *(int(v) for v in result["many"].values()), int(result["after"])]
    assert ids == sorted(ids)
    check(ids, 5)
    assert result["version"] == __version__
    assert result["stats"]["cmd_get"] == "4" and result["stats"]["get_hits"] == "4"
    assert "Not supported" in result["set_error"]


PHP_SCRIPT = """<?php
$m = new Memcached();
$m->setOption(Memcached::OPT_BINARY_PROTOCOL, $argv[2] === "binary");
if ($argv[1][0] === "/") { $m->addServer($argv[1], 0); }
else { [$host, $port] = explode(":", $argv[1]); $m->addServer($host, (int)$port); }
$one = $m->get("a");
$many = $m->getMulti(["a", "b", "c"]);
$version = $m->getVersion();
$stats = $m->getStats();
echo json_encode(["one" => $one, "many" => $many, "version" => array_values($version)[0],
                  "stats" => array_values($stats)[0], "result" => $m->getResultMessage()]);
"""


@pytest.mark.parametrize("protocol", ["binary", "text"])
def test_php_memcached(served: tuple[Daemon, str], tmp_path: Path, protocol: str) -> None:
    """php-memcached multi-gets with GETK + NOOP in binary (go-katsubushi answers NOT FOUND), and its
    getVersion and getStats go through libmemcached's version parsing in both protocols."""
    php = shutil.which("php")
    if php is None or "memcached" not in subprocess.run([php, "-m"], capture_output=True, text=True).stdout:
        pytest.skip("php and php-memcached are missing (apt-get install php-cli php-memcached)")
    _, address = served
    script = tmp_path / "client.php"
    script.write_text(PHP_SCRIPT)
    out = subprocess.run([php, str(script), address, protocol], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    result = json.loads(out.stdout)
    assert result["result"] == "SUCCESS"
    assert sorted(result["many"]) == ["a", "b", "c"]
    ids = [int(result["one"]), *(int(v) for v in result["many"].values())]
    assert ids == sorted(ids)
    check(ids, 5)
    assert result["version"] == __version__
    # Every binary get is a command; a text GET line is one whatever its keys.
    assert result["stats"]["cmd_get"] == (4 if protocol == "binary" else 2) and result["stats"]["get_hits"] == 4


# -- a meta protocol client ----------------------------------------------------------------------


def test_meta_memcache(daemon: Daemon) -> None:
    from meta_memcache import CacheClient, ServerAddress, connection_pool_factory_builder

    client = CacheClient.cache_client_from_servers(
        servers=[ServerAddress(host="127.0.0.1", port=daemon.port)],
        connection_pool_factory_fn=connection_pool_factory_builder(recv_timeout=5),
    )
    one = int(client.get("a"))
    many = client.multi_get(["a", "b", "c"])
    assert sorted(k.key for k in many) == ["a", "b", "c"]
    ids = [one, *(int(v) for v in many.values())]
    assert ids[0] < min(ids[1:])
    check(ids, 7)

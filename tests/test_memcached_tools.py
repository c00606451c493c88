"""The daemon as memcached's own tools and clients see it: libmemcached's protocol tester
(``memccapable``) and load generator (``memcslap``), pymemcache's multi-get, a raw socket asking for
100,000 IDs at once, storage commands answered in step, and the framing of every command beside a
running memcached 1.6.18, with the daemon's memory watched where a client asks a great deal."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    Daemon,
    DaemonFactory,
    decode,
    memcached_server,
    parse_values,
    recv_until,
)
from pymemcache.client.base import Client as PymemcacheClient
from pymemcache.exceptions import MemcacheClientError


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is missing (apt-get install libmemcached-tools)")
    return path


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def stats(sock: socket.socket) -> dict[str, str]:
    sock.sendall(b"stats\r\n")
    lines = recv_until(sock, b"END\r\n").decode().split("\r\n")
    return {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines if line.startswith("STAT ")}


# -- libmemcached's tools --------------------------------------------------------------------------

# What passed before this daemon answered verbosity, unknown stats groups and storage commands as
# memcached does (the binary five), and what passes now: every test that does not need an item stored.
MEMCCAPABLE_PASSING = [
    "ascii version",
    "ascii quit",
    "ascii verbosity",
    "ascii set noreply",
    "ascii add noreply",
    "ascii stat",
    "binary noop",
    "binary quit",
    "binary quitq",
    "binary version",
    "binary stat",
]

# memccapable picks the rules it checks ``version x y``, ``version noreply``, ``quit foo bar`` and
# ``quit noreply`` by from the VERSION line its "ascii version" test reads: ERROR from a version below
# 1.6 (memcached 1.5 and older), VERSION and a close from 1.6 on; a test run alone keeps the old rules
# (memcached 1.6.18 fails ``-T "ascii quit"``). This daemon numbers its own versions (1.0.0) and answers
# as memcached 1.6 and go-katsubushi do, so these tests run after "ascii version" in one memccapable,
# which sees the daemon announced as 1.6 through a relay that rewrites that one line and nothing else.
MEMCCAPABLE_VERSION_JUDGED = {
    "ascii version",
    "ascii quit",
    "ascii verbosity",
    "ascii set noreply",
    "ascii add noreply",
}
# memccapable's ascii tests in the order it runs them (its -P prompts for each in turn).
MEMCCAPABLE_ASCII_ORDER = [
    "ascii version",
    "ascii quit",
    "ascii verbosity",
    "ascii set",
    "ascii set noreply",
    "ascii get",
    "ascii gets",
    "ascii mget",
    "ascii flush",
    "ascii flush noreply",
    "ascii add",
    "ascii add noreply",
]


class VersionRelay:
    """A loopback relay to ``port`` that presents the server's ``VERSION <ours>`` as ``VERSION 1.6.0``
    (memccapable sends one request at a time, so a version line never straddles two reads)."""

    def __init__(self, port: int, ours: bytes) -> None:
        self._target, self._ours = port, b"VERSION " + ours + b"\r\n"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._target))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, rewrite: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data.replace(self._ours, b"VERSION 1.6.0\r\n") if rewrite else data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()


def memccapable_after_version(port: int, test_name: str) -> subprocess.CompletedProcess[str]:
    """memccapable -P answering its prompts: run "ascii version" and ``test_name``, skip the rest."""
    order = MEMCCAPABLE_ASCII_ORDER[: MEMCCAPABLE_ASCII_ORDER.index(test_name) + 1]
    answers = ["go" if name in ("ascii version", test_name) else "skip" for name in order] + ["quit"]
    return subprocess.run(
        [tool("memccapable"), "-h", "127.0.0.1", "-p", str(port), "-t", "2", "-v", "-a", "-P"],
        input="\n".join(answers) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("test_name", MEMCCAPABLE_PASSING)
def test_memccapable(daemon: Daemon, test_name: str) -> None:
    if test_name not in MEMCCAPABLE_VERSION_JUDGED:
        out = subprocess.run(
            [tool("memccapable"), "-h", "127.0.0.1", "-p", str(daemon.port), "-t", "2", "-v", "-T", test_name],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return
    with daemon.connect() as s:
        s.sendall(b"version\r\n")
        ours = recv_until(s, b"\r\n").split()[1]
    relay = VersionRelay(daemon.port, ours)
    try:
        out = memccapable_after_version(relay.port, test_name)
    finally:
        relay.close()
    passed = re.findall(r"(ascii [a-z ]+?)\s+\[pass\]", out.stdout)
    assert out.returncode == 0 and test_name in passed and "[FAIL]" not in out.stdout, out.stdout + out.stderr


def test_memccapable_ascii_quit_run_alone_fails_against_memcached_too(memcached: int) -> None:
    """Why "ascii quit" runs after "ascii version": alone, memccapable expects a pre-1.6 ERROR, which
    memcached 1.6.18 does not give either."""
    out = subprocess.run(
        [tool("memccapable"), "-h", "127.0.0.1", "-p", str(memcached), "-t", "2", "-T", "ascii quit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert re.search(r"ascii quit\s+\[pass\]", memccapable_after_version(memcached, "ascii quit").stdout)


@pytest.mark.parametrize("binary", [False, True])
def test_memcslap_mget_retrieves_every_key(daemon: Daemon, binary: bool) -> None:
    """memcslap loads its keys with sets (refused here: this server stores nothing), then gets all of
    them in one multi-get: 2,000 keys of 20 to 60 bytes, a 80 KB line in text. It retrieved none
    when a get line was limited to 64 KiB."""
    with daemon.connect() as s:
        before = int(stats(s)["get_hits"])
    flags = ["--binary"] if binary else []
    out = subprocess.run(
        [tool("memcslap"), f"--servers=127.0.0.1:{daemon.port}", "--test=mget", "--execute-number=2000", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    retrieved = re.search(r"Time to mget\s+(\d+) keys", out.stdout)
    assert retrieved is not None and int(retrieved.group(1)) == 2000, out.stdout
    with daemon.connect() as s:
        assert int(stats(s)["get_hits"]) - before == 2000


# -- large multi-gets ------------------------------------------------------------------------------


@pytest.fixture(params=["tcp", "unix"])
def address(request: pytest.FixtureRequest, daemons: DaemonFactory, short_tmp: Path) -> tuple[Daemon, object]:
    if request.param == "unix":
        path = str(short_tmp / "k.sock")
        return daemons.start(port=None, sock=path, worker_id=6), path
    d = daemons.start(worker_id=6)
    return d, ("127.0.0.1", d.port)


@pytest.mark.parametrize("count", [2_000, 100_000])
def test_pymemcache_get_many(address: tuple[Daemon, object], count: int) -> None:
    """pymemcache writes the whole get line, then reads: over a unix socket, whose buffers are small,
    that works only because the daemon reads ahead while the client is not reading (up to
    --read-ahead, 1 MiB: this line is 0.9 MB)."""
    _, where = address
    client = PymemcacheClient(where, connect_timeout=5, timeout=30)
    try:
        keys = [f"k{i}" for i in range(count)]
        many = client.get_many(keys)
    finally:
        client.close()
    assert sorted(many) == sorted(keys)
    ids = [int(v) for v in many.values()]
    assert len(set(ids)) == count and all(decode(i)[1] == 6 for i in ids)


def test_a_raw_get_of_100000_keys_in_bounded_memory(daemon: Daemon) -> None:
    """One get line of 100,000 40-byte keys (4 MB in, 6 MB out), written while the replies are read:
    every key answered, in order, with distinct IDs, and the daemon's memory does not follow the size
    of the request or of its reply."""
    keys = [b"%040d" % i for i in range(100_000)]
    line = b"get " + b" ".join(keys) + b"\r\n"
    rss_before = rss_kb(daemon.pid)
    peak = [rss_before]
    s = daemon.connect(timeout=30)

    def send() -> None:
        for i in range(0, len(line), 65536):
            s.sendall(line[i : i + 65536])
            peak[0] = max(peak[0], rss_kb(daemon.pid))

    sender = threading.Thread(target=send)
    sender.start()
    reply = recv_until(s, b"END\r\n", limit=100_000_000)
    sender.join()
    s.close()
    pairs = parse_values(reply)
    assert [k for k, _ in pairs] == keys
    ids = [i for _, i in pairs]
    assert len(set(ids)) == len(ids) and ids == sorted(ids)
    assert peak[0] - rss_before < 8_000  # kB, while a buffered request and reply would be 10 MB


def test_a_client_that_never_reads_a_huge_get_is_not_read_without_bound(daemon: Daemon) -> None:
    """A get line of 2,000,000 keys (20 MB) from a client that reads nothing: the daemon reads ahead
    up to its limit and stops, so the client cannot send it all, and memory stays where it was."""
    rss_before = rss_kb(daemon.pid)
    s = daemon.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(2.0)
    chunk = b" ".join(b"k%07d" % i for i in range(100_000)) + b" "
    sent = 0
    try:
        s.sendall(b"get ")
        for _ in range(20):
            s.sendall(chunk)
            sent += len(chunk)
    except TimeoutError:
        pass  # the daemon stopped reading: that is the point
    assert sent < 15_000_000
    with daemon.connect() as other:  # the daemon goes on for everyone else
        other.sendall(b"get a\r\n")
        assert parse_values(recv_until(other, b"END\r\n"))
    assert rss_kb(daemon.pid) - rss_before < 20_000  # kB: the read-ahead (1 MiB) and a little
    s.close()


# -- storage commands, in step ---------------------------------------------------------------------

STORAGE = [
    b"set k 0 0 5",
    b"add k 0 0 5",
    b"replace k 0 0 5",
    b"append k 0 0 5",
    b"prepend k 0 0 5",
    b"cas k 0 0 5 99",
]


@pytest.mark.parametrize("noreply", [False, True])
def test_each_storage_command_then_a_get_on_the_same_connection(daemon: Daemon, noreply: bool) -> None:
    with daemon.connect() as s:
        for command in STORAGE:
            s.sendall(command + (b" noreply" if noreply else b"") + b"\r\nvalue\r\nget after\r\n")
            reply = recv_until(s, b"END\r\n")
            name = command.split()[0]
            expected = b"" if noreply else b"CLIENT_ERROR %b is not supported: this server only issues IDs\r\n" % name
            assert reply.startswith(expected), reply
            assert [k for k, _ in parse_values(reply[len(expected) :])] == [b"after"], reply
        for command in (b"incr k 1", b"decr k 1", b"touch k 10", b"delete k", b"flush_all"):
            s.sendall(command + (b" noreply" if noreply else b"") + b"\r\nget after\r\n")
            reply = recv_until(s, b"END\r\n")
            assert reply.startswith(b"VALUE" if noreply else b"CLIENT_ERROR"), reply
            assert parse_values(reply[reply.index(b"VALUE") :])


def test_pymemcache_sets_and_gets_on_one_connection(daemon: Daemon) -> None:
    client = PymemcacheClient(("127.0.0.1", daemon.port), connect_timeout=5, timeout=5)
    try:
        assert client.set("k", b"v" * 10_000)  # noreply, pymemcache's default: nothing comes back
        first = int(client.get("k"))
        with pytest.raises(MemcacheClientError, match="not supported"):
            client.set("k", b"v", noreply=False)
        assert int(client.get("k")) > first  # still in step
    finally:
        client.close()


# -- beside a real memcached -----------------------------------------------------------------------


@pytest.fixture
def memcached() -> Iterator[int]:
    with memcached_server() as port:
        yield port


# Requests whose framing (how many replies, which errors, what is read as data) must be memcached's.
FRAMING = [
    b"set a 0 0 3\r\nabc\r\n",
    b"set a 0 0 3 noreply\r\nabc\r\n",
    b"set a 0 0 3\r\nabcdef\r\n",
    b"set a 0 0 3 noreply\r\nabcdef\r\n",
    b"set a 0 0 5\r\nabc\r\nxx\r\n",
    b"set a 0 0 3\r\nabc\n\r\n",
    b"set a 0 0 2000000\r\n" + b"x" * 2_000_000 + b"\r\n",
    b"set a 0 0 4294967295\r\nabc\r\n",
    b"set a 0 0 2147483646\r\nabc\r\n",
    b"set a 0 0 -1\r\nabc\r\n",
    b"set a x 0 3\r\nabc\r\n",
    b"set " + b"k" * 251 + b" 0 0 3\r\nabc\r\n",
    b"set a 0 0\r\nabc\r\n",
    b"set a 0 0 3 x y\r\nabc\r\n",
    b"set a 0 0 3 x\r\nabc\r\n",
    b"add a 0 0 3\r\nabc\r\n",
    b"replace a 0 0 3 noreply\r\nabc\r\n",
    b"append a 0 0 3\r\nabc\r\n",
    b"prepend a 0 0 3\r\nabc\r\n",
    b"cas a 0 0 3 1\r\nabc\r\n",
    b"cas a 0 0 3 1 noreply\r\nabc\r\n",
    b"cas a 0 0 3\r\nabc\r\n",
    b"incr a 1\r\n",
    b"incr a 1 noreply\r\n",
    b"incr a\r\n",
    b"decr a 1\r\n",
    b"touch a 10\r\n",
    b"touch a\r\n",
    b"delete a\r\n",
    b"delete a noreply\r\n",
    b"delete a b c d e\r\n",
    b"delete\r\n",
    b"flush_all\r\n",
    b"flush_all noreply\r\n",
    b"verbosity 1\r\n",
    b"verbosity 1 noreply\r\n",
    b"verbosity noreply\r\n",
    b"verbosity\r\n",
    b"verbosity x\r\n",
    b"stats noreply\r\n",
    b"stats nosuchgroup\r\n",
    b"stats malloc\r\n",
    b"version x y\r\n",
    b"version noreply\r\n",
    b"get " + b"k" * 251 + b"\r\n",  # (with keys before it, they are answered here, see docs/protocol.md)
    b"ms a 2\r\nabcd\r\n",
]

# memcached's answers that mean "stored", "not stored", "deleted", "found" and so on, where ours
# (which stores nothing) is "not supported"; and its replies to stats groups we do not have.
_OUTCOME = re.compile(
    rb"^(STORED|NOT_STORED|EXISTS|NOT_FOUND|DELETED|TOUCHED|OK|\d+|SERVER_ERROR object too large for cache|"
    rb"CLIENT_ERROR cannot increment or decrement non-numeric value|"
    rb"CLIENT_ERROR \S+ is not supported: this server only issues IDs)\r\n",
    re.MULTILINE,
)
_VERSION = re.compile(rb"^VERSION \S+\r\n", re.MULTILINE)  # ours is 1.0.0, memcached's 1.6.18


def exchange(sock: socket.socket, data: bytes) -> bytes:
    """The reply to ``data``, delimited by an ``mn`` sent after it (a no-op both servers answer MN)."""
    sock.sendall(data + b"mn\r\n")
    return recv_until(sock, b"MN\r\n", limit=10_000_000)[:-4]


def test_framing_is_memcacheds(daemon: Daemon, memcached: int) -> None:
    """Each request beside a running memcached 1.6.18: the same replies, line for line, once its
    "stored"/"not found"/... and our "not supported" are taken as the same outcome (and verbosity's OK,
    which both send, with them)."""
    with daemon.connect(timeout=10) as ours, socket.create_connection(("127.0.0.1", memcached), timeout=10) as theirs:
        for data in FRAMING:
            mine, reference = exchange(ours, data), exchange(theirs, data)
            mine, reference = (_VERSION.sub(b"VERSION <v>\r\n", r) for r in (mine, reference))
            assert _OUTCOME.sub(b"<outcome>\r\n", mine) == _OUTCOME.sub(b"<outcome>\r\n", reference), (
                data[:80],
                mine,
                reference,
            )


def read_to_close(sock: socket.socket) -> bytes | None:
    """What arrives until the peer closes, or None if it is still open after a second."""
    sock.settimeout(1.0)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    return data


@pytest.mark.parametrize("line", [b"quit", b"quit now", b"quit noreply"])
def test_quit_with_arguments_closes_as_memcached_does(daemon: Daemon, memcached: int, line: bytes) -> None:
    """memcached 1.6 (and go-katsubushi) close on ``quit now``, answering nothing, not even the
    ``version`` after it; a ``get`` before it is answered."""
    for port in (daemon.port, memcached):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"get a\r\n" + line + b"\r\nversion\r\n")
            reply = read_to_close(s)
            assert reply is not None, (port, line, "still open")
            assert reply.endswith(b"END\r\n") and b"VERSION" not in reply, (port, reply)


def test_a_huge_declared_length_is_discarded_in_bounded_memory(daemon: Daemon) -> None:
    """``set`` of a 2,000,000,000-byte value: memcached swallows it unread (too large for it); so do
    we, as it arrives, holding none of it."""
    rss_before = rss_kb(daemon.pid)
    with daemon.connect(timeout=30) as s:
        s.sendall(b"set k 0 0 2000000000\r\n")
        block = b"x" * 1_000_000
        started = time.monotonic()
        for _ in range(100):  # the first 100 MB of it
            s.sendall(block)
        assert rss_kb(daemon.pid) - rss_before < 10_000
        assert time.monotonic() - started < 60
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(100)  # nothing is answered before the block is over


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_client_that_shuts_down_its_side_still_gets_every_reply(
    daemons: DaemonFactory, short_tmp: Path, transport: str
) -> None:
    """``printf 'get ...' | nc``: the request, then end of input, then the replies are read. The
    daemon answers all of it (a budget at a time, as the client reads) before it closes."""
    path = str(short_tmp / "k.sock")
    daemon = daemons.start(port=None, sock=path) if transport == "unix" else daemons.start()
    keys = [b"key-%05d" % i for i in range(30_000)]
    with daemon.connect(timeout=20) as s:
        s.sendall(b"get " + b" ".join(keys) + b"\r\nversion\r\n")
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    values, version = reply.split(b"END\r\n")
    assert [k for k, _ in parse_values(values + b"END\r\n")] == keys
    assert version.startswith(b"VERSION ")


def test_read_ahead_is_a_setting(daemons: DaemonFactory) -> None:
    daemon = daemons.start("--read-ahead", "2m")
    with daemon.connect() as s:
        s.sendall(b"stats settings\r\n")
        assert b"STAT read_ahead 2097152\r\n" in recv_until(s, b"END\r\n")
    bad = daemons.start("--read-ahead", "lots", wait=False)
    assert bad.proc.wait(10) != 0
    assert "invalid read ahead 'lots'" in bad.stderr()


def test_sigterm_answers_the_requests_held_for_a_client_that_is_behind(daemons: DaemonFactory, short_tmp: Path) -> None:
    """A client behind with its replies when the daemon is told to stop: what it had sent, held
    unanswered meanwhile, is answered as it reads (within the stop's grace), then the connection closes."""
    path = str(short_tmp / "k.sock")
    daemon = daemons.start(port=None, sock=path)
    keys = [b"key-%05d" % i for i in range(30_000)]  # 1.2 MB of replies: far more than a unix socket holds
    with daemon.connect(timeout=10) as s:
        s.sendall(b"get " + b" ".join(keys) + b"\r\n")
        time.sleep(0.3)  # the daemon answers what the socket takes, and holds the rest
        os.kill(daemon.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # until the daemon has begun to stop: its listener is closed
            try:
                daemon.connect(timeout=1).close()
            except OSError:
                break
            time.sleep(0.01)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert [k for k, _ in parse_values(reply)] == keys
    assert daemon.proc.wait(5) == 0

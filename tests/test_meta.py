"""memcached's meta commands and ``stats <group>`` on the text front end: without sockets, against
the daemon, and beside a real memcached for the reply shapes."""

from __future__ import annotations

import itertools
import socket
from collections.abc import Iterator

import pytest
from conftest import Daemon, DaemonFactory, FakeClock, decode, memcached_server, recv_until

from katsubushi_py.frontends.text import MAX_LINE, TextConnection
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer


@pytest.fixture
def conn(clock: FakeClock) -> TextConnection:
    return TextConnection(Issuer(Generator(5, clock=clock), "1.0.0"))


def meta_ids(reply: bytes) -> list[int]:
    """The IDs in a reply made of VA blocks (and other lines), checking each block's length."""
    lines = reply.split(b"\r\n")
    assert lines[-1] == b"", reply
    ids = []
    for header, value in itertools.pairwise(lines):
        if header.startswith(b"VA "):
            assert int(header.split()[1]) == len(value), reply
            ids.append(int(value))
    return ids


# -- without sockets -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"mg k", b"HD"),
        (b"mg k v", b"VA 19"),
        (b"mg k v k", b"VA 19 kk"),
        (b"mg k k v", b"VA 19 kk"),
        (b"mg k v O123 k f s", b"VA 19 O123 kk f0 s19"),
        (b"mg k s v f", b"VA 19 s19 f0"),
        (b"mg k k O", b"HD kk O"),
        (b"mg k q", b"HD"),
        (b"mg k v q", b"VA 19"),
        (b"mg k t h l u", b"HD t-1 h0 l0"),
        (b"mg k N30 R30 T30 P L v", b"VA 19"),
        (b"mg aw== b k v", b"VA 19 kaw== b"),
        (b"mg " + b"x" * 250 + b" k", b"HD k" + b"x" * 250),
        (b"mg k O" + b"o" * 31, b"HD O" + b"o" * 31),
    ],
)
def test_mg_answers_one_fresh_id_with_the_flags_asked_for(conn: TextConnection, line: bytes, expected: bytes) -> None:
    reply = conn.receive(line + b"\r\n")
    head, rest = reply.split(b"\r\n", 1)
    assert head == expected
    if head.startswith(b"VA"):
        [id_] = meta_ids(reply)
        assert decode(id_)[1] == 5
    else:
        assert rest == b""
    counters = conn._issuer.counters("meta")
    assert (counters.commands, counters.ids) == (1, 1)
    assert conn._issuer.counters("text").commands == 0


def test_mg_c_returns_the_id_itself(conn: TextConnection) -> None:
    head, value, _ = conn.receive(b"mg k v c\r\n").split(b"\r\n")
    assert head == b"VA 19 c" + value


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (b"mg", b"ERROR"),
        (b"MG k v", b"ERROR"),
        (b"Mg k v", b"ERROR"),
        (b"MN", b"ERROR"),
        (b"mg k x", b"CLIENT_ERROR invalid flag"),
        (b"mg k 5 v", b"CLIENT_ERROR invalid flag"),
        (b"mg k E5 v", b"CLIENT_ERROR invalid flag"),
        (b"mg k v v", b"CLIENT_ERROR duplicate flag"),
        (b"mg k O" + b"o" * 32, b"CLIENT_ERROR opaque token too long"),
        (b"mg " + b"x" * 251 + b" v", b"CLIENT_ERROR bad command line format"),
        (b"mg k v b", b"CLIENT_ERROR error decoding key"),
        (b"md k", b"CLIENT_ERROR md is not supported: this server only issues IDs"),
        (b"ma k v", b"CLIENT_ERROR ma is not supported: this server only issues IDs"),
        (b"me k", b"CLIENT_ERROR me is not supported: this server only issues IDs"),
        (b"md", b"ERROR"),
        (b"ms k", b"CLIENT_ERROR bad command line format"),
    ],
)
def test_meta_errors_take_no_id_and_keep_the_connection(conn: TextConnection, line: bytes, error: bytes) -> None:
    reply = conn.receive(line + b"\r\nmn\r\n")
    assert reply == error + b"\r\nMN\r\n"
    assert conn._issuer.totals() == (0, 0, 0) and not conn.closing


def test_quiet_mg_pipeline_ended_by_mn_is_a_multi_get(conn: TextConnection) -> None:
    keys = [b"key%d" % i for i in range(50)]
    reply = conn.receive(b"".join(b"mg %b v k q O%d\r\n" % (k, i) for i, k in enumerate(keys)) + b"mn\r\n")
    assert reply.endswith(b"MN\r\n")
    heads = [line for line in reply.split(b"\r\n") if line.startswith(b"VA ")]
    assert heads == [b"VA 19 k%b O%d" % (k, i) for i, k in enumerate(keys)]
    ids = meta_ids(reply)
    assert len(ids) == 50 and all(a < b for a, b in itertools.pairwise(ids))


def test_ms_data_block_is_skipped_even_split_across_reads(conn: TextConnection) -> None:
    not_supported = b"CLIENT_ERROR ms is not supported: this server only issues IDs\r\n"
    assert conn.receive(b"ms k 6 T0\r\nmg x") == b""  # the block is still to come
    assert conn.receive(b" v") == b""  # looks like a command, but it is the block's bytes
    reply = conn.receive(b"\r\nmn\r\nms k 0\r\n\r\nmn\r\n")
    assert reply == not_supported + b"MN\r\n" + not_supported + b"MN\r\n"
    assert conn._buffer == b"" and conn._issuer.totals() == (0, 0, 0)


def test_ms_block_larger_than_a_line_is_skipped_as_it_arrives(conn: TextConnection) -> None:
    """Before, a block longer than a line was skipped when it came in one read, and closed the
    connection when it did not; now it is discarded as it arrives, however it is split, never held."""
    not_supported = b"CLIENT_ERROR ms is not supported: this server only issues IDs\r\n"
    assert conn.receive(b"mn\r\nms k %d\r\nabc" % (2 * MAX_LINE)) == b"MN\r\n"
    for _ in range(2 * MAX_LINE // 1000):
        assert conn.receive(b"x" * 1000) == b"" and conn._buffer == b""
    rest = 2 * MAX_LINE - 3 - 2 * MAX_LINE // 1000 * 1000
    assert conn.receive(b"y" * rest + b"\r\nmn\r\n") == not_supported + b"MN\r\n"
    assert not conn.closing


def test_mg_generation_failure_is_server_error(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    conn = TextConnection(Issuer(gen, "1"))
    conn.receive(b"mg a v\r\n")
    clock.step_wall_ms(-10_000)
    gen.reanchor()
    reply = conn.receive(b"mg a v k\r\nmn\r\n")
    assert reply == b"SERVER_ERROR clock moved backwards by 10000 ms (more than the 1000 ms we may wait)\r\nMN\r\n"
    assert conn._issuer.counters("meta").failures == {"clock_backwards": 1}


def test_mg_waiting_for_the_clock_is_deferred_in_order(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    conn = TextConnection(Issuer(gen, "1"))
    [first] = meta_ids(conn.receive(b"mg a v\r\n"))
    clock.step_wall_ms(-200)
    gen.reanchor()
    assert conn.receive(b"mn\r\nmg b v k\r\nget c\r\nmn\r\n") == b"MN\r\n"
    assert conn.wait > 0.19
    clock.advance_ms(201)
    rest = conn.resume()
    assert rest.startswith(b"VA 19 kb\r\n") and b"VALUE c 0 19\r\n" in rest and rest.endswith(b"END\r\nMN\r\n")
    [second] = meta_ids(rest)
    assert second > first
    assert (conn._issuer.counters("meta").commands, conn._issuer.counters("text").commands) == (2, 1)


def test_stats_groups(conn: TextConnection) -> None:
    general = conn.receive(b"stats\r\n")
    assert general.startswith(b"STAT version 1.0.0\r\n") and general.endswith(b"END\r\n")
    assert conn.receive(b"STATS settings\r\n") == b"STAT layout 41/10/12\r\nSTAT epoch_ms 1420070400000\r\nEND\r\n"
    for group in (b"items", b"slabs", b"sizes", b"conns", b"ITEMS"):  # memcached's, with nothing to say here
        assert conn.receive(b"stats " + group + b"\r\n") == b"END\r\n"
    # memcached 1.6 answers ERROR for a group it does not have (Cache::Memcached's "malloc" among them,
    # which it takes as an empty group), and for stats noreply
    for group in (b"malloc", b"noreply", b"nosuchgroup", b"detail dump", b"reset"):
        assert conn.receive(b"stats " + group + b"\r\n") == b"ERROR\r\n"


# -- against the daemon, beside a real memcached -------------------------------------------------

VALUE = b"1574026156804435968"  # 19 digits, as long as today's IDs
LONG_KEY = b"x" * 250


@pytest.fixture
def memcached() -> Iterator[int]:
    with memcached_server() as port:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            for key in (b"k", LONG_KEY):
                s.sendall(b"set %b 0 0 19\r\n%b\r\n" % (key, VALUE))
                assert recv_until(s, b"\r\n") == b"STORED\r\n"
        yield port


def exchange(sock: socket.socket, line: bytes) -> bytes:
    """The reply to ``line``, delimited by a ``version`` sent after it."""
    sock.sendall(line + b"\r\nversion\r\n")
    reply = b""
    while not reply.endswith(b"\r\n") or not reply.rsplit(b"\r\n", 2)[-2].startswith(b"VERSION "):
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    return reply[: reply.rindex(b"VERSION ")]


def shape(reply: bytes) -> list[list[bytes]]:
    """A reply's lines as tokens, with what differs between an ID and a stored item blanked: the
    value itself and the values of c (CAS), h (hit before) and l (last access)."""
    out = []
    lines = reply.split(b"\r\n")
    assert lines[-1] == b"", reply
    skip_value = False
    for line in lines[:-1]:
        if skip_value:
            out.append([b"<value>"])
            skip_value = False
            continue
        tokens = line.split(b" ")
        skip_value = tokens[0] == b"VA"
        out.append([t[:1] if t[:1] in (b"c", b"h", b"l") and tokens[0] in (b"VA", b"HD") else t for t in tokens])
    return out


MG_LINES = [
    b"mg k",
    b"mg k v",
    b"mg k v k",
    b"mg k k v",
    b"mg k v O123 k f s",
    b"mg k s v f",
    b"mg k q",
    b"mg k v q",
    b"mg k c",
    b"mg k t",
    b"mg k h",
    b"mg k l",
    b"mg k u",
    b"mg k v c t h l s",
    b"mg k N30 v",
    b"mg k T30 v",
    b"mg k R30 v",
    b"mg k P L v",
    b"mg k O v",
    b"mg k O" + b"o" * 31 + b" v",
    b"mg k O" + b"o" * 32 + b" v",
    b"mg k x",
    b"mg k Z",
    b"mg k v v",
    b"mg k 5 v",
    b"mg k v b",
    b"mg aw== b v",
    b"mg",
    b"mg " + LONG_KEY + b" v k",
    b"mg " + LONG_KEY + b"x v",
    b"MG k v",
    b"mn",
    b"mn x",
    b"MN",
    b"mg k q v k O1\r\nmg k q v k O2",
]


def test_meta_reply_shapes_match_memcached(daemon: Daemon, memcached: int) -> None:
    with daemon.connect() as ours, socket.create_connection(("127.0.0.1", memcached), timeout=5) as theirs:
        for line in MG_LINES:
            mine, reference = exchange(ours, line), exchange(theirs, line)
            assert shape(mine) == shape(reference), (line, mine, reference)
        # What memcached returns for c, h and l, ours in the same positions: the ID as CAS, a fresh
        # item never hit, last accessed 0 s ago.
        head, value, _ = exchange(ours, b"mg k v c h l").split(b"\r\n")
        assert head == b"VA 19 c%b h0 l0" % value
        ids = [i for line in MG_LINES for i in meta_ids(exchange(ours, line.split(b"\r\n")[0]))]
    assert len(ids) == len(set(ids)) > 10
    assert all(decode(i)[1] == 7 for i in ids)


@pytest.mark.parametrize(
    "request_bytes",
    [b"ms k 2 T0\r\nab", b"ms k 0\r\n", b"ms k 5 F3 T0\r\nmn\r\nx", b"md k O9", b"me k", b"ma k O9"],
)
def test_unsupported_meta_commands_answer_one_line_like_memcached_and_keep_the_stream_in_step(
    daemon: Daemon, memcached: int, request_bytes: bytes
) -> None:
    with daemon.connect() as ours, socket.create_connection(("127.0.0.1", memcached), timeout=5) as theirs:
        mine, reference = exchange(ours, request_bytes), exchange(theirs, request_bytes)
        assert reference.count(b"\r\n") == mine.count(b"\r\n") == 1, (mine, reference)
        assert mine.startswith(b"CLIENT_ERROR " + request_bytes[:2] + b" is not supported")
        assert meta_ids(exchange(ours, b"mg after v"))  # still usable


def test_stats_groups_on_the_daemon(daemons: DaemonFactory) -> None:
    d = daemons.start("--max-connections", "77", "--idle-timeout", "5s", worker_id=3)
    with d.connect() as s:
        s.sendall(b"stats settings\r\n")
        lines = recv_until(s, b"END\r\n").decode().split("\r\n")[:-2]
        settings = {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines}
        assert settings["maxconns"] == "77" and settings["idle_timeout"] == "5"
        assert settings["tcpport"] == str(d.port) and settings["inter"] == "127.0.0.1"
        assert settings["domain_socket"] == "NULL" and settings["layout"] == "41/10/12"
        assert all(" " not in value for value in settings.values())
        for group in (b"items", b"slabs"):
            s.sendall(b"stats " + group + b"\r\n")
            assert recv_until(s, b"END\r\n") == b"END\r\n"
        s.sendall(b"stats malloc\r\n")
        assert recv_until(s, b"\r\n") == b"ERROR\r\n"
        s.sendall(b"stats\r\n")
        general = recv_until(s, b"END\r\n")
        assert general.startswith(b"STAT pid %d\r\n" % d.pid) and b"STAT worker_id 3\r\n" in general

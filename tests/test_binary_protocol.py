"""The memcached binary protocol without sockets: bytes in, bytes out."""

from __future__ import annotations

import itertools

import pytest
from binary_packets import (
    ADD,
    APPEND,
    DECREMENT,
    DELETE,
    FLUSH,
    GAT,
    GET,
    GETK,
    GETKQ,
    GETQ,
    HEADER,
    INCREMENT,
    INTERNAL_ERROR,
    INVALID_ARGUMENTS,
    NOOP,
    NOT_SUPPORTED,
    PREPEND,
    QUIT,
    QUITQ,
    REPLACE,
    SET,
    SETQ,
    STAT,
    SUCCESS,
    TEMPORARY_FAILURE,
    TOUCH,
    UNKNOWN_COMMAND,
    VERBOSITY,
    VERSION,
    id_of,
    parse_all,
    request,
)
from conftest import FAKE_START_MS, FakeClock, decode

from katsubushi_py.daemon.stats import Stats
from katsubushi_py.frontends.binary import MAX_BODY, BinaryConnection
from katsubushi_py.frontends.fastpath import REPLY_BUDGET
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer


def make_issuer(generator: Generator, version: str = "1.2.3") -> Issuer:
    """An issuer with the daemon's STATS fields, as the daemon wires them."""
    issuer = Issuer(generator, version)
    issuer.stats_fields = Stats(issuer).fields
    return issuer


@pytest.fixture
def conn(clock: FakeClock) -> BinaryConnection:
    return BinaryConnection(make_issuer(Generator(9, clock=clock)))


def test_get_is_byte_for_byte_what_go_katsubushi_sends(conn: BinaryConnection) -> None:
    # From the transcript: GET key=Hello opaque=deadbeef.
    reply = conn.receive(bytes.fromhex("80 00 00 05 00 00 00 00 00 00 00 05 de ad be ef") + b"\0" * 8 + b"Hello")
    head = bytes.fromhex("81 00 00 00 04 00 00 00 00 00 00 17 de ad be ef") + b"\0" * 8 + b"\0\0\0\0"
    assert reply[:28] == head and len(reply) == 28 + 19
    assert decode(int(reply[28:])) == (FAKE_START_MS, 9, 0)
    assert not conn.closing and conn.activity == 1


@pytest.mark.parametrize("opcode", [GET, GETQ, GETK, GETKQ])
@pytest.mark.parametrize("key", [b"", b"k", b"\x00\xff key \r\n", b"x" * 250])
def test_every_get_opcode_issues_one_id_and_echoes_the_key_only_for_k(
    conn: BinaryConnection, opcode: int, key: bytes
) -> None:
    [packet] = parse_all(conn.receive(request(opcode, key, opaque=0xFFFFFFFE)))
    assert (packet.opcode, packet.status, packet.opaque, packet.cas) == (opcode, SUCCESS, 0xFFFFFFFE, 0)
    assert packet.key == (key if opcode in (GETK, GETKQ) else b"")
    assert decode(id_of(packet))[1] == 9


def test_quiet_getkq_then_noop_is_a_multi_get_in_one_reply(conn: BinaryConnection) -> None:
    keys = [b"k%d" % i for i in range(100)]
    stream = b"".join(request(GETKQ, k, opaque=i) for i, k in enumerate(keys)) + request(NOOP, opaque=12345)
    packets = parse_all(conn.receive(stream))
    assert len(packets) == 101 and conn.activity == 101
    assert [p.key for p in packets[:100]] == keys and [p.opaque for p in packets[:100]] == list(range(100))
    ids = [id_of(p) for p in packets[:100]]
    assert all(a < b for a, b in itertools.pairwise(ids))
    noop = packets[100]
    assert (noop.opcode, noop.status, noop.opaque, noop.key, noop.value) == (NOOP, SUCCESS, 12345, b"", b"")
    counters = conn._issuer.counters("binary")
    assert (counters.commands, counters.ids, counters.failures) == (100, 100, {})
    assert conn._issuer.counters("text").commands == 0


def test_version(conn: BinaryConnection) -> None:
    [packet] = parse_all(conn.receive(request(VERSION, opaque=0x01020304)))
    assert (packet.opcode, packet.status, packet.opaque, packet.value) == (VERSION, SUCCESS, 0x01020304, b"1.2.3")


def test_stat_has_the_text_stats_fields_in_order_then_a_terminator(clock: FakeClock) -> None:
    issuer = make_issuer(Generator(9, clock=clock))
    conn = BinaryConnection(issuer)
    conn.receive(request(GET) + request(GETK, b"a"))
    packets = parse_all(conn.receive(request(STAT, opaque=0x0A0B0C0D)))
    assert all(p.opcode == STAT and p.status == SUCCESS and p.opaque == 0x0A0B0C0D for p in packets)
    assert packets[-1].key == packets[-1].value == b""
    text_lines = TextConnection(issuer).receive(b"stats\r\n").decode().split("\r\n")[:-2]
    text_fields = [line.split(" ", 2)[1:] for line in text_lines]
    binary_fields = [[p.key.decode(), p.value.decode()] for p in packets[:-1]]
    assert [name for name, _ in binary_fields] == [name for name, _ in text_fields]
    assert [name for name, _ in binary_fields[:9]] == [
        "pid",
        "uptime",
        "time",
        "version",
        "curr_connections",
        "total_connections",
        "cmd_get",
        "get_hits",
        "get_misses",
    ]
    fields = dict(binary_fields)
    assert fields["cmd_get"] == "2" and fields["get_hits"] == "2" and fields["version"] == "1.2.3"


def test_stat_groups(conn: BinaryConnection) -> None:
    settings = parse_all(conn.receive(request(STAT, b"settings", opaque=5)))
    assert [(p.key, p.value) for p in settings] == [
        (b"layout", b"41/10/12"),
        (b"epoch_ms", b"1420070400000"),
        (b"", b""),
    ]
    for group in (b"items", b"slabs", b"sizes", b"conns"):
        [terminator] = parse_all(conn.receive(request(STAT, group, opaque=6)))
        assert (terminator.opcode, terminator.status, terminator.opaque, terminator.key) == (STAT, SUCCESS, 6, b"")
    for group in (b"malloc", b"nosuchgroup", b"reset"):  # as memcached answers a group it does not have
        [missing] = parse_all(conn.receive(request(STAT, group, opaque=7)))
        assert (missing.opcode, missing.status, missing.opaque, missing.value) == (STAT, 0x0001, 7, b"Not found")


def test_quit_answers_then_closes_and_drops_what_follows(conn: BinaryConnection) -> None:
    packets = parse_all(conn.receive(request(GET, opaque=1) + request(QUIT, opaque=2) + request(GET, opaque=3)))
    assert [(p.opcode, p.opaque) for p in packets] == [(GET, 1), (QUIT, 2)]
    assert packets[1].status == SUCCESS and packets[1].value == b""
    assert conn.closing
    assert conn.receive(request(GET)) == b""


def test_quitq_closes_without_an_answer(conn: BinaryConnection) -> None:
    assert conn.receive(request(QUITQ, opaque=2)) == b""
    assert conn.closing


@pytest.mark.parametrize("opcode", [0x1F, 0x20, 0x21, 0x50, 0x89, 0xFF])
def test_unknown_opcode_is_0x81_with_the_opaque_and_the_connection_stays(conn: BinaryConnection, opcode: int) -> None:
    packets = parse_all(conn.receive(request(opcode, b"key", opaque=0xCAFE, extras=b"xx", value=b"v") + request(GET)))
    assert (packets[0].opcode, packets[0].status, packets[0].opaque) == (opcode, UNKNOWN_COMMAND, 0xCAFE)
    assert packets[0].value == b"Unknown command" and packets[0].key == b""
    assert id_of(packets[1]) and not conn.closing


@pytest.mark.parametrize(
    ("opcode", "extras", "name"),
    [
        (SET, b"\0" * 8, "SET"),
        (ADD, b"\0" * 8, "ADD"),
        (REPLACE, b"\0" * 8, "REPLACE"),
        (DELETE, b"", "DELETE"),
        (INCREMENT, b"\0" * 20, "INCREMENT"),
        (DECREMENT, b"\0" * 20, "DECREMENT"),
        (FLUSH, b"", "FLUSH"),
        (APPEND, b"", "APPEND"),
        (PREPEND, b"", "PREPEND"),
        (SETQ, b"\0" * 8, "SETQ"),
        (VERBOSITY, b"\0" * 4, "VERBOSITY"),
        (TOUCH, b"\0" * 4, "TOUCH"),
        (GAT, b"\0" * 4, "GAT"),
    ],
)
def test_storage_and_arithmetic_opcodes_are_not_supported(
    conn: BinaryConnection, opcode: int, extras: bytes, name: str
) -> None:
    stream = request(opcode, b"key", opaque=77, extras=extras, value=b"some value") + request(GETK, b"after", opaque=78)
    packets = parse_all(conn.receive(stream))
    assert (packets[0].opcode, packets[0].status, packets[0].opaque) == (opcode, NOT_SUPPORTED, 77)
    assert packets[0].value == f"{name} is not supported: this server only issues IDs".encode()
    assert packets[1].key == b"after" and id_of(packets[1])
    assert conn._issuer.counters("binary").commands == 1  # only the GETK asked for an ID


def test_largest_body_is_still_read_and_answered(conn: BinaryConnection) -> None:
    value = b"v" * (MAX_BODY - 8 - 3)
    packets = parse_all(conn.receive(request(SET, b"key", extras=b"\0" * 8, value=value) + request(GET)))
    assert packets[0].status == NOT_SUPPORTED and id_of(packets[1])


def behind(gen: Generator, clock: FakeClock, ms: int) -> None:
    clock.step_wall_ms(-ms)
    gen.reanchor()


def test_generation_failure_is_a_binary_error_status_for_that_request_only(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    conn = BinaryConnection(make_issuer(gen))
    first = id_of(parse_all(conn.receive(request(GET)))[0])
    behind(gen, clock, 10_000)
    stream = b"".join(request(GETKQ, b"k%d" % i, opaque=i) for i in range(3)) + request(NOOP, opaque=9)
    reply = conn.receive(stream)
    assert b"ERROR" not in reply  # never text in a binary stream
    packets = parse_all(reply)
    assert [(p.opcode, p.status, p.opaque) for p in packets] == [
        (GETKQ, TEMPORARY_FAILURE, 0),
        (GETKQ, TEMPORARY_FAILURE, 1),
        (GETKQ, TEMPORARY_FAILURE, 2),
        (NOOP, SUCCESS, 9),
    ]
    message = b"clock moved backwards by 10000 ms (more than the 1000 ms we may wait)"
    assert all(p.value == message and p.key == b"" and p.extras == b"" for p in packets[:3])
    assert conn._issuer.counters("binary").failures == {"clock_backwards": 3}
    clock.advance_ms(10_001)
    assert id_of(parse_all(conn.receive(request(GET)))[0]) > first
    assert not conn.closing


def test_unexpected_error_is_an_internal_error_status(clock: FakeClock) -> None:
    issuer = make_issuer(Generator(1, clock=clock))

    def broken() -> int:
        raise RuntimeError("boom")

    issuer.next_id = broken  # type: ignore[method-assign]
    conn = BinaryConnection(issuer)
    [packet] = parse_all(conn.receive(request(GETK, b"k", opaque=4)))
    assert (packet.status, packet.opaque) == (INTERNAL_ERROR, 4)
    assert packet.value == b"internal error (RuntimeError); see the daemon's log"


def test_clock_wait_defers_the_request_and_keeps_the_order(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    conn = BinaryConnection(make_issuer(gen))
    first = id_of(parse_all(conn.receive(request(GET)))[0])
    behind(gen, clock, 200)
    reply = conn.receive(request(VERSION, opaque=1) + request(GET, opaque=2) + request(GETKQ, b"c", opaque=3))
    assert [p.opaque for p in parse_all(reply)] == [1]  # answered up to the request that waits
    assert 0.19 < conn.wait <= 0.201
    assert conn.receive(request(NOOP, opaque=4)) == b""  # arrives while waiting: kept, in order
    assert conn.resume() == b"" and conn.wait > 0  # too early: still waiting
    clock.advance_ms(201)
    packets = parse_all(conn.resume())
    assert conn.wait == 0
    assert [(p.opcode, p.opaque) for p in packets] == [(GET, 2), (GETKQ, 3), (NOOP, 4)]
    ids = [id_of(p) for p in packets[:2]]
    assert first < ids[0] < ids[1]
    assert conn.activity == 5
    assert conn._issuer.counters("binary").commands == 3  # a waiting request is counted once, when answered


def test_bad_magic_closes_after_answering_what_came_before(conn: BinaryConnection) -> None:
    bad = b"\x82" + request(GET)[1:]
    packets = parse_all(conn.receive(request(GET, opaque=1) + bad + request(GET, opaque=3)))
    assert [p.opaque for p in packets] == [1]
    assert conn.closing and conn.receive(request(GET)) == b""


@pytest.mark.parametrize("first", [b"\x00", b"\x81", b"G"])
def test_bad_magic_in_a_short_read_closes_at_once(conn: BinaryConnection, first: bytes) -> None:
    conn.receive(request(GET))
    assert conn.receive(first) == b""
    assert conn.closing


@pytest.mark.parametrize(
    ("keylen", "extlen", "bodylen"),
    [
        (0, 0, 2**32 - 1),  # go-katsubushi would allocate 4 GiB for this
        (0, 0, MAX_BODY + 1),
        (251, 0, 251),  # memcached's key limit
        (5, 4, 8),  # key and extras longer than the body
    ],
)
def test_oversized_or_inconsistent_lengths_close_without_reading_the_body(
    conn: BinaryConnection, keylen: int, extlen: int, bodylen: int
) -> None:
    header = HEADER.pack(0x80, GET, keylen, extlen, 0, 0, bodylen, 0xABCD, 0)
    packets = parse_all(conn.receive(request(GET, opaque=1) + header + b"x" * 100))
    assert [(p.opaque, p.status) for p in packets] == [(1, SUCCESS), (0xABCD, INVALID_ARGUMENTS)]
    assert packets[1].value == b"Invalid arguments"
    assert conn.closing and conn._buffer == b""
    assert conn.receive(b"x" * 100_000) == b"" and conn._buffer == b""


def test_a_request_dribbled_one_byte_at_a_time(conn: BinaryConnection) -> None:
    stream = request(GETK, b"dribble", opaque=7)
    for byte in stream[:-1]:
        assert conn.receive(bytes([byte])) == b""
    assert conn.activity == 0
    [packet] = parse_all(conn.receive(stream[-1:]))
    assert (packet.key, packet.opaque) == (b"dribble", 7) and id_of(packet)
    assert conn.activity == 1 and conn._buffer == b""


def test_every_split_of_a_pipelined_stream_gives_the_same_answers(clock: FakeClock) -> None:
    stream = request(GETK, b"a", opaque=1) + request(STAT, b"items", opaque=2) + request(GETKQ, b"b", opaque=3)
    stream += request(SET, b"c", opaque=4, extras=b"\0" * 8, value=b"xyz") + request(NOOP, opaque=5)
    expected = [(GETK, 1, b"a"), (STAT, 2, b""), (GETKQ, 3, b"b"), (SET, 4, b""), (NOOP, 5, b"")]
    for cut1, cut2 in itertools.combinations(range(1, len(stream)), 2):
        conn = BinaryConnection(make_issuer(Generator(1, clock=clock)))
        reply = conn.receive(stream[:cut1]) + conn.receive(stream[cut1:cut2]) + conn.receive(stream[cut2:])
        assert [(p.opcode, p.opaque, p.key) for p in parse_all(reply)] == expected, (cut1, cut2)


def test_ids_of_other_lengths_are_framed_by_their_length(clock: FakeClock) -> None:
    """A layout with a recent epoch makes IDs shorter than today's 19 digits."""
    layout = Layout(epoch_ms=FAKE_START_MS - 1000, now_ms=FAKE_START_MS)
    conn = BinaryConnection(make_issuer(Generator(3, layout, clock=clock)))
    [alone] = parse_all(conn.receive(request(GET, opaque=1)))
    run = parse_all(conn.receive(request(GETKQ, b"a", opaque=2) + request(GET, opaque=3) + request(NOOP)))
    ids = [id_of(alone), id_of(run[0]), id_of(run[1])]
    assert all(len(str(i)) < 19 for i in ids) and ids == sorted(ids)
    assert [(p.opaque, p.key) for p in run] == [(2, b"a"), (3, b""), (0, b"")]
    assert [layout.decompose(i).worker_id for i in ids] == [3, 3, 3]


def test_a_storage_request_of_any_size_is_answered_and_its_body_discarded_as_it_arrives(
    conn: BinaryConnection,
) -> None:
    """memcached reads and discards the value of a SET it refuses; so do we, holding none of it."""
    value = b"v" * 1_000_000
    stream = request(SET, b"key", opaque=5, extras=b"\0" * 8, value=value) + request(GETK, b"after", opaque=6)
    replies = [conn.receive(stream[:30])]  # the header and a little of the body: answered now
    assert parse_all(replies[0])[0].status == NOT_SUPPORTED
    for i in range(30, len(stream), 65536):
        replies.append(conn.receive(stream[i : i + 65536]))
        assert len(conn._buffer) < 100  # nothing of the value is held
    packets = parse_all(b"".join(replies))
    assert [(p.opcode, p.status, p.opaque) for p in packets] == [(SET, NOT_SUPPORTED, 5), (GETK, SUCCESS, 6)]
    assert packets[1].key == b"after" and id_of(packets[1]) and not conn.closing


def test_a_value_over_memcacheds_limit_is_invalid_arguments_and_closes(conn: BinaryConnection) -> None:
    header = HEADER.pack(0x80, SET, 3, 8, 0, 0, 3 + 8 + 2**31 - 2, 0xAB, 0)
    [packet] = parse_all(conn.receive(header + b"\0" * 8 + b"key"))
    assert (packet.opcode, packet.status, packet.opaque) == (SET, INVALID_ARGUMENTS, 0xAB)
    assert conn.closing and conn._buffer == b""


def test_stat_replies_are_made_a_budget_at_a_time(conn: BinaryConnection) -> None:
    """A STAT of 24 bytes answers more than a kilobyte: one read of 1,000 of them stops once its reply
    reaches the budget, holds the rest, and resume carries on (gets are never cut short: their replies
    are never more than twice their requests)."""
    reply = conn.receive(request(STAT, opaque=1) * 1000 + request(NOOP, opaque=2))
    sizes = [len(reply)]
    while conn.backlog:
        part = conn.resume()
        sizes.append(len(part))
        reply += part
    packets = parse_all(reply)
    assert sum(1 for p in packets if p.opcode == STAT and not p.key) == 1000 and packets[-1].opcode == NOOP
    assert len(sizes) > 5 and max(sizes) < REPLY_BUDGET + 4096


def test_a_quiet_multi_get_of_100000_keys_streams(clock: FakeClock) -> None:
    conn = BinaryConnection(make_issuer(Generator(9, clock=clock)))
    stream = b"".join(request(GETKQ, b"key-%06d" % i, opaque=i) for i in range(100_000)) + request(NOOP, opaque=7)
    reply = b""
    held = 0
    for i in range(0, len(stream), 262_144):  # as the socket transport reads
        reply += conn.receive(stream[i : i + 262_144])
        while conn.backlog:
            reply += conn.resume()
        held = max(held, len(conn._buffer))
    packets = parse_all(reply)
    assert len(packets) == 100_001 and packets[-1].opcode == NOOP
    ids = [id_of(p) for p in packets[:-1]]
    assert len(set(ids)) == 100_000 and ids == sorted(ids)
    assert [p.opaque for p in packets[:-1]] == list(range(100_000))
    assert held < 24 + 250  # at most one incomplete request between reads

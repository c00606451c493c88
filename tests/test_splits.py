"""A reply never depends on how its request was split into reads, and the compiled cores answer
exactly as their pure-Python twins do: requests of both memcached protocols fed whole, split at every
byte boundary, a byte at a time and at random (tests/twins.py). Among them the two divergences an
outside fuzzing pass found (issue 23), kept as regressions."""

from __future__ import annotations

import pytest
from binary_packets import (
    GET,
    GETK,
    GETKQ,
    GETQ,
    HEADER,
    INVALID_ARGUMENTS,
    NOOP,
    NOT_SUPPORTED,
    QUIT,
    SET,
    STAT,
    SUCCESS,
    VERSION,
    parse_all,
    request,
)
from twins import check_splits, mask_ids

from katsubushi_py.frontends.text import MAX_LINE

LONG_KEY = b"k" * 251

TEXT = {
    "gets": b"get a b c\r\nGET d\r\ngets e f\r\nGeT g\r\n",
    "no keys": b"get\r\nget   \r\nget \t\r\n",
    "mixed": b"get a b\r\nset k 0 0 3\r\nabc\r\nmg x v k O1\r\nmn\r\nstats items\r\nverbosity 1\r\nversion\r\n"
    b"get a " + LONG_KEY + b" z\r\nms k 5 T0\r\nhello\r\nmn\r\nset k 0 0 3 noreply\r\nabcd\r\nget q\r\n"
    b"incr a 1\r\n   \r\nstats nosuchgroup\r\nquit\r\nget never\r\n",
    "storage": b"set a 0 0 1\r\nx\r\nadd b 0 0 2 noreply\r\nxy\r\ncas c 0 0 1 5\r\nz\r\nreplace d 0 0 0\r\n\r\n"
    b"append e 0 0 3\r\nabcde\r\nprepend f 1 2 3 noreply\r\nab\r\nmn\r\nset g 0 0 -1\r\nmn\r\n",
    "batches": b"get " + b" ".join(b"k%d" % i for i in range(140)) + b"\r\nmn\r\n",  # over one batch of 128
    "long key at a batch's edge": b"get " + b" ".join([b"k"] * 127 + [LONG_KEY]) + b" x\r\nmn\r\n",
}


@pytest.mark.parametrize("name", list(TEXT))
def test_text_requests_split_every_way(name: str) -> None:
    check_splits("text", TEXT[name])


def test_replies_made_a_budget_at_a_time_split_at_random() -> None:
    whole = check_splits("text", b"stats\r\n" * 150 + b"mn\r\n", every=False, seed=5)  # 80 KB of replies
    assert whole.reply.count(b"END\r\n") == 150 and whole.reply.endswith(b"MN\r\n")
    whole = check_splits("binary", request(STAT, opaque=9) * 150 + request(NOOP), every=False, seed=6)
    assert parse_all(whole.reply)[-1].opcode == NOOP


def test_gets_with_cas_split_every_way() -> None:
    whole = check_splits(
        "text", b"gets a b\r\ngets " + b" ".join(b"k%d" % i for i in range(140)) + b"\r\n", gets_cas=True
    )
    assert whole.reply.count(b"VALUE") == 142 and whole.reply.endswith(b"END\r\n")


def test_long_text_requests_split_at_random() -> None:
    line = b"get " + b" ".join(b"key-%05d" % i for i in range(8000)) + b"\r\nmn\r\n"  # an 80 KB line
    whole = check_splits("text", line, every=False, seed=1)
    assert whole.reply.count(b"VALUE ") == 8000 and whole.reply.endswith(b"END\r\nMN\r\n")


def test_regression_ms_block_longer_than_a_line() -> None:
    """Issue 23: an ms data block longer than the line limit was skipped when it came in one read
    and closed the connection when it did not (in both implementations)."""
    data = b"mn\r\nms k %d T0\r\n" % (MAX_LINE + 10) + b"x" * (MAX_LINE + 10) + b"\r\nmn\r\n"
    whole = check_splits("text", data, every=False, seed=2)
    assert whole.reply == b"MN\r\nCLIENT_ERROR ms is not supported: this server only issues IDs\r\nMN\r\n"
    assert not whole.closing


BINARY = {
    "gets": request(GET, opaque=1)
    + request(GETK, b"a", opaque=2)
    + request(GETQ, b"b", opaque=3)
    + request(GETKQ, b"c", opaque=4, extras=b"\0\0\0\0")
    + request(NOOP, opaque=5),
    "mixed": request(VERSION, opaque=1)
    + request(STAT, b"settings", opaque=2)
    + request(SET, b"k", opaque=3, extras=b"\0" * 8, value=b"v" * 100)
    + request(0x42, b"x", opaque=4, value=b"y")
    + request(GETKQ, b"k" * 250, opaque=5)
    + request(NOOP, opaque=6)
    + request(QUIT, opaque=7)
    + request(GET, opaque=8),
    "bad length": request(GETK, b"a", opaque=1) + HEADER.pack(0x80, GETK, 251, 0, 0, 0, 251, 2, 0) + b"k" * 251,
    "bad magic": request(GET, opaque=1) + b"\x81" + request(GET)[1:],
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_requests_split_every_way(name: str) -> None:
    check_splits("binary", BINARY[name])


def test_regression_binary_get_with_a_body_over_4096_bytes() -> None:
    """Issue 23: a GET whose body is over 4,096 bytes got an ID when it arrived in one read, and
    "Invalid arguments" and a close when split (the one-GET shortcut skipped the size check)."""
    data = request(GET, b"k", opaque=0xBEEF, value=b"v" * 4097)
    whole = check_splits("binary", data, every=False, seed=3)
    [packet] = parse_all(whole.reply)
    assert (packet.opcode, packet.status, packet.opaque) == (GET, INVALID_ARGUMENTS, 0xBEEF)
    assert whole.closing


def test_a_large_set_is_answered_the_same_however_it_is_split() -> None:
    data = request(SET, b"key", opaque=1, extras=b"\0" * 8, value=b"v" * 20_000) + request(GETK, b"after", opaque=2)
    whole = check_splits("binary", data, every=False, seed=4)
    packets = parse_all(whole.reply)
    assert [(p.opcode, p.status) for p in packets] == [(SET, NOT_SUPPORTED), (GETK, SUCCESS)]
    assert b"<id>" in mask_ids(whole.reply) and not whole.closing

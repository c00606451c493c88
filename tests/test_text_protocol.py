"""The memcached text protocol without sockets: bytes in, bytes out."""

import pytest
from conftest import FAKE_START_MS, FakeClock, decode, parse_values

from katsubushi_py.daemon.stats import Stats
from katsubushi_py.frontends.fastpath import REPLY_BUDGET
from katsubushi_py.frontends.text import MAX_LINE, TextConnection
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer


def text_conn(generator: Generator, version: str = "1", **kwargs: bool) -> TextConnection:
    """A text connection on an issuer with the daemon's STATS fields, as the daemon wires them."""
    issuer = Issuer(generator, version)
    issuer.stats_fields = Stats(issuer).fields
    return TextConnection(issuer, **kwargs)


def totals(conn: TextConnection) -> tuple[int, int, int]:
    return conn._issuer.totals()


@pytest.fixture
def conn(clock: FakeClock) -> TextConnection:
    return text_conn(Generator(9, clock=clock), "9.9.9")


def test_get_one_key(conn: TextConnection) -> None:
    reply = conn.receive(b"GET a\r\n")
    [(key, id_)] = parse_values(reply)
    assert key == b"a"
    assert decode(id_) == (FAKE_START_MS, 9, 0)
    assert reply == b"VALUE a 0 %d\r\n%d\r\nEND\r\n" % (len(str(id_)), id_)


def test_get_many_keys_in_order_with_increasing_ids(conn: TextConnection) -> None:
    pairs = parse_values(conn.receive(b"get a b c a\r\n"))
    assert [k for k, _ in pairs] == [b"a", b"b", b"c", b"a"]
    ids = [i for _, i in pairs]
    assert ids == sorted(ids) and len(set(ids)) == 4


def test_gets_answers_like_get_without_cas(conn: TextConnection) -> None:
    reply = conn.receive(b"GETS k\r\n")
    assert reply.startswith(b"VALUE k 0 ") and len(reply.split(b"\r\n")[0].split()) == 4


@pytest.mark.parametrize("word", [b"get", b"GET", b"GeT", b"gEt"])
def test_command_words_are_case_insensitive(conn: TextConnection, word: bytes) -> None:
    assert parse_values(conn.receive(word + b" x\n"))[0][0] == b"x"


def test_separators_and_line_endings(conn: TextConnection) -> None:
    pairs = parse_values(conn.receive(b"  GET\ta \t b\r\n"))
    assert [k for k, _ in pairs] == [b"a", b"b"]
    assert parse_values(conn.receive(b"GET z\n"))[0][0] == b"z"


def test_keys_are_echoed_byte_for_byte(conn: TextConnection) -> None:
    key = b"\xe9\xb0\xb9\x01" + b"k" * 246  # 250 bytes: memcached's longest key
    assert parse_values(conn.receive(b"GET " + key + b"\r\n"))[0][0] == key


@pytest.mark.parametrize("split", [False, True])
def test_a_key_over_250_bytes_is_a_client_error_in_its_place(conn: TextConnection, split: bool) -> None:
    """memcached's limit and its answer; the keys before it are answered (they may have been sent
    already: a get line is answered as it arrives), the rest of the line is ignored."""
    line = b"get a b " + b"k" * 251 + b" c d\r\n"
    reply = b"".join(conn.receive(line[i : i + 7]) for i in range(0, len(line), 7)) if split else conn.receive(line)
    error = b"CLIENT_ERROR bad command line format\r\n"
    assert reply.endswith(error)
    assert [k for k, _ in parse_values(reply.removesuffix(error) + b"END\r\n")] == [b"a", b"b"]
    assert not conn.closing and conn._buffer == b""
    assert [k for k, _ in parse_values(conn.receive(b"get e\r\n"))] == [b"e"]
    assert totals(conn) == (2, 3, 0)


@pytest.mark.parametrize(
    "line",
    [
        b"\r\n",
        b"\n",
        b"   \r\n",
        b"\t\r\n",
        b"GET\r\n",
        b"FOO bar\r\n",
        b"SET a 0 0\r\n",  # a storage command with a token missing: memcached's ERROR, and no data block
        b"\x00GET a\r\n",
        b"gets\r\n",
    ],
)
def test_errors_keep_the_connection(conn: TextConnection, line: bytes) -> None:
    assert conn.receive(line) == b"ERROR\r\n"
    assert not conn.closing
    assert parse_values(conn.receive(b"GET a\r\n"))


def test_get_without_key_counts_a_command_but_no_id(conn: TextConnection) -> None:
    conn.receive(b"GET\r\n")
    assert totals(conn) == (1, 0, 0)
    conn.receive(b"GET a b\r\n")
    assert totals(conn) == (2, 2, 0)


def test_version_and_stats(conn: TextConnection) -> None:
    assert conn.receive(b"VERSION\r\n") == b"VERSION 9.9.9\r\n"
    conn.receive(b"GET a b c\r\n")
    reply = conn.receive(b"stats\r\n").decode()
    lines = reply.split("\r\n")
    assert lines[-2:] == ["END", ""]
    names = [line.split(" ")[1] for line in lines[:-2]]
    assert names[:9] == [
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
    fields = {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines[:-2]}
    assert fields["cmd_get"] == "1" and fields["get_hits"] == "3" and fields["worker_id"] == "9"
    for name in (
        "clock_drift_ms",
        "clock_backwards_events",
        "sequence_overflow_waits",
        "state_file_high_water_ms",
        "id_lifetime_end",
    ):
        assert name in fields
    assert all(" " not in value for value in fields.values())


def test_pipelined_commands_are_answered_together_in_order(conn: TextConnection) -> None:
    reply = conn.receive(b"GET a\r\nVERSION\r\nGET b\r\n")
    first, rest = reply.split(b"END\r\n", 1)
    assert first.startswith(b"VALUE a ")
    assert rest.startswith(b"VERSION 9.9.9\r\nVALUE b ")


def test_commands_split_across_reads(conn: TextConnection) -> None:
    assert conn.receive(b"GE") == b""
    assert conn.receive(b"T a") == b""  # "a" may go on
    first = conn.receive(b"\r")  # it did not: answered (the line's END comes with its end)
    assert first.startswith(b"VALUE a 0 19\r\n") and first.endswith(b"\r\n") and b"END" not in first
    reply = first + conn.receive(b"\nGET b\r\nGET")
    assert [k for k, _ in parse_values(reply.replace(b"END\r\nVALUE", b"VALUE"))] == [b"a", b"b"]
    assert parse_values(conn.receive(b" c\r\n"))[0][0] == b"c"
    assert totals(conn) == (3, 3, 0)


def test_quit_drops_what_follows(conn: TextConnection) -> None:
    reply = conn.receive(b"GET a\r\nQUIT\r\nGET b\r\n")
    assert parse_values(reply)[0][0] == b"a" and b"VALUE b" not in reply
    assert conn.closing
    assert conn.receive(b"GET c\r\n") == b""


def test_quit_alone(conn: TextConnection) -> None:
    assert conn.receive(b"quit\r\n") == b""
    assert conn.closing


@pytest.mark.parametrize("line", [b"version x y", b"version noreply", b"VERSION x"])
def test_version_ignores_its_arguments(conn: TextConnection, line: bytes) -> None:
    """As memcached 1.6 (``version x y`` answers ``VERSION 1.6.18``) and go-katsubushi answer."""
    assert conn.receive(line + b"\r\n") == b"VERSION 9.9.9\r\n"
    assert not conn.closing


@pytest.mark.parametrize("line", [b"quit now", b"quit noreply", b"QUIT now"])
def test_quit_ignores_its_arguments(conn: TextConnection, line: bytes) -> None:
    """As memcached 1.6 and go-katsubushi: ``quit now`` closes, and what follows is not answered."""
    assert conn.receive(line + b"\r\nversion\r\n") == b""
    assert conn.closing


def test_longest_line_is_served(conn: TextConnection) -> None:
    line = b"version" + b" " * (MAX_LINE - 9) + b"\r\n"
    assert len(line) == MAX_LINE
    assert conn.receive(line) == b"VERSION 9.9.9\r\n"


def test_overlong_complete_line_gets_client_error_and_close(conn: TextConnection) -> None:
    line = b"version" + b" " * (MAX_LINE - 8) + b"\r\n"
    assert conn.receive(b"GET a\r\n" + line).endswith(b"END\r\nCLIENT_ERROR line too long\r\n")
    assert conn.closing


def test_a_get_line_has_no_length_limit(conn: TextConnection) -> None:
    keys = [b"key-%06d" % i for i in range(20_000)]  # a 220 KB line
    reply = conn.receive(b"GET " + b" ".join(keys) + b"\r\n")
    while conn.backlog:
        reply += conn.resume()
    pairs = parse_values(reply)
    assert [k for k, _ in pairs] == keys
    ids = [i for _, i in pairs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert totals(conn) == (1, 20_000, 0)  # one command, as a GET line always counts


def test_overlong_partial_line_is_not_buffered(conn: TextConnection) -> None:
    for _ in range(MAX_LINE // 1024 - 1):
        assert conn.receive(b"k" * 1024) == b""
    assert conn.receive(b"k" * 1024) == b"CLIENT_ERROR line too long\r\n"
    assert conn.closing and conn._buffer == b""


def test_generation_failure_is_server_error_without_partial_values(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    conn = text_conn(gen)
    conn.receive(b"GET a\r\n")
    clock.step_wall_ms(-10_000)
    gen.reanchor()
    assert (
        conn.receive(b"GET a b c\r\n")
        == b"SERVER_ERROR clock moved backwards by 10000 ms (more than the 1000 ms we may wait)\r\n"
    )
    assert conn.receive(b"GET a\r\n").startswith(b"SERVER_ERROR clock moved backwards")
    assert totals(conn) == (3, 1, 2)
    assert not conn.closing


def test_gets_cas_option_adds_the_id_as_cas(clock: FakeClock) -> None:
    conn = text_conn(Generator(1, clock=clock), gets_cas=True)
    lines = conn.receive(b"gets a b\r\n").split(b"\r\n")
    assert lines[0].split()[:4] == [b"VALUE", b"a", b"0", b"19"] and lines[0].split()[4] == lines[1]
    assert lines[2].split()[4] == lines[3] and lines[4:] == [b"END", b""]
    assert conn.receive(b"get a\r\n").split(b"\r\n")[0].count(b" ") == 3  # GET unchanged
    assert conn.receive(b"gets\r\n") == b"ERROR\r\n"


# -- what memcached answers where go-katsubushi does not --------------------------------------------

NOT_SUPPORTED = b"CLIENT_ERROR %b is not supported: this server only issues IDs\r\n"


@pytest.mark.parametrize(
    "command",
    [
        b"set k 0 0 5",
        b"add k 1 2 5",
        b"replace k 0 0 5",
        b"append k 0 0 5",
        b"prepend k 0 0 5",
        b"cas k 0 0 5 77",
        b"SET k 0 0 5",
        b"set k 0 0 5 x",  # memcached ignores a sixth token that is not noreply
    ],
)
@pytest.mark.parametrize("noreply", [False, True])
def test_storage_commands_are_answered_once_and_their_block_is_skipped(
    conn: TextConnection, command: bytes, noreply: bool
) -> None:
    line = command + (b" noreply" if noreply and not command.endswith(b"x") else b"")
    reply = conn.receive(line + b"\r\nvalue\r\nget after\r\n")
    name = command.split()[0].lower()
    expected = b"" if noreply and not command.endswith(b"x") else NOT_SUPPORTED % name
    assert reply.startswith(expected) and parse_values(reply[len(expected) :])[0][0] == b"after"
    assert totals(conn) == (1, 1, 0) and conn._buffer == b"" and not conn.closing


def test_a_data_block_is_discarded_as_it_arrives(conn: TextConnection) -> None:
    assert conn.receive(b"set k 0 0 1000000\r\n") == b""
    for _ in range(1000):
        assert conn.receive(b"x" * 1000) == b""
        assert conn._buffer == b""  # nothing of the block is held
    assert conn.receive(b"\r") == b""
    assert conn.receive(b"\nmn\r\n") == NOT_SUPPORTED % b"set" + b"MN\r\n"


@pytest.mark.parametrize(
    ("request_bytes", "reply"),
    [
        # memcached 1.6.18's bytes for the same requests (with STORED where we say "not supported")
        (b"set foo 0 0 3\r\nbarbaz\r\nmn\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 3 noreply\r\nbarbaz\r\nmn\r\n", b"ERROR\r\nMN\r\n"),
        (b"set foo 0 0 5\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\n"),
        (b"set foo 0 0 3\r\nbar\nmn\r\n", b"CLIENT_ERROR bad data chunk\r\nERROR\r\n"),
        (b"set foo 0 0 4294967295\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 2147483646\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 -1\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 abc\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo x 0 3\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 x 3\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set " + b"k" * 251 + b" 0 0 3\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0\r\nbar\r\nmn\r\n", b"ERROR\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 3 x y\r\nbar\r\nmn\r\n", b"ERROR\r\nERROR\r\nMN\r\n"),
        (b"cas foo 0 0 3\r\nbar\r\nmn\r\n", b"ERROR\r\nERROR\r\nMN\r\n"),
        (b"cas foo 0 0 3 x\r\nbar\r\nmn\r\n", b"CLIENT_ERROR bad command line format\r\nERROR\r\nMN\r\n"),
        (b"set foo 0 0 03\r\nbar\r\nmn\r\n", NOT_SUPPORTED % b"set" + b"MN\r\n"),
        (b"set foo 0 0 +3\r\nbar\r\nmn\r\n", NOT_SUPPORTED % b"set" + b"MN\r\n"),
        (
            b"incr a 1\r\nincr a\r\nincr a 1 noreply\r\nincr a 1 2 3\r\nmn\r\n",
            NOT_SUPPORTED % b"incr" + b"ERROR\r\nERROR\r\nMN\r\n",
        ),
        (b"decr a 1\r\ndecr a\r\nmn\r\n", NOT_SUPPORTED % b"decr" + b"ERROR\r\nMN\r\n"),
        (b"touch a 10\r\ntouch a\r\ntouch a 10 noreply\r\nmn\r\n", NOT_SUPPORTED % b"touch" + b"ERROR\r\nMN\r\n"),
        (
            b"delete\r\ndelete a b c d e\r\ndelete zz\r\ndelete zz noreply\r\nmn\r\n",
            b"ERROR\r\nERROR\r\n" + NOT_SUPPORTED % b"delete" + b"MN\r\n",
        ),
        (b"flush_all\r\nflush_all noreply\r\nflush_all 0 noreply\r\nmn\r\n", NOT_SUPPORTED % b"flush_all" + b"MN\r\n"),
        (
            b"gat\r\ngat 10 a b\r\ngats 10 a\r\nmn\r\n",
            b"ERROR\r\n" + NOT_SUPPORTED % b"gat" + NOT_SUPPORTED % b"gats" + b"MN\r\n",
        ),
    ],
)
def test_framing_of_other_commands_is_memcacheds(conn: TextConnection, request_bytes: bytes, reply: bytes) -> None:
    """Each request answered as memcached 1.6.18 frames it: the same number of replies (none with
    noreply), the same block skipped or not, the same errors (tests/test_memcached_tools.py checks
    the framing against a running memcached too)."""
    assert conn.receive(request_bytes) == reply
    assert totals(conn) == (0, 0, 0) and not conn.closing


@pytest.mark.parametrize(
    ("line", "reply"),
    [
        (b"verbosity 1", b"OK\r\n"),
        (b"verbosity 0", b"OK\r\n"),
        (b"verbosity 1 2", b"OK\r\n"),
        (b"verbosity 1 noreply", b""),
        (b"verbosity noreply", b""),  # memcached: a bad level, whose error noreply hides
        (b"verbosity", b"ERROR\r\n"),
        (b"verbosity foo bar my", b"ERROR\r\n"),
        (b"verbosity x", b"CLIENT_ERROR bad command line format\r\n"),
        (b"verbosity -1", b"CLIENT_ERROR bad command line format\r\n"),
    ],
)
def test_verbosity_is_answered_as_memcached_does(conn: TextConnection, line: bytes, reply: bytes) -> None:
    assert conn.receive(line + b"\r\nversion\r\n") == reply + b"VERSION 9.9.9\r\n"


def test_a_reply_is_made_a_budget_at_a_time(conn: TextConnection) -> None:
    """One read of 4,000 stats commands (28 KB) would answer 2 MB at once: a receive stops once its
    reply reaches the budget and holds the rest, and resume carries on."""
    request_bytes = b"stats\r\n" * 4000
    reply = conn.receive(request_bytes)
    sizes = [len(reply)]
    while conn.backlog:
        part = conn.resume()
        sizes.append(len(part))
        reply += part
    assert reply.count(b"END\r\n") == 4000 and len(sizes) > 20
    assert max(sizes) < REPLY_BUDGET + 4096  # the budget and at most one command's reply
    assert conn._buffer == b""


def test_a_long_get_waits_for_the_clock_in_the_middle_and_carries_on(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    conn = text_conn(gen)
    first = parse_values(conn.receive(b"get a\r\n"))[0][1]
    keys = [b"k%d" % i for i in range(300)]
    assert conn.receive(b"get " + b" ".join(keys[:200]) + b" ") != b""  # some batches answered
    clock.step_wall_ms(-200)
    gen.reanchor()
    reply = conn.receive(b" ".join(keys[200:]) + b"\r\nget z\r\n")
    assert reply == b"" and conn.wait > 0.19  # the next batch waits, and what follows it
    clock.advance_ms(201)
    rest = conn.resume()
    assert rest.endswith(b"END\r\n") and rest.count(b"END\r\n") == 2
    ids = [i for _, i in parse_values(rest.split(b"END\r\n")[0] + b"END\r\n")]
    assert len(ids) == 100 and min(ids) > first
    assert totals(conn) == (3, 302, 0)


def test_a_failure_in_the_middle_of_a_get_line_ends_it(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    conn = text_conn(gen)
    answered = conn.receive(b"get " + b" ".join(b"k%d" % i for i in range(200)) + b" ")
    clock.step_wall_ms(-10_000)
    gen.reanchor()
    reply = conn.receive(b"x y z\r\nget q\r\n")
    assert answered.count(b"VALUE ") == 200 and b"END" not in answered
    assert reply.startswith(b"SERVER_ERROR clock moved backwards by 10000 ms")
    assert reply.endswith(b"\r\n") and reply.count(b"\r\n") == 2  # and the next line's error
    assert totals(conn) == (2, 200, 2) and not conn.closing


def test_gets_cas_streams_too(clock: FakeClock) -> None:
    conn = text_conn(Generator(1, clock=clock), gets_cas=True)
    keys = [b"k%d" % i for i in range(500)]
    line = b"gets " + b" ".join(keys) + b"\r\n"
    reply = b"".join(conn.receive(line[i : i + 1000]) for i in range(0, len(line), 1000))
    lines = reply.split(b"\r\n")
    assert lines[-2:] == [b"END", b""] and len(lines) == 2 * 500 + 2
    for head, value in zip(lines[0:-2:2], lines[1:-2:2], strict=True):
        word, _, flags, length, cas = head.split(b" ")
        assert (word, flags, int(length), cas) == (b"VALUE", b"0", len(value), value)


@pytest.mark.parametrize("keys", [1, 3, 100])
@pytest.mark.parametrize("age_ms", [1, 1000])  # IDs of 7 and 10 digits
def test_ids_of_other_lengths_are_framed_by_their_length(clock: FakeClock, keys: int, age_ms: int) -> None:
    """A layout with a recent epoch makes IDs shorter than today's 19 digits (the compiled path
    writes each VALUE line's length from a table by the ID's length)."""
    layout = Layout(epoch_ms=FAKE_START_MS - age_ms, now_ms=FAKE_START_MS)
    conn = text_conn(Generator(3, layout, clock=clock))
    pairs = parse_values(conn.receive(b"get " + b" ".join(b"k%d" % i for i in range(keys)) + b"\r\n"))
    ids = [i for _, i in pairs]
    assert len(ids) == keys and all(len(str(i)) < 19 for i in ids) and ids == sorted(ids)
    assert [layout.decompose(i).worker_id for i in ids] == [3] * keys

"""The memcached text protocol without sockets: bytes in, bytes out."""

import pytest
from conftest import FAKE_START_MS, FakeClock, decode, parse_values

from katsubushi_py.daemon.stats import Stats
from katsubushi_py.frontends.text import MAX_LINE, TextConnection
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
    key = b"\xe9\xb0\xb9\x01" + b"k" * 300
    assert parse_values(conn.receive(b"GET " + key + b"\r\n"))[0][0] == key


@pytest.mark.parametrize(
    "line",
    [
        b"\r\n",
        b"\n",
        b"   \r\n",
        b"\t\r\n",
        b"GET\r\n",
        b"FOO bar\r\n",
        b"SET a 0 0 1\r\n",
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
    assert conn.receive(b"VERSION extra args\r\n") == b"VERSION 9.9.9\r\n"
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
    assert conn.receive(b"T a") == b""
    assert conn.receive(b"\r") == b""
    reply = conn.receive(b"\nGET b\r\nGET")
    assert [k for k, _ in parse_values(reply.replace(b"END\r\nVALUE", b"VALUE"))] == [b"a", b"b"]
    assert parse_values(conn.receive(b" c\r\n"))[0][0] == b"c"


def test_quit_drops_what_follows(conn: TextConnection) -> None:
    reply = conn.receive(b"GET a\r\nQUIT\r\nGET b\r\n")
    assert parse_values(reply)[0][0] == b"a" and b"VALUE b" not in reply
    assert conn.closing
    assert conn.receive(b"GET c\r\n") == b""


def test_quit_alone(conn: TextConnection) -> None:
    assert conn.receive(b"quit now\r\n") == b""
    assert conn.closing


def test_longest_line_is_served(conn: TextConnection) -> None:
    line = b"GET " + b"k" * (MAX_LINE - 6) + b"\r\n"
    assert len(line) == MAX_LINE
    assert parse_values(conn.receive(line))


def test_overlong_complete_line_gets_client_error_and_close(conn: TextConnection) -> None:
    line = b"GET " + b"k" * (MAX_LINE - 5) + b"\r\n"
    assert conn.receive(b"GET a\r\n" + line).endswith(b"END\r\nCLIENT_ERROR line too long\r\n")
    assert conn.closing


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

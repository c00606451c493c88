"""The HTTP front end without sockets: bytes in, bytes out (routes, limits, pipelining, clock waits)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from conftest import FAKE_START_MS, FakeClock, decode

from katsubushi_py.daemon.stats import Stats
from katsubushi_py.frontends.http import (
    MAX_BODY,
    MAX_HEAD,
    MAX_HEADERS,
    MAX_PIPELINED,
    MAX_URL,
    YIELD,
    HttpApi,
    HttpConnection,
)
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_replies(data: bytes) -> list[Reply]:
    """Split a byte stream into responses, strictly: every one has a Content-Length that matches."""
    replies = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        assert sep, data
        lines = head.decode("latin-1").split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1"
        headers = {}
        for line in lines[1:]:
            name, value = line.split(": ", 1)
            assert name.lower() not in headers, head
            headers[name.lower()] = value
        length = int(headers["content-length"])
        assert len(rest) >= length, data
        replies.append(Reply(int(status), headers, rest[:length]))
        data = rest[length:]
    return replies


def one(data: bytes) -> Reply:
    [reply] = parse_replies(data)
    return reply


def get(path: str, *headers: str) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: k\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n").encode()


def make_conn(generator: Generator, metrics: object = None) -> HttpConnection:
    issuer = Issuer(generator, "9.9.9")
    issuer.stats_fields = Stats(issuer).fields
    return HttpConnection(HttpApi(issuer, metrics))  # type: ignore[arg-type]


@pytest.fixture
def conn(clock: FakeClock) -> HttpConnection:
    return make_conn(Generator(9, clock=clock))


def totals(conn: HttpConnection) -> tuple[int, int, int]:
    return conn._api._issuer.totals()


def test_id_as_text_and_as_json(conn: HttpConnection) -> None:
    text = one(conn.receive(get("/id")))
    assert text.status == 200 and text.headers["content-type"] == "text/plain"
    assert decode(int(text.body)) == (FAKE_START_MS, 9, 0) and text.body.isdigit()
    assert "date" in text.headers and "connection" not in text.headers
    as_json = one(conn.receive(get("/id", "Accept: text/html, application/json;q=0.9")))
    assert as_json.headers["content-type"] == "application/json"
    assert as_json.body == b'{"id":"%d"}' % (int(text.body) + 1)  # a string: IDs exceed 2^53
    assert not conn.closing and totals(conn) == (2, 2, 0)


def test_ids_bodies_are_go_katsubushis(conn: HttpConnection) -> None:
    text = one(conn.receive(get("/ids?n=3")))
    ids = [int(line) for line in text.body.split(b"\n")]
    assert len(ids) == 3 and ids == sorted(ids) and not text.body.endswith(b"\n")
    as_json = one(conn.receive(get("/ids?n=3", "Accept: application/json")))
    assert as_json.body == b'{"ids":["%d","%d","%d"]}\n' % (ids[2] + 1, ids[2] + 2, ids[2] + 3)
    assert one(conn.receive(get("/ids"))).body.isdigit()  # n missing means 1
    assert one(conn.receive(get("/ids?x=1&n=1000&n=5"))).body.count(b"\n") == 999  # the first n counts
    assert one(conn.receive(get("/ids?n=%32"))).body.count(b"\n") == 1  # percent-encoded
    assert totals(conn) == (5, 3 + 3 + 1 + 1000 + 2, 0)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("n=1001", "too many IDs requested: 1001, n must be from 1 to 1000"),
        ("n=0", "n must be from 1 to 1000, got 0"),  # go-katsubushi: 200 and an empty list
        ("n=-1", "n must be from 1 to 1000, got -1"),  # go-katsubushi: the handler panics, no reply
        ("n=abc", "n must be an integer from 1 to 1000, got 'abc'"),
        ("n=", "n must be an integer from 1 to 1000, got ''"),
        ("n=1_0", "n must be an integer from 1 to 1000, got '1_0'"),  # Python's int() would take it
        ("n=2.5", "n must be an integer from 1 to 1000, got '2.5'"),
        ("n=99999999999999999999", "too many IDs requested: 99999999999999999999, n must be from 1 to 1000"),
    ],
)
def test_bad_counts_are_400_with_a_json_error(conn: HttpConnection, query: str, message: str) -> None:
    reply = one(conn.receive(get(f"/ids?{query}")))
    assert reply.status == 400 and reply.headers["content-type"] == "application/json"
    assert json.loads(reply.body) == {"error": message}
    assert not conn.closing  # the connection stays usable
    assert totals(conn) == (1, 0, 0)  # counted in cmd_get as go-katsubushi does, not as a miss
    assert one(conn.receive(get("/id"))).status == 200


@pytest.mark.parametrize("path", ["/nope", "/id/", "/ID", "/", "/idx", "/metrics"])
def test_unknown_paths_are_404(conn: HttpConnection, path: str) -> None:
    reply = one(conn.receive(get(path)))
    assert reply.status == 404 and json.loads(reply.body) == {"error": "not found"}
    assert not conn.closing and totals(conn) == (0, 0, 0)


def test_other_methods_are_405_with_allow(conn: HttpConnection) -> None:
    post = one(conn.receive(b"POST /id HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"))
    assert post.status == 405 and post.headers["allow"] == "GET" and b"use GET" in post.body
    head = conn.receive(b"HEAD /ids HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 405 ") and head.endswith(b"\r\n\r\n")  # no body after a HEAD
    assert b"Allow: GET\r\n" in head
    assert one(conn.receive(b"DELETE /stats HTTP/1.1\r\n\r\n")).status == 405
    assert not conn.closing and totals(conn) == (0, 0, 0)


def test_stats_health_and_decode(conn: HttpConnection) -> None:
    conn.receive(get("/ids?n=4"))
    stats = json.loads(one(conn.receive(get("/stats"))).body)
    assert list(stats)[:9] == [
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
    assert (stats["version"], stats["cmd_get"], stats["get_hits"], stats["worker_id"]) == ("9.9.9", 1, 4, 9)
    health = one(conn.receive(get("/healthz")))
    assert health.status == 200 and json.loads(health.body) == {"status": "ok", "worker_id": 9}
    decoded = one(conn.receive(get("/decode/189608758458974208")))
    assert json.loads(decoded.body) == {
        "id": "189608758458974208",
        "time": "2016-06-07T05:17:30.777Z",
        "worker_id": 0,
        "sequence": 0,
    }
    hex_form = one(conn.receive(get("/decode/02a1a02946400000?encoding=hex")))
    assert json.loads(hex_form.body)["id"] == "189608758458974208"
    for bad in ("/decode/12ab", "/decode/", "/decode/-5", "/decode/99999999999999999999999"):
        reply = one(conn.receive(get(bad)))
        assert reply.status == 400 and json.loads(reply.body)["error"], bad
    assert not conn.closing


def test_metrics_route_renders_what_the_daemon_gives(clock: FakeClock) -> None:
    seen = []

    def render(accept: bytes) -> tuple[bytes, bytes]:
        seen.append(accept)
        return b"m 1\n", b"text/plain; version=0.0.4"

    conn = make_conn(Generator(1, clock=clock), render)
    reply = one(conn.receive(get("/metrics", "Accept: application/openmetrics-text")))
    assert reply.status == 200 and reply.body == b"m 1\n"
    assert reply.headers["content-type"] == "text/plain; version=0.0.4"
    assert seen == [b"application/openmetrics-text"]


def test_generation_failure_is_503_with_the_reason(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    conn = make_conn(gen)
    gen.set_fence(clock.monotonic_ns())  # the lease's deadline has passed
    for path in ("/id", "/ids?n=5"):
        reply = one(conn.receive(get(path)))
        assert reply.status == 503
        assert json.loads(reply.body) == {"error": "worker id lease not confirmed", "reason": "lease_unconfirmed"}
    health = one(conn.receive(get("/healthz")))
    assert health.status == 503
    assert json.loads(health.body) == {
        "status": "unavailable",
        "reason": "lease_unconfirmed",
        "message": "worker id lease not confirmed",
    }
    assert totals(conn) == (2, 0, 2) and not conn.closing
    gen.set_fence(None)
    assert one(conn.receive(get("/healthz"))).status == 200


def test_pipelined_requests_are_answered_in_order_and_split_reads_work(conn: HttpConnection) -> None:
    batch = get("/ids?n=2") + get("/nope") + get("/id", "Accept: application/json") + get("/ids?n=0")
    replies = parse_replies(conn.receive(batch))
    assert [r.status for r in replies] == [200, 404, 200, 400]
    _first, second = (int(x) for x in replies[0].body.split(b"\n"))
    assert json.loads(replies[2].body)["id"] == str(second + 1)
    assert conn.activity == 4
    # The same, one byte at a time.
    out = b"".join(conn.receive(batch[i : i + 1]) for i in range(len(batch)))
    assert [r.status for r in parse_replies(out)] == [200, 404, 200, 400]
    assert conn.activity == 8 and not conn.closing


def test_keep_alive_rules(clock: FakeClock) -> None:
    conn = make_conn(Generator(1, clock=clock))
    reply = conn.receive(get("/id", "Connection: close") + get("/id"))  # what follows a close is dropped
    assert len(parse_replies(reply)) == 1 and b"Connection: close\r\n" in reply and conn.closing
    assert conn.receive(get("/id")) == b""
    old = make_conn(Generator(1, clock=clock))
    assert b"Connection: close\r\n" in old.receive(b"GET /id HTTP/1.0\r\n\r\n") and old.closing
    kept = make_conn(Generator(1, clock=clock))
    reply = kept.receive(b"GET /id HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert b"Connection: keep-alive\r\n" in reply and not kept.closing


def refused(conn: HttpConnection, data: bytes, status: int) -> Reply:
    reply = parse_replies(data)[-1]
    assert reply.status == status, reply
    assert reply.headers["connection"] == "close" and conn.closing
    assert json.loads(reply.body)["error"]
    return reply


def test_request_target_over_the_limit_is_414(conn: HttpConnection) -> None:
    ok = get("/decode/1?" + "x" * (MAX_URL - 20))
    assert one(conn.receive(ok)).status == 200
    refused(conn, conn.receive(get("/id?" + "x" * MAX_URL)), 414)


def test_a_long_target_trickled_in_is_refused_without_holding_it(conn: HttpConnection) -> None:
    conn.receive(b"GET /id?")
    for _ in range(MAX_URL // 1000):
        assert conn.receive(b"x" * 1000) == b""
    refused(conn, conn.receive(b"x" * 1000), 414)
    assert len(conn._url) <= MAX_URL + 1000


def test_header_section_over_the_limit_is_431(conn: HttpConnection) -> None:
    refused(conn, conn.receive(get("/id", "X-Big: " + "y" * MAX_HEAD)), 431)


def test_one_endless_header_trickled_in_is_431_within_a_read_of_the_limit(conn: HttpConnection) -> None:
    # The parser holds an unfinished header itself: the bound comes from the bytes fed to it.
    assert conn.receive(get("/id")) != b""  # a complete request first, in the same connection
    data = b"GET /id HTTP/1.1\r\nX-Endless: "
    fed = len(data)
    reply = conn.receive(data)
    while not reply:
        assert fed <= MAX_HEAD + 4096, "held more than the limit plus one read"
        reply = conn.receive(b"z" * 4096)
        fed += 4096
    refused(conn, reply, 431)


def test_a_fresh_head_after_complete_requests_in_the_same_read_is_not_overcounted(conn: HttpConnection) -> None:
    # 100 complete requests plus the start of another in one read: far over MAX_HEAD in total, but
    # only the unfinished head counts.
    batch = get("/nope", "X-Pad: " + "p" * 300) * 60
    assert len(batch) > MAX_HEAD
    replies = parse_replies(conn.receive(batch + b"GET /id HTTP/1.1\r\nHost: k\r\n"))
    assert [r.status for r in replies] == [404] * 60 and not conn.closing
    assert one(conn.receive(b"\r\n")).status == 200


def test_too_many_header_fields_is_431(conn: HttpConnection) -> None:
    fine = [f"X-H{i}: v" for i in range(MAX_HEADERS - 1)]  # plus Host
    assert one(conn.receive(get("/id", *fine))).status == 200
    refused(conn, conn.receive(get("/id", *fine, "X-One-More: v")), 431)


def test_bodies_small_are_skipped_large_are_413(conn: HttpConnection) -> None:
    small = b"GET /id HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % MAX_BODY + b"b" * MAX_BODY
    assert one(conn.receive(small)).status == 200 and not conn.closing
    chunked = b"GET /id HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    assert one(conn.receive(chunked)).status == 200 and not conn.closing
    refused(conn, conn.receive(b"POST /id HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1)), 413)


def test_a_chunked_body_over_the_limit_is_413(clock: FakeClock) -> None:
    conn = make_conn(Generator(1, clock=clock))
    conn.receive(b"GET /id HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    out = b""
    for _ in range(MAX_BODY // 100 + 2):
        out += conn.receive(b"64\r\n" + b"c" * 100 + b"\r\n")
    refused(conn, out, 413)


def test_more_pipelined_requests_than_the_limit_in_one_read_is_429_after_the_first_ones(
    conn: HttpConnection,
) -> None:
    out = conn.receive(get("/ids?n=1000") * (MAX_PIPELINED + 50))
    # Answered a reply budget at a time, the rest after a turn of the event loop (wait), in order.
    assert conn.wait == YIELD and len(parse_replies(out)) < 10
    while conn.wait:
        out += conn.resume()
    replies = parse_replies(out)
    assert [r.status for r in replies] == [200] * MAX_PIPELINED + [429]
    assert conn.closing and totals(conn) == (MAX_PIPELINED, MAX_PIPELINED * 1000, 0)


@pytest.mark.parametrize(
    "data",
    [
        b"GET /id HTTP/1.1\nHost: k\n\n",  # bare LF
        b"garbage\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # HTTP/2 prior knowledge
        b"GET /id HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET /\xe3\x81\x82 HTTP/1.1\r\n\r\n",
    ],
)
def test_malformed_requests_are_400_and_close(conn: HttpConnection, data: bytes) -> None:
    refused(conn, conn.receive(get("/id") + data), 400)  # the good request before it is answered
    assert conn.receive(get("/id")) == b""


def test_an_upgrade_request_is_answered_then_closed(conn: HttpConnection) -> None:
    reply = conn.receive(get("/id", "Connection: Upgrade", "Upgrade: websocket") + b"\x81\x05hello")
    assert one(reply).status == 200 and one(reply).headers["connection"] == "close" and conn.closing


def behind(gen: Generator, clock: FakeClock, ms: int) -> None:
    """Make the generator's clock ``ms`` behind what it has issued (a re-anchor after a step back)."""
    clock.step_wall_ms(-ms)
    gen.reanchor()


def test_a_request_waiting_for_the_clock_holds_the_ones_after_it_in_order(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    conn = make_conn(gen)
    first = int(one(conn.receive(get("/id"))).body)
    behind(gen, clock, 200)
    reply = conn.receive(get("/healthz") + get("/id") + get("/nope") + get("/ids?n=2"))
    assert [r.status for r in parse_replies(reply)] == [200]  # answered up to the request that waits
    assert 0.19 < conn.wait <= 0.201
    assert conn.receive(get("/ids?n=3")) == b""  # arrives while waiting: kept, in order
    assert conn.resume() == b"" and conn.wait > 0  # too early: still waiting
    clock.advance_ms(201)
    rest = parse_replies(conn.resume())
    assert conn.wait == 0 and [r.status for r in rest] == [200, 404, 200, 200]
    ids = [int(x) for r in rest for x in r.body.split(b"\n") if x.isdigit()]
    assert len(ids) == 6 and ids == sorted(ids) and ids[0] > first
    assert totals(conn) == (4, 7, 0)  # a waiting request is counted once, when answered


def test_a_bug_in_a_route_is_a_500_and_a_close_not_a_dropped_connection(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(accept: bytes) -> tuple[bytes, bytes]:
        raise RuntimeError("collector bug")

    conn = make_conn(Generator(1, clock=clock), broken)
    replies = parse_replies(conn.receive(get("/id") + get("/metrics") + get("/id")))
    assert [r.status for r in replies] == [200, 500] and conn.closing
    assert "unexpected error answering an HTTP request" in caplog.text and "collector bug" in caplog.text

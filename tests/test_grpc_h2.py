"""gRPC over HTTP/2 sans-IO (frontends/grpc_h2.py): an h2 client against a GrpcConnection, no sockets.

The fast path and the slow path must agree: the same random conversations (tests/grpc_conversations.py)
go to a connection with the fast path and to one without it, and every stream's reply, the bytes the
client sends back (window updates, settings acknowledgements) and the IDs must be the same. The
compiled core against the pure-Python one is tests/test_grpc_twins.py.
"""

from __future__ import annotations

import time

import pytest
from google.protobuf import descriptor_pb2
from grpc_conversations import (
    FETCH,
    FETCH_MULTI,
    REFLECTION,
    STATS,
    Client,
    chunks,
    decode_ids,
    grpc_headers,
    make_server,
    message,
    play_step,
    script,
    split_messages,
    varint,
)
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

from katsubushi_py.frontends import grpc_frames
from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends.grpc_frames import PREFACE, frame, literal_block, table_neutral
from katsubushi_py.frontends.grpc_h2 import GrpcConnection
from katsubushi_py.frontends.grpc_service import GrpcService
from katsubushi_py.issuing.issuer import Issuer

BOTH = pytest.mark.parametrize("fast", [True, False], ids=["fast", "slow"])


def connect(fast: bool = True, **kw: int):
    server, clock = make_server(fast, **kw)
    client = Client()
    client.take(server.receive(client.pending()))
    client.take(server.receive(client.pending()))  # the SETTINGS acknowledgement
    return server, client, clock


def exchange(server, client: Client, cut: int = 0) -> None:
    """Send what the client has written, in pieces of ``cut`` bytes; answer it all, as the connection
    glue does (a slice at a time while a read's budget holds the rest back)."""
    for piece in chunks(client.pending(), cut):
        client.take(server.receive(piece))
        while server.backlog and not server.wait and not server.closing:
            client.take(server.resume())
    client.take(server.receive(b""))


def served_fast(server, client: Client) -> int:
    """Streams the fast path answered: h2 never saw them."""
    h2 = server._h2
    return sum(1 for sid in client.replies if sid not in h2.streams and sid not in h2._closed_streams)


def ok_ids(client: Client, sid: int) -> list[int]:
    reply = client.replies[sid]
    assert reply.headers.get(b":status") == b"200", reply
    assert (reply.trailers or reply.headers).get(b"grpc-status") == b"0", reply
    (body,) = split_messages(reply.data)
    return decode_ids(body)


def status(client: Client, sid: int) -> tuple[bytes | None, bytes | None, bytes | None]:
    reply = client.replies[sid]
    where = reply.trailers or reply.headers
    return reply.headers.get(b":status"), where.get(b"grpc-status"), where.get(b"grpc-message")


# -- the two paths agree ------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_fast_and_slow_paths_agree_on_random_conversations(seed: int) -> None:
    pairs = [connect(fast=True)[:2], connect(fast=False)[:2]]
    for step in script(seed):
        for _server, client in pairs:
            play_step(client, step)
        sent = [client.pending() for _, client in pairs]
        assert sent[0] == sent[1], f"the clients diverged before {step}"
        for (server, client), data in zip(pairs, sent, strict=True):
            for piece in chunks(data, step[-1]):
                client.take(server.receive(piece))
    for _ in range(10_000):  # what is still in flight (window updates for replies cut by tiny windows)
        sent = [client.pending() for _, client in pairs]
        assert sent[0] == sent[1], "the clients diverged at the end"
        if not sent[0]:
            break
        for (server, client), data in zip(pairs, sent, strict=True):
            client.take(server.receive(data))
    (fast_server, fast_client), (slow_server, slow_client) = pairs
    assert fast_client.replies.keys() == slow_client.replies.keys()
    for sid, reply in fast_client.replies.items():
        assert reply.summary() == slow_client.replies[sid].summary(), sid
    assert fast_client.goaway is None and slow_client.goaway is None
    assert not fast_server.closing and not slow_server.closing
    assert all(reply.ended or reply.reset is not None for reply in fast_client.replies.values())
    ids = [i for reply in fast_client.replies.values() for i in reply.ids()]
    assert ids and len(ids) == len(set(ids))
    assert fast_server.activity and fast_server._service.counters.commands == slow_server._service.counters.commands
    steps = script(seed)
    if not any(step[:2] == ("settings", "window-small") for step in steps):  # (replies then wait for windows)
        assert served_fast(fast_server, fast_client) > 0
    assert served_fast(slow_server, slow_client) == 0


@BOTH
def test_fetch_and_fetch_multi(fast: bool) -> None:
    server, client, _ = connect(fast)
    calls = [client.call(FETCH) for _ in range(10)]
    exchange(server, client)
    calls += [client.call(FETCH) for _ in range(10)]
    multi = {n: client.call(FETCH_MULTI, b"\x08" + varint(n) if n else b"") for n in (0, 1, 2, 100, 1000)}
    long_form = client.call(FETCH_MULTI, b"\x08\x83\x80\x00")  # 3, as a non-minimal varint
    exchange(server, client)
    ids = [ok_ids(client, sid)[0] for sid in calls]
    assert ids == sorted(ids) and len(set(ids)) == 20
    for n, sid in multi.items():
        got = ok_ids(client, sid)
        assert len(got) == max(n, 1) and got == sorted(got) and got[0] > ids[-1]
    assert len(ok_ids(client, long_form)) == 3
    counters = server._service.counters
    assert (counters.commands, counters.ids) == (26, 20 + 1 + 1 + 2 + 100 + 1000 + 3)
    assert served_fast(server, client) > (5 if fast else -1)
    if not fast:
        assert served_fast(server, client) == 0


@BOTH
def test_calls_whose_headers_change_the_table_each_time_are_fast_too(fast: bool) -> None:
    """grpc-go sends a new grpc-timeout value with each call, added to the HPACK table: no block is
    ever the same, so the slow path decodes each one (keeping HPACK in step) and hands the call over."""
    server, client, _ = connect(fast)
    sids = []
    for timeout in range(40):
        sids.append(client.call(FETCH, headers=grpc_headers(FETCH, grpc_timeout=b"%dm" % (4000 + timeout))))
        if timeout % 4 == 0:
            exchange(server, client)
    multi = client.call(FETCH_MULTI, b"\x08\x05", headers=grpc_headers(FETCH_MULTI, grpc_timeout=b"1S"))
    exchange(server, client)
    ids = [ok_ids(client, sid)[0] for sid in sids]
    assert ids == sorted(ids) and len(set(ids)) == 40 and len(ok_ids(client, multi)) == 5
    assert served_fast(server, client) == (41 if fast else 0)
    assert server._cache_len() == 0  # none of these blocks can be recognised by its bytes


ODD_HEADERS = {
    "te gzip": [(b"te", b"gzip")],
    "te Trailers": [(b"te", b"Trailers")],
    "two te": [(b"te", b"trailers")],
    "uppercase name": [(b"X-Odd", b"1")],
    "connection header": [(b"connection", b"close")],
    "value with a trailing space": [(b"x-odd", b"1 ")],
    "host beside :authority": [(b"host", b"elsewhere")],
    "host equal to :authority": [(b"host", b"test")],
    "two content-types": [(b"content-type", b"application/grpc")],
    "content-length that matches": [(b"content-length", b"5")],
    "content-length that does not": [(b"content-length", b"7")],
    "content-length not a number": [(b"content-length", b"five")],
    "grpc-encoding gzip, plain message": [(b"grpc-encoding", b"gzip")],
    "grpc-timeout malformed": [(b"grpc-timeout", b"1x")],
    "a cookie": [(b"cookie", b"a=1")],
    "an empty value": [(b"x-odd", b"")],
}


@pytest.mark.parametrize("odd", ODD_HEADERS)
def test_odd_headers_get_the_same_answer_on_both_paths(odd: str) -> None:
    """Headers the fast path does not take as plain (or does) are judged as h2 judges them."""
    outcomes = []
    for fast in (True, False):
        server, client, _ = connect(fast)
        warm = client.call(FETCH)  # the table holds the usual headers
        exchange(server, client)
        names = {name for name, _ in ODD_HEADERS[odd]} if not odd.startswith("two ") else set()
        headers = [(name, value) for name, value in grpc_headers(FETCH) if name not in names] + ODD_HEADERS[odd]
        sid = client.call(FETCH, headers=headers)
        exchange(server, client)
        goaway = client.goaway and (client.goaway.error_code, client.goaway.last_stream_id)
        reply = client.replies[sid]
        outcomes.append((goaway, reply.summary()[0:2], reply.summary()[3:], bool(ok_ids(client, warm))))
    assert outcomes[0] == outcomes[1]


@BOTH
def test_a_call_split_across_frames_and_reads(fast: bool) -> None:
    """Header blocks in HEADERS plus CONTINUATION frames, messages in several DATA frames, and all of it
    read a byte at a time: the same answers."""
    server, client, _ = connect(fast)
    client.call(FETCH)
    exchange(server, client)
    client.h2.max_outbound_frame_size = 7  # h2 cuts header blocks into CONTINUATION frames of 7 bytes
    sids = [client.open(FETCH_MULTI), client.open(FETCH)]
    client.h2.max_outbound_frame_size = 16384
    body = message(b"\x08\x05")
    for at in range(0, len(body), 2):  # DATA frames of two bytes, the last one ending the stream
        client.send(sids[0], body[at : at + 2], end=at + 2 >= len(body))
    client.send(sids[1], b"\x00\x00", end=False)
    client.send(sids[1], b"\x00\x00\x00", end=True)
    exchange(server, client, cut=1)
    assert len(ok_ids(client, sids[0])) == 5 and len(ok_ids(client, sids[1])) == 1
    after = client.call(FETCH)
    exchange(server, client)
    assert ok_ids(client, after)


@BOTH
def test_fetch_multi_over_the_limit_is_invalid_argument(fast: bool) -> None:
    server, client, _ = connect(fast)
    sid = client.call(FETCH_MULTI, b"\x08" + varint(1001))
    exchange(server, client)
    assert status(client, sid) == (b"200", b"3", b"too many IDs requested: 1001, n must be from 1 to 1000")
    assert server._service.counters.commands == 1 and server._service.counters.ids == 0


class ChosenIds:
    """A generator handing out chosen values: the fast path's reply bytes against protobuf's."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)
        self.monotonic_ns = time.monotonic_ns  # the clock the frame budget reads

    def next_id(self) -> int:
        return self.values.pop(0)

    def next_ids(self, n: int) -> list[int]:
        out, self.values = self.values[:n], self.values[n:]
        return out


EDGES = [1, 127, 128, 16383, 16384, 1 << 35, (1 << 56) - 1, 1 << 56, (1 << 63) - 1, (1 << 64) - 1, 0]


@BOTH
def test_replies_are_the_bytes_protobuf_writes(fast: bool) -> None:
    server = GrpcConnection(GrpcService(Issuer(ChosenIds(EDGES * 2), "1.0.0")), fast=fast)
    client = Client()
    client.take(server.receive(client.pending()))
    singles = [client.call(FETCH) for _ in EDGES]
    exchange(server, client)
    multi = client.call(FETCH_MULTI, b"\x08" + varint(len(EDGES)))
    exchange(server, client)
    for sid, value in zip(singles, EDGES, strict=True):
        assert split_messages(client.replies[sid].data) == [pb.FetchResponse(id=value).SerializeToString()]
    assert split_messages(client.replies[multi].data) == [pb.FetchMultiResponse(ids=EDGES).SerializeToString()]
    assert served_fast(server, client) == (len(EDGES) + 1 if fast else 0)


def test_table_neutral_blocks() -> None:
    assert table_neutral(b"\x82\x86\x84")  # indexed
    assert table_neutral(b"\x04\x05/path")  # literal without indexing, indexed name
    assert table_neutral(b"\x10\x03abc\x03def")  # never indexed, literal name
    assert table_neutral(b"\xff\x80\x01")  # an indexed field with a long integer
    assert not table_neutral(b"\x82\x44\x05/path")  # literal with incremental indexing
    assert not table_neutral(b"\x20")  # a table size update
    assert not table_neutral(b"\x04\x09/pa")  # a string cut short
    assert not table_neutral(b"\xff\x80\x80\x80\x80\x80\x01")  # an integer too long


@pytest.mark.parametrize("sizes", [(1, 1), (126, 0), (127, 127), (130, 1), (1, 5000)])
def test_literal_blocks_decode_to_their_headers_and_leave_the_table_alone(sizes: tuple[int, int]) -> None:
    from hpack import Decoder

    headers = [(b":path", b"/katsubushi.Generator/Fetch"), (b"n" * sizes[0], b"v" * sizes[1])]
    decoder = Decoder()
    block = literal_block(headers)
    assert decoder.decode(block, raw=True) == headers and table_neutral(block)
    assert len(decoder.header_table.dynamic_entries) == 0


def test_a_block_that_changes_the_table_clears_what_was_recognised() -> None:
    server, client, _ = connect(True)
    for _ in range(3):
        client.call(FETCH)
    exchange(server, client)
    assert server._cache_len() == 1
    client.call(FETCH, headers=grpc_headers(FETCH, x_custom=b"a-new-value"))  # h2 indexes the new field
    exchange(server, client)
    assert server._cache_len() == 0
    for _ in range(3):
        client.call(FETCH, headers=grpc_headers(FETCH, x_custom=b"a-new-value"))
    exchange(server, client)
    assert server._cache_len() == 1
    assert all(status(client, sid)[1] == b"0" for sid in client.replies)


@BOTH
def test_a_smaller_header_table_holds_the_fast_path_until_h2_has_said_so(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.call(FETCH)
    client.call(FETCH)
    exchange(server, client)
    client.h2.update_settings({SettingCodes.HEADER_TABLE_SIZE: 0})
    exchange(server, client)
    assert not server._fast  # h2's encoder owes the client a table size update
    sids = [client.call(FETCH) for _ in range(3)]
    exchange(server, client)
    assert all(status(client, sid)[1] == b"0" for sid in sids)
    assert server._fast == fast


@BOTH
def test_replies_wait_for_a_tiny_flow_control_window(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 10})
    exchange(server, client)
    sid = client.call(FETCH_MULTI, b"\x08" + varint(1000))
    for _ in range(2000):  # each round: the client reads what came and opens its window again
        exchange(server, client)
        if client.replies[sid].ended:
            break
    assert len(ok_ids(client, sid)) == 1000


@BOTH
def test_the_inbound_window_is_given_back(fast: bool) -> None:
    """70 KB of requests, more than the 64 KB connection window, in calls the fast path takes: the
    server gives the window back as it goes (else the calls past 64 KB would be a flow-control error)."""
    server, client, _ = connect(fast)
    first = client.call(FETCH)
    exchange(server, client)
    block = client.h2.encoder.encode(grpc_headers(FETCH))  # indexed now: the same bytes every time
    # The slow path (h2) is slower: its calls carry 250 bytes of padding, which counts as flow-controlled.
    per_call, calls, pad = (5, 100, b"") if fast else (256, 2, b"\x00" * 250)
    data = frame(0, 9, 0, bytes((len(pad),)) + message(b"") + pad)[9:] if pad else message(b"")
    sid, given, answered, window = first + 2, 0, 0, 65535
    for _ in range(140):
        batch = b"".join(
            frame(1, 4, s, block) + frame(0, 9 if pad else 1, s, data) for s in range(sid, sid + 2 * calls, 2)
        )
        batch += frame(8, 0, 0, (calls * 20).to_bytes(4, "big"))  # the client reads the replies: room for more
        sid += 2 * calls
        out = server.receive(batch)
        window -= per_call * calls
        assert window >= 0
        at = 0
        while at < len(out):
            length, kind, flags = int.from_bytes(out[at : at + 3], "big"), out[at + 3], out[at + 4]
            stream = int.from_bytes(out[at + 5 : at + 9], "big")
            assert kind != 7, "GOAWAY"
            if kind == 8 and stream == 0:
                increment = int.from_bytes(out[at + 9 : at + 13], "big")
                given += increment
                window += increment
            answered += kind == 1 and flags & 1
            at += 9 + length
    assert answered == 140 * calls and server._service.counters.commands == 140 * calls + 1
    assert given >= 140 * calls * per_call - 65535 // 2
    assert (server._h2.highest_inbound_stream_id == sid - 2) != fast  # the slow path saw every stream


# -- answers the specifications give -------------------------------------------------------------------
@BOTH
def test_a_call_refused_from_its_headers_is_answered_once_the_client_has_sent_its_body(fast: bool) -> None:
    """curl 7.88 sent its body after an answer that came first, then waited for nothing until its own
    timeout (about one unknown-method call in thirty, by timing): the refusal waits for the request to
    be whole, then comes at once, with no RST_STREAM."""
    server, client, _ = connect(fast)
    nope = client.open(b"/katsubushi.Generator/Nope")  # HEADERS without END_STREAM: the body follows
    client.take(server.receive(client.pending()))
    assert client.replies[nope].headers == {} and not client.replies[nope].ended
    client.send(nope, message(b""))  # the body, and the end of the client's side
    client.take(server.receive(client.pending()))
    assert status(client, nope) == (b"200", b"12", b"unknown method Nope for service katsubushi.Generator")
    assert client.replies[nope].ended and client.replies[nope].reset is None
    assert server._calls == {}  # nothing left of it
    fetch = client.call(FETCH)  # and the connection serves on
    exchange(server, client)
    assert status(client, fetch)[:2] == (b"200", b"0")


@BOTH
def test_bad_calls_get_the_grpc_answers(fast: bool) -> None:
    server, client, _ = connect(fast)
    ctype = client.open(FETCH, grpc_headers(FETCH, content_type=b"text/plain"))
    client.send(ctype, message(b""))
    no_ctype = client.open(FETCH, grpc_headers(FETCH, content_type=b"", method=b"GET"), end=True)
    method = client.open(FETCH, grpc_headers(FETCH, method=b"PUT"), end=True)
    nope = client.call(b"/katsubushi.Generator/Nope")
    service = client.call(b"/foo.Bar/Baz")
    big = client.open(FETCH_MULTI)
    client.send(big, b"\x00" + (100_000).to_bytes(4, "big") + b"\x00" * 50, end=False)
    gzip = client.open(FETCH, grpc_headers(FETCH, grpc_encoding=b"gzip"))
    client.send(gzip, message(b"", flag=1))
    flagged = client.call(FETCH, b"")
    client.replies[flagged] = client.replies[flagged]
    none = client.open(FETCH, end=True)
    two = client.open(FETCH)
    client.send(two, message(b"") + message(b""))
    cut = client.open(FETCH_MULTI)
    client.send(cut, message(b"\x08\x05")[:-1])
    garbage = client.call(FETCH_MULTI, b"\x08")
    timeout = client.open(FETCH, grpc_headers(FETCH, grpc_timeout=b"soon"))
    client.send(timeout, message(b""))
    exchange(server, client)
    assert status(client, ctype) == (b"415", b"3", b'invalid gRPC request content-type "text/plain"')
    assert status(client, no_ctype) == (b"415", b"3", b'invalid gRPC request content-type ""')
    assert status(client, method) == (b"405", b"13", b'method "PUT" is not allowed: gRPC calls are POST')
    assert status(client, nope) == (b"200", b"12", b"unknown method Nope for service katsubushi.Generator")
    assert status(client, service) == (b"200", b"12", b"unknown service foo.Bar")
    assert status(client, big) == (b"200", b"8", b"grpc: received message larger than max (100000 vs. 4096)")
    assert client.replies[big].reset == ErrorCodes.NO_ERROR  # the client was still sending
    assert status(client, gzip)[:2] == (b"200", b"12")
    assert client.replies[gzip].headers[b"grpc-accept-encoding"] == b"identity"
    assert status(client, none)[:2] == (b"200", b"13")
    assert status(client, two)[:2] == (b"200", b"13")
    assert status(client, cut)[:2] == (b"200", b"13")
    assert status(client, garbage)[:2] == (b"200", b"13")
    assert status(client, timeout)[:2] == (b"400", b"13")
    assert status(client, flagged)[1] == b"0"
    assert client.goaway is None
    after = client.call(FETCH)
    exchange(server, client)
    assert status(client, after)[1] == b"0"


def test_compressed_flag_without_an_encoding_is_internal() -> None:
    server, client, _ = connect()
    sid = client.open(FETCH)
    client.send(sid, message(b"", flag=1))
    exchange(server, client)
    assert status(client, sid) == (b"200", b"13", b"grpc: compressed flag set with identity or empty encoding")


def test_http1_gets_a_505_and_a_close() -> None:
    server, _ = make_server()
    reply = server.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n") and b"HTTP/2" in reply
    assert server.closing


@pytest.mark.parametrize("first", [b"\x16\x03\x01\x02\x00\x01\x00", b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", b"hello"])
def test_a_wrong_preface_gets_goaway_protocol_error(first: bytes) -> None:
    server, _ = make_server()
    reply = server.receive(first + b"\x00" * 30)
    goaway = reply[reply.index(b"\x07\x00\x00\x00\x00\x00") - 3 :]
    assert goaway[3] == 7 and int.from_bytes(goaway[13:17], "big") == ErrorCodes.PROTOCOL_ERROR
    assert server.closing


def test_the_preface_may_arrive_a_byte_at_a_time() -> None:
    server, _ = make_server()
    client = Client()
    sid = client.call(FETCH)
    for byte in client.pending():
        client.take(server.receive(bytes((byte,))))
    assert ok_ids(client, sid)


@BOTH
def test_streams_beyond_the_limit_are_refused_not_the_connection(fast: bool) -> None:
    server, _ = make_server(fast)
    client = Client()  # the client has not read the server's SETTINGS: it opens 101 streams at once
    sids = [client.open(FETCH) for _ in range(grpc_frames.MAX_STREAMS + 1)]
    client.take(server.receive(client.pending()))
    assert client.replies[sids[-1]].reset == ErrorCodes.REFUSED_STREAM
    assert client.goaway is None
    for sid in sids[:-1]:
        client.send(sid, message(b""))
    exchange(server, client)
    assert all(status(client, sid)[1] == b"0" for sid in sids[:-1])


@BOTH
def test_a_flood_of_pings_gets_goaway_enhance_your_calm(fast: bool) -> None:
    server, client, _ = connect(fast)
    for i in range(500):
        client.h2.ping(i.to_bytes(8, "big"))
    exchange(server, client)
    assert client.goaway is None  # a burst of 500 is answered
    raw = b"".join(frame(6, 0, 0, i.to_bytes(8, "big")) for i in range(1000))
    client.take(server.receive(raw))
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert server.closing


@BOTH
def test_a_flood_of_settings_and_resets_gets_goaway(fast: bool) -> None:
    # The budget refills with time, the generator's: the test's fake clock stands still here, so the
    # count alone decides (on a loaded machine, real time would earn back what parsing 1,200 frames spends).
    server, client, _ = connect(fast)
    settings = frame(4, 0, 0, b"\x00\x03\x00\x00\x00\x64") * 1200
    client.take(server.receive(settings))
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    server, client, _ = connect(fast)
    opened = b"".join(
        frame(1, 4, sid, client.h2.encoder.encode(grpc_headers(FETCH))) + frame(3, 0, sid, b"\x00\x00\x00\x08")
        for sid in range(1, 2400, 2)
    )
    client.take(server.receive(opened))
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM


@BOTH
def test_a_header_list_too_large_closes_the_connection(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.open(FETCH, grpc_headers(FETCH, x_big=b"x" * 20_000))
    exchange(server, client)
    assert client.goaway is not None and client.goaway.error_code != ErrorCodes.NO_ERROR
    assert server.closing


@BOTH
def test_a_frame_too_large_gets_goaway_frame_size_error(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.take(server.receive(frame(0, 0, 1, b"\x00" * 20_000)))
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.FRAME_SIZE_ERROR


@BOTH
def test_a_reset_that_crosses_the_reply_is_ignored(fast: bool) -> None:
    server, client, _ = connect(fast)
    first = client.call(FETCH)
    second = client.call(FETCH)
    exchange(server, client)
    assert ok_ids(client, first) and ok_ids(client, second)
    client.take(server.receive(frame(3, 0, first, b"\x00\x00\x00\x08") + frame(8, 0, second, b"\x00\x00\x01\x00")))
    third = client.call(FETCH)
    exchange(server, client)
    assert client.goaway is None and ok_ids(client, third)


@BOTH
def test_a_call_waits_for_the_clock_and_is_answered_after(fast: bool) -> None:
    server, client, clock = connect(fast)
    first = client.call(FETCH)
    exchange(server, client)
    clock.step_wall_ms(-3)  # the wall clock steps back 3 ms: the generator waits rather than repeat
    server._service.issuer.generator.reanchor()
    waiting = client.call(FETCH)
    behind = client.call(FETCH)
    client.take(server.receive(client.pending()))
    assert server.wait > 0 and not client.replies[waiting].ended
    assert server.receive(b"") == b""  # nothing is read meanwhile
    while server.wait:
        clock.advance_ns(int(server.wait * 1e9) + 1)
        client.take(server.resume())
    ids = [ok_ids(client, sid)[0] for sid in (first, waiting, behind)]
    assert ids == sorted(ids) and len(set(ids)) == 3
    exchange(server, client)
    assert server._fast == fast


@BOTH
def test_a_generation_failure_is_unavailable_with_the_reason(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.call(FETCH)
    client.call(FETCH)
    exchange(server, client)
    server._service.issuer.generator.close()
    sid = client.call(FETCH)
    multi = client.call(FETCH_MULTI, b"\x08\x05")
    exchange(server, client)
    for call in (sid, multi):
        assert status(client, call)[:2] == (b"200", b"14")
        reply = client.replies[call]
        assert (reply.trailers or reply.headers)[b"katsubushi-reason"] == b"closed"


def test_a_bug_in_a_method_answers_that_call_with_internal(caplog: pytest.LogCaptureFixture) -> None:
    server, client, _ = connect(False)

    def broken() -> list[tuple[str, object]]:
        raise RuntimeError("a bug")

    server._service.issuer.stats_fields = broken
    sid = client.call(STATS)
    after = client.call(FETCH)
    exchange(server, client)
    assert status(client, sid) == (b"200", b"13", b"internal error; see the daemon's log")
    assert ok_ids(client, after) and "a bug" in caplog.text


@BOTH
def test_goodbye_is_goaway_naming_the_last_stream(fast: bool) -> None:
    server, client, _ = connect(fast)
    sids = [client.call(FETCH) for _ in range(3)]
    exchange(server, client)
    half = client.open(FETCH)  # HEADERS only: not processed
    client.take(server.receive(client.pending()))
    client.take(server.goodbye())
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.NO_ERROR
    assert client.goaway.last_stream_id == (sids[-1] if fast else half)
    assert server.closing and server.receive(b"anything") == b""


@BOTH
def test_stats_and_reflection(fast: bool) -> None:
    server, client, _ = connect(fast)
    client.call(FETCH)
    stats = client.call(STATS)
    requests = [
        rpb.ServerReflectionRequest(list_services=""),
        rpb.ServerReflectionRequest(file_containing_symbol="katsubushi.Generator.Fetch"),
        rpb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
        rpb.ServerReflectionRequest(file_by_filename="katsubushi_py/frontends/katsubushi.proto"),
        rpb.ServerReflectionRequest(file_containing_symbol="no.Such"),
        rpb.ServerReflectionRequest(all_extension_numbers_of_type="katsubushi.FetchRequest"),
    ]
    reflect = client.open(REFLECTION)
    client.send(reflect, b"".join(message(r.SerializeToString()) for r in requests[:2]), end=False)
    exchange(server, client)
    assert len(split_messages(client.replies[reflect].data)) == 2  # answered as they come, stream still open
    client.send(reflect, b"".join(message(r.SerializeToString()) for r in requests[2:]))
    v1 = client.call(b"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", requests[0].SerializeToString())
    exchange(server, client)
    reply = pb.StatsResponse.FromString(split_messages(client.replies[stats].data)[0])
    assert (reply.cmd_get, reply.get_hits, reply.version) == (1, 1, "1.0.0")
    answers = [rpb.ServerReflectionResponse.FromString(m) for m in split_messages(client.replies[reflect].data)]
    assert status(client, reflect)[1] == b"0"
    names = {s.name for s in answers[0].list_services_response.service}
    assert names == {
        "katsubushi.Generator",
        "katsubushi.Stats",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(a.file_descriptor_response.file_descriptor_proto[0])
        for a in answers[1:4]
    ]
    assert [f.package for f in files] == ["katsubushi", "grpc.reflection.v1", "katsubushi"]
    assert files[1].service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert answers[4].error_response.error_code == 5
    assert answers[5].all_extension_numbers_response.base_type_name == "katsubushi.FetchRequest"
    v1_answer = rpb.ServerReflectionResponse.FromString(split_messages(client.replies[v1].data)[0])
    assert len(v1_answer.list_services_response.service) == 4


def test_the_preface_is_what_h2_expects() -> None:
    assert PREFACE == b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

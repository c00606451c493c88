"""The gRPC connection's budgets, sans-IO on both paths (issue 33): every frame the slow path takes
counts in the flood budget (WINDOW_UPDATE too), calls answered earn it back, and a header block has
a size and ends within the request deadline. The real-process attacks are in tests/test_hostile.py."""

from __future__ import annotations

import pytest
from grpc_conversations import FETCH, Client, grpc_headers, make_server, message
from h2.errors import ErrorCodes

from katsubushi_py.daemon.deadlines import holds_partial_request
from katsubushi_py.frontends.grpc_frames import (
    CONTINUATION,
    END_HEADERS,
    FLOOD_BURST,
    HEADERS,
    IDLE_WINDOW_UPDATES,
    MAX_HEADER_BLOCK,
    WINDOW_UPDATE,
    frame,
)

BOTH = pytest.mark.parametrize("fast", [True, False], ids=["fast", "slow"])


def connect(fast: bool):
    # The budget refills by the generator's clock, here the fake one, which stands still unless a test
    # moves it: the count alone decides.
    server, _ = make_server(fast)
    client = Client()
    client.take(server.receive(client.pending()))
    client.take(server.receive(client.pending()))
    return server, client


@BOTH
def test_window_updates_on_an_open_stream_spend_the_budget(fast: bool) -> None:
    server, client = connect(fast)
    sid = client.open(FETCH)  # a stream left open: no DATA, so the slow path takes what follows
    client.take(server.receive(client.pending()))
    flood = b"".join(
        frame(WINDOW_UPDATE, 0, sid if i % 2 else 0, b"\x00\x00\x00\x01")
        for i in range(IDLE_WINDOW_UPDATES + FLOOD_BURST + 10)
    )
    client.take(server.receive(flood))
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert server.closing


@BOTH
def test_a_client_making_calls_never_runs_out(fast: bool) -> None:
    # Each call with three window updates and a ping around it: five frames for the slow path (on the
    # slow one); what the calls answered earn back keeps the client within its budget for ever.
    server, client = connect(fast)
    ids = 0
    for _ in range(1500):
        sid = client.open(FETCH)
        client.send(sid, message(b""))
        client.h2.increment_flow_control_window(100)
        client.h2.increment_flow_control_window(100, stream_id=sid)
        client.h2.ping(b"12345678")
        client.take(server.receive(client.pending()))
        ids += bool(client.replies[sid].ids())
    assert client.goaway is None and not server.closing
    assert ids == 1500


@BOTH
def test_a_header_block_over_its_size_closes_the_connection(fast: bool) -> None:
    server, client = connect(fast)
    block = client.h2.encoder.encode(grpc_headers(FETCH))
    raw = frame(HEADERS, 0, 1, block) + b"".join(frame(CONTINUATION, 0, 1, b"\x00" * 16384) for _ in range(3))
    client.take(server.receive(raw))
    assert len(raw) > MAX_HEADER_BLOCK
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert server.closing


def split_block(data: bytes, at: int) -> tuple[bytes, bytes]:
    """A client's HEADERS frame (END_HEADERS) cut into HEADERS and a CONTINUATION at ``at``."""
    length = int.from_bytes(data[:3], "big")
    flags, sid = data[4], int.from_bytes(data[5:9], "big")
    block = data[9 : 9 + length]
    assert data[3] == HEADERS and flags & END_HEADERS and len(data) == 9 + length
    return frame(HEADERS, flags & ~END_HEADERS, sid, block[:at]), frame(CONTINUATION, END_HEADERS, sid, block[at:])


@BOTH
def test_a_header_block_in_progress_is_a_partial_request(fast: bool) -> None:
    server, client = connect(fast)
    client.open(FETCH)
    first, rest = split_block(client.pending(), 5)
    client.take(server.receive(first))
    assert holds_partial_request(server)
    client.take(server.receive(frame(CONTINUATION, 0, 1, rest[9:12])))
    assert holds_partial_request(server)
    client.take(server.expire())  # what the request deadline does
    assert client.goaway is not None and client.goaway.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert server.closing
    # The same block ended in time is a call like any other.
    server, client = connect(fast)
    sid = client.open(FETCH)
    first, rest = split_block(client.pending(), 5)
    client.take(server.receive(first))
    client.take(server.receive(rest))
    assert not holds_partial_request(server)
    client.send(sid, message(b""))
    client.take(server.receive(client.pending()))
    assert client.replies[sid].ids() and client.goaway is None

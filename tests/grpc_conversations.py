"""gRPC conversations for the sans-IO tests of frontends/grpc_h2.py: an h2 client that records every
stream's reply, a server on a fake clock, and random scripted conversations (what real clients send:
h2load's and grpc-js's HEADERS then DATA, grpcio's HEADERS, stream WINDOW_UPDATE, DATA; PINGs,
SETTINGS, window updates, bad calls, input cut at any byte).

Used by tests/test_grpc_h2.py (fast path against slow path, in one process) and tests/grpc_harness.py
(the compiled core against the pure-Python one, in two processes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from conftest import FakeClock
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
)
from h2.settings import SettingCodes

from katsubushi_py.frontends import katsubushi_pb2 as pb
from katsubushi_py.frontends.grpc_h2 import GrpcConnection
from katsubushi_py.frontends.grpc_service import GrpcService
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer

FETCH = b"/katsubushi.Generator/Fetch"
FETCH_MULTI = b"/katsubushi.Generator/FetchMulti"
STATS = b"/katsubushi.Stats/Get"
REFLECTION = b"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def grpc_headers(path: bytes, content_type: bytes = b"application/grpc", method: bytes = b"POST", **more: bytes):
    headers = [(b":method", method), (b":scheme", b"http"), (b":path", path), (b":authority", b"test")]
    if content_type:
        headers.append((b"content-type", content_type))
    headers.append((b"te", b"trailers"))
    headers += [(name.replace("_", "-").encode(), value) for name, value in more.items()]
    return headers


def message(body: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + len(body).to_bytes(4, "big") + body


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_messages(data: bytes) -> list[bytes]:
    out = []
    while len(data) >= 5:
        size = int.from_bytes(data[1:5], "big")
        out.append(data[5 : 5 + size])
        data = data[5 + size :]
    assert not data, "a reply message cut short"
    return out


def decode_ids(body: bytes) -> list[int]:
    """The IDs of a FetchResponse or FetchMultiResponse, as protobuf reads them (a FetchResponse's
    field 1 is a varint; a FetchMultiResponse's is packed, length-delimited)."""
    if body[:1] == b"\x08" or not body:
        return [pb.FetchResponse.FromString(body).id] if body else []
    return list(pb.FetchMultiResponse.FromString(body).ids)


@dataclass
class Reply:
    path: bytes = b""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytes = b""
    trailers: dict[bytes, bytes] = field(default_factory=dict)
    ended: bool = False
    reset: int | None = None

    def ids(self) -> list[int]:
        """The IDs of a successful Fetch or FetchMulti."""
        if self.path not in (FETCH, FETCH_MULTI) or (self.trailers or self.headers).get(b"grpc-status") != b"0":
            return []
        return decode_ids(split_messages(self.data)[0])

    def summary(self) -> tuple:
        return (
            self.headers.get(b":status"),
            self.headers.get(b"content-type"),
            tuple(split_messages(self.data)),
            self.trailers.get(b"grpc-status", self.headers.get(b"grpc-status")),
            self.trailers.get(b"grpc-message", self.headers.get(b"grpc-message")),
            self.trailers.get(b"katsubushi-reason"),
            self.ended,
            self.reset,
        )


class Client:
    """An HTTP/2 client (h2) that records each stream's reply and acknowledges what it reads."""

    def __init__(self) -> None:
        # No outbound validation: the tests also send headers h2 would not let a client send.
        config = H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False, normalize_outbound_headers=False
        )
        self.h2 = H2Connection(config)
        self.h2.initiate_connection()
        self.replies: dict[int, Reply] = {}
        self.goaway: ConnectionTerminated | None = None
        self.timeout = 4_999_000  # grpc-timeout in microseconds, a new one for each grpc-go call

    def open(self, path: bytes = FETCH, headers: list | None = None, end: bool = False) -> int:
        sid = self.h2.get_next_available_stream_id()
        headers = headers or grpc_headers(path)
        self.h2.send_headers(sid, headers, end_stream=end)
        self.replies[sid] = Reply(path=dict(headers)[b":path"])
        return sid

    def send(self, sid: int, data: bytes, end: bool = True) -> None:
        self.h2.send_data(sid, data, end_stream=end)

    def call(self, path: bytes, body: bytes = b"", headers: list | None = None) -> int:
        sid = self.open(path, headers)
        self.send(sid, message(body))
        return sid

    def pending(self) -> bytes:
        return self.h2.data_to_send()

    def take(self, data: bytes) -> None:
        if not data:
            return
        for event in self.h2.receive_data(data):
            reply = self.replies.get(getattr(event, "stream_id", 0) or 0)
            if isinstance(event, ResponseReceived) and reply is not None:
                reply.headers = dict(event.headers)
            elif isinstance(event, DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if reply is not None:
                    reply.data += event.data
            elif isinstance(event, TrailersReceived) and reply is not None:
                reply.trailers = dict(event.headers)
            elif isinstance(event, StreamEnded) and reply is not None:
                reply.ended = True
            elif isinstance(event, StreamReset) and reply is not None:
                reply.reset = int(event.error_code)
            elif isinstance(event, ConnectionTerminated):
                self.goaway = event


class DrainedConnection(GrpcConnection):
    """A GrpcConnection whose ``receive`` also answers what a read's budget held back (``backlog``),
    as the connection glue does a slice at a time; ``pieces`` counts the resumes that took (the twins
    must agree on where a read is cut)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.pieces = 0

    def receive(self, data: bytes) -> bytes:
        out = super().receive(data)
        while self.backlog and not self.wait and not self.closing:
            self.pieces += 1
            out += super().resume()
        return out


def make_server(fast: bool = True, sequence_bits: int = 12, drained: bool = True) -> tuple[GrpcConnection, FakeClock]:
    clock = FakeClock()
    layout = Layout(sequence_bits=sequence_bits, worker_bits=22 - sequence_bits, time_bits=41)
    generator = Generator(5, layout, clock=clock, block_on_clock=False)
    kind = DrainedConnection if drained else GrpcConnection
    return kind(GrpcService(Issuer(generator, "1.0.0")), fast=fast), clock


def script(seed: int, steps: int = 40) -> list[tuple]:
    """A random conversation: a list of steps, each a tuple (kind, arguments...)."""
    rng = random.Random(seed)
    out: list[tuple] = []
    for _ in range(steps):
        kind = rng.choices(
            [
                "nghttp2",
                "grpc-js",
                "grpcio",
                "grpc-go",
                "multi",
                "stats",
                "ping",
                "window",
                "settings",
                "bad",
                "reflect",
            ],
            weights=[8, 6, 6, 6, 6, 1, 2, 2, 1, 2, 1],
        )[0]
        cut = rng.choice([0, 0, 1, 7, 9, 13, 40, 1000])  # feed the step's bytes in pieces of this size (0: whole)
        if kind in ("nghttp2", "grpc-js", "grpcio", "grpc-go"):
            out.append((kind, rng.choice([1, 1, 2, 8, 20]), cut))
        elif kind == "multi":
            n = rng.choice([0, 1, 2, 100, 127, 128, 999, 1000, 1001, 70000])
            form = rng.choice(["plain", "plain", "empty", "long", "extra"])
            out.append((kind, n, form, cut))
        elif kind == "window":
            out.append((kind, rng.choice([1, 100, 65535, 1 << 20]), cut))
        elif kind == "settings":
            out.append((kind, rng.choice(["table", "window", "window-small", "frame"]), rng.randrange(1 << 16), cut))
        elif kind == "bad":
            out.append((kind, rng.choice(["ctype", "method", "path", "big", "compressed", "none", "two", "cut"]), cut))
        else:
            out.append((kind, cut))
    return out


def multi_body(n: int, form: str) -> bytes:
    if form == "empty" or (form == "plain" and n == 0):
        return b""
    if form == "long":  # a non-minimal varint: protobuf reads it, the fast path does not
        return b"\x08" + bytes(((n & 0x7F) | 0x80, 0x80, 0x00))
    if form == "extra":  # an unknown field after n
        return b"\x08" + varint(n) + b"\x10\x01"
    return b"\x08" + varint(n)


def play_step(client: Client, step: tuple) -> list[int]:
    """Write one step's frames into the client; returns the streams it opened."""
    kind = step[0]
    h2 = client.h2
    opened: list[int] = []
    if kind == "nghttp2":  # every HEADERS, then every DATA
        opened = [client.open(FETCH) for _ in range(step[1])]
        for sid in opened:
            client.send(sid, message(b""))
    elif kind == "grpc-js":  # HEADERS and DATA per call
        for _ in range(step[1]):
            opened.append(client.call(FETCH))
    elif kind == "grpc-go":  # a new grpc-timeout every call, which h2's encoder (as Go's) adds to the table
        for _ in range(step[1]):
            client.timeout += 1
            opened.append(client.call(FETCH, headers=grpc_headers(FETCH, grpc_timeout=b"%du" % client.timeout)))
    elif kind == "grpcio":  # HEADERS, a WINDOW_UPDATE for the reply, DATA; then one for the connection
        for _ in range(step[1]):
            sid = client.open(FETCH)
            h2.increment_flow_control_window(4096, stream_id=sid)
            client.send(sid, message(b""))
            opened.append(sid)
        if 0x7FFFFFFF - h2.inbound_flow_control_window >= 5 * step[1]:
            h2.increment_flow_control_window(5 * step[1])
    elif kind == "multi":
        opened.append(client.call(FETCH_MULTI, multi_body(step[1], step[2])))
    elif kind == "stats":
        opened.append(client.call(STATS))
    elif kind == "reflect":
        opened.append(client.call(REFLECTION, b"\x3a\x00"))  # list_services
    elif kind == "ping":
        h2.ping(b"pingpong")
    elif kind == "window":
        room = 0x7FFFFFFF - h2.inbound_flow_control_window
        if room > 0:
            h2.increment_flow_control_window(min(step[1], room))
    elif kind == "settings":
        what, value = step[1], step[2]
        if what == "table":
            h2.update_settings({SettingCodes.HEADER_TABLE_SIZE: value % 4097})
        elif what == "window":
            h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1000 + value})
        elif what == "window-small":
            h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1 + value % 64})
        else:
            h2.update_settings({SettingCodes.MAX_FRAME_SIZE: 16384 + value})
    elif kind == "bad":
        what = step[1]
        if what == "ctype":
            sid = client.open(FETCH, grpc_headers(FETCH, content_type=b"text/plain"))
            client.send(sid, message(b""))
        elif what == "method":
            sid = client.open(FETCH, grpc_headers(FETCH, method=b"PUT"), end=True)
        elif what == "path":
            sid = client.call(b"/katsubushi.Generator/Nope")
        elif what == "big":
            sid = client.open(FETCH_MULTI)
            client.send(sid, b"\x00" + (100_000).to_bytes(4, "big") + b"\x00" * 100, end=False)
        elif what == "compressed":
            sid = client.open(FETCH, grpc_headers(FETCH, grpc_encoding=b"gzip"))
            client.send(sid, message(b"", flag=1))
        elif what == "none":
            sid = client.open(FETCH, end=True)
        elif what == "two":
            sid = client.open(FETCH)
            client.send(sid, message(b"") + message(b""))
        else:  # "cut": the stream ends inside a message
            sid = client.open(FETCH_MULTI)
            client.send(sid, message(b"\x08\x05")[:-1])
        opened.append(sid)
    return opened


def chunks(data: bytes, cut: int) -> list[bytes]:
    if not cut or not data:
        return [data] if data else []
    return [data[i : i + cut] for i in range(0, len(data), cut)]

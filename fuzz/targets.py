"""Fuzz targets (issue 23): one function per entry point that consumes untrusted bytes, each taking the
fuzzer's input and raising ``AssertionError`` (or anything else: a traceback is a finding) when

- the compiled core and its pure-Python twin answer differently (ID values aside; one injected clock,
  tests/twins.py), or leave different state;
- the reply depends on how the input was split into reads;
- a connection holds more input than its documented bound (unbounded buffering);
- an exception escapes where the client must get a clear error or a clean close.

The same functions run under atheris (fuzz/run.py, coverage-guided, on the normal or the sanitized
build) and in the normal test suite (tests/test_fuzz_regressions.py replays the seed corpora and every
input a fuzzer ever found), so they must not need atheris.

An input is read with :class:`Bytes`: its first bytes choose the options and the chunking, the rest is
the payload; for the binary target the payload may also be a list of structured requests (arbitrary
magic, opcode, key, extras and body lengths, lying lengths, quiet multi-gets).
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # tests/twins.py

from twins import PureIssuer, StepClock, Twins, mask_ids, pure_twin  # noqa: E402

from katsubushi_py.frontends.binary import MAX_BODY  # noqa: E402
from katsubushi_py.frontends.text import MAX_LINE  # noqa: E402
from katsubushi_py.ids import encodings  # noqa: E402
from katsubushi_py.ids.layout import Layout  # noqa: E402
from katsubushi_py.issuing.generator import Generator  # noqa: E402
from katsubushi_py.issuing.issuer import Issuer  # noqa: E402

#: What a memcached connection may hold between reads once every reply was written: one line (text)
#: or one request (binary, body up to MAX_BODY; a larger one is discarded as it arrives).
TEXT_HELD_BOUND = MAX_LINE + 2
BINARY_HELD_BOUND = 24 + 65535 + MAX_BODY


class Bytes:
    """Reads small integers and byte strings off the front of the fuzzer's input; zeros once it ends."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def u16(self) -> int:
        return self.byte() << 8 | self.byte()

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out


def chunkings(payload: bytes, seed: int) -> list[list[bytes]]:
    """The payload whole, and cut by ``seed``: at random points, or a byte at a time (short ones)."""
    rng = random.Random(seed)
    out = [[payload]]
    if len(payload) < 2:
        return out
    if seed % 7 == 0 and len(payload) <= 128:
        out.append([payload[i : i + 1] for i in range(len(payload))])
    else:
        points = sorted(set(rng.sample(range(1, len(payload)), min(len(payload) - 1, 1 + seed % 9))))
        out.append([payload[a:b] for a, b in zip([0, *points], [*points, len(payload)], strict=True)])
    return out


def differential(protocol: str, payload: bytes, seed: int, held_bound: int, **kwargs: Any) -> None:
    """The compiled core and its twin on the payload whole and split: they agree, every split gets
    the whole payload's reply, and what is held stays under ``held_bound``."""
    twins = Twins(protocol, **kwargs)
    whole: Any = None
    for chunks in chunkings(payload, seed):
        outcome = twins.agree(chunks)
        assert len(outcome.held) <= held_bound, f"{protocol}: {len(outcome.held)} bytes held for reads {chunks!r}"
        if whole is None:
            whole = outcome
        else:
            assert outcome.without_ids() == whole.without_ids(), (
                f"{protocol}: the reply depends on the split {[len(c) for c in chunks]}\n"
                f"whole: {whole.without_ids()!r}\nsplit: {outcome.without_ids()!r}"
            )


# -- memcached text and meta ---------------------------------------------------------------------


def text(data: bytes) -> None:
    """The text and meta protocol: the input as a client's bytes (repeated, now and then, so that a
    bound on what is held shows)."""
    b = Bytes(data)
    options, seed = b.byte(), b.u16()
    max_line = MAX_LINE
    if options & 0x80:  # a short line limit (as --max-line... would set), and input well past it
        max_line = 32 + b.byte() * 4
    payload = b.rest()
    if options & 0x80 and payload:
        payload *= 1 + 3 * max_line // len(payload)
    bound = max_line + TEXT_HELD_BOUND - MAX_LINE + 256  # a line, or a get line's one incomplete key
    differential("text", payload, seed, bound, gets_cas=bool(options & 1), max_line=max_line)


# -- memcached binary ------------------------------------------------------------------------------

OPCODES = [0x00, 0x09, 0x0C, 0x0D, 0x0A, 0x0B, 0x10, 0x07, 0x17, 0x01, 0x02, 0x03, 0x04, 0x05, 0x1C, 0x42]


def binary_requests(b: Bytes) -> bytes:
    """Requests made from the input: opcode (mostly a known one), key, extras and body lengths, the
    declared body length right or off (short, long, huge), magic right or not."""
    out = bytearray()
    while b.pos < len(b.data) and len(out) < 1 << 16:
        kind = b.byte()
        opcode = OPCODES[kind & 0x0F] if kind & 0x10 == 0 else b.byte()
        keylen = b.byte() if kind & 0x20 == 0 else 240 + b.byte() % 20
        extlen = b.byte() % 12 if kind & 0x40 == 0 else b.byte()
        vsize = b.byte() if kind & 0x80 == 0 else (MAX_BODY - 8, MAX_BODY + 1, 20_000, 0)[b.byte() % 4]
        lie = b.byte()
        opaque = b.take(4).ljust(4, b"\0")
        body = b"k" * keylen
        body = bytes(extlen) + body + b"v" * vsize
        declared = len(body)
        if lie & 0x07 == 1:
            declared = max(0, declared - 1 - lie // 8)
        elif lie & 0x07 == 2:
            declared += 1 + lie // 8
        elif lie & 0x07 == 3:
            declared = 0xFFFFFFFF - lie
        magic = 0x80 if lie & 0xF0 != 0xF0 else lie
        out += bytes((magic, opcode)) + keylen.to_bytes(2, "big") + bytes((extlen % 256, 0, 0, 0))
        out += declared.to_bytes(4, "big") + opaque + bytes(8) + body
    return bytes(out)


def binary(data: bytes) -> None:
    """The binary protocol: the input as raw bytes, or as structured requests (first byte odd)."""
    b = Bytes(data)
    options, seed = b.byte(), b.u16()
    payload = binary_requests(b) if options & 1 else b.rest()
    if options & 1 == 0 and payload and payload[0] != 0x80:
        payload = b"\x80" + payload  # the daemon sends a connection whose first byte is 0x80 here
    differential("binary", payload, seed, BINARY_HELD_BOUND)


# -- HTTP ------------------------------------------------------------------------------------------

_DATE = re.compile(rb"\r\nDate: [^\r]*")


def _http_connection(clock: StepClock) -> Any:
    from katsubushi_py.frontends.http import HttpApi, HttpConnection

    generator = Generator(5, Layout(), clock=clock, block_on_clock=False)
    return HttpConnection(HttpApi(Issuer(generator, "1.0.0")))


def http(data: bytes) -> None:
    """The HTTP request path (httptools and our handlers): no exception, the same replies (ID values
    and the Date header aside) however the input is split, a clean close after a refusal."""
    from katsubushi_py.frontends.http import HttpConnection

    b = Bytes(data)
    seed = b.u16()
    payload = b.rest()
    outcomes = []
    for chunks in chunkings(payload, seed):
        clock = StepClock()
        conn = _http_connection(clock)
        reply = b""
        for chunk in chunks:
            reply += conn.receive(chunk)
            while conn.wait and not conn.closing:
                clock.advance_ns(int(conn.wait * 1e9) + 1)
                reply += conn.resume()
            if conn.closing:
                break
        assert isinstance(conn, HttpConnection)
        held = len(conn._pending)
        assert held <= len(payload), held
        outcomes.append((mask_ids(_DATE.sub(b"", reply)), conn.closing, conn.activity))
    assert all(o == outcomes[0] for o in outcomes), f"HTTP reply depends on the split:\n{outcomes!r}"


# -- ID encodings ----------------------------------------------------------------------------------


def ids(data: bytes) -> None:
    """Every decoder: text is an ID (0 to 2**64-1, ASCII, encoded back to text that decodes to the same
    ID) or a clean EncodingError."""
    if not data:
        return
    names = list(encodings.ENCODINGS)
    name = names[data[0] % len(names)]
    text = data[1:].decode("utf-8", "replace")
    try:
        value = encodings.decode(text, name)
    except encodings.EncodingError:
        return
    assert isinstance(value, int) and 0 <= value < 2**64, (name, text, value)
    assert text.strip().isascii(), f"{name} accepted non-ASCII text {text!r} as {value}"
    again = encodings.encode(value, name)
    assert encodings.decode(again, name) == value, (name, text, value, again)


# -- gRPC ------------------------------------------------------------------------------------------


class _Clock(StepClock):
    """The gRPC connection's flood budget reads time.monotonic: the fuzz run replaces it with this."""


def _grpc_pair() -> tuple[Callable[[bool], tuple[Any, StepClock]], Any]:
    from katsubushi_py.frontends.grpc_h2 import GrpcConnection
    from katsubushi_py.frontends.grpc_service import GrpcService

    def make(pure: bool) -> tuple[Any, StepClock]:
        clock = StepClock()
        layout = Layout(sequence_bits=4, worker_bits=18, time_bits=41)  # 16 IDs a ms: refills and waits
        gen_class = pure_twin(Generator) if pure else Generator
        generator = gen_class(5, layout, clock=clock, block_on_clock=False)
        issuer = (PureIssuer if pure else Issuer)(generator, "1.0.0")
        cls = _pure_grpc(GrpcConnection) if pure else GrpcConnection
        return cls(GrpcService(issuer)), clock

    return make, GrpcConnection


_pure_grpc_classes: dict[type, type] = {}


def _pure_grpc(cls: type) -> type:
    """GrpcConnection rebuilt on PyGrpcCore (what KATSUBUSHI_NO_EXTENSIONS=1 builds)."""
    from katsubushi_py.frontends.grpc_fast import GrpcCore, PyGrpcCore

    if PyGrpcCore in cls.__mro__:
        return cls
    if cls not in _pure_grpc_classes:
        slots = set(cls.__slots__)
        namespace = {k: v for k, v in vars(cls).items() if k not in slots and k not in ("__dict__", "__weakref__")}
        # The same bases (GrpcCalls, the calls' half) with the compiled core swapped for its pure twin.
        bases = tuple(PyGrpcCore if base is GrpcCore else base for base in cls.__bases__)
        _pure_grpc_classes[cls] = type("Pure" + cls.__name__, bases, namespace)
    return _pure_grpc_classes[cls]


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def grpc_frames(b: Bytes) -> bytes:
    """HTTP/2 frames made from the input: type, flags, stream id, payload (or raw bytes)."""
    out = bytearray()
    while b.pos < len(b.data) and len(out) < 1 << 16:
        head = b.byte()
        if head == 0xFF:
            out += b.take(b.byte())
            continue
        ftype = head % 10
        flags = b.byte()
        sid = b.byte() if head & 0x10 == 0 else b.u16() << 15 | b.u16()
        size = b.byte() if head & 0x20 == 0 else b.u16()
        payload = b.take(size)
        out += len(payload).to_bytes(3, "big") + bytes((ftype, flags)) + (sid & 0x7FFFFFFF).to_bytes(4, "big") + payload
    return bytes(out)


def _grpc_run(conn: Any, clock: StepClock, chunks: list[bytes]) -> tuple[bytes, list[Any]]:
    reply = b""
    for chunk in chunks:
        reply += conn.receive(chunk)
        for _ in range(1000):  # as the connection glue: the clock's waits, and a read held back (backlog)
            if not (conn.wait or conn.backlog) or conn.closing:
                break
            if conn.wait:
                clock.advance_ns(int(conn.wait * 1e9) + 1)
            reply += conn.resume()
        if conn.closing:
            break
    counters = conn._service.counters
    state = [
        conn._fast,
        conn._last_stream,
        conn._out_window,
        conn._peer_window,
        conn._in_window,
        conn._debt,
        conn._handed,
        conn._cache_len(),
        conn._buffer,
        conn.activity,
        conn.closing,
        conn.wait,
        counters.commands,
        counters.ids,
        sorted(counters.failures.items()),
    ]
    return reply + conn.goodbye(), state


def grpc(data: bytes) -> None:
    """The gRPC server (fast path and h2's slow path): the compiled core and its twin, each on its own
    copy of the clock, answer byte for byte alike (IDs included) on the same reads, whole and split;
    nothing escapes as an exception; the input held stays bounded."""

    make, _ = _grpc_pair()
    b = Bytes(data)
    options, seed = b.byte(), b.u16()
    if options & 1:
        payload = b.rest()
        if options & 2:
            payload = PREFACE + payload
    else:
        payload = PREFACE + grpc_frames(b)
    # The frame budget refills by each connection's generator clock (StepClock): the same for both twins.
    for chunks in chunkings(payload, seed):
        results = []
        for pure in (False, True):
            conn, clock = make(pure)
            results.append(_grpc_run(conn, clock, chunks))
            held = len(conn._buffer) + len(conn._held)
            assert held <= len(payload), held
        assert results[0] == results[1], f"gRPC: compiled and pure differ on reads {[len(c) for c in chunks]}"


# -- the socket transport (fuzz/transport_target.py, which needs this module first) -------------------


def transport(data: bytes) -> None:
    """The memcached connection over a real socket pair and event loop: compiled transport and glue
    against their pure twins."""
    import transport_target

    transport_target.transport(data)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "transport": transport,
    "text": text,
    "binary": binary,
    "http": http,
    "ids": ids,
    "grpc": grpc,
}

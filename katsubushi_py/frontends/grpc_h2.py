"""gRPC over HTTP/2, sans-IO: bytes in, bytes out, on the daemon's own event loop and connection glue.

Two paths share one connection, and must always agree (tests/test_grpc_h2.py plays the same
conversations through both and compares what a client decodes):

- **The slow path** (:meth:`GrpcConnection._receive_slow`) is everything: the ``h2`` library (sans-IO,
  well kept) does the connection preface, SETTINGS, PING, flow control, HPACK, stream states, RST_STREAM
  and GOAWAY; this module splits the input into frames, feeds them to h2 one by one, turns h2's events
  into calls of :class:`~.grpc_service.GrpcService`, and answers with h2.
- **The fast path** (:class:`PyGrpcCore`, compiled twin ``_grpc_speedups.GrpcCore``) is the steady
  state of ``Fetch`` and ``FetchMulti``: a HEADERS frame whose header block it recognises, then the
  DATA frame with the stream's one message and END_STREAM, answered with precomputed HEADERS, the
  DATA frame with the IDs, and the trailers; also connection WINDOW_UPDATEs. At the first frame it
  does not take it hands the rest of the input to the slow path (with the HEADERS frames of calls it
  had started, which h2 then opens as if it had seen them first).

Recognising a header block without decoding it: an HPACK block that has only indexed fields and
literals *without indexing* (or never indexed) leaves the dynamic table as it was, so while no other
kind of block is decoded, the same bytes always mean the same headers. h2load's, grpcio's and
grpc-js's blocks after the first are of that kind (indexed fields, an unindexed ``:path``).

A block the fast path does not recognise goes to the slow path, which, in steady state, decodes it
itself with h2's own decoder (HPACK stays in step; h2's errors) and, if it is a plain ``Fetch`` or
``FetchMulti`` (:func:`_plain_call`, deliberately narrower than h2's rules), gives the call to the fast
path (:meth:`PyGrpcCore._pending_add`) and remembers the block if it is table-neutral
(:meth:`PyGrpcCore._cache_add`); any other block makes it forget them all
(:meth:`PyGrpcCore._cache_clear`). So grpc-go, which adds every new ``grpc-timeout`` value to the
table, costs a decode per call but no h2 stream. When h2 must see such a call after all (the fast
path hands over), it gets a block of the same headers as literals without indexing
(:func:`literal_block`), which leaves the table alone. The fast path's reply blocks use the static
table and literals without indexing only, so they never touch the dynamic table of h2's encoder
either; while the client has asked for a smaller table and h2's encoder owes it a size update, the
fast path stays off.

State the paths share, handed over at each switch: the highest stream id (h2's
``highest_inbound_stream_id``), the connection's outbound window (h2's ``outbound_flow_control_window``),
the client's initial stream window, and the inbound window: the fast path counts the DATA bytes it
consumed (``_debt``) and gives them back with a WINDOW_UPDATE once they reach half of h2's window, as
h2 would, or before the slow path runs, so h2's own window account is exact whenever it is used.

What a client can make a connection hold (each limit answered as the HTTP/2 and gRPC specifications
say): one incomplete frame (``MAX_FRAME`` + 9 bytes); ``MAX_STREAMS`` open calls (more are refused
with RST_STREAM REFUSED_STREAM), each holding at most one request message of ``MAX_MESSAGE`` bytes
(a larger one is ``RESOURCE_EXHAUSTED``) and at most one reply that the client's flow-control window
does not take yet (at most about 10 KB: 1,000 IDs); a header list of ``MAX_HEADER_LIST`` bytes (a larger
one closes the connection with GOAWAY: HPACK cannot skip a block); while a call waits for the clock,
one read of input. PING, SETTINGS, RST_STREAM, PRIORITY, empty DATA and unknown frames draw on a
budget of ``FLOOD_BURST`` refilled at ``FLOOD_RATE`` a second; a client that spends it is sent
GOAWAY ENHANCE_YOUR_CALM (the HTTP/2 flood attacks of 2019 and 2023). Replies the client does not
read stop the reading of its requests (the connection glue's flow control).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from h2.config import H2Configuration
from h2.connection import H2Connection, _decode_headers
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import ProtocolError
from h2.settings import SettingCodes, Settings
from h2.stream import StreamClosedBy
from hyperframe.frame import RstStreamFrame

from ..issuing.errors import ClockWait
from ..issuing.issuer import MAX_IDS_PER_REQUEST
from . import grpc_service as svc
from .grpc_service import GrpcService, Reply, fetch_multi_reply, fetch_reply

log = logging.getLogger("katsubushi_py")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the protocol's default, never raised
MAX_STREAMS = 100  # SETTINGS_MAX_CONCURRENT_STREAMS
MAX_HEADER_LIST = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE (the HTTP front end's MAX_HEAD)
MAX_MESSAGE = 4096  # a request message (reflection's are the largest, a symbol name)
FLOOD_BURST = 1000
FLOOD_RATE = 100.0  # control frames a second, sustained
CACHE_SIZE = 16  # recognised header blocks per connection
RETURN_AT = 65535 // 2  # inbound bytes given back with a WINDOW_UPDATE (h2's rule: half its window)

# Frame types and flags (RFC 9113 section 6).
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8

#: The fast path's reply header blocks: ``:status: 200`` (static index 8) and ``content-type:
#: application/grpc`` (a literal without indexing, name index 31); ``grpc-status: 0`` (a literal without
#: indexing, new name). Neither adds to the dynamic table.
REPLY_HEADERS = b"\x00\x00\x14\x01\x04"  # length 20, HEADERS, END_HEADERS; then the stream id
REPLY_BLOCK = b"\x88\x0f\x10\x10application/grpc"
TRAILERS = b"\x00\x00\x0f\x01\x05"  # length 15, HEADERS, END_STREAM | END_HEADERS
TRAILERS_BLOCK = b"\x00\x0bgrpc-status\x010"

_HTTP1_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
HTTP1_REPLY_BODY = (
    b"this port serves gRPC over HTTP/2 (h2c: HTTP/2 with prior knowledge); HTTP/1.1 is not spoken here\n"
)
HTTP1_REPLY = (
    b"HTTP/1.1 505 HTTP Version Not Supported\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
    b"Connection: close\r\n\r\n%b" % (len(HTTP1_REPLY_BODY), HTTP1_REPLY_BODY)
)


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def goaway(last_stream_id: int, error_code: int, debug: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + error_code.to_bytes(4, "big") + debug)


#: What a connection beyond ``--max-connections`` (or during shutdown) gets before the close: nothing.
#: The polite answer, the server preface and a GOAWAY, completes the connection as far as gRPC clients
#: are concerned, and they reconnect at once, in a loop (grpcio: 200 connections in 3 s, then
#: DEADLINE_EXCEEDED); a connection closed before the preface is a failed one, so they fail the call
#: with UNAVAILABLE and back off before trying again.
TOO_MANY_CONNECTIONS = b""


def table_neutral(block: bytes) -> bool:
    """True if decoding this HPACK block cannot change the dynamic table: only indexed fields and
    literals without indexing or never indexed (RFC 7541 section 6), each complete."""
    i, n = 0, len(block)
    while i < n:
        b = block[i]
        if b & 0x80:  # indexed field: a 7-bit prefix integer
            i = _skip_int(block, i, 0x7F)
        elif b & 0xE0:  # 01xxxxxx adds to the table, 001xxxxx resizes it
            return False
        else:  # 0000xxxx or 0001xxxx: a name index (4-bit prefix), a literal name if 0, a value
            named = b & 0x0F
            i = _skip_int(block, i, 0x0F)
            if i < 0:
                return False
            if not named:
                i = _skip_string(block, i)
            i = _skip_string(block, i) if i >= 0 else -1
        if i < 0:
            return False
    return True


def _skip_int(block: bytes, i: int, mask: int) -> int:
    """The index after an HPACK integer at i (its prefix the low bits of block[i]); -1 if cut short or
    longer than four continuation bytes."""
    if block[i] & mask != mask:
        return i + 1
    for j in range(i + 1, min(i + 5, len(block))):
        if block[j] < 0x80:
            return j + 1
    return -1


def _string_length(block: bytes, i: int) -> tuple[int, int]:
    """(length, index of the first byte) of the HPACK string at i; (-1, -1) if malformed."""
    n = len(block)
    if i >= n:
        return -1, -1
    value = block[i] & 0x7F
    i += 1
    if value == 0x7F:
        shift = 0
        for _ in range(4):
            if i >= n:
                return -1, -1
            b = block[i]
            i += 1
            value += (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        else:
            return -1, -1
    return value, i


def _skip_string(block: bytes, i: int) -> int:
    length, start = _string_length(block, i)
    if length < 0 or start + length > len(block):
        return -1
    return start + length


def _hpack_int(value: int, prefix: int, first: int) -> bytes:
    """An HPACK integer with a ``prefix``-bit prefix; ``first`` holds the first byte's other bits."""
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """An HPACK block of these headers as literals without indexing (new names, no Huffman): it
    decodes to them whatever the dynamic table holds, and changes nothing in it."""
    return b"".join(
        b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value for name, value in headers
    )


_TOKEN = re.compile(rb"[a-z0-9!#$%&'*+\-.^_`|~]+")
_PSEUDO = (b":method", b":scheme", b":path", b":authority")
_NOT_PLAIN = (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"host", b"cookie")


def _plain_call(headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """(method, content-length or -1) if these request headers are a Fetch or FetchMulti that h2
    accepts and the slow path would serve like any other; (0, -1) for anything else (which h2 then
    judges). Deliberately narrower than h2's rules: a doubt is the slow path's."""
    seen: set[bytes] = set()
    regular = False
    method = scheme = path = ctype = None
    length = -1
    for name, value in headers:
        if value and (
            value[0] in (0x20, 0x09) or value[-1] in (0x20, 0x09) or b"\r" in value or b"\n" in value or b"\0" in value
        ):
            return 0, -1
        if name[:1] == b":":
            if regular or name in seen or name not in _PSEUDO:
                return 0, -1
            seen.add(name)
            if name == b":method":
                method = value
            elif name == b":scheme":
                scheme = value
            elif name == b":path":
                path = value
            continue
        regular = True
        if not _TOKEN.fullmatch(name) or name in _NOT_PLAIN:
            return 0, -1
        if name in (b"content-type", b"content-length", b"grpc-encoding", b"grpc-timeout", b"te"):
            if name in seen:
                return 0, -1
            seen.add(name)
        if name == b"content-type":
            ctype = value
        elif name == b"te":
            if value != b"trailers":
                return 0, -1
        elif name == b"grpc-encoding":
            if value != b"identity":
                return 0, -1
        elif name == b"grpc-timeout":
            if not _valid_timeout(value):
                return 0, -1
        elif name == b"content-length":
            if not value.isdigit() or len(value) > 9:
                return 0, -1
            length = int(value)
    if method != b"POST" or not scheme or ctype is None:
        return 0, -1
    if not (ctype == b"application/grpc" or ctype.startswith((b"application/grpc+", b"application/grpc;"))):
        return 0, -1
    code = svc.METHODS.get(path or b"", 0)
    return (code, length) if code in (svc.FETCH, svc.FETCH_MULTI) else (0, -1)


def _reply_frames(stream_id: int, message: bytes) -> bytes:
    """The fast path's three frames for one successful call."""
    sid = stream_id.to_bytes(4, "big")
    n = len(message)
    return b"".join(
        (
            REPLY_HEADERS,
            sid,
            REPLY_BLOCK,
            (n + 5).to_bytes(3, "big"),
            b"\x00\x00",
            sid,
            b"\x00",
            n.to_bytes(4, "big"),
            message,
            TRAILERS,
            sid,
            TRAILERS_BLOCK,
        )
    )


class PyGrpcCore:
    """The fast path, pure Python (``_grpc_speedups.GrpcCore`` is its compiled twin: the same steps in
    C). ``_fast`` is set by the slow path when the connection is in the steady state the fast path
    can serve; ``_receive_slow`` is the subclass's."""

    __slots__ = (
        "_buffer",
        "_cache_codes",
        "_cache_keys",
        "_cache_lengths",
        "_counters",
        "_debt",
        "_fast",
        "_handed",
        "_in_window",
        "_last_stream",
        "_next_id",
        "_next_ids",
        "_out_window",
        "_peer_window",
        "_pending",
        "activity",
        "closing",
        "wait",
    )

    _buffer: bytes
    _fast: bool
    _last_stream: int
    _out_window: int
    _peer_window: int
    _in_window: int
    _debt: int
    _handed: int
    activity: int
    closing: bool
    wait: float

    def _core_init(self, generator: Any, counters: Any) -> None:
        self._buffer = b""
        self._fast = False
        self._cache_keys: list[bytes] = []
        self._cache_codes: list[int] = []
        self._cache_lengths: list[int] = []  # the block's content-length (-1: none), which DATA must match
        # Calls started: [stream id, method, header block, bytes the client added to the stream's window,
        # content-length or -1].
        self._pending: list[list[Any]] = []
        self._handed = 0  # the last stream id handed over to the slow path
        self._last_stream = 0
        self._out_window = self._peer_window = self._in_window = 65535
        self._debt = 0
        self._next_id = generator.next_id
        self._next_ids = generator.next_ids
        self._counters = counters
        self.activity = 0
        self.closing = False
        self.wait = 0.0

    def _cache_add(self, block: bytes, method: int, length: int) -> None:
        """Remember a table-neutral header block that h2's decoder found to be a plain ``method`` call."""
        if block in self._cache_keys:
            return
        if len(self._cache_keys) >= CACHE_SIZE:
            self._cache_clear()
        self._cache_keys.append(block)
        self._cache_codes.append(method)
        self._cache_lengths.append(length)

    def _cache_clear(self) -> None:
        self._cache_keys.clear()
        self._cache_codes.clear()
        self._cache_lengths.clear()

    def _pending_add(self, stream_id: int, method: int, block: bytes, length: int) -> None:
        """A call the slow path decoded the headers of (``block`` decodes to them without touching the
        table), for the fast path to answer when its DATA arrives."""
        self._pending.append([stream_id, method, block, 0, length])

    def _cache_len(self) -> int:
        return len(self._cache_keys)

    def _pending_frames(self) -> bytes:
        """The frames of the calls the fast path started, for the slow path: each one's HEADERS and,
        if the client opened its window, one WINDOW_UPDATE with the sum. Forgets them."""
        out = []
        for sid, _, block, opened, _ in self._pending:
            out.append(frame(HEADERS, END_HEADERS, sid, block))
            if opened:
                out.append(frame(WINDOW_UPDATE, 0, sid, opened.to_bytes(4, "big")))
        self._pending.clear()
        return b"".join(out)

    def _receive_slow(self, data: bytes) -> bytes:
        raise NotImplementedError

    def receive(self, data: bytes) -> bytes:
        """Answer what arrived: the fast path while it can, the slow path with the rest; and the fast
        path again if the slow path stopped early, in steady state, leaving frames in ``_buffer``."""
        out: list[bytes] = []
        while True:
            if not self._fast:
                out.append(self._receive_slow(data))
            else:
                part, slow = self._fast_pass(data)
                out.append(part)
                if not slow:
                    break
            if not self._fast or len(self._buffer) < 9:
                break
            data = b""
        return out[0] if len(out) == 1 else b"".join(out)

    def _fast_pass(self, data: bytes) -> tuple[bytes, bool]:
        """One run of the fast path over ``_buffer`` and data; (output, whether the slow path ran)."""
        buf = self._buffer + data if self._buffer else data
        self._buffer = b""
        n = len(buf)
        pos = 0
        out: list[bytes] = []
        calls = issued = 0
        pending = self._pending
        give_up = False
        while n - pos >= 9:
            length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
            if length > MAX_FRAME:
                give_up = True
                break
            end = pos + 9 + length
            if end > n:
                break
            kind = buf[pos + 3]
            flags = buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
            if kind == HEADERS:
                if flags != END_HEADERS or not sid & 1 or len(pending) >= MAX_STREAMS:
                    give_up = True
                    break
                if sid <= (pending[-1][0] if pending else self._last_stream):
                    give_up = True
                    break
                block = buf[pos + 9 : end]
                try:
                    at = self._cache_keys.index(block)
                except ValueError:
                    give_up = True
                    break
                pending.append([sid, self._cache_codes[at], self._cache_keys[at], 0, self._cache_lengths[at]])
            elif kind == DATA:
                if flags != END_STREAM or not pending or pending[0][0] != sid or length < 5 or buf[pos + 9]:
                    give_up = True
                    break
                size = int.from_bytes(buf[pos + 10 : pos + 14], "big")
                if size != length - 5 or self._debt + length > self._in_window or pending[0][4] not in (-1, length):
                    give_up = True
                    break
                method = pending[0][1]
                if method == svc.FETCH:
                    if size:
                        give_up = True
                        break
                    count = 1
                else:  # FETCH_MULTI: empty (n = 1), or field 1 alone as a varint of one or two bytes
                    if size == 0:
                        count = 0
                    elif size == 2 and buf[pos + 14] == 0x08 and buf[pos + 15] < 0x80:
                        count = buf[pos + 15]
                    elif size == 3 and buf[pos + 14] == 0x08 and buf[pos + 15] >= 0x80 and buf[pos + 16] < 0x80:
                        count = (buf[pos + 15] & 0x7F) | (buf[pos + 16] << 7)
                    else:
                        give_up = True
                        break
                    count = count or 1  # proto3: 0 and unset are alike; go-katsubushi reads 1
                    if count > MAX_IDS_PER_REQUEST:
                        give_up = True
                        break
                # The reply's most bytes: prefix, tag, length, ten bytes an ID.
                bound = 5 + 3 + 10 * count
                if bound > self._out_window or bound > self._peer_window + pending[0][3]:
                    give_up = True
                    break
                try:
                    message = (
                        fetch_reply(self._next_id())
                        if method == svc.FETCH
                        else fetch_multi_reply([self._next_id()] if count == 1 else self._next_ids(count))
                    )
                except Exception:  # a clock wait or a failure: the slow path asks again and answers it
                    give_up = True
                    break
                pending.pop(0)
                self._last_stream = sid
                self._debt += length
                if self._debt >= RETURN_AT:
                    out.append(frame(WINDOW_UPDATE, 0, 0, self._debt.to_bytes(4, "big")))
                    self._debt = 0
                self._out_window -= len(message) + 5
                out.append(_reply_frames(sid, message))
                calls += 1
                issued += count
            elif kind == WINDOW_UPDATE and length == 4:
                increment = int.from_bytes(buf[pos + 9 : end], "big") & 0x7FFFFFFF
                if not increment:
                    give_up = True
                    break
                if sid == 0:
                    if self._out_window + increment > 0x7FFFFFFF:
                        give_up = True
                        break
                    self._out_window += increment
                elif pending and pending[0][0] <= sid <= pending[-1][0]:  # grpcio opens each call's window
                    for call in pending:
                        if call[0] == sid:
                            break
                    else:
                        give_up = True
                        break
                    if self._peer_window + call[3] + increment > 0x7FFFFFFF:
                        give_up = True
                        break
                    call[3] += increment
                elif not (sid & 1 and sid <= self._last_stream):  # a closed stream's is ignored, as h2 does
                    give_up = True
                    break
            else:
                give_up = True
                break
            pos = end
        if calls:
            self.activity += calls
            counters = self._counters
            counters.commands += calls
            counters.ids += issued
        if not give_up:
            if pos < n:
                self._buffer = buf[pos:]
            return b"".join(out), False
        if pending:
            self._handed = pending[-1][0]
            rest = self._pending_frames() + buf[pos:]
        else:
            rest = buf[pos:]
        out.append(self._receive_slow(rest))
        return b"".join(out), True


if TYPE_CHECKING:
    GrpcCore = PyGrpcCore
else:
    from ..compiled import grpc_speedups

    GrpcCore = grpc_speedups.GrpcCore if grpc_speedups is not None else PyGrpcCore

#: True when the connections derive from the compiled twin.
COMPILED = GrpcCore is not PyGrpcCore


class _H2(H2Connection):
    """h2, with one change: a HEADERS frame that opens a stream beyond SETTINGS_MAX_CONCURRENT_STREAMS
    is a stream error (RST_STREAM REFUSED_STREAM), as RFC 9113 section 5.1.2 says, where h2 makes it
    a connection error. Its header block is still decoded, to keep HPACK's table in step."""

    def _receive_headers_frame(self, frame: Any) -> Any:
        sid = frame.stream_id
        if (
            sid not in self.streams
            and sid & 1
            and sid > self.highest_inbound_stream_id
            and self.open_inbound_streams >= self.local_settings.max_concurrent_streams
        ):
            _decode_headers(self.decoder, frame.data)
            self.highest_inbound_stream_id = sid
            self._closed_streams[sid] = StreamClosedBy.SEND_RST_STREAM
            refusal = RstStreamFrame(sid)
            refusal.error_code = ErrorCodes.REFUSED_STREAM
            return [refusal], []
        return super()._receive_headers_frame(frame)


_H2_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,  # ours are fixed and valid
    normalize_outbound_headers=False,
)

_REPLY_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


def _grpc_message(text: str) -> bytes:
    """The ``grpc-message`` value: UTF-8, percent-encoded outside printable ASCII and ``%``."""
    return b"".join(
        bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in text.encode("utf-8", "replace")
    )


def _valid_timeout(value: bytes) -> bool:
    """``grpc-timeout``: one to eight digits and a unit (H, M, S, m, u, n)."""
    return 2 <= len(value) <= 9 and value[:-1].isdigit() and value[-1:] in b"HMSmun"


class _Call:
    """An open stream."""

    __slots__ = ("body", "encoding", "ended", "headers_sent", "messages", "method", "sid", "trailers", "unsent")

    def __init__(self, sid: int, method: int, encoding: bytes | None) -> None:
        self.sid = sid
        self.method = method
        self.encoding = encoding
        self.body = b""  # bytes of a request message still arriving
        self.messages: list[bytes] = []  # complete request messages not yet answered (unary: at most one)
        self.ended = False  # the client ended its side
        self.headers_sent = False
        self.unsent = b""  # reply DATA the client's windows do not take yet
        self.trailers: list[tuple[bytes, bytes]] | None = None  # to send once unsent is


class GrpcConnection(GrpcCore):
    """One client connection: :class:`~.text.TextConnection`'s interface (``receive``, ``resume``,
    ``closing``, ``wait``, ``activity``), so the daemon's connection glue drives it; plus
    :meth:`goodbye`, the GOAWAY sent before the connection is closed (shutdown, idle timeout)."""

    __slots__ = (
        "_calls",
        "_draining",
        "_fast_ok",
        "_h2",
        "_held",
        "_service",
        "_started",
        "_tokens",
        "_tokens_at",
        "_waiting",
    )

    def __init__(self, service: GrpcService, fast: bool = True) -> None:
        self._core_init(service.issuer.generator, service.counters)
        self._service = service
        self._fast_ok = fast
        h2 = self._h2 = _H2(config=_H2_CONFIG)
        h2.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
            },
        )
        h2.decoder.max_header_list_size = MAX_HEADER_LIST
        self._calls: dict[int, _Call] = {}
        self._waiting: deque[_Call] = deque()  # calls whose reply waits for the clock, in order
        self._held = b""  # input that arrived while a call waits for the clock
        self._started = False
        self._draining = False  # a GOAWAY was sent or received: no new calls
        self._tokens = float(FLOOD_BURST)
        self._tokens_at = time.monotonic()

    # -- the slow path ---------------------------------------------------------------------------
    def _receive_slow(self, data: bytes) -> bytes:
        if self.closing:
            return b""
        if self.wait:
            self._held += data
            return b""
        out: list[bytes] = []
        self._sync_in(out)
        self._process(data, out)
        return self._finish(out)

    def resume(self) -> bytes:
        """After ``wait`` seconds: answer the calls that waited for the clock, then what arrived meanwhile."""
        self.wait = 0.0
        out: list[bytes] = []
        if self.closing:
            return b""
        self._sync_in(out)
        try:
            while self._waiting and not self.wait:
                call = self._waiting[0]
                if self._complete(call):
                    self._waiting.popleft()
            if not self.wait and self._held:
                data, self._held = self._held, b""
                self._process(data, out)
        except ProtocolError as exc:
            self._broken(exc)
        reply = self._finish(out)
        if self._fast and len(self._buffer) >= 9:  # the slow path stopped early: the rest is the fast path's
            reply += self.receive(b"")
        return reply

    def goodbye(self) -> bytes:
        """A GOAWAY (NO_ERROR) naming the last stream served, before the connection closes."""
        if self.closing or not self._started:
            return b""
        out: list[bytes] = []
        self._sync_in(out)
        self._draining = True
        self._h2.close_connection(ErrorCodes.NO_ERROR)
        self.closing = True
        return self._finish(out)

    def _sync_in(self, out: list[bytes]) -> None:
        """Hand the fast path's state to h2: the stream ids it served, the outbound window it used,
        and the inbound bytes it consumed (given back now, so h2's own account is exact)."""
        h2 = self._h2
        if self._last_stream > h2.highest_inbound_stream_id:
            h2.highest_inbound_stream_id = self._last_stream
        h2.outbound_flow_control_window = self._out_window
        if self._debt:
            out.append(frame(WINDOW_UPDATE, 0, 0, self._debt.to_bytes(4, "big")))
            self._debt = 0
        self._fast = False

    def _finish(self, out: list[bytes]) -> bytes:
        """Collect h2's output, hand the state back to the fast path and say whether it may run."""
        h2 = self._h2
        out.append(h2.data_to_send())
        self._last_stream = h2.highest_inbound_stream_id
        self._out_window = h2.outbound_flow_control_window
        self._peer_window = h2.remote_settings.initial_window_size
        self._in_window = h2.inbound_flow_control_window
        if self._draining and not self._calls and not self._waiting:
            self.closing = True
        self._fast = self._fast_ok and not self._calls and self._steady()
        return b"".join(out)

    def _steady(self) -> bool:
        """No call open or waiting, nothing held, and h2's encoder owes the client nothing: the state
        the fast path serves (given no open call in ``_calls``)."""
        h2 = self._h2
        return (
            self._started
            and not self.closing
            and not self.wait
            and not self._waiting
            and not self._held
            and not self._draining
            and not h2.encoder.table_size_changes
            and h2.open_inbound_streams == 0
        )

    def _broken(self, exc: ProtocolError) -> None:
        """h2 found a connection error and queued its GOAWAY: close once it is written."""
        log.debug("gRPC connection error: %s", exc)
        self.closing = True
        self._calls.clear()
        self._waiting.clear()

    def _process(self, data: bytes, out: list[bytes]) -> None:
        buf = self._buffer + data if self._buffer else data
        self._buffer = b""
        pos = 0
        h2 = self._h2
        try:
            if not self._started:
                if len(buf) < len(PREFACE) and PREFACE.startswith(buf):
                    self._buffer = buf
                    return
                if not buf.startswith(PREFACE):
                    if buf.startswith(_HTTP1_METHODS):
                        out.append(HTTP1_REPLY)
                        self.closing = True
                        return
                    if len(buf) < 8 and any(m.startswith(buf) for m in _HTTP1_METHODS):
                        self._buffer = buf
                        return
                    # RFC 9113 section 3.4: a connection error of type PROTOCOL_ERROR.
                    h2.initiate_connection()
                    h2.close_connection(ErrorCodes.PROTOCOL_ERROR, b"expected the HTTP/2 connection preface")
                    self.closing = True
                    return
                h2.initiate_connection()
                self._started = True
                h2.receive_data(PREFACE)
                pos = len(PREFACE)
            n = len(buf)
            while n - pos >= 9 and not self.closing:
                length = int.from_bytes(buf[pos : pos + 3], "big")
                if length > MAX_FRAME:
                    h2.receive_data(buf[pos : pos + 9])  # raises: FRAME_SIZE_ERROR
                end = pos + 9 + length
                if end > n:
                    break
                self._frame(buf[pos:end])
                pos = end
                if self.wait:
                    self._held = buf[pos:] + self._held
                    return
                if self._fast_ok and not self._calls and n - pos >= 9 and self._steady():
                    self._buffer = buf[pos:]  # steady again: the caller hands the rest to the fast path
                    return
            if not self.closing:
                self._buffer = buf[pos:]
        except ProtocolError as exc:
            self._broken(exc)
        except Exception:  # a bug here must not leave a client hanging: say so and close
            log.exception("unexpected error in a gRPC connection")
            h2.close_connection(ErrorCodes.INTERNAL_ERROR, b"internal error")
            self.closing = True

    def _spend(self) -> bool:
        """One control frame from the flood budget; False (and a GOAWAY) once it is spent."""
        now = time.monotonic()
        self._tokens = min(float(FLOOD_BURST), self._tokens + (now - self._tokens_at) * FLOOD_RATE) - 1.0
        self._tokens_at = now
        if self._tokens >= 0:
            return True
        log.debug("gRPC client sent too many control frames; closing the connection")
        self._h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, b"too many control frames")
        self.closing = True
        self._calls.clear()
        self._waiting.clear()
        return False

    def _frame(self, raw: bytes) -> None:
        """One complete frame: bookkeeping for the fast path and the flood budget, then h2."""
        kind = raw[3]
        flags = raw[4]
        sid = int.from_bytes(raw[5:9], "big") & 0x7FFFFFFF
        h2 = self._h2
        if kind in (HEADERS, CONTINUATION):
            neutral = kind == HEADERS and flags & ~END_STREAM == END_HEADERS and table_neutral(raw[9:])
            if (
                flags == END_HEADERS
                and kind == HEADERS
                and self._fast_ok
                and sid & 1
                and sid > max(h2.highest_inbound_stream_id, self._handed)
                and not self._calls
                and self._steady()
            ):
                self._headers(sid, raw[9:], neutral)
                return
            if not neutral:
                self._cache_clear()  # this block may change the table: what was recognised may not hold
        elif kind == RST_STREAM:
            if not self._spend():
                return
            if sid and sid <= h2.highest_inbound_stream_id and sid not in h2.streams:
                return  # a stream already closed (the client's reset crossed our reply): ignored, RFC 9113 5.1
        elif kind in (PING, SETTINGS):
            if not flags & ACK and not self._spend():
                return
        elif kind == DATA:
            if len(raw) == 9 and not flags & END_STREAM and not self._spend():
                return
        elif kind not in (WINDOW_UPDATE, GOAWAY) and not self._spend():  # PRIORITY, unknown types
            return
        for event in h2.receive_data(raw):
            self._event(event)

    def _headers(self, sid: int, block: bytes, neutral: bool) -> None:
        """A HEADERS frame opening a stream in steady state: decoded here with h2's own decoder (so
        HPACK stays in step, with h2's errors); a plain Fetch or FetchMulti becomes a call of the fast
        path (and the block, if table-neutral, one it recognises from now on); anything else goes to
        h2 as a block that means the same headers and leaves the table alone."""
        h2 = self._h2
        try:
            headers = _decode_headers(h2.decoder, block)
        except ProtocolError as exc:
            h2.close_connection(exc.error_code)
            raise
        if not neutral:
            self._cache_clear()
        method, length = _plain_call(headers)
        if not neutral:
            block = literal_block(headers)
        if method:  # (the fast path has no call pending here: it hands them all over before the slow path runs)
            if neutral:
                self._cache_add(block, method, length)
            self._pending_add(sid, method, block, length)
            return
        for event in h2.receive_data(frame(HEADERS, END_HEADERS, sid, block)):
            self._event(event)

    def _event(self, event: Any) -> None:
        if isinstance(event, RequestReceived):
            self._request(event.stream_id, event.headers, event.stream_ended is not None)
        elif isinstance(event, DataReceived):
            self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            call = self._calls.get(event.stream_id)
            if call is not None and call.method and event.data:
                call.body += event.data
                self._take_messages(call)
        elif isinstance(event, StreamEnded | TrailersReceived):
            call = self._calls.get(event.stream_id)
            if call is not None and not call.ended:
                call.ended = True
                self._ended(call)
        elif isinstance(event, StreamReset):
            call = self._calls.pop(event.stream_id, None)
            if call is not None and call in self._waiting:
                self._waiting.remove(call)
        elif isinstance(event, WindowUpdated):
            for call in list(self._calls.values()):
                if call.unsent:
                    self._flush(call)
        elif isinstance(event, ConnectionTerminated):
            # The client is leaving: h2 sends nothing more after its GOAWAY, so neither do we.
            self._draining = True
            self.closing = True
            self._calls.clear()
            self._waiting.clear()

    # -- calls -----------------------------------------------------------------------------------
    def _request(self, sid: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.activity += 1
        method = path = ctype = encoding = timeout = None
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                ctype = value
            elif name == b"grpc-encoding":
                encoding = value
            elif name == b"grpc-timeout":
                timeout = value
        if self._draining:
            self._h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        if ctype is None or not (
            ctype == b"application/grpc" or ctype.startswith((b"application/grpc+", b"application/grpc;"))
        ):
            shown = (ctype or b"").decode("utf-8", "replace")
            self._abort(sid, b"415", svc.INVALID_ARGUMENT, f'invalid gRPC request content-type "{shown}"')
            return
        if timeout is not None and not _valid_timeout(timeout):
            self._abort(sid, b"400", svc.INTERNAL, f"malformed grpc-timeout: {timeout.decode('latin-1')!r}")
            return
        if method != b"POST":
            shown = (method or b"").decode("utf-8", "replace")
            self._abort(sid, b"405", svc.INTERNAL, f'method "{shown}" is not allowed: gRPC calls are POST')
            return
        code = svc.METHODS.get(path or b"")
        if code is None:
            self._abort(sid, b"200", svc.UNIMPLEMENTED, svc.unknown_method(path or b""))
            return
        if encoding == b"identity":
            encoding = None
        call = self._calls[sid] = _Call(sid, code, encoding)
        if ended:
            call.ended = True
            self._ended(call)

    def _take_messages(self, call: _Call) -> None:
        """Cut complete messages out of the call's body; a reflection stream answers each at once."""
        body = call.body
        while len(body) >= 5:
            flag = body[0]
            size = int.from_bytes(body[1:5], "big")
            if size > MAX_MESSAGE:
                self._fail(
                    call, svc.RESOURCE_EXHAUSTED, f"grpc: received message larger than max ({size} vs. {MAX_MESSAGE})"
                )
                return
            if flag > 1:
                self._fail(call, svc.INTERNAL, f"grpc: received unexpected payload format {flag}")
                return
            if flag == 1:
                if call.encoding is None:
                    self._fail(call, svc.INTERNAL, "grpc: compressed flag set with identity or empty encoding")
                else:
                    shown = call.encoding.decode("latin-1")
                    self._fail(
                        call,
                        svc.UNIMPLEMENTED,
                        f'grpc: Decompressor is not installed for grpc-encoding "{shown}"',
                        ((b"grpc-accept-encoding", b"identity"),),
                    )
                return
            if len(body) < 5 + size:
                break
            call.messages.append(body[5 : 5 + size])
            body = body[5 + size :]
            if call.method == svc.REFLECTION:
                self._reflect(call)
            elif len(call.messages) > 1:
                self._fail(call, svc.INTERNAL, "grpc: a unary call must send one request message, not more")
                return
        call.body = body

    def _reflect(self, call: _Call) -> None:
        for message in call.messages:
            try:
                reply = self._service.reflection.answer(message)
            except Exception as exc:  # an undecodable request
                self._fail(call, svc.INTERNAL, f"grpc: error unmarshalling request: {exc}")
                return
            self._send_message(call, reply)
        call.messages.clear()

    def _ended(self, call: _Call) -> None:
        """The client ended its side of the call: a unary call is answered now."""
        if not call.method:  # already answered with an error
            return
        if call.method == svc.REFLECTION:
            if call.body:
                self._fail(call, svc.INTERNAL, "grpc: the request stream ended inside a message")
            else:
                self._trailers(call, svc.OK, "")
            return
        if call.body:
            self._fail(call, svc.INTERNAL, f"grpc: request message cut short: {len(call.body)} bytes of a message")
            return
        if not call.messages:
            self._fail(call, svc.INTERNAL, "grpc: a unary call must send one request message, it sent none")
            return
        if self.wait or not self._complete(call):  # another call is waiting for the clock: this one waits behind it
            self._waiting.append(call)

    def _complete(self, call: _Call) -> bool:
        """Answer a unary call; False if it must wait for the clock (``wait`` is then set)."""
        if call.sid not in self._calls:  # reset by the client meanwhile
            return True
        try:
            reply: Reply = self._service.unary(call.method, call.messages[0])
        except ClockWait as exc:
            self.wait = max(exc.seconds, 1e-4)
            return False
        if reply.message is not None:
            self._send_message(call, reply.message)
        self._trailers(call, reply.status, reply.text, reply.trailers)
        return True

    def _abort(self, sid: int, http_status: bytes, status: int, text: str, extra: tuple = ()) -> None:
        """A call refused from its headers: one HEADERS frame (trailers only), at once. What the client
        still sends on the stream is read and dropped; no RST_STREAM (grpc-go sends one, which makes curl,
        still sending its body, report an error instead of the answer)."""
        headers = [
            (b":status", http_status),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"%d" % status),
            (b"grpc-message", _grpc_message(text)),
            *extra,
        ]
        self._h2.send_headers(sid, headers, end_stream=True)

    def _fail(self, call: _Call, status: int, text: str, extra: tuple = ()) -> None:
        """End a call with an error status; what the client still sends on it is ignored."""
        call.method = 0
        call.body = b""
        call.messages.clear()
        self._trailers(call, status, text, extra)

    def _send_message(self, call: _Call, message: bytes) -> None:
        if not call.headers_sent:
            self._h2.send_headers(call.sid, _REPLY_HEADERS)
            call.headers_sent = True
        call.unsent += b"\x00" + len(message).to_bytes(4, "big") + message
        self._flush(call)

    def _flush(self, call: _Call) -> None:
        """Send what the windows take of the call's reply; then its trailers, if they wait for it."""
        h2 = self._h2
        while call.unsent:
            room = min(h2.local_flow_control_window(call.sid), h2.max_outbound_frame_size)
            if room <= 0:
                return
            chunk, call.unsent = call.unsent[:room], call.unsent[room:]
            h2.send_data(call.sid, chunk)
        if call.trailers is not None:
            trailers, call.trailers = call.trailers, None
            self._end(call, trailers)

    def _trailers(self, call: _Call, status: int, text: str, extra: tuple = ()) -> None:
        trailers = [(b"grpc-status", b"%d" % status)]
        if text:
            trailers.append((b"grpc-message", _grpc_message(text)))
        trailers.extend(extra)
        if not call.headers_sent:  # trailers only
            trailers = [*_REPLY_HEADERS, *trailers]
            call.headers_sent = True
        if call.unsent:
            call.trailers = trailers
        else:
            self._end(call, trailers)

    def _end(self, call: _Call, trailers: list[tuple[bytes, bytes]]) -> None:
        h2 = self._h2
        h2.send_headers(call.sid, trailers, end_stream=True)
        self._calls.pop(call.sid, None)
        stream = h2.streams.get(call.sid)
        if stream is not None and not stream.closed:  # answered before the client finished sending: stop it
            h2.reset_stream(call.sid, ErrorCodes.NO_ERROR)

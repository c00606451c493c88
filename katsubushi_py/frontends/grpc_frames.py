"""HTTP/2 frames and HPACK header blocks for the gRPC front end, as bytes: the limits and settings the
server announces, the frames both paths write, and what the fast path (:mod:`.grpc_fast`) and the
slow path (:mod:`.grpc_h2`) need to judge a header block without h2: whether decoding it can change
HPACK's dynamic table (:func:`table_neutral`), whether its headers are a plain ``Fetch`` or
``FetchMulti`` (:func:`plain_call`), and the same headers as a block that leaves the table alone
(:func:`literal_block`).
"""

from __future__ import annotations

import re

from . import grpc_service as svc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME = 16384  # SETTINGS_MAX_FRAME_SIZE: the protocol's default, never raised
MAX_STREAMS = 100  # SETTINGS_MAX_CONCURRENT_STREAMS
MAX_HEADER_LIST = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE (the HTTP front end's MAX_HEAD)
MAX_MESSAGE = 4096  # a request message (reflection's are the largest, a symbol name)
MAX_HEADER_BLOCK = 2 * MAX_HEADER_LIST  # a HEADERS frame and its CONTINUATIONs, encoded (see grpc_budget)
FLOOD_BURST = 1000  # frames the slow path takes at once (see grpc_budget)
FLOOD_RATE = 100.0  # frames a second, sustained
REFUND_PER_CALL = 8  # frames a call answered earns back (a call takes 2 to 5)
IDLE_WINDOW_UPDATES = FLOOD_BURST  # the fast path's WINDOW_UPDATEs with no call answered, then the slow path's
CACHE_SIZE = 16  # recognised header blocks per connection
RETURN_AT = 65535 // 2  # inbound bytes given back with a WINDOW_UPDATE (h2's rule: half its window)
# Fairness (issue 33): one receive or resume stops taking frames once it has spent this much, holding
# the rest of the read (``backlog``) for the connection glue's next slice. The fast path spends a
# call's reply bytes plus CALL_COST; the slow path FRAME_COST a frame plus the reply bytes it sends.
PIECE_BUDGET = 16 * 1024
CALL_COST = 256  # the fast path's fixed work of a call, in reply bytes (about 1 µs in C, 5 in Python)
FRAME_COST = 1024  # one frame through h2 (20 to 60 µs of Python)

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

HTTP1_METHODS = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ", b"CONNECT ", b"TRACE ")
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
    if all(len(name) < 127 > len(value) for name, value in headers):  # lengths of one byte each
        return b"".join([b"\x00%c%b%c%b" % (len(name), name, len(value), value) for name, value in headers])
    return b"".join(
        b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value for name, value in headers
    )


_TOKEN = re.compile(rb"[a-z0-9!#$%&'*+\-.^_`|~]+")
_PSEUDO = (b":method", b":scheme", b":path", b":authority")
_NOT_PLAIN = (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade", b"host", b"cookie")


def plain_call(headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
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
            if not valid_timeout(value):
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


def reply_frames(stream_id: int, message: bytes) -> bytes:
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


def valid_timeout(value: bytes) -> bool:
    """``grpc-timeout``: one to eight digits and a unit (H, M, S, m, u, n)."""
    return 2 <= len(value) <= 9 and value[:-1].isdigit() and value[-1:] in b"HMSmun"

"""What a gRPC connection's client may make the slow path do: the frame budget, the header block, and
h2 as the server runs it (:class:`H2`: a stream over the limit is refused, not the connection).

Why a budget for every frame: the slow path hands each frame to h2, which costs several microseconds
of Python whatever the frame says; a frame that asks for nothing (a WINDOW_UPDATE, a PING, a
PRIORITY, an empty DATA, an unknown type) is work without a request. Before issue 33 WINDOW_UPDATE was
outside the budget: with one stream left open, four connections sending nothing else held the daemon
at 99.6 % CPU. Now every frame the slow path takes spends one token of a bucket of
:data:`FLOOD_BURST` refilled at :data:`FLOOD_RATE` a second, and every call answered (on either path)
earns :data:`REFUND_PER_CALL` back, so a client that makes calls never runs dry however many frames its
calls take, while one that only sends frames runs out and is sent GOAWAY ``ENHANCE_YOUR_CALM``. (Calls
reset before their answer earn nothing: the rapid-reset attack of 2023 spends as before.) The fast
path's frames (the steady state's HEADERS, DATA and WINDOW_UPDATE, in C) cost about what the bytes of a
memcached request cost and are not counted.

Why a header block has a size and a deadline: HPACK cannot skip a block, so h2 keeps a HEADERS frame and
its CONTINUATIONs until END_HEADERS; a client that never sends it held ~1.5 MB a connection (64 frames
of 16 KB) for the whole idle timeout (issue 33: 1,000 connections took 1.5 GB). A block is now refused
past :data:`MAX_HEADER_BLOCK` bytes (twice ``SETTINGS_MAX_HEADER_LIST_SIZE``, which bounds the decoded
list; HPACK's Huffman code can make a block longer than the list it decodes to) and closed by the
request deadline (``--request-timeout``) like any request that has begun and not arrived
(:mod:`katsubushi_py.daemon.deadlines`). Both end the connection with GOAWAY ``ENHANCE_YOUR_CALM``.
The fast path takes only HEADERS frames with END_HEADERS, so every block in progress is the slow
path's, compiled or not.
"""

from __future__ import annotations

from typing import Any

from h2.config import H2Configuration
from h2.connection import H2Connection, _decode_headers
from h2.errors import ErrorCodes
from h2.stream import StreamClosedBy
from hyperframe.frame import RstStreamFrame

from .grpc_frames import FLOOD_BURST, FLOOD_RATE, REFUND_PER_CALL


class FrameBudget:
    """One connection's token bucket (see the module's docstring). ``spend`` takes the time and the
    number of calls answered so far, so that the caller decides what the clock is."""

    __slots__ = ("_answered", "_at", "_tokens")

    def __init__(self, now: float) -> None:
        self._tokens = float(FLOOD_BURST)
        self._at = now
        self._answered = 0

    def spend(self, now: float, answered: int) -> bool:
        """One frame; False once the budget is spent."""
        earned = (now - self._at) * FLOOD_RATE + (answered - self._answered) * REFUND_PER_CALL
        self._answered = answered
        self._at = now
        self._tokens = min(float(FLOOD_BURST), self._tokens + earned) - 1.0
        return self._tokens >= 0


class H2(H2Connection):
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


H2_CONFIG = H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,  # ours are fixed and valid
    normalize_outbound_headers=False,
)

"""gRPC over HTTP/2, sans-IO: bytes in, bytes out, on the daemon's own event loop and connection glue.

Two paths share one connection, and must always agree (tests/test_grpc_h2.py plays the same
conversations through both and compares what a client decodes):

- **The slow path** (:class:`GrpcConnection`, here) is everything: the ``h2`` library (sans-IO, well
  kept) does the connection preface, SETTINGS, PING, flow control, HPACK, stream states, RST_STREAM and
  GOAWAY; this module splits the input into frames, feeds them to h2 one by one, turns h2's events into
  calls of :class:`~.grpc_service.GrpcService`, and answers with h2.
- **The fast path** (:mod:`.grpc_fast`, compiled twin ``_grpc_speedups.GrpcCore``) is the steady state
  of ``Fetch`` and ``FetchMulti``, recognised by the bytes of their header blocks.

A HEADERS frame the fast path does not recognise comes here. In steady state the slow path decodes it
itself with h2's own decoder (HPACK stays in step; h2's errors) and, if it is a plain ``Fetch`` or
``FetchMulti`` (:func:`~.grpc_frames.plain_call`, deliberately narrower than h2's rules), gives the
call to the fast path and remembers the block if it is table-neutral; any other block makes the fast
path forget them all. So grpc-go, which adds every new ``grpc-timeout`` value to the table, costs a
decode per call but no h2 stream. When h2 must see such a call after all (the fast path hands it
over), it gets a block of the same headers as literals without indexing
(:func:`~.grpc_frames.literal_block`), which leaves the table alone. The fast path's reply blocks use
the static table and literals without indexing only, so they never touch the dynamic table of h2's
encoder either; while the client has asked for a smaller table and h2's encoder owes it a size
update, the fast path stays off.

State the paths share, handed over at each switch: the highest stream id (h2's
``highest_inbound_stream_id``), the connection's outbound window (h2's ``outbound_flow_control_window``),
the client's initial stream window, and the inbound window (see :mod:`.grpc_fast`).

What a client can make a connection hold (each limit answered as the HTTP/2 and gRPC specifications
say): one incomplete frame (``MAX_FRAME`` + 9 bytes); ``MAX_STREAMS`` open calls (more are refused
with RST_STREAM REFUSED_STREAM), each holding at most one request message of ``MAX_MESSAGE`` bytes
(a larger one is ``RESOURCE_EXHAUSTED``) and at most one reply that the client's flow-control window
does not take yet (at most about 10 KB: 1,000 IDs); a header list of ``MAX_HEADER_LIST`` bytes (a larger
one closes the connection with GOAWAY: HPACK cannot skip a block), and a header block (HEADERS and
CONTINUATIONs) of ``MAX_HEADER_BLOCK`` bytes that must end within the request deadline; while a call
waits for the clock, one read of input. Every frame the slow path takes draws on a budget of
``FLOOD_BURST`` refilled at ``FLOOD_RATE`` a second and by each call answered; a client that spends it
is sent GOAWAY ENHANCE_YOUR_CALM (the HTTP/2 flood attacks of 2019 and 2023; :mod:`.grpc_budget`).
Replies the client does not read stop the reading of its requests (the connection glue's flow control).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from h2.connection import _decode_headers
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
from h2.exceptions import FrameTooLargeError, ProtocolError
from h2.settings import SettingCodes, Settings

from .grpc_budget import H2, H2_CONFIG, FrameBudget
from .grpc_calls import GrpcCalls, _Call
from .grpc_fast import GrpcCore
from .grpc_frames import (
    CONTINUATION,
    END_HEADERS,
    END_STREAM,
    FRAME_COST,
    HEADERS,
    HTTP1_METHODS,
    HTTP1_REPLY,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    MAX_STREAMS,
    PIECE_BUDGET,
    PREFACE,
    RST_STREAM,
    WINDOW_UPDATE,
    frame,
    literal_block,
    plain_call,
    table_neutral,
)
from .grpc_service import GrpcService

log = logging.getLogger("katsubushi_py")


class GrpcConnection(GrpcCalls, GrpcCore):
    """One client connection: :class:`~.text.TextConnection`'s interface (``receive``, ``resume``,
    ``closing``, ``wait``, ``activity``), so the daemon's connection glue drives it; plus
    :meth:`goodbye`, the GOAWAY sent before the connection is closed (shutdown, idle timeout)."""

    __slots__ = (
        "_answered",
        "_block",
        "_budget",
        "_calls",
        "_draining",
        "_fast_ok",
        "_h2",
        "_held",
        "_monotonic_ns",
        "_requests",
        "_service",
        "_started",
        "_waiting",
        "on_login",
    )

    # ``backlog`` (the fast path's slot) is set when one receive or resume has spent PIECE_BUDGET:
    # the rest of the read is held in ``_buffer`` and the connection glue calls ``resume`` in its
    # next slice, after the other connections have had their turn (issue 33's fairness). What arrives
    # meanwhile is held behind it, up to ``--read-ahead``; a client that does not read its replies
    # stops being read (pause_writing), as before.

    def __init__(self, service: GrpcService, fast: bool = True) -> None:
        self._core_init(service.issuer.generator, service.counters)
        self._service = service
        self._fast_ok = fast
        h2 = self._h2 = H2(config=H2_CONFIG)
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
        self._monotonic_ns = service.issuer.generator.monotonic_ns  # the generator's clock (a test's fake one)
        self._budget = FrameBudget(self._monotonic_ns() / 1e9)
        self._requests = 0  # calls the slow path opened (activity less these: the fast path's calls)
        self._answered = 0  # calls the slow path answered
        self._block = 0  # bytes of a header block begun and not ended (the request deadline watches it)
        #: With --token-file, set by the daemon: called once, at the first call with a good token.
        self.on_login: Callable[[], None] | None = None

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
        """After ``wait`` seconds: answer the calls that waited for the clock, then what arrived meanwhile.
        Or, in the glue's next slice, the next piece of a read held back (``backlog``)."""
        if self.backlog:
            self.backlog = False
            return self.receive(b"")
        self.wait = 0.0
        out: list[bytes] = []
        if self.closing:
            return b""
        self._spent = 0
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
        except Exception:  # as in _process: a bug must not leave the client hanging
            log.exception("unexpected error in a gRPC connection")
            self._h2.close_connection(ErrorCodes.INTERNAL_ERROR, b"internal error")
            self.closing = True
        reply = self._finish(out)
        if self._fast and not self.backlog and len(self._buffer) >= 9:  # the rest is the fast path's
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

    def release(self) -> None:
        """The connection is gone: let what h2 holds (a header block in progress: up to
        ``MAX_HEADER_BLOCK``) go now. h2's connection is a reference cycle (its frame dispatch table
        holds its own bound methods), which only a full collection would free, long after a flood of
        connections has closed (issue 33)."""
        self._h2._frame_dispatch_table = {}  # type: ignore[attr-defined]
        self._calls.clear()
        self._waiting.clear()

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
            and not self._block
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
                    if buf.startswith(HTTP1_METHODS):
                        out.append(HTTP1_REPLY)
                        self.closing = True
                        return
                    if len(buf) < 8 and any(m.startswith(buf) for m in HTTP1_METHODS):
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
                    # FRAME_SIZE_ERROR from the header alone. h2 says it only once the whole frame is
                    # in: given the header it buffers it and waits, and the fast path, steady, handed
                    # the header back again and again (h2's buffer growing by 9 bytes a turn) until
                    # the "frame" was complete: 33 bytes from a client held the loop for 20 s of CPU
                    # per 5 MB of length (found by fuzzing, issue 23).
                    h2.close_connection(ErrorCodes.FRAME_SIZE_ERROR)
                    raise FrameTooLargeError(f"frame of {length} bytes, over the {MAX_FRAME} allowed")
                end = pos + 9 + length
                if end > n:
                    break
                self._frame(buf[pos:end])
                pos = end
                if self.wait:
                    self._held = buf[pos:] + self._held
                    return
                self._spent += FRAME_COST
                if self._spent >= PIECE_BUDGET and n - pos >= 9 and not self.closing:
                    self._buffer = buf[pos:]  # the rest in the glue's next slice (issue 33)
                    self.backlog = True
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

    def _calm(self, why: str) -> None:
        """GOAWAY ENHANCE_YOUR_CALM and the close: the client asked for more than its budget."""
        log.debug("gRPC client %s; closing the connection", why)
        self._h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, why.encode())
        self.closing = True
        self._block = 0
        self._calls.clear()
        self._waiting.clear()

    def expire(self) -> bytes:
        """The request deadline passed with a request begun (a header block, a frame) and not ended:
        the GOAWAY to write before the close."""
        if self.closing or not self._started:
            return b""
        self._calm("did not finish its request within --request-timeout")
        return self._h2.data_to_send()

    def login_expired(self) -> bytes:
        """--login-timeout passed with no call carrying a good token: the GOAWAY to write before the
        close (as for --request-timeout)."""
        if self.closing or not self._started:
            return b""
        self._calm("did not send a call with a valid bearer token within --login-timeout")
        return self._h2.data_to_send()

    def _logged_in(self) -> None:
        on_login, self.on_login = self.on_login, None
        if on_login is not None:
            on_login()

    def _frame(self, raw: bytes) -> None:
        """One complete frame: the frame budget, the header block's size, bookkeeping for the fast
        path, then h2."""
        kind = raw[3]
        flags = raw[4]
        sid = int.from_bytes(raw[5:9], "big") & 0x7FFFFFFF
        h2 = self._h2
        if not self._budget.spend(self._monotonic_ns() / 1e9, self.activity - self._requests + self._answered):
            self._calm("sent too many frames")
            return
        if kind in (HEADERS, CONTINUATION):
            if kind == HEADERS or self._block:  # (a CONTINUATION out of place is h2's protocol error)
                self._block = 0 if flags & END_HEADERS else self._block + len(raw) - 9 or 1
                if self._block > MAX_HEADER_BLOCK:
                    self._calm(f"sent a header block over {MAX_HEADER_BLOCK} bytes")
                    return
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
        elif kind == RST_STREAM and sid and sid <= h2.highest_inbound_stream_id and sid not in h2.streams:
            return  # a stream already closed (the client's reset crossed our reply): ignored, RFC 9113 5.1
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
        method, length = plain_call(headers)
        credentials = self._service.credentials
        if method and credentials is not None:
            # --token-file: the call goes to the fast path only with a good token (else h2 opens it and
            # _request refuses it). A block remembered here carries a token checked against the
            # credentials in use: a reload makes every connection forget them (Daemon.forget_headers).
            # More than one authorization value is refused, by _request: it goes there (method 0).
            tokens = [value for name, value in headers if name == b"authorization"]
            if len(tokens) != 1 or not credentials.check_authorization(tokens[0], count=False):
                method = 0
            elif self.on_login is not None:
                self._logged_in()
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

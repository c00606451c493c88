"""The gRPC front end's fast path: :class:`PyGrpcCore`, and its compiled twin
``_grpc_speedups.GrpcCore`` (the same steps in C; :data:`GrpcCore` is whichever
:mod:`katsubushi_py.compiled` selects). :class:`~.grpc_h2.GrpcConnection`, the slow path, derives from
it.

It serves the steady state of ``Fetch`` and ``FetchMulti``: a HEADERS frame whose header block it
recognises (or the slow path has decoded for it), then the DATA frame with the stream's one message
and END_STREAM, answered with precomputed HEADERS, the DATA frame with the IDs, and the trailers; also
connection WINDOW_UPDATEs, and the per-stream ones grpcio sends before its DATA. At the first frame it
does not take it hands the rest of the input to the slow path, after the HEADERS frames (and window
updates) of the calls it had started, which h2 then opens as if it had seen them first; and it takes
the input back if the slow path stops early, in steady state, leaving frames in ``_buffer``.

Recognising a header block without decoding it: an HPACK block that has only indexed fields and
literals *without indexing* (or never indexed) leaves the dynamic table as it was, so while no other
kind of block is decoded, the same bytes always mean the same headers. h2load's, grpcio's and
grpc-js's blocks after the first are of that kind (indexed fields, an unindexed ``:path``). The slow
path remembers such blocks (:meth:`PyGrpcCore._cache_add`) and forgets them all before any other kind
is decoded (:meth:`PyGrpcCore._cache_clear`).

The inbound window: the fast path counts the DATA bytes it consumed (``_debt``) and gives them back
with a WINDOW_UPDATE once they reach half of h2's window, as h2 would; the slow path gives back what
is left before h2 runs, so h2's own account is exact whenever it is used.

WINDOW_UPDATEs without calls: after ``IDLE_WINDOW_UPDATES`` of them since the last call answered, the
fast path hands the rest to the slow path, whose frame budget counts every frame (issue 33: a client
could otherwise send window updates for ever, at the fast path's cost, without a request).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..issuing.issuer import MAX_IDS_PER_REQUEST
from . import grpc_service as svc
from .grpc_frames import (
    CACHE_SIZE,
    CALL_COST,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    IDLE_WINDOW_UPDATES,
    MAX_FRAME,
    MAX_STREAMS,
    PIECE_BUDGET,
    RETURN_AT,
    WINDOW_UPDATE,
    frame,
    reply_frames,
)
from .grpc_service import fetch_multi_reply, fetch_reply


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
        "_idle",
        "_in_window",
        "_last_stream",
        "_next_id",
        "_next_ids",
        "_out_window",
        "_peer_window",
        "_pending",
        "_spent",
        "activity",
        "backlog",
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
    _idle: int
    _spent: int
    activity: int
    backlog: bool
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
        self._idle = 0  # WINDOW_UPDATEs taken since the last call answered (see IDLE_WINDOW_UPDATES)
        self._next_id = generator.next_id
        self._next_ids = generator.next_ids
        self._counters = counters
        self._spent = 0  # this receive's (or resume's) work: see PIECE_BUDGET
        self.activity = 0
        self.backlog = False
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
        path again if the slow path stopped early, in steady state, leaving frames in ``_buffer``.
        While ``backlog`` is set (a piece's budget was spent) what arrives is only held, behind the
        rest, until ``resume``."""
        if self.backlog:
            self._buffer += data
            return b""
        self._spent = 0  # a new piece: both paths spend from it
        out: list[bytes] = []
        while True:
            if not self._fast:
                out.append(self._receive_slow(data))
            else:
                part, slow = self._fast_pass(data)
                out.append(part)
                if not slow:
                    break
            if not self._fast or self.backlog or len(self._buffer) < 9:
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
                out.append(reply_frames(sid, message))
                calls += 1
                issued += count
                self._idle = 0
                self._spent += len(message) + CALL_COST
                if self._spent >= PIECE_BUDGET and n - end >= 9:  # the rest in the glue's next slice
                    pos = end
                    self.backlog = True
                    break
            elif kind == WINDOW_UPDATE and length == 4:
                increment = int.from_bytes(buf[pos + 9 : end], "big") & 0x7FFFFFFF
                if not increment or self._idle >= IDLE_WINDOW_UPDATES:
                    give_up = True
                    break
                self._idle += 1
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

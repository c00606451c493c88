"""One gRPC call's life on the slow path, from its request headers to its trailers.

Apart from grpc_h2.py (the connection: frames in, h2's events, the fast path's hand-overs, the flood
budget, GOAWAY) because a call is its own concern: judging the request headers (content-type,
grpc-timeout, method, bearer token, the path) and refusing a bad one with a trailers-only answer, cutting
length-prefixed messages out of the body (size and compression refused as grpc-go words it), answering
a unary call (or waiting for the clock) and a reflection stream, and sending the reply as the client's
flow-control windows take it, then the trailers. :class:`GrpcCalls` is the half of
:class:`~.grpc_h2.GrpcConnection` that does this; the connection sets the state it uses.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from h2.errors import ErrorCodes

from ..issuing.errors import ClockWait
from . import grpc_service as svc
from .grpc_frames import MAX_MESSAGE, valid_timeout
from .grpc_service import GrpcService, Reply

log = logging.getLogger("katsubushi_py")


_REPLY_HEADERS = ((b":status", b"200"), (b"content-type", b"application/grpc"))


def _grpc_message(text: str) -> bytes:
    """The ``grpc-message`` value: UTF-8, percent-encoded outside printable ASCII and ``%``."""
    return b"".join(
        bytes((c,)) if 0x20 <= c <= 0x7E and c != 0x25 else b"%%%02X" % c for c in text.encode("utf-8", "replace")
    )


class _Call:
    """An open stream."""

    __slots__ = (
        "body",
        "encoding",
        "ended",
        "headers_sent",
        "messages",
        "method",
        "refusal",
        "sid",
        "trailers",
        "unsent",
    )

    def __init__(self, sid: int, method: int, encoding: bytes | None) -> None:
        self.sid = sid
        self.refusal: list[tuple[bytes, bytes]] | None = None  # a refusal to send once the client ends its side
        self.method = method
        self.encoding = encoding
        self.body = b""  # bytes of a request message still arriving
        self.messages: list[bytes] = []  # complete request messages not yet answered (unary: at most one)
        self.ended = False  # the client ended its side
        self.headers_sent = False
        self.unsent = b""  # reply DATA the client's windows do not take yet
        self.trailers: list[tuple[bytes, bytes]] | None = None  # to send once unsent is


class GrpcCalls:
    """The calls of a :class:`~.grpc_h2.GrpcConnection` (see the module's docstring): only its base,
    with no state of its own (``__slots__`` empty: the connection's slots hold it)."""

    __slots__ = ()

    _h2: Any
    _service: GrpcService
    _calls: dict[int, _Call]
    _waiting: deque[_Call]
    _draining: bool
    _requests: int
    _answered: int
    activity: int
    wait: float
    _spent: int  # the reply bytes of this receive or resume (PIECE_BUDGET: issue 33's fairness)
    on_login: Any  # with --token-file: called once, at the first call with a good token (then None)

    # -- calls -----------------------------------------------------------------------------------
    def _request(self, sid: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        self.activity += 1
        self._requests += 1
        method = path = ctype = encoding = timeout = authorization = None
        authorizations = 0
        for name, value in headers:
            if name == b"authorization":
                authorization = value
                authorizations += 1
            elif name == b":path":
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
            self._abort(sid, ended, b"415", svc.INVALID_ARGUMENT, f'invalid gRPC request content-type "{shown}"')
            return
        if timeout is not None and not valid_timeout(timeout):
            self._abort(sid, ended, b"400", svc.INTERNAL, f"malformed grpc-timeout: {timeout.decode('latin-1')!r}")
            return
        if method != b"POST":
            shown = (method or b"").decode("utf-8", "replace")
            self._abort(sid, ended, b"405", svc.INTERNAL, f'method "{shown}" is not allowed: gRPC calls are POST')
            return
        credentials = self._service.credentials
        if credentials is not None and authorizations > 1:
            # Which of several values counts is a choice two implementations can make differently (a
            # proxy in front may judge the first, we the last): the call is refused whatever they say.
            credentials.check_authorization(None)  # counted as a failed authentication
            text = f"{authorizations} authorization metadata values: send exactly one (Bearer <token>)"
            self._abort(sid, ended, b"200", svc.UNAUTHENTICATED, text)
            return
        if credentials is not None and not credentials.check_authorization(authorization):
            text = "invalid bearer token" if authorization else "missing metadata authorization: Bearer <token>"
            self._abort(sid, ended, b"200", svc.UNAUTHENTICATED, text)
            return
        if credentials is not None and self.on_login is not None:
            self._logged_in()  # type: ignore[attr-defined]  # (the connection's)
        code = svc.METHODS.get(path or b"")
        if code is None:
            self._abort(sid, ended, b"200", svc.UNIMPLEMENTED, svc.unknown_method(path or b""))
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
        if not call.method:  # refused from its headers (answered now), or already answered with an error
            if call.refusal is not None:
                self._h2.send_headers(call.sid, call.refusal, end_stream=True)
                call.refusal = None
                self._calls.pop(call.sid, None)
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
        except Exception:  # a bug in a method: answer this call with it, as the HTTP front end does
            log.exception("unexpected error answering a gRPC call")
            reply = Reply(None, svc.INTERNAL, "internal error; see the daemon's log")
        if reply.message is not None:
            self._send_message(call, reply.message)
        self._trailers(call, reply.status, reply.text, reply.trailers)
        return True

    def _abort(self, sid: int, ended: bool, http_status: bytes, status: int, text: str, extra: tuple = ()) -> None:
        """A call refused from its headers: one HEADERS frame (trailers only), once the client has ended
        its side (at once if its HEADERS ended the stream). What it still sends is read and dropped. No
        RST_STREAM (grpc-go sends one, which makes curl, still sending its body, report an error instead
        of the answer), and no answer before the request is whole: curl 7.88, given the answer before it
        had sent its body, sent the body and then waited for nothing until its own timeout (about one
        call in thirty, by timing). A client that never ends the stream is closed at --request-timeout,
        as any request left incomplete."""
        headers = [
            (b":status", http_status),
            (b"content-type", b"application/grpc"),
            (b"grpc-status", b"%d" % status),
            (b"grpc-message", _grpc_message(text)),
            *extra,
        ]
        if ended:
            self._h2.send_headers(sid, headers, end_stream=True)
            return
        call = self._calls[sid] = _Call(sid, 0, None)  # method 0: what arrives on it is dropped
        call.refusal = headers

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
        self._spent += len(message)
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
        self._answered += 1
        self._calls.pop(call.sid, None)
        stream = h2.streams.get(call.sid)
        if stream is not None and not stream.closed:  # answered before the client finished sending: stop it
            h2.reset_stream(call.sid, ErrorCodes.NO_ERROR)

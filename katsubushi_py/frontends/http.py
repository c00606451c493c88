"""HTTP/1.1 as go-katsubushi answers it, and more, sans-IO: bytes in, bytes out.

Routes (exact paths, ``GET`` only; any other method on them is ``405`` with ``Allow: GET``):

- ``/id``, ``/ids?n=N`` (1 <= N <= 1000, missing means 1): go-katsubushi's bodies byte for byte, plain
  text by default and JSON when ``Accept`` mentions ``application/json``, IDs as JSON strings because
  they exceed 2^53. A bad ``n`` is ``400`` with a JSON body that says what is allowed (go-katsubushi
  crashes the request on ``n=-1`` and answers ``n=0`` with an empty list; here both are ``400``). A
  generation failure is ``503`` with the reason.
- ``/stats``: the STATS fields as indented JSON (go-katsubushi's nine first, then ours).
- ``/metrics`` (Prometheus), ``/healthz`` (``200``, or ``503`` with why no ID can be issued now),
  ``/livez`` (``200`` while the event loop answers: a liveness probe),
  ``/decode/<id>`` (the JSON line of ``katsubushi-py decode``).
- Anything else is ``404``. Every error body is ``{"error": "..."}``.

The parser is httptools (llhttp, the C parser behind Node.js and uvicorn): about 2 us a request where
the pure-Python h11 takes about 100 us, which would make HTTP parsing, not issuing, the cost of a
request. It frames requests, bodies and keep-alive; what it does not do is bound what a client can
make the server hold, so this module does, answering each excess with its 4xx and closing:

- request target over ``MAX_URL`` bytes: ``414``;
- header section over ``MAX_HEAD`` bytes or ``MAX_HEADERS`` fields: ``431``;
- a body over ``MAX_BODY`` bytes (no route takes one; a small one is read and ignored): ``413``;
- more than ``MAX_PIPELINED`` requests in one read (each answered at once would let a 28-byte
  ``/ids?n=1000`` request cost 20 KB of reply and a thousand IDs): ``429``;
- anything llhttp rejects (bare LF line ends, bad methods, an HTTP/2 preface): ``400``.

Held between calls: at most ``MAX_HEAD`` bytes of an unfinished head plus one read (the bytes of a
partial header are held by the parser, so the head's size is bounded from the reads that fed it), and
while a request waits for the clock, the requests parsed after it (at most ``MAX_PIPELINED``) and the
bytes of one more read (the server stops reading meanwhile). Responses go out in request order.

:class:`HttpConnection` has the interface of :class:`~katsubushi_py.frontends.text.TextConnection`
(``receive``, ``resume``, ``closing``, ``wait``, ``activity``), so the daemon drives it with the same
connection glue: flow control, idle timeout (which also closes a client that sends half a request and
stalls), the connection limit and the connection counters.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from email.utils import formatdate
from typing import NamedTuple
from urllib.parse import unquote_to_bytes

import httptools

from ..auth.credentials import Credentials
from ..ids.encodings import EncodingError, decode
from ..ids.layout import LayoutError
from ..ids.tools import decode_record
from ..issuing.errors import ClockWait
from ..issuing.issuer import MAX_IDS_PER_REQUEST, Issuer

log = logging.getLogger("katsubushi_py")

MAX_URL = 8 * 1024
MAX_HEAD = 16 * 1024
MAX_HEADERS = 100
MAX_BODY = 1024
MAX_PIPELINED = 100
#: One receive (or resume) answers no further pipelined request once its responses reach this many
#: bytes (the memcached protocols' budget, about three ``/ids?n=1000``): the rest is answered after
#: ``wait`` = :data:`YIELD` seconds, one turn of the event loop, in which other connections are served.
REPLY_BUDGET = 64 * 1024
YIELD = 1e-6

_REASONS = {
    200: b"200 OK",
    400: b"400 Bad Request",
    401: b"401 Unauthorized",
    404: b"404 Not Found",
    405: b"405 Method Not Allowed",
    408: b"408 Request Timeout",
    413: b"413 Content Too Large",
    414: b"414 URI Too Long",
    429: b"429 Too Many Requests",
    431: b"431 Request Header Fields Too Large",
    500: b"500 Internal Server Error",
    503: b"503 Service Unavailable",
}
TEXT = b"text/plain"
JSON = b"application/json"

#: What a connection beyond ``--max-connections`` (or during shutdown) is told before the close.
TOO_MANY_CONNECTIONS = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 33\r\n"
    b'Connection: close\r\n\r\n{"error":"too many connections"}\n'
)

_INTEGER = re.compile(rb"[+-]?[0-9]+")


def too_many_ids(n: int) -> str:
    """The refusal of a count over the limit; gRPC's ``FetchMulti`` says the same."""
    return f"too many IDs requested: {n}, n must be from 1 to {MAX_IDS_PER_REQUEST}"


def check_count(text: bytes | None) -> int | str:
    """``/ids``'s ``n``: the count, or why it is refused. Missing means 1, as in go-katsubushi."""
    if text is None:
        return 1
    if not _INTEGER.fullmatch(text):
        shown = text.decode("utf-8", "replace")[:40]
        return f"n must be an integer from 1 to {MAX_IDS_PER_REQUEST}, got {shown!r}"
    # int() refuses more than 4,300 digits (CPython's guard against quadratic conversion), and a huge
    # count shown back would make the reply as big as the request: judge the digits' length first.
    digits = text.lstrip(b"+-").lstrip(b"0")
    if len(digits) > len(str(MAX_IDS_PER_REQUEST)):
        sign = "-" if text.startswith(b"-") else ""
        shown = sign + (digits.decode() if len(digits) <= 40 else f"{digits[:20].decode()}... ({len(digits)} digits)")
        if sign:
            return f"n must be from 1 to {MAX_IDS_PER_REQUEST}, got {shown}"
        return f"too many IDs requested: {shown}, n must be from 1 to {MAX_IDS_PER_REQUEST}"
    n = -int(digits or b"0") if text.startswith(b"-") else int(digits or b"0")
    if n > MAX_IDS_PER_REQUEST:
        return too_many_ids(n)
    if n < 1:
        return f"n must be from 1 to {MAX_IDS_PER_REQUEST}, got {n}"
    return n


def _over_max_body(value: bytes) -> bool:
    """A Content-Length over ``MAX_BODY``, judged by its digits' length before int() (which refuses
    more than 4,300 of them)."""
    if not value.isdigit():
        return False
    digits = value.lstrip(b"0")
    return len(digits) > len(str(MAX_BODY)) or int(digits or b"0") > MAX_BODY


def _query_value(query: bytes | None, name: bytes) -> bytes | None:
    """The first value of ``name`` in a query string (percent-decoded), or None."""
    if not query:
        return None
    for pair in query.split(b"&"):
        key, _, value = pair.partition(b"=")
        if key == name:
            if b"%" in value or b"+" in value:
                value = unquote_to_bytes(value.replace(b"+", b" "))
            return value
    return None


_date = [0, b""]


def _http_date() -> bytes:
    """The Date header's value, formatted once a second."""
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, formatdate(now, usegmt=True).encode()
    return _date[1]


def response(status: int, content_type: bytes, body: bytes, keep_alive: bool = True, extra: bytes = b"") -> bytes:
    """One complete response. ``extra`` is more header lines, each ending in CRLF."""
    return b"HTTP/1.1 %b\r\nContent-Type: %b\r\nContent-Length: %d\r\nDate: %b\r\n%b%b\r\n%b" % (
        _REASONS[status],
        content_type,
        len(body),
        _http_date(),
        extra,
        b"" if keep_alive else b"Connection: close\r\n",
        body,
    )


def error_body(message: str, **more: object) -> bytes:
    return json.dumps({"error": message, **more}, separators=(",", ":")).encode() + b"\n"


class Request(NamedTuple):
    method: bytes
    target: bytes
    accept: bytes
    keep_alive: bool
    version: str
    authorization: bytes = b""  # the Authorization header (checked only with --token-file)


class Refusal(NamedTuple):
    """A request that broke a limit or the syntax: answered with ``status`` in its turn, then the close."""

    status: int
    message: str


#: (Accept header) -> (body, content type): the Prometheus exposition, made by the daemon.
MetricsRenderer = Callable[[bytes], tuple[bytes, bytes]]


class HttpApi:
    """The routes, shared by every HTTP connection of a daemon."""

    def __init__(self, issuer: Issuer, metrics: MetricsRenderer | None = None) -> None:
        self._issuer = issuer
        self._counters = issuer.counters("http")
        self._metrics = metrics
        self._routes: dict[bytes, Callable[[Request, bytes | None], bytes]] = {
            b"/id": self._id,
            b"/ids": self._ids,
            b"/stats": self._stats,
            b"/healthz": self._healthz,
            b"/livez": self._livez,
        }
        if metrics is not None:
            self._routes[b"/metrics"] = self._metrics_route
        self._credentials: Credentials | None = None
        self._open: frozenset[bytes] = frozenset()

    def require_token(self, credentials: Credentials, metrics_open: bool = False) -> None:
        """--token-file: every route but /healthz and /livez (and /metrics with ``metrics_open``) needs
        ``Authorization: Bearer <token>``; without it, 401 and a ``WWW-Authenticate`` challenge."""
        self._credentials = credentials
        probes = (b"/healthz", b"/livez")  # what kubelets and load balancers ask, without credentials
        self._open = frozenset((*probes, b"/metrics") if metrics_open else probes)

    def respond(self, request: Request | Refusal, on_login: Callable[[], None] | None = None) -> bytes:
        """The response to one request. Raises :class:`ClockWait` (nothing sent, nothing counted) when
        the request must be retried a little later. ``on_login`` is called when the request's token is
        checked and good (its connection is authenticated from then on; issue 33)."""
        if isinstance(request, Refusal):
            return response(request.status, JSON, error_body(request.message), keep_alive=False)
        target = request.target
        if target[:1] == b"/":
            path, _, query = target.partition(b"?")
            path = path.partition(b"#")[0]
        else:  # absolute form (http://host/path) or something stranger
            try:
                url = httptools.parse_url(target)
            except httptools.HttpParserInvalidURLError:
                return response(400, JSON, error_body("bad request target"), request.keep_alive)
            path, query = url.path or b"/", url.query
        route = self._routes.get(path)
        if route is None and not path.startswith(b"/decode/"):
            body = b"" if request.method == b"HEAD" else error_body("not found")
            return response(404, JSON, body, request.keep_alive)
        credentials = self._credentials
        if (
            credentials is not None
            and path not in self._open
            and not credentials.check_authorization(request.authorization)
        ):
            return self._unauthorized(request)
        if on_login is not None and credentials is not None and path not in self._open:
            on_login()
        if request.method != b"GET":
            body = b"" if request.method == b"HEAD" else error_body("method not allowed: use GET")
            return response(405, JSON, body, request.keep_alive, b"Allow: GET\r\n")
        if route is None:
            return self._decode(request, path[len(b"/decode/") :], query)
        return route(request, query)

    def _unauthorized(self, request: Request) -> bytes:
        """401 with RFC 6750's challenge (``invalid_token`` when a token was given and is wrong)."""
        if request.authorization:
            challenge = b'WWW-Authenticate: Bearer realm="katsubushi-py", error="invalid_token"\r\n'
            message = "invalid bearer token"
        else:
            challenge = b'WWW-Authenticate: Bearer realm="katsubushi-py"\r\n'
            message = "authentication required: send Authorization: Bearer <token>"
        body = b"" if request.method == b"HEAD" else error_body(message)
        return response(401, JSON, body, request.keep_alive, challenge)

    # -- routes ----------------------------------------------------------------------------------
    def _reply(self, request: Request, status: int, content_type: bytes, body: bytes) -> bytes:
        extra = b"Connection: keep-alive\r\n" if request.keep_alive and request.version == "1.0" else b""
        return response(status, content_type, body, request.keep_alive, extra)

    def _failure(self, request: Request, reason: str, message: str) -> bytes:
        return self._reply(request, 503, JSON, error_body(message, reason=reason))

    def _id(self, request: Request, query: bytes | None) -> bytes:
        ids = self._issuer.issue(self._counters, 1)
        if not isinstance(ids, list):
            return self._failure(request, ids.reason, ids.message)
        if b"application/json" in request.accept:
            return self._reply(request, 200, JSON, b'{"id":"%d"}' % ids[0])
        return self._reply(request, 200, TEXT, b"%d" % ids[0])

    def _ids(self, request: Request, query: bytes | None) -> bytes:
        n = check_count(_query_value(query, b"n"))
        if isinstance(n, str):
            self._counters.commands += 1  # go-katsubushi counts a refused count in cmd_get too
            return self._reply(request, 400, JSON, error_body(n))
        ids = self._issuer.issue(self._counters, n)
        if not isinstance(ids, list):
            return self._failure(request, ids.reason, ids.message)
        # One format template per reply: about twice as fast as formatting each ID and joining.
        if b"application/json" in request.accept:
            return self._reply(request, 200, JSON, b'{"ids":["' + (b'%d","' * n)[:-3] % tuple(ids) + b'"]}\n')
        return self._reply(request, 200, TEXT, (b"%d\n" * n)[:-1] % tuple(ids))

    def _stats(self, request: Request, query: bytes | None) -> bytes:
        body = json.dumps(dict(self._issuer.stats_fields()), indent=2).encode() + b"\n"
        return self._reply(request, 200, JSON, body)

    def _healthz(self, request: Request, query: bytes | None) -> bytes:
        problem = self._issuer.health()
        if problem is None:
            body = {"status": "ok", "worker_id": self._issuer.generator.worker_id}
            return self._reply(request, 200, JSON, json.dumps(body, separators=(",", ":")).encode() + b"\n")
        body = {"status": "unavailable", "reason": problem.reason, "message": problem.message}
        return self._reply(request, 503, JSON, json.dumps(body, separators=(",", ":")).encode() + b"\n")

    def _livez(self, request: Request, query: bytes | None) -> bytes:
        """Alive: the event loop answers (a liveness probe). Nothing about issuing, which /healthz
        answers: a daemon waiting for its clock or a lease recovers by itself, a restart would not help."""
        return self._reply(request, 200, JSON, b'{"status":"alive"}\n')

    def _metrics_route(self, request: Request, query: bytes | None) -> bytes:
        assert self._metrics is not None
        body, content_type = self._metrics(request.accept)
        return self._reply(request, 200, content_type, body)

    def _decode(self, request: Request, text: bytes, query: bytes | None) -> bytes:
        encoding = (_query_value(query, b"encoding") or b"dec").decode("ascii", "replace")
        try:
            layout = self._issuer.generator.layout
            record = decode_record(layout, layout.check_id(decode(unquote_to_bytes(text).decode(), encoding)))
        except (EncodingError, LayoutError, UnicodeDecodeError) as exc:
            return self._reply(request, 400, JSON, error_body(str(exc)))
        return self._reply(request, 200, JSON, record.encode() + b"\n")


class _Stop(Exception):
    """Raised from a parser callback to stop parsing at a refused request."""


class HttpConnection:
    """One client's side of the conversation; the parser calls the ``on_*`` methods.

    After :meth:`receive`: ``closing`` says the server must close once the reply is written; ``wait``
    (seconds, 0 when not waiting) says a request waits for the clock and :meth:`resume` must be called
    after that long; ``activity`` counts complete requests (the idle timer uses it).
    """

    __slots__ = (
        "_api",
        "_authorization",
        "_body",
        "_fresh_head",
        "_head",
        "_head_fed",
        "_headers",
        "_in_head",
        "_parser",
        "_pending",
        "_queue",
        "_refused",
        "_request_accept",
        "_url",
        "activity",
        "closing",
        "on_login",
        "wait",
    )

    #: The connection glue's "input held until the reply is written": never here (HTTP bounds its
    #: pipelining itself, see MAX_PIPELINED).
    backlog = False

    def __init__(self, api: HttpApi) -> None:
        self._api = api
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[Request | Refusal] = deque()
        self._pending = b""  # bytes that arrived while a request waits for the clock
        self._url = b""
        self._request_accept = b""
        self._authorization = b""
        self._head = 0  # bytes of the current head's target and complete headers
        self._head_fed = 0  # bytes fed to the parser since the current head began (at most)
        self._headers = 0
        self._body = 0
        self._in_head = False
        self._fresh_head = False
        self._refused = False  # a refusal is queued: the parser is done with this connection
        self.closing = False
        self.wait = 0.0
        self.activity = 0
        #: With --token-file, set by the daemon: called once, at the first request with a good token.
        self.on_login: Callable[[], None] | None = None

    def login_expired(self) -> bytes:
        """--login-timeout passed with no request carrying a good token: the 408 to write before the
        close (nothing when a response that closes is already on its way)."""
        if self.closing:
            return b""
        self.closing = True
        message = "no request with a valid bearer token within --login-timeout"
        return response(408, JSON, error_body(message), keep_alive=False)

    def _logged_in(self) -> None:
        on_login, self.on_login = self.on_login, None
        if on_login is not None:
            on_login()

    def receive(self, data: bytes) -> bytes:
        """Take newly arrived bytes; return the responses to every request complete in them."""
        if self.closing:
            return b""
        if self.wait:
            self._pending += data
            return b""
        self._feed(data)
        return self._answer()

    def resume(self) -> bytes:
        """After ``wait`` seconds: answer the waiting request, what was parsed after it, then what
        arrived meanwhile."""
        self.wait = 0.0
        out = self._answer()
        if self._pending and not self.wait and not self.closing:
            data, self._pending = self._pending, b""
            self._feed(data)
            out += self._answer()
        return out

    # -- parsing ---------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if self._refused:
            return
        self._fresh_head = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An Upgrade or CONNECT request is answered as any other (we never switch protocols), then
            # the connection closes: what follows it is not HTTP/1.1 we could read.
            last = self._queue[-1] if self._queue else None
            if isinstance(last, Request):
                self._queue[-1] = last._replace(keep_alive=False)
            else:
                self._queue.append(Refusal(400, "protocol upgrades are not supported"))
            self._refused = True
            return
        except httptools.HttpParserCallbackError:
            if not self._refused:  # not one of our limits: a bug in a callback
                self._queue.append(Refusal(500, "internal error"))
                self._refused = True
            return
        except httptools.HttpParserError as exc:
            self._queue.append(Refusal(400, f"bad request: {exc}"))
            self._refused = True
            return
        if self._in_head:
            # A header still arriving is held inside the parser, which passes it on only when complete:
            # bound the head by the bytes fed since it began. In the read where it began, that is at
            # most what follows the end of the last complete head.
            if self._fresh_head:
                end = data.rfind(b"\r\n\r\n")
                self._head_fed = len(data) - (end + 4 if end >= 0 else 0)
            else:
                self._head_fed += len(data)
            if self._head_fed > MAX_HEAD:
                self._queue.append(Refusal(431, f"request header section over {MAX_HEAD} bytes"))
                self._refused = True

    def _refuse(self, status: int, message: str) -> None:
        self._queue.append(Refusal(status, message))
        self._refused = True
        raise _Stop

    def on_message_begin(self) -> None:
        if len(self._queue) >= MAX_PIPELINED:
            self._refuse(429, f"more than {MAX_PIPELINED} pipelined requests: read the responses before sending more")
        self._url = b""
        self._request_accept = b""
        self._authorization = b""
        self._head = self._head_fed = self._headers = self._body = 0
        self._in_head = self._fresh_head = True

    def on_url(self, piece: bytes) -> None:
        self._url += piece
        if len(self._url) > MAX_URL:
            self._refuse(414, f"request target over {MAX_URL} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers += 1
        self._head += len(name) + len(value) + 4
        if self._headers > MAX_HEADERS:
            self._refuse(431, f"more than {MAX_HEADERS} header fields")
        if self._head + len(self._url) > MAX_HEAD:
            self._refuse(431, f"request header section over {MAX_HEAD} bytes")
        if len(name) == 13 and name.lower() == b"authorization":
            self._authorization = value
        elif len(name) == 6 and name.lower() == b"accept":
            self._request_accept = self._request_accept + b"," + value if self._request_accept else value
        elif len(name) == 14 and name.lower() == b"content-length" and _over_max_body(value.strip()):
            self._refuse(413, f"request body over {MAX_BODY} bytes (no route takes one)")

    def on_headers_complete(self) -> None:
        self._in_head = False

    def on_body(self, piece: bytes) -> None:
        self._body += len(piece)
        if self._body > MAX_BODY:
            self._refuse(413, f"request body over {MAX_BODY} bytes (no route takes one)")

    def on_message_complete(self) -> None:
        parser = self._parser
        self._queue.append(
            Request(
                parser.get_method(),
                self._url,
                self._request_accept,
                parser.should_keep_alive(),
                parser.get_http_version(),
                self._authorization,
            )
        )
        self.activity += 1

    # -- answering -------------------------------------------------------------------------------
    def _answer(self) -> bytes:
        queue = self._queue
        respond = self._api.respond
        login = self._logged_in if self.on_login is not None else None
        out = []
        spent = 0
        while queue:
            request = queue[0]
            try:
                out.append(respond(request, login))
            except ClockWait as wait:
                self.wait = max(wait.seconds, 1e-4)
                break
            except Exception:  # a bug in a route: answer it and close, rather than drop the connection
                log.exception("unexpected error answering an HTTP request")
                request = Refusal(500, "internal error; see the daemon's log")
                out.append(respond(request))
            queue.popleft()
            if isinstance(request, Refusal) or not request.keep_alive:
                self.closing = True
                queue.clear()
                self._pending = b""
                break
            spent += len(out[-1])
            if spent >= REPLY_BUDGET and queue:
                # Fairness: the rest after one turn of the event loop (as a wait for the clock is
                # resumed), so that 100 pipelined /ids?n=1000 (100,000 IDs) stall no one else.
                self.wait = YIELD
                break
        return b"".join(out)

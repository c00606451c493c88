"""The memcached binary protocol, sans-IO: bytes in, bytes out.

:class:`BinaryConnection` has the same interface as :class:`~.text.TextConnection` (``receive``,
``resume``, ``closing``, ``wait``, ``activity``), so the daemon drives both alike. A connection
speaks binary when its first byte is the request magic ``0x80``.

What it answers (go-katsubushi's shapes where it has them, memcached's everywhere else):

- GET ``0x00``, GETQ ``0x09``, GETK ``0x0c``, GETKQ ``0x0d``: one fresh ID each: status 0, four zero
  flag bytes as extras, the decimal ID as the value, CAS 0; the K variants echo the key. The key may
  be empty. A quiet get only hides a miss, and an ID is never a miss, so quiet gets are answered too:
  that is what makes ``GETKQ k1 ... GETKQ kn NOOP`` (how pylibmc, Dalli and php-memcached multi-get)
  work.
- NOOP ``0x0a``, VERSION ``0x0b``, QUIT ``0x07`` (answered, then closed), QUITQ ``0x17`` (closed).
- STAT ``0x10``: with no key, one packet per field of the text ``STATS`` in the same order; with the
  key ``settings``, the text ``stats settings`` fields; with memcached's ``items``, ``slabs``,
  ``sizes`` or ``conns``, nothing (an empty group, as the text front end answers); each followed by an
  empty terminator packet. Any other key: status ``0x0001`` (not found), as memcached answers a group
  it does not have.
- The opaque is echoed on every response, errors included, and the opcode is the request's.
- Storage, deletion, arithmetic, flush, touch and verbosity opcodes: status ``0x0083`` (not
  supported) with a short message; any other opcode: ``0x0081`` (unknown command). The connection
  stays usable.
- No ID can be issued: status ``0x0086`` (temporary failure: clock behind, lease not confirmed, state
  file, shutting down) or ``0x0084`` (internal error, layout exhausted), the reason as the body, for
  that request only.
- A key over 250 bytes, or key and extras longer than the body: status ``0x0004`` (invalid
  arguments), then the connection is closed, as memcached does, without reading or allocating the
  body; the same for a body over :data:`MAX_BODY` where the opcode takes none that long (the gets,
  NOOP, VERSION, STAT, QUIT), and for a value over 2**31 - 3 bytes (memcached's limit). A storage or
  unknown opcode with a body over :data:`MAX_BODY` is answered as soon as its header is in, and its
  body discarded as it arrives, never held (memcached reads and discards such a body too). A magic
  other than ``0x80`` closes the connection.

When the clock is a little behind, the request that needs an ID is not answered yet: ``wait`` says
for how long, the rest of the input is kept in order, and :meth:`BinaryConnection.resume` carries on
from that request, exactly as in the text front end.

Memory: between calls at most one incomplete request is held, under ``24 + MAX_BODY`` bytes (about
4 KiB). A call stops before a request other than a get once its reply has reached
:data:`~.fastpath.REPLY_BUDGET` and holds the rest (``backlog``) until :meth:`BinaryConnection.resume`,
as the text front end does; gets are not stopped for it, as their replies are never more than
twice their requests (a GET of 24 + k bytes answers 47 + k bytes or so, the key echoed only by GETK
and GETKQ), while a STAT of 24 bytes answers about 1.5 KiB. While a request waits for the clock the
rest of its read is held too, and the server reads nothing more meanwhile.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from ..issuing.errors import ClockWait
from ..issuing.issuer import Issuer
from .fastpath import COMPILED, MAX_KEY, REPLY_BUDGET, BinaryCore

#: The longest run of consecutive gets answered at once (about 48 KiB of reply): a longer one (100,000
#: ``getkq`` in one write) is answered a run at a time, under :data:`REPLY_BUDGET` like any other
#: request, so the connection glue can serve other clients between the slices.
GET_RUN = 1024

HEADER = 24
REQUEST_MAGIC = 0x80
RESPONSE_MAGIC = 0x81

#: No request we serve needs more than a key: the body of any other is held only up to this size
#: (larger ones are discarded unread, or refused, see the module's docstring).
MAX_BODY = 4096

#: memcached refuses a value longer than this (INT_MAX - 2) as invalid arguments.
MAX_VALUE = 2**31 - 3

# Parser states (``_state``): at a request's start, or discarding ``_skip`` more bytes of a body.
AT_REQUEST = 0
SKIP_BODY = 1

# Opcodes
GET, SET, ADD, REPLACE, DELETE, INCREMENT, DECREMENT, QUIT = range(8)
FLUSH, GETQ, NOOP, VERSION, GETK, GETKQ, APPEND, PREPEND, STAT = range(8, 17)
SETQ, ADDQ, REPLACEQ, DELETEQ, INCREMENTQ, DECREMENTQ, QUITQ, FLUSHQ, APPENDQ, PREPENDQ = range(0x11, 0x1B)
VERBOSITY, TOUCH, GAT, GATQ = range(0x1B, 0x1F)
GATK, GATKQ = 0x23, 0x24

# Statuses
SUCCESS = 0x0000
KEY_NOT_FOUND = 0x0001
INVALID_ARGUMENTS = 0x0004
UNKNOWN_COMMAND = 0x0081
NOT_SUPPORTED = 0x0083
INTERNAL_ERROR = 0x0084
TEMPORARY_FAILURE = 0x0086

#: memcached commands that store, delete, count or touch items: answered "not supported".
UNSUPPORTED = {
    SET: "SET",
    ADD: "ADD",
    REPLACE: "REPLACE",
    DELETE: "DELETE",
    INCREMENT: "INCREMENT",
    DECREMENT: "DECREMENT",
    FLUSH: "FLUSH",
    APPEND: "APPEND",
    PREPEND: "PREPEND",
    SETQ: "SETQ",
    ADDQ: "ADDQ",
    REPLACEQ: "REPLACEQ",
    DELETEQ: "DELETEQ",
    INCREMENTQ: "INCREMENTQ",
    DECREMENTQ: "DECREMENTQ",
    FLUSHQ: "FLUSHQ",
    APPENDQ: "APPENDQ",
    PREPENDQ: "PREPENDQ",
    VERBOSITY: "VERBOSITY",
    TOUCH: "TOUCH",
    GAT: "GAT",
    GATQ: "GATQ",
    GATK: "GATK",
    GATKQ: "GATKQ",
}

_ECHO_KEY = frozenset((GETK, GETKQ))

# memcached's groups of STAT that have nothing to report here (any other group is not found).
_EMPTY_STATS_GROUPS = frozenset((b"items", b"slabs", b"sizes", b"conns"))

# The opcodes a body of any length is accepted with (answered from the header, the body discarded):
# all but the ones we serve, which take a key at most.
_BODY_DISCARDED = frozenset(range(256)) - {GET, GETQ, GETK, GETKQ, NOOP, VERSION, STAT, QUIT, QUITQ}

# Failures that will not pass by themselves; every other reason is temporary.
_PERMANENT = frozenset(("internal", "layout_exhausted"))

# magic, opcode, key length, extras length, data type, vbucket, body length (the opaque is echoed raw).
_REQUEST = struct.Struct(">BBHBBHI")
# The same without data type and vbucket, with the opaque: what the parsing loop needs of a header.
_REQUEST_OPAQUE = struct.Struct(">BBHBxxxI4s")
# magic, opcode, key length, extras length, data type, status, body length, opaque (raw), CAS.
_RESPONSE = struct.Struct(">BBHBBHI4sQ")
_FLAGS = b"\x00\x00\x00\x00"

# Today's IDs have 19 digits, so a plain GET's reply comes from one template: the header up to the
# opaque (extras 4, body 23), the opaque, CAS and flags all zero, the ID.
_MIN_19_DIGITS = 10**18
_MAX_19_DIGITS = 10**19
_GET_19 = (
    struct.pack(">BBHBBHI", RESPONSE_MAGIC, GET, 0, 4, 0, SUCCESS, 4 + 19).replace(b"%", b"%%")
    + b"%b"
    + b"\x00" * 12
    + b"%d"
)


def _prefixes_19(opcode: int) -> list[bytes]:
    """Bytes 0-11 of the reply to ``opcode`` with a 19-digit ID, by the request's key length (only
    GETK and GETKQ echo the key, so only their replies depend on it)."""
    echo = opcode in _ECHO_KEY
    return [
        struct.pack(">BBHBBHI", RESPONSE_MAGIC, opcode, n if echo else 0, 4, 0, SUCCESS, 4 + (n if echo else 0) + 19)
        for n in range(MAX_KEY + 1)
    ]


# Pipelined gets (a quiet multi-get, or GETs sent back to back) are answered as one run: their IDs
# come from one ``next_ids`` and their replies from one format of this template repeated: prefix,
# opaque, CAS and flags all zero, the key (empty unless echoed), the ID.
_GET_PREFIXES_19 = {opcode: _prefixes_19(opcode) for opcode in (GET, GETQ, GETK, GETKQ)}
_GET_ITEM_19 = b"%b%b" + b"\x00" * 12 + b"%b%d"


def response(opcode: int, opaque: bytes, status: int = SUCCESS, key: bytes = b"", value: bytes = b"") -> bytes:
    """A response packet without extras."""
    head = _RESPONSE.pack(RESPONSE_MAGIC, opcode, len(key), 0, 0, status, len(key) + len(value), opaque, 0)
    return head + key + value


def value_response(opcode: int, opaque: bytes, key: bytes, id_: int) -> bytes:
    """A get's reply: flags 0 as extras, the key (empty unless echoed), the decimal ID."""
    value = b"%d" % id_
    head = _RESPONSE.pack(RESPONSE_MAGIC, opcode, len(key), 4, 0, SUCCESS, 4 + len(key) + len(value), opaque, 0)
    return head + _FLAGS + key + value


class BinaryConnection(BinaryCore):
    """One client's side of a binary conversation; see the module's docstring for what it answers."""

    __slots__ = (
        "_counters",
        "_issuer",
        "_next_id",
        "_next_ids",
        "_skip",
        "_version",
    )

    def __init__(self, issuer: Issuer) -> None:
        self._issuer = issuer
        self._counters = issuer.counters("binary")
        self._next_id = issuer.next_id
        self._next_ids = issuer.next_ids
        self._buffer = b""
        self._state = AT_REQUEST
        self._skip = 0  # SKIP_BODY: bytes of the body still to discard
        self._version = issuer.version.encode()
        self.closing = False
        self.wait = 0.0
        self.backlog = False
        self.activity = 0
        self._fast_init(issuer.generator, self._counters)

    def _receive_slow(self, data: bytes) -> bytes:
        """Take newly arrived bytes; return the reply to every request complete in them.

        This is the whole protocol. The compiled twin's ``receive`` answers what it can of the same
        input exactly as this would (runs of gets and NOOPs), and hands this method the rest."""
        if self._buffer:
            if self.wait or self.backlog or self.closing:  # a request waits, or the client is behind
                if not self.closing:
                    self._buffer += data  # kept, in order
                return b""
            data = self._buffer + data
            self._buffer = b""
        elif self.closing or self.backlog:  # (backlog: the server holds input while its client is behind)
            if not self.closing:
                self._buffer = data
            return b""
        if self._state:  # SKIP_BODY: the rest of a body answered already
            if self._skip > len(data):
                self._skip -= len(data)
                return b""
            # A body that ends with this read leaves the parser at a request's start, as it would if
            # the body had come in one read with its header (fuzzing found the state left behind).
            data = data[self._skip :]
            self._skip = 0
            self._state = AT_REQUEST
        if len(data) >= HEADER:
            magic, opcode, keylen, extlen, _, _, bodylen = _REQUEST.unpack_from(data)
            if (
                opcode == GET
                and magic == REQUEST_MAGIC
                and len(data) == HEADER + bodylen
                and keylen <= MAX_KEY
                and keylen + extlen <= bodylen <= MAX_BODY
            ):
                # The usual case: exactly one complete GET.
                try:
                    reply = self._get_one(data[12:16])
                except ClockWait as wait:
                    return self._wait(data, wait, b"")
                self.activity += 1
                return reply
        return self._receive_all(data)

    if not COMPILED:
        receive = _receive_slow

    def resume(self) -> bytes:
        """After ``wait`` seconds, or once a ``backlog`` reply is written: carry on with the input held."""
        self.wait = 0.0
        self.backlog = False
        return self.receive(b"") if self._buffer else b""

    def _receive_all(self, data: bytes) -> bytes:
        """Every complete request in ``data``, in order; consecutive gets are answered as one run."""
        out: list[bytes] = []
        spent = self._spent  # reply bytes of this read so far (the compiled core's part, if any)
        pos = 0
        size = len(data)
        handlers = _HANDLERS
        prefixes_19 = _GET_PREFIXES_19
        gets: list[bytes | int] = []  # the run of gets not answered yet: prefix, opaque, key, 0 each
        gets_start = 0
        unpack = _REQUEST_OPAQUE.unpack_from

        while size - pos >= HEADER:
            magic, opcode, keylen, extlen, bodylen, opaque = unpack(data, pos)
            if magic != REQUEST_MAGIC or keylen > MAX_KEY or keylen + extlen > bodylen:
                break  # answered below, after the requests before it
            end = pos + HEADER + bodylen
            prefixes = prefixes_19.get(opcode)
            if prefixes is not None:
                if bodylen > MAX_BODY or end > size:
                    break
                if not gets:
                    gets_start = pos
                if opcode in _ECHO_KEY:
                    key_start = pos + HEADER + extlen
                    gets += (prefixes[keylen], opaque, data[key_start : key_start + keylen], 0)
                else:
                    gets += (prefixes[keylen], opaque, b"", 0)
                pos = end
                if len(gets) >= 4 * GET_RUN:  # a long run is answered a piece at a time, under the budget
                    waiting = self._answer_run(gets, data, gets_start, out)
                    if waiting is not None:
                        return waiting
                    spent += len(out[-1])
                    gets = []
                    if spent >= REPLY_BUDGET:
                        self._buffer = data[pos:]
                        self.backlog = True
                        return b"".join(out)
                continue
            if bodylen > MAX_BODY:
                if opcode not in _BODY_DISCARDED or bodylen - keylen - extlen > MAX_VALUE:
                    break  # refused below
            elif end > size:
                break
            if gets:
                waiting = self._answer_run(gets, data, gets_start, out)
                if waiting is not None:
                    return waiting
                spent += len(out[-1])
                gets = []
            if spent >= REPLY_BUDGET:  # the rest once this reply is written
                self._buffer = data[pos:]
                self.backlog = True
                return b"".join(out)
            self.activity += 1
            if bodylen > MAX_BODY:  # answered now; the body is discarded as it arrives
                reply = handlers[opcode](self, opcode, opaque, b"")
                out.append(reply)
                spent += len(reply)
                if end > size:
                    self._state = SKIP_BODY
                    self._skip = end - size
                    return b"".join(out)
                pos = end
                continue
            key_start = pos + HEADER + extlen
            reply = handlers[opcode](self, opcode, opaque, data[key_start : key_start + keylen])
            out.append(reply)
            spent += len(reply)
            if self.closing:  # QUIT: what came after it is not answered
                return b"".join(out)
            pos = end
        if gets:
            try:
                out.append(self._answer_gets(gets))
            except ClockWait as wait:
                return self._wait(data[gets_start:], wait, b"".join(out))
        if pos < size:
            out.append(self._check_rest(data, pos))
        return b"".join(out)

    def _check_rest(self, data: bytes, pos: int) -> bytes:
        """What follows the complete requests: keep an incomplete request; close on a bad magic, or
        on lengths too long to read (answered "invalid arguments", as memcached does, before the
        body is read or anything is allocated for it)."""
        if data[pos] != REQUEST_MAGIC:
            self.closing = True
            return b""
        if len(data) - pos >= HEADER:
            _, opcode, keylen, extlen, _, _, bodylen = _REQUEST.unpack_from(data, pos)
            if (
                keylen > MAX_KEY
                or keylen + extlen > bodylen
                or (bodylen > MAX_BODY and (opcode not in _BODY_DISCARDED or bodylen - keylen - extlen > MAX_VALUE))
            ):
                self.closing = True
                return response(opcode, data[pos + 12 : pos + 16], INVALID_ARGUMENTS, value=b"Invalid arguments")
        self._buffer = data[pos:]
        return b""

    def _answer_run(self, gets: list[bytes | int], data: bytes, gets_start: int, out: list[bytes]) -> bytes | None:
        """Answer the run of gets collected so far (``gets``, starting at ``gets_start`` in ``data``):
        its reply is appended to ``out``. When the clock makes them wait: the reply to return now (what
        came before; the run is kept for :meth:`resume`). A method, not a closure, so that the receive
        loop's variables stay plain locals; called once per run, not per get."""
        try:
            out.append(self._answer_gets(gets))
        except ClockWait as wait:
            return self._wait(data[gets_start:], wait, b"".join(out))
        return None

    def _wait(self, rest: bytes, wait: ClockWait, reply: bytes) -> bytes:
        """Keep ``rest`` (starting with the waiting request) for :meth:`resume`."""
        self._buffer = rest
        self.wait = max(wait.seconds, 1e-4)
        return reply

    # -- requests --------------------------------------------------------------------------------
    def _get_one(self, opaque: bytes) -> bytes:
        """A GET alone in its read: the binary hot path, so counters are bumped inline."""
        counters = self._counters
        counters.commands += 1
        try:
            id_ = self._next_id()
        except ClockWait:
            counters.commands -= 1
            raise
        except Exception as exc:
            return self._failure(GET, opaque, exc)
        counters.ids += 1
        if _MIN_19_DIGITS <= id_ < _MAX_19_DIGITS:
            return _GET_19 % (opaque, id_)
        return value_response(GET, opaque, b"", id_)

    def _answer_gets(self, gets: list[bytes | int]) -> bytes:
        """A run of gets: one ``next_ids`` for all, the replies in one format. If no ID can be
        issued, every request of the run gets the error, each with its own opaque."""
        count = len(gets) >> 2
        counters = self._counters
        counters.commands += count
        try:
            ids = self._next_ids(count) if count > 1 else [self._next_id()]
        except ClockWait:
            counters.commands -= count
            raise
        except Exception as exc:
            # The prefix's second byte is the opcode. Answered, so activity, as a GET alone is.
            replies = [self._failure(p[1], o, exc) for p, o in zip(gets[0::4], gets[1::4], strict=True)]  # type: ignore[index,arg-type]
            self.activity += count
            return b"".join(replies)
        counters.ids += count
        self.activity += count
        if ids[0] >= _MIN_19_DIGITS and ids[-1] < _MAX_19_DIGITS:
            gets[3::4] = ids
            return _GET_ITEM_19 * count % tuple(gets)
        return b"".join(
            value_response(p[1], o, k, i)  # type: ignore[index,arg-type]
            for p, o, k, i in zip(gets[0::4], gets[1::4], gets[2::4], ids, strict=True)
        )

    def _failure(self, opcode: int, opaque: bytes, exc: Exception) -> bytes:
        failure = self._issuer.failed(self._counters, exc)
        status = INTERNAL_ERROR if failure.reason in _PERMANENT else TEMPORARY_FAILURE
        return response(opcode, opaque, status, value=failure.message.encode("ascii", "replace"))

    def _noop(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        return response(opcode, opaque)

    def _version_cmd(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        return response(opcode, opaque, value=self._version)

    def _stat(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        if not key:
            fields = self._issuer.stats_fields()
        elif key == b"settings":
            fields = self._issuer.settings_fields()
        elif key in _EMPTY_STATS_GROUPS:
            fields = []
        else:
            return response(opcode, opaque, KEY_NOT_FOUND, value=b"Not found")
        packets = [response(opcode, opaque, key=name.encode(), value=str(value).encode()) for name, value in fields]
        packets.append(response(opcode, opaque))
        return b"".join(packets)

    def _quit(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        self.closing = True
        return b"" if opcode == QUITQ else response(opcode, opaque)

    def _unsupported(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        message = f"{UNSUPPORTED[opcode]} is not supported: this server only issues IDs"
        return response(opcode, opaque, NOT_SUPPORTED, value=message.encode())

    def _unknown(self, opcode: int, opaque: bytes, key: bytes) -> bytes:
        return response(opcode, opaque, UNKNOWN_COMMAND, value=b"Unknown command")


def _handlers() -> list[Callable[[BinaryConnection, int, bytes, bytes], bytes]]:
    """Every opcode but the gets (answered in runs, see ``_receive_all``), by opcode. Shared by all
    connections, so a connection costs no memory for it."""
    handlers = [BinaryConnection._unknown] * 256
    handlers[NOOP] = BinaryConnection._noop
    handlers[VERSION] = BinaryConnection._version_cmd
    handlers[STAT] = BinaryConnection._stat
    handlers[QUIT] = handlers[QUITQ] = BinaryConnection._quit
    for opcode in UNSUPPORTED:
        handlers[opcode] = BinaryConnection._unsupported
    return handlers


_HANDLERS = _handlers()

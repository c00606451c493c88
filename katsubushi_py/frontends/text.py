"""The memcached text protocol as go-katsubushi speaks it, sans-IO: bytes in, bytes out.

:class:`TextConnection` holds one connection's unparsed bytes and turns everything that arrived into
one reply, so the server writes pipelined answers with a single ``write`` and tests need no socket.

Framing follows katsubushi: a line ends at LF with an optional CR before it; tokens are separated by
ASCII whitespace (space, tab, and CR/VT/FF inside a line); the command word is case-insensitive; keys
are echoed byte for byte. Where katsubushi is wrong we are not: a whitespace-only line answers
``ERROR`` (it kills the Go daemon), an overlong line answers ``CLIENT_ERROR line too long`` before the
close (Go resets silently), and a generation failure is ``SERVER_ERROR <reason>`` (Go says ``ERROR``).

Beyond katsubushi, memcached's meta commands (lower case, as memcached takes them): ``mg <key>
<flags>*`` answers one fresh ID (``VA``/``HD`` with the flags ``v k O f s c t h l q u b N R T P L`` as
memcached 1.6 answers them for an item stored without expiry), ``mn`` answers ``MN``, and ``ms``,
``md``, ``ma`` and ``me`` answer ``CLIENT_ERROR ... not supported`` (``ms``'s data block is skipped, so
the connection stays in step). ``stats`` takes memcached's groups: ``stats settings`` shows the
configuration, other groups are empty.

IDs come from the :class:`~katsubushi_py.issuing.issuer.Issuer`. When the clock is a little behind,
the command that needs an ID is not answered yet: :attr:`TextConnection.wait` says for how long, the
rest of the input is kept in order, and :meth:`TextConnection.resume` carries on from that command.

Buffer cost: at most ``max_line`` bytes are held between calls (64 KiB by default, as katsubushi),
plus the bytes of the current call; while a command waits for the clock, also what arrived after it
in the same read (the server stops reading meanwhile). A reply is at most about 30 bytes per key of
the input.
"""

from __future__ import annotations

import binascii
from collections.abc import Callable

from ..issuing.errors import ClockWait
from ..issuing.issuer import Issuer

#: katsubushi serves lines of up to 65,536 bytes including the LF, and drops longer ones.
MAX_LINE = 65_536

ERROR = b"ERROR\r\n"
END = b"END\r\n"
LINE_TOO_LONG = b"CLIENT_ERROR line too long\r\n"

# The meta protocol, with memcached's limits and its error lines.
MAX_KEY = 250
MAX_OPAQUE_TOKEN = 32  # the O flag and its opaque, as memcached counts them
BAD_FORMAT = b"CLIENT_ERROR bad command line format\r\n"
INVALID_FLAG = b"CLIENT_ERROR invalid flag\r\n"
DUPLICATE_FLAG = b"CLIENT_ERROR duplicate flag\r\n"
OPAQUE_TOO_LONG = b"CLIENT_ERROR opaque token too long\r\n"
BAD_BASE64_KEY = b"CLIENT_ERROR error decoding key\r\n"
# The flags memcached 1.6 takes for mg; of these, an ID answers b, c, f, h, k, l, O, s, t and v.
_MG_FLAGS = frozenset(b"bcfhklOqstuvNRTPL")


# Today's IDs (and every ID of the default layout from 2015-01-25 to beyond its end) have 19 digits, so
# their VALUE lines can come from one format template instead of being assembled piece by piece.
_MIN_19_DIGITS = 10**18
_MAX_19_DIGITS = 10**19
_ONE_VALUE_19 = b"VALUE %b 0 19\r\n%d\r\nEND\r\n"
_VALUE_19 = b"VALUE %b 0 19\r\n%d\r\n"


def format_values(tokens: list[bytes], ids: list[int]) -> bytes:
    """The reply to ``GET`` with keys ``tokens[1:]`` and increasing ``ids``."""
    count = len(ids)
    if ids[0] >= _MIN_19_DIGITS and ids[-1] < _MAX_19_DIGITS:
        args: list[bytes | int] = [b""] * (2 * count)
        args[0::2] = tokens[1:]
        args[1::2] = ids
        return _VALUE_19 * count % tuple(args) + END
    parts = []
    for key, id_ in zip(tokens[1:], ids, strict=True):
        value = b"%d" % id_
        parts.append(b"VALUE %b 0 %d\r\n%b\r\n" % (key, len(value), value))
    parts.append(END)
    return b"".join(parts)


def server_error(message: str) -> bytes:
    return b"SERVER_ERROR " + message.encode("ascii", "replace") + b"\r\n"


def not_supported(command: bytes) -> bytes:
    return b"CLIENT_ERROR " + command + b" is not supported: this server only issues IDs\r\n"


class _DataBlock(Exception):
    """Raised by a command whose line is followed by a data block (meta set): the block is
    ``size`` bytes after the line, and ``reply`` answers line and block once both are in."""

    def __init__(self, size: int, reply: bytes) -> None:
        super().__init__(size)
        self.size = size
        self.reply = reply


def render_stats(fields: list[tuple[str, object]]) -> bytes:
    lines = [f"STAT {name} {value}\r\n" for name, value in fields]
    lines.append("END\r\n")
    return "".join(lines).encode()


class TextConnection:
    """One client's side of the conversation.

    After :meth:`receive`, ``closing`` says the server must close once the reply is written (QUIT,
    or an overlong line); ``wait`` (seconds, 0 when not waiting) says a command is waiting for the
    clock and :meth:`resume` must be called after that long, with no new input meanwhile;
    ``activity`` counts complete lines seen so far (the idle timer uses it).
    """

    __slots__ = (
        "_buffer",
        "_commands",
        "_counters",
        "_fast_get",
        "_issuer",
        "_max_line",
        "_next_id",
        "_version",
        "activity",
        "closing",
        "wait",
    )

    def __init__(self, issuer: Issuer, *, max_line: int = MAX_LINE, gets_cas: bool = False) -> None:
        self._issuer = issuer
        self._counters = issuer.counters("text")
        self._max_line = max_line
        self._buffer = b""
        self._version = b"VERSION " + issuer.version.encode() + b"\r\n"
        self.closing = False
        self.wait = 0.0
        self.activity = 0
        handlers: dict[bytes, Callable[[list[bytes]], bytes | None]] = {
            b"get": self._get,
            b"gets": self._gets_with_cas if gets_cas else self._get,
            b"version": self._version_cmd,
            b"stats": self._stats_cmd,
            b"quit": self._quit,
        }
        # The two usual spellings are looked up directly; anything else is lower-cased first.
        self._commands = {**handlers, **{name.upper(): h for name, h in handlers.items()}}
        self._fast_get = frozenset((b"get", b"GET") if gets_cas else (b"get", b"GET", b"gets", b"GETS"))
        self._next_id = issuer.next_id

    def receive(self, data: bytes) -> bytes:
        """Take newly arrived bytes; return the reply to everything complete in them."""
        if self._buffer:
            if self.wait:  # a command is waiting for the clock: keep the order, answer nothing yet
                self._buffer += data
                return b""
            data = self._buffer + data
            self._buffer = b""
        elif self.closing:
            return b""
        newline = data.find(b"\n")
        if newline < 0:
            return self._hold(data)
        if newline == len(data) - 1 and newline < self._max_line:
            # The usual case: exactly one complete command, and most often a one-key GET.
            self.activity += 1
            tokens = data.split()
            try:
                if len(tokens) == 2 and tokens[0] in self._fast_get:
                    return self._get_one(tokens[1])
                return self._tokens(tokens) or b""
            except ClockWait as wait:
                return self._wait(data, wait, b"")
            except _DataBlock as block:  # its data block is still to come
                return self._hold_block(data, block)
        out: list[bytes] = []
        start = 0
        fast_get = self._fast_get
        while newline >= 0:
            if newline - start >= self._max_line:
                out.append(LINE_TOO_LONG)
                self.closing = True
                return b"".join(out)
            self.activity += 1
            tokens = data[start:newline].split()
            try:
                if len(tokens) == 2 and tokens[0] in fast_get:
                    out.append(self._get_one(tokens[1]))
                else:
                    reply = self._tokens(tokens)
                    if reply is None:  # QUIT: what came after it is not answered
                        return b"".join(out)
                    out.append(reply)
            except ClockWait as wait:
                return self._wait(data[start:], wait, b"".join(out))
            except _DataBlock as block:
                end = newline + 1 + block.size
                if end > len(data):
                    out.append(self._hold_block(data[start:], block))
                    return b"".join(out)
                out.append(block.reply)
                newline = end - 1  # carry on after the block
            start = newline + 1
            newline = data.find(b"\n", start)
        out.append(self._hold(data[start:]))
        return b"".join(out)

    def resume(self) -> bytes:
        """After ``wait`` seconds: answer the waiting command and what came after it."""
        self.wait = 0.0
        return self.receive(b"") if self._buffer else b""

    def _wait(self, rest: bytes, wait: ClockWait, reply: bytes) -> bytes:
        """Keep ``rest`` (starting with the waiting command) for :meth:`resume`."""
        self.activity -= 1  # counted again when the command is taken up
        self._buffer = rest
        self.wait = max(wait.seconds, 1e-4)
        return reply

    def _hold_block(self, rest: bytes, block: _DataBlock) -> bytes:
        """Keep a command line whose data block is incomplete, with what arrived of the block, until
        the block is in; a block that would not fit in ``max_line`` is answered and the connection
        closed instead, so memory stays bounded."""
        self.activity -= 1  # counted again when the command is taken up
        if rest.index(b"\n") + 1 + block.size > self._max_line:
            self.closing = True
            return block.reply
        self._buffer = rest
        return b""

    def _hold(self, rest: bytes) -> bytes:
        """Keep an incomplete line, unless it is already too long to ever be served."""
        if len(rest) >= self._max_line:
            self.closing = True
            self._buffer = b""
            return LINE_TOO_LONG
        self._buffer = rest
        return b""

    def _tokens(self, tokens: list[bytes]) -> bytes | None:
        if not tokens:
            return ERROR
        handler = self._commands.get(tokens[0]) or self._commands.get(tokens[0].lower())
        if handler is None:
            meta = _META_COMMANDS.get(tokens[0])
            return ERROR if meta is None else meta(self, tokens)
        return handler(tokens)

    # -- commands --------------------------------------------------------------------------------
    def _get_one(self, key: bytes) -> bytes:
        counters = self._counters
        counters.commands += 1
        try:
            id_ = self._next_id()
        except ClockWait:
            counters.commands -= 1
            raise
        except Exception as exc:
            return server_error(self._issuer.failed(counters, exc).message)
        counters.ids += 1
        if _MIN_19_DIGITS <= id_ < _MAX_19_DIGITS:
            return _ONE_VALUE_19 % (key, id_)
        value = b"%d" % id_
        return b"VALUE %b 0 %d\r\n%b\r\nEND\r\n" % (key, len(value), value)

    def _get(self, tokens: list[bytes]) -> bytes:
        count = len(tokens) - 1
        if count == 1:
            return self._get_one(tokens[1])
        if count == 0:
            self._counters.commands += 1  # katsubushi counts the command even when it fails for lack of a key
            return ERROR
        ids = self._issuer.issue(self._counters, count)
        if isinstance(ids, list):
            return format_values(tokens, ids)
        return server_error(ids.message)

    def _gets_with_cas(self, tokens: list[bytes]) -> bytes:
        """GETS as memcached answers it, with a CAS field (the ID itself), for clients such as
        aiomcache's multi_get that insist on one. Off by default: katsubushi's clients reject it."""
        reply = self._get(tokens)
        if not reply.startswith(b"VALUE "):
            return reply
        lines = reply.split(b"\r\n")
        for i in range(0, len(lines) - 2, 2):
            lines[i] += b" " + lines[i + 1]
        return b"\r\n".join(lines)

    def _version_cmd(self, tokens: list[bytes]) -> bytes:
        return self._version

    def _stats_cmd(self, tokens: list[bytes]) -> bytes:
        """Plain ``stats``: the general fields; ``stats settings``: the configuration; any other
        group: empty (clients such as Cache::Memcached sum what ``stats malloc`` returns)."""
        if len(tokens) == 1:
            return render_stats(self._issuer.stats_fields())
        if tokens[1].lower() == b"settings":
            return render_stats(self._issuer.settings_fields())
        return END

    def _quit(self, tokens: list[bytes]) -> None:
        self.closing = True
        return None

    # -- meta commands (see _META_COMMANDS) ------------------------------------------------------
    def _meta_get(self, tokens: list[bytes]) -> bytes:
        """``mg <key> <flags>*``: one fresh ID, as memcached answers a hit on an item without expiry.
        Flags are checked before an ID is taken, so a bad request costs none."""
        if len(tokens) < 2:
            return ERROR  # as memcached
        key = tokens[1]
        if len(key) > MAX_KEY:
            return BAD_FORMAT
        seen: set[int] = set()
        for flag in tokens[2:]:
            letter = flag[0]
            if letter not in _MG_FLAGS:
                return INVALID_FLAG
            if letter in seen:
                return DUPLICATE_FLAG
            seen.add(letter)
            if letter == 0x4F and len(flag) > MAX_OPAQUE_TOKEN:  # O<opaque>
                return OPAQUE_TOO_LONG
        base64_key = 0x62 in seen  # b
        if base64_key:
            try:
                binascii.a2b_base64(key, strict_mode=True)
            except binascii.Error:
                return BAD_BASE64_KEY
        ids = self._issuer.issue(self._issuer.counters("meta"))
        if not isinstance(ids, list):
            return server_error(ids.message)
        value = b"%d" % ids[0]
        returned = []
        for flag in tokens[2:]:
            letter = flag[0]
            if letter == 0x6B:  # k: the key as sent; with b it is base64, which the b flag says
                returned.append(b" k" + key + (b" b" if base64_key else b""))
            elif letter == 0x4F:  # O: the opaque, copied back
                returned.append(b" " + flag)
            elif letter == 0x66:  # f: client flags
                returned.append(b" f0")
            elif letter == 0x73:  # s: value size
                returned.append(b" s%d" % len(value))
            elif letter == 0x63:  # c: the ID is unique, as a CAS value is (and as GETS gives with --gets-cas)
                returned.append(b" c" + value)
            elif letter == 0x74:  # t: no expiry
                returned.append(b" t-1")
            elif letter == 0x68:  # h: a fresh ID was never fetched before
                returned.append(b" h0")
            elif letter == 0x6C:  # l: seconds since last access
                returned.append(b" l0")
        # q hides only a miss (EN), and an ID is never a miss; u, N, R, T, P and L change nothing here.
        if 0x76 in seen:  # v
            return b"VA %d%b\r\n%b\r\n" % (len(value), b"".join(returned), value)
        return b"HD" + b"".join(returned) + b"\r\n"

    def _meta_noop(self, tokens: list[bytes]) -> bytes:
        return b"MN\r\n"

    def _meta_set(self, tokens: list[bytes]) -> bytes:
        """``ms <key> <datalen> <flags>*`` and its data block: not supported, and the block is skipped."""
        if len(tokens) < 2:
            return ERROR
        if len(tokens) < 3 or not tokens[2].isdigit():
            return BAD_FORMAT  # no length: memcached too reads the block as the next command
        raise _DataBlock(int(tokens[2]) + 2, not_supported(b"ms"))

    def _meta_unsupported(self, tokens: list[bytes]) -> bytes:
        return ERROR if len(tokens) < 2 else not_supported(tokens[0])


# Meta commands are lower case only, as in memcached, so they are looked up by exact spelling, and
# only when the command table has no entry: they cost the other commands nothing, and a connection
# no memory (this table is shared).
_META_COMMANDS: dict[bytes, Callable[[TextConnection, list[bytes]], bytes]] = {
    b"mg": TextConnection._meta_get,
    b"mn": TextConnection._meta_noop,
    b"ms": TextConnection._meta_set,
    b"md": TextConnection._meta_unsupported,
    b"ma": TextConnection._meta_unsupported,
    b"me": TextConnection._meta_unsupported,
}

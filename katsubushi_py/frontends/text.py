"""The memcached text protocol as go-katsubushi speaks it, sans-IO: bytes in, bytes out.

:class:`TextConnection` holds one connection's unparsed bytes and turns everything that arrived into
one reply, so the server writes pipelined answers with a single ``write`` and tests need no socket.

Framing follows katsubushi: a line ends at LF with an optional CR before it; tokens are separated by
ASCII whitespace (space, tab, and CR/VT/FF inside a line); the command word is case-insensitive; keys
are echoed byte for byte. Where katsubushi is wrong we are not: a whitespace-only line answers
``ERROR`` (it kills the Go daemon), an overlong line answers ``CLIENT_ERROR line too long`` before the
close (Go resets silently), and a generation failure is ``SERVER_ERROR <reason>`` (Go says ``ERROR``).

IDs come from the :class:`~katsubushi_py.issuing.issuer.Issuer`. When the clock is a little behind,
the command that needs an ID is not answered yet: :attr:`TextConnection.wait` says for how long, the
rest of the input is kept in order, and :meth:`TextConnection.resume` carries on from that command.

Buffer cost: at most ``max_line`` bytes are held between calls (64 KiB by default, as katsubushi),
plus the bytes of the current call; while a command waits for the clock, also what arrived after it
in the same read (the server stops reading meanwhile). A reply is at most about 30 bytes per key of
the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..compiled import speedups
from ..issuing.errors import ClockWait
from ..issuing.issuer import Issuer

#: katsubushi serves lines of up to 65,536 bytes including the LF, and drops longer ones.
MAX_LINE = 65_536

ERROR = b"ERROR\r\n"
END = b"END\r\n"
LINE_TOO_LONG = b"CLIENT_ERROR line too long\r\n"


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


def render_stats(fields: list[tuple[str, object]]) -> bytes:
    lines = [f"STAT {name} {value}\r\n" for name, value in fields]
    lines.append("END\r\n")
    return "".join(lines).encode()


class PyTextCore:
    """The state the compiled twin (``_speedups.TextCore``) keeps in C, so that its fast path reads it
    without attribute lookups. Here just slots: the pure-Python :meth:`TextConnection.receive` is the
    whole protocol."""

    __slots__ = ("_buffer", "activity", "closing", "wait")

    def _fast_init(self, generator: object, counters: object, max_line: int, gets_fast: bool) -> None:
        """The compiled twin takes complete GET/GETS lines itself when it may; nothing to do here."""


if TYPE_CHECKING or speedups is None:
    _TextCore = PyTextCore
else:
    _TextCore = speedups.TextCore


class TextConnection(_TextCore):
    """One client's side of the conversation.

    After :meth:`receive`, ``closing`` says the server must close once the reply is written (QUIT,
    or an overlong line); ``wait`` (seconds, 0 when not waiting) says a command is waiting for the
    clock and :meth:`resume` must be called after that long, with no new input meanwhile;
    ``activity`` counts complete lines seen so far (the idle timer uses it).
    """

    __slots__ = (
        "_commands",
        "_counters",
        "_fast_get",
        "_issuer",
        "_max_line",
        "_next_id",
        "_version",
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
        self._fast_init(issuer.generator, self._counters, max_line, not gets_cas)

    def _receive_slow(self, data: bytes) -> bytes:
        """Take newly arrived bytes; return the reply to everything complete in them.

        This is the whole protocol. The compiled twin's ``receive`` answers what it can of the same
        input exactly as this would, and hands this method the rest."""
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
            start = newline + 1
            newline = data.find(b"\n", start)
        out.append(self._hold(data[start:]))
        return b"".join(out)

    if _TextCore is PyTextCore:
        receive = _receive_slow

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
            return ERROR
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
        return render_stats(self._issuer.stats_fields())

    def _quit(self, tokens: list[bytes]) -> None:
        self.closing = True
        return None

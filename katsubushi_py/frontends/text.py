"""The memcached text protocol, sans-IO: bytes in, bytes out.

:class:`TextConnection` holds one connection's unparsed bytes and turns what arrived into one reply,
so the server writes pipelined answers with a single ``write`` and tests need no socket.

Framing follows go-katsubushi: a line ends at LF with an optional CR before it; tokens are separated
by ASCII whitespace (space, tab, and CR/VT/FF inside a line); the classic command words are
case-insensitive; keys are echoed byte for byte. ``GET`` and ``GETS`` answer one fresh ID per key.

Where memcached and go-katsubushi differ, we answer as memcached does wherever a client can notice:

- **Gets of any length.** A ``get``/``gets`` line is read as a stream of keys, not as one line: the
  keys are answered as they arrive, in batches (one ``next_ids`` each), and ``END`` follows the line's
  end, so a line of 100,000 keys costs no more memory than one of ten. A key over 250 bytes (memcached's
  limit) is answered ``CLIENT_ERROR bad command line format`` in its place and the rest of its line
  is ignored; a failure to issue IDs is ``SERVER_ERROR <reason>`` in place of the batch, and the rest
  of the line is ignored too (keys answered before stay answered: they were already sent).
- **Storage commands** (``set``, ``add``, ``replace``, ``append``, ``prepend``, ``cas``) are framed as
  memcached frames them: the data block is read and discarded as it arrives (never held), its
  ``\\r\\n`` checked (``CLIENT_ERROR bad data chunk`` if missing, as memcached), and the command is
  answered once, ``CLIENT_ERROR <cmd> is not supported: this server only issues IDs``, or not at all
  with ``noreply``. A bad command line gets memcached's answer and no block is read (memcached reads
  none either): a wrong number of tokens ``ERROR``, a bad number, a key over 250 bytes or a length
  outside 0 to 2**31 - 3 ``CLIENT_ERROR bad command line format``. ``incr``, ``decr``, ``touch``,
  ``delete``, ``flush_all``, ``gat`` and ``gats`` get the same "not supported" (nothing with
  ``noreply``), or ``ERROR`` for a wrong number of tokens.
- ``verbosity <n> [noreply]`` answers ``OK`` (and changes nothing), as memcached does with its
  errors; ``stats <group>`` answers ``settings``, is empty (``END``) for memcached's ``items``,
  ``slabs``, ``sizes`` and ``conns``, and ``ERROR`` for any other group (``stats noreply`` too).
- ``version`` and ``quit`` ignore their arguments (``version x y`` answers ``VERSION``, ``quit now``
  closes), as memcached 1.6 and go-katsubushi both do: a user puts one of those beside this daemon.
  (libmemcached's protocol tester expects ``ERROR`` only of a server whose version is below 1.6, the
  way memcached answered before; it is told our version, so it does not ask.)

And where go-katsubushi is wrong we are not: a whitespace-only line answers ``ERROR`` (it kills the Go
daemon), an overlong line answers ``CLIENT_ERROR line too long`` before the close (Go resets
silently), and a generation failure is ``SERVER_ERROR <reason>`` (Go says ``ERROR``).

Beyond katsubushi, memcached's meta commands (lower case, as memcached takes them): ``mg <key>
<flags>*`` answers one fresh ID (``VA``/``HD`` with the flags ``v k O f s c t h l q u b N R T P L`` as
memcached 1.6 answers them for an item stored without expiry), ``mn`` answers ``MN``, and ``ms``,
``md``, ``ma`` and ``me`` answer ``CLIENT_ERROR ... not supported`` (``ms``'s data block is skipped, so
the connection stays in step).

IDs come from the :class:`~katsubushi_py.issuing.issuer.Issuer`. When the clock is a little behind,
the command that needs an ID is not answered yet: :attr:`TextConnection.wait` says for how long, the
rest of the input is kept in order, and :meth:`TextConnection.resume` carries on from that command.

Memory: between calls a connection holds at most one incomplete line other than a get (under
``max_line``, 64 KiB by default, as go-katsubushi), or in a get line one incomplete key (250 bytes),
or two bytes of a data block's end. A call stops taking commands once its reply reaches
:data:`~.fastpath.REPLY_BUDGET` (64 KiB): the rest of that read is held (``backlog``) until the
server has written the reply and calls :meth:`TextConnection.resume`, so a reply is at most about
the budget plus one command's answer (``stats``, about 1.5 KiB, or a batch of 128 keys), whatever
the read asked for; while a command waits for the clock the rest of its read is held too. The
server reads nothing more meanwhile.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable

from ..issuing.errors import ClockWait
from ..issuing.issuer import Issuer
from .fastpath import COMPILED, GET_BATCH, MAX_KEY, REPLY_BUDGET, TextCore

#: The keys of a get line are split this many bytes at a time (see ``_run``, state KEYS).
KEYS_CHUNK = 16 * 1024

#: go-katsubushi serves lines of up to 65,536 bytes including the LF; any line but a get's still has
#: that limit here (a get line has none: its keys are answered as they arrive).
MAX_LINE = 65_536

ERROR = b"ERROR\r\n"
END = b"END\r\n"
OK = b"OK\r\n"
LINE_TOO_LONG = b"CLIENT_ERROR line too long\r\n"
BAD_FORMAT = b"CLIENT_ERROR bad command line format\r\n"
BAD_DATA_CHUNK = b"CLIENT_ERROR bad data chunk\r\n"

# The meta protocol, with memcached's limits and its error lines.
MAX_OPAQUE_TOKEN = 32  # the O flag and its opaque, as memcached counts them
INVALID_FLAG = b"CLIENT_ERROR invalid flag\r\n"
DUPLICATE_FLAG = b"CLIENT_ERROR duplicate flag\r\n"
OPAQUE_TOO_LONG = b"CLIENT_ERROR opaque token too long\r\n"
BAD_BASE64_KEY = b"CLIENT_ERROR error decoding key\r\n"
# The flags memcached 1.6 takes for mg; of these, an ID answers b, c, f, h, k, l, O, s, t and v.
_MG_FLAGS = frozenset(b"bcfhklOqstuvNRTPL")

#: The largest data block memcached accepts a length for (INT_MAX - 2).
MAX_DATA_LENGTH = 2**31 - 3

# What the parser is in the middle of, between calls (``_state``; the compiled core takes input only
# in LINE with nothing held).
LINE = 0  # at the start of a command line (an incomplete one may be held)
KEYS = 1  # in a get line, after its command word: each key is answered as it arrives
SKIP_LINE = 2  # discarding the rest of a line whose error was answered in its place
DATA = 3  # discarding a data block (``_skip`` bytes more)
DATA_END = 4  # the block was discarded: the two bytes that end it must be CR LF

# A get line whose end has not arrived yet: optional whitespace, then the command word, then whitespace.
_GET_WORD = re.compile(rb"[ \t\r\x0b\x0c]*(gets?)[ \t\r\x0b\x0c]", re.IGNORECASE)

# Today's IDs (and every ID of the default layout from 2015-01-25 to beyond its end) have 19 digits, so
# their VALUE lines can come from one format template instead of being assembled piece by piece.
_MIN_19_DIGITS = 10**18
_MAX_19_DIGITS = 10**19
_ONE_VALUE_19 = b"VALUE %b 0 19\r\n%d\r\nEND\r\n"
_VALUE_19 = b"VALUE %b 0 19\r\n%d\r\n"


def format_values(keys: list[bytes], ids: list[int]) -> bytes:
    """The VALUE blocks for ``keys`` and their increasing ``ids`` (without ``END``)."""
    count = len(ids)
    if ids[0] >= _MIN_19_DIGITS and ids[-1] < _MAX_19_DIGITS:
        args: list[bytes | int] = [b""] * (2 * count)
        args[0::2] = keys
        args[1::2] = ids
        return _VALUE_19 * count % tuple(args)
    parts = []
    for key, id_ in zip(keys, ids, strict=True):
        value = b"%d" % id_
        parts.append(b"VALUE %b 0 %d\r\n%b\r\n" % (key, len(value), value))
    return b"".join(parts)


def format_values_with_cas(keys: list[bytes], ids: list[int]) -> bytes:
    """GETS as memcached answers it, with a CAS field (the ID itself): for ``--gets-cas``."""
    return b"".join(
        b"VALUE %b 0 %d %d\r\n%d\r\n" % (key, len(b"%d" % id_), id_, id_) for key, id_ in zip(keys, ids, strict=True)
    )


def server_error(message: str) -> bytes:
    return b"SERVER_ERROR " + message.encode("ascii", "replace") + b"\r\n"


def not_supported(command: bytes) -> bytes:
    return b"CLIENT_ERROR " + command + b" is not supported: this server only issues IDs\r\n"


def render_stats(fields: list[tuple[str, object]]) -> bytes:
    lines = [f"STAT {name} {value}\r\n" for name, value in fields]
    lines.append("END\r\n")
    return "".join(lines).encode()


def _number(token: bytes, low: int, high: int) -> int | None:
    """``token`` as memcached's strtol/strtoul read a whole token (an optional sign, decimal digits),
    if it is from ``low`` to ``high``; else None."""
    digits = token[1:] if token[:1] in (b"+", b"-") else token
    if not digits.isdigit() or len(digits) > 40:  # (int() refuses thousands of digits)
        return None
    value = int(token)
    return value if low <= value <= high else None


# How many tokens memcached takes for the commands answered by TextConnection._other (None: at least 2).
_OTHER_TOKENS = {
    b"incr": (3, 4),
    b"decr": (3, 4),
    b"touch": (3, 4),
    b"delete": (2, 3, 4),
    b"flush_all": (1, 2, 3),
}

# memcached's groups of ``stats`` that have nothing to report here.
_EMPTY_STATS_GROUPS = frozenset((b"items", b"slabs", b"sizes", b"conns"))


def _may_hold_long_key(length: int, tokens: list[bytes], count: int) -> bool:
    """Whether a get line of ``length`` bytes split into ``tokens`` (its ``count`` keys after the
    command word) has a key over MAX_KEY. The length alone rules it out for most lines: such a key
    needs at least the word, a separator and a byte for every other key, and 251 bytes."""
    return length >= len(tokens[0]) + 2 * count + MAX_KEY and max(map(len, tokens)) > MAX_KEY


class TextConnection(TextCore):
    """One client's side of the conversation.

    After :meth:`receive`, ``closing`` says the server must close once the reply is written (QUIT,
    or an overlong line); ``wait`` (seconds, 0 when not waiting) says a command is waiting for the
    clock and :meth:`resume` must be called after that long, with no new input meanwhile;
    ``backlog`` says the reply reached :data:`~.fastpath.REPLY_BUDGET`, the rest of the input is held
    and :meth:`resume` must be called once the reply is written (the server sets it too, while its
    client is behind with its replies, so that what arrives is held, unanswered); ``activity`` counts
    commands (and batches of a get line's keys) answered so far (the idle timer uses it).
    """

    __slots__ = (
        "_commands",
        "_counters",
        "_data_noreply",
        "_data_reply",
        "_fast_get",
        "_get_words",
        "_issuer",
        "_keys_seen",
        "_line_cas",
        "_max_line",
        "_next_id",
        "_next_ids",
        "_skip",
        "_version",
    )

    def __init__(self, issuer: Issuer, *, max_line: int = MAX_LINE, gets_cas: bool = False) -> None:
        self._issuer = issuer
        self._counters = issuer.counters("text")
        self._max_line = max_line
        self._buffer = b""
        self._state = LINE
        self._version = b"VERSION " + issuer.version.encode() + b"\r\n"
        self.closing = False
        self.wait = 0.0
        self.backlog = False
        self.activity = 0
        self._skip = 0  # DATA: bytes of the block still to discard
        self._data_reply = b""  # DATA: the reply once the block is in
        self._data_noreply = False  # DATA: noreply, so nothing is answered, not even a bad block
        self._keys_seen = 0  # KEYS: keys of this line answered so far
        self._line_cas = False  # KEYS: the line is a GETS answered with CAS fields
        handlers: dict[bytes, Callable[[list[bytes]], bytes | None]] = {
            b"version": self._version_cmd,
            b"stats": self._stats_cmd,
            b"quit": self._quit,
            b"verbosity": self._verbosity,
            b"set": self._storage,
            b"add": self._storage,
            b"replace": self._storage,
            b"append": self._storage,
            b"prepend": self._storage,
            b"cas": self._storage,
            b"incr": self._other,
            b"decr": self._other,
            b"touch": self._other,
            b"delete": self._other,
            b"flush_all": self._other,
            b"gat": self._other,
            b"gats": self._other,
        }
        # The two usual spellings are looked up directly; anything else is lower-cased first.
        self._commands = {**handlers, **{name.upper(): h for name, h in handlers.items()}}
        self._commands[b"refresh_certs"] = self._refresh_certs  # (lower case only, as memcached)
        # get and gets: whether the line's values carry a CAS field.
        words = {b"get": False, b"gets": gets_cas}
        self._get_words = {**words, **{name.upper(): cas for name, cas in words.items()}}
        self._fast_get = frozenset((b"get", b"GET") if gets_cas else (b"get", b"GET", b"gets", b"GETS"))
        self._next_id = issuer.next_id
        self._next_ids = issuer.next_ids
        self._fast_init(issuer.generator, self._counters, max_line, not gets_cas)

    def _receive_slow(self, data: bytes) -> bytes:
        """Take newly arrived bytes; return the reply to everything complete in them.

        This is the whole protocol. The compiled twin's ``receive`` answers what it can of the same
        input exactly as this would, and hands this method the rest."""
        if self._buffer:
            if self.wait or self.backlog or self.closing:  # a command waits, or the client is behind
                if not self.closing:
                    self._buffer += data  # kept, in order
                return b""
            data = self._buffer + data
            self._buffer = b""
        elif self.closing or self.backlog:  # (backlog: the server holds input while its client is behind)
            if not self.closing:
                self._buffer = data
            return b""
        if not self._state:
            newline = data.find(b"\n")
            if newline == len(data) - 1 and newline < self._max_line:
                # The usual case: exactly one complete command, and most often a GET of a few keys.
                tokens = data.split()
                # (a line shorter than 255 bytes cannot hold a key over 250)
                if len(tokens) == 2 and tokens[0] in self._fast_get and newline < MAX_KEY + 5:
                    self.activity += 1
                    try:
                        return self._get_one(tokens[1])
                    except ClockWait as wait:
                        return self._wait(data, wait, b"")
                count = len(tokens) - 1
                if 0 < count <= GET_BATCH:
                    cas = self._get_words.get(tokens[0])
                    if cas is not None and not _may_hold_long_key(newline, tokens, count):
                        self.activity += 1
                        try:
                            return self._get_line(tokens, cas)
                        except ClockWait as wait:
                            return self._wait(data, wait, b"")
                return self._run(data, tokens)
        return self._run(data, None)

    if not COMPILED:
        receive = _receive_slow

    def resume(self) -> bytes:
        """After ``wait`` seconds, or once a ``backlog`` reply is written: carry on with the input held."""
        self.wait = 0.0
        self.backlog = False
        return self.receive(b"") if self._buffer else b""

    def _run(self, data: bytes, first: list[bytes] | None) -> bytes:
        """Everything complete in ``data``, in order, from the current state; ``first`` is the first
        line's tokens when ``data`` is that one line."""
        out: list[bytes] = []
        spent = self._spent  # reply bytes of this read so far (the compiled core's part, if any)
        pos = 0
        size = len(data)
        max_line = self._max_line
        while pos < size:
            state = self._state
            if state == LINE:
                if spent >= REPLY_BUDGET:
                    self._buffer = data[pos:]
                    self.backlog = True
                    break
                newline = data.find(b"\n", pos)
                if newline < 0:
                    start = self._get_line_start(data, pos)
                    if start >= 0:
                        pos = start  # a get line: its complete keys are answered now
                        continue
                    if size - pos >= max_line:
                        out.append(LINE_TOO_LONG)
                        self.closing = True
                    else:
                        self._buffer = data[pos:]
                    break
                line_start = pos
                tokens = first if first is not None else data[pos:newline].split()
                first = None
                pos = newline + 1
                if not tokens:
                    self.activity += 1
                    out.append(ERROR)
                    spent += len(ERROR)
                    continue
                word = tokens[0]
                cas = self._get_words.get(word)
                handler = meta = None
                if cas is None:
                    handler = self._commands.get(word)
                    if handler is None:
                        lower = word.lower()
                        cas = self._get_words.get(lower)
                        if cas is None:
                            handler = self._commands.get(lower)
                            if handler is None:
                                meta = _META_COMMANDS.get(word)
                self.activity += 1
                if cas is not None:  # a get line, complete
                    count = len(tokens) - 1
                    if (
                        count > GET_BATCH
                        or newline - line_start >= max_line
                        or _may_hold_long_key(newline - line_start, tokens, count)
                    ):
                        # Many keys, or a key too long: answered in batches, as if its keys were arriving.
                        self._start_keys(cas)
                        spent_now = self._keys(tokens, 1, b"\n" + data[pos:], out, spent)
                        if spent_now is None:
                            return b"".join(out)
                        spent = spent_now
                        continue
                    try:
                        reply = self._get_line(tokens, cas)
                    except ClockWait as wait:
                        return self._wait(data[line_start:], wait, b"".join(out))
                elif newline - line_start >= max_line:
                    out.append(LINE_TOO_LONG)
                    self.closing = True
                    break
                elif handler is not None or meta is not None:
                    try:
                        reply = handler(tokens) if handler is not None else meta(self, tokens)  # type: ignore[misc]
                    except ClockWait as wait:
                        return self._wait(data[line_start:], wait, b"".join(out))
                    if reply is None:  # QUIT: what came after it is not answered
                        break
                else:
                    reply = ERROR
                out.append(reply)
                spent += len(reply)
            elif state == KEYS:
                newline = data.find(b"\n", pos)
                if (size if newline < 0 else newline) - pos > KEYS_CHUNK:
                    # A long run of keys is split a chunk at a time (at a space, so no key is cut): the
                    # keys held when the reply budget is reached are then a chunk's, not the whole
                    # line's, and each resume costs a chunk, not what is left of a 1 MiB line.
                    cut = data.rfind(b" ", pos + 1, pos + KEYS_CHUNK)
                    if cut > pos:
                        reply = self._keys(data[pos:cut].split(), 0, data[cut:], out, spent)
                        if reply is None:
                            return b"".join(out)
                        spent = reply
                        pos = cut
                        continue
                if newline < 0:
                    keys = data[pos:].split()
                    partial = b""
                    if keys and data[-1] not in b" \t\r\x0b\x0c":
                        partial = keys.pop()  # may continue in the next read
                    rest = b" " + partial
                    pos = size
                else:
                    keys = data[pos:newline].split()
                    rest = b"\n" + data[newline + 1 :]
                    pos = newline + 1
                reply = self._keys(keys, 0, rest, out, spent)
                if reply is None:
                    return b"".join(out)
                spent = reply
                if newline < 0 and self._state == KEYS:
                    if len(partial) > MAX_KEY:
                        out.append(BAD_FORMAT)
                        self._state = SKIP_LINE
                    else:
                        self._buffer = partial
            elif state == SKIP_LINE:
                newline = data.find(b"\n", pos)
                if newline < 0:
                    break
                pos = newline + 1
                self._state = LINE
            elif state == DATA:
                take = min(self._skip, size - pos)
                self._skip -= take
                pos += take
                if self._skip:
                    break
                self._state = DATA_END
            else:  # DATA_END
                if size - pos < 2:
                    self._buffer = data[pos:]
                    break
                self._state = LINE
                if data[pos : pos + 2] == b"\r\n":
                    reply = self._data_reply
                else:
                    reply = b"" if self._data_noreply else BAD_DATA_CHUNK
                pos += 2
                out.append(reply)
                spent += len(reply)
        return b"".join(out)

    def _get_line_start(self, data: bytes, pos: int) -> int:
        """Where the keys of the get line starting at ``pos`` begin, when its command word has arrived
        but not its end (the line is then in KEYS); else -1."""
        match = _GET_WORD.match(data, pos)
        if match is None:
            return -1
        word = match.group(1)
        self._start_keys(self._get_words.get(word, self._get_words.get(word.lower(), False)))
        return match.end()

    def _start_keys(self, cas: bool) -> None:
        self._state = KEYS
        self._keys_seen = 0
        self._line_cas = cas

    def _keys(self, keys: list[bytes], start: int, rest: bytes, out: list[bytes], spent: int) -> int | None:
        """Answer ``keys[start:]`` of the current get line, in batches, appending to ``out``; ``rest``
        is what follows them (``\\n`` and the rest of the read if the line ends, else a space and an
        incomplete key). Returns the reply bytes spent so far, or None when it had to stop and hold
        the keys not answered yet (``backlog`` or ``wait`` is set). At the line's end: ``END`` (or
        ``ERROR`` for a line without keys), and the state is LINE again."""
        count = len(keys)
        i = start
        while i < count:
            if spent >= REPLY_BUDGET:
                self._buffer = b" ".join(keys[i:]) + rest
                self.backlog = True
                return None
            batch = keys[i : i + GET_BATCH]
            too_long = len(max(batch, key=len)) > MAX_KEY
            if too_long:
                at = next(j for j, key in enumerate(batch) if len(key) > MAX_KEY)
                batch = batch[:at]
            if batch:
                try:
                    reply, issued = self._values(batch)
                except ClockWait as wait:
                    self._buffer = b" ".join(keys[i:]) + rest
                    self.wait = max(wait.seconds, 1e-4)
                    return None
                out.append(reply)
                spent += len(reply)
                self.activity += 1
                if not issued:  # SERVER_ERROR: the rest of the line is not answered
                    self._skip_rest_of_line(rest)
                    return spent
                self._keys_seen += len(batch)
                i += len(batch)
            if too_long:
                out.append(BAD_FORMAT)
                spent += len(BAD_FORMAT)
                self._skip_rest_of_line(rest)
                return spent
        if rest[:1] == b"\n":  # the line ends here
            self._state = LINE
            if self._keys_seen:
                reply = END
            else:
                self._counters.commands += 1  # go-katsubushi counts a GET without keys too
                reply = ERROR
            out.append(reply)
            spent += len(reply)
        return spent

    def _skip_rest_of_line(self, rest: bytes) -> None:
        """After an error answered in a get line's place: LINE if the line has ended (the caller
        carries on after it), else SKIP_LINE until it does."""
        self._state = LINE if rest[:1] == b"\n" else SKIP_LINE

    def _values(self, keys: list[bytes]) -> tuple[bytes, bool]:
        """One batch of a get line: its VALUE blocks, or the SERVER_ERROR that replaces them (False).
        The line counts as one command, when its first batch is answered."""
        count = len(keys)
        counters = self._counters
        first = not self._keys_seen
        if first:
            counters.commands += 1
        try:
            ids = self._next_ids(count) if count > 1 else [self._next_id()]
        except ClockWait:
            if first:
                counters.commands -= 1
            raise
        except Exception as exc:
            return server_error(self._issuer.failed(counters, exc).message), False
        counters.ids += count
        if self._line_cas:
            return format_values_with_cas(keys, ids), True
        return format_values(keys, ids), True

    def _wait(self, rest: bytes, wait: ClockWait, reply: bytes) -> bytes:
        """Keep ``rest`` (starting with the waiting command) for :meth:`resume`."""
        self.activity -= 1  # counted again when the command is taken up
        self._buffer = rest
        self.wait = max(wait.seconds, 1e-4)
        return reply

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

    def _get_line(self, tokens: list[bytes], cas: bool) -> bytes:
        """A complete get line of at most GET_BATCH keys, none over MAX_KEY: all its IDs at once (or
        one SERVER_ERROR), as the compiled core answers it."""
        count = len(tokens) - 1
        if count == 1 and not cas:
            return self._get_one(tokens[1])
        if count == 0:
            self._counters.commands += 1  # go-katsubushi counts the command even when it fails for lack of a key
            return ERROR
        keys = tokens[1:]
        ids = self._issuer.issue(self._counters, count)
        if not isinstance(ids, list):
            return server_error(ids.message)
        return (format_values_with_cas(keys, ids) if cas else format_values(keys, ids)) + END

    def _version_cmd(self, tokens: list[bytes]) -> bytes:
        """Arguments ignored, as memcached 1.6 and go-katsubushi ignore them."""
        return self._version

    def _stats_cmd(self, tokens: list[bytes]) -> bytes:
        """Plain ``stats``: the general fields; ``stats settings``: the configuration; memcached's
        other groups: empty; anything else (``stats noreply`` too): ERROR, as memcached answers."""
        if len(tokens) == 1:
            return render_stats(self._issuer.stats_fields())
        group = tokens[1].lower()
        if group == b"settings":
            return render_stats(self._issuer.settings_fields())
        return END if group in _EMPTY_STATS_GROUPS else ERROR

    def _quit(self, tokens: list[bytes]) -> bytes | None:
        """Arguments ignored (``quit now`` closes), as memcached 1.6 and go-katsubushi do."""
        self.closing = True
        return None

    def _verbosity(self, tokens: list[bytes]) -> bytes:
        """``verbosity <level> [noreply]``: OK, as memcached answers (the log level stays as
        configured); memcached's errors for a wrong number of tokens or a bad level."""
        if not 2 <= len(tokens) <= 3:
            return ERROR
        noreply = tokens[-1] == b"noreply"
        if _number(tokens[1], 0, 2**64 - 1) is None:
            return b"" if noreply else BAD_FORMAT
        return b"" if noreply else OK

    def _refresh_certs(self, tokens: list[bytes]) -> bytes:
        """memcached's ``refresh_certs [noreply]``: reload the TLS certificates (daemon/tls.py). Answered
        as memcached answers: ``OK`` (nothing with noreply), else a line ``Error <reason>`` (noreply
        or not; memcached's own words, not one of its error classes); other tokens are ignored."""
        refresh = getattr(self._issuer, "refresh_certs", None)
        reason = "TLS not enabled" if refresh is None else refresh()
        if reason is None:
            return b"" if tokens[-1] == b"noreply" else OK
        return b"Error " + reason.encode("utf-8", "replace").replace(b"\r", b" ").replace(b"\n", b" ") + b"\r\n"

    def _storage(self, tokens: list[bytes]) -> bytes:
        """``set|add|replace|append|prepend <key> <flags> <exptime> <bytes> [noreply]`` and ``cas
        <key> <flags> <exptime> <bytes> <cas unique> [noreply]``: the data block is discarded as it
        arrives (state DATA), then answered, as memcached frames them."""
        name = tokens[0].lower()
        with_cas = name == b"cas"
        if len(tokens) not in ((6, 7) if with_cas else (5, 6)):
            return ERROR
        noreply = tokens[-1] == b"noreply"
        length = _number(tokens[4], 0, MAX_DATA_LENGTH)
        if (
            len(tokens[1]) > MAX_KEY
            or _number(tokens[2], 0, 2**64 - 1) is None  # flags
            or _number(tokens[3], -(2**63), 2**31 - 1) is None  # exptime
            or length is None
            or (with_cas and _number(tokens[5], 0, 2**64 - 1) is None)
        ):
            return b"" if noreply else BAD_FORMAT
        self._state = DATA
        self._skip = length
        self._data_noreply = noreply
        self._data_reply = b"" if noreply else not_supported(name)
        return b""

    def _other(self, tokens: list[bytes]) -> bytes:
        """incr, decr, touch, delete, flush_all, gat, gats: not supported (nothing with noreply), or
        ERROR for memcached's wrong numbers of tokens."""
        name = tokens[0].lower()
        allowed = _OTHER_TOKENS.get(name)
        if (len(tokens) < 2) if allowed is None else (len(tokens) not in allowed):
            return ERROR
        if tokens[-1] == b"noreply" and allowed is not None:
            return b""
        return not_supported(name)

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
        """``ms <key> <datalen> <flags>*`` and its data block: not supported; the block is discarded
        and its CR LF checked, as memcached frames it (and, as memcached's meta commands, errors are
        answered whatever the flags say)."""
        if len(tokens) < 2:
            return ERROR
        length = _number(tokens[2], 0, MAX_DATA_LENGTH) if len(tokens) >= 3 else None
        if len(tokens[1]) > MAX_KEY or length is None:
            return BAD_FORMAT  # memcached too reads no block then: it is taken as the next command
        self._state = DATA
        self._skip = length
        self._data_noreply = False
        self._data_reply = not_supported(b"ms")
        return b""

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

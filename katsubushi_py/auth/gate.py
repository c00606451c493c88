"""The login of a memcached connection, sans-IO: what a connection speaks until it has authenticated.

With ``--auth-file`` every memcached connection (TCP or unix socket) starts here instead of in the
text or binary protocol. :class:`AuthGate` has the interface the connection glue drives
(``receive``, ``resume``, ``closing``, ``wait``, ``backlog``, ``activity``), answers only what
memcached answers before a login, and issues nothing: it holds no issuer at all. Once the client has
authenticated it calls ``authenticated(protocol, rest)``, which makes the connection's real protocol
object (the compiled one where it is built), binds it to the connection (so every later read goes
straight to it, on the compiled path too, at the cost it has without authentication) and returns its
reply to whatever followed the login in the same read.

The first byte picks the protocol, as on any memcached connection: ``0x80`` binary, else text.

Text (memcached 1.6's ``-Y``, its bytes as ``memcached -Y`` answers them):

- ``set <key> <flags> <exptime> <bytes> [noreply]`` whose data is ``<user> <password>`` logs in:
  ``STORED`` (nothing with ``noreply``, where memcached answers ``STORED`` anyway and so puts a
  client that sent ``noreply``, pymemcache by default, one reply out of step), or
  ``CLIENT_ERROR authentication failure`` (also with ``noreply``, as other client errors); data
  without a space is ``CLIENT_ERROR bad authentication token format``, data not followed by ``\\r\\n``
  ``CLIENT_ERROR bad command line termination`` (and the rest of that line is skipped). The password
  is everything after the first space.
- Any other command, meta commands included, is ``CLIENT_ERROR unauthenticated``; ``quit`` closes.

Binary (SASL, as memcached's ``-S`` answers it):

- List mechanisms ``0x20``: ``PLAIN``. Auth ``0x21`` with the key ``PLAIN`` and the value
  ``[authzid] NUL user NUL password``: status 0 and ``Authenticated``, or ``0x20`` and ``Auth failure.``
  (the connection stays open for another try). An auth with an empty value answers ``0x21`` (continue)
  and the credentials may then come in a step ``0x22``. Another mechanism, or a step without an auth
  before it: ``Auth failure.``. Extras on a SASL request: ``0x04`` ``Invalid arguments`` and the close.
- VERSION ``0x0b`` is answered (memcached allows it before a login); any other opcode is answered
  ``0x20`` ``Auth failure.`` and the connection closed, as memcached does.

Bad input and brute force: a failed login is answered after :data:`FAILURE_DELAY` (reading stops
meanwhile, so one connection tries at most a few passwords a second), and the connection is closed
after :data:`MAX_FAILURES` failed logins or :data:`MAX_UNAUTHENTICATED` other commands. Memory is
bounded: a text line over :data:`MAX_LINE` bytes (``CLIENT_ERROR line too long``), login data over
:data:`MAX_DATA` bytes (``CLIENT_ERROR bad authentication token format``) or a binary body over
:data:`MAX_BODY` bytes (``0x04`` ``Invalid arguments``) is refused and the connection closed without
reading it. So a connection holds at most about 4 KiB before it has logged in.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from .credentials import Credentials

#: The binary request magic: a first byte of 0x80 means the binary protocol.
REQUEST_MAGIC = 0x80
_RESPONSE_MAGIC = 0x81
_HEADER = struct.Struct(">BBHBBHI4s8x")  # magic opcode keylen extlen datatype vbucket bodylen opaque (cas)
_RESPONSE = struct.Struct(">BBHBBHI4sQ")

SASL_LIST_MECHS, SASL_AUTH, SASL_STEP = 0x20, 0x21, 0x22
VERSION = 0x0B
SUCCESS, INVALID_ARGUMENTS, AUTH_ERROR, AUTH_CONTINUE = 0x0000, 0x0004, 0x0020, 0x0021

#: Longest line taken before a login (a ``set`` line is under 300 bytes).
MAX_LINE = 2048
#: Longest login data (``<user> <password>``) and SASL body taken.
MAX_DATA = MAX_BODY = 4096
#: Failed logins on one connection before it is closed.
MAX_FAILURES = 5
#: Commands other than a login on one text connection before it is closed.
MAX_UNAUTHENTICATED = 32
#: Seconds before a failed login is answered.
FAILURE_DELAY = 0.2

UNAUTHENTICATED = b"CLIENT_ERROR unauthenticated\r\n"
AUTH_FAILURE = b"CLIENT_ERROR authentication failure\r\n"
BAD_TOKEN_FORMAT = b"CLIENT_ERROR bad authentication token format\r\n"
BAD_TERMINATION = b"CLIENT_ERROR bad command line termination\r\n"
LINE_TOO_LONG = b"CLIENT_ERROR line too long\r\n"
STORED = b"STORED\r\n"

_LINE, _DATA, _SKIP_LINE = range(3)

#: (protocol "text" or "binary", the bytes after the login) -> the real protocol's reply to them.
Authenticated = Callable[[str, bytes], bytes]


def binary_response(opcode: int, opaque: bytes, status: int = SUCCESS, value: bytes = b"") -> bytes:
    return _RESPONSE.pack(_RESPONSE_MAGIC, opcode, 0, 0, 0, status, len(value), opaque, 0) + value


class AuthGate:
    """A memcached connection before its login (see the module's docstring)."""

    __slots__ = (
        "_authenticated",
        "_binary",
        "_buffer",
        "_credentials",
        "_data_length",
        "_failures",
        "_held",
        "_noreply",
        "_plain_started",
        "_state",
        "_unauthenticated",
        "_version",
        "activity",
        "backlog",
        "closing",
        "wait",
    )

    def __init__(self, credentials: Credentials, version: str, authenticated: Authenticated) -> None:
        self._credentials = credentials
        self._version = version.encode()
        self._authenticated = authenticated
        self._binary: bool | None = None  # picked by the first byte
        self._buffer = b""
        self._state = _LINE
        self._data_length = 0
        self._noreply = False
        self._failures = 0
        self._unauthenticated = 0
        self._plain_started = False
        # A failed login's (reply, the input after it, whether to close then), answered after the delay.
        self._held: tuple[bytes, bytes, bool] | None = None
        self.activity = 0
        self.backlog = False
        self.closing = False
        self.wait = 0.0

    def receive(self, data: bytes) -> bytes:
        if self.closing or not data:
            return b""
        if self._held is not None:  # (not read while waiting; kept in order if it is anyway)
            self._held = (self._held[0], self._held[1] + data, self._held[2])
            return b""
        if self._binary is None:
            self._binary = data[0] == REQUEST_MAGIC
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        return self._binary_input(buffer) if self._binary else self._text_input(buffer)

    def resume(self) -> bytes:
        """After a failed login's delay: its answer, then whatever arrived after it."""
        held, self._held = self._held, None
        self.wait = 0.0
        if held is None:
            return b""
        reply, rest, close = held
        if close:
            self.closing = True
        if self.closing or not rest:
            return reply
        return reply + (self._binary_input(rest) if self._binary else self._text_input(rest))

    def _failed(self, reply: bytes, rest: bytes, out: list[bytes]) -> bytes:
        """A failed login: answered after the delay; the close after too many."""
        self._failures += 1
        self.wait = FAILURE_DELAY
        # After too many, the last answer (delayed too) is followed by the close and nothing more is read.
        self._held = (reply, b"", True) if self._failures >= MAX_FAILURES else (reply, rest, False)
        return b"".join(out)

    # -- text --------------------------------------------------------------------------------------
    def _text_input(self, data: bytes) -> bytes:
        out: list[bytes] = []
        pos = 0
        size = len(data)
        while pos < size and not self.closing:
            if self._state == _DATA:
                need = self._data_length + 2
                if size - pos < need:
                    break
                block = data[pos : pos + self._data_length]
                end = data[pos + self._data_length : pos + need]
                self._state = _LINE
                self.activity += 1
                if end != b"\r\n":
                    out.append(BAD_TERMINATION)
                    self._state = _SKIP_LINE
                    pos += self._data_length
                    continue
                pos += need
                user, space, password = block.partition(b" ")
                if not space or not user:
                    self._credentials.note_login(False)
                    out.append(BAD_TOKEN_FORMAT)
                    continue
                if self._credentials.check_user(user, password):
                    stored = b"" if self._noreply else STORED
                    return b"".join(out) + stored + self._authenticated("text", data[pos:])
                return self._failed(AUTH_FAILURE, data[pos:], out)
            newline = data.find(b"\n", pos)
            if newline < 0:
                if size - pos > MAX_LINE:
                    out.append(LINE_TOO_LONG)
                    self.closing = True
                break
            line = data[pos:newline]
            pos = newline + 1
            if self._state == _SKIP_LINE:
                self._state = _LINE
                continue
            if len(line) > MAX_LINE:
                out.append(LINE_TOO_LONG)
                self.closing = True
                break
            out.append(self._text_command(line.split()))
        if not self.closing and pos < size:
            self._buffer = data[pos:]
        return b"".join(out)

    def _text_command(self, tokens: list[bytes]) -> bytes:
        """The answer to one line before a login; a login line moves to reading its data."""
        self.activity += 1
        command = tokens[0].lower() if tokens else b""
        if command == b"set" and len(tokens) in (5, 6) and (len(tokens) == 5 or tokens[5] == b"noreply"):
            length = tokens[4]
            if length.isdigit() and all(t.isdigit() or (t[:1] == b"-" and t[1:].isdigit()) for t in tokens[2:4]):
                if len(length) > 9 or int(length) > MAX_DATA:  # (int() refuses thousands of digits)
                    self.closing = True  # not read: the login data is a user and a password
                    return BAD_TOKEN_FORMAT
                self._state = _DATA
                self._data_length = int(length)
                self._noreply = len(tokens) == 6
                return b""
        if command == b"quit" and len(tokens) == 1:
            self.closing = True
            return b""
        self._unauthenticated += 1
        if self._unauthenticated >= MAX_UNAUTHENTICATED:
            self.closing = True
        return UNAUTHENTICATED

    # -- binary ------------------------------------------------------------------------------------
    def _binary_input(self, data: bytes) -> bytes:
        out: list[bytes] = []
        pos = 0
        size = len(data)
        while size - pos >= 24 and not self.closing:
            magic, opcode, keylen, extlen, _, _, bodylen, opaque = _HEADER.unpack_from(data, pos)
            if magic != REQUEST_MAGIC:
                self.closing = True
                break
            if opcode not in (SASL_LIST_MECHS, SASL_AUTH, SASL_STEP, VERSION):
                # memcached answers anything else before a login with an auth error, and closes.
                out.append(binary_response(opcode, opaque, AUTH_ERROR, b"Auth failure."))
                self.closing = True
                break
            if bodylen > MAX_BODY or keylen + extlen > bodylen:
                out.append(binary_response(opcode, opaque, INVALID_ARGUMENTS, b"Invalid arguments"))
                self.closing = True
                break
            end = pos + 24 + bodylen
            if end > size:
                break
            self.activity += 1
            if extlen:
                out.append(binary_response(opcode, opaque, INVALID_ARGUMENTS, b"Invalid arguments"))
                self.closing = True
                break
            key = data[pos + 24 : pos + 24 + keylen]
            value = data[pos + 24 + keylen : end]
            pos = end
            if opcode == VERSION:
                out.append(binary_response(opcode, opaque, value=self._version))
            elif opcode == SASL_LIST_MECHS:
                out.append(binary_response(opcode, opaque, value=b"PLAIN"))
            elif key != b"PLAIN" or (opcode == SASL_STEP and not self._plain_started):
                self._plain_started = False
                self._credentials.note_login(False)
                return self._failed(binary_response(opcode, opaque, AUTH_ERROR, b"Auth failure."), data[pos:], out)
            elif not value and opcode == SASL_AUTH:
                self._plain_started = True  # PLAIN with no initial response: the credentials come in a step
                out.append(binary_response(opcode, opaque, AUTH_CONTINUE))
            else:
                self._plain_started = False
                parts = value.split(b"\0")
                if len(parts) == 3 and (not parts[0] or parts[0] == parts[1]):
                    ok = self._credentials.check_user(parts[1], parts[2])
                else:
                    ok = False
                    self._credentials.note_login(False)
                if ok:
                    reply = binary_response(opcode, opaque, value=b"Authenticated")
                    return b"".join(out) + reply + self._authenticated("binary", data[pos:])
                return self._failed(binary_response(opcode, opaque, AUTH_ERROR, b"Auth failure."), data[pos:], out)
        if not self.closing and pos < size:
            self._buffer = data[pos:]
        return b"".join(out)

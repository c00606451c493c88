"""Credentials from files: memcached users (``--auth-file``) and bearer tokens (``--token-file``).

Credentials are only ever read from files, never from the command line (where ``ps`` shows them to
every user of the machine). Both files are read at start (a bad, missing or empty file is one line
and exit status 2, through :class:`~katsubushi_py.config.ConfigError`) and again on SIGHUP by
:meth:`Credentials.reload`, which keeps the credentials it has when the new files are not usable and
says why in one log line. Open connections keep whatever they were allowed; a reload changes what
the next login or request is checked against.

- ``--auth-file``: memcached's ``-Y`` format, one ``user:password`` per line (the password is
  everything after the first ``:``; blank lines are skipped, a trailing CR is dropped). It serves both
  the text protocol's login (``set <key> 0 0 <n>`` with ``<user> <password>`` as the data) and SASL
  PLAIN on the binary protocol.
- ``--token-file``: one bearer token per line (blank lines skipped), for HTTP
  (``Authorization: Bearer <token>``) and gRPC (metadata ``authorization: Bearer <token>``). Tokens are
  at least :data:`MIN_TOKEN` characters of RFC 6750's token alphabet, so a file with a typo or a stray
  space is refused rather than quietly accepting a weak secret.

Comparisons are constant in time whatever the input: each candidate is hashed (SHA-256, so every
comparison is of equal-length digests) and compared with :func:`hmac.compare_digest` against every
entry, without stopping at a match, so neither a user name's existence nor a password's or token's
prefix shows in the time an answer takes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass

log = logging.getLogger("katsubushi_py")

#: A credentials file larger than this is refused (it is a few lines; more is a wrong path).
MAX_FILE = 1024 * 1024
#: The shortest bearer token accepted.
MIN_TOKEN = 16
#: RFC 6750's b64token: what may follow ``Bearer `` in an Authorization header.
_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class CredentialsError(ValueError):
    """A credentials file that cannot be used; the message is one line naming the file."""


@dataclass(frozen=True)
class AuthConfig:
    """Where the credentials are, from ``--auth-file``, ``--token-file`` and ``--metrics-no-auth``."""

    auth_file: str | None = None
    token_file: str | None = None
    metrics_no_auth: bool = False
    #: A memcached connection that has not logged in this long after it opened is closed.
    login_timeout: float = 10.0


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def _read(path: str, what: str) -> list[str]:
    """The non-blank lines of a credentials file (CR and LF stripped)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise CredentialsError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE:
        raise CredentialsError(f"{what} {path} is over {MAX_FILE} bytes: is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CredentialsError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None
    lines = [line.rstrip("\r") for line in text.split("\n")]
    if not any(line.strip() for line in lines):
        raise CredentialsError(f"{what} {path} is empty: it needs at least one entry")
    return lines


def load_users(path: str) -> list[tuple[bytes, bytes]]:
    """(digest of the user name, digest of the password) for each ``user:password`` line."""
    users = []
    for number, line in enumerate(_read(path, "--auth-file"), 1):
        if not line.strip():
            continue
        user, sep, password = line.partition(":")
        if not sep or not user or not password:
            raise CredentialsError(f"--auth-file {path} line {number}: expected user:password")
        if " " in user or "\t" in user:
            raise CredentialsError(f"--auth-file {path} line {number}: a user name cannot contain whitespace")
        users.append((_digest(user.encode()), _digest(password.encode())))
    return users


def first_user(path: str) -> tuple[bytes, bytes]:
    """The first user and password of an --auth-file (what ``katsubushi-py health`` logs in as)."""
    load_users(path)  # the same checks as the daemon's
    for line in _read(path, "--auth-file"):
        if line.strip():
            user, _, password = line.partition(":")
            return user.encode(), password.encode()
    raise CredentialsError(f"--auth-file {path} is empty: it needs at least one entry")


def load_tokens(path: str) -> list[bytes]:
    """The digest of each token line."""
    tokens = []
    for number, line in enumerate(_read(path, "--token-file"), 1):
        token = line.strip()
        if not token:
            continue
        if not _TOKEN.fullmatch(token):
            raise CredentialsError(
                f"--token-file {path} line {number}: a token is letters, digits and - . _ ~ + / (then = padding)"
            )
        if len(token) < MIN_TOKEN:
            raise CredentialsError(f"--token-file {path} line {number}: a token needs at least {MIN_TOKEN} characters")
        tokens.append(_digest(token.encode()))
    return tokens


class Credentials:
    """The users and tokens of one daemon process, shared by its connections; reloadable."""

    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._users: list[tuple[bytes, bytes]] = []
        self._tokens: list[bytes] = []
        # memcached's STATS auth_cmds and auth_errors (logins tried, failed), and refused bearer tokens.
        self.logins = 0
        self.login_failures = 0
        self.token_failures = 0
        self._load()

    @property
    def users_enabled(self) -> bool:
        """Whether memcached connections must log in."""
        return self.config.auth_file is not None

    @property
    def tokens_enabled(self) -> bool:
        """Whether HTTP and gRPC requests need a bearer token."""
        return self.config.token_file is not None

    def _load(self) -> None:
        """Read both files; raises :class:`CredentialsError` and changes nothing if either is unusable."""
        users = load_users(self.config.auth_file) if self.config.auth_file else []
        tokens = load_tokens(self.config.token_file) if self.config.token_file else []
        self._users, self._tokens = users, tokens

    def reload(self) -> bool:
        """Read the files again (SIGHUP): the new credentials, or the old ones kept and one log line."""
        try:
            self._load()
        except CredentialsError as exc:
            log.error("credentials not reloaded, the previous ones stay in use: %s", exc)
            return False
        parts = []
        if self.config.auth_file:
            parts.append(f"{len(self._users)} user(s) from {self.config.auth_file}")
        if self.config.token_file:
            parts.append(f"{len(self._tokens)} token(s) from {self.config.token_file}")
        if parts:
            log.info("credentials reloaded: %s", ", ".join(parts))
        return True

    def check_user(self, user: bytes, password: bytes) -> bool:
        """Whether ``user`` has ``password``, in time independent of both (every entry is compared)."""
        user_digest, password_digest = _digest(user), _digest(password)
        found = False
        for known_user, known_password in self._users:
            same_user = hmac.compare_digest(user_digest, known_user)
            same_password = hmac.compare_digest(password_digest, known_password)
            found |= same_user & same_password
        self.note_login(found)
        return found

    def note_login(self, ok: bool) -> None:
        """Count a memcached login (one that is malformed counts as failed, as in memcached)."""
        self.logins += 1
        if not ok:
            self.login_failures += 1

    def stat_fields(self) -> list[tuple[str, object]]:
        """STATS fields: memcached's ``auth_cmds`` and ``auth_errors`` (with --auth-file), and
        ``auth_token_errors`` (with --token-file): requests refused for a missing or wrong token."""
        fields: list[tuple[str, object]] = []
        if self.users_enabled:
            fields += [("auth_cmds", self.logins), ("auth_errors", self.login_failures)]
        if self.tokens_enabled:
            fields.append(("auth_token_errors", self.token_failures))
        return fields

    def check_token(self, token: bytes) -> bool:
        """Whether ``token`` is one of the tokens, in time independent of it."""
        token_digest = _digest(token)
        found = False
        for known in self._tokens:
            found |= hmac.compare_digest(token_digest, known)
        return found

    def check_authorization(self, header: bytes | None, count: bool = True) -> bool:
        """Whether an ``Authorization`` header (HTTP) or ``authorization`` metadata (gRPC) value is
        ``Bearer <one of the tokens>``. The scheme is case-insensitive (RFC 9110). ``count``: a
        refusal counts in ``auth_token_errors`` (not when the request is checked again later)."""
        scheme, _, token = (header or b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and self.check_token(token.strip()):
            return True
        if count:
            self.token_failures += 1
        return False


def check_files(config: AuthConfig) -> Credentials:
    """Load the credentials at start; :class:`CredentialsError` (one line) if a file is unusable."""
    return Credentials(config)

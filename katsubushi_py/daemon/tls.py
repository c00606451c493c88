"""TLS on the TCP listeners (memcached, HTTP, gRPC), done by Python's ``ssl`` module (OpenSSL).

The flags mirror memcached's ``-Z`` options: ``--tls-cert`` (``ssl_chain_cert``: the certificate chain,
PEM), ``--tls-key`` (``ssl_key``), ``--tls-ca`` (``ssl_ca_cert``: the CAs whose client certificates
are accepted), ``--tls-verify none|request|require`` (``ssl_verify_mode`` 0, 1, 2) and
``--tls-min-version 1.2|1.3`` (``ssl_min_version``, default TLS 1.2). With TLS on, every TCP listener
speaks TLS; ``--plain-port`` keeps one plain memcached listener on loopback (memcached's ``notls:``
prefix), and unix sockets stay plain (as in memcached).

How a TLS connection is served: by our own socket transport
(:class:`~katsubushi_py.daemon.sockets.SocketServer`, compiled or pure, as plain memcached is served
with the compiled hot path), not by the loop's TLS transport. After ``accept`` the socket is wrapped
with the listener's context (``SSLSocket``, non-blocking, no handshake yet); :class:`TlsHandshake`
drives the handshake with the loop's reader and writer callbacks, within the handshake deadline
(``--request-timeout``); then the transport reads and writes through OpenSSL's object itself (one
record decrypted per read, what OpenSSL still holds read on the next turn, a write it could not finish
retried with the same bytes) and the connection glue
(:class:`~katsubushi_py.daemon.connection.ConnectionHandler`) sees the connection, as a plain one. A
request costs one decrypting read and one encrypting write, with no memory BIOs, copies or state
machine of the loop's in between (``bench/RESULTS.md``, "TLS in the socket transport"). So:

- a reload (``SIGHUP``, memcached's ``refresh_certs``) builds new contexts from the files; OpenSSL's
  server-name callback, called early in every handshake, hands each new connection the current one
  (:meth:`TlsServer._switcher`): new connections get the new certificate, key and CAs, open ones
  keep the session they have; a bad file leaves the old contexts in place;
- a handshake that stalls, or garbage instead of one, costs one file descriptor and ~48 KB until the
  deadline or OpenSSL's error, never a traceback; handshakes in progress count toward
  --max-connections and --max-unauthenticated (:mod:`.admission`: one beyond them is closed at
  accept), so no number of idle connections to a TLS port can take more than those;
- a record that stops half-way (the fd readable, OpenSSL still without a whole record) starts the
  request deadline (:mod:`.deadlines`), so a record trickled in a byte at a time is closed within
  --request-timeout, not the idle timeout; plain connections keep exactly the path they had.

gRPC's context offers ALPN ``h2`` (gRPC clients refuse a server that does not select it), HTTP's
``http/1.1``; memcached's none.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .memory import TRIMMER

if TYPE_CHECKING:
    from .sockets import SocketServer

log = logging.getLogger("katsubushi_py")

#: --tls-verify's choices and their OpenSSL meaning (memcached's ssl_verify_mode 0, 1, 2).
VERIFY_MODES = {"none": ssl.CERT_NONE, "request": ssl.CERT_OPTIONAL, "require": ssl.CERT_REQUIRED}
#: --tls-min-version's choices; memcached's spellings (tlsv1.2, 2) are taken too.
MIN_VERSIONS = {
    "1.2": ssl.TLSVersion.TLSv1_2,
    "1.3": ssl.TLSVersion.TLSv1_3,
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
    "2": ssl.TLSVersion.TLSv1_2,
    "3": ssl.TLSVersion.TLSv1_3,
}
#: The listener kinds, and the ALPN protocols each offers.
ALPN = {"memcached": None, "http": ["http/1.1"], "grpc": ["h2"]}


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used: one line naming the file and why."""


@dataclass(frozen=True)
class TlsConfig:
    cert: str  # the certificate chain (PEM): the server's certificate first, then intermediates
    key: str | None = None  # the private key (PEM); None: in the --tls-cert file
    ca: str | None = None  # CAs whose client certificates are accepted (mutual TLS)
    verify: str = "none"  # none, request or require
    min_version: str = "1.2"
    ciphers: str | None = None  # OpenSSL cipher list for TLS 1.2 (TLS 1.3's suites are OpenSSL's)

    def describe(self) -> str:
        client = f", client certificates {self.verify}d" if self.verify != "none" else ""
        return f"TLS {self.min_version}+{client}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        text = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in text.upper().replace(" ", "_"):
            return "the key does not belong to the certificate (key values mismatch)"
        if any(word in text.upper() for word in ("PEM LIB", "NO_START_LINE", "NO CERTIFICATE", "NO_CERTIFICATE")):
            return f"not a PEM certificate or key (OpenSSL: {text})"
        return text
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def _check_dates(path: str, now: float) -> None:
    """Refuse a certificate (the chain's first) that has expired or is not valid yet."""
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    if decode is None:  # (CPython has it; another implementation: OpenSSL checks at handshake time)
        return
    try:
        info = decode(path)
        not_before = ssl.cert_time_to_seconds(info["notBefore"])
        not_after = ssl.cert_time_to_seconds(info["notAfter"])
    except (ssl.SSLError, OSError, KeyError, ValueError):
        return  # load_cert_chain has already said what is wrong with the file
    if now > not_after:
        raise TlsError(f"--tls-cert {path}: the certificate expired on {info['notAfter']}")
    if now < not_before:
        raise TlsError(f"--tls-cert {path}: the certificate is not valid before {info['notBefore']}")


def _copy_private(config: TlsConfig, into: str) -> TlsConfig:
    """The files copied into a private directory, so that what is checked is what is loaded even
    if a certificate manager rewrites them meanwhile."""

    def copy(path: str | None, name: str, option: str) -> str | None:
        if path is None:
            return None
        target = os.path.join(into, name)
        try:
            shutil.copyfile(path, target)
        except OSError as exc:
            raise TlsError(f"{option} {path}: cannot read it: {exc.strerror or exc}") from None
        return target

    return TlsConfig(
        cert=copy(config.cert, "cert.pem", "--tls-cert") or "",
        key=copy(config.key, "key.pem", "--tls-key"),
        ca=copy(config.ca, "ca.pem", "--tls-ca"),
        verify=config.verify,
        min_version=config.min_version,
        ciphers=config.ciphers,
    )


def build_contexts(config: TlsConfig, now: float | None = None) -> dict[str, ssl.SSLContext]:
    """A server context per listener kind, from the files as they are now; :class:`TlsError` names
    the file and the problem (missing, unreadable, not PEM, a key that does not match, expired)."""
    with tempfile.TemporaryDirectory(prefix="katsubushi-tls-") as private:
        copied = _copy_private(config, private)
        contexts = {}
        for kind, alpn in ALPN.items():
            contexts[kind] = _context(config, copied, alpn)
        _check_dates(copied.cert, time.time() if now is None else now)
    return contexts


def _context(config: TlsConfig, copied: TlsConfig, alpn: list[str] | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[config.min_version]
    ctx.options |= ssl.OP_NO_RENEGOTIATION  # as memcached: no renegotiation
    if config.ciphers:
        try:
            ctx.set_ciphers(config.ciphers)
        except ssl.SSLError:
            raise TlsError(f"--tls-ciphers {config.ciphers!r}: OpenSSL knows none of these ciphers") from None
    try:
        ctx.load_cert_chain(copied.cert, copied.key)
    except (ssl.SSLError, OSError) as exc:
        what = f"--tls-cert {config.cert}" + (f" and --tls-key {config.key}" if config.key else "")
        raise TlsError(f"{what}: cannot load the certificate and key: {_reason(exc)}") from None
    if copied.ca is not None:
        try:
            ctx.load_verify_locations(cafile=copied.ca)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"--tls-ca {config.ca}: cannot load the CA certificates: {_reason(exc)}") from None
    ctx.verify_mode = VERIFY_MODES[config.verify]
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


class TlsServer:
    """The daemon's TLS contexts and their reload, and what STATS reports of them (memcached's
    ``ssl_min_version``, ``time_since_server_cert_refresh``, and the reload counts)."""

    def __init__(self, config: TlsConfig, handshake_timeout: float) -> None:
        self.config = config
        self.handshake_timeout = handshake_timeout or None  # 0: no deadline
        #: The contexts the listeners were made with (asyncio keeps the one it was given).
        self.listening = build_contexts(config)
        for kind, ctx in self.listening.items():
            ctx.sni_callback = self._switcher(kind)
        #: The contexts new connections get: the listening ones until a reload replaces them.
        self.contexts = dict(self.listening)
        self.loaded_at = time.monotonic()
        self.reloads = 0
        self.reload_failures = 0

    def _switcher(self, kind: str) -> Callable[[ssl.SSLObject, str | None, ssl.SSLContext], None]:
        """OpenSSL's server-name callback, which it calls early in every ClientHello (with or without
        SNI): hand the connection the current context, so that it uses the certificate, key and CAs
        of the last reload (``SSL_set_SSL_CTX``)."""

        def switch(obj: ssl.SSLObject, server_name: str | None, listening: ssl.SSLContext) -> None:
            current = self.contexts[kind]
            if current is not listening:
                obj.context = current

        return switch

    def reload(self) -> str | None:
        """Load the files again; None if the new certificate is in use for new connections, else the
        reason (logged once; the old contexts stay)."""
        try:
            contexts = build_contexts(self.config)
        except TlsError as exc:
            self.reload_failures += 1
            log.error("TLS certificates not reloaded, the old ones stay in use: %s", exc)
            return str(exc)
        self.contexts = contexts
        self.loaded_at = time.monotonic()
        self.reloads += 1
        log.info("TLS certificates reloaded from %s", self.config.cert)
        return None

    def stat_fields(self) -> list[tuple[str, object]]:
        return [
            ("ssl_min_version", "tlsv" + self.config.min_version),
            ("time_since_server_cert_refresh", int(time.monotonic() - self.loaded_at)),
            ("ssl_cert_reloads", self.reloads),
            ("ssl_cert_reload_failures", self.reload_failures),
        ]

    def server_options(self, kind: str) -> dict[str, Any]:
        """:class:`~.sockets.SocketServer`'s TLS arguments for a listener of ``kind``."""
        return {"tls_context": self.listening[kind], "handshake_timeout": self.handshake_timeout}


class TlsHandshake:
    """A TLS connection's server handshake, driven by the loop's reader and writer callbacks (the
    socket is an ``SSLSocket`` made with ``do_handshake_on_connect=False``, non-blocking); once done,
    the connection is served by the server's transport like a plain one. No protocol object exists
    before that; the handshake counts toward the connection limits while it lasts (the server's
    ``_handshakes``, which :class:`~.admission.Admission` reads), and ends within ``timeout`` (the
    --request-timeout) or at OpenSSL's first error, closed quietly (a debug line)."""

    __slots__ = ("_fd", "_loop", "_server", "_sock", "_timer", "_waiting")

    def __init__(self, server: SocketServer, sock: ssl.SSLSocket, timeout: float | None) -> None:
        self._server = server
        self._loop = server._loop
        self._sock = sock
        self._fd = sock.fileno()
        self._waiting: str | None = None  # "read" or "write": the callback registered
        self._timer = self._loop.call_later(timeout, self._expired) if timeout else None
        server._handshakes.add(self)
        self._step()

    def _step(self) -> None:
        try:
            self._sock.do_handshake()
        except ssl.SSLWantReadError:
            self._wait("read")
            return
        except ssl.SSLWantWriteError:
            self._wait("write")
            return
        except (OSError, ValueError) as exc:  # an SSLError (garbage, a certificate refused), a reset
            log.debug("TLS handshake failed: %s", exc)
            self.close()
            return
        self._stop()
        server = self._server
        try:
            server._transport(self._loop, self._sock, server._factory()).start()
        except OSError as exc:  # the client reset the connection at once
            log.debug("dropped a new connection: %s", exc)
            self._sock.close()

    def _wait(self, what: str) -> None:
        if self._waiting == what:
            return
        self._unwatch()
        self._waiting = what
        if what == "read":
            self._loop.add_reader(self._fd, self._step)
        else:
            self._loop.add_writer(self._fd, self._step)

    def _unwatch(self) -> None:
        if self._waiting == "read":
            self._loop.remove_reader(self._fd)
        elif self._waiting == "write":
            self._loop.remove_writer(self._fd)
        self._waiting = None

    def _stop(self) -> None:
        self._unwatch()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._server._handshakes.discard(self)

    def _expired(self) -> None:
        self._timer = None
        log.debug("closing a connection whose TLS handshake did not finish in time")
        self.close()

    def close(self) -> None:
        self._stop()
        self._sock.close()
        TRIMMER.closed()

"""The asyncio daemon: listeners, the shared issuer and counters, the lease, a graceful stop.

Connections are :class:`~.connection.ConnectionHandler` objects (flow control, idle timeout, clock
waits) around the sans-IO protocols of :mod:`katsubushi_py.frontends`. This module opens and closes
listeners, owns the unix socket file, raises the open-files limit and runs the daemon until a signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import os
import resource
import signal
import socket
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from ..auth import AuthConfig, Credentials, CredentialsError
from ..compiled import IMPLEMENTATION, WHY_NOT_COMPILED
from ..config import ServerConfig
from ..issuing.errors import GenerationError
from ..issuing.generator import Generator
from ..issuing.issuer import Issuer
from ..issuing.statefile import StateFile
from ..leasing import LeaseError, LeaseKeeper, LeaseRefused
from .activation import ActivationError, describe, inherited_sockets
from .admission import Admission
from .connection import ConnectionHandler
from .deadlines import RequestDeadlines
from .memory import TRIMMER
from .refusals import DescriptorWatch
from .sockets import DIRECT, SocketServer, bind_tcp, bind_unix
from .stats import Stats, settings_fields
from .tls import TlsConfig, TlsError, TlsServer

log = logging.getLogger("katsubushi_py")

# File descriptors the process needs besides its client connections (listeners, logs, state file).
_SPARE_FDS = 32


def startup_warnings(addresses: list[str], tls: TlsConfig | None = None, auth: AuthConfig | None = None) -> list[str]:
    """What an operator should know about how this daemon runs, logged once it listens (so that a
    failed start stays one line): the pure-Python hot path, and listeners beyond loopback without TLS
    (with TLS, every TCP listener but the loopback --plain-port has it) or without authentication
    (client certificates required, or ``auth``: --auth-file the memcached ones, --token-file HTTP and
    gRPC)."""
    lines = []
    if IMPLEMENTATION != "compiled":
        advice = (
            "; reinstall where a C compiler and the Python headers exist (gcc, python3-dev) to build it"
            if WHY_NOT_COMPILED.startswith("not built")
            else ""
        )
        lines.append(
            f"running the pure-Python hot path ({WHY_NOT_COMPILED}): expect about 0.6-0.75x memcached's"
            " requests/s one key at a time instead of about 1.0x, and a fifth to a half of the compiled"
            f" path's IDs/s with pipelined and multi-key GETs (bench/RESULTS.md){advice}"
        )
    exposed = [address for address in addresses if not _is_local(address)]
    covered = [address for address in exposed if _authenticated(address, auth)]
    exposed = [address for address in exposed if address not in covered]
    logins = "logins: --auth-file (memcached), --token-file (HTTP, gRPC)"
    if exposed and tls is None:
        lines.append(
            f"listening beyond loopback ({', '.join(exposed)}) with no authentication or encryption: anyone"
            " who can reach these addresses can take IDs and read its stats, in clear text; turn on TLS"
            " (--tls-cert, --tls-key) and require client certificates (--tls-ca, --tls-verify require) or"
            f" {logins}; or allow only your applications (a firewall, a private network, a Kubernetes"
            " NetworkPolicy)"
        )
    elif exposed and tls is not None and tls.verify != "require":
        lines.append(
            f"listening beyond loopback ({', '.join(exposed)}) with TLS but no authentication: anyone who can"
            " reach these addresses can take IDs and read its stats; require client certificates (--tls-ca,"
            f" --tls-verify require) or {logins}; or allow only your applications (a firewall, a"
            " NetworkPolicy)"
        )
    if covered and tls is None:
        lines.append(
            f"listening beyond loopback ({', '.join(covered)}) with authentication but no encryption:"
            " passwords, tokens and IDs cross the network in clear text; turn on TLS (--tls-cert, --tls-key)"
        )
    return lines


def tls_scheme(plain: str) -> str:
    """How the start-up line labels a listener once TLS is on: ``https://`` for HTTP (a ``curl`` to a
    logged ``http://`` address gets an empty reply), ``grpc+tls://`` for gRPC, ``tls://`` for memcached
    (whose plain listeners, a unix socket or --plain-port, have no scheme)."""
    return {"http://": "https://", "grpc://": "grpc+tls://"}.get(plain, "tls://")


def _authenticated(address: str, auth: AuthConfig | None) -> bool:
    """Whether the listener at ``address`` asks for credentials."""
    if auth is None:
        return False
    if address.startswith(("http://", "grpc://", "https://", "grpc+tls://")):
        return auth.token_file is not None
    return auth.auth_file is not None


def _is_local(address: str) -> bool:
    """A unix socket or a loopback address (``127.0.0.1:11212``, ``http://[::1]:8080``, ``grpc://...``)."""
    address = address.split("://", 1)[-1]
    if address.startswith(("/", "@")) or ":" not in address:
        return True  # a unix socket (a path, or Linux's abstract namespace)
    host = address[1 : address.index("]")] if address.startswith("[") else address.rsplit(":", 1)[0]
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class StartupError(RuntimeError):
    """The daemon cannot start (port in use, live daemon on the socket, ...): one line for the user, and
    the exit status (2: a configuration to fix, which the shipped systemd unit does not restart)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def raise_fd_limit(needed: int) -> None:
    """Raise the open-files soft limit to what the connection limit needs, as memcached does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit to %d: %s", needed, exc)
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "open-files limit is %d (hard limit %s) but --max-connections needs about %d;"
            " connections beyond the limit will fail to be accepted",
            soft,
            hard,
            needed,
        )


def prepare_unix_socket(path: str) -> None:
    """Remove a socket file left by a killed daemon; refuse if a live one listens there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale unix socket %s (nothing listens on it)", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise StartupError(f"cannot check existing socket {path}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise StartupError(f"another daemon is listening on {path}")


@dataclass
class Listeners:
    """Listening sockets made elsewhere (by the ``--workers`` supervisor), served instead of binding
    ``--port``, ``--sock``, ``--http-port`` and ``--grpc-port``."""

    memcached: list[socket.socket] = field(default_factory=list)
    http: list[socket.socket] = field(default_factory=list)
    grpc: list[socket.socket] = field(default_factory=list)
    plain: list[socket.socket] = field(default_factory=list)  # --plain-port (memcached, no TLS)


class Daemon:
    """Listeners plus the shared issuer and counters."""

    def __init__(
        self,
        config: ServerConfig,
        generator: Generator,
        loop: asyncio.AbstractEventLoop,
        listeners: Listeners | None = None,
    ) -> None:
        self.config = config
        self.listeners = listeners
        self.generator = generator
        self.issuer = Issuer(generator, __version__)
        self.loop = loop
        self.stats = Stats(self.issuer, config.max_connections, config.idle_timeout)
        self.issuer.stats_fields = self.stats.fields
        self.issuer.settings_fields = lambda: settings_fields(config, generator.state_path)
        self.connections: set[ConnectionHandler] = set()
        self.servers: list[asyncio.AbstractServer | SocketServer] = []
        self.admission = Admission(
            config.max_connections,
            config.max_unauthenticated or max(1, config.max_connections // 2),
            self.connections,
            lambda: self.servers,
            self.stats,
        )
        self.issuer.stats_fields = _chain(self.issuer.stats_fields, self.admission.stat_fields)
        self.issuer.stats_fields = _chain(self.issuer.stats_fields, TRIMMER.stat_fields)
        self.stopping = False
        self._all_closed: asyncio.Event | None = None
        self.addresses: list[str] = []
        self._own_socket = False
        self.tls: TlsServer | None = None  # made by start() (the files are read again there)
        self.deadlines: RequestDeadlines | None = None
        self.descriptors: DescriptorWatch | None = None
        #: What SIGHUP rereads (credentials; certificates where TLS is served), and memcached's
        #: ``refresh_certs`` the certificates: callables returning None or why not. Each keeps what it
        #: has when its files are not usable, and says so in the log.
        self.reloaders: list[Callable[[], object]] = []
        #: Set by the --workers supervisor's processes: a reload asks the supervisor to reload all.
        self.tell_supervisor = False
        self.issuer.refresh_certs = self.refresh_certs  # type: ignore[attr-defined]
        self.credentials: Credentials | None = None
        if config.auth is not None:
            try:
                self.credentials = Credentials(config.auth)
            except CredentialsError as exc:
                raise StartupError(str(exc)) from None
            self.reloaders += [self.credentials.reload, self.forget_headers]
            self.stats.auth = self.credentials.stat_fields

    def forget_headers(self) -> None:
        """After the credentials are reread: every gRPC connection forgets the header blocks its fast
        path recognises by their bytes (each carried a token checked against the old tokens), so the
        next call of each is decoded and its token checked again."""
        for handler in list(self.connections):
            forget = getattr(handler._conn, "_cache_clear", None)
            if forget is not None:
                forget()

    def reload(self) -> str | None:
        """SIGHUP: every reloader in turn (credentials, certificates); one that fails is logged and does
        not stop the others. Returns the first failure's reason."""
        if not self.reloaders:
            log.info("SIGHUP: nothing to reload (no --tls-cert, --auth-file or --token-file)")
            return None
        log.info("SIGHUP: reloading")
        failures = []
        for reloader in self.reloaders:
            try:
                reason = reloader()
            except Exception:
                log.exception("reload failed; the previous settings stay in use")
                reason = "reload failed"
            if isinstance(reason, str):
                failures.append(reason)
        return failures[0] if failures else None

    def refresh_certs(self) -> str | None:
        """memcached's ``refresh_certs``: reload the certificates now (in every --workers process)."""
        if self.tls is None:
            return "TLS not enabled"
        reason = self.tls.reload()
        if reason is None and self.tell_supervisor:
            with contextlib.suppress(OSError):
                os.kill(os.getppid(), signal.SIGHUP)  # the supervisor passes it to every process
        return reason

    def connection_closed(self) -> None:
        TRIMMER.closed()
        if self._all_closed is not None and not self.connections:
            self._all_closed.set()

    async def _listen_tcp(
        self,
        factory: Callable[[], asyncio.Protocol],
        port: int,
        scheme: str = "",
        direct: bool = False,
        kind: str | None = None,
        host: str | None = None,
    ) -> None:
        """Listen on --host:port; ``direct``: serve with our socket transport (memcached, compiled);
        ``kind`` (memcached, http, grpc): with TLS when it is on (always on our socket transport)."""
        host = self.config.host if host is None else host
        tls: dict[str, Any] = {}
        if kind is not None and self.tls is not None:
            tls, direct, scheme = self._tls_options(kind), True, tls_scheme(scheme)
        backlog = min(4096, max(128, self.config.max_connections))
        server: asyncio.AbstractServer | SocketServer
        try:
            if direct:
                socks = bind_tcp(host, port)
                try:
                    for sock in socks:
                        self.servers.append(SocketServer(self.loop, sock, factory, backlog, **tls))
                        self._note_addresses(self.servers[-1], scheme)
                except OSError:
                    for sock in socks:
                        sock.close()
                    raise
                return
            server = await self.loop.create_server(factory, host, port, backlog=backlog, reuse_address=True)
        except OSError as exc:
            await self.close_listeners()
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise StartupError(f"cannot listen on {scheme}{host}:{port}: {reason}") from None
        self.servers.append(server)
        self._note_addresses(server, scheme)

    def _tls_options(self, kind: str) -> dict[str, Any]:
        """A TLS listener's arguments: its context and handshake deadline, and the admission of its
        handshakes (counted toward --max-connections and --max-unauthenticated)."""
        assert self.tls is not None
        return {**self.tls.server_options(kind), "admit": self.admission.admit_handshake}

    def _note_addresses(self, server: asyncio.AbstractServer | SocketServer, scheme: str) -> None:
        for sock in server.sockets:
            address, bound = sock.getsockname()[:2]
            self.addresses.append(scheme + (f"[{address}]:{bound}" if ":" in address else f"{address}:{bound}"))

    async def _start_http(self, port: int) -> None:
        """The HTTP API: its connections go through the same glue as memcached's (limit, counters,
        idle timeout, flow control, clock waits). prometheus-client loads only here."""
        from ..frontends.http import TOO_MANY_CONNECTIONS, HttpApi, HttpConnection
        from .metrics import make_registry, metrics_renderer

        memcached = ("text", "binary", "meta")  # the memcached listeners serve all three
        protocols = (*memcached, "http", "grpc") if self.config.grpc_port is not None else (*memcached, "http")
        api = HttpApi(self.issuer, metrics_renderer(make_registry(self.stats, self.issuer, protocols)))
        credentials = self.credentials
        tokens = credentials is not None and credentials.tokens_enabled
        if tokens:
            assert credentials is not None
            api.require_token(credentials, metrics_open=credentials.config.metrics_no_auth)

        def factory() -> ConnectionHandler:
            return ConnectionHandler(self, lambda: HttpConnection(api), TOO_MANY_CONNECTIONS, token_login=tokens)

        if self.listeners is not None and self.listeners.http:
            await self._serve_sockets(factory, self.listeners.http, "http://", kind="http")
        else:
            await self._listen_tcp(factory, port, "http://", kind="http")

    async def _start_grpc(self, port: int) -> None:
        """gRPC over HTTP/2 (:mod:`~katsubushi_py.frontends.grpc_h2`) through the same glue as memcached
        and HTTP (limit, counters, idle timeout, flow control, clock waits); h2 and protobuf load only here."""
        from ..frontends.grpc_frames import TOO_MANY_CONNECTIONS
        from ..frontends.grpc_h2 import GrpcConnection
        from ..frontends.grpc_service import GrpcService

        service = GrpcService(self.issuer)
        credentials = self.credentials
        tokens = credentials is not None and credentials.tokens_enabled
        if tokens:
            service.credentials = credentials  # every call's token checked (see GrpcConnection._headers)

        def factory() -> ConnectionHandler:
            return ConnectionHandler(self, lambda: GrpcConnection(service), TOO_MANY_CONNECTIONS, token_login=tokens)

        if self.listeners is not None and self.listeners.grpc:
            await self._serve_sockets(factory, self.listeners.grpc, "grpc://", direct=DIRECT, kind="grpc")
        else:
            await self._listen_tcp(factory, port, "grpc://", direct=DIRECT, kind="grpc")

    async def start(self) -> None:
        config = self.config
        backlog = min(4096, max(128, config.max_connections))
        if config.tls is not None:
            try:
                self.tls = TlsServer(config.tls, config.request_timeout)
            except TlsError as exc:
                raise StartupError(str(exc)) from None
            self.reloaders.append(self.tls.reload)
            self.issuer.stats_fields = _chain(self.issuer.stats_fields, self.tls.stat_fields)
        if config.request_timeout > 0:
            self.deadlines = RequestDeadlines(self, config.request_timeout)
            self.issuer.stats_fields = _chain(self.issuer.stats_fields, self.deadlines.stat_fields)
        self.descriptors = DescriptorWatch(self.loop, lambda: len(self.connections))
        # Sockets made for us (--workers) or passed by systemd replace the memcached listeners (--port,
        # --sock); HTTP and gRPC bind as usual unless the supervisor made their sockets too.
        if self.listeners is not None:
            await self._serve_sockets(
                lambda: ConnectionHandler(self), self.listeners.memcached, direct=DIRECT, kind="memcached"
            )
            await self._serve_sockets(lambda: ConnectionHandler(self), self.listeners.plain, direct=DIRECT)
            activated = True
        else:
            activated = await self._start_inherited()
        if config.port is not None and not activated:
            await self._listen_tcp(lambda: ConnectionHandler(self), config.port, direct=DIRECT, kind="memcached")
        if config.plain_port is not None and self.listeners is None:  # (the supervisor made it otherwise)
            await self._listen_tcp(lambda: ConnectionHandler(self), config.plain_port, direct=DIRECT, host="127.0.0.1")
        if config.http_port is not None:
            await self._start_http(config.http_port)
        if config.grpc_port is not None:
            await self._start_grpc(config.grpc_port)
        if config.sock and not activated:
            prepare_unix_socket(config.sock)
            server: asyncio.AbstractServer | SocketServer
            try:
                # Bound with its mode, listening only after: never reachable with a wider one.
                sock = bind_unix(config.sock, config.sock_mode)
                try:
                    if DIRECT:
                        server = SocketServer(self.loop, sock, lambda: ConnectionHandler(self), backlog)
                    else:
                        server = await self.loop.create_unix_server(
                            lambda: ConnectionHandler(self), sock=sock, backlog=backlog
                        )
                except OSError:
                    sock.close()
                    raise
            except OSError as exc:
                await self.close_listeners()
                raise StartupError(f"cannot listen on {config.sock}: {exc.strerror or exc}") from None
            self.servers.append(server)
            self._own_socket = True
            self.addresses.append(config.sock)

    async def _start_inherited(self) -> bool:
        """Serve on the sockets systemd passed (socket activation) instead of binding; False if none."""
        try:
            inherited = inherited_sockets()
        except ActivationError as exc:
            raise StartupError(str(exc)) from None
        await self._serve_sockets(lambda: ConnectionHandler(self), inherited, direct=DIRECT, kind="memcached")
        if inherited:
            log.info(
                "serving memcached on %d socket(s) passed by systemd; --port and --sock are not used", len(inherited)
            )
        return bool(inherited)

    async def _serve_sockets(
        self,
        factory: Callable[[], asyncio.Protocol],
        sockets: list[socket.socket],
        scheme: str = "",
        direct: bool = False,
        kind: str | None = None,
    ) -> None:
        """Serve on listening sockets made by someone else (the supervisor, or systemd); ``direct``:
        with our socket transport (memcached, compiled); ``kind``: TCP ones with TLS when it is on."""
        backlog = min(4096, max(128, self.config.max_connections))
        for sock in sockets:
            server: asyncio.AbstractServer | SocketServer
            label = scheme
            if kind is not None and self.tls is not None and sock.family != socket.AF_UNIX:
                server = SocketServer(self.loop, sock, factory, backlog, **self._tls_options(kind))
                label = tls_scheme(scheme)
            elif direct:
                server = SocketServer(self.loop, sock, factory, backlog)
            elif sock.family == socket.AF_UNIX:
                # The socket file is not ours to remove (systemd's, or shared by every --workers
                # process): since Python 3.13, asyncio and uvloop unlink it on close unless told not to.
                keep = {"cleanup_socket": False} if sys.version_info >= (3, 13) else {}
                server = await self.loop.create_unix_server(factory, sock=sock, backlog=backlog, **keep)
            else:
                server = await self.loop.create_server(factory, sock=sock, backlog=backlog)
            self.servers.append(server)
            self.addresses.append(label + describe(sock))

    async def close_listeners(self) -> None:
        for server in self.servers:
            server.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self.servers.clear()
        if self.config.sock and self._own_socket:  # never remove another daemon's socket
            self._own_socket = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.sock)

    async def stop(self, grace: float = 0.8) -> None:
        """Stop accepting, let every connection flush what it was already answered, then close."""
        self.stopping = True
        self.issuer.unavailable = "shutting down"
        if self.deadlines is not None:
            self.deadlines.stop()
        if self.descriptors is not None:
            self.descriptors.stop()
        for server in self.servers:
            server.close()
        self._all_closed = asyncio.Event()
        if self.connections:
            for handler in list(self.connections):
                handler.close()  # data already received was answered synchronously; close flushes it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace)
            for handler in list(self.connections):
                handler.abort()
        await self.close_listeners()


def _chain(
    first: Callable[[], list[tuple[str, object]]], then: Callable[[], list[tuple[str, object]]]
) -> Callable[[], list[tuple[str, object]]]:
    """STATS' fields: ``first``'s, then ``then``'s (TLS and the request deadline: not ``Stats.extra``,
    whose presence the metrics read as a lease)."""
    return lambda: [*first(), *then()]


def _lease_failure(keeper: LeaseKeeper, exc: BaseException) -> StartupError:
    """The one line a daemon that cannot lease a worker id exits with."""
    if isinstance(exc, LeaseRefused):
        return StartupError(str(exc), 2)
    if isinstance(exc, LeaseError | GenerationError):
        return StartupError(str(exc))
    return StartupError(f"cannot lease a worker id from {keeper.target.display}: {exc}")


async def serve(
    config: ServerConfig,
    generator: Generator,
    ready: Any = None,
    *,
    claim_state: Callable[[int], StateFile] | None = None,
    listeners: Listeners | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully.

    With ``config.lease`` the daemon listens at once with its generator fenced (every request answers
    ``SERVER_ERROR`` with what the lease waits for, STATS shows the lease state, health checks report
    it unavailable) while the lease keeper connects, leases a worker id and keeps it; ``claim_state``
    gives each leased id's state file. If the keeper gives up (Redis unreachable for the whole
    --lease-start-timeout, no free id with --no-wait-for-lease, an unusable state directory) the
    daemon stops with one line."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    hangup: list[Daemon] = []  # SIGHUP reloads once the daemon exists; before, it is ignored
    loop.add_signal_handler(signal.SIGHUP, lambda: [d.reload() for d in hangup])
    keeper: LeaseKeeper | None = None
    keeping: asyncio.Task[None] | None = None
    daemon: Daemon | None = None
    try:
        daemon = Daemon(config, generator, loop, listeners)
        daemon.tell_supervisor = listeners is not None
        hangup.append(daemon)
        issuer = daemon.issuer
        if config.lease is not None:
            lease = config.lease

            def lease_changed(reason: str | None) -> None:
                if not daemon.stopping:  # type: ignore[union-attr]
                    issuer.unavailable = reason

            keeper = LeaseKeeper(
                lease.target,
                lease.timings,
                lease.min_worker_id,
                lease.max_worker_id,
                wait_for_free_id=lease.wait_for_free_id,
                skew_warn=lease.clock_skew_warn,
                skew_max=lease.clock_skew_max,
                start_timeout=lease.start_timeout,
                free_warn=lease.free_warn,
                claim_state=claim_state,
                on_change=lease_changed,
            )
            # What the keeper's first step says, said already: a client that connects as soon as the
            # port listens may be answered before that step runs.
            waiting = f"waiting for a worker id lease: connecting to Redis at {lease.target.display}"
            generator.set_fence(0, waiting)
            issuer.unavailable = waiting
            daemon.stats.extra = keeper.stat_fields
        raise_fd_limit(config.max_connections + _SPARE_FDS)
        await daemon.start()
        where = ", ".join(daemon.addresses)
        flavour = type(loop).__module__.split(".")[0]
        # Where the state is kept goes into this line, after the listeners are up: a failed start stays one line.
        source = f" ({config.state_dir_source})" if config.state_dir_source else ""
        if keeper is None:
            state = f"state file {generator.state_path}{source}" if generator.state_path else "no state file"
            log.info(
                "katsubushi-py %s serving worker id %d from %s on %s (loop %s); %s",
                __version__,
                generator.worker_id,
                config.worker_id_source,
                where,
                flavour,
                state,
            )
        else:
            state = f"state directory {config.state_dir}{source}" if config.state_dir else "no state file"
            log.info(
                "katsubushi-py %s listening on %s (loop %s); leasing a worker id from %s; %s",
                __version__,
                where,
                flavour,
                keeper.target.display,
                state,
            )
            keeping = loop.create_task(keeper.run(generator))
        if listeners is None:  # (the --workers supervisor says it once for all its processes)
            for line in startup_warnings(daemon.addresses, config.tls, config.auth):
                log.warning("%s", line)
        if ready is not None:
            ready(daemon)
        stopping = loop.create_task(stop.wait())
        try:
            await asyncio.wait({stopping, *([keeping] if keeping else [])}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if keeping is not None and keeping.done() and not keeping.cancelled():
            failure = keeping.exception()
            raise _lease_failure(keeper, failure) if failure is not None else StartupError("lease keeper stopped")  # type: ignore[arg-type]
        log.info("stopping")
    finally:
        if daemon is not None:
            await daemon.stop()
        if keeper is not None:
            with contextlib.suppress(GenerationError):
                generator.close()
            last_ms = generator.last_issued_ms or 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(keeper.stop(last_ms), 1.5)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        # Removing the handler restores SIGHUP's default action (the end of the process): a reload asked
        # for while the daemon stores its final mark is ignored instead, as it is during start-up.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

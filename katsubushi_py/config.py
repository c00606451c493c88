"""The daemon's configuration: command line, environment, validation. Nothing here opens a socket.

go-katsubushi's spellings work unchanged (``-worker-id 7 -port 11212 -idle-timeout 10m``, and the
environment variables ``WORKER_ID``, ``PORT``, ``SOCK``, ``IDLE_TIMEOUT``, ``LOG_LEVEL`` in upper or
lower case); a flag wins over the environment. Every problem becomes one :class:`ConfigError` line.
The worker id comes from exactly one place: ``--worker-id``, ``--worker-id-from`` (see
:mod:`.worker_ids`) or a Redis lease.
"""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .auth.credentials import AuthConfig, CredentialsError, check_files

# (daemon/tls.py imports only ssl and the standard library: no import circle)
from .daemon.tls import MIN_VERSIONS, VERIFY_MODES, TlsConfig, TlsError, build_contexts
from .ids.layout import DEFAULT_LAYOUT, KATSUBUSHI_EPOCH_MS, Layout, LayoutError
from .ids.tools import ToolError, parse_epoch
from .leasing import LeaseError, LeaseTimings, RedisTarget, parse_redis_url
from .worker_ids import METHODS, WorkerIdError, derive

DEFAULT_PORT = 11212
DEFAULT_IDLE_TIMEOUT = 600.0
DEFAULT_MAX_CONNECTIONS = 4096
#: Bytes of a connection's requests read (and held unanswered) while its client is behind with
#: reading the replies; see daemon/connection.py.
DEFAULT_READ_AHEAD = 1024 * 1024
#: How long a request may take to arrive once begun (a TLS handshake, a command line, an HTTP head).
DEFAULT_REQUEST_TIMEOUT = 5.0

LOG_LEVELS = {
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
    "fatal": "CRITICAL",
    "panic": "CRITICAL",
    "critical": "CRITICAL",
}

# Flags whose value go-katsubushi also reads from the environment (name upper or lower case), and ours.
ENV_FLAGS = (
    "worker_id",
    "port",
    "sock",
    "idle_timeout",
    "log_level",
    "redis",
    "min_worker_id",
    "max_worker_id",
    "http_port",
    "grpc_port",
    "state_dir",
)

GRPC_INSTALL_HINT = "pip install 'katsubushi-py[grpc]'"
APP_DIR = "katsubushi-py"
# Ours, read the same way. (Not HOSTNAME: shells and container runtimes set it, and the kernel's
# host name is the one that counts; --hostname overrides it explicitly.)
OUR_ENV_FLAGS = ("worker_id_from", "worker_id_offset", "workers")

#: --loop's choices.
LOOPS = ["auto", "uvloop", "asyncio"]

#: More worker processes than this would use more worker ids than cores could ever need.
MAX_WORKERS = 64


class ConfigError(ValueError):
    """Configuration that cannot work; the message is the one line the user sees."""


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from a Go duration (``600s``, ``10m``, ``1h30m``, ``1.5h``, ``300ms``, ``0``) or bare
    seconds (``600``, ``0.5``), which katsubushi v1 took and v2 rejects."""
    raw = text.strip()
    if raw.startswith("-"):
        raise ConfigError(
            f"invalid {name} {text!r}: must not be negative (0, seconds, or a Go duration such as 1s or 500ms)"
        )
    if re.fullmatch(r"\d+(\.\d*)?|\.\d+", raw):
        return float(raw)
    pos, total = 0, 0.0
    for match in _DURATION_PART.finditer(raw):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(raw) or not raw:
        raise ConfigError(f"invalid {name} {text!r}: use seconds or a Go duration such as 600s, 10m or 1h30m")
    return total


@dataclass(frozen=True)
class LeaseConfig:
    """Worker ids leased from Redis instead of ``--worker-id``."""

    target: RedisTarget
    min_worker_id: int = 1
    max_worker_id: int = 1023
    timings: LeaseTimings = field(default_factory=LeaseTimings)
    wait_for_free_id: bool = True
    clock_skew_warn: float = 0.5
    clock_skew_max: float = 5.0
    start_timeout: float = 60.0  # how long start-up retries an unreachable Redis before giving up
    free_warn: float = 0.05  # warn when fewer than this share of the pool's ids are free


@dataclass(frozen=True)
class ServerConfig:
    worker_id: int | None  # None: leased from Redis (see ``lease``)
    worker_id_source: str = "--worker-id"  # for the log: where the worker id came from
    host: str = "127.0.0.1"
    port: int | None = DEFAULT_PORT  # None: no TCP listener (unix socket only)
    sock: str | None = None
    sock_mode: int | None = None
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT  # 0 = never
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_ahead: int = DEFAULT_READ_AHEAD  # bytes held unanswered while a client does not read its replies
    log_level: str = "INFO"
    log_format: str = "text"
    state_file: str | None = None  # --state-file: one file, for a static worker id
    state_dir: str | None = None  # a file per worker id in it (the default; None with --no-state-file)
    state_dir_source: str = ""  # where state_dir came from, for the start-up log line
    state_file_new_worker_id: bool = False  # accept a state file written for another worker id
    max_clock_wait: float = 1.0
    layout: Layout = DEFAULT_LAYOUT
    loop: str = "auto"
    gets_cas: bool = False
    lease: LeaseConfig | None = None
    http_port: int | None = None  # None: no HTTP listener (0: any free port)
    grpc_port: int | None = None  # None: no gRPC server (0: any free port)
    workers: int = 1  # processes sharing the listeners, one worker id each (see daemon/workers.py)
    # TLS and request deadlines (issue 27; see daemon/tls.py and daemon/deadlines.py)
    tls: TlsConfig | None = None  # None: every listener plain
    plain_port: int | None = None  # a plain memcached listener on 127.0.0.1 beside the TLS ones
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT  # a request (TLS handshake, line, HTTP head) must arrive within
    auth: AuthConfig | None = None  # --auth-file, --token-file: None when neither is given


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so errors stay one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def _flag(parser: argparse._ActionsContainer, name: str, **kwargs: object) -> None:
    """Register ``--name`` and katsubushi's single-dash ``-name``."""
    parser.add_argument(f"--{name}", f"-{name}", default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]


def add_layout_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("ID layout (defaults are go-katsubushi's)")
    group.add_argument(
        "--epoch",
        default=None,
        help="epoch as ISO-8601 or unix ms (default 2015-01-01T00:00:00Z = 1420070400000)",
    )
    group.add_argument("--time-bits", type=int, default=41, help="bits of milliseconds (default 41)")
    group.add_argument("--worker-bits", type=int, default=10, help="bits of worker id (default 10)")
    group.add_argument("--sequence-bits", type=int, default=12, help="bits of sequence (default 12)")


def layout_from_args(args: argparse.Namespace) -> Layout:
    try:
        epoch = KATSUBUSHI_EPOCH_MS if args.epoch is None else parse_epoch(args.epoch)
        return Layout(
            epoch_ms=epoch,
            time_bits=args.time_bits,
            worker_bits=args.worker_bits,
            sequence_bits=args.sequence_bits,
        )
    except (LayoutError, ToolError) as exc:
        raise ConfigError(str(exc)) from None


def build_parser(
    prog: str = "katsubushi-py",
    description: str = "Serve unique 64-bit IDs over the memcached protocol (GET a -> one ID).",
    epilog: str | None = None,
    usage: str | None = None,
) -> argparse.ArgumentParser:
    """The daemon's flags; ``katsubushi-py health`` parses the same ones under its own name."""
    parser = _Parser(
        prog=prog,
        description=description,
        epilog=epilog,
        usage=usage,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    _flag(
        parser,
        "worker-id",
        metavar="N",
        help="this daemon's worker id (env WORKER_ID); unique per daemon. Or --worker-id-from, or --redis",
    )
    _flag(
        parser,
        "worker-id-from",
        metavar="METHOD",
        choices=list(METHODS),
        help="ordinal: the host name's trailing -N (StatefulSet pod name-3 -> 3); ip: the low worker-bits"
        " bits of the default route's IPv4 address (env WORKER_ID_FROM)",
    )
    _flag(parser, "worker-id-offset", metavar="N", help="added to the ordinal (env WORKER_ID_OFFSET)")
    _flag(parser, "hostname", metavar="NAME", help="the host name for --worker-id-from ordinal (default: the kernel's)")
    _flag(parser, "host", metavar="ADDR", help="TCP address to listen on (default 127.0.0.1; 0.0.0.0 or :: for all)")
    _flag(parser, "port", metavar="PORT", help=f"TCP port (default {DEFAULT_PORT}; env PORT)")
    _flag(
        parser,
        "sock",
        metavar="PATH",
        help="unix socket path (env SOCK); alone it means no TCP, with an explicit --port both",
    )
    _flag(parser, "sock-mode", metavar="MODE", help="octal permissions of the unix socket, e.g. 0660")
    _flag(
        parser,
        "idle-timeout",
        metavar="DURATION",
        help="close connections idle this long: 600, 600s, 10m, 1h30m; 0 = never (default 10m; env IDLE_TIMEOUT)",
    )
    _flag(
        parser,
        "max-connections",
        metavar="N",
        help=f"refuse connections beyond this many (default {DEFAULT_MAX_CONNECTIONS})",
    )
    _flag(
        parser,
        "read-ahead",
        metavar="BYTES",
        help="per connection, how much of its requests to read and hold while the client does not read its"
        " replies, before reading stops; 1048576, 1024k, 1m (default 1m)",
    )
    _flag(parser, "log-level", metavar="LEVEL", help="debug, info, warn, error (default info; env LOG_LEVEL)")
    _flag(parser, "log-format", metavar="FORMAT", choices=["text", "json"], help="text or json (default text)")
    _flag(
        parser,
        "state-dir",
        metavar="DIR",
        help="keep a high-water mark per worker id in DIR/worker-<id>.state so a restart never reissues IDs"
        " (env STATE_DIR; default $STATE_DIRECTORY, /var/lib/katsubushi-py for root, else"
        " $XDG_STATE_HOME/katsubushi-py or ~/.local/state/katsubushi-py)",
    )
    _flag(parser, "state-file", metavar="PATH", help="one state file instead of a directory (static --worker-id)")
    parser.add_argument(
        "--no-state-file",
        action="store_true",
        default=False,
        help="keep no state: a restart after the clock stepped back can reissue IDs",
    )
    parser.add_argument(
        "--state-file-new-worker-id",
        action="store_true",
        default=False,
        help="accept a state file written for another worker id (after changing this daemon's worker id)",
    )
    _flag(
        parser,
        "max-clock-wait",
        metavar="DURATION",
        help="how far behind the clock may be for the generator to wait instead of failing (default 1s)",
    )
    _flag(
        parser,
        "http-port",
        metavar="PORT",
        help="also serve HTTP (/id, /ids, /stats, /metrics, /healthz, /decode) on --host (env HTTP_PORT; 0 = off)",
    )
    _flag(
        parser,
        "grpc-port",
        metavar="PORT",
        help=f"also serve go-katsubushi's gRPC service on --host (env GRPC_PORT; 0 = off; needs {GRPC_INSTALL_HINT})",
    )
    _flag(
        parser,
        "loop",
        metavar="LOOP",
        choices=LOOPS,
        help=f"event loop: {', '.join(LOOPS[:-1])} or {LOOPS[-1]} (default auto: uvloop when it is installed)",
    )
    lease = parser.add_argument_group("worker ids leased from Redis (instead of --worker-id)")
    _flag(
        lease,
        "redis",
        metavar="URL",
        help="redis://HOST:PORT/DB?ns=NAME; also rediss://, unix://, rediscluster:// (env REDIS)",
    )
    _flag(lease, "min-worker-id", metavar="N", help="lowest worker id to lease (default 1; env MIN_WORKER_ID)")
    _flag(lease, "max-worker-id", metavar="N", help="highest worker id to lease (default 1023; env MAX_WORKER_ID)")
    _flag(lease, "lease-ttl", metavar="DURATION", help="lease expiry (default 30s)")
    _flag(lease, "lease-renew", metavar="DURATION", help="renew interval (default a third of the ttl)")
    _flag(lease, "lease-delay", metavar="DURATION", help="wait after taking a recently used id (default 2x renew)")
    _flag(lease, "clock-skew-warn", metavar="DURATION", help="warn above this clock difference to Redis TIME (0.5s)")
    _flag(lease, "clock-skew-max", metavar="DURATION", help="refuse to start when it differs by more (5s)")
    _flag(
        lease,
        "lease-start-timeout",
        metavar="DURATION",
        help="at start, retry an unreachable or slow Redis this long, then exit (default 60s); the daemon"
        " listens meanwhile and answers SERVER_ERROR",
    )
    _flag(lease, "lease-free-warn", metavar="PERCENT", help="warn when fewer than this %% of the pool is free (5)")
    lease.add_argument(
        "--no-wait-for-lease",
        action="store_true",
        default=False,
        help="exit instead of waiting when every worker id of the range is leased",
    )
    _flag(
        parser,
        "workers",
        metavar="N",
        help="N processes behind the same listeners, each with its own worker id (consecutive from"
        " --worker-id, or leased); default 1 (env WORKERS)",
    )
    add_tls_options(parser)
    parser.add_argument(
        "--gets-cas",
        action="store_true",
        default=False,
        help="answer GETS with a CAS field like memcached (katsubushi omits it; aiomcache's multi_get needs it)",
    )
    parser.add_argument("--version", "-version", action="store_true", help="print the version and exit")
    add_auth_options(parser)
    add_layout_options(parser)
    return parser


def add_tls_options(parser: argparse.ArgumentParser) -> None:
    """TLS (memcached's -Z options) and the request deadline (issue 27)."""
    tls = parser.add_argument_group(
        "TLS on every TCP listener (memcached, HTTP, gRPC), as memcached's -Z; unix sockets stay plain"
    )
    _flag(tls, "tls-cert", metavar="PATH", help="certificate chain (PEM), server certificate first; turns TLS on")
    _flag(tls, "tls-key", metavar="PATH", help="private key (PEM), unless it is in the --tls-cert file")
    _flag(tls, "tls-ca", metavar="PATH", help="CA certificates (PEM) whose client certificates are accepted")
    _flag(
        tls,
        "tls-verify",
        metavar="MODE",
        choices=list(VERIFY_MODES),
        help="client certificates: none, request (checked if sent) or require (mutual TLS); default none,"
        " require when --tls-ca is given",
    )
    _flag(tls, "tls-min-version", metavar="VERSION", help="lowest TLS version accepted: 1.2 or 1.3 (default 1.2)")
    _flag(tls, "tls-ciphers", metavar="LIST", help="OpenSSL cipher list for TLS 1.2 (default OpenSSL's)")
    _flag(
        tls,
        "plain-port",
        metavar="PORT",
        help="also serve memcached without TLS on 127.0.0.1:PORT (memcached's notls: listener), e.g. for"
        " local health checks",
    )
    _flag(
        parser,
        "request-timeout",
        metavar="DURATION",
        help="close a connection whose TLS handshake, command line or HTTP head takes longer than this to"
        " arrive (default 5s; 0 = never; at most --idle-timeout)",
    )


def tls_settings(given: Mapping[str, object], idle: float) -> tuple[TlsConfig | None, int | None, float]:
    """(TLS configuration or None, --plain-port or None, request deadline in seconds); the files are
    loaded once here, so that a missing file, a key that does not match the certificate or an expired
    certificate is one line and exit status 2 before anything listens."""
    timeout = parse_duration(str(given.get("request_timeout", DEFAULT_REQUEST_TIMEOUT)), "--request-timeout")
    if idle > 0 and (timeout == 0 or timeout > idle):
        timeout = idle  # the idle timeout closes a stalled request anyway
    cert = str(given.get("tls_cert") or "") or None
    if cert is None:
        for name in ("tls_key", "tls_ca", "tls_verify", "tls_min_version", "tls_ciphers", "plain_port"):
            if name in given:
                raise ConfigError(f"--{name.replace('_', '-')} needs --tls-cert (TLS is off without it)")
        return None, None, timeout
    ca = str(given.get("tls_ca") or "") or None
    verify = str(given.get("tls_verify") or ("require" if ca else "none"))
    if verify != "none" and ca is None:
        raise ConfigError(f"--tls-verify {verify} needs --tls-ca (the CAs whose client certificates to accept)")
    version = str(given.get("tls_min_version", "1.2")).lower()
    if version not in MIN_VERSIONS:
        raise ConfigError(f"invalid --tls-min-version {version!r}: use 1.2 or 1.3")
    version = "1.3" if MIN_VERSIONS[version].name.endswith("3") else "1.2"
    config = TlsConfig(
        cert=cert,
        key=str(given.get("tls_key") or "") or None,
        ca=ca,
        verify=verify,
        min_version=version,
        ciphers=str(given.get("tls_ciphers") or "") or None,
    )
    try:
        build_contexts(config)
    except TlsError as exc:
        raise ConfigError(str(exc)) from None
    plain = _int(given["plain_port"], "plain port", 1, 65535) if "plain_port" in given else None
    return config, plain, timeout


# -- authentication (issue 27): credentials only from files, never on the command line ---------------
def add_auth_options(parser: argparse.ArgumentParser) -> None:
    auth = parser.add_argument_group("authentication (credentials are read from files only; SIGHUP rereads them)")
    _flag(
        auth,
        "auth-file",
        metavar="PATH",
        help="memcached users, one user:password a line (memcached's -Y format): text connections log in"
        " with set <key> 0 0 <n> + '<user> <password>', binary ones with SASL PLAIN; nothing else before",
    )
    _flag(
        auth,
        "token-file",
        metavar="PATH",
        help="bearer tokens, one a line: HTTP and gRPC requests need 'authorization: Bearer <token>'"
        " (/healthz stays open)",
    )
    _flag(
        auth,
        "login-timeout",
        metavar="DURATION",
        help="with --auth-file, close a memcached connection that has not logged in this long after it"
        " opened (default 10s)",
    )
    auth.add_argument(
        "--metrics-no-auth",
        action="store_true",
        default=False,
        help="with --token-file, serve /metrics without a token (for a Prometheus without credentials)",
    )


def _auth_config(args: argparse.Namespace) -> AuthConfig | None:
    """The credential files, each read once here so that a bad one is the one line of a failed start."""
    auth_file = str(getattr(args, "auth_file", "") or "") or None
    token_file = str(getattr(args, "token_file", "") or "") or None
    metrics_no_auth = bool(getattr(args, "metrics_no_auth", False))
    if metrics_no_auth and token_file is None:
        raise ConfigError("--metrics-no-auth needs --token-file")
    login_timeout = parse_duration(str(getattr(args, "login_timeout", "10s")), "--login-timeout")
    if login_timeout <= 0:
        raise ConfigError("--login-timeout must be more than 0")
    if hasattr(args, "login_timeout") and auth_file is None:
        raise ConfigError("--login-timeout needs --auth-file")
    if auth_file is None and token_file is None:
        return None
    config = AuthConfig(auth_file, token_file, metrics_no_auth, login_timeout)
    try:
        check_files(config)
    except CredentialsError as exc:
        raise ConfigError(str(exc)) from None
    return config


def _env(environ: Mapping[str, str], name: str) -> str | None:
    for key in (name.upper(), name.lower()):
        value = environ.get(key)
        if value:
            return value
    return None


_SIZE = re.compile(r"(\d+)\s*(|b|k|kb|kib|m|mb|mib|g|gb|gib)", re.IGNORECASE)


def parse_size(text: str, name: str) -> int:
    """Bytes from ``1048576``, ``1024k``, ``1m``, ``1MiB`` (k, m and g are powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ConfigError(f"invalid {name} {text!r}: use bytes such as 1048576, 1024k or 1m")
    unit = match.group(2).lower()[:1]
    return int(match.group(1)) * {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[unit]


def _int(value: object, name: str, low: int, high: int | None = None) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ConfigError(f"invalid {name} {value!r}: not an integer") from None
    if number < low or (high is not None and number > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ConfigError(f"invalid {name} {number}: must be {bound}")
    return number


def merged_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, object]:
    """The flags given, plus the environment variables of those not given (a flag wins)."""
    given = dict(vars(args))
    for name in ENV_FLAGS + OUR_ENV_FLAGS:
        if name not in given:
            value = _env(environ, name)
            if value is not None:
                given[name] = value
    return given


def listen_settings(given: Mapping[str, object]) -> tuple[str, int | None, str | None]:
    """(host, port or None, unix socket path or None) as the daemon listens with these settings."""
    sock = str(given.get("sock") or "") or None
    port_given = "port" in given
    port: int | None = _int(given["port"], "port", 0, 65535) if port_given else DEFAULT_PORT
    if sock and not port_given:
        port = None  # as in katsubushi: --sock alone means unix socket only
    return str(given.get("host", "127.0.0.1")), port, sock


_HOST_NAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")


def _check_host(host: str) -> None:
    """--host must be an IP address or a host name: ``999.1.1.1`` or ``10.0.0.1:80`` is a usage error
    (exit 2), not a failed start. A well-formed name that does not resolve is left to the bind (exit 1:
    DNS may not be up yet, and a restart can fix that)."""
    if not host:
        raise ConfigError("invalid --host '': give an address (0.0.0.0 or :: for every interface)")
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            hint = " (give the port with --port)" if re.fullmatch(r"[^:]+:\d+", host) else ""
            raise ConfigError(f"invalid --host {host!r}: not an IP address{hint}") from None
    elif len(host) > 253 or not _HOST_NAME.fullmatch(host):
        raise ConfigError(f"invalid --host {host!r}: not an IP address or a host name")


def _check_parent_directory(path: str, option: str) -> None:
    """A missing directory is named, so the user knows what to create (and by whom: the daemon's user)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(
            f"{option} {path}: directory {parent} does not exist; create it (mkdir -p {parent})"
            " and make it writable by the daemon's user"
        )


def _worker_id(
    given: dict[str, object], layout: Layout, leasing: bool, from_flag: bool, workers: int = 1
) -> tuple[int | None, str]:
    """The worker id (None: leased from Redis) and where it came from. With ``workers`` processes the
    first of ``workers`` consecutive ids, all checked to fit the layout; derived from a host name
    ordinal k, the ids are k x workers + offset onwards, so that hosts k and k + 1 never overlap."""
    method = str(given.get("worker_id_from") or "").lower()
    if not method:
        for name in ("worker_id_offset", "hostname"):
            if name in given:
                raise ConfigError(f"--{name.replace('_', '-')} needs --worker-id-from ordinal")
    elif method != "ordinal":
        for name in ("worker_id_offset", "hostname"):
            if name in given:
                raise ConfigError(f"--{name.replace('_', '-')} applies to --worker-id-from ordinal only")

    if "worker_id" in given:
        worker_id = _int(given["worker_id"], "worker id", 0)
        if leasing:
            if worker_id != 0:  # go-katsubushi reads 0 as "unset" and then uses -redis
                raise ConfigError("use either --worker-id or --redis, not both")
            if method:
                raise ConfigError(f"use either --worker-id-from {method} or --redis, not both")
            return None, "Redis lease"
        if method:
            raise ConfigError(f"use either --worker-id or --worker-id-from {method}, not both")
        try:
            layout.check_worker_id(worker_id)
        except LayoutError as exc:
            raise ConfigError(f"invalid worker id: {exc}") from None
        _check_worker_range(worker_id, workers, layout, "--worker-id" if from_flag else "WORKER_ID")
        return worker_id, "--worker-id" if from_flag else "WORKER_ID"
    if method:
        if leasing:
            raise ConfigError(f"use either --worker-id-from {method} or --redis, not both")
        if method not in METHODS:
            raise ConfigError(f"invalid worker id method {method!r}: use {' or '.join(METHODS)}")
        offset = _int(given.get("worker_id_offset", 0), "worker id offset", -(1 << 32))
        if workers > 1 and method != "ordinal":
            raise ConfigError(
                f"--worker-id-from {method} gives one worker id per host: with --workers use --worker-id-from"
                " ordinal, --worker-id or --redis"
            )
        try:
            if workers > 1:  # the ordinal itself, then spread: host k takes ids k x workers + offset onwards
                host = str(given.get("hostname") or "") or socket.gethostname()
                ordinal = derive(method, layout, hostname=host, offset=0).worker_id
                first = ordinal * workers + offset
                source = f"hostname {host!r} (ordinal {ordinal} x {workers} worker processes + offset {offset})"
                _check_worker_range(first, workers, layout, f"--worker-id-from ordinal ({source})")
                return first, source
            derived = derive(method, layout, hostname=str(given.get("hostname") or ""), offset=offset)
        except WorkerIdError as exc:
            raise ConfigError(f"--worker-id-from {method}: {exc}") from None
        return derived.worker_id, derived.source
    if leasing:
        return None, "Redis lease"
    raise ConfigError(
        "set --worker-id N (or WORKER_ID), --worker-id-from ordinal|ip, or --redis URL to lease one;"
        " it must differ on every daemon that issues IDs"
    )


def parse_server_config(
    argv: Sequence[str], environ: Mapping[str, str], parser: argparse.ArgumentParser | None = None
) -> tuple[ServerConfig | None, argparse.Namespace]:
    """Parse the serve command line (with ``parser``, the cli's, whose help lists the subcommands).
    Returns (None, args) when only ``--version`` was asked for."""
    args = (parser or build_parser()).parse_args(list(argv))
    if args.version:
        return None, args
    given = merged_settings(args, environ)

    layout = layout_from_args(args)
    lease = _lease_config(given, layout)
    workers = _int(given.get("workers", 1), "workers", 1, MAX_WORKERS)
    worker_id, worker_id_source = _worker_id(given, layout, lease is not None, "worker_id" in vars(args), workers)
    host, port, sock = listen_settings(given)
    _check_host(host)
    if sock:
        _check_parent_directory(sock, "--sock")
    state_file = str(given.get("state_file") or "") or None
    if state_file:
        _check_parent_directory(state_file, "--state-file")

    sock_mode = None
    if "sock_mode" in given:
        if not sock:
            raise ConfigError("--sock-mode needs --sock")
        try:
            sock_mode = int(str(given["sock_mode"]), 8)
        except ValueError:
            raise ConfigError(f"invalid sock mode {given['sock_mode']!r}: use octal such as 0660") from None
        if not 0 <= sock_mode <= 0o777:
            raise ConfigError(f"invalid sock mode {given['sock_mode']!r}: use octal such as 0660")

    idle = parse_duration(str(given.get("idle_timeout", DEFAULT_IDLE_TIMEOUT)), "idle timeout")
    max_wait = parse_duration(str(given.get("max_clock_wait", "1s")), "--max-clock-wait")
    level_name = str(given.get("log_level", "info")).lower()
    if level_name not in LOG_LEVELS:
        raise ConfigError(f"invalid log level {level_name!r}: use debug, info, warn, error")
    max_conn = _int(given.get("max_connections", DEFAULT_MAX_CONNECTIONS), "max connections", 1)
    read_ahead = parse_size(str(given.get("read_ahead", DEFAULT_READ_AHEAD)), "read ahead")
    # As in go-katsubushi, port 0 (the default) means "no such listener".
    http_port = _int(given.get("http_port", 0), "http port", 0, 65535) or None
    grpc_port = _int(given.get("grpc_port", 0), "grpc port", 0, 65535) or None
    if grpc_port is not None and not all(importlib.util.find_spec(m) for m in ("grpc", "grpc_reflection", "h2")):
        raise ConfigError(f"--grpc-port needs the grpc extra: {GRPC_INSTALL_HINT}")
    state_file, state_dir, state_source = _state_config(given, lease is not None, environ)
    tls, plain_port, request_timeout = tls_settings(given, idle)
    if plain_port is not None and plain_port in (port, http_port, grpc_port):
        raise ConfigError(f"--plain-port {plain_port} is already the port of another listener")
    if workers > 1 and state_file:
        raise ConfigError("--state-file is one worker id's file: with --workers use --state-dir (a file per worker id)")

    config = ServerConfig(
        worker_id=worker_id,
        worker_id_source=worker_id_source,
        host=host,
        port=port,
        sock=sock,
        sock_mode=sock_mode,
        idle_timeout=idle,
        max_connections=max_conn,
        read_ahead=read_ahead,
        log_level=LOG_LEVELS[level_name],
        log_format=str(given.get("log_format", "text")),
        state_file=state_file,
        state_dir=state_dir,
        state_dir_source=state_source,
        state_file_new_worker_id=bool(args.state_file_new_worker_id),
        max_clock_wait=max_wait,
        layout=layout,
        loop=str(given.get("loop", "auto")),
        gets_cas=bool(args.gets_cas),
        lease=lease,
        http_port=http_port,
        grpc_port=grpc_port,
        workers=workers,
        tls=tls,
        plain_port=plain_port,
        request_timeout=request_timeout,
        auth=_auth_config(args),
    )
    return config, args


def _check_worker_range(first: int, workers: int, layout: Layout, source: str) -> None:
    """``workers`` consecutive worker ids from ``first`` must all fit the layout."""
    last = first + workers - 1
    if first < 0 or last > layout.max_worker_id:
        raise ConfigError(
            f"{source}: {workers} worker processes need worker ids {first}..{last}, but the layout allows"
            f" 0..{layout.max_worker_id}"
        )


def default_state_dir(environ: Mapping[str, str], euid: int) -> tuple[str, str]:
    """Where state lives when no flag says: (directory, where that came from).

    systemd's ``StateDirectory=`` sets ``$STATE_DIRECTORY`` (a colon-separated list when it names
    several; the first is ours); root uses /var/lib, anyone else the XDG state directory."""
    systemd = environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return systemd, "$STATE_DIRECTORY"
    if euid == 0:
        return f"/var/lib/{APP_DIR}", "default for root"
    xdg = environ.get("XDG_STATE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, APP_DIR), "$XDG_STATE_HOME"
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "state", APP_DIR), "default"


def _state_config(
    given: dict[str, object], leased: bool, environ: Mapping[str, str]
) -> tuple[str | None, str | None, str]:
    """(state file, state directory, source of the directory): exactly one of the first two, or
    neither with --no-state-file."""
    state_file = str(given.get("state_file") or "") or None
    state_dir = str(given.get("state_dir") or "") or None
    if given.get("no_state_file"):
        if state_file or state_dir:
            raise ConfigError("--no-state-file cannot be combined with --state-file or --state-dir")
        return None, None, ""
    if state_file and state_dir:
        raise ConfigError("use either --state-file or --state-dir, not both")
    if state_file:
        if leased:
            raise ConfigError(
                "--state-file is for a static --worker-id; with --redis use --state-dir (a file per leased worker id)"
            )
        return state_file, None, ""
    if state_dir:
        return None, state_dir, "--state-dir or STATE_DIR"
    directory, source = default_state_dir(environ, os.geteuid())
    return None, directory, source


def _lease_config(given: dict[str, object], layout: Layout) -> LeaseConfig | None:
    url = given.get("redis")
    if not url:
        # (--min/--max-worker-id without --redis are ignored, as go-katsubushi ignores them.)
        for name in ("lease_ttl", "lease_renew", "lease_delay", "lease_start_timeout", "lease_free_warn"):
            if name in given:
                raise ConfigError(f"--{name.replace('_', '-')} needs --redis")
        return None
    try:
        target = parse_redis_url(str(url))
    except LeaseError as exc:
        raise ConfigError(str(exc)) from None
    top = layout.max_worker_id
    low = _int(given.get("min_worker_id", 1), "min worker id", 0, top)
    high = _int(given.get("max_worker_id", min(1023, top)), "max worker id", 0, top)
    if low > high:
        raise ConfigError(f"--min-worker-id {low} is greater than --max-worker-id {high}")
    ttl = parse_duration(str(given.get("lease_ttl", "30s")), "lease ttl")
    renew = parse_duration(str(given.get("lease_renew", ttl / 3)), "lease renew interval")
    delay = parse_duration(str(given.get("lease_delay", 2 * renew)), "lease delay")
    timings = LeaseTimings(ttl=ttl, renew=renew, delay=delay)
    try:
        timings.check()
    except LeaseError as exc:
        raise ConfigError(str(exc)) from None
    warn = parse_duration(str(given.get("clock_skew_warn", "0.5s")), "clock skew warning")
    most = parse_duration(str(given.get("clock_skew_max", "5s")), "clock skew maximum")
    if warn > most:
        raise ConfigError("--clock-skew-warn must not exceed --clock-skew-max")
    start_timeout = parse_duration(str(given.get("lease_start_timeout", "60s")), "lease start timeout")
    try:
        free_warn = float(str(given.get("lease_free_warn", "5")).strip().rstrip("%"))
    except ValueError:
        raise ConfigError(f"invalid --lease-free-warn {given['lease_free_warn']!r}: a percentage such as 5") from None
    if not 0 <= free_warn <= 100:
        raise ConfigError(f"invalid --lease-free-warn {free_warn:g}: must be 0..100")
    return LeaseConfig(
        target=target,
        min_worker_id=low,
        max_worker_id=high,
        timings=timings,
        wait_for_free_id=not given.get("no_wait_for_lease", False),
        clock_skew_warn=warn,
        clock_skew_max=most,
        start_timeout=start_timeout,
        free_warn=free_warn / 100,
    )

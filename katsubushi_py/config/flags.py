"""The daemon's command line: every flag, in go-katsubushi's spellings too (``-worker-id 7``), and the
environment variables read for the flags not given. Only parsing; what the values mean is checked in
:mod:`.server`, :mod:`.network` and :mod:`.identity`."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ..daemon.tls import VERIFY_MODES
from ..ids.layout import KATSUBUSHI_EPOCH_MS, Layout, LayoutError
from ..ids.tools import ToolError, parse_epoch
from ..worker_ids import METHODS
from .values import DEFAULT_MAX_CONNECTIONS, DEFAULT_PORT, ConfigError, env_value

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


class OneLineParser(argparse.ArgumentParser):
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
    parser = OneLineParser(
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
        help=f"refuse connections beyond this many, TLS handshakes in progress included (default"
        f" {DEFAULT_MAX_CONNECTIONS})",
    )
    _flag(
        parser,
        "max-unauthenticated",
        metavar="N",
        help="of --max-connections, at most this many TLS handshakes in progress and connections not yet"
        " logged in (--auth-file), so that they cannot push out clients that have (default: half of"
        " --max-connections)",
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
        help="close a connection that has not authenticated this long after it opened: with --auth-file a"
        " memcached one not logged in, with --token-file an HTTP or gRPC one with no request carrying a"
        " good token yet (default 10s)",
    )
    auth.add_argument(
        "--metrics-no-auth",
        action="store_true",
        default=False,
        help="with --token-file, serve /metrics without a token (for a Prometheus without credentials)",
    )


def merged_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, object]:
    """The flags given, plus the environment variables of those not given (a flag wins)."""
    given = dict(vars(args))
    for name in ENV_FLAGS + OUR_ENV_FLAGS:
        if name not in given:
            value = env_value(environ, name)
            if value is not None:
                given[name] = value
    return given

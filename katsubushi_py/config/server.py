"""The daemon's whole configuration (:class:`ServerConfig`) from its command line and environment: the
one place every setting is checked, so that a bad one is one line and exit status 2 before anything
listens. Nothing here opens a socket."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..auth.credentials import AuthConfig
from ..daemon.tls import TlsConfig
from ..ids.layout import DEFAULT_LAYOUT, Layout
from .flags import GRPC_INSTALL_HINT, MAX_WORKERS, build_parser, layout_from_args, merged_settings
from .identity import LeaseConfig, lease_config, state_config, worker_id_setting
from .network import auth_config, check_host, check_parent_directory, listen_settings, tls_settings
from .values import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PORT,
    DEFAULT_READ_AHEAD,
    DEFAULT_REQUEST_TIMEOUT,
    LOG_LEVELS,
    ConfigError,
    bounded_int,
    parse_duration,
    parse_size,
)


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
    max_unauthenticated: int = 0  # TLS handshakes and connections not logged in; 0: half of max_connections
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
    lease = lease_config(given, layout)
    workers = bounded_int(given.get("workers", 1), "workers", 1, MAX_WORKERS)
    worker_id, worker_id_source = worker_id_setting(
        given, layout, lease is not None, "worker_id" in vars(args), workers
    )
    host, port, sock = listen_settings(given)
    check_host(host)
    if sock:
        check_parent_directory(sock, "--sock")
    state_file = str(given.get("state_file") or "") or None
    if state_file:
        check_parent_directory(state_file, "--state-file")

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
    max_conn = bounded_int(given.get("max_connections", DEFAULT_MAX_CONNECTIONS), "max connections", 1)
    max_unauth = bounded_int(given.get("max_unauthenticated", max(1, max_conn // 2)), "--max-unauthenticated", 1)
    if max_unauth > max_conn:
        raise ConfigError(f"--max-unauthenticated {max_unauth} is more than --max-connections {max_conn}")
    read_ahead = parse_size(str(given.get("read_ahead", DEFAULT_READ_AHEAD)), "read ahead")
    # As in go-katsubushi, port 0 (the default) means "no such listener".
    http_port = bounded_int(given.get("http_port", 0), "http port", 0, 65535) or None
    grpc_port = bounded_int(given.get("grpc_port", 0), "grpc port", 0, 65535) or None
    if grpc_port is not None and not all(importlib.util.find_spec(m) for m in ("grpc", "grpc_reflection", "h2")):
        raise ConfigError(f"--grpc-port needs the grpc extra: {GRPC_INSTALL_HINT}")
    state_file, state_dir, state_source = state_config(given, lease is not None, environ)
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
        max_unauthenticated=max_unauth,
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
        auth=auth_config(args),
    )
    return config, args

"""The daemon's configuration: command line, environment, validation. Nothing here opens a socket.

go-katsubushi's spellings work unchanged (``-worker-id 7 -port 11212 -idle-timeout 10m``, and the
environment variables ``WORKER_ID``, ``PORT``, ``SOCK``, ``IDLE_TIMEOUT``, ``LOG_LEVEL`` in upper or
lower case); a flag wins over the environment. Every problem becomes one :class:`ConfigError` line.
The worker id comes from exactly one place: ``--worker-id``, ``--worker-id-from`` (see
:mod:`katsubushi_py.worker_ids`) or a Redis lease.

By concern: :mod:`.flags` (the command line), :mod:`.network` (listeners, TLS, credentials),
:mod:`.identity` (worker id, leases, state files), :mod:`.server` (:class:`ServerConfig`, checked as a
whole), :mod:`.values` (defaults and the parsers of durations and sizes).
"""

from .flags import (
    ENV_FLAGS,
    GRPC_INSTALL_HINT,
    LOOPS,
    MAX_WORKERS,
    OUR_ENV_FLAGS,
    OneLineParser,
    add_auth_options,
    add_layout_options,
    add_tls_options,
    build_parser,
    layout_from_args,
    merged_settings,
)
from .identity import APP_DIR, LeaseConfig, default_state_dir
from .network import listen_settings, tls_settings
from .server import ServerConfig, parse_server_config
from .values import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_PORT,
    DEFAULT_READ_AHEAD,
    DEFAULT_REQUEST_TIMEOUT,
    LOG_LEVELS,
    ConfigError,
    parse_duration,
    parse_size,
)

__all__ = [
    "APP_DIR",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_PORT",
    "DEFAULT_READ_AHEAD",
    "DEFAULT_REQUEST_TIMEOUT",
    "ENV_FLAGS",
    "GRPC_INSTALL_HINT",
    "LOG_LEVELS",
    "LOOPS",
    "MAX_WORKERS",
    "OUR_ENV_FLAGS",
    "ConfigError",
    "LeaseConfig",
    "OneLineParser",
    "ServerConfig",
    "add_auth_options",
    "add_layout_options",
    "add_tls_options",
    "build_parser",
    "default_state_dir",
    "layout_from_args",
    "listen_settings",
    "merged_settings",
    "parse_duration",
    "parse_server_config",
    "parse_size",
    "tls_settings",
]

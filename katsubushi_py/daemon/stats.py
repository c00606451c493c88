"""The daemon's connection counters, and the fields every STATS-like reply shows.

The first nine fields are go-katsubushi's, in its order and with its meanings, because Mackerel and
Prometheus exporters written for it parse them: ``cmd_get`` counts ID requests (GET/GETS commands and
their equivalents in the other protocols), ``get_hits`` IDs issued, ``get_misses`` requests that failed
to issue. Connections are counted over every listener, as go-katsubushi does. Our own fields follow.

``stats settings`` shows the configuration (:func:`settings_fields`), with memcached's names where
memcached has the same setting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..compiled import IMPLEMENTATION
from ..ids.layout import format_time
from ..issuing.issuer import Issuer
from .sockets import TLS_DIRECT

if TYPE_CHECKING:
    from ..config import ServerConfig


class Stats:
    """Plain counters: the event loop is single-threaded, so no locking is needed."""

    __slots__ = (
        "auth",
        "curr_connections",
        "extra",
        "idle_timeout",
        "issuer",
        "max_connections",
        "pid",
        "processes",
        "rejected_connections",
        "started",
        "total_connections",
        "version",
    )

    def __init__(self, issuer: Issuer, max_connections: int = 0, idle_timeout: float = 0.0) -> None:
        self.issuer = issuer
        self.pid = os.getpid()
        self.started = time.monotonic()
        self.version = issuer.version
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.curr_connections = 0
        self.total_connections = 0
        self.rejected_connections = 0
        # More fields from elsewhere, appended after ours: the Redis lease, then (--workers) the
        # summary over every worker process.
        self.extra: Callable[[], list[tuple[str, object]]] | None = None
        # With --auth-file or --token-file: memcached's auth_cmds and auth_errors, and ours.
        self.auth: Callable[[], list[tuple[str, object]]] | None = None
        self.processes: Callable[[], list[tuple[str, object]]] | None = None

    def fields(self) -> list[tuple[str, object]]:
        generator = self.issuer.generator
        layout = generator.layout
        cmd_get, get_hits, get_misses = self.issuer.totals()
        return [
            # go-katsubushi's nine, in its order.
            ("pid", self.pid),
            ("uptime", int(time.monotonic() - self.started)),
            ("time", int(time.time())),
            ("version", self.version),
            ("curr_connections", self.curr_connections),
            ("total_connections", self.total_connections),
            ("cmd_get", cmd_get),
            ("get_hits", get_hits),
            ("get_misses", get_misses),
            # ours
            ("worker_id", generator.worker_id),
            ("layout", layout.describe()),
            ("epoch_ms", layout.epoch_ms),
            ("id_lifetime_end", format_time(layout.lifetime_end)),
            ("clock_drift_ms", generator.drift_ms()),
            ("clock_backwards_events", generator.clock_backwards_events),
            ("sequence_overflow_waits", generator.sequence_overflow_waits),
            ("last_issued_ms", generator.last_issued_ms or 0),
            ("state_file_high_water_ms", generator.high_water_ms or 0),
            ("max_connections", self.max_connections),
            ("rejected_connections", self.rejected_connections),
            ("idle_timeout", int(self.idle_timeout)),
            ("implementation", IMPLEMENTATION),  # "compiled" or "python": which hot path runs
            *(self.auth() if self.auth is not None else ()),
            *(self.extra() if self.extra is not None else ()),
            *(self.processes() if self.processes is not None else ()),
        ]


def settings_fields(config: ServerConfig, state_path: str | None = None) -> list[tuple[str, object]]:
    """The daemon's settings for ``stats settings``: memcached's names first (``maxconns``,
    ``tcpport``, ``inter``, ``domain_socket``, ``idle_timeout``, the TLS and auth settings of
    :func:`security_settings`), then ours. Values have no spaces.
    ``state_path``: the state file in use now (in the state directory, or --state-file's)."""
    fields: list[tuple[str, object]] = [
        ("maxconns", config.max_connections),
        ("tcpport", config.port if config.port is not None else 0),
        ("inter", config.host if config.port is not None else "NULL"),
        ("domain_socket", config.sock or "NULL"),
        ("sock_mode", f"{config.sock_mode:o}" if config.sock_mode is not None else "NULL"),
        ("idle_timeout", int(config.idle_timeout)),
        *security_settings(config),
        ("layout", config.layout.describe()),
        ("epoch_ms", config.layout.epoch_ms),
        ("state_file", state_path or config.state_file or "NULL"),
        ("state_dir", config.state_dir or "NULL"),
        ("max_clock_wait", config.max_clock_wait),
        ("gets_cas", "yes" if config.gets_cas else "no"),
        ("read_ahead", config.read_ahead),
        ("event_loop", config.loop),
        ("log_level", config.log_level.lower()),
        ("worker_id_lease", "redis" if config.lease is not None else "no"),
    ]
    if config.lease is not None:
        fields += [
            ("lease_namespace", config.lease.target.namespace),
            ("lease_min_worker_id", config.lease.min_worker_id),
            ("lease_max_worker_id", config.lease.max_worker_id),
        ]
    return fields


#: memcached's ``ssl_verify_mode`` numbers (0 none, 1 request, 2 require; its 3, "once", we lack).
_VERIFY_MODES = {"none": 0, "request": 1, "require": 2}


def security_settings(config: ServerConfig) -> list[tuple[str, object]]:
    """TLS and authentication in ``stats settings``, under memcached 1.6's names and in its formats,
    shown whether they are on or off as memcached shows them (checked against Debian's memcached
    1.6.18 in tests/test_stats_settings.py): ``auth_enabled_sasl`` yes/no, ``auth_enabled_ascii`` the
    auth file or ``no``, ``ssl_enabled`` yes/no, the files as given (``(null)`` for an unset chain
    or key and ``NULL`` for an unset CA or cipher list, memcached's spellings), ``ssl_verify_mode``
    0-2, ``ssl_keyformat`` 1 (PEM, the only format read), ``ssl_min_version`` ``tlsv1.2`` or
    ``tlsv1.3``. memcached's ``ssl_wbuf_size``, ``ssl_session_cache`` and ``ssl_kernel_tls`` are left
    out: no such setting here. Then ours: the token file, ``metrics_no_auth``, ``login_timeout``,
    ``plain_port``, ``request_timeout`` and ``tls_openssl_direct`` (``yes`` when TLS is on and the
    compiled core calls OpenSSL directly, see ``_tls_direct.h``)."""
    tls, auth = config.tls, config.auth
    users = auth.auth_file if auth is not None else None
    tokens = auth.token_file if auth is not None else None
    return [
        ("auth_enabled_sasl", "yes" if users else "no"),  # SASL PLAIN on the binary protocol
        ("auth_enabled_ascii", users or "no"),  # memcached shows its -Y file here
        ("ssl_enabled", "yes" if tls is not None else "no"),
        ("ssl_chain_cert", tls.cert if tls is not None else "(null)"),
        ("ssl_key", (tls.key if tls is not None else None) or "(null)"),
        ("ssl_verify_mode", _VERIFY_MODES.get(tls.verify, 0) if tls is not None else 0),
        ("ssl_keyformat", 1),
        ("ssl_ciphers", (tls.ciphers if tls is not None else None) or "NULL"),
        ("ssl_ca_cert", (tls.ca if tls is not None else None) or "NULL"),
        ("ssl_min_version", "tlsv" + (tls.min_version if tls is not None else "1.2")),
        ("auth_token_file", tokens or "NULL"),
        ("metrics_no_auth", "yes" if auth is not None and auth.metrics_no_auth else "no"),
        ("login_timeout", f"{auth.login_timeout:g}" if auth is not None and (users or tokens) else 0),
        ("plain_port", config.plain_port if config.plain_port is not None else 0),
        ("request_timeout", f"{config.request_timeout:g}"),
        ("tls_openssl_direct", "yes" if tls is not None and TLS_DIRECT else "no"),
    ]

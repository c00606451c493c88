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
    ``tcpport``, ``inter``, ``domain_socket``, ``idle_timeout``), then ours. Values have no spaces.
    ``state_path``: the state file in use now (in the state directory, or --state-file's)."""
    fields: list[tuple[str, object]] = [
        ("maxconns", config.max_connections),
        ("tcpport", config.port if config.port is not None else 0),
        ("inter", config.host if config.port is not None else "NULL"),
        ("domain_socket", config.sock or "NULL"),
        ("sock_mode", f"{config.sock_mode:o}" if config.sock_mode is not None else "NULL"),
        ("idle_timeout", int(config.idle_timeout)),
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

"""Counters shared by every connection, and the STATS reply.

The first nine fields are go-katsubushi's, in its order and with its meanings, because Mackerel and
Prometheus exporters written for it parse them: ``cmd_get`` counts GET/GETS commands, ``get_hits`` IDs
issued, ``get_misses`` commands that failed to issue. Our own fields follow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from .generator import Generator
from .layout import format_time


class Stats:
    """Plain counters: the event loop is single-threaded, so no locking is needed."""

    __slots__ = (
        "cmd_get",
        "curr_connections",
        "extra",
        "get_hits",
        "get_misses",
        "idle_timeout",
        "max_connections",
        "pid",
        "rejected_connections",
        "started",
        "total_connections",
        "version",
    )

    def __init__(self, version: str, max_connections: int = 0, idle_timeout: float = 0.0) -> None:
        self.pid = os.getpid()
        self.started = time.monotonic()
        self.version = version
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.curr_connections = 0
        self.total_connections = 0
        self.rejected_connections = 0
        self.cmd_get = 0
        self.get_hits = 0
        self.get_misses = 0
        # More fields from elsewhere (the Redis lease), appended after ours.
        self.extra: Callable[[], list[tuple[str, object]]] | None = None

    def fields(self, generator: Generator) -> list[tuple[str, object]]:
        layout = generator.layout
        return [
            # go-katsubushi's nine, in its order.
            ("pid", self.pid),
            ("uptime", int(time.monotonic() - self.started)),
            ("time", int(time.time())),
            ("version", self.version),
            ("curr_connections", self.curr_connections),
            ("total_connections", self.total_connections),
            ("cmd_get", self.cmd_get),
            ("get_hits", self.get_hits),
            ("get_misses", self.get_misses),
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
            *(self.extra() if self.extra is not None else ()),
        ]

    def render(self, generator: Generator) -> bytes:
        lines = [f"STAT {name} {value}\r\n" for name, value in self.fields(generator)]
        lines.append("END\r\n")
        return "".join(lines).encode()

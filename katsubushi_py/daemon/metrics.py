"""Prometheus metrics for ``GET /metrics``, read from the daemon's own counters at scrape time.

Nothing here runs per request: the issuing paths keep bumping the plain counters they already keep
(:class:`~katsubushi_py.issuing.issuer.Counters` per protocol, :class:`~.stats.Stats` for
connections, the generator's clock counters, the lease keeper's fields), and :class:`DaemonCollector`
turns them into metric families when Prometheus asks. The registry is the daemon's own (not
prometheus-client's global one), with the library's process, platform and garbage-collector
collectors beside ours.

Metric names start with ``katsubushi_``; times are in seconds, as Prometheus conventions ask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..issuing.errors import GenerationError
from ..issuing.issuer import Issuer
from .stats import Stats

#: Why a request can fail (the ``reason`` of every GenerationError, and ``internal``): each is exported
#: from the start with 0, so an alert on its rate needs no series to appear first.
FAILURE_REASONS = tuple(sorted({cls.reason for cls in GenerationError.__subclasses__()} | {"internal"}))

#: The lease keeper's states (``lease_state`` in STATS).
LEASE_STATES = ("connecting", "waiting", "recovering", "delay", "held", "unconfirmed")


class DaemonCollector(Collector):
    """The daemon's state as metric families, built at each scrape."""

    def __init__(self, stats: Stats, issuer: Issuer, protocols: tuple[str, ...] = ("text",)) -> None:
        self._stats = stats
        self._issuer = issuer
        for protocol in protocols:  # every served protocol has its series from the start
            issuer.counters(protocol)

    def collect(self) -> Iterator[Metric]:
        stats, issuer = self._stats, self._issuer
        generator = issuer.generator

        requests = CounterMetricFamily(
            "katsubushi_requests", "Requests for IDs (GET commands, /id and /ids, Fetch calls)", labels=["protocol"]
        )
        issued = CounterMetricFamily("katsubushi_ids_issued", "IDs issued", labels=["protocol"])
        failures = CounterMetricFamily(
            "katsubushi_failures", "Requests that got no ID, by reason", labels=["protocol", "reason"]
        )
        for counters in issuer.all_counters():
            requests.add_metric([counters.protocol], counters.commands)
            issued.add_metric([counters.protocol], counters.ids)
            reasons = dict.fromkeys(FAILURE_REASONS, 0)
            reasons.update(counters.failures)
            for reason, count in sorted(reasons.items()):
                failures.add_metric([counters.protocol, reason], count)
        yield requests
        yield issued
        yield failures

        yield GaugeMetricFamily(
            "katsubushi_connections", "Open client connections (memcached and HTTP)", value=stats.curr_connections
        )
        yield CounterMetricFamily(
            "katsubushi_connections_accepted", "Client connections accepted", value=stats.total_connections
        )
        yield CounterMetricFamily(
            "katsubushi_connections_rejected",
            "Connections refused over --max-connections or while stopping",
            value=stats.rejected_connections,
        )
        yield GaugeMetricFamily("katsubushi_connections_max", "--max-connections", value=stats.max_connections)

        yield CounterMetricFamily(
            "katsubushi_clock_backwards_events",
            "Times the clock was found behind the last issued millisecond",
            value=generator.clock_backwards_events,
        )
        yield CounterMetricFamily(
            "katsubushi_sequence_overflow_waits",
            "Times a millisecond's sequence numbers ran out and issuing waited for the next",
            value=generator.sequence_overflow_waits,
        )
        yield GaugeMetricFamily(
            "katsubushi_clock_drift_seconds",
            "Wall clock minus the daemon's monotonic-anchored clock",
            value=generator.drift_ms() / 1000,
        )
        yield GaugeMetricFamily(
            "katsubushi_last_issued_timestamp_seconds",
            "Unix time of the latest millisecond IDs were issued in (0 before the first)",
            value=(generator.last_issued_ms or 0) / 1000,
        )
        yield GaugeMetricFamily(
            "katsubushi_state_file_high_water_timestamp_seconds",
            "Unix time of the state file's mark: no ID is issued above it before it is moved (0 without)",
            value=(generator.high_water_ms or 0) / 1000,
        )
        yield GaugeMetricFamily("katsubushi_worker_id", "The worker id IDs are issued under", value=generator.worker_id)
        info = GaugeMetricFamily(
            "katsubushi_build_info", "Version and ID layout", labels=["version", "layout", "epoch_ms"]
        )
        info.add_metric([issuer.version, generator.layout.describe(), str(generator.layout.epoch_ms)], 1)
        yield info
        yield GaugeMetricFamily(
            "katsubushi_id_lifetime_end_timestamp_seconds",
            "Unix time when the layout's time bits run out: no ID can be issued from then on",
            value=generator.layout.lifetime_end_ms / 1000,
        )
        yield GaugeMetricFamily(
            "katsubushi_can_issue",
            "1 when an ID can be issued now (what /healthz answers 200 for), else 0",
            value=1 if issuer.health() is None else 0,
        )

        if stats.extra is not None:
            yield from _lease_metrics(dict(stats.extra()))


def _lease_metrics(fields: dict[str, object]) -> Iterator[Metric]:
    """The Redis lease's fields, as STATS shows them (``lease_*``, ``worker_id_changes``)."""
    state = GaugeMetricFamily("katsubushi_lease_state", "1 for the lease's current state", labels=["state"])
    current = str(fields.get("lease_state", ""))
    for name in sorted({*LEASE_STATES, current} - {""}):
        state.add_metric([name], 1 if name == current else 0)
    yield state
    yield GaugeMetricFamily(
        "katsubushi_lease_time_left_seconds",
        "Time until the daemon stops issuing unless a renew succeeds",
        value=_number(fields.get("lease_time_left_ms")) / 1000,
    )
    yield CounterMetricFamily(
        "katsubushi_lease_renewals", "Successful lease renewals", value=_number(fields.get("lease_renewals"))
    )
    yield CounterMetricFamily(
        "katsubushi_lease_renew_failures", "Failed lease renewals", value=_number(fields.get("lease_renew_failures"))
    )
    yield CounterMetricFamily(
        "katsubushi_worker_id_changes",
        "Times the lease was lost and another worker id leased",
        value=_number(fields.get("worker_id_changes")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_data_loss_events",
        "Losses of lease data this daemon saw in Redis (a pool or record forgotten or damaged)",
        value=_number(fields.get("lease_data_loss_events")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_lost_writes",
        "Of those, proof that Redis lost lease writes under live holders (a rollback of its data in place)",
        value=_number(fields.get("lease_lost_writes")),
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_wait_seconds",
        "How long the daemon has been waiting for a worker id lease (0 while it holds one)",
        value=_number(fields.get("lease_wait_ms")) / 1000,
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_pool_ids", "Worker ids in the Redis pool", value=_number(fields.get("lease_pool_ids"))
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_pool_free_ids",
        "Worker ids of the pool free at the last renew",
        value=_number(fields.get("lease_pool_free")),
    )
    # Restarts and failovers of Redis, quarantines and Redis's clock (issue 21).
    yield CounterMetricFamily(
        "katsubushi_lease_redis_changes",
        "Restarts or failovers of Redis this daemon learned of (the pool's Redis run_id or master_replid changed)",
        value=_number(fields.get("lease_redis_changes")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_kept_through_change",
        "Times this daemon's lease was kept through a Redis restart or failover (its record intact)",
        value=_number(fields.get("lease_kept_through_change")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_quarantined_ids",
        "Worker ids this daemon quarantined in Redis (never released, damaged, in doubt, state file conflicts)",
        value=_number(fields.get("lease_quarantined_ids")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_skipped_live_leases",
        "Leases expired by Redis's clock that this daemon left to their holder (its mark still ahead)",
        value=_number(fields.get("lease_skipped_live_leases")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_redis_clock_steps",
        "Jumps of Redis's clock against this host's, seen across renews",
        value=_number(fields.get("lease_redis_clock_steps")),
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_redis_clock_offset_seconds",
        "Redis TIME minus this host's clock, at the last renew",
        value=_number(fields.get("lease_redis_clock_offset_ms")) / 1000,
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_pool_mark_ahead_seconds",
        "How far the pool's high-water mark is ahead of this holder's clock plus the lease ttl (a daemon's clock off)",
        value=_number(fields.get("lease_pool_mark_ahead_ms")) / 1000,
    )
    # Following the master through a Sentinel or Cluster failover, and the replica wait (issue 24).
    yield CounterMetricFamily(
        "katsubushi_lease_master_changes",
        "Times the pool's Redis master moved to another address (a Sentinel or Cluster failover) and was followed",
        value=_number(fields.get("lease_master_changes")),
    )
    since = _number(fields.get("lease_since_renew_ms"))
    yield GaugeMetricFamily(
        "katsubushi_lease_since_renew_seconds",
        "Time since the last confirmed lease renew (-1 before the first): how long the daemon has been without Redis",
        value=since / 1000 if since >= 0 else -1.0,
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_longest_renew_gap_seconds",
        "Longest time between two confirmed renews under the current lease",
        value=_number(fields.get("lease_longest_renew_gap_ms")) / 1000,
    )
    yield CounterMetricFamily(
        "katsubushi_lease_renew_outages",
        "Stretches of failed renews that ended with a confirmed renew (Redis back, or a new master followed)",
        value=_number(fields.get("lease_renew_outages")),
    )
    yield GaugeMetricFamily(
        "katsubushi_lease_replicas_expected",
        "Replicas every lease write must reach (replica_acks, else min-replicas-to-write, else the most the master"
        " has had since it started or was promoted)",
        value=_number(fields.get("lease_replicas_expected")),
    )
    yield CounterMetricFamily(
        "katsubushi_lease_replica_ack_failures",
        "Lease writes that not every expected replica acknowledged in time (not counted as renewed or acquired)",
        value=_number(fields.get("lease_replica_ack_failures")),
    )
    yield from _redis_settings(fields)


def _redis_settings(fields: dict[str, object]) -> Iterator[Metric]:
    """What the last check of Redis's settings found (issue 32; leasing/settings.py): read at start,
    every minute, after the master changed and after a failed lease write."""
    for name, text in (
        (
            "settings_unsafe",
            "Unsafe Redis settings found at the last check (min-replicas-to-write 0 beside replicas, allkeys-*"
            " eviction) that the URL does not accept",
        ),
        ("settings_unreadable", "1 when CONFIG GET is refused (renamed, ACL): Redis's settings cannot be checked"),
        ("min_replicas_to_write", "The master's min-replicas-to-write (-1: not known)"),
        ("replicas_connected", "Replicas connected to the master at the last check"),
        (
            "replicas_good",
            "Replicas the master counts for min-replicas-to-write (lagging less than min-replicas-max-lag)",
        ),
    ):
        yield GaugeMetricFamily(
            f"katsubushi_lease_redis_{name}", text, value=_number(fields.get(f"lease_redis_{name}"))
        )


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def make_registry(stats: Stats, issuer: Issuer, protocols: tuple[str, ...]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(stats, issuer, protocols))
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def metrics_renderer(registry: CollectorRegistry) -> Callable[[bytes], tuple[bytes, bytes]]:
    """(Accept header) -> (exposition, content type): the Prometheus text format, or OpenMetrics when
    the scraper asks for it."""

    def render(accept: bytes) -> tuple[bytes, bytes]:
        encoder, content_type = choose_encoder(accept.decode("latin-1"))
        return encoder(registry), content_type.encode()

    return render

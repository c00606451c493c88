"""Which worker id the daemon issues under and where its state lives: ``--worker-id``, one derived
from the host (``--worker-id-from``), or leases from Redis (:class:`LeaseConfig`); the state directory
or file that keeps a restart from reissuing IDs."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..ids.layout import Layout, LayoutError
from ..leasing import LeaseError, LeaseTimings, RedisTarget, parse_redis_url
from ..worker_ids import METHODS, WorkerIdError, derive
from .values import ConfigError, bounded_int, parse_duration

APP_DIR = "katsubushi-py"


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


def worker_id_setting(
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
        worker_id = bounded_int(given["worker_id"], "worker id", 0)
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
        check_worker_range(worker_id, workers, layout, "--worker-id" if from_flag else "WORKER_ID")
        return worker_id, "--worker-id" if from_flag else "WORKER_ID"
    if method:
        if leasing:
            raise ConfigError(f"use either --worker-id-from {method} or --redis, not both")
        if method not in METHODS:
            raise ConfigError(f"invalid worker id method {method!r}: use {' or '.join(METHODS)}")
        offset = bounded_int(given.get("worker_id_offset", 0), "worker id offset", -(1 << 32))
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
                check_worker_range(first, workers, layout, f"--worker-id-from ordinal ({source})")
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


def check_worker_range(first: int, workers: int, layout: Layout, source: str) -> None:
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


def state_config(
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


def lease_config(given: dict[str, object], layout: Layout) -> LeaseConfig | None:
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
    low = bounded_int(given.get("min_worker_id", 1), "min worker id", 0, top)
    high = bounded_int(given.get("max_worker_id", min(1023, top)), "max worker id", 0, top)
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

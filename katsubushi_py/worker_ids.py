"""Worker ids derived from where the daemon runs, for deployments without Redis.

Two daemons issuing under the same worker id produce the same IDs (each starts every millisecond at
sequence 0), and nothing detects it. So each method here refuses anything ambiguous rather than
guessing, and returns a description of where the id came from for the daemon's log:

- ``ordinal``: the number after the last ``-`` of the host name's first label, as a Kubernetes
  StatefulSet names its pods (``katsubushi-3`` -> 3), plus an offset. Only a whole ``-N`` segment
  counts: a Deployment's random pod suffix (``-x9k2b``) or a name like ``web03`` is refused, not read
  as a number, and so is EC2's ``ip-10-0-1-23`` (its last octet is not unique across subnets).
- ``ip``: the low worker-bits bits of the IPv4 address the host uses for its default route, as
  Sonyflake does. Unique only while no two daemons' addresses agree in those bits (all hosts in one
  /22 for 10 bits); the README says so next to the option.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from .ids.layout import Layout

METHODS = ("ordinal", "ip")

# Where ``--worker-id-from ip`` pretends to send: a TEST-NET-2 address (RFC 5737), routed like any
# other outside address by the default route. Connecting a UDP socket only asks the kernel for a
# route and a source address; no packet is sent.
_ROUTE_PROBE = ("198.51.100.1", 9)

_ORDINAL = re.compile(r"-(\d+)$")
_EC2_NAME = re.compile(r"ip-\d+-\d+-\d+-\d+")


class WorkerIdError(ValueError):
    """No safe worker id can be derived; the message says why and what to use instead."""


@dataclass(frozen=True)
class DerivedWorkerId:
    worker_id: int
    source: str  # for the log: "hostname 'katsubushi-3' (ordinal 3 + offset 0)"


def _check_range(worker_id: int, layout: Layout, what: str) -> int:
    if not 0 <= worker_id <= layout.max_worker_id:
        raise WorkerIdError(
            f"{what} = {worker_id} is out of range 0..{layout.max_worker_id} ({layout.worker_bits} worker bits)"
        )
    return worker_id


def from_ordinal(hostname: str, offset: int, layout: Layout) -> DerivedWorkerId:
    """Worker id = the trailing ``-N`` of the host name's first label, plus ``offset``."""
    label = hostname.strip().split(".", 1)[0]
    if _EC2_NAME.fullmatch(label):
        raise WorkerIdError(
            f"hostname {hostname!r} is an address, not an ordinal (its last number repeats across subnets);"
            " use --worker-id-from ip, --worker-id or --redis"
        )
    match = _ORDINAL.search(label)
    if match is None:
        raise WorkerIdError(
            f"hostname {hostname!r} has no trailing number '-N' (a StatefulSet pod is named NAME-N);"
            " use --worker-id or --redis, or --hostname to name the host"
        )
    ordinal = int(match.group(1))
    worker_id = _check_range(ordinal + offset, layout, f"ordinal {ordinal} of hostname {hostname!r} + offset {offset}")
    return DerivedWorkerId(worker_id, f"hostname {hostname!r} (ordinal {ordinal} + offset {offset})")


def from_ipv4(address: str, layout: Layout, how: str = "given") -> DerivedWorkerId:
    """Worker id = the low ``layout.worker_bits`` bits of an IPv4 address (Sonyflake's choice)."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        raise WorkerIdError(f"{address!r} is not an IPv4 address") from None
    if ip.is_loopback or ip.is_unspecified:
        raise WorkerIdError(f"the host's IPv4 address is {ip}, which every host has; use --worker-id or --redis")
    bits = min(layout.worker_bits, 32)
    worker_id = int(ip) & ((1 << bits) - 1)
    return DerivedWorkerId(worker_id, f"IPv4 address {ip} ({how}): its low {bits} bits")


def default_route_ipv4() -> str:
    """The source address the kernel picks for the default IPv4 route.

    Not ``gethostbyname(gethostname())``: on Debian and Ubuntu that is 127.0.1.1 from /etc/hosts.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(_ROUTE_PROBE)
        except OSError as exc:
            raise WorkerIdError(
                f"no IPv4 default route ({exc.strerror or exc}), so no address to take a worker id from"
                " (a host with only loopback?); use --worker-id or --redis"
            ) from None
        return str(probe.getsockname()[0])


def derive(method: str, layout: Layout, *, hostname: str | None = None, offset: int = 0) -> DerivedWorkerId:
    """The worker id for ``--worker-id-from METHOD``; raises :class:`WorkerIdError`."""
    if method == "ordinal":
        return from_ordinal(hostname if hostname else socket.gethostname(), offset, layout)
    if method == "ip":
        return from_ipv4(default_route_ipv4(), layout, "source of the default route")
    raise WorkerIdError(f"unknown --worker-id-from {method!r}: use {' or '.join(METHODS)}")

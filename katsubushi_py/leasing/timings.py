"""A lease's timings and the waits derived from them, with the small pieces every part of the keeper
shares (retry backoff, owner tokens, pool epochs).

Every daemon of a namespace must use the same ttl and clock skew: a daemon that sees a loss waits out
*its own* ttl and skew, which must cover every other daemon's.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
from dataclasses import dataclass

from .target import LeaseError


@dataclass(frozen=True)
class LeaseTimings:
    ttl: float = 30.0
    renew: float = 10.0
    delay: float = 20.0

    @property
    def margin(self) -> float:
        """How long before the Redis-side expiry we stop issuing: covers scheduling delays and clock
        rate differences, not clock offsets (Redis's clock alone decides expiry)."""
        return max(0.1, self.ttl / 10)

    def check(self) -> None:
        if self.ttl < 1:
            raise LeaseError("--lease-ttl must be at least 1s")
        if self.renew <= 0 or self.renew > self.ttl / 2:
            raise LeaseError(
                f"--lease-renew {self.renew:g}s is unsafe with --lease-ttl {self.ttl:g}s: renew at least twice"
                " per ttl (the default is a third of it)"
            )
        if self.renew >= self.ttl - self.margin:
            raise LeaseError("--lease-renew must be shorter than the ttl minus its safety margin")
        if self.delay < 2 * self.renew:
            raise LeaseError(f"--lease-delay {self.delay:g}s must be at least twice --lease-renew ({self.renew:g}s)")

    def recovery_wait(self, skew_max: float) -> float:
        """After a loss, how long nobody serves what is in doubt: every earlier holder's lease has run
        out (one ttl from its last renew, which came before the loss was seen) and its last ID is below
        any new holder's clock (the allowed skew, on both sides)."""
        return self.ttl + 2 * skew_max

    def unreleased_wait(self, skew_max: float) -> float:
        """How long an id whose lease ended without a release is leased to nobody, from when a daemon
        finds it: its holder may be alive and its record wrong, so the same wait as after a loss, or
        ``--lease-delay`` if that is longer."""
        return max(self.recovery_wait(skew_max), self.delay)


class Backoff:
    """Exponential backoff with jitter: first, 2 x first, 4 x first, ... up to ``cap``, each scaled
    by a random factor in [0.5, 1], so that daemons started together do not retry together."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.attempts = first, cap, 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2**self.attempts)
        self.attempts += 1
        return delay * random.uniform(0.5, 1.0)


def new_token() -> str:
    """Identifies this daemon as the holder: host, pid and randomness (never reused)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}"


def new_epoch() -> str:
    """A pool's identity: random, so a pool created anew never looks like the one before."""
    return secrets.token_hex(8)


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__

"""Shared by the leasing and safety tests: a real redis-server per test, leasing daemons with short
timings, and small clients for GET and STATS."""

from __future__ import annotations

import asyncio
import glob
import subprocess
import sys
import time

from conftest import Daemon, DaemonFactory, daemon_env, parse_values, recv_until
from redis_servers import RedisServer

from katsubushi_py.leasing import parse_redis_url
from katsubushi_py.leasing.keeper import init_pool as keeper_init_pool

TTL, RENEW, DELAY = 3.0, 1.0, 2.0
FAKETIME_LIB = next(iter(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), "/nonexistent/libfaketime.so.1")


def lease_args(url: str, ns: str = "t", *more: str) -> list[str]:
    return [
        "--redis",
        f"{url}?ns={ns}",
        "--lease-ttl",
        f"{TTL}s",
        "--lease-renew",
        f"{RENEW}s",
        "--lease-delay",
        f"{DELAY}s",
        *more,
    ]


def init_pool(url: str, ns: str = "t", low: int = 1, high: int = 1023) -> int:
    """What `katsubushi-py lease init` does: a pool that serves at once (one that a daemon creates
    itself waits out a lease ttl plus twice the clock skew, in case Redis lost the one before)."""
    return asyncio.run(keeper_init_pool(parse_redis_url(f"{url}?ns={ns}"), low, high))


def start_leased(
    daemons: DaemonFactory,
    url: str,
    *more: str,
    ns: str = "t",
    init: bool = True,
    wait: bool = True,
    **kwargs: object,
) -> Daemon:
    """A leasing daemon; with ``wait``, returned once it serves (it listens before that, answering
    SERVER_ERROR while it waits for its lease)."""
    if init:
        init_pool(url, ns)
    d = daemons.start(*lease_args(url, ns, *more), worker_id=None, wait=wait, **kwargs)  # type: ignore[arg-type]
    if wait:
        wait_serving(d)
    return d


def wait_serving(d: Daemon, timeout: float = 30.0) -> None:
    """Until the daemon (already listening) holds its lease and serves."""
    wait_until(lambda: stats(d).get("lease_state") == "held", timeout=timeout, step=0.02)


def get(d: Daemon, n: int = 1) -> list[int] | bytes:
    """IDs, or the raw reply when it is not VALUE lines (SERVER_ERROR ...)."""
    with d.connect() as s:
        s.sendall(b"GET " + b" ".join(b"k%d" % i for i in range(n)) + b"\r\n")
        reply = recv_until(s, b"\r\n")
        if reply.startswith(b"VALUE"):
            while not reply.endswith(b"END\r\n"):
                reply += recv_until(s, b"\r\n")
            return [i for _, i in parse_values(reply)]
        return reply


def ids(d: Daemon, n: int = 1) -> list[int]:
    reply = get(d, n)
    assert isinstance(reply, list), reply
    return reply


def stats(d: Daemon) -> dict[str, str]:
    with d.connect() as s:
        s.sendall(b"STATS\r\n")
        lines = recv_until(s, b"END\r\n").decode().split("\r\n")[:-2]
    return {line.split(" ")[1]: line.split(" ", 2)[2] for line in lines}


def lease_score(server: RedisServer, ns: str, worker_id: int) -> float | None:
    return server.client().zscore("{" + ns + "}:ids", worker_id)


def wait_until(predicate, timeout: float, step: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError("condition not met in time")


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "katsubushi_py", *args], capture_output=True, text=True, timeout=30, env=daemon_env()
    )

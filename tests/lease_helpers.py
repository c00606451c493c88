"""Shared by the leasing and safety tests: a real redis-server per test, leasing daemons with short
timings, and small clients for GET and STATS."""

from __future__ import annotations

import asyncio
import glob
import subprocess
import sys
import time

from conftest import Daemon, DaemonFactory, daemon_env, parse_values, recv_until
from id_recorder import Recorder
from redis_servers import RedisServer

from katsubushi_py.leasing import parse_redis_url
from katsubushi_py.leasing.keeper import init_pool as keeper_init_pool

TTL, RENEW, DELAY = 3.0, 1.0, 2.0
# The high-availability tests' timings (test_ha_*.py): a ttl that outlasts a 3 s failover.
TTL_HA, RENEW_HA = 9.0, 1.0
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


def check_followed_without_a_failed_request(
    recorder: Recorder, loaded: list[Daemon], killed: float, failover: float, old: str, new: str, what: str
) -> list[dict[str, str]]:
    """What a clean failover under load (Sentinel or Cluster) must show, once the recorder stopped: no
    duplicate, no failed request, every daemon served after the promotion and renewed on the new master
    (``new``, host:port) within the failover time plus a renew interval (and the retry, and a loaded
    machine's scheduling), kept its lease and its worker id, and said that it followed the master.
    Prints the figures (``what`` names the case) and returns each daemon's STATS."""
    assert recorder.duplicates() == 0, recorder.summary()
    assert recorder.overlapping_holders() == []
    assert [r.error for r in recorder.replies if r.error] == []  # no client request failed
    fields = [stats(d) for d in loaded]
    gaps = [int(f["lease_longest_renew_gap_ms"]) / 1000 for f in fields]
    served_after = [len(recorder.served(d, killed + failover)) for d in range(len(loaded))]
    print(
        f"{what}: {recorder.summary()}; failover {failover:.2f} s; longest time without a confirmed renew per"
        f" daemon {gaps} s; replies after the promotion {served_after}"
    )
    assert all(served_after)
    assert max(gaps) <= failover + RENEW_HA + 1.5, gaps
    for d, f in zip(loaded, fields, strict=True):
        assert f["lease_redis_address"] == new, f
        assert f["lease_master_changes"] == "1" and f["worker_id_changes"] == "0", f
        assert f["lease_kept_through_change"] == "1" and f["lease_data_loss_events"] == "0", f
        log = d.stderr()
        assert f"changed: {old} -> {new}; following it" in log
        assert "without a confirmed renew" in log and "issuing never stopped" in log
    return fields

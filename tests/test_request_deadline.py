"""--request-timeout (issue 27): a request that trickles in (a memcached text line or binary packet, an
HTTP head, a byte every fraction of a second) is closed once it has taken longer than the deadline,
far sooner than the idle timeout; a slow client whose requests do complete is not. (A TLS handshake
that stalls: tests/test_tls.py.) Runs on both hot paths: the sweep reads the compiled cores' state."""

from __future__ import annotations

import socket
import time

from conftest import DaemonFactory, free_port, recv_until, wait_for_port


def stats(port: int) -> dict[str, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"stats\r\n")
        text = recv_until(s, b"END\r\n").decode()
    return dict(line.split(" ", 2)[1:] for line in text.splitlines() if line.startswith("STAT "))


def is_closed(s: socket.socket) -> bool:
    """Whether the daemon closed ``s`` (what it said before is read and dropped)."""
    s.setblocking(False)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


def test_trickling_requests_are_closed_by_the_deadline_and_slow_complete_ones_are_not(
    daemons: DaemonFactory,
) -> None:
    http = free_port()
    d = daemons.start("--http-port", str(http), "--request-timeout", "1s", "--idle-timeout", "60s")
    wait_for_port(http, d.proc)
    port: int = d.port  # type: ignore[assignment]
    trickles = {
        "text line": (port, b"get " + b"k" * 200),  # never ends
        "binary packet": (port, bytes([0x80, 0x00, 0x00, 0x01]) + b"\x00" * 20),  # a GET's header, cut short
        "http head": (http, b"GET /id HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 200),
    }
    sockets = {name: socket.create_connection(("127.0.0.1", p), timeout=5) for name, (p, _) in trickles.items()}
    steady = socket.create_connection(("127.0.0.1", port), timeout=5)  # slow, but every request completes
    closed_at: dict[str, float] = {}
    said: dict[str, bytes] = {}
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < 6.0 and len(closed_at) < len(trickles):
        for name, (_, payload) in trickles.items():
            if name in closed_at:
                continue
            s = sockets[name]
            try:
                s.sendall(payload[step : step + 1])
            except (BrokenPipeError, ConnectionResetError):
                closed_at[name] = time.monotonic() - started
                continue
            if name == "http head":
                s.setblocking(False)
                try:
                    said[name] = said.get(name, b"") + s.recv(4096)
                except BlockingIOError:
                    pass
                finally:
                    s.setblocking(True)
            if is_closed(s):
                closed_at[name] = time.monotonic() - started
        steady.sendall(b"get a\r\n")
        assert recv_until(steady, b"END\r\n").startswith(b"VALUE a ")
        step += 1
        time.sleep(0.3)
    assert set(closed_at) == set(trickles), closed_at  # every trickle closed, long before the idle timeout
    assert all(0.9 < seconds < 5.5 for seconds in closed_at.values()), closed_at
    assert said.get("http head", b"").startswith(b"HTTP/1.1 408 Request Timeout\r\n"), said
    steady.sendall(b"get b\r\n")  # the slow client that completes its requests is still served
    assert recv_until(steady, b"END\r\n").startswith(b"VALUE b ")
    steady.close()
    fields = stats(port)
    assert fields["request_timeouts"] == "3" and fields["request_timeout"] == "1"
    for s in sockets.values():
        s.close()
    assert "Traceback" not in d.stderr()


def test_a_partial_line_then_silence_is_closed_by_the_deadline_not_the_idle_timeout(daemons: DaemonFactory) -> None:
    d = daemons.start("--request-timeout", "1s", "--idle-timeout", "60s")
    idle = d.connect()  # sends nothing: only the idle timeout applies to it
    with d.connect() as s:
        s.sendall(b"get a")  # no end of line, and nothing more
        s.settimeout(5)
        started = time.monotonic()
        assert s.recv(100) == b""
        assert time.monotonic() - started < 4
    assert not is_closed(idle)
    idle.sendall(b"get c\r\n")
    assert recv_until(idle, b"END\r\n").startswith(b"VALUE c ")
    idle.close()

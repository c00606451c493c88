"""The HTTP API against the real daemon process, with the standard library's http.client."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, DaemonFactory, decode, free_port, recv_all, wait_for_port
from lease_helpers import TTL, start_leased, wait_until
from prometheus_client.parser import text_string_to_metric_families
from redis_servers import RedisServer, start_redis
from test_daemon import get as mc_get
from test_daemon import run_cli
from test_daemon import stats as mc_stats
from test_http_protocol import parse_replies
from test_issuer import SteppableClock

from katsubushi_py.config import ServerConfig
from katsubushi_py.daemon.server import Daemon as InProcessDaemon
from katsubushi_py.issuing.generator import Generator


def start_http(daemons: DaemonFactory, *args: str, **kwargs: object) -> tuple[Daemon, int]:
    port = free_port()
    d = daemons.start("--http-port", str(port), *args, **kwargs)  # type: ignore[arg-type]
    wait_for_port(port, d.proc)  # the HTTP listener opens just after the memcached one
    return d, port


def fetch(
    conn: http.client.HTTPConnection, path: str, method: str = "GET", **headers: str
) -> tuple[int, http.client.HTTPResponse, bytes]:
    conn.request(method, path, headers=headers)
    response = conn.getresponse()
    return response.status, response, response.read()


def test_every_route_over_one_keep_alive_connection(daemons: DaemonFactory) -> None:
    _d, port = start_http(daemons)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, _, body = fetch(conn, "/stats")
    before = json.loads(body)
    sock = conn.sock

    status, response, body = fetch(conn, "/id")
    assert status == 200 and response.getheader("Content-Type") == "text/plain" and body.isdigit()
    first = int(body)
    assert decode(first)[1] == 7
    status, response, body = fetch(conn, "/id", Accept="application/json")
    assert response.getheader("Content-Type") == "application/json"
    assert list(json.loads(body)) == ["id"] and int(json.loads(body)["id"]) > first
    status, _, body = fetch(conn, "/ids?n=3")
    three = [int(x) for x in body.split(b"\n")]
    assert len(three) == 3 and three == sorted(three) and three[0] > first
    status, _, body = fetch(conn, "/ids?n=1000", Accept="application/json")
    thousand = [int(x) for x in json.loads(body)["ids"]]
    assert len(set(thousand)) == 1000 and thousand[0] > three[-1] and body.endswith(b"\n")
    for query in ("n=0", "n=-1", "n=1001", "n=abc"):
        status, response, body = fetch(conn, f"/ids?{query}")
        assert status == 400 and "from 1 to 1000" in json.loads(body)["error"], query
    status, response, body = fetch(conn, "/id", method="POST")
    assert status == 405 and response.getheader("Allow") == "GET"
    status, _, body = fetch(conn, "/nope")
    assert status == 404
    status, _, body = fetch(conn, "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok", "worker_id": 7}
    status, _, body = fetch(conn, f"/decode/{first}")
    record = json.loads(body)
    assert record["id"] == str(first) and record["worker_id"] == 7 and record["sequence"] == decode(first)[2]
    status, response, body = fetch(conn, "/metrics")
    assert status == 200 and response.getheader("Content-Type").startswith("text/plain")
    assert b"katsubushi_ids_issued_total" in body
    status, _, body = fetch(conn, "/stats")
    after = json.loads(body)

    assert conn.sock is sock  # never reconnected: every response kept the connection open
    assert after["total_connections"] == before["total_connections"]
    assert after["cmd_get"] - before["cmd_get"] == 4 + 4  # the refused counts are counted too
    assert after["get_hits"] - before["get_hits"] == 1 + 1 + 3 + 1000
    assert after["get_misses"] == before["get_misses"] == 0
    conn.close()


def test_pipelined_requests_on_one_socket_are_answered_in_order(daemons: DaemonFactory) -> None:
    _, port = start_http(daemons)
    requests = b"".join(
        b"GET %b HTTP/1.1\r\nHost: k\r\n\r\n" % path for path in (b"/ids?n=2", b"/nope", b"/id", b"/healthz", b"/id")
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for _ in range(2):  # and again on the same connection
            s.sendall(requests)
            data = b""
            while len(parse_replies_prefix(data)) < 5:
                chunk = s.recv(65536)
                assert chunk, data
                data += chunk
            replies = parse_replies(data)
            assert [r.status for r in replies] == [200, 404, 200, 200, 200]
            ids = [int(x) for r in (replies[0], replies[2], replies[4]) for x in r.body.split(b"\n")]
            assert ids == sorted(ids) and len(set(ids)) == 4


def parse_replies_prefix(data: bytes) -> list[object]:
    """The responses complete so far (none if the last one is still arriving)."""
    try:
        return list(parse_replies(data))
    except (AssertionError, ValueError, KeyError):
        return []


def test_an_oversized_header_is_431_and_closed(daemons: DaemonFactory) -> None:
    _, port = start_http(daemons)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, response, body = fetch(conn, "/id", **{"X-Huge": "h" * 20_000})
    assert status == 431 and response.getheader("Connection") == "close"
    assert "header section" in json.loads(body)["error"]
    assert conn.sock is None or conn.sock.recv(1) == b""  # closed by the server
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        # Sent slowly, in pieces: refused within a read of the limit, not buffered without end.
        s.sendall(b"GET /id HTTP/1.1\r\nX-Slow: ")
        reply = b""
        for _ in range(64):
            try:
                s.sendall(b"s" * 1024)
            except (BrokenPipeError, ConnectionResetError):
                break
            reply += recv_all(s, 0.01)
            if reply:
                break
        reply += recv_all(s, 1.0)
        assert reply.startswith(b"HTTP/1.1 431 "), reply


def test_a_half_sent_request_stalls_only_itself_and_the_idle_timeout_closes_it(daemons: DaemonFactory) -> None:
    _, port = start_http(daemons, "--idle-timeout", "1s")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as stalled:
        stalled.sendall(b"GET /ids?n=5 HTTP/1.1\r\nHost: k\r\nAcc")  # and nothing more
        other = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        for _ in range(10):
            status, _, body = fetch(other, "/id")
            assert status == 200 and body.isdigit()
            time.sleep(0.1)
        # Closed without an answer by the idle timeout (the socket's own timeout would raise instead).
        assert stalled.recv(100) == b""
        other.close()


def settle(mc: socket.socket, connections: int) -> dict[str, str]:
    """STATS once the daemon has noticed earlier connections' closes (the start-up probes')."""
    return wait_until(lambda: (f := mc_stats(mc))["curr_connections"] == str(connections) and f, timeout=10)


def test_connections_are_counted_with_memcached_and_limited_by_max_connections(daemons: DaemonFactory) -> None:
    d, port = start_http(daemons, "--max-connections", "3")
    with d.connect() as mc:
        settle(mc, 1)
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        second = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        assert fetch(first, "/id")[0] == 200 and fetch(second, "/id")[0] == 200
        with socket.create_connection(("127.0.0.1", port), timeout=5) as refused:
            reply = recv_all(refused, 1.0)
        assert reply.startswith(b"HTTP/1.1 503 ") and b"too many connections" in reply
        fields = mc_stats(mc)
        assert fields["curr_connections"] == "3" and fields["rejected_connections"] == "1"
        first.close()
        second.close()


def test_metrics_agree_with_stats(daemons: DaemonFactory) -> None:
    d, port = start_http(daemons)
    with d.connect() as mc:
        settle(mc, 1)
        for _ in range(3):
            mc_get(mc, b"a", b"b")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        fetch(conn, "/ids?n=7")
        fetch(conn, "/ids?n=5000")  # refused: a request, no IDs
        fields = mc_stats(mc)
        status, _response, body = fetch(conn, "/metrics")
    assert status == 200
    metrics = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            metrics[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def total(name: str) -> float:
        return sum(v for (n, _), v in metrics.items() if n == name)

    assert total("katsubushi_requests_total") == int(fields["cmd_get"]) == 5
    assert total("katsubushi_ids_issued_total") == int(fields["get_hits"]) == 13
    assert total("katsubushi_failures_total") == int(fields["get_misses"]) == 0
    assert metrics[("katsubushi_requests_total", (("protocol", "text"),))] == 3
    assert metrics[("katsubushi_ids_issued_total", (("protocol", "http"),))] == 7
    assert metrics[("katsubushi_connections", ())] == int(fields["curr_connections"]) == 2
    assert metrics[("katsubushi_connections_accepted_total", ())] == int(fields["total_connections"])
    assert metrics[("katsubushi_connections_rejected_total", ())] == int(fields["rejected_connections"])
    assert metrics[("katsubushi_worker_id", ())] == int(fields["worker_id"]) == 7
    assert metrics[("katsubushi_clock_backwards_events_total", ())] == int(fields["clock_backwards_events"])
    assert metrics[("katsubushi_sequence_overflow_waits_total", ())] == int(fields["sequence_overflow_waits"])
    assert metrics[("katsubushi_last_issued_timestamp_seconds", ())] * 1000 >= int(fields["last_issued_ms"])
    assert abs(metrics[("katsubushi_clock_drift_seconds", ())] * 1000 - int(fields["clock_drift_ms"])) <= 50
    assert metrics[("katsubushi_can_issue", ())] == 1
    assert metrics[("process_resident_memory_bytes", ())] > 0  # process metrics are there too
    assert not any(name.startswith("katsubushi_lease") for name, _ in metrics)  # no --redis, no lease series


def test_http_port_from_katsubushi_spellings(daemons: DaemonFactory) -> None:
    for how in ("flag", "env"):
        port = free_port()
        d = daemons.start("-http-port", str(port)) if how == "flag" else daemons.start(env={"HTTP_PORT": str(port)})
        wait_for_port(port, d.proc)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        assert fetch(conn, "/id")[0] == 200
        conn.close()
        d.wait_for_log(f"http://127.0.0.1:{port}")


def test_http_port_in_use_is_one_line(daemons: DaemonFactory) -> None:
    _d, port = start_http(daemons)
    result = run_cli("--worker-id", "1", "--port", str(free_port()), "--http-port", str(port))
    assert result.returncode == 1
    expected = f"katsubushi-py: error: cannot listen on http://127.0.0.1:{port}: address already in use"
    assert result.stderr.strip() == expected


async def test_a_request_waiting_for_the_clock_blocks_no_other_http_connection() -> None:
    clock = SteppableClock()
    gen = Generator(4, clock=clock, block_on_clock=False)
    daemon = InProcessDaemon(ServerConfig(worker_id=4, port=None, http_port=0), gen, asyncio.get_running_loop())
    await daemon.start()
    port = int(daemon.addresses[0].rsplit(":", 1)[1])
    try:
        first = gen.next_id()
        clock.offset_ns = -600_000_000  # 600 ms behind what was issued
        gen.reanchor()

        async def ask(request: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            data = await reader.read()  # until the server closes (Connection: close)
            writer.close()
            return data

        close = b"Host: k\r\nConnection: close\r\n\r\n"
        waiting = asyncio.ensure_future(ask(b"GET /ids?n=2 HTTP/1.1\r\n" + close))
        await asyncio.sleep(0.05)
        health = await ask(b"GET /healthz HTTP/1.1\r\n" + close)
        assert health.startswith(b"HTTP/1.1 200 ")  # served while the other request waits
        assert not waiting.done()
        [reply] = parse_replies(await waiting)
        ids = [int(x) for x in reply.body.split(b"\n")]
        assert reply.status == 200 and first < ids[0] < ids[1]
    finally:
        await daemon.stop()


def test_many_http_clients_at_once_get_distinct_ids(daemons: DaemonFactory) -> None:
    _, port = start_http(daemons)
    results: list[list[int]] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        got = []
        for i in range(100):
            body = fetch(conn, "/ids?n=10" if i % 2 else "/id")[2]
            got += [int(x) for x in body.split(b"\n")]
        conn.close()
        results.append(got)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for r in results for i in r]
    assert len(every) == 8 * (50 + 500) and len(set(every)) == len(every)


@pytest.mark.parametrize("method", ["HEAD", "PUT"])
def test_non_get_methods_on_a_real_daemon(daemons: DaemonFactory, method: str) -> None:
    _, port = start_http(daemons)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    status, response, _body = fetch(conn, "/ids", method=method)
    assert status == 405 and response.getheader("Allow") == "GET"
    assert fetch(conn, "/id")[0] == 200  # still usable


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


def test_healthz_and_grpc_turn_unavailable_while_the_lease_is_unconfirmed(
    daemons: DaemonFactory, redis_server: RedisServer
) -> None:
    """Redis paused (SIGSTOP): once the lease can no longer be confirmed, /healthz is 503 with the
    reason and so are /id and gRPC Fetch; once Redis answers again, all three recover."""
    import grpc

    from katsubushi_py.frontends import katsubushi_pb2 as pb
    from katsubushi_py.frontends import katsubushi_pb2_grpc as pb_grpc

    http_port, grpc_port = free_port(), free_port()
    d = start_leased(daemons, redis_server.url, "--http-port", str(http_port), "--grpc-port", str(grpc_port))
    wait_for_port(http_port, d.proc)
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=5)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    generator = pb_grpc.GeneratorStub(channel)

    def health() -> tuple[int, dict[str, object]]:
        status, _, body = fetch(conn, "/healthz")
        return status, json.loads(body)

    wait_until(lambda: health()[0] == 200, timeout=10)  # once the first renew confirmed the lease
    assert generator.Fetch(pb.FetchRequest(), timeout=5).id > 0
    redis_server.pause()
    try:
        status, body = wait_until(lambda: (h := health())[0] == 503 and h, timeout=TTL + 5)
        assert body == {
            "status": "unavailable",
            "reason": "lease_unconfirmed",
            "message": "worker id lease not confirmed",
        }
        status, _, text = fetch(conn, "/id")
        assert status == 503 and json.loads(text)["reason"] == "lease_unconfirmed"
        # Alive all the same: the liveness probe must not have the pod restarted for a wait.
        assert fetch(conn, "/livez")[:3:2] == (200, b'{"status":"alive"}\n')
        with pytest.raises(grpc.RpcError) as failed:
            generator.Fetch(pb.FetchRequest(), timeout=5)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert failed.value.details() == "worker id lease not confirmed"
        assert ("katsubushi-reason", "lease_unconfirmed") in failed.value.trailing_metadata()
        metrics = fetch(conn, "/metrics")[2].decode()
        assert 'katsubushi_lease_state{state="unconfirmed"} 1.0' in metrics
        assert "katsubushi_can_issue 0.0" in metrics
    finally:
        redis_server.resume()
    wait_until(lambda: health()[0] == 200, timeout=10)
    assert fetch(conn, "/id")[0] == 200
    assert generator.Fetch(pb.FetchRequest(), timeout=5).id > 0
    metrics = fetch(conn, "/metrics")[2].decode()
    assert 'katsubushi_lease_state{state="held"} 1.0' in metrics
    failures = [line for line in metrics.splitlines() if line.startswith("katsubushi_lease_renew_failures_total ")]
    assert failures and float(failures[0].split()[1]) >= 1
    assert 'katsubushi_failures_total{protocol="http",reason="lease_unconfirmed"} 1.0' in metrics
    assert 'katsubushi_failures_total{protocol="grpc",reason="lease_unconfirmed"} 1.0' in metrics
    channel.close()
    conn.close()

"""The binary protocol on the daemon as a real process, with raw packets over TCP and unix sockets."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from binary_packets import (
    GET,
    GETK,
    GETKQ,
    GETQ,
    HEADER,
    INVALID_ARGUMENTS,
    NOOP,
    NOT_SUPPORTED,
    QUIT,
    QUITQ,
    SET,
    STAT,
    SUCCESS,
    TEMPORARY_FAILURE,
    UNKNOWN_COMMAND,
    VERSION,
    id_of,
    parse_all,
    read_packets,
    read_until_terminator,
    request,
)
from conftest import Daemon, DaemonFactory, decode, free_port, parse_values, recv_all, recv_until, wait_for_port
from test_daemon import rss_kb

from katsubushi_py import __version__


def connect(daemons: DaemonFactory, transport: str, short_tmp: Path, *args: str) -> Daemon:
    if transport == "unix":
        return daemons.start(*args, port=None, sock=str(short_tmp / "k.sock"))
    return daemons.start(*args)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_every_opcode_over_the_wire(daemons: DaemonFactory, short_tmp: Path, transport: str) -> None:
    d = connect(daemons, transport, short_tmp)
    with d.connect() as s:
        s.sendall(request(GET, b"Hello", opaque=0xDEADBEEF))
        [get] = read_packets(s, 1)
        assert (get.opcode, get.opaque, get.key) == (GET, 0xDEADBEEF, b"")
        unix_ms, worker, _ = decode(id_of(get))
        assert worker == 7 and abs(unix_ms - time.time() * 1000) < 1000
        pipeline = [
            request(GETQ, b"a", opaque=1),
            request(GETK, b"b", opaque=2),
            request(GETKQ, b"c", opaque=3),
            request(VERSION, opaque=4),
            request(SET, b"k", opaque=5, extras=b"\0" * 8, value=b"v"),
            request(0x50, opaque=6),
            request(NOOP, opaque=7),
        ]
        s.sendall(b"".join(pipeline))
        packets = read_packets(s, 7)
        assert [(p.opcode, p.opaque) for p in packets] == [
            (GETQ, 1),
            (GETK, 2),
            (GETKQ, 3),
            (VERSION, 4),
            (SET, 5),
            (0x50, 6),
            (NOOP, 7),
        ]
        ids = [id_of(p) for p in packets[:3]]
        assert id_of(get) < ids[0] < ids[1] < ids[2]
        assert [p.key for p in packets[:3]] == [b"", b"b", b"c"]
        assert packets[3].value == __version__.encode()
        assert [p.status for p in packets[3:]] == [SUCCESS, NOT_SUPPORTED, UNKNOWN_COMMAND, SUCCESS]
        s.sendall(request(STAT, opaque=8))
        stats = read_until_terminator(s, STAT)
        fields = {p.key.decode(): p.value.decode() for p in stats[:-1]}
        assert all(p.opaque == 8 for p in stats)
        assert fields["cmd_get"] == "4" and fields["get_hits"] == "4" and fields["curr_connections"] == "1"
        s.sendall(request(STAT, b"settings", opaque=9))
        settings = {p.key.decode(): p.value.decode() for p in read_until_terminator(s, STAT)[:-1]}
        assert settings["domain_socket"] == (d.sock if transport == "unix" else "NULL")
        s.sendall(request(QUIT, opaque=10) + request(GET))
        [quit_reply] = read_packets(s, 1)
        assert (quit_reply.opcode, quit_reply.status, quit_reply.opaque) == (QUIT, SUCCESS, 10)
        assert recv_all(s, 1.0) == b""
    with d.connect() as s:
        s.sendall(request(QUITQ))
        assert recv_all(s, 1.0) == b""


def test_text_and_binary_connections_at_once_never_share_an_id(daemon: Daemon) -> None:
    results: list[list[int]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    deadline = time.monotonic() + 1.0

    def text_client(out: list[int]) -> None:
        with daemon.connect() as s:
            while time.monotonic() < deadline:
                s.sendall(b"GET a b c\r\n")
                out.extend(i for _, i in parse_values(recv_until(s, b"END\r\n")))

    def binary_client(out: list[int]) -> None:
        with daemon.connect() as s:
            while time.monotonic() < deadline:
                s.sendall(request(GET) + b"".join(request(GETKQ, b"k%d" % i) for i in range(10)) + request(NOOP))
                out.extend(id_of(p) for p in read_until_terminator(s, NOOP)[:-1])

    def run(target, out: list[int]) -> None:  # type: ignore[no-untyped-def]
        try:
            target(out)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(text_client if n % 2 else binary_client, results[n])) for n in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    every = [i for out in results for i in out]
    assert len(every) > 1000 and len(set(every)) == len(every)
    assert all(all(a < b for a, b in itertools.pairwise(out)) for out in results)


def test_a_request_dribbled_byte_by_byte_delays_no_one(daemon: Daemon) -> None:
    stream = request(GETK, b"slow", opaque=3)
    with daemon.connect() as slow, daemon.connect() as other:
        other.sendall(request(GET, opaque=1))
        first = id_of(read_packets(other, 1)[0])
        for i, byte in enumerate(stream):
            slow.sendall(bytes([byte]))
            if i in (0, 10, 23, 25):  # mid-header, end of header, mid-key: someone else is served
                other.sendall(request(GETK, b"other", opaque=i))
                [packet] = read_packets(other, 1)
                assert packet.opaque == i and id_of(packet) > first
            time.sleep(0.005)
        [packet] = read_packets(slow, 1)
        assert (packet.key, packet.opaque) == (b"slow", 3) and id_of(packet) > first


def test_bad_magic_closes_the_connection(daemon: Daemon) -> None:
    with daemon.connect() as s:
        s.sendall(request(GET, opaque=1) + b"\x82" + request(GET)[1:])
        reply = recv_all(s, 1.0)
    [packet] = parse_all(reply)
    assert packet.opaque == 1
    with daemon.connect() as s:  # the daemon goes on
        s.sendall(request(GET))
        assert id_of(read_packets(s, 1)[0])


def test_oversized_body_lengths_are_refused_without_memory(daemon: Daemon) -> None:
    """go-katsubushi allocates whatever body length a header declares; 40 such headers of 4 GiB
    each must leave the daemon's memory where it was."""
    with daemon.connect() as warm:
        warm.sendall(request(GET))
        read_packets(warm, 1)
    before = rss_kb(daemon.pid)
    socks = [daemon.connect() for _ in range(40)]
    try:
        for n, s in enumerate(socks):
            header = HEADER.pack(0x80, SET, 0, 0, 0, 0, 2**32 - 1, 0xFFFF0000 + n, 0)
            s.sendall(request(GET, opaque=n) + header + b"x" * 1000)  # the first kilobyte of "4 GiB"
        for n, s in enumerate(socks):
            data = recv_all(s, 2.0)
            [answer, refusal] = parse_all(data)
            assert answer.opaque == n and id_of(answer)
            assert (refusal.status, refusal.opaque) == (INVALID_ARGUMENTS, 0xFFFF0000 + n)
    finally:
        for s in socks:
            s.close()
    assert rss_kb(daemon.pid) - before < 10_000  # kB: nothing near even one declared body
    with daemon.connect() as s:
        s.sendall(request(GET))
        assert id_of(read_packets(s, 1)[0])


def test_binary_client_that_never_reads_is_not_buffered_without_bound(daemon: Daemon) -> None:
    stream = request(STAT) * 40  # about 1 KB in, 60 KB out
    rss_before = rss_kb(daemon.pid)
    sent = 0
    s = daemon.connect()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(3.0)
    try:
        for _ in range(100_000):  # would be 100 MB of requests and 6 GB of replies
            s.sendall(stream)
            sent += len(stream)
    except TimeoutError:
        pass  # the daemon stopped reading from us
    assert sent < 50_000_000
    with daemon.connect() as other:
        other.sendall(request(GET))
        assert id_of(read_packets(other, 1)[0])
    assert rss_kb(daemon.pid) - rss_before < 100_000
    s.close()


def test_idle_binary_connections_are_closed(daemons: DaemonFactory) -> None:
    d = daemons.start("--idle-timeout", "1s")
    with d.connect() as idle, d.connect() as partial, d.connect() as busy:
        idle.sendall(request(GET))
        read_packets(idle, 1)
        partial.sendall(request(GET)[:10])  # an incomplete header is not activity
        for _ in range(12):
            busy.sendall(request(NOOP))
            read_packets(busy, 1)
            time.sleep(0.2)
        for s in (idle, partial):
            s.settimeout(1)
            assert s.recv(10) == b""
        busy.sendall(request(GET))
        assert id_of(read_packets(busy, 1)[0])


def test_generation_failure_when_the_state_file_cannot_be_written(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A real fault: the state file's directory disappears, so the next reservation (every 2 s)
    fails. Binary requests get a binary error with the reason, text ones SERVER_ERROR, and the
    daemon serves again once the directory is back."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    d = daemons.start("--state-file", str(state_dir / "ids.state"))
    with d.connect() as binary, d.connect() as text:
        binary.sendall(request(GET))
        first = id_of(read_packets(binary, 1)[0])
        shutil.rmtree(state_dir)
        deadline = time.monotonic() + 10
        while True:  # until the reserved window (2 s) is used up
            binary.sendall(request(GETKQ, b"a", opaque=1) + request(NOOP, opaque=2))
            packets = read_until_terminator(binary, NOOP)
            if packets[0].status != SUCCESS or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        failure, noop = packets
        assert (failure.opcode, failure.status, failure.opaque, failure.key) == (GETKQ, TEMPORARY_FAILURE, 1, b"")
        assert failure.value.startswith(b"cannot write state file ") and b"No such file or directory" in failure.value
        assert (noop.opcode, noop.status) == (NOOP, SUCCESS)
        text.sendall(b"GET a\r\n")
        assert recv_until(text, b"\r\n").startswith(b"SERVER_ERROR cannot write state file ")
        binary.sendall(request(STAT))
        fields = {p.key: p.value for p in read_until_terminator(binary, STAT)[:-1]}
        assert int(fields[b"get_misses"]) >= 2
        os.mkdir(state_dir)
        binary.sendall(request(GET))
        assert id_of(read_packets(binary, 1)[0]) > first


def test_binary_and_meta_requests_have_their_own_metrics(daemons: DaemonFactory) -> None:
    http_port = free_port()
    d = daemons.start("--http-port", str(http_port))
    wait_for_port(http_port, d.proc)

    def requests_by_protocol() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as response:
            body = response.read().decode()
        return {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^katsubushi_requests_total\{protocol="(\w+)"\} (\S+)$', body, re.M)
        }

    assert requests_by_protocol()["binary"] == requests_by_protocol()["meta"] == 0  # there from the start
    with d.connect() as binary, d.connect() as text:
        binary.sendall(request(GET) + b"".join(request(GETKQ, b"k%d" % i) for i in range(3)) + request(NOOP))
        assert len(read_until_terminator(binary, NOOP)) == 5
        text.sendall(b"mg a v\r\nget b c\r\n")
        assert recv_until(text, b"END\r\n").count(b"\r\n") == 7
    counts = requests_by_protocol()
    assert (counts["binary"], counts["meta"], counts["text"]) == (4, 1, 1)

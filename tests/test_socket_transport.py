"""The socket transport that serves memcached listeners when the compiled hot path runs
(katsubushi_py/daemon/sockets.py): on a real socket pair and the real event loop, each case run with
the reference core (PySocketCore) and, where built, the compiled one (SocketCore); both must record
the same events. The whole daemon suite also runs on it (the compiled pass of .ci/run)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from transport_recorder import TRANSPORTS, Recorder

from katsubushi_py.daemon.sockets import HIGH_WATER, SocketServer


def pair(transport_class: type, protocol: Recorder) -> tuple[Any, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    transport = transport_class(asyncio.get_running_loop(), ours, protocol)
    transport.start()
    return transport, theirs


async def read_all(sock: socket.socket, size: int, timeout: float = 5.0) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    while len(got) < size:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_requests_are_answered_in_order(transport_class: type) -> None:
    proto = Recorder(reply=lambda data: data.upper())
    transport, peer = pair(transport_class, proto)
    loop = asyncio.get_running_loop()
    for word in (b"one", b"two", b"three"):
        await loop.sock_sendall(peer, word)
        assert await read_all(peer, len(word)) == word.upper()
    assert transport.get_extra_info("socket") is not None
    transport.close()
    assert await asyncio.wait_for(proto.lost, 5) is None
    assert await read_all(peer, 1) == b""  # closed on our side
    assert proto.events == ["made", "lost"]
    peer.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_a_client_that_does_not_read_pauses_then_resumes_the_protocol(transport_class: type) -> None:
    """Replies the kernel does not take are queued; above the high-water mark the protocol is told
    to stop reading, and once the client reads they all arrive, in order, and it is told to resume."""
    big = bytes(range(256)) * 256  # 64 KiB per reply
    proto = Recorder(reply=lambda data: big)
    transport, peer = pair(transport_class, proto)
    loop = asyncio.get_running_loop()
    for _ in range(16):  # 1 MiB of replies, more than the socket buffers hold
        await loop.sock_sendall(peer, b"x")
        await asyncio.sleep(0.01)
    assert "pause_writing" in proto.events
    assert transport._pending
    got = await read_all(peer, 16 * len(big))
    assert got == big * 16
    await asyncio.sleep(0.05)
    assert proto.events[-1] == "resume_writing"
    assert not transport._pending
    transport.close()
    await asyncio.wait_for(proto.lost, 5)
    peer.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_close_sends_what_is_queued_first(transport_class: type) -> None:
    proto = Recorder()
    transport, peer = pair(transport_class, proto)
    await asyncio.sleep(0)
    reply = b"z" * (4 * HIGH_WATER)
    transport.write(reply)
    transport.close()
    transport.write(b"after close")  # dropped
    assert not proto.lost.done()
    assert await read_all(peer, len(reply) + 100) == reply
    await asyncio.wait_for(proto.lost, 5)
    peer.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_abort_drops_what_is_queued(transport_class: type) -> None:
    proto = Recorder()
    transport, peer = pair(transport_class, proto)
    await asyncio.sleep(0)
    transport.write(b"q" * (8 * HIGH_WATER))
    transport.abort()
    await asyncio.wait_for(proto.lost, 5)
    got = await read_all(peer, 8 * HIGH_WATER)
    assert len(got) < 8 * HIGH_WATER
    peer.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_end_of_file_closes_unless_the_protocol_keeps_it_open(transport_class: type) -> None:
    loop = asyncio.get_running_loop()
    closing = Recorder()
    transport, peer = pair(transport_class, closing)
    await loop.sock_sendall(peer, b"bye")
    peer.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(closing.lost, 5)
    assert closing.events == ["made", "eof", "lost"] and closing.received == b"bye"
    peer.close()

    keeping = Recorder(keep_open_at_eof=True)
    transport, peer = pair(transport_class, keeping)
    peer.shutdown(socket.SHUT_WR)
    await asyncio.sleep(0.1)
    assert keeping.events == ["made", "eof"]
    transport.resume_reading()  # never again after end of file (the reader would spin)
    await asyncio.sleep(0.1)
    assert keeping.events == ["made", "eof"]
    transport.write(b"late answer")
    transport.close()
    assert await read_all(peer, 11) == b"late answer"
    await asyncio.wait_for(keeping.lost, 5)
    peer.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_a_reset_by_the_peer_loses_the_connection_quietly(
    transport_class: type, caplog: pytest.LogCaptureFixture
) -> None:
    proto = Recorder(reply=lambda data: b"r" * (1 << 20))
    _transport, peer = pair(transport_class, proto)
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(peer, b"x")
    await asyncio.sleep(0.05)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    peer.close()  # unread data and linger 0: a reset
    await asyncio.wait_for(proto.lost, 5)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_the_server_accepts_and_serves_each_connection(transport_class: type, tmp_path: Any) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s.sock"))
    made: list[Recorder] = []

    def factory() -> Recorder:
        made.append(Recorder(reply=lambda data: b"<" + data + b">"))
        return made[-1]

    server = SocketServer(loop, listener, factory, 16, transport=transport_class)
    clients = []
    for i in range(5):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        await loop.sock_connect(c, str(tmp_path / "s.sock"))
        await loop.sock_sendall(c, b"%d" % i)
        assert await read_all(c, 3) == b"<%d>" % i
        clients.append(c)
    assert len(made) == 5 and server.sockets == (listener,)
    server.close()
    await server.wait_closed()
    assert server.sockets == ()
    for c in clients:
        c.close()
    await asyncio.wait_for(asyncio.gather(*(p.lost for p in made)), 5)

"""TLS in our socket transport (katsubushi_py/daemon/sockets.py, tls.py): the handshake driven by the
loop's callbacks, then OpenSSL's reads and writes in the reference core (PySocketCore) and, where
built, the compiled one (SocketCore); each case runs with both on a real TCP socket and the real
event loop, against real TLS clients. The daemon-level TLS tests (tests/test_tls.py) run on it too."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import pytest
from tls_certs import Certs, make_certs
from transport_recorder import TRANSPORTS, Recorder

from katsubushi_py.daemon.sockets import HIGH_WATER, SocketServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def server_context(certs: Certs, verify: ssl.VerifyMode = ssl.CERT_NONE) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server.cert, certs.server.key)
    if verify != ssl.CERT_NONE:
        ctx.load_verify_locations(cafile=certs.ca.cert)
        ctx.verify_mode = verify
    return ctx


def client_context(certs: Certs, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=certs.ca.cert)
    if with_cert:
        ctx.load_cert_chain(certs.client.cert, certs.client.key)
    return ctx


class Server:
    """A TLS SocketServer on 127.0.0.1 whose connections' protocols are made by ``make``."""

    def __init__(self, transport_class: type, ctx: ssl.SSLContext, make: Callable[[], Recorder], timeout: float = 5):
        self.made: list[Recorder] = []
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        self.port = listener.getsockname()[1]

        def factory() -> Recorder:
            self.made.append(make())
            return self.made[-1]

        self.server = SocketServer(
            asyncio.get_running_loop(), listener, factory, 16, transport=transport_class,
            tls_context=ctx, handshake_timeout=timeout,
        )  # fmt: skip

    async def first(self) -> Recorder:
        for _ in range(500):
            if self.made:
                return self.made[0]
            await asyncio.sleep(0.01)
        raise AssertionError("no connection was made")

    def close(self) -> None:
        self.server.close()


def small_buffer(transport: Any) -> None:
    """A small kernel send buffer, so that replies are queued (loopback TCP takes megabytes)."""
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)


def blocking_client(port: int, ctx: ssl.SSLContext, rcvbuf: int = 0) -> ssl.SSLSocket:
    raw = socket.socket()
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # (before connecting: the window)
    raw.settimeout(5)
    raw.connect(("127.0.0.1", port))
    return ctx.wrap_socket(raw, server_hostname="localhost")


def read_exactly(s: ssl.SSLSocket, size: int) -> bytes:
    got = b""
    while len(got) < size:
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_requests_are_answered_and_the_client_certificate_is_known(transport_class: type, certs: Certs) -> None:
    srv = Server(transport_class, server_context(certs, ssl.CERT_REQUIRED), lambda: Recorder(reply=bytes.upper))
    client = await asyncio.to_thread(blocking_client, srv.port, client_context(certs, with_cert=True))
    for word in (b"one", b"two", b"three"):
        await asyncio.to_thread(client.sendall, word)
        assert await asyncio.to_thread(read_exactly, client, len(word)) == word.upper()
    proto = await srv.first()
    transport = proto.transport
    subject = dict(x[0] for x in transport.get_extra_info("peercert")["subject"])
    assert subject["commonName"] == "app-1"
    assert transport.get_extra_info("cipher") is not None
    assert isinstance(transport.get_extra_info("ssl_object"), ssl.SSLSocket)
    assert transport.get_extra_info("peername")[0] == "127.0.0.1"
    transport.close()
    assert await asyncio.wait_for(proto.lost, 5) is None
    # A clean end: the close_notify arrives, so the client reads the end of the stream, no error.
    assert await asyncio.to_thread(client.recv, 100) == b""
    assert proto.events == ["made", "lost"]
    client.close()
    srv.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_a_client_that_does_not_read_pauses_then_resumes_the_protocol(
    transport_class: type, certs: Certs
) -> None:
    """OpenSSL cannot send the records (SSLWantWriteError): each reply is queued, retried with the same
    bytes when the socket is writable; above the high-water mark the protocol is told to stop, and
    once the client reads, every reply arrives, in order, and it is told to resume."""
    big = bytes(range(256)) * 256  # 64 KiB per reply

    srv = Server(transport_class, server_context(certs), lambda: Recorder(reply=lambda data: big, on_made=small_buffer))
    client = await asyncio.to_thread(blocking_client, srv.port, client_context(certs), 16384)
    for _ in range(16):  # 1 MiB of replies, more than the socket buffers hold
        await asyncio.to_thread(client.sendall, b"x")
        await asyncio.sleep(0.01)
    proto = await srv.first()
    assert "pause_writing" in proto.events
    assert proto.transport._pending
    got = await asyncio.to_thread(read_exactly, client, 16 * len(big))
    assert got == big * 16
    await asyncio.sleep(0.05)
    assert proto.events[-1] == "resume_writing"
    assert not proto.transport._pending
    proto.transport.close()
    await asyncio.wait_for(proto.lost, 5)
    client.close()
    srv.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_close_sends_what_is_queued_first_and_abort_drops_it(transport_class: type, certs: Certs) -> None:
    srv = Server(transport_class, server_context(certs), lambda: Recorder(on_made=small_buffer))
    for i, how in enumerate(("close", "abort")):
        client = await asyncio.to_thread(blocking_client, srv.port, client_context(certs), 16384)
        await asyncio.to_thread(client.sendall, b"hello")
        while len(srv.made) <= i or srv.made[i].received != b"hello":
            await asyncio.sleep(0.01)
        proto = srv.made[i]
        reply = b"z" * (8 * HIGH_WATER)
        proto.transport.write(reply)
        getattr(proto.transport, how)()
        proto.transport.write(b"after")  # dropped
        got = await asyncio.to_thread(read_exactly, client, len(reply) + 100)
        await asyncio.wait_for(proto.lost, 5)
        if how == "close":
            assert got == reply
        else:
            assert len(got) < len(reply)
        client.close()
    srv.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_the_end_of_the_stream_with_and_without_close_notify(transport_class: type, certs: Certs) -> None:
    srv = Server(transport_class, server_context(certs), Recorder)
    polite = await asyncio.to_thread(blocking_client, srv.port, client_context(certs))
    await asyncio.to_thread(polite.sendall, b"bye")
    raw = await asyncio.to_thread(polite.unwrap)  # says close_notify
    proto = await srv.first()
    await asyncio.wait_for(proto.lost, 5)
    assert proto.events == ["made", "eof", "lost"] and proto.received == b"bye"
    raw.close()
    abrupt = await asyncio.to_thread(blocking_client, srv.port, client_context(certs))
    await asyncio.to_thread(abrupt.sendall, b"cut")
    socket.socket.shutdown(abrupt, socket.SHUT_WR)  # TCP's end, no close_notify: also the end
    while len(srv.made) < 2:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(srv.made[1].lost, 5)
    assert srv.made[1].events == ["made", "eof", "lost"] and srv.made[1].received == b"cut"
    abrupt.close()
    srv.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_what_openssl_holds_decrypted_is_read_without_the_fd_becoming_readable(
    transport_class: type, certs: Certs
) -> None:
    """Reads of 3 bytes (``_tls_read_size``): one record of 26 bytes leaves the rest in OpenSSL
    (``pending()``), which is read on the next turns; while the protocol has paused reading none is
    read, and resuming reads it."""
    holder: list[Any] = []

    def small_reads(transport: Any) -> None:
        transport._tls_read_size = 3
        holder.append(transport)

    srv = Server(transport_class, server_context(certs), lambda: Recorder(on_made=small_reads))
    client = await asyncio.to_thread(blocking_client, srv.port, client_context(certs))
    letters = bytes(range(97, 123))
    await asyncio.to_thread(client.sendall, letters)  # one record
    proto = await srv.first()
    for _ in range(200):
        if proto.received == letters:
            break
        await asyncio.sleep(0.01)
    assert proto.received == letters and proto.reads[0] == b"abc" and len(proto.reads) == 9
    # Paused after the first read of the next record: the rest waits in OpenSSL until resumed.
    proto.reads.clear()
    transport = proto.transport
    transport._data_received = lambda data: (proto.reads.append(data), transport.pause_reading())
    await asyncio.to_thread(client.sendall, letters)
    await asyncio.sleep(0.2)
    assert proto.reads == [b"abc"]
    transport._data_received = proto.reads.append
    transport.resume_reading()
    await asyncio.sleep(0.2)
    assert proto.received == letters
    proto.transport.close()
    await asyncio.wait_for(proto.lost, 5)
    client.close()
    srv.close()


def bio_client(port: int, ctx: ssl.SSLContext) -> tuple[socket.socket, ssl.SSLObject, ssl.MemoryBIO]:
    """A TLS client over memory BIOs on a raw socket: the test decides which bytes go when."""
    sock, obj, _, outgoing = bio_client_with_incoming(port, ctx)
    return sock, obj, outgoing


def bio_client_with_incoming(
    port: int, ctx: ssl.SSLContext
) -> tuple[socket.socket, ssl.SSLObject, ssl.MemoryBIO, ssl.MemoryBIO]:
    """:func:`bio_client`, with its incoming BIO too (to read what the server sends at the end)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    while True:
        try:
            obj.do_handshake()
            break
        except ssl.SSLWantReadError:
            sock.sendall(outgoing.read())
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("closed during the handshake") from None
            incoming.write(data)
    sock.sendall(outgoing.read())
    return sock, obj, incoming, outgoing


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_a_record_that_stops_half_way_is_marked_partial(transport_class: type, certs: Certs) -> None:
    """The fd was readable but OpenSSL has only part of a record: ``_tls_partial`` (what the request
    deadline reads) until the record is whole."""
    srv = Server(transport_class, server_context(certs), lambda: Recorder(reply=bytes.upper))
    sock, obj, outgoing = await asyncio.to_thread(bio_client, srv.port, client_context(certs))
    proto = await srv.first()
    await asyncio.sleep(0.1)  # (TLS 1.3: the client's last flight, then nothing)
    assert not proto.transport._tls_partial
    obj.write(b"get a\r\n")
    record = outgoing.read()
    await asyncio.to_thread(sock.sendall, record[:9])
    await asyncio.sleep(0.2)
    assert proto.transport._tls_partial and proto.received == b""
    await asyncio.to_thread(sock.sendall, record[9:])
    for _ in range(200):
        if proto.received:
            break
        await asyncio.sleep(0.01)
    assert proto.received == b"get a\r\n" and not proto.transport._tls_partial
    proto.transport.close()
    await asyncio.wait_for(proto.lost, 5)
    sock.close()
    srv.close()


@pytest.mark.parametrize("transport_class", TRANSPORTS)
async def test_failed_and_stalled_handshakes_close_without_a_protocol(transport_class: type, certs: Certs) -> None:
    """Garbage, plain text, a client that trusts another CA, a handshake that stops: each closed (the
    stalled one at the deadline, 0.5 s here), never a protocol made; the server forgets each."""
    srv = Server(transport_class, server_context(certs, ssl.CERT_REQUIRED), Recorder, timeout=0.5)
    loop = asyncio.get_running_loop()

    async def closed(payload: bytes) -> float:
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.setblocking(False)
        started = time.monotonic()
        if payload:
            await loop.sock_sendall(s, payload)
        try:
            while await asyncio.wait_for(loop.sock_recv(s, 4096), 5):
                pass
        except ConnectionResetError:
            pass
        s.close()
        return time.monotonic() - started

    assert await closed(bytes(range(256)) * 4) < 0.5  # OpenSSL's error, at once
    assert await closed(b"get a\r\n") < 0.5
    stalled = await closed(b"")
    assert 0.4 < stalled < 3
    # No client certificate where one is required (TLS 1.3: refused after the client's last flight).
    with pytest.raises((ssl.SSLError, ConnectionError)):
        client = await asyncio.to_thread(blocking_client, srv.port, client_context(certs))
        await asyncio.to_thread(client.sendall, b"get a\r\n")
        assert await asyncio.to_thread(client.recv, 100) == b""
        raise ConnectionError("closed")
    await asyncio.sleep(0.1)
    assert srv.made == [] and srv.server._handshakes == set()
    # Closing the server ends the handshakes under way.
    pending = socket.create_connection(("127.0.0.1", srv.port))
    for _ in range(100):
        if srv.server._handshakes:
            break
        await asyncio.sleep(0.01)
    assert len(srv.server._handshakes) == 1
    srv.close()
    assert srv.server._handshakes == set()
    pending.settimeout(5)
    assert pending.recv(10) == b""
    pending.close()

"""OpenSSL called directly by the compiled socket core (katsubushi_py/_tls_direct.h): the same events,
bytes and errors as through the ``_ssl`` object's methods (the compiled core with the switch off) and
as the reference core (PySocketCore), on a real TCP socket and the real event loop; and the daemon as
a real process serving TLS clients with it on and off (``KATSUBUSHI_TLS_DIRECT=0``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from conftest import DaemonFactory, decode
from pymemcache.client.base import Client
from test_tls_transport import Recorder, Server, bio_client_with_incoming, client_context, server_context
from tls_certs import Certs, make_certs

from katsubushi_py.compiled import speedups
from katsubushi_py.daemon import sockets
from katsubushi_py.daemon.sockets import PySocketTransport

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

#: (name, transport class, whether the compiled core calls OpenSSL directly)
CORES: list[Any] = [pytest.param(("python", PySocketTransport, False), id="python")]
if sockets.DIRECT:
    CORES.append(pytest.param(("methods", sockets.SocketTransport, False), id="compiled-methods"))
if sockets.TLS_DIRECT:
    CORES.append(pytest.param(("direct", sockets.SocketTransport, True), id="compiled-direct"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
async def core(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, type, bool]]:
    """The core under test; the compiled one with direct calls switched on or off for this test."""
    name, transport, direct = request.param
    if speedups is not None and sockets.TLS_DIRECT:
        direct_calls(direct)
    try:
        yield name, transport, direct
    finally:
        if speedups is not None and sockets.TLS_DIRECT:
            direct_calls(True)


def direct_calls(on: bool) -> bool:
    """Switch the compiled core's direct calls on (as the daemon does: with this Python's way of
    reporting a reset) or off."""
    assert speedups is not None
    if not on:
        return bool(speedups.tls_direct_setup(None))
    return bool(speedups.tls_direct_setup(ssl._ssl.__file__, sockets.SSL_RESET_IS_EOF))  # type: ignore[attr-defined]


async def wait_for(check: Callable[[], bool], seconds: float = 5) -> None:
    for _ in range(int(seconds / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def test_the_switch_and_the_check_of_the_object() -> None:
    """On by default where the compiled core is built; off for what is not an ``_ssl._SSLSocket``,
    and for one whose SSL does not point back to it."""
    if speedups is None:
        pytest.skip("the compiled core is not built")
    has_file = getattr(ssl._ssl, "__file__", None) is not None  # type: ignore[attr-defined]
    assert has_file == sockets.TLS_DIRECT
    assert direct_calls(False) is False
    assert speedups.tls_direct_setup("/nonexistent/_ssl.so") is False  # never loaded: RTLD_NOLOAD
    assert direct_calls(True) is True
    core = speedups.SocketCore()
    core._tls = object()  # not an SSL object: through its methods (which it does not have)
    assert core._tls_direct is False
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    obj = ctx.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO())._sslobj  # type: ignore[attr-defined]
    core._tls = obj
    assert core._tls_direct is True
    core._tls = None
    assert core._tls_direct is False


@pytest.mark.parametrize("core", CORES, indirect=True)
async def test_records_that_arrive_together_are_all_read(core: tuple[str, type, bool], certs: Certs) -> None:
    """Fifty records in one TCP write: the fd is readable once, the direct core reads ahead (one read
    takes several records), so what OpenSSL holds must be read without the fd announcing it."""
    _, transport, direct = core
    srv = Server(transport, server_context(certs), Recorder)
    sock, obj, _, outgoing = await asyncio.to_thread(bio_client_with_incoming, srv.port, client_context(certs))
    proto = await srv.first()
    assert getattr(proto.transport, "_tls_direct", False) is direct
    messages = [b"get k%d\r\n" % i for i in range(50)]
    for message in messages:
        obj.write(message)  # one record each
    await asyncio.to_thread(sock.sendall, outgoing.read())
    await wait_for(lambda: proto.received == b"".join(messages))
    assert proto.events == ["made"]
    proto.transport.close()
    await asyncio.wait_for(proto.lost, 5)
    sock.close()
    srv.close()


def damaged(record: bytes) -> bytes:
    """The record with one byte of its ciphertext flipped: its authentication fails."""
    return record[:10] + bytes([record[10] ^ 0x55]) + record[11:]


def oversized_header() -> bytes:
    """An application-data record header announcing more than a record may hold."""
    return b"\x17\x03\x03" + struct.pack(">H", 18 * 1024 + 1) + b"\x00" * 64


SCENARIOS = ["damaged record", "oversized record", "close_notify", "tcp close", "reset", "data then close"]


def how_the_server_ended(sock: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO) -> str:
    """What the client reads after the server ended: its close_notify, an alert, or nothing."""
    sock.settimeout(2)
    try:
        while data := sock.recv(65536):
            incoming.write(data)
    except OSError:
        pass
    incoming.write_eof()
    try:
        while obj.read(65536):
            pass
    except ssl.SSLZeroReturnError:
        return "close_notify"
    except ssl.SSLError as exc:
        return f"error {exc.reason or type(exc).__name__}"
    return "nothing"


async def run_scenario(scenario: str, transport: type, certs: Certs) -> tuple[list[str], bytes, str]:
    """What the server side saw (the protocol's events, the bytes it got) and how the client saw the
    server end (:func:`how_the_server_ended`)."""
    srv = Server(transport, server_context(certs), Recorder)
    sock, obj, incoming, outgoing = await asyncio.to_thread(bio_client_with_incoming, srv.port, client_context(certs))
    proto = await srv.first()
    obj.write(b"hello")
    await asyncio.to_thread(sock.sendall, outgoing.read())
    await wait_for(lambda: proto.received == b"hello")
    if scenario == "damaged record":
        obj.write(b"world")
        await asyncio.to_thread(sock.sendall, damaged(outgoing.read()))
    elif scenario == "oversized record":
        await asyncio.to_thread(sock.sendall, oversized_header())
    elif scenario == "close_notify":
        with contextlib.suppress(ssl.SSLWantReadError):
            obj.unwrap()  # writes our close_notify, then wants the server's
        await asyncio.to_thread(sock.sendall, outgoing.read())
    elif scenario == "tcp close":
        sock.shutdown(socket.SHUT_WR)
    elif scenario == "reset":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    elif scenario == "data then close":
        obj.write(b"world")
        await asyncio.to_thread(sock.sendall, outgoing.read())
        sock.shutdown(socket.SHUT_WR)
    await asyncio.wait_for(proto.lost, 5)
    srv.close()
    if scenario == "reset":
        end = "n/a"
    elif scenario == "close_notify":
        end = "n/a"  # (the client's object is shutting down: it reads no more application data)
        sock.close()
    else:
        end = await asyncio.to_thread(how_the_server_ended, sock, obj, incoming)
        sock.close()
    return proto.events, proto.received, end


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_errors_and_ends_are_the_same_events_on_every_core(scenario: str, certs: Certs) -> None:
    """A damaged record, a record too large, the peer's close_notify, its TCP close without one, a
    reset, data then a close: every core ends the connection the same way (eof or abort), with the
    same bytes delivered and the same answer on the wire (a close_notify after a graceful end, none
    after an abort)."""
    if not sockets.DIRECT:
        pytest.skip("the compiled core is not built")
    seen: dict[str, tuple[list[str], bytes, str]] = {}
    for param in CORES:
        name, transport, direct = param.values[0]
        if sockets.TLS_DIRECT:
            direct_calls(direct)
        try:
            seen[name] = await run_scenario(scenario, transport, certs)
        finally:
            if sockets.TLS_DIRECT:
                direct_calls(True)
    reference = seen["python"]
    expected_events = {
        "damaged record": ["made", "lost"],
        "oversized record": ["made", "lost"],
        "close_notify": ["made", "eof", "lost"],
        "tcp close": ["made", "eof", "lost"],
        # A reset: _ssl raises SSLEOFError (an end of file) before CPython 3.13, the OSError after.
        "reset": ["made", "eof", "lost"] if sockets._ssl_reports_a_reset_as_eof() else ["made", "lost"],
        "data then close": ["made", "eof", "lost"],
    }[scenario]
    assert reference[0] == expected_events
    assert reference[1] == (b"helloworld" if scenario == "data then close" else b"hello")
    # OpenSSL 3 answers a stream cut without close_notify with a decode_error alert (its "unexpected
    # eof" is fatal), a damaged or oversized record with the matching alert: the same on every core.
    assert (
        reference[2]
        == {
            "damaged record": "error SSLV3_ALERT_BAD_RECORD_MAC",
            "oversized record": "error TLSV1_ALERT_RECORD_OVERFLOW",
            "close_notify": "n/a",
            "tcp close": "error TLSV1_ALERT_DECODE_ERROR",
            "reset": "n/a",
            "data then close": "error TLSV1_ALERT_DECODE_ERROR",
        }[scenario]
    )
    for name, got in seen.items():
        assert got == reference, f"{name} differs from the reference core: {got} != {reference}"


def stats_settings(sock: ssl.SSLSocket) -> dict[str, str]:
    sock.sendall(b"stats settings\r\n")
    got = b""
    while not got.endswith(b"END\r\n"):
        chunk = sock.recv(65536)
        assert chunk, "closed"
        got += chunk
    return {line.split()[1]: line.split()[2] for line in got.decode().splitlines() if line.startswith("STAT ")}


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "methods"])
def test_the_daemon_serves_tls_clients_with_direct_calls_on_and_off(
    daemons: DaemonFactory, certs: Certs, direct: str
) -> None:
    """The daemon as a real process, ``KATSUBUSHI_TLS_DIRECT`` on (the default) and off: ``stats
    settings`` says which; pymemcache over TLS gets IDs; a raw TLS client pipelines 200 GETs of 100
    keys in one write (many records, read ahead) and gets every reply, in order; every ID is unique
    and increasing."""
    d = daemons.start(
        "--tls-cert", certs.server.cert, "--tls-key", certs.server.key, env={"KATSUBUSHI_TLS_DIRECT": direct}
    )
    ctx = client_context(certs)
    client = Client(("127.0.0.1", d.port), tls_context=ctx, connect_timeout=5, timeout=5)
    ids = [int(client.get("a")) for _ in range(50)]  # type: ignore[arg-type]
    ids += [int(v) for v in client.get_many([f"k{i}" for i in range(100)]).values()]
    client.close()
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", d.port), timeout=10), server_hostname="localhost") as s:
        on = stats_settings(s)["tls_openssl_direct"]
        compiled = sockets.TLS_DIRECT and os.environ.get("KATSUBUSHI_NO_EXTENSIONS", "") in ("", "0")
        assert on == ("yes" if direct == "1" and compiled else "no")
        request = b"get " + b" ".join(b"k%d" % i for i in range(100)) + b"\r\n"
        s.sendall(request * 200)
        got = b""
        while got.count(b"END\r\n") < 200:
            chunk = s.recv(1 << 20)
            assert chunk, "closed before every reply"
            got += chunk
    values = [int(line) for line in got.split(b"\r\n") if line.isdigit()]
    assert len(values) == 200 * 100
    ids += values
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert decode(ids[0])[1] == 7

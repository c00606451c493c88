"""The transport fuzz target: the fuzzer's bytes sent by a client over a real socket pair, in chunks, to
the daemon's memcached connection handling on a real event loop, once through the compiled socket
transport and protocol glue (``_speedups.SocketCore``, ``ProtocolCore``, the compiled connection
cores) and once through their pure-Python twins. The client may read its replies at once or late (with a
small ``--read-ahead`` so that flow control, held input and pausing are exercised), and ends with EOF.

Checked: both answer the same bytes (ID values aside) and both close, or neither; no exception reaches
the event loop; what a connection holds stays under the read-ahead plus one read; and the conversation
ends (a hang is a finding: the target fails after 10 s).

The clock is one injected clock that moves only when a command must wait for it: the loop's
``call_later`` for a clock wait fast-forwards it, so that waits cost no real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import types
from typing import Any

from targets import Bytes, chunkings  # type: ignore[import-not-found]
from twins import PureIssuer, StepClock, mask_ids, pure_twin  # type: ignore[import-not-found]

from katsubushi_py.daemon import connection, sockets
from katsubushi_py.daemon.admission import Admission
from katsubushi_py.daemon.stats import Stats
from katsubushi_py.frontends.binary import BinaryConnection
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer

READ_SIZE = sockets.READ_SIZE


class _FastForward:
    """The daemon's loop as the connection glue sees it: ``call_later`` moves the fake clock instead of
    waiting (and runs the callback on the next turn)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, clock: StepClock) -> None:
        self._loop = loop
        self._clock = clock

    def call_later(self, seconds: float, callback: Any, *args: Any) -> asyncio.Handle:
        self._clock.advance_ns(int(seconds * 1e9) + 1)
        return self._loop.call_soon(callback, *args)


class _Config:
    def __init__(self, read_ahead: int) -> None:
        self.max_connections = 100
        self.gets_cas = False
        self.idle_timeout = 0
        self.read_ahead = read_ahead


class _Daemon:
    """What ConnectionHandler uses of the daemon."""

    def __init__(self, issuer: Any, loop: Any, read_ahead: int) -> None:
        self.issuer = issuer
        self.loop = loop
        self.config = _Config(read_ahead)
        self.stats = Stats(issuer)
        self.connections: set[Any] = set()
        self.stopping = False
        self.credentials = None  # no --auth-file: connections speak memcached from the first byte
        mc = self.config.max_connections
        self.admission = Admission(mc, mc // 2, self.connections, lambda: (), self.stats)

    def connection_closed(self) -> None:
        pass


_pure_handler: type | None = None


def pure_handler() -> type:
    """ConnectionHandler on PyProtocolCore, creating the pure twins of the connection cores (what
    ``KATSUBUSHI_NO_EXTENSIONS=1`` runs)."""
    global _pure_handler
    if _pure_handler is None:
        cls = connection.ConnectionHandler
        text, binary = pure_twin(TextConnection), pure_twin(BinaryConnection)
        namespace: dict[str, Any] = {}
        for name, value in vars(cls).items():
            if name in cls.__slots__ or name in ("__dict__", "__weakref__"):
                continue
            if isinstance(value, types.FunctionType):
                scope = {**value.__globals__, "TextConnection": text, "BinaryConnection": binary}
                scope["_HOLDS_INPUT"] = (text, binary)
                value = types.FunctionType(value.__code__, scope, value.__name__, value.__defaults__, value.__closure__)
            namespace[name] = value
        namespace["data_received"] = namespace["_data_received"]
        _pure_handler = type("PureConnectionHandler", (connection.PyProtocolCore, asyncio.Protocol), namespace)
    return _pure_handler


def _issuer(pure: bool, clock: StepClock) -> Any:
    layout = Layout(sequence_bits=6, worker_bits=16, time_bits=41)  # 64 IDs a ms: refills and waits
    gen_class = pure_twin(Generator) if pure else Generator
    generator = gen_class(5, layout, clock=clock, block_on_clock=False)
    return (PureIssuer if pure else Issuer)(generator, "1.0.0")


async def converse(pure: bool, chunks: list[bytes], late_reader: bool, read_ahead: int) -> tuple[bytes, bool, int]:
    """One conversation; returns what the client received, whether the server closed, and the most
    input the connection held at any read."""
    loop = asyncio.get_running_loop()
    clock = StepClock()
    daemon = _Daemon(_issuer(pure, clock), _FastForward(loop, clock), read_ahead)
    handler = (pure_handler() if pure else connection.ConnectionHandler)(daemon)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.setblocking(False)
    held = [0]
    transport_class = sockets.PySocketTransport if pure else sockets.SocketTransport
    transport = transport_class(loop, ours, handler)
    original = handler.data_received

    def watched(data: bytes) -> None:
        original(data)
        held[0] = max(held[0], len(getattr(handler._conn, "_buffer", b"")))

    transport.start()
    transport._data_received = watched
    sent = asyncio.Event()
    received = bytearray()

    async def reader() -> None:
        if late_reader:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sent.wait(), 0.05)
        while True:
            chunk = await loop.sock_recv(theirs, 1 << 16)
            if not chunk:
                return
            received.extend(chunk)

    task = asyncio.ensure_future(reader())
    try:
        for chunk in chunks:
            await loop.sock_sendall(theirs, chunk)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        sent.set()
        theirs.shutdown(socket.SHUT_WR)
        await asyncio.wait_for(task, 10)
    except (ConnectionResetError, BrokenPipeError):
        sent.set()
        await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        theirs.close()
        transport.abort()
        await asyncio.sleep(0)
    return bytes(received), True, held[0]


_loop: asyncio.AbstractEventLoop | None = None


def transport(data: bytes) -> None:
    """The target: the input as a client's bytes, in chunks, with each transport and glue."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        _loop.set_exception_handler(_fail_on_loop_error)
    b = Bytes(data)
    options, seed = b.byte(), b.u16()
    payload = b.rest()
    if not payload:
        return
    if options & 2 and payload[0] != 0x80:
        payload = b"\x80" + payload
    read_ahead = 1 << 20 if options & 4 == 0 else 512
    late = bool(options & 8)
    chunks = chunkings(payload, seed)[-1]
    results = []
    for pure in (False, True):
        got, closed, held = _loop.run_until_complete(converse(pure, chunks, late, read_ahead))
        assert held <= read_ahead + READ_SIZE, f"{held} bytes held (read-ahead {read_ahead})"
        results.append((mask_ids(got), closed))
    assert results[0] == results[1], f"the compiled and pure transports differ:\n{results[0]!r}\n{results[1]!r}"
    if _errors:
        raise AssertionError(f"an exception reached the event loop: {_errors.pop()!r}")


_errors: list[Any] = []


def _fail_on_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    _errors.append(context.get("exception") or context.get("message"))

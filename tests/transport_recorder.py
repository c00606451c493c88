"""What the socket transport tests share (tests/test_socket_transport.py on plain sockets,
tests/test_tls_transport.py on TLS): the transport classes each case runs with, and a protocol that
records what the transport told it. One copy, so that both files judge the transport by the same
record: a change to what the protocol is told shows in both."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from katsubushi_py.daemon import sockets
from katsubushi_py.daemon.sockets import PySocketTransport

# The reference core always; the compiled one where it is built.
TRANSPORTS = [pytest.param(PySocketTransport, id="python")]
if sockets.DIRECT:
    TRANSPORTS.append(pytest.param(sockets.SocketTransport, id="compiled"))


class Recorder(asyncio.Protocol):
    """Answers every read with ``reply(data)`` and records what the transport told it: ``events`` (made,
    eof, pause_writing, resume_writing, lost), every read as it came (``reads``) and all of them
    (``received``). ``on_made(transport)`` runs as the connection is made (a small buffer, say);
    ``keep_open_at_eof`` is what ``eof_received`` answers. Both by keyword only: the two files' copies
    took different second arguments."""

    def __init__(
        self,
        reply: Callable[[bytes], bytes] | None = None,
        *,
        keep_open_at_eof: bool = False,
        on_made: Callable[[Any], None] | None = None,
    ) -> None:
        self.events: list[str] = []
        self.reads: list[bytes] = []
        self.reply = reply
        self.keep_open_at_eof = keep_open_at_eof
        self.on_made = on_made
        self.transport: Any = None
        self.lost = asyncio.get_running_loop().create_future()

    @property
    def received(self) -> bytes:
        return b"".join(self.reads)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.events.append("made")
        if self.on_made is not None:
            self.on_made(transport)

    def data_received(self, data: bytes) -> None:
        self.reads.append(data)
        if self.reply is not None:
            self.transport.write(self.reply(data))

    def eof_received(self) -> bool:
        self.events.append("eof")
        return self.keep_open_at_eof

    def pause_writing(self) -> None:
        self.events.append("pause_writing")

    def resume_writing(self) -> None:
        self.events.append("resume_writing")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append("lost")
        self.lost.set_result(exc)

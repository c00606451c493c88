"""Misbehaving servers for the client tests (real sockets on 127.0.0.1), and ways to make a real daemon
answer SERVER_ERROR."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from pathlib import Path

from conftest import Daemon, DaemonFactory, recv_until

#: A well-formed reply carrying an ID no daemon of the tests issues (worker 0): if a test ever sees it
#: come out of a client, the client took a reply it should have dropped.
FAKE_ID = 1574026156804435968
FAKE_REPLY = b"VALUE id 0 19\r\n%d\r\nEND\r\n" % FAKE_ID


def address(daemon: Daemon) -> str:
    return f"127.0.0.1:{daemon.port}" if daemon.port is not None else f"unix:{daemon.sock}"


class Blackhole:
    """A listening socket that never accepts: connects succeed (the kernel's backlog), nothing is
    ever answered, like a server whose process is stopped or a firewall that drops replies."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeServer:
    """Accepts connections (and counts them); to each request line answers ``reply`` after ``delay``
    seconds, or, with ``trickle``, one byte every ``trickle`` seconds. ``reply=None`` closes each
    connection as soon as it is accepted. ``disconnects`` counts connections the client closed."""

    def __init__(self, reply: bytes | None, *, delay: float = 0.0, trickle: float = 0.0) -> None:
        self.reply = reply
        self.delay = delay
        self.trickle = trickle
        self.accepted = 0
        self.disconnects = 0
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            if self.reply is None:
                conn.close()
                continue
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        assert self.reply is not None
        with contextlib.suppress(OSError):
            conn.settimeout(0.05)
            buffer = b""
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    self.disconnects += 1
                    return
                buffer += chunk
                while b"\n" in buffer and not self._stop.is_set():
                    _, buffer = buffer.split(b"\n", 1)
                    if self._stop.wait(self.delay):
                        return
                    if self.trickle:
                        for i in range(len(self.reply)):
                            conn.sendall(self.reply[i : i + 1])
                            if self._stop.wait(self.trickle):
                                return
                    else:
                        conn.sendall(self.reply)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(5)
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refused_address() -> str:
    """A loopback port where nothing listens (bound and released just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_failing_state_file_daemon(daemons: DaemonFactory, tmp_path: Path, worker_id: int) -> Daemon:
    """A real daemon whose state file's directory was removed: it can no longer reserve time ahead,
    so once its first window (2 s) is used up every GET gets ``SERVER_ERROR cannot write state
    file ...`` while the connection stays up. Returns once it answers so."""
    state_dir = tmp_path / f"state-{worker_id}"
    state_dir.mkdir()
    daemon = daemons.start("--state-file", str(state_dir / "state"), worker_id=worker_id)
    shutil.rmtree(state_dir)
    deadline = time.monotonic() + 15
    with daemon.connect() as sock:
        while True:
            sock.sendall(b"get probe\r\n")
            reply = recv_until(sock, b"\r\n")
            if reply.startswith(b"SERVER_ERROR"):
                assert b"state file" in reply, reply
                return daemon
            if not reply.endswith(b"END\r\n"):
                recv_until(sock, b"END\r\n")
            assert time.monotonic() < deadline, "the daemon kept issuing without its state file"
            time.sleep(0.05)


def hold_only_connection(daemon: Daemon) -> socket.socket:
    """Take the one connection a ``--max-connections 1`` daemon allows; every other connection then
    gets ``SERVER_ERROR too many connections``. Returns once the daemon has counted it (the factory's
    readiness probe may still hold the slot for a moment)."""
    deadline = time.monotonic() + 10
    while True:
        sock = daemon.connect()
        sock.sendall(b"version\r\n")
        reply = recv_until(sock, b"\r\n")
        if reply.startswith(b"VERSION"):
            return sock
        sock.close()
        assert reply == b"SERVER_ERROR too many connections\r\n", reply
        assert time.monotonic() < deadline, "the daemon kept refusing its only connection"
        time.sleep(0.02)

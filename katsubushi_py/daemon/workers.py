"""``--workers N``: N daemon processes behind the same listeners, one worker id each, one supervisor.

Why processes: one event loop uses one core, and the GIL keeps threads from doing better. memcached
answers a multi-core host with threads (``-t N``); an ID daemon can answer it with processes, because
every process only needs a worker id of its own: IDs of different worker ids never collide, so the
processes share nothing but the listening sockets. The cost is ID space: N worker ids per host.

How the sockets are shared:

- **TCP** (memcached, HTTP and gRPC): the supervisor opens one socket per process with ``SO_REUSEPORT``, all
  bound to the same address, so the kernel spreads new connections over the processes. It keeps them
  open: a process that dies is restarted on the same socket, and connections that arrived meanwhile
  wait in its backlog rather than being refused.
- **The unix socket** (and sockets passed by systemd): one listening socket, inherited by every
  process, which all accept from it. The supervisor owns the socket file and removes it at the end.

Worker ids: consecutive from ``--worker-id`` (or from a host name ordinal times N, see
:mod:`katsubushi_py.config`), or each process leases its own from Redis. State files are per worker
id in the state directory, so each process has its own, locked while it runs.

The supervisor restarts a process that dies (at once if it had run for 10 s; one that dies sooner
after 0.5 s, doubling while it keeps dying that soon, up to 30 s), stops every process on SIGTERM or
SIGINT (each drains as a single daemon does) and exits 0. If a process cannot start at all in the
first seconds (a state file in use, say), the supervisor stops the others and exits 1: that is a
configuration problem, not a crash.

STATS: each process answers with its own fields, plus ``worker_processes``, ``worker_process`` (its
index) and ``all_processes_*`` sums of the main counters over every process, which each process
publishes at least once a second on a small shared memory board (:class:`Board`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..config import ServerConfig
from .activation import ActivationError, describe, inherited_sockets
from .server import Listeners, StartupError, prepare_unix_socket, startup_warnings
from .sockets import bind_unix

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("katsubushi_py")

# A process that dies this soon after starting is restarted after a pause, doubled while it keeps dying
# that soon; one that ran longer is restarted at once. (docs/operations.md says so: keep them in step.)
_QUICK_DEATH_S = 10.0
_FIRST_PAUSE_S = 0.5
_MAX_PAUSE_S = 30.0
# A process that cannot start within this long of the supervisor's start is a configuration problem.
_STARTUP_GRACE_S = 3.0
_STOP_TIMEOUT_S = 5.0


class Board:
    """Counters every process publishes for the others' STATS: a shared anonymous mapping made
    before the processes fork, one 64-byte slot each, written only by its owner."""

    FIELDS = ("pid", "worker_id", "cmd_get", "get_hits", "get_misses", "curr_connections", "total_connections")
    _SLOT = struct.Struct("<8q")  # the fields above, then when the slot was written (monotonic ms)

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._map = mmap.mmap(-1, self._SLOT.size * processes)

    def publish(self, index: int, values: tuple[int, ...]) -> None:
        self._SLOT.pack_into(self._map, index * self._SLOT.size, *values, time.monotonic_ns() // 1_000_000)

    def read(self) -> list[dict[str, int]]:
        rows = []
        for index in range(self.processes):
            values = self._SLOT.unpack_from(self._map, index * self._SLOT.size)
            rows.append(dict(zip((*self.FIELDS, "written_ms"), values, strict=True)))
        return rows


def attach(daemon: Daemon, board: Board, index: int) -> None:
    """In worker process ``index``: publish this process's counters on the board (every second, and
    whenever STATS is asked), and add the summary of every process to its STATS."""
    stats = daemon.stats

    def publish() -> None:
        cmd_get, get_hits, get_misses = daemon.issuer.totals()
        board.publish(
            index,
            (
                os.getpid(),
                daemon.generator.worker_id,
                cmd_get,
                get_hits,
                get_misses,
                stats.curr_connections,
                stats.total_connections,
            ),
        )

    def every_second() -> None:
        publish()
        daemon.loop.call_later(1.0, every_second)

    def fields() -> list[tuple[str, object]]:
        publish()
        rows = board.read()
        summary: list[tuple[str, object]] = [("worker_processes", board.processes), ("worker_process", index)]
        for name in ("cmd_get", "get_hits", "get_misses", "curr_connections", "total_connections"):
            summary.append((f"all_processes_{name}", sum(row[name] for row in rows)))
        return summary

    stats.processes = fields
    every_second()


@dataclass
class ProcessSlot:
    index: int
    config: ServerConfig
    listeners: Listeners
    pid: int = 0
    started: float = 0.0
    pause: float = 0.0
    restart_at: float | None = None


def reuseport_sockets(host: str, port: int, count: int, backlog: int) -> list[socket.socket]:
    """``count`` listening TCP sockets on one address with SO_REUSEPORT (port 0: the first one's)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(info[0], socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(info[4])
            sock.listen(backlog)
            sock.setblocking(False)
            port = sock.getsockname()[1]
    except OSError as exc:
        for sock in sockets:
            sock.close()
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise StartupError(f"cannot listen on {host}:{port}: {reason}") from None
    return sockets


def unix_socket(path: str, mode: int | None, backlog: int) -> socket.socket:
    prepare_unix_socket(path)
    try:
        sock = bind_unix(path, mode)  # with its mode before it listens
    except OSError as exc:
        raise StartupError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    try:
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {path}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


def _die_with(supervisor: int) -> None:
    """Have the kernel send this worker process SIGTERM when the supervisor dies, even by SIGKILL, so
    that no worker outlives it holding a worker id (Linux ``PR_SET_PDEATHSIG``; elsewhere the worker
    notices nothing, as with any daemon whose parent dies)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != supervisor:  # it died before the request took effect
        os._exit(1)


def _all(listeners: Listeners) -> list[socket.socket]:
    return [*listeners.memcached, *listeners.http, *listeners.grpc, *listeners.plain]


def child_config(config: ServerConfig, index: int) -> ServerConfig:
    """Process ``index``'s configuration: its own worker id (or its own lease)."""
    worker_id = None if config.worker_id is None else config.worker_id + index
    source = config.worker_id_source if index == 0 else f"{config.worker_id_source} + {index} (worker process {index})"
    return replace(
        config,
        worker_id=worker_id,
        worker_id_source=source,
        workers=1,
    )


class Supervisor:
    """Starts, restarts and stops the worker processes (see the module's docstring)."""

    def __init__(self, config: ServerConfig, run_child: Callable[[ServerConfig, Listeners, Board, int], int]) -> None:
        self.config = config
        self.run_child = run_child
        self.board = Board(config.workers)
        self.slots: list[ProcessSlot] = []
        self._shared: list[socket.socket] = []
        self._unix_path: str | None = None
        self._stopping = False
        self._started = time.monotonic()
        self._failed_status = 1  # the exit status when a worker process cannot start (2: refused)

    # -- sockets ---------------------------------------------------------------------------------
    def open_listeners(self) -> None:
        config = self.config
        backlog = min(4096, max(128, config.max_connections))
        count = config.workers
        per_process: list[Listeners] = [Listeners() for _ in range(count)]
        try:
            inherited = inherited_sockets()
        except ActivationError as exc:
            raise StartupError(str(exc)) from None
        shared = list(inherited)
        if not inherited:
            if config.port is not None:
                for listeners, sock in zip(
                    per_process, reuseport_sockets(config.host, config.port, count, backlog), strict=True
                ):
                    listeners.memcached.append(sock)
            if config.sock:
                shared.append(unix_socket(config.sock, config.sock_mode, backlog))
                self._unix_path = config.sock
        if config.http_port is not None:
            for listeners, sock in zip(
                per_process, reuseport_sockets(config.host, config.http_port, count, backlog), strict=True
            ):
                listeners.http.append(sock)
        if config.grpc_port is not None:
            for listeners, sock in zip(
                per_process, reuseport_sockets(config.host, config.grpc_port, count, backlog), strict=True
            ):
                listeners.grpc.append(sock)
        if config.plain_port is not None:  # --plain-port: plain memcached on loopback beside TLS
            for listeners, sock in zip(
                per_process, reuseport_sockets("127.0.0.1", config.plain_port, count, backlog), strict=True
            ):
                listeners.plain.append(sock)
        for listeners in per_process:
            listeners.memcached.extend(shared)
        self._shared = shared
        self.slots = [ProcessSlot(i, child_config(config, i), per_process[i]) for i in range(count)]

    def addresses(self) -> list[str]:
        """Where the processes listen (the first one's listeners, and gRPC's)."""
        first = self.slots[0].listeners if self.slots else Listeners()
        tls = self.config.tls is not None  # then every TCP listener but --plain-port has it
        found = [
            ("tls://" if tls and sock.family != socket.AF_UNIX else "") + describe(sock) for sock in first.memcached
        ]
        found += [("https://" if tls else "http://") + describe(s) for s in first.http]
        if self.config.grpc_port is not None:
            found.append(f"{'grpc+tls' if tls else 'grpc'}://{self.config.host}:{self.config.grpc_port}")
        return found

    def close_listeners(self) -> None:
        for slot in self.slots:
            for sock in _all(slot.listeners):
                with contextlib.suppress(OSError):
                    sock.close()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)
            self._unix_path = None

    # -- processes -------------------------------------------------------------------------------
    def spawn(self, slot: ProcessSlot) -> None:
        supervisor = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker process
            code = 1
            try:
                _die_with(supervisor)
                # A reload asked for before this process serves has nothing to reload yet (its files
                # are read as it starts): ignored until serve() installs the handler, not fatal. Set
                # before the signals are unblocked, so that none arrives to the default action.
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                    signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                mine = {id(sock) for sock in _all(slot.listeners)}
                for other in self.slots:  # another process's SO_REUSEPORT socket must not stay open here
                    for sock in _all(other.listeners):
                        if id(sock) not in mine:
                            sock.close()
                code = self.run_child(slot.config, slot.listeners, self.board, slot.index)
            except BaseException:  # whatever happens, never return into the supervisor
                log.exception("worker process %d failed", slot.index)
            finally:
                os._exit(code)
        slot.pid = pid
        slot.started = time.monotonic()
        slot.restart_at = None

    def run(self) -> int:
        """Open the listeners, start every process, supervise until a signal; the exit status."""
        self.open_listeners()
        watched = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, watched)
        # SIGHUP was ignored since the command started (katsubushi_py.entry); blocked now, it waits for
        # sigwaitinfo below under its default action, which a blocked signal never takes (an ignored
        # one may be discarded at once, POSIX says).
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        status = 0
        try:
            for slot in self.slots:
                self.spawn(slot)
            log.info(
                "supervising %d worker processes (pids %s)",
                len(self.slots),
                ", ".join(str(slot.pid) for slot in self.slots),
            )
            for line in startup_warnings(self.addresses(), self.config.tls, self.config.auth):
                log.warning("%s", line)
            while not self._stopping:
                timeout = self._next_restart_in()
                if timeout is None:
                    info = signal.sigwaitinfo(watched)
                else:  # a restart is due: wait at most until then
                    info = signal.sigtimedwait(watched, timeout) if timeout > 0 else None
                if info is not None and info.si_signo in (signal.SIGTERM, signal.SIGINT):
                    log.info("stopping %d worker processes", len(self.slots))
                    break
                if info is not None and info.si_signo == signal.SIGHUP:  # a reload: every process rereads
                    for slot in self.slots:
                        if slot.pid:
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(slot.pid, signal.SIGHUP)
                    continue
                failed = self._reap()
                if failed is not None:
                    status = self._failed_status
                    log.error("%s; stopping the other worker processes", failed)
                    break
                self._restart_due()
        finally:
            self._stop_all()
            self.close_listeners()
            # A reload asked for while stopping is dropped, not taken for the end of the supervisor
            # (ignoring a signal discards it if pending) once the signals are unblocked.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        return status

    def _next_restart_in(self) -> float | None:
        due = [slot.restart_at for slot in self.slots if slot.restart_at is not None]
        return None if not due else max(0.0, min(due) - time.monotonic())

    def _reap(self) -> str | None:
        """Collect every process that ended; schedule its restart. A message if start-up failed."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is None:
                continue
            code = os.waitstatus_to_exitcode(wait_status)
            slot.pid = 0
            lived = time.monotonic() - slot.started
            how = f"exited with status {code}" if code >= 0 else f"was killed by signal {-code}"
            if code == 1 and time.monotonic() - self._started < _STARTUP_GRACE_S:
                self._failed_status = 1
                return f"worker process {slot.index} could not start ({how})"
            if code == 2:  # a configuration to fix (a Redis refused as unsafe): restarting cannot help
                self._failed_status = 2
                return f"worker process {slot.index} refused to run ({how})"
            slot.pause = 0.0 if lived >= _QUICK_DEATH_S else min(_MAX_PAUSE_S, max(_FIRST_PAUSE_S, slot.pause * 2))
            slot.restart_at = time.monotonic() + slot.pause
            log.error(
                "worker process %d (pid %d, worker id %s) %s after %.1f s; restarting it%s",
                slot.index,
                pid,
                "leased" if slot.config.worker_id is None else slot.config.worker_id,
                how,
                lived,
                f" in {slot.pause:.1f} s" if slot.pause else "",
            )

    def _restart_due(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.restart_at is not None and slot.restart_at <= now and slot.pid == 0:
                self.spawn(slot)

    def _stop_all(self) -> None:
        """SIGTERM to every process; each drains its connections and exits; SIGKILL the stragglers."""
        self._stopping = True
        running = [slot for slot in self.slots if slot.pid]
        for slot in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        for slot in running:
            while slot.pid:
                try:
                    pid, _ = os.waitpid(slot.pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid:
                    break
                if time.monotonic() > deadline:
                    log.warning("worker process %d did not stop in %.0f s; killing it", slot.index, _STOP_TIMEOUT_S)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(slot.pid, signal.SIGKILL)
                    os.waitpid(slot.pid, 0)
                    break
                time.sleep(0.01)
            slot.pid = 0

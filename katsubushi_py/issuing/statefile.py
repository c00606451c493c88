"""A durable high-water mark: the latest millisecond this daemon may have put into an ID.

Why: go-katsubushi (and Leaf, and most snowflake servers) keep nothing across a restart, so a
daemon restarted after the wall clock stepped back reissues IDs it already gave out. The generator
reserves a window ahead (say 2 s) in this file *before* issuing IDs in it, so every ID ever issued
has a time at or below the stored mark, and a restarted generator starts strictly after it.

The file is one JSON line with a CRC so that a damaged file is an error, never a silent reset.
Writes go to a temporary file that is fsynced, renamed over the old one, and the directory is
fsynced, so a crash leaves either the old mark or the new one.

**Ownership.** A mark protects only if one daemon at a time issues under it: two daemons given the
same file (a copy-pasted unit file, two containers on one volume) would each trust a mark the other
keeps moving. So a daemon holds an exclusive ``flock`` on ``<file>.lock`` for as long as it issues
under the file (the state file itself is replaced on every write, so it cannot carry the lock), and
the file records the worker id it was written for. The kernel drops the lock when the process dies,
so a crash never leaves a stale lock behind.

**One file, whatever path reaches it.** The lock file is named after the state file's real path
(symlinks resolved, the file's and its directories'), so a daemon given a symlink locks what a daemon
given the file locks, and the file is replaced at its real path (a symlink an operator made stays a
symlink). A hard link cannot be resolved to one name: a state file with more than one is refused when
it is locked (a daemon given the other name would lock another lock file), and while a daemon holds
one that gained a link it writes it in place instead of replacing it, so the link is never silently
broken into a stale copy that a daemon could later start from. What is not caught: a single file
bind-mounted at two places (two mount points, one inode, one link).

**Descriptors.** Client sockets and the state file draw on one descriptor table: a flood of idle
connections can fill it (``EMFILE`` under a ``LimitNOFILE``), and a write that then needs a new
descriptor would fail, leaving clients already served unable to get an ID. So a locked state file
keeps its directory open (the directory's fsync needs no new descriptor) and the process keeps a
reserve of spare descriptors (:class:`_Reserve`, two ``/dev/null`` opens): an ``open`` refused with
``EMFILE`` or ``ENFILE`` releases one and tries again (the kernel gives the lowest free number, the
one just released), and the reserve is refilled as soon as the write's descriptor is closed. Every
write refused for want of descriptors is logged (rate-limited).

**State directory.** :class:`StateDirectory` keeps one such file per worker id,
``DIR/worker-<id>.state``: a daemon with a static worker id uses its own, and a daemon leasing worker
ids from Redis uses the file of each id it holds, so it never issues under an id at or below the
last millisecond it (or another daemon of this host) may have issued under it, whatever Redis says.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import zlib
from pathlib import Path

from ..ratelimit import refusals
from .errors import StateFileError

FORMAT = "katsubushi-py-state/1"

log = logging.getLogger("katsubushi_py")

_EXHAUSTED = (errno.EMFILE, errno.ENFILE)


class _Reserve:
    """Spare descriptors kept for the state file's writes (see the module's docstring). One per
    process (a forked ``--workers`` process inherits the supervisor's and keeps its own copies)."""

    SIZE = 2

    def __init__(self) -> None:
        self._spare: list[int] = []
        #: Opens that needed a spare descriptor, and writes refused even so (for tests and STATS).
        self.used = 0
        self.refused = 0

    def refill(self) -> None:
        """Take descriptors back up to :attr:`SIZE`, as far as the table allows now."""
        while len(self._spare) < self.SIZE:
            try:
                self._spare.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                return

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o644, dir_fd: int | None = None) -> int:
        """``os.open``; refused for want of descriptors, again with a spare one released."""
        try:
            return os.open(path, flags | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in _EXHAUSTED or not self._spare:
                raise
            why = exc.strerror or str(exc)
        os.close(self._spare.pop())
        self.used += 1
        _refused(
            "state-file-reserve",
            logging.WARNING,
            "out of file descriptors (%s): the state file is written with a reserved one; clients are"
            " holding the rest (see --max-connections and LimitNOFILE)",
            why,
        )
        return os.open(path, flags | os.O_CLOEXEC, mode, dir_fd=dir_fd)

    def release(self) -> None:
        """Close the spares (tests; a process about to exec)."""
        while self._spare:
            os.close(self._spare.pop())


def _refused(kind: str, level: int, message: str, *args: object) -> None:
    """A rate-limited log line (the daemon's, when it runs; plain logging otherwise)."""
    refusals(kind, level, message, *args)


#: The process's reserve, filled when a state file is first locked.
reserve = _Reserve()


class StateFileInUse(StateFileError):
    """Another process holds the state file's lock: it issues IDs under this file's worker id."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def _crc(high_water_ms: int, worker_id: int) -> int:
    return zlib.crc32(f"{FORMAT}:{high_water_ms}:{worker_id}".encode())


class StateFile:
    """Reads and atomically replaces the high-water mark stored at ``path``; :meth:`lock` makes this
    process its only user."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        #: The path as given (in messages); :attr:`real_path` is the file it reaches.
        self.path = Path(path)
        self.real_path = Path(os.path.realpath(self.path))
        self.lock_path = self.real_path.with_name(self.real_path.name + ".lock")
        #: The worker id the file was last written for (set by :meth:`load`; None: no file yet).
        self.recorded_worker_id: int | None = None
        self._lock_fd: int | None = None
        #: The directory, kept open while locked: its fsync needs no new descriptor.
        self._dir_fd: int | None = None
        self._warned_links = False

    @property
    def described(self) -> str:
        """The path as given, and the file it reaches when that is another one (through a symlink)."""
        if self.real_path == self.path.absolute():
            return str(self.path)
        return f"{self.path} (that is, {self.real_path})"

    def _links(self) -> int:
        """How many hard links the state file has (0: it does not exist yet)."""
        try:
            return os.stat(self.real_path).st_nlink
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.described}: {exc.strerror or exc}") from None

    # -- ownership ---------------------------------------------------------------------------------
    @property
    def locked(self) -> bool:
        return self._lock_fd is not None

    def lock(self) -> None:
        """Take the file for this process, or raise :class:`StateFileInUse` naming the holder's pid.
        Idempotent. The lock lives as long as this object (or the process) does."""
        if self._lock_fd is not None:
            return
        reserve.refill()
        try:
            fd = reserve.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StateFileError(
                f"cannot write state file {self.described} (its lock file {self.lock_path.name}): {exc.strerror or exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            holder = f"pid {pid}" if pid is not None else "another process"
            raise StateFileInUse(f"state file {self.described} is in use by {holder}", pid) from None
        except OSError as exc:
            os.close(fd)
            raise StateFileError(f"cannot lock state file {self.described}: {exc.strerror or exc}") from None
        try:
            links = self._links()
        except StateFileError:
            os.close(fd)
            raise
        if links > 1:
            os.close(fd)
            raise StateFileError(
                f"state file {self.described} has {links} hard links: a daemon given another of its names would"
                f" lock another lock file and issue under the same worker id. Give each daemon its own state"
                f" file, and remove the other links (find them: find / -xdev -samefile {self.real_path})"
            )
        try:
            self._dir_fd = reserve.open(self.real_path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            os.close(fd)
            raise StateFileError(
                f"cannot open the directory of state file {self.described}: {exc.strerror or exc}"
            ) from None
        with contextlib.suppress(OSError):  # the pid is for messages only
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        reserve.refill()

    def unlock(self) -> None:
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            os.close(dir_fd)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def __del__(self) -> None:  # a dropped generator (or a crash) must not keep the file taken
        with contextlib.suppress(Exception):
            self.unlock()

    # -- the mark ----------------------------------------------------------------------------------
    def load(self) -> int | None:
        """The stored mark in unix ms, or None when no file exists yet. Sets :attr:`recorded_worker_id`."""
        try:
            raw = self.real_path.read_bytes()
        except FileNotFoundError:
            self.recorded_worker_id = None
            return None
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.described}: {exc.strerror or exc}") from None
        try:
            doc = json.loads(raw)
            mark = doc["high_water_ms"]
            worker_id = doc["worker_id"]
            ok = (
                doc["format"] == FORMAT
                and isinstance(mark, int)
                and isinstance(worker_id, int)
                and doc["crc32"] == _crc(mark, worker_id)
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise StateFileError(
                f"state file {self.described} is damaged (not a {FORMAT} record); refusing to guess the last"
                " issued time. Move it away only if you know no ID was issued after the clock's current time."
            )
        self.recorded_worker_id = worker_id
        return mark

    def store(self, high_water_ms: int, worker_id: int) -> None:
        """Durably replace the mark. Raises StateFileError when that cannot be done."""
        doc = {
            "format": FORMAT,
            "high_water_ms": high_water_ms,
            "worker_id": worker_id,
            "crc32": _crc(high_water_ms, worker_id),
        }
        line = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        try:
            if self._links() > 1:
                self._store_in_place(line)
            else:
                self._store_by_rename(line)
        except OSError as exc:
            if exc.errno in _EXHAUSTED:
                reserve.refused += 1
                _refused(
                    "state-file-exhausted",
                    logging.ERROR,
                    "cannot write state file %s: %s (no descriptor left, the reserve used up): no ID is issued"
                    " past its mark until one is free",
                    self.described,
                    exc.strerror or exc,
                )
            raise StateFileError(f"cannot write state file {self.described}: {exc.strerror or exc}") from None
        finally:
            reserve.refill()  # the write's descriptor is closed: take the spare back before a client does
        self.recorded_worker_id = worker_id

    def _store_by_rename(self, line: bytes) -> None:
        """The usual way: a temporary file, fsynced, renamed over the file at its real path (so a
        symlink stays a symlink), the directory fsynced: a crash leaves the old mark or the new one."""
        tmp = self.real_path.with_name(f".{self.real_path.name}.tmp")
        fd = reserve.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.real_path)
        if self._dir_fd is not None:  # locked: the directory is open already
            os.fsync(self._dir_fd)
            return
        dir_fd = reserve.open(self.real_path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def _store_in_place(self, line: bytes) -> None:
        """The file gained another hard link while we hold it: a rename would break the link and leave
        the other name with a stale mark (from which a daemon could later start), so overwrite it in
        one write of well under a disk sector, padded with blanks over the old line. A write torn by a
        crash fails its CRC at the next start: refused, never trusted."""
        if not self._warned_links:
            self._warned_links = True
            logging.getLogger("katsubushi_py").warning(
                "state file %s has %d hard links: writing it in place so that its names stay one file. A daemon"
                " refuses to start on a state file with more than one link; remove the others (find / -xdev"
                " -samefile %s)",
                self.described,
                self._links(),
                self.real_path,
            )
        fd = reserve.open(self.real_path, os.O_WRONLY)
        try:
            old = os.fstat(fd).st_size
            os.pwrite(fd, line.ljust(old, b" "), 0)
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


class StateDirectory:
    """A directory of state files, one per worker id: ``worker-<id>.state`` (and its ``.lock``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def create(self) -> None:
        """Make the directory (mode 0700) if it is missing; an existing one is used as it is."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateFileError(f"cannot create state directory {self.path}: {exc.strerror or exc}") from None
        if not self.path.is_dir():
            raise StateFileError(f"state directory {self.path} is not a directory")

    def file_for(self, worker_id: int) -> StateFile:
        return StateFile(self.path / f"worker-{worker_id}.state")

    def claim(self, worker_id: int) -> StateFile:
        """The locked state file of ``worker_id``; :class:`StateFileInUse` when another daemon of this
        host issues under that worker id from this directory."""
        state = self.file_for(worker_id)
        state.lock()
        return state

"""A durable high-water mark: the latest millisecond this daemon may have put into an ID.

Why: go-katsubushi (and Leaf, and most snowflake servers) keep nothing across a restart, so a
daemon restarted after the wall clock stepped back reissues IDs it already gave out. The generator
reserves a window ahead (say 2 s) in this file *before* issuing IDs in it, so every ID ever issued
has a time at or below the stored mark, and a restarted generator starts strictly after it.

The file is one JSON line with a CRC so that a damaged file is an error, never a silent reset.
Writes go to a temporary file that is fsynced, renamed over the old one, and the directory is
fsynced, so a crash leaves either the old mark or the new one.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from .errors import StateFileError

FORMAT = "katsubushi-py-state/1"


def _crc(high_water_ms: int, worker_id: int) -> int:
    return zlib.crc32(f"{FORMAT}:{high_water_ms}:{worker_id}".encode())


class StateFile:
    """Reads and atomically replaces the high-water mark stored at ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> int | None:
        """The stored mark in unix ms, or None when no file exists yet."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileError(f"cannot read state file {self.path}: {exc.strerror or exc}") from None
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
                f"state file {self.path} is damaged (not a {FORMAT} record); refusing to guess the last"
                " issued time. Move it away only if you know no ID was issued after the clock's current time."
            )
        return mark

    def store(self, high_water_ms: int, worker_id: int) -> None:
        """Durably replace the mark. Raises StateFileError when that cannot be done."""
        doc = {
            "format": FORMAT,
            "high_water_ms": high_water_ms,
            "worker_id": worker_id,
            "crc32": _crc(high_water_ms, worker_id),
        }
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, (json.dumps(doc, separators=(",", ":")) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateFileError(f"cannot write state file {self.path}: {exc.strerror or exc}") from None

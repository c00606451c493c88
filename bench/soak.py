"""Soak: the real daemon, for a long time, under 64 connections of every kind, good and bad.

    pip install -e '.[bench]'
    python bench/soak.py [--seconds 600] [--out bench/soak] [--connections 64]

What it does:
- starts katsubushi-py as a real process (a static worker id, no state file, TCP and ``--http-port``
  on free loopback ports);
- opens 64 connections (``--connections``; the mix scales with it) and keeps them busy for
  ``--seconds``: text GETs of one key and of 100 keys, pipelined GETs (20 per write), binary GETK and
  quiet multi-gets (GETKQ ... NOOP), meta ``mg`` and ``mg ... q`` + ``mn`` multi-gets, HTTP ``/id`` and
  ``/ids?n=50`` on keep-alive connections, clients that reconnect after every few requests (text,
  binary, HTTP), and misbehaving ones: slow clients (a request sent a byte at a time, the reply read a
  few bytes at a time), clients that send GETs and never read their replies (then hang up and come
  back), clients that send garbage (random bytes, bad binary headers, lines too long), and clients that
  send half a line and hang up or wait;
- records every ID it receives, per connection, and checks that every ID is unique over the whole run
  and that each connection's IDs are strictly increasing (one daemon, one worker id: every ID is
  later than the one before it, on any connection);
- samples the daemon's RSS and its open file descriptors every second (``/proc/PID/status``,
  ``/proc/PID/fd``) and fails if they pass their bounds or grow. **The criteria**: RSS never above the
  idle daemon's plus, per connection, what docs/protocol.md says one may make it hold (--read-ahead +
  384 KiB); after a warm-up (``--warmup``: 120 s, or half the run when that is shorter; the daemon's RSS
  climbs over its first 3 to 6 million IDs, a minute or two, then moves by a few MiB as the allocator
  reuses memory), the largest RSS sample of the last third of the rest not above the largest of its
  first third plus 16 MiB or 20%, whichever is more (judged when 6 samples or more follow the warm-up:
  CI's 60-second run judges its last 30 s, and fails on a leak of more than 1 to 2 MiB a second; a
  slower one is the 10-minute run's to find); open fds never above the idle
  daemon's plus two per connection plus 16 (a client that hangs up and connects again at once has, for a
  moment, its old connection still open on the daemon's side: 116 fds were seen for 64 connections),
  and the last third's largest not above the first third's plus 16;
- writes ``soak.csv`` (second, RSS KiB, fds, IDs so far, requests so far), ``soak.png`` (RSS and fds
  over time) and ``soak.json`` (the figures) into ``--out``; exits 1 on any failure: a duplicate, an ID
  out of order, a wrong reply to a good client, the daemon dying or printing a traceback, growth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
BINARY_HEADER = struct.Struct(">BBHBBHIIQ")
# What one connection may make the daemon hold, at most (docs/protocol.md, "Limits and memory"): the
# default --read-ahead (1 MiB), one read (256 KiB), one reply budget and unread replies (128 KiB).
PER_CONNECTION_KIB = 1024 + 256 + 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- the record of every ID ------------------------------------------------------------------------
@dataclass
class Record:
    """Every ID received, by connection, and everything that went wrong."""

    ids: list[array[int]] = field(default_factory=list)  # one array per connection ever opened
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    order_errors: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def connection(self) -> Conn:
        store: array[int] = array("Q")
        self.ids.append(store)
        return Conn(self, store)

    def error(self, what: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(what)
        else:
            self.counts["errors beyond the first 50"] = self.counts.get("errors beyond the first 50", 0) + 1

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    @property
    def total(self) -> int:
        return sum(len(a) for a in self.ids)


@dataclass
class Conn:
    record: Record
    ids: array[int]

    def got(self, kind: str, values: list[int]) -> None:
        ids = self.ids
        last = ids[-1] if ids else 0
        for v in values:
            if v <= last:
                self.record.order_errors += 1
                self.record.error(f"{kind}: ID {v} after {last} on one connection")
            last = v
        ids.extend(values)
        self.record.requests += 1


# -- the clients -------------------------------------------------------------------------------------
class Soak:
    def __init__(self, port: int, http_port: int, until: float, record: Record, rng: random.Random) -> None:
        self.port = port
        self.http_port = http_port
        self.until = until
        self.record = record
        self.rng = rng

    def running(self) -> bool:
        return time.monotonic() < self.until

    async def open(self, port: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", port or self.port)

    @staticmethod
    async def close(writer: asyncio.StreamWriter) -> None:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def guarded(self, kind: str, body: object) -> None:
        """Run one client for the whole soak; a good client's failure is an error of the run."""
        try:
            await body  # type: ignore[misc]
        except (asyncio.CancelledError, KeyboardInterrupt):
            raise
        except Exception as exc:  # any failure of a good client fails the soak
            self.record.error(f"{kind}: {exc!r}")

    # Text GETs -------------------------------------------------------------------------------------
    async def read_values(self, reader: asyncio.StreamReader, keys: int) -> list[int]:
        out = []
        for _ in range(keys):
            line = await reader.readline()
            if not line.startswith(b"VALUE "):
                raise AssertionError(f"expected VALUE, got {line[:80]!r}")
            out.append(int(await reader.readline()))
        end = await reader.readline()
        if end != b"END\r\n":
            raise AssertionError(f"expected END, got {end[:80]!r}")
        return out

    async def text_get(self, keys: int) -> None:
        reader, writer = await self.open()
        conn = self.record.connection()
        request = ("get " + " ".join(f"k{i}" for i in range(keys)) + "\r\n").encode()
        while self.running():
            writer.write(request)
            conn.got(f"text get x{keys}", await self.read_values(reader, keys))
        await self.close(writer)

    async def text_pipelined(self, depth: int = 20) -> None:
        reader, writer = await self.open()
        conn = self.record.connection()
        while self.running():
            writer.write(b"get a\r\n" * depth)
            ids: list[int] = []
            for _ in range(depth):
                ids.extend(await self.read_values(reader, 1))
            conn.got("text pipelined", ids)
        await self.close(writer)

    # Meta ------------------------------------------------------------------------------------------
    async def meta(self) -> None:
        reader, writer = await self.open()
        conn = self.record.connection()
        n = 0
        while self.running():
            n += 1
            if n % 2:
                writer.write(b"mg id v\r\n")
                head = await reader.readline()
                if not head.startswith(b"VA "):
                    raise AssertionError(f"mg: {head[:80]!r}")
                conn.got("meta mg", [int(await reader.readline())])
            else:
                writer.write(b"".join(b"mg k%d v k q O%d\r\n" % (i, i) for i in range(10)) + b"mn\r\n")
                ids = []
                for i in range(10):
                    head = await reader.readline()
                    if not head.startswith(b"VA ") or f" O{i}".encode() not in head:
                        raise AssertionError(f"mg q: {head[:80]!r}")
                    ids.append(int(await reader.readline()))
                if await reader.readline() != b"MN\r\n":
                    raise AssertionError("mn: no MN")
                conn.got("meta multi", ids)
        await self.close(writer)

    # Binary ----------------------------------------------------------------------------------------
    @staticmethod
    def binary_request(opcode: int, key: bytes, opaque: int) -> bytes:
        return BINARY_HEADER.pack(0x80, opcode, len(key), 0, 0, 0, len(key), opaque, 0) + key

    async def binary_reply(self, reader: asyncio.StreamReader) -> tuple[int, int, int, bytes]:
        header = await reader.readexactly(24)
        magic, opcode, key_len, extras_len, _, status, body_len, opaque, _ = BINARY_HEADER.unpack(header)
        if magic != 0x81:
            raise AssertionError(f"binary: magic {magic:#x}")
        body = await reader.readexactly(body_len)
        return opcode, status, opaque, body[extras_len + key_len :]

    async def binary(self) -> None:
        reader, writer = await self.open()
        conn = self.record.connection()
        n = 0
        while self.running():
            n += 1
            if n % 2:
                writer.write(self.binary_request(0x0C, b"id", n))  # GETK
                opcode, status, opaque, value = await self.binary_reply(reader)
                if status or opaque != n:
                    raise AssertionError(f"binary GETK: status {status:#x}, opaque {opaque}")
                conn.got("binary getk", [int(value)])
            else:
                keys = 10
                writer.write(
                    b"".join(self.binary_request(0x0D, b"k%d" % i, i) for i in range(keys))  # GETKQ
                    + self.binary_request(0x0A, b"", 999)  # NOOP
                )
                ids = []
                while True:
                    opcode, status, opaque, value = await self.binary_reply(reader)
                    if opcode == 0x0A:
                        break
                    if status or opaque != len(ids):
                        raise AssertionError(f"binary GETKQ: status {status:#x}, opaque {opaque}")
                    ids.append(int(value))
                if len(ids) != keys:
                    raise AssertionError(f"binary multi-get: {len(ids)} of {keys}")
                conn.got("binary multi", ids)
        await self.close(writer)

    # HTTP ------------------------------------------------------------------------------------------
    async def http_response(self, reader: asyncio.StreamReader) -> bytes:
        status = await reader.readline()
        if not status.startswith(b"HTTP/1.1 200"):
            raise AssertionError(f"HTTP: {status[:80]!r}")
        length = None
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise AssertionError("HTTP: no Content-Length")
        return await reader.readexactly(length)

    async def http(self) -> None:
        reader, writer = await self.open(self.http_port)
        conn = self.record.connection()
        n = 0
        while self.running():
            n += 1
            if n % 2:
                writer.write(b"GET /id HTTP/1.1\r\nHost: soak\r\n\r\n")
                conn.got("http /id", [int(await self.http_response(reader))])
            else:
                writer.write(b"GET /ids?n=50 HTTP/1.1\r\nHost: soak\r\n\r\n")
                ids = [int(x) for x in (await self.http_response(reader)).split(b"\n")]
                if len(ids) != 50:
                    raise AssertionError(f"/ids?n=50 gave {len(ids)}")
                conn.got("http /ids", ids)
        await self.close(writer)

    # Reconnecting clients ----------------------------------------------------------------------------
    async def reconnecting(self) -> None:
        rng = self.rng
        while self.running():
            kind = rng.choice(("text", "binary", "http"))
            port = self.http_port if kind == "http" else self.port
            reader, writer = await self.open(port)
            conn = self.record.connection()
            for _ in range(rng.randint(1, 5)):
                if kind == "text":
                    writer.write(b"get a b c\r\n")
                    conn.got("reconnect text", await self.read_values(reader, 3))
                elif kind == "binary":
                    writer.write(self.binary_request(0x00, b"", 7))  # GET
                    _, status, _, value = await self.binary_reply(reader)
                    if status:
                        raise AssertionError(f"binary GET: status {status:#x}")
                    conn.got("reconnect binary", [int(value)])
                else:
                    writer.write(b"GET /id HTTP/1.1\r\nHost: soak\r\n\r\n")
                    conn.got("reconnect http", [int(await self.http_response(reader))])
            if rng.random() < 0.5:
                writer.write(b"quit\r\n" if kind == "text" else b"")
            await self.close(writer)
            self.record.count("reconnects")

    # Misbehaving clients -----------------------------------------------------------------------------
    async def slow(self) -> None:
        """A request a byte at a time, the reply read a few bytes at a time."""
        reader, writer = await self.open()
        conn = self.record.connection()
        while self.running():
            for byte in b"get slow1 slow2\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.01)
            data = b""
            while not data.endswith(b"END\r\n"):
                chunk = await reader.read(7)
                if not chunk:
                    raise AssertionError("slow client: closed")
                data += chunk
                await asyncio.sleep(0.005)
            lines = data.split(b"\r\n")
            conn.got("slow", [int(lines[1]), int(lines[3])])
        await self.close(writer)

    async def not_reading(self) -> None:
        """Sends GETs and never reads the replies; the daemon stops reading it once its bounded buffers
        are full. Hangs up after a few seconds and comes back."""
        while self.running():
            _, writer = await self.open()
            sent = 0
            give_up = time.monotonic() + self.rng.uniform(2, 6)
            while time.monotonic() < give_up and self.running():
                writer.write(b"get a b c d e f g h i j\r\n" * 100)
                sent += 100
                try:
                    await asyncio.wait_for(writer.drain(), 0.5)
                except TimeoutError:
                    await asyncio.sleep(0.2)  # the daemon has stopped reading us: as it should
            transport = writer.transport
            transport.abort()  # hang up without reading anything
            self.record.count("non-reading connections")
            self.record.count("unread gets sent", sent)

    async def garbage(self) -> None:
        """Random bytes, bad binary headers, over-long lines: each must get an error or a close, never
        hang the daemon."""
        rng = self.rng
        while self.running():
            reader, writer = await self.open()
            kind = rng.choice(("random", "binary", "long", "badcmd"))
            if kind == "random":
                payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 2000)))
            elif kind == "binary":
                opcode, key_len, extras_len, body_len = (
                    rng.randrange(256),
                    rng.randrange(65536),
                    rng.randrange(256),
                    rng.randrange(1 << 32),
                )
                header = BINARY_HEADER.pack(0x80, opcode, key_len, extras_len, 0, 0, body_len, 0, 0)
                payload = header + bytes(rng.randrange(256) for _ in range(50))
            elif kind == "long":
                payload = b"x" * 70_000 + b"\r\n"
            else:
                payload = b"set a 0 0 5\r\nhello\r\nincr a 1\r\nbogus command\r\n\r\nmg " + b"k" * 300 + b" v\r\n"
            with contextlib.suppress(ConnectionError):
                writer.write(payload)
                await writer.drain()
                with contextlib.suppress(TimeoutError, ConnectionError):
                    await asyncio.wait_for(reader.read(65536), 0.3)
            await self.close(writer)
            self.record.count(f"garbage {kind}")

    async def half_lines(self) -> None:
        """Half a request, then either hang up or finish it after a pause (it must then be answered)."""
        rng = self.rng
        while self.running():
            reader, writer = await self.open()
            conn = self.record.connection()
            writer.write(b"get half")
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            if rng.random() < 0.5:
                writer.transport.abort()
                self.record.count("half lines abandoned")
                continue
            writer.write(b"way\r\n")
            conn.got("half line finished", await self.read_values(reader, 1))
            await self.close(writer)
            self.record.count("half lines finished")


MIX = (  # (kind, share of 64 connections)
    ("text1", 10),
    ("text100", 6),
    ("pipelined", 8),
    ("binary", 8),
    ("meta", 8),
    ("http", 8),
    ("reconnecting", 6),
    ("slow", 3),
    ("not_reading", 3),
    ("garbage", 2),
    ("half_lines", 2),
)


def clients(soak: Soak, connections: int) -> list[tuple[str, object]]:
    total = sum(n for _, n in MIX)
    out: list[tuple[str, object]] = []
    for kind, share in MIX:
        for _ in range(max(1, round(share * connections / total))):
            body = {
                "text1": lambda: soak.text_get(1),
                "text100": lambda: soak.text_get(100),
                "pipelined": soak.text_pipelined,
                "binary": soak.binary,
                "meta": soak.meta,
                "http": soak.http,
                "reconnecting": soak.reconnecting,
                "slow": soak.slow,
                "not_reading": soak.not_reading,
                "garbage": soak.garbage,
                "half_lines": soak.half_lines,
            }[kind]()
            out.append((kind, body))
    return out


# -- the daemon and its samples ------------------------------------------------------------------------
def daemon_command(port: int, http_port: int) -> list[str]:
    exe = shutil.which("katsubushi-py", path=str(Path(sys.executable).parent)) or shutil.which("katsubushi-py")
    base = [exe] if exe else [sys.executable, "-m", "katsubushi_py"]
    return [
        *base,
        "--worker-id",
        "7",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--no-state-file",
        "--log-level",
        "warn",
    ]


def sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open fds) of a process."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
                break
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError("the daemon did not listen")


def growth(values: list[int], margin: float) -> tuple[int, int, bool]:
    """(max of the first third, max of the last third, grew beyond the margin)."""
    third = max(1, len(values) // 3)
    first, last = max(values[:third]), max(values[-third:])
    return first, last, last > first + margin


# The fewest samples after the warm-up for RSS growth to be judged (two a third).
MIN_JUDGED = 6


def warmup_for(seconds: float, given: float | None) -> float:
    """The warm-up not judged for RSS growth: ``--warmup`` when given, else 120 s or half the run,
    whichever is shorter. The RSS climbs over the first 3 to 6 million IDs (one to three minutes); a
    fixed 120 s left a 60-second run (CI's) with nothing judged. Half a 60-second run still holds the
    end of the climb (up to about 14 MiB over 15 s seen here), inside the 16 MiB margin; a leak of more
    than 1 to 1.5 MiB a second is not (a slower one is the 10-minute soak's to find)."""
    return given if given is not None else min(120.0, seconds / 2)


def judge(
    samples: list[tuple[float, int, int, int, int]], connections: int, warmup: float
) -> tuple[list[str], dict[str, object]]:
    """The memory and descriptor criteria on the samples (second, RSS KiB, fds, IDs, requests):
    (failures, figures). RSS never above the idle daemon's (the first sample) plus what the connections
    may hold, and after the warm-up no growth from the first third of the rest to the last; fds never
    above the idle daemon's plus two per connection plus 16, and no growth over the run."""
    failures: list[str] = []
    rss_series = [s[1] for s in samples]
    ceiling = rss_series[0] + connections * PER_CONNECTION_KIB
    settled = [s[1] for s in samples if s[0] >= warmup]
    judged = len(settled) >= MIN_JUDGED
    if judged:
        rss_first, rss_last, rss_grew = growth(settled, max(16 * 1024, 0.20 * max(settled[: len(settled) // 3])))
    else:
        rss_first, rss_last, rss_grew = 0, 0, False
    fds_first, fds_last, fds_grew = growth([s[2] for s in samples], 16)
    fds_ceiling = samples[0][2] + 2 * connections + 16
    if max(rss_series) > ceiling:
        failures.append(f"RSS {max(rss_series)} KiB above the bound {ceiling} KiB (idle + connections x each)")
    if rss_grew:
        failures.append(
            f"RSS grew after the warm-up: the last third's max {rss_last} KiB > the first third's {rss_first} KiB"
            " + max(16 MiB, 20%)"
        )
    if fds_grew:
        failures.append(f"fds grew: the last third's max {fds_last} > the first third's {fds_first} + 16")
    if max(s[2] for s in samples) > fds_ceiling:
        failures.append(f"open fds {max(s[2] for s in samples)} above {fds_ceiling} (idle + 2 x connections + 16)")
    figures: dict[str, object] = {
        "rss_kib_start": samples[0][1],
        "rss_kib_end": samples[-1][1],
        "rss_kib_max": max(rss_series),
        "rss_kib_ceiling": ceiling,
        "warmup_seconds": warmup,
        "rss_growth_judged": judged,
        "rss_samples_judged": len(settled),
        "rss_kib_max_first_third_after_warmup": rss_first,
        "rss_kib_max_last_third": rss_last,
        "fds_start": samples[0][2],
        "fds_end": samples[-1][2],
        "fds_max_first_third": fds_first,
        "fds_max_last_third": fds_last,
    }
    return failures, figures


async def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port, http_port = free_port(), free_port()
    log = tempfile.TemporaryFile()  # noqa: SIM115 - read after the daemon stops, closed at exit
    proc = subprocess.Popen(daemon_command(port, http_port), stdout=log, stderr=subprocess.STDOUT)
    record = Record()
    samples: list[tuple[float, int, int, int, int]] = []
    failures: list[str] = []
    try:
        wait_listening(port, proc)
        wait_listening(http_port, proc)
        started = time.monotonic()
        until = started + args.seconds
        soak = Soak(port, http_port, until, record, random.Random(args.seed))
        tasks = [asyncio.ensure_future(soak.guarded(kind, body)) for kind, body in clients(soak, args.connections)]
        print(f"soak: daemon pid {proc.pid}, {len(tasks)} connections, {args.seconds:g}s", flush=True)
        next_sample = started
        while time.monotonic() < until:
            if proc.poll() is not None:
                failures.append(f"the daemon exited with {proc.returncode}")
                break
            rss, fds = sample(proc.pid)
            t = time.monotonic() - started
            samples.append((t, rss, fds, record.total, record.requests))
            if args.progress and len(samples) % args.progress == 0:
                print(f"  {t:6.0f}s rss {rss / 1024:.1f} MiB, fds {fds}, {record.total} IDs", flush=True)
            next_sample += 1.0
            await asyncio.sleep(max(0.0, next_sample - time.monotonic()))
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    finally:
        alive = proc.poll() is None
        if alive:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                failures.append("the daemon did not stop within 15 s of SIGTERM")
        log.seek(0)
        daemon_log = log.read().decode(errors="replace")
    # Uniqueness over the whole run, order per connection (checked as the IDs came).
    import numpy as np

    # One array of every ID (8 bytes each), sorted in place: a duplicate is two equal neighbours.
    total = record.total
    all_ids = np.empty(total, dtype=np.uint64)
    at = 0
    for i, a in enumerate(record.ids):
        if len(a):
            all_ids[at : at + len(a)] = np.frombuffer(a, dtype=np.uint64)
            at += len(a)
            record.ids[i] = array("Q")  # freed as we go
    all_ids.sort()
    duplicates = int(np.count_nonzero(all_ids[1:] == all_ids[:-1])) if total else 0
    unique = total - duplicates
    if not samples:
        failures.append("no sample of the daemon was taken")
        samples.append((0.0, 0, 0, 0, 0))
    if duplicates:
        failures.append(f"{duplicates} duplicate IDs")
    if record.order_errors:
        failures.append(f"{record.order_errors} IDs out of order on their connection")
    if record.errors:
        failures.append(f"{len(record.errors)} client errors, the first: {record.errors[0]}")
    memory_failures, memory = judge(samples, args.connections, args.warmup)
    failures += memory_failures
    if "Traceback" in daemon_log:
        failures.append("the daemon printed a traceback")
    if len(samples) < max(3, int(args.seconds * 0.8)):
        failures.append(f"only {len(samples)} samples in {args.seconds:g} s")
    with open(out / "soak.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["second", "rss_kib", "fds", "ids", "requests"])
        for t, rss, fds, ids, requests in samples:
            w.writerow([f"{t:.1f}", rss, fds, ids, requests])
    summary = {
        "seconds": args.seconds,
        "connections": args.connections,
        "ids": total,
        "unique": int(unique),
        "duplicates": int(duplicates),
        "requests": record.requests,
        "connections_opened": len(record.ids),
        "ids_per_second": round(total / samples[-1][0]) if samples and samples[-1][0] else None,
        "order_errors": record.order_errors,
        **memory,
        "counts": record.counts,
        "client_errors": record.errors[:10],
        "failures": failures,
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(samples, out / "soak.png", summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("counts", "client_errors")}))
    if daemon_log.strip():
        print("daemon log (last 2,000 characters):\n" + daemon_log[-2000:])
    for failure in failures:
        print(f"SOAK FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def plot(samples: list[tuple[float, int, int, int, int]], path: Path, summary: dict[str, object]) -> None:
    if not samples:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s[0] for s in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, [s[1] / 1024 for s in samples], color="tab:blue")
    ax1.set_ylabel("daemon RSS (MiB)")
    ax1.set_ylim(bottom=0)
    ax1.grid(alpha=0.3)
    ax2.plot(t, [s[2] for s in samples], color="tab:orange")
    ax2.set_ylabel("open fds")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("seconds")
    ax2.grid(alpha=0.3)
    fig.suptitle(
        f"katsubushi-py soak: {summary['connections']} connections, {summary['seconds']:g} s,"
        f" {summary['ids']:,} IDs, {summary['duplicates']} duplicates"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long (default 600)")
    parser.add_argument("--connections", type=int, default=64, help="how many client connections (default 64)")
    parser.add_argument("--out", default=str(HERE / "soak"), help="where soak.csv, .png, .json go (default bench/soak)")
    parser.add_argument("--seed", type=int, default=1, help="the misbehaving clients' random choices")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of RSS climb not judged for growth (default 120 s or half the run, whichever is"
        " shorter; the bound always holds)",
    )
    parser.add_argument("--progress", type=int, default=0, help="print a sample every N seconds (default: never)")
    args = parser.parse_args(argv)
    args.warmup = warmup_for(args.seconds, args.warmup)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

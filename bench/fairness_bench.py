#!/usr/bin/env python3
"""Fairness: another client's latency while one connection asks for a great many IDs at once.

A victim (this process) sends a 1-key ``get`` on its own connection, one after another, and times
each reply; meanwhile an attacker (a child process, so that it does not share the victim's GIL) sends
large requests back to back on one connection and reads every reply as fast as it can:

- ``text``: one ``get`` line of 1 MiB of keys (524,288 one-byte keys: 524k IDs), the issue's case;
- ``binary``: 100,000 ``getkq`` requests and a ``noop`` in one write (100k IDs);
- ``http``: 100 pipelined ``GET /ids?n=1000`` in one write (100k IDs);
- ``meta``: 100,000 ``mg k v`` in one write (100k IDs);
- ``grpc``: 100 ``FetchMulti`` calls of 1,000 IDs in one write (100k IDs; the most
  SETTINGS_MAX_CONCURRENT_STREAMS lets a client open at once), its windows opened for all the replies;
- ``grpc-slow``: the same with ``grpc-encoding: gzip`` on each call, which makes every call h2's (the
  slow path), not the fast path's.

Reported for each: the victim's median, 99th percentile and worst latency with no attack, and
during the attack, and how long the attacker's requests took. With ``--baseline DIR`` the same runs
against the code checked out in DIR (``PYTHONPATH=DIR``, its compiled modules built there), in the
same run, alternately. ``--pure``: ``KATSUBUSHI_NO_EXTENSIONS=1``.

Usage: python bench/fairness_bench.py [--baseline DIR] [--pure] [--seconds 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("daemon exited")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not ready")


# -- the attacker (a child process) -----------------------------------------------------------------
GRPC_CALLS = 100


def h2_frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def grpc_burst(first_sid: int, slow: bool) -> bytes:
    """GRPC_CALLS FetchMulti n=1000, header blocks of literals without indexing (HPACK, no table)."""
    headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/katsubushi.Generator/FetchMulti"),
               (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]  # fmt: skip
    if slow:
        headers.append((b"grpc-encoding", b"gzip"))
    block = b"".join(b"\x00%c%b%c%b" % (len(n), n, len(v), v) for n, v in headers)
    body = b"\x00\x00\x00\x00\x03\x08\xe8\x07"  # the message: field 1 = 1000
    return b"".join(
        h2_frame(1, 4, sid, block) + h2_frame(0, 1, sid, body)
        for sid in range(first_sid, first_sid + 2 * GRPC_CALLS, 2)
    )


def grpc_attacker(port: int, seconds: float, slow: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    settings = h2_frame(4, 0, 0, (4).to_bytes(2, "big") + (1 << 20).to_bytes(4, "big"))  # initial window 1 MiB
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + h2_frame(8, 0, 0, (1 << 30).to_bytes(4, "big")))
    sock.sendall(h2_frame(4, 1, 0, b""))  # the server's SETTINGS acknowledged (h2 does not wait for it)
    durations, sid, buffer = [], 1, b""
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(grpc_burst(sid, slow),))
        sender.start()
        sid += 2 * GRPC_CALLS
        ended = data_bytes = 0
        while ended < GRPC_CALLS:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("closed")
            buffer += chunk
            at = 0
            while len(buffer) - at >= 9:
                length = int.from_bytes(buffer[at : at + 3], "big")
                if len(buffer) - at < 9 + length:
                    break
                kind, flags = buffer[at + 3], buffer[at + 4]
                if kind == 0:
                    data_bytes += length
                elif kind == 1 and flags & 1 and buffer[at + 5 : at + 9] != bytes(4):
                    ended += 1
                elif kind == 7:
                    raise RuntimeError("GOAWAY")
                at += 9 + length
            buffer = buffer[at:]
        sender.join()
        sock.sendall(h2_frame(8, 0, 0, data_bytes.to_bytes(4, "big")))  # the connection window back
        durations.append(time.monotonic() - started)
    print(" ".join(f"{d:.4f}" for d in durations))


def attack_request(kind: str) -> tuple[bytes, bytes, int]:
    """(request, what ends its reply, how many times that end appears)."""
    if kind == "text":
        return b"get " + b"k " * (512 * 1024 - 3) + b"k\r\n", b"END\r\n", 1
    if kind == "meta":
        return b"mg k v\r\n" * 100_000 + b"mn\r\n", b"MN\r\n", 1
    if kind == "binary":
        getkq = struct.pack(">BBHBBHIIQ", 0x80, 0x0D, 1, 0, 0, 0, 1, 0, 0) + b"k"
        noop = struct.pack(">BBHBBHIIQ", 0x80, 0x0A, 0, 0, 0, 0, 0, 0, 0)
        return getkq * 100_000 + noop, b"\x81\x0a\x00\x00", 1
    if kind == "http":
        return b"GET /ids?n=1000 HTTP/1.1\r\nHost: x\r\n\r\n" * 100, b"HTTP/1.1 200", 100
    raise ValueError(kind)


def attacker(kind: str, port: int, seconds: float) -> None:
    if kind.startswith("grpc"):
        grpc_attacker(port, seconds, slow=kind == "grpc-slow")
        return
    request, end, count = attack_request(kind)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    durations = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(request,))
        sender.start()
        seen, tail = 0, b""
        while seen < count:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise RuntimeError("closed")
            data = tail + chunk
            seen += data.count(end)
            tail = data[-(len(end) - 1) :]
        sender.join()
        if kind == "http":  # the last reply's body
            time.sleep(0.001)
            sock.setblocking(False)
            try:
                while sock.recv(1 << 20):
                    pass
            except BlockingIOError:
                pass
            sock.setblocking(True)
        durations.append(time.monotonic() - started)
    print(" ".join(f"{d:.4f}" for d in durations))


# -- the victim --------------------------------------------------------------------------------------
def victim(port: int, seconds: float) -> list[float]:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    latencies = []
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        started = time.perf_counter()
        sock.sendall(b"get a\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            reply += sock.recv(4096)
        latencies.append(time.perf_counter() - started)
    sock.close()
    return latencies


def figures(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[int(len(ordered) * 0.99)]
    return (
        f"median {statistics.median(ordered) * 1000:6.2f} ms  p99 {p99 * 1000:7.2f} ms  "
        f"max {ordered[-1] * 1000:7.2f} ms  ({len(ordered)} requests)"
    )


def run(code: Path, pure: bool, kind: str, seconds: float) -> tuple[str, str, str]:
    port, http_port, grpc_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(code), "KATSUBUSHI_NO_EXTENSIONS": "1" if pure else "0"}
    env["STATE_DIRECTORY"] = tempfile.mkdtemp(prefix="kp-fair-")
    cmd = [sys.executable, "-m", "katsubushi_py", "--worker-id", "1", "--port", str(port)]
    cmd += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    quiet_io = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    # cwd: ``python -m`` puts the working directory first on sys.path, before PYTHONPATH, so run from
    # elsewhere "before" was this checkout's code too.
    proc = subprocess.Popen(cmd, env=env, cwd=code, **quiet_io)  # type: ignore[call-overload]
    try:
        wait_port(http_port, proc)
        wait_port(grpc_port, proc)
        target = {"http": http_port, "grpc": grpc_port, "grpc-slow": grpc_port}.get(kind, port)
        quiet = victim(port, 1.0)
        child = subprocess.Popen(
            [sys.executable, __file__, "--attacker", kind, "--port", str(target), "--seconds", str(seconds)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        time.sleep(0.3)  # the attack under way
        loud = victim(port, seconds - 0.6)
        out, _ = child.communicate(timeout=60)
        attacks = [float(x) for x in out.split()]
        attack = f"attacker: {len(attacks)} requests, median {statistics.median(attacks) * 1000:.0f} ms each"
        return figures(quiet), figures(loud), attack
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attacker")
    parser.add_argument("--port", type=int)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--pure", action="store_true")
    parser.add_argument("--kinds", default="text,meta,binary,http,grpc,grpc-slow")
    args = parser.parse_args()
    if args.attacker:
        attacker(args.attacker, args.port, args.seconds)
        return
    codes = [("before", args.baseline)] if args.baseline else []
    codes.append(("after", ROOT))
    path = "pure" if args.pure else "compiled"
    for kind in args.kinds.split(","):
        for round_ in range(args.rounds):
            for name, code in codes:
                quiet, loud, attack = run(code, args.pure, kind, args.seconds)
                print(f"{kind:6} {path:8} {name:6} round {round_}: quiet  {quiet}", flush=True)
                print(f"{kind:6} {path:8} {name:6} round {round_}: attack {loud}; {attack}", flush=True)


if __name__ == "__main__":
    main()

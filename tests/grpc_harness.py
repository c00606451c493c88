"""Plays scripted gRPC conversations (tests/grpc_conversations.py) through GrpcConnection and prints
every byte the server sent and its state after each step.

Run as a subprocess by tests/test_grpc_twins.py, once with the compiled gRPC core and once with
``KATSUBUSHI_NO_EXTENSIONS=1``: the two outputs must be byte-identical. The clock is a fake that moves
only when the script says. Input (argv): seeds. Output (stdout): JSON with the core's name and, per
conversation, per step, the server's bytes (hex) and state.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys

from grpc_conversations import FETCH, FETCH_MULTI, Client, chunks, grpc_headers, make_server, message, play_step, script

from katsubushi_py.frontends import grpc_fast
from katsubushi_py.frontends.grpc_frames import frame


def state(server) -> list[object]:
    counters = server._service.counters
    return [
        server._fast,
        server._last_stream,
        server._out_window,
        server._peer_window,
        server._in_window,
        server._debt,
        server._handed,
        server._cache_len(),
        server._buffer.hex(),
        server.activity,
        server.closing,
        server.wait,
        server.backlog,
        server.pieces,
        counters.commands,
        counters.ids,
        sorted(counters.failures.items()),
    ]


def play(seed: int) -> list[object]:
    server, clock = make_server(fast=True, sequence_bits=4 if seed % 3 == 0 else 12)  # 16 IDs a ms: refills
    # The frame budget refills by the generator's clock, the fake one: on the real clock the slower twin
    # earned more tokens, and the two closed a flood of window updates a few frames apart (seed 8).
    client = Client()
    out: list[object] = []
    steps = script(seed)
    for n, step in enumerate(steps):
        play_step(client, step)
        if seed % 4 == 1 and n == len(steps) // 2:
            clock.step_wall_ms(-2)  # the clock steps back: calls wait for it (the fast path hands them over)
            server._service.issuer.generator.reanchor()
        if seed % 5 == 2 and n == 3 * len(steps) // 4:
            server._service.issuer.generator.close()  # every later call fails
        for piece in chunks(client.pending(), step[-1]):
            reply = receive(server, clock, piece)
            client.take(reply)
            out.append([reply.hex(), state(server)])
        clock.advance_ns(300_000)
    for _ in range(10_000):
        data = client.pending()
        if not data:
            break
        client.take(server.receive(data))
        out.append(state(server))
    sids = [client.call(FETCH), client.call(FETCH_MULTI, b"\x08\x03")]
    out.append([server.receive(client.pending()).hex(), sids])
    out += raw_phase(server, clock, client, random.Random(seed), 7000 if seed % 4 == 0 and seed % 3 else 300)
    out.append(server.goodbye().hex())
    return out


def raw_phase(server, clock, client: Client, rng: random.Random, calls: int) -> list[object]:
    """Calls written as bytes (h2's client is too slow for thousands): enough of them to make the
    server give the inbound window back; then calls the fast path hands over while the client has
    opened their windows, with the client's initial window at 10 bytes so that it shows."""
    block = client.h2.encoder.encode(grpc_headers(FETCH))  # indexed by now: the same bytes every time
    multi = client.h2.encoder.encode(grpc_headers(FETCH_MULTI))
    sid = client.h2.highest_outbound_stream_id + 2
    out: list[object] = []
    data = b""
    for _ in range(calls):
        if rng.random() < 0.5:
            data += frame(1, 4, sid, block) + frame(0, 1, sid, message(b""))
        else:
            data += frame(1, 4, sid, multi) + frame(0, 1, sid, message(b"\x08" + bytes((rng.randrange(1, 128),))))
        sid += 2
        if rng.random() < 0.02:
            data += frame(8, 0, 0, (1 << 20).to_bytes(4, "big"))  # the client reads its replies
        if calls < 1000 and rng.random() < 0.01:
            data += frame(6, 0, 0, b"12345678")  # the slow path, now and then (not in the long runs)
    for piece in chunks(data, rng.choice([4096, 65536, 999, 77])):
        out.append([hashlib.sha256(receive(server, clock, piece)).hexdigest(), state(server)])
        clock.advance_ns(100_000)
    data = frame(4, 0, 0, b"\x00\x04\x00\x00\x00\x0a")  # SETTINGS_INITIAL_WINDOW_SIZE = 10
    for _ in range(20):
        group = list(range(sid, sid + 2 * rng.randrange(1, 4), 2))
        sid = group[-1] + 2
        for s in group:
            data += frame(1, 4, s, block) + frame(8, 0, s, (4096).to_bytes(4, "big"))
        if rng.random() < 0.5:
            data += frame(6, 0, 0, b"87654321")  # the fast path hands the calls over with their windows
        data += b"".join(frame(0, 1, s, message(b"")) for s in group)
    for piece in chunks(data, rng.choice([0, 13, 500])):
        out.append([receive(server, clock, piece).hex(), state(server)])
    return out


def receive(server, clock, data: bytes) -> bytes:
    """What the server answers, letting the clock run while a call waits for it."""
    reply = server.receive(data)
    while server.wait:
        clock.advance_ns(int(server.wait * 1e9) + 1)
        reply += server.resume()
    return reply


if __name__ == "__main__":
    core = "compiled" if grpc_fast.COMPILED else "python"
    print(json.dumps({"core": core, "conversations": [play(int(seed)) for seed in sys.argv[1:]]}))

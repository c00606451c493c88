"""Plays scripted conversations through the text and binary connections and prints every reply.

Run as a subprocess by tests/test_speedups.py, once with the compiled hot path and once with
``KATSUBUSHI_NO_EXTENSIONS=1``: the two outputs must be byte-identical. The clock is a fake that moves
only when the script says, so both runs see exactly the same time whatever they do with it.
Input (stdin): a JSON list of conversations, each ``{"protocol", "sequence_bits", "steps": [[hex,
advance_ns, step_back_ms], ...]}``. Output (stdout): JSON with the implementation and, per step, the
reply (hex), ``closing``, ``activity``, the parser's state, what it holds (hex) and the counters.
"""

from __future__ import annotations

import json
import sys

from katsubushi_py.compiled import IMPLEMENTATION
from katsubushi_py.frontends.binary import BinaryConnection
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer

START_MS = 1_795_305_600_000


class ScriptClock:
    def __init__(self) -> None:
        self.wall = START_MS * 1_000_000
        self.mono = 10**12

    def wall_ns(self) -> int:
        return self.wall

    def monotonic_ns(self) -> int:
        return self.mono

    def sleep(self, seconds: float) -> None:
        step = max(int(seconds * 1e9), 1000)
        self.wall += step
        self.mono += step


def play(conversation: dict) -> list[object]:
    clock = ScriptClock()
    layout = Layout(sequence_bits=conversation["sequence_bits"], worker_bits=10, time_bits=41)
    generator = Generator(5, layout, clock=clock, block_on_clock=False)
    issuer = Issuer(generator, "1.0.0")
    conn = TextConnection(issuer) if conversation["protocol"] == "text" else BinaryConnection(issuer)
    out: list[object] = []
    for chunk, advance_ns, step_back_ms in conversation["steps"]:
        clock.wall += advance_ns
        clock.mono += advance_ns
        if step_back_ms:
            clock.wall -= step_back_ms * 1_000_000
            generator.reanchor()
        reply = conn.receive(bytes.fromhex(chunk))
        while (conn.wait or conn.backlog) and not conn.closing:
            if conn.wait:  # a command waits for the clock: let exactly that much time pass
                wait_ns = int(conn.wait * 1e9) + 1
                clock.wall += wait_ns
                clock.mono += wait_ns
            reply += conn.resume()  # (or the reply reached its budget and was written: carry on)
        counters = [(c.protocol, c.commands, c.ids, sorted(c.failures.items())) for c in issuer.all_counters()]
        out.append([reply.hex(), bool(conn.closing), conn.activity, conn._state, conn._buffer.hex(), counters])
        if conn.closing:
            break
    return out


def main() -> None:
    conversations = json.load(sys.stdin)
    json.dump({"implementation": IMPLEMENTATION, "results": [play(c) for c in conversations]}, sys.stdout)


if __name__ == "__main__":
    main()

"""The compiled hot path and its pure-Python twin answer every conversation byte for byte alike.

Thousands of generated conversations (fast-path gets in every spelling, everything the fast path must
leave to Python, reads split anywhere, buckets used up and expired, clocks behind) are played once
with ``katsubushi_py._speedups`` and once with ``KATSUBUSHI_NO_EXTENSIONS=1``; replies, connection
state and counters must be identical. The rest of the suite runs both ways in ``.ci/run``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from binary_packets import request

from katsubushi_py.compiled import FREE_THREADED, speedups
from katsubushi_py.frontends.binary import BinaryConnection
from katsubushi_py.frontends.fastpath import COMPILED
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer

HARNESS = Path(__file__).with_name("speedups_harness.py")

# Whether the module is built, whatever KATSUBUSHI_NO_EXTENSIONS says for this run of the suite.
BUILT = importlib.util.find_spec("katsubushi_py._speedups") is not None and not FREE_THREADED
pytestmark = pytest.mark.skipif(not BUILT, reason="katsubushi_py._speedups is not built here")

WS = [b" ", b"  ", b"\t", b" \t ", b"\x0b", b"\x0c", b"\r"]


def text_line(rng: random.Random) -> bytes:
    kind = rng.random()
    keys = [bytes(rng.choice(b"abcxyz019_-:\x01\xff") for _ in range(rng.randint(1, 12))) for _ in range(140)]
    if kind < 0.5:  # gets the fast path may take
        word = rng.choice([b"get", b"GET", b"Get", b"gEt", b"gets", b"GETS", b"Gets"])
        count = rng.choice([1, 1, 1, 2, 3, 5, 17, 100, 128, 129, 140])
        parts = [word, *keys[:count]]
        line = rng.choice(WS[:3]).join(parts)
        if rng.random() < 0.3:
            line = rng.choice(WS) + line
        if rng.random() < 0.3:
            line += rng.choice(WS)
    elif kind < 0.55:  # gets it must leave to Python: a key too long, hundreds of keys
        keys[rng.randrange(5)] = b"k" * rng.choice([250, 251, 300])
        line = b"get " + b" ".join(keys[: rng.choice([5, 5, 140])])
    elif kind < 0.6:
        line = rng.choice([b"get", b"GET", b"gets", b" get ", b"getx a", b"ge a", b"gett a", b"g\xc5t a"])
    elif kind < 0.72:
        line = rng.choice(
            [
                b"version",
                b"VERSION",
                b"version x",
                b"quit",
                b"quit now",
                b"",
                b"   ",
                b"foo bar",
                b"mn",
                b"verbosity 1",
                b"verbosity noreply",
                b"stats items",
                b"stats malloc",
                b"incr a 1",
                b"delete a noreply",
                b"set a 0 0",
            ]
        )
    elif kind < 0.82:
        flags = b" ".join(rng.sample([b"v", b"k", b"q", b"f", b"s", b"t", b"O123", b"c"], rng.randint(0, 4)))
        line = b"mg " + keys[0] + (b" " + flags if flags else b"")
    elif kind < 0.88:
        size = rng.choice([0, 3, 100, 5000])
        block = b"x" * size + rng.choice([b"\r\n", b"\r\n", b"ab", b"\n"])
        command = rng.choice([b"set", b"add", b"cas", b"ms", b"append"])
        extra = b" 9" if command == b"cas" else b""
        args = b" %d" % size if command == b"ms" else b" 0 0 %d%b" % (size, extra)
        line = command + b" " + keys[0] + args + rng.choice([b"", b" noreply"]) + b"\r\n" + block[:-2]
        return line + block[-2:]
    elif kind < 0.9:
        line = b"stats"  # more than a kilobyte: a few of them in one read reach the reply budget
    else:
        line = b"get " + keys[0]
    return line + rng.choice([b"\r\n", b"\n"])


def binary_packet(rng: random.Random) -> bytes:
    opcode = rng.choice([0x00, 0x00, 0x09, 0x0C, 0x0D, 0x0D, 0x0A, 0x0B, 0x01, 0x07, 0x17, 0x42, 0x10])
    key = bytes(rng.choice(b"abcdef0123") for _ in range(rng.choice([0, 1, 5, 250])))
    extras = b"\x00" * rng.choice([0, 0, 4])
    if rng.random() < 0.03:
        return struct.pack(">BBHBBHII8s", 0x80, opcode, 251, 0, 0, 0, 251, 7, b"")  # key too long
    if rng.random() < 0.02:
        return b"\x81" + b"\x00" * 23  # bad magic
    value = b"v" * rng.choice([0] * 60 + [100, 4096, 5000])  # over 4,096: discarded, or refused
    body = extras + key + value
    opaque = rng.getrandbits(32)
    return struct.pack(">BBHBBHII8s", 0x80, opcode, len(key), len(extras), 0, 0, len(body), opaque, b"") + body


def split(data: bytes, rng: random.Random) -> list[bytes]:
    if rng.random() < 0.6 or len(data) < 2:
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def conversation(rng: random.Random) -> dict[str, object]:
    protocol = rng.choice(["text", "binary"])
    steps = []
    for _ in range(rng.randint(1, 12)):
        make = text_line if protocol == "text" else binary_packet
        data = b"".join(make(rng) for _ in range(rng.choice([1, 1, 1, 2, 4, 16])))
        for piece in split(data, rng):
            advance = rng.choice([0, 0, 0, 1_000, 400_000, 1_000_000, 2_500_000])
            step_back = rng.choice([0] * 30 + [1, 5, 200, 3000])
            steps.append([piece.hex(), advance, step_back])
    return {"protocol": protocol, "sequence_bits": rng.choice([2, 4, 12]), "steps": steps}


def play(conversations: list[dict[str, object]], **env: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(HARNESS)],
        input=json.dumps(conversations),
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_compiled_and_pure_python_answer_alike(seed: int) -> None:
    rng = random.Random(seed)
    conversations = [conversation(rng) for _ in range(700)]
    compiled = play(conversations, KATSUBUSHI_NO_EXTENSIONS="0")
    pure = play(conversations, KATSUBUSHI_NO_EXTENSIONS="1")
    assert (compiled["implementation"], pure["implementation"]) == ("compiled", "python")
    answered = sum(1 for conv in pure["results"] for step in conv if step[0])  # type: ignore[union-attr]
    assert answered > 1000  # the conversations really exercised the protocols
    for i, (a, b) in enumerate(zip(compiled["results"], pure["results"], strict=True)):  # type: ignore[arg-type]
        assert a == b, f"conversation {i} differs: {conversations[i]}"


def test_the_compiled_limits_are_the_python_ones() -> None:
    from katsubushi_py import _speedups  # type: ignore[attr-defined]
    from katsubushi_py.frontends import binary, fastpath

    compiled = (_speedups.MAX_KEY, _speedups.GET_BATCH, _speedups.REPLY_BUDGET, _speedups.MAX_BODY)
    assert compiled == (fastpath.MAX_KEY, fastpath.GET_BATCH, fastpath.REPLY_BUDGET, binary.MAX_BODY)


def test_stats_say_which_hot_path_runs(daemons) -> None:  # type: ignore[no-untyped-def]
    from conftest import recv_until

    def implementation(extensions: str) -> str:
        daemon = daemons.start(env={"KATSUBUSHI_NO_EXTENSIONS": extensions})
        with daemon.connect() as s:
            s.sendall(b"stats\r\n")
            lines = recv_until(s, b"END\r\n").decode().split("\r\n")
        return dict(line.split(" ", 2)[1:] for line in lines if line.startswith("STAT "))["implementation"]

    assert implementation("1") == "python"
    assert implementation("0") == "compiled"


# -- memory safety of the C glue (found by AddressSanitizer and UndefinedBehaviorSanitizer) ---------
#
# Every call from C into Python may drop the last reference to an object the C code goes on using. The
# tests make the callee drop it and record, with __del__, when the object is freed: it must be after
# the C code is done with it (before the fix it was freed inside the callback and then read).

needs_compiled = pytest.mark.skipif(not COMPILED, reason="the compiled hot path is not in use in this run")


def compiled_issuer(clock: object = None) -> Issuer:
    from conftest import FakeClock

    return Issuer(Generator(5, clock=clock or FakeClock()), "1.0.0")


@needs_compiled
def test_protocol_core_holds_the_connection_while_its_write_runs() -> None:
    events: list[str] = []

    class Conn(BinaryConnection):
        __slots__ = ()

        def __del__(self) -> None:
            events.append("connection freed")

    class Proto(speedups.ProtocolCore):  # type: ignore[name-defined,misc]
        def _after_receive(self) -> None:
            events.append("after receive")

    proto = Proto()
    proto._use(Conn(compiled_issuer()))  # the only reference to the connection

    def write(reply: bytes) -> None:
        proto._conn = None  # what a close does
        proto._receive = None
        events.append("dropped")

    proto._write = write
    proto.data_received(request(0x00))  # a binary GET
    events.append("returned")
    assert events == ["dropped", "connection freed", "returned"]


@needs_compiled
def test_socket_core_holds_the_protocol_while_its_data_received_runs() -> None:
    events: list[str] = []

    class Transport(speedups.SocketCore):  # type: ignore[name-defined,misc]
        pass

    class Proto(speedups.ProtocolCore):  # type: ignore[name-defined,misc]
        def __del__(self) -> None:
            events.append("protocol freed")

    ours, theirs = socket.socketpair()
    with ours, theirs:
        transport = Transport()
        transport._fd = ours.fileno()
        proto = Proto()
        proto._use(TextConnection(compiled_issuer()))

        def write(reply: bytes) -> None:
            transport._data_received = None  # what connection_lost does: the protocol's last reference
            events.append("dropped")

        proto._write = write
        transport._data_received = proto.data_received
        del proto
        theirs.sendall(b"get a\r\n")
        transport._readable()
        events.append("returned")
    assert events == ["dropped", "protocol freed", "returned"]


@needs_compiled
def test_connection_core_holds_its_generator_while_the_clock_runs() -> None:
    """An injected clock (Python) may re-initialise the connection's fast path while the compiled
    core reads it, dropping the generator that core is taking IDs from."""
    events: list[str] = []

    class Gen(speedups.GeneratorCore):  # type: ignore[name-defined,misc]
        def __del__(self) -> None:
            events.append("generator freed")

    issuer = compiled_issuer()
    conn = TextConnection(issuer)
    replacement = issuer.generator
    gen = Gen()
    gen._set_bucket(1 << 40, 100, 2**62)

    def clock() -> int:
        if not events:
            conn._fast_init(replacement, issuer.counters("text"))
            events.append("replaced")
        return 0

    gen._use_clock(clock)
    conn._fast_init(gen, speedups.Counters("text"))
    del gen
    reply = conn.receive(b"get a\r\n")
    events.append("returned")
    assert reply == b"VALUE a 0 13\r\n%d\r\nEND\r\n" % (1 << 40)
    assert events == ["replaced", "generator freed", "returned"]


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize(("base", "count"), [(2**63 - 1, 1), (-1, 5), (5, -1), (2**62, 2**62)])
def test_a_bucket_beyond_64_bits_is_refused(core: str, base: int, count: int) -> None:
    """``_set_bucket(2**63 - 1, 1, -1)`` made the compiled core's ``next + count`` overflow (undefined
    behaviour in C); both twins refuse any bucket that does not fit, and take the last IDs that do."""
    from katsubushi_py.issuing.bucket import PyGeneratorCore

    # The module itself, not katsubushi_py.compiled's choice: this runs with KATSUBUSHI_NO_EXTENSIONS too.
    built = importlib.import_module("katsubushi_py._speedups")
    cls = built.GeneratorCore if core == "compiled" else PyGeneratorCore
    gen = cls()
    with pytest.raises(ValueError, match="bucket"):
        gen._set_bucket(base, count, -1)
    gen._set_bucket(2**63 - 2, 1, 2**62)
    assert (gen._bucket_left(), gen._take(), gen._take(), gen._bucket_left()) == (1, 2**63 - 2, None, 0)


@needs_compiled
@pytest.mark.parametrize("n", [1, 5])
def test_a_clock_that_changes_the_bucket_cannot_push_ids_past_it(n: int) -> None:
    """``gen_has`` counted the bucket before calling an injected clock, and the fast path then took
    ``n`` IDs from whatever bucket the clock had left: a clock that set one with a single ID left made
    ``next_ids`` issue IDs past its end (past 2**63 - 1 here: signed overflow). It counts again after
    the clock; the request goes to the slow path."""

    class Gen(speedups.GeneratorCore):  # type: ignore[name-defined,misc]
        def _next_id_slow(self) -> str:
            return "slow"

        def _next_ids_slow(self, n: int) -> str:
            return "slow"

    gen = Gen()
    gen._set_bucket(1 << 40, 100, 2**62)
    calls: list[int] = []

    def clock() -> int:
        if not calls:
            gen._set_bucket(2**63 - n, n - 1, 2**62)  # one ID fewer than asked for, the last ones of 63 bits
        calls.append(1)
        return 0

    gen._use_clock(clock)
    assert (gen.next_ids(n) if n > 1 else gen.next_id()) == "slow"
    assert gen._bucket_left() == n - 1

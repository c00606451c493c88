"""The compiled protocol cores and their pure-Python twins side by side, in one process.

A reply must never depend on how its request was split into reads, and the compiled core must answer
exactly as the pure-Python one does. :func:`check_splits` feeds one request to a compiled connection
and to its pure twin, whole and split at every byte boundary (and a byte at a time), and checks that

- for every split, both cores end in the same state: the reply, ``closing``, ``activity``, what they
  hold and the counters (only the ID values in the replies may differ);
- every split gets the reply the whole request gets, ID values aside, and leaves the same state.

The pure twin is built here from the same class (:func:`pure_twin`), on ``PyConnectionCore`` and a
pure-Python generator and counters, whatever ``katsubushi_py.compiled`` selected for this run; both
generators read one injected clock, which moves only when a command must wait for it (or a
millisecond's IDs are used up). Without the compiled module, both sides are the pure core and the
check still compares splits. The fuzzing of issue 23 reuses :class:`Twins` and :func:`check_splits`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from katsubushi_py.frontends.binary import BinaryConnection
from katsubushi_py.frontends.fastpath import COMPILED, PyConnectionCore
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.ids.layout import Layout
from katsubushi_py.issuing.bucket import PyGeneratorCore
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.issuer import Issuer, PyCounters

START_MS = 1_795_305_600_000  # 2026-11-22T00:00:00Z

_pure_classes: dict[type, type] = {}


def pure_twin(cls: type) -> type:
    """``cls`` (a class deriving from a compiled core) rebuilt on its pure-Python reference base: the
    same methods, with ``_receive_slow`` as ``receive``, as ``KATSUBUSHI_NO_EXTENSIONS=1`` builds it."""
    if cls in _pure_classes:
        return _pure_classes[cls]
    base = PyConnectionCore if issubclass(cls, (TextConnection, BinaryConnection)) else PyGeneratorCore
    if cls.__mro__[1] is base:  # already the pure one (this run has no compiled module)
        return cls
    slots = set(getattr(cls, "__slots__", ()))
    namespace = {k: v for k, v in vars(cls).items() if k not in slots and k not in ("__dict__", "__weakref__")}
    if base is PyConnectionCore:
        namespace["receive"] = cls._receive_slow  # type: ignore[attr-defined]
    else:
        namespace["next_ids"] = cls._next_ids_slow  # type: ignore[attr-defined]
    twin = type("Pure" + cls.__name__, (base,), namespace)
    _pure_classes[cls] = twin
    return twin


class PureIssuer(Issuer):
    """An issuer whose counters are the pure-Python ones."""

    def counters(self, protocol: str) -> Any:
        counters = self._counters.get(protocol)
        if counters is None:
            counters = self._counters[protocol] = PyCounters(protocol)
        return counters


class StepClock:
    """Wall and monotonic clocks that move only when told, or when someone sleeps."""

    def __init__(self) -> None:
        self.wall = START_MS * 1_000_000
        self.mono = 10**12

    def wall_ns(self) -> int:
        return self.wall

    def monotonic_ns(self) -> int:
        return self.mono

    def sleep(self, seconds: float) -> None:
        self.advance_ns(max(int(seconds * 1e9), 1000))

    def advance_ns(self, ns: int) -> None:
        self.wall += ns
        self.mono += ns


def connection(protocol: str, pure: bool, clock: StepClock, sequence_bits: int = 12, **kwargs: Any) -> Any:
    """A text or binary connection on a fresh generator (worker id 5) reading ``clock``."""
    layout = Layout(sequence_bits=sequence_bits, worker_bits=10, time_bits=41)
    gen_class = pure_twin(Generator) if pure else Generator
    generator = gen_class(5, layout, clock=clock, block_on_clock=False)
    issuer = (PureIssuer if pure else Issuer)(generator, "1.0.0")
    cls = TextConnection if protocol == "text" else BinaryConnection
    return (pure_twin(cls) if pure else cls)(issuer, **kwargs)


@dataclass
class Outcome:
    """What a connection answered to a sequence of reads, and the state it was left in."""

    reply: bytes
    closing: bool
    activity: int
    state: int
    held: bytes
    counters: list[tuple[str, int, int, list[tuple[str, int]]]]

    def without_ids(self) -> tuple[bytes, bool, int, bytes]:
        """What must not depend on how the request was split: the reply (ID values aside), whether
        the connection closes, and what it holds for later."""
        return mask_ids(self.reply), self.closing, self.state, self.held


def feed(conn: Any, chunks: Iterable[bytes], clock: StepClock) -> Outcome:
    """Each chunk as one read; after each, what the server does: ``resume`` once the reply is written
    (``backlog``) or the clock has moved on (``wait``, which this clock does at once)."""
    reply = b""
    for chunk in chunks:
        reply += conn.receive(chunk)
        while (conn.wait or conn.backlog) and not conn.closing:
            if conn.wait:
                clock.advance_ns(int(conn.wait * 1e9) + 1)
            reply += conn.resume()
        if conn.closing:
            break
    counters = sorted((c.protocol, c.commands, c.ids, sorted(c.failures.items())) for c in conn._issuer.all_counters())
    return Outcome(reply, bool(conn.closing), conn.activity, conn._state, conn._buffer, counters)


_ID = re.compile(rb"\d{15,20}")


def mask_ids(reply: bytes) -> bytes:
    """``reply`` with every ID (a run of 15 to 20 digits: today's IDs have 19) replaced by ``<id>``."""
    return _ID.sub(b"<id>", reply)


class Twins:
    """A compiled connection and its pure twin for one protocol, each on a fresh generator; one clock."""

    def __init__(self, protocol: str, **kwargs: Any) -> None:
        self.protocol = protocol
        self.kwargs = kwargs

    def run(self, chunks: Sequence[bytes]) -> tuple[Outcome, Outcome]:
        clock = StepClock()
        compiled = feed(connection(self.protocol, False, clock, **self.kwargs), chunks, clock)
        pure = feed(connection(self.protocol, True, clock, **self.kwargs), chunks, clock)
        return compiled, pure

    def agree(self, chunks: Sequence[bytes]) -> Outcome:
        """Both cores' outcome for these reads, which must be the same (ID values aside)."""
        compiled, pure = self.run(chunks)
        assert (compiled.without_ids(), compiled.activity, compiled.counters) == (
            pure.without_ids(),
            pure.activity,
            pure.counters,
        ), f"the compiled core and its pure twin differ for reads {list(chunks)!r}:\n{compiled}\n{pure}"
        return compiled


def splits(data: bytes, rng: random.Random | None = None, every: bool = True) -> list[list[bytes]]:
    """Ways to cut ``data`` into reads: whole; in two at every boundary (or at 64 random ones when not
    ``every``); a byte at a time (when short); and, with ``rng``, some random multi-cuts."""
    out = [[data]]
    cuts = range(1, len(data)) if every else sorted((rng or random.Random(0)).sample(range(1, len(data)), 64))
    out += [[data[:i], data[i:]] for i in cuts]
    if len(data) <= 4096:
        out.append([data[i : i + 1] for i in range(len(data))])
    if rng is not None and len(data) > 2:
        for _ in range(32):
            points = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(2, 8))))
            out.append([data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)])
    return out


def check_splits(protocol: str, data: bytes, *, every: bool = True, seed: int = 0, **kwargs: Any) -> Outcome:
    """Feed ``data`` whole and split every way :func:`splits` makes; the compiled core and its twin
    must agree on each, and each split must get the whole request's reply (ID values aside) and leave
    the same state. Returns the whole request's outcome."""
    twins = Twins(protocol, **kwargs)
    whole = twins.agree([data])
    for chunks in splits(data, random.Random(seed), every)[1:]:
        outcome = twins.agree(chunks)
        assert outcome.without_ids() == whole.without_ids(), (
            f"the reply depends on how the request is split: {[len(c) for c in chunks]}\n"
            f"whole: {whole.without_ids()!r}\nsplit: {outcome.without_ids()!r}"
        )
    return whole


__all__ = ["COMPILED", "Outcome", "Twins", "check_splits", "connection", "feed", "mask_ids", "pure_twin", "splits"]

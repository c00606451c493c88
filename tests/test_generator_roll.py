"""The compiled core's roll: the next millisecond's bucket set in C, exactly as ``_refill`` would.

When a bucket's millisecond has ended and the next needs no decision (no wait, no fence, no
state-file window), the compiled ``GeneratorCore`` sets the new bucket itself (``gen_roll``), so that
the one request a millisecond that meets it does not leave C. The pure core has no roll: there the
generator's ``_refill`` does that step. These tests hold the roll to three things:

- it issues exactly what the pure twin issues, step for step, under every operation the generator
  has (a hypothesis state machine on two identical fake clocks);
- it never passes what ``_refill`` guards: the state file's reservation, the lease fence, a worker id
  switched or retired, a reanchor;
- it cannot set a bucket while a ``_refill`` in another thread waits with the GIL released (the
  duplicate that would make is reproduced here when the disarm is left out).
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock, decode
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from twins import pure_twin

from katsubushi_py import Generator, Layout
from katsubushi_py.issuing.bucket import PyGeneratorCore
from katsubushi_py.issuing.errors import GenerationError, LeaseNotConfirmedError
from katsubushi_py.issuing.statefile import StateFile

COMPILED = Generator.__mro__[1] is not PyGeneratorCore
pytestmark = pytest.mark.skipif(not COMPILED, reason="the compiled core is not in use: there is no roll")

SMALL = Layout(sequence_bits=2, worker_bits=10, time_bits=41)  # 4 IDs a millisecond: used up often


class Counting:
    """Counts a generator's refills (each is a trip to Python the roll did not save)."""

    refills = 0

    def _refill(self) -> None:
        self.refills += 1
        super()._refill()  # type: ignore[misc]


class Counted(Counting, Generator):
    """The generator on whichever core this run uses (here the compiled one)."""


class PureCounted(Counting, pure_twin(Generator)):  # type: ignore[misc]
    """Its twin on the pure-Python core."""


def outcome(call: Any) -> tuple[str, object]:
    try:
        return ("ok", call())
    except GenerationError as exc:
        return (type(exc).__name__, str(exc))


class CompiledAgainstPure(RuleBasedStateMachine):
    """Every operation applied to a compiled generator and to its pure twin, each on its own fake clock
    moved identically, each with its own state file: every answer, every error and the state the
    generator reports must be the same."""

    @initialize(sequence_bits=st.sampled_from([2, 12]), reserve_ms=st.sampled_from([3, 50, 2000]))
    def start(self, sequence_bits: int, reserve_ms: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="roll-"))
        layout = Layout(sequence_bits=sequence_bits, worker_bits=10, time_bits=41)
        self.clocks = (FakeClock(), FakeClock())
        self.gens = tuple(
            cls(
                5,
                layout,
                clock=clock,
                state_file=str(self.dir / f"{i}.state"),
                reserve_window=reserve_ms / 1000,
                block_on_clock=True,
            )
            for i, (cls, clock) in enumerate(zip((Counted, PureCounted), self.clocks, strict=True))
        )
        self.worker = 5

    def both(self, call: Any) -> object:
        a, b = (outcome(lambda g=g: call(g)) for g in self.gens)
        assert a == b
        return a[1]

    @rule(ns=st.sampled_from([0, 1_000, 300_000, 999_999, 1_000_000, 1_000_001, 2_500_000, 40_000_000]))
    def advance(self, ns: int) -> None:
        for clock in self.clocks:
            clock.advance_ns(ns)

    @rule()
    def next_id(self) -> None:
        self.both(lambda g: g.next_id())

    @rule(n=st.integers(1, 9))
    def next_ids(self, n: int) -> None:
        self.both(lambda g: g.next_ids(n))

    @rule(ahead_ns=st.sampled_from([None, -1, 0, 400_000, 1_500_000, 30_000_000]))
    def fence(self, ahead_ns: int | None) -> None:
        for g, clock in zip(self.gens, self.clocks, strict=True):
            g.set_fence(None if ahead_ns is None else clock.mono + ahead_ns)

    @rule(step_ms=st.sampled_from([-300, -4, -1, 0, 2]))
    def reanchor(self, step_ms: int) -> None:
        for g, clock in zip(self.gens, self.clocks, strict=True):
            clock.step_wall_ms(step_ms)
            g.reanchor()

    @precondition(lambda self: self.worker < 12)
    @rule(after_ms=st.sampled_from([0, 3, 40]))
    def switch_worker(self, after_ms: int) -> None:
        self.worker += 1
        for i, (g, clock) in enumerate(zip(self.gens, self.clocks, strict=True)):
            state = StateFile(self.dir / f"{i}-{self.worker}.state")
            after = 0 if not after_ms else clock.wall // 1_000_000 + after_ms
            g.switch_worker(self.worker, after, state)

    @rule()
    def check(self) -> None:
        a, b = (g.check() for g in self.gens)
        assert (type(a), str(a)) == (type(b), str(b))

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "gens"):
            return
        a, b = self.gens
        assert (a.last_issued_ms, a.high_water_ms, a.worker_id) == (b.last_issued_ms, b.high_water_ms, b.worker_id)

    def teardown(self) -> None:
        for g in getattr(self, "gens", ()):
            g.close()


TestCompiledAgainstPure = CompiledAgainstPure.TestCase
TestCompiledAgainstPure.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_the_roll_saves_the_refill_and_issues_what_the_pure_twin_issues() -> None:
    """A request every 0.3 ms for 200 ms: the pure twin refills once a millisecond, the compiled core
    once in all (the first bucket), and both issue the same IDs."""
    gens = [cls(3, clock=FakeClock()) for cls in (Counted, PureCounted)]
    issued: list[list[int]] = [[], []]
    for _ in range(667):
        for g, out in zip(gens, issued, strict=True):
            out.append(g.next_id())
            g._clock.advance_ns(300_000)  # type: ignore[attr-defined]
    assert issued[0] == issued[1]
    assert len({decode(i)[0] for i in issued[0]}) == 200
    assert (gens[0].refills, gens[1].refills) == (1, 200)


def test_the_roll_never_passes_the_state_files_reservation(tmp_path: Path) -> None:
    """Whenever an ID is handed out, the state file on disk already covers its millisecond."""
    clock = FakeClock()
    path = tmp_path / "state"
    gen = Counted(1, clock=clock, state_file=str(path), reserve_window=0.005)
    for _ in range(300):
        id_ = gen.next_id()
        mark = StateFile(path).load()
        assert mark is not None and decode(id_)[0] <= mark
        clock.advance_ns(700_000)
    # 210 ms: each window crossing (every 6 ms: 5 reserved ahead, then one past) went to Python, and
    # only those (the roll took the other milliseconds).
    assert 210 // 6 - 1 <= gen.refills <= 210 // 6 + 1


def test_the_roll_stops_at_the_fence_and_after_a_switch_or_retire(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    gen.set_fence(clock.mono + 2_500_000, "lease not confirmed (test)")
    first = gen.next_id()
    clock.advance_ms(1)
    assert decode(gen.next_id())[0] == decode(first)[0] + 1  # rolled, inside the fence
    clock.advance_ms(2)
    with pytest.raises(LeaseNotConfirmedError, match=r"lease not confirmed \(test\)"):
        gen.next_id()
    gen.set_fence(None)
    assert decode(gen.next_id())[1] == 1
    gen.switch_worker(9)
    clock.advance_ms(1)
    assert decode(gen.next_id())[1] == 9  # a roll after the switch issues under the new id
    clock.advance_ms(1)
    assert decode(gen.next_id())[1] == 9
    gen.retire_worker("retired (test)")
    clock.advance_ms(1)
    with pytest.raises(LeaseNotConfirmedError, match=r"retired \(test\)"):
        gen.next_id()


def test_no_roll_while_a_refill_waits_in_another_thread() -> None:
    """Thread A has used up a millisecond and waits in ``_refill`` for the next one (the GIL
    released, the lock held). The clock moves on; thread B asks for an ID. B must wait for A, not set
    the new millisecond's bucket itself: A would then set the same bucket again and hand out B's ID."""
    sleeping, wake = threading.Event(), threading.Event()

    class BlockingClock(FakeClock):
        def sleep(self, seconds: float) -> None:
            if threading.current_thread().name == "A" and not wake.is_set():
                sleeping.set()
                assert wake.wait(10)
            self.advance_ns(1000)

    clock = BlockingClock()
    gen = Generator(1, SMALL, clock=clock)
    issued = [gen.next_id() for _ in range(4)]  # millisecond X used up (and the roll armed)
    got: dict[str, int] = {}
    a = threading.Thread(target=lambda: got.__setitem__("A", gen.next_id()), name="A")
    a.start()
    assert sleeping.wait(10)
    clock.advance_ns(1_000_000)  # millisecond X + 1
    b = threading.Thread(target=lambda: got.__setitem__("B", gen.next_id()), name="B")
    b.start()
    b.join(0.5)  # B either waits for A's lock (right) or has rolled already (the bug)
    wake.set()
    a.join(10)
    b.join(10)
    issued += [got["A"], got["B"]]
    assert len(set(issued)) == len(issued), issued

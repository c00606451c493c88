import itertools
import json
import threading
from pathlib import Path

import pytest
from conftest import FAKE_START_MS, FakeClock, decode

from katsubushi_py import (
    ClockMovedBackwardsError,
    Generator,
    GeneratorClosedError,
    Layout,
    LayoutError,
    LayoutExhaustedError,
    StateFileError,
)
from katsubushi_py.issuing.statefile import StateFile


def test_one_million_ids_strictly_increase_with_the_real_clock() -> None:
    gen = Generator(5)
    ids = [gen.next_id() for _ in range(500_000)]
    ids += gen.next_ids(500_000)
    assert len(ids) == 1_000_000
    assert all(a < b for a, b in itertools.pairwise(ids))
    assert {decode(i)[1] for i in ids} == {5}


def test_ids_carry_time_worker_and_sequence(clock: FakeClock) -> None:
    gen = Generator(42, clock=clock)
    first, second = gen.next_id(), gen.next_id()
    assert decode(first) == (FAKE_START_MS, 42, 0)
    assert decode(second) == (FAKE_START_MS, 42, 1)
    clock.advance_ms(3)
    assert decode(gen.next_id()) == (FAKE_START_MS + 3, 42, 0)


def test_next_ids_hands_out_consecutive_sequence_numbers(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    ids = gen.next_ids(10)
    assert ids == list(range(ids[0], ids[0] + 10))
    assert [decode(i)[2] for i in ids] == list(range(10))
    assert gen.next_ids(0) == []


def test_sequence_overflow_moves_to_the_next_millisecond(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    ids = gen.next_ids(4096 * 3 + 5)
    assert all(a < b for a, b in itertools.pairwise(ids))
    times = [decode(i)[0] for i in ids]
    assert times[0] == FAKE_START_MS and times[4095] == FAKE_START_MS
    assert times[4096] == FAKE_START_MS + 1 and decode(ids[4096])[2] == 0
    assert times[-1] == FAKE_START_MS + 3
    assert gen.sequence_overflow_waits == 3
    assert clock.slept < 0.0045  # waited about three milliseconds, not more


def test_next_id_overflow_waits_for_the_next_millisecond(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    ids = [gen.next_id() for _ in range(4097)]
    assert decode(ids[-1]) == (FAKE_START_MS + 1, 1, 0)
    assert len(set(ids)) == 4097
    assert gen.sequence_overflow_waits == 1


def test_wall_clock_step_does_not_move_ids_and_shows_as_drift(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    before = gen.next_id()
    clock.step_wall_ms(-60_000)
    after = gen.next_id()
    assert after > before
    assert gen.drift_ms() == -60_000
    assert gen.clock_backwards_events == 0


def test_clock_back_5ms_waits_and_never_duplicates(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    issued = gen.next_ids(100)
    clock.step_wall_ms(-5)
    gen.reanchor()
    slept_before = clock.slept
    more = [*gen.next_ids(100), gen.next_id()]
    assert min(more) > max(issued)
    assert len(set(issued + more)) == 201
    assert gen.clock_backwards_events == 1
    assert 0.004 <= clock.slept - slept_before <= 0.007


def test_clock_back_10s_fails_and_never_duplicates(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    issued = gen.next_ids(100)
    clock.step_wall_ms(-10_000)
    gen.reanchor()
    with pytest.raises(ClockMovedBackwardsError, match="backwards by 10000 ms"):
        gen.next_id()
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_ids(3)
    assert gen.clock_backwards_events == 1  # one episode, however many requests it fails
    clock.advance_ms(10_001)
    later = gen.next_ids(5)
    assert min(later) > max(issued)


def test_backwards_wait_bound_is_configurable(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, max_backwards_wait=0.002)
    gen.next_id()
    clock.step_wall_ms(-5)
    gen.reanchor()
    with pytest.raises(ClockMovedBackwardsError):
        gen.next_id()


def test_worker_id_is_validated() -> None:
    with pytest.raises(LayoutError):
        Generator(1024)
    Generator(63, Layout(worker_bits=6, sequence_bits=16))
    with pytest.raises(LayoutError):
        Generator(64, Layout(worker_bits=6, sequence_bits=16))


def test_layout_exhaustion_is_an_error_not_a_wrap() -> None:
    clock = FakeClock()
    layout = Layout(epoch_ms=FAKE_START_MS - 1000, time_bits=35, now_ms=FAKE_START_MS)
    gen = Generator(1, layout, clock=clock)
    gen.next_id()
    clock.advance_ms(1 << 35)
    with pytest.raises(LayoutExhaustedError, match="ran out of time bits"):
        gen.next_id()


def test_threads_never_share_an_id() -> None:
    import sys

    # Switch threads as often as CPython allows, so that the lock-free path is interleaved for real.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    gen = Generator(3)
    results: list[list[int]] = [[] for _ in range(4)]

    def work(out: list[int]) -> None:
        for _ in range(20_000):
            out.append(gen.next_id())
        out.extend(gen.next_ids(5000))

    threads = [threading.Thread(target=work, args=(r,)) for r in results]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    every = [i for r in results for i in r]
    assert len(every) == len(set(every)) == 100_000
    for r in results:
        assert all(a < b for a, b in itertools.pairwise(r))


# -- restart safety -----------------------------------------------------------------------------
def test_state_file_reserves_ahead_once_per_window(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "state"
    stores: list[int] = []

    class CountingState(StateFile):
        def store(self, high_water_ms: int, worker_id: int) -> None:
            stores.append(high_water_ms)
            super().store(high_water_ms, worker_id)

    gen = Generator(1, clock=clock, state_file=CountingState(path), reserve_window=2.0)
    assert len(stores) == 1  # reserved at start, so an unwritable file fails early
    ids = []
    for _ in range(1000):  # one second in 1 ms steps
        ids.append(gen.next_id())
        clock.advance_ms(1)
    assert len(stores) == 1
    clock.advance_ms(1500)
    ids.append(gen.next_id())
    assert len(stores) == 2
    mark = StateFile(path).load()
    assert mark is not None and all(decode(i)[0] <= mark for i in ids)
    assert gen.high_water_ms == mark


def test_restart_after_clock_stepped_back_issues_nothing_old(tmp_path: Path) -> None:
    path = tmp_path / "state"
    clock = FakeClock()
    first = Generator(1, clock=clock, state_file=path)
    issued = first.next_ids(5000)
    del first  # a crash: no clean close, the reserved mark stays
    # The machine restarts with its clock 0.5 s behind; the mark is the 2 s window ahead of that.
    restarted_clock = FakeClock(FAKE_START_MS - 500)
    second = Generator(1, clock=restarted_clock, state_file=path)
    assert restarted_clock.slept > 2.5  # it waited for the clock to pass the mark
    later = second.next_ids(5000)
    assert min(later) > max(issued)


def test_restart_far_behind_the_mark_refuses(tmp_path: Path) -> None:
    path = tmp_path / "state"
    Generator(1, clock=FakeClock(), state_file=path).next_id()
    with pytest.raises(ClockMovedBackwardsError, match="behind the state file's mark"):
        Generator(1, clock=FakeClock(FAKE_START_MS - 60_000), state_file=path)


def test_clean_close_stores_the_last_millisecond_so_restart_is_immediate(tmp_path: Path) -> None:
    path = tmp_path / "state"
    clock = FakeClock()
    gen = Generator(1, clock=clock, state_file=path)
    issued = gen.next_ids(10)
    gen.close()
    assert StateFile(path).load() == FAKE_START_MS
    with pytest.raises(GeneratorClosedError):
        gen.next_id()
    with pytest.raises(GeneratorClosedError):
        gen.next_ids(2)
    clock2 = FakeClock(FAKE_START_MS)
    again = Generator(1, clock=clock2, state_file=path)
    assert clock2.slept < 0.002
    assert again.next_id() > max(issued)


@pytest.mark.parametrize("content", [b"", b"garbage", b'{"format":"katsubushi-py-state/1","high_water_ms":5}'])
def test_damaged_state_file_is_an_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state"
    path.write_bytes(content)
    with pytest.raises(StateFileError, match="damaged"):
        Generator(1, state_file=path)


def test_tampered_mark_fails_its_checksum(tmp_path: Path) -> None:
    path = tmp_path / "state"
    StateFile(path).store(FAKE_START_MS, 1)
    doc = json.loads(path.read_text())
    doc["high_water_ms"] -= 10_000
    path.write_text(json.dumps(doc))
    with pytest.raises(StateFileError, match="damaged"):
        StateFile(path).load()


def test_unwritable_state_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(StateFileError, match="cannot write"):
        Generator(1, state_file=tmp_path / "missing-dir" / "state")


def test_state_file_that_becomes_unwritable_fails_generation(tmp_path: Path, clock: FakeClock) -> None:
    d = tmp_path / "d"
    d.mkdir()
    gen = Generator(1, clock=clock, state_file=d / "state")
    gen.next_id()
    (d / "state").unlink()
    (d / "state.lock").unlink()  # the lock stays held on the open descriptor; only the name goes
    d.rmdir()
    clock.advance_ms(5000)
    with pytest.raises(StateFileError):
        gen.next_id()

"""The issuing core: failures with reasons, clock waits that block nobody, one clock reading per
refill, unexpected errors answered, and the locked path for free-threaded CPython."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

import pytest
from conftest import FAKE_START_MS, FakeClock, decode

from katsubushi_py.config import ServerConfig
from katsubushi_py.daemon.server import Daemon
from katsubushi_py.frontends.text import TextConnection
from katsubushi_py.issuing.errors import ClockWait, LeaseNotConfirmedError
from katsubushi_py.issuing.generator import Generator, SystemClock
from katsubushi_py.issuing.issuer import Failure, Issuer


def behind(gen: Generator, clock: FakeClock, ms: int) -> None:
    """Put the generator's clock ``ms`` behind its last issued millisecond."""
    clock.step_wall_ms(-ms)
    gen.reanchor()


def test_issue_returns_ids_or_a_failure_and_counts_per_protocol(clock: FakeClock) -> None:
    gen = Generator(3, clock=clock)
    issuer = Issuer(gen, "1.2.3")
    text, http = issuer.counters("text"), issuer.counters("http")
    assert issuer.counters("text") is text
    ids = issuer.issue(http, 5)
    assert isinstance(ids, list) and len(ids) == 5 and all(a < b for a, b in itertools.pairwise(ids))
    behind(gen, clock, 5_000)
    failure = issuer.issue(text, 2)
    assert failure == Failure("clock_backwards", "clock moved backwards by 5000 ms (more than the 1000 ms we may wait)")
    assert (http.commands, http.ids, http.failures) == (1, 5, {})
    assert (text.commands, text.ids, text.failures) == (1, 0, {"clock_backwards": 1})
    assert issuer.totals() == (2, 5, 1)
    assert issuer.health() == failure
    clock.advance_ms(5_001)
    assert issuer.health() is None
    issuer.unavailable = "shutting down"
    assert issuer.health() == Failure("unavailable", "shutting down")


def test_non_blocking_generator_asks_to_wait_instead_of_sleeping(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    first = gen.next_ids(3)
    behind(gen, clock, 300)
    slept = clock.slept
    with pytest.raises(ClockWait) as wait:
        gen.next_id()
    assert 0.299 <= wait.value.seconds <= 0.302
    assert clock.slept == slept  # nothing slept
    with pytest.raises(ClockWait):
        gen.next_ids(2)
    assert gen.clock_backwards_events == 1
    clock.advance_ns(int(wait.value.seconds * 1e9))
    later = gen.next_ids(2)
    assert min(later) > max(first)


def test_a_gap_of_a_millisecond_or_two_is_still_waited_in_place(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    first = gen.next_id()
    behind(gen, clock, 1)
    assert gen.next_id() > first  # no ClockWait for a wait as short as a used-up millisecond


def test_text_connection_defers_a_waiting_command_and_keeps_the_order(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock, block_on_clock=False)
    conn = TextConnection(Issuer(gen, "1"))
    first = conn.receive(b"GET a\r\n")
    behind(gen, clock, 200)
    reply = conn.receive(b"VERSION\r\nGET b\r\nGET c d\r\nVERSION\r\n")
    assert reply == b"VERSION 1\r\n"  # answered up to the command that waits
    assert 0.19 < conn.wait <= 0.201
    assert conn.receive(b"GET e\r\n") == b""  # arrives while waiting: kept, in order
    assert conn.resume() == b""  # too early: still waiting
    assert conn.wait > 0
    clock.advance_ms(201)
    rest = conn.resume()
    assert conn.wait == 0
    ids = [int(line) for line in rest.split(b"\r\n") if line.isdigit()]
    assert rest.count(b"VERSION 1\r\n") == 1 and len(ids) == 4
    assert [line.split()[1] for line in rest.split(b"\r\n") if line.startswith(b"VALUE")] == [b"b", b"c", b"d", b"e"]
    assert all(a < b for a, b in itertools.pairwise(ids)) and ids[0] > int(first.split(b"\r\n")[1])
    assert conn._issuer.totals() == (4, 5, 0)  # a waiting command is counted once, when answered


class PausingClock(FakeClock):
    """A clock whose monotonic reading jumps forward after ``pause_after`` more reads: a GC pause,
    SIGSTOP or VM freeze at an arbitrary point of the refill."""

    def __init__(self) -> None:
        super().__init__()
        self.pause_after: int | None = None
        self.pause_ns = 0

    def monotonic_ns(self) -> int:
        reading = self.mono
        if self.pause_after is not None:
            if self.pause_after == 0:
                self.advance_ns(self.pause_ns)
                self.pause_after = None
            else:
                self.pause_after -= 1
        return reading


@pytest.mark.parametrize("reads_before_pause", [0, 1, 2, 3])
def test_a_pause_anywhere_in_the_refill_never_issues_past_the_fence(reads_before_pause: int) -> None:
    clock = PausingClock()
    gen = Generator(1, clock=clock)
    gen.next_id()
    fence = clock.mono + 5_000_000  # the lease allows 5 ms more
    fence_ms = FAKE_START_MS + 5
    gen.set_fence(fence)
    clock.advance_ms(4)  # 1 ms before the fence: a new millisecond needs a refill
    clock.pause_after, clock.pause_ns = reads_before_pause, 50_000_000  # then 50 ms pass
    issued = []
    for _ in range(3):
        try:
            issued.append(gen.next_id())
        except LeaseNotConfirmedError:
            break
    assert all(decode(i)[0] < fence_ms for i in issued), [decode(i) for i in issued]
    with pytest.raises(LeaseNotConfirmedError):
        gen.next_id()


def test_fence_is_checked_again_after_waiting_for_the_next_millisecond(clock: FakeClock) -> None:
    gen = Generator(1, clock=clock)
    gen.set_fence(clock.mono + 500_000)  # half a millisecond left
    gen.next_ids(4096)  # uses up this millisecond: the next one starts after the fence
    with pytest.raises(LeaseNotConfirmedError):
        gen.next_id()
    assert gen.sequence_overflow_waits == 1


def test_unexpected_exception_is_answered_and_logged_once(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    gen = Generator(1, clock=clock)
    issuer = Issuer(gen, "1")
    conn = TextConnection(issuer)

    def broken() -> int:
        raise OSError(22, "Invalid argument")

    conn._next_id = broken
    with caplog.at_level(logging.ERROR, logger="katsubushi_py"):
        replies = [conn.receive(b"GET a\r\n") for _ in range(3)]
    assert replies == [b"SERVER_ERROR internal error (OSError); see the daemon's log\r\n"] * 3
    assert not conn.closing
    assert conn.receive(b"GET a b\r\n").startswith(b"VALUE a 0 ")  # the rest still works
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None  # once, with its traceback
    assert issuer.counters("text").failures == {"internal": 3}


def test_locked_path_for_free_threaded_python_never_shares_an_id() -> None:
    gen = Generator(2, free_threaded=True)
    assert gen.next_id.__func__ is Generator._next_id_locked  # type: ignore[attr-defined]
    results: list[list[int]] = [[] for _ in range(4)]

    def work(out: list[int]) -> None:
        for _ in range(50_000):
            out.append(gen.next_id())

    threads = [threading.Thread(target=work, args=(out,)) for out in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for out in results for i in out]
    assert len(set(every)) == len(every) == 200_000
    assert all(all(a < b for a, b in itertools.pairwise(out)) for out in results)


class SteppableClock(SystemClock):
    """The real clocks, with a wall clock that can be stepped like ``date -s``."""

    def __init__(self) -> None:
        self.offset_ns = 0

    def wall_ns(self) -> int:  # type: ignore[override]
        return time.time_ns() + self.offset_ns


async def test_a_request_waiting_for_the_clock_blocks_no_other_connection() -> None:
    clock = SteppableClock()
    gen = Generator(4, clock=clock, block_on_clock=False)
    loop = asyncio.get_running_loop()
    daemon = Daemon(ServerConfig(worker_id=4, port=0), gen, loop)
    await daemon.start()
    port = int(daemon.addresses[0].rsplit(":", 1)[1])
    try:
        first = gen.next_id()
        clock.offset_ns = -600_000_000  # 600 ms behind what was issued
        gen.reanchor()

        async def ask(line: bytes, half_close: bool = False) -> tuple[bytes, float]:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            started = time.monotonic()
            writer.write(line)
            if half_close:
                writer.write_eof()  # the answer must still come after the wait
            data = await reader.read() if half_close else await reader.readline()
            writer.close()
            return data, time.monotonic() - started

        waiting = asyncio.ensure_future(ask(b"GET late\r\nGET later\r\n", half_close=True))
        await asyncio.sleep(0.05)
        version, quick = await ask(b"VERSION\r\n")
        assert version.startswith(b"VERSION ") and quick < 0.3  # served while the GETs wait
        reply, slow = await waiting
        lines = reply.split(b"\r\n")
        assert lines[0] == b"VALUE late 0 19" and lines[3] == b"VALUE later 0 19" and lines[-1] == b""
        assert first < int(lines[1]) < int(lines[4]) and slow >= 0.5
    finally:
        await daemon.stop()

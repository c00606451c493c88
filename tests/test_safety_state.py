"""State files cannot be shared or mixed up (issue 11): a file is locked while a daemon issues under it,
the worker id written in it is compared, a state directory keeps a file per worker id, and a daemon
uses one by default. Real daemons as subprocesses; the generator's side with an injected clock."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path

import pytest
from conftest import FAKE_START_MS, DaemonFactory, FakeClock, decode
from id_recorder import Recorder
from lease_helpers import ids, init_pool, run_tool, start_leased, stats, wait_until
from redis_servers import RedisServer

from katsubushi_py.config import default_state_dir
from katsubushi_py.issuing.errors import LeaseNotConfirmedError, StateFileError
from katsubushi_py.issuing.generator import Generator
from katsubushi_py.issuing.statefile import StateDirectory, StateFile, StateFileInUse


def error_line(stderr: str) -> str:
    """The daemon's one error line (after any log lines)."""
    return stderr.strip().splitlines()[-1]


# -- daemons ---------------------------------------------------------------------------------------
def test_two_daemons_given_one_state_file(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A copy-pasted unit file, or two containers on one volume: the second daemon refuses to start,
    whatever worker id it was given, and the first goes on serving."""
    shared = tmp_path / "state"
    first = daemons.start("--state-file", str(shared), worker_id=7)
    before = ids(first, 10)
    for worker_id in (7, 8):
        second = daemons.start("--state-file", str(shared), worker_id=worker_id, wait=False)
        assert second.proc.wait(20) == 1
        assert error_line(second.stderr()) == f"katsubushi-py: error: state file {shared} is in use by pid {first.pid}"
    assert min(ids(first, 10)) > max(before)
    assert first.stop() == 0  # and once it stopped, the file is free again
    third = daemons.start("--state-file", str(shared), worker_id=7)
    assert min(ids(third, 10)) > max(before)


def test_a_state_file_written_for_another_worker_id_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    path = tmp_path / "state"
    first = daemons.start("--state-file", str(path), worker_id=7)
    issued = ids(first, 10)
    assert first.stop() == 0
    moved = daemons.start("--state-file", str(path), worker_id=8, wait=False)
    assert moved.proc.wait(20) == 1
    line = error_line(moved.stderr())
    assert f"state file {path} was written by worker id 7, not 8" in line and "--state-file-new-worker-id" in line
    # Told that the change is deliberate, it starts, and still issues after the file's mark.
    mark = json.loads(path.read_text())["high_water_ms"]
    adopted = daemons.start("--state-file", str(path), "--state-file-new-worker-id", worker_id=8)
    later = ids(adopted, 10)
    assert {decode(i)[1] for i in later} == {8} and min(decode(i)[0] for i in later) > mark >= decode(max(issued))[0]
    assert adopted.stop() == 0
    assert json.loads(path.read_text())["worker_id"] == 8


def test_two_daemons_on_one_worker_id_in_one_state_directory(daemons: DaemonFactory, tmp_path: Path) -> None:
    state = tmp_path / "state-dir"
    first = daemons.start("--state-dir", str(state), worker_id=3)
    other = daemons.start("--state-dir", str(state), worker_id=4)  # another worker id: fine
    assert ids(first) and ids(other)
    same = daemons.start("--state-dir", str(state), worker_id=3, wait=False)
    assert same.proc.wait(20) == 1
    expected = f"katsubushi-py: error: state file {state / 'worker-3.state'} is in use by pid {first.pid}"
    assert error_line(same.stderr()) == expected
    assert sorted(p.name for p in state.iterdir()) == [
        "worker-3.state",
        "worker-3.state.lock",
        "worker-4.state",
        "worker-4.state.lock",
    ]


def test_default_state_directory_is_made_private_and_logged(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Without a state flag the daemon keeps its state in a default directory (here systemd's
    $STATE_DIRECTORY), made if missing, mode 0700, and says where; a kill and a restart then cannot
    reissue."""
    home = tmp_path / "systemd-state" / "katsubushi-py"
    d = daemons.start(worker_id=5, env={"STATE_DIRECTORY": f"{home}:/unused"})
    issued = ids(d, 20)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    d.wait_for_log(f"); state file {home / 'worker-5.state'} ($STATE_DIRECTORY)\n")  # the serving line
    mark = int(stats(d)["state_file_high_water_ms"])
    d.stop(signal.SIGKILL)
    again = daemons.start(worker_id=5, env={"STATE_DIRECTORY": str(home)})
    assert min(decode(i)[0] for i in ids(again, 5)) > mark >= decode(max(issued))[0]


def test_no_state_file_says_what_is_lost(daemons: DaemonFactory) -> None:
    d = daemons.start("--no-state-file", worker_id=5)
    assert ids(d)
    assert stats(d)["state_file_high_water_ms"] == "0"
    assert "WARNING --no-state-file: no state is kept, so a restart after the wall clock stepped back" in d.stderr()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--worker-id", "1", "--no-state-file", "--state-dir", "/tmp/x"), "--no-state-file cannot be combined"),
        (("--worker-id", "1", "--state-file", "/tmp/x", "--state-dir", "/tmp/y"), "either --state-file or --state-dir"),
        (("--redis", "redis://127.0.0.1:1/0", "--state-file", "/tmp/x"), "with --redis use --state-dir"),
    ],
)
def test_bad_state_configuration(args: tuple[str, ...], message: str) -> None:
    result = run_tool(*args, "--port", "1")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_unusable_state_directory_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_tool("--worker-id", "1", "--port", "1", "--state-dir", str(blocker / "sub"))
    assert result.returncode == 1
    assert error_line(result.stderr).startswith(
        f"katsubushi-py: error: cannot create state directory {blocker / 'sub'}"
    )
    assert "Traceback" not in result.stderr


def test_leased_id_whose_state_file_another_local_daemon_holds(
    daemons: DaemonFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A daemon with a static --worker-id 1 shares the state directory of a leasing daemon whose pool
    holds 1 as free: the leasing daemon must not issue under 1. It quarantines 1 in Redis (someone
    issues under it that Redis does not know of), says so, and leases 2."""
    state = tmp_path / "shared"
    static = daemons.start("--state-dir", str(state), worker_id=1)
    init_pool(redis_server.url, low=1, high=2)
    leased = start_leased(daemons, redis_server.url, "--state-dir", str(state), "--clock-skew-max", "1s")
    fields = stats(leased)
    assert fields["worker_id"] == "2" and fields["lease_state_file_conflicts"] == "1"
    assert {decode(i)[1] for i in ids(leased, 10)} == {2}
    log = leased.stderr()
    assert (
        f"worker id 1 was free in Redis, but state file {state / 'worker-1.state'} is in use by pid {static.pid}" in log
    )
    rows = {
        row["worker_id"]: row
        for row in map(json.loads, run_tool("lease", "list", "--redis", f"{redis_server.url}?ns=t").stdout.splitlines())
    }
    assert rows[1]["quarantined"] and rows[1]["owner"] == "" and rows[2]["in_use"]
    assert sorted(p.name for p in state.iterdir() if p.suffix == ".state") == ["worker-1.state", "worker-2.state"]


def test_leased_ids_keep_their_marks_in_the_state_directory(
    daemons: DaemonFactory, redis_server: RedisServer, tmp_path: Path
) -> None:
    state = tmp_path / "leased-state"
    d = start_leased(
        daemons, redis_server.url, "--state-dir", str(state), "--min-worker-id", "9", "--max-worker-id", "9"
    )
    issued = ids(d, 50)
    assert d.stop() == 0
    doc = json.loads((state / "worker-9.state").read_text())
    assert doc["worker_id"] == 9 and doc["high_water_ms"] == decode(max(issued))[0]  # a clean stop: exact


# -- default directory -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("environ", "euid", "expected"),
    [
        (
            {"STATE_DIRECTORY": "/var/lib/kp:/var/lib/other", "HOME": "/home/u"},
            1000,
            ("/var/lib/kp", "$STATE_DIRECTORY"),
        ),
        ({"HOME": "/home/u"}, 0, ("/var/lib/katsubushi-py", "default for root")),
        ({"HOME": "/home/u", "XDG_STATE_HOME": "/xdg"}, 1000, ("/xdg/katsubushi-py", "$XDG_STATE_HOME")),
        ({"HOME": "/home/u", "XDG_STATE_HOME": "relative"}, 1000, ("/home/u/.local/state/katsubushi-py", "default")),
        ({"HOME": "/home/u"}, 1000, ("/home/u/.local/state/katsubushi-py", "default")),
    ],
)
def test_default_state_directory(environ: dict[str, str], euid: int, expected: tuple[str, str]) -> None:
    assert default_state_dir(environ, euid) == expected


# -- the generator's side --------------------------------------------------------------------------
def test_a_generator_locks_its_state_file(tmp_path: Path) -> None:
    path = tmp_path / "state"
    first = Generator(1, clock=FakeClock(), state_file=path)
    with pytest.raises(StateFileInUse, match=f"state file {path} is in use by pid {os.getpid()}"):
        Generator(1, clock=FakeClock(), state_file=path)
    first.close()  # stores the final mark and lets the file go
    Generator(1, clock=FakeClock(), state_file=path).close()


def test_worker_id_recorded_in_the_state_file_is_compared(tmp_path: Path) -> None:
    path = tmp_path / "state"
    Generator(1, clock=FakeClock(), state_file=path).close()
    with pytest.raises(StateFileError, match="was written by worker id 1, not 2"):
        Generator(2, clock=FakeClock(), state_file=path)
    assert not StateFile(path).locked  # a refused file is not kept locked
    Generator(2, clock=FakeClock(), state_file=path, allow_worker_id_change=True).close()
    assert StateFile(path).load() is not None and json.loads(path.read_text())["worker_id"] == 2


def test_switching_worker_ids_moves_between_their_state_files(tmp_path: Path) -> None:
    """A leasing daemon's generator: each leased id's own file; never at or below that file's mark;
    the file it leaves gets the exact last millisecond and is unlocked."""
    clock = FakeClock()
    directory = StateDirectory(tmp_path)
    directory.file_for(5).store(FAKE_START_MS + 300, 5)  # another daemon of this host issued under 5 until then
    gen = Generator(1, clock=clock)
    gen.set_fence(0, "waiting for a worker id lease")
    with pytest.raises(LeaseNotConfirmedError, match="waiting for a worker id lease"):
        gen.next_id()
    gen.switch_worker(5, 0, directory.claim(5))
    gen.set_fence(None)
    clock.advance_ms(400)
    first = gen.next_id()
    assert decode(first)[1] == 5 and decode(first)[0] > FAKE_START_MS + 300
    assert gen.high_water_ms is not None and gen.high_water_ms >= decode(first)[0]  # reserved before issuing
    with pytest.raises(StateFileInUse):
        directory.claim(5)
    gen.switch_worker(6, 0, directory.claim(6))
    assert directory.file_for(5).load() == decode(first)[0]  # exactly the last millisecond issued under 5
    directory.claim(5).unlock()  # free again
    assert decode(gen.next_id())[1] == 6
    gen.retire_worker("waiting for a worker id lease")
    with pytest.raises(LeaseNotConfirmedError):
        gen.next_id()
    directory.claim(6).unlock()
    gen.close()


def test_a_state_file_of_another_worker_id_is_not_adopted(tmp_path: Path) -> None:
    directory = StateDirectory(tmp_path)
    directory.file_for(3).store(FAKE_START_MS, 4)  # renamed by hand, say
    gen = Generator(1, clock=FakeClock())
    with pytest.raises(StateFileError, match="was written by worker id 4, not 3"):
        gen.switch_worker(3, 0, directory.claim(3))
    directory.claim(3).unlock()  # not left locked


# -- one file, whatever path reaches it (issue 21) -------------------------------------------------
def _second_on_the_same_file(daemons: DaemonFactory, first, path: Path) -> tuple[Recorder, object]:  # type: ignore[no-untyped-def]
    """Start a second daemon with ``path`` (another way to the first one's state file) and the same
    worker id while the first serves under load; load the second too if it listens. Returns once it
    exited, or after a few seconds of load."""
    recorder = Recorder([first]).start()
    second = daemons.start("--state-file", str(path), worker_id=7, wait=False)
    try:
        deadline = time.monotonic() + 8
        added = False
        while time.monotonic() < deadline and second.proc.poll() is None:
            if not added:
                try:
                    second.connect(timeout=0.2).close()
                    recorder.add(second)
                    added = True
                except OSError:
                    pass
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        recorder.stop()
    return recorder, second


def test_a_state_file_reached_through_a_symlink_is_one_file(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Two daemons with one worker id, one given the state file, the other a symlink to it: one lock,
    whatever the path; the second exits within seconds naming the file."""
    real = tmp_path / "real" / "state"
    real.parent.mkdir()
    link = tmp_path / "link-to-state"
    link.symlink_to(real)
    first = daemons.start("--state-file", str(real), worker_id=7)
    started = time.monotonic()
    recorder, second = _second_on_the_same_file(daemons, first, link)
    assert recorder.duplicates() == 0, recorder.summary()
    assert second.proc.poll() == 1 and time.monotonic() - started < 8  # type: ignore[attr-defined]
    line = error_line(second.stderr())  # type: ignore[attr-defined]
    assert str(link) in line and f"is in use by pid {first.pid}" in line, line
    print(f"symlinked state file: {recorder.summary()}; second daemon: {line}")


def test_a_state_file_with_another_hard_link_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The same with a hard link: the second daemon exits within seconds, naming the file and why; the
    first never breaks the link (it writes the file in place while it has more than one)."""
    real = tmp_path / "state"
    first = daemons.start("--state-file", str(real), worker_id=7)
    assert ids(first)
    link = tmp_path / "hard-link-to-state"
    os.link(real, link)
    started = time.monotonic()
    recorder, second = _second_on_the_same_file(daemons, first, link)
    assert recorder.duplicates() == 0, recorder.summary()
    assert second.proc.poll() == 1 and time.monotonic() - started < 8  # type: ignore[attr-defined]
    line = error_line(second.stderr())  # type: ignore[attr-defined]
    assert str(link) in line and "2 hard links" in line, line
    print(f"hard-linked state file: {recorder.summary()}; second daemon: {line}")
    # The first daemon goes on reserving ahead (a window every 2 s under load) without breaking the link.
    before = json.loads(real.read_text())["high_water_ms"]
    wait_until(lambda: ids(first, 50) and json.loads(real.read_text())["high_water_ms"] > before, timeout=10)
    assert os.stat(real).st_ino == os.stat(link).st_ino
    assert json.loads(link.read_text())["high_water_ms"] == json.loads(real.read_text())["high_water_ms"]
    assert "has 2 hard links: writing it in place" in first.stderr()


def test_a_state_directory_reached_through_a_symlink_is_one_directory(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A state directory given by two paths (one a symlink to the other): its lock files are the same
    files, so a second daemon with the same worker id is refused, naming the file it could not take."""
    real = tmp_path / "state-dir"
    real.mkdir()
    link = tmp_path / "state-dir-link"
    link.symlink_to(real)
    first = daemons.start("--state-dir", str(real), worker_id=3)
    assert ids(first)
    second = daemons.start("--state-dir", str(link), worker_id=3, wait=False)
    assert second.proc.wait(20) == 1
    line = error_line(second.stderr())
    assert "worker-3.state" in line and f"is in use by pid {first.pid}" in line, line


def test_state_file_lock_and_writes_follow_symlinks(tmp_path: Path) -> None:
    real = tmp_path / "real" / "worker.state"
    real.parent.mkdir()
    link = tmp_path / "worker.state"
    link.symlink_to(real)
    held = StateFile(real)
    held.lock()
    with pytest.raises(StateFileInUse, match=f"state file {link} \\(that is, {real}\\) is in use by pid"):
        StateFile(link).lock()
    held.unlock()
    via_link = StateFile(link)
    via_link.lock()
    via_link.store(FAKE_START_MS, 1)
    assert link.is_symlink() and StateFile(real).load() == FAKE_START_MS  # the link is still a link
    assert sorted(p.name for p in real.parent.iterdir()) == ["worker.state", "worker.state.lock"]
    via_link.unlock()


def test_state_file_with_two_hard_links(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "state"
    StateFile(path).store(FAKE_START_MS, 1)
    other = tmp_path / "other-name"
    os.link(path, other)
    for name in (path, other):
        with pytest.raises(StateFileError, match=f"state file {name} has 2 hard links"):
            StateFile(name).lock()
        assert not StateFile(name).locked
    os.unlink(other)
    held = StateFile(path)
    held.lock()  # one link again: fine
    os.link(path, other)  # linked while held: written in place, the link kept, said once
    held.store(FAKE_START_MS + 10_000, 1)
    held.store(FAKE_START_MS + 20, 1)  # over a line of another length (blank padding, or longer)
    assert os.stat(path).st_ino == os.stat(other).st_ino
    assert StateFile(other).load() == FAKE_START_MS + 20
    assert [r.getMessage() for r in caplog.records].count(
        f"state file {path} has 2 hard links: writing it in place so that its names stay one file. A daemon"
        f" refuses to start on a state file with more than one link; remove the others (find / -xdev -samefile"
        f" {path})"
    ) == 1
    held.unlock()

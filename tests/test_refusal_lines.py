"""Every kind of refusal says why in the log (issue 32): a state file that cannot be written refused
requests for 6 s, and a clock behind for 12 s and 30 s, without a line. Now one WARNING when refusals
of a kind start, then at most one every 10 s while they go on; and no ID is issued twice meanwhile."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import DaemonFactory
from lease_helpers import FAKETIME_LIB, get, wait_until


def _served_and_refused(d: object, seconds: float, keys: int = 5) -> tuple[list[int], list[bytes]]:
    served: list[int] = []
    refused: list[bytes] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reply = get(d, keys)  # type: ignore[arg-type]
        if isinstance(reply, list):
            served += reply
        else:
            refused.append(reply)
        time.sleep(0.01)
    return served, refused


def test_an_unwritable_state_file_is_logged(tmp_path: Path, daemons: DaemonFactory) -> None:
    state = tmp_path / "worker.state"
    d = daemons.start("--state-file", str(state))
    before, _ = _served_and_refused(d, 0.2)
    # The daemon writes a temporary file beside it and renames it over: a directory in its place makes
    # every write fail (EISDIR), for root too.
    blocker = tmp_path / ".worker.state.tmp"
    blocker.mkdir()
    try:
        during, refused = _served_and_refused(d, 4.0)  # the 2 s reserved ahead run out, then refusals
    finally:
        blocker.rmdir()
    after = wait_until(lambda: get(d, 5) if isinstance(get(d, 5), list) else None, timeout=5)
    assert refused and all(r.startswith(b"SERVER_ERROR cannot write state file") for r in refused), refused[:3]
    issued = before + during + after
    assert len(issued) == len(set(issued))
    log = d.stderr()
    lines = [line for line in log.splitlines() if "refusing requests for IDs (state_file)" in line]
    assert len(lines) == 1, log  # once, not once per refused request
    assert "WARNING" in lines[0] and "cannot write state file" in lines[0] and "Is a directory" in lines[0]


@pytest.mark.skipif(not os.path.exists(FAKETIME_LIB), reason="libfaketime is not installed (apt-get install faketime)")
def test_a_clock_behind_is_logged(tmp_path: Path, daemons: DaemonFactory) -> None:
    """The daemon's clock (libfaketime moves its monotonic clock too, as a VM restored from a snapshot
    does) goes back 3 s under load: refused until it passes the last issued millisecond, saying why.
    (Requests of 200 IDs: the rest of the last millisecond's sequence is used up at once; it is issued
    first, which is right.)"""
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    env = {
        "LD_PRELOAD": FAKETIME_LIB,
        "FAKETIME_TIMESTAMP_FILE": str(offset),
        "FAKETIME_CACHE_DURATION": "1",
    }
    d = daemons.start("--no-state-file", env=env)
    before, _ = _served_and_refused(d, 0.5, keys=200)
    offset.write_text("-3\n")
    during, refused = _served_and_refused(d, 5.0, keys=200)
    assert refused and all(r.startswith(b"SERVER_ERROR clock moved backwards") for r in refused), refused[:3]
    assert during, "served again once the clock passed the last issued millisecond"
    issued = before + during
    assert len(issued) == len(set(issued)) and min(during) > max(before)
    log = d.stderr()
    lines = [line for line in log.splitlines() if "refusing requests for IDs (clock_backwards)" in line]
    assert len(lines) == 1, log
    assert "WARNING" in lines[0] and "clock moved backwards by" in lines[0] and "went back" in lines[0]

"""The server benchmark's entry point runs end to end (figures are not asserted: speed is measured in
bench/, never in tests). Needs memcached and a C compiler; .ci/run installs memcached."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not shutil.which("memcached"), reason="memcached is not installed (apt-get install memcached)")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler for bench/loadgen.c")
@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) is missing")
def test_server_bench_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "server_bench.py"), "--quick", "--idle", "20"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for row in (
        "| 1 connection, sequential GET |",
        "| 16 connections, sequential each |",
        "| 4 connections, 16 pipelined each |",
        "| 1 connection, GET of 100 keys |",
        "| unix: 1 connection, sequential GET |",
        "| binary: 1 connection, sequential GET |",
        "| binary: 4 connections, 16 pipelined each |",
        "| binary: 1 connection, GETKQ x 100 + NOOP |",
        "| 20 idle connections: server RSS |",
        "| start-up, exec to first ID served |",
    ):
        assert row in out, out
    assert "found no duplicate" in out

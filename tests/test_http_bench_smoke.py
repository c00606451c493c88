"""The HTTP/gRPC benchmark's entry point runs end to end (figures are not asserted: speed is measured in
bench/, never in tests). Needs wrk and a C compiler; .ci/run installs wrk."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not shutil.which("wrk"), reason="wrk is not installed (apt-get install wrk)")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler for bench/loadgen.c")
@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) is missing")
def test_http_bench_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "http_bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for row in (
        "| HTTP /id, 1 connection |",
        "| HTTP /id, 16 connections |",
        "| HTTP /ids?n=100, 16 connections |",
        "| gRPC Fetch, 16 concurrent calls |",
        "| 1 connection, sequential GET |",
        "| 4 connections, 16 pipelined each |",
    ):
        assert row in out, out
    assert "found no duplicate" in out

"""The gRPC benchmark's entry point runs end to end (figures are not asserted: speed is measured in
bench/, never in tests). Needs h2load (Debian's nghttp2-client) and curl."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.once
@pytest.mark.skipif(not shutil.which("h2load"), reason="h2load is not installed (Debian: nghttp2-client)")
@pytest.mark.skipif(not shutil.which("curl"), reason="curl is not installed")
@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) is missing")
def test_grpc_bench_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "grpc_bench.py"), "--quick", "--only", "1 x 8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "| gRPC Fetch, 1 x 8 | katsubushi-py |" in out, out
    assert "| gRPC FetchMulti n=100, 1 x 8 | katsubushi-py |" in out, out

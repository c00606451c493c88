"""The server benchmark's entry point runs end to end (figures are not asserted: speed is measured in
bench/, never in tests). Needs memcached and a C compiler; .ci/run installs memcached."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not shutil.which("memcached"), reason="memcached is not installed (apt-get install memcached)")
@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler for bench/loadgen.c")
@pytest.mark.skipif(not shutil.which("taskset"), reason="taskset (util-linux) is missing")
def test_server_bench_runs_end_to_end(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "server_bench.py"),
            "--quick",
            "--pure",
            "--idle",
            "20",
            "--json",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for scenario in (
        "1 connection, sequential GET",
        "16 connections, sequential each",
        "4 connections, 16 pipelined each",
        "1 connection, GET of 100 keys",
        "unix: 1 connection, sequential GET",
        "binary: 1 connection, sequential GET",
        "binary: 4 connections, 16 pipelined each",
        "binary: 1 connection, GETKQ x 100 + NOOP",
    ):
        for subject in ("katsubushi-py", "katsubushi-py (python)", "memcached"):
            assert f"| {scenario} | {subject} |" in out, out
    assert "20 idle connections, server RSS:" in out and "Start-up, exec to first ID served:" in out
    assert "found no duplicate" in out
    recorded = json.loads(results.read_text())
    assert recorded["subjects"] == ["katsubushi-py", "katsubushi-py (python)"]
    assert all(len(sc["samples"]["memcached"]) == 1 for sc in recorded["scenarios"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the bench extra) is missing")
def test_chart_is_drawn_from_recorded_results(tmp_path: Path) -> None:
    row = {"rps": 100.0}
    recorded = {
        "machine": "test",
        "runs": 1,
        "seconds": 0.5,
        "subjects": ["katsubushi-py"],
        "scenarios": [{"name": "a", "metric": "rps", "samples": {"katsubushi-py": [row], "memcached": [row]}}],
    }
    (tmp_path / "r.json").write_text(json.dumps(recorded))
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plot_results.py"), str(tmp_path / "r.json"), str(tmp_path / "c.png")],
        check=True,
        timeout=120,
    )
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.once
@pytest.mark.skipif(not shutil.which("memcached"), reason="memcached is not installed (apt-get install memcached)")
@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is missing (the certificates)")
def test_sparse_bench_runs_end_to_end() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sparse_bench.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    for mode in ("plain", "TLS"):
        row = next(line for line in lines if line.startswith(f"| {mode} |"))
        ours, memcached, ratio = (cell.strip() for cell in row.split("|")[2:5])
        assert float(ours) > 0 and float(memcached) > 0 and ratio.endswith("x"), row

"""bench/soak.py, the soak of the real daemon: its checks can fail (growth, order), and a short run of
every kind of client passes with every ID unique. The 60-second run is in .ci/run, the 10-minute one's
figures in docs/guarantees.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"
spec = importlib.util.spec_from_file_location("soak", SOAK)
assert spec is not None and spec.loader is not None
soak = importlib.util.module_from_spec(spec)
sys.modules["soak"] = soak
spec.loader.exec_module(soak)


def test_the_growth_criterion() -> None:
    flat = [100, 120, 110, 115, 118, 119, 117, 116, 120]
    assert soak.growth(flat, 8) == (120, 120, False)
    warming_up_then_flat = [50, 90, 118, 119, 120, 118, 117, 121, 120]
    assert soak.growth(warming_up_then_flat, 8)[2] is False
    leaking = [100, 101, 102, 104, 106, 108, 110, 112, 114]
    assert soak.growth(leaking, 8) == (102, 114, True)


def test_an_id_out_of_order_on_a_connection_is_counted() -> None:
    record = soak.Record()
    conn = record.connection()
    conn.got("text", [5, 6, 7])
    conn.got("text", [8])
    assert record.order_errors == 0
    conn.got("text", [8, 9])
    assert record.order_errors == 1 and "ID 8 after 8" in record.errors[0]
    assert record.total == 6


@pytest.mark.once
def test_a_short_soak_of_every_kind_of_client(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "6", "--connections", "22", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "soak.json").read_text())
    assert summary["failures"] == [] and summary["duplicates"] == 0 and summary["order_errors"] == 0
    assert summary["ids"] > 1000 and summary["unique"] == summary["ids"]
    counts = summary["counts"]
    for what in ("reconnects", "non-reading connections", "half lines abandoned"):
        assert counts.get(what, 0) > 0, counts
    assert any(k.startswith("garbage") for k in counts), counts
    rows = (tmp_path / "soak.csv").read_text().splitlines()
    assert rows[0] == "second,rss_kib,fds,ids,requests" and len(rows) >= 5
    assert (tmp_path / "soak.png").stat().st_size > 1000

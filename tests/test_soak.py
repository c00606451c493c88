"""bench/soak.py, the soak of the real daemon: its checks can fail (growth, order), and a short run of
every kind of client passes with every ID unique. The 60-second run is in .ci/run, the 10-minute one's
figures in docs/guarantees.md. Its warm-up fits a short run (half of it, at most 120 s), so CI's
60-second run judges RSS growth: the judge on synthetic samples, and a short soak of a daemon made to
leak memory and descriptors, fail."""

from __future__ import annotations

import importlib.util
import json
import os
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


def samples(rss: list[int], fds: list[int] | None = None) -> list[tuple[float, int, int, int, int]]:
    """One sample a second: (second, RSS KiB, fds, IDs, requests)."""
    fds = fds or [78] * len(rss)
    return [(float(t), r, f, 0, 0) for t, (r, f) in enumerate(zip(rss, fds, strict=True))]


def test_the_warmup_fits_a_short_run() -> None:
    """CI's 60-second run had a 120 s warm-up: nothing after it, RSS growth never judged."""
    assert soak.warmup_for(60, None) == 30
    assert soak.warmup_for(600, None) == 120
    assert soak.warmup_for(60, 10) == 10


def test_a_60_second_run_judges_growth_and_fails_on_a_leak() -> None:
    """The climb of a healthy daemon as a 60-second run saw it (32 to 71 MiB by 45 s, then down),
    passes; the same with a leak of 2 MiB a second from 30 s on, or descriptors leaking, fails. (A
    60-second run cannot tell a leak of 1 MiB a second from the end of the climb: it passes here.)"""
    mib = 1024
    healthy = [32 * mib + int(39 * mib * min(t, 45) / 45) for t in range(46)] + [59 * mib] * 14
    failures, figures = soak.judge(samples(healthy), 64, soak.warmup_for(60, None))
    assert figures["rss_growth_judged"] is True and figures["rss_samples_judged"] == 30
    assert failures == []
    slow = [r + max(0, t - 30) * mib for t, r in enumerate(healthy)]
    assert soak.judge(samples(slow), 64, 30)[0] == []
    leaking = [r + max(0, t - 30) * 2 * mib for t, r in enumerate(healthy)]
    failures, _ = soak.judge(samples(leaking), 64, soak.warmup_for(60, None))
    assert [f for f in failures if f.startswith("RSS grew after the warm-up")], failures
    fds = [15] + [78] * 29 + [78 + t for t in range(30)]  # one descriptor a second, never closed
    failures, _ = soak.judge(samples([40 * mib] * 60, fds), 64, 30)
    assert failures == ["fds grew: the last third's max 107 > the first third's 78 + 16"]
    # Before: the 120 s warm-up left the same leak unjudged.
    failures, figures = soak.judge(samples(leaking), 64, 120)
    assert failures == [] and figures["rss_growth_judged"] is False


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


# A daemon made to leak: sitecustomize (imported by every Python started with this directory on its
# path) starts a thread in the daemon's process alone that keeps 3 MiB more every second and opens a
# descriptor every 0.3 s, never closed.
LEAK = """
import os, sys, threading, time

if "katsubushi" in " ".join(sys.argv) and "soak.py" not in " ".join(sys.argv):
    kept = []

    def leak():
        while True:
            kept.append(b"x" * (8 << 20))
            for _ in range(3):
                kept.append(os.open("/dev/null", os.O_RDONLY))
                time.sleep(0.33)

    threading.Thread(target=leak, daemon=True).start()
"""


@pytest.mark.once
def test_a_short_soak_of_a_leaking_daemon_fails(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(LEAK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(SOAK), "--seconds", "14", "--connections", "4", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "out" / "soak.json").read_text())
    assert summary["rss_growth_judged"] is True and summary["duplicates"] == 0
    grew = [f.split(":")[0] for f in summary["failures"]]
    assert "RSS grew after the warm-up" in grew and "fds grew" in grew, summary["failures"]

"""Draws the README's performance chart from what bench/server_bench.py measured.

    pip install -e '.[bench]'
    python bench/server_bench.py --pure --json bench/results.json   # measure (about 10 minutes)
    python bench/plot_results.py bench/results.json docs/performance.png

One horizontal bar per scenario and katsubushi-py subject: its throughput as a ratio to memcached's in
the same run (1.0 = as fast as memcached), so the picture is regenerated from the figures, never drawn
by hand.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path


def ratios(results: dict) -> tuple[list[str], dict[str, list[float]]]:
    """Scenario names, and per subject its median throughput over memcached's, scenario by scenario
    (NaN where the subject sat the scenario out)."""
    names = [sc["name"] for sc in results["scenarios"]]
    out: dict[str, list[float]] = {subject: [] for subject in results["subjects"]}
    for sc in results["scenarios"]:
        samples, metric = sc["samples"], sc["metric"]
        memcached = statistics.median(row[metric] for row in samples["memcached"])
        for subject in results["subjects"]:
            rows = samples.get(subject)  # an older checkout sits out what it cannot serve
            out[subject].append(statistics.median(row[metric] for row in rows) / memcached if rows else math.nan)
    return names, out


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: plot_results.py RESULTS.json OUT.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(Path(sys.argv[1]).read_text())
    names, by_subject = ratios(results)
    height = 0.8 / len(by_subject)
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.45 * len(names) * max(1, len(by_subject) * 0.6)))
    for i, (subject, values) in enumerate(by_subject.items()):
        positions = [n + i * height for n in range(len(names))]
        bars = ax.barh(positions, [0.0 if math.isnan(v) else v for v in values], height=height, label=subject)
        labels = ["not measured" if math.isnan(v) else f"{v:.2f}x" for v in values]
        ax.bar_label(bars, labels=labels, padding=3, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks([n + height * (len(by_subject) - 1) / 2 for n in range(len(names))], names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("throughput relative to memcached in the same run (memcached = 1.0, dashed)")
    ax.set_title(f"katsubushi-py beside memcached ({results['runs']} alternating runs, medians)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.text(0.01, 0.005, results["machine"], fontsize=6, color="grey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]}")


if __name__ == "__main__":
    main()

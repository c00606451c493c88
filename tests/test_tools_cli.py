"""The ID tools through the real console entry point, as a user runs them."""

import itertools
import json
import subprocess
import sys

import pytest

from katsubushi_py.ids.layout import DEFAULT_LAYOUT


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "katsubushi_py", *args], input=stdin, capture_output=True, text=True, timeout=30
    )


def test_decode_prints_katsubushi_dump_json() -> None:
    result = run("decode", "189608758458974208", "1574003989400260608")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == '{"id":"189608758458974208","time":"2016-06-07T05:17:30.777Z","worker_id":0,"sequence":0}'
    assert json.loads(lines[1]) == {
        "id": "1574003989400260608",
        "time": "2026-11-22T10:09:54.653Z",
        "worker_id": 1,
        "sequence": 0,
    }


def test_decode_reads_stdin_and_reports_bad_ids_but_prints_the_good() -> None:
    result = run("decode", stdin="189608758458974208\nnot-an-id\n\n9223372036854775808\n1574003989400260608\n")
    assert result.returncode == 2
    assert [json.loads(x)["id"] for x in result.stdout.splitlines()] == ["189608758458974208", "1574003989400260608"]
    errors = result.stderr.splitlines()
    assert len(errors) == 2 and "not-an-id" in errors[0] and "9223372036854775808" in errors[1]
    assert "Traceback" not in result.stderr


def test_decode_other_encodings_and_layouts() -> None:
    result = run("decode", "--encoding", "hex", "02a1a02946400000")
    assert json.loads(result.stdout)["time"] == "2016-06-07T05:17:30.777Z"
    custom = run("decode", "--worker-bits", "6", "--sequence-bits", "16", str((5 << 22) | (3 << 16) | 7))
    assert json.loads(custom.stdout)["worker_id"] == 3 and json.loads(custom.stdout)["sequence"] == 7


@pytest.mark.parametrize(
    ("when", "expected"),
    [
        ("1465276650.777", 189608758458974208),
        ("1465276650", 189608755200000000),
        ("2016-06-07T05:17:30.777Z", 189608758458974208),
        ("2016-06-07T14:17:30.777+09:00", 189608758458974208),
    ],
)
def test_id_at(when: str, expected: int) -> None:
    result = run("id-at", when)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == expected


def test_id_at_honours_the_epoch_option() -> None:
    result = run("id-at", "--epoch", "2020-01-01T00:00:00Z", "2020-01-01T00:00:01Z")
    assert int(result.stdout) == 1000 << 22


@pytest.mark.parametrize("when", ["yesterday", "2014-01-01", "2090-01-01"])
def test_id_at_bad_time(when: str) -> None:
    result = run("id-at", when)
    assert result.returncode == 2
    assert result.stderr.startswith("katsubushi-py: error: ") and len(result.stderr.splitlines()) == 1


def test_partitions() -> None:
    result = run("partitions", "--start", "2026-01-01", "--days", "7")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "PARTITION BY RANGE COLUMNS(id) ("
    assert lines[-1] == ");"
    assert lines[-2] == "  PARTITION pmax VALUES LESS THAN (MAXVALUE)"
    parts = lines[1:-2]
    assert len(parts) == 7
    assert parts[0].startswith("  PARTITION p20260101 VALUES LESS THAN (")
    assert parts[6].startswith("  PARTITION p20260107 ")
    bounds = [int(p.split("(")[1].split(")")[0]) for p in parts]
    assert bounds[0] == DEFAULT_LAYOUT.id_at(1767312000)  # 2026-01-02T00:00:00Z
    assert all(b - a == 86_400_000 << 22 for a, b in itertools.pairwise(bounds))


def test_partitions_bad_input() -> None:
    assert run("partitions", "--start", "2026-01-01", "--days", "0").returncode == 2
    assert run("partitions", "--start", "soon").returncode == 2
    result = run("partitions", "--days", "3")
    assert result.returncode == 2 and "--start" in result.stderr


def test_version() -> None:
    from katsubushi_py import __version__

    assert run("--version").stdout.strip() == f"katsubushi-py version: {__version__}"
    assert run("-version").stdout.strip() == f"katsubushi-py version: {__version__}"

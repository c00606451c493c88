"""What the README and docs tell a newcomer, held to what is true (issue 25): commands that work when
pasted, one unix socket path, figures that say which measurement they quote and match
bench/RESULTS.md, claims about the tools and encodings that hold, a changelog that agrees with the
package metadata, and no profiler dump in the repository."""

from __future__ import annotations

import json
import marshal
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import katsubushi_py
from katsubushi_py.daemon import workers

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "bench" / "RESULTS.md"


def flat(path: Path) -> str:
    """The text with every run of whitespace as one space (sentences wrap anywhere)."""
    return " ".join(path.read_text().split())


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "katsubushi_py", *args], capture_output=True, text=True, timeout=30, input=stdin
    )


# -- commands as written ---------------------------------------------------------------------------
def test_the_readmes_wheel_command_expands_to_the_wheel_with_its_extra(tmp_path: Path) -> None:
    """The command is run by a real shell, with ``pip`` a function that prints what pip would get: one
    existing wheel file followed by ``[grpc]`` (a quoted glob reached pip as the literal ``*``)."""
    command = re.search(r"the `grpc` extra adds the gRPC front end \(`([^`]+)`", flat(README))
    assert command is not None
    (tmp_path / "dist").mkdir()
    wheel = "katsubushi_py-1.0.0-cp311-cp311-linux_x86_64.whl"
    (tmp_path / "dist" / wheel).write_bytes(b"")
    script = f"pip() {{ printf '%s\\n' \"$@\"; }}\n{command.group(1)}\n"
    result = subprocess.run(["sh", "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=30)
    assert result.stdout.splitlines() == ["install", f"dist/{wheel}[grpc]"], result.stdout + result.stderr


def nc_commands() -> list[tuple[str, str]]:
    found = []
    for path in [README, *DOCS]:
        for line in path.read_text().splitlines():
            if re.search(r"\|\s*nc\b", line):
                found.append((path.name, line))
    return found


def test_every_nc_example_returns() -> None:
    """``printf ... | nc HOST PORT`` waits for ever after its input ends: every example says -q1."""
    commands = nc_commands()
    assert len(commands) >= 3, commands  # the README's quick start, the meta example, systemd's
    for name, line in commands:
        assert re.search(r"\|\s*nc -q1 ", line), f"{name}: {line}"


def test_one_unix_socket_path_in_the_docs() -> None:
    """The path the systemd socket unit uses, everywhere an example names one under /run."""
    unit = (ROOT / "contrib" / "katsubushi-py.socket").read_text()
    assert "ListenStream=/run/katsubushi-py.sock" in unit
    paths = {m for path in [README, *DOCS] for m in re.findall(r"/run/[\w.-]+\.sock", path.read_text())}
    assert paths == {"/run/katsubushi-py.sock"}


# -- claims ----------------------------------------------------------------------------------------
def test_the_commands_said_to_take_the_layout_options_do() -> None:
    sentence = re.search(r"shows one's options\. (.+?) take the layout options", flat(README))
    assert sentence is not None
    named = re.findall(r"`([\w-]+)`", sentence.group(1))
    assert set(named) == {"decode", "id-at", "partitions", "health"}
    layout = ["--epoch", "2020-01-01T00:00:00Z", "--worker-bits", "6", "--sequence-bits", "16"]
    assert run("decode", *layout, str((5 << 22) | (3 << 16) | 7)).returncode == 0
    assert run("id-at", *layout, "2020-01-01T00:00:01Z").stdout.strip() == str(1000 << 22)
    assert run("partitions", *layout, "--start", "2026-01-01", "--days", "1").returncode == 0
    health = run("health", *layout, "--port", "1", "--timeout", "0.2s")  # parsed, then unhealthy: no daemon
    assert health.returncode == 1 and "Connection refused" in health.stderr
    # ... and the ones said to have no use for them refuse them, as the README says.
    unused = re.search(r"`get` and `lease` have no use for them", flat(README))
    assert unused is not None
    for command in (["get"], ["lease", "stats"]):
        result = run(*command, "--epoch", "2020-01-01T00:00:00Z")
        assert result.returncode == 2 and "unrecognized arguments: --epoch" in result.stderr


def test_the_encodings_read_what_the_readme_says_they_read() -> None:
    text = flat(README)
    assert "hex of 1 to 16 digits in either case, with or without `0x` (`15DB`, `0x15db`)" in text
    result = run("decode", "--encoding", "hex", "15DB", "0x15db", "0X15Db")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["5595"] * 3
    for bad in ("1" * 17, "0x", "15DG", "-15db"):
        assert run("decode", "--encoding", "hex", bad).returncode == 2, bad
    assert "base32 as Crockford specifies it (any case, `I` and `L` read as 1, `O` as 0, hyphens ignored)" in text
    lenient = run("decode", "--encoding", "base32", "1-o", "10")
    assert [json.loads(line)["id"] for line in lenient.stdout.splitlines()] == ["32", "32"]


def results_row(scenario: str, server: str) -> list[str]:
    """The cells of a row of bench/RESULTS.md's main-run table."""
    for line in RESULTS.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 4 and cells[0] == scenario and cells[1] == server:
            return cells
    raise AssertionError(f"no row {scenario!r} / {server!r} in {RESULTS}")


def thousands(cell: str) -> int:
    return int(cell.split()[0].replace(",", ""))


def test_one_process_throughput_is_quoted_alike_and_from_the_results() -> None:
    """README said about 80k, docs/operations.md more than 100,000: both now quote the main run."""
    tcp = thousands(results_row("16 connections, sequential each", "katsubushi-py")[2])
    unix = thousands(results_row("unix: 16 connections, sequential each", "katsubushi-py")[2])
    claim = re.compile(
        r"one process already serves ([\d,]+) requests/s one key at a time over TCP and ([\d,]+) over a unix"
        r" socket \(16 connections, bench/RESULTS\.md's main run\)"
    )
    for path in (README, ROOT / "docs" / "operations.md"):
        found = claim.search(flat(path).replace("One process", "one process"))
        assert found is not None, path.name
        quoted = [int(n.replace(",", "")) for n in found.groups()]
        assert quoted == [round(tcp, -3), round(unix, -3)], (path.name, quoted, tcp, unix)
    assert "100,000 requests" not in flat(ROOT / "docs" / "operations.md") and "80k" not in flat(README)


def test_the_round_trip_figure_says_which_measurement_it_is() -> None:
    """The C load generator's median and a Python client's time per call are different figures: the
    README quotes both, each with its measurement, as bench/RESULTS.md has them."""
    p50 = int(results_row("1 connection, sequential GET", "katsubushi-py")[4].split("/")[0])
    client = next(line for line in RESULTS.read_text().splitlines() if line.startswith("| pymemcache get, 1 ID |"))
    per_call = round(float(client.split("|")[2]))
    sentence = (
        f"cost a loopback round trip of {p50} us (the median with one connection over TCP, measured with the"
        f" benchmark's C load generator; from Python, pymemcache's `get` takes {per_call} us a call"
    )
    assert sentence in flat(README)


def test_the_supervisors_restart_pauses_are_as_documented() -> None:
    text = flat(ROOT / "docs" / "operations.md")
    expected = (
        f"at once if it had run for {workers._QUICK_DEATH_S:g} s or more; one that dies sooner is restarted after"
        f" {workers._FIRST_PAUSE_S:g} s, then 1, 2, 4 s and so on up to {workers._MAX_PAUSE_S:g} s"
    )
    assert expected in text
    assert "at once the first time" not in text


# -- release metadata and repository hygiene -------------------------------------------------------
def test_the_changelog_agrees_with_the_development_status() -> None:
    """A package that says Production/Stable is released: its changelog entry has a date."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    heading = re.search(rf"^## {re.escape(katsubushi_py.__version__)}(.*)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert heading is not None
    stable = "Development Status :: 5 - Production/Stable" in pyproject
    dated = re.fullmatch(r" \(\d{4}-\d\d-\d\d\)", heading.group(1)) is not None
    assert "unreleased" not in heading.group(1).lower() or not stable
    assert dated or not stable, heading.group(0)


def test_no_profiler_dump_is_tracked_and_such_files_are_ignored() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
    ).stdout.split(b"\0")
    dumps = [name for name in tracked if re.search(rb"(^|/)p\.out$|\.(prof|pstats|out)$", name)]
    assert dumps == []
    for name in filter(None, tracked):  # whatever it is called: cProfile writes a marshalled dict
        data = (ROOT / os.fsdecode(name)).read_bytes()
        if data[:1] not in (b"{", b"\xfb"):  # marshal's dict type code (with or without its ref flag)
            continue
        try:
            loaded = marshal.loads(data)
        except (EOFError, ValueError, TypeError):
            continue
        assert not (isinstance(loaded, dict) and loaded), f"{name.decode()} is a profiler dump"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "p.out", "profile.prof", "run.pstats"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ignored.stdout.split() == ["p.out", "profile.prof", "run.pstats"]


# -- the Deploy section ----------------------------------------------------------------------------
def readme_section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    found = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_the_deploy_section_links_what_exists() -> None:
    section = readme_section("Deploy")
    for needed in (
        "deploy/kubernetes/statefulset.yaml",
        "deploy/kubernetes/redis-leasing.yaml",
        "contrib/prometheus/katsubushi-alerts.yaml",
        "contrib/prometheus/katsubushi-alerts.test.yaml",
        "contrib/grafana/katsubushi-dashboard.json",
        "docker build -t katsubushi-py:1.0.0 -t katsubushi-py .",
    ):
        assert needed in section, needed
    for path in re.findall(r"\b((?:deploy|contrib)/[\w./-]+\.\w+)", section):
        assert (ROOT / path).is_file(), path
    for target in re.findall(r"\]\(([^)]+)\)", section):
        file, _, anchor = target.partition("#")
        assert (ROOT / file).is_file(), target
        if anchor:
            assert anchor in anchors(ROOT / file), target


def test_the_dashboard_import_command_posts_the_dashboard(tmp_path: Path) -> None:
    """The README's curl line, run by a shell with ``curl`` a function that prints its -d argument:
    Grafana's import API gets {"dashboard": <the JSON file>, "overwrite": true}."""
    [command] = [line for line in readme_section("Deploy").splitlines() if "api/dashboards/db" in line]
    command = command.split("`", 2)[1]
    script = 'curl() { while [ $# -gt 0 ]; do [ "$1" = -d ] && printf "%s" "$2"; shift; done; }\n' + command + "\n"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=30)
    body = json.loads(result.stdout)
    dashboard = json.loads((ROOT / "contrib" / "grafana" / "katsubushi-dashboard.json").read_text())
    assert body == {"dashboard": dashboard, "overwrite": True}

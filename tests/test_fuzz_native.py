"""fuzz/run.py --native: the compiled modules rebuilt by clang with libFuzzer's coverage instrumentation
(scripts/native-fuzz-build.sh) and clang's libFuzzer preloaded, so that the C code's edges guide the
fuzzer. The run must use the instrumented build, and libFuzzer must count more edges than on the normal
build (where only the Python code is instrumented) from the same seeds."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Not marked "once": the first pass of .ci/run has no atheris (the test extra), the pure pass has.
pytestmark = [
    pytest.mark.skipif(shutil.which("clang") is None, reason="clang is not installed (apt-get install clang)"),
    pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed (the fuzz extra)"),
]


def fuzz(tmp_path: Path, name: str, *flags: str) -> tuple[str, dict[str, object]]:
    out = tmp_path / f"{name}.json"
    command = [sys.executable, str(ROOT / "fuzz" / "run.py"), "--target", "binary", "--seconds", "3"]
    proc = subprocess.run(
        [*command, "--json", str(out), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())["results"][0]


def test_native_fuzzing_counts_the_c_codes_edges(tmp_path: Path) -> None:
    normal_out, normal = fuzz(tmp_path, "normal")
    native_out, native = fuzz(tmp_path, "native", "--native")
    assert "katsubushi-fuzz-native-" in native_out.splitlines()[0], native_out  # the instrumented build
    assert "katsubushi-fuzz-native-" not in normal_out.splitlines()[0], normal_out
    assert isinstance(native["coverage"], int) and isinstance(normal["coverage"], int)
    # The binary parser's C code adds a few hundred edges to what the Python code's instrumentation sees.
    assert native["coverage"] > normal["coverage"] + 50, (normal, native)

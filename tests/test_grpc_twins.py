"""The compiled gRPC core (_grpc_speedups.GrpcCore) against its pure-Python twin (PyGrpcCore): the
same conversations (tests/grpc_harness.py), byte for byte, in two processes (the core is chosen at
import time). Skipped where the compiled core is not built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from katsubushi_py.frontends import grpc_fast

HERE = Path(__file__).resolve().parent
SEEDS = [str(seed) for seed in range(12)]


def run(pure: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    env.pop("KATSUBUSHI_NO_EXTENSIONS", None)
    if pure:
        env["KATSUBUSHI_NO_EXTENSIONS"] = "1"
    result = subprocess.run(
        [sys.executable, str(HERE / "grpc_harness.py"), *SEEDS], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.skipif(not grpc_fast.COMPILED, reason="the compiled gRPC core is not built here (or is switched off)")
def test_the_compiled_core_answers_byte_for_byte_as_the_pure_one() -> None:
    compiled, pure = run(pure=False), run(pure=True)
    assert (compiled["core"], pure["core"]) == ("compiled", "python")
    for seed, (mine, theirs) in enumerate(zip(compiled["conversations"], pure["conversations"], strict=True)):
        assert len(mine) == len(theirs), seed
        for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            assert a == b, f"seed {seed}, step {step}"

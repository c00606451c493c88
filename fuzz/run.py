"""Run the fuzz targets of fuzz/targets.py under atheris (coverage-guided, libFuzzer).

    python fuzz/run.py --target text --minutes 10       # one target, a long run
    python fuzz/run.py --all --seconds 40 --sanitized   # every target, the short run of .ci/run

Each target starts from its seed corpus (fuzz/corpus/<target>/, valid requests) and keeps what it
learns in a scratch directory (``--keep DIR`` to keep it); an input that fails is written to
fuzz/findings/<target>/ (which tests/test_fuzz_regressions.py replays in the normal suite) and fails
the run. With ``--sanitized`` the compiled modules are the ones scripts/sanitize-build.sh builds with
AddressSanitizer and UndefinedBehaviorSanitizer, loaded with libasan preloaded: a sanitizer report
fails the run too.

Coverage: atheris instruments the Python code (the pure twins, the glue and tests/twins.py); the C
cores are compiled by gcc without libFuzzer's instrumentation, so they are fuzzed by the inputs the
Python coverage finds (their twins take the same branches), checked against their twin on every
input, and under the sanitizers when ``--sanitized``.

Prints one line per target: executions, seconds, executions per second, corpus size, and FAILED with
the finding's file when there is one; ``--json FILE`` writes the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_NAMES = ["text", "binary", "http", "ids", "grpc", "transport"]


def child(target: str, libfuzzer_args: list[str]) -> None:
    """In the fuzzing process: instrument our code, then hand the target to atheris."""
    import atheris

    sys.path.insert(0, str(HERE))
    with atheris.instrument_imports(include=["katsubushi_py", "twins", "targets", "transport_target"]):
        import targets

        if target == "transport":
            import transport_target

            targets.TARGETS["transport"] = transport_target.transport
    function = targets.TARGETS[target]
    atheris.Setup([sys.argv[0], *libfuzzer_args], function)
    atheris.Fuzz()


def sanitized_env(build: Path) -> dict[str, str]:
    libasan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True)
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=libasan.stdout.strip(),
        PYTHONMALLOC="malloc",
        ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1:handle_segv=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(build), env.get("PYTHONPATH", "")])),
    )
    env.pop("KATSUBUSHI_NO_EXTENSIONS", None)
    return env


def run_target(target: str, seconds: int, env: dict[str, str], keep: Path | None, cwd: Path) -> dict[str, object]:
    seeds = HERE / "corpus" / target
    findings = HERE / "findings" / target
    findings.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-")) if keep is None else keep / target
    scratch.mkdir(parents=True, exist_ok=True)
    args = [
        f"-max_total_time={seconds}",
        "-timeout=20",
        "-rss_limit_mb=4096",
        "-max_len=8192",
        "-print_final_stats=1",
        f"-artifact_prefix={findings}/",
        str(scratch),
        str(seeds),
    ]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(HERE / "run.py"), "--child", target, "--", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        errors="replace",
    )
    elapsed = time.monotonic() - started
    log = proc.stderr
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log) or re.search(r"Done (\d+) runs", log)
    artifact = re.search(r"Test unit written to (\S+)", log)
    result: dict[str, object] = {
        "target": target,
        "executions": int(runs.group(1)) if runs else None,
        "seconds": round(elapsed, 1),
        "corpus": len(list(scratch.iterdir())),
        "returncode": proc.returncode,
        "finding": artifact.group(1) if artifact else None,
    }
    if keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        tail = log[-6000:]
        result["log"] = tail
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--target", action="append", choices=TARGET_NAMES, help="a target (repeatable)")
    parser.add_argument("--all", action="store_true", help="every target")
    parser.add_argument("--minutes", type=float, default=0, help="how long each target runs")
    parser.add_argument("--seconds", type=int, default=60, help="how long each target runs (without --minutes)")
    parser.add_argument("--sanitized", action="store_true", help="on the ASan/UBSan build of the compiled modules")
    parser.add_argument("--keep", type=Path, help="keep each target's learnt corpus under this directory")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, [a for a in rest if a != "--"])
        return 0
    targets = TARGET_NAMES if args.all else args.target
    if not targets:
        parser.error("--target or --all")
    seconds = int(args.minutes * 60) if args.minutes else args.seconds
    env = dict(os.environ)
    cwd = ROOT
    build_dir = None
    if args.sanitized:
        build_dir = Path(tempfile.mkdtemp(prefix="katsubushi-fuzz-sanitized-"))
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "sanitize-build.sh"), str(build_dir)],
            env={**os.environ, "PYTHON": sys.executable},
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(out.stdout + out.stderr, file=sys.stderr)
            return 1
        env = sanitized_env(build_dir / "pkg")
        cwd = build_dir / "pkg"  # so that nothing finds the worktree's unsanitized package first
    check = subprocess.run(
        [sys.executable, "-c", "import katsubushi_py.compiled as c; print(c.IMPLEMENTATION, c.__file__)"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    print(f"fuzzing on: {check.stdout.strip() or check.stderr.strip()}", flush=True)
    results = []
    failed = False
    for target in targets:
        result = run_target(target, seconds, env, args.keep, cwd)
        results.append(result)
        execs = result["executions"]
        rate = f"{execs / max(float(result['seconds']), 1e-9):.0f}/s" if execs else "?"
        line = f"{target:10} {execs} executions in {result['seconds']} s ({rate}), corpus {result['corpus']}"
        if result["returncode"] != 0:
            failed = True
            line += f"  FAILED (exit {result['returncode']}) {result['finding'] or ''}"
        print(line, flush=True)
        if result.get("log"):
            print(result["log"], file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"sanitized": args.sanitized, "results": results}, indent=1) + "\n")
    if build_dir is not None:
        shutil.rmtree(build_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

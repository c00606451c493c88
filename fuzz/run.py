"""Run the fuzz targets of fuzz/targets.py under atheris (coverage-guided, libFuzzer).

    python fuzz/run.py --target text --minutes 10       # one target, a long run
    python fuzz/run.py --all --seconds 40 --sanitized   # every target, the short run of .ci/run
    python fuzz/run.py --all --minutes 5 --native       # guided by the C code's coverage too (clang)

Each target starts from its seed corpus (fuzz/corpus/<target>/, valid requests) and keeps what it
learns in a scratch directory (``--keep DIR`` to keep it); an input that fails is written to
fuzz/findings/<target>/ (which tests/test_fuzz_regressions.py replays in the normal suite) and fails
the run. With ``--sanitized``, every input the run kept, every seed and every finding is then
replayed (without atheris) on the build of scripts/sanitize-build.sh, both compiled modules with
AddressSanitizer and UndefinedBehaviorSanitizer, libasan preloaded: a sanitizer report fails the run
too. (Fuzzing itself under libasan would run blind: atheris's libFuzzer and gcc's libasan define the
same coverage hooks, and with libasan preloaded libFuzzer sees no coverage.)

Coverage: atheris instruments the Python code (the pure twins, the glue and tests/twins.py). On the
normal build the C cores (compiled by gcc without libFuzzer's instrumentation) are fuzzed by the inputs
the Python coverage finds (their twins take the same branches) and checked against their twin on every
input. With ``--native`` the compiled modules are rebuilt by clang with ``-fsanitize=fuzzer-no-link``
(scripts/native-fuzz-build.sh), and clang's libFuzzer, built as a shared library, is LD_PRELOADed into
the fuzzing process: atheris uses it instead of its own, and the modules' coverage hooks resolve to it,
so that the C code's edge counters and comparisons guide the fuzzer as well (libFuzzer's ``cov:``
figure then counts the C code's edges too). ``--native`` and ``--sanitized`` combine: fuzzed on the
instrumented build, replayed on the sanitized one.

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
        import transport_target  # noqa: F401  (instrumented now; targets.transport imports it)

    function = targets.TARGETS[target]
    atheris.Setup([sys.argv[0], *libfuzzer_args], function)
    atheris.Fuzz()


def replay(target: str, directories: list[str]) -> None:
    """In the replaying process (no atheris): every input of the directories through the target."""
    sys.path.insert(0, str(HERE))
    import targets

    function = targets.TARGETS[target]
    count = 0
    for directory in map(Path, directories):
        for path in sorted(directory.iterdir()) if directory.is_dir() else []:
            try:
                function(path.read_bytes())
            except BaseException:
                print(f"FAILED on {path}", file=sys.stderr, flush=True)
                raise
            count += 1
    from katsubushi_py import compiled

    where = Path(compiled.speedups.__file__).parent if compiled.speedups else compiled.WHY_NOT_COMPILED
    print(f"replayed {count} inputs (compiled modules from {where})", flush=True)


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
    coverage = re.findall(r" cov: (\d+)", log)
    artifact = re.search(r"Test unit written to (\S+)", log)
    result: dict[str, object] = {
        "target": target,
        "executions": int(runs.group(1)) if runs else None,
        "seconds": round(elapsed, 1),
        "corpus": len(list(scratch.iterdir())),
        "coverage": int(coverage[-1]) if coverage else None,  # libFuzzer's cov: edges (Python + C with --native)
        "returncode": proc.returncode,
        "finding": artifact.group(1) if artifact else None,
    }
    if keep is None:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        tail = log[-6000:]
        result["log"] = tail
    return result


def build_copy(script: str, kind: str) -> Path | None:
    """A copy of the package with its compiled modules built by scripts/``script`` in a temporary
    directory (None, having said why, when the build failed)."""
    build = Path(tempfile.mkdtemp(prefix=f"katsubushi-fuzz-{kind}-"))
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / script), str(build)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        print(out.stdout + out.stderr, file=sys.stderr)
        shutil.rmtree(build, ignore_errors=True)
        return None
    return build


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help=argparse.SUPPRESS)
    parser.add_argument("--target", action="append", choices=TARGET_NAMES, help="a target (repeatable)")
    parser.add_argument("--all", action="store_true", help="every target")
    parser.add_argument("--minutes", type=float, default=0, help="how long each target runs")
    parser.add_argument("--seconds", type=int, default=60, help="how long each target runs (without --minutes)")
    parser.add_argument("--sanitized", action="store_true", help="on the ASan/UBSan build of the compiled modules")
    parser.add_argument(
        "--native", action="store_true", help="guided by the C code's coverage too (clang-instrumented build)"
    )
    parser.add_argument("--keep", type=Path, help="keep each target's learnt corpus under this directory")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child, [a for a in rest if a != "--"])
        return 0
    if args.replay:
        replay(args.replay, [a for a in rest if a != "--"])
        return 0
    targets = TARGET_NAMES if args.all else args.target
    if not targets:
        parser.error("--target or --all")
    seconds = int(args.minutes * 60) if args.minutes else args.seconds
    keep = args.keep
    sanitized_build = native_build = None
    if args.sanitized:
        # atheris's libFuzzer takes its coverage from the same hooks gcc's libasan defines: with libasan
        # preloaded the fuzzer runs blind. So the coverage-guided run is on the normal (or the native)
        # build, and every input it kept (and every seed and finding) is then replayed on the sanitized one.
        sanitized_build = build_copy("sanitize-build.sh", "sanitized")
        if sanitized_build is None:
            return 1
        keep = keep or sanitized_build / "corpus"
    env, cwd = dict(os.environ), ROOT
    if args.native:
        native_build = build_copy("native-fuzz-build.sh", "native")
        if native_build is None:
            return 1
        cwd = native_build / "pkg"  # so that nothing finds the worktree's uninstrumented package first
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH", "")]))
        env["LD_PRELOAD"] = str(native_build / "libfuzzer.so")
        env.pop("KATSUBUSHI_NO_EXTENSIONS", None)
    where = "import katsubushi_py.compiled as c; print(c.IMPLEMENTATION, c.speedups and c.speedups.__file__)"
    check = subprocess.run([sys.executable, "-c", where], cwd=cwd, env=env, capture_output=True, text=True)
    print(f"fuzzing on: {check.stdout.strip() or check.stderr.strip()}", flush=True)
    results = []
    failed = False
    for target in targets:
        result = run_target(target, seconds, env, keep, cwd)
        results.append(result)
        execs = result["executions"]
        rate = f"{execs / max(float(result['seconds']), 1e-9):.0f}/s" if execs else "?"
        line = f"{target:10} {execs} executions in {result['seconds']} s ({rate}), corpus {result['corpus']}"
        line += f", coverage {result['coverage']}"
        if result["returncode"] != 0:
            failed = True
            line += f"  FAILED (exit {result['returncode']}) {result['finding'] or ''}"
        print(line, flush=True)
        if result.get("log"):
            print(result["log"], file=sys.stderr, flush=True)
        if sanitized_build is not None and keep is not None:
            dirs = [keep / target, HERE / "corpus" / target, HERE / "findings" / target]
            started = time.monotonic()
            proc = subprocess.run(
                [sys.executable, str(HERE / "run.py"), "--replay", target, "--", *map(str, dirs)],
                env=sanitized_env(sanitized_build / "pkg"),
                cwd=sanitized_build / "pkg",  # so that nothing finds the worktree's unsanitized package first
                capture_output=True,
                text=True,
                errors="replace",
            )
            result["sanitized_replay"] = proc.stdout.strip()
            result["sanitized_returncode"] = proc.returncode
            line = f"{target:10} on the ASan/UBSan build: {proc.stdout.strip()} in {time.monotonic() - started:.1f} s"
            if proc.returncode != 0:
                failed = True
                line += f"  FAILED (exit {proc.returncode})"
            print(line, flush=True)
            if proc.returncode != 0:
                print(proc.stderr[-8000:], file=sys.stderr, flush=True)
    if args.json:
        figures = {"sanitized": args.sanitized, "native": args.native, "results": results}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    for build in (sanitized_build, native_build):
        if build is not None:
            shutil.rmtree(build, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

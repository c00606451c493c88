#!/usr/bin/env bash
# Builds both compiled modules (_speedups, _grpc_speedups) with gcc's AddressSanitizer and
# UndefinedBehaviorSanitizer into a copy of the package in a temporary directory (never into the
# worktree: a normal run must not load a sanitized module), and runs the protocol, transport, split
# and twin tests against that copy under LD_PRELOAD of libasan. Any sanitizer report (in pytest or in
# a daemon it starts) fails the run, as does a failed test.
#
#   scripts/sanitize.sh                      # the default test files
#   scripts/sanitize.sh tests/test_splits.py # chosen ones (any pytest arguments)
#   SANITIZE_KEEP=1 scripts/sanitize.sh      # keep the build (its path is printed) for fuzz/run.py --sanitized
#
# Python: $PYTHON, else the python3 on PATH (the project and its test extra installed in it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python=${PYTHON:-python3}

work=${SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/katsubushi-sanitize.XXXXXX")}
if [ -z "${SANITIZE_KEEP:-}" ] && [ -z "${SANITIZE_DIR:-}" ]; then
  trap 'rm -rf "$work"' EXIT
fi
"$(dirname "$0")/sanitize-build.sh" "$work" >/dev/null

pytest_bin=$(dirname "$(command -v "$python")")/pytest
[ -x "$pytest_bin" ] || pytest_bin=pytest
if [ $# -eq 0 ]; then
  set -- tests/test_splits.py tests/test_speedups.py tests/test_text_protocol.py tests/test_binary_protocol.py \
    tests/test_meta.py tests/test_http_protocol.py tests/test_socket_transport.py tests/test_tls_transport.py \
    tests/test_tls_direct.py tests/test_generator_roll.py \
    tests/test_grpc_twins.py \
    tests/test_grpc_h2.py tests/test_fuzz_regressions.py -q -p no:cacheprovider \
    -k "not flood_of_settings_and_resets"
  # (that test counts on 1,200 frames being parsed before the flood budget, refilled by the real
  # clock, grows back: under the sanitizers they are not)
fi

mkdir -p "$work/reports"
rm -f "$work"/reports/*
# detect_leaks=0: CPython keeps its interned and cached objects to the end. log_path: reports of the
# processes the tests start land there too.
libasan=$(gcc -print-file-name=libasan.so)
[ -e "$libasan" ] || { echo "gcc has no libasan.so here (Debian: libgcc-12-dev brings it)" >&2; exit 1; }
export LD_PRELOAD="$libasan"
export PYTHONMALLOC=malloc
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1:log_path=$work/reports/asan"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$work/reports/ubsan"
export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
unset KATSUBUSHI_NO_EXTENSIONS
cd "$work/pkg"  # python -m in the tests' subprocesses finds the sanitized copy first too
"$python" -c 'import katsubushi_py, katsubushi_py.compiled as c, sys
assert katsubushi_py.__file__.startswith(sys.argv[1]), katsubushi_py.__file__
assert c.IMPLEMENTATION == "compiled" and c.grpc_speedups is not None, c.WHY_NOT_COMPILED' "$work/pkg"
args=()
for arg in "$@"; do
  case $arg in -*) args+=("$arg") ;; *) if [ -e "$root/${arg%%::*}" ]; then args+=("$root/$arg"); else args+=("$arg"); fi ;; esac
done
status=0
"$pytest_bin" -c "$root/pyproject.toml" --rootdir "$root" "${args[@]}" || status=$?
unset LD_PRELOAD
cd "$root"
if ls "$work"/reports/* >/dev/null 2>&1; then
  echo "sanitizer reports:" >&2
  cat "$work"/reports/* >&2
  exit 1
fi
[ "$status" = 0 ] || { echo "tests failed under the sanitizers (exit $status)" >&2; exit "$status"; }
echo "sanitized run: no sanitizer report, tests passed (build in $work)"

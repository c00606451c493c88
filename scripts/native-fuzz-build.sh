#!/usr/bin/env bash
# native-fuzz-build.sh DIR: a copy of the package in DIR/pkg with both compiled modules built by clang
# with -fsanitize=fuzzer-no-link (SanitizerCoverage: the edge counters, comparison and switch tracing
# libFuzzer feeds on), so that atheris's libFuzzer is guided by the C code's coverage too, not only by
# the pure twins' (fuzz/run.py --native uses it). The hooks are libFuzzer's: DIR/libfuzzer.so is clang's
# libFuzzer (without its main) as a shared library, to be LD_PRELOADed into the fuzzing process, where
# atheris finds it ("Using preloaded libfuzzer") and the instrumented modules resolve their hooks to it.
# Prints DIR/pkg. Needs clang (Debian: apt-get install clang).
set -euo pipefail
dir=${1:?usage: native-fuzz-build.sh DIR}
cc=${CLANG:-clang}
command -v "$cc" >/dev/null || { echo "native-fuzz-build.sh: $cc not found (apt-get install clang)" >&2; exit 1; }
runtime=$("$cc" -print-file-name=libclang_rt.fuzzer_no_main-x86_64.a)
[ -f "$runtime" ] || { echo "native-fuzz-build.sh: clang has no libFuzzer runtime ($runtime)" >&2; exit 1; }
mkdir -p "$dir"
"$cc" -shared -fPIC -o "$dir/libfuzzer.so" -Wl,--whole-archive "$runtime" -Wl,--no-whole-archive -lstdc++ -lpthread
exec bash "$(dirname "$0")/build-copy.sh" "$dir" "$cc" -fsanitize=fuzzer-no-link

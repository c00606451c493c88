#!/usr/bin/env bash
# native-fuzz-build.sh DIR: a copy of the package in DIR/pkg with both compiled modules built by clang
# with -fsanitize=fuzzer-no-link (SanitizerCoverage: the edge counters, comparison and switch tracing
# libFuzzer feeds on), so that atheris's libFuzzer is guided by the C code's coverage too, not only by
# the pure twins' (fuzz/run.py --native uses it). The hooks are libFuzzer's: DIR/libfuzzer.so is clang's
# libFuzzer (without its main) as a shared library, to be LD_PRELOADed into the fuzzing process, where
# atheris finds it ("Using preloaded libfuzzer") and the instrumented modules resolve their hooks to it.
# Prints DIR/pkg. Needs clang (Debian: apt-get install clang).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: native-fuzz-build.sh DIR}
python=${PYTHON:-python3}
cc=${CLANG:-clang}
command -v "$cc" >/dev/null || { echo "native-fuzz-build.sh: $cc not found (apt-get install clang)" >&2; exit 1; }
mkdir -p "$dir/pkg"
rm -rf "$dir/pkg/katsubushi_py"
cp -r katsubushi_py "$dir/pkg/"
find "$dir/pkg/katsubushi_py" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for mod in _speedups _grpc_speedups; do
  "$cc" -shared -fPIC -O1 -g -I"$include" -fsanitize=fuzzer-no-link -Wall \
    -Werror=implicit-function-declaration \
    -o "$dir/pkg/katsubushi_py/$mod$suffix" "katsubushi_py/$mod.c"
done
runtime=$("$cc" -print-file-name=libclang_rt.fuzzer_no_main-x86_64.a)
[ -f "$runtime" ] || { echo "native-fuzz-build.sh: clang has no libFuzzer runtime ($runtime)" >&2; exit 1; }
"$cc" -shared -fPIC -o "$dir/libfuzzer.so" -Wl,--whole-archive "$runtime" -Wl,--no-whole-archive -lstdc++ -lpthread
echo "$dir/pkg"

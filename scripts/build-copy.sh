#!/usr/bin/env bash
# build-copy.sh DIR CC FLAGS...: a copy of the package in DIR/pkg (without its built modules), both
# compiled modules built there by CC with FLAGS. Prints DIR/pkg. The shared step of sanitize-build.sh
# (gcc, ASan/UBSan) and native-fuzz-build.sh (clang, libFuzzer's coverage instrumentation).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: build-copy.sh DIR CC FLAGS...}
cc=${2:?usage: build-copy.sh DIR CC FLAGS...}
shift 2
python=${PYTHON:-python3}
mkdir -p "$dir/pkg"
rm -rf "$dir/pkg/katsubushi_py"
cp -r katsubushi_py "$dir/pkg/"
find "$dir/pkg/katsubushi_py" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for mod in _speedups _grpc_speedups; do
  "$cc" -shared -fPIC -O1 -g -I"$include" "$@" -Wall -Werror=implicit-function-declaration \
    -o "$dir/pkg/katsubushi_py/$mod$suffix" "katsubushi_py/$mod.c"
done
echo "$dir/pkg"

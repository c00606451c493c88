#!/usr/bin/env bash
# sanitize-build.sh DIR: a copy of the package in DIR/pkg with both compiled modules built by gcc with
# -fsanitize=address,undefined (scripts/sanitize.sh and fuzz/run.py --sanitized use it). Prints DIR/pkg.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: sanitize-build.sh DIR}
python=${PYTHON:-python3}
mkdir -p "$dir/pkg"
rm -rf "$dir/pkg/katsubushi_py"
cp -r katsubushi_py "$dir/pkg/"
find "$dir/pkg/katsubushi_py" \( -name '*.so' -o -name '__pycache__' \) -prune -exec rm -rf {} +
include=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
for mod in _speedups _grpc_speedups; do
  gcc -shared -fPIC -O1 -g -I"$include" \
    -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined \
    -Wall -Werror=implicit-function-declaration \
    -o "$dir/pkg/katsubushi_py/$mod$suffix" "katsubushi_py/$mod.c"
done
echo "$dir/pkg"

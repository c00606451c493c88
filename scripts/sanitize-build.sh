#!/usr/bin/env bash
# sanitize-build.sh DIR: a copy of the package in DIR/pkg with both compiled modules built by gcc with
# -fsanitize=address,undefined (scripts/sanitize.sh and fuzz/run.py --sanitized use it). Prints DIR/pkg.
set -euo pipefail
dir=${1:?usage: sanitize-build.sh DIR}
exec bash "$(dirname "$0")/build-copy.sh" "$dir" gcc \
  -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined

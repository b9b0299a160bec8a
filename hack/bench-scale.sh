#!/usr/bin/env bash
# Scale benchmark (not part of make test): N simulated hosts + N Machines against a fresh local
# apiserver, `metalboot manager` (release build) as its own process. SCALE_N=100,1000,10000 by
# default; SCALE_STEADY_SECONDS=60. The first run builds in release mode (several minutes).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/hack/install-deps.sh"
"$root/hack/control-plane/build.sh"
cd "$root"
cargo build --release --quiet --bin metalboot
ulimit -n 65536 2>/dev/null || true
cargo bench --bench scale 2>&1 | grep --line-buffered -vE '^\s*(Compiling|Finished|Running)'

#!/usr/bin/env bash
# Stops exactly the processes start.sh started (recorded in <dir>/pids).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" && exec cargo run --quiet -- control-plane stop "$@"

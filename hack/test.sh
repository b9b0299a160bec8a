#!/usr/bin/env bash
# Runs the whole suite and ends with one line for the whole run: "N passed, N failed, N ignored",
# then the names of the failed tests. Exit status is cargo's.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/target"
log="$root/target/test.log"
"${CARGO:-cargo}" test --no-fail-fast "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i } }
     END { printf "\nsummary: %d passed, %d failed, %d ignored\n", p, f, g }' "$log"
grep -E '^test .* \.\.\. FAILED$' "$log" | sed -E 's/^test (.*) \.\.\. FAILED$/  failed: \1/'
exit "$status"

#!/usr/bin/env bash
# Runs the whole suite and ends with one line for the whole run: "N passed, N failed, N ignored",
# then the names of the failed tests. Exit status is non-zero when any test or the build failed.
#
# Two lanes run side by side once everything is built: the test binaries that boot a whole OS in
# QEMU under TCG (minutes each, and waiting on the guest about a third of the time) in one, every
# other binary in the other. On two cores that takes the light binaries' ~9 minutes off the
# critical path. Each lane's lines are prefixed with its name; target/test.log keeps them all.
#
# With arguments (`hack/test.sh --test netboot`), it is one plain `cargo test` with them.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
cargo=${CARGO:-cargo}
mkdir -p target
log="target/test.log"

summarize() {
    awk '/^([a-z]+\| )?test result:/ { for (i = 1; i <= NF; i++) { if ($(i+1) ~ /^passed/) p += $i; if ($(i+1) ~ /^failed/) f += $i; if ($(i+1) ~ /^ignored/) g += $i } }
         END { printf "\nsummary: %d passed, %d failed, %d ignored\n", p, f, g }' "$log"
    grep -E '^([a-z]+\| )?test .* \.\.\. FAILED$' "$log" |
        sed -E 's/^([a-z]+\| )?test (.*) \.\.\. FAILED$/  failed: \2/'
    # A binary that crashed prints no test result; cargo still names it.
    grep -E 'error: test failed, to rerun pass' "$log" | sed -E 's/^([a-z]+\| )?error: /  /'
}

if [ $# -gt 0 ]; then
    "$cargo" test --no-fail-fast "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    summarize
    exit "$status"
fi

# The binaries that boot the lab's Debian (live or from disk) in QEMU: the long lane.
qemu_tests=(capi_kubeadm e2e_lab image_e2e os_image)
light_args=(--lib --bins)
for file in tests/*.rs; do
    name=$(basename "$file" .rs)
    case " ${qemu_tests[*]} " in
    *" $name "*) ;;
    *) light_args+=(--test "$name") ;;
    esac
done
qemu_args=()
for name in "${qemu_tests[@]}"; do qemu_args+=(--test "$name"); done

# The test binaries take about 2 GB of target/ beside what `make test`'s other steps built. A full
# disk shows up as a linker crash (SIGBUS), so say how much room there is, before and on failure.
free_space() { df -h --output=avail target | tail -1 | tr -d ' '; }
echo "test: $(free_space) free on the filesystem of target/" | tee "$log"

# Build every target first, so a compile error ends the run with cargo's own message and the
# lanes below only run what is built.
"$cargo" test --no-fail-fast --no-run 2>&1 | tee -a "$log"
built=${PIPESTATUS[0]}
if [ "$built" -ne 0 ]; then
    echo "test: the build failed with $(free_space) free on the filesystem of target/" | tee -a "$log"
    summarize
    exit "$built"
fi

lane() {
    local name=$1
    shift
    "$cargo" test --no-fail-fast "$@" 2>&1 | sed -u "s/^/$name| /" | tee -a "target/test-$name.log"
    return "${PIPESTATUS[0]}"
}
: >target/test-qemu.log
: >target/test-light.log
lane qemu "${qemu_args[@]}" &
qemu_lane=$!
lane light "${light_args[@]}"
light_status=$?
lane light --doc
doc_status=$?
wait "$qemu_lane"
qemu_status=$?
cat target/test-light.log target/test-qemu.log >>"$log"
summarize
[ "$light_status" -eq 0 ] && [ "$doc_status" -eq 0 ] && [ "$qemu_status" -eq 0 ]

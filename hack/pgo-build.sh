#!/usr/bin/env bash
# A profile-guided (PGO) release build of metalboot, trained on the scale benchmark:
#   1. an instrumented release build (-Cprofile-generate);
#   2. training: `benches/scale.rs` at N=$PGO_TRAIN_N (default 1000) with that build as its
#      manager (the real apiserver, the simulated fleet, the boot service's HTTP path); the
#      benchmark stops the manager with SIGTERM, and the manager writes its profile as it exits;
#   3. llvm-profdata (rustup's llvm-tools, the LLVM of this rustc) merges the profile;
#   4. the release build again with -Cprofile-use: LLVM inlines along the paths training ran,
#      optimizes cold code for size and groups hot functions, so fewer of the binary's pages
#      are resident in the manager (README, Scale, thirty-fifth session: at N=1,000, 4.3 MiB
#      less of the binary resident and 0.82x the manager's CPU). Machine function splitting
#      (-enable-split-machine-functions) was tried and kept more text resident, not less: the
#      split-off blocks that do run are spread thin, and the kernel maps 64 KiB around each.
# Output: target/pgo/metalboot. The profile and every build stay under target/pgo (never
# committed). About three release builds and one N=1,000 run: 45 minutes on two cores.
# Code that training does not run (TFTP, DHCP, IPMI, the lab, the deploy agent) is built as
# cold: correct, smaller, maybe slower. `make bench` measures the boot service with the
# ordinary release build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out="$root/target/pgo"
host=$(rustc -vV | sed -n 's/^host: //p')
"$root/hack/install-deps.sh"
"$root/hack/control-plane/build.sh"
# Offline, an installed llvm-tools still serves; the check below says what is missing.
command -v rustup >/dev/null && { rustup component add llvm-tools >/dev/null || true; }
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
[ -x "$profdata" ] || { echo "pgo-build: $profdata is missing (rustup component add llvm-tools)" >&2; exit 1; }

# --target keeps RUSTFLAGS off build scripts and proc macros: only metalboot's code is trained.
echo "pgo-build: 1/4 instrumented release build"
rm -rf "$out/raw"
CARGO_TARGET_DIR="$out/generate" RUSTFLAGS="-Cprofile-generate=$out/raw" \
  cargo build --release --locked --target "$host" --bin metalboot

echo "pgo-build: 2/4 training on the scale benchmark, N=${PGO_TRAIN_N:-1000}"
ulimit -n 65536 2>/dev/null || true
SCALE_N="${PGO_TRAIN_N:-1000}" SCALE_STEADY_SECONDS=10 \
  METALBOOT_BIN="$out/generate/$host/release/metalboot" \
  cargo bench --bench scale 2>&1 | grep --line-buffered -vE '^\s*(Compiling|Finished|Running)'
compgen -G "$out/raw/*.profraw" >/dev/null || { echo "pgo-build: the manager wrote no profile" >&2; exit 1; }

echo "pgo-build: 3/4 merging the profile"
"$profdata" merge -o "$out/metalboot.profdata" "$out/raw"/*.profraw

echo "pgo-build: 4/4 release build with the profile"
CARGO_TARGET_DIR="$out/use" \
  RUSTFLAGS="-Cprofile-use=$out/metalboot.profdata" \
  cargo build --release --locked --target "$host" --bin metalboot
install -m 0755 "$out/use/$host/release/metalboot" "$out/metalboot"
echo "pgo-build: $out/metalboot"

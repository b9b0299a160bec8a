#!/usr/bin/env bash
# Redfish data the tests read, fetched at pinned versions into target/tools and never committed:
#
# - Real-vendor Redfish replies for the replay suite (tests/redfish_replay.rs): the JSON samples
#   that OpenStack's sushy (Dell, Lenovo, generic), sushy-oem-idrac (Dell iDRAC) and proliantutils
#   (HPE iLO) publish in their PyPI source distributions, into target/tools/replay (they are those
#   projects' test data).
# - DMTF's Redfish schemas (CSDL XML) for the Redfish Service Validator (tests/redfish_validator.rs),
#   into target/tools/redfish-schemas (they are DMTF's files). dmtf.org is out of reach here, so
#   they come from the crates.io crate nv-redfish-schema, which bundles DMTF's redfish-csdl/csdl
#   unchanged. Only that directory: the crate's Swordfish CSDL carries older copies of DMTF files
#   under the same names (ServiceRoot_v1.xml is v1.9.0 there), and nothing here serves Swordfish.
#
# A second run with the files present does nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

replay() {
  local dest="$root/target/tools/replay"
  local packages=("sushy==5.14.0" "sushy-oem-idrac==6.0.0" "proliantutils==2.16.3")
  local stamp
  stamp="$dest/.fetched-$(printf '%s ' "${packages[@]}" | sha256sum | cut -c1-12)"
  if [ -f "$stamp" ]; then
    echo "replay: vendor Redfish samples already in $dest"
    return
  fi
  command -v python3 >/dev/null || { echo "replay: python3 is required" >&2; exit 1; }
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$work/sdist" "${packages[@]}"
  rm -rf "$dest"
  mkdir -p "$dest"
  for archive in "$work"/sdist/*.tar.gz; do
    tar -xzf "$archive" -C "$work"
  done
  # Only the JSON samples, by package.
  copy() { mkdir -p "$dest/$2" && cp "$1"/*.json "$dest/$2/"; }
  copy "$work"/sushy-5.14.0/sushy/tests/unit/json_samples sushy
  copy "$work"/sushy-oem-idrac-6.0.0/sushy_oem_idrac/tests/unit/json_samples idrac
  copy "$work"/proliantutils-2.16.3/proliantutils/tests/redfish/json_samples ilo
  touch "$stamp"
  echo "replay: vendor Redfish samples in $dest ($(find "$dest" -name '*.json' | wc -l) files)"
}

schemas() {
  local dest="$root/target/tools/redfish-schemas"
  local crate=nv-redfish-schema version=0.22.1
  # The crate's checksum as crates.io's index has it; cargo refuses a download that differs.
  local checksum=12b683cd72e1962b4ae64a03641ac846f981db4a97bb082fa9340b23a2b983b1
  local stamp="$dest/.fetched-$crate-$version-${checksum:0:12}-csdl"
  if [ -f "$stamp" ]; then
    echo "replay: DMTF Redfish schemas already in $dest"
    return
  fi
  command -v "${CARGO:-cargo}" >/dev/null || { echo "replay: cargo is required" >&2; exit 1; }
  # A scratch package whose lock pins the crate and its checksum, fetched with a cargo home of its
  # own (nothing lands in the user's).
  local scratch="$work/schemafetch"
  mkdir -p "$scratch/src"
  : >"$scratch/src/lib.rs"
  cat >"$scratch/Cargo.toml" <<TOML
[package]
name = "schemafetch"
version = "0.0.0"
edition = "2021"

[dependencies]
$crate = "=$version"
TOML
  cat >"$scratch/Cargo.lock" <<LOCK
version = 4

[[package]]
name = "glob"
version = "0.3.4"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "e4eba85ea1d0a966a983acd07deee566e67395d2d96b6fb39e62b5a833f1eb0b"

[[package]]
name = "$crate"
version = "$version"
source = "registry+https://github.com/rust-lang/crates.io-index"
checksum = "$checksum"
dependencies = [
 "glob",
]

[[package]]
name = "schemafetch"
version = "0.0.0"
dependencies = [
 "$crate",
]
LOCK
  CARGO_HOME="$work/cargo-home" "${CARGO:-cargo}" fetch --locked --quiet \
    --manifest-path "$scratch/Cargo.toml"
  local archive
  archive="$(find "$work/cargo-home/registry/cache" -name "$crate-$version.crate" | head -1)"
  [ -n "$archive" ] || { echo "replay: cargo fetch left no $crate-$version.crate" >&2; exit 1; }
  tar -xzf "$archive" -C "$work"
  local src="$work/$crate-$version"
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$src"/redfish-csdl/csdl/*.xml "$dest/"
  for required in ServiceRoot_v1.xml ComputerSystem_v1.xml Resource_v1.xml; do
    [ -f "$dest/$required" ] || { echo "replay: $crate $version has no $required" >&2; exit 1; }
  done
  touch "$stamp"
  echo "replay: DMTF Redfish schemas in $dest ($(find "$dest" -name '*.xml' | wc -l) files, from $crate $version)"
}

replay
schemas

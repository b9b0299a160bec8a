#!/usr/bin/env bash
# Real-vendor Redfish replies for the replay suite (tests/redfish_replay.rs): the JSON samples that
# OpenStack's sushy (Dell, Lenovo, generic), sushy-oem-idrac (Dell iDRAC) and proliantutils (HPE
# iLO) publish in their PyPI source distributions. Fetched at pinned versions into
# target/tools/replay, never committed (they are those projects' test data). A second run with the
# files present does nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/target/tools/replay"
packages=("sushy==5.14.0" "sushy-oem-idrac==6.0.0" "proliantutils==2.16.3")
stamp="$dest/.fetched-$(printf '%s ' "${packages[@]}" | sha256sum | cut -c1-12)"
if [ -f "$stamp" ]; then
  echo "replay: vendor Redfish samples already in $dest"
  exit 0
fi
command -v python3 >/dev/null || { echo "replay: python3 is required" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
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

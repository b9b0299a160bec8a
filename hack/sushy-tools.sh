#!/usr/bin/env bash
# Installs the Redfish emulator sushy-tools into a project-local venv (target/tools/sushy), used by
# tests/redfish.rs, and DMTF's Redfish Service Validator into the same venv, used by
# tests/redfish_validator.rs (its schemas come from hack/redfish-replay.sh). A second run with the
# pinned versions already present does nothing.
set -euo pipefail
version="${SUSHY_TOOLS_VERSION:-2.2.0}"
validator_version="${REDFISH_SERVICE_VALIDATOR_VERSION:-3.1.8}"
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/target/tools/sushy"
installed_version() {
  "$venv/bin/python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true
}
installed="$(installed_version sushy-tools)"
validator_installed="$(installed_version redfish-service-validator)"
# A venv copied or moved from another checkout keeps that checkout's path in its scripts.
if [ -e "$venv" ] && ! head -1 "$venv/bin/sushy-emulator" 2>/dev/null | grep -qxF "#!$venv/bin/python"; then
  echo "sushy: $venv was made for another path; recreating it"
  rm -rf "$venv"
  installed=""
  validator_installed=""
fi
if [ "$installed" = "$version" ] && [ -x "$venv/bin/sushy-emulator" ] &&
  [ "$validator_installed" = "$validator_version" ] && [ -x "$venv/bin/rf_service_validator" ]; then
  echo "sushy: sushy-tools $version and redfish-service-validator $validator_version already installed in $venv"
  exit 0
fi
command -v python3 >/dev/null || { echo "sushy: python3 is required (make deps)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  echo "sushy: creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
pip_install() { # name version installed-version binary
  if [ "$3" = "$2" ] && [ -x "$venv/bin/$4" ]; then
    return
  fi
  echo "sushy: installing $1==$2${3:+ (was $3)} into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$1==$2"
  local now
  now="$(installed_version "$1")"
  [ "$now" = "$2" ] || { echo "sushy: expected $1 $2, found $now" >&2; exit 1; }
  echo "sushy: installed $1 $now ($venv/bin/$4)"
}
pip_install sushy-tools "$version" "$installed" sushy-emulator
pip_install redfish-service-validator "$validator_version" "$validator_installed" rf_service_validator

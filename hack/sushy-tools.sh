#!/usr/bin/env bash
# Installs the Redfish emulator sushy-tools into a project-local venv (target/tools/sushy), used by
# tests/redfish.rs. A second run with the pinned version already present does nothing.
set -euo pipefail
version="${SUSHY_TOOLS_VERSION:-2.2.0}"
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="$root/target/tools/sushy"
installed="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sushy-tools"))' 2>/dev/null || true)"
# A venv copied or moved from another checkout keeps that checkout's path in its scripts.
if [ -e "$venv" ] && ! head -1 "$venv/bin/sushy-emulator" 2>/dev/null | grep -qxF "#!$venv/bin/python"; then
  echo "sushy: $venv was made for another path; recreating it"
  rm -rf "$venv"
  installed=""
fi
if [ "$installed" = "$version" ] && [ -x "$venv/bin/sushy-emulator" ]; then
  echo "sushy: sushy-tools $version already installed in $venv"
  exit 0
fi
command -v python3 >/dev/null || { echo "sushy: python3 is required (make deps)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
  echo "sushy: creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
fi
echo "sushy: installing sushy-tools==$version${installed:+ (was $installed)} into $venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "sushy-tools==$version"
now="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("sushy-tools"))')"
[ "$now" = "$version" ] || { echo "sushy: expected sushy-tools $version, found $now" >&2; exit 1; }
echo "sushy: installed sushy-tools $now ($venv/bin/sushy-emulator)"

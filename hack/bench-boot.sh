#!/usr/bin/env bash
# Boot-storm benchmark: metalboot's boot service vs nginx on this machine, one run, ratio printed.
# Also the TFTP storm against tftpd-hpa. Installs nginx and tftpd-hpa if missing; builds in release mode (first run takes several minutes).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/hack/install-deps.sh"
"$root/hack/control-plane/build.sh"
if ! command -v nginx >/dev/null; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx-light >/dev/null || DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nginx >/dev/null
fi
if ! command -v in.tftpd >/dev/null; then
  # Installed for its binary only: keep the package from starting a daemon on port 69.
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  policy=/usr/sbin/policy-rc.d
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' | $sudo tee $policy >/dev/null; $sudo chmod +x $policy; trap "$sudo rm -f $policy" EXIT; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq tftpd-hpa >/dev/null
fi
"$root/hack/os-image/build.sh"
cd "$root" && cargo bench --bench boot --bench tftp --bench netboot --bench image 2>&1 | grep -vE '^\s*(Compiling|Finished|Running)'

#!/usr/bin/env bash
# Installs the Debian packages metalboot's tests and lab need, only those missing, so a second
# run is quick and offline. Go (for the control-plane build) and Rust come with the machine.
set -euo pipefail
packages=(
  curl ca-certificates atftp  # HTTP/TFTP clients in tests
  python3-venv                # sushy-tools (Redfish emulator) in a project-local venv
  qemu-system-x86 ipxe-qemu   # lab hosts and the real-iPXE boot test
  ipxe                        # undionly.kpxe / ipxe.efi served over TFTP
  ovmf                        # UEFI lab hosts (EDK2 PXE and HTTP Boot)
  iproute2 dnsmasq-base       # the bridged lab network; dnsmasq plays the site's DHCP server
  ipmitool openipmi           # the IPMI driver's tool; ipmi_sim, a real IPMI BMC for tests
  cloud-init                  # the real cloud-init validates and runs the bootstrap cloud-config
  busybox-static cpio kmod    # the deploy ramdisk's initramfs
  mmdebstrap qemu-utils squashfs-tools  # the lab's installed OS: a Debian disk image, its qcow2 form, its live squashfs
  grub-pc-bin grub-efi-amd64-bin grub2-common dosfstools mtools  # its boot loader for SeaBIOS and OVMF
  musl-tools xz-utils zstd     # the deploy ramdisk: metalboot agent as a static musl binary
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "deps: all Debian packages present"
else
  echo "deps: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  # QEMU from bookworm-backports only when backports' qemu-utils would otherwise conflict.
  if dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null | grep -q bpo; then
    echo "deps: qemu-utils comes from backports; taking QEMU from bookworm-backports too"
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sed 's#^qemu-system-x86$#qemu-system-x86/bookworm-backports#')
    missing+=(qemu-system-common/bookworm-backports qemu-system-data/bookworm-backports seabios/bookworm-backports)
  fi
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # cloud-init is here for its validator and runcmd semantics: keep it from configuring this
  # machine at its next boot (cloud-init's own off switch).
  if printf '%s\n' "${missing[@]}" | grep -qx cloud-init; then
    $sudo mkdir -p /etc/cloud && $sudo touch /etc/cloud/cloud-init.disabled
  fi
  echo "deps: installed"
fi
command -v go >/dev/null || { echo "deps: Go >= 1.26 is required to build the control plane and is not on PATH" >&2; exit 1; }

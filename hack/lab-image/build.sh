#!/usr/bin/env bash
# Builds the lab OS into target/lab/image: Debian's kernel (vmlinuz) and a small busybox
# initramfs (initrd.gz) whose /init acts as cloud-init NoCloud and as a kubelet stand-in.
# Cached: rebuilt only when the kernel package or the files in this directory change.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="${LAB_IMAGE_DIR:-$root/target/lab/image}"
mkdir -p "$out"

# The kernel package linux-image-amd64 points at (e.g. linux-image-6.1.0-40-amd64).
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
if [ -z "$kpkg" ]; then
  apt-get update -qq >/dev/null 2>&1 || true
  kpkg=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
fi
[ -n "$kpkg" ] || { echo "lab-image: cannot resolve linux-image-amd64 (apt-get update?)" >&2; exit 1; }
want="$kpkg $(cat "$here"/init "$here"/cloud-config.awk "$here"/udhcpc.script "$0" | sha256sum | cut -c1-16)"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ] && [ -s "$out/vmlinuz" ] && [ -s "$out/initrd.gz" ]; then
  echo "lab image: reusing $out ($kpkg)"
  exit 0
fi
command -v busybox >/dev/null || { echo "lab-image: busybox-static is required" >&2; exit 1; }
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt drops to the _apt user to download; let it write here (no "unsandboxed" warning).
chmod 755 "$work"
if id _apt >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then chown _apt "$work"; fi
cd "$work"
echo "lab image: downloading $kpkg"
apt-get download "$kpkg" >/dev/null
dpkg-deb -x ./*.deb kernel
cp kernel/boot/vmlinuz-* "$out/vmlinuz.new"

# virtio-net and its dependencies are modules in Debian's kernel; load order matters. button +
# evdev turn the ACPI power button (the BMC's graceful shutdown) into an event acpid sees.
mkdir -p initramfs/{bin,sbin,etc,proc,sys,dev,run,tmp,root,lib/modules,usr/share/metalboot}
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci failover net_failover virtio_net button evdev; do
  f=$(find kernel/lib/modules -name "$m.ko*" | head -1)
  [ -n "$f" ] || { echo "lab-image: module $m not in $kpkg" >&2; exit 1; }
  case "$f" in
    *.xz) xz -dc "$f" > "initramfs/lib/modules/$m.ko" ;;
    *.zst) zstd -qdc "$f" > "initramfs/lib/modules/$m.ko" ;;
    *) cp "$f" "initramfs/lib/modules/$m.ko" ;;
  esac
done
cp "$(command -v busybox)" initramfs/bin/busybox
cp "$here/init" initramfs/init
cp "$here/cloud-config.awk" initramfs/usr/share/metalboot/cloud-config.awk
cp "$here/udhcpc.script" initramfs/etc/udhcpc.script
chmod +x initramfs/init initramfs/etc/udhcpc.script
(cd initramfs && find . | cpio -o -H newc --quiet | gzip -9) > "$out/initrd.gz.new"
mv "$out/vmlinuz.new" "$out/vmlinuz"
mv "$out/initrd.gz.new" "$out/initrd.gz"
echo "$want" > "$out/.stamp"
echo "lab image: built $out (vmlinuz $(du -h "$out/vmlinuz" | cut -f1), initrd.gz $(du -h "$out/initrd.gz" | cut -f1)) in $(( $(date +%s) - start ))s"

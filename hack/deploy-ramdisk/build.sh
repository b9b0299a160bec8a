#!/usr/bin/env bash
# Builds the deploy ramdisk into target/lab/deploy: Debian's kernel (vmlinuz) and an initramfs
# (initrd.gz) of busybox, the storage and network modules, and `metalboot agent` built from this
# crate as a static musl binary. Cached: rebuilt when the kernel package, this directory or the
# agent binary changes.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="${DEPLOY_RAMDISK_DIR:-$root/target/lab/deploy}"
target=x86_64-unknown-linux-musl
mkdir -p "$out"

command -v musl-gcc >/dev/null || { echo "deploy ramdisk: musl-gcc is required (make deps)" >&2; exit 1; }
rustup target list --installed 2>/dev/null | grep -qx "$target" || rustup target add "$target"
echo "deploy ramdisk: building metalboot for $target"
CC_x86_64_unknown_linux_musl=musl-gcc "${CARGO:-cargo}" build --quiet --profile ramdisk --no-default-features --target "$target" --bin metalboot
agent="$root/target/$target/ramdisk/metalboot"

kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
[ -n "$kpkg" ] || { echo "deploy ramdisk: cannot resolve linux-image-amd64 (apt-get update?)" >&2; exit 1; }
want="$kpkg $(cat "$here"/* "$agent" | sha256sum | cut -c1-16)"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ] && [ -s "$out/vmlinuz" ] && [ -s "$out/initrd.gz" ]; then
  echo "deploy ramdisk: reusing $out ($kpkg)"
  exit 0
fi
command -v busybox >/dev/null || { echo "deploy ramdisk: busybox-static is required" >&2; exit 1; }
start=$(date +%s)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
if id _apt >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then chown _apt "$work"; fi
cd "$work"
apt-get download "$kpkg" >/dev/null
dpkg-deb -x ./*.deb kernel
cp kernel/boot/vmlinuz-* "$out/vmlinuz.new"

mkdir -p initramfs/{bin,sbin,etc,proc,sys,dev,run,tmp,lib/modules}
# Load order: each module after the ones it needs. Required: virtio (the lab's hosts);
# best effort: NVMe and AHCI for real hosts.
required="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci failover net_failover virtio_net virtio_blk"
optional="scsi_common scsi_mod sd_mod libata libahci ahci nvme-core nvme_core nvme e1000e igb"
: > initramfs/lib/modules/order
for m in $required $optional; do
  f=$(find kernel/lib/modules -name "$m.ko*" | head -1)
  if [ -z "$f" ]; then
    case " $required " in *" $m "*) echo "deploy ramdisk: module $m not in $kpkg" >&2; exit 1 ;; esac
    continue
  fi
  case "$f" in
    *.xz) xz -dc "$f" > "initramfs/lib/modules/$m.ko" ;;
    *.zst) zstd -qdc "$f" > "initramfs/lib/modules/$m.ko" ;;
    *) cp "$f" "initramfs/lib/modules/$m.ko" ;;
  esac
  echo "$m" >> initramfs/lib/modules/order
done
cp "$(command -v busybox)" initramfs/bin/busybox
cp "$agent" initramfs/bin/metalboot
cp "$here/init" initramfs/init
cp "$here/udhcpc.script" initramfs/etc/udhcpc.script
chmod +x initramfs/init initramfs/etc/udhcpc.script
(cd initramfs && find . | cpio -o -H newc --quiet | gzip -6) > "$out/initrd.gz.new"
mv "$out/vmlinuz.new" "$out/vmlinuz"
mv "$out/initrd.gz.new" "$out/initrd.gz"
echo "$want" > "$out/.stamp"
echo "deploy ramdisk: built $out (vmlinuz $(du -h "$out/vmlinuz" | cut -f1), initrd.gz $(du -h "$out/initrd.gz" | cut -f1)) in $(( $(date +%s) - start ))s"

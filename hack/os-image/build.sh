#!/usr/bin/env bash
# Builds the lab's installed OS: a Debian bookworm disk image with systemd, Debian's kernel, the
# real cloud-init and GRUB for both BIOS (SeaBIOS) and UEFI (OVMF), from Debian's packages with
# mmdebstrap. Output: target/lab/os/debian.raw (sparse) and debian.qcow2 (compressed), and their
# sha256/sha512 sums. Cached: rebuilt only when this directory's files change.
#
# GPT layout: 1 BIOS boot partition (core.img), 2 EFI system partition (removable-path GRUB),
# 3 ext4 root labelled "metalboot-root". cloud-init's NoCloud datasource is left to find its seed:
# metalboot's deploy agent adds a CIDATA partition whose meta-data points back at the boot token
# URL (seedfrom), so nothing secret is stored on the disk.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="${OS_IMAGE_DIR:-$root/target/lab/os}"
size="${OS_IMAGE_SIZE:-2G}"
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$out"
want="$(cat "$here"/* | sha256sum | cut -c1-16) $size $suite"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ] && [ -s "$out/debian.raw" ] && [ -s "$out/debian.qcow2" ]; then
  echo "os image: reusing $out"
  exit 0
fi
for tool in mmdebstrap grub-install mkfs.vfat mkfs.ext4 sgdisk losetup qemu-img; do
  command -v "$tool" >/dev/null || { echo "os image: $tool is required (make deps)" >&2; exit 1; }
done
[ -d /usr/lib/grub/i386-pc ] && [ -d /usr/lib/grub/x86_64-efi ] || { echo "os image: grub-pc-bin and grub-efi-amd64-bin are required" >&2; exit 1; }
start=$(date +%s)
work=$(mktemp -d)
loop=""
cleanup() {
  mountpoint -q "$work/mnt/boot/efi" 2>/dev/null && umount "$work/mnt/boot/efi"
  mountpoint -q "$work/mnt" 2>/dev/null && umount "$work/mnt"
  [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

echo "os image: debootstrapping $suite (mmdebstrap)"
packages=(
  systemd-sysv udev dbus linux-image-cloud-amd64 initramfs-tools
  cloud-init curl ca-certificates iproute2 netbase e2fsprogs
  kmod procps less
)
mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
  --customize-hook="cp '$here/networkd.network' \"\$1/etc/systemd/network/10-dhcp.network\"" \
  --customize-hook="cp '$here/cloud.cfg' \"\$1/etc/cloud/cloud.cfg.d/90-metalboot.cfg\"" \
  --customize-hook="chroot \"\$1\" systemctl enable systemd-networkd.service systemd-networkd-wait-online.service serial-getty@ttyS0.service" \
  --customize-hook="echo metalboot > \"\$1/etc/hostname\"" \
  --customize-hook="printf 'LABEL=metalboot-root / ext4 errors=remount-ro 0 1\nLABEL=METALEFI /boot/efi vfat umask=0077,nofail 0 2\n' > \"\$1/etc/fstab\"" \
  --customize-hook="rm -f \"\$1\"/etc/machine-id \"\$1\"/var/lib/dbus/machine-id; touch \"\$1/etc/machine-id\"" \
  "$suite" "$work/rootfs.tar" "$mirror"

echo "os image: partitioning a $size disk"
truncate -s "$size" "$work/disk.raw"
sgdisk --clear \
  --new=1:1MiB:+1MiB --typecode=1:EF02 --change-name=1:bios \
  --new=2:0:+63MiB --typecode=2:EF00 --change-name=2:esp \
  --new=3:0:0 --typecode=3:8304 --change-name=3:root \
  "$work/disk.raw" >/dev/null
loop=$(losetup --find --show --partscan "$work/disk.raw")
# Without udev the partition nodes may need a moment (or a nudge) to appear.
for _ in $(seq 50); do [ -b "${loop}p3" ] && break; partx -u "$loop" 2>/dev/null || true; sleep 0.1; done
[ -b "${loop}p3" ] || { echo "os image: no partition devices for $loop" >&2; exit 1; }
mkfs.vfat -F 32 -n METALEFI "${loop}p2" >/dev/null
mkfs.ext4 -q -L metalboot-root "${loop}p3"
mkdir -p "$work/mnt"
mount "${loop}p3" "$work/mnt"
tar -C "$work/mnt" -xpf "$work/rootfs.tar"
mkdir -p "$work/mnt/boot/efi"
mount "${loop}p2" "$work/mnt/boot/efi"

echo "os image: installing GRUB for BIOS and UEFI"
grub-install --target=i386-pc --boot-directory="$work/mnt/boot" --modules="part_gpt ext2" "$loop" 2>&1 | grep -v "^Installation finished" || true
grub-install --target=x86_64-efi --boot-directory="$work/mnt/boot" --efi-directory="$work/mnt/boot/efi" \
  --removable --no-nvram --modules="part_gpt ext2" 2>&1 | grep -v "^Installation finished" || true
[ -s "$work/mnt/boot/efi/EFI/BOOT/BOOTX64.EFI" ] || { echo "os image: UEFI GRUB missing" >&2; exit 1; }
[ -s "$work/mnt/boot/grub/i386-pc/core.img" ] || { echo "os image: BIOS GRUB missing" >&2; exit 1; }
# One static grub.cfg for both: the kernel and initrd symlinks Debian keeps in /.
cat > "$work/mnt/boot/grub/grub.cfg" <<'CFG'
set timeout=1
insmod part_gpt
insmod ext2
search --no-floppy --label metalboot-root --set=root
menuentry "Debian (metalboot lab)" {
  linux /vmlinuz root=LABEL=metalboot-root ro console=tty0 console=ttyS0,115200n8 net.ifnames=0
  initrd /initrd.img
}
CFG
[ -e "$work/mnt/vmlinuz" ] && [ -e "$work/mnt/initrd.img" ] || { echo "os image: /vmlinuz or /initrd.img missing" >&2; exit 1; }
umount "$work/mnt/boot/efi"
umount "$work/mnt"
losetup -d "$loop"; loop=""

echo "os image: writing raw and qcow2"
qemu-img convert -c -O qcow2 "$work/disk.raw" "$out/debian.qcow2.new"
cp --sparse=always "$work/disk.raw" "$out/debian.raw.new"
mv "$out/debian.raw.new" "$out/debian.raw"
mv "$out/debian.qcow2.new" "$out/debian.qcow2"
(cd "$out" && sha256sum debian.raw debian.qcow2 > SHA256SUMS && sha512sum debian.raw debian.qcow2 > SHA512SUMS)
echo "$want" > "$out/.stamp"
echo "os image: built $out (raw $(du -h --apparent-size "$out/debian.raw" | cut -f1), $(du -h "$out/debian.raw" | cut -f1) used; qcow2 $(du -h "$out/debian.qcow2" | cut -f1)) in $(( $(date +%s) - start ))s"

#!/usr/bin/env bash
# Builds the lab's installed OS: a Debian bookworm disk image with systemd, Debian's kernel, the
# real cloud-init and GRUB for both BIOS (SeaBIOS) and UEFI (OVMF), from Debian's packages with
# mmdebstrap. Output: target/lab/os/debian.raw (sparse), debian.raw.gz and debian.qcow2, and their
# sha256/sha512 sums; and the same system for live mode (diskless, netbooted on every boot):
# target/lab/os/live/{vmlinuz,initrd.img,filesystem.squashfs}, booted by Debian's live-boot with
# `boot=live fetch=<squashfs URL>`. Cached: rebuilt only when this directory's files change.
#
# GPT layout: 1 BIOS boot partition (core.img), 2 EFI system partition (removable-path GRUB),
# 3 ext4 root labelled "metalboot-root". cloud-init's NoCloud datasource is left to find its seed:
# metalboot's deploy agent adds a CIDATA partition whose meta-data points back at the boot token
# URL (seedfrom), so nothing secret is stored on the disk.
#
# A Kubernetes node, ready for `kubeadm join`: kubelet and kubeadm built from the pinned release
# (hack/control-plane/build.sh), containerd, runc and the CNI plugins from Debian, a bridge CNI
# config, the pause image built from the release's source (pause-image.sh), and kubeadm's kubelet
# unit. Files in node/.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out="${OS_IMAGE_DIR:-$root/target/lab/os}"
size="${OS_IMAGE_SIZE:-2G}"
suite=bookworm
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
k8s_bin="${CONTROL_PLANE_BIN:-$root/target/control-plane/bin}"
mkdir -p "$out"
for b in kubelet kubeadm; do
  [ -x "$k8s_bin/$b" ] || { echo "os image: no $k8s_bin/$b (make control-plane builds it)" >&2; exit 1; }
done
want="$(find "$here" -type f | sort | xargs cat | sha256sum | cut -c1-16) $(cat "$k8s_bin/.pin" 2>/dev/null | tr ' ' -) $size $suite"
if [ -f "$out/.stamp" ] && [ "$(cat "$out/.stamp")" = "$want" ] && [ -s "$out/debian.raw" ] && [ -s "$out/debian.raw.gz" ] && [ -s "$out/debian.qcow2" ] && [ -s "$out/live/filesystem.squashfs" ]; then
  echo "os image: reusing $out"
  exit 0
fi
for tool in mmdebstrap grub-install grub-mkimage mkfs.vfat mcopy mkfs.ext4 sgdisk losetup qemu-img mksquashfs; do
  command -v "$tool" >/dev/null || { echo "os image: $tool is required (make deps)" >&2; exit 1; }
done
[ -d /usr/lib/grub/i386-pc ] && [ -d /usr/lib/grub/x86_64-efi ] || { echo "os image: grub-pc-bin and grub-efi-amd64-bin are required" >&2; exit 1; }
start=$(date +%s)
work=$(mktemp -d)
loop=""
cleanup() {
  mountpoint -q "$work/mnt" 2>/dev/null && umount "$work/mnt"
  [ -n "$loop" ] && losetup -d "$loop" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT

echo "os image: debootstrapping $suite (mmdebstrap)"
packages=(
  systemd-sysv udev dbus linux-image-cloud-amd64 initramfs-tools
  cloud-init curl ca-certificates iproute2 netbase e2fsprogs
  kmod procps less live-boot
  containerd runc containernetworking-plugins
)
"$here/pause-image.sh" "$work/pause.tar"
node="$here/node"
mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
  --customize-hook="cp '$here/networkd.network' \"\$1/etc/systemd/network/10-dhcp.network\"" \
  --customize-hook="cp '$here/cloud.cfg' \"\$1/etc/cloud/cloud.cfg.d/90-metalboot.cfg\"" \
  --customize-hook="chroot \"\$1\" systemctl enable systemd-networkd.service systemd-networkd-wait-online.service serial-getty@ttyS0.service" \
  --customize-hook="echo metalboot > \"\$1/etc/hostname\"" \
  --customize-hook="install -m 0755 '$k8s_bin/kubelet' '$k8s_bin/kubeadm' \"\$1/usr/bin/\"" \
  --customize-hook="install -D -m 0644 '$node/kubelet.service' \"\$1/etc/systemd/system/kubelet.service\"" \
  --customize-hook="install -D -m 0644 '$node/10-kubeadm.conf' \"\$1/etc/systemd/system/kubelet.service.d/10-kubeadm.conf\"" \
  --customize-hook="install -D -m 0644 '$node/containerd.toml' \"\$1/etc/containerd/config.toml\"" \
  --customize-hook="install -D -m 0644 '$node/containerd-live.conf' \"\$1/etc/systemd/system/containerd.service.d/10-metalboot-live.conf\"" \
  --customize-hook="install -D -m 0644 '$node/10-metalboot-bridge.conflist' \"\$1/etc/cni/net.d/10-metalboot-bridge.conflist\"" \
  --customize-hook="install -D -m 0644 '$node/sysctl-kubernetes.conf' \"\$1/etc/sysctl.d/90-kubernetes.conf\"" \
  --customize-hook="install -D -m 0644 '$node/modules-kubernetes.conf' \"\$1/etc/modules-load.d/kubernetes.conf\"" \
  --customize-hook="install -D -m 0644 '$node/metalboot-pause-image.service' \"\$1/etc/systemd/system/metalboot-pause-image.service\"" \
  --customize-hook="install -D -m 0644 '$work/pause.tar' \"\$1/usr/share/metalboot/pause.tar\"" \
  --customize-hook="for c in \"\$1\"/boot/config-*; do cp \"\$c\" \"\$1/usr/lib/modules/\${c##*/config-}/config\"; done" \
  --customize-hook="chroot \"\$1\" systemctl enable containerd.service kubelet.service metalboot-pause-image.service" \
  --customize-hook="printf 'LABEL=metalboot-root / ext4 errors=remount-ro 0 1\nLABEL=METALEFI /boot/efi vfat umask=0077,nofail 0 2\n' > \"\$1/etc/fstab\"" \
  --customize-hook="rm -f \"\$1\"/etc/machine-id \"\$1\"/var/lib/dbus/machine-id; touch \"\$1/etc/machine-id\"" \
  "$suite" "$work/rootfs.tar" "$mirror"

# Live mode: the same root as a squashfs that live-boot's initramfs fetches over HTTP and mounts
# under a tmpfs overlay, so every boot starts from the image as built. live-boot writes the live
# system's fstab itself; the disk's would make systemd wait for a root partition that is not there.
echo "os image: live boot files (squashfs, zstd)"
mkdir -p "$work/live" && rm -rf "$out/live.new" && mkdir -p "$out/live.new"
tar -C "$work/live" -xpf "$work/rootfs.tar"
: > "$work/live/etc/fstab"
cp -L "$work/live/vmlinuz" "$out/live.new/vmlinuz"
cp -L "$work/live/initrd.img" "$out/live.new/initrd.img"
[ -e "$work/live/usr/share/initramfs-tools/scripts/live" ] || { echo "os image: live-boot is not installed" >&2; exit 1; }
mksquashfs "$work/live" "$out/live.new/filesystem.squashfs" -comp zstd -noappend -quiet -no-progress -e boot
rm -rf "$work/live"

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

echo "os image: installing GRUB for BIOS and UEFI"
# grub-install cannot map a loop device's partitions without udev, and the build machine's kernel
# may not mount FAT. So GRUB is laid down the way grub-install would, by hand: each platform's
# image is made with grub-mkimage with an early config that finds the root by label and reads
# the one grub.cfg; modules go to /boot/grub/<platform>.
mkdir -p "$work/mnt/boot/grub"
cp -r /usr/lib/grub/i386-pc /usr/lib/grub/x86_64-efi "$work/mnt/boot/grub/"
cat > "$work/early.cfg" <<'CFG'
search --no-floppy --label metalboot-root --set=root
set prefix=($root)/boot/grub
configfile ($root)/boot/grub/grub.cfg
CFG
# BIOS: core.img into the BIOS boot partition (LBA 2048), boot.img's code into the MBR (its
# partition table kept), each pointed at the next stage as grub-bios-setup does: boot.img's
# kernel sector (offset 0x5c) at core.img, core.img's first blocklist (offset 0x1f4) at the
# rest of itself.
grub-mkimage -O i386-pc -o "$work/core.img" -p /boot/grub -c "$work/early.cfg" \
  biosdisk part_gpt part_msdos ext2 search search_label normal configfile linux echo test \
  serial terminal boot reboot
core_sectors=$(( ($(stat -c %s "$work/core.img") + 511) / 512 ))
[ "$core_sectors" -le 2048 ] || { echo "os image: core.img does not fit the BIOS boot partition" >&2; exit 1; }
le64() { printf "$(printf '%016x' "$1" | sed -E 's/(..)(..)(..)(..)(..)(..)(..)(..)/\\x\8\\x\7\\x\6\\x\5\\x\4\\x\3\\x\2\\x\1/')"; }
le64 2049 | dd of="$work/core.img" bs=1 seek=$((0x1f4)) conv=notrunc status=none
dd if="$work/core.img" of="$loop" bs=512 seek=2048 conv=notrunc status=none
cp /usr/lib/grub/i386-pc/boot.img "$work/boot.img"
le64 2048 | dd of="$work/boot.img" bs=1 seek=$((0x5c)) conv=notrunc status=none
dd if="$work/boot.img" of="$loop" bs=440 count=1 conv=notrunc status=none
# UEFI: the removable-path loader on the ESP, filled with mtools.
grub-mkimage -O x86_64-efi -o "$work/BOOTX64.EFI" -p /boot/grub -c "$work/early.cfg" \
  part_gpt part_msdos ext2 fat search search_label normal configfile linux echo test \
  all_video efi_gop serial terminal boot reboot
export MTOOLS_SKIP_CHECK=1
mmd -i "${loop}p2" ::/EFI ::/EFI/BOOT 2>/dev/null  # "could not get geometry": a partition, not a drive
mcopy -i "${loop}p2" "$work/BOOTX64.EFI" ::/EFI/BOOT/BOOTX64.EFI 2>/dev/null
mdir -i "${loop}p2" ::/EFI/BOOT | grep -q BOOTX64 || { echo "os image: UEFI GRUB missing" >&2; exit 1; }
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
umount "$work/mnt"
losetup -d "$loop"; loop=""

echo "os image: writing raw and qcow2"
qemu-img convert -c -O qcow2 "$work/disk.raw" "$out/debian.qcow2.new"
gzip -1 -c "$work/disk.raw" > "$out/debian.raw.gz.new"
cp --sparse=always "$work/disk.raw" "$out/debian.raw.new"
mv "$out/debian.raw.new" "$out/debian.raw"
mv "$out/debian.qcow2.new" "$out/debian.qcow2"
mv "$out/debian.raw.gz.new" "$out/debian.raw.gz"
rm -rf "$out/live" && mv "$out/live.new" "$out/live"
(cd "$out" && sha256sum debian.raw debian.raw.gz debian.qcow2 > SHA256SUMS && sha512sum debian.raw debian.raw.gz debian.qcow2 > SHA512SUMS)
echo "$want" > "$out/.stamp"
echo "os image: built $out (raw $(du -h --apparent-size "$out/debian.raw" | cut -f1), $(du -h "$out/debian.raw" | cut -f1) used; qcow2 $(du -h "$out/debian.qcow2" | cut -f1)) in $(( $(date +%s) - start ))s"

//! Hardware inspection from the running kernel's view (`/proc`, `/sys`), the way the deploy
//! agent sees the host: CPUs, memory, disks (size, serial, WWN, rotational, a by-path name),
//! NICs (MAC, link, speed) and the firmware mode. Every function takes the filesystem root, so
//! the same code reads a recorded tree in tests. Missing or odd files leave a field empty; they
//! never fail the inspection.

use std::fs;
use std::path::Path;

use crate::api::metalhost::{CpuInfo, DiskInfo, HardwareInventory, NicInfo};

/// Block devices that are never install targets.
const NOT_DISKS: &[&str] = &["loop", "ram", "zram", "dm-", "sr", "fd", "md", "nbd"];

fn read(root: &Path, rel: &str) -> Option<String> {
    fs::read_to_string(root.join(rel.trim_start_matches('/')))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The whole inventory.
pub fn inspect(root: &Path) -> HardwareInventory {
    HardwareInventory {
        cpu: cpu(root),
        memory_mib: memory_mib(root),
        disks: disks(root),
        nics: nics(root),
        firmware_mode: Some(
            if root.join("sys/firmware/efi").is_dir() {
                "UEFI"
            } else {
                "BIOS"
            }
            .to_string(),
        ),
        manufacturer: read(root, "sys/class/dmi/id/sys_vendor"),
        model: read(root, "sys/class/dmi/id/product_name"),
        serial_number: read(root, "sys/class/dmi/id/product_serial"),
        system_uuid: read(root, "sys/class/dmi/id/product_uuid"),
        bios_version: read(root, "sys/class/dmi/id/bios_version"),
        ..Default::default()
    }
}

fn cpu(root: &Path) -> Option<CpuInfo> {
    let text = read(root, "proc/cpuinfo")?;
    let count = text
        .lines()
        .filter(|l| l.split(':').next().is_some_and(|k| k.trim() == "processor"))
        .count();
    let model = text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == "model name").then(|| v.trim().to_string())
    });
    Some(CpuInfo {
        count: i32::try_from(count).ok()?,
        model,
        architecture: Some(std::env::consts::ARCH.to_string()),
    })
}

fn memory_mib(root: &Path) -> Option<i64> {
    let text = read(root, "proc/meminfo")?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix("MemTotal:")?;
        let kib: i64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
        Some(kib / 1024)
    })
}

/// Disks under `/sys/block`, sorted by name.
pub fn disks(root: &Path) -> Vec<DiskInfo> {
    let Ok(entries) = fs::read_dir(root.join("sys/block")) else {
        return Vec::new();
    };
    let mut out: Vec<DiskInfo> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            if NOT_DISKS.iter().any(|p| name.starts_with(p)) || name.contains("boot") {
                return None;
            }
            let base = format!("sys/block/{name}");
            let sectors: i64 = read(root, &format!("{base}/size"))?.parse().ok()?;
            if sectors == 0 {
                return None;
            }
            let first =
                |rels: &[&str]| rels.iter().find_map(|r| read(root, &format!("{base}/{r}")));
            Some(DiskInfo {
                size_bytes: sectors.saturating_mul(512),
                model: first(&["device/model"]),
                serial_number: first(&["serial", "device/serial"]),
                wwn: first(&["wwid", "device/wwid"])
                    .map(|w| w.trim_start_matches("naa.").to_string()),
                by_path: by_path(root, &name),
                rotational: read(root, &format!("{base}/queue/rotational")).as_deref() == Some("1"),
                name,
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// A `/dev/disk/by-path` style name from the device's sysfs path: the PCI address of the
/// controller it hangs off (`pci-0000:00:04.0`), as udev's path_id names virtio and NVMe disks.
fn by_path(root: &Path, name: &str) -> Option<String> {
    let link = fs::read_link(root.join(format!("sys/block/{name}"))).ok()?;
    let pci = link
        .components()
        .rev()
        .filter_map(|c| c.as_os_str().to_str())
        .find(|c| is_pci_address(c))?;
    Some(format!("pci-{pci}"))
}

fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

fn nics(root: &Path) -> Vec<NicInfo> {
    let Ok(entries) = fs::read_dir(root.join("sys/class/net")) else {
        return Vec::new();
    };
    let mut out: Vec<NicInfo> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let base = format!("sys/class/net/{name}");
            // Physical NICs have a device; lo, bridges and veths do not.
            if !root.join(&base).join("device").exists() {
                return None;
            }
            Some(NicInfo {
                mac: read(root, &format!("{base}/address")),
                link_up: read(root, &format!("{base}/carrier")).map(|c| c == "1"),
                speed_mbps: read(root, &format!("{base}/speed"))
                    .and_then(|s| s.parse::<i64>().ok())
                    .filter(|s| *s > 0),
                name: Some(name),
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(root: &Path, rel: &str, body: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, body).unwrap();
    }

    /// A recorded tree shaped like a QEMU guest's: two virtio disks, a CD-ROM, a loop device,
    /// one virtio NIC and lo.
    #[test]
    fn a_qemu_guest_is_inspected() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        put(
            root,
            "proc/cpuinfo",
            "processor\t: 0\nmodel name\t: QEMU Virtual CPU version 2.5+\n\nprocessor\t: 1\nmodel name\t: QEMU Virtual CPU version 2.5+\n",
        );
        put(
            root,
            "proc/meminfo",
            "MemTotal:        2030092 kB\nMemFree: 1 kB\n",
        );
        let devices = root.join("sys/devices/pci0000:00/0000:00:04.0/virtio1/block/vda");
        fs::create_dir_all(&devices).unwrap();
        put(
            root,
            "sys/devices/pci0000:00/0000:00:04.0/virtio1/block/vda/size",
            "16777216\n",
        );
        put(
            root,
            "sys/devices/pci0000:00/0000:00:04.0/virtio1/block/vda/serial",
            "LAB-DISK-0\n",
        );
        put(
            root,
            "sys/devices/pci0000:00/0000:00:04.0/virtio1/block/vda/queue/rotational",
            "1\n",
        );
        fs::create_dir_all(root.join("sys/block")).unwrap();
        std::os::unix::fs::symlink(
            "../devices/pci0000:00/0000:00:04.0/virtio1/block/vda",
            root.join("sys/block/vda"),
        )
        .unwrap();
        put(root, "sys/block/vdb/size", "2097152\n");
        put(root, "sys/block/vdb/wwid", "naa.5000c500a0b1c2d3\n");
        put(root, "sys/block/vdb/queue/rotational", "0\n");
        put(root, "sys/block/sr0/size", "2048\n");
        put(root, "sys/block/loop0/size", "2048\n");
        put(root, "sys/block/vdc/size", "0\n");
        put(root, "sys/class/net/eth0/address", "52:54:00:12:34:56\n");
        put(root, "sys/class/net/eth0/carrier", "1\n");
        put(root, "sys/class/net/eth0/speed", "-1\n");
        fs::create_dir_all(root.join("sys/class/net/eth0/device")).unwrap();
        put(root, "sys/class/net/lo/address", "00:00:00:00:00:00\n");

        let inv = inspect(root);
        assert_eq!(inv.cpu.as_ref().map(|c| c.count), Some(2));
        assert_eq!(
            inv.cpu.and_then(|c| c.model).as_deref(),
            Some("QEMU Virtual CPU version 2.5+")
        );
        assert_eq!(inv.memory_mib, Some(1982));
        assert_eq!(inv.firmware_mode.as_deref(), Some("BIOS"));
        let names: Vec<_> = inv.disks.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["vda", "vdb"]);
        assert_eq!(inv.disks[0].size_bytes, 8 << 30);
        assert_eq!(inv.disks[0].serial_number.as_deref(), Some("LAB-DISK-0"));
        assert_eq!(inv.disks[0].by_path.as_deref(), Some("pci-0000:00:04.0"));
        assert!(inv.disks[0].rotational);
        assert_eq!(inv.disks[1].wwn.as_deref(), Some("5000c500a0b1c2d3"));
        assert!(!inv.disks[1].rotational);
        assert_eq!(inv.nics.len(), 1);
        assert_eq!(inv.nics[0].mac.as_deref(), Some("52:54:00:12:34:56"));
        assert_eq!(inv.nics[0].link_up, Some(true));
        assert_eq!(inv.nics[0].speed_mbps, None);
    }

    #[test]
    fn an_empty_tree_gives_an_empty_inventory_not_an_error() {
        let t = tempfile::tempdir().unwrap();
        let inv = inspect(t.path());
        assert!(inv.cpu.is_none() && inv.disks.is_empty() && inv.nics.is_empty());
    }

    #[test]
    fn this_machine_can_be_inspected() {
        // The live /proc and /sys of the test machine: at least one CPU and some memory.
        let inv = inspect(Path::new("/"));
        assert!(inv.cpu.is_some_and(|c| c.count >= 1));
        assert!(inv.memory_mib.is_some_and(|m| m > 0));
    }
}

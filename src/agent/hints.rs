//! Which disk receives the image: every root-device hint given must match (Metal3's rule), and
//! among the disks that match, the smallest one wins, so a large data disk is not taken for a
//! small OS by accident. Without hints, disks under 4 GiB are passed over (USB sticks, BMC
//! virtual media), as Ironic does.

use crate::api::metalhost::DiskInfo;
use crate::api::metalmachine::RootDeviceHints;

const GIB: i64 = 1 << 30;
/// Without hints, a root disk has at least this much.
pub const DEFAULT_MIN_BYTES: i64 = 4 * GIB;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HintError {
    #[error("the host has no disks")]
    NoDisks,
    #[error("no disk matches the root device hints ({hints}); disks: {disks}")]
    NoMatch { hints: String, disks: String },
}

/// The disk to write, from the inspected disks.
pub fn choose_root_device<'a>(
    disks: &'a [DiskInfo],
    hints: Option<&RootDeviceHints>,
    image_bytes: Option<u64>,
) -> Result<&'a DiskInfo, HintError> {
    if disks.is_empty() {
        return Err(HintError::NoDisks);
    }
    let default_hints = RootDeviceHints::default();
    let hints = hints.unwrap_or(&default_hints);
    let least = image_bytes.map_or(0, |b| i64::try_from(b).unwrap_or(i64::MAX));
    let unhinted = hints == &default_hints;
    disks
        .iter()
        .filter(|d| matches(d, hints))
        .filter(|d| d.size_bytes >= least)
        .filter(|d| !unhinted || d.size_bytes >= DEFAULT_MIN_BYTES)
        .min_by_key(|d| (d.size_bytes, d.name.clone()))
        .ok_or_else(|| HintError::NoMatch {
            hints: describe(hints, image_bytes),
            disks: disks
                .iter()
                .map(|d| format!("{} {} GiB", d.name, d.size_bytes / GIB))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn matches(d: &DiskInfo, h: &RootDeviceHints) -> bool {
    let name_ok = h
        .device_name
        .as_deref()
        .is_none_or(|want| want.strip_prefix("/dev/").unwrap_or(want) == d.name);
    let same = |want: &Option<String>, have: &Option<String>| {
        want.as_deref()
            .is_none_or(|w| have.as_deref().is_some_and(|h| h.eq_ignore_ascii_case(w)))
    };
    let by_path_ok = h.by_path.as_deref().is_none_or(|want| {
        let want = want.strip_prefix("/dev/disk/by-path/").unwrap_or(want);
        d.by_path.as_deref() == Some(want)
    });
    name_ok
        && same(&h.serial_number, &d.serial_number)
        && same(&h.wwn, &d.wwn)
        && by_path_ok
        && h.rotational.is_none_or(|r| r == d.rotational)
        && h.min_size_gigabytes
            .is_none_or(|g| d.size_bytes >= g.saturating_mul(GIB))
        && h.max_size_gigabytes
            .is_none_or(|g| d.size_bytes <= g.saturating_mul(GIB))
}

fn describe(h: &RootDeviceHints, image_bytes: Option<u64>) -> String {
    let mut parts = Vec::new();
    if let Some(v) = &h.device_name {
        parts.push(format!("deviceName={v}"));
    }
    if let Some(v) = h.min_size_gigabytes {
        parts.push(format!("minSizeGigabytes={v}"));
    }
    if let Some(v) = h.max_size_gigabytes {
        parts.push(format!("maxSizeGigabytes={v}"));
    }
    if let Some(v) = &h.serial_number {
        parts.push(format!("serialNumber={v}"));
    }
    if let Some(v) = &h.wwn {
        parts.push(format!("wwn={v}"));
    }
    if let Some(v) = &h.by_path {
        parts.push(format!("byPath={v}"));
    }
    if let Some(v) = h.rotational {
        parts.push(format!("rotational={v}"));
    }
    if parts.is_empty() {
        parts.push(format!("none: at least {} GiB", DEFAULT_MIN_BYTES / GIB));
    }
    if let Some(b) = image_bytes {
        parts.push(format!("image {b} bytes"));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(name: &str, gib: i64, serial: &str, rotational: bool) -> DiskInfo {
        DiskInfo {
            name: name.into(),
            size_bytes: gib * GIB,
            serial_number: Some(serial.into()),
            wwn: Some(format!("0x5000{serial}")),
            by_path: Some(format!("pci-0000:00:0{}.0", name.len())),
            rotational,
            model: None,
        }
    }

    fn disks() -> Vec<DiskInfo> {
        vec![
            disk("sda", 4000, "S1", true),
            disk("sdb", 480, "S2", false),
            disk("nvme0n1", 960, "S3", false),
            disk("sdc", 1, "USB", false),
        ]
    }

    /// One row per hint rule.
    #[test]
    fn hints_choose_the_disk() {
        let d = disks();
        let h = |f: fn(&mut RootDeviceHints)| {
            let mut h = RootDeviceHints::default();
            f(&mut h);
            h
        };
        type Row<'a> = (&'a str, RootDeviceHints, Option<u64>, Result<&'a str, ()>);
        let rows: Vec<Row> = vec![
            (
                "no hints: the smallest disk of 4 GiB or more",
                h(|_| {}),
                None,
                Ok("sdb"),
            ),
            (
                "no hints, a large image",
                h(|_| {}),
                Some(500 * GIB as u64),
                Ok("nvme0n1"),
            ),
            (
                "device name with /dev/",
                h(|h| h.device_name = Some("/dev/sda".into())),
                None,
                Ok("sda"),
            ),
            (
                "device name, a small disk is fine when named",
                h(|h| h.device_name = Some("sdc".into())),
                None,
                Ok("sdc"),
            ),
            (
                "serial",
                h(|h| h.serial_number = Some("s3".into())),
                None,
                Ok("nvme0n1"),
            ),
            (
                "wwn",
                h(|h| h.wwn = Some("0x5000S1".into())),
                None,
                Ok("sda"),
            ),
            (
                "by-path with prefix",
                h(|h| h.by_path = Some("/dev/disk/by-path/pci-0000:00:07.0".into())),
                None,
                Ok("nvme0n1"),
            ),
            (
                "rotational",
                h(|h| h.rotational = Some(true)),
                None,
                Ok("sda"),
            ),
            (
                "size range",
                h(|h| {
                    h.min_size_gigabytes = Some(500);
                    h.max_size_gigabytes = Some(1000)
                }),
                None,
                Ok("nvme0n1"),
            ),
            (
                "all hints must match",
                h(|h| {
                    h.serial_number = Some("S1".into());
                    h.rotational = Some(false)
                }),
                None,
                Err(()),
            ),
            (
                "nothing that large",
                h(|h| h.min_size_gigabytes = Some(8000)),
                None,
                Err(()),
            ),
            (
                "image larger than the named disk",
                h(|h| h.device_name = Some("sdc".into())),
                Some(2 * GIB as u64),
                Err(()),
            ),
        ];
        for (row, hints, image, want) in rows {
            let got = choose_root_device(&d, Some(&hints), image).map(|d| d.name.as_str());
            match want {
                Ok(name) => assert_eq!(got, Ok(name), "{row}"),
                Err(()) => assert!(
                    matches!(got, Err(HintError::NoMatch { .. })),
                    "{row}: {got:?}"
                ),
            }
        }
        assert_eq!(choose_root_device(&[], None, None), Err(HintError::NoDisks));
    }

    #[test]
    fn a_refusal_names_the_hints_and_the_disks() {
        let hints = RootDeviceHints {
            serial_number: Some("NOPE".into()),
            ..Default::default()
        };
        let e = choose_root_device(&disks(), Some(&hints), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("serialNumber=NOPE") && e.contains("sda 4000 GiB"),
            "{e}"
        );
    }
}

//! Cleaning a disk on release, so the next tenant never sees the previous one's data. The
//! default erases what makes data findable: the partition tables at both ends of the disk and the
//! first megabyte of every partition (filesystem, LVM, RAID and LUKS signatures live there, as
//! `wipefs` knows). `Full` zeroes every byte, for operators who need it.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};

const MIB: u64 = 1 << 20;

/// How much to erase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WipeMode {
    Metadata,
    Full,
}

/// What was erased.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Wiped {
    /// Byte ranges zeroed, as (offset, length).
    pub ranges: Vec<(u64, u64)>,
    pub bytes: u64,
}

/// Wipes `disk`.
pub fn wipe(disk: &mut File, mode: WipeMode) -> io::Result<Wiped> {
    let size = disk.seek(SeekFrom::End(0))?;
    let mut ranges = match mode {
        WipeMode::Full => vec![(0, size)],
        WipeMode::Metadata => {
            let mut r = vec![
                (0, MIB.min(size)),
                (size.saturating_sub(MIB), MIB.min(size)),
            ];
            // Partition starts, from whichever GPT header is readable (ignored when none is).
            if let Ok(table) = gpt::GptConfig::new()
                .writable(false)
                .open_from_device(&mut *disk)
            {
                for p in table.partitions().values().filter(|p| p.is_used()) {
                    let start = p.first_lba.saturating_mul(512);
                    if start < size {
                        r.push((start, MIB.min(size - start)));
                    }
                }
            }
            r
        }
    };
    ranges.sort();
    ranges.dedup();
    let zeros = vec![0u8; (4 * MIB) as usize];
    let mut bytes = 0;
    for &(offset, len) in &ranges {
        disk.seek(SeekFrom::Start(offset))?;
        let mut left = len;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            disk.write_all(&zeros[..n])?;
            left -= n as u64;
            bytes += n as u64;
        }
    }
    disk.sync_all()?;
    Ok(Wiped { ranges, bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn disk_with_data() -> (tempfile::NamedTempFile, File) {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut file = f.reopen().unwrap();
        file.write_all(&vec![0xAA; 64 << 20]).unwrap();
        let mut gpt = gpt::GptConfig::new()
            .writable(true)
            .change_partition_count(true)
            .create_from_device(&mut file, None)
            .unwrap();
        gpt.add_partition(
            "root",
            32 << 20,
            gpt::partition_types::LINUX_FS,
            0,
            Some(2048),
        )
        .unwrap();
        gpt.write_inplace().unwrap();
        drop(gpt);
        (f, file)
    }

    fn at(file: &mut File, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0; len];
        file.seek(SeekFrom::Start(offset)).unwrap();
        file.read_exact(&mut buf).unwrap();
        buf
    }

    #[test]
    fn metadata_wipe_erases_tables_and_partition_heads_only() {
        let (_f, mut disk) = disk_with_data();
        let w = wipe(&mut disk, WipeMode::Metadata).unwrap();
        assert!(at(&mut disk, 0, 1 << 20).iter().all(|b| *b == 0), "head");
        assert!(
            at(&mut disk, (64 << 20) - (1 << 20), 1 << 20)
                .iter()
                .all(|b| *b == 0),
            "tail"
        );
        // The partition starts at 1 MiB: its first megabyte is gone, data after it stays.
        assert!(
            at(&mut disk, 1 << 20, 1 << 20).iter().all(|b| *b == 0),
            "partition head"
        );
        assert!(
            at(&mut disk, 8 << 20, 4096).iter().all(|b| *b == 0xAA),
            "data untouched"
        );
        assert_eq!(w.bytes, 3 << 20);
        assert!(
            gpt::GptConfig::new().open_from_device(&mut disk).is_err(),
            "no table left"
        );
    }

    #[test]
    fn full_wipe_zeroes_everything() {
        let (_f, mut disk) = disk_with_data();
        let w = wipe(&mut disk, WipeMode::Full).unwrap();
        assert_eq!(w.bytes, 64 << 20);
        assert!(at(&mut disk, 0, 64 << 20).iter().all(|b| *b == 0));
    }
}

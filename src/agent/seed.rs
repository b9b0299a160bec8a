//! The NoCloud seed the deploy agent leaves on a disk it wrote: a small FAT partition labelled
//! `CIDATA` (cloud-init's NoCloud looks for that label) whose meta-data names the instance and
//! points back at the boot service with `seedfrom`. The user-data stays behind the per-attempt
//! token: the disk holds only a URL whose token dies at the callback, never the bootstrap data.
//!
//! An image is usually smaller than the disk it is written to, so its GPT's backup header sits
//! in the middle of the disk. The table is rebuilt for the whole disk (the partitions kept as
//! they are), the seed partition is added in the last free megabytes, and the protective MBR's
//! partition record is updated in place so a BIOS boot loader in its boot code survives.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};

use gpt::GptConfig;
use gpt::disk::LogicalBlockSize;
use gpt::mbr::{PartRecord, ProtectiveMBR};

/// Size of the seed partition: room for the three small documents and FAT's own tables.
pub const SEED_BYTES: u64 = 4 * 1024 * 1024;
/// GPT partition name of the seed; a re-provisioning reuses a partition so named.
pub const SEED_PARTITION_NAME: &str = "cidata";
const SECTOR: u64 = 512;
/// Partitions start on 1 MiB boundaries, as every partitioning tool does.
const ALIGN_SECTORS: u64 = 2048;

#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    #[error("the written image has no GPT partition table ({0}); metalboot seeds GPT images only")]
    NotGpt(String),
    #[error("no {needed} bytes free at the end of the disk for the NoCloud seed")]
    NoRoom { needed: u64 },
    #[error("rewriting the partition table: {0}")]
    Table(String),
    #[error("writing the seed filesystem: {0}")]
    Filesystem(#[from] io::Error),
}

/// What goes into the seed's meta-data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub instance_id: String,
    pub hostname: String,
    /// The boot service's NoCloud URL for this attempt, ending in `/`.
    pub seedfrom: String,
}

impl Seed {
    /// meta-data as YAML. Values are quoted as JSON strings (valid YAML) so no value can
    /// add a key of its own.
    pub fn meta_data(&self) -> String {
        let q = |s: &str| serde_json::Value::String(s.to_string()).to_string();
        format!(
            "instance-id: {}\nlocal-hostname: {}\nseedfrom: {}\n",
            q(&self.instance_id),
            q(&self.hostname),
            q(&self.seedfrom)
        )
    }
}

/// Where the seed landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeedPlacement {
    pub partition: u32,
    pub first_lba: u64,
    pub sectors: u64,
}

/// Adds (or reuses) the seed partition on `disk` and writes the seed into it.
pub fn write_seed(disk: &mut File, seed: &Seed) -> Result<SeedPlacement, SeedError> {
    let placement = place_partition(disk)?;
    let mut window = Window::new(
        disk,
        placement.first_lba * SECTOR,
        placement.sectors * SECTOR,
    );
    fatfs::format_volume(
        &mut window,
        fatfs::FormatVolumeOptions::new().volume_label(*b"CIDATA     "),
    )?;
    window.seek(SeekFrom::Start(0))?;
    let fs = fatfs::FileSystem::new(&mut window, fatfs::FsOptions::new())?;
    let root = fs.root_dir();
    for (name, body) in [
        ("meta-data", seed.meta_data()),
        // NoCloud requires a user-data file beside meta-data; the real one comes from seedfrom.
        ("user-data", String::new()),
    ] {
        let mut file = root.create_file(name)?;
        file.truncate()?;
        file.write_all(body.as_bytes())?;
        file.flush()?;
    }
    drop(root);
    fs.unmount()?;
    disk.sync_all()?;
    Ok(placement)
}

fn place_partition(disk: &mut File) -> Result<SeedPlacement, SeedError> {
    let lb = LogicalBlockSize::Lb512;
    let existing = GptConfig::new()
        .writable(false)
        .logical_block_size(lb)
        .open_from_device(&mut *disk)
        .map_err(|e| SeedError::NotGpt(e.to_string()))?;
    let guid = *existing.guid();
    let mut partitions: BTreeMap<u32, gpt::partition::Partition> = existing
        .partitions()
        .iter()
        .filter(|(_, p)| p.is_used())
        .map(|(id, p)| (*id, p.clone()))
        .collect();
    drop(existing);
    let reused = partitions
        .iter()
        .find(|(_, p)| p.name == SEED_PARTITION_NAME)
        .map(|(id, _)| *id);
    // A new table for the whole disk: headers at its real start and end.
    let mut table = GptConfig::new()
        .writable(true)
        .logical_block_size(lb)
        .change_partition_count(true)
        .create_from_device(&mut *disk, Some(guid))
        .map_err(|e| SeedError::Table(e.to_string()))?;
    let placement = match reused {
        Some(id) => {
            let p = &partitions[&id];
            SeedPlacement {
                partition: id,
                first_lba: p.first_lba,
                sectors: p.last_lba + 1 - p.first_lba,
            }
        }
        None => {
            table
                .update_partitions(partitions.clone())
                .map_err(|e| SeedError::Table(e.to_string()))?;
            let last_usable = table.header().last_usable;
            let used_end = partitions.values().map(|p| p.last_lba).max().unwrap_or(0);
            let sectors = SEED_BYTES / SECTOR;
            let first_lba = (last_usable + 1)
                .checked_sub(sectors)
                .map(|lba| lba / ALIGN_SECTORS * ALIGN_SECTORS)
                .filter(|lba| *lba > used_end)
                .ok_or(SeedError::NoRoom { needed: SEED_BYTES })?;
            let id = (1..=128u32)
                .find(|id| !partitions.contains_key(id))
                .ok_or_else(|| SeedError::Table("no free partition slot".into()))?;
            partitions.insert(
                id,
                gpt::partition::Partition {
                    part_type_guid: gpt::partition_types::BASIC,
                    part_guid: uuid::Uuid::new_v4(),
                    first_lba,
                    last_lba: first_lba + sectors - 1,
                    flags: 0,
                    name: SEED_PARTITION_NAME.to_string(),
                },
            );
            SeedPlacement {
                partition: id,
                first_lba,
                sectors,
            }
        }
    };
    table
        .update_partitions(partitions)
        .map_err(|e| SeedError::Table(e.to_string()))?;
    table
        .write_inplace()
        .map_err(|e| SeedError::Table(e.to_string()))?;
    drop(table);
    // The protective MBR's record covers the whole disk now; its boot code stays.
    let disk_sectors = disk.seek(SeekFrom::End(0))? / SECTOR;
    let mut mbr =
        ProtectiveMBR::from_disk(&mut *disk, lb).unwrap_or_else(|_| ProtectiveMBR::with_lb_size(0));
    let size = u32::try_from(disk_sectors.saturating_sub(1)).unwrap_or(u32::MAX);
    mbr.set_partition(0, PartRecord::new_protective(Some(size)));
    mbr.update_conservative(&mut *disk)
        .map_err(|e| SeedError::Table(e.to_string()))?;
    Ok(placement)
}

/// A byte range of a file seen as a whole device, for the FAT formatter.
struct Window<'a> {
    file: &'a mut File,
    start: u64,
    len: u64,
    pos: u64,
}

impl<'a> Window<'a> {
    fn new(file: &'a mut File, start: u64, len: u64) -> Self {
        Window {
            file,
            start,
            len,
            pos: 0,
        }
    }
    fn room(&self, want: usize) -> usize {
        want.min(self.len.saturating_sub(self.pos) as usize)
    }
}

impl Read for Window<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.room(buf.len());
        self.file.seek(SeekFrom::Start(self.start + self.pos))?;
        let n = self.file.read(&mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Write for Window<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.room(buf.len());
        if n == 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "past the end of the seed partition",
            ));
        }
        self.file.seek(SeekFrom::Start(self.start + self.pos))?;
        let n = self.file.write(&buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Seek for Window<'_> {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let target = match to {
            SeekFrom::Start(n) => Some(n),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        match target {
            Some(t) if t <= self.len => {
                self.pos = t;
                Ok(t)
            }
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "seek outside the seed partition",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed() -> Seed {
        Seed {
            instance_id: "i-1".into(),
            hostname: "host-0".into(),
            seedfrom: "http://10.0.2.2:8080/nocloud/abc/".into(),
        }
    }

    /// A 64 MiB "image" with one partition, written to a 256 MiB "disk" (sgdisk's view of the
    /// result is checked too when sgdisk is installed).
    fn image_on_bigger_disk() -> (tempfile::NamedTempFile, File) {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut file = f.reopen().unwrap();
        file.set_len(64 << 20).unwrap();
        let mut gpt = GptConfig::new()
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
        ProtectiveMBR::with_lb_size(((64u64 << 20) / 512 - 1) as u32)
            .overwrite_lba0(&mut file)
            .unwrap();
        // Boot code a BIOS loader would have put there.
        file.seek(SeekFrom::Start(0)).unwrap();
        file.write_all(&[0xEB; 64]).unwrap();
        file.set_len(256 << 20).unwrap();
        (f, file)
    }

    #[test]
    fn the_seed_lands_at_the_end_of_the_disk_and_keeps_the_partitions_and_boot_code() {
        let (f, mut disk) = image_on_bigger_disk();
        let placed = write_seed(&mut disk, &seed()).unwrap();
        // gdisk's own verifier, where it is installed, agrees the table is sound.
        if let Ok(out) = std::process::Command::new("sgdisk")
            .arg("-v")
            .arg(f.path())
            .output()
        {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(text.contains("No problems found"), "sgdisk -v: {text}");
        }
        assert_eq!(placed.sectors * 512, SEED_BYTES);
        assert!(placed.first_lba * 512 > 200 << 20, "{placed:?}");
        let table = GptConfig::new().open_from_device(&mut disk).unwrap();
        let names: Vec<_> = table
            .partitions()
            .values()
            .map(|p| p.name.clone())
            .collect();
        assert_eq!(names, ["root", "cidata"]);
        assert_eq!(table.header().backup_lba, (256u64 << 20) / 512 - 1);
        drop(table);
        let mut boot = [0u8; 64];
        disk.seek(SeekFrom::Start(0)).unwrap();
        disk.read_exact(&mut boot).unwrap();
        assert_eq!(boot, [0xEB; 64], "the MBR boot code is kept");

        let mut window = Window::new(&mut disk, placed.first_lba * 512, SEED_BYTES);
        let fs = fatfs::FileSystem::new(&mut window, fatfs::FsOptions::new()).unwrap();
        assert_eq!(fs.volume_label().trim(), "CIDATA");
        let mut text = String::new();
        fs.root_dir()
            .open_file("meta-data")
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        let parsed: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
        assert_eq!(parsed["seedfrom"], "http://10.0.2.2:8080/nocloud/abc/");
        assert_eq!(parsed["instance-id"], "i-1");
        assert!(fs.root_dir().open_file("user-data").is_ok());
    }

    #[test]
    fn seeding_twice_reuses_the_partition() {
        let (_f, mut disk) = image_on_bigger_disk();
        let first = write_seed(&mut disk, &seed()).unwrap();
        let second = write_seed(&mut disk, &seed()).unwrap();
        assert_eq!(first, second);
    }

    #[test]
    fn a_disk_without_gpt_or_room_is_refused() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut blank = f.reopen().unwrap();
        blank.set_len(8 << 20).unwrap();
        assert!(matches!(
            write_seed(&mut blank, &seed()),
            Err(SeedError::NotGpt(_))
        ));
        // A full disk: the image's partition reaches its end.
        let f = tempfile::NamedTempFile::new().unwrap();
        let mut full = f.reopen().unwrap();
        full.set_len(16 << 20).unwrap();
        let mut gpt = GptConfig::new()
            .writable(true)
            .change_partition_count(true)
            .create_from_device(&mut full, None)
            .unwrap();
        let free = gpt.find_free_sectors();
        let (start, len) = free[0];
        gpt.add_partition_at("root", 1, start, len, gpt::partition_types::LINUX_FS, 0)
            .unwrap();
        gpt.write_inplace().unwrap();
        drop(gpt);
        assert!(matches!(
            write_seed(&mut full, &seed()),
            Err(SeedError::NoRoom { .. })
        ));
    }

    #[test]
    fn meta_data_values_cannot_add_keys() {
        let hostile = Seed {
            instance_id: "x\nseedfrom: http://evil/".into(),
            ..seed()
        };
        let parsed: serde_yaml::Value = serde_yaml::from_str(&hostile.meta_data()).unwrap();
        assert_eq!(parsed["seedfrom"], "http://10.0.2.2:8080/nocloud/abc/");
    }
}

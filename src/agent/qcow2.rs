//! Streams a qcow2 image onto a disk in one front-to-back pass, as the network delivers it, with
//! no temporary copy. qcow2 is random access: its tables say where each guest cluster's bytes are
//! in the file. One pass suffices when every table comes before the clusters it maps, or not far
//! after them: the last [`LOOKBACK`] bytes read are kept. That is how `qemu-img convert` writes:
//! header, L1 table, then each L2 table before its data clusters, except that with `-c` it writes
//! the first compressed cluster or two of a region just before allocating the region's L2 table
//! (the lab's Debian image has them up to 100 KiB before). An image laid out otherwise is refused
//! with that reason, never guessed at. Unallocated and zero clusters are written as zeros, so nothing of the disk's earlier
//! contents shows through. Backing files, encryption, external data files, extended L2 entries
//! and non-zlib compression are refused.
//!
//! Every cost is bounded by the image's virtual size, which must fit the disk: each guest
//! cluster is written at most once per L2 entry that maps it, buffers hold at most one cluster
//! (2 MiB at most) plus a read block, and the L1 table is capped.

use std::collections::BTreeMap;
use std::io::{self, Read, Seek, SeekFrom, Write};

use super::image::{BLOCK, ImageError, Progress};

const MAGIC: &[u8; 4] = b"QFI\xfb";
const MIN_CLUSTER_BITS: u32 = 9;
const MAX_CLUSTER_BITS: u32 = 21;
/// L1 entries read into memory at most (16 MiB of table: far beyond any disk with 64 KiB
/// clusters, each entry covering 512 MiB).
const MAX_L1_ENTRIES: u64 = 1 << 21;
/// Bytes kept behind the read position, for clusters written shortly before the table that maps
/// them.
const LOOKBACK: u64 = 8 << 20;
/// Tables and clusters known but not reached yet, at most; a table-first image keeps a handful.
const MAX_PENDING: usize = 1 << 22;
/// Host offset bits of L1 and standard L2 entries (bits 9–55).
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
const COMPRESSED: u64 = 1 << 62;
/// Standard L2 entry of a cluster that reads as zeros (qcow2 v3).
const ZERO: u64 = 1;
/// Incompatible feature bit 0: refcounts may be stale. They are not read here, so it is harmless.
const DIRTY: u64 = 1;

/// What a range of the file holds, known from the header or a table read earlier.
#[derive(Debug, Clone, Copy)]
enum Need {
    L1,
    L2 { guest_base: u64 },
    Data { guest: u64 },
    Compressed { guest: u64, len: usize },
}

fn corrupt(message: impl Into<String>) -> ImageError {
    ImageError::Corrupt {
        format: "qcow2",
        message: message.into(),
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(x)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// The part of the header a one-pass reader needs, checked.
#[derive(Debug)]
struct Header {
    cluster_bits: u32,
    size: u64,
    l1_entries: u64,
    l1_offset: u64,
}

fn parse_header(b: &[u8], disk_size: u64) -> Result<Header, ImageError> {
    if b.len() < 72 || &b[..4] != MAGIC {
        return Err(corrupt("no qcow2 magic"));
    }
    let version = be32(b, 4);
    if !(2..=3).contains(&version) {
        return Err(corrupt(format!("version {version} (2 and 3 are known)")));
    }
    if be64(b, 8) != 0 {
        return Err(corrupt(
            "it has a backing file; write a self-contained image",
        ));
    }
    let cluster_bits = be32(b, 20);
    if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
        return Err(corrupt(format!("cluster_bits {cluster_bits}")));
    }
    let size = be64(b, 24);
    if be32(b, 32) != 0 {
        return Err(corrupt("it is encrypted"));
    }
    if version == 3 {
        if b.len() < 104 {
            return Err(corrupt("version 3 header shorter than 104 bytes"));
        }
        let incompatible = be64(b, 72) & !DIRTY;
        if incompatible != 0 {
            return Err(corrupt(format!(
                "incompatible features {incompatible:#x} (external data file, extended L2 entries or non-zlib compression)"
            )));
        }
    }
    if size > disk_size {
        return Err(ImageError::TooLarge {
            image: size,
            disk: disk_size,
        });
    }
    let l1_entries = u64::from(be32(b, 36));
    if l1_entries > MAX_L1_ENTRIES {
        return Err(corrupt(format!("an L1 table of {l1_entries} entries")));
    }
    let l1_offset = be64(b, 40);
    if l1_entries > 0 && (l1_offset == 0 || !l1_offset.is_multiple_of(1 << cluster_bits)) {
        return Err(corrupt(format!("L1 table offset {l1_offset}")));
    }
    Ok(Header {
        cluster_bits,
        size,
        l1_entries,
        l1_offset,
    })
}

/// The image as a forward-only window: bytes before `start` are gone for good.
struct Window<'a> {
    reader: &'a mut dyn Read,
    start: u64,
    bytes: Vec<u8>,
}

impl Window<'_> {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }

    /// Reads (and so hashes) up to `offset`, keeping only the [`LOOKBACK`] bytes before it.
    fn advance(&mut self, offset: u64) -> Result<(), ImageError> {
        let keep_from = offset.saturating_sub(LOOKBACK);
        if keep_from >= self.end() {
            self.start = self.end();
            self.bytes.clear();
            let mut sink = vec![0u8; BLOCK];
            while self.start < keep_from {
                let want = (keep_from - self.start).min(BLOCK as u64) as usize;
                let n = read_some(self.reader, &mut sink[..want])?;
                if n == 0 {
                    return Err(self.ended_before(offset));
                }
                self.start += n as u64;
            }
        } else if keep_from > self.start {
            self.bytes.drain(..(keep_from - self.start) as usize);
            self.start = keep_from;
        }
        while self.end() < offset {
            let want = ((offset - self.end()) as usize).min(BLOCK);
            let at = self.bytes.len();
            self.bytes.resize(at + want, 0);
            let n = read_some(self.reader, &mut self.bytes[at..])?;
            self.bytes.truncate(at + n);
            if n == 0 {
                return Err(self.ended_before(offset));
            }
        }
        Ok(())
    }

    fn ended_before(&self, offset: u64) -> ImageError {
        ImageError::Source(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "the qcow2 image ends at byte {} before byte {offset} its tables point at",
                self.end()
            ),
        ))
    }

    /// `len` bytes from `offset` (which the window must still hold); with `short_ok`, fewer when
    /// the image ends first (a compressed cluster's length is an upper bound).
    fn take(&mut self, offset: u64, len: usize, short_ok: bool) -> Result<&[u8], ImageError> {
        if offset < self.start {
            return Err(corrupt(format!(
                "a table maps byte {offset}, more than {} MiB before the table itself: the image is not laid out for streaming (re-convert it with `qemu-img convert -O qcow2`)",
                LOOKBACK >> 20
            )));
        }
        let end = offset + len as u64;
        while self.end() < end {
            let want = ((end - self.end()) as usize).min(BLOCK);
            let at = self.bytes.len();
            self.bytes.resize(at + want, 0);
            let n = read_some(self.reader, &mut self.bytes[at..])?;
            self.bytes.truncate(at + n);
            if n == 0 {
                break;
            }
        }
        // An offset past the image's end (a hostile table) gives nothing, never a bad slice.
        let from = ((offset - self.start) as usize).min(self.bytes.len());
        let have = (self.bytes.len() - from).min(len);
        if have < len && !short_ok {
            return Err(ImageError::Source(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("the qcow2 image ends inside the {len} bytes at {offset}"),
            )));
        }
        Ok(&self.bytes[from..from + have])
    }
}

fn read_some(r: &mut dyn Read, buf: &mut [u8]) -> Result<usize, ImageError> {
    loop {
        match r.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => return other.map_err(ImageError::Source),
        }
    }
}

/// Streams the qcow2 image read from `reader` onto `disk`; returns the bytes written (the
/// image's virtual size). Reads the image to its end, so a digest taken by `reader` covers it.
pub fn write<W: Write + Seek>(
    reader: &mut dyn Read,
    disk: &mut W,
    disk_size: u64,
    progress: &mut dyn FnMut(Progress),
) -> Result<u64, ImageError> {
    let mut window = Window {
        reader,
        start: 0,
        bytes: Vec::new(),
    };
    let header = {
        let first = window.take(0, 104, true)?.to_vec();
        parse_header(&first, disk_size)?
    };
    let cluster = 1u64 << header.cluster_bits;
    let entries_per_l2 = cluster / 8;
    let clusters = header.size.div_ceil(cluster);
    let mut written_clusters = vec![0u64; clusters.div_ceil(64) as usize];
    let mut pending: BTreeMap<u64, Vec<Need>> = BTreeMap::new();
    let mut pending_count = 0usize;
    let mut add = |pending: &mut BTreeMap<u64, Vec<Need>>,
                   window_start: u64,
                   offset: u64,
                   need: Need|
     -> Result<(), ImageError> {
        if offset < window_start {
            return Err(corrupt(format!(
                "a table maps byte {offset}, more than {} MiB before the table itself: the image is not laid out for streaming (re-convert it with `qemu-img convert -O qcow2`)",
                LOOKBACK >> 20
            )));
        }
        pending_count += 1;
        if pending_count > MAX_PENDING {
            return Err(corrupt("too many clusters mapped ahead of their data"));
        }
        pending.entry(offset).or_default().push(need);
        Ok(())
    };
    if header.l1_entries > 0 {
        add(&mut pending, 0, header.l1_offset, Need::L1)?;
    }
    let mut written = 0u64;
    let mut reported = 0u64;
    let mut inflated = vec![0u8; cluster as usize];
    while let Some((offset, needs)) = pending.pop_first() {
        window.advance(offset)?;
        for need in needs {
            match need {
                Need::L1 => {
                    let table = window
                        .take(offset, (header.l1_entries * 8) as usize, false)?
                        .to_vec();
                    for (i, entry) in table.chunks_exact(8).enumerate() {
                        let l2 = be64(entry, 0) & OFFSET_MASK;
                        if l2 == 0 {
                            continue;
                        }
                        if !l2.is_multiple_of(cluster) {
                            return Err(corrupt(format!("L2 table offset {l2} is not aligned")));
                        }
                        let guest_base = i as u64 * entries_per_l2 * cluster;
                        add(&mut pending, window.start, l2, Need::L2 { guest_base })?;
                    }
                }
                Need::L2 { guest_base } => {
                    let table = window.take(offset, cluster as usize, false)?.to_vec();
                    for (j, entry) in table.chunks_exact(8).enumerate() {
                        let e = be64(entry, 0);
                        let guest = guest_base + j as u64 * cluster;
                        if e & !(1 << 63) == 0 {
                            continue;
                        }
                        if guest >= header.size {
                            return Err(corrupt(format!(
                                "a cluster mapped at guest byte {guest}, past the virtual size {}",
                                header.size
                            )));
                        }
                        if e & COMPRESSED != 0 {
                            // Bits 0..x: byte offset; x..62: extra 512-byte sectors.
                            let x = 62 - (header.cluster_bits - 8);
                            let host = e & ((1u64 << x) - 1);
                            let sectors = (e >> x) & ((1u64 << (header.cluster_bits - 8)) - 1);
                            let len = ((sectors + 1) * 512 - (host & 511)) as usize;
                            add(
                                &mut pending,
                                window.start,
                                host,
                                Need::Compressed { guest, len },
                            )?;
                        } else if e & ZERO == 0 {
                            let host = e & OFFSET_MASK;
                            if host == 0 {
                                continue;
                            }
                            if !host.is_multiple_of(cluster) {
                                return Err(corrupt(format!(
                                    "data cluster offset {host} is not aligned"
                                )));
                            }
                            add(&mut pending, window.start, host, Need::Data { guest })?;
                        }
                    }
                }
                Need::Data { guest } => {
                    let len = cluster.min(header.size - guest) as usize;
                    let bytes = window.take(offset, len, false)?;
                    disk.seek(SeekFrom::Start(guest))
                        .map_err(ImageError::Disk)?;
                    disk.write_all(bytes).map_err(ImageError::Disk)?;
                    mark(&mut written_clusters, guest / cluster);
                    written += len as u64;
                }
                Need::Compressed { guest, len } => {
                    let bytes = window.take(offset, len, true)?;
                    let out = cluster.min(header.size - guest) as usize;
                    let mut inflate = flate2::Decompress::new(false);
                    inflate
                        .decompress(bytes, &mut inflated[..out], flate2::FlushDecompress::Finish)
                        .map_err(|e| corrupt(format!("compressed cluster at {offset}: {e}")))?;
                    if (inflate.total_out() as usize) < out {
                        return Err(corrupt(format!(
                            "compressed cluster at {offset} inflates to {} of {out} bytes",
                            inflate.total_out()
                        )));
                    }
                    disk.seek(SeekFrom::Start(guest))
                        .map_err(ImageError::Disk)?;
                    disk.write_all(&inflated[..out]).map_err(ImageError::Disk)?;
                    mark(&mut written_clusters, guest / cluster);
                    written += out as u64;
                }
            }
            if written >= reported + BLOCK as u64 {
                reported = written;
                progress(Progress { read: 0, written });
            }
        }
    }
    // The rest of the image (refcounts, snapshots' tables) is read for the digest only.
    let end = u64::MAX;
    match window.advance(end) {
        Ok(()) => {}
        Err(ImageError::Source(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {}
        Err(e) => return Err(e),
    }
    // Clusters the image does not store read as zeros.
    let zeros = vec![0u8; BLOCK];
    let mut c = 0u64;
    while c < clusters {
        if is_marked(&written_clusters, c) {
            c += 1;
            continue;
        }
        let run_start = c;
        while c < clusters && !is_marked(&written_clusters, c) {
            c += 1;
        }
        let (from, to) = (run_start * cluster, (c * cluster).min(header.size));
        disk.seek(SeekFrom::Start(from)).map_err(ImageError::Disk)?;
        let mut at = from;
        while at < to {
            let n = (to - at).min(BLOCK as u64) as usize;
            disk.write_all(&zeros[..n]).map_err(ImageError::Disk)?;
            at += n as u64;
            written += n as u64;
            if written >= reported + BLOCK as u64 {
                reported = written;
                progress(Progress { read: 0, written });
            }
        }
    }
    progress(Progress { read: 0, written });
    Ok(written)
}

fn mark(bits: &mut [u64], i: u64) {
    if let Some(word) = bits.get_mut((i / 64) as usize) {
        *word |= 1 << (i % 64);
    }
}

fn is_marked(bits: &[u64], i: u64) -> bool {
    bits.get((i / 64) as usize)
        .is_some_and(|w| w & (1 << (i % 64)) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use std::process::Command;

    /// A qcow2 v2 image laid out by hand: the header, the L1 table at `l1_offset`, and `blobs`.
    fn handmade(
        cluster_bits: u32,
        size: u64,
        l1_offset: u64,
        l1: &[u64],
        blobs: &[(u64, Vec<u8>)],
    ) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(MAGIC);
        f.extend_from_slice(&2u32.to_be_bytes());
        f.extend_from_slice(&0u64.to_be_bytes());
        f.extend_from_slice(&0u32.to_be_bytes());
        f.extend_from_slice(&cluster_bits.to_be_bytes());
        f.extend_from_slice(&size.to_be_bytes());
        f.extend_from_slice(&0u32.to_be_bytes());
        f.extend_from_slice(&(l1.len() as u32).to_be_bytes());
        f.extend_from_slice(&l1_offset.to_be_bytes());
        f.resize(72, 0);
        let mut put = |at: u64, bytes: &[u8]| {
            let end = at as usize + bytes.len();
            if f.len() < end {
                f.resize(end, 0);
            }
            f[at as usize..end].copy_from_slice(bytes);
        };
        let table: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
        put(l1_offset, &table);
        for (at, bytes) in blobs {
            put(*at, bytes);
        }
        f
    }

    fn l2(entries: &[u64], cluster: usize) -> Vec<u8> {
        let mut t: Vec<u8> = entries.iter().flat_map(|e| e.to_be_bytes()).collect();
        t.resize(cluster, 0);
        t
    }

    fn stream(image: &[u8], disk_size: u64) -> Result<Vec<u8>, ImageError> {
        let mut disk = Cursor::new(vec![0xaa; disk_size as usize]);
        write(&mut &image[..], &mut disk, disk_size, &mut |_| {})?;
        Ok(disk.into_inner())
    }

    #[test]
    fn a_table_first_image_is_written_with_zeros_where_it_stores_nothing() {
        // 512-byte clusters, 4 guest clusters: cluster 0 unallocated, cluster 1 stored, 2 and 3
        // past the L2 entries given. The disk starts full of 0xaa.
        let data = vec![0x5a; 512];
        let img = handmade(
            9,
            2048,
            512,
            &[1024],
            &[(1024, l2(&[0, 1536], 512)), (1536, data.clone())],
        );
        let disk = stream(&img, 4096).expect("written");
        assert!(disk[..512].iter().all(|b| *b == 0), "unallocated: zeros");
        assert_eq!(&disk[512..1024], &data[..]);
        assert!(disk[1024..2048].iter().all(|b| *b == 0));
        assert!(
            disk[2048..].iter().all(|b| *b == 0xaa),
            "past the image: untouched"
        );
    }

    #[test]
    fn a_cluster_shortly_before_its_table_is_written_and_one_far_before_is_refused() {
        // As `qemu-img convert -c` does: the data cluster just before the L2 table mapping it.
        let data = vec![0x5a; 512];
        let near = handmade(
            9,
            1024,
            1024,
            &[1536],
            &[(512, data.clone()), (1536, l2(&[0, 512], 512))],
        );
        let disk = stream(&near, 4096).expect("written");
        assert_eq!(&disk[512..1024], &data[..]);
        assert!(disk[..512].iter().all(|b| *b == 0));
        // The same cluster, but further back than the reader keeps.
        let table = 2048 + LOOKBACK + 4096;
        let far = handmade(
            9,
            1024,
            1024,
            &[table],
            &[(2048, data), (table, l2(&[2048], 512))],
        );
        let Err(e) = stream(&far, 4096) else {
            panic!(
                "a cluster {} MiB before its table was written",
                LOOKBACK >> 20
            );
        };
        assert_eq!(e.reason(), "ImageFormatInvalid");
        assert!(e.to_string().contains("not laid out for streaming"), "{e}");
    }

    #[test]
    fn hostile_headers_are_refused_with_their_reason() {
        let good = handmade(9, 1024, 512, &[0], &[]);
        assert!(stream(&good, 4096).is_ok());
        let mut backing = good.clone();
        backing[8..16].copy_from_slice(&72u64.to_be_bytes());
        assert!(
            stream(&backing, 4096)
                .unwrap_err()
                .to_string()
                .contains("backing file")
        );
        let mut huge_cluster = good.clone();
        huge_cluster[20..24].copy_from_slice(&30u32.to_be_bytes());
        assert_eq!(
            stream(&huge_cluster, 4096).unwrap_err().reason(),
            "ImageFormatInvalid"
        );
        let mut encrypted = good.clone();
        encrypted[32..36].copy_from_slice(&1u32.to_be_bytes());
        assert!(
            stream(&encrypted, 4096)
                .unwrap_err()
                .to_string()
                .contains("encrypted")
        );
        assert_eq!(stream(&good, 512).unwrap_err().reason(), "DiskTooSmall");
        let mut huge_l1 = good.clone();
        huge_l1[36..40].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(
            stream(&huge_l1, 4096).unwrap_err().reason(),
            "ImageFormatInvalid"
        );
        assert_eq!(
            stream(b"not qcow2", 4096).unwrap_err().reason(),
            "ImageFormatInvalid"
        );
        // Truncated inside a table it needs.
        let img = handmade(
            9,
            1024,
            512,
            &[1024],
            &[(1024, l2(&[1536], 512)), (1536, vec![1; 512])],
        );
        let e = stream(&img[..1600], 4096).unwrap_err();
        assert_eq!(e.reason(), "ImageUnreadable", "{e}");
    }

    /// What `qemu-img convert` writes, plain and compressed, streams back to the raw bytes.
    #[test]
    fn qemu_img_images_stream_to_their_raw_bytes() {
        let dir = tempfile::tempdir().expect("tmp");
        let raw = dir.path().join("disk.raw");
        // 8 MiB: data, a hole, more data, a hole at the end; not a multiple of 64 KiB at the end.
        let size = (8 << 20) - 4096;
        let mut bytes = vec![0u8; size];
        for (i, b) in bytes[..(3 << 20)].iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        for (i, b) in bytes[(5 << 20)..(6 << 20) + 100].iter_mut().enumerate() {
            *b = (i % 13) as u8 + 1;
        }
        std::fs::write(&raw, &bytes).expect("raw");
        for (name, args) in [
            ("plain.qcow2", vec![]),
            ("compressed.qcow2", vec!["-c"]),
            ("small-clusters.qcow2", vec!["-o", "cluster_size=4096"]),
            // Several L2 regions of 2 MiB, compressed: qemu-img writes a region's first
            // compressed cluster before its L2 table.
            (
                "compressed-small-clusters.qcow2",
                vec!["-c", "-o", "cluster_size=4096"],
            ),
            ("v2.qcow2", vec!["-o", "compat=0.10"]),
        ] {
            let out = dir.path().join(name);
            let status = Command::new("qemu-img")
                .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
                .args(&args)
                .arg(&raw)
                .arg(&out)
                .status()
                .expect("qemu-img (Debian package qemu-utils)");
            assert!(status.success(), "{name}");
            let image = std::fs::read(&out).expect("qcow2");
            let disk = stream(&image, 16 << 20).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(
                disk[..size] == bytes[..],
                "{name}: the written disk differs from the raw image"
            );
            assert!(
                disk[size..].iter().all(|b| *b == 0xaa),
                "{name}: wrote past the image"
            );
        }
    }
}

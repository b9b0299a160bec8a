//! Streams an OS image onto a disk: read once from the network, checked while it streams
//! (sha256 or sha512 of the bytes as served), decompressed on the way when it is gzip, written
//! in large sequential blocks. No temporary copy exists anywhere, so a host with 2 GiB of RAM can
//! write a 100 GiB image. A checksum that does not match is only known at the end: the caller
//! then wipes what was written, so a bad image never boots.

use std::io::{self, Read, Seek, Write};

use sha2::Digest;

use crate::api::metalmachine::{ChecksumType, ImageFormat};

/// Bytes moved per write: large enough for sequential throughput, small enough for a ramdisk.
pub const BLOCK: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image checksum mismatch: expected {expected}, got {actual}")]
    ChecksumMismatch { expected: String, actual: String },
    #[error("the image ({image} bytes) does not fit the disk ({disk} bytes)")]
    TooLarge { image: u64, disk: u64 },
    #[error("the image ended early or could not be read: {0}")]
    Source(io::Error),
    #[error("the image is not valid {format}: {message}")]
    Corrupt {
        format: &'static str,
        message: String,
    },
    #[error("writing the disk: {0}")]
    Disk(io::Error),
}

impl ImageError {
    /// Condition reason for the MetalMachine.
    pub fn reason(&self) -> &'static str {
        match self {
            ImageError::ChecksumMismatch { .. } => "ImageChecksumMismatch",
            ImageError::TooLarge { .. } => "DiskTooSmall",
            ImageError::Source(_) => "ImageUnreadable",
            ImageError::Corrupt { .. } => "ImageFormatInvalid",
            ImageError::Disk(_) => "DiskWriteFailed",
        }
    }
}

/// How far a write got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Bytes read from the image source (compressed size for gzip).
    pub read: u64,
    /// Bytes written to the disk.
    pub written: u64,
}

enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    fn new(kind: ChecksumType) -> Self {
        match kind {
            ChecksumType::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            ChecksumType::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }
    fn update(&mut self, bytes: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Sha512(h) => h.update(bytes),
        }
    }
    fn hex(self) -> String {
        let bytes = match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Sha512(h) => h.finalize().to_vec(),
        };
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Hashes and counts every byte read through it.
struct Checked<R> {
    inner: R,
    hasher: Option<Hasher>,
    read: u64,
}

impl<R: Read> Read for Checked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(h) = self.hasher.as_mut() {
            h.update(&buf[..n]);
        }
        self.read += n as u64;
        Ok(n)
    }
}

/// What to write and how to check it.
pub struct ImageSource<R> {
    pub reader: R,
    pub format: ImageFormat,
    pub checksum: String,
    pub checksum_type: ChecksumType,
    /// The source's length when it is known (Content-Length), checked against the disk up front
    /// for raw images.
    pub length: Option<u64>,
}

/// Writes the image to `disk` (of `disk_size` bytes), calling `progress` after each block.
pub fn write_image<R: Read, W: Write + Seek>(
    source: ImageSource<R>,
    disk: &mut W,
    disk_size: u64,
    mut progress: impl FnMut(Progress),
) -> Result<Progress, ImageError> {
    if let (ImageFormat::Raw, Some(len)) = (source.format, source.length)
        && len > disk_size
    {
        return Err(ImageError::TooLarge {
            image: len,
            disk: disk_size,
        });
    }
    let mut checked = Checked {
        inner: source.reader,
        hasher: Some(Hasher::new(source.checksum_type)),
        read: 0,
    };
    let mut written = 0u64;
    let mut buf = vec![0u8; BLOCK];
    if source.format == ImageFormat::Qcow2 {
        written = super::qcow2::write(&mut checked, disk, disk_size, &mut progress)?;
    } else {
        let mut decoded: Box<dyn Read + '_> = match source.format {
            ImageFormat::Gzip => Box::new(flate2::read::MultiGzDecoder::new(&mut checked)),
            _ => Box::new(&mut checked),
        };
        loop {
            let filled = fill(&mut *decoded, &mut buf).map_err(|e| match source.format {
                ImageFormat::Gzip if e.kind() == io::ErrorKind::InvalidInput => {
                    ImageError::Corrupt {
                        format: "gzip",
                        message: e.to_string(),
                    }
                }
                _ => ImageError::Source(e),
            })?;
            if filled == 0 {
                break;
            }
            if written + filled as u64 > disk_size {
                return Err(ImageError::TooLarge {
                    image: written + filled as u64,
                    disk: disk_size,
                });
            }
            disk.write_all(&buf[..filled]).map_err(ImageError::Disk)?;
            written += filled as u64;
            progress(Progress { read: 0, written });
        }
    }
    disk.flush().map_err(ImageError::Disk)?;
    let read = checked.read;
    let actual = checked.hasher.take().map(Hasher::hex).unwrap_or_default();
    let expected = source.checksum.trim().to_ascii_lowercase();
    if actual != expected {
        return Err(ImageError::ChecksumMismatch { expected, actual });
    }
    Ok(Progress { read, written })
}

/// Reads until `buf` is full or the source ends; returns the bytes read.
fn fill(r: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Hex digest of `bytes`, for tests and for the lab's checksum files.
pub fn digest_hex(kind: ChecksumType, bytes: &[u8]) -> String {
    let mut h = Hasher::new(kind);
    h.update(bytes);
    h.hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn source(bytes: &[u8], format: ImageFormat, checksum: String) -> ImageSource<&[u8]> {
        ImageSource {
            reader: bytes,
            format,
            checksum,
            checksum_type: ChecksumType::Sha256,
            length: Some(bytes.len() as u64),
        }
    }

    #[test]
    fn a_raw_image_is_written_and_checked() {
        let img = image(BLOCK * 2 + 123);
        let mut disk = io::Cursor::new(Vec::new());
        let mut seen = Vec::new();
        let sum = digest_hex(ChecksumType::Sha256, &img);
        let done = write_image(
            source(&img, ImageFormat::Raw, sum.to_uppercase()),
            &mut disk,
            1 << 30,
            |p| seen.push(p.written),
        )
        .unwrap();
        assert_eq!(disk.get_ref(), &img);
        assert_eq!(done.written, img.len() as u64);
        assert_eq!(seen, [BLOCK as u64, 2 * BLOCK as u64, img.len() as u64]);
    }

    #[test]
    fn a_gzip_image_is_checked_against_its_compressed_bytes() {
        let img = image(300_000);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&img).unwrap();
        let gz = gz.finish().unwrap();
        let mut disk = io::Cursor::new(Vec::new());
        let sum = digest_hex(ChecksumType::Sha256, &gz);
        let done = write_image(
            source(&gz, ImageFormat::Gzip, sum),
            &mut disk,
            1 << 30,
            |_| {},
        )
        .unwrap();
        assert_eq!(disk.get_ref(), &img);
        assert_eq!(done.read, gz.len() as u64);
        // sha512 too.
        let mut disk = io::Cursor::new(Vec::new());
        let mut src = source(
            &gz,
            ImageFormat::Gzip,
            digest_hex(ChecksumType::Sha512, &gz),
        );
        src.checksum_type = ChecksumType::Sha512;
        write_image(src, &mut disk, 1 << 30, |_| {}).unwrap();
        assert_eq!(disk.get_ref(), &img);
    }

    #[test]
    fn bad_images_end_with_the_reason_that_names_them() {
        let img = image(10_000);
        let mut disk = io::Cursor::new(Vec::new());
        let wrong = digest_hex(ChecksumType::Sha256, b"another image");
        let e = write_image(
            source(&img, ImageFormat::Raw, wrong),
            &mut disk,
            1 << 30,
            |_| {},
        )
        .unwrap_err();
        assert_eq!(e.reason(), "ImageChecksumMismatch");

        let sum = digest_hex(ChecksumType::Sha256, &img);
        let e = write_image(
            source(&img, ImageFormat::Raw, sum.clone()),
            &mut io::Cursor::new(Vec::new()),
            100,
            |_| {},
        )
        .unwrap_err();
        assert_eq!(e.reason(), "DiskTooSmall");
        // Unknown length: the write stops at the disk's end.
        let mut src = source(&img, ImageFormat::Raw, sum.clone());
        src.length = None;
        let e = write_image(src, &mut io::Cursor::new(Vec::new()), 4096, |_| {}).unwrap_err();
        assert_eq!(e.reason(), "DiskTooSmall");

        let e = write_image(
            source(&img, ImageFormat::Gzip, sum),
            &mut io::Cursor::new(Vec::new()),
            1 << 30,
            |_| {},
        )
        .unwrap_err();
        assert!(
            matches!(e.reason(), "ImageFormatInvalid" | "ImageUnreadable"),
            "{e}"
        );

        // Truncated gzip.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&img).unwrap();
        let gz = gz.finish().unwrap();
        let cut = &gz[..gz.len() / 2];
        let e = write_image(
            source(
                cut,
                ImageFormat::Gzip,
                digest_hex(ChecksumType::Sha256, cut),
            ),
            &mut io::Cursor::new(Vec::new()),
            1 << 30,
            |_| {},
        )
        .unwrap_err();
        assert!(
            matches!(e.reason(), "ImageFormatInvalid" | "ImageUnreadable"),
            "{e}"
        );
    }
}

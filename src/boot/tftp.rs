//! TFTP for the first stage of network boot: a read-only root of iPXE binaries (BIOS
//! `undionly.kpxe`, UEFI `ipxe.efi`/`snponly.efi`, arm64 `snp.efi`; Debian's `/usr/lib/ipxe` by
//! default). blksize and tsize are negotiated by async-tftp; this handler decides what may be read:
//! plain relative names only (one leading `/` is tolerated, as some firmware sends it), no directory
//! that resolves outside the root, no writes. A *file* symlink in the root is followed wherever it
//! points: only the operator can create one, and Debian's own `/usr/lib/ipxe/ipxe.efi` is a link
//! to `/boot/ipxe.efi`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use async_tftp::packet;
use async_tftp::server::{Handler, TftpServerBuilder};

use super::artifacts::check_relative_path;

/// Longest file name accepted (TFTP has no limit of its own; firmware never needs more).
pub const MAX_NAME: usize = 255;

/// Why a TFTP read was refused (also the metric label).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    BadName(String),
    OutsideRoot,
    NotFound,
}

/// Where `requested` lives under `root`, or why it may not be read. `root` must be canonical.
pub fn resolve(root: &Path, requested: &str) -> Result<PathBuf, Refusal> {
    if requested.len() > MAX_NAME {
        return Err(Refusal::BadName(format!(
            "name longer than {MAX_NAME} bytes"
        )));
    }
    let relative = requested.strip_prefix('/').unwrap_or(requested);
    check_relative_path(relative).map_err(|e| Refusal::BadName(e.to_string()))?;
    let joined = root.join(relative);
    // The directory part must stay inside the root even after following links.
    let parent = joined.parent().ok_or(Refusal::NotFound)?;
    let real_parent = std::fs::canonicalize(parent).map_err(|_| Refusal::NotFound)?;
    if !real_parent.starts_with(root) {
        return Err(Refusal::OutsideRoot);
    }
    let file = real_parent.join(joined.file_name().ok_or(Refusal::NotFound)?);
    if !std::fs::metadata(&file).is_ok_and(|m| m.is_file()) {
        return Err(Refusal::NotFound);
    }
    Ok(file)
}

pub struct ReadOnlyRoot {
    root: PathBuf,
}

impl ReadOnlyRoot {
    pub fn new(root: &Path) -> std::io::Result<Self> {
        Ok(Self {
            root: std::fs::canonicalize(root)?,
        })
    }
}

impl Handler for ReadOnlyRoot {
    type Reader = blocking::Unblock<std::fs::File>;
    type Writer = futures::io::Sink;

    async fn read_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
    ) -> Result<(Self::Reader, Option<u64>), packet::Error> {
        let requested = path.to_string_lossy().into_owned();
        // Names come from anyone on the network: cut short, and logged escaped (`?`).
        let shown: String = requested.chars().take(80).collect();
        match resolve(&self.root, &requested) {
            Ok(file) => {
                let opened = blocking::unblock(move || {
                    let f = std::fs::File::open(file)?;
                    let size = f.metadata()?.len();
                    Ok::<_, std::io::Error>((f, size))
                })
                .await;
                match opened {
                    Ok((f, size)) => {
                        // Resolved names are plain relative paths inside the root: safe as labels.
                        let name = shown.trim_start_matches('/');
                        tracing::info!(%client, file = %name, bytes = size, "TFTP read");
                        crate::metrics::record_tftp(name, "served");
                        // Streamed from a blocking-pool thread; the file is never held in memory.
                        Ok((blocking::Unblock::new(f), Some(size)))
                    }
                    Err(e) => {
                        tracing::warn!(%client, file = %shown, error = %e, "TFTP read failed");
                        crate::metrics::record_tftp(&shown, "error");
                        Err(packet::Error::UnknownError)
                    }
                }
            }
            Err(refusal) => {
                tracing::warn!(%client, file = ?shown, reason = ?refusal, "TFTP read refused");
                crate::metrics::record_tftp(
                    "refused",
                    match refusal {
                        Refusal::NotFound => "not-found",
                        _ => "refused",
                    },
                );
                Err(match refusal {
                    Refusal::NotFound => packet::Error::FileNotFound,
                    _ => packet::Error::PermissionDenied,
                })
            }
        }
    }

    async fn write_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
        _size: Option<u64>,
    ) -> Result<Self::Writer, packet::Error> {
        let shown: String = path.to_string_lossy().chars().take(80).collect();
        tracing::warn!(%client, file = ?shown, "TFTP write refused (read-only)");
        crate::metrics::record_tftp("write", "refused");
        Err(packet::Error::PermissionDenied)
    }
}

/// A bound TFTP server; `serve` runs it until the process ends.
pub struct Tftp {
    server: async_tftp::server::TftpServer<ReadOnlyRoot>,
}

impl Tftp {
    pub async fn bind(addr: SocketAddr, root: &Path) -> Result<Self, String> {
        let handler =
            ReadOnlyRoot::new(root).map_err(|e| format!("TFTP root {}: {e}", root.display()))?;
        let server = TftpServerBuilder::with_handler(handler)
            .bind(addr)
            .build()
            .await
            .map_err(|e| format!("binding TFTP to {addr}: {e}"))?;
        Ok(Self { server })
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.listen_addr().ok()
    }

    pub async fn serve(self) -> Result<(), String> {
        self.server.serve().await.map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_escape_or_mislead_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::write(root.join("undionly.kpxe"), b"x").expect("file");
        std::fs::create_dir(root.join("sub")).expect("dir");
        std::os::unix::fs::symlink("/etc", root.join("etc")).expect("dir symlink");
        let outside = tempfile::NamedTempFile::new().expect("file outside");
        std::os::unix::fs::symlink(outside.path(), root.join("ipxe.efi")).expect("file symlink");
        assert_eq!(
            resolve(&root, "undionly.kpxe"),
            Ok(root.join("undionly.kpxe"))
        );
        assert_eq!(
            resolve(&root, "/undionly.kpxe"),
            Ok(root.join("undionly.kpxe"))
        );
        assert_eq!(
            resolve(&root, "ipxe.efi"),
            Ok(root.join("ipxe.efi")),
            "operator's file link"
        );
        for bad in [
            "../etc/passwd",
            "//etc/passwd",
            "sub/../../x",
            "a\\b",
            "./undionly.kpxe",
            "",
            "/",
            &"a".repeat(300),
        ] {
            assert!(
                matches!(resolve(&root, bad), Err(Refusal::BadName(_))),
                "{bad:?}"
            );
        }
        assert_eq!(resolve(&root, "etc/passwd"), Err(Refusal::OutsideRoot));
        assert_eq!(resolve(&root, "/etc/passwd"), Err(Refusal::OutsideRoot));
        assert_eq!(resolve(&root, "sub"), Err(Refusal::NotFound));
        assert_eq!(resolve(&root, "missing.efi"), Err(Refusal::NotFound));
    }
}

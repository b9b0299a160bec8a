//! TFTP for the first stage of network boot: a read-only root of iPXE binaries (BIOS
//! `undionly.kpxe`, UEFI `ipxe.efi`/`snponly.efi`, arm64 `snp.efi`; Debian's `/usr/lib/ipxe` by
//! default). blksize and tsize are negotiated by async-tftp; this handler decides what may be read:
//! plain relative names only (one leading `/` is tolerated, as some firmware sends it), no directory
//! that resolves outside the root, no writes. A *file* symlink in the root is followed wherever it
//! points: only the operator can create one, and Debian's own `/usr/lib/ipxe/ipxe.efi` is a link
//! to `/boot/ipxe.efi`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_tftp::packet;
use async_tftp::server::{Handler, TftpServerBuilder};

use super::artifacts::check_relative_path;
use super::budget::{ClientSlots, Slot};

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
    inside_root(root, relative)
}

/// `relative` (already a checked relative path) under `root`, if its directory stays inside the
/// root after following links and it is a file. Shared by TFTP and `/artifacts`.
pub fn inside_root(root: &Path, relative: &str) -> Result<PathBuf, Refusal> {
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

/// Budgets of the TFTP server. Anyone on the provisioning network can send a read request (over
/// UDP, spoofable), so transfers are capped in number, in memory and in time.
#[derive(Clone, Debug)]
pub struct TftpLimits {
    /// Transfers at once; more get an ERROR packet.
    pub max_transfers: usize,
    /// Transfers at once per client address.
    pub max_per_client: usize,
    /// Wait for an ACK before resending; the client's own `timeout` option is ignored.
    pub timeout: Duration,
    /// Resends before an unacknowledged transfer is dropped (reclaimed after about
    /// `timeout × (retries + 1)`).
    pub retries: u32,
    /// Largest block offered (iPXE and firmware ask for 1432–1468).
    pub block_size: u16,
    /// Blocks in flight before an ACK (1: a spoofed request gets one block, no more).
    pub window: u16,
    /// Read-ahead per transfer: the memory a transfer holds, whatever the file size.
    pub read_buffer: usize,
}

impl Default for TftpLimits {
    fn default() -> Self {
        Self {
            max_transfers: 256,
            max_per_client: 32,
            timeout: Duration::from_secs(3),
            retries: 3,
            block_size: 1468,
            window: 1,
            read_buffer: 16 * 1024,
        }
    }
}

/// A file streamed from a blocking-pool thread through a small buffer, holding its slot.
pub struct TransferReader {
    file: blocking::Unblock<std::fs::File>,
    _slot: Slot,
}

impl futures::io::AsyncRead for TransferReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.file).poll_read(cx, buf)
    }
}

pub struct ReadOnlyRoot {
    root: PathBuf,
    limits: TftpLimits,
    transfers: Arc<ClientSlots>,
}

impl ReadOnlyRoot {
    pub fn new(root: &Path) -> std::io::Result<Self> {
        Self::with_limits(root, TftpLimits::default())
    }

    pub fn with_limits(root: &Path, limits: TftpLimits) -> std::io::Result<Self> {
        Ok(Self {
            root: std::fs::canonicalize(root)?,
            transfers: ClientSlots::new(limits.max_transfers, limits.max_per_client),
            limits,
        })
    }
}

impl Handler for ReadOnlyRoot {
    type Reader = TransferReader;
    type Writer = futures::io::Sink;

    async fn read_req_open(
        &mut self,
        client: &SocketAddr,
        path: &Path,
    ) -> Result<(Self::Reader, Option<u64>), packet::Error> {
        let requested = path.to_string_lossy().into_owned();
        // Names come from anyone on the network: cut short, and logged escaped (`?`).
        let shown: String = requested.chars().take(80).collect();
        let Ok(slot) = self.transfers.take(client.ip()) else {
            tracing::debug!(%client, "TFTP read refused: too many transfers");
            crate::metrics::record_tftp("refused", "busy");
            return Err(packet::Error::Msg("too many transfers, retry".into()));
        };
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
                        // Streamed through a small buffer; the file is never held in memory.
                        let file = blocking::Unblock::with_capacity(self.limits.read_buffer, f);
                        Ok((TransferReader { file, _slot: slot }, Some(size)))
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
    transfers: Arc<ClientSlots>,
}

impl Tftp {
    pub async fn bind(addr: SocketAddr, root: &Path) -> Result<Self, String> {
        Self::bind_with(addr, root, TftpLimits::default()).await
    }

    pub async fn bind_with(
        addr: SocketAddr,
        root: &Path,
        limits: TftpLimits,
    ) -> Result<Self, String> {
        let handler = ReadOnlyRoot::with_limits(root, limits.clone())
            .map_err(|e| format!("TFTP root {}: {e}", root.display()))?;
        let transfers = handler.transfers.clone();
        let server = TftpServerBuilder::with_handler(handler)
            .bind(addr)
            .timeout(limits.timeout)
            .ignore_client_timeout()
            .max_send_retries(limits.retries)
            .block_size_limit(limits.block_size)
            .window_size_limit(limits.window)
            .build()
            .await
            .map_err(|e| format!("binding TFTP to {addr}: {e}"))?;
        Ok(Self { server, transfers })
    }

    /// Transfers in flight now.
    pub fn transfers(&self) -> Arc<ClientSlots> {
        self.transfers.clone()
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

//! TFTP for the first stage of network boot: a read-only root of iPXE binaries (BIOS
//! `undionly.kpxe`, UEFI `ipxe.efi`/`snponly.efi`, arm64 `snp.efi`; Debian's `/usr/lib/ipxe` by
//! default). What may be read: plain relative names only (one leading `/` is tolerated, as some
//! firmware sends it), no directory that resolves outside the root, no writes. A *file* symlink in
//! the root is followed wherever it points: only the operator can create one, and Debian's own
//! `/usr/lib/ipxe/ipxe.efi` is a link to `/boot/ipxe.efi`.
//!
//! The server is our own (RFC 1350 with the blksize and tsize options of RFC 2347–2349), because
//! `async-tftp` could not be made to end a transfer on the client's ERROR packet, kept one transfer
//! per client address (so a request spoofed from a client's ip:port held that client off), and
//! resent blocks to an address that had never acknowledged one. Here each request is a transfer of
//! its own on its own port; a transfer resends only after its client acknowledged something, so an
//! unconfirmed (possibly spoofed) address gets one packet per request and is dropped after one
//! timeout; a client's ERROR ends its transfer at once; memory per transfer is one block and the
//! read buffer, whatever the file size.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, BufReader};
use tokio::net::UdpSocket;

use super::artifacts::check_relative_path;
use super::budget::{ClientSlots, Slot};
use super::netns::NetNamespace;

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
    /// Wait for an ACK before resending; the client's own `timeout` option is not acknowledged.
    pub timeout: Duration,
    /// Wait for the first ACK (or the OACK's ACK): an address that never asked — a spoofed
    /// request — holds a slot this long. PXE firmware answers within milliseconds.
    pub first_ack_timeout: Duration,
    /// Longest a whole transfer may take, however slowly the client acknowledges.
    pub max_transfer_time: Duration,
    /// Resends of a block, once the client has acknowledged one (a transfer whose first packet
    /// is never acknowledged ends after one `timeout`).
    pub retries: u32,
    /// Largest block offered (iPXE and firmware ask for 1432–1468).
    pub block_size: u16,
    /// Read-ahead per transfer: the memory a transfer holds, whatever the file size.
    pub read_buffer: usize,
    /// Largest RFC 7440 window (blocks sent before an ACK is awaited); memory per transfer is
    /// this many blocks.
    pub max_window: u16,
}

impl Default for TftpLimits {
    fn default() -> Self {
        Self {
            max_transfers: 256,
            max_per_client: 32,
            timeout: Duration::from_secs(3),
            first_ack_timeout: Duration::from_secs(1),
            max_transfer_time: Duration::from_secs(120),
            retries: 3,
            block_size: 1468,
            read_buffer: 16 * 1024,
            max_window: 16,
        }
    }
}

/// The TFTP wire format (RFC 1350, options per RFC 2347): pure, so every parser is unit-tested
/// and fuzzed.
pub mod wire {
    pub const RRQ: u16 = 1;
    pub const WRQ: u16 = 2;
    pub const DATA: u16 = 3;
    pub const ACK: u16 = 4;
    pub const ERROR: u16 = 5;
    pub const OACK: u16 = 6;

    /// Error codes of RFC 1350 used here.
    pub const NOT_DEFINED: u16 = 0;
    pub const FILE_NOT_FOUND: u16 = 1;
    pub const ACCESS_VIOLATION: u16 = 2;
    pub const ILLEGAL_OPERATION: u16 = 4;

    /// A request to the server's well-known port.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Request {
        Read {
            name: String,
            mode: String,
            /// Option names lower-cased, in the order sent.
            options: Vec<(String, String)>,
        },
        Write,
    }

    /// What a client sends during a transfer.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum ClientPacket {
        Ack(u16),
        Error(u16, String),
        Other,
    }

    fn opcode(packet: &[u8]) -> Option<u16> {
        Some(u16::from_be_bytes([*packet.first()?, *packet.get(1)?]))
    }

    /// Parses a request; `None` for anything that is not a well-formed RRQ or WRQ.
    pub fn parse_request(packet: &[u8]) -> Option<Request> {
        match opcode(packet)? {
            WRQ => Some(Request::Write),
            RRQ => {
                let body = &packet[2..];
                // Every field ends with a NUL; the packet ends with the last field's NUL.
                if body.last() != Some(&0) {
                    return None;
                }
                let mut fields = body[..body.len() - 1]
                    .split(|b| *b == 0)
                    .map(|f| std::str::from_utf8(f).ok().map(str::to_string));
                let name = fields.next()??;
                let mode = fields.next()??.to_ascii_lowercase();
                let mut options = Vec::new();
                loop {
                    match (fields.next(), fields.next()) {
                        (None, _) => break,
                        (Some(Some(key)), Some(Some(value))) if options.len() < 16 => {
                            options.push((key.to_ascii_lowercase(), value))
                        }
                        _ => return None,
                    }
                }
                Some(Request::Read {
                    name,
                    mode,
                    options,
                })
            }
            _ => None,
        }
    }

    pub fn parse_client_packet(packet: &[u8]) -> ClientPacket {
        match opcode(packet) {
            Some(ACK) if packet.len() >= 4 => {
                ClientPacket::Ack(u16::from_be_bytes([packet[2], packet[3]]))
            }
            Some(ERROR) if packet.len() >= 4 => {
                let message = packet[4..].split(|b| *b == 0).next().unwrap_or_default();
                ClientPacket::Error(
                    u16::from_be_bytes([packet[2], packet[3]]),
                    String::from_utf8_lossy(&message[..message.len().min(128)]).into_owned(),
                )
            }
            _ => ClientPacket::Other,
        }
    }

    pub fn data(block: u16, payload: &[u8]) -> Vec<u8> {
        let mut p = Vec::with_capacity(4 + payload.len());
        p.extend_from_slice(&DATA.to_be_bytes());
        p.extend_from_slice(&block.to_be_bytes());
        p.extend_from_slice(payload);
        p
    }

    pub fn error(code: u16, message: &str) -> Vec<u8> {
        let mut p = Vec::with_capacity(5 + message.len());
        p.extend_from_slice(&ERROR.to_be_bytes());
        p.extend_from_slice(&code.to_be_bytes());
        p.extend_from_slice(message.as_bytes());
        p.push(0);
        p
    }

    pub fn oack(options: &[(String, String)]) -> Vec<u8> {
        let mut p = OACK.to_be_bytes().to_vec();
        for (key, value) in options {
            p.extend_from_slice(key.as_bytes());
            p.push(0);
            p.extend_from_slice(value.as_bytes());
            p.push(0);
        }
        p
    }
}

/// The options this server acknowledges, and the block size they settle on: blksize (clamped to
/// the budget; below 512 it is not acknowledged, so tiny blocks cannot stretch a transfer),
/// tsize (the file's size). timeout and windowsize are not acknowledged, so the
/// client keeps RFC 1350's one block in flight and the server's own timeout.
pub fn negotiate(
    options: &[(String, String)],
    limit: u16,
    file_size: u64,
) -> (usize, Vec<(String, String)>) {
    let mut block = 512usize;
    let mut accepted = Vec::new();
    for (key, value) in options {
        match key.as_str() {
            "blksize" => {
                if let Ok(asked) = value.parse::<usize>()
                    && (512..=65464).contains(&asked)
                {
                    block = asked.min(usize::from(limit));
                    accepted.push((key.clone(), block.to_string()));
                }
            }
            "tsize" => accepted.push((key.clone(), file_size.to_string())),
            _ => {}
        }
    }
    (block, accepted)
}

/// RFC 7440 `windowsize`: how many blocks go out before an ACK is awaited, capped at `limit`;
/// None when not asked (or not a number from 1 to 65535), which means one.
pub fn negotiate_window(options: &[(String, String)], limit: u16) -> Option<u16> {
    options
        .iter()
        .find(|(key, _)| key == "windowsize")
        .and_then(|(_, value)| value.parse::<u16>().ok())
        .filter(|w| *w >= 1)
        .map(|w| w.min(limit.max(1)))
}

/// A bound TFTP server; `serve` runs it until the process ends.
/// Told when a transfer completed (the boot service maps the address to a host).
pub trait TransferObserver: Send + Sync + 'static {
    fn transfer_done(&self, client: SocketAddr, file: &str);
}

pub struct Tftp {
    socket: Arc<UdpSocket>,
    root: PathBuf,
    limits: TftpLimits,
    transfers: Arc<ClientSlots>,
    /// Where transfer sockets are created: the namespace the listener is in.
    netns: NetNamespace,
    observer: Option<Arc<dyn TransferObserver>>,
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
        Self::bind_in(&NetNamespace::current(), addr, root, limits)
    }

    /// Listens on `addr` inside `netns`; transfers get their ports there too.
    pub fn bind_in(
        netns: &NetNamespace,
        addr: SocketAddr,
        root: &Path,
        limits: TftpLimits,
    ) -> Result<Self, String> {
        let root = std::fs::canonicalize(root)
            .map_err(|e| format!("TFTP root {}: {e}", root.display()))?;
        let socket = netns
            .udp_socket(addr, None, false)
            .map_err(|e| format!("binding TFTP to {addr}: {e}"))?;
        Ok(Self {
            socket: Arc::new(socket),
            root,
            transfers: ClientSlots::new(limits.max_transfers, limits.max_per_client),
            limits,
            netns: netns.clone(),
            observer: None,
        })
    }

    /// Reports each completed transfer to `observer`.
    pub fn with_observer(mut self, observer: Arc<dyn TransferObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Transfers in flight now.
    pub fn transfers(&self) -> Arc<ClientSlots> {
        self.transfers.clone()
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.socket.local_addr().ok()
    }

    pub async fn serve(self) -> Result<(), String> {
        let local_ip = self
            .socket
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; 2048];
        loop {
            let (n, client) = self
                .socket
                .recv_from(&mut buf)
                .await
                .map_err(|e| format!("TFTP receive: {e}"))?;
            match wire::parse_request(&buf[..n]) {
                Some(wire::Request::Read {
                    name,
                    mode,
                    options,
                }) => {
                    let Ok(slot) = self.transfers.take(client.ip()) else {
                        tracing::debug!(%client, "TFTP read refused: too many transfers");
                        crate::metrics::record_tftp("refused", "busy");
                        self.reply(
                            client,
                            wire::error(wire::NOT_DEFINED, "too many transfers, retry"),
                        )
                        .await;
                        continue;
                    };
                    if mode != "octet" {
                        self.reply(
                            client,
                            wire::error(wire::ILLEGAL_OPERATION, "octet mode only"),
                        )
                        .await;
                        continue;
                    }
                    let transfer = Transfer {
                        observer: self.observer.clone(),
                        netns: self.netns.clone(),
                        root: self.root.clone(),
                        limits: self.limits.clone(),
                        client,
                        local_ip,
                        _slot: slot,
                    };
                    tokio::spawn(transfer.run(name, options));
                }
                Some(wire::Request::Write) => {
                    tracing::warn!(%client, "TFTP write refused (read-only)");
                    crate::metrics::record_tftp("write", "refused");
                    self.reply(client, wire::error(wire::ACCESS_VIOLATION, "read-only"))
                        .await;
                }
                // Not a request: nothing answered, nothing amplified.
                None => crate::metrics::record_tftp("malformed", "refused"),
            }
        }
    }

    async fn reply(&self, client: SocketAddr, packet: Vec<u8>) {
        if let Err(e) = self.socket.send_to(&packet, client).await {
            tracing::debug!(%client, error = %e, "TFTP reply not sent");
        }
    }
}

/// One read transfer, on a port of its own (its transfer ID), holding its slot until it ends.
struct Transfer {
    observer: Option<Arc<dyn TransferObserver>>,
    netns: NetNamespace,
    root: PathBuf,
    limits: TftpLimits,
    client: SocketAddr,
    local_ip: IpAddr,
    _slot: Slot,
}

/// How a transfer ended, for the log and the metric.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    Done,
    /// The client sent an ERROR packet.
    ClientError,
    /// No acknowledgement within the budget.
    Abandoned,
}

impl Transfer {
    async fn run(self, requested: String, options: Vec<(String, String)>) {
        // Names come from anyone on the network: cut short, and logged escaped (`?`).
        let shown: String = requested.chars().take(80).collect();
        let socket = match self
            .netns
            .udp_socket(SocketAddr::new(self.local_ip, 0), None, false)
        {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(client = %self.client, error = %e, "TFTP: no port for a transfer");
                return;
            }
        };
        let root = self.root.clone();
        let resolved = tokio::task::spawn_blocking(move || resolve(&root, &requested)).await;
        let file = match resolved {
            Ok(Ok(path)) => path,
            Ok(Err(refusal)) => {
                tracing::warn!(client = %self.client, file = ?shown, reason = ?refusal, "TFTP read refused");
                let (code, label) = match refusal {
                    Refusal::NotFound => (wire::FILE_NOT_FOUND, "not-found"),
                    _ => (wire::ACCESS_VIOLATION, "refused"),
                };
                crate::metrics::record_tftp("refused", label);
                let _ = socket
                    .send_to(&wire::error(code, "not available"), self.client)
                    .await;
                return;
            }
            Err(_) => return,
        };
        let opened = match tokio::fs::File::open(&file).await {
            Ok(f) => match f.metadata().await {
                Ok(m) => Ok((f, m.len())),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        let (file, size) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                tracing::warn!(client = %self.client, file = %shown, error = %e, "TFTP read failed");
                crate::metrics::record_tftp(&shown, "error");
                let _ = socket
                    .send_to(&wire::error(wire::NOT_DEFINED, "read failed"), self.client)
                    .await;
                return;
            }
        };
        // Resolved names are plain relative paths inside the root: safe as labels.
        let name = shown.trim_start_matches('/').to_string();
        tracing::info!(client = %self.client, file = %name, bytes = size, "TFTP read");
        crate::metrics::record_tftp(&name, "served");
        let ended = match tokio::time::timeout(
            self.limits.max_transfer_time,
            self.send_file(&socket, file, size, &options),
        )
        .await
        {
            Ok(ended) => ended,
            Err(_) => {
                let _ = socket
                    .send_to(
                        &wire::error(wire::NOT_DEFINED, "transfer too slow"),
                        self.client,
                    )
                    .await;
                Ended::Abandoned
            }
        };
        match ended {
            Ended::Done => match &self.observer {
                Some(observer) => observer.transfer_done(self.client, &name),
                None => tracing::debug!(client = %self.client, file = %name, "TFTP transfer done"),
            },
            Ended::ClientError => {
                crate::metrics::record_tftp(&name, "client-error");
                tracing::info!(client = %self.client, file = %name, "TFTP transfer ended by the client's ERROR")
            }
            Ended::Abandoned => {
                crate::metrics::record_tftp(&name, "abandoned");
                tracing::info!(client = %self.client, file = %name, "TFTP transfer abandoned: no ACK")
            }
        }
    }

    async fn send_file(
        &self,
        socket: &UdpSocket,
        file: tokio::fs::File,
        size: u64,
        options: &[(String, String)],
    ) -> Ended {
        let (block_size, mut accepted) = negotiate(options, self.limits.block_size, size);
        let window_size = negotiate_window(options, self.limits.max_window);
        if let Some(w) = window_size {
            accepted.push(("windowsize".into(), w.to_string()));
        }
        let window_size = usize::from(window_size.unwrap_or(1));
        let mut reader = BufReader::with_capacity(self.limits.read_buffer, file);
        let mut acknowledged_once = false;
        if !accepted.is_empty() {
            let oack = VecDeque::from([(0u16, wire::oack(&accepted))]);
            match self.exchange(socket, &oack, acknowledged_once).await {
                Ok(_) => acknowledged_once = true,
                Err(ended) => return ended,
            }
        }
        // Blocks sent and not yet acknowledged (at most `window_size`), oldest first.
        let mut window: VecDeque<(u16, Vec<u8>)> = VecDeque::with_capacity(window_size);
        let mut next_block: u16 = 1;
        let mut last_read = false;
        let mut payload = vec![0u8; block_size];
        loop {
            while !last_read && window.len() < window_size {
                let mut filled = 0;
                while filled < block_size {
                    match reader.read(&mut payload[filled..]).await {
                        Ok(0) => break,
                        Ok(n) => filled += n,
                        Err(e) => {
                            tracing::warn!(client = %self.client, error = %e, "TFTP read failed mid-transfer");
                            let _ = socket
                                .send_to(
                                    &wire::error(wire::NOT_DEFINED, "read failed"),
                                    self.client,
                                )
                                .await;
                            return Ended::Abandoned;
                        }
                    }
                }
                window.push_back((next_block, wire::data(next_block, &payload[..filled])));
                last_read = filled < block_size;
                next_block = next_block.wrapping_add(1);
            }
            match self.exchange(socket, &window, acknowledged_once).await {
                Ok(acked) => {
                    acknowledged_once = true;
                    // Go-back-N (RFC 7440 §4): what follows the acknowledged block goes again.
                    window.drain(..=acked);
                    if last_read && window.is_empty() {
                        return Ended::Done;
                    }
                }
                Err(ended) => return ended,
            }
        }
    }

    /// Sends the window's packets and waits for the ACK of one of them (its index), resending
    /// on timeout only once the client has acknowledged something. Packets from other addresses
    /// are ignored, an ACK of a block outside the window is not answered (no Sorcerer's
    /// Apprentice), an ERROR from the client ends the transfer.
    async fn exchange(
        &self,
        socket: &UdpSocket,
        window: &VecDeque<(u16, Vec<u8>)>,
        acknowledged_once: bool,
    ) -> Result<usize, Ended> {
        let (sends, timeout) = if acknowledged_once {
            (self.limits.retries + 1, self.limits.timeout)
        } else {
            (1, self.limits.first_ack_timeout)
        };
        let mut buf = [0u8; 1024];
        for _ in 0..sends {
            for (_, packet) in window {
                if socket.send_to(packet, self.client).await.is_err() {
                    return Err(Ended::Abandoned);
                }
            }
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let received = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await;
                let Ok(Ok((n, from))) = received else {
                    break;
                };
                if from != self.client {
                    continue;
                }
                match wire::parse_client_packet(&buf[..n]) {
                    wire::ClientPacket::Ack(acked) => {
                        if let Some(i) = window.iter().position(|(block, _)| *block == acked) {
                            return Ok(i);
                        }
                    }
                    wire::ClientPacket::Error(..) => return Err(Ended::ClientError),
                    _ => {}
                }
            }
        }
        Err(Ended::Abandoned)
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

    #[test]
    fn requests_parse_or_are_refused() {
        use wire::{Request, parse_request};
        assert_eq!(
            parse_request(b"\x00\x01undionly.kpxe\x00OCTET\x00BLKSIZE\x001468\x00tsize\x000\x00"),
            Some(Request::Read {
                name: "undionly.kpxe".into(),
                mode: "octet".into(),
                options: vec![
                    ("blksize".into(), "1468".into()),
                    ("tsize".into(), "0".into())
                ],
            })
        );
        assert_eq!(
            parse_request(b"\x00\x02x\x00octet\x00"),
            Some(Request::Write)
        );
        for bad in [
            &b""[..],
            b"\x00",
            b"\x00\x01",
            b"\x00\x01name",
            b"\x00\x01name\x00",
            b"\x00\x01name\x00octet\x00blksize\x00",
            b"\x00\x01\xff\xfe\x00octet\x00",
            b"\x00\x04\x00\x01",
        ] {
            assert_eq!(parse_request(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_blksize_and_tsize_are_acknowledged() {
        let opts = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(negotiate(&[], 1468, 10), (512, vec![]));
        let window = |v: &str| negotiate_window(&opts(&[("windowsize", v)]), 16);
        assert_eq!(window("4"), Some(4));
        assert_eq!(window("64"), Some(16), "capped");
        assert_eq!(window("0"), None);
        assert_eq!(window("70000"), None);
        assert_eq!(window("x"), None);
        assert_eq!(negotiate_window(&[], 16), None);
        assert_eq!(
            negotiate(
                &opts(&[
                    ("blksize", "65464"),
                    ("tsize", "0"),
                    ("timeout", "255"),
                    ("windowsize", "64")
                ]),
                1468,
                67
            ),
            (1468, opts(&[("blksize", "1468"), ("tsize", "67")]))
        );
        assert_eq!(
            negotiate(&opts(&[("blksize", "1024")]), 1468, 0),
            (1024, opts(&[("blksize", "1024")]))
        );
        assert_eq!(
            negotiate(&opts(&[("blksize", "7")]), 1468, 0),
            (512, vec![])
        );
        assert_eq!(
            negotiate(&opts(&[("blksize", "8")]), 1468, 0),
            (512, vec![]),
            "tiny blocks would stretch a transfer"
        );
        assert_eq!(
            negotiate(&opts(&[("blksize", "x")]), 1468, 0),
            (512, vec![])
        );
    }

    #[test]
    fn client_packets() {
        use wire::{ClientPacket, parse_client_packet};
        assert_eq!(
            parse_client_packet(b"\x00\x04\x01\x02"),
            ClientPacket::Ack(258)
        );
        assert_eq!(
            parse_client_packet(b"\x00\x05\x00\x05unknown tid\x00"),
            ClientPacket::Error(5, "unknown tid".into())
        );
        assert_eq!(parse_client_packet(b"\x00\x04\x01"), ClientPacket::Other);
        assert_eq!(
            parse_client_packet(b"\x00\x03\x00\x01data"),
            ClientPacket::Other
        );
    }
}

//! TFTP storm benchmark (not a test): 200 concurrent `undionly.kpxe` transfers (blksize 1468, as
//! PXE ROMs ask) from metalboot's TFTP service, then from tftpd-hpa serving the same file on the
//! same machine in the same run. Three rounds each, median reported, with the ratio.
//! Run with `hack/bench-boot.sh` (installs tftpd-hpa, builds in release mode).
//!
//! The client is a few lines of RFC 1350/2348 written here: no crate offers an async TFTP client,
//! and spawning 200 curl processes would measure process start-up more than the servers.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use metalboot::boot::tftp::Tftp;
use tokio::net::UdpSocket;

const CLIENTS: usize = 200;
const ROUNDS: usize = 3;
const BLKSIZE: usize = 1468;
const FILE: &str = "undionly.kpxe";

/// One read request: RRQ with blksize, ACK every block, retransmit on silence.
async fn fetch(server: SocketAddr) -> Result<Vec<u8>, String> {
    let socket = UdpSocket::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let mut rrq = vec![0, 1];
    for part in [FILE, "octet", "blksize", &BLKSIZE.to_string()] {
        rrq.extend_from_slice(part.as_bytes());
        rrq.push(0);
    }
    socket
        .send_to(&rrq, server)
        .await
        .map_err(|e| e.to_string())?;
    let mut last_sent = rrq;
    let mut peer = server;
    let mut data = Vec::new();
    let mut expected: u16 = 1;
    let mut block_size = 512;
    let mut buf = vec![0u8; BLKSIZE + 4];
    let mut silent = 0;
    loop {
        let received =
            tokio::time::timeout(Duration::from_secs(2), socket.recv_from(&mut buf)).await;
        let (n, from) = match received {
            Ok(r) => r.map_err(|e| e.to_string())?,
            Err(_) => {
                silent += 1;
                if silent > 5 {
                    return Err("server went silent".into());
                }
                socket
                    .send_to(&last_sent, peer)
                    .await
                    .map_err(|e| e.to_string())?;
                continue;
            }
        };
        silent = 0;
        peer = from;
        match buf.get(..2) {
            Some([0, 6]) => {
                block_size = BLKSIZE;
                last_sent = vec![0, 4, 0, 0];
            }
            Some([0, 3]) if n >= 4 => {
                let block = u16::from_be_bytes([buf[2], buf[3]]);
                if block == expected {
                    data.extend_from_slice(&buf[4..n]);
                    expected = expected.wrapping_add(1);
                }
                last_sent = vec![0, 4, buf[2], buf[3]];
                if block == expected.wrapping_sub(1) && n - 4 < block_size {
                    socket
                        .send_to(&last_sent, peer)
                        .await
                        .map_err(|e| e.to_string())?;
                    return Ok(data);
                }
            }
            Some([0, 5]) => return Err(String::from_utf8_lossy(&buf[4..n]).into_owned()),
            _ => return Err("unexpected packet".into()),
        }
        socket
            .send_to(&last_sent, peer)
            .await
            .map_err(|e| e.to_string())?;
    }
}

/// Seconds for CLIENTS concurrent transfers; panics if any transfer is not byte-identical.
async fn storm(server: SocketAddr, want: &[u8]) -> f64 {
    let started = Instant::now();
    let all = futures::future::join_all((0..CLIENTS).map(|_| fetch(server))).await;
    let seconds = started.elapsed().as_secs_f64();
    for (i, got) in all.into_iter().enumerate() {
        match got {
            Ok(bytes) if bytes == want => {}
            Ok(bytes) => panic!("transfer {i}: {} bytes, not the file", bytes.len()),
            Err(e) => panic!("transfer {i} failed: {e}"),
        }
    }
    seconds
}

async fn median_of_rounds(server: SocketAddr, want: &[u8]) -> f64 {
    let mut times = Vec::new();
    for _ in 0..ROUNDS {
        times.push(storm(server, want).await);
    }
    times.sort_by(f64::total_cmp);
    times[ROUNDS / 2]
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("free UDP port")
}

#[tokio::main]
async fn main() {
    let root = tempfile::tempdir().expect("tempdir");
    let want = std::fs::read(Path::new("/usr/lib/ipxe").join(FILE)).expect("Debian ipxe");
    std::fs::write(root.path().join(FILE), &want).expect("copy");
    // tftpd-hpa drops to `nobody`: the root must be world-readable.
    Command::new("chmod")
        .args(["-R", "a+rX"])
        .arg(root.path())
        .status()
        .expect("chmod");

    // All clients come from 127.0.0.1: the per-address budget (32 by default) is raised so the
    // storm measures transfers, not refusals.
    let limits = metalboot::boot::tftp::TftpLimits {
        max_per_client: CLIENTS,
        ..Default::default()
    };
    let ours = Tftp::bind_with("127.0.0.1:0".parse().expect("addr"), root.path(), limits)
        .await
        .expect("bind metalboot TFTP");
    let our_addr = ours.local_addr().expect("address");
    tokio::spawn(ours.serve());
    let metalboot = median_of_rounds(our_addr, &want).await;

    let port = free_udp_port();
    let mut hpa = Command::new("in.tftpd")
        .args(["-L", "-s", "-a", &format!("127.0.0.1:{port}")])
        .arg(root.path())
        .spawn()
        .expect("in.tftpd (hack/bench-boot.sh installs tftpd-hpa)");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hpa_addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let tftpd = median_of_rounds(hpa_addr, &want).await;
    let _ = hpa.kill();
    let _ = hpa.wait();

    let total_mb = (CLIENTS * want.len()) as f64 / 1e6;
    println!(
        "TFTP storm: {CLIENTS} concurrent {FILE} ({} bytes), blksize {BLKSIZE}, median of {ROUNDS} rounds",
        want.len()
    );
    for (name, s) in [("metalboot", metalboot), ("tftpd-hpa", tftpd)] {
        println!(
            "  {name:<10} {s:>6.2} s  {:>7.1} MB/s  {:>6.0} transfers/s",
            total_mb / s,
            CLIENTS as f64 / s
        );
    }
    println!(
        "ratio: metalboot takes {:.2}× tftpd-hpa's time for the same TFTP storm",
        metalboot / tftpd
    );
}

//! The boot service's TFTP side against real clients: curl `tftp://`, atftp, and raw UDP packets
//! for what well-behaved clients never send. Serves Debian's `/usr/lib/ipxe` as in production.

use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use metalboot::boot::tftp::Tftp;

const ROOT: &str = "/usr/lib/ipxe";

async fn start() -> SocketAddr {
    start_counted().await.0
}

/// A server over Debian's iPXE directory, and its count of transfers in flight.
async fn start_counted() -> (
    SocketAddr,
    std::sync::Arc<metalboot::boot::budget::ClientSlots>,
) {
    let server = Tftp::bind("127.0.0.1:0".parse().expect("addr"), Path::new(ROOT))
        .await
        .expect("bind TFTP");
    let addr = server.local_addr().expect("TFTP address");
    let transfers = server.transfers();
    tokio::spawn(server.serve());
    (addr, transfers)
}

fn original() -> Vec<u8> {
    std::fs::read(Path::new(ROOT).join("undionly.kpxe")).expect("Debian ipxe's undionly.kpxe")
}

async fn curl_get(addr: SocketAddr, name: &str, out: &Path) -> std::process::Output {
    let url = format!("tftp://{addr}/{name}");
    let out = out.to_path_buf();
    tokio::task::spawn_blocking(move || {
        Command::new("curl")
            .args(["-sS", "--max-time", "60", "--tftp-blksize", "1468", "-o"])
            .arg(&out)
            .arg(url)
            .output()
            .expect("run curl")
    })
    .await
    .expect("curl task")
}

/// Sends one raw request and returns the first packet the server answers with.
async fn raw_request(addr: SocketAddr, packet: Vec<u8>) -> Vec<u8> {
    tokio::task::spawn_blocking(move || {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("udp");
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        socket.send_to(&packet, addr).expect("send");
        let mut buf = [0u8; 2048];
        let (n, _) = socket.recv_from(&mut buf).expect("an answer within 10 s");
        buf[..n].to_vec()
    })
    .await
    .expect("udp task")
}

fn request(opcode: u8, name: &str) -> Vec<u8> {
    let mut p = vec![0, opcode];
    p.extend_from_slice(name.as_bytes());
    p.push(0);
    p.extend_from_slice(b"octet\0");
    p
}

#[tokio::test]
async fn curl_fetches_undionly_byte_identical_with_blksize_1468() {
    let addr = start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("undionly.kpxe");
    let result = curl_get(addr, "undionly.kpxe", &out).await;
    assert!(
        result.status.success(),
        "curl: {}",
        String::from_utf8_lossy(&result.stderr)
    );
    let got = std::fs::read(&out).expect("downloaded");
    assert_eq!(got.len(), original().len());
    assert!(got == original(), "byte-identical");
}

/// Fetches undionly.kpxe with atftp and `options` (e.g. `blksize 1468`) into `out`; returns
/// atftp's trace and its OACK line.
async fn atftp(addr: SocketAddr, options: &[String], out: &Path) -> (String, String) {
    let mut args = vec!["--trace".to_string()];
    for option in options {
        args.extend(["--option".to_string(), option.clone()]);
    }
    let (port, local) = (addr.port().to_string(), out.to_path_buf());
    let result = tokio::task::spawn_blocking(move || {
        Command::new("atftp")
            .args(&args)
            .args(["-g", "-r", "undionly.kpxe", "-l"])
            .arg(&local)
            .args(["127.0.0.1", &port])
            .output()
            .expect("run atftp")
    })
    .await
    .expect("atftp task");
    let trace = format!(
        "{}{}",
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
    let oack = trace
        .lines()
        .find(|l| l.contains("OACK"))
        .unwrap_or_else(|| panic!("no OACK in the trace:\n{trace}"))
        .to_string();
    (trace, oack)
}

/// RFC 7440: atftp asks for a window of 8 blocks; the server acknowledges it and the file
/// arrives whole. A window larger than the server's cap is cut to the cap.
#[tokio::test]
async fn atftp_with_windowsize_gets_the_window_and_the_whole_file() {
    let addr = start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    for (asked, granted) in [(8, 8), (500, 16)] {
        let out = dir.path().join(format!("undionly-{asked}.kpxe"));
        let options = ["blksize 1468".to_string(), format!("windowsize {asked}")];
        let (trace, oack) = atftp(addr, &options, &out).await;
        assert!(oack.contains(&format!("windowsize: {granted}")), "{oack}");
        // ACKs only every window: far fewer than one per block.
        let acks = trace.lines().filter(|l| l.contains("sent ACK")).count();
        let blocks = original().len().div_ceil(1468);
        println!("windowsize {asked}: {acks} ACKs for {blocks} blocks");
        assert!(
            acks > 0 && acks < blocks / 4,
            "{acks} ACKs for {blocks} blocks:\n{trace}"
        );
        assert!(std::fs::read(&out).expect("downloaded") == original());
    }
}

#[tokio::test]
async fn atftp_trace_shows_blksize_and_tsize_negotiated() {
    let addr = start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("undionly.kpxe");
    let options = ["blksize 1468".to_string(), "tsize 0".to_string()];
    let (_, oack) = atftp(addr, &options, &out).await;
    println!("atftp: {oack}");
    assert!(oack.contains("blksize: 1468"), "{oack}");
    assert!(
        oack.contains(&format!("tsize: {}", original().len())),
        "{oack}"
    );
    assert!(std::fs::read(&out).expect("downloaded") == original());
}

#[tokio::test]
async fn ten_path_escape_attempts_get_an_error_packet_and_no_data() {
    let addr = start().await;
    let attempts = [
        "../../../../etc/passwd",
        "/etc/passwd",
        "..\\..\\..\\etc\\passwd",
        "qemu/../../../etc/passwd",
        "undionly.kpxe/../../../../etc/shadow",
        "./../etc/hostname",
        "....//....//etc/passwd",
        "/proc/self/environ",
        "qemu/../../../../proc/self/cmdline",
        "%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    ];
    for name in attempts {
        let answer = raw_request(addr, request(1, name)).await;
        assert_eq!(
            answer.get(..2),
            Some(&[0u8, 5][..]),
            "{name:?} must be answered with ERROR, got {answer:?}"
        );
        let code = u16::from_be_bytes([answer[2], answer[3]]);
        assert!(
            code == 1 || code == 2,
            "{name:?}: file-not-found or access-violation, got {code}"
        );
    }
}

#[tokio::test]
async fn writes_are_refused() {
    let addr = start().await;
    let answer = raw_request(addr, request(2, "undionly.kpxe")).await;
    assert_eq!(
        answer.get(..4),
        Some(&[0u8, 5, 0, 2][..]),
        "WRQ answered with ERROR access violation: {answer:?}"
    );
    assert!(original().len() > 1000, "the file is untouched");
}

#[tokio::test]
async fn twenty_concurrent_transfers_are_all_identical() {
    let addr = start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let transfers = (0..20).map(|i| {
        let out = dir.path().join(format!("undionly-{i}.kpxe"));
        async move {
            let result = curl_get(addr, "undionly.kpxe", &out).await;
            assert!(
                result.status.success(),
                "transfer {i}: {}",
                String::from_utf8_lossy(&result.stderr)
            );
            std::fs::read(&out).expect("downloaded")
        }
    });
    let all = futures::future::join_all(transfers).await;
    let want = original();
    assert_eq!(all.len(), 20);
    for (i, got) in all.iter().enumerate() {
        assert!(*got == want, "transfer {i} differs");
    }
}

/// A minimal client on `socket`: RRQ with blksize 1468, ACKs every block from the transfer's
/// port, returns the file. Packets from any other port are ignored, as RFC 1350 asks.
fn fetch_on(socket: &UdpSocket, addr: SocketAddr, name: &str) -> (Vec<u8>, Vec<SocketAddr>) {
    let mut rrq = request(1, name);
    rrq.extend_from_slice(b"blksize\x001468\x00");
    socket.send_to(&rrq, addr).expect("send RRQ");
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut file = Vec::new();
    let mut server: Option<SocketAddr> = None;
    let mut strays = Vec::new();
    let mut buf = [0u8; 2048];
    loop {
        let (n, from) = socket.recv_from(&mut buf).expect("a packet within 10 s");
        if server.is_some_and(|s| s != from) {
            strays.push(from);
            continue;
        }
        match buf[1] {
            6 => {
                server = Some(from);
                socket.send_to(&[0, 4, 0, 0], from).expect("ACK 0");
            }
            3 => {
                server = Some(from);
                file.extend_from_slice(&buf[4..n]);
                socket.send_to(&[0, 4, buf[2], buf[3]], from).expect("ACK");
                if n - 4 < 1468 {
                    return (file, strays);
                }
            }
            other => panic!("unexpected packet type {other}: {:?}", &buf[..n]),
        }
    }
}

#[tokio::test]
async fn a_client_error_ends_its_transfer_at_once() {
    let (addr, transfers) = start_counted().await;
    let socket = UdpSocket::bind("127.0.0.1:0").expect("udp");
    let first = tokio::task::spawn_blocking({
        let socket = socket.try_clone().expect("clone");
        move || {
            socket
                .send_to(&request(1, "undionly.kpxe"), addr)
                .expect("RRQ");
            socket
                .set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
            let mut buf = [0u8; 2048];
            let (n, from) = socket.recv_from(&mut buf).expect("DATA 1");
            (buf[..n].to_vec(), from)
        }
    })
    .await
    .expect("task");
    assert_eq!(first.0[..4], [0, 3, 0, 1], "DATA block 1");
    assert_eq!(transfers.active(), 1);
    let sent = std::time::Instant::now();
    socket
        .send_to(b"\x00\x05\x00\x00cancelled by the user\x00", first.1)
        .expect("ERROR");
    support_wait(|| transfers.active() == 0).await;
    println!(
        "TFTP: a client's ERROR ended its transfer {:?} after it was sent",
        sent.elapsed()
    );
    // The 3 s ACK timeout would be the only other way out: the ERROR ended it well before.
    assert!(sent.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn a_request_spoofed_from_a_clients_address_does_not_hold_that_client_off() {
    let (addr, transfers) = start_counted().await;
    let client = UdpSocket::bind("127.0.0.1:0").expect("udp");
    // The attacker's request carries the client's ip:port; the server answers the client, who
    // did not ask and does not acknowledge.
    let spoofed = client.try_clone().expect("clone");
    spoofed
        .send_to(&request(1, "ipxe.efi"), addr)
        .expect("spoofed RRQ");
    let spoofed_at = std::time::Instant::now();
    support_wait(|| transfers.active() == 1).await;
    // The one packet the spoofed transfer sent has arrived; it sends nothing more unacknowledged.
    // Read off the runtime's thread: the server sends DATA 1 on it (current-thread runtime), so a
    // blocking read here would hold that send back until the read timed out.
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let (client, first) = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 2048];
        let first = client.recv_from(&mut buf).map(|(_, from)| from);
        (client, first)
    })
    .await
    .expect("read task");
    let spoofed_tid = first.expect("the spoofed transfer's DATA 1");
    // The client's own request, from the same ip:port, is served at once, byte for byte.
    let (fetched, strays) =
        tokio::task::spawn_blocking(move || fetch_on(&client, addr, "undionly.kpxe"))
            .await
            .expect("fetch");
    assert!(
        fetched == original(),
        "the client got its file while the spoofed transfer was open"
    );
    assert!(
        !strays.contains(&spoofed_tid),
        "the unacknowledged transfer sent nothing more: {strays:?}"
    );
    assert!(
        spoofed_at.elapsed() < metalboot::boot::tftp::TftpLimits::default().first_ack_timeout,
        "served while the spoofed transfer still held its slot"
    );
}

/// Polls `done` every 10 ms for up to 10 s.
async fn support_wait(done: impl Fn() -> bool) {
    for _ in 0..1000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached within 10 s");
}

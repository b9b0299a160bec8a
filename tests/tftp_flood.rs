//! The TFTP server under a flood of unacknowledged (spoofable) read requests, alone in its test
//! binary so that the fds and memory it measures are the server's: transfers stay within their
//! budget, are reclaimed within about one timeout, and a real host is served meanwhile.

mod support;

use std::net::UdpSocket;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use metalboot::boot::tftp::Tftp;

const ROOT: &str = "/usr/lib/ipxe";

fn original() -> Vec<u8> {
    std::fs::read(Path::new(ROOT).join("undionly.kpxe")).expect("Debian ipxe's undionly.kpxe")
}

fn request(opcode: u8, name: &str) -> Vec<u8> {
    let mut p = vec![0, opcode];
    p.extend_from_slice(name.as_bytes());
    p.push(0);
    p.extend_from_slice(b"octet\0");
    p
}

/// 200 read requests from one address that never acknowledge. The server keeps at most its
/// per-client budget of transfers, answers the rest with an ERROR packet, sends one packet per
/// accepted request and no resend to an address that never acknowledged, reclaims the abandoned
/// transfers within about one timeout, and a host on another address is served byte-identical.
#[tokio::test]
async fn unacknowledged_requests_stay_within_budget_and_a_real_host_is_served() {
    use metalboot::boot::tftp::TftpLimits;
    let limits = TftpLimits {
        max_transfers: 64,
        max_per_client: 8,
        timeout: Duration::from_secs(1),
        retries: 2,
        ..TftpLimits::default()
    };
    let server = Tftp::bind_with(
        "127.0.0.1:0".parse().expect("addr"),
        Path::new(ROOT),
        limits.clone(),
    )
    .await
    .expect("bind TFTP");
    let addr = server.local_addr().expect("address");
    let transfers = server.transfers();
    tokio::spawn(server.serve());

    const REQUESTS: usize = 200;
    let fds_before = support::open_fds();
    let rss_before = support::rss_kib();
    // One attacker socket (one ip:port) sends every request: the server's fds and memory are
    // then all that grows in this process.
    let attack = tokio::task::spawn_blocking(move || {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("udp");
        for _ in 0..REQUESTS {
            let _ = socket.send_to(&request(1, "undionly.kpxe"), addr);
        }
        // Every answer: a data block (accepted) or an ERROR (refused); nothing is acknowledged.
        let _ = socket.set_read_timeout(Some(Duration::from_millis(300)));
        let (mut data, mut errors, mut bytes) = (0, 0, 0);
        let mut buf = [0u8; 2048];
        while let Ok((n, _)) = socket.recv_from(&mut buf) {
            bytes += n;
            match buf[1] {
                3 | 6 => data += 1,
                5 => errors += 1,
                _ => {}
            }
        }
        (REQUESTS, data, errors, bytes)
    });
    // Meanwhile a real host, on its own address.
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("undionly.kpxe");
    let url = format!("tftp://{addr}/undionly.kpxe");
    let fetched = tokio::task::spawn_blocking({
        let out = out.clone();
        move || {
            Command::new("curl")
                .args(["-sS", "--max-time", "60", "--interface", "127.0.0.2"])
                .args(["--tftp-blksize", "1468", "-o"])
                .arg(&out)
                .arg(url)
                .output()
                .expect("run curl")
        }
    });
    let (peak, fds_peak, rss_peak) = {
        let (mut peak, mut fds, mut rss) = (0, 0, 0);
        while !attack.is_finished() {
            peak = peak.max(transfers.active());
            fds = fds.max(support::open_fds());
            rss = rss.max(support::rss_kib());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (peak, fds, rss)
    };
    let (sent, data, errors, bytes) = attack.await.expect("attack");
    // The accepted transfers wait for ACKs that never come: they are all still in flight now.
    let peak = peak.max(transfers.active());
    let fetched = fetched.await.expect("curl");
    let started = std::time::Instant::now();
    let reclaimed = async {
        while transfers.active() > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let budget = limits.timeout * (limits.retries + 2);
    tokio::time::timeout(budget + Duration::from_secs(5), reclaimed)
        .await
        .expect("abandoned transfers are reclaimed");
    println!(
        "TFTP: {sent} unacknowledged requests from one address; budget {} per client, {} in all; \
         peak transfers {peak}; first answers: {data} data, {errors} ERROR; {bytes} bytes sent to \
         the attacker ({:.1}× the {} request bytes); reclaimed in {:?} (budget {budget:?}); \
         fds {fds_before} → peak {fds_peak} → {}; RSS KiB {rss_before} → peak {rss_peak}; \
         the real host: {}",
        limits.max_per_client,
        limits.max_transfers,
        bytes as f64 / (sent * request(1, "undionly.kpxe").len()) as f64,
        sent * request(1, "undionly.kpxe").len(),
        started.elapsed(),
        support::open_fds(),
        if fetched.status.success() {
            "served"
        } else {
            "FAILED"
        }
    );
    assert!(
        peak <= limits.max_per_client + 1,
        "transfers in flight {peak} stay within the per-client budget (+1: the real host)"
    );
    assert!(data <= limits.max_per_client, "{data} accepted");
    assert!(
        // A socket and the open file per transfer (the attacker's and the real host's
        // included), plus curl's pipes and the attacker's socket.
        fds_peak <= fds_before + 2 * (limits.max_per_client + 1) + 4,
        "two fds per transfer: fds {fds_before} → {fds_peak}"
    );
    assert!(
        support::open_fds() <= fds_before + 2,
        "fds return to baseline"
    );
    assert!(
        rss_peak < rss_before + 16 * 1024,
        "memory grows by less than 16 MiB ({rss_before} → {rss_peak} KiB)"
    );
    assert!(
        errors >= sent - limits.max_per_client - sent / 10,
        "{errors} refused with an ERROR (a few requests of the burst may be dropped by the kernel)"
    );
    assert!(
        fetched.status.success(),
        "{}",
        String::from_utf8_lossy(&fetched.stderr)
    );
    assert!(std::fs::read(&out).expect("downloaded") == original());
}

//! The boot HTTP service under hostile traffic, on loopback against a real manager: slow and idle
//! connections are closed within their budgets, one client address cannot take every connection,
//! an unauthenticated callback is answered before its body is read, and a legitimate client keeps
//! being served throughout. Each attack prints its budget and what was measured.

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use metalboot::boot::serve::HttpLimits;
use metalboot::manager::ManagerOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

const ATTACKERS: usize = 100;

fn limits() -> HttpLimits {
    HttpLimits {
        max_connections: 64,
        max_connections_per_client: 16,
        header_read_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        connection_lifetime: Duration::from_secs(20),
    }
}

/// Connects from a chosen loopback address (the attacker is 127.0.0.1, the host 127.0.0.2).
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(from), 0))?;
    socket.connect(to).await
}

/// Reads until the server closes the connection (or `limit` passes); returns what was read.
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        match tokio::time::timeout(left, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(seen),
            Ok(Ok(n)) => seen.extend_from_slice(&buf[..n]),
        }
    }
}

/// A legitimate host's request, from its own address.
async fn legitimate(boot: SocketAddr) -> bool {
    let client = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)))
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    client
        .get(format!("http://{boot}/boot.ipxe"))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
}

#[tokio::test]
async fn slow_idle_and_unauthenticated_traffic_stays_within_budget() {
    let (ns, _) = (support::namespace("hostile-http").await, ());
    support::boot::install_crds(&ns.client).await;
    let manager = metalboot::manager::start(
        ns.client.clone(),
        ManagerOptions {
            namespace: Some(ns.name.clone()),
            boot_http: "127.0.0.1:0".parse().expect("addr"),
            http_limits: limits(),
            ..Default::default()
        },
    )
    .await
    .expect("manager");
    let boot = manager.boot_addr;
    support::eventually("boot service ready", 30, || async {
        legitimate(boot).await.then_some(())
    })
    .await;
    let fds_before = support::open_fds();
    let rss_before = support::rss_kib();
    let budget = limits();

    // 1. Slowloris: 100 connections from one address, each sending headers that never end.
    let refused_before = metalboot::metrics::http_refused("per_client");
    let started = Instant::now();
    let mut attackers = Vec::new();
    for _ in 0..ATTACKERS {
        if let Ok(mut s) = connect_from(Ipv4Addr::LOCALHOST, boot).await {
            let _ = s
                .write_all(b"GET /boot.ipxe HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .await;
            attackers.push(s);
        }
    }
    let fds_peak = support::open_fds();
    let rss_peak = support::rss_kib();
    let mut served = 0;
    for _ in 0..10 {
        served += usize::from(legitimate(boot).await);
    }
    let mut closed = 0;
    let mut slowest = Duration::ZERO;
    for s in &mut attackers {
        if until_closed(s, budget.header_read_timeout * 3)
            .await
            .is_some()
        {
            closed += 1;
            slowest = slowest.max(started.elapsed());
        }
    }
    let refused = metalboot::metrics::http_refused("per_client") - refused_before;
    println!(
        "slowloris: {ATTACKERS} connections from one address; budget {} per address, headers within \
         {:?}; refused at accept {refused}, all closed: {closed}/{ATTACKERS} after at most {slowest:?}; \
         legitimate client served {served}/10; fds {fds_before} → peak {fds_peak}",
        budget.max_connections_per_client, budget.header_read_timeout
    );
    assert_eq!(closed, attackers.len(), "every slow connection is closed");
    assert!(
        refused >= (ATTACKERS - budget.max_connections_per_client) as u64,
        "one address holds at most {} connections (refused {refused})",
        budget.max_connections_per_client
    );
    assert_eq!(
        served, 10,
        "the legitimate client is served during the attack"
    );
    drop(attackers);

    // 2. Idle keep-alive: a connection that made one request and then says nothing is closed.
    let mut idle = connect_from(Ipv4Addr::LOCALHOST, boot)
        .await
        .expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("request");
    let started = Instant::now();
    let answered = until_closed(
        &mut idle,
        budget.connection_lifetime + Duration::from_secs(10),
    )
    .await
    .expect("the idle connection is closed within the connection lifetime");
    println!(
        "idle keep-alive: closed after {:?} (lifetime budget {:?})",
        started.elapsed(),
        budget.connection_lifetime
    );
    assert!(String::from_utf8_lossy(&answered).starts_with("HTTP/1.1 200"));

    // 3. An unauthenticated callback announcing 100 MiB: answered without reading the body.
    let mut post = connect_from(Ipv4Addr::LOCALHOST, boot)
        .await
        .expect("connect");
    let token = "f".repeat(64);
    post.write_all(
        format!("POST /callback/{token} HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")
            .as_bytes(),
    )
    .await
    .expect("headers");
    let started = Instant::now();
    let mut head = vec![0u8; 64];
    let n = tokio::time::timeout(budget.request_timeout, post.read(&mut head))
        .await
        .expect("an answer before the body is sent")
        .expect("read");
    let status = String::from_utf8_lossy(&head[..n]).to_string();
    println!(
        "unauthenticated 100 MiB callback: {:?} after {:?}, 0 body bytes sent",
        status.lines().next().unwrap_or(""),
        started.elapsed()
    );
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");

    // 4. A flood of unknown tokens while attempts are in flight: each costs a map lookup, not a
    //    parse of every boot Secret (64 KiB of user-data each here).
    const ATTEMPTS: usize = 20;
    const FLOOD: usize = 1000;
    for i in 0..ATTEMPTS {
        let machine = support::boot::create_machine(
            &ns.client,
            &ns.name,
            &format!("m{i}"),
            metalboot::api::metalmachine::BootProfile {
                kernel: "vmlinuz".into(),
                initrds: vec![],
                cmdline: None,
            },
        )
        .await;
        support::boot::create_boot_secret(
            &ns.client,
            &ns.name,
            &machine,
            &format!("h{i}"),
            &[b'x'; 65536],
        )
        .await;
    }
    support::eventually("the boot service sees every attempt", 30, || async {
        (manager
            .boot
            .as_ref()
            .expect("boot service")
            .stores
            .boot_secrets
            .state()
            .len()
            >= ATTEMPTS)
            .then_some(())
    })
    .await;
    let parsed_before = manager
        .boot
        .as_ref()
        .expect("boot service")
        .secrets_parsed();
    let flooder = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3)))
        .build()
        .expect("client");
    let started = Instant::now();
    let mut refused = 0;
    for i in 0..FLOOD {
        let token = format!("{i:064x}");
        if let Ok(r) = flooder
            .get(format!("http://{boot}/nocloud/{token}/meta-data"))
            .send()
            .await
        {
            refused += usize::from(r.status() == reqwest::StatusCode::NOT_FOUND);
        }
    }
    let parsed = manager
        .boot
        .as_ref()
        .expect("boot service")
        .secrets_parsed()
        - parsed_before;
    println!(
        "unknown-token flood: {FLOOD} requests ({refused} answered 404) in {:?} with {ATTEMPTS} \
         attempts in flight; boot Secrets parsed: {parsed} (a scan per request would be {})",
        started.elapsed(),
        FLOOD * ATTEMPTS
    );
    assert_eq!(refused, FLOOD);
    assert!(
        parsed <= 2 * ATTEMPTS as u64,
        "token lookups go through the index: {parsed} parses for {FLOOD} requests"
    );

    // Afterwards: the process is back near where it started, and still serves.
    let fds_after = support::eventually("fds back near baseline", 30, || async {
        let now = support::open_fds();
        (now <= fds_before + 8).then_some(now)
    })
    .await;
    println!(
        "fds: before {fds_before}, peak {fds_peak}, after {fds_after}; RSS KiB: before {rss_before}, \
         during the slowloris {rss_peak}, after {}",
        support::rss_kib()
    );
    assert!(
        rss_peak < rss_before + 64 * 1024,
        "the attack costs less than 64 MiB of memory ({rss_before} → {rss_peak} KiB)"
    );
    assert!(legitimate(boot).await);
    drop(manager);
}

//! The lab's TLS passthrough relay to the apiserver (`lab up --kubeadm`): bytes pass unchanged
//! both ways, and past its connection budget a new connection waits for a slot instead of
//! costing the relay another upstream connection. The upstream is a real TCP server on
//! loopback that records, in order, the connections it accepts and sees closed.

use std::sync::Arc;

use metalboot::lab::relay::{TCP_RELAY_MAX_CONNECTIONS, serve_tcp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Accepted(u8),
    Closed(u8),
}

/// An echo server: each connection's first byte names it; it echoes until EOF.
async fn upstream(log: Arc<Mutex<Vec<Seen>>>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let Ok(n) = stream.read(&mut buf).await else {
                    return;
                };
                if n == 0 {
                    return;
                }
                let name = buf[0];
                log.lock().await.push(Seen::Accepted(name));
                let _ = stream.write_all(&buf[..n]).await;
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            let _ = stream.write_all(&buf[..n]).await;
                        }
                    }
                }
                log.lock().await.push(Seen::Closed(name));
            });
        }
    });
    addr
}

async fn echo(stream: &mut TcpStream, byte: u8) {
    stream.write_all(&[byte]).await.expect("write");
    let mut back = [0u8; 1];
    stream.read_exact(&mut back).await.expect("echo");
    assert_eq!(back[0], byte);
}

#[tokio::test]
async fn bytes_pass_unchanged_and_past_the_budget_a_connection_waits_for_a_slot() {
    let log = Arc::new(Mutex::new(Vec::new()));
    let target = upstream(log.clone()).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let relay = listener.local_addr().expect("addr");
    tokio::spawn(serve_tcp(listener, target));

    // Fill every slot; each connection is named by its first byte (mod 256, with 0 kept for
    // the one past the budget).
    let mut held = Vec::new();
    for i in 0..TCP_RELAY_MAX_CONNECTIONS {
        let mut stream = TcpStream::connect(relay).await.expect("connect");
        echo(&mut stream, (i % 255) as u8 + 1).await;
        held.push(stream);
    }
    // A TLS record's worth of bytes passes through unchanged.
    let record: Vec<u8> = (0..16384u32).map(|i| (i * 7 % 251) as u8).collect();
    held[0].write_all(&record).await.expect("write");
    let mut back = vec![0u8; record.len()];
    held[0].read_exact(&mut back).await.expect("read");
    assert_eq!(back, record);

    // One past the budget: the kernel accepts it, the relay does not serve it yet. Freeing one
    // slot serves it, and only then does the upstream see it: after the freed one closed.
    let mut extra = TcpStream::connect(relay).await.expect("connect");
    extra.write_all(&[0]).await.expect("write");
    let freed = held.pop().expect("a held connection");
    let freed_name = ((TCP_RELAY_MAX_CONNECTIONS - 1) % 255) as u8 + 1;
    drop(freed);
    let mut back = [0u8; 1];
    extra
        .read_exact(&mut back)
        .await
        .expect("served once a slot is free");
    assert_eq!(back[0], 0);
    let log = log.lock().await.clone();
    let accepted_extra = log
        .iter()
        .position(|s| *s == Seen::Accepted(0))
        .expect("the upstream saw the extra connection");
    let closed_freed = log
        .iter()
        .position(|s| *s == Seen::Closed(freed_name))
        .expect("the upstream saw the freed connection close");
    assert!(
        closed_freed < accepted_extra,
        "the connection past the budget reached the upstream before a slot was free: {:?}",
        &log[log.len().saturating_sub(4)..]
    );
    assert_eq!(
        log.iter()
            .filter(|s| matches!(s, Seen::Accepted(_)))
            .count(),
        TCP_RELAY_MAX_CONNECTIONS + 1
    );
}

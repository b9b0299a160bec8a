//! Network-boot storm (not a test): 200 simulated PXE clients on a bridge in network namespaces
//! the benchmark makes. Each client does what PXE firmware does — DHCP DISCOVER until a boot
//! server names its program, TFTP `undionly.kpxe` (blksize 1468, as EDK2 asks), then an HTTP GET
//! of a 20 MB kernel — first against metalboot (proxyDHCP + its TFTP + the boot HTTP server with
//! its budgets), then against dnsmasq (DHCP + TFTP) + nginx, same machine, same run. Prints the
//! time of each phase and the ratios. Run with `hack/bench-boot.sh` (installs nginx, release build).
//!
//! Each client has its own address (as real hosts do), so per-client budgets apply as they would
//! in a rack. The benchmark process itself runs in the clients' namespace; servers get their
//! sockets in the provisioning namespace.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode};
use dhcproto::{Decodable, Encodable};
use metalboot::boot::dhcp::BootFiles;
use metalboot::boot::dhcpd::{BootClients, DhcpConfig, DhcpService};
use metalboot::boot::tftp::Tftp;
use metalboot::lab::net::{BOOT_IP, BRIDGE, LabNetwork};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UdpSocket;

const CLIENTS: u32 = 200;
const KERNEL_MB: usize = 20;
const HTTP_PORT: u16 = 8080;

fn client_ip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 20 + i as u8)
}

fn mac(i: u32) -> [u8; 6] {
    [0x52, 0x54, 0x00, 0xbe, (i >> 8) as u8, i as u8]
}

struct Everyone;

impl BootClients for Everyone {
    fn provisioning(&self, _mac: &str) -> bool {
        true
    }
}

#[derive(Default, Debug, Clone, Copy)]
struct Phases {
    dhcp: f64,
    tftp: f64,
    http: f64,
    failures: usize,
}

impl Phases {
    fn total(&self) -> f64 {
        self.dhcp + self.tftp + self.http
    }
}

/// DISCOVER from every client at once; done when each has an answer naming a boot file.
async fn dhcp_phase() -> (f64, usize) {
    // This process is in the clients' namespace: bound to its link, as firmware is.
    let socket = metalboot::boot::netns::NetNamespace::current()
        .udp_socket(
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 68)),
            Some("eth0"),
            true,
        )
        .expect("client DHCP socket");
    let discover = |i: u32| {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_htype(HType::Eth)
            .set_xid(0xb007_0000 + i)
            .set_flags(dhcproto::v4::Flags::default().set_broadcast())
            .set_chaddr(&mac(i));
        let opts = m.opts_mut();
        opts.insert(DhcpOption::MessageType(MessageType::Discover));
        opts.insert(DhcpOption::ClassIdentifier(
            b"PXEClient:Arch:00000:UNDI:002001".to_vec(),
        ));
        opts.insert(DhcpOption::ClientSystemArchitecture(0u16.into()));
        m.to_vec().expect("encode")
    };
    let socket = Arc::new(socket);
    let started = Instant::now();
    // Answers are read while DISCOVERs go out, so the clients' socket buffer is not the limit.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader = {
        let socket = socket.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            while let Ok((n, _)) = socket.recv_from(&mut buf).await {
                if let Ok(m) = Message::decode(&mut dhcproto::Decoder::new(&buf[..n]))
                    && m.opcode() == Opcode::BootReply
                    && m.fname().is_some_and(|f| f.iter().any(|b| *b != 0))
                    && tx.send(m.xid()).is_err()
                {
                    break;
                }
            }
        })
    };
    let mut answered = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    // Like firmware: DISCOVER, and again after a second without an answer.
    'rounds: while tokio::time::Instant::now() < deadline {
        for i in 0..CLIENTS {
            if !answered.contains(&(0xb007_0000 + i)) {
                socket
                    .send_to(&discover(i), (Ipv4Addr::BROADCAST, 67))
                    .await
                    .expect("send DISCOVER");
                tokio::task::yield_now().await;
            }
        }
        let round = tokio::time::Instant::now() + Duration::from_secs(1);
        while answered.len() < CLIENTS as usize {
            match tokio::time::timeout_at(round, rx.recv()).await {
                Ok(Some(xid)) => {
                    answered.insert(xid);
                }
                _ => continue 'rounds,
            }
        }
        break;
    }
    reader.abort();
    (
        started.elapsed().as_secs_f64(),
        CLIENTS as usize - answered.len(),
    )
}

/// One TFTP read with blksize 1468, from the client's own address; returns the bytes received.
async fn tftp_read(from: Ipv4Addr, file: &str) -> Result<u64, String> {
    let socket = UdpSocket::bind((from, 0))
        .await
        .map_err(|e| e.to_string())?;
    let mut rrq = vec![0, 1];
    for part in [file, "octet", "blksize", "1468", "tsize", "0"] {
        rrq.extend_from_slice(part.as_bytes());
        rrq.push(0);
    }
    socket
        .send_to(&rrq, (BOOT_IP, 69))
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 2048];
    let mut expected: u16 = 1;
    let mut bytes = 0u64;
    let mut blksize = 512usize;
    loop {
        let (n, server) = tokio::time::timeout(Duration::from_secs(10), socket.recv_from(&mut buf))
            .await
            .map_err(|_| "TFTP timeout".to_string())?
            .map_err(|e| e.to_string())?;
        match u16::from_be_bytes([buf[0], buf[1]]) {
            6 => {
                // OACK: take the block size, acknowledge block 0.
                let fields: Vec<&[u8]> = buf[2..n].split(|b| *b == 0).collect();
                for pair in fields.chunks(2) {
                    if pair.len() == 2 && pair[0].eq_ignore_ascii_case(b"blksize") {
                        blksize = std::str::from_utf8(pair[1])
                            .ok()
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(512);
                    }
                }
                socket
                    .send_to(&[0, 4, 0, 0], server)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            3 => {
                let block = u16::from_be_bytes([buf[2], buf[3]]);
                if block == expected {
                    bytes += (n - 4) as u64;
                    expected = expected.wrapping_add(1);
                }
                let [hi, lo] = block.to_be_bytes();
                socket
                    .send_to(&[0, 4, hi, lo], server)
                    .await
                    .map_err(|e| e.to_string())?;
                if n - 4 < blksize && block.wrapping_add(1) == expected {
                    return Ok(bytes);
                }
            }
            5 => return Err(String::from_utf8_lossy(&buf[4..n]).into_owned()),
            _ => {}
        }
    }
}

/// A plain HTTP/1.1 GET from the client's own address, read to the end.
async fn http_get(from: Ipv4Addr, path: &str) -> Result<u64, String> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
    socket
        .bind(SocketAddr::new(IpAddr::V4(from), 0))
        .map_err(|e| e.to_string())?;
    let mut stream = socket
        .connect(SocketAddr::new(IpAddr::V4(BOOT_IP), HTTP_PORT))
        .await
        .map_err(|e| e.to_string())?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {BOOT_IP}\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut bytes = 0u64;
    let mut head_ok = None;
    loop {
        let n = stream.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        if head_ok.is_none() {
            head_ok = Some(buf.starts_with(b"HTTP/1.1 200"));
        }
        bytes += n as u64;
    }
    if head_ok == Some(true) {
        Ok(bytes)
    } else {
        Err("not 200".into())
    }
}

async fn storm() -> Phases {
    let (dhcp, mut failures) = dhcp_phase().await;
    let started = Instant::now();
    let tftp: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(tftp_read(client_ip(i), "undionly.kpxe")))
        .collect();
    for t in tftp {
        if !matches!(t.await, Ok(Ok(b)) if b > 0) {
            failures += 1;
        }
    }
    let tftp = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let http: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(http_get(client_ip(i), "/artifacts/vmlinuz")))
        .collect();
    for h in http {
        if !matches!(h.await, Ok(Ok(b)) if b as usize >= KERNEL_MB << 20) {
            failures += 1;
        }
    }
    Phases {
        dhcp,
        tftp,
        http: started.elapsed().as_secs_f64(),
        failures,
    }
}

fn stop(mut child: Child) {
    // SIGTERM lets nginx's master stop its workers.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let _ = child.wait();
}

fn main() {
    let work = tempfile::tempdir().expect("tempdir");
    let mut net = LabNetwork::create(&format!("mbb-netboot-{}", std::process::id()))
        .expect("network namespaces (root, iproute2)");
    let clients = net.add_peer("clients", None).expect("clients namespace");
    let batch: String = (0..CLIENTS)
        .map(|i| format!("addr add {}/24 dev eth0\n", client_ip(i)))
        .collect();
    let batch_file = work.path().join("addrs");
    std::fs::write(&batch_file, batch).expect("batch");
    let ok = Command::new("ip")
        .args(["-n", &clients, "-batch"])
        .arg(&batch_file)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "client addresses");
    let www = work.path().join("www");
    std::fs::create_dir_all(www.join("artifacts")).expect("www");
    let kernel: Vec<u8> = (0..KERNEL_MB << 20)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8)
        .collect();
    std::fs::write(www.join("artifacts/vmlinuz"), &kernel).expect("kernel");
    drop(kernel);
    let provisioning = net.namespace().expect("provisioning namespace");

    // This thread (and the runtime's, created from it) lives in the clients' namespace.
    let client_ns = std::fs::File::open(format!("/var/run/netns/{clients}")).expect("netns");
    nix::sched::setns(&client_ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");

    let ours = runtime.block_on(async {
        let mut config = DhcpConfig::new(
            BOOT_IP,
            BootFiles::new(&format!("http://{BOOT_IP}:{HTTP_PORT}")),
        );
        config.interface = Some(BRIDGE.into());
        let dhcp = DhcpService::bind(&provisioning, config, Arc::new(Everyone)).expect("DHCP");
        let tftp = Tftp::bind_in(
            &provisioning,
            SocketAddr::from((BOOT_IP, 69)),
            Path::new("/usr/lib/ipxe"),
            Default::default(),
        )
        .expect("TFTP");
        let listener = provisioning
            .tcp_listener(SocketAddr::from((BOOT_IP, HTTP_PORT)))
            .expect("HTTP");
        let app = axum::Router::new().nest(
            "/artifacts",
            metalboot::boot::artifacts::artifacts_router(www.join("artifacts")),
        );
        let files = metalboot::boot::front::FileRoutes::default().route(
            "/artifacts",
            &www.join("artifacts"),
            None,
        );
        let servers = [
            tokio::spawn(async move {
                let _ = dhcp.serve().await;
            }),
            tokio::spawn(async move {
                let _ = tftp.serve().await;
            }),
            tokio::spawn(async move {
                let _ = metalboot::boot::serve::serve_with_files(
                    listener,
                    app,
                    Default::default(),
                    files,
                )
                .await;
            }),
        ];
        let phases = storm().await;
        for s in servers {
            s.abort();
            let _ = s.await;
        }
        phases
    });

    // dnsmasq: DHCP with the boot file, its own TFTP server; nginx for HTTP.
    let lab = net.netns.clone();
    let (_, _) = net
        .start_dnsmasq(
            &lab,
            BRIDGE,
            work.path(),
            "dnsmasq",
            &[
                "--dhcp-range=10.77.0.20,10.77.0.250,255.255.255.0,1h",
                "--no-ping",
                "--dhcp-boot=undionly.kpxe",
                "--enable-tftp",
                "--tftp-root=/usr/lib/ipxe",
                "--tftp-max=1000",
                "--dhcp-lease-max=1000",
            ],
        )
        .expect("dnsmasq");
    let conf = work.path().join("nginx.conf");
    std::fs::write(&conf, format!(
        "daemon off; worker_processes auto; pid {pid}; error_log {log};\nevents {{ worker_connections 4096; }}\nhttp {{ access_log off; sendfile on; tcp_nopush on;\n server {{ listen {BOOT_IP}:{HTTP_PORT}; root {root}; }} }}\n",
        pid = work.path().join("nginx.pid").display(), log = work.path().join("nginx.err").display(), root = www.display()
    )).expect("nginx.conf");
    let nginx = Command::new("ip")
        .args(["netns", "exec", &lab, "nginx", "-c"])
        .arg(&conf)
        .arg("-p")
        .arg(work.path())
        .spawn()
        .expect("nginx (hack/bench-boot.sh installs it)");
    let theirs = runtime.block_on(async {
        // Ready when both answer: nginx's port and dnsmasq's TFTP.
        for _ in 0..100 {
            if http_get(client_ip(0), "/artifacts/vmlinuz").await.is_ok()
                && tftp_read(client_ip(0), "undionly.kpxe").await.is_ok()
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        storm().await
    });
    stop(nginx);
    drop(net);

    println!("\n{CLIENTS} PXE clients: DHCP → TFTP undionly.kpxe → HTTP {KERNEL_MB} MB kernel");
    println!(
        "{:<22} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "", "DHCP", "TFTP", "HTTP", "total", "failures"
    );
    for (name, p) in [("metalboot", ours), ("dnsmasq + nginx", theirs)] {
        println!(
            "{name:<22} {:>7.3}s {:>7.3}s {:>7.3}s {:>7.3}s {:>9}",
            p.dhcp,
            p.tftp,
            p.http,
            p.total(),
            p.failures
        );
    }
    println!(
        "ratio (metalboot / dnsmasq+nginx): DHCP {:.2}×, TFTP {:.2}×, HTTP {:.2}×, total {:.2}×",
        ours.dhcp / theirs.dhcp,
        ours.tftp / theirs.tftp,
        ours.http / theirs.http,
        ours.total() / theirs.total()
    );
}

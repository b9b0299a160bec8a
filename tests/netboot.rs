//! Real network boot on a bridged network the test makes itself (two network namespaces, a
//! bridge, tap devices): dnsmasq is the site's DHCP server (addresses only), metalboot's
//! proxyDHCP, TFTP and HTTP sockets sit on the bridge, and three QEMU hosts boot with real
//! firmware — SeaBIOS with the NIC's iPXE ROM, OVMF/EDK2 PXE → TFTP `ipxe.efi`, and OVMF/EDK2
//! HTTP Boot — until each fetches the boot service's iPXE script and chains to its own URL.
//! The Kubernetes side (MetalHosts, the callback) is `e2e_lab`'s, on the same network code.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{ConnectInfo, Path};
use axum::routing::get;
use metalboot::boot::dhcp::{Answer, BootFiles, BootOffer};
use metalboot::boot::dhcpd::{BootClients, DhcpConfig, DhcpService};
use metalboot::boot::front::FileRoutes;
use metalboot::boot::serve::{HttpLimits, serve_with_files};
use metalboot::boot::tftp::{Tftp, TransferObserver};
use metalboot::lab::net::{BOOT_IP, LabNetwork, POOL};
use metalboot::lab::qemu::{Accel, Firmware, HostNetwork, QemuHost, QemuHostSpec};

/// What the boot service saw, per MAC.
#[derive(Default)]
struct Seen {
    provisioning: BTreeSet<String>,
    answers: Mutex<Vec<Answer>>,
    addresses: Mutex<BTreeMap<IpAddr, String>>,
    tftp: Mutex<Vec<(String, String)>>,
    reached: Mutex<BTreeMap<String, IpAddr>>,
    nbp: Mutex<Vec<IpAddr>>,
}

impl BootClients for Seen {
    fn provisioning(&self, mac: &str) -> bool {
        self.provisioning.contains(mac)
    }
    fn answered(&self, answer: &Answer) {
        self.answers.lock().unwrap().push(answer.clone());
    }
    fn address_learned(&self, mac: &str, ip: Ipv4Addr) {
        self.addresses
            .lock()
            .unwrap()
            .insert(IpAddr::V4(ip), mac.to_string());
    }
}

impl TransferObserver for Seen {
    fn transfer_done(&self, client: SocketAddr, file: &str) {
        let mac = self
            .addresses
            .lock()
            .unwrap()
            .get(&client.ip())
            .cloned()
            .unwrap_or_else(|| format!("unknown {}", client.ip()));
        self.tftp.lock().unwrap().push((mac, file.to_string()));
    }
}

const HTTP_PORT: u16 = 8080;

fn boot_router(seen: Arc<Seen>) -> Router {
    let reached = seen.clone();
    let nbp = seen.clone();
    Router::new()
        .route(
            "/boot.ipxe",
            get(|| async {
                format!("#!ipxe\nchain http://{BOOT_IP}:{HTTP_PORT}/reached/${{net0/mac}}\n")
            }),
        )
        .route(
            "/reached/{mac}",
            get(
                move |Path(mac): Path<String>, ConnectInfo(from): ConnectInfo<SocketAddr>| async move {
                    reached.reached.lock().unwrap().entry(mac).or_insert(from.ip());
                    // Keep the host busy and quiet until the test ends.
                    "#!ipxe\nprompt --timeout 600000 reached\n"
                },
            ),
        )
        .nest_service(
            "/nbp",
            tower::ServiceBuilder::new()
                .map_request(move |r: axum::http::Request<axum::body::Body>| {
                    if let Some(ConnectInfo(from)) =
                        r.extensions().get::<ConnectInfo<SocketAddr>>()
                    {
                        nbp.nbp.lock().unwrap().push(from.ip());
                    }
                    r
                })
                .service(tower_http::services::ServeDir::new("/usr/lib/ipxe")),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bios_uefi_pxe_and_uefi_http_boot_hosts_chain_to_the_boot_service_over_a_bridge() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut net = LabNetwork::create(&format!("mbt-netboot-{}", std::process::id()))
        .expect("the test's network namespaces (needs root, iproute2)");
    net.start_site_dhcp(dir.path()).expect("dnsmasq");
    let ns = net.namespace().expect("namespace");

    let hosts = [
        ("bios", "52:54:00:4e:00:01", Firmware::Bios),
        ("uefi-pxe", "52:54:00:4e:00:02", Firmware::UefiPxe),
        ("uefi-http", "52:54:00:4e:00:03", Firmware::UefiHttp),
    ];
    let seen = Arc::new(Seen {
        provisioning: hosts.iter().map(|h| h.1.to_string()).collect(),
        ..Default::default()
    });

    let tftp = Tftp::bind_in(
        &ns,
        SocketAddr::from((BOOT_IP, 69)),
        std::path::Path::new("/usr/lib/ipxe"),
        Default::default(),
    )
    .expect("TFTP in the namespace")
    .with_observer(seen.clone());
    tokio::spawn(tftp.serve());
    let listener = ns
        .tcp_listener(SocketAddr::from((BOOT_IP, HTTP_PORT)))
        .expect("HTTP in the namespace");
    let app = boot_router(seen.clone());
    // The boot server as the manager runs it: the firmware's NBP download over UEFI HTTP Boot goes
    // out through the front with sendfile, and counts here once it is whole.
    let fetched = seen.clone();
    let files = FileRoutes::default().route(
        "/nbp",
        std::path::Path::new("/usr/lib/ipxe"),
        Some(Arc::new(move |from: IpAddr, _: &str| {
            fetched.nbp.lock().unwrap().push(from)
        })),
    );
    let sent_before = metalboot::metrics::sendfile_bytes();
    tokio::spawn(serve_with_files(
        listener,
        app,
        HttpLimits::default(),
        files,
    ));
    let mut config = DhcpConfig::new(
        BOOT_IP,
        BootFiles::new(&format!("http://{BOOT_IP}:{HTTP_PORT}")),
    );
    config.interface = Some("br0".into());
    let dhcp = DhcpService::bind(&ns, config, seen.clone()).expect("proxyDHCP in the namespace");
    tokio::spawn(dhcp.serve());

    let mut qemus = Vec::new();
    for (i, (name, mac, firmware)) in hosts.iter().enumerate() {
        let tap = format!("tap{i}");
        net.add_tap(&tap).expect("tap");
        let host = QemuHost::new(QemuHostSpec {
            name: name.to_string(),
            uuid: format!("6d62a1b0-0000-4000-8000-00000000004{i}"),
            mac: mac.to_string(),
            memory_mib: 256,
            network: HostNetwork::Tap {
                netns: net.netns.clone(),
                ifname: tap,
            },
            firmware: *firmware,
            dir: dir.path().join(name),
            accel: Accel::Tcg,
            graceful_seconds: 1,
            disk: None,
        });
        host.power_on().await.expect("power on");
        qemus.push(host);
    }

    let reached = support::eventually("every host to chain to its own URL", 300, || {
        let seen = seen.clone();
        async move {
            let reached = seen.reached.lock().unwrap().clone();
            (reached.len() == hosts.len()).then_some(reached)
        }
    })
    .await;
    for q in &qemus {
        let _ = q.force_off().await;
    }
    let answers = seen.answers.lock().unwrap().clone();
    let offers_to = |mac: &str| -> Vec<BootOffer> {
        answers
            .iter()
            .filter(|a| a.mac == mac)
            .map(|a| a.offer.clone())
            .collect()
    };
    let tftp = seen.tftp.lock().unwrap().clone();
    for a in &answers {
        println!("proxyDHCP {} {:?}", a.mac, a.offer);
    }
    println!("TFTP done: {tftp:?}\nreached: {reached:?}");

    // Addresses are the site server's: every host's iPXE came from its pool.
    let leases = std::fs::read_to_string(net.dnsmasq_leases.as_ref().expect("leases"))
        .expect("dnsmasq leases");
    for (_, mac, _) in &hosts {
        let IpAddr::V4(ip) = reached[*mac] else {
            panic!("{mac}: not IPv4")
        };
        assert!(ip >= POOL.0 && ip <= POOL.1, "{mac} came from {ip}");
        assert!(
            leases.contains(&format!("{mac} {ip}")),
            "dnsmasq leased {ip} to {mac}: {leases}"
        );
    }
    // The UEFI PXE host: EDK2 fetched ipxe.efi over TFTP, attributed to its MAC.
    assert!(
        tftp.contains(&(hosts[1].1.to_string(), "ipxe.efi".to_string())),
        "TFTP log: {tftp:?}"
    );
    assert!(offers_to(hosts[1].1).contains(&BootOffer::Tftp {
        file: "ipxe.efi".into()
    }));
    // The HTTP Boot host: the program over HTTP, never TFTP.
    assert!(
        offers_to(hosts[2].1).contains(&BootOffer::Http {
            url: format!("http://{BOOT_IP}:{HTTP_PORT}/nbp/ipxe.efi")
        }),
        "{answers:?}"
    );
    assert!(seen.nbp.lock().unwrap().contains(&reached[hosts[2].1]));
    assert!(
        metalboot::metrics::sendfile_bytes() > sent_before,
        "the UEFI firmware's NBP went out with sendfile"
    );
    assert!(!tftp.iter().any(|(mac, _)| mac == hosts[2].1));
    // Every iPXE (the BIOS ROM's and the chain-loaded ones) got the script, not a program.
    for (_, mac, _) in &hosts {
        assert!(offers_to(mac).contains(&BootOffer::Http {
            url: format!("http://{BOOT_IP}:{HTTP_PORT}/boot.ipxe")
        }));
    }
}

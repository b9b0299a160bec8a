//! Full-DHCP mode on an isolated provisioning network the test makes (namespaces, a bridge):
//! metalboot is the only DHCP server. Real clients (busybox `udhcpc`, each in a namespace of its
//! own with its own MAC) get addresses from the pool; a MetalHost's reservation goes to its MAC;
//! a restarted service, reading its lease file, never hands out a live lease again and gives a
//! client its address back; a PXE client metalboot provisions gets address and boot program in
//! one answer.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode};
use dhcproto::{Decodable, Encodable};
use metalboot::boot::dhcp::BootFiles;
use metalboot::boot::dhcpd::{BootClients, DhcpConfig, DhcpService};
use metalboot::boot::leases::{Leases, Pool};
use metalboot::boot::netns::NetNamespace;
use metalboot::lab::net::{BOOT_IP, LabNetwork};

const RESERVED_MAC: &str = "52:54:00:f0:00:05";
const RESERVED_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 50);
const PXE_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0xf0, 0x00, 0x09];

struct Hosts;

impl BootClients for Hosts {
    fn provisioning(&self, mac: &str) -> bool {
        mac == "52:54:00:f0:00:09"
    }
    fn reservations(&self) -> BTreeMap<String, Ipv4Addr> {
        BTreeMap::from([(RESERVED_MAC.to_string(), RESERVED_IP)])
    }
}

fn start(ns: &NetNamespace, lease_file: &Path) -> tokio::task::JoinHandle<()> {
    let pool = Pool::new(
        "10.77.0.0/24".parse().expect("cidr"),
        Some("10.77.0.100-10.77.0.110"),
        vec![BOOT_IP],
        None,
        Duration::from_secs(3600),
    )
    .expect("pool");
    let leases = Leases::load(pool, Some(lease_file)).expect("leases");
    let mut config = DhcpConfig::new(BOOT_IP, BootFiles::new(&format!("http://{BOOT_IP}:8080")));
    config.interface = Some("br0".into());
    let dhcp = DhcpService::bind(ns, config, Arc::new(Hosts))
        .expect("DHCP")
        .with_leases(leases);
    tokio::spawn(async move {
        let _ = dhcp.serve().await;
    })
}

/// Runs busybox udhcpc in `netns` until it holds a lease; returns the address it took.
async fn udhcpc(netns: &str, dir: &Path) -> Ipv4Addr {
    let script = dir.join(format!("{netns}.sh"));
    let out = dir.join(format!("{netns}.lease"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n[ \"$1\" = bound ] && echo \"$ip\" > {}\nexit 0\n",
            out.display()
        ),
    )
    .expect("script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    let _ = std::fs::remove_file(&out);
    let status = tokio::process::Command::new("ip")
        .args(["netns", "exec", netns, "busybox", "udhcpc"])
        .args(["-i", "eth0", "-n", "-q", "-f", "-t", "5", "-T", "1", "-s"])
        .arg(&script)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .await
        .expect("udhcpc (busybox-static)");
    assert!(status.success(), "udhcpc in {netns} got no lease");
    std::fs::read_to_string(&out)
        .expect("lease written by the script")
        .trim()
        .parse()
        .expect("an address")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_dhcp_leases_survive_a_restart_and_honour_reservations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let lease_file = dir.path().join("leases.json");
    let mut net = LabNetwork::create(&format!("mbt-full-{}", std::process::id()))
        .expect("the test's network namespaces (needs root, iproute2)");
    let ns = net.namespace().expect("namespace");
    let mut client = |suffix: &str, mac: &str| {
        let peer = net.add_peer(suffix, None).expect("client namespace");
        let ok = std::process::Command::new("ip")
            .args(["-n", &peer, "link", "set", "eth0", "address", mac])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "MAC of {peer}");
        peer
    };
    let a = client("a", "52:54:00:f0:00:01");
    let b = client("b", "52:54:00:f0:00:02");
    let reserved = client("r", RESERVED_MAC);
    let pxe = client("p", "52:54:00:f0:00:09");
    let late = client("c", "52:54:00:f0:00:03");
    let flooder = client("f", "02:f1:00:00:00:01");

    let service = start(&ns, &lease_file);
    let first = udhcpc(&a, dir.path()).await;
    assert_eq!(
        first,
        Ipv4Addr::new(10, 77, 0, 100),
        "the pool's first address"
    );
    assert_eq!(udhcpc(&reserved, dir.path()).await, RESERVED_IP);
    let recorded = std::fs::read_to_string(&lease_file).expect("lease file");
    assert!(recorded.contains("52:54:00:f0:00:01"), "{recorded}");

    // A restart: the new service knows A's lease from the file.
    service.abort();
    let _ = service.await;
    let service = start(&ns, &lease_file);
    let second = udhcpc(&b, dir.path()).await;
    assert_ne!(second, first, "a restarted service gave a live lease again");
    assert_eq!(
        udhcpc(&a, dir.path()).await,
        first,
        "a client gets its address back"
    );

    // DHCP starvation: 300 DISCOVERs from made-up MACs. Offers held are bounded, so a real
    // client arriving after them still gets an address.
    let offered = || support::dhcp_packets("offered");
    // From a machine of its own: 300 broadcast OFFERs to made-up MACs must not fill the PXE
    // client's socket buffer below.
    let flood = NetNamespace::open(&flooder)
        .expect("flooder namespace")
        .udp_socket(
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 68)),
            Some("eth0"),
            true,
        )
        .expect("flood socket");
    let before = offered();
    for i in 0..300u32 {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_htype(HType::Eth)
            .set_xid(10_000 + i)
            .set_chaddr(&[0x02, 0xf1, 0x00, 0x00, (i >> 8) as u8, i as u8]);
        m.opts_mut()
            .insert(DhcpOption::MessageType(MessageType::Discover));
        let _ = flood
            .send_to(&m.to_vec().expect("encode"), (Ipv4Addr::BROADCAST, 67))
            .await;
        if i % 25 == 24 {
            // Let the service keep up, so the flood is decided rather than dropped.
            let want = before + u64::from(i) / 2;
            support::eventually("the flood to be answered", 20, || async {
                (offered() >= want).then_some(())
            })
            .await;
        }
    }
    drop(flood);
    let third = udhcpc(&late, dir.path()).await;
    assert!(![first, second, RESERVED_IP].contains(&third), "{third}");

    // A PXE client metalboot provisions: address and boot program in one answer.
    let socket = NetNamespace::open(&pxe)
        .expect("pxe namespace")
        .udp_socket(
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, 68)),
            Some("eth0"),
            true,
        )
        .expect("socket");

    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_htype(HType::Eth)
        .set_xid(77)
        .set_flags(dhcproto::v4::Flags::default().set_broadcast())
        .set_chaddr(&PXE_MAC);
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Discover));
    m.opts_mut().insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007".to_vec(),
    ));
    m.opts_mut()
        .insert(DhcpOption::ClientSystemArchitecture(7u16.into()));
    socket
        .send_to(&m.to_vec().expect("encode"), (Ipv4Addr::BROADCAST, 67))
        .await
        .expect("send");
    let mut buf = vec![0u8; 1500];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let offer = loop {
        let (n, _) = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf))
            .await
            .expect("the PXE client's offer within 20 s")
            .expect("receive");
        if let Ok(reply) = Message::decode(&mut dhcproto::Decoder::new(&buf[..n]))
            && reply.xid() == 77
        {
            break reply;
        }
    };
    let taken: BTreeSet<Ipv4Addr> = [first, second, third, RESERVED_IP].into();
    assert!(!taken.contains(&offer.yiaddr()), "{:?}", offer.yiaddr());
    assert!(
        offer.yiaddr() >= Ipv4Addr::new(10, 77, 0, 100)
            && offer.yiaddr() <= Ipv4Addr::new(10, 77, 0, 110)
    );
    assert_eq!(
        offer
            .fname_str()
            .and_then(Result::ok)
            .map(|f| f.trim_end_matches('\0').to_string()),
        Some("ipxe.efi".to_string())
    );
    assert_eq!(offer.siaddr(), BOOT_IP);
    service.abort();
}

//! proxyDHCP among other DHCP traffic, on a bridge the test makes itself: the site's dnsmasq
//! hands out addresses, a rogue dnsmasq offers its own boot file, and clients in their own
//! namespaces send plain requests, PXE requests from known and unknown MACs, garbage and floods.
//! metalboot answers exactly the PXE clients it provisions, never with an address, and keeps
//! doing so through all of it. Absence of an answer is shown by metalboot's own packet counter
//! (it decided, and decided not to answer) alongside the site server's answer to the same packet.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use dhcproto::v4::{DhcpOption, HType, Message, MessageType, Opcode};
use dhcproto::{Decodable, Encodable};
use metalboot::boot::dhcp::BootFiles;
use metalboot::boot::dhcpd::{BootClients, DhcpConfig, DhcpService};
use metalboot::boot::netns::NetNamespace;
use metalboot::lab::net::{BOOT_IP, LabNetwork, SITE_IP};
use tokio::net::UdpSocket;

const KNOWN: [u8; 6] = [0x52, 0x54, 0x00, 0x48, 0x00, 0x01];
const UNKNOWN: [u8; 6] = [0x52, 0x54, 0x00, 0x48, 0x00, 0x02];
/// A provisioned MAC that floods: its own answer budget, untouched before the flood, so the
/// count does not depend on how long the earlier phases took (the budget's window is a minute).
const FLOODER: [u8; 6] = [0x52, 0x54, 0x00, 0x48, 0x00, 0x03];
const ROGUE_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);

struct Provisioning(BTreeSet<String>);

impl BootClients for Provisioning {
    fn provisioning(&self, mac: &str) -> bool {
        self.0.contains(mac)
    }
}

fn discover(xid: u32, mac: &[u8; 6], pxe: bool) -> Vec<u8> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_htype(HType::Eth)
        .set_xid(xid)
        .set_flags(dhcproto::v4::Flags::default().set_broadcast())
        .set_chaddr(mac);
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Discover));
    if pxe {
        m.opts_mut().insert(DhcpOption::ClassIdentifier(
            b"PXEClient:Arch:00000:UNDI:002001".to_vec(),
        ));
        m.opts_mut()
            .insert(DhcpOption::ClientSystemArchitecture(0u16.into()));
    }
    m.to_vec().expect("encode")
}

use support::dhcp_packets as counted;

/// A DHCP client machine on the bridge.
struct Client {
    socket: UdpSocket,
}

/// An answer to one of our requests: who sent it (server identifier) and what it offers.
#[derive(Debug)]
struct Offer {
    server: Ipv4Addr,
    yiaddr: Ipv4Addr,
    file: String,
}

impl Client {
    fn new(netns: &str) -> Self {
        let ns = NetNamespace::open(netns).expect("client namespace");
        let socket = ns
            .udp_socket(
                SocketAddr::from((Ipv4Addr::UNSPECIFIED, 68)),
                Some("eth0"),
                true,
            )
            .expect("client socket");
        Client { socket }
    }

    async fn send(&self, packet: &[u8]) {
        self.socket
            .send_to(packet, (Ipv4Addr::BROADCAST, 67))
            .await
            .expect("send");
    }

    /// Sends `packet` (transaction `xid`) and sends it again every 2 s, as firmware and DHCP
    /// clients do, until `done` says enough, or 20 s: a server under load may drop a DISCOVER.
    async fn ask(&self, packet: &[u8], xid: u32, done: impl Fn(&[Offer]) -> bool) -> Vec<Offer> {
        let mut all: BTreeMap<u32, Vec<Offer>> = BTreeMap::new();
        let finished = |all: &BTreeMap<u32, Vec<Offer>>| all.get(&xid).is_some_and(|o| done(o));
        for _ in 0..10 {
            self.send(packet).await;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
            self.gather(&mut all, deadline, &finished).await;
            if finished(&all) {
                break;
            }
        }
        all.remove(&xid).unwrap_or_default()
    }

    /// Answers by transaction id until `done` says enough, or 20 s.
    async fn collect(
        &self,
        done: impl Fn(&BTreeMap<u32, Vec<Offer>>) -> bool,
    ) -> BTreeMap<u32, Vec<Offer>> {
        let mut all: BTreeMap<u32, Vec<Offer>> = BTreeMap::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        self.gather(&mut all, deadline, &done).await;
        all
    }

    /// Adds answers to `all` by transaction id until `done` or `deadline`.
    async fn gather(
        &self,
        all: &mut BTreeMap<u32, Vec<Offer>>,
        deadline: tokio::time::Instant,
        done: &impl Fn(&BTreeMap<u32, Vec<Offer>>) -> bool,
    ) {
        let mut buf = vec![0u8; 1500];
        while !done(all) {
            let Ok(Ok((n, _))) =
                tokio::time::timeout_at(deadline, self.socket.recv_from(&mut buf)).await
            else {
                break;
            };
            let Ok(m) = Message::decode(&mut dhcproto::Decoder::new(&buf[..n])) else {
                continue;
            };
            if m.opcode() != Opcode::BootReply {
                continue;
            }
            let server = match m.opts().get(dhcproto::v4::OptionCode::ServerIdentifier) {
                Some(DhcpOption::ServerIdentifier(ip)) => *ip,
                _ => m.siaddr(),
            };
            all.entry(m.xid()).or_default().push(Offer {
                server,
                yiaddr: m.yiaddr(),
                file: m
                    .fname_str()
                    .and_then(Result::ok)
                    .unwrap_or_default()
                    .trim_end_matches('\0')
                    .to_string(),
            });
        }
    }
}

fn from(offers: &[Offer], server: Ipv4Addr) -> Vec<&Offer> {
    offers.iter().filter(|o| o.server == server).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_dhcp_answers_only_its_pxe_clients_through_rogues_garbage_and_floods() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut net = LabNetwork::create(&format!("mbt-dhcp-{}", std::process::id()))
        .expect("the test's network namespaces (needs root, iproute2)");
    net.start_site_dhcp(dir.path()).expect("site dnsmasq");
    let rogue = net
        .add_peer("rogue", Some(&format!("{ROGUE_IP}/24")))
        .expect("rogue namespace");
    net.start_dnsmasq(
        &rogue,
        "eth0",
        dir.path(),
        "rogue",
        &[
            "--dhcp-range=10.77.0.200,10.77.0.250,255.255.255.0,1h",
            "--dhcp-boot=evil.efi,rogue,10.77.0.3",
            "--dhcp-vendorclass=pxe,PXEClient",
        ],
    )
    .expect("rogue dnsmasq");
    let client_ns = net.add_peer("client", None).expect("client namespace");
    let ns = net.namespace().expect("namespace");

    let mut config = DhcpConfig::new(BOOT_IP, BootFiles::new(&format!("http://{BOOT_IP}:8080")));
    config.interface = Some("br0".into());
    config.max_answers_per_mac = 5;
    let provisioned = BTreeSet::from(["52:54:00:48:00:01".into(), "52:54:00:48:00:03".into()]);
    let dhcp =
        DhcpService::bind(&ns, config, Arc::new(Provisioning(provisioned))).expect("proxyDHCP");
    tokio::spawn(dhcp.serve());
    let client = Client::new(&client_ns);
    let site_and_rogue =
        |o: &[Offer]| !from(o, SITE_IP).is_empty() && !from(o, ROGUE_IP).is_empty();

    // A PXE client metalboot provisions: metalboot's offer (no address, its boot server and
    // program) beside the site's address and the rogue's.
    // Sent again every 2 s until all three answered, as firmware does; each copy metalboot
    // answers uses the MAC's budget.
    let offers = client
        .ask(&discover(1, &KNOWN, true), 1, |o| {
            site_and_rogue(o) && !from(o, BOOT_IP).is_empty()
        })
        .await;
    let ours = from(&offers, BOOT_IP);
    assert!(!ours.is_empty(), "{offers:?}");
    for offer in &ours {
        assert_eq!(
            offer.yiaddr,
            Ipv4Addr::UNSPECIFIED,
            "proxyDHCP offers no address"
        );
        assert_eq!(offer.file, "undionly.kpxe");
    }
    assert!(ours.len() <= 5, "the first MAC's budget: {offers:?}");
    assert!(
        from(&offers, SITE_IP)
            .iter()
            .all(|o| o.yiaddr != Ipv4Addr::UNSPECIFIED),
        "the site server hands out the address: {offers:?}"
    );

    // A plain DHCP client with the same MAC: the site answers, metalboot decides not to.
    let before = counted("not-boot-client");
    let offers = client
        .ask(&discover(2, &KNOWN, false), 2, |o| {
            !from(o, SITE_IP).is_empty()
        })
        .await;
    support::eventually("metalboot to see the plain request", 20, || async {
        (counted("not-boot-client") > before).then_some(())
    })
    .await;
    assert!(!from(&offers, SITE_IP).is_empty(), "{offers:?}");
    assert!(from(&offers, BOOT_IP).is_empty(), "{offers:?}");

    // A PXE client metalboot does not provision: nothing from metalboot.
    let before = counted("not-provisioning");
    let offers = client
        .ask(&discover(3, &UNKNOWN, true), 3, site_and_rogue)
        .await;
    support::eventually("metalboot to see the unknown MAC", 20, || async {
        (counted("not-provisioning") > before).then_some(())
    })
    .await;
    assert!(from(&offers, BOOT_IP).is_empty(), "{offers:?}");

    // Garbage: random bytes, truncated and oversized messages, an option flood.
    let before = counted("");
    let valid = discover(4, &UNKNOWN, true);
    let mut garbage: Vec<Vec<u8>> = Vec::new();
    for i in 0..300u32 {
        let len = (i as usize * 7) % 1400 + 1;
        garbage.push(
            (0..len)
                .map(|j| (j as u32 ^ i).wrapping_mul(2_654_435_761) as u8)
                .collect(),
        );
        garbage.push(valid[..(i as usize % valid.len())].to_vec());
    }
    let mut flood = valid.clone();
    flood.truncate(flood.len() - 1); // drop the end option, then pad with option 224s
    while flood.len() < 1400 {
        flood.extend_from_slice(&[224, 2, 0xaa, 0xbb]);
    }
    garbage.push(flood);
    garbage.push(vec![0xff; 9000]);
    // In batches, each decided before the next is sent: a UDP socket's buffer drops what
    // arrives faster than it is read, and this counts decisions, not drops.
    let mut sent = 0u64;
    for batch in garbage.chunks(20) {
        for packet in batch {
            // 9000 bytes is fragmented on the way; a send error would be the test's link's.
            if client
                .socket
                .send_to(packet, (Ipv4Addr::BROADCAST, 67))
                .await
                .is_ok()
            {
                sent += 1;
            }
        }
        let want = before + sent;
        support::eventually("metalboot to decide on the garbage", 30, || async {
            (counted("") >= want).then_some(())
        })
        .await;
    }
    assert!(counted("malformed") > 0);
    // Still answering, and a flood from one MAC gets a bounded number of answers: 30
    // DISCOVERs sent at once, all within one budget window.
    let before = counted("rate-limited");
    for xid in 10..40 {
        client.send(&discover(xid, &FLOODER, true)).await;
    }
    let xids: Vec<u32> = (10..40).collect();
    let all = client
        .collect(|all| {
            xids.iter()
                .all(|x| all.get(x).is_some_and(|o| !from(o, SITE_IP).is_empty()))
        })
        .await;
    let answered: usize = all.values().map(|o| from(o, BOOT_IP).len()).sum();
    support::eventually("the flood to be rate-limited", 20, || async {
        (counted("rate-limited") > before).then_some(())
    })
    .await;
    assert!(
        (1..=5).contains(&answered),
        "{answered} answers to 30 DISCOVERs within a minute (budget 5)"
    );
}

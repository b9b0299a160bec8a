//! The proxyDHCP service on the provisioning network: UDP 67 (broadcast DISCOVER/REQUEST from
//! PXE and HTTP-boot firmware) and UDP 4011 (the PXE client's follow-up request to the proxy).
//! Every decision is `dhcp::answer`; this module owns the sockets, where replies go, and the
//! budgets: one packet in flight per socket (no task per packet), a bounded receive buffer, and at
//! most `max_answers_per_mac` answers per MAC and minute, so a looping or hostile client costs a
//! counter increment, not a log line or a reply.

use std::collections::{BTreeMap, HashMap};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::UdpSocket;

use dhcproto::Decodable;
use dhcproto::v4::{Message, MessageType};

use super::dhcp::{
    AddressRequest, Answer, BootFiles, Client, Ignored, address_reply, address_request, answer,
    boot_offer, classify,
};
use super::leases::{Leases, Refused};
use super::netns::NetNamespace;

/// Who the DHCP service answers, and whom it tells.
pub trait BootClients: Send + Sync + 'static {
    /// Whether metalboot is network-booting the host with this MAC now.
    fn provisioning(&self, mac: &str) -> bool;
    /// Called once per reply sent (the per-hop timeline's first hop).
    fn answered(&self, _answer: &Answer) {}
    /// A host being provisioned took this address (from the site's DHCP server, or from ours).
    fn address_learned(&self, _mac: &str, _ip: Ipv4Addr) {}
    /// Boot MAC → reserved address, from the MetalHosts (full-DHCP mode).
    fn reservations(&self) -> BTreeMap<String, Ipv4Addr> {
        BTreeMap::new()
    }
}

#[derive(Clone, Debug)]
pub struct DhcpConfig {
    /// The interface facing the hosts (SO_BINDTODEVICE; needed to broadcast replies when the
    /// machine has several). None: all interfaces.
    pub interface: Option<String>,
    /// metalboot's address on that network: the boot server (siaddr) and server identifier.
    pub server_ip: Ipv4Addr,
    pub files: BootFiles,
    /// Answer every PXE/HTTP-boot client, not only hosts being provisioned (a lab with hosts
    /// that are not MetalHosts yet; never the default).
    pub answer_all: bool,
    /// 67 and 4011; other values only for tests and benchmarks outside a namespace.
    pub server_port: u16,
    pub pxe_port: u16,
    /// Where broadcast replies go (68).
    pub client_port: u16,
    pub max_answers_per_mac: u32,
}

impl DhcpConfig {
    pub fn new(server_ip: Ipv4Addr, files: BootFiles) -> Self {
        Self {
            interface: None,
            server_ip,
            files,
            answer_all: false,
            server_port: 67,
            pxe_port: 4011,
            client_port: 68,
            max_answers_per_mac: 30,
        }
    }
}

pub struct DhcpService {
    server: Arc<UdpSocket>,
    pxe: Arc<UdpSocket>,
    config: Arc<DhcpConfig>,
    clients: Arc<dyn BootClients>,
    limiter: Arc<Mutex<AnswerLimiter>>,
    /// Full-DHCP mode: metalboot hands out the addresses too (None: proxyDHCP).
    leases: Option<Arc<Mutex<Leases>>>,
    /// When the reservations were last read from the hosts: at most once a second, not once
    /// per packet (reading them walks every MetalHost).
    reservations_read: Mutex<Option<Instant>>,
}

impl DhcpService {
    pub fn bind(
        netns: &NetNamespace,
        config: DhcpConfig,
        clients: Arc<dyn BootClients>,
    ) -> std::io::Result<Self> {
        let device = config.interface.as_deref();
        let bind = |port: u16| {
            netns
                .udp_socket(
                    SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
                    device,
                    true,
                )
                .map_err(|e| std::io::Error::new(e.kind(), format!("DHCP on UDP {port}: {e}")))
        };
        Ok(Self {
            server: Arc::new(bind(config.server_port)?),
            pxe: Arc::new(bind(config.pxe_port)?),
            limiter: Arc::new(Mutex::new(AnswerLimiter::new(config.max_answers_per_mac))),
            config: Arc::new(config),
            clients,
            leases: None,
            reservations_read: Mutex::new(None),
        })
    }

    /// Full-DHCP mode: port 67 hands out addresses from `leases` to every client, with the boot
    /// program for the boot clients metalboot provisions (the PXE port stays as in proxy mode).
    pub fn with_leases(mut self, leases: Leases) -> Self {
        self.leases = Some(Arc::new(Mutex::new(leases)));
        self
    }

    /// The ports actually bound (tests bind port 0).
    pub fn ports(&self) -> (Option<u16>, Option<u16>) {
        let port = |s: &UdpSocket| s.local_addr().ok().map(|a| a.port());
        (port(&self.server), port(&self.pxe))
    }

    /// Serves both ports until one of them fails.
    pub async fn serve(self) -> std::io::Result<()> {
        let server = self.receive(self.server.clone(), false);
        let pxe = self.receive(self.pxe.clone(), true);
        tokio::try_join!(server, pxe).map(|_| ())
    }

    async fn receive(&self, socket: Arc<UdpSocket>, pxe_port: bool) -> std::io::Result<()> {
        // An Ethernet frame's worth; anything longer arrives truncated and fails to decode.
        let mut buf = vec![0u8; 1500];
        loop {
            let (n, from) = socket.recv_from(&mut buf).await?;
            let clients = &self.clients;
            let wanted = |mac: &str| self.config.answer_all || clients.provisioning(mac);
            let packet = &buf[..n];
            if let (Some(leases), false) = (&self.leases, pxe_port) {
                self.serve_address(&socket, leases, packet).await;
                continue;
            }
            let decided = answer(
                packet,
                &self.config.files,
                self.config.server_ip,
                pxe_port,
                wanted,
            );
            if decided == Err(Ignored::ForTheSiteServer)
                && let Some((mac, ip)) = super::dhcp::requested_address(packet)
                && wanted(&mac)
            {
                clients.address_learned(&mac, ip);
            }
            let answered = match decided {
                Ok(answered) => answered,
                Err(ignored) => {
                    crate::metrics::record_dhcp(ignored.label());
                    if ignored != Ignored::Malformed {
                        tracing::debug!(%from, reason = ignored.label(), "DHCP request not answered");
                    }
                    continue;
                }
            };
            let allowed = self
                .limiter
                .lock()
                .map(|mut l| l.allow(&answered.mac, Instant::now()))
                .unwrap_or(false);
            if !allowed {
                crate::metrics::record_dhcp("rate-limited");
                continue;
            }
            let to = destination(&answered, from, pxe_port, &self.config);
            match socket.send_to(&answered.packet, to).await {
                Ok(_) => {
                    crate::metrics::record_dhcp("answered");
                    tracing::info!(mac = %answered.mac, offer = ?answered.offer, %to, port = if pxe_port { self.config.pxe_port } else { self.config.server_port }, "proxyDHCP answer");
                    self.clients.answered(&answered);
                }
                Err(e) => {
                    crate::metrics::record_dhcp("send-failed");
                    tracing::warn!(mac = %answered.mac, %to, error = %e, "proxyDHCP answer not sent");
                }
            }
        }
    }
}

impl DhcpService {
    /// One packet on port 67 in full-DHCP mode.
    async fn serve_address(&self, socket: &UdpSocket, leases: &Mutex<Leases>, packet: &[u8]) {
        let Ok(request) = Message::decode(&mut dhcproto::Decoder::new(packet)) else {
            crate::metrics::record_dhcp(Ignored::Malformed.label());
            return;
        };
        let Some((mac, kind)) = address_request(&request) else {
            crate::metrics::record_dhcp("not-a-request");
            return;
        };
        let client = classify(&request);
        let boots = matches!(client, Client::Boot { .. })
            && (self.config.answer_all || self.clients.provisioning(&mac));
        let boot = if boots {
            boot_offer(&client, &self.config.files)
        } else {
            None
        };
        let server = self.config.server_ip;
        let now = jiff::Timestamp::now().as_second().max(0) as u64;
        let decided = {
            let Ok(mut leases) = leases.lock() else {
                return;
            };
            let stale = self.reservations_read.lock().is_ok_and(|mut read| {
                let stale = read.is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
                if stale {
                    *read = Some(Instant::now());
                }
                stale
            });
            if stale {
                leases.set_reservations(self.clients.reservations());
            }
            let pool = leases.pool().clone();
            let outcome = match kind {
                AddressRequest::Discover { requested } => {
                    match leases.offer(&mac, requested, now) {
                        Some(ip) => Ok((MessageType::Offer, ip)),
                        None => Err("pool-exhausted"),
                    }
                }
                AddressRequest::Request { for_server, .. }
                    if for_server.is_some_and(|s| s != server) =>
                {
                    Err("for-another-server")
                }
                AddressRequest::Request { ip, .. } => match leases.request(&mac, ip, now) {
                    Ok(lease) => Ok((MessageType::Ack, lease.ip)),
                    Err(Refused::NotYours(ip)) => Ok((MessageType::Nak, ip)),
                    Err(Refused::NotRecorded(e)) => {
                        tracing::error!(%mac, error = %e, "lease not recorded; not acknowledged");
                        Err("lease-not-recorded")
                    }
                },
                AddressRequest::Release { ip } => {
                    leases.release(&mac, ip, false, now);
                    Err("released")
                }
                AddressRequest::Decline { ip } => {
                    tracing::warn!(%mac, %ip, "client declined an address: something else uses it");
                    leases.release(&mac, ip, true, now);
                    Err("declined")
                }
                AddressRequest::Other => Err("not-a-request"),
            };
            outcome.map(|(kind, ip)| (kind, ip, pool))
        };
        let (kind, ip, pool) = match decided {
            Ok(decided) => decided,
            Err(outcome) => {
                crate::metrics::record_dhcp(outcome);
                return;
            }
        };
        let allowed = self
            .limiter
            .lock()
            .map(|mut l| l.allow(&mac, Instant::now()))
            .unwrap_or(false);
        if !allowed {
            crate::metrics::record_dhcp("rate-limited");
            return;
        }
        let reply = address_reply(
            &request,
            kind,
            ip,
            &pool,
            server,
            boot.as_ref().map(|b| (&client, b)),
        );
        let Ok(bytes) = dhcproto::Encodable::to_vec(&reply) else {
            return;
        };
        let answered = Answer {
            mac: mac.clone(),
            offer: boot.clone().unwrap_or(super::dhcp::BootOffer::Tftp {
                file: String::new(),
            }),
            discover: kind == MessageType::Offer,
            packet: bytes,
            giaddr: request.giaddr(),
            ciaddr: if kind == MessageType::Nak {
                Ipv4Addr::UNSPECIFIED
            } else {
                request.ciaddr()
            },
        };
        let to = destination(
            &answered,
            SocketAddr::from(([0, 0, 0, 0], 0)),
            false,
            &self.config,
        );
        if let Err(e) = socket.send_to(&answered.packet, to).await {
            crate::metrics::record_dhcp("send-failed");
            tracing::warn!(%mac, %to, error = %e, "DHCP answer not sent");
            return;
        }
        let outcome = match kind {
            MessageType::Offer => "offered",
            MessageType::Ack => "acknowledged",
            _ => "refused",
        };
        crate::metrics::record_dhcp(outcome);
        tracing::info!(%mac, %ip, kind = outcome, boot = ?boot, %to, "DHCP answer");
        if boots && kind == MessageType::Ack {
            self.clients.address_learned(&mac, ip);
        }
        if boot.is_some() {
            self.clients.answered(&answered);
        }
    }
}

/// Where a reply goes (RFC 2131 §4.1; PXE spec §2.2): to the relay when one forwarded it; on the
/// PXE port back to the sender; to a client that has an address, there; else broadcast.
pub fn destination(
    answered: &Answer,
    from: SocketAddr,
    pxe_port: bool,
    config: &DhcpConfig,
) -> SocketAddr {
    if !answered.giaddr.is_unspecified() {
        return SocketAddr::V4(SocketAddrV4::new(answered.giaddr, config.server_port));
    }
    if pxe_port {
        return from;
    }
    if !answered.ciaddr.is_unspecified() {
        return SocketAddr::V4(SocketAddrV4::new(answered.ciaddr, config.client_port));
    }
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::BROADCAST, config.client_port))
}

/// At most `per_minute` answers per MAC in a fixed one-minute window. Only answered MACs (hosts
/// being provisioned) get an entry, so the map is as large as the fleet being provisioned; it is
/// cleared of stale windows when it grows past a bound anyway.
struct AnswerLimiter {
    per_minute: u32,
    windows: HashMap<String, (Instant, u32)>,
}

impl AnswerLimiter {
    const WINDOW: Duration = Duration::from_secs(60);
    const MAX_ENTRIES: usize = 16_384;

    fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            windows: HashMap::new(),
        }
    }

    fn allow(&mut self, mac: &str, now: Instant) -> bool {
        if self.windows.len() >= Self::MAX_ENTRIES {
            self.windows
                .retain(|_, (start, _)| now.duration_since(*start) < Self::WINDOW);
            if self.windows.len() >= Self::MAX_ENTRIES {
                return false;
            }
        }
        let entry = self.windows.entry(mac.to_string()).or_insert((now, 0));
        if now.duration_since(entry.0) >= Self::WINDOW {
            *entry = (now, 0);
        }
        entry.1 += 1;
        entry.1 <= self.per_minute
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boot::dhcp::BootOffer;

    fn answered(giaddr: [u8; 4], ciaddr: [u8; 4]) -> Answer {
        Answer {
            mac: "52:54:00:00:00:01".into(),
            offer: BootOffer::Tftp {
                file: "ipxe.efi".into(),
            },
            discover: true,
            packet: vec![],
            giaddr: giaddr.into(),
            ciaddr: ciaddr.into(),
        }
    }

    #[test]
    fn replies_go_where_the_protocol_says() {
        let config = DhcpConfig::new([10, 0, 0, 2].into(), BootFiles::new("http://10.0.0.2"));
        let from: SocketAddr = "10.0.0.50:68".parse().unwrap();
        let rows = [
            (
                "relayed",
                answered([10, 9, 0, 1], [0; 4]),
                false,
                "10.9.0.1:67",
            ),
            (
                "PXE port: back to the sender",
                answered([0; 4], [10, 0, 0, 50]),
                true,
                "10.0.0.50:68",
            ),
            (
                "client with an address",
                answered([0; 4], [10, 0, 0, 50]),
                false,
                "10.0.0.50:68",
            ),
            (
                "client without an address",
                answered([0; 4], [0; 4]),
                false,
                "255.255.255.255:68",
            ),
        ];
        for (name, a, pxe, want) in rows {
            assert_eq!(
                destination(&a, from, pxe, &config).to_string(),
                want,
                "{name}"
            );
        }
    }

    #[test]
    fn answers_per_mac_are_bounded_per_window() {
        let mut limiter = AnswerLimiter::new(3);
        let t0 = Instant::now();
        assert!((0..3).all(|_| limiter.allow("a", t0)));
        assert!(!limiter.allow("a", t0), "fourth in the window");
        assert!(limiter.allow("b", t0), "another MAC has its own budget");
        assert!(
            limiter.allow("a", t0 + AnswerLimiter::WINDOW),
            "next window"
        );
    }
}

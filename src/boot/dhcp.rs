//! proxyDHCP decisions (PXE spec §2.2, RFC 4578): which network boot program a client gets. The
//! site's DHCP server hands out addresses; metalboot answers only PXE and HTTP-boot clients, with
//! the boot server and file, never with an address. Packets are decoded and encoded by `dhcproto`;
//! this module is pure (no sockets), so each rule is table-tested and the whole path is fuzzed.
//! The sockets are in `dhcpd`.

use std::net::Ipv4Addr;

use dhcproto::v4::{DhcpOption, Flags, HType, Message, MessageType, Opcode, OptionCode};

/// Which network boot program each client architecture gets (option 93, RFC 4578 / IANA).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootFiles {
    /// Legacy BIOS (architecture 0), over TFTP.
    pub bios: String,
    /// x86-64 UEFI (architectures 7 and 9), over TFTP.
    pub efi_x64: String,
    /// arm64 UEFI (architecture 11), over TFTP.
    pub efi_arm64: String,
    /// The boot service's HTTP base, e.g. `http://10.0.0.2:8080`: iPXE chains `/boot.ipxe` from
    /// it, UEFI HTTP Boot clients fetch their program from `/nbp/<file>`.
    pub http_base: String,
}

/// The boot programs given when none is configured (Debian's `ipxe` package names).
pub const DEFAULT_BIOS_FILE: &str = "undionly.kpxe";
pub const DEFAULT_EFI_X64_FILE: &str = "ipxe.efi";
pub const DEFAULT_EFI_ARM64_FILE: &str = "snp.efi";

impl BootFiles {
    pub fn new(http_base: &str) -> Self {
        Self {
            bios: DEFAULT_BIOS_FILE.into(),
            efi_x64: DEFAULT_EFI_X64_FILE.into(),
            efi_arm64: DEFAULT_EFI_ARM64_FILE.into(),
            http_base: http_base.trim_end_matches('/').to_string(),
        }
    }
}

/// What a request says about its sender.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Client {
    /// Not a network-boot client (or not a request metalboot answers): no reply, ever.
    Ignored,
    Boot {
        mac: String,
        /// Client system architecture (option 93; 0 when absent, as BIOS PXE ROMs may omit it).
        arch: u16,
        /// Already running iPXE (user class `iPXE`, or iPXE's option 175).
        ipxe: bool,
        /// A UEFI HTTP Boot client (vendor class `HTTPClient`).
        http: bool,
        discover: bool,
    },
}

/// What metalboot offers a boot client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootOffer {
    /// A file on metalboot's TFTP server.
    Tftp { file: String },
    /// A URL (iPXE's script, or a UEFI HTTP Boot program).
    Http { url: String },
}

/// Classifies a DHCPDISCOVER/DHCPREQUEST. Only Ethernet clients whose vendor class says
/// `PXEClient` or `HTTPClient` are boot clients.
pub fn classify(msg: &Message) -> Client {
    if msg.opcode() != Opcode::BootRequest || msg.htype() != HType::Eth || msg.hlen() != 6 {
        return Client::Ignored;
    }
    let discover = match msg.opts().msg_type() {
        Some(MessageType::Discover) => true,
        Some(MessageType::Request) => false,
        _ => return Client::Ignored,
    };
    let class = match msg.opts().get(OptionCode::ClassIdentifier) {
        Some(DhcpOption::ClassIdentifier(class)) => class.as_slice(),
        _ => return Client::Ignored,
    };
    let http = class.starts_with(b"HTTPClient");
    if !http && !class.starts_with(b"PXEClient") {
        return Client::Ignored;
    }
    let arch = match msg.opts().get(OptionCode::ClientSystemArchitecture) {
        Some(DhcpOption::ClientSystemArchitecture(a)) => u16::from(*a),
        _ => 0,
    };
    let ipxe = matches!(
        msg.opts().get(OptionCode::UserClass),
        Some(DhcpOption::UserClass(class)) if class.windows(4).any(|w| w == b"iPXE")
    ) || msg.opts().get(OptionCode::Unknown(175)).is_some();
    let mac = mac_text(msg.chaddr());
    Client::Boot {
        mac,
        arch,
        ipxe,
        http,
        discover,
    }
}

/// The boot program for a client: iPXE gets the boot service's script (no chain loop), HTTP Boot
/// clients an HTTP URL, PXE ROMs a TFTP file by architecture; an architecture with no program
/// gets nothing.
pub fn boot_offer(client: &Client, files: &BootFiles) -> Option<BootOffer> {
    let Client::Boot {
        arch, ipxe, http, ..
    } = client
    else {
        return None;
    };
    if *ipxe {
        return Some(BootOffer::Http {
            url: format!("{}/boot.ipxe", files.http_base),
        });
    }
    let file = match arch {
        0 => &files.bios,
        // EFI BC and EFI x86-64; 16 is x86-64 UEFI HTTP Boot.
        7 | 9 | 16 => &files.efi_x64,
        // arm64 UEFI; 19 is arm64 UEFI HTTP Boot.
        11 | 19 => &files.efi_arm64,
        _ => return None,
    };
    Some(if *http {
        BootOffer::Http {
            url: format!("{}/nbp/{file}", files.http_base),
        }
    } else {
        BootOffer::Tftp { file: file.clone() }
    })
}

/// The proxyDHCP answer to `request`: no address (yiaddr 0.0.0.0), metalboot as the boot server,
/// the boot file, and for PXE clients the PXE vendor options telling the ROM to use the file in
/// this answer rather than run boot-server discovery.
pub fn proxy_reply(
    request: &Message,
    client: &Client,
    offer: &BootOffer,
    server: Ipv4Addr,
) -> Message {
    let discover = matches!(client, Client::Boot { discover: true, .. });
    let http = matches!(client, Client::Boot { http: true, .. });
    let mut reply = Message::default();
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_xid(request.xid())
        .set_flags(Flags::default().set_broadcast())
        .set_chaddr(request.chaddr())
        .set_giaddr(request.giaddr())
        .set_yiaddr(Ipv4Addr::UNSPECIFIED)
        .set_siaddr(server);
    reply
        .opts_mut()
        .insert(DhcpOption::MessageType(if discover {
            MessageType::Offer
        } else {
            MessageType::Ack
        }));
    reply
        .opts_mut()
        .insert(DhcpOption::ServerIdentifier(server));
    add_boot(&mut reply, http, offer);
    reply
}

/// The boot part of an answer: the program, and the vendor class that makes firmware take it.
fn add_boot(reply: &mut Message, http: bool, offer: &BootOffer) {
    match offer {
        BootOffer::Tftp { file } => reply.set_fname_str(file),
        BootOffer::Http { url } => reply.set_fname_str(url),
    };
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::ClassIdentifier(if http {
        b"HTTPClient".to_vec()
    } else {
        b"PXEClient".to_vec()
    }));
    if !http {
        // PXE_DISCOVERY_CONTROL (6) = 8: use the boot file of this packet, no discovery.
        opts.insert(DhcpOption::VendorExtensions(vec![6, 1, 8, 255]));
    }
}

/// What a full-DHCP server does with a packet on port 67.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AddressRequest {
    /// DHCPDISCOVER: offer an address (the client may ask for one, option 50).
    Discover {
        requested: Option<Ipv4Addr>,
    },
    /// DHCPREQUEST for `ip`; `for_server` is the server the client selected (option 54), absent
    /// when it renews or reboots.
    Request {
        ip: Ipv4Addr,
        for_server: Option<Ipv4Addr>,
    },
    Release {
        ip: Ipv4Addr,
    },
    Decline {
        ip: Ipv4Addr,
    },
    /// Anything else (INFORM, replies, garbage that decodes).
    Other,
}

/// Reads what a client asks of an address server (full-DHCP mode), with its MAC.
pub fn address_request(request: &Message) -> Option<(String, AddressRequest)> {
    if request.opcode() != Opcode::BootRequest
        || request.htype() != HType::Eth
        || request.hlen() != 6
    {
        return None;
    }
    let opt_ip = |code| match request.opts().get(code) {
        Some(DhcpOption::RequestedIpAddress(ip)) | Some(DhcpOption::ServerIdentifier(ip)) => {
            Some(*ip)
        }
        _ => None,
    };
    let requested = opt_ip(OptionCode::RequestedIpAddress);
    let kind = match request.opts().msg_type() {
        Some(MessageType::Discover) => AddressRequest::Discover { requested },
        Some(MessageType::Request) => {
            let ip = requested.unwrap_or(request.ciaddr());
            if ip.is_unspecified() {
                AddressRequest::Other
            } else {
                AddressRequest::Request {
                    ip,
                    for_server: opt_ip(OptionCode::ServerIdentifier),
                }
            }
        }
        Some(MessageType::Release) => AddressRequest::Release {
            ip: request.ciaddr(),
        },
        Some(MessageType::Decline) => match requested {
            Some(ip) => AddressRequest::Decline { ip },
            None => AddressRequest::Other,
        },
        _ => AddressRequest::Other,
    };
    Some((mac_text(request.chaddr()), kind))
}

/// An OFFER, ACK or NAK from the address server: the address and the network's options, and
/// for a boot client metalboot provisions, its boot program in the same packet.
pub fn address_reply(
    request: &Message,
    kind: MessageType,
    yiaddr: Ipv4Addr,
    pool: &super::leases::Pool,
    server: Ipv4Addr,
    boot: Option<(&Client, &BootOffer)>,
) -> Message {
    let mut reply = Message::default();
    reply
        .set_opcode(Opcode::BootReply)
        .set_htype(HType::Eth)
        .set_xid(request.xid())
        .set_flags(request.flags())
        .set_chaddr(request.chaddr())
        .set_giaddr(request.giaddr())
        .set_yiaddr(if kind == MessageType::Nak {
            Ipv4Addr::UNSPECIFIED
        } else {
            yiaddr
        });
    reply.opts_mut().insert(DhcpOption::MessageType(kind));
    reply
        .opts_mut()
        .insert(DhcpOption::ServerIdentifier(server));
    if kind == MessageType::Nak {
        return reply;
    }
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::SubnetMask(pool.network.mask()));
    if let Some(router) = pool.router {
        opts.insert(DhcpOption::Router(vec![router]));
    }
    let seconds = u32::try_from(pool.lease_time.as_secs()).unwrap_or(u32::MAX);
    opts.insert(DhcpOption::AddressLeaseTime(seconds));
    opts.insert(DhcpOption::Renewal(seconds / 2));
    opts.insert(DhcpOption::Rebinding(seconds / 8 * 7));
    if let Some((client, offer)) = boot {
        reply.set_siaddr(server);
        add_boot(
            &mut reply,
            matches!(client, Client::Boot { http: true, .. }),
            offer,
        );
    }
    reply
}

/// Why a packet got no answer (a metric label; never an error: silence is the protocol's answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// Not a DHCP message `dhcproto` can decode.
    Malformed,
    /// Not a PXE or HTTP-boot client, or not a DISCOVER/REQUEST: the site's DHCP server's job.
    NotBootClient,
    /// A boot client whose MAC is not a host metalboot is provisioning now.
    NotProvisioning,
    /// No boot program for the client's architecture.
    NoProgram,
    /// A DHCPREQUEST broadcast to the site's server (it selects that server's address offer);
    /// a proxy answers requests only on the PXE port.
    ForTheSiteServer,
}

impl Ignored {
    pub fn label(self) -> &'static str {
        match self {
            Ignored::Malformed => "malformed",
            Ignored::NotBootClient => "not-boot-client",
            Ignored::NotProvisioning => "not-provisioning",
            Ignored::NoProgram => "no-program",
            Ignored::ForTheSiteServer => "for-site-server",
        }
    }
}

/// A reply to send, and what it says (for the log and the per-hop timeline).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub mac: String,
    pub offer: BootOffer,
    /// DHCPOFFER (to a DISCOVER) or DHCPACK (to a REQUEST).
    pub discover: bool,
    pub packet: Vec<u8>,
    /// The request's relay agent and client addresses, which say where the reply goes.
    pub giaddr: Ipv4Addr,
    pub ciaddr: Ipv4Addr,
}

/// One decision from raw bytes to raw bytes. `wanted(mac)` says whether the boot client is one
/// metalboot should answer (by default: a MetalHost it is provisioning now). On the DHCP port
/// only DISCOVERs are answered; on the PXE port (4011) REQUESTs are.
pub fn answer(
    packet: &[u8],
    files: &BootFiles,
    server: Ipv4Addr,
    pxe_port: bool,
    wanted: impl Fn(&str) -> bool,
) -> Result<Answer, Ignored> {
    use dhcproto::{Decodable, Encodable};
    let request =
        Message::decode(&mut dhcproto::Decoder::new(packet)).map_err(|_| Ignored::Malformed)?;
    let client = classify(&request);
    let Client::Boot { mac, discover, .. } = &client else {
        return Err(Ignored::NotBootClient);
    };
    if !*discover && !pxe_port {
        return Err(Ignored::ForTheSiteServer);
    }
    if !wanted(mac) {
        return Err(Ignored::NotProvisioning);
    }
    let offer = boot_offer(&client, files).ok_or(Ignored::NoProgram)?;
    let packet = proxy_reply(&request, &client, &offer, server)
        .to_vec()
        .map_err(|_| Ignored::Malformed)?;
    Ok(Answer {
        mac: mac.clone(),
        discover: *discover,
        offer,
        packet,
        giaddr: request.giaddr(),
        ciaddr: request.ciaddr(),
    })
}

/// The address a client takes from the site's server, from its broadcast DHCPREQUEST (option 50,
/// or `ciaddr` when renewing): how TFTP and HTTP clients, known only by address, are matched
/// to a MAC and so to a host.
pub fn requested_address(packet: &[u8]) -> Option<(String, Ipv4Addr)> {
    use dhcproto::Decodable;
    let request = Message::decode(&mut dhcproto::Decoder::new(packet)).ok()?;
    if request.opts().msg_type() != Some(MessageType::Request)
        || request.htype() != HType::Eth
        || request.hlen() != 6
    {
        return None;
    }
    let ip = match request.opts().get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(ip)) => *ip,
        _ => request.ciaddr(),
    };
    if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() {
        return None;
    }
    Some((mac_text(request.chaddr()), ip))
}

fn mac_text(chaddr: &[u8]) -> String {
    chaddr
        .iter()
        .take(6)
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::{Decodable, Encodable};

    const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0xaa, 0x00, 0x01];
    const SERVER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

    fn request(
        kind: MessageType,
        class: Option<&[u8]>,
        arch: Option<u16>,
        user_class: Option<&[u8]>,
    ) -> Message {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_htype(HType::Eth)
            .set_xid(0x1234_5678)
            .set_chaddr(&MAC);
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        if let Some(c) = class {
            m.opts_mut().insert(DhcpOption::ClassIdentifier(c.to_vec()));
        }
        if let Some(a) = arch {
            m.opts_mut()
                .insert(DhcpOption::ClientSystemArchitecture(a.into()));
        }
        if let Some(u) = user_class {
            m.opts_mut().insert(DhcpOption::UserClass(u.to_vec()));
        }
        m
    }

    #[test]
    fn boot_program_by_client() {
        let files = BootFiles::new("http://10.0.0.2:8080/");
        let tftp = |f: &str| Some(BootOffer::Tftp { file: f.into() });
        let http = |u: &str| Some(BootOffer::Http { url: u.into() });
        let pxe: &[u8] = b"PXEClient:Arch:00000:UNDI:002001";
        let rows: Vec<(&str, Message, Option<BootOffer>)> = vec![
            (
                "BIOS PXE ROM",
                request(MessageType::Discover, Some(pxe), Some(0), None),
                tftp("undionly.kpxe"),
            ),
            (
                "BIOS ROM without option 93",
                request(MessageType::Discover, Some(pxe), None, None),
                tftp("undionly.kpxe"),
            ),
            (
                "x86-64 UEFI PXE",
                request(
                    MessageType::Discover,
                    Some(b"PXEClient:Arch:00007"),
                    Some(7),
                    None,
                ),
                tftp("ipxe.efi"),
            ),
            (
                "EFI BC",
                request(
                    MessageType::Request,
                    Some(b"PXEClient:Arch:00009"),
                    Some(9),
                    None,
                ),
                tftp("ipxe.efi"),
            ),
            (
                "arm64 UEFI PXE",
                request(
                    MessageType::Discover,
                    Some(b"PXEClient:Arch:00011"),
                    Some(11),
                    None,
                ),
                tftp("snp.efi"),
            ),
            (
                "UEFI HTTP Boot",
                request(
                    MessageType::Discover,
                    Some(b"HTTPClient:Arch:00016"),
                    Some(16),
                    None,
                ),
                http("http://10.0.0.2:8080/nbp/ipxe.efi"),
            ),
            (
                "iPXE already: the script, no chain loop",
                request(MessageType::Discover, Some(pxe), Some(0), Some(b"iPXE")),
                http("http://10.0.0.2:8080/boot.ipxe"),
            ),
            (
                "plain DHCP client: nothing",
                request(MessageType::Discover, None, None, None),
                None,
            ),
            (
                "another vendor class: nothing",
                request(MessageType::Discover, Some(b"MSFT 5.0"), None, None),
                None,
            ),
            (
                "unknown architecture: nothing",
                request(MessageType::Discover, Some(pxe), Some(2), None),
                None,
            ),
            (
                "a DHCPINFORM: nothing",
                request(MessageType::Inform, Some(pxe), Some(0), None),
                None,
            ),
        ];
        for (name, msg, want) in rows {
            assert_eq!(boot_offer(&classify(&msg), &files), want, "{name}");
        }
    }

    #[test]
    fn a_proxy_answer_offers_no_address_and_round_trips() {
        let files = BootFiles::new("http://10.0.0.2:8080");
        let req = request(
            MessageType::Discover,
            Some(b"PXEClient:Arch:00007"),
            Some(7),
            None,
        );
        let answered = answer(
            &req.to_vec().expect("encode"),
            &files,
            SERVER,
            false,
            |_| true,
        )
        .expect("an answer");
        assert_eq!(answered.mac, "52:54:00:aa:00:01");
        assert!(answered.discover);
        let reply = Message::decode(&mut dhcproto::Decoder::new(&answered.packet)).expect("decode");
        assert_eq!(reply.opcode(), Opcode::BootReply);
        assert_eq!(reply.xid(), 0x1234_5678);
        assert_eq!(reply.chaddr(), &MAC);
        assert_eq!(
            reply.yiaddr(),
            Ipv4Addr::UNSPECIFIED,
            "proxyDHCP never offers an address"
        );
        assert_eq!(reply.siaddr(), SERVER);
        assert_eq!(
            reply
                .fname_str()
                .and_then(Result::ok)
                .map(|f| f.trim_end_matches('\0')),
            Some("ipxe.efi")
        );
        assert_eq!(reply.opts().msg_type(), Some(MessageType::Offer));
        assert_eq!(
            reply.opts().get(OptionCode::ClassIdentifier),
            Some(&DhcpOption::ClassIdentifier(b"PXEClient".to_vec()))
        );
        assert_eq!(
            reply.opts().get(OptionCode::VendorExtensions),
            Some(&DhcpOption::VendorExtensions(vec![6, 1, 8, 255]))
        );
    }

    #[test]
    fn garbage_gets_no_answer() {
        let files = BootFiles::new("http://10.0.0.2:8080");
        for packet in [&b""[..], &[0u8; 10], &[1u8; 300], &[0xff; 600]] {
            let got = answer(packet, &files, SERVER, false, |_| true);
            assert!(
                matches!(got, Err(Ignored::Malformed | Ignored::NotBootClient)),
                "{got:?}"
            );
        }
    }

    #[test]
    fn only_wanted_boot_clients_are_answered() {
        let files = BootFiles::new("http://10.0.0.2:8080");
        let pxe = request(MessageType::Discover, Some(b"PXEClient"), Some(0), None)
            .to_vec()
            .expect("encode");
        let plain = request(MessageType::Discover, None, None, None)
            .to_vec()
            .expect("encode");
        let odd_arch = request(MessageType::Discover, Some(b"PXEClient"), Some(2), None)
            .to_vec()
            .expect("encode");
        let only = |m: &str| m == "52:54:00:aa:00:01";
        assert!(answer(&pxe, &files, SERVER, false, only).is_ok());
        assert_eq!(
            answer(&pxe, &files, SERVER, false, |_| false),
            Err(Ignored::NotProvisioning)
        );
        assert_eq!(
            answer(&plain, &files, SERVER, false, |_| true),
            Err(Ignored::NotBootClient),
            "a plain DHCP client is never answered, even for a wanted MAC"
        );
        assert_eq!(
            answer(&odd_arch, &files, SERVER, false, |_| true),
            Err(Ignored::NoProgram)
        );
    }

    #[test]
    fn requests_are_answered_on_the_pxe_port_only_and_teach_the_address() {
        let files = BootFiles::new("http://10.0.0.2:8080");
        let mut req = request(MessageType::Request, Some(b"PXEClient"), Some(7), None);
        req.opts_mut()
            .insert(DhcpOption::RequestedIpAddress([10, 0, 0, 150].into()));
        let bytes = req.to_vec().expect("encode");
        assert_eq!(
            answer(&bytes, &files, SERVER, false, |_| true),
            Err(Ignored::ForTheSiteServer)
        );
        let acked = answer(&bytes, &files, SERVER, true, |_| true).expect("an ACK on 4011");
        assert!(!acked.discover);
        assert_eq!(
            requested_address(&bytes),
            Some((
                "52:54:00:aa:00:01".to_string(),
                Ipv4Addr::new(10, 0, 0, 150)
            ))
        );
        let discover = request(MessageType::Discover, Some(b"PXEClient"), Some(7), None);
        assert_eq!(requested_address(&discover.to_vec().expect("encode")), None);
        assert_eq!(requested_address(b"garbage"), None);
    }
}

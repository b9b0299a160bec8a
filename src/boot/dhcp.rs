//! proxyDHCP decisions (PXE spec §2.2, RFC 4578): which network boot program a client gets. The
//! site's DHCP server hands out addresses; metalboot answers only PXE and HTTP-boot clients, with
//! the boot server and file, never with an address. Packets are decoded and encoded by `dhcproto`;
//! this module is pure (no sockets), so each rule is table-tested and the whole path is fuzzed.
//!
//! Not wired into the manager yet (issue 14): the listener on :67/:4011, the MetalHost filter and
//! the bridged lab network come next.

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

impl BootFiles {
    pub fn new(http_base: &str) -> Self {
        Self {
            bios: "undionly.kpxe".into(),
            efi_x64: "ipxe.efi".into(),
            efi_arm64: "snp.efi".into(),
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
    let mac = msg
        .chaddr()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
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
    match offer {
        BootOffer::Tftp { file } => reply.set_fname_str(file),
        BootOffer::Http { url } => reply.set_fname_str(url),
    };
    let opts = reply.opts_mut();
    opts.insert(DhcpOption::MessageType(if discover {
        MessageType::Offer
    } else {
        MessageType::Ack
    }));
    opts.insert(DhcpOption::ServerIdentifier(server));
    opts.insert(DhcpOption::ClassIdentifier(if http {
        b"HTTPClient".to_vec()
    } else {
        b"PXEClient".to_vec()
    }));
    if !http {
        // PXE_DISCOVERY_CONTROL (6) = 8: use the boot file of this packet, no discovery.
        opts.insert(DhcpOption::VendorExtensions(vec![6, 1, 8, 255]));
    }
    reply
}

/// One decision from raw bytes to raw bytes: `None` for anything metalboot does not answer
/// (undecodable, not a boot client, no program for its architecture).
pub fn answer(packet: &[u8], files: &BootFiles, server: Ipv4Addr) -> Option<Vec<u8>> {
    use dhcproto::{Decodable, Encodable};
    let request = Message::decode(&mut dhcproto::Decoder::new(packet)).ok()?;
    let client = classify(&request);
    let offer = boot_offer(&client, files)?;
    proxy_reply(&request, &client, &offer, server).to_vec().ok()
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
        let bytes = answer(&req.to_vec().expect("encode"), &files, SERVER).expect("an answer");
        let reply = Message::decode(&mut dhcproto::Decoder::new(&bytes)).expect("decode");
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
            assert_eq!(answer(packet, &files, SERVER), None);
        }
    }
}

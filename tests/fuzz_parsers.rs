//! Property-based fuzzing (proptest; `cargo fuzz` needs a nightly toolchain this machine lacks) of
//! every parser that reads input from the network or from objects anyone may write: TFTP file
//! names, HTTP route parts (MAC, token paths, artifact paths), the callback body, the boot Secret,
//! Redfish addresses and error bodies. Each must answer every input without panicking, and what
//! it accepts must satisfy its invariant. Each target runs for a fixed time,
//! `METALBOOT_FUZZ_SECONDS` (default 5 s; `make test` and CI use the default), and prints how many
//! cases it tried.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use proptest::prelude::*;

/// Runs `check` on values from `strategy` until the time budget is spent; panics with the
/// minimal failing input proptest shrinks to.
fn fuzz<S: Strategy>(
    target: &str,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    let budget = std::time::Duration::from_secs(
        std::env::var("METALBOOT_FUZZ_SECONDS")
            .ok()
            .and_then(|c| c.parse().ok())
            .unwrap_or(5),
    );
    const BATCH: u32 = 256;
    let started = std::time::Instant::now();
    let mut cases = 0u64;
    while started.elapsed() < budget {
        // A runner runs its cases once; each batch gets a fresh runner with a fresh random seed.
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: BATCH,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        if let Err(e) = runner.run(&strategy, &check) {
            panic!("{target}: {e}");
        }
        cases += u64::from(BATCH);
    }
    println!("fuzz {target}: {cases} cases in {budget:?}, no failure");
}

/// Strings a hostile client would try: path pieces, separators, dots, NULs, unicode.
fn hostile_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        proptest::collection::vec(
            prop_oneof![
                Just("/".to_string()),
                Just("..".to_string()),
                Just(".".to_string()),
                Just("\\".to_string()),
                Just("%2e".to_string()),
                Just("\0".to_string()),
                Just("undionly.kpxe".to_string()),
                Just("etc".to_string()),
                "[a-z0-9_-]{1,12}",
                "\\PC{1,4}",
            ],
            0..12
        )
        .prop_map(|parts| parts.concat()),
    ]
}

#[test]
fn tftp_names_resolve_inside_the_root_or_are_refused() {
    fuzz(
        "tftp_names_resolve_inside_the_root_or_are_refused",
        hostile_text(),
        |name| {
            let dir = tempfile::tempdir().expect("tempdir");
            let root = std::fs::canonicalize(dir.path()).expect("root");
            std::fs::write(root.join("undionly.kpxe"), b"x").expect("file");
            if let Ok(file) = metalboot::boot::tftp::resolve(&root, &name) {
                prop_assert!(file.starts_with(&root), "{name:?} resolved to {file:?}");
            }
            Ok(())
        },
    );
}

#[test]
fn artifact_paths_never_climb() {
    fuzz("artifact_paths_never_climb", hostile_text(), |path| {
        if metalboot::boot::artifacts::check_relative_path(&path).is_ok() {
            prop_assert!(
                !path.split('/').any(|s| s == ".." || s.is_empty()),
                "{path:?}"
            );
            prop_assert!(!path.starts_with('/') && !path.contains('\\'), "{path:?}");
        }
        Ok(())
    });
}

#[test]
fn macs_normalize_to_one_canonical_form() {
    fuzz(
        "macs_normalize_to_one_canonical_form",
        prop_oneof![
            any::<String>(),
            "[0-9a-fA-F]{2}([-:][0-9a-fA-F]{2}){5}",
            "[0-9a-fA-F]{12}",
        ],
        |raw| {
            if let Some(mac) = metalboot::boot::ipxe::normalize_mac(&raw) {
                prop_assert_eq!(mac.len(), 17);
                prop_assert!(
                    mac.chars().enumerate().all(|(i, c)| if i % 3 == 2 {
                        c == ':'
                    } else {
                        c.is_ascii_hexdigit() && !c.is_ascii_uppercase()
                    }),
                    "{}",
                    mac
                );
                prop_assert_eq!(
                    metalboot::boot::ipxe::normalize_mac(&mac),
                    Some(mac.clone()),
                    "idempotent"
                );
            }
            Ok(())
        },
    );
}

#[test]
fn logged_paths_are_bounded_and_carry_no_token() {
    fuzz(
        "logged_paths_are_bounded_and_carry_no_token",
        (hostile_text(), "[0-9a-f]{64}", hostile_text()),
        |(prefix, token, suffix)| {
            for path in [
                format!("{prefix}/nocloud/{token}/{suffix}"),
                format!("/nocloud//{token}{suffix}"),
                format!("{prefix}/callback/{token}"),
                format!("/{token}"),
            ] {
                let logged = metalboot::boot::http::redact_path(&path);
                prop_assert!(
                    !logged.contains(&token[..24]),
                    "{path:?} logged as {logged:?}"
                );
                prop_assert!(logged.chars().count() <= 513);
            }
            Ok(())
        },
    );
}

#[test]
fn callback_bodies_are_parsed_within_their_caps() {
    fuzz("callback_bodies_are_parsed_within_their_caps", prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..20_000),
        any::<String>().prop_map(String::into_bytes),
        ("[a-z-]{0,70}", proptest::collection::vec("[0-9.:a-fA-F]{0,40}", 0..80)).prop_map(|(h, addrs)| {
            serde_json::json!({"hostname": h, "addresses": addrs.iter().map(|a| serde_json::json!({"type": "InternalIP", "address": a})).collect::<Vec<_>>()}).to_string().into_bytes()
        }),
    ], |body| {
            if let Ok((hostname, addresses)) = metalboot::boot::nocloud::parse_callback(&body) {
                prop_assert!(body.len() <= metalboot::boot::nocloud::MAX_CALLBACK_BYTES);
                prop_assert!(addresses.len() <= 64);
                prop_assert!(hostname.is_none_or(|h| h.len() <= 253));
            }
        Ok(())
    });
}

#[test]
fn boot_secrets_of_any_shape_parse_or_are_refused() {
    fuzz(
        "boot_secrets_of_any_shape_parse_or_are_refused",
        (
            proptest::collection::btree_map("[a-z./-]{1,40}", any::<String>(), 0..6),
            proptest::collection::btree_map("[a-z./-]{1,40}", any::<String>(), 0..6),
            proptest::collection::btree_map(
                "[a-z-]{1,20}",
                proptest::collection::vec(any::<u8>(), 0..256),
                0..6,
            ),
        ),
        |(labels, annotations, data)| {
            let mut secret = Secret::default();
            secret.metadata.name = Some("m1-boot".into());
            secret.metadata.namespace = Some("ns".into());
            secret.metadata.labels = Some(labels);
            secret.metadata.annotations = Some(annotations);
            secret.data = Some(
                data.into_iter()
                    .map(|(k, v)| (k, ByteString(v)))
                    .collect::<BTreeMap<_, _>>(),
            );
            // The store's form keeps every annotation and every datum but the bootstrap data,
            // whatever the keys (well-known ones are kept as static strings).
            let stored = metalboot::boot::tokens::StoredBootSecret::from(&secret);
            let _ = metalboot::boot::tokens::parse_boot_secret(&stored);
            let back = stored.to_secret();
            let non_empty = |m: Option<BTreeMap<String, String>>| m.filter(|m| !m.is_empty());
            prop_assert_eq!(
                non_empty(back.metadata.annotations),
                non_empty(secret.metadata.annotations)
            );
            let mut data = secret.data.unwrap_or_default();
            data.remove("user-data");
            prop_assert_eq!(back.data.unwrap_or_default(), data);
            prop_assert_eq!(back.metadata.labels, None);
            Ok(())
        },
    );
}

#[test]
fn redfish_addresses_and_error_bodies_never_panic() {
    fuzz("redfish_addresses_and_error_bodies_never_panic", (prop_oneof![any::<String>(), "(redfish|redfish\\+http|idrac-redfish|https?)://[a-z0-9.:\\[\\]]{0,30}(/[a-zA-Z0-9._-]{0,20}){0,6}"], prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..4096),
            any::<String>().prop_map(|m| serde_json::json!({"error": {"message": m, "@Message.ExtendedInfo": [{"Message": m}]}}).to_string().into_bytes()),
        ]), |(address, body)| {
            if let Ok(parsed) = metalboot::bmc::redfish::parse_address(&address) {
                let _ = format!("{parsed:?}");
            }
            for message in metalboot::bmc::redfish::redfish_messages(&body) {
                prop_assert!(message.len() <= 64 * 1024);
            }
        Ok(())
    });
}

#[test]
fn tftp_packets_decode_or_are_ignored() {
    use metalboot::boot::tftp::wire;
    fuzz(
        "tftp_packets_decode_or_are_ignored",
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..600),
            (
                0u8..8,
                hostile_text(),
                "[a-zA-Z]{0,8}",
                proptest::collection::vec(("[a-zA-Z]{0,10}", "[0-9]{0,6}"), 0..20)
            )
                .prop_map(|(op, name, mode, opts)| {
                    let mut p = vec![0, op];
                    for field in [name, mode]
                        .into_iter()
                        .chain(opts.into_iter().flat_map(|(k, v)| [k, v]))
                    {
                        p.extend_from_slice(field.as_bytes());
                        p.push(0);
                    }
                    p
                }),
        ],
        |packet| {
            if let Some(wire::Request::Read { name, options, .. }) = wire::parse_request(&packet) {
                prop_assert!(name.len() < packet.len());
                prop_assert!(options.len() <= 16);
                let (block, accepted) = metalboot::boot::tftp::negotiate(&options, 1468, 1 << 20);
                prop_assert!((512..=1468).contains(&block));
                prop_assert!(accepted.len() <= options.len());
            }
            let _ = wire::parse_client_packet(&packet);
            Ok(())
        },
    );
}

#[test]
fn dhcp_requests_get_a_proxy_answer_or_none() {
    use dhcproto::{Decodable, v4};
    let files = metalboot::boot::dhcp::BootFiles::new("http://10.0.0.2:8080");
    let server = std::net::Ipv4Addr::new(10, 0, 0, 2);
    // A BOOTP header (op, htype 1, hlen 6, xid, magic cookie) followed by hostile options.
    let header = |options: Vec<u8>| {
        let mut p = vec![0u8; 240];
        p[0] = 1;
        p[1] = 1;
        p[2] = 6;
        p[236..240].copy_from_slice(&[99, 130, 83, 99]);
        p.extend(options);
        p
    };
    let answered = std::sync::atomic::AtomicU64::new(0);
    fuzz(
        "dhcp_requests_get_a_proxy_answer_or_none",
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..700),
            proptest::collection::vec(any::<u8>(), 0..400).prop_map(header),
            proptest::collection::vec(
                (
                    prop_oneof![
                        Just(53u8),
                        Just(60),
                        Just(77),
                        Just(93),
                        Just(94),
                        Just(175),
                        any::<u8>()
                    ],
                    proptest::collection::vec(any::<u8>(), 0..12)
                ),
                0..30
            )
            .prop_map(move |opts| header(
                opts.into_iter()
                    .flat_map(|(code, value)| {
                        let mut o = vec![code, value.len() as u8];
                        o.extend(value);
                        o
                    })
                    .chain([255])
                    .collect()
            )),
            // Well-formed PXE requests with arbitrary architecture, user class and relay address.
            (
                prop_oneof![
                    Just(0u16),
                    Just(7),
                    Just(9),
                    Just(11),
                    Just(16),
                    any::<u16>()
                ],
                proptest::collection::vec(any::<u8>(), 0..20),
                any::<[u8; 4]>(),
                any::<bool>()
            )
                .prop_map(|(arch, user_class, giaddr, discover)| {
                    use dhcproto::Encodable;
                    let mut m = v4::Message::default();
                    m.set_chaddr(&[0x52, 0x54, 0, 1, 2, 3]).set_giaddr(giaddr);
                    let opts = m.opts_mut();
                    opts.insert(v4::DhcpOption::MessageType(if discover {
                        v4::MessageType::Discover
                    } else {
                        v4::MessageType::Request
                    }));
                    opts.insert(v4::DhcpOption::ClassIdentifier(
                        b"PXEClient:Arch:00000".to_vec(),
                    ));
                    opts.insert(v4::DhcpOption::ClientSystemArchitecture(arch.into()));
                    opts.insert(v4::DhcpOption::UserClass(user_class));
                    m.to_vec().unwrap_or_default()
                }),
        ],
        |packet| {
            let _ = metalboot::boot::dhcp::requested_address(&packet);
            // The full-DHCP reading of the same packet.
            if let Ok(m) = v4::Message::decode(&mut dhcproto::Decoder::new(&packet)) {
                let _ = metalboot::boot::dhcp::address_request(&m);
            }
            // Both ports: 67 answers DISCOVERs, 4011 REQUESTs.
            let pxe_port = packet.len() % 2 == 0;
            if let Ok(reply) =
                metalboot::boot::dhcp::answer(&packet, &files, server, pxe_port, |_| true)
            {
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let reply = v4::Message::decode(&mut dhcproto::Decoder::new(&reply.packet))
                    .map_err(|e| TestCaseError::fail(format!("our reply does not decode: {e}")))?;
                prop_assert_eq!(reply.yiaddr(), std::net::Ipv4Addr::UNSPECIFIED);
                prop_assert_eq!(reply.siaddr(), server);
            }
            Ok(())
        },
    );
    let answered = answered.into_inner();
    println!("fuzz dhcp: {answered} requests answered");
    assert!(answered > 0, "the reply path was exercised");
}

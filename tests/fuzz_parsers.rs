//! Property-based fuzzing (proptest; `cargo fuzz` needs a nightly toolchain this machine lacks) of
//! every parser that reads input from the network or from objects anyone may write: TFTP file
//! names, HTTP route parts (MAC, token paths, artifact paths), the callback body, the boot Secret,
//! Redfish addresses and error bodies. Each must answer every input without panicking, and what
//! it accepts must satisfy its invariant. Cases per target: `METALBOOT_FUZZ_CASES` (default 10000).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use proptest::prelude::*;

fn config() -> ProptestConfig {
    let cases = std::env::var("METALBOOT_FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(10_000);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
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

proptest! {
    #![proptest_config(config())]

    #[test]
    fn tftp_names_resolve_inside_the_root_or_are_refused(name in hostile_text()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = std::fs::canonicalize(dir.path()).expect("root");
        std::fs::write(root.join("undionly.kpxe"), b"x").expect("file");
        if let Ok(file) = metalboot::boot::tftp::resolve(&root, &name) {
            prop_assert!(file.starts_with(&root), "{name:?} resolved to {file:?}");
        }
    }

    #[test]
    fn artifact_paths_never_climb(path in hostile_text()) {
        if metalboot::boot::artifacts::check_relative_path(&path).is_ok() {
            prop_assert!(!path.split('/').any(|s| s == ".." || s.is_empty()), "{path:?}");
            prop_assert!(!path.starts_with('/') && !path.contains('\\'), "{path:?}");
        }
    }

    #[test]
    fn macs_normalize_to_one_canonical_form(raw in prop_oneof![
        any::<String>(),
        "[0-9a-fA-F]{2}([-:][0-9a-fA-F]{2}){5}",
        "[0-9a-fA-F]{12}",
    ]) {
        if let Some(mac) = metalboot::boot::ipxe::normalize_mac(&raw) {
            prop_assert_eq!(mac.len(), 17);
            prop_assert!(mac.chars().enumerate().all(|(i, c)| if i % 3 == 2 { c == ':' } else { c.is_ascii_hexdigit() && !c.is_ascii_uppercase() }), "{}", mac);
            prop_assert_eq!(metalboot::boot::ipxe::normalize_mac(&mac), Some(mac.clone()), "idempotent");
        }
    }

    #[test]
    fn logged_paths_are_bounded_and_carry_no_token(
        prefix in hostile_text(),
        token in "[0-9a-f]{64}",
        suffix in hostile_text(),
    ) {
        for path in [
            format!("{prefix}/nocloud/{token}/{suffix}"),
            format!("/nocloud//{token}{suffix}"),
            format!("{prefix}/callback/{token}"),
            format!("/{token}"),
        ] {
            let logged = metalboot::boot::http::redact_path(&path);
            prop_assert!(!logged.contains(&token[..24]), "{path:?} logged as {logged:?}");
            prop_assert!(logged.chars().count() <= 513);
        }
    }

    #[test]
    fn callback_bodies_are_parsed_within_their_caps(body in prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..20_000),
        any::<String>().prop_map(String::into_bytes),
        ("[a-z-]{0,70}", proptest::collection::vec("[0-9.:a-fA-F]{0,40}", 0..80)).prop_map(|(h, addrs)| {
            serde_json::json!({"hostname": h, "addresses": addrs.iter().map(|a| serde_json::json!({"type": "InternalIP", "address": a})).collect::<Vec<_>>()}).to_string().into_bytes()
        }),
    ]) {
        if let Ok((hostname, addresses)) = metalboot::boot::nocloud::parse_callback(&body) {
            prop_assert!(body.len() <= metalboot::boot::nocloud::MAX_CALLBACK_BYTES);
            prop_assert!(addresses.len() <= 64);
            prop_assert!(hostname.is_none_or(|h| h.len() <= 253));
        }
    }

    #[test]
    fn boot_secrets_of_any_shape_parse_or_are_refused(
        labels in proptest::collection::btree_map("[a-z./-]{1,40}", any::<String>(), 0..6),
        annotations in proptest::collection::btree_map("[a-z./-]{1,40}", any::<String>(), 0..6),
        data in proptest::collection::btree_map("[a-z-]{1,20}", proptest::collection::vec(any::<u8>(), 0..256), 0..6),
    ) {
        let mut secret = Secret::default();
        secret.metadata.name = Some("m1-boot".into());
        secret.metadata.namespace = Some("ns".into());
        secret.metadata.labels = Some(labels);
        secret.metadata.annotations = Some(annotations);
        secret.data = Some(data.into_iter().map(|(k, v)| (k, ByteString(v))).collect::<BTreeMap<_, _>>());
        let _ = metalboot::boot::tokens::parse_boot_secret(&secret);
    }

    #[test]
    fn redfish_addresses_and_error_bodies_never_panic(
        address in prop_oneof![any::<String>(), "(redfish|redfish\\+http|idrac-redfish|https?)://[a-z0-9.:\\[\\]]{0,30}(/[a-zA-Z0-9._-]{0,20}){0,6}"],
        body in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..4096),
            any::<String>().prop_map(|m| serde_json::json!({"error": {"message": m, "@Message.ExtendedInfo": [{"Message": m}]}}).to_string().into_bytes()),
        ],
    ) {
        if let Ok(parsed) = metalboot::bmc::redfish::parse_address(&address) {
            let _ = format!("{parsed:?}");
        }
        for message in metalboot::bmc::redfish::redfish_messages(&body) {
            prop_assert!(message.len() <= 64 * 1024);
        }
    }
}

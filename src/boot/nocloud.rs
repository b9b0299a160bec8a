//! cloud-init NoCloud documents and the callback report, as pure functions.

use std::net::IpAddr;

use serde::Deserialize;

use super::tokens::BootRecord;

/// Largest callback body accepted.
pub const MAX_CALLBACK_BYTES: usize = 16 * 1024;
const MAX_ADDRESSES: usize = 64;

/// `meta-data`: instance-id, local-hostname and provider-id (kubelet's `--provider-id`).
pub fn meta_data(record: &BootRecord) -> Result<String, serde_yaml::Error> {
    #[derive(serde::Serialize)]
    struct MetaData<'a> {
        #[serde(rename = "instance-id")]
        instance_id: &'a str,
        #[serde(rename = "local-hostname")]
        local_hostname: &'a str,
        #[serde(rename = "provider-id")]
        provider_id: &'a str,
    }
    serde_yaml::to_string(&MetaData {
        instance_id: &record.instance_id,
        local_hostname: &record.host,
        provider_id: &record.provider_id,
    })
}

/// `network-config` (version 2): DHCP on every Ethernet interface, what a freshly booted host on
/// the provisioning network needs before anything else.
pub fn network_config() -> &'static str {
    "version: 2\nethernets:\n  all-ethernet:\n    match:\n      name: \"e*\"\n    dhcp4: true\n"
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CallbackError {
    #[error("callback body is larger than {MAX_CALLBACK_BYTES} bytes")]
    TooLarge,
    #[error("callback body is not the expected JSON: {0}")]
    Malformed(String),
    #[error("callback address {0:?} is not an IP address")]
    BadAddress(String),
    #[error("callback hostname {0:?} is not a valid DNS name")]
    BadHostname(String),
    #[error("callback lists more than {MAX_ADDRESSES} addresses")]
    TooManyAddresses,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ReportedAddress {
    Plain(String),
    Typed { address: String },
}

#[derive(Deserialize)]
struct Report {
    #[serde(default)]
    hostname: Option<String>,
    #[serde(default)]
    addresses: Vec<ReportedAddress>,
}

/// A validated callback: hostname (if any) and IP addresses, deduplicated in order.
pub fn parse_callback(body: &[u8]) -> Result<(Option<String>, Vec<IpAddr>), CallbackError> {
    if body.len() > MAX_CALLBACK_BYTES {
        return Err(CallbackError::TooLarge);
    }
    let report: Report = if body.iter().all(u8::is_ascii_whitespace) {
        Report {
            hostname: None,
            addresses: Vec::new(),
        }
    } else {
        serde_json::from_slice(body).map_err(|e| CallbackError::Malformed(e.to_string()))?
    };
    if report.addresses.len() > MAX_ADDRESSES {
        return Err(CallbackError::TooManyAddresses);
    }
    let mut addresses = Vec::new();
    for a in report.addresses {
        let text = match a {
            ReportedAddress::Plain(s) | ReportedAddress::Typed { address: s } => s,
        };
        let ip: IpAddr = text
            .trim()
            .parse()
            .map_err(|_| CallbackError::BadAddress(text.clone()))?;
        if !addresses.contains(&ip) {
            addresses.push(ip);
        }
    }
    let hostname = match report
        .hostname
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
    {
        Some(h) if valid_hostname(&h) => Some(h),
        Some(h) => return Err(CallbackError::BadHostname(h)),
        None => None,
    };
    Ok((hostname, addresses))
}

fn valid_hostname(h: &str) -> bool {
    h.len() <= 253
        && h.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callback_bodies() {
        let ok = |body: &str| parse_callback(body.as_bytes());
        assert_eq!(
            ok(r#"{"hostname":"host-0","addresses":["10.0.2.15","fe80::1","10.0.2.15"]}"#),
            Ok((
                Some("host-0".into()),
                vec!["10.0.2.15".parse().unwrap(), "fe80::1".parse().unwrap()]
            ))
        );
        assert_eq!(
            ok(r#"{"addresses":[{"type":"InternalIP","address":"192.168.1.5"}]}"#),
            Ok((None, vec!["192.168.1.5".parse().unwrap()]))
        );
        assert_eq!(ok(""), Ok((None, vec![])));
        assert!(matches!(ok("{nope"), Err(CallbackError::Malformed(_))));
        assert!(matches!(
            ok(r#"{"addresses":["300.1.1.1"]}"#),
            Err(CallbackError::BadAddress(_))
        ));
        assert!(matches!(
            ok(r#"{"hostname":"bad host; rm -rf /"}"#),
            Err(CallbackError::BadHostname(_))
        ));
        assert!(matches!(
            ok(r#"{"hostname":"-x"}"#),
            Err(CallbackError::BadHostname(_))
        ));
        assert_eq!(
            parse_callback(&vec![b' '; MAX_CALLBACK_BYTES + 1]),
            Err(CallbackError::TooLarge)
        );
        let many = format!(
            r#"{{"addresses":[{}]}}"#,
            vec!["\"10.0.0.1\""; 65].join(",")
        );
        assert_eq!(ok(&many), Err(CallbackError::TooManyAddresses));
    }
}

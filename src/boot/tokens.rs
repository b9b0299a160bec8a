//! Boot tokens: one per provisioning attempt, kept in a Secret owned by the MetalMachine (the
//! "boot Secret"). The Secret carries everything the boot service needs to answer that host —
//! token, NoCloud identity, a snapshot of the bootstrap data — and, once the host calls back,
//! the callback record. It is the durable state of an attempt: a restarted manager rebuilds from
//! it, and deleting it kills the token.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use rand::RngCore;
use serde::{Deserialize, Serialize};

/// Label on every boot Secret; the boot service's reflector selects on it.
pub const BOOT_TOKEN_LABEL: &str = "metalboot.io/boot-token";
/// Secret type of boot Secrets, so they are recognisable in `kubectl get secrets`.
pub const BOOT_SECRET_TYPE: &str = "metalboot.io/boot-token";
const KEY_TOKEN: &str = "token";
const KEY_USER_DATA: &str = "user-data";
const KEY_CALLBACK: &str = "callback";
/// The deploy agent's hardware inventory (JSON), written by the boot service.
const KEY_INSPECTION: &str = "inspection";
/// The deploy agent's last report (JSON), written by the boot service.
const KEY_DEPLOY: &str = "deploy";
pub const ANN_HOST: &str = "metalboot.io/host";
const ANN_PROVIDER_ID: &str = "metalboot.io/provider-id";
const ANN_INSTANCE_ID: &str = "metalboot.io/instance-id";
const ANN_ATTEMPT: &str = "metalboot.io/attempt";
const ANN_MACHINE: &str = "metalboot.io/metalmachine";
/// When the host was powered on for this attempt (RFC 3339): the boot timeout runs from it, and
/// its presence means "do not power again" after a manager restart.
const ANN_POWERED_AT: &str = "metalboot.io/powered-at";
/// When the host was pointed at its disk and restarted after the image was written (image mode):
/// its presence means "do not restart again".
const ANN_DISK_BOOT_AT: &str = "metalboot.io/disk-boot-at";
/// Present on a cleaning attempt (`metadata` or `full`): the token boots the deploy agent to wipe
/// the released host's disks, and serves no NoCloud data and takes no callback.
const ANN_CLEAN: &str = "metalboot.io/clean";
/// How the host's BMC kept the one-time network boot the power-on set (`Honoured` or
/// `Continuous`), when the power-on read it back; the MetalHost controller records it in
/// `status.bmc.bootOnce`.
const ANN_BOOT_ONCE: &str = "metalboot.io/boot-once";
/// Present on a live-mode machine's Secret once it is provisioned: the token is armed for the
/// n-th network boot after provisioning (a reboot), and rotated after each such boot called back.
const ANN_BOOT: &str = "metalboot.io/boot";
/// Every key above, which the store keeps as static strings (see [`StoredBootSecret`]).
const KNOWN_KEYS: [&str; 15] = [
    KEY_TOKEN,
    KEY_USER_DATA,
    KEY_CALLBACK,
    KEY_INSPECTION,
    KEY_DEPLOY,
    ANN_HOST,
    ANN_PROVIDER_ID,
    ANN_INSTANCE_ID,
    ANN_ATTEMPT,
    ANN_MACHINE,
    ANN_POWERED_AT,
    ANN_DISK_BOOT_AT,
    ANN_CLEAN,
    ANN_BOOT_ONCE,
    ANN_BOOT,
];

mod stored;
pub use stored::StoredBootSecret;

/// The host a boot Secret's attempt runs on, from its metadata alone (watches of metadata).
pub fn boot_secret_host(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> Option<&str> {
    let labelled = meta
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(BOOT_TOKEN_LABEL));
    labelled
        .then(|| meta.annotations.as_ref()?.get(ANN_HOST).map(String::as_str))
        .flatten()
}

/// Name of the boot Secret of a MetalMachine.
pub fn boot_secret_name(metal_machine: &str) -> String {
    format!("{metal_machine}-boot")
}

/// A bearer token. Debug never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(String);

impl Token {
    /// 256 random bits, hex-encoded (URL-safe, fixed length).
    pub fn mint() -> Self {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        Token(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Compares in time independent of where the strings differ.
    pub fn matches(&self, presented: &str) -> bool {
        let (a, b) = (self.0.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }

    /// A short non-secret fingerprint for logs and Events.
    pub fn fingerprint(&self) -> String {
        self.0.chars().take(6).collect()
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Token({}…)", self.fingerprint())
    }
}

/// What a host reported when it called back.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct CallbackRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default)]
    pub addresses: Vec<IpAddr>,
    /// Source address of the callback request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_ip: Option<IpAddr>,
    /// RFC 3339 time the callback arrived.
    pub received_at: String,
}

/// One provisioning attempt, as read from its boot Secret.
#[derive(Clone, Debug, PartialEq)]
pub struct BootRecord {
    pub namespace: String,
    pub secret_name: String,
    pub metal_machine: String,
    pub host: String,
    pub attempt: u32,
    pub token: Token,
    pub provider_id: String,
    pub instance_id: String,
    pub callback: Option<CallbackRecord>,
    /// What the deploy agent found on the host (image mode).
    pub inspection: Option<crate::api::metalhost::HardwareInventory>,
    /// The deploy agent's last report (image mode).
    pub deploy: Option<crate::agent::protocol::DeployReport>,
    /// When the host was powered on for this attempt.
    pub powered_at: Option<jiff::Timestamp>,
    /// When the host was restarted into its written disk (image mode).
    pub disk_boot_at: Option<jiff::Timestamp>,
    /// Set on a cleaning attempt: how much the agent wipes.
    pub clean: Option<crate::agent::wipe::WipeMode>,
    /// Set once a live-mode machine is provisioned: which boot after provisioning this token is
    /// armed for (1 = the first reboot).
    pub reboot: Option<u32>,
    /// How the BMC kept the one-time network boot of the power-on, read back right after it.
    pub boot_once: Option<crate::api::metalhost::BootOnce>,
    pub resource_version: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BootSecretError {
    #[error("boot Secret {0} lacks {1}")]
    Missing(String, &'static str),
    #[error("boot Secret {0} has an unreadable {1}")]
    Invalid(String, &'static str),
}

/// Inputs of a new attempt.
pub struct NewAttempt<'a> {
    pub namespace: &'a str,
    pub metal_machine: &'a str,
    pub owner: OwnerReference,
    pub cluster_name: Option<&'a str>,
    pub host: &'a str,
    pub attempt: u32,
    pub provider_id: &'a str,
    pub user_data: &'a [u8],
}

/// The boot Secret of a new attempt, with a fresh token.
pub fn new_boot_secret(a: &NewAttempt<'_>) -> Secret {
    let token = Token::mint();
    let mut labels = BTreeMap::from([(BOOT_TOKEN_LABEL.to_string(), "true".to_string())]);
    if let Some(cluster) = a.cluster_name {
        labels.insert(
            crate::api::CLUSTER_NAME_LABEL.to_string(),
            cluster.to_string(),
        );
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(boot_secret_name(a.metal_machine)),
            namespace: Some(a.namespace.to_string()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([
                (ANN_MACHINE.to_string(), a.metal_machine.to_string()),
                (ANN_HOST.to_string(), a.host.to_string()),
                (ANN_PROVIDER_ID.to_string(), a.provider_id.to_string()),
                (
                    ANN_INSTANCE_ID.to_string(),
                    format!("{}-{}", a.owner.uid, a.attempt),
                ),
                (ANN_ATTEMPT.to_string(), a.attempt.to_string()),
            ])),
            owner_references: Some(vec![a.owner.clone()]),
            ..Default::default()
        },
        type_: Some(BOOT_SECRET_TYPE.to_string()),
        data: Some(BTreeMap::from([
            (
                KEY_TOKEN.to_string(),
                ByteString(token.expose().as_bytes().to_vec()),
            ),
            (KEY_USER_DATA.to_string(), ByteString(a.user_data.to_vec())),
        ])),
        ..Default::default()
    }
}

/// Inputs of a cleaning attempt.
pub struct CleanAttempt<'a> {
    pub namespace: &'a str,
    pub metal_machine: &'a str,
    /// The host being cleaned owns the Secret: the released machine may be garbage collected
    /// (foreground deletion takes its dependents first) while its host is still being cleaned.
    pub host_owner: OwnerReference,
    pub cluster_name: Option<&'a str>,
    pub provider_id: &'a str,
    pub mode: crate::agent::wipe::WipeMode,
}

/// The boot Secret of a cleaning attempt, with a fresh token and no bootstrap data. It replaces
/// the machine's boot Secret (same name), so the provisioning token dies with it.
pub fn clean_boot_secret(a: &CleanAttempt<'_>) -> Secret {
    let mode = match a.mode {
        crate::agent::wipe::WipeMode::Metadata => "metadata",
        crate::agent::wipe::WipeMode::Full => "full",
    };
    let mut labels = BTreeMap::from([(BOOT_TOKEN_LABEL.to_string(), "true".to_string())]);
    if let Some(cluster) = a.cluster_name {
        labels.insert(
            crate::api::CLUSTER_NAME_LABEL.to_string(),
            cluster.to_string(),
        );
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(boot_secret_name(a.metal_machine)),
            namespace: Some(a.namespace.to_string()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([
                (ANN_MACHINE.to_string(), a.metal_machine.to_string()),
                (ANN_HOST.to_string(), a.host_owner.name.clone()),
                (ANN_PROVIDER_ID.to_string(), a.provider_id.to_string()),
                (
                    ANN_INSTANCE_ID.to_string(),
                    format!("{}-clean", a.host_owner.uid),
                ),
                (ANN_ATTEMPT.to_string(), "1".to_string()),
                (ANN_CLEAN.to_string(), mode.to_string()),
            ])),
            owner_references: Some(vec![a.host_owner.clone()]),
            ..Default::default()
        },
        type_: Some(BOOT_SECRET_TYPE.to_string()),
        data: Some(BTreeMap::from([(
            KEY_TOKEN.to_string(),
            ByteString(Token::mint().expose().as_bytes().to_vec()),
        )])),
        ..Default::default()
    }
}

/// The data patch that records a callback on a boot Secret.
pub fn callback_patch(record: &CallbackRecord) -> Result<serde_json::Value, serde_json::Error> {
    use base64::Engine;
    let json = serde_json::to_vec(record)?;
    Ok(serde_json::json!({
        "data": { KEY_CALLBACK: base64::engine::general_purpose::STANDARD.encode(json) }
    }))
}

/// The data patch that records one JSON document under `key`.
fn json_data_patch(
    key: &str,
    value: &impl Serialize,
) -> Result<serde_json::Value, serde_json::Error> {
    use base64::Engine;
    let json = serde_json::to_vec(value)?;
    Ok(serde_json::json!({
        "data": { key: base64::engine::general_purpose::STANDARD.encode(json) }
    }))
}

/// The data patch that records the deploy agent's inspection.
pub fn inspection_patch(
    inventory: &crate::api::metalhost::HardwareInventory,
) -> Result<serde_json::Value, serde_json::Error> {
    json_data_patch(KEY_INSPECTION, inventory)
}

/// The data patch that records the deploy agent's report.
pub fn deploy_patch(
    report: &crate::agent::protocol::DeployReport,
) -> Result<serde_json::Value, serde_json::Error> {
    json_data_patch(KEY_DEPLOY, report)
}

/// The patch that records when the host was restarted into its written disk.
pub fn disk_boot_patch(at: jiff::Timestamp) -> serde_json::Value {
    serde_json::json!({"metadata": {"annotations": {ANN_DISK_BOOT_AT: at.to_string()}}})
}

/// The patch that records when the host was powered on for the current attempt, and how the BMC
/// kept the one-time network boot set for it, when that was read back.
pub fn powered_patch(
    at: jiff::Timestamp,
    boot_once: Option<crate::api::metalhost::BootOnce>,
) -> serde_json::Value {
    let mut annotations = serde_json::json!({ANN_POWERED_AT: at.to_string()});
    if let Some(once) = boot_once {
        annotations[ANN_BOOT_ONCE] = serde_json::json!(once.to_string());
    }
    serde_json::json!({"metadata": {"annotations": annotations}})
}

/// The bootstrap data snapshot of a boot Secret read from the apiserver (the store has none);
/// None for a cleaning attempt, which has none.
pub fn user_data(secret: &Secret) -> Option<&[u8]> {
    secret
        .data
        .as_ref()?
        .get(KEY_USER_DATA)
        .map(|b| b.0.as_slice())
}

/// The merge patch that turns `before` into `after` (a `next_attempt` or `next_boot` of it):
/// only the annotations and data keys that differ, conditioned on `before`'s resourceVersion so
/// the old token dies atomically, as a replace would. Keys `before` lacks and `after` keeps
/// (the bootstrap data the store drops) are left as they are on the server.
pub fn renewal_patch(before: &Secret, after: &Secret) -> serde_json::Value {
    use base64::Engine;
    fn changes<V: PartialEq>(
        before: Option<&BTreeMap<String, V>>,
        after: Option<&BTreeMap<String, V>>,
        encode: impl Fn(&V) -> serde_json::Value,
    ) -> serde_json::Map<String, serde_json::Value> {
        let empty = BTreeMap::new();
        let (before, after) = (before.unwrap_or(&empty), after.unwrap_or(&empty));
        let mut patch = serde_json::Map::new();
        for (key, value) in after {
            if before.get(key) != Some(value) {
                patch.insert(key.clone(), encode(value));
            }
        }
        for key in before.keys().filter(|k| !after.contains_key(*k)) {
            patch.insert(key.clone(), serde_json::Value::Null);
        }
        patch
    }
    let annotations = changes(
        before.metadata.annotations.as_ref(),
        after.metadata.annotations.as_ref(),
        |v: &String| serde_json::json!(v),
    );
    let data = changes(
        before.data.as_ref(),
        after.data.as_ref(),
        |v: &ByteString| serde_json::json!(base64::engine::general_purpose::STANDARD.encode(&v.0)),
    );
    crate::controllers::conditioned(
        serde_json::json!({"metadata": {"annotations": annotations}, "data": data}),
        before.metadata.resource_version.as_deref(),
    )
}

/// The same boot Secret for the next attempt: a fresh token, attempt + 1, not yet powered, no
/// callback. Written as a `renewal_patch` conditioned on its resourceVersion, which kills the
/// old token atomically.
pub fn next_attempt(secret: &Secret) -> Secret {
    let mut next = secret.clone();
    let attempt = next
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANN_ATTEMPT))
        .and_then(|a| a.parse::<u32>().ok())
        .unwrap_or(1);
    let uid = next
        .metadata
        .owner_references
        .as_ref()
        .and_then(|o| o.first())
        .map(|o| o.uid.clone())
        .unwrap_or_default();
    let annotations = next
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations.insert(ANN_ATTEMPT.into(), (attempt + 1).to_string());
    annotations.insert(ANN_INSTANCE_ID.into(), format!("{uid}-{}", attempt + 1));
    // The next attempt deploys again; what the agent found about the hardware stays true.
    renew(&mut next);
    next
}

/// A fresh token for the same Secret, and nothing of what the last token's boot recorded: not
/// powered, not restarted into its disk, no callback, no deploy report.
fn renew(secret: &mut Secret) {
    let annotations = secret
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    annotations.remove(ANN_POWERED_AT);
    annotations.remove(ANN_DISK_BOOT_AT);
    let data = secret.data.get_or_insert_with(Default::default);
    data.insert(
        KEY_TOKEN.into(),
        ByteString(Token::mint().expose().as_bytes().to_vec()),
    );
    data.remove(KEY_CALLBACK);
    data.remove(KEY_DEPLOY);
}

/// The same boot Secret armed for the next network boot of a provisioned live-mode machine: a
/// fresh token (the one its last boot used dies with the write, a `renewal_patch` conditioned
/// on the resourceVersion), the boot count + 1, no callback, not powered. Attempt, instance-id and the
/// bootstrap data snapshot stay: it is the same machine coming back, not a new attempt.
pub fn next_boot(secret: &Secret) -> Secret {
    let mut next = secret.clone();
    let annotations = next
        .metadata
        .annotations
        .get_or_insert_with(Default::default);
    let boot = annotations
        .get(ANN_BOOT)
        .and_then(|n| n.parse::<u32>().ok())
        .unwrap_or(0);
    annotations.insert(ANN_BOOT.into(), boot.saturating_add(1).to_string());
    renew(&mut next);
    next
}

/// [`parse_boot_secret`] of a whole Secret, as read from the apiserver.
pub fn parse_secret(secret: &Secret) -> Result<BootRecord, BootSecretError> {
    parse_boot_secret(&secret.into())
}

/// Reads a boot Secret. Anything malformed is an error, never a panic: Secrets can be edited.
pub fn parse_boot_secret(secret: &StoredBootSecret) -> Result<BootRecord, BootSecretError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let ann = |key: &'static str| secret.annotation(key);
    let annotation = |key: &'static str| {
        ann(key)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
            .ok_or_else(|| BootSecretError::Missing(name.clone(), key))
    };
    let datum = |key: &'static str| secret.datum(key);
    let token = datum(KEY_TOKEN)
        .ok_or_else(|| BootSecretError::Missing(name.clone(), KEY_TOKEN))
        .and_then(|b| {
            String::from_utf8(b.to_vec())
                .map_err(|_| BootSecretError::Invalid(name.clone(), KEY_TOKEN))
        })?;
    if token.len() < 32 {
        return Err(BootSecretError::Invalid(name, KEY_TOKEN));
    }
    let callback = match datum(KEY_CALLBACK) {
        Some(bytes) => Some(
            serde_json::from_slice::<CallbackRecord>(bytes)
                .map_err(|_| BootSecretError::Invalid(name.clone(), KEY_CALLBACK))?,
        ),
        None => None,
    };
    let json = |key: &'static str| -> Result<Option<serde_json::Value>, BootSecretError> {
        datum(key)
            .map(|bytes| {
                serde_json::from_slice(bytes)
                    .map_err(|_| BootSecretError::Invalid(name.clone(), key))
            })
            .transpose()
    };
    let inspection = json(KEY_INSPECTION)?
        .map(serde_json::from_value)
        .transpose()
        .map_err(|_| BootSecretError::Invalid(name.clone(), KEY_INSPECTION))?;
    let deploy = json(KEY_DEPLOY)?
        .map(serde_json::from_value)
        .transpose()
        .map_err(|_| BootSecretError::Invalid(name.clone(), KEY_DEPLOY))?;
    Ok(BootRecord {
        inspection,
        deploy,
        namespace: secret.metadata.namespace.clone().unwrap_or_default(),
        metal_machine: annotation(ANN_MACHINE)?,
        host: annotation(ANN_HOST)?,
        attempt: annotation(ANN_ATTEMPT)?
            .parse()
            .map_err(|_| BootSecretError::Invalid(name.clone(), ANN_ATTEMPT))?,
        provider_id: annotation(ANN_PROVIDER_ID)?,
        instance_id: annotation(ANN_INSTANCE_ID)?,
        token: Token(token),
        callback,
        powered_at: ann(ANN_POWERED_AT).and_then(|t| t.parse().ok()),
        disk_boot_at: ann(ANN_DISK_BOOT_AT).and_then(|t| t.parse().ok()),
        clean: match ann(ANN_CLEAN) {
            None => None,
            Some("full") => Some(crate::agent::wipe::WipeMode::Full),
            Some("metadata") => Some(crate::agent::wipe::WipeMode::Metadata),
            Some(_) => return Err(BootSecretError::Invalid(name, ANN_CLEAN)),
        },
        reboot: match ann(ANN_BOOT) {
            None => None,
            Some(n) => Some(
                n.parse()
                    .map_err(|_| BootSecretError::Invalid(name.clone(), ANN_BOOT))?,
            ),
        },
        // A fact about the BMC, not the attempt: an edited value is ignored, never an error.
        boot_once: match ann(ANN_BOOT_ONCE) {
            Some("Honoured") => Some(crate::api::metalhost::BootOnce::Honoured),
            Some("Continuous") => Some(crate::api::metalhost::BootOnce::Continuous),
            _ => None,
        },
        resource_version: secret.metadata.resource_version.clone(),
        secret_name: name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner() -> OwnerReference {
        OwnerReference {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "MetalMachine".into(),
            name: "m1".into(),
            uid: "uid-1".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }
    }

    fn attempt() -> Secret {
        new_boot_secret(&NewAttempt {
            namespace: "ns",
            metal_machine: "m1",
            owner: owner(),
            cluster_name: Some("c1"),
            host: "h1",
            attempt: 2,
            provider_id: "metalboot://ns/h1",
            user_data: b"#!/bin/sh\n\x00\xff",
        })
    }

    #[test]
    fn a_new_boot_secret_parses_back() {
        let record = parse_secret(&attempt()).expect("parse");
        assert_eq!(record.metal_machine, "m1");
        assert_eq!(record.host, "h1");
        assert_eq!(record.attempt, 2);
        assert_eq!(record.instance_id, "uid-1-2");
        assert_eq!(user_data(&attempt()), Some(&b"#!/bin/sh\n\x00\xff"[..]));
        assert_eq!(record.token.expose().len(), 64);
        assert!(record.callback.is_none());
    }

    /// The power-on's patch carries how the BMC kept the one-time boot, when it was read back;
    /// a value edited into something else is ignored, not an unreadable Secret.
    #[test]
    fn the_powered_patch_records_how_the_bmc_kept_the_one_time_boot() {
        use crate::api::metalhost::BootOnce;
        let patched = |patch: serde_json::Value| {
            let mut secret = attempt();
            let annotations = secret
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            for (k, v) in patch["metadata"]["annotations"]
                .as_object()
                .into_iter()
                .flatten()
            {
                annotations.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
            }
            parse_secret(&secret).expect("parse")
        };
        let t = jiff::Timestamp::UNIX_EPOCH;
        for once in [BootOnce::Honoured, BootOnce::Continuous] {
            let record = patched(powered_patch(t, Some(once)));
            assert_eq!(record.boot_once, Some(once));
            assert_eq!(record.powered_at, Some(t));
        }
        assert_eq!(patched(powered_patch(t, None)).boot_once, None);
        let garbled =
            patched(serde_json::json!({"metadata": {"annotations": {ANN_BOOT_ONCE: "Twice"}}}));
        assert_eq!(garbled.boot_once, None);
    }

    #[test]
    fn the_next_attempt_has_a_new_token_and_forgets_power_and_callback() {
        let mut first = attempt();
        first
            .metadata
            .annotations
            .as_mut()
            .map(|a| a.insert(ANN_POWERED_AT.into(), "2026-01-01T00:00:00Z".into()));
        first.data.as_mut().map(|d| {
            d.insert(
                KEY_CALLBACK.into(),
                ByteString(br#"{"receivedAt":"x"}"#.to_vec()),
            )
        });
        let before = parse_secret(&first).expect("parse");
        assert!(before.powered_at.is_some() && before.callback.is_some());
        let next = next_attempt(&first);
        let after = parse_secret(&next).expect("parse");
        assert_eq!(after.attempt, 3);
        assert_ne!(after.token, before.token);
        assert!(after.powered_at.is_none() && after.callback.is_none());
        assert_eq!(user_data(&next), user_data(&first));
        assert_eq!(after.instance_id, "uid-1-3");
    }

    #[test]
    fn each_boot_of_a_live_machine_gets_its_own_token_and_keeps_its_identity() {
        let mut provisioned = attempt();
        provisioned.data.as_mut().map(|d| {
            d.insert(
                KEY_CALLBACK.into(),
                ByteString(br#"{"receivedAt":"x"}"#.to_vec()),
            )
        });
        let before = parse_secret(&provisioned).expect("parse");
        assert_eq!(before.reboot, None);
        let first = next_boot(&provisioned);
        let armed = parse_secret(&first).expect("parse");
        assert_eq!(armed.reboot, Some(1));
        assert_ne!(armed.token, before.token);
        assert!(armed.callback.is_none() && armed.powered_at.is_none());
        assert_eq!(
            (armed.attempt, &armed.instance_id, user_data(&first)),
            (before.attempt, &before.instance_id, user_data(&provisioned))
        );
        let second = parse_secret(&next_boot(&first)).expect("parse");
        assert_eq!(second.reboot, Some(2));
        assert_ne!(second.token, armed.token);

        let mut garbled = first.clone();
        garbled
            .metadata
            .annotations
            .as_mut()
            .map(|a| a.insert(ANN_BOOT.into(), "-1".into()));
        assert_eq!(
            parse_secret(&garbled),
            Err(BootSecretError::Invalid("m1-boot".into(), ANN_BOOT))
        );
    }

    /// RFC 7386 merge, as the apiserver applies a merge patch (test only).
    fn merged(mut target: serde_json::Value, patch: &serde_json::Value) -> serde_json::Value {
        if let (Some(t), Some(p)) = (target.as_object_mut(), patch.as_object()) {
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    let next = merged(t.remove(k).unwrap_or(serde_json::Value::Null), v);
                    t.insert(k.clone(), next);
                }
            }
            return target;
        }
        patch.clone()
    }

    /// The store holds boot Secrets without their bootstrap data; the renewal written from that
    /// copy gives the server's copy what `next_attempt`/`next_boot` of the whole Secret gives,
    /// bootstrap data untouched, and only for the version it was decided from.
    #[test]
    fn a_renewal_from_the_stores_copy_keeps_the_bootstrap_data_on_the_server() {
        let mut on_server = attempt();
        on_server.metadata.resource_version = Some("7".into());
        on_server
            .metadata
            .annotations
            .as_mut()
            .map(|a| a.insert(ANN_POWERED_AT.into(), "2026-01-01T00:00:00Z".into()));
        on_server.data.as_mut().map(|d| {
            d.insert(
                KEY_CALLBACK.into(),
                ByteString(br#"{"receivedAt":"x"}"#.to_vec()),
            )
        });
        let stored = StoredBootSecret::from(&on_server);
        assert_eq!(
            stored.datum(KEY_USER_DATA),
            None,
            "the store drops the bootstrap data"
        );
        assert_eq!(stored.metadata.labels, None, "and the labels");
        assert_eq!(
            stored.annotation(ANN_POWERED_AT),
            Some("2026-01-01T00:00:00Z"),
            "and keeps the annotations"
        );
        assert_eq!(
            parse_boot_secret(&stored),
            parse_secret(&on_server),
            "the store's copy reads as the whole Secret does"
        );
        let in_store = stored.to_secret();
        assert_eq!(user_data(&in_store), None);
        for renew in [next_attempt, next_boot] {
            let next = renew(&in_store);
            let patch = renewal_patch(&in_store, &next);
            assert_eq!(patch["metadata"]["resourceVersion"], "7");
            assert!(patch["data"].get(KEY_USER_DATA).is_none(), "{patch}");
            let server = serde_json::to_value(&on_server).expect("json");
            let written: Secret = serde_json::from_value(merged(server, &patch)).expect("a Secret");
            let mut expected = renew(&on_server);
            // The token is fresh on each call: compare it as written.
            expected.data.as_mut().map(|d| {
                d.insert(
                    KEY_TOKEN.into(),
                    ByteString(parse_secret(&next).expect("parse").token.expose().into()),
                )
            });
            expected.metadata.resource_version = Some("7".into());
            assert_eq!(written, expected);
            assert_eq!(user_data(&written), user_data(&on_server));
        }
    }

    #[test]
    fn tokens_are_random_and_compared_exactly() {
        let (a, b) = (Token::mint(), Token::mint());
        assert_ne!(a, b);
        assert!(a.matches(a.expose()));
        assert!(!a.matches(b.expose()));
        assert!(!a.matches(&a.expose()[..63]));
        assert!(!a.matches(""));
        assert!(!format!("{a:?}").contains(a.expose()));
    }

    #[test]
    fn malformed_boot_secrets_are_errors_not_panics() {
        let mut no_token = attempt();
        no_token.data.as_mut().map(|d| d.remove(KEY_TOKEN));
        assert!(matches!(
            parse_secret(&no_token),
            Err(BootSecretError::Missing(_, "token"))
        ));

        let mut short = attempt();
        short
            .data
            .as_mut()
            .map(|d| d.insert(KEY_TOKEN.into(), ByteString(b"abc".to_vec())));
        assert!(parse_secret(&short).is_err());

        let mut bad_attempt = attempt();
        bad_attempt
            .metadata
            .annotations
            .as_mut()
            .map(|a| a.insert(ANN_ATTEMPT.into(), "two".into()));
        assert!(parse_secret(&bad_attempt).is_err());

        let mut bad_callback = attempt();
        bad_callback
            .data
            .as_mut()
            .map(|d| d.insert(KEY_CALLBACK.into(), ByteString(b"{not json".to_vec())));
        assert!(parse_secret(&bad_callback).is_err());

        assert!(parse_secret(&Secret::default()).is_err());
    }
}

//! From a MetalHost to a connected BMC driver: read the credentials (and CA) Secrets, build the
//! driver, and keep it per host so its Redfish session is reused until the address, TLS settings
//! or credentials change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;

use crate::api::MetalHost;
use crate::bmc::redfish::RedfishOptions;
use crate::bmc::{Bmc, BmcError, Credentials};

/// Everything needed to talk to one host's BMC.
pub struct BmcTarget {
    pub address: String,
    pub credentials: Credentials,
    pub ca_pem: Option<String>,
    pub disable_certificate_verification: bool,
    /// Changes whenever any input above changes (Secret resourceVersions, address, TLS switch).
    pub fingerprint: String,
}

/// Makes BMC drivers; tests and the lab use the Redfish one too, against real emulators.
pub trait BmcConnector: Send + Sync {
    fn connect(&self, host_key: &str, target: BmcTarget) -> Result<Arc<dyn Bmc>, BmcError>;

    /// Drops the drivers of hosts for which `keep` is false and returns them, to be logged out.
    fn evict(&self, _keep: &dyn Fn(&str) -> bool) -> Vec<Arc<dyn Bmc>> {
        Vec::new()
    }
}

/// A cached driver and the fingerprint of the inputs it was built from.
type CachedBmc = (String, Arc<dyn Bmc>);

/// Redfish drivers, cached per host.
pub struct RedfishConnector {
    timeout: Duration,
    cache: Mutex<HashMap<String, CachedBmc>>,
}

impl RedfishConnector {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            cache: Mutex::new(HashMap::new()),
        }
    }
}

impl BmcConnector for RedfishConnector {
    fn connect(&self, host_key: &str, target: BmcTarget) -> Result<Arc<dyn Bmc>, BmcError> {
        if let Ok(cache) = self.cache.lock()
            && let Some((fingerprint, bmc)) = cache.get(host_key)
            && *fingerprint == target.fingerprint
        {
            return Ok(bmc.clone());
        }
        let options = RedfishOptions {
            timeout: self.timeout,
            ca_pem: target.ca_pem,
            disable_certificate_verification: target.disable_certificate_verification,
            ..RedfishOptions::default()
        };
        let bmc: Arc<dyn Bmc> = crate::bmc::connect(&target.address, target.credentials, options)?;
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(host_key.to_string(), (target.fingerprint, bmc.clone()));
        }
        Ok(bmc)
    }

    fn evict(&self, keep: &dyn Fn(&str) -> bool) -> Vec<Arc<dyn Bmc>> {
        let Ok(mut cache) = self.cache.lock() else {
            return Vec::new();
        };
        let gone: Vec<String> = cache.keys().filter(|k| !keep(k)).cloned().collect();
        gone.iter()
            .filter_map(|k| cache.remove(k))
            .map(|(_, bmc)| bmc)
            .collect()
    }
}

/// Why a host's BMC target could not be assembled.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("credentials Secret {0} not found")]
    CredentialsMissing(String),
    #[error("CA Secret {0} not found or has no ca.crt")]
    CaMissing(String),
    #[error("{0}")]
    CredentialsInvalid(String),
    #[error("reading Secret {name}: {source}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
}

impl TargetError {
    pub fn reason(&self) -> &'static str {
        match self {
            TargetError::CredentialsMissing(_) => "CredentialsMissing",
            TargetError::CaMissing(_) => "CASecretMissing",
            TargetError::CredentialsInvalid(_) => "CredentialsInvalid",
            TargetError::Read { .. } => "CredentialsUnreadable",
        }
    }
}

/// The host's BMC driver, connected (cached per host) or the fault that prevents it, as a
/// condition reason and message. Both controllers that talk to BMCs go through here.
pub async fn connect(
    client: &kube::Client,
    connector: &dyn BmcConnector,
    host: &MetalHost,
) -> Result<Arc<dyn Bmc>, crate::controllers::power::Fault> {
    use crate::controllers::power::Fault;
    let target = load_target(client, host).await.map_err(|e| Fault {
        reason: e.reason(),
        message: e.to_string(),
    })?;
    let host_key = format!(
        "{}/{}",
        host.namespace().unwrap_or_default(),
        host.name_any()
    );
    connector
        .connect(&host_key, target)
        .map_err(|e| Fault::from_bmc(&e))
}

/// How long a credentials or CA Secret read is reused. Every BMC operation needs the
/// credentials, and a GET per operation was a third of the apiserver's reads at a thousand
/// hosts. A changed Secret is forgotten as soon as the MetalHost controller's Secret watch sees
/// it (`forget_secret`), and a read that a change overtook is not kept (`SecretCache`), so this
/// limit is only the backstop for a watch that was down.
const SECRET_TTL: std::time::Duration = std::time::Duration::from_secs(600);

type SecretKey = (String, String);

/// Credentials and CA Secrets read for BMC operations, keyed by namespace and name.
#[derive(Default)]
struct SecretCache {
    entries: std::collections::HashMap<SecretKey, (Secret, std::time::Instant)>,
    /// Reads in flight per Secret, and whether the watch saw it change since the first began:
    /// such a read may predate the change, so it is used once and not kept.
    reading: std::collections::HashMap<SecretKey, (usize, bool)>,
    last_swept: Option<std::time::Instant>,
}

impl SecretCache {
    fn get(&self, key: &SecretKey) -> Option<Secret> {
        self.entries
            .get(key)
            .filter(|(_, at)| at.elapsed() < SECRET_TTL)
            .map(|(secret, _)| secret.clone())
    }

    fn begin_read(&mut self, key: &SecretKey) {
        self.reading.entry(key.clone()).or_insert((0, false)).0 += 1;
    }

    fn changed(&mut self, key: &SecretKey) {
        self.entries.remove(key);
        if let Some((_, changed)) = self.reading.get_mut(key) {
            *changed = true;
        }
    }

    /// Ends a read; keeps what it found unless the Secret changed while it was in flight (a
    /// missing Secret is never kept: it is read again next time).
    fn finish_read(&mut self, key: SecretKey, found: Option<&Secret>) {
        let overtaken = match self.reading.get_mut(&key) {
            Some((readers, changed)) => {
                *readers = readers.saturating_sub(1);
                let overtaken = *changed;
                if *readers == 0 {
                    self.reading.remove(&key);
                }
                overtaken
            }
            None => true,
        };
        // Bounded by the Secrets hosts name; expired entries are swept at most once a minute.
        let now = std::time::Instant::now();
        if self
            .last_swept
            .is_none_or(|at| at.elapsed() > std::time::Duration::from_secs(60))
        {
            self.entries.retain(|_, (_, at)| at.elapsed() < SECRET_TTL);
            self.last_swept = Some(now);
        }
        if let (false, Some(secret)) = (overtaken, found) {
            self.entries.insert(key, (secret.clone(), now));
        }
    }
}

fn secret_cache() -> &'static std::sync::Mutex<SecretCache> {
    static CACHE: std::sync::OnceLock<std::sync::Mutex<SecretCache>> = std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The Secret changed (or went): the next BMC operation reads it again.
pub fn forget_secret(namespace: &str, name: &str) {
    if let Ok(mut c) = secret_cache().lock() {
        c.changed(&(namespace.to_string(), name.to_string()));
    }
}

/// A Secret, from the cache while the watch has not seen it change, else read.
async fn secret_cached(
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
) -> Result<Option<Secret>, kube::Error> {
    let cache = secret_cache();
    let key = (namespace.to_string(), name.to_string());
    let mut reading = None;
    if let Ok(mut c) = cache.lock() {
        if let Some(secret) = c.get(&key) {
            return Ok(Some(secret));
        }
        c.begin_read(&key);
        reading = Some(Reading(Some(key)));
    }
    let fresh = secrets.get_opt(name).await;
    if let (Some(mut reading), Ok(mut c)) = (reading, cache.lock())
        && let Some(key) = reading.0.take()
    {
        c.finish_read(key, fresh.as_ref().ok().and_then(Option::as_ref));
    }
    fresh
}

/// A read in flight: ended (kept nothing) if the pass is dropped before the read returns, so a
/// cancelled read never leaves its Secret marked as being read.
struct Reading(Option<SecretKey>);

impl Drop for Reading {
    fn drop(&mut self) {
        if let (Some(key), Ok(mut c)) = (self.0.take(), secret_cache().lock()) {
            c.finish_read(key, None);
        }
    }
}

/// Reads the host's credentials (and CA) Secrets.
pub async fn load_target(
    client: &kube::Client,
    host: &MetalHost,
) -> Result<BmcTarget, TargetError> {
    let namespace = host.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
    let name = &host.spec.bmc.credentials_name;
    let secret = secret_cached(&secrets, &namespace, name)
        .await
        .map_err(|source| TargetError::Read {
            name: name.clone(),
            source,
        })?
        .ok_or_else(|| TargetError::CredentialsMissing(format!("{namespace}/{name}")))?;
    let credentials = Credentials::from_secret(&secret)
        .map_err(|e| TargetError::CredentialsInvalid(e.to_string()))?;
    let mut fingerprint = format!(
        "{}|{}|{}",
        host.spec.bmc.address,
        secret.resource_version().unwrap_or_default(),
        host.spec
            .bmc
            .disable_certificate_verification
            .unwrap_or(false)
    );
    let ca_pem = match &host.spec.bmc.ca_secret_name {
        None => None,
        Some(ca_name) => {
            let ca = secret_cached(&secrets, &namespace, ca_name)
                .await
                .map_err(|source| TargetError::Read {
                    name: ca_name.clone(),
                    source,
                })?;
            let pem = ca
                .as_ref()
                .and_then(|s| s.data.as_ref())
                .and_then(|d| d.get("ca.crt"))
                .and_then(|b| String::from_utf8(b.0.clone()).ok())
                .ok_or_else(|| TargetError::CaMissing(format!("{namespace}/{ca_name}")))?;
            fingerprint.push('|');
            fingerprint.push_str(&ca.and_then(|s| s.resource_version()).unwrap_or_default());
            Some(pem)
        }
    };
    Ok(BmcTarget {
        address: host.spec.bmc.address.clone(),
        credentials,
        ca_pem,
        disable_certificate_verification: host
            .spec
            .bmc
            .disable_certificate_verification
            .unwrap_or(false),
        fingerprint,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(version: &str) -> Secret {
        Secret {
            metadata: kube::api::ObjectMeta {
                name: Some("bmc".into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn version(cache: &SecretCache, key: &SecretKey) -> Option<String> {
        cache.get(key).and_then(|s| s.metadata.resource_version)
    }

    /// A read is kept until the watch sees the Secret change; a read that a change overtook
    /// (the password was rotated while the GET was in flight) is used once and not kept.
    #[test]
    fn a_read_overtaken_by_a_change_is_not_kept() {
        let key: SecretKey = ("ns".into(), "bmc".into());
        let mut cache = SecretCache::default();

        cache.begin_read(&key);
        cache.finish_read(key.clone(), Some(&secret("1")));
        assert_eq!(version(&cache, &key), Some("1".into()), "kept");

        cache.changed(&key);
        assert_eq!(version(&cache, &key), None, "a change forgets it");

        cache.begin_read(&key);
        cache.changed(&key);
        cache.finish_read(key.clone(), Some(&secret("1")));
        assert_eq!(version(&cache, &key), None, "overtaken: not kept");
        assert!(cache.reading.is_empty(), "no read left in flight");

        cache.begin_read(&key);
        cache.finish_read(key.clone(), None);
        assert_eq!(
            version(&cache, &key),
            None,
            "a missing Secret is read again"
        );

        cache.begin_read(&key);
        cache.finish_read(key.clone(), Some(&secret("2")));
        assert_eq!(version(&cache, &key), Some("2".into()));
    }
}

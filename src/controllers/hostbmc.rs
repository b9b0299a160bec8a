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
/// it (`forget_secret`); the time limit is the backstop.
const SECRET_TTL: std::time::Duration = std::time::Duration::from_secs(30);

type SecretCache = std::sync::Mutex<
    std::collections::HashMap<(String, String), (Option<Secret>, std::time::Instant)>,
>;

fn secret_cache() -> &'static SecretCache {
    static CACHE: std::sync::OnceLock<SecretCache> = std::sync::OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The Secret changed (or went): the next BMC operation reads it again.
pub fn forget_secret(namespace: &str, name: &str) {
    if let Ok(mut c) = secret_cache().lock() {
        c.remove(&(namespace.to_string(), name.to_string()));
    }
}

/// A Secret, from a read at most `SECRET_TTL` old (a missing one is read again every time).
async fn secret_cached(
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
) -> Result<Option<Secret>, kube::Error> {
    let cache = secret_cache();
    let key = (namespace.to_string(), name.to_string());
    if let Ok(c) = cache.lock()
        && let Some((Some(secret), at)) = c.get(&key)
        && at.elapsed() < SECRET_TTL
    {
        return Ok(Some(secret.clone()));
    }
    let fresh = secrets.get_opt(name).await?;
    if let Ok(mut c) = cache.lock() {
        // Bounded by the Secrets hosts name; stale entries are dropped as they are passed.
        c.retain(|_, (_, at)| at.elapsed() < SECRET_TTL);
        c.insert(key, (fresh.clone(), std::time::Instant::now()));
    }
    Ok(fresh)
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

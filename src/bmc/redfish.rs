//! The Redfish driver: DMTF Redfish over HTTPS (or plain HTTP for labs) with reqwest/rustls.
//!
//! - Addresses: `redfish://host[:port][/redfish/v1/Systems/<id>]` (HTTPS), `redfish+https://…`,
//!   `redfish+http://…`. Without a system path the BMC's only system is used.
//! - Auth: a Redfish session (`X-Auth-Token`) when the service root advertises a session service,
//!   HTTP basic otherwise; one re-login on 401; logout on [`Bmc::logout`] or (best effort) on drop.
//! - Every request has a timeout; idempotent requests (GET, PATCH of the boot override, DELETE)
//!   are retried with bounded backoff on connection failures and 5xx; actions (POST) are retried
//!   only when the connection was refused, i.e. the BMC cannot have seen them.
//! - At most one request in flight per BMC address in this process (many BMCs fall over otherwise).
//!
//! Not here: deciding what to do with a host, or IPMI.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue};
use reqwest::{Method, StatusCode, Url};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use super::{
    Bmc, BmcCapabilities, BmcError, BmcFuture, BootDevice, BootMode, BootOnce, BootOverride,
    Credentials, HardwareInventory, NicInfo, PowerAction, PowerState, Secret, Unreachable,
};

const SERVICE_ROOT: &str = "/redfish/v1";
const SYSTEMS: &str = "/redfish/v1/Systems";
const DEFAULT_SESSIONS: &str = "/redfish/v1/SessionService/Sessions";

/// Connection settings.
#[derive(Clone, Debug)]
pub struct RedfishOptions {
    /// Per-request timeout (connect to last body byte).
    pub timeout: Duration,
    /// PEM bundle of CAs to trust in addition to the built-in roots.
    pub ca_pem: Option<String>,
    /// Accept any certificate. Only when explicitly set.
    pub disable_certificate_verification: bool,
    /// Attempts for idempotent requests (1 = no retry).
    pub attempts: u32,
    /// First backoff delay; doubled per attempt up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Longest `Retry-After` honoured on a busy answer (503/429); a BMC asking for more is
    /// retried after this long, within the same attempt budget.
    pub max_retry_after: Duration,
}

/// BMCs with the same trust (extra CA bundle, verification) and connect timeout share one HTTP
/// client: a client carries its own TLS configuration and root store, and one per BMC was most
/// of the manager's memory at a thousand hosts. Connections stay per BMC origin inside the pool;
/// with one request at a time per BMC a real BMC holds at most one, closed after 30 s idle (BMCs
/// have few connection slots). The idle limit only matters to many systems behind one origin (a
/// chassis manager, the lab's simulated fleet).
fn shared_client(address: &str, options: &RedfishOptions) -> Result<reqwest::Client, BmcError> {
    type Key = (Duration, Option<String>, bool);
    static CLIENTS: std::sync::OnceLock<std::sync::Mutex<HashMap<Key, reqwest::Client>>> =
        std::sync::OnceLock::new();
    let key: Key = (
        options.timeout,
        options.ca_pem.clone(),
        options.disable_certificate_verification,
    );
    let clients = CLIENTS.get_or_init(Default::default);
    if let Ok(c) = clients.lock()
        && let Some(client) = c.get(&key)
    {
        return Ok(client.clone());
    }
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .connect_timeout(options.timeout)
        .pool_max_idle_per_host(64)
        .pool_idle_timeout(Duration::from_secs(30))
        .redirect(reqwest::redirect::Policy::none())
        // Credentials go to the BMC itself, never through a proxy picked up from the
        // environment (HTTPS_PROXY is for the apiserver).
        .no_proxy()
        .user_agent(concat!("metalboot/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = &options.ca_pem {
        let certs =
            reqwest::Certificate::from_pem_bundle(pem.as_bytes()).map_err(|e| BmcError::Tls {
                address: address.to_string(),
                detail: format!("the CA bundle is not valid PEM: {e}"),
            })?;
        if certs.is_empty() {
            return Err(BmcError::Tls {
                address: address.to_string(),
                detail: "the CA bundle holds no certificate".to_string(),
            });
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    if options.disable_certificate_verification {
        builder = builder.danger_accept_invalid_certs(true);
    }
    let client = builder.build().map_err(|e| BmcError::Tls {
        address: address.to_string(),
        detail: format!("cannot build the HTTP client: {e}"),
    })?;
    if let Ok(mut c) = clients.lock() {
        c.insert(key, client.clone());
    }
    Ok(client)
}

impl Default for RedfishOptions {
    fn default() -> Self {
        RedfishOptions {
            timeout: Duration::from_secs(20),
            ca_pem: None,
            disable_certificate_verification: false,
            attempts: 3,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(4),
            max_retry_after: Duration::from_secs(30),
        }
    }
}

/// Transport scheme of a parsed address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    Http,
    Https,
}

/// A parsed `redfish…://` address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RedfishAddress {
    pub scheme: Scheme,
    /// Host as it goes in a URL (IPv6 in brackets).
    pub host: String,
    pub port: u16,
    /// `/redfish/v1/Systems/<id>` when given.
    pub system_path: Option<String>,
}

impl RedfishAddress {
    pub fn base_url(&self) -> String {
        let scheme = match self.scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
        };
        format!("{scheme}://{}:{}", self.host, self.port)
    }

    /// Key of the per-BMC request gate.
    pub fn gate_key(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// Parse a BMC address. `ipmi://` is recognised and refused as unsupported.
pub fn parse_address(address: &str) -> Result<RedfishAddress, BmcError> {
    let invalid = |reason: &str| BmcError::InvalidAddress {
        address: redact_userinfo(address),
        reason: reason.to_string(),
    };
    let Some((scheme, rest)) = address.split_once("://") else {
        return Err(invalid(
            "expected redfish://, redfish+https://, redfish+http:// or ipmi://",
        ));
    };
    let (scheme, http_scheme) = match scheme.to_ascii_lowercase().as_str() {
        "redfish" | "redfish+https" => (Scheme::Https, "https"),
        "redfish+http" => (Scheme::Http, "http"),
        "ipmi" => {
            return Err(BmcError::Unsupported {
                address: redact_userinfo(address),
                what: "IPMI (ipmi:// addresses); use a redfish:// address".to_string(),
            });
        }
        other => return Err(invalid(&format!("unknown scheme {other:?}"))),
    };
    let url =
        Url::parse(&format!("{http_scheme}://{rest}")).map_err(|e| invalid(&e.to_string()))?;
    if !url.username().is_empty() || url.password().is_some() {
        return Err(invalid(
            "credentials do not belong in the address; use the credentials Secret",
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("no query or fragment allowed"));
    }
    let host = match url.host_str() {
        Some(h) if !h.is_empty() => h.to_string(),
        _ => return Err(invalid("no host")),
    };
    let port = url.port_or_known_default().unwrap_or(match scheme {
        Scheme::Http => 80,
        Scheme::Https => 443,
    });
    let path = url.path().trim_end_matches('/');
    let system_path = if path.is_empty() || path == "/redfish/v1" || path == SYSTEMS {
        None
    } else {
        match path.strip_prefix("/redfish/v1/Systems/") {
            Some(id) if !id.is_empty() && !id.contains('/') => Some(path.to_string()),
            _ => return Err(invalid("path must be /redfish/v1/Systems/<id> or empty")),
        }
    };
    Ok(RedfishAddress {
        scheme,
        host,
        port,
        system_path,
    })
}

/// The address with any `user:password@` replaced, for messages.
fn redact_userinfo(address: &str) -> String {
    let Some((scheme, rest)) = address.split_once("://") else {
        return address.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://<redacted>@{}", &rest[at + 1..]),
        None => address.to_string(),
    }
}

/// Redfish reset types, in the order we prefer them for each action.
pub fn reset_preferences(action: PowerAction) -> &'static [&'static str] {
    match action {
        PowerAction::On => &["On", "ForceOn"],
        PowerAction::GracefulOff => &["GracefulShutdown"],
        PowerAction::ForceOff => &["ForceOff"],
        PowerAction::Cycle => &["PowerCycle", "ForceRestart", "GracefulRestart"],
    }
}

/// Choose the reset type for `action` from what the BMC allows. `None` allowable values means the
/// BMC did not say (Redfish: then all values are allowed) and the first preference is used.
pub fn choose_reset_type(
    action: PowerAction,
    allowable: Option<&[String]>,
) -> Option<&'static str> {
    let prefs = reset_preferences(action);
    match allowable {
        None => prefs.first().copied(),
        Some(values) => prefs
            .iter()
            .copied()
            .find(|p| values.iter().any(|v| v == p)),
    }
}

/// The process-wide gate: at most one request in flight per BMC address.
fn gate_for(key: &str) -> Arc<Semaphore> {
    static GATES: OnceLock<Mutex<HashMap<String, Arc<Semaphore>>>> = OnceLock::new();
    let gates = GATES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = match gates.lock() {
        Ok(m) => m,
        Err(poisoned) => poisoned.into_inner(),
    };
    map.entry(key.to_string())
        .or_insert_with(|| Arc::new(Semaphore::new(1)))
        .clone()
}

#[derive(Clone)]
enum Auth {
    /// Not logged in yet (or the session expired).
    None,
    Session {
        token: Secret,
        location: Option<String>,
        generation: u64,
    },
    Basic {
        generation: u64,
    },
}

/// What may be retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Retry {
    /// GET, DELETE, PATCH of the boot override: safe to repeat.
    Idempotent,
    /// Actions: only when the BMC cannot have seen the request.
    OnlyConnectRefused,
}

/// A complete answer.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
}

/// A Redfish BMC bound to one system.
pub struct RedfishBmc {
    address: String,
    parsed: RedfishAddress,
    base: String,
    http: reqwest::Client,
    credentials: Credentials,
    options: RedfishOptions,
    gate: Arc<Semaphore>,
    auth: tokio::sync::Mutex<Auth>,
    generation: std::sync::atomic::AtomicU64,
    system: tokio::sync::Mutex<Option<String>>,
}

impl std::fmt::Debug for RedfishBmc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedfishBmc")
            .field("address", &self.address)
            .field("username", &self.credentials.username)
            .finish_non_exhaustive()
    }
}

/// The most of a BMC reply the driver reads (real service roots and systems are a few KiB).
pub const MAX_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// `path` resolved against the BMC's origin `base` (`scheme://host:port`): a path, or an absolute
/// URL on that same origin. Anything else — another scheme, host or port, a scheme-relative
/// `//host/…`, userinfo — is refused with the reason.
pub fn confined_url(base: &str, path: &str) -> Result<String, String> {
    let shown: String = path.chars().take(200).collect();
    if path.starts_with("//") || path.contains('\\') {
        return Err(format!(
            "refused to follow {shown:?}: not a path on the BMC"
        ));
    }
    if path.starts_with('/') {
        return Ok(format!("{base}{path}"));
    }
    let (Ok(origin), Ok(target)) = (Url::parse(base), Url::parse(path)) else {
        return Err(format!(
            "refused to follow {shown:?}: not a path on the BMC"
        ));
    };
    let same = target.scheme() == origin.scheme()
        && target.host_str() == origin.host_str()
        && target.port_or_known_default() == origin.port_or_known_default()
        && target.username().is_empty()
        && target.password().is_none();
    if same {
        Ok(target.to_string())
    } else {
        Err(format!(
            "refused to follow {shown:?}: the BMC's reply names another origin than {base}"
        ))
    }
}

impl RedfishBmc {
    /// Build a client. No network I/O happens until the first operation.
    pub fn new(
        address: &str,
        credentials: Credentials,
        options: RedfishOptions,
    ) -> Result<Self, BmcError> {
        let parsed = parse_address(address)?;
        let http = shared_client(address, &options)?;
        let gate = gate_for(&parsed.gate_key());
        Ok(RedfishBmc {
            address: address.to_string(),
            base: parsed.base_url(),
            system: tokio::sync::Mutex::new(parsed.system_path.clone()),
            parsed,
            http,
            credentials,
            options,
            gate,
            auth: tokio::sync::Mutex::new(Auth::None),
            generation: std::sync::atomic::AtomicU64::new(0),
        })
    }

    pub fn parsed_address(&self) -> &RedfishAddress {
        &self.parsed
    }

    /// Whether a Redfish session is open (false with basic auth).
    pub async fn has_session(&self) -> bool {
        matches!(*self.auth.lock().await, Auth::Session { .. })
    }

    /// The URL of `path` on this BMC. Paths come from the BMC's own replies (links, action
    /// targets, Locations): an absolute URL is followed only when it names the BMC's own scheme,
    /// host and port, so a rogue or intercepted reply cannot make the driver send credentials or a
    /// session token anywhere else.
    fn url(&self, path: &str) -> Result<String, String> {
        confined_url(&self.base, path)
    }

    fn op(method: &Method, path: &str) -> String {
        format!("{method} {}", shown(path))
    }

    // ---- transport ------------------------------------------------------------------------

    /// One HTTP exchange, holding the address's gate, with the configured timeout.
    async fn exchange(
        &self,
        method: &Method,
        path: &str,
        body: Option<&Value>,
        headers: &HeaderMap,
    ) -> Result<Reply, BmcError> {
        let operation = Self::op(method, path);
        let _permit = self.gate.acquire().await.map_err(|_| BmcError::Protocol {
            address: self.address.clone(),
            operation: operation.clone(),
            detail: "request gate closed".to_string(),
        })?;
        let url = self
            .url(path)
            .map_err(|detail| self.protocol(&operation, detail))?;
        let mut req = self
            .http
            .request(method.clone(), url)
            .timeout(self.options.timeout)
            .headers(headers.clone())
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(b) = body {
            req = req.json(b);
        }
        tracing::debug!(bmc = %self.address, %operation, "redfish request");
        let resp = req
            .send()
            .await
            .map_err(|e| self.classify(&operation, &e))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        // Bounded: a BMC's reply is read only up to MAX_REPLY_BYTES.
        let mut resp = resp;
        let mut body = Vec::new();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| self.classify(&operation, &e))?
        {
            if body.len() + chunk.len() > MAX_REPLY_BYTES {
                return Err(self.protocol(
                    &operation,
                    format!("reply larger than {} KiB", MAX_REPLY_BYTES / 1024),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        tracing::debug!(bmc = %self.address, %operation, status = status.as_u16(), bytes = body.len(), "redfish reply");
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    /// Turn a reqwest error into a precise [`BmcError`]. Never includes headers (tokens).
    fn classify(&self, operation: &str, e: &reqwest::Error) -> BmcError {
        let unreachable = |cause| BmcError::Unreachable {
            address: self.address.clone(),
            operation: operation.to_string(),
            cause,
        };
        if e.is_timeout() {
            return unreachable(Unreachable::TimedOut(self.options.timeout));
        }
        let chain = error_chain(e);
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
        let mut refused = false;
        let mut dropped = false;
        let mut tls = false;
        while let Some(err) = source {
            if let Some(io) = err.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind::*;
                match io.kind() {
                    ConnectionRefused => refused = true,
                    ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof => {
                        dropped = true
                    }
                    InvalidData => tls = true,
                    _ => {}
                }
            }
            source = err.source();
        }
        let lower = chain.to_ascii_lowercase();
        let not_tls = lower.contains("corrupt message") || lower.contains("invalidcontenttype");
        if not_tls
            || ["certificate", "tls", "handshake", "unknownissuer", "alert"]
                .iter()
                .any(|w| lower.contains(w))
        {
            tls = true;
        }
        if refused {
            unreachable(Unreachable::ConnectionRefused)
        } else if tls && e.is_connect() {
            BmcError::Tls {
                address: self.address.clone(),
                detail: if not_tls {
                    format!(
                        "{chain} (the port does not speak TLS; for plain HTTP use redfish+http://)"
                    )
                } else {
                    chain
                },
            }
        } else if dropped
            || lower.contains("connection closed")
            || lower.contains("incomplete")
            || lower.contains("reset")
            || e.is_body()
        {
            unreachable(Unreachable::ConnectionDropped)
        } else if e.is_connect() {
            unreachable(Unreachable::Other(chain))
        } else if e.is_request() {
            unreachable(Unreachable::ConnectionDropped)
        } else {
            BmcError::Protocol {
                address: self.address.clone(),
                operation: operation.to_string(),
                detail: chain,
            }
        }
    }

    /// An exchange with bounded retries. Non-2xx answers other than 5xx are returned as replies.
    async fn exchange_retrying(
        &self,
        method: &Method,
        path: &str,
        body: Option<&Value>,
        headers: &HeaderMap,
        retry: Retry,
    ) -> Result<Reply, BmcError> {
        let attempts = self.options.attempts.max(1);
        let mut delay = self.options.backoff;
        let mut attempt = 1;
        loop {
            let result = self.exchange(method, path, body, headers).await;
            // A busy answer with Retry-After (503, 429) says the request was not acted on: any
            // verb may go again, the session login and actions included, after the time asked.
            let busy = match &result {
                Ok(reply) if matches!(reply.status.as_u16(), 503 | 429) => {
                    reply.header("retry-after").map(|v| retry_after(&v))
                }
                _ => None,
            };
            let retryable = busy.is_some()
                || match (&result, retry) {
                    (Err(BmcError::Unreachable { cause, .. }), Retry::OnlyConnectRefused) => {
                        *cause == Unreachable::ConnectionRefused
                    }
                    (
                        Err(BmcError::Unreachable {
                            cause: Unreachable::TimedOut(_),
                            ..
                        }),
                        Retry::Idempotent,
                    ) => false,
                    (Err(BmcError::Unreachable { .. }), Retry::Idempotent) => true,
                    (Ok(reply), Retry::Idempotent) => reply.status.is_server_error(),
                    _ => false,
                };
            if !retryable || attempt >= attempts {
                return result;
            }
            let why = match &result {
                Ok(r) => format!("HTTP {}", r.status.as_u16()),
                Err(e) => e.to_string(),
            };
            let wait = match busy {
                Some(Some(asked)) => asked.min(self.options.max_retry_after),
                _ => delay,
            };
            tracing::info!(bmc = %self.address, operation = %Self::op(method, path), attempt, %why, retry_in_ms = wait.as_millis() as u64, "retrying BMC request");
            tokio::time::sleep(wait).await;
            delay = (delay * 2).min(self.options.max_backoff);
            attempt += 1;
        }
    }

    // ---- authentication -------------------------------------------------------------------

    fn next_generation(&self) -> u64 {
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1
    }

    /// Current auth headers, logging in first if needed. Returns the auth generation used.
    async fn auth_headers(&self) -> Result<(HeaderMap, u64), BmcError> {
        let mut auth = self.auth.lock().await;
        if matches!(*auth, Auth::None) {
            *auth = self.login().await?;
        }
        let mut headers = HeaderMap::new();
        let generation = match &*auth {
            Auth::Session {
                token, generation, ..
            } => {
                let mut v =
                    HeaderValue::from_str(token.expose()).map_err(|_| BmcError::Protocol {
                        address: self.address.clone(),
                        operation: "login".to_string(),
                        detail: "session token is not a valid header value".to_string(),
                    })?;
                v.set_sensitive(true);
                headers.insert("X-Auth-Token", v);
                *generation
            }
            Auth::Basic { generation } => {
                use base64::Engine;
                let raw = format!(
                    "{}:{}",
                    self.credentials.username,
                    self.credentials.password.expose()
                );
                let encoded = base64::engine::general_purpose::STANDARD.encode(raw);
                let mut v = HeaderValue::from_str(&format!("Basic {encoded}")).map_err(|_| {
                    BmcError::Credentials(
                        "the username or password cannot be sent in an HTTP header".to_string(),
                    )
                })?;
                v.set_sensitive(true);
                headers.insert(reqwest::header::AUTHORIZATION, v);
                *generation
            }
            Auth::None => 0,
        };
        Ok((headers, generation))
    }

    /// Discover the session service and log in; basic auth when there is none.
    async fn login(&self) -> Result<Auth, BmcError> {
        let root = self
            .exchange_retrying(
                &Method::GET,
                "/redfish/v1/",
                None,
                &HeaderMap::new(),
                Retry::Idempotent,
            )
            .await?;
        // Some BMCs protect the service root; then assume the standard sessions path.
        let sessions_path = if root.status.is_success() {
            let v = self.parse_json(&root, "GET /redfish/v1/")?;
            v.pointer("/Links/Sessions/@odata.id")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| {
                    v.get("SessionService")
                        .map(|_| DEFAULT_SESSIONS.to_string())
                })
        } else {
            Some(DEFAULT_SESSIONS.to_string())
        };
        let Some(sessions_path) = sessions_path else {
            tracing::debug!(bmc = %self.address, "no session service advertised; using HTTP basic auth");
            return Ok(Auth::Basic {
                generation: self.next_generation(),
            });
        };
        let body = json!({
            "UserName": self.credentials.username,
            "Password": self.credentials.password.expose(),
        });
        let operation = format!("POST {}", shown(&sessions_path));
        let reply = self
            .exchange_retrying(
                &Method::POST,
                &sessions_path,
                Some(&body),
                &HeaderMap::new(),
                Retry::OnlyConnectRefused,
            )
            .await?;
        match reply.status.as_u16() {
            200 | 201 => {
                let Some(token) = reply.header("X-Auth-Token") else {
                    return Err(
                        self.protocol(&operation, "session created without an X-Auth-Token header")
                    );
                };
                let location = reply.header("Location").map(|l| self.path_of(&l));
                tracing::debug!(bmc = %self.address, session = ?location, "logged in");
                Ok(Auth::Session {
                    token: Secret::new(token),
                    location,
                    generation: self.next_generation(),
                })
            }
            401 | 403 => Err(self.auth_failed(&reply)),
            404 | 405 | 501 => {
                tracing::debug!(bmc = %self.address, status = reply.status.as_u16(), "no session service; using HTTP basic auth");
                Ok(Auth::Basic {
                    generation: self.next_generation(),
                })
            }
            _ => Err(self.rejected(&operation, &reply)),
        }
    }

    fn auth_failed(&self, reply: &Reply) -> BmcError {
        let messages = redfish_messages(&reply.body);
        BmcError::AuthFailed {
            address: self.address.clone(),
            username: self.credentials.username.clone(),
            detail: if messages.is_empty() {
                format!("HTTP {}", reply.status.as_u16())
            } else {
                format!("HTTP {}: {}", reply.status.as_u16(), messages.join("; "))
            },
        }
    }

    /// Forget the session of `generation` (if still current) so the next request logs in again.
    async fn invalidate(&self, generation: u64) {
        let mut auth = self.auth.lock().await;
        let current = match &*auth {
            Auth::Session { generation, .. } | Auth::Basic { generation } => *generation,
            Auth::None => return,
        };
        if current == generation {
            *auth = Auth::None;
        }
    }

    /// Strip scheme and host from an absolute Location.
    fn path_of(&self, location: &str) -> String {
        match Url::parse(location) {
            Ok(u) => u.path().to_string(),
            Err(_) => location.to_string(),
        }
    }

    /// An authenticated request: logs in as needed, re-logs in once on 401.
    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        extra: &HeaderMap,
        retry: Retry,
    ) -> Result<Reply, BmcError> {
        let mut relogged = false;
        loop {
            let (mut headers, generation) = self.auth_headers().await?;
            for (k, v) in extra {
                headers.insert(k.clone(), v.clone());
            }
            let reply = self
                .exchange_retrying(&method, path, body, &headers, retry)
                .await?;
            if reply.status == StatusCode::UNAUTHORIZED {
                let was_session = matches!(*self.auth.lock().await, Auth::Session { .. });
                if was_session && !relogged {
                    tracing::info!(bmc = %self.address, "session rejected (401); logging in again");
                    self.invalidate(generation).await;
                    relogged = true;
                    continue;
                }
                self.invalidate(generation).await;
                return Err(self.auth_failed(&reply));
            }
            return Ok(reply);
        }
    }

    // ---- helpers --------------------------------------------------------------------------

    fn protocol(&self, operation: &str, detail: impl Into<String>) -> BmcError {
        BmcError::Protocol {
            address: self.address.clone(),
            operation: operation.to_string(),
            detail: detail.into(),
        }
    }

    fn rejected(&self, operation: &str, reply: &Reply) -> BmcError {
        BmcError::Rejected {
            address: self.address.clone(),
            operation: operation.to_string(),
            status: reply.status.as_u16(),
            messages: redfish_messages(&reply.body),
        }
    }

    fn parse_json(&self, reply: &Reply, operation: &str) -> Result<Value, BmcError> {
        serde_json::from_slice(&reply.body).map_err(|e| {
            self.protocol(
                operation,
                format!(
                    "malformed JSON in HTTP {} answer: {e}",
                    reply.status.as_u16()
                ),
            )
        })
    }

    /// GET a resource as JSON; 404 becomes NotFound.
    async fn get_json(&self, path: &str) -> Result<(Value, Reply), BmcError> {
        let operation = format!("GET {}", shown(path));
        let reply = self
            .call(
                Method::GET,
                path,
                None,
                &HeaderMap::new(),
                Retry::Idempotent,
            )
            .await?;
        if reply.status == StatusCode::NOT_FOUND {
            return Err(BmcError::NotFound {
                address: self.address.clone(),
                what: path.to_string(),
                available: Vec::new(),
            });
        }
        if !reply.status.is_success() {
            return Err(self.rejected(&operation, &reply));
        }
        let v = self.parse_json(&reply, &operation)?;
        Ok((v, reply))
    }

    /// Send an action or change; any 2xx is success.
    async fn send(
        &self,
        method: Method,
        path: &str,
        body: &Value,
        extra: &HeaderMap,
        retry: Retry,
    ) -> Result<Reply, BmcError> {
        let operation = format!("{method} {}", shown(path));
        let reply = self.call(method, path, Some(body), extra, retry).await?;
        match reply.status.as_u16() {
            // Accepted with a task monitor: the operation is done when the monitor says so.
            202 => match reply.header("Location") {
                Some(monitor) => {
                    let monitor = self.path_of(&monitor);
                    self.await_task(&operation, &monitor).await?;
                    Ok(reply)
                }
                None => Ok(reply),
            },
            200..=299 => Ok(reply),
            404 => Err(BmcError::NotFound {
                address: self.address.clone(),
                what: path.to_string(),
                available: Vec::new(),
            }),
            405 | 501 => Err(BmcError::Unsupported {
                address: self.address.clone(),
                what: format!("{operation} (HTTP {}){}", reply.status.as_u16(), {
                    let m = redfish_messages(&reply.body);
                    if m.is_empty() {
                        String::new()
                    } else {
                        format!(": {}", m.join("; "))
                    }
                }),
            }),
            _ => Err(self.rejected(&operation, &reply)),
        }
    }

    /// Polls a task monitor (Redfish spec §13.2) until the task ends: 202 while it runs, then
    /// 200/204, or the Task resource with its `TaskState`. Bounded: at most `TASK_POLLS` polls,
    /// one second apart (or the `Retry-After` the BMC asks, capped like any busy answer).
    async fn await_task(&self, operation: &str, monitor: &str) -> Result<(), BmcError> {
        const TASK_POLLS: u32 = 120;
        for _ in 0..TASK_POLLS {
            let reply = self
                .call(
                    Method::GET,
                    monitor,
                    None,
                    &HeaderMap::new(),
                    Retry::Idempotent,
                )
                .await?;
            let state = serde_json::from_slice::<Value>(&reply.body)
                .ok()
                .and_then(|v| {
                    v.get("TaskState")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                });
            match (reply.status.as_u16(), state.as_deref()) {
                (202, _)
                | (
                    200,
                    Some(
                        "New" | "Starting" | "Running" | "Pending" | "Stopping" | "Suspended"
                        | "Service",
                    ),
                ) => {
                    let wait = reply
                        .header("retry-after")
                        .and_then(|v| retry_after(&v))
                        .unwrap_or(Duration::from_secs(1))
                        .min(self.options.max_retry_after);
                    tokio::time::sleep(wait).await;
                }
                (200, Some("Exception" | "Killed" | "Cancelled" | "Interrupted")) => {
                    let mut messages = redfish_messages(&reply.body);
                    if let Ok(v) = serde_json::from_slice::<Value>(&reply.body)
                        && let Some(list) = v.get("Messages").and_then(Value::as_array)
                    {
                        messages.extend(list.iter().filter_map(extended_info).take(MAX_MESSAGES));
                    }
                    return Err(BmcError::Rejected {
                        address: self.address.clone(),
                        operation: format!("{operation} (task {})", state.unwrap_or_default()),
                        status: 200,
                        messages,
                    });
                }
                // Done; many BMCs delete the monitor once the task is over.
                (200..=299, _) | (404, _) => return Ok(()),
                _ => return Err(self.rejected(&format!("{operation} (task monitor)"), &reply)),
            }
        }
        Err(BmcError::Unreachable {
            address: self.address.clone(),
            operation: format!("{operation} (task monitor)"),
            cause: Unreachable::TimedOut(Duration::from_secs(u64::from(TASK_POLLS))),
        })
    }

    async fn system_members(&self) -> Result<Vec<String>, BmcError> {
        let (v, _) = self.get_json(SYSTEMS).await?;
        Ok(members(&v))
    }

    /// The system path, resolving it on first use.
    async fn system_path(&self) -> Result<String, BmcError> {
        let mut system = self.system.lock().await;
        if let Some(path) = &*system {
            return Ok(path.clone());
        }
        let found = self.system_members().await?;
        match found.as_slice() {
            [one] => {
                *system = Some(one.clone());
                Ok(one.clone())
            }
            [] => Err(BmcError::NotFound {
                address: self.address.clone(),
                what: "any system in /redfish/v1/Systems".to_string(),
                available: Vec::new(),
            }),
            many => Err(BmcError::InvalidAddress {
                address: self.address.clone(),
                reason: format!(
                    "the BMC has {} systems; add one of them to the address: {}",
                    many.len(),
                    shown(&many.join(", "))
                ),
            }),
        }
    }

    /// GET the system; a 404 lists the systems the BMC does have.
    async fn get_system(&self) -> Result<(String, Value, Reply), BmcError> {
        let path = self.system_path().await?;
        match self.get_json(&path).await {
            Ok((v, r)) => Ok((path, v, r)),
            Err(BmcError::NotFound { .. }) => {
                let available = self.system_members().await.unwrap_or_default();
                Err(BmcError::NotFound {
                    address: self.address.clone(),
                    what: format!("system {path}"),
                    available,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Allowable reset types: inline annotation, else the ActionInfo resource, else unknown.
    async fn allowable_reset_types(&self, reset: &Value) -> Result<Option<Vec<String>>, BmcError> {
        if let Some(values) = reset
            .get("ResetType@Redfish.AllowableValues")
            .and_then(Value::as_array)
        {
            return Ok(Some(strings(values)));
        }
        if let Some(info) = reset.get("@Redfish.ActionInfo").and_then(Value::as_str) {
            let (v, _) = self.get_json(info).await?;
            let values = v
                .get("Parameters")
                .and_then(Value::as_array)
                .and_then(|ps| {
                    ps.iter()
                        .find(|p| p.get("Name").and_then(Value::as_str) == Some("ResetType"))
                })
                .and_then(|p| p.get("AllowableValues"))
                .and_then(Value::as_array)
                .map(|vs| strings(vs));
            return Ok(values);
        }
        Ok(None)
    }

    async fn do_power(&self, action: PowerAction) -> Result<(), BmcError> {
        let (path, system, _) = self.get_system().await?;
        let Some(reset) = system.pointer("/Actions/#ComputerSystem.Reset") else {
            return Err(BmcError::Unsupported {
                address: self.address.clone(),
                what: format!("{action}: system {path} has no ComputerSystem.Reset action"),
            });
        };
        let target = reset
            .get("target")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| format!("{path}/Actions/ComputerSystem.Reset"));
        let allowable = self.allowable_reset_types(reset).await?;
        // From the observed state: cycling a host that is off powers it on (many BMCs refuse a
        // cycle of an off system); a graceful off of a host that is off is already done.
        let power = system.get("PowerState").and_then(Value::as_str);
        let action = match (action, power) {
            (PowerAction::Cycle, Some("Off")) => PowerAction::On,
            (action, _) => action,
        };
        if action == PowerAction::GracefulOff && power == Some("Off") {
            return Ok(());
        }
        let offered = |t: &str| {
            allowable
                .as_deref()
                .is_some_and(|a| a.iter().any(|v| v == t))
        };
        let chosen = choose_reset_type(action, allowable.as_deref()).or(
            // iLO offers no GracefulShutdown: its power button is the graceful off, and pressing
            // it is safe only while the host is on (on an off host it powers it on).
            (action == PowerAction::GracefulOff
                && power == Some("On")
                && offered("PushPowerButton"))
            .then_some("PushPowerButton"),
        );
        let Some(reset_type) = chosen else {
            return Err(BmcError::Unsupported {
                address: self.address.clone(),
                what: format!(
                    "{action}: none of {:?} is among the allowed reset types {:?}",
                    reset_preferences(action),
                    allowable.unwrap_or_default()
                ),
            });
        };
        tracing::info!(bmc = %self.address, system = %path, %action, reset_type, "resetting");
        self.send(
            Method::POST,
            &target,
            &json!({ "ResetType": reset_type }),
            &HeaderMap::new(),
            Retry::OnlyConnectRefused,
        )
        .await?;
        Ok(())
    }

    async fn do_set_boot_once(
        &self,
        device: BootDevice,
        mode: Option<BootMode>,
    ) -> Result<(), BmcError> {
        let mut boot = json!({
            "BootSourceOverrideTarget": device.redfish_name(),
            "BootSourceOverrideEnabled": "Once",
        });
        if let Some(m) = mode {
            boot["BootSourceOverrideMode"] = json!(boot_mode_name(m));
        }
        let mut fresh_etag_tried = false;
        loop {
            let (path, system, reply) = self.get_system().await?;
            // Properties the system's settings object (`@Redfish.Settings`) carries go there and
            // apply at the next reset, as the BMC wants (iDRAC: the override mode); the rest go
            // to the system itself.
            let mut boot = boot.clone();
            // A BMC that offers no `Once` refuses it: it gets the override it keeps anyway
            // (its probe says `bootOnce: Continuous`).
            if let Some(allowed) = system
                .pointer("/Boot/BootSourceOverrideEnabled@Redfish.AllowableValues")
                .and_then(Value::as_array)
                .map(|a| strings(a))
                && !allowed.iter().any(|a| a == "Once")
                && allowed.iter().any(|a| a == "Continuous")
            {
                boot["BootSourceOverrideEnabled"] = json!("Continuous");
            }
            if let Some(settings_path) = system
                .pointer("/@Redfish.Settings/SettingsObject/@odata.id")
                .and_then(Value::as_str)
                .map(str::to_string)
            {
                self.patch_settings(&settings_path, &mut boot).await?;
                if boot.as_object().is_some_and(|b| b.is_empty()) {
                    return Ok(());
                }
            }
            let body = json!({ "Boot": boot });
            if let Some(allowed) = system
                .pointer("/Boot/BootSourceOverrideTarget@Redfish.AllowableValues")
                .and_then(Value::as_array)
            {
                let allowed = strings(allowed);
                if !allowed.iter().any(|a| a == device.redfish_name()) {
                    return Err(BmcError::Unsupported {
                        address: self.address.clone(),
                        what: format!(
                            "boot device {} (allowed: {})",
                            device.redfish_name(),
                            shown(&allowed.join(", "))
                        ),
                    });
                }
            }
            let etag = reply.header("ETag").or_else(|| {
                system
                    .get("@odata.etag")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            });
            let mut extra = HeaderMap::new();
            if let Some(tag) = &etag
                && let Ok(v) = HeaderValue::from_str(tag)
            {
                extra.insert(reqwest::header::IF_MATCH, v);
            }
            match self
                .send(Method::PATCH, &path, &body, &extra, Retry::Idempotent)
                .await
            {
                Err(BmcError::Rejected { status: 412, .. }) if !fresh_etag_tried => {
                    tracing::info!(bmc = %self.address, "ETag was stale (412); reading the system again");
                    fresh_etag_tried = true;
                }
                Err(e) => return Err(e),
                Ok(_) => {
                    tracing::info!(bmc = %self.address, system = %path, device = device.redfish_name(), ?mode, "one-time boot set");
                    return Ok(());
                }
            }
        }
    }

    /// Moves the boot properties the settings object at `path` carries out of `boot` and
    /// PATCHes them there (with its ETag). A settings object that cannot be read is ignored.
    async fn patch_settings(&self, path: &str, boot: &mut Value) -> Result<(), BmcError> {
        let Ok((settings, reply)) = self.get_json(path).await else {
            return Ok(());
        };
        let Some(carried) = settings.get("Boot").and_then(Value::as_object) else {
            return Ok(());
        };
        let Some(wanted) = boot.as_object_mut() else {
            return Ok(());
        };
        let moved: serde_json::Map<String, Value> = carried
            .keys()
            .filter_map(|k| wanted.remove(k).map(|v| (k.clone(), v)))
            .collect();
        if moved.is_empty() {
            return Ok(());
        }
        let mut extra = HeaderMap::new();
        if let Some(tag) = reply.header("ETag").or_else(|| {
            settings
                .get("@odata.etag")
                .and_then(Value::as_str)
                .map(str::to_string)
        }) && let Ok(v) = HeaderValue::from_str(&tag)
        {
            extra.insert(reqwest::header::IF_MATCH, v);
        }
        tracing::info!(bmc = %self.address, settings = %shown(path), properties = ?moved.keys().collect::<Vec<_>>(), "boot properties to the settings object (applied at the next reset)");
        self.send(
            Method::PATCH,
            path,
            &json!({ "Boot": moved }),
            &extra,
            Retry::Idempotent,
        )
        .await
        .map(|_| ())
    }

    async fn do_boot_override(&self) -> Result<BootOverride, BmcError> {
        let (_, system, _) = self.get_system().await?;
        Ok(boot_override_of(&system))
    }

    async fn do_power_state(&self) -> Result<PowerState, BmcError> {
        let (_, system, _) = self.get_system().await?;
        Ok(power_state_of(&system))
    }

    /// Both from one read of the system.
    async fn do_power_and_boot_override(&self) -> Result<(PowerState, BootOverride), BmcError> {
        let (_, system, _) = self.get_system().await?;
        Ok((power_state_of(&system), boot_override_of(&system)))
    }

    async fn do_inventory(&self) -> Result<HardwareInventory, BmcError> {
        let (_, system, _) = self.get_system().await?;
        let s = |k: &str| {
            system
                .get(k)
                .and_then(Value::as_str)
                .filter(|v| !v.is_empty())
                .map(str::to_string)
        };
        let mut inv = HardwareInventory {
            manufacturer: s("Manufacturer"),
            model: s("Model"),
            serial_number: s("SerialNumber"),
            system_uuid: s("UUID"),
            bios_version: s("BiosVersion"),
            ..Default::default()
        };
        for (key, value) in [
            ("name", system.get("Name")),
            ("id", system.get("Id")),
            ("sku", system.get("SKU")),
            ("cpuCount", system.pointer("/ProcessorSummary/Count")),
            (
                "memoryGiB",
                system.pointer("/MemorySummary/TotalSystemMemoryGiB"),
            ),
        ] {
            match value {
                Some(Value::String(v)) if !v.is_empty() => {
                    inv.extra.insert(key.to_string(), v.clone());
                }
                Some(Value::Number(n)) => {
                    inv.extra.insert(key.to_string(), n.to_string());
                }
                _ => {}
            }
        }
        if let Some(nics_path) = system
            .pointer("/EthernetInterfaces/@odata.id")
            .and_then(Value::as_str)
        {
            let (collection, _) = self.get_json(nics_path).await?;
            for member in members(&collection) {
                let (nic, _) = self.get_json(&member).await?;
                let mac = ["MACAddress", "PermanentMACAddress"]
                    .iter()
                    .find_map(|k| {
                        nic.get(*k)
                            .and_then(Value::as_str)
                            .filter(|m| !m.is_empty())
                    })
                    .map(|m| m.to_ascii_lowercase());
                inv.nics.push(NicInfo {
                    name: nic.get("Id").and_then(Value::as_str).map(str::to_string),
                    mac,
                    ..Default::default()
                });
            }
        }
        Ok(inv)
    }

    /// Reads what the BMC offers; lookups beyond the service root and the system that fail are
    /// left unknown rather than failing the probe.
    async fn do_probe(&self) -> Result<BmcCapabilities, BmcError> {
        let (root, _) = self.get_json(SERVICE_ROOT).await?;
        let (_, system, reply) = self.get_system().await?;
        let text = |v: &Value, k: &str| {
            v.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(shown)
        };
        let reset = system
            .pointer("/Actions/#ComputerSystem.Reset")
            .cloned()
            .unwrap_or(Value::Null);
        let reset_types_source = if reset.get("ResetType@Redfish.AllowableValues").is_some() {
            "AllowableValues"
        } else if reset.get("@Redfish.ActionInfo").is_some() {
            "ActionInfo"
        } else {
            "none advertised"
        };
        // An ActionInfo that cannot be read leaves the reset types unknown, not the probe failed.
        let reset_types = self
            .allowable_reset_types(&reset)
            .await
            .ok()
            .flatten()
            .unwrap_or_default();
        let allowed = |key: &str| {
            system
                .pointer(&format!("/Boot/{key}@Redfish.AllowableValues"))
                .and_then(Value::as_array)
                .map(|v| strings(v))
                .unwrap_or_default()
        };
        let boot_targets = allowed("BootSourceOverrideTarget");
        // A BMC that lists the override's allowable values without `Once` keeps every override;
        // otherwise only a one-time boot read back tells (see `BootOnce`).
        let enabled = allowed("BootSourceOverrideEnabled");
        let boot_once = (!enabled.is_empty() && !enabled.iter().any(|e| e == "Once"))
            .then_some(BootOnce::Continuous);
        let mut boot_modes = allowed("BootSourceOverrideMode");
        if boot_modes.is_empty()
            && let Some(mode) = system
                .pointer("/Boot/BootSourceOverrideMode")
                .and_then(Value::as_str)
        {
            boot_modes.push(mode.to_string());
        }
        let manager = match system
            .pointer("/Links/ManagedBy/0/@odata.id")
            .and_then(Value::as_str)
        {
            Some(path) => self.get_json(path).await.ok().map(|(m, _)| m),
            None => None,
        };
        let virtual_media = system.pointer("/VirtualMedia/@odata.id").is_some()
            || manager
                .as_ref()
                .is_some_and(|m| m.pointer("/VirtualMedia/@odata.id").is_some());
        Ok(BmcCapabilities {
            protocol: "Redfish".into(),
            protocol_version: text(&root, "RedfishVersion"),
            vendor: text(&root, "Vendor")
                .or_else(|| manager.as_ref().and_then(|m| text(m, "Manufacturer"))),
            firmware_version: manager.as_ref().and_then(|m| text(m, "FirmwareVersion")),
            sessions: Some(root.pointer("/SessionService/@odata.id").is_some()),
            uefi_http_boot: Some(boot_targets.iter().any(|t| t == "UefiHttp")),
            reset_types,
            reset_types_source: Some(reset_types_source.into()),
            boot_targets,
            boot_modes,
            etag: Some(reply.header("etag").is_some_and(|e| !e.is_empty())),
            virtual_media: Some(virtual_media),
            cipher_suite: None,
            boot_once,
        })
    }

    /// The system's virtual CD/DVD device (system-level VirtualMedia, else its manager's).
    async fn cd_device(&self) -> Result<Value, BmcError> {
        let (path, system, _) = self.get_system().await?;
        let mut collections = Vec::new();
        if let Some(p) = system
            .pointer("/VirtualMedia/@odata.id")
            .and_then(Value::as_str)
        {
            collections.push(p.to_string());
        }
        if let Some(managers) = system.pointer("/Links/ManagedBy").and_then(Value::as_array) {
            for m in managers
                .iter()
                .filter_map(|m| m.get("@odata.id").and_then(Value::as_str))
            {
                if let Ok((manager, _)) = self.get_json(m).await
                    && let Some(p) = manager
                        .pointer("/VirtualMedia/@odata.id")
                        .and_then(Value::as_str)
                {
                    collections.push(p.to_string());
                }
            }
        }
        let mut seen = Vec::new();
        for collection in collections {
            let (c, _) = self.get_json(&collection).await?;
            for member in members(&c) {
                let (dev, _) = self.get_json(&member).await?;
                let types = dev
                    .get("MediaTypes")
                    .and_then(Value::as_array)
                    .map(|t| strings(t))
                    .unwrap_or_default();
                if types.iter().any(|t| t == "CD" || t == "DVD") {
                    return Ok(dev);
                }
                seen.push(format!("{member} {types:?}"));
            }
        }
        Err(BmcError::Unsupported {
            address: self.address.clone(),
            what: format!(
                "virtual CD/DVD media for system {path} (devices: {})",
                if seen.is_empty() {
                    "none".to_string()
                } else {
                    shown(&seen.join(", "))
                }
            ),
        })
    }

    async fn do_insert_media(&self, iso_url: &str) -> Result<(), BmcError> {
        let dev = self.cd_device().await?;
        let dev_path = dev
            .get("@odata.id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let body = json!({ "Image": iso_url, "Inserted": true, "WriteProtected": true });
        if let Some(target) = dev
            .pointer("/Actions/#VirtualMedia.InsertMedia/target")
            .and_then(Value::as_str)
        {
            self.send(
                Method::POST,
                target,
                &body,
                &HeaderMap::new(),
                Retry::OnlyConnectRefused,
            )
            .await?;
        } else {
            self.send(
                Method::PATCH,
                &dev_path,
                &body,
                &HeaderMap::new(),
                Retry::Idempotent,
            )
            .await?;
        }
        tracing::info!(bmc = %self.address, device = %dev_path, "virtual media inserted");
        Ok(())
    }

    async fn do_eject_media(&self) -> Result<(), BmcError> {
        let dev = self.cd_device().await?;
        let dev_path = dev
            .get("@odata.id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if let Some(target) = dev
            .pointer("/Actions/#VirtualMedia.EjectMedia/target")
            .and_then(Value::as_str)
        {
            self.send(
                Method::POST,
                target,
                &json!({}),
                &HeaderMap::new(),
                Retry::OnlyConnectRefused,
            )
            .await?;
        } else {
            self.send(
                Method::PATCH,
                &dev_path,
                &json!({ "Image": null, "Inserted": false }),
                &HeaderMap::new(),
                Retry::Idempotent,
            )
            .await?;
        }
        tracing::info!(bmc = %self.address, device = %dev_path, "virtual media ejected");
        Ok(())
    }

    /// DELETE the session, if any. Idempotent.
    pub async fn logout(&self) -> Result<(), BmcError> {
        let previous = std::mem::replace(&mut *self.auth.lock().await, Auth::None);
        let Auth::Session {
            token,
            location: Some(location),
            ..
        } = previous
        else {
            return Ok(());
        };
        let mut headers = HeaderMap::new();
        if let Ok(mut v) = HeaderValue::from_str(token.expose()) {
            v.set_sensitive(true);
            headers.insert("X-Auth-Token", v);
        }
        let reply = self
            .exchange_retrying(
                &Method::DELETE,
                &location,
                None,
                &headers,
                Retry::Idempotent,
            )
            .await?;
        // 401/404: the session is already gone, which is what we wanted.
        if reply.status.is_success() || matches!(reply.status.as_u16(), 401 | 404) {
            tracing::debug!(bmc = %self.address, session = %location, "logged out");
            Ok(())
        } else {
            Err(self.rejected(&format!("DELETE {location}"), &reply))
        }
    }
}

impl Drop for RedfishBmc {
    /// Best-effort logout when a session is still open and a tokio runtime is around.
    fn drop(&mut self) {
        let Auth::Session {
            token,
            location: Some(location),
            ..
        } = std::mem::replace(self.auth.get_mut(), Auth::None)
        else {
            return;
        };
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let http = self.http.clone();
        let Ok(url) = self.url(&location) else {
            return;
        };
        let gate = self.gate.clone();
        let timeout = self.options.timeout;
        let address = self.address.clone();
        handle.spawn(async move {
            let Ok(_permit) = gate.acquire_owned().await else { return };
            let mut req = http.delete(url).timeout(timeout);
            if let Ok(mut v) = HeaderValue::from_str(token.expose()) {
                v.set_sensitive(true);
                req = req.header("X-Auth-Token", v);
            }
            match req.send().await {
                Ok(r) => tracing::debug!(bmc = %address, status = r.status().as_u16(), "session closed on drop"),
                Err(e) => tracing::debug!(bmc = %address, error = %e.without_url(), "closing the session on drop failed"),
            }
        });
    }
}

impl Bmc for RedfishBmc {
    fn address(&self) -> &str {
        &self.address
    }
    fn power_state(&self) -> BmcFuture<'_, PowerState> {
        Box::pin(self.do_power_state())
    }
    fn power(&self, action: PowerAction) -> BmcFuture<'_, ()> {
        Box::pin(self.do_power(action))
    }
    fn set_boot_once(&self, device: BootDevice, mode: Option<BootMode>) -> BmcFuture<'_, ()> {
        Box::pin(self.do_set_boot_once(device, mode))
    }
    fn boot_override(&self) -> BmcFuture<'_, BootOverride> {
        Box::pin(self.do_boot_override())
    }
    fn power_and_boot_override(&self) -> BmcFuture<'_, (PowerState, BootOverride)> {
        Box::pin(self.do_power_and_boot_override())
    }
    fn insert_media<'a>(&'a self, iso_url: &'a str) -> BmcFuture<'a, ()> {
        Box::pin(self.do_insert_media(iso_url))
    }
    fn eject_media(&self) -> BmcFuture<'_, ()> {
        Box::pin(self.do_eject_media())
    }
    fn inventory(&self) -> BmcFuture<'_, HardwareInventory> {
        Box::pin(self.do_inventory())
    }
    fn probe(&self) -> BmcFuture<'_, BmcCapabilities> {
        Box::pin(self.do_probe())
    }

    fn logout(&self) -> BmcFuture<'_, ()> {
        Box::pin(RedfishBmc::logout(self))
    }
}

/// The boot override a system resource shows.
fn boot_override_of(system: &Value) -> BootOverride {
    let s = |p: &str| {
        system
            .pointer(p)
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    BootOverride {
        target: s("/Boot/BootSourceOverrideTarget"),
        enabled: s("/Boot/BootSourceOverrideEnabled"),
        mode: s("/Boot/BootSourceOverrideMode").and_then(|m| match m.as_str() {
            "UEFI" => Some(BootMode::UEFI),
            "Legacy" => Some(BootMode::Legacy),
            _ => None,
        }),
    }
}

/// The power state a system resource shows.
fn power_state_of(system: &Value) -> PowerState {
    match system.get("PowerState").and_then(Value::as_str) {
        Some("On") => PowerState::On,
        Some("Off") => PowerState::Off,
        Some("PoweringOn") => PowerState::PoweringOn,
        Some("PoweringOff") => PowerState::PoweringOff,
        _ => PowerState::Unknown,
    }
}

fn boot_mode_name(mode: BootMode) -> &'static str {
    match mode {
        BootMode::UEFI => "UEFI",
        BootMode::Legacy => "Legacy",
    }
}

fn strings(values: &[Value]) -> Vec<String> {
    values
        .iter()
        .filter_map(Value::as_str)
        .map(str::to_string)
        .collect()
}

/// `Members[].@odata.id` of a collection.
fn members(collection: &Value) -> Vec<String> {
    collection
        .get("Members")
        .and_then(Value::as_array)
        .map(|ms| {
            ms.iter()
                .filter_map(|m| m.get("@odata.id").and_then(Value::as_str))
                .map(|s| s.trim_end_matches('/').to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// A `Retry-After` value in seconds (RFC 9110 §10.2.3); None for an HTTP-date or garbage, which
/// get the ordinary backoff.
fn retry_after(value: &str) -> Option<Duration> {
    value.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// The human-readable messages of a Redfish error body (`error.@Message.ExtendedInfo[].Message`,
/// else `error.message`), or a short excerpt of a non-JSON body.
pub fn redfish_messages(body: &[u8]) -> Vec<String> {
    // What is not a Redfish error (a proxy's page, an attacker's text) is described, never echoed:
    // these messages end up in conditions and Events.
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return if body.iter().all(u8::is_ascii_whitespace) {
            Vec::new()
        } else {
            vec![format!("a non-Redfish reply of {} bytes", body.len())]
        };
    };
    let bounded = |m: &str| -> String {
        let mut s: String = m.chars().take(MAX_MESSAGE_CHARS).collect();
        if m.chars().count() > MAX_MESSAGE_CHARS {
            s.push('…');
        }
        s
    };
    let mut out: Vec<String> = v
        .pointer("/error/@Message.ExtendedInfo")
        .and_then(Value::as_array)
        .map(|infos| {
            infos
                .iter()
                .filter_map(extended_info)
                .take(MAX_MESSAGES)
                .map(|m| bounded(&m))
                .collect()
        })
        .unwrap_or_default();
    if out.is_empty()
        && let Some(m) = v.pointer("/error/message").and_then(Value::as_str)
    {
        out.push(bounded(m));
    }
    out
}

/// One `@Message.ExtendedInfo` entry as an operator needs it: `MessageId: Message`, and the
/// `MessageArgs` when there is no text to carry them.
fn extended_info(info: &Value) -> Option<String> {
    let id = info.get("MessageId").and_then(Value::as_str);
    let message = info.get("Message").and_then(Value::as_str);
    let args: Vec<String> = info
        .get("MessageArgs")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .take(8)
                .map(|v| match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    match (id, message) {
        (Some(id), Some(m)) => Some(format!("{id}: {m}")),
        (None, Some(m)) => Some(m.to_string()),
        (Some(id), None) if args.is_empty() => Some(id.to_string()),
        (Some(id), None) => Some(format!("{id} ({})", args.join(", "))),
        (None, None) => None,
    }
}

/// Text a BMC chose (paths, member lists) as it appears in errors, conditions and logs: bounded.
fn shown(text: &str) -> String {
    const MAX: usize = 200;
    if text.chars().count() <= MAX {
        text.to_string()
    } else {
        let mut cut: String = text.chars().take(MAX).collect();
        cut.push('…');
        cut
    }
}

/// Bounds on what a BMC's error reply may put into a condition or an Event.
pub const MAX_MESSAGES: usize = 4;
pub const MAX_MESSAGE_CHARS: usize = 300;

/// `Display` of an error and its sources, joined by `: `, without URLs repeated.
fn error_chain(e: &reqwest::Error) -> String {
    let mut parts = Vec::new();
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = source {
        let s = err.to_string();
        if !parts.contains(&s) {
            parts.push(s);
        }
        source = err.source();
    }
    if parts.is_empty() {
        parts.push(e.to_string());
    }
    parts.join(": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bmc_messages_are_bounded_and_never_echo_other_bodies() {
        assert_eq!(
            redfish_messages(b"<html><body>proxy login: password=hunter2</body></html>"),
            vec!["a non-Redfish reply of 55 bytes".to_string()]
        );
        assert!(redfish_messages(b"  \n").is_empty());
        let long = "x".repeat(5000);
        let many: Vec<Value> = (0..20).map(|_| json!({"Message": long})).collect();
        let body = json!({"error": {"message": "m", "@Message.ExtendedInfo": many}}).to_string();
        let messages = redfish_messages(body.as_bytes());
        assert_eq!(messages.len(), MAX_MESSAGES);
        assert!(
            messages
                .iter()
                .all(|m| m.chars().count() == MAX_MESSAGE_CHARS + 1)
        );
    }

    #[test]
    fn only_the_bmcs_own_origin_is_followed() {
        let base = "https://10.0.0.5:443";
        for (path, want) in [
            (
                "/redfish/v1/SessionService/Sessions",
                Some("https://10.0.0.5:443/redfish/v1/SessionService/Sessions"),
            ),
            (
                "https://10.0.0.5/redfish/v1/Systems/1",
                Some("https://10.0.0.5/redfish/v1/Systems/1"),
            ),
            ("https://10.0.0.5:443/x", Some("https://10.0.0.5/x")),
            ("https://10.0.0.6/redfish/v1", None),
            ("http://10.0.0.5/redfish/v1", None),
            ("https://10.0.0.5:8443/redfish/v1", None),
            ("https://admin:pw@10.0.0.5/redfish/v1", None),
            ("//evil.example/redfish/v1", None),
            ("/\\evil", None),
            ("redfish/v1/Systems/1", None),
            ("file:///etc/passwd", None),
            ("", None),
        ] {
            assert_eq!(confined_url(base, path).ok().as_deref(), want, "{path:?}");
        }
    }

    #[test]
    fn address_forms() {
        let ok = |a: &str, scheme, host: &str, port, sys: Option<&str>| {
            let p = parse_address(a).unwrap_or_else(|e| panic!("{a}: {e}"));
            assert_eq!(
                p,
                RedfishAddress {
                    scheme,
                    host: host.to_string(),
                    port,
                    system_path: sys.map(str::to_string)
                },
                "{a}"
            );
        };
        ok("redfish://10.0.0.1", Scheme::Https, "10.0.0.1", 443, None);
        ok(
            "redfish://bmc.example:8443/redfish/v1/Systems/1",
            Scheme::Https,
            "bmc.example",
            8443,
            Some("/redfish/v1/Systems/1"),
        );
        ok(
            "redfish+https://h/redfish/v1/Systems/abc/",
            Scheme::Https,
            "h",
            443,
            Some("/redfish/v1/Systems/abc"),
        );
        ok(
            "redfish+http://127.0.0.1:8000",
            Scheme::Http,
            "127.0.0.1",
            8000,
            None,
        );
        ok(
            "redfish+http://127.0.0.1:8000/",
            Scheme::Http,
            "127.0.0.1",
            8000,
            None,
        );
        ok(
            "redfish+http://h/redfish/v1/Systems",
            Scheme::Http,
            "h",
            80,
            None,
        );
        ok(
            "redfish://[fd00::1]:623/redfish/v1/Systems/S1",
            Scheme::Https,
            "[fd00::1]",
            623,
            Some("/redfish/v1/Systems/S1"),
        );
        ok("REDFISH://h", Scheme::Https, "h", 443, None);

        let err = |a: &str, reason: &str| {
            let e = parse_address(a).expect_err(a);
            assert_eq!(e.reason(), reason, "{a}: {e}");
        };
        err("ipmi://10.0.0.1:623", "BmcUnsupported");
        err("http://h", "BmcAddressInvalid");
        err("h:443", "BmcAddressInvalid");
        err("redfish://", "BmcAddressInvalid");
        err("redfish://h/other/path", "BmcAddressInvalid");
        err("redfish://h/redfish/v1/Systems/a/b", "BmcAddressInvalid");
        err("redfish://user:pw@h", "BmcAddressInvalid");
        err("redfish://h:99999", "BmcAddressInvalid");
        let e = parse_address("redfish://user:topsecret@h/x").expect_err("userinfo");
        assert!(!e.to_string().contains("topsecret"), "{e}");
    }

    #[test]
    fn reset_type_choice() {
        let sushy: Vec<String> = [
            "On",
            "ForceOff",
            "GracefulShutdown",
            "GracefulRestart",
            "ForceRestart",
            "Nmi",
            "ForceOn",
        ]
        .map(String::from)
        .to_vec();
        let only = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        type Case = (PowerAction, Option<Vec<String>>, Option<&'static str>);
        let table: &[Case] = &[
            (PowerAction::On, Some(sushy.clone()), Some("On")),
            (
                PowerAction::GracefulOff,
                Some(sushy.clone()),
                Some("GracefulShutdown"),
            ),
            (PowerAction::ForceOff, Some(sushy.clone()), Some("ForceOff")),
            (
                PowerAction::Cycle,
                Some(sushy.clone()),
                Some("ForceRestart"),
            ),
            (
                PowerAction::Cycle,
                Some(only(&["PowerCycle", "ForceRestart"])),
                Some("PowerCycle"),
            ),
            (
                PowerAction::Cycle,
                Some(only(&["GracefulRestart"])),
                Some("GracefulRestart"),
            ),
            (
                PowerAction::On,
                Some(only(&["ForceOn", "ForceOff"])),
                Some("ForceOn"),
            ),
            (PowerAction::GracefulOff, Some(only(&["ForceOff"])), None),
            (PowerAction::Cycle, Some(only(&["On", "ForceOff"])), None),
            (PowerAction::On, Some(Vec::new()), None),
            (PowerAction::On, None, Some("On")),
            (PowerAction::Cycle, None, Some("PowerCycle")),
        ];
        for (action, allowable, want) in table {
            assert_eq!(
                choose_reset_type(*action, allowable.as_deref()),
                *want,
                "{action:?} from {allowable:?}"
            );
        }
    }

    #[test]
    fn redfish_error_messages() {
        let body = br#"{"error":{"code":"Base.1.0.GeneralError","message":"general","@Message.ExtendedInfo":[{"Message":"The property X is read only."},{"Message":"Second."}]}}"#;
        assert_eq!(
            redfish_messages(body),
            vec!["The property X is read only.", "Second."]
        );
        assert_eq!(
            redfish_messages(br#"{"error":{"message":"Incorrect username or password"}}"#),
            vec!["Incorrect username or password"]
        );
        assert_eq!(
            redfish_messages(b"Service Unavailable"),
            vec!["a non-Redfish reply of 19 bytes"],
            "not Redfish JSON: described, not echoed"
        );
        assert!(redfish_messages(b"").is_empty());
        // What iDRAC and iLO send: the MessageId names the rule, the args what broke it.
        let body = br#"{"error":{"@Message.ExtendedInfo":[{"MessageId":"Base.1.8.PropertyValueNotInList","Message":"The value Foo for the property BootSourceOverrideTarget is not in the list of acceptable values.","MessageArgs":["Foo","BootSourceOverrideTarget"]},{"MessageId":"IDRAC.2.8.SYS403","MessageArgs":["Pxe"]}]}}"#;
        assert_eq!(
            redfish_messages(body),
            vec![
                "Base.1.8.PropertyValueNotInList: The value Foo for the property BootSourceOverrideTarget is not in the list of acceptable values.",
                "IDRAC.2.8.SYS403 (Pxe)"
            ]
        );
    }

    #[test]
    fn retry_after_in_seconds() {
        assert_eq!(retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(" 120 "), Some(Duration::from_secs(120)));
        assert_eq!(retry_after("Wed, 21 Oct 2026 07:28:00 GMT"), None);
        assert_eq!(retry_after("-1"), None);
    }
}

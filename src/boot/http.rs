//! The boot service's HTTP side: the iPXE chain, cloud-init NoCloud documents and the
//! bootstrap-success callback. Every answer comes from reflector stores shared with the
//! controllers; only a callback writes (it records itself on the boot Secret).

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, FromRequestParts, Path, Query, State};
use axum::http::{HeaderValue, StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use serde::Deserialize;
use tokio::sync::mpsc;

use crate::api::{MetalHost, MetalMachine};
use crate::controllers::events::EventRecorder;
use kube::runtime::events::EventType;

use super::ipxe::{self, HostScript, Templates};
use super::nocloud;
use super::tokens::{self, BootRecord, CallbackRecord, StoredBootSecret};

/// The stores the boot service reads (shared with the controllers).
#[derive(Clone)]
pub struct BootStores {
    pub hosts: Store<MetalHost>,
    /// The hosts' index, kept by the watch that fills `hosts`
    /// ([`crate::controllers::metalmachine::claim::host_index_keys`]): a DHCP, iPXE or TFTP
    /// request finds its host by boot MAC in one lookup, whatever the fleet's size. Those
    /// requests come from anyone on the provisioning network.
    pub host_index: crate::stores::Index<MetalHost>,
    pub machines: Store<MetalMachine>,
    /// Secrets labelled `metalboot.io/boot-token`, as the store keeps them.
    pub boot_secrets: Store<StoredBootSecret>,
}

impl BootStores {
    /// Stores of their own, each filled by a watch of `namespace`: the boot service without
    /// the manager's shared ones (tests, benchmarks). Wait for `BootState::wait_for_stores`.
    pub fn watch(client: &kube::Client, namespace: &str) -> Self {
        let host_index =
            crate::stores::Index::new(crate::controllers::metalmachine::claim::host_index_keys);
        BootStores {
            hosts: crate::stores::SharedStore::indexed(host_index.clone()).run(
                kube::Api::namespaced(client.clone(), namespace),
                kube::runtime::watcher::Config::default(),
            ),
            host_index,
            machines: crate::stores::watch_store(
                kube::Api::namespaced(client.clone(), namespace),
                kube::runtime::watcher::Config::default(),
            ),
            boot_secrets: crate::stores::watch_boot_secrets(kube::Api::namespaced(
                client.clone(),
                namespace,
            )),
        }
    }
}

/// Who a boot MAC belongs to.
enum MacOwners {
    None,
    One(Arc<MetalHost>),
    /// Two or more hosts name the same boot MAC: an operator's mistake that must not boot one
    /// of them with the other's data.
    Shared(crate::controllers::metalmachine::claim::MacSharers),
}

#[derive(Clone, Debug)]
pub struct BootConfig {
    /// How hosts reach this service, e.g. `http://10.0.0.2:8080` (no trailing slash).
    pub base_url: String,
    /// Only the first address that fetched a host's script may use its token.
    pub pin_source_ip: bool,
    /// How long vendor-data waits for the bootstrap sentinel before giving up.
    pub sentinel_wait_seconds: u32,
    /// The deploy ramdisk that image-mode hosts netboot to run `metalboot agent`.
    pub deploy: Option<crate::api::metalmachine::BootProfile>,
}

/// Milestones of a host's boot, broadcast for whoever watches (the lab's timings table, metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootEvent {
    /// The proxyDHCP service told the host with this boot MAC where its boot program is.
    DhcpAnswered {
        mac: String,
        host: String,
        offer: String,
    },
    /// The TFTP server sent a whole file to the host with this boot MAC.
    TftpDone {
        mac: String,
        host: String,
        file: String,
    },
    /// A kernel or initrd was served to the host at an address learned from its DHCP request.
    Artifact {
        mac: String,
        host: String,
        file: String,
    },
    /// A provisioning iPXE script was served to the host with this boot MAC.
    ScriptServed { mac: String, host: String },
    /// A NoCloud document was served for this attempt.
    NoCloud {
        namespace: String,
        metal_machine: String,
        host: String,
        document: String,
    },
    /// The host called back.
    Callback {
        namespace: String,
        metal_machine: String,
        host: String,
    },
}

/// A host reported success: the MetalMachine controller should look at `namespace/metal_machine`.
#[derive(Debug, Clone, PartialEq)]
pub struct CallbackNotice {
    pub namespace: String,
    pub metal_machine: String,
    /// The boot Secret as the apiserver answered the write that recorded the report, so the
    /// controller need not wait for its watch to deliver it (see `metalmachine::observe`).
    pub recorded: Option<Recorded>,
}

/// A write to a boot Secret: the resourceVersion it replaced and the Secret it produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub replaced: String,
    pub written: Arc<StoredBootSecret>,
}

impl Recorded {
    /// The apiserver's answer, kept as the boot Secrets' store keeps a Secret: the machine's
    /// pass reads it in place of the store's copy. Answers wait for their passes during a
    /// callback storm (thousands at once); whole, each would carry the bootstrap data (tens of
    /// KB for a control plane) and managedFields.
    pub fn of_write(replaced: String, written: Secret) -> Self {
        Self {
            replaced,
            written: Arc::new(written.into()),
        }
    }
}

pub struct BootState {
    pub stores: BootStores,
    pub config: BootConfig,
    templates: Templates,
    client: kube::Client,
    recorder: EventRecorder,
    callbacks: mpsc::UnboundedSender<CallbackNotice>,
    /// Source address pinned per attempt (boot Secret namespace/name/attempt).
    /// Per boot Secret (`namespace/name`): the token the pin is for, and the first address
    /// that presented it.
    pins: Mutex<HashMap<String, (u64, IpAddr)>>,
    /// Event writes caused by requests, rate-limited per machine and reason.
    event_limiter: EventLimiter,
    /// Token hash → boot Secret, so a token costs one lookup and one parse.
    tokens: TokenIndex,
    /// Recently served tokens (hash → namespace, machine), to attribute replays to a machine.
    seen: Mutex<SeenTokens>,
    /// Stores have synced: before that every host would look unknown.
    ready: std::sync::atomic::AtomicBool,
    events: tokio::sync::broadcast::Sender<BootEvent>,
    /// Address → boot MAC of hosts being provisioned, learned from their DHCP requests, so TFTP
    /// (which sees only addresses) can say which host a transfer was for.
    addresses: Mutex<HashMap<IpAddr, String>>,
    /// When each host reached its last boot milestone (for `metalboot_boot_hop_seconds`).
    hops: Mutex<HashMap<String, std::time::Instant>>,
    /// When `/metrics` last counted the hosts by state: at most once a second, however often
    /// it is asked (anyone on the provisioning network may ask).
    hosts_counted: Mutex<Option<std::time::Instant>>,
    /// Bootstrap data read from the apiserver lately, per token hash: a host that asks again
    /// (cloud-init retrying, a token holder looping) after its last read was answered costs no
    /// apiserver read for [`USER_DATA_MEMO_TTL`].
    user_data: moka::future::Cache<u64, Bytes>,
}

/// How long bootstrap data read for a token answers that token's repeats without a read.
const USER_DATA_MEMO_TTL: std::time::Duration = std::time::Duration::from_secs(10);
/// Bytes of bootstrap data kept at once (a boot Secret holds at most 1 MiB).
const USER_DATA_MEMO_BYTES: u64 = 8 << 20;

/// Token hash → the boot Secret holding it. Built from the store, each Secret version parsed once;
/// rebuilt at most once per [`TOKEN_REINDEX`] when a token is not found, and rid of deleted
/// Secrets when it outgrows the store (`note`).
#[derive(Default)]
struct TokenIndex {
    inner: Mutex<TokenIndexInner>,
    parsed: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct TokenIndexInner {
    by_hash: HashMap<u64, ObjectRef<StoredBootSecret>>,
    /// resourceVersion indexed per Secret, and the hash it gave.
    versions: HashMap<ObjectRef<StoredBootSecret>, (String, u64)>,
    refreshed: Option<std::time::Instant>,
}

const TOKEN_REINDEX: std::time::Duration = std::time::Duration::from_millis(500);

/// Index entries beyond twice the store's size before deleted Secrets are dropped on a note.
const TOKEN_INDEX_SLACK: usize = 64;

impl TokenIndex {
    fn find(&self, hash: u64, store: &Store<StoredBootSecret>) -> Option<BootRecord> {
        let key = self.inner.lock().ok()?.by_hash.get(&hash).cloned()?;
        let secret = store.get(&key)?;
        self.parsed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tokens::parse_boot_secret(&secret).ok()
    }

    /// Indexes the token of a boot Secret a host is being handed (its script, its DHCP answer).
    /// Tokens found at once never trigger a re-index, so Secrets deleted since (every released
    /// machine's) are dropped here once the index holds more than twice the store plus
    /// [`TOKEN_INDEX_SLACK`]: at most that many entries, at an amortized constant cost per note.
    fn note(
        &self,
        secret: &StoredBootSecret,
        record: &BootRecord,
        store: &Store<StoredBootSecret>,
    ) {
        if let Ok(mut inner) = self.inner.lock() {
            inner.insert(secret, record);
            if inner.versions.len() > 2 * store.len() + TOKEN_INDEX_SLACK {
                inner.retain_live(store);
            }
        }
    }

    fn refresh(&self, store: &Store<StoredBootSecret>) {
        let Ok(mut inner) = self.inner.lock() else {
            return;
        };
        if inner
            .refreshed
            .is_some_and(|at| at.elapsed() < TOKEN_REINDEX)
        {
            return;
        }
        inner.refreshed = Some(std::time::Instant::now());
        inner.retain_live(store);
        for secret in store.state() {
            let key = place_of(&secret);
            let version = secret.resource_version().unwrap_or_default();
            if inner.versions.get(&key).is_some_and(|(v, _)| *v == version) {
                continue;
            }
            self.parsed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Ok(record) = tokens::parse_boot_secret(&secret) {
                inner.insert(&secret, &record);
            }
        }
    }
}

/// A Secret's place in the store, for the token index: `ObjectRef::from_obj` would also copy in
/// its resourceVersion and uid, two more strings per boot Secret held, which lookups ignore.
fn place_of(secret: &StoredBootSecret) -> ObjectRef<StoredBootSecret> {
    let meta = &secret.metadata;
    let reference = ObjectRef::new(meta.name.as_deref().unwrap_or_default());
    match meta.namespace.as_deref() {
        Some(namespace) => reference.within(namespace),
        None => reference,
    }
}

impl TokenIndexInner {
    /// Forgets the tokens of Secrets the store no longer holds.
    fn retain_live(&mut self, store: &Store<StoredBootSecret>) {
        let Self {
            by_hash, versions, ..
        } = self;
        versions.retain(|key, (_, hash)| {
            let keep = store.get(key).is_some();
            if !keep {
                by_hash.remove(hash);
            }
            keep
        });
    }

    /// Indexes `record`'s token under its Secret, replacing that Secret's previous token.
    fn insert(&mut self, secret: &StoredBootSecret, record: &BootRecord) {
        let key = place_of(secret);
        let hash = token_hash(record.token.expose());
        let version = secret.resource_version().unwrap_or_default();
        if let Some((_, old)) = self.versions.insert(key.clone(), (version, hash)) {
            self.by_hash.remove(&old);
        }
        self.by_hash.insert(hash, key);
    }
}

/// At most one Event per key per [`EVENT_INTERVAL`]; the map is pruned so it stays bounded.
#[derive(Default)]
struct EventLimiter(Mutex<HashMap<String, std::time::Instant>>);

const EVENT_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);
const EVENT_KEYS: usize = 4096;

impl EventLimiter {
    fn allow(&self, key: &str) -> bool {
        let Ok(mut last) = self.0.lock() else {
            return false;
        };
        if last.len() >= EVENT_KEYS {
            last.retain(|_, at| at.elapsed() < EVENT_INTERVAL);
        }
        if last.len() >= EVENT_KEYS {
            return false; // still full of fresh keys: a flood; write nothing more
        }
        match last.get(key) {
            Some(at) if at.elapsed() < EVENT_INTERVAL => false,
            _ => {
                last.insert(key.to_string(), std::time::Instant::now());
                true
            }
        }
    }
}

#[derive(Default)]
struct SeenTokens {
    order: VecDeque<u64>,
    owners: HashMap<u64, (String, String)>,
}

const SEEN_CAPACITY: usize = 4096;

impl SeenTokens {
    fn remember(&mut self, hash: u64, owner: (String, String)) {
        if self.owners.insert(hash, owner).is_none() {
            self.order.push_back(hash);
            if self.order.len() > SEEN_CAPACITY
                && let Some(old) = self.order.pop_front()
            {
                self.owners.remove(&old);
            }
        }
    }
}

fn token_hash(token: &str) -> u64 {
    crate::stable_hash::stable_hash(token)
}

impl BootState {
    pub fn new(
        stores: BootStores,
        config: BootConfig,
        client: kube::Client,
        callbacks: mpsc::UnboundedSender<CallbackNotice>,
    ) -> Result<Self, minijinja::Error> {
        let recorder = EventRecorder::new(client.clone(), "metalboot-boot-service");
        Ok(Self {
            stores,
            config,
            templates: Templates::new()?,
            client,
            recorder,
            callbacks,
            pins: Mutex::new(HashMap::new()),
            event_limiter: EventLimiter::default(),
            tokens: TokenIndex::default(),
            seen: Mutex::new(SeenTokens::default()),
            ready: std::sync::atomic::AtomicBool::new(false),
            events: tokio::sync::broadcast::channel(256).0,
            addresses: Mutex::new(HashMap::new()),
            hops: Mutex::new(HashMap::new()),
            hosts_counted: Mutex::new(None),
            user_data: moka::future::Cache::builder()
                .max_capacity(USER_DATA_MEMO_BYTES)
                .weigher(|_, data: &Bytes| u32::try_from(data.len() + 8).unwrap_or(u32::MAX))
                .time_to_live(USER_DATA_MEMO_TTL)
                .build(),
        })
    }

    /// Boot milestones as they happen (lagging receivers lose the oldest).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<BootEvent> {
        self.events.subscribe()
    }

    fn publish(&self, event: BootEvent) {
        self.record_hop(&event);
        let _ = self.events.send(event);
    }

    /// The per-hop timeline as a metric: seconds from a host's previous milestone to this one
    /// (`metalboot_boot_hop_seconds{hop}`), the DHCP answer starting a boot and the callback
    /// ending it.
    fn record_hop(&self, event: &BootEvent) {
        let (host, hop) = match event {
            BootEvent::DhcpAnswered { host, .. } => (host, "dhcp"),
            BootEvent::TftpDone { host, .. } => (host, "tftp"),
            BootEvent::ScriptServed { host, .. } => (host, "script"),
            BootEvent::Artifact { host, .. } => (host, "artifact"),
            BootEvent::NoCloud { host, document, .. } if document == "user-data" => {
                (host, "user-data")
            }
            BootEvent::Callback { host, .. } => (host, "callback"),
            BootEvent::NoCloud { .. } => return,
        };
        let Ok(mut hops) = self.hops.lock() else {
            return;
        };
        let now = std::time::Instant::now();
        if let Some(previous) = hops.get(host) {
            crate::metrics::record_hop(hop, now.duration_since(*previous));
        }
        if hop == "callback" {
            hops.remove(host);
        } else {
            if hops.len() >= 65_536 {
                hops.clear();
            }
            hops.insert(host.clone(), now);
        }
    }

    /// Tells the timeline that `file` (a kernel, an initrd) went to `client`.
    pub fn artifact_served(&self, client: IpAddr, file: &str) {
        let mac = self
            .addresses
            .lock()
            .ok()
            .and_then(|a| a.get(&client).cloned());
        if let Some(mac) = mac
            && let Some(host) = self.host_by_mac(&mac)
        {
            self.publish(BootEvent::Artifact {
                mac,
                host: host.name_any(),
                file: file.to_string(),
            });
        }
    }

    /// Waits until every store has its first full list, then lets requests through.
    pub async fn wait_for_stores(&self) {
        crate::stores::until_ready(&self.stores.hosts).await;
        crate::stores::until_ready(&self.stores.machines).await;
        crate::stores::until_ready(&self.stores.boot_secrets).await;
        tracing::info!("boot service: stores synced, answering hosts");
        self.ready.store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The hosts registered with boot MAC `mac` (normalized), for the iPXE script, which says
    /// which hosts collide (the first few).
    fn hosts_with_mac(&self, mac: &str) -> MacOwners {
        let key = crate::controllers::metalmachine::claim::boot_mac_key(mac);
        self.stores.host_index.pick(&key, |hosts| match hosts {
            [] => MacOwners::None,
            [host] => MacOwners::One(Arc::clone(host)),
            shared => MacOwners::Shared(crate::controllers::metalmachine::claim::MacSharers::of(
                shared, None,
            )),
        })
    }

    /// The one host with boot MAC `mac`. A MAC that two hosts claim belongs to neither: its
    /// requests get no host's script, token or DHCP answer until an operator fixes one of them.
    fn host_by_mac(&self, mac: &str) -> Option<Arc<MetalHost>> {
        let key = crate::controllers::metalmachine::claim::boot_mac_key(mac);
        self.stores.host_index.pick(&key, |hosts| match hosts {
            [host] => Some(Arc::clone(host)),
            _ => None,
        })
    }

    /// The host behind a boot MAC and its current attempt, when it has one that has not called
    /// back yet: the hosts the proxyDHCP service answers.
    fn provisioning_host(&self, mac: &str) -> Option<Arc<MetalHost>> {
        let host = self.host_by_mac(mac)?;
        let consumer = host.spec.consumer_ref.as_ref()?;
        let record = self.current_record(&host.namespace().unwrap_or_default(), &consumer.name)?;
        record.callback.is_none().then_some(host)
    }

    fn machine(&self, namespace: &str, name: &str) -> Option<Arc<MetalMachine>> {
        self.stores
            .machines
            .get(&ObjectRef::new(name).within(namespace))
    }

    fn current_record(&self, namespace: &str, machine: &str) -> Option<BootRecord> {
        let secret = self
            .stores
            .boot_secrets
            .get(&ObjectRef::new(&tokens::boot_secret_name(machine)).within(namespace))?;
        match tokens::parse_boot_secret(&secret) {
            Ok(record) => {
                // The token is about to be handed out: index it now, not at the next re-index.
                self.tokens
                    .note(&secret, &record, &self.stores.boot_secrets);
                Some(record)
            }
            Err(e) => {
                tracing::warn!(error = %e, "ignoring unreadable boot Secret");
                None
            }
        }
    }

    /// Finds the attempt a presented token belongs to.
    fn lookup(&self, token: &str) -> TokenLookup {
        let hash = token_hash(token);
        let found = self
            .tokens
            .find(hash, &self.stores.boot_secrets)
            .or_else(|| {
                // Not indexed: a boot Secret may be newer than the index. Re-index at most once per
                // interval, so a flood of unknown tokens costs a map lookup each, not a scan.
                self.tokens.refresh(&self.stores.boot_secrets);
                self.tokens.find(hash, &self.stores.boot_secrets)
            });
        if let Some(record) = found.filter(|r| r.token.matches(token)) {
            let machine = self.machine(&record.namespace, &record.metal_machine);
            // A cleaning attempt runs while its machine is being deleted, until the agent
            // reports its outcome.
            let live = machine.as_ref().is_some_and(|m| {
                m.uid().is_some()
                    && match record.clean {
                        Some(_) => record.deploy.as_ref().is_none_or(|d| {
                            d.state == crate::agent::protocol::DeployState::Writing
                        }),
                        None => m.meta().deletion_timestamp.is_none(),
                    }
            });
            return match (record.callback.is_some(), machine) {
                (false, Some(machine)) if live => TokenLookup::Current(record, machine),
                (_, machine) => TokenLookup::Spent(record, machine),
            };
        }
        let owner = self
            .seen
            .lock()
            .ok()
            .and_then(|s| s.owners.get(&hash).cloned());
        match owner {
            Some((namespace, name)) => TokenLookup::Replayed(self.machine(&namespace, &name)),
            None => TokenLookup::Unknown,
        }
    }

    /// Boot Secrets parsed so far (each version once; tests check a token flood adds none).
    pub fn secrets_parsed(&self) -> u64 {
        self.tokens
            .parsed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    fn remember(&self, record: &BootRecord) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.remember(
                token_hash(record.token.expose()),
                (record.namespace.clone(), record.metal_machine.clone()),
            );
        }
    }

    /// Forgets source pins of attempts whose boot Secret (`namespace/name`) is gone.
    pub fn retain_pins(&self, secret_exists: impl Fn(&str) -> bool) {
        if let Ok(mut pins) = self.pins.lock() {
            pins.retain(|secret, _| secret_exists(secret));
        }
    }

    pub fn pinned(&self) -> usize {
        self.pins.lock().map(|p| p.len()).unwrap_or(0)
    }

    fn pin_key(record: &BootRecord) -> String {
        format!("{}/{}", record.namespace, record.secret_name)
    }

    /// Records the first address that presented a token; later requests with it must come from
    /// that address. A new token of the same Secret (the next attempt, a cleaning, a live host's
    /// next boot, which may bring a new address) starts a new pin in place of the old one.
    fn check_pin(&self, record: &BootRecord, client: Option<IpAddr>) -> Result<(), IpAddr> {
        if !self.config.pin_source_ip {
            return Ok(());
        }
        let (Some(ip), Ok(mut pins)) = (client, self.pins.lock()) else {
            return Ok(());
        };
        let token = token_hash(record.token.expose());
        match pins.get(&Self::pin_key(record)) {
            Some((pinned_token, pinned)) if *pinned_token == token && *pinned != ip => Err(*pinned),
            Some((pinned_token, _)) if *pinned_token == token => Ok(()),
            _ => {
                pins.insert(Self::pin_key(record), (token, ip));
                Ok(())
            }
        }
    }

    async fn event(&self, machine: &MetalMachine, type_: EventType, reason: &str, note: String) {
        // Anonymous requests can cause these: at most one Event per machine and reason per
        // interval reaches the apiserver; the rest are counted.
        let key = format!(
            "{}/{}/{reason}",
            machine.namespace().unwrap_or_default(),
            machine.name_any()
        );
        if !self.event_limiter.allow(&key) {
            crate::metrics::record_event_suppressed(reason);
            return;
        }
        if let Err(e) = self
            .recorder
            .publish(machine, type_, reason, "Boot", &note)
            .await
        {
            tracing::warn!(error = %e, reason, "could not publish Event");
        }
    }
}

enum TokenLookup {
    Current(BootRecord, Arc<MetalMachine>),
    /// The attempt exists but already called back, or its machine is gone or going.
    Spent(BootRecord, Option<Arc<MetalMachine>>),
    /// Not a current token, but one this service served before.
    Replayed(Option<Arc<MetalMachine>>),
    Unknown,
}

impl crate::boot::dhcpd::BootClients for BootState {
    fn provisioning(&self, mac: &str) -> bool {
        self.provisioning_host(mac).is_some()
    }

    fn address_learned(&self, mac: &str, ip: std::net::Ipv4Addr) {
        if let Ok(mut addresses) = self.addresses.lock() {
            // Only hosts being provisioned get here; the bound is against a misbehaving fleet.
            if addresses.len() >= 65_536 {
                addresses.clear();
            }
            addresses.insert(IpAddr::V4(ip), mac.to_string());
        }
    }

    /// Each boot MAC's reserved address; a MAC that two hosts name has none (it gets no answer).
    fn reservations(&self) -> std::collections::BTreeMap<String, std::net::Ipv4Addr> {
        self.stores
            .hosts
            .state()
            .iter()
            .filter_map(|h| {
                let mac = ipxe::normalize_mac(&h.spec.boot_mac_address)?;
                let ip = h.spec.boot_ip_address?;
                self.host_by_mac(&mac).is_some().then_some((mac, ip))
            })
            .collect()
    }

    fn answered(&self, answer: &crate::boot::dhcp::Answer) {
        let offer = match &answer.offer {
            crate::boot::dhcp::BootOffer::Tftp { file } => format!("tftp:{file}"),
            crate::boot::dhcp::BootOffer::Http { url } => url.clone(),
        };
        self.publish(BootEvent::DhcpAnswered {
            mac: answer.mac.clone(),
            host: self
                .host_by_mac(&answer.mac)
                .map(|h| h.name_any())
                .unwrap_or_default(),
            offer,
        });
    }
}

impl crate::boot::tftp::TransferObserver for BootState {
    fn transfer_done(&self, client: SocketAddr, file: &str) {
        let mac = self
            .addresses
            .lock()
            .ok()
            .and_then(|a| a.get(&client.ip()).cloned());
        let host = mac.as_deref().and_then(|m| self.host_by_mac(m));
        tracing::info!(client = %client, mac = mac.as_deref().unwrap_or("unknown"), host = ?host.as_ref().map(|h| h.name_any()), file, "TFTP transfer done");
        if let (Some(mac), Some(host)) = (mac, host) {
            self.publish(BootEvent::TftpDone {
                mac,
                host: host.name_any(),
                file: file.to_string(),
            });
        }
    }
}

/// Reports kernels and initrds served with success to the timeline (`/artifacts` only).
pub async fn artifact_hop(
    State(state): State<Arc<BootState>>,
    ClientIp(ip): ClientIp,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let file = request
        .uri()
        .path()
        .rsplit('/')
        .next()
        .unwrap_or_default()
        .chars()
        .take(80)
        .collect::<String>();
    let response = next.run(request).await;
    if let Some(ip) = ip
        && response.status().is_success()
    {
        state.artifact_served(ip, &file);
    }
    response
}

/// The client's address when the request came over a socket (absent in socket-less tests).
pub struct ClientIp(pub Option<IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for ClientIp {
    type Rejection = std::convert::Infallible;
    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(ClientIp(
            parts
                .extensions
                .get::<ConnectInfo<SocketAddr>>()
                .map(|c| c.0.ip()),
        ))
    }
}

/// The boot service's routes. `main` serves it with connect info; tests call it directly.
pub fn router(state: Arc<BootState>) -> Router {
    Router::new()
        .route("/boot.ipxe", get(entry_script))
        .route("/ipxe/{mac}", get(host_script))
        .route("/nocloud/{token}/{document}", get(nocloud_document))
        .route("/callback/{token}", post(callback))
        .route("/agent/{token}/task", get(agent_api::task))
        .route("/agent/{token}/inspection", post(agent_api::inspection))
        .route("/agent/{token}/report", post(agent_api::report))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            until_ready,
        ))
        .with_state(state)
}

/// Sets the hosts-per-state gauge from `hosts`.
fn count_hosts_by_state(hosts: &Store<MetalHost>) {
    use crate::api::metalhost::HostState;
    use std::cell::Cell;
    let states = [
        HostState::Registering,
        HostState::Available,
        HostState::Provisioning,
        HostState::Provisioned,
        HostState::Deprovisioning,
        HostState::Error,
    ];
    let counts: [Cell<i64>; 6] = Default::default();
    let _ = hosts.find(|h| {
        let host_state = h.status.as_ref().and_then(|s| s.state).unwrap_or_default();
        if let Some(i) = states.iter().position(|s| *s == host_state) {
            counts[i].set(counts[i].get() + 1);
        }
        false
    });
    let named: Vec<(String, i64)> = states
        .iter()
        .zip(&counts)
        .map(|(st, n)| (format!("{st:?}"), n.get()))
        .collect();
    let refs: Vec<(&str, i64)> = named.iter().map(|(s, n)| (s.as_str(), *n)).collect();
    crate::metrics::set_hosts(&refs);
}

async fn metrics_text(State(state): State<Arc<BootState>>) -> Response {
    // At most once a second, in one pass over the store under its read lock, nothing copied:
    // anyone on the provisioning network may ask, and the store holds every host. In between,
    // the gauge keeps the last count.
    let due = state.hosts_counted.lock().is_ok_and(|mut at| {
        let due = at.is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(1));
        if due {
            *at = Some(std::time::Instant::now());
        }
        due
    });
    if due {
        count_hosts_by_state(&state.stores.hosts);
    }
    let mut response = text(StatusCode::OK, crate::metrics::render());
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    response
}

async fn readyz(State(state): State<Arc<BootState>>) -> Response {
    if state.is_ready() {
        text(StatusCode::OK, "ok\n".into())
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "stores syncing\n".into())
    }
}

/// Until the stores have synced every host would look unknown, so hosts get 503 and retry
/// (the entry script's loop) instead of a wrong answer.
async fn until_ready(
    State(state): State<Arc<BootState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    if state.is_ready() || path == "/healthz" || path == "/readyz" || path == "/metrics" {
        next.run(request).await
    } else {
        text(
            StatusCode::SERVICE_UNAVAILABLE,
            "boot service starting, retry\n".into(),
        )
    }
}

/// Logs every request on `metalboot::boot::access` (method, path with tokens shortened, status,
/// client) — the trail an operator follows when a host does not boot. Layer it outermost.
pub async fn access_log(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let method = request.method().clone();
    let client = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip());
    let started = std::time::Instant::now();
    let raw_path = request.uri().path().to_string();
    let response = next.run(request).await;
    let bytes = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    log_request(
        &method,
        &raw_path,
        response.status().as_u16(),
        client,
        started,
        bytes,
    );
    response
}

/// One access-log line and the request metrics, for the Router's requests and the front's files.
pub fn log_request(
    method: &axum::http::Method,
    raw_path: &str,
    status: u16,
    client: Option<IpAddr>,
    started: std::time::Instant,
    bytes: Option<u64>,
) {
    crate::metrics::record_http(raw_path, status, bytes);
    tracing::info!(
        target: "metalboot::boot::access",
        %method,
        path = %redact_path(raw_path),
        status,
        client = ?client,
        ms = started.elapsed().as_millis() as u64,
        "request"
    );
}

/// A request path safe to log. A token is cut to 6 characters wherever it appears: after
/// `/nocloud/` or `/callback/` (empty segments skipped, so `//` does not bypass it), and in any
/// segment that merely looks like one (24+ characters of the token alphabet). Segments are cut
/// to 64 characters and the whole path to 512, so a hostile path cannot blow up a log line.
pub fn redact_path(path: &str) -> String {
    const SEGMENT: usize = 64;
    const TOTAL: usize = 512;
    let looks_like_token = |s: &str| {
        s.len() >= 24
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    };
    let mut out = Vec::new();
    let mut token_next = false;
    for segment in path.split('/') {
        if segment.is_empty() {
            out.push(String::new());
            continue;
        }
        if token_next || looks_like_token(segment) {
            out.push(format!("{}…", segment.chars().take(6).collect::<String>()));
        } else if segment.chars().count() > SEGMENT {
            out.push(format!(
                "{}…",
                segment.chars().take(SEGMENT).collect::<String>()
            ));
        } else {
            out.push(segment.to_string());
        }
        token_next =
            segment.eq_ignore_ascii_case("nocloud") || segment.eq_ignore_ascii_case("callback");
    }
    let joined = out.join("/");
    if joined.chars().count() > TOTAL {
        format!("{}…", joined.chars().take(TOTAL).collect::<String>())
    } else {
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::{
        EventLimiter, Recorded, Secret, StoredBootSecret, TOKEN_INDEX_SLACK, TokenIndex,
        redact_path, token_hash, tokens,
    };

    /// A boot Secret as the apiserver would answer its create.
    fn boot_secret(machine: &str, version: u32) -> Secret {
        let mut secret = tokens::new_boot_secret(&tokens::NewAttempt {
            namespace: "ns",
            metal_machine: machine,
            owner: k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                uid: format!("uid-{machine}"),
                ..Default::default()
            },
            cluster_name: None,
            host: "h1",
            attempt: 1,
            provider_id: "metalboot://ns/h1",
            user_data: b"#cloud-config\n",
        });
        secret.metadata.resource_version = Some(version.to_string());
        secret
    }

    #[test]
    fn the_token_index_forgets_released_machines_without_unknown_tokens() {
        use kube::runtime::watcher::Event;
        let (store, mut writer) = kube::runtime::reflector::store::<StoredBootSecret>();
        let index = TokenIndex::default();
        let live: Vec<StoredBootSecret> = (0..10)
            .map(|i| boot_secret(&format!("kept-{i}"), i).into())
            .collect();
        for secret in &live {
            writer.apply_watcher_event(&Event::Apply(secret.clone()));
            let record = tokens::parse_boot_secret(secret).unwrap();
            index.note(secret, &record, &store);
        }
        // A thousand machines provisioned and released, every token found at once: no lookup
        // ever misses, so no re-index runs.
        for i in 0..1_000 {
            let secret = StoredBootSecret::from(boot_secret(&format!("churn-{i}"), 100 + i));
            writer.apply_watcher_event(&Event::Apply(secret.clone()));
            let record = tokens::parse_boot_secret(&secret).unwrap();
            index.note(&secret, &record, &store);
            assert!(
                index
                    .find(token_hash(record.token.expose()), &store)
                    .is_some()
            );
            writer.apply_watcher_event(&Event::Delete(secret));
        }
        let inner = index.inner.lock().unwrap();
        // The bound holds at each note, when the store also held the Secret being noted.
        assert!(
            inner.versions.len() <= 2 * (store.len() + 1) + TOKEN_INDEX_SLACK,
            "{} entries for {} live boot Secrets",
            inner.versions.len(),
            store.len()
        );
        assert_eq!(inner.by_hash.len(), inner.versions.len());
        drop(inner);
        for secret in &live {
            let record = tokens::parse_boot_secret(secret).unwrap();
            let found = index.find(token_hash(record.token.expose()), &store);
            assert_eq!(found.map(|r| r.metal_machine), Some(record.metal_machine));
        }
    }

    #[test]
    fn a_recorded_write_keeps_what_the_store_keeps() {
        let mut answer = boot_secret("m1", 7);
        answer.metadata.managed_fields = Some(vec![Default::default()]);
        let record = tokens::parse_boot_secret(&(&answer).into()).unwrap();
        let recorded = Recorded::of_write("6".into(), answer.clone());
        assert_eq!(
            tokens::user_data(&recorded.written.to_secret()),
            None,
            "no bootstrap data"
        );
        assert_eq!(recorded.written.metadata.managed_fields, None);
        assert_eq!(
            *recorded.written,
            StoredBootSecret::from(answer),
            "the store's form"
        );
        let kept = tokens::parse_boot_secret(&recorded.written).unwrap();
        assert!(kept.token.matches(record.token.expose()), "the token stays");
        assert_eq!(recorded.replaced, "6");
    }

    #[test]
    fn request_events_are_rate_limited_per_machine_and_reason() {
        let limiter = EventLimiter::default();
        assert!(limiter.allow("ns/m1/BootTokenReplayed"));
        assert!(
            !limiter.allow("ns/m1/BootTokenReplayed"),
            "the same again: suppressed"
        );
        assert!(limiter.allow("ns/m2/BootTokenReplayed"), "another machine");
        assert!(
            limiter.allow("ns/m1/BootCallbackRejected"),
            "another reason"
        );
        for i in 0..10_000 {
            limiter.allow(&format!("ns/flood-{i}/X"));
        }
        assert!(
            limiter.0.lock().map(|m| m.len()).unwrap_or(usize::MAX) <= super::EVENT_KEYS,
            "bounded under a flood of keys"
        );
    }

    #[test]
    fn tokens_never_reach_the_access_log() {
        let token = "a".repeat(64);
        assert_eq!(
            redact_path(&format!("/nocloud/{token}/user-data")),
            "/nocloud/aaaaaa…/user-data"
        );
        assert_eq!(
            redact_path(&format!("/callback/{token}")),
            "/callback/aaaaaa…"
        );
        assert_eq!(
            redact_path("/ipxe/52-54-00-12-34-56"),
            "/ipxe/52-54-00-12-34-56"
        );
        assert_eq!(redact_path("/boot.ipxe"), "/boot.ipxe");
        assert_eq!(
            redact_path(&format!("/nocloud//{token}/user-data")),
            "/nocloud//aaaaaa…/user-data",
            "a double slash does not skip the redaction"
        );
        assert_eq!(
            redact_path(&format!("/NoCloud/{token}")),
            "/NoCloud/aaaaaa…",
            "nor does another case"
        );
        assert_eq!(
            redact_path(&format!("/x/{token}")),
            "/x/aaaaaa…",
            "nor another route"
        );
        assert_eq!(
            redact_path("/artifacts/vmlinuz-6.1.0-56-amd64"),
            "/artifacts/vmlinuz-6.1.0-56-amd64"
        );
        let hostile = format!("/{}", "x.".repeat(30_000));
        assert!(redact_path(&hostile).chars().count() <= 513, "bounded");
    }
}

fn text(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn internal_error(what: &str, e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "{what}");
    text(StatusCode::INTERNAL_SERVER_ERROR, format!("{what}\n"))
}

async fn entry_script(State(state): State<Arc<BootState>>, ClientIp(ip): ClientIp) -> Response {
    tracing::info!(route = "/boot.ipxe", client = ?ip, "entry script");
    match state.templates.entry_script(&state.config.base_url) {
        Ok(script) => text(StatusCode::OK, script),
        Err(e) => internal_error("rendering the entry script failed", e),
    }
}

#[derive(Deserialize)]
struct ScriptQuery {
    attempt: Option<u32>,
}

async fn host_script(
    State(state): State<Arc<BootState>>,
    Path(raw_mac): Path<String>,
    Query(query): Query<ScriptQuery>,
    ClientIp(ip): ClientIp,
) -> Response {
    let Some(mac) = ipxe::normalize_mac(&raw_mac) else {
        tracing::warn!(route = "/ipxe", client = ?ip, "not a MAC address: {:?}", raw_mac.chars().take(40).collect::<String>());
        return text(
            StatusCode::BAD_REQUEST,
            "#!ipxe\necho metalboot: not a MAC address\nexit\n".into(),
        );
    };
    let owners = state.hosts_with_mac(&mac);
    let host = match &owners {
        MacOwners::One(host) => Some(host.clone()),
        MacOwners::None | MacOwners::Shared(_) => None,
    };
    let consumer = host
        .as_ref()
        .and_then(|h| h.spec.consumer_ref.as_ref())
        .map(|c| c.name.clone());
    let namespace = host
        .as_ref()
        .and_then(|h| h.namespace())
        .unwrap_or_default();
    let machine = consumer
        .as_ref()
        .and_then(|name| state.machine(&namespace, name));
    let record = consumer
        .as_ref()
        .and_then(|name| state.current_record(&namespace, name));
    let script = match owners {
        MacOwners::Shared(sharers) => HostScript::Shared {
            mac: mac.clone(),
            hosts: sharers.to_string(),
        },
        MacOwners::One(_) | MacOwners::None => ipxe::choose_script(
            &mac,
            query.attempt.unwrap_or(1),
            host.as_deref(),
            machine.as_deref(),
            record.as_ref(),
            &state.config.base_url,
            state.config.deploy.as_ref(),
        ),
    };
    let host_name = host.as_ref().map(|h| h.name_any());
    match &script {
        HostScript::Provision(plan) => {
            if let Some(record) = &record {
                state.remember(record);
                if let Err(pinned) = state.check_pin(record, ip) {
                    tracing::warn!(host = ?host_name, client = ?ip, %pinned, "iPXE script requested from an address other than the pinned one");
                }
            }
            tracing::info!(route = "/ipxe", %mac, host = %plan.host, machine = %plan.machine, attempt = plan.attempt, client = ?ip, "provisioning script");
            state.publish(BootEvent::ScriptServed {
                mac: mac.clone(),
                host: plan.host.clone(),
            });
        }
        HostScript::Refused { reason, .. } => {
            tracing::warn!(route = "/ipxe", %mac, host = ?host_name, client = ?ip, %reason, "refused to render a provisioning script");
            if let Some(m) = &machine {
                state
                    .event(m, EventType::Warning, "BootProfileInvalid", reason.clone())
                    .await;
            }
        }
        HostScript::Idle { state: why, .. } => {
            tracing::info!(route = "/ipxe", %mac, host = ?host_name, client = ?ip, reason = %why, "exit script");
        }
        HostScript::Unknown { attempt, .. } => {
            tracing::info!(route = "/ipxe", %mac, client = ?ip, attempt, "unknown MAC");
        }
        HostScript::Shared { hosts, .. } => {
            tracing::warn!(route = "/ipxe", %mac, client = ?ip, %hosts, "boot MAC of several MetalHosts: booting none of them");
        }
    }
    match state.templates.host_script(&script, &state.config.base_url) {
        Ok(body) => text(StatusCode::OK, body),
        Err(e) => internal_error("rendering a host script failed", e),
    }
}

/// Checks a presented token; on refusal returns the response and emits what the operator needs.
async fn authorize(
    state: &BootState,
    token: &str,
    ip: Option<IpAddr>,
    route: &str,
) -> Result<(BootRecord, Arc<MetalMachine>), Response> {
    let not_found = || text(StatusCode::NOT_FOUND, "unknown or expired token\n".into());
    // A token is 64 hex characters; anything else is noise and is not even looked up.
    if token.len() != 64 || !token.chars().all(|c| c.is_ascii_hexdigit()) {
        tracing::warn!(route, client = ?ip, "malformed token");
        return Err(not_found());
    }
    match state.lookup(token) {
        // A cleaning token only talks to the deploy agent's routes: no NoCloud data, no callback.
        TokenLookup::Current(record, _)
            if record.clean.is_some() && !route.starts_with("/agent/") =>
        {
            tracing::warn!(route, machine = %record.metal_machine, client = ?ip, "cleaning token used outside the agent routes");
            Err(not_found())
        }
        TokenLookup::Current(record, machine) => {
            state.remember(&record);
            if let Err(pinned) = state.check_pin(&record, ip) {
                tracing::warn!(route, machine = %record.metal_machine, client = ?ip, %pinned, "token used from an address other than the pinned one");
                state
                    .event(&machine, EventType::Warning, "BootTokenSourceMismatch",
                        format!("{route} for attempt {} came from {}, but the attempt is pinned to {pinned}", record.attempt, ip.map(|i| i.to_string()).unwrap_or_default()))
                    .await;
                return Err(text(
                    StatusCode::FORBIDDEN,
                    "token is pinned to another address\n".into(),
                ));
            }
            Ok((record, machine))
        }
        TokenLookup::Spent(record, machine) => {
            tracing::warn!(route, machine = %record.metal_machine, attempt = record.attempt, client = ?ip, "request with a spent token");
            if let Some(m) = machine {
                state
                    .event(
                        &m,
                        EventType::Warning,
                        "BootTokenReplayed",
                        format!(
                            "{route} used the token of attempt {} after it was spent (from {})",
                            record.attempt,
                            ip.map(|i| i.to_string())
                                .unwrap_or_else(|| "unknown".into())
                        ),
                    )
                    .await;
            }
            Err(not_found())
        }
        TokenLookup::Replayed(machine) => {
            tracing::warn!(route, client = ?ip, "request with an expired token");
            if let Some(m) = machine {
                state
                    .event(
                        &m,
                        EventType::Warning,
                        "BootTokenReplayed",
                        format!(
                            "{route} used an expired boot token (from {})",
                            ip.map(|i| i.to_string())
                                .unwrap_or_else(|| "unknown".into())
                        ),
                    )
                    .await;
            }
            Err(not_found())
        }
        TokenLookup::Unknown => {
            tracing::warn!(route, client = ?ip, "request with an unknown token");
            Err(not_found())
        }
    }
}

/// How long a user-data request waits for the apiserver's copy of the boot Secret.
const USER_DATA_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The bootstrap data of the attempt `record` authorized, read from the apiserver: the store
/// keeps none (`tokens::StoredBootSecret`). Only a request whose token was found current gets here,
/// and its repeats join the read on its way or, within [`USER_DATA_MEMO_TTL`] of its answer, are
/// answered from the memo: one read per token per TTL, never one per unauthenticated request.
/// The read skips the manager's queue of apiserver requests, as a callback's write does: a host
/// booting in a storm must not time out waiting behind the controllers. A Secret renewed since
/// the lookup holds another token: the request gets the answer an expired token gets.
async fn read_user_data(state: &BootState, record: &BootRecord) -> Result<Bytes, Response> {
    let token = token_hash(record.token.expose());
    let secrets: Api<Secret> = Api::namespaced(state.client.clone(), &record.namespace);
    let read = async {
        let read = crate::kubeconn::gate::urgent(tokio::time::timeout(
            USER_DATA_READ_TIMEOUT,
            secrets.get_opt(&record.secret_name),
        ));
        let secret = match read.await {
            Ok(Ok(Some(secret))) => secret,
            Ok(Ok(None)) => return Err(UserDataMiss::Expired),
            Ok(Err(e)) => return Err(UserDataMiss::Unavailable(e.to_string())),
            Err(_) => {
                return Err(UserDataMiss::Unavailable(
                    "the apiserver did not answer in time".into(),
                ));
            }
        };
        let user_data = Bytes::from(tokens::user_data(&secret).unwrap_or_default().to_vec());
        let same_attempt = tokens::parse_boot_secret(&secret.into())
            .is_ok_and(|current| current.token.matches(record.token.expose()));
        if !same_attempt {
            tracing::warn!(route = "/nocloud", machine = %record.metal_machine, "user-data of an attempt replaced since its token was looked up");
            return Err(UserDataMiss::Expired);
        }
        Ok(user_data)
    };
    // Requests with one token while its read is on its way join that read.
    state.user_data.try_get_with(token, read).await.map_err(|miss| match &*miss {
        UserDataMiss::Expired => text(
            StatusCode::NOT_FOUND,
            "unknown or expired token\n".into(),
        ),
        UserDataMiss::Unavailable(what) => {
            tracing::warn!(route = "/nocloud", machine = %record.metal_machine, error = %what, "could not read the bootstrap data");
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                "bootstrap data unavailable, retry\n".into(),
            )
        }
    })
}

/// Why a user-data request gets no bootstrap data.
#[derive(Debug)]
enum UserDataMiss {
    /// The boot Secret is gone or holds another attempt's token.
    Expired,
    /// The apiserver failed or did not answer in time.
    Unavailable(String),
}

async fn nocloud_document(
    State(state): State<Arc<BootState>>,
    Path((token, document)): Path<(String, String)>,
    ClientIp(ip): ClientIp,
) -> Response {
    let (record, _machine) = match authorize(&state, &token, ip, "/nocloud").await {
        Ok(found) => found,
        Err(response) => return response,
    };
    // Read before the milestone is recorded: a failed read is not the host reaching user-data.
    let user_data = match document.as_str() {
        "user-data" => match read_user_data(&state, &record).await {
            Ok(bytes) => Some(bytes),
            Err(response) => return response,
        },
        _ => None,
    };
    tracing::info!(route = "/nocloud", document = %document, machine = %record.metal_machine, host = %record.host, attempt = record.attempt, client = ?ip, "NoCloud document");
    state.publish(BootEvent::NoCloud {
        namespace: record.namespace.clone(),
        metal_machine: record.metal_machine.clone(),
        host: record.host.clone(),
        document: document.clone(),
    });
    match document.as_str() {
        "meta-data" => match nocloud::meta_data(&record) {
            Ok(body) => text(StatusCode::OK, body),
            Err(e) => internal_error("rendering meta-data failed", e),
        },
        "user-data" => {
            // Byte for byte what the bootstrap provider wrote, whatever its format.
            let mut response = (StatusCode::OK, user_data.unwrap_or_default()).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            response
                .headers_mut()
                .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            response
        }
        "vendor-data" => {
            let url = format!(
                "{}/callback/{}",
                state.config.base_url,
                record.token.expose()
            );
            match state
                .templates
                .vendor_data(&url, state.config.sentinel_wait_seconds)
            {
                Ok(body) => text(StatusCode::OK, body),
                Err(e) => internal_error("rendering vendor-data failed", e),
            }
        }
        "network-config" => text(StatusCode::OK, nocloud::network_config().into()),
        _ => text(StatusCode::NOT_FOUND, "no such NoCloud document\n".into()),
    }
}

mod agent_api;

/// Why a callback could not be recorded.
enum CallbackWrite {
    /// The attempt the token belongs to is gone: replaced by a later attempt (new token), or
    /// another request already recorded its callback. Never retried.
    Superseded,
    /// The apiserver could not be written; the host should retry.
    Failed(String),
}

/// Records `received` on the boot Secret of `record`'s attempt, with a resourceVersion
/// precondition: a late callback of attempt N can never land on attempt N+1's Secret, and of
/// concurrent callbacks with one token exactly one wins. A conflict caused by an unrelated
/// write (the controller noting the power-on) is retried against a fresh read, as long as that
/// read is still the same attempt with the same token and no callback yet.
async fn record_callback(
    secrets: &Api<Secret>,
    record: &BootRecord,
    received: &CallbackRecord,
) -> Result<Recorded, CallbackWrite> {
    let patch = tokens::callback_patch(received)
        .map_err(|e| CallbackWrite::Failed(format!("encoding the callback record: {e}")))?;
    record_on_attempt(secrets, record, patch).await
}

/// Merges `data_patch` into the boot Secret of `record`'s attempt, under the same rule as the
/// callback: only while that attempt (same token) lives and has not called back.
async fn record_on_attempt(
    secrets: &Api<Secret>,
    record: &BootRecord,
    data_patch: serde_json::Value,
) -> Result<Recorded, CallbackWrite> {
    const ATTEMPTS: usize = 3;
    let mut current = record.clone();
    for _ in 0..ATTEMPTS {
        let Some(resource_version) = current.resource_version.clone() else {
            return Err(CallbackWrite::Superseded);
        };
        let patch = crate::controllers::conditioned(data_patch.clone(), Some(&resource_version));
        match secrets
            .patch(
                &record.secret_name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(written) => return Ok(Recorded::of_write(resource_version, written)),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(kube::Error::Api(e)) if e.code == 404 => return Err(CallbackWrite::Superseded),
            Err(e) => return Err(CallbackWrite::Failed(e.to_string())),
        }
        let fresh = match secrets.get_opt(&record.secret_name).await {
            Ok(Some(secret)) => {
                tokens::parse_boot_secret(&secret.into()).map_err(|_| CallbackWrite::Superseded)?
            }
            Ok(None) => return Err(CallbackWrite::Superseded),
            Err(e) => return Err(CallbackWrite::Failed(e.to_string())),
        };
        let same_attempt = fresh.attempt == record.attempt
            && fresh.token.matches(record.token.expose())
            && fresh.callback.is_none();
        if !same_attempt {
            return Err(CallbackWrite::Superseded);
        }
        current = fresh;
    }
    Err(CallbackWrite::Failed(
        "the boot Secret kept changing; retry".into(),
    ))
}

/// How long a host may take to send its (at most 16 KiB) callback body.
const CALLBACK_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

async fn callback(
    State(state): State<Arc<BootState>>,
    Path(token): Path<String>,
    ClientIp(ip): ClientIp,
    body: axum::body::Body,
) -> Response {
    // The token first: an unauthenticated client gets its answer before a byte of body is read.
    let (record, machine) = match authorize(&state, &token, ip, "/callback").await {
        Ok(found) => found,
        Err(response) => {
            crate::metrics::record_callback("refused");
            return response;
        }
    };
    // Then the body, never more than the cap (the read stops there) and within a time budget.
    let body = match tokio::time::timeout(
        CALLBACK_BODY_TIMEOUT,
        axum::body::to_bytes(body, nocloud::MAX_CALLBACK_BYTES),
    )
    .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            crate::metrics::record_callback("malformed");
            return text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "callback body is larger than {} bytes\n",
                    nocloud::MAX_CALLBACK_BYTES
                ),
            );
        }
        Err(_) => {
            crate::metrics::record_callback("malformed");
            return text(
                StatusCode::REQUEST_TIMEOUT,
                "callback body not received in time\n".into(),
            );
        }
    };
    let (hostname, addresses) = match nocloud::parse_callback(&body) {
        Ok(report) => report,
        Err(e) => {
            tracing::warn!(route = "/callback", machine = %record.metal_machine, client = ?ip, error = %e, "rejected callback");
            crate::metrics::record_callback("malformed");
            state
                .event(
                    &machine,
                    EventType::Warning,
                    "BootCallbackRejected",
                    e.to_string(),
                )
                .await;
            return text(StatusCode::BAD_REQUEST, format!("{e}\n"));
        }
    };
    let received = CallbackRecord {
        hostname,
        addresses,
        source_ip: ip,
        received_at: jiff::Timestamp::now().to_string(),
    };
    let secrets: Api<Secret> = Api::namespaced(state.client.clone(), &record.namespace);
    // The host, and the machine's ready status after it, wait on this write: it skips the
    // manager's queue of apiserver requests.
    let recorded = match crate::kubeconn::gate::urgent(record_callback(
        &secrets, &record, &received,
    ))
    .await
    {
        Ok(recorded) => recorded,
        Err(CallbackWrite::Superseded) => {
            tracing::warn!(route = "/callback", machine = %record.metal_machine, attempt = record.attempt, client = ?ip, "callback of an attempt that was replaced or already called back");
            crate::metrics::record_callback("superseded");
            return text(
                StatusCode::CONFLICT,
                "this boot attempt was replaced or has already called back\n".into(),
            );
        }
        Err(CallbackWrite::Failed(e)) => {
            // The host retries; nothing is lost by answering 503.
            tracing::error!(route = "/callback", machine = %record.metal_machine, error = %e, "could not record the callback");
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "could not record the callback, retry\n".into(),
            );
        }
    };
    tracing::info!(route = "/callback", machine = %record.metal_machine, host = %record.host, attempt = record.attempt, client = ?ip, addresses = ?received.addresses, "bootstrap succeeded");
    crate::metrics::record_callback("accepted");
    state.publish(BootEvent::Callback {
        namespace: record.namespace.clone(),
        metal_machine: record.metal_machine.clone(),
        host: record.host.clone(),
    });
    let _ = state.callbacks.send(CallbackNotice {
        namespace: record.namespace.clone(),
        metal_machine: record.metal_machine.clone(),
        recorded: Some(recorded),
    });
    text(StatusCode::OK, "ok\n".into())
}

//! Reconcilers. Each controller file keeps its decisions in pure functions (observed state →
//! actions and status, table-tested without a server) and a thin I/O shell around them. This
//! module holds what they share: conditions, per-object backoff, status writes, Events, pause.

pub mod cloudinitconfig;
pub mod cluster;
pub mod conditions;
pub mod drain;
pub mod events;
pub mod existingcontrolplane;
pub mod expectations;
pub mod hostbmc;
pub mod janitor;
pub mod machine;
pub mod metalcluster;
pub mod metalhost;
pub mod metalmachine;
pub mod per_object;
pub mod power;
pub mod refs;

use std::time::Duration;

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};

use crate::api::{Cluster, Machine, MetalCluster, MetalHost, MetalMachine, PAUSED_ANNOTATION};

/// Readers of the manager's shared reflector stores (see `stores::Reflectors`).
#[derive(Clone)]
pub struct SharedStores {
    pub hosts: Store<MetalHost>,
    pub metal_machines: Store<MetalMachine>,
    pub machines: Store<DeserializeGuard<Machine>>,
    pub clusters: Store<DeserializeGuard<Cluster>>,
    pub metal_clusters: Store<MetalCluster>,
    /// Secrets labelled `metalboot.io/boot-token`, as the store keeps them.
    pub boot_secrets: Store<crate::boot::tokens::StoredBootSecret>,
    /// Hosts by consumer and free hosts by namespace (`metalmachine::claim::host_index_keys`).
    pub host_index: crate::stores::Index<MetalHost>,
    /// MetalMachines waiting for a free host (`metalmachine::waiting_index_keys`).
    pub metal_machine_index: crate::stores::Index<MetalMachine>,
}

impl SharedStores {
    /// Waits until every store has made its first list, as controller-runtime's workers wait for
    /// their caches. Before that, an object missing from a store may only be not listed yet: a
    /// pass deciding from it would write "owner not found" or "Cluster not found" over a running
    /// machine's status after every restart.
    pub async fn until_listed(&self) {
        use crate::stores::until_ready;
        until_ready(&self.hosts).await;
        until_ready(&self.metal_machines).await;
        until_ready(&self.machines).await;
        until_ready(&self.clusters).await;
        until_ready(&self.metal_clusters).await;
        until_ready(&self.boot_secrets).await;
    }
}

/// One controller's subscriptions to the shared watches.
pub struct Subscriptions {
    pub hosts: crate::stores::Changes<MetalHost>,
    pub metal_machines: crate::stores::Changes<MetalMachine>,
    pub machines: crate::stores::Changes<DeserializeGuard<Machine>>,
    pub clusters: crate::stores::Changes<DeserializeGuard<Cluster>>,
    pub boot_secrets: crate::stores::Changes<crate::boot::tokens::StoredBootSecret>,
}

impl Subscriptions {
    pub fn new(r: &crate::stores::Reflectors) -> Self {
        Subscriptions {
            hosts: r.hosts.subscribe(),
            metal_machines: r.metal_machines.subscribe(),
            machines: r.machines.subscribe(),
            clusters: r.clusters.subscribe(),
            boot_secrets: r.boot_secrets.subscribe(),
        }
    }
}

/// Errors of a reconcile, by stage, so the log line and the condition say what failed where.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("reading {what}: {source}")]
    Read {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("writing {what}: {source}")]
    Write {
        what: String,
        #[source]
        source: kube::Error,
    },
    /// A BMC operation failed; `reason` is the BMC error's condition reason.
    #[error("BMC of {host}: {message}")]
    Bmc {
        host: String,
        reason: &'static str,
        message: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Drain(#[from] drain::DrainError),
    #[error("finalizer: {0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<ReconcileError>>),
    /// Not an error: cleanup is under way and must be looked at again. kube's `finalizer()`
    /// removes the finalizer on any `Ok`, so "not done yet" travels as this variant.
    #[error("{what}; checking again in {after:?}")]
    Requeue { what: String, after: Duration },
}

impl ReconcileError {
    /// A conditioned write refused because our copy was stale (409) or the object is already
    /// gone (404). Not a failure: the watch brings the fresh object, and the pass is redone.
    pub fn is_stale_write(&self) -> bool {
        use kube::runtime::finalizer::Error as F;
        match self {
            ReconcileError::Write {
                source: kube::Error::Api(e),
                ..
            } => e.code == 409 || e.code == 404,
            ReconcileError::Finalizer(inner) => match inner.as_ref() {
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.is_stale_write(),
                _ => false,
            },
            _ => false,
        }
    }

    /// For `Requeue` (also inside a finalizer error): when to look again, without backoff.
    pub fn requeue_after(&self) -> Option<Duration> {
        use kube::runtime::finalizer::Error as F;
        match self {
            ReconcileError::Requeue { after, .. } => Some(*after),
            ReconcileError::Finalizer(inner) => match inner.as_ref() {
                F::ApplyFailed(e) | F::CleanupFailed(e) => e.requeue_after(),
                _ => None,
            },
            _ => None,
        }
    }

    /// A short label for metrics: what kind of failure this was.
    pub fn category(&self) -> &'static str {
        match self {
            ReconcileError::Read { .. } => "read",
            ReconcileError::Write { .. } => "write",
            ReconcileError::Bmc { .. } => "bmc",
            ReconcileError::Invalid(_) => "invalid",
            ReconcileError::Drain(_) => "drain",
            ReconcileError::Finalizer(_) => "finalizer",
            ReconcileError::Requeue { .. } => "requeue",
        }
    }

    pub fn read(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| ReconcileError::Read { what, source }
    }
    pub fn write(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| ReconcileError::Write { what, source }
    }
}

/// Per-object exponential backoff for `error_policy` (kube-runtime has none built in): 2 s, 4 s,
/// … capped at 5 minutes, with ±20 % jitter so a rack of failing hosts does not retry in step.
#[derive(Default)]
pub struct Backoff {
    failures: per_object::PerObject<u32>,
}

impl Backoff {
    pub const BASE: Duration = Duration::from_secs(2);
    pub const MAX: Duration = Duration::from_secs(300);

    /// Delay before retrying `key` after another failure.
    pub fn next(&self, key: &str) -> Duration {
        let n = self
            .failures
            .update(key, |n| {
                *n = n.saturating_add(1);
                *n
            })
            .unwrap_or(1);
        let jitter = 0.8 + rand::random::<f64>() * 0.4;
        backoff_delay(n).mul_f64(jitter)
    }

    /// After a stale write: soon, once the watch has had time to deliver the fresh object.
    pub const STALE_RETRY: Duration = Duration::from_millis(500);

    /// What a controller's error policy does after a failed pass over `key` (a `kind`): a
    /// `Requeue` comes back when it asked; a stale write soon and quietly (at a thousand hosts
    /// these are routine, and backing them off only delays the fleet); anything else is a
    /// warning and exponential backoff.
    pub fn after_failure(
        &self,
        kind: &str,
        key: &str,
        error: &ReconcileError,
    ) -> kube::runtime::controller::Action {
        use kube::runtime::controller::Action;
        if let Some(after) = error.requeue_after() {
            return Action::requeue(after);
        }
        if error.is_stale_write() {
            tracing::debug!(kind, object = %key, %error, "stale write; redoing the pass");
            return Action::requeue(Self::STALE_RETRY);
        }
        let delay = self.next(key);
        tracing::warn!(kind, object = %key, error = %error, retry_in = ?delay, "reconcile failed");
        Action::requeue(delay)
    }

    /// `key` reconciled fine: its next failure starts from the base delay again.
    pub fn reset(&self, key: &str) {
        self.failures.remove(key);
    }

    /// Forgets the objects for which `keep` is false (they are gone).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.failures.retain(keep);
    }

    pub fn len(&self) -> usize {
        self.failures.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Delay after the `n`th consecutive failure, without jitter.
pub fn backoff_delay(n: u32) -> Duration {
    let exp = n.saturating_sub(1).min(16);
    Backoff::BASE.saturating_mul(1u32 << exp).min(Backoff::MAX)
}

/// What a reconcile pass ends with: the controller's next action, or why it failed.
pub type PassOutcome = Result<kube::runtime::controller::Action, ReconcileError>;

/// Runs one reconcile pass of `controller` over `object` in a span naming both, and records its
/// duration, error category and per-object pass count (what tests wait on).
///
/// The pass is boxed here, before any await: every layer that takes a future by value (this one,
/// a task-local scope, the runner's task) holds it inline and often twice, so an unboxed
/// MetalMachine pass of 13 KB made a 54 KB task, allocated for each of up to
/// [`CONCURRENT_PASSES`] running passes. Boxing here rather than at each call site means a new
/// caller cannot forget it; the `task_size` tests guard the result.
pub fn instrumented<'a, F>(
    controller: &'a str,
    object: String,
    pass: F,
) -> impl std::future::Future<Output = PassOutcome> + 'a
where
    F: std::future::Future<Output = PassOutcome> + 'a,
{
    use tracing::Instrument;
    let pass = Box::pin(pass);
    async move {
        let started = std::time::Instant::now();
        let span = tracing::info_span!("reconcile", controller, object = %object);
        let result = pass.instrument(span).await;
        crate::metrics::record_reconcile(
            controller,
            result.as_ref().err().map(|e| e.category()),
            started.elapsed(),
        );
        crate::metrics::record_pass(controller, &object);
        result
    }
}

/// How many passes one controller runs at once. Unbounded, a burst of 10,000 changes starts
/// 10,000 passes that each hold what they observed (a claiming MetalMachine: every host) and an
/// apiserver connection while they wait; bounded, the rest wait in the queue as object
/// references. Passes wait on the apiserver or a BMC (20 s per request at worst) far more than
/// they compute, so the bound is wide: a few slow BMCs, or a burst of Machines queued at 64,
/// held up a whole N=1000 run by up to a minute.
pub const CONCURRENT_PASSES: u16 = 256;

pub fn concurrency() -> kube::runtime::controller::Config {
    kube::runtime::controller::Config::default().concurrency(CONCURRENT_PASSES)
}

/// One timer for a whole kind instead of one per object: every `period / slices`, the objects
/// `pick` names in the next of `slices` slices of `store`, so each named object gets a pass once
/// per `period`, spread over it. kube-runtime's scheduler keeps about 700 bytes per object that
/// returned `requeue` (its reference twice, in a hash map and a timer wheel): 7 MB at 10,000.
/// The Machine resync and the MetalHost power poll run on it.
pub fn sliced_sweep<K>(
    store: Store<K>,
    period: Duration,
    slices: u64,
    pick: impl Fn(&[std::sync::Arc<K>], u64) -> Vec<ObjectRef<K>> + Send + Sync + 'static,
) -> impl futures::Stream<Item = ObjectRef<K>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    use futures::StreamExt;
    let slices = slices.max(1);
    let pick = std::sync::Arc::new(pick);
    let mut ticks = tokio::time::interval(period / u32::try_from(slices).unwrap_or(u32::MAX));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    futures::stream::unfold((ticks, 0u64), move |(mut ticks, slice)| {
        let (store, pick) = (store.clone(), pick.clone());
        async move {
            ticks.tick().await;
            let due = pick(&store.state(), slice);
            Some((futures::stream::iter(due), (ticks, (slice + 1) % slices)))
        }
    })
    .flatten()
}

/// `namespace/name` of an object, the key for backoff and logs.
pub fn key<K: Resource>(obj: &K) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

/// Writes `status` with server-side apply under the controller's own field manager (forced:
/// this controller is the only writer of these fields, and a conflict must not hot-loop).
/// Returns the written object's resourceVersion.
/// Whether applying `decided` would change the status an object shows (`shown`). An empty status
/// where there is none is no change: a pass that exits before deciding anything writes nothing.
/// Every controller asks this before its status apply.
pub fn status_changes<S: Default + PartialEq>(shown: Option<&S>, decided: &S) -> bool {
    match shown {
        Some(shown) => shown != decided,
        None => *decided != S::default(),
    }
}

pub async fn apply_status<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
) -> Result<Option<String>, ReconcileError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + std::fmt::Debug,
{
    apply_status_answer(api, name, manager, status)
        .await
        .map(|written| written.resource_version())
}

/// [`apply_status`], returning the apiserver's answer: the whole object as written.
pub async fn apply_status_answer<K, S>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    status: &S,
) -> Result<K, ReconcileError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + std::fmt::Debug,
{
    let patch = StatusApply {
        api_version: &K::api_version(&()),
        kind: &K::kind(&()),
        status,
    };
    api.patch_status(
        name,
        &PatchParams::apply(manager).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(ReconcileError::write(format!(
        "{} {name} status",
        K::kind(&())
    )))
}

/// The body of a status apply, serialized from the decided status where it lies: a JSON tree
/// of it (what `json!` built) was a second copy, held by each of up to 256 passes per
/// controller while their request waited for the apiserver bound.
#[derive(Serialize, Debug)]
#[serde(rename_all = "camelCase")]
struct StatusApply<'a, S> {
    api_version: &'a str,
    kind: &'a str,
    status: &'a S,
}

/// `patch`, applied only to the version it was decided from: a stale read is a 409 and a new
/// decision, never a lost write of another controller. Every cross-controller write uses it.
pub fn conditioned(
    mut patch: serde_json::Value,
    resource_version: Option<&str>,
) -> serde_json::Value {
    patch["metadata"]["resourceVersion"] = serde_json::json!(resource_version);
    patch
}

/// Patch parameters for a merge patch written under a controller's field manager.
pub fn merge_params(manager: &str) -> PatchParams {
    PatchParams {
        field_manager: Some(manager.to_string()),
        ..Default::default()
    }
}

/// Publishes Events for one controller; failures to publish are logged, never fatal.
#[derive(Clone)]
pub struct Events {
    recorder: events::EventRecorder,
}

impl Events {
    pub fn new(client: kube::Client, controller: &str) -> Self {
        Self {
            recorder: events::EventRecorder::new(client, controller),
        }
    }

    pub async fn publish<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        warning: bool,
        reason: &str,
        note: impl Into<String>,
    ) {
        let note: String = note.into();
        if let Err(e) = self
            .recorder
            .publish(
                obj,
                if warning {
                    kube::runtime::events::EventType::Warning
                } else {
                    kube::runtime::events::EventType::Normal
                },
                reason,
                reason,
                &note,
            )
            .await
        {
            tracing::warn!(reason, error = %e, "could not publish Event");
        }
    }
}

/// Cluster API pause: the object's own annotation or its Cluster's `spec.paused`.
pub fn is_paused<K: Resource>(obj: &K, cluster: Option<&crate::api::Cluster>) -> bool {
    obj.annotations().contains_key(PAUSED_ANNOTATION) || cluster.is_some_and(|c| c.paused())
}

/// Whether `obj` passes `--watch-filter`: no filter, or the label `cluster.x-k8s.io/watch-filter`
/// equal to it.
pub fn passes_watch_filter<K: Resource>(obj: &K, filter: Option<&str>) -> bool {
    match filter.filter(|f| !f.is_empty()) {
        None => true,
        Some(f) => {
            obj.labels()
                .get(crate::api::WATCH_FILTER_LABEL)
                .map(String::as_str)
                == Some(f)
        }
    }
}

/// The size of the future an async fn of two arguments returns (a reconcile's task).
#[cfg(test)]
pub(crate) fn future_size<A, B, F>(_: fn(A, B) -> F) -> usize {
    std::mem::size_of::<F>()
}

#[cfg(test)]
mod tests {
    /// The sweep goes round its slices in order and keeps going: over each period every object
    /// a slice holds is named once (here: the first eight names are the eight objects, and the
    /// next eight are the same again).
    #[tokio::test]
    async fn a_sliced_sweep_names_each_object_once_per_period_and_goes_on() {
        use futures::StreamExt;
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::reflector::{self, ObjectRef};
        use kube::runtime::watcher::Event;
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let names: Vec<String> = (0..8).map(|i| format!("c{i}")).collect();
        for name in &names {
            let mut map = ConfigMap::default();
            map.metadata.name = Some(name.clone());
            map.metadata.namespace = Some("ns".into());
            writer.apply_watcher_event(&Event::Apply(map));
        }
        let slice_of = |name: &str| name.trim_start_matches('c').parse::<u64>().unwrap_or(0) % 4;
        let sweep = super::sliced_sweep(
            store,
            std::time::Duration::from_millis(40),
            4,
            move |maps: &[std::sync::Arc<ConfigMap>], slice| {
                maps.iter()
                    .filter(|m| slice_of(&m.metadata.name.clone().unwrap_or_default()) == slice)
                    .map(|m| ObjectRef::from_obj(m.as_ref()))
                    .collect()
            },
        );
        let named: Vec<String> = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            sweep.map(|r| r.name).take(16).collect::<Vec<_>>(),
        )
        .await
        .unwrap_or_default();
        assert_eq!(named.len(), 16, "two periods named: {named:?}");
        let mut first: Vec<String> = named[..8].to_vec();
        first.sort();
        assert_eq!(first, names, "each object once in the first period");
        assert_eq!(named[..8], named[8..], "and the same again, in slice order");
        let slices: Vec<u64> = named[..8].iter().map(|n| slice_of(n)).collect();
        assert!(slices.is_sorted(), "slices in order: {slices:?}");
    }

    /// The apply body names the kind and carries the status as it serializes, nothing else.
    #[test]
    fn a_status_apply_is_the_kind_and_the_status() {
        let status = crate::api::metalmachine::MetalMachineStatus {
            ready: true,
            ..Default::default()
        };
        let body = super::StatusApply {
            api_version: "infrastructure.cluster.x-k8s.io/v1beta1",
            kind: "MetalMachine",
            status: &status,
        };
        let sent = serde_json::to_value(&body).ok();
        let expected = serde_json::to_value(&status).ok().map(|status| {
            serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                "kind": "MetalMachine",
                "status": status,
            })
        });
        assert!(sent.is_some());
        assert_eq!(sent, expected);
    }

    #[test]
    fn an_empty_status_where_there_is_none_is_no_change() {
        #[derive(Default, PartialEq)]
        struct S(Option<&'static str>);
        assert!(
            !status_changes(None, &S::default()),
            "nothing decided, nothing shown"
        );
        assert!(status_changes(None, &S(Some("Ready"))), "a first status");
        assert!(!status_changes(Some(&S(Some("Ready"))), &S(Some("Ready"))));
        assert!(
            status_changes(Some(&S(Some("Ready"))), &S::default()),
            "emptied"
        );
    }

    use super::*;

    /// A pass waits for every shared store's first list: until the last one lists, "not found"
    /// in any of them could be only "not listed yet".
    #[tokio::test]
    async fn passes_wait_until_every_shared_store_has_listed() {
        use futures::FutureExt;
        use kube::runtime::reflector::store::Writer;
        use kube::runtime::watcher::Event;
        fn list<K>(writer: &mut Writer<K>)
        where
            K: kube::runtime::reflector::Lookup + Clone,
            K::DynamicType: Eq + std::hash::Hash + Clone + Default,
        {
            writer.apply_watcher_event(&Event::Init);
            writer.apply_watcher_event(&Event::InitDone);
        }
        let (hosts, mut hosts_w) = kube::runtime::reflector::store();
        let (metal_machines, mut metal_machines_w) = kube::runtime::reflector::store();
        let (machines, mut machines_w) = kube::runtime::reflector::store();
        let (clusters, mut clusters_w) = kube::runtime::reflector::store();
        let (metal_clusters, mut metal_clusters_w) = kube::runtime::reflector::store();
        let (boot_secrets, mut boot_secrets_w) = kube::runtime::reflector::store();
        let stores = SharedStores {
            hosts,
            metal_machines,
            machines,
            clusters,
            metal_clusters,
            boot_secrets,
            host_index: crate::stores::Index::new(metalmachine::claim::host_index_keys),
            metal_machine_index: crate::stores::Index::new(metalmachine::waiting_index_keys),
        };
        let listed = || stores.until_listed().now_or_never().is_some();
        assert!(!listed(), "nothing listed");
        list(&mut hosts_w);
        list(&mut metal_machines_w);
        list(&mut machines_w);
        list(&mut clusters_w);
        list(&mut metal_clusters_w);
        assert!(!listed(), "the boot Secrets have not listed");
        list(&mut boot_secrets_w);
        assert!(listed(), "all six listed");
    }

    #[test]
    fn stale_writes_retry_soon_without_backoff_and_real_failures_back_off() {
        let api = |code: u16| {
            let status = serde_json::json!({"status": "Failure", "code": code});
            kube::Error::Api(Box::new(serde_json::from_value(status).expect("a Status")))
        };
        let write = |code| ReconcileError::write("Machine m finalizer".to_string())(api(code));
        let b = Backoff::default();
        for (error, stale) in [
            (write(409), true),
            (write(404), true),
            (write(422), false),
            (write(500), false),
            (ReconcileError::Invalid("bad".into()), false),
        ] {
            assert_eq!(error.is_stale_write(), stale, "{error}");
            let action = b.after_failure("Machine", "ns/m", &error);
            let quick = kube::runtime::controller::Action::requeue(Backoff::STALE_RETRY);
            assert_eq!(action == quick, stale, "{error}");
        }
        assert_eq!(b.len(), 1, "only real failures count towards the backoff");
    }

    #[test]
    fn backoff_doubles_then_caps() {
        let delays: Vec<u64> = (1..=10).map(|n| backoff_delay(n).as_secs()).collect();
        assert_eq!(delays, vec![2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff_delay(u32::MAX), Backoff::MAX);
    }

    #[test]
    fn backoff_forgets_objects_that_are_gone() {
        let backoff = Backoff::default();
        for key in ["ns/a", "ns/b", "ns/c"] {
            backoff.next(key);
        }
        backoff.retain(|k| k == "ns/b");
        assert_eq!(backoff.len(), 1);
        assert!(
            backoff.next("ns/b") > Backoff::BASE.mul_f64(1.3),
            "the live entry keeps counting"
        );
    }

    #[test]
    fn backoff_is_per_object_and_resets() {
        let b = Backoff::default();
        let first = b.next("ns/a");
        let _ = b.next("ns/a");
        let third = b.next("ns/a");
        assert!(third > first, "{third:?} > {first:?}");
        assert!(
            b.next("ns/b") <= Duration::from_millis(2400),
            "another object starts at the base"
        );
        b.reset("ns/a");
        assert!(b.next("ns/a") <= Duration::from_millis(2400));
    }
}

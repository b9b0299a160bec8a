//! The Machine controller for standalone mode (no upstream Cluster API): seeds 002/003. It is the
//! only writer of Machines. Each pass is observe → decide → act → one status write:
//!
//! - `observe.rs`: the Cluster (shared store), the bootstrap config and infrastructure machine,
//!   and the workload cluster's Node with the Machine's providerID.
//! - `decide.rs`: **what the controller does when X** — the phase rules (Pending → Provisioning →
//!   Provisioned → Running; Failed is terminal) and the one next write, table-tested.
//! - `act.rs`: that write (finalizer, cluster association, adoption, dataSecretName, providerID,
//!   Node labels and taint).
//! - `deletion.rs`: hooks → drain → hooks → infrastructure → bootstrap config → Node → finalizer.
//! - `workloads.rs`: one client and Node watch per workload cluster.
//!
//! Nothing polls (but a resync every 10 minutes, `resync_sweep`, as a safety net): the Machine
//! wakes on its own changes, its Cluster's (shared stream), its referenced objects' and its
//! Node's. A referenced MetalMachine or CloudInitConfig comes from the manager's shared store
//! of its kind (changes through its stream, deletions through
//! `Triggers::follow_deletions`); any other kind from a watch `Triggers` starts the first time
//! the kind is met.

pub mod act;
pub mod decide;
pub mod deletion;
pub mod observe;
pub mod workloads;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::core::{ApiResource, DeserializeGuard};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use workloads::WorkloadNode;

use crate::api::capi::MachineStatus;
use crate::api::{CloudInitConfig, Cluster, Machine, MetalMachine};
use crate::controllers::refs::ContractObject;

use super::{Backoff, Events, ReconcileError, apply_status, key, passes_watch_filter};
pub use workloads::Workloads;

pub const CONTROLLER: &str = "machine";
pub const FINALIZER: &str = "machine.cluster.x-k8s.io";
pub const FIELD_MANAGER: &str = "metalboot-machine";
/// How long the manager's Machines use a workload kubeconfig read before reading it again.
pub const KUBECONFIG_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);
const UNINITIALIZED_TAINT: &str = "node.cluster.x-k8s.io/uninitialized";
const PRE_DRAIN_HOOK: &str = "pre-drain.delete.hook.machine.cluster.x-k8s.io";
const PRE_TERMINATE_HOOK: &str = "pre-terminate.delete.hook.machine.cluster.x-k8s.io";
const EXCLUDE_DRAIN_ANNOTATION: &str = "machine.cluster.x-k8s.io/exclude-node-draining";
/// Set once the drain is over (done, skipped or timed out), so deletion does not drain twice.
const DRAINED: &str = "DrainingSucceeded";
/// A safety net for a missed event; progress comes from watches, not from this. Every Machine
/// not Failed gets a pass this often, from [`resync_sweep`].
const RESYNC: Duration = Duration::from_secs(600);
/// The resync runs in this many slices of `RESYNC`, one Machine in `RESYNC_SLICES` per slice.
const RESYNC_SLICES: u64 = 600;

/// What wakes Machines besides their own watch: referenced objects of kinds met at run time, and
/// workload-cluster Nodes matched by providerID.
pub struct Triggers {
    tx: mpsc::UnboundedSender<ObjectRef<Machine>>,
    kinds: Mutex<HashMap<(String, String), WatchedKind>>,
    by_provider_id: Mutex<HashMap<String, ObjectRef<Machine>>>,
}

/// A kind watched on demand: the watch's task, and the store it keeps, which serves the
/// referenced objects of that kind instead of a GET per pass.
struct WatchedKind {
    task: JoinHandle<()>,
    store: Store<ContractObject>,
    resource: ApiResource,
}

impl Triggers {
    pub fn new() -> (
        Arc<Self>,
        impl futures::Stream<Item = ObjectRef<Machine>> + Send + 'static,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
        let triggers = Arc::new(Self {
            tx,
            kinds: Mutex::default(),
            by_provider_id: Mutex::default(),
        });
        (triggers, stream)
    }

    /// Starts watching a referenced kind once (kinds the controller owns are watched already).
    pub fn watch_kind(&self, client: &kube::Client, ar: &ApiResource, namespace: Option<&str>) {
        let Ok(mut kinds) = self.kinds.lock() else {
            return;
        };
        let key = (ar.group.clone(), ar.kind.clone());
        if kinds.get(&key).is_some_and(|k| !k.task.is_finished()) {
            return;
        }
        let api: Api<ContractObject> = match namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
            None => Api::all_with(client.clone(), ar),
        };
        let tx = self.tx.clone();
        tracing::info!(kind = %ar.kind, group = %ar.group, "watching a referenced kind");
        let writer = kube::runtime::reflector::store::Writer::new(ar.clone());
        let store = writer.as_reader();
        let reader = store.clone();
        let task = tokio::spawn(async move {
            let wake = |obj: &ContractObject| {
                for owner in owning_machines(obj) {
                    let _ = tx.send(owner);
                }
            };
            // A Machine is woken only once the store shows what woke it: the reflector applies
            // each event before passing it on, but a re-list's objects reach the store only at
            // its end (InitDone), so those wake their Machines then, from the store.
            let events = kube::runtime::reflector(
                writer,
                crate::stores::lean(watcher(api, watcher::Config::default()))
                    .modify(crate::controllers::refs::keep_contract_fields)
                    .default_backoff(),
            );
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                match event {
                    Ok(watcher::Event::Apply(obj) | watcher::Event::Delete(obj)) => wake(&obj),
                    Ok(watcher::Event::InitDone) => {
                        for obj in reader.state() {
                            wake(&obj);
                        }
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitApply(_)) | Err(_) => {}
                }
            }
        });
        kinds.insert(
            key,
            WatchedKind {
                task,
                store,
                resource: ar.clone(),
            },
        );
    }

    /// Wakes the Machines owning each object `shared` deletes. A shared store's change stream
    /// sends no deletions, and a Machine waits for its infrastructure and bootstrap config to
    /// go when it is deleted (or reports one missing): without this, only its requeue (2 s)
    /// or the resync would tell it. Subscribe before the store runs.
    pub fn follow_deletions<K: crate::stores::Watched>(
        &self,
        shared: &crate::stores::SharedStore<K>,
    ) {
        let tx = self.tx.clone();
        let mut departures = shared.subscribe_departures(|obj: &K| owning_machines::<Machine>(obj));
        tokio::spawn(async move {
            while let Some(departure) = departures.next().await {
                if let crate::stores::Departure::Deleted(owners) = departure {
                    for owner in owners {
                        if tx.send(owner).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    }

    /// A referenced object from the watch of its kind, if that watch has listed and holds it,
    /// with only its metadata and contract fields (`refs::keep_contract_fields`). None otherwise
    /// (not watched yet, not listed yet, or absent): the caller then reads it.
    pub fn cached(
        &self,
        group: &str,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Option<ContractObject> {
        let kinds = self.kinds.lock().ok()?;
        let watched = kinds.get(&(group.to_string(), kind.to_string()))?;
        futures::FutureExt::now_or_never(watched.store.wait_until_ready())?.ok()?;
        watched
            .store
            .get(&ObjectRef::new_with(name, watched.resource.clone()).within(namespace))
            .map(|obj| obj.as_ref().clone())
    }

    /// Kinds watched on demand (tests check this stays one per kind).
    pub fn watched_kinds(&self) -> usize {
        self.kinds.lock().map(|k| k.len()).unwrap_or(0)
    }

    pub fn provider_id(&self, provider_id: &str, machine: ObjectRef<Machine>) {
        if let Ok(mut ids) = self.by_provider_id.lock() {
            ids.insert(provider_id.to_string(), machine);
        }
    }

    pub fn node_changed(&self, node: &WorkloadNode) {
        let Some(id) = node.spec.as_ref().and_then(|s| s.provider_id.as_deref()) else {
            return;
        };
        if let Ok(ids) = self.by_provider_id.lock()
            && let Some(machine) = ids.get(id)
        {
            let _ = self.tx.send(machine.clone());
        }
    }

    /// Drops what was kept for a Machine that is gone.
    pub fn forget_machine(&self, m: &Machine) {
        let Ok(mut ids) = self.by_provider_id.lock() else {
            return;
        };
        match &m.spec.provider_id {
            Some(id) => {
                ids.remove(id);
            }
            // Deleted before its providerID was copied: the infrastructure's may have been
            // looked for already. Rare, so the scan is affordable here.
            None => {
                let machine = ObjectRef::from_obj(m);
                ids.retain(|_, r| *r != machine);
            }
        }
    }

    pub fn tracked_provider_ids(&self) -> usize {
        self.by_provider_id.lock().map(|m| m.len()).unwrap_or(0)
    }
}

impl Drop for Triggers {
    fn drop(&mut self) {
        if let Ok(kinds) = self.kinds.lock() {
            for kind in kinds.values() {
                kind.task.abort();
            }
        }
    }
}

pub struct MachineContext {
    pub client: kube::Client,
    pub events: Events,
    pub backoff: Backoff,
    pub workloads: Arc<Workloads>,
    pub watch_filter: Option<String>,
    pub clusters: Store<DeserializeGuard<Cluster>>,
    pub triggers: Arc<Triggers>,
    /// The namespace the manager watches (None: all), for the watches started on demand.
    pub namespace: Option<String>,
    /// Read-your-writes: a pass never decides from a Machine older than its own last write
    /// (a referenced object's watch can wake it before the Machine's own watch catches up).
    pub expectations: super::expectations::Expectations,
    /// The manager's shared MetalMachine store: a Machine's MetalMachine is read from it instead
    /// of a GET per pass. The controller is woken by that same shared stream (see
    /// `controller`), so a pass never sees an older MetalMachine than the change that woke it.
    pub metal_machines: Option<kube::runtime::reflector::Store<MetalMachine>>,
    /// The bootstrap controller's CloudInitConfig store, when it runs in this manager: read
    /// the same way (one copy of each config, and no watch of its own).
    pub cloud_init_configs: Option<kube::runtime::reflector::Store<CloudInitConfig>>,
}

impl MachineContext {
    /// A referenced object from the manager's own stores, as its contract fields: a MetalMachine
    /// from the shared typed store, another kind from its own watch. None when it is not cached
    /// (not seen yet): the caller then reads it.
    pub fn cached_reference(
        &self,
        r: &crate::api::common::ContractVersionedObjectReference,
        namespace: &str,
    ) -> Option<ContractObject> {
        use kube::runtime::reflector::ObjectRef;
        match self.shared_store_of(&r.api_group, &r.kind) {
            Some(Shared::MetalMachines(store)) => store
                .get(&ObjectRef::new(&r.name).within(namespace))
                .map(|mm| ContractObject::of_metal_machine(&mm)),
            Some(Shared::CloudInitConfigs(store)) => store
                .get(&ObjectRef::new(&r.name).within(namespace))
                .map(|cfg| ContractObject::of_cloud_init_config(&cfg)),
            None => self
                .triggers
                .cached(&r.api_group, &r.kind, namespace, &r.name),
        }
    }

    /// Whether a referenced kind comes from one of the manager's shared stores (whose streams
    /// wake Machines, see `controller`) rather than from a watch `Triggers` starts for it.
    pub fn has_shared_store(&self, group: &str, kind: &str) -> bool {
        self.shared_store_of(group, kind).is_some()
    }

    fn shared_store_of(&self, group: &str, kind: &str) -> Option<Shared<'_>> {
        if group == MetalMachine::group(&()) && kind == MetalMachine::kind(&()) {
            return self.metal_machines.as_ref().map(Shared::MetalMachines);
        }
        if group == CloudInitConfig::group(&()) && kind == CloudInitConfig::kind(&()) {
            return self
                .cloud_init_configs
                .as_ref()
                .map(Shared::CloudInitConfigs);
        }
        None
    }
}

/// A shared typed store that serves one referenced kind.
enum Shared<'a> {
    MetalMachines(&'a Store<MetalMachine>),
    CloudInitConfigs(&'a Store<CloudInitConfig>),
}

fn machine_key(m: &Machine) -> String {
    super::expectations::object_key("Machine", &m.namespace().unwrap_or_default(), &m.name_any())
}

/// Writes status with server-side apply when it changed; the phase's lastUpdated moves with it.
/// Returns the Machine's resourceVersion after the write (the one read when nothing changed).
async fn write_status(
    ctx: &MachineContext,
    m: &Machine,
    status: MachineStatus,
) -> Result<Option<String>, ReconcileError> {
    write_status_at(ctx, m, status, m.metadata.generation).await
}

/// [`write_status`] for the generation the pass's own spec write produced: the status decided
/// for that write is current for it, and stamped with it, so the next pass has nothing to write
/// just to move observedGeneration.
async fn write_status_at(
    ctx: &MachineContext,
    m: &Machine,
    mut status: MachineStatus,
    generation: Option<i64>,
) -> Result<Option<String>, ReconcileError> {
    let previous = m.status.clone().unwrap_or_default();
    if status.phase != previous.phase {
        status.last_updated = Some(super::conditions::now());
    }
    if generation != m.metadata.generation {
        for c in &mut status.conditions {
            if c.observed_generation == m.metadata.generation {
                c.observed_generation = generation;
            }
        }
    }
    status.observed_generation = generation;
    // Upstream fields we keep but do not own are not re-applied.
    status.extra.clear();
    if status
        == (MachineStatus {
            extra: Default::default(),
            ..previous
        })
    {
        return Ok(m.resource_version());
    }
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
    let written = apply_status(&api, &m.name_any(), FIELD_MANAGER, &status).await?;
    ctx.expectations
        .wrote(machine_key(m), m.resource_version(), written.clone());
    Ok(written)
}

async fn reconcile(
    guarded: Arc<DeserializeGuard<Machine>>,
    ctx: Arc<MachineContext>,
) -> Result<Action, ReconcileError> {
    // The filter reads labels, which an unparseable Machine has too: others' Machines stay silent.
    if !passes_watch_filter(guarded.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    let m = match &guarded.0 {
        Ok(m) => Arc::new(m.clone()),
        // Not ours to fix or write to: a Machine that does not parse (a permissive CRD, a newer
        // upstream shape) waits for its next change.
        Err(invalid) => {
            tracing::warn!(
                machine = %ObjectRef::from_obj(guarded.as_ref()),
                error = %invalid.error.chars().take(300).collect::<String>(),
                "Machine does not parse; left alone until it changes"
            );
            return Ok(Action::await_change());
        }
    };
    let object = key(m.as_ref());
    // Only listed stores can say "not found" (see `SharedStores::until_listed`).
    crate::stores::until_ready(&ctx.clusters).await;
    if let Some(metal_machines) = &ctx.metal_machines {
        crate::stores::until_ready(metal_machines).await;
    }
    super::instrumented(CONTROLLER, object, pass(m, &ctx)).await
}

/// One pass: deletion is its own pipeline; otherwise observe → decide → act → status.
async fn pass(m: Arc<Machine>, ctx: &MachineContext) -> Result<Action, ReconcileError> {
    let machines: Api<Machine> =
        Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
    if !super::expectations::store_reflects(
        &ctx.expectations,
        &machines,
        &machine_key(&m),
        &m.name_any(),
        m.resource_version().as_deref(),
    )
    .await
    {
        return Ok(Action::requeue(Duration::from_millis(250)));
    }
    // The two pipelines boxed apart, so a pass holds only the one it runs: inline, every pass
    // was as large as both (12.7 KB, up to `CONCURRENT_PASSES` at once). Their stages stay
    // inline: boxed too, a deletion pass was larger than before (each box is a frame of its
    // own, where one frame lays its stages over each other).
    if m.meta().deletion_timestamp.is_some() {
        return Box::pin(deletion::delete(m, ctx)).await;
    }
    Box::pin(provision(m, ctx)).await
}

/// Observe → decide → act → status, for a Machine not being deleted.
async fn provision(m: Arc<Machine>, ctx: &MachineContext) -> Result<Action, ReconcileError> {
    let observation = observe::observe(ctx, m.clone()).await?;
    let decision = decide::decide(&observation.observed);
    tracing::debug!(step = ?decision.step, phase = ?decision.status.phase, "decided");
    let generation = act::act(ctx, &observation, &decision.step)
        .await?
        .or(m.metadata.generation);
    write_status_at(ctx, &m, decision.status.clone(), generation).await?;
    if let Some((warning, reason, message)) = decision.event {
        ctx.events
            .publish(m.as_ref(), warning, &reason, message)
            .await;
    }
    ctx.backoff.reset(&key(m.as_ref()));
    Ok(match (&decision.step, decision.requeue) {
        (_, Some(after)) => Action::requeue(after),
        // A write was made: its watch event usually comes first; this is the fallback.
        (step, None) if *step != decide::Step::Nothing => {
            Action::requeue(Duration::from_millis(500))
        }
        // Settled (or Failed): the next pass comes from a watch event or the resync sweep.
        _ => Action::await_change(),
    })
}

/// The resync, as one timer instead of one per Machine ([`super::sliced_sweep`]): every
/// `RESYNC / RESYNC_SLICES`, the Machines of the next slice (by a hash of their names), so each
/// Machine not Failed gets a pass every `RESYNC`, spread over it as per-object timers spread
/// them. A settled Machine returned `requeue(RESYNC)` before.
fn resync_sweep(
    store: Store<DeserializeGuard<Machine>>,
) -> impl futures::Stream<Item = ObjectRef<DeserializeGuard<Machine>>> + Send + 'static {
    super::sliced_sweep(store, RESYNC, RESYNC_SLICES, in_resync_slice)
}

/// The Machines of `machines` whose resync falls in `slice`: each Machine not Failed is in
/// exactly one of the `RESYNC_SLICES` slices. A Machine that does not read has no pass to
/// resync (its error was reported when it was read).
fn in_resync_slice(
    machines: &[Arc<DeserializeGuard<Machine>>],
    slice: u64,
) -> Vec<ObjectRef<DeserializeGuard<Machine>>> {
    machines
        .iter()
        .filter(|guarded| {
            guarded.0.as_ref().is_ok_and(|m| {
                m.status.as_ref().and_then(|s| s.phase.as_deref()) != Some("Failed")
                    && resync_slice(m.namespace().as_deref(), &m.name_any()) == slice
            })
        })
        .map(|guarded| ObjectRef::from_obj(guarded.as_ref()))
        .collect()
}

/// The slice of a Machine's resync: stable for its name, so its passes stay `RESYNC` apart.
fn resync_slice(namespace: Option<&str>, name: &str) -> u64 {
    crate::stable_hash::stable_hash(&(namespace, name)) % RESYNC_SLICES
}

fn error_policy(
    m: Arc<DeserializeGuard<Machine>>,
    error: &ReconcileError,
    ctx: Arc<MachineContext>,
) -> Action {
    ctx.backoff
        .after_failure("Machine", &key(m.as_ref()), error)
}

/// The Machines a referenced object names as its owners (as `M`: a Machine, or the guarded
/// Machine the controller runs on).
fn owning_machines<M: Resource<DynamicType = ()>>(obj: &impl Resource) -> Vec<ObjectRef<M>> {
    let namespace = obj.meta().namespace.clone().unwrap_or_default();
    obj.meta()
        .owner_references
        .iter()
        .flatten()
        .filter(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
        .map(|o| ObjectRef::new(&o.name).within(&namespace))
        .collect()
}

/// Watches Machines (the manager's shared stream and store: one copy of each Machine for every
/// controller), the kinds they own that metalboot serves, their Clusters (shared stream) and
/// whatever `Triggers` reports.
pub fn controller(
    machines: crate::stores::Changes<DeserializeGuard<Machine>>,
    store: Store<DeserializeGuard<Machine>>,
    clusters: crate::stores::Changes<DeserializeGuard<Cluster>>,
    metal_machines: crate::stores::Changes<MetalMachine>,
    cloud_init_configs: Option<crate::stores::Changes<CloudInitConfig>>,
    triggers: impl futures::Stream<Item = ObjectRef<Machine>> + Send + 'static,
) -> Controller<DeserializeGuard<Machine>> {
    let by_cluster = store.clone();
    let resync = resync_sweep(store.clone());
    let controller = Controller::for_shared_stream(machines, store);
    // Like MetalMachines: the shared stream wakes the Machine once the store shows the change.
    let controller = match cloud_init_configs {
        Some(configs) => controller.watches_shared_stream(configs, |cfg| owning_machines(&*cfg)),
        None => controller,
    };
    controller
        // The shared stream, not a watch of its own: the store `observe` reads is updated
        // before this wakes the Machine.
        .watches_shared_stream(metal_machines, |mm| owning_machines(&*mm))
        .watches_shared_stream(clusters, move |cluster| {
            let namespace = cluster.meta().namespace.clone();
            let name = cluster.meta().name.clone().unwrap_or_default();
            by_cluster
                .state()
                .into_iter()
                .filter(|guarded| {
                    guarded
                        .0
                        .as_ref()
                        .is_ok_and(|m| m.namespace() == namespace && m.spec.cluster_name == name)
                })
                .map(|guarded| ObjectRef::from_obj(guarded.as_ref()))
                .collect::<Vec<_>>()
        })
        .reconcile_on(futures::stream::select(
            triggers.map(|machine| machine.into_kind_unchecked(())),
            resync,
        ))
}

pub async fn run(controller: Controller<DeserializeGuard<Machine>>, ctx: Arc<MachineContext>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

#[cfg(test)]
mod task_size {
    /// Each running pass is a task of this size, up to CONCURRENT_PASSES of them; the pass
    /// itself is boxed (see `instrumented`). Unboxed, this task was 25,096 bytes.
    #[test]
    fn a_machine_pass_task_holds_its_pass_boxed() {
        let size = crate::controllers::future_size(super::reconcile as fn(_, _) -> _);
        assert!(size <= 2048, "the Machine reconcile future is {size} bytes");
    }

    /// The boxed pass itself, up to CONCURRENT_PASSES of them at once: its two pipelines
    /// (provisioning, deletion) boxed apart, so a pass carries the one it runs. With both
    /// inline, it was 12,656 bytes.
    #[test]
    fn a_machine_pass_boxes_its_pipelines() {
        let size = crate::controllers::future_size(super::pass as fn(_, _) -> _);
        assert!(size <= 3072, "the Machine pass future is {size} bytes");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::CloudInitConfig;
    use crate::stores::SharedStore;

    /// Over one `RESYNC`, the sweep names each Machine that reads and is not Failed exactly
    /// once, and no other: the safety net a per-Machine `requeue(RESYNC)` gave.
    #[test]
    fn the_resync_sweep_names_each_machine_once_per_resync() {
        let machine = |namespace: &str, name: &str, phase: &str| {
            let guarded: DeserializeGuard<Machine> = serde_json::from_value(serde_json::json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "Machine",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"clusterName": "c", "bootstrap": {},
                    "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                        "kind": "MetalMachine", "name": name}},
                "status": {"phase": phase},
            }))
            .expect("a Machine");
            assert!(guarded.0.is_ok(), "{name} reads");
            Arc::new(guarded)
        };
        let unreadable: DeserializeGuard<Machine> = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2",
            "kind": "Machine",
            "metadata": {"name": "odd", "namespace": "a"},
            "spec": "not an object",
        }))
        .expect("a guarded Machine");
        assert!(unreadable.0.is_err());
        let mut machines: Vec<_> = (0..2000)
            .map(|i| {
                machine(
                    if i % 2 == 0 { "a" } else { "b" },
                    &format!("m{i}"),
                    "Running",
                )
            })
            .collect();
        machines.push(machine("a", "failed", "Failed"));
        machines.push(Arc::new(unreadable));
        let mut named: HashMap<String, usize> = HashMap::new();
        let mut busiest = 0;
        for slice in 0..RESYNC_SLICES {
            let due = in_resync_slice(&machines, slice);
            busiest = busiest.max(due.len());
            for reference in due {
                *named.entry(reference.to_string()).or_default() += 1;
            }
        }
        assert_eq!(
            named.len(),
            2000,
            "every Running Machine, and neither the Failed nor the odd one"
        );
        assert!(named.values().all(|n| *n == 1), "each once");
        assert!(
            !named
                .keys()
                .any(|k| k.contains("failed") || k.contains("odd"))
        );
        // Spread, not bunched: 2,000 over 600 slices is 3.3 a slice on average.
        assert!(busiest <= 20, "a slice named {busiest} Machines");
    }

    /// A shared store's change stream sends no deletions: the owning Machine still wakes when
    /// its CloudInitConfig (or MetalMachine) is deleted, and only then.
    #[tokio::test]
    async fn a_deleted_config_wakes_the_machine_that_owns_it() {
        let (triggers, wake) = Triggers::new();
        let shared = SharedStore::<CloudInitConfig>::new();
        triggers.follow_deletions(&shared);
        let config = |name: &str, machine: &str| -> CloudInitConfig {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1",
                "kind": "CloudInitConfig",
                "metadata": {"name": name, "namespace": "ns", "resourceVersion": "3",
                    "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2",
                        "kind": "Machine", "name": machine, "uid": "u", "controller": true}]},
                "spec": {},
            }))
            .expect("a CloudInitConfig")
        };
        // m1's config is listed and changed, never deleted; m2's is deleted.
        let events: Vec<Result<watcher::Event<CloudInitConfig>, watcher::Error>> = vec![
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(config("c1", "m1"))),
            Ok(watcher::Event::InitDone),
            Ok(watcher::Event::Apply(config("c1", "m1"))),
            Ok(watcher::Event::Apply(config("c2", "m2"))),
            Ok(watcher::Event::Delete(config("c2", "m2"))),
        ];
        shared.run_on(futures::stream::iter(events));
        futures::pin_mut!(wake);
        let woken = tokio::time::timeout(Duration::from_secs(10), wake.next())
            .await
            .expect("a wake-up within 10 s");
        assert_eq!(
            woken,
            Some(ObjectRef::new("m2").within("ns")),
            "the first wake-up is the deletion's (changes come through the change stream)"
        );
    }
}

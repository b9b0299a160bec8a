//! MetalMachine controller: the Cluster API infrastructure-machine contract for bare metal.
//!
//! Where to look:
//! - [`decide`]: what the controller decides for every situation (seed 004's gates in order,
//!   the boot attempts, deletion) — pure, table-tested, no server.
//! - [`observe`]: what it reads (shared stores; the BMC only while deprovisioning).
//! - [`act`]: the one side effect of a pass (a BMC call, or one write with a precondition).
//! - [`claim`]: which host a machine has or may claim.
//!
//! A pass is observe → decide → act → one status write (server-side apply, only when changed).
//! After each write the controller waits until its stores show that write before deciding
//! again (see `expectations`), so a lagging cache can never make it boot a host twice.

pub mod act;
pub mod claim;
pub mod decide;
pub mod observe;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::Api;
use kube::core::SelectorExt;
use kube::runtime::Controller;
use kube::runtime::controller::Action;
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};

use crate::api::common::MachineAddress;
use crate::api::metalmachine::MetalMachineStatus;
use crate::api::{MetalHost, MetalMachine};
use crate::boot::http::{CallbackNotice, Recorded};
use crate::boot::tokens::BootRecord;
use crate::kubeconn::gate::Priority;
use crate::stable_hash::stable_hash;

use super::conditions::{self, Want};
use super::expectations::{Expectations, object_key};
use super::hostbmc::BmcConnector;
use super::per_object::PerObject;
use super::power::PowerRequests;
use super::{Backoff, Events, ReconcileError, SharedStores, Subscriptions, passes_watch_filter};
use act::ActError;
use decide::{Decision, Policy};
use observe::{BootObservation, Observation, Observed};

pub use decide::provider_id;

pub const FINALIZER: &str = "metalmachine.infrastructure.cluster.x-k8s.io";
pub const FIELD_MANAGER: &str = "metalboot-metalmachine";
pub const CONTROLLER: &str = "metalmachine";
pub const READY: &str = "Ready";
pub const HOST_ASSOCIATED: &str = "HostAssociated";
pub const BOOT_READY: &str = "BootReady";
pub const PAUSED: &str = "Paused";
/// The callback's addresses, kept in metadata (which `clusterctl move` keeps) so status can be
/// rebuilt after a move.
pub const ADDRESSES_ANNOTATION: &str = "metalboot.io/addresses";
/// Set on a MetalHost released while its BMC could not power it off: the MetalHost controller
/// shows it as Error until an operator removes the annotation.
pub const DEPROVISION_FAILED_ANNOTATION: &str = "metalboot.io/deprovision-failed";

/// The Machine that owns `mm` (the Cluster API Machine controller sets this owner reference).
pub fn machine_owner(mm: &MetalMachine) -> Option<&OwnerReference> {
    mm.owner_references()
        .iter()
        .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
}

/// The addresses recorded at provisioning (see [`ADDRESSES_ANNOTATION`]).
pub fn recorded_addresses(mm: &MetalMachine) -> Option<Vec<MachineAddress>> {
    mm.annotations()
        .get(ADDRESSES_ANNOTATION)
        .and_then(|a| serde_json::from_str(a).ok())
}

/// Boot Secrets as the answers to the boot service's writes returned them (a host's callback,
/// a deploy report), per MetalMachine, until the machine's next pass looks. That pass decides
/// from the answer only when the store still shows exactly the version the write replaced, so
/// a callback is acted on without waiting for the Secret watch, which lags by seconds under load.
#[derive(Clone, Default)]
pub struct FreshSecrets(Arc<Mutex<HashMap<String, Recorded>>>);

/// Notices of machines whose pass never came (deleted) are dropped past this many.
const FRESH_SECRETS_MAX: usize = 4096;

impl FreshSecrets {
    /// Keeps the write a notice carries, for its machine's next pass.
    pub fn offer(&self, notice: &CallbackNotice) {
        let Some(recorded) = &notice.recorded else {
            return;
        };
        if let Ok(mut fresh) = self.0.lock() {
            if fresh.len() >= FRESH_SECRETS_MAX {
                fresh.clear();
            }
            fresh.insert(
                object_key("MetalMachine", &notice.namespace, &notice.metal_machine),
                recorded.clone(),
            );
        }
    }

    /// The write kept for `machine_key`, once.
    pub fn take(&self, machine_key: &str) -> Option<Recorded> {
        self.0.lock().ok()?.remove(machine_key)
    }
}

/// Keeps the answer to this controller's write of a MetalMachine (its status, finalizers or
/// providerID) with the write's expectation, without its managedFields as the stores keep them.
/// A pass right after a write (a host calling back moments after its power-on pass wrote the
/// status) decided nothing until the watch brought that write back: at N=1000 about one callback
/// in two waited so, 50 ms at a time. While the store shows a version the write replaced, the
/// answer is the apiserver's copy and as new as anything this controller knows
/// ([`Expectations::ahead_of_store`]).
pub fn keep_answer(ctx: &MachineContext, mut written: MetalMachine) {
    written.metadata.managed_fields = None;
    let key = object_key(
        "MetalMachine",
        written.metadata.namespace.as_deref().unwrap_or_default(),
        &written.name_any(),
    );
    let version = written.metadata.resource_version.clone();
    ctx.expectations.answered(&key, version.as_deref(), written);
}

pub struct MachineContext {
    pub client: kube::Client,
    pub connector: Arc<dyn BmcConnector>,
    pub stores: SharedStores,
    pub events: Events,
    pub backoff: Backoff,
    pub policy: Policy,
    pub watch_filter: Option<String>,
    pub power_requests: PowerRequests,
    /// The power-on (or cycle) last sent for each machine, and when: a BMC applies it
    /// asynchronously, so deprovisioning does not trust an Off read until it had time to land.
    pub power_ons: PowerRequests,
    /// Power actions sent whose note on the boot Secret is not written yet (see
    /// [`decide::UnrecordedPower`]).
    pub unrecorded_power: PerObject<decide::UnrecordedPower>,
    /// Writes the stores have not shown yet, with the answers to this controller's MetalMachine
    /// writes (a pass decides from those instead of waiting for the watch).
    pub expectations: Expectations<MetalMachine>,
    pub fresh_secrets: FreshSecrets,
    /// One pass per machine at a time, between the controller and the callback lane.
    pub pass_locks: PassLocks,
    /// Callback-lane passes running now (see [`callback_lane`]).
    pub lane: CallbackLane,
    /// Hosts whose claim is on its way to the apiserver (see [`ClaimsInFlight`]).
    pub claims_in_flight: ClaimsInFlight,
}

/// The hosts this process is claiming right now, by `namespace/name`: sent, not yet answered.
/// Machines choosing a free host meanwhile skip them (their claim would be refused 409); once
/// answered, the expectations of the write take over until the store shows it.
#[derive(Default)]
pub struct ClaimsInFlight(Mutex<HashSet<String>>);

impl ClaimsInFlight {
    /// Marks `host` as being claimed until the returned guard is dropped (answer or not).
    pub fn claiming(&self, namespace: &str, host: &str) -> ClaimGuard<'_> {
        let key = format!("{namespace}/{host}");
        if let Ok(mut set) = self.0.lock() {
            set.insert(key.clone());
        }
        ClaimGuard { claims: self, key }
    }

    /// The claims in flight now, in `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> HashSet<String> {
        let prefix = format!("{namespace}/");
        self.0
            .lock()
            .map(|set| {
                set.iter()
                    .filter_map(|k| k.strip_prefix(&prefix).map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A claim in flight; dropping it (answered, failed or cancelled) ends it.
pub struct ClaimGuard<'a> {
    claims: &'a ClaimsInFlight,
    key: String,
}

impl Drop for ClaimGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut set) = self.claims.0.lock() {
            set.remove(&self.key);
        }
    }
}

/// Serializes the passes over one MetalMachine between the controller and the callback lane
/// (the controller alone never runs two at once). One lock per machine while a pass holds or
/// awaits it, forgotten after: striped locks made a quarter of the callbacks at N=1000 wait for
/// another machine's pass.
#[derive(Default)]
pub struct PassLocks(Mutex<HashMap<String, Arc<Turns>>>);

/// One machine's lock, and what a callback waiting for it raises.
#[derive(Default)]
pub struct Turns {
    lock: Arc<tokio::sync::Mutex<()>>,
    /// The priority of the pass holding the lock now.
    holder: Mutex<Priority>,
    /// Callback passes waiting for the lock: every pass that takes it meanwhile is raised too.
    callbacks_waiting: std::sync::atomic::AtomicUsize,
}

/// A callback's pass counted as waiting for a turn, until it has the turn or is dropped while it
/// waits (the lane stopping): the count never outlives the wait.
struct CallbackWaiting(Arc<Turns>);

impl CallbackWaiting {
    fn new(turns: &Arc<Turns>) -> Self {
        turns
            .callbacks_waiting
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if let Ok(holder) = turns.holder.lock() {
            holder.raise();
        }
        Self(turns.clone())
    }
}

impl Drop for CallbackWaiting {
    fn drop(&mut self) {
        self.0
            .callbacks_waiting
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A machine's turn; the lock is forgotten when no other pass awaits it.
pub struct PassTurn<'a> {
    locks: &'a PassLocks,
    key: String,
    turns: Option<Arc<Turns>>,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    priority: Priority,
}

impl PassTurn<'_> {
    /// The priority of this pass's apiserver requests (see `kubeconn::gate::with_priority`).
    pub fn priority(&self) -> Priority {
        self.priority.clone()
    }
}

impl PassLocks {
    /// The machine's turn. `for_callback`: a host's callback waits on this pass, so the pass
    /// holding the turn now, and any taking it before this one, skip the apiserver queue.
    pub async fn lock(&self, machine_key: &str, for_callback: bool) -> PassTurn<'_> {
        use std::sync::atomic::Ordering;
        let turns = match self.0.lock() {
            Ok(mut locks) => locks.entry(machine_key.to_string()).or_default().clone(),
            // A poisoned map: serialize nothing rather than stop every pass.
            Err(_) => Arc::default(),
        };
        let waiting = for_callback.then(|| CallbackWaiting::new(&turns));
        let guard = turns.lock.clone().lock_owned().await;
        drop(waiting);
        // Read and set under the holder's lock: a callback that starts waiting meanwhile either
        // is counted here or raises the priority set here (it counts itself, then takes this
        // lock to raise the holder).
        let priority = Priority::default();
        match turns.holder.lock() {
            Ok(mut holder) => {
                if for_callback || turns.callbacks_waiting.load(Ordering::SeqCst) > 0 {
                    priority.raise();
                }
                *holder = priority.clone();
            }
            Err(_) => priority.raise(),
        }
        PassTurn {
            locks: self,
            key: machine_key.to_string(),
            turns: Some(turns),
            guard: Some(guard),
            priority,
        }
    }

    /// Machines with a pass holding or awaiting their lock.
    pub fn len(&self) -> usize {
        self.0.lock().map(|l| l.len()).unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for PassTurn<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        drop(self.turns.take());
        if let Ok(mut locks) = self.locks.0.lock()
            && locks
                .get(&self.key)
                .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            locks.remove(&self.key);
        }
    }
}

/// The callback lane's bound and stop: past `CALLBACK_LANE_PASSES` passes at once a callback
/// waits for the controller, and a stopped manager's lane passes end with it.
#[derive(Clone)]
pub struct CallbackLane {
    permits: Arc<tokio::sync::Semaphore>,
    stop: tokio_util::sync::CancellationToken,
}

impl Default for CallbackLane {
    fn default() -> Self {
        Self {
            permits: Arc::new(tokio::sync::Semaphore::new(CALLBACK_LANE_PASSES)),
            stop: Default::default(),
        }
    }
}

impl CallbackLane {
    /// Ends the passes running and refuses new ones (the manager is stopping).
    pub fn stop(&self) {
        self.stop.cancel();
        self.permits.close();
    }
}

const CALLBACK_LANE_PASSES: usize = 64;

/// How often, and how far apart, a lane pass looks again at stores that lag behind this
/// manager's own writes (1 s in all; past that the controller's pass takes over).
const LANE_STALE_TRIES: u32 = 20;
const LANE_STALE_WAIT: Duration = Duration::from_millis(50);

/// What a pass came to.
pub enum Passed {
    Decided(Action),
    /// Decided from the answer to this controller's last write, the store still behind it: a
    /// pass must follow until the store shows the write (see [`ANSWER_RECHECK`]).
    DecidedFromAnswer(Action),
    /// A store had not shown this manager's last write to the named object yet: nothing was
    /// decided.
    Stale(String),
}

/// A host's callback is acted on at once, outside the controller's queue. Under a burst the
/// controller's runner is full and a woken machine waits among hundreds in no particular order
/// (38 s p99 at N=1000); here its pass starts when the callback is recorded.
///
/// Returns whether a lane pass took the notice. One that did not (the lane is full) goes to the
/// controller's queue. One that did goes there only when the lane gives it back through
/// `handoff`: the machine had left the store, the store stayed behind for a second, or the pass
/// failed. Sent to both, every notice also started a controller pass that waited for the
/// lane's turn and then for the store to show the lane's writes, with nothing left to do (the
/// boot Secret's watch wakes the controller after the callback anyway).
pub fn callback_lane(
    ctx: &Arc<MachineContext>,
    notice: &CallbackNotice,
    handoff: tokio::sync::mpsc::UnboundedSender<CallbackNotice>,
) -> bool {
    // When the host called back, read once from the recording write for every stage below.
    let called = notice
        .recorded
        .as_ref()
        .and_then(|r| crate::boot::tokens::parse_boot_secret(&r.written).ok())
        .and_then(|record| called_back_at(&record));
    observe_stage("recorded", called);
    let Ok(permit) = ctx.lane.permits.clone().try_acquire_owned() else {
        return false;
    };
    let machine = ObjectRef::new(&notice.metal_machine).within(&notice.namespace);
    let ctx = ctx.clone();
    let notice = notice.clone();
    tokio::spawn(async move {
        let _permit = permit;
        let stop = ctx.lane.stop.clone();
        let lane_pass = async {
            let Some(mm) = ctx.stores.metal_machines.get(&machine) else {
                return LaneOutcome::GiveBack;
            };
            if !passes_watch_filter(mm.as_ref(), ctx.watch_filter.as_deref()) {
                return LaneOutcome::Done;
            }
            observe_stage("lane", called);
            // A store that has not shown this manager's last write yet would hand the callback
            // to the controller's queue (seconds under a burst): the lane looks again shortly.
            for attempt in 0..LANE_STALE_TRIES {
                let lane = LanePass {
                    called,
                    measure_turn: attempt == 0,
                };
                match pass_in_turn(mm.clone(), &ctx, Some(lane)).await {
                    Ok(Passed::Stale(what)) => {
                        observe_stage("stale", called);
                        crate::metrics::record_callback_stale(super::expectations::kind_of(&what));
                        tokio::time::sleep(LANE_STALE_WAIT).await;
                    }
                    Ok(Passed::Decided(_)) => return LaneOutcome::Done,
                    // The controller's pass follows it, to wait for the store (see
                    // `ANSWER_RECHECK`); the lane keeps no timer of its own.
                    Ok(Passed::DecidedFromAnswer(_)) => return LaneOutcome::GiveBack,
                    Err(e) => {
                        tracing::debug!(error = %e, "callback lane pass failed; the controller passes next");
                        return LaneOutcome::GiveBack;
                    }
                }
            }
            LaneOutcome::GiveBack
        };
        tokio::select! {
            () = stop.cancelled() => {}
            outcome = lane_pass => {
                if matches!(outcome, LaneOutcome::GiveBack) {
                    // The controller's stream outlives the lane's passes; once it is gone, so
                    // is the manager.
                    let _ = handoff.send(notice);
                }
            }
        }
    });
    true
}

/// How a callback-lane pass ended: done, or the notice goes to the controller's queue.
enum LaneOutcome {
    Done,
    GiveBack,
}

async fn write_status(
    ctx: &MachineContext,
    mm: &MetalMachine,
    status: &MetalMachineStatus,
) -> Result<(), ReconcileError> {
    if !super::status_changes(mm.status.as_ref(), status) {
        return Ok(());
    }
    let namespace = mm.namespace().unwrap_or_default();
    let api: Api<MetalMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let written = super::apply_status_answer(&api, &mm.name_any(), FIELD_MANAGER, status).await?;
    ctx.expectations.wrote(
        object_key("MetalMachine", &namespace, &mm.name_any()),
        mm.resource_version(),
        written.resource_version(),
    );
    keep_answer(ctx, written);
    Ok(())
}

/// `status`, decided from generation `from`, stamped with `to`: the generation this pass's own
/// spec write produced, which the decision already accounts for.
fn restamped(mut status: MetalMachineStatus, from: Option<i64>, to: i64) -> MetalMachineStatus {
    status.observed_generation = Some(to);
    for c in &mut status.conditions {
        if c.observed_generation == from {
            c.observed_generation = Some(to);
        }
    }
    status
}

/// The status to show when the step failed: the decision's, with the fault on Ready.
fn with_fault(
    mut status: MetalMachineStatus,
    mm: &MetalMachine,
    reason: &str,
    message: &str,
) -> MetalMachineStatus {
    let now = conditions::now();
    for type_ in [BOOT_READY, READY] {
        conditions::set(
            &mut status.conditions,
            Want::f(type_, reason, message),
            mm.metadata.generation,
            &now,
        );
    }
    status
}

/// A callback-lane pass: when the host called back (if its record says), and whether this try
/// measures the wait for the machine's turn (the first does).
#[derive(Clone, Copy)]
struct LanePass {
    called: Option<jiff::Timestamp>,
    measure_turn: bool,
}

/// When the host called back, per its boot record.
fn called_back_at(record: &BootRecord) -> Option<jiff::Timestamp> {
    record.callback.as_ref()?.received_at.parse().ok()
}

/// Seconds from the callback in `record` to now, as `stage` (the callback's latency is split
/// into stages, so a slow p99 says where it waited).
fn observe_since_callback(stage: &str, record: &BootRecord) {
    observe_stage(stage, called_back_at(record));
}

/// Seconds from `called` (the callback) to now, as `stage`.
fn observe_stage(stage: &str, called: Option<jiff::Timestamp>) {
    if let Some(called) = called {
        crate::metrics::observe_callback_latency(
            stage,
            jiff::Timestamp::now()
                .duration_since(called)
                .as_secs_f64()
                .max(0.0),
        );
    }
}

/// Seconds from the callback to this pass's ready status, and the boot and total phases.
fn record_callback_latency(o: &Observed, mm: &MetalMachine) {
    let BootObservation::Record(record) = &o.boot else {
        return;
    };
    let Some(called) = called_back_at(record) else {
        return;
    };
    observe_since_callback("ready", record);
    if let Some(powered) = record.powered_at {
        crate::metrics::observe_phase("boot", called.duration_since(powered).as_secs_f64());
    }
    if let Some(created) = mm.metadata.creation_timestamp.as_ref() {
        crate::metrics::observe_phase("total", called.duration_since(created.0).as_secs_f64());
    }
}

/// Passes that write no status when their step succeeds. After `RemoveFinalizer` the object is
/// going. After `AddFinalizer`, `Claim` and `Mint` the next passes follow at once (each step's
/// watch event or answer wakes the next) and the first pass that has something to say writes
/// the status they lead to (the power-on's, hostRef and all, or a wait's): a status of just an
/// observedGeneration, "claiming" or "minting a token" would be current for one round trip and
/// cost the apiserver a MetalMachine status apply per machine, and the Machine's mirror of its
/// message another. Except a claim by a machine whose status says it found no host: that status
/// keeps it in the index of machines a freed host wakes, so the claim replaces it at once.
/// A power-on or mint that fails with a fault still writes it with the full status; any step
/// that meets a conflict or an apiserver error leaves the status before it until a pass gets
/// through (the error goes to the controller's log and backoff).
fn leaves_status_to_next_pass(step: &decide::Step, shown: &MetalMachine) -> bool {
    match step {
        decide::Step::Claim { .. } => waiting_index_keys(shown).is_empty(),
        decide::Step::AddFinalizer | decide::Step::RemoveFinalizer | decide::Step::Mint { .. } => {
            true
        }
        _ => false,
    }
}

async fn reconcile(
    mm: Arc<MetalMachine>,
    ctx: Arc<MachineContext>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(mm.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    match pass_in_turn(mm, &ctx, None).await? {
        Passed::Decided(action) | Passed::DecidedFromAnswer(action) => Ok(action),
        Passed::Stale(_) => Ok(Action::requeue(Duration::from_millis(250))),
    }
}

/// A pass in the machine's turn (controller and callback lane alike), deciding from the store's
/// copy as of the turn: the other path's pass may have run while this one waited. `lane`: set
/// for a callback-lane pass.
async fn pass_in_turn(
    mm: Arc<MetalMachine>,
    ctx: &MachineContext,
    lane: Option<LanePass>,
) -> Result<Passed, ReconcileError> {
    let object = super::key(mm.as_ref());
    ctx.stores.until_listed().await;
    let turn = ctx.pass_locks.lock(&object, lane.is_some()).await;
    if let Some(lane) = lane.filter(|l| l.measure_turn) {
        observe_stage("turn", lane.called);
    }
    // Gone from the store while this pass waited for its turn: deleted, so there is nothing to
    // decide, and the copy it was started with is stale. Deciding from it once waited on our
    // delete's expectation; that is forgotten when the deletion reaches the store
    // (`Expectations::gone`), so the pass ends here instead.
    let Some(mm) = ctx
        .stores
        .metal_machines
        .get(&ObjectRef::from_obj(mm.as_ref()))
    else {
        return Ok(Passed::Decided(Action::await_change()));
    };
    let notes = Mutex::new(PassNotes::default());
    let pass = super::instrumented(CONTROLLER, object, pass_noting(mm, ctx, &notes));
    let action = crate::kubeconn::gate::with_priority(turn.priority(), pass).await?;
    let notes = notes.into_inner().unwrap_or_default();
    Ok(match notes.stale {
        Some(what) => Passed::Stale(what),
        None if notes.from_answer => Passed::DecidedFromAnswer(action),
        None => Passed::Decided(action),
    })
}

/// One pass: observe → decide → act → status. Public so a test can drive it over stores it holds
/// back, as a lagging watch would.
pub async fn pass(mm: Arc<MetalMachine>, ctx: &MachineContext) -> Result<Action, ReconcileError> {
    pass_noting(mm, ctx, &Mutex::new(PassNotes::default())).await
}

/// What a pass says of its stores besides its action.
#[derive(Default)]
struct PassNotes {
    /// The object whose store lagged, when the pass decided nothing for that.
    stale: Option<String>,
    /// The pass decided from the answer to this controller's last write to the machine.
    from_answer: bool,
}

/// A pass that decided from the answer to this controller's last write looks again within this
/// long, until the store shows the write: the write's expectation is met, or past its TTL is
/// put to the apiserver, only by passes that look. Without them, a ready machine would wait for
/// no event, and an expectation left alone for ten minutes is swept out; a store still behind
/// then would pass for current.
pub const ANSWER_RECHECK: Duration = Duration::from_secs(5);

/// [`pass`], noting in `notes` what it saw of its stores.
async fn pass_noting(
    mm: Arc<MetalMachine>,
    ctx: &MachineContext,
    notes: &Mutex<PassNotes>,
) -> Result<Action, ReconcileError> {
    // Boxed, as each step of `act` is: the pass holds one of the two at a time, and inline it
    // would be as large as both together.
    let observed = match Box::pin(observe::observe(ctx, mm.clone())).await {
        Observation::Ready(o) => o,
        Observation::Stale(what) => {
            tracing::debug!(%what, "store has not seen our last write yet");
            if let Ok(mut n) = notes.lock() {
                n.stale = Some(what);
            }
            return Ok(Action::requeue(Duration::from_millis(250)));
        }
    };
    let Decision {
        status,
        step,
        requeue,
        note,
    } = decide::decide(&observed, &ctx.policy);
    // The copy decided from: the store's, or the answer to this controller's last write.
    let from_answer = observed.mm.resource_version() != mm.resource_version();
    if from_answer && let Ok(mut n) = notes.lock() {
        n.from_answer = true;
    }
    let mm = observed.mm.clone();
    tracing::debug!(?step, "decided");
    let called_back = matches!(step, decide::Step::RecordProvisioned { .. });
    if called_back && let BootObservation::Record(record) = &observed.boot {
        observe_since_callback("decided", record);
    }
    let key = super::key(mm.as_ref());
    let acting = Box::pin(async {
        let acted = act::act(ctx, &observed, &step).await;
        let written = match &acted {
            Ok(acted) if !leaves_status_to_next_pass(&step, &mm) => {
                let status = match acted.generation {
                    Some(generation) => {
                        restamped(status.clone(), mm.metadata.generation, generation)
                    }
                    None => status.clone(),
                };
                Some(write_status(ctx, &mm, &status).await)
            }
            _ => None,
        };
        (acted, written)
    });
    // A called-back host waits on these two writes (providerID, then ready): they skip the
    // manager's queue of apiserver requests.
    let (acted, written) = if called_back {
        crate::kubeconn::gate::urgent(acting).await
    } else {
        acting.await
    };
    match acted {
        Ok(_) => {
            written.transpose()?;
            if called_back {
                record_callback_latency(&observed, &mm);
            }
            if let Some(note) = note {
                ctx.events
                    .publish(mm.as_ref(), note.warning, note.reason, note.message)
                    .await;
            }
            let acted = !matches!(step, decide::Step::Nothing);
            if acted {
                ctx.backoff.reset(&key);
            }
            // After a step, look again soon even if no watch event maps back here (a release
            // clears the very consumerRef that would route the host's event to this machine).
            let requeue = requeue.or(acted.then_some(Duration::from_millis(500)));
            let requeue = match from_answer {
                true => Some(requeue.map_or(ANSWER_RECHECK, |r| r.min(ANSWER_RECHECK))),
                false => requeue,
            };
            Ok(match requeue {
                Some(after) => Action::requeue(after),
                None => Action::await_change(),
            })
        }
        Err(ActError::Conflict(what)) => {
            tracing::debug!(%what, "conflict; deciding again");
            Ok(Action::requeue(Duration::from_millis(250)))
        }
        Err(ActError::Waiting(f)) => {
            write_status(ctx, &mm, &with_fault(status, &mm, f.reason, &f.message)).await?;
            Ok(Action::requeue(match from_answer {
                true => ANSWER_RECHECK,
                false => Duration::from_secs(15),
            }))
        }
        Err(ActError::Fault(f)) => {
            // The decided status names the host even before any status write did (a Mint pass
            // leaves its status to the power-on pass).
            let host = status
                .host_ref
                .as_ref()
                .map(|r| r.name.clone())
                .unwrap_or_default();
            write_status(ctx, &mm, &with_fault(status, &mm, f.reason, &f.message)).await?;
            ctx.events
                .publish(mm.as_ref(), true, f.reason, f.message.clone())
                .await;
            Err(ReconcileError::Bmc {
                host,
                reason: f.reason,
                message: f.message,
            })
        }
        Err(ActError::Api(e)) => Err(e),
    }
}

fn error_policy(mm: Arc<MetalMachine>, error: &ReconcileError, ctx: Arc<MachineContext>) -> Action {
    ctx.backoff
        .after_failure("MetalMachine", &super::key(mm.as_ref()), error)
}

/// How many machines still looking for a host one freed host wakes. Only one of them can have
/// it; the others retry on their own (`GATE_RESYNC`, 60 s) or when the next host frees. So do
/// machines a change of a free host does not reach (the host was already free, or the claim and
/// release both happened between two reads of it).
const WAKES_PER_FREED_HOST: usize = 8;

/// Which hosts the host watch last showed free (Available, unclaimed), and with what a claim
/// matches on (labels, hardware), so that only a host that becomes free, or a free host that
/// now matches differently, wakes waiting machines. Waking every waiting machine on every event
/// of a free host cost 10,000 × 10,000 wake-ups at 10,000 hosts and stalled the manager.
#[derive(Default)]
struct FreedHosts(Mutex<HashMap<ObjectRef<MetalHost>, u64>>);

impl FreedHosts {
    fn newly_free(&self, host: &MetalHost) -> bool {
        // Free means claimable: a host brought online or unpaused becomes free then.
        let free = claim::is_free(host);
        let key = ObjectRef::from_obj(host);
        match self.0.lock() {
            Ok(mut known) if free => {
                let matched_on = claim_fingerprint(host);
                known.insert(key, matched_on) != Some(matched_on)
            }
            Ok(mut known) => {
                known.remove(&key);
                false
            }
            Err(_) => free,
        }
    }

    /// Machines of the host's namespace whose status says they found no host, and whose
    /// selector admits this one (machines held at an earlier gate, or between their claim and
    /// power-on, would only take the slots).
    fn machines_to_wake(
        &self,
        waiting: &crate::stores::Index<MetalMachine>,
        host: &MetalHost,
    ) -> Vec<ObjectRef<MetalMachine>> {
        let mut waiting = waiting.get(&waiting_key(
            host.metadata.namespace.as_deref().unwrap_or_default(),
        ));
        // The index lists them by name; each host starts elsewhere in that list, so the first
        // few by name are not the only ones ever woken.
        if !waiting.is_empty() {
            let start = (stable_hash(&host.metadata.name) % waiting.len() as u64) as usize;
            waiting.rotate_left(start);
        }
        waiting
            .into_iter()
            .filter(|m| {
                m.spec
                    .parsed_host_selector()
                    .is_ok_and(|s| s.matches(host.labels()))
            })
            .take(WAKES_PER_FREED_HOST)
            .map(|m| ObjectRef::from_obj(m.as_ref()))
            .collect()
    }
}

/// The MetalMachine index key of the machines of `namespace` waiting for a free host.
fn waiting_key(namespace: &str) -> String {
    format!("waiting/{namespace}")
}

/// What the shared MetalMachines' store indexes a machine under: waiting, while its status says
/// it found no host and it is not being deleted. A freed host then finds the machines to wake
/// without reading every machine (10,000 × 10,000 comparisons when a fleet is released).
pub fn waiting_index_keys(m: &MetalMachine) -> Vec<String> {
    let waiting = m.metadata.deletion_timestamp.is_none()
        && m.status.as_ref().is_some_and(|s| {
            s.host_ref.is_none()
                && conditions::get(&s.conditions, HOST_ASSOCIATED).is_some_and(|c| {
                    matches!(
                        c.reason.as_str(),
                        "NoHostAvailable" | "NoHostInFailureDomain"
                    )
                })
        });
    match waiting {
        true => vec![waiting_key(
            m.metadata.namespace.as_deref().unwrap_or_default(),
        )],
        false => Vec::new(),
    }
}

/// What a claim matches a free host on: its labels (selector, failure domain) and hardware.
fn claim_fingerprint(host: &MetalHost) -> u64 {
    let hardware = host.status.as_ref().and_then(|s| s.hardware.as_ref());
    stable_hash(&(&host.metadata.labels, hardware))
}

/// The spec (generation and uid) of each owner Machine last seen, so only a Machine whose spec
/// changed wakes its MetalMachine. A pass reads nothing of the Machine but its spec (bootstrap
/// data, failure domain); its status changes about six times per provisioning, and each woke a
/// MetalMachine pass that had nothing to do and held the machine's turn against its callback.
#[derive(Default)]
struct OwnerSpecs(Mutex<HashMap<String, (String, i64)>>);

impl OwnerSpecs {
    /// Whether `machine`'s spec is not the one last seen (or it was never seen). `machines`: how
    /// many Machines the store holds; deletions are not sent to watchers, so past twice that the
    /// record is cleared (each Machine then wakes its MetalMachine once more).
    fn changed(&self, machine: &crate::api::capi::Machine, machines: usize) -> bool {
        let Some(generation) = machine.metadata.generation else {
            return true;
        };
        let spec = (machine.uid().unwrap_or_default(), generation);
        let key = format!(
            "{}/{}",
            machine.namespace().unwrap_or_default(),
            machine.name_any()
        );
        let Ok(mut seen) = self.0.lock() else {
            return true;
        };
        if seen.len() > machines.saturating_mul(2).max(1024) {
            seen.clear();
        }
        seen.insert(key, spec.clone()) != Some(spec)
    }

    /// Forgets a Machine that no longer parses: its MetalMachine's pass reads it as invalid, and
    /// the next version that parses must wake it, even at a generation seen before (a status
    /// write can break and mend a Machine without touching its spec).
    fn forget(&self, namespace: &str, name: &str) {
        if let Ok(mut seen) = self.0.lock() {
            seen.remove(&format!("{namespace}/{name}"));
        }
    }
}

/// The controller over the shared streams: MetalMachines, and what wakes them — their boot
/// Secrets (owned), hosts (claims and releases), Machines (bootstrap data), Clusters (pause,
/// infrastructure readiness) and the boot service's callbacks.
pub fn controller(
    stores: &SharedStores,
    subs: Subscriptions,
    callbacks: impl futures::Stream<Item = CallbackNotice> + Send + 'static,
) -> Controller<MetalMachine> {
    let waiting = stores.metal_machine_index.clone();
    let freed = FreedHosts::default();
    let by_cluster = stores.metal_machines.clone();
    let owner_specs = OwnerSpecs::default();
    let owners = stores.machines.clone();
    Controller::for_shared_stream(subs.metal_machines, stores.metal_machines.clone())
        .owns_shared_stream(subs.boot_secrets)
        .watches_shared_stream(subs.hosts, move |host: Arc<MetalHost>| {
            let mut wake: Vec<ObjectRef<MetalMachine>> = Vec::new();
            if let Some(c) = &host.spec.consumer_ref {
                wake.push(ObjectRef::new(&c.name).within(&c.namespace));
            }
            if freed.newly_free(&host) {
                wake.extend(freed.machines_to_wake(&waiting, &host));
            }
            wake
        })
        .watches_shared_stream(subs.machines, move |machine| {
            let namespace = machine.meta().namespace.clone().unwrap_or_default();
            if machine.0.is_err() {
                owner_specs.forget(
                    &namespace,
                    machine.meta().name.as_deref().unwrap_or_default(),
                );
            }
            machine
                .0
                .as_ref()
                .ok()
                .filter(|m| m.spec.infrastructure_ref.kind == "MetalMachine")
                .filter(|m| owner_specs.changed(m, owners.len()))
                .map(|m| ObjectRef::new(&m.spec.infrastructure_ref.name).within(&namespace))
        })
        .watches_shared_stream(subs.clusters, move |cluster| {
            let namespace = cluster.meta().namespace.clone();
            let name = cluster.meta().name.clone().unwrap_or_default();
            by_cluster
                .state()
                .into_iter()
                .filter(|m| m.metadata.namespace == namespace)
                .filter(|m| m.labels().get(crate::api::CLUSTER_NAME_LABEL) == Some(&name))
                .map(|m| ObjectRef::from_obj(m.as_ref()))
                .collect::<Vec<_>>()
        })
        .reconcile_on(callbacks.map(|n| ObjectRef::new(&n.metal_machine).within(&n.namespace)))
}

pub async fn run(controller: Controller<MetalMachine>, ctx: Arc<MachineContext>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "MetalMachine controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::common::Condition;

    /// A claim is in flight from its send until its guard goes, however the pass ends.
    #[test]
    fn a_claim_is_in_flight_until_its_guard_is_dropped() {
        let claims = ClaimsInFlight::default();
        let guard = claims.claiming("ns", "h1");
        let other = claims.claiming("other", "h2");
        assert_eq!(claims.in_namespace("ns"), HashSet::from(["h1".to_string()]));
        drop(guard);
        assert!(claims.in_namespace("ns").is_empty());
        assert_eq!(
            claims.in_namespace("other"),
            HashSet::from(["h2".to_string()])
        );
        drop(other);
        assert!(claims.in_namespace("other").is_empty());
    }

    #[test]
    fn an_owner_machine_wakes_its_metal_machine_only_when_its_spec_changes() {
        let machine = |uid: &str, generation: i64| -> crate::api::capi::Machine {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2",
                "kind": "Machine",
                "metadata": {"name": "m1", "namespace": "ns", "uid": uid, "generation": generation},
                "spec": {"clusterName": "c1", "bootstrap": {},
                         "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                                               "kind": "MetalMachine", "name": "m1"}},
            }))
            .expect("a Machine")
        };
        let seen = OwnerSpecs::default();
        assert!(seen.changed(&machine("u1", 1), 1), "first seen");
        assert!(!seen.changed(&machine("u1", 1), 1), "a status write");
        assert!(seen.changed(&machine("u1", 2), 1), "a spec write");
        assert!(seen.changed(&machine("u2", 2), 1), "the Machine recreated");
        seen.forget("ns", "m1");
        assert!(
            seen.changed(&machine("u2", 2), 1),
            "mended after it did not parse: same generation, still a change"
        );
        let mut unversioned = machine("u2", 2);
        unversioned.metadata.generation = None;
        assert!(seen.changed(&unversioned, 1), "no generation: always");
        assert!(seen.changed(&unversioned, 1), "no generation: always");
    }

    /// The pass that records providerID (a spec write) stamps its status with the generation
    /// that write produced, so the next pass has nothing left to write.
    #[test]
    fn a_status_decided_with_a_spec_write_carries_its_generation() {
        let condition = |type_: &str, generation: i64| Condition {
            type_: type_.into(),
            status: "True".into(),
            reason: "R".into(),
            message: String::new(),
            observed_generation: Some(generation),
            last_transition_time: conditions::now(),
        };
        let status = MetalMachineStatus {
            observed_generation: Some(1),
            conditions: vec![condition("Ready", 1), condition("Older", 0)],
            ..Default::default()
        };
        let stamped = restamped(status, Some(1), 2);
        assert_eq!(stamped.observed_generation, Some(2));
        let generations: Vec<_> = stamped
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.observed_generation))
            .collect();
        assert_eq!(generations, [("Ready", Some(2)), ("Older", Some(0))]);
    }

    /// Passes over one machine take turns, passes over two do not wait for each other, and a
    /// machine's lock is forgotten once no pass holds or awaits it.
    #[tokio::test]
    async fn passes_over_one_machine_take_turns_and_their_lock_is_forgotten() {
        let locks = PassLocks::default();
        let first = locks.lock("MetalMachine/ns/a", false).await;
        let other = locks.lock("MetalMachine/ns/b", false).await;
        assert_eq!(locks.len(), 2);
        let mut second = std::pin::pin!(locks.lock("MetalMachine/ns/a", false));
        assert!(
            futures::poll!(second.as_mut()).is_pending(),
            "a second pass over a waits"
        );
        drop(first);
        assert_eq!(locks.len(), 2, "a is still awaited, so remembered");
        let second = second.await;
        drop(second);
        drop(other);
        assert!(
            locks.is_empty(),
            "nothing holds or awaits a lock: all forgotten"
        );
    }

    /// A callback's pass waiting for a machine's turn raises the priority of the pass holding it,
    /// and of every pass taking it before the callback's; other passes stay in the crowd.
    #[tokio::test]
    async fn a_callback_waiting_for_a_turn_raises_the_passes_ahead_of_it() {
        let locks = PassLocks::default();
        let holding = locks.lock("MetalMachine/ns/a", false).await;
        let other = locks.lock("MetalMachine/ns/b", false).await;
        assert!(!holding.priority().is_raised(), "no callback waits yet");
        let mut queued = std::pin::pin!(locks.lock("MetalMachine/ns/a", false));
        assert!(futures::poll!(queued.as_mut()).is_pending());
        let mut callback = std::pin::pin!(locks.lock("MetalMachine/ns/a", true));
        assert!(futures::poll!(callback.as_mut()).is_pending());
        assert!(
            holding.priority().is_raised(),
            "the pass the callback waits for is raised"
        );
        assert!(
            !other.priority().is_raised(),
            "another machine's pass is not"
        );
        drop(holding);
        let queued = queued.await;
        assert!(
            queued.priority().is_raised(),
            "a pass taking the turn before the callback's is raised"
        );
        drop(queued);
        let callback = callback.await;
        assert!(callback.priority().is_raised(), "the callback's own pass");
        drop(callback);
        let after = locks.lock("MetalMachine/ns/a", false).await;
        assert!(!after.priority().is_raised(), "no callback waits any more");
    }

    /// A callback's pass dropped while it waits for the turn (the lane stopping) stops raising
    /// the passes that take the turn after.
    #[tokio::test]
    async fn a_callback_dropped_while_waiting_raises_nothing_after() {
        let locks = PassLocks::default();
        let holding = locks.lock("MetalMachine/ns/a", false).await;
        {
            let mut callback = std::pin::pin!(locks.lock("MetalMachine/ns/a", true));
            assert!(futures::poll!(callback.as_mut()).is_pending());
        }
        assert!(holding.priority().is_raised(), "raised while it waited");
        drop(holding);
        let after = locks.lock("MetalMachine/ns/a", false).await;
        assert!(!after.priority().is_raised(), "no callback waits any more");
    }

    /// A MetalMachine of namespace `ns` whose status (if `reason`) is only a HostAssociated
    /// condition, False for `reason`.
    fn machine_with_host_associated(name: &str, reason: Option<&str>) -> MetalMachine {
        let mut m = MetalMachine::new(name, Default::default());
        m.metadata.namespace = Some("ns".into());
        m.status = reason.map(|reason| MetalMachineStatus {
            conditions: vec![Condition {
                type_: HOST_ASSOCIATED.into(),
                status: "False".into(),
                reason: reason.into(),
                message: String::new(),
                observed_generation: None,
                last_transition_time: conditions::now(),
            }],
            ..Default::default()
        });
        m
    }

    #[test]
    fn a_claim_writes_its_status_only_over_a_wait_for_a_host() {
        let machine = |reason: Option<&str>| machine_with_host_associated("m1", reason);
        let claim = decide::Step::Claim {
            host: "h1".into(),
            resource_version: "7".into(),
        };
        assert!(
            leaves_status_to_next_pass(&claim, &machine(None)),
            "a new machine claims without a status of its own"
        );
        for waited in ["NoHostAvailable", "NoHostInFailureDomain"] {
            assert!(
                !leaves_status_to_next_pass(&claim, &machine(Some(waited))),
                "{waited}: the claim replaces the wait at once"
            );
        }
        assert!(leaves_status_to_next_pass(
            &decide::Step::AddFinalizer,
            &machine(None)
        ));
        let power_on = decide::Step::PowerOn {
            host: "h1".into(),
            attempt: 1,
        };
        assert!(!leaves_status_to_next_pass(&power_on, &machine(None)));
    }

    /// A host wakes waiting machines when it becomes claimable, not on every change while it
    /// stays so, and only machines whose status says they found no host.
    #[test]
    fn a_freed_host_wakes_only_machines_that_found_none() {
        use crate::api::metalhost::{ConsumerReference, HostState, MetalHostStatus};
        let mut host = MetalHost::new("h", crate::api::metalhost::MetalHostSpec::for_tests());
        host.metadata.namespace = Some("ns".into());
        host.spec.online = true;
        host.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m0", "ns"));
        host.status = Some(MetalHostStatus {
            state: Some(HostState::Available),
            ..Default::default()
        });
        let freed = FreedHosts::default();
        assert!(!freed.newly_free(&host), "claimed: not free");
        host.spec.consumer_ref = None;
        assert!(freed.newly_free(&host), "released: newly free");
        assert!(!freed.newly_free(&host), "still free: nothing new");
        host.spec.online = false;
        assert!(!freed.newly_free(&host), "offline: not claimable");
        host.spec.online = true;
        assert!(freed.newly_free(&host), "back online: newly free");
        host.metadata.labels = Some([("rack".to_string(), "r2".to_string())].into());
        assert!(
            freed.newly_free(&host),
            "relabelled while free: may match others now"
        );
        assert!(!freed.newly_free(&host), "same labels: nothing new");
        if let Some(status) = host.status.as_mut() {
            status.hardware = Some(crate::api::metalhost::HardwareInventory {
                memory_mib: Some(65_536),
                ..Default::default()
            });
        }
        assert!(
            freed.newly_free(&host),
            "inspected while free: may match hardware requirements now"
        );
        assert!(!freed.newly_free(&host), "same hardware: nothing new");

        let machine = machine_with_host_associated;
        let (store, mut writer) = kube::runtime::reflector::store::<MetalMachine>();
        let mut deleting = machine("deleting", Some("NoHostAvailable"));
        deleting.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let mut elsewhere = machine("elsewhere", Some("NoHostAvailable"));
        elsewhere.metadata.namespace = Some("other".into());
        for m in [
            machine("waiting", Some("NoHostAvailable")),
            machine("claiming", Some("Claiming")),
            machine("new", None),
            deleting,
            elsewhere,
        ] {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(m));
        }
        let waiting = crate::stores::Index::new(waiting_index_keys);
        waiting.rebuild(&store);
        let woken: Vec<String> = freed
            .machines_to_wake(&waiting, &host)
            .into_iter()
            .map(|r| r.name)
            .collect();
        assert_eq!(woken, ["waiting"]);
    }
}

#[cfg(test)]
mod task_size {
    /// Each running pass is a task of this size, up to CONCURRENT_PASSES of them; the pass
    /// itself is boxed (see `instrumented`). Unboxed, this task was 54,352 bytes.
    #[test]
    fn a_metalmachine_pass_task_holds_its_pass_boxed() {
        let size = crate::controllers::future_size(super::reconcile as fn(_, _) -> _);
        assert!(
            size <= 2048,
            "the MetalMachine reconcile future is {size} bytes"
        );
    }

    /// The boxed pass itself, up to CONCURRENT_PASSES of them at once: its observation and each
    /// step of `act` boxed in turn, so a pass carries the stage it is in, not the largest.
    /// Unboxed stages, it was 14,928 bytes.
    #[test]
    fn a_metalmachine_pass_boxes_its_stages() {
        let size = crate::controllers::future_size(super::pass as fn(_, _) -> _);
        assert!(size <= 4608, "the MetalMachine pass future is {size} bytes");
    }
}

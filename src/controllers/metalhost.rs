//! MetalHost controller: registers hosts (credentials + a BMC that answers → Available, or Error
//! with the fault), reads inventory once, polls power politely (one sweep over all hosts,
//! [`poll_sweep`]), and holds `online: false` hosts powered off. It is the only writer of
//! MetalHost status: `state` is derived from the claim in `spec.consumerRef` (written by the
//! MetalMachine controller) and the consumer's own status, so a host restored from a backup with
//! its consumerRef is never shown Available, and nobody else's write can erase a field of ours.
//! It never provisions: claiming and booting belong to the MetalMachine controller.
//!
//! Where to look: [`plan`] (what to do with the BMC this pass) and [`desired_state`] (which
//! state the host is in) are pure and table-tested below.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};

use crate::api::metalhost::{
    BootOnce, HardwareInventory, HostErrorType, HostState, MetalHostStatus, PowerState,
};
use crate::api::{HOST_PAUSED_ANNOTATION, MetalHost, MetalMachine};
use crate::bmc::Bmc;

use super::conditions::{self, Want};
use super::expectations::{Expectations, object_key, store_reflects};
use super::hostbmc::BmcConnector;
use super::metalmachine::DEPROVISION_FAILED_ANNOTATION;
use super::metalmachine::claim::{MacSharers, boot_mac_sharers};
use super::power::{PowerOffStep, PowerRequests, power_off_step};
use super::{Backoff, Events, ReconcileError, SharedStores, key};

pub use super::power::Fault;

pub const FIELD_MANAGER: &str = "metalboot-metalhost";
pub const CONTROLLER: &str = "metalhost";
/// Condition: credentials were accepted by a BMC that answered.
pub const REGISTERED: &str = "Registered";
/// Condition: the last BMC call succeeded.
pub const BMC_REACHABLE: &str = "BmcReachable";
/// Condition: reconciliation is paused by annotation.
pub const PAUSED: &str = "Paused";
/// Condition: the operator holds the host off (`spec.online: false`); its transition time is
/// when the hold began, from which the graceful period runs.
pub const HELD_OFF: &str = "PoweredOffByOperator";
/// Condition: the MetalMachine in `spec.consumerRef` exists.
pub const CONSUMER_FOUND: &str = "ConsumerFound";
/// Condition, present only while true: another MetalHost names this host's boot MAC (a copied
/// manifest). The boot service boots none of them, so an unclaimed one is in Error, where no
/// machine claims it; a claimed one keeps its state (a running node is left running).
pub const BOOT_MAC_SHARED: &str = "BootMACShared";

/// What the controller does with the BMC this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPlan {
    Paused,
    /// Check credentials and BMC; read inventory if missing.
    Register,
    /// Power the host off (operator set `online: false`), per the shared power-off policy.
    HoldOff,
    /// Read the power state.
    Poll,
    /// No BMC call due (status may still change): the poll sweep ([`poll_sweep`]) comes back.
    Wait,
}

/// A power reading is due once the last one is this share of the poll interval old. The poll
/// sweep comes back to each host once per interval, a little later than its last reading when
/// that pass waited its turn, so a reading taken at one sweep is due at the next.
const DUE_SHARE: f64 = 0.9;

/// `last_read` is this manager's last power reading of the host: readings that changed nothing
/// are not written to status (see [`poll_status`]), so status alone may look older.
pub fn plan(
    host: &MetalHost,
    now: jiff::Timestamp,
    poll_interval: Duration,
    last_read: Option<jiff::Timestamp>,
) -> HostPlan {
    if paused(host) {
        return HostPlan::Paused;
    }
    let status = host.status.clone().unwrap_or_default();
    let registered = conditions::is_true(&status.conditions, REGISTERED);
    if !registered || status.error_type == Some(HostErrorType::RegistrationError) {
        return HostPlan::Register;
    }
    if !host.spec.online && status.power_state != Some(PowerState::Off) {
        return HostPlan::HoldOff;
    }
    let since_check = status
        .last_power_check
        .map(|t| t.0)
        .max(last_read)
        .map(|t| now.duration_since(t).as_secs())
        .unwrap_or(i64::MAX);
    if since_check >= poll_interval.mul_f64(DUE_SHARE).as_secs() as i64 {
        HostPlan::Poll
    } else {
        HostPlan::Wait
    }
}

/// A paused host is left as it is: the controller writes only its Paused condition.
fn paused(host: &MetalHost) -> bool {
    host.annotations().contains_key(HOST_PAUSED_ANNOTATION)
}

/// The state this controller writes for the host when its consumer is `consumer`: None when it
/// writes none (a paused host, or one with no status yet, which registers first). Other
/// controllers that wait for this one ask here rather than restate its rules. Ask with a
/// claimed host's consumer: the one rule that reads other hosts (a shared boot MAC) changes only
/// an unclaimed host's state.
pub fn state_it_writes(host: &MetalHost, consumer: Consumer) -> Option<HostState> {
    if paused(host) {
        return None;
    }
    host.status
        .as_ref()
        .map(|status| desired_state(host, status, consumer, false))
}

/// The consumer named by `spec.consumerRef`, as the MetalMachine store has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consumer {
    /// No claim.
    Unclaimed,
    /// Claimed, but the MetalMachine is not (or not yet, after a restore) in the store.
    Missing,
    Provisioning,
    Provisioned,
    Deleting,
}

pub fn consumer_of(host: &MetalHost, machines: &Store<MetalMachine>) -> Consumer {
    let Some(c) = &host.spec.consumer_ref else {
        return Consumer::Unclaimed;
    };
    match machines.get(&ObjectRef::new(&c.name).within(&c.namespace)) {
        None => Consumer::Missing,
        Some(mm) if mm.metadata.deletion_timestamp.is_some() => Consumer::Deleting,
        Some(mm) if mm.spec.provider_id.is_some() => Consumer::Provisioned,
        Some(_) => Consumer::Provisioning,
    }
}

/// The host's lifecycle state, from facts: registration, an abandoned deprovisioning, the claim
/// and its consumer, and whether another host names its boot MAC. A claimed host is never
/// Available; a host whose consumer is missing (a restore, a move in progress) keeps a busy
/// state and is left alone.
pub fn desired_state(
    host: &MetalHost,
    status: &MetalHostStatus,
    consumer: Consumer,
    boot_mac_shared: bool,
) -> HostState {
    if status.error_type == Some(HostErrorType::RegistrationError)
        || !conditions::is_true(&status.conditions, REGISTERED)
    {
        return status.state.unwrap_or_default();
    }
    if consumer == Consumer::Unclaimed
        && (host
            .annotations()
            .contains_key(DEPROVISION_FAILED_ANNOTATION)
            || boot_mac_shared)
    {
        return HostState::Error;
    }
    match consumer {
        Consumer::Unclaimed => HostState::Available,
        Consumer::Provisioning => HostState::Provisioning,
        Consumer::Provisioned => HostState::Provisioned,
        Consumer::Deleting => HostState::Deprovisioning,
        Consumer::Missing => match status.state {
            Some(
                s @ (HostState::Provisioning | HostState::Provisioned | HostState::Deprovisioning),
            ) => s,
            _ => HostState::Provisioned,
        },
    }
}

/// What the current attempt of this host's consumer learned about the host, from its boot
/// Secret: the deploy agent's inspection (written by the boot service) and how the BMC kept the
/// one-time network boot of the power-on (written by the MetalMachine controller).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttemptFacts {
    pub inspection: Option<HardwareInventory>,
    pub boot_once: Option<BootOnce>,
}

/// The [`AttemptFacts`] of this host. One store lookup: the boot Secret is named after the
/// consumer.
pub fn attempt_facts(
    host: &MetalHost,
    boot_secrets: &Store<crate::boot::tokens::StoredBootSecret>,
) -> AttemptFacts {
    let record = host.spec.consumer_ref.as_ref().and_then(|consumer| {
        let secret = boot_secrets.get(
            &ObjectRef::new(&crate::boot::tokens::boot_secret_name(&consumer.name))
                .within(&consumer.namespace),
        )?;
        crate::boot::tokens::parse_boot_secret(&secret).ok()
    });
    match record {
        Some(r) if r.host == host.name_any() => AttemptFacts {
            inspection: r.inspection,
            boot_once: r.boot_once,
        },
        _ => AttemptFacts::default(),
    }
}

/// The deploy agent's inspection over what the BMC reported: the agent sees CPUs, memory, disks,
/// link state and firmware mode from inside the host; the BMC's identity fields (manufacturer,
/// model, serial number, UUID, firmware version) and NIC names are kept where the agent has none.
pub fn merge_inspection(
    bmc: Option<&HardwareInventory>,
    agent: &HardwareInventory,
) -> HardwareInventory {
    let mut merged = agent.clone();
    let Some(bmc) = bmc else {
        return merged;
    };
    let keep = |mine: &mut Option<String>, theirs: &Option<String>| {
        if mine.is_none() {
            mine.clone_from(theirs);
        }
    };
    keep(&mut merged.manufacturer, &bmc.manufacturer);
    keep(&mut merged.model, &bmc.model);
    keep(&mut merged.serial_number, &bmc.serial_number);
    keep(&mut merged.system_uuid, &bmc.system_uuid);
    keep(&mut merged.bios_version, &bmc.bios_version);
    for nic in &mut merged.nics {
        let named = bmc.nics.iter().find(|b| {
            b.mac.as_deref().map(str::to_ascii_lowercase)
                == nic.mac.as_deref().map(str::to_ascii_lowercase)
        });
        if let Some(b) = named {
            keep(&mut nic.name, &b.name);
        }
    }
    for (k, v) in &bmc.extra {
        merged.extra.entry(k.clone()).or_insert_with(|| v.clone());
    }
    merged
}

/// What the status says of a boot MAC that `sharers` name too: nothing when they are none.
fn shared_mac_message(host: &MetalHost, sharers: &MacSharers) -> Option<String> {
    (!sharers.is_empty()).then(|| {
        format!(
            "boot MAC {} is also spec.bootMACAddress of MetalHost {}: the boot service boots none of them; give each host its own",
            host.spec.boot_mac_address, sharers
        )
    })
}

/// Sets the BootMACShared condition while `message` says the MAC is shared, removes it after.
fn say_shared_mac(
    status: &mut MetalHostStatus,
    message: Option<String>,
    generation: Option<i64>,
    now: &Time,
) {
    match message {
        Some(message) => conditions::set(
            &mut status.conditions,
            Want::t(BOOT_MAC_SHARED, "BootMACShared", message),
            generation,
            now,
        ),
        None => status.conditions.retain(|c| c.type_ != BOOT_MAC_SHARED),
    }
}

/// Applies the derived state and what goes with it (error fields, the consumer and shared-MAC
/// conditions, the deploy agent's inspection, and how the BMC keeps a one-time boot when the
/// probe record does not say yet). `sharers`: the other hosts with this host's boot MAC.
///
/// How the BMC keeps a one-time boot rides with the next status write rather than making one of
/// its own (about one of a host's three writes in a fleet's boot): until then the MetalMachine
/// controller reads it from the boot Secret, where it was learned, and a fact lost with that
/// Secret is read back from the BMC at the next power-on.
fn settle(
    host: &MetalHost,
    status: MetalHostStatus,
    consumer: Consumer,
    facts: &AttemptFacts,
    sharers: &MacSharers,
    now: &Time,
) -> MetalHostStatus {
    let mut status = settle_state(host, status, consumer, facts, sharers, now);
    let changes = super::status_changes(host.status.as_ref(), &status);
    if let (Some(learned), Some(bmc)) = (facts.boot_once, status.bmc.as_mut())
        && bmc.boot_once.is_none()
        && changes
    {
        bmc.boot_once = Some(learned);
    }
    status
}

/// [`settle`] but for the learned one-time boot.
fn settle_state(
    host: &MetalHost,
    mut status: MetalHostStatus,
    consumer: Consumer,
    facts: &AttemptFacts,
    sharers: &MacSharers,
    now: &Time,
) -> MetalHostStatus {
    if let Some(agent) = &facts.inspection {
        status.hardware = Some(merge_inspection(status.hardware.as_ref(), agent));
    }
    let generation = host.metadata.generation;
    let state = desired_state(host, &status, consumer, !sharers.is_empty());
    status.state = Some(state);
    let shared_message = shared_mac_message(host, sharers);
    let released_badly = host.annotations().get(DEPROVISION_FAILED_ANNOTATION);
    if state == HostState::Error && status.error_type != Some(HostErrorType::RegistrationError) {
        (status.error_type, status.error_message) = match (released_badly, &shared_message) {
            (Some(why), _) => (
                Some(HostErrorType::DeprovisioningError),
                Some(why.chars().take(2048).collect()),
            ),
            (None, message) => (Some(HostErrorType::BootMACShared), message.clone()),
        };
    } else if matches!(
        status.error_type,
        Some(HostErrorType::DeprovisioningError | HostErrorType::BootMACShared)
    ) {
        status.error_type = None;
        status.error_message = None;
    }
    say_shared_mac(&mut status, shared_message, generation, now);
    match (consumer, host.spec.consumer_ref.as_ref()) {
        (Consumer::Unclaimed, _) | (_, None) => {
            status.conditions.retain(|c| c.type_ != CONSUMER_FOUND)
        }
        (Consumer::Missing, Some(c)) => conditions::set(
            &mut status.conditions,
            Want::f(
                CONSUMER_FOUND,
                "ConsumerMissing",
                format!(
                    "spec.consumerRef names MetalMachine {}/{}, which does not exist; the host is left as it is (clear spec.consumerRef to free it)",
                    c.namespace, c.name
                ),
            ),
            generation,
            now,
        ),
        (_, Some(c)) => conditions::set(
            &mut status.conditions,
            Want::t(
                CONSUMER_FOUND,
                "ConsumerFound",
                format!("claimed by MetalMachine {}/{}", c.namespace, c.name),
            ),
            generation,
            now,
        ),
    }
    if host.spec.online {
        status.conditions.retain(|c| c.type_ != HELD_OFF);
    }
    status
}
/// What a registration read: power, and the inventory and capabilities when they were missing.
pub type Registered = (
    PowerState,
    Option<HardwareInventory>,
    Option<crate::api::metalhost::BmcCapabilities>,
);

/// Status after a registration attempt.
pub fn registration_status(
    host: &MetalHost,
    result: Result<Registered, Fault>,
    now: &Time,
) -> MetalHostStatus {
    let mut status = host.status.clone().unwrap_or_default();
    let generation = host.metadata.generation;
    status.observed_generation = generation;
    match result {
        Ok((power, inventory, capabilities)) => {
            // The state proper is settled from the claim (see `desired_state`).
            status.state = Some(HostState::Available);
            status.error_type = None;
            status.error_message = None;
            status.power_state = Some(power);
            status.last_power_check = Some(now.clone());
            if inventory.is_some() {
                status.hardware = inventory;
            }
            if capabilities.is_some() {
                status.bmc = capabilities;
            }
            conditions::set(
                &mut status.conditions,
                Want::t(REGISTERED, "Registered", "the BMC accepted the credentials"),
                generation,
                now,
            );
            conditions::set(
                &mut status.conditions,
                Want::t(BMC_REACHABLE, "BmcReachable", ""),
                generation,
                now,
            );
        }
        Err(fault) => {
            status.state = Some(HostState::Error);
            status.error_type = Some(HostErrorType::RegistrationError);
            status.error_message = Some(fault.message.clone());
            conditions::set(
                &mut status.conditions,
                Want::f(REGISTERED, fault.reason, fault.message.clone()),
                generation,
                now,
            );
            conditions::set(
                &mut status.conditions,
                Want::f(BMC_REACHABLE, fault.reason, fault.message),
                generation,
                now,
            );
        }
    }
    status
}

/// Status after a power read (registered host): `status` with the reading applied.
/// `lastPowerCheck` moves only with a reading that changed the status: a host re-read every
/// poll interval with nothing new costs no write (10,000 hosts would otherwise write 33 statuses
/// a second just to move a timestamp). This manager keeps the time of every reading in memory.
pub fn poll_status(
    mut status: MetalHostStatus,
    generation: Option<i64>,
    result: Result<PowerState, Fault>,
    now: &Time,
) -> MetalHostStatus {
    // What a reading can change; compared instead of cloning the whole status (inventory and
    // all) on every poll.
    let power_before = status.power_state;
    let reachable_before = conditions::get(&status.conditions, BMC_REACHABLE).cloned();
    match result {
        Ok(power) => {
            status.power_state = Some(power);
            conditions::set(
                &mut status.conditions,
                Want::t(BMC_REACHABLE, "BmcReachable", ""),
                generation,
                now,
            );
        }
        Err(fault) => {
            status.power_state = Some(PowerState::Unknown);
            conditions::set(
                &mut status.conditions,
                Want::f(BMC_REACHABLE, fault.reason, fault.message),
                generation,
                now,
            );
        }
    }
    if status.power_state != power_before
        || conditions::get(&status.conditions, BMC_REACHABLE) != reachable_before.as_ref()
        || status.last_power_check.is_none()
    {
        status.last_power_check = Some(now.clone());
    }
    status
}

/// When this manager last read each host's power, by host key: the schedule of the next
/// reading, which status no longer carries for readings that changed nothing.
pub type PowerReadings = super::per_object::PerObject<jiff::Timestamp>;

pub struct HostContext {
    pub client: kube::Client,
    pub connector: Arc<dyn BmcConnector>,
    pub stores: SharedStores,
    pub events: Events,
    pub backoff: Backoff,
    pub poll_interval: Duration,
    /// How long a graceful power-off may take before it is forced (the shared policy).
    pub graceful_off: Duration,
    pub power_requests: PowerRequests,
    pub power_readings: PowerReadings,
    pub watch_filter: Option<String>,
    /// Metadata of the Secrets in scope, from the watch that also wakes hosts on a change.
    pub secret_meta: Store<PartialObjectMeta<Secret>>,
    /// This controller's status writes the host store has not shown yet: a pass waits for them
    /// (a pass from the older copy would only write the same status again).
    pub expectations: Expectations,
}

/// Writes the whole status with server-side apply: this controller is its only writer.
pub async fn write_status(
    expectations: &Expectations,
    api: &Api<MetalHost>,
    host: &MetalHost,
    status: &MetalHostStatus,
) -> Result<(), ReconcileError> {
    if !super::status_changes(host.status.as_ref(), status) {
        return Ok(());
    }
    let written = super::apply_status(api, &host.name_any(), FIELD_MANAGER, status).await?;
    expectations.wrote(host_key(host), host.resource_version(), written);
    Ok(())
}

/// [`write_status`], then one Warning Event when the status written is the first to say the
/// boot MAC is shared (a later pass sees the condition in the store and says nothing).
async fn write_and_tell(
    ctx: &HostContext,
    api: &Api<MetalHost>,
    host: &MetalHost,
    status: &MetalHostStatus,
) -> Result<(), ReconcileError> {
    write_status(&ctx.expectations, api, host, status).await?;
    let said = |s: &MetalHostStatus| conditions::is_true(&s.conditions, BOOT_MAC_SHARED);
    if said(status) && !host.status.as_ref().is_some_and(said) {
        let message = conditions::get(&status.conditions, BOOT_MAC_SHARED)
            .map(|c| c.message.clone())
            .unwrap_or_default();
        ctx.events
            .publish(host, true, "BootMACShared", message)
            .await;
    }
    Ok(())
}

fn host_key(host: &MetalHost) -> String {
    object_key(
        "MetalHost",
        &host.namespace().unwrap_or_default(),
        &host.name_any(),
    )
}

async fn connect(ctx: &HostContext, host: &MetalHost) -> Result<Arc<dyn Bmc>, Fault> {
    super::hostbmc::connect(&ctx.client, ctx.connector.as_ref(), host).await
}

async fn reconcile(host: Arc<MetalHost>, ctx: Arc<HostContext>) -> Result<Action, ReconcileError> {
    if !super::passes_watch_filter(host.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    let object = key(host.as_ref());
    ctx.stores.until_listed().await;
    crate::stores::until_ready(&ctx.secret_meta).await;
    super::instrumented(CONTROLLER, object, pass(host, &ctx)).await
}

async fn pass(host: Arc<MetalHost>, ctx: &HostContext) -> Result<Action, ReconcileError> {
    let name = host.name_any();
    let api: Api<MetalHost> =
        Api::namespaced(ctx.client.clone(), &host.namespace().unwrap_or_default());
    if !store_reflects(
        &ctx.expectations,
        &api,
        &host_key(&host),
        &name,
        host.resource_version().as_deref(),
    )
    .await
    {
        return Ok(Action::requeue(Duration::from_millis(250)));
    }
    let now = conditions::now();
    let consumer = consumer_of(&host, &ctx.stores.metal_machines);
    let facts = attempt_facts(&host, &ctx.stores.boot_secrets);
    let sharers = boot_mac_sharers(&ctx.stores.host_index, &host);
    let previous_state = host.status.as_ref().and_then(|s| s.state);
    label_secrets_for_move(ctx, &host).await;
    let host_key = key(host.as_ref());
    let read_power = |power: Result<PowerState, Fault>| {
        ctx.power_readings.insert(&host_key, now.0);
        power
    };
    // Each plan's work boxed: inline, every pass would carry the size of the largest (the
    // registration's BMC reads), up to `CONCURRENT_PASSES` at once.
    // A pass that reads the BMC, or has nothing due, ends without a timer of its own: the poll
    // sweep brings the host back at its next reading.
    match plan(&host, now.0, ctx.poll_interval, ctx.power_readings.get(&host_key)) {
        HostPlan::Paused => Box::pin(async {
            let mut status = host.status.clone().unwrap_or_default();
            conditions::set(
                &mut status.conditions,
                Want::t(
                    PAUSED,
                    "Paused",
                    format!("annotation {HOST_PAUSED_ANNOTATION} is set"),
                ),
                host.metadata.generation,
                &now,
            );
            write_status(&ctx.expectations, &api, &host, &status).await?;
            Ok(Action::await_change())
        })
        .await,
        HostPlan::Register => Box::pin(async {
            let result = match connect(ctx, &host).await {
                Err(f) => Err(f),
                Ok(bmc) => match bmc.power_state().await {
                    Err(e) => Err(Fault::from_bmc(&e)),
                    Ok(power) => {
                        let inventory = if host
                            .status
                            .as_ref()
                            .and_then(|s| s.hardware.as_ref())
                            .is_none()
                        {
                            match bmc.inventory().await {
                                Ok(inv) => Some(inv),
                                Err(e) => {
                                    tracing::warn!(host = %name, error = %e, "inventory not read; will retry at the next registration");
                                    None
                                }
                            }
                        } else {
                            None
                        };
                        // Probed once, like the inventory: it reads, never changes anything.
                        let capabilities = if host
                            .status
                            .as_ref()
                            .and_then(|s| s.bmc.as_ref())
                            .is_none()
                        {
                            match bmc.probe().await {
                                Ok(caps) => Some(caps),
                                Err(e) => {
                                    tracing::warn!(host = %name, error = %e, "BMC not probed; will retry at the next registration");
                                    None
                                }
                            }
                        } else {
                            None
                        };
                        Ok((power, inventory, capabilities))
                    }
                },
            };
            let failed = result.as_ref().err().cloned();
            let mut status = registration_status(&host, result, &now);
            match failed {
                None => status = settle(&host, status, consumer, &facts, &sharers, &now),
                // Registration failed: the state stays Error with that fault, but what the
                // status says of the MAC stays true.
                Some(_) => say_shared_mac(
                    &mut status,
                    shared_mac_message(&host, &sharers),
                    host.metadata.generation,
                    &now,
                ),
            }
            status.conditions.retain(|c| c.type_ != PAUSED);
            write_and_tell(ctx, &api, &host, &status).await?;
            match failed {
                Some(f) => {
                    if previous_state != Some(HostState::Error) {
                        ctx.events
                            .publish(host.as_ref(), true, f.reason, f.message.clone())
                            .await;
                    }
                    tracing::warn!(host = %name, reason = f.reason, "registration failed: {}", f.message);
                    // Retried with backoff; a changed credentials Secret retries at once.
                    Ok(Action::requeue(ctx.backoff.next(&key(host.as_ref()))))
                }
                None => {
                    ctx.backoff.reset(&key(host.as_ref()));
                    if previous_state != status.state {
                        ctx.events
                            .publish(
                                host.as_ref(),
                                false,
                                "Registered",
                                format!(
                                    "BMC {} answered; host is {:?}",
                                    host.spec.bmc.address,
                                    status.state.unwrap_or_default()
                                ),
                            )
                            .await;
                    }
                    Ok(Action::await_change())
                }
            }
        })
        .await,
        HostPlan::HoldOff => Box::pin(async {
            let mut status = host.status.clone().unwrap_or_default();
            conditions::set(
                &mut status.conditions,
                Want::t(HELD_OFF, "OnlineFalse", "spec.online is false"),
                host.metadata.generation,
                &now,
            );
            let since = conditions::get(&status.conditions, HELD_OFF)
                .map(|c| {
                    now.0
                        .duration_since(c.last_transition_time.0)
                        .unsigned_abs()
                })
                .unwrap_or_default();
            let bmc = connect(ctx, &host).await;
            let power = read_power(match &bmc {
                Ok(b) => b.power_state().await.map_err(|e| Fault::from_bmc(&e)),
                Err(f) => Err(f.clone()),
            });
            let step = power_off_step(
                power.clone(),
                since,
                ctx.graceful_off,
                None,
                ctx.power_requests.last(&host_key),
            );
            if let (PowerOffStep::Request(action), Ok(b)) = (&step, &bmc) {
                match b.power(*action).await {
                    Ok(()) => {
                        ctx.power_requests.record(&host_key, *action);
                        ctx.events
                            .publish(
                                host.as_ref(),
                                false,
                                if *action == crate::bmc::PowerAction::ForceOff {
                                    "ForcedOff"
                                } else {
                                    "GracefulOff"
                                },
                                "holding the host powered off: spec.online is false",
                            )
                            .await;
                    }
                    Err(e) => {
                        tracing::warn!(host = %name, error = %e, "power-off request failed; will retry")
                    }
                }
            }
            if step == PowerOffStep::Done {
                ctx.power_requests.forget(&host_key);
            }
            let polled = poll_status(status, host.metadata.generation, power, &now);
            let status = settle(&host, polled, consumer, &facts, &sharers, &now);
            write_and_tell(ctx, &api, &host, &status).await?;
            Ok(Action::requeue(Duration::from_secs(3)))
        })
        .await,
        HostPlan::Poll => Box::pin(async {
            let result = read_power(match connect(ctx, &host).await {
                Err(f) => Err(f),
                Ok(bmc) => bmc.power_state().await.map_err(|e| Fault::from_bmc(&e)),
            });
            let current = host.status.clone().unwrap_or_default();
            let polled = poll_status(current, host.metadata.generation, result, &now);
            let status = settle(&host, polled, consumer, &facts, &sharers, &now);
            write_and_tell(ctx, &api, &host, &status).await?;
            Ok(Action::await_change())
        })
        .await,
        HostPlan::Wait => Box::pin(async {
            // No BMC call due, but the claim or its consumer may have moved on: settle the state.
            let status = settle(
                &host,
                host.status.clone().unwrap_or_default(),
                consumer,
                &facts,
                &sharers,
                &now,
            );
            if status.state != previous_state {
                // A new state is worth a fresh power reading (a boot or power-off just happened).
                let result = read_power(match connect(ctx, &host).await {
                    Err(f) => Err(f),
                    Ok(bmc) => bmc.power_state().await.map_err(|e| Fault::from_bmc(&e)),
                });
                let status = poll_status(status, host.metadata.generation, result, &now);
                write_and_tell(ctx, &api, &host, &status).await?;
                return Ok(Action::await_change());
            }
            write_and_tell(ctx, &api, &host, &status).await?;
            Ok(Action::await_change())
        })
        .await,
    }
}

/// Makes `clusterctl move` carry the host's credentials (and CA) Secret with it: MetalHosts move
/// as a hierarchy, but a Secret moves only when owned or labelled, and an owner reference would
/// let the garbage collector delete a Secret shared by hosts once the last of them is gone.
const CLUSTERCTL_MOVE_LABEL: &str = "clusterctl.cluster.x-k8s.io/move";

/// Whether a Secret's metadata stays in the store `label_secrets_for_move` reads: not a boot
/// Secret, nor bootstrap data (owned by a bootstrap config), which are never a BMC's credentials
/// or CA. Those two are one each per provisioned host, and were most of that store (about
/// 3.5 KB per host); their events still pass on (a boot Secret wakes its host).
fn may_be_bmc_secret(meta: &kube::api::ObjectMeta) -> bool {
    let boot = meta
        .labels
        .as_ref()
        .is_some_and(|l| l.contains_key(crate::boot::tokens::BOOT_TOKEN_LABEL));
    // The group of Cluster API's bootstrap configs: CABPK's KubeadmConfig, our CloudInitConfig.
    let bootstrap_data = meta
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.api_version.starts_with("bootstrap.cluster.x-k8s.io/"));
    !boot && !bootstrap_data
}

async fn label_secrets_for_move(ctx: &HostContext, host: &MetalHost) {
    let namespace = host.namespace().unwrap_or_default();
    let names = std::iter::once(&host.spec.bmc.credentials_name)
        .chain(host.spec.bmc.ca_secret_name.as_ref());
    for name in names {
        // Read from the watch's store: nothing is asked of the apiserver unless a label is missing.
        let unlabelled = ctx
            .secret_meta
            .get(&ObjectRef::new(name).within(&namespace))
            .is_some_and(|meta| !meta.labels().contains_key(CLUSTERCTL_MOVE_LABEL));
        if !unlabelled {
            continue;
        }
        let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
        let patch = serde_json::json!({"metadata": {"labels": {CLUSTERCTL_MOVE_LABEL: ""}}});
        if let Err(e) = secrets
            .patch_metadata(
                name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
        {
            tracing::warn!(secret = %name, error = %e, "cannot label the BMC Secret for clusterctl move");
        }
    }
}

fn error_policy(host: Arc<MetalHost>, error: &ReconcileError, ctx: Arc<HostContext>) -> Action {
    ctx.backoff
        .after_failure("MetalHost", &key(host.as_ref()), error)
}

/// The hosts whose credentials or CA Secret is `secret`. Every Secret change in the namespace
/// asks this (bootstrap Secrets too, one per machine): a lookup, not a scan of every host.
fn hosts_using(
    hosts: &crate::stores::Index<MetalHost>,
    namespace: &str,
    secret: &str,
) -> Vec<ObjectRef<MetalHost>> {
    hosts
        .get(&crate::controllers::metalmachine::claim::secret_key(
            namespace, secret,
        ))
        .iter()
        .map(|h| ObjectRef::from_obj(h.as_ref()))
        .collect()
}

/// What [`boot_mac_wakes`] follows of a host (`SharedStore::subscribe_events`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMac {
    place: (String, String),
    mac: Option<String>,
}

/// The view of a host [`boot_mac_wakes`] follows.
pub fn boot_mac(host: &MetalHost) -> HostMac {
    HostMac {
        place: (
            host.metadata.namespace.clone().unwrap_or_default(),
            host.metadata.name.clone().unwrap_or_default(),
        ),
        mac: crate::boot::ipxe::normalize_mac(&host.spec.boot_mac_address),
    }
}

/// The hosts to look at again when the set of hosts naming a boot MAC changes: a host that
/// comes to a MAC others name wakes them all, and one that leaves it (deleted, or its MAC
/// edited) wakes those left. A change that moves no host between MACs (a status write, most of
/// them) wakes nobody. The stream remembers the MAC of each host that shared one, so that
/// leaving it can be told; hosts alone with their MAC are not remembered.
fn boot_mac_wakes(
    events: impl futures::Stream<Item = watcher::Event<HostMac>> + Send,
    hosts: crate::stores::Index<MetalHost>,
) -> impl futures::Stream<Item = ObjectRef<MetalHost>> + Send {
    use crate::controllers::metalmachine::claim::boot_mac_key;
    let mut shared_at: std::collections::HashMap<(String, String), String> =
        std::collections::HashMap::new();
    events.flat_map(move |event| {
        let listed = |mac: &str| hosts.get(&boot_mac_key(mac));
        let mut wake = Vec::new();
        match event {
            watcher::Event::Apply(host) => {
                let before = shared_at.remove(&host.place);
                if let Some(left) = before.as_deref()
                    && host.mac.as_deref() != Some(left)
                {
                    wake.extend(listed(left));
                }
                if let Some(mac) = host.mac {
                    let members = listed(&mac);
                    if members.len() >= 2 {
                        if before.as_deref() != Some(mac.as_str()) {
                            // A newcomer: every member's status changes, and each is remembered
                            // so that its own next write is not taken for another coming.
                            for member in &members {
                                shared_at.insert(
                                    (
                                        member.metadata.namespace.clone().unwrap_or_default(),
                                        member.metadata.name.clone().unwrap_or_default(),
                                    ),
                                    mac.clone(),
                                );
                            }
                            wake.extend(members);
                        } else {
                            shared_at.insert(host.place, mac);
                        }
                    }
                }
            }
            watcher::Event::Delete(host) => {
                shared_at.remove(&host.place);
                if let Some(mac) = host.mac {
                    wake.extend(listed(&mac));
                }
            }
            // A re-list passes every host to the controller at its end.
            watcher::Event::Init => shared_at.clear(),
            watcher::Event::InitApply(_) | watcher::Event::InitDone => {}
        }
        futures::stream::iter(
            wake.iter()
                .map(|h| ObjectRef::from_obj(h.as_ref()))
                .collect::<Vec<_>>(),
        )
    })
}

/// The power poll, as one timer instead of one per host ([`super::sliced_sweep`]): every
/// `poll_interval / slices` (about a second), the hosts of the next slice (by a hash of their
/// names), so each host not paused gets a pass once per interval, spread over it. Each pass
/// returned `requeue(interval)` before. A reading taken between sweeps (a new state is read at
/// once) moves the next one to the sweep after, so a host is read at least every two intervals,
/// and in the steady state once per interval.
pub fn poll_sweep(
    hosts: Store<MetalHost>,
    poll_interval: Duration,
) -> impl futures::Stream<Item = ObjectRef<MetalHost>> + Send + 'static {
    let slices = poll_slices(poll_interval);
    super::sliced_sweep(hosts, poll_interval, slices, move |hosts, slice| {
        in_poll_slice(hosts, slice, slices)
    })
}

/// The sweep's slices: one per second of the interval, at least one.
fn poll_slices(poll_interval: Duration) -> u64 {
    poll_interval.as_secs().clamp(1, u32::MAX.into())
}

/// The hosts of `hosts` whose reading falls in `slice` of `slices`: each host not paused is in
/// exactly one (a paused host is left as it is, so nothing of it is read).
fn in_poll_slice(hosts: &[Arc<MetalHost>], slice: u64, slices: u64) -> Vec<ObjectRef<MetalHost>> {
    hosts
        .iter()
        .filter(|h| {
            !paused(h) && poll_slice(h.namespace().as_deref(), &h.name_any(), slices) == slice
        })
        .map(|h| ObjectRef::from_obj(h.as_ref()))
        .collect()
}

/// The slice of a host's reading: stable for its name, so its readings stay an interval apart.
fn poll_slice(namespace: Option<&str>, name: &str, slices: u64) -> u64 {
    crate::stable_hash::stable_hash(&(namespace, name)) % slices.max(1)
}

/// The controller over the shared host stream; a consumer's change (provisioned, deleting)
/// wakes its host, a changed credentials Secret re-checks the hosts using it, and a host that
/// comes to or leaves a boot MAC others name wakes them (`host_macs`: the shared host store's
/// events through [`boot_mac`]). Power readings come from [`poll_sweep`], added by [`run`].
pub fn controller(
    client: kube::Client,
    namespace: Option<&str>,
    stores: &SharedStores,
    hosts: crate::stores::Changes<MetalHost>,
    host_macs: futures::stream::BoxStream<'static, watcher::Event<HostMac>>,
    machines: crate::stores::Changes<MetalMachine>,
    secret_meta: kube::runtime::reflector::store::Writer<PartialObjectMeta<Secret>>,
) -> Controller<MetalHost> {
    let secrets: Api<PartialObjectMeta<Secret>> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let store = stores.host_index.clone();
    let claimed = stores.host_index.clone();
    // Credentials are re-checked as soon as their Secret changes (metadata only is watched, and
    // kept in a store for the move label).
    let secret_changes = crate::stores::reflector_keeping(
        secret_meta,
        |secret: &PartialObjectMeta<Secret>| {
            may_be_bmc_secret(&secret.metadata).then(|| secret.clone())
        },
        // Owners are kept for `may_be_bmc_secret`; the Secrets it keeps are few (a BMC's, a
        // cluster's kubeconfig and CA), not one per host.
        watcher(secrets, watcher::Config::default())
            .modify(|s| crate::stores::slim_secret_meta(s, &[crate::boot::tokens::ANN_HOST], true)),
    )
    .default_backoff()
    .touched_objects();
    Controller::for_shared_stream(hosts, stores.hosts.clone())
        .reconcile_on(boot_mac_wakes(host_macs, stores.host_index.clone()))
        .watches_stream(secret_changes, move |secret| {
            crate::controllers::hostbmc::forget_secret(
                &secret.namespace().unwrap_or_default(),
                &secret.name_any(),
            );
            let namespace = secret.namespace().unwrap_or_default();
            // A boot Secret wakes its host: the deploy agent's inspection lands there, and how
            // the BMC kept the power-on's one-time boot.
            if let Some(host) = crate::boot::tokens::boot_secret_host(&secret.metadata) {
                return vec![ObjectRef::new(host).within(&namespace)];
            }
            hosts_using(&store, &namespace, &secret.name_any())
        })
        .watches_shared_stream(machines, move |mm: Arc<MetalMachine>| {
            let namespace = mm.namespace().unwrap_or_default();
            // The machine names its host in status once it has one; a machine without that
            // (claiming, or restored without status) finds its hosts in the index by consumer.
            if let Some(host) = mm.status.as_ref().and_then(|s| s.host_ref.as_ref()) {
                return vec![ObjectRef::new(&host.name).within(&namespace)];
            }
            // A machine still claiming changes nothing a host derives its state from (the
            // claim is the host's own write, which wakes it), so it wakes none. One that has no
            // status yet may be new to the store, which changes its host's consumer from missing
            // to found.
            if mm.metadata.deletion_timestamp.is_none()
                && mm.spec.provider_id.is_none()
                && mm.status.is_some()
            {
                return Vec::new();
            }
            claimed
                .get(&crate::controllers::metalmachine::claim::consumer_key(
                    &namespace,
                    &mm.name_any(),
                ))
                .into_iter()
                .map(|h| ObjectRef::from_obj(h.as_ref()))
                .collect::<Vec<_>>()
        })
}

/// Runs the controller, with the power poll's sweep at the context's interval.
pub async fn run(controller: Controller<MetalHost>, ctx: Arc<HostContext>) {
    controller
        .reconcile_on(poll_sweep(ctx.stores.hosts.clone(), ctx.poll_interval))
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "MetalHost controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_move_check_keeps_every_secret_but_boot_and_bootstrap_data() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        let meta = |labels: &[&str], owner: Option<&str>| kube::api::ObjectMeta {
            name: Some("s".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|l| (l.to_string(), String::new()))
                    .collect(),
            ),
            owner_references: owner.map(|api_version| {
                vec![OwnerReference {
                    api_version: api_version.into(),
                    kind: "K".into(),
                    name: "o".into(),
                    uid: "u".into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        };
        let rows = [
            ("plain credentials", meta(&[], None), true),
            (
                "credentials labelled for a cluster",
                meta(&[crate::api::CLUSTER_NAME_LABEL], None),
                true,
            ),
            (
                "credentials owned by a host",
                meta(&[], Some("infrastructure.cluster.x-k8s.io/v1alpha1")),
                true,
            ),
            (
                "boot Secret",
                meta(
                    &[
                        crate::boot::tokens::BOOT_TOKEN_LABEL,
                        crate::api::CLUSTER_NAME_LABEL,
                    ],
                    None,
                ),
                false,
            ),
            (
                "bootstrap data of a CloudInitConfig or KubeadmConfig",
                meta(
                    &[crate::api::CLUSTER_NAME_LABEL],
                    Some("bootstrap.cluster.x-k8s.io/v1beta2"),
                ),
                false,
            ),
        ];
        for (what, meta, kept) in rows {
            assert_eq!(may_be_bmc_secret(&meta), kept, "{what}");
        }
    }

    /// The agent's view wins where it has one; the BMC's identity fields and NIC names stay.
    #[test]
    fn the_agents_inspection_is_merged_over_the_bmcs() {
        use crate::api::metalhost::{CpuInfo, DiskInfo, NicInfo};
        let bmc = HardwareInventory {
            manufacturer: Some("QEMU".into()),
            serial_number: Some("SN-1".into()),
            memory_mib: Some(2048),
            nics: vec![NicInfo {
                name: Some("NIC.1".into()),
                mac: Some("52:54:00:AA:00:01".into()),
                ..Default::default()
            }],
            ..Default::default()
        };
        let agent = HardwareInventory {
            cpu: Some(CpuInfo {
                count: 4,
                ..Default::default()
            }),
            memory_mib: Some(1000),
            disks: vec![DiskInfo {
                name: "vda".into(),
                size_bytes: 8 << 30,
                ..Default::default()
            }],
            nics: vec![NicInfo {
                mac: Some("52:54:00:aa:00:01".into()),
                link_up: Some(true),
                ..Default::default()
            }],
            firmware_mode: Some("BIOS".into()),
            ..Default::default()
        };
        let merged = super::merge_inspection(Some(&bmc), &agent);
        assert_eq!(merged.manufacturer.as_deref(), Some("QEMU"));
        assert_eq!(merged.serial_number.as_deref(), Some("SN-1"));
        assert_eq!(merged.memory_mib, Some(1000), "the agent's memory");
        assert_eq!(merged.disks.len(), 1);
        assert_eq!(merged.nics[0].name.as_deref(), Some("NIC.1"));
        assert_eq!(merged.nics[0].link_up, Some(true));
        assert_eq!(super::merge_inspection(None, &agent), agent);
    }

    use super::*;
    use crate::api::metalhost::{ConsumerReference, MetalHostSpec};

    fn at(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + secs).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
    }

    fn host(status: Option<MetalHostStatus>, online: bool) -> MetalHost {
        let mut h = MetalHost::new(
            "h",
            MetalHostSpec {
                online,
                ..MetalHostSpec::for_tests()
            },
        );
        h.status = status;
        h
    }

    fn registered(state: HostState, power: PowerState, checked: i64) -> MetalHostStatus {
        let mut s = MetalHostStatus {
            state: Some(state),
            power_state: Some(power),
            last_power_check: Some(Time(at(checked))),
            ..Default::default()
        };
        conditions::set(
            &mut s.conditions,
            Want::t(REGISTERED, "Registered", ""),
            None,
            &Time(at(0)),
        );
        s
    }

    #[test]
    fn plan_table() {
        let five_min = Duration::from_secs(300);
        let mut paused = host(
            Some(registered(HostState::Available, PowerState::Off, 0)),
            true,
        );
        paused.metadata.annotations =
            Some([(HOST_PAUSED_ANNOTATION.to_string(), "".to_string())].into());
        let mut reg_error = registered(HostState::Error, PowerState::Unknown, 0);
        reg_error.error_type = Some(HostErrorType::RegistrationError);
        let cases: Vec<(&str, MetalHost, i64, HostPlan)> = vec![
            (
                "new host registers",
                host(None, true),
                0,
                HostPlan::Register,
            ),
            (
                "registration error retries",
                host(Some(reg_error), true),
                10,
                HostPlan::Register,
            ),
            ("paused does nothing", paused, 10, HostPlan::Paused),
            (
                "fresh power reading waits",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                100,
                HostPlan::Wait,
            ),
            (
                "a reading just short of its share of the interval waits",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                269,
                HostPlan::Wait,
            ),
            (
                "a reading taken at the last sweep is due at this one, though that pass was late",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                270,
                HostPlan::Poll,
            ),
            (
                "stale power reading polls",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                300,
                HostPlan::Poll,
            ),
            (
                "offline host that is on is powered off",
                host(
                    Some(registered(HostState::Available, PowerState::On, 0)),
                    false,
                ),
                10,
                HostPlan::HoldOff,
            ),
            (
                "offline host that is off just polls",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    false,
                ),
                400,
                HostPlan::Poll,
            ),
        ];
        for (what, h, now, want) in cases {
            assert_eq!(plan(&h, at(now), five_min, None), want, "{what}");
        }
    }

    /// Over one poll interval, the sweep names each host that is not paused exactly once, and
    /// no other: what a per-host `requeue(interval)` gave, spread over the interval.
    #[test]
    fn the_poll_sweep_names_each_host_once_per_interval() {
        let named_host = |namespace: &str, name: &str| {
            let mut h = host(None, true);
            h.metadata.name = Some(name.to_string());
            h.metadata.namespace = Some(namespace.to_string());
            Arc::new(h)
        };
        let mut hosts: Vec<_> = (0..3000)
            .map(|i| named_host(if i % 2 == 0 { "a" } else { "b" }, &format!("h{i}")))
            .collect();
        let mut held = host(None, true);
        held.metadata.name = Some("held".into());
        held.metadata.annotations =
            Some([(HOST_PAUSED_ANNOTATION.to_string(), "".to_string())].into());
        hosts.push(Arc::new(held));
        let slices = poll_slices(Duration::from_secs(300));
        assert_eq!(slices, 300);
        let mut named: std::collections::HashMap<String, usize> = Default::default();
        let mut busiest = 0;
        for slice in 0..slices {
            let due = in_poll_slice(&hosts, slice, slices);
            busiest = busiest.max(due.len());
            for reference in due {
                *named.entry(reference.to_string()).or_default() += 1;
            }
        }
        assert_eq!(named.len(), 3000, "every host but the paused one");
        assert!(named.values().all(|n| *n == 1), "each once");
        assert!(!named.keys().any(|k| k.contains("held")));
        // Spread, not bunched: 3,000 over 300 slices is 10 a slice on average.
        assert!(busiest <= 40, "a slice named {busiest} hosts");
        // An interval under a second still sweeps, in one slice.
        assert_eq!(poll_slices(Duration::from_millis(500)), 1);
        assert_eq!(in_poll_slice(&hosts, 0, 1).len(), 3000);
    }

    #[test]
    fn a_reading_kept_in_memory_defers_the_next_one() {
        let five_min = Duration::from_secs(300);
        let h = host(
            Some(registered(HostState::Available, PowerState::Off, 0)),
            true,
        );
        assert_eq!(plan(&h, at(400), five_min, None), HostPlan::Poll);
        assert_eq!(
            plan(&h, at(400), five_min, Some(at(350))),
            HostPlan::Wait,
            "read 50 s ago, though status still says 400 s"
        );
    }

    #[test]
    fn only_a_power_reading_that_changes_something_is_written() {
        let mut shown = registered(HostState::Available, PowerState::Off, 0);
        conditions::set(
            &mut shown.conditions,
            Want::t(BMC_REACHABLE, "BmcReachable", ""),
            None,
            &Time(at(0)),
        );
        let later = Time(at(400));
        assert_eq!(
            poll_status(shown.clone(), None, Ok(PowerState::Off), &later),
            shown,
            "same power, still reachable: nothing to write"
        );
        let on = poll_status(shown.clone(), None, Ok(PowerState::On), &later);
        assert_eq!(on.power_state, Some(PowerState::On));
        assert_eq!(on.last_power_check, Some(later.clone()));
        let lost = poll_status(
            shown,
            None,
            Err(Fault {
                reason: "BmcUnreachable",
                message: "connection refused".into(),
            }),
            &later,
        );
        assert_eq!(lost.power_state, Some(PowerState::Unknown));
        assert_eq!(lost.last_power_check, Some(later));
        assert!(!conditions::is_true(&lost.conditions, BMC_REACHABLE));
    }

    #[test]
    fn registration_outcomes() {
        let now = Time(at(5));
        let ok = registration_status(
            &host(None, true),
            Ok((PowerState::Off, Some(HardwareInventory::default()), None)),
            &now,
        );
        assert_eq!(ok.state, Some(HostState::Available));
        assert!(conditions::is_true(&ok.conditions, REGISTERED));
        assert!(ok.hardware.is_some());

        let bad = registration_status(
            &host(None, true),
            Err(Fault {
                reason: "BmcAuthFailed",
                message: "refused user admin".into(),
            }),
            &now,
        );
        assert_eq!(bad.state, Some(HostState::Error));
        assert_eq!(bad.error_type, Some(HostErrorType::RegistrationError));
        let c = conditions::get(&bad.conditions, REGISTERED).expect("condition");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "BmcAuthFailed")
        );

        // A claimed host that re-registers (e.g. credentials rotated) keeps its provisioning state.
        let mut claimed = host(
            Some(registered(HostState::Provisioned, PowerState::On, 0)),
            true,
        );
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "ns"));
        let status = registration_status(&claimed, Ok((PowerState::On, None, None)), &now);
        let kept = settle(
            &claimed,
            status,
            Consumer::Provisioned,
            &AttemptFacts::default(),
            &MacSharers::default(),
            &now,
        );
        assert_eq!(kept.state, Some(HostState::Provisioned));
    }

    /// How the BMC kept the power-on's one-time boot, learned by the MetalMachine controller on
    /// the boot Secret, fills the probe record's `bootOnce` when it is unknown; a known value
    /// stays, and without a probe record there is nothing to fill. It is written with the next
    /// change of the status, never alone.
    #[test]
    fn the_probe_record_learns_how_the_bmc_keeps_a_one_time_boot() {
        use crate::api::metalhost::BmcCapabilities;
        let now = Time(at(5));
        let probed = |once: Option<BootOnce>| {
            let mut status = registered(HostState::Provisioning, PowerState::On, 0);
            status.bmc = Some(BmcCapabilities {
                protocol: "Redfish".into(),
                boot_once: once,
                ..Default::default()
            });
            status
        };
        let mut claimed = host(Some(probed(None)), true);
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "ns"));
        let learned = |once| AttemptFacts {
            inspection: None,
            boot_once: once,
        };
        let rows = [
            (
                "unknown, learned Continuous",
                probed(None),
                Some(BootOnce::Continuous),
                Some(BootOnce::Continuous),
            ),
            (
                "unknown, learned Honoured",
                probed(None),
                Some(BootOnce::Honoured),
                Some(BootOnce::Honoured),
            ),
            ("unknown, nothing learned", probed(None), None, None),
            (
                "known stays",
                probed(Some(BootOnce::Honoured)),
                Some(BootOnce::Continuous),
                Some(BootOnce::Honoured),
            ),
        ];
        for (what, status, fact, want) in rows {
            // The consumer's providerID moves the state: a write that the fact may ride with.
            let settled = settle(
                &claimed,
                status,
                Consumer::Provisioned,
                &learned(fact),
                &MacSharers::default(),
                &now,
            );
            assert_eq!(settled.bmc.and_then(|b| b.boot_once), want, "{what}");
        }
        let unprobed = registered(HostState::Provisioning, PowerState::On, 0);
        let settled = settle(
            &claimed,
            unprobed,
            Consumer::Provisioning,
            &learned(Some(BootOnce::Continuous)),
            &MacSharers::default(),
            &now,
        );
        assert_eq!(settled.bmc, None, "no probe record is made up");

        // Learned while nothing else in the status changes: it waits for the next write, and
        // rides with it.
        let written = settle(
            &claimed,
            probed(None),
            Consumer::Provisioning,
            &learned(None),
            &MacSharers::default(),
            &now,
        );
        let mut quiet = host(Some(written.clone()), true);
        quiet.spec.consumer_ref = claimed.spec.consumer_ref.clone();
        let alone = settle(
            &quiet,
            written.clone(),
            Consumer::Provisioning,
            &learned(Some(BootOnce::Continuous)),
            &MacSharers::default(),
            &now,
        );
        assert_eq!(alone, written, "a write for the learned fact alone");
        let with_provisioned = settle(
            &quiet,
            written,
            Consumer::Provisioned,
            &learned(Some(BootOnce::Continuous)),
            &MacSharers::default(),
            &now,
        );
        assert_eq!(
            (
                with_provisioned.state,
                with_provisioned.bmc.and_then(|b| b.boot_once)
            ),
            (Some(HostState::Provisioned), Some(BootOnce::Continuous)),
            "the next write carries it"
        );
    }

    /// A shared boot MAC puts an unclaimed host in Error with its own type, message and
    /// condition, all gone once the MAC is its own again; a failed release's error wins over it.
    #[test]
    fn a_shared_boot_mac_is_said_and_unsaid() {
        let now = Time(at(5));
        let free = host(
            Some(registered(HostState::Available, PowerState::Off, 0)),
            true,
        );
        let others = MacSharers {
            first: vec!["ns/copy".to_string()],
            count: 1,
        };
        let facts = AttemptFacts::default();
        let shared = settle(
            &free,
            free.status.clone().unwrap_or_default(),
            Consumer::Unclaimed,
            &facts,
            &others,
            &now,
        );
        assert_eq!(shared.state, Some(HostState::Error));
        assert_eq!(shared.error_type, Some(HostErrorType::BootMACShared));
        let message = shared.error_message.clone().unwrap_or_default();
        assert!(message.contains("MetalHost ns/copy"), "{message}");
        let condition = conditions::get(&shared.conditions, BOOT_MAC_SHARED).expect("condition");
        assert_eq!(condition.status, "True");
        assert_eq!(condition.message, message);

        let mut was_shared = free.clone();
        was_shared.status = Some(shared);
        let alone = settle(
            &was_shared,
            was_shared.status.clone().unwrap_or_default(),
            Consumer::Unclaimed,
            &facts,
            &MacSharers::default(),
            &now,
        );
        assert_eq!(alone.state, Some(HostState::Available));
        assert_eq!((alone.error_type, alone.error_message), (None, None));
        assert!(conditions::get(&alone.conditions, BOOT_MAC_SHARED).is_none());

        let mut abandoned = free.clone();
        abandoned.metadata.annotations = Some(
            [(
                DEPROVISION_FAILED_ANNOTATION.to_string(),
                "BMC gone".to_string(),
            )]
            .into(),
        );
        let both = settle(
            &abandoned,
            abandoned.status.clone().unwrap_or_default(),
            Consumer::Unclaimed,
            &facts,
            &others,
            &now,
        );
        assert_eq!(both.error_type, Some(HostErrorType::DeprovisioningError));
        assert_eq!(both.error_message.as_deref(), Some("BMC gone"));
        assert!(conditions::is_true(&both.conditions, BOOT_MAC_SHARED));
    }

    /// A host that comes to a MAC another host names wakes both, once: their own status writes
    /// after that wake nobody. One that leaves the MAC, by an edit or by deletion, wakes those
    /// left. A host alone with its MAC, or without a readable one, wakes nobody.
    #[tokio::test]
    async fn hosts_are_woken_when_the_hosts_naming_their_boot_mac_change() {
        use kube::runtime::reflector;
        use watcher::Event;
        let named = |name: &str, mac: &str| {
            let mut h = host(None, true);
            h.metadata.name = Some(name.into());
            h.metadata.namespace = Some("ns".into());
            h.spec.boot_mac_address = mac.into();
            h
        };
        let (store, mut writer) = reflector::store::<MetalHost>();
        let index =
            crate::stores::Index::new(crate::controllers::metalmachine::claim::host_index_keys);
        let a = named("a", "52:54:00:00:00:0a");
        let copy = named("copy", "52:54:00:00:00:0A");
        let mut a_in_error = a.clone();
        a_in_error.status = Some(registered(HostState::Error, PowerState::Off, 0));
        let mut copy_fixed = copy.clone();
        copy_fixed.spec.boot_mac_address = "52:54:00:00:00:0c".into();
        let steps: Vec<(&str, Event<MetalHost>, Vec<&str>)> = vec![
            ("a alone", Event::Apply(a.clone()), vec![]),
            (
                "another alone",
                Event::Apply(named("alone", "52:54:00:00:00:0b")),
                vec![],
            ),
            (
                "the copy comes",
                Event::Apply(copy.clone()),
                vec!["a", "copy"],
            ),
            ("a's status write", Event::Apply(a_in_error.clone()), vec![]),
            (
                "the copy's status write",
                Event::Apply(copy.clone()),
                vec![],
            ),
            (
                "the copy's MAC is fixed",
                Event::Apply(copy_fixed.clone()),
                vec!["a"],
            ),
            (
                "the fixed copy again",
                Event::Apply(copy_fixed.clone()),
                vec![],
            ),
            (
                "the copy comes back",
                Event::Apply(copy.clone()),
                vec!["a", "copy"],
            ),
            (
                "the copy is deleted",
                Event::Delete(copy.clone()),
                vec!["a"],
            ),
            ("a is deleted", Event::Delete(a.clone()), vec![]),
            ("no MAC", Event::Apply(named("bad", "not a MAC")), vec![]),
        ];
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let mut woken = boot_mac_wakes(rx, index.clone());
        for (what, event, want) in steps {
            index.apply(&mut writer, &store, &event);
            let viewed = match &event {
                Event::Apply(h) => Event::Apply(boot_mac(h)),
                Event::Delete(h) => Event::Delete(boot_mac(h)),
                _ => Event::InitDone,
            };
            let _ = tx.unbounded_send(viewed);
            // What the event woke is ready at once; then the stream waits for the next event.
            let mut got = Vec::new();
            while let Some(Some(next)) = futures::FutureExt::now_or_never(woken.next()) {
                got.push(next.name);
            }
            assert_eq!(got, want, "{what}");
        }
    }

    /// One row per rule of `desired_state`.
    #[test]
    fn state_is_derived_from_the_claim() {
        let claimed = |state: HostState| {
            let mut h = host(Some(registered(state, PowerState::On, 0)), true);
            h.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "ns"));
            h
        };
        let mut abandoned = host(
            Some(registered(HostState::Deprovisioning, PowerState::On, 0)),
            true,
        );
        abandoned.metadata.annotations = Some(
            [(
                DEPROVISION_FAILED_ANNOTATION.to_string(),
                "BMC gone".to_string(),
            )]
            .into(),
        );
        let mut restored = claimed(HostState::Registering);
        restored.status = Some(registered(HostState::Registering, PowerState::On, 0));
        let rows: Vec<(&str, MetalHost, Consumer, bool, HostState)> = vec![
            (
                "unclaimed, registered: Available",
                host(
                    Some(registered(HostState::Registering, PowerState::Off, 0)),
                    true,
                ),
                Consumer::Unclaimed,
                false,
                HostState::Available,
            ),
            (
                "claimed, consumer booting",
                claimed(HostState::Available),
                Consumer::Provisioning,
                false,
                HostState::Provisioning,
            ),
            (
                "claimed, consumer has a providerID",
                claimed(HostState::Provisioning),
                Consumer::Provisioned,
                false,
                HostState::Provisioned,
            ),
            (
                "claimed, consumer deleting",
                claimed(HostState::Provisioned),
                Consumer::Deleting,
                false,
                HostState::Deprovisioning,
            ),
            (
                "claimed, consumer missing: keeps its busy state",
                claimed(HostState::Provisioned),
                Consumer::Missing,
                false,
                HostState::Provisioned,
            ),
            (
                "restored from a backup (status empty), consumer not there yet: never Available",
                restored,
                Consumer::Missing,
                false,
                HostState::Provisioned,
            ),
            (
                "released after a failed power-off: Error",
                abandoned,
                Consumer::Unclaimed,
                false,
                HostState::Error,
            ),
            (
                "unclaimed, another host names its boot MAC: Error (never claimed)",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                Consumer::Unclaimed,
                true,
                HostState::Error,
            ),
            (
                "claimed, another host names its boot MAC: keeps its state (a node stays up)",
                claimed(HostState::Provisioned),
                Consumer::Provisioned,
                true,
                HostState::Provisioned,
            ),
        ];
        for (what, h, consumer, shared, want) in rows {
            let status = h.status.clone().unwrap_or_default();
            assert_eq!(desired_state(&h, &status, consumer, shared), want, "{what}");
        }
        let unregistered = host(None, true);
        assert_eq!(
            desired_state(
                &unregistered,
                &MetalHostStatus::default(),
                Consumer::Provisioning,
                true
            ),
            HostState::Registering,
            "registration comes first"
        );
    }
}

#[cfg(test)]
mod task_size {
    /// Each running pass is a task of this size, up to CONCURRENT_PASSES of them; the pass
    /// itself is boxed (see `instrumented`). Unboxed, this task was 14,016 bytes.
    #[test]
    fn a_metalhost_pass_task_holds_its_pass_boxed() {
        let size = crate::controllers::future_size(super::reconcile as fn(_, _) -> _);
        assert!(
            size <= 2048,
            "the MetalHost reconcile future is {size} bytes"
        );
    }

    /// The boxed pass itself, up to CONCURRENT_PASSES of them at once: each plan's work boxed,
    /// so a pass carries the stage it is in, not the largest. Unboxed stages, it was 7,496 bytes.
    #[test]
    fn a_metalhost_pass_boxes_its_stages() {
        let size = crate::controllers::future_size(super::pass as fn(_, _) -> _);
        assert!(size <= 3072, "the MetalHost pass future is {size} bytes");
    }
}

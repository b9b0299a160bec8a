//! What the MetalMachine controller decides, as one pure function of what it observed: the
//! status the object should have, the one next step, and when to look again. Every rule of
//! seed 004 (the infrastructure-machine contract) is a gate here, in the seed's order, and a row
//! in the table tests below. No I/O happens here.

use std::time::Duration;

use kube::ResourceExt;

use crate::agent::wipe::WipeMode;
use crate::api::common::{MachineAddress, MachineAddressType};
use crate::api::metalhost::PowerState;
use crate::api::metalhost::{BootOnce, CleaningMode};
use crate::api::metalmachine::ProvisioningMode;
use crate::api::metalmachine::{
    HostReference, MachineInitialization, MetalMachinePhase, MetalMachineStatus,
};
use crate::api::{MetalHost, MetalMachine, PAUSED_ANNOTATION};
use crate::bmc::PowerAction;
use crate::boot::tokens::{BootRecord, CallbackRecord};
use crate::controllers::conditions::{self, Want};
use crate::controllers::power::{Fault, PowerOffStep, power_off_step};

use super::claim;
use super::observe::{BootObservation, Observed, OwnerObservation};
use super::{BOOT_READY, FINALIZER, HOST_ASSOCIATED, PAUSED, READY};

/// Settings that shape decisions (from the manager's flags).
#[derive(Debug, Clone)]
pub struct Policy {
    /// How long a graceful power-off may take before it is forced.
    pub graceful_off: Duration,
    /// How long deletion keeps trying an unreachable BMC before releasing the machine anyway.
    pub deprovision_timeout: Duration,
}

/// The one side effect of a pass. Everything but `Nothing` is done by `act`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    Nothing,
    AddFinalizer,
    RemoveFinalizer,
    /// Set `spec.consumerRef` of this host, conditioned on the resourceVersion we decided from.
    Claim {
        host: String,
        resource_version: String,
    },
    /// Create the boot Secret of attempt 1 (fresh token, bootstrap data snapshot).
    Mint {
        host: String,
        provider_id: String,
    },
    /// One-time network boot and power on (or cycle); then note the power-on on the boot Secret.
    PowerOn {
        host: String,
        attempt: u32,
    },
    /// Replace the boot Secret with the next attempt (new token): the old token dies with it.
    NextAttempt,
    /// Record the outcome on the MetalMachine's spec and metadata (moved by clusterctl, unlike
    /// status): providerID, failure domain and the callback's addresses.
    RecordProvisioned {
        provider_id: String,
        failure_domain: Option<String>,
        addresses: Vec<MachineAddress>,
    },
    /// Point the host's next boot back at its disk (best effort: the BMC may refuse).
    BootFromDisk {
        host: String,
    },
    /// Image mode, image written: boot the disk and restart the host into it, then note the
    /// restart on the boot Secret so it happens once.
    RestartToDisk {
        host: String,
    },
    /// Note on the boot Secret a power action already sent for this attempt whose note was
    /// refused or lost (see [`UnrecordedPower`]): the write alone, no BMC call.
    RecordPower(UnrecordedPower),
    /// Replace (or create) the boot Secret with a cleaning attempt for the released host: a fresh
    /// token that boots the deploy agent to wipe its disks; the provisioning token dies.
    StartCleaning {
        host: String,
        mode: WipeMode,
    },
    /// Live mode, provisioned: arm the host's next network boot. The boot Secret is replaced
    /// (or re-created) with a fresh token for that boot; the token of the boot that just called
    /// back dies with the replace. With `netboot`, after a boot consumed the one-time network
    /// boot, the next boot is set to the network again (best effort).
    ArmNextBoot {
        host: String,
        netboot: bool,
    },
    /// Delete the boot Secret: the token dies.
    DeleteBootSecret,
    /// Send a power-off request for deprovisioning.
    PowerOff {
        host: String,
        action: PowerAction,
    },
    /// Clear the host's `spec.consumerRef` (resourceVersion precondition). With a fault, the
    /// host is also marked for an operator (it could not be powered off).
    Release {
        host: String,
        resource_version: String,
        fault: Option<Fault>,
    },
}

/// A power action this manager sent for the current attempt (by boot Secret UID and attempt)
/// whose note on the boot Secret (`poweredAt`, `diskBootAt`) has not been written. The action
/// cannot be conditioned on a resourceVersion, the note can: a note refused (a 409 from a boot
/// service write, a 429 from a throttled apiserver) left a store that says "not powered yet",
/// and the next pass powered the host again, cycling it mid-boot. Kept in memory until the
/// note is written or the store shows it; after a restart the action is sent once more, as
/// every power request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnrecordedPower {
    pub secret_uid: String,
    pub attempt: u32,
    /// A cleaning attempt replaces the provisioning one in the same Secret (same UID), and
    /// counts its attempts from 1 again.
    pub cleaning: bool,
    /// The attempt's token, by its non-secret fingerprint: every attempt, cleaning and boot
    /// has a fresh one, also when a Secret is replaced under the same UID and attempt.
    pub token: String,
    pub at: jiff::Timestamp,
    pub kind: PoweredFor,
}

/// What an [`UnrecordedPower`] is to the attempt the store shows now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeptPower {
    /// Sent for this attempt, not noted on it yet: decide notes it instead of acting again.
    Unnoted,
    /// Sent for this attempt, and the record carries the note: nothing is left to keep.
    Noted,
    /// Sent for another attempt (or Secret): it says nothing about this one.
    OtherAttempt,
}

impl UnrecordedPower {
    /// The record of the attempt this action was sent for, of `secret` (its UID).
    pub fn for_attempt(
        secret_uid: Option<&str>,
        record: &BootRecord,
        at: jiff::Timestamp,
        kind: PoweredFor,
    ) -> Self {
        UnrecordedPower {
            secret_uid: secret_uid.unwrap_or_default().to_string(),
            attempt: record.attempt,
            cleaning: record.clean.is_some(),
            token: record.token.fingerprint(),
            at,
            kind,
        }
    }

    /// This action, against the attempt `record` of the Secret whose UID is `secret_uid`.
    pub fn against(&self, secret_uid: Option<&str>, record: &BootRecord) -> KeptPower {
        let same_attempt = secret_uid == Some(self.secret_uid.as_str())
            && record.attempt == self.attempt
            && record.clean.is_some() == self.cleaning
            && record.token.fingerprint() == self.token;
        let noted = match self.kind {
            PoweredFor::NetworkBoot(_) => record.powered_at.is_some(),
            PoweredFor::DiskBoot => record.disk_boot_at.is_some(),
        };
        match (same_attempt, noted) {
            (false, _) => KeptPower::OtherAttempt,
            (true, true) => KeptPower::Noted,
            (true, false) => KeptPower::Unnoted,
        }
    }
}

/// What an [`UnrecordedPower`] started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoweredFor {
    /// The one-time network boot of the attempt (provisioning or cleaning), with how the BMC
    /// kept the override, when it was read back.
    NetworkBoot(Option<BootOnce>),
    /// Image mode: the restart into the written disk.
    DiskBoot,
}

/// The step that powers the host for `kind`, unless this manager already did for this attempt
/// and only the note is missing: then the note alone.
fn power_step(o: &Observed, kind: PoweredFor, send: Step) -> Step {
    match &o.unrecorded_power {
        Some(sent)
            if matches!(
                (sent.kind, kind),
                (PoweredFor::NetworkBoot(_), PoweredFor::NetworkBoot(_))
                    | (PoweredFor::DiskBoot, PoweredFor::DiskBoot)
            ) =>
        {
            Step::RecordPower(sent.clone())
        }
        _ => send,
    }
}

/// An Event to publish once the step succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: &'static str,
    pub message: String,
}

/// The outcome of `decide`.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub status: MetalMachineStatus,
    pub step: Step,
    /// When to look again without a change; None waits for a watch event.
    pub requeue: Option<Duration>,
    pub note: Option<Note>,
}

impl Decision {
    fn new(status: MetalMachineStatus, step: Step, requeue: Option<Duration>) -> Self {
        Decision {
            status,
            step,
            requeue,
            note: None,
        }
    }
    /// The machine became ready: announced by the pass that makes it so (see `decide_boot`).
    fn noting_provisioned(self, host_name: &str, provider_id: &str) -> Self {
        self.noting(
            false,
            "Provisioned",
            format!("MetalHost {host_name} bootstrapped; providerID {provider_id}"),
        )
    }
    fn noting(mut self, warning: bool, reason: &'static str, message: String) -> Self {
        self.note = Some(Note {
            warning,
            reason,
            message,
        });
        self
    }
}

/// providerID of a provisioning: unique per MetalMachine object (its UID), so a Node left over
/// from a host's previous tenant can never match the next Machine on that host.
pub fn provider_id(namespace: &str, host: &str, metal_machine_uid: &str) -> String {
    format!("metalboot://{namespace}/{host}/{metal_machine_uid}")
}

/// Where one provisioning attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootStep {
    /// Boot Secret exists but the host was not powered for it yet (first time, or a restart
    /// between minting and powering): set one-time network boot and power on.
    Power,
    /// Powered; waiting for the callback.
    Wait(Duration),
    /// Timed out; roll to the next attempt and power-cycle.
    Retry { next_attempt: u32 },
    /// Timed out on the last allowed attempt.
    GiveUp { attempts: u32 },
    /// The host called back.
    Finish,
}

pub fn boot_step(
    record: &BootRecord,
    now: jiff::Timestamp,
    timeout_seconds: i32,
    retries: i32,
) -> BootStep {
    boot_step_since(record, record.powered_at, now, timeout_seconds, retries)
}

/// `boot_step` with the timeout counted from `since` (image mode restarts the clock when the
/// host is restarted into its disk); None: not powered for this attempt yet.
fn boot_step_since(
    record: &BootRecord,
    since: Option<jiff::Timestamp>,
    now: jiff::Timestamp,
    timeout_seconds: i32,
    retries: i32,
) -> BootStep {
    if record.callback.is_some() {
        return BootStep::Finish;
    }
    let Some(powered_at) = since else {
        return BootStep::Power;
    };
    let elapsed = now.duration_since(powered_at).as_secs().max(0);
    let timeout = i64::from(timeout_seconds.max(1));
    if elapsed < timeout {
        return BootStep::Wait(Duration::from_secs((timeout - elapsed) as u64));
    }
    let allowed_attempts = (retries.max(0) as u32).saturating_add(1);
    if record.attempt < allowed_attempts {
        BootStep::Retry {
            next_attempt: record.attempt + 1,
        }
    } else {
        BootStep::GiveUp {
            attempts: record.attempt,
        }
    }
}

/// How long the deploy agent may stay silent while it writes before the attempt is failed.
pub const AGENT_SILENCE: Duration = Duration::from_secs(180);

/// Where an image-mode attempt stands once the host was powered for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageStep {
    /// The deploy agent has not reported yet.
    AwaitingAgent,
    /// Writing; the message says how far.
    Writing(String),
    /// The write failed (or the agent fell silent): the reason names why.
    Failed { reason: String, message: String },
    /// Written: restart the host into its disk.
    Restart,
    /// Restarted into the disk: the installed OS boots and calls back.
    BootingDisk,
}

pub fn image_step(record: &BootRecord, now: jiff::Timestamp) -> ImageStep {
    use crate::agent::protocol::DeployState;
    let Some(report) = &record.deploy else {
        return ImageStep::AwaitingAgent;
    };
    match report.state {
        DeployState::Written if record.disk_boot_at.is_some() => ImageStep::BootingDisk,
        DeployState::Written => ImageStep::Restart,
        // The boot service never records a cleaning outcome on a deployment.
        DeployState::Cleaned => ImageStep::Failed {
            reason: "AgentFailed".into(),
            message: "the deploy agent reported a cleaning on a deployment".into(),
        },
        DeployState::Failed => ImageStep::Failed {
            reason: report
                .reason
                .clone()
                .unwrap_or_else(|| "AgentFailed".into()),
            message: report.message.clone().unwrap_or_default(),
        },
        DeployState::Writing => {
            let last = report
                .received_at
                .as_deref()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok());
            if last.is_some_and(|t| now.duration_since(t).unsigned_abs() > AGENT_SILENCE) {
                return ImageStep::Failed {
                    reason: "AgentSilent".into(),
                    message: format!(
                        "the deploy agent has not reported for more than {} s",
                        AGENT_SILENCE.as_secs()
                    ),
                };
            }
            let mib = |b: u64| b / (1 << 20);
            let total = report
                .total_bytes
                .map(|t| format!(" of {} MiB", mib(t)))
                .unwrap_or_default();
            ImageStep::Writing(format!(
                "writing the image to {}: {} MiB{total} at {} MiB/s",
                report.device.as_deref().unwrap_or("its disk"),
                mib(report.written_bytes),
                mib(report.bytes_per_second)
            ))
        }
    }
}

/// Machine addresses from a callback: each routable IP as InternalIP, the hostname (or the host
/// name) as Hostname.
pub fn addresses_from(callback: &CallbackRecord, host_name: &str) -> Vec<MachineAddress> {
    let mut out: Vec<MachineAddress> = callback
        .addresses
        .iter()
        .filter(|ip| !ip.is_loopback() && !is_link_local(ip))
        .map(|ip| MachineAddress {
            type_: MachineAddressType::InternalIP,
            address: ip.to_string(),
        })
        .collect();
    out.push(MachineAddress {
        type_: MachineAddressType::Hostname,
        address: callback
            .hostname
            .clone()
            .unwrap_or_else(|| host_name.to_string()),
    });
    out
}

fn is_link_local(ip: &std::net::IpAddr) -> bool {
    match ip {
        std::net::IpAddr::V4(v4) => v4.is_link_local(),
        std::net::IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// Status bookkeeping for one decision: conditions stamped with one time and generation.
struct StatusDraft {
    status: MetalMachineStatus,
    generation: Option<i64>,
    now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
}

impl StatusDraft {
    fn set(&mut self, want: Want<'_>) {
        conditions::set(
            &mut self.status.conditions,
            want,
            self.generation,
            &self.now,
        );
    }
    /// Phase and Ready=False with a reason, the shape of every "waiting for …" gate.
    fn waiting(mut self, phase: MetalMachinePhase, reason: &str, message: String) -> Self {
        self.status.phase = Some(phase);
        self.set(Want::f(READY, reason, message));
        self
    }
    fn done(self) -> MetalMachineStatus {
        self.status
    }
}

/// Re-polls while waiting on a gate that no watch covers for sure (a Machine or Cluster that
/// does not exist yet comes with a watch event, so this is only a safety net).
const GATE_RESYNC: Duration = Duration::from_secs(60);
/// While the host boots: how often to look at the timeout.
const BOOT_POLL: Duration = Duration::from_secs(30);
/// While a host powers off.
const POWER_OFF_POLL: Duration = Duration::from_secs(3);
/// How long after a power-on an Off read is not trusted during deprovisioning: BMCs apply
/// power actions asynchronously (sushy-tools' emulator within 11 s).
pub const POWER_SETTLE: Duration = Duration::from_secs(15);

/// The decision for one MetalMachine.
pub fn decide(o: &Observed, policy: &Policy) -> Decision {
    let mm = o.mm.as_ref();
    let observed_status = mm.status.clone().unwrap_or_default();
    let mut draft = StatusDraft {
        status: observed_status.clone(),
        generation: mm.metadata.generation,
        now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(o.now),
    };
    draft.status.observed_generation = mm.metadata.generation;
    if mm.metadata.deletion_timestamp.is_some() {
        return decide_deletion(o, draft, policy);
    }
    // Gate 1: a Machine owns this object.
    let machine = match &o.owner {
        OwnerObservation::Found(machine) => machine.clone(),
        // Seed 004: without a Machine owner, exit the reconciliation, status untouched (as
        // CAPD, CAPV and CAPK do). The Machine controller sets the owner within moments of the
        // object's creation; a "waiting for owner" status in between was a write that the
        // Machine then mirrored into its own (about 2 % of the requests at N=1,000).
        OwnerObservation::NoOwner => {
            return Decision::new(observed_status, Step::Nothing, Some(GATE_RESYNC));
        }
        OwnerObservation::Missing(name) => {
            let status = draft
                .waiting(
                    MetalMachinePhase::Pending,
                    "WaitingForMachineOwner",
                    format!("owner Machine {name} not found"),
                )
                .done();
            return Decision::new(status, Step::Nothing, Some(GATE_RESYNC));
        }
        OwnerObservation::Invalid { name, error } => {
            let status = draft
                .waiting(
                    MetalMachinePhase::Pending,
                    "MachineInvalid",
                    format!("owner Machine {name} cannot be read: {error}"),
                )
                .done();
            return Decision::new(status, Step::Nothing, None);
        }
    };
    // Gate 2: a terminal failure is final; only deletion changes anything.
    if observed_status.failure_reason.is_some() || observed_status.failure_message.is_some() {
        return Decision::new(observed_status, Step::Nothing, None);
    }
    // Gate 3: the Cluster exists.
    let Some(cluster) = o.cluster.as_ref() else {
        let status = draft
            .waiting(
                MetalMachinePhase::Pending,
                "WaitingForCluster",
                format!("Cluster {:?} not found", o.cluster_name),
            )
            .done();
        return Decision::new(status, Step::Nothing, Some(GATE_RESYNC));
    };
    // Gate 4: our finalizer, before anything is claimed.
    if !mm.finalizers().iter().any(|f| f == FINALIZER) {
        return Decision::new(draft.done(), Step::AddFinalizer, None);
    }
    // Gate 5: paused (Cluster.spec.paused or the annotation): no write but the condition.
    if cluster.paused() || mm.annotations().contains_key(PAUSED_ANNOTATION) {
        draft.set(Want::t(
            PAUSED,
            "Paused",
            "the Cluster or this object is paused",
        ));
        return Decision::new(draft.done(), Step::Nothing, None);
    }
    draft.status.conditions.retain(|c| c.type_ != PAUSED);
    // Gate 6: the Cluster's infrastructure is provisioned.
    if !cluster.infrastructure_provisioned() {
        let status = draft
            .waiting(
                MetalMachinePhase::Pending,
                "WaitingForClusterInfrastructure",
                "the Cluster's infrastructure is not provisioned yet".into(),
            )
            .done();
        return Decision::new(status, Step::Nothing, None);
    }
    // Gate 7: bootstrap data (a data Secret, or inline data in standalone mode).
    let bootstrap = &machine.spec.bootstrap;
    if bootstrap.data_secret_name.is_none() && bootstrap.data.is_none() {
        let status = draft
            .waiting(
                MetalMachinePhase::Pending,
                "WaitingForBootstrapData",
                "the Machine has no spec.bootstrap.dataSecretName yet".into(),
            )
            .done();
        return Decision::new(status, Step::Nothing, None);
    }
    let claimed = claim::claimed_host(&o.hosts, mm);
    // Provisioned (providerID set): rebuild status from spec and metadata; never boot again.
    if let Some(provider_id) = mm.spec.provider_id.clone() {
        return decide_provisioned(o, draft, provider_id, claimed, &observed_status);
    }
    // Gate 8: a host, claimed before or claimed now.
    let Some(host) = claimed else {
        return decide_claim(o, draft, machine.spec.failure_domain.as_deref());
    };
    let host_name = host.name_any();
    associate(&mut draft, host, &o.failure_domain_label);
    // Gate 9: the host may be powered on.
    if !host.spec.online {
        draft.set(Want::f(
            BOOT_READY,
            "HostOffline",
            format!("MetalHost {host_name} is held offline (spec.online: false)"),
        ));
        let status = draft
            .waiting(
                MetalMachinePhase::Provisioning,
                "HostOffline",
                format!("MetalHost {host_name} is held offline"),
            )
            .done();
        return Decision::new(status, Step::Nothing, None);
    }
    // Gate 10: the boot attempt.
    decide_boot(o, draft, host)
}

/// Fills `hostRef`, the failure domain and HostAssociated for the claimed host.
fn associate(draft: &mut StatusDraft, host: &MetalHost, failure_domain_label: &str) {
    let host_name = host.name_any();
    draft.status.host_ref = Some(HostReference {
        name: host_name.clone(),
        uid: host.uid(),
    });
    draft.status.failure_domain = host.labels().get(failure_domain_label).cloned();
    draft.set(Want::t(
        HOST_ASSOCIATED,
        "HostClaimed",
        format!("claimed MetalHost {host_name}"),
    ));
}

fn decide_claim(o: &Observed, mut draft: StatusDraft, failure_domain: Option<&str>) -> Decision {
    let mm = o.mm.as_ref();
    match claim::best_candidate(&o.hosts, mm, failure_domain, &o.failure_domain_label) {
        Ok(host) => {
            draft.set(Want::f(
                HOST_ASSOCIATED,
                "Claiming",
                format!("claiming MetalHost {}", host.name_any()),
            ));
            let status = draft
                .waiting(
                    MetalMachinePhase::Claiming,
                    "Claiming",
                    format!("claiming MetalHost {}", host.name_any()),
                )
                .done();
            let step = Step::Claim {
                host: host.name_any(),
                resource_version: host.resource_version().unwrap_or_default(),
            };
            Decision::new(status, step, None).noting(
                false,
                "HostClaimed",
                format!("claimed MetalHost {}", host.name_any()),
            )
        }
        Err(e) => {
            let reason = e.reason();
            let message = e.to_string();
            draft.set(Want::f(HOST_ASSOCIATED, reason, message.clone()));
            let status = draft
                .waiting(MetalMachinePhase::Claiming, reason, message)
                .done();
            // A host change wakes this machine (watch); the resync is a safety net.
            Decision::new(status, Step::Nothing, Some(GATE_RESYNC))
        }
    }
}

/// The status of a provisioned machine: ready, with the callback's addresses. Written by the
/// very pass that records the providerID (right after that write), and rebuilt from spec and
/// metadata by every later pass, so no extra round trip stands between a callback and ready.
fn provisioned_status(
    mm: &MetalMachine,
    mut draft: StatusDraft,
    host_name: &str,
    provider_id: &str,
    addresses: Option<Vec<MachineAddress>>,
) -> MetalMachineStatus {
    if let Some(addresses) = addresses {
        draft.status.addresses = addresses;
    }
    if draft.status.failure_domain.is_none() {
        draft.status.failure_domain = mm.spec.failure_domain.clone();
    }
    draft.status.ready = true;
    draft.status.initialization = Some(MachineInitialization {
        provisioned: Some(true),
    });
    draft.status.phase = Some(MetalMachinePhase::Provisioned);
    draft.set(Want::t(
        BOOT_READY,
        "BootstrapSucceeded",
        format!("MetalHost {host_name} reported bootstrap success"),
    ));
    draft.set(Want::t(
        READY,
        "Provisioned",
        format!("running on MetalHost {host_name} ({provider_id})"),
    ));
    draft.done()
}

fn decide_provisioned(
    o: &Observed,
    mut draft: StatusDraft,
    provider_id: String,
    claimed: Option<&MetalHost>,
    observed_status: &MetalMachineStatus,
) -> Decision {
    let mm = o.mm.as_ref();
    let host_name = claimed
        .map(|h| h.name_any())
        .or_else(|| observed_status.host_ref.as_ref().map(|r| r.name.clone()))
        .unwrap_or_default();
    match claimed {
        Some(host) => associate(&mut draft, host, &o.failure_domain_label),
        None => draft.set(Want::f(
            HOST_ASSOCIATED,
            "HostNotFound",
            "no MetalHost names this machine in spec.consumerRef (after a move, re-create the MetalHost with its consumerRef)",
        )),
    }
    let status = provisioned_status(
        mm,
        draft,
        &host_name,
        &provider_id,
        super::recorded_addresses(mm),
    );
    if mm.spec.mode == ProvisioningMode::Live {
        return live_next_boot(o, status, claimed, observed_status.ready, &provider_id);
    }
    let has_boot_secret = !matches!(o.boot, BootObservation::None);
    // The disk override the restart into the disk set still holds on a BMC that keeps every
    // override (its probe record says `Continuous`): the boot that called back did not consume
    // it, so it is not set again.
    let disk_override_holds = |host: &MetalHost| {
        boot_once_known(o, host) == Some(BootOnce::Continuous)
            && matches!(&o.boot, BootObservation::Record(r) if r.disk_boot_at.is_some())
    };
    // The boot Secret goes only once the store shows this machine ready: a decision from a store
    // that lags behind can then never see "no Secret, not ready" and boot the host again.
    let step = match (has_boot_secret, observed_status.ready, claimed) {
        (true, false, Some(host)) if disk_override_holds(host) => Step::Nothing,
        (true, false, Some(host)) => Step::BootFromDisk {
            host: host.name_any(),
        },
        (true, _, _) => Step::DeleteBootSecret,
        (false, _, _) => Step::Nothing,
    };
    let decision = Decision::new(status, step, None);
    if has_boot_secret && !observed_status.ready && claimed.is_some() {
        return decision.noting_provisioned(&host_name, &provider_id);
    }
    decision
}

/// How the host's BMC keeps a one-time boot override, as its probe record says (unknown until
/// the first one-time network boot was read back).
pub fn boot_once_of(host: &MetalHost) -> Option<BootOnce> {
    host.status.as_ref()?.bmc.as_ref()?.boot_once
}

/// [`boot_once_of`], or, until the MetalHost controller copies it there (with its next status
/// write), what this attempt's power-on read back and noted on the boot Secret.
pub(super) fn boot_once_known(o: &Observed, host: &MetalHost) -> Option<BootOnce> {
    boot_once_of(host).or(match &o.boot {
        BootObservation::Record(r) if r.host == host.name_any() => r.boot_once,
        _ => None,
    })
}

/// A provisioned live-mode host is diskless: every power-on network-boots its OS again, and each
/// boot gets a token of its own. After a boot's callback (the provisioning one included) the
/// boot Secret is re-armed for the next boot: a fresh token, the same instance-id, providerID
/// and bootstrap data, and the next boot set to the network. Nothing here ever powers the host:
/// a reboot is the operator's or the OS's, and only its callback is awaited, without a deadline.
/// Like the deletion of image mode's Secret, re-arming waits until the store shows this machine
/// ready, so no decision can see the new token without the providerID.
fn live_next_boot(
    o: &Observed,
    status: MetalMachineStatus,
    claimed: Option<&MetalHost>,
    ready_seen: bool,
    provider_id: &str,
) -> Decision {
    let Some(host) = claimed else {
        return Decision::new(status, Step::Nothing, None);
    };
    let host_name = host.name_any();
    // The boot that just called back consumed the one-time network boot, unless the BMC keeps
    // every override (its probe record says `Continuous`): then the network boot set before
    // still holds, and is not set again.
    let netboot_consumed = boot_once_known(o, host) != Some(BootOnce::Continuous);
    let arm = |netboot| Step::ArmNextBoot {
        host: host_name.clone(),
        netboot,
    };
    match (&o.boot, ready_seen) {
        (BootObservation::Record(r), false) if r.reboot.is_none() => {
            Decision::new(status, Step::Nothing, None).noting_provisioned(&host_name, provider_id)
        }
        (_, false) => Decision::new(status, Step::Nothing, None),
        (BootObservation::Record(r), true) => match (r.reboot, &r.callback) {
            (None, _) => Decision::new(status, arm(netboot_consumed), None),
            (Some(boot), Some(callback)) => {
                let name = callback
                    .hostname
                    .as_deref()
                    .map(|h| format!(" as {h}"))
                    .unwrap_or_default();
                Decision::new(status, arm(netboot_consumed), None).noting(
                    false,
                    "HostRebooted",
                    format!(
                        "MetalHost {host_name} network-booted its OS again and called back{name} (boot {boot} since provisioning); its next boot is armed with a fresh token"
                    ),
                )
            }
            // Armed: waiting for the host's next boot, however long that takes.
            (Some(_), None) => Decision::new(status, Step::Nothing, None),
        },
        // Edited beyond reading: replaced by a fresh one on the next pass.
        (BootObservation::Unreadable(error), true) => {
            Decision::new(status, Step::DeleteBootSecret, None).noting(
                true,
                "BootSecretReplaced",
                format!("the boot Secret is unreadable ({error}); re-arming the next boot"),
            )
        }
        // Gone (deleted by hand, or provisioned before boots were re-armed): made again. No boot
        // was seen, so the BMC's boot settings are left as they are.
        (BootObservation::None, true) => Decision::new(status, arm(false), None),
    }
}

/// What the image-mode gate concluded.
enum ImageGate {
    Decided(Decision),
    /// The phase's clock ran out: the ordinary boot timeout (retry or give up) decides.
    BootTimeout(StatusDraft),
}

/// Image mode, host powered and no callback yet: the deploy agent's report decides. Each phase
/// has its own clock: the boot timeout until the agent first reports, the agent's silence bound
/// while it writes (a large image may take longer than a boot), and the boot timeout again from
/// the restart into the disk. None hands the attempt to the boot timeout below.
fn decide_image(
    o: &Observed,
    mut draft: StatusDraft,
    record: &BootRecord,
    host_name: &str,
) -> ImageGate {
    let mm = &o.mm;
    let attempt = record.attempt;
    let attempts_allowed = (mm.spec.boot_retries().max(0) as u32).saturating_add(1);
    let provisioning = Want::f(
        READY,
        "Provisioning",
        format!("booting MetalHost {host_name}"),
    );
    let (reason, message) = match image_step(record, o.now) {
        ImageStep::Failed { reason, message } => {
            let message = format!(
                "attempt {attempt}: the deploy agent could not write the image to MetalHost {host_name}: {message}"
            );
            draft.set(Want::f(BOOT_READY, &reason, message.clone()));
            if attempt < attempts_allowed {
                draft.set(provisioning);
                let retry = format!(
                    "{message}; retrying (attempt {} of {attempts_allowed})",
                    attempt + 1
                );
                return ImageGate::Decided(
                    Decision::new(draft.done(), Step::NextAttempt, None).noting(
                        true,
                        "ImageWriteFailed",
                        retry,
                    ),
                );
            }
            draft.status.phase = Some(MetalMachinePhase::Failed);
            draft.status.failure_reason = Some(reason.clone());
            draft.status.failure_message = Some(message.clone());
            draft.set(Want::f(READY, &reason, message.clone()));
            return ImageGate::Decided(
                Decision::new(draft.done(), Step::DeleteBootSecret, None).noting(
                    true,
                    "BootFailed",
                    message,
                ),
            );
        }
        ImageStep::Restart => {
            draft.set(Want::f(
                BOOT_READY,
                "BootingInstalledOS",
                format!("attempt {attempt}: image written; restarting MetalHost {host_name} into its disk"),
            ));
            draft.set(provisioning);
            let step = power_step(
                o,
                PoweredFor::DiskBoot,
                Step::RestartToDisk {
                    host: host_name.to_string(),
                },
            );
            return ImageGate::Decided(Decision::new(draft.done(), step, Some(BOOT_POLL)));
        }
        // The agent is writing and reporting: its silence bound, not the boot timeout, applies.
        ImageStep::Writing(progress) => {
            draft.set(Want::f(
                BOOT_READY,
                "WritingImage",
                format!("attempt {attempt}: {progress}"),
            ));
            draft.set(provisioning);
            return ImageGate::Decided(Decision::new(draft.done(), Step::Nothing, Some(BOOT_POLL)));
        }
        ImageStep::BootingDisk => (
            "BootingInstalledOS",
            "image written; waiting for the installed OS's bootstrap-success callback",
        ),
        ImageStep::AwaitingAgent => ("WaitingForAgent", "host network-booting the deploy agent"),
    };
    // Boot timeout from the restart into the disk, or from the power-on before the agent spoke.
    let BootStep::Wait(remaining) = boot_step_since(
        record,
        record.disk_boot_at.or(record.powered_at),
        o.now,
        mm.spec.boot_timeout_seconds(),
        mm.spec.boot_retries(),
    ) else {
        return ImageGate::BootTimeout(draft);
    };
    draft.set(Want::f(
        BOOT_READY,
        reason,
        format!("attempt {attempt}: {message}"),
    ));
    draft.set(provisioning);
    ImageGate::Decided(Decision::new(
        draft.done(),
        Step::Nothing,
        Some(remaining.min(BOOT_POLL)),
    ))
}

fn waiting_for_callback(attempt: u32) -> String {
    format!("attempt {attempt}: host network-booting, waiting for its bootstrap-success callback")
}

fn decide_boot(o: &Observed, mut draft: StatusDraft, host: &MetalHost) -> Decision {
    let mm = o.mm.as_ref();
    let host_name = host.name_any();
    let namespace = mm.namespace().unwrap_or_default();
    draft.status.phase = Some(MetalMachinePhase::Provisioning);
    let record = match &o.boot {
        BootObservation::None => {
            draft.set(Want::f(
                BOOT_READY,
                "PoweringOn",
                "minting a boot token; the host is powered on next",
            ));
            draft.set(Want::f(
                READY,
                "Provisioning",
                format!("booting MetalHost {host_name}"),
            ));
            let step = Step::Mint {
                host: host_name.clone(),
                provider_id: provider_id(&namespace, &host_name, &mm.uid().unwrap_or_default()),
            };
            return Decision::new(draft.done(), step, None);
        }
        BootObservation::Unreadable(error) => {
            // An edited or corrupt boot Secret is replaced by a fresh attempt.
            return Decision::new(draft.done(), Step::DeleteBootSecret, None).noting(
                true,
                "BootSecretReplaced",
                format!("the boot Secret is unreadable ({error}); starting a fresh attempt"),
            );
        }
        BootObservation::Record(record) if record.host != host_name => {
            // Left from a claim of another host: that attempt is over.
            return Decision::new(draft.done(), Step::DeleteBootSecret, None);
        }
        // Armed for a reboot: only a provisioned machine has one, so this view of the machine
        // (no providerID) is older than the Secret. Never boot from it; look again.
        BootObservation::Record(record) if record.reboot.is_some() => {
            let unchanged = mm.status.clone().unwrap_or_default();
            return Decision::new(unchanged, Step::Nothing, Some(Duration::from_secs(1)));
        }
        BootObservation::Record(record) => record,
    };
    let timeout = mm.spec.boot_timeout_seconds();
    let retries = mm.spec.boot_retries();
    if mm.spec.mode == crate::api::metalmachine::ProvisioningMode::Image
        && record.callback.is_none()
        && record.powered_at.is_some()
    {
        match decide_image(o, draft, record, &host_name) {
            ImageGate::Decided(decision) => return decision,
            ImageGate::BootTimeout(back) => draft = back,
        }
    }
    match boot_step(record, o.now, timeout, retries) {
        BootStep::Power => {
            // The same words as the wait that follows: the power-on and the first wait write
            // one status, not two.
            draft.set(Want::f(
                BOOT_READY,
                "WaitingForCallback",
                waiting_for_callback(record.attempt),
            ));
            draft.set(Want::f(
                READY,
                "Provisioning",
                format!("booting MetalHost {host_name}"),
            ));
            let step = power_step(
                o,
                PoweredFor::NetworkBoot(None),
                Step::PowerOn {
                    host: host_name,
                    attempt: record.attempt,
                },
            );
            Decision::new(draft.done(), step, Some(BOOT_POLL))
        }
        BootStep::Wait(remaining) => {
            draft.set(Want::f(
                BOOT_READY,
                "WaitingForCallback",
                waiting_for_callback(record.attempt),
            ));
            draft.set(Want::f(
                READY,
                "Provisioning",
                format!("booting MetalHost {host_name}"),
            ));
            Decision::new(draft.done(), Step::Nothing, Some(remaining.min(BOOT_POLL)))
        }
        BootStep::Retry { next_attempt } => {
            let message = format!(
                "no bootstrap-success callback from MetalHost {host_name} within {timeout} s; power-cycling for attempt {next_attempt} of {}",
                retries.max(0) + 1
            );
            draft.set(Want::f(BOOT_READY, "BootTimeout", message.clone()));
            Decision::new(draft.done(), Step::NextAttempt, None).noting(
                true,
                "BootTimeout",
                message,
            )
        }
        BootStep::GiveUp { attempts } => {
            let message = format!(
                "MetalHost {host_name} never reported bootstrap success: {attempts} attempts of {timeout} s each"
            );
            draft.status.phase = Some(MetalMachinePhase::Failed);
            draft.status.failure_reason = Some("BootTimeout".into());
            draft.status.failure_message = Some(message.clone());
            draft.set(Want::f(BOOT_READY, "BootTimeout", message.clone()));
            draft.set(Want::f(READY, "BootTimeout", message.clone()));
            Decision::new(draft.done(), Step::DeleteBootSecret, None).noting(
                true,
                "BootFailed",
                message,
            )
        }
        BootStep::Finish => {
            let addresses = record
                .callback
                .as_ref()
                .map(|c| addresses_from(c, &host_name))
                .unwrap_or_default();
            let status = provisioned_status(
                mm,
                draft,
                &host_name,
                &record.provider_id,
                Some(addresses.clone()),
            );
            let step = Step::RecordProvisioned {
                provider_id: record.provider_id.clone(),
                failure_domain: host.labels().get(&o.failure_domain_label).cloned(),
                addresses,
            };
            // This pass makes the machine ready, and the next decides from its answer (ready):
            // the Event is announced here, or never. `decide_provisioned` announces it only when
            // a pass finds the providerID without ready (a status write that failed).
            Decision::new(status, step, None).noting_provisioned(&host_name, &record.provider_id)
        }
    }
}

/// How long a cleaning attempt waits for the deploy agent's first word after the power-on.
pub const CLEANING_TIMEOUT: Duration = Duration::from_secs(600);

/// How an image-mode machine's host is to be cleaned on release, if at all: only a host this
/// machine may have written (powered for an attempt, provisioned, or failed: a terminal failure
/// deletes the boot Secret that said whether it was powered), and only when the host does not
/// disable cleaning. Live mode writes nothing, so it cleans nothing.
pub fn cleaning_wanted(o: &Observed, host: &MetalHost) -> Option<WipeMode> {
    let mode = match host.spec.automated_cleaning_mode.unwrap_or_default() {
        CleaningMode::Disabled => return None,
        CleaningMode::Metadata => WipeMode::Metadata,
        CleaningMode::Full => WipeMode::Full,
    };
    let mm = o.mm.as_ref();
    if mm.spec.mode != ProvisioningMode::Image {
        return None;
    }
    let failed = mm
        .status
        .as_ref()
        .is_some_and(|s| s.failure_reason.is_some());
    let touched = mm.spec.provider_id.is_some()
        || failed
        || match &o.boot {
            BootObservation::Record(r) => r.powered_at.is_some() || r.deploy.is_some(),
            BootObservation::Unreadable(_) => true,
            BootObservation::None => false,
        }
        // Powered, though the note of it was refused: the agent may be writing already.
        || o.unrecorded_power.is_some();
    touched.then_some(mode)
}

/// Where a cleaning attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CleanStep {
    /// Not powered yet: netboot the deploy agent.
    PowerOn,
    /// Waiting for the agent; the message says for what.
    Waiting(String),
    /// Cleaned: power off and release.
    Cleaned(String),
    /// Not cleaned: power off and release into Error.
    Failed(Fault),
}

pub fn clean_step(record: &BootRecord, now: jiff::Timestamp) -> CleanStep {
    use crate::agent::protocol::DeployState;
    let Some(powered) = record.powered_at else {
        return CleanStep::PowerOn;
    };
    let since = |t: jiff::Timestamp| now.duration_since(t).unsigned_abs();
    let Some(report) = &record.deploy else {
        if since(powered) > CLEANING_TIMEOUT {
            return CleanStep::Failed(Fault {
                reason: "CleaningTimeout",
                message: format!(
                    "the deploy agent did not report within {} s of the power-on",
                    CLEANING_TIMEOUT.as_secs()
                ),
            });
        }
        return CleanStep::Waiting("waiting for the deploy agent to clean it".into());
    };
    match report.state {
        DeployState::Cleaned => CleanStep::Cleaned(report.message.clone().unwrap_or_default()),
        DeployState::Failed => CleanStep::Failed(Fault {
            reason: "CleaningFailed",
            message: format!(
                "{}: {}",
                report.reason.as_deref().unwrap_or("AgentFailed"),
                report.message.as_deref().unwrap_or("no message")
            ),
        }),
        DeployState::Written => CleanStep::Failed(Fault {
            reason: "CleaningFailed",
            message: "the deploy agent reported a deployment on a cleaning".into(),
        }),
        DeployState::Writing => {
            let last = report
                .received_at
                .as_deref()
                .and_then(|t| t.parse::<jiff::Timestamp>().ok());
            if last.is_some_and(|t| since(t) > AGENT_SILENCE) {
                return CleanStep::Failed(Fault {
                    reason: "AgentSilent",
                    message: format!(
                        "the deploy agent stopped reporting while cleaning (over {} s)",
                        AGENT_SILENCE.as_secs()
                    ),
                });
            }
            CleanStep::Waiting(format!(
                "cleaning: {} MiB wiped",
                report.written_bytes / (1 << 20)
            ))
        }
    }
}

/// Set by `clusterctl move` on each source object just before it deletes it.
pub const DELETE_FOR_MOVE_ANNOTATION: &str = "clusterctl.cluster.x-k8s.io/delete-for-move";

/// How long a release waits for the MetalHost controller to show it saw the deletion.
pub const HOST_REACTION_WAIT: Duration = Duration::from_secs(30);

/// Whether the MetalHost controller has yet to write the state it writes once it saw its
/// consumer's deletion (its own rule, [`crate::controllers::metalhost::state_it_writes`]).
fn host_yet_to_see_deletion(host: &MetalHost) -> bool {
    use crate::controllers::metalhost::{Consumer, state_it_writes};
    state_it_writes(host, Consumer::Deleting)
        .is_some_and(|state| host.status.as_ref().and_then(|s| s.state) != Some(state))
}

fn decide_deletion(o: &Observed, mut draft: StatusDraft, policy: &Policy) -> Decision {
    let mm = o.mm.as_ref();
    if !mm.finalizers().iter().any(|f| f == FINALIZER) {
        return Decision::new(draft.done(), Step::Nothing, None);
    }
    // `clusterctl move` deletes the source copy after the target copy exists: the machine and
    // its host live on there. Nothing is deprovisioned or released; only the finalizer goes.
    if mm.annotations().contains_key(DELETE_FOR_MOVE_ANNOTATION) {
        return Decision::new(draft.done(), Step::RemoveFinalizer, None);
    }
    // Pause holds deletion too: no BMC call, no release, the finalizer stays.
    let paused = o.cluster.as_ref().is_some_and(|c| c.paused())
        || mm.annotations().contains_key(PAUSED_ANNOTATION);
    if paused {
        draft.set(Want::t(
            PAUSED,
            "Paused",
            "the Cluster or this object is paused; deletion waits",
        ));
        return Decision::new(draft.done(), Step::Nothing, None);
    }
    draft.status.conditions.retain(|c| c.type_ != PAUSED);
    draft.status.phase = Some(MetalMachinePhase::Deprovisioning);
    let has_boot_secret = !matches!(o.boot, BootObservation::None);
    let Some(host) = claim::claimed_host(&o.hosts, mm) else {
        let step = if has_boot_secret {
            Step::DeleteBootSecret
        } else {
            Step::RemoveFinalizer
        };
        return Decision::new(draft.done(), step, None);
    };
    let host_name = host.name_any();
    let since_delete = mm
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| o.now.duration_since(t.0).unsigned_abs())
        .unwrap_or_default();
    let power = o.power.clone().unwrap_or(Ok(PowerState::Unknown));
    // A BMC applies a power-on seconds after it accepts it: an Off read soon after this
    // controller's last power-on may be that power-on still pending. Read again once it landed.
    if let (Ok(PowerState::Off), Some(ago)) = (&power, o.last_power_on)
        && ago < POWER_SETTLE
        && o.last_power_off.is_none()
    {
        draft.set(Want::f(
            READY,
            "Deprovisioning",
            format!(
                "MetalHost {host_name} reads off {} s after it was powered on; waiting for the BMC to settle",
                ago.as_secs()
            ),
        ));
        return Decision::new(draft.done(), Step::Nothing, Some(POWER_SETTLE - ago));
    }
    // Cleaning comes first for a host an image-mode tenant wrote: the deploy agent wipes its
    // disks, then it is powered off (forced: nothing is left to shut down) and released; a host
    // that could not be cleaned is released into Error, never Available.
    let mut since_off_wanted = since_delete;
    let mut graceful = policy.graceful_off;
    let mut outcome: Result<String, Fault> = Ok(String::new());
    match &o.boot {
        BootObservation::Record(r) if r.clean.is_some() => match clean_step(r, o.now) {
            CleanStep::PowerOn => {
                draft.set(Want::f(
                    READY,
                    "Cleaning",
                    format!(
                        "netbooting MetalHost {host_name} into the deploy agent to wipe its disks"
                    ),
                ));
                let step = power_step(
                    o,
                    PoweredFor::NetworkBoot(None),
                    Step::PowerOn {
                        host: host_name,
                        attempt: r.attempt,
                    },
                );
                return Decision::new(draft.done(), step, Some(Duration::from_secs(10)));
            }
            CleanStep::Waiting(message) => {
                draft.set(Want::f(
                    READY,
                    "Cleaning",
                    format!("MetalHost {host_name}: {message}"),
                ));
                return Decision::new(draft.done(), Step::Nothing, Some(Duration::from_secs(10)));
            }
            CleanStep::Cleaned(message) => {
                outcome = Ok(message);
                graceful = Duration::ZERO;
            }
            CleanStep::Failed(fault) => {
                outcome = Err(fault);
                graceful = Duration::ZERO;
            }
        },
        _ => {
            if let Some(mode) = cleaning_wanted(o, host) {
                draft.set(Want::f(
                    READY,
                    "Cleaning",
                    format!("cleaning MetalHost {host_name} ({mode:?}) before it is released"),
                ));
                let step = Step::StartCleaning {
                    host: host_name,
                    mode,
                };
                return Decision::new(draft.done(), step, None);
            }
        }
    }
    // After cleaning, the power-off deadline runs from the agent's last word, not the deletion.
    if let BootObservation::Record(r) = &o.boot
        && r.clean.is_some()
        && let Some(at) = r
            .deploy
            .as_ref()
            .and_then(|d| d.received_at.as_deref())
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
    {
        since_off_wanted = o.now.duration_since(at).unsigned_abs();
    }
    let release = |fault: Option<Fault>| Step::Release {
        host: host_name.clone(),
        resource_version: host.resource_version().unwrap_or_default(),
        fault,
    };
    match power_off_step(
        power,
        since_off_wanted,
        graceful,
        Some(policy.deprovision_timeout),
        o.last_power_off,
    ) {
        // The MetalHost controller answers our deletion with one status write (Deprovisioning).
        // A release conditioned on the version before it is refused 409 and redone, BMC call
        // included: ~6 % of releases at N=1,000. So the release waits for that write, which wakes
        // this machine, and not longer than HOST_REACTION_WAIT (a MetalHost controller that is
        // down or paused does not hold a deletion up). The READY condition stays as it is.
        PowerOffStep::Done
            if host_yet_to_see_deletion(host) && since_delete < HOST_REACTION_WAIT =>
        {
            Decision::new(
                draft.done(),
                Step::Nothing,
                Some(HOST_REACTION_WAIT - since_delete),
            )
        }
        PowerOffStep::Done => match outcome {
            Ok(cleaned) => Decision::new(draft.done(), release(None), None).noting(
                false,
                "HostReleased",
                if cleaned.is_empty() {
                    format!("MetalHost {host_name} powered off and released")
                } else {
                    format!("MetalHost {host_name} cleaned ({cleaned}), powered off and released")
                },
            ),
            Err(fault) => {
                let message = format!(
                    "released MetalMachine although MetalHost {host_name} could not be cleaned ({}: {}); the host is in Error for an operator to check",
                    fault.reason, fault.message
                );
                Decision::new(draft.done(), release(Some(fault)), None).noting(
                    true,
                    "HostCleaningFailed",
                    message,
                )
            }
        },
        PowerOffStep::Request(action) => {
            draft.set(Want::f(
                READY,
                "Deprovisioning",
                format!("powering MetalHost {host_name} off ({action} requested)"),
            ));
            let step = Step::PowerOff {
                host: host_name,
                action,
            };
            Decision::new(draft.done(), step, Some(POWER_OFF_POLL))
        }
        PowerOffStep::Wait(action) => {
            draft.set(Want::f(
                READY,
                "Deprovisioning",
                format!("powering MetalHost {host_name} off ({action} requested)"),
            ));
            Decision::new(draft.done(), Step::Nothing, Some(POWER_OFF_POLL))
        }
        PowerOffStep::Retry(f) => {
            draft.set(Want::f(
                READY,
                f.reason,
                format!("deprovisioning MetalHost {host_name}: {}", f.message),
            ));
            Decision::new(draft.done(), Step::Nothing, Some(Duration::from_secs(10)))
        }
        PowerOffStep::GiveUp(f) => {
            let message = format!(
                "released MetalMachine although MetalHost {host_name} could not be powered off ({}); the host is in Error for an operator to check",
                f.message
            );
            Decision::new(draft.done(), release(Some(f)), None).noting(
                true,
                "HostAbandoned",
                message,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};

    use super::*;
    use crate::api::capi::{Cluster, Machine, MachineSpec};
    use crate::api::metalhost::MetalHostStatus;
    use crate::api::metalhost::{ConsumerReference, HostErrorType, HostState, MetalHostSpec};
    use crate::api::metalmachine::MetalMachineSpec;
    use crate::api::{DEFAULT_FAILURE_DOMAIN_LABEL, MetalMachine};
    use crate::boot::tokens::Token;

    const T0: i64 = 1_800_000_000;

    fn at(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(T0 + secs).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
    }

    fn policy() -> Policy {
        Policy {
            graceful_off: Duration::from_secs(60),
            deprovision_timeout: Duration::from_secs(600),
        }
    }

    fn metal_machine() -> MetalMachine {
        let mut mm = MetalMachine::new(
            "m",
            MetalMachineSpec {
                boot_timeout_seconds: Some(100),
                boot_retries: Some(2),
                ..Default::default()
            },
        );
        mm.metadata.namespace = Some("ns".into());
        mm.metadata.uid = Some("mm-uid".into());
        mm.metadata.generation = Some(1);
        mm.metadata.resource_version = Some("1".into());
        mm.metadata.finalizers = Some(vec![FINALIZER.into()]);
        mm.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "cluster.x-k8s.io/v1beta2".into(),
            kind: "Machine".into(),
            name: "m".into(),
            uid: "machine-uid".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        mm
    }

    fn machine() -> Machine {
        let mut m = Machine::new(
            "m",
            MachineSpec {
                cluster_name: "c1".into(),
                ..Default::default()
            },
        );
        m.metadata.namespace = Some("ns".into());
        m.spec.bootstrap.data_secret_name = Some("m-bootstrap".into());
        m
    }

    fn cluster() -> Cluster {
        let mut c: Cluster = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": "c1", "namespace": "ns"},
            "spec": {},
            "status": {"initialization": {"infrastructureProvisioned": true}},
        }))
        .unwrap_or_else(|e| panic!("cluster fixture: {e}"));
        c.metadata.namespace = Some("ns".into());
        c
    }

    fn host(name: &str, consumer: Option<&str>, fd: Option<&str>) -> MetalHost {
        let mut h = MetalHost::new(
            name,
            MetalHostSpec {
                consumer_ref: consumer.map(|c| ConsumerReference::to_metal_machine(c, "ns")),
                ..MetalHostSpec::for_tests()
            },
        );
        h.metadata.namespace = Some("ns".into());
        h.metadata.resource_version = Some(format!("rv-{name}"));
        h.metadata.labels = Some(
            fd.map(|fd| {
                BTreeMap::from([(DEFAULT_FAILURE_DOMAIN_LABEL.to_string(), fd.to_string())])
            })
            .unwrap_or_default(),
        );
        let mut status = MetalHostStatus {
            state: Some(if consumer.is_some() {
                HostState::Provisioning
            } else {
                HostState::Available
            }),
            ..Default::default()
        };
        conditions::set(
            &mut status.conditions,
            Want::t(crate::controllers::metalhost::REGISTERED, "Registered", ""),
            None,
            &Time(at(-600)),
        );
        h.status = Some(status);
        h
    }

    fn record(attempt: u32, powered: Option<i64>, called_back: bool) -> BootRecord {
        BootRecord {
            namespace: "ns".into(),
            secret_name: "m-boot".into(),
            metal_machine: "m".into(),
            host: "h1".into(),
            attempt,
            token: Token::mint(),
            provider_id: "metalboot://ns/h1/mm-uid".into(),
            instance_id: "mm-uid-1".into(),
            callback: called_back.then(|| CallbackRecord {
                hostname: Some("node-1".into()),
                addresses: vec![
                    "10.0.0.7"
                        .parse()
                        .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0])),
                ],
                source_ip: None,
                received_at: "t".into(),
            }),
            powered_at: powered.map(at),
            inspection: None,
            deploy: None,
            disk_boot_at: None,
            clean: None,
            reboot: None,
            boot_once: None,
            resource_version: Some("5".into()),
        }
    }

    /// A machine that has passed every gate up to the claim, with one free host `h1`.
    fn observed() -> Observed {
        Observed {
            mm: Arc::new(metal_machine()),
            now: at(0),
            owner: OwnerObservation::Found(Arc::new(machine())),
            cluster_name: "c1".into(),
            cluster: Some(Arc::new(cluster())),
            failure_domain_label: DEFAULT_FAILURE_DOMAIN_LABEL.into(),
            hosts: vec![Arc::new(host("h1", None, Some("rack-a")))],
            boot: BootObservation::None,
            boot_secret: None,
            power: None,
            last_power_off: None,
            last_power_on: None,
            unrecorded_power: None,
        }
    }

    /// A power action sent for the attempt, whose note on the boot Secret was refused.
    /// (Decide takes the observed entry as it is; `observe` matched it to the attempt. Its token
    /// is fixed here, as `record`'s is fresh on every call.)
    fn unrecorded(kind: PoweredFor) -> Option<UnrecordedPower> {
        Some(UnrecordedPower {
            token: "0a1b2c".into(),
            ..UnrecordedPower::for_attempt(
                Some("secret-uid"),
                &record(1, None, false),
                at(-3),
                kind,
            )
        })
    }

    /// An unnoted power action belongs to one attempt: not to the next, nor to the cleaning
    /// attempt that replaces it in the same Secret, nor to a Secret replaced with a fresh token
    /// under the same UID and attempt, nor to another Secret of the same name. Once the record
    /// carries its note, it is forgotten.
    #[test]
    fn an_unnoted_power_action_belongs_to_its_attempt_until_noted() {
        let first = record(1, None, false);
        let sent = UnrecordedPower::for_attempt(
            Some("uid-1"),
            &first,
            at(0),
            PoweredFor::NetworkBoot(None),
        );
        let same = |f: &dyn Fn(&mut BootRecord)| {
            let mut r = first.clone();
            f(&mut r);
            r
        };
        let rows = [
            (
                "the same attempt",
                Some("uid-1"),
                same(&|_| {}),
                KeptPower::Unnoted,
            ),
            (
                "the same attempt, noted",
                Some("uid-1"),
                same(&|r| r.powered_at = Some(at(1))),
                KeptPower::Noted,
            ),
            (
                "the next attempt",
                Some("uid-1"),
                same(&|r| r.attempt = 2),
                KeptPower::OtherAttempt,
            ),
            (
                "the cleaning attempt",
                Some("uid-1"),
                same(&|r| r.clean = Some(WipeMode::Metadata)),
                KeptPower::OtherAttempt,
            ),
            (
                "a fresh token under the same UID and attempt",
                Some("uid-1"),
                same(&|r| r.token = Token::mint()),
                KeptPower::OtherAttempt,
            ),
            (
                "a new Secret",
                Some("uid-2"),
                same(&|_| {}),
                KeptPower::OtherAttempt,
            ),
            ("no UID", None, same(&|_| {}), KeptPower::OtherAttempt),
        ];
        for (what, uid, r, want) in rows {
            assert_eq!(sent.against(uid, &r), want, "{what}");
        }
        let restart = UnrecordedPower {
            kind: PoweredFor::DiskBoot,
            ..sent
        };
        assert_eq!(
            restart.against(Some("uid-1"), &same(&|r| r.powered_at = Some(at(1)))),
            KeptPower::Unnoted,
            "powered on, the restart into the disk not noted"
        );
    }

    fn claimed(mut o: Observed) -> Observed {
        o.hosts = vec![Arc::new(host("h1", Some("m"), Some("rack-a")))];
        o
    }

    /// The hosts with their status changed by `f`.
    fn hosts_with(mut o: Observed, f: impl Fn(&mut MetalHostStatus)) -> Observed {
        o.hosts = o
            .hosts
            .iter()
            .map(|h| {
                let mut h = (**h).clone();
                f(h.status.get_or_insert_with(Default::default));
                Arc::new(h)
            })
            .collect();
        o
    }

    /// The hosts as the MetalHost controller leaves them once it saw their consumer's deletion.
    fn deprovisioning(o: Observed) -> Observed {
        hosts_with(o, |s| s.state = Some(HostState::Deprovisioning))
    }

    fn with_mm(mut o: Observed, f: impl FnOnce(&mut MetalMachine)) -> Observed {
        let mut mm = (*o.mm).clone();
        f(&mut mm);
        o.mm = Arc::new(mm);
        o
    }

    fn ready_reason(d: &Decision) -> String {
        conditions::get(&d.status.conditions, READY)
            .map(|c| c.reason.to_string())
            .unwrap_or_default()
    }

    /// Seed 004: without a Machine owner the pass exits. A new MetalMachine gets no status
    /// write, one with a status keeps it as it is, and once owned it gets its first status.
    #[test]
    fn no_owner_leaves_status_alone() {
        use crate::controllers::status_changes;
        let changes_status =
            |mm: &MetalMachine, s: &MetalMachineStatus| status_changes(mm.status.as_ref(), s);
        let unowned = |status: Option<MetalMachineStatus>| {
            with_mm(
                Observed {
                    owner: OwnerObservation::NoOwner,
                    ..observed()
                },
                |mm| mm.status = status,
            )
        };
        let new = unowned(None);
        let d = decide(&new, &policy());
        assert_eq!(d.step, Step::Nothing);
        assert!(!changes_status(&new.mm, &d.status), "new: {:?}", d.status);

        let shown = MetalMachineStatus {
            phase: Some(MetalMachinePhase::Pending),
            observed_generation: Some(7),
            ..Default::default()
        };
        let earlier = unowned(Some(shown.clone()));
        let d = decide(&earlier, &policy());
        assert_eq!(d.status, shown);
        assert!(!changes_status(&earlier.mm, &d.status));

        let owned = with_mm(observed(), |mm| mm.status = None);
        let d = decide(&owned, &policy());
        assert!(
            changes_status(&owned.mm, &d.status),
            "owned: a first status"
        );
    }

    /// Seed 004, "normal resource", one row per gate in the seed's order, plus the boot steps.
    #[test]
    fn gates_in_seed_order() {
        type Row = (&'static str, Observed, &'static str, Step);
        let failed = with_mm(observed(), |mm| {
            mm.status = Some(MetalMachineStatus {
                failure_reason: Some("BootTimeout".into()),
                ..Default::default()
            })
        });
        let paused_cluster = {
            let mut o = observed();
            let mut c = cluster();
            c.spec.paused = Some(true);
            o.cluster = Some(Arc::new(c));
            o
        };
        let paused_annotation = with_mm(observed(), |mm| {
            mm.metadata.annotations = Some(BTreeMap::from([(
                PAUSED_ANNOTATION.to_string(),
                String::new(),
            )]))
        });
        let infra_not_ready = {
            let mut o = observed();
            let mut c = cluster();
            c.status = None;
            o.cluster = Some(Arc::new(c));
            o
        };
        let no_data = {
            let mut o = observed();
            let mut m = machine();
            m.spec.bootstrap.data_secret_name = None;
            o.owner = OwnerObservation::Found(Arc::new(m));
            o
        };
        let inline_data = {
            let mut o = observed();
            let mut m = machine();
            m.spec.bootstrap.data_secret_name = None;
            m.spec.bootstrap.data = Some("#cloud-config\n".into());
            o.owner = OwnerObservation::Found(Arc::new(m));
            o
        };
        let offline = {
            let mut o = claimed(observed());
            let mut h = host("h1", Some("m"), None);
            h.spec.online = false;
            o.hosts = vec![Arc::new(h)];
            o
        };
        let rows: Vec<Row> = vec![
            (
                "1. no Machine owner: exit, status untouched (no_owner_leaves_status_alone)",
                Observed {
                    owner: OwnerObservation::NoOwner,
                    ..observed()
                },
                "",
                Step::Nothing,
            ),
            (
                "1. owner Machine not found: wait",
                Observed {
                    owner: OwnerObservation::Missing("m".into()),
                    ..observed()
                },
                "WaitingForMachineOwner",
                Step::Nothing,
            ),
            (
                "1. owner Machine malformed: wait, say why",
                Observed {
                    owner: OwnerObservation::Invalid {
                        name: "m".into(),
                        error: "invalid type".into(),
                    },
                    ..observed()
                },
                "MachineInvalid",
                Step::Nothing,
            ),
            ("2. terminal failure: nothing", failed, "", Step::Nothing),
            (
                "3. Cluster not found: wait",
                Observed {
                    cluster: None,
                    ..observed()
                },
                "WaitingForCluster",
                Step::Nothing,
            ),
            (
                "4. no finalizer: add it first",
                with_mm(observed(), |mm| mm.metadata.finalizers = None),
                "",
                Step::AddFinalizer,
            ),
            (
                "5. Cluster paused: nothing",
                paused_cluster,
                "",
                Step::Nothing,
            ),
            (
                "5. annotation paused: nothing",
                paused_annotation,
                "",
                Step::Nothing,
            ),
            (
                "6. Cluster infrastructure not provisioned: wait",
                infra_not_ready,
                "WaitingForClusterInfrastructure",
                Step::Nothing,
            ),
            (
                "7. no dataSecretName: wait",
                no_data,
                "WaitingForBootstrapData",
                Step::Nothing,
            ),
            (
                "7. inline bootstrap data counts as data",
                inline_data,
                "Claiming",
                Step::Claim {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                },
            ),
            (
                "8. a free host: claim it with its resourceVersion",
                observed(),
                "Claiming",
                Step::Claim {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                },
            ),
            (
                "8. no free host: wait",
                Observed {
                    hosts: vec![Arc::new(host("h1", Some("other"), None))],
                    ..observed()
                },
                "NoHostAvailable",
                Step::Nothing,
            ),
            (
                "9. claimed host held offline: wait",
                offline,
                "HostOffline",
                Step::Nothing,
            ),
            (
                "10. claimed, no boot Secret: mint a token",
                claimed(observed()),
                "Provisioning",
                Step::Mint {
                    host: "h1".into(),
                    provider_id: "metalboot://ns/h1/mm-uid".into(),
                },
            ),
            (
                "10. minted, not powered: power on",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, None, false))),
                    ..claimed(observed())
                },
                "Provisioning",
                Step::PowerOn {
                    host: "h1".into(),
                    attempt: 1,
                },
            ),
            (
                "10. powered on, the note of it refused: the note alone, never a second power-on",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, None, false))),
                    unrecorded_power: unrecorded(PoweredFor::NetworkBoot(None)),
                    ..claimed(observed())
                },
                "Provisioning",
                Step::RecordPower(unrecorded(PoweredFor::NetworkBoot(None)).unwrap()),
            ),
            (
                "10. a kept action of another kind (a restart into the disk) is no network boot: power on",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, None, false))),
                    unrecorded_power: unrecorded(PoweredFor::DiskBoot),
                    ..claimed(observed())
                },
                "Provisioning",
                Step::PowerOn {
                    host: "h1".into(),
                    attempt: 1,
                },
            ),
            (
                "10. powered, within the timeout: wait",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, Some(-40), false))),
                    ..claimed(observed())
                },
                "Provisioning",
                Step::Nothing,
            ),
            (
                "10. timed out with retries left: next attempt",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, Some(-100), false))),
                    ..claimed(observed())
                },
                "",
                Step::NextAttempt,
            ),
            (
                "10. last attempt timed out: give up",
                Observed {
                    boot: BootObservation::Record(Box::new(record(3, Some(-100), false))),
                    ..claimed(observed())
                },
                "BootTimeout",
                Step::DeleteBootSecret,
            ),
            (
                "10. unreadable boot Secret: replace it",
                Observed {
                    boot: BootObservation::Unreadable("no token".into()),
                    ..claimed(observed())
                },
                "",
                Step::DeleteBootSecret,
            ),
            (
                "10. called back: record providerID, domain, addresses, and ready in the same pass (seed steps 8, 10, 11)",
                Observed {
                    boot: BootObservation::Record(Box::new(record(2, Some(-10), true))),
                    ..claimed(observed())
                },
                "Provisioned",
                Step::RecordProvisioned {
                    provider_id: "metalboot://ns/h1/mm-uid".into(),
                    failure_domain: Some("rack-a".into()),
                    addresses: vec![
                        MachineAddress {
                            type_: MachineAddressType::InternalIP,
                            address: "10.0.0.7".into(),
                        },
                        MachineAddress {
                            type_: MachineAddressType::Hostname,
                            address: "node-1".into(),
                        },
                    ],
                },
            ),
        ];
        for (what, o, want_reason, want_step) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want_step, "{what}: step");
            if !want_reason.is_empty() {
                assert_eq!(ready_reason(&d), want_reason, "{what}: Ready reason");
            }
            // Ready is written right after the providerID, never before it.
            let records = matches!(d.step, Step::RecordProvisioned { .. });
            assert_eq!(d.status.ready, records, "{what}: ready");
            if let Step::RecordProvisioned { addresses, .. } = &d.step {
                assert_eq!(
                    d.note.as_ref().map(|n| (n.warning, n.reason)),
                    Some((false, "Provisioned")),
                    "{what}: the pass that makes the machine ready announces it"
                );
                assert_eq!(&d.status.addresses, addresses, "{what}: addresses");
                assert_eq!(
                    d.status.initialization.as_ref().and_then(|i| i.provisioned),
                    Some(true),
                    "{what}: initialization.provisioned"
                );
            }
        }
    }

    /// The power-on pass and the wait after it show the same BootReady, so the power-on costs
    /// one status write, not two.
    #[test]
    fn the_power_on_and_the_wait_after_it_write_one_status() {
        let boot_ready = |powered: Option<i64>| {
            let o = Observed {
                boot: BootObservation::Record(Box::new(record(1, powered, false))),
                ..claimed(observed())
            };
            let d = decide(&o, &policy());
            d.status
                .conditions
                .into_iter()
                .find(|c| c.type_ == BOOT_READY)
                .map(|c| (c.reason, c.message))
        };
        let powering = boot_ready(None);
        assert!(powering.is_some(), "BootReady is set");
        assert_eq!(powering, boot_ready(Some(-40)));
    }

    /// Seed 004 steps 8–12 and what follows (image mode): status rebuilt from spec, the boot
    /// Secret deleted only once the store shows the machine ready, and never a new boot.
    #[test]
    fn provisioned_machines_never_boot_again() {
        let provisioned = |ready: bool, boot: BootObservation| {
            let mut o = claimed(observed());
            o.boot = boot;
            with_mm(o, |mm| {
                mm.spec.mode = ProvisioningMode::Image;
                mm.spec.provider_id = Some("metalboot://ns/h1/mm-uid".into());
                mm.status = Some(MetalMachineStatus {
                    ready,
                    ..Default::default()
                });
            })
        };
        let rows = vec![
            (
                "providerID set, status not yet ready: ready + next boot from disk",
                provisioned(
                    false,
                    BootObservation::Record(Box::new(record(1, Some(-5), true))),
                ),
                Step::BootFromDisk { host: "h1".into() },
            ),
            (
                "store shows ready: the token dies",
                provisioned(
                    true,
                    BootObservation::Record(Box::new(record(1, Some(-5), true))),
                ),
                Step::DeleteBootSecret,
            ),
            (
                "ready and no boot Secret: nothing",
                provisioned(true, BootObservation::None),
                Step::Nothing,
            ),
            (
                "moved (status empty, no boot Secret): status rebuilt, no boot",
                provisioned(false, BootObservation::None),
                Step::Nothing,
            ),
        ];
        for (what, o, want) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want, "{what}");
            assert!(d.status.ready, "{what}: ready");
            assert_eq!(
                d.status.phase,
                Some(MetalMachinePhase::Provisioned),
                "{what}"
            );
            assert_eq!(ready_reason(&d), "Provisioned", "{what}");
        }
        // Moved, and the host not re-created yet: still provisioned, never claims another host.
        let mut moved = provisioned(false, BootObservation::None);
        moved.hosts = vec![Arc::new(host("h2", None, None))];
        let d = decide(&moved, &policy());
        assert_eq!(d.step, Step::Nothing);
        let associated = conditions::get(&d.status.conditions, HOST_ASSOCIATED);
        assert_eq!(associated.map(|c| c.reason.as_str()), Some("HostNotFound"));
    }

    /// Live mode, provisioned: every boot network-boots the OS with a token of its own. After
    /// each callback the Secret is re-armed (fresh token, next boot to the network), only once the
    /// store shows the machine ready; the controller never powers the host; a reboot record seen
    /// with a machine that has no providerID is a stale view and boots nothing.
    #[test]
    fn provisioned_live_machines_rearm_each_boot_and_never_power_the_host() {
        let provisioned = |ready: bool, boot: BootObservation| {
            let mut o = claimed(observed());
            o.boot = boot;
            with_mm(o, |mm| {
                mm.spec.provider_id = Some("metalboot://ns/h1/mm-uid".into());
                mm.status = Some(MetalMachineStatus {
                    ready,
                    ..Default::default()
                });
            })
        };
        let reboot = |boot: u32, called_back: bool| {
            let mut r = record(1, None, called_back);
            r.reboot = Some(boot);
            BootObservation::Record(Box::new(r))
        };
        let arm = |netboot| Step::ArmNextBoot {
            host: "h1".into(),
            netboot,
        };
        let rows = vec![
            (
                "provisioning callback, status not yet ready: ready first, nothing armed",
                provisioned(
                    false,
                    BootObservation::Record(Box::new(record(1, Some(-5), true))),
                ),
                Step::Nothing,
                Some("Provisioned"),
            ),
            (
                "store shows ready: the next boot is armed (the provisioning token dies)",
                provisioned(
                    true,
                    BootObservation::Record(Box::new(record(1, Some(-5), true))),
                ),
                arm(true),
                None,
            ),
            (
                "armed, the host has not rebooted: nothing, and no deadline",
                provisioned(true, reboot(1, false)),
                Step::Nothing,
                None,
            ),
            (
                "the host rebooted and called back: re-armed for the boot after",
                provisioned(true, reboot(1, true)),
                arm(true),
                Some("HostRebooted"),
            ),
            (
                "a reboot callback seen before ready: wait for the store",
                provisioned(false, reboot(2, true)),
                Step::Nothing,
                None,
            ),
            (
                "no boot Secret (deleted by hand, or provisioned before re-arming existed): armed again",
                provisioned(true, BootObservation::None),
                arm(false),
                None,
            ),
            (
                "an unreadable boot Secret: replaced",
                provisioned(true, BootObservation::Unreadable("garbled".into())),
                Step::DeleteBootSecret,
                Some("BootSecretReplaced"),
            ),
        ];
        for (what, o, want, note) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want, "{what}");
            assert!(d.status.ready, "{what}: ready");
            assert_eq!(ready_reason(&d), "Provisioned", "{what}");
            assert_eq!(d.note.as_ref().map(|n| n.reason), note, "{what}");
        }
        // A stale view: the machine without its providerID next to a Secret armed for a reboot.
        let mut stale = claimed(observed());
        stale.boot = reboot(1, false);
        let d = decide(&stale, &policy());
        assert_eq!(d.step, Step::Nothing, "never power from a stale view");
        assert_eq!(d.status, stale.mm.status.clone().unwrap_or_default());
    }

    /// The strategy chosen from the host's probe record (`status.bmc.bootOnce`): after a boot
    /// called back, an override is set again only where that boot consumed it. A BMC that keeps
    /// every override (`Continuous`, as sushy-tools) still holds the network boot of a live-mode
    /// host and the disk boot of an image-mode host's restart, so it gets no request; a BMC that
    /// honours `Once`, or one not known yet, gets the override as before.
    #[test]
    fn the_probe_record_decides_whether_an_override_is_set_again_after_a_boot() {
        use crate::api::metalhost::BmcCapabilities;
        let provisioned =
            |mode: ProvisioningMode, ready: bool, record: BootRecord, once: Option<BootOnce>| {
                let mut o = claimed(observed());
                let mut h = (*o.hosts[0]).clone();
                if let Some(status) = h.status.as_mut() {
                    status.bmc = Some(BmcCapabilities {
                        protocol: "Redfish".into(),
                        boot_once: once,
                        ..Default::default()
                    });
                }
                o.hosts = vec![Arc::new(h)];
                o.boot = BootObservation::Record(Box::new(record));
                with_mm(o, |mm| {
                    mm.spec.mode = mode;
                    mm.spec.provider_id = Some("metalboot://ns/h1/mm-uid".into());
                    mm.status = Some(MetalMachineStatus {
                        ready,
                        ..Default::default()
                    });
                })
            };
        let called_back = || record(1, Some(-50), true);
        let rebooted = || {
            let mut r = record(1, None, true);
            r.reboot = Some(1);
            r
        };
        let restarted_into_disk = || {
            let mut r = record(1, Some(-50), true);
            r.disk_boot_at = Some(at(-20));
            r
        };
        let arm = |netboot| Step::ArmNextBoot {
            host: "h1".into(),
            netboot,
        };
        let disk = || Step::BootFromDisk { host: "h1".into() };
        // Read back at this attempt's power-on and noted on the boot Secret, not yet copied to
        // the host's record (the MetalHost controller writes it with its next change).
        let noted = |mut r: BootRecord, once| {
            r.boot_once = Some(once);
            r
        };
        use BootOnce::{Continuous, Honoured};
        use ProvisioningMode::{Image, Live};
        let rows = vec![
            (
                "live, provisioning callback, BMC honours Once: the network boot is set again",
                provisioned(Live, true, called_back(), Some(Honoured)),
                arm(true),
                None,
            ),
            (
                "live, provisioning callback, BMC not known yet: set again, as before",
                provisioned(Live, true, called_back(), None),
                arm(true),
                None,
            ),
            (
                "live, provisioning callback, BMC keeps overrides: the power-on's network boot holds",
                provisioned(Live, true, called_back(), Some(Continuous)),
                arm(false),
                None,
            ),
            (
                "live, a reboot called back, BMC honours Once: set again",
                provisioned(Live, true, rebooted(), Some(Honoured)),
                arm(true),
                Some("HostRebooted"),
            ),
            (
                "live, a reboot called back, BMC keeps overrides: still holds",
                provisioned(Live, true, rebooted(), Some(Continuous)),
                arm(false),
                Some("HostRebooted"),
            ),
            (
                "image, the installed OS called back, BMC honours Once: next boot from disk",
                provisioned(Image, false, restarted_into_disk(), Some(Honoured)),
                disk(),
                Some("Provisioned"),
            ),
            (
                "image, BMC not known yet: next boot from disk, as before",
                provisioned(Image, false, restarted_into_disk(), None),
                disk(),
                Some("Provisioned"),
            ),
            (
                "image, BMC keeps overrides: the restart's disk boot holds, no request",
                provisioned(Image, false, restarted_into_disk(), Some(Continuous)),
                Step::Nothing,
                Some("Provisioned"),
            ),
            (
                "live, BMC keeps overrides, said only by the boot Secret so far: still holds",
                provisioned(Live, true, noted(called_back(), Continuous), None),
                arm(false),
                None,
            ),
            (
                "image, BMC keeps overrides, said only by the boot Secret so far: no request",
                provisioned(Image, false, noted(restarted_into_disk(), Continuous), None),
                Step::Nothing,
                Some("Provisioned"),
            ),
            (
                "a boot Secret that names another host says nothing of this one",
                provisioned(
                    Live,
                    true,
                    {
                        let mut r = noted(called_back(), Continuous);
                        r.host = "h2".into();
                        r
                    },
                    None,
                ),
                arm(true),
                None,
            ),
            (
                "the host's record wins over the Secret's",
                provisioned(Live, true, noted(called_back(), Continuous), Some(Honoured)),
                arm(true),
                None,
            ),
            (
                "image, BMC keeps overrides, but no restart into the disk was recorded: set it",
                provisioned(Image, false, called_back(), Some(Continuous)),
                disk(),
                Some("Provisioned"),
            ),
            (
                "image, store shows ready: the token dies whatever the BMC",
                provisioned(Image, true, restarted_into_disk(), Some(Continuous)),
                Step::DeleteBootSecret,
                None,
            ),
        ];
        for (what, o, want, note) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want, "{what}");
            assert!(d.status.ready, "{what}: ready");
            assert_eq!(ready_reason(&d), "Provisioned", "{what}");
            assert_eq!(d.note.as_ref().map(|n| n.reason), note, "{what}");
        }
    }

    #[test]
    fn the_failure_domain_is_a_hard_constraint() {
        let mut o = observed();
        let mut m = machine();
        m.spec.failure_domain = Some("rack-b".into());
        o.owner = OwnerObservation::Found(Arc::new(m));
        let d = decide(&o, &policy());
        assert_eq!(d.step, Step::Nothing, "h1 is in rack-a: not a candidate");
        assert_eq!(ready_reason(&d), "NoHostInFailureDomain");
        o.hosts.push(Arc::new(host("h2", None, Some("rack-b"))));
        let d = decide(&o, &policy());
        assert_eq!(
            d.step,
            Step::Claim {
                host: "h2".into(),
                resource_version: "rv-h2".into()
            }
        );
        // The MetalCluster's label override decides which label names the domain.
        o.failure_domain_label = "example.com/rack".into();
        let d = decide(&o, &policy());
        assert_eq!(ready_reason(&d), "NoHostInFailureDomain");
    }

    /// Seed 004, "deleted resource", and pause holding deletion.
    #[test]
    fn deletion_rows() {
        let deleting = |o: Observed, secs_ago: i64| {
            with_mm(deprovisioning(o), move |mm| {
                mm.metadata.deletion_timestamp = Some(Time(at(-secs_ago)))
            })
        };
        // Deleted `secs_ago`, its host off and in `state` (the MetalHost controller's view).
        let off_in = |state: HostState, secs_ago: i64| Observed {
            power: Some(Ok(PowerState::Off)),
            ..hosts_with(deleting(claimed(observed()), secs_ago), |s| {
                s.state = Some(state)
            })
        };
        let fault = Fault {
            reason: "BmcUnreachable",
            message: "refused".into(),
        };
        let paused = {
            let mut o = deleting(claimed(observed()), 1);
            let mut c = cluster();
            c.spec.paused = Some(true);
            o.cluster = Some(Arc::new(c));
            o.power = Some(Ok(PowerState::On));
            o
        };
        let rows: Vec<(&str, Observed, Step)> = vec![
            (
                "no finalizer: nothing",
                with_mm(deleting(observed(), 1), |mm| mm.metadata.finalizers = None),
                Step::Nothing,
            ),
            ("paused: deletion waits, no BMC call", paused, Step::Nothing),
            (
                "deleted by clusterctl move: the finalizer goes, the host stays as it is",
                with_mm(deleting(claimed(observed()), 1), |mm| {
                    mm.metadata.annotations =
                        Some([(DELETE_FOR_MOVE_ANNOTATION.to_string(), String::new())].into())
                }),
                Step::RemoveFinalizer,
            ),
            (
                "no host, boot Secret left: delete it",
                Observed {
                    boot: BootObservation::Record(Box::new(record(1, None, false))),
                    ..deleting(observed(), 1)
                },
                Step::DeleteBootSecret,
            ),
            (
                "nothing left: remove the finalizer",
                deleting(observed(), 1),
                Step::RemoveFinalizer,
            ),
            (
                "host on: graceful power-off",
                Observed {
                    power: Some(Ok(PowerState::On)),
                    ..deleting(claimed(observed()), 1)
                },
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::GracefulOff,
                },
            ),
            (
                "host off: release it (resourceVersion precondition)",
                Observed {
                    power: Some(Ok(PowerState::Off)),
                    ..deleting(claimed(observed()), 1)
                },
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "host off, its controller has not shown Deprovisioning yet: wait for that write (a release before it would be refused 409)",
                off_in(HostState::Provisioned, 1),
                Step::Nothing,
            ),
            (
                "host off, its controller had not even shown the claim (Available): wait for its Deprovisioning write all the same",
                off_in(HostState::Available, 1),
                Step::Nothing,
            ),
            (
                "host off, still not Deprovisioning 30 s after the deletion: release anyway",
                off_in(HostState::Provisioned, 30),
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "host off and paused: its controller writes nothing for the deletion, release at once",
                {
                    let mut o = off_in(HostState::Provisioned, 1);
                    let mut h = (*o.hosts[0]).clone();
                    h.annotations_mut().insert(
                        crate::api::HOST_PAUSED_ANNOTATION.to_string(),
                        String::new(),
                    );
                    o.hosts = vec![Arc::new(h)];
                    o
                },
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "host off, its registration failed: its controller writes nothing for the deletion, release at once",
                hosts_with(off_in(HostState::Error, 1), |s| {
                    s.error_type = Some(HostErrorType::RegistrationError)
                }),
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "host off, not registered: its controller writes nothing for the deletion, release at once",
                hosts_with(off_in(HostState::Registering, 1), |s| s.conditions.clear()),
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "host reads off 2 s after this controller powered it on: the power-on may be pending at the BMC, wait",
                Observed {
                    power: Some(Ok(PowerState::Off)),
                    last_power_on: Some(Duration::from_secs(2)),
                    ..deleting(claimed(observed()), 1)
                },
                Step::Nothing,
            ),
            (
                "host reads off once the power-on had time to land: release it",
                Observed {
                    power: Some(Ok(PowerState::Off)),
                    last_power_on: Some(POWER_SETTLE),
                    ..deleting(claimed(observed()), 1)
                },
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: None,
                },
            ),
            (
                "BMC unreachable within the deadline: wait",
                Observed {
                    power: Some(Err(fault.clone())),
                    ..deleting(claimed(observed()), 10)
                },
                Step::Nothing,
            ),
            (
                "BMC unreachable past the deadline: release, host to Error",
                Observed {
                    power: Some(Err(fault.clone())),
                    ..deleting(claimed(observed()), 700)
                },
                Step::Release {
                    host: "h1".into(),
                    resource_version: "rv-h1".into(),
                    fault: Some(fault.clone()),
                },
            ),
        ];
        for (what, o, want) in rows {
            assert_eq!(decide(&o, &policy()).step, want, "{what}");
        }
        // The wait for the host's Deprovisioning looks again when it runs out, and writes no
        // status of its own: the machine's status is the one the power-off left.
        let powered_off = decide(&off_in(HostState::Deprovisioning, 1), &policy());
        let waiting = decide(&off_in(HostState::Provisioned, 1), &policy());
        assert_eq!(
            waiting.requeue,
            Some(HOST_REACTION_WAIT - Duration::from_secs(1))
        );
        assert_eq!(waiting.note, None);
        assert_eq!(
            conditions::get(&waiting.status.conditions, READY),
            conditions::get(
                &off_in(HostState::Provisioned, 1)
                    .mm
                    .status
                    .clone()
                    .unwrap_or_default()
                    .conditions,
                READY
            ),
            "READY as it was"
        );
        assert!(matches!(powered_off.step, Step::Release { .. }));
    }

    /// Cleaning on release (issue 15): an image-mode tenant's host is wiped by the deploy agent
    /// before it is released; one that cannot be wiped is released into Error.
    #[test]
    fn cleaning_rows() {
        use crate::agent::protocol::{DeployReport, DeployState};
        let report = |state: DeployState, received: i64| DeployReport {
            state,
            device: None,
            written_bytes: 2 << 20,
            total_bytes: None,
            bytes_per_second: 0,
            reason: (state == DeployState::Failed).then(|| "CleaningFailed".into()),
            message: Some("wiped vda".into()),
            received_at: Some(at(received).to_string()),
        };
        // An image-mode machine deleted 10 s before `now`, its host on, with `boot`.
        let image = |provisioned: bool, boot: BootObservation, now: i64| {
            let mut o = with_mm(deprovisioning(claimed(observed())), |mm| {
                mm.spec.mode = crate::api::metalmachine::ProvisioningMode::Image;
                mm.spec.provider_id = provisioned.then(|| "metalboot://ns/h1/mm-uid".into());
                mm.metadata.deletion_timestamp = Some(Time(at(now - 10)));
            });
            o.boot = boot;
            o.now = at(now);
            o.power = Some(Ok(PowerState::On));
            o
        };
        let cleaning = |powered: Option<i64>, deploy: Option<DeployReport>| {
            let mut r = record(1, powered, false);
            r.clean = Some(WipeMode::Metadata);
            r.deploy = deploy;
            BootObservation::Record(Box::new(r))
        };
        // Sent for a cleaning attempt (the kept action names its attempt's kind and token).
        let unrecorded_cleaning = || {
            let BootObservation::Record(r) = cleaning(None, None) else {
                return None;
            };
            Some(UnrecordedPower {
                token: "0a1b2c".into(),
                ..UnrecordedPower::for_attempt(
                    Some("secret-uid"),
                    &r,
                    at(-3),
                    PoweredFor::NetworkBoot(None),
                )
            })
        };
        let with_host_mode = |mut o: Observed, mode: CleaningMode| {
            let mut h = (*o.hosts[0]).clone();
            h.spec.automated_cleaning_mode = Some(mode);
            o.hosts = vec![Arc::new(h)];
            o
        };
        let release = |fault: Option<Fault>| Step::Release {
            host: "h1".into(),
            resource_version: "rv-h1".into(),
            fault,
        };
        let off = |mut o: Observed| {
            o.power = Some(Ok(PowerState::Off));
            o
        };
        let start = |mode| Step::StartCleaning {
            host: "h1".into(),
            mode,
        };
        type Row = (&'static str, Observed, &'static str, Step);
        let rows: Vec<Row> = vec![
            (
                "provisioned image-mode tenant released: start cleaning (metadata by default)",
                image(true, BootObservation::None, 100),
                "Cleaning",
                start(WipeMode::Metadata),
            ),
            (
                "the host asks for a full erase",
                with_host_mode(image(true, BootObservation::None, 100), CleaningMode::Full),
                "Cleaning",
                start(WipeMode::Full),
            ),
            (
                "an interrupted write (powered attempt, never provisioned): cleaned too",
                image(
                    false,
                    BootObservation::Record(Box::new(record(1, Some(0), false))),
                    100,
                ),
                "Cleaning",
                start(WipeMode::Metadata),
            ),
            (
                "failed attempt (its boot Secret deleted at the failure): cleaned",
                with_mm(image(false, BootObservation::None, 100), |mm| {
                    mm.status = Some(MetalMachineStatus {
                        failure_reason: Some("ImageChecksumMismatch".into()),
                        ..Default::default()
                    })
                }),
                "Cleaning",
                start(WipeMode::Metadata),
            ),
            (
                "powered, the note of it refused: the agent may be writing, so cleaned",
                Observed {
                    unrecorded_power: unrecorded(PoweredFor::NetworkBoot(None)),
                    ..image(
                        false,
                        BootObservation::Record(Box::new(record(1, None, false))),
                        100,
                    )
                },
                "Cleaning",
                start(WipeMode::Metadata),
            ),
            (
                "never powered: nothing was written, plain power-off",
                image(
                    false,
                    BootObservation::Record(Box::new(record(1, None, false))),
                    100,
                ),
                "Deprovisioning",
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::GracefulOff,
                },
            ),
            (
                "cleaning disabled on the host: plain power-off",
                with_host_mode(
                    image(true, BootObservation::None, 100),
                    CleaningMode::Disabled,
                ),
                "Deprovisioning",
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::GracefulOff,
                },
            ),
            (
                "live mode writes nothing: plain power-off",
                with_mm(image(true, BootObservation::None, 100), |mm| {
                    mm.spec.mode = crate::api::metalmachine::ProvisioningMode::Live
                }),
                "Deprovisioning",
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::GracefulOff,
                },
            ),
            (
                "cleaning attempt not powered: netboot the agent",
                image(true, cleaning(None, None), 100),
                "Cleaning",
                Step::PowerOn {
                    host: "h1".into(),
                    attempt: 1,
                },
            ),
            (
                "cleaning attempt netbooted, the note of it refused: the note alone",
                Observed {
                    unrecorded_power: unrecorded_cleaning(),
                    ..image(true, cleaning(None, None), 100)
                },
                "Cleaning",
                Step::RecordPower(unrecorded_cleaning().unwrap()),
            ),
            (
                "agent not heard from, inside the cleaning timeout: wait",
                image(true, cleaning(Some(50), None), 100),
                "Cleaning",
                Step::Nothing,
            ),
            (
                "agent wiping, reported recently: wait",
                image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Writing, 90))),
                    100,
                ),
                "Cleaning",
                Step::Nothing,
            ),
            (
                "cleaned, host still on: forced off at once (nothing left to shut down)",
                image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Cleaned, 90))),
                    100,
                ),
                "Deprovisioning",
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::ForceOff,
                },
            ),
            (
                "cleaned long after the deletion: the power-off deadline runs from the agent's report",
                image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Cleaned, 2000))),
                    2010,
                ),
                "Deprovisioning",
                Step::PowerOff {
                    host: "h1".into(),
                    action: PowerAction::ForceOff,
                },
            ),
            (
                "cleaned and off: released",
                off(image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Cleaned, 90))),
                    100,
                )),
                "",
                release(None),
            ),
            (
                "the agent could not wipe: released into Error",
                off(image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Failed, 90))),
                    100,
                )),
                "",
                release(Some(Fault {
                    reason: "CleaningFailed",
                    message: "CleaningFailed: wiped vda".into(),
                })),
            ),
            (
                "the agent never came: released into Error after the cleaning timeout",
                off(image(true, cleaning(Some(0), None), 700)),
                "",
                release(Some(Fault {
                    reason: "CleaningTimeout",
                    message: "the deploy agent did not report within 600 s of the power-on".into(),
                })),
            ),
            (
                "the agent fell silent while wiping: released into Error",
                off(image(
                    true,
                    cleaning(Some(0), Some(report(DeployState::Writing, 100))),
                    400,
                )),
                "",
                release(Some(Fault {
                    reason: "AgentSilent",
                    message: "the deploy agent stopped reporting while cleaning (over 180 s)"
                        .into(),
                })),
            ),
        ];
        for (what, o, reason, want) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want, "{what}");
            assert_eq!(ready_reason(&d), reason, "{what}");
        }
    }

    /// Image mode (issue 15): the deploy agent's report decides, each phase on its own clock.
    #[test]
    fn image_mode_rows() {
        use crate::agent::protocol::{DeployReport, DeployState};
        let report = |state: DeployState, reason: Option<&str>, received: i64| DeployReport {
            state,
            device: Some("vda".into()),
            written_bytes: 64 << 20,
            total_bytes: Some(128 << 20),
            bytes_per_second: 8 << 20,
            reason: reason.map(String::from),
            message: reason.map(|_| "sha256 differs".to_string()),
            received_at: Some(at(received).to_string()),
        };
        // attempt, deploy report, restarted into disk at, now; boot timeout 100 s, 2 retries.
        let image =
            |attempt: u32, deploy: Option<DeployReport>, disk_boot: Option<i64>, now: i64| {
                let mut o = with_mm(claimed(observed()), |mm| {
                    mm.spec.mode = crate::api::metalmachine::ProvisioningMode::Image;
                });
                let mut r = record(attempt, Some(0), false);
                r.deploy = deploy;
                r.disk_boot_at = disk_boot.map(at);
                o.boot = BootObservation::Record(Box::new(r));
                o.now = at(now);
                o
            };
        let host = || "h1".to_string();
        type Row = (
            &'static str,
            Observed,
            &'static str,
            Step,
            Option<&'static str>,
        );
        let rows: Vec<Row> = vec![
            (
                "agent not heard from yet, inside the boot timeout: wait",
                image(1, None, None, 50),
                "WaitingForAgent",
                Step::Nothing,
                None,
            ),
            (
                "agent never spoke within the boot timeout: next attempt",
                image(1, None, None, 150),
                "BootTimeout",
                Step::NextAttempt,
                None,
            ),
            (
                "writing, reported recently, past the boot timeout: the silence bound applies, wait",
                image(1, Some(report(DeployState::Writing, None, 400)), None, 450),
                "WritingImage",
                Step::Nothing,
                None,
            ),
            (
                "writing but silent for longer than AGENT_SILENCE: next attempt",
                image(
                    1,
                    Some(report(DeployState::Writing, None, 10)),
                    None,
                    10 + 181,
                ),
                "AgentSilent",
                Step::NextAttempt,
                Some("ImageWriteFailed"),
            ),
            (
                "checksum mismatch, retries left: next attempt, reason kept",
                image(
                    2,
                    Some(report(
                        DeployState::Failed,
                        Some("ImageChecksumMismatch"),
                        20,
                    )),
                    None,
                    30,
                ),
                "ImageChecksumMismatch",
                Step::NextAttempt,
                Some("ImageWriteFailed"),
            ),
            (
                "checksum mismatch on the last attempt: terminal, token deleted",
                image(
                    3,
                    Some(report(
                        DeployState::Failed,
                        Some("ImageChecksumMismatch"),
                        20,
                    )),
                    None,
                    30,
                ),
                "ImageChecksumMismatch",
                Step::DeleteBootSecret,
                Some("BootFailed"),
            ),
            (
                "written, not restarted yet: boot the disk",
                image(1, Some(report(DeployState::Written, None, 60)), None, 61),
                "BootingInstalledOS",
                Step::RestartToDisk { host: host() },
                None,
            ),
            (
                "written, restarted, the note of the restart refused: the note alone",
                Observed {
                    unrecorded_power: unrecorded(PoweredFor::DiskBoot),
                    ..image(1, Some(report(DeployState::Written, None, 60)), None, 61)
                },
                "BootingInstalledOS",
                Step::RecordPower(unrecorded(PoweredFor::DiskBoot).unwrap()),
                None,
            ),
            (
                "restarted into the disk: never restarted twice, the timeout runs from the restart",
                image(
                    1,
                    Some(report(DeployState::Written, None, 60)),
                    Some(300),
                    350,
                ),
                "BootingInstalledOS",
                Step::Nothing,
                None,
            ),
            (
                "restarted into the disk and no callback within the boot timeout: next attempt",
                image(
                    1,
                    Some(report(DeployState::Written, None, 60)),
                    Some(300),
                    401,
                ),
                "BootTimeout",
                Step::NextAttempt,
                None,
            ),
        ];
        for (what, o, want_boot_reason, want_step, want_note) in rows {
            let d = decide(&o, &policy());
            assert_eq!(d.step, want_step, "{what}: step");
            let boot_reason = conditions::get(&d.status.conditions, BOOT_READY)
                .map(|c| c.reason.clone())
                .unwrap_or_default();
            assert_eq!(boot_reason, want_boot_reason, "{what}: BootReady reason");
            if let Some(want) = want_note {
                assert_eq!(
                    d.note.as_ref().map(|n| n.reason),
                    Some(want),
                    "{what}: note"
                );
            }
        }
        // A terminal write failure names the agent's reason on the Machine.
        let d = decide(
            &image(
                3,
                Some(report(DeployState::Failed, Some("DiskTooSmall"), 20)),
                None,
                30,
            ),
            &policy(),
        );
        assert_eq!(d.status.failure_reason.as_deref(), Some("DiskTooSmall"));
        assert_eq!(d.status.phase, Some(MetalMachinePhase::Failed));
    }

    #[test]
    fn boot_step_table() {
        let cases: Vec<(&str, BootRecord, i64, BootStep)> = vec![
            (
                "minted, never powered",
                record(1, None, false),
                0,
                BootStep::Power,
            ),
            (
                "powered, within the timeout",
                record(1, Some(0), false),
                40,
                BootStep::Wait(Duration::from_secs(60)),
            ),
            (
                "first timeout",
                record(1, Some(0), false),
                100,
                BootStep::Retry { next_attempt: 2 },
            ),
            (
                "second timeout",
                record(2, Some(0), false),
                150,
                BootStep::Retry { next_attempt: 3 },
            ),
            (
                "last attempt timed out",
                record(3, Some(0), false),
                100,
                BootStep::GiveUp { attempts: 3 },
            ),
            (
                "called back",
                record(2, Some(0), true),
                500,
                BootStep::Finish,
            ),
            (
                "clock behind the power time",
                record(1, Some(50), false),
                0,
                BootStep::Wait(Duration::from_secs(100)),
            ),
        ];
        for (what, r, now, want) in cases {
            assert_eq!(boot_step(&r, at(now), 100, 2), want, "{what}");
        }
        assert_eq!(
            boot_step(&record(1, Some(0), false), at(100), 100, 0),
            BootStep::GiveUp { attempts: 1 },
            "no retries"
        );
    }

    #[test]
    fn status_only_changes_when_something_changed() {
        // The same observation twice gives the same status: the caller writes only on change.
        let o = claimed(observed());
        let first = decide(&o, &policy());
        let again = with_mm(o, |mm| mm.status = Some(first.status.clone()));
        assert_eq!(decide(&again, &policy()).status, first.status);
    }

    #[test]
    fn addresses_keep_routable_ips_and_the_hostname() {
        let ip = |s: &str| s.parse().unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
        let cb = CallbackRecord {
            hostname: Some("node-0".into()),
            addresses: vec![
                ip("10.0.2.15"),
                ip("127.0.0.1"),
                ip("fe80::1"),
                ip("fd00::15"),
            ],
            source_ip: None,
            received_at: "t".into(),
        };
        let got: Vec<(MachineAddressType, String)> = addresses_from(&cb, "host-0")
            .into_iter()
            .map(|a| (a.type_, a.address))
            .collect();
        assert_eq!(
            got,
            vec![
                (MachineAddressType::InternalIP, "10.0.2.15".into()),
                (MachineAddressType::InternalIP, "fd00::15".into()),
                (MachineAddressType::Hostname, "node-0".into()),
            ]
        );
    }
}

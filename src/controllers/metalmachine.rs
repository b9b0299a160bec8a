//! MetalMachine controller: the Cluster API infrastructure-machine contract for bare metal.
//!
//! Normal path (seed 004 order): Machine owner → no terminal failure → Cluster exists →
//! finalizer → Cluster infrastructure provisioned → bootstrap data ready → claim a matching
//! Available host (optimistic concurrency) → boot Secret with a fresh token → one-time network
//! boot + power on → wait for the callback (power-cycle retries on timeout, then a terminal
//! failure) → providerID, addresses, ready → host Provisioned, token killed.
//! Deletion: power off (forced after a grace period), release the host, kill the token; a BMC
//! that stays unreachable marks the host Error and releases the machine anyway.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Resource, ResourceExt};

use crate::api::common::{MachineAddress, MachineAddressType};
use crate::api::metalhost::{ConsumerReference, HostState, PowerState};
use crate::api::metalmachine::{
    HostReference, MachineInitialization, MetalMachinePhase, MetalMachineStatus,
};
use crate::api::{
    CLUSTER_NAME_LABEL, Cluster, DEFAULT_FAILURE_DOMAIN_LABEL, HOST_PAUSED_ANNOTATION, Machine,
    MetalHost, MetalMachine,
};
use crate::bmc::{Bmc, BootDevice, PowerAction};
use crate::boot::tokens::{self, BOOT_TOKEN_LABEL, BootRecord, CallbackRecord, NewAttempt};

use super::conditions::{self, Want};
use super::hostbmc::{BmcConnector, load_target};
use super::metalhost::{Fault, fault};
use super::{Backoff, Events, ReconcileError, apply_status, is_paused, key, passes_watch_filter};

pub const FINALIZER: &str = "metalmachine.infrastructure.cluster.x-k8s.io";
pub const FIELD_MANAGER: &str = "metalboot-metalmachine";
pub const READY: &str = "Ready";
pub const HOST_ASSOCIATED: &str = "HostAssociated";
pub const BOOT_READY: &str = "BootReady";
pub const PAUSED: &str = "Paused";

/// The Machine that owns `mm` (the Cluster API Machine controller sets this owner reference).
pub fn machine_owner(mm: &MetalMachine) -> Option<&OwnerReference> {
    mm.owner_references()
        .iter()
        .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
}

/// Label selector semantics (matchLabels AND every matchExpression). An unknown operator
/// matches nothing, so a typo never claims a host it should not.
pub fn selector_matches(
    selector: Option<&LabelSelector>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let Some(selector) = selector else {
        return true;
    };
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let expressions_ok = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| values.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !values.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            _ => false,
        }
    });
    labels_ok && expressions_ok
}

/// Hosts `mm` may claim, best first: Available, online, unclaimed, not paused, in its namespace,
/// matching its selector; those in the Machine's failure domain first; then a stable order that
/// differs per machine so racing machines try different hosts first.
pub fn candidate_hosts(
    hosts: &[Arc<MetalHost>],
    mm: &MetalMachine,
    failure_domain: Option<&str>,
) -> Vec<Arc<MetalHost>> {
    let namespace = mm.namespace();
    let mut candidates: Vec<Arc<MetalHost>> = hosts
        .iter()
        .filter(|h| h.namespace() == namespace && h.meta().deletion_timestamp.is_none())
        .filter(|h| {
            let s = h.status.as_ref();
            s.and_then(|s| s.state) == Some(HostState::Available)
                && s.and_then(|s| s.consumer_ref.as_ref()).is_none()
        })
        .filter(|h| h.spec.online && !h.annotations().contains_key(HOST_PAUSED_ANNOTATION))
        .filter(|h| selector_matches(mm.spec.host_selector.as_ref(), h.labels()))
        .cloned()
        .collect();
    let seed = mm.uid().unwrap_or_else(|| mm.name_any());
    let spread = |h: &MetalHost| {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (seed.as_str(), h.name_any()).hash(&mut hasher);
        hasher.finish()
    };
    candidates.sort_by_key(|h| {
        let in_domain = failure_domain.is_some_and(|fd| {
            h.labels()
                .get(DEFAULT_FAILURE_DOMAIN_LABEL)
                .map(String::as_str)
                == Some(fd)
        });
        (!in_domain, spread(h))
    });
    candidates
}

/// Where one provisioning attempt stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BootStep {
    /// No boot Secret yet: mint attempt 1.
    Mint,
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
    record: Option<&BootRecord>,
    now: jiff::Timestamp,
    timeout_seconds: i32,
    retries: i32,
) -> BootStep {
    let Some(record) = record else {
        return BootStep::Mint;
    };
    if record.callback.is_some() {
        return BootStep::Finish;
    }
    let Some(powered_at) = record.powered_at else {
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

/// Machine addresses from a callback: each IP as InternalIP, the hostname (or the host name) as
/// Hostname.
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

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// How long a power-off request is given before the same request is sent again. BMCs apply
/// power actions asynchronously (sushy-tools and many real BMCs take seconds), and some restart
/// the transition on every repeated request, so hammering them delays the very power-off we want.
pub const POWER_OFF_RESEND: Duration = Duration::from_secs(30);

/// What deprovisioning does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeprovisionStep {
    /// Send this power-off request to the BMC now.
    Request(PowerAction),
    /// This request was sent recently: give the BMC time, and check the power state again.
    Wait(PowerAction),
    /// Powered off: release the host.
    Release,
    /// BMC trouble, still within the deadline: try again later.
    Retry(Fault),
    /// BMC trouble (or a host that will not power off) past the deadline: mark the host Error and
    /// release the machine.
    Abandon(Fault),
}

/// `last_request` is the power-off request already sent for this deletion and how long ago.
pub fn deprovision_step(
    power: Result<PowerState, Fault>,
    since_delete: Duration,
    graceful: Duration,
    deadline: Duration,
    last_request: Option<(PowerAction, Duration)>,
) -> DeprovisionStep {
    match power {
        Ok(PowerState::Off) => DeprovisionStep::Release,
        Ok(_) if since_delete >= deadline => DeprovisionStep::Abandon(Fault {
            reason: "PowerOffTimeout",
            message: format!(
                "host still not off {} s after deletion",
                since_delete.as_secs()
            ),
        }),
        Ok(_) => {
            let want = if since_delete >= graceful {
                PowerAction::ForceOff
            } else {
                PowerAction::GracefulOff
            };
            match last_request {
                Some((sent, ago)) if sent == want && ago < POWER_OFF_RESEND => {
                    DeprovisionStep::Wait(want)
                }
                _ => DeprovisionStep::Request(want),
            }
        }
        Err(f) if since_delete >= deadline => DeprovisionStep::Abandon(f),
        Err(f) => DeprovisionStep::Retry(f),
    }
}

pub fn provider_id(namespace: &str, host: &str) -> String {
    format!("metalboot://{namespace}/{host}")
}

pub struct MachineContext {
    pub client: kube::Client,
    pub connector: Arc<dyn BmcConnector>,
    pub hosts: Store<MetalHost>,
    pub events: Events,
    pub backoff: Backoff,
    /// How long a graceful power-off may take before it is forced.
    pub graceful_off: Duration,
    /// How long deletion keeps trying an unreachable BMC before releasing the machine anyway.
    pub deprovision_timeout: Duration,
    pub watch_filter: Option<String>,
    /// The power-off request last sent per deleting machine, and when (see [`POWER_OFF_RESEND`]).
    /// In memory: after a restart the request is simply sent once more.
    pub power_off_requests: std::sync::Mutex<HashMap<String, (PowerAction, std::time::Instant)>>,
}

struct Observed {
    machine: Machine,
    cluster: Cluster,
}

fn status_of(mm: &MetalMachine) -> MetalMachineStatus {
    mm.status.clone().unwrap_or_default()
}

async fn write(
    ctx: &MachineContext,
    mm: &MetalMachine,
    status: &MetalMachineStatus,
) -> Result<(), ReconcileError> {
    let api: Api<MetalMachine> =
        Api::namespaced(ctx.client.clone(), &mm.namespace().unwrap_or_default());
    apply_status(&api, &mm.name_any(), FIELD_MANAGER, status).await
}

/// Sets the phase and a Ready=False condition and writes, for the many "waiting for …" exits.
async fn wait_with(
    ctx: &MachineContext,
    mm: &MetalMachine,
    phase: MetalMachinePhase,
    reason: &str,
    message: String,
) -> Result<(), ReconcileError> {
    let mut status = status_of(mm);
    status.phase = Some(phase);
    status.observed_generation = mm.metadata.generation;
    conditions::set(
        &mut status.conditions,
        Want::f(READY, reason, message),
        mm.metadata.generation,
        &conditions::now(),
    );
    if status != status_of(mm) {
        write(ctx, mm, &status).await?;
    }
    Ok(())
}

async fn observe(
    ctx: &MachineContext,
    mm: &MetalMachine,
) -> Result<Result<Observed, (MetalMachinePhase, &'static str, String)>, ReconcileError> {
    let namespace = mm.namespace().unwrap_or_default();
    let Some(owner) = machine_owner(mm) else {
        return Ok(Err((
            MetalMachinePhase::Pending,
            "WaitingForMachineOwner",
            "no Machine owns this MetalMachine yet".into(),
        )));
    };
    let machines: Api<Machine> = Api::namespaced(ctx.client.clone(), &namespace);
    let Some(machine) = machines
        .get_opt(&owner.name)
        .await
        .map_err(ReconcileError::read(format!("Machine {}", owner.name)))?
    else {
        return Ok(Err((
            MetalMachinePhase::Pending,
            "WaitingForMachineOwner",
            format!("owner Machine {} not found", owner.name),
        )));
    };
    let cluster_name = mm
        .labels()
        .get(CLUSTER_NAME_LABEL)
        .cloned()
        .unwrap_or_else(|| machine.spec.cluster_name.clone());
    let clusters: Api<Cluster> = Api::namespaced(ctx.client.clone(), &namespace);
    let cluster = if cluster_name.is_empty() {
        None
    } else {
        clusters
            .get_opt(&cluster_name)
            .await
            .map_err(ReconcileError::read(format!("Cluster {cluster_name}")))?
    };
    let Some(cluster) = cluster else {
        return Ok(Err((
            MetalMachinePhase::Pending,
            "WaitingForCluster",
            format!("Cluster {cluster_name:?} not found"),
        )));
    };
    Ok(Ok(Observed { machine, cluster }))
}

async fn reconcile(
    mm: Arc<MetalMachine>,
    ctx: Arc<MachineContext>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(mm.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    let namespace = mm.namespace().unwrap_or_default();
    let api: Api<MetalMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    if mm.meta().deletion_timestamp.is_none() {
        // Seed 004 steps 1–3 come before the finalizer is added.
        let status = status_of(&mm);
        if status.failure_reason.is_some() || status.failure_message.is_some() {
            return Ok(Action::await_change());
        }
        if let Err((phase, reason, message)) = observe(&ctx, &mm).await? {
            wait_with(&ctx, &mm, phase, reason, message).await?;
            return Ok(Action::requeue(Duration::from_secs(15)));
        }
    }
    finalizer(&api, FINALIZER, mm, |event| async {
        match event {
            FinalizerEvent::Apply(mm) => apply(mm, ctx.clone()).await,
            FinalizerEvent::Cleanup(mm) => cleanup(mm, ctx.clone()).await,
        }
    })
    .await
    .map_err(|e| ReconcileError::Finalizer(Box::new(e)))
}

async fn apply(mm: Arc<MetalMachine>, ctx: Arc<MachineContext>) -> Result<Action, ReconcileError> {
    let namespace = mm.namespace().unwrap_or_default();
    let now = conditions::now();
    let generation = mm.metadata.generation;
    let observed = match observe(&ctx, &mm).await? {
        Ok(o) => o,
        Err((phase, reason, message)) => {
            wait_with(&ctx, &mm, phase, reason, message).await?;
            return Ok(Action::requeue(Duration::from_secs(15)));
        }
    };
    if is_paused(mm.as_ref(), Some(&observed.cluster)) {
        let mut status = status_of(&mm);
        conditions::set(
            &mut status.conditions,
            Want::t(PAUSED, "Paused", "the Cluster or this object is paused"),
            generation,
            &now,
        );
        write(&ctx, &mm, &status).await?;
        return Ok(Action::await_change());
    }
    if let Some(c) = status_of(&mm)
        .conditions
        .iter()
        .position(|c| c.type_ == PAUSED)
    {
        let mut status = status_of(&mm);
        status.conditions.remove(c);
        write(&ctx, &mm, &status).await?;
    }
    if !observed.cluster.infrastructure_provisioned() {
        wait_with(
            &ctx,
            &mm,
            MetalMachinePhase::Pending,
            "WaitingForClusterInfrastructure",
            "the Cluster's infrastructure is not provisioned yet".into(),
        )
        .await?;
        return Ok(Action::requeue(Duration::from_secs(15)));
    }
    let Some(data_secret) = observed.machine.spec.bootstrap.data_secret_name.clone() else {
        wait_with(
            &ctx,
            &mm,
            MetalMachinePhase::Pending,
            "WaitingForBootstrapData",
            "the Machine has no spec.bootstrap.dataSecretName yet".into(),
        )
        .await?;
        return Ok(Action::requeue(Duration::from_secs(15)));
    };

    // The host: the one we claimed before (status is rebuildable: found by consumer UID), or a new claim.
    let host = match claimed_host(&ctx, &mm).await? {
        Some(host) => host,
        None => match claim(&ctx, &mm, observed.machine.spec.failure_domain.as_deref()).await? {
            Some(host) => host,
            None => return Ok(Action::requeue(Duration::from_secs(10))),
        },
    };
    let host_name = host.name_any();
    let mut status = status_of(&mm);
    status.host_ref = Some(HostReference {
        name: host_name.clone(),
        uid: host.uid(),
    });
    status.failure_domain = host.labels().get(DEFAULT_FAILURE_DOMAIN_LABEL).cloned();
    status.observed_generation = generation;
    conditions::set(
        &mut status.conditions,
        Want::t(
            HOST_ASSOCIATED,
            "HostClaimed",
            format!("claimed MetalHost {host_name}"),
        ),
        generation,
        &now,
    );

    if mm.spec.provider_id.is_some() && status.ready {
        // Provisioned earlier; make sure the host says so and no token is left alive.
        ensure_host_state(&ctx, &host, HostState::Provisioned).await?;
        delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
        return Ok(Action::await_change());
    }
    if !host.spec.online {
        status.phase = Some(MetalMachinePhase::Provisioning);
        conditions::set(
            &mut status.conditions,
            Want::f(
                BOOT_READY,
                "HostOffline",
                format!("MetalHost {host_name} is held offline (spec.online: false)"),
            ),
            generation,
            &now,
        );
        conditions::set(
            &mut status.conditions,
            Want::f(
                READY,
                "HostOffline",
                format!("MetalHost {host_name} is held offline"),
            ),
            generation,
            &now,
        );
        write(&ctx, &mm, &status).await?;
        return Ok(Action::requeue(Duration::from_secs(30)));
    }

    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let boot_name = tokens::boot_secret_name(&mm.name_any());
    let boot_secret = secrets
        .get_opt(&boot_name)
        .await
        .map_err(ReconcileError::read(format!("Secret {boot_name}")))?;
    let record = match &boot_secret {
        Some(s) => match tokens::parse_boot_secret(s) {
            Ok(r) => Some(r),
            Err(e) => {
                // An edited or corrupt boot Secret is replaced by a fresh attempt.
                tracing::warn!(machine = %key(mm.as_ref()), error = %e, "replacing an unreadable boot Secret");
                delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
                return Ok(Action::requeue(Duration::from_secs(1)));
            }
        },
        None => None,
    };
    let step = boot_step(
        record.as_ref(),
        now.0,
        mm.spec.boot_timeout_seconds(),
        mm.spec.boot_retries(),
    );
    status.phase = Some(MetalMachinePhase::Provisioning);
    match step {
        BootStep::Mint => {
            let user_data = match bootstrap_data(&ctx, &namespace, &data_secret).await? {
                Ok(data) => data,
                Err(message) => {
                    conditions::set(
                        &mut status.conditions,
                        Want::f(READY, "WaitingForBootstrapData", message),
                        generation,
                        &now,
                    );
                    write(&ctx, &mm, &status).await?;
                    return Ok(Action::requeue(Duration::from_secs(15)));
                }
            };
            let owner = mm
                .controller_owner_ref(&())
                .ok_or_else(|| ReconcileError::Invalid("MetalMachine has no UID".into()))?;
            let secret = tokens::new_boot_secret(&NewAttempt {
                namespace: &namespace,
                metal_machine: &mm.name_any(),
                owner,
                cluster_name: mm
                    .labels()
                    .get(CLUSTER_NAME_LABEL)
                    .map(String::as_str)
                    .or(Some(observed.machine.spec.cluster_name.as_str())),
                host: &host_name,
                attempt: 1,
                provider_id: &provider_id(&namespace, &host_name),
                user_data: &user_data,
            });
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    return Ok(Action::requeue(Duration::from_secs(1)));
                }
                Err(e) => return Err(ReconcileError::write(format!("Secret {boot_name}"))(e)),
            }
            conditions::set(
                &mut status.conditions,
                Want::f(
                    BOOT_READY,
                    "PoweringOn",
                    "boot token minted; powering the host on",
                ),
                generation,
                &now,
            );
            write(&ctx, &mm, &status).await?;
            Ok(Action::requeue(Duration::from_millis(200)))
        }
        BootStep::Power => {
            let Some(record) = record else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            match power_for_boot(&ctx, &host).await {
                Ok(action) => {
                    secrets
                        .patch(
                            &boot_name,
                            &PatchParams::default(),
                            &Patch::Merge(tokens::powered_patch(now.0)),
                        )
                        .await
                        .map_err(ReconcileError::write(format!("Secret {boot_name}")))?;
                    ctx.events.publish(mm.as_ref(), false, "BootStarted", format!("MetalHost {host_name}: one-time network boot set, {action} (attempt {})", record.attempt)).await;
                    conditions::set(
                        &mut status.conditions,
                        Want::f(
                            BOOT_READY,
                            "WaitingForCallback",
                            format!(
                                "attempt {}: host network-booting, waiting for its bootstrap-success callback",
                                record.attempt
                            ),
                        ),
                        generation,
                        &now,
                    );
                    conditions::set(
                        &mut status.conditions,
                        Want::f(
                            READY,
                            "Provisioning",
                            format!("booting MetalHost {host_name}"),
                        ),
                        generation,
                        &now,
                    );
                    write(&ctx, &mm, &status).await?;
                    ctx.backoff.reset(&key(mm.as_ref()));
                    Ok(Action::requeue(
                        Duration::from_secs(mm.spec.boot_timeout_seconds().max(1) as u64)
                            .min(Duration::from_secs(30)),
                    ))
                }
                Err(f) => {
                    conditions::set(
                        &mut status.conditions,
                        Want::f(BOOT_READY, f.reason, f.message.clone()),
                        generation,
                        &now,
                    );
                    conditions::set(
                        &mut status.conditions,
                        Want::f(READY, f.reason, f.message.clone()),
                        generation,
                        &now,
                    );
                    write(&ctx, &mm, &status).await?;
                    ctx.events
                        .publish(mm.as_ref(), true, f.reason, f.message.clone())
                        .await;
                    Err(ReconcileError::Bmc {
                        host: host_name,
                        reason: f.reason,
                        message: f.message,
                    })
                }
            }
        }
        BootStep::Wait(remaining) => {
            let attempt = record.as_ref().map(|r| r.attempt).unwrap_or(1);
            conditions::set(
                &mut status.conditions,
                Want::f(
                    BOOT_READY,
                    "WaitingForCallback",
                    format!(
                        "attempt {attempt}: waiting for the bootstrap-success callback ({} s left)",
                        remaining.as_secs()
                    ),
                ),
                generation,
                &now,
            );
            conditions::set(
                &mut status.conditions,
                Want::f(
                    READY,
                    "Provisioning",
                    format!("booting MetalHost {host_name}"),
                ),
                generation,
                &now,
            );
            if status != status_of(&mm) {
                write(&ctx, &mm, &status).await?;
            }
            Ok(Action::requeue(remaining.min(Duration::from_secs(30))))
        }
        BootStep::Retry { next_attempt } => {
            let Some(secret) = boot_secret else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            // Replace atomically: the old token dies with the old resourceVersion.
            let next = tokens::next_attempt(&secret);
            secrets
                .replace(&boot_name, &PostParams::default(), &next)
                .await
                .map_err(ReconcileError::write(format!("Secret {boot_name}")))?;
            let message = format!(
                "no bootstrap-success callback from MetalHost {host_name} within {} s; power-cycling for attempt {next_attempt} of {}",
                mm.spec.boot_timeout_seconds(),
                mm.spec.boot_retries() + 1
            );
            ctx.events
                .publish(mm.as_ref(), true, "BootTimeout", message.clone())
                .await;
            conditions::set(
                &mut status.conditions,
                Want::f(BOOT_READY, "BootTimeout", message),
                generation,
                &now,
            );
            write(&ctx, &mm, &status).await?;
            Ok(Action::requeue(Duration::from_millis(200)))
        }
        BootStep::GiveUp { attempts } => {
            let message = format!(
                "MetalHost {host_name} never reported bootstrap success: {attempts} attempts of {} s each",
                mm.spec.boot_timeout_seconds()
            );
            status.phase = Some(MetalMachinePhase::Failed);
            status.failure_reason = Some("BootTimeout".into());
            status.failure_message = Some(message.clone());
            conditions::set(
                &mut status.conditions,
                Want::f(BOOT_READY, "BootTimeout", message.clone()),
                generation,
                &now,
            );
            conditions::set(
                &mut status.conditions,
                Want::f(READY, "BootTimeout", message.clone()),
                generation,
                &now,
            );
            write(&ctx, &mm, &status).await?;
            delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
            ctx.events
                .publish(mm.as_ref(), true, "BootFailed", message)
                .await;
            Ok(Action::await_change())
        }
        BootStep::Finish => {
            let Some(record) = record else {
                return Ok(Action::requeue(Duration::from_secs(1)));
            };
            finish(&ctx, &mm, &host, &record, status).await
        }
    }
}

async fn finish(
    ctx: &MachineContext,
    mm: &MetalMachine,
    host: &MetalHost,
    record: &BootRecord,
    mut status: MetalMachineStatus,
) -> Result<Action, ReconcileError> {
    let namespace = mm.namespace().unwrap_or_default();
    let host_name = host.name_any();
    let now = conditions::now();
    let generation = mm.metadata.generation;
    let id = provider_id(&namespace, &host_name);
    let api: Api<MetalMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    if mm.spec.provider_id.is_none() {
        let patch = serde_json::json!({"spec": {"providerID": id}});
        api.patch(
            &mm.name_any(),
            &super::merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(ReconcileError::write(format!(
            "MetalMachine {} spec.providerID",
            mm.name_any()
        )))?;
    }
    if let Some(callback) = &record.callback {
        status.addresses = addresses_from(callback, &host_name);
        if let Ok(called) = callback.received_at.parse::<jiff::Timestamp>() {
            if let Some(powered) = record.powered_at {
                crate::metrics::observe_phase("boot", called.duration_since(powered).as_secs_f64());
            }
            if let Some(created) = mm.metadata.creation_timestamp.as_ref() {
                crate::metrics::observe_phase(
                    "total",
                    called.duration_since(created.0).as_secs_f64(),
                );
            }
        }
    }
    status.ready = true;
    status.initialization = Some(MachineInitialization {
        provisioned: Some(true),
    });
    status.phase = Some(MetalMachinePhase::Provisioned);
    conditions::set(
        &mut status.conditions,
        Want::t(
            BOOT_READY,
            "BootstrapSucceeded",
            format!("MetalHost {host_name} reported bootstrap success"),
        ),
        generation,
        &now,
    );
    conditions::set(
        &mut status.conditions,
        Want::t(
            READY,
            "Provisioned",
            format!("running on MetalHost {host_name}"),
        ),
        generation,
        &now,
    );
    write(ctx, mm, &status).await?;
    ensure_host_state(ctx, host, HostState::Provisioned).await?;
    // The one-time network boot was consumed by this boot; leave the next boot to the disk.
    if let Ok(bmc) = bmc_for(ctx, host).await
        && let Err(e) = bmc
            .set_boot_once(BootDevice::Hdd, host.spec.boot_mode)
            .await
    {
        tracing::warn!(host = %host_name, error = %e, "could not set the next boot back to disk");
    }
    delete_boot_secret(ctx, &namespace, &mm.name_any()).await?;
    ctx.events
        .publish(
            mm,
            false,
            "Provisioned",
            format!(
                "MetalHost {host_name} bootstrapped (attempt {}); providerID {id}",
                record.attempt
            ),
        )
        .await;
    ctx.backoff.reset(&key(mm));
    Ok(Action::await_change())
}

async fn bootstrap_data(
    ctx: &MachineContext,
    namespace: &str,
    name: &str,
) -> Result<Result<Vec<u8>, String>, ReconcileError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let secret = secrets
        .get_opt(name)
        .await
        .map_err(ReconcileError::read(format!("bootstrap Secret {name}")))?;
    Ok(
        match secret
            .and_then(|s| s.data)
            .and_then(|mut d| d.remove("value"))
        {
            Some(value) => Ok(value.0),
            None => Err(format!(
                "bootstrap Secret {name} not found or has no key `value`"
            )),
        },
    )
}

async fn bmc_for(ctx: &MachineContext, host: &MetalHost) -> Result<Arc<dyn Bmc>, Fault> {
    let target = load_target(&ctx.client, host).await.map_err(|e| Fault {
        reason: e.reason(),
        message: e.to_string(),
    })?;
    ctx.connector
        .connect(&key(host), target)
        .map_err(|e| fault(&e))
}

/// One-time network boot, then power on (or cycle a host that is already on). Returns what it did.
async fn power_for_boot(ctx: &MachineContext, host: &MetalHost) -> Result<&'static str, Fault> {
    let bmc = bmc_for(ctx, host).await?;
    bmc.set_boot_once(BootDevice::Pxe, host.spec.boot_mode)
        .await
        .map_err(|e| fault(&e))?;
    let power = bmc.power_state().await.map_err(|e| fault(&e))?;
    let (action, said) = if power == PowerState::Off {
        (PowerAction::On, "powered on")
    } else {
        (PowerAction::Cycle, "power-cycled")
    };
    bmc.power(action).await.map_err(|e| fault(&e))?;
    // The host's power reading is stale now; ask the host controller for a fresh one soon.
    let hosts: Api<MetalHost> =
        Api::namespaced(ctx.client.clone(), &host.namespace().unwrap_or_default());
    let patch = serde_json::json!({"status": {"lastPowerCheck": null}});
    let _ = hosts
        .patch_status(
            &host.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await;
    Ok(said)
}

/// The host this machine claimed, found by consumer UID (so status is rebuildable).
async fn claimed_host(
    ctx: &MachineContext,
    mm: &MetalMachine,
) -> Result<Option<MetalHost>, ReconcileError> {
    let uid = mm.uid().unwrap_or_default();
    let namespace = mm.namespace().unwrap_or_default();
    let from_store = ctx.hosts.state().into_iter().find(|h| {
        h.namespace().as_deref() == Some(namespace.as_str())
            && h.status
                .as_ref()
                .and_then(|s| s.consumer_ref.as_ref())
                .is_some_and(|c| c.uid == uid)
    });
    let name = from_store.map(|h| h.name_any()).or_else(|| {
        mm.status
            .as_ref()
            .and_then(|s| s.host_ref.as_ref())
            .map(|r| r.name.clone())
    });
    let Some(name) = name else { return Ok(None) };
    // Confirm against the apiserver: the store may lag behind our own claim or release.
    let hosts: Api<MetalHost> = Api::namespaced(ctx.client.clone(), &namespace);
    let host = hosts
        .get_opt(&name)
        .await
        .map_err(ReconcileError::read(format!("MetalHost {name}")))?;
    Ok(host.filter(|h| {
        h.status
            .as_ref()
            .and_then(|s| s.consumer_ref.as_ref())
            .is_some_and(|c| c.uid == uid)
    }))
}

/// Claims the best candidate host with optimistic concurrency; None when none could be had.
async fn claim(
    ctx: &MachineContext,
    mm: &MetalMachine,
    failure_domain: Option<&str>,
) -> Result<Option<MetalHost>, ReconcileError> {
    let namespace = mm.namespace().unwrap_or_default();
    let hosts: Api<MetalHost> = Api::namespaced(ctx.client.clone(), &namespace);
    let candidates = candidate_hosts(&ctx.hosts.state(), mm, failure_domain);
    if candidates.is_empty() {
        let selector = mm
            .spec
            .host_selector
            .as_ref()
            .map(|s| serde_json::to_string(s).unwrap_or_default())
            .unwrap_or_else(|| "{}".into());
        let mut status = status_of(mm);
        let now = conditions::now();
        status.phase = Some(MetalMachinePhase::Claiming);
        let message = format!(
            "no Available MetalHost in namespace {namespace} matches hostSelector {selector}"
        );
        conditions::set(
            &mut status.conditions,
            Want::f(HOST_ASSOCIATED, "NoHostAvailable", message.clone()),
            mm.metadata.generation,
            &now,
        );
        conditions::set(
            &mut status.conditions,
            Want::f(READY, "NoHostAvailable", message),
            mm.metadata.generation,
            &now,
        );
        if status != status_of(mm) {
            write(ctx, mm, &status).await?;
        }
        return Ok(None);
    }
    let consumer = ConsumerReference {
        api_version: MetalMachine::api_version(&()).into_owned(),
        kind: "MetalMachine".into(),
        name: mm.name_any(),
        uid: mm.uid().unwrap_or_default(),
    };
    for candidate in candidates.iter().take(3) {
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": candidate.resource_version()},
            "status": {"consumerRef": consumer, "state": HostState::Provisioning},
        });
        match hosts
            .patch_status(
                &candidate.name_any(),
                &super::merge_params(FIELD_MANAGER),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(host) => {
                ctx.events
                    .publish(
                        mm,
                        false,
                        "HostClaimed",
                        format!("claimed MetalHost {}", host.name_any()),
                    )
                    .await;
                return Ok(Some(host));
            }
            // Someone else changed the host first (another machine claimed it): try the next.
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => {
                return Err(ReconcileError::write(format!(
                    "MetalHost {} claim",
                    candidate.name_any()
                ))(e));
            }
        }
    }
    Ok(None)
}

async fn ensure_host_state(
    ctx: &MachineContext,
    host: &MetalHost,
    state: HostState,
) -> Result<(), ReconcileError> {
    if host.status.as_ref().and_then(|s| s.state) == Some(state) {
        return Ok(());
    }
    let hosts: Api<MetalHost> =
        Api::namespaced(ctx.client.clone(), &host.namespace().unwrap_or_default());
    let patch = serde_json::json!({"status": {"state": state}});
    hosts
        .patch_status(
            &host.name_any(),
            &super::merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
        .map_err(ReconcileError::write(format!(
            "MetalHost {} state",
            host.name_any()
        )))
}

async fn delete_boot_secret(
    ctx: &MachineContext,
    namespace: &str,
    machine: &str,
) -> Result<(), ReconcileError> {
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let name = tokens::boot_secret_name(machine);
    match secrets.delete(&name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(ReconcileError::write(format!("Secret {name} deletion"))(e)),
    }
}

async fn release_host(
    ctx: &MachineContext,
    host: &MetalHost,
    error: Option<&Fault>,
) -> Result<(), ReconcileError> {
    let hosts: Api<MetalHost> =
        Api::namespaced(ctx.client.clone(), &host.namespace().unwrap_or_default());
    let patch = match error {
        None => {
            serde_json::json!({"status": {"consumerRef": null, "state": HostState::Available, "errorType": null, "errorMessage": null}})
        }
        Some(f) => serde_json::json!({"status": {
            "consumerRef": null, "state": HostState::Error, "errorType": "DeprovisioningError",
            "errorMessage": format!("released while its BMC could not power it off: {}", f.message)}}),
    };
    hosts
        .patch_status(
            &host.name_any(),
            &super::merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
        .map_err(ReconcileError::write(format!(
            "MetalHost {} release",
            host.name_any()
        )))
}

async fn cleanup(
    mm: Arc<MetalMachine>,
    ctx: Arc<MachineContext>,
) -> Result<Action, ReconcileError> {
    let namespace = mm.namespace().unwrap_or_default();
    let Some(host) = claimed_host(&ctx, &mm).await? else {
        tracing::debug!(machine = %key(mm.as_ref()), "deprovisioning: no claimed host");
        delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
        return Ok(Action::await_change());
    };
    let host_name = host.name_any();
    let since_delete = mm
        .meta()
        .deletion_timestamp
        .as_ref()
        .map(|t| jiff::Timestamp::now().duration_since(t.0).unsigned_abs())
        .unwrap_or_default();
    ensure_host_state(&ctx, &host, HostState::Deprovisioning).await?;
    let mut status = status_of(&mm);
    if status.phase != Some(MetalMachinePhase::Deprovisioning) {
        status.phase = Some(MetalMachinePhase::Deprovisioning);
        // The object may be on its way out; a failed status write must not block deletion.
        let _ = write(&ctx, &mm, &status).await;
    }
    let bmc = bmc_for(&ctx, &host).await;
    let power = match &bmc {
        Ok(b) => b.power_state().await.map_err(|e| fault(&e)),
        Err(f) => Err(f.clone()),
    };
    let machine_key = key(mm.as_ref());
    tracing::debug!(machine = %machine_key, host = %host_name, power = ?power, since_delete = ?since_delete, "deprovisioning step");
    let last_request = ctx
        .power_off_requests
        .lock()
        .ok()
        .and_then(|sent| sent.get(&machine_key).copied())
        .map(|(action, at)| (action, at.elapsed()));
    let step = deprovision_step(
        power,
        since_delete,
        ctx.graceful_off,
        ctx.deprovision_timeout,
        last_request,
    );
    if matches!(step, DeprovisionStep::Release | DeprovisionStep::Abandon(_))
        && let Ok(mut sent) = ctx.power_off_requests.lock()
    {
        sent.remove(&machine_key);
    }
    match step {
        DeprovisionStep::Release => {
            if let Ok(b) = &bmc
                && let Err(e) = b.set_boot_once(BootDevice::Hdd, host.spec.boot_mode).await
            {
                tracing::warn!(host = %host_name, error = %e, "could not reset the boot override");
            }
            release_host(&ctx, &host, None).await?;
            delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
            ctx.events
                .publish(
                    mm.as_ref(),
                    false,
                    "HostReleased",
                    format!("MetalHost {host_name} powered off and released"),
                )
                .await;
            Ok(Action::await_change())
        }
        DeprovisionStep::Request(action) | DeprovisionStep::Wait(action) => {
            // A power state was read, so the connection exists; a failed request is retried.
            if matches!(step, DeprovisionStep::Request(_))
                && let Ok(b) = &bmc
            {
                match b.power(action).await {
                    Ok(()) => {
                        if let Ok(mut sent) = ctx.power_off_requests.lock() {
                            sent.insert(machine_key, (action, std::time::Instant::now()));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(host = %host_name, error = %e, %action, "power-off request failed; will retry");
                    }
                }
            }
            Err(ReconcileError::Requeue {
                what: format!(
                    "waiting for MetalHost {host_name} to power off ({action} requested)"
                ),
                after: Duration::from_secs(3),
            })
        }
        DeprovisionStep::Retry(f) => {
            tracing::warn!(host = %host_name, reason = f.reason, "deprovisioning: {}", f.message);
            Err(ReconcileError::Requeue {
                what: format!("MetalHost {host_name}: {} ({})", f.message, f.reason),
                after: ctx
                    .backoff
                    .next(&key(mm.as_ref()))
                    .min(Duration::from_secs(15)),
            })
        }
        DeprovisionStep::Abandon(f) => {
            release_host(&ctx, &host, Some(&f)).await?;
            delete_boot_secret(&ctx, &namespace, &mm.name_any()).await?;
            let message = format!(
                "released MetalMachine although MetalHost {host_name} could not be powered off ({}); the host is in Error for an operator to check",
                f.message
            );
            ctx.events
                .publish(mm.as_ref(), true, "HostAbandoned", message.clone())
                .await;
            ctx.events
                .publish(&host, true, "DeprovisioningFailed", message)
                .await;
            Ok(Action::await_change())
        }
    }
}

fn error_policy(mm: Arc<MetalMachine>, error: &ReconcileError, ctx: Arc<MachineContext>) -> Action {
    if let Some(after) = error.requeue_after() {
        tracing::debug!(machine = %key(mm.as_ref()), "{error}");
        return Action::requeue(after);
    }
    let delay = ctx.backoff.next(&key(mm.as_ref()));
    tracing::warn!(machine = %key(mm.as_ref()), error = %error, retry_in = ?delay, "MetalMachine reconcile failed");
    Action::requeue(delay)
}

/// Builds the controller; `store()` of the result is the MetalMachine store the boot service reads.
pub fn controller(client: kube::Client, namespace: Option<&str>) -> Controller<MetalMachine> {
    let (machines, secrets, host_api, capi_machines): (
        Api<MetalMachine>,
        Api<Secret>,
        Api<MetalHost>,
        Api<Machine>,
    ) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
            Api::all(client.clone()),
        ),
    };
    let controller = Controller::new(machines, watcher::Config::default());
    let store = controller.store();
    let waiting = store.clone();
    controller
        // A boot Secret change (the host called back) wakes its machine at once.
        .owns(secrets, watcher::Config::default().labels(BOOT_TOKEN_LABEL))
        // A host change wakes its consumer, and machines still looking for a host.
        .watches(host_api, watcher::Config::default(), move |host| {
            let namespace = host.namespace();
            let consumer = host
                .status
                .as_ref()
                .and_then(|s| s.consumer_ref.as_ref())
                .map(|c| c.name.clone());
            waiting
                .state()
                .into_iter()
                .filter(|m| m.namespace() == namespace)
                .filter(|m| {
                    Some(m.name_any()) == consumer
                        || m.status
                            .as_ref()
                            .and_then(|s| s.host_ref.as_ref())
                            .is_none()
                })
                .map(|m| ObjectRef::from_obj(m.as_ref()))
                .collect::<Vec<_>>()
        })
        // The Machine getting its bootstrap data wakes its MetalMachine.
        .watches(capi_machines, watcher::Config::default(), move |machine| {
            let namespace = machine.namespace().unwrap_or_default();
            let r = &machine.spec.infrastructure_ref;
            (r.kind == "MetalMachine").then(|| ObjectRef::new(&r.name).within(&namespace))
        })
}

pub async fn run(controller: Controller<MetalMachine>, ctx: Arc<MachineContext>) {
    controller
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
    use crate::boot::tokens::{Token, parse_boot_secret};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn at(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + secs).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
    }

    fn record(attempt: u32, powered: Option<i64>, called_back: bool) -> BootRecord {
        BootRecord {
            namespace: "ns".into(),
            secret_name: "m-boot".into(),
            metal_machine: "m".into(),
            host: "h".into(),
            attempt,
            token: Token::mint(),
            provider_id: "metalboot://ns/h".into(),
            instance_id: "u-1".into(),
            user_data: vec![],
            callback: called_back.then(|| CallbackRecord {
                hostname: None,
                addresses: vec![],
                source_ip: None,
                received_at: "t".into(),
            }),
            powered_at: powered.map(at),
            resource_version: None,
        }
    }

    #[test]
    fn boot_step_table() {
        // timeout 100 s, 2 retries → 3 attempts in all.
        let cases: Vec<(&str, Option<BootRecord>, i64, BootStep)> = vec![
            ("nothing yet", None, 0, BootStep::Mint),
            (
                "minted, never powered (or restarted in between)",
                Some(record(1, None, false)),
                0,
                BootStep::Power,
            ),
            (
                "powered, within the timeout",
                Some(record(1, Some(0), false)),
                40,
                BootStep::Wait(Duration::from_secs(60)),
            ),
            (
                "first timeout",
                Some(record(1, Some(0), false)),
                100,
                BootStep::Retry { next_attempt: 2 },
            ),
            (
                "second timeout",
                Some(record(2, Some(0), false)),
                150,
                BootStep::Retry { next_attempt: 3 },
            ),
            (
                "last attempt timed out",
                Some(record(3, Some(0), false)),
                100,
                BootStep::GiveUp { attempts: 3 },
            ),
            (
                "called back",
                Some(record(2, Some(0), true)),
                500,
                BootStep::Finish,
            ),
            (
                "clock behind the power time",
                Some(record(1, Some(50), false)),
                0,
                BootStep::Wait(Duration::from_secs(100)),
            ),
        ];
        for (what, r, now, want) in cases {
            assert_eq!(boot_step(r.as_ref(), at(now), 100, 2), want, "{what}");
        }
        assert_eq!(
            boot_step(Some(&record(1, Some(0), false)), at(100), 100, 0),
            BootStep::GiveUp { attempts: 1 },
            "no retries"
        );
    }

    #[test]
    fn deprovision_step_table() {
        let s = Duration::from_secs;
        let f = Fault {
            reason: "BmcUnreachable",
            message: "refused".into(),
        };
        let graceful = Some((PowerAction::GracefulOff, s(2)));
        let cases = vec![
            (
                "off: release",
                Ok(PowerState::Off),
                s(0),
                graceful,
                DeprovisionStep::Release,
            ),
            (
                "on: ask nicely",
                Ok(PowerState::On),
                s(5),
                None,
                DeprovisionStep::Request(PowerAction::GracefulOff),
            ),
            (
                "asked nicely 2 s ago: wait, do not ask again",
                Ok(PowerState::On),
                s(7),
                graceful,
                DeprovisionStep::Wait(PowerAction::GracefulOff),
            ),
            (
                "asked nicely long ago: ask again",
                Ok(PowerState::PoweringOff),
                s(50),
                Some((PowerAction::GracefulOff, POWER_OFF_RESEND)),
                DeprovisionStep::Request(PowerAction::GracefulOff),
            ),
            (
                "still on after grace: force, once",
                Ok(PowerState::On),
                s(61),
                graceful,
                DeprovisionStep::Request(PowerAction::ForceOff),
            ),
            (
                "forced 10 s ago: wait",
                Ok(PowerState::On),
                s(71),
                Some((PowerAction::ForceOff, s(10))),
                DeprovisionStep::Wait(PowerAction::ForceOff),
            ),
            (
                "BMC down: retry",
                Err(f.clone()),
                s(10),
                None,
                DeprovisionStep::Retry(f.clone()),
            ),
            (
                "BMC down too long: abandon",
                Err(f.clone()),
                s(301),
                graceful,
                DeprovisionStep::Abandon(f.clone()),
            ),
        ];
        for (what, power, since, last, want) in cases {
            assert_eq!(
                deprovision_step(power, since, s(60), s(300), last),
                want,
                "{what}"
            );
        }
        assert!(matches!(
            deprovision_step(
                Ok(PowerState::On),
                s(400),
                s(60),
                s(300),
                Some((PowerAction::ForceOff, s(1)))
            ),
            DeprovisionStep::Abandon(_)
        ));
    }

    #[test]
    fn selector_semantics() {
        let labels: BTreeMap<String, String> = [
            ("role".to_string(), "worker".to_string()),
            ("rack".to_string(), "a".to_string()),
        ]
        .into();
        let expr = |key: &str, op: &str, values: &[&str]| LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        };
        let sel = |labels: &[(&str, &str)], exprs: Vec<LabelSelectorRequirement>| LabelSelector {
            match_labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            match_expressions: Some(exprs),
        };
        assert!(selector_matches(None, &labels));
        assert!(selector_matches(
            Some(&sel(&[("role", "worker")], vec![])),
            &labels
        ));
        assert!(!selector_matches(
            Some(&sel(&[("role", "control-plane")], vec![])),
            &labels
        ));
        assert!(selector_matches(
            Some(&sel(&[], vec![expr("rack", "In", &["a", "b"])])),
            &labels
        ));
        assert!(!selector_matches(
            Some(&sel(&[], vec![expr("rack", "NotIn", &["a"])])),
            &labels
        ));
        assert!(selector_matches(
            Some(&sel(&[], vec![expr("gpu", "DoesNotExist", &[])])),
            &labels
        ));
        assert!(!selector_matches(
            Some(&sel(&[], vec![expr("gpu", "Exists", &[])])),
            &labels
        ));
        assert!(
            !selector_matches(Some(&sel(&[], vec![expr("rack", "Typo", &["a"])])), &labels),
            "unknown operators match nothing"
        );
    }

    #[test]
    fn candidates_prefer_the_failure_domain_and_skip_unavailable_hosts() {
        use crate::api::metalhost::{BmcDetails, MetalHostSpec, MetalHostStatus};
        let host = |name: &str, state: HostState, online: bool, fd: Option<&str>| {
            let mut h = MetalHost::new(
                name,
                MetalHostSpec {
                    bmc: BmcDetails {
                        address: "redfish://b".into(),
                        credentials_name: "c".into(),
                        disable_certificate_verification: None,
                        ca_secret_name: None,
                    },
                    boot_mac_address: "52:54:00:00:00:01".into(),
                    boot_mode: None,
                    online,
                    description: None,
                },
            );
            h.metadata.namespace = Some("ns".into());
            h.metadata.labels = Some(
                fd.map(|fd| [(DEFAULT_FAILURE_DOMAIN_LABEL.to_string(), fd.to_string())].into())
                    .unwrap_or_default(),
            );
            h.status = Some(MetalHostStatus {
                state: Some(state),
                ..Default::default()
            });
            Arc::new(h)
        };
        let hosts = vec![
            host("a", HostState::Available, true, Some("rack-a")),
            host("b", HostState::Available, true, Some("rack-b")),
            host("c", HostState::Provisioned, true, Some("rack-b")),
            host("d", HostState::Available, false, Some("rack-b")),
            host("e", HostState::Error, true, None),
        ];
        let mut mm = MetalMachine::new("m", Default::default());
        mm.metadata.namespace = Some("ns".into());
        let names = |v: Vec<Arc<MetalHost>>| v.iter().map(|h| h.name_any()).collect::<Vec<_>>();
        assert_eq!(names(candidate_hosts(&hosts, &mm, Some("rack-b")))[0], "b");
        assert_eq!(names(candidate_hosts(&hosts, &mm, Some("rack-a")))[0], "a");
        let mut all = names(candidate_hosts(&hosts, &mm, None));
        all.sort();
        assert_eq!(all, vec!["a", "b"]);
    }

    #[test]
    fn addresses_keep_routable_ips_and_the_hostname() {
        let cb = CallbackRecord {
            hostname: Some("node-0".into()),
            addresses: vec![
                "10.0.2.15".parse().unwrap(),
                "127.0.0.1".parse().unwrap(),
                "fe80::1".parse().unwrap(),
                "fd00::15".parse().unwrap(),
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
        let _ = parse_boot_secret; // keep the import used in this test module's scope
    }
}

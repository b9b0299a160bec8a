//! Carrying out the one step `decide` chose: a BMC call, or one write with a precondition. Each
//! write records an expectation, so the next decision waits until the store has seen it.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, Patch, PostParams, Preconditions};
use kube::{Resource, ResourceExt};

use crate::api::metalhost::{ConsumerReference, PowerState};
use crate::api::{CLUSTER_NAME_LABEL, MetalHost, MetalMachine};
use crate::bmc::{Bmc, BootDevice, PowerAction};
use crate::boot::tokens::{self, CleanAttempt, NewAttempt};
use crate::controllers::expectations::object_key;
use crate::controllers::power::Fault;
use crate::controllers::{ReconcileError, merge_params};

use super::decide::{PoweredFor, Step, UnrecordedPower};
use super::observe::{BootObservation, Observed, OwnerObservation};
use super::{ADDRESSES_ANNOTATION, FIELD_MANAGER, FINALIZER, MachineContext};

/// Why a step was not done.
#[derive(Debug)]
pub enum ActError {
    /// Someone wrote first (409): decide again from a fresher store. Not an error.
    Conflict(String),
    /// Cannot be done yet, for a reason worth a condition (no backoff).
    Waiting(Fault),
    /// The BMC or its credentials failed: shown in conditions, retried with backoff.
    Fault(Fault),
    Api(ReconcileError),
}

fn write_error(what: String) -> impl FnOnce(kube::Error) -> ActError {
    move |e| match e {
        kube::Error::Api(ref s) if s.code == 409 => ActError::Conflict(what),
        e => ActError::Api(ReconcileError::Write { what, source: e }),
    }
}

pub async fn bmc_for(ctx: &MachineContext, host: &MetalHost) -> Result<Arc<dyn Bmc>, Fault> {
    crate::controllers::hostbmc::connect(&ctx.client, ctx.connector.as_ref(), host).await
}

/// A merge patch conditioned on `replaced`, the resourceVersion the decision was made from (a
/// stale decision becomes a 409 and is decided again), recorded as an expectation on behalf of
/// `writer` (the MetalMachine deciding) so its next decision waits until the store shows it.
async fn patch_from<K>(
    ctx: &MachineContext,
    writer: &MetalMachine,
    api: &Api<K>,
    name: &str,
    replaced: Option<String>,
    patch: serde_json::Value,
    what: &str,
) -> Result<K, ActError>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let kind = K::kind(&());
    // Every object a MetalMachine writes is in its own namespace.
    let namespace = writer.namespace().unwrap_or_default();
    let key = object_key(&kind, &namespace, name);
    let writer = object_key("MetalMachine", &namespace, &writer.name_any());
    let patch = crate::controllers::conditioned(patch, replaced.as_deref());
    let written = match api
        .patch(name, &merge_params(FIELD_MANAGER), &Patch::Merge(&patch))
        .await
    {
        Ok(written) => written,
        Err(e) => {
            // A 409: the store's version is stale. A lost answer: the write may have landed,
            // and a pass deciding from a store without it would act again (a claim decided
            // again could claim a second host). Either way the next passes wait until the store
            // moves past `replaced` (or the apiserver says, after the TTL, that it will not).
            if matches!(&e, kube::Error::Api(s) if s.code == 409) {
                ctx.expectations.conflicted_for(key, replaced, &writer);
            } else if may_have_landed(&e) {
                ctx.expectations.uncertain_for(key, replaced, &writer);
            }
            return Err(write_error(format!("{kind} {name} {what}"))(e));
        }
    };
    ctx.expectations.wrote_for(
        key,
        replaced,
        written.meta().resource_version.clone(),
        &writer,
    );
    Ok(written)
}

/// Whether a write that failed with `e` may have been applied all the same: its answer was lost
/// (the connection, the client's stack) or unreadable, or the apiserver failed after taking it
/// (5xx). A refusal (4xx) or a request that was never sent (no connection) changed nothing.
fn may_have_landed(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(status) => status.code >= 500,
        kube::Error::Service(source) => !never_connected(source.as_ref()),
        kube::Error::HyperError(_) | kube::Error::ReadEvents(_) | kube::Error::SerdeError(_) => {
            true
        }
        _ => false,
    }
}

/// Whether the client failed to connect, so the request never left.
fn never_connected(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.downcast_ref::<hyper_util::client::legacy::Error>()
            .is_some_and(hyper_util::client::legacy::Error::is_connect)
        {
            return true;
        }
        cause = e.source();
    }
    false
}

/// A power action can be neither undone nor conditioned on a resourceVersion the way a write
/// can. So before one, the boot Secret the decision was made from must still be the apiserver's
/// (one GET of its metadata). A store that lags behind a starved apiserver shows an attempt that
/// has since been powered or called back; acting on it would reset a host mid-boot or after its
/// callback. A moved Secret becomes an expectation: the next passes wait for the store.
async fn fence_power(
    ctx: &MachineContext,
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
    decided: Option<&str>,
) -> Result<(), ActError> {
    let live = secrets
        .get_metadata_opt(name)
        .await
        .map_err(|source| {
            ActError::Api(ReconcileError::Read {
                what: format!("Secret {name} before a power action"),
                source,
            })
        })?
        .and_then(|m| m.metadata.resource_version);
    if live.as_deref() == decided {
        return Ok(());
    }
    let key = object_key("Secret", namespace, name);
    crate::metrics::record_store_lag("Secret", "fenced");
    tracing::info!(
        object = %key,
        store = decided.unwrap_or("absent"),
        apiserver = live.as_deref().unwrap_or("absent"),
        "the boot Secret moved on since the store's copy; no power action from it"
    );
    ctx.expectations
        .wrote(key, decided.map(str::to_string), live);
    Err(ActError::Conflict(format!(
        "Secret {name} changed since the decision"
    )))
}

/// Keeps a power action just sent for the attempt `o` decided from as unnoted (until
/// [`note_power`] writes its note), and returns it.
fn keep_unnoted(
    ctx: &MachineContext,
    o: &Observed,
    mm_key: &str,
    kind: PoweredFor,
) -> Result<UnrecordedPower, ActError> {
    let (BootObservation::Record(record), Some(secret)) = (&o.boot, &o.boot_secret) else {
        return Err(ActError::Conflict("boot Secret gone".into()));
    };
    let sent = UnrecordedPower::for_attempt(secret.metadata.uid.as_deref(), record, o.now, kind);
    ctx.unrecorded_power.insert(mm_key, sent.clone());
    Ok(sent)
}

/// Notes a power action on the boot Secret, conditioned on the version decided from; once
/// written, the action is no longer kept as unrecorded.
async fn note_power(
    ctx: &MachineContext,
    o: &Observed,
    secrets: &Api<Secret>,
    boot_name: &str,
    mm_key: &str,
    sent: &UnrecordedPower,
) -> Result<(), ActError> {
    let BootObservation::Record(record) = &o.boot else {
        return Err(ActError::Conflict("boot Secret gone".into()));
    };
    let (patch, what) = match sent.kind {
        PoweredFor::NetworkBoot(boot_once) => {
            (tokens::powered_patch(sent.at, boot_once), "powered-at")
        }
        PoweredFor::DiskBoot => (tokens::disk_boot_patch(sent.at), "disk-boot-at"),
    };
    let replaced = record.resource_version.clone();
    patch_from(
        ctx,
        o.mm.as_ref(),
        secrets,
        boot_name,
        replaced,
        patch,
        what,
    )
    .await?;
    ctx.unrecorded_power.remove(mm_key);
    Ok(())
}

fn host_named<'a>(o: &'a Observed, name: &str) -> Result<&'a MetalHost, ActError> {
    o.hosts
        .iter()
        .find(|h| h.name_any() == name)
        .map(Arc::as_ref)
        .ok_or_else(|| ActError::Conflict(format!("MetalHost {name} left the store")))
}

/// What a step changed on the MetalMachine itself, for the status written after it.
#[derive(Debug, Default)]
pub struct Acted {
    /// The generation the step's own spec write produced: the status decided with that write
    /// describes it, so it is stamped with it (not with the older one, which would cost a second
    /// write just to move observedGeneration).
    pub generation: Option<i64>,
}

/// Takes `step`. Each step's work is boxed: a future is as large as its largest branch, and
/// the power steps' BMC calls made every pass carry their size (the boxed pass, up to
/// `CONCURRENT_PASSES` at once, was 14.9 KB); boxed, a pass allocates only the step it takes.
pub async fn act(ctx: &MachineContext, o: &Observed, step: &Step) -> Result<Acted, ActError> {
    let mm = o.mm.as_ref();
    let namespace = mm.namespace().unwrap_or_default();
    let name = mm.name_any();
    let mm_key = object_key("MetalMachine", &namespace, &name);
    let machines: Api<MetalMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    let hosts: Api<MetalHost> = Api::namespaced(ctx.client.clone(), &namespace);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let boot_name = tokens::boot_secret_name(&name);
    let boot_key = object_key("Secret", &namespace, &boot_name);
    match step {
        Step::Nothing => Ok(Acted::default()),
        Step::AddFinalizer | Step::RemoveFinalizer => Box::pin(async {
            let mut finalizers: Vec<String> = mm
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect();
            if *step == Step::AddFinalizer {
                finalizers.push(FINALIZER.into());
            }
            // Conditioned on the version we decided from: a stale read is a 409 and a new
            // decision, never a lost finalizer of someone else.
            let emptied = finalizers.is_empty();
            let patch = serde_json::json!({"metadata": {"finalizers": finalizers}});
            let replaced = mm.resource_version();
            let removing = *step == Step::RemoveFinalizer;
            match patch_from(
                ctx,
                mm,
                &machines,
                &name,
                replaced.clone(),
                patch,
                "finalizers",
            )
            .await
            {
                // The last finalizer gone, the object is deleted, and the answer may carry the
                // very version it replaced (which sets no expectation): expect the deletion.
                Ok(_) if removing && emptied => {
                    ctx.expectations.wrote(mm_key.clone(), replaced, None)
                }
                Ok(written) => super::keep_answer(ctx, written),
                // Already gone: a pass decided from a store that still shows the deleted object.
                Err(ActError::Api(ReconcileError::Write {
                    source: kube::Error::Api(ref s),
                    ..
                })) if removing && s.code == 404 => {
                    ctx.expectations.wrote(mm_key.clone(), replaced, None);
                }
                Err(e) => return Err(e),
            }
            if removing {
                // The machine is gone for good: drop everything kept about it but the
                // expectation of that last write, so passes from a store that still shows the
                // object wait for its deletion instead of patching a deleted object again.
                ctx.expectations.forget(&boot_key);
                ctx.power_requests.forget(&mm_key);
                ctx.power_ons.forget(&mm_key);
                ctx.unrecorded_power.remove(&mm_key);
                ctx.backoff.reset(&crate::controllers::key(mm));
            }
            Ok(Acted::default())
        })
        .await,
        Step::Claim {
            host,
            resource_version,
        } => Box::pin(async {
            let consumer = ConsumerReference::to_metal_machine(&name, &namespace);
            let patch = super::claim::claim_patch(&consumer);
            let replaced = Some(resource_version.clone());
            let _in_flight = ctx.claims_in_flight.claiming(&namespace, host);
            patch_from(ctx, mm, &hosts, host, replaced, patch, "claim").await?;
            Ok(Acted::default())
        })
        .await,
        Step::Mint { host, provider_id } => Box::pin(async {
            let user_data = bootstrap_data(ctx, o, &namespace).await?;
            let owner = mm.controller_owner_ref(&()).ok_or_else(|| {
                ActError::Api(ReconcileError::Invalid("MetalMachine has no UID".into()))
            })?;
            let cluster_name = (!o.cluster_name.is_empty()).then_some(o.cluster_name.as_str());
            let secret = tokens::new_boot_secret(&NewAttempt {
                namespace: &namespace,
                metal_machine: &name,
                owner,
                cluster_name: mm
                    .labels()
                    .get(CLUSTER_NAME_LABEL)
                    .map(String::as_str)
                    .or(cluster_name),
                host,
                attempt: 1,
                provider_id,
                user_data: &user_data,
            });
            let created = secrets
                .create(&PostParams::default(), &secret)
                .await
                .map_err(write_error(format!("Secret {boot_name}")))?;
            ctx.expectations
                .wrote(boot_key, None, created.resource_version());
            Ok(Acted::default())
        })
        .await,
        Step::PowerOn { host, attempt } => Box::pin(async {
            let BootObservation::Record(record) = &o.boot else {
                return Err(ActError::Conflict("boot Secret gone".into()));
            };
            let target = host_named(o, host)?;
            fence_power(
                ctx,
                &secrets,
                &namespace,
                &boot_name,
                record.resource_version.as_deref(),
            )
            .await?;
            let bmc = bmc_for(ctx, target).await.map_err(ActError::Fault)?;
            bmc.set_boot_once(BootDevice::Pxe, target.spec.boot_mode)
                .await
                .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
            // While neither the host's record nor this attempt's boot Secret says how its BMC
            // keeps a one-time override, the power read also reads the override back (one
            // request on Redfish, as before).
            let (power, boot_once) = if super::decide::boot_once_known(o, target).is_none() {
                let (power, read) = bmc
                    .power_and_boot_override()
                    .await
                    .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
                let once = read.once_after_setting(BootDevice::Pxe);
                tracing::info!(host = %host, read = ?read, learned = ?once, "one-time network boot read back");
                (power, once)
            } else {
                let power = bmc
                    .power_state()
                    .await
                    .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
                (power, None)
            };
            let (action, said) = if power == PowerState::Off {
                (PowerAction::On, "powered on")
            } else {
                (PowerAction::Cycle, "power-cycled")
            };
            bmc.power(action)
                .await
                .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
            ctx.power_ons.record(&mm_key, action);
            let sent = keep_unnoted(ctx, o, &mm_key, PoweredFor::NetworkBoot(boot_once))?;
            // The Event says what the BMC did, whether or not the note landed.
            let noted = note_power(ctx, o, &secrets, &boot_name, &mm_key, &sent).await;
            let (reason, note) = match record.clean {
                Some(mode) => (
                    "CleaningStarted",
                    format!(
                        "MetalHost {host}: one-time network boot set, {said} to wipe its disks ({mode:?})"
                    ),
                ),
                None => (
                    "BootStarted",
                    format!(
                        "MetalHost {host}: one-time network boot set, {said} (attempt {attempt})"
                    ),
                ),
            };
            ctx.events.publish(mm, false, reason, note).await;
            noted.map(|()| Acted::default())
        })
        .await,
        Step::RecordPower(sent) => Box::pin(async {
            note_power(ctx, o, &secrets, &boot_name, &mm_key, sent).await?;
            Ok(Acted::default())
        })
        .await,
        Step::StartCleaning { host, mode } => Box::pin(async {
            let target = host_named(o, host)?;
            let host_owner = OwnerReference {
                api_version: MetalHost::api_version(&()).to_string(),
                kind: MetalHost::kind(&()).to_string(),
                name: host.clone(),
                uid: target
                    .uid()
                    .ok_or_else(|| ActError::Conflict(format!("MetalHost {host} has no UID")))?,
                controller: None,
                block_owner_deletion: None,
            };
            let provider_id = mm.spec.provider_id.clone().unwrap_or_else(|| {
                super::decide::provider_id(&namespace, host, &mm.uid().unwrap_or_default())
            });
            let mut secret = tokens::clean_boot_secret(&CleanAttempt {
                namespace: &namespace,
                metal_machine: &name,
                host_owner,
                cluster_name: mm.labels().get(CLUSTER_NAME_LABEL).map(String::as_str),
                provider_id: &provider_id,
                mode: *mode,
            });
            let current = o.boot_secret.clone();
            // Replacing the provisioning attempt's Secret (with its resourceVersion) kills its
            // token in the same write that creates the cleaning token.
            let written = match &current {
                Some(old) => {
                    secret.metadata.resource_version = old.resource_version();
                    secrets
                        .replace(&boot_name, &PostParams::default(), &secret)
                        .await
                }
                None => secrets.create(&PostParams::default(), &secret).await,
            }
            .map_err(write_error(format!("Secret {boot_name}")))?;
            ctx.expectations.wrote(
                boot_key,
                current.and_then(|s| s.resource_version()),
                written.resource_version(),
            );
            Ok(Acted::default())
        })
        .await,
        Step::NextAttempt => Box::pin(async {
            let Some(secret) = o.boot_secret.as_ref().map(|s| s.to_secret()) else {
                return Err(ActError::Conflict("boot Secret gone".into()));
            };
            // Conditioned on the resourceVersion: the old token dies with the old version.
            let patch = tokens::renewal_patch(&secret, &tokens::next_attempt(&secret));
            patch_from(
                ctx,
                mm,
                &secrets,
                &boot_name,
                secret.resource_version(),
                patch,
                "next attempt",
            )
            .await?;
            Ok(Acted::default())
        })
        .await,
        Step::RecordProvisioned {
            provider_id,
            failure_domain,
            addresses,
        } => Box::pin(async {
            let addresses = serde_json::to_string(addresses)
                .map_err(|e| ActError::Api(ReconcileError::Invalid(format!("addresses: {e}"))))?;
            let mut spec = serde_json::json!({"providerID": provider_id});
            if let Some(fd) = failure_domain {
                spec["failureDomain"] = serde_json::json!(fd);
            }
            let patch = serde_json::json!({
                "metadata": {"annotations": {ADDRESSES_ANNOTATION: addresses}},
                "spec": spec,
            });
            let replaced = mm.resource_version();
            let written =
                patch_from(ctx, mm, &machines, &name, replaced, patch, "providerID").await?;
            let generation = written.metadata.generation;
            super::keep_answer(ctx, written);
            Ok(Acted { generation })
        })
        .await,
        Step::RestartToDisk { host } => Box::pin(async {
            let BootObservation::Record(record) = &o.boot else {
                return Err(ActError::Conflict("boot Secret gone".into()));
            };
            let target = host_named(o, host)?;
            fence_power(
                ctx,
                &secrets,
                &namespace,
                &boot_name,
                record.resource_version.as_deref(),
            )
            .await?;
            let bmc = bmc_for(ctx, target).await.map_err(ActError::Fault)?;
            bmc.set_boot_once(BootDevice::Hdd, target.spec.boot_mode)
                .await
                .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
            bmc.power(PowerAction::Cycle)
                .await
                .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
            ctx.power_ons.record(&mm_key, PowerAction::Cycle);
            let sent = keep_unnoted(ctx, o, &mm_key, PoweredFor::DiskBoot)?;
            let noted = note_power(ctx, o, &secrets, &boot_name, &mm_key, &sent).await;
            ctx.events
                .publish(
                    mm,
                    false,
                    "BootingInstalledOS",
                    format!(
                        "MetalHost {host}: image written; next boot set to disk, power-cycled (attempt {})",
                        record.attempt
                    ),
                )
                .await;
            noted.map(|()| Acted::default())
        })
        .await,
        Step::ArmNextBoot { host, netboot } => Box::pin(async {
            // The next power-on network-boots the OS again. Best effort, as for image mode's
            // disk: a BMC that refuses leaves a warning, and the host's own boot order decides.
            if *netboot {
                next_boot_best_effort(ctx, o, mm, host, BootDevice::Pxe).await?;
            }
            let current = o.boot_secret.as_ref().map(|s| s.to_secret());
            // Conditioned on the resourceVersion: the last boot's token dies with it.
            if let Some(secret) = &current {
                let patch = tokens::renewal_patch(secret, &tokens::next_boot(secret));
                let replaced = secret.resource_version();
                patch_from(ctx, mm, &secrets, &boot_name, replaced, patch, "next boot").await?;
                return Ok(Acted::default());
            }
            // Gone (deleted by hand): a fresh Secret for the same boot, from the bootstrap data.
            let user_data = bootstrap_data(ctx, o, &namespace).await?;
            let owner = mm.controller_owner_ref(&()).ok_or_else(|| {
                ActError::Api(ReconcileError::Invalid("MetalMachine has no UID".into()))
            })?;
            let provider_id = mm.spec.provider_id.clone().unwrap_or_default();
            let fresh = tokens::new_boot_secret(&NewAttempt {
                namespace: &namespace,
                metal_machine: &name,
                owner,
                cluster_name: mm.labels().get(CLUSTER_NAME_LABEL).map(String::as_str),
                host,
                attempt: 1,
                provider_id: &provider_id,
                user_data: &user_data,
            });
            let written = secrets
                .create(&PostParams::default(), &tokens::next_boot(&fresh))
                .await
                .map_err(write_error(format!("Secret {boot_name}")))?;
            ctx.expectations
                .wrote(boot_key, None, written.resource_version());
            Ok(Acted::default())
        })
        .await,
        Step::BootFromDisk { host } => Box::pin(async {
            // The one-time network boot was consumed; leave the next boot to the disk. Best
            // effort: a BMC that refuses leaves a warning, not an unprovisioned machine.
            next_boot_best_effort(ctx, o, mm, host, BootDevice::Hdd).await?;
            Ok(Acted::default())
        })
        .await,
        Step::DeleteBootSecret => Box::pin(async {
            let current = o.boot_secret.as_ref().and_then(|s| s.resource_version());
            let params = DeleteParams {
                preconditions: current.clone().map(|rv| Preconditions {
                    resource_version: Some(rv),
                    uid: None,
                }),
                ..Default::default()
            };
            match secrets.delete(&boot_name, &params).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(write_error(format!("Secret {boot_name} deletion"))(e)),
            }
            ctx.expectations.wrote(boot_key, current, None);
            Ok(Acted::default())
        })
        .await,
        Step::PowerOff { host, action } => Box::pin(async {
            let target = host_named(o, host)?;
            let bmc = bmc_for(ctx, target).await.map_err(ActError::Fault)?;
            bmc.power(*action)
                .await
                .map_err(|e| ActError::Fault(Fault::from_bmc(&e)))?;
            ctx.power_requests.record(&mm_key, *action);
            Ok(Acted::default())
        })
        .await,
        Step::Release {
            host,
            resource_version,
            fault,
        } => Box::pin(async {
            if fault.is_none() {
                let target = host_named(o, host)?;
                if let Ok(bmc) = bmc_for(ctx, target).await
                    && let Err(e) = bmc
                        .set_boot_once(BootDevice::Hdd, target.spec.boot_mode)
                        .await
                {
                    tracing::warn!(host = %host, error = %e, "could not reset the boot override");
                }
            }
            let failed = fault.as_ref().map(|f| release_fault_message(&name, f));
            let patch = super::claim::release_patch(failed.as_deref());
            let replaced = Some(resource_version.clone());
            let written = patch_from(ctx, mm, &hosts, host, replaced, patch, "release").await?;
            ctx.power_requests.forget(&mm_key);
            if fault.is_some() {
                ctx.events
                    .publish(
                        &written,
                        true,
                        "DeprovisioningFailed",
                        failed.unwrap_or_default(),
                    )
                    .await;
            }
            Ok(Acted::default())
        })
        .await,
    }
}

/// Why a host was released into Error, for its `errorMessage` and the Event: a cleaning that
/// did not happen, or a BMC that could not power it off.
fn release_fault_message(machine: &str, fault: &Fault) -> String {
    match fault.reason {
        "CleaningFailed" | "CleaningTimeout" | "AgentSilent" => format!(
            "released by MetalMachine {machine} although its disks could not be cleaned ({}): {}",
            fault.reason, fault.message
        ),
        _ => format!(
            "released by MetalMachine {machine} while its BMC could not power it off: {}",
            fault.message
        ),
    }
}

/// The Machine's bootstrap data: inline `spec.bootstrap.data`, or the data Secret's `value`.
/// Points the host's next boot at `device`. Best effort: a BMC that refuses leaves a warning
/// Event, and the host's own boot order decides; the machine's progress does not wait on it.
async fn next_boot_best_effort(
    ctx: &MachineContext,
    o: &Observed,
    mm: &MetalMachine,
    host: &str,
    device: BootDevice,
) -> Result<(), ActError> {
    let target = host_named(o, host)?;
    let result = match bmc_for(ctx, target).await {
        Ok(bmc) => bmc
            .set_boot_once(device, target.spec.boot_mode)
            .await
            .map_err(|e| Fault::from_bmc(&e)),
        Err(f) => Err(f),
    };
    if let Err(f) = result {
        let what = match device {
            BootDevice::Hdd => "the disk",
            _ => "the network",
        };
        tracing::warn!(host = %host, reason = f.reason, "could not point the next boot at {what}: {}", f.message);
        let reason = match device {
            BootDevice::Hdd => "BootOverrideNotReset",
            _ => "BootOverrideNotSet",
        };
        ctx.events
            .publish(
                mm,
                true,
                reason,
                format!(
                    "MetalHost {host}: could not point the next boot at {what}: {}",
                    f.message
                ),
            )
            .await;
    }
    Ok(())
}

async fn bootstrap_data(
    ctx: &MachineContext,
    o: &Observed,
    namespace: &str,
) -> Result<Vec<u8>, ActError> {
    let OwnerObservation::Found(machine) = &o.owner else {
        return Err(ActError::Conflict("owner Machine gone".into()));
    };
    if let Some(data) = &machine.spec.bootstrap.data {
        return Ok(data.clone().into_bytes());
    }
    let Some(name) = machine.spec.bootstrap.data_secret_name.as_deref() else {
        return Err(ActError::Conflict("no dataSecretName".into()));
    };
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(|e| {
            ActError::Api(ReconcileError::Read {
                what: format!("bootstrap Secret {name}"),
                source: e,
            })
        })?;
    secret
        .and_then(|s| s.data)
        .and_then(|mut d| d.remove("value"))
        .map(|v| v.0)
        .ok_or_else(|| {
            ActError::Waiting(Fault {
                reason: "WaitingForBootstrapData",
                message: format!("bootstrap Secret {name} not found or has no key `value`"),
            })
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_hosts_error_says_whether_cleaning_or_power_failed() {
        let fault = |reason| Fault {
            reason,
            message: "m".into(),
        };
        for reason in ["CleaningFailed", "CleaningTimeout", "AgentSilent"] {
            let said = release_fault_message("m1", &fault(reason));
            assert!(said.contains("could not be cleaned"), "{said}");
            assert!(said.contains(reason), "{said}");
        }
        let said = release_fault_message("m1", &fault("BmcUnreachable"));
        assert!(said.contains("could not power it off"), "{said}");
    }

    /// Which failed writes the next passes must treat as possibly applied.
    #[test]
    fn a_write_may_have_landed_unless_it_was_refused_or_never_sent() {
        let status = |code| {
            kube::Error::Api(
                kube::core::Status::failure("m", "r")
                    .with_code(code)
                    .boxed(),
            )
        };
        let rows = [
            ("504 Gateway Timeout", status(504), true),
            ("500 Internal Error", status(500), true),
            ("503 Unavailable", status(503), true),
            (
                "connection lost before the answer",
                kube::Error::Service("connection reset".into()),
                true,
            ),
            (
                "answer not JSON",
                kube::Error::SerdeError(serde_json::from_str::<u8>("x").unwrap_err()),
                true,
            ),
            ("409 Conflict (handled on its own)", status(409), false),
            ("422 Invalid", status(422), false),
            (
                "429 Too Many Requests (priority and fairness)",
                status(429),
                false,
            ),
            ("404 Not Found", status(404), false),
            ("never sent", kube::Error::TlsRequired, false),
        ];
        for (what, e, want) in rows {
            assert_eq!(may_have_landed(&e), want, "{what}");
        }
    }

    /// A write to an apiserver nobody listens for was never sent, so nothing waits for it.
    #[tokio::test]
    async fn a_write_without_a_connection_never_landed() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let config = kube::Config::new(url.parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let hosts: Api<MetalHost> = Api::namespaced(client, "ns");
        let e = hosts
            .patch(
                "h",
                &kube::api::PatchParams::default(),
                &Patch::Merge(serde_json::json!({})),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, kube::Error::Service(_)), "{e:?}");
        assert!(!may_have_landed(&e), "{e:?}");
    }
}

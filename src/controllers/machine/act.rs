//! The one write a pass makes, as `decide` chose it. Writes to the Machine and to the objects it
//! references are conditioned on the resourceVersion that was read.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch};
use kube::{Resource, ResourceExt};

use crate::api::{CLUSTER_NAME_LABEL, Machine};
use crate::controllers::refs::ContractObject;
use crate::controllers::{ReconcileError, conditioned, merge_params, refs};

use super::decide::Step;
use super::observe::Observation;
use super::{FIELD_MANAGER, FINALIZER, MachineContext};

/// A merge patch on the Machine, applied only to `version` (the one `decide` saw, or the one the
/// pass's own status write produced); the next decision waits until the store shows the write.
/// Returns the Machine's generation after the write.
pub async fn patch_machine(
    ctx: &MachineContext,
    m: &Machine,
    version: Option<String>,
    patch: serde_json::Value,
    what: &str,
) -> Result<Option<i64>, ReconcileError> {
    let written =
        Api::<Machine>::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default())
            .patch(
                &m.name_any(),
                &merge_params(FIELD_MANAGER),
                &Patch::Merge(&conditioned(patch, version.as_deref())),
            )
            .await
            .map_err(|e| {
                stale_on_conflict(ctx, &e, super::machine_key(m), version.clone());
                ReconcileError::write(format!("Machine {} {what}", m.name_any()))(e)
            })?;
    ctx.expectations
        .wrote(super::machine_key(m), version, written.resource_version());
    Ok(written.metadata.generation)
}

/// A 409 says the version the write was conditioned on is stale: later passes wait until the
/// store shows another one (or ask the apiserver after the TTL) rather than send the same
/// stale write again.
fn stale_on_conflict(ctx: &MachineContext, e: &kube::Error, key: String, version: Option<String>) {
    if matches!(e, kube::Error::Api(s) if s.code == 409) {
        ctx.expectations.conflicted(key, version);
    }
}

/// Adds the Machine's controller owner reference and the cluster-name label to `obj`.
async fn adopt(
    ctx: &MachineContext,
    m: &Machine,
    obj: &ContractObject,
    r: &crate::api::common::ContractVersionedObjectReference,
) -> Result<(), ReconcileError> {
    let Some(owner) = m.controller_owner_ref(&()) else {
        return Ok(());
    };
    let mut owners = obj.metadata.owner_references.clone().unwrap_or_default();
    if !owners.iter().any(|o| o.uid == owner.uid) {
        owners.retain(|o| o.controller != Some(true));
        owners.push(owner);
    }
    let patch = conditioned(
        serde_json::json!({"metadata": {
            "labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name},
            "ownerReferences": owners,
        }}),
        obj.resource_version().as_deref(),
    );
    let namespace = m.namespace().unwrap_or_default();
    let key = crate::controllers::expectations::object_key(&r.kind, &namespace, &obj.name_any());
    let api = refs::api_for::<ContractObject>(&ctx.client, &namespace, r).await?;
    let written = api
        .patch(
            &obj.name_any(),
            &merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(|e| {
            stale_on_conflict(ctx, &e, key.clone(), obj.resource_version());
            ReconcileError::write(format!("owner reference on {} {}", r.kind, obj.name_any()))(e)
        })?;
    // The next pass reads the object from its kind's watch: not before it shows this write.
    ctx.expectations
        .wrote(key, obj.resource_version(), written.resource_version());
    Ok(())
}

/// Returns the Machine's generation after the step when the step wrote the Machine itself.
pub async fn act(
    ctx: &MachineContext,
    o: &Observation,
    step: &Step,
) -> Result<Option<i64>, ReconcileError> {
    let m = o.observed.machine.as_ref();
    match step {
        Step::Nothing => Ok(None),
        Step::PrepareMetadata {
            add_finalizer,
            cluster_owner,
        } => {
            let mut finalizers = m.finalizers().to_vec();
            if *add_finalizer {
                finalizers.push(FINALIZER.into());
            }
            let mut owners = m.owner_references().to_vec();
            owners.extend(cluster_owner.clone());
            patch_machine(
                ctx,
                m,
                m.resource_version(),
                serde_json::json!({"metadata": {
                    "finalizers": finalizers,
                    "labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name},
                    "ownerReferences": owners,
                }}),
                "finalizer and cluster association",
            )
            .await
        }
        Step::AdoptBootstrap => match (&o.bootstrap_object, &m.spec.bootstrap.config_ref) {
            (Some(obj), Some(r)) => adopt(ctx, m, obj, r).await.map(|()| None),
            _ => Ok(None),
        },
        Step::AdoptInfrastructure => match &o.infra_object {
            Some(obj) => adopt(ctx, m, obj, &m.spec.infrastructure_ref)
                .await
                .map(|()| None),
            None => Ok(None),
        },
        Step::CopyDataSecretName(secret) => {
            patch_machine(
                ctx,
                m,
                m.resource_version(),
                serde_json::json!({"spec": {"bootstrap": {"dataSecretName": secret}}}),
                "dataSecretName",
            )
            .await
            // The status decided with this step still says the data is missing: it stays
            // stamped with the generation it was decided from.
            .map(|_| None)
        }
        Step::CopyProviderId(id) => {
            patch_machine(
                ctx,
                m,
                m.resource_version(),
                serde_json::json!({"spec": {"providerID": id}}),
                "providerID",
            )
            .await
        }
        Step::SyncNode { name, patch } => {
            let namespace = m.namespace().unwrap_or_default();
            let (workload, _) = ctx
                .workloads
                .get(&ctx.client, &namespace, &m.spec.cluster_name)
                .await
                .map_err(|(_, message)| ReconcileError::Invalid(message))?;
            Api::<Node>::all(workload)
                .patch(name, &merge_params(FIELD_MANAGER), &Patch::Merge(patch))
                .await
                .map(|_| None)
                .map_err(ReconcileError::write(format!("Node {name}")))
        }
    }
}

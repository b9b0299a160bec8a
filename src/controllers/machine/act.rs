//! The one write a pass makes, as `decide` chose it. Writes to the Machine and to the objects it
//! references are conditioned on the resourceVersion that was read.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject, Patch};
use kube::{Resource, ResourceExt};

use crate::api::{CLUSTER_NAME_LABEL, Machine};
use crate::controllers::{ReconcileError, merge_params, refs};

use super::decide::Step;
use super::observe::Observation;
use super::{FIELD_MANAGER, FINALIZER, MachineContext};

/// A merge patch on the Machine, applied only to the version `decide` saw.
async fn patch_machine(
    ctx: &MachineContext,
    m: &Machine,
    mut patch: serde_json::Value,
    what: &str,
) -> Result<(), ReconcileError> {
    patch["metadata"]["resourceVersion"] = serde_json::json!(m.resource_version());
    Api::<Machine>::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default())
        .patch(
            &m.name_any(),
            &merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
        .map_err(ReconcileError::write(format!(
            "Machine {} {what}",
            m.name_any()
        )))
}

/// Adds the Machine's controller owner reference and the cluster-name label to `obj`.
async fn adopt(
    ctx: &MachineContext,
    m: &Machine,
    obj: &DynamicObject,
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
    let patch = serde_json::json!({"metadata": {
        "labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name},
        "ownerReferences": owners,
        "resourceVersion": obj.resource_version(),
    }});
    let api = refs::api_for(&ctx.client, &m.namespace().unwrap_or_default(), r).await?;
    api.patch(
        &obj.name_any(),
        &merge_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await
    .map(|_| ())
    .map_err(ReconcileError::write(format!(
        "owner reference on {} {}",
        r.kind,
        obj.name_any()
    )))
}

pub async fn act(ctx: &MachineContext, o: &Observation, step: &Step) -> Result<(), ReconcileError> {
    let m = o.observed.machine.as_ref();
    match step {
        Step::Nothing => Ok(()),
        Step::AddFinalizer => {
            let mut finalizers = m.finalizers().to_vec();
            finalizers.push(FINALIZER.into());
            patch_machine(
                ctx,
                m,
                serde_json::json!({"metadata": {"finalizers": finalizers}}),
                "finalizer",
            )
            .await
        }
        Step::AssociateWithCluster { cluster_owner } => {
            let mut owners = m.owner_references().to_vec();
            owners.extend(cluster_owner.clone());
            patch_machine(
                ctx,
                m,
                serde_json::json!({"metadata": {
                    "labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name},
                    "ownerReferences": owners,
                }}),
                "cluster association",
            )
            .await
        }
        Step::AdoptBootstrap => match (&o.bootstrap_object, &m.spec.bootstrap.config_ref) {
            (Some(obj), Some(r)) => adopt(ctx, m, obj, r).await,
            _ => Ok(()),
        },
        Step::AdoptInfrastructure => match &o.infra_object {
            Some(obj) => adopt(ctx, m, obj, &m.spec.infrastructure_ref).await,
            None => Ok(()),
        },
        Step::CopyDataSecretName(secret) => {
            patch_machine(
                ctx,
                m,
                serde_json::json!({"spec": {"bootstrap": {"dataSecretName": secret}}}),
                "dataSecretName",
            )
            .await
        }
        Step::CopyProviderId(id) => {
            patch_machine(
                ctx,
                m,
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
                .map(|_| ())
                .map_err(ReconcileError::write(format!("Node {name}")))
        }
    }
}

//! Resolving v1beta2 contract references (`{apiGroup, kind, name}`) to objects: the version comes
//! from the CRD's `cluster.x-k8s.io/v1beta2` label, as upstream does.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, GroupVersionKind};

use crate::api::common::ContractVersionedObjectReference;

use super::ReconcileError;

/// Plural the way Cluster API's CRD names are computed (lower-cased kind, English plural).
pub fn plural(kind: &str) -> String {
    let lower = kind.to_lowercase();
    if lower.ends_with('s') || lower.ends_with('x') || lower.ends_with("ch") {
        format!("{lower}es")
    } else if let Some(stem) = lower.strip_suffix('y') {
        format!("{stem}ies")
    } else {
        format!("{lower}s")
    }
}

/// The dynamic API for a reference in `namespace`.
pub async fn api_for(
    client: &kube::Client,
    namespace: &str,
    r: &ContractVersionedObjectReference,
) -> Result<Api<DynamicObject>, ReconcileError> {
    let plural = plural(&r.kind);
    let crd_name = format!("{plural}.{}", r.api_group);
    let crd = Api::<CustomResourceDefinition>::all(client.clone())
        .get_opt(&crd_name)
        .await
        .map_err(ReconcileError::read(format!("CRD {crd_name}")))?
        .ok_or_else(|| {
            ReconcileError::Invalid(format!("no CRD {crd_name} for {}/{}", r.api_group, r.kind))
        })?;
    let labels = crd.metadata.labels.unwrap_or_default();
    let version = labels
        .get("cluster.x-k8s.io/v1beta2")
        .or_else(|| labels.get("cluster.x-k8s.io/v1beta1"))
        .and_then(|v| v.split('_').next_back().map(str::to_string))
        .or_else(|| {
            crd.spec
                .versions
                .iter()
                .find(|v| v.storage)
                .map(|v| v.name.clone())
        })
        .ok_or_else(|| {
            ReconcileError::Invalid(format!("CRD {crd_name} names no contract version"))
        })?;
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(&r.api_group, &version, &r.kind),
        &plural,
    );
    Ok(Api::namespaced_with(client.clone(), namespace, &ar))
}

/// `status.initialization.<flag>` (v1beta2) or `status.ready` (v1beta1).
pub fn ready(obj: &DynamicObject, flag: &str) -> bool {
    let status = &obj.data["status"];
    status["initialization"][flag]
        .as_bool()
        .or_else(|| status["ready"].as_bool())
        .unwrap_or(false)
}

/// A terminal failure reported by a referenced object.
pub fn failure(obj: &DynamicObject) -> Option<(String, String)> {
    let status = &obj.data["status"];
    let reason = status["failureReason"].as_str().map(str::to_string);
    let message = status["failureMessage"].as_str().map(str::to_string);
    (reason.is_some() || message.is_some())
        .then(|| (reason.unwrap_or_default(), message.unwrap_or_default()))
}

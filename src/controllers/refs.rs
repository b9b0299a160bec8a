//! Resolving v1beta2 contract references (`{apiGroup, kind, name}`) to objects: the version comes
//! from the CRD's `cluster.x-k8s.io/v1beta2` label, as upstream does.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

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

/// How long a CRD's served contract version is trusted before the CRD is read again (a provider
/// upgrade can change it; reading the CRD on every pass is what this cache avoids).
const GVK_TTL: Duration = Duration::from_secs(300);

type GvkCache = Mutex<HashMap<(String, String), (ApiResource, Instant)>>;

fn gvk_cache() -> &'static GvkCache {
    static CACHE: OnceLock<GvkCache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The API resource (contract version and plural) of a referenced kind, from its CRD.
pub async fn resource_for(
    client: &kube::Client,
    r: &ContractVersionedObjectReference,
) -> Result<ApiResource, ReconcileError> {
    let key = (r.api_group.clone(), r.kind.clone());
    if let Ok(cache) = gvk_cache().lock()
        && let Some((ar, at)) = cache.get(&key)
        && at.elapsed() < GVK_TTL
    {
        return Ok(ar.clone());
    }
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
    if let Ok(mut cache) = gvk_cache().lock() {
        cache.insert(key, (ar.clone(), Instant::now()));
    }
    Ok(ar)
}

/// The dynamic API for a reference in `namespace`.
pub async fn api_for(
    client: &kube::Client,
    namespace: &str,
    r: &ContractVersionedObjectReference,
) -> Result<Api<DynamicObject>, ReconcileError> {
    let ar = resource_for(client, r).await?;
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

/// What the Machine controller keeps of a referenced object it watches: metadata (owners,
/// labels, deletion) and the contract fields (`status`, `spec.providerID`,
/// `spec.failureDomain`). A bootstrap config's spec (files, users, commands) as a JSON tree was
/// the largest part of that store: 9.6 KB per CloudInitConfig at N=1,000 (heaptrack), against
/// 4 KB for the same object typed.
pub fn keep_contract_fields(obj: &mut DynamicObject) {
    if let Some(annotations) = obj.metadata.annotations.as_mut() {
        annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    let mut kept = serde_json::Map::new();
    if let serde_json::Value::Object(data) = &mut obj.data {
        if let Some(status) = data.remove("status") {
            kept.insert("status".into(), status);
        }
        if let Some(serde_json::Value::Object(spec)) = data.get_mut("spec") {
            let contract: serde_json::Map<_, _> = ["providerID", "failureDomain"]
                .into_iter()
                .filter_map(|field| spec.remove(field).map(|v| (field.to_string(), v)))
                .collect();
            if !contract.is_empty() {
                kept.insert("spec".into(), contract.into());
            }
        }
    }
    obj.data = kept.into();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watched_reference_keeps_what_the_contract_reads_and_drops_the_rest() {
        let mut obj: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2",
            "kind": "CloudInitConfig",
            "metadata": {
                "name": "c1", "namespace": "ns", "resourceVersion": "7",
                "labels": {"cluster.x-k8s.io/cluster-name": "c"},
                "annotations": {
                    "kubectl.kubernetes.io/last-applied-configuration": "{\"spec\":{}}",
                    "note": "kept"
                },
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                    "name": "m1", "uid": "u1", "controller": true}]
            },
            "spec": {"files": [{"path": "/etc/x", "content": "x".repeat(4096)}],
                     "providerID": "metalboot://ns/h/u", "failureDomain": "rack-a"},
            "status": {"initialization": {"dataSecretCreated": true}, "dataSecretName": "c1",
                       "failureReason": "R", "failureMessage": "M",
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}
        }))
        .expect("object");
        let before = (ready(&obj, "dataSecretCreated"), failure(&obj));
        keep_contract_fields(&mut obj);
        assert_eq!((ready(&obj, "dataSecretCreated"), failure(&obj)), before);
        assert_eq!(obj.data["status"]["dataSecretName"], "c1");
        assert_eq!(obj.data["status"]["addresses"][0]["address"], "10.0.0.1");
        assert_eq!(obj.data["spec"]["providerID"], "metalboot://ns/h/u");
        assert_eq!(obj.data["spec"]["failureDomain"], "rack-a");
        assert!(obj.data["spec"].get("files").is_none(), "{:?}", obj.data);
        let annotations = obj.metadata.annotations.clone().unwrap_or_default();
        assert!(!annotations.contains_key("kubectl.kubernetes.io/last-applied-configuration"));
        assert_eq!(annotations.get("note").map(String::as_str), Some("kept"));
        assert_eq!(obj.metadata.owner_references.map(|o| o.len()), Some(1));
        assert_eq!(obj.metadata.resource_version.as_deref(), Some("7"));

        // A spec without contract fields leaves none; an object without status has none.
        let mut bare: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "x/v1", "kind": "K", "metadata": {"name": "b"},
            "spec": {"big": [1, 2, 3]}
        }))
        .expect("object");
        keep_contract_fields(&mut bare);
        assert_eq!(bare.data, serde_json::json!({}));
        assert!(!ready(&bare, "provisioned"));
    }
}

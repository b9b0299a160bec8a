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

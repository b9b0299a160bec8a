//! Resolving v1beta2 contract references (`{apiGroup, kind, name}`) to objects: the version comes
//! from the CRD's `cluster.x-k8s.io/v1beta2` label, as upstream does.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use std::borrow::Cow;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use kube::api::{Api, DynamicObject};
use kube::core::{ApiResource, DynamicResourceScope, GroupVersionKind};

use crate::api::common::{ContractVersionedObjectReference, MachineAddress};
use crate::api::{CloudInitConfig, MetalMachine};

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

/// The API for a reference in `namespace`: a [`ContractObject`] for a Machine's references, a
/// `DynamicObject` to read an infrastructure cluster's other fields.
pub async fn api_for<K: Resource<DynamicType = ApiResource, Scope = DynamicResourceScope>>(
    client: &kube::Client,
    namespace: &str,
    r: &ContractVersionedObjectReference,
) -> Result<Api<K>, ReconcileError> {
    let ar = resource_for(client, r).await?;
    Ok(Api::namespaced_with(client.clone(), namespace, &ar))
}

/// A referenced bootstrap config or infrastructure machine (any provider's kind), as the Machine
/// and Cluster controllers read it: its metadata and the contract fields, decoded from the
/// object's JSON with everything else skipped.
///
/// It replaces a `DynamicObject`, whose JSON tree spends a B-tree node (about 600 bytes) on
/// every nested map however small: a CloudInitConfig watched that way took 4.0 KB per object
/// in the Machine controller's store with its spec already dropped, 1.3 KB of it metadata. A
/// field of the wrong type reads as absent (as the JSON lookups it replaces did), so one
/// provider's odd object never breaks its kind's watch.
#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq)]
pub struct ContractObject {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, deserialize_with = "lenient")]
    pub spec: ContractSpec,
    #[serde(default, deserialize_with = "lenient")]
    pub status: ContractStatus,
}

#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContractSpec {
    #[serde(rename = "providerID", default, deserialize_with = "lenient")]
    pub provider_id: Option<String>,
}

#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ContractStatus {
    /// v1beta2: `provisioned` (infrastructure) or `dataSecretCreated` (bootstrap).
    #[serde(default, deserialize_with = "lenient")]
    pub initialization: Initialization,
    /// v1beta1.
    #[serde(default, deserialize_with = "lenient")]
    pub ready: Option<bool>,
    #[serde(default, deserialize_with = "lenient")]
    pub failure_reason: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub failure_message: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub data_secret_name: Option<String>,
    #[serde(default, deserialize_with = "lenient")]
    pub addresses: Vec<MachineAddress>,
    /// Of the conditions, only the Ready condition's message is kept: what the Machine shows
    /// while it waits.
    #[serde(default, rename = "conditions", deserialize_with = "ready_message")]
    pub ready_message: Option<String>,
}

#[derive(Clone, Debug, Default, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Initialization {
    #[serde(default, deserialize_with = "lenient")]
    pub provisioned: Option<bool>,
    #[serde(default, deserialize_with = "lenient")]
    pub data_secret_created: Option<bool>,
}

/// A value of the wrong shape reads as the default.
fn lenient<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de> + Default,
{
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Either<T> {
        Good(T),
        Bad(serde::de::IgnoredAny),
    }
    Ok(match <Either<T> as serde::Deserialize>::deserialize(d)? {
        Either::Good(t) => t,
        Either::Bad(_) => T::default(),
    })
}

/// The message of the condition of type Ready, if any; other conditions are skipped.
fn ready_message<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(serde::Deserialize)]
    struct Condition {
        #[serde(rename = "type", default, deserialize_with = "lenient")]
        type_: String,
        #[serde(default, deserialize_with = "lenient")]
        message: Option<String>,
    }
    /// Each entry on its own: one that is not an object does not hide the others.
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Entry {
        Condition(Condition),
        Other(serde::de::IgnoredAny),
    }
    let entries: Vec<Entry> = lenient(d)?;
    Ok(entries
        .into_iter()
        .find_map(|e| match e {
            Entry::Condition(c) if c.type_ == "Ready" => Some(c.message),
            _ => None,
        })
        .flatten())
}

impl Resource for ContractObject {
    type DynamicType = ApiResource;
    type Scope = DynamicResourceScope;

    fn group(dt: &ApiResource) -> Cow<'_, str> {
        dt.group.as_str().into()
    }
    fn version(dt: &ApiResource) -> Cow<'_, str> {
        dt.version.as_str().into()
    }
    fn kind(dt: &ApiResource) -> Cow<'_, str> {
        dt.kind.as_str().into()
    }
    fn api_version(dt: &ApiResource) -> Cow<'_, str> {
        dt.api_version.as_str().into()
    }
    fn plural(dt: &ApiResource) -> Cow<'_, str> {
        dt.plural.as_str().into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl ContractStatus {
    /// `status.initialization.<flag>` (v1beta2) or `status.ready` (v1beta1).
    pub fn ready(&self, flag: InitializationFlag) -> bool {
        let initialized = match flag {
            InitializationFlag::Provisioned => self.initialization.provisioned,
            InitializationFlag::DataSecretCreated => self.initialization.data_secret_created,
        };
        initialized.or(self.ready).unwrap_or(false)
    }
}

/// Whether an infrastructure cluster, read whole, says it is provisioned.
pub fn provisioned(obj: &DynamicObject) -> bool {
    <ContractStatus as serde::Deserialize>::deserialize(&obj.data["status"])
        .is_ok_and(|status| status.ready(InitializationFlag::Provisioned))
}

impl ContractObject {
    /// `status.initialization.<flag>` (v1beta2) or `status.ready` (v1beta1).
    pub fn ready(&self, flag: InitializationFlag) -> bool {
        self.status.ready(flag)
    }

    /// A terminal failure reported by the object.
    pub fn failure(&self) -> Option<(String, String)> {
        let (reason, message) = (&self.status.failure_reason, &self.status.failure_message);
        (reason.is_some() || message.is_some()).then(|| {
            (
                reason.clone().unwrap_or_default(),
                message.clone().unwrap_or_default(),
            )
        })
    }

    /// The contract view of one of our own MetalMachines, from the typed store (no JSON).
    pub fn of_metal_machine(mm: &MetalMachine) -> Self {
        // Called on every Machine pass: only the fields kept are cloned, not the whole status.
        let status = mm.status.as_ref();
        ContractObject {
            metadata: contract_metadata(&mm.metadata),
            spec: ContractSpec {
                provider_id: mm.spec.provider_id.clone(),
            },
            status: ContractStatus {
                initialization: Initialization {
                    provisioned: status
                        .and_then(|s| s.initialization.as_ref())
                        .and_then(|i| i.provisioned),
                    data_secret_created: None,
                },
                ready: Some(status.is_some_and(|s| s.ready)),
                failure_reason: status.and_then(|s| s.failure_reason.clone()),
                failure_message: status.and_then(|s| s.failure_message.clone()),
                data_secret_name: None,
                addresses: status.map(|s| s.addresses.clone()).unwrap_or_default(),
                ready_message: status.and_then(|s| ready_message_of(&s.conditions)),
            },
        }
    }

    /// The contract view of one of our own CloudInitConfigs, from the bootstrap controller's
    /// typed store (no watch of its own, no JSON).
    pub fn of_cloud_init_config(cfg: &CloudInitConfig) -> Self {
        let status = cfg.status.as_ref();
        ContractObject {
            metadata: contract_metadata(&cfg.metadata),
            spec: ContractSpec::default(),
            status: ContractStatus {
                initialization: Initialization {
                    provisioned: None,
                    data_secret_created: status
                        .and_then(|s| s.initialization.as_ref())
                        .and_then(|i| i.data_secret_created),
                },
                ready: status.map(|s| s.ready),
                failure_reason: status.and_then(|s| s.failure_reason.clone()),
                failure_message: status.and_then(|s| s.failure_message.clone()),
                data_secret_name: status.and_then(|s| s.data_secret_name.clone()),
                addresses: Vec::new(),
                ready_message: status.and_then(|s| ready_message_of(&s.conditions)),
            },
        }
    }
}

/// The metadata of one of our own objects as a `ContractObject` keeps it (see
/// [`keep_contract_fields`]).
fn contract_metadata(meta: &ObjectMeta) -> ObjectMeta {
    let mut metadata = meta.clone();
    metadata.annotations = None;
    metadata.managed_fields = None;
    metadata
}

/// The Ready condition's message, as [`ContractStatus::ready_message`] keeps it.
fn ready_message_of(conditions: &[crate::api::common::Condition]) -> Option<String> {
    conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone())
}

/// Which v1beta2 initialization flag says a referenced object is ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitializationFlag {
    /// An infrastructure machine or cluster: `status.initialization.provisioned`.
    Provisioned,
    /// A bootstrap config: `status.initialization.dataSecretCreated`.
    DataSecretCreated,
}

/// What the Machine controller keeps of a referenced object it watches: no annotation of it is
/// read (a MetalMachine's addresses annotation, a client's last-applied configuration).
pub fn keep_contract_fields(obj: &mut ContractObject) {
    obj.metadata.annotations = None;
}

#[cfg(test)]
mod tests {
    use super::*;
    use InitializationFlag::{DataSecretCreated, Provisioned};

    fn read(json: serde_json::Value) -> ContractObject {
        serde_json::from_value(json).expect("a contract object")
    }

    #[test]
    fn a_referenced_object_reads_as_its_contract_fields() {
        let mut obj = read(serde_json::json!({
            "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2",
            "kind": "CloudInitConfig",
            "metadata": {
                "name": "c1", "namespace": "ns", "resourceVersion": "7",
                "labels": {"cluster.x-k8s.io/cluster-name": "c"},
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                    "name": "m1", "uid": "u1", "controller": true}]
            },
            "spec": {"files": [{"path": "/etc/x", "content": "x".repeat(4096)}],
                     "providerID": "metalboot://ns/h/u", "failureDomain": "rack-a"},
            "status": {"initialization": {"dataSecretCreated": true}, "dataSecretName": "c1",
                       "failureReason": "R", "failureMessage": "M", "observedGeneration": 3,
                       "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                       "conditions": [
                           {"type": "DataSecretAvailable", "status": "True", "reason": "Ok"},
                           {"type": "Ready", "status": "False", "reason": "W", "message": "wait"}]}
        }));
        assert!(obj.ready(DataSecretCreated));
        assert!(!obj.ready(Provisioned), "another kind's flag");
        assert_eq!(obj.failure(), Some(("R".into(), "M".into())));
        assert_eq!(obj.status.data_secret_name.as_deref(), Some("c1"));
        assert_eq!(obj.status.addresses[0].address, "10.0.0.1");
        assert_eq!(obj.spec.provider_id.as_deref(), Some("metalboot://ns/h/u"));
        assert_eq!(obj.status.ready_message.as_deref(), Some("wait"));
        assert_eq!(
            obj.metadata.owner_references.as_ref().map(Vec::len),
            Some(1)
        );
        assert_eq!(obj.metadata.resource_version.as_deref(), Some("7"));
        keep_contract_fields(&mut obj);
        assert_eq!(obj.metadata.annotations, None);

        // v1beta1: `status.ready`; no status, no spec: nothing ready, no failure.
        assert!(read(serde_json::json!({"status": {"ready": true}})).ready(Provisioned));
        let bare = read(serde_json::json!({"metadata": {"name": "b"}, "spec": {"big": [1]}}));
        assert!(!bare.ready(Provisioned));
        assert_eq!(bare.failure(), None);
    }

    /// Whatever shape a provider's object has, it decodes: a field of the wrong type reads as
    /// absent, and the watch of its kind goes on.
    #[test]
    fn a_field_of_the_wrong_shape_reads_as_absent() {
        let odd = read(serde_json::json!({
            "metadata": {"name": "odd"},
            "spec": {"providerID": 7, "failureDomain": ["a"]},
            "status": {"initialization": "yes", "ready": "true", "failureReason": {"x": 1},
                       "addresses": [{"type": "Nowhere", "address": 1}],
                       "conditions": [{"type": "Ready", "message": 5}, "junk"]}
        }));
        assert_eq!(odd.spec, ContractSpec::default());
        assert_eq!(odd.status, ContractStatus::default());
        let not_objects = read(serde_json::json!({"spec": "x", "status": [1, 2]}));
        assert_eq!(not_objects, ContractObject::default());
        // Bad conditions do not hide the Ready condition's message.
        let conditions = read(serde_json::json!({"status": {"conditions": [
            {"type": ["Other"]}, "junk", null,
            {"type": "Ready", "message": "waiting for the host"}]}}));
        assert_eq!(
            conditions.status.ready_message.as_deref(),
            Some("waiting for the host")
        );
    }
}

//! Types shared by several CRDs, shaped like their Cluster API counterparts so the upstream
//! Machine controller and clusterctl read them without conversion.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use compact_str::CompactString;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// `metav1.Condition`, with its type, status and reason held inline: they are short names (a
/// reason is CamelCase, at most 1,024 characters by the API, in practice under 24), and each
/// stored host's objects carry many conditions. k8s-openapi's type gives each of the three a
/// heap allocation of its own. Same JSON, same schema ([`conditions_schema`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    #[serde(rename = "type", default)]
    pub type_: CompactString,
    #[serde(default)]
    pub status: CompactString,
    #[serde(default)]
    pub reason: CompactString,
    #[serde(default)]
    pub message: String,
    pub last_transition_time: Time,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// One address of a machine, as Cluster API defines `MachineAddress`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
pub struct MachineAddress {
    /// Address type: Hostname, ExternalIP, InternalIP, ExternalDNS or InternalDNS.
    #[serde(rename = "type")]
    pub type_: MachineAddressType,
    /// The address (an IP literal or a DNS name, by type).
    #[schemars(length(min = 1, max = 256))]
    pub address: String,
}

/// The address types Cluster API accepts.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema,
)]
pub enum MachineAddressType {
    Hostname,
    ExternalIP,
    InternalIP,
    ExternalDNS,
    InternalDNS,
}

/// Where clients reach the workload cluster's apiserver.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiEndpoint {
    /// Hostname or IP address of the endpoint.
    #[serde(default)]
    #[schemars(length(max = 512))]
    pub host: String,
    /// TCP port of the endpoint.
    #[serde(default)]
    #[schemars(range(min = 0, max = 65535))]
    pub port: i32,
}

impl ApiEndpoint {
    pub fn is_set(&self) -> bool {
        !self.host.is_empty() && self.port != 0
    }
}

/// A v1beta2 contract reference: group and kind without version (the version is read from the
/// CRD's contract label).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContractVersionedObjectReference {
    /// API group of the referenced object, e.g. `infrastructure.cluster.x-k8s.io`.
    #[serde(default)]
    #[schemars(length(max = 253))]
    pub api_group: String,
    /// Kind of the referenced object.
    #[serde(default)]
    #[schemars(length(max = 63))]
    pub kind: String,
    /// Name of the referenced object, in the referrer's namespace.
    #[serde(default)]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// A failure domain a cluster may place machines in.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailureDomain {
    /// Name of the failure domain (the host label value).
    pub name: String,
    /// Whether control-plane machines may be placed here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane: Option<bool>,
    /// Free-form attributes of the failure domain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<BTreeMap<String, String>>,
}

/// Labels and annotations a template stamps onto the objects made from it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateObjectMeta {
    /// Labels copied onto objects created from the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Annotations copied onto objects created from the template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// A reference to a key in a Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyReference {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Key within the Secret's data.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Schema of a `conditions` list: a map keyed by `type`, as `metav1.Condition` lists are.
pub fn conditions_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as Wire;
    let mut schema = generator.subschema_for::<Vec<Wire>>();
    schema.insert("x-kubernetes-list-type".into(), "map".into());
    schema.insert(
        "x-kubernetes-list-map-keys".into(),
        serde_json::json!(["type"]),
    );
    schema.insert(
        "description".into(),
        "Conditions in metav1.Condition form, one per type; `Ready` summarises the others.".into(),
    );
    schema
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition as Wire;

    /// What the apiserver sends reads into [`Condition`] and is written back as k8s-openapi's
    /// `metav1.Condition` would write it; its names are held inline, its message on the heap.
    #[test]
    fn a_condition_reads_and_writes_as_metav1_does_and_keeps_its_names_inline() {
        let sent = serde_json::json!({
            "type": "BootstrapConfigReady",
            "status": "False",
            "reason": "WaitingForBootstrapData",
            "message": "the CloudInitConfig has no data Secret yet",
            "lastTransitionTime": "2026-12-07T14:00:00Z",
            "observedGeneration": 3,
        });
        let ours: Condition = serde_json::from_value(sent.clone()).expect("reads");
        let wire: Wire = serde_json::from_value(sent.clone()).expect("reads");
        assert_eq!(serde_json::to_value(&ours).expect("writes"), sent);
        assert_eq!(serde_json::to_value(&wire).expect("writes"), sent);
        for name in [&ours.type_, &ours.status, &ours.reason] {
            assert!(!name.is_heap_allocated(), "{name} is on the heap");
        }
        // Without an observed generation, neither writes one.
        let mut sent = sent;
        sent.as_object_mut().map(|o| o.remove("observedGeneration"));
        let ours: Condition = serde_json::from_value(sent.clone()).expect("reads");
        assert_eq!(serde_json::to_value(&ours).expect("writes"), sent);
        // A condition without its time is refused by both, as the API requires one.
        let mut untimed = sent;
        untimed
            .as_object_mut()
            .map(|o| o.remove("lastTransitionTime"));
        assert!(serde_json::from_value::<Condition>(untimed.clone()).is_err());
        assert!(serde_json::from_value::<Wire>(untimed).is_err());
    }
}

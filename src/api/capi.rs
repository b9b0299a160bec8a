//! Cluster API core `Cluster` and `Machine` (`cluster.x-k8s.io/v1beta2`), read tolerantly: the
//! fields metalboot uses are typed, everything else is kept in `extra` so an upstream object
//! round-trips unchanged and an upstream field we do not model never fails a watch. The
//! manager's Machine store drops `extra` ([`Machine::forget_unmodeled`]): its copies do not
//! round-trip and are never written back whole. The CRDs
//! generated from these types are for standalone mode only (no upstream Cluster API installed);
//! they keep unknown fields too.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::NodeSystemInfo;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::common::{
    ApiEndpoint, Condition, ContractVersionedObjectReference, FailureDomain, MachineAddress,
    conditions_schema,
};

/// Cluster spec (the parts metalboot reads).
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema,
)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Cluster",
    namespaced,
    status = "ClusterStatus",
    shortname = "cl",
    category = "cluster-api",
    doc = "Cluster is the Cluster API cluster (standalone-mode CRD installed by metalboot when upstream Cluster API is absent).",
    label("cluster.x-k8s.io/provider", "metalboot-standalone"),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Cluster phase"
    ),
    printcolumn(
        name = "Paused",
        type_ = "boolean",
        json_path = ".spec.paused",
        priority = 1,
        description = "Reconciliation paused"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// Pause reconciliation of this cluster and its objects.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused: Option<bool>,
    /// Endpoint of the workload cluster's apiserver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// The infrastructure cluster (e.g. a MetalCluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ref: Option<ContractVersionedObjectReference>,
    /// The control-plane provider's object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_ref: Option<ContractVersionedObjectReference>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// Cluster status (the parts metalboot reads or, in standalone mode, writes).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatus {
    /// v1beta2 initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<ClusterStatusInitialization>,
    /// v1beta1-style readiness of the infrastructure cluster (kept for older readers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ready: Option<bool>,
    /// Failure domains copied from the infrastructure cluster.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_domains: Vec<FailureDomain>,
    /// Cluster phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// v1beta2 cluster initialization flags.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterStatusInitialization {
    /// The infrastructure cluster reported provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_provisioned: Option<bool>,
    /// The control plane reported initialized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_initialized: Option<bool>,
}

impl Cluster {
    /// The infrastructure is provisioned, by the v1beta2 field or the v1beta1 one.
    pub fn infrastructure_provisioned(&self) -> bool {
        self.status.as_ref().is_some_and(|s| {
            s.initialization
                .as_ref()
                .and_then(|i| i.infrastructure_provisioned)
                .or(s.infrastructure_ready)
                .unwrap_or(false)
        })
    }

    pub fn paused(&self) -> bool {
        self.spec.paused.unwrap_or(false)
    }
}

impl Machine {
    /// Drops every field kept only for a round trip (the `extra` maps), for the manager's store.
    /// An upstream Machine's status carries its v1beta1 conditions again under `deprecated`, and
    /// as `serde_json::Value` trees they are kilobytes per Machine that no reader of the store
    /// looks at. So a store copy must never be written back whole; nothing does (status is
    /// applied by its own field manager, spec and metadata changes are patches).
    pub fn forget_unmodeled(&mut self) {
        self.spec.extra = BTreeMap::new();
        self.spec.bootstrap.extra = BTreeMap::new();
        if let Some(deletion) = self.spec.deletion.as_mut() {
            deletion.extra = BTreeMap::new();
        }
        if let Some(status) = self.status.as_mut() {
            status.extra = BTreeMap::new();
            if let Some(node) = status.node_ref.as_mut() {
                node.extra = BTreeMap::new();
            }
        }
    }
}

/// Machine spec (the parts metalboot reads or writes).
#[derive(
    CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema,
)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    shortname = "ma",
    category = "cluster-api",
    doc = "Machine is the Cluster API machine (standalone-mode CRD installed by metalboot when upstream Cluster API is absent).",
    label("cluster.x-k8s.io/provider", "metalboot-standalone"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".spec.clusterName",
        description = "Cluster"
    ),
    printcolumn(
        name = "Node",
        type_ = "string",
        json_path = ".status.nodeRef.name",
        description = "Node"
    ),
    printcolumn(
        name = "ProviderID",
        type_ = "string",
        json_path = ".spec.providerID",
        description = "Provider ID"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Machine phase"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    printcolumn(
        name = "Version",
        type_ = "string",
        json_path = ".spec.version",
        description = "Kubernetes version"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// Name of the Cluster this machine belongs to.
    #[serde(default)]
    pub cluster_name: String,
    /// Bootstrap configuration reference or ready data.
    #[serde(default)]
    pub bootstrap: MachineBootstrap,
    /// The infrastructure machine (e.g. a MetalMachine).
    #[serde(default)]
    pub infrastructure_ref: ContractVersionedObjectReference,
    /// Kubernetes version of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Provider ID copied from the infrastructure machine.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    pub provider_id: Option<String>,
    /// Failure domain requested for (or, once copied, reported by) the infrastructure machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// Deletion timeouts.
    // Boxed: rarely set, and inline it took each stored Machine a size class up (`api::tests`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<Box<MachineDeletionSpec>>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// How the machine gets its bootstrap data.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineBootstrap {
    /// The bootstrap provider's config object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_ref: Option<ContractVersionedObjectReference>,
    /// Secret holding the bootstrap data (set by a user, or copied from the config's status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
    /// Inline bootstrap data (seeds 000/003): when set, the machine is ready for bootstrapping and
    /// no bootstrap config is consulted. Honoured in standalone mode; upstream v1beta2 has no
    /// such field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// Deletion timeouts of a machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineDeletionSpec {
    /// Seconds to spend draining the node; unset or 0 waits forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_drain_timeout_seconds: Option<i32>,
    /// Seconds to wait for volumes to detach.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_volume_detach_timeout_seconds: Option<i32>,
    /// Seconds to keep trying to delete the Node; default 10.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_deletion_timeout_seconds: Option<i32>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// Machine status.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// The Node of this machine in the workload cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_ref: Option<MachineNodeReference>,
    /// System information of the Node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_info: Option<NodeSystemInfo>,
    /// Last time the phase changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_updated: Option<Time>,
    /// Phase: Pending, Provisioning, Provisioned, Running, Deleting, Deleted, Failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Seed contract: the bootstrap config is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_ready: Option<bool>,
    /// Seed contract: the infrastructure machine is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_ready: Option<bool>,
    /// v1beta2 initialization flags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<MachineStatusInitialization>,
    /// Addresses copied from the infrastructure machine.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    /// Terminal failure copied from a referenced object (seed contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal failure message copied from a referenced object (seed contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Generation last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Progress of deletion (v1beta2): when draining the Node began.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<MachineStatusDeletion>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

/// v1beta2 deletion progress: the start of the drain bounds it by `nodeDrainTimeoutSeconds`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatusDeletion {
    /// When draining the Node started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_drain_start_time: Option<Time>,
    /// When waiting for volumes to detach started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_for_node_volume_detach_start_time: Option<Time>,
}

/// v1beta2 machine initialization flags.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatusInitialization {
    /// The bootstrap data Secret exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_data_secret_created: Option<bool>,
    /// The infrastructure machine reported provisioned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub infrastructure_provisioned: Option<bool>,
}

/// v1beta2 node reference: the Node's name (Nodes are cluster-scoped).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineNodeReference {
    /// Name of the Node.
    pub name: String,
    /// Upstream fields metalboot does not model, kept as they are.
    #[serde(flatten)]
    #[schemars(skip)]
    pub extra: BTreeMap<String, Value>,
}

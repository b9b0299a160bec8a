//! `ExistingControlPlane`: a workload cluster's control plane that Cluster API does not manage
//! (made by kubeadm by hand, run by another team, the lab's own apiserver). It follows the
//! v1beta2 control-plane contract as an externally managed control plane, so that upstream core
//! and the kubeadm bootstrap provider can join metalboot's bare-metal workers to it
//! (`clusterctl generate cluster --flavor kubeadm-workers`).

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{ApiEndpoint, Condition, conditions_schema};

/// Where the existing control plane is reached.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "controlplane.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "ExistingControlPlane",
    namespaced,
    status = "ExistingControlPlaneStatus",
    shortname = "ecp",
    category = "cluster-api",
    category = "metalboot",
    doc = "ExistingControlPlane is a control plane that Cluster API does not manage; metalboot reports it initialized once the cluster's <cluster>-ca and <cluster>-kubeconfig Secrets exist, so that workers can join it.",
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels.cluster\\.x-k8s\\.io/cluster-name",
        description = "Cluster"
    ),
    printcolumn(
        name = "Initialized",
        type_ = "boolean",
        json_path = ".status.initialization.controlPlaneInitialized",
        description = "Workers may join"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".spec.controlPlaneEndpoint.host",
        description = "Control-plane endpoint host"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct ExistingControlPlaneSpec {
    /// Where joining nodes reach the apiserver (what `kubeadm join` dials). Port 1–65535.
    #[x_kube(validation = Rule::new("self.host != '' && self.port >= 1 && self.port <= 65535").message("spec.controlPlaneEndpoint needs a host and a port between 1 and 65535"))]
    pub control_plane_endpoint: ApiEndpoint,
}

/// What metalboot observed of the existing control plane.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExistingControlPlaneStatus {
    /// v1beta2 contract: the control plane can accept joins; never goes back to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<ControlPlaneInitialization>,
    /// Contract: no control-plane Machines exist, so core drains and deletes workers' Nodes
    /// without looking for control-plane members.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_managed_control_plane: Option<bool>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// v1beta2 initialization flags of a control plane.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ControlPlaneInitialization {
    /// The control plane accepts joins (its CA and kubeconfig Secrets exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_initialized: Option<bool>,
}

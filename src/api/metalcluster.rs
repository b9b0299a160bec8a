//! `MetalCluster`: the infrastructure cluster of the contract. Bare metal has no cloud load
//! balancer, so it carries the operator's control-plane endpoint and the failure domains found on
//! host labels.

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{ApiEndpoint, Condition, FailureDomain, TemplateObjectMeta, conditions_schema};
use super::metalmachine::TemplateStatus;

/// Desired state of a MetalCluster.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MetalCluster",
    namespaced,
    status = "MetalClusterStatus",
    shortname = "mc",
    shortname = "mcluster",
    category = "cluster-api",
    category = "metalboot",
    doc = "MetalCluster is the Cluster API infrastructure cluster for bare-metal hosts managed by metalboot.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels.cluster\\.x-k8s\\.io/cluster-name",
        description = "Cluster"
    ),
    printcolumn(
        name = "Ready",
        type_ = "boolean",
        json_path = ".status.ready",
        description = "Infrastructure ready"
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
pub struct MetalClusterSpec {
    /// Where the workload cluster's apiserver is reached (a VIP, DNS name or load balancer the
    /// operator runs). Port 1–65535.
    #[serde(default)]
    #[x_kube(validation = Rule::new("(self.host == '' && self.port == 0) || (self.host != '' && self.port >= 1 && self.port <= 65535)").message("spec.controlPlaneEndpoint needs both host and a port between 1 and 65535"))]
    pub control_plane_endpoint: ApiEndpoint,
    /// Label on MetalHosts whose values name failure domains. Defaults to
    /// `metalboot.io/failure-domain`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub failure_domain_label: Option<String>,
}

/// Observed state of a MetalCluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalClusterStatus {
    /// v1beta1 contract: infrastructure is ready.
    #[serde(default)]
    pub ready: bool,
    /// v1beta2 contract: initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<ClusterInitialization>,
    /// Failure domains: the distinct values of the failure-domain label on hosts in the namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failure_domains: Vec<FailureDomain>,
    /// Terminal failure, machine-readable (v1beta1 contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal failure, for people (v1beta1 contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// v1beta2 initialization flags of an infrastructure cluster.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClusterInitialization {
    /// Infrastructure is provisioned; never goes back to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

/// Template for MetalClusters (ClusterClass).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MetalClusterTemplate",
    namespaced,
    status = "TemplateStatus",
    shortname = "mct",
    category = "cluster-api",
    category = "metalboot",
    doc = "MetalClusterTemplate is a template from which MetalClusters are created.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MetalClusterTemplateSpec {
    /// The MetalCluster to stamp out.
    pub template: MetalClusterTemplateResource,
}

/// The object a MetalClusterTemplate describes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalClusterTemplateResource {
    /// Labels and annotations for the created MetalClusters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created MetalClusters.
    pub spec: MetalClusterSpec,
}

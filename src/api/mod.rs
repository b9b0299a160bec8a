//! The API: CRD types and the CRD documents generated from them.
//!
//! `infrastructure.cluster.x-k8s.io/v1alpha1` (MetalHost, MetalMachine[Template],
//! MetalCluster[Template]) and `bootstrap.cluster.x-k8s.io/v1alpha1` (CloudInitConfig[Template])
//! serve both the v1beta1 and v1beta2 Cluster API contracts; `controlplane.cluster.x-k8s.io/v1alpha1`
//! ExistingControlPlane serves the v1beta2 control-plane contract. `cluster.x-k8s.io/v1beta2` Cluster
//! and Machine are read tolerantly and get CRDs only for standalone mode.

// `printcolumn(name = .., type_ = ..)` repeats keys across columns, which this lint misreads as
// duplicated attributes.
#![allow(clippy::duplicated_attributes)]

pub mod capi;
pub mod cloudinitconfig;
pub mod common;
pub mod crdgen;
pub mod existingcontrolplane;
pub mod metalcluster;
pub mod metalhost;
pub mod metalmachine;

pub use capi::{Cluster, Machine};
pub use cloudinitconfig::{CloudInitConfig, CloudInitConfigTemplate};
pub use existingcontrolplane::ExistingControlPlane;
pub use metalcluster::{MetalCluster, MetalClusterTemplate};
pub use metalhost::MetalHost;
pub use metalmachine::{MetalMachine, MetalMachineTemplate};

/// Label that ties objects to their Cluster.
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";
/// Annotation that pauses reconciliation of one object (Cluster API convention).
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";
/// Annotation that pauses metalboot's reconciliation of one MetalHost.
pub const HOST_PAUSED_ANNOTATION: &str = "metalboot.io/paused";
/// Default MetalHost label whose value names the host's failure domain.
pub const DEFAULT_FAILURE_DOMAIN_LABEL: &str = "metalboot.io/failure-domain";
/// Label clusterctl and users put on objects to select which manager watches them.
pub const WATCH_FILTER_LABEL: &str = "cluster.x-k8s.io/watch-filter";

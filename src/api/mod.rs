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

#[cfg(test)]
mod tests {
    /// Each stored object's fixed part is one allocation (the store's `Arc`), which jemalloc
    /// rounds up to its next size class (… 640, 768, 896, 1,024, 1,280, 1,536 …), so a few bytes
    /// over a class boundary cost a whole step, once per host. Optional parts that are often
    /// unset (root device hints, an image in live mode, hardware requirements, a host selector, a
    /// Machine's deletion options) are boxed to keep these two under a boundary: at 10,000
    /// hosts, 256 bytes per object is 2.5 MB of the manager's heap. (A set part costs its own
    /// small allocation: a selector's 48 bytes.)
    #[test]
    fn a_stored_machine_and_metal_machine_stay_under_their_size_class() {
        // The store keeps an `Arc<K>`: two counters (16 bytes) before the object.
        const ARC: usize = 16;
        assert!(
            ARC + std::mem::size_of::<super::MetalMachine>() <= 768,
            "MetalMachine is {} bytes",
            std::mem::size_of::<super::MetalMachine>()
        );
        assert!(
            ARC + std::mem::size_of::<kube::core::DeserializeGuard<super::Machine>>() <= 1280,
            "Machine is {} bytes",
            std::mem::size_of::<super::Machine>()
        );
    }
}

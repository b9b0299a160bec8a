//! What the Machine controller does, as a pure function of what it observed: the phase rules of
//! seeds 002/003 and the one next write. Every rule is a row in the tests below.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::NodeSystemInfo;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
use kube::ResourceExt;

use crate::api::capi::{MachineNodeReference, MachineStatus, MachineStatusInitialization};
use crate::api::common::MachineAddress;
use crate::api::{CLUSTER_NAME_LABEL, Cluster, Machine};
use crate::controllers::conditions::{self, Want};

use super::FINALIZER;

/// A referenced bootstrap config or infrastructure machine, as far as the Machine cares.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RefView {
    pub kind: String,
    pub name: String,
    /// Owned by this Machine (controller reference) and labelled with its cluster.
    pub adopted: bool,
    /// `status.initialization.<flag>` or v1beta1 `status.ready`.
    pub ready: bool,
    /// `status.failureReason` / `failureMessage`: terminal for the Machine.
    pub failure: Option<(String, String)>,
    /// Bootstrap: `status.dataSecretName`.
    pub data_secret_name: Option<String>,
    /// Infrastructure: `spec.providerID`.
    pub provider_id: Option<String>,
    /// Infrastructure: `status.addresses`.
    pub addresses: Vec<MachineAddress>,
    /// The reference's own Ready message, shown while waiting for it.
    pub waiting_message: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Referenced {
    /// No reference (bootstrap only: data set directly).
    None,
    NotFound {
        kind: String,
        name: String,
    },
    Found(RefView),
}

#[derive(Clone, Debug, PartialEq)]
pub enum NodeView {
    /// Not looked for: no providerID or infrastructure not ready.
    NotLooked,
    /// The workload cluster cannot be read (kubeconfig missing, invalid, unreachable).
    Unavailable {
        reason: String,
        message: String,
    },
    Missing {
        provider_id: String,
    },
    Found {
        name: String,
        ready: bool,
        info: Option<Box<NodeSystemInfo>>,
        /// Labels, annotations and taint removal still to send (`None`: in sync).
        sync: Option<serde_json::Value>,
    },
}

#[derive(Clone, Debug)]
pub struct Observed {
    pub machine: Arc<Machine>,
    pub cluster: Option<Arc<Cluster>>,
    pub bootstrap: Referenced,
    pub infra: Referenced,
    pub node: NodeView,
    pub now: Time,
}

/// The one write of a pass (status is written after it, separately, when it changed).
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Nothing,
    /// Whichever of these the Machine lacks, in one metadata patch (one write, not one per
    /// item): our finalizer, the cluster-name label, and an owner reference to the Cluster for a
    /// Machine nobody owns.
    PrepareMetadata {
        add_finalizer: bool,
        cluster_owner: Option<OwnerReference>,
    },
    AdoptBootstrap,
    AdoptInfrastructure,
    CopyDataSecretName(String),
    CopyProviderId(String),
    SyncNode {
        name: String,
        patch: serde_json::Value,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub status: MachineStatus,
    pub step: Step,
    /// Only for what no watch reports (the Cluster missing): everything else wakes us.
    pub requeue: Option<Duration>,
    /// Running reached, or a terminal failure, to announce: (warning, reason, message).
    pub event: Option<(bool, String, String)>,
}

/// The phase per seeds 002/003. Failed is terminal: once there, only deletion changes it.
/// Running is entered when the Node is Ready. A Running Machine stays Running whatever the Node
/// lookup says (as upstream's does, its nodeRef staying set): a Node NotReady, gone, or not
/// listed yet after a restart is said by NodeReady and Ready, not by flapping phases.
pub fn phase(
    previous: Option<&str>,
    failed: bool,
    bootstrap_ready: bool,
    infra_ready: bool,
    has_provider_id: bool,
    node: Option<bool>,
) -> &'static str {
    if failed || previous == Some("Failed") {
        return "Failed";
    }
    match node {
        Some(true) if infra_ready => "Running",
        _ if infra_ready && previous == Some("Running") => "Running",
        _ if infra_ready && has_provider_id => "Provisioned",
        _ if bootstrap_ready => "Provisioning",
        _ => "Pending",
    }
}

fn set(status: &mut MachineStatus, want: Want<'_>, o: &Observed) {
    conditions::set(
        &mut status.conditions,
        want,
        o.machine.metadata.generation,
        &o.now,
    );
}

/// The pass's one write: the first rule to propose one wins.
fn propose(step: &mut Step, s: Step) {
    if *step == Step::Nothing {
        *step = s;
    }
}

/// Decides for a Machine that is not being deleted and passes the watch filter.
pub fn decide(o: &Observed) -> Decision {
    let m = o.machine.as_ref();
    let previous_phase = m.status.as_ref().and_then(|s| s.phase.clone());
    let mut status = m.status.clone().unwrap_or_default();
    let mut step = Step::Nothing;

    // 1. The Cluster: nothing happens without it.
    let Some(cluster) = o.cluster.as_deref() else {
        set(
            &mut status,
            Want::f(
                "Ready",
                "ClusterNotFound",
                format!("Cluster {:?} not found", m.spec.cluster_name),
            ),
            o,
        );
        // The phase says how far the Machine got, which a missing Cluster does not undo (upstream
        // writes nothing then): a Running Machine whose Cluster is gone, or not listed yet after a
        // restart, stays Running.
        status.phase = Some(previous_phase.unwrap_or_else(|| "Pending".into()));
        return Decision {
            status,
            step: Step::Nothing,
            requeue: Some(Duration::from_secs(15)),
            event: None,
        };
    };
    // 2. Paused: no write but the Paused condition.
    if crate::controllers::is_paused(m, Some(cluster)) {
        set(
            &mut status,
            Want::t("Paused", "Paused", "the Cluster or this Machine is paused"),
            o,
        );
        return Decision {
            status,
            step: Step::Nothing,
            requeue: None,
            event: None,
        };
    }
    status.conditions.retain(|c| c.type_ != "Paused");
    // 3. Our finalizer before anything we would have to undo, and the Cluster association (the
    // label; an owner reference when nothing else controls it), written together.
    let add_finalizer = !m.finalizers().iter().any(|f| f == FINALIZER);
    let labelled = m.labels().get(CLUSTER_NAME_LABEL) == Some(&m.spec.cluster_name);
    let has_controller = m
        .owner_references()
        .iter()
        .any(|r| r.controller == Some(true));
    let owned_by_cluster = m
        .owner_references()
        .iter()
        .any(|r| r.kind == "Cluster" && r.name == m.spec.cluster_name);
    let needs_owner = !has_controller && !owned_by_cluster;
    if add_finalizer || !labelled || needs_owner {
        propose(
            &mut step,
            Step::PrepareMetadata {
                add_finalizer,
                cluster_owner: needs_owner.then(|| OwnerReference {
                    api_version: "cluster.x-k8s.io/v1beta2".into(),
                    kind: "Cluster".into(),
                    name: cluster.name_any(),
                    uid: cluster.uid().unwrap_or_default(),
                    controller: None,
                    block_owner_deletion: None,
                }),
            },
        );
    }

    let mut failure: Option<(String, String)> = status
        .failure_reason
        .clone()
        .map(|r| (r, status.failure_message.clone().unwrap_or_default()));
    // 5. Bootstrap: data set directly (Secret name or inline data), or copied from the config.
    let bootstrap_ready =
        m.spec.bootstrap.data_secret_name.is_some() || m.spec.bootstrap.data.is_some();
    match &o.bootstrap {
        Referenced::None => {}
        Referenced::NotFound { kind, name } => set(
            &mut status,
            Want::f(
                "BootstrapConfigReady",
                "NotFound",
                format!("{kind} {name} not found"),
            ),
            o,
        ),
        Referenced::Found(config) => {
            if !config.adopted {
                propose(&mut step, Step::AdoptBootstrap);
            }
            if let Some(f) = &config.failure {
                failure.get_or_insert(f.clone());
            }
            if !bootstrap_ready
                && config.ready
                && let Some(secret) = &config.data_secret_name
            {
                propose(&mut step, Step::CopyDataSecretName(secret.clone()));
            }
        }
    }
    if bootstrap_ready {
        set(
            &mut status,
            Want::t("BootstrapConfigReady", "DataSecretAvailable", ""),
            o,
        );
    } else if !matches!(o.bootstrap, Referenced::NotFound { .. }) {
        set(
            &mut status,
            Want::f(
                "BootstrapConfigReady",
                "WaitingForBootstrapData",
                "the bootstrap config has no data Secret yet",
            ),
            o,
        );
    }
    status.bootstrap_ready = Some(bootstrap_ready);

    // 6. Infrastructure: ready with a providerID, which is copied to the Machine.
    let mut infra_ready = false;
    match &o.infra {
        Referenced::None => {}
        Referenced::NotFound { kind, name } => set(
            &mut status,
            Want::f(
                "InfrastructureReady",
                "NotFound",
                format!("{kind} {name} not found"),
            ),
            o,
        ),
        Referenced::Found(infra) => {
            if !infra.adopted {
                propose(&mut step, Step::AdoptInfrastructure);
            }
            if let Some(f) = &infra.failure {
                failure.get_or_insert(f.clone());
            }
            infra_ready = infra.ready && infra.provider_id.is_some();
            if infra_ready {
                if m.spec.provider_id.is_none()
                    && let Some(id) = &infra.provider_id
                {
                    propose(&mut step, Step::CopyProviderId(id.clone()));
                }
                status.addresses = infra.addresses.clone();
                set(
                    &mut status,
                    Want::t(
                        "InfrastructureReady",
                        "Provisioned",
                        format!("{} {} is provisioned", infra.kind, infra.name),
                    ),
                    o,
                );
            } else {
                let why = infra
                    .waiting_message
                    .clone()
                    .unwrap_or_else(|| "not provisioned yet".into());
                set(
                    &mut status,
                    Want::f("InfrastructureReady", "WaitingForInfrastructure", why),
                    o,
                );
            }
        }
    }
    status.infrastructure_ready = Some(infra_ready);
    status.initialization = Some(MachineStatusInitialization {
        bootstrap_data_secret_created: Some(bootstrap_ready),
        infrastructure_provisioned: Some(infra_ready),
    });
    let mut event = None;
    if let Some((reason, message)) = &failure {
        if status.failure_reason.is_none() {
            event = Some((true, "Failed".to_string(), format!("{reason}: {message}")));
        }
        status.failure_reason = Some(reason.clone());
        status.failure_message = Some(message.clone());
    }

    // 7. The Node with the Machine's providerID, in the workload cluster: once the providerID
    // is the Machine's, or this pass's write makes it so (observe already looks the Node up by
    // the infrastructure's providerID, so the pass that copies it records the Node as well).
    let provider_id_set = m.spec.provider_id.is_some() || matches!(step, Step::CopyProviderId(_));
    let node = if provider_id_set {
        &o.node
    } else {
        &NodeView::NotLooked
    };
    let mut node_ready = None;
    match node {
        NodeView::NotLooked => {}
        NodeView::Unavailable { reason, message } => set(
            &mut status,
            Want::f("NodeReady", reason, message.clone()),
            o,
        ),
        NodeView::Missing { provider_id } => set(
            &mut status,
            Want::f(
                "NodeReady",
                "NodeNotFound",
                format!("no Node with providerID {provider_id} yet"),
            ),
            o,
        ),
        NodeView::Found {
            name,
            ready,
            info,
            sync,
        } => {
            status.node_ref = Some(MachineNodeReference {
                name: name.clone(),
                extra: Default::default(),
            });
            status.node_info = info.as_deref().cloned();
            node_ready = Some(*ready);
            let want = if *ready {
                Want::t("NodeReady", "NodeReady", "")
            } else {
                Want::f(
                    "NodeReady",
                    "NodeNotReady",
                    format!("Node {name} is not Ready"),
                )
            };
            set(&mut status, want, o);
            if let Some(patch) = sync {
                propose(
                    &mut step,
                    Step::SyncNode {
                        name: name.clone(),
                        patch: patch.clone(),
                    },
                );
            }
        }
    }

    // 8. The phase, and Ready.
    let next = phase(
        previous_phase.as_deref(),
        failure.is_some(),
        bootstrap_ready,
        infra_ready,
        // This pass's write copies it: the status that follows that write already counts it,
        // so Provisioned costs no second pass.
        provider_id_set,
        node_ready,
    );
    status.phase = Some(next.into());
    let ready = next == "Running" && node_ready == Some(true);
    set(
        &mut status,
        if ready {
            Want::t("Ready", "Ready", "")
        } else {
            Want::f("Ready", "NotReady", format!("phase {next}"))
        },
        o,
    );
    // Announced: reaching Running (the Node matched, upstream's SuccessfulSetNodeRef) and
    // Failed. The steps between are in status; an Event each would cost the apiserver an etcd
    // write per Machine per phase for nothing an operator could not read there.
    if previous_phase.as_deref() != Some(next)
        && matches!(next, "Running" | "Failed")
        && event.is_none()
    {
        event = Some((
            next == "Failed",
            format!("Phase{next}"),
            format!("Machine is {next}"),
        ));
    }
    // Kubeconfig Secrets are not watched (a Secret watch is costly): look again, paced.
    let requeue = matches!(node, NodeView::Unavailable { .. }).then_some(KUBECONFIG_RETRY);
    Decision {
        status,
        step,
        requeue,
        event,
    }
}

/// How often a Machine looks again for a workload kubeconfig that is missing or unusable.
pub const KUBECONFIG_RETRY: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::capi::{ClusterSpec, MachineBootstrap, MachineSpec};
    use crate::api::common::ContractVersionedObjectReference;

    fn machine() -> Machine {
        let mut m = Machine::new(
            "m1",
            MachineSpec {
                cluster_name: "c1".into(),
                bootstrap: MachineBootstrap {
                    config_ref: Some(ContractVersionedObjectReference {
                        api_group: "bootstrap.cluster.x-k8s.io".into(),
                        kind: "CloudInitConfig".into(),
                        name: "m1".into(),
                    }),
                    ..Default::default()
                },
                infrastructure_ref: ContractVersionedObjectReference {
                    api_group: "infrastructure.cluster.x-k8s.io".into(),
                    kind: "MetalMachine".into(),
                    name: "m1".into(),
                },
                ..Default::default()
            },
        );
        m.metadata.namespace = Some("ns".into());
        m.metadata.uid = Some("uid-m1".into());
        m.metadata.finalizers = Some(vec![FINALIZER.into()]);
        m.metadata.labels = Some([(CLUSTER_NAME_LABEL.to_string(), "c1".to_string())].into());
        m.metadata.owner_references = Some(vec![OwnerReference {
            kind: "Cluster".into(),
            name: "c1".into(),
            ..Default::default()
        }]);
        m
    }

    fn view(kind: &str) -> RefView {
        RefView {
            kind: kind.into(),
            name: "m1".into(),
            adopted: true,
            ..Default::default()
        }
    }

    fn base() -> Observed {
        Observed {
            machine: Arc::new(machine()),
            cluster: Some(Arc::new(Cluster::new("c1", ClusterSpec::default()))),
            bootstrap: Referenced::Found(view("CloudInitConfig")),
            infra: Referenced::Found(view("MetalMachine")),
            node: NodeView::NotLooked,
            now: conditions::now(),
        }
    }

    fn with(f: impl FnOnce(&mut Observed, &mut Machine)) -> Observed {
        let mut o = base();
        let mut m = machine();
        f(&mut o, &mut m);
        o.machine = Arc::new(m);
        o
    }

    fn bootstrapped(o: &mut Observed, m: &mut Machine) {
        m.spec.bootstrap.data_secret_name = Some("m1-data".into());
        if let Referenced::Found(v) = &mut o.bootstrap {
            v.ready = true;
            v.data_secret_name = Some("m1-data".into());
        }
    }

    fn provisioned(o: &mut Observed, m: &mut Machine) {
        bootstrapped(o, m);
        m.spec.provider_id = Some("metalboot://ns/h/u".into());
        if let Referenced::Found(v) = &mut o.infra {
            v.ready = true;
            v.provider_id = Some("metalboot://ns/h/u".into());
        }
    }

    fn node(ready: bool) -> NodeView {
        NodeView::Found {
            name: "n1".into(),
            ready,
            info: None,
            sync: None,
        }
    }

    fn previously(m: &mut Machine, phase: &str) {
        m.status = Some(MachineStatus {
            phase: Some(phase.into()),
            ..Default::default()
        });
    }

    fn cond(d: &Decision, type_: &str) -> (String, String) {
        conditions::get(&d.status.conditions, type_)
            .map(|c| (c.status.to_string(), c.reason.to_string()))
            .unwrap_or_default()
    }

    /// Seed 002/003 phase rules, one row each: observed inputs → phase and the next write.
    #[test]
    fn phase_rules_of_seeds_002_and_003() {
        let rows: Vec<(&str, Observed, &str, Step)> = vec![
            (
                "new Machine, config not ready: Pending",
                base(),
                "Pending",
                Step::Nothing,
            ),
            (
                "config ready with a data Secret: copy dataSecretName first",
                with(|o, _| {
                    if let Referenced::Found(v) = &mut o.bootstrap {
                        v.ready = true;
                        v.data_secret_name = Some("m1-data".into());
                    }
                }),
                "Pending",
                Step::CopyDataSecretName("m1-data".into()),
            ),
            (
                "dataSecretName set: Provisioning",
                with(bootstrapped),
                "Provisioning",
                Step::Nothing,
            ),
            (
                "inline bootstrap data, no config: Provisioning (seed 003 override)",
                with(|o, m| {
                    m.spec.bootstrap.config_ref = None;
                    m.spec.bootstrap.data = Some("#cloud-config\n".into());
                    o.bootstrap = Referenced::None;
                }),
                "Provisioning",
                Step::Nothing,
            ),
            (
                "infrastructure ready: copy providerID, Provisioned in the same pass",
                with(|o, m| {
                    bootstrapped(o, m);
                    if let Referenced::Found(v) = &mut o.infra {
                        v.ready = true;
                        v.provider_id = Some("metalboot://ns/h/u".into());
                    }
                }),
                "Provisioned",
                Step::CopyProviderId("metalboot://ns/h/u".into()),
            ),
            (
                "infrastructure ready and its Node already Ready: the pass that copies the \
                 providerID records the Node too, Running with one status write",
                with(|o, m| {
                    bootstrapped(o, m);
                    if let Referenced::Found(v) = &mut o.infra {
                        v.ready = true;
                        v.provider_id = Some("metalboot://ns/h/u".into());
                    }
                    o.node = node(true);
                }),
                "Running",
                Step::CopyProviderId("metalboot://ns/h/u".into()),
            ),
            (
                "Node already Ready but an earlier write wins the pass (adopting the \
                 infrastructure): no Node, not Running, before the providerID is the Machine's",
                with(|o, m| {
                    bootstrapped(o, m);
                    if let Referenced::Found(v) = &mut o.infra {
                        v.ready = true;
                        v.adopted = false;
                        v.provider_id = Some("metalboot://ns/h/u".into());
                    }
                    o.node = node(true);
                }),
                "Provisioning",
                Step::AdoptInfrastructure,
            ),
            (
                "infrastructure ready, providerID synced: Provisioned",
                with(provisioned),
                "Provisioned",
                Step::Nothing,
            ),
            (
                "Node found but not Ready: still Provisioned",
                with(|o, m| {
                    provisioned(o, m);
                    o.node = node(false);
                }),
                "Provisioned",
                Step::Nothing,
            ),
            (
                "Node found and Ready: Running",
                with(|o, m| {
                    provisioned(o, m);
                    o.node = node(true);
                }),
                "Running",
                Step::Nothing,
            ),
            (
                "Running, Node goes NotReady: stays Running",
                with(|o, m| {
                    provisioned(o, m);
                    previously(m, "Running");
                    o.node = node(false);
                }),
                "Running",
                Step::Nothing,
            ),
            (
                "Running, Node not found (deleted, or its cluster's Nodes not listed yet after \
                 a restart): stays Running",
                with(|o, m| {
                    provisioned(o, m);
                    previously(m, "Running");
                    o.node = NodeView::Missing {
                        provider_id: "metalboot://ns/h/u".into(),
                    };
                }),
                "Running",
                Step::Nothing,
            ),
            (
                "Running, workload cluster unreadable: stays Running",
                with(|o, m| {
                    provisioned(o, m);
                    previously(m, "Running");
                    o.node = NodeView::Unavailable {
                        reason: "WorkloadClusterUnreachable".into(),
                        message: "no answer".into(),
                    };
                }),
                "Running",
                Step::Nothing,
            ),
            (
                "infrastructure reports failureReason: Failed",
                with(|o, m| {
                    bootstrapped(o, m);
                    if let Referenced::Found(v) = &mut o.infra {
                        v.failure = Some(("InsufficientHosts".into(), "no host".into()));
                    }
                }),
                "Failed",
                Step::Nothing,
            ),
            (
                "Failed is terminal",
                with(|o, m| {
                    provisioned(o, m);
                    previously(m, "Failed");
                    o.node = node(true);
                }),
                "Failed",
                Step::Nothing,
            ),
        ];
        for (what, o, phase, step) in rows {
            let d = decide(&o);
            assert_eq!(
                (d.status.phase.as_deref(), &d.step),
                (Some(phase), &step),
                "{what}"
            );
        }
    }

    /// The gates before the phase: one row each, in the order they apply.
    #[test]
    fn gates_in_order() {
        let d = decide(&with(|o, _| o.cluster = None));
        assert_eq!(
            (cond(&d, "Ready").1.as_str(), &d.step, d.requeue.is_some()),
            ("ClusterNotFound", &Step::Nothing, true),
            "no Cluster: say so, no write, look again later"
        );
        assert_eq!(
            d.status.phase.as_deref(),
            Some("Pending"),
            "no Cluster, no phase yet: Pending"
        );
        let d = decide(&with(|o, m| {
            provisioned(o, m);
            previously(m, "Running");
            o.node = node(true);
            o.cluster = None;
        }));
        assert_eq!(
            (d.status.phase.as_deref(), cond(&d, "Ready").1.as_str()),
            (Some("Running"), "ClusterNotFound"),
            "a Running Machine whose Cluster is missing (gone, or not listed yet) stays Running"
        );
        let d = decide(&with(|o, m| {
            m.metadata.annotations =
                Some([("cluster.x-k8s.io/paused".to_string(), String::new())].into());
            m.metadata.finalizers = None;
            o.bootstrap = Referenced::Found(RefView {
                adopted: false,
                ..view("CloudInitConfig")
            });
        }));
        assert_eq!(
            (cond(&d, "Paused"), &d.step),
            (("True".into(), "Paused".into()), &Step::Nothing),
            "paused: not even the finalizer"
        );
        let d = decide(&with(|o, m| {
            m.metadata.finalizers = None;
            m.metadata.labels = None;
            o.bootstrap = Referenced::Found(RefView {
                adopted: false,
                ..view("CloudInitConfig")
            });
        }));
        assert!(
            matches!(
                &d.step,
                Step::PrepareMetadata {
                    add_finalizer: true,
                    cluster_owner: None
                }
            ),
            "finalizer first, with the label in the same write: {:?}",
            d.step
        );
        let d = decide(&with(|_, m| m.metadata.owner_references = None));
        assert!(
            matches!(&d.step, Step::PrepareMetadata { add_finalizer: false, cluster_owner: Some(o) } if o.name == "c1"),
            "a Machine nobody owns is owned by its Cluster: {:?}",
            d.step
        );
        let d = decide(&with(|_, m| {
            m.metadata.finalizers = None;
            m.metadata.owner_references = None;
        }));
        assert!(
            matches!(&d.step, Step::PrepareMetadata { add_finalizer: true, cluster_owner: Some(o) } if o.name == "c1"),
            "finalizer and Cluster owner: one write, not two: {:?}",
            d.step
        );
        let d = decide(&with(|o, _| {
            o.bootstrap = Referenced::Found(RefView {
                adopted: false,
                ..view("CloudInitConfig")
            });
            o.infra = Referenced::Found(RefView {
                adopted: false,
                ..view("MetalMachine")
            });
        }));
        assert_eq!(d.step, Step::AdoptBootstrap, "then the bootstrap config");
        let d = decide(&with(|o, _| {
            o.infra = Referenced::Found(RefView {
                adopted: false,
                ..view("MetalMachine")
            });
        }));
        assert_eq!(d.step, Step::AdoptInfrastructure, "then the infrastructure");
        let d = decide(&with(|o, m| {
            provisioned(o, m);
            o.node = NodeView::Found {
                name: "n1".into(),
                ready: true,
                info: None,
                sync: Some(serde_json::json!({"metadata": {}})),
            };
        }));
        assert!(
            matches!(d.step, Step::SyncNode { .. }),
            "then the Node's labels and taint"
        );
    }

    #[test]
    fn missing_references_and_workload_trouble_are_conditions() {
        let d = decide(&with(|o, _| {
            o.bootstrap = Referenced::NotFound {
                kind: "CloudInitConfig".into(),
                name: "m1".into(),
            };
            o.infra = Referenced::NotFound {
                kind: "MetalMachine".into(),
                name: "m1".into(),
            };
        }));
        assert_eq!(cond(&d, "BootstrapConfigReady").1, "NotFound");
        assert_eq!(cond(&d, "InfrastructureReady").1, "NotFound");
        let d = decide(&with(|o, m| {
            provisioned(o, m);
            o.node = NodeView::Unavailable {
                reason: "KubeconfigMissing".into(),
                message: "Secret ns/c1-kubeconfig not found".into(),
            };
        }));
        assert_eq!(
            (
                cond(&d, "NodeReady").1.as_str(),
                d.status.phase.as_deref(),
                d.requeue
            ),
            (
                "KubeconfigMissing",
                Some("Provisioned"),
                Some(KUBECONFIG_RETRY)
            ),
            "an unwatched kubeconfig Secret is looked at again, paced"
        );
        let d = decide(&with(|o, m| {
            bootstrapped(o, m);
            if let Referenced::Found(v) = &mut o.infra {
                v.failure = Some(("R".into(), "M".into()));
            }
        }));
        assert_eq!(
            d.event,
            Some((true, "Failed".into(), "R: M".into())),
            "a new failure is announced once"
        );
    }
}

//! Everything the Machine controller reads before it decides: the Cluster (shared store), the
//! bootstrap config and infrastructure machine (through the cached contract version), and the
//! workload cluster's Node with the Machine's providerID (one shared watch per cluster).

use std::sync::Arc;

use super::workloads::WorkloadNode;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

use crate::api::common::ContractVersionedObjectReference;
use crate::api::{CLUSTER_NAME_LABEL, Cluster, Machine};
use crate::controllers::refs::{ContractObject, InitializationFlag};
use crate::controllers::{ReconcileError, conditions, refs};

use super::decide::{NodeView, Observed, RefView, Referenced};
use super::{MachineContext, UNINITIALIZED_TAINT};

pub fn cluster_of(
    clusters: &Store<DeserializeGuard<Cluster>>,
    m: &Machine,
) -> Option<Arc<Cluster>> {
    let namespace = m.namespace().unwrap_or_default();
    let guard = clusters.get(&ObjectRef::new(&m.spec.cluster_name).within(&namespace))?;
    guard.0.as_ref().ok().map(|c| Arc::new(c.clone()))
}

/// Owned by `m` (controller reference with its UID) and labelled with its cluster.
pub fn adopted_by(obj: &ContractObject, m: &Machine) -> bool {
    let owned = m.meta().uid.as_ref().is_some_and(|uid| {
        obj.owner_references()
            .iter()
            .any(|o| &o.uid == uid && o.controller == Some(true))
    });
    owned && obj.labels().get(CLUSTER_NAME_LABEL) == Some(&m.spec.cluster_name)
}

fn view(
    obj: &ContractObject,
    m: &Machine,
    r: &ContractVersionedObjectReference,
    flag: InitializationFlag,
) -> RefView {
    RefView {
        kind: r.kind.clone(),
        name: r.name.clone(),
        adopted: adopted_by(obj, m),
        ready: obj.ready(flag),
        failure: obj.failure(),
        data_secret_name: obj.status.data_secret_name.clone(),
        provider_id: obj.spec.provider_id.clone(),
        addresses: obj.status.addresses.clone(),
        waiting_message: obj.status.ready_message.clone(),
    }
}

/// Reads a referenced object; also starts watching its kind, so its changes wake the Machine.
pub async fn referenced(
    ctx: &MachineContext,
    m: &Machine,
    r: Option<&ContractVersionedObjectReference>,
    flag: InitializationFlag,
) -> Result<(Referenced, Option<ContractObject>), ReconcileError> {
    let Some(r) = r.filter(|r| !r.name.is_empty()) else {
        return Ok((Referenced::None, None));
    };
    let namespace = m.namespace().unwrap_or_default();
    let resource = refs::resource_for(&ctx.client, r).await?;
    if !ctx.has_shared_store(&r.api_group, &r.kind) {
        ctx.triggers
            .watch_kind(&ctx.client, &resource, ctx.namespace.as_deref());
    }
    // A cached copy older than our own last write to it (adoption) is not used.
    let key = crate::controllers::expectations::object_key(&r.kind, &namespace, &r.name);
    let cached = ctx.cached_reference(r, &namespace).filter(|obj| {
        ctx.expectations
            .check(&key, obj.resource_version().as_deref())
            == crate::controllers::expectations::Seen::Met
    });
    let obj = match cached {
        Some(obj) => Some(obj),
        // Not cached (another provider's kind, or not seen yet): a miss is confirmed by a GET.
        None => kube::api::Api::<ContractObject>::namespaced_with(
            ctx.client.clone(),
            &namespace,
            &resource,
        )
        .get_opt(&r.name)
        .await
        .map_err(ReconcileError::read(format!("{} {}", r.kind, r.name)))?,
    };
    Ok(match obj {
        None => (
            Referenced::NotFound {
                kind: r.kind.clone(),
                name: r.name.clone(),
            },
            None,
        ),
        Some(obj) => (Referenced::Found(view(&obj, m, r, flag)), Some(obj)),
    })
}

/// The Machine labels upstream syncs to its Node.
pub fn synced_label(key: &str) -> bool {
    key.starts_with("node-role.kubernetes.io/")
        || key.starts_with("node-restriction.kubernetes.io/")
        || key.starts_with("node.cluster.x-k8s.io/")
}

/// The Node annotations upstream's node syncing sets (all under this prefix).
pub const SYNCED_ANNOTATION_PREFIX: &str = "cluster.x-k8s.io/";

/// What upstream's node syncing would still change on `node`: the Machine's annotations, its
/// node-role labels, and removal of the uninitialized taint. `None` when in sync.
pub fn node_sync_patch(node: &WorkloadNode, m: &Machine) -> Option<serde_json::Value> {
    let mut annotations = serde_json::Map::new();
    for (k, v) in [
        ("cluster.x-k8s.io/cluster-name", m.spec.cluster_name.clone()),
        (
            "cluster.x-k8s.io/cluster-namespace",
            m.namespace().unwrap_or_default(),
        ),
        ("cluster.x-k8s.io/machine", m.name_any()),
        ("cluster.x-k8s.io/owner-kind", "Machine".to_string()),
        ("cluster.x-k8s.io/owner-name", m.name_any()),
    ] {
        if node.annotations().get(k) != Some(&v) {
            annotations.insert(k.into(), v.into());
        }
    }
    let labels: serde_json::Map<String, serde_json::Value> = m
        .labels()
        .iter()
        .filter(|(k, _)| synced_label(k))
        .filter(|(k, v)| node.labels().get(*k) != Some(*v))
        .map(|(k, v)| (k.clone(), v.clone().into()))
        .collect();
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let tainted = taints.iter().any(|t| t.key == UNINITIALIZED_TAINT);
    if annotations.is_empty() && labels.is_empty() && !tainted {
        return None;
    }
    let mut patch = serde_json::json!({"metadata": {"annotations": annotations, "labels": labels}});
    if tainted {
        let kept: Vec<_> = taints
            .into_iter()
            .filter(|t| t.key != UNINITIALIZED_TAINT)
            .collect();
        patch["spec"] = serde_json::json!({"taints": kept});
    }
    Some(patch)
}

fn node_view(node: &WorkloadNode, m: &Machine) -> NodeView {
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
        .is_some_and(|c| c.status == "True");
    NodeView::Found {
        name: node.name_any(),
        ready,
        info: node
            .status
            .as_ref()
            .and_then(|s| s.node_info.clone())
            .map(Box::new),
        sync: node_sync_patch(node, m),
    }
}

/// All reads of one pass. The referenced objects come back too, for `act` to adopt them.
pub struct Observation {
    pub observed: Observed,
    pub bootstrap_object: Option<ContractObject>,
    pub infra_object: Option<ContractObject>,
}

pub async fn observe(ctx: &MachineContext, m: Arc<Machine>) -> Result<Observation, ReconcileError> {
    let cluster = cluster_of(&ctx.clusters, &m);
    let (bootstrap, bootstrap_object) = referenced(
        ctx,
        &m,
        m.spec.bootstrap.config_ref.as_ref(),
        InitializationFlag::DataSecretCreated,
    )
    .await?;
    let (infra, infra_object) = referenced(
        ctx,
        &m,
        Some(&m.spec.infrastructure_ref),
        InitializationFlag::Provisioned,
    )
    .await?;
    let infra_ready = matches!(&infra, Referenced::Found(v) if v.ready && v.provider_id.is_some());
    // The infrastructure's providerID, before this pass has copied it to the Machine: the pass
    // that copies it then also records the Node (one status write for Provisioned and Running,
    // not two).
    let provider_id = m.spec.provider_id.clone().or_else(|| match &infra {
        Referenced::Found(v) => v.provider_id.clone(),
        _ => None,
    });
    let node = match provider_id.filter(|_| infra_ready) {
        None => NodeView::NotLooked,
        Some(provider_id) => {
            ctx.triggers
                .provider_id(&provider_id, ObjectRef::from_obj(m.as_ref()));
            let namespace = m.namespace().unwrap_or_default();
            match ctx
                .workloads
                .get(&ctx.client, &namespace, &m.spec.cluster_name)
                .await
            {
                Err((reason, message)) => NodeView::Unavailable {
                    reason: reason.into(),
                    message,
                },
                // Two Nodes with one providerID (a host re-registered under a new name before
                // the old Node was deleted): the newest is the host as it runs now.
                Ok((_, nodes)) => nodes
                    .get(&provider_id)
                    .iter()
                    .max_by_key(|n| n.metadata.creation_timestamp.as_ref().map(|t| t.0))
                    .map(|n| node_view(n, &m))
                    .unwrap_or(NodeView::Missing { provider_id }),
            }
        }
    };
    Ok(Observation {
        observed: Observed {
            machine: m,
            cluster,
            bootstrap,
            infra,
            node,
            now: conditions::now(),
        },
        bootstrap_object,
        infra_object,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::MetalMachine;
    use crate::api::capi::MachineSpec;

    fn machine() -> Machine {
        Machine::new(
            "m1",
            MachineSpec {
                cluster_name: "c1".into(),
                ..Default::default()
            },
        )
    }

    /// A MetalMachine is read from the typed shared store, any other kind from its JSON: both
    /// roads give the Machine the same view, and the view holds what it decides from.
    #[test]
    fn a_metal_machine_reads_the_same_from_the_typed_store_as_from_its_json() {
        let mut m = machine();
        m.metadata.uid = Some("uid-m1".into());
        let r = ContractVersionedObjectReference {
            api_group: "infrastructure.cluster.x-k8s.io".into(),
            kind: "MetalMachine".into(),
            name: "m1".into(),
        };
        let condition = |kind: &str, message: &str| {
            serde_json::json!({"type": kind, "status": "False", "reason": "Waiting",
                "message": message, "lastTransitionTime": "2026-11-28T10:00:00Z",
                "observedGeneration": 2})
        };
        let metal_machine = |status: serde_json::Value| -> MetalMachine {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "MetalMachine",
                "metadata": {"name": "m1", "namespace": "ns", "resourceVersion": "9",
                    "labels": {CLUSTER_NAME_LABEL: "c1"},
                    "annotations": {"note": "x"},
                    "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2",
                        "kind": "Machine", "name": "m1", "uid": "uid-m1", "controller": true}]},
                "spec": {"providerID": "metalboot://ns/h1/u", "failureDomain": "rack-a"},
                "status": status,
            }))
            .expect("a MetalMachine")
        };
        let statuses = [
            serde_json::json!({
                "ready": false, "phase": "Provisioning", "observedGeneration": 2,
                "hostRef": {"name": "h1", "uid": "u"},
                "initialization": {"provisioned": false},
                "conditions": [condition("HostClaimed", "claimed h1"),
                    condition("Ready", "waiting for the host's callback"),
                    condition("Booted", "booting attempt 1")],
            }),
            serde_json::json!({
                "ready": true, "initialization": {"provisioned": true},
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                "failureReason": "R", "failureMessage": "M",
                "conditions": [condition("Booted", "booted")],
            }),
            serde_json::json!({}),
        ];
        let mut views = Vec::new();
        for status in &statuses {
            let typed = metal_machine(status.clone());
            let from_store = ContractObject::of_metal_machine(&typed);
            let mut from_json: ContractObject =
                serde_json::from_value(serde_json::to_value(&typed).expect("json"))
                    .expect("a contract object");
            refs::keep_contract_fields(&mut from_json);
            assert_eq!(from_store, from_json, "{status}");
            views.push(view(&from_store, &m, &r, InitializationFlag::Provisioned));
        }
        assert!(views.iter().all(|v| v.adopted));
        assert_eq!(
            views[0].waiting_message.as_deref(),
            Some("waiting for the host's callback")
        );
        assert!(!views[0].ready && views[1].ready && !views[2].ready);
        assert_eq!(views[1].failure, Some(("R".into(), "M".into())));
        assert_eq!(views[1].addresses.len(), 1);
        assert_eq!(views[0].provider_id.as_deref(), Some("metalboot://ns/h1/u"));
    }

    /// A CloudInitConfig is read from the bootstrap controller's typed store (spec dropped once
    /// rendered) when that controller runs here: the Machine's view is the same as from the
    /// config's JSON, with or without a status.
    #[test]
    fn a_cloud_init_config_reads_the_same_from_the_typed_store_as_from_its_json() {
        let mut m = machine();
        m.metadata.uid = Some("uid-m1".into());
        let r = ContractVersionedObjectReference {
            api_group: "bootstrap.cluster.x-k8s.io".into(),
            kind: "CloudInitConfig".into(),
            name: "m1".into(),
        };
        let config = |status: Option<serde_json::Value>| -> crate::api::CloudInitConfig {
            let mut json = serde_json::json!({
                "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1",
                "kind": "CloudInitConfig",
                "metadata": {"name": "m1", "namespace": "ns", "resourceVersion": "9",
                    "labels": {CLUSTER_NAME_LABEL: "c1"},
                    "annotations": {"note": "x"},
                    "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2",
                        "kind": "Machine", "name": "m1", "uid": "uid-m1", "controller": true}]},
                "spec": {},
            });
            if let Some(status) = status {
                json["status"] = status;
            }
            serde_json::from_value(json).expect("a CloudInitConfig")
        };
        let statuses = [
            Some(serde_json::json!({
                "ready": true, "dataSecretName": "m1",
                "initialization": {"dataSecretCreated": true}, "observedGeneration": 1,
                "conditions": [{"type": "Ready", "status": "True", "reason": "DataSecretAvailable",
                    "message": "", "lastTransitionTime": "2026-11-28T10:00:00Z"}],
            })),
            Some(serde_json::json!({
                "ready": false, "failureReason": "InvalidSpec", "failureMessage": "files[0]",
                "conditions": [{"type": "Ready", "status": "False", "reason": "InvalidSpec",
                    "message": "files[0].path is empty",
                    "lastTransitionTime": "2026-11-28T10:00:00Z"}],
            })),
            None,
        ];
        let mut views = Vec::new();
        for status in &statuses {
            let typed = config(status.clone());
            let from_store = ContractObject::of_cloud_init_config(&typed);
            let mut from_json: ContractObject =
                serde_json::from_value(serde_json::to_value(&typed).expect("json"))
                    .expect("a contract object");
            refs::keep_contract_fields(&mut from_json);
            assert_eq!(from_store, from_json, "{status:?}");
            views.push(view(
                &from_store,
                &m,
                &r,
                InitializationFlag::DataSecretCreated,
            ));
        }
        assert!(views.iter().all(|v| v.adopted));
        assert!(views[0].ready && !views[1].ready && !views[2].ready);
        assert_eq!(views[0].data_secret_name.as_deref(), Some("m1"));
        assert_eq!(
            views[1].failure,
            Some(("InvalidSpec".into(), "files[0]".into()))
        );
        assert_eq!(
            views[1].waiting_message.as_deref(),
            Some("files[0].path is empty")
        );
        // As another writer may leave it (v1beta2 only, no `ready`): the typed road reads
        // `ready: false`, the JSON road nothing, and the Machine sees the same either way.
        let raw = serde_json::json!({
            "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1",
            "kind": "CloudInitConfig",
            "metadata": {"name": "m1", "namespace": "ns", "resourceVersion": "9",
                "labels": {CLUSTER_NAME_LABEL: "c1"},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2",
                    "kind": "Machine", "name": "m1", "uid": "uid-m1", "controller": true}]},
            "spec": {},
            "status": {"initialization": {"dataSecretCreated": true}, "dataSecretName": "m1"},
        });
        let typed: crate::api::CloudInitConfig =
            serde_json::from_value(raw.clone()).expect("a CloudInitConfig");
        let from_store = ContractObject::of_cloud_init_config(&typed);
        let mut from_json: ContractObject = serde_json::from_value(raw).expect("a contract object");
        refs::keep_contract_fields(&mut from_json);
        let flag = InitializationFlag::DataSecretCreated;
        let (by_store, by_json) = (
            view(&from_store, &m, &r, flag),
            view(&from_json, &m, &r, flag),
        );
        assert!(by_store.ready);
        assert_eq!(by_store, by_json);
    }

    /// The Node store keeps only what a Machine compares: whatever the Node carries besides,
    /// the Machine sees the same Node and would sync the same patch.
    #[test]
    fn a_trimmed_node_reads_as_the_whole_node() {
        let mut m = machine();
        m.metadata.namespace = Some("ns".into());
        m.metadata.labels = Some(
            [
                ("node-role.kubernetes.io/worker".to_string(), String::new()),
                ("team".to_string(), "a".to_string()),
            ]
            .into(),
        );
        let node = |annotations: serde_json::Value, labels: serde_json::Value, ready: &str| {
            serde_json::from_value::<WorkloadNode>(serde_json::json!({
                "metadata": {"name": "n1", "annotations": annotations, "labels": labels},
                "spec": {"providerID": "metalboot://ns/h/u", "taints": [
                    {"key": UNINITIALIZED_TAINT, "effect": "NoSchedule"}]},
                "status": {"conditions": [
                    {"type": "MemoryPressure", "status": "False"},
                    {"type": "Ready", "status": ready}],
                    "nodeInfo": {"architecture": "amd64", "bootID": "b",
                    "containerRuntimeVersion": "c", "kernelVersion": "k", "kubeProxyVersion": "",
                    "kubeletVersion": "v1.36.3", "machineID": "m", "operatingSystem": "linux",
                    "osImage": "Debian", "systemUUID": "s"},
                    "images": [{"names": ["pause"], "sizeBytes": 1}]}
            }))
            .expect("a Node")
        };
        let synced = serde_json::json!({"cluster.x-k8s.io/cluster-name": "c1",
            "cluster.x-k8s.io/cluster-namespace": "ns", "cluster.x-k8s.io/machine": "m1",
            "cluster.x-k8s.io/owner-kind": "Machine", "cluster.x-k8s.io/owner-name": "m1",
            "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///run/containerd.sock"});
        let nodes = [
            node(
                serde_json::json!({"other": "x"}),
                serde_json::json!({"a": "b"}),
                "False",
            ),
            node(
                synced,
                serde_json::json!({"node-role.kubernetes.io/worker": "", "kubernetes.io/os": "linux"}),
                "True",
            ),
        ];
        for whole in nodes {
            let mut trimmed = whole.clone();
            super::super::workloads::keep_what_machines_read(&mut trimmed);
            assert_eq!(node_view(&trimmed, &m), node_view(&whole, &m));
        }
    }
}

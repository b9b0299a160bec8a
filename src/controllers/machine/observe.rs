//! Everything the Machine controller reads before it decides: the Cluster (shared store), the
//! bootstrap config and infrastructure machine (through the cached contract version), and the
//! workload cluster's Node with the Machine's providerID (one shared watch per cluster).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use kube::api::DynamicObject;
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};

use crate::api::common::{ContractVersionedObjectReference, MachineAddress};
use crate::api::{CLUSTER_NAME_LABEL, Cluster, Machine};
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
pub fn adopted_by(obj: &DynamicObject, m: &Machine) -> bool {
    let owned = m.meta().uid.as_ref().is_some_and(|uid| {
        obj.owner_references()
            .iter()
            .any(|o| &o.uid == uid && o.controller == Some(true))
    });
    owned && obj.labels().get(CLUSTER_NAME_LABEL) == Some(&m.spec.cluster_name)
}

fn view(
    obj: &DynamicObject,
    m: &Machine,
    r: &ContractVersionedObjectReference,
    flag: &str,
) -> RefView {
    let status = &obj.data["status"];
    RefView {
        kind: r.kind.clone(),
        name: r.name.clone(),
        adopted: adopted_by(obj, m),
        ready: refs::ready(obj, flag),
        failure: refs::failure(obj),
        data_secret_name: status["dataSecretName"].as_str().map(str::to_string),
        provider_id: obj.data["spec"]["providerID"].as_str().map(str::to_string),
        addresses: serde_json::from_value::<Vec<MachineAddress>>(status["addresses"].clone())
            .unwrap_or_default(),
        waiting_message: status["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
            .and_then(|c| c["message"].as_str())
            .map(str::to_string),
    }
}

/// Reads a referenced object; also starts watching its kind, so its changes wake the Machine.
pub async fn referenced(
    ctx: &MachineContext,
    m: &Machine,
    r: Option<&ContractVersionedObjectReference>,
    flag: &str,
) -> Result<(Referenced, Option<DynamicObject>), ReconcileError> {
    let Some(r) = r.filter(|r| !r.name.is_empty()) else {
        return Ok((Referenced::None, None));
    };
    let namespace = m.namespace().unwrap_or_default();
    let resource = refs::resource_for(&ctx.client, r).await?;
    ctx.triggers
        .watch_kind(&ctx.client, &resource, ctx.namespace.as_deref());
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
        None => kube::api::Api::<DynamicObject>::namespaced_with(
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

/// What upstream's node syncing would still change on `node`: the Machine's annotations, its
/// node-role labels, and removal of the uninitialized taint. `None` when in sync.
pub fn node_sync_patch(node: &Node, m: &Machine) -> Option<serde_json::Value> {
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
        .filter(|(k, _)| {
            k.starts_with("node-role.kubernetes.io/")
                || k.starts_with("node-restriction.kubernetes.io/")
                || k.starts_with("node.cluster.x-k8s.io/")
        })
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

fn node_view(node: &Node, m: &Machine) -> NodeView {
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
    pub bootstrap_object: Option<DynamicObject>,
    pub infra_object: Option<DynamicObject>,
}

pub async fn observe(ctx: &MachineContext, m: Arc<Machine>) -> Result<Observation, ReconcileError> {
    let cluster = cluster_of(&ctx.clusters, &m);
    let (bootstrap, bootstrap_object) = referenced(
        ctx,
        &m,
        m.spec.bootstrap.config_ref.as_ref(),
        "dataSecretCreated",
    )
    .await?;
    let (infra, infra_object) =
        referenced(ctx, &m, Some(&m.spec.infrastructure_ref), "provisioned").await?;
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

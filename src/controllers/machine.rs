//! The Machine controller for standalone mode (no upstream Cluster API): seeds 002/003. It is the
//! only writer of Machines: labels and owner references, bootstrap data and infrastructure
//! readiness copied in, the Node found by providerID in the workload cluster, phases
//! Pending → Provisioning → Provisioned → Running (Failed is terminal), and deletion in order:
//! pre-drain hooks → cordon + evictions (PDBs respected, bounded by nodeDrainTimeout) →
//! pre-terminate hooks → infrastructure → bootstrap config → Node → Deleted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, DynamicObject, Patch};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};
use kube::runtime::reflector::Store;
use kube::runtime::{Controller, watcher};
use kube::{Resource, ResourceExt};

use crate::api::capi::{MachineNodeReference, MachineStatus, MachineStatusInitialization};
use crate::api::common::MachineAddress;
use crate::api::{CLUSTER_NAME_LABEL, CloudInitConfig, Cluster, Machine, MetalMachine};

use super::conditions::{self, Want};
use super::drain;
use super::{
    Backoff, Events, ReconcileError, apply_status, is_paused, key, merge_params,
    passes_watch_filter, refs,
};

pub const FINALIZER: &str = "machine.cluster.x-k8s.io";
pub const FIELD_MANAGER: &str = "metalboot-machine";
const UNINITIALIZED_TAINT: &str = "node.cluster.x-k8s.io/uninitialized";
const PRE_DRAIN_HOOK: &str = "pre-drain.delete.hook.machine.cluster.x-k8s.io";
const PRE_TERMINATE_HOOK: &str = "pre-terminate.delete.hook.machine.cluster.x-k8s.io";
const EXCLUDE_DRAIN_ANNOTATION: &str = "machine.cluster.x-k8s.io/exclude-node-draining";
/// True once the drain is over (drained, skipped or timed out).
const DRAINED: &str = "DrainingSucceeded";

/// The phase per seed 002. Failed is terminal: once there, only deletion changes it.
pub fn phase(
    previous: Option<&str>,
    failed: bool,
    deleting: bool,
    bootstrap_ready: bool,
    infra_ready: bool,
    has_provider_id: bool,
    has_node: bool,
) -> &'static str {
    if deleting {
        return "Deleting";
    }
    if failed || previous == Some("Failed") {
        return "Failed";
    }
    if has_node && infra_ready {
        "Running"
    } else if infra_ready && has_provider_id {
        "Provisioned"
    } else if bootstrap_ready {
        "Provisioning"
    } else {
        "Pending"
    }
}

/// A workload cluster's client and Node store, with the kubeconfig Secret version they came from.
type Workload = (String, kube::Client, Store<Node>);

/// One client and one Node store per workload cluster, shared by its Machines.
#[derive(Default)]
pub struct Workloads {
    clusters: Mutex<HashMap<String, Workload>>,
}

impl Workloads {
    /// The workload cluster's client and Nodes, from `<cluster>-kubeconfig` (key `value`).
    async fn get(
        &self,
        client: &kube::Client,
        namespace: &str,
        cluster: &str,
    ) -> Result<(kube::Client, Store<Node>), (&'static str, String)> {
        let secret_name = format!("{cluster}-kubeconfig");
        let secret = Api::<Secret>::namespaced(client.clone(), namespace)
            .get_opt(&secret_name)
            .await
            .map_err(|e| {
                (
                    "KubeconfigUnreadable",
                    format!("reading Secret {secret_name}: {e}"),
                )
            })?
            .ok_or((
                "KubeconfigMissing",
                format!("Secret {namespace}/{secret_name} not found"),
            ))?;
        let version = secret.resource_version().unwrap_or_default();
        let cache_key = format!("{namespace}/{cluster}");
        if let Ok(map) = self.clusters.lock()
            && let Some((v, c, s)) = map.get(&cache_key)
            && *v == version
        {
            return Ok((c.clone(), s.clone()));
        }
        let value = secret.data.and_then(|d| d.get("value").cloned()).ok_or((
            "KubeconfigInvalid",
            format!("Secret {secret_name} has no key `value`"),
        ))?;
        let text = String::from_utf8(value.0).map_err(|_| {
            (
                "KubeconfigInvalid",
                format!("Secret {secret_name}: `value` is not UTF-8"),
            )
        })?;
        let kubeconfig = kube::config::Kubeconfig::from_yaml(&text)
            .map_err(|e| ("KubeconfigInvalid", format!("Secret {secret_name}: {e}")))?;
        let workload = crate::controlplane::client_with_retries(kubeconfig, false)
            .await
            .map_err(|e| ("KubeconfigInvalid", format!("Secret {secret_name}: {e}")))?;
        let store = crate::stores::watch_store(
            Api::<Node>::all(workload.clone()),
            watcher::Config::default(),
        );
        if tokio::time::timeout(Duration::from_secs(10), crate::stores::until_ready(&store))
            .await
            .is_err()
        {
            return Err((
                "WorkloadClusterUnreachable",
                format!("no answer from the workload cluster of {cluster} within 10 s"),
            ));
        }
        if let Ok(mut map) = self.clusters.lock() {
            map.insert(cache_key, (version, workload.clone(), store.clone()));
        }
        Ok((workload, store))
    }
}

pub struct MachineContext {
    pub client: kube::Client,
    pub events: Events,
    pub backoff: Backoff,
    pub workloads: Workloads,
    pub watch_filter: Option<String>,
}

fn machine_owner_ref(m: &Machine) -> Option<OwnerReference> {
    m.controller_owner_ref(&())
}

/// Adds the Machine's controller owner reference and the cluster-name label to a referenced object.
async fn adopt(
    api: &Api<DynamicObject>,
    obj: &DynamicObject,
    m: &Machine,
) -> Result<(), ReconcileError> {
    let Some(owner) = machine_owner_ref(m) else {
        return Ok(());
    };
    let mut owners = obj.metadata.owner_references.clone().unwrap_or_default();
    let owned = owners.iter().any(|o| o.uid == owner.uid);
    let labelled = obj.labels().get(CLUSTER_NAME_LABEL) == Some(&m.spec.cluster_name);
    if owned && labelled {
        return Ok(());
    }
    if !owned {
        owners.retain(|o| o.controller != Some(true));
        owners.push(owner);
    }
    let patch = serde_json::json!({"metadata": {
        "labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name},
        "ownerReferences": owners,
        "resourceVersion": obj.resource_version(),
    }});
    api.patch(
        &obj.name_any(),
        &merge_params(FIELD_MANAGER),
        &Patch::Merge(&patch),
    )
    .await
    .map(|_| ())
    .map_err(ReconcileError::write(format!(
        "owner reference on {}",
        obj.name_any()
    )))
}

async fn reconcile(m: Arc<Machine>, ctx: Arc<MachineContext>) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(m.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
    finalizer(&api, FINALIZER, m, |event| async {
        match event {
            FinalizerEvent::Apply(m) => apply(m, ctx.clone()).await,
            FinalizerEvent::Cleanup(m) => cleanup(m, ctx.clone()).await,
        }
    })
    .await
    .map_err(|e| ReconcileError::Finalizer(Box::new(e)))
}

async fn write_status(
    ctx: &MachineContext,
    m: &Machine,
    mut status: MachineStatus,
) -> Result<(), ReconcileError> {
    let previous = m.status.clone().unwrap_or_default();
    if status.phase != previous.phase {
        status.last_updated = Some(conditions::now());
    }
    status.observed_generation = m.metadata.generation;
    // Upstream fields we keep but do not own are not re-applied.
    status.extra.clear();
    if status
        == (MachineStatus {
            extra: Default::default(),
            ..previous
        })
    {
        return Ok(());
    }
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &m.namespace().unwrap_or_default());
    apply_status(&api, &m.name_any(), FIELD_MANAGER, &status)
        .await
        .map(|_| ())
}

/// For status written on the way to a requeue: the requeue matters more, the failure is logged.
async fn write_status_or_warn(ctx: &MachineContext, m: &Machine, status: MachineStatus) {
    if let Err(e) = write_status(ctx, m, status).await {
        tracing::warn!(machine = %key(m), error = %e, "could not write Machine status");
    }
}

async fn apply(m: Arc<Machine>, ctx: Arc<MachineContext>) -> Result<Action, ReconcileError> {
    let ns = m.namespace().unwrap_or_default();
    let name = m.name_any();
    let api: Api<Machine> = Api::namespaced(ctx.client.clone(), &ns);
    let now = conditions::now();
    let generation = m.metadata.generation;
    let mut status = m.status.clone().unwrap_or_default();
    let cluster = Api::<Cluster>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&m.spec.cluster_name)
        .await
        .map_err(ReconcileError::read(format!(
            "Cluster {}",
            m.spec.cluster_name
        )))?;
    let Some(cluster) = cluster else {
        conditions::set(
            &mut status.conditions,
            Want::f(
                "Ready",
                "ClusterNotFound",
                format!("Cluster {:?} not found", m.spec.cluster_name),
            ),
            generation,
            &now,
        );
        status.phase = Some(
            phase(
                status.phase.as_deref(),
                false,
                false,
                false,
                false,
                false,
                false,
            )
            .into(),
        );
        write_status(&ctx, &m, status).await?;
        return Ok(Action::requeue(Duration::from_secs(15)));
    };
    if is_paused(m.as_ref(), Some(&cluster)) {
        conditions::set(
            &mut status.conditions,
            Want::t("Paused", "Paused", "the Cluster or this Machine is paused"),
            generation,
            &now,
        );
        write_status(&ctx, &m, status).await?;
        return Ok(Action::await_change());
    }
    status.conditions.retain(|c| c.type_ != "Paused");

    // Cluster association: the label, and for a standalone Machine an owner reference to its Cluster.
    let labelled = m.labels().get(CLUSTER_NAME_LABEL) == Some(&m.spec.cluster_name);
    let has_controller = m
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true));
    let owned_by_cluster = m
        .owner_references()
        .iter()
        .any(|o| o.kind == "Cluster" && o.name == m.spec.cluster_name);
    if !labelled || (!has_controller && !owned_by_cluster) {
        let mut owners = m.owner_references().to_vec();
        if !has_controller && !owned_by_cluster {
            owners.push(OwnerReference {
                api_version: Cluster::api_version(&()).into_owned(),
                kind: "Cluster".into(),
                name: cluster.name_any(),
                uid: cluster.uid().unwrap_or_default(),
                controller: None,
                block_owner_deletion: None,
            });
        }
        let patch = serde_json::json!({"metadata": {"labels": {CLUSTER_NAME_LABEL: m.spec.cluster_name}, "ownerReferences": owners, "resourceVersion": m.resource_version()}});
        api.patch(&name, &merge_params(FIELD_MANAGER), &Patch::Merge(&patch))
            .await
            .map_err(ReconcileError::write(format!("Machine {name} metadata")))?;
        return Ok(Action::requeue(Duration::from_millis(100)));
    }

    let mut failure: Option<(String, String)> = status
        .failure_reason
        .clone()
        .map(|r| (r, status.failure_message.clone().unwrap_or_default()));
    // Bootstrap.
    let mut bootstrap_ready = m.spec.bootstrap.data_secret_name.is_some();
    if let Some(config_ref) = m
        .spec
        .bootstrap
        .config_ref
        .clone()
        .filter(|r| !r.name.is_empty())
    {
        let configs = refs::api_for(&ctx.client, &ns, &config_ref).await?;
        match configs
            .get_opt(&config_ref.name)
            .await
            .map_err(ReconcileError::read(format!(
                "{} {}",
                config_ref.kind, config_ref.name
            )))? {
            None => conditions::set(
                &mut status.conditions,
                Want::f(
                    "BootstrapConfigReady",
                    "NotFound",
                    format!("{} {} not found", config_ref.kind, config_ref.name),
                ),
                generation,
                &now,
            ),
            Some(config) => {
                adopt(&configs, &config, &m).await?;
                if let Some(f) = refs::failure(&config) {
                    failure.get_or_insert(f);
                }
                let secret = config.data["status"]["dataSecretName"]
                    .as_str()
                    .map(str::to_string);
                if !bootstrap_ready
                    && refs::ready(&config, "dataSecretCreated")
                    && let Some(secret) = secret
                {
                    let patch =
                        serde_json::json!({"spec": {"bootstrap": {"dataSecretName": secret}}});
                    api.patch(&name, &merge_params(FIELD_MANAGER), &Patch::Merge(&patch))
                        .await
                        .map_err(ReconcileError::write(format!(
                            "Machine {name} dataSecretName"
                        )))?;
                    bootstrap_ready = true;
                }
            }
        }
    }
    if bootstrap_ready {
        conditions::set(
            &mut status.conditions,
            Want::t("BootstrapConfigReady", "DataSecretAvailable", ""),
            generation,
            &now,
        );
    } else if conditions::get(&status.conditions, "BootstrapConfigReady")
        .is_none_or(|c| c.reason != "NotFound")
    {
        conditions::set(
            &mut status.conditions,
            Want::f(
                "BootstrapConfigReady",
                "WaitingForBootstrapData",
                "the bootstrap config has no data Secret yet",
            ),
            generation,
            &now,
        );
    }
    status.bootstrap_ready = Some(bootstrap_ready);

    // Infrastructure.
    let mut infra_ready = false;
    let mut provider_id = m.spec.provider_id.clone();
    let infra_ref = m.spec.infrastructure_ref.clone();
    let infras = refs::api_for(&ctx.client, &ns, &infra_ref).await?;
    match infras
        .get_opt(&infra_ref.name)
        .await
        .map_err(ReconcileError::read(format!(
            "{} {}",
            infra_ref.kind, infra_ref.name
        )))? {
        None => conditions::set(
            &mut status.conditions,
            Want::f(
                "InfrastructureReady",
                "NotFound",
                format!("{} {} not found", infra_ref.kind, infra_ref.name),
            ),
            generation,
            &now,
        ),
        Some(infra) => {
            adopt(&infras, &infra, &m).await?;
            if let Some(f) = refs::failure(&infra) {
                failure.get_or_insert(f);
            }
            let infra_id = infra.data["spec"]["providerID"]
                .as_str()
                .map(str::to_string);
            infra_ready = refs::ready(&infra, "provisioned") && infra_id.is_some();
            if infra_ready {
                if provider_id.is_none() {
                    let patch = serde_json::json!({"spec": {"providerID": infra_id}});
                    api.patch(&name, &merge_params(FIELD_MANAGER), &Patch::Merge(&patch))
                        .await
                        .map_err(ReconcileError::write(format!("Machine {name} providerID")))?;
                    provider_id = infra_id;
                }
                status.addresses = serde_json::from_value::<Vec<MachineAddress>>(
                    infra.data["status"]["addresses"].clone(),
                )
                .unwrap_or_default();
                conditions::set(
                    &mut status.conditions,
                    Want::t(
                        "InfrastructureReady",
                        "Provisioned",
                        format!("{} {} is provisioned", infra_ref.kind, infra_ref.name),
                    ),
                    generation,
                    &now,
                );
            } else {
                let why = infra.data["status"]["conditions"]
                    .as_array()
                    .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
                    .and_then(|c| c["message"].as_str())
                    .unwrap_or("not provisioned yet")
                    .to_string();
                conditions::set(
                    &mut status.conditions,
                    Want::f("InfrastructureReady", "WaitingForInfrastructure", why),
                    generation,
                    &now,
                );
            }
        }
    }
    status.infrastructure_ready = Some(infra_ready);
    status.initialization = Some(MachineStatusInitialization {
        bootstrap_data_secret_created: Some(bootstrap_ready),
        infrastructure_provisioned: Some(infra_ready),
    });
    if let Some((reason, message)) = &failure {
        if status.failure_reason.is_none() {
            ctx.events
                .publish(m.as_ref(), true, "Failed", format!("{reason}: {message}"))
                .await;
        }
        status.failure_reason = Some(reason.clone());
        status.failure_message = Some(message.clone());
    }

    // Node.
    if let Some(pid) = provider_id.clone().filter(|_| infra_ready) {
        match ctx
            .workloads
            .get(&ctx.client, &ns, &m.spec.cluster_name)
            .await
        {
            Err((reason, message)) => {
                conditions::set(
                    &mut status.conditions,
                    Want::f("NodeReady", reason, message),
                    generation,
                    &now,
                );
            }
            Ok((workload, nodes)) => {
                let node = nodes.state().into_iter().find(|n| {
                    n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(pid.as_str())
                });
                match node {
                    None => conditions::set(
                        &mut status.conditions,
                        Want::f(
                            "NodeReady",
                            "NodeNotFound",
                            format!("no Node with providerID {pid} yet"),
                        ),
                        generation,
                        &now,
                    ),
                    Some(node) => {
                        status.node_ref = Some(MachineNodeReference {
                            name: node.name_any(),
                            extra: Default::default(),
                        });
                        status.node_info = node.status.as_ref().and_then(|s| s.node_info.clone());
                        let ready = node
                            .status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"))
                            .is_some_and(|c| c.status == "True");
                        conditions::set(
                            &mut status.conditions,
                            if ready {
                                Want::t("NodeReady", "NodeReady", "")
                            } else {
                                Want::f(
                                    "NodeReady",
                                    "NodeNotReady",
                                    format!("Node {} is not Ready", node.name_any()),
                                )
                            },
                            generation,
                            &now,
                        );
                        sync_node(&workload, &node, &m).await?;
                    }
                }
            }
        }
    }

    let has_node = status.node_ref.is_some();
    let next = phase(
        m.status.as_ref().and_then(|s| s.phase.as_deref()),
        failure.is_some(),
        false,
        bootstrap_ready,
        infra_ready,
        provider_id.is_some(),
        has_node,
    );
    status.phase = Some(next.into());
    let ready = next == "Running" && conditions::is_true(&status.conditions, "NodeReady");
    conditions::set(
        &mut status.conditions,
        if ready {
            Want::t("Ready", "Ready", "")
        } else {
            Want::f("Ready", "NotReady", format!("phase {next}"))
        },
        generation,
        &now,
    );
    let changed = m.status.as_ref().and_then(|s| s.phase.as_deref()) != Some(next);
    write_status(&ctx, &m, status).await?;
    if changed {
        ctx.events
            .publish(
                m.as_ref(),
                next == "Failed",
                &format!("Phase{next}"),
                format!("Machine is {next}"),
            )
            .await;
    }
    ctx.backoff.reset(&key(m.as_ref()));
    Ok(match next {
        "Running" => Action::requeue(Duration::from_secs(120)),
        "Failed" => Action::await_change(),
        _ => Action::requeue(Duration::from_secs(5)),
    })
}

/// Annotations, role labels, and the uninitialized taint removed (upstream's node syncing).
async fn sync_node(
    workload: &kube::Client,
    node: &Node,
    m: &Machine,
) -> Result<(), ReconcileError> {
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
        return Ok(());
    }
    let mut patch = serde_json::json!({"metadata": {"annotations": annotations, "labels": labels}});
    if tainted {
        let kept: Vec<_> = taints
            .into_iter()
            .filter(|t| t.key != UNINITIALIZED_TAINT)
            .collect();
        patch["spec"] = serde_json::json!({"taints": kept});
    }
    Api::<Node>::all(workload.clone())
        .patch(
            &node.name_any(),
            &merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
        .map(|_| ())
        .map_err(ReconcileError::write(format!("Node {}", node.name_any())))
}

fn hooks(m: &Machine, prefix: &str) -> Vec<String> {
    m.annotations()
        .keys()
        .filter(|k| k.starts_with(prefix))
        .cloned()
        .collect()
}

async fn cleanup(m: Arc<Machine>, ctx: Arc<MachineContext>) -> Result<Action, ReconcileError> {
    let ns = m.namespace().unwrap_or_default();
    let now = conditions::now();
    let generation = m.metadata.generation;
    let mut status = m.status.clone().unwrap_or_default();
    status.phase = Some("Deleting".into());
    let waiting = |what: String| ReconcileError::Requeue {
        what,
        after: Duration::from_secs(2),
    };
    // Upstream order: pre-drain hooks, drain, pre-terminate hooks, then the referenced objects.
    for (step, prefix) in [("drain", PRE_DRAIN_HOOK), ("terminate", PRE_TERMINATE_HOOK)] {
        if step == "terminate"
            && let Some(node) = status.node_ref.as_ref().map(|n| n.name.clone())
            && let Some(wait) = drain_node(&ctx, &m, &node, &mut status).await?
        {
            write_status_or_warn(&ctx, &m, status).await;
            return Err(wait);
        }
        let pending = hooks(&m, prefix);
        if !pending.is_empty() {
            conditions::set(
                &mut status.conditions,
                Want::t(
                    "Deleting",
                    "WaitingForHooks",
                    format!("waiting for hook annotations {pending:?}"),
                ),
                generation,
                &now,
            );
            write_status_or_warn(&ctx, &m, status).await;
            return Err(waiting(format!("Machine waits for hooks {pending:?}")));
        }
    }
    // Infrastructure, then bootstrap config: delete and wait until gone.
    let mut refs_in_order = vec![m.spec.infrastructure_ref.clone()];
    refs_in_order.extend(m.spec.bootstrap.config_ref.clone());
    for r in refs_in_order.into_iter().filter(|r| !r.name.is_empty()) {
        let api = refs::api_for(&ctx.client, &ns, &r).await?;
        if let Some(obj) = api
            .get_opt(&r.name)
            .await
            .map_err(ReconcileError::read(format!("{} {}", r.kind, r.name)))?
        {
            if obj.metadata.deletion_timestamp.is_none() {
                api.delete(&r.name, &DeleteParams::default())
                    .await
                    .map_err(ReconcileError::write(format!(
                        "deleting {} {}",
                        r.kind, r.name
                    )))?;
            }
            conditions::set(
                &mut status.conditions,
                Want::t(
                    "Deleting",
                    "WaitingForDeletion",
                    format!("waiting for {} {} to be deleted", r.kind, r.name),
                ),
                generation,
                &now,
            );
            write_status_or_warn(&ctx, &m, status).await;
            return Err(waiting(format!(
                "waiting for {} {} to be deleted",
                r.kind, r.name
            )));
        }
    }
    if let Some(node_ref) = &status.node_ref {
        match ctx
            .workloads
            .get(&ctx.client, &ns, &m.spec.cluster_name)
            .await
        {
            Ok((workload, _)) => match Api::<Node>::all(workload)
                .delete(&node_ref.name, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => {
                    tracing::warn!(machine = %key(m.as_ref()), error = %e, "could not delete the Node; continuing")
                }
            },
            Err((reason, message)) => {
                tracing::warn!(machine = %key(m.as_ref()), reason, "cannot reach the workload cluster to delete the Node: {message}")
            }
        }
    }
    status.phase = Some("Deleted".into());
    conditions::set(
        &mut status.conditions,
        Want::t(
            "Deleting",
            "Deleted",
            "infrastructure, bootstrap config and Node deleted",
        ),
        generation,
        &now,
    );
    write_status(&ctx, &m, status).await?;
    ctx.events
        .publish(m.as_ref(), false, "PhaseDeleted", "Machine deleted")
        .await;
    Ok(Action::await_change())
}

/// Whether a drain that started at `started` has used up `timeout_seconds` (unset or 0: never).
pub fn drain_timed_out(
    started: Option<jiff::Timestamp>,
    now: jiff::Timestamp,
    timeout_seconds: Option<i32>,
) -> bool {
    match (started, timeout_seconds) {
        (Some(started), Some(t)) if t > 0 => now.duration_since(started).as_secs() >= i64::from(t),
        _ => false,
    }
}

/// Records drain progress: the `Deleting` condition always, and `DrainingSucceeded` (upstream's
/// v1beta1 name) once the drain is over, so later passes of the deletion do not drain again.
fn mark_drain(status: &mut MachineStatus, m: &Machine, over: bool, reason: &str, message: String) {
    let now = conditions::now();
    let generation = m.metadata.generation;
    conditions::set(
        &mut status.conditions,
        Want::t("Deleting", reason, message.clone()),
        generation,
        &now,
    );
    let drained = if over {
        Want::t(DRAINED, reason, message)
    } else {
        Want::f(DRAINED, reason, message)
    };
    conditions::set(&mut status.conditions, drained, generation, &now);
}

/// Cordons and drains the Machine's Node. `Some(requeue)` while pods remain; `None` when the drain
/// is over: done, skipped (annotation, Cluster going away, Node gone) or out of time.
async fn drain_node(
    ctx: &MachineContext,
    m: &Machine,
    node: &str,
    status: &mut MachineStatus,
) -> Result<Option<ReconcileError>, ReconcileError> {
    if conditions::is_true(&status.conditions, DRAINED) {
        return Ok(None);
    }
    let ns = m.namespace().unwrap_or_default();
    if m.annotations().contains_key(EXCLUDE_DRAIN_ANNOTATION) {
        let why = format!("{EXCLUDE_DRAIN_ANNOTATION} is set");
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let cluster_going = Api::<Cluster>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&m.spec.cluster_name)
        .await
        .map_err(ReconcileError::read(format!(
            "Cluster {}",
            m.spec.cluster_name
        )))?
        .is_none_or(|c| c.metadata.deletion_timestamp.is_some());
    if cluster_going {
        let why = "the Cluster is being deleted".to_string();
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let timeout = m
        .spec
        .deletion
        .as_ref()
        .and_then(|d| d.node_drain_timeout_seconds);
    let now = conditions::now();
    let deletion = status.deletion.get_or_insert_with(Default::default);
    let started = deletion.node_drain_start_time.get_or_insert(now.clone()).0;
    if drain_timed_out(Some(started), now.0, timeout) {
        let why = format!(
            "Node {node} not drained within {}s; continuing deletion",
            timeout.unwrap_or_default()
        );
        ctx.events
            .publish(m, true, "DrainTimedOut", why.clone())
            .await;
        mark_drain(status, m, true, "DrainTimedOut", why);
        return Ok(None);
    }
    let requeue = |what: String| ReconcileError::Requeue {
        what,
        after: Duration::from_secs(5),
    };
    let workload = match ctx
        .workloads
        .get(&ctx.client, &ns, &m.spec.cluster_name)
        .await
    {
        Ok((workload, _)) => workload,
        Err((reason, message)) => {
            let why = format!("cannot drain Node {node}: {message}");
            mark_drain(status, m, false, reason, why.clone());
            return Ok(Some(requeue(why)));
        }
    };
    let nodes: Api<Node> = Api::all(workload.clone());
    if !drain::cordon(&nodes, node, FIELD_MANAGER).await? {
        let why = format!("Node {node} no longer exists");
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let pass = drain::evict_pass(&workload, node).await?;
    tracing::debug!(machine = %key(m), node, ?pass, "eviction pass");
    for pod in &pass.evicted {
        let what = format!("evicted pod {pod} from Node {node}");
        ctx.events.publish(m, false, "PodEvicted", what).await;
    }
    if pass.done() {
        mark_drain(
            status,
            m,
            true,
            "NodeDrained",
            format!("Node {node} drained"),
        );
        return Ok(None);
    }
    let summary = pass.summary(node);
    mark_drain(status, m, false, "DrainingNode", summary.clone());
    Ok(Some(requeue(summary)))
}

fn error_policy(m: Arc<Machine>, error: &ReconcileError, ctx: Arc<MachineContext>) -> Action {
    if let Some(after) = error.requeue_after() {
        return Action::requeue(after);
    }
    let delay = ctx.backoff.next(&key(m.as_ref()));
    tracing::warn!(machine = %key(m.as_ref()), error = %error, retry_in = ?delay, "Machine reconcile failed");
    Action::requeue(delay)
}

/// Watches Machines, and metalboot's own infrastructure machines and bootstrap configs (owned by
/// their Machine), so a Machine moves the moment they change. References to other providers' kinds
/// are picked up by the periodic requeue.
pub fn controller(client: kube::Client, namespace: Option<&str>) -> Controller<Machine> {
    fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
    {
        match namespace {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    Controller::new(
        api::<Machine>(&client, namespace),
        watcher::Config::default(),
    )
    .owns(
        api::<MetalMachine>(&client, namespace),
        watcher::Config::default(),
    )
    .owns(
        api::<CloudInitConfig>(&client, namespace),
        watcher::Config::default(),
    )
}

pub async fn run(controller: Controller<Machine>, ctx: Arc<MachineContext>) {
    controller
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

#[cfg(test)]
mod tests {
    use super::{drain_timed_out, phase};

    #[test]
    fn drain_timeout_counts_from_the_recorded_start() {
        let start: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().expect("time");
        let at = |s: i64| start + jiff::SignedDuration::from_secs(s);
        let table = [
            (Some(start), at(59), Some(60), false),
            (Some(start), at(60), Some(60), true),
            (Some(start), at(9999), None, false),
            (Some(start), at(9999), Some(0), false),
            (None, at(9999), Some(60), false),
        ];
        for (i, (started, now, timeout, want)) in table.into_iter().enumerate() {
            assert_eq!(drain_timed_out(started, now, timeout), want, "row {i}");
        }
    }

    #[test]
    fn phases_follow_seed_002() {
        // (previous, failed, deleting, bootstrap, infra, providerID, node) → phase
        let cases = [
            (None, false, false, false, false, false, false, "Pending"),
            (
                Some("Pending"),
                false,
                false,
                true,
                false,
                false,
                false,
                "Provisioning",
            ),
            (
                Some("Provisioning"),
                false,
                false,
                true,
                true,
                true,
                false,
                "Provisioned",
            ),
            (
                Some("Provisioned"),
                false,
                false,
                true,
                true,
                true,
                true,
                "Running",
            ),
            (
                Some("Provisioning"),
                true,
                false,
                true,
                false,
                false,
                false,
                "Failed",
            ),
            (
                Some("Failed"),
                false,
                false,
                true,
                true,
                true,
                true,
                "Failed",
            ),
            (
                Some("Running"),
                false,
                true,
                true,
                true,
                true,
                true,
                "Deleting",
            ),
            (
                Some("Failed"),
                true,
                true,
                true,
                true,
                true,
                true,
                "Deleting",
            ),
            (None, false, false, true, true, false, false, "Provisioning"),
        ];
        for (prev, failed, deleting, b, i, p, n, want) in cases {
            assert_eq!(
                phase(prev, failed, deleting, b, i, p, n),
                want,
                "{prev:?} f={failed} d={deleting} b={b} i={i} p={p} n={n}"
            );
        }
    }
}

//! MetalCluster controller: bare metal has no cloud load balancer, so the infrastructure cluster
//! is ready once the operator's control-plane endpoint is valid; its failure domains are the
//! distinct values of the failure-domain label on the namespace's MetalHosts.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, watcher};
use kube::{Resource, ResourceExt};

use crate::api::common::FailureDomain;
use crate::api::metalcluster::{ClusterInitialization, MetalClusterStatus};
use crate::api::{Cluster, DEFAULT_FAILURE_DOMAIN_LABEL, MetalCluster, MetalHost};

use super::conditions::{self, Want};
use super::{Backoff, ReconcileError, apply_status, is_paused, key, passes_watch_filter};

pub const FIELD_MANAGER: &str = "metalboot-metalcluster";
/// Objects with this label are managed by someone else (Cluster API contract).
pub const MANAGED_BY_LABEL: &str = "cluster.x-k8s.io/managed-by";

/// The status a MetalCluster should have, from its spec and the hosts in its namespace.
pub fn desired_status(
    mc: &MetalCluster,
    hosts: &[Arc<MetalHost>],
    paused: bool,
    now: &Time,
) -> MetalClusterStatus {
    let mut status = mc.status.clone().unwrap_or_default();
    let generation = mc.metadata.generation;
    status.observed_generation = generation;
    if paused {
        conditions::set(
            &mut status.conditions,
            Want::t("Paused", "Paused", "the Cluster or this object is paused"),
            generation,
            now,
        );
        return status;
    }
    status.conditions.retain(|c| c.type_ != "Paused");
    let label = mc
        .spec
        .failure_domain_label
        .as_deref()
        .unwrap_or(DEFAULT_FAILURE_DOMAIN_LABEL);
    let domains: BTreeSet<String> = hosts
        .iter()
        .filter(|h| h.namespace() == mc.namespace())
        .filter_map(|h| h.labels().get(label).cloned())
        .filter(|v| !v.is_empty())
        .collect();
    status.failure_domains = domains
        .into_iter()
        .map(|name| FailureDomain {
            name,
            control_plane: Some(true),
            attributes: None,
        })
        .collect();
    let endpoint = &mc.spec.control_plane_endpoint;
    let already =
        status.ready || status.initialization.as_ref().and_then(|i| i.provisioned) == Some(true);
    if endpoint.is_set() || already {
        // Once provisioned, never back (contract); an endpoint change does not unprovision.
        status.ready = true;
        status.initialization = Some(ClusterInitialization {
            provisioned: Some(true),
        });
        conditions::set(
            &mut status.conditions,
            Want::t(
                "Ready",
                "Ready",
                format!("control plane endpoint {}:{}", endpoint.host, endpoint.port),
            ),
            generation,
            now,
        );
    } else {
        conditions::set(
            &mut status.conditions,
            Want::f(
                "Ready",
                "ControlPlaneEndpointMissing",
                "spec.controlPlaneEndpoint must name the workload cluster's apiserver (host and port 1-65535)",
            ),
            generation,
            now,
        );
    }
    status
}

pub struct ClusterContext {
    pub client: kube::Client,
    /// The manager's shared host store (labels name the failure domains). A label change wakes
    /// this controller once that store has applied it: a pass it wakes reads what woke it.
    pub hosts: Store<MetalHost>,
    /// The manager's shared Cluster store (the same watch that wakes this controller).
    pub clusters: Store<DeserializeGuard<Cluster>>,
    pub backoff: Backoff,
    pub watch_filter: Option<String>,
}

async fn reconcile(
    mc: Arc<MetalCluster>,
    ctx: Arc<ClusterContext>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(mc.as_ref(), ctx.watch_filter.as_deref())
        || mc.labels().contains_key(MANAGED_BY_LABEL)
    {
        return Ok(Action::await_change());
    }
    // Only listed stores can say "not found" (see `SharedStores::until_listed`): no hosts listed
    // yet would read as no failure domains.
    crate::stores::until_ready(&ctx.hosts).await;
    crate::stores::until_ready(&ctx.clusters).await;
    let namespace = mc.namespace().unwrap_or_default();
    let owner = mc
        .owner_references()
        .iter()
        .find(|o| o.kind == "Cluster" && o.api_version.starts_with("cluster.x-k8s.io/"))
        .map(|o| o.name.clone());
    let cluster = owner
        .and_then(|name| ctx.clusters.get(&ObjectRef::new(&name).within(&namespace)))
        .and_then(|guard| guard.0.as_ref().ok().cloned());
    let status = desired_status(
        &mc,
        &ctx.hosts.state(),
        is_paused(mc.as_ref(), cluster.as_ref()),
        &conditions::now(),
    );
    if super::status_changes(mc.status.as_ref(), &status) {
        let api: Api<MetalCluster> = Api::namespaced(ctx.client.clone(), &namespace);
        apply_status(&api, &mc.name_any(), FIELD_MANAGER, &status).await?;
    }
    ctx.backoff.reset(&key(mc.as_ref()));
    Ok(Action::requeue(Duration::from_secs(300)))
}

fn error_policy(mc: Arc<MetalCluster>, error: &ReconcileError, ctx: Arc<ClusterContext>) -> Action {
    ctx.backoff
        .after_failure("MetalCluster", &key(mc.as_ref()), error)
}

/// Owned by the Cluster of that name (the owner reference core or the Machine controller sets).
fn owned_by_cluster(mc: &MetalCluster, cluster: &str) -> bool {
    mc.owner_references().iter().any(|o| {
        o.kind == "Cluster" && o.api_version.starts_with("cluster.x-k8s.io/") && o.name == cluster
    })
}

/// What the failure domains depend on of a host: where it is and its labels (hashed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLabels {
    namespace: String,
    name: String,
    labels: u64,
}

/// The view of a host [`host_label_changes`] follows (`SharedStore::subscribe_events`).
pub fn host_labels(host: &MetalHost) -> HostLabels {
    HostLabels {
        namespace: host.namespace().unwrap_or_default(),
        name: host.name_any(),
        labels: crate::stable_hash::stable_hash(&host.metadata.labels),
    }
}

/// The namespaces whose failure domains a host event may change: a host new, deleted, or with
/// other labels. Each host changes about ten times per provisioning (claims, power, status);
/// each of those read every host of the namespace again, which at 10,000 hosts kept a core busy.
/// A re-list's objects reach the store only at its end, so what it changed is passed on then,
/// with the namespaces of hosts deleted while the watch was down (missing from the list).
fn host_label_changes(
    events: impl futures::Stream<Item = watcher::Event<HostLabels>> + Send,
) -> impl futures::Stream<Item = String> + Send {
    /// A re-list in progress: the hosts it listed, and the namespaces it changed so far.
    #[derive(Default)]
    struct Relist {
        listed: std::collections::HashSet<(String, String)>,
        changed: BTreeSet<String>,
    }
    let mut labels_of: HashMap<(String, String), u64> = HashMap::new();
    let mut relist: Option<Relist> = None;
    events.flat_map(move |event| {
        let mut changed = Vec::new();
        match event {
            watcher::Event::Apply(h) => {
                let place = (h.namespace, h.name);
                if labels_of.insert(place.clone(), h.labels) != Some(h.labels) {
                    changed.push(place.0);
                }
            }
            watcher::Event::InitApply(h) => {
                let place = (h.namespace, h.name);
                let relist = relist.get_or_insert_with(Relist::default);
                relist.listed.insert(place.clone());
                if labels_of.insert(place.clone(), h.labels) != Some(h.labels) {
                    relist.changed.insert(place.0);
                }
            }
            watcher::Event::Delete(h) => {
                labels_of.remove(&(h.namespace.clone(), h.name));
                changed.push(h.namespace);
            }
            watcher::Event::Init => relist = Some(Relist::default()),
            watcher::Event::InitDone => {
                let Relist {
                    listed,
                    changed: mut namespaces,
                } = relist.take().unwrap_or_default();
                labels_of.retain(|(namespace, name), _| {
                    let kept = listed.contains(&(namespace.clone(), name.clone()));
                    if !kept {
                        namespaces.insert(namespace.clone());
                    }
                    kept
                });
                changed.extend(namespaces);
            }
        }
        futures::stream::iter(changed)
    })
}

/// `clusters` is the manager's shared Cluster stream: a Cluster change (un-pause after
/// `clusterctl move`, a new owner) re-evaluates its MetalCluster at once, not at the resync.
/// `host_events` are the shared host store's events through [`host_labels`].
pub fn controller(
    client: kube::Client,
    namespace: Option<&str>,
    clusters_changes: crate::stores::Changes<DeserializeGuard<Cluster>>,
    host_events: futures::stream::BoxStream<'static, watcher::Event<HostLabels>>,
) -> Controller<MetalCluster> {
    let clusters: Api<MetalCluster> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let controller = crate::stores::lean_controller(clusters, watcher::Config::default());
    let store = controller.store();
    let by_cluster = store.clone();
    let in_namespace = host_label_changes(host_events).flat_map(move |namespace| {
        let refs: Vec<ObjectRef<MetalCluster>> = store
            .state()
            .into_iter()
            .filter(|c| c.namespace().as_deref() == Some(namespace.as_str()))
            .map(|c| ObjectRef::from_obj(c.as_ref()))
            .collect();
        futures::stream::iter(refs)
    });
    controller
        .reconcile_on(in_namespace)
        .watches_shared_stream(clusters_changes, move |cluster| {
            let namespace = cluster.meta().namespace.clone();
            let name = cluster.meta().name.clone().unwrap_or_default();
            by_cluster
                .state()
                .into_iter()
                .filter(|c| c.namespace() == namespace && owned_by_cluster(c, &name))
                .map(|c| ObjectRef::from_obj(c.as_ref()))
                .collect::<Vec<_>>()
        })
}

pub async fn run(controller: Controller<MetalCluster>, ctx: Arc<ClusterContext>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "MetalCluster controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::common::ApiEndpoint;
    use crate::api::metalcluster::MetalClusterSpec;

    /// Only what can change the failure domains reaches the clusters: a new host, a label
    /// change, a deletion; not the status and claim changes in between. Each host has a
    /// namespace of its own here, so the namespaces passed on say which events got through.
    #[tokio::test]
    async fn only_new_relabelled_or_deleted_hosts_wake_the_clusters() {
        use watcher::Event;
        let seen = |name: &str, zone: &str, power: &str| {
            let mut h: MetalHost = serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalHost",
                "metadata": {"name": name, "namespace": format!("n{name}"),
                             "labels": {"zone": zone}},
                "spec": {"bmc": {"address": "redfish://x", "credentialsName": "c"},
                         "bootMACAddress": "52:54:00:00:00:01"},
            }))
            .expect("a MetalHost");
            h.metadata.annotations = Some([("power".to_string(), power.to_string())].into());
            host_labels(&h)
        };
        let events = vec![
            Event::Init,
            Event::InitApply(seen("a", "z1", "off")),
            Event::InitDone,
            Event::Apply(seen("a", "z1", "on")),
            Event::Apply(seen("b", "z1", "off")),
            Event::Apply(seen("a", "z2", "on")),
            Event::Apply(seen("a", "z2", "off")),
            Event::Delete(seen("b", "z1", "off")),
            // The watch restarts; host `a` was deleted meanwhile, `c` is new.
            Event::Init,
            Event::InitApply(seen("c", "z3", "off")),
            Event::InitDone,
        ];
        let passed: Vec<String> = host_label_changes(futures::stream::iter(events))
            .collect()
            .await;
        // A list's changes come at its end, when the store holds them.
        assert_eq!(passed, ["na", "nb", "na", "nb", "na", "nc"]);
    }

    fn cluster(host: &str, port: i32) -> MetalCluster {
        let mut mc = MetalCluster::new(
            "c",
            MetalClusterSpec {
                control_plane_endpoint: ApiEndpoint {
                    host: host.into(),
                    port,
                },
                failure_domain_label: None,
            },
        );
        mc.metadata.namespace = Some("ns".into());
        mc
    }

    fn host(ns: &str, fd: Option<&str>) -> Arc<MetalHost> {
        let mut h: MetalHost = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "h", "namespace": ns},
            "spec": {"bmc": {"address": "redfish://x", "credentialsName": "c"},
                         "bootMACAddress": "52:54:00:00:00:01"},
        }))
        .expect("a MetalHost");
        h.metadata.labels =
            fd.map(|fd| [(DEFAULT_FAILURE_DOMAIN_LABEL.to_string(), fd.to_string())].into());
        Arc::new(h)
    }

    #[test]
    fn readiness_follows_the_endpoint_and_never_goes_back() {
        let now = conditions::now();
        let missing = desired_status(&cluster("", 0), &[], false, &now);
        assert!(!missing.ready);
        assert_eq!(
            conditions::get(&missing.conditions, "Ready").map(|c| c.reason.as_str()),
            Some("ControlPlaneEndpointMissing")
        );
        let ready = desired_status(&cluster("10.0.0.10", 6443), &[], false, &now);
        assert!(
            ready.ready && ready.initialization.as_ref().and_then(|i| i.provisioned) == Some(true)
        );
        let mut emptied = cluster("", 0);
        emptied.status = Some(ready);
        assert!(
            desired_status(&emptied, &[], false, &now).ready,
            "provisioned never goes back"
        );
    }

    #[test]
    fn failure_domains_are_the_distinct_host_labels_of_the_namespace() {
        let hosts = vec![
            host("ns", Some("rack-b")),
            host("ns", Some("rack-a")),
            host("ns", Some("rack-b")),
            host("ns", None),
            host("other", Some("rack-z")),
        ];
        let status = desired_status(
            &cluster("10.0.0.10", 6443),
            &hosts,
            false,
            &conditions::now(),
        );
        let names: Vec<&str> = status
            .failure_domains
            .iter()
            .map(|d| d.name.as_str())
            .collect();
        assert_eq!(names, vec!["rack-a", "rack-b"]);
    }

    #[test]
    fn paused_clusters_only_get_the_paused_condition() {
        let status = desired_status(&cluster("10.0.0.10", 6443), &[], true, &conditions::now());
        assert!(conditions::is_true(&status.conditions, "Paused"));
        assert!(!status.ready);
    }
}

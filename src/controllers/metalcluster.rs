//! MetalCluster controller: bare metal has no cloud load balancer, so the infrastructure cluster
//! is ready once the operator's control-plane endpoint is valid; its failure domains are the
//! distinct values of the failure-domain label on the namespace's MetalHosts.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
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
    hosts: &[Arc<PartialObjectMeta<MetalHost>>],
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
    /// The hosts' metadata (labels name the failure domains), from the watch that wakes this
    /// controller on a label change: a pass it wakes reads what woke it.
    pub hosts: Store<PartialObjectMeta<MetalHost>>,
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
    if Some(&status) != mc.status.as_ref() {
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

/// The hosts' watch, passing on a host only when it is new, deleted, or its labels changed. Each
/// host changes about ten times per provisioning (claims, power, status); each of those read every
/// host of the namespace again for the failure domains, which at 10,000 hosts kept a core busy.
/// A host deleted while the watch was down is missing from the re-list that follows: it is passed
/// on at the list's end as a stand-in naming only its namespace.
fn host_label_changes(
    events: impl futures::Stream<
        Item = Result<watcher::Event<PartialObjectMeta<MetalHost>>, watcher::Error>,
    > + Send,
) -> impl futures::Stream<Item = Result<PartialObjectMeta<MetalHost>, watcher::Error>> + Send {
    use kube::core::PartialObjectMetaExt;
    use std::hash::{Hash, Hasher};
    let mut labels_of: HashMap<(String, String), u64> = HashMap::new();
    let mut listed: Option<std::collections::HashSet<(String, String)>> = None;
    let place =
        |h: &PartialObjectMeta<MetalHost>| (h.namespace().unwrap_or_default(), h.name_any());
    events.flat_map(move |event| {
        let mut changed = Vec::new();
        match event {
            Err(e) => changed.push(Err(e)),
            Ok(watcher::Event::Apply(h) | watcher::Event::InitApply(h)) => {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                h.metadata.labels.hash(&mut hasher);
                let labels = hasher.finish();
                if let Some(listed) = &mut listed {
                    listed.insert(place(&h));
                }
                if labels_of.insert(place(&h), labels) != Some(labels) {
                    changed.push(Ok(h));
                }
            }
            Ok(watcher::Event::Delete(h)) => {
                labels_of.remove(&place(&h));
                changed.push(Ok(h));
            }
            Ok(watcher::Event::Init) => listed = Some(Default::default()),
            Ok(watcher::Event::InitDone) => {
                let listed = listed.take().unwrap_or_default();
                let mut gone_from: BTreeSet<String> = BTreeSet::new();
                labels_of.retain(|(namespace, name), _| {
                    let kept = listed.contains(&(namespace.clone(), name.clone()));
                    if !kept {
                        gone_from.insert(namespace.clone());
                    }
                    kept
                });
                changed.extend(gone_from.into_iter().map(|namespace| {
                    Ok(kube::api::ObjectMeta {
                        namespace: Some(namespace),
                        ..Default::default()
                    }
                    .into_request_partial::<MetalHost>())
                }));
            }
        }
        futures::stream::iter(changed)
    })
}

/// `clusters` is the manager's shared Cluster stream: a Cluster change (un-pause after
/// `clusterctl move`, a new owner) re-evaluates its MetalCluster at once, not at the resync.
/// Returns the controller and the store of host metadata its passes read.
pub fn controller(
    client: kube::Client,
    namespace: Option<&str>,
    clusters_changes: crate::stores::Changes<DeserializeGuard<Cluster>>,
) -> (
    Controller<MetalCluster>,
    Store<PartialObjectMeta<MetalHost>>,
) {
    let (clusters, hosts): (Api<MetalCluster>, Api<PartialObjectMeta<MetalHost>>) = match namespace
    {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let controller = crate::stores::lean_controller(clusters, watcher::Config::default());
    let store = controller.store();
    // Host labels define the failure domains: a new or deleted host, or a change of a host's
    // labels, re-evaluates its namespace's clusters. Only the hosts' metadata is watched, into
    // a store of its own that is written before the change wakes anyone.
    let by_cluster = store.clone();
    let (host_meta, writer) = kube::runtime::reflector::store();
    let host_changes = host_label_changes(kube::runtime::reflector(
        writer,
        crate::stores::lean(watcher(hosts, watcher::Config::default())).default_backoff(),
    ));
    let controller = controller
        .watches_stream(host_changes, move |host| {
            let namespace = host.namespace();
            store
                .state()
                .into_iter()
                .filter(|c| c.namespace() == namespace)
                .map(|c| ObjectRef::from_obj(c.as_ref()))
                .collect::<Vec<_>>()
        })
        .watches_shared_stream(clusters_changes, move |cluster| {
            let namespace = cluster.meta().namespace.clone();
            let name = cluster.meta().name.clone().unwrap_or_default();
            by_cluster
                .state()
                .into_iter()
                .filter(|c| c.namespace() == namespace && owned_by_cluster(c, &name))
                .map(|c| ObjectRef::from_obj(c.as_ref()))
                .collect::<Vec<_>>()
        });
    (controller, host_meta)
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
    /// change, a deletion; not the status and claim changes in between.
    #[tokio::test]
    async fn only_new_relabelled_or_deleted_hosts_wake_the_clusters() {
        use watcher::Event;
        let meta = |name: &str, zone: &str, version: &str| {
            let h: PartialObjectMeta<MetalHost> = serde_json::from_value(serde_json::json!({
                "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
                "metadata": {"name": name, "namespace": "ns", "resourceVersion": version,
                             "labels": {"zone": zone}},
            }))
            .expect("metadata");
            h
        };
        let events = vec![
            Ok(Event::Init),
            Ok(Event::InitApply(meta("a", "z1", "1"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(meta("a", "z1", "2"))),
            Ok(Event::Apply(meta("b", "z1", "3"))),
            Ok(Event::Apply(meta("a", "z2", "4"))),
            Ok(Event::Apply(meta("a", "z2", "5"))),
            Ok(Event::Delete(meta("b", "z1", "6"))),
            // The watch restarts; host `a` was deleted meanwhile, `c` is new.
            Ok(Event::Init),
            Ok(Event::InitApply(meta("c", "z3", "7"))),
            Ok(Event::InitDone),
        ];
        let passed: Vec<String> = host_label_changes(futures::stream::iter(events))
            .map(|h| {
                h.map(|h| match h.resource_version() {
                    Some(version) => version,
                    None => format!("{}: gone", h.namespace().unwrap_or_default()),
                })
            })
            .filter_map(|r| async move { r.ok() })
            .collect()
            .await;
        assert_eq!(passed, ["1", "3", "4", "6", "7", "ns: gone"]);
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

    fn host(ns: &str, fd: Option<&str>) -> Arc<PartialObjectMeta<MetalHost>> {
        use kube::core::PartialObjectMetaExt;
        Arc::new(
            kube::api::ObjectMeta {
                name: Some("h".into()),
                namespace: Some(ns.into()),
                labels: fd
                    .map(|fd| [(DEFAULT_FAILURE_DOMAIN_LABEL.to_string(), fd.to_string())].into()),
                ..Default::default()
            }
            .into_request_partial(),
        )
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

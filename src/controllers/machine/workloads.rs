//! One client and one Node watch per workload cluster, shared by its Machines. A rotated
//! kubeconfig replaces the entry and stops the old watch. A deleted Cluster's entry goes with it,
//! and no later pass of its Machines brings it back ([`Workloads::follow_clusters`]): its watch
//! would otherwise retry a gone apiserver for as long as the manager runs.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{NodeCondition, NodeSystemInfo, Secret, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use tokio::task::JoinHandle;

use crate::stores::Departure;

/// The cache key of a Cluster's workload: `namespace/name`.
fn workload_key(namespace: &str, cluster: &str) -> String {
    format!("{namespace}/{cluster}")
}

fn cluster_key(meta: &ObjectMeta) -> String {
    workload_key(
        meta.namespace.as_deref().unwrap_or_default(),
        meta.name.as_deref().unwrap_or_default(),
    )
}

/// Whether the followed Cluster store says a Cluster (by workload key) is gone: false while no
/// store is followed or it has not listed yet.
type ClusterGone = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// Why the workload cluster cannot be read: a condition reason and message.
pub type Unavailable = (&'static str, String);

/// A cluster's turn to read its kubeconfig, with the last read's failure and when it came.
type ReadSlot = Arc<tokio::sync::Mutex<Option<(Instant, Unavailable)>>>;

struct Workload {
    /// The kubeconfig Secret's resourceVersion this entry was built from.
    version: String,
    /// When that version was last read from the apiserver.
    checked: Instant,
    client: kube::Client,
    nodes: NodesByProviderId,
    /// The Node store behind `nodes`: until its first list, no Node is "missing".
    store: reflector::Store<WorkloadNode>,
    /// Until when passes wait for that first list; after it, they say the cluster is
    /// unreachable at once (a cluster that never lists must not hold every pass 10 s).
    list_deadline: Instant,
    watch: JoinHandle<()>,
}

/// What a pass takes from a cached [`Workload`], outside the cache's lock.
struct Handles {
    client: kube::Client,
    nodes: NodesByProviderId,
    store: reflector::Store<WorkloadNode>,
    list_deadline: Instant,
}

impl Workload {
    fn handles(&self) -> Handles {
        Handles {
            client: self.client.clone(),
            nodes: self.nodes.clone(),
            store: self.store.clone(),
            list_deadline: self.list_deadline,
        }
    }
}

impl Handles {
    /// The client and Nodes, once the Nodes have listed (see [`listed`]).
    async fn listed(self, cluster: &str) -> Result<(kube::Client, NodesByProviderId), Unavailable> {
        listed(&self.store, self.list_deadline, cluster).await?;
        Ok((self.client, self.nodes))
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// A workload cluster's Node as a Machine's pass reads it (`observe::node_view`,
/// `observe::node_sync_patch`): metadata, spec (providerID, taints), and of the status the
/// conditions and nodeInfo. Read into this type, not `Node`: serde skips everything else as it
/// reads (a real Node's image list, volumes, addresses and resource lists), and the struct is
/// under half of `Node`'s 1,520 bytes, which were mostly empty status fields: one per host,
/// times every Node of every workload cluster.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub struct WorkloadNode {
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: Option<WorkloadNodeSpec>,
    pub status: Option<WorkloadNodeStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
pub struct WorkloadNodeSpec {
    #[serde(rename = "providerID")]
    pub provider_id: Option<String>,
    pub taints: Option<Vec<Taint>>,
}

#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadNodeStatus {
    pub conditions: Option<Vec<NodeCondition>>,
    pub node_info: Option<NodeSystemInfo>,
}

impl k8s_openapi::Resource for WorkloadNode {
    const API_VERSION: &'static str = "v1";
    const GROUP: &'static str = "";
    const KIND: &'static str = "Node";
    const VERSION: &'static str = "v1";
    const URL_PATH_SEGMENT: &'static str = "nodes";
    type Scope = k8s_openapi::ClusterResourceScope;
}

impl k8s_openapi::Metadata for WorkloadNode {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What a Machine's pass reads of its Node (`observe::node_view`, `observe::node_sync_patch`):
/// metadata (name, and of the annotations and labels only those it syncs), spec (providerID,
/// taints), and of the status the Ready condition and nodeInfo. A real Node's status is mostly
/// its image list (tens of entries with digests), volumes and resource lists, and its metadata
/// a dozen labels and annotations of the kubelet's and the CNI's: kilobytes per Node, times
/// every Node of every workload cluster.
pub fn keep_what_machines_read(node: &mut WorkloadNode) {
    use super::observe::{SYNCED_ANNOTATION_PREFIX, synced_label};
    // Collected anew, not `retain`ed: an emptied B-tree keeps its node (about 540 bytes).
    fn only(
        map: Option<BTreeMap<String, String>>,
        keep: impl Fn(&str) -> bool,
    ) -> Option<BTreeMap<String, String>> {
        let kept: BTreeMap<String, String> = map?.into_iter().filter(|(k, _)| keep(k)).collect();
        (!kept.is_empty()).then_some(kept)
    }
    let meta = &mut node.metadata;
    meta.annotations = only(meta.annotations.take(), |k| {
        k.starts_with(SYNCED_ANNOTATION_PREFIX)
    });
    meta.labels = only(meta.labels.take(), synced_label);
    if let Some(status) = node.status.as_mut() {
        status.conditions = status
            .conditions
            .take()
            .map(|cs| cs.into_iter().filter(|c| c.type_ == "Ready").collect());
    }
}

/// A workload cluster's Nodes by providerID: a Machine's pass finds its Node without comparing
/// every Node's providerID (at 10,000 Nodes, most of the standalone Machine controller's CPU).
pub type NodesByProviderId = crate::stores::Index<WorkloadNode>;

/// The key [`NodesByProviderId`] lists a Node under.
fn provider_id_of(node: &WorkloadNode) -> Vec<String> {
    node.spec
        .as_ref()
        .and_then(|s| s.provider_id.clone())
        .into_iter()
        .collect()
}

/// Called with every changed Node, so Machines wake when their Node appears or turns Ready.
pub type NodeListener = Arc<dyn Fn(&WorkloadNode) + Send + Sync>;

#[derive(Default)]
pub struct Workloads {
    clusters: Mutex<HashMap<String, Workload>>,
    listener: Option<NodeListener>,
    /// How long a kubeconfig read stands before the next use reads it again (zero: every use).
    recheck: Duration,
    /// Node watch tasks alive now: counted by the tasks themselves, so an aborted one is seen gone.
    live: Arc<AtomicUsize>,
    /// One kubeconfig read per cluster at a time: when the recheck comes due, every Machine pass
    /// of that cluster in flight (up to the controller's bound) would otherwise read it at once.
    /// At N=1,000 that was about 400 GETs of one Secret where 20 were due.
    /// The slot also keeps the last read's failure, so the passes that queued behind a read
    /// that failed take its answer instead of each asking again in turn.
    reading: Mutex<HashMap<String, ReadSlot>>,
    /// Set by [`Workloads::follow_clusters`]: a read for a Cluster the store no longer holds
    /// caches nothing, so a pass after (or during) its deletion cannot start a watch again.
    cluster_gone: std::sync::OnceLock<ClusterGone>,
}

/// Held by a watch task for as long as it runs.
struct Alive(Arc<AtomicUsize>);

impl Alive {
    fn new(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter.clone())
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Workloads {
    pub fn with_listener(listener: NodeListener) -> Self {
        Self {
            clusters: Mutex::default(),
            listener: Some(listener),
            recheck: Duration::ZERO,
            live: Arc::default(),
            reading: Mutex::default(),
            cluster_gone: std::sync::OnceLock::new(),
        }
    }

    /// Reads the kubeconfig Secret at most once per `every` per cluster, not once per Machine
    /// pass: at 1,000 Machines of one cluster those reads were ~4,000 GETs while provisioning.
    /// A rotated kubeconfig is then picked up within `every`.
    pub fn rechecking_every(mut self, every: Duration) -> Self {
        self.recheck = every;
        self
    }

    /// Node watches running now (one per workload cluster in use; tests check none leaks).
    pub fn live_watches(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Stops the watch of a cluster that is gone.
    pub fn forget(&self, namespace: &str, cluster: &str) {
        self.forget_key(&workload_key(namespace, cluster));
    }

    /// Forgets each workload whose Cluster the shared Cluster store deletes, and, when that
    /// store has listed (again), each whose Cluster it does not hold: a re-list sends no
    /// deletion for what went while the watch was down. From then on a read for a Cluster the
    /// store does not hold caches nothing. Subscribe before the store runs.
    pub fn follow_clusters<K: crate::stores::Watched>(
        self: &Arc<Self>,
        clusters: &crate::stores::SharedStore<K>,
    ) {
        let store = clusters.store.clone();
        let _ = self.cluster_gone.set(Box::new(move |key: &str| {
            let listed = futures::FutureExt::now_or_never(store.wait_until_ready())
                .is_some_and(|r| r.is_ok());
            let Some((namespace, name)) = key.split_once('/') else {
                return false;
            };
            listed
                && store
                    .get(&reflector::ObjectRef::new(name).within(namespace))
                    .is_none()
        }));
        let workloads = Arc::downgrade(self);
        let mut departures =
            clusters.subscribe_departures(|c: &K| cluster_key(kube::Resource::meta(c)));
        tokio::spawn(async move {
            while let Some(departure) = departures.next().await {
                let Some(workloads) = workloads.upgrade() else {
                    return;
                };
                match departure {
                    Departure::Deleted(key) => workloads.forget_key(&key),
                    // The store holds the new list by now: the same check a read makes.
                    Departure::Relisted => workloads.forget_gone(),
                }
            }
        });
    }

    /// Drops the workload (its watch stops). The read slot stays: passes may hold it, and the
    /// last one out removes it.
    fn forget_key(&self, key: &str) {
        if let Ok(mut map) = self.clusters.lock() {
            map.remove(key);
        }
    }

    fn cluster_gone(&self, key: &str) -> bool {
        self.cluster_gone.get().is_some_and(|gone| gone(key))
    }

    /// Drops (and so stops the watch of) every workload whose Cluster the store does not hold.
    fn forget_gone(&self) {
        if let Ok(mut map) = self.clusters.lock() {
            map.retain(|key, _| !self.cluster_gone(key));
        }
    }

    /// Workload clusters held now (`namespace/cluster`, sorted; tests check what is forgotten).
    pub fn held(&self) -> Vec<String> {
        let mut keys: Vec<String> = self
            .clusters
            .lock()
            .map(|map| map.keys().cloned().collect())
            .unwrap_or_default();
        keys.sort();
        keys
    }

    /// The workload cluster's client and Nodes, from `<cluster>-kubeconfig` (key `value`).
    pub async fn get(
        &self,
        client: &kube::Client,
        namespace: &str,
        cluster: &str,
    ) -> Result<(kube::Client, NodesByProviderId), Unavailable> {
        let cache_key = workload_key(namespace, cluster);
        if let Some(handles) = self.cached(&cache_key) {
            return handles.listed(cluster).await;
        }
        let slot = self
            .reading
            .lock()
            .ok()
            .map(|mut map| map.entry(cache_key.clone()).or_default().clone());
        let handles = match &slot {
            Some(slot) => {
                let arrived = Instant::now();
                let mut last_failure = slot.lock().await;
                match (self.cached(&cache_key), last_failure.as_ref()) {
                    // The pass that held the turn has just read it.
                    (Some(handles), _) => Ok(handles),
                    // Or failed to, since this pass came: its answer is this pass's too.
                    (None, Some((failed_at, why))) if *failed_at >= arrived => Err(why.clone()),
                    (None, _) => {
                        let read = self.read(client, namespace, cluster, &cache_key).await;
                        *last_failure =
                            read.as_ref().err().map(|why| (Instant::now(), why.clone()));
                        read
                    }
                }
            }
            None => self.read(client, namespace, cluster, &cache_key).await,
        };
        // The last pass out forgets the slot: no entry per cluster name ever looked up.
        if let (Some(slot), Ok(mut map)) = (slot, self.reading.lock())
            && Arc::strong_count(&slot) == 2
        {
            map.remove(&cache_key);
        }
        handles?.listed(cluster).await
    }

    /// The cached workload, if its kubeconfig was read within the recheck interval.
    fn cached(&self, cache_key: &str) -> Option<Handles> {
        self.clusters.lock().ok().and_then(|map| {
            map.get(cache_key)
                .filter(|w| w.checked.elapsed() < self.recheck)
                .map(Workload::handles)
        })
    }

    /// Reads the kubeconfig Secret: the cached workload when its version is unchanged, else a
    /// new client and Node watch in its place. One pass per cluster at a time (see `reading`).
    async fn read(
        &self,
        client: &kube::Client,
        namespace: &str,
        cluster: &str,
        cache_key: &str,
    ) -> Result<Handles, Unavailable> {
        let gone = || {
            (
                "ClusterNotFound",
                format!("Cluster {namespace}/{cluster} not found"),
            )
        };
        if self.cluster_gone(cache_key) {
            return Err(gone());
        }
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
        let unchanged = self.clusters.lock().ok().and_then(|mut map| {
            map.get_mut(cache_key)
                .filter(|w| w.version == version)
                .map(|w| {
                    w.checked = Instant::now();
                    w.handles()
                })
        });
        if let Some(handles) = unchanged {
            return Ok(handles);
        }
        let invalid = |m: String| ("KubeconfigInvalid", format!("Secret {secret_name}: {m}"));
        let value = secret
            .data
            .and_then(|d| d.get("value").cloned())
            .ok_or_else(|| invalid("no key `value`".into()))?;
        let text =
            String::from_utf8(value.0).map_err(|_| invalid("`value` is not UTF-8".into()))?;
        let kubeconfig =
            kube::config::Kubeconfig::from_yaml(&text).map_err(|e| invalid(e.to_string()))?;
        let workload = crate::controlplane::client_with_retries(kubeconfig, false)
            .await
            .map_err(|e| invalid(e.to_string()))?;
        // A fleet's release drains hundreds of nodes at once. Unbounded, each drain's reads,
        // cordon and evictions went to the workload apiserver together (3,000 LIST pods and
        // GET nodes at N=3,000), each on a connection of its own, while the manager's own
        // requests waited at 8 in flight; and that apiserver is the operator's production
        // cluster. They now wait for a bound of 8 of their own (fixed: the manager's
        // `--api-requests-in-flight` is for its own apiserver). The Node watch is never held.
        let workload = crate::kubeconn::gate::gated_elsewhere(
            workload,
            crate::kubeconn::gate::DEFAULT_IN_FLIGHT,
            crate::kubeconn::gate::DEFAULT_BESIDE_URGENT,
        );
        let (store, mut writer) = reflector::store();
        let nodes = NodesByProviderId::new(provider_id_of);
        let listener = self.listener.clone();
        let events = crate::stores::lean(watcher(
            Api::<WorkloadNode>::all(workload.clone()),
            watcher::Config::default(),
        ))
        .modify(keep_what_machines_read)
        .default_backoff();
        let alive = Alive::new(&self.live);
        let (index, reader) = (nodes.clone(), store.clone());
        let watch = tokio::spawn(async move {
            let _alive = alive;
            futures::pin_mut!(events);
            while let Some(event) = events.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(e) => {
                        crate::stores::log_watch_error("workload Node", &e);
                        continue;
                    }
                };
                index.apply(&mut writer, &reader, &event);
                let Some(listener) = &listener else {
                    continue;
                };
                // Woken once the index shows the Node (a re-list's Nodes at its end).
                match &event {
                    watcher::Event::Apply(node) => listener(node),
                    watcher::Event::InitDone => reader.state().iter().for_each(|n| listener(n)),
                    _ => {}
                }
            }
        });
        let entry = Workload {
            version,
            checked: Instant::now(),
            client: workload.clone(),
            nodes: nodes.clone(),
            store: store.clone(),
            list_deadline: Instant::now() + LIST_WAIT,
            watch,
        };
        let handles = entry.handles();
        // Inserting drops (and so stops) the watch of the kubeconfig this one replaces. Checked
        // under the lock the deletion's `forget` takes: the store drops the Cluster before its
        // listeners hear of it, so either the deletion comes after this insert and removes it, or
        // this check sees the Cluster gone (and dropping `entry` stops its watch).
        if let Ok(mut map) = self.clusters.lock() {
            if self.cluster_gone(cache_key) {
                return Err(gone());
            }
            map.insert(cache_key.to_string(), entry);
        }
        Ok(handles)
    }
}

/// How long passes wait for a workload cluster's first list of Nodes.
const LIST_WAIT: Duration = Duration::from_secs(10);

/// Waits, until `deadline` at most, for the Node store's first list. Every pass waits, not only
/// the one that started the watch: a pass that found the entry while the list was still under
/// way would read no Node as "the Node is missing". A store whose watch was replaced (a new
/// kubeconfig) is never filled: that is no list either.
async fn listed(
    store: &reflector::Store<WorkloadNode>,
    deadline: Instant,
    cluster: &str,
) -> Result<(), Unavailable> {
    let wait = deadline.saturating_duration_since(Instant::now());
    match tokio::time::timeout(wait, crate::stores::until_ready(store)).await {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            "WorkloadClusterUnreachable",
            format!(
                "the Node watch of the workload cluster of {cluster} was replaced; reading again"
            ),
        )),
        Err(_) => Err((
            "WorkloadClusterUnreachable",
            format!(
                "no answer from the workload cluster of {cluster} within {} s",
                LIST_WAIT.as_secs()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_node_keeps_what_a_machine_reads_and_drops_its_image_list() {
        let json = serde_json::json!({
            "metadata": {"name": "n1",
                "annotations": {"cluster.x-k8s.io/machine": "m1",
                    "flannel.alpha.coreos.com/public-ip": "10.0.0.1"},
                "labels": {"node-role.kubernetes.io/worker": "", "kubernetes.io/arch": "amd64"}},
            "spec": {"providerID": "metalboot://ns/h/u", "podCIDR": "10.244.0.0/24",
                     "taints": [{"key": "node.cluster.x-k8s.io/uninitialized", "effect": "NoSchedule"}]},
            "status": {
                "conditions": [{"type": "MemoryPressure", "status": "False"},
                    {"type": "Ready", "status": "True"}],
                "nodeInfo": {"architecture": "amd64", "bootID": "b", "containerRuntimeVersion": "c",
                    "kernelVersion": "k", "kubeProxyVersion": "", "kubeletVersion": "v1.36.3",
                    "machineID": "m", "operatingSystem": "linux", "osImage": "Debian", "systemUUID": "s"},
                "images": [{"names": ["registry.k8s.io/pause@sha256:0123"], "sizeBytes": 1}],
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
                "capacity": {"cpu": "2"}, "allocatable": {"cpu": "2"},
                "volumesInUse": ["v"]
            }
        });
        // The Node as the apiserver has it, read whole, against what the store keeps.
        let node: k8s_openapi::api::core::v1::Node =
            serde_json::from_value(json.clone()).expect("a Node");
        let mut kept: WorkloadNode = serde_json::from_value(json).expect("a WorkloadNode");
        keep_what_machines_read(&mut kept);
        let (spec, was_spec) = (
            kept.spec.clone().unwrap_or_default(),
            node.spec.clone().unwrap_or_default(),
        );
        assert_eq!(spec.provider_id, was_spec.provider_id);
        assert_eq!(spec.taints, was_spec.taints);
        let (status, was) = (
            kept.status.clone().unwrap_or_default(),
            node.status.clone().unwrap_or_default(),
        );
        assert_eq!(status.node_info, was.node_info);
        assert!(status.node_info.is_some());
        let types = |cs: Option<Vec<NodeCondition>>| {
            cs.unwrap_or_default()
                .into_iter()
                .map(|c| c.type_)
                .collect::<Vec<_>>()
        };
        assert_eq!(types(status.conditions), ["Ready"]);
        assert_eq!(types(was.conditions).len(), 2);
        let keys = |m: Option<&std::collections::BTreeMap<String, String>>| {
            m.map(|m| m.keys().cloned().collect::<Vec<_>>())
                .unwrap_or_default()
        };
        assert_eq!(
            keys(kept.metadata.annotations.as_ref()),
            ["cluster.x-k8s.io/machine"]
        );
        assert_eq!(
            keys(kept.metadata.labels.as_ref()),
            ["node-role.kubernetes.io/worker"]
        );
        assert_eq!(kept.metadata.name, node.metadata.name);
        // Nothing synced: no map at all (an emptied one would keep its allocation).
        let mut bare = kept.clone();
        bare.metadata.labels = Some([("kubernetes.io/os".to_string(), "linux".to_string())].into());
        keep_what_machines_read(&mut bare);
        assert_eq!(bare.metadata.labels, None);
        assert!(
            std::mem::size_of::<WorkloadNode>()
                < std::mem::size_of::<k8s_openapi::api::core::v1::Node>() / 2,
            "{} bytes",
            std::mem::size_of::<WorkloadNode>()
        );
    }
}

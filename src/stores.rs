//! Reflector stores shared by the controllers and the boot service: one watch per kind, many
//! readers. A controller subscribes to the store's event stream; the boot service only reads.

use std::fmt::Debug;
use std::hash::Hash;

use futures::StreamExt;
use kube::Resource;
use kube::api::Api;
use kube::runtime::reflector::{self, ReflectHandle, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;

/// Events buffered per subscriber before the reflector waits for a slow controller.
const SUBSCRIBER_BUFFER: usize = 1024;

/// A store being filled by one watch. Subscribe controllers before `run`.
pub struct SharedStore<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    pub store: Store<K>,
    writer: Writer<K>,
}

impl<K> SharedStore<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    pub fn new() -> Self {
        let (store, writer) = reflector::store_shared(SUBSCRIBER_BUFFER);
        Self { store, writer }
    }

    /// An event stream for a controller (`Controller::for_shared_stream` and friends).
    pub fn subscribe(&self) -> ReflectHandle<K> {
        match self.writer.subscribe() {
            Some(handle) => handle,
            // store_shared always makes a subscribable writer.
            None => unreachable!("shared store without subscribers"),
        }
    }

    /// Fills the store from `api` until the process ends; watch errors back off and retry.
    pub fn run(self, api: Api<K>, config: watcher::Config) -> Store<K> {
        let store = self.store.clone();
        let stream =
            reflector::reflector(self.writer, lean(watcher(api, config))).default_backoff();
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    tracing::warn!(kind = %K::kind(&()), error = %e, "watch error; retrying");
                }
            }
        });
        store
    }
}

impl<K> Default for SharedStore<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    fn default() -> Self {
        Self::new()
    }
}

/// Drops `managedFields` before objects are stored: nothing here reads them, and at thousands of
/// objects they are most of the manager's memory.
fn lean<K: Resource + Send + 'static>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send {
    use kube::runtime::WatchStreamExt;
    events.modify(|o| {
        o.meta_mut().managed_fields = None;
    })
}

/// A store nobody subscribes to (read-only users such as the boot service in tests).
pub fn watch_store<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, lean(watcher(api, config))).default_backoff();
    tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(event) = stream.next().await {
            if let Err(e) = event {
                tracing::warn!(kind = %K::kind(&()), error = %e, "watch error; retrying");
            }
        }
    });
    store
}

/// Waits for `store`'s first full list. `Store::wait_until_ready` wakes only one waiter (it sits on
/// a oneshot channel, and a controller's own applier waits on the same store), so a second waiter
/// can sleep forever; re-polling on a short timeout makes a lost wakeup cost at most that long.
pub async fn until_ready<K>(store: &Store<K>)
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    loop {
        match tokio::time::timeout(
            std::time::Duration::from_millis(250),
            store.wait_until_ready(),
        )
        .await
        {
            Ok(Ok(())) => return,
            // The writer is gone (its controller stopped): nothing will ever fill the store.
            Ok(Err(_)) => return,
            Err(_) => continue,
        }
    }
}

/// The reflectors of the manager: one watch per kind, shared by every controller and the boot
/// service. Malformed Machines and Clusters (an upstream CRD newer than our types, or a
/// permissive one) come through as `DeserializeGuard` errors instead of stalling the watch.
pub struct Reflectors {
    pub hosts: SharedStore<crate::api::MetalHost>,
    pub metal_machines: SharedStore<crate::api::MetalMachine>,
    pub machines: SharedStore<kube::core::DeserializeGuard<crate::api::Machine>>,
    pub clusters: SharedStore<kube::core::DeserializeGuard<crate::api::Cluster>>,
    pub metal_clusters: SharedStore<crate::api::MetalCluster>,
    pub boot_secrets: SharedStore<k8s_openapi::api::core::v1::Secret>,
}

impl Default for Reflectors {
    fn default() -> Self {
        Self::new()
    }
}

impl Reflectors {
    pub fn new() -> Self {
        Reflectors {
            hosts: SharedStore::new(),
            metal_machines: SharedStore::new(),
            machines: SharedStore::new(),
            clusters: SharedStore::new(),
            metal_clusters: SharedStore::new(),
            boot_secrets: SharedStore::new(),
        }
    }

    /// Readers of every store (cheap clones).
    pub fn stores(&self) -> crate::controllers::SharedStores {
        crate::controllers::SharedStores {
            hosts: self.hosts.store.clone(),
            metal_machines: self.metal_machines.store.clone(),
            machines: self.machines.store.clone(),
            clusters: self.clusters.store.clone(),
            metal_clusters: self.metal_clusters.store.clone(),
            boot_secrets: self.boot_secrets.store.clone(),
        }
    }

    /// Starts every watch (after all controllers subscribed), in `namespace` or everywhere.
    pub fn run(self, client: kube::Client, namespace: Option<&str>) {
        fn api<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
        where
            K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
            K::DynamicType: Default,
        {
            match namespace {
                Some(ns) => Api::namespaced(client.clone(), ns),
                None => Api::all(client.clone()),
            }
        }
        let all = watcher::Config::default;
        self.hosts.run(api(&client, namespace), all());
        self.metal_machines.run(api(&client, namespace), all());
        self.machines.run(api(&client, namespace), all());
        self.clusters.run(api(&client, namespace), all());
        self.metal_clusters.run(api(&client, namespace), all());
        self.boot_secrets.run(
            api(&client, namespace),
            all().labels(crate::boot::tokens::BOOT_TOKEN_LABEL),
        );
    }
}

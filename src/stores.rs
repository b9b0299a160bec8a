//! Reflector stores shared by the controllers and the boot service: one watch per kind, many
//! readers. A controller subscribes to the store's event stream; the boot service only reads.

//!
//! The changes are fanned out here rather than through kube-runtime's shared-store handles
//! (`store_shared`/`ReflectHandle`). A `ReflectHandle` passes an object reference and looks the
//! object up when the controller reads it; if the object was deleted in between, kube-runtime
//! 5.0's `poll_next` returns `Pending` without a waker, so that subscriber is never polled again,
//! its bounded buffer fills, and the whole kind's watch stops being read (the apiserver then
//! closes it "due to unresponsiveness"). Here each subscriber gets the object itself, on its own
//! unbounded channel: a controller's intake only maps events to requests, so it keeps up, and a
//! stopped controller's channel is dropped.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::Resource;
use kube::api::Api;
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::boot::tokens::StoredBootSecret;

mod index;
pub use index::{Index, KeysOf};

/// What a controller subscribed to a shared store receives: each object as a watch event applied
/// it (and every object again after each full list), as `Controller::for_shared_stream` and its
/// `watches_shared_stream`/`owns_shared_stream` take them. Deletions are not sent.
pub type Changes<K> = BoxStream<'static, Arc<K>>;

/// A kind a [`SharedStore`] can watch: what kube-runtime's watcher and store ask of it.
pub trait Watched:
    Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static
{
}

impl<K> Watched for K where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static
{
}

/// A store being filled by one watch. Subscribe controllers before `run`.
pub struct SharedStore<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    pub store: Store<K>,
    writer: Writer<K>,
    subscribers: Mutex<Vec<mpsc::UnboundedSender<Arc<K>>>>,
    listeners: Mutex<Vec<Listener<K>>>,
    index: Option<Index<K>>,
}

/// What a [`SharedStore::subscribe_departures`] subscriber hears.
#[derive(Debug, PartialEq)]
pub enum Departure<T> {
    /// The watch deleted this object, and the store no longer holds it.
    Deleted(T),
    /// The store now holds a full list: whatever it lacks is gone, deletion seen or not.
    Relisted,
}

/// A subscriber to the watch events themselves (see [`SharedStore::listen`]); false once its
/// receiver is gone.
type Listener<K> = Box<dyn FnMut(&watcher::Event<K>) -> bool + Send>;

impl<K> SharedStore<K>
where
    K: Watched,
{
    pub fn new() -> Self {
        let (store, writer) = reflector::store();
        Self {
            store,
            writer,
            subscribers: Mutex::default(),
            listeners: Mutex::default(),
            index: None,
        }
    }

    /// A store whose watch also keeps `index` (a clone of it) of its objects.
    pub fn indexed(index: Index<K>) -> Self {
        Self {
            index: Some(index),
            ..Self::new()
        }
    }

    /// A change stream for a controller (`Controller::for_shared_stream` and friends).
    pub fn subscribe(&self) -> Changes<K> {
        let (tx, rx) = mpsc::unbounded_channel();
        if let Ok(mut subscribers) = self.subscribers.lock() {
            subscribers.push(tx);
        }
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|o| (o, rx)) })
            .boxed()
    }

    /// The watch events, deletions and re-lists included, each object seen through `view` (a
    /// few fields, not a copy of the object): for a subscriber that follows what the store
    /// holds (a follower of deletions alone takes [`SharedStore::subscribe_departures`]). Each
    /// event is sent once the store has applied it; a re-list's objects (`InitApply`) reach the
    /// store only at its `InitDone`, so act on them from there.
    pub fn subscribe_events<T: Send + 'static>(
        &self,
        view: impl Fn(&K) -> T + Send + 'static,
    ) -> BoxStream<'static, watcher::Event<T>> {
        self.listen(move |event| {
            Some(match event {
                watcher::Event::Apply(o) => watcher::Event::Apply(view(o)),
                watcher::Event::Delete(o) => watcher::Event::Delete(view(o)),
                watcher::Event::Init => watcher::Event::Init,
                watcher::Event::InitApply(o) => watcher::Event::InitApply(view(o)),
                watcher::Event::InitDone => watcher::Event::InitDone,
            })
        })
    }

    /// What leaves the store, each object seen through `view` only when it does: a watch's
    /// deletion ([`Departure::Deleted`], sent once the store no longer holds it) or a full list
    /// applied ([`Departure::Relisted`]; an object deleted while the watch was down is only
    /// missing from it). For followers of deletions: [`SharedStore::subscribe_events`] would
    /// build a view of every object every change, to be thrown away.
    pub fn subscribe_departures<T: Send + 'static>(
        &self,
        view: impl Fn(&K) -> T + Send + 'static,
    ) -> BoxStream<'static, Departure<T>> {
        self.listen(move |event| match event {
            watcher::Event::Delete(o) => Some(Departure::Deleted(view(o))),
            watcher::Event::InitDone => Some(Departure::Relisted),
            _ => None,
        })
    }

    /// A listener that sends what `pick` makes of each watch event (None: nothing), once the
    /// store has applied it; it is dropped with its receiver.
    fn listen<T: Send + 'static>(
        &self,
        pick: impl Fn(&watcher::Event<K>) -> Option<T> + Send + 'static,
    ) -> BoxStream<'static, T> {
        let (tx, rx) = mpsc::unbounded_channel();
        let listener: Listener<K> = Box::new(move |event| match pick(event) {
            Some(picked) => tx.send(picked).is_ok(),
            None => !tx.is_closed(),
        });
        if let Ok(mut listeners) = self.listeners.lock() {
            listeners.push(listener);
        }
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })
            .boxed()
    }

    /// Fills the store from `api` until the process ends; watch errors back off and retry.
    /// For stores that live as long as the process (tests, benchmarks); a manager keeps the
    /// handle of [`SharedStore::start`] instead, to stop the watch with itself.
    pub fn run(self, api: Api<K>, config: watcher::Config) -> Store<K> {
        self.start(api, config).0
    }

    /// Fills the store from `api` until the returned task is aborted (dropping the handle does
    /// not stop it); watch errors back off and retry.
    pub fn start(self, api: Api<K>, config: watcher::Config) -> (Store<K>, JoinHandle<()>) {
        self.start_on(lean(watcher(api, config)).default_backoff())
    }

    /// [`SharedStore::start`], each object trimmed by `keep` before it is stored and passed on.
    pub fn start_keeping(
        self,
        api: Api<K>,
        config: watcher::Config,
        keep: impl FnMut(&mut K) + Send + 'static,
    ) -> (Store<K>, JoinHandle<()>) {
        self.start_on(lean(watcher(api, config)).modify(keep).default_backoff())
    }

    /// Fills the store from `events` (a watch) and sends the changes to the subscribers, for as
    /// long as `events` lasts.
    pub fn run_on(
        self,
        events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    ) -> Store<K> {
        self.start_on(events).0
    }

    /// [`SharedStore::run_on`], with the task's handle. Aborting the task drops the store's
    /// writer and its subscribers' senders, so their change streams end too.
    pub fn start_on(
        self,
        events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    ) -> (Store<K>, JoinHandle<()>) {
        let store = self.store.clone();
        let mut writer = self.writer;
        let mut subscribers = self.subscribers.into_inner().unwrap_or_default();
        let mut listeners = self.listeners.into_inner().unwrap_or_default();
        let index = self.index;
        let stream = events;
        let task = tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(event) => {
                        match &index {
                            Some(index) => index.apply(&mut writer, &store, &event),
                            None => writer.apply_watcher_event(&event),
                        }
                        fan_out(&store, &event, &mut subscribers);
                        listeners.retain_mut(|listen| listen(&event));
                    }
                    Err(e) => log_watch_error(K::kind(&()).as_ref(), &e),
                }
            }
        });
        (self.store, task)
    }
}

/// A watch error, said at the level it deserves. A 410 (the version the watch would resume from
/// is compacted away, or older than the apiserver's watch cache) is how watches end in normal
/// operation: the watcher lists again, and client-go's reflector logs it below warning too. It
/// was the one warning of a 10,000-host benchmark run, at start. Anything else is a warning.
pub fn log_watch_error(kind: &str, error: &watcher::Error) {
    if is_expired(error) {
        tracing::info!(kind, error = %error, "watch expired; listing again");
    } else {
        tracing::warn!(kind, error = %error, "watch error; retrying");
    }
}

fn is_expired(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchError(status) if status.code == 410)
}

/// Sends what `event` changed to every subscriber, as the store now holds it: the applied object,
/// or every object after a full list. A subscriber whose controller stopped is dropped.
fn fan_out<K>(
    store: &Store<K>,
    event: &watcher::Event<K>,
    subscribers: &mut Vec<mpsc::UnboundedSender<Arc<K>>>,
) where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let changed: Vec<Arc<K>> = match event {
        watcher::Event::Apply(obj) => store.get(&ObjectRef::from_obj(obj)).into_iter().collect(),
        watcher::Event::InitDone => store.state(),
        _ => return,
    };
    for obj in changed {
        subscribers.retain(|tx| tx.send(obj.clone()).is_ok());
    }
}

impl<K> Default for SharedStore<K>
where
    K: Watched,
{
    fn default() -> Self {
        Self::new()
    }
}

/// Drops `managedFields` before objects are stored: nothing here reads them, and at thousands of
/// objects they are most of the manager's memory. Every watch that fills a store goes through it.
/// So does `kubectl apply`'s copy of what it last applied ([`forget_last_applied`]).
pub fn lean<K: Resource + Send + 'static>(
    events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send {
    use kube::runtime::WatchStreamExt;
    events.modify(|o| {
        let meta = o.meta_mut();
        meta.managed_fields = None;
        forget_last_applied(meta);
    })
}

/// The annotation `kubectl apply` (client-side) keeps its last applied manifest in.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops `kubectl apply`'s copy of the whole manifest it last applied: the usual way an operator
/// declares MetalHosts and their Machines, and a second copy of each object's spec in every
/// store, which no reader looks at (kubectl reads it from the server). An annotation map left
/// empty goes too: each map is at least one 640-byte B-tree node.
pub fn forget_last_applied(meta: &mut kube::api::ObjectMeta) {
    if let Some(annotations) = meta.annotations.as_mut()
        && annotations.remove(LAST_APPLIED).is_some()
        && annotations.is_empty()
    {
        meta.annotations = None;
    }
}

/// `kube::runtime::reflector`, except that the store holds `keep(object)`: a few of each
/// object's fields, or nothing (None). Every event still passes on whole (a controller is woken
/// by all of them, and maps them to their owners). An object that stops being kept leaves the
/// store. For a watch whose store is read for a few of its objects, or for a few fields, while
/// the rest (one or two objects per host) would be held for nothing.
pub fn reflector_keeping<K, E>(
    mut writer: Writer<K>,
    keep: impl Fn(&K) -> Option<K> + Send + 'static,
    events: impl futures::Stream<Item = Result<watcher::Event<K>, E>>,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, E>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + Hash + Clone,
{
    use futures::TryStreamExt;
    events.inspect_ok(move |event| match event {
        watcher::Event::Apply(obj) => match keep(obj) {
            Some(kept) => writer.apply_watcher_event(&watcher::Event::Apply(kept)),
            None => writer.apply_watcher_event(&watcher::Event::Delete(obj.clone())),
        },
        watcher::Event::InitApply(obj) => {
            if let Some(kept) = keep(obj) {
                writer.apply_watcher_event(&watcher::Event::InitApply(kept));
            }
        }
        _ => writer.apply_watcher_event(event),
    })
}

/// What is kept of a Secret watched for its metadata alone: name, version and labels, the
/// annotations named in `annotations`, and the owners when `owners` (an owned-object watch maps
/// a change to its owner through them, a `reflector_keeping` filter may decide by them). Every
/// boot and bootstrap Secret passes through such a watch; their other annotations and fields
/// were 2.5 KB per Secret at N=1,000 (heaptrack).
pub fn slim_secret_meta(
    secret: &mut kube::core::PartialObjectMeta<k8s_openapi::api::core::v1::Secret>,
    annotations: &[&str],
    owners: bool,
) {
    let meta = std::mem::take(&mut secret.metadata);
    let kept_annotations: std::collections::BTreeMap<String, String> = meta
        .annotations
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| annotations.contains(&k.as_str()))
        .collect();
    secret.metadata = kube::api::ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        resource_version: meta.resource_version,
        uid: meta.uid,
        labels: meta.labels,
        annotations: (!kept_annotations.is_empty()).then_some(kept_annotations),
        owner_references: meta.owner_references.filter(|_| owners),
        ..Default::default()
    };
}

/// `Controller::new` with a lean store: the controller's own watch of its kind, `managedFields`
/// dropped (a Machine written by four field managers is 20 KB of them).
pub fn lean_controller<K>(api: Api<K>, config: watcher::Config) -> kube::runtime::Controller<K>
where
    K: Watched,
{
    lean_controller_keeping(api, config, |_| {})
}

/// `lean_controller` whose store also drops what `keep` removes from each object.
pub fn lean_controller_keeping<K>(
    api: Api<K>,
    config: watcher::Config,
    keep: impl FnMut(&mut K) + Send + 'static,
) -> kube::runtime::Controller<K>
where
    K: Watched,
{
    let (store, writer) = reflector::store();
    let changes = reflector::reflector(
        writer,
        lean(watcher(api, config)).modify(keep).default_backoff(),
    )
    .applied_objects();
    kube::runtime::Controller::for_stream(changes, store)
}

/// A store nobody subscribes to (read-only users such as the boot service in tests).
pub fn watch_store<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: Watched,
{
    SharedStore::new().run(api, config)
}

/// The watch of boot Secrets (by their label).
fn boot_secrets() -> watcher::Config {
    watcher::Config::default().labels(crate::boot::tokens::BOOT_TOKEN_LABEL)
}

/// The boot Secrets' store as the manager keeps it ([`StoredBootSecret`]: no bootstrap data), for
/// a boot service run without the manager (tests, `make bench`).
pub fn watch_boot_secrets(api: Api<StoredBootSecret>) -> Store<StoredBootSecret> {
    SharedStore::new().run(api, boot_secrets())
}

/// Waits for `store`'s first full list: true once listed, false if its writer is gone (its
/// watch stopped), when nothing will ever fill it. `Store::wait_until_ready` wakes only one
/// waiter (it sits on a oneshot channel, and a controller's own applier waits on the same
/// store), so a second waiter can sleep forever; re-polling on a short timeout makes a lost
/// wakeup cost at most that long. A store that never lists (a missing CRD, a forbidden list) is
/// said in a warning every 30 s for the whole process, not once per waiting pass.
pub async fn until_ready<K>(store: &Store<K>) -> bool
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let started = std::time::Instant::now();
    loop {
        match tokio::time::timeout(
            std::time::Duration::from_millis(250),
            store.wait_until_ready(),
        )
        .await
        {
            Ok(Ok(())) => return true,
            Ok(Err(_)) => return false,
            Err(_) => {
                if started.elapsed() > UNLISTED_WARNING_EVERY {
                    warn_unlisted(K::kind(&()).as_ref());
                }
            }
        }
    }
}

const UNLISTED_WARNING_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// One warning per `UNLISTED_WARNING_EVERY` across every waiter.
fn warn_unlisted(kind: &str) {
    static LAST: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    let Ok(mut last) = LAST.lock() else {
        return;
    };
    if last.is_some_and(|at| at.elapsed() < UNLISTED_WARNING_EVERY) {
        return;
    }
    *last = Some(std::time::Instant::now());
    tracing::warn!(
        kind,
        waited_seconds = UNLISTED_WARNING_EVERY.as_secs(),
        "passes wait for the first list of this kind's watch (see its watch errors: a missing CRD or a forbidden list?)"
    );
}

/// What the Machine store keeps: the modeled fields ([`crate::api::Machine::forget_unmodeled`]).
pub fn keep_machine(guarded: &mut kube::core::DeserializeGuard<crate::api::Machine>) {
    if let Ok(machine) = guarded.0.as_mut() {
        machine.forget_unmodeled();
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
    pub boot_secrets: SharedStore<StoredBootSecret>,
    host_index: Index<crate::api::MetalHost>,
    metal_machine_index: Index<crate::api::MetalMachine>,
}

impl Default for Reflectors {
    fn default() -> Self {
        Self::new()
    }
}

impl Reflectors {
    pub fn new() -> Self {
        let host_index = Index::new(crate::controllers::metalmachine::claim::host_index_keys);
        let metal_machine_index = Index::new(crate::controllers::metalmachine::waiting_index_keys);
        Reflectors {
            hosts: SharedStore::indexed(host_index.clone()),
            metal_machines: SharedStore::indexed(metal_machine_index.clone()),
            machines: SharedStore::new(),
            clusters: SharedStore::new(),
            metal_clusters: SharedStore::new(),
            boot_secrets: SharedStore::new(),
            host_index,
            metal_machine_index,
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
            host_index: self.host_index.clone(),
            metal_machine_index: self.metal_machine_index.clone(),
        }
    }

    /// Starts every watch (after all controllers subscribed), in `namespace` or everywhere. The
    /// watches run until their tasks are aborted (the manager does when it is dropped).
    pub fn run(self, client: kube::Client, namespace: Option<&str>) -> Vec<JoinHandle<()>> {
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
        vec![
            self.hosts.start(api(&client, namespace), all()).1,
            self.metal_machines.start(api(&client, namespace), all()).1,
            self.machines
                .start_keeping(api(&client, namespace), all(), keep_machine)
                .1,
            self.clusters.start(api(&client, namespace), all()).1,
            self.metal_clusters.start(api(&client, namespace), all()).1,
            self.boot_secrets
                .start(api(&client, namespace), boot_secrets())
                .1,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::watcher::Event;

    fn map(name: &str, version: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// An object deleted before its controller read the change must not stop the changes after
    /// it (kube-runtime 5.0's `ReflectHandle` stops there for good, and with it, once its buffer
    /// is full, the whole watch).
    #[tokio::test]
    async fn a_deleted_object_does_not_stop_later_changes() {
        let shared = SharedStore::<ConfigMap>::new();
        let mut changes = shared.subscribe();
        let mut other = shared.subscribe();
        let events = vec![
            Ok(Event::Init),
            Ok(Event::InitApply(map("a", "1"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(map("b", "2"))),
            Ok(Event::Delete(map("b", "2"))),
            Ok(Event::Apply(map("c", "3"))),
        ];
        let store = shared.run_on(futures::stream::iter(events));
        let mut seen = Vec::new();
        for _ in 0..3 {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), changes.next());
            let Ok(Some(obj)) = next.await else {
                panic!("the changes stopped after {seen:?}");
            };
            seen.push(format!(
                "{}@{}",
                obj.metadata.name.clone().unwrap_or_default(),
                obj.metadata.resource_version.clone().unwrap_or_default()
            ));
        }
        assert_eq!(seen, ["a@1", "b@2", "c@3"]);
        assert!(other.next().await.is_some(), "every subscriber gets them");
        assert!(store.get(&ObjectRef::new("b").within("ns")).is_none());
        assert!(store.get(&ObjectRef::new("c").within("ns")).is_some());
    }

    /// A departures subscriber hears each deletion once the store dropped the object, and each
    /// full list; its view is built for those only, not for every object every change.
    #[tokio::test]
    async fn departures_are_deletions_and_relists_and_nothing_else_is_viewed() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let shared = SharedStore::<ConfigMap>::new();
        let viewed = Arc::new(AtomicUsize::new(0));
        let counted = viewed.clone();
        let store = shared.store.clone();
        let mut departures = shared.subscribe_departures(move |obj: &ConfigMap| {
            counted.fetch_add(1, Ordering::SeqCst);
            let name = obj.metadata.name.clone().unwrap_or_default();
            let held = store.get(&ObjectRef::new(&name).within("ns")).is_some();
            (name, held)
        });
        let events = vec![
            Ok(Event::Init),
            Ok(Event::InitApply(map("a", "1"))),
            Ok(Event::InitApply(map("b", "2"))),
            Ok(Event::InitDone),
            Ok(Event::Apply(map("b", "3"))),
            Ok(Event::Delete(map("a", "1"))),
            Ok(Event::Apply(map("c", "4"))),
            Ok(Event::Init),
            Ok(Event::InitApply(map("c", "4"))),
            Ok(Event::InitDone),
        ];
        shared.run_on(futures::stream::iter(events));
        let mut heard = Vec::new();
        for _ in 0..3 {
            let next = tokio::time::timeout(std::time::Duration::from_secs(10), departures.next());
            let Ok(Some(departure)) = next.await else {
                panic!("the departures stopped after {heard:?}");
            };
            heard.push(departure);
        }
        assert_eq!(
            heard,
            [
                Departure::Relisted,
                Departure::Deleted(("a".to_string(), false)),
                Departure::Relisted
            ],
            "a's deletion, seen once the store no longer held a"
        );
        assert_eq!(
            viewed.load(Ordering::SeqCst),
            1,
            "only the deleted object is viewed"
        );
    }

    /// `kubectl apply`'s manifest copy is not stored; every other annotation is, and a map
    /// that held only that copy is gone, not kept empty.
    #[test]
    fn the_last_applied_manifest_is_not_stored() {
        let with = |pairs: &[(&str, &str)]| kube::api::ObjectMeta {
            annotations: Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        };
        let manifest = r#"{"apiVersion":"v1","kind":"ConfigMap"}"#;
        let mut only = with(&[(LAST_APPLIED, manifest)]);
        forget_last_applied(&mut only);
        assert_eq!(only.annotations, None);
        let mut both = with(&[(LAST_APPLIED, manifest), ("team", "metal")]);
        forget_last_applied(&mut both);
        assert_eq!(both, with(&[("team", "metal")]));
        let mut other = with(&[("team", "metal")]);
        forget_last_applied(&mut other);
        assert_eq!(other, with(&[("team", "metal")]));
    }

    /// A watch that expired is listed again, as it should be: not a warning (the one warning of a
    /// 10,000-host run). Every other watch error still is.
    #[test]
    fn only_an_expired_watch_is_below_warning() {
        let status = |code: u16| {
            watcher::Error::WatchError(Box::new(kube::core::Status {
                code,
                reason: "Expired".into(),
                ..Default::default()
            }))
        };
        assert!(is_expired(&status(410)));
        assert!(!is_expired(&status(500)));
        assert!(!is_expired(&status(403)));
        assert!(!is_expired(&watcher::Error::NoResourceVersion));
    }

    #[tokio::test]
    async fn a_keeping_reflector_stores_what_it_keeps_and_passes_every_event_on_whole() {
        use kube::ResourceExt;
        use watcher::Event;
        let kept = |name: &str, keep: bool| ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: keep.then(|| [("keep".to_string(), String::new())].into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let (store, writer) = reflector::store::<ConfigMap>();
        let events = vec![
            Event::Init,
            Event::InitApply(kept("a", true)),
            Event::InitApply(kept("b", false)),
            Event::InitDone,
            Event::Apply(kept("c", false)),
            Event::Apply(kept("d", true)),
            // a kept object that stops being accepted leaves the store
            Event::Apply(kept("a", false)),
        ];
        let passed: Vec<_> = reflector_keeping(
            writer,
            |cm: &ConfigMap| {
                cm.labels().contains_key("keep").then(|| ConfigMap {
                    metadata: kube::api::ObjectMeta {
                        name: cm.metadata.name.clone(),
                        namespace: cm.metadata.namespace.clone(),
                        ..Default::default()
                    },
                    ..Default::default()
                })
            },
            futures::stream::iter(events.into_iter().map(Ok::<_, ()>)),
        )
        .collect()
        .await;
        assert_eq!(passed.len(), 7, "every event passes on");
        assert!(
            passed
                .iter()
                .any(|e| matches!(e, Ok(Event::Apply(cm)) if cm.labels().contains_key("keep"))),
            "whole"
        );
        let mut names: Vec<String> = store.state().iter().map(|cm| cm.name_any()).collect();
        names.sort();
        assert_eq!(names, ["d"]);
        assert!(
            store.state().iter().all(|cm| cm.metadata.labels.is_none()),
            "the store holds what `keep` made of it"
        );
    }

    #[test]
    fn a_secret_watched_for_metadata_keeps_only_what_its_readers_use() {
        use crate::boot::tokens::ANN_HOST;
        use k8s_openapi::api::core::v1::Secret;
        let full: kube::core::PartialObjectMeta<Secret> =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "v1", "kind": "PartialObjectMetadata",
                "metadata": {
                    "name": "m1-boot", "namespace": "ns", "resourceVersion": "9", "uid": "u",
                    "creationTimestamp": "2026-11-27T00:00:00Z",
                    "labels": {"metalboot.io/boot-token": "true"},
                    "annotations": {"metalboot.io/host": "h1", "metalboot.io/provider-id": "p",
                                    "metalboot.io/instance-id": "i"},
                    "ownerReferences": [{"apiVersion": "v1", "kind": "K", "name": "o", "uid": "ou"}]
                }
            }))
            .expect("metadata");
        let mut for_hosts = full.clone();
        slim_secret_meta(&mut for_hosts, &[ANN_HOST], false);
        let m = &for_hosts.metadata;
        assert_eq!(
            (
                m.name.as_deref(),
                m.namespace.as_deref(),
                m.resource_version.as_deref()
            ),
            (Some("m1-boot"), Some("ns"), Some("9"))
        );
        assert_eq!(m.labels, full.metadata.labels);
        assert_eq!(
            m.annotations
                .as_ref()
                .map(|a| a.keys().cloned().collect::<Vec<_>>()),
            Some(vec![ANN_HOST.to_string()])
        );
        assert!(m.owner_references.is_none() && m.creation_timestamp.is_none());
        assert_eq!(
            crate::boot::tokens::boot_secret_host(&for_hosts.metadata),
            Some("h1")
        );

        let mut for_configs = full.clone();
        slim_secret_meta(&mut for_configs, &[], true);
        assert!(for_configs.metadata.annotations.is_none());
        assert_eq!(
            for_configs.metadata.owner_references,
            full.metadata.owner_references
        );
    }

    /// An upstream v1beta2 Machine as core Cluster API writes it in provider mode: its status
    /// repeats the v1beta1 conditions under `deprecated`, which no reader of the store models.
    fn upstream_machine() -> serde_json::Value {
        let old_condition = |kind: &str| {
            serde_json::json!({"type": kind, "status": "True",
                "lastTransitionTime": "2026-11-29T10:00:00Z", "severity": "",
                "reason": "", "message": ""})
        };
        let old_conditions = [
            "Ready",
            "BootstrapReady",
            "InfrastructureReady",
            "NodeHealthy",
            "DrainingSucceeded",
        ]
        .map(old_condition);
        serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": "w-0", "namespace": "ns", "resourceVersion": "7",
                "labels": {"cluster.x-k8s.io/cluster-name": "c"}},
            "spec": {"clusterName": "c", "version": "v1.36.3",
                "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io",
                    "kind": "KubeadmConfig", "name": "w-0"}, "dataSecretName": "w-0"},
                "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io",
                    "kind": "MetalMachine", "name": "w-0"},
                "providerID": "metalboot://ns/host-0",
                "readinessGates": [{"conditionType": "Ready"}],
                "deletion": {"nodeDrainTimeoutSeconds": 60, "someLaterField": 1}},
            "status": {"phase": "Running", "nodeRef": {"name": "host-0", "uid": "u"},
                "initialization": {"bootstrapDataSecretCreated": true,
                    "infrastructureProvisioned": true},
                "conditions": [{"type": "Ready", "status": "True", "reason": "Ready",
                    "message": "", "lastTransitionTime": "2026-11-29T10:00:00Z"}],
                "certificatesExpiryDate": "2027-11-29T10:00:00Z",
                "deprecated": {"v1beta1": {"conditions": old_conditions}}}
        })
    }

    #[test]
    fn the_machine_store_keeps_every_modeled_field_and_drops_the_rest() {
        let upstream = upstream_machine();
        let full: crate::api::Machine = serde_json::from_value(upstream).expect("a Machine");
        let mut guarded = kube::core::DeserializeGuard(Ok(full.clone()));
        keep_machine(&mut guarded);
        let Ok(kept) = guarded.0 else {
            panic!("a Machine that read whole is kept")
        };
        // Every modeled field is as it was...
        let mut expected = full.clone();
        expected.spec.extra.clear();
        expected.spec.bootstrap.extra.clear();
        if let Some(d) = expected.spec.deletion.as_mut() {
            d.extra.clear();
        }
        if let Some(s) = expected.status.as_mut() {
            s.extra.clear();
            if let Some(n) = s.node_ref.as_mut() {
                n.extra.clear();
            }
        }
        assert_eq!(
            (&kept.metadata, &kept.spec, &kept.status),
            (&expected.metadata, &expected.spec, &expected.status)
        );
        assert_eq!(
            kept.spec.provider_id.as_deref(),
            Some("metalboot://ns/host-0")
        );
        assert_eq!(kept.metadata.labels, full.metadata.labels);
        // ...and what was only there for a round trip is gone.
        let full_status = full.status.as_ref().map(|s| s.extra.len());
        assert!(
            full_status.is_some_and(|n| n >= 2),
            "the test's upstream extras were read"
        );
        let written = serde_json::to_value(&kept).expect("serializes");
        for gone in ["deprecated", "certificatesExpiryDate"] {
            assert!(
                written["status"].get(gone).is_none(),
                "{gone} kept: {written}"
            );
        }
        assert!(written["spec"].get("readinessGates").is_none());
        assert!(written["spec"]["deletion"].get("someLaterField").is_none());
        assert!(written["status"]["nodeRef"].get("uid").is_none());
    }

    #[test]
    fn a_machine_that_did_not_read_is_kept_as_its_error() {
        let mut guarded: kube::core::DeserializeGuard<crate::api::Machine> =
            serde_json::from_value(serde_json::json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                "metadata": {"name": "bad", "namespace": "ns"},
                "spec": {"clusterName": 5}
            }))
            .expect("a guard reads anything with metadata");
        keep_machine(&mut guarded);
        assert!(guarded.0.is_err());
    }
}

//! Subsets of a shared store by key (client-go's `Indexer`), kept by the watch that fills the
//! store. At 10,000 hosts, finding a machine's claimed host or the free hosts by filtering the
//! whole store on every pass was about half of the manager's CPU (perf: `memcmp` of names and
//! namespaces). kube-runtime has no indexer, so this is ours.
//!
//! The index and the store never disagree for a reader: the watch applies each event to both
//! while it holds the index's write lock, and a reader looks up under its read lock. A reader that
//! saw an object's new version in the store (an expectation met) and then asks the index gets the
//! same version from it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use kube::Resource;
use kube::runtime::reflector::{Store, store::Writer};
use kube::runtime::watcher;

/// An object's place in the store: namespace and name.
type ObjectKey = (String, String);

/// What the index keys an object under (none, one or several keys).
pub type KeysOf<K> = fn(&K) -> Vec<String>;

/// The objects listed under one key. Most keys list a single object (a host's consumer, its
/// boot MAC), and a one-entry B-tree still allocates a whole node of eleven slots (about 640
/// bytes): at 10,000 hosts, megabytes for nothing. A single object is its own key (its
/// namespace and name), not a copy of it.
enum Listed<K> {
    One(Arc<K>),
    Many(BTreeMap<ObjectKey, Arc<K>>),
}

/// Whether `held` is the object `object` names.
fn is_object<K: Resource>(held: &K, object: &ObjectKey) -> bool {
    held.meta().namespace.as_deref().unwrap_or_default() == object.0
        && held.meta().name.as_deref().unwrap_or_default() == object.1
}

impl<K: Resource> Listed<K> {
    fn insert(&mut self, object: ObjectKey, value: Arc<K>) {
        match self {
            Listed::One(held) if is_object(held.as_ref(), &object) => *held = value,
            Listed::One(..) => {
                let mut many = BTreeMap::new();
                let single = std::mem::replace(self, Listed::Many(BTreeMap::new()));
                if let Listed::One(held) = single {
                    many.insert(object_key(held.as_ref()), held);
                }
                many.insert(object, value);
                *self = Listed::Many(many);
            }
            Listed::Many(many) => {
                many.insert(object, value);
            }
        }
    }

    /// Removes `object`; true when nothing is left under the key.
    fn remove(&mut self, object: &ObjectKey) -> bool {
        match self {
            Listed::One(held) => is_object(held.as_ref(), object),
            Listed::Many(many) => {
                many.remove(object);
                match many.len() {
                    0 => true,
                    // Back to one entry: give the B-tree's node back.
                    1 => {
                        if let Some((_, held)) = std::mem::take(many).into_iter().next() {
                            *self = Listed::One(held);
                        }
                        false
                    }
                    _ => false,
                }
            }
        }
    }

    /// The objects, ordered by namespace and name.
    fn values(&self) -> Vec<Arc<K>> {
        match self {
            Listed::One(held) => vec![held.clone()],
            Listed::Many(many) => many.values().cloned().collect(),
        }
    }
}

struct Members<K> {
    /// Per index key, its objects (the same `Arc`s the store holds).
    by_key: HashMap<Arc<str>, Listed<K>>,
    /// Per object, the keys it is listed under now (to unlist it when it changes). The key
    /// strings are those of `by_key`: a key shared by 10,000 hosts (their BMC credentials
    /// Secret) is one string, not 10,000.
    keys_of_object: HashMap<ObjectKey, Box<[Arc<str>]>>,
}

impl<K> Default for Members<K> {
    fn default() -> Self {
        Members {
            by_key: HashMap::new(),
            keys_of_object: HashMap::new(),
        }
    }
}

impl<K: Resource> Members<K> {
    fn unlist(&mut self, object: &ObjectKey) {
        for key in self.keys_of_object.remove(object).unwrap_or_default() {
            if let Some(listed) = self.by_key.get_mut(&key)
                && listed.remove(object)
            {
                self.by_key.remove(&key);
            }
        }
    }

    fn list(&mut self, object: ObjectKey, value: Arc<K>, keys: Vec<String>) {
        self.unlist(&object);
        if keys.is_empty() {
            return;
        }
        let mut shared = Vec::with_capacity(keys.len());
        for key in keys {
            let key: Arc<str> = match self.by_key.get_key_value(key.as_str()) {
                Some((existing, _)) => existing.clone(),
                None => Arc::from(key),
            };
            self.by_key
                .entry(key.clone())
                .and_modify(|listed| listed.insert(object.clone(), value.clone()))
                .or_insert_with(|| Listed::One(value.clone()));
            shared.push(key);
        }
        self.keys_of_object
            .insert(object, shared.into_boxed_slice());
    }
}

/// An index over one shared store. Cheap to clone; every clone reads the same index.
pub struct Index<K> {
    keys_of: KeysOf<K>,
    members: Arc<RwLock<Members<K>>>,
}

impl<K> Clone for Index<K> {
    fn clone(&self) -> Self {
        Index {
            keys_of: self.keys_of,
            members: self.members.clone(),
        }
    }
}

fn object_key<K: Resource>(obj: &K) -> ObjectKey {
    (
        obj.meta().namespace.clone().unwrap_or_default(),
        obj.meta().name.clone().unwrap_or_default(),
    )
}

impl<K> Index<K>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    /// An empty index that lists each object under `keys_of(object)`.
    pub fn new(keys_of: KeysOf<K>) -> Self {
        Index {
            keys_of,
            members: Arc::default(),
        }
    }

    /// The objects listed under `key` now, ordered by namespace and name.
    pub fn get(&self, key: &str) -> Vec<Arc<K>> {
        let members = self.members.read().unwrap_or_else(PoisonError::into_inner);
        members
            .by_key
            .get(key)
            .map(Listed::values)
            .unwrap_or_default()
    }

    /// What `pick` makes of the objects listed under `key` (ordered by namespace and name; none
    /// when the key lists nothing), read in one look and borrowed: [`Index::get`] clones the
    /// `Arc` of every object listed, and the free hosts of a namespace are every host of a new
    /// fleet (10,000 on each claiming pass at scale). `pick` runs under the index's read lock,
    /// which holds the watch's next event back: it must be short and must not use the index.
    pub fn pick<R>(&self, key: &str, pick: impl FnOnce(&[&Arc<K>]) -> R) -> R {
        let members = self.members.read().unwrap_or_else(PoisonError::into_inner);
        let listed: Vec<&Arc<K>> = match members.by_key.get(key) {
            None => Vec::new(),
            Some(Listed::One(held)) => vec![held],
            Some(Listed::Many(many)) => many.values().collect(),
        };
        pick(&listed)
    }

    /// Applies `event` to the store (through `writer`) and to the index, as one step for readers.
    pub fn apply(&self, writer: &mut Writer<K>, store: &Store<K>, event: &watcher::Event<K>) {
        let mut members = self.members.write().unwrap_or_else(PoisonError::into_inner);
        writer.apply_watcher_event(event);
        match event {
            watcher::Event::Apply(obj) => {
                let stored = store.get(&kube::runtime::reflector::ObjectRef::from_obj(obj));
                match stored {
                    Some(stored) => {
                        let keys = (self.keys_of)(&stored);
                        members.list(object_key(obj), stored, keys);
                    }
                    None => members.unlist(&object_key(obj)),
                }
            }
            watcher::Event::Delete(obj) => members.unlist(&object_key(obj)),
            // The store swapped in the full list: so does the index.
            watcher::Event::InitDone => {
                *members = Members::default();
                self.fill(&mut members, store.state());
            }
            watcher::Event::Init | watcher::Event::InitApply(_) => {}
        }
    }

    /// Lists every object of `store` anew (a store filled without a watch, as tests do).
    pub fn rebuild(&self, store: &Store<K>) {
        let mut members = self.members.write().unwrap_or_else(PoisonError::into_inner);
        *members = Members::default();
        self.fill(&mut members, store.state());
    }

    fn fill(&self, members: &mut Members<K>, objects: Vec<Arc<K>>) {
        for obj in objects {
            let keys = (self.keys_of)(&obj);
            members.list(object_key(obj.as_ref()), obj, keys);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;
    use kube::runtime::reflector;
    use watcher::Event;

    fn map(name: &str, colour: Option<&str>) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                labels: colour.map(|c| [("colour".to_string(), c.to_string())].into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn by_colour(m: &ConfigMap) -> Vec<String> {
        m.metadata
            .labels
            .iter()
            .flat_map(|l| l.get("colour"))
            .map(|c| format!("colour/{c}"))
            .collect()
    }

    fn names(index: &Index<ConfigMap>, key: &str) -> Vec<String> {
        index
            .get(key)
            .iter()
            .map(|m| m.metadata.name.clone().unwrap_or_default())
            .collect()
    }

    /// A key listing one object holds its `Arc` and nothing else: no copy of its namespace and
    /// name (two allocations per key per object, most keys listing one object).
    #[test]
    fn a_key_of_one_object_holds_only_its_pointer() {
        assert!(
            std::mem::size_of::<Listed<ConfigMap>>() <= 32,
            "{}",
            std::mem::size_of::<Listed<ConfigMap>>()
        );
        let mut listed = Listed::One(Arc::new(map("a", None)));
        listed.insert(("ns".into(), "b".into()), Arc::new(map("b", None)));
        assert!(matches!(&listed, Listed::Many(many) if many.len() == 2));
        assert!(!listed.remove(&("ns".into(), "a".into())));
        assert!(matches!(&listed, Listed::One(held) if held.metadata.name.as_deref() == Some("b")));
        listed.insert(("ns".into(), "b".into()), Arc::new(map("b", Some("red"))));
        assert!(matches!(&listed, Listed::One(held) if held.metadata.labels.is_some()));
        assert!(listed.remove(&("ns".into(), "b".into())));
    }

    /// Each event moves an object between keys the way the store changes; a relist replaces
    /// what the index had (an object deleted while the watch was down is gone from both).
    #[test]
    fn follows_the_store_through_changes_deletes_and_relists() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let index = Index::new(by_colour);
        let events = [
            Event::Init,
            Event::InitApply(map("a", Some("red"))),
            Event::InitApply(map("b", Some("red"))),
            Event::InitApply(map("gone", Some("blue"))),
        ];
        for e in &events {
            index.apply(&mut writer, &store, e);
        }
        assert!(
            names(&index, "colour/red").is_empty(),
            "not before the list is done"
        );
        index.apply(&mut writer, &store, &Event::InitDone);
        assert_eq!(names(&index, "colour/red"), ["a", "b"]);
        assert_eq!(names(&index, "colour/blue"), ["gone"]);

        index.apply(&mut writer, &store, &Event::Apply(map("a", Some("blue"))));
        index.apply(&mut writer, &store, &Event::Apply(map("c", None)));
        assert_eq!(names(&index, "colour/red"), ["b"]);
        assert_eq!(names(&index, "colour/blue"), ["a", "gone"]);
        index.apply(&mut writer, &store, &Event::Delete(map("b", Some("red"))));
        assert!(names(&index, "colour/red").is_empty());

        for e in [
            Event::Init,
            Event::InitApply(map("a", Some("blue"))),
            Event::InitApply(map("c", Some("red"))),
            Event::InitDone,
        ] {
            index.apply(&mut writer, &store, &e);
        }
        assert_eq!(names(&index, "colour/blue"), ["a"]);
        assert_eq!(names(&index, "colour/red"), ["c"]);
        let listed = index.get("colour/red");
        let stored = store.state();
        assert!(
            stored.iter().any(|s| Arc::ptr_eq(s, &listed[0])),
            "the index hands out the store's own objects"
        );
    }

    /// A key goes from one object to several and back (its B-tree dropped again) to none, and
    /// the key string is shared between the key's entry and every object listed under it.
    #[test]
    fn a_key_goes_from_one_object_to_many_and_back() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let index = Index::new(by_colour);
        for e in [Event::Init, Event::InitDone] {
            index.apply(&mut writer, &store, &e);
        }
        let apply = |writer: &mut reflector::store::Writer<ConfigMap>, e: Event<ConfigMap>| {
            index.apply(writer, &store, &e)
        };
        apply(&mut writer, Event::Apply(map("b", Some("red"))));
        assert_eq!(names(&index, "colour/red"), ["b"]);
        apply(&mut writer, Event::Apply(map("a", Some("red"))));
        apply(&mut writer, Event::Apply(map("c", Some("red"))));
        assert_eq!(names(&index, "colour/red"), ["a", "b", "c"], "ordered");
        {
            let members = index.members.read().unwrap_or_else(PoisonError::into_inner);
            let (key, _) = members.by_key.get_key_value("colour/red").expect("listed");
            assert!(
                members
                    .keys_of_object
                    .values()
                    .all(|keys| keys.iter().all(|k| Arc::ptr_eq(k, key))),
                "one key string, shared"
            );
        }
        apply(&mut writer, Event::Delete(map("a", Some("red"))));
        apply(&mut writer, Event::Apply(map("c", Some("blue"))));
        assert_eq!(names(&index, "colour/red"), ["b"]);
        assert!(
            matches!(
                index
                    .members
                    .read()
                    .unwrap_or_else(PoisonError::into_inner)
                    .by_key
                    .get("colour/red"),
                Some(Listed::One(..))
            ),
            "back to a single entry"
        );
        apply(&mut writer, Event::Apply(map("b", Some("red"))));
        assert_eq!(
            names(&index, "colour/red"),
            ["b"],
            "a new version replaces the old"
        );
        apply(&mut writer, Event::Apply(map("b", None)));
        assert!(names(&index, "colour/red").is_empty());
        assert_eq!(names(&index, "colour/blue"), ["c"]);
        let members = index.members.read().unwrap_or_else(PoisonError::into_inner);
        assert_eq!(members.by_key.len(), 1, "an emptied key is gone");
        assert_eq!(members.keys_of_object.len(), 1);
    }

    /// `pick` sees the objects of a key in order, borrowed from the store (not copied), and
    /// nothing for a key that lists nothing.
    #[test]
    fn pick_sees_the_objects_of_a_key_in_order() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let index = Index::new(by_colour);
        let mut events = vec![Event::Init];
        events.extend(["c", "a", "b"].map(|n| Event::InitApply(map(n, Some("red")))));
        events.push(Event::InitApply(map("e", Some("blue"))));
        events.push(Event::InitDone);
        for e in &events {
            index.apply(&mut writer, &store, e);
        }
        let names = |key: &str| {
            index.pick(key, |listed| {
                listed
                    .iter()
                    .map(|m| m.metadata.name.clone().unwrap_or_default())
                    .collect::<Vec<_>>()
            })
        };
        assert_eq!(names("colour/red"), ["a", "b", "c"]);
        assert_eq!(names("colour/blue"), ["e"]);
        assert!(names("colour/green").is_empty());
        let stored = store.state();
        index.pick("colour/blue", |listed| {
            assert!(
                stored.iter().any(|s| Arc::ptr_eq(s, listed[0])),
                "the store's own"
            );
        });
    }

    #[test]
    fn rebuild_lists_a_store_filled_without_the_index() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        for e in [
            Event::Init,
            Event::InitApply(map("a", Some("red"))),
            Event::InitDone,
        ] {
            writer.apply_watcher_event(&e);
        }
        let index = Index::new(by_colour);
        assert!(index.get("colour/red").is_empty());
        index.rebuild(&store);
        assert_eq!(names(&index, "colour/red"), ["a"]);
    }
}

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
        let stream = reflector::reflector(self.writer, watcher(api, config)).default_backoff();
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

/// A store nobody subscribes to (read-only users such as the boot service in tests).
pub fn watch_store<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
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

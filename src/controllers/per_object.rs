//! What the manager remembers about each object in memory only (backoff counts, the last power
//! request, the last power reading), by object key. The janitor forgets objects that are gone;
//! without it each map grows with every object ever seen.

use std::collections::HashMap;
use std::sync::Mutex;

pub struct PerObject<V> {
    entries: Mutex<HashMap<String, V>>,
}

impl<V> Default for PerObject<V> {
    fn default() -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
        }
    }
}

impl<V: Clone> PerObject<V> {
    pub fn get(&self, key: &str) -> Option<V> {
        self.entries.lock().ok()?.get(key).cloned()
    }

    pub fn insert(&self, key: &str, value: V) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.insert(key.to_string(), value);
        }
    }

    pub fn remove(&self, key: &str) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.remove(key);
        }
    }

    /// Changes `key`'s entry (a default one when it has none) and returns what `change` returns.
    pub fn update<R>(&self, key: &str, change: impl FnOnce(&mut V) -> R) -> Option<R>
    where
        V: Default,
    {
        let mut entries = self.entries.lock().ok()?;
        Some(change(entries.entry(key.to_string()).or_default()))
    }

    /// Forgets the objects for which `keep` is false (they are gone).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|k, _| keep(k));
        }
    }

    pub fn len(&self) -> usize {
        self.entries.lock().map(|e| e.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

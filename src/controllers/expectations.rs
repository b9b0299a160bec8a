//! Read-your-writes for reflector stores. A controller that wrote an object must not decide
//! again from a store that has not seen that write yet: a stale store is how a host that had
//! already called back got power-cycled with a new token (the boot Secret deleted, the ready
//! status not yet seen). After each write the controller records the resourceVersion it
//! replaced; until the store shows another version of that object (or none, after a delete),
//! decisions about it wait. Entries expire after [`EXPECTATION_TTL`] so a lost watch event can
//! delay a controller but never stall it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an unmet expectation holds decisions back before it is dropped with a warning.
pub const EXPECTATION_TTL: Duration = Duration::from_secs(30);

/// Expectations of one controller, keyed by `Kind/namespace/name`.
#[derive(Default)]
pub struct Expectations {
    pending: Mutex<HashMap<String, (Option<String>, Instant)>>,
}

impl Expectations {
    /// The object was written: `replaced` is the resourceVersion the write replaced (None for a
    /// create), `written` the one it produced (None for a delete). A write that changed nothing
    /// (same version) sets no expectation.
    pub fn wrote(&self, key: String, replaced: Option<String>, written: Option<String>) {
        if replaced.is_some() && replaced == written {
            return;
        }
        if let Ok(mut pending) = self.pending.lock() {
            pending.insert(key, (replaced, Instant::now()));
        }
    }

    /// Whether the store's version of `key` (`seen`, None when absent) reflects our last write.
    pub fn satisfied(&self, key: &str, seen: Option<&str>) -> bool {
        let Ok(mut pending) = self.pending.lock() else {
            return true;
        };
        let Some((replaced, at)) = pending.get(key) else {
            return true;
        };
        if still_pending(key, replaced.as_deref(), *at, seen) {
            return false;
        }
        pending.remove(key);
        true
    }

    /// The first pending expectation under `prefix` (e.g. `MetalHost/<ns>/`) that the store does
    /// not reflect yet; `seen(key)` gives the store's version. Only pending entries are looked
    /// at, so this costs nothing per object in the store.
    pub fn first_unmet(
        &self,
        prefix: &str,
        seen: impl Fn(&str) -> Option<String>,
    ) -> Option<String> {
        let Ok(mut pending) = self.pending.lock() else {
            return None;
        };
        let mut unmet = None;
        pending.retain(|key, (replaced, at)| {
            if !key.starts_with(prefix) {
                return true;
            }
            // Every entry under the prefix is checked, so met ones are forgotten whatever the
            // map's order; the first unmet one found is reported.
            let pending = still_pending(key, replaced.as_deref(), *at, seen(key).as_deref());
            if pending && unmet.is_none() {
                unmet = Some(key.clone());
            }
            pending
        });
        unmet
    }

    /// Drops everything about `key` (the object is gone for good).
    /// Drops entries past their TTL that nobody asked about again (their object went away).
    pub fn expire(&self) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.retain(|_, (_, at)| at.elapsed() < EXPECTATION_TTL);
        }
    }

    pub fn forget(&self, key: &str) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.remove(key);
        }
    }

    pub fn len(&self) -> usize {
        self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether a write that replaced `replaced` at `at` is still unseen by a store showing `seen`.
fn still_pending(key: &str, replaced: Option<&str>, at: Instant, seen: Option<&str>) -> bool {
    if replaced != seen {
        return false;
    }
    if at.elapsed() >= EXPECTATION_TTL {
        tracing::warn!(
            object = key,
            "the store never showed our write; deciding without it"
        );
        return false;
    }
    true
}

/// The key of an object for expectations and logs.
pub fn object_key(kind: &str, namespace: &str, name: &str) -> String {
    format!("{kind}/{namespace}/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_waits_until_the_store_moves_past_the_old_version() {
        let e = Expectations::default();
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        assert!(!e.satisfied("S/ns/a", Some("10")), "store still shows 10");
        assert!(
            e.satisfied("S/ns/a", Some("12")),
            "any newer version will do"
        );
        assert!(
            e.satisfied("S/ns/a", Some("10")),
            "met expectations are gone"
        );
    }

    #[test]
    fn creates_and_deletes() {
        let e = Expectations::default();
        e.wrote("S/ns/new".into(), None, Some("5".into()));
        assert!(
            !e.satisfied("S/ns/new", None),
            "created, store has not seen it"
        );
        assert!(e.satisfied("S/ns/new", Some("5")));
        e.wrote("S/ns/old".into(), Some("7".into()), None);
        assert!(
            !e.satisfied("S/ns/old", Some("7")),
            "deleted, store still has it"
        );
        assert!(e.satisfied("S/ns/old", None));
        assert!(e.is_empty());
    }

    #[test]
    fn pending_writes_are_found_by_prefix_without_touching_others() {
        let e = Expectations::default();
        e.wrote("H/ns/a".into(), Some("1".into()), Some("2".into()));
        e.wrote("H/ns/b".into(), Some("5".into()), Some("6".into()));
        e.wrote("H/ns2/a".into(), Some("9".into()), Some("10".into()));
        let store = |key: &str| match key {
            "H/ns/a" => Some("2".to_string()),
            "H/ns/b" => Some("5".to_string()),
            _ => None,
        };
        assert_eq!(e.first_unmet("H/ns/", store), Some("H/ns/b".into()));
        assert!(e.satisfied("H/ns/a", Some("1")), "a was met and forgotten");
        assert!(
            !e.satisfied("H/ns2/a", Some("9")),
            "another namespace is untouched"
        );
    }

    #[test]
    fn a_write_that_changed_nothing_expects_nothing() {
        let e = Expectations::default();
        e.wrote("S/ns/a".into(), Some("3".into()), Some("3".into()));
        assert!(e.satisfied("S/ns/a", Some("3")));
        assert!(e.is_empty());
    }
}

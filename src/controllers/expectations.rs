//! Read-your-writes for reflector stores. A controller that wrote an object must not decide
//! again from a store that has not seen that write yet: a stale store is how a host that had
//! already called back got power-cycled with a new token (the boot Secret deleted, the ready
//! status not yet seen). After each write the controller records the resourceVersion it
//! replaced; until the store shows another version of that object (or none, after a delete),
//! decisions about it wait.
//!
//! Waiting has no deadline of its own. After [`EXPECTATION_TTL`] without the store moving, the
//! controller asks the apiserver once ([`store_reflects`]): if its copy is the store's, the write
//! was superseded and the wait ends; if it is newer, the store really is behind and the wait goes
//! on, asking again a TTL later. An apiserver starved for minutes (an N=1000 run sharing two
//! cores with a compiler) used to end the wait blind after 30 s, and the next decision, made from
//! a boot Secret without its callback, power-cycled 77 hosts that had already called back.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kube::api::Api;

/// How long an unmet expectation waits for the store before the apiserver is asked.
pub const EXPECTATION_TTL: Duration = Duration::from_secs(30);

/// Entries nobody asked about for this long belong to objects that went away.
const FORGET_AFTER: Duration = Duration::from_secs(600);

/// Where the store stands against our last write to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// The store shows our write, or something after it (or no write is pending).
    Met,
    /// Not yet, and the write is recent: wait without asking.
    Waiting,
    /// Not yet, for longer than the TTL: ask the apiserver which of the two is behind.
    Overdue,
}

/// How many replaced versions one pending expectation remembers (writes in a row before the
/// store catches up: a pass writes at most two).
const REPLACED_KEPT: usize = 8;

/// The versions one pass's writes can add to `replaced`: two writes (spec, then status), each
/// adding the version it replaced and our write before it.
const ANSWERED_PASS_WRITES: usize = 4;

/// How many writers whose conditioned write lost (409) one pending expectation names (machines
/// that raced for the same host; one more is dropped oldest first). Writers whose write went
/// through are never dropped: evicting a claim's own machine would let it decide from a store
/// without its claim, and claim a second host.
const LOSERS_KEPT: usize = 4;

/// How a writer's write to an object went.
#[derive(Clone, Copy)]
enum Role {
    /// Applied, or perhaps applied (its answer was lost).
    Wrote,
    /// Refused 409.
    Lost,
}

struct Pending<A> {
    /// The resourceVersions our writes replaced since the store last caught up (None for a
    /// create), oldest first. All of them, not just the last: a pass that writes twice (status,
    /// then a finalizer) leaves a store that may still show the version before the first write,
    /// and that version must not pass for one after our writes.
    replaced: Vec<Option<String>>,
    /// The resourceVersion our last write produced. When another write follows before the
    /// store caught up, it joins `replaced`: a pass that writes the spec and then the status
    /// sends the status write with the version it read, yet the spec write's version is older
    /// than the status write's too.
    written: Option<String>,
    /// When the apiserver is to be asked: a TTL after the write, or after its last answer that
    /// the store was behind.
    due: Instant,
    /// Whether a lag past the TTL was already reported for this write.
    reported: bool,
    /// On whose behalf the writes were made (e.g. `MetalMachine/<ns>/<name>` for a host it
    /// claimed), so a pass waits only for the writes that concern its object. Conditioned
    /// writes to one object go through one at a time, so this stays short.
    writers: Vec<String>,
    /// On whose behalf writes were answered 409 (at most `LOSERS_KEPT`).
    losers: Vec<String>,
    /// The controller's write count when this entry was last recorded: an answer the apiserver
    /// gave to a question asked before then says nothing about the later write.
    recorded: u64,
    /// The apiserver's answer to the write that produced `written`, when the writer kept it
    /// ([`Expectations::answered`]); dropped with the entry once the store shows the write, by
    /// the next write that comes without one, and once the wait is overdue.
    answer: Option<Kept<A>>,
}

/// How many answers one controller holds at most (2 to 4 KiB each for a MetalMachine). Past it,
/// a write's answer is not kept and the next pass waits for the store, as without answers: at
/// N=10,000 a queue of passes tens of seconds long would otherwise hold one per machine.
const ANSWERS_KEPT: usize = 1024;

/// An answer, counted in its controller's [`Expectations::answers_held`] for as long as it lives:
/// however its entry goes (met, swept, forgotten, replaced by a later write), the count follows.
struct Kept<A> {
    answer: Arc<A>,
    held: Arc<AtomicUsize>,
}

impl<A> Drop for Kept<A> {
    fn drop(&mut self) {
        self.held.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Expectations of one controller, keyed by `Kind/namespace/name`. `A` is what the controller
/// keeps of the answers to its writes (see [`Expectations::ahead_of_store`]); most keep none.
pub struct Expectations<A = ()> {
    /// Ordered by key, so a pass looks only at the keys under its prefix (one kind in one
    /// namespace), not at every write the controller has pending.
    pending: Mutex<BTreeMap<String, Pending<A>>>,
    ttl: Duration,
    /// The size at which the next write sweeps out old entries first.
    sweep_at: AtomicUsize,
    /// Writes recorded so far (see `Pending::recorded`).
    records: AtomicU64,
    /// Answers held now (at most [`ANSWERS_KEPT`]).
    answers_held: Arc<AtomicUsize>,
}

/// The smallest map a write-time sweep waits for.
const SWEEP_AT_LEAST: usize = 1024;

impl<A> Default for Expectations<A> {
    fn default() -> Self {
        Expectations::with_ttl(EXPECTATION_TTL)
    }
}

impl<A> Expectations<A> {
    /// Expectations that ask the apiserver after `ttl` (tests use zero: every wait is overdue).
    pub fn with_ttl(ttl: Duration) -> Self {
        Expectations {
            pending: Mutex::default(),
            ttl,
            sweep_at: AtomicUsize::new(SWEEP_AT_LEAST),
            records: AtomicU64::new(0),
            answers_held: Arc::default(),
        }
    }

    /// The object was written: `replaced` is the resourceVersion the write replaced (None for a
    /// create), `written` the one it produced (None for a delete). A write that changed nothing
    /// (same version) sets no expectation.
    pub fn wrote(&self, key: String, replaced: Option<String>, written: Option<String>) {
        self.wrote_as(key, replaced, written, None);
    }

    /// [`Expectations::wrote`] on behalf of `writer` (the object whose decision made the write).
    pub fn wrote_for(
        &self,
        key: String,
        replaced: Option<String>,
        written: Option<String>,
        writer: &str,
    ) {
        self.wrote_as(key, replaced, written, Some(writer));
    }

    fn wrote_as(
        &self,
        key: String,
        replaced: Option<String>,
        written: Option<String>,
        writer: Option<&str>,
    ) {
        if replaced.is_some() && replaced == written {
            return;
        }
        self.record(
            key,
            replaced,
            Some(written),
            writer.map(|w| (w, Role::Wrote)),
        );
    }

    /// A write conditioned on `version` was answered 409: the store's copy at `version` is
    /// stale, and so is nothing else. Our own last written version is left as it was: it is
    /// usually the apiserver's current one (the very write the 409 lost to), and marking it
    /// stale would hold back every pass that waits for this object until it moved again.
    pub fn conflicted(&self, key: String, version: Option<String>) {
        self.record(key, version, None, None);
    }

    /// [`Expectations::conflicted`] on behalf of `writer`.
    pub fn conflicted_for(&self, key: String, version: Option<String>, writer: &str) {
        self.record(key, version, None, Some((writer, Role::Lost)));
    }

    /// A write conditioned on `version` whose answer was lost: it may have landed. As after a
    /// 409, the store's copy at `version` is stale. But `writer` is kept among the writers, never
    /// evicted as losers are (a machine whose claim may have landed must not decide from a store
    /// without it), and for everyone else the object counts as written by it
    /// ([`Expectations::written_by_others`]) until the store moves.
    pub fn uncertain_for(&self, key: String, version: Option<String>, writer: &str) {
        self.record(key, version, None, Some((writer, Role::Wrote)));
    }

    /// Adds `stale` to the versions the store must move past; with `written`, a write of ours
    /// produced that version (and the one before it, if any, becomes stale too).
    fn record(
        &self,
        key: String,
        stale: Option<String>,
        written: Option<Option<String>>,
        writer: Option<(&str, Role)>,
    ) {
        let Ok(mut pending) = self.pending.lock() else {
            return;
        };
        // Entries of objects that went away are dropped here too, so a controller without a
        // sweep of its own keeps no more than the writes of the last FORGET_AFTER.
        if pending.len() >= self.sweep_at.load(Ordering::Relaxed) {
            forget_old(&mut pending);
            self.sweep_at
                .store((pending.len() * 2).max(SWEEP_AT_LEAST), Ordering::Relaxed);
        }
        let due = self.due();
        let entry = pending.entry(key).or_insert_with(|| Pending {
            replaced: Vec::new(),
            written: None,
            due,
            reported: false,
            writers: Vec::new(),
            losers: Vec::new(),
            recorded: 0,
            answer: None,
        });
        entry.recorded = self.records.fetch_add(1, Ordering::Relaxed) + 1;
        match writer {
            Some((writer, Role::Wrote)) if !entry.writers.iter().any(|w| w == writer) => {
                entry.writers.push(writer.to_string());
            }
            Some((writer, Role::Lost)) if !entry.losers.iter().any(|w| w == writer) => {
                if entry.losers.len() == LOSERS_KEPT {
                    entry.losers.remove(0);
                }
                entry.losers.push(writer.to_string());
            }
            _ => {}
        }
        let earlier = match &written {
            Some(now) => entry.written.take().filter(|w| Some(w) != now.as_ref()),
            None => None,
        };
        for older in [earlier.map(Some), Some(stale)].into_iter().flatten() {
            if !entry.replaced.contains(&older) {
                if entry.replaced.len() == REPLACED_KEPT {
                    entry.replaced.remove(0);
                }
                entry.replaced.push(older);
            }
        }
        if let Some(written) = written {
            // A write's own answer is never stale when it arrives.
            if written.is_some() {
                entry.replaced.retain(|r| *r != written);
            }
            entry.written = written;
            entry.answer = None;
        }
        entry.due = due;
        entry.reported = false;
    }

    /// Where the store's version of `key` (`seen`, None when absent) stands against our last
    /// write. A met expectation is forgotten.
    pub fn check(&self, key: &str, seen: Option<&str>) -> Seen {
        let Ok(mut pending) = self.pending.lock() else {
            return Seen::Met;
        };
        let Some(entry) = pending.get_mut(key) else {
            return Seen::Met;
        };
        let state = state_of(entry, seen);
        match state {
            Seen::Met => {
                pending.remove(key);
            }
            // Past the TTL the apiserver decides, never the answer again: whatever it says,
            // the answer is as old as the wait.
            Seen::Overdue => entry.answer = None,
            Seen::Waiting => {}
        }
        state
    }

    /// Keeps `answer`, the apiserver's reply to our write to `key` that produced `version`,
    /// for [`Expectations::ahead_of_store`]. Only while that write is still our last one: the
    /// answer lives in the write's own entry, so it goes when the store shows the write.
    /// At most [`ANSWERS_KEPT`] are held; past that, the answer is dropped.
    pub fn answered(&self, key: &str, version: Option<&str>, answer: A) {
        if let Ok(mut pending) = self.pending.lock()
            && let Some(entry) = pending.get_mut(key)
            && entry.written.is_some()
            && entry.written.as_deref() == version
        {
            // The one this replaces (if any) is counted out first.
            entry.answer = None;
            if self.answers_held.load(Ordering::Relaxed) >= ANSWERS_KEPT {
                return;
            }
            self.answers_held.fetch_add(1, Ordering::Relaxed);
            entry.answer = Some(Kept {
                answer: Arc::new(answer),
                held: self.answers_held.clone(),
            });
        }
    }

    /// Answers held now.
    pub fn answers_held(&self) -> usize {
        self.answers_held.load(Ordering::Relaxed)
    }

    /// The answer to our last write to `key`, while the store shows (`seen`) a version our
    /// writes replaced and nothing since marked that write's own version stale (a 409). The
    /// answer is then newer than the store, and as new as anything we know.
    ///
    /// Only within the TTL, and only while the chain of our writes the store has not shown
    /// leaves room for one more pass's writes: past the TTL the apiserver is asked, as for any
    /// lag; and a pass deciding from an answer writes again, so an unbounded chain would push
    /// the store's own version out of `replaced` and make that stale version pass for current.
    pub fn ahead_of_store(&self, key: &str, seen: Option<&str>) -> Option<Arc<A>> {
        let pending = self.pending.lock().ok()?;
        let entry = pending.get(key)?;
        let answer = entry.answer.as_ref()?.answer.clone();
        let superseded = entry.replaced.contains(&entry.written);
        let room = entry.replaced.len() + ANSWERED_PASS_WRITES <= REPLACED_KEPT;
        let waiting = state_of(entry, seen) == Seen::Waiting && !entry.reported;
        (waiting && room && !superseded).then_some(answer)
    }

    /// The first pending expectation under `prefix` (e.g. `MetalHost/<ns>/`) that concerns the
    /// caller and that the store does not reflect yet, with how long it has waited; `seen(key)`
    /// gives the store's version. An entry concerns the caller when `writer` made one of its
    /// writes (or lost one with a 409), or when `concerns(key)` says so (e.g. the store shows the
    /// host claimed by the caller). Only pending entries are looked at, so
    /// this costs nothing per object in the store; met ones are forgotten whoever they concern.
    /// Overdue entries are reported before waiting ones, so each gets its question to the
    /// apiserver.
    pub fn first_unmet(
        &self,
        prefix: &str,
        seen: impl Fn(&str) -> Option<String>,
        writer: &str,
        concerns: impl Fn(&str) -> bool,
    ) -> Option<(String, Seen)> {
        let Ok(mut pending) = self.pending.lock() else {
            return None;
        };
        let mut unmet: Option<(String, Seen)> = None;
        let mut met: Vec<String> = Vec::new();
        // Every entry under the prefix is checked, so met ones are forgotten.
        for (key, entry) in pending
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
        {
            let state = state_of(entry, seen(key).as_deref());
            if state == Seen::Met {
                met.push(key.clone());
                continue;
            }
            let by_caller = entry
                .writers
                .iter()
                .chain(&entry.losers)
                .any(|w| w == writer);
            if !by_caller && !concerns(key) {
                continue;
            }
            let better = match &unmet {
                None => true,
                Some((_, found)) => *found == Seen::Waiting && state == Seen::Overdue,
            };
            if better {
                unmet = Some((key.clone(), state));
            }
        }
        for key in met {
            pending.remove(&key);
        }
        unmet
    }

    /// The names under `prefix` that another writer than `writer` wrote and the store (`seen`)
    /// does not show yet. A machine choosing a free host skips the ones another machine of this
    /// process has just claimed: its claim, bound to their old version, would only be refused
    /// (409) and leave it waiting for the store. Entries of 409s alone are not counted (nobody
    /// here holds that host), and nothing is forgotten here: [`Expectations::first_unmet`] does.
    pub fn written_by_others(
        &self,
        prefix: &str,
        seen: impl Fn(&str) -> Option<String>,
        writer: &str,
    ) -> std::collections::HashSet<String> {
        let Ok(pending) = self.pending.lock() else {
            return Default::default();
        };
        pending
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .take_while(|(key, _)| key.starts_with(prefix))
            .filter(|(_, entry)| {
                !entry.writers.is_empty() && !entry.writers.iter().any(|w| w == writer)
            })
            .filter(|(key, entry)| state_of(entry, seen(key).as_deref()) != Seen::Met)
            .filter_map(|(key, _)| key.strip_prefix(prefix).map(str::to_string))
            .collect()
    }

    /// The apiserver's answer about an overdue `key`: `live` is its resourceVersion (None when
    /// the object is gone), `seen` the store's. The same version means the store is current
    /// and our write was superseded (the wait ends, true); another means the store is behind
    /// (the wait goes on for another TTL, reported once per write, false). `asked` is
    /// [`Expectations::asking`] from before the question: a write recorded since then is newer
    /// than the answer, which then ends nothing.
    pub fn confirm(&self, key: &str, seen: Option<&str>, live: Option<&str>, asked: u64) -> bool {
        let Ok(mut pending) = self.pending.lock() else {
            return true;
        };
        if pending.get(key).is_some_and(|entry| entry.recorded > asked) {
            return false;
        }
        if live == seen {
            if pending.remove(key).is_some() {
                tracing::debug!(
                    object = key,
                    "the apiserver agrees with the store; our write was superseded"
                );
                crate::metrics::record_store_lag(kind_of(key), "current");
            }
            return true;
        }
        if let Some(entry) = pending.get_mut(key) {
            entry.due = self.due();
            if !entry.reported {
                entry.reported = true;
                tracing::warn!(
                    object = key,
                    store = seen.unwrap_or("absent"),
                    apiserver = live.unwrap_or("absent"),
                    "the store is behind the apiserver past the TTL; waiting for it, not deciding from it"
                );
            }
        }
        crate::metrics::record_store_lag(kind_of(key), "behind");
        false
    }

    /// Taken before asking the apiserver about an overdue key, for [`Expectations::confirm`].
    pub fn asking(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// The apiserver could not be asked about an overdue `key`: wait another TTL.
    pub fn unconfirmed(&self, key: &str) {
        if let Ok(mut pending) = self.pending.lock()
            && let Some(entry) = pending.get_mut(key)
        {
            entry.due = self.due();
        }
        crate::metrics::record_store_lag(kind_of(key), "unknown");
    }

    /// Drops entries nobody asked about for long (their object went away).
    pub fn expire(&self) {
        if let Ok(mut pending) = self.pending.lock() {
            forget_old(&mut pending);
        }
    }

    /// The store no longer holds `key`. An expectation its absence meets (our delete, or
    /// writes before someone else's delete) is forgotten now, not by the sweep [`FORGET_AFTER`]
    /// later: about four per released Machine stayed in memory all through a fleet's release.
    /// One its absence does not meet (our create, not shown yet) stays, as
    /// [`Expectations::check`] would keep it. A pass still holding a copy from before the
    /// deletion then finds its check met, so it must not decide from that copy: the
    /// MetalMachine controller reads the store again after the check (`metalmachine::observe`)
    /// and ends a pass whose object left the store while it waited for its turn.
    ///
    /// `absent` asks the store whether it still holds no object under that name, while no write
    /// can be recorded: a deletion reported late, after a namesake was created and written to,
    /// must not forget the namesake's expectations while the store shows its older version.
    pub fn gone(&self, key: &str, absent: impl FnOnce() -> bool) {
        if let Ok(mut pending) = self.pending.lock()
            && pending
                .get(key)
                .is_some_and(|entry| state_of(entry, None) == Seen::Met)
            && absent()
        {
            pending.remove(key);
        }
    }

    /// Drops everything about `key` (the object is gone for good).
    pub fn forget(&self, key: &str) {
        if let Ok(mut pending) = self.pending.lock() {
            pending.remove(key);
        }
    }

    fn due(&self) -> Instant {
        let now = Instant::now();
        now.checked_add(self.ttl).unwrap_or(now)
    }

    pub fn len(&self) -> usize {
        self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Drops entries nobody asked about for FORGET_AFTER (their object went away).
fn forget_old<A>(pending: &mut BTreeMap<String, Pending<A>>) {
    let now = Instant::now();
    pending.retain(|_, entry| {
        entry
            .due
            .checked_add(FORGET_AFTER)
            .is_none_or(|forget_at| now < forget_at)
    });
}

/// Whether a pending write is shown by a store showing `seen`.
fn state_of<A>(entry: &Pending<A>, seen: Option<&str>) -> Seen {
    if !entry.replaced.iter().any(|r| r.as_deref() == seen) {
        Seen::Met
    } else if Instant::now() >= entry.due {
        Seen::Overdue
    } else {
        Seen::Waiting
    }
}

/// The kind in an [`object_key`].
pub fn kind_of(key: &str) -> &str {
    key.split('/').next().unwrap_or_default()
}

/// Whether the store's `seen` version of `name` (under `key`) reflects our last write. Within
/// the TTL this only looks at the expectation; past it, it asks the apiserver for the object's
/// metadata (one GET per object per TTL) and keeps waiting while the apiserver is ahead.
pub async fn store_reflects<K, A>(
    expectations: &Expectations<A>,
    api: &Api<K>,
    key: &str,
    name: &str,
    seen: Option<&str>,
) -> bool
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match expectations.check(key, seen) {
        Seen::Met => true,
        Seen::Waiting => false,
        Seen::Overdue => {
            let asked = expectations.asking();
            match api.get_metadata_opt(name).await {
                Ok(live) => {
                    let live = live.and_then(|m| m.metadata.resource_version);
                    expectations.confirm(key, seen, live.as_deref(), asked)
                }
                Err(e) => {
                    tracing::debug!(object = key, error = %e, "could not ask the apiserver about a lagging store");
                    expectations.unconfirmed(key);
                    false
                }
            }
        }
    }
}

/// The key of an object for expectations and logs.
pub fn object_key(kind: &str, namespace: &str, name: &str) -> String {
    format!("{kind}/{namespace}/{name}")
}

/// Hands `gone` the key ([`object_key`]) of each object `shared`'s watch deletes, after the
/// store applied the deletion, with a question for [`Expectations::gone`]: whether the store
/// still holds no object of that name (a namesake may have been created since). Subscribe
/// before the store runs. An object deleted while the watch was down (seen only as missing from
/// the next list) is not reported; the sweep [`FORGET_AFTER`] later still drops its entries.
pub fn follow_deletions<K: crate::stores::Watched>(
    shared: &crate::stores::SharedStore<K>,
    gone: impl Fn(&str, &dyn Fn() -> bool) + Send + 'static,
) {
    use futures::StreamExt;
    use kube::ResourceExt;
    use kube::runtime::reflector::ObjectRef;
    let kind = K::kind(&()).into_owned();
    let mut departures = shared.subscribe_departures(move |obj: &K| {
        let key = object_key(&kind, &obj.namespace().unwrap_or_default(), &obj.name_any());
        (key, ObjectRef::from_obj(obj))
    });
    let store = shared.store.clone();
    tokio::spawn(async move {
        while let Some(departure) = departures.next().await {
            if let crate::stores::Departure::Deleted((key, object)) = departure {
                gone(&key, &|| store.get(&object).is_none());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn met(e: &Expectations, key: &str, seen: Option<&str>) -> bool {
        e.check(key, seen) == Seen::Met
    }

    #[test]
    fn an_update_waits_until_the_store_moves_past_the_old_version() {
        let e = Expectations::<()>::default();
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        assert_eq!(
            e.check("S/ns/a", Some("10")),
            Seen::Waiting,
            "store still shows 10"
        );
        assert!(met(&e, "S/ns/a", Some("12")), "any newer version will do");
        assert!(met(&e, "S/ns/a", Some("10")), "met expectations are gone");
    }

    /// A pass that writes twice (status, then the finalizer): a store still at the version
    /// before the first write is as stale as one at the version before the second.
    #[test]
    fn two_writes_in_a_row_wait_for_the_last_from_either_old_version() {
        let e = Expectations::<()>::default();
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        e.wrote("S/ns/a".into(), Some("11".into()), Some("12".into()));
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Waiting, "before both");
        assert_eq!(
            e.check("S/ns/a", Some("11")),
            Seen::Waiting,
            "before the last"
        );
        assert!(met(&e, "S/ns/a", Some("12")));
        assert!(e.is_empty());
        // A 409 marks only the version the write was conditioned on: our own last write (the
        // one it lost to) stays current.
        e.wrote("S/ns/d".into(), Some("40".into()), Some("41".into()));
        e.conflicted("S/ns/d".into(), Some("40".into()));
        assert_eq!(e.check("S/ns/d", Some("40")), Seen::Waiting);
        assert!(
            met(&e, "S/ns/d", Some("41")),
            "our write is the current version"
        );
        e.conflicted("S/ns/e".into(), Some("50".into()));
        assert_eq!(
            e.check("S/ns/e", Some("50")),
            Seen::Waiting,
            "stale until it moves"
        );
        assert!(met(&e, "S/ns/e", Some("52")));
        // A spec write, then a status write sent with the version read before the spec write:
        // the spec write's version is older than the status write's too.
        e.wrote("S/ns/c".into(), Some("30".into()), Some("31".into()));
        e.wrote("S/ns/c".into(), Some("30".into()), Some("32".into()));
        assert_eq!(
            e.check("S/ns/c", Some("31")),
            Seen::Waiting,
            "the spec write only"
        );
        assert!(met(&e, "S/ns/c", Some("32")));
        // A finalizer removal that deleted the object answers with the version it replaced.
        e.wrote("S/ns/b".into(), Some("20".into()), Some("21".into()));
        e.wrote("S/ns/b".into(), Some("21".into()), None);
        assert_eq!(e.check("S/ns/b", Some("20")), Seen::Waiting);
        assert_eq!(e.check("S/ns/b", Some("21")), Seen::Waiting);
        assert!(met(&e, "S/ns/b", None), "gone");
    }

    #[test]
    fn creates_and_deletes() {
        let e = Expectations::<()>::default();
        e.wrote("S/ns/new".into(), None, Some("5".into()));
        assert!(!met(&e, "S/ns/new", None), "created, store has not seen it");
        assert!(met(&e, "S/ns/new", Some("5")));
        e.wrote("S/ns/old".into(), Some("7".into()), None);
        assert!(
            !met(&e, "S/ns/old", Some("7")),
            "deleted, store still has it"
        );
        assert!(met(&e, "S/ns/old", None));
        assert!(e.is_empty());
    }

    #[test]
    fn pending_writes_are_found_by_prefix_without_touching_others() {
        let e = Expectations::<()>::default();
        e.wrote("H/ns/a".into(), Some("1".into()), Some("2".into()));
        e.wrote("H/ns/b".into(), Some("5".into()), Some("6".into()));
        e.wrote("H/ns2/a".into(), Some("9".into()), Some("10".into()));
        let store = |key: &str| match key {
            "H/ns/a" => Some("2".to_string()),
            "H/ns/b" => Some("5".to_string()),
            _ => None,
        };
        assert_eq!(
            e.first_unmet("H/ns/", store, "", |_| true),
            Some(("H/ns/b".into(), Seen::Waiting))
        );
        assert!(met(&e, "H/ns/a", Some("1")), "a was met and forgotten");
        assert!(
            !met(&e, "H/ns2/a", Some("9")),
            "another namespace is untouched"
        );
    }

    /// A write whose answer the writer keeps (the answer here is its version).
    fn wrote_answered(e: &Expectations<String>, key: &str, replaced: &str, written: &str) {
        e.wrote(key.into(), Some(replaced.into()), Some(written.into()));
        e.answered(key, Some(written), written.into());
    }

    fn ahead(e: &Expectations<String>, key: &str, seen: &str) -> Option<String> {
        e.ahead_of_store(key, Some(seen))
            .map(|a| a.as_ref().clone())
    }

    #[test]
    fn our_last_write_is_ahead_of_a_store_that_shows_what_it_replaced() {
        let e = Expectations::<String>::default();
        assert_eq!(ahead(&e, "S/ns/a", "10"), None, "no write");
        wrote_answered(&e, "S/ns/a", "10", "11");
        wrote_answered(&e, "S/ns/a", "11", "12");
        assert_eq!(ahead(&e, "S/ns/a", "10"), Some("12".into()));
        assert_eq!(ahead(&e, "S/ns/a", "11"), Some("12".into()));
        assert_eq!(
            ahead(&e, "S/ns/a", "13"),
            None,
            "the store moved past our writes: it is the newest"
        );
        // A write decided from our last answer lost (409): someone wrote after us.
        e.conflicted("S/ns/a".into(), Some("12".into()));
        assert_eq!(ahead(&e, "S/ns/a", "10"), None);
        // A 409 of a write conditioned on the store's old version leaves our answer current.
        wrote_answered(&e, "S/ns/b", "40", "41");
        e.conflicted("S/ns/b".into(), Some("40".into()));
        assert_eq!(ahead(&e, "S/ns/b", "40"), Some("41".into()));
        // Deleted: no answer to decide from.
        wrote_answered(&e, "S/ns/c", "19", "20");
        e.wrote("S/ns/c".into(), Some("20".into()), None);
        assert_eq!(ahead(&e, "S/ns/c", "20"), None);
        assert!(
            e.check("S/ns/a", Some("10")) != Seen::Met,
            "asking ends no expectation"
        );
    }

    /// The answer belongs to one write: a later write whose answer was not kept leaves none,
    /// an answer to a write that is no longer the last is not kept, and the answer goes with
    /// the entry once the store shows the write.
    #[test]
    fn an_answer_lives_and_dies_with_its_write() {
        let e = Expectations::<String>::default();
        wrote_answered(&e, "S/ns/a", "10", "11");
        e.wrote("S/ns/a".into(), Some("11".into()), Some("12".into()));
        assert_eq!(
            ahead(&e, "S/ns/a", "10"),
            None,
            "the last write has no answer"
        );
        e.answered("S/ns/a", Some("11"), "11".into());
        assert_eq!(
            ahead(&e, "S/ns/a", "10"),
            None,
            "11 is no longer our last write"
        );
        e.answered("S/ns/a", Some("12"), "12".into());
        assert_eq!(ahead(&e, "S/ns/a", "10"), Some("12".into()));
        assert_eq!(e.check("S/ns/a", Some("12")), Seen::Met);
        assert!(
            e.is_empty(),
            "the store showed the write: entry and answer are gone"
        );
        e.answered("S/ns/a", Some("12"), "12".into());
        assert!(e.is_empty(), "no write, nothing to attach an answer to");
        assert_eq!(ahead(&e, "S/ns/a", "10"), None);
    }

    /// Past the TTL the answer is gone for good: a failed question to the apiserver moves the
    /// next one a TTL ahead, and the entry is then waiting again, but the answer is as old as
    /// the wait and is never used again.
    #[test]
    fn an_overdue_wait_drops_its_answer_even_when_the_apiserver_cannot_be_asked() {
        let mut e = Expectations::<String>::with_ttl(Duration::ZERO);
        wrote_answered(&e, "S/ns/a", "10", "11");
        assert_eq!(e.answers_held(), 1);
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Overdue);
        e.ttl = Duration::from_secs(3600);
        e.unconfirmed("S/ns/a");
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Waiting);
        assert_eq!(ahead(&e, "S/ns/a", "10"), None);
        assert_eq!(e.answers_held(), 0);
    }

    /// Answers are counted however their entries go, and past the bound none is kept: the
    /// passes then wait for the store, as they would without answers.
    #[test]
    fn answers_held_are_bounded_and_counted_out_however_they_go() {
        let e = Expectations::<String>::default();
        // A delete has no answer to keep.
        e.wrote("S/ns/gone".into(), Some("1".into()), None);
        e.answered("S/ns/gone", None, "1".into());
        assert_eq!(e.answers_held(), 0);
        for i in 0..ANSWERS_KEPT + 1 {
            wrote_answered(&e, &format!("S/ns/m{i}"), "10", "11");
        }
        assert_eq!(e.answers_held(), ANSWERS_KEPT);
        let last = format!("S/ns/m{ANSWERS_KEPT}");
        assert_eq!(ahead(&e, &last, "10"), None, "past the bound: not kept");
        assert_eq!(ahead(&e, "S/ns/m0", "10"), Some("11".into()));
        // Met, forgotten, replaced by a write without one: each counts out.
        assert_eq!(e.check("S/ns/m0", Some("11")), Seen::Met);
        e.forget("S/ns/m1");
        e.wrote("S/ns/m2".into(), Some("11".into()), Some("12".into()));
        assert_eq!(e.answers_held(), ANSWERS_KEPT - 3);
        wrote_answered(&e, &last, "11", "12");
        assert_eq!(ahead(&e, &last, "10"), Some("12".into()), "room again");
    }

    /// A pass deciding from an answer writes again. A chain of such writes the store never
    /// showed must not push the store's own version out of `replaced` (where it would pass for
    /// current): the chain stops while there is room, and the passes wait for the store.
    #[test]
    fn answers_stop_before_a_chain_of_writes_forgets_the_stores_version() {
        let e = Expectations::<String>::default();
        wrote_answered(&e, "S/ns/a", "10", "11");
        let mut answered = 0;
        for version in 12..40 {
            let Some(answer) = ahead(&e, "S/ns/a", "10") else {
                break;
            };
            answered += 1;
            // A spec write, then a status write, both from the answer.
            wrote_answered(&e, "S/ns/a", &answer, &version.to_string());
            wrote_answered(&e, "S/ns/a", &answer, &format!("{version}b"));
        }
        assert!(answered > 0, "some passes decided from answers");
        assert!(answered < 28, "and then the chain stopped");
        assert_eq!(
            e.check("S/ns/a", Some("10")),
            Seen::Waiting,
            "the store's version is still known to be stale"
        );
    }

    #[test]
    fn past_the_ttl_an_answer_is_not_used_and_the_apiserver_is_asked() {
        let e = Expectations::<String>::with_ttl(Duration::ZERO);
        wrote_answered(&e, "S/ns/a", "10", "11");
        assert_eq!(ahead(&e, "S/ns/a", "10"), None);
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Overdue);
        // The apiserver said the store is behind: until our next write, passes wait for it.
        let e = Expectations::<String>::default();
        wrote_answered(&e, "S/ns/b", "20", "21");
        assert!(!e.confirm("S/ns/b", Some("20"), Some("21"), e.asking()));
        assert_eq!(ahead(&e, "S/ns/b", "20"), None);
        wrote_answered(&e, "S/ns/b", "21", "22");
        assert_eq!(ahead(&e, "S/ns/b", "20"), Some("22".into()));
    }

    /// A deleted object's expectations go when its store drops it, not a sweep later; a
    /// create the store has not shown yet stays, whatever the order of the two.
    #[test]
    fn a_deletion_forgets_what_its_absence_meets_and_keeps_an_unseen_create() {
        let e = Expectations::<()>::default();
        // Our delete, and writes before another controller's delete.
        e.wrote("S/ns/deleted".into(), Some("10".into()), None);
        e.wrote("S/ns/theirs".into(), Some("20".into()), Some("21".into()));
        // Our create, not in the store yet: its absence is the stale view.
        e.wrote("S/ns/created".into(), None, Some("30".into()));
        for key in ["S/ns/deleted", "S/ns/theirs", "S/ns/created", "S/ns/never"] {
            e.gone(key, || true);
        }
        assert_eq!(e.len(), 1);
        assert_eq!(e.check("S/ns/created", None), Seen::Waiting);
        assert_eq!(e.check("S/ns/created", Some("30")), Seen::Met);
    }

    /// A boot Secret deleted and created again under the same name (the next attempt): the
    /// old one's deletion, reported after the new one's create was recorded, must not end the
    /// wait for the new one, or a pass would decide from a store without it.
    #[test]
    fn a_late_deletion_of_a_namesake_keeps_the_wait_for_its_successor() {
        let e = Expectations::<()>::default();
        e.wrote("Secret/ns/boot".into(), Some("10".into()), None);
        e.wrote("Secret/ns/boot".into(), None, Some("12".into()));
        e.gone("Secret/ns/boot", || true);
        assert_eq!(e.check("Secret/ns/boot", None), Seen::Waiting);
        assert_eq!(e.check("Secret/ns/boot", Some("10")), Seen::Waiting);
        assert_eq!(e.check("Secret/ns/boot", Some("12")), Seen::Met);
        // In the other order the deletion forgets the old entry, and the create starts anew.
        e.wrote("Secret/ns/boot".into(), Some("12".into()), None);
        e.gone("Secret/ns/boot", || true);
        assert!(e.is_empty());
        e.wrote("Secret/ns/boot".into(), None, Some("14".into()));
        assert_eq!(e.check("Secret/ns/boot", None), Seen::Waiting);
    }

    /// A deletion reported after its namesake was created, shown and written to: the store
    /// holds the namesake, so the wait for our write to it goes on (forgetting it would let a
    /// pass decide from the namesake's version before our write).
    #[test]
    fn a_late_deletion_leaves_a_shown_namesakes_write_alone() {
        let e = Expectations::<()>::default();
        e.wrote(
            "Secret/ns/boot".into(),
            Some("12".into()),
            Some("13".into()),
        );
        let store_holds_the_namesake = || false;
        e.gone("Secret/ns/boot", store_holds_the_namesake);
        assert_eq!(e.check("Secret/ns/boot", Some("12")), Seen::Waiting);
        e.gone("Secret/ns/boot", || true);
        assert!(e.is_empty(), "once the store holds none, absence meets it");
    }

    /// The wiring: a watch's Delete reaches [`Expectations::gone`] with the object's key, once
    /// the store no longer holds it; Applies forget nothing.
    #[tokio::test]
    async fn a_watched_deletion_reaches_the_expectations() {
        use k8s_openapi::api::core::v1::ConfigMap;
        use kube::runtime::watcher::Event;
        let e = Arc::new(Expectations::<()>::default());
        e.wrote("ConfigMap/ns/a".into(), Some("1".into()), None);
        e.wrote("ConfigMap/ns/b".into(), Some("5".into()), Some("6".into()));
        let shared = crate::stores::SharedStore::<ConfigMap>::new();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let seen = e.clone();
        let (forgot, mut forgotten) = tokio::sync::mpsc::unbounded_channel();
        let store = shared.store.clone();
        follow_deletions(&shared, move |key, absent| {
            seen.gone(key, absent);
            let _ = forgot.send((key.to_string(), store.state().len()));
        });
        let events =
            futures::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) },
            );
        shared.run_on(events);
        let cm = |name: &str, version: &str| ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                resource_version: Some(version.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        for event in [
            Event::Init,
            Event::InitApply(cm("a", "1")),
            Event::InitApply(cm("b", "5")),
            Event::InitDone,
            Event::Apply(cm("b", "7")),
            Event::Delete(cm("a", "1")),
        ] {
            assert!(tx.send(event).is_ok());
        }
        let reported = tokio::time::timeout(Duration::from_secs(10), forgotten.recv()).await;
        assert_eq!(
            reported.ok().flatten(),
            Some(("ConfigMap/ns/a".to_string(), 1)),
            "a's deletion, once the store no longer held it"
        );
        assert_eq!(e.len(), 1, "a's deletion forgot a");
        assert_eq!(e.check("ConfigMap/ns/b", Some("5")), Seen::Waiting);
        assert!(forgotten.try_recv().is_err(), "Applies forget nothing");
    }

    #[test]
    fn a_write_that_changed_nothing_expects_nothing() {
        let e = Expectations::<()>::default();
        e.wrote("S/ns/a".into(), Some("3".into()), Some("3".into()));
        assert!(met(&e, "S/ns/a", Some("3")));
        assert!(e.is_empty());
    }

    /// The rule the starvation run broke: past the TTL the wait does not end by itself. It ends
    /// only when the apiserver shows the store's own version; while the apiserver is ahead, the
    /// store is behind and the wait goes on.
    #[test]
    fn past_the_ttl_the_wait_ends_only_when_the_apiserver_agrees_with_the_store() {
        let e = Expectations::<()>::with_ttl(Duration::ZERO);
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Overdue);
        // The apiserver has our write (11) or a later one (14): the store is behind.
        assert!(!e.confirm("S/ns/a", Some("10"), Some("11"), e.asking()));
        assert!(!e.confirm("S/ns/a", Some("10"), Some("14"), e.asking()));
        assert_eq!(
            e.check("S/ns/a", Some("10")),
            Seen::Overdue,
            "still waiting"
        );
        // Deleted since: the store still shows it, so it is behind too.
        assert!(!e.confirm("S/ns/a", Some("10"), None, e.asking()));
        // The apiserver shows 10 (our write was undone by a restore, say): decide from it.
        assert!(e.confirm("S/ns/a", Some("10"), Some("10"), e.asking()));
        assert!(e.is_empty());
        // A create whose object is gone again, in the apiserver as in the store.
        e.wrote("S/ns/b".into(), None, Some("3".into()));
        assert_eq!(e.check("S/ns/b", None), Seen::Overdue);
        assert!(e.confirm("S/ns/b", None, None, e.asking()));
    }

    /// A write recorded while the question was on its way: the apiserver's answer predates it,
    /// so it ends nothing (before, "the apiserver agrees with the store" dropped the new write).
    #[test]
    fn an_answer_older_than_a_write_ends_nothing() {
        let e = Expectations::<()>::with_ttl(Duration::ZERO);
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Overdue);
        let asked = e.asking();
        // Another pass writes while the GET is in flight; the GET read the object before that.
        e.wrote("S/ns/a".into(), Some("11".into()), Some("12".into()));
        assert!(!e.confirm("S/ns/a", Some("11"), Some("11"), asked));
        assert_eq!(
            e.check("S/ns/a", Some("11")),
            Seen::Overdue,
            "still waiting"
        );
        assert!(e.confirm("S/ns/a", Some("11"), Some("11"), e.asking()));
    }

    #[test]
    fn a_confirmed_lag_waits_a_whole_ttl_before_the_next_question() {
        let mut e = Expectations::<()>::with_ttl(Duration::ZERO);
        e.wrote("S/ns/a".into(), Some("10".into()), Some("11".into()));
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Overdue);
        e.ttl = Duration::from_secs(3600);
        assert!(!e.confirm("S/ns/a", Some("10"), Some("11"), e.asking()));
        assert_eq!(
            e.check("S/ns/a", Some("10")),
            Seen::Waiting,
            "asked again only a TTL later"
        );
        e.unconfirmed("S/ns/a");
        assert_eq!(e.check("S/ns/a", Some("10")), Seen::Waiting);
    }

    #[test]
    fn overdue_entries_are_found_before_waiting_ones() {
        let e = Expectations::<()>::with_ttl(Duration::from_secs(60));
        e.wrote("H/ns/a".into(), Some("1".into()), Some("2".into()));
        e.wrote("H/ns/b".into(), Some("5".into()), Some("6".into()));
        if let Ok(mut pending) = e.pending.lock()
            && let Some(entry) = pending.get_mut("H/ns/b")
        {
            entry.due = Instant::now();
        }
        let store = |key: &str| match key {
            "H/ns/a" => Some("1".to_string()),
            _ => Some("5".to_string()),
        };
        assert_eq!(
            e.first_unmet("H/ns/", store, "", |_| true),
            Some(("H/ns/b".into(), Seen::Overdue))
        );
    }

    /// A write to `key` on behalf of `writer`, from version `from` to `to`.
    fn wrote_for(e: &Expectations, key: &str, from: &str, to: &str, writer: &str) {
        e.wrote_for(key.into(), Some(from.into()), Some(to.into()), writer);
    }

    /// A host another machine has just claimed, not yet in the store, is no candidate for the
    /// rest; once the store shows any later version of it, it is one again.
    #[test]
    fn hosts_others_just_wrote_are_named_until_the_store_shows_them() {
        let e = Expectations::<()>::default();
        wrote_for(&e, "H/ns/a", "1", "2", "M/ns/m1");
        wrote_for(&e, "H/ns/b", "5", "6", "M/ns/m2");
        e.conflicted_for("H/ns/c".into(), Some("8".into()), "M/ns/m3");
        wrote_for(&e, "H/other/d", "1", "2", "M/other/m9");
        let store = |key: &str| match key {
            "H/ns/a" => Some("1".to_string()),
            "H/ns/b" => Some("6".to_string()),
            _ => Some("8".to_string()),
        };
        let names = |writer: &str| {
            let mut v: Vec<_> = e
                .written_by_others("H/ns/", store, writer)
                .into_iter()
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            names("M/ns/m4"),
            vec!["a".to_string()],
            "a: claimed by m1, the store still shows the version before; b: the store shows the claim; c: only a lost race; d: another namespace"
        );
        assert!(
            names("M/ns/m1").is_empty(),
            "a machine's own claim is not another's"
        );
    }

    /// A machine waits for the host it claimed and for hosts that name it, not for every host
    /// another machine wrote: under a storm that wait never ended.
    #[test]
    fn a_pass_waits_only_for_the_writes_that_concern_it() {
        let e = Expectations::<()>::default();
        wrote_for(&e, "H/ns/a", "1", "2", "M/ns/m1");
        wrote_for(&e, "H/ns/b", "5", "6", "M/ns/m2");
        e.conflicted_for("H/ns/b".into(), Some("5".into()), "M/ns/m3");
        e.wrote("H/ns/c".into(), Some("8".into()), Some("9".into()));
        let store = |key: &str| match key {
            "H/ns/a" => Some("1".to_string()),
            "H/ns/b" => Some("5".to_string()),
            _ => Some("8".to_string()),
        };
        assert_eq!(
            e.first_unmet("H/ns/", store, "M/ns/m1", |_| false),
            Some(("H/ns/a".into(), Seen::Waiting))
        );
        assert_eq!(
            e.first_unmet("H/ns/", store, "M/ns/m3", |_| false),
            Some(("H/ns/b".into(), Seen::Waiting)),
            "a machine that lost the race for b waits for b too"
        );
        assert_eq!(e.first_unmet("H/ns/", store, "M/ns/m4", |_| false), None);
        assert_eq!(
            e.first_unmet("H/ns/", store, "M/ns/m4", |key| key == "H/ns/c"),
            Some(("H/ns/c".into(), Seen::Waiting)),
            "a host that names the machine in the store concerns it whoever wrote it"
        );
        // However many machines lose the race for a host, the one whose claim went through
        // keeps waiting for it.
        for loser in ["M/ns/l1", "M/ns/l2", "M/ns/l3", "M/ns/l4", "M/ns/l5"] {
            e.conflicted_for("H/ns/a".into(), Some("1".into()), loser);
        }
        assert_eq!(
            e.first_unmet("H/ns/", store, "M/ns/m1", |_| false),
            Some(("H/ns/a".into(), Seen::Waiting))
        );
        assert_eq!(
            e.first_unmet("H/ns/", store, "M/ns/l5", |_| false),
            Some(("H/ns/a".into(), Seen::Waiting))
        );
        // Met entries are forgotten even when they concern someone else.
        let caught_up = |_: &str| Some("99".to_string());
        assert_eq!(
            e.first_unmet("H/ns/", caught_up, "M/ns/m4", |_| false),
            None
        );
        assert!(e.is_empty());
    }

    /// A claim whose answer was lost may have landed: its machine waits for the host however
    /// many others lose a race for it, and the others count the host as taken, until the store
    /// moves.
    #[test]
    fn a_write_whose_answer_was_lost_keeps_its_writer_until_the_store_moves() {
        let e = Expectations::<()>::default();
        e.uncertain_for("H/ns/a".into(), Some("1".into()), "M/ns/m1");
        for loser in ["M/ns/l1", "M/ns/l2", "M/ns/l3", "M/ns/l4", "M/ns/l5"] {
            e.conflicted_for("H/ns/a".into(), Some("1".into()), loser);
        }
        let lagging = |_: &str| Some("1".to_string());
        assert_eq!(
            e.first_unmet("H/ns/", lagging, "M/ns/m1", |_| false),
            Some(("H/ns/a".into(), Seen::Waiting)),
            "not evicted by five losers"
        );
        assert_eq!(
            e.written_by_others("H/ns/", lagging, "M/ns/m2"),
            ["a".to_string()].into(),
            "taken for the others"
        );
        assert!(e.written_by_others("H/ns/", lagging, "M/ns/m1").is_empty());
        let moved = |_: &str| Some("2".to_string());
        assert_eq!(e.first_unmet("H/ns/", moved, "M/ns/m1", |_| false), None);
        assert!(e.is_empty());
    }
}

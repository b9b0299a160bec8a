//! Kubernetes Events (`events.k8s.io/v1`), with repeats folded into a series as kube-runtime's
//! `Recorder` does: the same reason for the same object within six minutes patches the first
//! Event's `series.count` instead of creating another.
//!
//! Written here instead of using `kube::runtime::events::Recorder` because of what that costs
//! at fleet scale: it keeps a full copy of every Event of the last six minutes and scans all of
//! them on every publish (tens of thousands of copies and scans while 10,000 hosts register).
//! This keeps, per series, a 64-bit hash of what makes it one and the time of its first Event
//! (which gives the Event's name), with no string on the heap, and expires them in time order.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Resource;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;

/// How long a repeat joins the earlier Event's series (kube-runtime and client-go use the same).
pub const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);

/// One series: when its first Event was created (its name says when), how often it happened
/// since, and when last.
struct Series {
    first: Timestamp,
    count: i32,
    last: Timestamp,
}

/// What makes two Events one series, hashed (see [`series_key`]).
type SeriesKey = u64;

/// Series of the last [`SERIES_WINDOW`], by key, with their expiry in time order.
#[derive(Default)]
struct Recent {
    series: HashMap<SeriesKey, Series>,
    expiry: VecDeque<(Timestamp, SeriesKey)>,
}

impl Recent {
    /// Forgets series not repeated within the window. Each publish adds one expiry entry, so
    /// this does at most as much work as the publishes since the last call.
    fn expire(&mut self, now: Timestamp) {
        while let Some((at, _)) = self.expiry.front() {
            if *at > now {
                break;
            }
            let Some((_, key)) = self.expiry.pop_front() else {
                break;
            };
            if self
                .series
                .get(&key)
                .is_some_and(|s| s.last + SERIES_WINDOW <= now)
            {
                self.series.remove(&key);
            }
        }
    }

    /// The repeat of a live series (when its first Event was created, and the new count), or
    /// None: a new Event.
    fn repeat(&mut self, key: SeriesKey, now: Timestamp) -> Option<(Timestamp, i32)> {
        self.expire(now);
        self.series.get(&key).map(|s| (s.first, s.count + 1))
    }

    fn record(&mut self, key: SeriesKey, first: Timestamp, count: i32, now: Timestamp) {
        self.expiry.push_back((now + SERIES_WINDOW, key));
        self.series.insert(
            key,
            Series {
                first,
                count,
                last: now,
            },
        );
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.series.len()
    }
}

/// Publishes Events for one reporting component (clones share the series).
#[derive(Clone)]
pub struct EventRecorder {
    client: kube::Client,
    controller: String,
    instance: String,
    recent: Arc<Mutex<Recent>>,
    /// Keys the series hash per process: object names come from users, so no one can make two
    /// series collide on purpose.
    hasher: RandomState,
}

impl EventRecorder {
    pub fn new(client: kube::Client, controller: &str) -> Self {
        Self {
            client,
            controller: controller.into(),
            instance: std::env::var("POD_NAME").unwrap_or_else(|_| controller.into()),
            recent: Arc::default(),
            hasher: RandomState::new(),
        }
    }

    /// Creates the Event, or counts a repeat in its series.
    pub async fn publish<K: Resource<DynamicType = ()>>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &str,
        action: &str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let warning = type_ == EventType::Warning;
        let regarding = obj.object_ref(&());
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let key = series_key(&self.hasher, &regarding, warning, reason, action);
        let now = Timestamp::now();
        let repeat = self.recent.lock().ok().and_then(|mut r| r.repeat(key, now));
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let (first, count) = match repeat {
            Some((first, count)) => {
                let patch = serde_json::json!({
                    "series": EventSeries { count, last_observed_time: MicroTime(now) }
                });
                let name = event_name(&regarding, &self.controller, first);
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                (first, count)
            }
            None => {
                let event = self.event(regarding, warning, reason, action, note, now);
                events.create(&PostParams::default(), &event).await?;
                (now, 1)
            }
        };
        if let Ok(mut recent) = self.recent.lock() {
            recent.record(key, first, count, now);
        }
        Ok(())
    }

    fn event(
        &self,
        regarding: ObjectReference,
        warning: bool,
        reason: &str,
        action: &str,
        note: &str,
        now: Timestamp,
    ) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(event_name(&regarding, &self.controller, now)),
                namespace: regarding.namespace.clone(),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            type_: Some(if warning { "Warning" } else { "Normal" }.into()),
            reason: Some(reason.into()),
            action: Some(action.into()),
            // Events are capped at 1 kB; keep the start, which says what happened.
            note: Some(note.chars().take(1000).collect()),
            regarding: Some(regarding),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            ..Default::default()
        }
    }
}

/// The name of the Event that starts a series at `first`: the object's name (the reporting
/// controller's for an object without one) and the time.
fn event_name(regarding: &ObjectReference, controller: &str, first: Timestamp) -> String {
    let object = regarding.name.as_deref().unwrap_or(controller);
    format!("{object}.{:x}", first.as_nanosecond())
}

/// What makes two Events the same series: the object (by uid, so a re-created namesake starts
/// afresh), type, reason and action. Hashed: a `str` hashes with a terminator, so the parts
/// cannot run into each other.
fn series_key(
    hasher: &RandomState,
    regarding: &ObjectReference,
    warning: bool,
    reason: &str,
    action: &str,
) -> SeriesKey {
    hasher.hash_one((
        regarding.kind.as_deref().unwrap_or_default(),
        regarding.namespace.as_deref().unwrap_or_default(),
        regarding.name.as_deref().unwrap_or_default(),
        regarding.uid.as_deref().unwrap_or_default(),
        warning,
        reason,
        action,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap_or(Timestamp::UNIX_EPOCH)
    }

    #[test]
    fn a_repeat_within_the_window_joins_the_series_and_a_later_one_starts_anew() {
        let mut recent = Recent::default();
        assert_eq!(recent.repeat(7, at(0)), None);
        recent.record(7, at(0), 1, at(0));
        assert_eq!(recent.repeat(7, at(300)), Some((at(0), 2)));
        recent.record(7, at(0), 2, at(300));
        // Six minutes after the first, but not after the last repeat: still the series.
        assert_eq!(recent.repeat(7, at(400)), Some((at(0), 3)));
        assert_eq!(recent.repeat(7, at(300 + 360)), None, "window passed");
        assert_eq!(recent.len(), 0, "expired series are forgotten");
    }

    #[test]
    fn expiry_forgets_old_series_without_touching_live_ones() {
        let mut recent = Recent::default();
        for i in 0..1000 {
            recent.record(i as SeriesKey, at(i), 1, at(i));
        }
        recent.expire(at(360 + 499));
        assert_eq!(recent.len(), 500, "series 0..=499 expired, 500.. live");
        assert_eq!(recent.repeat(500, at(360 + 499)), Some((at(500), 2)));
        assert_eq!(recent.repeat(499, at(360 + 499)), None);
    }

    #[test]
    fn the_series_key_tells_objects_reasons_and_types_apart() {
        let r = |name: &str, uid: &str| ObjectReference {
            kind: Some("MetalHost".into()),
            namespace: Some("ns".into()),
            name: Some(name.into()),
            uid: Some(uid.into()),
            ..Default::default()
        };
        let hasher = RandomState::new();
        let key = |regarding: &ObjectReference, warning: bool, reason: &str, action: &str| {
            series_key(&hasher, regarding, warning, reason, action)
        };
        let base = key(&r("a", "1"), false, "Registered", "Registered");
        assert_eq!(base, key(&r("a", "1"), false, "Registered", "Registered"));
        assert_ne!(base, key(&r("a", "2"), false, "Registered", "Registered"));
        assert_ne!(base, key(&r("b", "1"), false, "Registered", "Registered"));
        assert_ne!(base, key(&r("a", "1"), true, "Registered", "Registered"));
        assert_ne!(base, key(&r("a", "1"), false, "Other", "Registered"));
        // Parts cannot run into each other: reason "ab" + action "c" is not "a" + "bc".
        assert_ne!(
            key(&r("a", "1"), false, "ab", "c"),
            key(&r("a", "1"), false, "a", "bc")
        );
    }

    /// A repeat patches the Event its series started with: the name is the same from the
    /// object and the first Event's time alone.
    #[test]
    fn a_series_names_its_first_event_from_the_object_and_the_time() {
        let regarding = ObjectReference {
            name: Some("host-1".into()),
            ..Default::default()
        };
        let first = at(0);
        assert_eq!(
            event_name(&regarding, "ctl", first),
            format!("host-1.{:x}", first.as_nanosecond())
        );
        assert_eq!(
            event_name(&ObjectReference::default(), "ctl", first),
            format!("ctl.{:x}", first.as_nanosecond())
        );
    }
}

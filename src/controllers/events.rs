//! Kubernetes Events (`events.k8s.io/v1`), with repeats folded into a series as kube-runtime's
//! `Recorder` does: the same reason for the same object within six minutes patches the first
//! Event's `series.count` instead of creating another.
//!
//! Written here instead of using `kube::runtime::events::Recorder` because of what that costs
//! at fleet scale: it keeps a full copy of every Event of the last six minutes and scans all of
//! them on every publish (tens of thousands of copies and scans while 10,000 hosts register).
//! This keeps one short key and the Event's name per series, and expires them in time order.

use std::collections::{HashMap, VecDeque};
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

/// One series: the Event that started it and how often it happened since.
struct Series {
    event_name: String,
    count: i32,
    last: Timestamp,
}

/// Series of the last [`SERIES_WINDOW`], by key, with their expiry in time order.
#[derive(Default)]
struct Recent {
    series: HashMap<String, Series>,
    expiry: VecDeque<(Timestamp, String)>,
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

    /// The repeat of a live series (its Event's name and the new count), or None: a new Event.
    fn repeat(&mut self, key: &str, now: Timestamp) -> Option<(String, i32)> {
        self.expire(now);
        self.series
            .get(key)
            .map(|s| (s.event_name.clone(), s.count + 1))
    }

    fn record(&mut self, key: String, event_name: String, count: i32, now: Timestamp) {
        self.expiry.push_back((now + SERIES_WINDOW, key.clone()));
        self.series.insert(
            key,
            Series {
                event_name,
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
}

impl EventRecorder {
    pub fn new(client: kube::Client, controller: &str) -> Self {
        Self {
            client,
            controller: controller.into(),
            instance: std::env::var("POD_NAME").unwrap_or_else(|_| controller.into()),
            recent: Arc::default(),
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
        let key = series_key(&regarding, warning, reason, action);
        let now = Timestamp::now();
        let repeat = self
            .recent
            .lock()
            .ok()
            .and_then(|mut r| r.repeat(&key, now));
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let (name, count) = match repeat {
            Some((name, count)) => {
                let patch = serde_json::json!({
                    "series": EventSeries { count, last_observed_time: MicroTime(now) }
                });
                events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await?;
                (name, count)
            }
            None => {
                let event = self.event(regarding, warning, reason, action, note, now);
                let name = event.metadata.name.clone().unwrap_or_default();
                events.create(&PostParams::default(), &event).await?;
                (name, 1)
            }
        };
        if let Ok(mut recent) = self.recent.lock() {
            recent.record(key, name, count, now);
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
        let object = regarding
            .name
            .clone()
            .unwrap_or_else(|| self.controller.clone());
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{object}.{:x}", now.as_nanosecond())),
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

/// What makes two Events the same series: the object (by uid, so a re-created namesake starts
/// afresh), type, reason and action.
fn series_key(regarding: &ObjectReference, warning: bool, reason: &str, action: &str) -> String {
    format!(
        "{}/{}/{}/{}\0{}\0{reason}\0{action}",
        regarding.kind.as_deref().unwrap_or_default(),
        regarding.namespace.as_deref().unwrap_or_default(),
        regarding.name.as_deref().unwrap_or_default(),
        regarding.uid.as_deref().unwrap_or_default(),
        if warning { 'W' } else { 'N' },
    )
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
        assert_eq!(recent.repeat("a", at(0)), None);
        recent.record("a".into(), "ev-a".into(), 1, at(0));
        assert_eq!(recent.repeat("a", at(300)), Some(("ev-a".into(), 2)));
        recent.record("a".into(), "ev-a".into(), 2, at(300));
        // Six minutes after the first, but not after the last repeat: still the series.
        assert_eq!(recent.repeat("a", at(400)), Some(("ev-a".into(), 3)));
        assert_eq!(recent.repeat("a", at(300 + 360)), None, "window passed");
        assert_eq!(recent.len(), 0, "expired series are forgotten");
    }

    #[test]
    fn expiry_forgets_old_series_without_touching_live_ones() {
        let mut recent = Recent::default();
        for i in 0..1000 {
            recent.record(format!("k{i}"), format!("e{i}"), 1, at(i));
        }
        recent.expire(at(360 + 499));
        assert_eq!(recent.len(), 500, "series 0..=499 expired, 500.. live");
        assert_eq!(
            recent.repeat("k500", at(360 + 499)),
            Some(("e500".into(), 2))
        );
        assert_eq!(recent.repeat("k499", at(360 + 499)), None);
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
        let base = series_key(&r("a", "1"), false, "Registered", "Registered");
        assert_eq!(
            base,
            series_key(&r("a", "1"), false, "Registered", "Registered")
        );
        assert_ne!(
            base,
            series_key(&r("a", "2"), false, "Registered", "Registered")
        );
        assert_ne!(
            base,
            series_key(&r("b", "1"), false, "Registered", "Registered")
        );
        assert_ne!(
            base,
            series_key(&r("a", "1"), true, "Registered", "Registered")
        );
        assert_ne!(base, series_key(&r("a", "1"), false, "Other", "Registered"));
    }
}

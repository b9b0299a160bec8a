//! `metav1.Condition` bookkeeping: set a condition without touching `lastTransitionTime` unless
//! the status actually changed, and read conditions back.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::api::common::Condition;

/// A condition to set: type, status, reason (CamelCase), message (for people).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want<'a> {
    pub type_: &'a str,
    pub status: bool,
    pub reason: &'a str,
    pub message: String,
}

impl<'a> Want<'a> {
    pub fn t(type_: &'a str, reason: &'a str, message: impl Into<String>) -> Self {
        Want {
            type_,
            status: true,
            reason,
            message: message.into(),
        }
    }
    pub fn f(type_: &'a str, reason: &'a str, message: impl Into<String>) -> Self {
        Want {
            type_,
            status: false,
            reason,
            message: message.into(),
        }
    }
}

/// Sets `want` in `conditions` (kept sorted by type for stable status patches).
pub fn set(
    conditions: &mut Vec<Condition>,
    want: Want<'_>,
    observed_generation: Option<i64>,
    now: &Time,
) {
    let status = if want.status { "True" } else { "False" };
    let message: String = want.message.chars().take(32 * 1024).collect();
    match conditions.iter_mut().find(|c| c.type_ == want.type_) {
        Some(existing) => {
            if existing.status != status {
                existing.last_transition_time = now.clone();
            }
            existing.status = status.into();
            existing.reason = want.reason.into();
            existing.message = message;
            existing.observed_generation = observed_generation;
        }
        None => conditions.push(Condition {
            type_: want.type_.into(),
            status: status.into(),
            reason: want.reason.into(),
            message,
            observed_generation,
            last_transition_time: now.clone(),
        }),
    }
    conditions.sort_by(|a, b| a.type_.cmp(&b.type_));
}

pub fn get<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == "True")
}

pub fn now() -> Time {
    Time(jiff::Timestamp::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> Time {
        Time(jiff::Timestamp::from_second(secs).unwrap_or(jiff::Timestamp::UNIX_EPOCH))
    }

    #[test]
    fn transition_time_moves_only_when_status_changes() {
        let mut c = Vec::new();
        set(&mut c, Want::f("Ready", "Waiting", "a"), Some(1), &at(10));
        set(
            &mut c,
            Want::f("Ready", "StillWaiting", "b"),
            Some(2),
            &at(20),
        );
        assert_eq!(c[0].last_transition_time, at(10));
        assert_eq!(
            (
                c[0].reason.as_str(),
                c[0].message.as_str(),
                c[0].observed_generation
            ),
            ("StillWaiting", "b", Some(2))
        );
        set(&mut c, Want::t("Ready", "Ready", ""), Some(2), &at(30));
        assert_eq!(c[0].last_transition_time, at(30));
        assert!(is_true(&c, "Ready"));
    }

    #[test]
    fn conditions_stay_sorted_and_unique() {
        let mut c = Vec::new();
        for t in ["Ready", "BootReady", "HostAssociated", "BootReady"] {
            set(&mut c, Want::t(t, "R", ""), None, &at(1));
        }
        let types: Vec<&str> = c.iter().map(|c| c.type_.as_str()).collect();
        assert_eq!(types, vec!["BootReady", "HostAssociated", "Ready"]);
    }
}

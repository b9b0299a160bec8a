//! The one power-off policy, shared by the MetalHost controller (operator holds a host off with
//! `online: false`) and the MetalMachine controller (deprovisioning): ask gracefully, force after
//! the configured grace period, send each request once and re-send it only after
//! [`POWER_OFF_RESEND`], and give up after a deadline.

use std::time::{Duration, Instant};

use crate::api::metalhost::PowerState;
use crate::bmc::PowerAction;

use super::per_object::PerObject;

/// A BMC or credentials fault, as a condition reason and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub reason: &'static str,
    pub message: String,
}

impl Fault {
    pub fn from_bmc(e: &crate::bmc::BmcError) -> Fault {
        crate::metrics::record_bmc_error(e.reason());
        Fault {
            reason: e.reason(),
            message: e.to_string(),
        }
    }
}

/// How long a power-off request is given before the same request is sent again. BMCs apply
/// power actions asynchronously (sushy-tools and many real BMCs take seconds), and some restart
/// the transition on every repeated request, so hammering them delays the very power-off we want.
pub const POWER_OFF_RESEND: Duration = Duration::from_secs(30);

/// What powering a host off does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PowerOffStep {
    /// Send this power-off request to the BMC now.
    Request(PowerAction),
    /// This request was sent recently: give the BMC time, and check the power state again.
    Wait(PowerAction),
    /// The host is off.
    Done,
    /// BMC trouble, still within the deadline: try again later.
    Retry(Fault),
    /// BMC trouble (or a host that will not power off) past the deadline.
    GiveUp(Fault),
}

/// The policy. `since` is how long the host has been wanted off; `last_request` is the request
/// already sent for this and how long ago. `deadline: None` never gives up (an operator's hold).
pub fn power_off_step(
    power: Result<PowerState, Fault>,
    since: Duration,
    graceful: Duration,
    deadline: Option<Duration>,
    last_request: Option<(PowerAction, Duration)>,
) -> PowerOffStep {
    let past_deadline = deadline.is_some_and(|d| since >= d);
    match power {
        Ok(PowerState::Off) => PowerOffStep::Done,
        Ok(_) if past_deadline => PowerOffStep::GiveUp(Fault {
            reason: "PowerOffTimeout",
            message: format!(
                "host still not off {} s after it was asked",
                since.as_secs()
            ),
        }),
        Ok(_) => {
            let want = if since >= graceful {
                PowerAction::ForceOff
            } else {
                PowerAction::GracefulOff
            };
            match last_request {
                Some((sent, ago)) if sent == want && ago < POWER_OFF_RESEND => {
                    PowerOffStep::Wait(want)
                }
                _ => PowerOffStep::Request(want),
            }
        }
        Err(f) if past_deadline => PowerOffStep::GiveUp(f),
        Err(f) => PowerOffStep::Retry(f),
    }
}

/// The power request last sent per object, and when. In memory: after a restart the request
/// is simply sent once more. Entries go when the object is off, given up, or deleted.
pub type PowerRequests = PerObject<(PowerAction, Instant)>;

impl PowerRequests {
    pub fn last(&self, key: &str) -> Option<(PowerAction, Duration)> {
        self.get(key).map(|(action, at)| (action, at.elapsed()))
    }

    pub fn record(&self, key: &str, action: PowerAction) {
        self.insert(key, (action, Instant::now()));
    }

    pub fn forget(&self, key: &str) {
        self.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_requests_of_gone_objects_are_released() {
        let requests = PowerRequests::default();
        requests.record("ns/a", PowerAction::GracefulOff);
        requests.record("ns/b", PowerAction::ForceOff);
        requests.retain(|k| k == "ns/a");
        assert_eq!(requests.len(), 1);
        assert!(requests.last("ns/a").is_some() && requests.last("ns/b").is_none());
    }

    #[test]
    fn power_off_policy_table() {
        let s = Duration::from_secs;
        let f = Fault {
            reason: "BmcUnreachable",
            message: "refused".into(),
        };
        let graceful = Some((PowerAction::GracefulOff, s(2)));
        let deadline = Some(s(300));
        let cases = vec![
            (
                "off: done",
                Ok(PowerState::Off),
                s(0),
                graceful,
                deadline,
                PowerOffStep::Done,
            ),
            (
                "on: ask nicely",
                Ok(PowerState::On),
                s(5),
                None,
                deadline,
                PowerOffStep::Request(PowerAction::GracefulOff),
            ),
            (
                "asked nicely 2 s ago: wait, do not ask again",
                Ok(PowerState::On),
                s(7),
                graceful,
                deadline,
                PowerOffStep::Wait(PowerAction::GracefulOff),
            ),
            (
                "asked nicely long ago: ask again",
                Ok(PowerState::PoweringOff),
                s(50),
                Some((PowerAction::GracefulOff, POWER_OFF_RESEND)),
                deadline,
                PowerOffStep::Request(PowerAction::GracefulOff),
            ),
            (
                "still on after grace: force, once",
                Ok(PowerState::On),
                s(61),
                graceful,
                deadline,
                PowerOffStep::Request(PowerAction::ForceOff),
            ),
            (
                "forced 10 s ago: wait",
                Ok(PowerState::On),
                s(71),
                Some((PowerAction::ForceOff, s(10))),
                deadline,
                PowerOffStep::Wait(PowerAction::ForceOff),
            ),
            (
                "BMC down: retry",
                Err(f.clone()),
                s(10),
                None,
                deadline,
                PowerOffStep::Retry(f.clone()),
            ),
            (
                "BMC down too long: give up",
                Err(f.clone()),
                s(301),
                graceful,
                deadline,
                PowerOffStep::GiveUp(f.clone()),
            ),
            (
                "an operator's hold never gives up",
                Err(f.clone()),
                s(100_000),
                None,
                None,
                PowerOffStep::Retry(f.clone()),
            ),
        ];
        for (what, power, since, last, deadline, want) in cases {
            assert_eq!(
                power_off_step(power, since, s(60), deadline, last),
                want,
                "{what}"
            );
        }
        assert!(matches!(
            power_off_step(
                Ok(PowerState::On),
                s(400),
                s(60),
                Some(s(300)),
                Some((PowerAction::ForceOff, s(1)))
            ),
            PowerOffStep::GiveUp(_)
        ));
    }

    #[test]
    fn requests_are_remembered_and_forgotten() {
        let r = PowerRequests::default();
        r.record("ns/a", PowerAction::GracefulOff);
        assert_eq!(r.last("ns/a").map(|l| l.0), Some(PowerAction::GracefulOff));
        r.forget("ns/a");
        assert!(r.is_empty());
    }
}

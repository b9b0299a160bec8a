//! What the deploy agent and the boot service say to each other, under `/agent/<token>/`:
//! `POST inspection` (the hardware inventory), `GET task` (what to do), `POST report` (progress
//! and the outcome). The token is the attempt's boot token, so an agent can only speak for the
//! host it was booted for, and only while that attempt lives.

use serde::{Deserialize, Serialize};

use crate::api::metalmachine::{ImageSpec, RootDeviceHints};

/// Largest inspection body the boot service reads.
pub const MAX_INSPECTION_BYTES: usize = 64 * 1024;
/// Largest report body the boot service reads.
pub const MAX_REPORT_BYTES: usize = 4 * 1024;
/// Longest report message kept (in characters).
pub const MAX_MESSAGE_CHARS: usize = 512;

/// What the agent is asked to do.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "action", rename_all = "camelCase")]
pub enum AgentTask {
    /// Write `image` (its URL made absolute) to the disk `rootDeviceHints` choose, then leave the
    /// NoCloud seed beside it.
    #[serde(rename_all = "camelCase")]
    Deploy {
        image: ImageSpec,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        root_device_hints: Option<Box<RootDeviceHints>>,
        seed: SeedSpec,
    },
    /// Wipe every disk the inspection found (the host is being released), then report
    /// `Cleaned`.
    Clean { mode: super::wipe::WipeMode },
    /// Nothing (any more): the image is written, or this attempt is not an image deployment.
    Done { reason: String },
}

/// The seed's meta-data values.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct SeedSpec {
    pub instance_id: String,
    pub hostname: String,
    pub seedfrom: String,
}

/// Where a deployment stands.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeployState {
    Writing,
    Written,
    /// Cleaning attempts: every disk wiped.
    Cleaned,
    Failed,
}

/// Failure reasons the agent may report; anything else is recorded as `AgentFailed`.
pub const KNOWN_REASONS: &[&str] = &[
    "ImageChecksumMismatch",
    "DiskTooSmall",
    "ImageUnreadable",
    "ImageFormatInvalid",
    "DiskWriteFailed",
    "NoRootDevice",
    "SeedFailed",
    "CleaningFailed",
];

/// Progress or outcome of a deployment, as the agent reports it and the boot Secret keeps it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct DeployReport {
    pub state: DeployState,
    /// The disk written, e.g. `vda`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    #[serde(default)]
    pub written_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    #[serde(default)]
    pub bytes_per_second: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the boot service received it (RFC 3339); set by the boot service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received_at: Option<String>,
}

impl DeployReport {
    /// The report as the boot service keeps it: reason from the known set, message bounded,
    /// device name plain.
    pub fn sanitized(mut self, received_at: String) -> Self {
        if let Some(r) = &self.reason
            && !KNOWN_REASONS.contains(&r.as_str())
        {
            self.reason = Some("AgentFailed".into());
        }
        if self.state == DeployState::Failed && self.reason.is_none() {
            self.reason = Some("AgentFailed".into());
        }
        self.message = self.message.map(|m| {
            m.chars()
                .filter(|c| !c.is_control())
                .take(MAX_MESSAGE_CHARS)
                .collect()
        });
        self.device = self.device.filter(|d| {
            !d.is_empty() && d.len() <= 64 && d.chars().all(|c| c.is_ascii_alphanumeric())
        });
        self.received_at = Some(received_at);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_from_a_hostile_agent_are_bounded() {
        let r = DeployReport {
            state: DeployState::Failed,
            device: Some("../../etc".into()),
            written_bytes: 1,
            total_bytes: None,
            bytes_per_second: 0,
            reason: Some("Anything\nat all".into()),
            message: Some(format!("a\u{1b}[2J{}", "x".repeat(10_000))),
            received_at: Some("forged".into()),
        }
        .sanitized("now".into());
        assert_eq!(r.reason.as_deref(), Some("AgentFailed"));
        assert_eq!(r.device, None);
        let m = r.message.unwrap();
        assert_eq!(m.chars().count(), MAX_MESSAGE_CHARS);
        assert!(!m.contains('\u{1b}'));
        assert_eq!(r.received_at.as_deref(), Some("now"));
    }

    #[test]
    fn tasks_round_trip_as_tagged_json() {
        let t = AgentTask::Done {
            reason: "written".into(),
        };
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, r#"{"action":"done","reason":"written"}"#);
        assert_eq!(serde_json::from_str::<AgentTask>(&json).unwrap(), t);
        let t = AgentTask::Clean {
            mode: super::super::wipe::WipeMode::Full,
        };
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(json, r#"{"action":"clean","mode":"full"}"#);
        assert_eq!(serde_json::from_str::<AgentTask>(&json).unwrap(), t);
    }
}

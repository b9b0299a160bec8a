//! The deploy agent's side of the boot service (`/agent/<token>/…`): the attempt's token
//! authorizes each request exactly as it does the NoCloud documents and the callback, bodies are
//! read only after the token is accepted and never past their cap, and what the agent says is
//! bounded before it is written to the attempt's boot Secret (the only thing written).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube::runtime::events::EventType;

use super::{
    BootState, CallbackNotice, CallbackWrite, ClientIp, authorize, record_on_attempt, text,
};
use crate::agent::protocol::{
    AgentTask, DeployReport, DeployState, MAX_INSPECTION_BYTES, MAX_REPORT_BYTES, SeedSpec,
};
use crate::api::metalhost::HardwareInventory;
use crate::api::metalmachine::ProvisioningMode;
use crate::boot::ipxe;
use crate::boot::tokens;

/// How long an agent may take to send a body.
const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Progress reports closer together than this are acknowledged but not written.
const PROGRESS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// The most disks or NICs kept from one inspection, and the longest string.
const MAX_DEVICES: usize = 64;
const MAX_FIELD_CHARS: usize = 256;

fn json(status: StatusCode, value: &impl serde::Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => {
            let mut r = text(status, body);
            r.headers_mut().insert(
                axum::http::header::CONTENT_TYPE,
                axum::http::HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => super::internal_error("encoding an agent answer failed", e),
    }
}

async fn read_body(body: axum::body::Body, cap: usize) -> Result<axum::body::Bytes, Response> {
    match tokio::time::timeout(BODY_TIMEOUT, axum::body::to_bytes(body, cap)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(_)) => Err(text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("body is larger than {cap} bytes\n"),
        )),
        Err(_) => Err(text(
            StatusCode::REQUEST_TIMEOUT,
            "body not received in time\n".into(),
        )),
    }
}

/// `GET /agent/<token>/task`: what the agent should do for this attempt.
pub(super) async fn task(
    State(state): State<Arc<BootState>>,
    Path(token): Path<String>,
    ClientIp(ip): ClientIp,
) -> Response {
    let (record, machine) = match authorize(&state, &token, ip, "/agent/task").await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let done = |reason: &str| {
        json(
            StatusCode::OK,
            &AgentTask::Done {
                reason: reason.to_string(),
            },
        )
    };
    if let Some(mode) = record.clean {
        if record
            .deploy
            .as_ref()
            .is_some_and(|d| d.state != DeployState::Writing)
        {
            return done("this host's cleaning already ended");
        }
        tracing::info!(route = "/agent/task", machine = %record.metal_machine, host = %record.host, ?mode, client = ?ip, "cleaning task");
        return json(StatusCode::OK, &AgentTask::Clean { mode });
    }
    if machine.spec.mode != ProvisioningMode::Image {
        return done("this attempt netboots its OS (live mode); nothing to write");
    }
    if record
        .deploy
        .as_ref()
        .is_some_and(|d| d.state != DeployState::Writing)
    {
        return done("this attempt's image is already written or failed");
    }
    let Some(image) = machine.spec.image.clone() else {
        return done("spec.image is empty");
    };
    let base = &state.config.base_url;
    let url = match ipxe::artifact_url(&image.url, base) {
        Ok(url) => url,
        Err(reason) => return text(StatusCode::CONFLICT, format!("{reason}\n")),
    };
    tracing::info!(route = "/agent/task", machine = %record.metal_machine, host = %record.host, attempt = record.attempt, client = ?ip, "deploy task");
    json(
        StatusCode::OK,
        &AgentTask::Deploy {
            image: crate::api::metalmachine::ImageSpec { url, ..*image },
            root_device_hints: machine.spec.root_device_hints.clone(),
            seed: SeedSpec {
                instance_id: record.instance_id.clone(),
                hostname: record.host.clone(),
                seedfrom: ipxe::nocloud_url(base, record.token.expose()),
            },
        },
    )
}

fn clip(s: Option<String>) -> Option<String> {
    s.map(|s| {
        s.chars()
            .filter(|c| !c.is_control())
            .take(MAX_FIELD_CHARS)
            .collect()
    })
}

/// An inventory as the boot service keeps it: lists and strings bounded, no free-form facts.
fn bounded(mut inv: HardwareInventory) -> HardwareInventory {
    inv.extra.clear();
    inv.disks.truncate(MAX_DEVICES);
    inv.nics.truncate(MAX_DEVICES);
    for d in &mut inv.disks {
        d.name = clip(Some(std::mem::take(&mut d.name))).unwrap_or_default();
        d.model = clip(d.model.take());
        d.serial_number = clip(d.serial_number.take());
        d.wwn = clip(d.wwn.take());
        d.by_path = clip(d.by_path.take());
    }
    for n in &mut inv.nics {
        n.name = clip(n.name.take());
        n.mac = clip(n.mac.take());
    }
    if let Some(cpu) = inv.cpu.as_mut() {
        cpu.model = clip(cpu.model.take());
        cpu.architecture = clip(cpu.architecture.take());
    }
    inv.manufacturer = clip(inv.manufacturer.take());
    inv.model = clip(inv.model.take());
    inv.serial_number = clip(inv.serial_number.take());
    inv.system_uuid = clip(inv.system_uuid.take());
    inv.bios_version = clip(inv.bios_version.take());
    inv.firmware_mode = clip(inv.firmware_mode.take());
    inv.inspected_at = Some(jiff::Timestamp::now().to_string());
    inv
}

/// `POST /agent/<token>/inspection`: the host's hardware, kept on the boot Secret until the
/// MetalHost controller copies it into `status.hardware`.
pub(super) async fn inspection(
    State(state): State<Arc<BootState>>,
    Path(token): Path<String>,
    ClientIp(ip): ClientIp,
    body: axum::body::Body,
) -> Response {
    let (record, machine) = match authorize(&state, &token, ip, "/agent/inspection").await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let body = match read_body(body, MAX_INSPECTION_BYTES).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let inventory = match serde_json::from_slice::<HardwareInventory>(&body) {
        Ok(inv) => bounded(inv),
        Err(e) => {
            state
                .event(
                    &machine,
                    EventType::Warning,
                    "InspectionRejected",
                    format!("the deploy agent's inspection is not valid: {e}"),
                )
                .await;
            return text(StatusCode::BAD_REQUEST, format!("not an inventory: {e}\n"));
        }
    };
    let patch = match tokens::inspection_patch(&inventory) {
        Ok(p) => p,
        Err(e) => return super::internal_error("encoding the inspection failed", e),
    };
    let secrets: Api<Secret> = Api::namespaced(state.client.clone(), &record.namespace);
    match record_on_attempt(&secrets, &record, patch).await {
        Ok(_) => {
            tracing::info!(route = "/agent/inspection", machine = %record.metal_machine, host = %record.host, disks = inventory.disks.len(), client = ?ip, "inspection recorded");
            text(StatusCode::OK, "ok\n".into())
        }
        Err(CallbackWrite::Superseded) => text(
            StatusCode::CONFLICT,
            "this boot attempt was replaced or has already called back\n".into(),
        ),
        Err(CallbackWrite::Failed(e)) => {
            tracing::error!(route = "/agent/inspection", machine = %record.metal_machine, error = %e, "could not record the inspection");
            text(
                StatusCode::SERVICE_UNAVAILABLE,
                "could not record, retry\n".into(),
            )
        }
    }
}

/// `POST /agent/<token>/report`: progress while writing, then the outcome. The outcome is final
/// for the attempt; progress is written at most every few seconds.
pub(super) async fn report(
    State(state): State<Arc<BootState>>,
    Path(token): Path<String>,
    ClientIp(ip): ClientIp,
    body: axum::body::Body,
) -> Response {
    let (record, machine) = match authorize(&state, &token, ip, "/agent/report").await {
        Ok(found) => found,
        Err(response) => return response,
    };
    let body = match read_body(body, MAX_REPORT_BYTES).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let report = match serde_json::from_slice::<DeployReport>(&body) {
        Ok(r) => r.sanitized(jiff::Timestamp::now().to_string()),
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("not a report: {e}\n")),
    };
    // A cleaning attempt ends Cleaned or Failed; a deployment ends Written or Failed.
    let fits = match report.state {
        DeployState::Written => record.clean.is_none(),
        DeployState::Cleaned => record.clean.is_some(),
        DeployState::Writing | DeployState::Failed => true,
    };
    if !fits {
        return text(
            StatusCode::BAD_REQUEST,
            format!("{:?} is not an outcome of this attempt\n", report.state),
        );
    }
    if let Some(previous) = &record.deploy {
        if previous.state != DeployState::Writing {
            return text(
                StatusCode::CONFLICT,
                "this attempt's deployment already ended\n".into(),
            );
        }
        let recent = previous
            .received_at
            .as_deref()
            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
            .is_some_and(|t| {
                jiff::Timestamp::now().duration_since(t).unsigned_abs() < PROGRESS_INTERVAL
            });
        if report.state == DeployState::Writing && recent {
            return text(StatusCode::ACCEPTED, "noted\n".into());
        }
    }
    let patch = match tokens::deploy_patch(&report) {
        Ok(p) => p,
        Err(e) => return super::internal_error("encoding the report failed", e),
    };
    let secrets: Api<Secret> = Api::namespaced(state.client.clone(), &record.namespace);
    let recorded = match record_on_attempt(&secrets, &record, patch).await {
        Ok(recorded) => recorded,
        Err(CallbackWrite::Superseded) => {
            return text(
                StatusCode::CONFLICT,
                "this boot attempt was replaced or has already called back\n".into(),
            );
        }
        Err(CallbackWrite::Failed(e)) => {
            tracing::error!(route = "/agent/report", machine = %record.metal_machine, error = %e, "could not record the report");
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "could not record, retry\n".into(),
            );
        }
    };
    match report.state {
        DeployState::Writing => {}
        DeployState::Written => {
            tracing::info!(route = "/agent/report", machine = %record.metal_machine, host = %record.host, device = ?report.device, bytes = report.written_bytes, client = ?ip, "image written");
            state
                .event(
                    &machine,
                    EventType::Normal,
                    "ImageWritten",
                    format!(
                        "the deploy agent wrote {} bytes to {} of MetalHost {}",
                        report.written_bytes,
                        report.device.as_deref().unwrap_or("its disk"),
                        record.host
                    ),
                )
                .await;
        }
        DeployState::Cleaned => {
            tracing::info!(route = "/agent/report", machine = %record.metal_machine, host = %record.host, message = ?report.message, client = ?ip, "host cleaned");
            state
                .event(
                    &machine,
                    EventType::Normal,
                    "HostCleaned",
                    format!(
                        "MetalHost {}: {}",
                        record.host,
                        report.message.as_deref().unwrap_or("disks wiped")
                    ),
                )
                .await;
        }
        DeployState::Failed if record.clean.is_some() => {
            tracing::warn!(route = "/agent/report", machine = %record.metal_machine, host = %record.host, reason = ?report.reason, client = ?ip, "cleaning failed");
            state
                .event(
                    &machine,
                    EventType::Warning,
                    "HostCleaningFailed",
                    format!(
                        "MetalHost {}: {}",
                        record.host,
                        report.message.as_deref().unwrap_or("no message")
                    ),
                )
                .await;
        }
        DeployState::Failed => {
            tracing::warn!(route = "/agent/report", machine = %record.metal_machine, host = %record.host, reason = ?report.reason, client = ?ip, "image write failed");
            state
                .event(
                    &machine,
                    EventType::Warning,
                    "ImageWriteFailed",
                    format!(
                        "{}: {}",
                        report.reason.as_deref().unwrap_or("AgentFailed"),
                        report.message.as_deref().unwrap_or("no message")
                    ),
                )
                .await;
        }
    }
    if report.state != DeployState::Writing {
        let _ = state.callbacks.send(CallbackNotice {
            namespace: record.namespace.clone(),
            metal_machine: record.metal_machine.clone(),
            recorded: Some(recorded),
        });
    }
    text(StatusCode::OK, "ok\n".into())
}

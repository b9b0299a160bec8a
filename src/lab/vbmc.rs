//! The lab's virtual BMC: one Redfish service with one System per QEMU lab host. It speaks the
//! Redfish subset metalboot's driver uses (service root, sessions and basic auth, systems,
//! reset with allowed values, one-time boot override, Ethernet interfaces) — the same suite the
//! driver passes against sushy-tools runs against it. What it serves is valid Redfish: every
//! resource carries the `@odata.id`, `@odata.type`, `Id` and `Name` the schemas require, links
//! only to resources it serves, and DMTF's Redfish Service Validator passes it
//! (`tests/redfish_validator.rs`). It serves no `$metadata` or OData service document (the
//! service validator does not read them; the protocol validator would).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine;
use serde_json::{Value, json};

use crate::api::metalhost::PowerState;

use super::fleet::{PowerAction, SimHost};
use super::qemu::{BootOverride, QemuHost};

/// One system behind the virtual BMC: a QEMU lab host, or a simulated host of the fleet
/// (`lab up --simulated-hosts`), which behaves like a host without running one.
#[derive(Clone)]
pub enum LabSystem {
    Qemu(Arc<QemuHost>),
    Simulated(Arc<SimHost>),
}

impl LabSystem {
    pub fn name(&self) -> &str {
        match self {
            LabSystem::Qemu(h) => &h.spec.name,
            LabSystem::Simulated(h) => &h.name,
        }
    }

    fn uuid(&self) -> &str {
        match self {
            LabSystem::Qemu(h) => &h.spec.uuid,
            LabSystem::Simulated(h) => &h.uuid,
        }
    }

    fn mac(&self) -> &str {
        match self {
            LabSystem::Qemu(h) => &h.spec.mac,
            LabSystem::Simulated(h) => &h.mac,
        }
    }

    fn model(&self) -> &'static str {
        match self {
            LabSystem::Qemu(_) => "QEMU pc (virtual BMC)",
            LabSystem::Simulated(_) => "simulated host (metalboot fleet)",
        }
    }

    async fn power_state(&self) -> PowerState {
        match self {
            LabSystem::Qemu(h) => h.power_state().await,
            LabSystem::Simulated(h) => h.power_state(),
        }
    }

    async fn boot_override(&self) -> BootOverride {
        match self {
            LabSystem::Qemu(h) => h.boot_override().await,
            LabSystem::Simulated(h) => h.boot_override(),
        }
    }

    async fn set_boot_override(&self, boot: BootOverride) {
        match self {
            LabSystem::Qemu(h) => h.set_boot_override(boot).await,
            LabSystem::Simulated(h) => h.set_boot_override(boot),
        }
    }

    async fn act(&self, action: PowerAction) -> Result<(), String> {
        match self {
            LabSystem::Qemu(h) => match action {
                PowerAction::On => h.power_on().await,
                PowerAction::ForceOff => h.force_off().await,
                PowerAction::GracefulShutdown => h.graceful_off().await,
                PowerAction::ForceRestart => h.reset().await,
                PowerAction::PowerCycle => h.power_cycle().await,
            }
            .map_err(|e| e.to_string()),
            LabSystem::Simulated(h) => {
                h.act(action);
                Ok(())
            }
        }
    }
}

pub struct VirtualBmc {
    pub systems: BTreeMap<String, LabSystem>,
    username: String,
    password: String,
    sessions: Mutex<HashMap<String, String>>,
}

impl VirtualBmc {
    pub fn new(hosts: Vec<Arc<QemuHost>>, username: String, password: String) -> Self {
        Self::with_systems(
            hosts.into_iter().map(LabSystem::Qemu).collect(),
            username,
            password,
        )
    }

    pub fn with_systems(systems: Vec<LabSystem>, username: String, password: String) -> Self {
        VirtualBmc {
            systems: systems
                .into_iter()
                .map(|s| (s.name().to_string(), s))
                .collect(),
            username,
            password,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        if let Some(token) = headers.get("X-Auth-Token").and_then(|v| v.to_str().ok()) {
            return self
                .sessions
                .lock()
                .map(|s| s.contains_key(token))
                .unwrap_or(false);
        }
        let Some(basic) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Basic "))
        else {
            return false;
        };
        let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(basic.trim()) else {
            return false;
        };
        let expected = format!("{}:{}", self.username, self.password);
        constant_time_eq(&decoded, expected.as_bytes())
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A Redfish error body.
fn error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {
        "code": "Base.1.8.GeneralError",
        "message": message,
        "@Message.ExtendedInfo": [{"MessageId": "Base.1.8.GeneralError", "Message": message}],
    }});
    (status, axum::Json(body)).into_response()
}

/// The schema versions the resources claim (`@odata.type`): the versions whose properties they
/// carry, as DMTF's CSDL defines them.
const SERVICE_ROOT_TYPE: &str = "#ServiceRoot.v1_11_0.ServiceRoot";
const SESSION_SERVICE_TYPE: &str = "#SessionService.v1_1_8.SessionService";
const SESSION_COLLECTION_TYPE: &str = "#SessionCollection.SessionCollection";
const SESSION_TYPE: &str = "#Session.v1_7_0.Session";
const SYSTEM_COLLECTION_TYPE: &str = "#ComputerSystemCollection.ComputerSystemCollection";
const SYSTEM_TYPE: &str = "#ComputerSystem.v1_20_0.ComputerSystem";
const NIC_COLLECTION_TYPE: &str = "#EthernetInterfaceCollection.EthernetInterfaceCollection";
const NIC_TYPE: &str = "#EthernetInterface.v1_12_0.EthernetInterface";

const SESSIONS: &str = "/redfish/v1/SessionService/Sessions";

/// A Redfish resource collection: `Members` with their `@odata.id`s.
fn collection(odata_id: &str, odata_type: &str, name: &str, members: Vec<String>) -> Response {
    let members: Vec<Value> = members.iter().map(|m| json!({"@odata.id": m})).collect();
    axum::Json(json!({
        "@odata.id": odata_id,
        "@odata.type": odata_type,
        "Name": name,
        "Members@odata.count": members.len(),
        "Members": members,
    }))
    .into_response()
}

/// Serves `bmc` on a free loopback port until the process ends; returns the port.
pub async fn serve_on_loopback(bmc: Arc<VirtualBmc>) -> std::io::Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move { axum::serve(listener, router(bmc)).await });
    Ok(port)
}

pub fn router(bmc: Arc<VirtualBmc>) -> Router {
    let protected = Router::new()
        .route("/redfish/v1/SessionService", get(session_service))
        .route(
            "/redfish/v1/SessionService/Sessions/{id}",
            get(session).delete(logout),
        )
        .route("/redfish/v1/Systems", get(systems))
        .route("/redfish/v1/Systems/{id}", get(system).patch(patch_system))
        .route(
            "/redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset",
            post(reset),
        )
        .route("/redfish/v1/Systems/{id}/EthernetInterfaces", get(nics))
        .route(
            "/redfish/v1/Systems/{id}/EthernetInterfaces/{nic}",
            get(nic),
        )
        .layer(middleware::from_fn_with_state(bmc.clone(), require_auth))
        .layer(middleware::from_fn_with_state(
            bmc.clone(),
            simulated_faults,
        ));
    Router::new()
        .route("/redfish/v1", get(root))
        .route("/redfish/v1/", get(root))
        .route(
            "/redfish/v1/SessionService/Sessions",
            post(login).get(list_sessions),
        )
        .merge(protected)
        .with_state(bmc)
}

async fn require_auth(
    State(bmc): State<Arc<VirtualBmc>>,
    request: Request,
    next: Next,
) -> Response {
    if bmc.authorized(request.headers()) {
        next.run(request).await
    } else {
        let mut r = error(StatusCode::UNAUTHORIZED, "authentication required");
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"metalboot-lab\""),
        );
        r
    }
}

/// Requests for a simulated system are counted, and its fault applied (a slow or failing BMC),
/// before anything else: a real BMC that is slow is slow for the login too.
async fn simulated_faults(
    State(bmc): State<Arc<VirtualBmc>>,
    request: Request,
    next: Next,
) -> Response {
    let id = request
        .uri()
        .path()
        .strip_prefix("/redfish/v1/Systems/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default();
    let Some(LabSystem::Simulated(sim)) = bmc.systems.get(id).cloned() else {
        return next.run(request).await;
    };
    let _in_flight = sim.bmc_request();
    if let Some(delay) = sim.bmc_delay() {
        tokio::time::sleep(delay).await;
    }
    if sim.bmc_fails() {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "simulated BMC failure (fleet fault)",
        );
    }
    next.run(request).await
}

async fn root() -> Response {
    axum::Json(json!({
        "@odata.id": "/redfish/v1/",
        "@odata.type": SERVICE_ROOT_TYPE,
        "Id": "RootService",
        "Name": "metalboot lab BMC",
        "RedfishVersion": "1.15.0",
        "Systems": {"@odata.id": "/redfish/v1/Systems"},
        "SessionService": {"@odata.id": "/redfish/v1/SessionService"},
        "Links": {"Sessions": {"@odata.id": SESSIONS}},
    }))
    .into_response()
}

async fn session_service() -> Response {
    axum::Json(json!({
        "@odata.id": "/redfish/v1/SessionService",
        "@odata.type": SESSION_SERVICE_TYPE,
        "Id": "SessionService",
        "Name": "Session Service",
        "ServiceEnabled": true,
        "Sessions": {"@odata.id": SESSIONS},
    }))
    .into_response()
}

/// A session resource, as a login returns it and a GET reads it. The password is never shown.
fn session_body(id: &str, user: &str) -> Value {
    json!({
        "@odata.id": format!("{SESSIONS}/{id}"),
        "@odata.type": SESSION_TYPE,
        "Id": id,
        "Name": "User Session",
        "UserName": user,
        "Password": null,
    })
}

async fn login(State(bmc): State<Arc<VirtualBmc>>, body: axum::body::Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "malformed JSON");
    };
    let user = v
        .get("UserName")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let pass = v
        .get("Password")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if !(constant_time_eq(user.as_bytes(), bmc.username.as_bytes())
        && constant_time_eq(pass.as_bytes(), bmc.password.as_bytes()))
    {
        return error(StatusCode::UNAUTHORIZED, "invalid credentials");
    }
    let token = crate::boot::tokens::Token::mint().expose().to_string();
    let id = format!("{:08x}", rand::random::<u32>());
    if let Ok(mut sessions) = bmc.sessions.lock() {
        sessions.insert(token.clone(), id.clone());
    }
    let location = format!("{SESSIONS}/{id}");
    let mut r = (StatusCode::CREATED, axum::Json(session_body(&id, user))).into_response();
    if let (Ok(t), Ok(l)) = (
        HeaderValue::from_str(&token),
        HeaderValue::from_str(&location),
    ) {
        r.headers_mut().insert("X-Auth-Token", t);
        r.headers_mut().insert(header::LOCATION, l);
    }
    r
}

async fn list_sessions(State(bmc): State<Arc<VirtualBmc>>, headers: HeaderMap) -> Response {
    if !bmc.authorized(&headers) {
        return error(StatusCode::UNAUTHORIZED, "authentication required");
    }
    let mut ids: Vec<String> = bmc
        .sessions
        .lock()
        .map(|s| s.values().cloned().collect())
        .unwrap_or_default();
    ids.sort();
    let members = ids.iter().map(|id| format!("{SESSIONS}/{id}")).collect();
    collection(
        SESSIONS,
        SESSION_COLLECTION_TYPE,
        "Session Collection",
        members,
    )
}

async fn session(State(bmc): State<Arc<VirtualBmc>>, Path(id): Path<String>) -> Response {
    let known = bmc
        .sessions
        .lock()
        .map(|s| s.values().any(|v| *v == id))
        .unwrap_or(false);
    if !known {
        return error(StatusCode::NOT_FOUND, "no such session");
    }
    // One account: every session is its user's.
    axum::Json(session_body(&id, &bmc.username)).into_response()
}

async fn logout(State(bmc): State<Arc<VirtualBmc>>, Path(id): Path<String>) -> Response {
    let removed = bmc
        .sessions
        .lock()
        .map(|mut s| {
            let before = s.len();
            s.retain(|_, v| *v != id);
            before != s.len()
        })
        .unwrap_or(false);
    if removed {
        StatusCode::NO_CONTENT.into_response()
    } else {
        error(StatusCode::NOT_FOUND, "no such session")
    }
}

async fn systems(State(bmc): State<Arc<VirtualBmc>>) -> Response {
    let members = bmc
        .systems
        .keys()
        .map(|id| format!("/redfish/v1/Systems/{id}"))
        .collect();
    collection(
        "/redfish/v1/Systems",
        SYSTEM_COLLECTION_TYPE,
        "Computer System Collection",
        members,
    )
}

fn host(bmc: &VirtualBmc, id: &str) -> Option<LabSystem> {
    bmc.systems.get(id).cloned()
}

fn no_system(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, &format!("no system {id}"))
}

const RESET_TYPES: [&str; 5] = [
    "On",
    "ForceOff",
    "GracefulShutdown",
    "ForceRestart",
    "PowerCycle",
];
/// `UefiHttp` boots the NIC like `Pxe`: which protocol runs is the host's firmware's choice
/// (the lab's HTTP Boot host has PXE switched off).
const BOOT_TARGETS: [&str; 5] = ["None", "Pxe", "UefiHttp", "Hdd", "Cd"];

async fn system(State(bmc): State<Arc<VirtualBmc>>, Path(id): Path<String>) -> Response {
    let Some(h) = host(&bmc, &id) else {
        return no_system(&id);
    };
    let power = match h.power_state().await {
        PowerState::On => "On",
        PowerState::Off => "Off",
        PowerState::PoweringOn => "PoweringOn",
        PowerState::PoweringOff => "PoweringOff",
        PowerState::Unknown => "Unknown",
    };
    let boot = h.boot_override().await;
    axum::Json(json!({
        "@odata.id": format!("/redfish/v1/Systems/{id}"),
        "@odata.type": SYSTEM_TYPE,
        "Id": id,
        "Name": id,
        "Manufacturer": "metalboot lab",
        "Model": h.model(),
        "SerialNumber": format!("LAB-{}", h.uuid().rsplit('-').next().unwrap_or_default()),
        "UUID": h.uuid(),
        "BiosVersion": "SeaBIOS (QEMU)",
        "PowerState": power,
        "Boot": {
            "BootSourceOverrideTarget": boot.target,
            "BootSourceOverrideEnabled": boot.enabled,
            "BootSourceOverrideMode": boot.mode,
            "BootSourceOverrideTarget@Redfish.AllowableValues": BOOT_TARGETS,
            "BootSourceOverrideMode@Redfish.AllowableValues": ["Legacy", "UEFI"],
        },
        "EthernetInterfaces": {"@odata.id": format!("/redfish/v1/Systems/{id}/EthernetInterfaces")},
        "Actions": {"#ComputerSystem.Reset": {
            "target": format!("/redfish/v1/Systems/{id}/Actions/ComputerSystem.Reset"),
            "ResetType@Redfish.AllowableValues": RESET_TYPES,
        }},
    }))
    .into_response()
}

async fn patch_system(
    State(bmc): State<Arc<VirtualBmc>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Some(h) = host(&bmc, &id) else {
        return no_system(&id);
    };
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "malformed JSON");
    };
    let Some(boot) = v.get("Boot") else {
        return error(StatusCode::BAD_REQUEST, "only Boot can be changed");
    };
    let mut current = h.boot_override().await;
    if let Some(t) = boot.get("BootSourceOverrideTarget").and_then(Value::as_str) {
        if !BOOT_TARGETS.contains(&t) {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("BootSourceOverrideTarget {t} is not supported"),
            );
        }
        current.target = t.to_string();
    }
    if let Some(e) = boot
        .get("BootSourceOverrideEnabled")
        .and_then(Value::as_str)
    {
        if !["Once", "Continuous", "Disabled"].contains(&e) {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("BootSourceOverrideEnabled {e} is not supported"),
            );
        }
        current.enabled = e.to_string();
    }
    if let Some(m) = boot.get("BootSourceOverrideMode").and_then(Value::as_str) {
        if m != "Legacy" && m != "UEFI" {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("BootSourceOverrideMode {m} is not supported"),
            );
        }
        current.mode = m.to_string();
    }
    h.set_boot_override(BootOverride { ..current }).await;
    StatusCode::NO_CONTENT.into_response()
}

async fn reset(
    State(bmc): State<Arc<VirtualBmc>>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    let Some(h) = host(&bmc, &id) else {
        return no_system(&id);
    };
    let reset_type = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| {
            v.get("ResetType")
                .and_then(Value::as_str)
                .map(str::to_string)
        })
        .unwrap_or_default();
    let action = match reset_type.as_str() {
        "On" => PowerAction::On,
        "ForceOff" => PowerAction::ForceOff,
        "GracefulShutdown" => PowerAction::GracefulShutdown,
        "ForceRestart" => PowerAction::ForceRestart,
        "PowerCycle" => PowerAction::PowerCycle,
        other => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("ResetType {other:?} is not one of {RESET_TYPES:?}"),
            );
        }
    };
    match h.act(action).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, &e),
    }
}

async fn nics(State(bmc): State<Arc<VirtualBmc>>, Path(id): Path<String>) -> Response {
    if host(&bmc, &id).is_none() {
        return no_system(&id);
    }
    collection(
        &format!("/redfish/v1/Systems/{id}/EthernetInterfaces"),
        NIC_COLLECTION_TYPE,
        "Ethernet Network Interface Collection",
        vec![format!("/redfish/v1/Systems/{id}/EthernetInterfaces/nic0")],
    )
}

async fn nic(
    State(bmc): State<Arc<VirtualBmc>>,
    Path((id, nic)): Path<(String, String)>,
) -> Response {
    let Some(h) = host(&bmc, &id) else {
        return no_system(&id);
    };
    if nic != "nic0" {
        return error(StatusCode::NOT_FOUND, &format!("no interface {nic}"));
    }
    axum::Json(json!({
        "@odata.id": format!("/redfish/v1/Systems/{id}/EthernetInterfaces/nic0"),
        "@odata.type": NIC_TYPE,
        "Id": "nic0",
        "Name": "Ethernet Interface nic0",
        "MACAddress": h.mac(),
        "PermanentMACAddress": h.mac(),
    }))
    .into_response()
}

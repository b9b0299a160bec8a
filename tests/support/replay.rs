//! A small Redfish server that replays real vendors' replies (the JSON samples
//! `hack/redfish-replay.sh` fetches: Dell iDRAC, HPE iLO, sushy's generic service) with scripted
//! behaviours on top — sessions at the vendor's own path, ETags that a PATCH must match, reset
//! types only in an ActionInfo resource, busy answers with Retry-After. Documents are served at
//! their own `@odata.id` (trailing slashes and all); power and boot override are live state.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

pub const USER: &str = "replay-admin";
pub const PASSWORD: &str = "replay-pw-7731";

/// Scripted behaviours a personality adds to its vendor's documents.
#[derive(Clone, Debug, Default)]
pub struct Behaviour {
    /// The system carries an ETag; a PATCH without the current one gets 412.
    pub etag_required: bool,
    /// Reset types only through an ActionInfo resource (no inline AllowableValues).
    pub action_info: bool,
    /// The first request of each method is answered 503 with `Retry-After: 1`.
    pub busy_first: bool,
    /// A settings object (this sample file) for the system: the boot properties it carries are
    /// refused on the system and applied from the settings object at the next reset.
    pub settings: Option<&'static str>,
    /// Resets answer 202 with a task monitor that runs for one poll before the power changes.
    pub task_monitor: bool,
    /// The override's allowable values leave `Once` out (`Continuous`, `Disabled`): a PATCH of
    /// `Once` is refused, as a value not in the list.
    pub once_not_offered: bool,
}

pub struct Personality {
    pub name: &'static str,
    /// Sample directory under target/tools/replay; its `root.json`, `system.json` and
    /// `manager.json` are the service.
    pub dir: &'static str,
    /// A key inside `system.json` (proliantutils keeps variants in one file).
    pub system_key: Option<&'static str>,
    pub behaviour: Behaviour,
}

fn personality(name: &'static str, dir: &'static str, behaviour: Behaviour) -> Personality {
    Personality {
        name,
        dir,
        system_key: None,
        behaviour,
    }
}

pub fn personalities() -> Vec<Personality> {
    vec![
        personality(
            "Dell iDRAC (sushy-oem-idrac samples)",
            "idrac",
            Behaviour::default(),
        ),
        Personality {
            system_key: Some("default"),
            ..personality(
                "HPE iLO 5 (proliantutils samples), ETag required",
                "ilo",
                Behaviour {
                    etag_required: true,
                    ..Default::default()
                },
            )
        },
        personality(
            "generic (sushy samples), reset types only in ActionInfo",
            "sushy",
            Behaviour {
                action_info: true,
                ..Default::default()
            },
        ),
        personality(
            "Dell iDRAC with a settings object for the boot mode (sushy samples)",
            "idrac",
            Behaviour {
                settings: Some("settings-body-bootsourceoverridemode-only.json"),
                task_monitor: true,
                ..Default::default()
            },
        ),
        personality(
            "generic (sushy samples), busy: 503 + Retry-After on first requests",
            "sushy",
            Behaviour {
                busy_first: true,
                ..Default::default()
            },
        ),
    ]
}

pub fn samples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tools/replay")
}

fn norm(path: &str) -> String {
    let p = path.split(['?', '#']).next().unwrap_or_default();
    let p = p.trim_end_matches('/');
    if p.is_empty() { "/".into() } else { p.into() }
}

struct Inner {
    docs: BTreeMap<String, Value>,
    system: String,
    reset_target: String,
    reset_types: Vec<Value>,
    sessions_path: String,
    behaviour: Behaviour,
    version: u64,
    tokens: Vec<String>,
    busy_seen: Vec<String>,
    /// The settings object's path, and what was PATCHed to it (applied at the next reset).
    settings: Option<String>,
    pending: serde_json::Map<String, Value>,
    /// Task monitors: polls left before each completes, and the power state it then sets.
    tasks: Vec<(u32, String)>,
    /// Every request: method and path.
    pub log: Vec<(String, String, u16)>,
}

#[derive(Clone)]
pub struct Replay {
    inner: Arc<Mutex<Inner>>,
    pub port: u16,
}

impl Replay {
    pub fn system_path(&self) -> String {
        self.inner.lock().unwrap().system.clone()
    }

    pub fn log(&self) -> Vec<(String, String, u16)> {
        self.inner.lock().unwrap().log.clone()
    }

    pub fn power(&self) -> String {
        let i = self.inner.lock().unwrap();
        i.docs[&i.system]["PowerState"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    pub fn boot(&self) -> Value {
        let i = self.inner.lock().unwrap();
        i.docs[&i.system]["Boot"].clone()
    }
}

fn load(p: &Personality, file: &str) -> Value {
    load_sample(p.dir, file)
}

/// A sample from one package's directory under target/tools/replay.
fn load_sample(dir: &str, file: &str) -> Value {
    let path = samples_dir().join(dir).join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run hack/redfish-replay.sh)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Starts a replay server for `p` on loopback.
pub async fn start(p: &Personality) -> Replay {
    let root = load(p, "root.json");
    let mut system = load(p, "system.json");
    if let Some(key) = p.system_key {
        system = system[key].clone();
    }
    let system_path = norm(system["@odata.id"].as_str().expect("system @odata.id"));
    let systems_path = norm(
        root["Systems"]["@odata.id"]
            .as_str()
            .unwrap_or("/redfish/v1/Systems"),
    );
    let sessions_path = norm(
        root.pointer("/Links/Sessions/@odata.id")
            .and_then(Value::as_str)
            .unwrap_or("/redfish/v1/SessionService/Sessions"),
    );
    // A known starting point: off, no override, a NIC with a MAC.
    system["PowerState"] = json!("Off");
    system["Boot"]["BootSourceOverrideEnabled"] = json!("Disabled");
    system["Boot"]["BootSourceOverrideTarget"] = json!("None");
    if system["Boot"]
        .get("BootSourceOverrideTarget@Redfish.AllowableValues")
        .is_none()
    {
        system["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"] =
            json!(["None", "Pxe", "Hdd", "Cd"]);
    }
    if p.behaviour.once_not_offered {
        system["Boot"]["BootSourceOverrideEnabled@Redfish.AllowableValues"] =
            json!(["Continuous", "Disabled"]);
    }
    let reset = system
        .pointer("/Actions/#ComputerSystem.Reset")
        .cloned()
        .expect("a reset action");
    let reset_target = norm(reset["target"].as_str().expect("reset target"));
    let mut docs = BTreeMap::new();
    let mut settings_path = None;
    if let Some(file) = p.behaviour.settings {
        // The settings sample is sushy's (an iDRAC reply in its test data).
        let settings = load_sample("sushy", file);
        let path = norm(settings["@odata.id"].as_str().expect("settings @odata.id"));
        system["@Redfish.Settings"] = json!({"SettingsObject": {"@odata.id": path}});
        docs.insert(path.clone(), settings);
        settings_path = Some(path);
    }
    if p.behaviour.action_info {
        let types = reset["ResetType@Redfish.AllowableValues"].clone();
        let info = format!("{system_path}/ResetActionInfo");
        let action = system
            .pointer_mut("/Actions/#ComputerSystem.Reset")
            .and_then(Value::as_object_mut)
            .expect("reset action object");
        action.remove("ResetType@Redfish.AllowableValues");
        action.insert("@Redfish.ActionInfo".into(), json!(info));
        docs.insert(
            info.clone(),
            json!({"@odata.id": info, "Id": "ResetActionInfo", "Name": "Reset Action Info",
                "Parameters": [{"Name": "ResetType", "Required": true, "DataType": "String",
                    "AllowableValues": types}]}),
        );
    }
    if let Some(nics) = system
        .pointer("/EthernetInterfaces/@odata.id")
        .and_then(Value::as_str)
    {
        let nics = norm(nics);
        let nic = format!("{nics}/1");
        docs.insert(
            nics.clone(),
            json!({"@odata.id": nics, "Members": [{"@odata.id": nic}], "Members@odata.count": 1}),
        );
        docs.insert(
            nic.clone(),
            json!({"@odata.id": nic, "Id": "1", "MACAddress": "52:54:00:aa:bb:01"}),
        );
    }
    let manager = load(p, "manager.json");
    if let Some(id) = manager["@odata.id"].as_str() {
        docs.insert(norm(id), manager);
    }
    docs.insert(
        systems_path.clone(),
        json!({"@odata.id": systems_path, "Members": [{"@odata.id": system_path}], "Members@odata.count": 1}),
    );
    docs.insert("/redfish/v1".into(), root);
    docs.insert(system_path.clone(), system);
    let inner = Arc::new(Mutex::new(Inner {
        docs,
        system: system_path,
        reset_target,
        reset_types: reset["ResetType@Redfish.AllowableValues"]
            .as_array()
            .cloned()
            .unwrap_or_default(),
        sessions_path,
        behaviour: p.behaviour.clone(),
        version: 1,
        tokens: Vec::new(),
        busy_seen: Vec::new(),
        settings: settings_path,
        pending: serde_json::Map::new(),
        tasks: Vec::new(),
        log: Vec::new(),
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let app = Router::new().fallback(handle).with_state(inner.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    Replay { inner, port }
}

fn error(status: StatusCode, id: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({"error": {"code": id, "message": message,
            "@Message.ExtendedInfo": [{"MessageId": id, "Message": message}]}})),
    )
        .into_response()
}

fn authorized(inner: &Inner, headers: &HeaderMap) -> bool {
    let basic = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        format!("{USER}:{PASSWORD}"),
    );
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or("");
    header("authorization") == format!("Basic {basic}")
        || inner.tokens.iter().any(|t| t == header("x-auth-token"))
}

async fn handle(
    State(inner): State<Arc<Mutex<Inner>>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = norm(uri.path());
    let response = respond(&inner, &method, &path, &headers, &body);
    if let Ok(mut i) = inner.lock() {
        i.log
            .push((method.to_string(), path, response.status().as_u16()));
    }
    response
}

fn respond(
    inner: &Arc<Mutex<Inner>>,
    method: &Method,
    path: &str,
    headers: &HeaderMap,
    body: &Bytes,
) -> Response {
    let Ok(mut i) = inner.lock() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    if i.behaviour.busy_first && !i.busy_seen.contains(&method.to_string()) {
        i.busy_seen.push(method.to_string());
        let mut r = error(
            StatusCode::SERVICE_UNAVAILABLE,
            "Base.1.8.ServiceTemporarilyUnavailable",
            "busy, retry later",
        );
        r.headers_mut()
            .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        return r;
    }
    let body: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    // The service root is public, as the spec says; everything else needs credentials.
    if path == "/redfish/v1" && method == Method::GET {
        return axum::Json(i.docs["/redfish/v1"].clone()).into_response();
    }
    if path == i.sessions_path && method == Method::POST {
        if body["UserName"] != json!(USER) || body["Password"] != json!(PASSWORD) {
            return error(
                StatusCode::UNAUTHORIZED,
                "Base.1.8.NoValidSession",
                "bad credentials",
            );
        }
        let token = format!("token-{}", i.tokens.len() + 1);
        i.tokens.push(token.clone());
        let location = format!("{}/{}", i.sessions_path, i.tokens.len());
        let mut r = (
            StatusCode::CREATED,
            axum::Json(json!({"@odata.id": location})),
        )
            .into_response();
        r.headers_mut()
            .insert("x-auth-token", token.parse().expect("header"));
        r.headers_mut()
            .insert("location", location.parse().expect("header"));
        return r;
    }
    if !authorized(&i, headers) {
        return error(
            StatusCode::UNAUTHORIZED,
            "Base.1.8.NoValidSession",
            "authentication required",
        );
    }
    if method == Method::DELETE && path.starts_with(&i.sessions_path) {
        return StatusCode::NO_CONTENT.into_response();
    }
    let system = i.system.clone();
    let etag = format!("W/\"{}\"", i.version);
    match (method.clone(), path) {
        (Method::GET, p) if p.starts_with("/redfish/v1/TaskService/TaskMonitors/") => {
            let n: usize = p
                .rsplit('/')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let Some((left, state)) = i.tasks.get(n).cloned() else {
                return error(
                    StatusCode::NOT_FOUND,
                    "Base.1.8.ResourceMissingAtURI",
                    "no such task",
                );
            };
            if left > 0 {
                i.tasks[n].0 -= 1;
                return (
                    StatusCode::ACCEPTED,
                    axum::Json(json!({"TaskState": "Running"})),
                )
                    .into_response();
            }
            if let Some(doc) = i.docs.get_mut(&system) {
                doc["PowerState"] = json!(state);
            }
            axum::Json(json!({"TaskState": "Completed", "TaskStatus": "OK"})).into_response()
        }
        (Method::GET, p) => match i.docs.get(p) {
            Some(doc) => {
                let mut r = axum::Json(doc.clone()).into_response();
                if p == system && i.behaviour.etag_required {
                    r.headers_mut()
                        .insert("etag", etag.parse().expect("header"));
                }
                r
            }
            None => error(
                StatusCode::NOT_FOUND,
                "Base.1.8.ResourceMissingAtURI",
                "no such resource",
            ),
        },
        (Method::PATCH, p) if Some(p) == i.settings.as_deref() => {
            let carried = i.docs[p]["Boot"].clone();
            match body.get("Boot").and_then(Value::as_object) {
                Some(boot) if boot.keys().all(|k| carried.get(k).is_some()) => {
                    for (k, v) in boot {
                        i.pending.insert(k.clone(), v.clone());
                    }
                    StatusCode::ACCEPTED.into_response()
                }
                _ => error(
                    StatusCode::BAD_REQUEST,
                    "Base.1.8.PropertyUnknown",
                    "not a setting",
                ),
            }
        }
        (Method::PATCH, p) if p == system => {
            if let Some(settings) = i.settings.clone()
                && let Some(boot) = body.get("Boot").and_then(Value::as_object)
                && boot
                    .keys()
                    .any(|k| i.docs[&settings]["Boot"].get(k).is_some())
            {
                return error(
                    StatusCode::BAD_REQUEST,
                    "Base.1.8.PropertyNotWritable",
                    "set this through the settings object",
                );
            }
            let matches =
                headers.get("if-match").and_then(|v| v.to_str().ok()) == Some(etag.as_str());
            if i.behaviour.etag_required && !matches {
                return error(
                    StatusCode::PRECONDITION_FAILED,
                    "Base.1.8.PreconditionFailed",
                    "ETag does not match",
                );
            }
            let allowed =
                i.docs[&system]["Boot"]["BootSourceOverrideTarget@Redfish.AllowableValues"].clone();
            let enabled_allowed = i.docs[&system]["Boot"]
                .get("BootSourceOverrideEnabled@Redfish.AllowableValues")
                .cloned();
            if let Some(boot) = body.get("Boot").and_then(Value::as_object) {
                if let Some(t) = boot.get("BootSourceOverrideTarget")
                    && !allowed.as_array().is_some_and(|a| a.contains(t))
                {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "Base.1.8.PropertyValueNotInList",
                        "target not allowed",
                    );
                }
                if let (Some(e), Some(list)) =
                    (boot.get("BootSourceOverrideEnabled"), &enabled_allowed)
                    && !list.as_array().is_some_and(|a| a.contains(e))
                {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "Base.1.8.PropertyValueNotInList",
                        "BootSourceOverrideEnabled not allowed",
                    );
                }
                for (k, v) in boot {
                    if let Some(doc) = i.docs.get_mut(&system) {
                        doc["Boot"][k] = v.clone();
                    }
                }
                i.version += 1;
                return StatusCode::NO_CONTENT.into_response();
            }
            error(
                StatusCode::BAD_REQUEST,
                "Base.1.8.PropertyUnknown",
                "only Boot",
            )
        }
        (Method::POST, p) if p == i.reset_target => {
            let reset = body["ResetType"].as_str().unwrap_or("").to_string();
            if !i.reset_types.contains(&json!(reset)) {
                return error(
                    StatusCode::BAD_REQUEST,
                    "Base.1.8.ActionParameterValueNotInList",
                    "ResetType not offered",
                );
            }
            let state = match reset.as_str() {
                "On" | "ForceOn" | "ForceRestart" | "GracefulRestart" | "PowerCycle" => "On",
                "ForceOff" | "GracefulShutdown" => "Off",
                "PushPowerButton" => {
                    if i.docs[&system]["PowerState"] == json!("On") {
                        "Off"
                    } else {
                        "On"
                    }
                }
                _ => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "Base.1.8.ActionParameterValueNotInList",
                        "unknown ResetType",
                    );
                }
            };
            let pending = std::mem::take(&mut i.pending);
            let task = i.behaviour.task_monitor;
            if let Some(doc) = i.docs.get_mut(&system) {
                if !task {
                    doc["PowerState"] = json!(state);
                }
                for (k, v) in pending {
                    doc["Boot"][k] = v;
                }
            }
            i.version += 1;
            if task {
                i.tasks.push((1, state.to_string()));
                let monitor = format!("/redfish/v1/TaskService/TaskMonitors/{}", i.tasks.len() - 1);
                let mut r = StatusCode::ACCEPTED.into_response();
                r.headers_mut()
                    .insert("location", monitor.parse().expect("header"));
                return r;
            }
            StatusCode::NO_CONTENT.into_response()
        }
        _ => error(
            StatusCode::METHOD_NOT_ALLOWED,
            "Base.1.8.OperationNotAllowed",
            "not allowed",
        ),
    }
}

//! A loopback HTTP/1.1 proxy in front of a Redfish emulator that injects faults (503, dropped
//! connections, stalls, malformed JSON, expired sessions), records every request and the maximum
//! number of requests in flight, and — because sushy-tools 2.2.0 has no SessionService — can add
//! a Redfish session layer (`X-Auth-Token`) translated to the emulator's HTTP basic auth.
//!
//! Raw TCP, one request per connection (`Connection: close`), so a dropped connection is exactly
//! one dropped request.
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this status and a Redfish error body.
    Status(u16),
    /// Read the request, then close the connection without answering.
    Drop,
    /// Wait this long before forwarding.
    Stall(Duration),
    /// Forward, then replace the body with truncated JSON (status 200).
    MalformedJson,
}

#[derive(Clone, Debug)]
pub struct LogEntry {
    pub method: String,
    pub path: String,
    /// HTTP status answered, or 0 when the connection was dropped.
    pub status: u16,
    pub fault: Option<Fault>,
}

struct Rule {
    method: Option<String>,
    path_prefix: String,
    fault: Fault,
    remaining: usize,
}

struct Session {
    id: String,
    basic: String,
}

struct State {
    upstream: String,
    client: reqwest::Client,
    sessions_enabled: bool,
    rules: Mutex<VecDeque<Rule>>,
    sessions: Mutex<HashMap<String, Session>>,
    next_id: AtomicU64,
    log: Mutex<Vec<LogEntry>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<State>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Request {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn error_body(message: &str) -> Vec<u8> {
    serde_json::json!({"error": {"code": "Base.1.0.GeneralError", "message": message,
        "@Message.ExtendedInfo": [{"MessageId": "Base.1.0.GeneralError", "Message": message}]}})
    .to_string()
    .into_bytes()
}

fn json_response(status: u16, body: Vec<u8>) -> Response {
    Response {
        status,
        headers: vec![("Content-Type".into(), "application/json".into())],
        body,
    }
}

#[derive(Clone)]
pub struct ProxyLog(Arc<State>);

impl ProxyLog {
    pub fn count(&self, method: &str, path_prefix: &str) -> usize {
        self.0
            .log
            .lock()
            .expect("log")
            .iter()
            .filter(|e| e.method == method && e.path.starts_with(path_prefix))
            .count()
    }
}

impl FaultProxy {
    /// Start a proxy to `upstream` (an `http://` base URL) on a free loopback port.
    pub async fn start(upstream: &str, sessions: bool) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fault proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(State {
            upstream: upstream.trim_end_matches('/').to_string(),
            client: reqwest::Client::builder()
                .danger_accept_invalid_certs(true)
                .build()
                .expect("proxy client"),
            sessions_enabled: sessions,
            rules: Mutex::new(VecDeque::new()),
            sessions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            log: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let st = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = handle(st, sock).await;
                });
            }
        });
        FaultProxy { addr, state, task }
    }

    /// `redfish+http://127.0.0.1:<port>` plus `path`.
    pub fn address(&self, path: &str) -> String {
        format!("redfish+http://{}{}", self.addr, path)
    }

    /// Inject `fault` into the next `count` requests whose path starts with `path_prefix`
    /// (and whose method is `method`, when given).
    pub fn inject(&self, method: Option<&str>, path_prefix: &str, fault: Fault, count: usize) {
        self.state.rules.lock().expect("rules").push_back(Rule {
            method: method.map(str::to_string),
            path_prefix: path_prefix.to_string(),
            fault,
            remaining: count,
        });
    }

    pub fn clear_faults(&self) {
        self.state.rules.lock().expect("rules").clear();
    }

    /// Forget all sessions: the next request with an old token gets 401.
    pub fn expire_sessions(&self) {
        self.state.sessions.lock().expect("sessions").clear();
    }

    pub fn session_count(&self) -> usize {
        self.state.sessions.lock().expect("sessions").len()
    }

    pub fn log(&self) -> Vec<LogEntry> {
        self.state.log.lock().expect("log").clone()
    }

    pub fn count(&self, method: &str, path_prefix: &str) -> usize {
        self.log_handle().count(method, path_prefix)
    }

    /// The request log, readable from another task.
    pub fn log_handle(&self) -> ProxyLog {
        ProxyLog(self.state.clone())
    }

    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }
}

async fn read_request(sock: &mut TcpStream) -> Option<Request> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let header_end = loop {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(pos) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break pos + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let method = first.next()?.to_string();
    let path = first.next()?.to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[header_end..].to_vec();
    while body.len() < len {
        let n = sock.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Request {
        method,
        path,
        headers,
        body,
    })
}

async fn write_response(sock: &mut TcpStream, resp: &Response) {
    let reason = reqwest::StatusCode::from_u16(resp.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Status");
    let mut out = format!("HTTP/1.1 {} {}\r\n", resp.status, reason);
    for (k, v) in &resp.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        resp.body.len()
    ));
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&resp.body);
    let _ = sock.write_all(&bytes).await;
    let _ = sock.shutdown().await;
}

fn take_fault(st: &State, req: &Request) -> Option<Fault> {
    let mut rules = st.rules.lock().expect("rules");
    let idx = rules.iter().position(|r| {
        r.remaining > 0
            && req.path.starts_with(&r.path_prefix)
            && r.method.as_deref().is_none_or(|m| m == req.method)
    })?;
    let rule = &mut rules[idx];
    rule.remaining -= 1;
    let fault = rule.fault.clone();
    if rule.remaining == 0 {
        rules.remove(idx);
    }
    Some(fault)
}

async fn handle(st: Arc<State>, mut sock: TcpStream) -> Option<()> {
    let req = read_request(&mut sock).await?;
    let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    st.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let fault = take_fault(&st, &req);
    let resp = match &fault {
        Some(Fault::Drop) => None,
        Some(Fault::Status(code)) => Some(json_response(
            *code,
            error_body(&format!("injected HTTP {code}")),
        )),
        Some(Fault::Stall(d)) => {
            tokio::time::sleep(*d).await;
            Some(serve(&st, &req).await)
        }
        Some(Fault::MalformedJson) => {
            let mut r = serve(&st, &req).await;
            r.status = 200;
            r.body =
                br#"{"@odata.id": "/redfish/v1/Systems/x", "PowerState": "On", "Boot": {"#.to_vec();
            r.headers = vec![("Content-Type".into(), "application/json".into())];
            Some(r)
        }
        None => Some(serve(&st, &req).await),
    };
    st.log.lock().expect("log").push(LogEntry {
        method: req.method.clone(),
        path: req.path.clone(),
        status: resp.as_ref().map(|r| r.status).unwrap_or(0),
        fault: fault.clone(),
    });
    // Leave the in-flight window before the client can see the answer.
    st.in_flight.fetch_sub(1, Ordering::SeqCst);
    match resp {
        Some(r) => write_response(&mut sock, &r).await,
        None => drop(sock),
    }
    Some(())
}

const SESSIONS: &str = "/redfish/v1/SessionService/Sessions";

async fn serve(st: &State, req: &Request) -> Response {
    if !st.sessions_enabled {
        return forward(st, req, req.header("Authorization").map(str::to_string)).await;
    }
    let path = req.path.trim_end_matches('/');
    // Authorization for the upstream: a known token becomes basic auth; unknown token → 401.
    let auth = match req.header("X-Auth-Token") {
        Some(token) => match st.sessions.lock().expect("sessions").get(token) {
            Some(s) => Some(s.basic.clone()),
            None => return json_response(401, error_body("session expired or unknown")),
        },
        None => req.header("Authorization").map(str::to_string),
    };
    match (req.method.as_str(), path) {
        ("GET", "/redfish/v1") => {
            let mut r = forward(st, req, None).await;
            if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&r.body) {
                v["SessionService"] =
                    serde_json::json!({"@odata.id": "/redfish/v1/SessionService"});
                v["Links"] = serde_json::json!({"Sessions": {"@odata.id": SESSIONS}});
                r.body = v.to_string().into_bytes();
            }
            r
        }
        ("POST", SESSIONS) => {
            let v: serde_json::Value = serde_json::from_slice(&req.body).unwrap_or_default();
            let user = v["UserName"].as_str().unwrap_or_default();
            let pass = v["Password"].as_str().unwrap_or_default();
            let basic = format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}"))
            );
            let check = Request {
                method: "GET".into(),
                path: "/redfish/v1/Systems".into(),
                headers: Vec::new(),
                body: Vec::new(),
            };
            let r = forward(st, &check, Some(basic.clone())).await;
            if r.status != 200 {
                return json_response(401, error_body("Incorrect username or password"));
            }
            let id = st.next_id.fetch_add(1, Ordering::SeqCst).to_string();
            let token = format!("tok-{id}-{}", rand::random::<u64>());
            st.sessions.lock().expect("sessions").insert(
                token.clone(),
                Session {
                    id: id.clone(),
                    basic,
                },
            );
            Response {
                status: 201,
                headers: vec![
                    ("Content-Type".into(), "application/json".into()),
                    ("X-Auth-Token".into(), token),
                    ("Location".into(), format!("{SESSIONS}/{id}")),
                ],
                body: serde_json::json!({"@odata.id": format!("{SESSIONS}/{id}"), "Id": id, "UserName": user})
                    .to_string()
                    .into_bytes(),
            }
        }
        ("GET", SESSIONS) => {
            if auth.is_none() {
                return json_response(401, error_body("Authorization required"));
            }
            let members: Vec<serde_json::Value> = st
                .sessions
                .lock()
                .expect("sessions")
                .values()
                .map(|s| serde_json::json!({"@odata.id": format!("{SESSIONS}/{}", s.id)}))
                .collect();
            json_response(
                200,
                serde_json::json!({"Members@odata.count": members.len(), "Members": members})
                    .to_string()
                    .into_bytes(),
            )
        }
        ("DELETE", p) if p.starts_with(SESSIONS) => {
            let id = p.rsplit('/').next().unwrap_or_default().to_string();
            let mut sessions = st.sessions.lock().expect("sessions");
            let before = sessions.len();
            sessions.retain(|_, s| s.id != id);
            if sessions.len() < before {
                Response {
                    status: 204,
                    headers: Vec::new(),
                    body: Vec::new(),
                }
            } else {
                json_response(404, error_body("no such session"))
            }
        }
        _ => forward(st, req, auth).await,
    }
}

async fn forward(st: &State, req: &Request, auth: Option<String>) -> Response {
    let method = reqwest::Method::from_bytes(req.method.as_bytes()).unwrap_or(reqwest::Method::GET);
    let mut r = st
        .client
        .request(method, format!("{}{}", st.upstream, req.path))
        .timeout(Duration::from_secs(30));
    for (k, v) in &req.headers {
        let lower = k.to_ascii_lowercase();
        if [
            "host",
            "connection",
            "content-length",
            "authorization",
            "x-auth-token",
            "accept-encoding",
        ]
        .contains(&lower.as_str())
        {
            continue;
        }
        r = r.header(k, v);
    }
    if let Some(a) = auth {
        r = r.header("Authorization", a);
    }
    if !req.body.is_empty() {
        r = r.body(req.body.clone());
    }
    match r.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let headers: Vec<(String, String)> = resp
                .headers()
                .iter()
                .filter(|(k, _)| {
                    ![
                        "content-length",
                        "connection",
                        "transfer-encoding",
                        "www-authenticate",
                    ]
                    .contains(&k.as_str())
                })
                .filter_map(|(k, v)| Some((k.to_string(), v.to_str().ok()?.to_string())))
                .collect();
            let body = resp.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
            Response {
                status,
                headers,
                body,
            }
        }
        Err(e) => json_response(502, error_body(&format!("proxy upstream error: {e}"))),
    }
}

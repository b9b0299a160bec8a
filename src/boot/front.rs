//! The boot HTTP server's front: where each connection's requests are read first.
//!
//! hyper cannot hand a file to the kernel (hyperium/hyper#3026, tower-http#381), so every kernel,
//! initrd and image byte was read into user space and written out again: a 500-client boot storm
//! took 1.5–2.5× nginx's time. Here a GET or HEAD whose whole head is already in the socket
//! buffer, and which carries no body, is answered on the socket itself: a file under a static
//! route with sendfile(2), anything else through the same `Router`, its small body buffered.
//! Everything else — a body, a partial or malformed head, conditional or multi-range requests,
//! refused paths, missing files — is handed to hyper for the rest of the connection. Only heads
//! answered here are ever consumed, so hyper sees the connection exactly as the client sent it.
//! The parser is httparse (hyper's own) and sendfile is nix's; the loop is ours because no crate
//! puts sendfile behind a tower service.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::extract::ConnectInfo;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, StatusCode, Version};
use http_body_util::{BodyExt, Limited};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tower::ServiceExt;

use super::serve::HttpLimits;

/// Longest request head answered here; a longer one goes to hyper, which refuses it.
const MAX_HEAD: usize = 8 * 1024;
/// Most header lines in a head answered here.
const MAX_HEADERS: usize = 32;
/// Largest body buffered for a route that is not a file (scripts, NoCloud documents, metrics).
const MAX_BUFFERED_BODY: usize = 8 << 20;
/// Most bytes one sendfile(2) call may send.
const SENDFILE_CHUNK: u64 = 2 << 20;
/// After its lifetime a connection may finish the transfer in flight for this long (as hyper's
/// graceful shutdown does in `serve`).
const LIFETIME_GRACE: Duration = Duration::from_secs(5);

/// Called with the client and the file's name once a whole file (or range) was sent.
pub type ServedHook = Arc<dyn Fn(IpAddr, &str) + Send + Sync>;

/// Directories served under URL prefixes: the same files the `Router` serves there with
/// `ServeDir`, which still answers every request the front hands over.
#[derive(Clone, Default)]
pub struct FileRoutes {
    routes: Vec<Arc<FileRoute>>,
}

#[derive(Clone)]
struct FileRoute {
    /// `/artifacts/`: always ends with a slash.
    prefix: String,
    /// Canonical, so "inside the root" compares real paths.
    root: PathBuf,
    served: Option<ServedHook>,
}

impl FileRoutes {
    /// Serves the files under `dir` at `prefix` (for example `/artifacts`).
    pub fn route(mut self, prefix: &str, dir: &Path, served: Option<ServedHook>) -> Self {
        let root = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        self.routes.push(Arc::new(FileRoute {
            prefix: format!("{}/", prefix.trim_end_matches('/')),
            root,
            served,
        }));
        self
    }

    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

/// How the front leaves a connection.
pub(super) enum Next {
    /// Done: closed, idle past its budget, failed, or not kept alive.
    Close,
    /// hyper serves the rest; nothing of the next request was consumed.
    HandOff,
}

/// Answers requests on `stream` until one must go to hyper or the connection ends.
pub(super) async fn front(
    stream: &mut TcpStream,
    remote: SocketAddr,
    app: &Router,
    files: &FileRoutes,
    limits: &HttpLimits,
    deadline: Instant,
) -> Next {
    let mut head = vec![0u8; MAX_HEAD];
    loop {
        // Idle or silent past the header budget: closed, as hyper closes an idle keep-alive.
        let peeked =
            match tokio::time::timeout(limits.header_read_timeout, stream.peek(&mut head)).await {
                Ok(Ok(n)) if n > 0 => n,
                _ => return Next::Close,
            };
        if Instant::now() >= deadline {
            return Next::Close;
        }
        let Some((length, request)) = parse_head(&head[..peeked]) else {
            return Next::HandOff;
        };
        let keep_alive = keeps_alive(&request);
        let answered = match plan(&request, files) {
            Plan::HandOff => return Next::HandOff,
            Plan::File { route, relative } => {
                // Path checks, open and stat touch the disk: off the runtime's threads.
                let opening = route.clone();
                let range = request.headers().get(header::RANGE).cloned();
                let opened =
                    tokio::task::spawn_blocking(move || open(&opening, &relative, range.as_ref()))
                        .await;
                let Ok(Some(file)) = opened else {
                    return Next::HandOff;
                };
                if stream.read_exact(&mut head[..length]).await.is_err() {
                    return Next::Close;
                }
                answer_file(
                    stream, &request, remote, route, file, keep_alive, limits, deadline,
                )
                .await
            }
            Plan::Route => {
                if stream.read_exact(&mut head[..length]).await.is_err() {
                    return Next::Close;
                }
                answer_route(stream, request, remote, app, keep_alive, limits, deadline).await
            }
        };
        match answered {
            Ok(Kept::Open) if keep_alive => continue,
            Ok(_) => {
                let _ = stream.shutdown().await;
                return Next::Close;
            }
            Err(why) => {
                crate::metrics::record_http_aborted(why.reason());
                tracing::debug!(client = %remote.ip(), %why, "boot HTTP connection ended");
                return Next::Close;
            }
        }
    }
}

/// A complete request head in `bytes`: its length and the request it names.
fn parse_head(bytes: &[u8]) -> Option<(usize, Request<()>)> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut headers);
    let httparse::Status::Complete(length) = parsed.parse(bytes).ok()? else {
        return None;
    };
    let version = match parsed.version? {
        1 => Version::HTTP_11,
        0 => Version::HTTP_10,
        _ => return None,
    };
    let mut builder = Request::builder()
        .method(parsed.method?)
        .uri(parsed.path?)
        .version(version);
    for h in parsed.headers.iter() {
        builder = builder.header(h.name, h.value);
    }
    builder.body(()).ok().map(|request| (length, request))
}

/// What the front does with one request.
#[derive(Debug)]
enum Plan<'a> {
    File {
        route: &'a Arc<FileRoute>,
        relative: String,
    },
    Route,
    HandOff,
}

impl std::fmt::Debug for FileRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.prefix)
    }
}

fn plan<'a>(request: &Request<()>, files: &'a FileRoutes) -> Plan<'a> {
    if !matches!(*request.method(), Method::GET | Method::HEAD) {
        return Plan::HandOff;
    }
    let uri = request.uri();
    if uri.scheme().is_some() || uri.authority().is_some() || !uri.path().starts_with('/') {
        return Plan::HandOff;
    }
    let headers = request.headers();
    let has_body = headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .any(|v| v.as_bytes() != b"0");
    if has_body || headers.contains_key(header::EXPECT) || headers.contains_key(header::UPGRADE) {
        return Plan::HandOff;
    }
    let path = uri.path();
    for route in &files.routes {
        if path == route.prefix.trim_end_matches('/') {
            return Plan::HandOff;
        }
        let Some(rest) = path.strip_prefix(route.prefix.as_str()) else {
            continue;
        };
        const CONDITIONAL: [HeaderName; 5] = [
            header::IF_MATCH,
            header::IF_NONE_MATCH,
            header::IF_MODIFIED_SINCE,
            header::IF_UNMODIFIED_SINCE,
            header::IF_RANGE,
        ];
        if CONDITIONAL.iter().any(|name| headers.contains_key(name)) {
            return Plan::HandOff;
        }
        // A refused path goes to the Router, whose guard answers and logs the refusal.
        return match super::artifacts::percent_decode(rest) {
            Some(relative) if super::artifacts::check_relative_path(&relative).is_ok() => {
                Plan::File { route, relative }
            }
            _ => Plan::HandOff,
        };
    }
    Plan::Route
}

/// HTTP/1.1 keeps the connection unless the client says `close`; HTTP/1.0 closes it.
fn keeps_alive(request: &Request<()>) -> bool {
    request.version() == Version::HTTP_11
        && !has_token(request.headers().get_all(header::CONNECTION), "close")
}

/// A file ready to send: opened, measured, and its range checked.
struct OpenFile {
    file: std::fs::File,
    name: String,
    start: u64,
    length: u64,
    size: u64,
    partial: bool,
    modified: Option<SystemTime>,
    content_type: HeaderValue,
}

/// Opens `relative` under the route's root with one satisfiable range at most; `None` leaves the
/// request to the Router (missing, outside the root, not a file, several or unsatisfiable ranges).
fn open(route: &FileRoute, relative: &str, range: Option<&HeaderValue>) -> Option<OpenFile> {
    let path = super::tftp::inside_root(&route.root, relative).ok()?;
    let file = std::fs::File::open(&path).ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        return None;
    }
    let size = meta.len();
    let (start, length, partial) = match range {
        None => (0, size, false),
        Some(value) => {
            let ranges = http_range_header::parse_range_header(value.to_str().ok()?)
                .ok()?
                .validate(size)
                .ok()?;
            let [range] = ranges.as_slice() else {
                return None;
            };
            let length = range.end().checked_sub(*range.start())?.checked_add(1)?;
            (*range.start(), length, true)
        }
    };
    let content_type = mime_guess::from_path(&path)
        .first_raw()
        .map(HeaderValue::from_static)
        .unwrap_or(HeaderValue::from_static("application/octet-stream"));
    Some(OpenFile {
        name: relative
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .chars()
            .take(80)
            .collect(),
        file,
        start,
        length,
        size,
        partial,
        modified: meta.modified().ok(),
        content_type,
    })
}

/// Why a connection ended while the front answered on it.
#[derive(Debug, thiserror::Error)]
pub(super) enum Ended {
    #[error("writing to the client failed: {0}")]
    Write(#[from] std::io::Error),
    #[error("the client took no data for {0:?}")]
    Stalled(Duration),
    #[error("the connection outlived its lifetime mid-transfer")]
    Lifetime,
    #[error("the file shrank while it was sent")]
    FileShrank,
    #[error("the response body could not be read or passed {MAX_BUFFERED_BODY} bytes")]
    Body,
}

impl Ended {
    /// The `reason` label of `metalboot_boot_http_responses_aborted`.
    fn reason(&self) -> &'static str {
        match self {
            Ended::Write(_) => "write-failed",
            Ended::Stalled(_) => "stalled",
            Ended::Lifetime => "lifetime",
            Ended::FileShrank => "file-shrank",
            Ended::Body => "body",
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn answer_file(
    stream: &mut TcpStream,
    request: &Request<()>,
    remote: SocketAddr,
    route: &FileRoute,
    file: OpenFile,
    keep_alive: bool,
    limits: &HttpLimits,
    deadline: Instant,
) -> Result<Kept, Ended> {
    let started = std::time::Instant::now();
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, file.content_type.clone());
    headers.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    if let Some(modified) = file.modified.filter(|m| http_date_can_show(*m))
        && let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(modified))
    {
        headers.insert(header::LAST_MODIFIED, value);
    }
    let status = if file.partial {
        let last = file.start + file.length.saturating_sub(1);
        let range = format!("bytes {}-{last}/{}", file.start, file.size);
        if let Ok(value) = HeaderValue::from_str(&range) {
            headers.insert(header::CONTENT_RANGE, value);
        }
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let head = response_head(status, &headers, Some(file.length), keep_alive);
    // Corked, the head leaves in the same segment as the file's first bytes (nginx's
    // `tcp_nopush`): no small segment for the client to hold a delayed ACK on.
    let _ = socket2::SockRef::from(&*stream).set_tcp_cork(true);
    write_all(stream, &head, limits.request_timeout, deadline).await?;
    let head_only = request.method() == Method::HEAD;
    if !head_only {
        send_file(
            stream,
            &file.file,
            file.start,
            file.length,
            limits.request_timeout,
            deadline + LIFETIME_GRACE,
        )
        .await?;
        crate::metrics::record_sendfile(file.length);
        if let Some(served) = &route.served {
            served(remote.ip(), &file.name);
        }
    }
    let _ = socket2::SockRef::from(&*stream).set_tcp_cork(false);
    super::http::log_request(
        request.method(),
        request.uri().path(),
        status.as_u16(),
        Some(remote.ip()),
        started,
        Some(file.length),
    );
    Ok(Kept::Open)
}

/// httpdate panics on times before 1970 or past 9999; a file's mtime can be either.
fn http_date_can_show(time: SystemTime) -> bool {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .is_ok_and(|since| since.as_secs() < 253_402_300_800)
}

/// Whether the response let the connection stay open.
#[derive(Debug, PartialEq)]
enum Kept {
    Open,
    /// The app said `Connection: close`.
    Closing,
}

/// Sends `length` bytes of `file` from `start` with sendfile(2): from the page cache to the
/// socket, never through user space. Each wait for the socket is bounded by `stall` (a client
/// that stops reading), the whole transfer by `deadline`.
async fn send_file(
    stream: &TcpStream,
    file: &std::fs::File,
    start: u64,
    length: u64,
    stall: Duration,
    deadline: Instant,
) -> Result<(), Ended> {
    let mut offset = i64::try_from(start).map_err(|_| Ended::FileShrank)?;
    let mut left = length;
    while left > 0 {
        let wait = stall.min(deadline.saturating_duration_since(Instant::now()));
        match tokio::time::timeout(wait, stream.writable()).await {
            Ok(ready) => ready?,
            Err(_) if Instant::now() >= deadline => return Err(Ended::Lifetime),
            Err(_) => return Err(Ended::Stalled(stall)),
        }
        // A bounded chunk per call: on a cold page cache sendfile waits for the disk, on a
        // runtime thread.
        let chunk = usize::try_from(left.min(SENDFILE_CHUNK)).unwrap_or(1 << 20);
        let sent = stream.try_io(Interest::WRITABLE, || {
            nix::sys::sendfile::sendfile64(stream, file, Some(&mut offset), chunk)
                .map_err(std::io::Error::from)
        });
        match sent {
            Ok(0) => return Err(Ended::FileShrank),
            Ok(n) => left = left.saturating_sub(n as u64),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => return Err(Ended::Write(e)),
        }
    }
    Ok(())
}

async fn answer_route(
    stream: &mut TcpStream,
    request: Request<()>,
    remote: SocketAddr,
    app: &Router,
    keep_alive: bool,
    limits: &HttpLimits,
    deadline: Instant,
) -> Result<Kept, Ended> {
    let head_only = request.method() == Method::HEAD;
    let mut request = request.map(|()| axum::body::Body::empty());
    request.extensions_mut().insert(ConnectInfo(remote));
    // The app carries the request timeout and the access log, as on hyper's side.
    let response = match app.clone().oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let (parts, body) = response.into_parts();
    let body = match tokio::time::timeout(
        bounded(limits.request_timeout, deadline),
        Limited::new(body, MAX_BUFFERED_BODY).collect(),
    )
    .await
    {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(_)) => return Err(Ended::Body),
        Err(_) => return Err(Ended::Stalled(limits.request_timeout)),
    };
    // HEAD: the length the app gave, if any (as hyper does); GET: the body's.
    let length = if head_only {
        parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
    } else {
        Some(body.len() as u64)
    };
    let app_closes = has_token(parts.headers.get_all(header::CONNECTION), "close");
    let keep_alive = keep_alive && !app_closes;
    let mut out = response_head(parts.status, &parts.headers, length, keep_alive);
    if !head_only && !bodiless(parts.status) {
        out.extend_from_slice(&body);
    }
    write_all(stream, &out, limits.request_timeout, deadline).await?;
    Ok(if keep_alive {
        Kept::Open
    } else {
        Kept::Closing
    })
}

/// A wait bounded by `budget` and by the connection's lifetime (plus the grace).
fn bounded(budget: Duration, deadline: Instant) -> Duration {
    budget.min((deadline + LIFETIME_GRACE).saturating_duration_since(Instant::now()))
}

/// Statuses that never carry a body.
fn bodiless(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
}

fn has_token(values: header::GetAll<'_, HeaderValue>, token: &str) -> bool {
    values
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

async fn write_all(
    stream: &mut TcpStream,
    bytes: &[u8],
    stall: Duration,
    deadline: Instant,
) -> Result<(), Ended> {
    match tokio::time::timeout(bounded(stall, deadline), stream.write_all(bytes)).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(Ended::Stalled(stall)),
    }
}

/// The status line and headers of a response; hop-by-hop and length headers are the front's own.
fn response_head(
    status: StatusCode,
    headers: &HeaderMap,
    content_length: Option<u64>,
    keep_alive: bool,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(
        format!(
            "HTTP/1.1 {} {}\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        )
        .as_bytes(),
    );
    for (name, value) in headers {
        if [
            header::CONTENT_LENGTH,
            header::TRANSFER_ENCODING,
            header::CONNECTION,
        ]
        .contains(name)
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if !headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(httpdate::fmt_http_date(SystemTime::now()).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if let Some(length) = content_length.filter(|_| !bodiless(status)) {
        out.extend_from_slice(format!("content-length: {length}\r\n").as_bytes());
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routes(dir: &Path) -> FileRoutes {
        FileRoutes::default().route("/artifacts", dir, None)
    }

    fn planned(head: &str, files: &FileRoutes) -> String {
        match parse_head(head.as_bytes()) {
            None => "incomplete".into(),
            Some((length, request)) => {
                assert_eq!(length, head.len(), "the whole head is measured");
                match plan(&request, files) {
                    Plan::File { relative, .. } => format!("file {relative}"),
                    Plan::Route => "route".into(),
                    Plan::HandOff => "hand off".into(),
                }
            }
        }
    }

    /// One row per rule: what the front answers itself and what it leaves to hyper.
    #[test]
    fn the_front_answers_plain_gets_and_hands_everything_else_to_hyper() {
        let dir = tempfile::tempdir().expect("tempdir");
        let files = routes(dir.path());
        let rows = [
            (
                "GET /artifacts/vmlinuz HTTP/1.1\r\nHost: a\r\n\r\n",
                "file vmlinuz",
            ),
            (
                "HEAD /artifacts/debian/initrd.img HTTP/1.1\r\n\r\n",
                "file debian/initrd.img",
            ),
            ("GET /artifacts/a%20b HTTP/1.1\r\n\r\n", "file a b"),
            (
                "GET /artifacts/vmlinuz?x=1 HTTP/1.1\r\n\r\n",
                "file vmlinuz",
            ),
            (
                "GET /artifacts/vmlinuz HTTP/1.1\r\nRange: bytes=0-9\r\n\r\n",
                "file vmlinuz",
            ),
            ("GET /ipxe/52:54:00:00:00:01 HTTP/1.1\r\n\r\n", "route"),
            ("GET /healthz HTTP/1.0\r\n\r\n", "route"),
            (
                "GET /nocloud/t/user-data HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
                "route",
            ),
            // A body, or a request that is not a plain read: hyper's.
            (
                "POST /callback/t HTTP/1.1\r\nContent-Length: 2\r\n\r\n",
                "hand off",
            ),
            (
                "GET /healthz HTTP/1.1\r\nContent-Length: 5\r\n\r\n",
                "hand off",
            ),
            (
                "GET /healthz HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
                "hand off",
            ),
            (
                "GET /healthz HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
                "hand off",
            ),
            (
                "GET /healthz HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
                "hand off",
            ),
            ("OPTIONS * HTTP/1.1\r\n\r\n", "hand off"),
            (
                "GET http://a/artifacts/vmlinuz HTTP/1.1\r\n\r\n",
                "hand off",
            ),
            // Conditional requests and refused paths: ServeDir and the guard answer them.
            (
                "GET /artifacts/vmlinuz HTTP/1.1\r\nIf-None-Match: \"x\"\r\n\r\n",
                "hand off",
            ),
            (
                "GET /artifacts/vmlinuz HTTP/1.1\r\nIf-Modified-Since: x\r\n\r\n",
                "hand off",
            ),
            (
                "GET /artifacts/vmlinuz HTTP/1.1\r\nIf-Range: x\r\n\r\n",
                "hand off",
            ),
            ("GET /artifacts/../etc/passwd HTTP/1.1\r\n\r\n", "hand off"),
            ("GET /artifacts/%2e%2e/x HTTP/1.1\r\n\r\n", "hand off"),
            ("GET /artifacts/%zz HTTP/1.1\r\n\r\n", "hand off"),
            ("GET /artifacts/ HTTP/1.1\r\n\r\n", "hand off"),
            ("GET /artifacts HTTP/1.1\r\n\r\n", "hand off"),
        ];
        for (head, expected) in rows {
            assert_eq!(planned(head, &files), expected, "{head:?}");
        }
        // A head not yet whole, a malformed one, or one with too many lines: hyper's.
        for bad in [
            "GET /artifacts/vmlinuz HTTP/1.1\r\nHost: a\r\n".to_string(),
            "GET /artifacts/vmlinuz HTTP/2.0\r\n\r\n".to_string(),
            "GET /a b c\r\n\r\n".to_string(),
            format!(
                "GET /healthz HTTP/1.1\r\n{}\r\n",
                "X-A: b\r\n".repeat(MAX_HEADERS + 1)
            ),
        ] {
            assert!(parse_head(bad.as_bytes()).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn a_file_time_httpdate_cannot_show_is_left_out_not_a_panic() {
        let epoch = SystemTime::UNIX_EPOCH;
        assert!(http_date_can_show(
            epoch + Duration::from_secs(1_700_000_000)
        ));
        assert!(!http_date_can_show(epoch - Duration::from_secs(1)));
        assert!(!http_date_can_show(
            epoch + Duration::from_secs(253_402_300_800)
        ));
    }

    #[test]
    fn only_http11_without_close_keeps_the_connection() {
        let keep = |head: &str| parse_head(head.as_bytes()).map(|(_, r)| keeps_alive(&r));
        assert_eq!(keep("GET / HTTP/1.1\r\n\r\n"), Some(true));
        assert_eq!(
            keep("GET / HTTP/1.1\r\nConnection: keep-alive\r\n\r\n"),
            Some(true)
        );
        assert_eq!(
            keep("GET / HTTP/1.1\r\nConnection: Keep-Alive, Close\r\n\r\n"),
            Some(false)
        );
        assert_eq!(keep("GET / HTTP/1.0\r\n\r\n"), Some(false));
        assert_eq!(
            keep("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"),
            Some(false)
        );
    }

    #[test]
    fn files_open_with_one_satisfiable_range_or_not_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("vmlinuz"), vec![7u8; 1000]).expect("write");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        let files = routes(dir.path());
        let route = &files.routes[0];
        let range = |r: &str| Some(HeaderValue::from_str(r).expect("header"));
        let opened = |relative: &str, r: Option<HeaderValue>| {
            open(route, relative, r.as_ref()).map(|f| (f.start, f.length, f.size, f.partial))
        };
        assert_eq!(opened("vmlinuz", None), Some((0, 1000, 1000, false)));
        assert_eq!(
            opened("vmlinuz", range("bytes=0-99")),
            Some((0, 100, 1000, true))
        );
        assert_eq!(
            opened("vmlinuz", range("bytes=-10")),
            Some((990, 10, 1000, true))
        );
        assert_eq!(
            opened("vmlinuz", range("bytes=990-5000")),
            Some((990, 10, 1000, true))
        );
        for refused in ["bytes=5000-6000", "bytes=0-1,5-6", "bytes=x", "items=0-1"] {
            assert_eq!(opened("vmlinuz", range(refused)), None, "{refused}");
        }
        assert_eq!(opened("missing", None), None);
        assert_eq!(opened("sub", None), None);
    }

    #[test]
    fn response_heads_carry_one_length_and_say_when_they_close() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
        headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        let head = String::from_utf8(response_head(StatusCode::OK, &headers, Some(3), false))
            .expect("ascii");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(head.ends_with("\r\n\r\n"), "{head}");
        assert_eq!(head.matches("content-length").count(), 1, "{head}");
        assert!(head.contains("content-length: 3\r\n"), "{head}");
        assert!(!head.contains("chunked"), "{head}");
        assert!(head.contains("content-type: text/plain\r\n"), "{head}");
        assert!(head.contains("connection: close\r\n"), "{head}");
        let kept = String::from_utf8(response_head(
            StatusCode::NOT_MODIFIED,
            &HeaderMap::new(),
            Some(3),
            true,
        ))
        .expect("ascii");
        assert!(!kept.contains("content-length"), "{kept}");
        assert!(!kept.contains("connection"), "{kept}");
    }
}

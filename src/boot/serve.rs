//! The boot service's HTTP server with explicit budgets. Anyone on the provisioning network can
//! connect, so every connection is bounded: how many at once (in all, and per client address),
//! how long its request headers may take, how long one request may run, and how long the
//! connection may live at all. `axum::serve` has none of these knobs; hyper's connection builder
//! has the header timeout, the rest is the accept loop below. With file routes, each connection
//! first goes through `front`, which sends files with sendfile(2) and hands hyper the rest.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tower::ServiceExt;

use super::budget::{ClientSlots, Slot};
use super::front::{self, FileRoutes};

/// Budgets of the boot HTTP server.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Connections open at once; past it a new connection is closed at once.
    pub max_connections: usize,
    /// Connections open at once from one client address.
    pub max_connections_per_client: usize,
    /// Time to send a request's headers (slowloris), also while a kept-alive connection idles.
    /// With file routes the wait for the first byte and the wait for the rest of a head that
    /// came in pieces are each bounded by it.
    pub header_read_timeout: Duration,
    /// Time one request may take to be answered; a file transfer instead may not stall (the
    /// client taking nothing) for this long.
    pub request_timeout: Duration,
    /// Time a connection may stay open at all, however busy.
    pub connection_lifetime: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_client: 32,
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            connection_lifetime: Duration::from_secs(300),
        }
    }
}

/// Serves `app` on `listener` within `limits` until the listener fails.
pub async fn serve(listener: TcpListener, app: Router, limits: HttpLimits) -> std::io::Result<()> {
    serve_with_files(listener, app, limits, FileRoutes::default()).await
}

/// As `serve`, with `files` sent by the front with sendfile(2). `app` must serve the same
/// directories at the same prefixes: it answers whatever the front hands over.
pub async fn serve_with_files(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    files: FileRoutes,
) -> std::io::Result<()> {
    let files = std::sync::Arc::new(files);
    let app = app.layer(tower_http::timeout::TimeoutLayer::with_status_code(
        axum::http::StatusCode::REQUEST_TIMEOUT,
        limits.request_timeout,
    ));
    let slots = ClientSlots::new(limits.max_connections, limits.max_connections_per_client);
    loop {
        let (stream, remote) = match listener.accept().await {
            Ok(accepted) => accepted,
            // Out of fds or similar: back off briefly instead of spinning.
            Err(e) => {
                tracing::warn!(error = %e, "boot HTTP accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let slot = match slots.take(remote.ip()) {
            Ok(slot) => slot,
            Err(full) => {
                crate::metrics::record_http_refused(full.label());
                continue; // dropping the stream closes it
            }
        };
        tokio::spawn(connection(
            stream,
            remote,
            app.clone(),
            files.clone(),
            limits.clone(),
            slot,
        ));
    }
}

async fn connection(
    mut stream: tokio::net::TcpStream,
    remote: SocketAddr,
    app: Router,
    files: std::sync::Arc<FileRoutes>,
    limits: HttpLimits,
    _slot: Slot,
) {
    let deadline = tokio::time::Instant::now() + limits.connection_lifetime;
    if !files.is_empty() {
        match front::front(&mut stream, remote, &app, &files, &limits, deadline).await {
            front::Next::Close => return,
            front::Next::HandOff => {}
        }
    }
    let service = app.map_request(move |mut request: hyper::Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(ConnectInfo(remote));
        request
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
    futures::pin_mut!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(client = %remote.ip(), error = %e, "boot HTTP connection ended");
            }
        }
        _ = tokio::time::sleep_until(deadline) => {
            // Let an in-flight response finish, then close.
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
        }
    }
}

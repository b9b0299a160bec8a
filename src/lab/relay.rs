//! Relays from where lab hosts are to the lab's apiserver, which listens on loopback.
//!
//! - [`serve`]: plain HTTP, for the kubelet stand-in (the lab without `--kubeadm`). The lab OS's busybox
//!   `wget` cannot complete a TLS handshake with Go's TLS stack, so the stand-in talks plain HTTP
//!   to this relay, which forwards over verified TLS. The relay adds no identity: the bearer
//!   token the guest got through its bootstrap data is what authorizes.
//! - [`serve_tcp`]: TCP passthrough, for real kubelets (`lab up --kubeadm`): TLS end to end.

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

#[derive(Clone)]
struct Relay {
    client: reqwest::Client,
    upstream: String,
}

/// Serves the relay on a free loopback port until the process ends; returns its URL.
pub async fn serve_on_loopback(upstream: String, ca_pem: String) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        if let Err(e) = serve(listener, upstream, &ca_pem).await {
            tracing::error!(error = %e, "apiserver relay stopped");
        }
    });
    Ok(url)
}

/// Serves the relay on `listener`, forwarding to `upstream` (https) trusting `ca_pem`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    upstream: String,
    ca_pem: &str,
) -> Result<(), String> {
    let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes()).map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder()
        .use_rustls_tls()
        .add_root_certificate(ca)
        .build()
        .map_err(|e| e.to_string())?;
    let app = Router::new()
        .fallback(forward)
        .with_state(Relay { client, upstream });
    axum::serve(listener, app).await.map_err(|e| e.to_string())
}

async fn forward(State(relay): State<Relay>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(body) = axum::body::to_bytes(body, 4 << 20).await else {
        return (StatusCode::PAYLOAD_TOO_LARGE, "request too large\n").into_response();
    };
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/");
    let Ok(method) = reqwest::Method::from_bytes(parts.method.as_str().as_bytes()) else {
        return (StatusCode::METHOD_NOT_ALLOWED, "method\n").into_response();
    };
    let mut upstream = relay
        .client
        .request(method, format!("{}{path}", relay.upstream))
        .body(body);
    for name in [header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT] {
        if let Some(v) = parts.headers.get(&name).and_then(|v| v.to_str().ok()) {
            upstream = upstream.header(name.as_str(), v);
        }
    }
    match upstream.send().await {
        Ok(reply) => {
            let status =
                StatusCode::from_u16(reply.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            let content_type = reply
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let bytes = reply.bytes().await.unwrap_or_else(|_| Bytes::new());
            let mut response = (status, bytes).into_response();
            if let Some(ct) = content_type.and_then(|c| HeaderValue::from_str(&c).ok()) {
                response.headers_mut().insert(header::CONTENT_TYPE, ct);
            }
            response
        }
        Err(e) => (StatusCode::BAD_GATEWAY, format!("relay: {e}\n")).into_response(),
    }
}

/// Connections the TLS relay carries at once: a kubelet holds a few (watches), a lab has a
/// handful of hosts; past this, new connections wait for a slot instead of piling up.
pub const TCP_RELAY_MAX_CONNECTIONS: usize = 256;

/// A TCP relay to the apiserver for lab hosts running a real kubelet: bytes pass through
/// unchanged, so TLS runs end to end between the host and the apiserver (whose certificate
/// names the lab bridge's address) and the relay sees nothing but ciphertext. Serves
/// `listener` (bound where the hosts reach it) until the process ends.
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    upstream: std::net::SocketAddr,
) -> std::io::Result<()> {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(TCP_RELAY_MAX_CONNECTIONS));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return Ok(());
        };
        let (mut inbound, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, a reset before accept: the relay itself goes on.
                tracing::warn!(error = %e, "apiserver TLS relay could not accept");
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                continue;
            }
        };
        keep_alive(&inbound);
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::net::TcpStream::connect(upstream).await {
                Ok(mut outbound) => {
                    keep_alive(&outbound);
                    if let Err(e) = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await
                    {
                        tracing::debug!(%peer, error = %e, "apiserver TLS relay connection ended");
                    }
                }
                Err(e) => {
                    tracing::warn!(%peer, error = %e, "apiserver unreachable from the TLS relay")
                }
            }
        });
    }
}

/// TCP keepalive on a relayed connection: a host powered off hard never closes its side, and
/// its idle watch connections would hold relay slots until the process ends. Probes after 30 s
/// of silence, every 10 s, 3 times: such a slot is free again in about a minute.
fn keep_alive(stream: &tokio::net::TcpStream) {
    let probes = socket2::TcpKeepalive::new()
        .with_time(std::time::Duration::from_secs(30))
        .with_interval(std::time::Duration::from_secs(10))
        .with_retries(3);
    if let Err(e) = socket2::SockRef::from(stream).set_tcp_keepalive(&probes) {
        tracing::debug!(error = %e, "no TCP keepalive on a relayed connection");
    }
}

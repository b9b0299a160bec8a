//! Logging setup: human-readable lines by default, JSON for log shippers. The level comes from
//! `--log-level` or `RUST_LOG`.

//! kube-client's own request-failure logger is off: every such error reaches the operator through
//! the caller's message or condition, and twice is noise.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub fn init(format: LogFormat, level: Option<&str>) {
    let filter = level
        .map(EnvFilter::new)
        .or_else(|| EnvFilter::try_from_default_env().ok())
        .unwrap_or_else(|| EnvFilter::new("info,kube_runtime=warn,kube_client=warn,kube_client::client::builder=off,hyper=warn"));
    let registry = tracing_subscriber::registry().with(filter);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // try_init: a second call (tests, the in-process lab) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => registry
            .with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr))
            .try_init(),
        LogFormat::Json => registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init(),
    };
}

//! Connecting to the management cluster, with errors that say which kubeconfig or endpoint was
//! tried — the first thing an operator needs when the manager cannot start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{KubeConfigOptions, Kubeconfig};

pub mod gate;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("cannot load {source_desc}: {message}")]
    Load {
        source_desc: String,
        message: String,
    },
    #[error(
        "no cluster configured: no --kubeconfig, $KUBECONFIG unset, {home_config} absent, and not running in a pod ({message})"
    )]
    NothingConfigured {
        home_config: String,
        message: String,
    },
    #[error("cannot reach the Kubernetes API at {server} (from {source_desc}): {message}")]
    Unreachable {
        server: String,
        source_desc: String,
        message: String,
    },
}

/// A connected client and a description of where it points.
pub struct Connection {
    pub client: kube::Client,
    pub server: String,
    pub source_desc: String,
}

fn home_kubeconfig() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|h| Path::new(&h).join(".kube/config"))
}

/// The User-Agent of every request: the apiserver's audit log then says which replica wrote what.
pub fn user_agent(identity: &str) -> String {
    format!("metalboot/{} ({identity})", env!("CARGO_PKG_VERSION"))
}

/// Loads the config the way kubectl does (flag, `$KUBECONFIG`, `~/.kube/config`, in-cluster) and
/// proves the apiserver answers. `identity` goes into the User-Agent.
pub async fn connect(
    kubeconfig: Option<&Path>,
    identity: &str,
) -> Result<Connection, ConnectError> {
    let opts = KubeConfigOptions::default();
    let load = |source_desc: &str, e: &dyn std::fmt::Display| ConnectError::Load {
        source_desc: source_desc.to_string(),
        message: e.to_string(),
    };
    let home = home_kubeconfig();
    let (mut config, source_desc) = if let Some(path) = kubeconfig {
        let desc = format!("kubeconfig {}", path.display());
        let kc = Kubeconfig::read_from(path).map_err(|e| load(&desc, &e))?;
        let config = kube::Config::from_custom_kubeconfig(kc, &opts)
            .await
            .map_err(|e| load(&desc, &e))?;
        (config, desc)
    } else if let Some(env) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty()) {
        let desc = format!("kubeconfig $KUBECONFIG={}", env.to_string_lossy());
        let config = kube::Config::from_kubeconfig(&opts)
            .await
            .map_err(|e| load(&desc, &e))?;
        (config, desc)
    } else if let Some(home) = home.as_ref().filter(|h| h.is_file()) {
        let desc = format!("kubeconfig {}", home.display());
        let config = kube::Config::from_kubeconfig(&opts)
            .await
            .map_err(|e| load(&desc, &e))?;
        (config, desc)
    } else {
        let config = kube::Config::incluster().map_err(|e| ConnectError::NothingConfigured {
            home_config: home
                .as_ref()
                .map(|h| h.display().to_string())
                .unwrap_or_else(|| "~/.kube/config".into()),
            message: e.to_string(),
        })?;
        (config, "in-cluster service account".to_string())
    };
    config.connect_timeout = Some(Duration::from_secs(5));
    if let Ok(agent) = http::HeaderValue::from_str(&user_agent(identity)) {
        config.headers.push((http::header::USER_AGENT, agent));
    }
    let server = config.cluster_url.to_string();
    let unreachable = |message: String| ConnectError::Unreachable {
        server: server.clone(),
        source_desc: source_desc.clone(),
        message,
    };
    let client = kube::Client::try_from(config).map_err(|e| unreachable(e.to_string()))?;
    match tokio::time::timeout(Duration::from_secs(15), client.apiserver_version()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(unreachable(one_line(&e))),
        Err(_) => return Err(unreachable("no answer within 15s".into())),
    }
    Ok(Connection {
        client,
        server,
        source_desc,
    })
}

/// An error and its causes on one line, for the single line an operator reads.
pub fn one_line(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text.replace('\n', " ")
}

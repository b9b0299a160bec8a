//! `metalboot manager`: the controllers and the boot service in one process, sharing reflector
//! stores. Tests and the lab start it in-process with `start`; the CLI runs it until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::middleware;
use tokio::task::JoinHandle;

use crate::boot::http::{self as boot_http, BootConfig, BootState, BootStores, CallbackNotice};
use crate::controllers::hostbmc::{BmcConnector, RedfishConnector};
use crate::controllers::{
    Backoff, Events, cloudinitconfig, cluster, machine, metalcluster, metalhost, metalmachine,
};
use crate::leader::{self, Leadership, LeaseConfig};

#[derive(Clone)]
pub struct ManagerOptions {
    /// Watch only this namespace (all when None).
    pub namespace: Option<String>,
    /// Reconcile only objects labelled `cluster.x-k8s.io/watch-filter=<value>`.
    pub watch_filter: Option<String>,
    /// Also run the standalone Cluster API controllers (Machine, Cluster status, CloudInitConfig).
    pub standalone: bool,
    pub leader_election: Option<LeaseConfig>,
    /// Where the boot service's HTTP side listens.
    pub boot_http: SocketAddr,
    /// How hosts reach the boot service (defaults to `http://<boot_http>`).
    pub advertise_url: Option<String>,
    pub pin_source_ip: bool,
    pub bmc_timeout: Duration,
    pub power_poll_interval: Duration,
    pub graceful_off: Duration,
    pub deprovision_timeout: Duration,
    /// How long vendor-data waits for the bootstrap sentinel.
    pub sentinel_wait: Duration,
    pub artifacts_dir: Option<PathBuf>,
    /// TFTP for iPXE binaries: where it listens and what it serves (None: no TFTP).
    pub tftp: Option<(SocketAddr, PathBuf)>,
    /// How often memory kept about deleted objects is released (BMC sessions logged out).
    pub janitor_interval: Duration,
    /// Budgets of the boot HTTP server (connections, timeouts).
    pub http_limits: crate::boot::serve::HttpLimits,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        Self {
            namespace: None,
            watch_filter: None,
            standalone: true,
            leader_election: None,
            boot_http: SocketAddr::from(([0, 0, 0, 0], 8080)),
            advertise_url: None,
            pin_source_ip: false,
            bmc_timeout: Duration::from_secs(20),
            power_poll_interval: Duration::from_secs(300),
            graceful_off: Duration::from_secs(60),
            deprovision_timeout: Duration::from_secs(600),
            sentinel_wait: Duration::from_secs(3 * 3600),
            artifacts_dir: None,
            tftp: None,
            janitor_interval: Duration::from_secs(60),
            http_limits: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error("binding the boot HTTP service to {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the boot service listens on {0}, which hosts cannot reach; pass --advertise-url")]
    NoAdvertiseAddress(SocketAddr),
    #[error("TFTP: {0}")]
    Tftp(String),
    #[error("iPXE templates: {0}")]
    Templates(#[from] minijinja::Error),
    #[error(transparent)]
    Leader(#[from] leader::LeaderError),
    #[error("stopped acting: {0}")]
    LeadershipLost(leader::Lost),
}

/// A running manager. Dropping it stops everything it started (tests use that as a "kill").
pub struct RunningManager {
    pub boot_addr: SocketAddr,
    /// Where TFTP listens, when it runs.
    pub tftp_addr: Option<SocketAddr>,
    pub base_url: String,
    /// The boot service's state: subscribe to its boot milestones.
    pub boot: Arc<BootState>,
    /// Long-running services: the manager runs while all of them do.
    tasks: Vec<JoinHandle<()>>,
    /// Helpers that finish on their own (store sync); aborted with the manager.
    helpers: Vec<JoinHandle<()>>,
    /// Held while this replica leads (None without leader election).
    leadership: Option<Leadership>,
}

impl RunningManager {
    /// Runs until one of its tasks ends (a controller stops on SIGTERM/SIGINT), then steps down;
    /// or until leadership is lost, which is an error: the process must exit, not act on.
    pub async fn wait(mut self) -> Result<(), ManagerError> {
        let tasks = std::mem::take(&mut self.tasks);
        let leadership = self.leadership.take();
        let Some(mut leadership) = leadership else {
            let _ = futures::future::select_all(tasks).await;
            return Ok(());
        };
        tokio::select! {
            _ = futures::future::select_all(tasks) => {
                leadership.release().await;
                Ok(())
            }
            lost = leadership.lost() => Err(ManagerError::LeadershipLost(lost)),
        }
    }

    /// The write fence, when leader election is on.
    pub fn fence(&self) -> Option<Arc<leader::WriteFence>> {
        self.leadership.as_ref().map(Leadership::fence)
    }
}

impl Drop for RunningManager {
    fn drop(&mut self) {
        for task in self.tasks.iter().chain(&self.helpers) {
            task.abort();
        }
    }
}

pub async fn start(
    client: kube::Client,
    opts: ManagerOptions,
) -> Result<RunningManager, ManagerError> {
    let base_url = match &opts.advertise_url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None if opts.boot_http.ip().is_unspecified() => {
            return Err(ManagerError::NoAdvertiseAddress(opts.boot_http));
        }
        None => format!("http://{}", opts.boot_http),
    };
    // A standby waits here, with no listener: hosts and load balancers see only the leader's
    // boot service, and a standby never accepts a connection it would not answer.
    let leadership = match opts.leader_election.clone() {
        Some(lease) => Some(leader::acquire(client.clone(), lease).await?),
        None => None,
    };
    // From here on every write goes through the fence: none after the renew deadline.
    let client = match &leadership {
        Some(leadership) => leadership.fenced(client),
        None => client,
    };
    let listener = tokio::net::TcpListener::bind(opts.boot_http)
        .await
        .map_err(|source| ManagerError::Bind {
            addr: opts.boot_http,
            source,
        })?;
    let boot_addr = listener.local_addr().map_err(|source| ManagerError::Bind {
        addr: opts.boot_http,
        source,
    })?;
    // Port 0 (tests) is only known now.
    let base_url = match &opts.advertise_url {
        None if opts.boot_http.port() == 0 => format!("http://{boot_addr}"),
        _ => base_url,
    };
    let tftp = match &opts.tftp {
        Some((addr, root)) => Some(
            crate::boot::tftp::Tftp::bind(*addr, root)
                .await
                .map_err(ManagerError::Tftp)?,
        ),
        None => None,
    };
    let tftp_addr = tftp.as_ref().and_then(|t| t.local_addr());
    let namespace = opts.namespace.as_deref();
    let connector: Arc<dyn BmcConnector> = Arc::new(RedfishConnector::new(opts.bmc_timeout));
    let watch_filter = opts.watch_filter.clone().filter(|f| !f.is_empty());
    let mut tasks = Vec::new();

    // One watch per kind, shared by every controller and the boot service.
    let reflectors = crate::stores::Reflectors::new();
    let stores = reflectors.stores();
    let host_controller = metalhost::controller(
        client.clone(),
        namespace,
        &stores,
        reflectors.hosts.subscribe(),
        reflectors.metal_machines.subscribe(),
    );
    let host_ctx = Arc::new(metalhost::HostContext {
        client: client.clone(),
        connector: connector.clone(),
        stores: stores.clone(),
        events: Events::new(client.clone(), "metalboot-metalhost"),
        backoff: Backoff::default(),
        poll_interval: opts.power_poll_interval,
        graceful_off: opts.graceful_off,
        power_requests: Default::default(),
        watch_filter: watch_filter.clone(),
    });

    let (callback_tx, callback_rx) = tokio::sync::mpsc::unbounded_channel::<CallbackNotice>();
    let callbacks = futures::stream::unfold(callback_rx, |mut rx| async move {
        rx.recv().await.map(|n| (n, rx))
    });
    let machine_controller = metalmachine::controller(
        &stores,
        crate::controllers::Subscriptions::new(&reflectors),
        callbacks,
    );
    let machine_ctx = Arc::new(metalmachine::MachineContext {
        client: client.clone(),
        connector,
        stores: stores.clone(),
        events: Events::new(client.clone(), "metalboot-metalmachine"),
        backoff: Backoff::default(),
        policy: metalmachine::decide::Policy {
            graceful_off: opts.graceful_off,
            deprovision_timeout: opts.deprovision_timeout,
        },
        watch_filter: watch_filter.clone(),
        power_requests: Default::default(),
        expectations: Default::default(),
    });
    let cluster_controller = metalcluster::controller(client.clone(), namespace);
    let cluster_ctx = Arc::new(metalcluster::ClusterContext {
        client: client.clone(),
        hosts: stores.hosts.clone(),
        backoff: Backoff::default(),
        watch_filter: watch_filter.clone(),
    });
    // The standalone Machine controller subscribes to the shared Cluster stream before it runs.
    let mut standalone_machines = opts.standalone.then(|| {
        let (triggers, wake) = machine::Triggers::new();
        let listener = triggers.clone();
        let machine_ctx = Arc::new(machine::MachineContext {
            client: client.clone(),
            events: Events::new(client.clone(), "metalboot-machine"),
            backoff: Backoff::default(),
            workloads: Arc::new(machine::Workloads::with_listener(Arc::new(move |node| {
                listener.node_changed(node)
            }))),
            watch_filter: watch_filter.clone(),
            clusters: stores.clusters.clone(),
            triggers,
            namespace: namespace.map(str::to_string),
            expectations: Default::default(),
        });
        let controller = machine::controller(
            client.clone(),
            namespace,
            reflectors.clusters.subscribe(),
            wake,
        );
        (controller, machine_ctx)
    });
    reflectors.run(client.clone(), namespace);

    let state = Arc::new(BootState::new(
        BootStores {
            hosts: stores.hosts.clone(),
            machines: stores.metal_machines.clone(),
            boot_secrets: stores.boot_secrets.clone(),
        },
        BootConfig {
            base_url: base_url.clone(),
            pin_source_ip: opts.pin_source_ip,
            sentinel_wait_seconds: opts.sentinel_wait.as_secs() as u32,
        },
        client.clone(),
        callback_tx,
    )?);
    let boot = state.clone();
    let syncing = state.clone();
    let helpers = vec![tokio::spawn(async move { syncing.wait_for_stores().await })];
    let mut router = boot_http::router(state);
    if let Some(dir) = &opts.artifacts_dir {
        router = router.nest(
            "/artifacts",
            crate::boot::artifacts::artifacts_router(dir.clone()),
        );
    }
    let app = router.layer(middleware::from_fn(boot_http::access_log));
    tracing::info!(listen = %boot_addr, advertise = %base_url, limits = ?opts.http_limits, "boot HTTP service listening");
    let limits = opts.http_limits.clone();
    tasks.push(tokio::spawn(async move {
        if let Err(e) = crate::boot::serve::serve(listener, app, limits).await {
            tracing::error!(error = %e, "boot HTTP service stopped");
        }
    }));
    if let Some(tftp) = tftp {
        tracing::info!(listen = ?tftp_addr, "boot TFTP service listening");
        tasks.push(tokio::spawn(async move {
            if let Err(e) = tftp.serve().await {
                tracing::error!(error = %e, "boot TFTP service stopped");
            }
        }));
    }
    tasks.push(tokio::spawn(crate::controllers::janitor::run(
        host_ctx.clone(),
        machine_ctx.clone(),
        boot.clone(),
        opts.janitor_interval,
    )));
    tasks.push(tokio::spawn(metalhost::run(host_controller, host_ctx)));
    tasks.push(tokio::spawn(metalmachine::run(
        machine_controller,
        machine_ctx,
    )));
    tasks.push(tokio::spawn(metalcluster::run(
        cluster_controller,
        cluster_ctx,
    )));
    if opts.standalone {
        // Upstream Cluster API's jobs, for clusters without it: Machines, Cluster status, bootstrap.
        if let Some((controller, ctx)) = standalone_machines.take() {
            tasks.push(tokio::spawn(machine::run(controller, ctx)));
        }
        let status_ctx = Arc::new(cluster::StatusContext {
            client: client.clone(),
            backoff: Backoff::default(),
            watch_filter: watch_filter.clone(),
        });
        tasks.push(tokio::spawn(cluster::run(
            cluster::controller(client.clone(), namespace),
            status_ctx,
        )));
        let config_ctx = Arc::new(cloudinitconfig::ConfigContext {
            client: client.clone(),
            events: Events::new(client.clone(), "metalboot-cloudinitconfig"),
            backoff: Backoff::default(),
            watch_filter: watch_filter.clone(),
        });
        tasks.push(tokio::spawn(cloudinitconfig::run(
            cloudinitconfig::controller(client.clone(), namespace),
            config_ctx,
        )));
    }
    tracing::info!(
        namespace = namespace.unwrap_or("<all>"),
        standalone = opts.standalone,
        "controllers started"
    );
    Ok(RunningManager {
        boot_addr,
        tftp_addr,
        base_url,
        boot,
        tasks,
        helpers,
        leadership,
    })
}

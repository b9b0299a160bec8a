//! `metalboot manager`: the controllers and the boot service in one process, sharing reflector
//! stores. Tests and the lab start it in-process with `start`; the CLI runs it until a signal.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::middleware;
use tokio::task::JoinHandle;

use crate::boot::http::{self as boot_http, BootConfig, BootState, BootStores, CallbackNotice};
use crate::boot::netns::NetNamespace;
use crate::controllers::hostbmc::{BmcConnector, RedfishConnector};
use crate::controllers::{
    Backoff, Events, cloudinitconfig, cluster, existingcontrolplane, machine, metalcluster,
    metalhost, metalmachine,
};
use crate::leader::{self, Leadership, LeaseConfig};

/// The controller groups of one manager process. clusterctl installs the infrastructure and the
/// bootstrap provider as two Deployments of the same image; standalone mode (no upstream Cluster
/// API) adds `core`, metalboot's own Machine and Cluster-status controllers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Controllers {
    /// MetalHost, MetalMachine, MetalCluster and the boot service (HTTP, TFTP).
    pub infrastructure: bool,
    /// CloudInitConfig: renders the bootstrap data Secret.
    pub bootstrap: bool,
    /// Machine and Cluster status, for clusters without upstream Cluster API core.
    pub core: bool,
}

impl Controllers {
    pub const ALL: Controllers = Controllers {
        infrastructure: true,
        bootstrap: true,
        core: true,
    };
    /// Both clusterctl providers in one process, as the lab and the tests run them beside
    /// upstream core.
    pub const PROVIDERS: Controllers = Controllers {
        infrastructure: true,
        bootstrap: true,
        core: false,
    };
}

#[derive(Clone)]
pub struct ManagerOptions {
    /// Watch only this namespace (all when None).
    pub namespace: Option<String>,
    /// Reconcile only objects labelled `cluster.x-k8s.io/watch-filter=<value>`.
    pub watch_filter: Option<String>,
    /// Which controller groups this process runs (one binary, three clusterctl roles).
    pub controllers: Controllers,
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
    /// The deploy ramdisk image-mode hosts netboot (None: image mode is refused).
    pub deploy: Option<crate::api::metalmachine::BootProfile>,
    /// TFTP for iPXE binaries: where it listens and what it serves (None: no TFTP).
    pub tftp: Option<(SocketAddr, PathBuf)>,
    /// How often memory kept about deleted objects is released (BMC sessions logged out).
    pub janitor_interval: Duration,
    /// Budgets of the boot HTTP server (connections, timeouts).
    pub http_limits: crate::boot::serve::HttpLimits,
    /// The network namespace the boot service's sockets (HTTP, TFTP, DHCP) are created in: the
    /// process's own, or the lab's provisioning network.
    pub boot_netns: NetNamespace,
    /// The proxyDHCP service (None: the site's DHCP server is configured by hand).
    pub dhcp: Option<DhcpSettings>,
    /// Ordinary apiserver requests in flight at once (see `kubeconn::gate`; 0: no bound).
    pub api_requests_in_flight: usize,
    /// Of those, how many may be in flight while a callback's request is.
    pub api_requests_in_flight_beside_callbacks: usize,
}

/// How the proxyDHCP service runs.
#[derive(Clone, Debug, Default)]
pub struct DhcpSettings {
    /// The interface facing the hosts (None: all).
    pub interface: Option<String>,
    /// metalboot's address on the provisioning network (defaults to the advertise URL's host).
    pub server_ip: Option<std::net::Ipv4Addr>,
    /// Answer every PXE client, not only hosts being provisioned.
    pub answer_all: bool,
    /// Boot programs per architecture (None: `BootFiles` defaults).
    pub bios_file: Option<String>,
    pub efi_x64_file: Option<String>,
    pub efi_arm64_file: Option<String>,
    /// Full-DHCP mode (None: proxyDHCP).
    pub full: Option<FullDhcp>,
}

/// metalboot as the provisioning network's only DHCP server.
#[derive(Clone, Debug)]
pub struct FullDhcp {
    pub network: ipnetwork::Ipv4Network,
    /// `first-last` (default: the network from its tenth address).
    pub pool: Option<String>,
    pub router: Option<std::net::Ipv4Addr>,
    pub lease_time: Duration,
    /// Where leases are recorded before they are acknowledged.
    pub lease_file: PathBuf,
}

impl Default for ManagerOptions {
    fn default() -> Self {
        Self {
            namespace: None,
            watch_filter: None,
            controllers: Controllers::ALL,
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
            deploy: None,
            tftp: None,
            janitor_interval: Duration::from_secs(60),
            http_limits: Default::default(),
            boot_netns: NetNamespace::current(),
            dhcp: None,
            api_requests_in_flight: crate::kubeconn::gate::DEFAULT_IN_FLIGHT,
            api_requests_in_flight_beside_callbacks: crate::kubeconn::gate::DEFAULT_BESIDE_URGENT,
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
    #[error("DHCP: {0}")]
    Dhcp(String),
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
    /// The boot service's state (infrastructure controllers only): subscribe to its milestones.
    pub boot: Option<Arc<BootState>>,
    /// What the infrastructure controllers keep in memory per object (infrastructure only):
    /// the janitor must empty it of objects that are gone.
    pub held: Option<Held>,
    /// Long-running services: the manager runs while all of them do.
    tasks: Vec<JoinHandle<()>>,
    /// Helpers that finish on their own (store sync); aborted with the manager.
    helpers: Vec<JoinHandle<()>>,
    /// The stores' watches. Aborted with the manager: a manager dropped in a process that goes
    /// on (a test's restart, the lab) must not leave its watches on the apiserver.
    watches: Vec<JoinHandle<()>>,
    /// Held while this replica leads (None without leader election).
    leadership: Option<Leadership>,
}

/// The manager's per-object memory, for checking that deleted objects leave none behind.
pub struct Held {
    hosts: Arc<metalhost::HostContext>,
    machines: Arc<metalmachine::MachineContext>,
}

/// How many entries each per-object map holds.
#[derive(Debug, Default, PartialEq)]
pub struct HeldCounts {
    pub host_power_requests: usize,
    pub host_power_readings: usize,
    pub machine_power_requests: usize,
    pub machine_power_ons: usize,
    pub machine_unrecorded_power: usize,
    /// Machines with a pass holding or awaiting their turn (none at rest).
    pub machine_pass_locks: usize,
}

impl Held {
    pub fn counts(&self) -> HeldCounts {
        HeldCounts {
            host_power_requests: self.hosts.power_requests.len(),
            host_power_readings: self.hosts.power_readings.len(),
            machine_power_requests: self.machines.power_requests.len(),
            machine_power_ons: self.machines.power_ons.len(),
            machine_unrecorded_power: self.machines.unrecorded_power.len(),
            machine_pass_locks: self.machines.pass_locks.len(),
        }
    }
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

    /// The stores' watch tasks, to see them end once the manager is dropped.
    pub fn watch_tasks(&self) -> Vec<tokio::task::AbortHandle> {
        self.watches.iter().map(JoinHandle::abort_handle).collect()
    }

    /// The write fence, when leader election is on.
    pub fn fence(&self) -> Option<Arc<leader::WriteFence>> {
        self.leadership.as_ref().map(Leadership::fence)
    }
}

impl Drop for RunningManager {
    fn drop(&mut self) {
        for task in self.tasks.iter().chain(&self.helpers).chain(&self.watches) {
            task.abort();
        }
        if let Some(held) = &self.held {
            held.machines.lane.stop();
        }
    }
}

pub async fn start(
    client: kube::Client,
    opts: ManagerOptions,
) -> Result<RunningManager, ManagerError> {
    let opts = ManagerOptions {
        watch_filter: opts.watch_filter.filter(|f| !f.is_empty()),
        ..opts
    };
    let serves_hosts = opts.controllers.infrastructure;
    let base_url = match &opts.advertise_url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None if serves_hosts && opts.boot_http.ip().is_unspecified() => {
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
    // Outside the fence: a write waiting in the bound is checked when it leaves, not when it
    // joined.
    let client = crate::kubeconn::gate::gated(
        client,
        opts.api_requests_in_flight,
        opts.api_requests_in_flight_beside_callbacks,
    );
    let listener = opts
        .boot_netns
        .tcp_listener(opts.boot_http)
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
    let namespace = opts.namespace.as_deref();
    let watch_filter = opts.watch_filter.clone();
    let mut running = RunningManager {
        boot_addr,
        tftp_addr: None,
        base_url,
        boot: None,
        held: None,
        tasks: Vec::new(),
        helpers: Vec::new(),
        watches: Vec::new(),
        leadership,
    };

    // One watch per kind, shared by every controller and the boot service.
    let reflectors = (opts.controllers.infrastructure || opts.controllers.core)
        .then(crate::stores::Reflectors::new);
    // One CloudInitConfig watch and store, for the bootstrap controller and the standalone
    // Machine controller (which reads its configs' contract fields from it).
    let cloud_init_configs = opts
        .controllers
        .bootstrap
        .then(crate::stores::SharedStore::<crate::api::CloudInitConfig>::new);
    // The standalone Machine controller subscribes to the shared Cluster stream before it runs.
    let standalone_machines = match &reflectors {
        Some(reflectors) if opts.controllers.core => {
            let stores = reflectors.stores();
            let (triggers, wake) = machine::Triggers::new();
            triggers.follow_deletions(&reflectors.metal_machines);
            if let Some(configs) = &cloud_init_configs {
                triggers.follow_deletions(configs);
            }
            let listener = triggers.clone();
            let workloads = Arc::new(
                machine::Workloads::with_listener(Arc::new(move |node| {
                    listener.node_changed(node)
                }))
                .rechecking_every(machine::KUBECONFIG_RECHECK),
            );
            workloads.follow_clusters(&reflectors.clusters);
            let machine_ctx = Arc::new(machine::MachineContext {
                client: client.clone(),
                events: Events::new(client.clone(), "metalboot-machine"),
                backoff: Backoff::default(),
                workloads,
                watch_filter: watch_filter.clone(),
                clusters: stores.clusters.clone(),
                triggers,
                namespace: namespace.map(str::to_string),
                expectations: Default::default(),
                metal_machines: Some(stores.metal_machines.clone()),
                cloud_init_configs: cloud_init_configs.as_ref().map(|c| c.store.clone()),
            });
            // What the Machine controller expected of an object goes once the object does.
            forget_expected_on_deletion(&reflectors.machines, &machine_ctx, |c| &c.expectations);
            forget_expected_on_deletion(&reflectors.metal_machines, &machine_ctx, |c| {
                &c.expectations
            });
            if let Some(configs) = &cloud_init_configs {
                forget_expected_on_deletion(configs, &machine_ctx, |c| &c.expectations);
            }
            let controller = machine::controller(
                reflectors.machines.subscribe(),
                stores.machines.clone(),
                reflectors.clusters.subscribe(),
                reflectors.metal_machines.subscribe(),
                cloud_init_configs
                    .as_ref()
                    .map(crate::stores::SharedStore::subscribe),
                wake,
            );
            Some((controller, machine_ctx))
        }
        _ => None,
    };
    match (&reflectors, serves_hosts) {
        (Some(reflectors), true) => {
            let (app, files) =
                start_infrastructure(&client, &opts, reflectors, &mut running).await?;
            let limits = opts.http_limits.clone();
            tracing::info!(listen = %boot_addr, advertise = %running.base_url, limits = ?limits, "boot HTTP service listening");
            running.tasks.push(tokio::spawn(async move {
                if let Err(e) =
                    crate::boot::serve::serve_with_files(listener, app, limits, files).await
                {
                    tracing::error!(error = %e, "boot HTTP service stopped");
                }
            }));
        }
        _ => {
            // No hosts to serve: the same port answers probes and metrics only.
            tracing::info!(listen = %boot_addr, "health and metrics listening");
            let limits = opts.http_limits.clone();
            running.tasks.push(tokio::spawn(async move {
                if let Err(e) = crate::boot::serve::serve(listener, health_router(), limits).await {
                    tracing::error!(error = %e, "health service stopped");
                }
            }));
        }
    }
    let shared_clusters = reflectors.as_ref().map(|r| r.stores().clusters);
    if let Some(reflectors) = reflectors {
        running.watches = reflectors.run(client.clone(), namespace);
    }
    if let Some((controller, ctx)) = standalone_machines {
        // Upstream Cluster API's jobs, for clusters without it: Machines and Cluster status.
        // Its expectations of deleted objects are dropped by a sweep of their own.
        let expiring = ctx.clone();
        let interval = opts.janitor_interval.max(Duration::from_millis(100));
        running.helpers.push(tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                expiring.expectations.expire();
            }
        }));
        running
            .tasks
            .push(tokio::spawn(machine::run(controller, ctx)));
        let status_ctx = Arc::new(cluster::StatusContext {
            client: client.clone(),
            backoff: Backoff::default(),
            watch_filter: watch_filter.clone(),
        });
        running.tasks.push(tokio::spawn(cluster::run(
            cluster::controller(client.clone(), namespace),
            status_ctx,
        )));
    }
    if let Some(configs) = cloud_init_configs {
        let (controller, secrets) =
            cloudinitconfig::controller(client.clone(), namespace, &configs);
        let config_ctx = Arc::new(cloudinitconfig::ConfigContext {
            client: client.clone(),
            events: Events::new(client.clone(), "metalboot-cloudinitconfig"),
            backoff: Backoff::default(),
            watch_filter: watch_filter.clone(),
            secrets,
            clusters: shared_clusters,
            expectations: Default::default(),
            content_from: cloudinitconfig::content_from_reads(),
        });
        forget_expected_on_deletion(&configs, &config_ctx, |c| &c.expectations);
        running.watches.push(cloudinitconfig::watch_configs(
            configs,
            client.clone(),
            namespace,
        ));
        running
            .tasks
            .push(tokio::spawn(cloudinitconfig::run(controller, config_ctx)));
    }
    tracing::info!(
        namespace = namespace.unwrap_or("<all>"),
        controllers = ?opts.controllers,
        "controllers started"
    );
    Ok(running)
}

/// The DHCP service's configuration from the manager's: the server address defaults to the
/// advertise URL's host, which must then be an IPv4 address (DHCP carries no names).
fn dhcp_config(
    settings: &DhcpSettings,
    base_url: &str,
) -> Result<crate::boot::dhcpd::DhcpConfig, ManagerError> {
    let server_ip = match settings.server_ip {
        Some(ip) => ip,
        None => base_url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().and_then(|h| h.parse().ok()))
            .ok_or_else(|| {
                ManagerError::Dhcp(format!(
                    "the advertise URL {base_url} has no IPv4 address; pass --dhcp-server-ip"
                ))
            })?,
    };
    let mut files = crate::boot::dhcp::BootFiles::new(base_url);
    let set = |field: &mut String, value: &Option<String>| {
        if let Some(v) = value {
            *field = v.clone();
        }
    };
    set(&mut files.bios, &settings.bios_file);
    set(&mut files.efi_x64, &settings.efi_x64_file);
    set(&mut files.efi_arm64, &settings.efi_arm64_file);
    let mut config = crate::boot::dhcpd::DhcpConfig::new(server_ip, files);
    config.interface = settings.interface.clone();
    config.answer_all = settings.answer_all;
    Ok(config)
}

/// The lease table of full-DHCP mode, with what the lease file recorded.
fn full_leases(
    full: &FullDhcp,
    server_ip: std::net::Ipv4Addr,
) -> Result<crate::boot::leases::Leases, ManagerError> {
    let pool = crate::boot::leases::Pool::new(
        full.network,
        full.pool.as_deref(),
        vec![server_ip],
        full.router,
        full.lease_time,
    )
    .map_err(|e| ManagerError::Dhcp(e.to_string()))?;
    if let Some(dir) = full.lease_file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| {
            ManagerError::Dhcp(format!("lease file directory {}: {e}", dir.display()))
        })?;
    }
    crate::boot::leases::Leases::load(pool, Some(&full.lease_file))
        .map_err(|e| ManagerError::Dhcp(e.to_string()))
}

/// Probes and metrics for a process that serves no hosts (the bootstrap provider).
fn health_router() -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(|| async { "ok\n" }))
        .route("/metrics", get(|| async { crate::metrics::render() }))
}

/// The infrastructure provider: MetalHost, MetalMachine and MetalCluster controllers, the
/// janitor, TFTP and the boot service's state. Returns the boot HTTP app for the listener.
async fn start_infrastructure(
    client: &kube::Client,
    opts: &ManagerOptions,
    reflectors: &crate::stores::Reflectors,
    running: &mut RunningManager,
) -> Result<(axum::Router, crate::boot::front::FileRoutes), ManagerError> {
    let namespace = opts.namespace.as_deref();
    let watch_filter = opts.watch_filter.clone();
    let tftp = match &opts.tftp {
        Some((addr, root)) => Some(
            crate::boot::tftp::Tftp::bind_in(&opts.boot_netns, *addr, root, Default::default())
                .map_err(ManagerError::Tftp)?,
        ),
        None => None,
    };
    running.tftp_addr = tftp.as_ref().and_then(|t| t.local_addr());
    let connector: Arc<dyn BmcConnector> = Arc::new(RedfishConnector::new(opts.bmc_timeout));
    let stores = reflectors.stores();
    let (secret_meta, secret_meta_writer) = kube::runtime::reflector::store();
    let host_controller = metalhost::controller(
        client.clone(),
        namespace,
        &stores,
        reflectors.hosts.subscribe(),
        reflectors.hosts.subscribe_events(metalhost::boot_mac),
        reflectors.metal_machines.subscribe(),
        secret_meta_writer,
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
        power_readings: Default::default(),
        watch_filter: watch_filter.clone(),
        secret_meta,
        expectations: Default::default(),
    });

    forget_expected_on_deletion(&reflectors.hosts, &host_ctx, |c| &c.expectations);

    let (callback_tx, callback_rx) = tokio::sync::mpsc::unbounded_channel::<CallbackNotice>();
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
        power_ons: Default::default(),
        unrecorded_power: Default::default(),
        expectations: Default::default(),
        fresh_secrets: Default::default(),
        pass_locks: Default::default(),
        lane: Default::default(),
        claims_in_flight: Default::default(),
    });
    forget_expected_on_deletion(&reflectors.metal_machines, &machine_ctx, |c| {
        &c.expectations
    });
    forget_expected_on_deletion(&reflectors.boot_secrets, &machine_ctx, |c| &c.expectations);
    forget_expected_on_deletion(&reflectors.hosts, &machine_ctx, |c| &c.expectations);
    let lane_ctx = machine_ctx.clone();
    // Notices the callback lane took reach the controller only when the lane gives them back.
    let (handoff_tx, handoff_rx) = tokio::sync::mpsc::unbounded_channel::<CallbackNotice>();
    let callbacks = futures::stream::unfold(callback_rx, move |mut rx| {
        let lane_ctx = lane_ctx.clone();
        let handoff = handoff_tx.clone();
        async move {
            let notice = rx.recv().await?;
            lane_ctx.fresh_secrets.offer(&notice);
            let taken = metalmachine::callback_lane(&lane_ctx, &notice, handoff);
            Some(((!taken).then_some(notice), rx))
        }
    });
    let callbacks = futures::StreamExt::filter_map(callbacks, futures::future::ready);
    let handed_back = futures::stream::unfold(handoff_rx, |mut rx| async move {
        let notice = rx.recv().await?;
        Some((notice, rx))
    });
    let callbacks = futures::stream::select(callbacks, handed_back);
    let machine_controller = metalmachine::controller(
        &stores,
        crate::controllers::Subscriptions::new(reflectors),
        callbacks,
    );
    let cluster_controller = metalcluster::controller(
        client.clone(),
        namespace,
        reflectors.clusters.subscribe(),
        reflectors.hosts.subscribe_events(metalcluster::host_labels),
    );
    let control_plane_controller = existingcontrolplane::controller(
        client.clone(),
        namespace,
        reflectors.clusters.subscribe(),
    );
    let control_plane_ctx = Arc::new(existingcontrolplane::Context {
        client: client.clone(),
        clusters: stores.clusters.clone(),
        backoff: Backoff::default(),
        watch_filter: watch_filter.clone(),
    });
    let cluster_ctx = Arc::new(metalcluster::ClusterContext {
        client: client.clone(),
        hosts: stores.hosts.clone(),
        clusters: stores.clusters.clone(),
        backoff: Backoff::default(),
        watch_filter: watch_filter.clone(),
    });

    let state = Arc::new(BootState::new(
        BootStores {
            hosts: stores.hosts.clone(),
            host_index: stores.host_index.clone(),
            machines: stores.metal_machines.clone(),
            boot_secrets: stores.boot_secrets.clone(),
        },
        BootConfig {
            base_url: running.base_url.clone(),
            pin_source_ip: opts.pin_source_ip,
            sentinel_wait_seconds: opts.sentinel_wait.as_secs() as u32,
            deploy: opts.deploy.clone(),
        },
        client.clone(),
        callback_tx,
    )?);
    running.boot = Some(state.clone());
    let syncing = state.clone();
    running
        .helpers
        .push(tokio::spawn(async move { syncing.wait_for_stores().await }));
    let mut router = boot_http::router(state.clone());
    // The front sends these files with sendfile(2); the Router answers what it hands over.
    let mut files = crate::boot::front::FileRoutes::default();
    if let Some(dir) = &opts.artifacts_dir {
        let timeline = state.clone();
        files = files.route(
            "/artifacts",
            dir,
            Some(std::sync::Arc::new(move |ip, file: &str| {
                timeline.artifact_served(ip, file)
            })),
        );
        router = router.nest(
            "/artifacts",
            crate::boot::artifacts::artifacts_router(dir.clone()).layer(
                middleware::from_fn_with_state(state.clone(), boot_http::artifact_hop),
            ),
        );
    }
    if let Some((_, root)) = &opts.tftp {
        // UEFI HTTP Boot clients fetch the same programs PXE clients get over TFTP.
        router = router.nest_service("/nbp", tower_http::services::ServeDir::new(root));
        files = files.route("/nbp", root, None);
    }
    let app = router.layer(middleware::from_fn(boot_http::access_log));
    if let Some(settings) = &opts.dhcp {
        let config = dhcp_config(settings, &running.base_url)?;
        let leases = match &settings.full {
            Some(full) => Some(full_leases(full, config.server_ip)?),
            None => None,
        };
        let mut dhcp =
            crate::boot::dhcpd::DhcpService::bind(&opts.boot_netns, config, state.clone())
                .map_err(|e| ManagerError::Dhcp(e.to_string()))?;
        if let Some(leases) = leases {
            dhcp = dhcp.with_leases(leases);
        }
        tracing::info!(ports = ?dhcp.ports(), interface = ?settings.interface, "proxyDHCP service listening");
        running.tasks.push(tokio::spawn(async move {
            if let Err(e) = dhcp.serve().await {
                tracing::error!(error = %e, "proxyDHCP service stopped");
            }
        }));
    }
    if let Some(tftp) = tftp {
        let tftp = tftp.with_observer(state.clone());
        tracing::info!(listen = ?running.tftp_addr, "boot TFTP service listening");
        running.tasks.push(tokio::spawn(async move {
            if let Err(e) = tftp.serve().await {
                tracing::error!(error = %e, "boot TFTP service stopped");
            }
        }));
    }
    running.held = Some(Held {
        hosts: host_ctx.clone(),
        machines: machine_ctx.clone(),
    });
    running
        .tasks
        .push(tokio::spawn(crate::controllers::janitor::run(
            host_ctx.clone(),
            machine_ctx.clone(),
            state,
            opts.janitor_interval,
        )));
    running
        .tasks
        .push(tokio::spawn(metalhost::run(host_controller, host_ctx)));
    running.tasks.push(tokio::spawn(metalmachine::run(
        machine_controller,
        machine_ctx,
    )));
    running.tasks.push(tokio::spawn(metalcluster::run(
        cluster_controller,
        cluster_ctx,
    )));
    running.tasks.push(tokio::spawn(existingcontrolplane::run(
        control_plane_controller,
        control_plane_ctx,
    )));
    Ok((app, files))
}

/// Forgets the expectations (of the controller whose context is `ctx`) that a deletion from
/// `shared` meets, as each deletion reaches the store ([`crate::controllers::expectations::Expectations::gone`]).
fn forget_expected_on_deletion<K, C, A>(
    shared: &crate::stores::SharedStore<K>,
    ctx: &Arc<C>,
    expectations: fn(&C) -> &crate::controllers::expectations::Expectations<A>,
) where
    K: crate::stores::Watched,
    C: Send + Sync + 'static,
    A: 'static,
{
    let ctx = ctx.clone();
    crate::controllers::expectations::follow_deletions(shared, move |key, absent| {
        expectations(&ctx).gone(key, absent)
    });
}

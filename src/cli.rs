//! The `metalboot` command line: one binary for the manager, CRD generation, operator tools and
//! the local lab.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::controlplane::{self, ControlPlane, Lifetime};
use crate::telemetry::{self, LogFormat};

#[derive(Debug, Parser)]
#[command(
    name = "metalboot",
    version,
    about = "Cluster API bare-metal provider with its own boot service"
)]
pub struct Cli {
    /// Log line format.
    #[arg(long, global = true, value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log filter (tracing EnvFilter syntax, e.g. `info,metalboot=debug`); defaults to $RUST_LOG or info.
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controllers and the boot service against the cluster named by the kubeconfig.
    Manager(Box<ManagerArgs>),
    /// Print every CRD as YAML, or write one file per CRD into a directory.
    Crds {
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Start or stop the local control plane (etcd + kube-apiserver built by hack/control-plane).
    #[command(subcommand)]
    ControlPlane(ControlPlaneCommand),
    /// The local lab: QEMU hosts behind virtual Redfish BMCs.
    #[command(subcommand)]
    Lab(LabCommand),
    /// Talk to one BMC: status, power, one-time boot, inventory.
    Bmc(crate::bmc::cli::BmcArgs),
    /// The deploy agent, run by the deploy ramdisk: inspect the host, write the image the boot
    /// service names to the chosen disk, leave the NoCloud seed, report.
    Agent(AgentArgs),
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// `http://…/agent/<token>`; default: `metalboot.agent=` on the kernel command line.
    #[arg(long)]
    pub url: Option<String>,
    /// Root of /proc and /sys.
    #[arg(long, default_value = "/")]
    pub sys_root: PathBuf,
    /// Where the disks are.
    #[arg(long, default_value = "/dev")]
    pub dev_dir: PathBuf,
    /// Seconds to keep retrying an unreachable boot service.
    #[arg(long, default_value_t = 600)]
    pub patience_seconds: u64,
}

#[derive(Debug, Args)]
pub struct ManagerArgs {
    /// Kubeconfig to use; defaults to $KUBECONFIG, ~/.kube/config, then the in-cluster account.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Apiserver requests in flight at once (watches, Lease renewals and the work a host's
    /// callback waits on excepted); the rest queue in the manager, in order. 0: no bound.
    #[arg(long, env = "METALBOOT_API_REQUESTS_IN_FLIGHT", default_value_t = crate::kubeconn::gate::DEFAULT_IN_FLIGHT)]
    pub api_requests_in_flight: usize,
    /// Of those, how many ordinary requests may be in flight while a request a host's callback
    /// waits on is: a new one starts only when fewer are (at least 1; equal to the bound: no
    /// difference).
    #[arg(long, env = "METALBOOT_API_REQUESTS_IN_FLIGHT_BESIDE_CALLBACKS", default_value_t = crate::kubeconn::gate::DEFAULT_BESIDE_URGENT)]
    pub api_requests_in_flight_beside_callbacks: usize,
    /// Connect to the cluster, report where, and exit (a quick check of credentials and network).
    #[arg(long)]
    pub check_connection: bool,
    /// Watch only this namespace (empty: all namespaces).
    #[arg(long, env = "METALBOOT_WATCH_NAMESPACE", default_value = "")]
    pub namespace: String,
    /// Reconcile only objects labelled cluster.x-k8s.io/watch-filter=<value> (empty: all).
    #[arg(long, env = "METALBOOT_WATCH_FILTER", default_value = "")]
    pub watch_filter: String,
    /// Controller groups to run: `infrastructure` (MetalHost, MetalMachine, MetalCluster and the
    /// boot service) and/or `bootstrap` (CloudInitConfig). clusterctl installs each as its own
    /// provider Deployment of this binary.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [ControllerGroup::Infrastructure, ControllerGroup::Bootstrap])]
    pub controllers: Vec<ControllerGroup>,
    /// Also run metalboot's own Machine and Cluster-status controllers, for clusters without
    /// upstream Cluster API core. Off for clusterctl installs, where core runs.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    pub standalone: bool,
    /// Elect a leader through a Lease so only one replica acts.
    #[arg(long)]
    pub leader_elect: bool,
    /// Namespace of the leader Lease (defaults to $POD_NAMESPACE, then "default").
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub leader_election_namespace: String,
    /// Seconds the leader Lease stays valid after a renewal; a standby takes over after that.
    #[arg(long, default_value_t = 15)]
    pub leader_elect_lease_seconds: u64,
    /// The leader renews when fewer than this many seconds are left, and stops writing when
    /// fewer than half of them are left (the margin for clock skew between replicas).
    #[arg(long, default_value_t = 10)]
    pub leader_elect_grace_seconds: u64,
    /// Address of the boot service's HTTP side.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub boot_http_bind: std::net::SocketAddr,
    /// Address of the boot service's TFTP side (iPXE binaries for PXE firmware).
    #[arg(long, default_value = "0.0.0.0:69")]
    pub tftp_bind: std::net::SocketAddr,
    /// Do not run TFTP (hosts chain-load iPXE some other way, or boot UEFI HTTP directly).
    #[arg(long)]
    pub no_tftp: bool,
    /// Directory TFTP serves iPXE binaries from.
    #[arg(long, default_value = "/usr/lib/ipxe")]
    pub tftp_root: PathBuf,
    /// DHCP on the provisioning network: `proxy` answers PXE and HTTP-boot firmware with the
    /// boot server and program (never an address; the site's DHCP server keeps doing that), and
    /// only for hosts being provisioned; `full` is the (isolated) network's only DHCP server:
    /// addresses from `--dhcp-range` for every client, MetalHosts' `bootIPAddress`
    /// reservations, and the boot program for hosts being provisioned; `off` leaves
    /// network-boot options to the site's server.
    #[arg(long, value_enum, default_value_t = DhcpMode::Proxy, env = "METALBOOT_DHCP")]
    pub dhcp: DhcpMode,
    /// The interface facing the hosts (default: all).
    #[arg(long, env = "METALBOOT_DHCP_INTERFACE", default_value = "")]
    pub dhcp_interface: String,
    /// Full DHCP: the provisioning network, e.g. 10.0.0.0/24.
    #[arg(long)]
    pub dhcp_range: Option<ipnetwork::Ipv4Network>,
    /// Full DHCP: the addresses handed out, `first-last` (default: the network from its tenth).
    #[arg(long)]
    pub dhcp_pool: Option<String>,
    /// Full DHCP: the router (option 3) clients are told.
    #[arg(long)]
    pub dhcp_router: Option<std::net::Ipv4Addr>,
    /// Full DHCP: lease time in seconds.
    #[arg(long, default_value_t = 3600)]
    pub dhcp_lease_seconds: u64,
    /// Full DHCP: where leases are recorded before they are acknowledged, so a restart never
    /// hands out a live lease again.
    #[arg(long, default_value = "/var/lib/metalboot/dhcp-leases.json")]
    pub dhcp_lease_file: PathBuf,
    /// metalboot's IPv4 address on the provisioning network (default: the advertise URL's host).
    #[arg(long)]
    pub dhcp_server_ip: Option<std::net::Ipv4Addr>,
    /// Answer every PXE client, not only hosts being provisioned.
    #[arg(long)]
    pub dhcp_answer_all: bool,
    /// Boot program for legacy BIOS PXE (client architecture 0), served over TFTP.
    #[arg(long, default_value = crate::boot::dhcp::DEFAULT_BIOS_FILE)]
    pub boot_file_bios: String,
    /// Boot program for x86-64 UEFI (architectures 7, 9; HTTP Boot 16 gets it over HTTP).
    #[arg(long, default_value = crate::boot::dhcp::DEFAULT_EFI_X64_FILE)]
    pub boot_file_efi_x64: String,
    /// Boot program for arm64 UEFI (architecture 11; HTTP Boot 19), when the TFTP root has one.
    #[arg(long, default_value = crate::boot::dhcp::DEFAULT_EFI_ARM64_FILE)]
    pub boot_file_efi_arm64: String,
    /// Open the boot service's sockets (HTTP, TFTP, DHCP) in this network namespace (a name
    /// from `ip netns` or a path); the lab's provisioning network. Default: the process's own.
    #[arg(long)]
    pub boot_netns: Option<String>,
    /// Directory served at /artifacts (kernels, initrds).
    #[arg(long)]
    pub artifacts_dir: Option<PathBuf>,
    /// Kernel of the deploy ramdisk that image-mode hosts netboot to run `metalboot agent`
    /// (a URL, or a path under --artifacts-dir). Without it image mode is refused.
    #[arg(long, requires = "deploy_initrd")]
    pub deploy_kernel: Option<String>,
    /// Initramfs of the deploy ramdisk (with `metalboot agent` as its job).
    #[arg(long, requires = "deploy_kernel")]
    pub deploy_initrd: Option<String>,
    /// Extra kernel arguments for the deploy ramdisk (the agent's URL is added).
    #[arg(long, default_value = "console=ttyS0")]
    pub deploy_cmdline: String,
    /// URL hosts use to reach the boot service, e.g. http://10.0.0.2:8080 (required when binding 0.0.0.0).
    #[arg(long)]
    pub advertise_url: Option<String>,
    /// Only the first address that fetched a host's iPXE script may use its boot token.
    #[arg(long)]
    pub pin_source_ip: bool,
    /// Seconds between power-state polls of each host.
    #[arg(long, default_value_t = 300)]
    pub power_poll_seconds: u64,
    /// Seconds a graceful power-off may take before it is forced.
    #[arg(long, default_value_t = 60)]
    pub graceful_off_seconds: u64,
    /// Seconds deletion keeps trying an unreachable BMC before releasing the machine anyway.
    #[arg(long, default_value_t = 600)]
    pub deprovision_timeout_seconds: u64,
}

/// `--dhcp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DhcpMode {
    Off,
    Proxy,
    Full,
}

/// A group of controllers selectable with `--controllers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ControllerGroup {
    Infrastructure,
    Bootstrap,
}

impl ManagerArgs {
    /// This replica's name in the leader Lease and the User-Agent: $POD_NAME, else host and pid.
    pub fn identity(&self) -> String {
        std::env::var("POD_NAME")
            .ok()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| {
                let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .map(|h| h.trim().to_string())
                    .unwrap_or_default();
                format!("{host}-{}", std::process::id())
            })
    }

    pub fn options(&self) -> std::io::Result<crate::manager::ManagerOptions> {
        let non_empty = |s: &str| (!s.is_empty()).then(|| s.to_string());
        if self.dhcp == DhcpMode::Full && self.dhcp_range.is_none() {
            return Err(std::io::Error::other(
                "--dhcp full needs --dhcp-range (the provisioning network, e.g. 10.0.0.0/24)",
            ));
        }
        let boot_netns = match &self.boot_netns {
            Some(name) => crate::boot::netns::NetNamespace::open(name)?,
            None => crate::boot::netns::NetNamespace::current(),
        };
        Ok(crate::manager::ManagerOptions {
            api_requests_in_flight: self.api_requests_in_flight,
            api_requests_in_flight_beside_callbacks: self.api_requests_in_flight_beside_callbacks,
            boot_netns,
            dhcp: (self.dhcp != DhcpMode::Off).then(|| crate::manager::DhcpSettings {
                full: match (self.dhcp, self.dhcp_range) {
                    (DhcpMode::Full, Some(network)) => Some(crate::manager::FullDhcp {
                        network,
                        pool: self.dhcp_pool.clone(),
                        router: self.dhcp_router,
                        lease_time: std::time::Duration::from_secs(self.dhcp_lease_seconds.max(60)),
                        lease_file: self.dhcp_lease_file.clone(),
                    }),
                    _ => None,
                },
                interface: non_empty(&self.dhcp_interface),
                server_ip: self.dhcp_server_ip,
                answer_all: self.dhcp_answer_all,
                bios_file: Some(self.boot_file_bios.clone()),
                efi_x64_file: Some(self.boot_file_efi_x64.clone()),
                efi_arm64_file: Some(self.boot_file_efi_arm64.clone()),
            }),
            namespace: non_empty(&self.namespace),
            watch_filter: non_empty(&self.watch_filter),
            controllers: crate::manager::Controllers {
                infrastructure: self.controllers.contains(&ControllerGroup::Infrastructure),
                bootstrap: self.controllers.contains(&ControllerGroup::Bootstrap),
                core: self.standalone,
            },
            leader_election: self.leader_elect.then(|| crate::leader::LeaseConfig {
                namespace: self.leader_election_namespace.clone(),
                // The bootstrap provider is a separate process with its own Lease.
                name: if self.controllers.contains(&ControllerGroup::Infrastructure) {
                    "metalboot-manager".into()
                } else {
                    "metalboot-bootstrap".into()
                },
                identity: self.identity(),
                duration: std::time::Duration::from_secs(self.leader_elect_lease_seconds),
                grace: std::time::Duration::from_secs(self.leader_elect_grace_seconds),
            }),
            boot_http: self.boot_http_bind,
            advertise_url: self.advertise_url.clone(),
            pin_source_ip: self.pin_source_ip,
            power_poll_interval: std::time::Duration::from_secs(self.power_poll_seconds.max(10)),
            graceful_off: std::time::Duration::from_secs(self.graceful_off_seconds),
            deprovision_timeout: std::time::Duration::from_secs(self.deprovision_timeout_seconds),
            artifacts_dir: self.artifacts_dir.clone(),
            deploy: self
                .deploy_kernel
                .as_ref()
                .zip(self.deploy_initrd.as_ref())
                .map(|(kernel, initrd)| crate::api::metalmachine::BootProfile {
                    kernel: kernel.clone(),
                    initrds: vec![initrd.clone()],
                    cmdline: Some(self.deploy_cmdline.clone()),
                }),
            tftp: (!self.no_tftp).then(|| (self.tftp_bind, self.tftp_root.clone())),
            ..Default::default()
        })
    }
}

#[derive(Debug, Args)]
pub struct ControlPlaneDirs {
    /// Data directory (certificates, etcd data, logs, kubeconfig, pids).
    #[arg(long, default_value_os_t = controlplane::project_dir().join("target/control-plane/run"))]
    pub dir: PathBuf,
    /// Where etcd and kube-apiserver were built.
    #[arg(long, default_value_os_t = controlplane::default_bin_dir())]
    pub bin_dir: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum ControlPlaneCommand {
    /// Start etcd and kube-apiserver in the background and write a kubeconfig.
    Start(ControlPlaneDirs),
    /// Stop exactly the processes `start` recorded.
    Stop(ControlPlaneDirs),
}

#[derive(Debug, Args)]
pub struct LabArgs {
    /// Number of QEMU hosts (and Machines). On the bridged network they take turns: SeaBIOS,
    /// UEFI PXE, UEFI HTTP Boot.
    #[arg(long, default_value_t = 3)]
    pub hosts: u32,
    /// Lab directory: control plane, image, host logs, state.
    #[arg(long, default_value_os_t = controlplane::project_dir().join("target/lab"))]
    pub dir: PathBuf,
    /// Memory per lab host (the live Debian keeps its root squashfs in memory).
    #[arg(long, default_value_t = 1024)]
    pub memory_mib: u32,
    /// Seconds from power-on to the callback before a lab host is power-cycled.
    #[arg(long, default_value_t = 600)]
    pub boot_timeout_seconds: i32,
    /// Seconds `lab up` waits for every Machine to be Running.
    #[arg(long, default_value_t = 1500)]
    pub timeout_seconds: u64,
    /// Run the Machines with metalboot's own standalone controllers instead of upstream Cluster
    /// API core installed by clusterctl (the default, which needs `make capi`).
    #[arg(long)]
    pub standalone: bool,
    /// Kubeadm workers: a MachineDeployment whose Machines upstream's kubeadm bootstrap provider
    /// (CABPK) renders, joined to the lab's apiserver by the real kubeadm and kubelet on the lab
    /// Debian (hosts get at least 2 GiB). Upstream mode only.
    #[arg(long)]
    pub kubeadm: bool,
    /// `bridged`: the hosts' firmware does real DHCP, PXE and TFTP on a bridge in network
    /// namespaces the lab creates (needs root), with dnsmasq as the site's DHCP server and
    /// metalboot's proxyDHCP; `user`: QEMU's user-mode network. Bridged falls back to user
    /// when the namespaces cannot be created, and says so.
    #[arg(long, value_enum, default_value_t = LabNetworkArg::Bridged)]
    pub network: LabNetworkArg,
    /// How the hosts get the lab's Debian: `live` netboots it on every boot (diskless, through
    /// live-boot); `image` has metalboot's deploy agent write it (the qcow2 image) to each
    /// host's 4 GiB virtio disk, which the host then boots.
    #[arg(long, value_enum, default_value_t = LabOsArg::Live)]
    pub os: LabOsArg,
    /// How many hosts (the last ones) sit behind an IPMI BMC (OpenIPMI's ipmi_sim in front of
    /// the virtual BMC) instead of Redfish.
    #[arg(long, default_value_t = 1)]
    pub ipmi_hosts: u32,
    /// Instead of QEMU hosts, N simulated hosts behind the virtual BMC: each, network-booted,
    /// fetches its iPXE script and NoCloud data, registers its Node and calls back, like a lab
    /// host does over the network (for scale; see `make bench-scale`).
    #[arg(long, default_value_t = 0)]
    pub simulated_hosts: u32,
    /// Simulated hosts: milliseconds from power-on to the firmware's first request.
    #[arg(long, default_value_t = 2000)]
    pub fleet_boot_delay_ms: u64,
    /// Simulated hosts: milliseconds from the NoCloud data to the end of the bootstrap.
    #[arg(long, default_value_t = 1000)]
    pub fleet_os_delay_ms: u64,
    /// Simulated hosts: the share (0 to 1) that never calls back.
    #[arg(long, default_value_t = 0.0)]
    pub fleet_no_callback: f64,
    /// Simulated hosts: the share whose BMC answers every request with 500.
    #[arg(long, default_value_t = 0.0)]
    pub fleet_bmc_errors: f64,
    /// Simulated hosts: the share whose BMC answers after 2 seconds.
    #[arg(long, default_value_t = 0.0)]
    pub fleet_slow_bmc: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LabOsArg {
    Live,
    Image,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LabNetworkArg {
    Bridged,
    User,
}

impl LabArgs {
    fn options(&self) -> crate::lab::up::LabOptions {
        crate::lab::up::LabOptions {
            hosts: self.hosts,
            dir: self.dir.clone(),
            memory_mib: self.memory_mib,
            boot_timeout_seconds: self.boot_timeout_seconds,
            standalone: self.standalone,
            ipmi_hosts: self.ipmi_hosts,
            simulated: (self.simulated_hosts > 0).then(|| crate::lab::up::Simulated {
                hosts: self.simulated_hosts,
                boot_delay: std::time::Duration::from_millis(self.fleet_boot_delay_ms),
                os_delay: std::time::Duration::from_millis(self.fleet_os_delay_ms),
                faults: crate::lab::fleet::FaultShares {
                    no_callback: self.fleet_no_callback.clamp(0.0, 1.0),
                    bmc_errors: self.fleet_bmc_errors.clamp(0.0, 1.0),
                    slow_bmc: self.fleet_slow_bmc.clamp(0.0, 1.0),
                    slow_bmc_delay: std::time::Duration::from_secs(2),
                },
            }),
            network: match self.network {
                LabNetworkArg::Bridged => crate::lab::up::NetworkMode::Bridged,
                LabNetworkArg::User => crate::lab::up::NetworkMode::User,
            },
            image_mode: self.os == LabOsArg::Image,
            kubeadm: self.kubeadm,
        }
    }
}

#[derive(Debug, Args)]
pub struct LabDir {
    /// Lab directory.
    #[arg(long, default_value_os_t = controlplane::project_dir().join("target/lab"))]
    pub dir: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum LabCommand {
    /// Set up and start the lab in the background; show progress until every Machine is Running.
    Up(LabArgs),
    /// The lab itself, in the foreground (what `up` starts in the background).
    Serve(LabArgs),
    /// Print the lab's table and timings once.
    Status(LabDir),
    /// Stop exactly what `lab up` started.
    Down(LabDir),
}

pub async fn run() -> ExitCode {
    let cli = Cli::parse();
    telemetry::init(cli.log_format, cli.log_level.as_deref());
    match dispatch(cli.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("metalboot: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(command: Command) -> Result<(), String> {
    match command {
        Command::Manager(args) => {
            let conn = crate::kubeconn::connect(args.kubeconfig.as_deref(), &args.identity())
                .await
                .map_err(|e| e.to_string())?;
            tracing::info!(server = %conn.server, source = %conn.source_desc, "connected to the management cluster");
            if args.check_connection {
                return Ok(());
            }
            let options = args.options().map_err(|e| e.to_string())?;
            let running = crate::manager::start(conn.client, options)
                .await
                .map_err(|e| e.to_string())?;
            running.wait().await.map_err(|e| e.to_string())
        }
        Command::Bmc(args) => crate::bmc::cli::run(args).await,
        Command::Agent(args) => run_agent(args).await,
        Command::Crds { out_dir } => write_crds(out_dir.as_deref()),
        Command::Lab(LabCommand::Up(args)) => crate::lab::up::up(
            args.options(),
            std::time::Duration::from_secs(args.timeout_seconds),
        )
        .await
        .map_err(|e| e.to_string()),
        Command::Lab(LabCommand::Serve(args)) => crate::lab::up::serve(args.options())
            .await
            .map_err(|e| e.to_string()),
        Command::Lab(LabCommand::Status(d)) => crate::lab::up::status(&d.dir)
            .await
            .map_err(|e| e.to_string()),
        Command::Lab(LabCommand::Down(d)) => {
            crate::lab::up::down(&d.dir).map_err(|e| e.to_string())
        }
        Command::ControlPlane(ControlPlaneCommand::Start(dirs)) => {
            let cp = start_detached(&dirs).await?;
            println!("control plane running at {}", cp.server);
            println!("  export KUBECONFIG={}", cp.kubeconfig_path.display());
            println!(
                "  logs: {}/{{etcd,kube-apiserver}}.log",
                cp.data_dir.display()
            );
            Ok(())
        }
        Command::ControlPlane(ControlPlaneCommand::Stop(dirs)) => {
            let stopped =
                controlplane::stop_detached(&dirs.dir, &dirs.bin_dir).map_err(|e| e.to_string())?;
            if stopped.is_empty() {
                println!("nothing was running");
            }
            for s in stopped {
                println!("stopped {s}");
            }
            Ok(())
        }
    }
}

async fn start_detached(dirs: &ControlPlaneDirs) -> Result<ControlPlane, String> {
    if dirs.dir.join("pids").exists() {
        let _ = controlplane::stop_detached(&dirs.dir, &dirs.bin_dir);
    }
    ControlPlane::start(&controlplane::Options {
        bin_dir: dirs.bin_dir.clone(),
        data_dir: dirs.dir.clone(),
        lifetime: Lifetime::Detached,
        join_ready: false,
    })
    .await
    .map_err(|e| e.to_string())
}

fn write_crds(out_dir: Option<&std::path::Path>) -> Result<(), String> {
    use crate::api::crdgen;
    let Some(dir) = out_dir else {
        print!("{}", crdgen::all_yaml().map_err(|e| e.to_string())?);
        return Ok(());
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let files = crdgen::generated_files().map_err(|e| e.to_string())?;
    let names: Vec<&String> = files.iter().map(|(name, _)| name).collect();
    // Remove generated files whose type is gone, so crds/ mirrors the code exactly.
    for stale in crdgen::yaml_files_under(dir) {
        if !names.contains(&&stale) {
            let _ = std::fs::remove_file(dir.join(stale));
        }
    }
    for (name, content) in &files {
        let path = dir.join(name);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("creating {}: {e}", parent.display()))?;
        }
        std::fs::write(&path, content).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

async fn run_agent(args: AgentArgs) -> Result<(), String> {
    use crate::agent::run::{AgentConfig, Outcome, run, url_from_cmdline};
    let url = match args.url {
        Some(url) => url,
        None => std::fs::read_to_string("/proc/cmdline")
            .ok()
            .and_then(|c| url_from_cmdline(&c))
            .ok_or("no --url and no metalboot.agent= on the kernel command line")?,
    };
    let outcome = run(AgentConfig {
        url,
        sys_root: args.sys_root,
        dev_dir: args.dev_dir,
        patience: std::time::Duration::from_secs(args.patience_seconds),
    })
    .await
    .map_err(|e| e.to_string())?;
    match outcome {
        Outcome::Written { device, bytes } => {
            println!("metalboot agent: wrote {bytes} bytes to {device}");
            Ok(())
        }
        Outcome::Cleaned => {
            println!("metalboot agent: disks cleaned");
            Ok(())
        }
        Outcome::Nothing(reason) => {
            println!("metalboot agent: nothing to do: {reason}");
            Ok(())
        }
        Outcome::Failed { reason, message } => Err(format!("{reason}: {message}")),
    }
}

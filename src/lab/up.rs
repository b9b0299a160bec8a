//! `metalboot lab up|serve|status|down`: the whole provisioning chain on one machine. `up` sets
//! things up and starts `serve` in the background; `serve` owns the control plane, the manager,
//! the virtual BMC and the QEMU hosts, and records state and timings under the lab directory;
//! `status` reads them; `down` stops exactly the `serve` process `up` started (everything else
//! dies with it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde::{Deserialize, Serialize};

use crate::api::MetalHost;
use crate::api::capi::Machine;
use crate::boot::http::BootEvent;
use crate::controlplane::{self, ControlPlane, Lifetime};
use crate::manager::ManagerOptions;

use super::net::LabNetwork;
use super::objects::LabObjects;
use super::qemu::{Accel, Firmware, HostNetwork, QemuHost, QemuHostSpec, probe_accel};
use super::vbmc::{self, LabSystem, VirtualBmc};
use futures::{StreamExt, TryStreamExt};

pub const NAMESPACE: &str = "metalboot-lab";
pub const CLUSTER: &str = "lab";
pub(crate) const MANAGER: &str = "metalboot-lab";

#[derive(Debug, Clone)]
pub struct LabOptions {
    pub hosts: u32,
    pub dir: PathBuf,
    pub memory_mib: u32,
    /// Seconds a lab host may take from power-on to its callback before a power cycle.
    pub boot_timeout_seconds: i32,
    /// metalboot's standalone controllers run the Machines, instead of upstream core.
    pub standalone: bool,
    /// How many of the hosts (the last ones) sit behind an IPMI BMC instead of Redfish.
    pub ipmi_hosts: u32,
    /// How hosts are wired: a bridged network in namespaces (real DHCP/PXE/TFTP) or QEMU's
    /// user-mode network (its DHCP hands iPXE the script URL).
    pub network: NetworkMode,
    /// Simulated hosts instead of QEMU ones (`--simulated-hosts`).
    pub simulated: Option<Simulated>,
    /// `--os image`: the deploy agent writes the lab's Debian to each host's disk, instead of
    /// the hosts netbooting it live.
    pub image_mode: bool,
    /// `--kubeadm`: the Machines are a MachineDeployment of kubeadm workers (upstream's kubeadm
    /// bootstrap provider renders their data) that join the lab's apiserver with the real
    /// kubeadm and kubelet, instead of the kubelet stand-in.
    pub kubeadm: bool,
}

/// `lab up --simulated-hosts N`: the fleet of [`super::fleet`] on loopback, no QEMU.
#[derive(Debug, Clone)]
pub struct Simulated {
    pub hosts: u32,
    pub boot_delay: Duration,
    pub os_delay: Duration,
    pub faults: super::fleet::FaultShares,
}

/// `lab up --network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NetworkMode {
    Bridged,
    User,
}

/// The lab's network namespace: named after the lab directory, so two labs (a developer's and a
/// test's) never share one, and the next lab in the same directory deletes a killed one's.
pub fn netns_name(dir: &Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    // FNV-1a: stable across runs and Rust versions, unlike the std hasher.
    let hash = dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("metalboot-lab-{:08x}", hash as u32)
}

/// Which firmware lab host `i` has on the bridged network: every kind in turn.
pub fn firmware_of(i: u32, network: NetworkMode) -> Firmware {
    match (network, i % 3) {
        (NetworkMode::User, _) => Firmware::Bios,
        (_, 0) => Firmware::Bios,
        (_, 1) => Firmware::UefiPxe,
        _ => Firmware::UefiHttp,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("{0}")]
    Setup(String),
    #[error("control plane: {0}")]
    ControlPlane(#[from] controlplane::ControlPlaneError),
    #[error("Kubernetes: {0}")]
    Kube(#[from] kube::Error),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LabError {
    let what = what.into();
    move |source| LabError::Io { what, source }
}

/// What `serve` tells `up`, `status` and `down` (written once everything is started).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabState {
    pub pid: u32,
    pub kubeconfig: PathBuf,
    pub accel: String,
    pub boot_url: String,
    pub bmc_url: String,
    pub hosts: Vec<LabHost>,
    /// The network the lab ended up with (bridged, or user-mode when namespaces failed).
    #[serde(default = "user_network")]
    pub network: NetworkMode,
    /// The provisioning network's namespace (bridged network): `ip netns exec <it> …` reaches
    /// the boot service and the hosts.
    #[serde(default)]
    pub netns: Option<String>,
}

fn user_network() -> NetworkMode {
    NetworkMode::User
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LabHost {
    pub name: String,
    pub mac: String,
    #[serde(default = "bios")]
    pub firmware: Firmware,
    /// The BMC address of its MetalHost (`redfish+http://…` or `ipmi://…`).
    #[serde(default)]
    pub bmc: String,
    pub serial_log: PathBuf,
}

/// Live facts `serve` refreshes every second: power and QEMU pid per host.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HostLive {
    pub power: String,
    pub qemu_pid: Option<u32>,
}

/// Milestones per host (RFC 3339), for the timings table.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Timeline {
    pub power_on: Option<String>,
    /// metalboot's proxyDHCP answered the firmware (bridged network only).
    #[serde(default)]
    pub dhcp: Option<String>,
    /// The boot program arrived over TFTP (UEFI PXE hosts).
    #[serde(default)]
    pub tftp: Option<String>,
    pub script: Option<String>,
    /// The kernel and the (last) initrd were served (bridged network: matched by address).
    #[serde(default)]
    pub kernel: Option<String>,
    #[serde(default)]
    pub initrd: Option<String>,
    pub user_data: Option<String>,
    pub callback: Option<String>,
    pub running: Option<String>,
}

fn bios() -> Firmware {
    Firmware::Bios
}

fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), LabError> {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_vec_pretty(value).map_err(|e| LabError::Setup(e.to_string()))?;
    std::fs::write(&tmp, text).map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("writing {}", path.display())))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Option<T> {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
}

use super::fleet::mac_of;

fn free_port() -> Result<u16, LabError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io("finding a free port"))
}

/// The lab daemon: everything runs in this process until SIGTERM/SIGINT.
pub async fn serve(opts: LabOptions) -> Result<(), LabError> {
    let dir = opts.dir.clone();
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let image = dir.join("image");
    for f in LIVE_FILES {
        let path = image.join("live").join(f);
        if opts.simulated.is_none() && !path.is_file() {
            return Err(LabError::Setup(format!(
                "lab OS {} missing; `metalboot lab up` puts it there (hack/os-image/build.sh builds it)",
                path.display()
            )));
        }
    }
    if opts.kubeadm && (opts.standalone || opts.simulated.is_some()) {
        return Err(LabError::Setup(
            "--kubeadm needs upstream Cluster API (not --standalone) and QEMU hosts (not --simulated-hosts)".into(),
        ));
    }
    let cp = ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir: dir.join("control-plane"),
        lifetime: Lifetime::TiedToThisProcess,
        join_ready: opts.kubeadm,
    })
    .await?;
    let client = cp.client().await?;
    tracing::info!(server = %cp.server, "lab control plane ready");
    // Provider mode (the default): clusterctl installs upstream core and metalboot's two
    // providers from a local repository, and core runs out of process. Standalone mode installs
    // metalboot's CRDs (with its Cluster and Machine stand-ins) and runs its own controllers.
    let (_upstream_managers, controllers) = if opts.standalone {
        crate::api::crdgen::install(&client).await?;
        (Vec::new(), crate::manager::Controllers::ALL)
    } else {
        let upstream_dir = dir.join("upstream");
        let _ = std::fs::remove_dir_all(&upstream_dir);
        std::fs::create_dir_all(&upstream_dir).map_err(io("creating the upstream directory"))?;
        let (release, _, managers) =
            super::upstream::install(&client, &cp.kubeconfig_path, &upstream_dir, opts.kubeadm)
                .await
                .map_err(|e| LabError::Setup(e.to_string()))?;
        for manager in &managers {
            tracing::info!(version = %release.version, log = %manager.log.display(), "upstream Cluster API provider installed by clusterctl and running");
        }
        (managers, crate::manager::Controllers::PROVIDERS)
    };
    let accel = probe_accel(&dir.join("kvm-probe")).await;
    tracing::info!(
        accel = accel.name(),
        "lab hosts run with {}",
        if accel == Accel::Kvm {
            "KVM"
        } else {
            "TCG (software emulation)"
        }
    );

    // The bridged network when the machine allows it; otherwise user-mode, said loudly.
    // Simulated hosts live on loopback: no bridge, no firmware, no DHCP.
    let network_mode = if opts.simulated.is_some() {
        NetworkMode::User
    } else {
        opts.network
    };
    let mut network = match network_mode {
        NetworkMode::User => None,
        NetworkMode::Bridged => match LabNetwork::create(&netns_name(&dir)) {
            Ok(mut net) => match net.start_site_dhcp(&dir.join("network")) {
                Ok(()) => Some(net),
                Err(e) => {
                    tracing::warn!(error = %e, "no site DHCP server; falling back to QEMU's user-mode network");
                    None
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot create the lab's network namespaces (root and iproute2 needed); falling back to QEMU's user-mode network");
                None
            }
        },
    };
    let mode = if network.is_some() {
        NetworkMode::Bridged
    } else {
        NetworkMode::User
    };
    // Where hosts reach metalboot: its bridge address, or the user-mode network's gateway.
    let host_side_ip = match mode {
        NetworkMode::Bridged => super::net::BOOT_IP.to_string(),
        NetworkMode::User => "10.0.2.2".to_string(),
    };
    let boot_netns = match &network {
        Some(net) => net.namespace().map_err(io("opening the lab namespace"))?,
        None => crate::boot::netns::NetNamespace::current(),
    };
    let boot_port = free_port()?;
    let boot_url = format!("http://{host_side_ip}:{boot_port}");
    let listen_ip = match mode {
        NetworkMode::Bridged => host_side_ip.clone(),
        NetworkMode::User => "127.0.0.1".to_string(),
    };
    let manager = crate::manager::start(
        client.clone(),
        ManagerOptions {
            namespace: Some(NAMESPACE.into()),
            controllers,
            boot_http: format!("{listen_ip}:{boot_port}")
                .parse()
                .map_err(|e| LabError::Setup(format!("{e}")))?,
            advertise_url: Some(boot_url.clone()),
            boot_netns: boot_netns.clone(),
            // Real firmware on the bridge: TFTP on :69 and proxyDHCP on the bridge only.
            tftp: (mode == NetworkMode::Bridged).then(|| {
                (
                    std::net::SocketAddr::from((super::net::BOOT_IP, 69)),
                    PathBuf::from("/usr/lib/ipxe"),
                )
            }),
            dhcp: (mode == NetworkMode::Bridged).then(|| crate::manager::DhcpSettings {
                interface: Some(super::net::BRIDGE.into()),
                ..Default::default()
            }),
            artifacts_dir: Some(image.clone()),
            deploy: opts
                .image_mode
                .then(|| crate::api::metalmachine::BootProfile {
                    kernel: "deploy-vmlinuz".into(),
                    initrds: vec!["deploy-initrd.gz".into()],
                    cmdline: Some("console=ttyS0".into()),
                }),
            power_poll_interval: Duration::from_secs(15),
            graceful_off: Duration::from_secs(30),
            deprovision_timeout: Duration::from_secs(120),
            bmc_timeout: Duration::from_secs(10),
            ..Default::default()
        },
    )
    .await
    .map_err(|e| LabError::Setup(e.to_string()))?;

    let bmc_password = crate::boot::tokens::Token::mint().expose()[..24].to_string();
    let mut hosts: Vec<Arc<QemuHost>> = Vec::new();
    // Image mode: a fresh, empty 4 GiB virtio disk per host and lab run.
    let disk_of = |i: u32| -> Result<Option<PathBuf>, LabError> {
        if !opts.image_mode {
            return Ok(None);
        }
        let path = dir
            .join("hosts")
            .join(format!("lab-host-{i}"))
            .join("disk.raw");
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(io(format!("creating {}", parent.display())))?;
        }
        let _ = std::fs::remove_file(&path);
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(4 << 30))
            .map_err(io(format!("creating {}", path.display())))?;
        Ok(Some(path))
    };
    let qemu_hosts = if opts.simulated.is_some() {
        0
    } else {
        opts.hosts
    };
    for i in 0..qemu_hosts {
        let host_network = match &network {
            Some(net) => {
                let tap = format!("tap{i}");
                net.add_tap(&tap)
                    .map_err(|e| LabError::Setup(e.to_string()))?;
                HostNetwork::Tap {
                    netns: net.netns.clone(),
                    ifname: tap,
                }
            }
            None => HostNetwork::User {
                bootfile_url: format!("{boot_url}/boot.ipxe"),
            },
        };
        hosts.push(Arc::new(QemuHost::new(QemuHostSpec {
            name: format!("lab-host-{i}"),
            uuid: format!("6d62a1b0-0000-4000-8000-{i:012x}"),
            mac: mac_of(i),
            // A kubelet and containerd beside the live root squashfs need more than the stand-in.
            memory_mib: if opts.kubeadm {
                opts.memory_mib.max(2048)
            } else {
                opts.memory_mib
            },
            network: host_network,
            firmware: firmware_of(i, mode),
            dir: dir.join("hosts").join(format!("lab-host-{i}")),
            accel,
            graceful_seconds: 30,
            disk: disk_of(i)?,
        })));
    }
    for h in &hosts {
        // A fresh serial log per lab run.
        let _ = std::fs::create_dir_all(&h.spec.dir);
        let _ = std::fs::remove_file(h.serial_log());
    }
    let fleet = match &opts.simulated {
        Some(sim) => Some(
            super::fleet::Fleet::new(super::fleet::FleetOptions {
                hosts: sim.hosts,
                boot_url: boot_url.clone(),
                boot_delay: sim.boot_delay,
                os_delay: sim.os_delay,
                faults: sim.faults.clone(),
                concurrent_boots: 256,
            })
            .map_err(|e| LabError::Setup(format!("the simulated fleet's HTTP client: {e}")))?,
        ),
        None => None,
    };
    let mut systems: Vec<LabSystem> = hosts.iter().cloned().map(LabSystem::Qemu).collect();
    if let Some(fleet) = &fleet {
        systems.extend(fleet.systems());
    }
    let bmc = Arc::new(VirtualBmc::with_systems(
        systems.clone(),
        "admin".into(),
        bmc_password.clone(),
    ));
    let bmc_port = vbmc::serve_on_loopback(bmc)
        .await
        .map_err(io("serving the lab BMC"))?;
    let bmc_url = format!("redfish+http://127.0.0.1:{bmc_port}");

    // The last `ipmi_hosts` hosts answer IPMI (ipmi_sim in front of the virtual BMC).
    let ipmi_password = crate::boot::tokens::Token::mint().expose()[..16].to_string();
    let mut ipmi_fronts = Vec::new();
    let mut bmcs: Vec<(String, &'static str)> = systems
        .iter()
        .map(|s| {
            (
                format!("{bmc_url}/redfish/v1/Systems/{}", s.name()),
                "lab-bmc",
            )
        })
        .collect();
    let ipmi_from = qemu_hosts.saturating_sub(opts.ipmi_hosts) as usize;
    if qemu_hosts == 0 || opts.ipmi_hosts == 0 {
        // No QEMU host to put behind IPMI.
    } else if !super::ipmi::available() {
        tracing::warn!(
            "ipmi_sim, ipmitool or curl missing (packages openipmi, ipmitool, curl): every lab host uses Redfish"
        );
    } else {
        for (i, h) in hosts.iter().enumerate().skip(ipmi_from) {
            let front = super::ipmi::start(
                &h.spec.dir.join("ipmi"),
                &h.spec.name,
                &format!("http://127.0.0.1:{bmc_port}"),
                ("admin", &bmc_password),
                ("admin", &ipmi_password),
            )
            .map_err(io(format!("starting ipmi_sim for {}", h.spec.name)))?;
            tracing::info!(host = %h.spec.name, address = %front.address(), "lab host behind an IPMI BMC (ipmi_sim)");
            bmcs[i] = (front.address(), "lab-ipmi");
            ipmi_fronts.push(front);
        }
    }

    let api_port = cp.server.rsplit(':').next().unwrap_or("6443").to_string();
    // The lab OS reaches the apiserver through a loopback relay (see lab::relay).
    let relay_listener = boot_netns
        .tcp_listener(
            format!("{listen_ip}:0")
                .parse()
                .map_err(|e| LabError::Setup(format!("{e}")))?,
        )
        .map_err(io("binding the apiserver relay"))?;
    let relay_port = relay_listener
        .local_addr()
        .map_err(io("relay address"))?
        .port();
    let (upstream, ca) = (cp.server.clone(), cp.ca_pem.clone());
    // Kubeadm mode: the CA key and kubeconfig Cluster API needs from the existing control plane.
    let mut existing_control_plane: Option<(String, String)> = None;
    if opts.kubeadm {
        // Real kubelets: TLS end to end through a passthrough relay, and the control plane
        // made ready for their joins at the address they use.
        let api_addr: std::net::SocketAddr = format!("127.0.0.1:{api_port}")
            .parse()
            .map_err(|e| LabError::Setup(format!("the apiserver's address: {e}")))?;
        tokio::spawn(async move {
            if let Err(e) = super::relay::serve_tcp(relay_listener, api_addr).await {
                tracing::error!(error = %e, "apiserver TLS relay stopped");
            }
        });
        controlplane::prepare_for_joins(
            &client,
            &controlplane::default_bin_dir(),
            &cp.kubeconfig_path,
            (&host_side_ip, relay_port),
            &dir.join("kubeadm"),
        )
        .await?;
        let ca_key_path = cp.data_dir.join("pki/ca.key");
        let ca_key = std::fs::read_to_string(&ca_key_path)
            .map_err(io(format!("reading {}", ca_key_path.display())))?;
        let kubeconfig =
            serde_yaml::to_string(&cp.kubeconfig).map_err(|e| LabError::Setup(e.to_string()))?;
        existing_control_plane = Some((ca_key, kubeconfig));
    } else {
        tokio::spawn(async move {
            if let Err(e) = super::relay::serve(relay_listener, upstream, &ca).await {
                tracing::error!(error = %e, "apiserver relay stopped");
            }
        });
    }
    let objects = LabObjects {
        client: client.clone(),
        namespace: NAMESPACE.into(),
        // Kubeadm workers join at the relay, which the ExistingControlPlane names too.
        endpoint: (
            host_side_ip.clone(),
            if opts.kubeadm {
                i32::from(relay_port)
            } else {
                api_port.parse().unwrap_or(6443)
            },
        ),
        kubeadm: opts.kubeadm,
        kubeconfig: serde_yaml::to_string(&cp.kubeconfig)
            .map_err(|e| LabError::Setup(e.to_string()))?,
        kubelet_apiserver: format!("http://{host_side_ip}:{relay_port}"),
        boot_timeout_seconds: opts.boot_timeout_seconds,
        boot_url: boot_url.clone(),
        image: if opts.image_mode {
            let sums = std::fs::read_to_string(image.join("SHA256SUMS"))
                .map_err(io("reading the lab image's SHA256SUMS"))?;
            let checksum = sums
                .lines()
                .find(|l| l.ends_with(" debian.qcow2"))
                .and_then(|l| l.split_whitespace().next())
                .ok_or_else(|| LabError::Setup("debian.qcow2 is not in SHA256SUMS".into()))?;
            Some(("debian.qcow2".to_string(), checksum.to_string()))
        } else {
            None
        },
    };
    objects
        .base(&[("lab-bmc", &bmc_password), ("lab-ipmi", &ipmi_password)])
        .await?;
    if let Some((ca_key, kubeconfig)) = &existing_control_plane {
        super::upstream::write_cluster_secrets(
            &client,
            NAMESPACE,
            CLUSTER,
            (&cp.ca_pem, ca_key),
            kubeconfig,
        )
        .await
        .map_err(|e| LabError::Setup(e.to_string()))?;
        tracing::info!(endpoint = %format!("{host_side_ip}:{relay_port}"), "lab control plane ready for kubeadm joins: ExistingControlPlane, {CLUSTER}-ca, {CLUSTER}-kubeconfig");
    }
    let what = if fleet.is_some() {
        "simulated"
    } else {
        "QEMU lab"
    };
    let count = bmcs.len() as u32;
    // A few at a time: thousands of simulated hosts register in seconds, not minutes.
    futures::stream::iter((0..count).zip(&bmcs))
        .map(|(i, bmc)| {
            let uefi = fleet.is_none() && firmware_of(i, mode).uefi();
            let description = format!("{what} host {i}");
            let objects = &objects;
            async move { objects.host(i, (&bmc.0, bmc.1), uefi, &description).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    if opts.kubeadm {
        objects.kubeadm_workers(count).await?;
    } else {
        futures::stream::iter(0..count)
            .map(|i| objects.machine(i))
            .buffer_unordered(16)
            .try_collect::<Vec<()>>()
            .await?;
    }

    let state = LabState {
        pid: std::process::id(),
        kubeconfig: cp.kubeconfig_path.clone(),
        accel: accel.name().into(),
        boot_url,
        bmc_url: bmc_url.clone(),
        network: mode,
        netns: network.as_ref().map(|n| n.netns.clone()),
        hosts: hosts
            .iter()
            .enumerate()
            .map(|(i, h)| LabHost {
                name: h.spec.name.clone(),
                mac: h.spec.mac.clone(),
                firmware: h.spec.firmware,
                bmc: bmcs.get(i).map(|b| b.0.clone()).unwrap_or_default(),
                serial_log: h.serial_log(),
            })
            .chain(fleet.iter().flat_map(|f| &f.hosts).map(|h| LabHost {
                name: h.name.clone(),
                mac: h.mac.clone(),
                firmware: bios(),
                bmc: format!("{bmc_url}/redfish/v1/Systems/{}", h.name),
                serial_log: PathBuf::new(),
            }))
            .collect(),
    };
    write_json(&dir.join("state.json"), &state)?;
    tracing::info!(hosts = count, "lab objects created; provisioning");

    // Timings: power-on from the hosts, boot milestones from the boot service, Running from Machines.
    let mut events = manager
        .boot
        .as_ref()
        .ok_or_else(|| LabError::Setup("the lab manager runs no boot service".into()))?
        .subscribe();
    let mut timelines: BTreeMap<String, Timeline> = BTreeMap::new();
    let machines: Api<Machine> = Api::namespaced(client.clone(), NAMESPACE);
    let metal_machines: Api<crate::api::MetalMachine> = Api::namespaced(client.clone(), NAMESPACE);
    // Listing thousands of Machines every second would be most of the apiserver's work.
    let mut tick = tokio::time::interval(Duration::from_secs(if count > 50 { 10 } else { 1 }));
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io("SIGTERM handler"))?;
    let stamp = || jiff::Timestamp::now().to_string();
    loop {
        tokio::select! {
            _ = terminate.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
            event = events.recv() => {
                if let Ok(event) = event {
                    let (host, field) = match &event {
                        BootEvent::DhcpAnswered { host, .. } => (host.clone(), "dhcp"),
                        BootEvent::TftpDone { host, .. } => (host.clone(), "tftp"),
                        BootEvent::Artifact { host, file, .. } if file.starts_with("initrd") => (host.clone(), "initrd"),
                        BootEvent::Artifact { host, .. } => (host.clone(), "kernel"),
                        BootEvent::ScriptServed { host, .. } => (host.clone(), "script"),
                        BootEvent::NoCloud { host, document, .. } if document == "user-data" => (host.clone(), "user_data"),
                        BootEvent::Callback { host, .. } => (host.clone(), "callback"),
                        _ => continue,
                    };
                    let t = timelines.entry(host).or_default();
                    let slot = match field { "dhcp" => &mut t.dhcp, "tftp" => &mut t.tftp, "script" => &mut t.script, "kernel" => &mut t.kernel, "initrd" => &mut t.initrd, "user_data" => &mut t.user_data, _ => &mut t.callback };
                    // The first of each, except the initrd: the last one ends the download.
                    if slot.is_none() || field == "initrd" { *slot = Some(stamp()); }
                }
            }
            _ = tick.tick() => {
                let mut live = BTreeMap::new();
                for h in &hosts {
                    let pid = h.pid().await;
                    let power = if pid.is_some() { "On" } else { "Off" };
                    if pid.is_some() {
                        let t = timelines.entry(h.spec.name.clone()).or_default();
                        if t.power_on.is_none() { t.power_on = Some(stamp()); }
                    }
                    live.insert(h.spec.name.clone(), HostLive { power: power.into(), qemu_pid: pid });
                }
                if let Some(fleet) = &fleet {
                    for h in &fleet.hosts {
                        let power = format!("{:?}", h.power_state());
                        live.insert(h.name.clone(), HostLive { power, qemu_pid: None });
                    }
                    let _ = write_json(&dir.join("fleet.json"), &fleet.stats());
                }
                // Which host runs which Machine is the MetalMachine's claim, not the order.
                let claims: BTreeMap<String, String> = metal_machines
                    .list(&ListParams::default())
                    .await
                    .map(|l| l.items.into_iter().filter_map(|mm| Some((mm.name_any(), mm.status?.host_ref?.name))).collect())
                    .unwrap_or_default();
                if let Ok(list) = machines.list(&ListParams::default()).await {
                    for m in list.items {
                        let running = m.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                        if let (true, Some(host)) = (running, claims.get(&m.spec.infrastructure_ref.name)) {
                            let t = timelines.entry(host.clone()).or_default();
                            if t.running.is_none() { t.running = Some(stamp()); }
                        }
                    }
                }
                let _ = write_json(&dir.join("hosts.json"), &live);
                let _ = write_json(&dir.join("timings.json"), &timelines);
            }
        }
    }
    tracing::info!("lab shutting down");
    for h in &hosts {
        let _ = h.force_off().await;
    }
    drop(manager);
    drop(ipmi_fronts);
    drop(network.take());
    cp.stop();
    let _ = std::fs::remove_file(dir.join("state.json"));
    let _ = std::fs::remove_file(dir.join("lab.pid"));
    Ok(())
}

/// One row per host of the live table.
pub struct Row {
    pub host: String,
    pub power: String,
    pub host_state: String,
    pub machine: String,
    pub phase: String,
    pub detail: String,
}

pub async fn rows(dir: &Path) -> Result<(LabState, Vec<Row>), LabError> {
    let state: LabState = read_json(&dir.join("state.json"))
        .ok_or_else(|| LabError::Setup(format!("no lab running in {}", dir.display())))?;
    let live: BTreeMap<String, HostLive> = read_json(&dir.join("hosts.json")).unwrap_or_default();
    let kc = kube::config::Kubeconfig::read_from(&state.kubeconfig)
        .map_err(|e| LabError::Setup(e.to_string()))?;
    let client = controlplane::client_from_kubeconfig(kc).await?;
    let hosts: Vec<MetalHost> = Api::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await?
        .items;
    let machines: Vec<Machine> = Api::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await?
        .items;
    let metal_machines: Vec<crate::api::MetalMachine> = Api::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await?
        .items;
    let rows = state
        .hosts
        .iter()
        .map(|h| {
            let host = hosts.iter().find(|x| x.name_any() == h.name);
            let claimer = metal_machines.iter().find(|mm| {
                mm.status
                    .as_ref()
                    .and_then(|s| s.host_ref.as_ref())
                    .is_some_and(|r| r.name == h.name)
            });
            let claimed_by = claimer.map(|mm| mm.name_any());
            // Image mode: the deploy agent's progress (bytes written, rate) while it lasts.
            let image_note = claimer
                .and_then(|mm| mm.status.as_ref())
                .and_then(|s| {
                    s.conditions
                        .iter()
                        .find(|c| c.type_ == crate::controllers::metalmachine::BOOT_READY)
                })
                .filter(|c| {
                    ["WaitingForAgent", "WritingImage", "BootingInstalledOS"]
                        .contains(&c.reason.as_str())
                })
                .map(|c| format!("{}: {}", c.reason, c.message));
            let machine = claimed_by.and_then(|mm| {
                machines
                    .iter()
                    .find(|m| m.spec.infrastructure_ref.name == mm)
            });
            // The first condition that is not yet true says what the Machine waits for.
            let condition_note = machine
                .and_then(|m| m.status.as_ref())
                .and_then(|s| {
                    ["BootstrapConfigReady", "InfrastructureReady", "NodeReady"]
                        .iter()
                        .find_map(|t| {
                            s.conditions
                                .iter()
                                .find(|c| c.type_ == *t && c.status != "True")
                        })
                })
                .map(|c| c.message.clone())
                .unwrap_or_default();
            Row {
                host: h.name.clone(),
                power: live
                    .get(&h.name)
                    .map(|l| l.power.clone())
                    .unwrap_or_else(|| "?".into()),
                host_state: host
                    .and_then(|x| x.status.as_ref()?.state)
                    .map(|s| format!("{s:?}"))
                    .unwrap_or_else(|| "-".into()),
                machine: machine.map(|m| m.name_any()).unwrap_or_else(|| "-".into()),
                phase: machine
                    .and_then(|m| m.status.as_ref()?.phase.clone())
                    .unwrap_or_else(|| "-".into()),
                detail: image_note.unwrap_or(condition_note),
            }
        })
        .collect();
    Ok((state, rows))
}

/// One line for a big (simulated) lab: hosts by state, Machines by phase.
pub fn render_summary(rows: &[Row]) -> String {
    let mut hosts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut phases: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rows {
        *hosts.entry(r.host_state.as_str()).or_default() += 1;
        *phases.entry(r.phase.as_str()).or_default() += 1;
    }
    let list = |m: &BTreeMap<&str, usize>| {
        m.iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{} hosts: {}; Machines: {}",
        rows.len(),
        list(&hosts),
        list(&phases)
    )
}

pub fn render_table(rows: &[Row], elapsed: Option<Duration>) -> String {
    let mut out = format!(
        "{:<12} {:<6} {:<14} {:<10} {:<12} {}\n",
        "HOST", "POWER", "METALHOST", "MACHINE", "PHASE", "DETAIL"
    );
    for r in rows {
        let detail: String = r.detail.chars().take(70).collect();
        out.push_str(&format!(
            "{:<12} {:<6} {:<14} {:<10} {:<12} {}\n",
            r.host, r.power, r.host_state, r.machine, r.phase, detail
        ));
    }
    if let Some(e) = elapsed {
        out.push_str(&format!("elapsed {:.0}s\n", e.as_secs_f64()));
    }
    out
}

fn seconds_between(a: &Option<String>, b: &Option<String>) -> Option<f64> {
    let a: jiff::Timestamp = a.as_ref()?.parse().ok()?;
    let b: jiff::Timestamp = b.as_ref()?.parse().ok()?;
    Some(b.duration_since(a).as_secs_f64())
}

/// One row per host: seconds between consecutive milestones (per hop), then power-on to Running.
/// A hop a host does not take (TFTP for an iPXE ROM or HTTP Boot) shows "-", and the next hop
/// counts from the last milestone it did reach.
pub fn render_timings(timings: &BTreeMap<String, Timeline>) -> String {
    let header = [
        "HOST",
        "power→DHCP",
        "→TFTP",
        "→script",
        "→kernel",
        "→initrd",
        "→user-data",
        "→callback",
        "→Running",
        "total",
    ];
    let widths = [12, 11, 7, 8, 8, 8, 11, 10, 9, 7];
    let row = |cells: &[String]| {
        let mut line = format!("{:<w$}", cells[0], w = widths[0]);
        for (cell, w) in cells.iter().zip(widths).skip(1) {
            line.push_str(&format!(" {cell:>w$}"));
        }
        line.push('\n');
        line
    };
    let mut out = row(&header.map(String::from));
    let cell = |v: Option<f64>| v.map(|s| format!("{s:.1}s")).unwrap_or_else(|| "-".into());
    for (host, t) in timings {
        let hops = [
            &t.dhcp,
            &t.tftp,
            &t.script,
            &t.kernel,
            &t.initrd,
            &t.user_data,
            &t.callback,
            &t.running,
        ];
        let mut last = &t.power_on;
        let mut cells = vec![host.clone()];
        for hop in hops {
            let took = seconds_between(last, hop);
            if hop.is_some() {
                last = hop;
            }
            cells.push(cell(took));
        }
        cells.push(cell(seconds_between(&t.power_on, &t.running)));
        out.push_str(&row(&cells));
    }
    out
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

fn tail(path: &Path, n: usize) -> String {
    controlplane::tail(path, n)
}

/// The lab OS's live-boot files, built by `hack/os-image/build.sh` into `target/lab/os/live`.
const LIVE_FILES: [&str; 3] = ["vmlinuz", "initrd.img", "filesystem.squashfs"];

/// Sets up, starts `serve` in the background and shows the table until every Machine is Running.
pub async fn up(opts: LabOptions, timeout: Duration) -> Result<(), LabError> {
    let project = controlplane::project_dir();
    // A simulated fleet boots nothing: no OS to build.
    let simulated = opts.simulated.is_some();
    let scripts = [
        "hack/install-deps.sh",
        "hack/control-plane/build.sh",
        "hack/os-image/build.sh",
        "hack/deploy-ramdisk/build.sh",
    ];
    let needed = match (simulated, opts.image_mode) {
        (true, _) => 2,
        (false, false) => 3,
        (false, true) => 4,
    };
    for script in &scripts[..needed] {
        let status = std::process::Command::new(project.join(script))
            .status()
            .map_err(io(format!("running {script}")))?;
        if !status.success() {
            return Err(LabError::Setup(format!("{script} failed")));
        }
    }
    // The boot service serves `<dir>/image`: the lab OS's live files go there (linked, not copied,
    // when the lab directory is on the same filesystem as the build cache).
    let live = opts.dir.join("image/live");
    std::fs::create_dir_all(&live).map_err(io(format!("creating {}", live.display())))?;
    let os = std::env::var_os("OS_IMAGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| project.join("target/lab/os"));
    // Image mode also serves the deploy ramdisk and the qcow2 image.
    let deploy = project.join("target/lab/deploy");
    let image_files = [
        (deploy.join("vmlinuz"), "deploy-vmlinuz"),
        (deploy.join("initrd.gz"), "deploy-initrd.gz"),
        (os.join("debian.qcow2"), "debian.qcow2"),
        (os.join("SHA256SUMS"), "SHA256SUMS"),
    ];
    let links = LIVE_FILES
        .iter()
        .map(|f| (os.join("live").join(f), live.join(f)))
        .chain(
            image_files
                .iter()
                .filter(|_| opts.image_mode)
                .map(|(from, to)| (from.clone(), opts.dir.join("image").join(to))),
        )
        .filter(|_| !simulated);
    for (from, to) in links {
        let _ = std::fs::remove_file(&to);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(io(format!("copying {}", from.display())))?;
        }
    }
    std::fs::create_dir_all(&opts.dir).map_err(io(format!("creating {}", opts.dir.display())))?;
    let pid_file = opts.dir.join("lab.pid");
    if let Some(pid) = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        && pid_alive(pid)
    {
        return Err(LabError::Setup(format!(
            "a lab is already running (pid {pid}); `metalboot lab down` first"
        )));
    }
    let _ = std::fs::remove_file(opts.dir.join("state.json"));
    let _ = std::fs::remove_file(opts.dir.join("timings.json"));
    let log = std::fs::File::create(opts.dir.join("lab.log")).map_err(io("creating lab.log"))?;
    let exe = std::env::current_exe().map_err(io("locating the metalboot binary"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args([
        "lab",
        "serve",
        "--hosts",
        &opts.hosts.to_string(),
        "--memory-mib",
        &opts.memory_mib.to_string(),
    ])
    .args([
        "--boot-timeout-seconds",
        &opts.boot_timeout_seconds.to_string(),
    ])
    .args(opts.standalone.then_some("--standalone"))
    .args(opts.kubeadm.then_some("--kubeadm"))
    .args(["--ipmi-hosts", &opts.ipmi_hosts.to_string()])
    .args(["--os", if opts.image_mode { "image" } else { "live" }])
    .args([
        "--network",
        match opts.network {
            NetworkMode::Bridged => "bridged",
            NetworkMode::User => "user",
        },
    ])
    .args(opts.simulated.iter().flat_map(|sim| {
        [
            "--simulated-hosts".to_string(),
            sim.hosts.to_string(),
            "--fleet-boot-delay-ms".into(),
            sim.boot_delay.as_millis().to_string(),
            "--fleet-os-delay-ms".into(),
            sim.os_delay.as_millis().to_string(),
            "--fleet-no-callback".into(),
            sim.faults.no_callback.to_string(),
            "--fleet-bmc-errors".into(),
            sim.faults.bmc_errors.to_string(),
            "--fleet-slow-bmc".into(),
            sim.faults.slow_bmc.to_string(),
        ]
    }))
    .arg("--dir")
    .arg(&opts.dir)
    .stdin(std::process::Stdio::null())
    .stdout(log.try_clone().map_err(io("lab.log"))?)
    .stderr(log);
    // SAFETY: setsid is async-signal-safe; the daemon leaves our session and terminal.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::setsid();
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(io("starting the lab daemon"))?;
    std::fs::write(&pid_file, child.id().to_string()).map_err(io("writing lab.pid"))?;
    println!(
        "lab: daemon pid {} (log {})",
        child.id(),
        opts.dir.join("lab.log").display()
    );

    let started = Instant::now();
    let tty = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let mut last = String::new();
    loop {
        if !pid_alive(child.id()) {
            return Err(LabError::Setup(format!(
                "the lab daemon exited; last lines of its log:\n{}",
                tail(&opts.dir.join("lab.log"), 25)
            )));
        }
        if let Ok((state, rows)) = rows(&opts.dir).await {
            let table = if rows.len() > 20 {
                render_summary(&rows)
            } else {
                render_table(&rows, None)
            };
            if table != last || tty {
                if tty {
                    print!("\x1b[2J\x1b[H");
                }
                if rows.len() > 20 {
                    println!("{:.0}s: {table}", started.elapsed().as_secs_f64());
                } else {
                    print!("{}", render_table(&rows, Some(started.elapsed())));
                }
                last = table;
            }
            let total = opts.simulated.as_ref().map_or(opts.hosts, |s| s.hosts) as usize;
            let settled =
                |r: &Row| r.phase == "Running" || (opts.simulated.is_some() && r.phase == "Failed");
            if rows.len() == total && rows.iter().all(settled) {
                // The daemon records Running on its next one-second tick; give it a few.
                let mut timings: BTreeMap<String, Timeline> = BTreeMap::new();
                for _ in 0..5 {
                    timings = read_json(&opts.dir.join("timings.json")).unwrap_or_default();
                    if timings.len() >= rows.len() && timings.values().all(|t| t.running.is_some())
                    {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                println!(
                    "\nall {} Machines Running after {:.0}s (hosts under {})\n",
                    rows.len(),
                    started.elapsed().as_secs_f64(),
                    state.accel.to_uppercase()
                );
                print!("{}", render_timings(&timings));
                println!(
                    "\nThe lab keeps running: KUBECONFIG={} kubectl get metalhosts,metalmachines,machines -n {NAMESPACE}",
                    state.kubeconfig.display()
                );
                println!(
                    "`metalboot lab status` shows this table again; `metalboot lab down` stops the lab."
                );
                return Ok(());
            }
            if started.elapsed() > timeout {
                for h in &state.hosts {
                    println!(
                        "--- {} serial console (last lines):\n{}",
                        h.name,
                        tail(&h.serial_log, 15)
                    );
                }
                return Err(LabError::Setup(format!(
                    "not every Machine reached Running within {}s (the lab keeps running for inspection)",
                    timeout.as_secs()
                )));
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

pub async fn status(dir: &Path) -> Result<(), LabError> {
    let (state, rows) = rows(dir).await?;
    let timings: BTreeMap<String, Timeline> =
        read_json(&dir.join("timings.json")).unwrap_or_default();
    let text = format!(
        "{}\n{}\nhosts run under {}; KUBECONFIG={}\n",
        render_table(&rows, None),
        render_timings(&timings),
        state.accel.to_uppercase(),
        state.kubeconfig.display()
    );
    // `lab status | head` closes the pipe early: that is the reader's choice, not an error.
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(io("writing the status")(e)),
        _ => Ok(()),
    }
}

/// Stops the daemon `up` started (and so everything it runs).
pub fn down(dir: &Path) -> Result<(), LabError> {
    let pid_file = dir.join("lab.pid");
    let Some(pid) = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
    else {
        println!("no lab running in {}", dir.display());
        return Ok(());
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !pid_alive(pid) || !String::from_utf8_lossy(&cmdline).contains("serve") {
        println!("lab daemon (pid {pid}) is not running");
        let _ = std::fs::remove_file(&pid_file);
        return Ok(());
    }
    // SAFETY: kill(2) on the pid we recorded and just verified.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(30);
    while pid_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    if pid_alive(pid) {
        // SAFETY: as above.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    let _ = std::fs::remove_file(&pid_file);
    println!("lab stopped (daemon pid {pid})");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lab_macs_are_distinct_and_local() {
        assert_eq!(mac_of(0), "52:54:00:6d:00:00");
        assert_eq!(mac_of(1), "52:54:00:6d:00:01");
        assert_eq!(mac_of(300), "52:54:00:6d:01:2c");
    }

    #[test]
    fn timings_are_differences_between_milestones() {
        let t = Timeline {
            power_on: Some("2026-11-22T10:00:00Z".into()),
            dhcp: Some("2026-11-22T10:00:04Z".into()),
            tftp: None,
            script: Some("2026-11-22T10:00:12.5Z".into()),
            kernel: None,
            initrd: None,
            user_data: Some("2026-11-22T10:00:20Z".into()),
            callback: Some("2026-11-22T10:00:21Z".into()),
            running: None,
        };
        let table = render_timings(&BTreeMap::from([("lab-host-0".to_string(), t)]));
        let row: Vec<&str> = table
            .lines()
            .nth(1)
            .map(|l| l.split_whitespace().collect())
            .unwrap_or_default();
        // No TFTP hop: the script counts from the DHCP answer.
        assert_eq!(
            row,
            [
                "lab-host-0",
                "4.0s",
                "-",
                "8.5s",
                "-",
                "-",
                "7.5s",
                "1.0s",
                "-",
                "-"
            ],
            "{table}"
        );
        assert!(
            table
                .lines()
                .nth(1)
                .is_some_and(|l| l.trim_end().ends_with('-')),
            "{table}"
        );
    }
}

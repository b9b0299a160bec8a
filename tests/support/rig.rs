//! The end-to-end rig: one real QEMU host behind the lab's virtual BMC, driven by the real
//! manager (controllers and boot service) against the real apiserver, with a Cluster, a Machine
//! whose bootstrap data Secret the test chooses, and its MetalMachine (image or live mode).
//! Used by `image_e2e` and `kubeadm_e2e`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use metalboot::api::capi::{Cluster, ClusterSpec, Machine, MachineBootstrap, MachineSpec};
use metalboot::api::cloudinitconfig::CloudInitConfigSpec;
use metalboot::api::common::ContractVersionedObjectReference;
use metalboot::api::metalhost::{BmcDetails, MetalHostSpec};
use metalboot::api::metalmachine::{
    BootProfile, ChecksumType, ImageFormat, ImageSpec, MetalMachineSpec, ProvisioningMode,
};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::controllers::cloudinitconfig::render;
use metalboot::lab::qemu::{Accel, Firmware, HostNetwork, QemuHost, QemuHostSpec};
use metalboot::lab::vbmc::{VirtualBmc, serve_on_loopback};
use metalboot::manager::ManagerOptions;

use crate::support;
use crate::support::boot::install_crds;

pub const USER: &str = "admin";
pub const PASSWORD: &str = "image-e2e-bmc";

/// A tenant's bootstrap data: metalboot's CloudInitConfig rendering of commands, or user-data as
/// another bootstrap provider (CABPK) would have written it.
pub enum Bootstrap {
    Commands(Vec<String>),
    UserData(String),
}

impl From<Vec<String>> for Bootstrap {
    fn from(commands: Vec<String>) -> Self {
        Bootstrap::Commands(commands)
    }
}

pub fn console(host: &QemuHost) -> String {
    String::from_utf8_lossy(&std::fs::read(host.serial_log()).unwrap_or_default()).into_owned()
}

pub fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The deploy ramdisk, the image and the live system, as `make test` builds them, in a fresh
/// artifacts directory.
pub fn artifacts(dir: &Path) -> String {
    let project = Path::new(env!("CARGO_MANIFEST_DIR"));
    let os = project.join("target/lab/os");
    let ramdisk = project.join("target/lab/deploy");
    for (from, to) in [
        (ramdisk.join("vmlinuz"), "deploy-vmlinuz"),
        (ramdisk.join("initrd.gz"), "deploy-initrd.gz"),
        (os.join("debian.raw.gz"), "debian.raw.gz"),
        (os.join("debian.qcow2"), "debian.qcow2"),
        (os.join("live/vmlinuz"), "live-vmlinuz"),
        (os.join("live/initrd.img"), "live-initrd.img"),
        (
            os.join("live/filesystem.squashfs"),
            "live-filesystem.squashfs",
        ),
    ] {
        assert!(
            from.exists(),
            "{} is missing: `make test` builds it",
            from.display()
        );
        let to = dir.join(to);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).expect("copy artifact");
        }
    }
    image_checksum("debian.raw.gz")
}

/// The sha256 of one of the lab's OS images, from the build's SHA256SUMS.
pub fn image_checksum(name: &str) -> String {
    let os = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/lab/os");
    std::fs::read_to_string(os.join("SHA256SUMS"))
        .expect("SHA256SUMS")
        .lines()
        .find(|l| l.ends_with(&format!(" {name}")))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("{name} in SHA256SUMS"))
        .to_string()
}

/// One host, its BMC, a Cluster, a Machine whose bootstrap data runs `commands`, the manager, and
/// the image-mode MetalMachine with `boot_timeout` seconds and no retries.
pub struct Env {
    pub ns: support::TestNamespace,
    pub host: Arc<QemuHost>,
    pub bmc_address: String,
    pub machines: Api<MetalMachine>,
    pub secrets: Api<Secret>,
    /// The host's disk file (none is attached in live mode).
    pub disk: std::path::PathBuf,
    /// The boot service's port on loopback.
    pub boot_port: u16,
    pub _manager: metalboot::manager::RunningManager,
    pub _work: tempfile::TempDir,
}

/// How the first tenant gets its OS.
pub enum First<'a> {
    /// Image mode; `checksum_override`: the image checksum, when not the image's own.
    Image { checksum_override: Option<&'a str> },
    /// Live mode, on a host with no disk.
    Live,
}

/// A tenant's OS: image mode with the gzip image's checksum, image mode with the qcow2 image, or
/// live mode booting the live system from the boot service at `base_url` (as the guest reaches
/// it).
pub enum TenantOs<'a> {
    Image(&'a str),
    Qcow2,
    Live { base_url: String },
}

/// One rack slot: a QEMU host (a disk in image mode, none in live mode) behind the lab's virtual
/// BMC, its credentials and MetalHost (labelled `host_labels`), and the manager running
/// `controllers` with the boot service on a loopback port the host's iPXE is told.
pub struct Rack {
    pub host: Arc<QemuHost>,
    pub bmc_address: String,
    /// The host's disk file (none is attached in live mode).
    pub disk: std::path::PathBuf,
    /// The boot service's port on loopback.
    pub boot_port: u16,
    /// The deploy ramdisk, the images and the live system, as served.
    pub served: std::path::PathBuf,
    /// The gzip image's checksum.
    pub checksum: String,
    pub manager: metalboot::manager::RunningManager,
    pub work: tempfile::TempDir,
}

pub async fn rack(
    client: &kube::Client,
    namespace: &str,
    mac: &str,
    live: bool,
    controllers: metalboot::manager::Controllers,
    host_labels: &[(&str, &str)],
) -> Rack {
    metalboot::telemetry::init(
        metalboot::telemetry::LogFormat::Text,
        Some("info,metalboot=debug,kube_runtime=warn"),
    );
    let work = tempfile::tempdir().expect("tmp");
    let served = work.path().join("artifacts");
    std::fs::create_dir_all(&served).expect("artifacts dir");
    let checksum = artifacts(&served);

    // The boot service's port, chosen now: the guest's iPXE is told it before the manager runs.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let disk = work.path().join("host-0.raw");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(4 << 30))
        .expect("disk");
    let host = Arc::new(QemuHost::new(QemuHostSpec {
        name: "host-0".into(),
        uuid: "6d62a1b0-0000-4000-8000-0000000000e2".into(),
        mac: mac.into(),
        // A live system holds its root squashfs (215 MB) in memory, and may run a kubelet.
        memory_mib: if live { 2048 } else { 1024 },
        network: HostNetwork::User {
            bootfile_url: format!("http://10.0.2.2:{port}/boot.ipxe"),
        },
        firmware: Firmware::Bios,
        dir: work.path().join("host-0"),
        accel: Accel::Tcg,
        graceful_seconds: 5,
        disk: (!live).then(|| disk.clone()),
    }));
    let bmc = Arc::new(VirtualBmc::new(
        vec![host.clone()],
        USER.into(),
        PASSWORD.into(),
    ));
    let bmc_port = serve_on_loopback(bmc).await.expect("virtual BMC");
    let bmc_address = format!("redfish+http://127.0.0.1:{bmc_port}/redfish/v1/Systems/host-0");

    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some("bmc-credentials".into()),
                    ..Default::default()
                },
                string_data: Some(BTreeMap::from([
                    ("username".to_string(), USER.to_string()),
                    ("password".to_string(), PASSWORD.to_string()),
                ])),
                ..Default::default()
            },
        )
        .await
        .expect("credentials");
    let mut metal_host = MetalHost::new(
        "host-0",
        MetalHostSpec {
            bmc: BmcDetails {
                address: bmc_address.clone(),
                credentials_name: "bmc-credentials".into(),
                disable_certificate_verification: None,
                ca_secret_name: None,
            },
            boot_mac_address: mac.into(),
            boot_ip_address: None,
            boot_mode: None,
            online: true,
            description: None,
            consumer_ref: None,
            automated_cleaning_mode: None,
        },
    );
    metal_host.metadata.labels = Some(
        host_labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    Api::<MetalHost>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &metal_host)
        .await
        .expect("MetalHost");

    let manager = metalboot::manager::start(
        client.clone(),
        ManagerOptions {
            namespace: Some(namespace.to_string()),
            controllers,
            boot_http: format!("127.0.0.1:{port}").parse().expect("addr"),
            advertise_url: Some(format!("http://10.0.2.2:{port}")),
            artifacts_dir: Some(served.clone()),
            deploy: Some(BootProfile {
                kernel: "deploy-vmlinuz".into(),
                initrds: vec!["deploy-initrd.gz".into()],
                cmdline: Some("console=ttyS0".into()),
            }),
            power_poll_interval: Duration::from_secs(10),
            graceful_off: Duration::from_secs(5),
            deprovision_timeout: Duration::from_secs(60),
            bmc_timeout: Duration::from_secs(10),
            janitor_interval: Duration::from_secs(5),
            ..Default::default()
        },
    )
    .await
    .expect("manager starts");
    Rack {
        host,
        bmc_address,
        disk,
        boot_port: port,
        served,
        checksum,
        manager,
        work,
    }
}

/// The live system's boot profile, its root squashfs fetched from the boot service at
/// `base_url` (as the guest reaches it).
pub fn live_boot(base_url: &str) -> BootProfile {
    BootProfile {
        kernel: "live-vmlinuz".into(),
        initrds: vec!["live-initrd.img".into()],
        cmdline: Some(format!(
            "boot=live fetch={base_url}/artifacts/live-filesystem.squashfs console=ttyS0,115200n8 net.ifnames=0"
        )),
    }
}

pub async fn setup(
    prefix: &str,
    mac: &str,
    bootstrap: impl Into<Bootstrap>,
    boot_timeout: i32,
    first: First<'_>,
) -> Env {
    let ns = support::namespace(prefix).await;
    install_crds(&ns.client).await;
    let client = &ns.client;
    let live = matches!(first, First::Live);
    let rack = rack(
        client,
        &ns.name,
        mac,
        live,
        metalboot::manager::Controllers::ALL,
        &[],
    )
    .await;

    let clusters: Api<Cluster> = Api::namespaced(client.clone(), &ns.name);
    clusters
        .create(
            &PostParams::default(),
            &Cluster::new("c1", ClusterSpec::default()),
        )
        .await
        .expect("Cluster");
    clusters
        .patch_status(
            "c1",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"initialization": {"infrastructureProvisioned": true}}})),
        )
        .await
        .expect("Cluster status");

    let port = rack.boot_port;
    let os = match first {
        First::Image { checksum_override } => {
            TenantOs::Image(checksum_override.unwrap_or(&rack.checksum))
        }
        First::Live => TenantOs::Live {
            base_url: format!("http://10.0.2.2:{port}"),
        },
    };
    add_tenant(client, &ns.name, "node", bootstrap.into(), os, boot_timeout).await;
    let machines: Api<MetalMachine> = Api::namespaced(client.clone(), &ns.name);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
    Env {
        ns,
        host: rack.host,
        bmc_address: rack.bmc_address,
        machines,
        secrets,
        disk: rack.disk,
        boot_port: port,
        _manager: rack.manager,
        _work: rack.work,
    }
}

/// A tenant: the bootstrap data Secret running `commands`, its Machine, and the MetalMachine
/// `name` with `boot_timeout` seconds and no retries.
pub async fn add_tenant(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    data: Bootstrap,
    os: TenantOs<'_>,
    boot_timeout: i32,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let bootstrap = format!("{name}-bootstrap");
    let user_data = match data {
        Bootstrap::Commands(commands) => render(
            &CloudInitConfigSpec {
                commands,
                ..Default::default()
            },
            &Default::default(),
        )
        .expect("render"),
        Bootstrap::UserData(user_data) => user_data,
    };
    secrets
        .create(
            &PostParams::default(),
            &Secret {
                metadata: ObjectMeta {
                    name: Some(bootstrap.clone()),
                    ..Default::default()
                },
                data: Some(BTreeMap::from([(
                    "value".to_string(),
                    ByteString(user_data.into_bytes()),
                )])),
                type_: Some("cluster.x-k8s.io/secret".into()),
                ..Default::default()
            },
        )
        .await
        .expect("bootstrap Secret");
    let machine = Api::<Machine>::namespaced(client.clone(), namespace)
        .create(
            &PostParams::default(),
            &Machine::new(
                name,
                MachineSpec {
                    cluster_name: "c1".into(),
                    bootstrap: MachineBootstrap {
                        data_secret_name: Some(bootstrap.clone()),
                        ..Default::default()
                    },
                    infrastructure_ref: ContractVersionedObjectReference {
                        api_group: "infrastructure.cluster.x-k8s.io".into(),
                        kind: "MetalMachine".into(),
                        name: name.into(),
                    },
                    ..Default::default()
                },
            ),
        )
        .await
        .expect("Machine");

    let spec = match os {
        TenantOs::Image(checksum) => MetalMachineSpec {
            mode: ProvisioningMode::Image,
            image: Some(Box::new(ImageSpec {
                url: "debian.raw.gz".into(),
                checksum: checksum.to_string(),
                checksum_type: ChecksumType::Sha256,
                format: ImageFormat::Gzip,
            })),
            ..Default::default()
        },
        TenantOs::Qcow2 => MetalMachineSpec {
            mode: ProvisioningMode::Image,
            image: Some(Box::new(ImageSpec {
                url: "debian.qcow2".into(),
                checksum: image_checksum("debian.qcow2"),
                checksum_type: ChecksumType::Sha256,
                format: ImageFormat::Qcow2,
            })),
            ..Default::default()
        },
        // Debian's live-boot fetches the root squashfs itself: its URL is on the command line.
        TenantOs::Live { base_url } => MetalMachineSpec {
            mode: ProvisioningMode::Live,
            boot: Some(live_boot(&base_url)),
            ..Default::default()
        },
    };
    let mut mm = MetalMachine::new(
        name,
        MetalMachineSpec {
            boot_timeout_seconds: Some(boot_timeout),
            boot_retries: Some(0),
            ..spec
        },
    );
    mm.metadata.labels = Some(BTreeMap::from([(
        "cluster.x-k8s.io/cluster-name".to_string(),
        "c1".to_string(),
    )]));
    mm.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "cluster.x-k8s.io/v1beta2".into(),
        kind: "Machine".into(),
        name: name.into(),
        uid: machine.uid().expect("uid"),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }]);
    let machines: Api<MetalMachine> = Api::namespaced(client.clone(), namespace);
    machines
        .create(&PostParams::default(), &mm)
        .await
        .expect("MetalMachine");
}

/// Waits for the first tenant's machine to fail; returns it and the console so far.
pub async fn until_failed(env: &Env) -> (MetalMachine, String) {
    let failed = support::eventually_or("the machine failed", 1500, || async {
        env.machines.get("node").await.ok().filter(|m| {
            m.status
                .as_ref()
                .is_some_and(|s| s.failure_reason.is_some())
        })
    })
    .await;
    let text = console(&env.host);
    let Some(failed) = failed else {
        panic!("the machine did not fail:\n{}", tail(&text, 8000));
    };
    (failed, text)
}

//! Image mode end to end on one real QEMU host behind the lab's virtual BMC, driven by the real
//! manager (controllers and boot service) against the real apiserver: the MetalMachine claims
//! the host, the controller powers it on for a network boot over Redfish, real iPXE loads the
//! deploy ramdisk, `metalboot agent` inspects the host (→ `MetalHost.status.hardware`) and writes
//! the real Debian image to the virtio disk; the controller restarts the host into its disk over
//! the BMC; the installed OS's real cloud-init runs the user-data and calls back; the machine is
//! provisioned. Then a power cycle through the BMC boots the installed OS again: no new token,
//! the machine stays provisioned, the user-data does not run twice. Then the machine is deleted:
//! the deploy agent wipes the disk before the host is Available again, and a second tenant's
//! OS on the same host, written from the qcow2 form of the image, does not find the marker the
//! first one left.
//!
//! Live mode on the same rig, with a diskless host: the real Debian system netboots through
//! live-boot (kernel, initrd, squashfs over HTTP) and its real cloud-init calls back; a reset
//! through the BMC network-boots it again with a fresh per-boot token, and it comes back as the
//! same node (hostname, providerID) while the machine stays provisioned.

mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use metalboot::api::capi::{Cluster, ClusterSpec, Machine, MachineBootstrap, MachineSpec};
use metalboot::api::cloudinitconfig::CloudInitConfigSpec;
use metalboot::api::common::ContractVersionedObjectReference;
use metalboot::api::metalhost::{BmcDetails, HostState, MetalHostSpec};
use metalboot::api::metalmachine::{
    BootProfile, ChecksumType, ImageFormat, ImageSpec, MetalMachineSpec, ProvisioningMode,
};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, Credentials, PowerAction};
use metalboot::controllers::cloudinitconfig::render;
use metalboot::lab::qemu::{Accel, Firmware, HostNetwork, QemuHost, QemuHostSpec};
use metalboot::lab::vbmc::{VirtualBmc, serve_on_loopback};
use metalboot::manager::ManagerOptions;
use support::boot::install_crds;

const MAC: &str = "52:54:00:6d:62:10";
const USER: &str = "admin";
const PASSWORD: &str = "image-e2e-bmc";
const RAN: &str = "metalboot-e2e: user-data ran";
/// What the first tenant's OS leaves on its disk, and what the second must not find.
const MARKER: &str = "/var/lib/metalboot-e2e-tenant-1";
const SECOND_RAN: &str = "metalboot-e2e: second tenant ran, no marker";

fn console(host: &QemuHost) -> String {
    String::from_utf8_lossy(&std::fs::read(host.serial_log()).unwrap_or_default()).into_owned()
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The deploy ramdisk, the image and the live system, as `make test` builds them, in a fresh
/// artifacts directory.
fn artifacts(dir: &Path) -> String {
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
fn image_checksum(name: &str) -> String {
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
struct Env {
    ns: support::TestNamespace,
    host: Arc<QemuHost>,
    bmc_address: String,
    machines: Api<MetalMachine>,
    secrets: Api<Secret>,
    /// The host's disk file (none is attached in live mode).
    disk: std::path::PathBuf,
    /// The boot service's port on loopback.
    boot_port: u16,
    _manager: metalboot::manager::RunningManager,
    _work: tempfile::TempDir,
}

/// How the first tenant gets its OS.
enum First<'a> {
    /// Image mode; `checksum_override`: the image checksum, when not the image's own.
    Image { checksum_override: Option<&'a str> },
    /// Live mode, on a host with no disk.
    Live,
}

/// A tenant's OS: image mode with the gzip image's checksum, image mode with the qcow2 image, or
/// live mode booting the live system from the boot service at `base_url` (as the guest reaches
/// it).
enum TenantOs<'a> {
    Image(&'a str),
    Qcow2,
    Live { base_url: String },
}

async fn setup(
    prefix: &str,
    mac: &str,
    commands: Vec<String>,
    boot_timeout: i32,
    first: First<'_>,
) -> Env {
    metalboot::telemetry::init(
        metalboot::telemetry::LogFormat::Text,
        Some("info,metalboot=debug,kube_runtime=warn"),
    );
    let ns = support::namespace(prefix).await;
    install_crds(&ns.client).await;
    let client = &ns.client;
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
        memory_mib: 1024,
        network: HostNetwork::User {
            bootfile_url: format!("http://10.0.2.2:{port}/boot.ipxe"),
        },
        firmware: Firmware::Bios,
        dir: work.path().join("host-0"),
        accel: Accel::Tcg,
        graceful_seconds: 5,
        disk: matches!(first, First::Image { .. }).then(|| disk.clone()),
    }));
    let bmc = Arc::new(VirtualBmc::new(
        vec![host.clone()],
        USER.into(),
        PASSWORD.into(),
    ));
    let bmc_port = serve_on_loopback(bmc).await.expect("virtual BMC");
    let bmc_address = format!("redfish+http://127.0.0.1:{bmc_port}/redfish/v1/Systems/host-0");

    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns.name);
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
    Api::<MetalHost>::namespaced(client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &MetalHost::new(
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
            ),
        )
        .await
        .expect("MetalHost");

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
    let manager = metalboot::manager::start(
        client.clone(),
        ManagerOptions {
            namespace: Some(ns.name.clone()),
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

    let os = match first {
        First::Image { checksum_override } => {
            TenantOs::Image(checksum_override.unwrap_or(&checksum))
        }
        First::Live => TenantOs::Live {
            base_url: format!("http://10.0.2.2:{port}"),
        },
    };
    add_tenant(client, &ns.name, "node", commands, os, boot_timeout).await;
    let machines: Api<MetalMachine> = Api::namespaced(client.clone(), &ns.name);
    Env {
        ns,
        host,
        bmc_address,
        machines,
        secrets,
        disk,
        boot_port: port,
        _manager: manager,
        _work: work,
    }
}

/// A tenant: the bootstrap data Secret running `commands`, its Machine, and the MetalMachine
/// `name` with `boot_timeout` seconds and no retries.
async fn add_tenant(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    commands: Vec<String>,
    os: TenantOs<'_>,
    boot_timeout: i32,
) {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let bootstrap = format!("{name}-bootstrap");
    let user_data = render(
        &CloudInitConfigSpec {
            commands,
            ..Default::default()
        },
        &Default::default(),
    )
    .expect("render");
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
            image: Some(ImageSpec {
                url: "debian.raw.gz".into(),
                checksum: checksum.to_string(),
                checksum_type: ChecksumType::Sha256,
                format: ImageFormat::Gzip,
            }),
            ..Default::default()
        },
        TenantOs::Qcow2 => MetalMachineSpec {
            mode: ProvisioningMode::Image,
            image: Some(ImageSpec {
                url: "debian.qcow2".into(),
                checksum: image_checksum("debian.qcow2"),
                checksum_type: ChecksumType::Sha256,
                format: ImageFormat::Qcow2,
            }),
            ..Default::default()
        },
        // Debian's live-boot fetches the root squashfs itself: its URL is on the command line.
        TenantOs::Live { base_url } => MetalMachineSpec {
            mode: ProvisioningMode::Live,
            boot: Some(BootProfile {
                kernel: "live-vmlinuz".into(),
                initrds: vec!["live-initrd.img".into()],
                cmdline: Some(format!(
                    "boot=live fetch={base_url}/artifacts/live-filesystem.squashfs console=ttyS0,115200n8 net.ifnames=0"
                )),
            }),
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

#[tokio::test]
async fn an_image_mode_machine_is_installed_boots_its_disk_and_survives_a_power_cycle() {
    let env = setup(
        "image-e2e",
        MAC,
        vec![
            format!("echo tenant-1 > {MARKER}"),
            format!("test -e {MARKER}"),
            format!("echo '{RAN}' > /dev/console"),
        ],
        900,
        First::Image {
            checksum_override: None,
        },
    )
    .await;
    let Env {
        ns,
        host,
        bmc_address,
        machines,
        secrets,
        ..
    } = &env;
    let client = &ns.client;
    let provisioned = support::eventually_or("the MetalMachine provisioned", 1500, || async {
        machines
            .get("node")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let Some(provisioned) = provisioned else {
        let mm = machines.get("node").await.ok();
        panic!(
            "not provisioned: {:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            tail(&console(host), 8000)
        );
    };
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), &ns.name);
    // The MetalHost controller shows the claim's outcome on its own pass, after the machine's.
    let provisioned_host = support::eventually_or("the MetalHost Provisioned", 60, || async {
        let h = hosts.get("host-0").await.ok()?;
        (h.status.as_ref()?.state == Some(HostState::Provisioned)).then_some(h)
    })
    .await;
    let status = match provisioned_host {
        Some(h) => h.status.unwrap_or_default(),
        None => {
            let h = hosts.get("host-0").await.expect("host");
            panic!("the MetalHost is not Provisioned: {:?}", h.status);
        }
    };
    let hardware = status.hardware.expect("hardware");
    let vda = hardware
        .disks
        .iter()
        .find(|d| d.name == "vda")
        .unwrap_or_else(|| panic!("the agent's disks are not on the host: {hardware:?}"));
    assert_eq!(vda.size_bytes, 4 << 30);
    assert_eq!(vda.serial_number.as_deref(), Some("host-0"));
    assert_eq!(hardware.firmware_mode.as_deref(), Some("BIOS"));
    let first = console(host);
    assert_eq!(first.matches(RAN).count(), 1, "{}", tail(&first, 8000));
    assert!(
        first.contains("metalboot agent") || first.contains("metalboot::agent"),
        "the deploy agent ran on this host:\n{}",
        tail(&first, 8000)
    );

    // A power cycle through the BMC: the installed OS boots again, nothing is provisioned again.
    let boots_before = console(host).matches("finished at").count();
    let driver = RedfishBmc::new(
        bmc_address,
        Credentials::new(USER, PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver");
    driver.power(PowerAction::Cycle).await.expect("power cycle");
    let again = support::eventually_or("the installed OS booted again", 900, || async {
        (console(host).matches("finished at").count() > boots_before).then_some(())
    })
    .await;
    let text = console(host);
    assert!(
        again.is_some(),
        "no second boot of the installed OS:\n{}",
        tail(&text, 8000)
    );
    assert_eq!(
        text.matches(RAN).count(),
        1,
        "the user-data ran twice:\n{}",
        tail(&text, 8000)
    );
    let last = text
        .lines()
        .rfind(|l| l.contains("finished at"))
        .unwrap_or_default();
    assert!(last.contains("DataSourceNoCloud"), "{last}");
    let after = machines.get("node").await.expect("MetalMachine");
    assert_eq!(after.spec.provider_id, provisioned.spec.provider_id);
    assert!(
        secrets
            .get_opt(&metalboot::boot::tokens::boot_secret_name("node"))
            .await
            .expect("get")
            .is_none(),
        "a boot Secret (a new token) exists after the power cycle"
    );

    // Release: the deploy agent wipes the disk before the host is Available again.
    let starts = partition_starts(&env.disk);
    assert!(
        starts.len() >= 2,
        "the installed disk has its partitions: {starts:?}"
    );
    let text = delete_and_release(&env).await;
    assert!(
        text.contains("cleaning ended"),
        "the deploy agent cleaned this host:\n{}",
        tail(&text, 8000)
    );
    let size = std::fs::metadata(&env.disk).expect("disk").len();
    let mut wiped = vec![0, size - (1 << 20)];
    wiped.extend(&starts);
    for offset in wiped {
        assert!(
            zeroed(&env.disk, offset, 1 << 20),
            "the MiB at {offset} of the released disk still has data"
        );
    }
    assert!(
        partition_starts(&env.disk).is_empty(),
        "a partition table survived the cleaning"
    );

    // A second tenant on the same host, from the qcow2 image: its OS must not find the first
    // one's marker (its commands stop at the test, and nothing calls back, if it does).
    add_tenant(
        client,
        &ns.name,
        "node2",
        vec![
            format!("test ! -e {MARKER}"),
            format!("echo '{SECOND_RAN}' > /dev/console"),
        ],
        TenantOs::Qcow2,
        900,
    )
    .await;
    let second = support::eventually_or("the second tenant provisioned", 1500, || async {
        machines
            .get("node2")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let text = console(host);
    assert!(
        second.is_some(),
        "the second tenant was not provisioned:\n{}",
        tail(&text, 8000)
    );
    assert_eq!(text.matches(SECOND_RAN).count(), 1, "{}", tail(&text, 8000));
}

/// Waits for the first tenant's machine to fail; returns it and the console so far.
async fn until_failed(env: &Env) -> (MetalMachine, String) {
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

/// Deletes the first tenant's MetalMachine and waits until it is gone and its host is released
/// and Available; returns the console so far.
async fn delete_and_release(env: &Env) -> String {
    env.machines
        .delete("node", &DeleteParams::default())
        .await
        .expect("delete the MetalMachine");
    let hosts: Api<MetalHost> = Api::namespaced(env.ns.client.clone(), &env.ns.name);
    let released = support::eventually_or("the host cleaned and Available", 900, || async {
        let h = hosts.get("host-0").await.ok()?;
        let available = h.spec.consumer_ref.is_none()
            && h.status.as_ref().and_then(|s| s.state) == Some(HostState::Available);
        let gone = env.machines.get_opt("node").await.ok()?.is_none();
        (available && gone).then_some(())
    })
    .await;
    let text = console(&env.host);
    if released.is_none() {
        let mm = env.machines.get_opt("node").await.ok().flatten();
        let h = hosts.get("host-0").await.ok();
        panic!(
            "not released: {:#?}\n{:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            h.and_then(|h| h.status),
            tail(&text, 8000)
        );
    }
    text
}

/// Where the disk's GPT partitions start, in bytes (none when no table is readable).
fn partition_starts(disk: &Path) -> Vec<u64> {
    let Ok(table) = gpt::GptConfig::new().writable(false).open(disk) else {
        return Vec::new();
    };
    table
        .partitions()
        .values()
        .filter(|p| p.is_used())
        .map(|p| p.first_lba * 512)
        .collect()
}

/// Whether `len` bytes of `disk` from `offset` are all zero.
fn zeroed(disk: &Path, offset: u64, len: usize) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut buf = vec![0u8; len];
    std::fs::File::open(disk)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(offset))?;
            f.read_exact(&mut buf)
        })
        .is_ok_and(|()| buf.iter().all(|b| *b == 0))
}

/// A bootstrap command that fails under the real cloud-init on the installed OS: no sentinel, no
/// callback; the boot timeout, counted from the restart into the disk, ends the attempt, and
/// with no retries left the machine fails with `BootTimeout`, never provisioned.
#[tokio::test]
async fn a_failing_bootstrap_command_ends_in_the_boot_timeout() {
    let env = setup(
        "image-e2e-fail",
        "52:54:00:6d:62:11",
        vec![
            "echo 'metalboot-e2e: step 1' > /dev/console".into(),
            "false".into(),
            format!("echo '{RAN}' > /dev/console"),
        ],
        240,
        First::Image {
            checksum_override: None,
        },
    )
    .await;
    let (failed, text) = until_failed(&env).await;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        status.failure_reason.as_deref(),
        Some("BootTimeout"),
        "{status:?}"
    );
    assert!(failed.spec.provider_id.is_none(), "provisioned after all");
    assert!(
        text.contains("metalboot::agent") && text.contains("metalboot-e2e: step 1"),
        "the image was written and the installed OS ran the first command:\n{}",
        tail(&text, 8000)
    );
    assert!(!text.contains(RAN), "a command ran after the failed one");
    assert!(
        !text.contains("reporting to the boot service"),
        "vendor-data reported success without the sentinel"
    );
}

/// A wrong checksum through the whole manager: the real agent streams the image, finds the digest
/// differs, wipes what it wrote and reports; with no retries the machine fails with
/// `ImageChecksumMismatch`, never provisioned, and the host never boots its disk. Deleting the
/// machine cleans the host, which is Available again.
#[tokio::test]
async fn a_wrong_checksum_fails_the_machine_and_the_host_is_cleaned_on_release() {
    let env = setup(
        "image-e2e-sum",
        "52:54:00:6d:62:12",
        vec![format!("echo '{RAN}' > /dev/console")],
        900,
        First::Image {
            checksum_override: Some(&"0".repeat(64)),
        },
    )
    .await;
    let (failed, text) = until_failed(&env).await;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        status.failure_reason.as_deref(),
        Some("ImageChecksumMismatch"),
        "{status:?}"
    );
    assert!(failed.spec.provider_id.is_none(), "provisioned after all");
    assert!(!text.contains(RAN), "the installed OS ran the user-data");
    assert!(
        partition_starts(&env.disk).is_empty(),
        "the failed write was not wiped"
    );

    let text = delete_and_release(&env).await;
    assert!(
        text.contains("cleaning ended"),
        "the host was cleaned before release:\n{}",
        tail(&text, 8000)
    );
    assert!(zeroed(&env.disk, 0, 1 << 20));
}

/// What the live system's user-data prints on each boot, with the hostname and providerID the
/// node came up with.
const LIVE_RAN: &str = "metalboot-e2e-live: booted";

/// The `LIVE_RAN` lines of the console: one per boot of the live system.
fn live_boots(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.find(LIVE_RAN).map(|at| l[at..].trim().to_string()))
        .collect()
}

async fn boot_record(env: &Env) -> Option<metalboot::boot::tokens::BootRecord> {
    let secret = env
        .secrets
        .get_opt(&metalboot::boot::tokens::boot_secret_name("node"))
        .await
        .ok()??;
    metalboot::boot::tokens::parse_boot_secret(&secret).ok()
}

/// Live mode, diskless: the real Debian system netboots through live-boot and real cloud-init
/// calls back; the boot Secret stays, armed with a fresh token for the next boot. A reset through
/// the BMC network-boots the host again: the armed token serves the same identity, the OS comes
/// back as the same node (hostname and providerID, printed by the user-data on each boot) and
/// calls back; the machine never leaves Ready; the Secret is re-armed with yet another token and
/// the token of the first boot is refused. Deleting the machine powers the host off and releases
/// it without cleaning (nothing was written).
#[tokio::test]
async fn a_live_mode_host_reboots_into_its_os_as_the_same_node() {
    let env = setup(
        "live-e2e",
        "52:54:00:6d:62:13",
        vec![format!(
            "echo \"{LIVE_RAN} as $(hostname) with $(grep -o 'metalboot://[^\" ]*' /run/cloud-init/instance-data.json | head -n1)\" > /dev/console"
        )],
        900,
        First::Live,
    )
    .await;
    let Env {
        ns,
        host,
        bmc_address,
        machines,
        ..
    } = &env;
    let provisioned = support::eventually_or("the live MetalMachine provisioned", 1200, || async {
        machines
            .get("node")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let Some(provisioned) = provisioned else {
        let mm = machines.get("node").await.ok();
        panic!(
            "not provisioned: {:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            tail(&console(host), 8000)
        );
    };
    let provider_id = provisioned.spec.provider_id.clone().unwrap_or_default();
    let text = console(host);
    assert!(
        text.contains("live-boot") || text.contains("/run/live"),
        "the host booted through live-boot:\n{}",
        tail(&text, 8000)
    );
    let first_boot = live_boots(&text);
    assert_eq!(
        first_boot,
        vec![format!("{LIVE_RAN} as host-0 with {provider_id}")],
        "{}",
        tail(&text, 8000)
    );
    // The provisioning token dies; a token for the next boot takes its place.
    let armed = support::eventually("the next boot armed", 60, || async {
        boot_record(&env).await.filter(|r| r.reboot == Some(1))
    })
    .await;
    let ready_since = |mm: &MetalMachine| {
        mm.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.status == "True")
                .map(|c| c.last_transition_time.clone())
        })
    };
    let ready_at = support::eventually("the MetalMachine Ready", 60, || async {
        machines
            .get("node")
            .await
            .ok()
            .as_ref()
            .and_then(ready_since)
    })
    .await;

    // A reset through the BMC: the host network-boots its OS again, with the armed token.
    let driver = RedfishBmc::new(
        bmc_address,
        Credentials::new(USER, PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver");
    driver.power(PowerAction::Cycle).await.expect("power cycle");
    let rearmed = support::eventually_or("the reboot called back and re-armed", 900, || async {
        boot_record(&env).await.filter(|r| r.reboot == Some(2))
    })
    .await;
    let text = console(host);
    let Some(rearmed) = rearmed else {
        panic!(
            "the rebooted host did not call back: {:?}\nconsole:\n{}",
            boot_record(&env).await.map(|r| (r.reboot, r.callback)),
            tail(&text, 8000)
        );
    };
    assert_eq!(
        live_boots(&text),
        vec![
            format!("{LIVE_RAN} as host-0 with {provider_id}"),
            format!("{LIVE_RAN} as host-0 with {provider_id}"),
        ],
        "the second boot is the same node:\n{}",
        tail(&text, 8000)
    );
    assert_ne!(rearmed.token, armed.token, "each boot has its own token");
    assert_eq!(
        (rearmed.attempt, &rearmed.instance_id),
        (armed.attempt, &armed.instance_id),
        "a reboot is not a new attempt"
    );
    let after = machines.get("node").await.expect("MetalMachine");
    assert_eq!(
        after.spec.provider_id.as_deref(),
        Some(provider_id.as_str())
    );
    assert_eq!(
        ready_since(&after),
        Some(ready_at),
        "the machine left Ready during the reboot"
    );
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(ns.client.clone(), &ns.name);
    let rebooted = support::eventually("the HostRebooted Event", 30, || async {
        events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("HostRebooted"))
    })
    .await;
    assert!(
        rebooted
            .message
            .as_deref()
            .is_some_and(|m| m.contains("as host-0") && m.contains("boot 1")),
        "{rebooted:?}"
    );
    // The first boot's token is spent: nothing is served for it any more.
    let stale = reqwest::get(format!(
        "http://127.0.0.1:{}/nocloud/{}/user-data",
        env.boot_port,
        armed.token.expose()
    ))
    .await
    .expect("boot service");
    assert_eq!(stale.status(), reqwest::StatusCode::NOT_FOUND);

    // Release: powered off, Available, nothing to clean.
    let text = delete_and_release(&env).await;
    assert!(
        !text.contains("metalboot::agent"),
        "a live host was netbooted into the deploy agent"
    );
}

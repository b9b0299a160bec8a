//! The lab's installed OS (hack/os-image: Debian bookworm, systemd, Debian's kernel, the real
//! cloud-init, GRUB for BIOS and UEFI) booted from its own disk in QEMU, under SeaBIOS and under
//! OVMF, with the NoCloud seed the deploy agent writes (`write_seed`: a CIDATA partition whose
//! `seedfrom` is the attempt's token URL on the real boot service). Real cloud-init fetches the
//! bootstrap provider's `#cloud-config` from the boot service and runs it; metalboot's vendor-data
//! calls back only when every command succeeded; a reset boots the same instance again without
//! running the user-data twice.
//!
//! The guest reaches the boot service, which listens on loopback, as 10.0.2.2 over QEMU's
//! user-mode network, which the test makes itself.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use metalboot::agent::seed::{Seed, write_seed};
use metalboot::api::MetalMachine;
use metalboot::api::cloudinitconfig::CloudInitConfigSpec;
use metalboot::api::metalhost::HostState;
use metalboot::api::metalmachine::BootProfile;
use metalboot::api::metalmachine::{
    ChecksumType, ImageFormat, ImageSpec, MetalMachineSpec, ProvisioningMode,
};
use metalboot::boot::artifacts::artifacts_router;
use metalboot::boot::http::{BootConfig, CallbackNotice, router};
use metalboot::boot::ipxe::nocloud_url;
use metalboot::boot::serve::{HttpLimits, serve};
use metalboot::boot::tokens;
use metalboot::controllers::cloudinitconfig::render;
use support::boot::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc::UnboundedReceiver;

const OVMF: &str = "/usr/share/ovmf/OVMF.fd";
const MAC: &str = "52:54:00:12:34:56";
/// What the user-data prints to the console each time it runs.
const RAN: &str = "metalboot-test: user-data ran";
/// cloud-init's last line of each boot.
const FINISHED: &str = "finished at";

fn os_image() -> PathBuf {
    let image = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/lab/os/debian.raw");
    assert!(
        image.exists(),
        "{} is missing: `make test` builds it (hack/os-image/build.sh)",
        image.display()
    );
    image
}

#[derive(Clone, Copy, Debug)]
enum Firmware {
    SeaBios,
    Ovmf,
}

/// A host's disk as the deploy agent leaves it: the image on a disk 1 GiB larger, and the seed.
fn installed_disk(dir: &Path, seed: &Seed) -> PathBuf {
    let disk = dir.join("disk.raw");
    let copied = std::process::Command::new("cp")
        .arg("--sparse=always")
        .arg(os_image())
        .arg(&disk)
        .status()
        .expect("cp");
    assert!(copied.success(), "copying the OS image");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&disk)
        .expect("open disk");
    let len = f.metadata().expect("metadata").len();
    f.set_len(len + (1 << 30)).expect("grow disk");
    write_seed(&mut f, seed).expect("seed");
    disk
}

struct Guest {
    _child: tokio::process::Child,
    console: PathBuf,
    monitor: PathBuf,
}

impl Guest {
    fn boot(dir: &Path, disk: &Path, firmware: Firmware) -> Guest {
        let console = dir.join("console.log");
        let monitor = dir.join("monitor.sock");
        let mut cmd = tokio::process::Command::new("qemu-system-x86_64");
        // TCG: /dev/kvm exists on some test machines without working (guests hang).
        cmd.args(["-machine", "pc,accel=tcg", "-m", "1024", "-smp", "1"])
            .args(["-display", "none"])
            .args(["-serial", &format!("file:{}", console.display())])
            .args([
                "-monitor",
                &format!("unix:{},server=on,wait=off", monitor.display()),
            ])
            .args([
                "-drive",
                &format!("file={},format=raw,if=virtio", disk.display()),
            ])
            .args(["-netdev", "user,id=n0"])
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        if let Firmware::Ovmf = firmware {
            assert!(Path::new(OVMF).exists(), "{OVMF} is missing (package ovmf)");
            cmd.args(["-bios", OVMF]);
        }
        Guest {
            _child: cmd.spawn().expect("start qemu-system-x86_64"),
            console,
            monitor,
        }
    }

    fn console(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).into_owned()
    }

    fn count(&self, what: &str) -> usize {
        self.console().matches(what).count()
    }

    /// Waits until the console shows `what` `n` times.
    async fn until_console(&self, what: &str, n: usize, secs: u64) {
        if support::eventually_or(&format!("{n}× {what:?} on the console"), secs, || async {
            (self.count(what) >= n).then_some(())
        })
        .await
        .is_none()
        {
            panic!("console:\n{}", tail(&self.console(), 6000));
        }
    }

    /// A hard reset, as a BMC's ForceRestart does. The monitor reads its input as it echoes it:
    /// the connection stays open until the prompt after the command shows it was taken.
    async fn reset(&self) {
        let mut sock = tokio::net::UnixStream::connect(&self.monitor)
            .await
            .expect("monitor");
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        let prompts = |seen: &[u8]| String::from_utf8_lossy(seen).matches("(qemu) ").count();
        let mut sent = false;
        let done = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let n = sock.read(&mut buf).await.expect("monitor");
                assert!(n > 0, "monitor closed");
                seen.extend_from_slice(&buf[..n]);
                if !sent && prompts(&seen) >= 1 {
                    sock.write_all(b"system_reset\n").await.expect("reset");
                    sent = true;
                } else if sent && prompts(&seen) >= 2 {
                    return;
                }
            }
        })
        .await;
        assert!(
            done.is_ok(),
            "the monitor did not take system_reset: {}",
            String::from_utf8_lossy(&seen)
        );
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

struct Attempt {
    ns: support::TestNamespace,
    /// The boot service as the guest reaches it.
    base: String,
    machine: String,
    callbacks: UnboundedReceiver<CallbackNotice>,
    seed: Seed,
    _state: std::sync::Arc<metalboot::boot::http::BootState>,
}

/// What the boot service serves besides the token routes.
struct Served {
    /// Served at /artifacts.
    artifacts: PathBuf,
    deploy: BootProfile,
    image: ImageSpec,
}

/// The real boot service on loopback, and a host mid-provisioning in image mode with the
/// bootstrap provider's rendering of `commands` as its user-data.
async fn attempt(prefix: &str, commands: &[&str], served: Option<&Served>) -> Attempt {
    let ns = support::namespace(prefix).await;
    install_crds(&ns.client).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    // How the guest sees the host's loopback on QEMU's user network.
    let base = format!("http://10.0.2.2:{port}");
    let (state, callbacks) = boot_state_with(
        &ns.client,
        &ns.name,
        BootConfig {
            base_url: base.clone(),
            pin_source_ip: false,
            sentinel_wait_seconds: 600,
            deploy: served.map(|s| s.deploy.clone()),
        },
    )
    .await;
    let mut app = router(state.clone());
    if let Some(served) = served {
        app = app.nest("/artifacts", artifacts_router(served.artifacts.clone()));
    }
    tokio::spawn(serve(listener, app, HttpLimits::default()));

    let user_data = render(
        &CloudInitConfigSpec {
            commands: commands.iter().map(|c| c.to_string()).collect(),
            ..Default::default()
        },
        &Default::default(),
    )
    .expect("render");
    create_host(&ns.client, &ns.name, "host-0", MAC).await;
    let machine = Api::<MetalMachine>::namespaced(ns.client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &MetalMachine::new(
                "node",
                MetalMachineSpec {
                    mode: ProvisioningMode::Image,
                    image: Some(Box::new(served.map(|s| s.image.clone()).unwrap_or(
                        ImageSpec {
                            url: "debian.raw".into(),
                            checksum: "0".repeat(64),
                            checksum_type: ChecksumType::Sha256,
                            format: ImageFormat::Raw,
                        },
                    ))),
                    ..Default::default()
                },
            ),
        )
        .await
        .expect("create MetalMachine");
    set_host_state(
        &ns.client,
        &ns.name,
        "host-0",
        HostState::Provisioning,
        Some(&machine),
    )
    .await;
    let record = create_boot_secret(
        &ns.client,
        &ns.name,
        &machine,
        "host-0",
        user_data.as_bytes(),
    )
    .await;
    until_stores("the boot Secret in the store", &state, |s| {
        !s.boot_secrets.state().is_empty() && !s.machines.state().is_empty()
    })
    .await;
    let seed = Seed {
        instance_id: record.instance_id.clone(),
        hostname: "host-0".into(),
        seedfrom: nocloud_url(&base, record.token.expose()),
    };
    Attempt {
        ns,
        base,
        machine: "node".into(),
        callbacks,
        seed,
        _state: state,
    }
}

async fn boot_record(a: &Attempt) -> tokens::BootRecord {
    let secret = Api::<Secret>::namespaced(a.ns.client.clone(), &a.ns.name)
        .get(&tokens::boot_secret_name(&a.machine))
        .await
        .expect("boot Secret");
    tokens::parse_secret(&secret).expect("parse")
}

/// SeaBIOS: the installed OS runs the user-data once, calls back, and a reset boots the same
/// instance from cloud-init's cache (not the spent token) without running it again.
#[tokio::test]
async fn bios_boot_runs_the_user_data_once_calls_back_and_survives_a_reset() {
    let mut a = attempt(
        "os-bios",
        &[
            &format!("echo '{RAN}' > /dev/console"),
            "touch /var/lib/metalboot-test-marker",
        ],
        None,
    )
    .await;
    let dir = tempfile::tempdir().expect("tmp");
    let disk = installed_disk(dir.path(), &a.seed);
    let guest = Guest::boot(dir.path(), &disk, Firmware::SeaBios);

    let notice = tokio::time::timeout(Duration::from_secs(600), a.callbacks.recv()).await;
    let Ok(Some(notice)) = notice else {
        panic!("no callback; console:\n{}", tail(&guest.console(), 6000));
    };
    assert_eq!(notice.metal_machine, a.machine);
    let record = boot_record(&a).await;
    let callback = record.callback.expect("callback recorded");
    assert!(
        callback
            .addresses
            .iter()
            .any(|ip| ip.to_string() == "10.0.2.15"),
        "{callback:?}"
    );
    guest.until_console(FINISHED, 1, 300).await;
    assert_eq!(guest.count(RAN), 1, "{}", guest.console());

    guest.reset().await;
    guest.until_console(FINISHED, 2, 600).await;
    let console = guest.console();
    assert_eq!(
        console.matches(RAN).count(),
        1,
        "the user-data ran again after a reset:\n{}",
        tail(&console, 6000)
    );
    let last = console
        .lines()
        .rfind(|l| l.contains(FINISHED))
        .unwrap_or_default();
    assert!(
        last.contains("DataSourceNoCloud"),
        "the second boot did not keep its NoCloud instance: {last}\n{}",
        tail(&console, 30000)
    );
    let again = boot_record(&a).await;
    assert_eq!(again.attempt, record.attempt, "no new attempt");
    let second = a.callbacks.try_recv();
    assert!(
        second.is_err(),
        "a second callback ({second:?}) after {:?}:\n{}",
        again.callback,
        tail(&console, 20000)
    );
}

/// OVMF: a bootstrap command that fails stops the rest, no sentinel is written, and nothing
/// calls back.
#[tokio::test]
async fn uefi_boot_with_a_failing_command_never_calls_back() {
    let mut a = attempt(
        "os-uefi",
        &[
            "echo 'metalboot-test: step 1' > /dev/console",
            "false",
            "echo 'metalboot-test: after the failure' > /dev/console",
        ],
        None,
    )
    .await;
    let dir = tempfile::tempdir().expect("tmp");
    let disk = installed_disk(dir.path(), &a.seed);
    let guest = Guest::boot(dir.path(), &disk, Firmware::Ovmf);
    guest.until_console(FINISHED, 1, 600).await;
    let console = guest.console();
    assert!(
        console.contains("metalboot-test: step 1"),
        "{}",
        tail(&console, 6000)
    );
    assert!(
        !console.contains("metalboot-test: after the failure"),
        "a command ran after a failed one"
    );
    assert!(
        console.contains("scripts-user"),
        "cloud-init did not report the failed runcmd:\n{}",
        tail(&console, 6000)
    );
    assert!(
        boot_record(&a).await.callback.is_none(),
        "callback recorded"
    );
    assert!(a.callbacks.try_recv().is_err(), "callback notice");
}

/// The deploy ramdisk and the OS image served from a fresh artifacts directory; `checksum`
/// defaults to the image's real sha256.
fn served(checksum: Option<String>) -> (tempfile::TempDir, Served) {
    let project = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ramdisk = project.join("target/lab/deploy");
    let os = os_image().with_file_name("debian.raw.gz");
    for f in [
        ramdisk.join("vmlinuz"),
        ramdisk.join("initrd.gz"),
        os.clone(),
    ] {
        assert!(
            f.exists(),
            "{} is missing: `make test` builds it",
            f.display()
        );
    }
    let sums = std::fs::read_to_string(os.with_file_name("SHA256SUMS")).expect("SHA256SUMS");
    let real = sums
        .lines()
        .find(|l| l.ends_with(" debian.raw.gz"))
        .and_then(|l| l.split_whitespace().next())
        .expect("debian.raw.gz in SHA256SUMS")
        .to_string();
    let artifacts = tempfile::tempdir().expect("tmp");
    for (from, to) in [
        (ramdisk.join("vmlinuz"), "deploy-vmlinuz"),
        (ramdisk.join("initrd.gz"), "deploy-initrd.gz"),
        (os.clone(), "debian.raw.gz"),
    ] {
        let to = artifacts.path().join(to);
        if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).expect("copy artifact");
        }
    }
    let served = Served {
        artifacts: artifacts.path().to_path_buf(),
        deploy: BootProfile {
            kernel: "deploy-vmlinuz".into(),
            initrds: vec!["deploy-initrd.gz".into()],
            cmdline: Some("console=ttyS0".into()),
        },
        image: ImageSpec {
            url: "debian.raw.gz".into(),
            checksum: checksum.unwrap_or(real),
            checksum_type: ChecksumType::Sha256,
            format: ImageFormat::Gzip,
        },
    };
    (artifacts, served)
}

/// SeaBIOS and the NIC's real iPXE network-boot the deploy ramdisk from the boot service, with
/// an empty 4 GiB virtio disk; returns once the agent reported its outcome on the boot Secret.
async fn deploy_stage(
    a: &Attempt,
    dir: &Path,
) -> (
    PathBuf,
    metalboot::agent::protocol::DeployReport,
    tokio::process::Child,
    String,
) {
    let disk = dir.join("disk.raw");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(4 << 30))
        .expect("empty disk");
    let console = dir.join("deploy-console.log");
    let deploy = tokio::process::Command::new("qemu-system-x86_64")
        .args(["-machine", "pc,accel=tcg", "-m", "1024", "-smp", "1"])
        .args(["-display", "none", "-monitor", "none"])
        .args(["-serial", &format!("file:{}", console.display())])
        .args([
            "-netdev",
            &format!("user,id=n0,bootfile={}/boot.ipxe", a.base),
        ])
        .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={MAC}")])
        .args([
            "-drive",
            &format!("file={},format=raw,if=none,id=d0", disk.display()),
        ])
        .args(["-device", "virtio-blk-pci,drive=d0,serial=METALDISK0"])
        .args(["-boot", "once=n"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start qemu-system-x86_64");
    let console_text =
        || String::from_utf8_lossy(&std::fs::read(&console).unwrap_or_default()).into_owned();
    let finished =
        support::eventually_or("the agent's outcome on the boot Secret", 900, || async {
            boot_record(a)
                .await
                .deploy
                .filter(|d| d.state != metalboot::agent::protocol::DeployState::Writing)
        })
        .await;
    let Some(report) = finished else {
        panic!("no outcome; console:\n{}", tail(&console_text(), 8000));
    };
    (disk, report, deploy, console_text())
}

/// The whole install on one host, as real as it runs here: SeaBIOS and the NIC's real iPXE fetch
/// the boot service's script, which sends the deploy ramdisk (hack/deploy-ramdisk: busybox and
/// `metalboot agent` as a static musl binary); the agent inspects the host, streams the real OS
/// image (gzip, sha256 checked on the way) onto the empty virtio disk and seeds it; the disk then
/// boots the installed OS, whose real cloud-init runs the user-data and calls back.
#[tokio::test]
async fn the_deploy_agent_installs_the_os_which_boots_and_calls_back() {
    let (_artifacts, served) = served(None);
    let mut a = attempt(
        "os-deploy",
        &[&format!("echo '{RAN}' > /dev/console")],
        Some(&served),
    )
    .await;
    let dir = tempfile::tempdir().expect("tmp");
    let (disk, report, mut deploy, console) = deploy_stage(&a, dir.path()).await;
    assert_eq!(
        report.state,
        metalboot::agent::protocol::DeployState::Written,
        "{report:?}\n{}",
        tail(&console, 8000)
    );
    assert_eq!(report.device.as_deref(), Some("vda"), "{report:?}");
    let record = boot_record(&a).await;
    let hardware = record.inspection.expect("inspection recorded");
    let vda = hardware
        .disks
        .iter()
        .find(|d| d.name == "vda")
        .unwrap_or_else(|| panic!("no vda in {hardware:?}"));
    assert_eq!(vda.size_bytes, 4 << 30, "{vda:?}");
    assert_eq!(vda.serial_number.as_deref(), Some("METALDISK0"), "{vda:?}");
    assert!(
        hardware.nics.iter().any(|n| n
            .mac
            .as_deref()
            .is_some_and(|m| m.eq_ignore_ascii_case(MAC))),
        "{hardware:?}"
    );
    assert!(
        hardware
            .memory_mib
            .is_some_and(|m| (900..=1024).contains(&m)),
        "{hardware:?}"
    );
    assert_eq!(
        hardware.firmware_mode.as_deref(),
        Some("BIOS"),
        "{hardware:?}"
    );
    let _ = deploy.kill().await;
    let _ = deploy.wait().await;

    // Stage 2: the disk boots the installed OS (the controller's restart into the disk).
    let guest = Guest::boot(dir.path(), &disk, Firmware::SeaBios);
    let notice = tokio::time::timeout(Duration::from_secs(600), a.callbacks.recv()).await;
    let Ok(Some(notice)) = notice else {
        panic!("no callback; console:\n{}", tail(&guest.console(), 8000));
    };
    assert_eq!(notice.metal_machine, a.machine);
    guest.until_console(FINISHED, 1, 300).await;
    assert_eq!(guest.count(RAN), 1);
}

/// A wrong checksum: the real agent streams the whole image, finds the digest differs, wipes
/// what it wrote and reports `ImageChecksumMismatch`; the disk holds no partition table after.
#[tokio::test]
async fn a_wrong_checksum_is_reported_and_the_disk_is_wiped() {
    let (_artifacts, served) = served(Some("ab".repeat(32)));
    let a = attempt("os-badsum", &["true"], Some(&served)).await;
    let dir = tempfile::tempdir().expect("tmp");
    let (disk, report, mut deploy, console) = deploy_stage(&a, dir.path()).await;
    let _ = deploy.kill().await;
    let _ = deploy.wait().await;
    assert_eq!(
        report.state,
        metalboot::agent::protocol::DeployState::Failed,
        "{report:?}\n{}",
        tail(&console, 8000)
    );
    assert_eq!(
        report.reason.as_deref(),
        Some("ImageChecksumMismatch"),
        "{report:?}"
    );
    let mib_at = |offset: u64| {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&disk).expect("disk");
        f.seek(SeekFrom::Start(offset)).expect("seek");
        let mut buf = vec![0u8; 1 << 20];
        f.read_exact(&mut buf).expect("read");
        buf
    };
    assert!(
        mib_at(0).iter().all(|b| *b == 0),
        "the first MiB (MBR, GPT) was not wiped"
    );
    assert!(
        mib_at((4 << 30) - (1 << 20)).iter().all(|b| *b == 0),
        "the last MiB (backup GPT) was not wiped"
    );
    assert!(
        report.message.as_deref().is_some_and(|m| !m.is_empty()),
        "the failure says what differed: {report:?}"
    );
    assert!(boot_record(&a).await.callback.is_none());
}

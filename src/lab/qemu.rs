//! One lab host: a QEMU process per power-on, controlled over QMP. Power on starts QEMU (with
//! `-boot once=n` when a one-time network boot was requested); force off quits it; reset is a
//! QMP `system_reset`; graceful off presses the ACPI power button (systemd-logind shuts the
//! lab's Debian down) and forces the host off if it is still running after a grace period.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use crate::api::metalhost::PowerState;

/// UEFI firmware for lab hosts booted in UEFI mode (Debian package `ovmf`). As `-bios`, its
/// variables live in memory: every power-on starts from the defaults, like a fresh VARS copy.
const OVMF: &str = "/usr/share/ovmf/OVMF.fd";

/// How a host's firmware network-boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Firmware {
    /// SeaBIOS; the NIC's iPXE option ROM does DHCP and boots.
    Bios,
    /// OVMF with the NIC's option ROM removed (`romfile=`): EDK2's own PXE does DHCP and
    /// fetches the boot program over TFTP.
    UefiPxe,
    /// OVMF with PXE switched off (fw_cfg `IPv4PXESupport`/`IPv6PXESupport`): EDK2 HTTP Boot.
    UefiHttp,
}

impl Firmware {
    pub fn uefi(self) -> bool {
        self != Firmware::Bios
    }
}

/// How a host is wired.
#[derive(Debug, Clone)]
pub enum HostNetwork {
    /// QEMU's user-mode network; its built-in DHCP hands iPXE this boot file URL.
    User { bootfile_url: String },
    /// A tap device in a network namespace (the bridged lab network); QEMU runs in it.
    Tap { netns: String, ifname: String },
}

/// How QEMU executes guest code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

#[derive(Debug, Clone)]
pub struct QemuHostSpec {
    pub name: String,
    pub uuid: String,
    pub mac: String,
    pub memory_mib: u32,
    pub network: HostNetwork,
    pub firmware: Firmware,
    /// Per-host directory: QMP socket, serial log.
    pub dir: PathBuf,
    pub accel: Accel,
    /// Seconds a graceful power-off waits for the guest before forcing it.
    pub graceful_seconds: u64,
    /// The host's disk (a raw file, virtio), which the deploy agent writes and the host boots
    /// after the network when the network boot exits; None: diskless.
    pub disk: Option<PathBuf>,
}

/// The one-time boot override a BMC client requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootOverride {
    pub target: String,
    pub enabled: String,
    pub mode: String,
}

impl Default for BootOverride {
    fn default() -> Self {
        BootOverride {
            target: "None".into(),
            enabled: "Disabled".into(),
            mode: "Legacy".into(),
        }
    }
}

struct Inner {
    child: Option<Child>,
    boot: BootOverride,
    power_ons: u32,
}

pub struct QemuHost {
    pub spec: QemuHostSpec,
    inner: Mutex<Inner>,
}

#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    #[error("starting QEMU for {host}: {source}")]
    Spawn {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP of {host}: {message}")]
    Qmp { host: String, message: String },
}

impl QemuHost {
    pub fn new(spec: QemuHostSpec) -> Self {
        QemuHost {
            spec,
            inner: Mutex::new(Inner {
                child: None,
                boot: BootOverride::default(),
                power_ons: 0,
            }),
        }
    }

    pub fn serial_log(&self) -> PathBuf {
        self.spec.dir.join("serial.log")
    }

    fn qmp_socket(&self) -> PathBuf {
        self.spec.dir.join("qmp.sock")
    }

    pub async fn boot_override(&self) -> BootOverride {
        self.inner.lock().await.boot.clone()
    }

    pub async fn set_boot_override(&self, boot: BootOverride) {
        self.inner.lock().await.boot = boot;
    }

    /// How many times the host was powered on (QEMU started), for tests and timings.
    pub async fn power_ons(&self) -> u32 {
        self.inner.lock().await.power_ons
    }

    /// The QEMU process id while it runs.
    pub async fn pid(&self) -> Option<u32> {
        let mut inner = self.inner.lock().await;
        reap(&mut inner);
        inner.child.as_ref().and_then(|c| c.id())
    }

    pub async fn power_state(&self) -> PowerState {
        let mut inner = self.inner.lock().await;
        reap(&mut inner);
        if inner.child.is_none() {
            return PowerState::Off;
        }
        match qmp(&self.qmp_socket(), "query-status", json!({})).await {
            Ok(v) => match v.get("status").and_then(Value::as_str) {
                Some("running") | Some("debug") | Some("inmigrate") => PowerState::On,
                Some("shutdown") | Some("prelaunch") => PowerState::Off,
                _ => PowerState::On,
            },
            // QEMU is alive but QMP not up yet: it is starting.
            Err(_) => PowerState::On,
        }
    }

    pub async fn power_on(&self) -> Result<(), QemuError> {
        let mut inner = self.inner.lock().await;
        reap(&mut inner);
        if inner.child.is_some() {
            return Ok(());
        }
        self.start(&mut inner).await
    }

    async fn start(&self, inner: &mut Inner) -> Result<(), QemuError> {
        let spawn_err = |source| QemuError::Spawn {
            host: self.spec.name.clone(),
            source,
        };
        std::fs::create_dir_all(&self.spec.dir).map_err(spawn_err)?;
        let _ = std::fs::remove_file(self.qmp_socket());
        let once = inner.boot.enabled != "Disabled"
            && (inner.boot.target == "Pxe" || inner.boot.target == "UefiHttp");
        // A one-time (or continuous) disk boot puts the disk before the NIC.
        let disk_first = inner.boot.enabled != "Disabled" && inner.boot.target == "Hdd";
        let mut cmd = match &self.spec.network {
            HostNetwork::User { .. } => Command::new("qemu-system-x86_64"),
            HostNetwork::Tap { netns, .. } => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", netns, "qemu-system-x86_64"]);
                cmd
            }
        };
        // A BIOS host asked for UEFI boots EDK2's PXE (the override is the operator's intent).
        let firmware = match (self.spec.firmware, inner.boot.mode.as_str()) {
            (Firmware::Bios, "UEFI") => Firmware::UefiPxe,
            (firmware, _) => firmware,
        };
        let ovmf = firmware.uefi() && Path::new(OVMF).exists();
        if firmware.uefi() {
            if ovmf {
                cmd.args(["-bios", OVMF]);
                // IPv6 is not on the lab network: no PXEv6/HTTPv6 wait.
                cmd.args(["-fw_cfg", "name=opt/org.tianocore/IPv6PXESupport,string=n"]);
                if firmware == Firmware::UefiHttp {
                    cmd.args(["-fw_cfg", "name=opt/org.tianocore/IPv4PXESupport,string=n"]);
                }
            } else {
                tracing::info!(host = %self.spec.name, "UEFI boot requested but {OVMF} is absent (package ovmf); booting SeaBIOS");
            }
        }
        let netdev = match &self.spec.network {
            HostNetwork::User { bootfile_url } => format!("user,id=net0,bootfile={bootfile_url}"),
            HostNetwork::Tap { ifname, .. } => {
                format!("tap,id=net0,ifname={ifname},script=no,downscript=no")
            }
        };
        // EDK2's own network stack runs only without the NIC's iPXE option ROM.
        let romfile = if ovmf { ",romfile=" } else { "" };
        cmd.args(["-name", &self.spec.name])
            .args(["-machine", &format!("pc,accel={}", self.spec.accel.name())])
            .args(["-m", &self.spec.memory_mib.to_string(), "-smp", "1"])
            .args(["-uuid", &self.spec.uuid])
            .args(["-display", "none", "-monitor", "none"])
            .args([
                "-chardev",
                &format!(
                    "file,id=serial0,path={},append=on",
                    self.serial_log().display()
                ),
            ])
            .args(["-serial", "chardev:serial0"])
            .args([
                "-qmp",
                &format!("unix:{},server=on,wait=off", self.qmp_socket().display()),
            ])
            .args(["-netdev", &netdev])
            .args([
                "-device",
                &format!(
                    "virtio-net-pci,netdev=net0,mac={},bootindex=1{romfile}",
                    self.spec.mac
                ),
            ])
            .args(["-boot", if once { "once=n" } else { "order=cn" }])
            .args(self.spec.disk.iter().flat_map(|disk| {
                [
                    "-drive".to_string(),
                    format!("file={},format=raw,if=none,id=disk0", disk.display()),
                    "-device".to_string(),
                    format!(
                        "virtio-blk-pci,drive=disk0,serial={}{}",
                        self.spec.name,
                        if disk_first {
                            ",bootindex=0"
                        } else {
                            ",bootindex=2"
                        }
                    ),
                ]
            }))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.spec.dir.join("qemu.log"))
                    .map_err(spawn_err)?,
            ))
            .kill_on_drop(true);
        let child = cmd.spawn().map_err(spawn_err)?;
        if (once || disk_first) && inner.boot.enabled == "Once" {
            inner.boot.enabled = "Disabled".into();
            inner.boot.target = "None".into();
        }
        inner.child = Some(child);
        inner.power_ons += 1;
        tracing::info!(host = %self.spec.name, once_network = once, accel = self.spec.accel.name(), "lab host powered on");
        Ok(())
    }

    pub async fn force_off(&self) -> Result<(), QemuError> {
        let mut inner = self.inner.lock().await;
        if let Some(mut child) = inner.child.take() {
            let _ = qmp(&self.qmp_socket(), "quit", json!({})).await;
            if tokio::time::timeout(Duration::from_secs(3), child.wait())
                .await
                .is_err()
            {
                let _ = child.kill().await;
            }
            tracing::info!(host = %self.spec.name, "lab host powered off");
        }
        Ok(())
    }

    /// ACPI power button, then force after the grace period if the guest ignored it.
    pub async fn graceful_off(self: &std::sync::Arc<Self>) -> Result<(), QemuError> {
        let Some(pid) = self.pid().await else {
            return Ok(());
        };
        let _ = qmp(&self.qmp_socket(), "system_powerdown", json!({})).await;
        let host = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(host.spec.graceful_seconds)).await;
            // Only the QEMU that was asked to power down: a host powered on again during the
            // grace period runs a new one, which must not be killed.
            if host.pid().await == Some(pid) {
                tracing::info!(host = %host.spec.name, "guest ignored the ACPI power button; forcing off");
                let _ = host.force_off().await;
            }
        });
        Ok(())
    }

    /// Hard reset: the guest reboots at once; a pending one-time network boot restarts QEMU so
    /// the override takes effect.
    pub async fn reset(&self) -> Result<(), QemuError> {
        let pending_network = {
            let inner = self.inner.lock().await;
            inner.boot.enabled != "Disabled" && inner.boot.target == "Pxe"
        };
        if pending_network || self.pid().await.is_none() {
            self.force_off().await?;
            return self.power_on().await;
        }
        qmp(&self.qmp_socket(), "system_reset", json!({}))
            .await
            .map(|_| ())
            .map_err(|message| QemuError::Qmp {
                host: self.spec.name.clone(),
                message,
            })
    }

    /// Power cycle: off, then on (a fresh QEMU, so a one-time boot override applies).
    pub async fn power_cycle(&self) -> Result<(), QemuError> {
        self.force_off().await?;
        self.power_on().await
    }
}

fn reap(inner: &mut Inner) {
    if let Some(child) = inner.child.as_mut()
        && let Ok(Some(_)) = child.try_wait()
    {
        inner.child = None;
    }
}

/// One QMP command: greeting, capabilities, command; returns `return` or the error text.
async fn qmp(socket: &Path, command: &str, arguments: Value) -> Result<Value, String> {
    let exchange = async {
        let stream = UnixStream::connect(socket)
            .await
            .map_err(|e| e.to_string())?;
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        let mut next = async || -> Result<Value, String> {
            loop {
                let line = lines
                    .next_line()
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or("QMP closed")?;
                let v: Value = serde_json::from_str(&line).map_err(|e| e.to_string())?;
                if v.get("event").is_none() {
                    return Ok(v);
                }
            }
        };
        next().await?; // greeting
        write
            .write_all(b"{\"execute\":\"qmp_capabilities\"}\n")
            .await
            .map_err(|e| e.to_string())?;
        next().await?;
        let request = json!({"execute": command, "arguments": arguments});
        write
            .write_all(format!("{request}\n").as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        if command == "quit" {
            return Ok(Value::Null);
        }
        let reply = next().await?;
        match reply.get("return") {
            Some(v) => Ok(v.clone()),
            None => Err(reply
                .get("error")
                .map(|e| e.to_string())
                .unwrap_or_else(|| reply.to_string())),
        }
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .unwrap_or_else(|_| Err("QMP timed out".into()))
}

/// Whether KVM really runs guests here: boots iPXE with a script that prints a marker and powers
/// off. On hosts where /dev/kvm exists but guests hang (nested PVM), this times out → TCG.
pub async fn probe_accel(work: &Path) -> Accel {
    if !Path::new("/dev/kvm").exists() {
        return Accel::Tcg;
    }
    let lkrn = Path::new("/usr/lib/ipxe/ipxe.lkrn");
    if !lkrn.exists() {
        return Accel::Tcg;
    }
    let _ = std::fs::create_dir_all(work);
    let script = work.join("kvm-probe.ipxe");
    if std::fs::write(&script, "#!ipxe\necho METALBOOT-KVM-OK\npoweroff\n").is_err() {
        return Accel::Tcg;
    }
    let run = Command::new("qemu-system-x86_64")
        .args([
            "-machine",
            "pc,accel=kvm",
            "-cpu",
            "max",
            "-m",
            "64",
            "-display",
            "none",
            "-no-reboot",
        ])
        .args(["-serial", "stdio", "-monitor", "none", "-net", "none"])
        .arg("-kernel")
        .arg(lkrn)
        .arg("-initrd")
        .arg(&script)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(8), run).await {
        Ok(Ok(out)) if String::from_utf8_lossy(&out.stdout).contains("METALBOOT-KVM-OK") => {
            Accel::Kvm
        }
        _ => Accel::Tcg,
    }
}

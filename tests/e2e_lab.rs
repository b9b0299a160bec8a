//! The lab end to end, as `make lab` runs it: `metalboot lab up --hosts 3` under TCG provisions
//! three QEMU hosts on the bridged lab network — SeaBIOS with the NIC's iPXE, OVMF with EDK2's PXE
//! (TFTP `ipxe.efi`), OVMF with EDK2 HTTP Boot; addresses from dnsmasq, boot options from
//! metalboot's proxyDHCP — through the virtual BMC, the boot service, metalboot's infrastructure and bootstrap
//! providers and upstream Cluster API core (installed by clusterctl). Each host runs the lab's real
//! Debian (live-boot, the real cloud-init, systemd), whose bootstrap commands register its Node;
//! deleting a Machine shuts its host down through ACPI and frees it; `lab down` leaves nothing
//! running.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Secret};
use kube::api::{Api, DeleteParams, ListParams};
use metalboot::api::capi::Machine;
use metalboot::api::metalhost::HostState;
use metalboot::api::{CloudInitConfig, MetalHost, MetalMachine};
use metalboot::lab::qemu::Firmware;
use metalboot::lab::up::{HostLive, LabState, NAMESPACE, NetworkMode, Timeline};

fn metalboot(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args(args)
        .output()
        .expect("run metalboot")
}

fn read_json<T: for<'de> serde::Deserialize<'de>>(path: &Path) -> T {
    serde_json::from_slice(
        &std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .expect("json")
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

async fn eventually<T, F, Fut>(what: &str, secs: u64, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {what}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Two hosts' worth of labs at a time, as many as there are cores under TCG: the three-host lab
/// runs alone, the two one-host labs side by side (each in its own namespace and directory).
static LAB_SLOTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

/// Runs `lab down` however the test ends, so a failed assertion leaves no QEMU or apiserver behind.
struct LabDownOnDrop(String);

impl Drop for LabDownOnDrop {
    fn drop(&mut self) {
        let _ = metalboot(&["lab", "down", "--dir", &self.0]);
    }
}

#[tokio::test]
async fn lab_up_provisions_bios_uefi_pxe_and_uefi_http_hosts_and_tears_down_cleanly() {
    let _slots = LAB_SLOTS.acquire_many(2).await.expect("lab slots");
    let dir: PathBuf = metalboot::controlplane::project_dir()
        .join(format!("target/e2e-lab-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().expect("utf-8 path").to_string();
    let _lab_down = LabDownOnDrop(dir_s.clone());
    // Generous for TCG on a busy 2-core machine; lower it to see a broken chain fail sooner.
    let timeout = std::env::var("METALBOOT_E2E_TIMEOUT_SECONDS").unwrap_or_else(|_| "900".into());
    let up = metalboot(&[
        "lab",
        "up",
        "--hosts",
        "3",
        "--dir",
        &dir_s,
        "--timeout-seconds",
        &timeout,
        "--boot-timeout-seconds",
        "300",
    ]);
    let stdout = String::from_utf8_lossy(&up.stdout).into_owned();
    if !up.status.success() {
        panic!(
            "lab up failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&up.stderr)
        );
    }
    println!("{stdout}");
    assert!(stdout.contains("all 3 Machines Running"), "{stdout}");
    assert!(
        stdout.contains("power→DHCP"),
        "timings table printed: {stdout}"
    );

    // `lab status | head`: the reader may close the pipe before status writes (`true` closes it
    // at once); status must not panic on it.
    let piped = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "'{}' lab status --dir '{}' | true",
            env!("CARGO_BIN_EXE_metalboot"),
            dir.display()
        ))
        .output()
        .expect("lab status | head");
    let stderr = String::from_utf8_lossy(&piped.stderr);
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
        "lab status | head: {stderr}"
    );

    let state: LabState = read_json(&dir.join("state.json"));
    assert_eq!(
        state.network,
        NetworkMode::Bridged,
        "the lab runs on its bridge"
    );
    let firmware: Vec<Firmware> = state.hosts.iter().map(|h| h.firmware).collect();
    assert_eq!(
        firmware,
        [Firmware::Bios, Firmware::UefiPxe, Firmware::UefiHttp]
    );
    // The last host is driven over IPMI: metalboot's ipmitool → ipmi_sim → the virtual BMC.
    let ipmi_host = state.hosts.last().expect("hosts");
    assert!(ipmi_host.bmc.starts_with("ipmi://"), "{ipmi_host:?}");
    assert!(
        state.hosts[..2]
            .iter()
            .all(|h| h.bmc.starts_with("redfish+http://")),
        "{:?}",
        state.hosts
    );
    let chassis = std::fs::read_to_string(
        dir.join("hosts")
            .join(&ipmi_host.name)
            .join("ipmi/chassis.log"),
    )
    .expect("ipmi_sim's chassis log");
    for want in ["set boot pxe", "set power 1"] {
        assert!(chassis.lines().any(|l| l == want), "{want}: {chassis}");
    }
    // Per-hop timeline: every host was answered by metalboot's proxyDHCP; only the EDK2 PXE host
    // fetched its boot program over TFTP.
    let timings: std::collections::BTreeMap<String, Timeline> =
        read_json(&dir.join("timings.json"));
    for host in &state.hosts {
        let t = &timings[&host.name];
        assert!(
            t.dhcp.is_some() && t.kernel.is_some() && t.initrd.is_some() && t.callback.is_some(),
            "{}: {t:?}",
            host.name
        );
        assert_eq!(
            t.tftp.is_some(),
            host.firmware == Firmware::UefiPxe,
            "{}: {t:?}",
            host.name
        );
    }
    // metalboot's own log: the EFI binary went over TFTP to the UEFI PXE host's MAC, and each
    // host's address came from the site's dnsmasq, not from metalboot.
    let log = std::fs::read_to_string(dir.join("lab.log")).expect("lab.log");
    let pxe_host = &state.hosts[1];
    assert!(
        log.lines().any(|l| l.contains("TFTP transfer done")
            && l.contains(&pxe_host.mac)
            && l.contains("ipxe.efi")),
        "no TFTP transfer of ipxe.efi to {} in lab.log",
        pxe_host.mac
    );
    // The same timeline as metrics, read from the boot service on the lab's bridge.
    let metrics = Command::new("ip")
        .args([
            "netns",
            "exec",
            state.netns.as_deref().expect("the lab's namespace"),
            "curl",
            "-sf",
        ])
        .arg(format!("{}/metrics", state.boot_url))
        .output()
        .expect("curl the boot service's metrics");
    let metrics = String::from_utf8_lossy(&metrics.stdout);
    for hop in [
        "dhcp",
        "tftp",
        "script",
        "artifact",
        "user-data",
        "callback",
    ] {
        assert!(
            metrics.contains(&format!(
                "metalboot_boot_hop_seconds_count{{hop=\"{hop}\"}}"
            )),
            "hop {hop} in /metrics:\n{metrics}"
        );
    }
    let leases =
        std::fs::read_to_string(dir.join("network/dnsmasq.leases")).expect("dnsmasq leases");
    for host in &state.hosts {
        assert!(
            leases.contains(&host.mac),
            "{} leased by dnsmasq: {leases}",
            host.name
        );
    }
    let kubeconfig = kube::config::Kubeconfig::read_from(&state.kubeconfig).expect("kubeconfig");
    let client = metalboot::controlplane::client_from_kubeconfig(kubeconfig)
        .await
        .expect("client");
    let machines: Api<Machine> = Api::namespaced(client.clone(), NAMESPACE);
    let nodes: Api<Node> = Api::all(client.clone());
    for m in machines
        .list(&ListParams::default())
        .await
        .expect("machines")
        .items
    {
        let status = m.status.clone().expect("status");
        assert_eq!(status.phase.as_deref(), Some("Running"));
        let provider_id = m.spec.provider_id.clone().expect("providerID");
        assert!(provider_id.starts_with("metalboot://"), "{provider_id}");
        let node = nodes
            .get(&status.node_ref.expect("nodeRef").name)
            .await
            .expect("Node");
        assert_eq!(
            node.spec.and_then(|s| s.provider_id).as_deref(),
            Some(provider_id.as_str()),
            "Node and Machine agree"
        );
        // The host ran exactly the bootstrap data: its serial console shows the bootstrap command.
        let config: Api<CloudInitConfig> = Api::namespaced(client.clone(), NAMESPACE);
        let secret_name = config
            .get(&m.metadata.name.clone().unwrap_or_default())
            .await
            .expect("config")
            .status
            .and_then(|s| s.data_secret_name)
            .expect("dataSecretName");
        let bootstrap = Api::<Secret>::namespaced(client.clone(), NAMESPACE)
            .get(&secret_name)
            .await
            .expect("bootstrap Secret");
        assert!(
            bootstrap
                .data
                .and_then(|d| d.get("value").cloned())
                .is_some_and(
                    |v| String::from_utf8_lossy(&v.0).contains("bootstrap-success.complete")
                )
        );
    }
    // Every MetalHost was probed at registration: its status says what its BMC speaks.
    let hosts_api: Api<MetalHost> = Api::namespaced(client.clone(), NAMESPACE);
    for host in &state.hosts {
        let probed = hosts_api
            .get(&host.name)
            .await
            .expect("MetalHost")
            .status
            .and_then(|s| s.bmc)
            .unwrap_or_else(|| panic!("{}: no status.bmc", host.name));
        let want = if host.bmc.starts_with("ipmi://") {
            "IPMI"
        } else {
            "Redfish"
        };
        assert_eq!(probed.protocol, want, "{}: {probed:?}", host.name);
    }
    // Which host runs which Machine is decided by the claim, not by the order of creation.
    let metal_machines: Api<MetalMachine> = Api::namespaced(client.clone(), NAMESPACE);
    let mut machine_of_host = std::collections::BTreeMap::new();
    for m in machines
        .list(&ListParams::default())
        .await
        .expect("machines")
        .items
    {
        let mm = metal_machines
            .get(&m.spec.infrastructure_ref.name)
            .await
            .expect("MetalMachine");
        let host = mm.status.and_then(|s| s.host_ref).expect("hostRef").name;
        machine_of_host.insert(host, m.metadata.name.clone().unwrap_or_default());
    }
    assert_eq!(
        machine_of_host.len(),
        state.hosts.len(),
        "one Machine per host: {machine_of_host:?}"
    );
    for host in &state.hosts {
        let serial = std::fs::read_to_string(&host.serial_log).unwrap_or_default();
        let machine = &machine_of_host[&host.name];
        assert!(
            serial.contains(&format!("metalboot lab: bootstrapping {machine}")),
            "{}: user-data ran:\n{serial}",
            host.name
        );
        assert!(
            serial.contains("reported bootstrap success")
                || serial.contains("bootstrap sentinel present"),
            "{}: {serial}",
            host.name
        );
    }

    // Delete one Machine: its host powers off within seconds and becomes Available; its Node goes.
    // A worker's: upstream core never deletes the Node of the last control-plane Machine (lab-0).
    let victim = state
        .hosts
        .iter()
        .find(|h| machine_of_host[&h.name] != "lab-0")
        .expect("a host running a worker Machine");
    let victim_machine = &machine_of_host[&victim.name];
    let live: std::collections::BTreeMap<String, HostLive> = read_json(&dir.join("hosts.json"));
    let qemu_pid = live
        .get(&victim.name)
        .and_then(|l| l.qemu_pid)
        .expect("QEMU pid of the victim");
    let node_name = machines
        .get(victim_machine)
        .await
        .expect("machine")
        .status
        .and_then(|s| s.node_ref)
        .map(|n| n.name)
        .expect("nodeRef");
    machines
        .delete(victim_machine, &DeleteParams::default())
        .await
        .expect("delete Machine");
    let deleted_at = Instant::now();
    eventually("the victim's QEMU process stopped", 120, || async {
        (!alive(qemu_pid)).then_some(())
    })
    .await;
    println!(
        "QEMU of {} stopped {:.1}s after the Machine was deleted",
        victim.name,
        deleted_at.elapsed().as_secs_f64()
    );
    // The graceful path did it: the BMC pressed the power button and the OS (systemd-logind)
    // shut itself down; the kernel's last word is on the console.
    let serial = std::fs::read_to_string(&victim.serial_log).unwrap_or_default();
    assert!(
        serial.contains("reboot: Power down"),
        "{} did not shut down through ACPI:\n{serial}",
        victim.name
    );
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), NAMESPACE);
    eventually("the MetalHost Available again", 120, || async {
        let h = hosts.get(&victim.name).await.ok()?;
        (h.status.and_then(|s| s.state) == Some(HostState::Available)).then_some(())
    })
    .await;
    eventually("the Node deleted", 120, || async {
        nodes
            .get_opt(&node_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;

    // lab down leaves no QEMU and no control-plane process behind.
    let live: std::collections::BTreeMap<String, HostLive> = read_json(&dir.join("hosts.json"));
    let qemu_pids: Vec<u32> = live.values().filter_map(|l| l.qemu_pid).collect();
    let down = metalboot(&["lab", "down", "--dir", &dir_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(!alive(state.pid), "the lab daemon is gone");
    for pid in qemu_pids {
        assert!(!alive(pid), "QEMU {pid} still running after lab down");
    }
    let pids = std::fs::read_to_string(dir.join("control-plane").join("etcd.log")).ok();
    assert!(pids.is_some(), "control plane ran under the lab dir");
    let leftovers = Command::new("pgrep")
        .args(["-f", &dir_s])
        .output()
        .expect("pgrep");
    assert!(
        String::from_utf8_lossy(&leftovers.stdout).trim().is_empty(),
        "processes still using the lab dir: {}",
        String::from_utf8_lossy(&leftovers.stdout)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lab up --os image`: the lab's host gets a disk, metalboot's deploy agent writes the lab's
/// Debian to it from the qcow2 image (streamed, checked), the host boots its disk and the
/// installed OS's real cloud-init bootstraps it; `lab status` shows the machine Running and the
/// MetalHost the agent's inventory.
#[tokio::test]
async fn lab_up_in_image_mode_writes_the_os_to_disk_and_boots_it() {
    let _slot = LAB_SLOTS.acquire().await.expect("a lab slot");
    let dir: PathBuf = metalboot::controlplane::project_dir()
        .join(format!("target/e2e-lab-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().expect("utf-8 path").to_string();
    let _lab_down = LabDownOnDrop(dir_s.clone());
    let up = metalboot(&[
        "lab",
        "up",
        "--hosts",
        "1",
        "--ipmi-hosts",
        "0",
        "--os",
        "image",
        "--dir",
        &dir_s,
        "--timeout-seconds",
        "1200",
        "--boot-timeout-seconds",
        "600",
    ]);
    let stdout = String::from_utf8_lossy(&up.stdout).into_owned();
    let state: Option<LabState> = std::fs::read(dir.join("state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let serial = state
        .as_ref()
        .and_then(|s| s.hosts.first())
        .and_then(|h| std::fs::read_to_string(&h.serial_log).ok())
        .unwrap_or_default();
    assert!(
        up.status.success(),
        "lab up --os image failed:\n{stdout}\n{}\nconsole:\n{}",
        String::from_utf8_lossy(&up.stderr),
        &serial[serial.len().saturating_sub(6000)..]
    );
    println!("{stdout}");
    assert!(stdout.contains("all 1 Machines Running"), "{stdout}");
    // The deploy agent wrote the disk; the installed OS booted from it and bootstrapped.
    assert!(
        serial.contains("metalboot::agent") || serial.contains("metalboot agent"),
        "the deploy agent ran:\n{serial}"
    );
    assert!(
        serial.contains("Datasource DataSourceNoCloud")
            && serial.contains("reported bootstrap success"),
        "the installed OS bootstrapped from its disk:\n{serial}"
    );
    let state = state.expect("state.json");
    let kubeconfig = kube::config::Kubeconfig::read_from(&state.kubeconfig).expect("kubeconfig");
    let client = metalboot::controlplane::client_from_kubeconfig(kubeconfig)
        .await
        .expect("client");
    let hosts: Api<MetalHost> = Api::namespaced(client, NAMESPACE);
    let host = hosts.get("lab-host-0").await.expect("MetalHost");
    let hardware = host.status.and_then(|s| s.hardware).expect("inventory");
    assert!(
        hardware
            .disks
            .iter()
            .any(|d| d.name == "vda" && d.size_bytes == 4 << 30),
        "{hardware:?}"
    );
    let down = metalboot(&["lab", "down", "--dir", &dir_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lab up --kubeadm`: the lab's Machines are a MachineDeployment of kubeadm workers. Upstream
/// core and upstream's kubeadm bootstrap provider (both installed by clusterctl) drive them;
/// the host netboots on the bridged network (dnsmasq, proxyDHCP, TFTP, iPXE), the live Debian's
/// real cloud-init runs CABPK's cloud-config, and the real kubeadm joins the lab's apiserver
/// through the TLS passthrough relay on the lab bridge. The Machine is Running on a Ready Node
/// whose providerID the kubelet took from metalboot's meta-data.
#[tokio::test]
async fn lab_up_kubeadm_joins_a_real_node() {
    let _slot = LAB_SLOTS.acquire().await.expect("a lab slot");
    let dir: PathBuf = metalboot::controlplane::project_dir()
        .join(format!("target/e2e-lab-kubeadm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.to_str().expect("utf-8 path").to_string();
    let _lab_down = LabDownOnDrop(dir_s.clone());
    let up = metalboot(&[
        "lab",
        "up",
        "--kubeadm",
        "--hosts",
        "1",
        "--ipmi-hosts",
        "0",
        "--dir",
        &dir_s,
        "--timeout-seconds",
        "1200",
        "--boot-timeout-seconds",
        "900",
    ]);
    let stdout = String::from_utf8_lossy(&up.stdout).into_owned();
    let state: Option<LabState> = std::fs::read(dir.join("state.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    let serial = state
        .as_ref()
        .and_then(|s| s.hosts.first())
        .and_then(|h| std::fs::read_to_string(&h.serial_log).ok())
        .unwrap_or_default();
    assert!(
        up.status.success(),
        "lab up --kubeadm failed:\n{stdout}\n{}\nconsole:\n{}\nlab log:\n{}",
        String::from_utf8_lossy(&up.stderr),
        &serial[serial.len().saturating_sub(6000)..],
        std::fs::read_to_string(dir.join("lab.log"))
            .map(|l| l[l.len().saturating_sub(6000)..].to_string())
            .unwrap_or_default()
    );
    println!("{stdout}");
    assert!(stdout.contains("all 1 Machines Running"), "{stdout}");
    let state = state.expect("state.json");
    assert_eq!(state.network, NetworkMode::Bridged, "the lab fell back");
    let kubeconfig = kube::config::Kubeconfig::read_from(&state.kubeconfig).expect("kubeconfig");
    let client = metalboot::controlplane::client_from_kubeconfig(kubeconfig)
        .await
        .expect("client");
    let machine = Api::<Machine>::namespaced(client.clone(), NAMESPACE)
        .list(&ListParams::default())
        .await
        .expect("Machines")
        .items
        .pop()
        .expect("a Machine");
    let provider_id = machine.spec.provider_id.clone().expect("providerID");
    assert_eq!(
        machine
            .spec
            .bootstrap
            .config_ref
            .as_ref()
            .map(|r| r.kind.as_str()),
        Some("KubeadmConfig"),
        "CABPK renders the Machine's bootstrap data"
    );
    // Running needs the Node with the Machine's providerID; Ready follows once the kubelet's
    // first status with a ready runtime network lands.
    let nodes: Api<Node> = Api::all(client.clone());
    let node = eventually("lab-host-0's Node Ready", 300, || async {
        nodes
            .get_opt("lab-host-0")
            .await
            .ok()
            .flatten()
            .filter(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
    })
    .await;
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
        Some(provider_id.as_str())
    );
    let status = node.status.expect("Node status");
    let info = status.node_info.expect("nodeInfo");
    assert!(
        info.container_runtime_version.starts_with("containerd://"),
        "{info:?}"
    );
    println!(
        "Node lab-host-0: providerID {provider_id}, kubelet {}, runtime {}, addresses {:?}",
        info.kubelet_version,
        info.container_runtime_version,
        status
            .addresses
            .iter()
            .flatten()
            .map(|a| format!("{}={}", a.type_, a.address))
            .collect::<Vec<_>>()
    );
    let down = metalboot(&["lab", "down", "--dir", &dir_s]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

//! The simulated fleet: N hosts behind the lab's virtual BMC, without QEMU. Each one, powered on
//! with a one-time network boot, does what a lab host's firmware and OS do over the network: asks
//! the boot service for its iPXE script, fetches the NoCloud documents it names, registers its
//! Node with the credentials its user-data carries, and posts the callback its vendor-data names.
//! Kernels and initrds are not downloaded (that is the boot-storm benchmark's job). A configurable
//! share of hosts misbehaves: no callback, a failing BMC, a slow BMC.
//!
//! It exists to measure and to guard the controllers at scale (`lab up --simulated-hosts N`,
//! `make bench-scale`, `tests/fleet.rs`): every power action a host receives after its accepted
//! callback is counted, because on real hardware that reboots a freshly joined node.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};

use crate::api::metalhost::PowerState;

use super::qemu::BootOverride;
use super::vbmc::LabSystem;

/// A Redfish `ResetType` the virtual BMC accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PowerAction {
    On,
    ForceOff,
    GracefulShutdown,
    ForceRestart,
    PowerCycle,
}

/// What share of the fleet misbehaves, and how (each in 0.0..=1.0; a host has at most one fault).
#[derive(Clone, Debug, Default)]
pub struct FaultShares {
    /// Boots and fetches its data but never calls back (a failed bootstrap).
    pub no_callback: f64,
    /// Its BMC answers every request with 500.
    pub bmc_errors: f64,
    /// Its BMC answers every request after `slow_bmc_delay`.
    pub slow_bmc: f64,
    pub slow_bmc_delay: Duration,
}

#[derive(Clone, Debug)]
pub struct FleetOptions {
    pub hosts: u32,
    /// The boot service as the hosts reach it, e.g. `http://127.0.0.1:8080`.
    pub boot_url: String,
    /// From power-on to the firmware's first request.
    pub boot_delay: Duration,
    /// From the NoCloud documents to the end of the bootstrap (Node and callback).
    pub os_delay: Duration,
    pub faults: FaultShares,
    /// Hosts in their network boot at once (a real network's DHCP and firmware pace them too).
    pub concurrent_boots: usize,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fault {
    None,
    NoCallback,
    BmcErrors,
    SlowBmc(Duration),
}

/// The fault of host `i`: a fixed, evenly spread choice, so runs are comparable.
pub fn fault_of(i: u32, shares: &FaultShares) -> Fault {
    // A multiplicative hash spreads consecutive indices over [0, 1).
    let u = (u64::from(i)
        .wrapping_add(1)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        >> 11) as f64
        / (1u64 << 53) as f64;
    let mut edge = shares.no_callback;
    if u < edge {
        return Fault::NoCallback;
    }
    edge += shares.bmc_errors;
    if u < edge {
        return Fault::BmcErrors;
    }
    edge += shares.slow_bmc;
    if u < edge {
        return Fault::SlowBmc(shares.slow_bmc_delay);
    }
    Fault::None
}

/// The lab's MAC address of host `i` (lab hosts and simulated hosts alike).
pub fn mac_of(i: u32) -> String {
    format!("52:54:00:6d:{:02x}:{:02x}", (i >> 8) & 0xff, i & 0xff)
}

/// The address host `i` reports in its callback and Node (never used on a wire).
fn address_of(i: u32) -> String {
    format!("10.128.{}.{}", (i >> 8) & 0xff, i & 0xff)
}

/// The loopback address host `i` sends from: each host is its own client to the boot service,
/// as in a rack, so per-client budgets apply per host and not to the whole fleet.
fn source_of(i: u32) -> std::net::IpAddr {
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(
        127,
        1 + ((i >> 16) & 0x3f) as u8,
        ((i >> 8) & 0xff) as u8,
        (i & 0xff) as u8,
    ))
}

#[derive(Default)]
struct Counters {
    bmc_requests: AtomicU64,
    bmc_max_in_flight: AtomicU32,
    power_actions: AtomicU64,
    network_boots: AtomicU64,
    scripts: AtomicU64,
    callbacks: AtomicU64,
    nodes: AtomicU64,
    boot_errors: AtomicU64,
    actions_after_callback: AtomicU64,
}

struct Shared {
    opts: FleetOptions,
    /// For the Node registration (the lab's relay), shared by all hosts.
    http: reqwest::Client,
    boots: tokio::sync::Semaphore,
    counters: Counters,
    /// Set while the harness deletes the Machines: power actions are then expected.
    releasing: AtomicBool,
}

#[derive(Default)]
struct SimState {
    power_on: bool,
    boot: BootOverride,
    /// Bumped by every power change; a boot in flight stops when it no longer matches.
    generation: u64,
    called_back: bool,
    /// When the last callback was accepted.
    callback_at: Option<std::time::Instant>,
}

pub struct SimHost {
    pub index: u32,
    pub name: String,
    pub mac: String,
    pub uuid: String,
    pub fault: Fault,
    state: Mutex<SimState>,
    in_flight: AtomicU32,
    shared: Arc<Shared>,
}

/// Decrements a host's in-flight BMC request count when the request ends.
pub struct InFlight<'a>(&'a AtomicU32);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl SimHost {
    fn lock(&self) -> std::sync::MutexGuard<'_, SimState> {
        // A panic elsewhere cannot leave the state half-written (plain fields only).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn power_state(&self) -> PowerState {
        if self.lock().power_on {
            PowerState::On
        } else {
            PowerState::Off
        }
    }

    /// When this host's last accepted callback happened.
    pub fn callback_at(&self) -> Option<std::time::Instant> {
        self.lock().callback_at
    }

    pub fn boot_override(&self) -> BootOverride {
        self.lock().boot.clone()
    }

    pub fn set_boot_override(&self, boot: BootOverride) {
        self.lock().boot = boot;
    }

    /// Counts one BMC request (and how many run at once for this host).
    pub fn bmc_request(&self) -> InFlight<'_> {
        let c = &self.shared.counters;
        c.bmc_requests.fetch_add(1, Ordering::Relaxed);
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        c.bmc_max_in_flight.fetch_max(now, Ordering::Relaxed);
        InFlight(&self.in_flight)
    }

    pub fn bmc_delay(&self) -> Option<Duration> {
        match self.fault {
            Fault::SlowBmc(d) => Some(d),
            _ => None,
        }
    }

    pub fn bmc_fails(&self) -> bool {
        self.fault == Fault::BmcErrors
    }

    /// A reset request: power changes at once; a network boot, if the override asks for one,
    /// runs in the background.
    pub fn act(self: &Arc<Self>, action: PowerAction) {
        let c = &self.shared.counters;
        c.power_actions.fetch_add(1, Ordering::Relaxed);
        let mut st = self.lock();
        if st.called_back && !self.shared.releasing.load(Ordering::Relaxed) {
            c.actions_after_callback.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(host = %self.name, ?action, "power action after an accepted callback");
        }
        let was_on = st.power_on;
        let starts = match action {
            PowerAction::On => !was_on,
            PowerAction::ForceRestart | PowerAction::PowerCycle => true,
            PowerAction::ForceOff | PowerAction::GracefulShutdown => {
                st.power_on = false;
                st.called_back = false;
                st.generation += 1;
                false
            }
        };
        if !starts {
            return;
        }
        st.power_on = true;
        st.generation += 1;
        let network = matches!(st.boot.enabled.as_str(), "Once" | "Continuous")
            && matches!(st.boot.target.as_str(), "Pxe" | "UefiHttp");
        if st.boot.enabled == "Once" {
            // Real BMCs clear a one-time override once the host has booted with it.
            st.boot.enabled = "Disabled".into();
            st.boot.target = "None".into();
        }
        if network {
            // A fresh network boot: whatever ran before is gone with the reboot.
            st.called_back = false;
            let generation = st.generation;
            drop(st);
            let host = self.clone();
            tokio::spawn(async move { host.network_boot(generation).await });
        }
    }

    fn current(&self, generation: u64) -> bool {
        let st = self.lock();
        st.power_on && st.generation == generation
    }

    async fn network_boot(self: Arc<Self>, generation: u64) {
        let opts = &self.shared.opts;
        tokio::time::sleep(opts.boot_delay).await;
        let Ok(_slot) = self.shared.boots.acquire().await else {
            return;
        };
        if !self.current(generation) {
            return;
        }
        self.shared
            .counters
            .network_boots
            .fetch_add(1, Ordering::Relaxed);
        match self.boot_chain(generation).await {
            Ok(()) => {}
            Err(why) => {
                self.shared
                    .counters
                    .boot_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(host = %self.name, %why, "simulated boot ended");
            }
        }
    }

    async fn get(&self, http: &reqwest::Client, url: &str) -> Result<String, String> {
        // Like iPXE and cloud-init: retry while the boot service is starting, busy or unreachable.
        for attempt in 0..10u32 {
            let r = match http.get(url).send().await {
                Ok(r) => r,
                Err(e) if attempt < 9 => {
                    tracing::debug!(host = %self.name, error = %e, "GET failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200 * (1 << attempt.min(5)))).await;
                    continue;
                }
                Err(e) => {
                    return Err(format!("GET {}: {e}", crate::boot::http::redact_path(url)));
                }
            };
            let status = r.status();
            if status.is_success() {
                return r.text().await.map_err(|e| e.to_string());
            }
            if status.is_server_error() || status.as_u16() == 429 {
                tokio::time::sleep(Duration::from_millis(200 * (1 << attempt.min(5)))).await;
                continue;
            }
            return Err(format!(
                "GET {}: {status}",
                crate::boot::http::redact_path(url)
            ));
        }
        Err(format!(
            "GET {}: still unavailable",
            crate::boot::http::redact_path(url)
        ))
    }

    async fn boot_chain(&self, generation: u64) -> Result<(), String> {
        let base = &self.shared.opts.boot_url;
        let http = reqwest::Client::builder()
            .local_address(source_of(self.index))
            .timeout(Duration::from_secs(30))
            .no_proxy()
            .build()
            .map_err(|e| format!("HTTP client: {e}"))?;
        let script = self
            .get(
                &http,
                &format!("{base}/ipxe/{}", self.mac.replace(':', "-")),
            )
            .await?;
        self.shared.counters.scripts.fetch_add(1, Ordering::Relaxed);
        let Some(seed) = script
            .split_whitespace()
            .find_map(|w| w.strip_prefix("ds=nocloud-net;s="))
        else {
            // An exit script: the firmware falls through to the disk, which is empty here.
            return Err("no provisioning script".into());
        };
        let meta = self.get(&http, &format!("{seed}meta-data")).await?;
        let user = self.get(&http, &format!("{seed}user-data")).await?;
        let vendor = self.get(&http, &format!("{seed}vendor-data")).await?;
        tokio::time::sleep(self.shared.opts.os_delay).await;
        if !self.current(generation) || self.fault == Fault::NoCallback {
            return Ok(());
        }
        let meta: Value = serde_yaml::from_str(&meta).map_err(|e| format!("meta-data: {e}"))?;
        let hostname = meta
            .get("local-hostname")
            .and_then(Value::as_str)
            .unwrap_or(&self.name)
            .to_string();
        let provider_id = meta
            .get("provider-id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if let Some((apiserver, token)) = kubelet_env(&user) {
            self.register_node(&apiserver, &token, &hostname, &provider_id)
                .await?;
        }
        let callback = callback_url(&vendor).ok_or("no callback URL in the vendor-data")?;
        let body = json!({"hostname": hostname, "addresses": [address_of(self.index)]});
        for attempt in 0..5u32 {
            if !self.current(generation) {
                return Ok(());
            }
            let r = http.post(&callback).json(&body).send().await;
            match r {
                Ok(r) if r.status().is_success() => {
                    let mut st = self.lock();
                    st.called_back = true;
                    st.callback_at = Some(std::time::Instant::now());
                    drop(st);
                    self.shared
                        .counters
                        .callbacks
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Ok(r) if r.status().is_client_error() => {
                    return Err(format!("callback refused: {}", r.status()));
                }
                _ => tokio::time::sleep(Duration::from_millis(500 * (1 << attempt))).await,
            }
        }
        Err("callback failed".into())
    }

    /// What the lab OS's kubelet stand-in does: create the Node with the provider ID, Ready.
    async fn register_node(
        &self,
        apiserver: &str,
        token: &str,
        hostname: &str,
        provider_id: &str,
    ) -> Result<(), String> {
        let now = jiff::Timestamp::now().to_string();
        let node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": hostname, "labels": {"kubernetes.io/hostname": hostname, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
            "spec": {"providerID": provider_id, "taints": [{"key": "node.cluster.x-k8s.io/uninitialized", "effect": "NoSchedule"}]},
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "metalboot simulated host", "lastHeartbeatTime": now, "lastTransitionTime": now}],
                "addresses": [{"type": "InternalIP", "address": address_of(self.index)}, {"type": "Hostname", "address": hostname}],
                "nodeInfo": {"machineID": self.uuid, "systemUUID": self.uuid, "bootID": self.uuid, "kernelVersion": "simulated", "osImage": "metalboot simulated host", "containerRuntimeVersion": "none://0", "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
            },
        });
        let r = self
            .shared
            .http
            .post(format!("{apiserver}/api/v1/nodes"))
            .bearer_auth(token)
            .json(&node)
            .send()
            .await
            .map_err(|e| format!("registering the Node: {e}"))?;
        // 409: the Node is there from an earlier boot of this host; the kubelet carries on.
        if r.status().is_success() || r.status().as_u16() == 409 {
            self.shared.counters.nodes.fetch_add(1, Ordering::Relaxed);
            Ok(())
        } else {
            Err(format!("registering the Node: {}", r.status()))
        }
    }
}

/// `APISERVER` and `TOKEN` from the `/etc/metalboot/kubelet.env` a lab user-data writes.
fn kubelet_env(user_data: &str) -> Option<(String, String)> {
    let doc: Value = serde_yaml::from_str(user_data).ok()?;
    let file =
        doc.get("write_files")?.as_array()?.iter().find(|f| {
            f.get("path").and_then(Value::as_str) == Some("/etc/metalboot/kubelet.env")
        })?;
    let raw = file.get("content")?.as_str()?;
    let content = match file.get("encoding").and_then(Value::as_str) {
        Some("b64" | "base64") => {
            use base64::Engine;
            String::from_utf8(
                base64::engine::general_purpose::STANDARD
                    .decode(raw.trim())
                    .ok()?,
            )
            .ok()?
        }
        _ => raw.to_string(),
    };
    let var = |name: &str| {
        content.lines().find_map(|l| {
            l.strip_prefix(name)
                .and_then(|v| v.strip_prefix('='))
                .map(|v| v.trim().to_string())
        })
    };
    Some((var("APISERVER")?, var("TOKEN")?))
}

/// The callback URL in metalboot's vendor-data script (`url='…'`).
fn callback_url(vendor_data: &str) -> Option<String> {
    vendor_data.lines().find_map(|l| {
        l.trim()
            .strip_prefix("url='")
            .and_then(|v| v.strip_suffix('\''))
            .map(str::to_string)
    })
}

/// The fleet's counters at one moment.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct FleetStats {
    pub hosts: u32,
    pub powered_on: u32,
    pub called_back: u32,
    pub bmc_requests: u64,
    /// The most requests one host's BMC had in flight at once.
    pub bmc_max_in_flight: u32,
    pub power_actions: u64,
    pub network_boots: u64,
    pub scripts: u64,
    pub callbacks: u64,
    pub nodes: u64,
    pub boot_errors: u64,
    /// Power actions a host got after its accepted callback, outside a release: must stay 0.
    pub actions_after_callback: u64,
}

pub struct Fleet {
    pub hosts: Vec<Arc<SimHost>>,
    shared: Arc<Shared>,
}

impl Fleet {
    pub fn new(opts: FleetOptions) -> Result<Fleet, reqwest::Error> {
        // Many hosts, one loopback: keep connections bounded and reused.
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .timeout(Duration::from_secs(30))
            .no_proxy()
            .build()?;
        let shared = Arc::new(Shared {
            boots: tokio::sync::Semaphore::new(opts.concurrent_boots.max(1)),
            opts,
            http,
            counters: Counters::default(),
            releasing: AtomicBool::new(false),
        });
        let hosts = (0..shared.opts.hosts)
            .map(|i| {
                Arc::new(SimHost {
                    index: i,
                    name: format!("lab-host-{i}"),
                    mac: mac_of(i),
                    uuid: format!("6d62a1b0-0000-4000-8000-{i:012x}"),
                    fault: fault_of(i, &shared.opts.faults),
                    state: Mutex::new(SimState::default()),
                    in_flight: AtomicU32::new(0),
                    shared: shared.clone(),
                })
            })
            .collect();
        Ok(Fleet { hosts, shared })
    }

    pub fn systems(&self) -> Vec<LabSystem> {
        self.hosts
            .iter()
            .map(|h| LabSystem::Simulated(h.clone()))
            .collect()
    }

    /// From now on power actions are expected: the Machines are being deleted.
    pub fn releasing(&self, releasing: bool) {
        self.shared.releasing.store(releasing, Ordering::Relaxed);
    }

    pub fn stats(&self) -> FleetStats {
        let c = &self.shared.counters;
        let (mut powered_on, mut called_back) = (0, 0);
        for h in &self.hosts {
            let st = h.lock();
            powered_on += u32::from(st.power_on);
            called_back += u32::from(st.called_back);
        }
        FleetStats {
            hosts: self.shared.opts.hosts,
            powered_on,
            called_back,
            bmc_requests: c.bmc_requests.load(Ordering::Relaxed),
            bmc_max_in_flight: c.bmc_max_in_flight.load(Ordering::Relaxed),
            power_actions: c.power_actions.load(Ordering::Relaxed),
            network_boots: c.network_boots.load(Ordering::Relaxed),
            scripts: c.scripts.load(Ordering::Relaxed),
            callbacks: c.callbacks.load(Ordering::Relaxed),
            nodes: c.nodes.load(Ordering::Relaxed),
            boot_errors: c.boot_errors.load(Ordering::Relaxed),
            actions_after_callback: c.actions_after_callback.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_spread_in_the_asked_shares() {
        let shares = FaultShares {
            no_callback: 0.1,
            bmc_errors: 0.05,
            slow_bmc: 0.2,
            slow_bmc_delay: Duration::from_millis(300),
        };
        let n = 10_000;
        let count = |f: &dyn Fn(Fault) -> bool| (0..n).filter(|&i| f(fault_of(i, &shares))).count();
        let near = |got: usize, share: f64| (got as f64 - share * n as f64).abs() < 0.02 * n as f64;
        assert!(near(count(&|f| f == Fault::NoCallback), 0.1));
        assert!(near(count(&|f| f == Fault::BmcErrors), 0.05));
        assert!(near(count(&|f| matches!(f, Fault::SlowBmc(_))), 0.2));
        assert_eq!(
            (0..n)
                .filter(|&i| fault_of(i, &FaultShares::default()) != Fault::None)
                .count(),
            0
        );
    }

    #[test]
    fn the_bootstrap_data_a_simulated_host_reads() {
        let user = "#cloud-config\nwrite_files:\n- path: /etc/other\n  content: x\n- path: /etc/metalboot/kubelet.env\n  permissions: '0600'\n  encoding: b64\n  content: QVBJU0VSVkVSPWh0dHA6Ly8xMjcuMC4wLjE6OTk5OQpUT0tFTj1zZWNyZXQK\nruncmd:\n- set -e\n";
        assert_eq!(
            kubelet_env(user),
            Some(("http://127.0.0.1:9999".into(), "secret".into()))
        );
        assert_eq!(kubelet_env("#cloud-config\nruncmd: []\n"), None);
        assert_eq!(kubelet_env("not: [yaml"), None);
        let vendor = "#!/bin/sh\nsentinel=/run/x\nurl='http://127.0.0.1:8080/callback/abc'\n(\n";
        assert_eq!(
            callback_url(vendor).as_deref(),
            Some("http://127.0.0.1:8080/callback/abc")
        );
        assert_eq!(callback_url("#!/bin/sh\n"), None);
    }
}

//! Kill and restart: a real `metalboot manager` process is SIGKILLed at random points while five
//! hosts provision (sushy-tools BMCs behind a recording proxy, the real boot service, the test
//! playing each host and its kubelet). Afterwards every Machine is Running, no host was ever
//! claimed by two consumers, and no host saw more than one extra power action at its BMC.
//!
//! Cycles: `METALBOOT_SOAK_CYCLES` (default 20), e.g.
//! `METALBOOT_SOAK_CYCLES=50 cargo test --test soak -- --nocapture`.

mod support;

#[path = "support/faultproxy.rs"]
mod faultproxy;
#[path = "support/hostlab.rs"]
mod hostlab;
#[path = "support/sushy.rs"]
mod sushy;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use metalboot::api::capi::Machine;
use metalboot::api::metalhost::PowerState;
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::bmc::Bmc;
use rand::Rng;
use serde_json::json;

const HOSTS: usize = 5;

fn cycles() -> usize {
    std::env::var("METALBOOT_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

fn free_port() -> SocketAddr {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("free port")
}

/// `metalboot manager` as operators run it, always on the same boot address (as behind a Service).
fn start_manager(ns: &str, boot: SocketAddr, log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args(["--log-format", "text", "manager", "--kubeconfig"])
        .arg(&support::control_plane().kubeconfig_path)
        .args([
            "--namespace",
            ns,
            "--no-tftp",
            "--dhcp",
            "off",
            "--standalone",
            "true",
        ])
        .args(["--boot-http-bind", &boot.to_string()])
        .args(["--power-poll-seconds", "10", "--graceful-off-seconds", "5"])
        .env("RUST_LOG", "info,metalboot=debug,kube_runtime=warn")
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .expect("start metalboot manager")
}

fn sigkill(child: &mut Child) {
    let _ = child.kill(); // SIGKILL
    let _ = child.wait();
}

/// What the test saw of the claims: every consumer each host ever named.
type Claims = Arc<Mutex<BTreeMap<String, BTreeSet<String>>>>;

fn record_claims(client: kube::Client, ns: &str) -> Claims {
    let claims: Claims = Arc::default();
    let record = claims.clone();
    let api: Api<MetalHost> = Api::namespaced(client, ns);
    tokio::spawn(async move {
        let mut hosts = watcher(api, watcher::Config::default())
            .applied_objects()
            .boxed();
        while let Some(Ok(host)) = hosts.next().await {
            let name = host.metadata.name.clone().unwrap_or_default();
            if let (Some(consumer), Ok(mut claims)) = (host.spec.consumer_ref, record.lock()) {
                claims
                    .entry(name)
                    .or_default()
                    .insert(format!("{}/{}", consumer.namespace, consumer.name));
            }
        }
    });
    claims
}

/// The host's side: it boots once per power action its BMC received, as firmware would, and
/// retries the boot service until it answers (iPXE's retry loop), which matters while the manager
/// is down. A provisioning script leads to the bootstrap-success callback.
struct Player {
    base: String,
    http: reqwest::Client,
}

#[derive(Debug, PartialEq)]
enum Boot {
    /// The boot service answered with a script that does not provision (idle, or local disk).
    Idle,
    /// Provisioned: the callback answered this status.
    CalledBack(u16),
}

impl Player {
    async fn boot(&self, mac: &str) -> Result<Boot, String> {
        let script = self
            .http
            .get(format!("{}/ipxe/{}", self.base, mac.replace(':', "-")))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !script.status().is_success() {
            return Err(format!("script: {}", script.status()));
        }
        let script = script.text().await.map_err(|e| e.to_string())?;
        let Some(seed) = script
            .split_whitespace()
            .find_map(|w| w.strip_prefix("ds=nocloud-net;s="))
        else {
            return Ok(Boot::Idle);
        };
        let callback = seed
            .replace("/nocloud/", "/callback/")
            .trim_end_matches('/')
            .to_string();
        let answer = self
            .http
            .post(&callback)
            .body("{}")
            .send()
            .await
            .map_err(|e| e.to_string())?;
        Ok(Boot::CalledBack(answer.status().as_u16()))
    }
}

#[tokio::test]
async fn sigkill_at_random_points_while_five_hosts_provision() {
    let lab = hostlab::lab("soak", HOSTS as u8).await;
    for i in 0..HOSTS {
        lab.host(i).await;
    }
    let claims = record_claims(lab.ns.client.clone(), &lab.ns.name);
    // The workload cluster is this apiserver: the Machine controller finds Nodes here.
    support::create_workload_kubeconfig(
        &lab.ns.client,
        &lab.ns.name,
        "c1",
        &support::control_plane().kubeconfig_path,
    )
    .await;

    let boot = free_port();
    let player = Arc::new(Player {
        base: format!("http://{boot}"),
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("http"),
    });
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut hosts = Vec::new();
    for i in 0..HOSTS {
        let (player, done) = (player.clone(), done.clone());
        let bmc = lab.bmc(i);
        let mac = lab.sushy.systems[i].macs[0].clone();
        let actions = format!("{}/Actions", lab.sushy.system_path(i));
        let proxy = lab.proxy.log_handle();
        hosts.push(tokio::spawn(async move {
            let mut booted = 0;
            let mut answers = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let powered = proxy.count("POST", &actions);
                let on = bmc.power_state().await.ok() == Some(PowerState::On);
                if powered > booted
                    && on
                    && let Ok(answer) = player.boot(&mac).await
                {
                    answers.push((std::time::Instant::now(), answer));
                    booted = powered;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            answers
        }));
    }
    let kubelet = tokio::spawn(play_kubelets(
        lab.ns.client.clone(),
        lab.ns.name.clone(),
        done.clone(),
    ));

    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("manager.log");
    let cycles = cycles();
    let mut uptimes = Vec::new();
    let mut kills = Vec::new();
    let mut machines_made = 0;
    for cycle in 0..cycles {
        // Machines arrive spread over the run, so kills land in every phase of provisioning.
        while machines_made < HOSTS && machines_made * cycles.max(1) <= cycle * HOSTS {
            lab.machine(&format!("m{machines_made}"), None, None).await;
            machines_made += 1;
        }
        let mut manager = start_manager(&lab.ns.name, boot, &log);
        let uptime = Duration::from_millis(rand::rng().random_range(200..5000));
        uptimes.push(uptime);
        // The kill point: a random moment of this run, not a wait for a result.
        tokio::time::sleep(uptime).await;
        sigkill(&mut manager);
        kills.push(std::time::Instant::now());
    }
    for late in machines_made..HOSTS {
        lab.machine(&format!("m{late}"), None, None).await;
    }
    let mut manager = start_manager(&lab.ns.name, boot, &log);

    let machines: Api<Machine> = Api::namespaced(lab.ns.client.clone(), &lab.ns.name);
    let running = support::eventually_or("every Machine Running", 300, || async {
        let list = machines.list(&Default::default()).await.ok()?;
        let running = list
            .items
            .iter()
            .filter(|m| m.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count();
        (running == HOSTS).then_some(())
    })
    .await;
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    sigkill(&mut manager);
    let mut answers = Vec::new();
    for host in hosts {
        answers.push(host.await.expect("host player"));
    }
    let _ = kubelet.await;
    let manager_log = std::fs::read_to_string(&log).unwrap_or_default();
    if running.is_none() {
        let phases: Vec<_> = machines
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .into_iter()
                    .map(|m| (m.metadata.name, m.status.and_then(|s| s.phase)))
                    .collect()
            })
            .unwrap_or_default();
        let lines: Vec<&str> = manager_log.lines().collect();
        panic!(
            "not every Machine is Running: {phases:?}\nmanager log (tail):\n{}",
            lines[lines.len().saturating_sub(60)..].join("\n")
        );
    }

    let power_actions: Vec<usize> = (0..HOSTS)
        .map(|i| {
            lab.proxy
                .count("POST", &format!("{}/Actions", lab.sushy.system_path(i)))
        })
        .collect();
    let claims = claims.lock().expect("claims").clone();
    let total: Duration = uptimes.iter().sum();
    // How many kills each host's provisioning lived through (before its accepted callback).
    let kills_during: Vec<usize> = answers
        .iter()
        .map(|boots| {
            let accepted = boots
                .iter()
                .find(|(_, b)| *b == Boot::CalledBack(200))
                .map(|(at, _)| *at);
            kills
                .iter()
                .filter(|k| accepted.is_none_or(|a| **k < a))
                .count()
        })
        .collect();
    let boots: Vec<Vec<&Boot>> = answers
        .iter()
        .map(|b| b.iter().map(|(_, b)| b).collect())
        .collect();
    println!(
        "{cycles} SIGKILLs after {:.1?} of uptime on average; kills before each host's accepted callback: \
         {kills_during:?}; power actions per host at the BMC: {power_actions:?}; \
         boots played per host: {boots:?}; consumers per host: {claims:?}",
        total / u32::try_from(cycles.max(1)).unwrap_or(1)
    );
    let mut consumers = BTreeSet::new();
    for (host, seen) in &claims {
        assert_eq!(seen.len(), 1, "{host} was claimed by {seen:?}");
        consumers.extend(seen.iter().cloned());
    }
    assert_eq!(
        (claims.len(), consumers.len()),
        (HOSTS, HOSTS),
        "each host claimed, each by its own Machine: {claims:?}"
    );
    for (i, actions) in power_actions.iter().enumerate() {
        assert!(
            (1..=2).contains(actions),
            "host-{i}: {actions} power actions at its BMC (one, plus at most one extra)"
        );
    }
    let nodes: Api<Node> = Api::all(lab.ns.client.clone());
    for i in 0..HOSTS {
        let _ = nodes
            .delete(&format!("{}-m{i}", lab.ns.name), &DeleteParams::default())
            .await;
    }
}

/// Each Machine's kubelet: once its MetalMachine has a providerID, a Ready Node with that ID.
async fn play_kubelets(client: kube::Client, ns: String, done: Arc<std::sync::atomic::AtomicBool>) {
    let metal_machines: Api<MetalMachine> = Api::namespaced(client.clone(), &ns);
    let nodes: Api<Node> = Api::all(client);
    let mut joined = BTreeSet::new();
    while !done.load(std::sync::atomic::Ordering::Relaxed) {
        for mm in metal_machines
            .list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let (Some(name), Some(provider_id)) = (mm.metadata.name, mm.spec.provider_id) else {
                continue;
            };
            let node = format!("{ns}-{name}");
            if joined.contains(&node) {
                continue;
            }
            let object: Node = serde_json::from_value(json!({
                "metadata": {"name": node},
                "spec": {"providerID": provider_id},
            }))
            .expect("node");
            let created = nodes.create(&PostParams::default(), &object).await;
            let ready = nodes
                .patch_status(
                    &node,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"conditions": [
                        {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "played",
                         "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
                )
                .await;
            if created.is_ok() && ready.is_ok() {
                joined.insert(node);
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

//! The simulated fleet end to end at N = 50 (so the fleet `make bench-scale` measures cannot rot):
//! the real apiserver, metalboot's manager with its standalone controllers, the lab's virtual
//! BMC serving 50 simulated hosts, each of which network-boots through the real boot service,
//! registers its Node and calls back. All Machines reach Running; no host that called back gets
//! a power action afterwards; deleting the Machines powers every host off and frees it.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::WatchStreamExt;
use metalboot::api::capi::Machine;
use metalboot::api::metalhost::HostState;
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::lab::fleet::{FaultShares, Fleet, FleetOptions};
use metalboot::lab::objects::LabObjects;
use metalboot::lab::vbmc::{VirtualBmc, serve_on_loopback};

const N: u32 = 50;

fn count<'a>(items: impl Iterator<Item = &'a str>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for i in items {
        *m.entry(i.to_string()).or_default() += 1;
    }
    m
}

fn manager_options(namespace: &str) -> metalboot::manager::ManagerOptions {
    metalboot::manager::ManagerOptions {
        namespace: Some(namespace.to_string()),
        boot_http: "127.0.0.1:0".parse().expect("addr"),
        // Short, so the settle window below sees a poll of every host.
        power_poll_interval: Duration::from_secs(10),
        ..Default::default()
    }
}

/// What a set of watches saw from the moment they started (their first lists included): every
/// object whose status went back, and the last resourceVersion of each object.
#[derive(Default)]
struct Recorder {
    went_back: std::sync::Mutex<Vec<String>>,
    versions: std::sync::Mutex<BTreeMap<String, String>>,
}

impl Recorder {
    /// Watches `api`, noting each object for which `went_back` says how its status went back.
    fn watch<K>(
        self: &Arc<Self>,
        api: Api<K>,
        kind: &'static str,
        went_back: impl Fn(&K) -> Option<String> + Send + 'static,
    ) where
        K: kube::Resource
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug
            + Send
            + Sync
            + 'static,
    {
        use futures::StreamExt;
        use kube::runtime::watcher;
        let recorder = self.clone();
        let mut stream = watcher(api, watcher::Config::default())
            .default_backoff()
            .applied_objects()
            .boxed();
        tokio::spawn(async move {
            while let Some(item) = stream.next().await {
                // A watch error is retried by the backoff; recording goes on.
                let Ok(object) = item else { continue };
                let name = format!("{kind} {}", object.name_any());
                if let Some(what) = went_back(&object)
                    && let Ok(mut v) = recorder.went_back.lock()
                {
                    v.push(format!("{name}: {what}"));
                }
                if let Ok(mut versions) = recorder.versions.lock() {
                    versions.insert(name, object.resource_version().unwrap_or_default());
                }
            }
        });
    }

    /// Whether the watches have seen every object of `kind` at (at least) the version listed.
    fn has_seen<K: kube::Resource>(&self, kind: &str, listed: &[K]) -> bool {
        let Ok(versions) = self.versions.lock() else {
            return false;
        };
        listed.iter().all(|o| {
            versions.get(&format!("{kind} {}", o.name_any())) == o.resource_version().as_ref()
        })
    }
}

/// The names of every object `api` lists now.
async fn names_of<K>(api: &Api<K>) -> Vec<String>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(&ListParams::default())
        .await
        .expect("list")
        .items
        .iter()
        .map(|o| o.name_any())
        .collect()
}

/// Records every Machine seen out of Running, every MetalMachine seen not ready or not
/// Provisioned, every MetalHost seen out of Provisioned and every MetalCluster seen not ready.
fn record_status_regressions(
    machines: &Api<Machine>,
    metal_machines: &Api<MetalMachine>,
    hosts: &Api<MetalHost>,
) -> Arc<Recorder> {
    let recorder = Arc::new(Recorder::default());
    recorder.watch(machines.clone(), "Machine", |m: &Machine| {
        let phase = m.status.as_ref().and_then(|s| s.phase.clone());
        (phase.as_deref() != Some("Running")).then(|| format!("phase {phase:?}"))
    });
    recorder.watch(
        metal_machines.clone(),
        "MetalMachine",
        |mm: &MetalMachine| {
            let status = mm.status.clone().unwrap_or_default();
            let phase = format!("{:?}", status.phase);
            (!status.ready || phase != "Some(Provisioned)")
                .then(|| format!("ready={} phase {phase}", status.ready))
        },
    );
    recorder.watch(hosts.clone(), "MetalHost", |h: &MetalHost| {
        let state = h.status.as_ref().and_then(|s| s.state);
        (state != Some(HostState::Provisioned)).then(|| format!("state {state:?}"))
    });
    recorder.watch(
        Api::<metalboot::api::MetalCluster>::namespaced(
            hosts.clone().into_client(),
            hosts.namespace().unwrap_or("default"),
        ),
        "MetalCluster",
        |c: &metalboot::api::MetalCluster| {
            (!c.status.as_ref().is_some_and(|s| s.ready)).then(|| "not ready".to_string())
        },
    );
    recorder
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_simulated_hosts_provision_and_release_without_a_reset_after_their_callback() {
    metalboot::telemetry::init(
        metalboot::telemetry::LogFormat::Text,
        Some("warn,kube_runtime=error"),
    );
    let ns = support::namespace("fleet").await;
    support::boot::install_crds(&ns.client).await;
    let manager = metalboot::manager::start(ns.client.clone(), manager_options(&ns.name))
        .await
        .expect("manager starts");

    // The lab's plain-HTTP relay to the apiserver, for the hosts' kubelet stand-in.
    let plane = support::control_plane();
    let relay_url =
        metalboot::lab::relay::serve_on_loopback(plane.server.clone(), plane.ca_pem.clone())
            .await
            .expect("relay");

    let fleet = Fleet::new(FleetOptions {
        hosts: N,
        boot_url: manager.base_url.clone(),
        boot_delay: Duration::from_millis(200),
        os_delay: Duration::from_millis(200),
        faults: FaultShares::default(),
        concurrent_boots: 16,
    })
    .expect("fleet");
    let password = "fleet-bmc-password";
    let bmc = Arc::new(VirtualBmc::with_systems(
        fleet.systems(),
        "admin".into(),
        password.into(),
    ));
    let bmc_port = serve_on_loopback(bmc).await.expect("serving the BMC");
    let bmc_url = format!("redfish+http://127.0.0.1:{bmc_port}");

    let objects = LabObjects {
        client: ns.client.clone(),
        namespace: ns.name.clone(),
        endpoint: ("127.0.0.1".into(), 6443),
        kubeconfig: serde_yaml::to_string(&plane.kubeconfig).expect("kubeconfig"),
        kubelet_apiserver: relay_url,
        boot_timeout_seconds: 300,
        boot_url: manager.base_url.clone(),
        image: None,
        kubeadm: false,
    };
    objects
        .base(&[("lab-bmc", password)])
        .await
        .expect("base objects");
    for h in &fleet.hosts {
        let address = format!("{bmc_url}/redfish/v1/Systems/{}", h.name);
        objects
            .host(h.index, (&address, "lab-bmc"), false, "simulated host")
            .await
            .expect("MetalHost");
    }
    let hosts: Api<MetalHost> = Api::namespaced(ns.client.clone(), &ns.name);
    let machines: Api<Machine> = Api::namespaced(ns.client.clone(), &ns.name);
    let metal_machines: Api<MetalMachine> = Api::namespaced(ns.client.clone(), &ns.name);
    let host_states = || async {
        let list = hosts.list(&ListParams::default()).await.ok()?;
        Some(
            list.items
                .iter()
                .map(|h| {
                    format!(
                        "{:?}",
                        h.status.as_ref().and_then(|s| s.state).unwrap_or_default()
                    )
                })
                .collect::<Vec<_>>(),
        )
    };
    support::eventually("all 50 MetalHosts Available", 180, || async {
        let states = host_states().await?;
        (states.len() == N as usize && states.iter().all(|s| s == "Available")).then_some(())
    })
    .await;

    for i in 0..N {
        objects.machine(i).await.expect("Machine");
    }
    let phases = support::eventually_or("all 50 Machines Running", 420, || async {
        let list = machines.list(&ListParams::default()).await.ok()?;
        let phases: Vec<String> = list
            .items
            .iter()
            .map(|m| {
                m.status
                    .as_ref()
                    .and_then(|s| s.phase.clone())
                    .unwrap_or_default()
            })
            .collect();
        (phases.len() == N as usize && phases.iter().all(|p| p == "Running")).then_some(phases)
    })
    .await;
    let stats = fleet.stats();
    if phases.is_none() {
        let list = machines.list(&ListParams::default()).await.expect("list");
        panic!(
            "not every Machine Running: {:?}; fleet {stats:?}",
            count(list.items.iter().map(|m| {
                m.status
                    .as_ref()
                    .and_then(|s| s.phase.as_deref())
                    .unwrap_or("-")
            }))
        );
    }
    eprintln!("provisioned: {stats:?}");
    assert_eq!(stats.callbacks, u64::from(N), "{stats:?}");
    assert_eq!(stats.nodes, u64::from(N), "{stats:?}");
    assert_eq!(stats.called_back, N, "{stats:?}");
    // Every MetalMachine is ready and names its own host.
    let mms = metal_machines
        .list(&ListParams::default())
        .await
        .expect("list");
    let claimed = count(mms.items.iter().filter_map(|mm| {
        mm.status
            .as_ref()
            .and_then(|s| s.host_ref.as_ref())
            .map(|r| r.name.as_str())
    }));
    assert_eq!(claimed.len(), N as usize, "each host claimed once");
    assert!(claimed.values().all(|&c| c == 1));

    // Settle: the controllers keep running for a while after the last Running (status writes,
    // the next power poll); any power action at a host that called back is the bug.
    let resource_version = machines
        .list(&ListParams::default())
        .await
        .expect("list")
        .metadata
        .resource_version
        .unwrap_or_default();
    support::eventually(
        "the manager's power poll of every host after Running",
        60,
        || async {
            let s = fleet.stats();
            (s.bmc_requests >= stats.bmc_requests + u64::from(N)).then_some(())
        },
    )
    .await;
    let settled = fleet.stats();
    eprintln!("settled (Machines at resourceVersion {resource_version}): {settled:?}");
    assert_eq!(
        settled.actions_after_callback, 0,
        "a host that called back got a power action: {settled:?}"
    );
    assert_eq!(settled.network_boots, u64::from(N), "one boot per host");
    assert!(
        settled.bmc_max_in_flight <= 1,
        "more than one request at once at one BMC: {settled:?}"
    );

    // Restart: the new manager's passes decide nothing from stores that have not listed yet. No
    // Machine leaves Running, no MetalMachine stops being ready or Provisioned, no MetalHost
    // leaves Provisioned, no host is touched.
    let recorder = record_status_regressions(&machines, &metal_machines, &hosts);
    // Each object's finished passes, by the manager's own count.
    let passes = |controller: &str, names: &[String]| {
        names
            .iter()
            .map(|n| metalboot::metrics::passes_of(controller, &format!("{}/{n}", ns.name)))
            .collect::<Vec<u64>>()
    };
    let machine_names = names_of(&machines).await;
    let mm_names = names_of(&metal_machines).await;
    let host_names = names_of(&hosts).await;
    let before = [
        passes("machine", &machine_names),
        passes("metalmachine", &mm_names),
        passes("metalhost", &host_names),
    ];
    drop(manager);
    let manager = metalboot::manager::start(ns.client.clone(), manager_options(&ns.name))
        .await
        .expect("manager restarts");
    support::eventually(
        "every Machine, MetalMachine and MetalHost passed by the restarted manager",
        120,
        || async {
            let after = [
                passes("machine", &machine_names),
                passes("metalmachine", &mm_names),
                passes("metalhost", &host_names),
            ];
            let all_passed = after
                .iter()
                .zip(&before)
                .all(|(a, b)| a.iter().zip(b).all(|(a, b)| a > b));
            all_passed.then_some(())
        },
    )
    .await;
    // Whatever those passes wrote has reached the recording watches: each has seen every object
    // at the version a list after the passes shows.
    support::eventually("the recording watches caught up", 60, || async {
        let m = machines.list(&ListParams::default()).await.ok()?.items;
        let mm = metal_machines
            .list(&ListParams::default())
            .await
            .ok()?
            .items;
        let h = hosts.list(&ListParams::default()).await.ok()?.items;
        (recorder.has_seen("Machine", &m)
            && recorder.has_seen("MetalMachine", &mm)
            && recorder.has_seen("MetalHost", &h))
        .then_some(())
    })
    .await;
    let restarted = fleet.stats();
    assert_eq!(
        restarted.actions_after_callback, 0,
        "the restart touched a host that called back: {restarted:?}"
    );
    let went_back = recorder
        .went_back
        .lock()
        .map(|v| v.clone())
        .unwrap_or_default();
    assert!(
        went_back.is_empty(),
        "status went back after the restart: {went_back:?}"
    );

    // Release: every Machine deleted → every host powered off and Available again.
    fleet.releasing(true);
    for m in machines
        .list(&ListParams::default())
        .await
        .expect("list")
        .items
    {
        machines
            .delete(&m.name_any(), &DeleteParams::default())
            .await
            .expect("delete Machine");
    }
    support::eventually(
        "every Machine gone and every host Available",
        300,
        || async {
            let left = machines
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .len();
            let states = host_states().await?;
            (left == 0 && states.iter().all(|s| s == "Available")).then_some(())
        },
    )
    .await;
    let released = fleet.stats();
    eprintln!("released: {released:?}");
    assert_eq!(
        released.powered_on, 0,
        "every host powered off: {released:?}"
    );
    let hs = hosts.list(&ListParams::default()).await.expect("list");
    assert!(
        hs.items.iter().all(|h| h.spec.consumer_ref.is_none()
            && h.status.as_ref().and_then(|s| s.state) == Some(HostState::Available)),
        "every host free"
    );
    drop(manager);
}

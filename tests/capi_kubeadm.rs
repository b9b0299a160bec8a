//! Upstream Cluster API joins a real node (issue 16): upstream core and upstream's kubeadm
//! bootstrap provider (CABPK), both built from the pinned release and installed by the real
//! `clusterctl init` beside metalboot, drive a MachineDeployment whose Machines use a
//! `KubeadmConfigTemplate`, as an operator writes it. metalboot (infrastructure and bootstrap
//! providers, no standalone controllers) claims a QEMU host behind the lab's virtual BMC, powers it
//! on over Redfish for a network boot, and real iPXE boots the lab's live Debian. Its real
//! cloud-init runs CABPK's own cloud-config (jinja: node name and `--provider-id` from metalboot's
//! meta-data), the real kubeadm joins, the real kubelet on containerd registers the Node, and
//! metalboot's vendor-data sees CABPK's sentinel and calls back.
//!
//! The cluster is what `clusterctl generate cluster --flavor kubeadm-workers` renders from
//! metalboot's shipped flavor. Its control plane is the test's own join-ready apiserver (etcd,
//! kube-apiserver, kube-controller-manager; the `kubeadm init` phases made its tokens' RBAC and
//! `cluster-info`), which Cluster API does not manage: the flavor's `ExistingControlPlane`, which
//! metalboot reports initialized once the test wrote `<cluster>-ca` and `<cluster>-kubeconfig`.
//! The guest reaches the boot service and the apiserver, both on loopback, as 10.0.2.2 over QEMU's
//! user-mode network, which the test makes itself.

#[path = "support/capi.rs"]
mod capi;
#[path = "support/kubeadm.rs"]
mod kubeadm;
#[path = "support/rig.rs"]
mod rig;
mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Node, Secret};
use kube::ResourceExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use metalboot::api::metalhost::{HostState, PowerState};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::lab::upstream;
use metalboot::manager::Controllers;
use serde_json::{Value, json};

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn has_uninitialized_taint(node: &Node) -> bool {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|ts| {
            ts.iter()
                .any(|t| t.key == "node.cluster.x-k8s.io/uninitialized")
        })
}

/// A condition of an upstream object's `status.conditions`, by type.
fn condition<'a>(object: &'a DynamicObject, type_: &str) -> Option<&'a Value> {
    object.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// The cluster as an operator gets it: `clusterctl generate cluster --flavor kubeadm-workers`
/// from metalboot's shipped flavor, for one live-booted worker joining the test's apiserver.
fn generate_cluster(
    mgmt: &capi::Management,
    ns: &str,
    endpoint_port: u16,
    boot_base: &str,
    discovery_seconds: u32,
    boot_timeout_seconds: u32,
) -> String {
    let boot = rig::live_boot(boot_base);
    let cmdline = boot.cmdline.unwrap_or_default();
    let port = endpoint_port.to_string();
    let discovery = discovery_seconds.to_string();
    let timeout = boot_timeout_seconds.to_string();
    let initrd = boot.initrds.join(",");
    mgmt.clusterctl.run(
        &[
            "generate",
            "cluster",
            "c1",
            "--infrastructure",
            "metalboot",
            "--flavor",
            "kubeadm-workers",
            "--target-namespace",
            ns,
            "--kubernetes-version",
            &kubeadm::kubernetes_version(),
            "--worker-machine-count",
            "1",
        ],
        &[
            ("CONTROL_PLANE_ENDPOINT_HOST", "10.0.2.2"),
            ("CONTROL_PLANE_ENDPOINT_PORT", &port),
            ("KERNEL_URL", &boot.kernel),
            ("INITRD_URL", &initrd),
            ("KERNEL_CMDLINE", &cmdline),
            ("BOOT_TIMEOUT_SECONDS", &timeout),
            ("BOOT_RETRIES", "0"),
            ("KUBEADM_DISCOVERY_SECONDS", &discovery),
        ],
    )
}

/// A management cluster with upstream core and CABPK, a rack with one worker host, the lab's
/// apiserver declared as the cluster's control plane, and the cluster applied.
struct KubeadmCluster {
    mgmt: capi::Management,
    ns: String,
    rack: rig::Rack,
    /// When the cluster was applied.
    applied: Instant,
}

impl KubeadmCluster {
    async fn start(
        name: &str,
        mac: &str,
        discovery_seconds: u32,
        boot_timeout_seconds: u32,
    ) -> KubeadmCluster {
        let mgmt = capi::Management::start_with(name, true).await;
        let client = mgmt.client.clone();
        kubeadm::prepare_for_joins(&mgmt.plane.kubeconfig_path, &mgmt.plane.server, &client).await;
        let ns = mgmt.namespace(name).await;
        let rack = rig::rack(
            &client,
            &ns,
            mac,
            true,
            Controllers::PROVIDERS,
            &[("metalboot.io/role", "worker")],
        )
        .await;

        let port: u16 = mgmt
            .plane
            .server
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("apiserver port");
        let ca_key = std::fs::read_to_string(mgmt.plane.data_dir.join("pki/ca.key"))
            .expect("the join-ready control plane's CA key");
        let kubeconfig =
            std::fs::read_to_string(&mgmt.plane.kubeconfig_path).expect("admin kubeconfig");
        let cluster_yaml = generate_cluster(
            &mgmt,
            &ns,
            port,
            &format!("http://10.0.2.2:{}", rack.boot_port),
            discovery_seconds,
            boot_timeout_seconds,
        );
        let applied = Instant::now();
        mgmt.apply(&cluster_yaml);
        // What the flavor asks the operator for: the existing control plane's CA and kubeconfig.
        upstream::write_cluster_secrets(
            &client,
            &ns,
            "c1",
            (&mgmt.plane.ca_pem, &ca_key),
            &kubeconfig,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        KubeadmCluster {
            mgmt,
            ns,
            rack,
            applied,
        }
    }

    fn api(&self, r: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.mgmt.client.clone(), &self.ns, r)
    }

    fn machines(&self) -> Api<DynamicObject> {
        self.api(&resource(
            "cluster.x-k8s.io",
            "v1beta2",
            "Machine",
            "machines",
        ))
    }

    fn kubeadm_configs(&self) -> Api<DynamicObject> {
        self.api(&resource(
            "bootstrap.cluster.x-k8s.io",
            "v1beta2",
            "KubeadmConfig",
            "kubeadmconfigs",
        ))
    }

    async fn existing_control_plane(&self) -> Option<DynamicObject> {
        self.api(&resource(
            "controlplane.cluster.x-k8s.io",
            "v1alpha1",
            "ExistingControlPlane",
            "existingcontrolplanes",
        ))
        .get_opt("c1")
        .await
        .ok()
        .flatten()
    }

    async fn machine(&self) -> Option<DynamicObject> {
        self.machines()
            .list(&Default::default())
            .await
            .ok()?
            .items
            .pop()
    }

    async fn metal_machine(&self) -> Option<MetalMachine> {
        Api::<MetalMachine>::namespaced(self.mgmt.client.clone(), &self.ns)
            .list(&Default::default())
            .await
            .ok()?
            .items
            .pop()
    }

    async fn host(&self) -> Option<MetalHost> {
        Api::<MetalHost>::namespaced(self.mgmt.client.clone(), &self.ns)
            .get_opt("host-0")
            .await
            .ok()
            .flatten()
    }

    /// The KubeadmConfig once CABPK rendered its bootstrap data.
    async fn rendered_config(&self) -> Option<DynamicObject> {
        self.kubeadm_configs()
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|c| c.data["status"]["dataSecretName"].is_string())
    }

    async fn diagnostics(&self) -> String {
        let machine = self.machine().await.map(|m| m.data["status"].clone());
        let mm = self.metal_machine().await.map(|m| m.status);
        let host = self.host().await.map(|h| h.status);
        format!(
            "Machine status: {machine:#?}\nMetalMachine status: {mm:#?}\nMetalHost status: {host:#?}\ncore:\n{}\nkubeadm bootstrap:\n{}\nconsole:\n{}",
            self.mgmt.core_log(),
            self.mgmt.kubeadm_bootstrap_log(),
            rig::tail(&rig::console(&self.rack.host), 6000)
        )
    }
}

/// When each milestone was first seen, from `since`.
struct Timeline {
    since: Instant,
    seen: Vec<(&'static str, Duration)>,
}

impl Timeline {
    fn new(since: Instant) -> Timeline {
        Timeline {
            since,
            seen: Vec::new(),
        }
    }

    fn mark(&mut self, what: &'static str, now: bool) {
        if now && !self.seen.iter().any(|(w, _)| *w == what) {
            self.seen.push((what, self.since.elapsed()));
        }
    }

    fn has(&self, what: &str) -> bool {
        self.seen.iter().any(|(w, _)| *w == what)
    }

    fn print(&self, title: &str) {
        println!("{title}");
        for (what, at) in &self.seen {
            println!("  {what:<46} {:>6.1} s", at.as_secs_f64());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cabpk_workers_join_run_and_scale_down_under_upstream_core() {
    let cluster = KubeadmCluster::start("kubeadm-join", "52:54:00:6d:62:30", 300, 1200).await;
    let client = cluster.mgmt.client.clone();
    let nodes: Api<Node> = Api::all(client.clone());
    let mut timeline = Timeline::new(cluster.applied);

    // Up: every milestone recorded as it is first seen, until the Machine is Running with a
    // Ready Node and core took the uninitialized taint off.
    let deadline = Instant::now() + Duration::from_secs(1500);
    let mut running: Option<(DynamicObject, Node)> = None;
    while running.is_none() && Instant::now() < deadline {
        let initialized = cluster
            .existing_control_plane()
            .await
            .is_some_and(|p| p.data["status"]["initialization"]["controlPlaneInitialized"] == true);
        timeline.mark("metalboot: ExistingControlPlane initialized", initialized);
        let config = cluster.rendered_config().await;
        timeline.mark("CABPK rendered the join cloud-config", config.is_some());
        let mm = cluster.metal_machine().await;
        let claimed = mm
            .as_ref()
            .and_then(|m| m.status.as_ref())
            .is_some_and(|s| s.host_ref.is_some());
        timeline.mark("metalboot claimed host-0", claimed);
        let powered = cluster.host().await.is_some_and(|h| {
            h.status
                .is_some_and(|s| s.power_state == Some(PowerState::On))
        });
        timeline.mark("host-0 powered on (Redfish)", claimed && powered);
        let provider_id = mm.as_ref().and_then(|m| m.spec.provider_id.clone());
        timeline.mark("callback: MetalMachine provisioned", provider_id.is_some());
        let machine = cluster.machine().await;
        // The node name comes from metalboot's meta-data (local-hostname: the MetalHost's name).
        let node = nodes.get_opt("host-0").await.ok().flatten();
        timeline.mark("kubelet registered the Node", node.is_some());
        let ready = node.as_ref().is_some_and(node_ready);
        timeline.mark("Node Ready", ready);
        let machine_running = machine.as_ref().is_some_and(|m| {
            m.data["status"]["phase"] == "Running"
                && m.data["status"]["nodeRef"]["name"].is_string()
        });
        timeline.mark("Machine Running, nodeRef set", machine_running);
        let untainted = node.as_ref().is_some_and(|n| !has_uninitialized_taint(n));
        timeline.mark(
            "uninitialized taint removed by core",
            untainted && machine_running,
        );
        if machine_running && ready && untainted {
            running = machine.zip(node);
        } else {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    let Some((machine, node)) = running else {
        timeline.print("up (so far):");
        panic!(
            "the Machine never ran on a Ready Node:\n{}",
            cluster.diagnostics().await
        );
    };
    let provider_id = machine.data["spec"]["providerID"]
        .as_str()
        .expect("providerID")
        .to_string();
    assert!(
        provider_id.starts_with(&format!("metalboot://{}/host-0/", cluster.ns)),
        "{provider_id}"
    );
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
        Some(provider_id.as_str()),
        "the kubelet's --provider-id is the Machine's"
    );
    assert_eq!(
        machine.data["status"]["nodeRef"]["name"],
        node.name_any().as_str()
    );
    // CABPK's data, not a test's: its header, its join configuration and its sentinel.
    let config = cluster.rendered_config().await.expect("KubeadmConfig");
    let data_secret = config.data["status"]["dataSecretName"]
        .as_str()
        .expect("dataSecretName")
        .to_string();
    let user_data = Api::<Secret>::namespaced(client.clone(), &cluster.ns)
        .get(&data_secret)
        .await
        .ok()
        .and_then(|s| s.data)
        .and_then(|d| d.get("value").cloned())
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .unwrap_or_default();
    for piece in [
        "## template: jinja",
        "kubeadm join --config /run/kubeadm/kubeadm-join-config.yaml",
        "/run/cluster-api/bootstrap-success.complete",
        "{{ ds.meta_data.provider_id }}",
    ] {
        assert!(user_data.contains(piece), "CABPK's user-data has {piece:?}");
    }
    let info = node
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .expect("nodeInfo");
    assert_eq!(info.kubelet_version, kubeadm::kubernetes_version());
    assert!(
        info.container_runtime_version.starts_with("containerd://"),
        "{}",
        info.container_runtime_version
    );
    timeline.print("kubeadm worker under upstream core + CABPK (TCG, 2 vCPU, 2 GiB, live Debian), from kubectl apply:");
    println!(
        "Node {}: providerID {provider_id}, kubelet {}, runtime {}",
        node.name_any(),
        info.kubelet_version,
        info.container_runtime_version
    );

    // Down: the MachineDeployment scaled to zero. Core drains the Node through the workload
    // kubeconfig, metalboot powers the host off and releases it, core deletes the Node.
    let node_name = node.name_any();
    let machine_name = machine.name_any();
    let deployments = cluster.api(&resource(
        "cluster.x-k8s.io",
        "v1beta2",
        "MachineDeployment",
        "machinedeployments",
    ));
    let scaled = Instant::now();
    deployments
        .patch(
            "c1-md-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .expect("scale the MachineDeployment to 0");
    let mut down = Timeline::new(scaled);
    let events: Api<Event> = Api::namespaced(client.clone(), &cluster.ns);
    let deadline = Instant::now() + Duration::from_secs(600);
    while Instant::now() < deadline {
        let node_now = nodes.get_opt(&node_name).await.ok().flatten();
        down.mark(
            "Node cordoned",
            node_now
                .as_ref()
                .and_then(|n| n.spec.as_ref())
                .is_some_and(|s| s.unschedulable == Some(true)),
        );
        let drained = events
            .list(&Default::default())
            .await
            .map(|l| {
                l.items.iter().any(|e| {
                    e.reason.as_deref() == Some("SuccessfulDrainNode")
                        && e.involved_object.name.as_deref() == Some(machine_name.as_str())
                })
            })
            .unwrap_or(false);
        down.mark("core drained the Node (Event)", drained);
        let host = cluster.host().await;
        let status = host
            .as_ref()
            .and_then(|h| h.status.clone())
            .unwrap_or_default();
        down.mark(
            "host-0 powered off",
            status.power_state == Some(PowerState::Off),
        );
        let released = status.state == Some(HostState::Available)
            && host.as_ref().is_some_and(|h| h.spec.consumer_ref.is_none());
        down.mark("host-0 released (Available)", released);
        down.mark("Node deleted", node_now.is_none());
        let machine_gone = cluster.machine().await.is_none();
        down.mark("Machine deleted", machine_gone);
        if machine_gone && node_now.is_none() && released {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    down.print("scale to 0, from the patch:");
    for milestone in [
        "core drained the Node (Event)",
        "host-0 powered off",
        "host-0 released (Available)",
        "Node deleted",
        "Machine deleted",
    ] {
        assert!(
            down.has(milestone),
            "scale-down: {milestone} never seen\n{}",
            cluster.diagnostics().await
        );
    }
    assert!(
        down.has("Node cordoned") || down.has("core drained the Node (Event)"),
        "the Node was never cordoned"
    );
    assert_eq!(
        cluster.rack.host.power_state().await,
        PowerState::Off,
        "the QEMU host still runs after the power-off"
    );
}

/// A join that fails under CABPK: the test deletes the bootstrap token CABPK made for the
/// Machine (in the workload cluster, after CABPK rendered it, before the host boots). The
/// token's signature leaves `cluster-info`, the real kubeadm's discovery gives up, CABPK's
/// sentinel is never written, metalboot's vendor-data never calls back, and metalboot's boot
/// timeout fails the MetalMachine; core shows it on the Machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cabpk_join_that_fails_ends_in_the_boot_timeout_shown_on_the_machine() {
    let cluster = KubeadmCluster::start("kubeadm-fail", "52:54:00:6d:62:31", 45, 330).await;
    let client = cluster.mgmt.client.clone();
    let config = support::eventually_or("CABPK renders the join", 300, || async {
        cluster.rendered_config().await
    })
    .await;
    let Some(config) = config else {
        panic!("CABPK never rendered:\n{}", cluster.diagnostics().await);
    };
    let token = config.data["spec"]["joinConfiguration"]["discovery"]["bootstrapToken"]["token"]
        .as_str()
        .expect("CABPK's bootstrap token")
        .to_string();
    let id = token.split('.').next().unwrap_or_default().to_string();
    Api::<Secret>::namespaced(client.clone(), "kube-system")
        .delete(&format!("bootstrap-token-{id}"), &Default::default())
        .await
        .expect("delete CABPK's bootstrap token");
    let public: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(client.clone(), "kube-public");
    support::eventually(
        "the token's signature gone from cluster-info",
        120,
        || async {
            public
                .get_opt("cluster-info")
                .await
                .ok()
                .flatten()
                .filter(|cm| kubeadm::signature(cm, &token).is_none())
        },
    )
    .await;
    let deleted_at = cluster.applied.elapsed();

    let failed = support::eventually_or("the Machine shows the boot timeout", 1200, || async {
        let machine = cluster.machine().await?;
        let infra = condition(&machine, "InfrastructureReady")?;
        (infra["status"] == "False" && infra["reason"] == "BootTimeout").then(|| machine.clone())
    })
    .await;
    let Some(machine) = failed else {
        panic!(
            "no BootTimeout on the Machine:\n{}",
            cluster.diagnostics().await
        );
    };
    let infra = condition(&machine, "InfrastructureReady")
        .cloned()
        .unwrap_or_default();
    assert_ne!(machine.data["status"]["phase"], "Running");
    assert!(machine.data["status"]["nodeRef"].is_null(), "{machine:?}");
    let mm = cluster.metal_machine().await.expect("MetalMachine");
    assert_eq!(
        mm.status.as_ref().and_then(|s| s.failure_reason.as_deref()),
        Some("BootTimeout")
    );
    assert!(mm.spec.provider_id.is_none(), "provisioned after all");
    // The boot timeout counts from the power-on, kubeadm's discovery timeout from its start:
    // on a loaded machine (TCG) the guest may reach kubeadm late, and the Machine fails first.
    // The host stays on after the last attempt, so its console still shows kubeadm give up.
    let kubeadm_failure =
        support::eventually_or("kubeadm's join fails on the console", 300, || {
            let console = rig::console(&cluster.rack.host);
            async move {
                console
                    .lines()
                    .find(|l| l.contains("error execution phase"))
                    .map(str::to_string)
            }
        })
        .await
        .unwrap_or_else(|| {
            panic!(
                "kubeadm join did not fail on the console:\n{}",
                rig::tail(&rig::console(&cluster.rack.host), 6000)
            )
        });
    let console = rig::console(&cluster.rack.host);
    assert!(
        !console.contains("reporting to the boot service"),
        "vendor-data reported success without CABPK's sentinel"
    );
    let joined = Api::<Node>::all(client.clone())
        .list(&Default::default())
        .await
        .expect("nodes")
        .items
        .len();
    assert_eq!(joined, 0, "a Node registered without a valid token");
    println!(
        "CABPK join with its token deleted ({:.1} s after apply): Machine {} phase {}, InfrastructureReady {} {}: {}",
        deleted_at.as_secs_f64(),
        machine.name_any(),
        machine.data["status"]["phase"],
        infra["status"],
        infra["reason"],
        infra["message"]
    );
    println!("kubeadm's failure on the console: {kubeadm_failure}");
}

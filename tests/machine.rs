//! The standalone Machine controller against the real apiserver, with test CRDs standing in for
//! the infrastructure machine and the bootstrap config (the test flips them ready), and the same
//! apiserver as the workload cluster through `<cluster>-kubeconfig`, as upstream tests do.

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::watcher;
use metalboot::api::capi::{Machine, MachineBootstrap, MachineSpec};
use metalboot::api::common::ContractVersionedObjectReference;
use metalboot::manager::RunningManager;
use serde_json::json;
use support::{TestNamespace, eventually};

const INFRA_GROUP: &str = "infrastructure.test.metalboot.dev";
const BOOTSTRAP_GROUP: &str = "bootstrap.test.metalboot.dev";
const HOLD: &str = "test.metalboot.dev/hold";

async fn install_test_crds(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (group, kind) in [
        (INFRA_GROUP, "FakeMachine"),
        (BOOTSTRAP_GROUP, "FakeConfig"),
    ] {
        let plural = format!("{}s", kind.to_lowercase());
        let name = format!("{plural}.{group}");
        let crd: CustomResourceDefinition = serde_json::from_value(json!({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": name, "labels": {"cluster.x-k8s.io/v1beta2": "v1"}},
            "spec": {"group": group, "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
                "versions": [{"name": "v1", "served": true, "storage": true, "subresources": {"status": {}},
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]}
        }))
        .expect("CRD");
        crds.patch(
            &name,
            &PatchParams::apply("metalboot-test").force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("install test CRD");
        eventually(&format!("{name} established"), 30, || async {
            let c = crds.get(&name).await.ok()?;
            c.status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        })
        .await;
    }
}

fn fake_api(client: &kube::Client, ns: &str, group: &str, kind: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(group, "v1", kind),
        &format!("{}s", kind.to_lowercase()),
    );
    Api::namespaced_with(client.clone(), ns, &ar)
}

struct Env {
    ns: TestNamespace,
    infra: Api<DynamicObject>,
    configs: Api<DynamicObject>,
    machines: Api<Machine>,
    _manager: RunningManager,
}

async fn env(prefix: &str, with_kubeconfig: bool) -> Env {
    let (ns, manager) = support::standalone_env(prefix).await;
    install_test_crds(&ns.client).await;
    if with_kubeconfig {
        workload_kubeconfig(&ns, support::control_plane().kubeconfig_path.as_path()).await;
    }
    Env {
        infra: fake_api(&ns.client, &ns.name, INFRA_GROUP, "FakeMachine"),
        configs: fake_api(&ns.client, &ns.name, BOOTSTRAP_GROUP, "FakeConfig"),
        machines: Api::namespaced(ns.client.clone(), &ns.name),
        ns,
        _manager: manager,
    }
}

/// `c1-kubeconfig` with the given file as `value` (the workload cluster is this apiserver).
async fn workload_kubeconfig(ns: &TestNamespace, file: &std::path::Path) {
    let value = std::fs::read(file).expect("kubeconfig file");
    set_kubeconfig_value(ns, value).await;
}

async fn set_kubeconfig_value(ns: &TestNamespace, value: Vec<u8>) {
    set_cluster_kubeconfig(ns, "c1", value).await;
}

async fn set_cluster_kubeconfig(ns: &TestNamespace, cluster: &str, value: Vec<u8>) {
    let name = format!("{cluster}-kubeconfig");
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([("value".to_string(), ByteString(value))])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .patch(
            &name,
            &PatchParams::apply("metalboot-test").force(),
            &Patch::Apply(&secret),
        )
        .await
        .expect("kubeconfig Secret");
}

impl Env {
    async fn create_fake(&self, api: &Api<DynamicObject>, kind: &str, name: &str, hold: bool) {
        let group = if kind == "FakeMachine" {
            INFRA_GROUP
        } else {
            BOOTSTRAP_GROUP
        };
        let mut obj = json!({"apiVersion": format!("{group}/v1"), "kind": kind, "metadata": {"name": name}, "spec": {}});
        if hold {
            obj["metadata"]["finalizers"] = json!([HOLD]);
        }
        let obj: DynamicObject = serde_json::from_value(obj).expect("object");
        api.create(&PostParams::default(), &obj)
            .await
            .expect("create fake object");
    }

    async fn machine(&self, name: &str, config: Option<&str>, data_secret: Option<&str>) {
        let machine = Machine::new(
            name,
            MachineSpec {
                cluster_name: "c1".into(),
                bootstrap: MachineBootstrap {
                    config_ref: config.map(|c| ContractVersionedObjectReference {
                        api_group: BOOTSTRAP_GROUP.into(),
                        kind: "FakeConfig".into(),
                        name: c.into(),
                    }),
                    data_secret_name: data_secret.map(str::to_string),
                    ..Default::default()
                },
                infrastructure_ref: ContractVersionedObjectReference {
                    api_group: INFRA_GROUP.into(),
                    kind: "FakeMachine".into(),
                    name: format!("{name}-infra"),
                },
                ..Default::default()
            },
        );
        self.machines
            .create(&PostParams::default(), &machine)
            .await
            .expect("Machine");
    }

    async fn status(&self, api: &Api<DynamicObject>, name: &str, status: serde_json::Value) {
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .expect("patch status");
    }

    async fn phase(&self, name: &str) -> Option<String> {
        self.machines.get(name).await.ok()?.status?.phase
    }

    async fn wait_phase(&self, name: &str, want: &str) -> Machine {
        eventually(&format!("Machine {name} {want}"), 60, || async {
            let m = self.machines.get(name).await.ok()?;
            (m.status.as_ref()?.phase.as_deref() == Some(want)).then_some(m)
        })
        .await
    }

    async fn condition(&self, name: &str, type_: &str) -> Option<(String, String)> {
        let m = self.machines.get(name).await.ok()?;
        m.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.reason.to_string(), c.message))
    }

    /// A Node in the "workload cluster" with the uninitialized taint and Ready, as a kubelet makes it.
    async fn node(&self, name: &str, provider_id: &str) {
        let nodes: Api<Node> = Api::all(self.ns.client.clone());
        let node: Node = serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"providerID": provider_id, "taints": [
                {"key": "node.cluster.x-k8s.io/uninitialized", "effect": "NoSchedule"}]}
        }))
        .expect("node");
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("Node");
        nodes
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test",
                     "lastHeartbeatTime": "2026-01-01T00:00:00Z", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})),
            )
            .await
            .expect("Node status");
    }

    async fn bootstrap_secret(&self, name: &str) {
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            string_data: Some(BTreeMap::from([(
                "value".to_string(),
                "#cloud-config\n".to_string(),
            )])),
            type_: Some("cluster.x-k8s.io/secret".into()),
            ..Default::default()
        };
        Api::<Secret>::namespaced(self.ns.client.clone(), &self.ns.name)
            .create(&PostParams::default(), &secret)
            .await
            .expect("bootstrap Secret");
    }

    async fn remove_annotation(&self, machine: &str, key: &str) {
        let path = format!(
            "/metadata/annotations/{}",
            key.replace('~', "~0").replace('/', "~1")
        );
        let patch =
            serde_json::from_value(json!([{"op": "remove", "path": path}])).expect("json patch");
        self.machines
            .patch(machine, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
            .expect("remove annotation");
    }

    /// The infrastructure machine `<name>-infra` reports provisioned with a providerID (returned).
    async fn provision_infra(&self, name: &str) -> String {
        let provider_id = format!("test://{}/{name}", self.ns.name);
        self.infra
            .patch(
                &format!("{name}-infra"),
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"providerID": provider_id}})),
            )
            .await
            .expect("providerID");
        self.status(
            &self.infra,
            &format!("{name}-infra"),
            json!({"initialization": {"provisioned": true}, "addresses": [{"type": "InternalIP", "address": "192.0.2.10"}]}),
        )
        .await;
        provider_id
    }

    /// Bootstrap ready, infrastructure provisioned, Node present: a Running Machine with a Node.
    async fn running(&self, name: &str, hold: bool) -> (Machine, String) {
        let config = format!("{name}-config");
        self.create_fake(&self.configs, "FakeConfig", &config, hold)
            .await;
        self.create_fake(&self.infra, "FakeMachine", &format!("{name}-infra"), hold)
            .await;
        self.machine(name, Some(&config), None).await;
        self.bootstrap_secret(&format!("{name}-data")).await;
        self.status(
            &self.configs,
            &config,
            json!({"ready": true, "initialization": {"dataSecretCreated": true}, "dataSecretName": format!("{name}-data")}),
        )
        .await;
        let provider_id = self.provision_infra(name).await;
        let node_name = format!("{}-{name}", self.ns.name);
        self.node(&node_name, &provider_id).await;
        (self.wait_phase(name, "Running").await, node_name)
    }
}

/// Records every phase a Machine shows (consecutive repeats folded), and "<gone>" when deleted.
fn record_phases(machines: &Api<Machine>, name: &str) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let out = seen.clone();
    let stream = watcher(
        machines.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    );
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let entry = match event {
                Ok(watcher::Event::Apply(m)) | Ok(watcher::Event::InitApply(m)) => {
                    m.status.and_then(|s| s.phase)
                }
                Ok(watcher::Event::Delete(_)) => Some("<gone>".to_string()),
                _ => None,
            };
            if let Some(p) = entry
                && let Ok(mut v) = out.lock()
                && v.last() != Some(&p)
            {
                v.push(p);
            }
        }
    });
    seen
}

fn phases(seen: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    seen.lock().map(|v| v.clone()).unwrap_or_default()
}

/// Removes the test's finalizer so a deletion can complete.
async fn release(api: &Api<DynamicObject>, name: &str) {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("release finalizer");
}

/// Whether the object exists and carries a deletion timestamp.
async fn being_deleted(api: &Api<DynamicObject>, name: &str) -> bool {
    api.get_opt(name)
        .await
        .ok()
        .flatten()
        .is_some_and(|o| o.metadata.deletion_timestamp.is_some())
}

fn controller_owner(obj: &DynamicObject) -> Option<String> {
    obj.owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| format!("{}/{}", o.kind, o.name))
}

#[tokio::test]
async fn happy_path_walks_the_phases_and_matches_the_node() {
    let env = env("machine-happy", true).await;
    env.create_fake(&env.configs, "FakeConfig", "m1-config", false)
        .await;
    env.create_fake(&env.infra, "FakeMachine", "m1-infra", false)
        .await;
    let seen = record_phases(&env.machines, "m1");
    env.machine("m1", Some("m1-config"), None).await;
    env.wait_phase("m1", "Pending").await;

    // Ownership and labels on all three objects.
    let machine = env.machines.get("m1").await.expect("Machine");
    assert_eq!(
        machine.labels().get("cluster.x-k8s.io/cluster-name"),
        Some(&"c1".to_string())
    );
    assert!(
        machine
            .owner_references()
            .iter()
            .any(|o| o.kind == "Cluster" && o.name == "c1"),
        "standalone Machine owned by its Cluster"
    );
    for (api, name) in [(&env.configs, "m1-config"), (&env.infra, "m1-infra")] {
        let obj = eventually(&format!("{name} adopted"), 30, || async {
            let o = api.get(name).await.ok()?;
            controller_owner(&o).is_some().then_some(o)
        })
        .await;
        assert_eq!(controller_owner(&obj).as_deref(), Some("Machine/m1"));
        assert_eq!(
            obj.labels().get("cluster.x-k8s.io/cluster-name"),
            Some(&"c1".to_string())
        );
    }

    // Bootstrap data appears: the Machine copies the Secret name and provisions.
    env.bootstrap_secret("m1-data").await;
    env.status(
        &env.configs,
        "m1-config",
        json!({"initialization": {"dataSecretCreated": true}, "dataSecretName": "m1-data"}),
    )
    .await;
    let m = env.wait_phase("m1", "Provisioning").await;
    assert_eq!(
        m.spec.bootstrap.data_secret_name.as_deref(),
        Some("m1-data")
    );

    // The infrastructure reports provisioned with a providerID.
    let provider_id = env.provision_infra("m1").await;
    let m = env.wait_phase("m1", "Provisioned").await;
    assert_eq!(m.spec.provider_id.as_deref(), Some(provider_id.as_str()));
    let status = m.status.clone().expect("status");
    assert_eq!(status.addresses.len(), 1);
    assert_eq!(
        env.condition("m1", "NodeReady").await.map(|c| c.0),
        Some("NodeNotFound".into())
    );

    // The kubelet registers: the Node is matched, annotated and untainted.
    let node_name = format!("{}-m1", env.ns.name);
    env.node(&node_name, &provider_id).await;
    let m = env.wait_phase("m1", "Running").await;
    assert_eq!(
        m.status.and_then(|s| s.node_ref).map(|n| n.name).as_deref(),
        Some(node_name.as_str())
    );
    let nodes: Api<Node> = Api::all(env.ns.client.clone());
    let node = eventually("Node annotated and untainted", 30, || async {
        let n = nodes.get(&node_name).await.ok()?;
        let tainted = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| t.key.contains("uninitialized")));
        (!tainted && n.annotations().contains_key("cluster.x-k8s.io/machine")).then_some(n)
    })
    .await;
    let a = node.annotations();
    assert_eq!(a.get("cluster.x-k8s.io/cluster-name"), Some(&"c1".into()));
    assert_eq!(
        a.get("cluster.x-k8s.io/cluster-namespace"),
        Some(&env.ns.name)
    );
    assert_eq!(a.get("cluster.x-k8s.io/machine"), Some(&"m1".into()));
    assert_eq!(
        phases(&seen),
        ["Pending", "Provisioning", "Provisioned", "Running"],
        "phases in order"
    );
    let _ = nodes.delete(&node_name, &DeleteParams::default()).await;
}

#[tokio::test]
async fn user_supplied_data_secret_name_skips_the_bootstrap_wait() {
    let env = env("machine-datasecret", true).await;
    env.create_fake(&env.infra, "FakeMachine", "m2-infra", false)
        .await;
    let seen = record_phases(&env.machines, "m2");
    env.bootstrap_secret("my-own-data").await;
    env.machine("m2", None, Some("my-own-data")).await;
    let m = env.wait_phase("m2", "Provisioning").await;
    let status = m.status.expect("status");
    assert_eq!(status.bootstrap_ready, Some(true));
    assert_eq!(
        status
            .initialization
            .and_then(|i| i.bootstrap_data_secret_created),
        Some(true)
    );
    assert_eq!(
        env.condition("m2", "BootstrapConfigReady").await,
        Some(("DataSecretAvailable".into(), String::new()))
    );
    assert_eq!(
        phases(&seen).first().map(String::as_str),
        Some("Provisioning"),
        "never Pending: {:?}",
        phases(&seen)
    );
}

#[tokio::test]
async fn failure_reported_by_infrastructure_is_terminal() {
    let env = env("machine-failed", true).await;
    env.create_fake(&env.infra, "FakeMachine", "m3-infra", false)
        .await;
    env.bootstrap_secret("m3-data").await;
    env.machine("m3", None, Some("m3-data")).await;
    env.wait_phase("m3", "Provisioning").await;
    env.status(
        &env.infra,
        "m3-infra",
        json!({"failureReason": "CreateError", "failureMessage": "host exploded"}),
    )
    .await;
    let m = env.wait_phase("m3", "Failed").await;
    let status = m.status.expect("status");
    assert_eq!(status.failure_reason.as_deref(), Some("CreateError"));
    assert_eq!(status.failure_message.as_deref(), Some("host exploded"));

    // The failure is cleared and the infrastructure even looks healthy: the Machine stays Failed.
    env.infra
        .patch(
            "m3-infra",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"providerID": "test://m3"}})),
        )
        .await
        .expect("providerID");
    env.status(
        &env.infra,
        "m3-infra",
        json!({"failureReason": null, "failureMessage": null, "initialization": {"provisioned": true}}),
    )
    .await;
    // Touch the Machine, and wait until the controller has looked at it again.
    let object = format!("{}/m3", env.ns.name);
    let before = metalboot::metrics::passes_of("machine", &object);
    env.machines
        .patch(
            "m3",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"test/poke": "1"}}})),
        )
        .await
        .expect("poke");
    eventually("the Machine controller looked again", 30, || async {
        (metalboot::metrics::passes_of("machine", &object) > before).then_some(())
    })
    .await;
    assert_eq!(env.phase("m3").await.as_deref(), Some("Failed"));
    let events: Vec<Event> = Api::<Event>::namespaced(env.ns.client.clone(), &env.ns.name)
        .list(&ListParams::default())
        .await
        .expect("events")
        .items;
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("Failed") && e.type_.as_deref() == Some("Warning")),
        "a Warning Event says why"
    );
}

#[tokio::test]
async fn deletion_runs_hooks_drain_infra_bootstrap_node_in_order() {
    let env = env("machine-delete", true).await;
    let client = env.ns.client.clone();
    let ns = env.ns.name.clone();
    let (_, node_name) = env.running("m4", true).await;
    env.machines
        .patch(
            "m4",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "pre-drain.delete.hook.machine.cluster.x-k8s.io/test": "",
                "pre-terminate.delete.hook.machine.cluster.x-k8s.io/test": ""}}})),
        )
        .await
        .expect("hooks");

    // Two web pods behind a PDB that allows one disruption, and a DaemonSet pod, on the Node.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let daemonset: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}},
                 "template": {"metadata": {"labels": {"app": "agent"}},
                              "spec": {"containers": [{"name": "c", "image": "agent"}]}}}
    }))
    .expect("DaemonSet");
    let daemonset = Api::<DaemonSet>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &daemonset)
        .await
        .expect("create DaemonSet");
    let pod_json = |name: &str, app: &str, owner: Option<&DaemonSet>| {
        let mut p = json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"nodeName": node_name, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "web"}]}
        });
        if let Some(ds) = owner {
            p["metadata"]["ownerReferences"] = json!([{"apiVersion": "apps/v1", "kind": "DaemonSet",
                "name": ds.name_any(), "uid": ds.uid(), "controller": true}]);
        }
        serde_json::from_value::<Pod>(p).expect("pod")
    };
    for (name, app, owner) in [
        ("web-0", "web", None),
        ("web-1", "web", None),
        ("agent-x", "agent", Some(&daemonset)),
    ] {
        pods.create(&PostParams::default(), &pod_json(name, app, owner))
            .await
            .expect("create pod");
        // Running and Ready, as a kubelet would report: only healthy pods count against a PDB.
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}]}})),
        )
        .await
        .expect("pod status");
    }
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}}
    }))
    .expect("PDB");
    pdbs.create(&PostParams::default(), &pdb)
        .await
        .expect("create PDB");
    // No disruption controller runs here: the test plays it, allowing one disruption.
    let allow_one = || async {
        let generation = pdbs.get("web").await.expect("PDB").metadata.generation;
        pdbs.patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"status": {"observedGeneration": generation, "disruptionsAllowed": 1,
                "currentHealthy": 2, "desiredHealthy": 1, "expectedPods": 2}}),
            ),
        )
        .await
        .expect("PDB status");
    };
    allow_one().await;

    let seen = record_phases(&env.machines, "m4");
    env.machines
        .delete("m4", &DeleteParams::default())
        .await
        .expect("delete Machine");
    let nodes: Api<Node> = Api::all(client.clone());
    let unschedulable = || async {
        nodes
            .get(&node_name)
            .await
            .ok()
            .and_then(|n| n.spec?.unschedulable)
            == Some(true)
    };

    // The pre-drain hook blocks everything.
    eventually("WaitingForHooks (pre-drain)", 30, || async {
        let (reason, message) = env.condition("m4", "Deleting").await?;
        (reason == "WaitingForHooks" && message.contains("pre-drain")).then_some(())
    })
    .await;
    let object = format!("{}/m4", env.ns.name);
    let passes = || metalboot::metrics::passes_of("machine", &object);
    let before = passes();
    eventually("two more deletion passes under the hook", 30, || async {
        (passes() >= before + 2).then_some(())
    })
    .await;
    assert!(!unschedulable().await, "not cordoned while the hook holds");
    assert_eq!(
        pods.list(&ListParams::default())
            .await
            .expect("pods")
            .items
            .len(),
        3
    );
    env.remove_annotation("m4", "pre-drain.delete.hook.machine.cluster.x-k8s.io/test")
        .await;

    // Cordon, one eviction allowed, the second refused by the PDB and retried.
    eventually("Node cordoned", 30, || async {
        unschedulable().await.then_some(())
    })
    .await;
    let refused = eventually("the PDB refuses the second eviction", 60, || async {
        let (reason, message) = env.condition("m4", "Deleting").await?;
        (reason == "DrainingNode" && message.contains("disruption budget")).then_some(message)
    })
    .await;
    println!("condition while blocked: {refused}");
    let remaining: Vec<String> = pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("pods")
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert_eq!(
        remaining.len(),
        1,
        "one web pod evicted, one kept: {remaining:?}"
    );
    allow_one().await;
    eventually("both web pods evicted", 60, || async {
        pods.list(&ListParams::default().labels("app=web"))
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    // An Event per eviction; the recorder folds repeats of one reason into a series.
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    eventually("two PodEvicted Events", 30, || async {
        let count: i32 = events
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|e| e.reason.as_deref() == Some("PodEvicted"))
            .map(|e| e.series.map_or(1, |s| s.count))
            .sum();
        (count == 2).then_some(())
    })
    .await;

    // Then the pre-terminate hook holds the infrastructure.
    eventually("WaitingForHooks (pre-terminate)", 30, || async {
        let (reason, message) = env.condition("m4", "Deleting").await?;
        (reason == "WaitingForHooks" && message.contains("pre-terminate")).then_some(())
    })
    .await;
    assert!(!being_deleted(&env.infra, "m4-infra").await);
    assert_eq!(
        env.condition("m4", "DrainingSucceeded").await.map(|c| c.0),
        Some("NodeDrained".into()),
        "the drain is recorded as over, so it is not repeated"
    );
    env.remove_annotation(
        "m4",
        "pre-terminate.delete.hook.machine.cluster.x-k8s.io/test",
    )
    .await;

    // Infrastructure first, and only when it is gone the bootstrap config.
    eventually("infrastructure deleted first", 30, || async {
        being_deleted(&env.infra, "m4-infra").await.then_some(())
    })
    .await;
    let before = passes();
    eventually(
        "two more deletion passes while the infrastructure exists",
        30,
        || async { (passes() >= before + 2).then_some(()) },
    )
    .await;
    assert!(
        !being_deleted(&env.configs, "m4-config").await,
        "bootstrap config untouched while the infrastructure exists"
    );
    release(&env.infra, "m4-infra").await;
    eventually("bootstrap config deleted next", 30, || async {
        being_deleted(&env.configs, "m4-config").await.then_some(())
    })
    .await;
    assert!(nodes.get_opt(&node_name).await.expect("node").is_some());
    release(&env.configs, "m4-config").await;

    eventually("Node deleted", 30, || async {
        nodes
            .get_opt(&node_name)
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    eventually("Machine gone", 30, || async {
        env.machines
            .get_opt("m4")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    eventually("watch saw the deletion", 10, || async {
        phases(&seen).contains(&"<gone>".to_string()).then_some(())
    })
    .await;
    let seen = phases(&seen);
    let tail: Vec<&str> = seen
        .iter()
        .rev()
        .take(3)
        .rev()
        .map(String::as_str)
        .collect();
    assert_eq!(
        tail,
        ["Deleting", "Deleted", "<gone>"],
        "Deleted recorded before the object disappears: {seen:?}"
    );
    assert!(
        pods.get_opt("agent-x").await.expect("pod").is_some(),
        "the DaemonSet pod is not evicted"
    );
}

#[tokio::test]
async fn drain_gives_up_after_the_timeout_and_is_skipped_when_excluded() {
    let env = env("machine-drain-limits", true).await;
    let client = env.ns.client.clone();
    let (_, slow_node) = env.running("slow", true).await;
    let (_, skip_node) = env.running("skip", true).await;
    env.machines
        .patch(
            "slow",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"deletion": {"nodeDrainTimeoutSeconds": 5}}})),
        )
        .await
        .expect("nodeDrainTimeoutSeconds");
    env.machines
        .patch(
            "skip",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {
                "machine.cluster.x-k8s.io/exclude-node-draining": ""}}})),
        )
        .await
        .expect("exclude annotation");
    // A pod on each Node behind a PDB that allows nothing: it can never be evicted.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &env.ns.name);
    for (name, node) in [("stuck-slow", &slow_node), ("stuck-skip", &skip_node)] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "stuck"}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "stuck"}]}
        }))
        .expect("pod");
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("pod");
        pods.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True"}]}})),
        )
        .await
        .expect("pod status");
    }
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &env.ns.name);
    let pdb: PodDisruptionBudget = serde_json::from_value(json!({
        "metadata": {"name": "stuck"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "stuck"}}}
    }))
    .expect("PDB");
    pdbs.create(&PostParams::default(), &pdb)
        .await
        .expect("PDB");
    pdbs.patch_status(
        "stuck",
        &PatchParams::default(),
        &Patch::Merge(
            json!({"status": {"observedGeneration": 1, "disruptionsAllowed": 0,
            "currentHealthy": 2, "desiredHealthy": 2, "expectedPods": 2}}),
        ),
    )
    .await
    .expect("PDB status");

    for name in ["slow", "skip"] {
        env.machines
            .delete(name, &DeleteParams::default())
            .await
            .expect("delete");
    }
    // Excluded: no cordon, no eviction, straight on to the infrastructure.
    let (reason, _) = eventually("skip: drain skipped", 30, || async {
        env.condition("skip", "DrainingSucceeded").await
    })
    .await;
    assert_eq!(reason, "DrainSkipped");
    let nodes: Api<Node> = Api::all(client.clone());
    let cordoned = |name: String| {
        let nodes = nodes.clone();
        async move {
            nodes
                .get(&name)
                .await
                .ok()
                .and_then(|n| n.spec?.unschedulable)
                == Some(true)
        }
    };
    assert!(
        !cordoned(skip_node.clone()).await,
        "excluded Node not cordoned"
    );
    eventually("skip: infrastructure deleted", 30, || async {
        being_deleted(&env.infra, "skip-infra").await.then_some(())
    })
    .await;

    // Timed out: cordoned, the eviction refused, and after 5 s the deletion goes on anyway.
    let (reason, message) = eventually("slow: refused while in time", 30, || async {
        env.condition("slow", "Deleting")
            .await
            .filter(|c| c.0 == "DrainingNode")
    })
    .await;
    assert!(message.contains("disruption budget"), "{reason}: {message}");
    assert!(cordoned(slow_node.clone()).await);
    eventually("slow: drain timed out", 30, || async {
        env.condition("slow", "DrainingSucceeded")
            .await
            .filter(|c| c.0 == "DrainTimedOut")
    })
    .await;
    eventually("slow: infrastructure deleted", 30, || async {
        being_deleted(&env.infra, "slow-infra").await.then_some(())
    })
    .await;
    let start = env
        .machines
        .get("slow")
        .await
        .expect("Machine")
        .status
        .and_then(|s| s.deletion)
        .and_then(|d| d.node_drain_start_time);
    assert!(
        start.is_some(),
        "status.deletion.nodeDrainStartTime recorded"
    );
    assert!(
        pods.get_opt("stuck-slow").await.expect("pod").is_some(),
        "the pod stayed"
    );
    let warnings = Api::<Event>::namespaced(client.clone(), &env.ns.name)
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("DrainTimedOut"))
        .map(|e| e.series.map_or(1, |s| s.count))
        .sum::<i32>();
    assert_eq!(
        warnings, 1,
        "one Warning Event for the timeout, not one per pass"
    );
    for name in ["slow", "skip"] {
        release(&env.infra, &format!("{name}-infra")).await;
        eventually("config deleted", 30, || async {
            being_deleted(&env.configs, &format!("{name}-config"))
                .await
                .then_some(())
        })
        .await;
        release(&env.configs, &format!("{name}-config")).await;
    }
    eventually("both Machines gone", 60, || async {
        env.machines
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn missing_or_invalid_workload_kubeconfig_is_a_condition_not_a_crash_loop() {
    let env = env("machine-kubeconfig", false).await;
    env.create_fake(&env.infra, "FakeMachine", "m5-infra", false)
        .await;
    env.bootstrap_secret("m5-data").await;
    env.machine("m5", None, Some("m5-data")).await;
    let provider_id = env.provision_infra("m5").await;
    let m = env.wait_phase("m5", "Provisioned").await;
    let (reason, message) = eventually("KubeconfigMissing", 30, || async {
        env.condition("m5", "NodeReady")
            .await
            .filter(|c| c.0 == "KubeconfigMissing")
    })
    .await;
    assert!(message.contains("c1-kubeconfig"), "{reason}: {message}");

    set_kubeconfig_value(&env.ns, b"this: is: not a kubeconfig".to_vec()).await;
    let (_, message) = eventually("KubeconfigInvalid", 30, || async {
        env.condition("m5", "NodeReady")
            .await
            .filter(|c| c.0 == "KubeconfigInvalid")
    })
    .await;
    println!("NodeReady while the kubeconfig is broken: {message}");
    // Retries are paced, not a hot loop: looking again writes nothing.
    let before: u64 = env
        .machines
        .get("m5")
        .await
        .expect("Machine")
        .resource_version()
        .and_then(|v| v.parse().ok())
        .expect("resourceVersion");
    let object = format!("{}/m5", env.ns.name);
    let looked = metalboot::metrics::passes_of("machine", &object);
    eventually("the Machine looked at the kubeconfig again", 30, || async {
        (metalboot::metrics::passes_of("machine", &object) > looked).then_some(())
    })
    .await;
    let after = env.machines.get("m5").await.expect("Machine");
    assert_eq!(
        after.resource_version().and_then(|v| v.parse::<u64>().ok()),
        Some(before),
        "no status churn while waiting for a usable kubeconfig"
    );
    assert_eq!(
        after.status.and_then(|s| s.phase),
        m.status.and_then(|s| s.phase)
    );

    // Fixing the Secret is enough: the Machine finds its Node.
    workload_kubeconfig(&env.ns, support::control_plane().kubeconfig_path.as_path()).await;
    let node_name = format!("{}-m5", env.ns.name);
    env.node(&node_name, &provider_id).await;
    env.wait_phase("m5", "Running").await;
    let _ = Api::<Node>::all(env.ns.client.clone())
        .delete(&node_name, &DeleteParams::default())
        .await;
}

/// Pause covers deletion: a deleted Machine of a paused Cluster shows Paused and deletes nothing
/// (its infrastructure, its Node) until the Cluster is unpaused; then deletion runs to the end.
#[tokio::test]
async fn a_paused_cluster_holds_machine_deletion() {
    let env = env("machine-pause", true).await;
    let (_, node_name) = env.running("m6", false).await;
    let clusters: Api<metalboot::api::Cluster> =
        Api::namespaced(env.ns.client.clone(), &env.ns.name);
    let pause = |paused: bool| {
        let clusters = clusters.clone();
        async move {
            clusters
                .patch(
                    "c1",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"paused": paused}})),
                )
                .await
                .expect("pause Cluster");
        }
    };
    pause(true).await;
    // The manager has seen the pause (its Cluster store is a watch, not a read of the write
    // above): only then is the deletion's answer to a paused Cluster what is tested.
    eventually("the Machine shows its Cluster paused", 30, || async {
        let m = env.machines.get("m6").await.ok()?;
        m.status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Paused" && c.status == "True")
    })
    .await;
    env.machines
        .delete("m6", &DeleteParams::default())
        .await
        .expect("delete Machine");
    // The Paused condition was already there; the deletion's own answer says it waits.
    let (_, message) = eventually("the deleting Machine shows Paused", 30, || async {
        env.condition("m6", "Paused")
            .await
            .filter(|(_, message)| message.contains("deletion waits"))
    })
    .await;
    assert!(message.contains("deletion waits"), "{message}");
    let infra = env
        .infra
        .get("m6-infra")
        .await
        .expect("infrastructure still there");
    assert!(
        infra.metadata.deletion_timestamp.is_none(),
        "no deletion step while paused"
    );
    let nodes: Api<Node> = Api::all(env.ns.client.clone());
    assert!(nodes.get_opt(&node_name).await.expect("get Node").is_some());

    pause(false).await;
    eventually("the Machine is gone once unpaused", 60, || async {
        env.machines
            .get_opt("m6")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    assert!(
        env.infra.get_opt("m6-infra").await.expect("get").is_none(),
        "and its infrastructure with it"
    );
    let _ = nodes.delete(&node_name, &DeleteParams::default()).await;
}

/// Machine passes that need the kubeconfig at the same moment read it once between them, not
/// once each: on a cold start, when the recheck comes due, and when the read fails (the passes
/// queued behind a failed read take its answer). A counting layer on the management client sees
/// every GET of the Secret.
#[tokio::test]
async fn passes_at_once_read_the_kubeconfig_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;
    let env = env("machine-herd", true).await;
    let reads = Arc::new(AtomicUsize::new(0));
    let counter = reads.clone();
    let count_kubeconfig_reads =
        tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
            if request.method() == http::Method::GET
                && request.uri().path().ends_with("-kubeconfig")
            {
                counter.fetch_add(1, Ordering::SeqCst);
            }
            request
        });
    let kubeconfig =
        kube::config::Kubeconfig::read_from(support::control_plane().kubeconfig_path.as_path())
            .expect("kubeconfig");
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("config");
    let client = kube::client::ClientBuilder::try_from(config)
        .expect("client builder")
        .with_layer(&count_kubeconfig_reads)
        .build();
    let recheck = Duration::from_millis(300);
    let workloads = metalboot::controllers::machine::Workloads::default().rechecking_every(recheck);
    let at_once = |cluster: &'static str| {
        let (workloads, client, ns) = (&workloads, &client, &env.ns.name);
        futures::future::join_all((0..32).map(move |_| workloads.get(client, ns, cluster)))
    };

    let cold = at_once("c1").await;
    assert!(cold.iter().all(Result::is_ok), "workload cluster");
    assert_eq!(reads.swap(0, Ordering::SeqCst), 1, "cold: one read");

    // What the cache holds is now older than the recheck interval: every pass finds it due.
    tokio::time::sleep(recheck + Duration::from_millis(100)).await;
    let due = at_once("c1").await;
    assert!(due.iter().all(Result::is_ok), "workload cluster");
    assert_eq!(reads.swap(0, Ordering::SeqCst), 1, "due: one read");

    let missing = at_once("no-such-cluster").await;
    assert!(
        missing
            .iter()
            .all(|answer| matches!(answer, Err(("KubeconfigMissing", _)))),
        "every pass is told the kubeconfig is missing"
    );
    assert_eq!(reads.swap(0, Ordering::SeqCst), 1, "failed: one read");
    workloads.forget(&env.ns.name, "c1");
}

/// A rotated workload kubeconfig replaces the cluster's Node watch: the old one stops.
#[tokio::test]
async fn a_rotated_kubeconfig_stops_the_old_node_watch() {
    let env = env("machine-rotate", true).await;
    let workloads = metalboot::controllers::machine::Workloads::default();
    workloads
        .get(&env.ns.client, &env.ns.name, "c1")
        .await
        .expect("workload cluster");
    assert_eq!(workloads.live_watches(), 1);
    for rotation in 0..3 {
        // Same cluster, new Secret version: as a certificate rotation looks.
        let mut value =
            std::fs::read(support::control_plane().kubeconfig_path.as_path()).expect("kubeconfig");
        value.extend(format!("\n# rotation {rotation}\n").into_bytes());
        set_kubeconfig_value(&env.ns, value).await;
        workloads
            .get(&env.ns.client, &env.ns.name, "c1")
            .await
            .expect("workload cluster after rotation");
        eventually("one Node watch per workload cluster", 10, || async {
            (workloads.live_watches() == 1).then_some(())
        })
        .await;
    }
    workloads.forget(&env.ns.name, "c1");
    eventually("no Node watch once forgotten", 10, || async {
        (workloads.live_watches() == 0).then_some(())
    })
    .await;
}

/// A deleted Cluster's workload goes with it: its Node watch stops, as does the watch of a
/// workload whose Cluster was gone when the Cluster store listed (a restarted watch sends no
/// deletion for it). Without this, each watch retries a gone apiserver while the manager runs.
#[tokio::test]
async fn a_deleted_cluster_stops_its_node_watch() {
    use kube::core::DeserializeGuard;
    use metalboot::api::Cluster;
    let ns = support::namespace("machine-forget").await;
    support::boot::install_crds(&ns.client).await;
    let clusters: Api<Cluster> = Api::namespaced(ns.client.clone(), &ns.name);
    let value =
        std::fs::read(support::control_plane().kubeconfig_path.as_path()).expect("kubeconfig");
    for name in ["kept", "deleted"] {
        clusters
            .create(
                &PostParams::default(),
                &Cluster::new(name, Default::default()),
            )
            .await
            .expect("Cluster");
    }
    // `orphan` has a kubeconfig and no Cluster: as if the Cluster went while the watch was down.
    for name in ["kept", "deleted", "orphan"] {
        set_cluster_kubeconfig(&ns, name, value.clone()).await;
    }
    let workloads = Arc::new(metalboot::controllers::machine::Workloads::default());
    let shared = metalboot::stores::SharedStore::<DeserializeGuard<Cluster>>::new();
    workloads.follow_clusters(&shared);
    for name in ["kept", "deleted", "orphan"] {
        workloads
            .get(&ns.client, &ns.name, name)
            .await
            .expect("workload cluster");
    }
    assert_eq!(workloads.live_watches(), 3);
    let key = |name: &str| format!("{}/{name}", ns.name);

    shared.run(
        Api::namespaced(ns.client.clone(), &ns.name),
        watcher::Config::default(),
    );
    eventually(
        "the orphan forgotten once the Clusters are listed",
        30,
        || async {
            (workloads.held() == vec![key("deleted"), key("kept")] && workloads.live_watches() == 2)
                .then_some(())
        },
    )
    .await;

    clusters
        .delete("deleted", &DeleteParams::default())
        .await
        .expect("delete Cluster");
    eventually("the deleted Cluster's watch stopped", 30, || async {
        (workloads.held() == vec![key("kept")] && workloads.live_watches() == 1).then_some(())
    })
    .await;
    // A later pass of one of its Machines (its kubeconfig Secret is still there) starts nothing.
    let again = workloads.get(&ns.client, &ns.name, "deleted").await;
    assert!(
        matches!(again, Err(("ClusterNotFound", _))),
        "a deleted Cluster's workload is not read again"
    );
    assert_eq!(workloads.held(), vec![key("kept")]);
    assert_eq!(workloads.live_watches(), 1);
    workloads.forget(&ns.name, "kept");
}

//! The API on a real apiserver: CRDs install, deploy/ manifests dry-run, invalid objects are
//! rejected with messages that name the field, upstream-shaped Cluster API objects round-trip,
//! and kubectl shows our printer columns and descriptions.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::runtime::{conditions, wait::await_condition};
use metalboot::api::capi::{Cluster, Machine};
use serde_json::{Value, json};

fn project() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn kubectl() -> Command {
    let mut cmd = Command::new(metalboot::controlplane::default_bin_dir().join("kubectl"));
    cmd.arg("--kubeconfig")
        .arg(&support::control_plane().kubeconfig_path);
    cmd
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("run kubectl");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

async fn install_crds(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in metalboot::api::crdgen::all_crds() {
        let name = crd.metadata.name.clone().expect("CRD name");
        crds.patch(
            &name,
            &PatchParams::apply("metalboot-test").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap_or_else(|e| panic!("install {name}: {e}"));
        tokio::time::timeout(
            Duration::from_secs(30),
            await_condition(crds.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .unwrap_or_else(|_| panic!("{name} not established"))
        .expect("watch CRD");
    }
}

fn dry_run_apply(file: &Path) -> String {
    run(kubectl()
        .args([
            "apply",
            "--server-side",
            "--dry-run=server",
            "--field-manager=metalboot-test",
            "-f",
        ])
        .arg(file))
}

/// The standalone examples are valid against metalboot's own CRDs (the clusterctl components and
/// cluster templates are checked with the real clusterctl and upstream core in tests/clusterctl.rs).
#[tokio::test]
async fn the_standalone_examples_pass_server_side_dry_run() {
    let ns = support::namespace("deploy").await;
    install_crds(&ns.client).await;
    for example in std::fs::read_dir(project().join("deploy/examples")).expect("examples") {
        let path = example.expect("entry").path();
        let out = dry_run_apply(&path);
        assert!(
            out.contains("(server dry run)"),
            "{}: {out}",
            path.display()
        );
    }
}

fn resource(group: &str, kind: &str, plural: &str, version: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

fn host(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalHost",
        "metadata": {"name": name}, "spec": spec})
}

fn good_host_spec() -> Value {
    json!({"bmc": {"address": "redfish://10.0.0.5/redfish/v1/Systems/1", "credentialsName": "bmc-creds"},
        "bootMACAddress": "52:54:00:12:34:56"})
}

fn with(mut base: Value, path: &[&str], value: Value) -> Value {
    let mut node = &mut base;
    for key in &path[..path.len() - 1] {
        node = &mut node[*key];
    }
    match value {
        Value::Null => {
            if let Some(obj) = node.as_object_mut() {
                obj.remove(path[path.len() - 1]);
            }
        }
        v => node[path[path.len() - 1]] = v,
    }
    base
}

fn machine(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalMachine",
        "metadata": {"name": name}, "spec": spec})
}

fn good_machine_spec() -> Value {
    json!({"boot": {"kernel": "vmlinuz", "initrds": ["initrd.gz"], "cmdline": "console=ttyS0"}})
}

fn cluster(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalCluster",
        "metadata": {"name": name}, "spec": spec})
}

fn config(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1", "kind": "CloudInitConfig",
        "metadata": {"name": name}, "spec": spec})
}

fn api_for(client: &kube::Client, ns: &str, object: &Value) -> Api<DynamicObject> {
    let kind = object["kind"].as_str().expect("kind");
    let ar = match kind {
        "MetalHost" => resource(
            "infrastructure.cluster.x-k8s.io",
            kind,
            "metalhosts",
            "v1alpha1",
        ),
        "MetalMachine" => resource(
            "infrastructure.cluster.x-k8s.io",
            kind,
            "metalmachines",
            "v1alpha1",
        ),
        "MetalCluster" => resource(
            "infrastructure.cluster.x-k8s.io",
            kind,
            "metalclusters",
            "v1alpha1",
        ),
        "CloudInitConfig" => resource(
            "bootstrap.cluster.x-k8s.io",
            kind,
            "cloudinitconfigs",
            "v1alpha1",
        ),
        other => panic!("no resource for {other}"),
    };
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// Creating (or, for transition and status rules, updating) each object must fail with 422 and
/// a message that names the offending field.
#[tokio::test]
async fn invalid_objects_are_rejected_with_a_message_naming_the_field() {
    let ns = support::namespace("invalid").await;
    install_crds(&ns.client).await;
    let client = &ns.client;

    enum Step {
        Create(Value),
        /// Create the first object, then update it into the second.
        Update(Value, Value),
    }
    let long_id = format!("metalboot://ns/{}", "x".repeat(600));
    let cases: Vec<(&str, Step, &str)> = vec![
        (
            "MAC with letters out of hex",
            Step::Create(host(
                "h1",
                with(
                    good_host_spec(),
                    &["bootMACAddress"],
                    json!("zz:54:00:12:34:56"),
                ),
            )),
            "spec.bootMACAddress",
        ),
        (
            "MAC with dashes",
            Step::Create(host(
                "h2",
                with(
                    good_host_spec(),
                    &["bootMACAddress"],
                    json!("52-54-00-12-34-56"),
                ),
            )),
            "spec.bootMACAddress",
        ),
        (
            "MAC missing",
            Step::Create(host(
                "h3",
                with(good_host_spec(), &["bootMACAddress"], Value::Null),
            )),
            "spec.bootMACAddress",
        ),
        (
            "BMC scheme http",
            Step::Create(host(
                "h4",
                with(
                    good_host_spec(),
                    &["bmc", "address"],
                    json!("http://10.0.0.5/redfish/v1/Systems/1"),
                ),
            )),
            "spec.bmc.address",
        ),
        (
            "BMC scheme unknown",
            Step::Create(host(
                "h5",
                with(
                    good_host_spec(),
                    &["bmc", "address"],
                    json!("idrac://10.0.0.5"),
                ),
            )),
            "spec.bmc.address",
        ),
        (
            "BMC port out of range",
            Step::Create(host(
                "h6",
                with(
                    good_host_spec(),
                    &["bmc", "address"],
                    json!("redfish://10.0.0.5:70000/redfish/v1/Systems/1"),
                ),
            )),
            "spec.bmc.address",
        ),
        (
            "BMC missing",
            Step::Create(host("h7", with(good_host_spec(), &["bmc"], Value::Null))),
            "spec.bmc",
        ),
        (
            "credentials name missing",
            Step::Create(host(
                "h8",
                with(good_host_spec(), &["bmc", "credentialsName"], Value::Null),
            )),
            "spec.bmc.credentialsName",
        ),
        (
            "credentials name not a DNS name",
            Step::Create(host(
                "h9",
                with(
                    good_host_spec(),
                    &["bmc", "credentialsName"],
                    json!("BMC_Creds"),
                ),
            )),
            "spec.bmc.credentialsName",
        ),
        (
            "online of the wrong type",
            Step::Create(host(
                "h10",
                with(good_host_spec(), &["online"], json!("yes")),
            )),
            "spec.online",
        ),
        (
            "consumerRef of the wrong kind",
            Step::Create(host(
                "h11",
                with(
                    good_host_spec(),
                    &["consumerRef"],
                    json!({"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "n"}),
                ),
            )),
            "spec.consumerRef",
        ),
        (
            "consumerRef without namespace",
            Step::Create(host(
                "h12",
                with(
                    good_host_spec(),
                    &["consumerRef"],
                    json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalMachine", "name": "m"}),
                ),
            )),
            "spec.consumerRef.namespace",
        ),
        (
            "boot profile missing",
            Step::Create(machine("m1", json!({}))),
            "spec.boot",
        ),
        (
            "image mode without an image",
            Step::Create(machine("m20", json!({"mode": "image"}))),
            "spec.image is required",
        ),
        (
            "image checksum too short",
            Step::Create(machine(
                "m21",
                json!({"mode": "image", "image": {"url": "os.raw", "checksum": "abc", "checksumType": "sha256"}}),
            )),
            "spec.image.checksum",
        ),
        (
            "image checksum of the other digest",
            Step::Create(machine(
                "m22",
                json!({"mode": "image", "image": {"url": "os.raw", "checksum": "a".repeat(64), "checksumType": "sha512"}}),
            )),
            "checksum must be the hex digest",
        ),
        (
            "image url escaping the artifacts dir",
            Step::Create(machine(
                "m23",
                json!({"mode": "image", "image": {"url": "../os.raw", "checksum": "a".repeat(64), "checksumType": "sha256"}}),
            )),
            "spec.image.url",
        ),
        (
            "image of an unknown format",
            Step::Create(machine(
                "m24",
                json!({"mode": "image", "image": {"url": "os.vmdk", "checksum": "a".repeat(64), "checksumType": "sha256", "format": "vmdk"}}),
            )),
            "spec.image.format",
        ),
        (
            "root device hint of the wrong type",
            Step::Create(machine(
                "m25",
                json!({"mode": "image", "image": {"url": "os.raw", "checksum": "a".repeat(64), "checksumType": "sha256"}, "rootDeviceHints": {"rotational": "yes"}}),
            )),
            "spec.rootDeviceHints.rotational",
        ),
        (
            "kernel as an absolute host path",
            Step::Create(machine(
                "m2",
                with(
                    good_machine_spec(),
                    &["boot", "kernel"],
                    json!("/etc/shadow"),
                ),
            )),
            "spec.boot.kernel",
        ),
        (
            "kernel escaping the artifacts dir",
            Step::Create(machine(
                "m3",
                with(
                    good_machine_spec(),
                    &["boot", "kernel"],
                    json!("../../etc/shadow"),
                ),
            )),
            "spec.boot.kernel",
        ),
        (
            "initrd escaping the artifacts dir",
            Step::Create(machine(
                "m4",
                with(
                    good_machine_spec(),
                    &["boot", "initrds"],
                    json!(["ok.img", "/etc/shadow"]),
                ),
            )),
            "spec.boot.initrds",
        ),
        (
            "boot timeout too short",
            Step::Create(machine(
                "m5",
                with(good_machine_spec(), &["bootTimeoutSeconds"], json!(5)),
            )),
            "spec.bootTimeoutSeconds",
        ),
        (
            "boot retries of the wrong type",
            Step::Create(machine(
                "m6",
                with(good_machine_spec(), &["bootRetries"], json!("two")),
            )),
            "spec.bootRetries",
        ),
        (
            "providerID too long",
            Step::Create(machine(
                "m7",
                with(good_machine_spec(), &["providerID"], json!(long_id)),
            )),
            "spec.providerID",
        ),
        (
            "providerID changed after set",
            Step::Update(
                machine(
                    "m8",
                    with(
                        good_machine_spec(),
                        &["providerID"],
                        json!("metalboot://ns/host-a"),
                    ),
                ),
                machine(
                    "m8",
                    with(
                        good_machine_spec(),
                        &["providerID"],
                        json!("metalboot://ns/host-b"),
                    ),
                ),
            ),
            "spec.providerID is immutable",
        ),
        (
            "providerID removed after set",
            Step::Update(
                machine(
                    "m9",
                    with(
                        good_machine_spec(),
                        &["providerID"],
                        json!("metalboot://ns/host-a"),
                    ),
                ),
                machine("m9", good_machine_spec()),
            ),
            "spec.providerID is immutable",
        ),
        (
            "endpoint port out of range",
            Step::Create(cluster(
                "c1",
                json!({"controlPlaneEndpoint": {"host": "10.0.0.10", "port": 70000}}),
            )),
            "spec.controlPlaneEndpoint.port",
        ),
        (
            "endpoint host without port",
            Step::Create(cluster(
                "c2",
                json!({"controlPlaneEndpoint": {"host": "10.0.0.10", "port": 0}}),
            )),
            "spec.controlPlaneEndpoint",
        ),
        (
            "file with content and contentFrom",
            Step::Create(config(
                "b1",
                json!({"files": [{"path": "/etc/x", "content": "a", "contentFrom": {"secret": {"name": "s", "key": "k"}}}]}),
            )),
            "spec.files[0]",
        ),
        (
            "file with a relative path",
            Step::Create(config(
                "b2",
                json!({"files": [{"path": "etc/x", "content": "a"}]}),
            )),
            "spec.files[0].path",
        ),
        (
            "file permissions not octal",
            Step::Create(config(
                "b3",
                json!({"files": [{"path": "/etc/x", "content": "a", "permissions": "0999"}]}),
            )),
            "spec.files[0].permissions",
        ),
        (
            "user name with capitals",
            Step::Create(config("b4", json!({"users": [{"name": "Root!"}]}))),
            "spec.users[0].name",
        ),
    ];
    assert!(cases.len() >= 15);

    let mut failures = Vec::new();
    for (what, step, field) in cases {
        let result = match step {
            Step::Create(obj) => {
                let api = api_for(client, &ns.name, &obj);
                api.create(
                    &PostParams::default(),
                    &serde_json::from_value(obj).expect("object"),
                )
                .await
                .map(|_| ())
            }
            Step::Update(first, second) => {
                let api = api_for(client, &ns.name, &first);
                let name = first["metadata"]["name"]
                    .as_str()
                    .expect("name")
                    .to_string();
                let created = api
                    .create(
                        &PostParams::default(),
                        &serde_json::from_value(first).expect("object"),
                    )
                    .await
                    .unwrap_or_else(|e| {
                        panic!("{what}: the valid first version was rejected: {e}")
                    });
                let mut updated: DynamicObject = serde_json::from_value(second).expect("object");
                updated.metadata.resource_version = created.metadata.resource_version;
                api.replace(&name, &PostParams::default(), &updated)
                    .await
                    .map(|_| ())
            }
        };
        match result {
            Ok(()) => failures.push(format!("{what}: accepted")),
            Err(kube::Error::Api(status))
                if status.code == 422 && status.message.contains(field) => {}
            Err(e) => failures.push(format!("{what}: expected a 422 naming `{field}`, got: {e}")),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");

    // And the valid versions are accepted, so the rejections above are about the field.
    for obj in [
        host("valid-host", good_host_spec()),
        machine("valid-machine", good_machine_spec()),
        machine(
            "valid-image-machine",
            json!({"mode": "image", "image": {"url": "https://images.example/os.qcow2", "checksum": "a".repeat(128), "checksumType": "sha512", "format": "qcow2"}, "rootDeviceHints": {"minSizeGigabytes": 4, "rotational": false}}),
        ),
        cluster(
            "valid-cluster",
            json!({"controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443}}),
        ),
        config(
            "valid-config",
            json!({"files": [{"path": "/etc/x", "content": "a", "permissions": "0644"}], "users": [{"name": "capi"}]}),
        ),
    ] {
        api_for(client, &ns.name, &obj)
            .create(
                &PostParams::default(),
                &serde_json::from_value(obj.clone()).expect("object"),
            )
            .await
            .unwrap_or_else(|e| panic!("valid {} rejected: {e}", obj["kind"]));
    }
}

/// Fields copied from upstream Cluster API v1.14 `cluster.x-k8s.io/v1beta2`, including many our
/// types do not model.
fn upstream_machine() -> Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": {"name": "md-0-abcde", "labels": {"cluster.x-k8s.io/cluster-name": "c1", "cluster.x-k8s.io/deployment-name": "md-0"},
            "annotations": {"machine.cluster.x-k8s.io/exclude-node-draining": ""}},
        "spec": {
            "clusterName": "c1",
            "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfig", "name": "md-0-abcde"}, "dataSecretName": "md-0-abcde"},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MetalMachine", "name": "md-0-abcde"},
            "version": "v1.36.3",
            "providerID": "metalboot://default/host-0",
            "failureDomain": "rack-a",
            "minReadySeconds": 10,
            "readinessGates": [{"conditionType": "MyGate", "polarity": "Positive"}],
            "deletion": {"nodeDrainTimeoutSeconds": 60, "nodeVolumeDetachTimeoutSeconds": 30, "nodeDeletionTimeoutSeconds": 10},
            "taints": [{"key": "dedicated", "value": "gpu", "effect": "NoSchedule", "propagation": "Always"}]
        },
        "status": {
            "nodeRef": {"name": "host-0"},
            "nodeInfo": {"machineID": "m", "systemUUID": "u", "bootID": "b", "kernelVersion": "6.1.0", "osImage": "Debian 12",
                "containerRuntimeVersion": "containerd://2.1.0", "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
            "lastUpdated": "2026-07-01T10:00:00Z",
            "phase": "Running",
            "certificatesExpiryDate": "2027-07-01T10:00:00Z",
            "observedGeneration": 2,
            "initialization": {"bootstrapDataSecretCreated": true, "infrastructureProvisioned": true},
            "addresses": [{"type": "InternalIP", "address": "10.0.0.5"}, {"type": "Hostname", "address": "host-0"}],
            "failureDomain": "rack-a",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "", "lastTransitionTime": "2026-07-01T10:00:00Z", "observedGeneration": 2}],
            "deletion": {"nodeDrainStartTime": "2026-07-01T11:00:00Z"},
            "deprecated": {"v1beta1": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-07-01T10:00:00Z"}],
                "failureReason": "CreateError", "failureMessage": "boom", "readyReplicas": 1}}
        }
    })
}

fn upstream_cluster() -> Value {
    json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
        "metadata": {"name": "c1"},
        "spec": {
            "paused": false,
            "clusterNetwork": {"apiServerPort": 6443, "pods": {"cidrBlocks": ["192.168.0.0/16"]}, "services": {"cidrBlocks": ["10.128.0.0/12"]}, "serviceDomain": "cluster.local"},
            "controlPlaneEndpoint": {"host": "10.0.0.10", "port": 6443},
            "controlPlaneRef": {"apiGroup": "controlplane.cluster.x-k8s.io", "kind": "KubeadmControlPlane", "name": "c1-cp"},
            "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MetalCluster", "name": "c1"},
            "availabilityGates": [{"conditionType": "Extra", "polarity": "Positive"}],
            "topology": {"classRef": {"name": "metal", "namespace": "default"}, "version": "v1.36.3",
                "controlPlane": {"replicas": 3}, "workers": {"machineDeployments": [{"class": "default-worker", "name": "md-0", "replicas": 2}]}}
        },
        "status": {
            "initialization": {"infrastructureProvisioned": true, "controlPlaneInitialized": true},
            "controlPlane": {"desiredReplicas": 3, "replicas": 3, "readyReplicas": 3, "availableReplicas": 3, "upToDateReplicas": 3},
            "workers": {"desiredReplicas": 2, "replicas": 2},
            "failureDomains": [{"name": "rack-a", "controlPlane": true, "attributes": {"row": "1"}}],
            "phase": "Provisioned",
            "observedGeneration": 3,
            "conditions": [{"type": "Available", "status": "True", "reason": "Available", "message": "", "lastTransitionTime": "2026-07-01T10:00:00Z"}],
            "deprecated": {"v1beta1": {"conditions": [], "failureReason": null}}
        }
    })
}

/// JSON equality that ignores nulls (an absent field and a null one mean the same to the apiserver).
fn strip_nulls(v: &Value) -> Value {
    match v {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), strip_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(strip_nulls).collect()),
        other => other.clone(),
    }
}

#[test]
fn upstream_v1beta2_objects_round_trip_through_our_types() {
    let machine: Machine =
        serde_json::from_value(upstream_machine()).expect("upstream Machine deserializes");
    assert_eq!(
        machine.spec.provider_id.as_deref(),
        Some("metalboot://default/host-0")
    );
    assert_eq!(
        machine.spec.bootstrap.data_secret_name.as_deref(),
        Some("md-0-abcde")
    );
    assert_eq!(
        machine
            .status
            .as_ref()
            .and_then(|s| s.node_ref.as_ref())
            .map(|n| n.name.as_str()),
        Some("host-0")
    );
    assert_eq!(
        strip_nulls(&serde_json::to_value(&machine).expect("serialize")),
        strip_nulls(&upstream_machine())
    );

    let cluster: Cluster =
        serde_json::from_value(upstream_cluster()).expect("upstream Cluster deserializes");
    assert!(cluster.infrastructure_provisioned());
    assert_eq!(
        strip_nulls(&serde_json::to_value(&cluster).expect("serialize")),
        strip_nulls(&upstream_cluster())
    );
}

#[tokio::test]
async fn upstream_objects_keep_unmodelled_fields_through_the_standalone_crds() {
    let ns = support::namespace("upstream").await;
    install_crds(&ns.client).await;
    let machines: Api<Machine> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut object: Machine = serde_json::from_value(upstream_machine()).expect("Machine");
    object.status = None;
    machines
        .create(&PostParams::default(), &object)
        .await
        .expect("create upstream-shaped Machine");
    let read = machines.get("md-0-abcde").await.expect("read back");
    assert_eq!(read.spec.extra.get("minReadySeconds"), Some(&json!(10)));
    assert_eq!(
        read.spec.extra.get("taints"),
        upstream_machine()["spec"].get("taints")
    );
    assert_eq!(
        read.spec
            .deletion
            .as_ref()
            .and_then(|d| d.node_drain_timeout_seconds),
        Some(60)
    );
    machines
        .patch_status(
            "md-0-abcde",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": upstream_machine()["status"]})),
        )
        .await
        .expect("upstream-shaped status");
    let read = machines
        .get_status("md-0-abcde")
        .await
        .expect("read status");
    let status = read.status.expect("status");
    assert_eq!(
        status.extra.get("certificatesExpiryDate"),
        Some(&json!("2027-07-01T10:00:00Z"))
    );
    assert_eq!(
        status.extra["deprecated"]["v1beta1"]["failureReason"],
        json!("CreateError")
    );

    let clusters: Api<Cluster> = Api::namespaced(ns.client.clone(), &ns.name);
    let mut cluster: Cluster = serde_json::from_value(upstream_cluster()).expect("Cluster");
    cluster.status = None;
    clusters
        .create(&PostParams::default(), &cluster)
        .await
        .expect("create upstream-shaped Cluster");
    let read = clusters.get("c1").await.expect("read back");
    assert_eq!(
        read.spec.extra.get("topology"),
        upstream_cluster()["spec"].get("topology")
    );
}

#[tokio::test]
async fn kubectl_shows_printer_columns_and_explains_fields() {
    let ns = support::namespace("kubectl").await;
    install_crds(&ns.client).await;
    let hosts = api_for(&ns.client, &ns.name, &host("x", json!({})));
    hosts
        .create(
            &PostParams::default(),
            &serde_json::from_value(host("rack1-slot4", good_host_spec())).expect("host"),
        )
        .await
        .expect("host");
    let machines = api_for(&ns.client, &ns.name, &machine("x", json!({})));
    machines
        .create(
            &PostParams::default(),
            &serde_json::from_value(machine("worker-0", good_machine_spec())).expect("machine"),
        )
        .await
        .expect("machine");

    let out = run(kubectl().args(["get", "metalhosts,metalmachines", "-n", &ns.name]));
    let headers: Vec<&str> = out.lines().filter(|l| l.starts_with("NAME")).collect();
    assert_eq!(headers.len(), 2, "{out}");
    for column in ["STATE", "POWER", "CONSUMER", "BMC", "AGE"] {
        assert!(
            headers[0].contains(column),
            "metalhosts lacks {column}: {out}"
        );
    }
    for column in ["CLUSTER", "PHASE", "HOST", "PROVIDERID", "READY", "AGE"] {
        assert!(
            headers[1].contains(column),
            "metalmachines lacks {column}: {out}"
        );
    }
    assert!(
        out.contains("redfish://10.0.0.5/redfish/v1/Systems/1"),
        "{out}"
    );

    // The apiserver publishes a new CRD's OpenAPI a moment after it is established.
    let explained = support::eventually("kubectl explain metalhost.spec.bmc", 60, || async {
        let out = kubectl()
            .args(["explain", "metalhost.spec.bmc"])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && text.contains("credentialsName")).then_some(text)
    })
    .await;
    assert!(
        explained.contains("How to reach and authenticate"),
        "{explained}"
    );
    assert!(
        explained.contains("disableCertificateVerification"),
        "{explained}"
    );
    assert!(
        explained.contains("Skip TLS certificate verification"),
        "{explained}"
    );
}

#[test]
fn provider_components_are_rendered_from_their_bases() {
    for provider in ["infrastructure", "bootstrap"] {
        let out = Command::new(project().join("hack/render-components.sh"))
            .arg(provider)
            .output()
            .expect("render");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let file = format!("deploy/{provider}-components.yaml");
        let committed = std::fs::read_to_string(project().join(&file)).expect("committed");
        assert!(
            committed == String::from_utf8_lossy(&out.stdout),
            "{file} drifted from deploy/{provider}; run `make deploy`"
        );
    }
}

/// No container engine runs here, so the image is not built in the suite; what can be checked
/// without one is: the Dockerfile copies only what exists, runs the binary the Deployments call
/// with `manager` as their first arg, as the user they require, and the network boot programs it
/// copies exist in Debian's ipxe package.
#[test]
fn dockerfile_matches_the_deployments() {
    let dockerfile = std::fs::read_to_string(project().join("Dockerfile")).expect("Dockerfile");
    for line in dockerfile
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from"))
    {
        let words: Vec<&str> = line.split_whitespace().collect();
        for source in &words[1..words.len() - 1] {
            assert!(
                project().join(source).exists(),
                "Dockerfile copies missing {source}"
            );
        }
    }
    assert!(
        dockerfile.contains("ENTRYPOINT [\"/metalboot\"]"),
        "{dockerfile}"
    );
    assert!(dockerfile.contains("USER 65532:65532"), "{dockerfile}");
    // IPMI hosts need ipmitool in the image (the driver runs it).
    assert!(dockerfile.contains("/usr/bin/ipmitool"), "{dockerfile}");
    for program in ["undionly.kpxe", "ipxe.efi", "snponly.efi"] {
        assert!(dockerfile.contains(&format!("/usr/lib/ipxe/{program}")));
        assert!(
            Path::new("/usr/lib/ipxe").join(program).exists(),
            "Debian's ipxe package has no {program}"
        );
    }
    for provider in ["infrastructure", "bootstrap"] {
        let deployment =
            std::fs::read_to_string(project().join(format!("deploy/{provider}/deployment.yaml")))
                .expect("deployment");
        assert!(deployment.contains("drop: [ALL]"), "{provider}");
        assert!(
            deployment.contains("allowPrivilegeEscalation: false"),
            "{provider}"
        );
        assert!(
            deployment.contains("type: Recreate"),
            "{provider}: host ports and a leader Lease"
        );
        if provider == "bootstrap" {
            assert!(deployment.contains("runAsUser: 65532"), "{provider}");
            assert!(deployment.contains("runAsNonRoot: true"), "{provider}");
        } else {
            // Port 69 needs NET_BIND_SERVICE, which only root keeps in a container.
            assert!(deployment.contains("runAsUser: 0"), "{provider}");
            assert!(deployment.contains("add: [NET_BIND_SERVICE]"), "{provider}");
        }
        assert!(
            deployment.contains("            - manager\n"),
            "{provider}: args start with the subcommand"
        );
        assert!(
            deployment.contains(&format!(
                "image: ghcr.io/metalboot/metalboot:v{}\n",
                env!("CARGO_PKG_VERSION")
            )),
            "{provider}: the canonical image of this release"
        );
    }
}

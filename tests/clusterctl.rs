//! Provider mode as an operator installs it: the real `clusterctl` (built from the pinned upstream
//! release) installs upstream core, kubeadm and metalboot from a local repository rendered from
//! `deploy/`, on an apiserver of this test's own. Then metalboot's managers run exactly as the
//! installed Deployments say, and `clusterctl delete` removes metalboot and nothing of core's.

mod support;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, ListParams};
use serde_json::Value;

#[path = "support/capi.rs"]
mod capi;

use capi::Clusterctl;

const CORE_GROUP: &str = "cluster.x-k8s.io";

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// What makes a CRD what it is, as the apiserver serves it: group, names, scope, and every
/// version's name, served/storage flags, schema, subresources and columns.
fn definition(crd: &CustomResourceDefinition) -> Value {
    let spec = serde_json::to_value(&crd.spec).expect("spec");
    serde_json::json!({
        "group": spec["group"], "names": spec["names"], "scope": spec["scope"],
        "versions": spec["versions"],
    })
}

async fn crds_of_group(
    client: &kube::Client,
    group: &str,
) -> BTreeMap<String, CustomResourceDefinition> {
    Api::<CustomResourceDefinition>::all(client.clone())
        .list(&ListParams::default())
        .await
        .expect("list CRDs")
        .items
        .into_iter()
        .filter(|c| c.spec.group == group)
        .map(|c| (c.name_any(), c))
        .collect()
}

/// The kubelet's part of starting a container: env from the downward API and `$(VAR)` in args.
fn container_command(
    deployment: &Deployment,
    fields: &BTreeMap<&str, String>,
) -> (Vec<String>, Vec<(String, String)>) {
    let container = &deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .expect("pod spec")
        .containers[0];
    let mut env: Vec<(String, String)> = Vec::new();
    for var in container.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => {
                let path = &from.field_ref.as_ref().expect("fieldRef only").field_path;
                fields
                    .get(path.as_str())
                    .unwrap_or_else(|| panic!("no value for fieldRef {path}"))
                    .clone()
            }
            (None, None) => String::new(),
        };
        env.push((var.name.clone(), value));
    }
    let args = container
        .args
        .iter()
        .flatten()
        .map(|arg| {
            let mut arg = arg.clone();
            for (name, value) in &env {
                arg = arg.replace(&format!("$({name})"), value);
            }
            arg
        })
        .collect();
    (args, env)
}

struct Process(Child);
impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_as_deployed(
    deployment: &Deployment,
    pod: &str,
    kubeconfig: &std::path::Path,
    log: &std::path::Path,
) -> (Process, Vec<String>) {
    let namespace = deployment.namespace().expect("namespace");
    let fields = BTreeMap::from([
        ("metadata.namespace", namespace),
        ("metadata.name", pod.to_string()),
        ("status.hostIP", "127.0.0.1".to_string()),
    ]);
    let (args, env) = container_command(deployment, &fields);
    let child = Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args(&args)
        .envs(env)
        // Out of cluster, the kubeconfig stands in for the mounted service account.
        .env("KUBECONFIG", kubeconfig)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log"))
        .spawn()
        .expect("start metalboot as deployed");
    (Process(child), args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clusterctl_installs_metalboot_beside_upstream_core_and_deletes_only_metalboot() {
    let plane = capi::private_control_plane("clusterctl").await;
    let client = plane.client().await.expect("client");
    capi::install_cert_manager_crds(&client).await;
    let clusterctl = Clusterctl::new(&plane.kubeconfig_path);

    // The ports and DHCP are the only variables set beyond defaults: this test runs on a shared
    // machine, where metalboot must not listen for DHCP outside a namespace a test made.
    let http_port = free_port().to_string();
    let tftp_port = free_port().to_string();
    let vars = [
        ("METALBOOT_BOOT_HTTP_PORT", http_port.as_str()),
        ("METALBOOT_TFTP_PORT", tftp_port.as_str()),
        ("METALBOOT_DHCP", "off"),
    ];
    let listed = clusterctl.run(
        &[
            "generate",
            "provider",
            "--infrastructure",
            "metalboot",
            "--describe",
        ],
        &[],
    );
    assert!(listed.contains("METALBOOT_ADVERTISE_URL"), "{listed}");

    let out = clusterctl.run(
        &[
            "init",
            "--infrastructure",
            "metalboot",
            "--bootstrap",
            "metalboot",
            "--bootstrap",
            "kubeadm",
        ],
        &vars,
    );
    assert!(
        out.contains("Your management cluster has been initialized successfully"),
        "{out}"
    );

    // Core's CRDs are upstream's: what the release's components define, labelled as core's.
    let upstream: BTreeMap<String, CustomResourceDefinition> = capi::crds_in(
        &capi::capi_dir()
            .join("components/cluster-api")
            .join(capi::capi_version())
            .join("core-components.yaml"),
    )
    .into_iter()
    .map(|c| (c.name_any(), c))
    .collect();
    let installed = crds_of_group(&client, CORE_GROUP).await;
    assert!(installed.contains_key("clusters.cluster.x-k8s.io"));
    assert!(installed.contains_key("machines.cluster.x-k8s.io"));
    for (name, crd) in &installed {
        let want = upstream
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not one of core's CRDs"));
        assert!(
            definition(crd) == definition(want),
            "{name} differs from upstream core's definition"
        );
        assert_eq!(
            crd.labels()
                .get("cluster.x-k8s.io/provider")
                .map(String::as_str),
            Some("cluster-api"),
            "{name} belongs to core"
        );
    }
    assert_eq!(
        installed.len(),
        upstream
            .values()
            .filter(|c| c.spec.group == CORE_GROUP)
            .count()
    );
    let ours = crds_of_group(&client, "infrastructure.cluster.x-k8s.io").await;
    assert!(ours.contains_key("metalhosts.infrastructure.cluster.x-k8s.io"));
    assert_eq!(
        ours["metalhosts.infrastructure.cluster.x-k8s.io"]
            .labels()
            .get("cluster.x-k8s.io/provider")
            .map(String::as_str),
        Some("infrastructure-metalboot")
    );
    let bootstrap = crds_of_group(&client, "bootstrap.cluster.x-k8s.io").await;
    assert!(bootstrap.contains_key("cloudinitconfigs.bootstrap.cluster.x-k8s.io"));
    assert!(bootstrap.contains_key("kubeadmconfigs.bootstrap.cluster.x-k8s.io"));

    // Both metalboot managers start with exactly the args and env their Deployments carry.
    let logs = tempfile::tempdir().expect("tempdir");
    let infra: Deployment = Api::namespaced(client.clone(), "metalboot-system")
        .get("metalboot-manager")
        .await
        .expect("infrastructure Deployment");
    let boot: Deployment = Api::namespaced(client.clone(), "metalboot-bootstrap-system")
        .get("metalboot-bootstrap-manager")
        .await
        .expect("bootstrap Deployment");
    let (infra_process, infra_args) = start_as_deployed(
        &infra,
        "metalboot-manager-0",
        &plane.kubeconfig_path,
        &logs.path().join("infrastructure.log"),
    );
    assert!(
        infra_args.contains(&format!("--advertise-url=http://127.0.0.1:{http_port}")),
        "the advertised URL comes from the downward API: {infra_args:?}"
    );
    let (boot_process, _) = start_as_deployed(
        &boot,
        "metalboot-bootstrap-manager-0",
        &plane.kubeconfig_path,
        &logs.path().join("bootstrap.log"),
    );
    let processes = std::cell::RefCell::new(vec![
        (infra_process, "infrastructure.log"),
        (boot_process, "bootstrap.log"),
    ]);
    let leases_infra: Api<Lease> = Api::namespaced(client.clone(), "metalboot-system");
    let leases_boot: Api<Lease> = Api::namespaced(client.clone(), "metalboot-bootstrap-system");
    let ready = format!("http://127.0.0.1:{http_port}/readyz");
    let http = reqwest::Client::new();
    support::eventually_or(
        "both managers lead and the boot service is ready",
        60,
        || async {
            for (process, log) in processes.borrow_mut().iter_mut() {
                let log: &str = log;
                if let Ok(Some(status)) = process.0.try_wait() {
                    panic!(
                        "{log}: manager exited ({status}):\n{}",
                        std::fs::read_to_string(logs.path().join(log)).unwrap_or_default()
                    );
                }
            }
            let holder = |l: Option<Lease>| l.and_then(|l| l.spec?.holder_identity);
            let infra_holder = holder(leases_infra.get_opt("metalboot-manager").await.ok()?)?;
            let boot_holder = holder(leases_boot.get_opt("metalboot-bootstrap").await.ok()?)?;
            let ok = http.get(&ready).send().await.ok()?.status().is_success();
            (ok && infra_holder == "metalboot-manager-0"
                && boot_holder == "metalboot-bootstrap-manager-0")
                .then_some(())
        },
    )
    .await
    .unwrap_or_else(|| {
        panic!(
            "managers not ready:\n{}\n{}",
            std::fs::read_to_string(logs.path().join("infrastructure.log")).unwrap_or_default(),
            std::fs::read_to_string(logs.path().join("bootstrap.log")).unwrap_or_default()
        )
    });
    drop(processes);

    // Deleting metalboot with its CRDs leaves every one of core's untouched.
    let before: BTreeMap<String, Option<String>> = installed
        .iter()
        .map(|(n, c)| (n.clone(), c.resource_version()))
        .collect();
    // One provider per command: clusterctl 1.14 deleting both at once with --include-crd lists
    // the first one's just-deleted kinds from a stale discovery cache and fails.
    for provider in ["--infrastructure", "--bootstrap"] {
        clusterctl.run(&["delete", provider, "metalboot", "--include-crd"], &[]);
    }
    let after: BTreeMap<String, Option<String>> = crds_of_group(&client, CORE_GROUP)
        .await
        .iter()
        .map(|(n, c)| (n.clone(), c.resource_version()))
        .collect();
    assert_eq!(after, before, "core's CRDs are neither deleted nor written");
    support::eventually_or("metalboot's CRDs are gone", 60, || async {
        let left = crds_of_group(&client, "infrastructure.cluster.x-k8s.io").await;
        let boot = crds_of_group(&client, "bootstrap.cluster.x-k8s.io").await;
        (left.is_empty() && !boot.contains_key("cloudinitconfigs.bootstrap.cluster.x-k8s.io"))
            .then_some(())
    })
    .await
    .expect("metalboot's CRDs deleted");
    assert!(
        crds_of_group(&client, "bootstrap.cluster.x-k8s.io")
            .await
            .contains_key("kubeadmconfigs.bootstrap.cluster.x-k8s.io"),
        "kubeadm's CRDs stay"
    );
}

//! The foundation: a real kube-apiserver built from source, CRDs and custom objects on it, and the
//! CLI's behaviour when no cluster can be reached.

mod support;

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, conditions, wait::await_condition, watcher};
use kube::{CustomResource, CustomResourceExt, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A throwaway CRD that exists only to prove CRDs and custom objects work on our control plane.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, JsonSchema)]
#[kube(
    group = "test.metalboot.dev",
    version = "v1",
    kind = "Widget",
    namespaced
)]
struct WidgetSpec {
    size: i32,
}

#[tokio::test]
async fn crd_and_custom_object_lifecycle_on_the_real_apiserver() {
    let ns = support::namespace("foundation").await;
    let crds: Api<CustomResourceDefinition> = Api::all(ns.client.clone());
    crds.patch(
        "widgets.test.metalboot.dev",
        &PatchParams::apply("metalboot-test").force(),
        &Patch::Apply(Widget::crd()),
    )
    .await
    .expect("apply the Widget CRD");
    tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(
            crds,
            "widgets.test.metalboot.dev",
            conditions::is_crd_established(),
        ),
    )
    .await
    .expect("CRD established in time")
    .expect("watching the CRD");

    let widgets: Api<Widget> = Api::namespaced(ns.client.clone(), &ns.name);
    let created = widgets
        .create(
            &PostParams::default(),
            &Widget::new("w1", WidgetSpec { size: 1 }),
        )
        .await
        .expect("create a Widget");
    assert_eq!(created.spec.size, 1);
    let read = widgets.get("w1").await.expect("read it back");
    assert_eq!(read.spec.size, 1);
    assert_eq!(read.uid(), created.uid());

    // Watch from the version we read, then change the object: the watch must see the change.
    let mut updates = watcher(
        widgets.clone(),
        watcher::Config::default().fields("metadata.name=w1"),
    )
    .applied_objects()
    .boxed();
    let patch = serde_json::json!({"spec": {"size": 7}});
    widgets
        .patch("w1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("update the Widget");
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(w) = updates.try_next().await.expect("watch stream") {
            if w.spec.size == 7 {
                return w;
            }
        }
        panic!("watch ended before the update arrived");
    })
    .await
    .expect("watch delivered the update in time");
    assert_eq!(seen.spec.size, 7);

    widgets
        .delete("w1", &DeleteParams::default())
        .await
        .expect("delete the Widget");
    let gone = widgets.get_opt("w1").await.expect("read after delete");
    assert!(gone.is_none(), "Widget still there after delete");
}

fn pinned_kubernetes_version() -> String {
    let env = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/hack/control-plane/versions.env"
    ))
    .expect("read versions.env");
    env.lines()
        .find_map(|l| l.strip_prefix("KUBERNETES_VERSION="))
        .expect("KUBERNETES_VERSION in versions.env")
        .trim()
        .to_string()
}

#[test]
fn kubectl_reports_the_pinned_version() {
    let plane = support::control_plane();
    let kubectl = metalboot::controlplane::default_bin_dir().join("kubectl");
    let out = std::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig_path)
        .args(["get", "--raw", "/version"])
        .output()
        .expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let version: serde_json::Value = serde_json::from_slice(&out.stdout).expect("/version is JSON");
    assert_eq!(version["gitVersion"], pinned_kubernetes_version());
}

#[test]
fn manager_reports_the_cluster_it_connected_to() {
    let plane = support::control_plane();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .arg("manager")
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig_path)
        .arg("--check-connection")
        .output()
        .expect("run metalboot manager");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "manager failed: {stderr}");
    assert!(
        stderr.contains(&plane.server),
        "log names the server: {stderr}"
    );
}

#[test]
fn manager_logs_json_lines_when_asked() {
    let plane = support::control_plane();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args([
            "--log-format",
            "json",
            "manager",
            "--check-connection",
            "--kubeconfig",
        ])
        .arg(&plane.kubeconfig_path)
        .output()
        .expect("run metalboot manager");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "manager failed: {stderr}");
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"))
        })
        .collect();
    assert!(
        lines.iter().any(|l| l["fields"]["server"]
            .as_str()
            .is_some_and(|s| s.trim_end_matches('/') == plane.server)),
        "a JSON line carries the server: {stderr}"
    );
}

/// A CONNECT proxy on loopback that counts the tunnels it opened (to loopback targets only).
async fn counting_proxy() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let tunnels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = tunnels.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut client = BufReader::new(socket);
                let mut request = String::new();
                client.read_line(&mut request).await.ok()?;
                let target = request
                    .strip_prefix("CONNECT ")?
                    .split_whitespace()
                    .next()?
                    .to_string();
                if !target.starts_with("127.0.0.1:") {
                    return None;
                }
                loop {
                    let mut header = String::new();
                    client.read_line(&mut header).await.ok()?;
                    if header.trim().is_empty() {
                        break;
                    }
                }
                let mut upstream = tokio::net::TcpStream::connect(&target).await.ok()?;
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut client = client.into_inner();
                client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .ok()?;
                tokio::io::copy_bidirectional(&mut client, &mut upstream)
                    .await
                    .ok()
            });
        }
    });
    (url, tunnels)
}

/// Outside a cluster, HTTPS_PROXY is honoured for the apiserver, and NO_PROXY exempts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_reaches_the_apiserver_through_https_proxy_unless_no_proxy_covers_it() {
    let plane = support::control_plane();
    let (proxy, tunnels) = counting_proxy().await;
    let check = |proxy: &str, no_proxy: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
            .args(["manager", "--check-connection", "--kubeconfig"])
            .arg(&plane.kubeconfig_path)
            .env("HTTPS_PROXY", proxy)
            .env("NO_PROXY", no_proxy)
            .env_remove("https_proxy")
            .env_remove("no_proxy")
            .output()
            .expect("run metalboot manager")
    };
    let proxied = {
        let proxy = proxy.clone();
        tokio::task::spawn_blocking(move || check(&proxy, ""))
    }
    .await
    .expect("join");
    let stderr = String::from_utf8_lossy(&proxied.stderr);
    assert!(proxied.status.success(), "through the proxy: {stderr}");
    assert!(
        tunnels.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the connection went through HTTPS_PROXY"
    );
    // A proxy that refuses every connection: only NO_PROXY lets the manager in.
    let direct = tokio::task::spawn_blocking(move || check("http://127.0.0.1:9", "127.0.0.1"))
        .await
        .expect("join");
    assert!(
        direct.status.success(),
        "NO_PROXY covers the apiserver: {}",
        String::from_utf8_lossy(&direct.stderr)
    );
}

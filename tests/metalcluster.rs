//! The MetalCluster controller against the real apiserver: its failure domains follow the labels
//! of the namespace's MetalHosts as they are added, relabelled and deleted. And a manager
//! dropped in a process that goes on takes its watches with it.

mod support;

use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use metalboot::api::{MetalCluster, MetalHost};
use serde_json::json;
use support::eventually;

fn host(name: &str, rack: &str) -> MetalHost {
    serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalHost",
        "metadata": {"name": name, "labels": {"metalboot.io/failure-domain": rack}},
        "spec": {
            "bmc": {"address": "redfish://127.0.0.1:9/redfish/v1/Systems/1", "credentialsName": "none"},
            "bootMACAddress": "52:54:00:00:00:01",
            "online": false,
        }
    }))
    .expect("MetalHost")
}

async fn domains(clusters: &Api<MetalCluster>) -> Vec<String> {
    let Ok(mc) = clusters.get("mc").await else {
        return Vec::new();
    };
    mc.status
        .map(|s| s.failure_domains.into_iter().map(|d| d.name).collect())
        .unwrap_or_default()
}

async fn until_domains(clusters: &Api<MetalCluster>, want: &[&str]) {
    eventually(&format!("failure domains {want:?}"), 60, || async {
        (domains(clusters).await == want).then_some(())
    })
    .await;
}

/// Held by each test of this binary: the watch count below is the apiserver's (this binary's
/// own), so one manager at a time.
static ONE_MANAGER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test]
async fn failure_domains_follow_host_labels_through_relabels_and_deletes() {
    let _alone = ONE_MANAGER_AT_A_TIME.lock().await;
    let (ns, _manager) = support::standalone_env("mc-domains").await;
    let hosts: Api<MetalHost> = Api::namespaced(ns.client.clone(), &ns.name);
    let clusters: Api<MetalCluster> = Api::namespaced(ns.client.clone(), &ns.name);
    for (name, rack) in [("h1", "rack-a"), ("h2", "rack-b")] {
        hosts
            .create(&PostParams::default(), &host(name, rack))
            .await
            .expect("host");
    }
    let mc: MetalCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalCluster",
        "metadata": {"name": "mc"},
        "spec": {"controlPlaneEndpoint": {"host": "10.0.0.1", "port": 6443}},
    }))
    .expect("MetalCluster");
    clusters
        .create(&PostParams::default(), &mc)
        .await
        .expect("MetalCluster");
    until_domains(&clusters, &["rack-a", "rack-b"]).await;

    // A host added after the cluster, and a relabelled one, each change the domains.
    hosts
        .create(&PostParams::default(), &host("h3", "rack-c"))
        .await
        .expect("host");
    until_domains(&clusters, &["rack-a", "rack-b", "rack-c"]).await;
    hosts
        .patch(
            "h1",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"labels": {"metalboot.io/failure-domain": "rack-d"}}}),
            ),
        )
        .await
        .expect("relabel");
    until_domains(&clusters, &["rack-b", "rack-c", "rack-d"]).await;

    // The last host of a domain deleted: the domain goes too.
    hosts
        .delete("h3", &DeleteParams::default())
        .await
        .expect("delete");
    until_domains(&clusters, &["rack-b", "rack-d"]).await;
}

/// Watches of metalboot's and Cluster API's kinds open on the apiserver now, from its own gauge
/// (`apiserver_longrunning_requests`). Only a manager watches those kinds here.
async fn open_watches_of_our_kinds(client: &kube::Client) -> u64 {
    const KINDS: [&str; 6] = [
        "metalhosts",
        "metalmachines",
        "metalclusters",
        "cloudinitconfigs",
        "machines",
        "clusters",
    ];
    let request = http::Request::get("/metrics").body(Vec::new());
    let Ok(request) = request else {
        return u64::MAX;
    };
    let metrics = client
        .request_text(request)
        .await
        .expect("the apiserver's /metrics");
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_longrunning_requests{") && l.contains("verb=\"WATCH\"")
        })
        .filter(|l| {
            KINDS
                .iter()
                .any(|k| l.contains(&format!("resource=\"{k}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// A manager dropped in a process that goes on (a test's restart, the lab) stops its stores'
/// watches: their tasks end and the apiserver counts none of them open.
#[tokio::test]
async fn a_dropped_manager_leaves_no_watch_open() {
    let _alone = ONE_MANAGER_AT_A_TIME.lock().await;
    let (ns, manager) = support::standalone_env("mc-dropped").await;
    let tasks = manager.watch_tasks();
    assert!(tasks.len() >= 6, "the manager runs its stores' watches");
    // The gauge is this binary's apiserver's: before the drop it shows the manager's watches.
    eventually(
        "the manager's watches open on the apiserver",
        60,
        || async { (open_watches_of_our_kinds(&ns.client).await >= 6).then_some(()) },
    )
    .await;
    assert!(tasks.iter().all(|t| !t.is_finished()), "watches run");

    drop(manager);
    eventually("every store's watch task ended", 30, || async {
        tasks.iter().all(|t| t.is_finished()).then_some(())
    })
    .await;
    eventually(
        "no watch of ours left open on the apiserver",
        60,
        || async { (open_watches_of_our_kinds(&ns.client).await == 0).then_some(()) },
    )
    .await;
}

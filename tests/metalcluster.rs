//! The MetalCluster controller against the real apiserver: its failure domains follow the labels
//! of the namespace's MetalHosts as they are added, relabelled and deleted.

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

#[tokio::test]
async fn failure_domains_follow_host_labels_through_relabels_and_deletes() {
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

//! Leader election on a real apiserver: while one replica holds the Lease, another cannot lead.

mod support;

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use metalboot::leader::{LeaseConfig, acquire};

fn config(ns: &str, identity: &str) -> LeaseConfig {
    LeaseConfig {
        namespace: ns.into(),
        name: "metalboot-manager".into(),
        identity: identity.into(),
        duration: Duration::from_secs(15),
        renew: Duration::from_millis(500),
    }
}

#[tokio::test]
async fn a_second_replica_waits_while_the_first_leads() {
    let ns = support::namespace("leader").await;
    tokio::time::timeout(
        Duration::from_secs(10),
        acquire(ns.client.clone(), config(&ns.name, "replica-a")),
    )
    .await
    .expect("the first replica becomes leader at once");
    let second = tokio::time::timeout(
        Duration::from_secs(5),
        acquire(ns.client.clone(), config(&ns.name, "replica-b")),
    )
    .await;
    assert!(
        second.is_err(),
        "replica-b must not lead while replica-a renews the Lease"
    );
    let lease = Api::<Lease>::namespaced(ns.client.clone(), &ns.name)
        .get("metalboot-manager")
        .await
        .expect("Lease");
    let spec = lease.spec.expect("spec");
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-a"));
    let renewed = spec.renew_time.expect("renewed").0;
    assert!(
        jiff::Timestamp::now().duration_since(renewed).as_secs() < 3,
        "replica-a keeps renewing"
    );
}

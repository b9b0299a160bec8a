//! One writer per field set, on a real apiserver: the MetalHost controller's status writes, the
//! MetalMachine controller's conditioned claim/release writes and an operator's label edits all
//! hammer one MetalHost at once, and the final object holds the last write of each.

mod support;

use std::collections::BTreeMap;

use kube::api::{Api, Patch, PatchParams};
use metalboot::api::MetalHost;
use metalboot::api::metalhost::{ConsumerReference, HostState, MetalHostStatus, PowerState};
use metalboot::controllers::expectations::Expectations;
use metalboot::controllers::merge_params;
use metalboot::controllers::metalhost::write_status;
use metalboot::controllers::metalmachine::FIELD_MANAGER;
use metalboot::controllers::metalmachine::claim::{claim_patch, conditioned, release_patch};

const ROUNDS: usize = 60;

#[tokio::test]
async fn status_claims_and_operator_edits_on_one_host_lose_nothing() {
    let ns = support::namespace("writers").await;
    support::boot::install_crds(&ns.client).await;
    let created = support::boot::create_host(&ns.client, &ns.name, "h", "52:54:00:00:00:09").await;
    let hosts: Api<MetalHost> = Api::namespaced(ns.client.clone(), &ns.name);

    // The MetalHost controller: server-side apply of the whole status, always from the stale
    // object it read first (a slow reconcile), never touching spec.
    let status_writer = async {
        for round in 0..ROUNDS {
            let status = MetalHostStatus {
                state: Some(HostState::Available),
                power_state: Some(if round.is_multiple_of(2) {
                    PowerState::On
                } else {
                    PowerState::Off
                }),
                observed_generation: Some(round as i64),
                error_message: Some(format!("status round {round}")),
                ..Default::default()
            };
            write_status(&Expectations::default(), &hosts, &created, &status)
                .await
                .unwrap_or_else(|e| panic!("status round {round}: {e}"));
        }
    };

    // The MetalMachine controller: claim and release, each conditioned on the version read.
    let claim_writer = async {
        let mut conflicts = 0;
        for round in 0..ROUNDS {
            loop {
                let host = hosts.get("h").await.expect("read host");
                let patch = if round.is_multiple_of(2) {
                    claim_patch(&ConsumerReference::to_metal_machine(
                        &format!("m{round}"),
                        &ns.name,
                    ))
                } else {
                    release_patch(None)
                };
                let patch = conditioned(patch, host.metadata.resource_version.as_deref());
                match hosts
                    .patch("h", &merge_params(FIELD_MANAGER), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => break,
                    Err(kube::Error::Api(e)) if e.code == 409 => conflicts += 1,
                    Err(e) => panic!("claim round {round}: {e}"),
                }
            }
        }
        conflicts
    };

    // An operator labelling the host with their own field manager, as `kubectl apply` would.
    let operator = async {
        for round in 0..ROUNDS {
            let labels = serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "MetalHost",
                "metadata": {"labels": {"rack": format!("r{round}")}},
            });
            hosts
                .patch("h", &PatchParams::apply("operator"), &Patch::Apply(&labels))
                .await
                .unwrap_or_else(|e| panic!("operator round {round}: {e}"));
        }
    };

    let ((), conflicts, ()) = tokio::join!(status_writer, claim_writer, operator);
    let last = ROUNDS - 1;
    let host = hosts.get("h").await.expect("final host");
    println!("{ROUNDS} rounds per writer; the claim writer re-read after {conflicts} conflicts");

    let consumer = host.spec.consumer_ref.clone();
    let expected = last
        .is_multiple_of(2)
        .then(|| ConsumerReference::to_metal_machine(&format!("m{last}"), &ns.name));
    assert_eq!(consumer, expected, "the last claim/release stands");
    let status = host.status.clone().expect("status");
    assert_eq!(
        (status.observed_generation, status.error_message.as_deref()),
        (
            Some(last as i64),
            Some(format!("status round {last}").as_str())
        ),
        "the last status stands"
    );
    let mut labels: BTreeMap<String, String> = created.metadata.labels.clone().unwrap_or_default();
    labels.insert("rack".into(), format!("r{last}"));
    assert_eq!(
        host.metadata.labels.clone().unwrap_or_default(),
        labels,
        "the operator's last label stands, next to the labels the host was created with"
    );
    assert_eq!(
        (
            &host.spec.bmc,
            &host.spec.boot_mac_address,
            host.spec.online
        ),
        (
            &created.spec.bmc,
            &created.spec.boot_mac_address,
            created.spec.online
        ),
        "nobody else's spec field moved"
    );
    let managers: Vec<(String, String)> = host
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            (
                m.manager.unwrap_or_default(),
                m.subresource.unwrap_or_default(),
            )
        })
        .collect();
    assert!(
        managers.contains(&("metalboot-metalhost".into(), "status".into())),
        "status belongs to the MetalHost controller: {managers:?}"
    );
}

//! Fixtures for boot-service tests: CRDs, a MetalHost + MetalMachine + boot Secret as the
//! controller would leave them mid-provisioning, and stores watching them.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::{conditions, wait::await_condition};
use kube::{Resource, ResourceExt};
use metalboot::api::metalhost::{BmcDetails, ConsumerReference, HostState, MetalHostSpec};
use metalboot::api::metalmachine::{BootProfile, MetalMachineSpec};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::boot::http::{BootConfig, BootState, BootStores, CallbackNotice};
use metalboot::boot::tokens::{self, BootRecord, NewAttempt};
use tokio::sync::mpsc;

pub async fn install_crds(client: &kube::Client) {
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

pub async fn create_host(client: &kube::Client, ns: &str, name: &str, mac: &str) -> MetalHost {
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), ns);
    let host = MetalHost::new(
        name,
        MetalHostSpec {
            bmc: BmcDetails {
                address: "redfish+http://127.0.0.1:1/redfish/v1/Systems/1".into(),
                credentials_name: "bmc".into(),
                disable_certificate_verification: None,
                ca_secret_name: None,
            },
            boot_mac_address: mac.into(),
            boot_ip_address: None,
            boot_mode: None,
            online: true,
            description: None,
            consumer_ref: None,
            automated_cleaning_mode: None,
        },
    );
    hosts
        .create(&PostParams::default(), &host)
        .await
        .expect("create MetalHost")
}

pub async fn set_host_state(
    client: &kube::Client,
    ns: &str,
    name: &str,
    state: HostState,
    consumer: Option<&MetalMachine>,
) {
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), ns);
    let consumer_ref = consumer.map(|m| ConsumerReference::to_metal_machine(&m.name_any(), ns));
    let spec = serde_json::json!({"spec": {"consumerRef": consumer_ref}});
    hosts
        .patch(name, &PatchParams::default(), &Patch::Merge(&spec))
        .await
        .expect("set host consumerRef");
    let status = serde_json::json!({"status": {"state": state}});
    hosts
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("set host status");
}

pub async fn create_machine(
    client: &kube::Client,
    ns: &str,
    name: &str,
    boot: BootProfile,
) -> MetalMachine {
    let machines: Api<MetalMachine> = Api::namespaced(client.clone(), ns);
    let m = MetalMachine::new(
        name,
        MetalMachineSpec {
            boot: Some(boot),
            ..Default::default()
        },
    );
    machines
        .create(&PostParams::default(), &m)
        .await
        .expect("create MetalMachine")
}

/// Creates the boot Secret of attempt 1 for `machine` on `host`, as the controller would.
pub async fn create_boot_secret(
    client: &kube::Client,
    ns: &str,
    machine: &MetalMachine,
    host: &str,
    user_data: &[u8],
) -> BootRecord {
    let secret = tokens::new_boot_secret(&NewAttempt {
        namespace: ns,
        metal_machine: &machine.name_any(),
        owner: machine.controller_owner_ref(&()).expect("owner ref"),
        cluster_name: Some("c1"),
        host,
        attempt: 1,
        provider_id: &format!("metalboot://{ns}/{host}"),
        user_data,
    });
    let created = Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create boot Secret");
    tokens::parse_secret(&created).expect("parse boot Secret")
}

/// Stores over the namespace and a boot service state reading them.
pub async fn boot_state(
    client: &kube::Client,
    ns: &str,
    base_url: &str,
    pin_source_ip: bool,
) -> (Arc<BootState>, mpsc::UnboundedReceiver<CallbackNotice>) {
    boot_state_with(
        client,
        ns,
        BootConfig {
            base_url: base_url.to_string(),
            pin_source_ip,
            sentinel_wait_seconds: 600,
            deploy: None,
        },
    )
    .await
}

/// As `boot_state`, with the whole configuration given.
pub async fn boot_state_with(
    client: &kube::Client,
    ns: &str,
    config: BootConfig,
) -> (Arc<BootState>, mpsc::UnboundedReceiver<CallbackNotice>) {
    let stores = BootStores::watch(client, ns);
    for ready in [
        stores.hosts.wait_until_ready().await.is_ok(),
        stores.machines.wait_until_ready().await.is_ok(),
        stores.boot_secrets.wait_until_ready().await.is_ok(),
    ] {
        assert!(ready, "store did not sync");
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let state = BootState::new(stores, config, client.clone(), tx).expect("boot state");
    state.wait_for_stores().await;
    (Arc::new(state), rx)
}

/// Waits until the stores of `state` see `check` hold.
pub async fn until_stores(what: &str, state: &BootState, check: impl Fn(&BootStores) -> bool) {
    super::eventually(what, 20, || async { check(&state.stores).then_some(()) }).await
}

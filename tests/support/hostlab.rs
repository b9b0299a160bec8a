//! A provisioning lab for tests: the real apiserver, sushy-tools as the BMC behind a recording
//! proxy, MetalHosts for its systems, Machines with their MetalMachines, and the test playing the
//! host through the real boot service. Test crates that use it declare `faultproxy` and `sushy`.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::ResourceExt;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use metalboot::api::capi::{Cluster, ClusterSpec, Machine, MachineBootstrap, MachineSpec};
use metalboot::api::common::ContractVersionedObjectReference;
use metalboot::api::metalhost::{BmcDetails, MetalHostSpec, PowerState};
use metalboot::api::metalmachine::{BootProfile, MetalMachineSpec};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, Credentials};
use metalboot::manager::{ManagerOptions, RunningManager};

use crate::support;
use crate::support::boot::install_crds;

pub const USER: &str = "admin";
pub const PASSWORD: &str = "s3cret-bmc-pass";

pub struct Lab {
    pub ns: support::TestNamespace,
    pub sushy: crate::sushy::Sushy,
    pub proxy: crate::faultproxy::FaultProxy,
}

pub async fn lab(prefix: &str, systems: u8) -> Lab {
    lab_with(prefix, systems, false).await
}

/// A lab whose BMC proxy also plays a Redfish session service (`sessions`), so logins and
/// logouts can be counted.
pub async fn lab_with(prefix: &str, systems: u8, sessions: bool) -> Lab {
    metalboot::telemetry::init(
        metalboot::telemetry::LogFormat::Text,
        Some("info,metalboot=debug,kube_runtime=warn"),
    );
    let ns = support::namespace(prefix).await;
    install_crds(&ns.client).await;
    let sushy = crate::sushy::start(crate::sushy::SushyConfig {
        systems: (0..systems).map(crate::sushy::system).collect(),
        tls: None,
        auth: Some((USER.into(), PASSWORD.into())),
    });
    let proxy = crate::faultproxy::FaultProxy::start(&sushy.base, sessions).await;
    credentials(&ns, "bmc-credentials", PASSWORD).await;
    // The Cluster exists and its infrastructure is provisioned, as upstream would report it.
    let clusters: Api<Cluster> = Api::namespaced(ns.client.clone(), &ns.name);
    clusters
        .create(
            &PostParams::default(),
            &Cluster::new("c1", ClusterSpec::default()),
        )
        .await
        .expect("Cluster");
    clusters
        .patch_status("c1", &PatchParams::default(), &Patch::Merge(serde_json::json!({"status": {"initialization": {"infrastructureProvisioned": true}}})))
        .await
        .expect("Cluster status");
    Lab { ns, sushy, proxy }
}

/// A manager over `ns` with timings for sushy-tools hosts, on a free loopback port.
pub fn manager_options(ns: &str) -> ManagerOptions {
    ManagerOptions {
        namespace: Some(ns.to_string()),
        boot_http: "127.0.0.1:0".parse().expect("addr"),
        power_poll_interval: Duration::from_secs(10),
        // sushy-tools' fake driver applies a power action 1–11 s after the request, so a forced
        // power-off at 5 s is done by 16 s; 30 s leaves room on a loaded machine.
        graceful_off: Duration::from_secs(5),
        deprovision_timeout: Duration::from_secs(30),
        bmc_timeout: Duration::from_secs(5),
        janitor_interval: Duration::from_secs(1),
        ..Default::default()
    }
}

pub async fn credentials(ns: &support::TestNamespace, name: &str, password: &str) {
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([
            ("username".to_string(), USER.to_string()),
            ("password".to_string(), password.to_string()),
        ])),
        ..Default::default()
    };
    Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .patch(
            name,
            &PatchParams::apply("metalboot-test").force(),
            &Patch::Apply(&secret),
        )
        .await
        .expect("credentials Secret");
}

impl Lab {
    /// `host-<i>`: sushy-tools' system `i`, through the recording proxy.
    pub async fn host(&self, i: usize) -> MetalHost {
        self.host_at(
            &format!("host-{i}"),
            &self.proxy.address(&self.sushy.system_path(i)),
            &self.sushy.systems[i].macs[0],
            "bmc-credentials",
        )
        .await
    }

    /// A MetalHost for any BMC: its address, boot MAC and credentials Secret.
    pub async fn host_at(
        &self,
        name: &str,
        address: &str,
        mac: &str,
        credentials_name: &str,
    ) -> MetalHost {
        let host = MetalHost::new(
            name,
            MetalHostSpec {
                bmc: BmcDetails {
                    address: address.into(),
                    credentials_name: credentials_name.into(),
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
        Api::<MetalHost>::namespaced(self.ns.client.clone(), &self.ns.name)
            .create(&PostParams::default(), &host)
            .await
            .expect("MetalHost")
    }

    /// A Machine with ready bootstrap data and its MetalMachine, owned as the Machine controller would.
    pub async fn machine(
        &self,
        name: &str,
        timeout: Option<i32>,
        retries: Option<i32>,
    ) -> (Machine, Vec<u8>) {
        let client = &self.ns.client;
        let data = format!("#!/bin/sh\necho bootstrap {name}\n").into_bytes();
        let bootstrap = Secret {
            metadata: ObjectMeta {
                name: Some(format!("{name}-bootstrap")),
                ..Default::default()
            },
            data: Some(BTreeMap::from([(
                "value".to_string(),
                ByteString(data.clone()),
            )])),
            type_: Some("cluster.x-k8s.io/secret".into()),
            ..Default::default()
        };
        Api::<Secret>::namespaced(client.clone(), &self.ns.name)
            .create(&PostParams::default(), &bootstrap)
            .await
            .expect("bootstrap Secret");
        let machine = Machine::new(
            name,
            MachineSpec {
                cluster_name: "c1".into(),
                bootstrap: MachineBootstrap {
                    data_secret_name: Some(format!("{name}-bootstrap")),
                    ..Default::default()
                },
                infrastructure_ref: ContractVersionedObjectReference {
                    api_group: "infrastructure.cluster.x-k8s.io".into(),
                    kind: "MetalMachine".into(),
                    name: name.into(),
                },
                ..Default::default()
            },
        );
        let machine = Api::<Machine>::namespaced(client.clone(), &self.ns.name)
            .create(&PostParams::default(), &machine)
            .await
            .expect("Machine");
        let mut mm = MetalMachine::new(
            name,
            MetalMachineSpec {
                boot: Some(BootProfile {
                    kernel: "vmlinuz".into(),
                    initrds: vec!["initrd.gz".into()],
                    cmdline: Some("console=ttyS0".into()),
                }),
                boot_timeout_seconds: timeout,
                boot_retries: retries,
                ..Default::default()
            },
        );
        mm.metadata.labels = Some(BTreeMap::from([(
            "cluster.x-k8s.io/cluster-name".to_string(),
            "c1".to_string(),
        )]));
        mm.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "cluster.x-k8s.io/v1beta2".into(),
            kind: "Machine".into(),
            name: name.into(),
            uid: machine.uid().expect("uid"),
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        Api::<MetalMachine>::namespaced(client.clone(), &self.ns.name)
            .create(&PostParams::default(), &mm)
            .await
            .expect("MetalMachine");
        (machine, data)
    }

    pub async fn manager(&self) -> RunningManager {
        metalboot::manager::start(self.ns.client.clone(), manager_options(&self.ns.name))
            .await
            .expect("manager starts")
    }

    /// A driver straight to the emulator (not through the proxy), for checking what the BMC saw.
    pub fn bmc(&self, i: usize) -> RedfishBmc {
        RedfishBmc::new(
            &self.sushy.address(&self.sushy.system_path(i)),
            Credentials::new(USER, PASSWORD),
            RedfishOptions::default(),
        )
        .expect("driver")
    }

    pub async fn metal_machine(&self, name: &str) -> Option<MetalMachine> {
        Api::<MetalMachine>::namespaced(self.ns.client.clone(), &self.ns.name)
            .get_opt(name)
            .await
            .expect("get MetalMachine")
    }

    pub async fn metal_host(&self, name: &str) -> MetalHost {
        Api::<MetalHost>::namespaced(self.ns.client.clone(), &self.ns.name)
            .get(name)
            .await
            .expect("get MetalHost")
    }

    pub async fn boot_secret(&self, machine: &str) -> Option<Secret> {
        Api::<Secret>::namespaced(self.ns.client.clone(), &self.ns.name)
            .get_opt(&format!("{machine}-boot"))
            .await
            .expect("get Secret")
    }

    pub fn resets(&self) -> usize {
        self.proxy.count("POST", "/redfish/v1/Systems/")
    }

    /// The POSTs the BMC saw, for assertion messages.
    pub fn posts(&self) -> Vec<crate::faultproxy::LogEntry> {
        self.proxy
            .log()
            .into_iter()
            .filter(|e| e.method == "POST")
            .collect()
    }

    pub async fn events(&self, name: &str) -> Vec<Event> {
        Api::<Event>::namespaced(self.ns.client.clone(), &self.ns.name)
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
            .collect()
    }
}

pub async fn power_of(bmc: &RedfishBmc) -> Option<PowerState> {
    bmc.power_state().await.ok()
}

pub fn condition(mm: &MetalMachine, type_: &str) -> Option<(String, String, String)> {
    mm.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| {
            (
                c.status.to_string(),
                c.reason.to_string(),
                c.message.clone(),
            )
        })
}

/// Plays the host: fetches the chain from the boot service and returns the NoCloud seed URL.
pub async fn boot_chain(base: &str, mac: &str) -> String {
    let http = reqwest::Client::new();
    // Like iPXE, retry while the boot service says it is still starting (503 until its stores
    // have synced): the test may reach it first, right after a manager start.
    let entry = support::eventually("the boot service answers boot.ipxe", 30, || async {
        let r = http.get(format!("{base}/boot.ipxe")).send().await.ok()?;
        if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            return None;
        }
        r.text().await.ok()
    })
    .await;
    assert!(entry.contains("/ipxe/${mac:hexhyp}"), "{entry}");
    let script = http
        .get(format!("{base}/ipxe/{}", mac.replace(':', "-")))
        .send()
        .await
        .expect("host script")
        .text()
        .await
        .expect("text");
    let seed = script
        .split_whitespace()
        .find_map(|w| w.strip_prefix("ds=nocloud-net;s="))
        .unwrap_or_else(|| panic!("no NoCloud datasource in the host script:\n{script}"))
        .to_string();
    assert!(
        script.contains(&format!("kernel {base}/artifacts/vmlinuz")),
        "{script}"
    );
    seed
}

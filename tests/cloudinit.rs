//! The CloudInitConfig bootstrap provider against the real apiserver, driven the way Cluster API
//! drives it: a Machine references the config, the Machine controller adopts it, the provider
//! renders the Secret.

mod support;

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use metalboot::api::CloudInitConfig;
use metalboot::api::capi::{Machine, MachineBootstrap, MachineSpec};
use metalboot::api::common::ContractVersionedObjectReference;
use metalboot::manager::RunningManager;
use serde_json::json;
use support::{TestNamespace, eventually};

const GOLDEN: &str = include_str!("golden/cloud-config.yaml");

async fn env(prefix: &str) -> (TestNamespace, RunningManager) {
    support::standalone_env(prefix).await
}

fn config(name: &str, spec: serde_json::Value) -> CloudInitConfig {
    serde_json::from_value(json!({
        "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1", "kind": "CloudInitConfig",
        "metadata": {"name": name}, "spec": spec
    }))
    .expect("CloudInitConfig")
}

/// A Machine in `cluster` whose bootstrap is the config `config`.
async fn machine_for(ns: &TestNamespace, name: &str, cluster: &str, config: &str) -> Machine {
    let m = Machine::new(
        name,
        MachineSpec {
            cluster_name: cluster.into(),
            bootstrap: MachineBootstrap {
                config_ref: Some(ContractVersionedObjectReference {
                    api_group: "bootstrap.cluster.x-k8s.io".into(),
                    kind: "CloudInitConfig".into(),
                    name: config.into(),
                }),
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
    Api::<Machine>::namespaced(ns.client.clone(), &ns.name)
        .create(&PostParams::default(), &m)
        .await
        .expect("Machine")
}

fn golden_spec() -> serde_json::Value {
    json!({
        "users": [{"name": "capi", "sudo": "ALL=(ALL) NOPASSWD:ALL", "sshAuthorizedKeys": ["ssh-ed25519 AAAA test"]}],
        "files": [
            {"path": "/etc/a", "content": "line: 1\n'quoted' \"x\"\n", "permissions": "0600"},
            {"path": "/etc/b", "contentFrom": {"secret": {"name": "file-b", "key": "data"}}}
        ],
        "commands": ["echo 'hi: there'"]
    })
}

/// Creates the Secret `name` holding `data` (key → value) in the test's namespace.
async fn create_secret(ns: &TestNamespace, name: &str, data: &[(&str, &[u8])]) {
    let s = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        data: Some(
            data.iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.to_vec())))
                .collect(),
        ),
        ..Default::default()
    };
    Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
        .create(&PostParams::default(), &s)
        .await
        .expect("Secret");
}

#[tokio::test]
async fn secret_matches_the_golden_file_and_its_name_survives_recreation() {
    let (ns, _manager) = env("cloudinit-golden").await;
    create_secret(&ns, "file-b", &[("data", "from secret\n".as_bytes())]).await;
    let configs: Api<CloudInitConfig> = Api::namespaced(ns.client.clone(), &ns.name);
    configs
        .create(
            &PostParams::default(),
            &config("m1-bootstrap", golden_spec()),
        )
        .await
        .expect("create config");
    machine_for(&ns, "m1", "c1", "m1-bootstrap").await;

    let secrets: Api<Secret> = Api::namespaced(ns.client.clone(), &ns.name);
    let secret = eventually("bootstrap Secret", 60, || async {
        secrets.get_opt("m1-bootstrap").await.ok()?
    })
    .await;
    let data = secret.data.clone().expect("data");
    assert_eq!(
        String::from_utf8_lossy(&data["value"].0),
        GOLDEN,
        "the rendered cloud-config equals tests/golden/cloud-config.yaml"
    );
    assert_eq!(data["format"].0, b"cloud-config");
    assert_eq!(data.len(), 2, "only value and format");
    assert_eq!(secret.type_.as_deref(), Some("cluster.x-k8s.io/secret"));
    assert_eq!(
        secret.labels().get("cluster.x-k8s.io/cluster-name"),
        Some(&"c1".to_string())
    );
    let owner = secret
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .cloned()
        .expect("controller owner");
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("CloudInitConfig", "m1-bootstrap")
    );
    let status = eventually("config status", 30, || async {
        let s = configs.get("m1-bootstrap").await.ok()?.status?;
        s.ready.then_some(s)
    })
    .await;
    assert_eq!(status.data_secret_name.as_deref(), Some("m1-bootstrap"));
    assert_eq!(
        status.initialization.and_then(|i| i.data_secret_created),
        Some(true)
    );
    // The Machine picked the Secret up.
    let machines: Api<Machine> = Api::namespaced(ns.client.clone(), &ns.name);
    eventually("Machine has dataSecretName", 30, || async {
        (machines
            .get("m1")
            .await
            .ok()?
            .spec
            .bootstrap
            .data_secret_name
            .as_deref()
            == Some("m1-bootstrap"))
        .then_some(())
    })
    .await;

    // Someone deletes the Secret: it comes back under the same name with the same content.
    let first_uid = secret.uid();
    secrets
        .delete("m1-bootstrap", &DeleteParams::default())
        .await
        .expect("delete Secret");
    let again = eventually("Secret recreated", 60, || async {
        let s = secrets.get_opt("m1-bootstrap").await.ok()??;
        (s.uid() != first_uid).then_some(s)
    })
    .await;
    assert_eq!(
        String::from_utf8_lossy(&again.data.expect("data")["value"].0),
        GOLDEN
    );
}

#[tokio::test]
async fn wrong_owner_and_missing_cluster_exit_without_writing() {
    let (ns, _manager) = env("cloudinit-exit").await;
    let configs: Api<CloudInitConfig> = Api::namespaced(ns.client.clone(), &ns.name);
    let secrets: Api<Secret> = Api::namespaced(ns.client.clone(), &ns.name);

    // Owned by something that is not a Cluster API Machine.
    let mut orphan = config("orphan", json!({"commands": ["true"]}));
    orphan.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "5e2a0c3c-0000-4000-8000-000000000001",
        "controller": true}))
    .expect("owner")]);
    configs
        .create(&PostParams::default(), &orphan)
        .await
        .expect("orphan");

    // Owned by a Machine whose Cluster does not exist.
    configs
        .create(
            &PostParams::default(),
            &config("lost", json!({"commands": ["true"]})),
        )
        .await
        .expect("lost");
    let lost_machine = machine_for(&ns, "m-lost", "no-such-cluster", "lost").await;
    configs
        .patch(
            "lost",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"metadata": {
                "labels": {"cluster.x-k8s.io/cluster-name": "no-such-cluster"},
                "ownerReferences": [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                    "name": "m-lost", "uid": lost_machine.uid(), "controller": true}]}})),
        )
        .await
        .expect("own lost");

    // A control in the same namespace proves the provider is running and writing.
    configs
        .create(
            &PostParams::default(),
            &config("good", json!({"commands": ["true"]})),
        )
        .await
        .expect("good");
    machine_for(&ns, "m-good", "c1", "good").await;
    eventually("the control's Secret", 60, || async {
        secrets.get_opt("good").await.ok()?
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;

    for name in ["orphan", "lost"] {
        assert!(
            secrets.get_opt(name).await.expect("get").is_none(),
            "{name}: no Secret written"
        );
        let status = configs.get(name).await.expect("config").status;
        assert!(
            status.is_none_or(|s| !s.ready
                && s.data_secret_name.is_none()
                && s.conditions.is_empty()),
            "{name}: no status written"
        );
    }
}

#[tokio::test]
async fn invalid_spec_is_a_terminal_failure_naming_the_field() {
    let (ns, _manager) = env("cloudinit-invalid").await;
    let configs: Api<CloudInitConfig> = Api::namespaced(ns.client.clone(), &ns.name);
    configs
        .create(
            &PostParams::default(),
            &config(
                "bad",
                json!({"files": [{"path": "/etc/x", "content": "not base64 !!", "encoding": "base64"}]}),
            ),
        )
        .await
        .expect("bad");
    machine_for(&ns, "m-bad", "c1", "bad").await;
    let status = eventually("failureReason", 60, || async {
        let s = configs.get("bad").await.ok()?.status?;
        s.failure_reason.is_some().then_some(s)
    })
    .await;
    assert_eq!(status.failure_reason.as_deref(), Some("InvalidSpec"));
    let message = status.failure_message.unwrap_or_default();
    assert!(message.contains("spec.files[0].content"), "{message}");
    assert!(
        Api::<Secret>::namespaced(ns.client.clone(), &ns.name)
            .get_opt("bad")
            .await
            .expect("get")
            .is_none()
    );
    // The Machine reports the failure and stays Failed.
    let machines: Api<Machine> = Api::namespaced(ns.client.clone(), &ns.name);
    eventually("Machine Failed", 60, || async {
        (machines.get("m-bad").await.ok()?.status?.phase.as_deref() == Some("Failed")).then_some(())
    })
    .await;
}

/// A `contentFrom` Secret that does not exist yet leaves the config waiting, not failed, and is
/// used once created; configs made together then share its read (the memo), each still getting
/// its content.
#[tokio::test]
async fn a_content_from_secret_created_late_is_used_by_every_config_that_names_it() {
    let (ns, _manager) = env("cloudinit-late").await;
    let configs: Api<CloudInitConfig> = Api::namespaced(ns.client.clone(), &ns.name);
    let secrets: Api<Secret> = Api::namespaced(ns.client.clone(), &ns.name);
    let spec = json!({"files": [
        {"path": "/etc/late", "contentFrom": {"secret": {"name": "late-file", "key": "data"}}}
    ]});
    configs
        .create(&PostParams::default(), &config("late-0", spec.clone()))
        .await
        .expect("late-0");
    machine_for(&ns, "late-0", "c1", "late-0").await;
    let waiting = eventually("late-0 waits for its Secret", 60, || async {
        let status = configs.get("late-0").await.ok()?.status?;
        let ready = status.conditions.iter().find(|c| c.type_ == "Ready")?;
        (ready.status == "False").then(|| (ready.message.clone(), status.failure_reason))
    })
    .await;
    assert!(waiting.0.contains("late-file"), "{}", waiting.0);
    assert_eq!(
        waiting.1, None,
        "a missing Secret is not a terminal failure"
    );

    create_secret(&ns, "late-file", &[("data", "arrived late\n".as_bytes())]).await;
    for i in 1..6 {
        let name = format!("late-{i}");
        configs
            .create(&PostParams::default(), &config(&name, spec.clone()))
            .await
            .expect("config");
        machine_for(&ns, &name, "c1", &name).await;
    }
    for i in 0..6 {
        let name = format!("late-{i}");
        let rendered = eventually("bootstrap Secret", 60, || async {
            secrets.get_opt(&name).await.ok()?
        })
        .await;
        let value = String::from_utf8_lossy(&rendered.data.expect("data")["value"].0).into_owned();
        assert!(value.contains("arrived late"), "{name}: {value}");
    }
}

/// Renders that ask for the same `contentFrom` Secret while its read is on its way join that
/// read, whichever keys they want of it; a render that asks after the answer reads again (no
/// value outlives its read), and so does one after a miss.
#[tokio::test]
async fn renders_asking_together_share_one_read_of_a_content_from_secret() {
    use metalboot::api::common::SecretKeyReference;
    use metalboot::controllers::cloudinitconfig::{
        content_from, content_from_reads, content_from_secret,
    };
    use std::sync::atomic::Ordering;

    let ns = support::namespace("cloudinit-reads").await;
    let (counting, gets) = support::client_counting_gets("/secrets/shared").await;
    // "d" is not UTF-8: it cannot be a file's content, so it reads as absent.
    create_secret(
        &ns,
        "shared",
        &[
            ("a", "value a".as_bytes()),
            ("b", "value b".as_bytes()),
            ("d", &[0xff, 0xfe]),
        ],
    )
    .await;
    let secrets: Api<Secret> = Api::namespaced(counting, &ns.name);
    let reads = content_from_reads();
    let together = futures::future::join_all(
        (0..16).map(|_| content_from_secret(&reads, &secrets, &ns.name, "shared")),
    )
    .await;
    for (i, values) in together.into_iter().enumerate() {
        let values = values.expect("read").expect("the Secret exists");
        for (key, expected) in [("a", "value a"), ("b", "value b")] {
            assert_eq!(
                values.get(key).map(|v| &**v),
                Some(expected),
                "render {i}, {key}"
            );
        }
    }
    assert_eq!(
        gets.load(Ordering::SeqCst),
        1,
        "16 renders of two keys of one Secret: one read"
    );

    let again = content_from_secret(&reads, &secrets, &ns.name, "shared")
        .await
        .expect("read")
        .expect("the Secret exists");
    assert_eq!(again.get("a").map(|v| &**v), Some("value a"));
    assert_eq!(
        gets.load(Ordering::SeqCst),
        2,
        "asked after the answer: read again"
    );

    // One render whose files name two keys of the Secret reads it once.
    let mut read = std::collections::BTreeMap::new();
    for (key, expected) in [("a", "value a"), ("b", "value b"), ("c", ""), ("d", "")] {
        let from = SecretKeyReference {
            name: "shared".into(),
            key: key.into(),
        };
        let value = content_from(&reads, &secrets, &ns.name, &from, &mut read)
            .await
            .expect("read");
        assert_eq!(
            value.as_deref(),
            (!expected.is_empty()).then_some(expected),
            "{key}"
        );
    }
    assert_eq!(gets.load(Ordering::SeqCst), 3, "one render: one more read");

    let (counting, gets) = support::client_counting_gets("/secrets/sharedmissing").await;
    let secrets: Api<Secret> = Api::namespaced(counting, &ns.name);
    for expected_gets in [1, 2] {
        let values = content_from_secret(&reads, &secrets, &ns.name, "sharedmissing")
            .await
            .expect("read");
        assert_eq!(values, None);
        assert_eq!(
            gets.load(Ordering::SeqCst),
            expected_gets,
            "a miss is not kept"
        );
    }
}

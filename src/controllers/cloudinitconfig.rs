//! CloudInitConfig: metalboot's bootstrap provider (seed 001). Renders a `#cloud-config` into a
//! Secret named like the config, owned by it, labelled with the cluster; the document always ends
//! by writing the bootstrap-success sentinel.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::core::DeserializeGuard;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::api::cloudinitconfig::{BootstrapInitialization, CloudInitConfigSpec, FileEncoding};
use crate::api::common::SecretKeyReference;
use crate::api::{CLUSTER_NAME_LABEL, CloudInitConfig, Cluster, Machine};
use crate::stores::SharedStore;

use super::conditions::{self, Want};
use super::expectations::{Expectations, object_key, store_reflects};
use super::{Backoff, Events, ReconcileError, apply_status, key, passes_watch_filter};

pub const FIELD_MANAGER: &str = "metalboot-cloudinitconfig";
/// The file the bootstrap data creates when it succeeded (Cluster API contract).
pub const SENTINEL: &str = "/run/cluster-api/bootstrap-success.complete";
pub const SECRET_TYPE: &str = "cluster.x-k8s.io/secret";

#[derive(Serialize)]
struct User {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    groups: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    shell: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sudo: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    ssh_authorized_keys: Vec<String>,
    lock_passwd: bool,
}

#[derive(Serialize)]
struct WriteFile {
    path: String,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    encoding: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    owner: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    permissions: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    append: bool,
}

#[derive(Serialize)]
struct Ntp {
    enabled: bool,
    servers: Vec<String>,
}

#[derive(Serialize)]
struct CloudConfig {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    users: Vec<User>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ntp: Option<Ntp>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    bootcmd: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    write_files: Vec<WriteFile>,
    runcmd: Vec<String>,
}

/// Renders the `#cloud-config`. `resolved` maps `spec.files[i]` with `contentFrom` to its content.
/// Built from typed values with serde_yaml, so user content cannot break the document.
pub fn render(
    spec: &CloudInitConfigSpec,
    resolved: &BTreeMap<usize, Arc<str>>,
) -> Result<String, String> {
    let mut write_files = Vec::new();
    for (i, f) in spec.files.iter().enumerate() {
        let content = match (&f.content, resolved.get(&i)) {
            (Some(c), _) => c.clone(),
            (None, Some(c)) => c.to_string(),
            (None, None) => return Err(format!("spec.files[{i}]: no content")),
        };
        if f.encoding == Some(FileEncoding::Base64) {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD
                .decode(content.trim())
                .map_err(|e| format!("spec.files[{i}].content is not valid base64: {e}"))?;
        }
        write_files.push(WriteFile {
            path: f.path.clone(),
            content,
            encoding: f.encoding.map(|_| "b64".to_string()),
            owner: f.owner.clone(),
            permissions: f.permissions.clone(),
            append: f.append.unwrap_or(false),
        });
    }
    // cloud-init runs runcmd as one shell script, one line per entry, without `set -e`: a failed
    // command would not stop the sentinel. `set -e` first makes the sentinel mean "every
    // command succeeded".
    let mut runcmd = vec!["set -e".to_string()];
    runcmd.extend(spec.commands.iter().cloned());
    runcmd.push(format!("mkdir -p /run/cluster-api && touch {SENTINEL}"));
    let doc = CloudConfig {
        users: spec
            .users
            .iter()
            .map(|u| User {
                name: u.name.clone(),
                groups: (!u.groups.is_empty()).then(|| u.groups.join(", ")),
                shell: u.shell.clone(),
                sudo: u.sudo.clone(),
                ssh_authorized_keys: u
                    .ssh_authorized_keys
                    .iter()
                    .filter(|k| !k.is_empty())
                    .cloned()
                    .collect(),
                lock_passwd: u.lock_password.unwrap_or(true),
            })
            .collect(),
        ntp: (!spec.ntp_servers.is_empty()).then(|| Ntp {
            enabled: true,
            servers: spec.ntp_servers.clone(),
        }),
        bootcmd: spec.boot_commands.clone(),
        write_files,
        runcmd,
    };
    let yaml = serde_yaml::to_string(&doc).map_err(|e| e.to_string())?;
    Ok(format!("#cloud-config\n{yaml}"))
}

pub struct ConfigContext {
    pub client: kube::Client,
    pub events: Events,
    pub backoff: Backoff,
    pub watch_filter: Option<String>,
    /// Which bootstrap Secrets exist: their names, from this controller's own watch of their
    /// metadata (see [`controller`] and `name_only`); their data is never held.
    pub secrets: Store<PartialObjectMeta<Secret>>,
    /// The manager's shared Cluster store, when it runs one (not in bootstrap-only mode).
    pub clusters: Option<Store<DeserializeGuard<Cluster>>>,
    /// Status writes the config store has not shown yet: a pass from the older copy waits
    /// (it would only write the same status again).
    pub expectations: Expectations,
    /// `contentFrom` reads on their way, for renders asking the same to join (see
    /// [`content_from`]).
    pub content_from: ContentFromReads,
}

/// Reads of `contentFrom` Secrets on their way to the apiserver, by namespace and Secret name.
/// Configs created together (a MachineDeployment scaling up) all name the same Secret, and with
/// the apiserver saturated a GET waits seconds for its turn: at N=1,000 every render sent its own,
/// 1,000 GETs of one Secret. Renders that ask while a read is waiting join it instead, whichever
/// keys they want of it. The value is dropped once its read is answered, so a render sees the
/// Secret as it was at most one read before it asked, near enough to upstream's kubeadm bootstrap
/// provider, which reads Secrets uncached (the value is baked into the bootstrap data for good).
/// `moka` gives the joining (`or_try_insert_with`: one init per key, errors not kept) and the
/// bounds.
pub type ContentFromReads = moka::future::Cache<(String, String), SecretValues>;

/// A Secret's UTF-8 values by key (a value that is not UTF-8 cannot be a file's content, so it
/// reads as absent).
pub type SecretValues = Arc<BTreeMap<String, Arc<str>>>;

/// How long a value outlives its read at most: only when the pass that read it was cancelled
/// before dropping it (normally it is dropped at once).
const CONTENT_FROM_LEFT_AT_MOST: Duration = Duration::from_secs(1);
/// Bytes held at once, keys included (a Secret holds at most 1 MiB).
const CONTENT_FROM_HELD_BYTES: u64 = 4 << 20;

pub fn content_from_reads() -> ContentFromReads {
    moka::future::Cache::builder()
        .max_capacity(CONTENT_FROM_HELD_BYTES)
        .weigher(
            |(namespace, name): &(String, String), values: &SecretValues| {
                let held: usize = values.iter().map(|(k, v)| k.len() + v.len()).sum();
                u32::try_from(namespace.len() + name.len() + held + 1).unwrap_or(u32::MAX)
            },
        )
        .time_to_live(CONTENT_FROM_LEFT_AT_MOST)
        .build()
}

/// Why a `contentFrom` Secret has no values.
#[derive(Debug)]
enum ContentMiss {
    /// The Secret does not exist.
    Absent,
    Read(kube::Error),
}

/// The error of a read other renders may have joined: owned when this render was the only
/// one, otherwise rebuilt (an apiserver refusal keeps its status and code). `None`: no Secret.
fn shared_miss(miss: Arc<ContentMiss>) -> Option<kube::Error> {
    match Arc::try_unwrap(miss) {
        Ok(ContentMiss::Absent) => None,
        Ok(ContentMiss::Read(e)) => Some(e),
        Err(shared) => match &*shared {
            ContentMiss::Absent => None,
            ContentMiss::Read(kube::Error::Api(status)) => Some(kube::Error::Api(status.clone())),
            ContentMiss::Read(e) => Some(kube::Error::Service(e.to_string().into())),
        },
    }
}

/// The UTF-8 values of a Secret that a file's `contentFrom` names, read from the apiserver or,
/// when a read of the same Secret is already waiting, by joining it (see [`ContentFromReads`]).
/// A missing Secret (`None`) and a failed read reach the renders that joined that read only.
pub async fn content_from_secret(
    reads: &ContentFromReads,
    secrets: &Api<Secret>,
    namespace: &str,
    name: &str,
) -> Result<Option<SecretValues>, ReconcileError> {
    let read_key = (namespace.to_string(), name.to_string());
    let read = async {
        let secret = secrets
            .get_opt(name)
            .await
            .map_err(ContentMiss::Read)?
            .ok_or(ContentMiss::Absent)?;
        let values = secret.data.unwrap_or_default().into_iter();
        Ok(Arc::new(
            values
                .filter_map(|(k, v)| Some((k, Arc::from(String::from_utf8(v.0).ok()?))))
                .collect(),
        ))
    };
    match reads.entry_by_ref(&read_key).or_try_insert_with(read).await {
        Ok(entry) => {
            // The render whose read it was drops it; the renders that joined have their copy.
            if entry.is_fresh() {
                reads.invalidate(&read_key).await;
            }
            Ok(Some(entry.into_value()))
        }
        Err(miss) => match shared_miss(miss) {
            None => Ok(None),
            Some(source) => Err(ReconcileError::Read {
                what: format!("Secret {name}"),
                source,
            }),
        },
    }
}

/// The value of the key a file's `contentFrom` names, each Secret read once per render however
/// many files name it (`read`: this render's Secrets so far).
pub async fn content_from(
    reads: &ContentFromReads,
    secrets: &Api<Secret>,
    namespace: &str,
    from: &SecretKeyReference,
    read: &mut BTreeMap<String, Option<SecretValues>>,
) -> Result<Option<Arc<str>>, ReconcileError> {
    let values = match read.get(&from.name) {
        Some(values) => values.clone(),
        None => {
            let values = content_from_secret(reads, secrets, namespace, &from.name).await?;
            read.insert(from.name.clone(), values.clone());
            values
        }
    };
    Ok(values.and_then(|v| v.get(&from.key).cloned()))
}

/// Whether the bootstrap data was rendered from this generation of the spec. Nothing reads the
/// spec then unless the Secret has to be written again, so the store drops it
/// (`forget_rendered_spec`). A kubeadm-sized spec is tens of KB per Machine; this lab's is 4 KB,
/// 8 MB of the manager's heap at N=2,000 (heaptrack).
fn rendered_at_generation(cfg: &CloudInitConfig) -> bool {
    cfg.status.as_ref().is_some_and(|s| {
        s.ready
            && s.data_secret_name.is_some()
            && s.observed_generation.is_some()
            && s.observed_generation == cfg.metadata.generation
    })
}

/// What the controller's store keeps of a config: no spec once it has been rendered (above).
fn forget_rendered_spec(cfg: &mut CloudInitConfig) {
    if rendered_at_generation(cfg) {
        cfg.spec = CloudInitConfigSpec::default();
    }
}

fn machine_owner(cfg: &CloudInitConfig) -> Option<String> {
    cfg.owner_references()
        .iter()
        .find(|o| o.kind == "Machine" && o.api_version.starts_with("cluster.x-k8s.io/"))
        .map(|o| o.name.clone())
}

async fn reconcile(
    cfg: Arc<CloudInitConfig>,
    ctx: Arc<ConfigContext>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(cfg.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    // Only a listed store can say "not found" (see `SharedStores::until_listed`).
    if let Some(clusters) = &ctx.clusters {
        crate::stores::until_ready(clusters).await;
    }
    let ns = cfg.namespace().unwrap_or_default();
    let name = cfg.name_any();
    let api: Api<CloudInitConfig> = Api::namespaced(ctx.client.clone(), &ns);
    let config_key = object_key("CloudInitConfig", &ns, &name);
    if !store_reflects(
        &ctx.expectations,
        &api,
        &config_key,
        &name,
        cfg.resource_version().as_deref(),
    )
    .await
    {
        return Ok(Action::requeue(Duration::from_millis(250)));
    }
    // 1. No Machine owner → exit (the Machine controller adds it).
    let Some(owner) = machine_owner(&cfg) else {
        return Ok(Action::await_change());
    };
    // 2. Terminal failure → exit.
    let status = cfg.status.clone().unwrap_or_default();
    if status.failure_reason.is_some() || status.failure_message.is_some() {
        return Ok(Action::await_change());
    }
    // 3. Cluster missing → exit (retry later; nothing written).
    let cluster_name = match cfg.labels().get(CLUSTER_NAME_LABEL) {
        Some(c) => c.clone(),
        None => Api::<Machine>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&owner)
            .await
            .map_err(ReconcileError::read(format!("Machine {owner}")))?
            .map(|m| m.spec.cluster_name)
            .unwrap_or_default(),
    };
    // From the stores where they hold the object; a miss (not there yet, or no store) is
    // confirmed by a GET. At 1,000 Machines these two GETs per pass were 14,000 requests.
    let cached_cluster = ctx
        .clusters
        .as_ref()
        .and_then(|clusters| clusters.get(&ObjectRef::new(&cluster_name).within(&ns)))
        .and_then(|guarded| guarded.0.as_ref().ok().cloned());
    let cluster = if cluster_name.is_empty() {
        None
    } else if cached_cluster.is_some() {
        cached_cluster
    } else {
        Api::<Cluster>::namespaced(ctx.client.clone(), &ns)
            .get_opt(&cluster_name)
            .await
            .map_err(ReconcileError::read(format!("Cluster {cluster_name}")))?
    };
    if cluster.is_none() {
        return Ok(Action::requeue(Duration::from_secs(15)));
    }
    // Paused (Cluster or this config): no write at all until it is unpaused.
    if super::is_paused(cfg.as_ref(), cluster.as_ref()) {
        return Ok(Action::await_change());
    }
    // 4–5. Deterministic name; create the Secret when missing.
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &ns);
    let now = conditions::now();
    let mut status = status;
    // A miss in the store is not confirmed by a GET: the create answers 409 when the Secret
    // exists (a lagging store). Until the store's first list, every Secret would be a miss.
    crate::stores::until_ready(&ctx.secrets).await;
    let written = ctx
        .secrets
        .get(&ObjectRef::new(&name).within(&ns))
        .is_some();
    if !written {
        // The store dropped a rendered config's spec; rendering again reads it.
        let read;
        let spec = if rendered_at_generation(&cfg) {
            read = api
                .get_opt(&name)
                .await
                .map_err(ReconcileError::read(format!("CloudInitConfig {name}")))?;
            match &read {
                Some(current) => &current.spec,
                None => return Ok(Action::await_change()),
            }
        } else {
            &cfg.spec
        };
        let mut resolved = BTreeMap::new();
        let mut secrets_read = BTreeMap::new();
        let mut problem = None;
        for (i, f) in spec.files.iter().enumerate() {
            if let Some(from) = &f.content_from {
                let value = content_from(
                    &ctx.content_from,
                    &secrets,
                    &ns,
                    &from.secret,
                    &mut secrets_read,
                )
                .await?;
                match value {
                    Some(v) => {
                        resolved.insert(i, v);
                    }
                    None => {
                        problem = Some(format!(
                            "spec.files[{i}].contentFrom.secret: Secret {}/{} has no UTF-8 key {:?}",
                            ns, from.secret.name, from.secret.key
                        ));
                        break;
                    }
                }
            }
        }
        let rendered = match problem {
            Some(p) => Err(p),
            None => render(spec, &resolved),
        };
        // The spec is to blame only if the Secret was never written: a store that lags may miss
        // one rendered before a referenced Secret went away.
        let rendered = match rendered {
            Err(message)
                if secrets
                    .get_opt(&name)
                    .await
                    .map_err(ReconcileError::read(format!("Secret {name}")))?
                    .is_none() =>
            {
                Err(message)
            }
            Err(_) => Ok(None),
            Ok(d) => Ok(Some(d)),
        };
        let data = match rendered {
            Ok(d) => d,
            Err(message) => {
                // A missing referenced Secret may appear later; an invalid spec will not.
                let transient = message.contains("contentFrom");
                conditions::set(
                    &mut status.conditions,
                    Want::f("Ready", "InvalidSpec", message.clone()),
                    cfg.metadata.generation,
                    &now,
                );
                if !transient {
                    status.failure_reason = Some("InvalidSpec".into());
                    status.failure_message = Some(message.clone());
                }
                let written = apply_status(&api, &name, FIELD_MANAGER, &status).await?;
                ctx.expectations
                    .wrote(config_key, cfg.resource_version(), written);
                ctx.events
                    .publish(cfg.as_ref(), true, "InvalidSpec", message)
                    .await;
                return Ok(if transient {
                    Action::requeue(Duration::from_secs(15))
                } else {
                    Action::await_change()
                });
            }
        };
        if let Some(data) = data {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    namespace: Some(ns.clone()),
                    labels: Some(BTreeMap::from([(
                        CLUSTER_NAME_LABEL.to_string(),
                        cluster_name.clone(),
                    )])),
                    owner_references: cfg.controller_owner_ref(&()).map(|o| vec![o]),
                    ..Default::default()
                },
                type_: Some(SECRET_TYPE.into()),
                data: Some(BTreeMap::from([
                    ("value".to_string(), ByteString(data.into_bytes())),
                    ("format".to_string(), ByteString(b"cloud-config".to_vec())),
                ])),
                ..Default::default()
            };
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    ctx.events
                        .publish(
                            cfg.as_ref(),
                            false,
                            "BootstrapDataCreated",
                            format!("Secret {name} written"),
                        )
                        .await
                }
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(ReconcileError::write(format!("Secret {name}"))(e)),
            }
        }
    }
    // 6–8. Status.
    status.data_secret_name = Some(name.clone());
    status.ready = true;
    status.initialization = Some(BootstrapInitialization {
        data_secret_created: Some(true),
    });
    status.observed_generation = cfg.metadata.generation;
    conditions::set(
        &mut status.conditions,
        Want::t(
            "Ready",
            "DataSecretCreated",
            format!("bootstrap data in Secret {name}"),
        ),
        cfg.metadata.generation,
        &now,
    );
    if super::status_changes(cfg.status.as_ref(), &status) {
        let written = apply_status(&api, &name, FIELD_MANAGER, &status).await?;
        ctx.expectations
            .wrote(config_key, cfg.resource_version(), written);
    }
    ctx.backoff.reset(&key(cfg.as_ref()));
    Ok(Action::await_change())
}

fn error_policy(
    cfg: Arc<CloudInitConfig>,
    error: &ReconcileError,
    ctx: Arc<ConfigContext>,
) -> Action {
    ctx.backoff
        .after_failure("CloudInitConfig", &key(cfg.as_ref()), error)
}

/// The Secrets this controller's watch follows: a cluster's, but not boot Secrets (they carry
/// the cluster's label too, one per provisioned host, and no config owns them).
fn bootstrap_secrets() -> watcher::Config {
    watcher::Config::default().labels(&format!(
        "{CLUSTER_NAME_LABEL},!{}",
        crate::boot::tokens::BOOT_TOKEN_LABEL
    ))
}

/// What the bootstrap Secrets' store keeps of each: its name and namespace. A pass asks it only
/// whether the config's Secret exists; the watch's events, owners included, still wake the
/// config that owns it. Labels, owners and versions were about 1 KB per provisioned host.
fn name_only(secret: &PartialObjectMeta<Secret>) -> PartialObjectMeta<Secret> {
    let mut kept = secret.clone();
    kept.types = None;
    kept.metadata = ObjectMeta {
        name: secret.metadata.name.clone(),
        namespace: secret.metadata.namespace.clone(),
        ..Default::default()
    };
    kept
}

/// The controller over `configs` (a [`SharedStore`] filled by [`watch_configs`]), and the
/// store of the bootstrap Secrets' metadata its watch of them keeps.
pub fn controller(
    client: kube::Client,
    namespace: Option<&str>,
    configs: &SharedStore<CloudInitConfig>,
) -> (
    Controller<CloudInitConfig>,
    Store<PartialObjectMeta<Secret>>,
) {
    let secrets: Api<PartialObjectMeta<Secret>> = match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // A deleted bootstrap Secret is recreated under the same name. Only metadata is watched:
    // the store answers "does it exist", and the Secrets' data (kubeconfigs, keys) stays out of
    // this process. Passes wait for its first list; after that a miss in a lagging store costs
    // a create answered 409, never a second Secret or an overwrite.
    let (store, writer) = reflector::store();
    let owned = crate::stores::reflector_keeping(
        writer,
        |s| Some(name_only(s)),
        watcher(secrets, bootstrap_secrets())
            .modify(|s| crate::stores::slim_secret_meta(s, &[], true))
            .default_backoff(),
    )
    .touched_objects();
    (
        Controller::for_shared_stream(configs.subscribe(), configs.store.clone())
            .owns_stream(owned),
        store,
    )
}

/// Fills `configs` from the apiserver; a rendered config is kept without its spec
/// (`forget_rendered_spec`). Subscribe every reader first.
pub fn watch_configs(
    configs: SharedStore<CloudInitConfig>,
    client: kube::Client,
    namespace: Option<&str>,
) -> tokio::task::JoinHandle<()> {
    let api: Api<CloudInitConfig> = match namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    configs
        .start_keeping(api, watcher::Config::default(), forget_rendered_spec)
        .1
}

pub async fn run(controller: Controller<CloudInitConfig>, ctx: Arc<ConfigContext>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::cloudinitconfig::{CloudInitFile, CloudInitUser};

    /// A read several renders waited for gives each the apiserver's refusal with its code (a
    /// 403 must read as a 403), and a missing key as no value, not as an error.
    #[test]
    fn a_shared_read_keeps_the_apiservers_answer_for_every_render() {
        let forbidden = || {
            kube::Error::Api(
                kube::core::Status::failure("secrets \"s\" is forbidden", "Forbidden")
                    .with_code(403)
                    .boxed(),
            )
        };
        let shared = Arc::new(ContentMiss::Read(forbidden()));
        let other_waiter = shared.clone();
        for miss in [shared, other_waiter] {
            match shared_miss(miss) {
                Some(kube::Error::Api(status)) => assert_eq!(status.code, 403),
                other => panic!("{other:?}"),
            }
        }
        assert!(shared_miss(Arc::new(ContentMiss::Absent)).is_none());
        let absent = Arc::new(ContentMiss::Absent);
        let _waiter = absent.clone();
        assert!(shared_miss(absent).is_none());
    }

    /// The store answers "does the Secret exist" by name, and keeps nothing else of it.
    #[test]
    fn the_bootstrap_secrets_store_keeps_only_names() {
        let secret: PartialObjectMeta<Secret> = serde_json::from_value(serde_json::json!({
            "apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata",
            "metadata": {"name": "m1", "namespace": "ns", "resourceVersion": "9", "uid": "u",
                "labels": {"cluster.x-k8s.io/cluster-name": "c"},
                "ownerReferences": [{"apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2",
                    "kind": "CloudInitConfig", "name": "m1", "uid": "cu", "controller": true}]}
        }))
        .expect("metadata");
        let kept = name_only(&secret);
        assert_eq!(
            kept.metadata,
            ObjectMeta {
                name: Some("m1".into()),
                namespace: Some("ns".into()),
                ..Default::default()
            }
        );
        assert_eq!(kept.types, None);
        assert_eq!(
            ObjectRef::from_obj(&kept),
            ObjectRef::from_obj(&secret),
            "found under the same key"
        );
    }

    #[test]
    fn rendering_is_stable_and_ends_with_the_sentinel() {
        let spec = CloudInitConfigSpec {
            users: vec![CloudInitUser {
                name: "capi".into(),
                sudo: Some("ALL=(ALL) NOPASSWD:ALL".into()),
                ssh_authorized_keys: vec!["ssh-ed25519 AAAA test".into()],
                ..Default::default()
            }],
            files: vec![
                CloudInitFile {
                    path: "/etc/a".into(),
                    content: Some("line: 1\n'quoted' \"x\"\n".into()),
                    permissions: Some("0600".into()),
                    ..Default::default()
                },
                CloudInitFile {
                    path: "/etc/b".into(),
                    ..Default::default()
                },
            ],
            commands: vec!["echo 'hi: there'".into()],
            ..Default::default()
        };
        let out =
            render(&spec, &BTreeMap::from([(1, Arc::from("from secret\n"))])).expect("render");
        let golden = "#cloud-config\nusers:\n- name: capi\n  sudo: ALL=(ALL) NOPASSWD:ALL\n  ssh_authorized_keys:\n  - ssh-ed25519 AAAA test\n  lock_passwd: true\nwrite_files:\n- path: /etc/a\n  content: |\n    line: 1\n    'quoted' \"x\"\n  permissions: '0600'\n- path: /etc/b\n  content: |\n    from secret\nruncmd:\n- set -e\n- 'echo ''hi: there'''\n- mkdir -p /run/cluster-api && touch /run/cluster-api/bootstrap-success.complete\n";
        assert_eq!(out, golden);
        let parsed: serde_yaml::Value =
            serde_yaml::from_str(out.trim_start_matches("#cloud-config\n")).expect("valid YAML");
        assert_eq!(
            parsed["write_files"][0]["content"],
            "line: 1\n'quoted' \"x\"\n"
        );
    }

    #[test]
    fn invalid_base64_names_the_field() {
        let spec = CloudInitConfigSpec {
            files: vec![CloudInitFile {
                path: "/x".into(),
                content: Some("***".into()),
                encoding: Some(FileEncoding::Base64),
                ..Default::default()
            }],
            ..Default::default()
        };
        let err = render(&spec, &BTreeMap::new()).expect_err("invalid");
        assert!(err.contains("spec.files[0].content"), "{err}");
    }

    #[test]
    fn the_store_forgets_the_spec_only_once_this_generation_is_rendered() {
        use crate::api::cloudinitconfig::CloudInitConfigStatus;
        let rendered = CloudInitConfigStatus {
            ready: true,
            data_secret_name: Some("m".into()),
            observed_generation: Some(2),
            ..Default::default()
        };
        let rows: [(&str, Option<CloudInitConfigStatus>, bool); 5] = [
            ("no status yet", None, true),
            (
                "rendered from this generation",
                Some(rendered.clone()),
                false,
            ),
            (
                "rendered from an older generation",
                Some(CloudInitConfigStatus {
                    observed_generation: Some(1),
                    ..rendered.clone()
                }),
                true,
            ),
            (
                "not ready (invalid spec)",
                Some(CloudInitConfigStatus {
                    ready: false,
                    ..rendered.clone()
                }),
                true,
            ),
            (
                "no Secret named",
                Some(CloudInitConfigStatus {
                    data_secret_name: None,
                    ..rendered.clone()
                }),
                true,
            ),
        ];
        for (row, status, spec_kept) in rows {
            let mut cfg = CloudInitConfig::new(
                "m",
                CloudInitConfigSpec {
                    commands: vec!["true".into()],
                    ..Default::default()
                },
            );
            cfg.metadata.generation = Some(2);
            cfg.status = status;
            forget_rendered_spec(&mut cfg);
            assert_eq!(!cfg.spec.commands.is_empty(), spec_kept, "{row}");
            assert_eq!(rendered_at_generation(&cfg), !spec_kept, "{row}");
        }
    }
}

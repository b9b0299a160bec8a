//! ExistingControlPlane controller: a control plane Cluster API does not manage can take joins
//! once Cluster API has what a join needs from it. That is the Cluster's `<cluster>-ca` Secret
//! (the CA whose hash every join configuration pins; the kubeadm bootstrap provider also wants
//! a non-empty `tls.key` there, though it never uses it for a worker join) and `<cluster>-kubeconfig` (how core and the bootstrap provider reach the
//! workload cluster: bootstrap tokens, Nodes, drains). The cluster is the one core names in the
//! `cluster.x-k8s.io/cluster-name` label when it adopts the object.
//!
//! Pipeline: observe (the object, its Cluster's pause, the two Secrets) → [`desired_status`]
//! (pure, one table row per rule) → one status write when it changed.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Resource;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};

use crate::api::existingcontrolplane::{ControlPlaneInitialization, ExistingControlPlaneStatus};
use crate::api::{CLUSTER_NAME_LABEL, Cluster, ExistingControlPlane};

use super::conditions::{self, Want};
use super::{Backoff, ReconcileError, apply_status, is_paused, key, passes_watch_filter};

pub const FIELD_MANAGER: &str = "metalboot-existingcontrolplane";
/// The contract's summary condition for a control plane.
pub const AVAILABLE: &str = "Available";

/// What one of the cluster's Secrets holds, as far as a join is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretState {
    Missing,
    /// Present, without a non-empty value under this key.
    Lacks(&'static str),
    Present,
}

impl SecretState {
    /// The state of `secret` given the keys a join needs from it.
    pub fn of(secret: Option<&Secret>, keys: &[&'static str]) -> SecretState {
        let Some(secret) = secret else {
            return SecretState::Missing;
        };
        let data = secret.data.as_ref();
        match keys
            .iter()
            .find(|k| data.and_then(|d| d.get(**k)).is_none_or(|v| v.0.is_empty()))
        {
            Some(key) => SecretState::Lacks(key),
            None => SecretState::Present,
        }
    }
}

/// What the controller observed of one ExistingControlPlane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The Cluster that adopted it (its cluster-name label), if any yet.
    pub cluster: Option<String>,
    pub paused: bool,
    /// `<cluster>-kubeconfig`, key `value`.
    pub kubeconfig: SecretState,
    /// `<cluster>-ca`, keys `tls.crt` and `tls.key`.
    pub ca: SecretState,
}

fn missing(what: &str, cluster: &str, suffix: &str, state: SecretState) -> Option<String> {
    match state {
        SecretState::Present => None,
        SecretState::Missing => Some(format!("no Secret {cluster}-{suffix} ({what})")),
        SecretState::Lacks(key) => Some(format!(
            "Secret {cluster}-{suffix} ({what}) has no value under {key}"
        )),
    }
}

/// The status an ExistingControlPlane should have. Initialized never goes back to false (the
/// contract); Available says whether joins can be prepared now.
pub fn desired_status(
    ecp: &ExistingControlPlane,
    o: &Observed,
    now: &Time,
) -> ExistingControlPlaneStatus {
    let mut status = ecp.status.clone().unwrap_or_default();
    let generation = ecp.metadata.generation;
    status.observed_generation = generation;
    status.external_managed_control_plane = Some(true);
    if o.paused {
        conditions::set(
            &mut status.conditions,
            Want::t("Paused", "Paused", "the Cluster or this object is paused"),
            generation,
            now,
        );
        return status;
    }
    status.conditions.retain(|c| c.type_ != "Paused");
    let available = match &o.cluster {
        None => Want::f(
            AVAILABLE,
            "WaitingForCluster",
            format!(
                "no Cluster has adopted this control plane yet (core sets the {CLUSTER_NAME_LABEL} label)"
            ),
        ),
        Some(cluster) => {
            let gaps: Vec<String> = [
                missing(
                    "the workload cluster's kubeconfig",
                    cluster,
                    "kubeconfig",
                    o.kubeconfig,
                ),
                missing("the cluster CA", cluster, "ca", o.ca),
            ]
            .into_iter()
            .flatten()
            .collect();
            if gaps.is_empty() {
                status.initialization = Some(ControlPlaneInitialization {
                    control_plane_initialized: Some(true),
                });
                Want::t(
                    AVAILABLE,
                    "SecretsPresent",
                    format!(
                        "workers may join at {}:{}",
                        ecp.spec.control_plane_endpoint.host, ecp.spec.control_plane_endpoint.port
                    ),
                )
            } else {
                Want::f(AVAILABLE, "SecretsMissing", gaps.join("; "))
            }
        }
    };
    conditions::set(&mut status.conditions, available, generation, now);
    status
}

pub struct Context {
    pub client: kube::Client,
    /// The manager's shared Cluster store, for the pause.
    pub clusters: Store<DeserializeGuard<Cluster>>,
    pub backoff: Backoff,
    pub watch_filter: Option<String>,
}

async fn reconcile(
    ecp: Arc<ExistingControlPlane>,
    ctx: Arc<Context>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(ecp.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    // Only a listed store can say "not found" (see `SharedStores::until_listed`).
    crate::stores::until_ready(&ctx.clusters).await;
    let namespace = ecp.namespace().unwrap_or_default();
    let cluster = ecp.labels().get(CLUSTER_NAME_LABEL).cloned();
    let cluster_object = cluster
        .as_ref()
        .and_then(|name| ctx.clusters.get(&ObjectRef::new(name).within(&namespace)))
        .and_then(|guard| guard.0.as_ref().ok().cloned());
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    let read = |name: String| {
        let secrets = secrets.clone();
        let namespace = namespace.clone();
        async move {
            secrets
                .get_opt(&name)
                .await
                .map_err(|source| ReconcileError::Read {
                    what: format!("Secret {namespace}/{name}"),
                    source,
                })
        }
    };
    let (kubeconfig, ca) = match &cluster {
        Some(name) => (
            read(format!("{name}-kubeconfig")).await?,
            read(format!("{name}-ca")).await?,
        ),
        None => (None, None),
    };
    let observed = Observed {
        cluster,
        paused: is_paused(ecp.as_ref(), cluster_object.as_ref()),
        kubeconfig: SecretState::of(kubeconfig.as_ref(), &["value"]),
        ca: SecretState::of(ca.as_ref(), &["tls.crt", "tls.key"]),
    };
    let status = desired_status(&ecp, &observed, &conditions::now());
    if Some(&status) != ecp.status.as_ref() {
        let api: Api<ExistingControlPlane> = Api::namespaced(ctx.client.clone(), &namespace);
        apply_status(&api, &ecp.name_any(), FIELD_MANAGER, &status).await?;
    }
    ctx.backoff.reset(&key(ecp.as_ref()));
    let initialized = status
        .initialization
        .as_ref()
        .and_then(|i| i.control_plane_initialized)
        == Some(true);
    // Secrets without the cluster label do not wake this controller: look again soon.
    Ok(Action::requeue(Duration::from_secs(if initialized {
        300
    } else {
        20
    })))
}

fn error_policy(
    ecp: Arc<ExistingControlPlane>,
    error: &ReconcileError,
    ctx: Arc<Context>,
) -> Action {
    ctx.backoff
        .after_failure("ExistingControlPlane", &key(ecp.as_ref()), error)
}

/// Wakes on its objects, on its Cluster (a pause or un-pause), and on Secrets labelled with a
/// cluster name (the kubeconfig and CA Secrets Cluster API's tools write carry it). Of Secrets
/// only metadata is watched: reconcile reads the two it needs.
pub fn controller(
    client: kube::Client,
    namespace: Option<&str>,
    clusters_changes: crate::stores::Changes<DeserializeGuard<Cluster>>,
) -> Controller<ExistingControlPlane> {
    let (planes, secrets): (Api<ExistingControlPlane>, Api<PartialObjectMeta<Secret>>) =
        match namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
    let controller = crate::stores::lean_controller(planes, watcher::Config::default());
    let store = controller.store();
    let by_cluster = store.clone();
    let adopted_by = move |store: &Store<ExistingControlPlane>,
                           namespace: Option<String>,
                           cluster: Option<String>| {
        store
            .state()
            .into_iter()
            .filter(|p| {
                p.namespace() == namespace
                    && cluster.is_some()
                    && p.labels().get(CLUSTER_NAME_LABEL) == cluster.as_ref()
            })
            .map(|p| ObjectRef::from_obj(p.as_ref()))
            .collect::<Vec<_>>()
    };
    let secret_changes = watcher(
        secrets,
        watcher::Config::default().labels(CLUSTER_NAME_LABEL),
    )
    .default_backoff()
    .touched_objects();
    controller
        .watches_stream(secret_changes, move |secret| {
            adopted_by(
                &store,
                secret.namespace(),
                secret.labels().get(CLUSTER_NAME_LABEL).cloned(),
            )
        })
        .watches_shared_stream(clusters_changes, move |cluster| {
            adopted_by(
                &by_cluster,
                cluster.meta().namespace.clone(),
                cluster.meta().name.clone(),
            )
        })
}

pub async fn run(controller: Controller<ExistingControlPlane>, ctx: Arc<Context>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "ExistingControlPlane controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::common::ApiEndpoint;
    use crate::api::existingcontrolplane::ExistingControlPlaneSpec;
    use k8s_openapi::ByteString;

    fn plane(initialized: bool) -> ExistingControlPlane {
        let mut ecp = ExistingControlPlane::new(
            "c1",
            ExistingControlPlaneSpec {
                control_plane_endpoint: ApiEndpoint {
                    host: "10.0.0.10".into(),
                    port: 6443,
                },
            },
        );
        ecp.metadata.generation = Some(1);
        if initialized {
            ecp.status = Some(ExistingControlPlaneStatus {
                initialization: Some(ControlPlaneInitialization {
                    control_plane_initialized: Some(true),
                }),
                ..Default::default()
            });
        }
        ecp
    }

    fn secret(data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                    .collect(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn secret_state_names_the_first_missing_key() {
        let keys = &["tls.crt", "tls.key"];
        assert_eq!(SecretState::of(None, keys), SecretState::Missing);
        assert_eq!(
            SecretState::of(Some(&secret(&[("tls.crt", "C")])), keys),
            SecretState::Lacks("tls.key")
        );
        assert_eq!(
            SecretState::of(Some(&secret(&[("tls.crt", "C"), ("tls.key", "")])), keys),
            SecretState::Lacks("tls.key"),
            "an empty key is missing too"
        );
        assert_eq!(
            SecretState::of(Some(&secret(&[("tls.crt", "C"), ("tls.key", "K")])), keys),
            SecretState::Present
        );
    }

    /// One row per rule: (what, already initialized, observed, want initialized, want
    /// Available status and reason, words the message must carry).
    #[test]
    fn what_the_controller_decides() {
        use SecretState::*;
        let cluster = Some("c1".to_string());
        /// Available's (status, reason), or none when only Paused is set.
        type WantAvailable = Option<(&'static str, &'static str)>;
        let rows: Vec<(&str, bool, Observed, bool, WantAvailable, &str)> = vec![
            (
                "not adopted by a Cluster yet",
                false,
                Observed {
                    cluster: None,
                    paused: false,
                    kubeconfig: Missing,
                    ca: Missing,
                },
                false,
                Some(("False", "WaitingForCluster")),
                CLUSTER_NAME_LABEL,
            ),
            (
                "no kubeconfig Secret",
                false,
                Observed {
                    cluster: cluster.clone(),
                    paused: false,
                    kubeconfig: Missing,
                    ca: Present,
                },
                false,
                Some(("False", "SecretsMissing")),
                "no Secret c1-kubeconfig",
            ),
            (
                "a CA Secret without the key",
                false,
                Observed {
                    cluster: cluster.clone(),
                    paused: false,
                    kubeconfig: Present,
                    ca: Lacks("tls.key"),
                },
                false,
                Some(("False", "SecretsMissing")),
                "c1-ca (the cluster CA) has no value under tls.key",
            ),
            (
                "both Secrets: initialized, joins possible",
                false,
                Observed {
                    cluster: cluster.clone(),
                    paused: false,
                    kubeconfig: Present,
                    ca: Present,
                },
                true,
                Some(("True", "SecretsPresent")),
                "10.0.0.10:6443",
            ),
            (
                "a Secret gone later: not available, still initialized (never goes back)",
                true,
                Observed {
                    cluster: cluster.clone(),
                    paused: false,
                    kubeconfig: Missing,
                    ca: Present,
                },
                true,
                Some(("False", "SecretsMissing")),
                "c1-kubeconfig",
            ),
            (
                "paused: only the Paused condition",
                false,
                Observed {
                    cluster: cluster.clone(),
                    paused: true,
                    kubeconfig: Present,
                    ca: Present,
                },
                false,
                None,
                "",
            ),
        ];
        let now = conditions::now();
        for (what, initialized, observed, want_initialized, want_available, words) in rows {
            let status = desired_status(&plane(initialized), &observed, &now);
            assert_eq!(status.external_managed_control_plane, Some(true), "{what}");
            assert_eq!(
                status
                    .initialization
                    .as_ref()
                    .and_then(|i| i.control_plane_initialized)
                    == Some(true),
                want_initialized,
                "{what}: initialized"
            );
            let available = conditions::get(&status.conditions, AVAILABLE);
            match want_available {
                None => {
                    assert!(available.is_none(), "{what}: {available:?}");
                    assert!(conditions::is_true(&status.conditions, "Paused"), "{what}");
                }
                Some((want_status, want_reason)) => {
                    let available = available.unwrap_or_else(|| panic!("{what}: no Available"));
                    assert_eq!(
                        (available.status.as_str(), available.reason.as_str()),
                        (want_status, want_reason),
                        "{what}"
                    );
                    assert!(
                        available.message.contains(words),
                        "{what}: {}",
                        available.message
                    );
                }
            }
        }
    }
}

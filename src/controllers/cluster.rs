//! Standalone-mode Cluster status: copies the infrastructure cluster's readiness, failure domains
//! and control-plane endpoint into the Cluster, as upstream's Cluster controller would. Off when
//! upstream Cluster API runs (`--standalone=false`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, Patch};
use kube::runtime::controller::Action;
use kube::runtime::{Controller, watcher};

use crate::api::Cluster;
use crate::api::capi::ClusterStatusInitialization;

use super::conditions::{self, Want};
use super::{Backoff, ReconcileError, apply_status, key, merge_params, passes_watch_filter, refs};

pub const FIELD_MANAGER: &str = "metalboot-cluster";

pub struct StatusContext {
    pub client: kube::Client,
    pub backoff: Backoff,
    pub watch_filter: Option<String>,
}

async fn reconcile(
    cluster: Arc<Cluster>,
    ctx: Arc<StatusContext>,
) -> Result<Action, ReconcileError> {
    if !passes_watch_filter(cluster.as_ref(), ctx.watch_filter.as_deref()) || cluster.paused() {
        return Ok(Action::await_change());
    }
    let ns = cluster.namespace().unwrap_or_default();
    let name = cluster.name_any();
    let Some(infra_ref) = cluster
        .spec
        .infrastructure_ref
        .clone()
        .filter(|r| !r.name.is_empty())
    else {
        return Ok(Action::await_change());
    };
    let infra = refs::api_for::<DynamicObject>(&ctx.client, &ns, &infra_ref)
        .await?
        .get_opt(&infra_ref.name)
        .await
        .map_err(ReconcileError::read(format!(
            "{} {}",
            infra_ref.kind, infra_ref.name
        )))?;
    let mut status = cluster.status.clone().unwrap_or_default();
    let now = conditions::now();
    let provisioned = infra.as_ref().is_some_and(refs::provisioned);
    let was = cluster.infrastructure_provisioned();
    if provisioned || was {
        status.initialization = Some(ClusterStatusInitialization {
            infrastructure_provisioned: Some(true),
            ..status.initialization.clone().unwrap_or_default()
        });
        status.infrastructure_ready = Some(true);
        conditions::set(
            &mut status.conditions,
            Want::t(
                "InfrastructureReady",
                "Provisioned",
                format!("{} {} is provisioned", infra_ref.kind, infra_ref.name),
            ),
            cluster.metadata.generation,
            &now,
        );
    } else {
        conditions::set(
            &mut status.conditions,
            Want::f(
                "InfrastructureReady",
                "WaitingForInfrastructure",
                format!(
                    "{} {} is not provisioned yet",
                    infra_ref.kind, infra_ref.name
                ),
            ),
            cluster.metadata.generation,
            &now,
        );
    }
    if let Some(domains) = infra
        .as_ref()
        .and_then(|i| serde_json::from_value(i.data["status"]["failureDomains"].clone()).ok())
    {
        status.failure_domains = domains;
    }
    status.phase = Some(
        if provisioned || was {
            "Provisioned"
        } else if infra.is_some() {
            "Provisioning"
        } else {
            "Pending"
        }
        .into(),
    );
    status.observed_generation = cluster.metadata.generation;
    let api: Api<Cluster> = Api::namespaced(ctx.client.clone(), &ns);
    if Some(&status) != cluster.status.as_ref() {
        apply_status(&api, &name, FIELD_MANAGER, &status).await?;
    }
    let endpoint = infra
        .as_ref()
        .map(|i| i.data["spec"]["controlPlaneEndpoint"].clone())
        .filter(|e| e["host"].as_str().is_some_and(|h| !h.is_empty()));
    if cluster
        .spec
        .control_plane_endpoint
        .as_ref()
        .is_none_or(|e| !e.is_set())
        && let Some(endpoint) = endpoint
    {
        api.patch(
            &name,
            &merge_params(FIELD_MANAGER),
            &Patch::Merge(serde_json::json!({"spec": {"controlPlaneEndpoint": endpoint}})),
        )
        .await
        .map_err(ReconcileError::write(format!(
            "Cluster {name} controlPlaneEndpoint"
        )))?;
    }
    ctx.backoff.reset(&key(cluster.as_ref()));
    Ok(Action::requeue(Duration::from_secs(if provisioned {
        300
    } else {
        10
    })))
}

fn error_policy(cluster: Arc<Cluster>, error: &ReconcileError, ctx: Arc<StatusContext>) -> Action {
    ctx.backoff
        .after_failure("Cluster status", &key(cluster.as_ref()), error)
}

pub fn controller(client: kube::Client, namespace: Option<&str>) -> Controller<Cluster> {
    let clusters: Api<Cluster> = match namespace {
        Some(ns) => Api::namespaced(client, ns),
        None => Api::all(client),
    };
    crate::stores::lean_controller(clusters, watcher::Config::default())
}

pub async fn run(controller: Controller<Cluster>, ctx: Arc<StatusContext>) {
    controller
        .with_config(crate::controllers::concurrency())
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|_| async {})
        .await;
}

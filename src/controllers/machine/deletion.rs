//! Deletion, in upstream's order: pre-drain hooks → cordon + evictions (PDBs respected, bounded
//! by nodeDrainTimeout) → pre-terminate hooks → infrastructure → bootstrap config → Node →
//! Deleted, then the finalizer goes. A paused Cluster or Machine holds all of it.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use kube::runtime::controller::Action;

use crate::api::capi::MachineStatus;
use crate::api::{Cluster, Machine};
use crate::controllers::conditions::{self, Want};
use crate::controllers::expectations::{self, Seen};
use crate::controllers::refs::ContractObject;
use crate::controllers::{ReconcileError, drain, is_paused, key, refs};

use super::observe::cluster_of;
use super::{
    DRAINED, EXCLUDE_DRAIN_ANNOTATION, FIELD_MANAGER, FINALIZER, MachineContext, PRE_DRAIN_HOOK,
    PRE_TERMINATE_HOOK, write_status,
};

/// How far one pass of the deletion got.
#[derive(Debug, PartialEq)]
pub enum Progress {
    /// Something is still going away: look again after this long.
    Wait(Duration),
    Done,
}

/// Handles a Machine with a deletionTimestamp: one pass of the cleanup, its status, and the
/// finalizer removed once everything is gone.
pub async fn delete(m: Arc<Machine>, ctx: &MachineContext) -> Result<Action, ReconcileError> {
    if !m.finalizers().iter().any(|f| f == FINALIZER) {
        return Ok(Action::await_change());
    }
    let cluster = cluster_of(&ctx.clusters, &m);
    let mut status = m.status.clone().unwrap_or_default();
    if is_paused(m.as_ref(), cluster.as_deref()) {
        // Only the Paused condition (the v1beta2 contract), no step of the deletion.
        conditions::set(
            &mut status.conditions,
            Want::t(
                "Paused",
                "Paused",
                "deletion waits: the Cluster or this Machine is paused",
            ),
            m.metadata.generation,
            &conditions::now(),
        );
        write_status(ctx, &m, status).await?;
        return Ok(Action::await_change());
    }
    status.conditions.retain(|c| c.type_ != "Paused");
    let progress = cleanup(&m, cluster.as_deref(), ctx, &mut status).await;
    let version = match write_status(ctx, &m, status).await {
        Ok(version) => version,
        Err(e) => {
            tracing::warn!(machine = %key(m.as_ref()), error = %e, "could not write Machine status");
            m.resource_version()
        }
    };
    match progress? {
        Progress::Wait(after) => Ok(Action::requeue(after)),
        Progress::Done => {
            ctx.events
                .publish(m.as_ref(), false, "PhaseDeleted", "Machine deleted")
                .await;
            let finalizers: Vec<String> = m
                .finalizers()
                .iter()
                .filter(|f| *f != FINALIZER)
                .cloned()
                .collect();
            let emptied = finalizers.is_empty();
            // Conditioned on the version our status write produced, not the one we read.
            match super::act::patch_machine(
                ctx,
                &m,
                version.clone(),
                serde_json::json!({"metadata": {"finalizers": finalizers}}),
                "finalizer",
            )
            .await
            {
                Ok(_) => {}
                // Already gone: an earlier pass removed the finalizer.
                Err(ReconcileError::Write {
                    source: kube::Error::Api(ref s),
                    ..
                }) if s.code == 404 => {}
                Err(e) => return Err(e),
            }
            // The last finalizer gone, the object is deleted and the answer may carry the very
            // version it replaced: expect the deletion, so a pass from a store that still shows
            // the object waits for it instead of patching a deleted object.
            if emptied {
                ctx.expectations
                    .wrote(super::machine_key(&m), version, None);
            }
            ctx.triggers.forget_machine(m.as_ref());
            ctx.backoff.reset(&key(m.as_ref()));
            Ok(Action::await_change())
        }
    }
}

fn hooks(m: &Machine, prefix: &str) -> Vec<String> {
    m.annotations()
        .keys()
        .filter(|k| k.starts_with(prefix))
        .cloned()
        .collect()
}

/// One pass of the deletion, in upstream's order. `Wait` while something is still going away.
async fn cleanup(
    m: &Machine,
    cluster: Option<&Cluster>,
    ctx: &MachineContext,
    status: &mut MachineStatus,
) -> Result<Progress, ReconcileError> {
    let ns = m.namespace().unwrap_or_default();
    let now = conditions::now();
    let generation = m.metadata.generation;
    status.phase = Some("Deleting".into());
    let waiting = |what: String| {
        tracing::debug!(machine = %key(m), "{what}");
        Progress::Wait(Duration::from_secs(2))
    };
    // Upstream order: pre-drain hooks, drain, pre-terminate hooks, then the referenced objects.
    for (step, prefix) in [("drain", PRE_DRAIN_HOOK), ("terminate", PRE_TERMINATE_HOOK)] {
        if step == "terminate"
            && let Some(node) = status.node_ref.as_ref().map(|n| n.name.clone())
            && let Some(after) = drain_node(ctx, m, cluster, &node, status).await?
        {
            return Ok(Progress::Wait(after));
        }
        let pending = hooks(m, prefix);
        if !pending.is_empty() {
            conditions::set(
                &mut status.conditions,
                Want::t(
                    "Deleting",
                    "WaitingForHooks",
                    format!("waiting for hook annotations {pending:?}"),
                ),
                generation,
                &now,
            );
            return Ok(waiting(format!("Machine waits for hooks {pending:?}")));
        }
    }
    // Infrastructure, then bootstrap config: delete and wait until gone.
    let mut refs_in_order = vec![m.spec.infrastructure_ref.clone()];
    refs_in_order.extend(m.spec.bootstrap.config_ref.clone());
    for r in refs_in_order.into_iter().filter(|r| !r.name.is_empty()) {
        let api = refs::api_for::<ContractObject>(&ctx.client, &ns, &r).await?;
        // The watched copy when there is one: a store that still shows a deleted object only
        // makes this wait, and its deletion event wakes the Machine. A miss is confirmed by a GET.
        let obj = match ctx.cached_reference(&r, &ns) {
            Some(obj) => Some(obj),
            None => api
                .get_opt(&r.name)
                .await
                .map_err(ReconcileError::read(format!("{} {}", r.kind, r.name)))?,
        };
        if let Some(obj) = obj {
            // Our own delete is pending while the store still shows the version it replaced (a
            // lagging copy without its deletionTimestamp): deleting again would only cost a
            // request, as it did ~2.5 times per released machine at N=1000.
            let ref_key = expectations::object_key(&r.kind, &ns, &r.name);
            let seen = obj.resource_version();
            let deleting = obj.metadata.deletion_timestamp.is_some()
                || ctx.expectations.check(&ref_key, seen.as_deref()) != Seen::Met;
            if !deleting {
                // Held by finalizers, the answer is the object with its deletionTimestamp; gone
                // at once (or already gone: a 404), there is no version left.
                let written = match api.delete(&r.name, &DeleteParams::default()).await {
                    Ok(answer) => answer.left().and_then(|o| o.resource_version()),
                    Err(kube::Error::Api(e)) if e.code == 404 => None,
                    Err(e) => {
                        return Err(ReconcileError::write(format!(
                            "deleting {} {}",
                            r.kind, r.name
                        ))(e));
                    }
                };
                ctx.expectations.wrote(ref_key, seen, written);
            }
            conditions::set(
                &mut status.conditions,
                Want::t(
                    "Deleting",
                    "WaitingForDeletion",
                    format!("waiting for {} {} to be deleted", r.kind, r.name),
                ),
                generation,
                &now,
            );
            return Ok(waiting(format!(
                "waiting for {} {} to be deleted",
                r.kind, r.name
            )));
        }
    }
    if let Some(node_ref) = &status.node_ref {
        match ctx
            .workloads
            .get(&ctx.client, &ns, &m.spec.cluster_name)
            .await
        {
            Ok((workload, _)) => match Api::<Node>::all(workload)
                .delete(&node_ref.name, &DeleteParams::default())
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => {
                    tracing::warn!(machine = %key(m), error = %e, "could not delete the Node; continuing")
                }
            },
            // As upstream: a deleted Cluster's Nodes go with it, nothing to wait for.
            Err(("ClusterNotFound", message)) => {
                tracing::info!(machine = %key(m), "Node not deleted: {message}")
            }
            Err((reason, message)) => {
                tracing::warn!(machine = %key(m), reason, "cannot reach the workload cluster to delete the Node: {message}")
            }
        }
    }
    status.phase = Some("Deleted".into());
    conditions::set(
        &mut status.conditions,
        Want::t(
            "Deleting",
            "Deleted",
            "infrastructure, bootstrap config and Node deleted",
        ),
        generation,
        &now,
    );
    Ok(Progress::Done)
}

/// Whether a drain that started at `started` has used up `timeout_seconds` (unset or 0: never).
pub fn drain_timed_out(
    started: Option<jiff::Timestamp>,
    now: jiff::Timestamp,
    timeout_seconds: Option<i32>,
) -> bool {
    match (started, timeout_seconds) {
        (Some(started), Some(t)) if t > 0 => now.duration_since(started).as_secs() >= i64::from(t),
        _ => false,
    }
}

/// Records drain progress: the `Deleting` condition always, and `DrainingSucceeded` (upstream's
/// v1beta1 name) once the drain is over, so later passes of the deletion do not drain again.
fn mark_drain(status: &mut MachineStatus, m: &Machine, over: bool, reason: &str, message: String) {
    let now = conditions::now();
    let generation = m.metadata.generation;
    conditions::set(
        &mut status.conditions,
        Want::t("Deleting", reason, message.clone()),
        generation,
        &now,
    );
    let drained = if over {
        Want::t(DRAINED, reason, message)
    } else {
        Want::f(DRAINED, reason, message)
    };
    conditions::set(&mut status.conditions, drained, generation, &now);
}

/// Cordons and drains the Machine's Node. `Some(requeue)` while pods remain; `None` when the drain
/// is over: done, skipped (annotation, Cluster going away, Node gone) or out of time.
async fn drain_node(
    ctx: &MachineContext,
    m: &Machine,
    cluster: Option<&Cluster>,
    node: &str,
    status: &mut MachineStatus,
) -> Result<Option<Duration>, ReconcileError> {
    if conditions::is_true(&status.conditions, DRAINED) {
        return Ok(None);
    }
    let ns = m.namespace().unwrap_or_default();
    if m.annotations().contains_key(EXCLUDE_DRAIN_ANNOTATION) {
        let why = format!("{EXCLUDE_DRAIN_ANNOTATION} is set");
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let cluster_going = cluster.is_none_or(|c| c.metadata.deletion_timestamp.is_some());
    if cluster_going {
        let why = "the Cluster is being deleted".to_string();
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let timeout = m
        .spec
        .deletion
        .as_ref()
        .and_then(|d| d.node_drain_timeout_seconds);
    let now = conditions::now();
    let deletion = status.deletion.get_or_insert_with(Default::default);
    let started = deletion.node_drain_start_time.get_or_insert(now.clone()).0;
    if drain_timed_out(Some(started), now.0, timeout) {
        let why = format!(
            "Node {node} not drained within {}s; continuing deletion",
            timeout.unwrap_or_default()
        );
        ctx.events
            .publish(m, true, "DrainTimedOut", why.clone())
            .await;
        mark_drain(status, m, true, "DrainTimedOut", why);
        return Ok(None);
    }
    let requeue = |what: String| {
        tracing::debug!(machine = %key(m), "{what}");
        Duration::from_secs(5)
    };
    let workload = match ctx
        .workloads
        .get(&ctx.client, &ns, &m.spec.cluster_name)
        .await
    {
        Ok((workload, _)) => workload,
        Err((reason, message)) => {
            let why = format!("cannot drain Node {node}: {message}");
            mark_drain(status, m, false, reason, why.clone());
            return Ok(Some(requeue(why)));
        }
    };
    let nodes: Api<Node> = Api::all(workload.clone());
    if !drain::cordon(&nodes, node, FIELD_MANAGER).await? {
        let why = format!("Node {node} no longer exists");
        mark_drain(status, m, true, "DrainSkipped", why);
        return Ok(None);
    }
    let pass = drain::evict_pass(&workload, node).await?;
    tracing::debug!(machine = %key(m), node, ?pass, "eviction pass");
    for pod in &pass.evicted {
        let what = format!("evicted pod {pod} from Node {node}");
        ctx.events.publish(m, false, "PodEvicted", what).await;
    }
    if pass.done() {
        mark_drain(
            status,
            m,
            true,
            "NodeDrained",
            format!("Node {node} drained"),
        );
        return Ok(None);
    }
    let summary = pass.summary(node);
    mark_drain(status, m, false, "DrainingNode", summary.clone());
    Ok(Some(requeue(summary)))
}

#[cfg(test)]
mod tests {
    use super::drain_timed_out;

    #[test]
    fn drain_timeout_counts_from_the_recorded_start() {
        let start: jiff::Timestamp = "2026-01-01T00:00:00Z".parse().expect("time");
        let at = |s: i64| start + jiff::SignedDuration::from_secs(s);
        let table = [
            (Some(start), at(59), Some(60), false),
            (Some(start), at(60), Some(60), true),
            (Some(start), at(9999), None, false),
            (Some(start), at(9999), Some(0), false),
            (None, at(9999), Some(60), false),
        ];
        for (i, (started, now, timeout, want)) in table.into_iter().enumerate() {
            assert_eq!(drain_timed_out(started, now, timeout), want, "row {i}");
        }
    }
}

//! Draining a Node before its Machine goes, as upstream Cluster API does: cordon, then evict every
//! pod through the Eviction API so PodDisruptionBudgets are respected. DaemonSet pods (their
//! controller would put them back) and mirror pods (the kubelet owns them) are left alone. A
//! budget that refuses (429) is not an error: the next pass tries again.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::{Api, EvictParams, ListParams, Patch};

use super::merge_params;

/// The annotation the kubelet puts on mirror pods of static pods.
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// What a drain does with one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodAction {
    Evict,
    /// Already terminating: wait for it to go.
    Wait,
    Skip(&'static str),
}

pub fn pod_action(pod: &Pod) -> PodAction {
    if pod.annotations().contains_key(MIRROR_ANNOTATION) {
        return PodAction::Skip("mirror pod");
    }
    if pod
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.kind == "DaemonSet")
    {
        return PodAction::Skip("DaemonSet pod");
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return PodAction::Wait;
    }
    PodAction::Evict
}

/// Where a drain stands after one pass.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DrainPass {
    /// Pods evicted in this pass (`namespace/name`).
    pub evicted: Vec<String>,
    /// Pods that still have to go (evictions refused, failed, or terminating).
    pub remaining: Vec<String>,
    /// Why evictions were refused, one line per pod (PDB messages from the apiserver).
    pub refused: Vec<String>,
}

impl DrainPass {
    pub fn done(&self) -> bool {
        self.remaining.is_empty()
    }

    /// A one-line summary for a condition message.
    pub fn summary(&self, node: &str) -> String {
        let mut s = format!(
            "draining Node {node}: {} pod(s) remaining",
            self.remaining.len()
        );
        if let Some(first) = self.refused.first() {
            s.push_str(&format!("; {first}"));
            if self.refused.len() > 1 {
                s.push_str(&format!(" (and {} more)", self.refused.len() - 1));
            }
        }
        s
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    #[error("cordoning Node {node}: {source}")]
    Cordon {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("listing the pods of Node {node}: {source}")]
    ListPods {
        node: String,
        #[source]
        source: kube::Error,
    },
}

/// Marks the Node unschedulable (no-op when it already is). Returns false when the Node is gone.
pub async fn cordon(nodes: &Api<Node>, node: &str, manager: &str) -> Result<bool, DrainError> {
    let Some(current) = nodes
        .get_opt(node)
        .await
        .map_err(|source| DrainError::Cordon {
            node: node.into(),
            source,
        })?
    else {
        return Ok(false);
    };
    if current.spec.and_then(|s| s.unschedulable) == Some(true) {
        return Ok(true);
    }
    let patch = serde_json::json!({"spec": {"unschedulable": true}});
    nodes
        .patch(node, &merge_params(manager), &Patch::Merge(&patch))
        .await
        .map_err(|source| DrainError::Cordon {
            node: node.into(),
            source,
        })?;
    Ok(true)
}

/// One pass: evict what may be evicted now, report what is left.
pub async fn evict_pass(client: &kube::Client, node: &str) -> Result<DrainPass, DrainError> {
    let pods: Api<Pod> = Api::all(client.clone());
    let list = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|source| DrainError::ListPods {
            node: node.into(),
            source,
        })?;
    let mut pass = DrainPass::default();
    for pod in list.items {
        let ns = pod.namespace().unwrap_or_default();
        let name = pod.name_any();
        let id = format!("{ns}/{name}");
        match pod_action(&pod) {
            PodAction::Skip(_) => {}
            PodAction::Wait => pass.remaining.push(id),
            PodAction::Evict => {
                match Api::<Pod>::namespaced(client.clone(), &ns)
                    .evict(&name, &EvictParams::default())
                    .await
                {
                    Ok(_) => pass.evicted.push(id),
                    Err(kube::Error::Api(e)) if e.code == 404 => {}
                    Err(kube::Error::Api(e)) if e.code == 429 => {
                        pass.refused.push(format!("{id}: {}", e.message));
                        pass.remaining.push(id);
                    }
                    Err(e) => {
                        pass.refused.push(format!("{id}: {e}"));
                        pass.remaining.push(id);
                    }
                }
            }
        }
    }
    Ok(pass)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};

    fn pod(owner: Option<(&str, bool)>, mirror: bool, terminating: bool) -> Pod {
        let mut p = Pod::default();
        p.metadata.name = Some("p".into());
        if let Some((kind, controller)) = owner {
            p.metadata.owner_references = Some(vec![OwnerReference {
                kind: kind.into(),
                controller: Some(controller),
                ..Default::default()
            }]);
        }
        if mirror {
            p.metadata.annotations =
                Some([(MIRROR_ANNOTATION.to_string(), "x".to_string())].into());
        }
        if terminating {
            p.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::now()));
        }
        p
    }

    #[test]
    fn which_pods_a_drain_evicts() {
        let table = [
            (pod(None, false, false), PodAction::Evict),
            (
                pod(Some(("ReplicaSet", true)), false, false),
                PodAction::Evict,
            ),
            (
                pod(Some(("DaemonSet", true)), false, false),
                PodAction::Skip("DaemonSet pod"),
            ),
            // Only the controlling owner makes a DaemonSet pod.
            (
                pod(Some(("DaemonSet", false)), false, false),
                PodAction::Evict,
            ),
            (pod(None, true, false), PodAction::Skip("mirror pod")),
            (
                pod(Some(("DaemonSet", true)), false, true),
                PodAction::Skip("DaemonSet pod"),
            ),
            (
                pod(Some(("ReplicaSet", true)), false, true),
                PodAction::Wait,
            ),
        ];
        for (i, (p, want)) in table.iter().enumerate() {
            assert_eq!(pod_action(p), *want, "row {i}");
        }
    }

    #[test]
    fn summary_names_the_first_refusal() {
        let pass = DrainPass {
            evicted: vec![],
            remaining: vec!["a/x".into(), "a/y".into()],
            refused: vec!["a/x: would violate PDB web".into(), "a/y: same".into()],
        };
        assert!(!pass.done());
        assert_eq!(
            pass.summary("n1"),
            "draining Node n1: 2 pod(s) remaining; a/x: would violate PDB web (and 1 more)"
        );
        assert!(DrainPass::default().done());
    }
}

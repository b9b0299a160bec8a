//! Which host a MetalMachine has, and which it may claim. The claim itself is
//! `MetalHost.spec.consumerRef`, written by `act` with a resourceVersion precondition, so two
//! machines never get one host; here is only the choosing (pure).

use std::sync::Arc;

use kube::ResourceExt;
use kube::core::{Selector, SelectorExt};

use crate::api::metalhost::{ConsumerReference, HostState};
use crate::api::{HOST_PAUSED_ANNOTATION, MetalHost, MetalMachine};
use crate::controllers::metalmachine::DEPROVISION_FAILED_ANNOTATION;
use crate::stable_hash::stable_hash;

/// The host whose `spec.consumerRef` names this machine (by namespace and name: UIDs change on
/// `clusterctl move`, names do not).
pub fn claimed_host<'a>(hosts: &'a [Arc<MetalHost>], mm: &MetalMachine) -> Option<&'a MetalHost> {
    let namespace = mm.namespace().unwrap_or_default();
    let name = mm.name_any();
    hosts
        .iter()
        .filter(|h| {
            h.spec
                .consumer_ref
                .as_ref()
                .is_some_and(|c| c.is_metal_machine(&namespace, &name))
        })
        .min_by_key(|h| h.name_any())
        .map(Arc::as_ref)
}

/// Why no host can be claimed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClaimError {
    #[error("no Available MetalHost in namespace {namespace} matches hostSelector {selector}")]
    NoHostAvailable { namespace: String, selector: String },
    #[error(
        "no Available MetalHost in failure domain {domain:?} (label {label}) matches hostSelector {selector}; the Machine's failure domain is a hard constraint"
    )]
    NoHostInFailureDomain {
        domain: String,
        label: String,
        selector: String,
    },
    #[error("spec.hostSelector is invalid: {0}")]
    InvalidSelector(String),
}

impl ClaimError {
    pub fn reason(&self) -> &'static str {
        match self {
            ClaimError::NoHostAvailable { .. } => "NoHostAvailable",
            ClaimError::NoHostInFailureDomain { .. } => "NoHostInFailureDomain",
            ClaimError::InvalidSelector(_) => "InvalidHostSelector",
        }
    }
}

/// A host any machine could claim, whatever it asks for: Available, online, unclaimed, not
/// paused, not deleting.
pub fn is_free(h: &MetalHost) -> bool {
    h.metadata.deletion_timestamp.is_none()
        && h.spec.consumer_ref.is_none()
        && h.status.as_ref().and_then(|s| s.state) == Some(HostState::Available)
        && h.spec.online
        && !h.annotations().contains_key(HOST_PAUSED_ANNOTATION)
}

/// The host index key of the hosts the MetalMachine `namespace/name` claims.
pub fn consumer_key(namespace: &str, name: &str) -> String {
    format!("consumer/{namespace}/{name}")
}

/// The host index key of the free hosts of `namespace` ([`is_free`]).
pub fn free_key(namespace: &str) -> String {
    format!("free/{namespace}")
}

/// What the shared hosts' store indexes a host under: its MetalMachine consumer, whether it is
/// free, its BMC Secrets and its boot MAC. Observing a machine then costs the hosts it may use, a
/// Secret change the hosts that use it, and a DHCP or iPXE request one lookup, not every host.
pub fn host_index_keys(h: &MetalHost) -> Vec<String> {
    let namespace = h.metadata.namespace.as_deref().unwrap_or_default();
    let mut keys = Vec::new();
    // Keyed by the consumer's own namespace: a host naming a machine elsewhere (which that
    // machine never claims) must still be found by the machine's changes (`metalhost` mapper).
    if let Some(c) = &h.spec.consumer_ref
        && c.kind == "MetalMachine"
    {
        keys.push(consumer_key(&c.namespace, &c.name));
    }
    if is_free(h) {
        keys.push(free_key(namespace));
    }
    keys.push(secret_key(namespace, &h.spec.bmc.credentials_name));
    if let Some(ca) = &h.spec.bmc.ca_secret_name {
        keys.push(secret_key(namespace, ca));
    }
    if let Some(mac) = crate::boot::ipxe::normalize_mac(&h.spec.boot_mac_address) {
        keys.push(boot_mac_key(&mac));
    }
    keys
}

/// The host index key of the hosts whose boot MAC is `mac` (as [`crate::boot::ipxe::normalize_mac`]
/// writes it), in every namespace: the boot service answers one NIC for one host, whichever
/// namespace registered it.
pub fn boot_mac_key(mac: &str) -> String {
    format!("mac/{mac}")
}

/// The hosts that name one boot MAC, besides the one asking: the first few (`namespace/name`,
/// in order) and how many. A placeholder MAC copied onto hundreds of hosts must not put hundreds
/// of names in each one's status.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MacSharers {
    pub first: Vec<String>,
    pub count: usize,
}

/// How many of the hosts sharing a MAC are named.
const SHARERS_NAMED: usize = 3;

impl MacSharers {
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The hosts of `listed` other than `except`.
    pub fn of(listed: &[&Arc<MetalHost>], except: Option<&MetalHost>) -> Self {
        let others = listed.iter().filter(|h| {
            except.is_none_or(|e| {
                h.metadata.namespace != e.metadata.namespace || h.metadata.name != e.metadata.name
            })
        });
        let mut sharers = MacSharers::default();
        for other in others {
            if sharers.first.len() < SHARERS_NAMED {
                sharers.first.push(format!(
                    "{}/{}",
                    other.metadata.namespace.as_deref().unwrap_or_default(),
                    other.metadata.name.as_deref().unwrap_or_default()
                ));
            }
            sharers.count += 1;
        }
        sharers
    }
}

impl std::fmt::Display for MacSharers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.first.join(", "))?;
        match self.count.saturating_sub(self.first.len()) {
            0 => Ok(()),
            more => write!(f, " and {more} more"),
        }
    }
}

/// The hosts besides `host` that name its boot MAC (none when its MAC does not read).
pub fn boot_mac_sharers(index: &crate::stores::Index<MetalHost>, host: &MetalHost) -> MacSharers {
    match crate::boot::ipxe::normalize_mac(&host.spec.boot_mac_address) {
        Some(mac) => index.pick(&boot_mac_key(&mac), |listed| {
            MacSharers::of(listed, Some(host))
        }),
        None => MacSharers::default(),
    }
}

/// The host index key of the hosts whose BMC credentials or CA Secret is `namespace/name`.
pub fn secret_key(namespace: &str, name: &str) -> String {
    format!("secret/{namespace}/{name}")
}

/// What a host must be for `mm` to claim it, read from the machine once per pass.
struct Claimable<'a> {
    mm: &'a MetalMachine,
    namespace: Option<&'a str>,
    selector: Selector,
    failure_domain: Option<&'a str>,
    failure_domain_label: &'a str,
}

impl<'a> Claimable<'a> {
    fn new(
        mm: &'a MetalMachine,
        failure_domain: Option<&'a str>,
        failure_domain_label: &'a str,
    ) -> Result<Self, ClaimError> {
        let selector = mm
            .spec
            .parsed_host_selector()
            .map_err(ClaimError::InvalidSelector)?;
        Ok(Self {
            mm,
            namespace: mm.metadata.namespace.as_deref(),
            selector,
            failure_domain,
            failure_domain_label,
        })
    }

    /// Borrows only: this runs for every host on every claiming pass (10,000 × 10,000 at scale).
    fn admits(&self, h: &MetalHost) -> bool {
        h.metadata.namespace.as_deref() == self.namespace
            && is_free(h)
            && self.selector.matches(h.labels())
            && self
                .mm
                .spec
                .host_hardware
                .as_ref()
                .is_none_or(|need| need.met_by(h.status.as_ref().and_then(|s| s.hardware.as_ref())))
            && self.failure_domain.is_none_or(|fd| {
                h.labels()
                    .get(self.failure_domain_label)
                    .map(String::as_str)
                    == Some(fd)
            })
    }

    /// Why no host was admitted.
    fn none_left(&self) -> ClaimError {
        let mm = self.mm;
        let mut selector = mm
            .spec
            .host_selector
            .as_ref()
            .and_then(|s| serde_json::to_string(s).ok())
            .unwrap_or_else(|| "{}".into());
        if let Some(need) = &mm.spec.host_hardware
            && let Ok(need) = serde_json::to_string(need)
        {
            selector.push_str(&format!(" with hardware {need}"));
        }
        match self.failure_domain {
            Some(domain) => ClaimError::NoHostInFailureDomain {
                domain: domain.into(),
                label: self.failure_domain_label.into(),
                selector,
            },
            None => ClaimError::NoHostAvailable {
                namespace: self.namespace.unwrap_or_default().into(),
                selector,
            },
        }
    }
}

/// The order in which `mm` tries hosts: it differs per machine, so racing machines try different
/// hosts first.
fn rank(seed: &str, host: &MetalHost) -> u64 {
    stable_hash(&(seed, host.metadata.name.as_deref().unwrap_or_default()))
}

fn seed(mm: &MetalMachine) -> String {
    mm.uid().unwrap_or_else(|| mm.name_any())
}

/// Hosts `mm` may claim, best first: Available, online, unclaimed, not paused, not deleting, in
/// its namespace, matching its selector and (when the Machine names one) its failure domain;
/// then an order that differs per machine so racing machines try different hosts first.
pub fn candidate_hosts(
    hosts: &[Arc<MetalHost>],
    mm: &MetalMachine,
    failure_domain: Option<&str>,
    failure_domain_label: &str,
) -> Result<Vec<Arc<MetalHost>>, ClaimError> {
    let claimable = Claimable::new(mm, failure_domain, failure_domain_label)?;
    let mut candidates: Vec<Arc<MetalHost>> = hosts
        .iter()
        .filter(|h| claimable.admits(h))
        .cloned()
        .collect();
    if candidates.is_empty() {
        return Err(claimable.none_left());
    }
    let seed = seed(mm);
    candidates.sort_by_cached_key(|h| rank(&seed, h));
    Ok(candidates)
}

/// The host to try to claim now: the first of [`candidate_hosts`], found in one pass over the
/// hosts without collecting or sorting them.
pub fn best_candidate(
    hosts: &[Arc<MetalHost>],
    mm: &MetalMachine,
    failure_domain: Option<&str>,
    failure_domain_label: &str,
) -> Result<Arc<MetalHost>, ClaimError> {
    let claimable = Claimable::new(mm, failure_domain, failure_domain_label)?;
    let seed = seed(mm);
    hosts
        .iter()
        .filter(|h| claimable.admits(h))
        .min_by_key(|h| rank(&seed, h))
        .cloned()
        .ok_or_else(|| claimable.none_left())
}

/// How many draws among the free hosts [`free_host_to_claim`] makes before it ranks them all.
const PROBES: u64 = 16;

/// What `observe` hands `decide` of the free hosts of `namespace` for a machine without a host:
/// one it may claim, or nothing (`decide` then says why none is admitted). Hosts `skip` picks
/// (claims of this process on their way) are passed over unless every free host is one of them.
///
/// The host is the first of [`PROBES`] draws among the free hosts, by a hash of the machine,
/// that it may claim; when no draw is, the first by [`rank`] of those it may claim. A host whose
/// boot MAC another host names is never handed out, though it may still be listed free until
/// the MetalHost controller marks it (the boot service would not boot it). Either way
/// each host it may claim is as likely as another, wherever it sits in the list (a rack's hosts
/// named in a row too). The draws read the index borrowed, in one look: copying every free
/// host, hashing it against the claims in flight and ranking it on every claiming pass was
/// about 13 % of the manager's CPU at N=3,000 (perf). The ranked scan, needed only when few
/// hosts suit the machine, runs on copies, outside the index's lock.
pub fn free_host_to_claim(
    index: &crate::stores::Index<MetalHost>,
    namespace: &str,
    mm: &MetalMachine,
    failure_domain: Option<&str>,
    failure_domain_label: &str,
    skip: impl Fn(&MetalHost) -> bool,
) -> Vec<Arc<MetalHost>> {
    let Ok(claimable) = Claimable::new(mm, failure_domain, failure_domain_label) else {
        return Vec::new();
    };
    let seed = seed(mm);
    let draw = |k: u64, len: usize| (stable_hash(&(seed.as_str(), k)) % len as u64) as usize;
    let mut shared: Vec<String> = Vec::new();
    let takes = |h: &MetalHost, skipping: bool, shared: &[String]| {
        claimable.admits(h)
            && !(skipping && skip(h))
            && !shared.iter().any(|s| Some(s) == h.metadata.name.as_ref())
    };
    let key = free_key(namespace);
    // The MAC check reads the index, so it is made outside the draws' look at it; a drawn host
    // that fails it is passed over and the draws are made again (a mistake, so rare).
    for _ in 0..PROBES {
        let drawn = index.pick(&key, |free| {
            if free.is_empty() {
                return None;
            }
            let skipping = free.iter().any(|h| !skip(h));
            (0..PROBES)
                .map(|k| free[draw(k, free.len())])
                .find(|h| takes(h, skipping, &shared))
                .cloned()
        });
        match drawn {
            Some(host) if boot_mac_sharers(index, &host).is_empty() => return vec![host],
            Some(host) => shared.push(host.name_any()),
            None => break,
        }
    }
    let free = index.get(&key);
    let skipping = free.iter().any(|h| !skip(h));
    // Ranked once; the MAC is then checked in rank order until one is not shared, not on every
    // free host (sharing is a mistake, so rare), and no rescan per host passed over.
    let mut ranked: Vec<&Arc<MetalHost>> = free
        .iter()
        .filter(|h| takes(h, skipping, &shared))
        .collect();
    ranked.sort_by_cached_key(|h| rank(&seed, h));
    ranked
        .into_iter()
        .find(|h| boot_mac_sharers(index, h).is_empty())
        .cloned()
        .into_iter()
        .collect()
}

/// The claim: the MetalHost's spec names its consumer. Sent only through [`conditioned`].
pub fn claim_patch(consumer: &ConsumerReference) -> serde_json::Value {
    serde_json::json!({"spec": {"consumerRef": consumer}})
}

/// The release: no consumer, and the deprovisioning fault (or its removal) for the operator.
pub fn release_patch(deprovision_failed: Option<&str>) -> serde_json::Value {
    serde_json::json!({
        "metadata": {"annotations": {DEPROVISION_FAILED_ANNOTATION: deprovision_failed}},
        "spec": {"consumerRef": null},
    })
}

pub use crate::controllers::conditioned;

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    use super::*;
    use crate::api::DEFAULT_FAILURE_DOMAIN_LABEL;
    use crate::api::metalhost::{ConsumerReference, MetalHostSpec, MetalHostStatus};

    fn host(name: &str, state: HostState, online: bool, labels: &[(&str, &str)]) -> Arc<MetalHost> {
        let mut h = MetalHost::new(
            name,
            MetalHostSpec {
                online,
                boot_mac_address: mac_of(name),
                ..MetalHostSpec::for_tests()
            },
        );
        h.metadata.namespace = Some("ns".into());
        h.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        h.status = Some(MetalHostStatus {
            state: Some(state),
            ..Default::default()
        });
        Arc::new(h)
    }

    /// A boot MAC of its own for each name (hosts that share one are never handed out).
    fn mac_of(name: &str) -> String {
        let b = crate::stable_hash::stable_hash(name).to_be_bytes();
        format!("52:54:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3])
    }

    fn mm(selector: Option<LabelSelector>) -> MetalMachine {
        let mut mm = MetalMachine::new("m", Default::default());
        mm.metadata.namespace = Some("ns".into());
        mm.spec.host_selector = selector.map(Box::new);
        mm
    }

    fn names(v: Result<Vec<Arc<MetalHost>>, ClaimError>) -> Vec<String> {
        let mut n: Vec<String> = v.unwrap_or_default().iter().map(|h| h.name_any()).collect();
        n.sort();
        n
    }

    /// The hosts sharing a MAC are named up to three, then counted; the host asking is not one.
    #[test]
    fn the_hosts_sharing_a_mac_are_named_a_few_then_counted() {
        let hosts: Vec<_> = (0..6)
            .map(|i| host(&format!("h{i}"), HostState::Available, true, &[]))
            .collect();
        let all: Vec<&Arc<MetalHost>> = hosts.iter().collect();
        let seen_by_h1 = MacSharers::of(&all, Some(&hosts[1]));
        assert_eq!(seen_by_h1.count, 5);
        assert_eq!(seen_by_h1.to_string(), "ns/h0, ns/h2, ns/h3 and 2 more");
        assert_eq!(MacSharers::of(&all[..2], None).to_string(), "ns/h0, ns/h1");
        assert!(MacSharers::of(&all[..1], Some(&hosts[0])).is_empty());
    }

    /// A free host whose boot MAC another host names is never handed out, whether the draws or
    /// the ranked scan behind them find it, while it is still listed free.
    #[test]
    fn a_free_host_whose_boot_mac_is_shared_is_not_handed_out() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let mut hosts: Vec<_> = (0..40)
            .map(|i| host(&format!("h{i:03}"), HostState::Available, true, &[]))
            .collect();
        // h000..h019 are free and share one MAC with a claimed host; h020.. have their own.
        let mut claimed = (*host("claimed", HostState::Provisioned, true, &[])).clone();
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("x", "ns"));
        claimed.spec.boot_mac_address = "52:54:00:00:00:aa".into();
        for h in hosts.iter_mut().take(20) {
            let mut copy = (**h).clone();
            copy.spec.boot_mac_address = "52:54:00:00:00:AA".into();
            *h = Arc::new(copy);
        }
        hosts.push(Arc::new(claimed));
        let index = indexed(&hosts);
        let never = |_: &MetalHost| false;
        for i in 0..200 {
            let mut machine = mm(None);
            machine.metadata.name = Some(format!("m{i}"));
            machine.metadata.uid = Some(format!("uid-{i}"));
            let found = free_host_to_claim(&index, "ns", &machine, None, fd, never);
            let name = found.first().map(|h| h.name_any()).unwrap_or_default();
            assert!(name.as_str() >= "h020", "m{i} was handed {name:?}");
        }
        // Only shared hosts free: nothing is handed out (the ranked scan agrees).
        let only_shared: Vec<_> = hosts
            .iter()
            .filter(|h| {
                h.spec
                    .boot_mac_address
                    .eq_ignore_ascii_case("52:54:00:00:00:aa")
            })
            .cloned()
            .collect();
        let index = indexed(&only_shared);
        assert!(free_host_to_claim(&index, "ns", &mm(None), None, fd, never).is_empty());
    }

    /// A claimed host is listed under its consumer (wherever that machine lives), a free one
    /// under its namespace, and every host under its BMC Secrets and its boot MAC (normalized,
    /// the way the boot service writes a request's MAC).
    #[test]
    fn hosts_are_indexed_by_consumer_as_free_by_bmc_secret_and_by_boot_mac() {
        let credentials = secret_key("ns", "c");
        let mac = |name: &str| boot_mac_key(&mac_of(name));
        let free = host("a", HostState::Available, true, &[]);
        assert_eq!(
            host_index_keys(&free),
            [free_key("ns"), credentials.clone(), mac("a")]
        );
        let mut offline = (*host("b", HostState::Available, false, &[])).clone();
        assert_eq!(host_index_keys(&offline), [credentials.clone(), mac("b")]);
        offline.spec.bmc.ca_secret_name = Some("ca".into());
        offline.spec.boot_mac_address = "52:54:00:AB:cd:0F".into();
        assert_eq!(
            host_index_keys(&offline),
            [
                credentials.clone(),
                secret_key("ns", "ca"),
                boot_mac_key("52:54:00:ab:cd:0f")
            ]
        );
        offline.spec.boot_mac_address = "not a MAC".into();
        assert_eq!(
            host_index_keys(&offline),
            [credentials.clone(), secret_key("ns", "ca")]
        );
        let mut claimed = (*host("c", HostState::Provisioning, true, &[])).clone();
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "ns"));
        assert_eq!(
            host_index_keys(&claimed),
            [consumer_key("ns", "m"), credentials.clone(), mac("c")]
        );
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "elsewhere"));
        assert_eq!(
            host_index_keys(&claimed),
            [consumer_key("elsewhere", "m"), credentials, mac("c")]
        );
    }

    #[test]
    fn only_free_matching_hosts_are_candidates() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let mut claimed = (*host("claimed", HostState::Available, true, &[])).clone();
        claimed.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("x", "ns"));
        let hosts = vec![
            host(
                "a",
                HostState::Available,
                true,
                &[(fd, "rack-a"), ("role", "worker")],
            ),
            host("b", HostState::Available, true, &[(fd, "rack-b")]),
            host("c", HostState::Provisioned, true, &[(fd, "rack-b")]),
            host("d", HostState::Available, false, &[(fd, "rack-b")]),
            host("e", HostState::Error, true, &[]),
            Arc::new(claimed),
        ];
        assert_eq!(
            names(candidate_hosts(&hosts, &mm(None), None, fd)),
            ["a", "b"]
        );
        assert_eq!(
            names(candidate_hosts(&hosts, &mm(None), Some("rack-b"), fd)),
            ["b"]
        );
        assert!(matches!(
            candidate_hosts(&hosts, &mm(None), Some("rack-z"), fd),
            Err(ClaimError::NoHostInFailureDomain { .. })
        ));
        let workers = LabelSelector {
            match_labels: Some(BTreeMap::from([("role".into(), "worker".into())])),
            match_expressions: None,
        };
        assert_eq!(
            names(candidate_hosts(&hosts, &mm(Some(workers)), None, fd)),
            ["a"]
        );
        let typo = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "role".into(),
                operator: "Typo".into(),
                values: Some(vec!["worker".into()]),
            }]),
        };
        assert!(
            matches!(
                candidate_hosts(&hosts, &mm(Some(typo)), None, fd),
                Err(ClaimError::InvalidSelector(_))
            ),
            "an unknown operator claims nothing and says why"
        );
    }

    #[test]
    fn hardware_requirements_use_the_inventory() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let with = |name: &str, facts: &[(&str, &str)]| {
            let mut h = (*host(name, HostState::Available, true, &[])).clone();
            if let Some(status) = h.status.as_mut() {
                status.hardware = Some(crate::api::metalhost::HardwareInventory {
                    extra: facts
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    ..Default::default()
                });
            }
            Arc::new(h)
        };
        // Inspected by the deploy agent: typed figures, and its disks.
        let agent = {
            let mut h = (*host("agent", HostState::Available, true, &[])).clone();
            if let Some(status) = h.status.as_mut() {
                status.hardware = Some(crate::api::metalhost::HardwareInventory {
                    cpu: Some(crate::api::metalhost::CpuInfo {
                        count: 16,
                        ..Default::default()
                    }),
                    memory_mib: Some(32 * 1024),
                    disks: vec![
                        crate::api::metalhost::DiskInfo {
                            name: "sda".into(),
                            size_bytes: 200 << 30,
                            ..Default::default()
                        },
                        crate::api::metalhost::DiskInfo {
                            name: "nvme0n1".into(),
                            size_bytes: 960 << 30,
                            ..Default::default()
                        },
                    ],
                    ..Default::default()
                });
            }
            Arc::new(h)
        };
        let hosts = vec![
            with("big", &[("cpuCount", "64"), ("memoryGiB", "512")]),
            with("small", &[("cpuCount", "4"), ("memoryGiB", "16")]),
            with("mute", &[]),
            host("uninspected", HostState::Available, true, &[]),
            agent,
        ];
        let need_disk = |cpus: Option<i32>, mem: Option<i32>, disk: Option<i32>| {
            let mut m = mm(None);
            m.spec.host_hardware = Some(Box::new(crate::api::metalmachine::HardwareRequirements {
                min_cpus: cpus,
                min_memory_gib: mem,
                min_disk_gib: disk,
            }));
            m
        };
        let need = |cpus: Option<i32>, mem: Option<i32>| need_disk(cpus, mem, None);
        let rows = [
            (
                "no requirement",
                mm(None),
                vec!["agent", "big", "mute", "small", "uninspected"],
            ),
            (
                "cpus met by those that say",
                need(Some(4), None),
                vec!["agent", "big", "small"],
            ),
            ("cpus and memory", need(Some(8), Some(64)), vec!["big"]),
            (
                "memory only",
                need(None, Some(16)),
                vec!["agent", "big", "small"],
            ),
            (
                "a disk of 500 GiB: only the inspected host with one",
                need_disk(None, None, Some(500)),
                vec!["agent"],
            ),
            (
                "cpus, memory and disk from the agent",
                need_disk(Some(16), Some(32), Some(960)),
                vec!["agent"],
            ),
            (
                "a disk too large for any",
                need_disk(None, None, Some(961)),
                vec![],
            ),
        ];
        for (name, machine, want) in rows {
            assert_eq!(
                names(candidate_hosts(&hosts, &machine, None, fd)),
                want,
                "{name}"
            );
        }
        let err = candidate_hosts(&hosts, &need(Some(1024), None), None, fd)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("minCPUs"),
            "the refusal names the requirement: {err}"
        );
    }

    /// The one-pass choice is the sorted list's first, for every machine.
    #[test]
    fn the_best_candidate_is_the_first_candidate() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let hosts: Vec<_> = (0..50)
            .map(|i| host(&format!("h{i}"), HostState::Available, true, &[]))
            .collect();
        for i in 0..20 {
            let mut machine = mm(None);
            machine.metadata.uid = Some(format!("uid-{i}"));
            let first = candidate_hosts(&hosts, &machine, None, fd)
                .ok()
                .and_then(|c| c.first().map(|h| h.name_any()));
            let best = best_candidate(&hosts, &machine, None, fd)
                .ok()
                .map(|h| h.name_any());
            assert_eq!(best, first, "machine {i}");
        }
        assert!(matches!(
            best_candidate(&hosts, &mm(None), Some("rack-z"), fd),
            Err(ClaimError::NoHostInFailureDomain { .. })
        ));
    }

    /// An index of `hosts` as the manager keeps it.
    fn indexed(hosts: &[Arc<MetalHost>]) -> crate::stores::Index<MetalHost> {
        use kube::runtime::{reflector, watcher::Event};
        let (store, mut writer) = reflector::store::<MetalHost>();
        let index = crate::stores::Index::new(host_index_keys);
        let mut events = vec![Event::Init];
        events.extend(hosts.iter().map(|h| Event::InitApply((**h).clone())));
        events.push(Event::InitDone);
        for e in &events {
            index.apply(&mut writer, &store, e);
        }
        index
    }

    /// Picks a free host for each of `machines` machines and counts how often each host is
    /// picked (asserting each pick is admitted: in `domain` when given).
    fn picks(
        index: &crate::stores::Index<MetalHost>,
        machines: usize,
        selector: Option<LabelSelector>,
        domain: Option<&str>,
    ) -> BTreeMap<String, usize> {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let mut picked = BTreeMap::<String, usize>::new();
        for i in 0..machines {
            let mut machine = mm(selector.clone());
            machine.metadata.uid = Some(format!("uid-{i}"));
            let found = free_host_to_claim(index, "ns", &machine, domain, fd, |_| false);
            assert_eq!(found.len(), 1, "machine {i} in {domain:?}");
            if let Some(d) = domain {
                assert_eq!(found[0].labels().get(fd).map(String::as_str), Some(d));
            }
            *picked.entry(found[0].name_any()).or_default() += 1;
        }
        picked
    }

    /// Every host picked, and none more than three times its share.
    fn spread_evenly(picked: &BTreeMap<String, usize>, machines: usize, hosts: usize) {
        let fair = machines / hosts;
        assert_eq!(picked.len(), hosts, "every host picked: {picked:?}");
        assert!(
            picked.values().all(|&n| n <= 3 * fair),
            "no host picked more than three times its share ({fair}): {picked:?}"
        );
    }

    /// What `observe` hands `decide` for a machine without a host: one free host it may claim,
    /// each as likely as another even when a rack's hosts are named in a row (a scan from a
    /// per-machine start gave the rack's first host to most machines). Mostly found by a draw.
    #[test]
    fn the_free_host_to_claim_is_one_it_may_take_spread_over_a_rack_named_in_a_row() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let rack = |i: usize| match i {
            0..30 => "rack-a",
            30..40 => "rack-b",
            _ => "rack-c",
        };
        let hosts: Vec<_> = (0..60)
            .map(|i| {
                host(
                    &format!("h{i:03}"),
                    HostState::Available,
                    true,
                    &[(fd, rack(i))],
                )
            })
            .collect();
        let index = indexed(&hosts);
        spread_evenly(&picks(&index, 400, None, Some("rack-b")), 400, 10);
        spread_evenly(&picks(&index, 1200, None, None), 1200, 60);
    }

    /// Ten hosts in a row of a thousand suit the machines: most draws miss, and the ranked scan
    /// behind them spreads the machines as evenly (taking the first that suits would not).
    #[test]
    fn the_ranked_scan_behind_the_draws_spreads_machines_too() {
        let special = [("role", "special")];
        let hosts: Vec<_> = (0..1000)
            .map(|i| {
                let labels: &[(&str, &str)] = if (500..510).contains(&i) {
                    &special
                } else {
                    &[]
                };
                host(&format!("h{i:04}"), HostState::Available, true, labels)
            })
            .collect();
        let index = indexed(&hosts);
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("role".into(), "special".into())])),
            match_expressions: None,
        };
        spread_evenly(&picks(&index, 400, Some(selector), None), 400, 10);
    }

    /// Claims in flight (`skip`) are passed over, unless every free host is one; nothing is
    /// handed over when no free host is admitted (or the selector is invalid).
    #[test]
    fn the_free_host_to_claim_passes_over_claims_in_flight() {
        let fd = DEFAULT_FAILURE_DOMAIN_LABEL;
        let special = [("role", "special")];
        let hosts: Vec<_> = (0..200)
            .map(|i| {
                let labels: &[(&str, &str)] = if i == 117 || i == 3 { &special } else { &[] };
                host(&format!("h{i:03}"), HostState::Available, true, labels)
            })
            .collect();
        let index = indexed(&hosts);
        let names = |v: Vec<Arc<MetalHost>>| v.iter().map(|h| h.name_any()).collect::<Vec<_>>();
        let selector = LabelSelector {
            match_labels: Some(BTreeMap::from([("role".into(), "special".into())])),
            match_expressions: None,
        };
        let wants_special = mm(Some(selector));
        let never = |_: &MetalHost| false;
        let found = names(free_host_to_claim(
            &index,
            "ns",
            &wants_special,
            None,
            fd,
            never,
        ));
        assert!(found == ["h003"] || found == ["h117"], "{found:?}");
        let other = if found == ["h003"] { "h117" } else { "h003" };
        let in_flight = found[0].clone();
        let skip = |h: &MetalHost| h.name_any() == in_flight;
        assert_eq!(
            names(free_host_to_claim(
                &index,
                "ns",
                &wants_special,
                None,
                fd,
                skip
            )),
            [other],
            "the claim in flight is passed over"
        );
        let both = |h: &MetalHost| matches!(h.name_any().as_str(), "h003" | "h117");
        assert!(
            free_host_to_claim(&index, "ns", &wants_special, None, fd, both).is_empty(),
            "every host it may claim is in flight while others are free: none"
        );
        assert_eq!(
            free_host_to_claim(&index, "ns", &wants_special, None, fd, |_| true).len(),
            1,
            "hosts in flight are tried when they are all there is"
        );
        let machine = mm(None);
        assert!(free_host_to_claim(&index, "ns", &machine, Some("rack-z"), fd, never).is_empty());
        assert!(free_host_to_claim(&index, "elsewhere", &machine, None, fd, never).is_empty());
        let typo = LabelSelector {
            match_labels: None,
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "role".into(),
                operator: "Typo".into(),
                values: None,
            }]),
        };
        assert!(free_host_to_claim(&index, "ns", &mm(Some(typo)), None, fd, never).is_empty());
    }

    #[test]
    fn the_claim_is_found_by_name_not_uid() {
        let mut h = (*host("h", HostState::Provisioned, true, &[])).clone();
        h.spec.consumer_ref = Some(ConsumerReference::to_metal_machine("m", "ns"));
        let hosts = vec![Arc::new(h)];
        let mut moved = mm(None);
        moved.metadata.uid = Some("a-new-uid-after-move".into());
        assert_eq!(
            claimed_host(&hosts, &moved).map(|h| h.name_any()),
            Some("h".into())
        );
        let mut other_ns = mm(None);
        other_ns.metadata.namespace = Some("elsewhere".into());
        assert!(claimed_host(&hosts, &other_ns).is_none());
    }
}

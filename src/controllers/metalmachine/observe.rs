//! Everything the MetalMachine controller reads before deciding: the owning Machine, the
//! Cluster, the MetalCluster's failure-domain label, the hosts it has or may claim, the boot Secret,
//! all from the shared reflector stores (no GET of an object a store holds), and, only while a
//! claimed host is being deprovisioned, its power state from the BMC.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use crate::api::metalhost::PowerState;
use crate::api::{
    CLUSTER_NAME_LABEL, Cluster, DEFAULT_FAILURE_DOMAIN_LABEL, Machine, MetalHost, MetalMachine,
};
use crate::bmc::PowerAction;
use crate::boot::tokens::{self, BootRecord};
use crate::controllers::expectations::{object_key, store_reflects};
use crate::controllers::power::Fault;

use super::decide::KeptPower;
use super::{FINALIZER, MachineContext, claim, machine_owner};

/// The owning Machine as the store has it.
#[derive(Debug, Clone)]
pub enum OwnerObservation {
    NoOwner,
    Missing(String),
    /// The Machine exists but does not parse (a permissive CRD, a newer upstream shape).
    Invalid {
        name: String,
        error: String,
    },
    Found(Arc<Machine>),
}

/// The boot Secret of the current attempt.
#[derive(Debug, Clone)]
pub enum BootObservation {
    None,
    Unreadable(String),
    Record(Box<BootRecord>),
}

/// What `decide` works from.
#[derive(Debug, Clone)]
pub struct Observed {
    pub mm: Arc<MetalMachine>,
    pub now: jiff::Timestamp,
    pub owner: OwnerObservation,
    pub cluster_name: String,
    pub cluster: Option<Arc<Cluster>>,
    /// Label on MetalHosts that names their failure domain (MetalCluster override or default).
    pub failure_domain_label: String,
    /// The hosts in the machine's namespace claimed by it; when it has none, the free host it
    /// may claim (`claim::free_host_to_claim`), if any.
    pub hosts: Vec<Arc<MetalHost>>,
    pub boot: BootObservation,
    /// The boot Secret `boot` was read from: the store's copy, or the fresher answer to a
    /// boot-service write. Steps write it under this copy's resourceVersion, not the store's:
    /// a store still behind the decision turned the write into a 409, after the BMC call made
    /// before it, which the next pass then made again.
    pub boot_secret: Option<Arc<tokens::StoredBootSecret>>,
    /// Deletion only: the claimed host's power state, read from its BMC.
    pub power: Option<Result<PowerState, Fault>>,
    /// Deletion only: the power-off request already sent, and how long ago.
    pub last_power_off: Option<(PowerAction, Duration)>,
    /// Deletion only: how long ago this controller last sent the host a power-on or cycle.
    pub last_power_on: Option<Duration>,
    /// A power action this manager sent for the attempt in `boot` whose note on the boot Secret
    /// is missing (only when it is for that Secret and attempt).
    pub unrecorded_power: Option<super::decide::UnrecordedPower>,
}

/// The outcome of observing.
pub enum Observation {
    Ready(Box<Observed>),
    /// A store has not caught up with this controller's own last write to `0`: decide later.
    Stale(String),
}

pub async fn observe(ctx: &MachineContext, mm: Arc<MetalMachine>) -> Observation {
    let stores = &ctx.stores;
    let namespace = mm.namespace().unwrap_or_default();
    let name = mm.name_any();
    let mm_key = object_key("MetalMachine", &namespace, &name);
    let metal_machines: Api<MetalMachine> = Api::namespaced(ctx.client.clone(), &namespace);
    // The store still shows a version this controller's last write replaced: decide from that
    // write's answer instead of waiting for the watch (the expectation stays until it shows it).
    let seen = mm.resource_version();
    let mm = match ctx.expectations.ahead_of_store(&mm_key, seen.as_deref()) {
        Some(fresh) => fresh,
        None => {
            if !store_reflects(
                &ctx.expectations,
                &metal_machines,
                &mm_key,
                &name,
                seen.as_deref(),
            )
            .await
            {
                return Observation::Stale(mm_key);
            }
            // Met because our delete's expectation was forgotten when the deletion reached the
            // store (`Expectations::gone` runs only after that)? Then the store no longer holds
            // the object, and `mm` is a copy from before: decide nothing from it. Read after the
            // check, this closes the window between the pass's read and its check.
            if stores
                .metal_machines
                .get(&ObjectRef::from_obj(mm.as_ref()))
                .is_none()
            {
                return Observation::Stale(mm_key);
            }
            mm
        }
    };
    let owner = match machine_owner(&mm) {
        None => OwnerObservation::NoOwner,
        Some(owner) => match stores
            .machines
            .get(&ObjectRef::new(&owner.name).within(&namespace))
        {
            None => OwnerObservation::Missing(owner.name.clone()),
            Some(guarded) => match &guarded.0 {
                Ok(machine) => OwnerObservation::Found(Arc::new(machine.clone())),
                Err(invalid) => OwnerObservation::Invalid {
                    name: owner.name.clone(),
                    error: invalid.error.chars().take(300).collect(),
                },
            },
        },
    };
    let cluster_name = mm
        .labels()
        .get(CLUSTER_NAME_LABEL)
        .cloned()
        .or_else(|| match &owner {
            OwnerObservation::Found(m) => Some(m.spec.cluster_name.clone()),
            _ => None,
        })
        .unwrap_or_default();
    let cluster = (!cluster_name.is_empty())
        .then(|| {
            stores
                .clusters
                .get(&ObjectRef::new(&cluster_name).within(&namespace))
        })
        .flatten()
        .and_then(|guarded| guarded.0.as_ref().ok().cloned().map(Arc::new));
    let failure_domain_label = cluster
        .as_ref()
        .and_then(|c| c.spec.infrastructure_ref.as_ref())
        .filter(|r| r.kind == "MetalCluster")
        .and_then(|r| {
            stores
                .metal_clusters
                .get(&ObjectRef::new(&r.name).within(&namespace))
        })
        .and_then(|mc| mc.spec.failure_domain_label.clone())
        .unwrap_or_else(|| DEFAULT_FAILURE_DOMAIN_LABEL.to_string());
    let host_prefix = object_key("MetalHost", &namespace, "");
    let host_version = |key: &str| {
        let host = key.strip_prefix(&host_prefix).unwrap_or_default();
        stores
            .hosts
            .get(&ObjectRef::new(host).within(&namespace))
            .and_then(|h| h.resource_version())
    };
    let host_api: Api<MetalHost> = Api::namespaced(ctx.client.clone(), &namespace);
    // Only the host writes that concern this machine hold it back: its own claims and releases
    // (and claims it lost with a 409), and hosts the store shows claimed by it. Under a storm,
    // waiting for every host any machine wrote held each pass for seconds; another machine's
    // claim of a host this one then picks is refused by its resourceVersion precondition.
    let names_this_machine = |key: &str| {
        let host = key.strip_prefix(&host_prefix).unwrap_or_default();
        stores
            .hosts
            .get(&ObjectRef::new(host).within(&namespace))
            .is_some_and(|h| {
                h.spec
                    .consumer_ref
                    .as_ref()
                    .is_some_and(|c| c.is_metal_machine(&namespace, &name))
            })
    };
    // Each pass ends an entry (met, or confirmed by the apiserver) or returns, so this ends.
    while let Some((key, _)) =
        ctx.expectations
            .first_unmet(&host_prefix, host_version, &mm_key, names_this_machine)
    {
        let host = key.strip_prefix(&host_prefix).unwrap_or_default();
        let seen = host_version(&key);
        if !store_reflects(&ctx.expectations, &host_api, &key, host, seen.as_deref()).await {
            return Observation::Stale(key);
        }
    }
    // Read after the expectations are met, so `decide` sees the versions that met them (the
    // index changes with the store, under one lock). Only the hosts `decide` can use: those
    // claimed by this machine, else the one free host it would claim. Filtering every host per
    // pass was about half of the manager's CPU at 10,000 hosts.
    let in_namespace = |h: &Arc<MetalHost>| h.metadata.namespace.as_deref() == Some(&namespace);
    let mut hosts = stores
        .host_index
        .get(&claim::consumer_key(&namespace, &name));
    hosts.retain(in_namespace);
    if hosts.is_empty() {
        // Free in the store, but being claimed or just claimed by another machine of this
        // process: a claim of one would be refused (409). Kept when they are all there is.
        // Read in this order, before the free hosts: a claim leaves the in-flight set only once
        // its answer is an expectation, and that only once the store (and with it the index
        // read below) shows the claim, so no claim slips between the reads.
        let mut taken = ctx.claims_in_flight.in_namespace(&namespace);
        taken.extend(
            ctx.expectations
                .written_by_others(&host_prefix, host_version, &mm_key),
        );
        let failure_domain = match &owner {
            OwnerObservation::Found(machine) => machine.spec.failure_domain.as_deref(),
            _ => None,
        };
        hosts = claim::free_host_to_claim(
            &stores.host_index,
            &namespace,
            &mm,
            failure_domain,
            &failure_domain_label,
            |h| h.metadata.name.as_ref().is_some_and(|n| taken.contains(n)),
        );
    }
    let secret_name = tokens::boot_secret_name(&name);
    let secret = stores
        .boot_secrets
        .get(&ObjectRef::new(&secret_name).within(&namespace));
    let secret_key = object_key("Secret", &namespace, &secret_name);
    let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    if !store_reflects(
        &ctx.expectations,
        &secrets,
        &secret_key,
        &secret_name,
        secret
            .as_ref()
            .and_then(|s| s.resource_version())
            .as_deref(),
    )
    .await
    {
        return Observation::Stale(secret_key);
    }
    // The store still shows the version a boot-service write replaced: decide from that write's
    // answer (the apiserver's own copy, never older than the store's), and let later passes wait
    // until the store shows it too.
    let fresh = ctx
        .fresh_secrets
        .take(&mm_key)
        .filter(|f| f.written.name_any() == secret_name)
        .filter(|f| {
            secret
                .as_ref()
                .and_then(|s| s.resource_version())
                .as_deref()
                == Some(f.replaced.as_str())
        });
    let secret = match fresh {
        Some(f) => {
            ctx.expectations.wrote(
                secret_key.clone(),
                Some(f.replaced.clone()),
                f.written.resource_version(),
            );
            Some(f.written)
        }
        None => secret,
    };
    let boot_secret = secret.clone();
    let boot = match secret {
        None => BootObservation::None,
        Some(secret) => match tokens::parse_boot_secret(&secret) {
            Ok(record) => BootObservation::Record(Box::new(record)),
            Err(e) => BootObservation::Unreadable(e.to_string()),
        },
    };
    let unrecorded_power = match (&boot, &boot_secret, ctx.unrecorded_power.get(&mm_key)) {
        (BootObservation::Record(record), Some(secret), Some(sent)) => {
            match sent.against(secret.metadata.uid.as_deref(), record) {
                KeptPower::Unnoted => Some(sent),
                KeptPower::Noted => {
                    ctx.unrecorded_power.remove(&mm_key);
                    None
                }
                KeptPower::OtherAttempt => None,
            }
        }
        _ => None,
    };
    let deprovisioning =
        mm.metadata.deletion_timestamp.is_some() && mm.finalizers().iter().any(|f| f == FINALIZER);
    let (power, last_power_off) = match claim::claimed_host(&hosts, &mm) {
        Some(host) if deprovisioning => {
            let power = match super::act::bmc_for(ctx, host).await {
                Ok(bmc) => bmc.power_state().await.map_err(|e| Fault::from_bmc(&e)),
                Err(f) => Err(f),
            };
            (Some(power), ctx.power_requests.last(&mm_key))
        }
        _ => (None, None),
    };
    Observation::Ready(Box::new(Observed {
        mm,
        now: jiff::Timestamp::now(),
        owner,
        cluster_name,
        cluster,
        failure_domain_label,
        hosts,
        boot,
        boot_secret,
        power,
        last_power_off,
        last_power_on: ctx.power_ons.last(&mm_key).map(|(_, ago)| ago),
        unrecorded_power,
    }))
}

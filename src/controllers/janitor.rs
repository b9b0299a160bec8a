//! Forgets what the manager keeps in memory about objects that are gone: BMC drivers of deleted
//! hosts (logged out, so their Redfish sessions do not pile up on the BMC), backoff,
//! power-request, power-on and power-reading entries, source-address pins of finished boot
//! attempts, expired expectations.
//! Without it each of these grows with every host and machine ever seen.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::reflector::Store;
use kube::{Resource, ResourceExt};

use crate::boot::http::BootState;

use super::expectations::object_key;
use super::{key, metalhost::HostContext, metalmachine::MachineContext};

/// What one sweep released, for logs and tests.
#[derive(Debug, Default, PartialEq)]
pub struct Swept {
    pub bmc_drivers: usize,
}

fn keys<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>) -> HashSet<String> {
    store.state().iter().map(|o| key(o.as_ref())).collect()
}

fn object_keys<K: Resource<DynamicType = ()> + Clone>(store: &Store<K>) -> HashSet<String> {
    store
        .state()
        .iter()
        .map(|o| {
            object_key(
                &K::kind(&()),
                &o.namespace().unwrap_or_default(),
                &o.name_any(),
            )
        })
        .collect()
}

/// One sweep against the shared stores (the caller runs it only once they have synced).
pub async fn sweep(hosts: &HostContext, machines: &MachineContext, boot: &BootState) -> Swept {
    let live_hosts = keys(&hosts.stores.hosts);
    let live_machines = keys(&hosts.stores.metal_machines);
    let live_machine_objects = object_keys(&hosts.stores.metal_machines);
    let live_boot_secrets = keys(&hosts.stores.boot_secrets);

    let evicted = hosts.connector.evict(&|k| live_hosts.contains(k));
    for bmc in &evicted {
        tracing::info!(bmc = %bmc.address(), "host deleted: logging out of its BMC");
        if let Ok(Err(e)) = tokio::time::timeout(Duration::from_secs(10), bmc.logout()).await {
            tracing::debug!(bmc = %bmc.address(), error = %e, "BMC logout failed");
        }
    }
    hosts.backoff.retain(|k| live_hosts.contains(k));
    hosts.power_requests.retain(|k| live_hosts.contains(k));
    hosts.power_readings.retain(|k| live_hosts.contains(k));
    machines.backoff.retain(|k| live_machines.contains(k));
    machines
        .power_requests
        .retain(|k| live_machine_objects.contains(k));
    machines
        .power_ons
        .retain(|k| live_machine_objects.contains(k));
    machines
        .unrecorded_power
        .retain(|k| live_machine_objects.contains(k));
    machines.expectations.expire();
    hosts.expectations.expire();
    boot.retain_pins(|secret| live_boot_secrets.contains(secret));
    Swept {
        bmc_drivers: evicted.len(),
    }
}

/// Sweeps every `interval` for as long as the manager runs.
pub async fn run(
    hosts: Arc<HostContext>,
    machines: Arc<MachineContext>,
    boot: Arc<BootState>,
    interval: Duration,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if !boot.is_ready() {
            continue; // before the first list every host would look deleted
        }
        let swept = sweep(&hosts, &machines, &boot).await;
        if swept != Swept::default() {
            tracing::debug!(?swept, "janitor");
        }
    }
}

//! Leader election on a coordination.k8s.io Lease, so two manager replicas never act at once.
//! The leader renews every `renew`; a replica takes over a Lease not renewed for `duration`.
//! A leader that cannot renew before its Lease expires stops the process: acting on as a
//! second leader would be worse than a restart.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Api, ObjectMeta, PostParams};

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub duration: Duration,
    pub renew: Duration,
}

/// Whether `lease` may be taken by `identity` at `now`.
pub fn can_take(lease: &LeaseSpec, identity: &str, now: jiff::Timestamp) -> bool {
    let holder = lease.holder_identity.as_deref().unwrap_or("");
    if holder.is_empty() || holder == identity {
        return true;
    }
    let duration = i64::from(lease.lease_duration_seconds.unwrap_or(15));
    match &lease.renew_time {
        Some(renewed) => now.duration_since(renewed.0).as_secs() > duration,
        None => true,
    }
}

fn spec(
    config: &LeaseConfig,
    now: jiff::Timestamp,
    acquired: Option<MicroTime>,
    transitions: i32,
) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(config.duration.as_secs() as i32),
        acquire_time: acquired.or(Some(MicroTime(now))),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(transitions),
        ..Default::default()
    }
}

/// One attempt to take or renew the Lease. Conflicts (someone else wrote first) are `Ok(false)`.
async fn try_acquire(api: &Api<Lease>, config: &LeaseConfig) -> Result<bool, kube::Error> {
    let now = jiff::Timestamp::now();
    match api.get_opt(&config.name).await? {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(config.name.clone()),
                    ..Default::default()
                },
                spec: Some(spec(config, now, None, 0)),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
        Some(mut lease) => {
            let current = lease.spec.clone().unwrap_or_default();
            if !can_take(&current, &config.identity, now) {
                return Ok(false);
            }
            let ours = current.holder_identity.as_deref() == Some(config.identity.as_str());
            let transitions = current.lease_transitions.unwrap_or(0) + i32::from(!ours);
            lease.spec = Some(spec(
                config,
                now,
                if ours { current.acquire_time } else { None },
                transitions,
            ));
            // replace carries the resourceVersion we read: a concurrent writer makes this a 409.
            match api
                .replace(&config.name, &PostParams::default(), &lease)
                .await
            {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e),
            }
        }
    }
}

/// Waits until this replica holds the Lease, then keeps renewing it in the background.
pub async fn acquire(client: kube::Client, config: LeaseConfig) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    loop {
        match try_acquire(&api, &config).await {
            Ok(true) => break,
            Ok(false) => tracing::info!(lease = %config.name, "another replica leads; waiting"),
            Err(e) => {
                tracing::warn!(lease = %config.name, error = %e, "leader election failed; retrying")
            }
        }
        tokio::time::sleep(config.renew).await;
    }
    tracing::info!(lease = %config.name, identity = %config.identity, "became leader");
    tokio::spawn(async move {
        let mut last_renewed = std::time::Instant::now();
        loop {
            tokio::time::sleep(config.renew).await;
            match try_acquire(&api, &config).await {
                Ok(true) => last_renewed = std::time::Instant::now(),
                Ok(false) => {
                    tracing::error!(lease = %config.name, "lost the leader Lease to another replica; exiting");
                    std::process::exit(1);
                }
                Err(e) => {
                    tracing::warn!(lease = %config.name, error = %e, "could not renew the leader Lease")
                }
            }
            if last_renewed.elapsed() > config.duration {
                tracing::error!(lease = %config.name, "could not renew the leader Lease before it expired; exiting");
                std::process::exit(1);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(holder: Option<&str>, renewed: Option<i64>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(String::from),
            lease_duration_seconds: Some(15),
            renew_time: renewed.map(|s| {
                MicroTime(jiff::Timestamp::from_second(s).unwrap_or(jiff::Timestamp::UNIX_EPOCH))
            }),
            ..Default::default()
        }
    }

    #[test]
    fn who_may_take_the_lease() {
        let now = jiff::Timestamp::from_second(1000).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
        assert!(can_take(&lease(None, None), "a", now), "free");
        assert!(can_take(&lease(Some("a"), Some(999)), "a", now), "ours");
        assert!(
            !can_take(&lease(Some("b"), Some(990)), "a", now),
            "held and fresh"
        );
        assert!(
            can_take(&lease(Some("b"), Some(980)), "a", now),
            "held but expired"
        );
    }
}

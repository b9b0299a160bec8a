//! MetalHost controller: registers hosts (credentials + a BMC that answers → Available, or Error
//! with the fault), reads inventory once, polls power politely, and holds `online: false` hosts
//! powered off. It never provisions: claiming and booting belong to the MetalMachine controller.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, Patch};
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Action;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};

use crate::api::metalhost::{
    HardwareInventory, HostErrorType, HostState, MetalHostStatus, PowerState,
};
use crate::api::{HOST_PAUSED_ANNOTATION, MetalHost};
use crate::bmc::{Bmc, PowerAction};

use super::conditions::{self, Want};
use super::hostbmc::{BmcConnector, load_target};
use super::{Backoff, Events, ReconcileError, key};

pub const FIELD_MANAGER: &str = "metalboot-metalhost";
/// Condition: credentials were accepted by a BMC that answered.
pub const REGISTERED: &str = "Registered";
/// Condition: the last BMC call succeeded.
pub const BMC_REACHABLE: &str = "BmcReachable";
/// Condition: reconciliation is paused by annotation.
pub const PAUSED: &str = "Paused";

/// A BMC or credentials fault, as a condition reason and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub reason: &'static str,
    pub message: String,
}

/// What the controller does with a host this time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPlan {
    Paused,
    /// Check credentials and BMC; read inventory if missing.
    Register,
    /// Power the host off (operator set `online: false`); `force` after the grace period.
    HoldOff {
        force: bool,
    },
    /// Read the power state.
    Poll,
    /// Nothing to do until then.
    Wait(Duration),
}

/// Seconds a graceful power-off gets before it is forced.
pub const GRACEFUL_OFF_SECONDS: i64 = 60;

pub fn plan(host: &MetalHost, now: jiff::Timestamp, poll_interval: Duration) -> HostPlan {
    if host.annotations().contains_key(HOST_PAUSED_ANNOTATION) {
        return HostPlan::Paused;
    }
    let status = host.status.clone().unwrap_or_default();
    let registered = conditions::is_true(&status.conditions, REGISTERED);
    let state = status.state.unwrap_or_default();
    if !registered
        || state == HostState::Registering
        || status.error_type == Some(HostErrorType::RegistrationError)
    {
        return HostPlan::Register;
    }
    if !host.spec.online && status.power_state != Some(PowerState::Off) {
        // The grace period runs from when `online` was last observed true (the generation change).
        let since_change = conditions::get(&status.conditions, "PoweredOffByOperator")
            .map(|c| now.duration_since(c.last_transition_time.0).as_secs())
            .unwrap_or(0);
        return HostPlan::HoldOff {
            force: since_change >= GRACEFUL_OFF_SECONDS,
        };
    }
    let since_check = status
        .last_power_check
        .map(|t| now.duration_since(t.0).as_secs())
        .unwrap_or(i64::MAX);
    let interval = poll_interval.as_secs() as i64;
    if since_check >= interval {
        HostPlan::Poll
    } else {
        HostPlan::Wait(Duration::from_secs((interval - since_check).max(1) as u64))
    }
}

/// Status after a registration attempt.
pub fn registration_status(
    host: &MetalHost,
    result: Result<(PowerState, Option<HardwareInventory>), Fault>,
    now: &Time,
) -> MetalHostStatus {
    let mut status = host.status.clone().unwrap_or_default();
    let generation = host.metadata.generation;
    status.observed_generation = generation;
    match result {
        Ok((power, inventory)) => {
            let state = status.state.unwrap_or_default();
            let busy = status.consumer_ref.is_some()
                && matches!(
                    state,
                    HostState::Provisioning | HostState::Provisioned | HostState::Deprovisioning
                );
            status.state = Some(if busy { state } else { HostState::Available });
            status.error_type = None;
            status.error_message = None;
            status.power_state = Some(power);
            status.last_power_check = Some(now.clone());
            if inventory.is_some() {
                status.hardware = inventory;
            }
            conditions::set(
                &mut status.conditions,
                Want::t(REGISTERED, "Registered", "the BMC accepted the credentials"),
                generation,
                now,
            );
            conditions::set(
                &mut status.conditions,
                Want::t(BMC_REACHABLE, "BmcReachable", ""),
                generation,
                now,
            );
        }
        Err(fault) => {
            status.state = Some(HostState::Error);
            status.error_type = Some(HostErrorType::RegistrationError);
            status.error_message = Some(fault.message.clone());
            conditions::set(
                &mut status.conditions,
                Want::f(REGISTERED, fault.reason, fault.message.clone()),
                generation,
                now,
            );
            conditions::set(
                &mut status.conditions,
                Want::f(BMC_REACHABLE, fault.reason, fault.message),
                generation,
                now,
            );
        }
    }
    status
}

/// Status after a power read (registered host).
pub fn poll_status(
    host: &MetalHost,
    result: Result<PowerState, Fault>,
    now: &Time,
) -> MetalHostStatus {
    let mut status = host.status.clone().unwrap_or_default();
    let generation = host.metadata.generation;
    match result {
        Ok(power) => {
            status.power_state = Some(power);
            status.last_power_check = Some(now.clone());
            conditions::set(
                &mut status.conditions,
                Want::t(BMC_REACHABLE, "BmcReachable", ""),
                generation,
                now,
            );
        }
        Err(fault) => {
            status.power_state = Some(PowerState::Unknown);
            status.last_power_check = Some(now.clone());
            conditions::set(
                &mut status.conditions,
                Want::f(BMC_REACHABLE, fault.reason, fault.message),
                generation,
                now,
            );
        }
    }
    status
}

pub struct HostContext {
    pub client: kube::Client,
    pub connector: Arc<dyn BmcConnector>,
    pub events: Events,
    pub backoff: Backoff,
    pub poll_interval: Duration,
    pub watch_filter: Option<String>,
}

/// Writes the host controller's status fields with a merge patch, leaving the MetalMachine
/// controller's `consumerRef` alone. `state` is written only after registration, and then only
/// if nobody changed the host since we read it (a claim in between must not be overwritten).
pub async fn write_status(
    api: &Api<MetalHost>,
    host: &MetalHost,
    status: &MetalHostStatus,
    with_state: bool,
) -> Result<(), ReconcileError> {
    let name = host.name_any();
    let mut fields = serde_json::json!({
        "powerState": status.power_state,
        "lastPowerCheck": status.last_power_check,
        "hardware": status.hardware,
        "errorType": status.error_type,
        "errorMessage": status.error_message,
        "observedGeneration": status.observed_generation,
        "conditions": status.conditions,
    });
    let mut patch = serde_json::json!({});
    if with_state {
        fields["state"] = serde_json::json!(status.state);
        patch["metadata"] = serde_json::json!({"resourceVersion": host.resource_version()});
    }
    patch["status"] = fields;
    match api
        .patch_status(
            &name,
            &super::merge_params(FIELD_MANAGER),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Err(ReconcileError::Requeue {
            what: format!("MetalHost {name} changed while registering"),
            after: Duration::from_millis(500),
        }),
        Err(e) => Err(ReconcileError::write(format!("MetalHost {name} status"))(e)),
    }
}

pub fn fault(e: &crate::bmc::BmcError) -> Fault {
    crate::metrics::record_bmc_error(e.reason());
    Fault {
        reason: e.reason(),
        message: e.to_string(),
    }
}

async fn connect(ctx: &HostContext, host: &MetalHost) -> Result<Arc<dyn Bmc>, Fault> {
    let target = load_target(&ctx.client, host).await.map_err(|e| Fault {
        reason: e.reason(),
        message: e.to_string(),
    })?;
    ctx.connector
        .connect(&key(host), target)
        .map_err(|e| fault(&e))
}

async fn reconcile(host: Arc<MetalHost>, ctx: Arc<HostContext>) -> Result<Action, ReconcileError> {
    if !super::passes_watch_filter(host.as_ref(), ctx.watch_filter.as_deref()) {
        return Ok(Action::await_change());
    }
    let name = host.name_any();
    let api: Api<MetalHost> =
        Api::namespaced(ctx.client.clone(), &host.namespace().unwrap_or_default());
    let now = conditions::now();
    let jitter = 0.9 + rand::random::<f64>() * 0.2;
    let interval = ctx.poll_interval.mul_f64(jitter);
    match plan(&host, now.0, interval) {
        HostPlan::Paused => {
            let mut status = host.status.clone().unwrap_or_default();
            conditions::set(
                &mut status.conditions,
                Want::t(
                    PAUSED,
                    "Paused",
                    format!("annotation {HOST_PAUSED_ANNOTATION} is set"),
                ),
                host.metadata.generation,
                &now,
            );
            write_status(&api, &host, &status, false).await?;
            Ok(Action::await_change())
        }
        HostPlan::Register => {
            let result = match connect(&ctx, &host).await {
                Err(f) => Err(f),
                Ok(bmc) => match bmc.power_state().await {
                    Err(e) => Err(fault(&e)),
                    Ok(power) => {
                        let inventory = if host
                            .status
                            .as_ref()
                            .and_then(|s| s.hardware.as_ref())
                            .is_none()
                        {
                            match bmc.inventory().await {
                                Ok(inv) => Some(inv),
                                Err(e) => {
                                    tracing::warn!(host = %name, error = %e, "inventory not read; will retry at the next registration");
                                    None
                                }
                            }
                        } else {
                            None
                        };
                        Ok((power, inventory))
                    }
                },
            };
            let failed = result.as_ref().err().cloned();
            let was = host.status.as_ref().and_then(|s| s.state);
            let status = registration_status(&host, result, &now);
            write_status(&api, &host, &status, true).await?;
            match failed {
                Some(f) => {
                    if was != Some(HostState::Error) {
                        ctx.events
                            .publish(host.as_ref(), true, f.reason, f.message.clone())
                            .await;
                    }
                    tracing::warn!(host = %name, reason = f.reason, "registration failed: {}", f.message);
                    // Retried with backoff; a changed credentials Secret retries at once.
                    Ok(Action::requeue(ctx.backoff.next(&key(host.as_ref()))))
                }
                None => {
                    ctx.backoff.reset(&key(host.as_ref()));
                    if was != status.state {
                        ctx.events
                            .publish(
                                host.as_ref(),
                                false,
                                "Registered",
                                format!(
                                    "BMC {} answered; host is {:?}",
                                    host.spec.bmc.address,
                                    status.state.unwrap_or_default()
                                ),
                            )
                            .await;
                    }
                    Ok(Action::requeue(interval))
                }
            }
        }
        HostPlan::HoldOff { force } => {
            let mut status = host.status.clone().unwrap_or_default();
            let reason = if force { "ForcedOff" } else { "GracefulOff" };
            conditions::set(
                &mut status.conditions,
                Want::t(
                    "PoweredOffByOperator",
                    "OnlineFalse",
                    "spec.online is false",
                ),
                host.metadata.generation,
                &now,
            );
            let result = match connect(&ctx, &host).await {
                Err(f) => Err(f),
                Ok(bmc) => {
                    let action = if force {
                        PowerAction::ForceOff
                    } else {
                        PowerAction::GracefulOff
                    };
                    match bmc.power(action).await {
                        Err(e) => Err(fault(&e)),
                        Ok(()) => bmc.power_state().await.map_err(|e| fault(&e)),
                    }
                }
            };
            let status = poll_status(
                &MetalHost {
                    status: Some(status),
                    ..(*host).clone()
                },
                result,
                &now,
            );
            write_status(&api, &host, &status, false).await?;
            ctx.events
                .publish(
                    host.as_ref(),
                    false,
                    reason,
                    "holding the host powered off: spec.online is false",
                )
                .await;
            Ok(Action::requeue(Duration::from_secs(10)))
        }
        HostPlan::Poll => {
            let result = match connect(&ctx, &host).await {
                Err(f) => Err(f),
                Ok(bmc) => bmc.power_state().await.map_err(|e| fault(&e)),
            };
            let mut status = poll_status(&host, result, &now);
            if host.spec.online {
                status
                    .conditions
                    .retain(|c| c.type_ != "PoweredOffByOperator");
            }
            write_status(&api, &host, &status, false).await?;
            Ok(Action::requeue(interval))
        }
        HostPlan::Wait(d) => Ok(Action::requeue(d)),
    }
}

fn error_policy(host: Arc<MetalHost>, error: &ReconcileError, ctx: Arc<HostContext>) -> Action {
    if let Some(after) = error.requeue_after() {
        return Action::requeue(after);
    }
    let delay = ctx.backoff.next(&key(host.as_ref()));
    tracing::warn!(host = %key(host.as_ref()), error = %error, retry_in = ?delay, "MetalHost reconcile failed");
    Action::requeue(delay)
}

/// The hosts whose credentials or CA Secret is `secret`.
fn hosts_using(
    hosts: &Store<MetalHost>,
    namespace: &str,
    secret: &str,
) -> Vec<ObjectRef<MetalHost>> {
    hosts
        .state()
        .into_iter()
        .filter(|h| {
            h.namespace().as_deref() == Some(namespace)
                && (h.spec.bmc.credentials_name == secret
                    || h.spec.bmc.ca_secret_name.as_deref() == Some(secret))
        })
        .map(|h| ObjectRef::from_obj(h.as_ref()))
        .collect()
}

/// Builds the controller; `store()` of the result is the hosts store the others share.
pub fn controller(client: kube::Client, namespace: Option<&str>) -> Controller<MetalHost> {
    let (hosts, secrets): (Api<MetalHost>, Api<PartialObjectMeta<Secret>>) = match namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let controller = Controller::new(hosts, watcher::Config::default());
    let store = controller.store();
    // Credentials are re-checked as soon as their Secret changes (metadata only is watched).
    let secret_changes = watcher(secrets, watcher::Config::default())
        .default_backoff()
        .touched_objects();
    controller.watches_stream(secret_changes, move |secret| {
        hosts_using(
            &store,
            &secret.namespace().unwrap_or_default(),
            &secret.name_any(),
        )
    })
}

pub async fn run(controller: Controller<MetalHost>, ctx: Arc<HostContext>) {
    controller
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(e) = result {
                tracing::debug!(error = %e, "MetalHost controller event");
            }
        })
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::metalhost::{BmcDetails, MetalHostSpec};

    fn at(secs: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000 + secs).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
    }

    fn host(status: Option<MetalHostStatus>, online: bool) -> MetalHost {
        let mut h = MetalHost::new(
            "h",
            MetalHostSpec {
                bmc: BmcDetails {
                    address: "redfish://b".into(),
                    credentials_name: "c".into(),
                    disable_certificate_verification: None,
                    ca_secret_name: None,
                },
                boot_mac_address: "52:54:00:00:00:01".into(),
                boot_mode: None,
                online,
                description: None,
            },
        );
        h.status = status;
        h
    }

    fn registered(state: HostState, power: PowerState, checked: i64) -> MetalHostStatus {
        let mut s = MetalHostStatus {
            state: Some(state),
            power_state: Some(power),
            last_power_check: Some(Time(at(checked))),
            ..Default::default()
        };
        conditions::set(
            &mut s.conditions,
            Want::t(REGISTERED, "Registered", ""),
            None,
            &Time(at(0)),
        );
        s
    }

    #[test]
    fn plan_table() {
        let five_min = Duration::from_secs(300);
        let mut paused = host(
            Some(registered(HostState::Available, PowerState::Off, 0)),
            true,
        );
        paused.metadata.annotations =
            Some([(HOST_PAUSED_ANNOTATION.to_string(), "".to_string())].into());
        let mut reg_error = registered(HostState::Error, PowerState::Unknown, 0);
        reg_error.error_type = Some(HostErrorType::RegistrationError);
        let cases: Vec<(&str, MetalHost, i64, HostPlan)> = vec![
            (
                "new host registers",
                host(None, true),
                0,
                HostPlan::Register,
            ),
            (
                "registration error retries",
                host(Some(reg_error), true),
                10,
                HostPlan::Register,
            ),
            ("paused does nothing", paused, 10, HostPlan::Paused),
            (
                "fresh power reading waits",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                100,
                HostPlan::Wait(Duration::from_secs(200)),
            ),
            (
                "stale power reading polls",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    true,
                ),
                300,
                HostPlan::Poll,
            ),
            (
                "offline host that is on is powered off",
                host(
                    Some(registered(HostState::Available, PowerState::On, 0)),
                    false,
                ),
                10,
                HostPlan::HoldOff { force: false },
            ),
            (
                "offline host that is off just polls",
                host(
                    Some(registered(HostState::Available, PowerState::Off, 0)),
                    false,
                ),
                400,
                HostPlan::Poll,
            ),
        ];
        for (what, h, now, want) in cases {
            assert_eq!(plan(&h, at(now), five_min), want, "{what}");
        }
    }

    #[test]
    fn registration_outcomes() {
        let now = Time(at(5));
        let ok = registration_status(
            &host(None, true),
            Ok((PowerState::Off, Some(HardwareInventory::default()))),
            &now,
        );
        assert_eq!(ok.state, Some(HostState::Available));
        assert!(conditions::is_true(&ok.conditions, REGISTERED));
        assert!(ok.hardware.is_some());

        let bad = registration_status(
            &host(None, true),
            Err(Fault {
                reason: "BmcAuthFailed",
                message: "refused user admin".into(),
            }),
            &now,
        );
        assert_eq!(bad.state, Some(HostState::Error));
        assert_eq!(bad.error_type, Some(HostErrorType::RegistrationError));
        let c = conditions::get(&bad.conditions, REGISTERED).expect("condition");
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "BmcAuthFailed")
        );

        // A claimed host that re-registers (e.g. credentials rotated) keeps its provisioning state.
        let mut busy = registered(HostState::Provisioned, PowerState::On, 0);
        busy.consumer_ref = Some(crate::api::metalhost::ConsumerReference {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "MetalMachine".into(),
            name: "m".into(),
            uid: "u".into(),
        });
        let kept = registration_status(&host(Some(busy), true), Ok((PowerState::On, None)), &now);
        assert_eq!(kept.state, Some(HostState::Provisioned));
    }
}

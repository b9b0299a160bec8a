//! Leader election, so two manager replicas never act at once.
//!
//! The election itself is `kube-lease-manager` (a maintained crate; it renews the Lease when fewer
//! than `grace` seconds are left and takes over an expired one). What it cannot give is a *fence*:
//! a leader that stalls (a stopped process, a GC pause, a partition) wakes up still believing it
//! leads. So every mutating request of the controllers goes through [`Leadership::fenced`], which
//! refuses it once this replica's own renewal is older than `duration - grace/2`. The deadline is
//! computed from the Lease's `renewTime`, which this replica wrote with its own clock, so no clock
//! of another replica is involved; a standby takes over only at `renewTime + duration`, leaving
//! `grace/2` for clock skew between replicas. When the deadline passes or the Lease goes to someone
//! else, [`Leadership::lost`] resolves and the manager exits, as controller-runtime does.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{StreamExt, future::BoxFuture};
use http::{Method, Request, Response};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::Api;
use kube::client::Body;
use kube::runtime::{WatchStreamExt, watcher};
use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Debug)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    /// How long a Lease stays valid after its last renewal.
    pub duration: Duration,
    /// The leader renews when fewer than `grace` are left, and stops writing `grace/2` before expiry.
    pub grace: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error(
        "leader election: lease duration ({duration}s) and grace ({grace}s) must be whole seconds, grace > 0 and shorter than the duration"
    )]
    Config { duration: u64, grace: u64 },
    #[error("leader election on Lease {namespace}/{name}: {message}")]
    Lease {
        namespace: String,
        name: String,
        message: String,
    },
}

impl LeaseConfig {
    fn validated(&self) -> Result<(u64, u64), LeaderError> {
        let (duration, grace) = (self.duration.as_secs(), self.grace.as_secs());
        if grace == 0 || grace >= duration {
            return Err(LeaderError::Config { duration, grace });
        }
        Ok((duration, grace))
    }
}

/// Until when this replica may write, given the Lease as last seen: `renewTime + duration -
/// grace/2` when the Lease is ours, nothing otherwise.
pub fn write_deadline(
    lease: &LeaseSpec,
    identity: &str,
    grace: Duration,
) -> Option<jiff::Timestamp> {
    if lease.holder_identity.as_deref() != Some(identity) {
        return None;
    }
    let renewed = lease.renew_time.as_ref()?.0;
    let duration = Duration::from_secs(u64::try_from(lease.lease_duration_seconds?).ok()?);
    let valid_for = duration.checked_sub(grace / 2)?;
    let valid_for = jiff::SignedDuration::try_from(valid_for).ok()?;
    renewed.checked_add(valid_for).ok()
}

/// Whether writes are allowed now: set from every observed version of the Lease.
#[derive(Debug)]
pub struct WriteFence {
    deadline: watch::Sender<Option<jiff::Timestamp>>,
    refused: std::sync::atomic::AtomicU64,
}

impl WriteFence {
    fn new() -> Self {
        Self {
            deadline: watch::Sender::new(None),
            refused: Default::default(),
        }
    }

    pub fn is_open(&self) -> bool {
        matches!(*self.deadline.borrow(), Some(d) if jiff::Timestamp::now() < d)
    }

    /// Writes refused so far (each is also logged).
    pub fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }
}

fn is_mutating(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

#[derive(Debug, thiserror::Error)]
#[error("{method} {path} refused: this replica's leader Lease is past its renew deadline")]
pub struct Fenced {
    method: Method,
    path: String,
}

/// A tower service that sends through `inner` unless the request writes and the fence is shut.
#[derive(Clone)]
struct FencedService {
    inner: kube::Client,
    fence: Arc<WriteFence>,
}

impl tower::Service<Request<Body>> for FencedService {
    type Response = Response<Body>;
    type Error = tower::BoxError;
    type Future = BoxFuture<'static, Result<Response<Body>, tower::BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let (inner, fence) = (self.inner.clone(), self.fence.clone());
        // Checked when the future is first polled: that is when the request leaves the
        // manager's queue (`kubeconn::gate`), so a write that waited there is not let through
        // on a check made before the wait.
        Box::pin(async move {
            if is_mutating(request.method()) && !fence.is_open() {
                fence
                    .refused
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let refused = Fenced {
                    method: request.method().clone(),
                    path: request.uri().path().to_string(),
                };
                tracing::error!(error = %refused, "write fenced");
                return Err(refused.into());
            }
            inner.send(request).await.map_err(Into::into)
        })
    }
}

/// Held while this replica leads.
pub struct Leadership {
    config: LeaseConfig,
    fence: Arc<WriteFence>,
    is_leader: watch::Receiver<bool>,
    /// Taken by `release`; aborted on drop (a dropped manager is a killed one, in tests).
    election: Option<JoinHandle<Result<LeaseManager, kube_lease_manager::LeaseManagerError>>>,
    lease_watch: JoinHandle<()>,
}

/// Why leadership ended.
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    #[error("another replica holds the leader Lease now")]
    TakenOver,
    #[error("the leader Lease was not renewed before its deadline")]
    NotRenewed,
    #[error("the leader election task stopped")]
    ElectionStopped,
}

/// Waits until this replica holds the Lease and may write. A standby waits here.
pub async fn acquire(client: kube::Client, config: LeaseConfig) -> Result<Leadership, LeaderError> {
    let (duration, grace) = config.validated()?;
    let lease_error = |message: String| LeaderError::Lease {
        namespace: config.namespace.clone(),
        name: config.name.clone(),
        message,
    };
    let fence = Arc::new(WriteFence::new());
    let lease_watch = tokio::spawn(watch_lease(client.clone(), config.clone(), fence.clone()));
    let manager = LeaseManagerBuilder::new(client, &config.name)
        .with_namespace(&config.namespace)
        .with_identity(&config.identity)
        .with_duration(duration)
        .with_grace(grace)
        .with_field_manager(format!("metalboot-leader-{}", config.identity))
        .build()
        .await
        .map_err(|e| {
            lease_watch.abort();
            lease_error(e.to_string())
        })?;
    let (mut is_leader, election) = manager.watch().await;
    tracing::info!(lease = %config.name, identity = %config.identity, "waiting for the leader Lease");
    let mut fence_changes = fence.deadline.subscribe();
    let became = async {
        is_leader.wait_for(|leads| *leads).await.ok()?;
        // The controllers start with an open fence, not with their first writes refused.
        fence_changes
            .wait_for(|d| matches!(d, Some(d) if jiff::Timestamp::now() < *d))
            .await
            .ok()?;
        Some(())
    };
    if became.await.is_none() {
        lease_watch.abort();
        return Err(lease_error("the election task stopped".into()));
    }
    tracing::info!(lease = %config.name, identity = %config.identity, "became leader");
    Ok(Leadership {
        config,
        fence,
        is_leader,
        election: Some(election),
        lease_watch,
    })
}

/// Keeps the fence in step with the Lease, from a watch of that one object.
async fn watch_lease(client: kube::Client, config: LeaseConfig, fence: Arc<WriteFence>) {
    let api: Api<Lease> = Api::namespaced(client, &config.namespace);
    let selector = format!("metadata.name={}", config.name);
    let mut holder: Option<String> = None;
    let mut events = watcher(api, watcher::Config::default().fields(&selector))
        .default_backoff()
        .boxed();
    while let Some(event) = events.next().await {
        let lease = match event {
            Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => lease,
            Ok(watcher::Event::Delete(_)) => {
                fence.deadline.send_replace(None);
                continue;
            }
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(lease = %config.name, error = %e, "watching the leader Lease");
                continue;
            }
        };
        let spec = lease.spec.unwrap_or_default();
        if spec.holder_identity != holder {
            holder.clone_from(&spec.holder_identity);
            if let Some(h) = holder.as_deref().filter(|h| *h != config.identity) {
                tracing::info!(lease = %config.name, holder = %h, "another replica leads");
            }
        }
        fence
            .deadline
            .send_replace(write_deadline(&spec, &config.identity, config.grace));
    }
}

impl Leadership {
    /// `client`, with every write refused once this replica may no longer lead.
    pub fn fenced(&self, client: kube::Client) -> kube::Client {
        let namespace = client.default_namespace().to_string();
        kube::Client::new(
            FencedService {
                inner: client,
                fence: self.fence.clone(),
            },
            namespace,
        )
    }

    pub fn fence(&self) -> Arc<WriteFence> {
        self.fence.clone()
    }

    /// Resolves when this replica stops leading: the Lease went to another replica, or was not
    /// renewed before the write deadline (then the fence already refuses writes).
    pub async fn lost(&mut self) -> Lost {
        let mut deadlines = self.fence.deadline.subscribe();
        loop {
            let deadline = *deadlines.borrow_and_update();
            let Some(deadline) = deadline else {
                return Lost::NotRenewed;
            };
            let left = jiff::Timestamp::now().duration_until(deadline);
            let Ok(left) = Duration::try_from(left) else {
                return Lost::NotRenewed;
            };
            tokio::select! {
                changed = self.is_leader.changed() => match changed {
                    Ok(()) if !*self.is_leader.borrow() => return Lost::TakenOver,
                    Ok(()) => {}
                    Err(_) => return Lost::ElectionStopped,
                },
                _ = deadlines.changed() => {}
                // Monotonic: a stopped process wakes here at once, past the deadline.
                _ = tokio::time::sleep(left) => {}
            }
        }
    }

    /// Steps down on a clean shutdown so a standby takes over at once, not after expiry.
    pub async fn release(mut self) {
        let Some(election) = self.election.take() else {
            return;
        };
        // The election task releases the Lease once every receiver of its state is gone.
        let (_, closed) = watch::channel(false);
        drop(std::mem::replace(&mut self.is_leader, closed));
        let name = &self.config.name;
        match tokio::time::timeout(Duration::from_secs(5), election).await {
            Ok(Ok(Ok(_))) => tracing::info!(lease = %name, "released the leader Lease"),
            Ok(Ok(Err(e))) => {
                tracing::warn!(lease = %name, error = %e, "releasing the leader Lease")
            }
            Ok(Err(_)) | Err(_) => {
                tracing::warn!(lease = %name, "the leader Lease was not released in time")
            }
        }
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        self.lease_watch.abort();
        if let Some(election) = &self.election {
            election.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    fn at(s: i64) -> jiff::Timestamp {
        jiff::Timestamp::from_second(s).unwrap_or(jiff::Timestamp::UNIX_EPOCH)
    }

    fn lease(holder: Option<&str>, renewed: Option<i64>, duration: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(String::from),
            lease_duration_seconds: duration,
            renew_time: renewed.map(|s| MicroTime(at(s))),
            ..Default::default()
        }
    }

    #[test]
    fn the_write_deadline_comes_grace_over_two_before_expiry() {
        let grace = Duration::from_secs(10);
        let rows = [
            (
                "ours",
                lease(Some("a"), Some(1000), Some(15)),
                Some(at(1010)),
            ),
            (
                "another replica's",
                lease(Some("b"), Some(1000), Some(15)),
                None,
            ),
            ("released", lease(None, None, None), None),
            ("never renewed", lease(Some("a"), None, Some(15)), None),
            ("no duration", lease(Some("a"), Some(1000), None), None),
            (
                "negative duration",
                lease(Some("a"), Some(1000), Some(-5)),
                None,
            ),
            (
                "duration under grace/2",
                lease(Some("a"), Some(1000), Some(4)),
                None,
            ),
        ];
        for (what, spec, expected) in rows {
            assert_eq!(write_deadline(&spec, "a", grace), expected, "{what}");
        }
    }

    #[test]
    fn only_reads_pass_a_shut_fence() {
        for (method, mutating) in [
            (Method::GET, false),
            (Method::HEAD, false),
            (Method::POST, true),
            (Method::PUT, true),
            (Method::PATCH, true),
            (Method::DELETE, true),
        ] {
            assert_eq!(is_mutating(&method), mutating, "{method}");
        }
    }

    #[test]
    fn bad_timings_are_refused_before_the_crate_sees_them() {
        let config = |duration, grace| LeaseConfig {
            namespace: "ns".into(),
            name: "l".into(),
            identity: "a".into(),
            duration: Duration::from_secs(duration),
            grace: Duration::from_secs(grace),
        };
        assert!(config(15, 10).validated().is_ok());
        assert!(config(15, 0).validated().is_err(), "zero grace");
        assert!(config(15, 15).validated().is_err(), "grace = duration");
        assert!(config(0, 0).validated().is_err(), "zero duration");
    }
}

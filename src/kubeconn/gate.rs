//! A bound on the manager's apiserver requests in flight, with a lane around it for the work a
//! waiting host's callback is held up by.
//!
//! Unbounded, a burst of Machines starts hundreds of passes whose requests all reach the
//! apiserver at once; on a saturated apiserver every request then takes as long as the whole
//! crowd (250 ms p50, 1 s p99 at N=1000 on two cores), and a callback needs three writes in a row
//! (the boot Secret's record, providerID, ready). Bounded, the crowd waits here in FIFO order
//! while the apiserver works through a short queue, and a request made inside [`urgent`] skips
//! the wait. Watches (open for minutes) and Lease renewals (leadership must not starve) are never
//! held.
//!
//! client-go bounds by rate (QPS/burst) and the apiserver by priority and fairness, which exempts
//! `system:masters` clients, so neither orders the manager's own requests; tower's
//! `ConcurrencyLimit` takes its permit in `poll_ready`, before the request (and so its lane) is
//! known. Hence this small layer.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::Semaphore;

tokio::task_local! {
    static URGENT: ();
}

/// Runs `work` with its apiserver requests ahead of the bounded crowd.
pub async fn urgent<F: Future>(work: F) -> F::Output {
    URGENT.scope((), work).await
}

/// Whether the current task is inside [`urgent`].
pub fn is_urgent() -> bool {
    URGENT.try_with(|_| ()).is_ok()
}

/// How many ordinary requests one manager keeps in flight by default. At N=1000 on two cores,
/// 8 reached all Running within the spread of unbounded runs, and halved the time a callback's
/// writes took against 32 (the apiserver's own default bound is 400 reads and 200 writes for
/// all its clients together). `--api-requests-in-flight` raises it for a larger apiserver.
pub const DEFAULT_IN_FLIGHT: usize = 8;

/// The layer: `in_flight` ordinary requests at once (0: no bound).
#[derive(Clone)]
pub struct RequestGate {
    permits: Option<Arc<Semaphore>>,
}

impl RequestGate {
    pub fn new(in_flight: usize) -> Self {
        Self {
            permits: (in_flight > 0).then(|| Arc::new(Semaphore::new(in_flight))),
        }
    }
}

impl<S> tower::Layer<S> for RequestGate {
    type Service = Gated<S>;

    fn layer(&self, inner: S) -> Gated<S> {
        Gated {
            inner,
            permits: self.permits.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Gated<S> {
    inner: S,
    permits: Option<Arc<Semaphore>>,
}

/// Requests that are never held: watches stay open for minutes, and a Lease renewal stuck
/// behind a burst would hand leadership away.
fn exempt<B>(request: &http::Request<B>) -> bool {
    let uri = request.uri();
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|p| p == "watch=true" || p == "watch=1"));
    watch || uri.path().starts_with("/apis/coordination.k8s.io/")
}

impl<S, B> tower::Service<http::Request<B>> for Gated<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let permits = self.permits.clone().filter(|_| !exempt(&request));
        // The inner future does nothing until polled; it is polled once the permit is held.
        // kube's Buffer hands this future back to the requesting task, so `is_urgent` sees
        // that task's lane.
        let response = self.inner.call(request);
        Box::pin(async move {
            let _permit = match permits {
                Some(permits) if !is_urgent() => permits.acquire_owned().await.ok(),
                _ => None,
            };
            response.await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tower::{Layer, Service, ServiceExt};

    /// A service that counts requests in flight and finishes each when told.
    #[derive(Clone, Default)]
    struct Counting {
        now: Arc<AtomicUsize>,
        peak: Arc<AtomicUsize>,
        release: Arc<tokio::sync::Notify>,
    }

    impl Service<http::Request<()>> for Counting {
        type Response = String;
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<String, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<()>) -> Self::Future {
            let (now, peak, release) = (self.now.clone(), self.peak.clone(), self.release.clone());
            Box::pin(async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                release.notified().await;
                now.fetch_sub(1, Ordering::SeqCst);
                Ok(request.uri().to_string())
            })
        }
    }

    fn get(path: &str) -> http::Request<()> {
        http::Request::get(path).body(()).unwrap_or_default()
    }

    async fn until(what: impl Fn() -> bool) {
        while !what() {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn ordinary_requests_wait_and_urgent_watch_and_lease_ones_do_not() {
        let backend = Counting::default();
        let gated = RequestGate::new(2).layer(backend.clone());
        let mut calls = Vec::new();
        for i in 0..5 {
            let svc = gated.clone();
            calls.push(tokio::spawn(
                svc.oneshot(get(&format!("/api/v1/namespaces/ns/secrets/s{i}"))),
            ));
        }
        let in_flight = || backend.now.load(Ordering::SeqCst);
        until(|| in_flight() == 2).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2, "three ordinary requests wait for a permit");

        let urgent_call = tokio::spawn(urgent(gated.clone().oneshot(get(
            "/apis/metalboot.io/v1alpha1/namespaces/ns/metalmachines/m",
        ))));
        let watch = tokio::spawn(
            gated
                .clone()
                .oneshot(get("/api/v1/secrets?watch=true&resourceVersion=1")),
        );
        let lease = tokio::spawn(
            gated
                .clone()
                .oneshot(get("/apis/coordination.k8s.io/v1/namespaces/ns/leases/l")),
        );
        // Were they held too, this would wait forever: fail instead.
        let past_the_gate = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            until(|| in_flight() == 5),
        );
        assert!(past_the_gate.await.is_ok(), "urgent, watch and lease pass");

        // Finish everything: each release lets waiting requests in until all are done.
        let all = async {
            for call in calls.into_iter().chain([urgent_call, watch, lease]) {
                while !call.is_finished() {
                    backend.release.notify_waiters();
                    tokio::task::yield_now().await;
                }
                assert!(matches!(call.await, Ok(Ok(_))));
            }
        };
        all.await;
        assert_eq!(
            backend.peak.load(Ordering::SeqCst),
            5,
            "2 ordinary + 3 past the gate"
        );
    }

    #[tokio::test]
    async fn zero_means_no_bound() {
        let backend = Counting::default();
        let gated = RequestGate::new(0).layer(backend.clone());
        let calls: Vec<_> = (0..10)
            .map(|i| tokio::spawn(gated.clone().oneshot(get(&format!("/api/v1/x{i}")))))
            .collect();
        until(|| backend.now.load(Ordering::SeqCst) == 10).await;
        for call in calls {
            while !call.is_finished() {
                backend.release.notify_waiters();
                tokio::task::yield_now().await;
            }
        }
    }
}

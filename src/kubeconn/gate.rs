//! A bound on the manager's apiserver requests in flight, with a lane around it for the work a
//! waiting host's callback is held up by.
//!
//! Unbounded, a burst of Machines starts hundreds of passes whose requests all reach the
//! apiserver at once; on a saturated apiserver every request then takes as long as the whole
//! crowd (250 ms p50, 1 s p99 at N=1000 on two cores), and a callback needs three writes in a row
//! (the boot Secret's record, providerID, ready). Bounded, the crowd waits here (in FIFO order
//! for a permit; the few holding one while an urgent request is out start in no set order)
//! while the apiserver works through a short queue, and a request made inside [`urgent`] skips
//! the wait. Watches (open for minutes) and Lease renewals (leadership must not starve) are never
//! held. While an urgent request is out, at most `beside_urgent` ordinary ones are: the
//! apiserver does not order requests by urgency, so each one beside it slows its answer.
//! Each request's wait here and its answer are timed per lane
//! (`metalboot_apiserver_request_seconds`).
//!
//! client-go bounds by rate (QPS/burst) and the apiserver by priority and fairness, which exempts
//! `system:masters` clients, so neither orders the manager's own requests; tower's
//! `ConcurrencyLimit` takes its permit in `poll_ready`, before the request (and so its lane) is
//! known. Hence this small wrapper.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use kube::client::Body;
use tokio::sync::Semaphore;

tokio::task_local! {
    static URGENT: ();
    static PRIORITY: Priority;
}

/// A pass's place in the queue, which can be raised while it waits: a host's callback whose pass
/// waits for this pass's turn on the same machine raises it, so the pass it waits for is not
/// held in the crowd (1.7 s p99 of the callback's wait at N=1000 was spent there).
#[derive(Clone, Default)]
pub struct Priority(Arc<Raised>);

#[derive(Default)]
struct Raised {
    raised: std::sync::atomic::AtomicBool,
    notify: tokio::sync::Notify,
}

impl Priority {
    /// From now on this pass's requests skip the wait, including one waiting now.
    pub fn raise(&self) {
        self.0
            .raised
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.0.notify.notify_waiters();
    }

    pub fn is_raised(&self) -> bool {
        self.0.raised.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Returns once raised.
    async fn raised(&self) {
        loop {
            // Created before the check, so a raise in between still wakes it.
            let notified = self.0.notify.notified();
            if self.is_raised() {
                return;
            }
            notified.await;
        }
    }
}

/// Runs `work` with its apiserver requests in the crowd until `priority` is raised.
pub async fn with_priority<F: Future>(priority: Priority, work: F) -> F::Output {
    PRIORITY.scope(priority, work).await
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

/// How many ordinary requests may be in flight while an urgent one is, by default: a new
/// ordinary request then starts only when fewer are (those already out finish first). At
/// N=1000 on two cores, 1 against 8 took the urgent answers' p99 from 431–443 ms to
/// 125–184 ms, and callback → ready from 974–1669 ms to 466–474 ms, with all Running no
/// slower, in two of three runs. `--api-requests-in-flight-beside-callbacks` changes it (equal to the bound: no
/// difference).
pub const DEFAULT_BESIDE_URGENT: usize = 1;

/// A permit is held at most this long: a request hung on a dropped connection keeps its own
/// caller waiting, not every other request behind the bound.
const HOLD_AT_MOST: Duration = Duration::from_secs(30);

/// `client`, with at most `in_flight` ordinary requests at once (0: no bound), and, while an
/// urgent (or raised) request is in flight, a new one started only when fewer than
/// `beside_urgent` are. Applied by
/// the manager around its leader fence, so a write is checked against the fence when it leaves
/// the queue, not when it joins it.
pub fn gated(client: kube::Client, in_flight: usize, beside_urgent: usize) -> kube::Client {
    gate(client, in_flight, beside_urgent, true)
}

/// [`gated`], for a client of another cluster's apiserver (a workload cluster's): the same
/// bound and lanes, its own, but not timed in `metalboot_apiserver_request_seconds`, which
/// times the management apiserver's requests.
pub fn gated_elsewhere(
    client: kube::Client,
    in_flight: usize,
    beside_urgent: usize,
) -> kube::Client {
    gate(client, in_flight, beside_urgent, false)
}

fn gate(client: kube::Client, in_flight: usize, beside_urgent: usize, timed: bool) -> kube::Client {
    if in_flight == 0 {
        return client;
    }
    let namespace = client.default_namespace().to_string();
    kube::Client::new(
        Gated {
            timed,
            inner: client,
            permits: Arc::new(Semaphore::new(in_flight)),
            lanes: Arc::new(Lanes {
                // At least one, so ordinary work always moves.
                beside_urgent: beside_urgent.clamp(1, in_flight),
                ..Lanes::default()
            }),
        },
        namespace,
    )
}

#[derive(Clone)]
struct Gated {
    /// Whether requests are timed in the management apiserver's metrics.
    timed: bool,
    inner: kube::Client,
    permits: Arc<Semaphore>,
    lanes: Arc<Lanes>,
}

/// Requests in flight per lane, so ordinary ones can give way while urgent ones are out.
#[derive(Default)]
struct Lanes {
    urgent: AtomicUsize,
    ordinary: AtomicUsize,
    beside_urgent: usize,
    /// Woken when either count falls.
    fell: tokio::sync::Notify,
}

/// One request counted in its lane until it is answered or dropped.
struct InFlight {
    lanes: Arc<Lanes>,
    urgent: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let count = match self.urgent {
            true => &self.lanes.urgent,
            false => &self.lanes.ordinary,
        };
        count.fetch_sub(1, Ordering::SeqCst);
        self.lanes.fell.notify_waiters();
    }
}

impl Lanes {
    fn urgent(self: &Arc<Self>) -> InFlight {
        self.urgent.fetch_add(1, Ordering::SeqCst);
        InFlight {
            lanes: self.clone(),
            urgent: true,
        }
    }

    /// Returns once an ordinary request may start: at once when no urgent one is in flight,
    /// else when fewer than `beside_urgent` ordinary ones are.
    async fn ordinary(self: &Arc<Self>) -> InFlight {
        loop {
            // Registered before the counts are read, so a fall in between still wakes it.
            let fell = self.fell.notified();
            tokio::pin!(fell);
            fell.as_mut().enable();
            let ordinary = self.ordinary.load(Ordering::SeqCst);
            let may_start =
                self.urgent.load(Ordering::SeqCst) == 0 || ordinary < self.beside_urgent;
            if may_start {
                if self
                    .ordinary
                    .compare_exchange(ordinary, ordinary + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    return InFlight {
                        lanes: self.clone(),
                        urgent: false,
                    };
                }
                continue;
            }
            fell.await;
        }
    }
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

impl tower::Service<http::Request<Body>> for Gated {
    type Response = http::Response<Body>;
    type Error = tower::BoxError;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let (inner, permits, lanes, timed) = (
            self.inner.clone(),
            self.permits.clone(),
            self.lanes.clone(),
            self.timed,
        );
        let held = !exempt(&request);
        // kube's Buffer hands this future back to the requesting task to poll, so `is_urgent`
        // sees that task's lane.
        Box::pin(async move {
            let arrived = std::time::Instant::now();
            let priority = PRIORITY.try_with(Priority::clone).ok();
            let raised = priority.as_ref().is_some_and(Priority::is_raised);
            let (permit, counted) = match (held, is_urgent() || raised, priority) {
                (false, _, _) => (None, None),
                (true, true, _) => (None, Some(lanes.urgent())),
                (true, false, None) => {
                    let permit = permits.acquire_owned().await.ok();
                    (permit, Some(lanes.ordinary().await))
                }
                (true, false, Some(priority)) => tokio::select! {
                    permit = async {
                        let permit = permits.acquire_owned().await.ok();
                        (permit, Some(lanes.ordinary().await))
                    } => permit,
                    () = priority.raised() => (None, Some(lanes.urgent())),
                },
            };
            // Timed per lane, so a slow answer can be told from a long wait here.
            use crate::metrics::{ApiserverRequestStage as Stage, observe_apiserver_request};
            let urgent = counted.as_ref().filter(|_| timed).map(|c| c.urgent);
            let sent = std::time::Instant::now();
            if let Some(urgent) = urgent {
                let queued = sent.duration_since(arrived).as_secs_f64();
                observe_apiserver_request(urgent, Stage::Queued, queued);
            }
            let response = async {
                let answered = inner.send(request).await;
                if let Some(urgent) = urgent {
                    observe_apiserver_request(
                        urgent,
                        Stage::Answered,
                        sent.elapsed().as_secs_f64(),
                    );
                }
                answered
            };
            if permit.is_none() && counted.is_none() {
                return response.await.map_err(Into::into);
            }
            // Both are given back with the answer, or after HOLD_AT_MOST: a hung urgent request
            // must not hold ordinary ones back for good either.
            tokio::pin!(response);
            tokio::select! {
                answered = &mut response => return answered.map_err(Into::into),
                () = tokio::time::sleep(HOLD_AT_MOST) => drop((permit, counted)),
            }
            response.await.map_err(Into::into)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::pin::Pin;

    /// An apiserver stand-in for the wrapper alone: counts requests in flight and answers each
    /// when told.
    #[derive(Clone, Default)]
    struct Counting {
        now: Arc<AtomicUsize>,
        peak: Arc<AtomicUsize>,
        release: Arc<tokio::sync::Notify>,
    }

    impl tower::Service<http::Request<Body>> for Counting {
        type Response = http::Response<String>;
        type Error = std::convert::Infallible;
        type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, request: http::Request<Body>) -> Self::Future {
            let (now, peak, release) = (self.now.clone(), self.peak.clone(), self.release.clone());
            Box::pin(async move {
                let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(n, Ordering::SeqCst);
                release.notified().await;
                now.fetch_sub(1, Ordering::SeqCst);
                Ok(http::Response::new(request.uri().to_string()))
            })
        }
    }

    fn get(path: &str) -> http::Request<Body> {
        let mut request = http::Request::new(Body::from(Vec::new()));
        if let Ok(uri) = path.parse() {
            *request.uri_mut() = uri;
        }
        request
    }

    async fn until(what: impl Fn() -> bool) {
        while !what() {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn ordinary_requests_wait_and_urgent_watch_and_lease_ones_do_not() {
        let backend = Counting::default();
        let client = gated(kube::Client::new(backend.clone(), "default"), 2, 2);
        let send = |path: String| {
            let client = client.clone();
            async move { client.send(get(&path)).await }
        };
        let mut calls = Vec::new();
        for i in 0..5 {
            calls.push(tokio::spawn(send(format!(
                "/api/v1/namespaces/ns/secrets/s{i}"
            ))));
        }
        let in_flight = || backend.now.load(Ordering::SeqCst);
        until(|| in_flight() == 2).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2, "three ordinary requests wait for a permit");

        let urgent_call = tokio::spawn(urgent(send(
            "/apis/metalboot.io/v1alpha1/namespaces/ns/metalmachines/m".into(),
        )));
        let watch = tokio::spawn(send("/api/v1/secrets?watch=true&resourceVersion=1".into()));
        let lease = tokio::spawn(send(
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l".into(),
        ));
        // Were they held too, this would wait forever: fail instead.
        let past_the_gate =
            tokio::time::timeout(Duration::from_secs(10), until(|| in_flight() == 5));
        assert!(past_the_gate.await.is_ok(), "urgent, watch and lease pass");

        // Finish everything: each release lets waiting requests in until all are done.
        for call in calls.into_iter().chain([urgent_call, watch, lease]) {
            while !call.is_finished() {
                backend.release.notify_waiters();
                tokio::task::yield_now().await;
            }
            assert!(matches!(call.await, Ok(Ok(_))));
        }
        assert_eq!(
            backend.peak.load(Ordering::SeqCst),
            5,
            "2 ordinary + 3 past the gate"
        );
    }

    /// A workload cluster's client is bounded the same way, with its own permits: the
    /// management client's crowd does not hold it up, nor it the crowd.
    #[tokio::test]
    async fn a_workload_clusters_requests_wait_for_their_own_bound() {
        let (management, workload) = (Counting::default(), Counting::default());
        let managed = gated(kube::Client::new(management.clone(), "default"), 1, 1);
        let elsewhere = gated_elsewhere(kube::Client::new(workload.clone(), "default"), 2, 1);
        let mut calls = Vec::new();
        for (client, n) in [(managed, 1), (elsewhere, 5)] {
            for i in 0..n {
                let client = client.clone();
                calls.push(tokio::spawn(async move {
                    client.send(get(&format!("/api/v1/nodes/n{i}"))).await
                }));
            }
        }
        let in_flight = || workload.now.load(Ordering::SeqCst);
        let reached = tokio::time::timeout(Duration::from_secs(10), until(|| in_flight() == 2));
        assert!(
            reached.await.is_ok(),
            "two pass through while the management bound is full"
        );
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2, "three wait for a permit");
        for call in calls {
            while !call.is_finished() {
                management.release.notify_waiters();
                workload.release.notify_waiters();
                tokio::task::yield_now().await;
            }
            assert!(matches!(call.await, Ok(Ok(_))));
        }
        assert_eq!(workload.peak.load(Ordering::SeqCst), 2);
    }

    /// A request waiting for a permit leaves the queue once its pass's priority is raised.
    #[tokio::test]
    async fn a_raised_priority_lets_a_waiting_request_through() {
        let backend = Counting::default();
        let client = gated(kube::Client::new(backend.clone(), "default"), 1, 1);
        let send = |path: &'static str| {
            let client = client.clone();
            async move { client.send(get(path)).await }
        };
        let first = tokio::spawn(send("/api/v1/first"));
        let in_flight = || backend.now.load(Ordering::SeqCst);
        until(|| in_flight() == 1).await;
        let priority = Priority::default();
        let waiting = tokio::spawn(with_priority(priority.clone(), send("/api/v1/second")));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 1, "the second request waits for the permit");
        priority.raise();
        let through = tokio::time::timeout(Duration::from_secs(10), until(|| in_flight() == 2));
        assert!(through.await.is_ok(), "raised, it no longer waits");
        for call in [first, waiting] {
            while !call.is_finished() {
                backend.release.notify_waiters();
                tokio::task::yield_now().await;
            }
            assert!(matches!(call.await, Ok(Ok(_))));
        }
    }

    /// How many requests of `lane` the manager's metrics saw answered so far.
    fn answered(lane: &str) -> f64 {
        let series = format!(
            "metalboot_apiserver_request_seconds_count{{lane=\"{lane}\",stage=\"answered\"}} "
        );
        crate::metrics::render()
            .lines()
            .find_map(|line| line.strip_prefix(series.as_str()))
            .and_then(|count| count.trim().parse().ok())
            .unwrap_or(0.0)
    }

    /// While an urgent request is out, only `beside_urgent` ordinary ones start; the rest
    /// start when it is answered. Each answer is timed in its lane.
    #[tokio::test]
    async fn ordinary_requests_give_way_while_an_urgent_one_is_out() {
        // Other tests share the process's metrics: compare counts, which only grow.
        let (urgent_before, ordinary_before) = (answered("urgent"), answered("ordinary"));
        let backend = Counting::default();
        let client = gated(kube::Client::new(backend.clone(), "default"), 4, 1);
        let send = |path: String| {
            let client = client.clone();
            async move { client.send(get(&path)).await }
        };
        let in_flight = || backend.now.load(Ordering::SeqCst);
        let urgent_call = tokio::spawn(urgent(send("/api/v1/urgent".into())));
        // Were requests held that should not be, these waits would last forever: fail instead.
        let ten_seconds = Duration::from_secs(10);
        let urgent_out = tokio::time::timeout(ten_seconds, until(|| in_flight() == 1));
        assert!(urgent_out.await.is_ok(), "the urgent request is not held");
        let calls: Vec<_> = (0..4)
            .map(|i| tokio::spawn(send(format!("/api/v1/ordinary{i}"))))
            .collect();
        let one_beside = tokio::time::timeout(ten_seconds, until(|| in_flight() >= 2));
        assert!(
            one_beside.await.is_ok(),
            "one ordinary request starts beside it"
        );
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(in_flight(), 2, "one ordinary request beside the urgent one");

        // Answer both: with no urgent request left, the other three start at once (bound 4).
        backend.release.notify_waiters();
        let rest = tokio::time::timeout(Duration::from_secs(10), until(|| in_flight() == 3));
        assert!(rest.await.is_ok(), "the waiting three start together");
        assert!(matches!(urgent_call.await, Ok(Ok(_))));
        for call in calls {
            while !call.is_finished() {
                backend.release.notify_waiters();
                tokio::task::yield_now().await;
            }
            assert!(matches!(call.await, Ok(Ok(_))));
        }
        assert!(answered("urgent") >= urgent_before + 1.0);
        assert!(answered("ordinary") >= ordinary_before + 4.0);
    }

    #[tokio::test]
    async fn zero_means_no_bound() {
        let backend = Counting::default();
        let client = gated(kube::Client::new(backend.clone(), "default"), 0, 0);
        let calls: Vec<_> = (0..10)
            .map(|i| {
                let client = client.clone();
                tokio::spawn(async move { client.send(get(&format!("/api/v1/x{i}"))).await })
            })
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

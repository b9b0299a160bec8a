//! Test support: one real control plane (etcd + kube-apiserver) per test binary, started on first
//! use and killed when the binary exits; each test gets its own namespace and its own client
//! (a `kube::Client` belongs to the tokio runtime that made it, and every test has a runtime).
//! Nothing here mocks the apiserver: if it cannot start, the test fails and says why.
#![allow(dead_code)]

pub mod boot;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::config::Kubeconfig;
use metalboot::controlplane::{self, ControlPlane, Lifetime};

pub struct SharedControlPlane {
    pub kubeconfig: Kubeconfig,
    pub kubeconfig_path: PathBuf,
    pub server: String,
    pub ca_pem: String,
    /// Holds the apiserver's audit log (`controlplane::AUDIT_LOG`).
    pub data_dir: PathBuf,
    pub join_ready: bool,
}

/// Whether this binary's control plane is join-ready (`controlplane::Options::join_ready`).
static JOIN_READY: AtomicBool = AtomicBool::new(false);

/// The binary's control plane, join-ready for kubeadm join (kube-controller-manager, bootstrap
/// tokens, the Node authorizer). Only a test binary whose every test calls this first gets one.
pub fn join_ready_control_plane() -> &'static SharedControlPlane {
    JOIN_READY.store(true, Ordering::SeqCst);
    let plane = control_plane();
    assert!(
        plane.join_ready,
        "this binary's control plane was started before a test asked for a join-ready one"
    );
    plane
}

/// The binary's control plane, started on first call.
pub fn control_plane() -> &'static SharedControlPlane {
    static PLANE: OnceLock<Result<SharedControlPlane, String>> = OnceLock::new();
    let plane = PLANE.get_or_init(|| {
        let exe = std::env::current_exe().ok();
        let name = exe
            .as_ref()
            .and_then(|e| e.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "test".into());
        // Ports are picked free and then handed to etcd and kube-apiserver, so another test
        // binary running beside this one (make test runs two lanes) can take one first: a bind
        // failure starts again on fresh ports, in a fresh directory.
        let mut attempt = 1;
        let (data_dir, join_ready, started) = loop {
            let data_dir = controlplane::project_dir()
                .join("target/test-control-plane")
                .join(format!("{name}-{}-{attempt}", std::process::id()));
            let opts = controlplane::Options {
                bin_dir: controlplane::default_bin_dir(),
                data_dir: data_dir.clone(),
                lifetime: Lifetime::TiedToThisProcess,
                join_ready: JOIN_READY.load(Ordering::SeqCst),
            };
            let join_ready = opts.join_ready;
            // Started on its own runtime: the caller may be inside another test's runtime.
            let started = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                rt.map_err(|e| e.to_string()).and_then(|rt| {
                    rt.block_on(ControlPlane::start(&opts))
                        .map_err(|e| e.to_string())
                })
            })
            .join()
            .map_err(|_| "control-plane start panicked".to_string())
            .and_then(|r| r);
            match started {
                Err(e) if e.contains("address already in use") && attempt < 3 => attempt += 1,
                started => break (data_dir, join_ready, started),
            }
        };
        started.map(|cp| {
            controlplane::remove_at_exit(&data_dir);
            let shared = SharedControlPlane {
                kubeconfig: cp.kubeconfig.clone(),
                kubeconfig_path: cp.kubeconfig_path.clone(),
                server: cp.server.clone(),
                ca_pem: cp.ca_pem.clone(),
                data_dir: cp.data_dir.clone(),
                join_ready,
            };
            // Processes die with this test binary (PDEATHSIG + atexit), not when a test ends.
            std::mem::forget(cp);
            shared
        })
    });
    match plane {
        Ok(p) => p,
        Err(e) => {
            panic!("the test control plane could not start (run `make test`, which builds it): {e}")
        }
    }
}

/// A client for the shared control plane, bound to the calling test's runtime.
pub async fn client() -> kube::Client {
    let plane = control_plane();
    match controlplane::client_from_kubeconfig(plane.kubeconfig.clone()).await {
        Ok(c) => c,
        Err(e) => panic!("client for the test control plane: {e}"),
    }
}

/// A client for the shared control plane that counts the GETs it sends whose path contains
/// `path_part`: how a test sees how many reads the code under test made, on the real apiserver.
pub async fn client_counting_gets(
    path_part: &str,
) -> (kube::Client, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let plane = control_plane();
    let config = kube::Config::from_custom_kubeconfig(
        plane.kubeconfig.clone(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .expect("kubeconfig of the test control plane");
    let gets = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = gets.clone();
    let path_part = path_part.to_string();
    let count =
        tower::util::MapRequestLayer::new(move |request: http::Request<kube::client::Body>| {
            if request.method() == http::Method::GET && request.uri().path().contains(&path_part) {
                counted.fetch_add(1, Ordering::SeqCst);
            }
            request
        });
    let client = kube::client::ClientBuilder::try_from(config)
        .expect("client of the test control plane")
        .with_layer(&count)
        .build();
    (client, gets)
}

/// A client from [`client_losing_one_answer`], and what became of the requests it picked.
pub struct LosingClient {
    pub client: kube::Client,
    /// The apiserver's HTTP status for the request held back, once it was sent, late.
    pub late_answer: tokio::sync::watch::Receiver<Option<u16>>,
    /// Requests picked so far, the held-back one included.
    pub picked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl LosingClient {
    /// The apiserver's HTTP status for the request held back, once it reached it (`what` says
    /// which request, if it never does within two minutes).
    pub async fn late_status(&mut self, what: &str) -> Option<u16> {
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(120),
            self.late_answer.wait_for(Option::is_some),
        )
        .await
        .unwrap_or_else(|_| panic!("{what} reached the apiserver"));
        answer
            .expect("the losing client's sender lives as long as its client")
            .to_owned()
    }
}

/// A client of the shared control plane whose first request `matches` picks is answered at once
/// with a lost connection, and reaches the apiserver only `late` after: a write applied after its
/// writer gave up on it, seen as a watch that lags behind a starved apiserver sees it.
pub async fn client_losing_one_answer(
    matches: impl Fn(&http::Method, &str) -> bool + Send + Sync + 'static,
    late: std::time::Duration,
) -> LosingClient {
    client_picking_one(matches, Fate::AnswerLost { late }).await
}

/// A client of the shared control plane whose first request `matches` picks never reaches the
/// apiserver: it is answered 429 Too Many Requests, as API Priority and Fairness answers a
/// request it sheds once the client's own retries (kube's default policy, inside the wrapped
/// client) are spent. `picked` counts the requests picked, the throttled one included.
pub async fn client_throttling_one_request(
    matches: impl Fn(&http::Method, &str) -> bool + Send + Sync + 'static,
) -> LosingClient {
    client_picking_one(matches, Fate::Throttled).await
}

/// A client of the shared control plane whose first request `matches` picks meets `fate`.
async fn client_picking_one(
    matches: impl Fn(&http::Method, &str) -> bool + Send + Sync + 'static,
    fate: Fate,
) -> LosingClient {
    let inner = client().await;
    let namespace = inner.default_namespace().to_string();
    let (answered, late_answer) = tokio::sync::watch::channel(None);
    let picked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let service = LosesOneAnswer {
        inner,
        matches: std::sync::Arc::new(matches),
        picked: picked.clone(),
        fate,
        answered: std::sync::Arc::new(answered),
    };
    LosingClient {
        client: kube::Client::new(service, namespace),
        late_answer,
        picked,
    }
}

/// Which requests a [`LosesOneAnswer`] picks, by method and path.
type Picks = dyn Fn(&http::Method, &str) -> bool + Send + Sync;

/// What becomes of the request a [`LosesOneAnswer`] picks.
#[derive(Clone, Copy)]
enum Fate {
    /// Applied `late` after its writer was told the connection was lost.
    AnswerLost { late: std::time::Duration },
    /// Never applied: answered 429.
    Throttled,
}

#[derive(Clone)]
struct LosesOneAnswer {
    inner: kube::Client,
    matches: std::sync::Arc<Picks>,
    picked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    fate: Fate,
    answered: std::sync::Arc<tokio::sync::watch::Sender<Option<u16>>>,
}

impl tower::Service<http::Request<kube::client::Body>> for LosesOneAnswer {
    type Response = http::Response<kube::client::Body>;
    type Error = tower::BoxError;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let inner = self.inner.clone();
        let lose = (self.matches)(request.method(), request.uri().path())
            && self.picked.fetch_add(1, Ordering::SeqCst) == 0;
        if !lose {
            return Box::pin(async move { inner.send(request).await.map_err(Into::into) });
        }
        let late = match self.fate {
            Fate::AnswerLost { late } => late,
            Fate::Throttled => {
                let status = serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": "too many requests (injected by the test)",
                    "reason": "TooManyRequests", "code": 429,
                });
                let response = http::Response::builder()
                    .status(429)
                    .header("content-type", "application/json")
                    .body(kube::client::Body::from(status.to_string().into_bytes()))
                    .map_err(Into::into);
                return Box::pin(async move { response });
            }
        };
        let answered = self.answered.clone();
        tokio::spawn(async move {
            tokio::time::sleep(late).await;
            let status = match inner.send(request).await {
                Ok(response) => response.status().as_u16(),
                Err(kube::Error::Api(status)) => status.code,
                Err(_) => 0,
            };
            answered.send_replace(Some(status));
        });
        Box::pin(async { Err("connection lost before the answer (injected by the test)".into()) })
    }
}

/// A fresh namespace for one test.
pub struct TestNamespace {
    pub client: kube::Client,
    pub name: String,
}

pub async fn namespace(prefix: &str) -> TestNamespace {
    let client = client().await;
    let name = format!("{prefix}-{:08x}", rand::random::<u32>());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .unwrap_or_else(|e| panic!("creating test namespace {name}: {e}"));
    TestNamespace { client, name }
}

/// A namespace with metalboot's CRDs, a Cluster `c1`, and a manager (standalone controllers
/// included) watching only that namespace. Dropping the manager stops it.
pub async fn standalone_env(prefix: &str) -> (TestNamespace, metalboot::manager::RunningManager) {
    metalboot::telemetry::init(
        metalboot::telemetry::LogFormat::Text,
        Some("info,metalboot=debug,kube_runtime=warn"),
    );
    let ns = namespace(prefix).await;
    boot::install_crds(&ns.client).await;
    Api::<metalboot::api::Cluster>::namespaced(ns.client.clone(), &ns.name)
        .create(
            &PostParams::default(),
            &metalboot::api::Cluster::new("c1", Default::default()),
        )
        .await
        .expect("Cluster");
    let manager = metalboot::manager::start(
        ns.client.clone(),
        metalboot::manager::ManagerOptions {
            namespace: Some(ns.name.clone()),
            boot_http: "127.0.0.1:0".parse().expect("addr"),
            ..Default::default()
        },
    )
    .await
    .expect("manager starts");
    (ns, manager)
}

/// Polls `check` until it returns Some or `secs` pass; None on timeout (the caller explains).
pub async fn eventually_or<T, F, Fut>(what: &str, secs: u64, mut check: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if std::time::Instant::now() > deadline {
            eprintln!("timed out after {secs}s waiting for {what}");
            return None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Polls `check` until it returns Some or `secs` pass; panics with `what` on timeout.
pub async fn eventually<T, F, Fut>(what: &str, secs: u64, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    match eventually_or(what, secs, check).await {
        Some(v) => v,
        None => panic!("timed out after {secs}s waiting for {what}"),
    }
}

/// Resident memory of this test process (servers and attackers both live here), in KiB.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// File descriptors this test process holds.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One write as the shared control plane's audit log recorded it (`resource` is
/// `resource/subresource`).
#[derive(Debug)]
pub struct Write {
    pub agent: String,
    pub verb: String,
    pub resource: String,
    pub name: String,
    pub at: jiff::Timestamp,
}

/// Every write in `ns`, oldest first.
pub fn writes_in(ns: &str) -> Vec<Write> {
    let path = control_plane()
        .data_dir
        .join(metalboot::controlplane::AUDIT_LOG);
    let text = std::fs::read_to_string(&path).expect("audit log");
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|e| e["objectRef"]["namespace"] == ns)
        .filter_map(|e| {
            Some(Write {
                agent: e["userAgent"].as_str().unwrap_or("").to_string(),
                verb: e["verb"].as_str()?.to_string(),
                resource: format!(
                    "{}/{}",
                    e["objectRef"]["resource"].as_str().unwrap_or(""),
                    e["objectRef"]["subresource"].as_str().unwrap_or("")
                ),
                name: e["objectRef"]["name"].as_str().unwrap_or("").to_string(),
                at: e["requestReceivedTimestamp"].as_str()?.parse().ok()?,
            })
        })
        .collect()
}

/// `<cluster>-kubeconfig` holding the kubeconfig at `file` under `value`, labelled with the cluster
/// name as upstream core's cache requires: the workload cluster is an apiserver of the test's own.
pub async fn create_workload_kubeconfig(
    client: &kube::Client,
    ns: &str,
    cluster: &str,
    file: &std::path::Path,
) {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    let kubeconfig = std::fs::read(file).expect("kubeconfig file");
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(format!("{cluster}-kubeconfig")),
            labels: Some(
                [(
                    "cluster.x-k8s.io/cluster-name".to_string(),
                    cluster.to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("cluster.x-k8s.io/secret".into()),
        data: Some([("value".to_string(), ByteString(kubeconfig))].into()),
        ..Default::default()
    };
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("kubeconfig Secret");
}

/// The boot service's DHCP packet counter (`metalboot_boot_dhcp_packets_total`) for one outcome,
/// or all of them summed for "": how a test sees what the DHCP service decided.
pub fn dhcp_packets(outcome: &str) -> u64 {
    let prefix = "metalboot_boot_dhcp_packets_total{outcome=\"";
    metalboot::metrics::render()
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter(|l| outcome.is_empty() || l.starts_with(&format!("{outcome}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<u64>().ok())
        .sum()
}

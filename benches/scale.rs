//! `make bench-scale` (not a test): N simulated hosts and N Machines against a fresh local
//! apiserver, with `metalboot manager` (release build, standalone controllers) as its own
//! process so its memory and CPU are its own. The simulated fleet (`lab::fleet`) and the lab's
//! virtual BMC run in this process. Per N it reports:
//!
//! - register: creating N MetalHosts until all are Available;
//! - provision: creating N Machines until all are Running (fleet boot delay included);
//! - steady: BMC requests per host per minute once everything is Running;
//! - release: deleting all Machines until every host is Available again;
//! - manager peak RSS and CPU seconds, apiserver CPU seconds, apiserver requests by verb per phase;
//! - the manager's memory at the end of each phase: RSS, and what jemalloc holds for live objects
//!   (allocated) against what it keeps in RAM (resident) and unmapped (retained);
//! - callback → MetalMachine ready and → Machine Provisioned, p50/p99, seen through watches;
//! - the same, one at a time with the fleet at rest: a tenth of the Machines (at most 20) are
//!   deleted, then replaced one by one;
//! - power actions at hosts after their accepted callback (must be 0), the most BMC requests
//!   in flight at one host, and warnings/errors in the manager's log.
//!
//! `SCALE_N=100,1000` picks the sizes (default 100,1000,10000); `SCALE_STEADY_SECONDS` the
//! steady-state window (default 60); `SCALE_HEAPTRACK=<file>` records the manager's heap with
//! heaptrack (attached once the manager starts; heaptrack sees only glibc's malloc, so point
//! `METALBOOT_BIN` at a `cargo build --release --no-default-features` binary, without jemalloc).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use metalboot::api::capi::Machine;
use metalboot::api::metalhost::HostState;
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::controlplane::{self, ControlPlane, Lifetime};
use metalboot::lab::fleet::{FaultShares, Fleet, FleetOptions};
use metalboot::lab::objects::LabObjects;
use metalboot::lab::vbmc::{VirtualBmc, serve_on_loopback};

const NAMESPACE: &str = "bench";

type Verbs = BTreeMap<String, f64>;

/// Per Machine: when its MetalMachine was first seen ready, and the Machine Provisioned/Running.
type Seen = BTreeMap<String, (Option<Instant>, Option<Instant>)>;

/// The manager's own histogram of seconds from a callback to one of its stages
/// (`metalboot_callback_latency_seconds{stage=…}`; `ready` is taken when the ready status write
/// returns): cumulative counts per upper bound in seconds. It holds no watch delay, unlike the
/// benchmark's own view, which lags by seconds under a burst.
async fn callback_stage_buckets(boot_url: &str, stage: &str) -> Vec<(f64, f64)> {
    let text = manager_metrics(boot_url).await;
    let stage = format!("stage=\"{stage}\"");
    histogram_buckets(&text, "metalboot_callback_latency_seconds", &[&stage])
}

/// A Prometheus histogram's cumulative counts per upper bound in seconds, summed over the series
/// of `metric` whose labels contain every one of `labels` (each written `name="value"`).
fn histogram_buckets(text: &str, metric: &str, labels: &[&str]) -> Vec<(f64, f64)> {
    let prefix = format!("{metric}_bucket{{");
    let mut sums: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
    for rest in text.lines().filter_map(|line| line.strip_prefix(&prefix)) {
        let Some((series, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        // Whole labels only: `subresource=""` must not match inside another label.
        let parts: Vec<&str> = series.split(',').collect();
        if !labels.iter().all(|l| parts.contains(l)) {
            continue;
        }
        let Some(le) = parts
            .iter()
            .find_map(|kv| kv.strip_prefix("le=\""))
            .map(|le| le.trim_end_matches('"'))
        else {
            continue;
        };
        let le = match le {
            "+Inf" => f64::INFINITY,
            le => match le.parse::<f64>() {
                Ok(le) => le,
                Err(_) => continue,
            },
        };
        let Ok(count) = value.trim().parse::<f64>() else {
            continue;
        };
        sums.entry(le.to_bits()).or_insert((le, 0.0)).1 += count;
    }
    let mut buckets: Vec<(f64, f64)> = sums.into_values().collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    buckets
}

/// Apiserver request latencies: the manager's per lane, and the apiserver's own for the three
/// kinds of write a callback waits on (every such write, from both lanes):
/// (label for the output, histogram source, labels).
const REQUEST_LATENCIES: [(&str, Source, &[&str]); 6] = [
    (
        "manager urgent, answer",
        Source::Manager,
        &["lane=\"urgent\"", "stage=\"answered\""],
    ),
    (
        "manager ordinary, wait",
        Source::Manager,
        &["lane=\"ordinary\"", "stage=\"queued\""],
    ),
    (
        "manager ordinary, answer",
        Source::Manager,
        &["lane=\"ordinary\"", "stage=\"answered\""],
    ),
    (
        "apiserver PATCH secrets",
        Source::Apiserver,
        &["verb=\"PATCH\"", "resource=\"secrets\"", "subresource=\"\""],
    ),
    (
        "apiserver PATCH metalmachines",
        Source::Apiserver,
        &[
            "verb=\"PATCH\"",
            "resource=\"metalmachines\"",
            "subresource=\"\"",
        ],
    ),
    (
        "apiserver APPLY metalmachines/status",
        Source::Apiserver,
        &[
            "verb=\"APPLY\"",
            "resource=\"metalmachines\"",
            "subresource=\"status\"",
        ],
    ),
];

#[derive(Clone, Copy)]
enum Source {
    Manager,
    Apiserver,
}

/// The histograms of [`REQUEST_LATENCIES`], in its order.
async fn request_latency_buckets(boot_url: &str, client: &kube::Client) -> Vec<Vec<(f64, f64)>> {
    let manager = manager_metrics(boot_url).await;
    let apiserver = apiserver_metrics(client).await;
    REQUEST_LATENCIES
        .iter()
        .map(|(_, source, labels)| match source {
            Source::Manager => {
                histogram_buckets(&manager, "metalboot_apiserver_request_seconds", labels)
            }
            Source::Apiserver => {
                histogram_buckets(&apiserver, "apiserver_request_duration_seconds", labels)
            }
        })
        .collect()
}

/// The manager's metrics page (empty when it cannot be read).
async fn manager_metrics(boot_url: &str) -> String {
    match reqwest::get(format!("{boot_url}/metrics")).await {
        Ok(response) => response.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// A counter of the manager's with one label, per value of that label: `prefix` is the
/// counter's name, `{` and the label's name up to the opening quote of its value.
async fn labelled_counter(boot_url: &str, prefix: &str) -> Vec<(String, f64)> {
    let text = manager_metrics(boot_url).await;
    text.lines()
        .filter_map(|line| line.strip_prefix(prefix))
        .filter_map(|rest| {
            let (label, value) = rest.split_once("\"} ")?;
            Some((label.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The manager's memory at one moment, in MiB (2^20 bytes; the tables before 2026-12-07 printed
/// these as "MB"): RSS now and its peak (from /proc), and what jemalloc says it holds (from
/// /metrics), so live objects can be told from pages the allocator keeps.
async fn memory(boot_url: &str, pid: u32) -> Memory {
    let heap = labelled_counter(boot_url, "metalboot_allocator_bytes{kind=\"").await;
    let mb = |kind: &str| {
        heap.iter()
            .find(|(k, _)| k == kind)
            .map_or(f64::NAN, |(_, bytes)| bytes / 1048576.0)
    };
    Memory {
        rss: status_kib(pid, "VmRSS:") as f64 / 1024.0,
        peak: status_kib(pid, "VmHWM:") as f64 / 1024.0,
        allocated: mb("allocated"),
        resident: mb("resident"),
        retained: mb("retained"),
    }
}

#[derive(Default, Clone, Copy)]
struct Memory {
    rss: f64,
    peak: f64,
    allocated: f64,
    resident: f64,
    retained: f64,
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RSS {:.0} MiB (peak {:.0}), jemalloc allocated {:.0} MiB, resident {:.0} MiB, retained {:.0} MiB",
            self.rss, self.peak, self.allocated, self.resident, self.retained
        )
    }
}

/// Reconcile passes per controller between two scrapes of `metalboot_reconciles_total`.
fn passes_between(after: &[(String, f64)], before: &[(String, f64)]) -> Vec<(String, f64)> {
    after
        .iter()
        .map(|(controller, n)| {
            let earlier = before
                .iter()
                .find(|(c, _)| c == controller)
                .map_or(0.0, |(_, n)| *n);
            (controller.clone(), n - earlier)
        })
        .collect()
}

const PASSES: &str = "metalboot_reconciles_total{controller=\"";
/// Which store a callback-lane pass found behind this manager's own last write, by kind (the
/// "stale" stage says how long that cost).
const LANE_STALE: &str = "metalboot_callback_lane_stale_total{kind=\"";

/// The callback's stages in the manager, in order: the boot Secret records it (the callback
/// answered), its lane pass starts, that pass has the machine's turn, (each time a lane pass
/// found a store behind and looks again), the pass that records it has decided, its ready
/// status is written.
const CALLBACK_STAGES: [&str; 6] = ["recorded", "lane", "turn", "stale", "decided", "ready"];

/// The `q` quantile in ms of what was observed between two scrapes, interpolated within its
/// bucket as Prometheus's `histogram_quantile` does.
fn bucket_quantile(after: &[(f64, f64)], before: &[(f64, f64)], q: f64) -> f64 {
    let earlier = |le: f64| {
        before
            .iter()
            .find(|(l, _)| *l == le)
            .map_or(0.0, |(_, c)| *c)
    };
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| (*le, c - earlier(*le)))
        .collect();
    let total = delta.last().map_or(0.0, |(_, c)| *c);
    if total <= 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in &delta {
        if count >= rank {
            if le.is_infinite() {
                return lower.0 * 1000.0;
            }
            let share = if count > lower.1 {
                (rank - lower.1) / (count - lower.1)
            } else {
                1.0
            };
            return (lower.0 + (le - lower.0) * share) * 1000.0;
        }
        lower = (le, count);
    }
    f64::NAN
}

/// The apiserver's metrics page (empty when it cannot be read).
async fn apiserver_metrics(client: &kube::Client) -> String {
    match http::Request::get("/metrics").body(Vec::new()) {
        Ok(req) => client.request_text(req).await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// `apiserver_request_total` summed by verb and resource (a GET's resource tells which store a
/// controller should read instead; a write's tells which controller to make write less).
async fn apiserver_requests(client: &kube::Client) -> Verbs {
    let text = apiserver_metrics(client).await;
    let mut verbs = Verbs::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\""))
                .map(|v| v.trim_end_matches('"'))
                .unwrap_or_default()
        };
        let (verb, resource, subresource) =
            (label("verb"), label("resource"), label("subresource"));
        let verb = match subresource {
            "" => format!("{verb} {resource}"),
            sub => format!("{verb} {resource}/{sub}"),
        };
        *verbs.entry(verb).or_default() += value.trim().parse::<f64>().unwrap_or(0.0);
    }
    verbs
}

/// The apiserver's own CPU profile over `seconds` (its profiling endpoint, on by default).
async fn apiserver_profile(client: &kube::Client, seconds: u32) -> Result<Vec<u8>, String> {
    use http_body_util::BodyExt;
    let req = http::Request::get(format!("/debug/pprof/profile?seconds={seconds}"))
        .body(kube::client::Body::empty())
        .map_err(|e| e.to_string())?;
    let response = client.send(req).await.map_err(|e| e.to_string())?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(body.to_bytes().to_vec())
}

/// Each verb's count between two counts.
fn deltas<'a>(after: &'a Verbs, before: &'a Verbs) -> impl Iterator<Item = (&'a String, f64)> {
    after
        .iter()
        .map(|(verb, v)| (verb, v - before.get(verb).copied().unwrap_or(0.0)))
}

fn delta(after: &Verbs, before: &Verbs) -> String {
    deltas(after, before)
        .filter(|(_, d)| *d >= 1.0)
        .map(|(verb, d)| format!("{verb} {d:.0}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Requests the apiserver answered between two counts, watches aside (a watch is one request
/// however long it streams).
fn requests_in(after: &Verbs, before: &Verbs) -> f64 {
    deltas(after, before)
        .filter(|(verb, _)| !verb.starts_with("WATCH "))
        .map(|(_, d)| d)
        .sum()
}

/// What a phase cost per host and per apiserver request, and the rate of hosts the
/// apiserver's CPU alone would allow if it had every core of the machine: the bound that
/// phase ran against when the apiserver is the busiest process.
fn cpu_per_request(
    requests: f64,
    apiserver_cpu: f64,
    manager_cpu: f64,
    n: u32,
    seconds: f64,
) -> String {
    let hosts = f64::from(n.max(1));
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get()) as f64;
    let apiserver_per_host = apiserver_cpu / hosts;
    format!(
        "{requests:.0} apiserver requests, watches aside ({:.1} per host); apiserver CPU {apiserver_cpu:.1} s \
         ({:.2} ms per request, {:.0} ms per host, {:.0}% of {cores:.0} cores), manager CPU \
         {manager_cpu:.1} s ({:.0} ms per host); the apiserver's CPU alone allows at most {:.1} \
         hosts/s on {cores:.0} cores, {:.1} hosts/s were provisioned",
        requests / hosts,
        1000.0 * apiserver_cpu / requests.max(1.0),
        1000.0 * apiserver_per_host,
        100.0 * apiserver_cpu / (seconds.max(f64::EPSILON) * cores),
        1000.0 * manager_cpu / hosts,
        cores / apiserver_per_host.max(f64::EPSILON),
        hosts / seconds.max(f64::EPSILON),
    )
}

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces): utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (ticks(11) + ticks(12)) / hz
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(18080)
}

fn manager_binary() -> PathBuf {
    let root = controlplane::project_dir();
    std::env::var_os("METALBOOT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/release/metalboot"))
}

struct Manager(Child);

impl Drop for Manager {
    /// SIGTERM first, as the kubelet stops a pod, so the manager leaves through `main`: a
    /// `-Cprofile-generate` build writes its profile only then (`hack/pgo-build.sh` trains on
    /// this benchmark). SIGKILL if it has not exited within 30 s.
    fn drop(&mut self) {
        let pid = self.0.id().to_string();
        let asked = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .is_ok_and(|s| s.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        while asked && Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn percentile(mut v: Vec<f64>, p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// How long provisioning or release may take before the run gives up: 30 min, or 0.27 s per host
/// past that (45 min at N=10,000), so a slow but moving large run still completes its row.
fn phase_limit(n: u32) -> Duration {
    Duration::from_secs(1800.max(u64::from(n) * 27 / 100))
}

async fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> Option<String>) -> f64 {
    let started = Instant::now();
    let mut last_note = Instant::now();
    loop {
        match done() {
            None => return started.elapsed().as_secs_f64(),
            Some(progress) => {
                if started.elapsed() > limit {
                    eprintln!("  {what}: gave up after {limit:?} ({progress})");
                    return f64::NAN;
                }
                if last_note.elapsed() > Duration::from_secs(15) {
                    eprintln!(
                        "  {what}: {progress} after {:.0}s",
                        started.elapsed().as_secs_f64()
                    );
                    last_note = Instant::now();
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[derive(Default)]
struct Row {
    n: u32,
    register: f64,
    provision: f64,
    release: f64,
    rss_mb: f64,
    manager_cpu: f64,
    apiserver_cpu: f64,
    bmc_per_host_minute: f64,
    ready_p50_ms: f64,
    ready_p99_ms: f64,
    manager_ready_p50_ms: f64,
    manager_ready_p99_ms: f64,
    provisioned_p50_ms: f64,
    provisioned_p99_ms: f64,
    quiet_ready_p50_ms: f64,
    quiet_ready_max_ms: f64,
    quiet_provisioned_p50_ms: f64,
    quiet_provisioned_max_ms: f64,
    resets_after_callback: u64,
    max_in_flight: u32,
    log_problems: usize,
    /// The manager's memory when every Machine is Running (all stores full).
    running_memory: Memory,
}

async fn run(n: u32, steady: Duration) -> Result<Row, String> {
    let dir = controlplane::project_dir()
        .join("target/bench-scale")
        .join(format!("n{n}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let cp = ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir: dir.join("control-plane"),
        lifetime: Lifetime::TiedToThisProcess,
        join_ready: false,
    })
    .await
    .map_err(|e| e.to_string())?;
    let apiserver_pid = cp.pids().last().copied().unwrap_or(0);
    let client = cp.client().await.map_err(|e| e.to_string())?;
    metalboot::api::crdgen::install(&client)
        .await
        .map_err(|e| e.to_string())?;

    let relay_url = metalboot::lab::relay::serve_on_loopback(cp.server.clone(), cp.ca_pem.clone())
        .await
        .map_err(|e| e.to_string())?;

    let boot_port = free_port();
    let boot_url = format!("http://127.0.0.1:{boot_port}");
    let fleet = Arc::new(
        Fleet::new(FleetOptions {
            hosts: n,
            boot_url: boot_url.clone(),
            boot_delay: Duration::from_secs(5),
            os_delay: Duration::from_secs(2),
            faults: FaultShares::default(),
            concurrent_boots: 256,
        })
        .map_err(|e| e.to_string())?,
    );
    let password = "bench-bmc-password";
    let bmc = Arc::new(VirtualBmc::with_systems(
        fleet.systems(),
        "admin".into(),
        password.into(),
    ));
    let bmc_port = serve_on_loopback(bmc).await.map_err(|e| e.to_string())?;
    let bmc_url = format!("redfish+http://127.0.0.1:{bmc_port}");

    let objects = Arc::new(LabObjects {
        client: client.clone(),
        namespace: NAMESPACE.into(),
        endpoint: ("127.0.0.1".into(), 6443),
        kubeconfig: serde_yaml::to_string(&cp.kubeconfig).map_err(|e| e.to_string())?,
        kubelet_apiserver: relay_url,
        boot_timeout_seconds: 600,
        boot_url: boot_url.clone(),
        image: None,
        kubeadm: false,
    });
    objects
        .base(&[("lab-bmc", password)])
        .await
        .map_err(|e| e.to_string())?;

    let log_path = dir.join("manager.log");
    let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
    let manager = Manager(
        Command::new(manager_binary())
            .args(["manager", "--kubeconfig"])
            .arg(&cp.kubeconfig_path)
            .args(["--namespace", NAMESPACE, "--standalone", "true"])
            .args(["--boot-http-bind", &format!("127.0.0.1:{boot_port}")])
            .args(["--advertise-url", &boot_url, "--no-tftp", "--dhcp", "off"])
            // SCALE_MANAGER_LOG=<filter>: e.g. `warn,kube_client::client::builder=debug` logs
            // every apiserver request with its URL (who reads what).
            .args([
                "--log-level",
                &std::env::var("SCALE_MANAGER_LOG").unwrap_or_else(|_| "warn".into()),
            ])
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("starting {}: {e}", manager_binary().display()))?,
    );
    let manager_pid = manager.0.id();
    // SCALE_HEAPTRACK=<file>: record the manager's heap from here on (where its memory goes).
    let _heaptrack = std::env::var_os("SCALE_HEAPTRACK").and_then(|out| {
        Command::new("heaptrack")
            .arg("--pid")
            .arg(manager_pid.to_string())
            .arg("--output")
            .arg(out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()
    });

    // Watches, as the manager has them: what the benchmark sees costs one watch per kind.
    let (hosts, hosts_writer) = reflector::store::<MetalHost>();
    let (machines, machines_writer) = reflector::store::<Machine>();
    let (mms, mms_writer) = reflector::store::<MetalMachine>();
    let seen: Arc<Mutex<Seen>> = Arc::default();
    tokio::spawn(
        watcher(
            Api::<MetalHost>::namespaced(client.clone(), NAMESPACE),
            Default::default(),
        )
        .default_backoff()
        .reflect(hosts_writer)
        .for_each(|_| async {}),
    );
    {
        let seen = seen.clone();
        tokio::spawn(
            watcher(
                Api::<Machine>::namespaced(client.clone(), NAMESPACE),
                Default::default(),
            )
            .default_backoff()
            .reflect(machines_writer)
            .applied_objects()
            .for_each(move |m| {
                if let Ok(m) = m {
                    let phase = m.status.as_ref().and_then(|s| s.phase.as_deref());
                    if matches!(phase, Some("Provisioned" | "Running"))
                        && let Ok(mut seen) = seen.lock()
                    {
                        seen.entry(m.name_any())
                            .or_default()
                            .1
                            .get_or_insert(Instant::now());
                    }
                }
                async {}
            }),
        );
    }
    {
        let seen = seen.clone();
        tokio::spawn(
            watcher(
                Api::<MetalMachine>::namespaced(client.clone(), NAMESPACE),
                Default::default(),
            )
            .default_backoff()
            .reflect(mms_writer)
            .applied_objects()
            .for_each(move |mm| {
                if let Ok(mm) = mm {
                    let ready = mm.status.as_ref().is_some_and(|s| s.ready);
                    if ready && let Ok(mut seen) = seen.lock() {
                        seen.entry(mm.name_any())
                            .or_default()
                            .0
                            .get_or_insert(Instant::now());
                    }
                }
                async {}
            }),
        );
    }

    let mut row = Row {
        n,
        ..Default::default()
    };
    let cpu = || (cpu_seconds(manager_pid), cpu_seconds(apiserver_pid));
    let cpu0 = cpu();

    // Register.
    let before = apiserver_requests(&client).await;
    let started = Instant::now();
    futures::stream::iter(fleet.hosts.clone())
        .map(|h| {
            let objects = objects.clone();
            let address = format!("{bmc_url}/redfish/v1/Systems/{}", h.name);
            async move {
                objects
                    .host(h.index, (&address, "lab-bmc"), false, "simulated host")
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .map_err(|e| e.to_string())?;
    let created = started.elapsed().as_secs_f64();
    let available = |hosts: &reflector::Store<MetalHost>| {
        hosts
            .state()
            .iter()
            .filter(|h| h.status.as_ref().and_then(|s| s.state) == Some(HostState::Available))
            .count()
    };
    let rest = wait_until("register", Duration::from_secs(900), || {
        let a = available(&hosts);
        (a < n as usize).then(|| format!("{a}/{n} Available"))
    })
    .await;
    row.register = created + rest;
    let after = apiserver_requests(&client).await;
    println!(
        "N={n} register: {:.1}s (objects created in {created:.1}s); apiserver: {}; {}",
        row.register,
        delta(&after, &before),
        memory(&boot_url, manager_pid).await
    );

    // Provision.
    let before = after;
    let requests_before = request_latency_buckets(&boot_url, &client).await;
    let mut stages_before = Vec::new();
    for stage in CALLBACK_STAGES {
        stages_before.push(callback_stage_buckets(&boot_url, stage).await);
    }
    let passes_before = labelled_counter(&boot_url, PASSES).await;
    let cpu_before = cpu();
    // SCALE_APISERVER_PROFILE=<file>: a CPU profile of the apiserver over the provisioning
    // burst (`go tool pprof -top <kube-apiserver> <file>` shows where its CPU goes).
    let profile = std::env::var_os("SCALE_APISERVER_PROFILE").map(|out| {
        let client = client.clone();
        tokio::spawn(async move {
            let seconds = std::env::var("SCALE_APISERVER_PROFILE_SECONDS")
                .ok()
                .and_then(|s| s.parse::<u32>().ok())
                .unwrap_or(60);
            match apiserver_profile(&client, seconds).await {
                Ok(bytes) => match std::fs::write(&out, &bytes) {
                    Ok(()) => println!(
                        "apiserver CPU profile ({seconds}s, {} bytes) in {}",
                        bytes.len(),
                        PathBuf::from(&out).display()
                    ),
                    Err(e) => println!("apiserver CPU profile not written: {e}"),
                },
                Err(e) => println!("apiserver CPU profile failed: {e}"),
            }
        })
    });
    let started = Instant::now();
    futures::stream::iter(0..n)
        .map(|i| {
            let objects = objects.clone();
            async move { objects.machine(i).await }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<()>>()
        .await
        .map_err(|e| e.to_string())?;
    let created = started.elapsed().as_secs_f64();
    let rest = wait_until("provision", phase_limit(n), || {
        let running = machines
            .state()
            .iter()
            .filter(|m| m.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            .count();
        (running < n as usize).then(|| {
            format!(
                "{running}/{n} Running, fleet callbacks/boots/errors {:?}",
                {
                    let s = fleet.stats();
                    (s.callbacks, s.network_boots, s.boot_errors)
                }
            )
        })
    })
    .await;
    row.provision = created + rest;
    if let Some(profile) = profile {
        let _ = profile.await;
    }
    let after = apiserver_requests(&client).await;
    let cpu_after = cpu();
    row.running_memory = memory(&boot_url, manager_pid).await;
    println!(
        "N={n} provision: {:.1}s (objects created in {created:.1}s); apiserver: {}; {}",
        row.provision,
        delta(&after, &before),
        row.running_memory
    );
    println!(
        "N={n} provision: {}",
        cpu_per_request(
            requests_in(&after, &before),
            cpu_after.1 - cpu_before.1,
            cpu_after.0 - cpu_before.0,
            n,
            row.provision,
        )
    );

    // Latencies: callback (fleet) → MetalMachine ready / Machine Provisioned (watches).
    let host_of: BTreeMap<String, String> = mms
        .state()
        .iter()
        .filter_map(|mm| {
            Some((
                mm.name_any(),
                mm.status.as_ref()?.host_ref.as_ref()?.name.clone(),
            ))
        })
        .collect();
    let by_name: BTreeMap<&str, _> = fleet.hosts.iter().map(|h| (h.name.as_str(), h)).collect();
    let (mut ready_ms, mut provisioned_ms) = (Vec::new(), Vec::new());
    if let Ok(seen) = seen.lock() {
        for (machine, (ready, provisioned)) in seen.iter() {
            let Some(called) = host_of
                .get(machine)
                .and_then(|h| by_name.get(h.as_str()))
                .and_then(|h| h.callback_at())
            else {
                continue;
            };
            let ms = |t: &Option<Instant>| {
                t.map(|t| t.saturating_duration_since(called).as_secs_f64() * 1000.0)
            };
            ready_ms.extend(ms(ready));
            provisioned_ms.extend(ms(provisioned));
        }
    }
    row.ready_p50_ms = percentile(ready_ms.clone(), 0.5);
    row.ready_p99_ms = percentile(ready_ms, 0.99);
    let mut split = Vec::new();
    for (stage, before) in CALLBACK_STAGES.iter().zip(&stages_before) {
        let after = callback_stage_buckets(&boot_url, stage).await;
        let (p50, p99) = (
            bucket_quantile(&after, before, 0.5),
            bucket_quantile(&after, before, 0.99),
        );
        let count = |b: &[(f64, f64)]| b.last().map_or(0.0, |(_, c)| *c);
        split.push(format!(
            "{stage} {p50:.0}/{p99:.0} ({:.0})",
            count(&after) - count(before)
        ));
        if *stage == "ready" {
            row.manager_ready_p50_ms = p50;
            row.manager_ready_p99_ms = p99;
        }
    }
    println!(
        "N={n} provision: callback→stage p50/p99 ms in the manager: {}; lane passes that found a store behind, by kind: {:?}; passes per controller: {:?}",
        split.join(", "),
        labelled_counter(&boot_url, LANE_STALE).await,
        passes_between(&labelled_counter(&boot_url, PASSES).await, &passes_before)
    );
    let requests_after = request_latency_buckets(&boot_url, &client).await;
    let requests: Vec<String> = REQUEST_LATENCIES
        .iter()
        .zip(requests_after.iter().zip(&requests_before))
        .map(|((label, _, _), (after, before))| {
            let count = |b: &[(f64, f64)]| b.last().map_or(0.0, |(_, c)| *c);
            format!(
                "{label} {:.0}/{:.0} ({:.0})",
                bucket_quantile(after, before, 0.5),
                bucket_quantile(after, before, 0.99),
                count(after) - count(before)
            )
        })
        .collect();
    println!(
        "N={n} provision: apiserver request p50/p99 ms: {}",
        requests.join(", ")
    );
    println!(
        "N={n} provision: callback→ready p50/p99 {:.0}/{:.0} ms as the benchmark's watch saw it, {:.0}/{:.0} ms in the manager's histogram",
        row.ready_p50_ms, row.ready_p99_ms, row.manager_ready_p50_ms, row.manager_ready_p99_ms
    );
    row.provisioned_p50_ms = percentile(provisioned_ms.clone(), 0.5);
    row.provisioned_p99_ms = percentile(provisioned_ms, 0.99);

    // Steady state.
    let before_bmc = fleet.stats().bmc_requests;
    let before = apiserver_requests(&client).await;
    tokio::time::sleep(steady).await;
    let after = apiserver_requests(&client).await;
    let bmc = fleet.stats().bmc_requests - before_bmc;
    row.bmc_per_host_minute = bmc as f64 / f64::from(n) / (steady.as_secs_f64() / 60.0);
    let stats = fleet.stats();
    row.resets_after_callback = stats.actions_after_callback;
    row.max_in_flight = stats.bmc_max_in_flight;
    println!(
        "N={n} steady ({}s): {bmc} BMC requests ({:.3}/host/min); apiserver: {}; fleet {stats:?}; manager fds {}",
        steady.as_secs(),
        row.bmc_per_host_minute,
        delta(&after, &before),
        open_fds(manager_pid)
    );

    // Quiet: with the fleet at rest, replace a few Machines one at a time and time each callback
    // alone (the provision phase's latencies include queueing behind the creation storm). None
    // below N=10: lab-0, the control-plane Machine, is never among them.
    let quiet = (n / 10).min(20);
    fleet.releasing(true);
    let api: Api<Machine> = Api::namespaced(client.clone(), NAMESPACE);
    for i in n - quiet..n {
        api.delete(&format!("lab-{i}"), &DeleteParams::default())
            .await
            .map_err(|e| format!("deleting lab-{i}: {e}"))?;
    }
    let freed = wait_until("quiet: free hosts", phase_limit(n), || {
        let left = machines.state().len();
        let a = available(&hosts);
        (left > (n - quiet) as usize || a < quiet as usize)
            .then(|| format!("{left} Machines left, {a}/{quiet} Available"))
    })
    .await;
    fleet.releasing(false);
    let (mut ready_ms, mut provisioned_ms) = (Vec::new(), Vec::new());
    for i in n..n + quiet {
        let name = format!("lab-{i}");
        objects.machine(i).await.map_err(|e| e.to_string())?;
        let both = |seen: &Seen| {
            seen.get(&name)
                .and_then(|(ready, provisioned)| Some((ready.as_ref()?, provisioned.as_ref()?)))
                .map(|(r, p)| (*r, *p))
        };
        wait_until("quiet: provision", Duration::from_secs(300), || {
            let done = seen.lock().ok().and_then(|s| both(&s));
            done.is_none()
                .then(|| format!("{name} not yet ready and Provisioned"))
        })
        .await;
        let called = mms
            .get(&reflector::ObjectRef::new(&name).within(NAMESPACE))
            .and_then(|mm| Some(mm.status.as_ref()?.host_ref.as_ref()?.name.clone()))
            .and_then(|h| fleet.hosts.iter().find(|x| x.name == h)?.callback_at());
        let done = seen.lock().ok().and_then(|s| both(&s));
        if let (Some(called), Some((ready, provisioned))) = (called, done) {
            let ms = |t: Instant| t.saturating_duration_since(called).as_secs_f64() * 1000.0;
            ready_ms.push(ms(ready));
            provisioned_ms.push(ms(provisioned));
        }
    }
    row.quiet_ready_p50_ms = percentile(ready_ms.clone(), 0.5);
    row.quiet_ready_max_ms = percentile(ready_ms.clone(), 1.0);
    row.quiet_provisioned_p50_ms = percentile(provisioned_ms.clone(), 0.5);
    row.quiet_provisioned_max_ms = percentile(provisioned_ms.clone(), 1.0);
    // The quiet phase's boots count too: no power action after a callback here either.
    let stats = fleet.stats();
    row.resets_after_callback = stats.actions_after_callback;
    row.max_in_flight = stats.bmc_max_in_flight;
    println!(
        "N={n} quiet: {quiet} Machines freed in {freed:.1}s, then provisioned one at a time: callback→ready {ready_ms:.0?} ms, callback→Provisioned {provisioned_ms:.0?} ms"
    );

    // Release.
    let before = apiserver_requests(&client).await;
    fleet.releasing(true);
    // One DELETE per Machine, as a MachineSet scaling down sends them.
    futures::stream::iter(machines.state())
        .map(|m| {
            let api = api.clone();
            async move { api.delete(&m.name_any(), &DeleteParams::default()).await }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await
        .map_err(|e| format!("deleting Machines: {e}"))?;
    row.release = wait_until("release", phase_limit(n), || {
        let left = machines.state().len();
        let a = available(&hosts);
        let off = fleet.stats().powered_on;
        (left > 0 || a < n as usize || off > 0)
            .then(|| format!("{left} Machines left, {a}/{n} Available, {off} on"))
    })
    .await;
    let after = apiserver_requests(&client).await;
    println!(
        "N={n} release: {:.1}s; apiserver: {}; {}",
        row.release,
        delta(&after, &before),
        memory(&boot_url, manager_pid).await
    );

    let cpu1 = cpu();
    row.manager_cpu = cpu1.0 - cpu0.0;
    row.apiserver_cpu = cpu1.1 - cpu0.1;
    row.rss_mb = status_kib(manager_pid, "VmHWM:") as f64 / 1024.0;
    drop(manager);
    row.log_problems = count_problems(&log_path);
    cp.stop();
    Ok(row)
}

/// Counts the manager's WARN and ERROR lines and prints the first few distinct ones (the log
/// lives in the run's temporary directory, gone once the run ends).
fn count_problems(log: &Path) -> usize {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let problems: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .collect();
    let mut shown = std::collections::BTreeSet::new();
    for line in &problems {
        // Without the timestamp, so repeats of one message count once.
        let message: String = line
            .split_once(" WARN ")
            .or_else(|| line.split_once(" ERROR "))
            .map_or(*line, |(_, rest)| rest)
            .chars()
            .take(300)
            .collect();
        if shown.len() < 5 && shown.insert(message.clone()) {
            println!("  manager log: {message}");
        }
    }
    problems.len()
}

fn main() {
    let sizes: Vec<u32> = std::env::var("SCALE_N")
        .unwrap_or_else(|_| "100,1000,10000".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let steady = Duration::from_secs(
        std::env::var("SCALE_STEADY_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60),
    );
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    let mut rows = Vec::new();
    for n in sizes {
        match rt.block_on(run(n, steady)) {
            Ok(row) => {
                println!("{}", markdown(&row));
                rows.push(row)
            }
            Err(e) => {
                eprintln!("N={n}: {e}");
                std::process::exit(1);
            }
        }
    }
    println!(
        "\n| N | register | all Running | delete → all Available | manager peak RSS | jemalloc allocated / resident at all Running | manager CPU | apiserver CPU | BMC req/host/min (steady) | callback→ready p50/p99 (watch) | callback→ready p50/p99 (manager) | callback→Provisioned p50/p99 | one at a time: callback→ready p50/max | one at a time: callback→Provisioned p50/max | resets after callback | max BMC requests in flight per host | WARN/ERROR lines |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!("{}", markdown(&r));
    }
}

fn markdown(r: &Row) -> String {
    {
        format!(
            "| {} | {:.1} s | {:.1} s | {:.1} s | {:.0} MiB | {:.0} / {:.0} MiB | {:.1} s | {:.1} s | {:.3} | {:.0}/{:.0} ms | {:.0}/{:.0} ms | {:.0}/{:.0} ms | {:.0}/{:.0} ms | {:.0}/{:.0} ms | {} | {} | {} |",
            r.n,
            r.register,
            r.provision,
            r.release,
            r.rss_mb,
            r.running_memory.allocated,
            r.running_memory.resident,
            r.manager_cpu,
            r.apiserver_cpu,
            r.bmc_per_host_minute,
            r.ready_p50_ms,
            r.ready_p99_ms,
            r.manager_ready_p50_ms,
            r.manager_ready_p99_ms,
            r.provisioned_p50_ms,
            r.provisioned_p99_ms,
            r.quiet_ready_p50_ms,
            r.quiet_ready_max_ms,
            r.quiet_provisioned_p50_ms,
            r.quiet_provisioned_max_ms,
            r.resets_after_callback,
            r.max_in_flight,
            r.log_problems
        )
    }
}

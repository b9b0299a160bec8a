//! Prometheus metrics, process-wide (one manager per process): boot service traffic, callbacks,
//! TFTP transfers, BMC errors by kind, hosts per state, and provisioning durations per phase.
//! Served as text at `/metrics` on the boot service's HTTP port.

use std::sync::OnceLock;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

pub struct Metrics {
    registry: Registry,
    pub http_requests: Family<Labels, Counter>,
    pub http_bytes: Family<Labels, Counter>,
    pub http_refused: Family<Labels, Counter>,
    pub http_sendfile_bytes: Counter,
    pub http_aborted: Family<Labels, Counter>,
    pub events_suppressed: Family<Labels, Counter>,
    pub callbacks: Family<Labels, Counter>,
    pub tftp_transfers: Family<Labels, Counter>,
    pub dhcp_packets: Family<Labels, Counter>,
    pub hop_seconds: Family<Labels, Histogram>,
    pub bmc_errors: Family<Labels, Counter>,
    pub hosts: Family<Labels, Gauge>,
    pub provisioning_seconds: Family<Labels, Histogram>,
    pub callback_latency_seconds: Family<Labels, Histogram>,
    pub reconciles: Family<Labels, Counter>,
    pub reconcile_errors: Family<Labels, Counter>,
    pub reconcile_seconds: Family<Labels, Histogram>,
    pub store_lag: Family<Labels, Counter>,
    pub callback_stale: Family<Labels, Counter>,
    pub allocator_bytes: Family<Labels, Gauge>,
    pub apiserver_request_seconds: Family<Labels, Histogram>,
}

fn reconcile_histogram() -> Histogram {
    // 1 ms … ~16 s: a pass is a store read, maybe one BMC call or write.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 15,
    ))
}

fn hop_histogram() -> Histogram {
    // 10 ms … ~5 min: one network-boot hop.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.01, 2.0, 15,
    ))
}

fn histogram() -> Histogram {
    // 1 s … ~68 min: firmware + OS boots are seconds to tens of minutes.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        1.0, 2.0, 13,
    ))
}

fn latency_histogram() -> Histogram {
    // 1 ms … ~33 s: the controllers' reaction to an event.
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 16,
    ))
}

pub fn metrics() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let mut registry = Registry::with_prefix("metalboot");
        let m = Metrics {
            http_requests: Family::default(),
            http_bytes: Family::default(),
            http_refused: Family::default(),
            http_sendfile_bytes: Counter::default(),
            http_aborted: Family::default(),
            events_suppressed: Family::default(),
            callbacks: Family::default(),
            tftp_transfers: Family::default(),
            dhcp_packets: Family::default(),
            hop_seconds: Family::new_with_constructor(hop_histogram),
            bmc_errors: Family::default(),
            hosts: Family::default(),
            provisioning_seconds: Family::new_with_constructor(histogram),
            callback_latency_seconds: Family::new_with_constructor(latency_histogram),
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_seconds: Family::new_with_constructor(reconcile_histogram),
            store_lag: Family::default(),
            callback_stale: Family::default(),
            allocator_bytes: Family::default(),
            apiserver_request_seconds: Family::new_with_constructor(latency_histogram),
            registry: Registry::default(),
        };
        registry.register(
            "boot_http_requests",
            "Boot service HTTP requests by route and status",
            m.http_requests.clone(),
        );
        registry.register(
            "boot_http_bytes",
            "Bytes sent by the boot service, by route",
            m.http_bytes.clone(),
        );
        registry.register(
            "boot_http_sendfile_bytes",
            "Bytes of files the boot service handed to the kernel with sendfile(2), never copied through user space",
            m.http_sendfile_bytes.clone(),
        );
        registry.register(
            "boot_http_responses_aborted",
            "Boot service responses cut off mid-way, by reason (stalled client, lifetime, file shrank, body too large)",
            m.http_aborted.clone(),
        );
        registry.register(
            "boot_http_connections_refused",
            "Boot service connections closed at accept, by the budget that was full",
            m.http_refused.clone(),
        );
        registry.register(
            "boot_events_suppressed",
            "Events from unauthenticated boot requests not written (rate limit), by reason",
            m.events_suppressed.clone(),
        );
        registry.register(
            "boot_callbacks",
            "Bootstrap-success callbacks by result",
            m.callbacks.clone(),
        );
        registry.register(
            "boot_tftp_transfers",
            "TFTP transfers by file and result",
            m.tftp_transfers.clone(),
        );
        registry.register(
            "boot_dhcp_packets",
            "DHCP packets received by the proxyDHCP service, by outcome",
            m.dhcp_packets.clone(),
        );
        registry.register(
            "boot_hop_seconds",
            "Seconds from a host's previous boot milestone to this one (dhcp, tftp, script, artifact, user-data, callback)",
            m.hop_seconds.clone(),
        );
        registry.register("bmc_errors", "BMC errors by reason", m.bmc_errors.clone());
        registry.register("hosts", "MetalHosts by state", m.hosts.clone());
        registry.register(
            "callback_latency_seconds",
            "Seconds from a host's bootstrap-success callback to each stage of acting on it: its boot Secret records it (stage=recorded), its callback-lane pass starts (stage=lane) and has the machine's turn (stage=turn), finds a store behind and looks again (stage=stale, once per try), the pass that records providerID has decided (stage=decided), providerID and ready are written (stage=ready)",
            m.callback_latency_seconds.clone(),
        );
        registry.register(
            "provisioning_phase_seconds",
            "Seconds spent in each provisioning phase (claim, boot, total)",
            m.provisioning_seconds.clone(),
        );
        registry.register(
            "reconciles",
            "Reconcile passes per controller",
            m.reconciles.clone(),
        );
        registry.register(
            "reconcile_errors",
            "Failed reconcile passes per controller and error category",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "reconcile_seconds",
            "Duration of reconcile passes per controller",
            m.reconcile_seconds.clone(),
        );
        registry.register(
            "controller_store_lag_checks",
            "Questions to the apiserver about a store that had not shown a controller's own write past the TTL, and before a power action, by kind and answer (behind, current, unknown, fenced)",
            m.store_lag.clone(),
        );
        registry.register(
            "callback_lane_stale",
            "Callback-lane passes that found a store behind this manager's own last write, by the kind of the object that store holds",
            m.callback_stale.clone(),
        );
        registry.register(
            "apiserver_request_seconds",
            "The manager's apiserver requests (watches and Lease renewals aside), by lane (urgent: work a host's callback waits on; ordinary: the rest) and stage: seconds waiting in the manager's bound (stage=queued), then until the apiserver's answer arrived (stage=answered)",
            m.apiserver_request_seconds.clone(),
        );
        #[cfg(feature = "jemalloc")]
        registry.register(
            "allocator_bytes",
            "The manager's heap by jemalloc's own count, read at each scrape: bytes held by live allocations (allocated), in pages holding them (active), in RAM (resident), mapped (mapped), and address space kept mapped for reuse without its pages (retained)",
            m.allocator_bytes.clone(),
        );
        Metrics { registry, ..m }
    })
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The route template of a boot-service path (bounded label values: never a MAC or token).
pub fn route_of(path: &str) -> &'static str {
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    match first {
        "boot.ipxe" => "/boot.ipxe",
        "ipxe" => "/ipxe",
        "nocloud" => "/nocloud",
        "callback" => "/callback",
        "artifacts" => "/artifacts",
        "healthz" | "readyz" => "/health",
        "metrics" => "/metrics",
        _ => "other",
    }
}

pub fn record_http(path: &str, status: u16, bytes: Option<u64>) {
    let m = metrics();
    let route = route_of(path);
    m.http_requests
        .get_or_create(&labels(&[
            ("route", route),
            ("status", &status.to_string()),
        ]))
        .inc();
    if let Some(b) = bytes {
        m.http_bytes
            .get_or_create(&labels(&[("route", route)]))
            .inc_by(b);
    }
}

pub fn record_sendfile(bytes: u64) {
    metrics().http_sendfile_bytes.inc_by(bytes);
}

/// Bytes sent with sendfile(2) so far (tests check the zero-copy path was taken).
pub fn sendfile_bytes() -> u64 {
    metrics().http_sendfile_bytes.get()
}

pub fn record_http_aborted(reason: &str) {
    metrics()
        .http_aborted
        .get_or_create(&labels(&[("reason", reason)]))
        .inc();
}

/// Responses cut off for `reason` so far.
pub fn http_aborted(reason: &str) -> u64 {
    metrics()
        .http_aborted
        .get_or_create(&labels(&[("reason", reason)]))
        .get()
}

pub fn record_http_refused(budget: &str) {
    metrics()
        .http_refused
        .get_or_create(&labels(&[("budget", budget)]))
        .inc();
}

pub fn record_event_suppressed(reason: &str) {
    metrics()
        .events_suppressed
        .get_or_create(&labels(&[("reason", reason)]))
        .inc();
}

/// Events not published because an anonymous request caused them within the interval.
pub fn events_suppressed(reason: &str) -> u64 {
    metrics()
        .events_suppressed
        .get_or_create(&labels(&[("reason", reason)]))
        .get()
}

pub fn http_refused(budget: &str) -> u64 {
    metrics()
        .http_refused
        .get_or_create(&labels(&[("budget", budget)]))
        .get()
}

pub fn record_store_lag(kind: &str, answer: &str) {
    metrics()
        .store_lag
        .get_or_create(&labels(&[("kind", kind), ("answer", answer)]))
        .inc();
}

pub fn record_callback_stale(kind: &str) {
    metrics()
        .callback_stale
        .get_or_create(&labels(&[("kind", kind)]))
        .inc();
}

/// Store-lag checks of `kind` answered `answer` so far.
pub fn store_lag(kind: &str, answer: &str) -> u64 {
    metrics()
        .store_lag
        .get_or_create(&labels(&[("kind", kind), ("answer", answer)]))
        .get()
}

pub fn record_callback(result: &str) {
    metrics()
        .callbacks
        .get_or_create(&labels(&[("result", result)]))
        .inc();
}

pub fn record_tftp(file: &str, result: &str) {
    metrics()
        .tftp_transfers
        .get_or_create(&labels(&[("file", file), ("result", result)]))
        .inc();
}

pub fn record_dhcp(outcome: &str) {
    metrics()
        .dhcp_packets
        .get_or_create(&labels(&[("outcome", outcome)]))
        .inc();
}

pub fn record_hop(hop: &str, took: std::time::Duration) {
    metrics()
        .hop_seconds
        .get_or_create(&labels(&[("hop", hop)]))
        .observe(took.as_secs_f64());
}

pub fn record_bmc_error(reason: &str) {
    metrics()
        .bmc_errors
        .get_or_create(&labels(&[("reason", reason)]))
        .inc();
}

pub fn observe_callback_latency(stage: &str, seconds: f64) {
    metrics()
        .callback_latency_seconds
        .get_or_create(&labels(&[("stage", stage)]))
        .observe(seconds);
}

/// Which series of `metalboot_apiserver_request_seconds` an observation goes to.
#[derive(Clone, Copy)]
pub enum ApiserverRequestStage {
    Queued = 0,
    Answered = 1,
}

/// One apiserver request of the manager's, in the urgent or the ordinary lane (see the metric's
/// help). Called for every request, so the four series are looked up once, not per call.
pub fn observe_apiserver_request(urgent: bool, stage: ApiserverRequestStage, seconds: f64) {
    static SERIES: OnceLock<[Histogram; 4]> = OnceLock::new();
    let series = SERIES.get_or_init(|| {
        let family = &metrics().apiserver_request_seconds;
        let series = |lane, stage| {
            family
                .get_or_create(&labels(&[("lane", lane), ("stage", stage)]))
                .clone()
        };
        [
            series("urgent", "queued"),
            series("urgent", "answered"),
            series("ordinary", "queued"),
            series("ordinary", "answered"),
        ]
    });
    let index = 2 * usize::from(!urgent) + stage as usize;
    if let Some(histogram) = series.get(index) {
        histogram.observe(seconds);
    }
}

pub fn observe_phase(phase: &str, seconds: f64) {
    metrics()
        .provisioning_seconds
        .get_or_create(&labels(&[("phase", phase)]))
        .observe(seconds);
}

/// One reconcile pass of `controller`: its duration, and the error category if it failed.
pub fn record_reconcile(controller: &str, error: Option<&str>, took: std::time::Duration) {
    let m = metrics();
    let by = labels(&[("controller", controller)]);
    m.reconciles.get_or_create(&by).inc();
    m.reconcile_seconds
        .get_or_create(&by)
        .observe(took.as_secs_f64());
    if let Some(category) = error {
        m.reconcile_errors
            .get_or_create(&labels(&[
                ("controller", controller),
                ("category", category),
            ]))
            .inc();
    }
}

/// Passes per object (`controller/namespace/name`), kept in memory only: not a Prometheus label
/// (one series per object would be unbounded), but what a test waits on to know "the controller
/// looked at my object again" before a negative assertion. Keyed by a hash of the two names, not
/// the names: every pass counts, and at 10,000 hosts the names were a string per pass and about
/// 2 MB of keys for a helper only tests read (a collision can only make a test's wait end early).
fn passes() -> &'static std::sync::Mutex<std::collections::HashMap<u64, u64>> {
    static PASSES: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<u64, u64>>> =
        std::sync::OnceLock::new();
    PASSES.get_or_init(Default::default)
}

/// The key of `controller`'s passes over `object` (SipHash with fixed keys: the same in every
/// process, so a count read in a test matches the one the controller wrote).
fn pass_key(controller: &str, object: &str) -> u64 {
    crate::stable_hash::stable_hash(&(controller, object))
}

/// Bound on the per-object pass counts: past it, the map starts over (tests compare counts
/// taken seconds apart, far below this).
const PASSES_CAPACITY: usize = 20_000;

/// One finished reconcile pass of `controller` over `object` (`namespace/name`).
pub fn record_pass(controller: &str, object: &str) {
    if let Ok(mut map) = passes().lock() {
        if map.len() >= PASSES_CAPACITY {
            map.clear();
        }
        *map.entry(pass_key(controller, object)).or_default() += 1;
    }
}

/// Finished passes of `controller` over `object` so far.
pub fn passes_of(controller: &str, object: &str) -> u64 {
    passes()
        .lock()
        .ok()
        .and_then(|m| m.get(&pass_key(controller, object)).copied())
        .unwrap_or(0)
}

/// Reconcile passes of `controller` so far (tests wait on this instead of sleeping).
pub fn reconciles(controller: &str) -> u64 {
    metrics()
        .reconciles
        .get_or_create(&labels(&[("controller", controller)]))
        .get()
}

/// Sets the hosts-per-state gauge from a full count (every known state, zeros included).
pub fn set_hosts(counts: &[(&str, i64)]) {
    for (state, n) in counts {
        metrics()
            .hosts
            .get_or_create(&labels(&[("state", state)]))
            .set(*n);
    }
}

/// Reads jemalloc's counts into `allocator_bytes`. A process whose global allocator is not
/// jemalloc (a test binary) reads only what went through jemalloc directly.
#[cfg(feature = "jemalloc")]
fn read_allocator() {
    use tikv_jemalloc_ctl::{epoch, stats};
    // The counts are a snapshot taken when the epoch moves.
    if epoch::advance().is_err() {
        return;
    }
    let counts = [
        ("allocated", stats::allocated::read()),
        ("active", stats::active::read()),
        ("resident", stats::resident::read()),
        ("mapped", stats::mapped::read()),
        ("retained", stats::retained::read()),
    ];
    for (kind, bytes) in counts {
        if let Ok(bytes) = bytes {
            metrics()
                .allocator_bytes
                .get_or_create(&labels(&[("kind", kind)]))
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }
}

/// The text exposition of every metric.
pub fn render() -> String {
    // One scrape at a time, so that a page never mixes jemalloc's counts of two snapshots.
    static RENDERING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = RENDERING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    #[cfg(feature = "jemalloc")]
    read_allocator();
    let mut out = String::new();
    if encode(&mut out, &metrics().registry).is_err() {
        out.clear();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_have_bounded_labels() {
        assert_eq!(route_of("/ipxe/52-54-00-00-00-01"), "/ipxe");
        assert_eq!(route_of("/nocloud/deadbeef/user-data"), "/nocloud");
        assert_eq!(route_of("/callback/deadbeef"), "/callback");
        assert_eq!(route_of("/artifacts/vmlinuz"), "/artifacts");
        assert_eq!(route_of("/wp-admin"), "other");
    }

    /// Each controller's passes over each object count apart: what a test waits on must move
    /// only for its own object.
    #[test]
    fn passes_are_counted_per_controller_and_object() {
        let (a, b) = ("ns-passes/a", "ns-passes/b");
        let before = (passes_of("metalhost", a), passes_of("metalhost", b));
        let other = passes_of("machine", a);
        record_pass("metalhost", a);
        record_pass("metalhost", a);
        record_pass("metalhost", b);
        assert_eq!(passes_of("metalhost", a), before.0 + 2);
        assert_eq!(passes_of("metalhost", b), before.1 + 1);
        assert_eq!(passes_of("machine", a), other);
        assert_ne!(pass_key("metalhost", "x/y"), pass_key("metalhost/x", "y"));
    }

    #[test]
    fn recorded_values_are_rendered() {
        record_http("/ipxe/52-54-00-00-00-01", 200, Some(321));
        record_callback("accepted");
        observe_phase("boot", 12.5);
        let text = render();
        assert!(
            text.contains("metalboot_boot_http_requests_total{route=\"/ipxe\",status=\"200\"}"),
            "{text}"
        );
        assert!(
            text.contains("metalboot_boot_callbacks_total{result=\"accepted\"}"),
            "{text}"
        );
        assert!(
            text.contains("metalboot_provisioning_phase_seconds_count{phase=\"boot\"}"),
            "{text}"
        );
        assert!(!text.contains("52-54-00"), "no MACs in labels");
    }

    /// The value of one `allocator_bytes` series in a rendered page.
    #[cfg(feature = "jemalloc")]
    fn allocator(text: &str, kind: &str) -> i64 {
        let series = format!("metalboot_allocator_bytes{{kind=\"{kind}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}"))
    }

    #[test]
    #[cfg(feature = "jemalloc")]
    fn each_scrape_reads_the_heap_anew() {
        use std::alloc::{GlobalAlloc, Layout};
        // The test binary's allocator is the system's, so this block goes to jemalloc directly.
        let layout = Layout::from_size_align(64 << 20, 4096).unwrap();
        let block = unsafe { tikv_jemallocator::Jemalloc.alloc_zeroed(layout) };
        assert!(!block.is_null());
        let held = render();
        unsafe { tikv_jemallocator::Jemalloc.dealloc(block, layout) };
        let freed = render();
        assert!(allocator(&held, "allocated") >= 64 << 20, "{held}");
        assert!(allocator(&held, "mapped") >= allocator(&held, "allocated"));
        assert!(
            allocator(&held, "allocated") - allocator(&freed, "allocated") >= 64 << 20,
            "held:\n{held}\nfreed:\n{freed}"
        );
    }
}

//! Leader election on a real apiserver: in-process for the fence, and with two real
//! `metalboot manager` processes for takeover, where the apiserver's audit log (User-Agent carries
//! the replica's identity) says which replica wrote what, and when.

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use metalboot::api::MetalHost;
use metalboot::leader::{LeaseConfig, Lost, acquire};

fn config(ns: &str, identity: &str, duration: u64, grace: u64) -> LeaseConfig {
    LeaseConfig {
        namespace: ns.into(),
        name: "metalboot-manager".into(),
        identity: identity.into(),
        duration: Duration::from_secs(duration),
        grace: Duration::from_secs(grace),
    }
}

fn config_map(name: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The fence in one process: a leader writes; once another holder takes the Lease, every write
/// through the fenced client is refused before it leaves, reads still pass, and `lost` says why.
#[tokio::test]
async fn a_leader_whose_lease_is_taken_can_no_longer_write() {
    let ns = support::namespace("leader-fence").await;
    let mut leadership = tokio::time::timeout(
        Duration::from_secs(30),
        acquire(ns.client.clone(), config(&ns.name, "replica-a", 15, 10)),
    )
    .await
    .expect("the only replica leads at once")
    .expect("leader election");
    let fenced = leadership.fenced(ns.client.clone());
    let maps: Api<ConfigMap> = Api::namespaced(fenced, &ns.name);
    maps.create(&PostParams::default(), &config_map("while-leading"))
        .await
        .expect("the leader writes");

    // Another holder, as a standby would write it after expiry.
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    let intruder = serde_json::json!({"spec": {
        "holderIdentity": "replica-b",
        "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(jiff::Timestamp::now()),
    }});
    leases
        .patch(
            "metalboot-manager",
            &PatchParams::default(),
            &Patch::Merge(&intruder),
        )
        .await
        .expect("take the Lease");
    let lost = tokio::time::timeout(Duration::from_secs(30), leadership.lost())
        .await
        .expect("leadership ends once the Lease is someone else's");
    assert!(
        matches!(lost, Lost::TakenOver | Lost::NotRenewed),
        "{lost:?}"
    );
    let refused = maps
        .create(&PostParams::default(), &config_map("after-losing"))
        .await
        .expect_err("no write once the Lease is gone");
    assert!(
        refused.to_string().contains("renew deadline"),
        "refused by the fence, not by the apiserver: {refused:?}"
    );
    assert_eq!(leadership.fence().refused(), 1);
    maps.get("while-leading").await.expect("reads still pass");
    let plain: Api<ConfigMap> = Api::namespaced(ns.client.clone(), &ns.name);
    assert!(
        plain.get_opt("after-losing").await.expect("get").is_none(),
        "the refused write never reached the apiserver"
    );
}

/// A `metalboot manager` process with leader election on, logging to a file.
struct Replica {
    child: Child,
    log: PathBuf,
    boot: SocketAddr,
}

const LEASE_SECONDS: i64 = 6;
const GRACE_SECONDS: i64 = 4;

fn free_port() -> SocketAddr {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("free port")
}

impl Replica {
    fn start(name: &'static str, ns: &str, dir: &Path) -> Replica {
        let plane = support::control_plane();
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("log file");
        let boot = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_metalboot"))
            .args(["--log-format", "text", "manager", "--kubeconfig"])
            .arg(&plane.kubeconfig_path)
            .args(["--namespace", ns, "--leader-election-namespace", ns])
            .args([
                "--leader-elect",
                "--no-tftp",
                "--dhcp",
                "off",
                "--standalone",
                "false",
            ])
            .args([
                "--leader-elect-lease-seconds",
                &LEASE_SECONDS.to_string(),
                "--leader-elect-grace-seconds",
                &GRACE_SECONDS.to_string(),
            ])
            .args(["--boot-http-bind", &boot.to_string()])
            .env("POD_NAME", name)
            .env("RUST_LOG", "info,metalboot=debug,kube_runtime=warn")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start metalboot manager");
        Replica { child, log, boot }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, signal: i32) -> bool {
        let Ok(pid) = i32::try_from(self.child.id()) else {
            return false;
        };
        // SAFETY: kill(2) on our own child, which is not reaped before Drop.
        unsafe { libc::kill(pid, signal) == 0 }
    }

    fn accepts_connections(&self) -> bool {
        TcpStream::connect_timeout(&self.boot, Duration::from_secs(1)).is_ok()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        self.signal(libc::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn by(replica: &str) -> impl Fn(&&support::Write) -> bool + '_ {
    move |w| w.agent.contains(&format!("({replica})"))
}

/// Every version of the Lease, as the test watched it.
fn record_lease(client: kube::Client, ns: &str) -> Arc<Mutex<Vec<LeaseSpec>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let api: Api<Lease> = Api::namespaced(client, ns);
    let record = seen.clone();
    tokio::spawn(async move {
        let config = watcher::Config::default().fields("metadata.name=metalboot-manager");
        let mut versions = watcher(api, config).applied_objects().boxed();
        while let Some(Ok(lease)) = versions.next().await {
            if let Ok(mut seen) = record.lock() {
                seen.push(lease.spec.unwrap_or_default());
            }
        }
    });
    seen
}

fn holder(spec: &LeaseSpec) -> &str {
    spec.holder_identity.as_deref().unwrap_or("")
}

async fn host_registered(hosts: &Api<MetalHost>, name: &str) -> bool {
    hosts
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|h| h.status)
        .is_some()
}

/// Two managers on one apiserver. `kill -STOP` the leader: the standby takes over only once the
/// Lease has expired; the stopped leader, resumed, writes nothing after its renew deadline and
/// exits. A standby accepts no boot-service connection.
#[tokio::test]
async fn a_stopped_leader_is_replaced_only_after_expiry_and_never_writes_again() {
    let ns = support::namespace("leader-procs").await;
    support::boot::install_crds(&ns.client).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let lease_versions = record_lease(ns.client.clone(), &ns.name);
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    let hosts: Api<MetalHost> = Api::namespaced(ns.client.clone(), &ns.name);
    let holder_now = || async {
        let lease = leases.get_opt("metalboot-manager").await.ok().flatten()?;
        lease.spec?.holder_identity
    };

    let a = Replica::start("replica-a", &ns.name, dir.path());
    support::eventually("replica-a leads and serves boot HTTP", 90, || async {
        (holder_now().await.as_deref() == Some("replica-a") && a.accepts_connections())
            .then_some(())
    })
    .await;
    let b = Replica::start("replica-b", &ns.name, dir.path());
    support::eventually("replica-b sees replica-a lead", 60, || async {
        b.log().contains("another replica leads").then_some(())
    })
    .await;
    assert!(
        !b.accepts_connections(),
        "a standby must not accept boot-service connections"
    );

    support::boot::create_host(&ns.client, &ns.name, "h1", "52:54:00:00:00:01").await;
    support::eventually("replica-a registers h1", 60, || async {
        host_registered(&hosts, "h1").await.then_some(())
    })
    .await;

    assert!(a.signal(libc::SIGSTOP), "stop replica-a");
    support::boot::create_host(&ns.client, &ns.name, "h2", "52:54:00:00:00:02").await;
    support::eventually("replica-b takes over", 60, || async {
        (holder_now().await.as_deref() == Some("replica-b")).then_some(())
    })
    .await;
    support::eventually("replica-b registers h2", 60, || async {
        host_registered(&hosts, "h2").await.then_some(())
    })
    .await;
    support::eventually("replica-b serves boot HTTP", 30, || async {
        b.accepts_connections().then_some(())
    })
    .await;

    let a_last_renew = lease_versions
        .lock()
        .expect("versions")
        .iter()
        .filter(|l| holder(l) == "replica-a")
        .filter_map(|l| l.renew_time.as_ref().map(|t| t.0))
        .max()
        .expect("replica-a renewed the Lease");
    let expiry = a_last_renew + jiff::SignedDuration::from_secs(LEASE_SECONDS);
    let a_deadline = expiry - jiff::SignedDuration::from_secs(GRACE_SECONDS / 2);

    assert!(a.signal(libc::SIGCONT), "resume replica-a");
    let a = Mutex::new(a);
    let status = support::eventually("the resumed replica-a exits", 60, || async {
        a.lock().ok()?.child.try_wait().ok().flatten()
    })
    .await;
    let a = a.into_inner().expect("replica-a");
    assert!(!status.success(), "losing the lead is an error exit");
    let a_log = a.log();
    assert!(
        a_log.contains("stopped acting"),
        "replica-a says why it stopped: {}",
        tail(&a_log)
    );

    let writes = support::writes_in(&ns.name);
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for w in &writes {
        *counts
            .entry(format!("{} {} {}", w.agent, w.verb, w.resource))
            .or_default() += 1;
    }
    println!(
        "writes in {} by agent, verb, resource: {counts:#?}",
        ns.name
    );
    println!(
        "replica-a: last renewal {a_last_renew}, write deadline {a_deadline}, Lease expiry {expiry}; \
         writes refused by its fence after resuming: {}",
        a_log.matches("write fenced").count()
    );
    assert!(
        writes
            .iter()
            .filter(by("replica-a"))
            .any(|w| w.name == "h1"),
        "replica-a's own writes are visible in the audit log (the check below can fail)"
    );
    let late: Vec<&support::Write> = writes
        .iter()
        .filter(by("replica-a"))
        .filter(|w| w.at > a_deadline)
        .collect();
    assert!(
        late.is_empty(),
        "replica-a wrote after its renew deadline {a_deadline}: {late:#?}"
    );
    let takeover = writes
        .iter()
        .filter(by("replica-b"))
        .filter(|w| w.resource.starts_with("leases"))
        .map(|w| w.at)
        .min()
        .expect("replica-b wrote the Lease to take it");
    assert!(
        takeover >= expiry,
        "replica-b took the Lease at {takeover}, before it expired at {expiry}"
    );
    let b_first_act = writes
        .iter()
        .filter(by("replica-b"))
        .filter(|w| !w.resource.starts_with("leases"))
        .map(|w| w.at)
        .min()
        .expect("replica-b acted");
    assert!(
        b_first_act > expiry,
        "replica-b acted at {b_first_act}, before replica-a's Lease expired at {expiry}"
    );
    drop(b);
}

fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

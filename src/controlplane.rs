//! The local Kubernetes control plane: etcd and kube-apiserver, built from source by
//! `hack/control-plane/build.sh`, started on free loopback ports with a generated CA and a
//! client-certificate admin (group `system:masters`). The test suite, `metalboot control-plane`
//! and the lab use it. Like upstream envtest it runs no controller-manager by default, so there is
//! no garbage collector and no namespace finalization. A *join-ready* control plane
//! ([`Options::join_ready`]) adds what `kubeadm join` needs from a cluster: bootstrap-token
//! authentication, the Node authorizer and NodeRestriction, and kube-controller-manager with the
//! cluster CA's key (kubelet CSR approval and signing, the bootstrap-token signer and cleaner).
//! It is not a production installer.

use std::fs;
use std::io::{self, BufRead};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, Once, OnceLock, mpsc};
use std::time::{Duration, Instant};

use base64::Engine;
use kube::config::{KubeConfigOptions, Kubeconfig};

use crate::pki::{self, Ca};

/// Loopback address the guest VMs of the lab use to reach the host (QEMU user-mode networking);
/// the apiserver certificate names it so a lab host can register its Node over TLS.
pub const QEMU_HOST_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);

const READY_TIMEOUT: Duration = Duration::from_secs(180);
const PIDS_FILE: &str = "pids";

#[derive(Debug, thiserror::Error)]
pub enum ControlPlaneError {
    #[error(
        "control-plane binary {0} is missing; build it with hack/control-plane/build.sh (make test and make lab do this)"
    )]
    MissingBinary(PathBuf),
    #[error("generating control-plane certificates: {0}")]
    Certificates(#[from] rcgen::Error),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{name} exited before the control plane was ready ({status}); last lines of {log}:\n{tail}"
    )]
    Exited {
        name: &'static str,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("kube-apiserver did not become ready within {}s; last lines of {log}:\n{tail}", READY_TIMEOUT.as_secs())]
    NotReady { log: PathBuf, tail: String },
    #[error("kubeconfig for the control plane: {0}")]
    Kubeconfig(String),
    #[error("no control plane recorded in {0} (nothing to stop)")]
    NothingToStop(PathBuf),
    #[error("preparing the control plane for kubeadm joins: {0}")]
    Joins(String),
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(io::Error) -> ControlPlaneError + 'a {
    move |source| ControlPlaneError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The apiserver's audit log, in the data directory: one JSON line per write, with the
/// User-Agent (metalboot puts the replica's identity there) — who wrote what, and when.
pub const AUDIT_LOG: &str = "audit.log";

/// Writes only, at Metadata level (no bodies, so no Secret content), written before the reply.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
";

/// How the started processes relate to this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// Killed when this process exits, however it exits (tests, the in-process lab).
    TiedToThisProcess,
    /// Left running in their own session; `stop_detached` ends them (`hack/control-plane/start.sh`).
    Detached,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub bin_dir: PathBuf,
    pub data_dir: PathBuf,
    pub lifetime: Lifetime,
    /// Also run kube-controller-manager and accept bootstrap tokens, for kubeadm join.
    pub join_ready: bool,
}

/// A running control plane. Dropping it stops processes it owns (not detached ones).
pub struct ControlPlane {
    pub data_dir: PathBuf,
    pub kubeconfig_path: PathBuf,
    pub server: String,
    pub kubeconfig: Kubeconfig,
    /// The CA that signed the apiserver certificate, for kubeconfigs handed to lab hosts.
    pub ca_pem: String,
    children: Vec<Child>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server", &self.server)
            .field("kubeconfig_path", &self.kubeconfig_path)
            .finish_non_exhaustive()
    }
}

/// The Kubernetes release the control plane, kubeadm and kubelet are built from (the pin in
/// `hack/control-plane/versions.env`, read at compile time).
pub fn kubernetes_version() -> &'static str {
    include_str!("../hack/control-plane/versions.env")
        .lines()
        .find_map(|l| l.strip_prefix("KUBERNETES_VERSION="))
        .map(str::trim)
        .unwrap_or("v1.36.3")
}

/// Where `hack/control-plane/build.sh` puts the binaries unless `METALBOOT_CONTROL_PLANE_BIN` says.
pub fn default_bin_dir() -> PathBuf {
    std::env::var_os("METALBOOT_CONTROL_PLANE_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| project_dir().join("target/control-plane/bin"))
}

/// The source checkout this binary was built from (the lab and tests keep their state there).
pub fn project_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn free_port() -> io::Result<u16> {
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

impl ControlPlaneError {
    /// A process found the loopback port it was given taken: between `free_port` and the
    /// process's bind, another process (a test starting a control plane beside this one) took it.
    fn lost_a_port(&self) -> bool {
        matches!(self, ControlPlaneError::Exited { tail, .. } if tail.contains("address already in use"))
    }
}

/// Starts made again after a process found its port taken.
const PORT_RACE_RETRIES: u32 = 3;

impl ControlPlane {
    /// Starts etcd and kube-apiserver (and kube-controller-manager for joins) on free loopback
    /// ports. A port is found free, then handed to a process, and another process may take it
    /// in between: such a start is made again on new ports, a few times.
    pub async fn start(opts: &Options) -> Result<Self, ControlPlaneError> {
        let mut retries = 0;
        loop {
            match Self::start_once(opts).await {
                Err(e) if retries < PORT_RACE_RETRIES && e.lost_a_port() => {
                    retries += 1;
                    tracing::info!(retries, error = %e, "a control-plane port was taken before its process bound it; starting again on new ports");
                    // etcd may have begun its data directory with the old peer address.
                    let _ = fs::remove_dir_all(opts.data_dir.join("etcd"));
                }
                result => return result,
            }
        }
    }

    async fn start_once(opts: &Options) -> Result<Self, ControlPlaneError> {
        let etcd_bin = opts.bin_dir.join("etcd");
        let apiserver_bin = opts.bin_dir.join("kube-apiserver");
        let kcm_bin = opts.bin_dir.join("kube-controller-manager");
        let mut needed = vec![&etcd_bin, &apiserver_bin];
        if opts.join_ready {
            needed.push(&kcm_bin);
        }
        for bin in needed {
            if !bin.is_file() {
                return Err(ControlPlaneError::MissingBinary(bin.clone()));
            }
        }
        let dir = &opts.data_dir;
        fs::create_dir_all(dir).map_err(io_err("creating data directory", dir))?;
        let pki_dir = dir.join("pki");
        fs::create_dir_all(&pki_dir).map_err(io_err("creating", &pki_dir))?;

        let ca = Ca::new("metalboot-local-control-plane")?;
        let serving = ca.issue_server(
            &[
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
            ],
            &[
                IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(Ipv6Addr::LOCALHOST),
                IpAddr::V4(QEMU_HOST_ADDRESS),
                // The lab bridge: bridged lab hosts reach the apiserver there, through a relay
                // that passes TLS through (`lab::relay::serve_tcp`).
                IpAddr::V4(crate::lab::net::BOOT_IP),
                IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
            ],
        )?;
        let admin = ca.issue_client("metalboot-admin", &["system:masters"])?;
        let (sa_key, sa_pub) = pki::new_key_pair_pem()?;
        let write = |name: &str, content: &str| -> Result<PathBuf, ControlPlaneError> {
            let path = pki_dir.join(name);
            fs::write(&path, content).map_err(io_err("writing", &path))?;
            Ok(path)
        };
        let ca_path = write("ca.crt", &ca.cert_pem())?;
        let cert_path = write("apiserver.crt", &serving.cert_pem)?;
        let key_path = write("apiserver.key", &serving.key_pem)?;
        let sa_path = write("service-account.key", &sa_key)?;
        let sa_pub_path = write("service-account.pub", &sa_pub)?;

        let (etcd_port, etcd_peer_port, api_port) =
            (|| Ok((free_port()?, free_port()?, free_port()?)))()
                .map_err(io_err("finding free loopback ports for", dir))?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let server = format!("https://127.0.0.1:{api_port}");

        let mut children = Vec::new();
        let etcd_log = dir.join("etcd.log");
        let etcd_dir = dir.join("etcd");
        let mut etcd = Command::new(&etcd_bin);
        etcd.arg("--data-dir")
            .arg(&etcd_dir)
            .arg(format!("--listen-client-urls={etcd_url}"))
            .arg(format!("--advertise-client-urls={etcd_url}"))
            .arg(format!(
                "--listen-peer-urls=http://127.0.0.1:{etcd_peer_port}"
            ))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer_port}"
            ))
            .arg(format!(
                "--initial-cluster=default=http://127.0.0.1:{etcd_peer_port}"
            ))
            .arg("--unsafe-no-fsync")
            .arg("--log-level=warn");
        children.push(spawn("etcd", etcd, &etcd_log, opts.lifetime)?);

        let api_log = dir.join("kube-apiserver.log");
        let audit_policy = write("audit-policy.yaml", AUDIT_POLICY)?;
        let audit_log = dir.join(AUDIT_LOG);
        let mut api = Command::new(&apiserver_bin);
        api.arg(format!("--etcd-servers={etcd_url}"))
            .arg(format!("--secure-port={api_port}"))
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg("--service-cluster-ip-range=10.0.0.0/24")
            .arg("--allow-privileged=true")
            // No controller-manager creates ServiceAccounts, so pods in tests would be rejected.
            .arg("--disable-admission-plugins=ServiceAccount")
            .arg(format!("--client-ca-file={}", ca_path.display()))
            .arg(format!("--tls-cert-file={}", cert_path.display()))
            .arg(format!("--tls-private-key-file={}", key_path.display()))
            .arg(format!(
                "--service-account-key-file={}",
                sa_pub_path.display()
            ))
            .arg(format!(
                "--service-account-signing-key-file={}",
                sa_path.display()
            ))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--cert-dir={}", pki_dir.display()))
            .arg(format!("--audit-policy-file={}", audit_policy.display()))
            .arg(format!("--audit-log-path={}", audit_log.display()))
            .arg("--audit-log-format=json")
            .arg("--audit-log-maxsize=100")
            .arg("--audit-log-maxbackup=1")
            .arg("--v=1");
        if opts.join_ready {
            // As kubeadm configures its control planes: kubelets bootstrap with a token, then
            // act as system:node:<name> within what the Node authorizer and NodeRestriction allow.
            api.arg("--authorization-mode=Node,RBAC")
                .arg("--enable-bootstrap-token-auth=true")
                .arg("--enable-admission-plugins=NodeRestriction");
        } else {
            api.arg("--authorization-mode=RBAC");
        }
        children.push(spawn("kube-apiserver", api, &api_log, opts.lifetime)?);
        let mut names = vec!["etcd", "kube-apiserver"];

        if opts.join_ready {
            // The cluster CA's key, readable by this user only (created so, never widened).
            let ca_key_path = pki_dir.join("ca.key");
            {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&ca_key_path)
                    .and_then(|mut f| f.write_all(ca.key_pem().as_bytes()))
                    .map_err(io_err("writing", &ca_key_path))?;
            }
            let identity = ca.issue_client("system:kube-controller-manager", &[])?;
            let kcm_kubeconfig = admin_kubeconfig(&server, &ca.cert_pem(), &identity)?;
            let kcm_kubeconfig_path = dir.join("kube-controller-manager.kubeconfig");
            let yaml = serde_yaml::to_string(&kcm_kubeconfig)
                .map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))?;
            fs::write(&kcm_kubeconfig_path, yaml)
                .map_err(io_err("writing", &kcm_kubeconfig_path))?;
            let kcm_log = dir.join("kube-controller-manager.log");
            let mut kcm = Command::new(&kcm_bin);
            kcm.arg(format!("--kubeconfig={}", kcm_kubeconfig_path.display()))
                // Everything on by default, plus the two bootstrap-token controllers kubeadm adds.
                .arg("--controllers=*,bootstrapsigner,tokencleaner")
                .arg(format!("--cluster-signing-cert-file={}", ca_path.display()))
                .arg(format!(
                    "--cluster-signing-key-file={}",
                    ca_key_path.display()
                ))
                .arg(format!("--root-ca-file={}", ca_path.display()))
                .arg(format!(
                    "--service-account-private-key-file={}",
                    sa_path.display()
                ))
                .arg("--use-service-account-credentials=true")
                .arg("--leader-elect=false")
                // Nothing scrapes it here: no port to find or to secure.
                .arg("--secure-port=0")
                .arg("--v=1");
            children.push(spawn(
                "kube-controller-manager",
                kcm,
                &kcm_log,
                opts.lifetime,
            )?);
            names.push("kube-controller-manager");
        }

        if opts.lifetime == Lifetime::Detached {
            let pids: String = children
                .iter()
                .zip(names)
                .map(|(c, name)| format!("{name} {}\n", c.id()))
                .collect();
            let path = dir.join(PIDS_FILE);
            fs::write(&path, pids).map_err(io_err("writing", &path))?;
        }

        let kubeconfig = admin_kubeconfig(&server, &ca.cert_pem(), &admin)?;
        let kubeconfig_path = dir.join("kubeconfig");
        let yaml = serde_yaml::to_string(&kubeconfig)
            .map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))?;
        fs::write(&kubeconfig_path, yaml).map_err(io_err("writing", &kubeconfig_path))?;

        let mut cp = ControlPlane {
            data_dir: dir.clone(),
            kubeconfig_path,
            server,
            kubeconfig,
            ca_pem: ca.cert_pem(),
            children,
        };
        cp.wait_ready(&etcd_log, &api_log).await?;
        if opts.lifetime == Lifetime::Detached {
            // The processes outlive us; forget the handles so Drop does not stop them.
            cp.children.clear();
        }
        Ok(cp)
    }

    async fn wait_ready(
        &mut self,
        etcd_log: &Path,
        api_log: &Path,
    ) -> Result<(), ControlPlaneError> {
        let client = self.client().await?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            for (child, name, log) in self
                .children
                .iter_mut()
                .zip([("etcd", etcd_log), ("kube-apiserver", api_log)])
                .map(|(c, (n, l))| (c, n, l))
            {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(ControlPlaneError::Exited {
                        name,
                        status: status.to_string(),
                        log: log.to_path_buf(),
                        tail: tail(log, 15),
                    });
                }
            }
            let request = http::Request::get("/readyz").body(Vec::new());
            if let Ok(request) = request
                && let Ok(body) = client.request_text(request).await
                && body.trim() == "ok"
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ControlPlaneError::NotReady {
                    log: api_log.to_path_buf(),
                    tail: tail(api_log, 15),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A new client for this control plane. Each tokio runtime needs its own client.
    pub async fn client(&self) -> Result<kube::Client, ControlPlaneError> {
        client_from_kubeconfig(self.kubeconfig.clone()).await
    }

    /// Stops the processes this handle owns and waits for them to exit.
    /// The processes' ids (etcd, then kube-apiserver), for benchmarks that measure them.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }

    pub fn stop(mut self) {
        self.stop_children();
    }

    fn stop_children(&mut self) {
        for child in self.children.iter_mut().rev() {
            terminate(child.id());
        }
        for child in self.children.iter_mut() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.children.clear();
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop_children();
    }
}

pub async fn client_from_kubeconfig(
    kubeconfig: Kubeconfig,
) -> Result<kube::Client, ControlPlaneError> {
    client_with_retries(kubeconfig, true).await
}

/// A client whose requests are not retried on 429/503/504 by kube's middleware. The eviction API
/// answers 429 when a PodDisruptionBudget refuses, and kube's default policy would then sleep
/// for minutes inside one request; the drain retries on its own schedule instead.
pub async fn client_with_retries(
    kubeconfig: Kubeconfig,
    retries: bool,
) -> Result<kube::Client, ControlPlaneError> {
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))?;
    config.default_retry = retries;
    kube::Client::try_from(config).map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))
}

fn admin_kubeconfig(
    server: &str,
    ca_pem: &str,
    admin: &pki::CertAndKey,
) -> Result<Kubeconfig, ControlPlaneError> {
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let value = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "metalboot-local", "cluster": {
            "server": server, "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": "metalboot-admin", "user": {
            "client-certificate-data": b64(&admin.cert_pem),
            "client-key-data": b64(&admin.key_pem)}}],
        "contexts": [{"name": "metalboot-local", "context": {
            "cluster": "metalboot-local", "user": "metalboot-admin", "namespace": "default"}}],
        "current-context": "metalboot-local",
    });
    serde_json::from_value(value).map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))
}

/// Stops a detached control plane started in `data_dir`: exactly the recorded processes, and
/// only while they still run our binaries (a recycled pid is left alone). Returns what it stopped.
pub fn stop_detached(data_dir: &Path, bin_dir: &Path) -> Result<Vec<String>, ControlPlaneError> {
    let path = data_dir.join(PIDS_FILE);
    let text =
        fs::read_to_string(&path).map_err(|_| ControlPlaneError::NothingToStop(path.clone()))?;
    let mut stopped = Vec::new();
    let mut pids = Vec::new();
    for line in text.lines() {
        let Some((name, pid)) = line.split_once(' ') else {
            continue;
        };
        let Ok(pid) = pid.trim().parse::<i32>() else {
            continue;
        };
        let want = fs::canonicalize(bin_dir.join(name)).ok();
        let running = fs::read_link(format!("/proc/{pid}/exe")).ok();
        if want.is_some() && running == want {
            terminate(pid as u32);
            pids.push(pid);
            stopped.push(format!("{name} (pid {pid})"));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while pids
        .iter()
        .any(|p| Path::new(&format!("/proc/{p}")).exists())
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    for pid in &pids {
        if Path::new(&format!("/proc/{pid}")).exists() {
            // SAFETY: kill(2) on a pid we started and verified above.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
        }
    }
    let _ = fs::remove_file(&path);
    Ok(stopped)
}

fn terminate(pid: u32) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
}

/// The last `n` lines of a log file, for error messages.
pub fn tail(path: &Path, n: usize) -> String {
    let Ok(file) = fs::File::open(path) else {
        return format!("({} not readable)", path.display());
    };
    let lines: Vec<String> = io::BufReader::new(file)
        .lines()
        .map_while(Result::ok)
        .collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process; test
/// harnesses run every test on a short-lived thread. So tied children are forked from one thread
/// that lives as long as the process.
fn spawner() -> &'static Mutex<mpsc::Sender<SpawnRequest>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("control-plane-spawner".into())
            .spawn(move || {
                for (mut command, reply) in rx {
                    let _ = reply.send(command.spawn());
                }
            })
            .map(|_| ())
            .unwrap_or_else(
                |e| tracing::error!(error = %e, "cannot start the control-plane spawner thread"),
            );
        Mutex::new(tx)
    })
}

static TIED_PIDS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static DIRS_TO_REMOVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

extern "C" fn kill_tied_children_at_exit() {
    if let Ok(pids) = TIED_PIDS.lock() {
        for pid in pids.iter() {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        if !pids.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    if let Ok(dirs) = DIRS_TO_REMOVE.lock() {
        for dir in dirs.iter() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}

fn register_at_exit() {
    // SAFETY: registering a plain extern "C" function.
    AT_EXIT.call_once(|| unsafe {
        libc::atexit(kill_tied_children_at_exit);
    });
}

/// Removes `dir` when this process exits, after the tied processes are killed.
pub fn remove_at_exit(dir: &Path) {
    register_at_exit();
    if let Ok(mut dirs) = DIRS_TO_REMOVE.lock() {
        dirs.push(dir.to_path_buf());
    }
}

/// Starts `command` with its output in `log`; a tied child dies with this process.
pub fn spawn(
    name: &'static str,
    mut command: Command,
    log: &Path,
    lifetime: Lifetime,
) -> Result<Child, ControlPlaneError> {
    let out = fs::File::create(log).map_err(io_err("creating log", log))?;
    let err = out.try_clone().map_err(io_err("opening log", log))?;
    command.stdin(Stdio::null()).stdout(out).stderr(err);
    match lifetime {
        Lifetime::TiedToThisProcess => {
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            register_at_exit();
            let (tx, rx) = mpsc::channel();
            let sent = spawner()
                .lock()
                .map(|s| s.send((command, tx)).is_ok())
                .unwrap_or(false);
            let child = if sent {
                rx.recv().unwrap_or_else(|_| {
                    Err(io::Error::other("control-plane spawner thread is gone"))
                })
            } else {
                Err(io::Error::other("control-plane spawner thread is gone"))
            }
            .map_err(io_err("starting", Path::new(name)))?;
            if let Ok(mut pids) = TIED_PIDS.lock() {
                pids.push(child.id());
            }
            Ok(child)
        }
        Lifetime::Detached => {
            // SAFETY: setsid is async-signal-safe.
            unsafe {
                command.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
            command.spawn().map_err(io_err("starting", Path::new(name)))
        }
    }
}

/// The kubeadm configuration of the init phases. The token is quoted: one made of digits only,
/// or of digits with a single `e`, is a YAML number, which kubeadm read back shortened and then
/// refused as malformed (seen once in CI: "773355.988232015").
fn kubeadm_init_config(token: &str, host: &str, port: u16, kubernetes_version: &str) -> String {
    format!(
        "apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
bootstrapTokens:
- token: \"{token}\"
  ttl: 15m0s
  groups: [system:bootstrappers:kubeadm:default-node-token]
  usages: [signing, authentication]
localAPIEndpoint:
  advertiseAddress: {QEMU_HOST_ADDRESS}
nodeRegistration:
  name: control-plane
  criSocket: unix:///run/containerd/containerd.sock
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: {kubernetes_version}
controlPlaneEndpoint: {host}:{port}
networking:
  podSubnet: 10.244.0.0/16
"
    )
}

/// `kubeadm init phase upload-config all` and `kubeadm init phase bootstrap-token` through the
/// admin `kubeconfig`, with one bootstrap `token` (15 minutes) and the cluster's control-plane
/// `endpoint`. kubeadm refuses a loopback advertise address, so it is told 10.0.2.2; the phases
/// connect through the kubeconfig only.
pub fn kubeadm_init_phases(
    bin_dir: &Path,
    kubeconfig: &Path,
    endpoint: (&str, u16),
    token: &str,
    dir: &Path,
) -> Result<(), ControlPlaneError> {
    let (host, port) = endpoint;
    let config = dir.join("kubeadm-init.yaml");
    let text = kubeadm_init_config(token, host, port, kubernetes_version());
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    // It names the token: readable by this user only (created so, never widened).
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&config)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(io_err("writing", &config))?;
    }
    let kubeadm = bin_dir.join("kubeadm");
    for phase in [
        &["init", "phase", "upload-config", "all"][..],
        &["init", "phase", "bootstrap-token"][..],
    ] {
        let out = Command::new(&kubeadm)
            .args(phase)
            .arg(format!("--config={}", config.display()))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .output()
            .map_err(io_err("running", &kubeadm))?;
        // Its stdout names the token ("Using token: …"), so only stderr goes into the error.
        if !out.status.success() {
            return Err(ControlPlaneError::Joins(format!(
                "kubeadm {}: {}",
                phase.join(" "),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
    }

    Ok(())
}

/// What `kubeadm init` leaves on a control plane for joining nodes, made by the real kubeadm's
/// phases through the admin `kubeconfig`: `upload-config all` (the kubeadm and kubelet
/// ConfigMaps) and `bootstrap-token` (the RBAC that lets bootstrap tokens join and
/// `cluster-info`), then `cluster-info` pointed at `endpoint`, where joining hosts reach the
/// apiserver. kubeadm refuses a loopback advertise address, so it is told 10.0.2.2 (the phases
/// connect through the kubeconfig only). The phases need one token; it lives 15 minutes and is
/// what shows that kube-controller-manager signed the moved `cluster-info` again.
pub async fn prepare_for_joins(
    client: &kube::Client,
    bin_dir: &Path,
    kubeconfig: &Path,
    endpoint: (&str, u16),
    dir: &Path,
) -> Result<(), ControlPlaneError> {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::Api;

    let fail = |what: &str| ControlPlaneError::Joins(what.to_string());
    let (host, port) = endpoint;
    let token = crate::boot::tokens::Token::mint();
    // kubeadm's token form: [a-z0-9]{6}.[a-z0-9]{16}.
    let alphabet: String = token
        .expose()
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        .collect();
    if alphabet.len() < 22 {
        return Err(fail("a minted token is too short for a kubeadm token"));
    }
    let token = format!("{}.{}", &alphabet[..6], &alphabet[6..22]);
    let token_id = &token[..6];
    // kubeadm runs twice as a child process: off the async workers, which serve the lab too.
    {
        let (bin_dir, kubeconfig, dir) = (
            bin_dir.to_path_buf(),
            kubeconfig.to_path_buf(),
            dir.to_path_buf(),
        );
        let (host, token) = (host.to_string(), token.clone());
        tokio::task::spawn_blocking(move || {
            kubeadm_init_phases(&bin_dir, &kubeconfig, (&host, port), &token, &dir)
        })
        .await
        .map_err(|e| ControlPlaneError::Joins(format!("the kubeadm phases' task: {e}")))??;
    }

    let public: Api<ConfigMap> = Api::namespaced(client.clone(), "kube-public");
    let signature = |cm: &ConfigMap| -> Option<String> {
        cm.data
            .as_ref()
            .and_then(|d| d.get(&format!("jws-kubeconfig-{token_id}")))
            .cloned()
    };
    // Signed by kube-controller-manager's bootstrap signer, then moved, then signed again.
    let signed = |previous: Option<String>| {
        let public = public.clone();
        async move {
            for _ in 0..240 {
                if let Ok(Some(cm)) = public.get_opt("cluster-info").await
                    && signature(&cm).is_some()
                    && signature(&cm) != previous
                {
                    return Ok(cm);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(ControlPlaneError::Joins(
                "kube-controller-manager did not sign cluster-info within 2 minutes".into(),
            ))
        }
    };
    let info = signed(None).await?;
    let first = signature(&info);
    let current = info
        .data
        .as_ref()
        .and_then(|d| d.get("kubeconfig"))
        .ok_or_else(|| fail("cluster-info has no kubeconfig"))?;
    let moved = cluster_info_for_server(current, &format!("https://{host}:{port}"))?;
    if &moved != current {
        // Only the kubeconfig key: the signer may add or drop signatures meanwhile.
        public
            .patch(
                "cluster-info",
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(serde_json::json!({"data": {"kubeconfig": moved}})),
            )
            .await
            .map_err(|e| ControlPlaneError::Joins(format!("pointing cluster-info: {e}")))?;
        signed(first).await?;
    }
    Ok(())
}

/// `cluster-info`'s kubeconfig with every cluster's server set to `server`. kubeadm writes there
/// the server its own kubeconfig names, which joining hosts may not reach (the lab's is loopback);
/// once the ConfigMap holds this, kube-controller-manager's bootstrap signer signs it again.
pub fn cluster_info_for_server(
    kubeconfig_yaml: &str,
    server: &str,
) -> Result<String, ControlPlaneError> {
    let mut config: Kubeconfig = serde_yaml::from_str(kubeconfig_yaml)
        .map_err(|e| ControlPlaneError::Kubeconfig(format!("cluster-info: {e}")))?;
    let mut pointed = 0;
    for named in &mut config.clusters {
        if let Some(cluster) = named.cluster.as_mut() {
            cluster.server = Some(server.to_string());
            pointed += 1;
        }
    }
    if pointed == 0 {
        return Err(ControlPlaneError::Kubeconfig(
            "cluster-info names no cluster".into(),
        ));
    }
    serde_yaml::to_string(&config).map_err(|e| ControlPlaneError::Kubeconfig(e.to_string()))
}

#[cfg(test)]
mod cluster_info_tests {
    use super::*;

    /// What `kubeadm init phase bootstrap-token` writes into cluster-info.
    const KUBEADM_CLUSTER_INFO: &str = "apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: Q0EK
    server: https://127.0.0.1:6443
  name: \"\"
contexts: null
current-context: \"\"
kind: Config
preferences: {}
users: null
";

    #[test]
    fn cluster_info_points_at_the_given_server_and_keeps_the_ca() {
        /// (server, CA line) the output must show, or words of the error.
        type Want = Result<(&'static str, &'static str), &'static str>;
        let rows: &[(&str, Want)] = &[
            (
                KUBEADM_CLUSTER_INFO,
                Ok(("https://10.0.2.2:6443", "certificate-authority-data: Q0EK")),
            ),
            (
                "apiVersion: v1\nkind: Config\nclusters: []\n",
                Err("no cluster"),
            ),
            ("clusters: [", Err("cluster-info:")),
        ];
        for (input, want) in rows {
            let got = cluster_info_for_server(input, "https://10.0.2.2:6443");
            match (want, got) {
                (Ok((server, ca)), Ok(out)) => {
                    assert!(out.contains(&format!("server: {server}")), "{out}");
                    assert!(out.contains(ca), "{out}");
                    assert!(!out.contains("127.0.0.1"), "{out}");
                }
                (Err(words), Err(e)) => assert!(e.to_string().contains(words), "{e}"),
                (want, got) => panic!("{input:?}: want {want:?}, got {got:?}"),
            }
        }
    }
}

#[cfg(test)]
mod kubeadm_config_tests {
    use super::*;

    /// A token of digits only (or digits with one `e`) stays a string, as kubeadm needs it.
    #[test]
    fn a_token_that_looks_like_a_number_stays_a_string() {
        for token in [
            "773355.9882320150123456",
            "773355.98e2320150123456",
            "abcdef.0123456789abcdef",
        ] {
            let text = kubeadm_init_config(token, "10.77.0.2", 6443, "v1.36.3");
            let init: serde_yaml::Value = serde::Deserialize::deserialize(
                serde_yaml::Deserializer::from_str(&text)
                    .next()
                    .expect("the InitConfiguration document"),
            )
            .expect("valid YAML");
            assert_eq!(
                init["bootstrapTokens"][0]["token"].as_str(),
                Some(token),
                "{token} read back as {:?}",
                init["bootstrapTokens"][0]["token"]
            );
        }
    }
}

#[cfg(test)]
mod port_race_tests {
    use super::*;

    /// A process that exited because its port was taken is started again; any other exit is
    /// reported. The apiserver's line is the one a fresh-clone CI run failed on (2026-11-30).
    #[test]
    fn only_a_taken_port_makes_the_start_again() {
        let exited = |tail: &str| ControlPlaneError::Exited {
            name: "kube-apiserver",
            status: "exit status: 1".into(),
            log: PathBuf::from("kube-apiserver.log"),
            tail: tail.into(),
        };
        let apiserver = r#"E1130 21:36:33.095928    4133 run.go:72] "command failed" err="failed to create listener: failed to listen on 127.0.0.1:41265: listen tcp 127.0.0.1:41265: bind: address already in use""#;
        let etcd = r#"{"level":"fatal","msg":"discovery failed","error":"listen tcp 127.0.0.1:40123: bind: address already in use"}"#;
        assert!(exited(apiserver).lost_a_port());
        assert!(exited(etcd).lost_a_port());
        assert!(!exited("E1130 open /nonexistent/ca.crt: no such file or directory").lost_a_port());
        assert!(
            !ControlPlaneError::NotReady {
                log: PathBuf::from("kube-apiserver.log"),
                tail: "address already in use".into(),
            }
            .lost_a_port(),
            "a control plane that never got ready is not started again"
        );
    }
}

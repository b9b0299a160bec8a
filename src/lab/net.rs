//! The lab's provisioning network: a Layer-2 segment that exists only inside network namespaces
//! the lab creates, so real firmware does real DHCP, PXE and TFTP without touching the machine's
//! own network.
//!
//! ```text
//!  netns <name>:          br0 10.77.0.2/24 ── metalboot's boot sockets (HTTP, TFTP, proxyDHCP)
//!                          ├── tap<i> ── QEMU host i (QEMU runs in this namespace)
//!                          └── site0 ──veth── netns <name>-site: site1 10.77.0.1/24, dnsmasq
//! ```
//!
//! dnsmasq plays the site's DHCP server (addresses only, no PXE options), as operators usually
//! do not own it; metalboot answers the boot clients with proxyDHCP. Same addresses in every lab
//! or test: each lives in namespaces of its own. Needs root (or CAP_NET_ADMIN), `ip`, `/dev/net/tun`
//! and dnsmasq (Debian `iproute2`, `dnsmasq-base`). Dropping the network kills dnsmasq and deletes
//! both namespaces, which deletes every interface in them.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::boot::netns::NetNamespace;

pub const BRIDGE: &str = "br0";
pub const BOOT_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
pub const SITE_IP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
/// The site server's pool.
pub const POOL: (Ipv4Addr, Ipv4Addr) =
    (Ipv4Addr::new(10, 77, 0, 100), Ipv4Addr::new(10, 77, 0, 199));

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("`{command}` failed: {message}")]
    Command { command: String, message: String },
    #[error("dnsmasq: {0}")]
    Dnsmasq(String),
}

pub struct LabNetwork {
    /// The provisioning network's namespace (bridge, taps, metalboot's sockets, QEMU).
    pub netns: String,
    /// The site DHCP server's namespace.
    pub site_netns: String,
    dnsmasq: Vec<Child>,
    pub dnsmasq_log: Option<PathBuf>,
    pub dnsmasq_leases: Option<PathBuf>,
    /// Namespaces of other machines on the bridge (tests: clients, a rogue server).
    peers: Vec<String>,
}

/// Runs `ip <args>`; a clear error with ip's own message when it fails.
fn ip(args: &[&str]) -> Result<(), NetError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetError::Command {
            command: format!("ip {}", args.join(" ")),
            message: e.to_string(),
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(NetError::Command {
        command: format!("ip {}", args.join(" ")),
        message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

impl LabNetwork {
    /// Creates the namespaces, the bridge and the site link; deletes leftovers of the same name
    /// first (a lab killed hard).
    pub fn create(name: &str) -> Result<Self, NetError> {
        let site = format!("{name}-site");
        for ns in [name, site.as_str()] {
            let _ = ip(&["netns", "del", ns]);
        }
        let net = LabNetwork {
            netns: name.to_string(),
            site_netns: site.clone(),
            dnsmasq: Vec::new(),
            dnsmasq_log: None,
            dnsmasq_leases: None,
            peers: Vec::new(),
        };
        let boot = format!("{BOOT_IP}/24");
        let site_addr = format!("{SITE_IP}/24");
        let steps: [&[&str]; 11] = [
            &["netns", "add", name],
            &["netns", "add", &site],
            &["-n", name, "link", "set", "lo", "up"],
            &["-n", &site, "link", "set", "lo", "up"],
            &["-n", name, "link", "add", BRIDGE, "type", "bridge"],
            &["-n", name, "addr", "add", &boot, "dev", BRIDGE],
            &["-n", name, "link", "set", BRIDGE, "up"],
            &[
                "-n", name, "link", "add", "site0", "type", "veth", "peer", "name", "site1",
                "netns", &site,
            ],
            &["-n", name, "link", "set", "site0", "master", BRIDGE, "up"],
            &["-n", &site, "addr", "add", &site_addr, "dev", "site1"],
            &["-n", &site, "link", "set", "site1", "up"],
        ];
        for step in steps {
            ip(step)?;
        }
        Ok(net)
    }

    /// The provisioning namespace, for the boot service's sockets.
    pub fn namespace(&self) -> std::io::Result<NetNamespace> {
        NetNamespace::open(&self.netns)
    }

    /// A tap device on the bridge for one QEMU host.
    pub fn add_tap(&self, tap: &str) -> Result<(), NetError> {
        ip(&[
            "-n",
            &self.netns,
            "tuntap",
            "add",
            "dev",
            tap,
            "mode",
            "tap",
        ])?;
        self.attach(tap)
    }

    /// Puts `port` (in the provisioning namespace) on the bridge and up.
    fn attach(&self, port: &str) -> Result<(), NetError> {
        ip(&[
            "-n",
            &self.netns,
            "link",
            "set",
            port,
            "master",
            BRIDGE,
            "up",
        ])
    }

    /// Starts the site's DHCP server: dnsmasq, DHCP only (no DNS, no TFTP, no PXE options).
    pub fn start_site_dhcp(&mut self, dir: &Path) -> Result<(), NetError> {
        let range = format!("--dhcp-range={},{},255.255.255.0,1h", POOL.0, POOL.1);
        let (log, leases) =
            self.start_dnsmasq(&self.site_netns.clone(), "site1", dir, "dnsmasq", &[&range])?;
        self.dnsmasq_log = Some(log);
        self.dnsmasq_leases = Some(leases);
        Ok(())
    }

    /// Another machine on the bridge: namespace `<netns>-<suffix>` with `eth0` on a veth into
    /// the bridge, with `address` (CIDR) or none. Returns the namespace's name.
    pub fn add_peer(&mut self, suffix: &str, address: Option<&str>) -> Result<String, NetError> {
        let ns = format!("{}-{suffix}", self.netns);
        let _ = ip(&["netns", "del", &ns]);
        ip(&["netns", "add", &ns])?;
        self.peers.push(ns.clone());
        let port: String = format!("p-{suffix}").chars().take(15).collect();
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            &self.netns,
            "link",
            "add",
            &port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            &ns,
        ])?;
        self.attach(&port)?;
        if let Some(address) = address {
            ip(&["-n", &ns, "addr", "add", address, "dev", "eth0"])?;
        }
        ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        Ok(ns)
    }

    /// dnsmasq as a DHCP server in `netns` on `interface`, with `args` (a range, options);
    /// returns its log and lease file. It dies with this network.
    pub fn start_dnsmasq(
        &mut self,
        netns: &str,
        interface: &str,
        dir: &Path,
        name: &str,
        args: &[&str],
    ) -> Result<(PathBuf, PathBuf), NetError> {
        std::fs::create_dir_all(dir).map_err(|e| NetError::Dnsmasq(e.to_string()))?;
        let log = dir.join(format!("{name}.log"));
        let leases = dir.join(format!("{name}.leases"));
        let _ = std::fs::remove_file(&leases);
        // dnsmasq appends: an old log's `started` would pass for this one's.
        let _ = std::fs::remove_file(&log);
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "dnsmasq"])
            .args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-hosts",
                "--no-resolv",
            ])
            .args(["--port=0", "--bind-interfaces", "--user=root"])
            .arg(format!("--interface={interface}"))
            .args(args)
            .arg(format!("--dhcp-leasefile={}", leases.display()))
            .arg(format!("--log-facility={}", log.display()))
            .arg("--log-dhcp")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| {
                NetError::Dnsmasq(format!("starting dnsmasq (package dnsmasq-base): {e}"))
            })?;
        self.dnsmasq.push(child);
        self.wait_for_dnsmasq(&log)?;
        Ok((log, leases))
    }

    /// Waits for the dnsmasq just started to log `started`, which it does after binding its
    /// sockets: a DISCOVER sent before that is lost, and a client's first one would go
    /// unanswered. An exit or 20 s of silence is an error with the log's tail.
    fn wait_for_dnsmasq(&mut self, log: &Path) -> Result<(), NetError> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if text.contains("started, version") {
                return Ok(());
            }
            let exited = match self.dnsmasq.last_mut() {
                Some(child) => child.try_wait().ok().flatten(),
                None => None,
            };
            let tail = || text.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            if let Some(status) = exited {
                return Err(NetError::Dnsmasq(format!("exited ({status}): {}", tail())));
            }
            if std::time::Instant::now() > deadline {
                return Err(NetError::Dnsmasq(format!(
                    "not started within 20 s: {}",
                    tail()
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// `ip netns exec <provisioning namespace>`: the prefix for a process on the bridge.
    pub fn exec_prefix(&self) -> Vec<String> {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            self.netns.clone(),
        ]
    }
}

impl Drop for LabNetwork {
    fn drop(&mut self) {
        for child in &mut self.dnsmasq {
            let _ = child.kill();
            let _ = child.wait();
        }
        for peer in &self.peers {
            let _ = ip(&["netns", "del", peer]);
        }
        let _ = ip(&["netns", "del", &self.netns]);
        let _ = ip(&["netns", "del", &self.site_netns]);
    }
}

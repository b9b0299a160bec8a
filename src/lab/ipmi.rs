//! A lab host behind an IPMI BMC: OpenIPMI's `ipmi_sim` (Debian `openipmi`) speaks IPMI 2.0 over
//! LAN on loopback, and its chassis-control program turns each chassis command into a call to
//! the lab's virtual Redfish BMC, which drives the QEMU host. So metalboot's IPMI driver
//! (ipmitool, RMCP+) really powers and boots a lab host, and a lab mixes Redfish and IPMI hosts.

use std::path::Path;
use std::process::Stdio;

use tokio::process::{Child, Command};

/// A running ipmi_sim for one lab host; it stops when dropped.
pub struct IpmiFront {
    _child: Child,
    pub port: u16,
}

impl IpmiFront {
    pub fn address(&self) -> String {
        format!("ipmi://127.0.0.1:{}", self.port)
    }
}

/// Whether this machine can run IPMI lab hosts.
pub fn available() -> bool {
    ["ipmi_sim", "ipmitool", "curl"].iter().all(|tool| {
        std::env::var_os("PATH")
            .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).is_file()))
    })
}

/// Starts ipmi_sim for `system` (a system of the virtual BMC at `redfish_base`, e.g.
/// `http://127.0.0.1:8000`), with the IPMI user `ipmi_user`/`ipmi_password`.
pub fn start(
    dir: &Path,
    system: &str,
    redfish_base: &str,
    redfish_credentials: (&str, &str),
    ipmi_credentials: (&str, &str),
) -> std::io::Result<IpmiFront> {
    std::fs::create_dir_all(dir)?;
    // curl reads the virtual BMC's credentials from a file only this user can read, never from
    // its command line.
    let curl_config = dir.join("curl.conf");
    std::fs::write(
        &curl_config,
        format!(
            "user = \"{}:{}\"\nsilent\nfail\nmax-time = 20\n",
            redfish_credentials.0, redfish_credentials.1
        ),
    )?;
    std::fs::set_permissions(
        &curl_config,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )?;
    let script = dir.join("chassis-control.sh");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
# ipmi_sim's chassis control for lab host {system}: IPMI chassis commands become Redfish calls to
# the lab's virtual BMC. Called as: <script> <mc> get <parm>... | set <parm> <value>...
system="{redfish_base}/redfish/v1/Systems/{system}"
cfg="{cfg}"
log="{log}"
reset() {{ curl -K "$cfg" -X POST -H 'Content-Type: application/json' -d "{{\"ResetType\":\"$1\"}}" "$system/Actions/ComputerSystem.Reset" >/dev/null; }}
boot() {{ curl -K "$cfg" -X PATCH -H 'Content-Type: application/json' -d "{{\"Boot\":{{\"BootSourceOverrideTarget\":\"$1\",\"BootSourceOverrideEnabled\":\"$2\"}}}}" "$system" >/dev/null; }}
shift
op=$1; shift
echo "$op $*" >> "$log"
case $op in
  get) for p in "$@"; do case $p in
         power) case $(curl -K "$cfg" "$system") in *'"PowerState":"On"'*) echo power:1;; *) echo power:0;; esac;;
         boot) echo boot:default;;
       esac; done;;
  set) while [ -n "$1" ]; do p=$1; v=$2; shift 2; case $p:$v in
         power:1) reset On || exit 1;;
         power:0) reset ForceOff || exit 1;;
         shutdown:1) reset GracefulShutdown || exit 1;;
         reset:1) reset ForceRestart || exit 1;;
         boot:pxe) boot Pxe Once || exit 1;;
         boot:default|boot:none) boot None Disabled || exit 1;;
       esac; done;;
  *) exit 1;;
esac
"#,
            cfg = curl_config.display(),
            log = dir.join("chassis.log").display(),
        ),
    )?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    start_simulator(dir, system, &script, ipmi_credentials)
}

/// Starts OpenIPMI's `ipmi_sim` in `dir` on a free loopback port: one management controller,
/// RMCP+ on the LAN, one admin user, and `chassis_control` as its chassis-control program
/// (`<program> 0x20 get|set <parm> [<value>]…`). The lab passes a program that drives a QEMU
/// host through the virtual BMC; tests pass one that records the calls.
pub fn start_simulator(
    dir: &Path,
    name: &str,
    chassis_control: &Path,
    (user, password): (&str, &str),
) -> std::io::Result<IpmiFront> {
    std::fs::create_dir_all(dir.join("state"))?;
    let port = std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let lan = dir.join("lan.conf");
    std::fs::write(
        &lan,
        format!(
            r#"name "{name}"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 {port}
    priv_limit admin
    allowed_auths_callback none md2 md5 straight
    allowed_auths_user none md2 md5 straight
    allowed_auths_operator none md2 md5 straight
    allowed_auths_admin none md2 md5 straight
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "{script} 0x20"
  user 2 true  "{user}" "{password}" admin 10 none md2 md5 straight
"#,
            script = chassis_control.display(),
        ),
    )?;
    std::fs::set_permissions(&lan, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    // Without an added and enabled management controller the LAN interface never opens.
    let emu = dir.join("sim.emu");
    std::fs::write(
        &emu,
        "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr\nmc_enable 0x20\n",
    )?;
    let child = Command::new("ipmi_sim")
        .arg("-c")
        .arg(&lan)
        .arg("-f")
        .arg(&emu)
        .arg("-s")
        .arg(dir.join("state"))
        .arg("-n")
        .stdin(Stdio::null())
        .stdout(Stdio::from(std::fs::File::create(
            dir.join("ipmi_sim.log"),
        )?))
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    Ok(IpmiFront {
        _child: child,
        port,
    })
}

//! OpenIPMI's `ipmi_sim` (Debian `openipmi`) as a real IPMI 2.0 BMC on loopback: RMCP+ sessions,
//! users, cipher suites, chassis commands. Its chassis control program is a small script that
//! keeps power and boot device in files and logs every call, so a test sees what reached the
//! "hardware".

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub const USER: &str = "admin";
pub const PASSWORD: &str = "ipmi-s3cret-pw";

pub struct IpmiSim {
    child: Child,
    pub port: u16,
    pub dir: PathBuf,
}

impl IpmiSim {
    pub fn address(&self) -> String {
        format!("ipmi://127.0.0.1:{}", self.port)
    }

    /// Every chassis-control call ipmi_sim made, e.g. `set power 1`, `set boot pxe`.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.join("calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    pub fn power(&self) -> String {
        std::fs::read_to_string(self.dir.join("power"))
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "0".into())
    }
}

impl Drop for IpmiSim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("a free UDP port")
}

/// Starts ipmi_sim in `dir`; returns once it answers on its LAN port.
pub async fn start(dir: &Path) -> IpmiSim {
    std::fs::create_dir_all(dir.join("state")).expect("state dir");
    let port = free_udp_port();
    let script = dir.join("chassis.sh");
    std::fs::write(
        &script,
        r#"#!/bin/sh
dir=$(dirname "$0")
shift
op=$1; shift
echo "$op $*" >> "$dir/calls.log"
case $op in
  get) for p in "$@"; do case $p in
         power) echo "power:$(cat "$dir/power" 2>/dev/null || echo 0)";;
         boot) echo "boot:$(cat "$dir/boot" 2>/dev/null || echo default)";;
       esac; done;;
  set) while [ -n "$1" ]; do p=$1; v=$2; shift 2; case $p in
         power) echo "$v" > "$dir/power";;
         boot) echo "$v" > "$dir/boot";;
         shutdown) [ "$v" = 1 ] && echo 0 > "$dir/power";;
       esac; done;;
  *) exit 1;;
esac
"#,
    )
    .expect("chassis script");
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    std::fs::write(
        dir.join("lan.conf"),
        format!(
            r#"name "metalboot-test"
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
  user 2 true  "{USER}" "{PASSWORD}" admin 10 none md2 md5 straight
"#,
            script = script.display()
        ),
    )
    .expect("lan.conf");
    // The management controller must be added and enabled, or the LAN interface never opens.
    std::fs::write(
        dir.join("sim.emu"),
        "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr\nmc_enable 0x20\n",
    )
    .expect("sim.emu");
    let child = Command::new("ipmi_sim")
        .arg("-c")
        .arg(dir.join("lan.conf"))
        .arg("-f")
        .arg(dir.join("sim.emu"))
        .arg("-s")
        .arg(dir.join("state"))
        .arg("-n")
        .stdin(Stdio::null())
        .stdout(Stdio::from(
            std::fs::File::create(dir.join("ipmi_sim.log")).expect("log"),
        ))
        .stderr(Stdio::null())
        .spawn()
        .expect("ipmi_sim (Debian openipmi)");
    let sim = IpmiSim {
        child,
        port,
        dir: dir.to_path_buf(),
    };
    // Up when a session opens: ipmitool's own answer, the positive signal.
    crate::support::eventually("ipmi_sim to answer on its LAN port", 20, || async {
        let out = tokio::process::Command::new("ipmitool")
            .args(["-I", "lanplus", "-C", "3", "-H", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .args(["-U", USER, "-E", "-N", "1", "-R", "1", "mc", "info"])
            .env("IPMI_PASSWORD", PASSWORD)
            .output()
            .await
            .ok()?;
        out.status.success().then_some(())
    })
    .await;
    sim
}

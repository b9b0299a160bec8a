//! OpenIPMI's `ipmi_sim` (Debian `openipmi`) as a real IPMI 2.0 BMC on loopback: RMCP+ sessions,
//! users, cipher suites, chassis commands. Its chassis control program is a small script that
//! keeps power and boot device in files and logs every call, so a test sees what reached the
//! "hardware".

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use metalboot::lab::ipmi::IpmiFront;

pub const USER: &str = "admin";
pub const PASSWORD: &str = "ipmi-s3cret-pw";

pub struct IpmiSim {
    front: IpmiFront,
    pub port: u16,
    pub dir: PathBuf,
}

impl IpmiSim {
    pub fn address(&self) -> String {
        self.front.address()
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

/// Starts ipmi_sim in `dir`; returns once it answers on its LAN port.
pub async fn start(dir: &Path) -> IpmiSim {
    std::fs::create_dir_all(dir).expect("dir");
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
    let front =
        metalboot::lab::ipmi::start_simulator(dir, "metalboot-test", &script, (USER, PASSWORD))
            .expect("ipmi_sim (Debian openipmi)");
    let port = front.port;
    let sim = IpmiSim {
        front,
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

//! IPMI over LAN (RMCP+, "lanplus") for hosts whose BMC speaks no Redfish. Driven through
//! `ipmitool`, as Ironic and bmclib do: it is what the field runs against every vendor's quirks,
//! and no maintained Rust crate speaks RMCP+ (checked: the IPMI crates on crates.io are in-band
//! or unmaintained).
//!
//! - Address `ipmi://host[:port]` (port 623 by default).
//! - The password reaches ipmitool through its environment (`-E`, `IPMI_PASSWORD`), never its
//!   command line, which any local user can read in `/proc`.
//! - Cipher suite 17 (SHA-256, AES) first, 3 (SHA-1, AES) when the BMC refuses 17's algorithms;
//!   the suite that worked is kept for this BMC.
//! - One command at a time per BMC; each is bounded: ipmitool's own retries (`-R 2`, `-N 2`) and
//!   a hard timeout that kills it.
//! - A power action is chosen from the observed state: a cycle of a host that is off powers it
//!   on (IPMI refuses to cycle an off chassis on many BMCs).

use std::time::Duration;

use tokio::process::Command;
use tokio::sync::Mutex;

use super::{
    Bmc, BmcCapabilities, BmcError, BmcFuture, BootDevice, BootMode, BootOverride, Credentials,
    HardwareInventory, PowerAction, PowerState, Unreachable,
};

/// Suites tried in order until one is accepted.
const CIPHER_SUITES: [u8; 2] = [17, 3];

pub struct IpmiBmc {
    /// `ipmi://host:port`, for messages.
    address: String,
    host: String,
    port: u16,
    credentials: Credentials,
    timeout: Duration,
    /// The cipher suite this BMC accepted, once known; the gate of one command at a time.
    cipher: Mutex<Option<u8>>,
}

/// What one ipmitool run said, classified.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Ok(String),
    /// The BMC does not offer this cipher suite's algorithms: try the next.
    CipherRefused,
    AuthFailed(String),
    Unreachable(String),
    Failed(String),
}

/// Reads ipmitool's verbose output (its messages are the only interface it has).
fn classify(success: bool, stdout: &str, stderr: &str) -> Outcome {
    if success {
        return Outcome::Ok(stdout.to_string());
    }
    let has = |needle: &str| stderr.contains(needle);
    let last = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("ipmitool failed without a message");
    let shown: String = last.chars().take(200).collect();
    if has("invalid authentication algorithm")
        || has("invalid integrity algorithm")
        || has("invalid confidentiality algorithm")
        || has("no matching cipher suite")
    {
        Outcome::CipherRefused
    } else if has("RAKP 2 HMAC is invalid")
        || has("unauthorized name")
        || has("RAKP 4 message has invalid integrity check")
        || has("Invalid user name")
        || has("invalid role")
    {
        Outcome::AuthFailed(shown)
    } else if has("Get Auth Capabilities error")
        || has("Error issuing Get Channel Authentication Capabilities")
        || has("No response from remote controller")
        || has("Unable to establish IPMI v2")
    {
        Outcome::Unreachable(shown)
    } else {
        Outcome::Failed(shown)
    }
}

/// ipmitool's arguments for one command: never the password.
fn arguments(host: &str, port: u16, username: &str, cipher: u8, command: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "-I",
        "lanplus",
        "-H",
        host,
        "-p",
        &port.to_string(),
        "-U",
        username,
        "-E",
        "-C",
        &cipher.to_string(),
        "-N",
        "2",
        "-R",
        "2",
        "-v",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(command.iter().map(|s| s.to_string()));
    args
}

/// One `Name : value` line of `mc info`, bounded; None when absent or empty.
fn mc_info_field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name)
            .then(|| v.trim().chars().take(100).collect::<String>())
            .filter(|v| !v.is_empty())
    })
}

/// Reads `chassis bootparam get 5` (boot flags).
fn parse_boot_flags(text: &str) -> BootOverride {
    let line = |prefix: &str| {
        text.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(prefix).map(str::trim))
    };
    let valid = text.contains("Boot Flag Valid");
    let once = text.contains("Options apply to only next boot");
    let device = line("- Boot Device Selector :").unwrap_or("");
    let target = match device {
        d if d.contains("PXE") => Some("Pxe"),
        d if d.contains("Hard-Drive") || d.contains("Hard Drive") => Some("Hdd"),
        d if d.contains("CD") => Some("Cd"),
        _ => Some("None"),
    };
    BootOverride {
        target: target.map(str::to_string),
        enabled: Some(
            match (valid, once) {
                (false, _) => "Disabled",
                (true, true) => "Once",
                (true, false) => "Continuous",
            }
            .to_string(),
        ),
        mode: Some(if text.contains("BIOS EFI boot") {
            BootMode::UEFI
        } else {
            BootMode::Legacy
        }),
    }
}

impl IpmiBmc {
    pub fn new(
        address: &str,
        credentials: Credentials,
        timeout: Duration,
    ) -> Result<Self, BmcError> {
        let invalid = |reason: &str| BmcError::InvalidAddress {
            address: address.chars().take(200).collect(),
            reason: reason.to_string(),
        };
        let rest = address
            .strip_prefix("ipmi://")
            .ok_or_else(|| invalid("expected ipmi://host[:port]"))?;
        let rest = rest.trim_end_matches('/');
        if rest.contains(['/', '?', '#', '@']) || rest.is_empty() {
            return Err(invalid(
                "expected ipmi://host[:port] (no path, query or credentials)",
            ));
        }
        let (host, port) = match rest.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(']') || host.starts_with('[') => {
                match port.parse::<u16>() {
                    Ok(port) if !host.contains(':') || host.starts_with('[') => {
                        (host.trim_matches(['[', ']']).to_string(), port)
                    }
                    _ => (rest.trim_matches(['[', ']']).to_string(), 623),
                }
            }
            _ => (rest.trim_matches(['[', ']']).to_string(), 623),
        };
        if host.is_empty() || host.starts_with('-') {
            return Err(invalid("no host"));
        }
        if credentials.username.starts_with('-') || credentials.username.len() > 64 {
            return Err(BmcError::Credentials(
                "an IPMI user name is at most 16 characters and cannot start with '-'".into(),
            ));
        }
        Ok(Self {
            address: format!("ipmi://{host}:{port}"),
            host,
            port,
            credentials,
            timeout,
            cipher: Mutex::new(None),
        })
    }

    /// Runs one ipmitool command, negotiating the cipher suite the first time.
    async fn run(&self, operation: &str, command: &[&str]) -> Result<String, BmcError> {
        let mut known = self.cipher.lock().await;
        let suites: Vec<u8> = match *known {
            Some(c) => vec![c],
            None => CIPHER_SUITES.to_vec(),
        };
        let mut refused = Vec::new();
        for cipher in suites {
            let args = arguments(
                &self.host,
                self.port,
                &self.credentials.username,
                cipher,
                command,
            );
            let child = Command::new("ipmitool")
                .args(&args)
                .env("IPMI_PASSWORD", self.credentials.password.expose())
                .stdin(std::process::Stdio::null())
                .kill_on_drop(true)
                .output();
            let output = match tokio::time::timeout(self.timeout, child).await {
                Ok(Ok(output)) => output,
                Ok(Err(e)) => {
                    return Err(BmcError::Unsupported {
                        address: self.address.clone(),
                        what: format!("IPMI without ipmitool (Debian package ipmitool): {e}"),
                    });
                }
                Err(_) => {
                    return Err(BmcError::Unreachable {
                        address: self.address.clone(),
                        operation: operation.to_string(),
                        cause: Unreachable::TimedOut(self.timeout),
                    });
                }
            };
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            match classify(output.status.success(), &stdout, &stderr) {
                Outcome::Ok(text) => {
                    *known = Some(cipher);
                    return Ok(text);
                }
                Outcome::CipherRefused => refused.push(cipher.to_string()),
                Outcome::AuthFailed(detail) => {
                    return Err(BmcError::AuthFailed {
                        address: self.address.clone(),
                        username: self.credentials.username.clone(),
                        detail,
                    });
                }
                Outcome::Unreachable(detail) => {
                    return Err(BmcError::Unreachable {
                        address: self.address.clone(),
                        operation: operation.to_string(),
                        cause: Unreachable::Other(detail),
                    });
                }
                Outcome::Failed(detail) => {
                    return Err(BmcError::Protocol {
                        address: self.address.clone(),
                        operation: operation.to_string(),
                        detail,
                    });
                }
            }
        }
        Err(BmcError::Unsupported {
            address: self.address.clone(),
            what: format!(
                "any cipher suite metalboot offers (refused: {})",
                refused.join(", ")
            ),
        })
    }

    fn no_virtual_media(&self) -> BmcError {
        BmcError::Unsupported {
            address: self.address.clone(),
            what: "virtual media over IPMI".into(),
        }
    }

    async fn read_power(&self) -> Result<PowerState, BmcError> {
        let text = self
            .run("power status", &["chassis", "power", "status"])
            .await?;
        if text.contains("Chassis Power is on") {
            Ok(PowerState::On)
        } else if text.contains("Chassis Power is off") {
            Ok(PowerState::Off)
        } else {
            Err(BmcError::Protocol {
                address: self.address.clone(),
                operation: "power status".into(),
                detail: text.chars().take(200).collect(),
            })
        }
    }
}

impl Bmc for IpmiBmc {
    fn address(&self) -> &str {
        &self.address
    }

    fn power_state(&self) -> BmcFuture<'_, PowerState> {
        Box::pin(self.read_power())
    }

    fn power(&self, action: PowerAction) -> BmcFuture<'_, ()> {
        Box::pin(async move {
            let verb = match action {
                PowerAction::On => "on",
                PowerAction::GracefulOff => "soft",
                PowerAction::ForceOff => "off",
                // From the observed state: cycling a chassis that is off does nothing (or
                // fails) on many BMCs; it is powered on instead.
                PowerAction::Cycle => match self.read_power().await? {
                    PowerState::Off => "on",
                    _ => "cycle",
                },
            };
            self.run(&action.to_string(), &["chassis", "power", verb])
                .await
                .map(|_| ())
        })
    }

    fn set_boot_once(&self, device: BootDevice, mode: Option<BootMode>) -> BmcFuture<'_, ()> {
        Box::pin(async move {
            let target = match device {
                BootDevice::Pxe => "pxe",
                BootDevice::Hdd => "disk",
                BootDevice::Cd => "cdrom",
                BootDevice::UefiHttp => {
                    return Err(BmcError::Unsupported {
                        address: self.address.clone(),
                        what: "UEFI HTTP boot over IPMI".into(),
                    });
                }
            };
            let mut command = vec!["chassis", "bootdev", target];
            if mode == Some(BootMode::UEFI) {
                command.push("options=efiboot");
            }
            self.run("set boot override", &command).await.map(|_| ())
        })
    }

    fn boot_override(&self) -> BmcFuture<'_, BootOverride> {
        Box::pin(async move {
            let text = self
                .run("read boot override", &["chassis", "bootparam", "get", "5"])
                .await?;
            Ok(parse_boot_flags(&text))
        })
    }

    fn insert_media<'a>(&'a self, _iso_url: &'a str) -> BmcFuture<'a, ()> {
        Box::pin(async move { Err(self.no_virtual_media()) })
    }

    fn eject_media(&self) -> BmcFuture<'_, ()> {
        Box::pin(async move { Err(self.no_virtual_media()) })
    }

    fn inventory(&self) -> BmcFuture<'_, HardwareInventory> {
        Box::pin(async move {
            let text = self.run("read inventory", &["mc", "info"]).await?;
            let field = |name: &str| mc_info_field(&text, name);
            let mut inventory = HardwareInventory {
                manufacturer: field("Manufacturer Name"),
                model: field("Product Name"),
                ..Default::default()
            };
            if let Some(firmware) = field("Firmware Revision") {
                inventory.extra.insert("bmcFirmware".into(), firmware);
            }
            inventory.extra.insert("protocol".into(), "IPMI 2.0".into());
            Ok(inventory)
        })
    }

    fn probe(&self) -> BmcFuture<'_, BmcCapabilities> {
        Box::pin(async move {
            let text = self.run("probe", &["mc", "info"]).await?;
            let field = |name: &str| mc_info_field(&text, name);
            Ok(BmcCapabilities {
                protocol: "IPMI".into(),
                protocol_version: field("IPMI Version"),
                vendor: field("Manufacturer Name"),
                firmware_version: field("Firmware Revision"),
                sessions: Some(true),
                reset_types: ["on", "soft", "off", "cycle", "reset"]
                    .map(String::from)
                    .to_vec(),
                reset_types_source: Some("IPMI chassis control".into()),
                boot_targets: ["pxe", "disk", "cdrom"].map(String::from).to_vec(),
                boot_modes: ["Legacy", "UEFI"].map(String::from).to_vec(),
                etag: None,
                virtual_media: Some(false),
                uefi_http_boot: Some(false),
                cipher_suite: *self.cipher.lock().await,
                // IPMI's boot flags carry "next boot only"; whether this BMC keeps it is learned
                // from the first one-time boot read back.
                boot_once: None,
            })
        })
    }

    fn logout(&self) -> BmcFuture<'_, ()> {
        // Every ipmitool run opens and closes its own session.
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        let creds = || Credentials::new("admin", "pw");
        let t = Duration::from_secs(5);
        let ok = |a: &str| IpmiBmc::new(a, creds(), t).map(|b| (b.host, b.port));
        assert_eq!(ok("ipmi://10.0.0.5").unwrap(), ("10.0.0.5".into(), 623));
        assert_eq!(ok("ipmi://bmc-7:6230").unwrap(), ("bmc-7".into(), 6230));
        assert_eq!(ok("ipmi://[fd00::1]:623").unwrap(), ("fd00::1".into(), 623));
        for bad in [
            "ipmi://",
            "ipmi://a/b",
            "ipmi://u@h",
            "ipmi://-oProxy",
            "redfish://h",
        ] {
            assert!(
                matches!(
                    IpmiBmc::new(bad, creds(), t),
                    Err(BmcError::InvalidAddress { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_password_is_never_an_argument() {
        let args = arguments(
            "10.0.0.5",
            623,
            "admin",
            17,
            &["chassis", "power", "status"],
        );
        assert!(args.contains(&"-E".to_string()));
        assert!(!args.iter().any(|a| a == "-P" || a.contains("pw")));
    }

    #[test]
    fn ipmitool_messages_are_classified() {
        let rows = [
            ("Chassis Power is on", "", true, "ok"),
            (
                "",
                "Error in open session response message : invalid authentication algorithm\nError: Unable to establish IPMI v2 / RMCP+ session",
                false,
                "cipher",
            ),
            (
                "",
                "> RAKP 2 HMAC is invalid\nError: Unable to establish IPMI v2 / RMCP+ session",
                false,
                "auth",
            ),
            (
                "",
                "RAKP 2 message indicates an error : unauthorized name\nError: Unable to establish IPMI v2 / RMCP+ session",
                false,
                "auth",
            ),
            (
                "",
                "Get Auth Capabilities error\nError issuing Get Channel Authentication Capabilities request\nError: Unable to establish IPMI v2 / RMCP+ session",
                false,
                "unreachable",
            ),
            (
                "",
                "Set Chassis Power Control to Cycle failed: Command not supported in present state",
                false,
                "failed",
            ),
        ];
        for (stdout, stderr, ok, want) in rows {
            let got = match classify(ok, stdout, stderr) {
                Outcome::Ok(_) => "ok",
                Outcome::CipherRefused => "cipher",
                Outcome::AuthFailed(_) => "auth",
                Outcome::Unreachable(_) => "unreachable",
                Outcome::Failed(_) => "failed",
            };
            assert_eq!(got, want, "{stderr}");
        }
    }

    #[test]
    fn boot_flags_are_read() {
        let text = "Boot parameter version: 1\nBoot parameter 5 is valid/unlocked\nBoot parameter data: e004000000\n Boot Flags :\n   - Boot Flag Valid\n   - Options apply to only next boot\n   - BIOS EFI boot \n   - Boot Device Selector : Force PXE\n";
        let o = parse_boot_flags(text);
        assert_eq!(o.target.as_deref(), Some("Pxe"));
        assert_eq!(o.enabled.as_deref(), Some("Once"));
        assert_eq!(o.mode, Some(BootMode::UEFI));
        let invalid =
            parse_boot_flags("   - Boot Flag Invalid\n   - Boot Device Selector : No override\n");
        assert_eq!(invalid.enabled.as_deref(), Some("Disabled"));
        assert_eq!(invalid.target.as_deref(), Some("None"));
    }
}

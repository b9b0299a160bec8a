//! `metalboot bmc …`: talk to one BMC by hand with the same driver the controllers use — check an
//! address and credentials before creating a MetalHost, or see what the BMC says.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

use super::redfish::RedfishOptions;
use super::{Bmc, BootDevice, BootMode, Credentials, Secret};

#[derive(Debug, Args)]
pub struct BmcArgs {
    /// BMC address, e.g. `redfish://10.0.0.5/redfish/v1/Systems/1`, `redfish+http://127.0.0.1:8000`
    /// or `ipmi://10.0.0.6[:623]` (IPMI over LAN through ipmitool).
    #[arg(long, env = "METALBOOT_BMC_ADDRESS")]
    pub address: String,
    /// Read `username`/`password` from this Secret (`namespace/name`) via the default kubeconfig.
    #[arg(long, conflicts_with_all = ["username", "password_file"])]
    pub credentials_secret: Option<String>,
    /// BMC user (with --password-file).
    #[arg(long, requires = "password_file")]
    pub username: Option<String>,
    /// File holding the BMC password (trailing newline ignored).
    #[arg(long, requires = "username")]
    pub password_file: Option<PathBuf>,
    /// Skip TLS certificate verification (self-signed BMC certificates on a trusted network).
    #[arg(long)]
    pub insecure: bool,
    /// PEM file with the CA(s) that signed the BMC certificate.
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 20)]
    pub timeout_secs: u64,
    /// Output format.
    #[arg(long, value_enum, default_value = "text")]
    pub output: Output,
    #[command(subcommand)]
    pub command: BmcCommand,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum BmcCommand {
    /// Power state and boot override.
    Status,
    /// Power the system on.
    PowerOn,
    /// Power the system off (gracefully unless --force).
    PowerOff {
        #[arg(long)]
        force: bool,
    },
    /// Power cycle / hard reset.
    Reset,
    /// Boot once from a device at the next boot.
    BootOnce {
        #[arg(value_enum)]
        device: CliBootDevice,
        #[arg(long, value_enum)]
        mode: Option<CliBootMode>,
    },
    /// Manufacturer, model, serial, UUID, BIOS version and NIC MACs.
    Inventory,
    /// What the BMC can do — protocol and firmware version, sessions, reset types, boot targets
    /// and modes, ETags, virtual media, UEFI HTTP boot — read without changing anything.
    Probe,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CliBootDevice {
    Pxe,
    Http,
    Cd,
    Disk,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CliBootMode {
    Uefi,
    Legacy,
}

/// The probe as an operator reads it.
pub fn probe_text(c: &super::BmcCapabilities) -> String {
    let f = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let b = |v: Option<bool>| match v {
        Some(true) => "yes",
        Some(false) => "no",
        None => "-",
    };
    let list = |v: &[String]| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(", ")
        }
    };
    let mut text = format!(
        "protocol:       {} {}
vendor:         {}
firmware:       {}
sessions:       {}
reset types:    {} ({})
boot targets:   {}
boot modes:     {}
ETag:           {}
virtual media:  {}
UEFI HTTP boot: {}",
        c.protocol,
        f(&c.protocol_version),
        f(&c.vendor),
        f(&c.firmware_version),
        b(c.sessions),
        list(&c.reset_types),
        f(&c.reset_types_source),
        list(&c.boot_targets),
        list(&c.boot_modes),
        b(c.etag),
        b(c.virtual_media),
        b(c.uefi_http_boot),
    );
    if let Some(once) = c.boot_once {
        text.push_str(&format!(
            "
boot once:      {once}"
        ));
    }
    if let Some(suite) = c.cipher_suite {
        text.push_str(&format!(
            "
cipher suite:   {suite}"
        ));
    }
    text
}

async fn credentials(args: &BmcArgs) -> Result<Credentials, String> {
    if let Some(reference) = &args.credentials_secret {
        let Some((ns, name)) = reference.split_once('/') else {
            return Err(format!(
                "--credentials-secret {reference:?}: expected namespace/name"
            ));
        };
        let conn = crate::kubeconn::connect(None, "bmc-cli")
            .await
            .map_err(|e| e.to_string())?;
        let api: kube::Api<k8s_openapi::api::core::v1::Secret> =
            kube::Api::namespaced(conn.client, ns);
        let secret = api
            .get(name)
            .await
            .map_err(|e| format!("reading Secret {ns}/{name} from {}: {e}", conn.server))?;
        return Credentials::from_secret(&secret).map_err(|e| e.to_string());
    }
    match (&args.username, &args.password_file) {
        (Some(user), Some(file)) => {
            let raw = std::fs::read_to_string(file)
                .map_err(|e| format!("reading {}: {e}", file.display()))?;
            Ok(Credentials {
                username: user.clone(),
                password: Secret::new(raw.trim_end_matches(['\r', '\n'])),
            })
        }
        _ => {
            Err("give --credentials-secret ns/name, or --username with --password-file".to_string())
        }
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct StatusOut {
    address: String,
    power_state: super::PowerState,
    boot_override: super::BootOverride,
}

fn print<T: Serialize>(
    output: Output,
    value: &T,
    text: impl FnOnce() -> String,
) -> Result<(), String> {
    match output {
        Output::Json => {
            let s = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
            println!("{s}");
        }
        Output::Text => println!("{}", text()),
    }
    Ok(())
}

/// Run one BMC command and print the BMC's answer.
pub async fn run(args: BmcArgs) -> Result<(), String> {
    let creds = credentials(&args).await?;
    let ca_pem = match &args.ca_file {
        Some(p) => {
            Some(std::fs::read_to_string(p).map_err(|e| format!("reading {}: {e}", p.display()))?)
        }
        None => None,
    };
    let options = RedfishOptions {
        timeout: Duration::from_secs(args.timeout_secs.max(1)),
        ca_pem,
        disable_certificate_verification: args.insecure,
        ..RedfishOptions::default()
    };
    let bmc = super::connect(&args.address, creds, options)
        .map_err(|e| format!("{} ({})", e, e.reason()))?;
    let result = command(bmc.as_ref(), &args).await;
    // Close the session whatever happened; a logout failure only matters if all else worked.
    let logout = bmc.logout().await.map_err(|e| e.to_string());
    result.and(logout)
}

async fn command(bmc: &dyn Bmc, args: &BmcArgs) -> Result<(), String> {
    let out = args.output;
    let e = |e: super::BmcError| format!("{} ({})", e, e.reason());
    match &args.command {
        BmcCommand::Status => {
            let power_state = bmc.power_state().await.map_err(e)?;
            let boot_override = bmc.boot_override().await.map_err(e)?;
            let status = StatusOut {
                address: args.address.clone(),
                power_state,
                boot_override,
            };
            print(out, &status, || {
                let b = &status.boot_override;
                format!(
                    "{}\n  power:         {:?}\n  boot override: {} ({}){}",
                    status.address,
                    status.power_state,
                    b.target.as_deref().unwrap_or("-"),
                    b.enabled.as_deref().unwrap_or("-"),
                    b.mode.map(|m| format!(", mode {m:?}")).unwrap_or_default()
                )
            })
        }
        BmcCommand::PowerOn => action(bmc, out, "power on", bmc.power_on()).await,
        BmcCommand::PowerOff { force: false } => {
            action(bmc, out, "graceful power off", bmc.power_off_graceful()).await
        }
        BmcCommand::PowerOff { force: true } => {
            action(bmc, out, "forced power off", bmc.power_off_force()).await
        }
        BmcCommand::Reset => action(bmc, out, "power cycle", bmc.power_cycle()).await,
        BmcCommand::BootOnce { device, mode } => {
            let device = match device {
                CliBootDevice::Pxe => BootDevice::Pxe,
                CliBootDevice::Http => BootDevice::UefiHttp,
                CliBootDevice::Cd => BootDevice::Cd,
                CliBootDevice::Disk => BootDevice::Hdd,
            };
            let mode = mode.map(|m| match m {
                CliBootMode::Uefi => BootMode::UEFI,
                CliBootMode::Legacy => BootMode::Legacy,
            });
            bmc.set_boot_once(device, mode).await.map_err(e)?;
            let now = bmc.boot_override().await.map_err(e)?;
            print(out, &now, || {
                let kept = match now.once_after_setting(device) {
                    Some(super::BootOnce::Continuous) => {
                        "\nthis BMC keeps a one-time override until it is changed (bootOnce: Continuous)"
                    }
                    Some(super::BootOnce::Honoured) => {
                        "\nthe next boot consumes it (bootOnce: Honoured)"
                    }
                    None => "",
                };
                format!(
                    "boot override set; the BMC now reports {} ({}){}{kept}",
                    now.target.as_deref().unwrap_or("-"),
                    now.enabled.as_deref().unwrap_or("-"),
                    now.mode
                        .map(|m| format!(", mode {m:?}"))
                        .unwrap_or_default()
                )
            })
        }
        BmcCommand::Probe => {
            let caps = bmc.probe().await.map_err(e)?;
            print(out, &caps, || probe_text(&caps))
        }
        BmcCommand::Inventory => {
            let inv = bmc.inventory().await.map_err(e)?;
            print(out, &inv, || {
                let f = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".to_string());
                let mut s = format!(
                    "manufacturer: {}\nmodel:        {}\nserial:       {}\nsystem UUID:  {}\nBIOS:         {}",
                    f(&inv.manufacturer),
                    f(&inv.model),
                    f(&inv.serial_number),
                    f(&inv.system_uuid),
                    f(&inv.bios_version)
                );
                for nic in &inv.nics {
                    s.push_str(&format!("\nNIC {}: {}", f(&nic.name), f(&nic.mac)));
                }
                for (k, v) in &inv.extra {
                    s.push_str(&format!("\n{k}: {v}"));
                }
                s
            })
        }
    }
}

async fn action(
    bmc: &dyn Bmc,
    out: Output,
    what: &str,
    fut: super::BmcFuture<'_, ()>,
) -> Result<(), String> {
    fut.await.map_err(|e| format!("{} ({})", e, e.reason()))?;
    let state = bmc
        .power_state()
        .await
        .map_err(|e| format!("{} ({})", e, e.reason()))?;
    #[derive(Serialize)]
    #[serde(rename_all = "camelCase")]
    struct Done<'a> {
        requested: &'a str,
        power_state: super::PowerState,
    }
    let done = Done {
        requested: what,
        power_state: state,
    };
    print(out, &done, || {
        format!("{what} requested; power state now {state:?} (the BMC may apply it after a delay)")
    })
}

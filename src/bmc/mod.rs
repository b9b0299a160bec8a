//! Talking to baseboard management controllers: the [`Bmc`] trait the controllers hold as
//! `Arc<dyn Bmc>`, its typed [`BmcError`], credentials that never print their password, and the
//! Redfish driver ([`redfish::RedfishBmc`]).
//!
//! What this module is not: it makes no decisions (when to power a host on, what to boot). It
//! performs one BMC operation per call and says precisely what went wrong when it cannot.

pub mod cli;
pub mod ipmi;
pub mod redfish;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::Serialize;

pub use crate::api::metalhost::{
    BmcCapabilities, BootMode, BootOnce, HardwareInventory, NicInfo, PowerState,
};

/// The future every [`Bmc`] operation returns: boxed so the trait stays object safe.
/// The driver for an address: `ipmi://` gets IPMI (ipmitool), everything else Redfish.
pub fn connect(
    address: &str,
    credentials: Credentials,
    options: redfish::RedfishOptions,
) -> Result<std::sync::Arc<dyn Bmc>, BmcError> {
    if address.to_ascii_lowercase().starts_with("ipmi://") {
        return Ok(std::sync::Arc::new(ipmi::IpmiBmc::new(
            address,
            credentials,
            options.timeout,
        )?));
    }
    Ok(std::sync::Arc::new(redfish::RedfishBmc::new(
        address,
        credentials,
        options,
    )?))
}

pub type BmcFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BmcError>> + Send + 'a>>;

/// One baseboard management controller, bound to one system (server) behind it.
///
/// Implementations serialise their own requests per BMC address and retry what is safe to retry;
/// callers only decide what to do next from the result.
pub trait Bmc: Send + Sync {
    /// The BMC address this driver talks to (as configured, without credentials).
    fn address(&self) -> &str;
    /// The system's current power state.
    fn power_state(&self) -> BmcFuture<'_, PowerState>;
    /// Ask for a power transition; the BMC may apply it later (poll [`Bmc::power_state`]).
    fn power(&self, action: PowerAction) -> BmcFuture<'_, ()>;
    /// Boot once from `device` at the next boot, optionally in `mode`.
    fn set_boot_once(&self, device: BootDevice, mode: Option<BootMode>) -> BmcFuture<'_, ()>;
    /// The boot override as the BMC reports it now.
    fn boot_override(&self) -> BmcFuture<'_, BootOverride>;
    /// Power state and boot override together; a driver that reads both in one request (Redfish:
    /// the system resource) answers with one, so reading the override back costs nothing extra.
    fn power_and_boot_override(&self) -> BmcFuture<'_, (PowerState, BootOverride)> {
        Box::pin(async move { Ok((self.power_state().await?, self.boot_override().await?)) })
    }
    /// Insert an ISO (by URL the BMC downloads) into the system's virtual CD/DVD drive.
    fn insert_media<'a>(&'a self, iso_url: &'a str) -> BmcFuture<'a, ()>;
    /// Eject whatever is in the system's virtual CD/DVD drive.
    fn eject_media(&self) -> BmcFuture<'_, ()>;
    /// Hardware facts: manufacturer, model, serial, UUID, BIOS version, NIC MACs.
    fn inventory(&self) -> BmcFuture<'_, HardwareInventory>;
    /// What the BMC can do, read without changing anything.
    fn probe(&self) -> BmcFuture<'_, BmcCapabilities>;
    /// End the BMC session, if one is open. Harmless to call twice.
    fn logout(&self) -> BmcFuture<'_, ()>;

    fn power_on(&self) -> BmcFuture<'_, ()> {
        self.power(PowerAction::On)
    }
    fn power_off_graceful(&self) -> BmcFuture<'_, ()> {
        self.power(PowerAction::GracefulOff)
    }
    fn power_off_force(&self) -> BmcFuture<'_, ()> {
        self.power(PowerAction::ForceOff)
    }
    fn power_cycle(&self) -> BmcFuture<'_, ()> {
        self.power(PowerAction::Cycle)
    }
}

/// A requested power transition; the driver maps it to a reset type the BMC supports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum PowerAction {
    On,
    GracefulOff,
    ForceOff,
    /// Power cycle or hard reset.
    Cycle,
}

impl fmt::Display for PowerAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PowerAction::On => "power on",
            PowerAction::GracefulOff => "graceful power off",
            PowerAction::ForceOff => "forced power off",
            PowerAction::Cycle => "power cycle",
        })
    }
}

/// A one-time boot device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum BootDevice {
    Pxe,
    UefiHttp,
    Cd,
    Hdd,
}

impl BootDevice {
    /// The Redfish `BootSourceOverrideTarget` value.
    pub fn redfish_name(self) -> &'static str {
        match self {
            BootDevice::Pxe => "Pxe",
            BootDevice::UefiHttp => "UefiHttp",
            BootDevice::Cd => "Cd",
            BootDevice::Hdd => "Hdd",
        }
    }

    pub fn from_redfish(name: &str) -> Option<Self> {
        [
            BootDevice::Pxe,
            BootDevice::UefiHttp,
            BootDevice::Cd,
            BootDevice::Hdd,
        ]
        .into_iter()
        .find(|d| d.redfish_name() == name)
    }
}

/// The boot override as read back from the BMC (raw strings where the BMC may say anything).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BootOverride {
    /// `BootSourceOverrideTarget`, e.g. `Pxe`, `Hdd`, `None`.
    pub target: Option<String>,
    /// `BootSourceOverrideEnabled`: `Once`, `Continuous` or `Disabled`.
    pub enabled: Option<String>,
    /// `BootSourceOverrideMode`.
    pub mode: Option<BootMode>,
}

impl BootOverride {
    pub fn device(&self) -> Option<BootDevice> {
        self.target.as_deref().and_then(BootDevice::from_redfish)
    }

    /// What this reading, taken right after a one-time boot from `asked` was set, says about how
    /// the BMC keeps one-time overrides. Only a reading of the device just asked for counts: a
    /// BMC that applies the change later (a settings object) shows the old override, which says
    /// nothing.
    pub fn once_after_setting(&self, asked: BootDevice) -> Option<BootOnce> {
        if self.device() != Some(asked) {
            return None;
        }
        match self.enabled.as_deref() {
            Some("Once") => Some(BootOnce::Honoured),
            Some("Continuous") => Some(BootOnce::Continuous),
            _ => None,
        }
    }
}

/// Why a BMC could not be reached, precisely.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unreachable {
    /// Nothing listens at the address (TCP connection refused).
    ConnectionRefused,
    /// No complete answer within the configured timeout.
    TimedOut(Duration),
    /// The connection was closed or reset before the answer was complete.
    ConnectionDropped,
    /// Name resolution, routing or another connect-time failure.
    Other(String),
}

impl fmt::Display for Unreachable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unreachable::ConnectionRefused => f.write_str("connection refused"),
            Unreachable::TimedOut(d) => write!(f, "timed out after {} s", fmt_secs(*d)),
            Unreachable::ConnectionDropped => {
                f.write_str("connection dropped before the answer was complete")
            }
            Unreachable::Other(detail) => write!(f, "cannot connect: {detail}"),
        }
    }
}

fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

/// Everything that can go wrong talking to a BMC. Messages name the BMC address and the request;
/// they never contain the password or session token.
#[derive(Debug, thiserror::Error)]
pub enum BmcError {
    #[error("invalid BMC address {address:?}: {reason}")]
    InvalidAddress { address: String, reason: String },
    #[error("BMC credentials: {0}")]
    Credentials(String),
    #[error("BMC {address} unreachable ({operation}): {cause}")]
    Unreachable {
        address: String,
        operation: String,
        cause: Unreachable,
    },
    #[error("TLS with BMC {address} failed: {detail}")]
    Tls { address: String, detail: String },
    #[error("BMC {address} refused the credentials for user {username:?}: {detail}")]
    AuthFailed {
        address: String,
        username: String,
        detail: String,
    },
    #[error("BMC {address}: {what} not found{}", available_suffix(.available))]
    NotFound {
        address: String,
        what: String,
        available: Vec<String>,
    },
    #[error("BMC {address} does not support {what}")]
    Unsupported { address: String, what: String },
    #[error("BMC {address} rejected {operation} with HTTP {status}{}", messages_suffix(.messages))]
    Rejected {
        address: String,
        operation: String,
        status: u16,
        messages: Vec<String>,
    },
    #[error("BMC {address} answered {operation} with something unexpected: {detail}")]
    Protocol {
        address: String,
        operation: String,
        detail: String,
    },
}

fn available_suffix(available: &[String]) -> String {
    if available.is_empty() {
        String::new()
    } else {
        format!(" (available: {})", available.join(", "))
    }
}

fn messages_suffix(messages: &[String]) -> String {
    if messages.is_empty() {
        String::new()
    } else {
        format!(": {}", messages.join("; "))
    }
}

impl BmcError {
    /// A CamelCase reason for a status condition.
    pub fn reason(&self) -> &'static str {
        match self {
            BmcError::InvalidAddress { .. } => "BmcAddressInvalid",
            BmcError::Credentials(_) => "BmcCredentialsInvalid",
            BmcError::Unreachable {
                cause: Unreachable::TimedOut(_),
                ..
            } => "BmcTimeout",
            BmcError::Unreachable { .. } => "BmcUnreachable",
            BmcError::Tls { .. } => "BmcTLSError",
            BmcError::AuthFailed { .. } => "BmcAuthFailed",
            BmcError::NotFound { .. } => "BmcNotFound",
            BmcError::Unsupported { .. } => "BmcUnsupported",
            BmcError::Rejected { .. } => "BmcRequestRejected",
            BmcError::Protocol { .. } => "BmcProtocolError",
        }
    }

    /// Whether trying again later may help (network or BMC-side trouble, not configuration).
    pub fn is_transient(&self) -> bool {
        match self {
            BmcError::Unreachable { .. } => true,
            BmcError::Rejected { status, .. } => *status >= 500 || *status == 409 || *status == 429,
            _ => false,
        }
    }
}

/// A string that never prints: `Debug` and `Display` show `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    /// The value itself, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Secret(value)
    }
}

/// BMC login.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: Secret,
}

impl Credentials {
    pub fn new(username: impl Into<String>, password: impl Into<String>) -> Self {
        Credentials {
            username: username.into(),
            password: Secret::new(password),
        }
    }

    /// Read keys `username` and `password` of a Kubernetes Secret (`data`, or `stringData` when
    /// the object was built locally).
    pub fn from_secret(secret: &k8s_openapi::api::core::v1::Secret) -> Result<Self, BmcError> {
        let name = format!(
            "{}/{}",
            secret.metadata.namespace.as_deref().unwrap_or("-"),
            secret.metadata.name.as_deref().unwrap_or("-")
        );
        let key = |k: &str| -> Result<String, BmcError> {
            if let Some(bytes) = secret.data.as_ref().and_then(|d| d.get(k)) {
                return String::from_utf8(bytes.0.clone()).map_err(|_| {
                    BmcError::Credentials(format!("Secret {name}: key {k:?} is not UTF-8"))
                });
            }
            if let Some(s) = secret.string_data.as_ref().and_then(|d| d.get(k)) {
                return Ok(s.clone());
            }
            Err(BmcError::Credentials(format!(
                "Secret {name} has no key {k:?}"
            )))
        };
        let username = key("username")?;
        let password = key("password")?;
        if username.is_empty() {
            return Err(BmcError::Credentials(format!(
                "Secret {name}: key \"username\" is empty"
            )));
        }
        Ok(Credentials {
            username,
            password: Secret(password),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    #[test]
    fn credentials_never_print_the_password() {
        let c = Credentials::new("admin", "hunter2-very-secret");
        let dbg = format!("{c:?} {:?} {}", c.password, c.password);
        assert!(!dbg.contains("hunter2"), "{dbg}");
        assert!(dbg.contains("<redacted>") && dbg.contains("admin"), "{dbg}");
    }

    #[test]
    fn credentials_from_secret() {
        let mut s = k8s_openapi::api::core::v1::Secret::default();
        s.metadata.name = Some("bmc".into());
        s.metadata.namespace = Some("ns".into());
        let mut data = BTreeMap::new();
        data.insert("username".to_string(), ByteString(b"root".to_vec()));
        s.data = Some(data.clone());
        let err = Credentials::from_secret(&s).expect_err("missing password");
        assert_eq!(
            err.to_string(),
            "BMC credentials: Secret ns/bmc has no key \"password\""
        );
        assert_eq!(err.reason(), "BmcCredentialsInvalid");
        data.insert("password".to_string(), ByteString(vec![0xff, 0xfe]));
        s.data = Some(data.clone());
        let err = Credentials::from_secret(&s).expect_err("not utf-8");
        assert!(err.to_string().contains("not UTF-8"), "{err}");
        data.insert("password".to_string(), ByteString(b"pw".to_vec()));
        s.data = Some(data);
        let c = Credentials::from_secret(&s).expect("valid");
        assert_eq!(c, Credentials::new("root", "pw"));
    }

    /// Only a reading of the device just asked for, as Once or Continuous, says anything.
    #[test]
    fn how_a_bmc_keeps_a_one_time_override_from_its_read_back() {
        let read = |target: &str, enabled: &str| BootOverride {
            target: Some(target.into()),
            enabled: Some(enabled.into()),
            mode: None,
        };
        let rows = [
            (
                "Pxe",
                "Once",
                Some(BootOnce::Honoured),
                "read back as asked",
            ),
            (
                "Pxe",
                "Continuous",
                Some(BootOnce::Continuous),
                "sushy-tools",
            ),
            ("Pxe", "Disabled", None, "not applied yet"),
            (
                "Hdd",
                "Continuous",
                None,
                "an older override (settings object)",
            ),
            ("None", "Once", None, "no target"),
            ("Pxe", "Sometimes", None, "not a Redfish value"),
        ];
        for (target, enabled, want, what) in rows {
            assert_eq!(
                read(target, enabled).once_after_setting(BootDevice::Pxe),
                want,
                "{what}"
            );
        }
        assert_eq!(
            BootOverride::default().once_after_setting(BootDevice::Pxe),
            None
        );
    }

    #[test]
    fn reasons_and_messages() {
        let e = BmcError::Unreachable {
            address: "redfish://h".into(),
            operation: "GET /redfish/v1".into(),
            cause: Unreachable::TimedOut(Duration::from_secs(2)),
        };
        assert_eq!(e.reason(), "BmcTimeout");
        assert!(e.to_string().contains("timed out after 2 s"), "{e}");
        let e = BmcError::NotFound {
            address: "redfish://h".into(),
            what: "system /redfish/v1/Systems/x".into(),
            available: vec!["/redfish/v1/Systems/a".into()],
        };
        assert_eq!(e.reason(), "BmcNotFound");
        assert!(
            e.to_string()
                .ends_with("(available: /redfish/v1/Systems/a)"),
            "{e}"
        );
    }
}

//! `MetalHost`: one racked server the operator declared — how to reach its BMC, which NIC boots —
//! and what metalboot observed of it. MetalMachines claim Available hosts.

use std::collections::BTreeMap;

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, conditions_schema};

/// Desired state of a bare-metal host.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MetalHost",
    namespaced,
    status = "MetalHostStatus",
    shortname = "mh",
    shortname = "mhost",
    category = "cluster-api",
    category = "metalboot",
    doc = "MetalHost is a physical server reachable through its BMC, available to be claimed by a MetalMachine.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    // `clusterctl move` moves every MetalHost of the namespace with what it owns (its BMC
    // credentials Secret): hosts are not owned by a Cluster, yet must follow it.
    label("clusterctl.cluster.x-k8s.io/move-hierarchy", "true"),
    printcolumn(
        name = "State",
        type_ = "string",
        json_path = ".status.state",
        description = "Lifecycle state of the host"
    ),
    printcolumn(
        name = "Power",
        type_ = "string",
        json_path = ".status.powerState",
        description = "Power state last read from the BMC"
    ),
    printcolumn(
        name = "Consumer",
        type_ = "string",
        json_path = ".spec.consumerRef.name",
        description = "MetalMachine using the host"
    ),
    printcolumn(
        name = "BMC",
        type_ = "string",
        json_path = ".spec.bmc.address",
        description = "BMC address"
    ),
    printcolumn(
        name = "Online",
        type_ = "boolean",
        json_path = ".spec.online",
        priority = 1,
        description = "Whether the host may be powered on"
    ),
    printcolumn(
        name = "Error",
        type_ = "string",
        json_path = ".status.errorMessage",
        priority = 1,
        description = "Last error"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MetalHostSpec {
    /// How to reach and authenticate to the host's baseboard management controller.
    pub bmc: BmcDetails,
    /// MAC address of the NIC the host network-boots from; the boot service matches iPXE
    /// requests to the host by it. Colon-separated hex, e.g. `52:54:00:12:34:56`.
    #[schemars(regex(pattern = r"^([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}$"))]
    #[serde(rename = "bootMACAddress")]
    pub boot_mac_address: String,
    /// The address metalboot's DHCP gives the boot NIC when it runs as the provisioning
    /// network's DHCP server (`--dhcp full`): a reservation no other client gets. Ignored in
    /// proxyDHCP mode, where the site's server hands out addresses.
    #[serde(
        default,
        rename = "bootIPAddress",
        skip_serializing_if = "Option::is_none"
    )]
    pub boot_ip_address: Option<std::net::Ipv4Addr>,
    /// Firmware boot mode used for one-time boot overrides. Leave unset to keep the BMC's current mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_mode: Option<BootMode>,
    /// Whether the host may be powered on. `false` holds it powered off (maintenance); a claimed
    /// host is not booted until this is `true` again.
    #[serde(default = "default_true")]
    pub online: bool,
    /// Free-text note for operators (rack, slot, ticket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub description: Option<String>,
    /// The MetalMachine using this host. Written by the MetalMachine controller with a
    /// resourceVersion precondition, so one host has at most one consumer. It lives in spec, not
    /// status, because `clusterctl move` and backups keep spec: a restored host whose consumer
    /// exists stays claimed by it (never re-registered as Available, never power-cycled).
    /// Matched by kind, namespace and name, never by UID (UIDs change on move).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_ref: Option<ConsumerReference>,
    /// How the host's disks are cleaned when an `image`-mode consumer releases it, before it is
    /// Available again: `metadata` (default) wipes partition tables and filesystem signatures,
    /// `full` zeroes every byte, `disabled` skips cleaning (the next tenant may see the
    /// previous one's data). A host that cannot be cleaned goes to Error, never Available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub automated_cleaning_mode: Option<CleaningMode>,
}

/// See `MetalHostSpec.automatedCleaningMode`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum CleaningMode {
    /// Wipe partition tables (both ends of each disk) and the first MiB of every partition.
    #[default]
    Metadata,
    /// Zero every byte of every disk.
    Full,
    /// Do not clean.
    Disabled,
}

fn default_true() -> bool {
    true
}

impl MetalHostSpec {
    /// A valid spec for unit tests: a Redfish BMC, one boot MAC, online, unclaimed.
    #[cfg(test)]
    pub(crate) fn for_tests() -> Self {
        MetalHostSpec {
            bmc: BmcDetails {
                address: "redfish://b".into(),
                credentials_name: "c".into(),
                disable_certificate_verification: None,
                ca_secret_name: None,
            },
            boot_mac_address: "52:54:00:00:00:01".into(),
            boot_ip_address: None,
            boot_mode: None,
            online: true,
            description: None,
            consumer_ref: None,
            automated_cleaning_mode: None,
        }
    }
}

/// BMC connection details.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BmcDetails {
    /// BMC address: `redfish://host[:port][/redfish/v1/Systems/<id>]` (HTTPS),
    /// `redfish+https://…`, `redfish+http://…` (plain HTTP, labs only), or `ipmi://host[:port]`
    /// (IPMI 2.0 over LAN, RMCP+, through ipmitool; port 623 by default). Without a system path
    /// the Redfish BMC's only system is used.
    #[schemars(regex(
        pattern = r"^(redfish|redfish\+http|redfish\+https|ipmi)://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]+)?(/[^\s]*)?$"
    ))]
    #[schemars(length(max = 2048))]
    #[x_kube(validation = Rule::new("!isURL(self) || url(self).getPort() == '' || (int(url(self).getPort()) >= 1 && int(url(self).getPort()) <= 65535)").message("spec.bmc.address: port must be between 1 and 65535"))]
    pub address: String,
    /// Name of a Secret in the host's namespace with keys `username` and `password`.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    )]
    pub credentials_name: String,
    /// Skip TLS certificate verification of the BMC. Off by default; only for BMCs with
    /// self-signed certificates you cannot replace, on a network you trust.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disable_certificate_verification: Option<bool>,
    /// Name of a Secret (key `ca.crt`) holding the CA bundle that signed the BMC's certificate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub ca_secret_name: Option<String>,
}

/// Firmware boot mode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum BootMode {
    UEFI,
    Legacy,
}

/// Lifecycle state of a host.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
pub enum HostState {
    /// Checking the BMC and credentials.
    #[default]
    Registering,
    /// Registered and free to be claimed.
    Available,
    /// Claimed; being booted for its consumer.
    Provisioning,
    /// Booted and bootstrapped for its consumer.
    Provisioned,
    /// Being powered off and released.
    Deprovisioning,
    /// Needs an operator: see `errorType`, `errorMessage` and the conditions.
    Error,
}

/// Power state as last read from the BMC.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum PowerState {
    On,
    Off,
    PoweringOn,
    PoweringOff,
    #[default]
    Unknown,
}

/// What kind of fault put a host into Error.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum HostErrorType {
    /// The BMC could not be reached or the credentials were refused.
    RegistrationError,
    /// A power action failed.
    PowerManagementError,
    /// The host could not be released cleanly (e.g. BMC unreachable during deprovisioning).
    DeprovisioningError,
    /// Another MetalHost names the same `spec.bootMACAddress`: none of them is network-booted
    /// until each has its own.
    BootMACShared,
}

/// Observed state of a bare-metal host.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct MetalHostStatus {
    /// Lifecycle state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<HostState>,
    /// Power state last read from the BMC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_state: Option<PowerState>,
    /// When a power reading last changed this status (readings that change nothing are not
    /// written: their cost would grow with the fleet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_power_check: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Hardware inventory read from the BMC once at registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hardware: Option<HardwareInventory>,
    /// What the BMC can do, probed once at registration without changing anything
    /// (`metalboot bmc probe` shows the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmc: Option<BmcCapabilities>,
    /// Kind of the fault when state is Error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_type: Option<HostErrorType>,
    /// Human-readable description of the fault when state is Error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 10240))]
    pub error_message: Option<String>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// Who is using a host.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kind == 'MetalMachine' && self.apiVersion.startsWith('infrastructure.cluster.x-k8s.io/')").message("spec.consumerRef must reference an infrastructure.cluster.x-k8s.io MetalMachine"))]
pub struct ConsumerReference {
    /// API version of the consumer, e.g. `infrastructure.cluster.x-k8s.io/v1alpha1`.
    #[schemars(length(min = 1, max = 317))]
    pub api_version: String,
    /// Kind of the consumer (`MetalMachine`).
    #[schemars(length(min = 1, max = 63))]
    pub kind: String,
    /// Name of the consumer.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Namespace of the consumer; MetalMachines only claim hosts in their own namespace.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
}

impl ConsumerReference {
    /// The reference to a MetalMachine.
    pub fn to_metal_machine(name: &str, namespace: &str) -> Self {
        ConsumerReference {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "MetalMachine".into(),
            name: name.into(),
            namespace: namespace.into(),
        }
    }

    /// Whether this reference names the MetalMachine `namespace/name`.
    pub fn is_metal_machine(&self, namespace: &str, name: &str) -> bool {
        self.kind == "MetalMachine" && self.name == name && self.namespace == namespace
    }
}

/// Hardware facts reported by the BMC.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct HardwareInventory {
    /// System manufacturer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manufacturer: Option<String>,
    /// System model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Chassis or system serial number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// SMBIOS system UUID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "systemUUID")]
    pub system_uuid: Option<String>,
    /// BIOS/UEFI firmware version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bios_version: Option<String>,
    /// Network interfaces (from the BMC, or the deploy agent's inspection).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<NicInfo>,
    /// CPUs the deploy agent counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuInfo>,
    /// Memory the deploy agent found, in MiB.
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<i64>,
    /// Disks the deploy agent found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<DiskInfo>,
    /// `UEFI` or `BIOS`, as the deploy agent booted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware_mode: Option<String>,
    /// When the deploy agent last inspected the host (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inspected_at: Option<String>,
    /// Other facts, free-form.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra: BTreeMap<String, String>,
}

/// A BMC's capabilities, read without changing anything: what it speaks, what it offers for
/// power and boot, and the details drivers trip over (sessions, ETags, ActionInfo).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BmcCapabilities {
    /// `Redfish` or `IPMI`.
    pub protocol: String,
    /// The service root's `RedfishVersion`, or the IPMI version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol_version: Option<String>,
    /// BMC vendor (Redfish `Vendor`, else the manager's `Manufacturer`; IPMI manufacturer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vendor: Option<String>,
    /// BMC firmware version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub firmware_version: Option<String>,
    /// Sessions offered (Redfish SessionService; IPMI RMCP+ sessions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sessions: Option<bool>,
    /// Reset types offered, from the action's allowable values or its ActionInfo.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reset_types: Vec<String>,
    /// Where the reset types came from: `AllowableValues`, `ActionInfo` or `none advertised`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_types_source: Option<String>,
    /// One-time boot targets offered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boot_targets: Vec<String>,
    /// Boot override modes offered (UEFI, Legacy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boot_modes: Vec<String>,
    /// The system resource carries an ETag, so changes are sent with If-Match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<bool>,
    /// Virtual media (system or manager).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub virtual_media: Option<bool>,
    /// UEFI HTTP boot offered as a boot target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uefi_http_boot: Option<bool>,
    /// IPMI: the RMCP+ cipher suite the BMC accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cipher_suite: Option<u8>,
    /// How the BMC keeps a one-time (`Once`) boot override. Learned from the override read back
    /// right after metalboot's first one-time network boot of the host (the power-on's own read,
    /// no extra request), or from the BMC's allowable values when they leave `Once` out; unset
    /// until then. The MetalMachine controller chooses from it whether an override must be set
    /// again after a boot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_once: Option<BootOnce>,
}

/// How the BMC keeps a one-time (`Once`) boot override: `Honoured` (it reads back as `Once`) or
/// `Continuous` (it reads back as `Continuous` and stays until changed). Learned from the
/// override read back after metalboot's first one-time network boot of the host, or from the
/// BMC's allowable values when they leave `Once` out.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum BootOnce {
    /// It reads back as `Once`: the next boot consumes it, and the boot after follows the
    /// host's own boot order.
    Honoured,
    /// It reads back as `Continuous` (sushy-tools does): every boot follows it until it is
    /// changed.
    Continuous,
}

impl std::fmt::Display for BootOnce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BootOnce::Honoured => "Honoured",
            BootOnce::Continuous => "Continuous",
        })
    }
}

/// CPUs of a host.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct CpuInfo {
    /// Logical CPUs.
    pub count: i32,
    /// Model name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Architecture, e.g. `x86_64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<String>,
}

/// One disk, as the deploy agent saw it.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct DiskInfo {
    /// Kernel name, e.g. `vda`.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: i64,
    /// Model string the disk reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Serial number the disk reports; a root-device hint can require it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// World Wide Name, when the disk has one; a root-device hint can require it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wwn: Option<String>,
    /// Persistent path name (under `/dev/disk/by-path/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by_path: Option<String>,
    /// True for spinning disks.
    #[serde(default)]
    pub rotational: bool,
}

/// One network interface.
#[derive(
    Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct NicInfo {
    /// Interface identifier at the BMC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// MAC address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Link up (deploy agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_up: Option<bool>,
    /// Link speed in Mbit/s (deploy agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed_mbps: Option<i64>,
}

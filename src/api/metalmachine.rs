//! `MetalMachine`: the infrastructure machine of the Cluster API contract. It claims a
//! `MetalHost`, network-boots it with the Machine's bootstrap data and reports it provisioned.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, MachineAddress, TemplateObjectMeta, conditions_schema};

/// Default seconds to wait for the bootstrap-success callback before power-cycling.
pub const DEFAULT_BOOT_TIMEOUT_SECONDS: i32 = 1200;
/// Default number of power-cycle retries after a boot timeout.
pub const DEFAULT_BOOT_RETRIES: i32 = 2;

/// Desired state of a MetalMachine.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MetalMachine",
    namespaced,
    status = "MetalMachineStatus",
    shortname = "mm",
    shortname = "mmachine",
    category = "cluster-api",
    category = "metalboot",
    doc = "MetalMachine is the Cluster API infrastructure machine backed by a MetalHost.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels.cluster\\.x-k8s\\.io/cluster-name",
        description = "Cluster the machine belongs to"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Provisioning phase"
    ),
    printcolumn(
        name = "Host",
        type_ = "string",
        json_path = ".status.hostRef.name",
        description = "Claimed MetalHost"
    ),
    printcolumn(
        name = "ProviderID",
        type_ = "string",
        json_path = ".spec.providerID",
        description = "Provider ID"
    ),
    printcolumn(
        name = "Ready",
        type_ = "boolean",
        json_path = ".status.ready",
        description = "Infrastructure ready"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)").message("spec.providerID is immutable once set"))]
#[x_kube(validation = Rule::new("self.mode != 'image' || has(self.image)").message("spec.image is required when spec.mode is image"))]
#[x_kube(validation = Rule::new("self.mode == 'image' || has(self.boot)").message("spec.boot is required when spec.mode is live"))]
// The optional parts that are often unset are boxed: the store keeps one of these per host, and
// inline they took its allocation a size class up (`api::tests`).
pub struct MetalMachineSpec {
    /// Provider ID of the host, `metalboot://<namespace>/<host>`, set by the controller when the
    /// host is provisioned; immutable once set. Matches `Node.spec.providerID`.
    #[serde(
        default,
        rename = "providerID",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(min = 1, max = 512))]
    pub provider_id: Option<String>,
    /// Failure domain the machine runs in (v1beta1 contract; v1beta2 reads `status.failureDomain`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub failure_domain: Option<String>,
    /// Which hosts this machine may claim. Empty selects every Available host in the namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_selector: Option<Box<LabelSelector>>,
    /// The least hardware a host must have to be claimed, judged from its inventory
    /// (`MetalHost.status.hardware`): a host whose inventory does not say is not enough.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_hardware: Option<Box<HardwareRequirements>>,
    /// How the host gets its OS: `live` netboots `boot` on every power-on (diskless); `image`
    /// has metalboot's deploy agent write `image` to the disk chosen by `rootDeviceHints`, and
    /// the host boots that disk from then on.
    #[serde(default)]
    pub mode: ProvisioningMode,
    /// What the host network-boots into (`live` mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<BootProfile>,
    /// The OS image written to disk (`image` mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<Box<ImageSpec>>,
    /// Which disk the image is written to (`image` mode). Empty picks the smallest disk that
    /// holds the image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root_device_hints: Option<Box<RootDeviceHints>>,
    /// Seconds to wait, after powering the host on, for its bootstrap-success callback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 86400))]
    pub boot_timeout_seconds: Option<i32>,
    /// Power cycles to try after a boot timeout before failing the machine terminally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10))]
    pub boot_retries: Option<i32>,
}

/// Minimum hardware for a host (`spec.hostHardware`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
pub struct HardwareRequirements {
    /// Least number of CPUs.
    #[serde(default, rename = "minCPUs", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub min_cpus: Option<i32>,
    /// Least memory in GiB.
    #[serde(
        default,
        rename = "minMemoryGiB",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1))]
    pub min_memory_gib: Option<i32>,
    /// A disk of at least this many GiB (the deploy agent's inspection of the host's disks).
    #[serde(
        default,
        rename = "minDiskGiB",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(range(min = 1))]
    pub min_disk_gib: Option<i32>,
}

impl HardwareRequirements {
    /// Whether `hardware` is known to meet every requirement. The deploy agent's inspection
    /// (typed fields) is preferred; the BMC's figures (`extra`) stand in where it has none.
    pub fn met_by(&self, hardware: Option<&crate::api::metalhost::HardwareInventory>) -> bool {
        const GIB: f64 = (1u64 << 30) as f64;
        let reported = |key: &str| {
            hardware
                .and_then(|h| h.extra.get(key))
                .and_then(|v| v.trim().parse::<f64>().ok())
        };
        let cpus = hardware
            .and_then(|h| h.cpu.as_ref())
            .map(|c| f64::from(c.count))
            .or_else(|| reported("cpuCount"));
        let memory_gib = hardware
            .and_then(|h| h.memory_mib)
            .map(|m| m as f64 / 1024.0)
            .or_else(|| reported("memoryGiB"));
        let largest_disk_gib = hardware
            .and_then(|h| h.disks.iter().map(|d| d.size_bytes).max())
            .map(|b| b as f64 / GIB);
        let enough = |need: Option<i32>, have: Option<f64>| {
            need.is_none_or(|need| have.is_some_and(|have| have >= f64::from(need)))
        };
        enough(self.min_cpus, cpus)
            && enough(self.min_memory_gib, memory_gib)
            && enough(self.min_disk_gib, largest_disk_gib)
    }
}

impl MetalMachineSpec {
    /// `hostSelector` as a selector to match host labels with (none set: every host), or why
    /// it does not parse.
    pub fn parsed_host_selector(&self) -> Result<kube::core::Selector, String> {
        match &self.host_selector {
            None => Ok(kube::core::Selector::default()),
            Some(s) => kube::core::Selector::try_from((**s).clone()).map_err(|e| e.to_string()),
        }
    }
    pub fn boot_timeout_seconds(&self) -> i32 {
        self.boot_timeout_seconds
            .unwrap_or(DEFAULT_BOOT_TIMEOUT_SECONDS)
    }
    pub fn boot_retries(&self) -> i32 {
        self.boot_retries.unwrap_or(DEFAULT_BOOT_RETRIES)
    }
}

/// Kernel, initrds and command line that the host's iPXE loads. Each location is an absolute
/// `http(s)://` URL, or a path relative to the boot service's artifacts directory (served at
/// `/artifacts/<path>`).
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BootProfile {
    /// Kernel image location.
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://') || (!self.startsWith('/') && !self.contains('..'))").message("spec.boot.kernel must be an http(s) URL or a relative artifact path without '..'"))]
    pub kernel: String,
    /// Initrd locations, loaded in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    #[x_kube(validation = Rule::new("self.all(i, size(i) > 0 && size(i) <= 2048 && (i.startsWith('http://') || i.startsWith('https://') || (!i.startsWith('/') && !i.contains('..'))))").message("spec.boot.initrds must be http(s) URLs or relative artifact paths without '..'"))]
    pub initrds: Vec<String>,
    /// Kernel command line. The boot service appends the NoCloud datasource
    /// (`ds=nocloud-net;s=http://…/nocloud/<token>/`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub cmdline: Option<String>,
}

/// How a MetalMachine's host gets its OS.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ProvisioningMode {
    /// Netboot `spec.boot` on every power-on; nothing is written to disk.
    #[default]
    Live,
    /// Write `spec.image` to disk with the deploy agent, then boot the disk.
    Image,
}

/// An OS image for `image` mode.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(self.checksumType == 'sha256' && self.checksum.matches('^[0-9a-fA-F]{64}$')) || (self.checksumType == 'sha512' && self.checksum.matches('^[0-9a-fA-F]{128}$'))").message("spec.image.checksum must be the hex digest that checksumType names"))]
pub struct ImageSpec {
    /// Where the image is: an `http(s)://` URL, or a path relative to the boot service's
    /// artifacts directory.
    #[schemars(length(min = 1, max = 2048))]
    #[x_kube(validation = Rule::new("self.startsWith('http://') || self.startsWith('https://') || (!self.startsWith('/') && !self.contains('..'))").message("spec.image.url must be an http(s) URL or a relative artifact path without '..'"))]
    pub url: String,
    /// Hex digest of the image file as served (of the compressed bytes for gzip).
    #[schemars(length(min = 64, max = 128))]
    pub checksum: String,
    /// Which digest `checksum` is.
    pub checksum_type: ChecksumType,
    /// How the image is stored.
    #[serde(default)]
    pub format: ImageFormat,
}

/// Digest of an image.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChecksumType {
    Sha256,
    Sha512,
}

/// On-the-wire format of an image.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// A disk image byte for byte.
    #[default]
    Raw,
    /// QEMU's qcow2 (metadata before data, as `qemu-img convert` writes it; zlib-compressed
    /// clusters allowed).
    Qcow2,
    /// A raw image compressed with gzip.
    Gzip,
}

/// Which disk receives the image. Every hint given must match; Metal3's names where they exist.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RootDeviceHints {
    /// Kernel name of the disk, e.g. `/dev/sda` or `sda`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub device_name: Option<String>,
    /// Least size in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub min_size_gigabytes: Option<i64>,
    /// Greatest size in GiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_size_gigabytes: Option<i64>,
    /// Disk serial number, exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub serial_number: Option<String>,
    /// World Wide Name, exactly (e.g. `0x5000c500a0b1c2d3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub wwn: Option<String>,
    /// Persistent path under `/dev/disk/by-path/`, e.g. `pci-0000:00:04.0`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub by_path: Option<String>,
    /// true for spinning disks, false for SSD/NVMe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotational: Option<bool>,
}

/// Coarse provisioning phase, for `kubectl get`.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum MetalMachinePhase {
    /// Waiting for its Machine, Cluster or bootstrap data.
    #[default]
    Pending,
    /// Looking for an Available host that matches.
    Claiming,
    /// Host claimed and booting; waiting for the bootstrap-success callback.
    Provisioning,
    /// Host bootstrapped; providerID set.
    Provisioned,
    /// Being deleted: host powering off and being released.
    Deprovisioning,
    /// Terminal failure; see failureReason/failureMessage.
    Failed,
}

/// Observed state of a MetalMachine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalMachineStatus {
    /// v1beta1 contract: the host is provisioned and bootstrapped.
    #[serde(default)]
    pub ready: bool,
    /// v1beta2 contract: initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<MachineInitialization>,
    /// Coarse phase, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MetalMachinePhase>,
    /// The claimed MetalHost (same namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_ref: Option<HostReference>,
    /// Addresses the host reported in its callback, plus those the BMC knows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<MachineAddress>,
    /// Failure domain of the claimed host (v1beta2 contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_domain: Option<String>,
    /// Terminal failure, machine-readable (v1beta1 contract). Once set the machine is not retried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal failure, for people (v1beta1 contract).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// v1beta2 initialization flags of an infrastructure machine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MachineInitialization {
    /// The host is provisioned; never goes back to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

/// Reference to a MetalHost in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostReference {
    /// Name of the MetalHost.
    pub name: String,
    /// UID of the MetalHost when it was claimed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
}

/// Template for MetalMachines (used by MachineDeployments and control planes).
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MetalMachineTemplate",
    namespaced,
    status = "TemplateStatus",
    shortname = "mmt",
    category = "cluster-api",
    category = "metalboot",
    doc = "MetalMachineTemplate is a template from which MetalMachines are created.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MetalMachineTemplateSpec {
    /// The MetalMachine to stamp out.
    pub template: MetalMachineTemplateResource,
}

/// The object a MetalMachineTemplate describes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetalMachineTemplateResource {
    /// Labels and annotations for the created MetalMachines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created MetalMachines.
    pub spec: MetalMachineSpec,
}

/// Status of a template: nothing is reconciled on templates; present so every CRD has one.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateStatus {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

//! `CloudInitConfig`: metalboot's bootstrap provider. It renders a `#cloud-config` document into
//! the bootstrap Secret the Machine points at; the document always ends by writing the
//! bootstrap-success sentinel.

use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::common::{Condition, SecretKeyReference, TemplateObjectMeta, conditions_schema};
use super::metalmachine::TemplateStatus;

/// Desired bootstrap configuration of one machine.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "CloudInitConfig",
    namespaced,
    status = "CloudInitConfigStatus",
    shortname = "cic",
    category = "cluster-api",
    category = "metalboot",
    doc = "CloudInitConfig renders cloud-init bootstrap data for a Machine into a Secret.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels.cluster\\.x-k8s\\.io/cluster-name",
        description = "Cluster"
    ),
    printcolumn(
        name = "Ready",
        type_ = "boolean",
        json_path = ".status.ready",
        description = "Bootstrap data ready"
    ),
    printcolumn(
        name = "DataSecret",
        type_ = "string",
        json_path = ".status.dataSecretName",
        description = "Secret with the bootstrap data"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitConfigSpec {
    /// Users to create (cloud-init `users`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub users: Vec<CloudInitUser>,
    /// Files to write before the commands run (cloud-init `write_files`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub files: Vec<CloudInitFile>,
    /// Commands run early on every boot (cloud-init `bootcmd`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boot_commands: Vec<String>,
    /// Commands run once at the end of first boot, in order (cloud-init `runcmd`). The sentinel
    /// `/run/cluster-api/bootstrap-success.complete` is written after the last one succeeds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<String>,
    /// NTP servers to use (cloud-init `ntp`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ntp_servers: Vec<String>,
}

/// A user account.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitUser {
    /// Login name.
    #[schemars(length(min = 1, max = 32), regex(pattern = r"^[a-z_][a-z0-9_-]*$"))]
    pub name: String,
    /// Supplementary groups.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<String>,
    /// Login shell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<String>,
    /// sudoers rule, e.g. `ALL=(ALL) NOPASSWD:ALL`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sudo: Option<String>,
    /// SSH public keys allowed to log in.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ssh_authorized_keys: Vec<String>,
    /// Lock the password (key-only login). Defaults to true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_password: Option<bool>,
}

/// A file to write.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.content) != has(self.contentFrom)").message("spec.files[]: set exactly one of content and contentFrom"))]
pub struct CloudInitFile {
    /// Absolute path on the host.
    #[schemars(length(min = 2, max = 4096), regex(pattern = r"^/[^\x00]*$"))]
    pub path: String,
    /// File content, inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// File content from a key of a Secret in the config's namespace (kept out of the spec).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_from: Option<FileSource>,
    /// Owner as `user:group`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z_][a-z0-9_-]*(:[a-z_][a-z0-9_-]*)?$"))]
    pub owner: Option<String>,
    /// Octal permissions, e.g. `0644`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^0?[0-7]{3}$"))]
    pub permissions: Option<String>,
    /// Encoding of `content`: omit for plain text, or `base64`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<FileEncoding>,
    /// Append to an existing file instead of replacing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub append: Option<bool>,
}

/// Where file content comes from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FileSource {
    /// A key of a Secret in the config's namespace.
    pub secret: SecretKeyReference,
}

/// Encoding of inline file content.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FileEncoding {
    Base64,
}

/// Observed state of a CloudInitConfig.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitConfigStatus {
    /// v1beta1 contract: the bootstrap Secret exists.
    #[serde(default)]
    pub ready: bool,
    /// Name of the bootstrap Secret (deterministic: the config's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_name: Option<String>,
    /// v1beta2 contract: initialization progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<BootstrapInitialization>,
    /// Terminal failure, machine-readable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Terminal failure, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// Generation of the spec last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
}

/// v1beta2 initialization flags of a bootstrap config.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct BootstrapInitialization {
    /// The bootstrap data Secret has been created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_secret_created: Option<bool>,
}

/// Template for CloudInitConfigs.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "bootstrap.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "CloudInitConfigTemplate",
    namespaced,
    status = "TemplateStatus",
    shortname = "cict",
    category = "cluster-api",
    category = "metalboot",
    doc = "CloudInitConfigTemplate is a template from which CloudInitConfigs are created.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1alpha1"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitConfigTemplateSpec {
    /// The CloudInitConfig to stamp out.
    pub template: CloudInitConfigTemplateResource,
}

/// The object a CloudInitConfigTemplate describes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudInitConfigTemplateResource {
    /// Labels and annotations for the created configs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateObjectMeta>,
    /// Spec of the created configs.
    pub spec: CloudInitConfigSpec,
}

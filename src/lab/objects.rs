//! The lab's Kubernetes objects, in one namespace: the BMC and kubelet credentials, the workload
//! cluster (the lab's own apiserver), and per host a MetalHost and a Machine with its
//! MetalMachine and CloudInitConfig. `lab up`, the simulated fleet's test and `make bench-scale`
//! create the same objects through this, so what the benchmark measures is what the lab runs.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject};
use kube::ResourceExt;
use kube::api::{Api, DynamicObject, ObjectMeta, Patch, PatchParams};
use serde_json::json;

use crate::api::CLUSTER_NAME_LABEL;

use super::fleet::mac_of;
use super::up::{CLUSTER, LabError, MANAGER};

pub struct LabObjects {
    pub client: kube::Client,
    pub namespace: String,
    /// The control-plane endpoint recorded on the MetalCluster (host, port).
    pub endpoint: (String, i32),
    /// The workload cluster's kubeconfig (YAML): the lab's own apiserver.
    pub kubeconfig: String,
    /// Where the lab OS reaches the apiserver (the lab's relay), for its kubelet.
    pub kubelet_apiserver: String,
    pub boot_timeout_seconds: i32,
    /// The boot service as the lab hosts reach it: live-boot fetches the root squashfs from it.
    pub boot_url: String,
    /// `--os image`: the qcow2 image (artifact path, sha256) the deploy agent writes to disk.
    pub image: Option<(String, String)>,
    /// Kubeadm workers joining the lab's apiserver (`lab up --kubeadm`): the Cluster's control
    /// plane is an `ExistingControlPlane` at `endpoint`, and no kubelet stand-in is set up.
    pub kubeadm: bool,
}

/// The lab's kubelet stand-in (a bootstrap command), until a real kubelet joins.
const REGISTER_NODE: &str = include_str!("register-node.sh");

/// Server-side apply with the lab's field manager.
pub(crate) async fn apply<K>(api: &Api<K>, object: &K) -> Result<K, kube::Error>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.patch(
        &object.name_any(),
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(object),
    )
    .await
}

impl LabObjects {
    /// The MetalMachine spec: the lab's Debian, live or written to disk.
    fn os_spec(&self) -> serde_json::Value {
        let mut spec = json!({"hostSelector": {"matchLabels": {"metalboot.io/role": "worker"}},
            "bootTimeoutSeconds": self.boot_timeout_seconds, "bootRetries": 1});
        match &self.image {
            Some((url, sha256)) => {
                spec["mode"] = json!("image");
                spec["image"] = json!({"url": url, "checksum": sha256,
                    "checksumType": "sha256", "format": "qcow2"});
            }
            // Netbooted by live-boot: the kernel and initrd through iPXE, the root squashfs
            // fetched by the initrd.
            None => {
                spec["boot"] = json!({"kernel": "live/vmlinuz", "initrds": ["live/initrd.img"],
                    "cmdline": format!("boot=live fetch={}/artifacts/live/filesystem.squashfs console=ttyS0,115200n8 net.ifnames=0 panic=10", self.boot_url)});
            }
        }
        spec
    }

    fn meta(&self, name: &str) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: Some(self.namespace.clone()),
            ..Default::default()
        }
    }

    fn dynamic(&self, kind: &str, group: &str, version: &str, plural: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &self.namespace,
            &kube::core::ApiResource::from_gvk_with_plural(
                &kube::core::GroupVersionKind::gvk(group, version, kind),
                plural,
            ),
        )
    }

    async fn apply_json(
        &self,
        api: &Api<DynamicObject>,
        value: serde_json::Value,
    ) -> Result<(), LabError> {
        let obj: DynamicObject =
            serde_json::from_value(value).map_err(|e| LabError::Setup(e.to_string()))?;
        apply(api, &obj).await?;
        Ok(())
    }

    async fn secret(
        &self,
        name: &str,
        labels: Option<BTreeMap<String, String>>,
        data: Vec<(&str, Vec<u8>)>,
    ) -> Result<(), LabError> {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        let secret = Secret {
            metadata: ObjectMeta {
                labels,
                ..self.meta(name)
            },
            data: Some(
                data.into_iter()
                    .map(|(k, v)| (k.to_string(), ByteString(v)))
                    .collect(),
            ),
            ..Default::default()
        };
        apply(&secrets, &secret).await?;
        Ok(())
    }

    /// The namespace, BMC credentials (`(secret name, password)`, user `admin`), the kubelet
    /// stand-in's identity, the workload kubeconfig, the Cluster and its MetalCluster.
    pub async fn base(&self, credentials: &[(&str, &str)]) -> Result<(), LabError> {
        let ns = &self.namespace;
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(ns.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        apply(&Api::<Namespace>::all(self.client.clone()), &namespace).await?;
        for (name, password) in credentials {
            let data = vec![
                ("username", b"admin".to_vec()),
                ("password", password.as_bytes().to_vec()),
            ];
            self.secret(name, None, data).await?;
        }
        if !self.kubeadm {
            self.kubelet_stand_in().await?;
        }
        // The workload cluster is this same apiserver (as upstream's envtest does). In kubeadm
        // mode `upstream::write_cluster_secrets` wrote this Secret with the CA's.
        if !self.kubeadm {
            let labels = BTreeMap::from([(CLUSTER_NAME_LABEL.to_string(), CLUSTER.to_string())]);
            let kubeconfig = vec![("value", self.kubeconfig.clone().into_bytes())];
            self.secret(&format!("{CLUSTER}-kubeconfig"), Some(labels), kubeconfig)
                .await?;
        }
        let mut spec = json!({"infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MetalCluster", "name": CLUSTER}});
        if self.kubeadm {
            spec["controlPlaneRef"] = json!({"apiGroup": "controlplane.cluster.x-k8s.io",
                "kind": "ExistingControlPlane", "name": CLUSTER});
            spec["clusterNetwork"] = json!({"pods": {"cidrBlocks": ["10.244.0.0/16"]}});
        }
        if self.kubeadm {
            self.apply_json(
                &self.dynamic(
                    "ExistingControlPlane",
                    "controlplane.cluster.x-k8s.io",
                    "v1alpha1",
                    "existingcontrolplanes",
                ),
                json!({
                    "apiVersion": "controlplane.cluster.x-k8s.io/v1alpha1", "kind": "ExistingControlPlane",
                    "metadata": {"name": CLUSTER, "namespace": ns},
                    "spec": {"controlPlaneEndpoint": {"host": self.endpoint.0, "port": self.endpoint.1}},
                }),
            )
            .await?;
        }
        self.apply_json(
            &self.dynamic("Cluster", "cluster.x-k8s.io", "v1beta2", "clusters"),
            json!({
                "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                "metadata": {"name": CLUSTER, "namespace": ns},
                "spec": spec,
            }),
        )
        .await?;
        self.apply_json(&self.dynamic("MetalCluster", "infrastructure.cluster.x-k8s.io", "v1alpha1", "metalclusters"), json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalCluster",
            "metadata": {"name": CLUSTER, "namespace": ns, "labels": {CLUSTER_NAME_LABEL: CLUSTER}},
            "spec": {"controlPlaneEndpoint": {"host": self.endpoint.0, "port": self.endpoint.1}},
        })).await
    }

    /// The kubelet stand-in's identity: a ServiceAccount allowed to register Nodes, and its
    /// token with the relay's address in the `lab-kubelet` Secret.
    async fn kubelet_stand_in(&self) -> Result<(), LabError> {
        let ns = &self.namespace;
        let sa: Api<ServiceAccount> = Api::namespaced(self.client.clone(), ns);
        apply(
            &sa,
            &ServiceAccount {
                metadata: self.meta("lab-kubelet"),
                ..Default::default()
            },
        )
        .await?;
        apply(
            &Api::<ClusterRole>::all(self.client.clone()),
            &ClusterRole {
                metadata: ObjectMeta {
                    name: Some("metalboot-lab-kubelet".into()),
                    ..Default::default()
                },
                rules: Some(vec![
                    PolicyRule {
                        api_groups: Some(vec!["".into()]),
                        resources: Some(vec!["nodes".into()]),
                        verbs: vec![
                            "create".into(),
                            "get".into(),
                            "list".into(),
                            "watch".into(),
                            "patch".into(),
                            "update".into(),
                        ],
                        ..Default::default()
                    },
                    PolicyRule {
                        api_groups: Some(vec!["".into()]),
                        resources: Some(vec!["nodes/status".into()]),
                        verbs: vec!["patch".into(), "update".into()],
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            },
        )
        .await?;
        apply(
            &Api::<ClusterRoleBinding>::all(self.client.clone()),
            &ClusterRoleBinding {
                metadata: ObjectMeta {
                    // One binding per namespace: tests and benchmarks run several labs at once.
                    name: Some(format!("metalboot-lab-kubelet-{ns}")),
                    ..Default::default()
                },
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: "metalboot-lab-kubelet".into(),
                },
                subjects: Some(vec![Subject {
                    kind: "ServiceAccount".into(),
                    name: "lab-kubelet".into(),
                    namespace: Some(ns.clone()),
                    ..Default::default()
                }]),
            },
        )
        .await?;
        let token = sa
            .create_token_request(
                "lab-kubelet",
                &Default::default(),
                &TokenRequest {
                    spec: Some(TokenRequestSpec {
                        expiration_seconds: Some(48 * 3600),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            )
            .await?
            .status
            .and_then(|s| s.token)
            .ok_or_else(|| {
                LabError::Setup("the apiserver issued no token for the lab kubelet".into())
            })?;
        let kubelet_env = format!("APISERVER={}\nTOKEN={token}\n", self.kubelet_apiserver);
        self.secret(
            "lab-kubelet",
            None,
            vec![("kubelet.env", kubelet_env.into_bytes())],
        )
        .await?;
        Ok(())
    }

    /// `count` kubeadm workers: a MachineDeployment whose Machines upstream's kubeadm bootstrap
    /// provider renders from a KubeadmConfigTemplate (node name and provider ID from metalboot's
    /// meta-data through cloud-init's jinja, as CAPM3's templates do), on MetalMachines of the
    /// lab's Debian.
    pub async fn kubeadm_workers(&self, count: u32) -> Result<(), LabError> {
        let ns = &self.namespace;
        let name = format!("{CLUSTER}-workers");
        let mut spec = self.os_spec();
        spec["bootRetries"] = json!(1);
        self.apply_json(&self.dynamic("MetalMachineTemplate", "infrastructure.cluster.x-k8s.io", "v1alpha1", "metalmachinetemplates"), json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalMachineTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"template": {"spec": spec}},
        })).await?;
        self.apply_json(&self.dynamic("KubeadmConfigTemplate", "bootstrap.cluster.x-k8s.io", "v1beta2", "kubeadmconfigtemplates"), json!({
            "apiVersion": "bootstrap.cluster.x-k8s.io/v1beta2", "kind": "KubeadmConfigTemplate",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"template": {"spec": {"joinConfiguration": {"nodeRegistration": {
                "name": "{{ ds.meta_data.local_hostname }}",
                "criSocket": "unix:///run/containerd/containerd.sock",
                "kubeletExtraArgs": [{"name": "provider-id", "value": "{{ ds.meta_data.provider_id }}"}],
            }}}}},
        })).await?;
        self.apply_json(&self.dynamic("MachineDeployment", "cluster.x-k8s.io", "v1beta2", "machinedeployments"), json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterName": CLUSTER, "replicas": count,
                "selector": {"matchLabels": {"cluster.x-k8s.io/deployment-name": name}},
                "template": {
                    "metadata": {"labels": {"cluster.x-k8s.io/deployment-name": name}},
                    "spec": {"clusterName": CLUSTER, "version": crate::controlplane::kubernetes_version(),
                        "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "KubeadmConfigTemplate", "name": name}},
                        "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MetalMachineTemplate", "name": name}}}},
        })).await
    }

    /// Host `i`'s MetalHost: `lab-host-<i>` with the lab's MAC for `i`.
    pub async fn host(
        &self,
        i: u32,
        bmc: (&str, &str),
        uefi: bool,
        description: &str,
    ) -> Result<(), LabError> {
        self.apply_json(&self.dynamic("MetalHost", "infrastructure.cluster.x-k8s.io", "v1alpha1", "metalhosts"), json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalHost",
            "metadata": {"name": format!("lab-host-{i}"), "namespace": self.namespace,
                "labels": {"metalboot.io/role": "worker", "metalboot.io/failure-domain": format!("rack-{}", i % 2)}},
            "spec": {"bmc": {"address": bmc.0, "credentialsName": bmc.1},
                "bootMACAddress": mac_of(i), "online": true,
                "bootMode": if uefi { "UEFI" } else { "Legacy" },
                "description": description},
        })).await
    }

    /// Machine `lab-<i>` with its MetalMachine and CloudInitConfig. The first Machine is the
    /// control plane's: upstream core initialises the cluster (and starts watching its Nodes)
    /// once a control-plane Machine has a Node.
    pub async fn machine(&self, i: u32) -> Result<(), LabError> {
        let name = format!("lab-{i}");
        let ns = &self.namespace;
        self.apply_json(
            &self.dynamic(
                "CloudInitConfig",
                "bootstrap.cluster.x-k8s.io",
                "v1alpha1",
                "cloudinitconfigs",
            ),
            json!({
                "apiVersion": "bootstrap.cluster.x-k8s.io/v1alpha1", "kind": "CloudInitConfig",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "files": [{"path": "/etc/metalboot/kubelet.env", "permissions": "0600",
                        "contentFrom": {"secret": {"name": "lab-kubelet", "key": "kubelet.env"}}},
                        {"path": "/usr/local/sbin/metalboot-lab-register-node", "permissions": "0755",
                        "content": REGISTER_NODE}],
                    "commands": [format!("echo 'metalboot lab: bootstrapping {name}' > /dev/console"),
                        "/usr/local/sbin/metalboot-lab-register-node".to_string()],
                },
            }),
        )
        .await?;
        self.apply_json(
            &self.dynamic(
                "MetalMachine",
                "infrastructure.cluster.x-k8s.io",
                "v1alpha1",
                "metalmachines",
            ),
            json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1", "kind": "MetalMachine",
                "metadata": {"name": name, "namespace": ns},
                "spec": self.os_spec(),
            }),
        )
        .await?;
        let labels = if i == 0 {
            json!({CLUSTER_NAME_LABEL: CLUSTER, "cluster.x-k8s.io/control-plane": ""})
        } else {
            json!({CLUSTER_NAME_LABEL: CLUSTER})
        };
        self.apply_json(&self.dynamic("Machine", "cluster.x-k8s.io", "v1beta2", "machines"), json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"clusterName": CLUSTER, "version": crate::controlplane::kubernetes_version(),
                "bootstrap": {"configRef": {"apiGroup": "bootstrap.cluster.x-k8s.io", "kind": "CloudInitConfig", "name": name}},
                "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MetalMachine", "name": name}},
        })).await
    }
}

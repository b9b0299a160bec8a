//! Upstream Cluster API in tests: the release `hack/capi/build.sh` built from the Go module proxy
//! (clusterctl, the core and kubeadm bootstrap managers, their rendered components), a clusterctl
//! local repository holding those and metalboot's `deploy/` files, and a private apiserver per
//! test, because `clusterctl init` installs cluster-scoped CRDs that would replace the stand-ins
//! other tests of the binary use.
//!
//! clusterctl never reaches the network here: every provider URL is a local file, the version
//! check is off, `$HOME` is a temporary directory, and cert-manager is declared externally
//! provisioned (its real CRDs are installed; nothing runs pods, so cert-manager itself does not
//! run and out-of-cluster webhooks get self-signed certificates instead).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use metalboot::controlplane::{self, ControlPlane, Lifetime};
use serde::Deserialize;

/// metalboot's release as the local repository names it (Cargo's version).
pub const METALBOOT_VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));

pub fn project() -> PathBuf {
    controlplane::project_dir()
}

/// The pinned upstream release (hack/capi/versions.env).
pub fn capi_version() -> String {
    let env = std::fs::read_to_string(project().join("hack/capi/versions.env"))
        .expect("hack/capi/versions.env");
    env.lines()
        .find_map(|l| l.strip_prefix("CAPI_VERSION="))
        .expect("CAPI_VERSION in versions.env")
        .trim()
        .to_string()
}

/// Where hack/capi/build.sh put the release.
pub fn capi_dir() -> PathBuf {
    let dir = project().join("target/capi").join(capi_version());
    assert!(
        dir.join(".built").is_file(),
        "upstream Cluster API is not built in {}; run `make capi` (make test does)",
        dir.display()
    );
    dir
}

/// An apiserver of the test's own, stopped when dropped.
pub async fn private_control_plane(name: &str) -> ControlPlane {
    let data_dir = project().join("target/test-control-plane").join(format!(
        "{name}-{}-{:06x}",
        std::process::id(),
        rand::random::<u32>() >> 8
    ));
    controlplane::remove_at_exit(&data_dir);
    ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir,
        lifetime: Lifetime::TiedToThisProcess,
    })
    .await
    .unwrap_or_else(|e| panic!("private control plane {name}: {e}"))
}

/// A clusterctl local repository and config, and a clusterctl bound to one apiserver.
pub struct Clusterctl {
    pub bin: PathBuf,
    pub config: PathBuf,
    pub kubeconfig: PathBuf,
    pub repository: PathBuf,
    _home: tempfile::TempDir,
}

impl Clusterctl {
    /// Lays out the repository (`<type>-<name>/<version>/...`) under a temporary directory.
    pub fn new(kubeconfig: &Path) -> Clusterctl {
        let capi = capi_dir();
        let version = capi_version();
        let home = tempfile::tempdir().expect("tempdir");
        let repository = home.path().join("repository");
        let mut providers = String::from("providers:\n");
        let mut add = |label: &str, ty: &str, version: &str, files: &[(&str, PathBuf)]| {
            let dir = repository.join(label).join(version);
            std::fs::create_dir_all(&dir).expect("repository dir");
            for (name, source) in files {
                std::fs::copy(source, dir.join(name))
                    .unwrap_or_else(|e| panic!("copying {}: {e}", source.display()));
            }
            // The directory is `<type prefix>-<name>`; core's is just its name.
            let name = ["control-plane-", "bootstrap-", "infrastructure-"]
                .iter()
                .find_map(|prefix| label.strip_prefix(prefix))
                .unwrap_or(label);
            providers.push_str(&format!(
                "  - name: {name}\n    type: {ty}\n    url: file://{}\n",
                dir.join(files[0].0).display()
            ));
        };
        let upstream = |provider: &str, file: &str| {
            capi.join("components")
                .join(provider)
                .join(&version)
                .join(file)
        };
        add(
            "cluster-api",
            "CoreProvider",
            &version,
            &[
                (
                    "core-components.yaml",
                    upstream("cluster-api", "core-components.yaml"),
                ),
                ("metadata.yaml", upstream("cluster-api", "metadata.yaml")),
            ],
        );
        add(
            "bootstrap-kubeadm",
            "BootstrapProvider",
            &version,
            &[
                (
                    "bootstrap-components.yaml",
                    upstream("bootstrap-kubeadm", "bootstrap-components.yaml"),
                ),
                (
                    "metadata.yaml",
                    upstream("bootstrap-kubeadm", "metadata.yaml"),
                ),
            ],
        );
        add(
            "control-plane-kubeadm",
            "ControlPlaneProvider",
            &version,
            &[
                (
                    "control-plane-components.yaml",
                    upstream("control-plane-kubeadm", "control-plane-components.yaml"),
                ),
                (
                    "metadata.yaml",
                    upstream("control-plane-kubeadm", "metadata.yaml"),
                ),
            ],
        );
        let deploy = project().join("deploy");
        let mut infrastructure = vec![
            (
                "infrastructure-components.yaml",
                deploy.join("infrastructure-components.yaml"),
            ),
            ("metadata.yaml", deploy.join("metadata.yaml")),
        ];
        let templates: Vec<(String, PathBuf)> = shipped_flavors()
            .into_iter()
            .map(|(_, file)| {
                (
                    file.file_name()
                        .expect("name")
                        .to_string_lossy()
                        .into_owned(),
                    file,
                )
            })
            .collect();
        infrastructure.extend(templates.iter().map(|(n, p)| (n.as_str(), p.clone())));
        add(
            "infrastructure-metalboot",
            "InfrastructureProvider",
            METALBOOT_VERSION,
            &infrastructure,
        );
        add(
            "bootstrap-metalboot",
            "BootstrapProvider",
            METALBOOT_VERSION,
            &[
                (
                    "bootstrap-components.yaml",
                    deploy.join("bootstrap-components.yaml"),
                ),
                ("metadata.yaml", deploy.join("metadata.yaml")),
            ],
        );
        let config = home.path().join("clusterctl.yaml");
        std::fs::write(
            &config,
            format!("{providers}cert-manager:\n  externallyProvisioned: \"true\"\n"),
        )
        .expect("clusterctl config");
        Clusterctl {
            bin: capi.join("bin/clusterctl"),
            config,
            kubeconfig: kubeconfig.to_path_buf(),
            repository,
            _home: home,
        }
    }

    /// A clusterctl command with the config, the kubeconfig and no way out to the network.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--config")
            .arg(&self.config)
            .env("HOME", self._home.path())
            .env("XDG_CONFIG_HOME", self._home.path())
            .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
            // Anything that would leave the machine by mistake (a provider URL not found in the
            // config) meets a closed loopback port instead; the apiserver is reached directly.
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("HTTP_PROXY", "http://127.0.0.1:9")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("KUBECONFIG", &self.kubeconfig)
            .env_remove("GITHUB_TOKEN");
        cmd
    }

    /// Runs clusterctl with `args`; panics with its output when it fails.
    pub fn run(&self, args: &[&str], env: &[(&str, &str)]) -> String {
        let out = self.output(args, env);
        let text = text_of(&out);
        assert!(out.status.success(), "clusterctl {args:?} failed:\n{text}");
        text
    }

    pub fn output(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        let mut cmd = self.command();
        cmd.args(args).envs(env.iter().copied());
        cmd.output().expect("run clusterctl")
    }
}

pub fn text_of(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The cluster templates metalboot ships: (flavor, file); the default flavor is "".
pub fn shipped_flavors() -> Vec<(String, PathBuf)> {
    let deploy = project().join("deploy");
    let mut flavors: Vec<(String, PathBuf)> = std::fs::read_dir(&deploy)
        .expect("deploy/")
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let flavor = name
                .strip_prefix("cluster-template")?
                .strip_suffix(".yaml")?;
            Some((flavor.trim_start_matches('-').to_string(), e.path()))
        })
        .collect();
    flavors.sort();
    flavors
}

/// cert-manager's real CRDs (from its Go module), so clusterctl's check of an externally
/// provisioned cert-manager and the components' Certificates and Issuers are accepted.
pub async fn install_cert_manager_crds(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = capi_dir().join("cert-manager-crds");
    for entry in std::fs::read_dir(&dir)
        .expect("cert-manager CRDs")
        .flatten()
    {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read CRD");
        let crd: CustomResourceDefinition = serde_yaml::from_str(text.trim_start_matches("---\n"))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let name = crd.metadata.name.clone().expect("CRD name");
        crds.patch(
            &name,
            &PatchParams::apply("metalboot-test").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap_or_else(|e| panic!("installing {name}: {e}"));
        tokio::time::timeout(
            Duration::from_secs(60),
            await_condition(crds.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .unwrap_or_else(|_| panic!("{name} not established"))
        .expect("watch CRD");
    }
}

/// The CustomResourceDefinitions of one multi-document components file.
pub fn crds_in(components: &Path) -> Vec<CustomResourceDefinition> {
    let text = std::fs::read_to_string(components).expect("components");
    serde_yaml::Deserializer::from_str(&text)
        .filter_map(|doc| {
            let value = serde_yaml::Value::deserialize(doc).ok()?;
            (value.get("kind")?.as_str()? == "CustomResourceDefinition")
                .then(|| serde_yaml::from_value(value).expect("CRD"))
        })
        .collect()
}

/// A management cluster as clusterctl leaves it, with upstream core actually running: a private
/// apiserver, `clusterctl init --infrastructure metalboot --bootstrap metalboot`, and the core
/// manager out of cluster with its webhooks on loopback (self-signed certificate; the webhook
/// configurations and CRD conversion webhooks clusterctl installed are pointed at it).
/// metalboot itself is started by the test (in-process), so it can play hosts against it.
pub struct Management {
    pub plane: ControlPlane,
    pub client: kube::Client,
    pub clusterctl: Clusterctl,
    core: Option<std::process::Child>,
    pub core_log: PathBuf,
    _certs: tempfile::TempDir,
}

impl Drop for Management {
    fn drop(&mut self) {
        if let Some(mut core) = self.core.take() {
            let _ = core.kill();
            let _ = core.wait();
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Namespaces of the upstream providers whose webhooks run here (core only: no kubeadm objects
/// are created by these tests, so kubeadm's managers are installed but not run).
const RUNNING_WEBHOOK_NAMESPACES: &[&str] = &["capi-system"];

impl Management {
    pub async fn start(name: &str) -> Management {
        let plane = private_control_plane(name).await;
        let client = plane.client().await.expect("client");
        install_cert_manager_crds(&client).await;
        let clusterctl = Clusterctl::new(&plane.kubeconfig_path);
        clusterctl.run(
            &[
                "init",
                "--infrastructure",
                "metalboot",
                "--bootstrap",
                "metalboot",
            ],
            &[],
        );
        let certs = tempfile::tempdir().expect("tempdir");
        let ca = metalboot::pki::Ca::new("capi-webhooks-test-ca").expect("CA");
        let serving = ca
            .issue_server(&["localhost"], &[std::net::IpAddr::from([127, 0, 0, 1])])
            .expect("serving certificate");
        std::fs::write(certs.path().join("tls.crt"), &serving.cert_pem).expect("write cert");
        std::fs::write(certs.path().join("tls.key"), &serving.key_pem).expect("write key");
        let webhook_port = free_port();
        point_webhooks_at_loopback(&client, webhook_port, ca.cert_pem().as_bytes()).await;

        let health_port = free_port();
        let core_log = certs.path().join("capi-manager.log");
        let core = Command::new(capi_dir().join("bin/capi-manager"))
            .arg("--kubeconfig")
            .arg(&plane.kubeconfig_path)
            .arg(format!("--webhook-port={webhook_port}"))
            .arg("--webhook-cert-dir")
            .arg(certs.path())
            .arg("--diagnostics-address=0")
            .arg(format!("--health-addr=127.0.0.1:{health_port}"))
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&core_log).expect("log"))
            .spawn()
            .expect("start the upstream core manager");
        let mut management = Management {
            plane,
            client,
            clusterctl,
            core: Some(core),
            core_log,
            _certs: certs,
        };
        let http = reqwest::Client::new();
        let ready = format!("http://127.0.0.1:{health_port}/readyz");
        let mut ready_now = false;
        for _ in 0..240 {
            if let Some(core) = management.core.as_mut()
                && let Ok(Some(status)) = core.try_wait()
            {
                panic!(
                    "the core manager exited ({status}):\n{}",
                    management.core_log()
                );
            }
            if http
                .get(&ready)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                ready_now = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            ready_now,
            "the core manager never became ready:\n{}",
            management.core_log()
        );
        management
    }

    pub fn core_log(&self) -> String {
        controlplane::tail(&self.core_log, 60)
    }

    pub async fn namespace(&self, prefix: &str) -> String {
        let name = format!("{prefix}-{:06x}", rand::random::<u32>() >> 8);
        let ns = k8s_openapi::api::core::v1::Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<k8s_openapi::api::core::v1::Namespace>::all(self.client.clone())
            .create(&Default::default(), &ns)
            .await
            .expect("namespace");
        name
    }

    /// `kubectl apply --server-side` of a YAML stream, as an operator applies a generated cluster.
    pub fn apply(&self, yaml: &str) -> String {
        use std::io::Write;
        let mut child = Command::new(controlplane::default_bin_dir().join("kubectl"))
            .arg("--kubeconfig")
            .arg(&self.plane.kubeconfig_path)
            .args(["apply", "--server-side", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("kubectl");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(yaml.as_bytes())
            .expect("write");
        let out = child.wait_with_output().expect("kubectl apply");
        let text = text_of(&out);
        assert!(out.status.success(), "kubectl apply failed:\n{text}");
        text
    }
}

/// Every admission and conversion webhook of the running providers, to `https://127.0.0.1:<port>`.
async fn point_webhooks_at_loopback(client: &kube::Client, port: u16, ca_pem: &[u8]) {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
    };
    let repoint = |config: &mut WebhookClientConfig| -> bool {
        let Some(service) = &config.service else {
            return false;
        };
        if !RUNNING_WEBHOOK_NAMESPACES.contains(&service.namespace.as_str()) {
            return false;
        }
        let path = service.path.clone().unwrap_or_default();
        *config = WebhookClientConfig {
            url: Some(format!("https://127.0.0.1:{port}{path}")),
            ca_bundle: Some(ByteString(ca_pem.to_vec())),
            service: None,
        };
        true
    };
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    for mut config in mutating
        .list(&Default::default())
        .await
        .expect("list")
        .items
    {
        let mut changed = false;
        for webhook in config.webhooks.iter_mut().flatten() {
            changed |= repoint(&mut webhook.client_config);
        }
        if changed {
            mutating
                .replace(&config.name_any(), &Default::default(), &config)
                .await
                .expect("repoint mutating webhooks");
        }
    }
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    for mut config in validating
        .list(&Default::default())
        .await
        .expect("list")
        .items
    {
        let mut changed = false;
        for webhook in config.webhooks.iter_mut().flatten() {
            changed |= repoint(&mut webhook.client_config);
        }
        if changed {
            validating
                .replace(&config.name_any(), &Default::default(), &config)
                .await
                .expect("repoint validating webhooks");
        }
    }
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for mut crd in crds
        .list(&Default::default())
        .await
        .expect("list CRDs")
        .items
    {
        let Some(webhook) = crd
            .spec
            .conversion
            .as_mut()
            .and_then(|c| c.webhook.as_mut())
            .and_then(|w| w.client_config.as_mut())
        else {
            continue;
        };
        let Some(service) = &webhook.service else {
            continue;
        };
        if !RUNNING_WEBHOOK_NAMESPACES.contains(&service.namespace.as_str()) {
            continue;
        }
        let path = service.path.clone().unwrap_or_default();
        webhook.url = Some(format!("https://127.0.0.1:{port}{path}"));
        webhook.ca_bundle = Some(ByteString(ca_pem.to_vec()));
        webhook.service = None;
        crds.replace(&crd.name_any(), &Default::default(), &crd)
            .await
            .expect("repoint a conversion webhook");
    }
}

//! Upstream Cluster API as an operator installs it, for the lab and the tests: the release that
//! `hack/capi/build.sh` built from the Go module proxy, a clusterctl local repository laid out
//! from that release and from metalboot's `deploy/`, `clusterctl init`, and the core manager run
//! out of cluster with its webhooks on loopback.
//!
//! Nothing here reaches the network: provider URLs are local files, clusterctl's version check is
//! off and its `$HOME` is private, any stray HTTP(S) goes to a closed loopback port, and
//! cert-manager is declared externally provisioned. Nothing runs pods here, so cert-manager
//! itself does not run: its real CRDs are installed (clusterctl checks them and the components
//! create Certificates), and the core webhooks get a self-signed certificate instead.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};

use crate::controlplane::{self, Lifetime};

/// metalboot's release as the local repository names it.
pub const METALBOOT_VERSION: &str = concat!("v", env!("CARGO_PKG_VERSION"));

/// An upstream manager this crate runs out of cluster: its binary in the release and the
/// namespace its webhooks are declared in (their Services have no pods here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProvider {
    Core,
    KubeadmBootstrap,
}

impl UpstreamProvider {
    fn binary(self) -> &'static str {
        match self {
            UpstreamProvider::Core => "capi-manager",
            UpstreamProvider::KubeadmBootstrap => "kubeadm-bootstrap-manager",
        }
    }

    fn webhook_namespace(self) -> &'static str {
        match self {
            UpstreamProvider::Core => "capi-system",
            UpstreamProvider::KubeadmBootstrap => "capi-kubeadm-bootstrap-system",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("upstream Cluster API is not built in {0}; run `make capi` (hack/capi/build.sh)")]
    NotBuilt(PathBuf),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed:\n{output}")]
    Command { what: String, output: String },
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("the upstream manager: {0}; its log is {1}")]
    Core(String, PathBuf),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> UpstreamError {
    let what = what.into();
    move |source| UpstreamError::Io { what, source }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> UpstreamError {
    let what = what.into();
    move |source| UpstreamError::Kube { what, source }
}

/// The pinned release as `hack/capi/build.sh` left it under `target/capi/<version>`.
#[derive(Debug, Clone)]
pub struct Release {
    pub version: String,
    pub dir: PathBuf,
}

impl Release {
    pub fn locate() -> Result<Release, UpstreamError> {
        let project = controlplane::project_dir();
        let pin = project.join("hack/capi/versions.env");
        let text =
            std::fs::read_to_string(&pin).map_err(io(format!("reading {}", pin.display())))?;
        let version = text
            .lines()
            .find_map(|l| l.strip_prefix("CAPI_VERSION="))
            .map(|v| v.trim().to_string())
            .ok_or_else(|| {
                UpstreamError::Invalid(format!("no CAPI_VERSION in {}", pin.display()))
            })?;
        let dir = project.join("target/capi").join(&version);
        if !dir.join(".built").is_file() {
            return Err(UpstreamError::NotBuilt(dir));
        }
        Ok(Release { version, dir })
    }

    pub fn clusterctl(&self) -> PathBuf {
        self.dir.join("bin/clusterctl")
    }

    /// A provider's file in the release's rendered components (`cluster-api`, `bootstrap-kubeadm`, …).
    pub fn component(&self, provider: &str, file: &str) -> PathBuf {
        self.dir
            .join("components")
            .join(provider)
            .join(&self.version)
            .join(file)
    }
}

/// A clusterctl local repository and the config naming it, with a private `$HOME`.
#[derive(Debug, Clone)]
pub struct LocalRepository {
    pub config: PathBuf,
    pub home: PathBuf,
}

/// Lays out `<dir>/repository/<type>-<name>/<version>/…` for upstream core, kubeadm (bootstrap
/// and control plane) and metalboot (infrastructure with every shipped cluster template, and
/// bootstrap), and writes `<dir>/clusterctl.yaml`.
pub fn write_local_repository(
    release: &Release,
    deploy: &Path,
    dir: &Path,
) -> Result<LocalRepository, UpstreamError> {
    let repository = dir.join("repository");
    let mut providers = String::from("providers:\n");
    let mut add = |name: &str,
                   kind: &str,
                   version: &str,
                   files: &[(String, PathBuf)]|
     -> Result<(), UpstreamError> {
        let label = match kind {
            "CoreProvider" => name.to_string(),
            "BootstrapProvider" => format!("bootstrap-{name}"),
            "ControlPlaneProvider" => format!("control-plane-{name}"),
            _ => format!("infrastructure-{name}"),
        };
        let target = repository.join(&label).join(version);
        std::fs::create_dir_all(&target).map_err(io(format!("creating {}", target.display())))?;
        for (file, source) in files {
            std::fs::copy(source, target.join(file))
                .map_err(io(format!("copying {}", source.display())))?;
        }
        let first = files
            .first()
            .ok_or_else(|| UpstreamError::Invalid(format!("no files for {label}")))?;
        providers.push_str(&format!(
            "  - name: {name}\n    type: {kind}\n    url: file://{}\n",
            target.join(&first.0).display()
        ));
        Ok(())
    };
    let upstream =
        |provider: &str, file: &str| (file.to_string(), release.component(provider, file));
    add(
        "cluster-api",
        "CoreProvider",
        &release.version,
        &[
            upstream("cluster-api", "core-components.yaml"),
            upstream("cluster-api", "metadata.yaml"),
        ],
    )?;
    add(
        "kubeadm",
        "BootstrapProvider",
        &release.version,
        &[
            upstream("bootstrap-kubeadm", "bootstrap-components.yaml"),
            upstream("bootstrap-kubeadm", "metadata.yaml"),
        ],
    )?;
    add(
        "kubeadm",
        "ControlPlaneProvider",
        &release.version,
        &[
            upstream("control-plane-kubeadm", "control-plane-components.yaml"),
            upstream("control-plane-kubeadm", "metadata.yaml"),
        ],
    )?;
    let ours = |file: &str| (file.to_string(), deploy.join(file));
    let mut infrastructure = vec![
        ours("infrastructure-components.yaml"),
        ours("metadata.yaml"),
    ];
    let mut templates: Vec<String> = std::fs::read_dir(deploy)
        .map_err(io(format!("reading {}", deploy.display())))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("cluster-template") && n.ends_with(".yaml"))
        .collect();
    templates.sort();
    infrastructure.extend(templates.iter().map(|t| ours(t)));
    add(
        "metalboot",
        "InfrastructureProvider",
        METALBOOT_VERSION,
        &infrastructure,
    )?;
    add(
        "metalboot",
        "BootstrapProvider",
        METALBOOT_VERSION,
        &[ours("bootstrap-components.yaml"), ours("metadata.yaml")],
    )?;
    let config = dir.join("clusterctl.yaml");
    std::fs::write(
        &config,
        format!("{providers}cert-manager:\n  externallyProvisioned: \"true\"\n"),
    )
    .map_err(io(format!("writing {}", config.display())))?;
    let home = dir.join("home");
    std::fs::create_dir_all(&home).map_err(io(format!("creating {}", home.display())))?;
    Ok(LocalRepository { config, home })
}

/// A clusterctl command bound to `kubeconfig` and the local repository, with no way out.
pub fn clusterctl(release: &Release, repository: &LocalRepository, kubeconfig: &Path) -> Command {
    let mut cmd = Command::new(release.clusterctl());
    cmd.arg("--config")
        .arg(&repository.config)
        .env("HOME", &repository.home)
        .env("XDG_CONFIG_HOME", &repository.home)
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .env("KUBECONFIG", kubeconfig)
        // Anything that would leave the machine by mistake (a provider URL not in the config)
        // meets a closed loopback port instead; the apiserver on loopback is reached directly.
        .env("HTTPS_PROXY", "http://127.0.0.1:9")
        .env("HTTP_PROXY", "http://127.0.0.1:9")
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("GITHUB_TOKEN");
    cmd
}

pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command to completion; its output is the error when it fails.
pub fn run(what: &str, cmd: &mut Command) -> Result<String, UpstreamError> {
    let out = cmd.output().map_err(io(format!("running {what}")))?;
    let text = output_text(&out);
    if out.status.success() {
        Ok(text)
    } else {
        Err(UpstreamError::Command {
            what: what.to_string(),
            output: text,
        })
    }
}

/// cert-manager's real CRDs (from its Go module, at the version this clusterctl installs).
pub async fn install_cert_manager_crds(
    client: &kube::Client,
    release: &Release,
) -> Result<(), UpstreamError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = release.dir.join("cert-manager-crds");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(io(format!("reading {}", dir.display())))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let text =
            std::fs::read_to_string(&path).map_err(io(format!("reading {}", path.display())))?;
        let crd: CustomResourceDefinition = serde_yaml::from_str(text.trim_start_matches("---\n"))
            .map_err(|e| UpstreamError::Invalid(format!("{}: {e}", path.display())))?;
        let name = crd.name_any();
        crds.patch(
            &name,
            &PatchParams::apply("metalboot").force(),
            &Patch::Apply(&crd),
        )
        .await
        .map_err(kube_err(format!("installing {name}")))?;
        tokio::time::timeout(
            Duration::from_secs(60),
            await_condition(crds.clone(), &name, conditions::is_crd_established()),
        )
        .await
        .map_err(|_| UpstreamError::Invalid(format!("{name} was not established within 60 s")))?
        .map_err(|e| UpstreamError::Invalid(format!("watching {name}: {e}")))?;
    }
    Ok(())
}

/// Every admission and conversion webhook served from `namespace`, to `https://127.0.0.1:<port>`.
pub async fn point_webhooks_at_loopback(
    client: &kube::Client,
    namespace: &str,
    port: u16,
    ca_pem: &[u8],
) -> Result<(), UpstreamError> {
    let repoint = |config: &mut WebhookClientConfig| -> bool {
        let Some(service) = &config.service else {
            return false;
        };
        if service.namespace != namespace {
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
    repoint_all(
        &Api::<MutatingWebhookConfiguration>::all(client.clone()),
        "mutating webhooks",
        |c| {
            c.webhooks
                .iter_mut()
                .flatten()
                .map(|w| &mut w.client_config)
                .collect()
        },
        &repoint,
    )
    .await?;
    repoint_all(
        &Api::<ValidatingWebhookConfiguration>::all(client.clone()),
        "validating webhooks",
        |c| {
            c.webhooks
                .iter_mut()
                .flatten()
                .map(|w| &mut w.client_config)
                .collect()
        },
        &repoint,
    )
    .await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for mut crd in crds
        .list(&Default::default())
        .await
        .map_err(kube_err("listing CRDs"))?
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
        if service.namespace != namespace {
            continue;
        }
        let path = service.path.clone().unwrap_or_default();
        webhook.url = Some(format!("https://127.0.0.1:{port}{path}"));
        webhook.ca_bundle = Some(ByteString(ca_pem.to_vec()));
        webhook.service = None;
        crds.replace(&crd.name_any(), &Default::default(), &crd)
            .await
            .map_err(kube_err(format!(
                "repointing {}'s conversion webhook",
                crd.name_any()
            )))?;
    }
    Ok(())
}

/// Applies `repoint` to every webhook client config of every object of kind `K` and writes back
/// the objects it changed.
async fn repoint_all<K>(
    api: &Api<K>,
    what: &str,
    configs: fn(&mut K) -> Vec<&mut WebhookClientConfig>,
    repoint: &impl Fn(&mut WebhookClientConfig) -> bool,
) -> Result<(), UpstreamError>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    for mut object in api
        .list(&Default::default())
        .await
        .map_err(kube_err(format!("listing {what}")))?
        .items
    {
        let mut changed = false;
        for config in configs(&mut object) {
            changed |= repoint(config);
        }
        if changed {
            api.replace(&object.name_any(), &Default::default(), &object)
                .await
                .map_err(kube_err(format!("repointing {what}")))?;
        }
    }
    Ok(())
}

fn free_port() -> Result<u16, UpstreamError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(io("finding a free port"))
}

/// An upstream manager (core, or the kubeadm bootstrap provider), running out of cluster; killed
/// when dropped (and with this process).
pub struct UpstreamManager {
    child: Child,
    pub log: PathBuf,
}

/// Upstream core's manager.
pub type CoreManager = UpstreamManager;

impl UpstreamManager {
    /// Starts core against `kubeconfig` (see [`UpstreamManager::start_provider`]).
    pub async fn start(
        client: &kube::Client,
        release: &Release,
        kubeconfig: &Path,
        dir: &Path,
    ) -> Result<UpstreamManager, UpstreamError> {
        Self::start_provider(client, release, UpstreamProvider::Core, kubeconfig, dir).await
    }

    /// Starts `provider`'s manager against `kubeconfig` with its webhooks on loopback, after
    /// pointing the installed webhook configurations at them, and waits until it is ready.
    pub async fn start_provider(
        client: &kube::Client,
        release: &Release,
        provider: UpstreamProvider,
        kubeconfig: &Path,
        dir: &Path,
    ) -> Result<UpstreamManager, UpstreamError> {
        let binary = provider.binary();
        let certs = dir.join(format!("{binary}-webhook-certs"));
        std::fs::create_dir_all(&certs).map_err(io(format!("creating {}", certs.display())))?;
        let cert_error =
            |e: rcgen::Error| UpstreamError::Invalid(format!("webhook certificate: {e}"));
        let ca = crate::pki::Ca::new("metalboot-capi-webhooks").map_err(cert_error)?;
        let serving = ca
            .issue_server(&["localhost"], &[IpAddr::from([127, 0, 0, 1])])
            .map_err(cert_error)?;
        std::fs::write(certs.join("tls.crt"), &serving.cert_pem).map_err(io("writing tls.crt"))?;
        std::fs::write(certs.join("tls.key"), &serving.key_pem).map_err(io("writing tls.key"))?;
        let webhook_port = free_port()?;
        point_webhooks_at_loopback(
            client,
            provider.webhook_namespace(),
            webhook_port,
            ca.cert_pem().as_bytes(),
        )
        .await?;

        let health_port = free_port()?;
        let log = dir.join(format!("{binary}.log"));
        let mut cmd = Command::new(release.dir.join("bin").join(binary));
        cmd.arg("--kubeconfig")
            .arg(kubeconfig)
            .arg(format!("--webhook-port={webhook_port}"))
            .arg("--webhook-cert-dir")
            .arg(&certs)
            .arg("--diagnostics-address=0")
            .arg(format!("--health-addr=127.0.0.1:{health_port}"))
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("NO_PROXY", "127.0.0.1,localhost");
        let child =
            controlplane::spawn(binary, cmd, &log, Lifetime::TiedToThisProcess).map_err(|e| {
                UpstreamError::Core(format!("{binary} did not start: {e}"), log.clone())
            })?;
        let mut core = UpstreamManager { child, log };
        let http = reqwest::Client::new();
        let ready = format!("http://127.0.0.1:{health_port}/readyz");
        for _ in 0..480 {
            if let Ok(Some(status)) = core.child.try_wait() {
                return Err(UpstreamError::Core(
                    format!("{binary} exited ({status})"),
                    core.log.clone(),
                ));
            }
            if http
                .get(&ready)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return Ok(core);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(UpstreamError::Core(
            format!("{binary} was not ready within 2 minutes"),
            core.log.clone(),
        ))
    }

    /// The last lines of its log, for error messages.
    pub fn log_tail(&self) -> String {
        controlplane::tail(&self.log, 60)
    }
}

impl Drop for UpstreamManager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A management cluster as `clusterctl init --infrastructure metalboot --bootstrap metalboot`
/// leaves it (cert-manager's CRDs first), with upstream core running; with `kubeadm`, upstream's
/// kubeadm bootstrap provider is installed (`--bootstrap metalboot,kubeadm`) and runs too.
pub async fn install(
    client: &kube::Client,
    kubeconfig: &Path,
    dir: &Path,
    kubeadm: bool,
) -> Result<(Release, LocalRepository, Vec<UpstreamManager>), UpstreamError> {
    let release = Release::locate()?;
    let repository =
        write_local_repository(&release, &controlplane::project_dir().join("deploy"), dir)?;
    install_cert_manager_crds(client, &release).await?;
    let bootstrap = if kubeadm {
        "metalboot,kubeadm"
    } else {
        "metalboot"
    };
    run(
        "clusterctl init",
        clusterctl(&release, &repository, kubeconfig).args([
            "init",
            "--infrastructure",
            "metalboot",
            "--bootstrap",
            bootstrap,
        ]),
    )?;
    let mut managers = vec![UpstreamManager::start(client, &release, kubeconfig, dir).await?];
    if kubeadm {
        managers.push(
            UpstreamManager::start_provider(
                client,
                &release,
                UpstreamProvider::KubeadmBootstrap,
                kubeconfig,
                dir,
            )
            .await?,
        );
    }
    Ok((release, repository, managers))
}

/// What Cluster API needs from a control plane it does not manage before workers can join it
/// (the `ExistingControlPlane` of the `kubeadm-workers` flavor): `<cluster>-ca` (the cluster CA,
/// whose hash goes into every join configuration; the kubeadm bootstrap provider wants a
/// non-empty key beside it, and the lab, which owns its CA, gives the real one) and `<cluster>-kubeconfig` (how core and the bootstrap provider reach the workload
/// cluster: bootstrap tokens, Nodes, drains), both labelled with the cluster's name.
pub async fn write_cluster_secrets(
    client: &kube::Client,
    namespace: &str,
    cluster: &str,
    ca: (&str, &str),
    kubeconfig_yaml: &str,
) -> Result<(), UpstreamError> {
    use k8s_openapi::api::core::v1::Secret;

    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let labelled = |name: String, data: Vec<(&str, &str)>| Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name),
            labels: Some(
                [(
                    "cluster.x-k8s.io/cluster-name".to_string(),
                    cluster.to_string(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        type_: Some("cluster.x-k8s.io/secret".into()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Default::default()
    };
    let (ca_cert, ca_key) = ca;
    for secret in [
        labelled(
            format!("{cluster}-ca"),
            vec![("tls.crt", ca_cert), ("tls.key", ca_key)],
        ),
        labelled(
            format!("{cluster}-kubeconfig"),
            vec![("value", kubeconfig_yaml)],
        ),
    ] {
        let name = secret.name_any();
        secrets
            .patch(
                &name,
                &PatchParams::apply("metalboot-lab").force(),
                &Patch::Apply(&secret),
            )
            .await
            .map_err(kube_err(format!("writing Secret {namespace}/{name}")))?;
    }
    Ok(())
}

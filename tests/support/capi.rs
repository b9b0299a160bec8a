//! Upstream Cluster API in tests: the release `hack/capi/build.sh` built from the Go module proxy
//! (clusterctl, the core and kubeadm bootstrap managers, their rendered components), a clusterctl
//! local repository holding those and metalboot's `deploy/` files, and a private apiserver per
//! test, because `clusterctl init` installs cluster-scoped CRDs that would replace the stand-ins
//! other tests of the binary use.
//!
//! The parts an operator's install is made of live in `metalboot::lab::upstream` (the lab uses
//! them too); this module adapts them to tests (panics with the cause, temporary directories).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use metalboot::controlplane::{self, ControlPlane, Lifetime};
use metalboot::lab::upstream::{
    self, CoreManager, LocalRepository, Release, UpstreamManager, UpstreamProvider,
};
use serde::Deserialize;

pub fn project() -> PathBuf {
    controlplane::project_dir()
}

pub fn release() -> Release {
    Release::locate().unwrap_or_else(|e| panic!("{e}"))
}

/// The pinned upstream release (hack/capi/versions.env).
pub fn capi_version() -> String {
    release().version
}

/// Where hack/capi/build.sh put the release.
pub fn capi_dir() -> PathBuf {
    release().dir
}

/// An apiserver of the test's own, stopped when dropped.
pub async fn private_control_plane(name: &str) -> ControlPlane {
    private_control_plane_with(name, false).await
}

/// An apiserver of the test's own, join-ready for kubeadm join when asked
/// (`controlplane::Options::join_ready`), stopped when dropped.
pub async fn private_control_plane_with(name: &str, join_ready: bool) -> ControlPlane {
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
        join_ready,
    })
    .await
    .unwrap_or_else(|e| panic!("private control plane {name}: {e}"))
}

/// clusterctl with a local repository made from the release and `deploy/`, bound to one apiserver.
pub struct Clusterctl {
    pub release: Release,
    pub repository: LocalRepository,
    pub kubeconfig: PathBuf,
    dir: tempfile::TempDir,
}

impl Clusterctl {
    pub fn new(kubeconfig: &Path) -> Clusterctl {
        let release = release();
        let dir = tempfile::tempdir().expect("tempdir");
        let repository =
            upstream::write_local_repository(&release, &project().join("deploy"), dir.path())
                .unwrap_or_else(|e| panic!("local repository: {e}"));
        Clusterctl {
            release,
            repository,
            kubeconfig: kubeconfig.to_path_buf(),
            dir,
        }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn command(&self) -> Command {
        upstream::clusterctl(&self.release, &self.repository, &self.kubeconfig)
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
    upstream::output_text(out)
}

pub async fn install_cert_manager_crds(client: &kube::Client) {
    upstream::install_cert_manager_crds(client, &release())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
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

/// A management cluster as clusterctl leaves it, with upstream core running
/// (`metalboot::lab::upstream::install`). metalboot itself is started by the test (in-process),
/// so it can play hosts against it.
pub struct Management {
    pub plane: ControlPlane,
    pub client: kube::Client,
    pub clusterctl: Clusterctl,
    core: CoreManager,
    kubeadm_bootstrap: Option<UpstreamManager>,
}

impl Management {
    pub async fn start(name: &str) -> Management {
        Self::start_with(name, false).await
    }

    /// With `kubeadm`: a join-ready apiserver (it is also the workload cluster kubeadm joins),
    /// and upstream's kubeadm bootstrap provider installed by clusterctl beside metalboot's and
    /// running out of cluster like core.
    pub async fn start_with(name: &str, kubeadm: bool) -> Management {
        let plane = private_control_plane_with(name, kubeadm).await;
        let client = plane.client().await.expect("client");
        install_cert_manager_crds(&client).await;
        let clusterctl = Clusterctl::new(&plane.kubeconfig_path);
        let bootstrap = if kubeadm {
            "metalboot,kubeadm"
        } else {
            "metalboot"
        };
        clusterctl.run(
            &[
                "init",
                "--infrastructure",
                "metalboot",
                "--bootstrap",
                bootstrap,
            ],
            &[],
        );
        let core = CoreManager::start(
            &client,
            &clusterctl.release,
            &plane.kubeconfig_path,
            clusterctl.dir(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        let kubeadm_bootstrap = if kubeadm {
            Some(
                UpstreamManager::start_provider(
                    &client,
                    &clusterctl.release,
                    UpstreamProvider::KubeadmBootstrap,
                    &plane.kubeconfig_path,
                    clusterctl.dir(),
                )
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            )
        } else {
            None
        };
        Management {
            plane,
            client,
            clusterctl,
            core,
            kubeadm_bootstrap,
        }
    }

    pub fn core_log(&self) -> String {
        self.core.log_tail()
    }

    /// The kubeadm bootstrap provider's log (empty when it does not run).
    pub fn kubeadm_bootstrap_log(&self) -> String {
        self.kubeadm_bootstrap
            .as_ref()
            .map(|m| m.log_tail())
            .unwrap_or_default()
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

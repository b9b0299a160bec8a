//! What `kubeadm init` leaves on a control plane for joining nodes, made by the real kubeadm
//! phases against a join-ready test control plane. Used by `control_plane` and `capi_kubeadm`.
#![allow(dead_code)]

use std::path::Path;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::Api;
use metalboot::controlplane;

/// The Kubernetes release the control plane, kubeadm and kubelet are built from.
pub fn kubernetes_version() -> String {
    metalboot::controlplane::kubernetes_version().to_string()
}

/// A bootstrap token in kubeadm's form, `[a-z0-9]{6}.[a-z0-9]{16}`.
pub fn random_token() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let mut pick = |n: usize| -> String {
        (0..n)
            .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char)
            .collect()
    };
    format!("{}.{}", pick(6), pick(16))
}

/// The `kubeadm init` phases with `token` (`controlplane::kubeadm_init_phases`), the
/// control-plane endpoint being `endpoint_host` at the apiserver's port.
pub fn init_phases(kubeconfig: &Path, server: &str, token: &str, endpoint_host: &str, dir: &Path) {
    let port: u16 = server
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("apiserver port");
    controlplane::kubeadm_init_phases(
        &controlplane::default_bin_dir(),
        kubeconfig,
        (endpoint_host, port),
        token,
        dir,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

/// kubeadm's `--discovery-token-ca-cert-hash`: sha256 of the CA's SubjectPublicKeyInfo.
pub fn ca_cert_hash(ca_pem: &str, dir: &Path) -> String {
    let ca = dir.join("ca.crt");
    std::fs::write(&ca, ca_pem).expect("write CA");
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl x509 -in '{}' -noout -pubkey | openssl pkey -pubin -outform DER | sha256sum",
            ca.display()
        ))
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {out:?}");
    let hex = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .expect("digest")
        .to_string();
    assert_eq!(hex.len(), 64, "sha256 hex: {hex}");
    format!("sha256:{hex}")
}

/// The `kubeadm init` phases, then `cluster-info` pointed at 10.0.2.2, where QEMU's user-mode
/// hosts reach the apiserver (`controlplane::prepare_for_joins`).
pub async fn prepare_for_joins(kubeconfig: &Path, server: &str, client: &kube::Client) {
    let port: u16 = server
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("apiserver port");
    let dir = tempfile::tempdir().expect("tempdir");
    controlplane::prepare_for_joins(
        client,
        &controlplane::default_bin_dir(),
        kubeconfig,
        ("10.0.2.2", port),
        dir.path(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// The bootstrap signer's signature of cluster-info for `token`.
pub fn signature(cm: &ConfigMap, token: &str) -> Option<String> {
    let id = token.split('.').next().unwrap_or_default();
    cm.data
        .as_ref()
        .and_then(|d| d.get(&format!("jws-kubeconfig-{id}")))
        .cloned()
}

/// Waits until cluster-info carries a signature for `token` (kubeadm join's discovery needs it).
pub async fn until_signed(client: &kube::Client, token: &str) -> ConfigMap {
    let public: Api<ConfigMap> = Api::namespaced(client.clone(), "kube-public");
    crate::support::eventually("cluster-info signed for the token", 120, || async {
        public
            .get_opt("cluster-info")
            .await
            .ok()
            .flatten()
            .filter(|cm| signature(cm, token).is_some())
    })
    .await
}

//! The foundation: a real kube-apiserver built from source, CRDs and custom objects on it, and the
//! CLI's behaviour when no cluster can be reached.

#[path = "support/kubeadm.rs"]
mod kubeadm;
mod support;

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, conditions, wait::await_condition, watcher};
use kube::{CustomResource, CustomResourceExt, ResourceExt};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A throwaway CRD that exists only to prove CRDs and custom objects work on our control plane.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, JsonSchema)]
#[kube(
    group = "test.metalboot.dev",
    version = "v1",
    kind = "Widget",
    namespaced
)]
struct WidgetSpec {
    size: i32,
}

#[tokio::test]
async fn crd_and_custom_object_lifecycle_on_the_real_apiserver() {
    let ns = support::namespace("foundation").await;
    let crds: Api<CustomResourceDefinition> = Api::all(ns.client.clone());
    crds.patch(
        "widgets.test.metalboot.dev",
        &PatchParams::apply("metalboot-test").force(),
        &Patch::Apply(Widget::crd()),
    )
    .await
    .expect("apply the Widget CRD");
    tokio::time::timeout(
        Duration::from_secs(30),
        await_condition(
            crds,
            "widgets.test.metalboot.dev",
            conditions::is_crd_established(),
        ),
    )
    .await
    .expect("CRD established in time")
    .expect("watching the CRD");

    let widgets: Api<Widget> = Api::namespaced(ns.client.clone(), &ns.name);
    let created = widgets
        .create(
            &PostParams::default(),
            &Widget::new("w1", WidgetSpec { size: 1 }),
        )
        .await
        .expect("create a Widget");
    assert_eq!(created.spec.size, 1);
    let read = widgets.get("w1").await.expect("read it back");
    assert_eq!(read.spec.size, 1);
    assert_eq!(read.uid(), created.uid());

    // Watch from the version we read, then change the object: the watch must see the change.
    let mut updates = watcher(
        widgets.clone(),
        watcher::Config::default().fields("metadata.name=w1"),
    )
    .applied_objects()
    .boxed();
    let patch = serde_json::json!({"spec": {"size": 7}});
    widgets
        .patch("w1", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("update the Widget");
    let seen = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(w) = updates.try_next().await.expect("watch stream") {
            if w.spec.size == 7 {
                return w;
            }
        }
        panic!("watch ended before the update arrived");
    })
    .await
    .expect("watch delivered the update in time");
    assert_eq!(seen.spec.size, 7);

    widgets
        .delete("w1", &DeleteParams::default())
        .await
        .expect("delete the Widget");
    let gone = widgets.get_opt("w1").await.expect("read after delete");
    assert!(gone.is_none(), "Widget still there after delete");
}

#[test]
fn kubectl_reports_the_pinned_version() {
    let plane = support::control_plane();
    let kubectl = metalboot::controlplane::default_bin_dir().join("kubectl");
    let out = std::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig_path)
        .args(["get", "--raw", "/version"])
        .output()
        .expect("run kubectl");
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let version: serde_json::Value = serde_json::from_slice(&out.stdout).expect("/version is JSON");
    assert_eq!(version["gitVersion"], kubeadm::kubernetes_version());
}

#[test]
fn manager_reports_the_cluster_it_connected_to() {
    let plane = support::control_plane();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .arg("manager")
        .arg("--kubeconfig")
        .arg(&plane.kubeconfig_path)
        .arg("--check-connection")
        .output()
        .expect("run metalboot manager");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "manager failed: {stderr}");
    assert!(
        stderr.contains(&plane.server),
        "log names the server: {stderr}"
    );
}

#[test]
fn manager_logs_json_lines_when_asked() {
    let plane = support::control_plane();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args([
            "--log-format",
            "json",
            "manager",
            "--check-connection",
            "--kubeconfig",
        ])
        .arg(&plane.kubeconfig_path)
        .output()
        .expect("run metalboot manager");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "manager failed: {stderr}");
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| {
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {l}"))
        })
        .collect();
    assert!(
        lines.iter().any(|l| l["fields"]["server"]
            .as_str()
            .is_some_and(|s| s.trim_end_matches('/') == plane.server)),
        "a JSON line carries the server: {stderr}"
    );
}

/// A CONNECT proxy on loopback that counts the tunnels it opened (to loopback targets only).
async fn counting_proxy() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let tunnels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = tunnels.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut client = BufReader::new(socket);
                let mut request = String::new();
                client.read_line(&mut request).await.ok()?;
                let target = request
                    .strip_prefix("CONNECT ")?
                    .split_whitespace()
                    .next()?
                    .to_string();
                if !target.starts_with("127.0.0.1:") {
                    return None;
                }
                loop {
                    let mut header = String::new();
                    client.read_line(&mut header).await.ok()?;
                    if header.trim().is_empty() {
                        break;
                    }
                }
                let mut upstream = tokio::net::TcpStream::connect(&target).await.ok()?;
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut client = client.into_inner();
                client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .ok()?;
                tokio::io::copy_bidirectional(&mut client, &mut upstream)
                    .await
                    .ok()
            });
        }
    });
    (url, tunnels)
}

/// Outside a cluster, HTTPS_PROXY is honoured for the apiserver, and NO_PROXY exempts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manager_reaches_the_apiserver_through_https_proxy_unless_no_proxy_covers_it() {
    let plane = support::control_plane();
    let (proxy, tunnels) = counting_proxy().await;
    let check = |proxy: &str, no_proxy: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
            .args(["manager", "--check-connection", "--kubeconfig"])
            .arg(&plane.kubeconfig_path)
            .env("HTTPS_PROXY", proxy)
            .env("NO_PROXY", no_proxy)
            .env_remove("https_proxy")
            .env_remove("no_proxy")
            .output()
            .expect("run metalboot manager")
    };
    let proxied = {
        let proxy = proxy.clone();
        tokio::task::spawn_blocking(move || check(&proxy, ""))
    }
    .await
    .expect("join");
    let stderr = String::from_utf8_lossy(&proxied.stderr);
    assert!(proxied.status.success(), "through the proxy: {stderr}");
    assert!(
        tunnels.load(std::sync::atomic::Ordering::SeqCst) >= 1,
        "the connection went through HTTPS_PROXY"
    );
    // A proxy that refuses every connection: only NO_PROXY lets the manager in.
    let direct = tokio::task::spawn_blocking(move || check("http://127.0.0.1:9", "127.0.0.1"))
        .await
        .expect("join");
    assert!(
        direct.status.success(),
        "NO_PROXY covers the apiserver: {}",
        String::from_utf8_lossy(&direct.stderr)
    );
}

/// A kubeconfig for `server` whose user is `user` (a token or a client certificate).
fn kubeconfig_with(
    server: &str,
    ca_pem: &str,
    user: serde_json::Value,
) -> kube::config::Kubeconfig {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "certificate-authority-data": b64(ca_pem)}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }))
    .expect("kubeconfig")
}

async fn client_for(kubeconfig: kube::config::Kubeconfig) -> kube::Client {
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .expect("client config");
    kube::Client::try_from(config).expect("client")
}

/// Issue 16's first build item, on the real parts: a join-ready control plane (bootstrap-token
/// authentication, Node authorizer, NodeRestriction, kube-controller-manager) set up by the real
/// `kubeadm init phase bootstrap-token` and `upload-config`, then a kubelet's TLS bootstrap done
/// by the test with the token: the CSR is auto-approved and signed by kube-controller-manager,
/// and its certificate acts as `system:node:worker-0` within what NodeRestriction allows. A
/// deleted token authenticates nothing. The kubelet itself is not here yet.
#[tokio::test]
async fn a_join_ready_control_plane_signs_a_kubelet_csr_made_with_a_bootstrap_token() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::certificates::v1::{
        CertificateSigningRequest, CertificateSigningRequestSpec,
    };
    use k8s_openapi::api::core::v1::{ConfigMap, Node, Secret};
    use metalboot::controlplane::{self, ControlPlane, Lifetime};

    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir: dir.path().to_path_buf(),
        lifetime: Lifetime::TiedToThisProcess,
        join_ready: true,
    })
    .await
    .expect("join-ready control plane");
    let admin = cp.client().await.expect("admin client");

    let token = kubeadm::random_token();
    let token_id = token.split('.').next().expect("token id").to_string();
    kubeadm::init_phases(
        &cp.kubeconfig_path,
        &cp.server,
        &token,
        "127.0.0.1",
        dir.path(),
    );

    // kube-controller-manager's bootstrap signer signs cluster-info with the token.
    let public: Api<ConfigMap> = Api::namespaced(admin.clone(), "kube-public");
    let signature_key = format!("jws-kubeconfig-{token_id}");
    let info = support::eventually("cluster-info signed for the token", 90, || async {
        public
            .get_opt("cluster-info")
            .await
            .ok()
            .flatten()
            .filter(|cm| {
                cm.data
                    .as_ref()
                    .is_some_and(|d| d.contains_key(&signature_key))
            })
    })
    .await;
    let info_kubeconfig = info
        .data
        .as_ref()
        .and_then(|d| d.get("kubeconfig"))
        .expect("cluster-info kubeconfig");
    assert!(
        info_kubeconfig.contains(&cp.server),
        "cluster-info names the apiserver: {info_kubeconfig}"
    );

    // TLS bootstrap, as kubelet does it: a CSR for system:node:worker-0, made with the token.
    let bootstrap = client_for(kubeconfig_with(
        &cp.server,
        &cp.ca_pem,
        serde_json::json!({"token": token}),
    ))
    .await;
    let key = rcgen::KeyPair::generate().expect("key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "system:node:worker-0");
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, "system:nodes");
    let request = params
        .serialize_request(&key)
        .expect("CSR")
        .pem()
        .expect("CSR PEM");
    let csrs: Api<CertificateSigningRequest> = Api::all(bootstrap.clone());
    let csr = CertificateSigningRequest {
        metadata: kube::api::ObjectMeta {
            name: Some("node-csr-worker-0".into()),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request.into_bytes()),
            signer_name: "kubernetes.io/kube-apiserver-client-kubelet".into(),
            usages: Some(vec!["digital signature".into(), "client auth".into()]),
            ..Default::default()
        },
        status: None,
    };
    csrs.create(&PostParams::default(), &csr)
        .await
        .expect("the bootstrap token may create a node CSR");
    let admin_csrs: Api<CertificateSigningRequest> = Api::all(admin.clone());
    let signed = support::eventually("CSR approved and signed", 90, || async {
        admin_csrs.get("node-csr-worker-0").await.ok().filter(|c| {
            c.status
                .as_ref()
                .and_then(|s| s.certificate.as_ref())
                .is_some_and(|cert| !cert.0.is_empty())
        })
    })
    .await;
    let status = signed.status.expect("status");
    let approved = status
        .conditions
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == "Approved")
        .expect("Approved condition");
    assert_eq!(approved.reason.as_deref(), Some("AutoApproved"));
    let certificate = String::from_utf8(status.certificate.expect("certificate").0).expect("PEM");

    // The signed certificate is the node's identity: it may register itself and no other.
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s.as_bytes());
    let node_client = client_for(kubeconfig_with(
        &cp.server,
        &cp.ca_pem,
        serde_json::json!({
            "client-certificate-data": b64(&certificate),
            "client-key-data": b64(&key.serialize_pem()),
        }),
    ))
    .await;
    let nodes: Api<Node> = Api::all(node_client);
    let node = |name: &str| Node {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    nodes
        .create(&PostParams::default(), &node("worker-0"))
        .await
        .expect("a node registers itself");
    match nodes
        .create(&PostParams::default(), &node("worker-1"))
        .await
    {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("NodeRestriction lets a node register another: {other:?}"),
    }

    // A token that is gone authenticates nothing: kubeadm join with it would fail.
    Api::<Secret>::namespaced(admin.clone(), "kube-system")
        .delete(
            &format!("bootstrap-token-{token_id}"),
            &DeleteParams::default(),
        )
        .await
        .expect("delete the token");
    let code = support::eventually("the deleted token is refused", 60, || async {
        let mut again = csr.clone();
        again.metadata.name = Some("node-csr-worker-0-again".into());
        match csrs.create(&PostParams::default(), &again).await {
            Err(kube::Error::Api(e)) if e.code == 401 => Some(e.code),
            _ => None,
        }
    })
    .await;
    assert_eq!(code, 401);
}

/// What `lab up --kubeadm` and the kubeadm tests do before any host joins
/// (`controlplane::prepare_for_joins`): the real kubeadm init phases, then `cluster-info` pointed
/// at the address hosts use, signed again by kube-controller-manager. The kubeadm config naming
/// the phases' token is readable by its owner only.
#[tokio::test]
async fn prepare_for_joins_points_cluster_info_at_the_hosts_endpoint_and_gets_it_signed() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use metalboot::controlplane::{self, ControlPlane, Lifetime};
    use std::os::unix::fs::PermissionsExt;

    let dir = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir: dir.path().join("plane"),
        lifetime: Lifetime::TiedToThisProcess,
        join_ready: true,
    })
    .await
    .expect("join-ready control plane");
    let admin = cp.client().await.expect("admin client");
    let work = dir.path().join("kubeadm");
    controlplane::prepare_for_joins(
        &admin,
        &controlplane::default_bin_dir(),
        &cp.kubeconfig_path,
        ("10.77.0.2", 41817),
        &work,
    )
    .await
    .expect("prepare for joins");

    let info = Api::<ConfigMap>::namespaced(admin.clone(), "kube-public")
        .get("cluster-info")
        .await
        .expect("cluster-info");
    let data = info.data.expect("cluster-info data");
    let kubeconfig: kube::config::Kubeconfig =
        serde_yaml::from_str(&data["kubeconfig"]).expect("cluster-info kubeconfig");
    let servers: Vec<Option<String>> = kubeconfig
        .clusters
        .iter()
        .map(|c| c.cluster.as_ref().and_then(|c| c.server.clone()))
        .collect();
    assert_eq!(servers, vec![Some("https://10.77.0.2:41817".to_string())]);
    assert!(
        data.keys().any(|k| k.starts_with("jws-kubeconfig-")),
        "no signature after the move: {:?}",
        data.keys().collect::<Vec<_>>()
    );
    // kubeadm's upload-config made the ConfigMaps a join reads.
    for name in ["kubeadm-config", "kubelet-config"] {
        Api::<ConfigMap>::namespaced(admin.clone(), "kube-system")
            .get(name)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let mode = std::fs::metadata(work.join("kubeadm-init.yaml"))
        .expect("kubeadm config")
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o077,
        0,
        "kubeadm-init.yaml is readable by others: {mode:o}"
    );
    drop(cp);
}

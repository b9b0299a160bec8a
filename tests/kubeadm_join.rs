//! A real node joins (issue 16): the lab's Debian, netbooted live as `make lab` boots it, runs the
//! real cloud-init on metalboot's NoCloud data. Its user-data is a `kubeadm join` cloud-config in
//! the shape upstream's kubeadm bootstrap provider (CABPK) renders: a JoinConfiguration written
//! with cloud-init's jinja templating (node name and `--provider-id` from metalboot's meta-data,
//! as CAPM3's templates do), `kubeadm join`, then the bootstrap-success sentinel. The real kubeadm
//! joins a join-ready control plane (real kube-apiserver, etcd and kube-controller-manager, the
//! token and `cluster-info` made by the real `kubeadm init` phases); the real kubelet, on Debian's
//! containerd, registers the Node with the Machine's providerID and it becomes Ready; metalboot's
//! vendor-data (merged with the user-data by cloud-init itself) sees the sentinel and calls back.
//! CABPK itself does not run here: the lab's `--kubeadm` mode is where it will.
//!
//! The guest reaches the boot service and the apiserver, both on loopback, as 10.0.2.2 over QEMU's
//! user-mode network, which the test makes itself.

#[path = "support/kubeadm.rs"]
mod kubeadm;
#[path = "support/rig.rs"]
mod rig;
mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::Api;
use metalboot::boot::artifacts::artifacts_router;
use metalboot::boot::http::{BootConfig, router};
use metalboot::boot::ipxe::nocloud_url;
use metalboot::boot::serve::{HttpLimits, serve};
use metalboot::controlplane;
use support::boot::*;

/// Where `hack/os-image/build.sh` puts the live system.
fn live_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/lab/os");
    for file in [
        "live/vmlinuz",
        "live/initrd.img",
        "live/filesystem.squashfs",
    ] {
        assert!(
            dir.join(file).is_file(),
            "{} is missing: `make test` builds it (hack/os-image/build.sh)",
            dir.join(file).display()
        );
    }
    dir
}

/// Once per test binary: the `kubeadm init` phases and `cluster-info` pointed at the hosts'
/// address (`kubeadm::prepare_for_joins`).
async fn prepare_for_joins(plane: &support::SharedControlPlane, client: &kube::Client) {
    static PREPARED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    PREPARED
        .get_or_init(|| kubeadm::prepare_for_joins(&plane.kubeconfig_path, &plane.server, client))
        .await;
}

/// A bootstrap token made by the real `kubeadm token create`, valid for `ttl`, and signed into
/// cluster-info.
async fn new_token(
    plane: &support::SharedControlPlane,
    client: &kube::Client,
    ttl: &str,
) -> String {
    let token = kubeadm::random_token();
    let out = std::process::Command::new(controlplane::default_bin_dir().join("kubeadm"))
        .args(["token", "create", &token, "--ttl", ttl])
        .arg(format!("--kubeconfig={}", plane.kubeconfig_path.display()))
        .output()
        .expect("run kubeadm token create");
    assert!(
        out.status.success(),
        "kubeadm token create: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    kubeadm::until_signed(client, &token).await;
    token
}

/// The cloud-config CABPK renders for a worker, reduced to what a join needs: the
/// JoinConfiguration (jinja: node name and provider ID from metalboot's meta-data), kubeadm join,
/// and the sentinel CABPK's bootstrap script writes once the join succeeded.
/// `discovery`: how long kubeadm looks for a cluster-info it can trust before it gives up.
fn join_user_data(endpoint: &str, token: &str, ca_hash: &str, discovery: &str) -> String {
    format!(
        r#"## template: jinja
#cloud-config
write_files:
- path: /run/kubeadm/kubeadm-join-config.yaml
  owner: root:root
  permissions: '0640'
  content: |
    apiVersion: kubeadm.k8s.io/v1beta4
    kind: JoinConfiguration
    discovery:
      bootstrapToken:
        apiServerEndpoint: {endpoint}
        token: {token}
        caCertHashes:
        - {ca_hash}
    timeouts:
      discovery: {discovery}
    nodeRegistration:
      name: '{{{{ ds.meta_data.local_hostname }}}}'
      criSocket: unix:///run/containerd/containerd.sock
      kubeletExtraArgs:
      - name: provider-id
        value: '{{{{ ds.meta_data.provider_id }}}}'
runcmd:
- "echo 'metalboot-test: kubeadm join starts' > /dev/console"
- "kubeadm join --config /run/kubeadm/kubeadm-join-config.yaml > /var/log/kubeadm-join.log 2>&1; rc=$?; tail -n 40 /var/log/kubeadm-join.log > /dev/console; [ $rc -eq 0 ] && mkdir -p /run/cluster-api && echo success > /run/cluster-api/bootstrap-success.complete"
- "echo 'metalboot-test: kubeadm join ended' > /dev/console"
"#
    )
}

struct Guest {
    _child: tokio::process::Child,
    console: PathBuf,
}

impl Guest {
    /// The live system as iPXE boots it (kernel, initrd, live-boot fetching the root squashfs),
    /// here by QEMU's direct kernel boot: the firmware paths have tests of their own.
    fn boot(dir: &Path, live: &Path, cmdline: &str) -> Guest {
        let console = dir.join("console.log");
        let mut cmd = tokio::process::Command::new("qemu-system-x86_64");
        cmd.args(["-machine", "pc,accel=tcg", "-m", "2048", "-smp", "2"])
            .args(["-display", "none"])
            .args(["-serial", &format!("file:{}", console.display())])
            .arg("-kernel")
            .arg(live.join("live/vmlinuz"))
            .arg("-initrd")
            .arg(live.join("live/initrd.img"))
            .args(["-append", cmdline])
            .args(["-netdev", "user,id=n0"])
            .args(["-device", "virtio-net-pci,netdev=n0,romfile="])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .kill_on_drop(true);
        Guest {
            _child: cmd.spawn().expect("start qemu-system-x86_64"),
            console,
        }
    }

    fn console(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.console).unwrap_or_default()).into_owned()
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

#[tokio::test]
async fn a_live_host_joins_with_kubeadm_and_its_node_becomes_ready() {
    let plane = support::join_ready_control_plane();
    let live = live_dir();
    let ns = support::namespace("join").await;
    install_crds(&ns.client).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let mut timeline: Vec<(&str, Duration)> = Vec::new();

    let port = plane.server.rsplit(':').next().expect("port");
    prepare_for_joins(plane, &ns.client).await;
    let token = new_token(plane, &ns.client, "2h").await;
    timeline.push(("control plane ready for joins", started.elapsed()));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!(
        "http://10.0.2.2:{}",
        listener.local_addr().expect("addr").port()
    );
    let (state, mut callbacks) = boot_state_with(
        &ns.client,
        &ns.name,
        BootConfig {
            base_url: base.clone(),
            pin_source_ip: false,
            sentinel_wait_seconds: 1200,
            deploy: None,
        },
    )
    .await;
    let app = router(state.clone()).nest("/artifacts", artifacts_router(live.clone()));
    tokio::spawn(serve(listener, app, HttpLimits::default()));

    let host = "direct-0";
    create_host(&ns.client, &ns.name, host, "52:54:00:12:34:57").await;
    let profile = metalboot::api::metalmachine::BootProfile {
        kernel: "live/vmlinuz".into(),
        initrds: vec!["live/initrd.img".into()],
        cmdline: Some(format!(
            "boot=live fetch={base}/artifacts/live/filesystem.squashfs"
        )),
    };
    let machine = create_machine(&ns.client, &ns.name, "worker-0", profile).await;
    set_host_state(
        &ns.client,
        &ns.name,
        host,
        metalboot::api::metalhost::HostState::Provisioning,
        Some(&machine),
    )
    .await;
    let user_data = join_user_data(
        &format!("10.0.2.2:{port}"),
        &token,
        &kubeadm::ca_cert_hash(&plane.ca_pem, dir.path()),
        "5m0s",
    );
    let record =
        create_boot_secret(&ns.client, &ns.name, &machine, host, user_data.as_bytes()).await;
    until_stores("the boot Secret in the store", &state, |s| {
        !s.boot_secrets.state().is_empty() && !s.machines.state().is_empty()
    })
    .await;

    let cmdline = format!(
        "boot=live fetch={base}/artifacts/live/filesystem.squashfs console=ttyS0,115200n8 net.ifnames=0 panic=10 ds=nocloud-net;s={}",
        nocloud_url(&base, record.token.expose())
    );
    let guest = Guest::boot(dir.path(), &live, &cmdline);
    let booted = Instant::now();
    let seen = |what: &'static str| {
        let guest = &guest;
        async move { guest.console().contains(what).then_some(()) }
    };
    let fail = |what: &str| -> ! { panic!("{what}; console:\n{}", tail(&guest.console(), 8000)) };
    if support::eventually_or("cloud-init starts kubeadm join", 900, || {
        seen("metalboot-test: kubeadm join starts")
    })
    .await
    .is_none()
    {
        fail("kubeadm join never started");
    }
    timeline.push(("power on → kubeadm join starts", booted.elapsed()));

    let nodes: Api<Node> = Api::all(ns.client.clone());
    let node = support::eventually_or("the kubelet registers its Node", 600, || async {
        nodes.get_opt(host).await.ok().flatten()
    })
    .await
    .unwrap_or_else(|| fail("no Node registered"));
    timeline.push(("power on → Node registered", booted.elapsed()));
    assert_eq!(
        node.spec.as_ref().and_then(|s| s.provider_id.as_deref()),
        Some(record.provider_id.as_str()),
        "the kubelet's --provider-id comes from metalboot's meta-data"
    );
    let ready = support::eventually_or("the Node becomes Ready", 600, || async {
        nodes.get_opt(host).await.ok().flatten().filter(node_ready)
    })
    .await;
    let Some(ready) = ready else {
        let conditions = nodes
            .get_opt(host)
            .await
            .ok()
            .flatten()
            .and_then(|n| n.status)
            .and_then(|s| s.conditions);
        fail(&format!("the Node never became Ready: {conditions:?}"))
    };
    timeline.push(("power on → Node Ready", booted.elapsed()));
    let info = ready
        .status
        .as_ref()
        .and_then(|s| s.node_info.as_ref())
        .expect("nodeInfo");
    assert_eq!(info.kubelet_version, kubeadm::kubernetes_version());
    assert!(
        info.container_runtime_version.starts_with("containerd://"),
        "{}",
        info.container_runtime_version
    );
    let addresses: Vec<String> = ready
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .map(|a| format!("{}={}", a.type_, a.address))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        addresses.iter().any(|a| a == "InternalIP=10.0.2.15"),
        "{addresses:?}"
    );

    // The sentinel, written after the join, reaches metalboot through its own vendor-data.
    let notice = tokio::time::timeout(Duration::from_secs(300), callbacks.recv())
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| fail("no callback after the join"));
    assert_eq!(notice.metal_machine, "worker-0");
    timeline.push(("power on → callback", booted.elapsed()));

    println!("kubeadm join timeline (TCG, 2 vCPU, 2 GiB, live Debian):");
    for (what, at) in &timeline {
        println!("  {what:<34} {:>6.1} s", at.as_secs_f64());
    }
    println!(
        "Node {host}: providerID {}, kubelet {}, runtime {}, {addresses:?}",
        record.provider_id, info.kubelet_version, info.container_runtime_version
    );
}

/// The whole manager (controllers, boot service) with one QEMU host behind the lab's virtual BMC,
/// in live mode: the MetalMachine claims the host, powers it on over Redfish for a network boot,
/// real iPXE boots the live Debian, whose real cloud-init runs the kubeadm join cloud-config; the
/// kubelet's Node carries the providerID metalboot sets on the MetalMachine once the vendor-data
/// called back, and becomes Ready.
#[tokio::test]
async fn the_manager_provisions_a_host_that_joins_as_a_ready_node() {
    let plane = support::join_ready_control_plane();
    let client = support::client().await;
    let port = plane.server.rsplit(':').next().expect("port");
    prepare_for_joins(plane, &client).await;
    let token = new_token(plane, &client, "2h").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let user_data = join_user_data(
        &format!("10.0.2.2:{port}"),
        &token,
        &kubeadm::ca_cert_hash(&plane.ca_pem, dir.path()),
        "5m0s",
    );
    let started = Instant::now();
    let env = rig::setup(
        "join-e2e",
        "52:54:00:6d:62:20",
        rig::Bootstrap::UserData(user_data),
        1200,
        rig::First::Live,
    )
    .await;
    let provisioned = support::eventually_or("the MetalMachine provisioned", 1500, || async {
        env.machines
            .get("node")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let Some(provisioned) = provisioned else {
        let mm = env.machines.get("node").await.ok();
        panic!(
            "not provisioned: {:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            rig::tail(&rig::console(&env.host), 8000)
        );
    };
    let provisioned_at = started.elapsed();
    let provider_id = provisioned.spec.provider_id.clone().expect("providerID");
    let nodes: Api<Node> = Api::all(env.ns.client.clone());
    let node = support::eventually_or("the Node Ready with the providerID", 300, || async {
        nodes
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|n| n.spec.as_ref().and_then(|s| s.provider_id.as_deref()) == Some(&provider_id))
            .filter(node_ready)
    })
    .await;
    let Some(node) = node else {
        panic!(
            "no Ready Node with providerID {provider_id}\nconsole:\n{}",
            rig::tail(&rig::console(&env.host), 8000)
        );
    };
    println!(
        "manager + kubeadm join: MetalMachine provisioned after {:.1} s, Node {} Ready with providerID {provider_id} after {:.1} s",
        provisioned_at.as_secs_f64(),
        node.metadata.name.as_deref().unwrap_or_default(),
        started.elapsed().as_secs_f64()
    );
}

/// A join that cannot succeed: the bootstrap token has expired before the host boots. The real
/// kubeadm finds no cluster-info it can trust and gives up; no sentinel, so metalboot's
/// vendor-data never calls back; the boot timeout ends the attempt and, with no retries left,
/// the MetalMachine fails with BootTimeout, never provisioned, and no Node appears.
#[tokio::test]
async fn a_join_with_an_expired_token_ends_in_the_boot_timeout() {
    let plane = support::join_ready_control_plane();
    let client = support::client().await;
    let port = plane.server.rsplit(':').next().expect("port");
    prepare_for_joins(plane, &client).await;
    let token = new_token(plane, &client, "1s").await;
    // Expired: the bootstrap signer takes its signature out of cluster-info.
    let public: Api<ConfigMap> = Api::namespaced(client.clone(), "kube-public");
    support::eventually("the expired token's signature gone", 120, || async {
        public
            .get_opt("cluster-info")
            .await
            .ok()
            .flatten()
            .filter(|cm| kubeadm::signature(cm, &token).is_none())
    })
    .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let user_data = join_user_data(
        &format!("10.0.2.2:{port}"),
        &token,
        &kubeadm::ca_cert_hash(&plane.ca_pem, dir.path()),
        "45s",
    );
    let env = rig::setup(
        "join-expired",
        "52:54:00:6d:62:21",
        rig::Bootstrap::UserData(user_data),
        600,
        rig::First::Live,
    )
    .await;
    let (failed, text) = rig::until_failed(&env).await;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        status.failure_reason.as_deref(),
        Some("BootTimeout"),
        "{status:?}"
    );
    assert!(failed.spec.provider_id.is_none(), "provisioned after all");
    assert!(
        text.contains("metalboot-test: kubeadm join starts")
            && text.contains("error execution phase"),
        "kubeadm join ran and failed:\n{}",
        rig::tail(&text, 8000)
    );
    assert!(
        !text.contains("reporting to the boot service"),
        "vendor-data reported success without the sentinel"
    );
    let nodes: Api<Node> = Api::all(env.ns.client.clone());
    let joined = nodes
        .list(&Default::default())
        .await
        .expect("nodes")
        .items
        .into_iter()
        .filter(|n| {
            n.spec
                .as_ref()
                .and_then(|s| s.provider_id.as_deref())
                .is_some_and(|id| id.starts_with(&format!("metalboot://{}/", env.ns.name)))
        })
        .count();
    assert_eq!(joined, 0, "a Node registered with an expired token");
    println!(
        "expired token: {} — {}",
        status.failure_reason.unwrap_or_default(),
        status.failure_message.unwrap_or_default()
    );
}

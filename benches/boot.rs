//! Boot-storm benchmark (not a test): 500 concurrent clients each fetch an iPXE host script, the
//! user-data and a 50 MB artifact — from metalboot's boot service, then from nginx serving the
//! same bytes on the same machine in the same run. Prints both and the ratio.
//! Run with `hack/bench-boot.sh` (installs nginx, builds in release mode).

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::Resource;
use kube::api::{Api, Patch, PatchParams, PostParams};
use metalboot::api::metalhost::{BmcDetails, ConsumerReference, HostState, MetalHostSpec};
use metalboot::api::metalmachine::{BootProfile, MetalMachineSpec};
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::boot::front::FileRoutes;
use metalboot::boot::http::{BootConfig, BootState, BootStores};
use metalboot::boot::serve::{HttpLimits, serve_with_files};
use metalboot::boot::tokens::{self, NewAttempt};
use metalboot::controlplane::{self, ControlPlane, Lifetime};

const CLIENTS: usize = 500;
const ARTIFACT_MB: usize = 50;
const MAC: &str = "52:54:00:be:ef:99";

struct Outcome {
    seconds: f64,
    bytes: u64,
    failures: usize,
}

async fn storm(script: String, user_data: String, artifact: String) -> Outcome {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(CLIENTS)
        .build()
        .expect("client");
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, urls) = (
                client.clone(),
                [script.clone(), user_data.clone(), artifact.clone()],
            );
            tokio::spawn(async move {
                let mut bytes = 0u64;
                for url in urls {
                    let Ok(reply) = client.get(&url).send().await else {
                        return Err(());
                    };
                    if !reply.status().is_success() {
                        return Err(());
                    }
                    let mut body = reply.bytes_stream();
                    while let Some(chunk) = body.next().await {
                        bytes += chunk.map_err(|_| ())?.len() as u64;
                    }
                }
                Ok(bytes)
            })
        })
        .collect();
    let (mut total, mut failures) = (0u64, 0usize);
    for t in tasks {
        match t.await {
            Ok(Ok(b)) => total += b,
            _ => failures += 1,
        }
    }
    Outcome {
        seconds: started.elapsed().as_secs_f64(),
        bytes: total,
        failures,
    }
}

fn report(name: &str, o: &Outcome) {
    println!(
        "{name:<10} {CLIENTS} clients × (script + user-data + {ARTIFACT_MB} MB): {:>6.2} s, {:>6.2} GB/s, {:>7.0} requests/s, {} failed",
        o.seconds,
        o.bytes as f64 / o.seconds / 1e9,
        (CLIENTS * 3) as f64 / o.seconds,
        o.failures
    );
}

#[tokio::main]
async fn main() {
    let work = tempfile::tempdir().expect("tempdir");
    let cp = ControlPlane::start(&controlplane::Options {
        bin_dir: controlplane::default_bin_dir(),
        data_dir: work.path().join("cp"),
        lifetime: Lifetime::TiedToThisProcess,
        join_ready: false,
    })
    .await
    .expect("control plane (run hack/control-plane/build.sh)");
    let client = cp.client().await.expect("client");
    metalboot::api::crdgen::install(&client)
        .await
        .expect("CRDs");
    let ns = "default";
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), ns);
    let host = MetalHost::new(
        "bench-host",
        MetalHostSpec {
            bmc: BmcDetails {
                address: "redfish+http://127.0.0.1:1".into(),
                credentials_name: "bmc".into(),
                disable_certificate_verification: None,
                ca_secret_name: None,
            },
            boot_mac_address: MAC.into(),
            boot_ip_address: None,
            boot_mode: None,
            online: true,
            description: None,
            consumer_ref: Some(ConsumerReference::to_metal_machine("bench", "default")),
            automated_cleaning_mode: None,
        },
    );
    hosts
        .create(&PostParams::default(), &host)
        .await
        .expect("host");
    let mm = Api::<MetalMachine>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &MetalMachine::new(
                "bench",
                MetalMachineSpec {
                    boot: Some(BootProfile {
                        kernel: "big.img".into(),
                        initrds: vec![],
                        cmdline: Some("console=ttyS0".into()),
                    }),
                    ..Default::default()
                },
            ),
        )
        .await
        .expect("machine");
    hosts
        .patch_status(
            "bench-host",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"status": {"state": HostState::Provisioning}})),
        )
        .await
        .expect("host status");
    let user_data: Vec<u8> = (0..4096)
        .map(|i| b"#cloud-config\nruncmd: []\n"[i % 25])
        .collect();
    let secret = tokens::new_boot_secret(&NewAttempt {
        namespace: ns,
        metal_machine: "bench",
        owner: mm.controller_owner_ref(&()).expect("owner"),
        cluster_name: None,
        host: "bench-host",
        attempt: 1,
        provider_id: "metalboot://default/bench-host",
        user_data: &user_data,
    });
    let token = tokens::parse_secret(&secret)
        .expect("parse")
        .token
        .expose()
        .to_string();
    Api::<Secret>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("boot Secret");

    let artifacts = work.path().join("www/artifacts");
    std::fs::create_dir_all(&artifacts).expect("mkdir");
    let big: Vec<u8> = (0..ARTIFACT_MB << 20).map(|i| (i % 251) as u8).collect();
    std::fs::write(artifacts.join("big.img"), &big).expect("artifact");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let base = format!("http://{addr}");
    let stores = BootStores::watch(&client, ns);
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let state = Arc::new(
        BootState::new(
            stores,
            BootConfig {
                base_url: base.clone(),
                pin_source_ip: false,
                sentinel_wait_seconds: 600,
                deploy: None,
            },
            client.clone(),
            tx,
        )
        .expect("state"),
    );
    state.wait_for_stores().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let app = metalboot::boot::http::router(state)
        .nest(
            "/artifacts",
            metalboot::boot::artifacts::artifacts_router(artifacts.clone()),
        )
        .layer(axum::middleware::from_fn(metalboot::boot::http::access_log));
    // The production server: budgets, and the front that sends files with sendfile(2). All 500
    // clients come from 127.0.0.1, so the per-address budget is raised to let them in.
    let limits = HttpLimits {
        max_connections: 4 * CLIENTS,
        max_connections_per_client: 2 * CLIENTS,
        ..HttpLimits::default()
    };
    let files = FileRoutes::default().route("/artifacts", &artifacts, None);
    tokio::spawn(serve_with_files(
        listener,
        app.clone(),
        limits.clone(),
        files,
    ));
    // The same server without the front (hyper alone, every byte through user space), as it was
    // before the front: the gain the front makes, in the same run.
    let copying = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let copying_base = format!("http://{}", copying.local_addr().expect("addr"));
    tokio::spawn(metalboot::boot::serve::serve(copying, app, limits));

    let mac_path = MAC.replace(':', "-");
    let script = reqwest::get(format!("{base}/ipxe/{mac_path}"))
        .await
        .expect("script")
        .text()
        .await
        .expect("text");
    assert!(
        script.contains("kernel "),
        "the fixture is provisioning:\n{script}"
    );
    // nginx serves byte-identical copies of the same three documents.
    let www = work.path().join("www");
    std::fs::create_dir_all(www.join("ipxe")).expect("mkdir");
    std::fs::write(www.join("ipxe").join(&mac_path), &script).expect("script copy");
    std::fs::write(www.join("user-data"), &user_data).expect("user-data copy");
    let nginx_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let conf = work.path().join("nginx.conf");
    std::fs::write(&conf, format!(
        "daemon off; worker_processes auto; pid {pid}; error_log {log};\nevents {{ worker_connections 4096; }}\nhttp {{ access_log off; sendfile on; tcp_nopush on; keepalive_requests 10000;\n server {{ listen 127.0.0.1:{nginx_port}; root {root}; }} }}\n",
        pid = work.path().join("nginx.pid").display(), log = work.path().join("nginx.err").display(), root = www.display()
    )).expect("nginx.conf");
    let mut nginx = Command::new("nginx")
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(work.path())
        .spawn()
        .expect("nginx (hack/bench-boot.sh installs it)");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let nginx_base = format!("http://127.0.0.1:{nginx_port}");

    // Silence per-request logging cost in neither: metalboot keeps its access log (production).
    let ours = storm(
        format!("{base}/ipxe/{mac_path}"),
        format!("{base}/nocloud/{token}/user-data"),
        format!("{base}/artifacts/big.img"),
    )
    .await;
    let copied = storm(
        format!("{copying_base}/ipxe/{mac_path}"),
        format!("{copying_base}/nocloud/{token}/user-data"),
        format!("{copying_base}/artifacts/big.img"),
    )
    .await;
    let theirs = storm(
        format!("{nginx_base}/ipxe/{mac_path}"),
        format!("{nginx_base}/user-data"),
        format!("{nginx_base}/artifacts/big.img"),
    )
    .await;
    // SIGTERM lets the master stop its workers (SIGKILL would orphan them).
    // SAFETY: kill(2) on the pid of the child we spawned.
    unsafe {
        libc::kill(nginx.id() as i32, libc::SIGTERM);
    }
    let _ = nginx.wait();
    println!();
    report("metalboot", &ours);
    report("hyper-only", &copied);
    report("nginx", &theirs);
    println!(
        "ratio: metalboot takes {:.2}× nginx's time for the same boot storm (without the front's sendfile: {:.2}×)",
        ours.seconds / theirs.seconds,
        copied.seconds / theirs.seconds
    );
    assert_eq!(
        (ours.failures, copied.failures, theirs.failures),
        (0, 0, 0),
        "every client was served"
    );
    assert!(Path::new(&conf).exists());
    cp.stop();
}

//! The deploy agent against the real boot service and a real apiserver: inspection reported,
//! task fetched, the image streamed from the boot service's artifacts and checked, the NoCloud
//! seed left on the disk, the outcome recorded on the attempt's boot Secret. The "disk" is a
//! sparse file and the hardware a recorded /sys tree; writing a real disk in a real host is the
//! QEMU test's job (tests/os_image.rs).

mod support;

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};
use metalboot::agent::image::digest_hex;
use metalboot::agent::protocol::DeployState;
use metalboot::agent::run::{AgentConfig, Outcome, run};
use metalboot::api::MetalMachine;
use metalboot::api::metalhost::HostState;
use metalboot::api::metalmachine::{
    ChecksumType, ImageFormat, ImageSpec, MetalMachineSpec, ProvisioningMode,
};
use metalboot::boot::artifacts::artifacts_router;
use metalboot::boot::http::{BootState, router};
use metalboot::boot::serve::{HttpLimits, serve};
use metalboot::boot::tokens;
use support::boot::*;

const GIB: u64 = 1 << 30;

/// A 64 MiB GPT image with one partition full of a pattern.
fn make_image(dir: &Path) -> Vec<u8> {
    let path = dir.join("os.raw");
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("image");
    f.set_len(64 << 20).expect("size");
    let mut gpt = gpt::GptConfig::new()
        .writable(true)
        .change_partition_count(true)
        .create_from_device(&mut f, None)
        .expect("gpt");
    gpt.add_partition(
        "root",
        32 << 20,
        gpt::partition_types::LINUX_FS,
        0,
        Some(2048),
    )
    .expect("partition");
    gpt.write_inplace().expect("write gpt");
    drop(gpt);
    f.seek(SeekFrom::Start(1 << 20)).expect("seek");
    let pattern: Vec<u8> = (0..(8 << 20)).map(|i: u32| (i % 253) as u8).collect();
    f.write_all(&pattern).expect("pattern");
    drop(f);
    let bytes = std::fs::read(&path).expect("read image");
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&bytes).expect("gzip");
    std::fs::write(dir.join("os.raw.gz"), gz.finish().expect("gzip")).expect("write gz");
    // qcow2 as operators make it: qemu-img, compressed clusters.
    let status = std::process::Command::new("qemu-img")
        .args(["convert", "-q", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&path)
        .arg(dir.join("os.qcow2"))
        .status()
        .expect("qemu-img (Debian package qemu-utils)");
    assert!(status.success(), "qemu-img convert");
    bytes
}

/// A recorded /sys and /proc with one 8 GiB virtio disk `vda`, and /dev/vda as a sparse file.
fn make_host(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let sys = dir.join("root");
    let dev = dir.join("dev");
    for (rel, body) in [
        (
            "proc/cpuinfo",
            "processor\t: 0\nmodel name\t: test cpu\n".to_string(),
        ),
        ("proc/meminfo", "MemTotal: 2097152 kB\n".to_string()),
        ("sys/block/vda/size", format!("{}\n", 8 * GIB / 512)),
        ("sys/block/vda/serial", "DISK-0\n".to_string()),
        ("sys/block/vda/queue/rotational", "0\n".to_string()),
    ] {
        let p = sys.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("dir");
        std::fs::write(p, body).expect("write");
    }
    std::fs::create_dir_all(&dev).expect("dev");
    let disk = std::fs::File::create(dev.join("vda")).expect("disk");
    disk.set_len(8 * GIB).expect("sparse disk");
    (sys, dev)
}

async fn image_machine(
    client: &kube::Client,
    ns: &str,
    name: &str,
    image: ImageSpec,
) -> MetalMachine {
    Api::<MetalMachine>::namespaced(client.clone(), ns)
        .create(
            &PostParams::default(),
            &MetalMachine::new(
                name,
                MetalMachineSpec {
                    mode: ProvisioningMode::Image,
                    image: Some(Box::new(image)),
                    ..Default::default()
                },
            ),
        )
        .await
        .expect("create MetalMachine")
}

async fn start_boot_service(
    ns: &support::TestNamespace,
    artifacts: &Path,
) -> (Arc<BootState>, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (state, _callbacks) = boot_state(&ns.client, &ns.name, &base, false).await;
    let app: Router =
        router(state.clone()).nest("/artifacts", artifacts_router(artifacts.to_path_buf()));
    tokio::spawn(serve(listener, app, HttpLimits::default()));
    (state, base)
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut f = std::fs::File::open(path).expect("open");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    let mut buf = vec![0; len];
    f.read_exact(&mut buf).expect("read");
    buf
}

async fn boot_record(client: &kube::Client, ns: &str, machine: &str) -> tokens::BootRecord {
    let secret = Api::<Secret>::namespaced(client.clone(), ns)
        .get(&tokens::boot_secret_name(machine))
        .await
        .expect("boot Secret");
    tokens::parse_secret(&secret).expect("parse")
}

#[tokio::test]
async fn the_agent_writes_a_checked_image_and_seeds_it_or_wipes_a_bad_one() {
    let ns = support::namespace("agent").await;
    install_crds(&ns.client).await;
    let client = &ns.client;
    let artifacts = tempfile::tempdir().expect("tmp");
    let image = make_image(artifacts.path());
    let gz = std::fs::read(artifacts.path().join("os.raw.gz")).expect("gz");
    let qcow2 = std::fs::read(artifacts.path().join("os.qcow2")).expect("qcow2");

    let cases = [
        (
            "raw",
            "os.raw",
            ImageFormat::Raw,
            digest_hex(ChecksumType::Sha256, &image),
            ChecksumType::Sha256,
        ),
        (
            "gzip",
            "os.raw.gz",
            ImageFormat::Gzip,
            digest_hex(ChecksumType::Sha512, &gz),
            ChecksumType::Sha512,
        ),
        (
            "qcow2",
            "os.qcow2",
            ImageFormat::Qcow2,
            digest_hex(ChecksumType::Sha256, &qcow2),
            ChecksumType::Sha256,
        ),
        (
            "bad",
            "os.raw",
            ImageFormat::Raw,
            digest_hex(ChecksumType::Sha256, b"not it"),
            ChecksumType::Sha256,
        ),
    ];
    let mut records = Vec::new();
    for (i, (name, url, format, checksum, checksum_type)) in cases.iter().enumerate() {
        let host = format!("host-{i}");
        create_host(client, &ns.name, &host, &format!("52:54:00:20:00:0{i}")).await;
        let machine = image_machine(
            client,
            &ns.name,
            name,
            ImageSpec {
                url: url.to_string(),
                checksum: checksum.clone(),
                checksum_type: *checksum_type,
                format: *format,
            },
        )
        .await;
        set_host_state(
            client,
            &ns.name,
            &host,
            HostState::Provisioning,
            Some(&machine),
        )
        .await;
        records
            .push(create_boot_secret(client, &ns.name, &machine, &host, b"#cloud-config\n").await);
    }
    let (state, base) = start_boot_service(&ns, artifacts.path()).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == cases.len() && s.machines.state().len() == cases.len()
    })
    .await;

    for ((name, ..), record) in cases.iter().zip(&records) {
        let host_dir = tempfile::tempdir().expect("tmp");
        let (sys_root, dev_dir) = make_host(host_dir.path());
        let outcome = run(AgentConfig {
            url: format!("{base}/agent/{}/", record.token.expose()),
            sys_root,
            dev_dir: dev_dir.clone(),
            patience: std::time::Duration::from_secs(20),
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let disk = dev_dir.join("vda");
        let kept = boot_record(client, &ns.name, name).await;
        let inspection = kept.inspection.clone().expect("inspection recorded");
        assert_eq!(inspection.disks.len(), 1, "{name}");
        assert_eq!(inspection.disks[0].serial_number.as_deref(), Some("DISK-0"));
        assert_eq!(inspection.memory_mib, Some(2048));
        let report = kept.deploy.clone().expect("report recorded");
        if *name == "bad" {
            assert!(
                matches!(&outcome, Outcome::Failed { reason, .. } if reason == "ImageChecksumMismatch"),
                "{outcome:?}"
            );
            assert_eq!(report.state, DeployState::Failed);
            assert_eq!(report.reason.as_deref(), Some("ImageChecksumMismatch"));
            assert!(
                read_at(&disk, 0, 1 << 20).iter().all(|b| *b == 0),
                "a bad image is wiped before it is reported"
            );
            assert!(gpt::GptConfig::new().open(&disk).is_err());
            continue;
        }
        assert_eq!(
            outcome,
            Outcome::Written {
                device: "vda".into(),
                bytes: image.len() as u64
            },
            "{name}"
        );
        assert_eq!(report.state, DeployState::Written);
        assert_eq!(report.device.as_deref(), Some("vda"));
        // The image's data, byte for byte (past the partition table the seed rewrote).
        assert_eq!(
            read_at(&disk, 1 << 20, 8 << 20),
            image[(1 << 20)..(9 << 20)].to_vec(),
            "{name}"
        );
        let table = gpt::GptConfig::new().open(&disk).expect("gpt on the disk");
        let parts: Vec<_> = table
            .partitions()
            .values()
            .map(|p| p.name.clone())
            .collect();
        assert_eq!(parts, ["root", "cidata"], "{name}");
        let seed = table
            .partitions()
            .values()
            .find(|p| p.name == "cidata")
            .expect("seed");
        let offset = seed.first_lba * 512;
        assert!(offset > 7 * GIB, "the seed sits at the disk's end");
        // The seed's FAT holds meta-data naming this attempt's NoCloud URL.
        let fat = read_at(&disk, offset, metalboot::agent::seed::SEED_BYTES as usize);
        let text = String::from_utf8_lossy(&fat);
        let seedfrom = format!("{base}/nocloud/{}/", record.token.expose());
        assert!(text.contains(&seedfrom), "{name}: seedfrom in the seed");
        // Asking again after the write: nothing more to do.
        let again = reqwest::get(format!("{base}/agent/{}/task", record.token.expose()))
            .await
            .expect("task")
            .text()
            .await
            .expect("body");
        assert!(again.contains("\"action\":\"done\""), "{again}");
    }

    // Hostile requests: a bad token, an oversized body, a report after the end, garbage.
    let token = records[0].token.expose();
    let http = reqwest::Client::new();
    let status = |r: reqwest::Response| r.status().as_u16();
    assert_eq!(
        status(
            http.get(format!("{base}/agent/{}/task", "0".repeat(64)))
                .send()
                .await
                .expect("req")
        ),
        404
    );
    assert_eq!(
        status(
            http.get(format!("{base}/agent/xyz/task"))
                .send()
                .await
                .expect("req")
        ),
        404
    );
    assert_eq!(
        status(
            http.post(format!("{base}/agent/{token}/inspection"))
                .body(vec![b' '; 100 * 1024])
                .send()
                .await
                .expect("req")
        ),
        413
    );
    assert_eq!(
        status(
            http.post(format!(
                "{base}/agent/{}/inspection",
                records[1].token.expose()
            ))
            .body("{not json")
            .send()
            .await
            .expect("req")
        ),
        400
    );
    assert_eq!(
        status(
            http.post(format!("{base}/agent/{token}/report"))
                .json(&serde_json::json!({"state": "Writing"}))
                .send()
                .await
                .expect("req")
        ),
        409,
        "the outcome is final"
    );
}

/// A connection cut halfway through the image: the agent resumes with a `Range` request from
/// the byte it reached, the digest runs over the joined bytes, and the write completes. The
/// cut is made by a small server of the test's own that serves the image's first half, then
/// drops the connection, and honours `Range` like the boot service's artifacts do.
#[tokio::test]
async fn a_broken_image_download_is_resumed_where_it_stopped() {
    use std::sync::Mutex;
    let ns = support::namespace("agent-resume").await;
    install_crds(&ns.client).await;
    let client = &ns.client;
    let artifacts = tempfile::tempdir().expect("tmp");
    let image = Arc::new(make_image(artifacts.path()));
    let ranges: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let cutting = {
        let image = image.clone();
        let ranges = ranges.clone();
        Router::new().route(
            "/os.raw",
            axum::routing::get(move |headers: axum::http::HeaderMap| {
                let image = image.clone();
                let ranges = ranges.clone();
                async move {
                    use axum::response::IntoResponse;
                    let range = headers
                        .get("range")
                        .and_then(|v| v.to_str().ok())
                        .map(String::from);
                    if let Ok(mut seen) = ranges.lock() {
                        seen.push(range.clone());
                    }
                    let total = image.len();
                    match range.and_then(|r| {
                        r.strip_prefix("bytes=")?
                            .strip_suffix('-')?
                            .parse::<usize>()
                            .ok()
                    }) {
                        Some(start) => (
                            axum::http::StatusCode::PARTIAL_CONTENT,
                            [(
                                "content-range",
                                format!("bytes {start}-{}/{total}", total - 1),
                            )],
                            image[start..].to_vec(),
                        )
                            .into_response(),
                        None => {
                            let half = axum::body::Bytes::copy_from_slice(&image[..total / 2]);
                            let chunks: Vec<Result<axum::body::Bytes, std::io::Error>> =
                                vec![Ok(half), Err(std::io::Error::other("the link went down"))];
                            (
                                [("content-length", total.to_string())],
                                axum::body::Body::from_stream(futures::stream::iter(chunks)),
                            )
                                .into_response()
                        }
                    }
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let cutting_url = format!("http://{}/os.raw", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, cutting).await });

    create_host(client, &ns.name, "host-0", "52:54:00:20:01:00").await;
    let machine = image_machine(
        client,
        &ns.name,
        "resumed",
        ImageSpec {
            url: cutting_url,
            checksum: digest_hex(ChecksumType::Sha256, &image),
            checksum_type: ChecksumType::Sha256,
            format: ImageFormat::Raw,
        },
    )
    .await;
    set_host_state(
        client,
        &ns.name,
        "host-0",
        HostState::Provisioning,
        Some(&machine),
    )
    .await;
    let record = create_boot_secret(client, &ns.name, &machine, "host-0", b"#cloud-config\n").await;
    let (state, base) = start_boot_service(&ns, artifacts.path()).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1 && s.machines.state().len() == 1
    })
    .await;
    let host_dir = tempfile::tempdir().expect("tmp");
    let (sys_root, dev_dir) = make_host(host_dir.path());
    let outcome = run(AgentConfig {
        url: format!("{base}/agent/{}", record.token.expose()),
        sys_root,
        dev_dir: dev_dir.clone(),
        patience: std::time::Duration::from_secs(20),
    })
    .await
    .expect("agent");
    assert_eq!(
        outcome,
        Outcome::Written {
            device: "vda".into(),
            bytes: image.len() as u64
        }
    );
    assert_eq!(
        read_at(&dev_dir.join("vda"), 1 << 20, 8 << 20),
        image[(1 << 20)..(9 << 20)].to_vec()
    );
    // One cut, one resume from the byte the agent reached: at most the half the server sent
    // (the cut may drop bytes still in flight), and the checksum above proves the join exact.
    let seen = ranges.lock().map(|r| r.clone()).unwrap_or_default();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], None, "{seen:?}");
    let resumed_at = seen[1].as_deref().and_then(|r| {
        r.strip_prefix("bytes=")?
            .strip_suffix('-')?
            .parse::<usize>()
            .ok()
    });
    assert!(
        resumed_at.is_some_and(|at| at <= image.len() / 2),
        "{seen:?}"
    );
}

/// Cleaning on release: a cleaning token (the boot Secret re-made for the released host) gets
/// the agent a `clean` task, serves no NoCloud data, takes no callback and no deployment
/// outcome; the agent wipes the disk's partition table and partition starts and reports
/// `Cleaned`, after which the token has nothing more to do.
#[tokio::test]
async fn a_cleaning_token_only_wipes_the_disks() {
    let ns = support::namespace("agent-clean").await;
    install_crds(&ns.client).await;
    let client = &ns.client;
    let artifacts = tempfile::tempdir().expect("tmp");
    let image = make_image(artifacts.path());
    let host = create_host(client, &ns.name, "host-c", "52:54:00:20:00:0c").await;
    let machine = image_machine(
        client,
        &ns.name,
        "released",
        ImageSpec {
            url: "os.raw".into(),
            checksum: digest_hex(ChecksumType::Sha256, &image),
            checksum_type: ChecksumType::Sha256,
            format: ImageFormat::Raw,
        },
    )
    .await;
    set_host_state(
        client,
        &ns.name,
        "host-c",
        HostState::Deprovisioning,
        Some(&machine),
    )
    .await;
    let secret = tokens::clean_boot_secret(&tokens::CleanAttempt {
        namespace: &ns.name,
        metal_machine: "released",
        host_owner: k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
            kind: "MetalHost".into(),
            name: "host-c".into(),
            uid: host.metadata.uid.clone().expect("uid"),
            ..Default::default()
        },
        cluster_name: None,
        provider_id: "metalboot://ns/host-c/uid",
        mode: metalboot::agent::wipe::WipeMode::Metadata,
    });
    let created = Api::<Secret>::namespaced(client.clone(), &ns.name)
        .create(&PostParams::default(), &secret)
        .await
        .expect("cleaning Secret");
    let record = tokens::parse_secret(&created).expect("parse");
    let token = record.token.expose().to_string();
    let (state, base) = start_boot_service(&ns, artifacts.path()).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1 && s.machines.state().len() == 1
    })
    .await;

    let http = reqwest::Client::new();
    for url in [
        format!("{base}/nocloud/{token}/user-data"),
        format!("{base}/nocloud/{token}/meta-data"),
    ] {
        let r = http.get(&url).send().await.expect("req");
        assert_eq!(r.status().as_u16(), 404, "{url}");
    }
    let r = http
        .post(format!("{base}/callback/{token}"))
        .json(&serde_json::json!({"hostname": "x"}))
        .send()
        .await
        .expect("req");
    assert_eq!(
        r.status().as_u16(),
        404,
        "a cleaning token takes no callback"
    );
    let r = http
        .post(format!("{base}/agent/{token}/report"))
        .json(&serde_json::json!({"state": "Written", "writtenBytes": 1}))
        .send()
        .await
        .expect("req");
    assert_eq!(r.status().as_u16(), 400, "a cleaning does not end Written");
    let task = http
        .get(format!("{base}/agent/{token}/task"))
        .send()
        .await
        .expect("task")
        .text()
        .await
        .expect("body");
    assert_eq!(task, r#"{"action":"clean","mode":"metadata"}"#);

    // The previous tenant's disk: the image, partition table and data.
    let host_dir = tempfile::tempdir().expect("tmp");
    let (sys_root, dev_dir) = make_host(host_dir.path());
    let disk = dev_dir.join("vda");
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(&disk)
            .expect("disk");
        f.write_all(&image).expect("previous tenant");
    }
    assert!(gpt::GptConfig::new().open(&disk).is_ok());
    let outcome = run(AgentConfig {
        url: format!("{base}/agent/{token}"),
        sys_root,
        dev_dir,
        patience: std::time::Duration::from_secs(20),
    })
    .await
    .expect("agent");
    assert_eq!(outcome, Outcome::Cleaned);
    let kept = boot_record(client, &ns.name, "released").await;
    let report = kept.deploy.expect("report recorded");
    assert_eq!(report.state, DeployState::Cleaned);
    assert!(
        report.message.as_deref().is_some_and(|m| m.contains("vda")),
        "{report:?}"
    );
    assert!(read_at(&disk, 0, 1 << 20).iter().all(|b| *b == 0));
    // The partition started at 1 MiB (sector 2048): its first MiB is gone too.
    assert!(read_at(&disk, 1 << 20, 1 << 20).iter().all(|b| *b == 0));
    assert!(gpt::GptConfig::new().open(&disk).is_err());
    let again = http
        .get(format!("{base}/agent/{token}/task"))
        .send()
        .await
        .expect("task");
    assert_eq!(
        again.status().as_u16(),
        404,
        "the cleaning token is spent once it reported"
    );
}

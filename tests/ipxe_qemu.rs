//! Real iPXE: QEMU's NIC ROM (Debian ipxe-qemu) boots against the running boot service and the
//! service's own access log shows the chain /boot.ipxe → /ipxe/<mac> → kernel → initrd.

mod support;

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::middleware;
use metalboot::api::metalhost::HostState;
use metalboot::api::metalmachine::BootProfile;
use metalboot::boot::{artifacts::artifacts_router, http};
use support::boot::*;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;

/// The service's log, captured in memory.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut v) = self.0.lock() {
            v.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Log {
    type Writer = Log;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

impl Log {
    fn text(&self) -> String {
        self.0
            .lock()
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default()
    }
}

const MAC: &str = "52:54:00:be:ef:01";

#[tokio::test]
async fn qemu_ipxe_follows_the_chain_to_kernel_and_initrd() {
    let log = Log::default();
    let _ = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new(
            "metalboot::boot::access=info",
        ))
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(log.clone()),
        )
        .try_init();

    let ns = support::namespace("ipxe-qemu").await;
    install_crds(&ns.client).await;
    create_host(&ns.client, &ns.name, "host-0", MAC).await;
    let machine = create_machine(
        &ns.client,
        &ns.name,
        "m1",
        BootProfile {
            kernel: "kernel.lkrn".into(),
            initrds: vec!["initrd.img".into()],
            cmdline: Some("console=ttyS0".into()),
        },
    )
    .await;
    set_host_state(
        &ns.client,
        &ns.name,
        "host-0",
        HostState::Provisioning,
        Some(&machine),
    )
    .await;
    create_boot_secret(&ns.client, &ns.name, &machine, "host-0", b"#!/bin/sh\n").await;

    // Any small kernel will do: iPXE's own Linux-kernel build (the OS boot is the lab's business).
    let artifacts = tempfile::tempdir().expect("tempdir");
    std::fs::copy(
        "/usr/lib/ipxe/ipxe.lkrn",
        artifacts.path().join("kernel.lkrn"),
    )
    .expect("ipxe.lkrn from Debian's ipxe package");
    std::fs::write(artifacts.path().join("initrd.img"), vec![7u8; 4096]).expect("initrd");

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let base = format!("http://10.0.2.2:{port}");
    let (state, _rx) = boot_state(&ns.client, &ns.name, &base, false).await;
    until_stores("fixture in the stores", &state, |s| {
        s.boot_secrets.state().len() == 1
    })
    .await;
    let app = http::router(state)
        .nest(
            "/artifacts",
            artifacts_router(artifacts.path().to_path_buf()),
        )
        .layer(middleware::from_fn(http::access_log))
        .into_make_service_with_connect_info::<SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let qemu_dir = tempfile::tempdir().expect("tempdir");
    let mut qemu = tokio::process::Command::new("qemu-system-x86_64")
        .args([
            "-machine",
            "pc,accel=tcg",
            "-m",
            "256",
            "-display",
            "none",
            "-monitor",
            "none",
            "-serial",
            "none",
        ])
        .args(["-netdev", &format!("user,id=n0,bootfile={base}/boot.ipxe")])
        .args(["-device", &format!("virtio-net-pci,netdev=n0,mac={MAC}")])
        .args(["-boot", "once=n"])
        .current_dir(qemu_dir.path())
        .kill_on_drop(true)
        .spawn()
        .expect("qemu-system-x86_64 (make test installs it)");

    let chain = [
        "path=/boot.ipxe",
        "path=/ipxe/52-54-00-be-ef-01",
        "path=/artifacts/kernel.lkrn",
        "path=/artifacts/initrd.img",
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    loop {
        let text = log.text();
        let positions: Vec<Option<usize>> = chain.iter().map(|p| text.find(p)).collect();
        if positions.iter().all(Option::is_some) {
            let ordered: Vec<usize> = positions.into_iter().flatten().collect();
            assert!(
                ordered.windows(2).all(|w| w[0] < w[1]),
                "chain out of order:\n{text}"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "iPXE did not follow the chain within 180 s; service log:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _ = qemu.kill().await;
    let text = log.text();
    for line in text.lines().filter(|l| chain.iter().any(|p| l.contains(p))) {
        assert!(line.contains("status=200"), "{line}");
    }
}

//! The lab's virtual BMC passes the same Redfish conformance suite as sushy-tools, with a real
//! QEMU host behind it.

#[path = "support/redfish_conformance.rs"]
mod conformance;

use std::sync::Arc;

use metalboot::bmc::Credentials;
use metalboot::bmc::redfish::RedfishOptions;
use metalboot::lab::qemu::{Accel, Firmware, HostNetwork, QemuHost, QemuHostSpec};
use metalboot::lab::vbmc::{VirtualBmc, router};

#[tokio::test]
async fn the_lab_bmc_passes_the_redfish_conformance_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = Arc::new(QemuHost::new(QemuHostSpec {
        name: "lab-host-0".into(),
        uuid: "6d62a1b0-0000-4000-8000-000000000001".into(),
        mac: "52:54:00:6d:62:00".into(),
        memory_mib: 256,
        // Nothing answers here: the guest's iPXE just retries; the test is about the BMC.
        network: HostNetwork::User {
            bootfile_url: "http://10.0.2.2:9/boot.ipxe".into(),
        },
        firmware: Firmware::Bios,
        dir: dir.path().join("lab-host-0"),
        accel: Accel::Tcg,
        graceful_seconds: 2,
        disk: None,
    }));
    let bmc = Arc::new(VirtualBmc::new(
        vec![host.clone()],
        "admin".into(),
        "lab-pass".into(),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(listener, router(bmc)).await });

    let address = format!("redfish+http://127.0.0.1:{port}/redfish/v1/Systems/lab-host-0");
    let report = conformance::redfish_conformance(
        &address,
        Credentials::new("admin", "lab-pass"),
        RedfishOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("conformance failed: {e}"));
    println!("{report:?}");
    println!(
        "metalboot bmc probe (lab BMC):\n{}",
        metalboot::bmc::cli::probe_text(&report.probe)
    );
    assert_eq!(report.probe.sessions, Some(true));
    assert_eq!(report.probe.uefi_http_boot, Some(true));
    assert_eq!(report.probe.boot_modes, ["Legacy", "UEFI"]);
    assert!(
        host.power_ons().await >= 2,
        "QEMU was really started by the power actions"
    );
    assert!(
        host.pid().await.is_none(),
        "the suite ends with the host forced off"
    );

    // Discovery without a system path works when there is exactly one system.
    let discovered = conformance::redfish_conformance(
        &format!("redfish+http://127.0.0.1:{port}"),
        Credentials::new("admin", "lab-pass"),
        RedfishOptions::default(),
    )
    .await;
    assert!(discovered.is_ok(), "{discovered:?}");
    // Wrong password is refused.
    let wrong = conformance::redfish_conformance(
        &address,
        Credentials::new("admin", "nope"),
        RedfishOptions::default(),
    )
    .await;
    assert!(wrong.is_err_and(|e| e.contains("BmcAuthFailed")));
}

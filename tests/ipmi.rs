//! The IPMI driver against a real IPMI 2.0 BMC: OpenIPMI's `ipmi_sim` on loopback (RMCP+,
//! cipher-suite negotiation, users), whose chassis-control program records what reached the
//! "hardware". The same `Bmc` trait the controllers use; `metalboot bmc` on an `ipmi://` address.

#[path = "support/ipmisim.rs"]
mod ipmisim;
mod support;

use std::time::Duration;

use metalboot::bmc::redfish::RedfishOptions;
use metalboot::bmc::{BmcError, BootDevice, BootMode, Credentials, PowerState};

fn options() -> RedfishOptions {
    RedfishOptions {
        timeout: Duration::from_secs(20),
        ..RedfishOptions::default()
    }
}

#[tokio::test]
async fn power_and_boot_once_reach_the_simulated_chassis() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = ipmisim::start(dir.path()).await;
    let bmc = metalboot::bmc::connect(
        &sim.address(),
        Credentials::new(ipmisim::USER, ipmisim::PASSWORD),
        options(),
    )
    .expect("an IPMI driver for ipmi://");
    assert_eq!(bmc.power_state().await.expect("status"), PowerState::Off);

    bmc.set_boot_once(BootDevice::Pxe, Some(BootMode::UEFI))
        .await
        .expect("boot once pxe");
    let boot = bmc.boot_override().await.expect("boot flags");
    assert_eq!(boot.target.as_deref(), Some("Pxe"));
    // ipmi_sim keeps the device selector but not the first flags byte (valid, persistent, EFI;
    // real BMCs clear "valid" 60 s after it is set, IPMI 2.0 §28.12): what counts is what
    // reached the chassis, checked below.
    assert!(boot.enabled.is_some() && boot.mode.is_some());

    // A cycle of a host that is off powers it on (the action follows the observed state).
    bmc.power_cycle().await.expect("cycle from off");
    assert_eq!(sim.power(), "1");
    assert_eq!(bmc.power_state().await.expect("status"), PowerState::On);
    bmc.power_cycle().await.expect("cycle while on");
    bmc.power_off_graceful().await.expect("soft off");
    bmc.power_on().await.expect("on");
    bmc.power_off_force().await.expect("off");
    assert_eq!(sim.power(), "0");
    let calls = sim.calls();
    println!("ipmi_sim chassis calls: {calls:?}");
    for want in [
        "set boot pxe",
        "set power 1",
        "set shutdown 1",
        "set power 0",
    ] {
        assert!(calls.iter().any(|c| c == want), "{want} in {calls:?}");
    }
    let probe = bmc.probe().await.expect("probe");
    println!(
        "metalboot bmc probe (ipmi_sim):\n{}",
        metalboot::bmc::cli::probe_text(&probe)
    );
    assert_eq!(probe.protocol, "IPMI");
    assert_eq!(
        probe.cipher_suite,
        Some(3),
        "ipmi_sim refuses suite 17's algorithms"
    );
    let inventory = bmc.inventory().await.expect("mc info");
    assert_eq!(
        inventory.extra.get("protocol").map(String::as_str),
        Some("IPMI 2.0")
    );
}

#[tokio::test]
async fn wrong_credentials_and_silence_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = ipmisim::start(dir.path()).await;
    let wrong = metalboot::bmc::connect(
        &sim.address(),
        Credentials::new(ipmisim::USER, "not-the-password"),
        options(),
    )
    .expect("driver");
    let err = wrong.power_state().await.expect_err("wrong password");
    assert!(matches!(err, BmcError::AuthFailed { .. }), "{err}");
    assert_eq!(err.reason(), "BmcAuthFailed");
    assert!(!err.to_string().contains("not-the-password"), "{err}");

    let nobody = metalboot::bmc::connect(
        &sim.address(),
        Credentials::new("nobody", ipmisim::PASSWORD),
        options(),
    )
    .expect("driver");
    let err = nobody.power_on().await.expect_err("unknown user");
    assert!(matches!(err, BmcError::AuthFailed { .. }), "{err}");
    assert!(
        sim.calls().iter().all(|c| !c.starts_with("set")),
        "nothing reached the chassis"
    );

    // Nobody listens: a bounded wait (ipmitool's own retries) and an Unreachable error.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("port")
        .port();
    let silent = metalboot::bmc::connect(
        &format!("ipmi://127.0.0.1:{port}"),
        Credentials::new(ipmisim::USER, ipmisim::PASSWORD),
        options(),
    )
    .expect("driver");
    let err = silent.power_state().await.expect_err("silence");
    assert_eq!(err.reason(), "BmcUnreachable", "{err}");
    assert!(err.is_transient());
}

#[tokio::test]
async fn metalboot_bmc_drives_an_ipmi_host() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = ipmisim::start(dir.path()).await;
    let password = dir.path().join("password");
    std::fs::write(&password, ipmisim::PASSWORD).expect("password file");
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_metalboot"))
            .args([
                "bmc",
                "--address",
                &sim.address(),
                "--username",
                ipmisim::USER,
            ])
            .arg("--password-file")
            .arg(&password)
            .args(args)
            .output()
            .expect("metalboot bmc")
    };
    for args in [
        &["power-on"][..],
        &["boot-once", "pxe"],
        &["status"],
        &["power-off", "--force"],
    ] {
        let out = run(args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "metalboot bmc {args:?}: {text}");
        assert!(!text.contains(ipmisim::PASSWORD), "{text}");
    }
    let calls = sim.calls();
    assert!(calls.iter().any(|c| c == "set power 1"), "{calls:?}");
    assert!(calls.iter().any(|c| c == "set boot pxe"), "{calls:?}");
    assert_eq!(sim.power(), "0");
}

//! The replay suite: `metalboot bmc` — every subcommand — against five vendor personalities built
//! from real vendors' Redfish replies (Dell iDRAC, HPE iLO 5 and sushy's generic service, fetched
//! by `hack/redfish-replay.sh`) with scripted behaviours: ETags a PATCH must match, reset types only
//! in an ActionInfo resource, a settings object for the boot mode, task monitors (202 + Location)
//! for resets, busy answers (503 + Retry-After) on the first request of each verb, the session
//! login included. Each subcommand's effect is checked at the server. Then how the driver reads
//! a one-time boot back (with the power state, one request) and what it does for a BMC that
//! offers no `Once`.

#[path = "support/replay.rs"]
mod replay;
mod support;

use std::process::Command;

/// Runs `metalboot bmc`; returns success, stdout (the JSON) and everything it printed.
fn bmc(
    replay: &replay::Replay,
    password: &std::path::Path,
    args: &[&str],
) -> (bool, String, String) {
    bmc_as(replay, password, "json", args)
}

/// Runs `metalboot bmc --output <output>`.
fn bmc_as(
    replay: &replay::Replay,
    password: &std::path::Path,
    output: &str,
    args: &[&str],
) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_metalboot"))
        .args(["bmc", "--address"])
        .arg(format!(
            "redfish+http://127.0.0.1:{}{}",
            replay.port,
            replay.system_path()
        ))
        .args(["--username", replay::USER, "--password-file"])
        .arg(password)
        .args(["--output", output])
        .args(args)
        .output()
        .expect("metalboot bmc");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains(replay::PASSWORD),
        "the password leaked: {text}"
    );
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        text,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bmc_subcommand_against_five_vendor_personalities() {
    let dir = tempfile::tempdir().expect("tempdir");
    let password = dir.path().join("password");
    std::fs::write(&password, replay::PASSWORD).expect("password file");
    for personality in replay::personalities() {
        let name = personality.name;
        let server = replay::start(&personality).await;
        let run = |args: &[&str]| {
            let (ok, stdout, text) = bmc(&server, &password, args);
            assert!(ok, "{name}: metalboot bmc {args:?}: {text}");
            stdout
        };

        let probe: serde_json::Value = serde_json::from_str(&run(&["probe"])).expect("probe JSON");
        println!("{name}: probe {probe}");
        // What an operator reads: `metalboot bmc probe` as it prints by default.
        let (ok, text, all) = bmc_as(&server, &password, "text", &["probe"]);
        assert!(ok, "{name}: metalboot bmc probe: {all}");
        println!("{name}: metalboot bmc probe\n{text}");
        assert!(
            text.starts_with("protocol:       Redfish"),
            "{name}: {text}"
        );
        assert_eq!(probe["protocol"], "Redfish", "{name}");
        assert!(
            probe["resetTypes"]
                .as_array()
                .is_some_and(|t| !t.is_empty()),
            "{name}: {probe}"
        );
        if personality.behaviour.action_info {
            assert_eq!(probe["resetTypesSource"], "ActionInfo", "{name}");
        }
        assert_eq!(
            probe["etag"],
            serde_json::json!(personality.behaviour.etag_required),
            "{name}"
        );

        let status: serde_json::Value =
            serde_json::from_str(&run(&["status"])).expect("status JSON");
        assert_eq!(status["powerState"], "Off", "{name}: {status}");

        run(&["power-on"]);
        assert_eq!(server.power(), "On", "{name}");
        run(&["boot-once", "pxe", "--mode", "uefi"]);
        run(&["reset"]);
        assert_eq!(server.power(), "On", "{name}: a reset leaves the host on");
        // After the reset: what a settings object held has been applied too.
        let boot = server.boot();
        assert_eq!(boot["BootSourceOverrideTarget"], "Pxe", "{name}: {boot}");
        assert_eq!(boot["BootSourceOverrideEnabled"], "Once", "{name}: {boot}");
        assert_eq!(boot["BootSourceOverrideMode"], "UEFI", "{name}: {boot}");
        run(&["power-off"]);
        assert_eq!(
            server.power(),
            "Off",
            "{name}: graceful off (or the power button)"
        );
        run(&["power-on"]);
        run(&["power-off", "--force"]);
        assert_eq!(server.power(), "Off", "{name}");
        let inventory = run(&["inventory"]);
        assert!(
            inventory.contains("52:54:00:aa:bb:01"),
            "{name}: {inventory}"
        );

        let log = server.log();
        if personality.behaviour.etag_required {
            assert!(
                log.iter().any(|(m, _, s)| m == "PATCH" && *s == 204)
                    && !log.iter().any(|(_, _, s)| *s == 412),
                "{name}: every PATCH carried the ETag: {log:?}"
            );
        }
        if personality.behaviour.settings.is_some() {
            assert!(
                log.iter()
                    .any(|(m, p, s)| m == "PATCH" && p.ends_with("/Settings") && *s == 202),
                "{name}: the mode went to the settings object: {log:?}"
            );
        }
        if personality.behaviour.task_monitor {
            let polls: Vec<u16> = log
                .iter()
                .filter(|(m, p, _)| m == "GET" && p.contains("/TaskMonitors/"))
                .map(|(_, _, s)| *s)
                .collect();
            assert!(
                polls.contains(&202) && polls.contains(&200),
                "{name}: every reset waited for its task monitor: {polls:?}"
            );
        }
        if personality.behaviour.busy_first {
            let busy: Vec<_> = log.iter().filter(|(_, _, s)| *s == 503).collect();
            assert!(
                busy.iter().any(|(m, _, _)| m == "POST"),
                "{name}: a busy POST (the login) was retried: {log:?}"
            );
            assert!(busy.len() >= 2, "{name}: {log:?}");
        }
    }
}

/// Reading a one-time boot back costs the power-on nothing on Redfish: power state and override
/// come from one GET of the system, as the power state alone did. The iDRAC personality keeps
/// `Once` as asked, so the reading says `Honoured`.
#[tokio::test]
async fn the_override_is_read_back_with_the_power_state_in_one_request() {
    use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
    use metalboot::bmc::{Bmc, BootDevice, BootOnce, Credentials, PowerState};
    let personality = replay::personalities()
        .into_iter()
        .find(|p| p.dir == "idrac" && p.behaviour.settings.is_none())
        .expect("the iDRAC personality");
    let server = replay::start(&personality).await;
    let system = server.system_path();
    let bmc = RedfishBmc::new(
        &format!("redfish+http://127.0.0.1:{}{system}", server.port),
        Credentials::new(replay::USER, replay::PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver");
    bmc.set_boot_once(BootDevice::Pxe, None)
        .await
        .expect("boot once");
    let requests = |from: usize| server.log()[from..].to_vec();
    let one_get = vec![("GET".to_string(), system.clone(), 200)];

    let before = server.log().len();
    let power = bmc.power_state().await.expect("power");
    assert_eq!(requests(before), one_get, "the power state alone");

    let before = server.log().len();
    let (both, read) = bmc.power_and_boot_override().await.expect("both");
    assert_eq!(requests(before), one_get, "power state and override");
    assert_eq!(both, power);
    assert_eq!(both, PowerState::Off);
    assert_eq!(
        read.once_after_setting(BootDevice::Pxe),
        Some(BootOnce::Honoured)
    );
    bmc.logout().await.expect("logout");
}

/// A BMC whose override offers no `Once` (allowable values `Continuous`, `Disabled`; a `Once`
/// is refused): the probe says so without writing (`bootOnce: Continuous`), the driver asks for
/// the override it keeps, and `metalboot bmc boot-once` says what the BMC does with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bmc_that_offers_no_once_gets_the_override_it_keeps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let password = dir.path().join("password");
    std::fs::write(&password, replay::PASSWORD).expect("password file");
    let personality = replay::Personality {
        name: "generic (sushy samples), no Once offered",
        dir: "sushy",
        system_key: None,
        behaviour: replay::Behaviour {
            once_not_offered: true,
            ..Default::default()
        },
    };
    let server = replay::start(&personality).await;
    let (ok, json, all) = bmc(&server, &password, &["probe"]);
    assert!(ok, "{all}");
    let probe: serde_json::Value = serde_json::from_str(&json).expect("probe JSON");
    assert_eq!(probe["bootOnce"], "Continuous", "{probe}");
    let (ok, text, all) = bmc_as(&server, &password, "text", &["probe"]);
    assert!(ok, "{all}");
    println!("{}: metalboot bmc probe\n{text}", personality.name);
    assert!(text.contains("\nboot once:      Continuous"), "{text}");

    let (ok, text, all) = bmc_as(&server, &password, "text", &["boot-once", "pxe"]);
    assert!(ok, "{all}");
    println!("{}: metalboot bmc boot-once pxe\n{text}", personality.name);
    assert!(text.contains("(bootOnce: Continuous)"), "{text}");
    let boot = server.boot();
    assert_eq!(boot["BootSourceOverrideTarget"], "Pxe", "{boot}");
    assert_eq!(boot["BootSourceOverrideEnabled"], "Continuous", "{boot}");
    assert!(
        !server
            .log()
            .iter()
            .any(|(m, _, s)| m == "PATCH" && *s == 400),
        "no Once was sent: {:?}",
        server.log()
    );
}

//! DMTF's Redfish Service Validator against the lab's virtual BMC: every resource the BMC serves is
//! walked from the service root, and each property checked against DMTF's schemas (CSDL), with
//! basic auth and with a Redfish session. The BMC serves two systems, a QEMU lab host (not
//! started) and a simulated fleet host, one of them with a boot override set.
//!
//! The validator (`redfish-service-validator` from PyPI) lives in the test venv that
//! `hack/sushy-tools.sh` makes; the schemas in `target/tools/redfish-schemas`, fetched by
//! `hack/redfish-replay.sh` (`make test` runs both). It runs offline: `--skipschema` uses those
//! schemas only, and a schema it cannot find would be a warning, so warnings are shown too.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use metalboot::lab::fleet::{FaultShares, Fleet, FleetOptions};
use metalboot::lab::qemu::{Accel, BootOverride, Firmware, HostNetwork, QemuHost, QemuHostSpec};
use metalboot::lab::vbmc::{LabSystem, VirtualBmc, serve_on_loopback};

const USER: &str = "admin";
const PASSWORD: &str = "validator-pass";

fn project_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The validator and the schemas, or a panic that says which script makes them.
fn tools() -> (PathBuf, PathBuf) {
    let validator = project_dir().join("target/tools/sushy/bin/rf_service_validator");
    let schemas = project_dir().join("target/tools/redfish-schemas");
    assert!(
        validator.is_file(),
        "{} is missing: run hack/sushy-tools.sh (or `make sushy`), which installs \
         redfish-service-validator into the test venv",
        validator.display()
    );
    assert!(
        schemas.join("ServiceRoot_v1.xml").is_file()
            && schemas.join("ComputerSystem_v1.xml").is_file(),
        "DMTF's Redfish schemas are missing from {}: run hack/redfish-replay.sh (or `make replay`)",
        schemas.display()
    );
    (validator, schemas)
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Counts {
    pass: u64,
    warn: u64,
    fail: u64,
    /// `Skip` per resource, `NOT TESTED` in the totals.
    skip: u64,
}

#[derive(Debug, Default)]
struct Summary {
    /// `Validating <uri>...` and the counts that follow it, in the order walked.
    resources: Vec<(String, Counts)>,
    total: Option<Counts>,
}

/// Reads the validator's console output: a `Validating <uri>...` line per resource followed by
/// `  - Pass: N, Warn: N, Fail: N, Skip: N`, and at the end the table
/// `| PASS | WARN | FAIL | NOT TESTED |` with one row of numbers.
fn parse(stdout: &str) -> Summary {
    let mut summary = Summary::default();
    let mut current: Option<String> = None;
    let lines: Vec<&str> = stdout.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if let Some(uri) = line
            .strip_prefix("Validating ")
            .and_then(|r| r.strip_suffix("..."))
        {
            current = Some(uri.to_string());
        } else if let Some(rest) = line.trim().strip_prefix("- Pass:") {
            let numbers: Vec<u64> = format!("Pass:{rest}")
                .split(',')
                .filter_map(|kv| kv.split(':').nth(1)?.trim().parse().ok())
                .collect();
            if let (Some(uri), [pass, warn, fail, skip]) = (current.take(), numbers.as_slice()) {
                summary.resources.push((
                    uri,
                    Counts {
                        pass: *pass,
                        warn: *warn,
                        fail: *fail,
                        skip: *skip,
                    },
                ));
            }
        } else if line.contains("PASS") && line.contains("FAIL") && line.contains("NOT TESTED") {
            // The header, a rule, then the numbers.
            let numbers: Vec<u64> = lines
                .get(i + 2)
                .map(|row| {
                    row.split('|')
                        .filter_map(|cell| cell.trim().parse().ok())
                        .collect()
                })
                .unwrap_or_default();
            if let [pass, warn, fail, skip] = numbers.as_slice() {
                summary.total = Some(Counts {
                    pass: *pass,
                    warn: *warn,
                    fail: *fail,
                    skip: *skip,
                });
            }
        }
    }
    summary
}

/// The `CRITICAL`, `ERROR` and `WARNING` lines of the validator's debug log in `logdir`: what failed and
/// what warned, with the property and the reason.
fn problem_lines(logdir: &Path) -> Vec<String> {
    let mut logs = Vec::new();
    let mut dirs = vec![logdir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "log") {
                logs.push(path);
            }
        }
    }
    logs.iter()
        .flat_map(|log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    [" - CRITICAL - ", " - ERROR - ", " - WARNING - "]
                        .iter()
                        .any(|level| l.contains(level))
                })
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

struct Run {
    status: std::process::ExitStatus,
    stdout: String,
    summary: Summary,
    problems: Vec<String>,
}

async fn validate(port: u16, authtype: &str) -> Run {
    let (validator, schemas) = tools();
    let work = tempfile::tempdir().expect("tempdir");
    let logdir = work.path().join("logs");
    let out = tokio::process::Command::new(&validator)
        .args(["--rhost", &format!("http://127.0.0.1:{port}")])
        .args(["-u", USER, "-p", PASSWORD, "--authtype", authtype])
        .arg("--schema_directory")
        .arg(&schemas)
        .arg("--skipschema")
        .arg("--logdir")
        .arg(&logdir)
        .args(["--timeout", "10"])
        // Its default config.ini is read from the working directory: an empty one.
        .current_dir(work.path())
        // Loopback, never through a proxy from the environment.
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("ALL_PROXY")
        .env_remove("all_proxy")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), out)
        .await
        .expect("the validator finishes within 300 s")
        .unwrap_or_else(|e| panic!("running {}: {e}", validator.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- rf_service_validator --authtype {authtype} ---\n{stdout}{stderr}");
    Run {
        status: out.status,
        summary: parse(&stdout),
        problems: problem_lines(&logdir),
        stdout,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lab_bmc_passes_the_dmtf_redfish_service_validator() {
    tools();
    let dir = tempfile::tempdir().expect("tempdir");
    // A QEMU lab host that is never powered on: its system reads Off and no QEMU runs.
    let qemu = Arc::new(QemuHost::new(QemuHostSpec {
        name: "lab-host-q".into(),
        uuid: "6d62a1b0-0000-4000-8000-0000000000aa".into(),
        mac: "52:54:00:6d:62:aa".into(),
        memory_mib: 256,
        network: HostNetwork::User {
            bootfile_url: "http://10.0.2.2:9/boot.ipxe".into(),
        },
        firmware: Firmware::UefiHttp,
        dir: dir.path().join("lab-host-q"),
        accel: Accel::Tcg,
        graceful_seconds: 2,
        disk: None,
    }));
    qemu.set_boot_override(BootOverride {
        target: "UefiHttp".into(),
        enabled: "Once".into(),
        mode: "UEFI".into(),
    })
    .await;
    // A simulated fleet host (no boot service: it is never powered on either).
    let fleet = Fleet::new(FleetOptions {
        hosts: 1,
        boot_url: "http://127.0.0.1:9".into(),
        boot_delay: Duration::from_secs(1),
        os_delay: Duration::from_secs(1),
        faults: FaultShares::default(),
        concurrent_boots: 1,
    })
    .expect("fleet");
    let mut systems = fleet.systems();
    systems.push(LabSystem::Qemu(qemu.clone()));
    let bmc = Arc::new(VirtualBmc::with_systems(
        systems,
        USER.into(),
        PASSWORD.into(),
    ));
    let port = serve_on_loopback(bmc).await.expect("serving the BMC");

    // Everything the BMC serves that the validator must have walked to.
    let mut expected: BTreeSet<String> = [
        "/redfish/v1/",
        "/redfish/v1/Systems",
        "/redfish/v1/SessionService",
        "/redfish/v1/SessionService/Sessions",
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    for id in ["lab-host-0", "lab-host-q"] {
        expected.insert(format!("/redfish/v1/Systems/{id}"));
        expected.insert(format!("/redfish/v1/Systems/{id}/EthernetInterfaces"));
        expected.insert(format!("/redfish/v1/Systems/{id}/EthernetInterfaces/nic0"));
    }

    let mut failures = Vec::new();
    for authtype in ["Basic", "Session"] {
        let run = validate(port, authtype).await;
        let walked: BTreeSet<String> = run
            .summary
            .resources
            .iter()
            .map(|(uri, _)| uri.clone())
            .collect();
        println!("walked ({authtype}): {walked:?}");
        let total = run.summary.total;
        let mut found = Vec::new();
        let mut fail = |why: String| found.push(format!("--authtype {authtype}: {why}"));
        if !run.status.success() {
            fail(format!("exit status {}", run.status));
        }
        match total {
            None => fail(format!("no summary table in the output:\n{}", run.stdout)),
            Some(t) => {
                if t.pass == 0 {
                    fail(format!("no property passed: {t:?}"));
                }
                if t.fail != 0 {
                    fail(format!("{} failed: {t:?}", t.fail));
                }
                // A resource whose schema is missing is a warning, and was not checked.
                if t.warn != 0 {
                    fail(format!("{} warned: {t:?}", t.warn));
                }
            }
        }
        let missing: Vec<&String> = expected.difference(&walked).collect();
        if !missing.is_empty() {
            fail(format!("not walked: {missing:?}"));
        }
        for (uri, counts) in &run.summary.resources {
            if counts.fail != 0 || counts.warn != 0 {
                fail(format!("{uri}: {counts:?}"));
            }
        }
        if authtype == "Session"
            && !walked
                .iter()
                .any(|u| u.starts_with("/redfish/v1/SessionService/Sessions/"))
        {
            fail("the validator's own session was not walked".into());
        }
        if !found.is_empty() {
            found.push(format!(
                "the validator's failing and warning lines (--authtype {authtype}):\n{}",
                run.problems.join("\n")
            ));
        }
        failures.extend(found);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The parser reads failures where the validator prints them (its output on this BMC before the
/// fixes), so a failing run cannot pass as an empty one.
#[test]
fn the_summary_parser_reads_failures() {
    let out = "Redfish Service Validator, Version 3.1.8\n\
        \n\
        Validating /redfish/v1/...\n\
        \x20 - Pass: 6, Warn: 0, Fail: 3, Skip: 32\n\
        Validating /redfish/v1/Systems...\n\
        \x20 - Pass: 0, Warn: 1, Fail: 1, Skip: 0\n\
        \n\
        +--------------+--------------+--------------+--------------+\n\
        |     PASS     |     WARN     |     FAIL     |  NOT TESTED  |\n\
        +--------------+--------------+--------------+--------------+\n\
        |      40      |      1       |      12      |     158      |\n\
        +--------------+--------------+--------------+--------------+\n";
    let s = parse(out);
    let counts = |pass, warn, fail, skip| Counts {
        pass,
        warn,
        fail,
        skip,
    };
    assert_eq!(
        s.resources,
        [
            ("/redfish/v1/".to_string(), counts(6, 0, 3, 32)),
            ("/redfish/v1/Systems".to_string(), counts(0, 1, 1, 0)),
        ]
    );
    assert_eq!(s.total, Some(counts(40, 1, 12, 158)));
}

//! Image mode end to end on one real QEMU host behind the lab's virtual BMC, driven by the real
//! manager (controllers and boot service) against the real apiserver: the MetalMachine claims
//! the host, the controller powers it on for a network boot over Redfish, real iPXE loads the
//! deploy ramdisk, `metalboot agent` inspects the host (→ `MetalHost.status.hardware`) and writes
//! the real Debian image to the virtio disk; the controller restarts the host into its disk over
//! the BMC; the installed OS's real cloud-init runs the user-data and calls back; the machine is
//! provisioned. Then a power cycle through the BMC boots the installed OS again: no new token,
//! the machine stays provisioned, the user-data does not run twice. Then the machine is deleted:
//! the deploy agent wipes the disk before the host is Available again, and a second tenant's
//! OS on the same host, written from the qcow2 form of the image, does not find the marker the
//! first one left.
//!
//! Live mode on the same rig, with a diskless host: the real Debian system netboots through
//! live-boot (kernel, initrd, squashfs over HTTP) and its real cloud-init calls back; a reset
//! through the BMC network-boots it again with a fresh per-boot token, and it comes back as the
//! same node (hostname, providerID) while the machine stays provisioned.

#[path = "support/rig.rs"]
mod rig;
mod support;

use std::path::Path;

use kube::api::{Api, DeleteParams};
use metalboot::api::metalhost::HostState;
use metalboot::api::{MetalHost, MetalMachine};
use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, Credentials, PowerAction};

const MAC: &str = "52:54:00:6d:62:10";
const RAN: &str = "metalboot-e2e: user-data ran";
/// What the first tenant's OS leaves on its disk, and what the second must not find.
const MARKER: &str = "/var/lib/metalboot-e2e-tenant-1";
const SECOND_RAN: &str = "metalboot-e2e: second tenant ran, no marker";

use rig::*;

/// Named to sort first: libtest starts tests in name order, so the longest one here runs beside
/// the others instead of alone after them.
#[tokio::test]
async fn a_disk_image_machine_is_installed_boots_its_disk_and_survives_a_power_cycle() {
    let env = setup(
        "image-e2e",
        MAC,
        vec![
            format!("echo tenant-1 > {MARKER}"),
            format!("test -e {MARKER}"),
            format!("echo '{RAN}' > /dev/console"),
        ],
        900,
        First::Image {
            checksum_override: None,
        },
    )
    .await;
    let Env {
        ns,
        host,
        bmc_address,
        machines,
        secrets,
        ..
    } = &env;
    let client = &ns.client;
    let provisioned = support::eventually_or("the MetalMachine provisioned", 1500, || async {
        machines
            .get("node")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let Some(provisioned) = provisioned else {
        let mm = machines.get("node").await.ok();
        panic!(
            "not provisioned: {:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            tail(&console(host), 8000)
        );
    };
    let hosts: Api<MetalHost> = Api::namespaced(client.clone(), &ns.name);
    // The MetalHost controller shows the claim's outcome on its own pass, after the machine's.
    let provisioned_host = support::eventually_or("the MetalHost Provisioned", 60, || async {
        let h = hosts.get("host-0").await.ok()?;
        (h.status.as_ref()?.state == Some(HostState::Provisioned)).then_some(h)
    })
    .await;
    let status = match provisioned_host {
        Some(h) => h.status.unwrap_or_default(),
        None => {
            let h = hosts.get("host-0").await.expect("host");
            panic!("the MetalHost is not Provisioned: {:?}", h.status);
        }
    };
    let hardware = status.hardware.expect("hardware");
    let vda = hardware
        .disks
        .iter()
        .find(|d| d.name == "vda")
        .unwrap_or_else(|| panic!("the agent's disks are not on the host: {hardware:?}"));
    assert_eq!(vda.size_bytes, 4 << 30);
    assert_eq!(vda.serial_number.as_deref(), Some("host-0"));
    assert_eq!(hardware.firmware_mode.as_deref(), Some("BIOS"));
    let first = console(host);
    assert_eq!(first.matches(RAN).count(), 1, "{}", tail(&first, 8000));
    assert!(
        first.contains("metalboot agent") || first.contains("metalboot::agent"),
        "the deploy agent ran on this host:\n{}",
        tail(&first, 8000)
    );

    // A power cycle through the BMC: the installed OS boots again, nothing is provisioned again.
    let boots_before = console(host).matches("finished at").count();
    let driver = RedfishBmc::new(
        bmc_address,
        Credentials::new(USER, PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver");
    driver.power(PowerAction::Cycle).await.expect("power cycle");
    let again = support::eventually_or("the installed OS booted again", 900, || async {
        (console(host).matches("finished at").count() > boots_before).then_some(())
    })
    .await;
    let text = console(host);
    assert!(
        again.is_some(),
        "no second boot of the installed OS:\n{}",
        tail(&text, 8000)
    );
    assert_eq!(
        text.matches(RAN).count(),
        1,
        "the user-data ran twice:\n{}",
        tail(&text, 8000)
    );
    let last = text
        .lines()
        .rfind(|l| l.contains("finished at"))
        .unwrap_or_default();
    assert!(last.contains("DataSourceNoCloud"), "{last}");
    let after = machines.get("node").await.expect("MetalMachine");
    assert_eq!(after.spec.provider_id, provisioned.spec.provider_id);
    assert!(
        secrets
            .get_opt(&metalboot::boot::tokens::boot_secret_name("node"))
            .await
            .expect("get")
            .is_none(),
        "a boot Secret (a new token) exists after the power cycle"
    );

    // Release: the deploy agent wipes the disk before the host is Available again.
    let starts = partition_starts(&env.disk);
    assert!(
        starts.len() >= 2,
        "the installed disk has its partitions: {starts:?}"
    );
    let text = delete_and_release(&env).await;
    assert!(
        text.contains("cleaning ended"),
        "the deploy agent cleaned this host:\n{}",
        tail(&text, 8000)
    );
    let size = std::fs::metadata(&env.disk).expect("disk").len();
    let mut wiped = vec![0, size - (1 << 20)];
    wiped.extend(&starts);
    for offset in wiped {
        assert!(
            zeroed(&env.disk, offset, 1 << 20),
            "the MiB at {offset} of the released disk still has data"
        );
    }
    assert!(
        partition_starts(&env.disk).is_empty(),
        "a partition table survived the cleaning"
    );

    // A second tenant on the same host, from the qcow2 image: its OS must not find the first
    // one's marker (its commands stop at the test, and nothing calls back, if it does).
    add_tenant(
        client,
        &ns.name,
        "node2",
        vec![
            format!("test ! -e {MARKER}"),
            format!("echo '{SECOND_RAN}' > /dev/console"),
        ]
        .into(),
        TenantOs::Qcow2,
        900,
    )
    .await;
    let second = support::eventually_or("the second tenant provisioned", 1500, || async {
        machines
            .get("node2")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let text = console(host);
    assert!(
        second.is_some(),
        "the second tenant was not provisioned:\n{}",
        tail(&text, 8000)
    );
    assert_eq!(text.matches(SECOND_RAN).count(), 1, "{}", tail(&text, 8000));
}

/// Deletes the first tenant's MetalMachine and waits until it is gone and its host is released
/// and Available; returns the console so far.
async fn delete_and_release(env: &Env) -> String {
    env.machines
        .delete("node", &DeleteParams::default())
        .await
        .expect("delete the MetalMachine");
    let hosts: Api<MetalHost> = Api::namespaced(env.ns.client.clone(), &env.ns.name);
    let released = support::eventually_or("the host cleaned and Available", 900, || async {
        let h = hosts.get("host-0").await.ok()?;
        let available = h.spec.consumer_ref.is_none()
            && h.status.as_ref().and_then(|s| s.state) == Some(HostState::Available);
        let gone = env.machines.get_opt("node").await.ok()?.is_none();
        (available && gone).then_some(())
    })
    .await;
    let text = console(&env.host);
    if released.is_none() {
        let mm = env.machines.get_opt("node").await.ok().flatten();
        let h = hosts.get("host-0").await.ok();
        panic!(
            "not released: {:#?}\n{:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            h.and_then(|h| h.status),
            tail(&text, 8000)
        );
    }
    text
}

/// Where the disk's GPT partitions start, in bytes (none when no table is readable).
fn partition_starts(disk: &Path) -> Vec<u64> {
    let Ok(table) = gpt::GptConfig::new().writable(false).open(disk) else {
        return Vec::new();
    };
    table
        .partitions()
        .values()
        .filter(|p| p.is_used())
        .map(|p| p.first_lba * 512)
        .collect()
}

/// Whether `len` bytes of `disk` from `offset` are all zero.
fn zeroed(disk: &Path, offset: u64, len: usize) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut buf = vec![0u8; len];
    std::fs::File::open(disk)
        .and_then(|mut f| {
            f.seek(SeekFrom::Start(offset))?;
            f.read_exact(&mut buf)
        })
        .is_ok_and(|()| buf.iter().all(|b| *b == 0))
}

/// A bootstrap command that fails under the real cloud-init on the installed OS: no sentinel, no
/// callback; the boot timeout, counted from the restart into the disk, ends the attempt, and
/// with no retries left the machine fails with `BootTimeout`, never provisioned.
#[tokio::test]
async fn a_failing_bootstrap_command_ends_in_the_boot_timeout() {
    let env = setup(
        "image-e2e-fail",
        "52:54:00:6d:62:11",
        vec![
            "echo 'metalboot-e2e: step 1' > /dev/console".into(),
            "false".into(),
            format!("echo '{RAN}' > /dev/console"),
        ],
        240,
        First::Image {
            checksum_override: None,
        },
    )
    .await;
    let (failed, text) = until_failed(&env).await;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        status.failure_reason.as_deref(),
        Some("BootTimeout"),
        "{status:?}"
    );
    assert!(failed.spec.provider_id.is_none(), "provisioned after all");
    assert!(
        text.contains("metalboot::agent") && text.contains("metalboot-e2e: step 1"),
        "the image was written and the installed OS ran the first command:\n{}",
        tail(&text, 8000)
    );
    assert!(!text.contains(RAN), "a command ran after the failed one");
    assert!(
        !text.contains("reporting to the boot service"),
        "vendor-data reported success without the sentinel"
    );
}

/// A wrong checksum through the whole manager: the real agent streams the image, finds the digest
/// differs, wipes what it wrote and reports; with no retries the machine fails with
/// `ImageChecksumMismatch`, never provisioned, and the host never boots its disk. Deleting the
/// machine cleans the host, which is Available again.
#[tokio::test]
async fn a_wrong_checksum_fails_the_machine_and_the_host_is_cleaned_on_release() {
    let env = setup(
        "image-e2e-sum",
        "52:54:00:6d:62:12",
        vec![format!("echo '{RAN}' > /dev/console")],
        900,
        First::Image {
            checksum_override: Some(&"0".repeat(64)),
        },
    )
    .await;
    let (failed, text) = until_failed(&env).await;
    let status = failed.status.clone().unwrap_or_default();
    assert_eq!(
        status.failure_reason.as_deref(),
        Some("ImageChecksumMismatch"),
        "{status:?}"
    );
    assert!(failed.spec.provider_id.is_none(), "provisioned after all");
    assert!(!text.contains(RAN), "the installed OS ran the user-data");
    assert!(
        partition_starts(&env.disk).is_empty(),
        "the failed write was not wiped"
    );

    let text = delete_and_release(&env).await;
    assert!(
        text.contains("cleaning ended"),
        "the host was cleaned before release:\n{}",
        tail(&text, 8000)
    );
    assert!(zeroed(&env.disk, 0, 1 << 20));
}

/// What the live system's user-data prints on each boot, with the hostname and providerID the
/// node came up with.
const LIVE_RAN: &str = "metalboot-e2e-live: booted";

/// The `LIVE_RAN` lines of the console: one per boot of the live system.
fn live_boots(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.find(LIVE_RAN).map(|at| l[at..].trim().to_string()))
        .collect()
}

async fn boot_record(env: &Env) -> Option<metalboot::boot::tokens::BootRecord> {
    let secret = env
        .secrets
        .get_opt(&metalboot::boot::tokens::boot_secret_name("node"))
        .await
        .ok()??;
    metalboot::boot::tokens::parse_secret(&secret).ok()
}

/// Live mode, diskless: the real Debian system netboots through live-boot and real cloud-init
/// calls back; the boot Secret stays, armed with a fresh token for the next boot. A reset through
/// the BMC network-boots the host again: the armed token serves the same identity, the OS comes
/// back as the same node (hostname and providerID, printed by the user-data on each boot) and
/// calls back; the machine never leaves Ready; the Secret is re-armed with yet another token and
/// the token of the first boot is refused. Deleting the machine powers the host off and releases
/// it without cleaning (nothing was written).
#[tokio::test]
async fn a_live_mode_host_reboots_into_its_os_as_the_same_node() {
    let env = setup(
        "live-e2e",
        "52:54:00:6d:62:13",
        vec![format!(
            "echo \"{LIVE_RAN} as $(hostname) with $(grep -o 'metalboot://[^\" ]*' /run/cloud-init/instance-data.json | head -n1)\" > /dev/console"
        )],
        900,
        First::Live,
    )
    .await;
    let Env {
        ns,
        host,
        bmc_address,
        machines,
        ..
    } = &env;
    let provisioned = support::eventually_or("the live MetalMachine provisioned", 1200, || async {
        machines
            .get("node")
            .await
            .ok()
            .filter(|m| m.spec.provider_id.is_some())
    })
    .await;
    let Some(provisioned) = provisioned else {
        let mm = machines.get("node").await.ok();
        panic!(
            "not provisioned: {:#?}\nconsole:\n{}",
            mm.and_then(|m| m.status),
            tail(&console(host), 8000)
        );
    };
    let provider_id = provisioned.spec.provider_id.clone().unwrap_or_default();
    let text = console(host);
    assert!(
        text.contains("live-boot") || text.contains("/run/live"),
        "the host booted through live-boot:\n{}",
        tail(&text, 8000)
    );
    let first_boot = live_boots(&text);
    assert_eq!(
        first_boot,
        vec![format!("{LIVE_RAN} as host-0 with {provider_id}")],
        "{}",
        tail(&text, 8000)
    );
    // The provisioning token dies; a token for the next boot takes its place.
    let armed = support::eventually("the next boot armed", 60, || async {
        boot_record(&env).await.filter(|r| r.reboot == Some(1))
    })
    .await;
    let ready_since = |mm: &MetalMachine| {
        mm.status.as_ref().and_then(|s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == "Ready" && c.status == "True")
                .map(|c| c.last_transition_time.clone())
        })
    };
    let ready_at = support::eventually("the MetalMachine Ready", 60, || async {
        machines
            .get("node")
            .await
            .ok()
            .as_ref()
            .and_then(ready_since)
    })
    .await;

    // A reset through the BMC: the host network-boots its OS again, with the armed token.
    let driver = RedfishBmc::new(
        bmc_address,
        Credentials::new(USER, PASSWORD),
        RedfishOptions::default(),
    )
    .expect("driver");
    driver.power(PowerAction::Cycle).await.expect("power cycle");
    let rearmed = support::eventually_or("the reboot called back and re-armed", 900, || async {
        boot_record(&env).await.filter(|r| r.reboot == Some(2))
    })
    .await;
    let text = console(host);
    let Some(rearmed) = rearmed else {
        panic!(
            "the rebooted host did not call back: {:?}\nconsole:\n{}",
            boot_record(&env).await.map(|r| (r.reboot, r.callback)),
            tail(&text, 8000)
        );
    };
    assert_eq!(
        live_boots(&text),
        vec![
            format!("{LIVE_RAN} as host-0 with {provider_id}"),
            format!("{LIVE_RAN} as host-0 with {provider_id}"),
        ],
        "the second boot is the same node:\n{}",
        tail(&text, 8000)
    );
    assert_ne!(rearmed.token, armed.token, "each boot has its own token");
    assert_eq!(
        (rearmed.attempt, &rearmed.instance_id),
        (armed.attempt, &armed.instance_id),
        "a reboot is not a new attempt"
    );
    let after = machines.get("node").await.expect("MetalMachine");
    assert_eq!(
        after.spec.provider_id.as_deref(),
        Some(provider_id.as_str())
    );
    assert_eq!(
        ready_since(&after),
        Some(ready_at),
        "the machine left Ready during the reboot"
    );
    let events = Api::<k8s_openapi::api::core::v1::Event>::namespaced(ns.client.clone(), &ns.name);
    let rebooted = support::eventually("the HostRebooted Event", 30, || async {
        events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| e.reason.as_deref() == Some("HostRebooted"))
    })
    .await;
    assert!(
        rebooted
            .message
            .as_deref()
            .is_some_and(|m| m.contains("as host-0") && m.contains("boot 1")),
        "{rebooted:?}"
    );
    // The first boot's token is spent: nothing is served for it any more.
    let stale = reqwest::get(format!(
        "http://127.0.0.1:{}/nocloud/{}/user-data",
        env.boot_port,
        armed.token.expose()
    ))
    .await
    .expect("boot service");
    assert_eq!(stale.status(), reqwest::StatusCode::NOT_FOUND);

    // Release: powered off, Available, nothing to clean.
    let text = delete_and_release(&env).await;
    assert!(
        !text.contains("metalboot::agent"),
        "a live host was netbooted into the deploy agent"
    );
}

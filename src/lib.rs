//! metalboot: a Cluster API bare-metal infrastructure provider with its own boot-config service.
//!
//! Layout follows the architecture: `api` (CRD types), `controllers` (reconcilers: pure decisions,
//! thin I/O), `bmc` (Redfish), `boot` (HTTP/TFTP/iPXE/cloud-init), `lab` (QEMU hosts behind
//! virtual BMCs), `controlplane` (the local kube-apiserver used by tests and the lab).

// Input from outside (CRs, Secrets, BMC replies, DHCP/TFTP/HTTP requests) must never panic the
// manager: outside tests, `unwrap`/`expect` do not compile under clippy (`.ci/run`).
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod agent;
pub mod api;
pub mod bmc;
pub mod boot;
pub mod cli;
pub mod controllers;
pub mod controlplane;
pub mod kubeconn;
pub mod lab;
pub mod leader;
pub mod manager;
pub mod metrics;
pub mod pki;
pub mod stable_hash;
pub mod stores;
pub mod telemetry;

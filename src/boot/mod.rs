//! The boot service: what a racked host talks to from its first DHCP answer until its bootstrap
//! script reports success — TFTP for iPXE binaries, HTTP for iPXE scripts, kernels, cloud-init
//! NoCloud documents and the success callback. It reads the controllers' reflector stores and
//! never decides anything about a machine's lifecycle itself.

pub mod artifacts;
pub mod budget;
pub mod dhcp;
pub mod dhcpd;
pub mod front;
pub mod http;
pub mod ipxe;
pub mod leases;
pub mod netns;
pub mod nocloud;
pub mod serve;
pub mod tftp;
pub mod tokens;

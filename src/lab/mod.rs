//! The local lab: QEMU hosts behind a virtual Redfish BMC, the lab OS image, and `lab up`.

pub mod fleet;
pub mod ipmi;
pub mod net;
pub mod objects;
pub mod qemu;
pub mod relay;
pub mod up;
pub mod upstream;
pub mod vbmc;

//! The deploy agent (`metalboot agent`): the same crate, built static, running in the deploy
//! ramdisk metalboot netboots before it writes a disk. It inspects the host, writes the OS image
//! to the disk the root-device hints choose, leaves the NoCloud seed beside it, and wipes disks
//! on release. Each part is a plain function over a reader, a file or a filesystem root, so it is
//! tested without a host; the HTTP conversation with the boot service is `run`.

pub mod hints;
pub mod image;
pub mod inspect;
pub mod protocol;
pub mod qcow2;
pub mod run;
pub mod seed;
pub mod wipe;

//! Where the boot service's sockets live. In a cluster the manager runs on the host network and
//! binds where it is. The lab (and the network-boot tests) put the provisioning network in a
//! network namespace of their own, a bridge with QEMU hosts and a site DHCP server on it, while
//! the manager stays on the host's loopback to reach the apiserver. So the boot service opens its
//! sockets (HTTP, TFTP, DHCP) inside that namespace: a socket keeps the namespace it was created
//! in, whichever thread uses it later. Each socket is created on a short-lived thread that enters
//! the namespace first, so no runtime thread ever changes namespace.

use std::fs::File;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// The network namespace sockets are created in: the process's own (the default) or a named one.
#[derive(Clone, Debug, Default)]
pub struct NetNamespace {
    inner: Option<Arc<(PathBuf, File)>>,
}

impl NetNamespace {
    /// The process's own namespace.
    pub fn current() -> Self {
        Self::default()
    }

    /// A namespace by path (`/var/run/netns/<name>`) or by the name `ip netns add` gave it.
    pub fn open(name_or_path: &str) -> io::Result<Self> {
        let path = if name_or_path.contains('/') {
            PathBuf::from(name_or_path)
        } else {
            Path::new("/var/run/netns").join(name_or_path)
        };
        let file = File::open(&path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("network namespace {}: {e}", path.display()),
            )
        })?;
        Ok(Self {
            inner: Some(Arc::new((path, file))),
        })
    }

    pub fn path(&self) -> Option<&Path> {
        self.inner.as_ref().map(|i| i.0.as_path())
    }

    /// Runs `create` with this namespace as the network namespace of the calling code.
    pub fn enter<T: Send>(&self, create: impl FnOnce() -> io::Result<T> + Send) -> io::Result<T> {
        let Some(inner) = &self.inner else {
            return create();
        };
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    nix::sched::setns(&inner.1, nix::sched::CloneFlags::CLONE_NEWNET).map_err(
                        |e| {
                            io::Error::other(format!(
                                "entering network namespace {}: {e}",
                                inner.0.display()
                            ))
                        },
                    )?;
                    create()
                })
                .join()
                .map_err(|_| io::Error::other("the namespace thread panicked"))?
        })
    }

    /// A TCP listener on `addr` in this namespace, ready for tokio.
    pub fn tcp_listener(&self, addr: SocketAddr) -> io::Result<tokio::net::TcpListener> {
        let listener = self.enter(|| {
            let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
            socket.set_reuse_address(true)?;
            socket.bind(&SockAddr::from(addr))?;
            socket.listen(1024)?;
            socket.set_nonblocking(true)?;
            Ok(std::net::TcpListener::from(socket))
        })?;
        tokio::net::TcpListener::from_std(listener)
    }

    /// A UDP socket on `addr` in this namespace, ready for tokio. `device` binds it to one
    /// interface (SO_BINDTODEVICE), so broadcasts go out there and only its packets come in.
    pub fn udp_socket(
        &self,
        addr: SocketAddr,
        device: Option<&str>,
        broadcast: bool,
    ) -> io::Result<tokio::net::UdpSocket> {
        let socket = self.enter(|| {
            let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
            if broadcast {
                socket.set_broadcast(true)?;
                socket.set_reuse_address(true)?;
            }
            if let Some(device) = device {
                socket.bind_device(Some(device.as_bytes()))?;
            }
            socket.bind(&SockAddr::from(addr))?;
            socket.set_nonblocking(true)?;
            Ok(std::net::UdpSocket::from(socket))
        })?;
        tokio::net::UdpSocket::from_std(socket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_current_namespace_runs_in_place() {
        let ns = NetNamespace::current();
        assert!(ns.path().is_none());
        assert_eq!(
            ns.enter(|| Ok(std::thread::current().id())).unwrap(),
            std::thread::current().id()
        );
    }

    #[test]
    fn a_missing_namespace_is_a_clear_error() {
        let err = NetNamespace::open("metalboot-no-such-namespace").unwrap_err();
        assert!(
            err.to_string()
                .contains("/var/run/netns/metalboot-no-such-namespace"),
            "{err}"
        );
    }
}

//! Address leases for full-DHCP mode (an isolated provisioning network where metalboot is the
//! only DHCP server). Pure bookkeeping, table-tested; `dhcpd` owns the sockets.
//!
//! Rules: a MetalHost's reservation (`spec.bootIPAddress`) always goes to its boot MAC and never
//! to anyone else; a client keeps its address while its lease lives and gets it back after it
//! expired if nobody took it; a new client gets the lowest address never leased, then the one
//! whose lease expired longest ago. Every lease is written to the lease file (atomically) before
//! the ACK leaves, so a restarted manager never hands out an address a live client holds. An
//! offer holds its address for a short time, so two DISCOVERs never get the same one.

use std::collections::{BTreeMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnetwork::Ipv4Network;
use serde::{Deserialize, Serialize};

/// The address pool and what every lease carries.
#[derive(Clone, Debug)]
pub struct Pool {
    pub network: Ipv4Network,
    pub first: Ipv4Addr,
    pub last: Ipv4Addr,
    /// Addresses never handed out (metalboot's own, the router's).
    pub excluded: Vec<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
    pub lease_time: Duration,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    #[error("the pool {first}–{last} is not inside {network}")]
    OutsideNetwork {
        first: Ipv4Addr,
        last: Ipv4Addr,
        network: Ipv4Network,
    },
    #[error("the pool {0} is not `<first>-<last>`")]
    Unreadable(String),
}

impl Pool {
    /// `network` with `range` (`10.0.0.50-10.0.0.99`) or, by default, every address of the
    /// network from the tenth on (the first ones are usually routers and servers).
    pub fn new(
        network: Ipv4Network,
        range: Option<&str>,
        excluded: Vec<Ipv4Addr>,
        router: Option<Ipv4Addr>,
        lease_time: Duration,
    ) -> Result<Self, PoolError> {
        let (first, last) = match range {
            Some(range) => {
                let (a, b) = range
                    .split_once('-')
                    .ok_or_else(|| PoolError::Unreadable(range.into()))?;
                let parse = |s: &str| {
                    s.trim()
                        .parse::<Ipv4Addr>()
                        .map_err(|_| PoolError::Unreadable(range.into()))
                };
                (parse(a)?, parse(b)?)
            }
            None => {
                let base = u32::from(network.network());
                let top = u32::from(network.broadcast()).saturating_sub(1);
                (Ipv4Addr::from((base + 10).min(top)), Ipv4Addr::from(top))
            }
        };
        if !network.contains(first) || !network.contains(last) || first > last {
            return Err(PoolError::OutsideNetwork {
                first,
                last,
                network,
            });
        }
        let mut excluded = excluded;
        excluded.extend(router);
        excluded.push(network.network());
        excluded.push(network.broadcast());
        Ok(Self {
            network,
            first,
            last,
            excluded,
            router,
            lease_time,
        })
    }

    fn addresses(&self) -> impl Iterator<Item = Ipv4Addr> + '_ {
        (u32::from(self.first)..=u32::from(self.last)).map(Ipv4Addr::from)
    }

    fn usable(&self, ip: Ipv4Addr) -> bool {
        ip >= self.first && ip <= self.last && !self.excluded.contains(&ip)
    }
}

/// One lease as the lease file keeps it (seconds since the Unix epoch).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub mac: String,
    pub ip: Ipv4Addr,
    pub expires: u64,
    /// An offer not yet requested: it holds the address briefly, and is never written.
    #[serde(default, skip)]
    pub offered: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("lease file {path}: {message}")]
    File { path: PathBuf, message: String },
}

/// Why a REQUEST is refused (DHCPNAK).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// The address is outside the pool, or someone else's.
    NotYours(Ipv4Addr),
    /// The lease could not be written: not acknowledged, so never given without a record.
    NotRecorded(String),
}

/// How long an offer holds its address.
const OFFER_HOLD: u64 = 30;

/// Offers held at once (and never more than half the pool). DISCOVERs are unauthenticated: a
/// flood of made-up MACs would otherwise hold the whole pool for `OFFER_HOLD` seconds (DHCP
/// starvation). Past this, offers are made without holding their address; the REQUEST then
/// decides, and a clash gets a NAK and a retry.
const MAX_HELD_OFFERS: usize = 64;

pub struct Leases {
    pool: Pool,
    /// By address: at most one client per address.
    by_ip: BTreeMap<Ipv4Addr, Lease>,
    /// Boot MAC → its MetalHost's reserved address.
    reservations: BTreeMap<String, Ipv4Addr>,
    file: Option<PathBuf>,
}

impl Leases {
    /// The table, with the leases `file` recorded (None: in memory only, for tests).
    pub fn load(pool: Pool, file: Option<&Path>) -> Result<Self, LeaseError> {
        let mut leases = Self {
            pool,
            by_ip: BTreeMap::new(),
            reservations: BTreeMap::new(),
            file: file.map(Path::to_path_buf),
        };
        let Some(path) = file else {
            return Ok(leases);
        };
        let err = |message: String| LeaseError::File {
            path: path.to_path_buf(),
            message,
        };
        match std::fs::read(path) {
            Ok(bytes) => {
                // A lease file that cannot be read stops the service: starting empty could hand
                // a live client's address to another.
                let recorded: Vec<Lease> =
                    serde_json::from_slice(&bytes).map_err(|e| err(e.to_string()))?;
                for lease in recorded {
                    leases.by_ip.insert(lease.ip, lease);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e.to_string())),
        }
        Ok(leases)
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Replaces the reservations (boot MAC → address) from the MetalHosts.
    pub fn set_reservations(&mut self, reservations: BTreeMap<String, Ipv4Addr>) {
        self.reservations = reservations;
    }

    fn holder(&self, ip: Ipv4Addr, now: u64) -> Option<&str> {
        if let Some((mac, _)) = self.reservations.iter().find(|(_, r)| **r == ip) {
            return Some(mac);
        }
        self.by_ip
            .get(&ip)
            .filter(|l| l.expires > now)
            .map(|l| l.mac.as_str())
    }

    fn free_for(&self, ip: Ipv4Addr, mac: &str, now: u64) -> bool {
        let reserved_here = self.reservations.get(mac) == Some(&ip);
        (self.pool.usable(ip) || (reserved_here && self.pool.network.contains(ip)))
            && self.holder(ip, now).is_none_or(|h| h == mac)
    }

    /// The address to offer `mac`: its reservation, its lease (live or expired but untaken),
    /// the address it asks for if free, a never-leased one, the longest-expired one.
    pub fn offer(&mut self, mac: &str, requested: Option<Ipv4Addr>, now: u64) -> Option<Ipv4Addr> {
        let ip = self.choose(mac, requested, now)?;
        let held = self
            .by_ip
            .values()
            .filter(|l| l.offered && l.expires > now)
            .count();
        let pool_size = (u32::from(self.pool.last) - u32::from(self.pool.first) + 1) as usize;
        if held < MAX_HELD_OFFERS.min(pool_size / 2)
            && self
                .by_ip
                .get(&ip)
                .is_none_or(|l| l.mac != mac || l.offered || l.expires <= now)
        {
            self.by_ip.insert(
                ip,
                Lease {
                    mac: mac.to_string(),
                    ip,
                    expires: now + OFFER_HOLD,
                    offered: true,
                },
            );
        }
        Some(ip)
    }

    fn choose(&self, mac: &str, requested: Option<Ipv4Addr>, now: u64) -> Option<Ipv4Addr> {
        if let Some(&reserved) = self.reservations.get(mac) {
            return self.free_for(reserved, mac, now).then_some(reserved);
        }
        let previous = self
            .by_ip
            .values()
            .filter(|l| l.mac == mac)
            .max_by_key(|l| l.expires)
            .map(|l| l.ip);
        for candidate in [previous, requested].into_iter().flatten() {
            if self.free_for(candidate, mac, now) {
                return Some(candidate);
            }
        }
        let reserved: HashSet<Ipv4Addr> = self.reservations.values().copied().collect();
        let never = self.pool.addresses().find(|ip| {
            !self.by_ip.contains_key(ip) && !reserved.contains(ip) && self.pool.usable(*ip)
        });
        never.or_else(|| {
            self.by_ip
                .values()
                .filter(|l| l.expires <= now && self.pool.usable(l.ip) && !reserved.contains(&l.ip))
                .min_by_key(|l| l.expires)
                .map(|l| l.ip)
        })
    }

    /// Commits a REQUEST for `ip` by `mac`: recorded in the file before it is acknowledged.
    pub fn request(&mut self, mac: &str, ip: Ipv4Addr, now: u64) -> Result<Lease, Refused> {
        if !self.free_for(ip, mac, now) {
            return Err(Refused::NotYours(ip));
        }
        if let Some(&reserved) = self.reservations.get(mac)
            && reserved != ip
        {
            return Err(Refused::NotYours(ip));
        }
        let lease = Lease {
            mac: mac.to_string(),
            ip,
            expires: now + self.pool.lease_time.as_secs(),
            offered: false,
        };
        // This client's other addresses are released: one address per client.
        let stale: Vec<Ipv4Addr> = self
            .by_ip
            .values()
            .filter(|l| l.mac == mac && l.ip != ip)
            .map(|l| l.ip)
            .collect();
        let before = self.by_ip.clone();
        for s in stale {
            self.by_ip.remove(&s);
        }
        self.by_ip.insert(ip, lease.clone());
        if let Err(e) = self.persist() {
            self.by_ip = before;
            return Err(Refused::NotRecorded(e));
        }
        Ok(lease)
    }

    /// A RELEASE (or a DECLINE with `declined`: the address is in use by something unknown and
    /// is kept away from everyone for a lease time).
    pub fn release(&mut self, mac: &str, ip: Ipv4Addr, declined: bool, now: u64) {
        if self.by_ip.get(&ip).is_some_and(|l| l.mac == mac) {
            if declined {
                self.by_ip.insert(
                    ip,
                    Lease {
                        mac: "declined".into(),
                        ip,
                        expires: now + self.pool.lease_time.as_secs(),
                        offered: false,
                    },
                );
            } else if let Some(lease) = self.by_ip.get_mut(&ip) {
                lease.expires = now;
            }
            let _ = self.persist();
        }
    }

    /// The live lease of `mac`, if any.
    pub fn lease_of(&self, mac: &str, now: u64) -> Option<&Lease> {
        self.by_ip
            .values()
            .find(|l| l.mac == mac && !l.offered && l.expires > now)
    }

    fn persist(&self) -> Result<(), String> {
        let Some(path) = &self.file else {
            return Ok(());
        };
        let recorded: Vec<&Lease> = self.by_ip.values().filter(|l| !l.offered).collect();
        let bytes = serde_json::to_vec_pretty(&recorded).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_000_000;

    fn pool(range: &str) -> Pool {
        Pool::new(
            "10.0.0.0/24".parse().unwrap(),
            Some(range),
            vec![Ipv4Addr::new(10, 0, 0, 2)],
            Some(Ipv4Addr::new(10, 0, 0, 1)),
            Duration::from_secs(3600),
        )
        .unwrap()
    }

    fn ip(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, 0, last)
    }

    #[test]
    fn pools_are_checked_and_default_past_the_first_addresses() {
        let net: Ipv4Network = "10.0.0.0/24".parse().unwrap();
        let default = Pool::new(net, None, vec![], None, Duration::from_secs(60)).unwrap();
        assert_eq!((default.first, default.last), (ip(10), ip(254)));
        assert!(matches!(
            Pool::new(net, Some("10.0.1.5-10.0.1.9"), vec![], None, Duration::ZERO),
            Err(PoolError::OutsideNetwork { .. })
        ));
        assert!(matches!(
            Pool::new(net, Some("10.0.0.5"), vec![], None, Duration::ZERO),
            Err(PoolError::Unreadable(_))
        ));
    }

    #[test]
    fn who_gets_which_address() {
        let mut l = Leases::load(pool("10.0.0.1-10.0.0.6"), None).unwrap();
        l.set_reservations(BTreeMap::from([("aa".to_string(), ip(5))]));
        // Router (.1) and metalboot (.2) are never offered; the first free one is .3.
        assert_eq!(l.offer("c1", None, NOW), Some(ip(3)), "lowest never-leased");
        assert_eq!(
            l.offer("c2", None, NOW),
            Some(ip(4)),
            "an offer holds its address"
        );
        assert_eq!(l.offer("aa", None, NOW), Some(ip(5)), "the reservation");
        assert_eq!(
            l.offer("c3", Some(ip(5)), NOW),
            Some(ip(6)),
            "a reservation is never someone else's"
        );
        assert_eq!(l.request("c3", ip(5), NOW), Err(Refused::NotYours(ip(5))));
        assert_eq!(
            l.request("aa", ip(3), NOW),
            Err(Refused::NotYours(ip(3))),
            "a reserved host takes only its address"
        );
        assert!(l.request("c1", ip(3), NOW).is_ok());
        assert_eq!(
            l.offer("c1", None, NOW + 10),
            Some(ip(3)),
            "a client keeps its address"
        );
        // Offers held are capped at half the pool (three here: c2's, aa's, and c1's before its
        // REQUEST), so c3's offer of .6 did not hold it: c4 is offered .6 too, and the first
        // REQUEST wins.
        assert_eq!(l.offer("c4", None, NOW + 10), Some(ip(6)));
        assert!(l.request("c4", ip(6), NOW + 10).is_ok());
        assert_eq!(
            l.request("c3", ip(6), NOW + 10),
            Err(Refused::NotYours(ip(6)))
        );
        assert_eq!(l.offer("c5", None, NOW + 10), None, "the pool is exhausted");
        // c2's offer lapsed: its address is free again for a newcomer.
        assert_eq!(l.offer("c5", None, NOW + OFFER_HOLD + 1), Some(ip(4)));
        // An expired lease comes back to its owner while nobody took it.
        assert_eq!(l.offer("c1", None, NOW + 7200), Some(ip(3)));
    }

    #[test]
    fn a_flood_of_made_up_macs_cannot_starve_the_pool() {
        let mut l = Leases::load(pool("10.0.0.3-10.0.0.102"), None).unwrap();
        l.set_reservations(BTreeMap::from([("host".to_string(), ip(200))]));
        for i in 0..1000 {
            l.offer(&format!("flood-{i}"), None, NOW);
        }
        let held = l.by_ip.values().filter(|x| x.offered).count();
        assert_eq!(held, 50, "offers held are bounded by half the pool");
        let got = l
            .offer("real", None, NOW)
            .expect("an address for a real client");
        assert!(l.request("real", got, NOW).is_ok(), "{got} is committed");
        assert_eq!(
            l.offer("host", None, NOW),
            Some(ip(200)),
            "reservations are untouched"
        );
        assert!(l.request("host", ip(200), NOW).is_ok());
    }

    #[test]
    fn a_restart_keeps_every_live_lease() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("leases.json");
        let mut before = Leases::load(pool("10.0.0.3-10.0.0.20"), Some(&file)).unwrap();
        let first = before.offer("c1", None, NOW).unwrap();
        before.request("c1", first, NOW).unwrap();
        let mut after = Leases::load(pool("10.0.0.3-10.0.0.20"), Some(&file)).unwrap();
        let second = after.offer("c2", None, NOW + 5).unwrap();
        assert_ne!(
            first, second,
            "a restarted service never gives a live lease twice"
        );
        assert_eq!(after.lease_of("c1", NOW + 5).map(|l| l.ip), Some(first));
        std::fs::write(&file, b"{not json").unwrap();
        assert!(
            Leases::load(pool("10.0.0.3-10.0.0.20"), Some(&file)).is_err(),
            "an unreadable file stops the service"
        );
    }

    #[test]
    fn an_unwritable_lease_is_not_acknowledged() {
        let mut l = Leases::load(
            pool("10.0.0.3-10.0.0.20"),
            Some(Path::new("/nonexistent/dir/leases.json")),
        )
        .unwrap();
        let offered = l.offer("c1", None, NOW).unwrap();
        assert!(matches!(
            l.request("c1", offered, NOW),
            Err(Refused::NotRecorded(_))
        ));
        assert!(l.lease_of("c1", NOW).is_none());
    }

    #[test]
    fn released_and_declined_addresses() {
        let mut l = Leases::load(pool("10.0.0.3-10.0.0.4"), None).unwrap();
        let a = l.offer("c1", None, NOW).unwrap();
        l.request("c1", a, NOW).unwrap();
        l.release("c1", a, true, NOW);
        assert_ne!(
            l.offer("c2", None, NOW),
            Some(a),
            "a declined address rests"
        );
        l.release("c2", ip(4), false, NOW);
    }
}

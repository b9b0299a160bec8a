//! Address leases for full-DHCP mode (an isolated provisioning network where metalboot is the
//! only DHCP server). Pure bookkeeping, table-tested; `dhcpd` owns the sockets.
//!
//! Rules: a MetalHost's reservation (`spec.bootIPAddress`) always goes to its boot MAC and never
//! to anyone else; a client keeps its address while its lease lives and gets it back after it
//! expired if nobody took it; a new client gets the lowest address never leased, then the one
//! whose lease expired longest ago. Every lease is written to the lease file before the ACK
//! leaves, so a restarted manager never hands out an address a live client holds. An offer holds
//! its address for a short time, so two DISCOVERs never get the same one.
//!
//! The lease file is a journal, as ISC dhcpd keeps its own: one JSON line per change, appended,
//! the last line of an address winning, rewritten whole (atomically) once it holds more than
//! twice the lines it needs. Rewriting every lease on every ACK cost a fleet of N hosts booting
//! at once O(N²) bytes written.

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

/// One lease as the lease file keeps it (seconds since the Unix epoch). A line with an empty
/// `mac` says the address has no lease any more.
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
    /// Lines in the lease file now: past twice the leases it must keep (plus some), it is
    /// rewritten with those only.
    journal_lines: usize,
    /// An append failed and may have left part of a line: the next write rewrites the file.
    torn: bool,
}

/// Lines a lease file may hold beyond twice its leases before it is rewritten.
const JOURNAL_SLACK: usize = 1024;

/// A lease as one line of the lease file.
fn lease_line(lease: &Lease) -> Result<Vec<u8>, String> {
    let mut line = serde_json::to_vec(lease).map_err(|e| e.to_string())?;
    line.push(b'\n');
    Ok(line)
}

/// What a lease file says: the leases by address, how many lines it has, and whether it must
/// be rewritten before anything is appended to it.
struct LeaseFile {
    by_ip: BTreeMap<Ipv4Addr, Lease>,
    lines: usize,
    rewrite: bool,
}

/// Reads a lease file: the last line of each address wins. A first line that opens a JSON array
/// is the whole-file format written before the journal. A last line cut short (the process died
/// while appending it) is dropped: that lease was never acknowledged. Either way the file is to
/// be rewritten, so that a line appended next never follows a torn one or an array.
fn read_lease_file(bytes: &[u8]) -> Result<LeaseFile, String> {
    let mut by_ip = BTreeMap::new();
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
        let recorded: Vec<Lease> = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
        let lines = recorded.len();
        for lease in recorded {
            by_ip.insert(lease.ip, lease);
        }
        return Ok(LeaseFile {
            by_ip,
            lines,
            rewrite: true,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| e.to_string())?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let complete = text.is_empty() || text.ends_with('\n');
    for (i, line) in lines.iter().enumerate() {
        let lease: Lease = match serde_json::from_str(line) {
            Ok(lease) => lease,
            // Cut short: the input ends inside a record (anything else is damage).
            Err(e) if e.is_eof() && i + 1 == lines.len() && !complete => break,
            Err(e) => return Err(format!("line {}: {e}", i + 1)),
        };
        match lease.mac.is_empty() {
            true => by_ip.remove(&lease.ip),
            false => by_ip.insert(lease.ip, lease),
        };
    }
    Ok(LeaseFile {
        by_ip,
        lines: lines.len(),
        rewrite: !complete,
    })
}

impl Leases {
    /// The table, with the leases `file` recorded (None: in memory only, for tests).
    pub fn load(pool: Pool, file: Option<&Path>) -> Result<Self, LeaseError> {
        let mut leases = Self {
            pool,
            by_ip: BTreeMap::new(),
            reservations: BTreeMap::new(),
            file: file.map(Path::to_path_buf),
            journal_lines: 0,
            torn: false,
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
                let read = read_lease_file(&bytes).map_err(err)?;
                leases.by_ip = read.by_ip;
                leases.journal_lines = read.lines;
                if read.rewrite {
                    leases.rewrite(path, leases.by_ip.clone()).map_err(err)?;
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
        // The lease first: a write cut short after it keeps an old address too many, never one
        // too few.
        let mut changes = vec![lease.clone()];
        changes.extend(stale.iter().map(|&ip| Lease {
            mac: String::new(),
            ip,
            expires: 0,
            offered: false,
        }));
        if let Err(e) = self.persist(&changes) {
            return Err(Refused::NotRecorded(e));
        }
        for s in stale {
            self.by_ip.remove(&s);
        }
        self.by_ip.insert(ip, lease.clone());
        Ok(lease)
    }

    /// A RELEASE (or a DECLINE with `declined`: the address is in use by something unknown and
    /// is kept away from everyone for a lease time). Only the client's own acknowledged lease
    /// counts (a client declines after its ACK, RFC 2131): a released offer just lapses, in
    /// memory, and an expired lease or a repeat writes nothing, so made-up MACs cannot make
    /// the service write.
    pub fn release(&mut self, mac: &str, ip: Ipv4Addr, declined: bool, now: u64) {
        let Some(held) = self.by_ip.get_mut(&ip).filter(|l| l.mac == mac) else {
            return;
        };
        if held.offered {
            held.expires = held.expires.min(now);
            return;
        }
        if held.expires <= now {
            return;
        }
        let lease = match declined {
            true => Lease {
                mac: "declined".into(),
                ip,
                expires: now + self.pool.lease_time.as_secs(),
                offered: false,
            },
            false => Lease {
                mac: mac.to_string(),
                ip,
                expires: now,
                offered: false,
            },
        };
        // Kept in memory even when the file refuses it: the address is only more careful to
        // give away, and a restart falls back to the recorded lease.
        let _ = self.persist(std::slice::from_ref(&lease));
        self.by_ip.insert(ip, lease);
    }

    /// The live lease of `mac`, if any.
    pub fn lease_of(&self, mac: &str, now: u64) -> Option<&Lease> {
        self.by_ip
            .values()
            .find(|l| l.mac == mac && !l.offered && l.expires > now)
    }

    /// Records `changes` (leases as they are to be; an empty `mac` removes one) before the
    /// table takes them: appended to the journal, or the whole file rewritten with the table as
    /// it will be once the journal has grown past twice its leases.
    fn persist(&mut self, changes: &[Lease]) -> Result<(), String> {
        use std::io::Write;
        let Some(path) = self.file.clone() else {
            return Ok(());
        };
        let recorded = self.by_ip.values().filter(|l| !l.offered).count() + changes.len();
        if self.torn || self.journal_lines + changes.len() > 2 * recorded + JOURNAL_SLACK {
            return self.rewrite(&path, self.with_changes(changes));
        }
        let mut bytes = Vec::new();
        for change in changes {
            bytes.extend(lease_line(change)?);
        }
        // Created only when it holds nothing yet: a journal deleted under the service is
        // written anew from the table, not restarted with this change alone.
        let opened = std::fs::OpenOptions::new()
            .create(self.journal_lines == 0)
            .append(true)
            .open(&path);
        let mut file = match opened {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return self.rewrite(&path, self.with_changes(changes));
            }
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        // On the disk before the ACK leaves: a power loss must not forget a lease.
        file.write_all(&bytes)
            .and_then(|()| file.sync_data())
            .map_err(|e| {
                self.torn = true;
                format!("{}: {e}", path.display())
            })?;
        self.journal_lines += changes.len();
        Ok(())
    }

    /// The table as it will be once it takes `changes` (an empty `mac` removes a lease).
    fn with_changes(&self, changes: &[Lease]) -> BTreeMap<Ipv4Addr, Lease> {
        let mut kept = self.by_ip.clone();
        for change in changes {
            match change.mac.is_empty() {
                true => kept.remove(&change.ip),
                false => kept.insert(change.ip, change.clone()),
            };
        }
        kept
    }

    /// Replaces the lease file with one line per lease of `kept` (atomically: a new file
    /// renamed over the old one).
    fn rewrite(&mut self, path: &Path, kept: BTreeMap<Ipv4Addr, Lease>) -> Result<(), String> {
        let mut bytes = Vec::new();
        let mut lines = 0;
        for lease in kept.values().filter(|l| !l.offered) {
            bytes.extend(lease_line(lease)?);
            lines += 1;
        }
        // The new file is on the disk before it replaces the old one, and the rename before
        // this returns: after a power loss the file is the old one or the new one, never empty.
        let tmp = path.with_extension("tmp");
        let written = std::fs::File::create(&tmp)
            .and_then(|mut file| {
                use std::io::Write;
                file.write_all(&bytes)?;
                file.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, path))
            .and_then(|()| match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => std::fs::File::open(dir)?.sync_all(),
                _ => Ok(()),
            });
        written.map_err(|e| format!("{}: {e}", path.display()))?;
        self.journal_lines = lines;
        self.torn = false;
        Ok(())
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

    /// The file is a journal: each ACK appends a line, not the whole table; a restart reads
    /// the last line of each address (a removed one stays removed, a line cut short by a crash
    /// is dropped); past twice the lines it needs the file is rewritten with the live table.
    /// A file in the whole-table format of before is read too.
    #[test]
    fn the_lease_file_is_a_journal_kept_short() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("leases.json");
        let wide = || pool("10.0.0.3-10.0.0.250");
        let mut l = Leases::load(wide(), Some(&file)).unwrap();
        for i in 0..100 {
            let mac = format!("c{i}");
            let got = l.offer(&mac, None, NOW).unwrap();
            l.request(&mac, got, NOW).unwrap();
        }
        let lines = |f: &Path| std::fs::read_to_string(f).unwrap().lines().count();
        assert_eq!(lines(&file), 100, "one line per ACK");
        // c0 moves to another address: its old one is removed, in the journal too.
        let old = l.lease_of("c0", NOW).unwrap().ip;
        l.request("c0", ip(250), NOW).unwrap();
        assert_eq!(lines(&file), 102);
        let back = Leases::load(wide(), Some(&file)).unwrap();
        assert_eq!(back.lease_of("c0", NOW).map(|l| l.ip), Some(ip(250)));
        assert!(!back.by_ip.contains_key(&old), "the removal was recorded");
        assert_eq!(back.by_ip.len(), 100);

        // A crash while appending: the torn last line is dropped, the rest read, and the file
        // rewritten, so the next line appended does not follow the torn one.
        let mut torn = std::fs::read(&file).unwrap();
        torn.extend(b"{\"mac\":\"c9");
        std::fs::write(&file, &torn).unwrap();
        let mut restarted = Leases::load(wide(), Some(&file)).unwrap();
        assert_eq!(restarted.by_ip.len(), 100);
        let got = restarted.offer("after", None, NOW).unwrap();
        restarted.request("after", got, NOW).unwrap();
        assert_eq!(Leases::load(wide(), Some(&file)).unwrap().by_ip.len(), 101);
        let good = std::fs::read(&file).unwrap();
        for (what, tail) in [
            ("a cut line ended by a newline", &b"{\"mac\":\"c9\n"[..]),
            (
                "a cut line before another",
                &b"{\"mac\":\"c9\n{\"mac\":\"c8"[..],
            ),
            ("a line that is not a lease", &b"{}\n"[..]),
        ] {
            let mut bad = good.clone();
            bad.extend(tail);
            std::fs::write(&file, &bad).unwrap();
            assert!(
                Leases::load(wide(), Some(&file)).is_err(),
                "{what} stops the service"
            );
        }
        std::fs::write(&file, &good).unwrap();

        // The journal deleted under a running service: the next ACK writes every lease again.
        let mut running = Leases::load(wide(), Some(&file)).unwrap();
        std::fs::remove_file(&file).unwrap();
        let got = running.offer("late", None, NOW).unwrap();
        running.request("late", got, NOW).unwrap();
        assert_eq!(Leases::load(wide(), Some(&file)).unwrap().by_ip.len(), 102);

        // Releases: an offer lapses in memory, a live lease is written once, a repeat is not.
        let before = lines(&file);
        let offered = running.offer("passing", None, NOW).unwrap();
        running.release("passing", offered, false, NOW);
        running.release("passing", offered, true, NOW);
        assert_eq!(lines(&file), before, "nothing of an offer is written");
        running.release("late", got, false, NOW);
        running.release("late", got, false, NOW);
        running.release("late", got, true, NOW);
        assert_eq!(lines(&file), before + 1, "one line for the release");

        // Renewals grow the journal until it is rewritten with one line per lease.
        let mut l = Leases::load(wide(), None).unwrap();
        l.file = Some(dir.path().join("renewed.json"));
        let renewed = dir.path().join("renewed.json");
        for i in 0..10 {
            let mac = format!("r{i}");
            let got = l.offer(&mac, None, NOW).unwrap();
            l.request(&mac, got, NOW).unwrap();
        }
        let mut longest = 0;
        for round in 1..=120u64 {
            for i in 0..10 {
                let mac = format!("r{i}");
                let got = l.lease_of(&mac, NOW).unwrap().ip;
                l.request(&mac, got, NOW + round).unwrap();
            }
            longest = longest.max(lines(&renewed));
        }
        assert!(longest <= 2 * 10 + JOURNAL_SLACK + 10, "{longest} lines");
        assert!(lines(&renewed) < 10 + 1200, "rewritten along the way");
        let back = Leases::load(wide(), Some(&renewed)).unwrap();
        assert_eq!(back.by_ip.len(), 10);
        assert!(back.by_ip.values().all(|l| l.expires == NOW + 120 + 3600));

        // The whole-table format written before the journal.
        let before = dir.path().join("before.json");
        std::fs::write(
            &before,
            br#"[{"mac":"old","ip":"10.0.0.9","expires":2000000}]"#,
        )
        .unwrap();
        let mut read = Leases::load(wide(), Some(&before)).unwrap();
        assert_eq!(read.lease_of("old", NOW).map(|l| l.ip), Some(ip(9)));
        let got = read.offer("new", None, NOW).unwrap();
        read.request("new", got, NOW).unwrap();
        let again = Leases::load(wide(), Some(&before)).unwrap();
        assert_eq!(again.lease_of("old", NOW).map(|l| l.ip), Some(ip(9)));
        assert_eq!(again.lease_of("new", NOW).map(|l| l.ip), Some(got));
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

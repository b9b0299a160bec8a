//! Slots per client address under a global cap: one mechanism for HTTP connections and TFTP
//! transfers, both open to anyone on the provisioning network. A slot is given back when its
//! guard drops, however the connection or transfer ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Which cap refused a slot (also the metric label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    Total,
    PerClient,
}

impl Full {
    pub fn label(self) -> &'static str {
        match self {
            Full::Total => "total",
            Full::PerClient => "per_client",
        }
    }
}

#[derive(Debug)]
pub struct ClientSlots {
    open: Mutex<HashMap<IpAddr, usize>>,
    max_total: usize,
    max_per_client: usize,
}

/// Held for as long as the connection or transfer lives.
#[derive(Debug)]
pub struct Slot(Arc<ClientSlots>, IpAddr);

impl ClientSlots {
    pub fn new(max_total: usize, max_per_client: usize) -> Arc<Self> {
        Arc::new(Self {
            open: Mutex::default(),
            max_total,
            max_per_client,
        })
    }

    pub fn take(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Full> {
        let mut open = self.open.lock().map_err(|_| Full::Total)?;
        if open.values().sum::<usize>() >= self.max_total {
            return Err(Full::Total);
        }
        let mine = open.entry(ip).or_default();
        if *mine >= self.max_per_client {
            return Err(Full::PerClient);
        }
        *mine += 1;
        Ok(Slot(self.clone(), ip))
    }

    /// Slots in use now.
    pub fn active(&self) -> usize {
        self.open.lock().map(|o| o.values().sum()).unwrap_or(0)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.0.open.lock()
            && let Some(n) = open.get_mut(&self.1)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_per_client_and_in_all_and_come_back() {
        let slots = ClientSlots::new(3, 2);
        let a: IpAddr = [10, 0, 0, 1].into();
        let b: IpAddr = [10, 0, 0, 2].into();
        let first = slots.take(a).expect("a 1");
        let _second = slots.take(a).expect("a 2");
        assert_eq!(slots.take(a).err(), Some(Full::PerClient));
        let _third = slots.take(b).expect("b 1");
        assert_eq!(slots.take(b).err(), Some(Full::Total));
        drop(first);
        assert_eq!(slots.active(), 2);
        assert!(slots.take(b).is_ok(), "a freed slot is usable again");
    }
}

//! Peers: the remote ports the host talks to, interned so that an entry names its peer
//! in 4 bytes.

use pvcm_wire::Gid;

use super::FastMap;

/// A remote port the host talks to: its GID and the CA GUID it last showed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Peer {
    pub(super) gid: Gid,
    pub(super) ca_guid: u64,
    pub(super) refs: u32,
}

/// Peers, interned so that an entry names its peer in 4 bytes.
#[derive(Debug, Default)]
pub(super) struct Peers {
    pub(super) slots: Vec<Peer>,
    pub(super) index: FastMap<Gid, u32>,
    pub(super) free: Vec<u32>,
    /// With the journal on: peers added or changed since it last took the changes.
    pub(super) dirty: Option<Vec<u32>>,
}

impl Peers {
    pub(super) fn acquire(&mut self, gid: Gid) -> u32 {
        if let Some(&i) = self.index.get(&gid) {
            self.slots[i as usize].refs += 1;
            return i;
        }
        let p = Peer {
            gid,
            ca_guid: 0,
            refs: 1,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.slots[i as usize] = p;
                i
            }
            None => {
                self.slots.push(p);
                (self.slots.len() - 1) as u32
            }
        };
        self.index.insert(gid, i);
        if let Some(d) = &mut self.dirty {
            d.push(i);
        }
        i
    }

    pub(super) fn release(&mut self, i: u32) {
        let Some(p) = self.slots.get_mut(i as usize) else {
            return;
        };
        p.refs = p.refs.saturating_sub(1);
        if p.refs == 0 {
            let gid = p.gid;
            self.index.remove(&gid);
            self.free.push(i);
        }
    }

    pub(super) fn get(&self, i: u32) -> Option<&Peer> {
        self.slots.get(i as usize)
    }

    pub(super) fn by_gid(&self, gid: &Gid) -> Option<&Peer> {
        self.index
            .get(gid)
            .and_then(|&i| self.slots.get(i as usize))
    }

    pub(super) fn set_ca_guid(&mut self, i: u32, guid: u64) {
        if let Some(p) = self.slots.get_mut(i as usize)
            && p.ca_guid != guid
        {
            p.ca_guid = guid;
            if let Some(d) = &mut self.dirty {
                d.push(i);
            }
        }
    }
}

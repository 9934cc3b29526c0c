//! The REQs received from the wire, by the ID their sender gave them.
//!
//! Until a peer has our REP it knows a connection only by its own comm ID and CA GUID.
//! Three things need the entry by that pair: a duplicate REQ (refresh it, don't raise a
//! second connection), a REJ(TIMEOUT) with Remote Comm ID 0 (the peer withdraws its
//! REQ), and the VM's first answer to the REQ (MRA, REP or a stateless REJ, which names
//! the peer's comm ID before the VM's own is known). Linux's core CM keeps the same
//! index (`cm.remote_id_table`, found by `cm_find_remote_id()`) and drops an entry from
//! it with `cm_remove_remote()`.
//!
//! An entry is in the index exactly when its [`flag::IN_REMOTE_IDS`] is set: the flag
//! travels with the entry into the journal and a migration's records, and restore and
//! import rebuild the index from it. [`RemoteIds`] keeps its map private, and the only
//! ways to change it are the [`Mux`] methods below, which change the flag with it.

use pvcm_wire::Gid;

use super::table::flag;
use super::{Clock, FastMap, Mux};

/// The ID a peer gave a connection: its CA GUID (from its REQ, and the ARI of a
/// REJ(TIMEOUT)) and its comm ID (the REQ's and the REJ's Local Comm ID). The Linux core
/// CM's `cm_find_remote_id` key; mlx4 used the comm ID alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteId {
    /// The remote CA GUID.
    pub ca_guid: u64,
    /// The remote comm ID.
    pub comm_id: u32,
}

/// The entries of REQs received from the wire, by their sender's [`RemoteId`] (see the
/// module documentation). Read it with [`RemoteIds::get`]; change it with
/// [`Mux::index_remote`] and [`Mux::unindex_remote`].
#[derive(Debug)]
pub(super) struct RemoteIds {
    map: FastMap<RemoteId, u32>,
}

impl RemoteIds {
    /// An empty index.
    pub(super) fn new() -> RemoteIds {
        RemoteIds {
            map: FastMap::with_hasher(Default::default()),
        }
    }

    /// The slot of the REQ the peer sent under `id`, if one is indexed.
    pub(super) fn get(&self, id: &RemoteId) -> Option<u32> {
        self.map.get(id).copied()
    }

    /// The map's capacity (for [`Mux::memory_bytes`]).
    pub(super) fn capacity(&self) -> usize {
        self.map.capacity()
    }

    /// Every (ID, slot), sorted: for comparing two muxes.
    pub(super) fn sorted(&self) -> Vec<(RemoteId, u32)> {
        let mut v: Vec<_> = self.map.iter().map(|(k, s)| (*k, *s)).collect();
        v.sort_unstable();
        v
    }
}

impl<C: Clock> Mux<C> {
    /// The [`RemoteId`] the entry in `slot` was received under.
    fn remote_id_of(&self, slot: u32) -> RemoteId {
        let e = &self.slab[slot as usize];
        RemoteId {
            ca_guid: e.remote_ca_guid,
            comm_id: e.remote_comm_id,
        }
    }

    /// Indexes the entry in `slot` under its remote CA GUID and comm ID (set them first).
    /// An entry the ID named before leaves the index: the peer reuses its ID, so the old
    /// REQ is no longer the one it means.
    pub(super) fn index_remote(&mut self, slot: u32) {
        let id = self.remote_id_of(slot);
        self.ent(slot).flags |= flag::IN_REMOTE_IDS;
        if let Some(old) = self.remote_ids.map.insert(id, slot)
            && old != slot
        {
            self.ent(old).flags &= !flag::IN_REMOTE_IDS;
        }
    }

    /// Takes the entry in `slot` out of the index if it is there (`cm_remove_remote()`);
    /// its flag is clear afterwards either way.
    pub(super) fn unindex_remote(&mut self, slot: u32) {
        if self.slab[slot as usize].has(flag::IN_REMOTE_IDS) {
            let id = self.remote_id_of(slot);
            if self.remote_ids.map.get(&id) == Some(&slot) {
                self.remote_ids.map.remove(&id);
            }
        }
        self.ent(slot).flags &= !flag::IN_REMOTE_IDS;
    }

    /// Restore: puts the entry in `slot` back in the index if its (restored) flag says it
    /// was there. The flag is the record's and is not changed.
    pub(super) fn reindex_remote(&mut self, slot: u32) {
        if self.slab[slot as usize].has(flag::IN_REMOTE_IDS) {
            let id = self.remote_id_of(slot);
            self.remote_ids.map.insert(id, slot);
        }
    }

    /// The slot of the REQ that the peer at `peer_gid` sent under comm ID `comm_id`, if
    /// the peer is known and one is indexed.
    pub(super) fn remote_by_peer(&self, peer_gid: &Gid, comm_id: u32) -> Option<u32> {
        let ca_guid = self.peers.by_gid(peer_gid)?.ca_guid;
        self.remote_ids.get(&RemoteId { ca_guid, comm_id })
    }
}

//! Moving a VM's CM state to another host (live migration, docs/migration.md).
//!
//! [`Mux::export_vm`] takes every entry a VM with an ID range ([`super::IdRange`]) owns,
//! live and quarantined, out of this mux and returns it as records; [`Mux::import_vm`]
//! on the other host checks them all, then attaches the VM with them. The `pv_cm_id`s
//! move unchanged (they come from the VM's own range, so no other VM anywhere holds
//! them) and so do the VM's TIDs (its TID space derives from the range). What is
//! host-local is translated: a peer index becomes the peer's GID and CA GUID, an
//! absolute deadline on this host's clock becomes the time left.
//!
//! Not moved: the VM's counters (they stay in the old host's totals) and its pending
//! ClassPortInfo Gets (the guest's CM retries a Get that goes unanswered).

use std::cmp::Reverse;
use std::time::Duration;

use pvcm_wire::Gid;

use super::persist::{REC_VM, Rd, decode_entry, decode_vm, encode_vm, entry_payload, records};
use super::table::{Entry, NO_PEER, State, flag};
use super::{
    AttachError, Clock, FastMap, IdRange, Mux, RemoteId, Time, Vm, VmConfig, VmId, put_record,
    put_record_parts,
};

/// The first record of an exported VM: the format version.
const REC_MIG_HEADER: u8 = 0x20;
/// One entry: its 68-byte record payload, the peer's GID and CA GUID, the time left.
const REC_MIG_ENTRY: u8 = 0x21;
/// Version of the export format.
const MIG_VERSION: u8 = 1;

/// Why a VM's state could not be exported or imported. A failed import changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    /// No such attached VM.
    #[error("no attached VM {0}")]
    NoSuchVm(u32),
    /// The VM has no ID range of its own, so its IDs cannot move.
    #[error("VM {0:?} has no ID range (give it id-range=BASE/LEN to make it migratable)")]
    NotMigratable(String),
    /// The mlx4 comparison policies keep no per-VM state worth moving.
    #[error("migration needs the default policy")]
    Legacy,
    /// The state is not an export of this format.
    #[error("bad VM state: {0}")]
    Corrupt(String),
    /// The VM cannot attach here.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// An ID or key of the VM is already in use here.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The table has no room for the VM's entries.
    #[error("table full: {need} entries to import, {free} free")]
    TableFull {
        /// Entries the VM brings.
        need: usize,
        /// Slots free here.
        free: usize,
    },
}

/// An entry as it travels.
struct Moved {
    e: Entry,
    peer: Option<(Gid, u64)>,
    left: u64,
}

impl<C: Clock> Mux<C> {
    /// Takes VM `vm`'s whole CM state out of this mux (nothing is sent on its behalf:
    /// its connections go on elsewhere) and returns it for [`Mux::import_vm`]. The VM
    /// is detached afterwards and its GID free here.
    pub fn export_vm(&mut self, vm: VmId) -> Result<Vec<u8>, MigrateError> {
        if !self.policy().transfers_state() {
            return Err(MigrateError::Legacy);
        }
        let v = self
            .vms
            .get(vm.0 as usize)
            .filter(|v| v.attached)
            .ok_or(MigrateError::NoSuchVm(vm.0))?;
        if v.cfg.id_range.is_none() {
            return Err(MigrateError::NotMigratable(v.cfg.name.clone()));
        }
        let now = self.clock.now().0;
        let mut out = Vec::new();
        put_record(&mut out, REC_MIG_HEADER, &[MIG_VERSION]);
        encode_vm(0, v, &mut out);
        let mut slots = Vec::new();
        for (s, e) in self.slab.iter().enumerate() {
            if e.vm != vm.0 || e.state == State::Free || e.has(flag::ORPHAN) {
                continue;
            }
            slots.push(s as u32);
            let (payload, n) = entry_payload(s as u32, e);
            let (gid, ca_guid) = self
                .peers
                .get(e.peer)
                .filter(|_| e.peer != NO_PEER)
                .map_or(([0u8; 16], 0), |p| (p.gid.0, p.ca_guid));
            let has_peer = [u8::from(e.peer != NO_PEER)];
            let left = if e.deadline == u64::MAX {
                u64::MAX
            } else {
                e.deadline.saturating_sub(now)
            };
            put_record_parts(
                &mut out,
                REC_MIG_ENTRY,
                &[
                    &payload[..n],
                    &has_peer,
                    &gid,
                    &ca_guid.to_le_bytes(),
                    &left.to_le_bytes(),
                ],
            );
        }
        for &s in &slots {
            let e = self.slab[s as usize];
            self.unindex(s, false);
            if e.state == State::Quarantined {
                self.quarantined -= 1;
            } else {
                self.live -= 1;
            }
            self.free_slot(s);
        }
        // Queue items of freed slots would release a later quarantine of the slot early.
        let slab = &self.slab;
        self.quarantine
            .retain(|(_, s)| slab[*s as usize].state == State::Quarantined);
        self.gets.retain(|_, g| g.vm != vm.0);
        let v = &mut self.vms[vm.0 as usize];
        v.attached = false;
        v.live = 0;
        v.quarantined = 0;
        v.sl_map = FastMap::default();
        for gid in v.cfg.gids() {
            self.gid_to_vm.remove(&gid);
        }
        self.fold_figures(vm.0);
        if let Some(c) = &mut self.changes {
            c.vms.push(vm.0);
        }
        Ok(out)
    }

    /// Attaches a VM with the state [`Mux::export_vm`] took on another host. Everything
    /// is checked before anything changes: the format, the GID and ID range (free here),
    /// every `pv_cm_id` (in the range, used nowhere here), the keys the entries are
    /// found by, and room in the table.
    pub fn import_vm(&mut self, state: &[u8]) -> Result<VmId, MigrateError> {
        if !self.policy().transfers_state() {
            return Err(MigrateError::Legacy);
        }
        let (cfg, next_id, moved) = decode_import(state)?;
        let range = cfg
            .id_range
            .ok_or_else(|| MigrateError::NotMigratable(cfg.name.clone()))?;
        self.check_attach(&cfg)?;
        self.check_moved(range, &moved)?;
        // Checked: attach and install.
        let id = u32::try_from(self.vms.len()).map_err(|_| AttachError::TooManyVms)?;
        let quota = cfg.quota.unwrap_or(self.cfg.default_quota);
        let mut v = Vm::new(cfg, quota, true, self.tids);
        v.next_id = next_id;
        for gid in v.cfg.gids() {
            self.gid_to_vm.insert(gid, id);
        }
        self.vms.push(v);
        if let Some(c) = &mut self.changes {
            c.vms.push(id);
        }
        self.install_moved(id, moved);
        self.reserve_for_entry(id);
        Ok(VmId(id))
    }

    /// Checks moved entries against this mux before any is installed: every ID in the
    /// VM's range and used once, every key free here, room in the table.
    fn check_moved(&self, range: IdRange, moved: &[Moved]) -> Result<(), MigrateError> {
        let bad = |why: &str| MigrateError::Corrupt(why.to_string());
        let mut ids = FastMap::default();
        let mut remote_keys = FastMap::default();
        for m in moved {
            let e = &m.e;
            if e.state == State::Free || e.has(flag::ORPHAN) {
                return Err(bad("a free or orphaned entry"));
            }
            if e.pv_cm_id != 0 {
                if !range.contains(e.pv_cm_id) {
                    return Err(bad(&format!(
                        "pv_cm_id {:#x} outside the VM's range {range}",
                        e.pv_cm_id
                    )));
                }
                if ids.insert(e.pv_cm_id, ()).is_some() {
                    return Err(bad(&format!("pv_cm_id {:#x} twice", e.pv_cm_id)));
                }
                if self.slot_named(e.pv_cm_id).is_some() {
                    return Err(MigrateError::Conflict(format!(
                        "pv_cm_id {:#x} is in use here",
                        e.pv_cm_id
                    )));
                }
            } else if e.state != State::ReqRcvd {
                return Err(bad("an entry without a pv_cm_id past REQ received"));
            }
            if e.has(flag::IN_REMOTE_IDS) {
                let k = RemoteId {
                    ca_guid: e.remote_ca_guid,
                    comm_id: e.remote_comm_id,
                };
                if self.remote_ids.get(&k).is_some() || remote_keys.insert(k, ()).is_some() {
                    return Err(MigrateError::Conflict(format!(
                        "peer CA GUID {:#x} comm ID {:#x} already routed here",
                        k.ca_guid, k.comm_id
                    )));
                }
            }
            if e.state == State::SidrReqRcvd && m.peer.is_none() {
                return Err(bad("a SIDR request without its peer"));
            }
        }
        let free = self.free.len() + ((1usize << self.slot_bits) - self.slab.len());
        if moved.len() > free {
            return Err(MigrateError::TableFull {
                need: moved.len(),
                free,
            });
        }
        // SIDR keys need the peer's index here: check them against peers already known.
        for m in moved.iter().filter(|m| m.e.state == State::SidrReqRcvd) {
            if let Some((gid, _)) = m.peer
                && let Some(&pi) = self.peers.index.get(&gid)
                && self.sidr_rcvd.contains_key(&(pi, m.e.remote_comm_id))
            {
                return Err(MigrateError::Conflict(format!(
                    "SIDR request {:#x} from {gid} already routed here",
                    m.e.remote_comm_id
                )));
            }
        }
        Ok(())
    }

    /// Installs the entries of VM `id`, checked by [`Mux::check_moved`]: their slots,
    /// peers, indexes, deadlines and the VM's figures.
    fn install_moved(&mut self, id: u32, mut moved: Vec<Moved>) {
        let now = self.clock.now().0;
        let mut quarantine = Vec::new();
        // Live entries first, so a comm ID a quarantined and a live entry share maps
        // to the live one (as `rebuild_indexes` decides).
        moved.sort_by_key(|m| m.e.state == State::Quarantined);
        for m in moved {
            let Some(slot) = self.alloc_slot() else {
                break; // counted above: cannot happen
            };
            let peer = m.peer.map_or(NO_PEER, |(gid, ca_guid)| {
                let i = self.peers.acquire(gid);
                if ca_guid != 0 {
                    self.peers.set_ca_guid(i, ca_guid);
                }
                i
            });
            // No deadline is longer here than this host would set itself: the quarantine
            // queue is released in order (every release is now + quarantine), and a
            // source's clock or a hostile state must not pin an entry for hours.
            let cap = if m.e.state == State::Quarantined {
                self.cfg.quarantine
            } else {
                self.cfg.max_wait.max(self.cfg.quarantine)
            };
            let deadline = if m.left == u64::MAX && m.e.state != State::Quarantined {
                u64::MAX
            } else {
                Time(now).after(Duration::from_nanos(m.left).min(cap)).0
            };
            let generation = self.slab[slot as usize].generation;
            let e = Entry {
                vm: id,
                peer,
                deadline,
                generation,
                flags: m.e.flags & !(flag::DIRTY | flag::IN_SL_MAP),
                ..m.e
            };
            *self.ent(slot) = e;
            if e.pv_cm_id != 0 {
                self.ranged.insert(e.pv_cm_id, slot);
            }
            if m.e.has(flag::IN_SL_MAP) && !self.vms[id as usize].sl_map.contains_key(&e.sl_cm_id) {
                self.index_sl(id, e.sl_cm_id, slot);
            }
            self.reindex_remote(slot);
            if e.state == State::SidrReqRcvd {
                self.sidr_rcvd.insert((peer, e.remote_comm_id), slot);
            }
            let v = &mut self.vms[id as usize];
            if e.state == State::Quarantined {
                // alloc_slot counted it live.
                self.live -= 1;
                self.quarantined += 1;
                v.quarantined += 1;
                quarantine.push((deadline, slot));
            } else {
                v.live += 1;
                if deadline != u64::MAX {
                    self.timers.push(Reverse((deadline, slot, generation)));
                }
            }
        }
        if !quarantine.is_empty() {
            let mut q: Vec<_> = self.quarantine.drain(..).chain(quarantine).collect();
            q.sort_unstable();
            self.quarantine = q.into();
        }
    }
}

/// A migration state's VM and entries, decoded; its format checked.
fn decode_import(state: &[u8]) -> Result<(VmConfig, u32, Vec<Moved>), MigrateError> {
    let bad = |why: &str| MigrateError::Corrupt(why.to_string());
    let mut version = None;
    let mut vm = None;
    let mut moved = Vec::new();
    for r in records(state) {
        let (kind, p) = r.map_err(|at| MigrateError::Corrupt(format!("truncated at {at}")))?;
        match kind {
            REC_MIG_HEADER => version = p.first().copied(),
            REC_VM => vm = Some(decode_vm(p).ok_or_else(|| bad("short VM record"))?),
            REC_MIG_ENTRY => moved.push(decode_moved(p).ok_or_else(|| bad("short entry"))?),
            _ => return Err(bad(&format!("unknown record kind {kind:#x}"))),
        }
    }
    if version != Some(MIG_VERSION) {
        return Err(bad(&format!(
            "format version {version:?}, want {MIG_VERSION}"
        )));
    }
    let (_, _, cfg, next_id) = vm.ok_or_else(|| bad("no VM record"))?;
    Ok((cfg, next_id, moved))
}

fn decode_moved(p: &[u8]) -> Option<Moved> {
    let (entry, rest) = p.split_at_checked(super::persist::SLOT_LEN)?;
    let (_, e) = decode_entry(entry)?;
    let mut r = Rd(rest);
    let has_peer = r.u8()? != 0;
    let gid = r.gid()?;
    let ca_guid = r.u64()?;
    let left = r.u64()?;
    Some(Moved {
        e,
        peer: has_peer.then_some((gid, ca_guid)),
        left,
    })
}

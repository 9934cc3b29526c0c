//! The PF multiplexer: pvcm's policy, pure and I/O-free.
//!
//! Every VM runs its own CM with its own comm-ID and TID space; all of them share the
//! host's CM port. The mux
//! - rewrites each VM's local comm ID (and the TIDs of transactions it starts) into
//!   host-unique values on the way to the wire, and back on the way in;
//! - routes wire MADs to the right VM: REQ by Primary Remote Port GID, SIDR_REQ and
//!   ClassPortInfo Get by destination GID, REJ(TIMEOUT) with Remote Comm ID 0 by
//!   [`RemoteId`] (sender CA GUID, sender comm ID), everything else by remote comm ID;
//! - keeps every entry exactly as long as the protocol can still use it: deadlines are
//!   derived from the CM timeouts the REQ and MRA carry, established connections never
//!   expire, closed ones pass through TimeWait, and freed IDs sit in quarantine;
//! - cleans up a detached VM's connections on its behalf (DREQ, REJ, DREP) so peers stop
//!   waiting, and checks what VMs send (source GID, QPN range, CA GUID, quota).
//!
//! I/O layers call [`Mux::from_guest`], [`Mux::from_wire`] and [`Mux::poll`], and send
//! what [`Mux::drain_outbox`] yields. Time comes from an injected [`Clock`].

//! The rooms: [`table`](self) (entries, IDs, timers, quarantine), `peers`, `remote` (the
//! REQs received, by their sender's ID), `guest` and `wire` (one handler per attribute
//! in each direction), `detach` (orphans), `legacy` (the mlx4 comparison policies),
//! `persist` (the journal, restore) and `migrate` (a VM's entries on the move).

mod clock;
mod config;
mod counters;
mod detach;
mod guest;
mod ids;
mod legacy;
mod migrate;
mod peers;
mod persist;
mod remote;
mod table;
mod wire;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use foldhash::fast::RandomState;
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as cmf};
use pvcm_wire::mad::{self, AttributeId};

pub use clock::{Clock, ManualClock, SystemClock, Time};
pub use config::{
    DEFAULT_QUOTA, ID_RANGE_BIT, IdRange, IdRangeError, MAX_GIDS, MuxConfig, Policy, UnknownPolicy,
    VmConfig,
};
pub use counters::{CmCounters, DropCounters, DropReason, Group};
pub use ids::{IdPermutation, TidKind, TidSpace, permute_bits};
pub use migrate::MigrateError;
pub use persist::{
    FIRST_FOREIGN_KIND, Inconsistency, RestoreError, Restored, StateDifference, put_record,
    put_record_parts, records,
};
pub use remote::RemoteId;
pub use table::State;

use peers::{Peer, Peers};
use table::{Entry, NO_VM, flag};

type FastMap<K, V> = HashMap<K, V, RandomState>;

/// Why [`Mux::attach_vm`] refused a VM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    /// Another attached VM has the same GID: give each VM its own address.
    #[error("GID {gid} is already used by VM {name:?}")]
    GidInUse {
        /// The GID.
        gid: Gid,
        /// The VM that has it.
        name: String,
    },
    /// VM IDs are never reused and all 2^32 are spent: restart the daemon.
    #[error("too many VMs")]
    TooManyVms,
    /// Another attached VM's `pv_cm_id` range shares IDs with this one's.
    #[error("ID range {range} overlaps VM {name:?}'s {other}")]
    IdRangeOverlap {
        /// This VM's range.
        range: IdRange,
        /// The other VM's range.
        other: IdRange,
        /// The other VM.
        name: String,
    },
    /// The range cannot hold the quota's IDs twice over (freed IDs wait in quarantine).
    #[error(
        "ID range {range} holds {size} IDs; a quota of {quota} connections needs at least \
         twice that (freed IDs wait in quarantine): use a shorter prefix or a smaller quota"
    )]
    IdRangeTooSmall {
        /// The range.
        range: IdRange,
        /// IDs in it.
        size: u64,
        /// The VM's quota.
        quota: u32,
    },
    /// The mlx4 comparison policies keep no per-VM ID ranges.
    #[error("ID ranges (migration) need the default policy")]
    IdRangeLegacy,
    /// The mux has no VM of that ID.
    #[error("no VM {0:?}")]
    NoSuchVm(VmId),
}

/// A buffer holding one MAD that the batch calls ([`Mux::from_wire_batch`],
/// [`Mux::from_guest_batch`]) rewrite in place: a bare `[u8; MAD_LEN]`, or an I/O layer's
/// own message, so that a batch goes through the mux without being copied.
pub trait MadSlot {
    /// The MAD.
    fn mad(&self) -> &[u8; mad::MAD_LEN];
    /// The MAD, to rewrite.
    fn mad_mut(&mut self) -> &mut [u8; mad::MAD_LEN];
}

impl<T: MadSlot + ?Sized> MadSlot for &mut T {
    fn mad(&self) -> &[u8; mad::MAD_LEN] {
        (**self).mad()
    }
    fn mad_mut(&mut self) -> &mut [u8; mad::MAD_LEN] {
        (**self).mad_mut()
    }
}

impl MadSlot for [u8; mad::MAD_LEN] {
    fn mad(&self) -> &[u8; mad::MAD_LEN] {
        self
    }
    fn mad_mut(&mut self) -> &mut [u8; mad::MAD_LEN] {
        self
    }
}

/// A VM attached to the mux. IDs are never reused, so a stale ID never names a new VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VmId(pub u32);

/// What to do with a MAD a VM sent ([`Mux::from_guest`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestVerdict {
    /// Send the (rewritten) MAD on the wire, to the destination the guest gave.
    ToWire,
    /// The buffer now holds the mux's own answer (REJ NO_RESOURCES); deliver it back to
    /// the VM that sent the MAD.
    Reply,
    /// Dropped and counted.
    Drop(DropReason),
}

/// What to do with a MAD from the wire ([`Mux::from_wire`]). The mux never forwards
/// wire to wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireVerdict {
    /// Deliver the (rewritten) MAD to this VM.
    ToVm(VmId),
    /// The buffer now holds the mux's own answer (REJ NO_RESOURCES, a stateless DREP);
    /// send it back to the MAD's source.
    Reply,
    /// Dropped and counted.
    Drop(DropReason),
}

/// A MAD the mux itself sends (on behalf of a detached VM, or a retry of one).
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// Source GID (the detached VM's).
    pub src: Gid,
    /// Destination GID (the peer's).
    pub dst: Gid,
    /// The MAD.
    pub mad: [u8; mad::MAD_LEN],
}

/// Per-VM state.
#[derive(Debug)]
struct Vm {
    cfg: VmConfig,
    quota: u32,
    /// The VM's comm IDs (and SIDR request IDs) -> entry slot.
    sl_map: FastMap<u32, u32>,
    /// Live entries (not quarantined) owned by the VM.
    live: u32,
    /// IDs the VM's connections left in quarantine.
    quarantined: u32,
    counters: CmCounters,
    drops: DropCounters,
    /// MADs the mux sent on the VM's behalf while it was attached.
    on_behalf: u64,
    attached: bool,
    /// The TIDs of the transactions its entries start: the host's, or for a VM with an
    /// ID range its own (derived from the range, the same on every host).
    tids: TidSpace,
    /// With an ID range: the counter the next `pv_cm_id` is drawn from (cyclic, so an
    /// ID comes back only after the whole range went round).
    next_id: u32,
}

impl Vm {
    /// The key of the VM's range permutation (the same on every host).
    fn tids_key(&self) -> u32 {
        self.cfg.id_range.map_or(0, range_key)
    }

    /// A VM with no entries; `host_tids` unless it has an ID range.
    fn new(cfg: VmConfig, quota: u32, attached: bool, host_tids: TidSpace) -> Vm {
        let tids = cfg
            .id_range
            .map_or(host_tids, |r| TidSpace::new(range_key(r)));
        Vm {
            quota,
            tids,
            next_id: 0,
            cfg,
            sl_map: FastMap::with_hasher(RandomState::default()),
            live: 0,
            quarantined: 0,
            counters: CmCounters::default(),
            drops: DropCounters::default(),
            on_behalf: 0,
            attached,
        }
    }
}

/// A ClassPortInfo Get the VM sent, waiting for its GetResp.
#[derive(Debug, Clone, Copy)]
struct PendingGet {
    vm: u32,
    vm_tid: u64,
    deadline: u64,
}

/// Figures for one VM or the whole host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// infiniband_cm-style counters.
    pub counters: CmCounters,
    /// Drops by reason.
    pub drops: DropCounters,
    /// MADs the mux sent itself on the VM's behalf (included in `counters`): answers
    /// from what it holds where the Linux CM answers without its application (a DREQ in
    /// TimeWait or for no connection, a REP retry of an established connection, a REQ
    /// retry of a detached VM's connection), and the cleanup of a detached VM.
    pub on_behalf: u64,
    /// Live entries (every state but Free and Quarantined).
    pub live: u64,
    /// Entries in quarantine.
    pub quarantined: u64,
}

/// The multiplexer. See the module documentation.
#[derive(Debug)]
pub struct Mux<C: Clock> {
    clock: C,
    cfg: MuxConfig,
    perm: IdPermutation,
    tids: TidSpace,
    slot_bits: u32,
    generation_mask: u16,
    slab: Vec<Entry>,
    free: VecDeque<u32>,
    vms: Vec<Vm>,
    gid_to_vm: FastMap<Gid, u32>,
    /// REQs received from the wire, by their sender's ID (`remote.rs`).
    remote_ids: remote::RemoteIds,
    /// Incoming SIDR_REQs delivered to VMs: (peer, request ID) -> slot.
    sidr_rcvd: FastMap<(u32, u32), u32>,
    /// mlx4 post-2020: REJ(TIMEOUT) routes by the peer's comm ID alone -> (VM, expiry).
    legacy_rej: FastMap<u32, (u32, u64)>,
    peers: Peers,
    timers: BinaryHeap<Reverse<(u64, u32, u16)>>,
    timers_after_compaction: usize,
    quarantine: VecDeque<(u64, u32)>,
    gets: FastMap<u64, PendingGet>,
    next_get: u32,
    outbox: Vec<Outgoing>,
    /// Entries with an ID from a VM's range ([`IdRange`]): `pv_cm_id` -> slot (live and
    /// quarantined). IDs of the host's space are found through the permutation instead.
    ranged: FastMap<u32, u32>,
    /// Counters of MADs the proxy itself sent or absorbed, and of VMs that left.
    host_counters: CmCounters,
    host_drops: DropCounters,
    /// MADs sent on behalf of detached VMs' connections, of unknown ones, and of VMs that left.
    host_on_behalf: u64,
    live: u64,
    quarantined: u64,
    /// With the journal on: what changed since [`Mux::journal_changes`] last ran.
    changes: Option<persist::Changes>,
}

/// Bits of a `pv_cm_id` preimage that hold the slot; the rest is the generation.
const MAX_TABLE_BITS: u8 = 26;
const MIN_TABLE_BITS: u8 = 8;

impl<C: Clock> Mux<C> {
    /// A mux with no VMs.
    pub fn new(cfg: MuxConfig, clock: C) -> Mux<C> {
        let bits = cfg.table_bits.clamp(MIN_TABLE_BITS, MAX_TABLE_BITS);
        let hasher = || RandomState::default();
        Mux {
            clock,
            perm: IdPermutation::new(cfg.seed),
            tids: TidSpace::new((cfg.seed >> 32) as u32 ^ 0x5043_4d00),
            slot_bits: u32::from(bits),
            generation_mask: ((1u32 << (32 - u32::from(bits))) - 1).min(u32::from(u16::MAX)) as u16,
            slab: Vec::new(),
            free: VecDeque::new(),
            vms: Vec::new(),
            gid_to_vm: FastMap::with_hasher(hasher()),
            remote_ids: remote::RemoteIds::new(),
            sidr_rcvd: FastMap::with_hasher(hasher()),
            legacy_rej: FastMap::with_hasher(hasher()),
            peers: Peers {
                index: FastMap::with_hasher(hasher()),
                ..Default::default()
            },
            timers: BinaryHeap::new(),
            timers_after_compaction: 0,
            quarantine: VecDeque::new(),
            gets: FastMap::with_hasher(hasher()),
            next_get: 1,
            outbox: Vec::new(),
            ranged: FastMap::with_hasher(hasher()),
            host_counters: CmCounters::default(),
            host_drops: DropCounters::default(),
            host_on_behalf: 0,
            live: 0,
            quarantined: 0,
            changes: None,
            cfg,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &MuxConfig {
        &self.cfg
    }

    /// The clock.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// The policy, whose behaviours the handlers ask (see `legacy.rs`).
    fn policy(&self) -> Policy {
        self.cfg.policy
    }

    // ----------------------------------------------------------------------------------
    // VMs

    /// Attaches a VM. Fails if another attached VM holds one of its GIDs.
    pub fn attach_vm(&mut self, cfg: VmConfig) -> Result<VmId, AttachError> {
        self.check_attach(&cfg)?;
        let id = u32::try_from(self.vms.len()).map_err(|_| AttachError::TooManyVms)?;
        for gid in cfg.gids() {
            self.gid_to_vm.insert(gid, id);
        }
        if let Some(c) = &mut self.changes {
            c.vms.push(id);
        }
        let quota = cfg.quota.unwrap_or(self.cfg.default_quota);
        self.vms.push(Vm::new(cfg, quota, true, self.tids));
        Ok(VmId(id))
    }

    /// Whether `cfg` could attach now: its GID and ID range are its own (no other VM's,
    /// nor a departed VM's whose IDs are still in use or quarantine), and the range holds
    /// its quota.
    pub fn can_attach(&self, cfg: &VmConfig) -> Result<(), AttachError> {
        self.check_attach(cfg)
    }

    /// Sets an attached VM's quota of live entries (`None`: the host's default).
    /// Entries past a lower quota stay; new ones are refused until the VM is below it.
    /// Returns the VM's live entries.
    pub fn set_quota(&mut self, vm: VmId, quota: Option<u32>) -> Result<u32, AttachError> {
        let default = self.cfg.default_quota;
        let v = self
            .vms
            .get_mut(vm.0 as usize)
            .ok_or(AttachError::NoSuchVm(vm))?;
        let q = quota.unwrap_or(default);
        if let Some(range) = v.cfg.id_range
            && u64::from(q) * 2 > range.size()
        {
            return Err(AttachError::IdRangeTooSmall {
                range,
                size: range.size(),
                quota: q,
            });
        }
        v.quota = q;
        v.cfg.quota = quota;
        let live = v.live;
        if let Some(c) = &mut self.changes {
            c.vms.push(vm.0);
        }
        Ok(live)
    }

    /// Whether `cfg` could attach now: its GID and ID range are its own, and the range
    /// holds its quota.
    fn check_attach(&self, cfg: &VmConfig) -> Result<(), AttachError> {
        for gid in cfg.gids() {
            if let Some(&other) = self.gid_to_vm.get(&gid) {
                return Err(AttachError::GidInUse {
                    gid,
                    name: self.vms[other as usize].cfg.name.clone(),
                });
            }
        }
        let Some(range) = cfg.id_range else {
            return Ok(());
        };
        if !self.policy().transfers_state() {
            return Err(AttachError::IdRangeLegacy);
        }
        let quota = cfg.quota.unwrap_or(self.cfg.default_quota);
        if u64::from(quota) * 2 > range.size() {
            return Err(AttachError::IdRangeTooSmall {
                range,
                size: range.size(),
                quota,
            });
        }
        // Detached VMs count too while they still own entries (orphans, quarantine).
        for v in &self.vms {
            if let Some(other) = v.cfg.id_range
                && other.overlaps(&range)
                && (v.attached || v.live > 0 || v.quarantined > 0)
            {
                return Err(AttachError::IdRangeOverlap {
                    range,
                    other,
                    name: v.cfg.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Moves a departing VM's figures into the host's, so host totals never go backwards.
    fn fold_figures(&mut self, vm: u32) {
        if let Some(v) = self.vms.get_mut(vm as usize) {
            self.host_counters += &std::mem::take(&mut v.counters);
            self.host_drops += &std::mem::take(&mut v.drops);
            self.host_on_behalf += std::mem::take(&mut v.on_behalf);
        }
    }

    /// The TID space of the transactions `vm`'s entries start.
    pub(super) fn tids_of(&self, vm: u32) -> TidSpace {
        self.vms.get(vm as usize).map_or(self.tids, |v| v.tids)
    }

    /// The VM's configuration, if it is attached.
    pub fn vm_config(&self, vm: VmId) -> Option<&VmConfig> {
        self.vms
            .get(vm.0 as usize)
            .filter(|v| v.attached)
            .map(|v| &v.cfg)
    }

    /// MADs the mux itself wants sent (on behalf of detached VMs). Drain after every call.
    pub fn drain_outbox(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.outbox.drain(..)
    }

    // ----------------------------------------------------------------------------------
    // Figures

    /// Figures of one VM (zero counters once detached: they move to the host's).
    pub fn vm_stats(&self, vm: VmId) -> Stats {
        let Some(v) = self.vms.get(vm.0 as usize) else {
            return Stats::default();
        };
        Stats {
            counters: v.counters,
            drops: v.drops,
            on_behalf: v.on_behalf,
            live: u64::from(v.live),
            quarantined: u64::from(v.quarantined),
        }
    }

    /// Figures of the whole host: every VM's plus the proxy's own.
    pub fn host_stats(&self) -> Stats {
        let mut s = Stats {
            counters: self.host_counters,
            drops: self.host_drops,
            on_behalf: self.host_on_behalf,
            live: self.live,
            quarantined: self.quarantined,
        };
        for v in &self.vms {
            s.counters += &v.counters;
            s.drops += &v.drops;
            s.on_behalf += v.on_behalf;
        }
        s
    }

    /// Live entries (not free, not quarantined), host-wide.
    pub fn live_entries(&self) -> u64 {
        self.live
    }

    /// Quarantined IDs, host-wide.
    pub fn quarantined_entries(&self) -> u64 {
        self.quarantined
    }

    /// Entries per state (for tests and tables).
    pub fn state_histogram(&self) -> Vec<(State, u64)> {
        let mut h: Vec<(State, u64)> = State::ALL.iter().map(|s| (*s, 0)).collect();
        for e in &self.slab {
            if let Some(i) = State::ALL.iter().position(|s| *s == e.state) {
                h[i].1 += 1;
            }
        }
        h
    }

    /// The state and owner of the entry a `pv_cm_id` names (for tests and debugging).
    pub fn lookup(&self, pv_cm_id: u32) -> Option<(State, Option<VmId>)> {
        let slot = self.slot_named(pv_cm_id)?;
        let e = self.slab.get(slot as usize)?;
        (e.pv_cm_id == pv_cm_id && e.state != State::Free).then(|| {
            (
                e.state,
                (e.vm != NO_VM && !e.has(flag::ORPHAN)).then_some(VmId(e.vm)),
            )
        })
    }

    /// The `pv_cm_id` the VM's comm ID is mapped to, if any.
    pub fn pv_cm_id_of(&self, vm: VmId, sl_cm_id: u32) -> Option<u32> {
        let v = self.vms.get(vm.0 as usize)?;
        let e = &self.slab[*v.sl_map.get(&sl_cm_id)? as usize];
        Some(e.pv_cm_id).filter(|&pv| pv != 0 && e.state != State::Quarantined)
    }

    /// Bytes the mux holds per live entry, counting the table, the maps and the timers
    /// at their current capacity (an upper-bound estimate for capacity planning).
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let map = |cap: usize, kv: usize| cap * (kv + 1);
        let mut b = self.slab.capacity() * size_of::<Entry>()
            + self.free.capacity() * 4
            + self.timers.capacity() * size_of::<Reverse<(u64, u32, u16)>>()
            + self.quarantine.capacity() * 16
            + map(self.remote_ids.capacity(), size_of::<(RemoteId, u32)>())
            + map(self.sidr_rcvd.capacity(), 12)
            + map(self.legacy_rej.capacity(), 16)
            + self.peers.slots.capacity() * size_of::<Peer>()
            + map(self.peers.index.capacity(), 20)
            + map(self.ranged.capacity(), 8);
        for v in &self.vms {
            b += map(v.sl_map.capacity(), 8);
        }
        b
    }
}

/// The key of a VM's range permutation and TID space: a fixed mix of the range, so
/// every host derives the same from the VM's configuration.
fn range_key(r: IdRange) -> u32 {
    let mut z = (u64::from(r.base) << 8 | u64::from(r.prefix_len)) ^ 0x7076_636d_5449_4453;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Asks the CPU to start loading `e`'s cache line, without waiting for it: the batch
/// paths issue these for a whole batch first, so the misses overlap.
#[inline]
fn prefetch(e: &Entry) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a prefetch is only a hint; it never faults and `e` is a valid reference.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                (e as *const Entry).cast::<i8>(),
            )
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        std::hint::black_box(e.pv_cm_id);
    }
}

/// Sets the Local Comm ID (every message that reaches this has one).
fn set_local(m: &mut CmMad<&mut [u8]>, id: u32) {
    let _ = m.set_local_comm_id(id);
}

/// Writes a CM SEND MAD with the given local and remote comm IDs, everything else zero.
fn write_cm_ids(buf: &mut [u8], attr: AttributeId, tid: u64, local: u32, remote: u32) {
    buf[..mad::MAD_LEN].fill(0);
    mad::Header::cm_send(attr, tid).emit(&mut mad::Packet::new_unchecked(&mut *buf));
    cmf::LOCAL_COMM_ID.set(buf, local.into());
    cmf::REMOTE_COMM_ID.set(buf, remote.into());
}

/// Writes a REJ.
fn write_rej(
    buf: &mut [u8],
    tid: u64,
    local: u32,
    remote: u32,
    msg: MsgResponse,
    reason: RejReason,
    ari: &[u8],
) {
    write_cm_ids(buf, AttributeId::Rej, tid, local, remote);
    cmf::REJ_MESSAGE_REJECTED.set(buf, msg.code().into());
    let n = ari.len().min(cmf::REJ_ARI.len());
    cmf::REJ_ARI_LENGTH.set(buf, n as u64);
    cmf::REJ_REASON.set(buf, reason.code().into());
    buf[cmf::REJ_ARI.start..cmf::REJ_ARI.start + n].copy_from_slice(&ari[..n]);
}

//! The PF multiplexer: pvcm's policy, pure and I/O-free.
//!
//! Every VM runs its own CM with its own comm-ID and TID space; all of them share the
//! host's CM port. The mux
//! - rewrites each VM's local comm ID (and the TIDs of transactions it starts) into
//!   host-unique values on the way to the wire, and back on the way in;
//! - routes wire MADs to the right VM: REQ by Primary Remote Port GID, SIDR_REQ and
//!   ClassPortInfo Get by destination GID, REJ(TIMEOUT) with Remote Comm ID 0 by
//!   [`RejTimeoutKey`] (sender CA GUID, sender comm ID), everything else by remote comm ID;
//! - keeps every entry exactly as long as the protocol can still use it: deadlines are
//!   derived from the CM timeouts the REQ and MRA carry, established connections never
//!   expire, closed ones pass through TimeWait, and freed IDs sit in quarantine;
//! - cleans up a detached VM's connections on its behalf (DREQ, REJ, DREP) so peers stop
//!   waiting, and checks what VMs send (source GID, QPN range, CA GUID, quota).
//!
//! I/O layers call [`Mux::from_guest`], [`Mux::from_wire`] and [`Mux::poll`], and send
//! what [`Mux::drain_outbox`] yields. Time comes from an injected [`Clock`].

mod clock;
mod config;
mod counters;
mod ids;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::Duration;

use foldhash::fast::RandomState;
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as cmf, req};
use pvcm_wire::mad::{self, AttributeId, Method};
use pvcm_wire::timeout::exponent_to_duration;

pub use clock::{Clock, ManualClock, SystemClock, Time};
pub use config::{MuxConfig, Policy, VmConfig};
pub use counters::{CmCounters, DropCounters, DropReason, Group};
pub use ids::{IdPermutation, TidKind, TidSpace};

type FastMap<K, V> = HashMap<K, V, RandomState>;

/// A VM attached to the mux. IDs are never reused, so a stale ID never names a new VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VmId(pub u32);

/// The key that routes a REJ(TIMEOUT) with Remote Comm ID 0: the rejecting side's CA
/// GUID (from its REQ, and the REJ's ARI) and its comm ID (the REQ's and the REJ's Local
/// Comm ID). The Linux core CM's `cm_find_remote_id` key; mlx4 used the comm ID alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RejTimeoutKey {
    /// The remote CA GUID.
    pub ca_guid: u64,
    /// The remote comm ID.
    pub comm_id: u32,
}

/// What to do with a MAD handed to the mux.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Send the (rewritten) MAD on the wire, to the destination the guest gave.
    ToWire,
    /// Deliver the (rewritten) MAD to this VM.
    ToVm(VmId),
    /// The buffer now holds the mux's own answer (REJ NO_RESOURCES, a stateless DREP);
    /// send it back to where the MAD came from.
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

/// Connection state as the proxy sees it from the MADs that pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum State {
    /// Slot unused.
    Free,
    /// VM sent a REQ (VM is the active side).
    ReqSent,
    /// A REQ from the wire was delivered to the VM (VM is the passive side).
    ReqRcvd,
    /// The passive VM sent its REP.
    RepSent,
    /// The active VM received a REP.
    RepRcvd,
    /// RTU passed.
    Established,
    /// The VM (or the proxy on its behalf) sent a DREQ.
    DreqSent,
    /// A DREQ from the wire was delivered to the VM.
    DreqRcvd,
    /// DREP passed; routing late duplicates until the peer's windows close.
    TimeWait,
    /// VM sent a SIDR_REQ.
    SidrReqSent,
    /// A SIDR_REQ from the wire was delivered to the VM.
    SidrReqRcvd,
    /// The `pv_cm_id` is held unusable; late MADs for it are dropped.
    Quarantined,
}

impl State {
    /// True while REQ/REP/RTU are still being exchanged (the states an MRA extends).
    pub fn in_handshake(self) -> bool {
        matches!(
            self,
            State::ReqSent | State::ReqRcvd | State::RepSent | State::RepRcvd
        )
    }

    /// Every state, for statistics.
    pub const ALL: [State; 12] = [
        State::Free,
        State::ReqSent,
        State::ReqRcvd,
        State::RepSent,
        State::RepRcvd,
        State::Established,
        State::DreqSent,
        State::DreqRcvd,
        State::TimeWait,
        State::SidrReqSent,
        State::SidrReqRcvd,
        State::Quarantined,
    ];
}

/// What a REQ from a VM whose comm ID names an existing entry is (see `Mux::req_retry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Retry {
    /// A retry while the handshake is open: forward it under the entry's IDs.
    Forward,
    /// A retry that crossed the peer's REJ: drop it.
    Drop,
    /// Not a retry: a new connection reusing the VM's comm ID.
    New,
}

const NO_VM: u32 = u32::MAX;
const NO_PEER: u32 = u32::MAX;

/// Flag bits of an entry.
mod flag {
    /// The VM started the connection.
    pub const ACTIVE: u8 = 1;
    /// Indexed in its VM's comm-ID map.
    pub const IN_SL_MAP: u8 = 2;
    /// Indexed in the REJ(TIMEOUT) map.
    pub const IN_REMOTE_MAP: u8 = 4;
    /// Legacy policies: the delayed-delete timer is armed.
    pub const LEGACY_TIMER: u8 = 8;
    /// Its VM detached; the proxy finishes the connection on its behalf.
    pub const ORPHAN: u8 = 16;
}

/// One connection (or SIDR exchange). 64 bytes; see `entry_size` in the tests.
#[derive(Debug, Clone, Copy)]
#[repr(align(64))] // one cache line per entry: a wire-side lookup touches one line
struct Entry {
    /// The VM's own comm ID (0 until the passive VM answers).
    sl_cm_id: u32,
    /// The host-unique ID on the wire (0 until assigned).
    pv_cm_id: u32,
    /// The peer's comm ID (0 until known).
    remote_comm_id: u32,
    /// Index in the peer table (the peer's GID and CA GUID).
    peer: u32,
    /// The peer's CA GUID (0 until known).
    remote_ca_guid: u64,
    /// When the mux next has to act on this entry (`u64::MAX`: never).
    deadline: u64,
    /// TID of the VM's REQ or SIDR_REQ, restored on replies.
    vm_tid_req: u64,
    /// TID of the VM's latest DREQ or LAP, restored on replies.
    vm_tid_other: u64,
    /// Owning VM (`NO_VM` for none).
    vm: u32,
    /// The peer's QPN (named in DREQs).
    remote_qpn: u32,
    /// Slot generation: part of `pv_cm_id`, bumped at each reuse of the slot.
    generation: u16,
    state: State,
    flags: u8,
    /// CM response timeout of the VM (5-bit exponent): how long the peer waits for it.
    vm_resp: u8,
    /// CM response timeout of the peer: how long the VM waits for it.
    peer_resp: u8,
    /// Local ACK timeout of the primary path (~2 x packet lifetime), 5-bit exponent.
    ack: u8,
    /// Max CM retries from the REQ; for orphans, DREQ attempts left.
    retries: u8,
}

impl Entry {
    const FREE: Entry = Entry {
        sl_cm_id: 0,
        pv_cm_id: 0,
        remote_comm_id: 0,
        peer: NO_PEER,
        remote_ca_guid: 0,
        deadline: u64::MAX,
        vm_tid_req: 0,
        vm_tid_other: 0,
        vm: NO_VM,
        remote_qpn: 0,
        generation: 0,
        state: State::Free,
        flags: 0,
        vm_resp: 0,
        peer_resp: 0,
        ack: 0,
        retries: 0,
    };

    fn has(&self, f: u8) -> bool {
        self.flags & f != 0
    }
}

/// A remote port the host talks to: its GID and the CA GUID it last showed.
#[derive(Debug, Clone, Copy)]
struct Peer {
    gid: Gid,
    ca_guid: u64,
    refs: u32,
}

/// Peers, interned so that an entry names its peer in 4 bytes.
#[derive(Debug, Default)]
struct Peers {
    slots: Vec<Peer>,
    index: FastMap<Gid, u32>,
    free: Vec<u32>,
}

impl Peers {
    fn acquire(&mut self, gid: Gid) -> u32 {
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
        i
    }

    fn release(&mut self, i: u32) {
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

    fn get(&self, i: u32) -> Option<&Peer> {
        self.slots.get(i as usize)
    }

    fn by_gid(&self, gid: &Gid) -> Option<&Peer> {
        self.index
            .get(gid)
            .and_then(|&i| self.slots.get(i as usize))
    }

    fn set_ca_guid(&mut self, i: u32, guid: u64) {
        if let Some(p) = self.slots.get_mut(i as usize) {
            p.ca_guid = guid;
        }
    }
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
    attached: bool,
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
    remote_map: FastMap<RejTimeoutKey, u32>,
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
    /// Counters of MADs the proxy itself sent or absorbed, and of VMs that left.
    host_counters: CmCounters,
    host_drops: DropCounters,
    live: u64,
    quarantined: u64,
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
            remote_map: FastMap::with_hasher(hasher()),
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
            host_counters: CmCounters::default(),
            host_drops: DropCounters::default(),
            live: 0,
            quarantined: 0,
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

    fn legacy(&self) -> bool {
        self.cfg.policy.is_legacy()
    }

    // ----------------------------------------------------------------------------------
    // VMs

    /// Attaches a VM. Fails if another attached VM has the same GID.
    pub fn attach_vm(&mut self, cfg: VmConfig) -> Result<VmId, String> {
        if let Some(&other) = self.gid_to_vm.get(&cfg.gid) {
            return Err(format!(
                "GID {} is already used by VM {:?}",
                cfg.gid, self.vms[other as usize].cfg.name
            ));
        }
        let id = u32::try_from(self.vms.len()).map_err(|_| "too many VMs".to_string())?;
        self.gid_to_vm.insert(cfg.gid, id);
        self.vms.push(Vm {
            quota: cfg.quota.unwrap_or(self.cfg.default_quota),
            cfg,
            sl_map: FastMap::with_hasher(RandomState::default()),
            live: 0,
            quarantined: 0,
            counters: CmCounters::default(),
            drops: DropCounters::default(),
            attached: true,
        });
        Ok(VmId(id))
    }

    /// The VM's configuration, if it is attached.
    pub fn vm_config(&self, vm: VmId) -> Option<&VmConfig> {
        self.vms
            .get(vm.0 as usize)
            .filter(|v| v.attached)
            .map(|v| &v.cfg)
    }

    /// Detaches a VM (it died, reset, or its vhost-user session ended). With the default
    /// policy every entry it owned is released now: established connections get a DREQ
    /// on its behalf, half-open ones a REJ, DREQs it owed an answer a DREP; the answers
    /// are absorbed. Legacy policies do nothing (mlx4's "TBD"): the entries leak.
    pub fn detach_vm(&mut self, vm: VmId) {
        let Some(v) = self.vms.get_mut(vm.0 as usize) else {
            return;
        };
        if !v.attached {
            return;
        }
        v.attached = false;
        let gid = v.cfg.gid;
        let ca_guid = v.cfg.ca_guid;
        v.sl_map = FastMap::with_hasher(RandomState::default());
        self.gid_to_vm.remove(&gid);
        // Fold the VM's figures into the host's so host totals never go backwards.
        let v = &self.vms[vm.0 as usize];
        self.host_counters += &v.counters;
        self.host_drops += &v.drops;
        let (c, d) = (CmCounters::default(), DropCounters::default());
        let v = &mut self.vms[vm.0 as usize];
        v.counters = c;
        v.drops = d;
        if self.legacy() {
            return;
        }
        let now = self.clock.now().0;
        for slot in 0..self.slab.len() as u32 {
            let e = self.slab[slot as usize];
            if e.vm != vm.0 || e.state == State::Free || e.state == State::Quarantined {
                continue;
            }
            // The VM's comm-ID map is gone already.
            self.slab[slot as usize].flags &= !flag::IN_SL_MAP;
            self.orphan(slot, gid, ca_guid, now);
        }
        if let Some(v) = self.vms.get_mut(vm.0 as usize) {
            v.live = 0;
        }
    }

    /// Finishes one connection of a detached VM.
    fn orphan(&mut self, slot: u32, vm_gid: Gid, vm_ca_guid: u64, now: u64) {
        let e = self.slab[slot as usize];
        let peer_gid = self.peers.get(e.peer).map(|p| p.gid);
        match (e.state, peer_gid) {
            (State::Established | State::DreqSent, Some(dst)) if e.pv_cm_id != 0 => {
                // Established: disconnect on the VM's behalf, retrying like a CM would.
                let attempts = self.cfg.detach_dreq_attempts.max(1);
                self.mark_orphan(slot, State::DreqSent);
                self.slab[slot as usize].retries = attempts - 1;
                self.send_dreq_on_behalf(slot, vm_gid, dst);
                let t = self.attempt(e.peer_resp, e.ack);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            (State::ReqSent | State::RepRcvd | State::ReqRcvd | State::RepSent, Some(dst)) => {
                // Half open: reject, as the Linux CM does when such an ID is destroyed.
                let mut m = [0u8; mad::MAD_LEN];
                let active_waiting = e.state == State::ReqSent;
                let pv = if e.pv_cm_id != 0 {
                    e.pv_cm_id
                } else {
                    self.assign_pv(slot)
                };
                let (reason, msg, remote, tid) = match e.state {
                    State::ReqSent => (
                        RejReason::Timeout,
                        MsgResponse::Other,
                        0,
                        self.tids.tid(TidKind::Req, pv),
                    ),
                    State::RepRcvd => (
                        RejReason::ConsumerDefined,
                        MsgResponse::Rep,
                        e.remote_comm_id,
                        self.tids.tid(TidKind::Req, pv),
                    ),
                    State::ReqRcvd => (
                        RejReason::ConsumerDefined,
                        MsgResponse::Req,
                        e.remote_comm_id,
                        e.vm_tid_req,
                    ),
                    _ => (
                        RejReason::ConsumerDefined,
                        MsgResponse::Other,
                        e.remote_comm_id,
                        e.vm_tid_req,
                    ),
                };
                let ari = if active_waiting {
                    vm_ca_guid.to_be_bytes()
                } else {
                    [0; 8]
                };
                write_rej(
                    &mut m,
                    tid,
                    pv,
                    remote,
                    msg,
                    reason,
                    if active_waiting { &ari } else { &[] },
                );
                self.outbox.push(Outgoing {
                    src: vm_gid,
                    dst,
                    mad: m,
                });
                self.host_counters.bump(Group::TxMsgs, AttributeId::Rej);
                self.retire(slot, now);
            }
            (State::DreqRcvd, Some(dst)) if e.pv_cm_id != 0 => {
                // The VM owed a DREP: answer so the peer stops retrying its DREQ.
                let mut m = [0u8; mad::MAD_LEN];
                write_cm_ids(
                    &mut m,
                    AttributeId::Drep,
                    e.vm_tid_other,
                    e.pv_cm_id,
                    e.remote_comm_id,
                );
                self.outbox.push(Outgoing {
                    src: vm_gid,
                    dst,
                    mad: m,
                });
                self.host_counters.bump(Group::TxMsgs, AttributeId::Drep);
                self.mark_orphan(slot, State::TimeWait);
                let t = self.timewait(&e);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            (State::TimeWait, _) => self.mark_orphan(slot, State::TimeWait),
            _ => self.retire(slot, now),
        }
    }

    fn mark_orphan(&mut self, slot: u32, state: State) {
        let e = &mut self.slab[slot as usize];
        e.flags |= flag::ORPHAN;
        e.state = state;
        let vm = e.vm;
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.live = v.live.saturating_sub(1);
        }
        // Orphans still count as live host entries until they retire.
    }

    fn send_dreq_on_behalf(&mut self, slot: u32, src: Gid, dst: Gid) {
        let e = self.slab[slot as usize];
        let mut m = [0u8; mad::MAD_LEN];
        write_cm_ids(
            &mut m,
            AttributeId::Dreq,
            self.tids.tid(TidKind::Dreq, e.pv_cm_id),
            e.pv_cm_id,
            e.remote_comm_id,
        );
        cmf::DREQ_REMOTE_QPN.set(&mut m, e.remote_qpn.into());
        self.outbox.push(Outgoing { src, dst, mad: m });
        self.host_counters.bump(Group::TxMsgs, AttributeId::Dreq);
    }

    /// MADs the mux itself wants sent (on behalf of detached VMs). Drain after every call.
    pub fn drain_outbox(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.outbox.drain(..)
    }

    // ----------------------------------------------------------------------------------
    // Slots, IDs, timers

    fn alloc_slot(&mut self) -> Option<u32> {
        let slot = match self.free.pop_front() {
            Some(s) => s,
            None => {
                if self.slab.len() >= 1usize << self.slot_bits {
                    return None;
                }
                self.slab.push(Entry::FREE);
                (self.slab.len() - 1) as u32
            }
        };
        let generation = self.slab[slot as usize].generation;
        self.slab[slot as usize] = Entry {
            generation,
            ..Entry::FREE
        };
        self.live += 1;
        Some(slot)
    }

    /// Gives the entry its `pv_cm_id` (slot + generation through the permutation).
    fn assign_pv(&mut self, slot: u32) -> u32 {
        loop {
            let e = &mut self.slab[slot as usize];
            let raw = (u32::from(e.generation) << self.slot_bits) | slot;
            let pv = self.perm.apply(raw);
            if pv != 0 {
                e.pv_cm_id = pv;
                return pv;
            }
            // 0 means "no comm ID" on the wire: skip this generation.
            e.generation = (e.generation + 1) & self.generation_mask;
        }
    }

    /// The slot a wire-side `pv_cm_id` names.
    fn lookup_pv(&self, pv: u32) -> Result<u32, DropReason> {
        if pv == 0 {
            return Err(DropReason::NoRoute);
        }
        let raw = self.perm.invert(pv);
        let slot = raw & ((1u32 << self.slot_bits) - 1);
        match self.slab.get(slot as usize) {
            Some(e) if e.pv_cm_id == pv => match e.state {
                State::Free => Err(DropReason::NoRoute),
                State::Quarantined => Err(DropReason::Quarantined),
                _ => Ok(slot),
            },
            _ => Err(DropReason::NoRoute),
        }
    }

    fn set_deadline(&mut self, slot: u32, deadline: u64) {
        let e = &mut self.slab[slot as usize];
        if e.deadline == deadline {
            return; // already queued
        }
        e.deadline = deadline;
        if deadline != u64::MAX {
            self.timers.push(Reverse((deadline, slot, e.generation)));
            // Lazy deletion leaves stale timers behind; compact when they dominate. The
            // floor keeps compaction amortized O(1) per timer.
            if self.timers.len() >= self.timer_budget() {
                self.compact_timers();
            }
        }
    }

    /// Extends (never shortens) the entry's deadline to `now + d`.
    fn extend_deadline(&mut self, slot: u32, now: u64, d: Duration) {
        let t = Time(now).after(d).0;
        let e = self.slab[slot as usize];
        if e.deadline == u64::MAX || t > e.deadline {
            self.set_deadline(slot, t);
        }
    }

    fn compact_timers(&mut self) {
        let slab = &self.slab;
        self.timers.retain(|Reverse((t, s, g))| {
            slab.get(*s as usize)
                .is_some_and(|e| e.generation == *g && e.deadline == *t && e.state != State::Free)
        });
        self.timers_after_compaction = self.timers.len();
        // Established connections hold no timer: give the memory back, down to the
        // budget (so later pushes on existing entries never allocate).
        let budget = self.timer_budget();
        if self.timers.capacity() > 2 * budget {
            self.timers.shrink_to(budget);
        }
    }

    /// Timers kept before compacting: the live entries (at most one valid timer each)
    /// plus the larger of what the last compaction kept and 512, so that compaction
    /// stays amortized O(1) per timer and the reserved capacity stays ~16 B per entry.
    fn timer_budget(&self) -> usize {
        self.live as usize + self.timers_after_compaction.max(512)
    }

    /// Called when an entry is created (the only place the mux may allocate): makes room
    /// for everything that entry can later need, so MADs of existing entries never
    /// allocate: its timers, its quarantine slot, its VM's comm-ID map slot.
    fn reserve_for_entry(&mut self, vm: u32) {
        let budget = self.timer_budget();
        if self.timers.capacity() < budget {
            self.timers.reserve(budget - self.timers.len());
        }
        let q = (self.live + self.quarantined) as usize;
        if self.quarantine.capacity() < q {
            self.quarantine.reserve(q - self.quarantine.len());
        }
        if let Some(v) = self.vms.get_mut(vm as usize) {
            // Quarantined entries may keep their comm ID mapped (see `retire_entry`).
            let want = (v.live + v.quarantined) as usize;
            if want > v.sl_map.len() {
                v.sl_map.reserve(want - v.sl_map.len());
            }
        }
    }

    /// `d` clamped to the configured upper bound.
    fn clamp(&self, d: Duration) -> Duration {
        d.min(self.cfg.max_wait)
    }

    /// One attempt of a CM exchange: response timeout + local ACK timeout (~2 x packet
    /// lifetime), as the Linux CM's `timeout_ms`.
    fn attempt(&self, resp: u8, ack: u8) -> Duration {
        self.clamp(exponent_to_duration(resp) + exponent_to_duration(ack))
    }

    /// The whole window a side may keep retrying: (retries + 1) attempts, plus grace.
    fn window(&self, resp: u8, ack: u8, retries: u8) -> Duration {
        let one = exponent_to_duration(resp) + exponent_to_duration(ack);
        self.clamp(one * (u32::from(retries) + 1) + self.cfg.grace)
    }

    fn timewait(&self, e: &Entry) -> Duration {
        self.clamp(exponent_to_duration(e.ack) + self.cfg.grace)
    }

    /// The next time [`Mux::poll`] has work, if any.
    pub fn next_deadline(&self) -> Option<Time> {
        let t = self.timers.peek().map(|Reverse((t, _, _))| *t);
        let q = self.quarantine.front().map(|(t, _)| *t);
        let g = self.gets.values().map(|p| p.deadline).min();
        [t, q, g].into_iter().flatten().min().map(Time)
    }

    /// Acts on every deadline that has passed: abandoned handshakes and closed windows
    /// retire, TimeWait ends, quarantine releases IDs, orphans retry their DREQs.
    pub fn poll(&mut self) {
        let now = self.clock.now().0;
        while let Some(&Reverse((t, slot, generation))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(e) = self.slab.get(slot as usize) else {
                continue;
            };
            if e.generation != generation || e.deadline != t || e.state == State::Free {
                continue; // stale timer
            }
            self.slab[slot as usize].deadline = u64::MAX;
            self.expire(slot, now);
        }
        while let Some(&(t, slot)) = self.quarantine.front() {
            if t > now {
                break;
            }
            self.quarantine.pop_front();
            if let Some(e) = self.slab.get(slot as usize)
                && e.state == State::Quarantined
            {
                let vm = e.vm;
                if let Some(v) = self.vms.get_mut(vm as usize) {
                    v.quarantined = v.quarantined.saturating_sub(1);
                }
                self.quarantined -= 1;
                self.free_slot(slot);
            }
        }
        if !self.gets.is_empty() {
            self.gets.retain(|_, p| p.deadline > now);
        }
        if !self.legacy_rej.is_empty() {
            self.legacy_rej.retain(|_, (_, exp)| *exp > now);
        }
    }

    fn expire(&mut self, slot: u32, now: u64) {
        let e = self.slab[slot as usize];
        if self.legacy() {
            // mlx4's delayed work: delete, no quarantine.
            self.retire(slot, now);
            return;
        }
        match e.state {
            State::DreqSent if e.has(flag::ORPHAN) && e.retries > 0 => {
                self.slab[slot as usize].retries -= 1;
                let src = self.vms.get(e.vm as usize).map(|v| v.cfg.gid);
                let dst = self.peers.get(e.peer).map(|p| p.gid);
                if let (Some(src), Some(dst)) = (src, dst) {
                    self.send_dreq_on_behalf(slot, src, dst);
                    self.host_counters.bump(Group::TxRetries, AttributeId::Dreq);
                }
                let t = self.attempt(e.peer_resp, e.ack);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            State::DreqSent | State::DreqRcvd => {
                // Both sides' DREQ windows are closed: the CMs are in TimeWait.
                self.slab[slot as usize].state = State::TimeWait;
                let t = self.timewait(&e);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            _ => self.retire(slot, now),
        }
    }

    /// Ends an entry: unindexes it, then quarantines its `pv_cm_id` (default policy) or
    /// frees it at once (legacy).
    fn retire(&mut self, slot: u32, now: u64) {
        self.retire_entry(slot, now, false);
    }

    /// [`Mux::retire`], but an entry going into quarantine stays in its VM's comm-ID map
    /// (when `keep_sl`), so that a REQ retry crossing the peer's REJ is recognised and
    /// dropped (see `req_retry`). Lookups by comm ID skip quarantined entries; the
    /// mapping goes when the slot is freed or the VM reuses the comm ID.
    fn retire_entry(&mut self, slot: u32, now: u64, keep_sl: bool) {
        let e = self.slab[slot as usize];
        if e.state == State::Free || e.state == State::Quarantined {
            return;
        }
        let quarantine = e.pv_cm_id != 0 && !self.legacy();
        self.unindex(slot, keep_sl && quarantine);
        if let Some(v) = self.vms.get_mut(e.vm as usize)
            && !e.has(flag::ORPHAN)
        {
            v.live = v.live.saturating_sub(1);
        }
        if quarantine {
            let en = &mut self.slab[slot as usize];
            en.state = State::Quarantined;
            en.deadline = u64::MAX;
            self.live -= 1;
            self.quarantined += 1;
            if let Some(v) = self.vms.get_mut(e.vm as usize) {
                v.quarantined += 1;
            }
            self.quarantine
                .push_back((Time(now).after(self.cfg.quarantine).0, slot));
        } else {
            self.live -= 1;
            self.free_slot(slot);
        }
    }

    /// Removes the entry from every map (but its VM's comm-ID map if `keep_sl`).
    fn unindex(&mut self, slot: u32, keep_sl: bool) {
        if !keep_sl {
            self.unindex_sl(slot);
        }
        let e = self.slab[slot as usize];
        if e.has(flag::IN_REMOTE_MAP) {
            let k = RejTimeoutKey {
                ca_guid: e.remote_ca_guid,
                comm_id: e.remote_comm_id,
            };
            if self.remote_map.get(&k) == Some(&slot) {
                self.remote_map.remove(&k);
            }
        }
        if e.state == State::SidrReqRcvd {
            let k = (e.peer, e.remote_comm_id);
            if self.sidr_rcvd.get(&k) == Some(&slot) {
                self.sidr_rcvd.remove(&k);
            }
        }
        self.slab[slot as usize].flags &= !flag::IN_REMOTE_MAP;
    }

    /// Removes the entry from its VM's comm-ID map (if the comm ID still names it).
    fn unindex_sl(&mut self, slot: u32) {
        let e = self.slab[slot as usize];
        if e.has(flag::IN_SL_MAP)
            && let Some(v) = self.vms.get_mut(e.vm as usize)
            && v.sl_map.get(&e.sl_cm_id) == Some(&slot)
        {
            v.sl_map.remove(&e.sl_cm_id);
        }
        self.slab[slot as usize].flags &= !flag::IN_SL_MAP;
    }

    fn free_slot(&mut self, slot: u32) {
        self.unindex_sl(slot);
        let e = self.slab[slot as usize];
        if e.peer != NO_PEER {
            self.peers.release(e.peer);
        }
        self.slab[slot as usize] = Entry {
            generation: (e.generation + 1) & self.generation_mask,
            ..Entry::FREE
        };
        self.free.push_back(slot);
    }

    // ----------------------------------------------------------------------------------
    // Guest -> wire

    /// A CM MAD from VM `vm`, to be sent to `dst`. Rewrites it in place.
    pub fn from_guest(&mut self, vm: VmId, buf: &mut [u8], dst: Gid) -> Verdict {
        if !self.vms.get(vm.0 as usize).is_some_and(|v| v.attached) {
            self.host_drops.bump(DropReason::UnknownConnection);
            return Verdict::Drop(DropReason::UnknownConnection);
        }
        let verdict = match CmMad::new_checked(&mut *buf) {
            Err(_) => Verdict::Drop(DropReason::Malformed),
            Ok(mut m) => {
                let now = self.clock.now().0;
                if now >= self.timers.peek().map_or(u64::MAX, |Reverse((t, _, _))| *t) {
                    self.poll();
                }
                self.guest_mad(vm.0, &mut m, dst, now)
            }
        };
        let attr = mad::Packet::new_unchecked(&*buf).attr_id();
        let v = &mut self.vms[vm.0 as usize];
        match verdict {
            Verdict::Drop(r) => v.drops.bump(r),
            Verdict::ToWire => {
                if let Some(a) = AttributeId::from_u16(attr) {
                    v.counters.bump(Group::TxMsgs, a);
                }
            }
            _ => {}
        }
        verdict
    }

    fn vm_cfg(&self, vm: u32) -> &VmConfig {
        &self.vms[vm as usize].cfg
    }

    fn guest_mad(&mut self, vm: u32, m: &mut CmMad<&mut [u8]>, dst: Gid, now: u64) -> Verdict {
        let checks = !self.legacy();
        let attr = m.attr();
        match attr {
            AttributeId::Req => {
                let sl = m.local_comm_id().unwrap_or(0);
                if checks {
                    if let Err(r) = self.check_req(vm, m.as_bytes()) {
                        return Verdict::Drop(r);
                    }
                }
                let existing = self.vms[vm as usize].sl_map.get(&sl).copied();
                let slot = match existing.map(|s| (s, self.req_retry(s, m.tid()))) {
                    Some((s, Retry::Forward)) => {
                        // A retry of the REQ already forwarded: same pv_cm_id and host
                        // TID, so the peer sees a duplicate (Linux `cm_match_req`).
                        self.vms[vm as usize].counters.bump(Group::TxRetries, attr);
                        s
                    }
                    Some((_, Retry::Drop)) => return Verdict::Drop(DropReason::BadState),
                    other => {
                        if let Some((old, _)) = other {
                            // The VM reuses its ID for a new connection: the old one is over.
                            self.retire(old, now);
                        }
                        if checks && self.vms[vm as usize].live >= self.vms[vm as usize].quota {
                            let tid = m.tid();
                            write_rej(
                                m.as_bytes_mut(),
                                tid,
                                0,
                                sl,
                                MsgResponse::Req,
                                RejReason::NoResources,
                                &[],
                            );
                            self.vms[vm as usize].drops.bump(DropReason::OverQuota);
                            return Verdict::Reply;
                        }
                        let Some(s) = self.new_entry(vm, dst) else {
                            return Verdict::Drop(DropReason::TableFull);
                        };
                        let p = req::Packet::new_unchecked(m.as_bytes());
                        let e = &mut self.slab[s as usize];
                        e.state = State::ReqSent;
                        e.flags |= flag::ACTIVE;
                        e.sl_cm_id = sl;
                        e.vm_resp = p.local_cm_response_timeout();
                        e.peer_resp = p.remote_cm_response_timeout();
                        e.ack = p.primary_path().local_ack_timeout;
                        e.retries = p.max_cm_retries();
                        self.index_sl(vm, sl, s);
                        self.assign_pv(s);
                        if !self.legacy() {
                            let e = self.slab[s as usize];
                            let w = self.window(e.peer_resp, e.ack, e.retries);
                            self.set_deadline(s, Time(now).after(w).0);
                        }
                        s
                    }
                };
                self.slab[slot as usize].vm_tid_req = m.tid();
                let pv = self.slab[slot as usize].pv_cm_id;
                m.set_tid(self.tids.tid(TidKind::Req, pv));
                set_local(m, pv);
                Verdict::ToWire
            }
            AttributeId::Rep => {
                if checks && let Err(r) = self.check_rep(vm, m.as_bytes()) {
                    return Verdict::Drop(r);
                }
                let slot = match self.guest_entry(vm, m, dst, now) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let e = self.slab[slot as usize];
                match e.state {
                    State::RepSent => {
                        self.vms[vm as usize].counters.bump(Group::TxRetries, attr);
                    }
                    State::ReqRcvd => {
                        self.slab[slot as usize].state = State::RepSent;
                        if !self.legacy() {
                            // The VM retries its REP, the peer may MRA or REJ; the RTU
                            // must come within the peer's response window.
                            let w = self.window(e.peer_resp, e.ack, e.retries);
                            self.set_deadline(slot, Time(now).after(w).0);
                        }
                    }
                    _ => return Verdict::Drop(DropReason::BadState),
                }
                set_local(m, self.slab[slot as usize].pv_cm_id);
                Verdict::ToWire
            }
            AttributeId::Mra => {
                let slot = match self.guest_entry(vm, m, dst, now) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let e = self.slab[slot as usize];
                if !self.legacy() && e.state.in_handshake() {
                    // The peer now waits the service timeout on top of its window. (An
                    // MRA for a LAP leaves an established connection without deadline.)
                    let svc = exponent_to_duration(m.mra_service_timeout().unwrap_or(0));
                    let w = self.clamp(svc + self.window(e.vm_resp, e.ack, e.retries));
                    self.extend_deadline(slot, now, w);
                }
                self.req_tid_to_host(slot, m);
                set_local(m, e.pv_cm_id);
                Verdict::ToWire
            }
            AttributeId::Rej => {
                let sl = m.local_comm_id().unwrap_or(0);
                // A REJ(TIMEOUT) must name the VM's own CA GUID; an ARI too short to
                // hold one is refused too (Linux's cm_rej_handler reads the first 8 ARI
                // bytes whatever the ARI length says).
                if checks
                    && m.rej_reason() == Some(RejReason::Timeout.code())
                    && m.remote_comm_id() == Some(0)
                    && m.rej_timeout_ca_guid() != Some(self.vm_cfg(vm).ca_guid)
                {
                    return Verdict::Drop(DropReason::SpoofedCaGuid);
                }
                if sl == 0 {
                    // A stateless reject (Linux cm_issue_rej): no ID of the VM's to hide,
                    // but the REQ it answers leaves no entry behind.
                    if !self.legacy()
                        && let Err(r) = self.stateless_rej(vm, m, dst, now)
                    {
                        return Verdict::Drop(r);
                    }
                    return Verdict::ToWire;
                }
                let slot = match self.guest_entry(vm, m, dst, now) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let pv = self.slab[slot as usize].pv_cm_id;
                self.req_tid_to_host(slot, m);
                set_local(m, pv);
                self.connection_rejected(slot, now);
                Verdict::ToWire
            }
            AttributeId::Rtu => {
                let slot = match self.guest_known(vm, m) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                match self.slab[slot as usize].state {
                    State::RepRcvd => self.establish(slot),
                    // Re-sent for a duplicate REP (the first RTU was lost).
                    State::Established => {
                        self.vms[vm as usize].counters.bump(Group::TxRetries, attr)
                    }
                    _ if self.legacy() => {}
                    _ => return Verdict::Drop(DropReason::BadState),
                }
                self.req_tid_to_host(slot, m);
                set_local(m, self.slab[slot as usize].pv_cm_id);
                Verdict::ToWire
            }
            AttributeId::Dreq => {
                let slot = match self.guest_known(vm, m) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let e = self.slab[slot as usize];
                match e.state {
                    State::DreqSent | State::TimeWait => {
                        self.vms[vm as usize].counters.bump(Group::TxRetries, attr)
                    }
                    State::DreqRcvd => {} // crossed DREQs: both sides answer with DREP
                    _ => {
                        // Established (or a half-open connection the VM tears down).
                        self.slab[slot as usize].state = State::DreqSent;
                        if self.legacy() {
                            self.legacy_arm(slot, now);
                        } else {
                            let w = self.window(e.peer_resp, e.ack, e.retries);
                            self.set_deadline(slot, Time(now).after(w).0);
                        }
                    }
                }
                self.slab[slot as usize].vm_tid_other = m.tid();
                m.set_tid(self.tids.tid(TidKind::Dreq, e.pv_cm_id));
                set_local(m, e.pv_cm_id);
                Verdict::ToWire
            }
            AttributeId::Drep => {
                let slot = match self.guest_known(vm, m) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let e = self.slab[slot as usize];
                match e.state {
                    State::TimeWait => self.vms[vm as usize].counters.bump(Group::TxRetries, attr),
                    _ if self.legacy() => {
                        if self.cfg.policy == Policy::Mlx4Pre2020 {
                            set_local(m, e.pv_cm_id);
                            self.retire(slot, now);
                            return Verdict::ToWire;
                        }
                    }
                    State::DreqRcvd | State::DreqSent => self.enter_timewait(slot, now),
                    _ => return Verdict::Drop(DropReason::BadState),
                }
                set_local(m, e.pv_cm_id);
                Verdict::ToWire
            }
            AttributeId::Lap | AttributeId::Apr => {
                let slot = match self.guest_known(vm, m) {
                    Ok(s) => s,
                    Err(r) => return Verdict::Drop(r),
                };
                let pv = self.slab[slot as usize].pv_cm_id;
                if attr == AttributeId::Lap {
                    self.slab[slot as usize].vm_tid_other = m.tid();
                    m.set_tid(self.tids.tid(TidKind::Lap, pv));
                }
                set_local(m, pv);
                Verdict::ToWire
            }
            AttributeId::SidrReq => {
                let rid = m.sidr_request_id().unwrap_or(0);
                let existing = self.vms[vm as usize].sl_map.get(&rid).copied();
                let slot = match existing {
                    Some(s) if self.slab[s as usize].state == State::SidrReqSent => {
                        self.vms[vm as usize].counters.bump(Group::TxRetries, attr);
                        s
                    }
                    other => {
                        if let Some(old) = other {
                            self.retire(old, now);
                        }
                        if checks && self.vms[vm as usize].live >= self.vms[vm as usize].quota {
                            return Verdict::Drop(DropReason::OverQuota);
                        }
                        let Some(s) = self.new_entry(vm, dst) else {
                            return Verdict::Drop(DropReason::TableFull);
                        };
                        let e = &mut self.slab[s as usize];
                        e.state = State::SidrReqSent;
                        e.flags |= flag::ACTIVE;
                        e.sl_cm_id = rid;
                        self.index_sl(vm, rid, s);
                        self.assign_pv(s);
                        let t = self.clamp(self.cfg.sidr_timeout);
                        self.set_deadline(s, Time(now).after(t).0);
                        s
                    }
                };
                self.slab[slot as usize].vm_tid_req = m.tid();
                let pv = self.slab[slot as usize].pv_cm_id;
                m.set_tid(self.tids.tid(TidKind::Sidr, pv));
                // A SIDR_REQ has a request ID, never a comm ID.
                let _ = m.set_sidr_request_id(pv);
                Verdict::ToWire
            }
            AttributeId::SidrRep => {
                if checks {
                    let status = m.as_bytes()[28];
                    if status == 0 && m.local_qpn().is_some_and(|q| !self.vm_cfg(vm).owns_qpn(q)) {
                        return Verdict::Drop(DropReason::SpoofedQpn);
                    }
                }
                // The request ID is the peer's; check the VM was asked.
                let rid = m.sidr_request_id().unwrap_or(0);
                let peer = self.peers.index.get(&dst).copied();
                let slot = peer.and_then(|p| self.sidr_rcvd.get(&(p, rid)).copied());
                match slot {
                    Some(s) if self.slab[s as usize].vm == vm => {
                        self.retire(s, now);
                        Verdict::ToWire
                    }
                    _ if self.legacy() => Verdict::ToWire,
                    _ => Verdict::Drop(DropReason::UnknownConnection),
                }
            }
            AttributeId::ClassPortInfo => {
                if m.method() == Method::Get as u8 {
                    let host_tid = self.tids.get_tid(self.next_get);
                    self.next_get = self.next_get.wrapping_add(1);
                    let deadline = Time(now).after(self.cfg.class_port_info_timeout).0;
                    self.gets.insert(
                        host_tid,
                        PendingGet {
                            vm,
                            vm_tid: m.tid(),
                            deadline,
                        },
                    );
                    m.set_tid(host_tid);
                }
                Verdict::ToWire
            }
        }
    }

    /// A REJ with Local Comm ID 0 from the VM (INVALID_SERVICE_ID, NO_RESOURCES, ...):
    /// its CM keeps no state for the REQ it rejects, so neither does the mux. Its Remote
    /// Comm ID is the peer's comm ID from that REQ: with the peer's CA GUID (that of the
    /// REJ's destination) it names the entry the REQ created, which retires (quarantine
    /// if the VM had named it, else freed at once: no ID of ours was on the wire). A REJ
    /// naming a REQ delivered to another VM is dropped: it would make the peer abandon
    /// that VM's connection (Linux finds a rejected REQ by the Remote Comm ID alone).
    fn stateless_rej(
        &mut self,
        vm: u32,
        m: &CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<(), DropReason> {
        let remote = m.remote_comm_id().unwrap_or(0);
        let Some(ca_guid) = self.peers.by_gid(&dst).map(|p| p.ca_guid) else {
            return Ok(());
        };
        let key = RejTimeoutKey {
            ca_guid,
            comm_id: remote,
        };
        let Some(&s) = self.remote_map.get(&key).filter(|_| remote != 0) else {
            return Ok(()); // nothing pending under that ID: pass, as before
        };
        let e = self.slab[s as usize];
        if e.vm != vm {
            return Err(DropReason::UnknownConnection);
        }
        if e.state == State::ReqRcvd {
            self.retire(s, now);
        }
        Ok(())
    }

    /// Whether a REQ from the VM naming the entry in `slot` (found by the VM's comm ID)
    /// with this TID is a retry of the entry's REQ.
    ///
    /// A retry carries the same comm ID and TID (the VM's CM re-sends the same MAD). It
    /// is forwarded under the entry's `pv_cm_id` and host TID while the handshake is
    /// open on the VM's side (ReqSent, or RepRcvd: the retry left before the VM's CM
    /// processed the REP); the peer handles the duplicate as a CM does (Linux ignores it
    /// in REP_SENT, re-sends its MRA in MRA_REQ_SENT). After the peer's REJ the retry
    /// crossed the REJ and is dropped: forwarding it under a new ID would raise a second
    /// connection at the peer. In any later state the VM's CM has sent its RTU, after
    /// which no conforming CM retries its REQ (and the VM's tx queue is FIFO): the same
    /// comm ID is then a new connection reusing it (Linux and the pvcm agent form the
    /// TID from the comm ID, so the TID is the same too).
    fn req_retry(&self, slot: u32, tid: u64) -> Retry {
        let e = &self.slab[slot as usize];
        let same = e.has(flag::ACTIVE) && (e.vm_tid_req == tid || self.legacy());
        match e.state {
            State::ReqSent | State::RepRcvd if same => Retry::Forward,
            State::Quarantined if same && e.has(flag::IN_SL_MAP) => Retry::Drop,
            _ => Retry::New,
        }
    }

    /// The active VM's RTU, REJ and MRA(REP) reuse its REQ's TID (as Linux's
    /// `cm_format_rtu`/`rej`/`mra` do), whose low half is the VM's comm ID: on the wire
    /// they carry the host REQ TID instead, as they would from a Linux host.
    fn req_tid_to_host(&self, slot: u32, m: &mut CmMad<&mut [u8]>) {
        let e = &self.slab[slot as usize];
        if e.has(flag::ACTIVE) && e.pv_cm_id != 0 && m.tid() == e.vm_tid_req {
            m.set_tid(self.tids.tid(TidKind::Req, e.pv_cm_id));
        }
    }

    fn check_req(&self, vm: u32, bytes: &[u8]) -> Result<(), DropReason> {
        let cfg = self.vm_cfg(vm);
        let p = req::Packet::new_unchecked(bytes);
        if p.primary_local_port_gid() != cfg.gid {
            return Err(DropReason::SpoofedGid);
        }
        let alt = p.alternate_path().local_gid;
        if alt != Gid::ZERO && alt != cfg.gid {
            return Err(DropReason::SpoofedGid);
        }
        if !cfg.owns_qpn(p.local_qpn()) {
            return Err(DropReason::SpoofedQpn);
        }
        if p.local_ca_guid() != cfg.ca_guid {
            return Err(DropReason::SpoofedCaGuid);
        }
        Ok(())
    }

    fn check_rep(&self, vm: u32, bytes: &[u8]) -> Result<(), DropReason> {
        let cfg = self.vm_cfg(vm);
        let b = bytes;
        if !cfg.owns_qpn(cmf::REP_LOCAL_QPN.get(b) as u32) {
            return Err(DropReason::SpoofedQpn);
        }
        if cmf::REP_LOCAL_CA_GUID.get(b) != cfg.ca_guid {
            return Err(DropReason::SpoofedCaGuid);
        }
        Ok(())
    }

    fn new_entry(&mut self, vm: u32, peer_gid: Gid) -> Option<u32> {
        let slot = self.alloc_slot()?;
        let peer = self.peers.acquire(peer_gid);
        let e = &mut self.slab[slot as usize];
        e.vm = vm;
        e.peer = peer;
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.live += 1;
        }
        self.reserve_for_entry(vm);
        Some(slot)
    }

    fn index_sl(&mut self, vm: u32, sl: u32, slot: u32) {
        self.vms[vm as usize].sl_map.insert(sl, slot);
        self.slab[slot as usize].flags |= flag::IN_SL_MAP;
    }

    /// A live entry the VM already named with this Local Comm ID.
    fn guest_known(&self, vm: u32, m: &CmMad<&mut [u8]>) -> Result<u32, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        self.vms[vm as usize]
            .sl_map
            .get(&sl)
            .copied()
            .filter(|&s| self.slab[s as usize].state != State::Quarantined)
            .ok_or(DropReason::UnknownConnection)
    }

    /// The entry of a passive-side answer (MRA, REP, REJ): by the VM's comm ID if it used
    /// it before, else the REQ it answers, found by (peer CA GUID, peer comm ID).
    fn guest_entry(
        &mut self,
        vm: u32,
        m: &CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<u32, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        let remote = m.remote_comm_id().unwrap_or(0);
        if let Ok(s) = self.guest_known(vm, m) {
            if self.slab[s as usize].remote_comm_id == remote || self.legacy() {
                return Ok(s);
            }
            // The VM reuses its comm ID towards another peer connection: as far as its
            // CM is concerned the old one is gone.
            self.retire(s, now);
        }
        if self.legacy() {
            // mlx4 allocates on any REP/MRA/REJ it has not seen, without checks.
            let s = self.new_entry(vm, dst).ok_or(DropReason::TableFull)?;
            let e = &mut self.slab[s as usize];
            e.state = State::ReqRcvd;
            e.sl_cm_id = sl;
            e.remote_comm_id = remote;
            self.index_sl(vm, sl, s);
            self.assign_pv(s);
            return Ok(s);
        }
        let ca_guid = self
            .peers
            .by_gid(&dst)
            .map(|p| p.ca_guid)
            .ok_or(DropReason::UnknownConnection)?;
        let k = RejTimeoutKey {
            ca_guid,
            comm_id: remote,
        };
        let s = self
            .remote_map
            .get(&k)
            .copied()
            .ok_or(DropReason::UnknownConnection)?;
        let e = self.slab[s as usize];
        if e.vm != vm || e.state != State::ReqRcvd || e.has(flag::IN_SL_MAP) {
            return Err(DropReason::UnknownConnection);
        }
        self.slab[s as usize].sl_cm_id = sl;
        self.index_sl(vm, sl, s);
        self.assign_pv(s);
        Ok(s)
    }

    fn establish(&mut self, slot: u32) {
        let e = &mut self.slab[slot as usize];
        e.state = State::Established;
        let was_indexed = e.has(flag::IN_REMOTE_MAP);
        e.flags &= !flag::IN_REMOTE_MAP;
        e.deadline = u64::MAX;
        // The peer got our REP: it can no longer send a REJ(TIMEOUT) without our ID.
        if was_indexed {
            let k = RejTimeoutKey {
                ca_guid: e.remote_ca_guid,
                comm_id: e.remote_comm_id,
            };
            if self.remote_map.get(&k) == Some(&slot) {
                self.remote_map.remove(&k);
            }
        }
    }

    fn enter_timewait(&mut self, slot: u32, now: u64) {
        let e = self.slab[slot as usize];
        self.slab[slot as usize].state = State::TimeWait;
        // Route the peer's DREQ retries if our DREP is lost: one more attempt of its
        // (each retry extends this), then the CM TimeWait. A retry arriving later still
        // gets a stateless DREP from `wire_mad`.
        let t = self.attempt(e.vm_resp.max(e.peer_resp), e.ack) + self.timewait(&e);
        self.set_deadline(slot, Time(now).after(self.clamp(t)).0);
    }

    fn connection_rejected(&mut self, slot: u32, now: u64) {
        match self.cfg.policy {
            Policy::Default => self.retire(slot, now),
            Policy::Mlx4Pre2020 => self.retire(slot, now),
            Policy::Mlx4Post2020 => self.legacy_arm(slot, now),
        }
    }

    /// mlx4's delayed delete: armed once, fires after `CM_CLEANUP_CACHE_TIMEOUT`.
    fn legacy_arm(&mut self, slot: u32, now: u64) {
        if self.slab[slot as usize].has(flag::LEGACY_TIMER) {
            return;
        }
        self.slab[slot as usize].flags |= flag::LEGACY_TIMER;
        let t = Time(now).after(self.cfg.policy.legacy_cleanup()).0;
        self.set_deadline(slot, t);
    }

    // ----------------------------------------------------------------------------------
    // Wire -> guest

    /// A CM MAD from the wire, sent by `src` to `dst`. Rewrites it in place.
    pub fn from_wire(&mut self, buf: &mut [u8], src: Gid, dst: Gid) -> Verdict {
        let verdict = match CmMad::new_checked(&mut *buf) {
            Err(_) => Verdict::Drop(DropReason::Malformed),
            Ok(mut m) => {
                let now = self.clock.now().0;
                if now >= self.timers.peek().map_or(u64::MAX, |Reverse((t, _, _))| *t) {
                    self.poll();
                }
                self.wire_mad(&mut m, src, dst, now)
            }
        };
        let attr = AttributeId::from_u16(mad::Packet::new_unchecked(&*buf).attr_id());
        match verdict {
            Verdict::Drop(r) => self.host_drops.bump(r),
            Verdict::ToVm(vm) => {
                if let (Some(v), Some(a)) = (self.vms.get_mut(vm.0 as usize), attr) {
                    v.counters.bump(Group::RxMsgs, a);
                }
            }
            Verdict::Reply | Verdict::ToWire => {
                if let Some(a) = attr {
                    self.host_counters.bump(Group::RxMsgs, a);
                }
            }
        }
        verdict
    }

    /// [`Mux::from_wire`] for a batch (as `recvmmsg` delivers them): `addrs[i]` is the
    /// (source, destination) of `mads[i]`, and `verdicts[i]` receives its verdict.
    ///
    /// Same results as one call per MAD, but first prefetches every entry the batch
    /// names, so that with a table far larger than the caches the misses overlap instead
    /// of being paid one after the other.
    pub fn from_wire_batch(
        &mut self,
        mads: &mut [[u8; mad::MAD_LEN]],
        addrs: &[(Gid, Gid)],
        verdicts: &mut [Verdict],
    ) {
        let n = mads.len().min(addrs.len()).min(verdicts.len());
        for m in &mads[..n] {
            if let Ok(Some(pv)) = CmMad::new_checked(&m[..]).map(|m| m.remote_comm_id()) {
                let slot = self.perm.invert(pv) & ((1u32 << self.slot_bits) - 1);
                if let Some(e) = self.slab.get(slot as usize) {
                    prefetch(e);
                }
            }
        }
        for i in 0..n {
            let (src, dst) = addrs[i];
            verdicts[i] = self.from_wire(&mut mads[i], src, dst);
        }
    }

    /// [`Mux::from_guest`] for a batch of MADs from one VM (as a virtqueue delivers
    /// them): `dsts[i]` is where `mads[i]` goes, `verdicts[i]` receives its verdict.
    /// Looks up the VM's comm-ID map and prefetches the entries first, like
    /// [`Mux::from_wire_batch`].
    pub fn from_guest_batch(
        &mut self,
        vm: VmId,
        mads: &mut [[u8; mad::MAD_LEN]],
        dsts: &[Gid],
        verdicts: &mut [Verdict],
    ) {
        let n = mads.len().min(dsts.len()).min(verdicts.len());
        if let Some(v) = self.vms.get(vm.0 as usize) {
            for m in &mads[..n] {
                let sl = u32::from_be_bytes([m[24], m[25], m[26], m[27]]);
                if let Some(&slot) = v.sl_map.get(&sl)
                    && let Some(e) = self.slab.get(slot as usize)
                {
                    prefetch(e);
                }
            }
        }
        for i in 0..n {
            verdicts[i] = self.from_guest(vm, &mut mads[i], dsts[i]);
        }
    }

    fn rx_dup(&mut self, vm: u32, attr: AttributeId) {
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.counters.bump(Group::RxDuplicates, attr);
        }
    }

    /// Routes a MAD that names a `pv_cm_id` in its Remote Comm ID; checks the frame was
    /// addressed to the owner's GID.
    fn wire_entry(&self, m: &CmMad<&mut [u8]>, dst: Gid) -> Result<u32, DropReason> {
        let pv = m.remote_comm_id().unwrap_or(0);
        let slot = self.lookup_pv(pv)?;
        let e = &self.slab[slot as usize];
        if e.has(flag::ORPHAN) {
            return Ok(slot);
        }
        match self.vms.get(e.vm as usize) {
            Some(v) if v.attached => {
                if v.cfg.gid != dst && !self.legacy() {
                    return Err(DropReason::WrongDestination);
                }
                Ok(slot)
            }
            _ => Err(DropReason::Absorbed),
        }
    }

    /// Delivers to the owner of `slot` with the remote comm ID restored, or absorbs it
    /// for an orphan.
    fn deliver(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>) -> Verdict {
        let e = self.slab[slot as usize];
        let _ = m.set_remote_comm_id(e.sl_cm_id);
        if let Some(kind) = self.tids.kind_of(m.tid(), e.pv_cm_id) {
            let tid = match kind {
                TidKind::Req | TidKind::Sidr => e.vm_tid_req,
                TidKind::Dreq | TidKind::Lap => e.vm_tid_other,
            };
            m.set_tid(tid);
        }
        if e.has(flag::ORPHAN) {
            Verdict::Drop(DropReason::Absorbed)
        } else {
            Verdict::ToVm(VmId(e.vm))
        }
    }

    fn wire_mad(&mut self, m: &mut CmMad<&mut [u8]>, src: Gid, dst: Gid, now: u64) -> Verdict {
        let attr = m.attr();
        match attr {
            AttributeId::Req => self.wire_req(m, src, now),
            AttributeId::Rej
                if m.remote_comm_id() == Some(0)
                    && m.rej_reason() == Some(RejReason::Timeout.code()) =>
            {
                self.wire_rej_timeout(m, src, dst, now)
            }
            AttributeId::SidrReq => {
                let Some(&vm) = self.gid_to_vm.get(&dst) else {
                    return Verdict::Drop(DropReason::UnknownGid);
                };
                let rid = m.sidr_request_id().unwrap_or(0);
                let peer = self.peers.acquire(src);
                if let Some(&s) = self.sidr_rcvd.get(&(peer, rid)) {
                    self.peers.release(peer);
                    if self.slab[s as usize].vm == vm {
                        self.rx_dup(vm, attr);
                        return Verdict::ToVm(VmId(vm));
                    }
                    self.retire(s, now);
                }
                self.peers.release(peer);
                if !self.legacy() && self.vms[vm as usize].live >= self.vms[vm as usize].quota {
                    return Verdict::Drop(DropReason::VmOverQuota);
                }
                let Some(s) = self.new_entry(vm, src) else {
                    return Verdict::Drop(DropReason::TableFull);
                };
                let e = &mut self.slab[s as usize];
                e.state = State::SidrReqRcvd;
                e.remote_comm_id = rid;
                let peer = e.peer;
                self.sidr_rcvd.insert((peer, rid), s);
                let t = self.clamp(self.cfg.sidr_timeout);
                self.set_deadline(s, Time(now).after(t).0);
                Verdict::ToVm(VmId(vm))
            }
            AttributeId::SidrRep => {
                let rid = m.sidr_request_id().unwrap_or(0);
                let slot = match self.lookup_pv(rid) {
                    Ok(s) if self.slab[s as usize].state == State::SidrReqSent => s,
                    Ok(_) => return Verdict::Drop(DropReason::BadState),
                    Err(r) => return Verdict::Drop(r),
                };
                let e = self.slab[slot as usize];
                let _ = m.set_sidr_request_id(e.sl_cm_id);
                if self.tids.kind_of(m.tid(), e.pv_cm_id) == Some(TidKind::Sidr) {
                    m.set_tid(e.vm_tid_req);
                }
                self.retire(slot, now);
                if self.vms.get(e.vm as usize).is_some_and(|v| v.attached) {
                    Verdict::ToVm(VmId(e.vm))
                } else {
                    Verdict::Drop(DropReason::Absorbed)
                }
            }
            AttributeId::ClassPortInfo => {
                if m.method() == Method::GetResp as u8 {
                    match self.gets.remove(&m.tid()) {
                        Some(p) if self.vms.get(p.vm as usize).is_some_and(|v| v.attached) => {
                            m.set_tid(p.vm_tid);
                            Verdict::ToVm(VmId(p.vm))
                        }
                        _ => Verdict::Drop(DropReason::NoRoute),
                    }
                } else {
                    match self.gid_to_vm.get(&dst) {
                        Some(&vm) => Verdict::ToVm(VmId(vm)),
                        None => Verdict::Drop(DropReason::UnknownGid),
                    }
                }
            }
            _ => {
                let slot = match self.wire_entry(m, dst) {
                    Ok(s) => s,
                    Err(r) => {
                        if attr == AttributeId::Dreq && !self.legacy() {
                            // Linux answers a DREQ for an unknown connection with a DREP
                            // (cm_issue_drep); do it here so the peer stops retrying.
                            self.host_drops.bump(r);
                            let tid = m.tid();
                            let (local, remote) = (
                                m.remote_comm_id().unwrap_or(0),
                                m.local_comm_id().unwrap_or(0),
                            );
                            write_cm_ids(m.as_bytes_mut(), AttributeId::Drep, tid, local, remote);
                            self.host_counters.bump(Group::TxMsgs, AttributeId::Drep);
                            return Verdict::Reply;
                        }
                        return Verdict::Drop(r);
                    }
                };
                self.wire_connected(slot, m, now)
            }
        }
    }

    fn wire_connected(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>, now: u64) -> Verdict {
        let attr = m.attr();
        let e = self.slab[slot as usize];
        let legacy = self.legacy();
        match attr {
            AttributeId::Rep => match e.state {
                State::ReqSent => {
                    let en = &mut self.slab[slot as usize];
                    en.state = State::RepRcvd;
                    en.remote_comm_id = m.local_comm_id().unwrap_or(0);
                    en.remote_ca_guid = m.local_ca_guid().unwrap_or(0);
                    en.remote_qpn = m.local_qpn().unwrap_or(0);
                    let (peer, guid) = (en.peer, en.remote_ca_guid);
                    self.peers.set_ca_guid(peer, guid);
                    if !legacy {
                        // The VM must RTU (or MRA/REJ) within its response window; the
                        // peer retries the REP meanwhile.
                        let w = self.window(e.vm_resp, e.ack, e.retries);
                        self.set_deadline(slot, Time(now).after(w).0);
                    }
                }
                State::RepRcvd | State::Established => self.rx_dup(e.vm, attr),
                _ if legacy => {}
                _ => return Verdict::Drop(DropReason::BadState),
            },
            AttributeId::Mra if !legacy && e.state.in_handshake() => {
                let svc = exponent_to_duration(m.mra_service_timeout().unwrap_or(0));
                let w = self.clamp(svc + self.window(e.peer_resp, e.ack, e.retries));
                self.extend_deadline(slot, now, w);
            }
            AttributeId::Rtu => match e.state {
                State::RepSent => self.establish(slot),
                State::Established => self.rx_dup(e.vm, attr),
                _ if legacy => {}
                _ => return Verdict::Drop(DropReason::BadState),
            },
            AttributeId::Rej => {
                let v = self.deliver(slot, m);
                if self.cfg.policy == Policy::Default
                    && e.has(flag::ACTIVE)
                    && matches!(e.state, State::ReqSent | State::RepRcvd)
                {
                    // The peer rejected the VM's REQ: keep the VM's comm ID mapped
                    // through the quarantine so that a REQ retry crossing this REJ is
                    // dropped, not sent as a second connection.
                    self.retire_entry(slot, now, true);
                } else {
                    self.connection_rejected(slot, now);
                }
                return v;
            }
            AttributeId::Dreq => match e.state {
                State::DreqRcvd | State::TimeWait => {
                    self.rx_dup(e.vm, attr);
                    if !legacy {
                        // A retry: the peer waits one more attempt after it.
                        let a = self.attempt(e.vm_resp, e.ack) + self.cfg.grace;
                        self.extend_deadline(slot, now, a);
                    }
                }
                State::DreqSent => {} // crossed DREQs
                _ => {
                    self.slab[slot as usize].state = State::DreqRcvd;
                    if legacy {
                        self.legacy_arm(slot, now);
                    } else {
                        // Never lose the entry before the VM answers or the peer's
                        // retries (max CM retries x the VM's response time) run out.
                        let w = self.window(e.vm_resp, e.ack, e.retries);
                        self.set_deadline(slot, Time(now).after(w).0);
                    }
                }
            },
            AttributeId::Drep => match e.state {
                State::DreqSent | State::DreqRcvd => {
                    let v = self.deliver(slot, m);
                    match self.cfg.policy {
                        Policy::Default => self.enter_timewait(slot, now),
                        Policy::Mlx4Pre2020 => self.retire(slot, now),
                        Policy::Mlx4Post2020 => {}
                    }
                    return v;
                }
                State::TimeWait => self.rx_dup(e.vm, attr),
                _ if legacy => {}
                _ => return Verdict::Drop(DropReason::BadState),
            },
            _ => {} // LAP, APR: route only
        }
        self.deliver(slot, m)
    }

    fn wire_req(&mut self, m: &mut CmMad<&mut [u8]>, src: Gid, now: u64) -> Verdict {
        let Some(gid) = m.req_primary_remote_gid() else {
            return Verdict::Drop(DropReason::Malformed);
        };
        let Some(&vm) = self.gid_to_vm.get(&gid) else {
            return Verdict::Drop(DropReason::UnknownGid);
        };
        let p = req::Packet::new_unchecked(m.as_bytes());
        let key = RejTimeoutKey {
            ca_guid: p.local_ca_guid(),
            comm_id: p.local_comm_id(),
        };
        if self.legacy() {
            if self.cfg.policy == Policy::Mlx4Post2020 {
                // mlx4 keys the REJ(TIMEOUT) map by the peer's comm ID alone.
                let exp = Time(now).after(Duration::from_secs(30)).0;
                self.legacy_rej.insert(key.comm_id, (vm, exp));
            }
            return Verdict::ToVm(VmId(vm));
        }
        if let Some(&s) = self.remote_map.get(&key) {
            let e = self.slab[s as usize];
            if e.vm == vm && !e.has(flag::ORPHAN) {
                // Duplicate REQ: refresh, and let the VM's CM decide (MRA again,
                // REJ STALE_CONN, or ignore).
                self.rx_dup(vm, AttributeId::Req);
                let w = self.window(e.peer_resp, e.ack, e.retries);
                self.extend_deadline(s, now, w);
                return Verdict::ToVm(VmId(vm));
            }
            // The peer reuses (CA GUID, comm ID) towards another VM: the old attempt is over.
            self.retire(s, now);
        }
        if self.vms[vm as usize].live >= self.vms[vm as usize].quota {
            let tid = m.tid();
            write_rej(
                m.as_bytes_mut(),
                tid,
                0,
                key.comm_id,
                MsgResponse::Req,
                RejReason::NoResources,
                &[],
            );
            self.host_counters.bump(Group::TxMsgs, AttributeId::Rej);
            self.vms[vm as usize].drops.bump(DropReason::VmOverQuota);
            return Verdict::Reply;
        }
        let Some(s) = self.new_entry(vm, src) else {
            return Verdict::Drop(DropReason::TableFull);
        };
        let path = p.primary_path();
        let e = &mut self.slab[s as usize];
        e.state = State::ReqRcvd;
        e.remote_comm_id = key.comm_id;
        e.remote_ca_guid = key.ca_guid;
        e.remote_qpn = p.local_qpn();
        e.vm_tid_req = p.header().tid(); // the peer's TID, echoed by the VM's answers
        // The passive VM answers within the REQ's Remote CM Response Timeout; the peer
        // answers it within its Local CM Response Timeout.
        e.vm_resp = p.remote_cm_response_timeout();
        e.peer_resp = p.local_cm_response_timeout();
        e.ack = path.local_ack_timeout;
        e.retries = p.max_cm_retries();
        e.flags |= flag::IN_REMOTE_MAP;
        let peer = e.peer;
        let en = *e;
        self.peers.set_ca_guid(peer, key.ca_guid);
        self.remote_map.insert(key, s);
        // If the VM never answers, the peer gives up after its REQ retries.
        let w = self.window(en.vm_resp, en.ack, en.retries);
        self.set_deadline(s, Time(now).after(w).0);
        Verdict::ToVm(VmId(vm))
    }

    fn wire_rej_timeout(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        src: Gid,
        dst: Gid,
        now: u64,
    ) -> Verdict {
        let comm_id = m.local_comm_id().unwrap_or(0);
        match self.cfg.policy {
            Policy::Mlx4Pre2020 => Verdict::Drop(DropReason::NoRoute),
            Policy::Mlx4Post2020 => match self.legacy_rej.get(&comm_id) {
                Some(&(vm, exp)) if exp > now => match self.vms.get(vm as usize) {
                    Some(v) if v.attached => Verdict::ToVm(VmId(vm)),
                    _ => Verdict::Drop(DropReason::Absorbed),
                },
                _ => Verdict::Drop(DropReason::NoRoute),
            },
            Policy::Default => {
                let Some(ca_guid) = m.rej_timeout_ca_guid() else {
                    return Verdict::Drop(DropReason::NoRoute);
                };
                let key = RejTimeoutKey { ca_guid, comm_id };
                let Some(&s) = self.remote_map.get(&key) else {
                    return Verdict::Drop(DropReason::NoRoute);
                };
                let e = self.slab[s as usize];
                // Only the port that sent the REQ may withdraw it, and only towards the
                // VM it asked: otherwise any host could cancel another peer's pending
                // connection by naming its CA GUID.
                if self.peers.get(e.peer).is_some_and(|p| p.gid != src) {
                    return Verdict::Drop(DropReason::WrongSource);
                }
                if !e.has(flag::ORPHAN)
                    && self
                        .vms
                        .get(e.vm as usize)
                        .is_some_and(|v| v.cfg.gid != dst)
                {
                    return Verdict::Drop(DropReason::WrongDestination);
                }
                self.retire(s, now);
                if e.has(flag::ORPHAN) {
                    return Verdict::Drop(DropReason::Absorbed);
                }
                Verdict::ToVm(VmId(e.vm))
            }
        }
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
            live: u64::from(v.live),
            quarantined: u64::from(v.quarantined),
        }
    }

    /// Figures of the whole host: every VM's plus the proxy's own.
    pub fn host_stats(&self) -> Stats {
        let mut s = Stats {
            counters: self.host_counters,
            drops: self.host_drops,
            live: self.live,
            quarantined: self.quarantined,
        };
        for v in &self.vms {
            s.counters += &v.counters;
            s.drops += &v.drops;
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
        let raw = self.perm.invert(pv_cm_id);
        let slot = raw & ((1u32 << self.slot_bits) - 1);
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
            + map(
                self.remote_map.capacity(),
                size_of::<(RejTimeoutKey, u32)>(),
            )
            + map(self.sidr_rcvd.capacity(), 12)
            + map(self.legacy_rej.capacity(), 16)
            + self.peers.slots.capacity() * size_of::<Peer>()
            + map(self.peers.index.capacity(), 20);
        for v in &self.vms {
            b += map(v.sl_map.capacity(), 8);
        }
        b
    }
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

//! The entry table: one slab of fixed-size entries, `pv_cm_id` allocation (slot +
//! generation through the keyed permutation), the timers (lazy-deletion heap),
//! quarantine, and the lifetime transitions every handler shares (retire, establish,
//! TimeWait, expiry).

use std::cmp::Reverse;
use std::time::Duration;

use pvcm_wire::Gid;
use pvcm_wire::mad::AttributeId;
use pvcm_wire::timeout::exponent_to_duration;

use super::{Clock, DropReason, Group, ID_RANGE_BIT, Mux, Time, permute_bits};

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

pub(super) const NO_VM: u32 = u32::MAX;
pub(super) const NO_PEER: u32 = u32::MAX;

/// Flag bits of an entry.
pub(super) mod flag {
    /// The VM started the connection.
    pub const ACTIVE: u8 = 1;
    /// Indexed in its VM's comm-ID map.
    pub const IN_SL_MAP: u8 = 2;
    /// Indexed by its sender's comm ID and CA GUID (`remote.rs`).
    pub const IN_REMOTE_IDS: u8 = 4;
    /// Legacy policies: the delayed-delete timer is armed.
    pub const LEGACY_TIMER: u8 = 8;
    /// Its VM detached; the proxy finishes the connection on its behalf.
    pub const ORPHAN: u8 = 16;
    /// Changed since the journal last took the changes (never persisted itself).
    pub const DIRTY: u8 = 32;
}

/// One connection (or SIDR exchange). 64 bytes, one cache line (asserted below).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(align(64))] // one cache line per entry: a wire-side lookup touches one line
pub(super) struct Entry {
    /// The VM's own comm ID (0 until the passive VM answers).
    pub(super) sl_cm_id: u32,
    /// The host-unique ID on the wire (0 until assigned).
    pub(super) pv_cm_id: u32,
    /// The peer's comm ID (0 until known).
    pub(super) remote_comm_id: u32,
    /// Index in the peer table (the peer's GID and CA GUID).
    pub(super) peer: u32,
    /// The peer's CA GUID (0 until known).
    pub(super) remote_ca_guid: u64,
    /// When the mux next has to act on this entry (`u64::MAX`: never).
    pub(super) deadline: u64,
    /// TID of the VM's REQ or SIDR_REQ, restored on replies.
    pub(super) vm_tid_req: u64,
    /// TID of the VM's latest DREQ or LAP, restored on replies.
    pub(super) vm_tid_other: u64,
    /// Owning VM (`NO_VM` for none).
    pub(super) vm: u32,
    /// The peer's QPN (named in DREQs).
    pub(super) remote_qpn: u32,
    /// Slot generation: part of `pv_cm_id`, bumped at each reuse of the slot.
    pub(super) generation: u16,
    pub(super) state: State,
    pub(super) flags: u8,
    /// CM response timeout of the VM (5-bit exponent): how long the peer waits for it.
    pub(super) vm_resp: u8,
    /// CM response timeout of the peer: how long the VM waits for it.
    pub(super) peer_resp: u8,
    /// Local ACK timeout of the primary path (~2 x packet lifetime), 5-bit exponent.
    pub(super) ack: u8,
    /// Max CM retries from the REQ; for orphans, DREQ attempts left.
    pub(super) retries: u8,
}

// A wire-side lookup touches one cache line: keep the entry at 64 bytes.
const _: () = assert!(std::mem::size_of::<Entry>() == 64);

impl Entry {
    pub(super) const FREE: Entry = Entry {
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

    pub(super) fn has(&self, f: u8) -> bool {
        self.flags & f != 0
    }
}

impl<C: Clock> Mux<C> {
    /// The entry in `slot`, for writing: every write goes through here, so that with the
    /// journal on (`Mux::enable_journal`) each changed slot is noted once.
    #[inline]
    pub(super) fn ent(&mut self, slot: u32) -> &mut Entry {
        let e = &mut self.slab[slot as usize];
        if let Some(c) = &mut self.changes
            && e.flags & flag::DIRTY == 0
        {
            e.flags |= flag::DIRTY;
            c.slots.push(slot);
        }
        e
    }

    pub(super) fn alloc_slot(&mut self) -> Option<u32> {
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
        *self.ent(slot) = Entry {
            generation,
            ..Entry::FREE
        };
        self.live += 1;
        Some(slot)
    }

    /// Gives the entry its `pv_cm_id`: the next free ID of its VM's range if the VM has
    /// one, otherwise slot + generation through the permutation, in the lower half.
    pub(super) fn assign_pv(&mut self, slot: u32) -> u32 {
        if let Some(pv) = self.assign_ranged(slot) {
            return pv;
        }
        let (bits, mask, perm) = (self.slot_bits, self.generation_mask, self.perm);
        let e = self.ent(slot);
        let old_generation = e.generation;
        let mut pv = 0;
        for _ in 0..=u32::from(mask) {
            let candidate = perm.apply((u32::from(e.generation) << bits) | slot);
            // 0 means "no comm ID" on the wire, and the upper half belongs to the VMs'
            // own ranges: skip such generations.
            if candidate != 0 && candidate & ID_RANGE_BIT == 0 {
                pv = candidate;
                break;
            }
            e.generation = (e.generation + 1) & mask;
        }
        if pv == 0 {
            // Every generation of this slot lands in the upper half (a tiny generation
            // space): take one anyway. Lookups of upper-half IDs fall back to the
            // permutation, and an import refuses a range ID that collides with it.
            pv = perm.apply((u32::from(e.generation) << bits) | slot).max(1);
        }
        e.pv_cm_id = pv;
        let (generation, deadline) = (e.generation, e.deadline);
        // A passive entry gets its ID late (at its REP) and may have a timer already:
        // timers name the generation, so re-arm it under the new one.
        if generation != old_generation && deadline != u64::MAX {
            self.timers.push(Reverse((deadline, slot, generation)));
        }
        pv
    }

    /// A range VM's entry: draws the next ID of its range not in use. The VM's quota
    /// check (`Mux::vm_full`) keeps one free, so the walk ends.
    fn assign_ranged(&mut self, slot: u32) -> Option<u32> {
        let vm = self.slab[slot as usize].vm;
        let v = self.vms.get(vm as usize)?;
        let r = v.cfg.id_range?;
        let (mask, bits, key) = (r.suffix_mask(), r.suffix_bits(), v.tids_key());
        let mut next = v.next_id;
        for _ in 0..=u64::from(mask) {
            let c = next & mask;
            next = next.wrapping_add(1) & mask;
            let pv = r.base | permute_bits(c, bits, key);
            if !self.ranged.contains_key(&pv) && self.slot_by_permutation(pv).is_none() {
                self.vms[vm as usize].next_id = next;
                if let Some(ch) = &mut self.changes {
                    ch.vms.push(vm);
                }
                self.ranged.insert(pv, slot);
                self.ent(slot).pv_cm_id = pv;
                return Some(pv);
            }
        }
        None
    }

    /// The slot whose entry holds `pv` through the permutation (host-space IDs).
    fn slot_by_permutation(&self, pv: u32) -> Option<u32> {
        let raw = self.perm.invert(pv);
        let slot = raw & ((1u32 << self.slot_bits) - 1);
        let e = self.slab.get(slot as usize)?;
        (e.pv_cm_id == pv && e.state != State::Free).then_some(slot)
    }

    /// The slot whose entry holds `pv` (any state but Free).
    pub(super) fn slot_named(&self, pv: u32) -> Option<u32> {
        if pv == 0 {
            return None;
        }
        if pv & ID_RANGE_BIT != 0
            && let Some(&s) = self.ranged.get(&pv)
        {
            return Some(s);
        }
        self.slot_by_permutation(pv)
    }

    /// The slot a wire-side `pv_cm_id` names.
    pub(super) fn lookup_pv(&self, pv: u32) -> Result<u32, DropReason> {
        let slot = self.slot_named(pv).ok_or(DropReason::NoRoute)?;
        match self.slab[slot as usize].state {
            State::Free => Err(DropReason::NoRoute),
            State::Quarantined => Err(DropReason::Quarantined),
            _ => Ok(slot),
        }
    }

    /// Whether `vm` may not take another entry: at its quota of live entries, or (with
    /// an ID range) with no ID of its range left free.
    pub(super) fn vm_full(&self, vm: u32) -> bool {
        let v = &self.vms[vm as usize];
        v.live >= v.quota
            || v.cfg
                .id_range
                .is_some_and(|r| u64::from(v.live) + u64::from(v.quarantined) >= r.size())
    }

    pub(super) fn set_deadline(&mut self, slot: u32, deadline: u64) {
        if self.slab[slot as usize].deadline == deadline {
            return; // already queued
        }
        let e = self.ent(slot);
        e.deadline = deadline;
        let generation = e.generation;
        if deadline != u64::MAX {
            self.timers.push(Reverse((deadline, slot, generation)));
            // Lazy deletion leaves stale timers behind; compact when they dominate. The
            // floor keeps compaction amortized O(1) per timer.
            if self.timers.len() >= self.timer_budget() {
                self.compact_timers();
            }
        }
    }

    /// Extends (never shortens) the entry's deadline to `now + d`.
    pub(super) fn extend_deadline(&mut self, slot: u32, now: u64, d: Duration) {
        let t = Time(now).after(d).0;
        let e = self.slab[slot as usize];
        if e.deadline == u64::MAX || t > e.deadline {
            self.set_deadline(slot, t);
        }
    }

    pub(super) fn compact_timers(&mut self) {
        let slab = &self.slab;
        self.timers.retain(|Reverse((t, s, g))| {
            slab.get(*s as usize).is_some_and(|e| {
                e.generation == *g
                    && e.deadline == *t
                    && e.state != State::Free
                    && e.state != State::Quarantined
            })
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
    pub(super) fn timer_budget(&self) -> usize {
        self.live as usize + self.timers_after_compaction.max(512)
    }

    /// Called when an entry is created (the only place the mux may allocate): makes room
    /// for everything that entry can later need, so MADs of existing entries never
    /// allocate: its timers, its quarantine slot, its VM's comm-ID map slot.
    pub(super) fn reserve_for_entry(&mut self, vm: u32) {
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
    pub(super) fn clamp(&self, d: Duration) -> Duration {
        d.min(self.cfg.max_wait)
    }

    /// One attempt of a CM exchange: response timeout + local ACK timeout (~2 x packet
    /// lifetime), as the Linux CM's `timeout_ms`.
    pub(super) fn attempt(&self, resp: u8, ack: u8) -> Duration {
        self.clamp(exponent_to_duration(resp) + exponent_to_duration(ack))
    }

    /// The whole window a side may keep retrying: (retries + 1) attempts, plus grace.
    pub(super) fn window(&self, resp: u8, ack: u8, retries: u8) -> Duration {
        let one = exponent_to_duration(resp) + exponent_to_duration(ack);
        self.clamp(one * (u32::from(retries) + 1) + self.cfg.grace)
    }

    pub(super) fn timewait(&self, e: &Entry) -> Duration {
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
            if e.generation != generation
                || e.deadline != t
                || e.state == State::Free
                || e.state == State::Quarantined
            {
                continue; // stale timer (a quarantined entry's deadline is its release)
            }
            self.ent(slot).deadline = u64::MAX;
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

    pub(super) fn expire(&mut self, slot: u32, now: u64) {
        let e = self.slab[slot as usize];
        if !self.policy().protocol_deadlines() {
            // mlx4's delayed work: delete, no quarantine.
            self.retire(slot, now);
            return;
        }
        match e.state {
            State::DreqSent if e.has(flag::ORPHAN) && e.retries > 0 => {
                self.ent(slot).retries -= 1;
                let dst = self.peers.get(e.peer).map(|p| p.gid);
                let vm = self.vms.get(e.vm as usize);
                if let (Some(v), Some(dst)) = (vm, dst) {
                    let src = v.cfg.source_for(dst);
                    self.send_dreq_on_behalf(slot, src, dst);
                    self.host_counters.bump(Group::TxRetries, AttributeId::Dreq);
                }
                let t = self.attempt(e.peer_resp, e.ack);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            State::DreqSent | State::DreqRcvd => {
                // Both sides' DREQ windows are closed: the CMs are in TimeWait.
                self.ent(slot).state = State::TimeWait;
                let t = self.timewait(&e);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            _ => self.retire(slot, now),
        }
    }

    /// Ends an entry: unindexes it, then quarantines its `pv_cm_id` (default policy) or
    /// frees it at once (legacy).
    pub(super) fn retire(&mut self, slot: u32, now: u64) {
        self.retire_entry(slot, now, false);
    }

    /// [`Mux::retire`], but an entry going into quarantine stays in its VM's comm-ID map
    /// (when `keep_sl`), so that a REQ retry crossing the peer's REJ is recognised and
    /// dropped (see `req_retry`). Lookups by comm ID skip quarantined entries; the
    /// mapping goes when the slot is freed or the VM reuses the comm ID.
    pub(super) fn retire_entry(&mut self, slot: u32, now: u64, keep_sl: bool) {
        let e = self.slab[slot as usize];
        if e.state == State::Free || e.state == State::Quarantined {
            return;
        }
        let quarantine = e.pv_cm_id != 0 && self.policy().quarantine();
        self.unindex(slot, keep_sl && quarantine);
        if let Some(v) = self.vms.get_mut(e.vm as usize)
            && !e.has(flag::ORPHAN)
        {
            v.live = v.live.saturating_sub(1);
        }
        if quarantine {
            let release = Time(now).after(self.cfg.quarantine).0;
            let en = self.ent(slot);
            en.state = State::Quarantined;
            // No timer: the quarantine queue releases it. The deadline keeps the release
            // time so that a restored table can rebuild that queue.
            en.deadline = release;
            self.live -= 1;
            self.quarantined += 1;
            if let Some(v) = self.vms.get_mut(e.vm as usize) {
                v.quarantined += 1;
            }
            self.quarantine.push_back((release, slot));
        } else {
            self.live -= 1;
            self.free_slot(slot);
        }
    }

    /// Removes the entry from every map (but its VM's comm-ID map if `keep_sl`).
    pub(super) fn unindex(&mut self, slot: u32, keep_sl: bool) {
        if !keep_sl {
            self.unindex_sl(slot);
        }
        let e = self.slab[slot as usize];
        if e.state == State::SidrReqRcvd {
            let k = (e.peer, e.remote_comm_id);
            if self.sidr_rcvd.get(&k) == Some(&slot) {
                self.sidr_rcvd.remove(&k);
            }
        }
        self.unindex_remote(slot);
    }

    /// Removes the entry from its VM's comm-ID map (if the comm ID still names it).
    pub(super) fn unindex_sl(&mut self, slot: u32) {
        let e = self.slab[slot as usize];
        if e.has(flag::IN_SL_MAP)
            && let Some(v) = self.vms.get_mut(e.vm as usize)
            && v.sl_map.get(&e.sl_cm_id) == Some(&slot)
        {
            v.sl_map.remove(&e.sl_cm_id);
        }
        self.ent(slot).flags &= !flag::IN_SL_MAP;
    }

    pub(super) fn free_slot(&mut self, slot: u32) {
        self.unindex_sl(slot);
        let e = self.slab[slot as usize];
        if e.pv_cm_id & ID_RANGE_BIT != 0 && self.ranged.get(&e.pv_cm_id) == Some(&slot) {
            self.ranged.remove(&e.pv_cm_id);
        }
        if e.peer != NO_PEER {
            self.peers.release(e.peer);
        }
        *self.ent(slot) = Entry {
            generation: (e.generation + 1) & self.generation_mask,
            ..Entry::FREE
        };
        self.free.push_back(slot);
    }

    // ----------------------------------------------------------------------------------

    pub(super) fn new_entry(&mut self, vm: u32, peer_gid: Gid) -> Option<u32> {
        let slot = self.alloc_slot()?;
        let peer = self.peers.acquire(peer_gid);
        let e = self.ent(slot);
        e.vm = vm;
        e.peer = peer;
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.live += 1;
        }
        self.reserve_for_entry(vm);
        Some(slot)
    }

    pub(super) fn index_sl(&mut self, vm: u32, sl: u32, slot: u32) {
        // The flag says "the map names this slot": a slot the comm ID named before
        // (a quarantined one) loses it, so a restored table maps the same slots.
        if let Some(old) = self.vms[vm as usize].sl_map.insert(sl, slot)
            && old != slot
        {
            self.ent(old).flags &= !flag::IN_SL_MAP;
        }
        self.ent(slot).flags |= flag::IN_SL_MAP;
    }

    /// The connection is established (an RTU passed): it has no deadline while its VM
    /// is attached, and the REJ(TIMEOUT) lookup forgets it, since the peer got our REP
    /// and names our comm ID in anything it sends.
    pub(super) fn establish(&mut self, slot: u32) {
        let e = self.ent(slot);
        e.state = State::Established;
        e.deadline = u64::MAX;
        self.unindex_remote(slot);
    }

    pub(super) fn enter_timewait(&mut self, slot: u32, now: u64) {
        let e = self.slab[slot as usize];
        self.ent(slot).state = State::TimeWait;
        // Route the peer's DREQ retries if our DREP is lost: one more attempt of its
        // (each retry extends this), then the CM TimeWait. A retry arriving later still
        // gets a stateless DREP from `wire_mad`.
        let t = self.attempt(e.vm_resp.max(e.peer_resp), e.ack) + self.timewait(&e);
        self.set_deadline(slot, Time(now).after(self.clamp(t)).0);
    }
}

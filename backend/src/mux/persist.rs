//! The mux's state as records, for the daemon's state journal (`crate::state`).
//!
//! With the journal on ([`Mux::enable_journal`]), every write to an entry goes through
//! `Mux::ent`, which notes the slot; new and changed peers and VM attach/detach are
//! noted too. [`Mux::journal_changes`] turns what changed into records (each the whole
//! new value: a 64-byte entry, a peer, a VM), and [`Mux::journal_snapshot`] writes every
//! record of the current state. Replaying a snapshot and then the changes, in order,
//! with the last record of each slot/peer/VM winning, gives back the same table:
//! [`Mux::restore`] does that and then rebuilds every index from the entries (the
//! comm-ID maps, the REJ(TIMEOUT) map, SIDR, peer reference counts, the timers, the
//! quarantine queue and the free list), so only the entries themselves are stored.
//!
//! Times are the mux clock's; the daemon's clock is CLOCK_MONOTONIC, so deadlines stay
//! valid across a restart of the process (not a reboot: the journal records the boot).
//!
//! Record layout: `kind: u8`, `len: u16` (LE), then `len` bytes of payload, all integers
//! little-endian. Kinds below [`FIRST_FOREIGN_KIND`] are the mux's; [`Mux::restore`]
//! skips the others (the daemon's own records share the stream).

use std::cmp::Reverse;

use pvcm_wire::Gid;

use super::peers::Peer;
use super::table::{Entry, NO_PEER, NO_VM, State, flag};
use super::{Clock, FastMap, ID_RANGE_BIT, IdRange, Mux, MuxConfig, Vm, VmConfig, VmId};

/// What changed since the journal last took the changes.
#[derive(Debug, Default)]
pub(super) struct Changes {
    pub(super) slots: Vec<u32>,
    pub(super) vms: Vec<u32>,
    /// A ClassPortInfo Get took a host TID.
    pub(super) next_get: bool,
}

pub(super) const REC_VM: u8 = 1;
const REC_PEER: u8 = 2;
const REC_SLOT: u8 = 3;
/// The next ClassPortInfo Get number (host TIDs of Gets are never handed out twice).
const REC_NEXT_GET: u8 = 4;
/// Record kinds from here on are not the mux's: [`Mux::restore`] skips them.
pub const FIRST_FOREIGN_KIND: u8 = 0x40;

pub(super) const SLOT_LEN: usize = 4 + 64;

/// Why a journal could not be restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RestoreError {
    /// A record is malformed (its checksum was good, so this is not a torn write).
    #[error("record {index}: {why}")]
    Corrupt {
        /// Index of the record in the stream.
        index: usize,
        /// What is wrong.
        why: String,
    },
    /// The records parse, but do not make one consistent table.
    #[error("record {records}: {source}")]
    Inconsistent {
        /// Records applied.
        records: usize,
        /// What does not fit.
        #[source]
        source: Inconsistency,
    },
    /// The mlx4 comparison policies keep timers outside the entries; they are not
    /// persisted.
    #[error("the {0} policy keeps no restorable state: use --policy default")]
    Policy(&'static str),
}

/// Why restored records do not make one consistent table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Inconsistency {
    /// Two attached VMs have the same GID.
    #[error("VMs {first} and {second} share GID {gid}")]
    SharedGid {
        /// The VM recorded first.
        first: u32,
        /// The other.
        second: u32,
        /// Their GID.
        gid: Gid,
    },
    /// An entry names a peer that no record made.
    #[error("slot {0} names a peer never recorded")]
    UnknownPeer(u32),
    /// An entry names a VM that no record made.
    #[error("slot {0} names a VM never recorded")]
    UnknownVm(u32),
    /// Two entries hold the same ranged `pv_cm_id`.
    #[error("two entries hold pv_cm_id {0:#x}")]
    SharedId(u32),
}

/// The first difference [`Mux::same_state_as`] found between two muxes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {ours} != {theirs}")]
pub struct StateDifference {
    /// What differs (`slot 7`, `live`, `free slots`).
    pub what: String,
    /// This mux's value.
    pub ours: String,
    /// The other's.
    pub theirs: String,
}

/// A mux rebuilt from records.
#[derive(Debug)]
pub struct Restored<C: Clock> {
    /// The mux, with the journal off.
    pub mux: Mux<C>,
    /// The VMs that were attached, by ID: the daemon gives each back to its port.
    pub attached: Vec<(VmId, VmConfig)>,
    /// Records applied.
    pub records: usize,
}

/// Appends one record.
pub fn put_record(out: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    put_record_parts(out, kind, &[payload]);
}

/// Appends one record whose payload is `parts` one after the other (no temporary
/// buffer). A payload over 64 KiB is cut at 64 KiB.
pub fn put_record_parts(out: &mut Vec<u8>, kind: u8, parts: &[&[u8]]) {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut left = usize::from(u16::try_from(total).unwrap_or(u16::MAX));
    out.push(kind);
    out.extend_from_slice(&(left as u16).to_le_bytes());
    for p in parts {
        let n = p.len().min(left);
        out.extend_from_slice(&p[..n]);
        left -= n;
    }
}

/// The records of a buffer: `(kind, payload)`, or an error at the first truncated one.
pub fn records(buf: &[u8]) -> impl Iterator<Item = Result<(u8, &[u8]), usize>> {
    let mut at = 0usize;
    let mut index = 0usize;
    std::iter::from_fn(move || {
        if at >= buf.len() {
            return None;
        }
        let r = match buf.get(at..at + 3) {
            Some(h) => {
                let len = usize::from(u16::from_le_bytes([h[1], h[2]]));
                match buf.get(at + 3..at + 3 + len) {
                    Some(p) => {
                        at += 3 + len;
                        Ok((h[0], p))
                    }
                    None => Err(index),
                }
            }
            None => Err(index),
        };
        if r.is_err() {
            at = buf.len();
        }
        index += 1;
        Some(r)
    })
}

/// Little-endian reader over a record's payload.
pub(super) struct Rd<'a>(pub(super) &'a [u8]);

impl Rd<'_> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (h, t) = self.0.split_at_checked(N)?;
        self.0 = t;
        h.try_into().ok()
    }
    pub(super) fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    pub(super) fn u16(&mut self) -> Option<u16> {
        self.take().map(u16::from_le_bytes)
    }
    pub(super) fn u32(&mut self) -> Option<u32> {
        self.take().map(u32::from_le_bytes)
    }
    pub(super) fn u64(&mut self) -> Option<u64> {
        self.take().map(u64::from_le_bytes)
    }
    pub(super) fn gid(&mut self) -> Option<Gid> {
        self.take::<16>().map(Gid)
    }
}

fn encode_entry(slot: u32, e: &Entry, out: &mut Vec<u8>) {
    let (b, w) = entry_payload(slot, e);
    put_record(out, REC_SLOT, &b[..w]);
}

/// An entry record's payload (and its length).
pub(super) fn entry_payload(slot: u32, e: &Entry) -> ([u8; SLOT_LEN], usize) {
    let mut b = [0u8; SLOT_LEN];
    let mut w = 0;
    let mut put = |x: &[u8]| {
        b[w..w + x.len()].copy_from_slice(x);
        w += x.len();
    };
    put(&slot.to_le_bytes());
    put(&e.sl_cm_id.to_le_bytes());
    put(&e.pv_cm_id.to_le_bytes());
    put(&e.remote_comm_id.to_le_bytes());
    put(&e.peer.to_le_bytes());
    put(&e.remote_ca_guid.to_le_bytes());
    put(&e.deadline.to_le_bytes());
    put(&e.vm_tid_req.to_le_bytes());
    put(&e.vm_tid_other.to_le_bytes());
    put(&e.vm.to_le_bytes());
    put(&e.remote_qpn.to_le_bytes());
    put(&e.generation.to_le_bytes());
    let state = State::ALL.iter().position(|s| *s == e.state).unwrap_or(0) as u8;
    put(&[
        state,
        e.flags & !flag::DIRTY,
        e.vm_resp,
        e.peer_resp,
        e.ack,
        e.retries,
    ]);
    (b, w)
}

pub(super) fn decode_entry(p: &[u8]) -> Option<(u32, Entry)> {
    let mut r = Rd(p);
    let slot = r.u32()?;
    let e = Entry {
        sl_cm_id: r.u32()?,
        pv_cm_id: r.u32()?,
        remote_comm_id: r.u32()?,
        peer: r.u32()?,
        remote_ca_guid: r.u64()?,
        deadline: r.u64()?,
        vm_tid_req: r.u64()?,
        vm_tid_other: r.u64()?,
        vm: r.u32()?,
        remote_qpn: r.u32()?,
        generation: r.u16()?,
        state: *State::ALL.get(usize::from(r.u8()?))?,
        flags: r.u8()? & !flag::DIRTY,
        vm_resp: r.u8()?,
        peer_resp: r.u8()?,
        ack: r.u8()?,
        retries: r.u8()?,
    };
    Some((slot, e))
}

fn encode_peer(i: u32, p: &Peer, out: &mut Vec<u8>) {
    put_record_parts(
        out,
        REC_PEER,
        &[&i.to_le_bytes(), &p.gid.0, &p.ca_guid.to_le_bytes()],
    );
}

pub(super) fn encode_vm(id: u32, v: &Vm, out: &mut Vec<u8>) {
    let c = &v.cfg;
    let mut b = Vec::with_capacity(48 + c.name.len());
    b.extend_from_slice(&id.to_le_bytes());
    b.push(u8::from(v.attached));
    b.extend_from_slice(&c.gid.0);
    b.extend_from_slice(&c.ca_guid.to_le_bytes());
    b.extend_from_slice(&c.qpn_base.to_le_bytes());
    b.extend_from_slice(&c.qpn_count.to_le_bytes());
    b.extend_from_slice(&c.quota.unwrap_or(u32::MAX).to_le_bytes());
    let name = &c.name.as_bytes()[..c.name.len().min(1024)];
    b.extend_from_slice(&(name.len() as u16).to_le_bytes());
    b.extend_from_slice(name);
    // Appended later (older records end at the name): the ID range and its counter.
    let (base, len) = c.id_range.map_or((0, 0), |r| (r.base, r.prefix_len));
    b.extend_from_slice(&base.to_le_bytes());
    b.push(len);
    b.extend_from_slice(&v.next_id.to_le_bytes());
    // Appended later (older records end at the counter): the further GIDs, a count and
    // 16 bytes each.
    b.push(c.more_gids.len() as u8);
    for g in &c.more_gids {
        b.extend_from_slice(&g.0);
    }
    put_record(out, REC_VM, &b);
}

pub(super) fn decode_vm(p: &[u8]) -> Option<(u32, bool, VmConfig, u32)> {
    let mut r = Rd(p);
    let id = r.u32()?;
    let attached = r.u8()? != 0;
    let gid = r.gid()?;
    let ca_guid = r.u64()?;
    let qpn_base = r.u32()?;
    let qpn_count = r.u32()?;
    let quota = Some(r.u32()?).filter(|&q| q != u32::MAX);
    let n = usize::from(r.u16()?);
    let name = String::from_utf8_lossy(r.0.get(..n)?).into_owned();
    r.0 = &r.0[n..];
    let (mut id_range, mut next_id) = (None, 0);
    if !r.0.is_empty() {
        let (base, len) = (r.u32()?, r.u8()?);
        if len != 0 {
            id_range = Some(IdRange::new(base, len).ok()?);
        }
        next_id = r.u32()?;
    }
    let mut more_gids = Vec::new();
    if !r.0.is_empty() {
        let n = usize::from(r.u8()?);
        if n >= super::MAX_GIDS {
            return None;
        }
        for _ in 0..n {
            more_gids.push(r.gid()?);
        }
    }
    Some((
        id,
        attached,
        VmConfig {
            name,
            gid,
            more_gids,
            ca_guid,
            qpn_base,
            qpn_count,
            quota,
            id_range,
        },
        next_id,
    ))
}

impl<C: Clock> Mux<C> {
    /// Turns change tracking on (the daemon does this once its journal holds a snapshot).
    pub fn enable_journal(&mut self) {
        if self.changes.is_none() {
            self.changes = Some(Changes::default());
            self.peers.dirty = Some(Vec::new());
        }
    }

    /// Appends the records of everything that changed since the last call (peers, then
    /// VMs, then entries) and forgets the changes. Returns how many records it wrote.
    pub fn journal_changes(&mut self, out: &mut Vec<u8>) -> usize {
        let Some(c) = &mut self.changes else {
            return 0;
        };
        let mut n = 0;
        if let Some(d) = &mut self.peers.dirty
            && !d.is_empty()
        {
            d.sort_unstable();
            d.dedup();
            for &i in d.iter() {
                if let Some(p) = self.peers.slots.get(i as usize) {
                    encode_peer(i, p, out);
                    n += 1;
                }
            }
            d.clear();
        }
        if !c.vms.is_empty() {
            c.vms.sort_unstable();
            c.vms.dedup();
            for &id in &c.vms {
                if let Some(v) = self.vms.get(id as usize) {
                    encode_vm(id, v, out);
                    n += 1;
                }
            }
            c.vms.clear();
        }
        if c.next_get {
            c.next_get = false;
            put_record(out, REC_NEXT_GET, &self.next_get.to_le_bytes());
            n += 1;
        }
        if !c.slots.is_empty() {
            // Overwrites of a whole entry drop its DIRTY bit, so a slot can be listed
            // twice: one record each is enough.
            if c.slots.len() > 1 {
                c.slots.sort_unstable();
                c.slots.dedup();
            }
            for &s in &c.slots {
                if let Some(e) = self.slab.get_mut(s as usize) {
                    e.flags &= !flag::DIRTY;
                    encode_entry(s, e, out);
                    n += 1;
                }
            }
            c.slots.clear();
        }
        n
    }

    /// Appends the records of the whole state: every VM, every referenced peer, every
    /// slot that is in use or has been (its generation matters for the next ID).
    pub fn journal_snapshot(&self, out: &mut Vec<u8>) -> usize {
        let mut n = 0;
        for (id, v) in self.vms.iter().enumerate() {
            encode_vm(id as u32, v, out);
            n += 1;
        }
        for (i, p) in self.peers.slots.iter().enumerate() {
            if p.refs > 0 {
                encode_peer(i as u32, p, out);
                n += 1;
            }
        }
        for (s, e) in self.slab.iter().enumerate() {
            if e.state != State::Free || e.generation != 0 {
                encode_entry(s as u32, e, out);
                n += 1;
            }
        }
        put_record(out, REC_NEXT_GET, &self.next_get.to_le_bytes());
        n + 1
    }

    /// Rebuilds a mux from records ([`Mux::journal_snapshot`] then
    /// [`Mux::journal_changes`] output, in order). `cfg` must have the seed and table
    /// size the records were written with (the daemon's journal header keeps them).
    pub fn restore<'a>(
        cfg: MuxConfig,
        clock: C,
        recs: impl IntoIterator<Item = (u8, &'a [u8])>,
    ) -> Result<Restored<C>, RestoreError> {
        if !cfg.policy.transfers_state() {
            return Err(RestoreError::Policy(cfg.policy.name()));
        }
        let mut m = Mux::new(cfg, clock);
        let max_slots = 1usize << m.slot_bits;
        let corrupt = |index: usize, why: &str| RestoreError::Corrupt {
            index,
            why: why.to_string(),
        };
        let mut applied = 0;
        for (index, (kind, p)) in recs.into_iter().enumerate() {
            match kind {
                REC_SLOT => {
                    let (slot, e) = decode_entry(p).ok_or_else(|| corrupt(index, "short entry"))?;
                    let s = slot as usize;
                    if s >= max_slots {
                        return Err(corrupt(index, "slot beyond the table"));
                    }
                    if m.slab.len() <= s {
                        m.slab.resize(s + 1, Entry::FREE);
                    }
                    m.slab[s] = e;
                }
                REC_PEER => {
                    let mut r = Rd(p);
                    let (Some(i), Some(gid), Some(ca_guid)) = (r.u32(), r.gid(), r.u64()) else {
                        return Err(corrupt(index, "short peer"));
                    };
                    let i = i as usize;
                    if i > max_slots {
                        return Err(corrupt(index, "peer index beyond the table"));
                    }
                    let blank = Peer {
                        gid: Gid([0; 16]),
                        ca_guid: 0,
                        refs: 0,
                    };
                    if m.peers.slots.len() <= i {
                        m.peers.slots.resize(i + 1, blank);
                    }
                    m.peers.slots[i] = Peer {
                        gid,
                        ca_guid,
                        refs: 0,
                    };
                }
                REC_VM => {
                    let (id, attached, vcfg, next_id) =
                        decode_vm(p).ok_or_else(|| corrupt(index, "short VM"))?;
                    let id = id as usize;
                    if id > m.vms.len() {
                        return Err(corrupt(index, "VM IDs out of order"));
                    }
                    let quota = vcfg.quota.unwrap_or(m.cfg.default_quota);
                    let mut v = Vm::new(vcfg, quota, attached, m.tids);
                    v.next_id = next_id;
                    if id == m.vms.len() {
                        m.vms.push(v);
                    } else {
                        m.vms[id] = v;
                    }
                }
                REC_NEXT_GET => {
                    let mut r = Rd(p);
                    m.next_get = r.u32().ok_or_else(|| corrupt(index, "short Get number"))?;
                }
                _ => continue,
            }
            applied += 1;
        }
        m.rebuild_indexes()
            .map_err(|source| RestoreError::Inconsistent {
                records: applied,
                source,
            })?;
        let attached = m
            .vms
            .iter()
            .enumerate()
            .filter(|(_, v)| v.attached)
            .map(|(i, v)| (VmId(i as u32), v.cfg.clone()))
            .collect();
        Ok(Restored {
            mux: m,
            attached,
            records: applied,
        })
    }

    /// Derives every index from the slab, the peers and the VMs.
    fn rebuild_indexes(&mut self) -> Result<(), Inconsistency> {
        for (id, v) in self.vms.iter().enumerate() {
            if !v.attached {
                continue;
            }
            for gid in v.cfg.gids() {
                if let Some(other) = self.gid_to_vm.insert(gid, id as u32) {
                    return Err(Inconsistency::SharedGid {
                        first: other,
                        second: id as u32,
                        gid,
                    });
                }
            }
        }
        let mut quarantine = Vec::new();
        for s in 0..self.slab.len() {
            let e = self.slab[s];
            let slot = s as u32;
            if e.state == State::Free {
                self.free.push_back(slot);
                continue;
            }
            if e.peer != NO_PEER {
                match self.peers.slots.get_mut(e.peer as usize) {
                    Some(p) => p.refs += 1,
                    None => return Err(Inconsistency::UnknownPeer(slot)),
                }
            }
            if e.vm != NO_VM && e.vm as usize >= self.vms.len() {
                return Err(Inconsistency::UnknownVm(slot));
            }
            let vm = self.vms.get_mut(e.vm as usize);
            if e.state == State::Quarantined {
                self.quarantined += 1;
                if let Some(v) = vm {
                    v.quarantined += 1;
                }
                quarantine.push((e.deadline, slot));
            } else {
                self.live += 1;
                if let Some(v) = vm
                    && !e.has(flag::ORPHAN)
                {
                    v.live += 1;
                }
                if e.deadline != u64::MAX {
                    self.timers.push(Reverse((e.deadline, slot, e.generation)));
                }
            }
            if e.has(flag::IN_SL_MAP)
                && let Some(v) = self.vms.get_mut(e.vm as usize)
                && v.attached
            {
                // A quarantined entry may keep its comm ID mapped; a live one that
                // reused the comm ID takes it over.
                let live = e.state != State::Quarantined;
                match v.sl_map.get(&e.sl_cm_id) {
                    Some(&o) if !(live && self.slab[o as usize].state == State::Quarantined) => {}
                    _ => {
                        v.sl_map.insert(e.sl_cm_id, slot);
                    }
                }
            }
            self.reindex_remote(slot);
            if e.state == State::SidrReqRcvd {
                self.sidr_rcvd.insert((e.peer, e.remote_comm_id), slot);
            }
            if e.pv_cm_id & ID_RANGE_BIT != 0
                && self
                    .vms
                    .get(e.vm as usize)
                    .and_then(|v| v.cfg.id_range)
                    .is_some_and(|r| r.contains(e.pv_cm_id))
                && self.ranged.insert(e.pv_cm_id, slot).is_some()
            {
                return Err(Inconsistency::SharedId(e.pv_cm_id));
            }
        }
        quarantine.sort_unstable();
        self.quarantine = quarantine.into();
        for (i, p) in self.peers.slots.iter().enumerate() {
            if p.refs > 0 {
                self.peers.index.insert(p.gid, i as u32);
            } else {
                self.peers.free.push(i as u32);
            }
        }
        for id in 0..self.vms.len() {
            self.reserve_for_entry(id as u32);
        }
        Ok(())
    }
}

impl<C: Clock> Mux<C> {
    /// Compares the protocol state (entries, indexes, timers, quarantine, peers, VMs) of
    /// two muxes, ignoring counters: for tests of [`Mux::restore`].
    #[doc(hidden)]
    pub fn same_state_as<D: Clock>(&self, o: &Mux<D>) -> Result<(), StateDifference> {
        let differ =
            |what: String, ours: String, theirs: String| StateDifference { what, ours, theirs };
        let strip = |e: &Entry| Entry {
            flags: e.flags & !flag::DIRTY,
            ..*e
        };
        let n = self.slab.len().max(o.slab.len());
        for s in 0..n {
            let a = self.slab.get(s).map_or(Entry::FREE, strip);
            let b = o.slab.get(s).map_or(Entry::FREE, strip);
            if a != b {
                return Err(differ(
                    format!("slot {s}"),
                    format!("{a:?}"),
                    format!("{b:?}"),
                ));
            }
        }
        let eq = |what: &str, a: String, b: String| {
            if a == b {
                Ok(())
            } else {
                Err(differ(what.to_string(), a, b))
            }
        };
        eq("live", self.live.to_string(), o.live.to_string())?;
        eq(
            "quarantined",
            self.quarantined.to_string(),
            o.quarantined.to_string(),
        )?;
        eq(
            "remote IDs",
            format!("{:?}", self.remote_ids.sorted()),
            format!("{:?}", o.remote_ids.sorted()),
        )?;
        let sidr = |m: &FastMap<(u32, u32), u32>| {
            let mut v: Vec<_> = m.iter().map(|(k, s)| (*k, *s)).collect();
            v.sort_unstable();
            format!("{v:?}")
        };
        eq("sidr", sidr(&self.sidr_rcvd), sidr(&o.sidr_rcvd))?;
        eq(
            "ranged",
            sorted_id_map(&self.ranged),
            sorted_id_map(&o.ranged),
        )?;
        eq(
            "next Get",
            self.next_get.to_string(),
            o.next_get.to_string(),
        )?;
        eq(
            "VM count",
            self.vms.len().to_string(),
            o.vms.len().to_string(),
        )?;
        for (i, (a, b)) in self.vms.iter().zip(&o.vms).enumerate() {
            let m = |v: &Vm| {
                let mut s: Vec<_> = v.sl_map.iter().map(|(k, s)| (*k, *s)).collect();
                s.sort_unstable();
                format!(
                    "{:?} attached {} live {} quarantined {} quota {} next {} sl {s:?}",
                    v.cfg, v.attached, v.live, v.quarantined, v.quota, v.next_id
                )
            };
            eq(&format!("VM {i}"), m(a), m(b))?;
        }
        // Timers: every valid one, as a set.
        eq("timers", timers_of(self), timers_of(o))?;
        let q = |m: &std::collections::VecDeque<(u64, u32)>, slab: &[Entry]| {
            let mut v: Vec<_> = m
                .iter()
                .filter(|(_, s)| {
                    slab.get(*s as usize)
                        .is_some_and(|e| e.state == State::Quarantined)
                })
                .copied()
                .collect();
            v.sort_unstable();
            format!("{v:?}")
        };
        eq(
            "quarantine",
            q(&self.quarantine, &self.slab),
            q(&o.quarantine, &o.slab),
        )?;
        let peers = |m: &super::peers::Peers| {
            let mut v: Vec<_> = m
                .index
                .iter()
                .map(|(g, i)| {
                    let p = m.slots[*i as usize];
                    (g.0, *i, p.ca_guid, p.refs)
                })
                .collect();
            v.sort_unstable();
            format!("{v:?}")
        };
        eq("peers", peers(&self.peers), peers(&o.peers))?;
        for m in [&self.peers, &o.peers] {
            if let Some((g, i)) = m
                .index
                .iter()
                .find(|(g, i)| m.slots.get(**i as usize).is_none_or(|p| p.gid != **g))
            {
                return Err(differ(
                    "peer index".to_string(),
                    format!("slot {i} for {g}"),
                    "that slot holding that GID".to_string(),
                ));
            }
        }
        let mut fa: Vec<u32> = self.free.iter().copied().collect();
        let mut fb: Vec<u32> = o.free.iter().copied().collect();
        fa.sort_unstable();
        fb.sort_unstable();
        eq("free slots", format!("{fa:?}"), format!("{fb:?}"))
    }
}

fn sorted_id_map(m: &FastMap<u32, u32>) -> String {
    let mut v: Vec<_> = m.iter().map(|(k, s)| (*k, *s)).collect();
    v.sort_unstable();
    format!("{v:?}")
}

fn timers_of<D: Clock>(m: &Mux<D>) -> String {
    let mut v: Vec<_> = m
        .timers
        .iter()
        .map(|Reverse(t)| *t)
        .filter(|(t, s, g)| {
            m.slab.get(*s as usize).is_some_and(|e| {
                e.generation == *g
                    && e.deadline == *t
                    && e.state != State::Free
                    && e.state != State::Quarantined
            })
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    format!("{v:?}")
}

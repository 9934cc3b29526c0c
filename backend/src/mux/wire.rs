//! Wire -> guest: one handler per attribute that arrives from the wire. REQ routes by
//! GID and creates the passive entry, REJ(TIMEOUT) without our ID by its key, SIDR and
//! ClassPortInfo by GID or TID, everything else by the `pv_cm_id` in its Remote Comm ID.

use std::cmp::Reverse;

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, req};
use pvcm_wire::mad::{self, AttributeId, Method};
use pvcm_wire::timeout::exponent_to_duration;

use super::table::{State, flag};
use super::{
    Clock, DropReason, Group, MadSlot, Mux, RemoteId, TidKind, Time, VmId, WireVerdict, prefetch,
    write_rej,
};

impl<C: Clock> Mux<C> {
    // Wire -> guest

    /// A CM MAD from the wire, sent by `src` to `dst`. Rewrites it in place.
    pub fn from_wire(&mut self, buf: &mut [u8], src: Gid, dst: Gid) -> WireVerdict {
        let now = self.clock.now().0;
        self.wire_mad_at(buf, src, dst, now)
    }

    /// [`Mux::from_wire`] at time `now` (a batch reads the clock once).
    fn wire_mad_at(&mut self, buf: &mut [u8], src: Gid, dst: Gid, now: u64) -> WireVerdict {
        let verdict = match CmMad::new_checked(&mut *buf) {
            Err(_) => WireVerdict::Drop(DropReason::Malformed),
            Ok(mut m) => {
                if now >= self.timers.peek().map_or(u64::MAX, |Reverse((t, _, _))| *t) {
                    self.poll();
                }
                self.wire_mad(&mut m, src, dst, now)
            }
        };
        let attr = AttributeId::from_u16(mad::Packet::new_unchecked(&*buf).attr_id());
        match verdict {
            WireVerdict::Drop(r) => self.host_drops.bump(r),
            WireVerdict::ToVm(vm) => {
                if let (Some(v), Some(a)) = (self.vms.get_mut(vm.0 as usize), attr) {
                    v.counters.bump(Group::RxMsgs, a);
                }
            }
            // A MAD the mux answered itself was counted by its handler.
            WireVerdict::Reply => {}
        }
        verdict
    }

    /// [`Mux::from_wire`] for a batch (as `recvmmsg` delivers them): `addr(i, &mads[i])`
    /// is the (source, destination) of `mads[i]`, and `verdicts[i]` receives its verdict.
    /// The MADs are rewritten where they are (any [`MadSlot`]: no copy).
    ///
    /// Same results as one call per MAD at one reading of the clock (a batch is handled
    /// in microseconds, and a clock read per MAD costs the host loop measurably), but
    /// first prefetches every entry the batch names, so that with a table far larger than
    /// the caches the misses overlap instead of being paid one after the other.
    pub fn from_wire_batch<B: MadSlot>(
        &mut self,
        mads: &mut [B],
        addr: impl Fn(usize, &B) -> (Gid, Gid),
        verdicts: &mut [WireVerdict],
    ) {
        let n = mads.len().min(verdicts.len());
        for m in &mads[..n] {
            if let Ok(Some(pv)) = CmMad::new_checked(&m.mad()[..]).map(|m| m.remote_comm_id()) {
                let slot = self.perm.invert(pv) & ((1u32 << self.slot_bits) - 1);
                if let Some(e) = self.slab.get(slot as usize) {
                    prefetch(e);
                }
            }
        }
        let now = self.clock.now().0;
        for i in 0..n {
            let (src, dst) = addr(i, &mads[i]);
            verdicts[i] = self.wire_mad_at(mads[i].mad_mut(), src, dst, now);
        }
    }

    pub(super) fn rx_dup(&mut self, vm: u32, attr: AttributeId) {
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.counters.bump(Group::RxDuplicates, attr);
        }
    }

    /// Routes a MAD that names a `pv_cm_id` in its Remote Comm ID; checks the frame was
    /// addressed to the owner's GID.
    pub(super) fn wire_entry(&self, m: &CmMad<&mut [u8]>, dst: Gid) -> Result<u32, DropReason> {
        let pv = m.remote_comm_id().unwrap_or(0);
        let slot = self.lookup_pv(pv)?;
        let e = &self.slab[slot as usize];
        if e.has(flag::ORPHAN) {
            return Ok(slot);
        }
        match self.vms.get(e.vm as usize) {
            Some(v) if v.attached => {
                if !v.cfg.holds(dst) && self.policy().checks() {
                    return Err(DropReason::WrongDestination);
                }
                Ok(slot)
            }
            _ => Err(DropReason::Absorbed),
        }
    }

    /// Delivers to the owner of `slot` with the remote comm ID restored.
    pub(super) fn deliver(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>) -> WireVerdict {
        let e = self.slab[slot as usize];
        let _ = m.set_remote_comm_id(e.sl_cm_id);
        if let Some(kind) = self.tids_of(e.vm).kind_of(m.tid(), e.pv_cm_id) {
            let tid = match kind {
                TidKind::Req | TidKind::Sidr => e.vm_tid_req,
                TidKind::Dreq | TidKind::Lap => e.vm_tid_other,
            };
            m.set_tid(tid);
        }
        WireVerdict::ToVm(VmId(e.vm))
    }

    /// Dispatches a wire MAD: REQ, REJ(TIMEOUT) without our ID, SIDR and ClassPortInfo
    /// route by their own keys; everything else names a `pv_cm_id`.
    pub(super) fn wire_mad(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        src: Gid,
        dst: Gid,
        now: u64,
    ) -> WireVerdict {
        let r = match m.attr() {
            AttributeId::Req => self.wire_req(m, src, now),
            AttributeId::Rej
                if m.remote_comm_id() == Some(0)
                    && m.rej_reason() == Some(RejReason::Timeout.code()) =>
            {
                self.wire_rej_timeout(m, src, dst, now)
            }
            AttributeId::SidrReq => self.wire_sidr_req(m, src, dst, now),
            AttributeId::SidrRep => self.wire_sidr_rep(m, now),
            AttributeId::ClassPortInfo => self.wire_class_port_info(m, dst),
            _ => match self.wire_entry(m, dst) {
                Ok(slot) => self.wire_connected(slot, m, now),
                Err(DropReason::NoRoute | DropReason::Quarantined)
                    if m.attr() == AttributeId::Dreq && self.policy().stateless_drep() =>
                {
                    Ok(self.stateless_drep(m))
                }
                Err(r) => Err(r),
            },
        };
        r.unwrap_or_else(WireVerdict::Drop)
    }

    /// A MAD naming a live entry: its attribute's handler, then delivery (REJ and DREP
    /// deliver before their entry changes). A detached VM's entry answers or absorbs it
    /// (`detach.rs`).
    fn wire_connected(
        &mut self,
        slot: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        if self.slab[slot as usize].has(flag::ORPHAN) {
            return Ok(self.wire_orphan(slot, m, now));
        }
        match m.attr() {
            AttributeId::Rep => {
                if let Some(answer) = self.wire_rep(slot, m, now)? {
                    return Ok(answer);
                }
            }
            AttributeId::Mra => self.wire_mra(slot, m, now),
            AttributeId::Rtu => self.wire_rtu(slot)?,
            AttributeId::Rej => return Ok(self.wire_rej(slot, m, now)),
            AttributeId::Dreq => {
                if let Some(answer) = self.wire_dreq(slot, m, now) {
                    return Ok(answer);
                }
            }
            AttributeId::Drep => return self.wire_drep(slot, m, now),
            _ => {} // LAP, APR: route only
        }
        Ok(self.deliver(slot, m))
    }

    /// REP: learns the peer's comm ID, CA GUID and QPN; the VM's RTU is due within its
    /// response window. A repeat while the VM has not answered is counted as a duplicate
    /// and delivered; a repeat after the VM's RTU (which the peer lost) gets the RTU
    /// again from the mux, as `cm_dup_rep_handler()` answers it.
    fn wire_rep(
        &mut self,
        slot: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<Option<WireVerdict>, DropReason> {
        let e = self.slab[slot as usize];
        match e.state {
            State::ReqSent => {
                let en = self.ent(slot);
                en.state = State::RepRcvd;
                en.remote_comm_id = m.local_comm_id().unwrap_or(0);
                en.remote_ca_guid = m.local_ca_guid().unwrap_or(0);
                en.remote_qpn = m.local_qpn().unwrap_or(0);
                let (peer, guid) = (en.peer, en.remote_ca_guid);
                self.peers.set_ca_guid(peer, guid);
                if self.policy().protocol_deadlines() {
                    // The VM must RTU (or MRA/REJ) within its response window; the peer
                    // retries the REP meanwhile.
                    let w = self.window(e.vm_resp, e.ack, e.retries);
                    self.set_deadline(slot, Time(now).after(w).0);
                }
            }
            State::Established if self.policy().answers_from_held_state() => {
                return Ok(Some(self.answer_retry(slot, m, AttributeId::Rtu)));
            }
            State::RepRcvd | State::Established => self.rx_dup(e.vm, AttributeId::Rep),
            _ if !self.policy().drops_unexpected() => {}
            _ => return Err(DropReason::BadState),
        }
        Ok(None)
    }

    /// MRA: the VM now waits the service timeout on top of the peer's window.
    fn wire_mra(&mut self, slot: u32, m: &CmMad<&mut [u8]>, now: u64) {
        let e = self.slab[slot as usize];
        if self.policy().protocol_deadlines() && e.state.in_handshake() {
            let svc = exponent_to_duration(m.mra_service_timeout().unwrap_or(0));
            let w = self.clamp(svc + self.window(e.peer_resp, e.ack, e.retries));
            self.extend_deadline(slot, now, w);
        }
    }

    /// RTU: establishes; a repeat is counted as a duplicate.
    fn wire_rtu(&mut self, slot: u32) -> Result<(), DropReason> {
        let e = self.slab[slot as usize];
        match e.state {
            State::RepSent => self.establish(slot),
            State::Established => self.rx_dup(e.vm, AttributeId::Rtu),
            _ if !self.policy().drops_unexpected() => {}
            _ => return Err(DropReason::BadState),
        }
        Ok(())
    }

    /// REJ: delivered, then the entry retires.
    fn wire_rej(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>, now: u64) -> WireVerdict {
        let e = self.slab[slot as usize];
        let v = self.deliver(slot, m);
        if self.policy().quarantine()
            && e.has(flag::ACTIVE)
            && matches!(e.state, State::ReqSent | State::RepRcvd)
        {
            // The peer rejected the VM's REQ: keep the VM's comm ID mapped through the
            // quarantine so that a REQ retry crossing this REJ is dropped, not sent as a
            // second connection.
            self.retire_entry(slot, now, true);
        } else {
            self.connection_rejected(slot, now);
        }
        v
    }

    /// DREQ: the entry lives until the VM answers or the peer's retries run out; each
    /// retry extends it. A retry after the VM's DREP (which the peer lost) gets the DREP
    /// again from the mux, as `cm_dreq_handler()` answers it in TIMEWAIT: the VM's CM
    /// may be gone by then.
    fn wire_dreq(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>, now: u64) -> Option<WireVerdict> {
        let e = self.slab[slot as usize];
        match e.state {
            State::TimeWait if self.policy().answers_from_held_state() => {
                let a = self.attempt(e.vm_resp, e.ack) + self.cfg.grace;
                self.extend_deadline(slot, now, a);
                return Some(self.answer_retry(slot, m, AttributeId::Drep));
            }
            State::DreqRcvd | State::TimeWait => {
                self.rx_dup(e.vm, AttributeId::Dreq);
                if self.policy().protocol_deadlines() {
                    // A retry: the peer waits one more attempt after it.
                    let a = self.attempt(e.vm_resp, e.ack) + self.cfg.grace;
                    self.extend_deadline(slot, now, a);
                }
            }
            State::DreqSent => {} // crossed DREQs
            _ => {
                self.ent(slot).state = State::DreqRcvd;
                if self.policy().protocol_deadlines() {
                    // Never lose the entry before the VM answers or the peer's retries
                    // (max CM retries x the VM's response time) run out.
                    let w = self.window(e.vm_resp, e.ack, e.retries);
                    self.set_deadline(slot, Time(now).after(w).0);
                } else {
                    self.legacy_arm(slot, now);
                }
            }
        }
        None
    }

    /// DREP: delivered with the DREQ's TID back, then TimeWait.
    fn wire_drep(
        &mut self,
        slot: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        let e = self.slab[slot as usize];
        match e.state {
            State::DreqSent | State::DreqRcvd => {
                let v = self.deliver(slot, m);
                if self.policy().protocol_deadlines() {
                    self.enter_timewait(slot, now);
                } else {
                    self.legacy_wire_drep(slot, now);
                }
                return Ok(v);
            }
            State::TimeWait => self.rx_dup(e.vm, AttributeId::Drep),
            _ if !self.policy().drops_unexpected() => {}
            _ => return Err(DropReason::BadState),
        }
        Ok(self.deliver(slot, m))
    }

    /// SIDR_REQ: routed by the frame's destination GID; remembered per (peer, request
    /// ID) for the VM's SIDR_REP.
    fn wire_sidr_req(
        &mut self,
        m: &CmMad<&mut [u8]>,
        src: Gid,
        dst: Gid,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        let &vm = self.gid_to_vm.get(&dst).ok_or(DropReason::UnknownGid)?;
        let rid = m.sidr_request_id().unwrap_or(0);
        // The peer's index, only to look the request up (released at once: the entry
        // takes its own reference).
        let peer = self.peers.acquire(src);
        let earlier = self.sidr_rcvd.get(&(peer, rid)).copied();
        self.peers.release(peer);
        if let Some(s) = earlier {
            if self.slab[s as usize].vm == vm {
                self.rx_dup(vm, AttributeId::SidrReq);
                return Ok(WireVerdict::ToVm(VmId(vm)));
            }
            self.retire(s, now);
        }
        if self.policy().checks() && self.vm_full(vm) {
            return Err(DropReason::VmOverQuota);
        }
        let s = self.new_entry(vm, src).ok_or(DropReason::TableFull)?;
        let e = self.ent(s);
        e.state = State::SidrReqRcvd;
        e.remote_comm_id = rid;
        let peer = e.peer;
        self.sidr_rcvd.insert((peer, rid), s);
        let t = self.clamp(self.cfg.sidr_timeout);
        self.set_deadline(s, Time(now).after(t).0);
        Ok(WireVerdict::ToVm(VmId(vm)))
    }

    /// SIDR_REP: by request ID; restores it and the TID; the exchange is over.
    fn wire_sidr_rep(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        let rid = m.sidr_request_id().unwrap_or(0);
        let slot = self.lookup_pv(rid)?;
        if self.slab[slot as usize].state != State::SidrReqSent {
            return Err(DropReason::BadState);
        }
        let e = self.slab[slot as usize];
        let _ = m.set_sidr_request_id(e.sl_cm_id);
        if self.tids_of(e.vm).kind_of(m.tid(), e.pv_cm_id) == Some(TidKind::Sidr) {
            m.set_tid(e.vm_tid_req);
        }
        self.retire(slot, now);
        if self.vms.get(e.vm as usize).is_some_and(|v| v.attached) {
            Ok(WireVerdict::ToVm(VmId(e.vm)))
        } else {
            Err(DropReason::Absorbed)
        }
    }

    /// ClassPortInfo: a GetResp by the host TID of the VM's Get, a Get by GID.
    fn wire_class_port_info(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
    ) -> Result<WireVerdict, DropReason> {
        if m.method() == Method::GetResp as u8 {
            match self.gets.remove(&m.tid()) {
                Some(p) if self.vms.get(p.vm as usize).is_some_and(|v| v.attached) => {
                    m.set_tid(p.vm_tid);
                    Ok(WireVerdict::ToVm(VmId(p.vm)))
                }
                _ => Err(DropReason::NoRoute),
            }
        } else {
            match self.gid_to_vm.get(&dst) {
                Some(&vm) => Ok(WireVerdict::ToVm(VmId(vm))),
                None => Err(DropReason::UnknownGid),
            }
        }
    }

    /// REQ: routed by its Primary Remote Port GID; creates the passive entry keyed by
    /// (peer CA GUID, peer comm ID); a duplicate refreshes it; REJ(NO_RESOURCES) for a
    /// VM at quota.
    fn wire_req(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        src: Gid,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        let gid = m.req_primary_remote_gid().ok_or(DropReason::Malformed)?;
        let p = req::Packet::new_unchecked(m.as_bytes());
        let key = RemoteId {
            ca_guid: p.local_ca_guid(),
            comm_id: p.local_comm_id(),
        };
        let earlier = self.remote_ids.get(&key);
        if let Some(s) = earlier
            && self.slab[s as usize].has(flag::ORPHAN)
        {
            // A retry of a REQ whose VM detached before it answered: the REJ sent then.
            return Ok(self.answer_orphan_req(s, m));
        }
        let &vm = self.gid_to_vm.get(&gid).ok_or(DropReason::UnknownGid)?;
        if !self.policy().tracks_received_reqs() {
            return Ok(self.legacy_wire_req(key.comm_id, vm, now));
        }
        if let Some(s) = earlier {
            let e = self.slab[s as usize];
            if e.vm == vm {
                // Duplicate REQ: refresh, and let the VM's CM decide (MRA again,
                // REJ STALE_CONN, or ignore).
                self.rx_dup(vm, AttributeId::Req);
                let w = self.window(e.peer_resp, e.ack, e.retries);
                self.extend_deadline(s, now, w);
                return Ok(WireVerdict::ToVm(VmId(vm)));
            }
            // The peer reuses (CA GUID, comm ID) towards another VM: the old attempt is over.
            self.retire(s, now);
        }
        if self.vm_full(vm) {
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
            self.host_counters.bump(Group::RxMsgs, AttributeId::Req);
            self.host_counters.bump(Group::TxMsgs, AttributeId::Rej);
            self.vms[vm as usize].drops.bump(DropReason::VmOverQuota);
            return Ok(WireVerdict::Reply);
        }
        let s = self.new_entry(vm, src).ok_or(DropReason::TableFull)?;
        let p = req::Packet::new_unchecked(m.as_bytes());
        let path = p.primary_path();
        let e = self.ent(s);
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
        let peer = e.peer;
        let en = *e;
        self.peers.set_ca_guid(peer, key.ca_guid);
        self.index_remote(s);
        // If the VM never answers, the peer gives up after its REQ retries.
        let w = self.window(en.vm_resp, en.ack, en.retries);
        self.set_deadline(s, Time(now).after(w).0);
        Ok(WireVerdict::ToVm(VmId(vm)))
    }

    /// REJ(TIMEOUT) with Remote Comm ID 0 (the peer never learnt our ID): routed by
    /// [`RemoteId`], only from the port that sent the REQ, only towards the VM it
    /// asked.
    fn wire_rej_timeout(
        &mut self,
        m: &mut CmMad<&mut [u8]>,
        src: Gid,
        dst: Gid,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        let comm_id = m.local_comm_id().unwrap_or(0);
        if !self.policy().tracks_received_reqs() {
            return self.legacy_wire_rej_timeout(comm_id, now);
        }
        let ca_guid = m.rej_timeout_ca_guid().ok_or(DropReason::NoRoute)?;
        let s = self
            .remote_ids
            .get(&RemoteId { ca_guid, comm_id })
            .ok_or(DropReason::NoRoute)?;
        let e = self.slab[s as usize];
        // Only the port that sent the REQ may withdraw it, and only towards the VM it
        // asked: otherwise any host could cancel another peer's pending connection by
        // naming its CA GUID.
        if self.peers.get(e.peer).is_some_and(|p| p.gid != src) {
            return Err(DropReason::WrongSource);
        }
        if !e.has(flag::ORPHAN)
            && self
                .vms
                .get(e.vm as usize)
                .is_some_and(|v| !v.cfg.holds(dst))
        {
            return Err(DropReason::WrongDestination);
        }
        self.retire(s, now);
        if e.has(flag::ORPHAN) {
            return Err(DropReason::Absorbed);
        }
        Ok(WireVerdict::ToVm(VmId(e.vm)))
    }
}

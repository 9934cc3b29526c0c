//! Guest -> wire: one handler per attribute a VM sends, as Linux `cm.c` has one per
//! message. Each checks what the VM may send, finds or creates the entry, rewrites the
//! VM's comm ID (and the TIDs of transactions it starts) and moves the entry's state.

use std::cmp::Reverse;

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as cmf, req};
use pvcm_wire::mad::{self, AttributeId, Method};
use pvcm_wire::timeout::exponent_to_duration;

use super::table::{State, flag};
use super::{
    Clock, DropReason, Group, GuestVerdict, MadSlot, Mux, PendingGet, TidKind, Time, VmConfig,
    VmId, prefetch, set_local, write_rej,
};

/// What a REQ from a VM whose comm ID names an existing entry is (see `Mux::req_retry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retry {
    /// A retry while the handshake is open: forward it under the entry's IDs.
    Forward,
    /// A retry that crossed the peer's REJ: drop it.
    Drop,
    /// Not a retry: a new connection reusing the VM's comm ID.
    New,
}

impl<C: Clock> Mux<C> {
    // Guest -> wire

    /// A CM MAD from VM `vm`, to be sent to `dst`. Rewrites it in place.
    pub fn from_guest(&mut self, vm: VmId, buf: &mut [u8], dst: Gid) -> GuestVerdict {
        let now = self.clock.now().0;
        self.guest_mad_at(vm, buf, dst, now)
    }

    /// [`Mux::from_guest`] at time `now` (a batch reads the clock once).
    fn guest_mad_at(&mut self, vm: VmId, buf: &mut [u8], dst: Gid, now: u64) -> GuestVerdict {
        if !self.vms.get(vm.0 as usize).is_some_and(|v| v.attached) {
            self.host_drops.bump(DropReason::UnknownConnection);
            return GuestVerdict::Drop(DropReason::UnknownConnection);
        }
        let verdict = match CmMad::new_checked(&mut *buf) {
            Err(_) => GuestVerdict::Drop(DropReason::Malformed),
            Ok(mut m) => {
                if now >= self.timers.peek().map_or(u64::MAX, |Reverse((t, _, _))| *t) {
                    self.poll();
                }
                self.guest_mad(vm.0, &mut m, dst, now)
            }
        };
        let attr = mad::Packet::new_unchecked(&*buf).attr_id();
        let v = &mut self.vms[vm.0 as usize];
        match verdict {
            GuestVerdict::Drop(r) => v.drops.bump(r),
            GuestVerdict::ToWire => {
                if let Some(a) = AttributeId::from_u16(attr) {
                    v.counters.bump(Group::TxMsgs, a);
                }
            }
            _ => {}
        }
        verdict
    }

    pub(super) fn vm_cfg(&self, vm: u32) -> &VmConfig {
        &self.vms[vm as usize].cfg
    }

    /// Dispatches a VM's MAD to the handler of its attribute.
    pub(super) fn guest_mad(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> GuestVerdict {
        let r = match m.attr() {
            AttributeId::Req => self.guest_req(vm, m, dst, now),
            AttributeId::Rep => self.guest_rep(vm, m, dst, now),
            AttributeId::Mra => self.guest_mra(vm, m, dst, now),
            AttributeId::Rej => self.guest_rej(vm, m, dst, now),
            AttributeId::Rtu => self.guest_rtu(vm, m),
            AttributeId::Dreq => self.guest_dreq(vm, m, now),
            AttributeId::Drep => self.guest_drep(vm, m, now),
            AttributeId::Lap | AttributeId::Apr => self.guest_lap_apr(vm, m),
            AttributeId::SidrReq => self.guest_sidr_req(vm, m, dst, now),
            AttributeId::SidrRep => self.guest_sidr_rep(vm, m, dst, now),
            AttributeId::ClassPortInfo => {
                self.guest_class_port_info(vm, m, now);
                Ok(GuestVerdict::ToWire)
            }
        };
        r.unwrap_or_else(GuestVerdict::Drop)
    }

    /// Whether the mux checks what VMs send (not under the mlx4 policies).
    fn checks(&self) -> bool {
        self.policy().checks()
    }

    /// Whether the VM is at its quota of live entries (never under the mlx4 policies).
    fn vm_at_quota(&self, vm: u32) -> bool {
        self.checks() && self.vm_full(vm)
    }

    /// REQ: checked, then a retry reuses its entry (see `req_retry`), anything else
    /// allocates one (REJ(NO_RESOURCES) over quota); Local Comm ID and TID rewritten.
    fn guest_req(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        if self.checks() {
            self.check_req(vm, m.as_bytes())?;
        }
        let existing = self.vms[vm as usize].sl_map.get(&sl).copied();
        let slot = match existing.map(|s| (s, self.req_retry(s, m.tid()))) {
            Some((s, Retry::Forward)) => {
                // A retry of the REQ already forwarded: same pv_cm_id and host TID, so
                // the peer sees a duplicate (Linux `cm_match_req`).
                self.vms[vm as usize]
                    .counters
                    .bump(Group::TxRetries, AttributeId::Req);
                s
            }
            Some((_, Retry::Drop)) => return Err(DropReason::BadState),
            other => {
                if let Some((old, _)) = other {
                    // The VM reuses its ID for a new connection: the old one is over.
                    self.retire(old, now);
                }
                if self.vm_at_quota(vm) {
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
                    return Ok(GuestVerdict::Reply);
                }
                let s = self.new_entry(vm, dst).ok_or(DropReason::TableFull)?;
                let p = req::Packet::new_unchecked(m.as_bytes());
                let e = self.ent(s);
                e.state = State::ReqSent;
                e.flags |= flag::ACTIVE;
                e.sl_cm_id = sl;
                e.vm_resp = p.local_cm_response_timeout();
                e.peer_resp = p.remote_cm_response_timeout();
                e.ack = p.primary_path().local_ack_timeout;
                e.retries = p.max_cm_retries();
                self.index_sl(vm, sl, s);
                self.assign_pv(s);
                if self.policy().protocol_deadlines() {
                    let e = self.slab[s as usize];
                    let w = self.window(e.peer_resp, e.ack, e.retries);
                    self.set_deadline(s, Time(now).after(w).0);
                }
                s
            }
        };
        self.ent(slot).vm_tid_req = m.tid();
        let pv = self.slab[slot as usize].pv_cm_id;
        m.set_tid(self.tids_of(vm).tid(TidKind::Req, pv));
        set_local(m, pv);
        Ok(GuestVerdict::ToWire)
    }

    /// REP: checked; links the passive entry; the RTU is due within the peer's window.
    fn guest_rep(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        if self.checks() {
            self.check_rep(vm, m.as_bytes())?;
        }
        let slot = self.guest_entry(vm, m, dst, now)?;
        let e = self.slab[slot as usize];
        match e.state {
            // A retry; in Established one that crossed the peer's RTU, which the mux
            // has already passed: the peer answers it with its RTU again
            // (`cm_dup_rep_handler()`). (Passive entries only: an active one never
            // sends a REP.)
            State::RepSent | State::Established if !e.has(flag::ACTIVE) => {
                self.vms[vm as usize]
                    .counters
                    .bump(Group::TxRetries, AttributeId::Rep);
            }
            State::ReqRcvd => {
                self.ent(slot).state = State::RepSent;
                if self.policy().protocol_deadlines() {
                    // The VM retries its REP, the peer may MRA or REJ; the RTU must come
                    // within the peer's response window.
                    let w = self.window(e.peer_resp, e.ack, e.retries);
                    self.set_deadline(slot, Time(now).after(w).0);
                }
            }
            _ => return Err(DropReason::BadState),
        }
        set_local(m, self.slab[slot as usize].pv_cm_id);
        Ok(GuestVerdict::ToWire)
    }

    /// MRA: the peer now waits the service timeout on top of its window.
    fn guest_mra(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let slot = self.guest_entry(vm, m, dst, now)?;
        let e = self.slab[slot as usize];
        if self.policy().protocol_deadlines() && e.state.in_handshake() {
            // (An MRA for a LAP leaves an established connection without deadline.)
            let svc = exponent_to_duration(m.mra_service_timeout().unwrap_or(0));
            let w = self.clamp(svc + self.window(e.vm_resp, e.ack, e.retries));
            self.extend_deadline(slot, now, w);
        }
        self.req_tid_to_host(slot, m);
        set_local(m, e.pv_cm_id);
        Ok(GuestVerdict::ToWire)
    }

    /// REJ: a REJ(TIMEOUT) must carry the VM's CA GUID; a stateless one (Local Comm ID
    /// 0) retires the REQ it names; any other retires its entry.
    fn guest_rej(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        // A REJ(TIMEOUT) must name the VM's own CA GUID; an ARI too short to hold one is
        // refused too (Linux's cm_rej_handler reads the first 8 ARI bytes whatever the
        // ARI length says).
        if self.checks()
            && m.rej_reason() == Some(RejReason::Timeout.code())
            && m.remote_comm_id() == Some(0)
            && m.rej_timeout_ca_guid() != Some(self.vm_cfg(vm).ca_guid)
        {
            return Err(DropReason::SpoofedCaGuid);
        }
        if sl == 0 {
            // A stateless reject (Linux cm_issue_rej): no ID of the VM's to hide, but the
            // REQ it answers leaves no entry behind.
            if self.policy().tracks_received_reqs() {
                self.stateless_rej(vm, m, dst, now)?;
            }
            return Ok(GuestVerdict::ToWire);
        }
        let slot = self.guest_entry(vm, m, dst, now)?;
        let pv = self.slab[slot as usize].pv_cm_id;
        self.req_tid_to_host(slot, m);
        set_local(m, pv);
        self.connection_rejected(slot, now);
        Ok(GuestVerdict::ToWire)
    }

    /// RTU: establishes; a repeat answers a duplicate REP.
    fn guest_rtu(&mut self, vm: u32, m: &mut CmMad<&mut [u8]>) -> Result<GuestVerdict, DropReason> {
        let slot = self.guest_known(vm, m)?;
        match self.slab[slot as usize].state {
            State::RepRcvd => self.establish(slot),
            // Re-sent for a duplicate REP (the first RTU was lost).
            State::Established => self.vms[vm as usize]
                .counters
                .bump(Group::TxRetries, AttributeId::Rtu),
            _ if !self.policy().drops_unexpected() => {}
            _ => return Err(DropReason::BadState),
        }
        self.req_tid_to_host(slot, m);
        set_local(m, self.slab[slot as usize].pv_cm_id);
        Ok(GuestVerdict::ToWire)
    }

    /// DREQ: the entry lives through the VM's retries (the peer's response window each).
    fn guest_dreq(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let slot = self.guest_known(vm, m)?;
        let e = self.slab[slot as usize];
        match e.state {
            State::DreqSent | State::TimeWait => self.vms[vm as usize]
                .counters
                .bump(Group::TxRetries, AttributeId::Dreq),
            State::DreqRcvd => {} // crossed DREQs: both sides answer with DREP
            _ => {
                // Established (or a half-open connection the VM tears down).
                self.ent(slot).state = State::DreqSent;
                if self.policy().protocol_deadlines() {
                    let w = self.window(e.peer_resp, e.ack, e.retries);
                    self.set_deadline(slot, Time(now).after(w).0);
                } else {
                    self.legacy_arm(slot, now);
                }
            }
        }
        self.ent(slot).vm_tid_other = m.tid();
        m.set_tid(self.tids_of(e.vm).tid(TidKind::Dreq, e.pv_cm_id));
        set_local(m, e.pv_cm_id);
        Ok(GuestVerdict::ToWire)
    }

    /// DREP: enters TimeWait.
    fn guest_drep(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let slot = self.guest_known(vm, m)?;
        let e = self.slab[slot as usize];
        match e.state {
            State::TimeWait => self.vms[vm as usize]
                .counters
                .bump(Group::TxRetries, AttributeId::Drep),
            _ if !self.policy().protocol_deadlines() => self.legacy_guest_drep(slot, now),
            State::DreqRcvd | State::DreqSent => self.enter_timewait(slot, now),
            _ => return Err(DropReason::BadState),
        }
        set_local(m, e.pv_cm_id);
        Ok(GuestVerdict::ToWire)
    }

    /// LAP, APR: rewritten only (LAP also its TID).
    fn guest_lap_apr(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
    ) -> Result<GuestVerdict, DropReason> {
        let slot = self.guest_known(vm, m)?;
        let pv = self.slab[slot as usize].pv_cm_id;
        if m.attr() == AttributeId::Lap {
            self.ent(slot).vm_tid_other = m.tid();
            m.set_tid(self.tids_of(vm).tid(TidKind::Lap, pv));
        }
        set_local(m, pv);
        Ok(GuestVerdict::ToWire)
    }

    /// SIDR_REQ: allocates (a retry reuses); request ID and TID rewritten.
    fn guest_sidr_req(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        let rid = m.sidr_request_id().unwrap_or(0);
        let existing = self.vms[vm as usize].sl_map.get(&rid).copied();
        let slot = match existing {
            Some(s) if self.slab[s as usize].state == State::SidrReqSent => {
                self.vms[vm as usize]
                    .counters
                    .bump(Group::TxRetries, AttributeId::SidrReq);
                s
            }
            other => {
                if let Some(old) = other {
                    self.retire(old, now);
                }
                if self.vm_at_quota(vm) {
                    return Err(DropReason::OverQuota);
                }
                let s = self.new_entry(vm, dst).ok_or(DropReason::TableFull)?;
                let e = self.ent(s);
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
        self.ent(slot).vm_tid_req = m.tid();
        let pv = self.slab[slot as usize].pv_cm_id;
        m.set_tid(self.tids_of(vm).tid(TidKind::Sidr, pv));
        // A SIDR_REQ has a request ID, never a comm ID.
        let _ = m.set_sidr_request_id(pv);
        Ok(GuestVerdict::ToWire)
    }

    /// SIDR_REP: only for a SIDR_REQ delivered to this VM; its QPN checked.
    fn guest_sidr_rep(
        &mut self,
        vm: u32,
        m: &mut CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<GuestVerdict, DropReason> {
        if self.checks() {
            let status = cmf::SIDR_REP_STATUS.get(m.as_bytes());
            if status == 0 && m.local_qpn().is_some_and(|q| !self.vm_cfg(vm).owns_qpn(q)) {
                return Err(DropReason::SpoofedQpn);
            }
        }
        // The request ID is the peer's; check the VM was asked.
        let rid = m.sidr_request_id().unwrap_or(0);
        let peer = self.peers.index.get(&dst).copied();
        let slot = peer.and_then(|p| self.sidr_rcvd.get(&(p, rid)).copied());
        match slot {
            Some(s) if self.slab[s as usize].vm == vm => {
                self.retire(s, now);
                Ok(GuestVerdict::ToWire)
            }
            _ if !self.policy().drops_unexpected() => Ok(GuestVerdict::ToWire),
            _ => Err(DropReason::UnknownConnection),
        }
    }

    /// ClassPortInfo: a Get leaves with a host TID, remembered for its GetResp.
    fn guest_class_port_info(&mut self, vm: u32, m: &mut CmMad<&mut [u8]>, now: u64) {
        if m.method() == Method::Get as u8 {
            let host_tid = self.tids.get_tid(self.next_get);
            self.next_get = self.next_get.wrapping_add(1);
            if let Some(c) = &mut self.changes {
                // A restored mux must not hand out a TID a late GetResp still names.
                c.next_get = true;
            }
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
    }

    /// A REJ with Local Comm ID 0 from the VM (INVALID_SERVICE_ID, NO_RESOURCES, ...):
    /// its CM keeps no state for the REQ it rejects, so neither does the mux. Its Remote
    /// Comm ID is the peer's comm ID from that REQ: with the peer's CA GUID (that of the
    /// REJ's destination) it names the entry the REQ created, which retires (quarantine
    /// if the VM had named it, else freed at once: no ID of ours was on the wire). A REJ
    /// naming a REQ delivered to another VM is dropped: it would make the peer abandon
    /// that VM's connection (Linux finds a rejected REQ by the Remote Comm ID alone).
    pub(super) fn stateless_rej(
        &mut self,
        vm: u32,
        m: &CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<(), DropReason> {
        let remote = m.remote_comm_id().unwrap_or(0);
        let Some(s) = self.remote_by_peer(&dst, remote).filter(|_| remote != 0) else {
            return Ok(()); // nothing pending under that ID: pass it on unchanged
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
    pub(super) fn req_retry(&self, slot: u32, tid: u64) -> Retry {
        let e = &self.slab[slot as usize];
        let same =
            e.has(flag::ACTIVE) && (e.vm_tid_req == tid || !self.policy().retry_needs_same_tid());
        match e.state {
            State::ReqSent | State::RepRcvd if same => Retry::Forward,
            State::Quarantined if same && e.has(flag::IN_SL_MAP) => Retry::Drop,
            _ => Retry::New,
        }
    }

    /// The active VM's RTU, REJ and MRA(REP) reuse its REQ's TID (as Linux's
    /// `cm_format_rtu`/`rej`/`mra` do), whose low half is the VM's comm ID: on the wire
    /// they carry the host REQ TID instead, as they would from a Linux host.
    pub(super) fn req_tid_to_host(&self, slot: u32, m: &mut CmMad<&mut [u8]>) {
        let e = &self.slab[slot as usize];
        if e.has(flag::ACTIVE) && e.pv_cm_id != 0 && m.tid() == e.vm_tid_req {
            m.set_tid(self.tids_of(e.vm).tid(TidKind::Req, e.pv_cm_id));
        }
    }

    pub(super) fn check_req(&self, vm: u32, bytes: &[u8]) -> Result<(), DropReason> {
        let cfg = self.vm_cfg(vm);
        let p = req::Packet::new_unchecked(bytes);
        if !cfg.holds(p.primary_local_port_gid()) {
            return Err(DropReason::SpoofedGid);
        }
        let alt = p.alternate_path().local_gid;
        if alt != Gid::ZERO && !cfg.holds(alt) {
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

    pub(super) fn check_rep(&self, vm: u32, bytes: &[u8]) -> Result<(), DropReason> {
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

    /// The entry of a MAD the VM sends for a connection it named before, by its comm ID.
    /// One in quarantine is `Quarantined`: the connection ended at the peer's word (its
    /// REJ, a timeout) while the VM's CM was answering it, and the answer crossed the
    /// end, as a late MAD from the wire does; Linux would send it and the peer drop it.
    pub(super) fn guest_known(&self, vm: u32, m: &CmMad<&mut [u8]>) -> Result<u32, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        let s = self.vms[vm as usize]
            .sl_map
            .get(&sl)
            .copied()
            .ok_or(DropReason::UnknownConnection)?;
        if self.slab[s as usize].state == State::Quarantined {
            return Err(DropReason::Quarantined);
        }
        Ok(s)
    }

    /// The entry of a passive-side answer (MRA, REP, REJ): by the VM's comm ID if it used
    /// it before, else the REQ it answers, found by (peer CA GUID, peer comm ID).
    pub(super) fn guest_entry(
        &mut self,
        vm: u32,
        m: &CmMad<&mut [u8]>,
        dst: Gid,
        now: u64,
    ) -> Result<u32, DropReason> {
        let sl = m.local_comm_id().unwrap_or(0);
        let remote = m.remote_comm_id().unwrap_or(0);
        let known = self.guest_known(vm, m);
        // Found nowhere else: the quarantined connection the VM named, or none.
        let unknown = match known {
            Err(DropReason::Quarantined) => DropReason::Quarantined,
            _ => DropReason::UnknownConnection,
        };
        if let Ok(s) = known {
            let e = &self.slab[s as usize];
            // The VM's CM withdrew its REQ (REJ(TIMEOUT), no Remote Comm ID) before it
            // processed the peer's REP, which the mux has already passed: the REJ ends
            // that same connection, and the peer (in REP_SENT) must get it.
            let withdrawn = remote == 0 && e.has(flag::ACTIVE) && e.state == State::RepRcvd;
            if e.remote_comm_id == remote || withdrawn || !self.policy().tracks_received_reqs() {
                return Ok(s);
            }
            // The VM reuses its comm ID towards another peer connection: as far as its
            // CM is concerned the old one is gone.
            self.retire(s, now);
        }
        if !self.policy().tracks_received_reqs() {
            return self.legacy_guest_entry(vm, sl, remote, dst);
        }
        let s = self.remote_by_peer(&dst, remote).ok_or(unknown)?;
        let e = self.slab[s as usize];
        if e.vm != vm {
            return Err(DropReason::UnknownConnection);
        }
        if e.state != State::ReqRcvd || e.has(flag::IN_SL_MAP) {
            return Err(unknown);
        }
        self.ent(s).sl_cm_id = sl;
        self.index_sl(vm, sl, s);
        self.assign_pv(s);
        Ok(s)
    }

    /// [`Mux::from_guest`] for a batch of MADs from one VM (as a virtqueue delivers
    /// them): `dst(i, &mads[i])` is where `mads[i]` goes, `verdicts[i]` receives its
    /// verdict. The MADs are rewritten where they are (any [`MadSlot`]: no copy). Like
    /// [`Mux::from_wire_batch`]: one reading of the clock, and the VM's comm-ID map
    /// looked up and the entries prefetched first.
    pub fn from_guest_batch<B: MadSlot>(
        &mut self,
        vm: VmId,
        mads: &mut [B],
        dst: impl Fn(usize, &B) -> Gid,
        verdicts: &mut [GuestVerdict],
    ) {
        let n = mads.len().min(verdicts.len());
        if let Some(v) = self.vms.get(vm.0 as usize) {
            for m in &mads[..n] {
                let sl = cmf::LOCAL_COMM_ID.get(m.mad()) as u32;
                if let Some(&slot) = v.sl_map.get(&sl)
                    && let Some(e) = self.slab.get(slot as usize)
                {
                    prefetch(e);
                }
            }
        }
        let now = self.clock.now().0;
        for i in 0..n {
            let d = dst(i, &mads[i]);
            verdicts[i] = self.guest_mad_at(vm, mads[i].mad_mut(), d, now);
        }
    }
}

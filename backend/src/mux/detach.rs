//! Orphans: when a VM detaches, the mux finishes its connections on its behalf (DREQ,
//! REJ, DREP) so that peers stop waiting, answers what the peers retry from what it
//! holds, and absorbs the rest.
//!
//! The Linux CM answers some MADs without its application, from the state it keeps
//! after the application is gone: a DREQ in TimeWait gets its DREP again
//! (`cm_dreq_handler()`), a DREQ for no connection a stateless DREP (`cm_issue_drep()`),
//! a REP retry of an established connection its RTU again (`cm_dup_rep_handler()`). The
//! mux does the same for every VM (its CM may be gone without the mux knowing: a program
//! that owned the device exited), and for a detached VM's half-open passive connections
//! it also answers a REQ retry with the REJ it sent at detach, so no peer waits for its
//! retries to run out because the VM's side let go.

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as cmf};
use pvcm_wire::mad::{self, AttributeId};

use super::table::{State, flag};
use super::{
    Clock, CmCounters, DropReason, FastMap, Group, Mux, Outgoing, TidKind, Time, VmId, WireVerdict,
    write_cm_ids, write_rej,
};
use foldhash::fast::RandomState;

impl<C: Clock> Mux<C> {
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
        if let Some(c) = &mut self.changes {
            c.vms.push(vm.0);
        }
        let v = &mut self.vms[vm.0 as usize];
        v.sl_map = FastMap::with_hasher(RandomState::default());
        for gid in v.cfg.gids() {
            self.gid_to_vm.remove(&gid);
        }
        self.fold_figures(vm.0);
        if !self.policy().cleans_up_detached_vms() {
            return;
        }
        let now = self.clock.now().0;
        for slot in 0..self.slab.len() as u32 {
            let e = self.slab[slot as usize];
            if e.vm != vm.0 || e.state == State::Free || e.state == State::Quarantined {
                continue;
            }
            // The VM's comm-ID map is gone already.
            self.ent(slot).flags &= !flag::IN_SL_MAP;
            self.orphan(slot, now);
        }
        if let Some(v) = self.vms.get_mut(vm.0 as usize) {
            v.live = 0;
        }
    }

    /// Finishes one connection of a detached VM: what it sends goes from the VM's GID
    /// for the peer's ([`VmConfig::source_for`]).
    ///
    /// [`VmConfig::source_for`]: super::VmConfig::source_for
    pub(super) fn orphan(&mut self, slot: u32, now: u64) {
        let e = self.slab[slot as usize];
        let peer_gid = self.peers.get(e.peer).map(|p| p.gid);
        // Used only with a peer to send to; the VM is the entry's, so it is there.
        let vm_gid = match (self.vms.get(e.vm as usize), peer_gid) {
            (Some(v), Some(dst)) => v.cfg.source_for(dst),
            (Some(v), None) => v.cfg.gid,
            (None, _) => Gid::ZERO,
        };
        match (e.state, peer_gid) {
            (State::Established | State::DreqSent, Some(dst)) if e.pv_cm_id != 0 => {
                // Established: disconnect on the VM's behalf, retrying like a CM would.
                let attempts = self.cfg.detach_dreq_attempts.max(1);
                self.mark_orphan(slot, State::DreqSent);
                self.ent(slot).retries = attempts - 1;
                self.send_dreq_on_behalf(slot, vm_gid, dst);
                let t = self.attempt(e.peer_resp, e.ack);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            (State::ReqSent | State::RepRcvd | State::ReqRcvd | State::RepSent, Some(dst)) => {
                // Half open: reject, as the Linux CM does when such an ID is destroyed.
                if e.pv_cm_id == 0 {
                    self.assign_pv(slot);
                }
                let mut m = [0u8; mad::MAD_LEN];
                self.write_orphan_rej(slot, &mut m, None);
                self.outbox.push(Outgoing {
                    src: vm_gid,
                    dst,
                    mad: m,
                });
                self.count_on_behalf(None, AttributeId::Rej, false);
                if matches!(e.state, State::ReqRcvd | State::RepSent) {
                    // The peer may retry its REQ until its window closes (the REJ can be
                    // lost): the entry stays, found by the peer's ID, and answers each
                    // retry with the REJ again.
                    self.mark_orphan(slot, e.state);
                    let w = self.window(e.vm_resp, e.ack, e.retries);
                    self.set_deadline(slot, Time(now).after(w).0);
                } else {
                    self.retire(slot, now);
                }
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
                self.count_on_behalf(None, AttributeId::Drep, false);
                self.mark_orphan(slot, State::TimeWait);
                let t = self.timewait(&e);
                self.set_deadline(slot, Time(now).after(t).0);
            }
            (State::TimeWait, _) => self.mark_orphan(slot, State::TimeWait),
            _ => self.retire(slot, now),
        }
    }

    /// Writes into `buf` the REJ that ends a detached VM's half-open connection in
    /// `slot`, with `tid` (default: the REQ's): REJ(TIMEOUT) with the VM's CA GUID in the
    /// ARI where the VM was waiting for a REP (as the Linux CM's destroy in REQ_SENT), a
    /// consumer-defined REJ otherwise, naming the message it answers as `cm_format_rej()`.
    fn write_orphan_rej(&self, slot: u32, buf: &mut [u8], tid: Option<u64>) {
        let e = self.slab[slot as usize];
        let host_req_tid = self.tids_of(e.vm).tid(TidKind::Req, e.pv_cm_id);
        let (reason, msg, remote, req_tid) = match e.state {
            State::ReqSent => (RejReason::Timeout, MsgResponse::Other, 0, host_req_tid),
            State::RepRcvd => (
                RejReason::ConsumerDefined,
                MsgResponse::Rep,
                e.remote_comm_id,
                host_req_tid,
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
        let guid = self
            .vms
            .get(e.vm as usize)
            .map_or([0; 8], |v| v.cfg.ca_guid.to_be_bytes());
        let ari: &[u8] = if reason == RejReason::Timeout {
            &guid
        } else {
            &[]
        };
        write_rej(
            buf,
            tid.unwrap_or(req_tid),
            e.pv_cm_id,
            remote,
            msg,
            reason,
            ari,
        );
    }

    pub(super) fn mark_orphan(&mut self, slot: u32, state: State) {
        let e = self.ent(slot);
        e.flags |= flag::ORPHAN;
        e.state = state;
        let vm = e.vm;
        if let Some(v) = self.vms.get_mut(vm as usize) {
            v.live = v.live.saturating_sub(1);
        }
        // Orphans still count as live host entries until they retire.
    }

    pub(super) fn send_dreq_on_behalf(&mut self, slot: u32, src: Gid, dst: Gid) {
        let e = self.slab[slot as usize];
        let mut m = [0u8; mad::MAD_LEN];
        write_cm_ids(
            &mut m,
            AttributeId::Dreq,
            self.tids_of(e.vm).tid(TidKind::Dreq, e.pv_cm_id),
            e.pv_cm_id,
            e.remote_comm_id,
        );
        cmf::DREQ_REMOTE_QPN.set(&mut m, e.remote_qpn.into());
        self.outbox.push(Outgoing { src, dst, mad: m });
        self.count_on_behalf(None, AttributeId::Dreq, false);
    }

    // ----------------------------------------------------------------------------------
    // Answers from what the mux holds

    /// The figures a MAD answered on `vm`'s behalf goes into: the VM's while it is
    /// attached (`vm` is `None` for a detached VM's connection or none), else the host's.
    fn answer_figures(&mut self, vm: Option<u32>) -> (&mut CmCounters, &mut u64) {
        match vm.and_then(|vm| self.vms.get_mut(vm as usize)) {
            Some(v) if v.attached => (&mut v.counters, &mut v.on_behalf),
            _ => (&mut self.host_counters, &mut self.host_on_behalf),
        }
    }

    /// Counts a MAD the mux sent on `vm`'s behalf (a re-send of one sent before when
    /// `resent`).
    pub(super) fn count_on_behalf(&mut self, vm: Option<u32>, tx: AttributeId, resent: bool) {
        let (c, n) = self.answer_figures(vm);
        c.bump(Group::TxMsgs, tx);
        if resent {
            c.bump(Group::TxRetries, tx);
        }
        *n += 1;
    }

    /// Counts a MAD from the wire that the mux answered itself on `vm`'s behalf, as a
    /// duplicate of one received before when `dup`.
    fn count_answered(&mut self, vm: Option<u32>, rx: AttributeId, dup: bool) {
        let (c, _) = self.answer_figures(vm);
        c.bump(Group::RxMsgs, rx);
        if dup {
            c.bump(Group::RxDuplicates, rx);
        }
    }

    /// The VM of `slot`'s entry for the figures, `None` for an orphan.
    fn owner(&self, slot: u32) -> Option<u32> {
        let e = &self.slab[slot as usize];
        (!e.has(flag::ORPHAN)).then_some(e.vm)
    }

    /// Answers the MAD in `m`, a retry by the peer for the connection in `slot` whose
    /// answer it lost, with that answer `tx`, in place: the retry's TID, the entry's ID
    /// and the peer's. A DREQ in TimeWait gets its DREP (`cm_dreq_handler()` in
    /// TIMEWAIT), a REP of an established connection its RTU (`cm_dup_rep_handler()`).
    pub(super) fn answer_retry(
        &mut self,
        slot: u32,
        m: &mut CmMad<&mut [u8]>,
        tx: AttributeId,
    ) -> WireVerdict {
        let e = self.slab[slot as usize];
        let (rx, tid) = (m.attr(), m.tid());
        let remote = m.local_comm_id().unwrap_or(e.remote_comm_id);
        write_cm_ids(m.as_bytes_mut(), tx, tid, e.pv_cm_id, remote);
        let vm = self.owner(slot);
        self.count_answered(vm, rx, true);
        self.count_on_behalf(vm, tx, true);
        WireVerdict::Reply
    }

    /// A DREQ for no connection (or one in quarantine) answered with a stateless DREP,
    /// as Linux's `cm_issue_drep()` does, so that the peer stops retrying.
    pub(super) fn stateless_drep(&mut self, m: &mut CmMad<&mut [u8]>) -> WireVerdict {
        let tid = m.tid();
        let (local, remote) = (
            m.remote_comm_id().unwrap_or(0),
            m.local_comm_id().unwrap_or(0),
        );
        write_cm_ids(m.as_bytes_mut(), AttributeId::Drep, tid, local, remote);
        self.count_answered(None, AttributeId::Dreq, true);
        self.count_on_behalf(None, AttributeId::Drep, false);
        WireVerdict::Reply
    }

    /// A MAD from the wire naming a detached VM's connection: a DREQ gets its DREP (the
    /// entry goes to TimeWait, so the mux stops its own DREQs), a DREP ends the DREQs the
    /// mux sent, a REJ ends the entry; everything else is absorbed, and no state moves
    /// towards a connection the VM no longer has.
    pub(super) fn wire_orphan(
        &mut self,
        slot: u32,
        m: &mut CmMad<&mut [u8]>,
        now: u64,
    ) -> WireVerdict {
        let e = self.slab[slot as usize];
        match m.attr() {
            AttributeId::Dreq => {
                if e.state != State::TimeWait {
                    self.enter_timewait(slot, now);
                } else {
                    let a = self.attempt(e.vm_resp.max(e.peer_resp), e.ack) + self.cfg.grace;
                    self.extend_deadline(slot, now, a);
                }
                return self.answer_retry(slot, m, AttributeId::Drep);
            }
            AttributeId::Drep if e.state == State::DreqSent => self.enter_timewait(slot, now),
            AttributeId::Rej => self.retire(slot, now),
            _ => {}
        }
        WireVerdict::Drop(DropReason::Absorbed)
    }

    /// A REQ retry for a detached VM's half-open passive connection in `slot` (found by
    /// the peer's ID): answered with the REJ sent at detach, in place.
    pub(super) fn answer_orphan_req(&mut self, slot: u32, m: &mut CmMad<&mut [u8]>) -> WireVerdict {
        let tid = m.tid();
        self.write_orphan_rej(slot, m.as_bytes_mut(), Some(tid));
        self.count_answered(None, AttributeId::Req, true);
        self.count_on_behalf(None, AttributeId::Rej, true);
        WireVerdict::Reply
    }
}

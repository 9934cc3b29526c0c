//! Orphans: when a VM detaches, the mux finishes its connections on its behalf (DREQ,
//! REJ, DREP) so that peers stop waiting, and absorbs the answers.

use foldhash::fast::RandomState;
use pvcm_wire::Gid;
use pvcm_wire::cm::{MsgResponse, RejReason, field as cmf};
use pvcm_wire::mad::{self, AttributeId};

use super::table::{State, flag};
use super::{
    Clock, CmCounters, DropCounters, FastMap, Group, Mux, Outgoing, TidKind, Time, VmId,
    write_cm_ids, write_rej,
};

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
            self.orphan(slot, gid, ca_guid, now);
        }
        if let Some(v) = self.vms.get_mut(vm.0 as usize) {
            v.live = 0;
        }
    }

    /// Finishes one connection of a detached VM.
    pub(super) fn orphan(&mut self, slot: u32, vm_gid: Gid, vm_ca_guid: u64, now: u64) {
        let e = self.slab[slot as usize];
        let peer_gid = self.peers.get(e.peer).map(|p| p.gid);
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
                        self.tids_of(e.vm).tid(TidKind::Req, pv),
                    ),
                    State::RepRcvd => (
                        RejReason::ConsumerDefined,
                        MsgResponse::Rep,
                        e.remote_comm_id,
                        self.tids_of(e.vm).tid(TidKind::Req, pv),
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
        self.host_counters.bump(Group::TxMsgs, AttributeId::Dreq);
    }
}

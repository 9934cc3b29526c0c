//! The mlx4 comparison policies (`Policy::Mlx4Pre2020`, `Policy::Mlx4Post2020`): what
//! Linux mlx4's PF proxy does where pvcm's default rules differ. No protocol deadlines,
//! a delayed-delete timer armed by DREQ (and REJ after 2020), REJ(TIMEOUT) routed by the
//! peer's comm ID alone (after 2020) or not at all, allocation on any answer it has not
//! seen, no checks, no quarantine, no VM cleanup. The handlers call in here at the
//! points where the policies part ways, so that they read as the default rules.

use pvcm_wire::Gid;

use super::table::{State, flag};
use std::time::Duration;

use super::{Clock, DropReason, Mux, Policy, Time, VmId, WireVerdict};

impl<C: Clock> Mux<C> {
    /// mlx4's delayed delete: armed once, fires after `CM_CLEANUP_CACHE_TIMEOUT`.
    pub(super) fn legacy_arm(&mut self, slot: u32, now: u64) {
        if self.slab[slot as usize].has(flag::LEGACY_TIMER) {
            return;
        }
        self.ent(slot).flags |= flag::LEGACY_TIMER;
        let t = Time(now).after(self.cfg.policy.legacy_cleanup()).0;
        self.set_deadline(slot, t);
    }

    /// mlx4 allocates on any REP/MRA/REJ it has not seen, without checks.
    pub(super) fn legacy_guest_entry(
        &mut self,
        vm: u32,
        sl: u32,
        remote: u32,
        dst: Gid,
    ) -> Result<u32, DropReason> {
        let s = self.new_entry(vm, dst).ok_or(DropReason::TableFull)?;
        let e = self.ent(s);
        e.state = State::ReqRcvd;
        e.sl_cm_id = sl;
        e.remote_comm_id = remote;
        self.index_sl(vm, sl, s);
        self.assign_pv(s);
        Ok(s)
    }

    /// A VM's DREP (in any state but TimeWait): before 2020 the entry goes at once,
    /// after 2020 it waits for the DREQ's delayed delete.
    pub(super) fn legacy_guest_drep(&mut self, slot: u32, now: u64) {
        if self.cfg.policy == Policy::Mlx4Pre2020 {
            self.retire(slot, now);
        }
    }

    /// A REJ for a connection: the default retires it; before 2020 mlx4 deletes at once,
    /// after 2020 it arms the delayed delete.
    pub(super) fn connection_rejected(&mut self, slot: u32, now: u64) {
        match self.cfg.policy {
            Policy::Default | Policy::Mlx4Pre2020 => self.retire(slot, now),
            Policy::Mlx4Post2020 => self.legacy_arm(slot, now),
        }
    }

    /// A DREP from the wire: before 2020 the entry goes at once, after 2020 it waits for
    /// the DREQ's delayed delete.
    pub(super) fn legacy_wire_drep(&mut self, slot: u32, now: u64) {
        if self.cfg.policy == Policy::Mlx4Pre2020 {
            self.retire(slot, now);
        }
    }

    /// A REQ from the wire: delivered without an entry; after 2020 mlx4 keys the
    /// REJ(TIMEOUT) map by the peer's comm ID alone, for 30 s.
    pub(super) fn legacy_wire_req(&mut self, comm_id: u32, vm: u32, now: u64) -> WireVerdict {
        if self.cfg.policy == Policy::Mlx4Post2020 {
            let exp = Time(now).after(Duration::from_secs(30)).0;
            self.legacy_rej.insert(comm_id, (vm, exp));
        }
        WireVerdict::ToVm(VmId(vm))
    }

    /// A REJ(TIMEOUT) without our ID: not routed before 2020, by the peer's comm ID alone
    /// after 2020.
    pub(super) fn legacy_wire_rej_timeout(
        &self,
        comm_id: u32,
        now: u64,
    ) -> Result<WireVerdict, DropReason> {
        if self.cfg.policy != Policy::Mlx4Post2020 {
            return Err(DropReason::NoRoute);
        }
        match self.legacy_rej.get(&comm_id) {
            Some(&(vm, exp)) if exp > now => match self.vms.get(vm as usize) {
                Some(v) if v.attached => Ok(WireVerdict::ToVm(VmId(vm))),
                _ => Err(DropReason::Absorbed),
            },
            _ => Err(DropReason::NoRoute),
        }
    }
}

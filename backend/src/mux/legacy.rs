//! The mlx4 comparison policies (`Policy::Mlx4Pre2020`, `Policy::Mlx4Post2020`): what
//! Linux mlx4's PF proxy does where pvcm's default rules differ. No protocol deadlines,
//! a delayed-delete timer armed by DREQ (and REJ after 2020), REJ(TIMEOUT) routed by the
//! peer's comm ID alone (after 2020) or not at all, allocation on any answer it has not
//! seen, no checks, no quarantine, no VM cleanup.
//!
//! Each way the policies part is a named behaviour, a predicate on [`Policy`] below,
//! which the handlers ask where it matters; where mlx4 does something of its own
//! instead, they call its handler here. So the handlers read as the default rules.

use pvcm_wire::Gid;

use super::table::{State, flag};
use std::time::Duration;

use super::{Clock, DropReason, Mux, Policy, Time, VmId, WireVerdict};

/// The behaviours in which the policies differ. Each is true for [`Policy::Default`]
/// and false for both mlx4 policies; what mlx4 does instead is said with each.
impl Policy {
    /// Entries live by the protocol's own deadlines: a handshake as long as the CM
    /// timeouts its REQ and MRAs carry, a DREQ through the peer's retries, then
    /// TimeWait. mlx4 sets none of these: an entry lives until its delayed delete
    /// (`legacy_arm`), armed by a DREQ (and after 2020 by a REJ), and goes when it fires.
    pub(crate) fn protocol_deadlines(self) -> bool {
        self == Policy::Default
    }

    /// A retired `pv_cm_id` is held in quarantine before its slot is reused, and a
    /// rejected REQ keeps the VM's comm ID mapped through it (a REQ retry crossing the
    /// REJ is dropped). mlx4 frees an entry at once.
    pub(crate) fn quarantine(self) -> bool {
        self == Policy::Default
    }

    /// What a VM sends is checked (source GID, QPN range, CA GUID, quota) and a wire MAD
    /// must be addressed to the GID of the VM it names. mlx4 checks nothing.
    pub(crate) fn checks(self) -> bool {
        self == Policy::Default
    }

    /// A MAD that its entry's state does not expect, or that names nothing the mux
    /// knows, is dropped and counted. mlx4 forwards it.
    pub(crate) fn drops_unexpected(self) -> bool {
        self == Policy::Default
    }

    /// A REQ from the wire gets an entry at once, found by its sender's (CA GUID, comm
    /// ID) (`remote.rs`): duplicates refresh it, the passive VM's first answer links to
    /// it, a stateless REJ or a REJ(TIMEOUT) ends it. mlx4 delivers the REQ without an
    /// entry, allocates one for any answer of the VM it has not seen (found by the VM's
    /// comm ID alone), and routes a REJ(TIMEOUT) by the peer's comm ID alone (after
    /// 2020) or not at all.
    pub(crate) fn tracks_received_reqs(self) -> bool {
        self == Policy::Default
    }

    /// A REQ repeating the VM's comm ID is a retry only with the same TID (another TID
    /// is a new connection). mlx4 takes any REQ with the comm ID as the same one.
    pub(crate) fn retry_needs_same_tid(self) -> bool {
        self == Policy::Default
    }

    /// A DREQ for an unknown connection is answered with a stateless DREP, as Linux's
    /// `cm_issue_drep()` does, so the peer stops retrying. mlx4 drops it, and the peer
    /// retries until it gives up.
    pub(crate) fn stateless_drep(self) -> bool {
        self == Policy::Default
    }

    /// The mux answers from what it holds where the Linux CM answers without its
    /// application: a DREQ retry in TimeWait gets the DREP again, a REP retry of an
    /// established connection the RTU again, a REQ retry of a detached VM's half-open
    /// connection its REJ again (`detach.rs`). mlx4 forwards them to the VM, whose CM may
    /// be gone, and the peer retries until it gives up.
    pub(crate) fn answers_from_held_state(self) -> bool {
        self == Policy::Default
    }

    /// A detached VM's connections are finished on its behalf (DREQs, REJs, DREPs).
    /// mlx4 leaves them to the delayed delete, and the peers to their timeouts.
    pub(crate) fn cleans_up_detached_vms(self) -> bool {
        self == Policy::Default
    }

    /// The mux's state can be journaled and restored (`--state-dir`), moved with a VM
    /// (migration) and given per-VM ID ranges. mlx4's entries carry no deadlines that
    /// a restored or migrated table could be rebuilt from.
    pub(crate) fn transfers_state(self) -> bool {
        self == Policy::Default
    }
}

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

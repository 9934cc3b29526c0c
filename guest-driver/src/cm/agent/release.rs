//! Handlers of the disconnection messages (DREQ, DREP).

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmRepr, drep, dreq};
use pvcm_wire::mad::{self, AttributeId, Header};
use pvcm_wire::timeout::linux_ms;

use crate::cm::counters::DropReason;
use crate::cm::event::State;
use crate::time::Time;

use super::Agent;

impl Agent {
    pub(super) fn on_dreq(&mut self, h: &Header, r: &dreq::Repr<'_>, src: Gid, now: Time) {
        let Some(slot) = self.by_ids(r.remote_comm_id, r.local_comm_id) else {
            // Linux cm_issue_drep(): answer anyway, count a duplicate.
            self.dup(AttributeId::Dreq);
            let d = CmRepr::Drep(drep::Repr {
                local_comm_id: r.remote_comm_id,
                remote_comm_id: r.local_comm_id,
                private_data: &[],
            });
            self.send(src, &Header::cm_send(AttributeId::Drep, h.tid), &d, true);
            return;
        };
        if self.conns[slot as usize].local_qpn != r.remote_qpn_eecn {
            self.drops.bump(DropReason::QpnMismatch);
            return;
        }
        match self.conns[slot as usize].state {
            State::RepSent | State::MraRepRcvd | State::DreqSent | State::Established => {
                // Our own DREQ, if any, crossed the peer's: it is answered (or, still
                // queued, moot), as Linux cancels it.
                self.pace_answered(slot);
                self.disarm(slot);
                let c = &mut self.conns[slot as usize];
                c.msg = None;
                c.state = State::DreqRcvd;
                c.tid = h.tid;
                // By default the DREP goes out at once (the QP would go to error), then
                // TimeWait, then the application hears of it: a late application never
                // makes the peer retry its DREQ. `auto_drep: false` (Linux): the DREP
                // waits for `disconnect()`/`destroy()`.
                if self.cfg.auto_drep || !self.conns[slot as usize].app {
                    self.send_drep(slot, &[]);
                    self.enter_timewait(slot, now);
                }
                self.report_disconnect(slot);
            }
            State::Timewait => {
                self.dup(AttributeId::Dreq);
                // A destroyed connection's one DREQ still waiting for its window is
                // answered by the peer's: withdrawn (it would draw a second DREP), and
                // the TimeWait that waited for it starts now.
                if self.pace_queued(slot) {
                    self.pace_release(slot);
                    let wait = linux_ms(self.conns[slot as usize].av_timeout);
                    self.arm(slot, now.after_ms(wait));
                }
                let c = &self.conns[slot as usize];
                if c.reply.is_some_and(|m| {
                    AttributeId::from_u16(mad::field::ATTR_ID.get(&m) as u16)
                        == Some(AttributeId::Drep)
                }) {
                    self.resend_reply(slot, h.tid);
                } else {
                    let d = CmRepr::Drep(drep::Repr {
                        local_comm_id: c.local_id,
                        remote_comm_id: c.remote_id,
                        private_data: &[],
                    });
                    let dst = c.remote_gid;
                    self.send(dst, &Header::cm_send(AttributeId::Drep, h.tid), &d, true);
                }
            }
            State::DreqRcvd => self.dup(AttributeId::Dreq),
            _ => self.drops.bump(DropReason::BadState),
        }
    }

    pub(super) fn on_drep(&mut self, r: &drep::Repr<'_>, now: Time) {
        let Some(slot) = self.by_ids(r.remote_comm_id, r.local_comm_id) else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        // The DREP answers our DREQ, also the one DREQ of a destroyed connection that
        // is in TimeWait already (a DREQ still queued was never sent: not this one's).
        if !self.pace_queued(slot) {
            self.pace_answered(slot);
        }
        match self.conns[slot as usize].state {
            State::DreqSent | State::DreqRcvd => {
                self.disarm(slot);
                self.report_disconnect(slot);
                self.enter_timewait(slot, now);
            }
            _ => self.drops.bump(DropReason::BadState),
        }
    }
}

//! Receiving: one MAD parsed and dispatched to its handler, and the handlers of the
//! messages that belong to no exchange (LAP, ClassPortInfo).

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, CmRepr, class_port_info, lap};
use pvcm_wire::mad::{self, AttributeId, Header, MAD_LEN, Method};

use crate::cm::counters::{DropReason, Group};
use crate::cm::event::State;
use crate::time::Time;

use super::Agent;

impl Agent {
    /// Handles one MAD from the device: `mad` is the 256-byte MAD (longer buffers are
    /// cut to 256 bytes), `src` the sender's GID from the message header. Timers due at
    /// `now` run first. Malformed input is counted in [`Agent::drops`], never a panic.
    pub fn handle_mad(&mut self, mad: &[u8], src: Gid, now: Time) {
        self.poll(now);
        self.receive(mad, src, now);
        self.pace_flush(now);
    }

    pub(super) fn receive(&mut self, mad: &[u8], src: Gid, now: Time) {
        let mad = mad.get(..MAD_LEN).unwrap_or(mad);
        let attr = match CmMad::new_checked(mad) {
            Ok(m) => m.attr(),
            Err(e) => {
                self.drops.bump(DropReason::of_error(&e));
                return;
            }
        };
        match attr {
            AttributeId::ClassPortInfo => self.counters.class_port_info_rx += 1,
            a => self.counters.bump(Group::RxMsgs, a),
        }
        let (h, r) = match CmRepr::parse(mad) {
            Ok(x) => x,
            Err(e) => {
                self.drops.bump(DropReason::of_error(&e));
                return;
            }
        };
        match r {
            CmRepr::Req(r) => self.on_req(&h, &r, src, now),
            CmRepr::Mra(r) => self.on_mra(&r, now),
            CmRepr::Rej(r) => self.on_rej(&r, now),
            CmRepr::Rep(r) => self.on_rep(&h, &r, src, now),
            CmRepr::Rtu(r) => self.on_rtu(&r),
            CmRepr::Dreq(r) => self.on_dreq(&h, &r, src, now),
            CmRepr::Drep(r) => self.on_drep(&r, now),
            CmRepr::SidrReq(r) => self.on_sidr_req(&h, &r, src),
            CmRepr::SidrRep(r) => self.on_sidr_rep(&r),
            CmRepr::Lap(r) => self.on_lap(&r),
            CmRepr::Apr(_) => self.drops.bump(DropReason::Unsolicited),
            CmRepr::ClassPortInfo(_) => self.on_class_port_info(&h, src),
        }
    }

    pub(super) fn dup(&mut self, a: AttributeId) {
        self.counters.bump(Group::RxDuplicates, a);
    }

    pub(super) fn on_lap(&mut self, r: &lap::Repr<'_>) {
        // Alternate paths do not exist on RoCE: Linux's cm_lap_handler returns -EINVAL
        // there, so the LAP is dropped and nothing is sent (no APR, no MRA). Counted.
        let reason = match self.by_ids(r.remote_comm_id, r.local_comm_id) {
            None => DropReason::UnknownConnection,
            Some(s) if self.conns[s as usize].state == State::Established => DropReason::LapOnRoce,
            Some(_) => DropReason::BadState,
        };
        self.drops.bump(reason);
    }

    pub(super) fn on_class_port_info(&mut self, h: &Header, src: Gid) {
        if h.method != Method::Get {
            self.drops.bump(DropReason::Unsolicited);
            return;
        }
        let info = class_port_info::Repr {
            base_version: mad::BASE_VERSION,
            class_version: mad::CM_CLASS_VERSION,
            resp_time: self.cfg.resp_time,
            ..Default::default()
        };
        let resp = Header {
            method: Method::GetResp,
            status: 0,
            class_specific: 0,
            tid: h.tid,
            attr_id: AttributeId::ClassPortInfo,
            attr_mod: h.attr_mod,
        };
        self.send(src, &resp, &CmRepr::ClassPortInfo(info), false);
    }
}

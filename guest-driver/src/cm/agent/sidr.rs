//! Handlers of the SIDR messages (SIDR_REQ, SIDR_REP).

use pvcm_wire::Gid;
use pvcm_wire::cm::{SidrStatus, sidr_rep, sidr_req};
use pvcm_wire::mad::{AttributeId, Header};

use crate::cm::counters::DropReason;
use crate::cm::event::{Event, State};

use super::Agent;

impl Agent {
    pub(super) fn on_sidr_req(&mut self, h: &Header, r: &sidr_req::Repr<'_>, src: Gid) {
        let key = (src, r.request_id);
        if self.sidr_rcvd.contains_key(&key) {
            self.dup(AttributeId::SidrReq);
            return;
        }
        let Some(&lslot) = self.listeners.get(&r.service_id) else {
            self.send_sidr_rep(
                src,
                h.tid,
                r.request_id,
                r.service_id,
                SidrStatus::Unsupported,
                0,
                0,
                &[],
            );
            return;
        };
        if let Some((qpn, qkey)) = self.conns[lslot as usize].sidr_auto {
            self.send_sidr_rep(
                src,
                h.tid,
                r.request_id,
                r.service_id,
                SidrStatus::Success,
                qpn,
                qkey,
                &[],
            );
            return;
        }
        let listen_id = self.id_of(lslot);
        let slot = self.alloc_slot(false);
        let c = &mut self.conns[slot as usize];
        c.state = State::SidrReqRcvd;
        c.listen = Some(listen_id);
        c.remote_id = r.request_id;
        c.remote_gid = src;
        c.service_id = r.service_id;
        c.tid = h.tid;
        c.sidr_key = Some(key);
        self.sidr_rcvd.insert(key, slot);
        let id = self.id_of(slot);
        self.event(Event::SidrRequest {
            id,
            listen_id,
            remote_gid: src,
            service_id: r.service_id,
            private_data: r.private_data.to_vec(),
        });
    }

    pub(super) fn on_sidr_rep(&mut self, r: &sidr_rep::Repr<'_>) {
        let Some(slot) = self
            .by_local(r.request_id)
            .filter(|s| self.conns[*s as usize].state == State::SidrReqSent)
        else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        let id = self.id_of(slot);
        self.event(Event::SidrResolved {
            id,
            status: r.status,
            qpn: r.qpn,
            qkey: r.qkey,
            private_data: r.private_data.to_vec(),
        });
        self.go_idle(slot);
    }
}

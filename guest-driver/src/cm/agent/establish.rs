//! Handlers of the connection-establishment messages (REQ, MRA, REJ, REP, RTU), one
//! per message as in Linux `cm.c`.

use pvcm_wire::Gid;
use pvcm_wire::cm::{MsgResponse, RejReason, mra, rej, rep, req, rtu};
use pvcm_wire::mad::{AttributeId, Header};
use pvcm_wire::timeout::linux_ms;

use crate::cm::config::cm_ack_timeout;
use crate::cm::counters::DropReason;
use crate::cm::event::{CmId, Event, State};
use crate::cm::qp_attr::{PathAv, QpParams};
use crate::time::Time;

use super::Agent;

impl Agent {
    pub(super) fn on_req(&mut self, h: &Header, r: &req::Repr<'_>, src: Gid, now: Time) {
        if self.req_matched(h, r, src, now) {
            return;
        }
        let Some(lslot) = self.req_admitted(h, r, src) else {
            return;
        };
        let slot = self.alloc_slot(false);
        let Some(local_id) = self.comm_ids.alloc(slot) else {
            self.free_slot(slot);
            self.rej_req(h, r, src, RejReason::NoResources, &[]);
            return;
        };
        let listen_id = self.id_of(lslot);
        self.req_rcvd(slot, listen_id, local_id, h, r, src);
        self.index_remote(slot);
        let id = self.id_of(slot);
        self.event(Event::ConnectRequest {
            id,
            listen_id,
            remote_gid: src,
            service_id: r.service_id,
            remote_qpn: r.local_qpn,
            private_data: r.private_data.to_vec(),
        });
        if let Some(d) = self.cfg.mra_delay {
            self.arm(slot, now.after(d));
        }
    }

    /// A REQ that belongs to a connection we have (Linux `cm_match_req`): a duplicate
    /// or a stale connection's. Handles it and says so.
    fn req_matched(&mut self, h: &Header, r: &req::Repr<'_>, src: Gid, now: Time) -> bool {
        // Duplicate (Linux cm_match_req -> cm_dup_req_handler): the MRA if we are in
        // MRA_REQ_SENT (sent now for the first time if it was delayed), else dropped. A
        // connection in TimeWait is no longer indexed by its remote comm ID, so a REQ
        // reusing it is a new request, as in Linux.
        if let Some(&slot) = self.remote_ids.get(&(r.local_ca_guid, r.local_comm_id)) {
            self.dup(AttributeId::Req);
            self.mra_owed(slot, State::ReqRcvd);
            if self.conns[slot as usize].state == State::MraReqSent {
                self.resend_reply(slot, h.tid);
            }
            return true;
        }
        // Stale connection: the peer's QP is still connected to one of ours (IBTA 12.4.1).
        // A connection in TimeWait is not in this index: its QPN may be reused at once.
        if let Some(&old) = self.remote_qpns.get(&(r.local_ca_guid, r.local_qpn)) {
            self.rej_req(h, r, src, RejReason::StaleConn, &[]);
            if self.conns[old as usize].state == State::Established {
                self.send_stale_dreq(old, now);
            }
            return true;
        }
        false
    }

    /// The listener slot a new REQ goes to, or `None` after rejecting it: no listener
    /// for its service ID, no room for another connection, or a primary path to a GID
    /// that is none of ours (the primary and the further ones).
    fn req_admitted(&mut self, h: &Header, r: &req::Repr<'_>, src: Gid) -> Option<u32> {
        let Some(&lslot) = self.listeners.get(&r.service_id) else {
            self.rej_req(h, r, src, RejReason::InvalidServiceId, &[]);
            return None;
        };
        let full =
            self.cfg.max_connections != 0 && self.connections >= self.cfg.max_connections as usize;
        if full {
            self.rej_req(h, r, src, RejReason::NoResources, &[]);
            return None;
        }
        if !self.cfg.holds(r.primary_path.remote_gid) {
            let gid = self.cfg.gid.0;
            self.rej_req(h, r, src, RejReason::InvalidGid, &gid);
            return None;
        }
        Some(lslot)
    }

    /// Rejects a REQ we keep no connection for.
    fn rej_req(&mut self, h: &Header, r: &req::Repr<'_>, src: Gid, reason: RejReason, ari: &[u8]) {
        self.send_rej(
            src,
            h.tid,
            0,
            r.local_comm_id,
            MsgResponse::Req,
            reason,
            ari,
            &[],
        );
    }

    /// The connection record of a new REQ (state REQ_RCVD), as Linux `cm_req_handler`
    /// fills it.
    fn req_rcvd(
        &mut self,
        slot: u32,
        listen_id: CmId,
        local_id: u32,
        h: &Header,
        r: &req::Repr<'_>,
        src: Gid,
    ) {
        let c = &mut self.conns[slot as usize];
        c.state = State::ReqRcvd;
        c.listen = Some(listen_id);
        c.local_id = local_id;
        c.holds_id = true;
        c.remote_id = r.local_comm_id;
        c.remote_ca_guid = r.local_ca_guid;
        c.remote_gid = src;
        c.remote_qpn = r.local_qpn;
        c.service_id = r.service_id;
        c.tid = h.tid;
        // Linux cm_req_handler: the peer's local response timeout, its retries; the
        // path's ACK timeout becomes av.timeout (packet life - 1, + 1).
        c.timeout_ms = linux_ms(r.local_cm_response_timeout);
        c.max_retries = r.max_cm_retries;
        c.av_timeout = r.primary_path.local_ack_timeout.max(1);
        c.req_responder_resources = r.responder_resources;
        c.req_initiator_depth = r.initiator_depth;
        // Linux cm_req_handler: the REQ's values, seen from this side.
        c.qp = QpParams {
            local_qpn: 0,
            remote_qpn: r.local_qpn,
            sq_psn: r.starting_psn,
            rq_psn: 0,
            path_mtu: r.path_mtu,
            retry_count: r.retry_count,
            rnr_retry_count: r.rnr_retry_count,
            responder_resources: r.initiator_depth,
            initiator_depth: r.responder_resources,
            path: PathAv {
                remote_gid: src,
                local_gid: r.primary_path.remote_gid,
                flow_label: r.primary_path.flow_label,
                hop_limit: r.primary_path.hop_limit,
                traffic_class: r.primary_path.traffic_class,
                sl: r.primary_path.sl,
            },
            peer_flow_control: r.end_to_end_flow_control,
            peer_srq: r.srq,
        };
    }

    pub(super) fn on_mra(&mut self, r: &mra::Repr<'_>, now: Time) {
        let (slot, waiting, extended) = match r.message_mraed {
            MsgResponse::Req => (
                self.by_ids(r.remote_comm_id, 0),
                State::ReqSent,
                State::MraReqRcvd,
            ),
            MsgResponse::Rep => (
                self.by_ids(r.remote_comm_id, r.local_comm_id),
                State::RepSent,
                State::MraRepRcvd,
            ),
            MsgResponse::Other => {
                // We never send a LAP: nothing to be acknowledged.
                self.drops.bump(DropReason::Unsolicited);
                return;
            }
        };
        let Some(slot) = slot else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        let state = self.conns[slot as usize].state;
        if state == waiting {
            // The peer has the REQ: its window slot is free.
            self.pace_answered(slot);
            // Linux cm_mra_handler -> ib_modify_mad(): the wait becomes service timeout
            // + packet life, for this attempt and every remaining retry.
            let c = &mut self.conns[slot as usize];
            c.state = extended;
            let wait = linux_ms(r.service_timeout) + linux_ms(c.av_timeout);
            c.timeout_ms = wait;
            self.arm(slot, now.after_ms(wait));
        } else if state == extended {
            self.dup(AttributeId::Mra);
        } else {
            self.drops.bump(DropReason::BadState);
        }
    }

    pub(super) fn on_rej(&mut self, r: &rej::Repr<'_>, now: Time) {
        // Linux cm_acquire_rejected_id().
        let slot = if r.reason == RejReason::Timeout {
            r.timeout_ca_guid()
                .and_then(|g| self.remote_ids.get(&(g, r.local_comm_id)).copied())
        } else if r.message_rejected == MsgResponse::Req {
            self.by_ids(r.remote_comm_id, 0)
        } else {
            self.by_ids(r.remote_comm_id, r.local_comm_id)
        };
        let Some(slot) = slot else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        let id = self.id_of(slot);
        let state = self.conns[slot as usize].state;
        let timewait = match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::RepSent
            | State::MraRepRcvd
            | State::ReqRcvd
            | State::MraReqSent => r.reason == RejReason::StaleConn,
            State::DreqSent | State::RepRcvd | State::MraRepSent | State::Established => true,
            _ => {
                self.drops.bump(DropReason::BadState);
                return;
            }
        };
        self.pace_answered(slot);
        if self.conns[slot as usize].app {
            self.event(Event::Rejected {
                id,
                reason: r.reason,
                ari: r.ari.to_vec(),
                private_data: r.private_data.to_vec(),
            });
        }
        if timewait {
            self.disarm(slot);
            self.enter_timewait(slot, now);
        } else {
            self.go_idle(slot);
        }
    }

    pub(super) fn on_rep(&mut self, h: &Header, r: &rep::Repr<'_>, src: Gid, now: Time) {
        let Some(slot) = self.by_local(r.remote_comm_id) else {
            // A REP for a connection we do not have (destroyed, or never ours): dropped
            // and counted, as Linux's cm_rep_handler does (no REJ).
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        let c = &self.conns[slot as usize];
        let fresh = matches!(c.state, State::ReqSent | State::MraReqRcvd) && c.remote_id == 0;
        if !fresh {
            if c.remote_id == r.local_comm_id && c.remote_ca_guid == r.local_ca_guid {
                // Linux cm_dup_rep_handler.
                self.dup(AttributeId::Rep);
                self.mra_owed(slot, State::RepRcvd);
                let state = self.conns[slot as usize].state;
                if matches!(state, State::Established | State::MraRepSent) {
                    self.resend_reply(slot, h.tid);
                }
            } else {
                self.drops.bump(DropReason::BadState);
            }
            return;
        }
        if self
            .remote_ids
            .contains_key(&(r.local_ca_guid, r.local_comm_id))
        {
            // Another connection already has this peer ID.
            self.drops.bump(DropReason::BadState);
            return;
        }
        if let Some(&old) = self.remote_qpns.get(&(r.local_ca_guid, r.local_qpn)) {
            // Stale connection (IBTA 12.9.8.3.1); our REQ keeps waiting, as in Linux.
            self.send_rej(
                src,
                h.tid,
                r.remote_comm_id,
                r.local_comm_id,
                MsgResponse::Rep,
                RejReason::StaleConn,
                &[],
                &[],
            );
            if self.conns[old as usize].state == State::Established {
                self.send_stale_dreq(old, now);
            }
            return;
        }
        self.pace_answered(slot);
        let c = &mut self.conns[slot as usize];
        c.remote_id = r.local_comm_id;
        c.remote_ca_guid = r.local_ca_guid;
        c.remote_qpn = r.local_qpn;
        c.av_timeout = cm_ack_timeout(r.target_ack_delay, c.av_timeout.saturating_sub(1));
        // Linux cm_rep_handler: the peer's PSN is ours to send with; its resources bound
        // ours; its RNR retry count is for our QP.
        c.qp.remote_qpn = r.local_qpn;
        c.qp.sq_psn = r.starting_psn;
        c.qp.rnr_retry_count = r.rnr_retry_count;
        c.qp.initiator_depth = r.responder_resources;
        c.qp.responder_resources = r.initiator_depth;
        c.qp.peer_flow_control = r.end_to_end_flow_control;
        c.qp.peer_srq = r.srq;
        c.msg = None;
        let auto = c.auto_rtu;
        self.disarm(slot);
        self.index_remote(slot);
        let id = self.id_of(slot);
        if auto {
            self.send_rtu(slot, &[]);
            self.conns[slot as usize].state = State::Established;
            self.event(Event::Established {
                id,
                remote_qpn: r.local_qpn,
                private_data: r.private_data.to_vec(),
            });
        } else {
            self.conns[slot as usize].state = State::RepRcvd;
            self.event(Event::ConnectResponse {
                id,
                remote_qpn: r.local_qpn,
                private_data: r.private_data.to_vec(),
            });
            if let Some(d) = self.cfg.mra_delay {
                self.arm(slot, now.after(d));
            }
        }
    }

    pub(super) fn on_rtu(&mut self, r: &rtu::Repr<'_>) {
        let Some(slot) = self.by_ids(r.remote_comm_id, r.local_comm_id) else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        match self.conns[slot as usize].state {
            State::RepSent | State::MraRepRcvd => {
                self.establish_passive(slot, r.private_data.to_vec());
            }
            _ => self.dup(AttributeId::Rtu),
        }
    }

    /// The passive side's connection in `slot` (REP_SENT or MRA_REP_RCVD) is
    /// established, by the peer's RTU or by its QP seeing data (`establish`): the REP's
    /// retries stop and `Established` is reported with `private_data` (the RTU's).
    pub(in crate::cm) fn establish_passive(&mut self, slot: u32, private_data: Vec<u8>) {
        self.disarm(slot);
        let c = &mut self.conns[slot as usize];
        c.msg = None;
        c.state = State::Established;
        let remote_qpn = c.remote_qpn;
        let id = self.id_of(slot);
        self.event(Event::Established {
            id,
            remote_qpn,
            private_data,
        });
    }
}

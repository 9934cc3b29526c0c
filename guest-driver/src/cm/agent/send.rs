//! Sending: encoding MADs into the outbox, and the format functions of the
//! messages the agent sends (as Linux `cm.c`'s `cm_format_*` with their senders).

use pvcm_wire::Gid;
use pvcm_wire::cm::{
    CmRepr, MsgResponse, PathRepr, RejReason, SidrStatus, drep, dreq, mra, rej, req, rtu, sidr_rep,
};
use pvcm_wire::mad::{self, AttributeId, Header, MAD_LEN};

use crate::cm::config::{ConnectOptions, cm_ack_timeout};
use crate::cm::counters::{DropReason, Group};
use crate::cm::event::State;
use crate::cm::pacing::Request;
use crate::time::Time;

use super::{Agent, OutMad};

/// The values a REQ settles for this side, chosen once: the REQ carries them and the
/// connection's QP parameters keep them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReqValues {
    pub local_id: u32,
    /// The REQ's TID.
    pub tid: u64,
    pub local_qpn: u32,
    pub psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub path_mtu: u8,
    pub flow_label: u32,
}

impl Agent {
    /// The REQ of an active connection to `dest` (Linux `cm_format_req`).
    pub(crate) fn format_req<'a>(
        &self,
        dest: Gid,
        service_id: u64,
        private_data: &'a [u8],
        opts: &ConnectOptions,
        v: &ReqValues,
    ) -> req::Repr<'a> {
        let routed = opts.hop_limit > 1;
        req::Repr {
            local_comm_id: v.local_id,
            vendor_id: 0,
            service_id,
            local_ca_guid: self.cfg.ca_guid,
            local_qkey: 0,
            local_qpn: v.local_qpn,
            responder_resources: v.responder_resources,
            local_eecn: 0,
            initiator_depth: v.initiator_depth,
            remote_eecn: 0,
            remote_cm_response_timeout: opts.remote_cm_response_timeout & 0x1F,
            transport: opts.transport,
            end_to_end_flow_control: opts.flow_control,
            starting_psn: v.psn,
            local_cm_response_timeout: opts.local_cm_response_timeout & 0x1F,
            retry_count: opts.retry_count & 0x7,
            partition_key: self.cfg.pkey,
            path_mtu: v.path_mtu,
            rdc_exists: false,
            rnr_retry_count: opts.rnr_retry_count & 0x7,
            max_cm_retries: opts.max_cm_retries & 0xF,
            srq: opts.srq,
            primary_path: PathRepr {
                local_lid: if routed { 0xFFFF } else { self.cfg.lid },
                remote_lid: if routed { 0xFFFF } else { 0 },
                local_gid: opts.local_gid.unwrap_or(self.cfg.gid),
                remote_gid: dest,
                flow_label: v.flow_label,
                packet_rate: 0,
                traffic_class: opts.traffic_class,
                hop_limit: opts.hop_limit,
                sl: opts.sl & 0xF,
                subnet_local: !routed,
                local_ack_timeout: cm_ack_timeout(self.cfg.ack_delay, opts.packet_life_time),
            },
            alternate_path: PathRepr::default(),
            sap_supported: false,
            private_data,
        }
    }

    pub(crate) fn encode(&mut self, h: &Header, r: &CmRepr<'_>) -> Option<[u8; MAD_LEN]> {
        let mut buf = [0u8; MAD_LEN];
        match r.emit(h, &mut buf) {
            Ok(()) => Some(buf),
            Err(_) => {
                self.drops.bump(DropReason::EmitFailed);
                None
            }
        }
    }

    /// Queues a MAD and counts it (`retry`: a timer retry or an answer re-sent because
    /// of a duplicate, as Linux counts them).
    pub(crate) fn push(&mut self, dst: Gid, mad: [u8; MAD_LEN], retry: bool) {
        match AttributeId::from_u16(mad::field::ATTR_ID.get(&mad) as u16) {
            Some(AttributeId::ClassPortInfo) => self.counters.class_port_info_tx += 1,
            Some(a) => {
                self.counters.bump(Group::TxMsgs, a);
                if retry {
                    self.counters.bump(Group::TxRetries, a);
                }
            }
            None => {}
        }
        self.outbox.push_back(OutMad { dst, mad });
    }

    /// Encodes and queues; returns the bytes sent.
    pub(crate) fn send(
        &mut self,
        dst: Gid,
        h: &Header,
        r: &CmRepr<'_>,
        retry: bool,
    ) -> Option<[u8; MAD_LEN]> {
        let buf = self.encode(h, r)?;
        self.push(dst, buf, retry);
        Some(buf)
    }

    /// A TID the agent starts: Linux `cm_form_tid()`.
    pub(crate) fn form_tid(&self, local_id: u32) -> u64 {
        (u64::from(self.cfg.hi_tid) << 32) | u64::from(local_id)
    }

    /// A REJ not tied to a connection record (Linux `cm_issue_rej()` and friends).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_rej(
        &mut self,
        dst: Gid,
        tid: u64,
        local_id: u32,
        remote_id: u32,
        msg: MsgResponse,
        reason: RejReason,
        ari: &[u8],
        private_data: &[u8],
    ) {
        let r = CmRepr::Rej(rej::Repr {
            local_comm_id: local_id,
            remote_comm_id: remote_id,
            message_rejected: msg,
            reason,
            ari,
            private_data,
        });
        self.send(dst, &Header::cm_send(AttributeId::Rej, tid), &r, false);
    }

    /// The application has not answered a REQ or REP in time: enter MRA_REQ_SENT /
    /// MRA_REP_SENT *without sending anything*, as rdma_cm's `ib_send_cm_mra()` with
    /// `IB_CM_MRA_FLAG_DELAY` does. The MRA is built now and goes out only in answer to a
    /// duplicate (Linux `cm_dup_req_handler` / `cm_dup_rep_handler`): an MRA on its own
    /// would make a Linux peer wait `ms(service timeout)` (~66 s) per remaining retry.
    pub(super) fn delay_mra(&mut self, slot: u32, which: MsgResponse, next: State) {
        let c = &self.conns[slot as usize];
        let r = CmRepr::Mra(mra::Repr {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            message_mraed: which,
            service_timeout: self.cfg.mra_service_timeout,
            private_data: &[],
        });
        let tid = c.tid;
        let built = self.encode(&Header::cm_send(AttributeId::Mra, tid), &r);
        let c = &mut self.conns[slot as usize];
        c.reply_unsent = built.is_some();
        c.reply = built;
        c.state = next;
    }

    /// A duplicate arrived while the application has not answered the REQ or REP yet
    /// (`waiting`: REQ_RCVD or REP_RCVD) and `mra_delay` has not passed: rdma_cm is in
    /// MRA_REQ_SENT / MRA_REP_SENT from the moment its handler returned, so the duplicate
    /// is owed the MRA now, not dropped. Enters the MRA state early (the caller sends it).
    pub(super) fn mra_owed(&mut self, slot: u32, waiting: State) {
        if self.cfg.mra_delay.is_none() || self.conns[slot as usize].state != waiting {
            return;
        }
        self.disarm(slot);
        match waiting {
            State::ReqRcvd => self.delay_mra(slot, MsgResponse::Req, State::MraReqSent),
            _ => self.delay_mra(slot, MsgResponse::Rep, State::MraRepSent),
        }
    }

    /// Answers a duplicate with the last answer (MRA, RTU, DREP) and this TID. A re-sent
    /// answer counts as a retry; a delayed MRA going out for the first time does not.
    pub(super) fn resend_reply(&mut self, slot: u32, tid: u64) {
        let c = &mut self.conns[slot as usize];
        if let Some(mut m) = c.reply {
            let first = std::mem::take(&mut c.reply_unsent);
            mad::field::TID.set(&mut m, tid);
            let dst = c.remote_gid;
            self.push(dst, m, !first);
        }
    }

    /// Sends the RTU and stores it for duplicate REPs.
    pub(crate) fn send_rtu(&mut self, slot: u32, private_data: &[u8]) {
        let c = &self.conns[slot as usize];
        let r = CmRepr::Rtu(rtu::Repr {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            private_data,
        });
        let (dst, tid) = (c.remote_gid, c.tid);
        let sent = self.send(dst, &Header::cm_send(AttributeId::Rtu, tid), &r, false);
        self.conns[slot as usize].reply = sent;
    }

    /// Sends a DREQ from ESTABLISHED; `retried`: keep it for retries (DREQ_SENT),
    /// else it goes once (destroy). The application's disconnects are paced like REQs
    /// (a burst must not overrun the peer either); the DREQ for a stale connection is
    /// not ([`Agent::send_stale_dreq`]).
    pub(crate) fn send_dreq(&mut self, slot: u32, private_data: &[u8], retried: bool, now: Time) {
        self.dreq(slot, private_data, retried, true, now);
    }

    /// The DREQ for a connection the peer has just called stale (its REQ or REP named
    /// our connected QPN): sent at once with the REJ(STALE_CONN), as Linux sends both,
    /// never behind a window of disconnects; one per stale connection, rare.
    pub(super) fn send_stale_dreq(&mut self, slot: u32, now: Time) {
        self.dreq(slot, &[], true, false, now);
    }

    pub(super) fn dreq(
        &mut self,
        slot: u32,
        private_data: &[u8],
        retried: bool,
        paced: bool,
        now: Time,
    ) {
        let c = &self.conns[slot as usize];
        let tid = self.form_tid(c.local_id);
        let r = CmRepr::Dreq(dreq::Repr {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            remote_qpn_eecn: c.remote_qpn,
            private_data,
        });
        let dst = c.remote_gid;
        let Some(mad) = self.encode(&Header::cm_send(AttributeId::Dreq, tid), &r) else {
            return;
        };
        if retried {
            let c = &mut self.conns[slot as usize];
            c.tid = tid;
            c.msg = Some(mad);
            c.retries_left = c.max_retries;
            c.state = State::DreqSent;
        }
        let sent = if paced {
            self.send_request(slot, dst, Request::Disconnect, mad)
        } else {
            self.push(dst, mad, false);
            true
        };
        if retried && sent {
            let t = self.conns[slot as usize].timeout_ms;
            self.arm(slot, now.after_ms(t));
        }
    }

    /// Sends the DREP answering the DREQ in `conn.tid` and stores it for duplicates.
    pub(crate) fn send_drep(&mut self, slot: u32, private_data: &[u8]) {
        let c = &self.conns[slot as usize];
        let r = CmRepr::Drep(drep::Repr {
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            private_data,
        });
        let (dst, tid) = (c.remote_gid, c.tid);
        let sent = self.send(dst, &Header::cm_send(AttributeId::Drep, tid), &r, false);
        self.conns[slot as usize].reply = sent;
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_sidr_rep(
        &mut self,
        dst: Gid,
        tid: u64,
        request_id: u32,
        service_id: u64,
        status: SidrStatus,
        qpn: u32,
        qkey: u32,
        private_data: &[u8],
    ) {
        let r = CmRepr::SidrRep(sidr_rep::Repr {
            request_id,
            status,
            vendor_id: 0,
            qpn,
            service_id,
            qkey,
            additional_info: &[],
            private_data,
        });
        self.send(dst, &Header::cm_send(AttributeId::SidrRep, tid), &r, false);
    }
}

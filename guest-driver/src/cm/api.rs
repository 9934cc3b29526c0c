//! The application's calls, with rdma_cm semantics: `listen`, `connect`, `accept`,
//! `reject`, `disconnect`, `destroy`, and SIDR resolution. Each call either acts (queues
//! MADs, arms timers) or fails with a [`CmError`] and changes nothing.

use pvcm_wire::Gid;
use pvcm_wire::cm::{CmRepr, FailoverAccepted, MsgResponse, RejReason, SidrStatus, rep, sidr_req};
use pvcm_wire::mad::{AttributeId, Header, MAD_LEN};
use pvcm_wire::timeout::linux_ms;

use super::agent::{Agent, ReqValues, check_pd, pd};
use super::config::{
    AcceptOptions, ConnectOptions, RDMA_MAX_INIT_DEPTH, RDMA_MAX_RESP_RES, SidrOptions,
};
use super::event::{CmError, CmId, State};
use super::pacing::Request;
use super::qp_attr::{PathAv, QpAttr, QpParams, QpState};
use super::rdma_cm;
use crate::time::Time;

/// What the agent knows of a connection (for diagnostics and the CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnInfo {
    /// Current state.
    pub state: State,
    /// Local comm ID (SIDR: request ID); meaningful while held.
    pub local_comm_id: u32,
    /// The peer's comm ID (0 until known).
    pub remote_comm_id: u32,
    /// Local QPN.
    pub local_qpn: u32,
    /// The peer's QPN (0 until known).
    pub remote_qpn: u32,
    /// The peer's CA GUID (0 until known).
    pub remote_ca_guid: u64,
    /// The peer's GID.
    pub remote_gid: Gid,
    /// Service ID.
    pub service_id: u64,
    /// The listener a passive connection came from.
    pub listen_id: Option<CmId>,
    /// When the armed timer fires ([`Time::NEVER`] if none).
    pub deadline: Time,
}

impl Agent {
    /// Whether the connection's DISCONNECTED came from our DREQ's retries running out
    /// (Linux IB_CM_DREQ_ERROR: rdma_cm reports it with -ETIMEDOUT), not from the
    /// peer's DREQ or DREP. False for an unknown id.
    pub fn disconnect_timed_out(&self, id: CmId) -> bool {
        self.slot_of(id)
            .is_some_and(|s| self.conns[s as usize].dreq_timed_out)
    }

    fn slot(&self, id: CmId) -> Result<u32, CmError> {
        self.slot_of(id).ok_or(CmError::UnknownId)
    }

    fn check_room(&self) -> Result<(), CmError> {
        let max = self.cfg.max_connections as usize;
        if max != 0 && self.connections >= max {
            Err(CmError::NoResources)
        } else {
            Ok(())
        }
    }

    fn check_qpn(&self, qpn: Option<u32>) -> Result<(), CmError> {
        match qpn {
            Some(q) if q > 0x00FF_FFFF || (self.cfg.qpn_count != 0 && !self.qpns.owns(q)) => {
                Err(CmError::QpnNotOwned(q))
            }
            _ => Ok(()),
        }
    }

    /// Assigns the local QPN: the caller's, or one from the pool.
    fn assign_qpn(&mut self, slot: u32, qpn: Option<u32>) -> Result<(), CmError> {
        let (q, sim) = match qpn {
            Some(q) => (q, false),
            None => (self.qpns.alloc().ok_or(CmError::NoResources)?, true),
        };
        let c = &mut self.conns[slot as usize];
        c.local_qpn = q;
        c.sim_qpn = sim;
        Ok(())
    }

    fn random_psn(&mut self) -> u32 {
        self.rng.next_u32() & 0x00FF_FFFF
    }

    /// The state of a handle the application holds.
    pub fn state(&self, id: CmId) -> Option<State> {
        self.slot_of(id).map(|s| self.conns[s as usize].state)
    }

    /// What the agent knows of a handle the application holds.
    pub fn info(&self, id: CmId) -> Option<ConnInfo> {
        let c = &self.conns[self.slot_of(id)? as usize];
        Some(ConnInfo {
            state: c.state,
            local_comm_id: c.local_id,
            remote_comm_id: c.remote_id,
            local_qpn: c.local_qpn,
            remote_qpn: c.remote_qpn,
            remote_ca_guid: c.remote_ca_guid,
            remote_gid: c.remote_gid,
            service_id: c.service_id,
            listen_id: c.listen,
            deadline: c.deadline,
        })
    }

    /// The attributes that move the connection's QP to `target` (INIT, RTR or RTS), from
    /// what its exchange settled, as Linux's `ib_cm_init_qp_attr()` gives them (see
    /// [`QpParams::attr`]); `InvalidState` where Linux refuses (e.g. RTR before the
    /// peer's values are known).
    pub fn qp_attr(&self, id: CmId, target: QpState) -> Result<QpAttr, CmError> {
        let c = &self.conns[self.slot(id)? as usize];
        c.qp.attr(c.state, target, c.av_timeout)
    }

    /// What the exchange settled for the connection's QP so far.
    pub fn qp_params(&self, id: CmId) -> Option<QpParams> {
        self.slot_of(id).map(|s| self.conns[s as usize].qp)
    }

    /// Listens for REQs and SIDR_REQs on `service_id` (exact match).
    pub fn listen(&mut self, service_id: u64) -> Result<CmId, CmError> {
        if self.listeners.contains_key(&service_id) {
            return Err(CmError::ServiceIdInUse(service_id));
        }
        let slot = self.alloc_slot(true);
        let c = &mut self.conns[slot as usize];
        c.state = State::Listen;
        c.service_id = service_id;
        self.listeners.insert(service_id, slot);
        Ok(self.id_of(slot))
    }

    /// Makes a listener answer SIDR_REQs itself with this UD QPN and Q_Key (status
    /// SUCCESS), instead of raising `SidrRequest` events.
    pub fn set_sidr_auto_reply(
        &mut self,
        listen: CmId,
        qpn: u32,
        qkey: u32,
    ) -> Result<(), CmError> {
        let slot = self.slot(listen)?;
        let c = &mut self.conns[slot as usize];
        if c.state != State::Listen {
            return Err(CmError::InvalidState(c.state));
        }
        c.sidr_auto = Some((qpn & 0x00FF_FFFF, qkey));
        Ok(())
    }

    /// Starts a connection: sends a REQ to `dest` for `service_id` (state REQ_SENT),
    /// retried every `2 * ms(packet life) + ms(remote response timeout)` up to
    /// `max_cm_retries` times; then `Unreachable`. `destroy()` right after is legal.
    /// With [`AgentConfig::pacing`](super::AgentConfig::pacing) the REQ may first wait
    /// for a slot of the destination's window (state REQ_SENT all the same; its timers
    /// start when it is sent).
    pub fn connect(
        &mut self,
        dest: Gid,
        service_id: u64,
        private_data: &[u8],
        opts: &ConnectOptions,
        now: Time,
    ) -> Result<CmId, CmError> {
        check_pd(private_data, pd::REQ)?;
        self.check_qpn(opts.qpn)?;
        if let Some(g) = opts.local_gid
            && !self.cfg.holds(g)
        {
            return Err(CmError::GidNotOwned(g));
        }
        self.check_room()?;
        let slot = self.alloc_active(opts.qpn)?;
        let v = self.req_values(slot, service_id, private_data, opts);
        let r = CmRepr::Req(self.format_req(dest, service_id, private_data, opts, &v));
        let Some(sent) = self.encode(&Header::cm_send(AttributeId::Req, v.tid), &r) else {
            self.free_slot(slot);
            return Err(CmError::NoResources);
        };
        self.req_sent(slot, dest, service_id, opts, &v, sent);
        let t = self.conns[slot as usize].timeout_ms;
        // Through the destination's window: a REQ that has to wait is sent (and its
        // timer started) when a slot frees up.
        if self.send_request(slot, dest, Request::Connect, sent) {
            self.arm(slot, now.after_ms(t));
        }
        Ok(self.id_of(slot))
    }

    /// A slot for an active connection, with its comm ID and local QPN.
    fn alloc_active(&mut self, qpn: Option<u32>) -> Result<u32, CmError> {
        let slot = self.alloc_slot(false);
        let Some(local_id) = self.comm_ids.alloc(slot) else {
            self.free_slot(slot);
            return Err(CmError::NoResources);
        };
        {
            let c = &mut self.conns[slot as usize];
            c.local_id = local_id;
            c.holds_id = true;
        }
        if let Err(e) = self.assign_qpn(slot, qpn) {
            self.free_slot(slot);
            return Err(e);
        }
        Ok(slot)
    }

    /// The values a REQ settles for this side, chosen once for the REQ and the
    /// connection's QP parameters.
    fn req_values(
        &mut self,
        slot: u32,
        service_id: u64,
        private_data: &[u8],
        opts: &ConnectOptions,
    ) -> ReqValues {
        let psn = match opts.starting_psn {
            Some(p) => p & 0x00FF_FFFF,
            None => self.random_psn(),
        };
        let c = &self.conns[slot as usize];
        // librdmacm: RDMA_MAX_RESP_RES / RDMA_MAX_INIT_DEPTH stand for the device maximum.
        let responder_resources = match opts.responder_resources {
            RDMA_MAX_RESP_RES => self.cfg.max_responder_resources,
            v => v,
        };
        let initiator_depth = match opts.initiator_depth {
            RDMA_MAX_INIT_DEPTH => self.cfg.max_initiator_depth,
            v => v,
        };
        // rdma_cm: the link's MTU; the flow label hashed from the rdma_cm ports.
        let path_mtu = match opts.path_mtu & 0xF {
            0 => self.cfg.active_mtu,
            m => m,
        };
        let flow_label = match opts.flow_label & 0xF_FFFF {
            0 => rdma_cm::req_flow_label(service_id, private_data).unwrap_or(0),
            f => f,
        };
        ReqValues {
            local_id: c.local_id,
            tid: self.form_tid(c.local_id),
            local_qpn: c.local_qpn,
            psn,
            responder_resources,
            initiator_depth,
            path_mtu,
            flow_label,
        }
    }

    /// The connection record of a REQ that is sent (or queued for its window): state
    /// REQ_SENT, its timeouts and the QP values it offers.
    fn req_sent(
        &mut self,
        slot: u32,
        dest: Gid,
        service_id: u64,
        opts: &ConnectOptions,
        v: &ReqValues,
        sent: [u8; MAD_LEN],
    ) {
        let local_gid = opts.local_gid.unwrap_or(self.cfg.gid);
        let c = &mut self.conns[slot as usize];
        c.state = State::ReqSent;
        c.remote_gid = dest;
        c.service_id = service_id;
        c.tid = v.tid;
        // Linux ib_send_cm_req(): timeout_ms and av.timeout from the path.
        c.timeout_ms =
            2 * linux_ms(opts.packet_life_time) + linux_ms(opts.remote_cm_response_timeout);
        c.max_retries = opts.max_cm_retries & 0xF;
        c.retries_left = c.max_retries;
        c.av_timeout = (opts.packet_life_time + 1).min(31);
        c.auto_rtu = opts.auto_rtu;
        c.msg = Some(sent);
        // Linux ib_send_cm_req: the REQ's values are this side's until the REP.
        c.qp = QpParams {
            local_qpn: v.local_qpn,
            remote_qpn: 0,
            sq_psn: 0,
            rq_psn: v.psn,
            path_mtu: v.path_mtu,
            retry_count: opts.retry_count & 0x7,
            rnr_retry_count: opts.rnr_retry_count & 0x7,
            responder_resources: v.responder_resources,
            initiator_depth: v.initiator_depth,
            path: PathAv {
                remote_gid: dest,
                local_gid,
                flow_label: v.flow_label,
                hop_limit: opts.hop_limit,
                traffic_class: opts.traffic_class,
                sl: opts.sl & 0xF,
            },
            peer_flow_control: false,
            peer_srq: false,
        };
    }

    /// Accepts: on a passive connection (REQ_RCVD, MRA_REQ_SENT) sends the REP (state
    /// REP_SENT, retried until the RTU); on an active one that waits for the
    /// application (REP_RCVD, MRA_REP_SENT; `auto_rtu: false`) sends the RTU and is
    /// established (rdma_cm's `rdma_establish()`; no event).
    pub fn accept(&mut self, id: CmId, private_data: &[u8], now: Time) -> Result<(), CmError> {
        self.accept_with(id, private_data, &AcceptOptions::default(), now)
    }

    /// [`Agent::accept`] with a real QPN or PSN for the REP.
    pub fn accept_with(
        &mut self,
        id: CmId,
        private_data: &[u8],
        opts: &AcceptOptions,
        now: Time,
    ) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        match self.conns[slot as usize].state {
            State::ReqRcvd | State::MraReqSent => {
                check_pd(private_data, pd::REP)?;
                self.check_qpn(opts.qpn)?;
                self.assign_qpn(slot, opts.qpn)?;
                let psn = match opts.starting_psn {
                    Some(p) => p & 0x00FF_FFFF,
                    None => self.random_psn(),
                };
                let c = &self.conns[slot as usize];
                // librdmacm rdma_accept(): the REQ's values (swapped), capped at the device
                // maximum, unless the application names its own.
                let responder_resources = match opts.responder_resources {
                    RDMA_MAX_RESP_RES => {
                        c.req_initiator_depth.min(self.cfg.max_responder_resources)
                    }
                    v => v,
                };
                let initiator_depth = match opts.initiator_depth {
                    RDMA_MAX_INIT_DEPTH => {
                        c.req_responder_resources.min(self.cfg.max_initiator_depth)
                    }
                    v => v,
                };
                let r = CmRepr::Rep(rep::Repr {
                    local_comm_id: c.local_id,
                    remote_comm_id: c.remote_id,
                    local_qkey: 0,
                    local_qpn: c.local_qpn,
                    vendor_id: 0,
                    local_eecn: 0,
                    starting_psn: psn,
                    responder_resources,
                    initiator_depth,
                    target_ack_delay: self.cfg.ack_delay & 0x1F,
                    failover_accepted: FailoverAccepted::Accepted,
                    end_to_end_flow_control: opts.flow_control,
                    rnr_retry_count: opts.rnr_retry_count & 0x7,
                    srq: opts.srq,
                    local_ca_guid: self.cfg.ca_guid,
                    private_data,
                });
                let (dst, tid) = (c.remote_gid, c.tid);
                let sent = self.send(dst, &Header::cm_send(AttributeId::Rep, tid), &r, false);
                self.disarm(slot);
                let c = &mut self.conns[slot as usize];
                // Linux ib_send_cm_rep: the REP's values are ours.
                c.qp.local_qpn = c.local_qpn;
                c.qp.rq_psn = psn;
                c.qp.responder_resources = responder_resources;
                c.qp.initiator_depth = initiator_depth;
                c.msg = sent;
                c.reply = None;
                c.retries_left = c.max_retries;
                c.state = State::RepSent;
                let t = c.timeout_ms;
                self.arm(slot, now.after_ms(t));
                Ok(())
            }
            State::RepRcvd | State::MraRepSent => {
                check_pd(private_data, pd::RTU)?;
                self.disarm(slot);
                self.send_rtu(slot, private_data);
                self.conns[slot as usize].state = State::Established;
                Ok(())
            }
            s => Err(CmError::InvalidState(s)),
        }
    }

    /// The passive side learnt from its QP that the peer sent data (Linux
    /// `ib_cm_notify(IB_EVENT_COMM_EST)`): a connection in REP_SENT or MRA_REP_RCVD is
    /// established without its RTU (`Established` is reported, later RTUs are
    /// duplicates). `InvalidState(Established)` if it already is; `InvalidState` in
    /// every other state.
    pub fn establish(&mut self, id: CmId) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        match self.conns[slot as usize].state {
            State::RepSent | State::MraRepRcvd => {
                self.establish_passive(slot, Vec::new());
                Ok(())
            }
            s => Err(CmError::InvalidState(s)),
        }
    }

    /// Rejects a connection request (REQ_RCVD, MRA_REQ_SENT) or, on an active side
    /// waiting for the application, a REP (REP_RCVD, MRA_REP_SENT) with REJ
    /// (CONSUMER_DEFINED) and this private data; the handle goes IDLE. On a SIDR request
    /// sends SIDR_REP(REJECT).
    pub fn reject(&mut self, id: CmId, private_data: &[u8], now: Time) -> Result<(), CmError> {
        self.reject_with(id, RejReason::ConsumerDefined, private_data, now)
    }

    /// [`Agent::reject`] with the REJ's reason given (rdma_cm's REJECT passes
    /// CONSUMER_DEFINED or VENDOR_OPTION_NOT_SUPPORTED on, `rdma_reject_ece`). A SIDR
    /// request is answered with SIDR_REP(REJECT) whatever the reason.
    pub fn reject_with(
        &mut self,
        id: CmId,
        reason: RejReason,
        private_data: &[u8],
        now: Time,
    ) -> Result<(), CmError> {
        let r = self.reject_inner(id, reason, private_data, now);
        self.pace_flush(now);
        r
    }

    fn reject_inner(
        &mut self,
        id: CmId,
        reason: RejReason,
        private_data: &[u8],
        now: Time,
    ) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        let state = self.conns[slot as usize].state;
        match state {
            State::ReqRcvd | State::MraReqSent | State::RepRcvd | State::MraRepSent => {
                check_pd(private_data, pd::REJ)?;
                self.rej_consumer(slot, reason, private_data);
                self.go_idle(slot);
                Ok(())
            }
            // After our REP, before the RTU (Linux cm_send_rej_locked in REP_SENT): the
            // REJ, then TimeWait, as a destroy there.
            State::RepSent | State::MraRepRcvd => {
                check_pd(private_data, pd::REJ)?;
                self.rej_consumer(slot, reason, private_data);
                self.disarm(slot);
                self.enter_timewait(slot, now);
                Ok(())
            }
            State::SidrReqRcvd => {
                check_pd(private_data, pd::SIDR_REP)?;
                self.sidr_answer(slot, SidrStatus::Reject, 0, 0, private_data);
                Ok(())
            }
            s => Err(CmError::InvalidState(s)),
        }
    }

    /// The application's REJ (`reason`: CONSUMER_DEFINED unless it gave another) as
    /// Linux `cm_format_rej()` words it for the state.
    fn rej_consumer(&mut self, slot: u32, reason: RejReason, private_data: &[u8]) {
        let c = &self.conns[slot as usize];
        let (local, msg) = match c.state {
            State::ReqRcvd => (0, MsgResponse::Req),
            State::MraReqSent => (c.local_id, MsgResponse::Req),
            State::RepRcvd | State::MraRepSent => (c.local_id, MsgResponse::Rep),
            _ => (c.local_id, MsgResponse::Other),
        };
        let (dst, tid, remote) = (c.remote_gid, c.tid, c.remote_id);
        self.send_rej(dst, tid, local, remote, msg, reason, &[], private_data);
    }

    /// Disconnects: from ESTABLISHED sends a DREQ (DREQ_SENT, retried; `Disconnected`
    /// when the DREP comes or the retries run out); after a received DREQ (DREQ_RCVD)
    /// sends the DREP. Either way the connection then waits out its TimeWait. Once
    /// disconnected (in TimeWait or after it, e.g. when the peer's DREQ was answered at
    /// once, see [`AgentConfig::auto_drep`](super::AgentConfig::auto_drep)) it sends
    /// nothing and succeeds.
    pub fn disconnect(&mut self, id: CmId, now: Time) -> Result<(), CmError> {
        let r = self.disconnect_inner(id, now);
        self.pace_flush(now);
        r
    }

    fn disconnect_inner(&mut self, id: CmId, now: Time) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        match self.conns[slot as usize].state {
            State::Established => {
                self.send_dreq(slot, &[], true, now);
                Ok(())
            }
            State::DreqRcvd => {
                self.send_drep(slot, &[]);
                self.enter_timewait(slot, now);
                Ok(())
            }
            // Already disconnected (the peer's DREQ was answered at once, or ours was),
            // maybe with the TimeWait over by now: nothing to send, and success, as
            // `rdma_disconnect()` then.
            State::Timewait => Ok(()),
            State::Idle if self.conns[slot as usize].disconnect_reported => Ok(()),
            s => Err(CmError::InvalidState(s)),
        }
    }

    /// Destroys a handle (legal in any state; its queued events are withdrawn and no
    /// more come). What the peer sees follows Linux `cm_destroy_id()`: REJ(TIMEOUT)
    /// with ARI = our CA GUID and Remote Comm ID 0 from REQ_SENT / MRA_REQ_RCVD;
    /// REJ(CONSUMER_DEFINED) from the other handshake states; one DREQ (not retried)
    /// from ESTABLISHED; a DREP from DREQ_RCVD; SIDR_REP(REJECT) for a pending SIDR
    /// request. A connection that needs a TimeWait keeps its comm ID until the wait
    /// ends. A connect whose REQ still waits for its destination's window leaves the
    /// queue with no wire traffic at all.
    pub fn destroy(&mut self, id: CmId, now: Time) -> Result<(), CmError> {
        let r = self.destroy_inner(id, now);
        self.pace_flush(now);
        r
    }

    /// Destroys several handles at once (a process's whole set, when it exits): as
    /// [`Agent::destroy`] for each, but a request of one of them still waiting for its
    /// destination's window never goes out because another freed a slot first; the
    /// windows move on once all are gone. Unknown handles are skipped.
    pub fn destroy_all(&mut self, ids: &[CmId], now: Time) {
        for &id in ids {
            let _ = self.destroy_inner(id, now);
        }
        self.pace_flush(now);
    }

    fn destroy_inner(&mut self, id: CmId, now: Time) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        self.conns[slot as usize].app = false;
        self.forget_events(id);
        match self.conns[slot as usize].state {
            State::Listen | State::Idle | State::SidrReqSent => self.free_slot(slot),
            State::SidrReqRcvd => self.sidr_answer(slot, SidrStatus::Reject, 0, 0, &[]),
            // A REQ still waiting for its window never left: it leaves the queue and
            // nothing goes on the wire.
            State::ReqSent if self.pace_queued(slot) => self.go_idle(slot),
            State::ReqSent | State::MraReqRcvd => {
                let c = &self.conns[slot as usize];
                let (dst, tid, local) = (c.remote_gid, c.tid, c.local_id);
                let ari = self.cfg.ca_guid.to_be_bytes();
                self.send_rej(
                    dst,
                    tid,
                    local,
                    0,
                    MsgResponse::Other,
                    RejReason::Timeout,
                    &ari,
                    &[],
                );
                self.go_idle(slot);
            }
            State::ReqRcvd | State::MraReqSent | State::RepRcvd | State::MraRepSent => {
                self.rej_consumer(slot, RejReason::ConsumerDefined, &[]);
                self.go_idle(slot);
            }
            State::RepSent | State::MraRepRcvd => {
                self.rej_consumer(slot, RejReason::ConsumerDefined, &[]);
                self.disarm(slot);
                self.enter_timewait(slot, now);
            }
            State::Established => {
                self.send_dreq(slot, &[], false, now);
                self.enter_timewait(slot, now);
            }
            State::DreqSent => {
                self.disarm(slot);
                self.enter_timewait(slot, now);
            }
            State::DreqRcvd => {
                self.send_drep(slot, &[]);
                self.enter_timewait(slot, now);
            }
            State::Timewait => {}
        }
        Ok(())
    }

    /// Resolves `service_id` at `dest` with SIDR (state SIDR_REQ_SENT, retried); the
    /// answer comes as `SidrResolved`, or `Unreachable`.
    pub fn resolve_sidr(
        &mut self,
        dest: Gid,
        service_id: u64,
        private_data: &[u8],
        opts: &SidrOptions,
        now: Time,
    ) -> Result<CmId, CmError> {
        check_pd(private_data, pd::SIDR_REQ)?;
        self.check_room()?;
        let slot = self.alloc_slot(false);
        let Some(request_id) = self.comm_ids.alloc(slot) else {
            self.free_slot(slot);
            return Err(CmError::NoResources);
        };
        {
            let c = &mut self.conns[slot as usize];
            c.local_id = request_id;
            c.holds_id = true;
        }
        let tid = self.form_tid(request_id);
        let r = CmRepr::SidrReq(sidr_req::Repr {
            request_id,
            partition_key: self.cfg.pkey,
            service_id,
            private_data,
        });
        let Some(sent) = self.send(dest, &Header::cm_send(AttributeId::SidrReq, tid), &r, false)
        else {
            self.free_slot(slot);
            return Err(CmError::NoResources);
        };
        let c = &mut self.conns[slot as usize];
        c.state = State::SidrReqSent;
        c.remote_gid = dest;
        c.service_id = service_id;
        c.tid = tid;
        c.timeout_ms = opts.timeout_ms;
        c.max_retries = opts.max_cm_retries;
        c.retries_left = opts.max_cm_retries;
        c.msg = Some(sent);
        let t = c.timeout_ms;
        self.arm(slot, now.after_ms(t));
        Ok(self.id_of(slot))
    }

    /// Answers a `SidrRequest` (status SUCCESS with the service's UD QPN and Q_Key, or
    /// another status); the handle goes IDLE.
    pub fn sidr_reply(
        &mut self,
        id: CmId,
        status: SidrStatus,
        qpn: u32,
        qkey: u32,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        let slot = self.slot(id)?;
        let state = self.conns[slot as usize].state;
        if state != State::SidrReqRcvd {
            return Err(CmError::InvalidState(state));
        }
        check_pd(private_data, pd::SIDR_REP)?;
        self.sidr_answer(slot, status, qpn, qkey, private_data);
        Ok(())
    }

    fn sidr_answer(&mut self, slot: u32, status: SidrStatus, qpn: u32, qkey: u32, pd: &[u8]) {
        let c = &self.conns[slot as usize];
        let (dst, tid, rid, sid) = (c.remote_gid, c.tid, c.remote_id, c.service_id);
        self.send_sidr_rep(dst, tid, rid, sid, status, qpn & 0x00FF_FFFF, qkey, pd);
        self.go_idle(slot);
    }
}

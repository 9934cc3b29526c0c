//! The agent: connection records, indexes, timers, and the handling of received MADs.
//! The application-facing calls are in `api.rs`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::FastMap;

use pvcm_wire::Gid;
use pvcm_wire::cm::{
    CmMad, CmRepr, MsgResponse, RejReason, SidrStatus, class_port_info, drep, dreq, lap, mra, rej,
    rep, req, rtu, sidr_rep, sidr_req,
};
use pvcm_wire::mad::{self, AttributeId, Header, MAD_LEN, Method};
use pvcm_wire::timeout::linux_ms;

use super::config::{AgentConfig, cm_ack_timeout};
use super::counters::{CmCounters, DropReason, Drops, Group};
use super::event::{CmId, Event, State};
use super::ids::{CommIds, QpnPool, SplitMix64};
use super::pacing::{Pace, Pacer, PacingCounters, Request, WindowInfo};
use super::qp_attr::{PathAv, QpParams};
use crate::time::Time;

/// A MAD the agent wants sent, with its destination GID (the device ABI's addressing:
/// the transport puts `dst` in the message header's `remote_gid`).
#[derive(Clone, PartialEq, Eq)]
pub struct OutMad {
    /// Destination GID.
    pub dst: Gid,
    /// The 256-byte MAD, in wire byte order.
    pub mad: [u8; MAD_LEN],
}

impl OutMad {
    /// The MAD's attribute (`None` only for bytes the agent never produces).
    pub fn attr(&self) -> Option<AttributeId> {
        AttributeId::from_u16(mad::field::ATTR_ID.get(&self.mad) as u16)
    }
}

impl core::fmt::Debug for OutMad {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match CmRepr::parse(&self.mad) {
            Ok((h, r)) => write!(f, "OutMad(to {} {} | {})", self.dst, h, r),
            Err(e) => write!(f, "OutMad(to {} unparsable: {})", self.dst, e),
        }
    }
}

/// What the agent remembers of one connection, listener or SIDR exchange.
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    pub generation: u32,
    pub live: bool,
    pub state: State,
    /// The application still holds the handle (not destroyed).
    pub app: bool,
    pub listen: Option<CmId>,
    pub local_id: u32,
    /// `local_id` is held in the comm-ID allocator.
    pub holds_id: bool,
    pub remote_id: u32,
    pub remote_ca_guid: u64,
    pub remote_gid: Gid,
    pub local_qpn: u32,
    /// `local_qpn` came from the port's pool.
    pub sim_qpn: bool,
    pub remote_qpn: u32,
    pub service_id: u64,
    /// TID of the exchange being answered or started (Linux `cm_id_priv->tid`).
    pub tid: u64,
    /// One attempt's timeout (Linux `timeout_ms`).
    pub timeout_ms: u64,
    pub max_retries: u8,
    pub retries_left: u8,
    /// Linux `av.timeout`: the path's ACK timeout exponent (TimeWait, MRA extension).
    pub av_timeout: u8,
    /// The MAD being retried (REQ, REP, DREQ, SIDR_REQ).
    pub msg: Option<[u8; MAD_LEN]>,
    /// The last answer sent (MRA, RTU, DREP), re-sent on duplicates.
    pub reply: Option<[u8; MAD_LEN]>,
    /// `reply` is an MRA that has not gone out yet (MRA_REQ_SENT / MRA_REP_SENT entered
    /// silently, Linux `IB_CM_MRA_FLAG_DELAY`): the first duplicate sends it.
    pub reply_unsent: bool,
    /// Sequence number of the armed timer.
    pub timer: Option<u64>,
    pub deadline: Time,
    pub in_remote_ids: bool,
    pub in_remote_qpns: bool,
    pub disconnect_reported: bool,
    pub auto_rtu: bool,
    /// The REQ's responder resources and initiator depth (mirrored in the REP).
    pub req_responder_resources: u8,
    pub req_initiator_depth: u8,
    /// SIDR_REQ_RCVD index key.
    pub sidr_key: Option<(Gid, u32)>,
    /// Listener: answer SIDR_REQs with this (QPN, Q_Key) without asking.
    pub sidr_auto: Option<(u32, u32)>,
    /// Where the connection's paced request (REQ, DREQ) stands.
    pub pace: Pace,
    /// What the exchange settled for the QP (for [`Agent::qp_attr`]).
    pub qp: QpParams,
}

impl Conn {
    fn new(generation: u32) -> Conn {
        Conn {
            generation,
            live: true,
            state: State::Idle,
            app: true,
            listen: None,
            local_id: 0,
            holds_id: false,
            remote_id: 0,
            remote_ca_guid: 0,
            remote_gid: Gid::ZERO,
            local_qpn: 0,
            sim_qpn: false,
            remote_qpn: 0,
            service_id: 0,
            tid: 0,
            timeout_ms: 0,
            max_retries: 0,
            retries_left: 0,
            av_timeout: 0,
            msg: None,
            reply: None,
            reply_unsent: false,
            timer: None,
            deadline: Time::NEVER,
            in_remote_ids: false,
            in_remote_qpns: false,
            disconnect_reported: false,
            auto_rtu: true,
            req_responder_resources: 0,
            req_initiator_depth: 0,
            sidr_key: None,
            sidr_auto: None,
            pace: Pace::Idle,
            qp: QpParams::default(),
        }
    }
}

/// An IBA chapter-12 Connection Manager agent for one port: pure, I/O-free, driven by
/// the MADs it is handed, the application's calls and `poll()` at `next_deadline()`.
///
/// Outputs are an outbox of MADs with their destination GIDs ([`Agent::pop_outbox`])
/// and an event queue for the application ([`Agent::pop_event`]).
#[derive(Debug)]
pub struct Agent {
    pub(crate) cfg: AgentConfig,
    pub(crate) rng: SplitMix64,
    pub(crate) conns: Vec<Conn>,
    free: Vec<u32>,
    pub(crate) comm_ids: CommIds,
    pub(crate) qpns: QpnPool,
    /// (remote CA GUID, remote comm ID) -> slot: duplicate REQ/REP detection and
    /// REJ(TIMEOUT) lookup. Left on entering TimeWait (Linux `cm_remove_remote()`), so a
    /// REQ reusing the remote comm ID then is a new request.
    remote_ids: FastMap<(u64, u32), u32>,
    /// (remote CA GUID, remote QPN) -> slot of a *connected* connection (REQ_RCVD or
    /// REP_RCVD up to DREQ): stale-connection detection. Left on entering TimeWait.
    remote_qpns: FastMap<(u64, u32), u32>,
    pub(crate) listeners: FastMap<u64, u32>,
    sidr_rcvd: FastMap<(Gid, u32), u32>,
    timers: BinaryHeap<Reverse<(u64, u64, u32)>>,
    timer_seq: u64,
    armed: usize,
    outbox: VecDeque<OutMad>,
    events: VecDeque<Event>,
    /// Events in `events` per slot (never fewer than there are): lets
    /// [`Agent::forget_events`] skip the queue for a slot with none.
    queued_events: Vec<u32>,
    pub(crate) counters: CmCounters,
    pub(crate) drops: Drops,
    pub(crate) connections: usize,
    /// Per-destination request windows (see `pacing.rs`).
    pacer: Pacer,
}

/// Connections an agent makes room for when it starts (fewer if its quota is smaller):
/// a burst of up to this many connections never grows the agent's tables. About 1 MiB
/// of address space, touched only as connections arrive.
pub const PRESIZED_CONNECTIONS: usize = 1024;

impl Agent {
    /// An agent with no connections.
    pub fn new(cfg: AgentConfig) -> Agent {
        let mut rng = SplitMix64::new(cfg.seed);
        let operand = rng.next_u32();
        let mut qpns = QpnPool::new(cfg.qpn_base, cfg.qpn_count);
        // Room for a first burst up front: growing the connection table and its indexes
        // one doubling at a time moves every entry again (a Conn holds two MADs), and
        // the burst would pay for it.
        let cap = match cfg.max_connections {
            0 => PRESIZED_CONNECTIONS,
            n => (n as usize).min(PRESIZED_CONNECTIONS),
        };
        let cfg_pacing = cfg.pacing;
        let mut comm_ids = CommIds::new(operand);
        comm_ids.reserve(cap);
        qpns.reserve(cap);
        Agent {
            cfg,
            rng,
            conns: Vec::with_capacity(cap),
            free: Vec::new(),
            comm_ids,
            qpns,
            remote_ids: FastMap::with_capacity_and_hasher(cap, Default::default()),
            remote_qpns: FastMap::with_capacity_and_hasher(cap, Default::default()),
            listeners: FastMap::default(),
            sidr_rcvd: FastMap::default(),
            timers: BinaryHeap::with_capacity(cap),
            timer_seq: 0,
            armed: 0,
            outbox: VecDeque::with_capacity(cap),
            events: VecDeque::with_capacity(cap),
            queued_events: Vec::with_capacity(cap),
            counters: CmCounters::default(),
            drops: Drops::default(),
            connections: 0,
            pacer: Pacer::new(cfg_pacing),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// The next MAD to send.
    pub fn pop_outbox(&mut self) -> Option<OutMad> {
        self.outbox.pop_front()
    }

    /// Every MAD to send, oldest first.
    pub fn drain_outbox(&mut self) -> impl Iterator<Item = OutMad> + '_ {
        self.outbox.drain(..)
    }

    /// MADs waiting to be sent.
    pub fn outbox_len(&self) -> usize {
        self.outbox.len()
    }

    /// The next event for the application.
    pub fn pop_event(&mut self) -> Option<Event> {
        let e = self.events.pop_front()?;
        unqueued(&mut self.queued_events, &e);
        Some(e)
    }

    /// Every pending event, oldest first.
    pub fn drain_events(&mut self) -> impl Iterator<Item = Event> + '_ {
        let queued = &mut self.queued_events;
        self.events.drain(..).inspect(move |e| unqueued(queued, e))
    }

    /// The counters (Linux `infiniband_cm` shape).
    pub fn counters(&self) -> &CmCounters {
        &self.counters
    }

    /// Counted drops.
    pub fn drops(&self) -> &Drops {
        &self.drops
    }

    /// Connections and SIDR exchanges the agent remembers (listeners excluded),
    /// including destroyed ones still in TimeWait.
    pub fn connection_count(&self) -> usize {
        self.connections
    }

    /// Listeners.
    pub fn listener_count(&self) -> usize {
        self.listeners.len()
    }

    /// Comm IDs held (live connections and TimeWait).
    pub fn comm_ids_held(&self) -> usize {
        self.comm_ids.len()
    }

    /// Simulated QPNs in use.
    pub fn qpns_in_use(&self) -> usize {
        self.qpns.in_use()
    }

    /// Timers armed.
    pub fn timers_armed(&self) -> usize {
        self.armed
    }

    /// True when the agent holds no protocol state at all besides listeners: no
    /// connection, comm ID, QPN, index entry, timer, unsent MAD or paced request.
    pub fn is_quiescent(&self) -> bool {
        self.connections == 0
            && self.comm_ids.is_empty()
            && self.qpns.in_use() == 0
            && self.remote_ids.is_empty()
            && self.remote_qpns.is_empty()
            && self.sidr_rcvd.is_empty()
            && self.armed == 0
            && self.outbox.is_empty()
            && self.pacer.is_idle()
    }

    /// How many remembered connections are in each state.
    pub fn state_histogram(&self) -> Vec<(State, usize)> {
        State::ALL
            .iter()
            .map(|s| {
                (
                    *s,
                    self.conns
                        .iter()
                        .filter(|c| c.live && c.state == *s)
                        .count(),
                )
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    // ------------------------------------------------------------------ slots

    /// Drops all CM state (the device reset: the host released every connection) and
    /// starts over with `cfg`: no connection, listener, timer, unsent MAD or event
    /// survives. Handles the application still holds must stay unknown, so one dead
    /// record per slot the old agent used is kept with its generation moved on: new
    /// handles get slots after them and never equal an old one. (A few hundred bytes per
    /// slot, once per reset.)
    pub fn reset(&mut self, cfg: AgentConfig) {
        let mut fresh = Agent::new(cfg);
        fresh.conns = self
            .conns
            .iter()
            .map(|c| {
                let mut d = c.clone();
                d.live = false;
                d.app = false;
                d.msg = None;
                d.reply = None;
                d.timer = None;
                d.pace = Pace::Idle;
                d.generation = d.generation.wrapping_add(1);
                d
            })
            .collect();
        *self = fresh;
    }

    pub(crate) fn alloc_slot(&mut self, listener: bool) -> u32 {
        if !listener {
            self.connections += 1;
        }
        if let Some(s) = self.free.pop() {
            let generation = self.conns[s as usize].generation;
            self.conns[s as usize] = Conn::new(generation);
            s
        } else {
            self.conns.push(Conn::new(0));
            (self.conns.len() - 1) as u32
        }
    }

    /// Forgets a slot entirely (releasing whatever it still holds).
    pub(crate) fn free_slot(&mut self, slot: u32) {
        self.release_protocol(slot);
        let c = &mut self.conns[slot as usize];
        if !c.live {
            return;
        }
        if c.state == State::Listen {
            let sid = c.service_id;
            if self.listeners.get(&sid) == Some(&slot) {
                self.listeners.remove(&sid);
            }
        } else {
            self.connections -= 1;
        }
        let c = &mut self.conns[slot as usize];
        c.live = false;
        c.app = false;
        c.generation = c.generation.wrapping_add(1);
        self.free.push(slot);
    }

    pub(crate) fn id_of(&self, slot: u32) -> CmId {
        CmId {
            slot,
            generation: self.conns[slot as usize].generation,
        }
    }

    /// The slot of a handle the application holds.
    pub(crate) fn slot_of(&self, id: CmId) -> Option<u32> {
        let c = self.conns.get(id.slot as usize)?;
        (c.live && c.app && c.generation == id.generation).then_some(id.slot)
    }

    fn by_local(&self, local_id: u32) -> Option<u32> {
        self.comm_ids.get(local_id)
    }

    fn by_ids(&self, local_id: u32, remote_id: u32) -> Option<u32> {
        self.by_local(local_id)
            .filter(|s| self.conns[*s as usize].remote_id == remote_id)
    }

    pub(crate) fn index_remote(&mut self, slot: u32) {
        let c = &self.conns[slot as usize];
        let (guid, rid, rqpn) = (c.remote_ca_guid, c.remote_id, c.remote_qpn);
        self.remote_ids.insert((guid, rid), slot);
        self.remote_qpns.insert((guid, rqpn), slot);
        let c = &mut self.conns[slot as usize];
        c.in_remote_ids = true;
        c.in_remote_qpns = true;
    }

    fn unindex_remote_qpn(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        if c.in_remote_qpns {
            c.in_remote_qpns = false;
            let key = (c.remote_ca_guid, c.remote_qpn);
            if self.remote_qpns.get(&key) == Some(&slot) {
                self.remote_qpns.remove(&key);
            }
        }
    }

    fn unindex_remote_id(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        if c.in_remote_ids {
            c.in_remote_ids = false;
            let key = (c.remote_ca_guid, c.remote_id);
            if self.remote_ids.get(&key) == Some(&slot) {
                self.remote_ids.remove(&key);
            }
        }
    }

    /// Releases what the protocol holds for a connection: paced request, comm ID,
    /// indexes, QPN, retried MAD, timer. The record itself stays (the application may
    /// hold it).
    fn release_protocol(&mut self, slot: u32) {
        self.pace_release(slot);
        self.disarm(slot);
        self.unindex_remote_id(slot);
        self.unindex_remote_qpn(slot);
        let c = &mut self.conns[slot as usize];
        c.msg = None;
        c.reply = None;
        c.reply_unsent = false;
        if c.holds_id {
            c.holds_id = false;
            let id = c.local_id;
            self.comm_ids.release(id);
        }
        let c = &mut self.conns[slot as usize];
        if c.sim_qpn {
            c.sim_qpn = false;
            let q = c.local_qpn;
            self.qpns.release(q);
        }
        let c = &mut self.conns[slot as usize];
        if let Some(key) = c.sidr_key.take() {
            if self.sidr_rcvd.get(&key) == Some(&slot) {
                self.sidr_rcvd.remove(&key);
            }
        }
    }

    /// Linux `cm_reset_to_idle()`: the connection is over without a TimeWait; its IDs
    /// go back at once. Forgotten entirely if the application destroyed it.
    pub(crate) fn go_idle(&mut self, slot: u32) {
        self.release_protocol(slot);
        let c = &mut self.conns[slot as usize];
        c.state = State::Idle;
        if !c.app {
            self.free_slot(slot);
        }
    }

    /// Linux `cm_enter_timewait()`: the QPN is no longer connected (it may be named by a
    /// new REQ without being stale) and the remote comm ID is forgotten (a REQ reusing it
    /// is new: `cm_remove_remote()` drops both); the local comm ID stays held for the
    /// packet-lifetime-based wait.
    pub(crate) fn enter_timewait(&mut self, slot: u32, now: Time) {
        self.unindex_remote_qpn(slot);
        self.unindex_remote_id(slot);
        let c = &mut self.conns[slot as usize];
        c.state = State::Timewait;
        c.msg = None;
        let wait = linux_ms(c.av_timeout);
        // A DREQ still waiting for its window: the wait starts when it goes out.
        if !self.pace_queued(slot) {
            self.arm(slot, now.after_ms(wait));
        }
    }

    // ----------------------------------------------------------------- pacing

    /// The pacing counters.
    pub fn pacing(&self) -> PacingCounters {
        self.pacer.counters()
    }

    /// One of a destination's windows (`None`: nothing outstanding or queued there).
    pub fn window(&self, dst: Gid, kind: Request) -> Option<WindowInfo> {
        self.pacer.window(dst, kind)
    }

    /// Sends a request (REQ, DREQ) of `slot` to `dst` through its destination's window
    /// for that kind: at once if a slot is free and nobody waits (true), else queued
    /// (false; the caller must not arm its timer: the send does).
    pub(crate) fn send_request(
        &mut self,
        slot: u32,
        dst: Gid,
        kind: Request,
        mad: [u8; MAD_LEN],
    ) -> bool {
        let pace = &mut self.conns[slot as usize].pace;
        let now = self.pacer.admit(pace, slot, dst, kind, mad);
        if now {
            self.push(dst, mad, false);
        }
        now
    }

    /// True if the connection's request waits in a queue (its timers must not run).
    pub(crate) fn pace_queued(&self, slot: u32) -> bool {
        matches!(self.conns[slot as usize].pace, Pace::Queued(_))
    }

    /// The peer answered the connection's request (see [`Pacer::answered`]).
    pub(crate) fn pace_answered(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.answered(&mut c.pace, slot, c.remote_gid);
    }

    /// The connection no longer needs its request (see [`Pacer::release`]).
    pub(crate) fn pace_release(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.release(&mut c.pace, slot, c.remote_gid);
    }

    /// The connection's request timed out, to be retried or given up (see
    /// [`Pacer::timeout`]).
    fn pace_timeout(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        self.pacer.timeout(&mut c.pace, c.remote_gid);
    }

    /// Sends what the freed slots allow, in queue order, arming each sent connection's
    /// timer from `now`. Run at the end of every agent call.
    pub(crate) fn pace_flush(&mut self, now: Time) {
        for r in self.pacer.ready() {
            self.conns[r.slot as usize].pace = r.pace;
            self.push(r.dst, r.mad, false);
            self.arm_after_send(r.slot, now);
        }
    }

    /// Arms the timer a request's connection runs once the request is on its way.
    fn arm_after_send(&mut self, slot: u32, now: Time) {
        let c = &self.conns[slot as usize];
        let wait = match c.state {
            State::ReqSent | State::DreqSent => c.timeout_ms,
            // A destroyed connection's one DREQ: its TimeWait starts now.
            State::Timewait => linux_ms(c.av_timeout),
            _ => return,
        };
        self.arm(slot, now.after_ms(wait));
    }

    // ----------------------------------------------------------------- timers

    pub(crate) fn arm(&mut self, slot: u32, at: Time) {
        self.timer_seq += 1;
        let seq = self.timer_seq;
        let c = &mut self.conns[slot as usize];
        if c.timer.is_none() {
            self.armed += 1;
        }
        c.timer = Some(seq);
        c.deadline = at;
        self.timers.push(Reverse((at.0, seq, slot)));
        if self.timers.len() > 64 && self.timers.len() > 4 * self.armed {
            self.compact_timers();
        }
    }

    pub(crate) fn disarm(&mut self, slot: u32) {
        let c = &mut self.conns[slot as usize];
        if c.timer.take().is_some() {
            self.armed -= 1;
            c.deadline = Time::NEVER;
        }
    }

    fn compact_timers(&mut self) {
        let live: Vec<Reverse<(u64, u64, u32)>> = self
            .conns
            .iter()
            .enumerate()
            .filter(|(_, c)| c.live)
            .filter_map(|(i, c)| c.timer.map(|seq| Reverse((c.deadline.0, seq, i as u32))))
            .collect();
        self.timers = BinaryHeap::from(live);
    }

    /// A MAD the device has taken from its queue (its send completion). A request's
    /// response timer starts here, as Linux's MAD layer starts it when the send
    /// completes: a REQ, REP, DREQ or SIDR_REQ that waited behind others (a burst on a
    /// busy vCPU) is not retried before the peer could have answered it. Only the
    /// message the connection waits on counts (its current `msg`, byte for byte).
    pub fn mad_sent(&mut self, mad: &[u8], now: Time) {
        let Ok(m) = CmMad::new_checked(mad) else {
            return;
        };
        let local = match m.attr() {
            AttributeId::Req | AttributeId::Rep | AttributeId::Dreq => m.local_comm_id(),
            AttributeId::SidrReq => m.sidr_request_id(),
            _ => None,
        };
        let Some(slot) = local.and_then(|id| self.by_local(id)) else {
            return;
        };
        let c = &self.conns[slot as usize];
        let waits = matches!(
            c.state,
            State::ReqSent | State::RepSent | State::DreqSent | State::SidrReqSent
        );
        if !c.live || c.timer.is_none() || !waits || c.msg.as_ref().map(|b| &b[..]) != Some(mad) {
            return;
        }
        let at = now.after_ms(c.timeout_ms);
        if at > c.deadline {
            self.arm(slot, at);
        }
    }

    /// When `poll()` next has work: the earliest armed timer.
    pub fn next_deadline(&mut self) -> Option<Time> {
        while let Some(Reverse((t, seq, slot))) = self.timers.peek().copied() {
            let c = &self.conns[slot as usize];
            if c.live && c.timer == Some(seq) {
                return Some(Time(t));
            }
            self.timers.pop();
        }
        None
    }

    /// Runs every timer due at `now`: retries, give-ups, the silent MRA states, TimeWait
    /// ends.
    pub fn poll(&mut self, now: Time) {
        while let Some(Reverse((t, seq, slot))) = self.timers.peek().copied() {
            if t > now.0 {
                break;
            }
            self.timers.pop();
            let c = &self.conns[slot as usize];
            if !c.live || c.timer != Some(seq) {
                continue;
            }
            self.disarm(slot);
            self.fire(slot, now);
        }
        self.pace_flush(now);
    }

    fn fire(&mut self, slot: u32, now: Time) {
        let state = self.conns[slot as usize].state;
        match state {
            State::ReqSent
            | State::MraReqRcvd
            | State::RepSent
            | State::MraRepRcvd
            | State::DreqSent
            | State::SidrReqSent => {
                let c = &mut self.conns[slot as usize];
                if c.retries_left > 0
                    && let Some(m) = c.msg
                {
                    c.retries_left -= 1;
                    let (dst, t) = (c.remote_gid, c.timeout_ms);
                    self.pace_timeout(slot);
                    self.push(dst, m, true);
                    self.arm(slot, now.after_ms(t));
                    return;
                }
                self.pace_timeout(slot);
                self.pace_release(slot);
                let id = self.id_of(slot);
                if state == State::DreqSent {
                    // Linux IB_CM_DREQ_ERROR -> rdma_cm DISCONNECTED.
                    self.report_disconnect(slot);
                    self.enter_timewait(slot, now);
                } else {
                    // REQ/REP/SIDR_REQ error -> rdma_cm UNREACHABLE.
                    if self.conns[slot as usize].app {
                        self.event(Event::Unreachable { id });
                    }
                    self.go_idle(slot);
                }
            }
            State::ReqRcvd => self.delay_mra(slot, MsgResponse::Req, State::MraReqSent),
            State::RepRcvd => self.delay_mra(slot, MsgResponse::Rep, State::MraRepSent),
            State::Timewait => {
                let id = self.id_of(slot);
                let app = self.conns[slot as usize].app;
                self.go_idle(slot);
                if app {
                    self.event(Event::TimewaitExit { id });
                }
            }
            _ => {}
        }
    }

    // ---------------------------------------------------------------- sending

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
    fn delay_mra(&mut self, slot: u32, which: MsgResponse, next: State) {
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
    fn mra_owed(&mut self, slot: u32, waiting: State) {
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
    fn resend_reply(&mut self, slot: u32, tid: u64) {
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
    fn send_stale_dreq(&mut self, slot: u32, now: Time) {
        self.dreq(slot, &[], true, false, now);
    }

    fn dreq(&mut self, slot: u32, private_data: &[u8], retried: bool, paced: bool, now: Time) {
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

    /// Reports `Disconnected` once per connection, if the application still holds it.
    pub(crate) fn report_disconnect(&mut self, slot: u32) {
        let id = self.id_of(slot);
        let c = &mut self.conns[slot as usize];
        if c.app && !c.disconnect_reported {
            c.disconnect_reported = true;
            self.event(Event::Disconnected { id });
        }
    }

    /// Withdraws the queued events of a destroyed handle. Only a slot with events
    /// queued walks the queue: an application that destroys each connection as its
    /// last event arrives (cmtime's server, most rdma_cm loops) would otherwise walk
    /// the whole queue once per connection, quadratic in a burst.
    pub(crate) fn forget_events(&mut self, id: CmId) {
        let s = id.slot as usize;
        if self.queued_events.get(s).is_none_or(|n| *n == 0) {
            return;
        }
        let before = self.events.len();
        self.events.retain(|e| e.id() != id);
        let gone = (before - self.events.len()) as u32;
        self.queued_events[s] = self.queued_events[s].saturating_sub(gone);
    }

    /// Queues an event for the application (the only way one is queued, so
    /// `queued_events` never undercounts).
    pub(crate) fn event(&mut self, e: Event) {
        let s = e.id().slot as usize;
        if self.queued_events.len() <= s {
            self.queued_events.resize(s + 1, 0);
        }
        self.queued_events[s] += 1;
        self.events.push_back(e);
    }

    // ---------------------------------------------------------------- receive

    /// Handles one MAD from the device: `mad` is the 256-byte MAD (longer buffers are
    /// cut to 256 bytes), `src` the sender's GID from the message header. Timers due at
    /// `now` run first. Malformed input is counted in [`Agent::drops`], never a panic.
    pub fn handle_mad(&mut self, mad: &[u8], src: Gid, now: Time) {
        self.poll(now);
        self.receive(mad, src, now);
        self.pace_flush(now);
    }

    fn receive(&mut self, mad: &[u8], src: Gid, now: Time) {
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

    fn dup(&mut self, a: AttributeId) {
        self.counters.bump(Group::RxDuplicates, a);
    }

    fn on_req(&mut self, h: &Header, r: &req::Repr<'_>, src: Gid, now: Time) {
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
            return;
        }
        // Stale connection: the peer's QP is still connected to one of ours (IBTA 12.4.1).
        // A connection in TimeWait is not in this index: its QPN may be reused at once.
        if let Some(&old) = self.remote_qpns.get(&(r.local_ca_guid, r.local_qpn)) {
            self.send_rej(
                src,
                h.tid,
                0,
                r.local_comm_id,
                MsgResponse::Req,
                RejReason::StaleConn,
                &[],
                &[],
            );
            if self.conns[old as usize].state == State::Established {
                self.send_stale_dreq(old, now);
            }
            return;
        }
        let Some(&lslot) = self.listeners.get(&r.service_id) else {
            self.send_rej(
                src,
                h.tid,
                0,
                r.local_comm_id,
                MsgResponse::Req,
                RejReason::InvalidServiceId,
                &[],
                &[],
            );
            return;
        };
        let full =
            self.cfg.max_connections != 0 && self.connections >= self.cfg.max_connections as usize;
        if full {
            self.send_rej(
                src,
                h.tid,
                0,
                r.local_comm_id,
                MsgResponse::Req,
                RejReason::NoResources,
                &[],
                &[],
            );
            return;
        }
        if r.primary_path.remote_gid != self.cfg.gid {
            let gid = self.cfg.gid.0;
            self.send_rej(
                src,
                h.tid,
                0,
                r.local_comm_id,
                MsgResponse::Req,
                RejReason::InvalidGid,
                &gid,
                &[],
            );
            return;
        }
        let slot = self.alloc_slot(false);
        let Some(local_id) = self.comm_ids.alloc(slot) else {
            self.free_slot(slot);
            self.send_rej(
                src,
                h.tid,
                0,
                r.local_comm_id,
                MsgResponse::Req,
                RejReason::NoResources,
                &[],
                &[],
            );
            return;
        };
        let listen_id = self.id_of(lslot);
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

    fn on_mra(&mut self, r: &mra::Repr<'_>, now: Time) {
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

    fn on_rej(&mut self, r: &rej::Repr<'_>, now: Time) {
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

    fn on_rep(&mut self, h: &Header, r: &rep::Repr<'_>, src: Gid, now: Time) {
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

    fn on_rtu(&mut self, r: &rtu::Repr<'_>) {
        let Some(slot) = self.by_ids(r.remote_comm_id, r.local_comm_id) else {
            self.drops.bump(DropReason::UnknownConnection);
            return;
        };
        match self.conns[slot as usize].state {
            State::RepSent | State::MraRepRcvd => {
                self.disarm(slot);
                let c = &mut self.conns[slot as usize];
                c.msg = None;
                c.state = State::Established;
                let remote_qpn = c.remote_qpn;
                let id = self.id_of(slot);
                self.event(Event::Established {
                    id,
                    remote_qpn,
                    private_data: r.private_data.to_vec(),
                });
            }
            _ => self.dup(AttributeId::Rtu),
        }
    }

    fn on_dreq(&mut self, h: &Header, r: &dreq::Repr<'_>, src: Gid, now: Time) {
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

    fn on_drep(&mut self, r: &drep::Repr<'_>, now: Time) {
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

    fn on_lap(&mut self, r: &lap::Repr<'_>) {
        // Alternate paths do not exist on RoCE: Linux's cm_lap_handler returns -EINVAL
        // there, so the LAP is dropped and nothing is sent (no APR, no MRA). Counted.
        let reason = match self.by_ids(r.remote_comm_id, r.local_comm_id) {
            None => DropReason::UnknownConnection,
            Some(s) if self.conns[s as usize].state == State::Established => DropReason::LapOnRoce,
            Some(_) => DropReason::BadState,
        };
        self.drops.bump(reason);
    }

    fn on_sidr_req(&mut self, h: &Header, r: &sidr_req::Repr<'_>, src: Gid) {
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

    fn on_sidr_rep(&mut self, r: &sidr_rep::Repr<'_>) {
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

    fn on_class_port_info(&mut self, h: &Header, src: Gid) {
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

/// Fails unless `data` fits a private-data field of `max` bytes.
pub(crate) fn check_pd(data: &[u8], max: usize) -> Result<(), super::CmError> {
    if data.len() > max {
        Err(super::CmError::PrivateDataTooLong {
            len: data.len(),
            max,
        })
    } else {
        Ok(())
    }
}

/// Private-data sizes, by message.
pub(crate) mod pd {
    pub use pvcm_wire::cm::{
        rej::PRIVATE_DATA_LEN as REJ, rep::PRIVATE_DATA_LEN as REP, req::PRIVATE_DATA_LEN as REQ,
        rtu::PRIVATE_DATA_LEN as RTU, sidr_rep::PRIVATE_DATA_LEN as SIDR_REP,
        sidr_req::PRIVATE_DATA_LEN as SIDR_REQ,
    };
}

/// An event left the queue: its slot has one fewer queued.
fn unqueued(queued: &mut [u32], e: &Event) {
    if let Some(n) = queued.get_mut(e.id().slot as usize) {
        *n = n.saturating_sub(1);
    }
}

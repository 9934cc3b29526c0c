//! The agent: connection records, slots and indexes, the event queue. The rest is split
//! by concern, as the host's mux is: `recv.rs` parses a MAD and dispatches it to one
//! handler per message (`establish.rs`: REQ, MRA, REJ, REP, RTU; `release.rs`: DREQ,
//! DREP; `sidr.rs`: SIDR_REQ, SIDR_REP), `send.rs` formats and sends the agent's MADs,
//! `timers.rs` arms and fires the retry and TimeWait timers, `pace.rs` sends requests
//! through the pacer. The application-facing calls are in `../api.rs`.

mod establish;
mod pace;
mod recv;
mod release;
mod send;
mod sidr;
mod timers;

pub(crate) use send::ReqValues;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::FastMap;

use pvcm_wire::Gid;
use pvcm_wire::cm::CmRepr;
use pvcm_wire::mad::{self, AttributeId, MAD_LEN};
use pvcm_wire::timeout::linux_ms;

use super::config::AgentConfig;
use super::counters::{CmCounters, Drops};
use super::event::{CmId, Event, State};
use super::ids::{CommIds, QpnPool, SplitMix64};
use super::pacing::{Pace, Pacer};
use super::qp_attr::QpParams;
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
    /// Our DREQ's retries ran out (Linux IB_CM_DREQ_ERROR): the DISCONNECTED it gave
    /// carries -ETIMEDOUT in rdma_cm.
    pub dreq_timed_out: bool,
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
            dreq_timed_out: false,
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

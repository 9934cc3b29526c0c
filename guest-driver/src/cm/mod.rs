//! The guest's Connection Manager: a complete IBA chapter-12 CM agent with rdma_cm
//! semantics, pure and I/O-free like the host's mux.
//!
//! [`Agent`] takes MADs from the device ([`Agent::handle_mad`], with the sender's GID
//! from the device ABI's message header), calls from the application
//! ([`Agent::listen`], [`Agent::connect`], [`Agent::accept`], [`Agent::reject`],
//! [`Agent::disconnect`], [`Agent::destroy`], [`Agent::resolve_sidr`]) and timer polls
//! ([`Agent::poll`] at [`Agent::next_deadline`]). Every input carries the current
//! [`Time`](crate::time::Time); nothing reads a clock, sleeps or does I/O. Its outputs are
//! an outbox of MADs with their destination GIDs ([`Agent::pop_outbox`]), which the
//! transport hands to the device, and an event queue ([`Agent::pop_event`]).
//!
//! # Behaviour (Linux `drivers/infiniband/core/cm.c` + rdma_cm)
//!
//! - States: those of `enum ib_cm_state` ([`State`]). REQ, REP and DREQ (and SIDR_REQ)
//!   are retried: one attempt lasts Linux's `timeout_ms` — on the active side
//!   `2 * ms(packet life) + ms(remote CM response timeout)`, on the passive side
//!   `ms(the REQ's local CM response timeout)`, `ms(t) = 1 << max(t - 8, 0)` — and
//!   the REQ's Max CM Retries bounds the retries. Exhausted REQ/REP/SIDR_REQ retries
//!   report [`Event::Unreachable`]; exhausted DREQ retries report `Disconnected` and
//!   enter TimeWait.
//! - MRA: a received MRA makes this attempt and every remaining retry wait
//!   `ms(service timeout) + ms(packet life)` (Linux `ib_modify_mad`). When the
//!   application has not answered a REQ (or, on an active side that confirms REPs itself,
//!   a REP) within [`AgentConfig::mra_delay`], the connection enters MRA_REQ_SENT
//!   (MRA_REP_SENT) silently, as rdma_cm's `IB_CM_MRA_FLAG_DELAY`: the MRA, offering
//!   [`AgentConfig::mra_service_timeout`], goes out only in answer to a duplicate REQ
//!   (REP), never on a timer.
//! - REJ reasons produced: CONSUMER_DEFINED (application reject, or destroy during the
//!   handshake), INVALID_SERVICE_ID (no listener), STALE_CONN, TIMEOUT (destroy in
//!   REQ_SENT / MRA_REQ_RCVD: ARI = our CA GUID big-endian, Remote Comm ID 0),
//!   NO_RESOURCES (over [`AgentConfig::max_connections`]), INVALID_GID (a REQ whose
//!   primary remote GID is not ours). A REP for a comm ID we do not have is dropped and
//!   counted, as in Linux.
//! - Duplicates by (remote comm ID, remote CA GUID), while the connection is not in
//!   TimeWait (entering TimeWait forgets the remote comm ID, as Linux's
//!   `cm_remove_remote()`: a REQ reusing it is a new request): a duplicate REQ gets the
//!   MRA in MRA_REQ_SENT, else is dropped; a duplicate REP re-sends the RTU (or the
//!   MRA(REP)); a DREQ for an unknown
//!   connection gets a stateless DREP; a DREQ in TimeWait gets the DREP again; a DREQ
//!   whose Remote QPN is not our QPN is dropped. All counted in `cm_rx_duplicates`
//!   (answers to duplicates count as `cm_tx_retries`, except a delayed MRA going out
//!   for the first time; unlike Linux, which
//!   adds 2 to `cm_tx_msgs` for such an answer, every MAD sent counts once, so one
//!   side's `cm_tx_msgs` equals the other's `cm_rx_msgs` on a lossless wire).
//! - Stale connections (IBTA 12.4.1, 12.9.8.3.1): a REQ or REP naming a (CA GUID, QPN)
//!   one of our connections is still connected to is rejected with STALE_CONN and the
//!   old connection gets a DREQ. A connection in TimeWait is *not* connected: its QPN
//!   may be reused at once (the `timewait-reuse` lab scenario).
//! - TimeWait lasts `ms(path ACK timeout)` (Linux `av.timeout`: packet life + 1, so
//!   512 ms for rdma_cm's RoCE paths); then the comm ID (and a simulated QPN) returns to
//!   the allocator. Comm IDs: cyclic index XOR a random operand, never 0, never one
//!   held. TIDs: `hi_tid << 32 | local comm ID` for REQ, DREQ and SIDR_REQ; answers
//!   echo the TID they answer.
//! - LAP is dropped and counted ([`DropReason::LapOnRoce`]), nothing is answered: on
//!   RoCE there are no alternate paths, and Linux's `cm_lap_handler` drops LAPs there
//!   too. APRs are never expected (we send no LAP).
//! - Handles (`CmId`) live until `destroy()`, as rdma_cm ids do; destroying one
//!   withdraws its queued events.
//! - ClassPortInfo GET is answered with GETRESP.
//! - DREQ: unlike rdma_cm, the DREP goes out at once, then TimeWait, then
//!   `Disconnected`; a later `disconnect()`/`destroy()` sends nothing. With
//!   [`AgentConfig::auto_drep`] off, as rdma_cm, the DREP waits for the application's
//!   `disconnect()` or `destroy()`.
//!
//! Left out: alternate paths and path migration, sending LAP, RD/EEC, the device's
//! SEND_ERROR feedback (a MAD the device refused is retried like a lost one).

mod agent;
mod api;
mod config;
mod counters;
mod event;
mod ids;
mod pacing;
pub mod qp_attr;
pub mod rdma_cm;

pub use agent::{Agent, OutMad};
pub use api::ConnInfo;
pub use config::{
    AcceptOptions, AgentConfig, CM_MRA_SETTING, CMA_CM_RESPONSE_TIMEOUT, CMA_IBOE_PACKET_LIFETIME,
    CMA_MAX_CM_RETRIES, ConnectOptions, DEFAULT_MAX_RD_ATOM, RDMA_MAX_INIT_DEPTH,
    RDMA_MAX_RESP_RES, SidrOptions, cm_ack_timeout,
};
pub use counters::{CmCounters, DropReason, Drops, Group, MESSAGES};
pub use event::{CmError, CmId, Event, State};
pub use ids::{CommIds, QpnPool, SplitMix64};
pub use pacing::{
    DEFAULT_INITIAL_WINDOW, DEFAULT_MAX_WINDOW, MIN_WINDOW, Pacing, PacingCounters, Request,
    WindowInfo,
};
pub use pvcm_wire::cm::{RejReason, SidrStatus};
pub use qp_attr::{QpAttr, QpParams, QpState};

/// The agent's hash maps and sets: foldhash, randomly keyed per map, instead of std's
/// SipHash, which cost a fifth of the agent's time per connection (agent_burst bench).
/// Keys include peers' comm IDs and CA GUIDs, so the hasher stays keyed.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// See [`FastMap`].
pub(crate) type FastSet<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;

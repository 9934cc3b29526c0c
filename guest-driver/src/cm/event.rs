//! What the application sees: connection handles, states, events and errors.

use core::fmt;

use pvcm_wire::Gid;
use pvcm_wire::cm::{RejReason, SidrStatus};

/// A handle on a connection, listener or SIDR exchange (rdma_cm's `rdma_cm_id`).
///
/// Handles are never reused while the agent remembers them: a slot's generation moves
/// on when it is freed, so a stale handle is reported as unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CmId {
    pub(crate) slot: u32,
    pub(crate) generation: u32,
}

impl fmt::Display for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cm#{}.{}", self.slot, self.generation)
    }
}

/// The CM states of Linux's `enum ib_cm_state` (IBTA chapter 12).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No exchange in progress.
    Idle,
    /// Listening for REQs and SIDR_REQs on a service ID.
    Listen,
    /// REQ sent, waiting for REP/REJ/MRA.
    ReqSent,
    /// REQ received, waiting for the application.
    ReqRcvd,
    /// REQ received and MRA(REQ) sent.
    MraReqSent,
    /// REQ sent and MRA(REQ) received.
    MraReqRcvd,
    /// REP sent, waiting for RTU.
    RepSent,
    /// REP received, waiting for the application (manual RTU).
    RepRcvd,
    /// REP received and MRA(REP) sent.
    MraRepSent,
    /// REP sent and MRA(REP) received.
    MraRepRcvd,
    /// Connected.
    Established,
    /// DREQ sent, waiting for DREP.
    DreqSent,
    /// DREQ received, waiting for the application's DREP.
    DreqRcvd,
    /// Disconnected; IDs held until the TimeWait ends.
    Timewait,
    /// SIDR_REQ sent, waiting for SIDR_REP.
    SidrReqSent,
    /// SIDR_REQ received, waiting for the application.
    SidrReqRcvd,
}

impl State {
    /// Every state.
    pub const ALL: [State; 16] = [
        State::Idle,
        State::Listen,
        State::ReqSent,
        State::ReqRcvd,
        State::MraReqSent,
        State::MraReqRcvd,
        State::RepSent,
        State::RepRcvd,
        State::MraRepSent,
        State::MraRepRcvd,
        State::Established,
        State::DreqSent,
        State::DreqRcvd,
        State::Timewait,
        State::SidrReqSent,
        State::SidrReqRcvd,
    ];

    /// Linux's name (`IB_CM_REQ_SENT` -> `REQ_SENT`).
    pub fn name(self) -> &'static str {
        match self {
            State::Idle => "IDLE",
            State::Listen => "LISTEN",
            State::ReqSent => "REQ_SENT",
            State::ReqRcvd => "REQ_RCVD",
            State::MraReqSent => "MRA_REQ_SENT",
            State::MraReqRcvd => "MRA_REQ_RCVD",
            State::RepSent => "REP_SENT",
            State::RepRcvd => "REP_RCVD",
            State::MraRepSent => "MRA_REP_SENT",
            State::MraRepRcvd => "MRA_REP_RCVD",
            State::Established => "ESTABLISHED",
            State::DreqSent => "DREQ_SENT",
            State::DreqRcvd => "DREQ_RCVD",
            State::Timewait => "TIMEWAIT",
            State::SidrReqSent => "SIDR_REQ_SENT",
            State::SidrReqRcvd => "SIDR_REQ_RCVD",
        }
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An event for the application (rdma_cm's `rdma_cm_event`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A REQ arrived for a listener: `accept()` or `reject()` the new `id`
    /// (`RDMA_CM_EVENT_CONNECT_REQUEST`).
    ConnectRequest {
        /// The new connection.
        id: CmId,
        /// The listener the REQ matched.
        listen_id: CmId,
        /// Where the REQ came from.
        remote_gid: Gid,
        /// The REQ's service ID.
        service_id: u64,
        /// The peer's QPN.
        remote_qpn: u32,
        /// The REQ's private data (the whole 92-byte field).
        private_data: Vec<u8>,
    },
    /// A REP arrived on a connection made with `auto_rtu: false`: `accept()` sends the
    /// RTU, `reject()` a REJ (`RDMA_CM_EVENT_CONNECT_RESPONSE`).
    ConnectResponse {
        /// The connection.
        id: CmId,
        /// The peer's QPN.
        remote_qpn: u32,
        /// The REP's private data.
        private_data: Vec<u8>,
    },
    /// Connected (`RDMA_CM_EVENT_ESTABLISHED`).
    Established {
        /// The connection.
        id: CmId,
        /// The peer's QPN.
        remote_qpn: u32,
        /// Private data of the REP (active side) or RTU (passive side).
        private_data: Vec<u8>,
    },
    /// The peer rejected (`RDMA_CM_EVENT_REJECTED`).
    Rejected {
        /// The connection.
        id: CmId,
        /// The REJ's reason.
        reason: RejReason,
        /// The REJ's Additional Rejection Information.
        ari: Vec<u8>,
        /// The REJ's private data.
        private_data: Vec<u8>,
    },
    /// Retries exhausted without an answer (`RDMA_CM_EVENT_UNREACHABLE`), for a REQ, a
    /// REP or a SIDR_REQ.
    Unreachable {
        /// The connection.
        id: CmId,
    },
    /// The connection is down: a DREQ arrived, our DREQ was answered, or our DREQ's
    /// retries ran out (`RDMA_CM_EVENT_DISCONNECTED`). After a received DREQ the
    /// application answers with `disconnect()` (or `destroy()`).
    Disconnected {
        /// The connection.
        id: CmId,
    },
    /// The TimeWait ended; the comm ID went back to the allocator
    /// (`RDMA_CM_EVENT_TIMEWAIT_EXIT`).
    TimewaitExit {
        /// The connection.
        id: CmId,
    },
    /// A SIDR_REQ for a listener without an automatic answer: answer with
    /// `sidr_reply()`.
    SidrRequest {
        /// The new SIDR exchange.
        id: CmId,
        /// The listener it matched.
        listen_id: CmId,
        /// Where it came from.
        remote_gid: Gid,
        /// Its service ID.
        service_id: u64,
        /// Its private data.
        private_data: Vec<u8>,
    },
    /// A SIDR_REP answered our SIDR_REQ.
    SidrResolved {
        /// The SIDR exchange.
        id: CmId,
        /// The answer's status.
        status: SidrStatus,
        /// The service's UD QPN.
        qpn: u32,
        /// The service's Q_Key.
        qkey: u32,
        /// The SIDR_REP's private data.
        private_data: Vec<u8>,
    },
}

impl Event {
    /// The handle the event is about.
    pub fn id(&self) -> CmId {
        match self {
            Event::ConnectRequest { id, .. }
            | Event::ConnectResponse { id, .. }
            | Event::Established { id, .. }
            | Event::Rejected { id, .. }
            | Event::Unreachable { id }
            | Event::Disconnected { id }
            | Event::TimewaitExit { id }
            | Event::SidrRequest { id, .. }
            | Event::SidrResolved { id, .. } => *id,
        }
    }
}

/// Why an API call failed. Nothing is sent and no state changes when one is returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    /// The handle names nothing (never issued, or destroyed).
    #[error("unknown cm id")]
    UnknownId,
    /// The call does not fit the connection's state.
    #[error("not valid in state {0}")]
    InvalidState(State),
    /// Private data longer than the message carries.
    #[error("private data of {len} bytes, at most {max}")]
    PrivateDataTooLong {
        /// Bytes given.
        len: usize,
        /// The message's private data size.
        max: usize,
    },
    /// Another listener has this service ID.
    #[error("service id {0:#018x} already has a listener")]
    ServiceIdInUse(u64),
    /// No comm ID, QPN or connection slot left.
    #[error("out of resources")]
    NoResources,
    /// A QPN outside the port's range (the device would drop the MAD).
    #[error("qpn {0:#x} is not in the port's range")]
    QpnNotOwned(u32),
    /// A local GID that is none of the port's (the device would drop the REQ).
    #[error("GID {0} is not one of the port's")]
    GidNotOwned(pvcm_wire::Gid),
}

//! QP attributes from a connection's CM exchange: what Linux's `ib_cm_init_qp_attr()`
//! (`cm_init_qp_init_attr`, `cm_init_qp_rtr_attr`, `cm_init_qp_rts_attr`) hands a
//! consumer to move its QP to INIT, RTR and RTS.
//!
//! [`QpParams`] is what the exchange settled for one connection, kept as Linux's
//! `cm_id_priv` keeps it: written when the REQ is sent or received and when the REP is
//! sent or received, each side taking the peer's values where IBTA says so (the peer's
//! starting PSN is our send PSN, the peer's responder resources bound our initiator
//! depth, the peer's RNR retry count is ours). [`QpParams::attr`] turns it into a
//! [`QpAttr`] for a target QP state, refusing the states Linux refuses.
//!
//! The attributes a CM cannot know (the P_Key index and port of the consumer's device,
//! the GID table index of the local GID) are left to the caller: the mask says they are
//! needed ([`mask::PKEY_INDEX`], [`mask::PORT`], the AV's source GID).

use pvcm_wire::Gid;

use super::event::{CmError, State};

/// `enum ib_qp_attr_mask` bits (Linux `include/rdma/ib_verbs.h`, the same values in
/// `ib_uverbs_qp_attr.qp_attr_mask`).
pub mod mask {
    /// `IB_QP_STATE`.
    pub const STATE: u32 = 1;
    /// `IB_QP_CUR_STATE`.
    pub const CUR_STATE: u32 = 1 << 1;
    /// `IB_QP_EN_SQD_ASYNC_NOTIFY`.
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    /// `IB_QP_ACCESS_FLAGS`.
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    /// `IB_QP_PKEY_INDEX`.
    pub const PKEY_INDEX: u32 = 1 << 4;
    /// `IB_QP_PORT`.
    pub const PORT: u32 = 1 << 5;
    /// `IB_QP_QKEY`.
    pub const QKEY: u32 = 1 << 6;
    /// `IB_QP_AV`.
    pub const AV: u32 = 1 << 7;
    /// `IB_QP_PATH_MTU`.
    pub const PATH_MTU: u32 = 1 << 8;
    /// `IB_QP_TIMEOUT`.
    pub const TIMEOUT: u32 = 1 << 9;
    /// `IB_QP_RETRY_CNT`.
    pub const RETRY_CNT: u32 = 1 << 10;
    /// `IB_QP_RNR_RETRY`.
    pub const RNR_RETRY: u32 = 1 << 11;
    /// `IB_QP_RQ_PSN`.
    pub const RQ_PSN: u32 = 1 << 12;
    /// `IB_QP_MAX_QP_RD_ATOMIC`.
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    /// `IB_QP_ALT_PATH`.
    pub const ALT_PATH: u32 = 1 << 14;
    /// `IB_QP_MIN_RNR_TIMER`.
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    /// `IB_QP_SQ_PSN`.
    pub const SQ_PSN: u32 = 1 << 16;
    /// `IB_QP_MAX_DEST_RD_ATOMIC`.
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    /// `IB_QP_PATH_MIG_STATE`.
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    /// `IB_QP_CAP`.
    pub const CAP: u32 = 1 << 19;
    /// `IB_QP_DEST_QPN`.
    pub const DEST_QPN: u32 = 1 << 20;
}

/// `enum ib_access_flags` bits a CM sets.
pub mod access {
    /// `IB_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: u32 = 1;
    /// `IB_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: u32 = 1 << 1;
    /// `IB_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: u32 = 1 << 2;
    /// `IB_ACCESS_REMOTE_ATOMIC`.
    pub const REMOTE_ATOMIC: u32 = 1 << 3;
}

/// QP states (`enum ib_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    /// `IB_QPS_RESET`.
    Reset = 0,
    /// `IB_QPS_INIT`.
    Init = 1,
    /// `IB_QPS_RTR`.
    Rtr = 2,
    /// `IB_QPS_RTS`.
    Rts = 3,
    /// `IB_QPS_SQD`.
    Sqd = 4,
    /// `IB_QPS_SQE`.
    Sqe = 5,
    /// `IB_QPS_ERR`.
    Err = 6,
}

impl QpState {
    /// The state of a raw value (`None` past `IB_QPS_ERR`).
    pub fn from_u32(v: u32) -> Option<QpState> {
        Some(match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            4 => QpState::Sqd,
            5 => QpState::Sqe,
            6 => QpState::Err,
            _ => return None,
        })
    }
}

/// The primary path's address vector as this side sees it (Linux `cm_av`'s GRH).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathAv {
    /// The peer's GID (destination).
    pub remote_gid: Gid,
    /// Our GID (source; the caller maps it to its device's GID index).
    pub local_gid: Gid,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Service level (4 bits).
    pub sl: u8,
}

/// What a connection's exchange settled for its QP (Linux `cm_id_priv`'s fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpParams {
    /// Our QPN (the REQ's or REP's Local QPN).
    pub local_qpn: u32,
    /// The peer's QPN.
    pub remote_qpn: u32,
    /// Our send PSN: the peer's starting PSN.
    pub sq_psn: u32,
    /// Our receive PSN: the starting PSN we sent.
    pub rq_psn: u32,
    /// Path MTU (IBTA code).
    pub path_mtu: u8,
    /// Transport retry count.
    pub retry_count: u8,
    /// RNR retry count (the peer's, for our QP).
    pub rnr_retry_count: u8,
    /// RDMA reads/atomics we accept at once.
    pub responder_resources: u8,
    /// RDMA reads/atomics we may have outstanding.
    pub initiator_depth: u8,
    /// The primary path.
    pub path: PathAv,
    /// The peer asked for end-to-end flow control (its REQ's or REP's bit).
    pub peer_flow_control: bool,
    /// The peer's QP uses a shared receive queue (its REQ's or REP's SRQ bit).
    pub peer_srq: bool,
}

/// Attributes for `ibv_modify_qp` (the fields a CM fills of `struct ib_qp_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpAttr {
    /// Which fields are set ([`mask`] bits).
    pub mask: u32,
    /// Target state.
    pub state: QpState,
    /// Remote access flags ([`access`] bits).
    pub access_flags: u32,
    /// Path MTU (IBTA code).
    pub path_mtu: u8,
    /// Destination QPN.
    pub dest_qpn: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Local ACK timeout (5-bit exponent).
    pub timeout: u8,
    /// Transport retry count.
    pub retry_cnt: u8,
    /// RNR retry count.
    pub rnr_retry: u8,
    /// The address vector (with [`mask::AV`]).
    pub av: PathAv,
}

impl QpAttr {
    fn new(state: QpState, mask: u32) -> QpAttr {
        QpAttr {
            mask,
            state,
            access_flags: 0,
            path_mtu: 0,
            dest_qpn: 0,
            rq_psn: 0,
            sq_psn: 0,
            max_dest_rd_atomic: 0,
            min_rnr_timer: 0,
            max_rd_atomic: 0,
            timeout: 0,
            retry_cnt: 0,
            rnr_retry: 0,
            av: PathAv::default(),
        }
    }
}

impl QpParams {
    /// The attributes for moving the QP to `target` while the connection is in `state`,
    /// with `timeout` the path's ACK timeout (Linux `av.timeout`), as Linux's
    /// `ib_cm_init_qp_attr()` computes them for an RC QP. INIT needs a connection that
    /// started (REQ sent or received); RTR and RTS need the peer's values (REQ received
    /// or REP received). Other targets and states are `InvalidState`.
    pub fn attr(&self, state: State, target: QpState, timeout: u8) -> Result<QpAttr, CmError> {
        use State::*;
        let exchanged = matches!(
            state,
            ReqRcvd | MraReqSent | RepRcvd | MraRepSent | RepSent | MraRepRcvd | Established
        );
        match target {
            QpState::Init if exchanged || matches!(state, ReqSent | MraReqRcvd) => {
                let mut a = QpAttr::new(
                    target,
                    mask::STATE | mask::ACCESS_FLAGS | mask::PKEY_INDEX | mask::PORT,
                );
                a.access_flags = access::REMOTE_WRITE;
                if self.responder_resources > 0 {
                    a.access_flags |= access::REMOTE_READ | access::REMOTE_ATOMIC;
                }
                Ok(a)
            }
            QpState::Rtr if exchanged => {
                let mut a = QpAttr::new(
                    target,
                    mask::STATE
                        | mask::AV
                        | mask::PATH_MTU
                        | mask::DEST_QPN
                        | mask::RQ_PSN
                        | mask::MAX_DEST_RD_ATOMIC
                        | mask::MIN_RNR_TIMER,
                );
                a.av = self.path;
                a.path_mtu = self.path_mtu;
                a.dest_qpn = self.remote_qpn;
                a.rq_psn = self.rq_psn;
                a.max_dest_rd_atomic = self.responder_resources;
                a.min_rnr_timer = 0;
                Ok(a)
            }
            QpState::Rts if exchanged => {
                let mut a = QpAttr::new(
                    target,
                    mask::STATE
                        | mask::SQ_PSN
                        | mask::RETRY_CNT
                        | mask::RNR_RETRY
                        | mask::MAX_QP_RD_ATOMIC
                        | mask::TIMEOUT,
                );
                a.sq_psn = self.sq_psn;
                a.retry_cnt = self.retry_count;
                a.rnr_retry = self.rnr_retry_count;
                a.max_rd_atomic = self.initiator_depth;
                a.timeout = timeout;
                Ok(a)
            }
            _ => Err(CmError::InvalidState(state)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> QpParams {
        QpParams {
            local_qpn: 0x11,
            remote_qpn: 0x22,
            sq_psn: 0x1234,
            rq_psn: 0x5678,
            path_mtu: 3,
            retry_count: 7,
            rnr_retry_count: 6,
            responder_resources: 4,
            initiator_depth: 2,
            path: PathAv {
                remote_gid: Gid::from_ipv4([10, 0, 0, 2].into()),
                local_gid: Gid::from_ipv4([10, 0, 0, 1].into()),
                flow_label: 0x12345,
                hop_limit: 64,
                traffic_class: 0x20,
                sl: 0,
            },
            peer_flow_control: false,
            peer_srq: false,
        }
    }

    #[test]
    fn init_rtr_rts_as_linux() {
        let p = params();
        let i = p
            .attr(State::ReqSent, QpState::Init, 17)
            .expect("init from REQ_SENT");
        assert_eq!(
            i.mask,
            mask::STATE | mask::ACCESS_FLAGS | mask::PKEY_INDEX | mask::PORT
        );
        assert_eq!(
            i.access_flags,
            access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC
        );
        let none = QpParams {
            responder_resources: 0,
            ..p
        };
        assert_eq!(
            none.attr(State::ReqRcvd, QpState::Init, 17)
                .expect("init")
                .access_flags,
            access::REMOTE_WRITE
        );
        let r = p.attr(State::RepRcvd, QpState::Rtr, 17).expect("rtr");
        assert_eq!(
            (r.dest_qpn, r.rq_psn, r.path_mtu, r.max_dest_rd_atomic, r.av),
            (0x22, 0x5678, 3, 4, p.path)
        );
        assert!(r.mask & mask::AV != 0 && r.mask & mask::SQ_PSN == 0);
        let s = p.attr(State::Established, QpState::Rts, 18).expect("rts");
        assert_eq!(
            (
                s.sq_psn,
                s.retry_cnt,
                s.rnr_retry,
                s.max_rd_atomic,
                s.timeout
            ),
            (0x1234, 7, 6, 2, 18)
        );
    }

    #[test]
    fn refused_where_linux_refuses() {
        let p = params();
        // No peer values yet on the active side.
        assert_eq!(
            p.attr(State::ReqSent, QpState::Rtr, 17),
            Err(CmError::InvalidState(State::ReqSent))
        );
        assert!(p.attr(State::Idle, QpState::Init, 17).is_err());
        assert!(p.attr(State::Timewait, QpState::Rts, 17).is_err());
        assert!(p.attr(State::Established, QpState::Err, 17).is_err());
        assert_eq!(QpState::from_u32(7), None);
        assert_eq!(QpState::from_u32(3), Some(QpState::Rts));
    }
}

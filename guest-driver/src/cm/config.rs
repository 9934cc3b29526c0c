//! The agent's configuration (from the device's PORT_INFO) and per-call options, with
//! defaults taken from what Linux's rdma_cm puts in its messages.

use core::time::Duration;

use pvcm_wire::Gid;
use pvcm_wire::abi::{MTU_1024, PortInfo};
use pvcm_wire::cm::TransportService;

use super::pacing::Pacing;

/// Linux's `CM_MRA_SETTING`: the service timeout an MRA offers (~68.7 s).
pub const CM_MRA_SETTING: u8 = 24;
/// rdma_cm's `CMA_CM_RESPONSE_TIMEOUT`: 4.096 us * 2^20 (~4.3 s; Linux uses 4096 ms).
pub const CMA_CM_RESPONSE_TIMEOUT: u8 = 20;
/// rdma_cm's `CMA_MAX_CM_RETRIES`.
pub const CMA_MAX_CM_RETRIES: u8 = 15;
/// rdma_cm's `CMA_IBOE_PACKET_LIFETIME` (RoCE paths): 4.096 us * 2^16 (Linux: 256 ms).
pub const CMA_IBOE_PACKET_LIFETIME: u8 = 16;
/// librdmacm's `RDMA_MAX_RESP_RES`: in [`ConnectOptions`]/[`AcceptOptions`], "the
/// device maximum" (librdmacm's default when the application passes no `conn_param`).
pub const RDMA_MAX_RESP_RES: u8 = 0xFF;
/// librdmacm's `RDMA_MAX_INIT_DEPTH`: in [`ConnectOptions`]/[`AcceptOptions`], "the
/// device maximum".
pub const RDMA_MAX_INIT_DEPTH: u8 = 0xFF;
/// The responder resources and initiator depth [`AgentConfig`] takes as the device
/// maximum: rdma_rxe's `max_qp_rd_atom` and `max_qp_init_rd_atom` (128).
pub const DEFAULT_MAX_RD_ATOM: u8 = 128;

/// The agent's identity and policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// The port's (primary) GID: the REQ's primary local GID unless
    /// [`ConnectOptions::local_gid`] names a further one.
    pub gid: Gid,
    /// The port's further GIDs (PORT_INFO's): a REQ to one of them is ours too, and a
    /// connection may start from one.
    pub more_gids: Vec<Gid>,
    /// The CA GUID (REQ/REP Local CA GUID, REJ(TIMEOUT) ARI).
    pub ca_guid: u64,
    /// P_Key (REQ partition key, SIDR_REQ P_Key).
    pub pkey: u16,
    /// LID (0xFFFF on RoCE; REQ paths use the permissive LID when routed).
    pub lid: u16,
    /// First QPN of the port's range for simulated QPs.
    pub qpn_base: u32,
    /// Size of the QPN range.
    pub qpn_count: u32,
    /// Most connections the agent holds at once (0: no limit); a REQ beyond it is
    /// answered with REJ(NO_RESOURCES).
    pub max_connections: u32,
    /// Seed of the comm-ID random operand, the TID prefix and starting PSNs.
    pub seed: u64,
    /// Upper 32 bits of every TID the agent starts (Linux: the MAD agent's `hi_tid`).
    pub hi_tid: u32,
    /// The CA's ACK delay (5-bit exponent): REP Target ACK Delay, and an input of the
    /// REQ's Local ACK Timeout (Linux `cm_ack_timeout()`).
    pub ack_delay: u8,
    /// If the application has not answered a REQ (accept/reject) within this time, the
    /// connection enters MRA_REQ_SENT *silently*, as rdma_cm does with
    /// `IB_CM_MRA_FLAG_DELAY` when its connect-request handler returns without
    /// accepting: the MRA(REQ) goes out only when a duplicate REQ arrives (Linux
    /// `cm_dup_req_handler`), never on a timer. Likewise MRA_REP_SENT for an active side
    /// that confirms REPs itself (the MRA(REP) answers a duplicate REP). `None`: never
    /// (a duplicate is then dropped).
    pub mra_delay: Option<Duration>,
    /// Service timeout the agent's MRAs offer (5-bit exponent; Linux 24).
    pub mra_service_timeout: u8,
    /// Answer a DREQ with a DREP at once (the default): the connection enters TimeWait
    /// and then the application gets `Disconnected`; its later `disconnect()` or
    /// `destroy()` sends nothing. An application that reacts late then never makes the
    /// peer retry its DREQ. `false`: Linux's behaviour, where rdma_cm sends the DREP only
    /// when the application calls `rdma_disconnect()` (here `disconnect()`/`destroy()`)
    /// and the DREQ is retried meanwhile (`pvcm-guest --linux-drep`).
    pub auto_drep: bool,
    /// The CM's response time value (5-bit exponent) reported in ClassPortInfo.
    pub resp_time: u8,
    /// The port's active MTU (IBTA code, PORT_INFO `active_mtu`): the REQ's Path MTU
    /// unless [`ConnectOptions::path_mtu`] names one.
    pub active_mtu: u8,
    /// The device maximum of responder resources (Linux `max_qp_rd_atom`): what
    /// [`RDMA_MAX_RESP_RES`] in the options stands for. The pvcm device carries no QPs,
    /// so this defaults to rdma_rxe's value; set it to the QP device's attribute.
    pub max_responder_resources: u8,
    /// The device maximum of initiator depth (Linux `max_qp_init_rd_atom`): what
    /// [`RDMA_MAX_INIT_DEPTH`] stands for.
    pub max_initiator_depth: u8,
    /// Per-destination pacing of REQs and DREQs; `None`: every request goes out at once.
    pub pacing: Option<Pacing>,
}

impl AgentConfig {
    /// A configuration with pvcm's defaults.
    pub fn new(gid: Gid, ca_guid: u64, qpn_base: u32, qpn_count: u32, seed: u64) -> AgentConfig {
        let mut rng = super::ids::SplitMix64::new(seed ^ 0x6869_5f74_6964);
        AgentConfig {
            gid,
            more_gids: Vec::new(),
            ca_guid,
            pkey: 0xFFFF,
            lid: 0xFFFF,
            qpn_base,
            qpn_count,
            max_connections: 0,
            seed,
            hi_tid: rng.next_u32(),
            ack_delay: 0,
            mra_delay: Some(Duration::from_millis(100)),
            mra_service_timeout: CM_MRA_SETTING,
            auto_drep: true,
            resp_time: CMA_CM_RESPONSE_TIMEOUT,
            active_mtu: MTU_1024,
            max_responder_resources: DEFAULT_MAX_RD_ATOM,
            max_initiator_depth: DEFAULT_MAX_RD_ATOM,
            pacing: Some(Pacing::default()),
        }
    }

    /// Whether `gid` is one of the port's GIDs.
    pub fn holds(&self, gid: Gid) -> bool {
        gid == self.gid || self.more_gids.contains(&gid)
    }

    /// The configuration the device's PORT_INFO prescribes (GIDs, CA GUID, P_Key, LID,
    /// QPN range, its connection quota as `max_connections`, the active MTU and the CA's
    /// ACK delay).
    pub fn from_port_info(p: &PortInfo, seed: u64) -> AgentConfig {
        AgentConfig {
            more_gids: p.more_gids.clone(),
            pkey: p.pkey,
            lid: p.lid,
            max_connections: p.max_entries,
            active_mtu: p.mtu_or_default(),
            ack_delay: p.ca_ack_delay & 0x1F,
            ..AgentConfig::new(p.gid, p.ca_guid, p.qpn_base, p.qpn_count, seed)
        }
    }
}

/// Options of `connect()` (the REQ's fields, rdma_cm's defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// A real QP's number; `None`: a simulated QPN from the port's range.
    pub qpn: Option<u32>,
    /// Path packet lifetime (5-bit exponent). The attempt timeout is Linux's
    /// `2 * ms(packet_life_time) + ms(remote_cm_response_timeout)`.
    pub packet_life_time: u8,
    /// How long the peer may take to answer (5-bit exponent).
    pub remote_cm_response_timeout: u8,
    /// How long this side may take to answer (5-bit exponent): the peer's timeout.
    pub local_cm_response_timeout: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// Responder resources; [`RDMA_MAX_RESP_RES`] (the default, as librdmacm's):
    /// [`AgentConfig::max_responder_resources`].
    pub responder_resources: u8,
    /// Initiator depth; [`RDMA_MAX_INIT_DEPTH`] (the default, as librdmacm's):
    /// [`AgentConfig::max_initiator_depth`].
    pub initiator_depth: u8,
    /// End-to-end flow control (librdmacm without `conn_param`: off).
    pub flow_control: bool,
    /// Transport retry count (3 bits).
    pub retry_count: u8,
    /// RNR retry count (3 bits; 7 = retry without limit, librdmacm's default).
    pub rnr_retry_count: u8,
    /// Path MTU (IBTA code: 3 = 1024); 0 (the default): the port's active MTU
    /// ([`AgentConfig::active_mtu`]), as rdma_cm takes the link's.
    pub path_mtu: u8,
    /// Hop limit of the primary path (RoCE: 64, so LIDs are permissive).
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label (20 bits); 0 (the default): derived as Linux's rdma_cm does on RoCEv2
    /// (`cma_get_roce_udp_flow_label`): `(source port * 31 + destination port)` cut to
    /// 20 bits, the ports taken from the rdma_cm service ID and the private data's
    /// `cma_hdr`; 0 when the REQ is not an rdma_cm IP one.
    pub flow_label: u32,
    /// Service level (4 bits).
    pub sl: u8,
    /// Transport service.
    pub transport: TransportService,
    /// Send the RTU as soon as a REP arrives (rdma_cm with a QP). `false`: report
    /// `ConnectResponse` and wait for `accept()` on the active side (rdma_cm without a
    /// QP); past `mra_delay` the connection is in MRA_REP_SENT and a duplicate REP
    /// draws an MRA(REP).
    pub auto_rtu: bool,
    /// Starting PSN (24 bits); `None`: random.
    pub starting_psn: Option<u32>,
    /// The QP takes its receives from a shared receive queue (the REQ's SRQ bit).
    pub srq: bool,
    /// The REQ's primary local GID: one of the port's ([`AgentConfig::holds`]; the
    /// address the rdma_cm id is bound to); `None`: the port's primary GID.
    pub local_gid: Option<Gid>,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            qpn: None,
            packet_life_time: CMA_IBOE_PACKET_LIFETIME,
            remote_cm_response_timeout: CMA_CM_RESPONSE_TIMEOUT,
            local_cm_response_timeout: CMA_CM_RESPONSE_TIMEOUT,
            max_cm_retries: CMA_MAX_CM_RETRIES,
            responder_resources: RDMA_MAX_RESP_RES,
            initiator_depth: RDMA_MAX_INIT_DEPTH,
            flow_control: false,
            retry_count: 7,
            rnr_retry_count: 7,
            path_mtu: 0,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            sl: 0,
            transport: TransportService::Rc,
            auto_rtu: true,
            starting_psn: None,
            srq: false,
            local_gid: None,
        }
    }
}

/// Options of `accept()` on the passive side (the REP's fields), with librdmacm's
/// defaults for an `rdma_accept()` without `conn_param`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptOptions {
    /// A real QP's number; `None`: a simulated QPN from the port's range.
    pub qpn: Option<u32>,
    /// Starting PSN (24 bits); `None`: random.
    pub starting_psn: Option<u32>,
    /// Responder resources; [`RDMA_MAX_RESP_RES`] (the default): the REQ's initiator
    /// depth, at most [`AgentConfig::max_responder_resources`] (librdmacm).
    pub responder_resources: u8,
    /// Initiator depth; [`RDMA_MAX_INIT_DEPTH`] (the default): the REQ's responder
    /// resources, at most [`AgentConfig::max_initiator_depth`] (librdmacm).
    pub initiator_depth: u8,
    /// End-to-end flow control (librdmacm without `conn_param`: off).
    pub flow_control: bool,
    /// RNR retry count (3 bits; librdmacm's default 7 retries without limit).
    pub rnr_retry_count: u8,
    /// The QP takes its receives from a shared receive queue (the REP's SRQ bit).
    pub srq: bool,
}

impl Default for AcceptOptions {
    fn default() -> Self {
        AcceptOptions {
            qpn: None,
            starting_psn: None,
            responder_resources: RDMA_MAX_RESP_RES,
            initiator_depth: RDMA_MAX_INIT_DEPTH,
            flow_control: false,
            rnr_retry_count: 7,
            srq: false,
        }
    }
}

/// Options of a SIDR resolution (rdma_cm's UDP port space defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SidrOptions {
    /// Timeout of one attempt, in milliseconds (rdma_cm: `1 << (20 - 8)` = 4096).
    pub timeout_ms: u64,
    /// Retries after the first attempt.
    pub max_cm_retries: u8,
}

impl Default for SidrOptions {
    fn default() -> Self {
        SidrOptions {
            timeout_ms: 1 << (CMA_CM_RESPONSE_TIMEOUT - 8),
            max_cm_retries: CMA_MAX_CM_RETRIES,
        }
    }
}

/// Linux's `cm_ack_timeout()`: the Local ACK Timeout exponent for a path, from the CA's
/// ACK delay and the packet lifetime (4.096 us * 2^ack = 4.096 us * 2^delay +
/// 2 * 4.096 us * 2^life, rounded).
pub fn cm_ack_timeout(ca_ack_delay: u8, packet_life_time: u8) -> u8 {
    let delay = i32::from(ca_ack_delay);
    let mut ack = i32::from(packet_life_time) + 1;
    if ack >= delay {
        ack += i32::from(delay >= ack - 1);
    } else {
        ack = delay + i32::from(ack >= delay - 1);
    }
    ack.min(31) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeout_matches_linux() {
        // life 16, no ACK delay: 17 (the RoCE REQ default).
        assert_eq!(cm_ack_timeout(0, 16), 17);
        // Equal-ish terms round up.
        assert_eq!(cm_ack_timeout(17, 16), 18);
        assert_eq!(cm_ack_timeout(20, 16), 20);
        assert_eq!(cm_ack_timeout(18, 16), 19);
        assert_eq!(cm_ack_timeout(0, 31), 31);
    }

    #[test]
    fn from_port_info_takes_identity_and_quota() {
        let p = PortInfo {
            abi_version: 1,
            port_up: true,
            gid: Gid::from_ipv4([10, 0, 0, 1].into()),
            more_gids: Vec::new(),
            ca_guid: 0x1122,
            lid: 0xFFFF,
            pkey: 0x7FFF,
            qpn_base: 0x100,
            qpn_count: 64,
            max_entries: 32,
            name: "vm".into(),
            active_mtu: 5,
            ca_ack_delay: 15,
        };
        let c = AgentConfig::from_port_info(&p, 9);
        assert_eq!((c.active_mtu, c.ack_delay), (5, 15));
        // A device that gives no MTU (a 96-byte PORT_INFO): 1024.
        let old = PortInfo {
            active_mtu: 0,
            ca_ack_delay: 0,
            ..p.clone()
        };
        let o = AgentConfig::from_port_info(&old, 9);
        assert_eq!((o.active_mtu, o.ack_delay), (MTU_1024, 0));
        assert_eq!(c.gid, p.gid);
        assert_eq!(
            (c.ca_guid, c.pkey, c.qpn_base, c.qpn_count),
            (0x1122, 0x7FFF, 0x100, 64)
        );
        assert_eq!(c.max_connections, 32);
        assert_eq!(c.hi_tid, AgentConfig::new(p.gid, 0, 0, 0, 9).hi_tid);
    }
}

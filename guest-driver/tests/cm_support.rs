//! Helpers shared by the CM tests (included with `#[path]`): a scripted peer that
//! builds MADs (on `pvcm_wire::testing`), outbox inspection, and a back-to-back network of agents.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::Ipv4Addr;

use pvcm_guest::cm::{Agent, AgentConfig, CmId, Event, Group, MESSAGES, OutMad, State};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;
use pvcm_wire::cm::{
    CmRepr, MsgResponse, PathRepr, RejReason, drep, dreq, lap, mra, rej, rep, req, rtu, sidr_rep,
    sidr_req,
};
use pvcm_wire::mad::{AttributeId, Header, MAD_LEN, Method};
use pvcm_wire::testing::{self, mad};

pub const AGENT_GUID: u64 = 0x0002_c903_00aa_0001;
pub const PEER_GUID: u64 = 0x0002_c903_00bb_0002;
pub const QPN_BASE: u32 = 0x1000;
pub const QPN_COUNT: u32 = 0x10000;
pub const SID: u64 = 0x0000_0000_0106_1d2f;

pub fn gid(n: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, n))
}

pub fn agent_gid() -> Gid {
    gid(1)
}

pub fn peer_gid() -> Gid {
    gid(2)
}

pub fn config() -> AgentConfig {
    AgentConfig::new(agent_gid(), AGENT_GUID, QPN_BASE, QPN_COUNT, 42)
}

pub fn agent() -> Agent {
    Agent::new(config())
}

/// Linux's DREQ handling: the DREP waits for the application's `disconnect()`.
pub fn linux_drep_agent() -> Agent {
    Agent::new(AgentConfig {
        auto_drep: false,
        ..config()
    })
}

pub fn ms(t: u64) -> Time {
    Time::from_millis(t)
}

/// A REQ from the peer to the agent: `testing::req_repr`'s, with rdma_cm-like
/// resources, MTU 1024, ACK timeout 17 and packet rate 0.
pub fn peer_req(local_comm_id: u32, qpn: u32) -> req::Repr<'static> {
    let r = testing::req_repr(peer_gid(), PEER_GUID, local_comm_id, agent_gid(), qpn);
    req::Repr {
        service_id: SID,
        responder_resources: 1,
        initiator_depth: 1,
        starting_psn: 1,
        path_mtu: 3,
        primary_path: PathRepr {
            packet_rate: 0,
            local_ack_timeout: 17,
            ..r.primary_path
        },
        private_data: b"req-pd",
        ..r
    }
}

pub fn req_mad(tid: u64, r: req::Repr<'_>) -> [u8; MAD_LEN] {
    mad(tid, CmRepr::Req(r))
}

/// A REP from the peer answering the agent's REQ.
pub fn peer_rep(local_comm_id: u32, remote_comm_id: u32, qpn: u32) -> rep::Repr<'static> {
    rep::Repr {
        local_comm_id,
        remote_comm_id,
        local_qpn: qpn,
        starting_psn: 5,
        responder_resources: 1,
        initiator_depth: 1,
        end_to_end_flow_control: true,
        rnr_retry_count: 7,
        local_ca_guid: PEER_GUID,
        private_data: b"rep-pd",
        ..rep::Repr::default()
    }
}

pub fn rep_mad(tid: u64, r: rep::Repr<'_>) -> [u8; MAD_LEN] {
    mad(tid, CmRepr::Rep(r))
}

pub fn rtu_mad(tid: u64, local: u32, remote: u32) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Rtu(rtu::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            private_data: b"rtu-pd",
        }),
    )
}

pub fn mra_mad(tid: u64, local: u32, remote: u32, which: MsgResponse, st: u8) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Mra(mra::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            message_mraed: which,
            service_timeout: st,
            ..mra::Repr::default()
        }),
    )
}

pub fn rej_mad(
    tid: u64,
    local: u32,
    remote: u32,
    which: MsgResponse,
    reason: RejReason,
    ari: &[u8],
    pd: &[u8],
) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Rej(rej::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            message_rejected: which,
            reason,
            ari,
            private_data: pd,
        }),
    )
}

pub fn dreq_mad(tid: u64, local: u32, remote: u32, remote_qpn: u32) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Dreq(dreq::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            remote_qpn_eecn: remote_qpn,
            ..dreq::Repr::default()
        }),
    )
}

pub fn drep_mad(tid: u64, local: u32, remote: u32) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Drep(drep::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            ..drep::Repr::default()
        }),
    )
}

pub fn lap_mad(tid: u64, local: u32, remote: u32, remote_qpn: u32) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::Lap(lap::Repr {
            local_comm_id: local,
            remote_comm_id: remote,
            remote_qpn_eecn: remote_qpn,
            remote_cm_response_timeout: 20,
            ..lap::Repr::default()
        }),
    )
}

pub fn sidr_req_mad(tid: u64, request_id: u32, service_id: u64) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::SidrReq(sidr_req::Repr {
            request_id,
            partition_key: 0xFFFF,
            service_id,
            private_data: b"sidr",
        }),
    )
}

pub fn sidr_rep_mad(
    tid: u64,
    request_id: u32,
    status: pvcm_wire::cm::SidrStatus,
    qpn: u32,
    qkey: u32,
) -> [u8; MAD_LEN] {
    mad(
        tid,
        CmRepr::SidrRep(sidr_rep::Repr {
            request_id,
            status,
            qpn,
            service_id: SID,
            qkey,
            private_data: b"sidr-rep",
            ..sidr_rep::Repr::default()
        }),
    )
}

pub fn class_port_info_get(tid: u64) -> [u8; MAD_LEN] {
    let h = Header {
        method: Method::Get,
        status: 0,
        class_specific: 0,
        tid,
        attr_id: AttributeId::ClassPortInfo,
        attr_mod: 0,
    };
    testing::encode(
        h,
        CmRepr::ClassPortInfo(pvcm_wire::cm::class_port_info::Repr::default()),
    )
}

/// Everything in the agent's outbox.
pub fn take(a: &mut Agent) -> Vec<OutMad> {
    a.drain_outbox().collect()
}

/// Exactly one MAD from the outbox.
pub fn one(a: &mut Agent) -> OutMad {
    let v = take(a);
    assert_eq!(v.len(), 1, "expected one MAD, got {v:?}");
    v.into_iter().next().expect("one")
}

pub fn parse(m: &OutMad) -> (Header, CmRepr<'_>) {
    CmRepr::parse(&m.mad).expect("agent MADs parse")
}

/// Every pending event.
pub fn events(a: &mut Agent) -> Vec<Event> {
    a.drain_events().collect()
}

/// Polls at `t` and returns what came out.
pub fn poll_at(a: &mut Agent, t: Time) -> (Vec<OutMad>, Vec<Event>) {
    a.poll(t);
    (take(a), events(a))
}

/// Counter group as a map name -> value (non-zero only), for readable assertions.
pub fn nonzero(a: &Agent, g: Group) -> HashMap<&'static str, u64> {
    MESSAGES
        .iter()
        .map(|m| (m.name(), a.counters().get(g, *m)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// Drives the agent as the active side through REQ/REP/RTU with the scripted peer;
/// returns (id, local comm id, local qpn, REQ TID).
pub fn establish_active(
    a: &mut Agent,
    peer_comm_id: u32,
    peer_qpn: u32,
    now: Time,
) -> (CmId, u32, u32, u64) {
    let id = a
        .connect(peer_gid(), SID, b"hi", &Default::default(), now)
        .expect("connect");
    let m = one(a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!("not a REQ")
    };
    let (local, qpn, tid) = (r.local_comm_id, r.local_qpn, h.tid);
    a.handle_mad(
        &rep_mad(tid, peer_rep(peer_comm_id, local, peer_qpn)),
        peer_gid(),
        now,
    );
    let m = one(a);
    assert!(matches!(parse(&m).1, CmRepr::Rtu(_)));
    let ev = events(a);
    assert!(
        matches!(ev.as_slice(), [Event::Established { .. }]),
        "{ev:?}"
    );
    assert_eq!(a.state(id), Some(State::Established));
    (id, local, qpn, tid)
}

/// Drives the agent as the passive side through REQ/REP/RTU; returns (id, local comm
/// id, local qpn).
pub fn establish_passive(
    a: &mut Agent,
    peer_comm_id: u32,
    peer_qpn: u32,
    now: Time,
) -> (CmId, u32, u32) {
    a.handle_mad(
        &req_mad(7, peer_req(peer_comm_id, peer_qpn)),
        peer_gid(),
        now,
    );
    let ev = events(a);
    let [Event::ConnectRequest { id, .. }] = ev.as_slice() else {
        panic!("no connect request: {ev:?}")
    };
    let id = *id;
    a.accept(id, b"acc", now).expect("accept");
    let m = one(a);
    let (_, CmRepr::Rep(r)) = parse(&m) else {
        panic!("not a REP")
    };
    let (local, qpn) = (r.local_comm_id, r.local_qpn);
    a.handle_mad(&rtu_mad(7, peer_comm_id, local), peer_gid(), now);
    let ev = events(a);
    assert!(
        matches!(ev.as_slice(), [Event::Established { .. }]),
        "{ev:?}"
    );
    (id, local, qpn)
}

// ------------------------------------------------------------- back to back

/// A MAD in flight between two agents.
#[derive(Debug, Clone)]
pub struct InFlight {
    pub at: Time,
    pub seq: u64,
    pub to: usize,
    pub src: Gid,
    pub mad: [u8; MAD_LEN],
}

/// Two agents and the wire between them (index 0 and 1), with per-type delivery
/// counts.
#[derive(Debug)]
pub struct Pair {
    pub agents: [Agent; 2],
    pub gids: [Gid; 2],
    pub sent: [[u64; 11]; 2],
    pub delivered: [[u64; 11]; 2],
}

impl Pair {
    pub fn new(seed: u64) -> Pair {
        let mut c0 = AgentConfig::new(gid(1), 0xA0, 0x100, 0x40000, seed);
        let mut c1 = AgentConfig::new(gid(2), 0xB0, 0x100, 0x40000, seed.wrapping_add(1));
        c0.mra_delay = None;
        c1.mra_delay = None;
        Pair {
            agents: [Agent::new(c0), Agent::new(c1)],
            gids: [gid(1), gid(2)],
            sent: [[0; 11]; 2],
            delivered: [[0; 11]; 2],
        }
    }

    pub fn index_of(&self, g: Gid) -> usize {
        usize::from(g == self.gids[1])
    }

    /// Moves everything the agents want sent into `out` (with its destination index).
    pub fn collect(&mut self, out: &mut Vec<(usize, Gid, [u8; MAD_LEN])>) {
        for i in 0..2 {
            while let Some(m) = self.agents[i].pop_outbox() {
                if let Some(k) = m.attr().and_then(|a| a.counter_index()) {
                    self.sent[i][k] += 1;
                }
                let to = self.index_of(m.dst);
                assert_ne!(to, i, "agent {i} sent to itself");
                out.push((to, self.gids[i], m.mad));
            }
        }
    }

    pub fn deliver(&mut self, to: usize, src: Gid, mad: &[u8; MAD_LEN], now: Time) {
        if let Some(k) = testing::attr(mad).and_then(|a| a.counter_index()) {
            self.delivered[to][k] += 1;
        }
        self.agents[to].handle_mad(mad, src, now);
    }

    /// The counters agree with what the wire carried: each agent's cm_tx_msgs is what
    /// it put on the wire, its cm_rx_msgs what the wire delivered to it.
    pub fn check_counters_match_wire(&self) {
        for i in 0..2 {
            for (k, m) in MESSAGES.iter().enumerate() {
                assert_eq!(
                    self.agents[i].counters().get(Group::TxMsgs, *m),
                    self.sent[i][k],
                    "agent {i} tx {m}"
                );
                assert_eq!(
                    self.agents[i].counters().get(Group::RxMsgs, *m),
                    self.delivered[i][k],
                    "agent {i} rx {m}"
                );
            }
        }
    }
}

/// The simple application of the back-to-back tests: accepts every request, answers
/// a DREQ with its DREP, destroys a handle once it is over (rejected, unreachable,
/// TimeWait exited). It tracks the handles it holds.
#[derive(Debug, Default)]
pub struct App {
    pub held: HashSet<CmId>,
    pub established: u64,
    pub rejected: u64,
    pub unreachable: u64,
    pub disconnected: u64,
    pub timewait_exits: u64,
    pub requests: u64,
    /// Private data of the connection requests, by id (the test's plan).
    pub plans: HashMap<CmId, u8>,
    pub newly_established: Vec<CmId>,
}

impl App {
    pub fn handle(&mut self, a: &mut Agent, now: Time) {
        while let Some(e) = a.pop_event() {
            match e {
                Event::ConnectRequest {
                    id, private_data, ..
                } => {
                    self.requests += 1;
                    self.held.insert(id);
                    self.plans.insert(id, private_data[0]);
                    if private_data[0] == PLAN_REJECT {
                        a.reject(id, b"no", now).expect("reject a fresh request");
                    } else {
                        // May fail if a REJ(TIMEOUT) already reset it: fine.
                        let _ = a.accept(id, &[], now);
                    }
                }
                Event::Established { id, .. } => {
                    self.established += 1;
                    self.newly_established.push(id);
                }
                Event::Disconnected { id } => {
                    self.disconnected += 1;
                    // Answers a received DREQ; a no-op after our own DREQ.
                    let _ = a.disconnect(id, now);
                }
                Event::Rejected { id, .. } => {
                    self.rejected += 1;
                    self.finish(a, id, now);
                }
                Event::Unreachable { id } => {
                    self.unreachable += 1;
                    self.finish(a, id, now);
                }
                Event::TimewaitExit { id } => {
                    self.timewait_exits += 1;
                    self.finish(a, id, now);
                }
                Event::ConnectResponse { .. }
                | Event::SidrRequest { .. }
                | Event::SidrResolved { .. } => panic!("unexpected {e:?}"),
            }
        }
    }

    pub fn finish(&mut self, a: &mut Agent, id: CmId, now: Time) {
        if self.held.remove(&id) {
            a.destroy(id, now).expect("destroy a held id");
            self.plans.remove(&id);
        }
    }
}

/// Plans carried in the REQ's first private-data byte.
pub const PLAN_CLIENT_DISCONNECTS: u8 = 1;
pub const PLAN_SERVER_DISCONNECTS: u8 = 2;
pub const PLAN_DESTROY_AFTER_CONNECT: u8 = 3;
pub const PLAN_CLIENT_DESTROYS_ESTABLISHED: u8 = 4;
pub const PLAN_REJECT: u8 = 5;

/// An in-order, lossless wire: delivers until nothing moves, letting the apps react.
pub fn settle(p: &mut Pair, apps: &mut [App; 2], now: Time) {
    let mut wire = Vec::new();
    loop {
        for (app, a) in apps.iter_mut().zip(p.agents.iter_mut()) {
            app.handle(a, now);
        }
        wire.clear();
        p.collect(&mut wire);
        if wire.is_empty() {
            break;
        }
        for (to, src, mad) in wire.drain(..).collect::<VecDeque<_>>() {
            p.deliver(to, src, &mad, now);
        }
    }
}

#[test]
fn support_builds_valid_mads() {
    let m = req_mad(1, peer_req(5, 0x200));
    assert!(matches!(CmRepr::parse(&m), Ok((_, CmRepr::Req(_)))));
    let mut a = agent();
    a.handle_mad(&m, peer_gid(), Time::ZERO);
    assert_eq!(a.drops().total(), 0);
}

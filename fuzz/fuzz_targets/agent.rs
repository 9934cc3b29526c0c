//! The guest's CM agent (`guest-driver/src/cm/agent.rs`) under wire MADs, API calls and
//! clock steps decoded from the input.
//!
//! One agent, one listener service and two peers. Wire MADs are either a well-formed
//! answer a peer's CM would give to one of the MADs the agent sent recently (REQ -> REP,
//! REP -> RTU, DREQ -> DREP, ...; or an MRA, REJ, DREQ, LAP, duplicate), a message built
//! from a template (REQ, SIDR_REQ, SIDR_REP, ClassPortInfo Get, any connected message
//! naming a comm ID the agent used) with arbitrary byte edits, or raw bytes. API calls:
//! listen, connect, accept, reject, disconnect, destroy, resolve_sidr, sidr_reply.
//!
//! Checked: no panic; every MAD the agent sends is a CM MAD that parses; no event names
//! a handle that was destroyed (destroy withdraws queued events) or was never issued;
//! API errors change nothing visible (no MAD); and quiesce: after destroying every
//! handle and running the clock past every retry and TimeWait, with no more answers
//! from the wire, the agent holds no connection, comm ID, QPN, timer or unsent MAD.

#![no_main]
#![allow(clippy::unwrap_used, dead_code)]

#[path = "../../guest-driver/tests/cm_support.rs"]
mod support;

use std::collections::HashSet;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pvcm_guest::cm::{
    AcceptOptions, Agent, AgentConfig, CmId, ConnectOptions, Event, OutMad, Pacing, SidrOptions,
};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, CmRepr, MsgResponse, RejReason, SidrStatus};
use pvcm_wire::mad::AttributeId;
use support::*;

const SIDS: [u64; 2] = [SID, SID + 1];

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Reply {
    /// What the peer's CM would answer.
    Natural,
    Mra(u8),
    Rej(u8),
    Dreq,
    Lap,
    Duplicate,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Base {
    Req { comm: u8, qpn: u8 },
    SidrReq { rid: u8 },
    SidrRep { status: u8 },
    CpiGet,
    Rep,
    Rtu,
    Mra,
    Rej,
    Dreq,
    Drep,
    Lap,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    /// A peer answers one of the agent's recent MADs.
    Answer {
        pick: u8,
        reply: Reply,
        comm: u8,
    },
    /// A templated MAD from a peer, with byte edits (offset, value).
    Wire {
        peer: bool,
        base: Base,
        pick: u8,
        edits: Vec<(u8, u8)>,
    },
    /// Raw bytes from a peer.
    Raw {
        peer: bool,
        bytes: Vec<u8>,
    },
    Listen {
        sid: bool,
    },
    Connect {
        peer: bool,
        sid: bool,
        life: u8,
        resp: u8,
        retries: u8,
        auto_rtu: bool,
        pd: u8,
    },
    Accept {
        pick: u8,
        pd: u8,
    },
    Reject {
        pick: u8,
    },
    Disconnect {
        pick: u8,
    },
    Destroy {
        pick: u8,
    },
    Sidr {
        peer: bool,
        sid: bool,
        retries: u8,
    },
    SidrReply {
        pick: u8,
        status: u8,
    },
    SidrAuto {
        pick: u8,
    },
    Advance {
        ms: u16,
        scale: u8,
    },
}

#[derive(Debug, Arbitrary)]
struct Input {
    seed: u64,
    auto_drep: bool,
    pacing: bool,
    max_connections: u8,
    qpn_count: u8,
    mra_delay: Option<u8>,
    ops: Vec<Op>,
}

struct World {
    a: Agent,
    now: Time,
    /// Handles issued (by calls or events) and not destroyed.
    live: Vec<CmId>,
    destroyed: HashSet<CmId>,
    issued: HashSet<CmId>,
    /// The agent's recent MADs (for answers and templates).
    sent: Vec<OutMad>,
    next_tid: u64,
}

fn peer(p: bool) -> Gid {
    if p { gid(3) } else { peer_gid() }
}

fn pick<T: Copy>(i: u8, v: &[T]) -> Option<T> {
    (!v.is_empty()).then(|| v[i as usize % v.len()])
}

fn recent<T: Clone>(i: u8, v: &[T]) -> Option<T> {
    let n = v.len().min(8);
    (n > 0).then(|| v[v.len() - 1 - i as usize % n].clone())
}

impl World {
    fn tid(&mut self) -> u64 {
        self.next_tid += 1;
        0xBEEF_0000_0000_0000 | self.next_tid
    }

    /// Takes what the agent produced and checks it.
    fn collect(&mut self) {
        let out: Vec<OutMad> = self.a.drain_outbox().collect();
        for m in out {
            let (h, r) = CmRepr::parse(&m.mad)
                .unwrap_or_else(|e| panic!("the agent sent an unparsable MAD: {e}"));
            assert_eq!(h.attr_id, r.attr());
            self.sent.push(m);
        }
        if self.sent.len() > 64 {
            self.sent.drain(..32);
        }
        let events: Vec<Event> = self.a.drain_events().collect();
        for e in events {
            let id = e.id();
            assert!(
                !self.destroyed.contains(&id),
                "event {e:?} for destroyed {id:?}"
            );
            match e {
                Event::ConnectRequest { id, listen_id, .. }
                | Event::SidrRequest { id, listen_id, .. } => {
                    assert!(
                        self.issued.contains(&listen_id),
                        "unknown listener {listen_id:?}"
                    );
                    assert!(self.issued.insert(id), "{id:?} issued twice");
                    self.live.push(id);
                }
                _ => assert!(self.issued.contains(&id), "event for unknown {id:?}"),
            }
        }
    }

    /// An API call: an error sends nothing.
    fn call<T>(&mut self, r: Result<T, pvcm_guest::cm::CmError>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                assert_eq!(self.a.outbox_len(), 0, "{e} but something was sent");
                None
            }
        }
    }

    fn wire(&mut self, m: &[u8], src: Gid) {
        self.a.handle_mad(m, src, self.now);
    }

    fn answer(&mut self, i: u8, reply: Reply, comm: u8) {
        let Some(o) = recent(i, &self.sent) else {
            return;
        };
        let Ok(m) = CmMad::new_checked(&o.mad[..]) else {
            return;
        };
        let tid = m.tid();
        let ours = m.local_comm_id().unwrap_or(0);
        let theirs = m.remote_comm_id().unwrap_or(0);
        let pc = 0x100 + u32::from(comm % 8);
        let local = if theirs != 0 { theirs } else { pc };
        let qpn = 0x2_0000 + local;
        let mad = match reply {
            Reply::Duplicate => o.mad,
            Reply::Mra(st) => {
                let which = match m.attr() {
                    AttributeId::Req => MsgResponse::Req,
                    AttributeId::Rep => MsgResponse::Rep,
                    _ => MsgResponse::Other,
                };
                mra_mad(tid, local, ours, which, st % 32)
            }
            Reply::Rej(r) => {
                let reason = if r & 1 == 0 {
                    RejReason::ConsumerDefined
                } else {
                    RejReason::Timeout
                };
                let remote = if r & 2 == 0 { ours } else { 0 };
                rej_mad(
                    tid,
                    local,
                    remote,
                    MsgResponse::Req,
                    reason,
                    &PEER_GUID.to_be_bytes(),
                    &[],
                )
            }
            Reply::Dreq => dreq_mad(tid, local, ours, 0),
            Reply::Lap => lap_mad(tid, local, ours, 0),
            Reply::Natural => match m.attr() {
                AttributeId::Req => rep_mad(tid, peer_rep(pc, ours, 0x2_0000 + pc)),
                AttributeId::Rep => rtu_mad(tid, local, ours),
                AttributeId::Dreq => drep_mad(tid, local, ours),
                AttributeId::SidrReq => sidr_rep_mad(
                    tid,
                    m.sidr_request_id().unwrap_or(0),
                    SidrStatus::Success,
                    qpn,
                    7,
                ),
                _ => dreq_mad(tid, local, ours, qpn),
            },
        };
        self.wire(&mad, o.dst);
    }

    fn apply(&mut self, op: &Op) {
        let now = self.now;
        match *op {
            Op::Answer { pick, reply, comm } => self.answer(pick, reply, comm),
            Op::Wire {
                peer: p,
                base,
                pick,
                ref edits,
            } => {
                let tid = self.tid();
                let (ours, theirs) = recent(pick, &self.sent)
                    .and_then(|o| {
                        CmMad::new_checked(&o.mad[..]).ok().map(|m| {
                            (
                                m.local_comm_id().unwrap_or(0),
                                m.remote_comm_id().unwrap_or(0),
                            )
                        })
                    })
                    .unwrap_or((u32::from(pick), 0));
                let local = if theirs != 0 { theirs } else { 0x100 };
                let mut m = match base {
                    Base::Req { comm, qpn } => req_mad(
                        tid,
                        pvcm_wire::cm::req::Repr {
                            service_id: SIDS[usize::from(comm & 1)],
                            ..peer_req(0x100 + u32::from(comm % 8), 0x2_0000 + u32::from(qpn % 8))
                        },
                    ),
                    Base::SidrReq { rid } => {
                        sidr_req_mad(tid, u32::from(rid % 8), SIDS[usize::from(rid >> 7)])
                    }
                    Base::SidrRep { status } => {
                        let s = SidrStatus::from_code(status % 8).unwrap_or(SidrStatus::Success);
                        sidr_rep_mad(tid, ours, s, 0x3000, 7)
                    }
                    Base::CpiGet => class_port_info_get(tid),
                    Base::Rep => rep_mad(tid, peer_rep(local, ours, 0x2_0000 + local)),
                    Base::Rtu => rtu_mad(tid, local, ours),
                    Base::Mra => mra_mad(tid, local, ours, MsgResponse::Req, 10),
                    Base::Rej => rej_mad(
                        tid,
                        local,
                        ours,
                        MsgResponse::Rep,
                        RejReason::ConsumerDefined,
                        &[],
                        b"no",
                    ),
                    Base::Dreq => dreq_mad(tid, local, ours, 0x2_0000 + local),
                    Base::Drep => drep_mad(tid, local, ours),
                    Base::Lap => lap_mad(tid, local, ours, 0x2_0000 + local),
                };
                for &(at, v) in edits.iter().take(16) {
                    m[usize::from(at)] = v;
                }
                self.wire(&m, peer(p));
            }
            Op::Raw { peer: p, ref bytes } => {
                let n = bytes.len().min(512);
                self.wire(&bytes[..n], peer(p));
            }
            Op::Listen { sid } => {
                let r = self.a.listen(SIDS[usize::from(sid)]);
                if let Some(id) = self.call(r) {
                    assert!(self.issued.insert(id));
                    self.live.push(id);
                }
            }
            Op::Connect {
                peer: p,
                sid,
                life,
                resp,
                retries,
                auto_rtu,
                pd,
            } => {
                let opts = ConnectOptions {
                    packet_life_time: life % 24,
                    remote_cm_response_timeout: resp % 32,
                    local_cm_response_timeout: resp % 32,
                    max_cm_retries: retries % 16,
                    auto_rtu,
                    ..ConnectOptions::default()
                };
                let data = vec![0xA5; usize::from(pd % 100)];
                let r = self
                    .a
                    .connect(peer(p), SIDS[usize::from(sid)], &data, &opts, now);
                if let Some(id) = self.call(r) {
                    assert!(self.issued.insert(id));
                    self.live.push(id);
                }
            }
            Op::Accept { pick: i, pd } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                let data = vec![0x5A; usize::from(pd % 200)];
                let r = self
                    .a
                    .accept_with(id, &data, &AcceptOptions::default(), now);
                self.call(r);
            }
            Op::Reject { pick: i } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                let r = self.a.reject(id, b"busy", now);
                self.call(r);
            }
            Op::Disconnect { pick: i } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                let r = self.a.disconnect(id, now);
                self.call(r);
            }
            Op::Destroy { pick: i } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                self.destroy(id);
            }
            Op::Sidr {
                peer: p,
                sid,
                retries,
            } => {
                let opts = SidrOptions {
                    max_cm_retries: retries % 4,
                    ..SidrOptions::default()
                };
                let r = self
                    .a
                    .resolve_sidr(peer(p), SIDS[usize::from(sid)], b"sidr", &opts, now);
                if let Some(id) = self.call(r) {
                    assert!(self.issued.insert(id));
                    self.live.push(id);
                }
            }
            Op::SidrReply { pick: i, status } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                let s = SidrStatus::from_code(status % 8).unwrap_or(SidrStatus::Success);
                let r = self.a.sidr_reply(id, s, 0x3000, 7, b"ok");
                self.call(r);
            }
            Op::SidrAuto { pick: i } => {
                let Some(id) = pick(i, &self.live) else {
                    return;
                };
                let r = self.a.set_sidr_auto_reply(id, 0x3001, 9);
                self.call(r);
            }
            Op::Advance { ms, scale } => {
                let d = u64::from(ms) * if scale & 1 == 0 { 1 } else { 1000 };
                let end = self.now.after(Duration::from_millis(d));
                // As the driver's pump: poll at each deadline up to `end`.
                let mut steps = 0;
                while let Some(t) = self.a.next_deadline().filter(|t| *t <= end) {
                    self.now = self.now.max(t);
                    self.a.poll(self.now);
                    self.collect();
                    steps += 1;
                    assert!(steps < 100_000, "poll makes no progress");
                }
                self.now = end;
                self.a.poll(end);
            }
        }
    }

    fn destroy(&mut self, id: CmId) {
        let r = self.a.destroy(id, self.now);
        if self.call(r).is_some() {
            self.live.retain(|x| *x != id);
            self.destroyed.insert(id);
        }
    }

    /// Quiesce: destroy every handle, let every retry and TimeWait run out (the wire
    /// answers nothing more), and nothing may be left.
    fn finish(&mut self) {
        self.collect();
        for id in self.live.clone() {
            self.destroy(id);
            self.collect();
        }
        assert!(self.live.is_empty());
        let mut steps = 0;
        while let Some(t) = self.a.next_deadline() {
            self.now = self.now.max(t);
            self.a.poll(self.now);
            self.collect();
            steps += 1;
            assert!(steps < 1_000_000, "poll makes no progress");
        }
        self.collect();
        assert_eq!(self.a.listener_count(), 0);
        assert_eq!(
            self.a.connection_count(),
            0,
            "{:?}",
            self.a.state_histogram()
        );
        assert!(
            self.a.is_quiescent(),
            "not quiescent: {} conns, {} comm IDs, {} QPNs, {} timers, {:?}",
            self.a.connection_count(),
            self.a.comm_ids_held(),
            self.a.qpns_in_use(),
            self.a.timers_armed(),
            self.a.state_histogram()
        );
    }
}

fuzz_target!(|input: Input| {
    let cfg = AgentConfig {
        auto_drep: input.auto_drep,
        pacing: input.pacing.then(Pacing::default),
        max_connections: u32::from(input.max_connections % 8),
        mra_delay: input
            .mra_delay
            .map(|d| Duration::from_millis(u64::from(d) * 4)),
        ..AgentConfig::new(
            agent_gid(),
            AGENT_GUID,
            QPN_BASE,
            u32::from(input.qpn_count % 16) + 1,
            input.seed,
        )
    };
    let mut w = World {
        a: Agent::new(cfg),
        now: Time::from_millis(1),
        live: Vec::new(),
        destroyed: HashSet::new(),
        issued: HashSet::new(),
        sent: Vec::new(),
        next_tid: 0,
    };
    for op in input.ops.iter().take(300) {
        w.apply(op);
        w.collect();
    }
    w.finish();
});

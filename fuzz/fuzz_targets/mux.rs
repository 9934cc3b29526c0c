//! The mux under arbitrary sequences of guest MADs, wire MADs, attaches, detaches and
//! clock steps (virtual time, `ManualClock`).
//!
//! The model is `backend/tests/mux_prop.rs`'s, driven by bytes instead of proptest: three
//! VM slots behind one host, three remote peers, small comm-ID spaces so that everything
//! collides, and a ground truth built only from what crossed the mux's API (which VM each
//! `pv_cm_id` left from, which VM each REQ was delivered to). On top of the property
//! test's structured operations, `GuestRaw` / `WireRaw` send a MAD of any attribute
//! (SIDR and ClassPortInfo included) with arbitrary byte edits.
//!
//! Checked after every operation: no panic; a wire MAD delivered to a VM belongs to that
//! VM (REQ: its GID; REJ(TIMEOUT): the REQ last delivered to it; SIDR_REQ and
//! ClassPortInfo Get: the frame's destination GID; GetResp: a Get it sent; everything
//! else: a `pv_cm_id` that left from it, restored to its own comm ID); never to a
//! detached VM; a VM's comm ID is replaced on the wire; what the mux sends itself speaks
//! for a detached VM; the live/quarantined counts agree with the table. At the end every
//! VM detaches, the clock runs past every lifetime, and every entry must be gone.

#![no_main]
#![allow(clippy::unwrap_used)]

#[path = "../../backend/tests/common/mod.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use arbitrary::Arbitrary;
use common::*;
use libfuzzer_sys::fuzz_target;
use pvcm_backend::mux::{
    Clock, DropReason, GuestVerdict, ManualClock, Mux, MuxConfig, Policy, State, VmConfig, VmId,
    WireVerdict,
};
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as f};
use pvcm_wire::mad::{AttributeId, Method};

const NVM: usize = 3;
const NPEER: usize = 3;
const PEER_COMMS: u32 = 4;
const VM_COMMS: u32 = 6;

const SHORT: ReqParams = ReqParams {
    resp: 16,
    retries: 3,
    ack: 14,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Arbitrary)]
enum Kind {
    Rep,
    Mra,
    Rej,
    Rtu,
    Dreq,
    Drep,
    Lap,
    Apr,
}

/// Which template a raw MAD starts from.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Base {
    Req,
    Conn(Kind),
    SidrReq,
    SidrRep,
    CpiGet,
    CpiGetResp,
    RejTimeout,
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Target {
    Recent(u8),
    Known(u8),
    WrongGid(u8, u8),
    Foreign(u8),
    Random(u32, u8),
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    PeerReq {
        peer: u8,
        vm: u8,
        comm: u8,
        short: bool,
        frame_dst: Option<u8>,
    },
    PeerMsg {
        peer: u8,
        kind: Kind,
        target: Target,
        comm: u8,
        svc: u8,
    },
    PeerStep {
        peer: u8,
        pick: u8,
        comm: u8,
    },
    PeerRejTimeout {
        peer: u8,
        comm: u8,
        guid_of: u8,
        vm: u8,
    },
    VmAnswer {
        vm: u8,
        pick: u8,
        kind: Kind,
        sl: u8,
        svc: u8,
    },
    VmMsg {
        vm: u8,
        pick: u8,
        kind: Kind,
        any_sl: Option<u8>,
        svc: u8,
    },
    VmStep {
        vm: u8,
        pick: u8,
    },
    VmReq {
        vm: u8,
        sl: u8,
        peer: u8,
        short: bool,
    },
    VmReqRetry {
        vm: u8,
        pick: u8,
    },
    VmRejTimeout {
        vm: u8,
        pick: u8,
        spoof: bool,
    },
    /// A MAD of any kind from a VM, with byte edits (offset, value).
    GuestRaw {
        vm: u8,
        peer: u8,
        base: Base,
        local: u8,
        remote: u8,
        edits: Vec<(u8, u8)>,
    },
    /// A MAD of any kind from a peer, naming a recent ID it learned, with byte edits.
    WireRaw {
        peer: u8,
        dst: u8,
        base: Base,
        pick: u8,
        comm: u8,
        edits: Vec<(u8, u8)>,
    },
    Advance {
        ms: u16,
        scale: u8,
    },
    Detach {
        vm: u8,
    },
    Reattach {
        vm: u8,
    },
    /// The daemon restarts: the mux is rebuilt from its journal and must hold the same
    /// state (then the run goes on with it).
    Restart,
}

#[derive(Debug, Arbitrary)]
struct Input {
    seed: u64,
    table_bits: u8,
    quota: Option<u8>,
    ops: Vec<Op>,
}

struct Slot {
    id: VmId,
    cfg: VmConfig,
    attached: bool,
    inbox: Vec<(usize, u32, u64)>,
    conns: Vec<Conn>,
}

#[derive(Debug, Clone, Copy)]
struct Conn {
    sl: u32,
    peer: usize,
    comm: u32,
    last: Option<AttributeId>,
    req: Option<(u64, bool, u32)>,
}

fn idx(i: u8, n: usize) -> usize {
    i as usize % n
}

fn recent<T: Copy>(i: u8, v: &[T]) -> Option<T> {
    let n = v.len().min(4);
    (n > 0).then(|| v[v.len() - 1 - idx(i, n)])
}

#[derive(Debug, Clone, Copy)]
struct PvInfo {
    vm: Option<VmId>,
    sl: u32,
}

#[derive(Debug, Clone, Copy)]
struct Learned {
    pv: u32,
    vm_gid: Gid,
    comm: u32,
    attr: AttributeId,
}

struct World {
    clock: ManualClock,
    mux: Mux<ManualClock>,
    slots: Vec<Slot>,
    peers: Vec<VmConfig>,
    learned: Vec<Vec<Learned>>,
    pv_owner: HashMap<u32, PvInfo>,
    /// Host TIDs of ClassPortInfo Gets a VM sent -> that VM.
    get_owner: HashMap<u64, VmId>,
    req_latest: HashMap<(u64, u32), VmId>,
    vm_gid: HashMap<VmId, Gid>,
    detached: HashSet<VmId>,
    next_tid: u64,
    /// A VM may be refused for quota (Reply) when the input set a small quota.
    small_quota: bool,
    /// The mux's journal: a snapshot, then the changes of every operation.
    journal: Vec<u8>,
}

fn raw_view(b: &Mad) -> Option<CmMad<&[u8]>> {
    CmMad::new_checked(&b[..]).ok()
}

fn is_rej_timeout(b: &CmMad<&[u8]>) -> bool {
    b.attr() == AttributeId::Rej
        && b.remote_comm_id() == Some(0)
        && b.rej_reason() == Some(RejReason::Timeout.code())
}

fn with_method(mut m: Mad, method: Method) -> Mad {
    m[3] = method as u8;
    m
}

impl World {
    fn new(input: &Input) -> World {
        let clock = ManualClock::new();
        let cfg = MuxConfig {
            policy: Policy::Default,
            seed: input.seed,
            table_bits: input.table_bits,
            default_quota: input
                .quota
                .map_or(MuxConfig::default().default_quota, |q| u32::from(q % 16)),
            ..MuxConfig::default()
        };
        let mut mux = Mux::new(cfg, clock.clone());
        let mut slots = Vec::new();
        let mut vm_gid = HashMap::new();
        for i in 0..NVM {
            let cfg = VmConfig::new(format!("vm{i}"), gid(2, i as u8 + 1));
            let id = mux.attach_vm(cfg.clone()).unwrap();
            vm_gid.insert(id, cfg.gid);
            slots.push(Slot {
                id,
                cfg,
                attached: true,
                inbox: Vec::new(),
                conns: Vec::new(),
            });
        }
        let peers = (0..NPEER)
            .map(|i| VmConfig::new(format!("peer{i}"), gid(9, i as u8 + 1)))
            .collect();
        let journal = start_journal(&mut mux);
        World {
            clock,
            mux,
            slots,
            peers,
            learned: vec![Vec::new(); NPEER],
            pv_owner: HashMap::new(),
            get_owner: HashMap::new(),
            req_latest: HashMap::new(),
            vm_gid,
            detached: HashSet::new(),
            next_tid: 1,
            small_quota: input.quota.is_some(),
            journal,
        }
    }

    fn tid(&mut self) -> u64 {
        self.next_tid += 1;
        0x7E57_0000_0000_0000 | self.next_tid
    }

    fn slot_gid(&self, s: usize) -> Gid {
        if s < NVM {
            self.slots[s].cfg.gid
        } else {
            gid(2, 99)
        }
    }

    fn attached_slot(&self, vm: VmId) -> Option<usize> {
        self.slots.iter().position(|s| s.id == vm && s.attached)
    }

    // ------------------------------------------------------------------------------
    // Wire -> mux

    fn wire(&mut self, peer: usize, m: &mut Mad, dst: Gid) -> WireVerdict {
        let before = *m;
        let src = self.peers[peer].gid;
        let v = self.mux.from_wire(m, src, dst);
        let Some(b) = raw_view(&before) else {
            assert_eq!(v, WireVerdict::Drop(DropReason::Malformed));
            return v;
        };
        let attr = b.attr();
        match v {
            WireVerdict::Reply => {
                let r = raw_view(m).expect("the mux's reply is a CM MAD");
                match attr {
                    AttributeId::Dreq => {
                        assert_eq!(r.attr(), AttributeId::Drep);
                        assert_eq!(r.local_comm_id(), b.remote_comm_id());
                        assert_eq!(r.remote_comm_id(), b.local_comm_id());
                    }
                    AttributeId::Req | AttributeId::SidrReq if self.small_quota => {
                        assert_eq!(r.attr(), AttributeId::Rej);
                    }
                    _ => panic!("Reply to a wire {attr:?}"),
                }
            }
            WireVerdict::Drop(_) => {}
            WireVerdict::ToVm(vm) => {
                assert!(
                    !self.detached.contains(&vm),
                    "wire {attr:?} delivered to detached {vm:?}"
                );
                assert!(self.mux.vm_config(vm).is_some());
                let slot = self
                    .attached_slot(vm)
                    .unwrap_or_else(|| panic!("wire {attr:?} delivered to unknown {vm:?}"));
                let got = raw_view(m).expect("a delivered MAD is a CM MAD");
                let vm_gid = self.slots[slot].cfg.gid;
                match attr {
                    AttributeId::Req => {
                        assert_eq!(
                            got.req_primary_remote_gid(),
                            Some(vm_gid),
                            "REQ delivered to {vm:?}, whose GID it does not name"
                        );
                        let key = (b.local_ca_guid().unwrap_or(0), b.local_comm_id().unwrap());
                        self.req_latest.insert(key, vm);
                        let tid = b.tid();
                        self.slots[slot]
                            .inbox
                            .push((peer, b.local_comm_id().unwrap(), tid));
                    }
                    _ if is_rej_timeout(&b) => {
                        let key = (
                            b.rej_timeout_ca_guid().unwrap_or(0),
                            b.local_comm_id().unwrap(),
                        );
                        assert_eq!(
                            self.req_latest.get(&key).copied(),
                            Some(vm),
                            "REJ(TIMEOUT) {key:x?} delivered to {vm:?}"
                        );
                    }
                    AttributeId::SidrReq => {
                        assert_eq!(dst, vm_gid, "SIDR_REQ to another GID delivered to {vm:?}");
                    }
                    AttributeId::ClassPortInfo if b.method() == Method::GetResp as u8 => {
                        assert_eq!(
                            self.get_owner.remove(&b.tid()),
                            Some(vm),
                            "GetResp delivered to {vm:?}, which did not send the Get"
                        );
                    }
                    AttributeId::ClassPortInfo => {
                        assert_eq!(dst, vm_gid, "Get to another GID delivered to {vm:?}");
                    }
                    AttributeId::SidrRep => {
                        let pv = b.sidr_request_id().unwrap();
                        let info = self.pv_owner.get(&pv).copied().unwrap_or_else(|| {
                            panic!("SIDR_REP naming {pv:#x}, which never left, delivered")
                        });
                        assert_eq!(info.vm, Some(vm), "SIDR_REP naming {pv:#x} misrouted");
                        assert_eq!(got.sidr_request_id(), Some(info.sl));
                    }
                    _ => {
                        let pv = b.remote_comm_id().unwrap();
                        let info = self.pv_owner.get(&pv).copied().unwrap_or_else(|| {
                            panic!(
                                "wire {attr:?} naming pv {pv:#x}, which never left any VM, \
                                 delivered to {vm:?}"
                            )
                        });
                        assert_eq!(info.vm, Some(vm), "wire {attr:?} naming {pv:#x} misrouted");
                        assert_eq!(
                            got.remote_comm_id(),
                            Some(info.sl),
                            "wire {attr:?} naming {pv:#x}: wrong comm ID restored"
                        );
                        assert_eq!(dst, vm_gid, "frame to another GID");
                        if let Some(c) = self.slots[slot]
                            .conns
                            .iter_mut()
                            .rev()
                            .find(|c| c.sl == info.sl && c.peer == peer)
                        {
                            if let Some(l) = b.local_comm_id().filter(|&l| l != 0) {
                                c.comm = l;
                            }
                            c.last = Some(attr);
                        }
                    }
                }
            }
        }
        v
    }

    // ------------------------------------------------------------------------------
    // VM -> mux

    fn guest(&mut self, s: usize, m: &mut Mad, peer: usize) -> GuestVerdict {
        let (vm, attached) = (self.slots[s].id, self.slots[s].attached);
        let dst = self.peers[peer].gid;
        let before = *m;
        let v = self.mux.from_guest(vm, m, dst);
        if let GuestVerdict::Drop(r) = v {
            // Echoed to the VM in a SEND_ERROR as it was sent: the device rewrites in
            // place and relies on a refused MAD being left untouched.
            assert!(m[..] == before[..], "a dropped MAD was modified ({r:?})");
        }
        if !attached {
            assert_eq!(v, GuestVerdict::Drop(DropReason::UnknownConnection));
            return v;
        }
        let Some(b) = raw_view(&before) else {
            assert_eq!(v, GuestVerdict::Drop(DropReason::Malformed));
            return v;
        };
        let attr = b.attr();
        if is_rej_timeout(&b) && b.rej_timeout_ca_guid() != Some(self.slots[s].cfg.ca_guid) {
            assert_eq!(v, GuestVerdict::Drop(DropReason::SpoofedCaGuid));
        }
        match v {
            GuestVerdict::Reply => {
                // Only a REQ over the VM's quota.
                assert!(self.small_quota, "unexpected Reply to {attr:?}");
                assert_eq!(attr, AttributeId::Req, "Reply to a guest {attr:?}");
            }
            GuestVerdict::Drop(_) => {}
            GuestVerdict::ToWire => {
                let out_m = raw_view(m).expect("a MAD for the wire is a CM MAD");
                let (sl, out) = match attr {
                    AttributeId::SidrReq => (
                        b.sidr_request_id().unwrap(),
                        out_m.sidr_request_id().unwrap(),
                    ),
                    AttributeId::SidrRep => return v,
                    AttributeId::ClassPortInfo => {
                        if b.method() == Method::Get as u8 {
                            self.get_owner.insert(out_m.tid(), vm);
                        }
                        return v;
                    }
                    _ => (
                        b.local_comm_id().unwrap_or(0),
                        out_m.local_comm_id().unwrap_or(0),
                    ),
                };
                if sl == 0 && attr == AttributeId::Rej {
                    // A stateless REJ (Local Comm ID 0) leaves as it is.
                    assert_eq!(out, 0, "{attr:?} with comm ID 0 left with {out:#x}");
                    return v;
                }
                assert_ne!(out, 0, "{attr:?} left with Local Comm ID 0");
                assert_eq!(
                    self.mux.lookup(out).and_then(|x| x.1),
                    Some(vm),
                    "{attr:?} from {vm:?} (comm ID {sl}) left with {out:#x}, no ID of its own"
                );
                if attr != AttributeId::SidrReq
                    && let Some(pv) = self.mux.pv_cm_id_of(vm, sl)
                {
                    assert_eq!(out, pv, "{attr:?} left with another ID than its pv_cm_id");
                }
                match self.pv_owner.get(&out) {
                    Some(info) => assert_eq!(
                        (info.vm, info.sl),
                        (Some(vm), sl),
                        "pv {out:#x} left from two (VM, comm ID)s"
                    ),
                    None => {
                        self.pv_owner.insert(out, PvInfo { vm: Some(vm), sl });
                    }
                }
                let comm = out_m.remote_comm_id().unwrap_or(0);
                self.learned[peer].push(Learned {
                    pv: out,
                    vm_gid: self.slots[s].cfg.gid,
                    comm,
                    attr,
                });
            }
        }
        v
    }

    fn drain(&mut self) {
        let out: Vec<_> = self.mux.drain_outbox().collect();
        for o in out {
            let m = view(&o.mad);
            let attr = m.attr();
            assert!(
                matches!(
                    attr,
                    AttributeId::Dreq | AttributeId::Drep | AttributeId::Rej
                ),
                "outbox {attr:?}"
            );
            assert!(
                self.detached.iter().any(|v| self.vm_gid[v] == o.src),
                "outbox MAD from {}, which no detached VM had",
                o.src
            );
            let peer = self
                .peers
                .iter()
                .position(|p| p.gid == o.dst)
                .unwrap_or_else(|| panic!("outbox MAD to {}", o.dst));
            let local = m.local_comm_id().unwrap_or(0);
            assert_ne!(local, 0);
            match self.pv_owner.get(&local) {
                Some(info) => {
                    if let Some(v) = info.vm {
                        assert!(self.detached.contains(&v), "outbox names live {v:?}");
                        assert_eq!(self.vm_gid[&v], o.src);
                    }
                }
                None => {
                    self.pv_owner.insert(local, PvInfo { vm: None, sl: 0 });
                }
            }
            self.learned[peer].push(Learned {
                pv: local,
                vm_gid: o.src,
                comm: m.remote_comm_id().unwrap_or(0),
                attr,
            });
        }
    }

    fn check_counts(&self) {
        let h = self.mux.state_histogram();
        let q: u64 = h
            .iter()
            .filter(|(s, _)| *s == State::Quarantined)
            .map(|x| x.1)
            .sum();
        let live: u64 = h
            .iter()
            .filter(|(s, _)| *s != State::Quarantined && *s != State::Free)
            .map(|x| x.1)
            .sum();
        assert_eq!(self.mux.live_entries(), live);
        assert_eq!(self.mux.quarantined_entries(), q);
    }

    fn build(
        &mut self,
        kind: Kind,
        cfg: &VmConfig,
        local: u32,
        remote: u32,
        svc: u8,
        mra_msg: MsgResponse,
    ) -> Mad {
        let tid = self.tid();
        let qpn = cfg.qpn_base.wrapping_add(local);
        match kind {
            Kind::Rep => rep(cfg, tid, local, remote, qpn),
            Kind::Mra => mra(tid, local, remote, mra_msg, svc),
            Kind::Rej => rej(tid, local, remote, RejReason::ConsumerDefined, &[]),
            Kind::Rtu => ids(AttributeId::Rtu, tid, local, remote),
            Kind::Dreq => dreq(tid, local, remote, remote.wrapping_add(0x1_0000)),
            Kind::Drep => ids(AttributeId::Drep, tid, local, remote),
            Kind::Lap => ids(AttributeId::Lap, tid, local, remote),
            Kind::Apr => ids(AttributeId::Apr, tid, local, remote),
        }
    }

    /// A template MAD from `cfg` (local ID `local`) to `to`, naming `remote`.
    fn template(&mut self, base: Base, cfg: &VmConfig, local: u32, remote: u32, to: Gid) -> Mad {
        let tid = self.tid();
        match base {
            Base::Req => req(
                cfg,
                local,
                tid,
                to,
                cfg.qpn_base.wrapping_add(local),
                &SHORT,
            ),
            Base::Conn(k) => self.build(k, cfg, local, remote, 3, MsgResponse::Rep),
            Base::SidrReq => {
                let mut m = ids(AttributeId::SidrReq, tid, 0, 0);
                f::SIDR_REQUEST_ID.set(&mut m, local.into());
                m
            }
            Base::SidrRep => {
                let mut m = ids(AttributeId::SidrRep, tid, 0, 0);
                f::SIDR_REQUEST_ID.set(&mut m, remote.into());
                f::SIDR_REP_QPN.set(&mut m, cfg.qpn_base.wrapping_add(local).into());
                m
            }
            Base::CpiGet => with_method(ids(AttributeId::ClassPortInfo, tid, 0, 0), Method::Get),
            Base::CpiGetResp => {
                let mut m =
                    with_method(ids(AttributeId::ClassPortInfo, tid, 0, 0), Method::GetResp);
                // A GetResp echoes a Get's TID: one a VM sent, if any.
                if let Some(&t) = self.get_owner.keys().min() {
                    m[8..16].copy_from_slice(&t.to_be_bytes());
                }
                m
            }
            Base::RejTimeout => rej(
                tid,
                local,
                0,
                RejReason::Timeout,
                &cfg.ca_guid.to_be_bytes(),
            ),
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::PeerReq {
                peer,
                vm,
                comm,
                short,
                frame_dst,
            } => {
                let peer = idx(peer, NPEER);
                let to = self.slot_gid(idx(vm, NVM + 1));
                let dst = frame_dst.map_or(to, |s| self.slot_gid(idx(s, NVM)));
                let comm = 1 + u32::from(comm) % PEER_COMMS;
                let tid = self.tid();
                let p = if short { &SHORT } else { &LINUX };
                let pc = self.peers[peer].clone();
                let mut m = req(&pc, comm, tid, to, 0x1_0000 + comm, p);
                self.wire(peer, &mut m, dst);
            }
            Op::PeerMsg {
                peer,
                kind,
                target,
                comm,
                svc,
            } => {
                let peer = idx(peer, NPEER);
                let comm = 1 + u32::from(comm) % PEER_COMMS;
                let (l, dst) = match target {
                    Target::Recent(i) => match recent(i, &self.learned[peer]) {
                        Some(l) => (l, l.vm_gid),
                        None => return,
                    },
                    Target::Known(i) => {
                        let ls = &self.learned[peer];
                        if ls.is_empty() {
                            return;
                        }
                        let l = ls[idx(i, ls.len())];
                        (l, l.vm_gid)
                    }
                    Target::WrongGid(i, s) => {
                        let ls = &self.learned[peer];
                        if ls.is_empty() {
                            return;
                        }
                        (ls[idx(i, ls.len())], self.slot_gid(idx(s, NVM)))
                    }
                    Target::Foreign(i) => {
                        let all: Vec<Learned> = self.learned.iter().flatten().copied().collect();
                        if all.is_empty() {
                            return;
                        }
                        let l = all[idx(i, all.len())];
                        (l, l.vm_gid)
                    }
                    Target::Random(pv, s) => {
                        let g = self.slot_gid(idx(s, NVM));
                        (
                            Learned {
                                pv,
                                vm_gid: g,
                                comm: 0,
                                attr: AttributeId::Req,
                            },
                            g,
                        )
                    }
                };
                let local = if l.comm != 0 { l.comm } else { comm };
                let pc = self.peers[peer].clone();
                let mut m = self.build(kind, &pc, local, l.pv, svc % 32, MsgResponse::Rep);
                self.wire(peer, &mut m, dst);
            }
            Op::PeerStep { peer, pick, comm } => {
                let peer = idx(peer, NPEER);
                let comm = 1 + u32::from(comm) % PEER_COMMS;
                let n = self.learned[peer].len();
                let Some(l) = recent(pick, &self.learned[peer]) else {
                    return;
                };
                let (kind, local) = match l.attr {
                    AttributeId::Req => (Kind::Rep, comm),
                    AttributeId::Rep => (Kind::Rtu, l.comm),
                    AttributeId::Dreq => (Kind::Drep, l.comm),
                    AttributeId::Lap => (Kind::Apr, l.comm),
                    _ => (Kind::Dreq, l.comm),
                };
                let local = if local == 0 { comm } else { local };
                let pc = self.peers[peer].clone();
                let mut m = self.build(kind, &pc, local, l.pv, 0, MsgResponse::Rep);
                let v = self.wire(peer, &mut m, l.vm_gid);
                if kind == Kind::Rep && matches!(v, WireVerdict::ToVm(_)) {
                    let at = self.learned[peer].iter().rposition(|x| x.pv == l.pv);
                    if let Some(at) = at.filter(|&at| at + 4 >= n) {
                        self.learned[peer][at].comm = local;
                    }
                }
            }
            Op::VmStep { vm, pick } => {
                let vm = idx(vm, NVM);
                let Some(c) = recent(pick, &self.slots[vm].conns) else {
                    return;
                };
                let kind = match c.last {
                    Some(AttributeId::Rep) => Kind::Rtu,
                    Some(AttributeId::Dreq) => Kind::Drep,
                    Some(AttributeId::Lap) => Kind::Apr,
                    _ => Kind::Dreq,
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, c.sl, c.comm, 0, MsgResponse::Rep);
                self.guest(vm, &mut m, c.peer);
            }
            Op::PeerRejTimeout {
                peer,
                comm,
                guid_of,
                vm,
            } => {
                let peer = idx(peer, NPEER);
                let comm = 1 + u32::from(comm) % PEER_COMMS;
                let tid = self.tid();
                let ari = self.peers[idx(guid_of, NPEER)].ca_guid.to_be_bytes();
                let mut m = rej(tid, comm, 0, RejReason::Timeout, &ari);
                let dst = self.slot_gid(idx(vm, NVM));
                self.wire(peer, &mut m, dst);
            }
            Op::VmAnswer {
                vm,
                pick,
                kind,
                sl,
                svc,
            } => {
                let vm = idx(vm, NVM);
                let sl = 1 + u32::from(sl) % VM_COMMS;
                let kind = match kind {
                    Kind::Mra | Kind::Rej => kind,
                    _ => Kind::Rep,
                };
                let Some((peer, comm, tid)) = recent(pick, &self.slots[vm].inbox) else {
                    return;
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, sl, comm, svc % 32, MsgResponse::Req);
                m[8..16].copy_from_slice(&tid.to_be_bytes());
                if self.guest(vm, &mut m, peer) == GuestVerdict::ToWire {
                    let c = &mut self.slots[vm].conns;
                    c.retain(|x| x.sl != sl);
                    if kind != Kind::Rej {
                        c.push(Conn {
                            sl,
                            peer,
                            comm,
                            last: None,
                            req: None,
                        });
                    }
                }
            }
            Op::VmMsg {
                vm,
                pick,
                kind,
                any_sl,
                svc,
            } => {
                let vm = idx(vm, NVM);
                let (sl, peer, comm) = match any_sl {
                    Some(sl) => (1 + u32::from(sl) % VM_COMMS, idx(pick, NPEER), 0),
                    None => {
                        let cs = &self.slots[vm].conns;
                        if cs.is_empty() {
                            return;
                        }
                        let c = cs[idx(pick, cs.len())];
                        (c.sl, c.peer, c.comm)
                    }
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, sl, comm, svc % 32, MsgResponse::Rep);
                self.guest(vm, &mut m, peer);
            }
            Op::VmReq {
                vm,
                sl,
                peer,
                short,
            } => {
                let vm = idx(vm, NVM);
                let sl = 1 + u32::from(sl) % VM_COMMS;
                let peer = idx(peer, NPEER);
                let tid = self.tid();
                let p = if short { &SHORT } else { &LINUX };
                let cfg = self.slots[vm].cfg.clone();
                let to = self.peers[peer].gid;
                let mut m = req(&cfg, sl, tid, to, cfg.qpn_base + sl, p);
                if self.guest(vm, &mut m, peer) == GuestVerdict::ToWire {
                    let pv = view(&m).local_comm_id().unwrap_or(0);
                    let c = &mut self.slots[vm].conns;
                    c.retain(|x| x.sl != sl);
                    c.push(Conn {
                        sl,
                        peer,
                        comm: 0,
                        last: None,
                        req: Some((tid, short, pv)),
                    });
                }
            }
            Op::VmReqRetry { vm, pick } => {
                let vm = idx(vm, NVM);
                let active: Vec<Conn> = self.slots[vm]
                    .conns
                    .iter()
                    .filter(|c| c.req.is_some())
                    .copied()
                    .collect();
                let Some(c) = recent(pick, &active) else {
                    return;
                };
                let Some((tid, short, pv)) = c.req else {
                    return;
                };
                let id = self.slots[vm].id;
                let before = self
                    .mux
                    .lookup(pv)
                    .filter(|x| x.1 == Some(id) || x.0 == State::Quarantined)
                    .map(|x| x.0);
                let p = if short { &SHORT } else { &LINUX };
                let cfg = self.slots[vm].cfg.clone();
                let to = self.peers[c.peer].gid;
                let mut m = req(&cfg, c.sl, tid, to, cfg.qpn_base + c.sl, p);
                let v = self.guest(vm, &mut m, c.peer);
                let out = view(&m).local_comm_id().unwrap_or(0);
                if let Some(st @ (State::ReqSent | State::RepRcvd)) = before {
                    assert_eq!(v, GuestVerdict::ToWire, "REQ retry in {st:?}");
                    assert_eq!(out, pv, "REQ retry in {st:?} under a new pv_cm_id");
                }
                if v == GuestVerdict::Drop(DropReason::BadState) {
                    assert_eq!(before, Some(State::Quarantined));
                }
                if v == GuestVerdict::ToWire && out != pv {
                    let conns = &mut self.slots[vm].conns;
                    conns.retain(|x| x.sl != c.sl);
                    conns.push(Conn {
                        comm: 0,
                        last: None,
                        req: Some((tid, short, out)),
                        ..c
                    });
                }
            }
            Op::VmRejTimeout { vm, pick, spoof } => {
                let vm = idx(vm, NVM);
                let cs = &self.slots[vm].conns;
                if cs.is_empty() {
                    return;
                }
                let Conn { sl, peer, .. } = cs[idx(pick, cs.len())];
                let guid = if spoof {
                    self.peers[0].ca_guid
                } else {
                    self.slots[vm].cfg.ca_guid
                };
                let tid = self.tid();
                let mut m = rej(tid, sl, 0, RejReason::Timeout, &guid.to_be_bytes());
                self.guest(vm, &mut m, peer);
            }
            Op::GuestRaw {
                vm,
                peer,
                base,
                local,
                remote,
                ref edits,
            } => {
                let vm = idx(vm, NVM);
                let peer = idx(peer, NPEER);
                let cfg = self.slots[vm].cfg.clone();
                let local = u32::from(local) % (VM_COMMS + 1);
                let remote = u32::from(remote) % (PEER_COMMS + 1);
                let to = self.peers[peer].gid;
                let mut m = self.template(base, &cfg, local, remote, to);
                for &(at, val) in edits.iter().take(16) {
                    m[at as usize] = val;
                }
                self.guest(vm, &mut m, peer);
            }
            Op::WireRaw {
                peer,
                dst,
                base,
                pick,
                comm,
                ref edits,
            } => {
                let peer = idx(peer, NPEER);
                let comm = u32::from(comm) % (PEER_COMMS + 1);
                let (pv, to) = match recent(pick, &self.learned[peer]) {
                    Some(l) => (l.pv, l.vm_gid),
                    None => (u32::from(pick), self.slot_gid(idx(dst, NVM))),
                };
                let dst = if dst & 0x80 != 0 {
                    self.slot_gid(idx(dst, NVM + 1))
                } else {
                    to
                };
                let pc = self.peers[peer].clone();
                let mut m = self.template(base, &pc, comm, pv, to);
                for &(at, val) in edits.iter().take(16) {
                    m[at as usize] = val;
                }
                self.wire(peer, &mut m, dst);
            }
            Op::Advance { ms, scale } => {
                let d = u64::from(ms) * if scale & 1 == 0 { 1 } else { 100 };
                self.clock.advance(Duration::from_millis(d));
                self.mux.poll();
            }
            Op::Detach { vm } => {
                let vm = idx(vm, NVM);
                let id = self.slots[vm].id;
                if self.slots[vm].attached {
                    self.slots[vm].attached = false;
                    self.detached.insert(id);
                    self.mux.detach_vm(id);
                } else {
                    self.mux.detach_vm(id);
                    assert_eq!(self.mux.drain_outbox().count(), 0);
                }
                assert!(self.mux.vm_config(id).is_none());
                assert_eq!(self.mux.vm_stats(id).live, 0);
            }
            Op::Restart => {
                let attached =
                    restart_from_journal(&mut self.mux, &mut self.journal, &self.clock).unwrap();
                let mut expect: Vec<VmId> = self
                    .slots
                    .iter()
                    .filter(|s| s.attached)
                    .map(|s| s.id)
                    .collect();
                expect.sort_unstable();
                assert_eq!(attached, expect);
                // Pending ClassPortInfo Gets are not kept: their answers are dropped.
                self.get_owner.clear();
            }
            Op::Reattach { vm } => {
                let vm = idx(vm, NVM);
                let cfg = self.slots[vm].cfg.clone();
                let r = self.mux.attach_vm(cfg.clone());
                if self.slots[vm].attached {
                    assert!(r.is_err(), "two attached VMs with GID {}", cfg.gid);
                } else {
                    let id = r.unwrap();
                    assert!(!self.vm_gid.contains_key(&id), "VmId {id:?} reused");
                    self.vm_gid.insert(id, cfg.gid);
                    self.slots[vm] = Slot {
                        id,
                        cfg,
                        attached: true,
                        inbox: Vec::new(),
                        conns: Vec::new(),
                    };
                }
            }
        }
    }

    /// Quiesce: every VM detaches, time runs past every lifetime, nothing is left.
    fn finish(&mut self) {
        for s in 0..NVM {
            if self.slots[s].attached {
                self.apply(&Op::Detach { vm: s as u8 });
            }
        }
        self.drain();
        // The longest an entry can outlive its VM: the orphan's DREQ attempts (3) and
        // then TimeWait, each up to max_wait (600 s), then 30 s of quarantine: 2,430 s.
        let end = self.clock.now().after(Duration::from_secs(3600));
        let mut steps = 0;
        while let Some(t) = self.mux.next_deadline().filter(|t| *t <= end) {
            self.clock.set(t);
            self.mux.poll();
            self.drain();
            steps += 1;
            assert!(steps < 100_000, "poll makes no progress");
        }
        self.clock.set(end);
        self.mux.poll();
        self.drain();
        self.check_counts();
        assert_eq!(
            self.mux.live_entries(),
            0,
            "{:?}",
            self.mux.state_histogram()
        );
        assert_eq!(self.mux.quarantined_entries(), 0);
    }
}

fuzz_target!(|input: Input| {
    let mut w = World::new(&input);
    for op in input.ops.iter().take(400) {
        w.apply(op);
        w.drain();
        w.check_counts();
        w.mux.journal_changes(&mut w.journal);
    }
    w.apply(&Op::Restart);
    w.finish();
});

//! Property test of the mux's core safety property: whatever the interleaving of MADs
//! from several VMs behind one host and several remote peers (colliding comm IDs, stale
//! and random `pv_cm_id`s, frames addressed to the wrong VM, detach and reattach, time
//! passing), a wire MAD is only ever delivered to the VM that owns the connection it
//! names, never to a detached VM, the VMs' own comm IDs never reach the wire, a VM's
//! REQ retry while its handshake is open leaves under the same `pv_cm_id` (never a
//! second connection), the mux never panics, and once every VM is gone every entry
//! drains away.
//!
//! The test keeps a ground-truth model built only from what it saw cross the mux's API:
//! which VM each `pv_cm_id` left from (and with which VM comm ID), which VM each REQ was
//! delivered to. Drops are always allowed: the property is about misrouting, not delivery.
#![allow(clippy::unwrap_used)]

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestError, TestRunner};
use pvcm_backend::mux::{
    Clock, DropReason, GuestVerdict, ManualClock, Mux, MuxConfig, Policy, State, VmConfig, VmId,
    WireVerdict,
};
use pvcm_wire::Gid;
use pvcm_wire::cm::{MsgResponse, RejReason};
use pvcm_wire::mad::AttributeId;

const NVM: usize = 3;
const NPEER: usize = 3;
/// Peers' comm IDs: a small space, so that peers collide with each other.
const PEER_COMMS: u32 = 4;
/// VMs' comm IDs: a small space, so that VMs collide with each other (and themselves).
const VM_COMMS: u32 = 6;

/// A handshake parameter set: Linux's, or a short one so that windows close during a run.
const SHORT: ReqParams = ReqParams {
    resp: 16,
    retries: 3,
    ack: 14,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

const KINDS: [Kind; 8] = [
    Kind::Rep,
    Kind::Mra,
    Kind::Rej,
    Kind::Rtu,
    Kind::Dreq,
    Kind::Drep,
    Kind::Lap,
    Kind::Apr,
];

/// Which `pv_cm_id` a peer names, and where it sends the frame.
#[derive(Debug, Clone)]
enum Target {
    /// One of the last few the peer learned, to the VM GID it learned it from.
    Recent(Index),
    /// One the peer learned (possibly long stale), to the VM GID it learned it from.
    Known(Index),
    /// One the peer learned, but addressed to this VM slot's GID.
    WrongGid(Index, usize),
    /// One another peer learned (the frame's source is not the connection's peer).
    Foreign(Index),
    /// Any value, to this VM slot's GID.
    Random(u32, usize),
}

#[derive(Debug, Clone)]
enum Op {
    /// Peer sends a REQ for VM slot `vm` (slot `NVM`: a GID nobody has); the frame may be
    /// addressed to another slot's GID.
    PeerReq {
        peer: usize,
        vm: usize,
        comm: u32,
        short: bool,
        frame_dst: Option<usize>,
    },
    /// Peer sends a connected-mode MAD naming a `pv_cm_id` in its Remote Comm ID.
    PeerMsg {
        peer: usize,
        kind: Kind,
        target: Target,
        comm: u32,
        svc: u8,
    },
    /// Peer answers one of the last MADs it got as its CM would (REQ -> REP with comm ID
    /// `comm`, REP -> RTU, DREQ -> DREP, LAP -> APR, anything else -> DREQ).
    PeerStep { peer: usize, pick: Index, comm: u32 },
    /// Peer gives up on a REQ: REJ(TIMEOUT), Remote Comm ID 0, ARI = a CA GUID (its own
    /// or, as a spoof, another peer's).
    PeerRejTimeout {
        peer: usize,
        comm: u32,
        guid_of: usize,
        vm: usize,
    },
    /// VM answers a REQ it was delivered.
    VmAnswer {
        vm: usize,
        pick: Index,
        kind: Kind,
        sl: u32,
        svc: u8,
    },
    /// VM sends a MAD for a connection it named before (or any comm ID).
    VmMsg {
        vm: usize,
        pick: Index,
        kind: Kind,
        any_sl: Option<u32>,
        svc: u8,
    },
    /// VM answers the last wire MAD of one of its recent connections as its CM would
    /// (REP -> RTU, DREQ -> DREP, LAP -> APR, anything else -> DREQ).
    VmStep { vm: usize, pick: Index },
    /// VM starts a connection.
    VmReq {
        vm: usize,
        sl: u32,
        peer: usize,
        short: bool,
    },
    /// VM re-sends the REQ of one of its recent active connections (same comm ID and
    /// TID), as its CM does when its REQ timer fires, whatever happened since.
    VmReqRetry { vm: usize, pick: Index },
    /// VM gives up on a connection with REJ(TIMEOUT) (optionally naming another CA GUID).
    VmRejTimeout { vm: usize, pick: Index, spoof: bool },
    /// Time passes, then `poll`.
    Advance { ms: u64 },
    /// The VM in the slot detaches.
    Detach { vm: usize },
    /// A fresh VM attaches with the slot's GID (if the slot is free).
    Reattach { vm: usize },
    /// The daemon restarts: the mux is rebuilt from its journal (the snapshot plus every
    /// change since) and must hold the same state.
    Restart,
}

fn kind() -> impl Strategy<Value = Kind> {
    proptest::sample::select(&KINDS[..])
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        4 => any::<Index>().prop_map(Target::Recent),
        3 => any::<Index>().prop_map(Target::Known),
        1 => (any::<Index>(), 0..NVM).prop_map(|(i, v)| Target::WrongGid(i, v)),
        1 => any::<Index>().prop_map(Target::Foreign),
        1 => (any::<u32>(), 0..NVM).prop_map(|(x, v)| Target::Random(x, v)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            0..NPEER,
            0..=NVM,
            1..=PEER_COMMS,
            any::<bool>(),
            proptest::option::weighted(0.2, 0..NVM),
        )
            .prop_map(|(peer, vm, comm, short, frame_dst)| Op::PeerReq {
                peer,
                vm,
                comm,
                short,
                frame_dst,
            }),
        5 => (0..NPEER, kind(), target(), 1..=PEER_COMMS, 0u8..=31).prop_map(
            |(peer, kind, target, comm, svc)| Op::PeerMsg {
                peer,
                kind,
                target,
                comm,
                svc,
            }
        ),
        5 => (0..NPEER, any::<Index>(), 1..=PEER_COMMS)
            .prop_map(|(peer, pick, comm)| Op::PeerStep { peer, pick, comm }),
        4 => (0..NVM, any::<Index>()).prop_map(|(vm, pick)| Op::VmStep { vm, pick }),
        1 => (0..NPEER, 1..=PEER_COMMS, 0..NPEER, 0..NVM).prop_map(
            |(peer, comm, guid_of, vm)| Op::PeerRejTimeout {
                peer,
                comm,
                guid_of,
                vm,
            }
        ),
        5 => (
            0..NVM,
            any::<Index>(),
            proptest::sample::select(&[Kind::Rep, Kind::Rep, Kind::Mra, Kind::Rej][..]),
            1..=VM_COMMS,
            0u8..=31,
        )
            .prop_map(|(vm, pick, kind, sl, svc)| Op::VmAnswer {
                vm,
                pick,
                kind,
                sl,
                svc,
            }),
        5 => (
            0..NVM,
            any::<Index>(),
            kind(),
            proptest::option::weighted(0.1, 1..=VM_COMMS),
            0u8..=31,
        )
            .prop_map(|(vm, pick, kind, any_sl, svc)| Op::VmMsg {
                vm,
                pick,
                kind,
                any_sl,
                svc,
            }),
        2 => (0..NVM, 1..=VM_COMMS, 0..NPEER, any::<bool>())
            .prop_map(|(vm, sl, peer, short)| Op::VmReq { vm, sl, peer, short }),
        2 => (0..NVM, any::<Index>()).prop_map(|(vm, pick)| Op::VmReqRetry { vm, pick }),
        1 => (0..NVM, any::<Index>(), proptest::bool::weighted(0.2))
            .prop_map(|(vm, pick, spoof)| Op::VmRejTimeout { vm, pick, spoof }),
        3 => (0u64..40_000).prop_map(|ms| Op::Advance { ms }),
        1 => (0..NVM).prop_map(|vm| Op::Detach { vm }),
        3 => (0..NVM).prop_map(|vm| Op::Reattach { vm }),
        1 => Just(Op::Restart),
    ]
}

/// One VM slot: the VM currently (or last) attached with the slot's GID.
struct Slot {
    id: VmId,
    cfg: VmConfig,
    attached: bool,
    /// REQs delivered to this VM: (peer, peer comm ID, TID).
    inbox: Vec<(usize, u32, u64)>,
    /// Connections the VM has named.
    conns: Vec<Conn>,
}

/// A connection as a VM's CM knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Conn {
    /// The VM's comm ID.
    sl: u32,
    peer: usize,
    /// The peer's comm ID (0: not known yet).
    comm: u32,
    /// The last wire MAD delivered for it.
    last: Option<AttributeId>,
    /// The VM started it: the REQ's TID and parameter set, and the `pv_cm_id` it left with.
    req: Option<(u64, bool, u32)>,
}

/// One of the last 4 items of `v` (`None` if empty).
fn recent<T: Copy>(i: Index, v: &[T]) -> Option<T> {
    let n = v.len().min(4);
    (n > 0).then(|| v[v.len() - 1 - i.index(n)])
}

/// Who a `pv_cm_id` belongs to, learned from the MADs that left with it.
#[derive(Debug, Clone, Copy)]
struct PvInfo {
    /// The VM it left from; `None` when it first showed up in the mux's own MADs (sent
    /// on behalf of a detached VM).
    vm: Option<VmId>,
    /// The VM comm ID it stands for.
    sl: u32,
    /// The peer it was first sent to.
    peer: usize,
}

/// A `pv_cm_id` as a peer learned it: from a MAD sent to it by this VM GID.
#[derive(Debug, Clone, Copy)]
struct Learned {
    pv: u32,
    vm_gid: Gid,
    /// The peer's comm ID that MAD named (0: none yet).
    comm: u32,
    /// What the MAD was.
    attr: AttributeId,
}

type Coverage = BTreeMap<String, u64>;

struct World {
    clock: ManualClock,
    mux: Mux<ManualClock>,
    slots: Vec<Slot>,
    peers: Vec<VmConfig>,
    learned: Vec<Vec<Learned>>,
    pv_owner: HashMap<u32, PvInfo>,
    /// (peer CA GUID, peer comm ID) -> the VM its latest REQ was delivered to.
    req_latest: HashMap<(u64, u32), VmId>,
    vm_gid: HashMap<VmId, Gid>,
    detached: HashSet<VmId>,
    next_tid: u64,
    cov: Coverage,
    /// The mux's journal: a snapshot, then the changes of every operation.
    journal: Vec<u8>,
}

fn attr_name(b: &Mad) -> String {
    format!("{:?}", view(b).attr())
}

impl World {
    fn new(seed: u64) -> World {
        let clock = ManualClock::new();
        let cfg = MuxConfig {
            policy: Policy::Default,
            seed,
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
            req_latest: HashMap::new(),
            vm_gid,
            detached: HashSet::new(),
            next_tid: 1,
            cov: Coverage::new(),
            journal,
        }
    }

    fn tid(&mut self) -> u64 {
        self.next_tid += 1;
        0x7E57_0000_0000_0000 | self.next_tid
    }

    fn count(&mut self, what: String) {
        *self.cov.entry(what).or_default() += 1;
    }

    fn slot_gid(&self, s: usize) -> Gid {
        if s < NVM {
            self.slots[s].cfg.gid
        } else {
            gid(2, 99)
        }
    }

    /// The attached slot of VM `vm`.
    fn attached_slot(&self, vm: VmId) -> Option<usize> {
        self.slots.iter().position(|s| s.id == vm && s.attached)
    }

    // ------------------------------------------------------------------------------
    // Wire -> mux

    /// Peer `peer` sends `m` to `dst`; checks the verdict against the model.
    fn wire(&mut self, peer: usize, m: &mut Mad, dst: Gid) -> Result<WireVerdict, TestCaseError> {
        let before = *m;
        let src = self.peers[peer].gid;
        let v = self.mux.from_wire(m, src, dst);
        let b = view(&before);
        let attr = b.attr();
        let rej_timeout = attr == AttributeId::Rej
            && b.remote_comm_id() == Some(0)
            && b.rej_reason() == Some(RejReason::Timeout.code());
        let name = if rej_timeout {
            "RejTimeout".to_string()
        } else {
            attr_name(&before)
        };
        match v {
            WireVerdict::Reply => {
                // Only a DREQ for an unknown connection is answered (stateless DREP).
                prop_assert_eq!(attr, AttributeId::Dreq, "Reply to a wire {}", name);
                let r = view(m);
                prop_assert_eq!(r.attr(), AttributeId::Drep);
                prop_assert_eq!(r.local_comm_id(), b.remote_comm_id());
                prop_assert_eq!(r.remote_comm_id(), b.local_comm_id());
                self.count(format!("wire {name} Reply"));
            }
            WireVerdict::Drop(r) => self.count(format!("wire {name} Drop({r:?})")),
            WireVerdict::ToVm(vm) => {
                // Invariant 2: never to a detached VM.
                prop_assert!(
                    !self.detached.contains(&vm),
                    "wire {} delivered to detached {:?}",
                    name,
                    vm
                );
                prop_assert!(self.mux.vm_config(vm).is_some());
                let slot = self.attached_slot(vm);
                prop_assert!(
                    slot.is_some(),
                    "wire {} delivered to unknown {:?}",
                    name,
                    vm
                );
                let slot = slot.unwrap();
                let got = view(m);
                if attr == AttributeId::Req {
                    // Invariant 1, REQ: by its Primary Remote Port GID.
                    prop_assert_eq!(
                        got.req_primary_remote_gid(),
                        Some(self.slots[slot].cfg.gid),
                        "REQ delivered to {:?}, whose GID it does not name",
                        vm
                    );
                } else if rej_timeout {
                    // Invariant 1, REJ(TIMEOUT): (ARI CA GUID, Local Comm ID) names the
                    // REQ most recently delivered to this VM.
                    let key = (
                        b.rej_timeout_ca_guid().unwrap_or(0),
                        b.local_comm_id().unwrap(),
                    );
                    prop_assert_eq!(
                        self.req_latest.get(&key).copied(),
                        Some(vm),
                        "REJ(TIMEOUT) {:x?} delivered to {:?}",
                        key,
                        vm
                    );
                } else {
                    // Invariant 1, connected MADs: the pv_cm_id left from this VM, and
                    // the restored Remote Comm ID is the VM's own comm ID for it.
                    let pv = b.remote_comm_id().unwrap();
                    let info = self.pv_owner.get(&pv).copied();
                    prop_assert!(
                        info.is_some(),
                        "wire {} naming pv {:#x}, which never left any VM, delivered to {:?}",
                        name,
                        pv,
                        vm
                    );
                    let info = info.unwrap();
                    prop_assert_eq!(
                        info.vm,
                        Some(vm),
                        "wire {} naming pv {:#x} misrouted",
                        name,
                        pv
                    );
                    prop_assert_eq!(
                        got.remote_comm_id(),
                        Some(info.sl),
                        "wire {} naming pv {:#x}: wrong comm ID restored",
                        name,
                        pv
                    );
                    prop_assert_eq!(dst, self.slots[slot].cfg.gid, "frame to another GID");
                    if info.peer != peer {
                        // The mux routes by pv_cm_id and destination GID; it does not check
                        // the source (the VM's CM checks the peer's comm ID itself).
                        self.count(format!("wire {name} ToVm from another source"));
                    }
                    // What the VM learns: the peer's comm ID for its connection.
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
                self.count(format!("wire {name} ToVm"));
            }
        }
        Ok(v)
    }

    // ------------------------------------------------------------------------------
    // VM -> mux

    /// VM slot `s` sends `m` to peer `peer`; checks the verdict and learns the pv_cm_id.
    fn guest(&mut self, s: usize, m: &mut Mad, peer: usize) -> Result<GuestVerdict, TestCaseError> {
        let (vm, attached) = (self.slots[s].id, self.slots[s].attached);
        let dst = self.peers[peer].gid;
        let before = *m;
        let b = view(&before);
        let attr = b.attr();
        let sl = b.local_comm_id().unwrap_or(0);
        let v = self.mux.from_guest(vm, m, dst);
        let name = attr_name(&before);
        if !attached {
            prop_assert_eq!(v, GuestVerdict::Drop(DropReason::UnknownConnection));
            self.count(format!("guest {name} from detached VM"));
            return Ok(v);
        }
        let rej_timeout = attr == AttributeId::Rej
            && b.remote_comm_id() == Some(0)
            && b.rej_reason() == Some(RejReason::Timeout.code());
        if rej_timeout && b.rej_timeout_ca_guid() != Some(self.slots[s].cfg.ca_guid) {
            prop_assert_eq!(v, GuestVerdict::Drop(DropReason::SpoofedCaGuid));
        }
        match v {
            GuestVerdict::Reply => {
                // Only a REQ over quota; the default quota is never reached here.
                return Err(TestCaseError::fail(format!("unexpected Reply to {name}")));
            }
            GuestVerdict::Drop(r) => {
                // A dropped MAD is echoed to the VM in a SEND_ERROR as it sent it: the
                // mux leaves the buffer untouched when it refuses (the device rewrites
                // in place and relies on this).
                prop_assert_eq!(&m[..], &before[..], "a dropped {} was modified", name);
                self.count(format!("guest {name} Drop({r:?})"))
            }
            GuestVerdict::ToWire => {
                self.count(format!("guest {name} ToWire"));
                let out = view(m).local_comm_id().unwrap_or(0);
                // Invariant 3: the VM's comm ID is replaced by its pv_cm_id.
                prop_assert_ne!(sl, 0, "the test's VMs always name a comm ID");
                prop_assert_ne!(out, 0, "{} left with Local Comm ID 0", name);
                // It names an entry of this VM (a REJ's is retired already, but its ID
                // is still held, in quarantine)...
                prop_assert_eq!(
                    self.mux.lookup(out).and_then(|x| x.1),
                    Some(vm),
                    "{} from {:?} (comm ID {}) left with {:#x}, no ID of its own",
                    name,
                    vm,
                    sl,
                    out
                );
                // ... the one the VM's comm ID maps to, if still mapped. (So the VM's own
                // comm ID only shows if it happens to be its pv_cm_id too.)
                if let Some(pv) = self.mux.pv_cm_id_of(vm, sl) {
                    prop_assert_eq!(out, pv, "{} left with another ID than its pv_cm_id", name);
                }
                // Host-uniqueness: a pv_cm_id stands for one (VM, comm ID).
                match self.pv_owner.get(&out) {
                    Some(info) => {
                        prop_assert_eq!(
                            (info.vm, info.sl),
                            (Some(vm), sl),
                            "pv {:#x} left from two (VM, comm ID)s",
                            out
                        );
                    }
                    None => {
                        self.pv_owner.insert(
                            out,
                            PvInfo {
                                vm: Some(vm),
                                sl,
                                peer,
                            },
                        );
                    }
                }
                let comm = view(m).remote_comm_id().unwrap_or(0);
                self.learned[peer].push(Learned {
                    pv: out,
                    vm_gid: self.slots[s].cfg.gid,
                    comm,
                    attr,
                });
                if attr == AttributeId::Rtu
                    && self.mux.lookup(out).map(|x| x.0) == Some(State::Established)
                {
                    self.count("established (VM active)".into());
                }
            }
        }
        Ok(v)
    }

    /// Checks what the mux sent on its own (for detached VMs) and lets peers learn it.
    fn drain(&mut self) -> Result<(), TestCaseError> {
        let out: Vec<_> = self.mux.drain_outbox().collect();
        for o in out {
            let m = view(&o.mad);
            let attr = m.attr();
            prop_assert!(
                matches!(
                    attr,
                    AttributeId::Dreq | AttributeId::Drep | AttributeId::Rej
                ),
                "outbox {:?}",
                attr
            );
            prop_assert!(
                self.detached.iter().any(|v| self.vm_gid[v] == o.src),
                "outbox MAD from {}, which no detached VM had",
                o.src
            );
            let peer = self.peers.iter().position(|p| p.gid == o.dst);
            prop_assert!(peer.is_some(), "outbox MAD to {}", o.dst);
            let peer = peer.unwrap();
            let local = m.local_comm_id().unwrap_or(0);
            prop_assert_ne!(local, 0);
            match self.pv_owner.get(&local) {
                Some(info) => {
                    if let Some(v) = info.vm {
                        prop_assert!(self.detached.contains(&v), "outbox names live {:?}", v);
                        prop_assert_eq!(self.vm_gid[&v], o.src);
                    }
                }
                None => {
                    self.pv_owner.insert(
                        local,
                        PvInfo {
                            vm: None,
                            sl: 0,
                            peer,
                        },
                    );
                }
            }
            self.learned[peer].push(Learned {
                pv: local,
                vm_gid: o.src,
                comm: m.remote_comm_id().unwrap_or(0),
                attr,
            });
            self.count(format!("outbox {attr:?}"));
        }
        Ok(())
    }

    /// The mux's counters agree with its table.
    fn check_counts(&self) -> Result<(), TestCaseError> {
        let h = self.mux.state_histogram();
        let q = h
            .iter()
            .filter(|(s, _)| *s == State::Quarantined)
            .map(|x| x.1)
            .sum::<u64>();
        let live = h
            .iter()
            .filter(|(s, _)| *s != State::Quarantined && *s != State::Free)
            .map(|x| x.1)
            .sum::<u64>();
        prop_assert_eq!(self.mux.live_entries(), live);
        prop_assert_eq!(self.mux.quarantined_entries(), q);
        Ok(())
    }

    // ------------------------------------------------------------------------------
    // Operations

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
        let qpn = cfg.qpn_base + local;
        match kind {
            Kind::Rep => rep(cfg, tid, local, remote, qpn),
            Kind::Mra => mra(tid, local, remote, mra_msg, svc),
            Kind::Rej => rej(tid, local, remote, RejReason::ConsumerDefined, &[]),
            Kind::Rtu => ids(AttributeId::Rtu, tid, local, remote),
            Kind::Dreq => dreq(tid, local, remote, 0x1_0000 + remote),
            Kind::Drep => ids(AttributeId::Drep, tid, local, remote),
            Kind::Lap => ids(AttributeId::Lap, tid, local, remote),
            Kind::Apr => ids(AttributeId::Apr, tid, local, remote),
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::PeerReq {
                peer,
                vm,
                comm,
                short,
                frame_dst,
            } => {
                let to = self.slot_gid(vm);
                let dst = frame_dst.map_or(to, |s| self.slot_gid(s));
                let tid = self.tid();
                let p = if short { &SHORT } else { &LINUX };
                let pc = self.peers[peer].clone();
                let mut m = req(&pc, comm, tid, to, 0x1_0000 + comm, p);
                if let WireVerdict::ToVm(v) = self.wire(peer, &mut m, dst)? {
                    self.req_latest.insert((pc.ca_guid, comm), v);
                    let s = self.attached_slot(v).unwrap();
                    self.slots[s].inbox.push((peer, comm, tid));
                }
            }
            Op::PeerMsg {
                peer,
                kind,
                ref target,
                comm,
                svc,
            } => {
                let (l, dst) = match *target {
                    Target::Recent(i) => match recent(i, &self.learned[peer]) {
                        Some(l) => (l, l.vm_gid),
                        None => return Ok(()),
                    },
                    Target::Known(i) => {
                        if self.learned[peer].is_empty() {
                            return Ok(());
                        }
                        let l = *i.get(&self.learned[peer]);
                        (l, l.vm_gid)
                    }
                    Target::WrongGid(i, s) => {
                        if self.learned[peer].is_empty() {
                            return Ok(());
                        }
                        (*i.get(&self.learned[peer]), self.slot_gid(s))
                    }
                    Target::Foreign(i) => {
                        let all: Vec<Learned> = self.learned.iter().flatten().copied().collect();
                        if all.is_empty() {
                            return Ok(());
                        }
                        let l = *i.get(&all);
                        (l, l.vm_gid)
                    }
                    Target::Random(pv, s) => (
                        Learned {
                            pv,
                            vm_gid: self.slot_gid(s),
                            comm: 0,
                            attr: AttributeId::Req,
                        },
                        self.slot_gid(s),
                    ),
                };
                let local = if l.comm != 0 { l.comm } else { comm };
                let pc = self.peers[peer].clone();
                let mut m = self.build(kind, &pc, local, l.pv, svc, MsgResponse::Rep);
                let v = self.wire(peer, &mut m, dst)?;
                if kind == Kind::Rtu
                    && matches!(v, WireVerdict::ToVm(_))
                    && self.mux.lookup(l.pv).map(|x| x.0) == Some(State::Established)
                {
                    self.count("established (VM passive)".into());
                }
            }
            Op::PeerStep { peer, pick, comm } => {
                let n = self.learned[peer].len();
                let Some(l) = recent(pick, &self.learned[peer]) else {
                    return Ok(());
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
                let v = self.wire(peer, &mut m, l.vm_gid)?;
                if kind == Kind::Rep && matches!(v, WireVerdict::ToVm(_)) {
                    // The peer now knows the connection by its own comm ID too.
                    let at = self.learned[peer].iter().rposition(|x| x.pv == l.pv);
                    if let Some(at) = at.filter(|&at| at + 4 >= n) {
                        self.learned[peer][at].comm = local;
                    }
                }
                if kind == Kind::Rtu
                    && matches!(v, WireVerdict::ToVm(_))
                    && self.mux.lookup(l.pv).map(|x| x.0) == Some(State::Established)
                {
                    self.count("established (VM passive)".into());
                }
            }
            Op::VmStep { vm, pick } => {
                let Some(c) = recent(pick, &self.slots[vm].conns) else {
                    return Ok(());
                };
                let kind = match c.last {
                    Some(AttributeId::Rep) => Kind::Rtu,
                    Some(AttributeId::Dreq) => Kind::Drep,
                    Some(AttributeId::Lap) => Kind::Apr,
                    _ => Kind::Dreq,
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, c.sl, c.comm, 0, MsgResponse::Rep);
                self.guest(vm, &mut m, c.peer)?;
            }
            Op::PeerRejTimeout {
                peer,
                comm,
                guid_of,
                vm,
            } => {
                let tid = self.tid();
                let ari = self.peers[guid_of].ca_guid.to_be_bytes();
                let mut m = rej(tid, comm, 0, RejReason::Timeout, &ari);
                let dst = self.slot_gid(vm);
                self.wire(peer, &mut m, dst)?;
            }
            Op::VmAnswer {
                vm,
                pick,
                kind,
                sl,
                svc,
            } => {
                let Some((peer, comm, tid)) = recent(pick, &self.slots[vm].inbox) else {
                    return Ok(());
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, sl, comm, svc, MsgResponse::Req);
                // The answer echoes the REQ's TID.
                m[8..16].copy_from_slice(&tid.to_be_bytes());
                if self.guest(vm, &mut m, peer)? == GuestVerdict::ToWire {
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
                let (sl, peer, comm) = match any_sl {
                    Some(sl) => (sl, pick.index(NPEER), 0),
                    None => {
                        if self.slots[vm].conns.is_empty() {
                            return Ok(());
                        }
                        let c = *pick.get(&self.slots[vm].conns);
                        (c.sl, c.peer, c.comm)
                    }
                };
                let cfg = self.slots[vm].cfg.clone();
                let mut m = self.build(kind, &cfg, sl, comm, svc, MsgResponse::Rep);
                self.guest(vm, &mut m, peer)?;
            }
            Op::VmReq {
                vm,
                sl,
                peer,
                short,
            } => {
                let tid = self.tid();
                let p = if short { &SHORT } else { &LINUX };
                let cfg = self.slots[vm].cfg.clone();
                let to = self.peers[peer].gid;
                let mut m = req(&cfg, sl, tid, to, cfg.qpn_base + sl, p);
                if self.guest(vm, &mut m, peer)? == GuestVerdict::ToWire {
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
                let active: Vec<Conn> = self.slots[vm]
                    .conns
                    .iter()
                    .filter(|c| c.req.is_some())
                    .copied()
                    .collect();
                let Some(c) = recent(pick, &active) else {
                    return Ok(());
                };
                let Some((tid, short, pv)) = c.req else {
                    return Ok(());
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
                let v = self.guest(vm, &mut m, c.peer)?;
                let out = view(&m).local_comm_id().unwrap_or(0);
                if let Some(st @ (State::ReqSent | State::RepRcvd)) = before {
                    // A retry while the handshake is open leaves as the same REQ.
                    prop_assert_eq!(v, GuestVerdict::ToWire, "REQ retry in {:?}", st);
                    prop_assert_eq!(out, pv, "REQ retry in {:?} under a new pv_cm_id", st);
                }
                if v == GuestVerdict::Drop(DropReason::BadState) {
                    // Only a retry that crossed the peer's REJ.
                    prop_assert_eq!(before, Some(State::Quarantined));
                }
                let state = before.map_or("gone".to_string(), |s| format!("{s:?}"));
                let verdict = match v {
                    GuestVerdict::ToWire if out == pv => "same pv".to_string(),
                    GuestVerdict::ToWire => "new pv".to_string(),
                    v => format!("{v:?}"),
                };
                self.count(format!("guest Req retry in {state}: {verdict}"));
                if v == GuestVerdict::ToWire && out != pv {
                    // A new connection under the same comm ID (and TID).
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
                if self.slots[vm].conns.is_empty() {
                    return Ok(());
                }
                let Conn { sl, peer, .. } = *pick.get(&self.slots[vm].conns);
                let guid = if spoof {
                    self.peers[0].ca_guid
                } else {
                    self.slots[vm].cfg.ca_guid
                };
                let tid = self.tid();
                let mut m = rej(tid, sl, 0, RejReason::Timeout, &guid.to_be_bytes());
                self.guest(vm, &mut m, peer)?;
            }
            Op::Advance { ms } => {
                self.clock.advance(Duration::from_millis(ms));
                self.mux.poll();
            }
            Op::Detach { vm } => {
                let id = self.slots[vm].id;
                if self.slots[vm].attached {
                    self.slots[vm].attached = false;
                    self.detached.insert(id);
                    self.mux.detach_vm(id);
                    self.count("detach".into());
                } else {
                    // Detaching twice is a no-op.
                    self.mux.detach_vm(id);
                    prop_assert_eq!(self.mux.drain_outbox().count(), 0);
                }
                prop_assert!(self.mux.vm_config(id).is_none());
                prop_assert_eq!(self.mux.vm_stats(id).live, 0);
            }
            Op::Restart => {
                let attached = restart_from_journal(&mut self.mux, &mut self.journal, &self.clock)
                    .map_err(TestCaseError::fail)?;
                let mut expect: Vec<VmId> = self
                    .slots
                    .iter()
                    .filter(|s| s.attached)
                    .map(|s| s.id)
                    .collect();
                expect.sort_unstable();
                prop_assert_eq!(attached, expect);
                self.count("restart".into());
            }
            Op::Reattach { vm } => {
                let cfg = self.slots[vm].cfg.clone();
                let r = self.mux.attach_vm(cfg.clone());
                if self.slots[vm].attached {
                    prop_assert!(r.is_err(), "two attached VMs with GID {}", cfg.gid);
                } else {
                    let id = r.map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(!self.vm_gid.contains_key(&id), "VmId {:?} reused", id);
                    self.vm_gid.insert(id, cfg.gid);
                    self.slots[vm] = Slot {
                        id,
                        cfg,
                        attached: true,
                        inbox: Vec::new(),
                        conns: Vec::new(),
                    };
                    self.count("reattach".into());
                }
            }
        }
        Ok(())
    }

    /// Invariant 4: with every VM gone, every entry drains away.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        for s in 0..NVM {
            if self.slots[s].attached {
                self.apply(&Op::Detach { vm: s })?;
            }
        }
        self.drain()?;
        // Drive the mux as its I/O layer does: poll at each deadline, for 3 x 700 s.
        // The longest an entry can outlive its VM: the orphan's DREQ attempts (3) and
        // then TimeWait, each up to max_wait (600 s), then 30 s of quarantine: 2,430 s.
        let end = self.clock.now().after(Duration::from_secs(3600));
        let mut steps = 0;
        while let Some(t) = self.mux.next_deadline().filter(|t| *t <= end) {
            self.clock.set(t);
            self.mux.poll();
            self.drain()?;
            steps += 1;
            prop_assert!(steps < 100_000, "poll makes no progress");
        }
        self.clock.set(end);
        self.mux.poll();
        self.drain()?;
        self.check_counts()?;
        prop_assert_eq!(
            self.mux.live_entries(),
            0,
            "{:?}",
            self.mux.state_histogram()
        );
        prop_assert_eq!(self.mux.quarantined_entries(), 0);
        Ok(())
    }
}

fn run_case(seed: u64, ops: &[Option<Op>], cov: &RefCell<Coverage>) -> Result<(), TestCaseError> {
    let mut w = World::new(seed);
    for op in ops.iter().flatten() {
        w.apply(op)?;
        w.drain()?;
        w.check_counts()?;
        // The daemon commits the changes of each batch.
        w.mux.journal_changes(&mut w.journal);
    }
    w.apply(&Op::Restart)?;
    w.finish()?;
    let mut c = cov.borrow_mut();
    for (k, v) in w.cov {
        *c.entry(k).or_default() += v;
    }
    Ok(())
}

#[test]
fn wire_mads_reach_only_their_owner() {
    let config = ProptestConfig {
        cases: 256,
        max_shrink_iters: 20_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    let cov = RefCell::new(Coverage::new());
    // 50..300 operations; an operation shrinks to `None` (skipped), so that a failing
    // case shrinks below 50 operations.
    let ops = proptest::collection::vec(proptest::option::weighted(0.98, op()), 50..300);
    let strategy = (any::<u64>(), ops);
    let result = runner.run(&strategy, |(seed, ops)| run_case(seed, &ops, &cov));
    if let Err(e) = result {
        match e {
            TestError::Fail(why, (seed, ops)) => {
                let ops: Vec<Op> = ops.into_iter().flatten().collect();
                panic!(
                    "{why}\nminimal case: seed {seed:#x}, {} ops:\n{ops:#?}",
                    ops.len()
                )
            }
            TestError::Abort(why) => panic!("aborted: {why}"),
        }
    }
    // The property is not vacuous: every kind of routing (and of refusal) happened.
    let cov = cov.into_inner();
    for (k, v) in &cov {
        eprintln!("{v:8}  {k}");
    }
    let seen = |what: &str| {
        cov.iter()
            .filter(|(k, _)| k.contains(what))
            .map(|x| *x.1)
            .sum::<u64>()
    };
    for must in [
        "wire Req ToVm",
        "wire Rep ToVm",
        "wire Mra ToVm",
        "wire Rej ToVm",
        "wire RejTimeout ToVm",
        "wire Rtu ToVm",
        "wire Dreq ToVm",
        "wire Drep ToVm",
        "wire Lap ToVm",
        "wire Apr ToVm",
        "wire Dreq Reply",
        "Drop(WrongDestination)",
        "Drop(Quarantined)",
        "Drop(NoRoute)",
        "Drop(Absorbed)",
        "Drop(BadState)",
        "Drop(UnknownGid)",
        "guest Req ToWire",
        "guest Rep ToWire",
        "guest Mra ToWire",
        "guest Rej ToWire",
        "guest Rtu ToWire",
        "guest Dreq ToWire",
        "guest Drep ToWire",
        "guest Rej Drop(SpoofedCaGuid)",
        "guest Req retry in ReqSent: same pv",
        "guest Req retry in RepRcvd: same pv",
        "guest Req retry in Quarantined: Drop(BadState)",
        "from detached VM",
        "established (VM active)",
        "established (VM passive)",
        "outbox Dreq",
        "outbox Rej",
        "reattach",
        "restart",
    ] {
        assert!(seen(must) > 0, "never happened: {must}");
    }
}

//! The reference model of the mux, shared by the property test (`backend/tests/mux_prop.rs`,
//! operations from proptest strategies) and the fuzz target (`fuzz/fuzz_targets/mux.rs`,
//! operations decoded from bytes with `arbitrary`), so the two check the same things.
//!
//! Three VM slots behind one host, three remote peers, small comm-ID spaces so that
//! everything collides, and a ground truth built only from what crossed the mux's API:
//! which VM each `pv_cm_id` left from (and with which VM comm ID), which VM each REQ was
//! delivered to. The operations: peer REQs, MADs naming recent, stale, foreign or random
//! `pv_cm_id`s, frames to the wrong GID, peers and VMs answering as their CMs would, REQ
//! retries, REJ(TIMEOUT)s (spoofed too), a MAD of any attribute with byte edits
//! (`GuestRaw`, `WireRaw`), detach and reattach, time steps, restarts (the mux rebuilt
//! from its journal). Drops are always allowed: the property is about misrouting, not
//! delivery.
//!
//! Checked after every operation (a failed check panics): no panic; a wire MAD
//! delivered to a VM belongs to that VM (REQ: its GID; REJ(TIMEOUT): the REQ last
//! delivered to it; SIDR_REQ and ClassPortInfo Get: the frame's destination GID;
//! GetResp: a Get it sent; SIDR_REP: a request ID that left from it; everything else: a
//! `pv_cm_id` that left from it, restored to its own comm ID); never to a detached VM; a
//! VM's comm ID is replaced on the wire and a `pv_cm_id` stands for one (VM, comm ID);
//! a VM's REQ retry while its handshake is open leaves under the same `pv_cm_id`; a
//! refused MAD is left untouched; what the mux sends itself speaks for a detached VM;
//! the live/quarantined counts agree with the table; a mux restored from the journal
//! holds the same state. At the end ([`run`]) every VM detaches, the clock runs past
//! every lifetime, and every entry must be gone.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use pvcm_backend::mux::{
    Clock, DropReason, GuestVerdict, ManualClock, Mux, MuxConfig, Policy, State, VmConfig, VmId,
    WireVerdict,
};
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmMad, MsgResponse, RejReason, field as f};
use pvcm_wire::mad::{AttributeId, Method};

use crate::common::*;

/// How a run's mux is configured, and whether it keeps coverage.
#[derive(Debug, Clone)]
pub struct Config {
    /// The mux's seed.
    pub seed: u64,
    /// The table size (bits; the mux clamps it).
    pub table_bits: u8,
    /// A small quota for every VM (`q % 16`), so REQs meet REJ(NO_RESOURCES).
    pub quota: Option<u8>,
    /// Keep [`World::cov`].
    pub coverage: bool,
}

impl Config {
    /// The default table and quota, this seed.
    pub fn new(seed: u64) -> Config {
        Config {
            seed,
            table_bits: MuxConfig::default().table_bits,
            quota: None,
            coverage: false,
        }
    }
}

/// What happened how often.
pub type Coverage = BTreeMap<String, u64>;

/// The longest run [`run`] takes: more operations are ignored.
pub const MAX_OPS: usize = 400;

/// Runs `ops` (skipping `None`s) on a fresh model, checking after each, then restarts the
/// mux and quiesces; returns the model (its coverage) for the caller to look at.
pub fn run<'a>(config: &Config, ops: impl IntoIterator<Item = &'a Op>) -> World {
    let mut w = World::new(config);
    for op in ops.into_iter().take(MAX_OPS) {
        w.apply(op);
        w.drain();
        w.check_counts();
        // The daemon commits the changes of each batch.
        w.mux.journal_changes(&mut w.journal);
    }
    w.apply(&Op::Restart);
    w.finish();
    w
}

/// A MAD's name for the coverage: its attribute (from the wire, `RejTimeout` for a
/// REJ(TIMEOUT) without our ID, which routes by its own key), `Malformed` for what is no
/// CM MAD.
fn mad_name(m: &Mad, from_wire: bool) -> String {
    match raw_view(m) {
        Some(b) if from_wire && is_rej_timeout(&b) => "RejTimeout".to_string(),
        Some(b) => format!("{:?}", b.attr()),
        None => "Malformed".to_string(),
    }
}

/// VM slots.
pub const NVM: usize = 3;
/// Remote peers.
pub const NPEER: usize = 3;
/// Comm IDs a peer uses (1..=4).
pub const PEER_COMMS: u32 = 4;
/// Comm IDs a VM uses (1..=6).
pub const VM_COMMS: u32 = 6;

const SHORT: ReqParams = ReqParams {
    resp: 16,
    retries: 3,
    ack: 14,
};

/// A connected-mode message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub enum Kind {
    Rep,
    Mra,
    Rej,
    Rtu,
    Dreq,
    Drep,
    Lap,
    Apr,
}

/// Every [`Kind`].
pub const KINDS: [Kind; 8] = [
    Kind::Rep,
    Kind::Mra,
    Kind::Rej,
    Kind::Rtu,
    Kind::Dreq,
    Kind::Drep,
    Kind::Lap,
    Kind::Apr,
];

/// Which template a raw MAD starts from.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub enum Base {
    Req,
    Conn(Kind),
    SidrReq,
    SidrRep,
    CpiGet,
    CpiGetResp,
    RejTimeout,
}

/// Which `pv_cm_id` a peer names, and where it sends the frame. Indices pick modulo the
/// list's length; VM slots modulo [`NVM`].
#[derive(Debug, Clone, Copy)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub enum Target {
    /// One of the last few the peer learned, to the VM GID it learned it from.
    Recent(u8),
    /// One the peer learned (possibly long stale), to the VM GID it learned it from.
    Known(u8),
    /// One the peer learned, but addressed to this VM slot's GID.
    WrongGid(u8, u8),
    /// One another peer learned (the frame's source is not the connection's peer).
    Foreign(u8),
    /// Any value, to this VM slot's GID.
    Random(u32, u8),
}

/// One operation. Peers, VM slots, comm IDs and picks are taken modulo their ranges
/// (comm IDs from 1).
#[derive(Debug, Clone)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub enum Op {
    /// Peer sends a REQ for VM slot `vm` (slot `NVM`: a GID nobody has); the frame may be
    /// addressed to another slot's GID.
    PeerReq {
        peer: u8,
        vm: u8,
        comm: u8,
        short: bool,
        frame_dst: Option<u8>,
    },
    /// Peer sends a connected-mode MAD naming a `pv_cm_id` in its Remote Comm ID.
    PeerMsg {
        peer: u8,
        kind: Kind,
        target: Target,
        comm: u8,
        svc: u8,
    },
    /// Peer answers one of the last MADs it got as its CM would (REQ -> REP with comm ID
    /// `comm`, REP -> RTU, DREQ -> DREP, LAP -> APR, anything else -> DREQ).
    PeerStep { peer: u8, pick: u8, comm: u8 },
    /// Peer gives up on a REQ: REJ(TIMEOUT), Remote Comm ID 0, ARI = a CA GUID (its own
    /// or, as a spoof, another peer's).
    PeerRejTimeout {
        peer: u8,
        comm: u8,
        guid_of: u8,
        vm: u8,
    },
    /// VM answers a REQ it was delivered (REP, MRA or REJ; other kinds answer REP).
    VmAnswer {
        vm: u8,
        pick: u8,
        kind: Kind,
        sl: u8,
        svc: u8,
    },
    /// VM sends a MAD for a connection it named before (or any comm ID).
    VmMsg {
        vm: u8,
        pick: u8,
        kind: Kind,
        any_sl: Option<u8>,
        svc: u8,
    },
    /// VM answers the last wire MAD of one of its recent connections as its CM would
    /// (REP -> RTU, DREQ -> DREP, LAP -> APR, anything else -> DREQ).
    VmStep { vm: u8, pick: u8 },
    /// VM starts a connection.
    VmReq {
        vm: u8,
        sl: u8,
        peer: u8,
        short: bool,
    },
    /// VM re-sends the REQ of one of its recent active connections (same comm ID and
    /// TID), as its CM does when its REQ timer fires, whatever happened since.
    VmReqRetry { vm: u8, pick: u8 },
    /// VM gives up on a connection with REJ(TIMEOUT) (optionally naming another CA GUID).
    VmRejTimeout { vm: u8, pick: u8, spoof: bool },
    /// A MAD of any kind from a VM, with byte edits (offset, value; 16 at most).
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
    /// Time passes (`ms`, times 100 for an odd `scale`), then `poll`.
    Advance { ms: u16, scale: u8 },
    /// The VM in the slot detaches.
    Detach { vm: u8 },
    /// A fresh VM attaches with the slot's GID (if the slot is free).
    Reattach { vm: u8 },
    /// The daemon restarts: the mux is rebuilt from its journal (the snapshot plus every
    /// change since) and must hold the same state (then the run goes on with it).
    Restart,
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

pub struct World {
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
    /// What happened how often (verdicts by attribute, retries by state, ...), when
    /// asked for: the property test checks it was not vacuous.
    pub cov: Option<Coverage>,
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
    pub fn new(config: &Config) -> World {
        let clock = ManualClock::new();
        let cfg = MuxConfig {
            policy: Policy::Default,
            seed: config.seed,
            table_bits: config.table_bits,
            default_quota: config
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
            small_quota: config.quota.is_some(),
            journal,
            cov: config.coverage.then(Coverage::new),
        }
    }

    fn tid(&mut self) -> u64 {
        self.next_tid += 1;
        0x7E57_0000_0000_0000 | self.next_tid
    }

    /// Counts `what` in the coverage, if kept.
    fn count(&mut self, what: impl FnOnce() -> String) {
        if let Some(c) = &mut self.cov {
            *c.entry(what()).or_default() += 1;
        }
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

    /// Peer `peer` sends `m` to `dst`; checks the verdict against the model.
    fn wire(&mut self, peer: usize, m: &mut Mad, dst: Gid) -> WireVerdict {
        let before = *m;
        let v = self.wire_checked(peer, m, dst);
        if self.cov.is_some() {
            let name = mad_name(&before, true);
            self.count(|| match v {
                WireVerdict::Reply => format!("wire {name} Reply"),
                WireVerdict::Drop(r) => format!("wire {name} Drop({r:?})"),
                WireVerdict::ToVm(_) => format!("wire {name} ToVm"),
            });
            let pv = raw_view(&before).and_then(|b| b.remote_comm_id());
            if name == "Rtu"
                && matches!(v, WireVerdict::ToVm(_))
                && pv.and_then(|pv| self.mux.lookup(pv)).map(|x| x.0) == Some(State::Established)
            {
                self.count(|| "established (VM passive)".into());
            }
        }
        v
    }

    fn wire_checked(&mut self, peer: usize, m: &mut Mad, dst: Gid) -> WireVerdict {
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
                    AttributeId::Rep => {
                        // A REP retry of an established connection: its RTU again.
                        assert_eq!(r.attr(), AttributeId::Rtu);
                        assert_eq!(r.local_comm_id(), b.remote_comm_id());
                        assert_eq!(r.remote_comm_id(), b.local_comm_id());
                        assert_eq!(r.tid(), b.tid());
                    }
                    AttributeId::Req => {
                        // A VM at quota (NO_RESOURCES), or a retry of a REQ whose VM
                        // detached before answering (the REJ sent then, again).
                        assert_eq!(r.attr(), AttributeId::Rej);
                        assert_eq!(r.remote_comm_id(), b.local_comm_id());
                        assert_eq!(r.tid(), b.tid());
                    }
                    AttributeId::SidrReq if self.small_quota => {
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

    /// VM slot `s` sends `m` to peer `peer`; checks the verdict and learns the
    /// `pv_cm_id` it left with.
    fn guest(&mut self, s: usize, m: &mut Mad, peer: usize) -> GuestVerdict {
        let before = *m;
        let attached = self.slots[s].attached;
        let v = self.guest_checked(s, m, peer);
        if self.cov.is_some() {
            let name = mad_name(&before, false);
            self.count(|| match v {
                _ if !attached => format!("guest {name} from detached VM"),
                GuestVerdict::Reply => format!("guest {name} Reply"),
                GuestVerdict::Drop(r) => format!("guest {name} Drop({r:?})"),
                GuestVerdict::ToWire => format!("guest {name} ToWire"),
            });
            let out = raw_view(m).and_then(|o| o.local_comm_id());
            if name == "Rtu"
                && v == GuestVerdict::ToWire
                && out.and_then(|pv| self.mux.lookup(pv)).map(|x| x.0) == Some(State::Established)
            {
                self.count(|| "established (VM active)".into());
            }
        }
        v
    }

    fn guest_checked(&mut self, s: usize, m: &mut Mad, peer: usize) -> GuestVerdict {
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

    pub fn drain(&mut self) {
        let out: Vec<_> = self.mux.drain_outbox().collect();
        for o in out {
            let m = view(&o.mad);
            let attr = m.attr();
            self.count(|| format!("outbox {attr:?}"));
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

    pub fn check_counts(&self) {
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

    pub fn apply(&mut self, op: &Op) {
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
                self.count(|| {
                    let state = before.map_or("gone".to_string(), |s| format!("{s:?}"));
                    let verdict = match v {
                        GuestVerdict::ToWire if out == pv => "same pv".to_string(),
                        GuestVerdict::ToWire => "new pv".to_string(),
                        v => format!("{v:?}"),
                    };
                    format!("guest Req retry in {state}: {verdict}")
                });
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
                    self.count(|| "detach".into());
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
                self.count(|| "restart".into());
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
                    self.count(|| "reattach".into());
                }
            }
        }
    }

    /// Quiesce: every VM detaches, time runs past every lifetime, nothing is left.
    pub fn finish(&mut self) {
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

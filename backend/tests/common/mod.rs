//! Test harness for the mux: a two-host "wire" that plays the VMs' CMs by script, with
//! the MAD builders of `pvcm_wire::testing` (`req` and `rep` take a VM's configuration).
//! Everything goes through the real `Mux` API.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::time::Duration;

use pvcm_backend::mux::{
    GuestVerdict, ManualClock, Mux, MuxConfig, Policy, VmConfig, VmId, WireVerdict, records,
};
use pvcm_wire::Gid;
use pvcm_wire::mad::AttributeId;
// Each test crate uses part of them.
#[allow(unused_imports)]
pub use pvcm_wire::testing::{LINUX, Mad, ReqParams, dreq, ids, mra, rej, view};

pub fn gid(a: u8, b: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(127, 0, a, b))
}

/// A REQ from the VM `cfg` (its GID and CA GUID) with comm ID `sl`.
pub fn req(cfg: &VmConfig, sl: u32, tid: u64, dst: Gid, qpn: u32, p: &ReqParams) -> Mad {
    pvcm_wire::testing::req_with(cfg.gid, cfg.ca_guid, sl, tid, dst, qpn, p)
}

/// A REP from the VM `cfg` (its CA GUID).
pub fn rep(cfg: &VmConfig, tid: u64, local: u32, remote: u32, qpn: u32) -> Mad {
    pvcm_wire::testing::rep(cfg.ca_guid, tid, local, remote, qpn)
}

/// One host: a mux and its VMs.
pub struct Host {
    pub mux: Mux<ManualClock>,
    pub vms: Vec<(VmId, VmConfig)>,
}

impl Host {
    pub fn new(policy: Policy, seed: u64, clock: &ManualClock) -> Host {
        let cfg = MuxConfig {
            policy,
            seed,
            ..MuxConfig::default()
        };
        Host {
            mux: Mux::new(cfg, clock.clone()),
            vms: Vec::new(),
        }
    }

    pub fn add_vm(&mut self, name: &str, g: Gid) -> usize {
        let cfg = VmConfig::new(name, g);
        let id = self.mux.attach_vm(cfg.clone()).unwrap();
        self.vms.push((id, cfg));
        self.vms.len() - 1
    }

    pub fn id(&self, i: usize) -> VmId {
        self.vms[i].0
    }
    pub fn cfg(&self, i: usize) -> &VmConfig {
        &self.vms[i].1
    }
    pub fn gid(&self, i: usize) -> Gid {
        self.vms[i].1.gid
    }
    pub fn qpn(&self, i: usize, n: u32) -> u32 {
        self.vms[i].1.qpn_base + n
    }
}

/// Two hosts on one wire, sharing a virtual clock.
pub struct Net {
    pub clock: ManualClock,
    pub a: Host,
    pub b: Host,
}

/// One connection from a VM on A (active) to a VM on B (passive).
#[derive(Debug, Clone, Copy)]
pub struct Conn {
    pub av: usize,
    pub bv: usize,
    pub a_sl: u32,
    pub b_sl: u32,
    /// pv_cm_id of A's side on the wire (B's VM sees it as remote comm ID).
    pub a_pv: u32,
    /// pv_cm_id of B's side on the wire.
    pub b_pv: u32,
    pub a_qpn: u32,
    pub b_qpn: u32,
}

impl Net {
    pub fn new(policy: Policy) -> Net {
        let clock = ManualClock::new();
        Net {
            a: Host::new(policy, 0xA, &clock),
            b: Host::new(policy, 0xB, &clock),
            clock,
        }
    }

    pub fn advance(&mut self, d: Duration) {
        self.clock.advance(d);
        self.a.mux.poll();
        self.b.mux.poll();
    }

    /// VM `av` on A sends `m` to VM `bv` on B; returns A's verdict and, if it went on
    /// the wire, B's verdict.
    pub fn a_to_b(
        &mut self,
        av: usize,
        bv: usize,
        m: &mut Mad,
    ) -> (GuestVerdict, Option<WireVerdict>) {
        let (src, dst) = (self.a.gid(av), self.b.gid(bv));
        let v1 = self.a.mux.from_guest(self.a.id(av), m, dst);
        if v1 != GuestVerdict::ToWire {
            return (v1, None);
        }
        (v1, Some(self.b.mux.from_wire(m, src, dst)))
    }

    /// VM `bv` on B sends `m` to VM `av` on A.
    pub fn b_to_a(
        &mut self,
        bv: usize,
        av: usize,
        m: &mut Mad,
    ) -> (GuestVerdict, Option<WireVerdict>) {
        let (src, dst) = (self.b.gid(bv), self.a.gid(av));
        let v1 = self.b.mux.from_guest(self.b.id(bv), m, dst);
        if v1 != GuestVerdict::ToWire {
            return (v1, None);
        }
        (v1, Some(self.a.mux.from_wire(m, src, dst)))
    }

    /// REQ from A's VM `av` (comm ID `a_sl`) to B's VM `bv`, delivered; returns the MAD
    /// as B's VM sees it.
    pub fn send_req(&mut self, av: usize, bv: usize, a_sl: u32, n: u32, p: &ReqParams) -> Mad {
        let mut m = req(
            self.a.cfg(av),
            a_sl,
            0xAAAA_0000_0000_0000 | u64::from(a_sl),
            self.b.gid(bv),
            self.a.qpn(av, n),
            p,
        );
        let v = self.a_to_b(av, bv, &mut m);
        assert_eq!(
            v,
            (GuestVerdict::ToWire, Some(WireVerdict::ToVm(self.b.id(bv))))
        );
        m
    }

    /// A full REQ/REP/RTU handshake.
    pub fn connect(&mut self, av: usize, bv: usize, a_sl: u32, b_sl: u32, n: u32) -> Conn {
        self.connect_with(av, bv, a_sl, b_sl, n, &LINUX)
    }

    pub fn connect_with(
        &mut self,
        av: usize,
        bv: usize,
        a_sl: u32,
        b_sl: u32,
        n: u32,
        p: &ReqParams,
    ) -> Conn {
        let got = self.send_req(av, bv, a_sl, n, p);
        let a_pv = view(&got).local_comm_id().unwrap();
        let (b_qpn, a_qpn) = (self.b.qpn(bv, n), self.a.qpn(av, n));
        let mut m = rep(self.b.cfg(bv), view(&got).tid(), b_sl, a_pv, b_qpn);
        let v = self.b_to_a(bv, av, &mut m);
        assert_eq!(
            v,
            (GuestVerdict::ToWire, Some(WireVerdict::ToVm(self.a.id(av))))
        );
        let rm = view(&m);
        assert_eq!(
            rm.remote_comm_id(),
            Some(a_sl),
            "REP's remote comm ID restored"
        );
        assert_eq!(
            rm.tid(),
            0xAAAA_0000_0000_0000 | u64::from(a_sl),
            "REQ TID restored"
        );
        let b_pv = rm.local_comm_id().unwrap();
        let mut m = ids(AttributeId::Rtu, rm.tid(), a_sl, b_pv);
        let v = self.a_to_b(av, bv, &mut m);
        assert_eq!(
            v,
            (GuestVerdict::ToWire, Some(WireVerdict::ToVm(self.b.id(bv))))
        );
        assert_eq!(view(&m).remote_comm_id(), Some(b_sl));
        Conn {
            av,
            bv,
            a_sl,
            b_sl,
            a_pv,
            b_pv,
            a_qpn,
            b_qpn,
        }
    }

    /// A's VM disconnects: DREQ, then B's VM answers DREP.
    pub fn disconnect_from_a(&mut self, c: &Conn) {
        let mut m = dreq(0xD0 << 32 | u64::from(c.a_sl), c.a_sl, c.b_pv, c.b_qpn);
        let v = self.a_to_b(c.av, c.bv, &mut m);
        assert_eq!(
            v,
            (
                GuestVerdict::ToWire,
                Some(WireVerdict::ToVm(self.b.id(c.bv)))
            )
        );
        let got = view(&m);
        assert_eq!(got.remote_comm_id(), Some(c.b_sl));
        let mut r = ids(AttributeId::Drep, got.tid(), c.b_sl, c.a_pv);
        let v = self.b_to_a(c.bv, c.av, &mut r);
        assert_eq!(
            v,
            (
                GuestVerdict::ToWire,
                Some(WireVerdict::ToVm(self.a.id(c.av)))
            )
        );
        assert_eq!(
            view(&r).tid(),
            0xD0 << 32 | u64::from(c.a_sl),
            "DREQ TID restored"
        );
    }

    pub fn live(&self) -> (u64, u64) {
        (self.a.mux.live_entries(), self.b.mux.live_entries())
    }

    pub fn quarantined(&self) -> (u64, u64) {
        (
            self.a.mux.quarantined_entries(),
            self.b.mux.quarantined_entries(),
        )
    }

    /// Advances time past every protocol window and the quarantine.
    pub fn quiesce(&mut self) {
        for _ in 0..4 {
            self.advance(Duration::from_secs(700));
        }
    }
}

/// Turns the mux's journal on and returns it, starting with a snapshot (as `--state-dir`
/// does at start).
pub fn start_journal(mux: &mut Mux<ManualClock>) -> Vec<u8> {
    let mut journal = Vec::new();
    mux.journal_snapshot(&mut journal);
    mux.enable_journal();
    journal
}

/// A daemon restart in miniature: rebuilds `mux` from `journal` (its snapshot, then
/// every change since), checks the restored state is the live one's, and goes on with
/// the restored mux (journal on, `journal` reset to its snapshot). Returns the VMs it
/// restored as attached, by ID.
pub fn restart_from_journal(
    mux: &mut Mux<ManualClock>,
    journal: &mut Vec<u8>,
    clock: &ManualClock,
) -> Result<Vec<VmId>, String> {
    mux.journal_changes(journal);
    let recs: Vec<(u8, &[u8])> = records(journal)
        .collect::<Result<_, _>>()
        .map_err(|i| format!("journal record {i} torn"))?;
    let restored = Mux::restore(mux.config().clone(), clock.clone(), recs)
        .map_err(|e| format!("restore: {e}"))?;
    mux.same_state_as(&restored.mux)
        .map_err(|e| format!("restored state differs: {e}"))?;
    let attached = restored.attached.iter().map(|(id, _)| *id).collect();
    *mux = restored.mux;
    *journal = start_journal(mux);
    Ok(attached)
}

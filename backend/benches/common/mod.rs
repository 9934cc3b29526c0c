//! Shared setup of the mux benchmarks (`benches/mux.rs`) and the memory example
//! (`examples/mux_memory.rs`): two hosts A and B, a few VMs on each, and N connections
//! established by driving the real REQ -> REP -> RTU handshake through both muxes.
//!
//! Connection `i` runs from A's VM `i % VMS_PER_HOST` to B's VM
//! `(i / VMS_PER_HOST) % VMS_PER_HOST`. Every VM picks its own comm IDs (distinct,
//! scattered over 32 bits like a real CM's) and QPNs in its range. Any unexpected
//! verdict panics: a benchmark of the wrong path is worse than none.

#![allow(dead_code)] // the bench and the example each use part of it

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use pvcm_backend::mux::{GuestVerdict, ManualClock, Mux, MuxConfig, VmConfig, VmId, WireVerdict};
use pvcm_wire::Gid;
use pvcm_wire::cm::{CmRepr, FailoverAccepted, apr, field as cmf, lap, rep, req, rtu};
use pvcm_wire::mad;
use pvcm_wire::testing::{self, LINUX, path};

/// VMs attached to each host.
pub const VMS_PER_HOST: usize = 4;
/// A MAD.
pub type MadBuf = testing::Mad;

/// One host: its mux and its VMs.
#[derive(Debug)]
pub struct Host {
    /// The mux.
    pub mux: Mux<ManualClock>,
    /// The mux's clock (never advanced here: no deadline passes during a run).
    pub clock: ManualClock,
    /// The attached VMs.
    pub vms: Vec<VmId>,
    /// Their configurations, by index.
    pub cfgs: Vec<VmConfig>,
}

impl Host {
    fn new(seed: u64, subnet: u8) -> Host {
        let clock = ManualClock::new();
        let cfg = MuxConfig {
            seed,
            ..MuxConfig::default()
        };
        let mut mux = Mux::new(cfg, clock.clone());
        let mut vms = Vec::new();
        let mut cfgs = Vec::new();
        for j in 0..VMS_PER_HOST {
            let gid = Gid::from_ipv4(Ipv4Addr::new(10, 0, subnet, 1 + j as u8));
            let mut c = VmConfig::new(format!("vm{subnet}.{j}"), gid);
            // A few VMs hold a million connections: lift the per-VM quota.
            c.quota = Some(u32::MAX);
            let id = mux
                .attach_vm(c.clone())
                .unwrap_or_else(|e| panic!("attach {j}: {e}"));
            vms.push(id);
            cfgs.push(c);
        }
        Host {
            mux,
            clock,
            vms,
            cfgs,
        }
    }

    /// GID of VM `j`.
    pub fn gid(&self, j: usize) -> Gid {
        self.cfgs[j].gid
    }
}

/// What the benchmarks need to name one established connection again.
#[derive(Debug, Clone, Copy)]
pub struct Conn {
    /// The A VM's own comm ID.
    pub a_sl: u32,
    /// The A host's `pv_cm_id` for it (what B sees as the remote comm ID).
    pub a_pv: u32,
    /// The B host's `pv_cm_id` (what the A VM sees as the remote comm ID).
    pub b_pv: u32,
    /// Index of the A VM.
    pub a_vm: u8,
    /// Index of the B VM.
    pub b_vm: u8,
}

/// Two hosts and the connections between them.
#[derive(Debug)]
pub struct Testbed {
    /// Host A (the active sides).
    pub a: Host,
    /// Host B (the passive sides).
    pub b: Host,
    /// Connections established so far.
    pub conns: Vec<Conn>,
    /// Mux calls made by the handshakes (6 per connection: 3 MADs through 2 muxes).
    pub mux_calls: u64,
    /// Wall time spent in [`Testbed::establish`] (MAD building included).
    pub setup_time: Duration,
    /// Per VM: comm IDs used so far.
    next_a: [u32; VMS_PER_HOST],
    next_b: [u32; VMS_PER_HOST],
}

/// A distinct, non-zero, scattered comm ID for the `k`-th connection of a VM
/// (multiplication by an odd constant is a bijection of u32).
fn comm_id(k: u32, salt: u32) -> u32 {
    k.wrapping_add(1).wrapping_mul(0x9E37_79B1) ^ salt
}

fn local_comm_id(buf: &MadBuf) -> u32 {
    testing::view(buf)
        .local_comm_id()
        .unwrap_or_else(|| panic!("no local comm ID"))
}

fn remote_comm_id(buf: &MadBuf) -> u32 {
    testing::view(buf)
        .remote_comm_id()
        .unwrap_or_else(|| panic!("no remote comm ID"))
}

/// The TID of a MAD.
pub fn tid(buf: &MadBuf) -> u64 {
    mad::field::TID.get(buf)
}

#[track_caller]
fn expect<V: PartialEq + std::fmt::Debug>(got: V, want: V, what: &str, i: usize) {
    assert_eq!(got, want, "connection {i}: {what}");
}

impl Testbed {
    /// Two hosts with [`VMS_PER_HOST`] VMs each and no connections.
    pub fn new() -> Testbed {
        Testbed {
            a: Host::new(0x0A0A_5EED_0000_0001, 0),
            b: Host::new(0x0B0B_5EED_0000_0002, 1),
            conns: Vec::new(),
            mux_calls: 0,
            setup_time: Duration::ZERO,
            next_a: [0; VMS_PER_HOST],
            next_b: [0; VMS_PER_HOST],
        }
    }

    /// Two hosts with `n` established connections.
    pub fn with_connections(n: usize) -> Testbed {
        let mut t = Testbed::new();
        t.establish(n);
        t
    }

    /// Establishes `n` more connections through the full handshake.
    pub fn establish(&mut self, n: usize) {
        let start = Instant::now();
        self.conns.reserve(n);
        for _ in 0..n {
            let c = self.connect();
            self.conns.push(c);
        }
        self.setup_time += start.elapsed();
    }

    /// One REQ -> REP -> RTU handshake from an A VM to a B VM.
    fn connect(&mut self) -> Conn {
        let i = self.conns.len();
        let (ai, bi) = (i % VMS_PER_HOST, (i / VMS_PER_HOST) % VMS_PER_HOST);
        let (a_vm, b_vm) = (self.a.vms[ai], self.b.vms[bi]);
        let (a_gid, b_gid) = (self.a.gid(ai), self.b.gid(bi));
        let (ka, kb) = (self.next_a[ai], self.next_b[bi]);
        self.next_a[ai] += 1;
        self.next_b[bi] += 1;
        let a_cfg = &self.a.cfgs[ai];
        let b_cfg = &self.b.cfgs[bi];
        let a_sl = comm_id(ka, 0x5A5A_0000 | ai as u32);
        let b_sl = comm_id(kb, 0xA5A5_0000 | bi as u32);
        let a_qpn = a_cfg.qpn_base + ka % a_cfg.qpn_count;
        let b_qpn = b_cfg.qpn_base + kb % b_cfg.qpn_count;
        // REQ from the A VM.
        let r = req::Repr {
            starting_psn: ka & 0x00FF_FFFF,
            private_data: &[],
            ..testing::req_repr(a_gid, a_cfg.ca_guid, a_sl, b_gid, a_qpn)
        };
        let mut buf = testing::mad(0x1000_0000_0000_0000 | u64::from(ka), CmRepr::Req(r));
        expect(
            self.a.mux.from_guest(a_vm, &mut buf, b_gid),
            GuestVerdict::ToWire,
            "REQ A.from_guest",
            i,
        );
        expect(
            self.b.mux.from_wire(&mut buf, a_gid, b_gid),
            WireVerdict::ToVm(b_vm),
            "REQ B.from_wire",
            i,
        );
        let a_pv = local_comm_id(&buf);
        let req_tid = tid(&buf);

        // REP from the B VM.
        let r = rep::Repr {
            local_comm_id: b_sl,
            remote_comm_id: a_pv,
            local_qpn: b_qpn,
            starting_psn: kb & 0x00FF_FFFF,
            responder_resources: 4,
            initiator_depth: 4,
            target_ack_delay: 15,
            failover_accepted: FailoverAccepted::NotSupported,
            end_to_end_flow_control: true,
            rnr_retry_count: 7,
            local_ca_guid: b_cfg.ca_guid,
            ..rep::Repr::default()
        };
        buf = testing::mad(req_tid, CmRepr::Rep(r));
        expect(
            self.b.mux.from_guest(b_vm, &mut buf, a_gid),
            GuestVerdict::ToWire,
            "REP B.from_guest",
            i,
        );
        expect(
            self.a.mux.from_wire(&mut buf, b_gid, a_gid),
            WireVerdict::ToVm(a_vm),
            "REP A.from_wire",
            i,
        );
        assert_eq!(
            remote_comm_id(&buf),
            a_sl,
            "connection {i}: REP not restored"
        );
        let b_pv = local_comm_id(&buf);

        // RTU from the A VM.
        let r = rtu::Repr {
            local_comm_id: a_sl,
            remote_comm_id: b_pv,
            private_data: &[],
        };
        buf = testing::mad(0x2000_0000_0000_0000 | u64::from(ka), CmRepr::Rtu(r));
        expect(
            self.a.mux.from_guest(a_vm, &mut buf, b_gid),
            GuestVerdict::ToWire,
            "RTU A.from_guest",
            i,
        );
        expect(
            self.b.mux.from_wire(&mut buf, a_gid, b_gid),
            WireVerdict::ToVm(b_vm),
            "RTU B.from_wire",
            i,
        );
        self.mux_calls += 6;
        Conn {
            a_sl,
            a_pv,
            b_pv,
            a_vm: ai as u8,
            b_vm: bi as u8,
        }
    }

    /// A LAP template per (A VM, B VM) pair, index `a_vm * VMS_PER_HOST + b_vm`; the
    /// comm IDs are patched per connection with [`patch_lap`].
    pub fn lap_templates(&self) -> Vec<MadBuf> {
        let mut out = Vec::new();
        for ai in 0..VMS_PER_HOST {
            for bi in 0..VMS_PER_HOST {
                let (a_gid, b_gid) = (self.a.gid(ai), self.b.gid(bi));
                let r = lap::Repr {
                    remote_qpn_eecn: self.b.cfgs[bi].qpn_base,
                    remote_cm_response_timeout: LINUX.resp,
                    alternate_path: path(a_gid, b_gid),
                    ..lap::Repr::default()
                };
                out.push(testing::mad(0x3000_0000_0000_0001, CmRepr::Lap(r)));
            }
        }
        out
    }

    /// An APR template per pair, as [`Testbed::lap_templates`].
    pub fn apr_templates(&self) -> Vec<MadBuf> {
        let mut out = Vec::new();
        for _ in 0..VMS_PER_HOST * VMS_PER_HOST {
            // ar_status: Success.
            out.push(testing::mad(0, CmRepr::Apr(apr::Repr::default())));
        }
        out
    }

    /// The upper 32 bits of the TIDs host A gives the LAPs it forwards, learnt from one
    /// LAP of `conns[0]` (host TIDs are `hi << 32 | pv_cm_id`, see `mux::TidSpace`).
    /// An APR carrying `lap_tid_hi << 32 | a_pv` answers that LAP, so A restores the
    /// VM's TID. Checked on `conns[0]`; a mismatch only prints a warning (the APR is
    /// still routed, by comm ID, but the TID-restore branch is not measured).
    pub fn lap_tid_hi(&mut self) -> u32 {
        let c = self.conns[0];
        let laps = self.lap_templates();
        let aprs = self.apr_templates();
        let pair = c.pair();
        let mut buf = laps[pair];
        patch_lap(&mut buf, &c);
        let vm_tid = tid(&buf);
        let (a_vm, b_gid, a_gid) = (
            self.a.vms[c.a_vm as usize],
            self.b.gid(c.b_vm as usize),
            self.a.gid(c.a_vm as usize),
        );
        expect(
            self.a.mux.from_guest(a_vm, &mut buf, b_gid),
            GuestVerdict::ToWire,
            "LAP A.from_guest",
            0,
        );
        let hi = (tid(&buf) >> 32) as u32;
        let mut buf = aprs[pair];
        patch_apr(&mut buf, &c, hi);
        expect(
            self.a.mux.from_wire(&mut buf, b_gid, a_gid),
            WireVerdict::ToVm(a_vm),
            "APR A.from_wire",
            0,
        );
        if tid(&buf) != vm_tid {
            eprintln!(
                "warning: APR TID {:#x} not restored to the VM's LAP TID {vm_tid:#x}",
                tid(&buf)
            );
        }
        hi
    }
}

impl Default for Testbed {
    fn default() -> Self {
        Testbed::new()
    }
}

impl Conn {
    /// Index of the connection's VM pair in the templates.
    pub fn pair(&self) -> usize {
        usize::from(self.a_vm) * VMS_PER_HOST + usize::from(self.b_vm)
    }
}

/// Makes a LAP template the A VM's LAP on `c`.
#[inline]
pub fn patch_lap(buf: &mut MadBuf, c: &Conn) {
    cmf::LOCAL_COMM_ID.set(buf, c.a_sl.into());
    cmf::REMOTE_COMM_ID.set(buf, c.b_pv.into());
}

/// Makes an APR template the B side's answer, on the wire, to A's LAP on `c`.
#[inline]
pub fn patch_apr(buf: &mut MadBuf, c: &Conn, lap_tid_hi: u32) {
    cmf::LOCAL_COMM_ID.set(buf, c.b_pv.into());
    cmf::REMOTE_COMM_ID.set(buf, c.a_pv.into());
    mad::field::TID.set(buf, (u64::from(lap_tid_hi) << 32) | u64::from(c.a_pv));
}

/// A pseudo-random permutation of `0..n` (xorshift-driven Fisher-Yates, fixed seed).
pub fn shuffled(n: usize) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    let mut s: u64 = 0x2545_F491_4F6C_DD1D;
    for i in (1..n).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        let j = (s % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// Resident set size of this process, in bytes (from `/proc/self/statm`).
pub fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

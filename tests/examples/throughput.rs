//! Throughput of one backend against raw loopback UDP, in the same run.
//!
//! 1. Baseline: 280-byte frames from one UDP socket to another on loopback with
//!    `sendmmsg`/`recvmmsg` batches of 64 (the wire port's own calls), a sender and a
//!    receiver thread.
//! 2. Through one backend: VM `a` sends CM MADs (LAPs on established connections, which
//!    the mux rewrites and forwards without creating state) in batches of 64 per kick
//!    to VM `b` on the same backend: a's tx queue, the mux, `sendmmsg`, the host loop's
//!    `recvmmsg`, the mux again, b's rx queue. Both VMs are driven by the lab's
//!    vhost-user frontend and pvcm-guest's split queues.
//!
//! Both runs keep at most `WINDOW` messages in flight, so neither measures drops.
//!
//!     cargo run --release -p pvcm-lab --example throughput [-- MESSAGES]

#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pvcm_lab::backend::{self, LabVmSpec};
use pvcm_lab::lab::scenarios::rate::raw_udp_baseline;
use pvcm_lab::{LabVm, VmOpts};
use pvcm_wire::abi::MsgType;
use pvcm_wire::mad::AttributeId;
use pvcm_wire::testing as mads;

const BATCH: usize = 64;

/// CPU time (user + system) of the whole process so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage fills a plain struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage for the call.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// A run's figures: messages per second of wall time, and CPU time per message.
#[derive(Debug, Clone, Copy)]
struct Run {
    rate: f64,
    cpu_us: f64,
}
const WINDOW: u64 = 1024;

fn baseline(n: u64) -> Run {
    let c0 = cpu_time();
    let dt = raw_udp_baseline(
        Ipv4Addr::new(127, 40, 0, 1),
        Ipv4Addr::new(127, 40, 0, 2),
        n,
    )
    .unwrap();
    Run {
        rate: n as f64 / dt.as_secs_f64(),
        cpu_us: (cpu_time() - c0).as_secs_f64() * 1e6 / n as f64,
    }
}

fn through_backend(n: u64) -> (Run, pvcm_backend::stats::Snapshot) {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", Ipv4Addr::new(127, 41, 0, 1));
    let sb = LabVmSpec::new("b", Ipv4Addr::new(127, 41, 0, 2));
    let mut cfg = backend::config(dir.path(), "h", &[&sa, &sb], 1);
    cfg.rx_backlog_bytes = 4096 * pvcm_backend::backlog::MSG_COST;
    let h = backend::start(cfg);
    let opts = VmOpts {
        queue_size: 1024,
        ..VmOpts::default()
    };
    let mut a = LabVm::connect(&backend::socket(dir.path(), "a"), opts).unwrap();
    let mut b = LabVm::connect(&backend::socket(dir.path(), "b"), opts).unwrap();
    // Establish connections by hand: REQ, REP, RTU.
    let (ca, cb) = (sa.vm_config(), sb.vm_config());
    let conns = 64u32;
    let mut laps = Vec::new();
    for i in 0..conns {
        let a_sl = 0x1000 + i;
        let tid = 0xAA00_0000_0000 | u64::from(i);
        let req = mads::req(sa.gid(), ca.ca_guid, a_sl, tid, sb.gid(), ca.qpn_base + i);
        a.send_mad(sb.gid(), &req).unwrap();
        let m = b
            .recv_type(MsgType::Mad, Duration::from_secs(5))
            .unwrap()
            .mad();
        let a_pv = mads::view(&m).local_comm_id().unwrap();
        let rep = mads::rep(
            cb.ca_guid,
            mads::view(&m).tid(),
            0x2000 + i,
            a_pv,
            cb.qpn_base + i,
        );
        b.send_mad(sa.gid(), &rep).unwrap();
        let m = a
            .recv_type(MsgType::Mad, Duration::from_secs(5))
            .unwrap()
            .mad();
        let b_pv = mads::view(&m).local_comm_id().unwrap();
        a.send_mad(sb.gid(), &mads::rtu(tid, a_sl, b_pv)).unwrap();
        b.recv_type(MsgType::Mad, Duration::from_secs(5)).unwrap();
        laps.push(mads::ids(
            AttributeId::Lap,
            0x1A00_0000 | u64::from(i),
            a_sl,
            b_pv,
        ));
    }
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let (t0, c0) = (Instant::now(), cpu_time());
    let rx = std::thread::spawn(move || {
        let mut total = 0u64;
        while total < n {
            let k = b.recv_count(Duration::from_secs(2)) as u64;
            if k == 0 {
                break;
            }
            total += k;
            g.store(total, Ordering::Release);
        }
        total
    });
    let mut sent = 0u64;
    while sent < n {
        while sent - got.load(Ordering::Acquire) > WINDOW {
            std::thread::sleep(Duration::from_micros(20));
        }
        let k = (n - sent).min(BATCH as u64);
        for j in 0..k {
            let lap = &laps[((sent + j) % u64::from(conns)) as usize];
            a.queue_mad(sb.gid(), lap).unwrap();
        }
        a.kick();
        a.reclaim_tx();
        sent += k;
    }
    let total = rx.join().unwrap();
    let (dt, dc) = (t0.elapsed(), cpu_time() - c0);
    let snap = h.snapshot();
    assert_eq!(total, n, "backend lost MADs:\n{}", snap.render());
    drop(a);
    h.shutdown();
    let run = Run {
        rate: n as f64 / dt.as_secs_f64(),
        cpu_us: dc.as_secs_f64() * 1e6 / n as f64,
    };
    (run, snap)
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    // Warm up both paths, then measure each twice, interleaved.
    let _ = baseline(n / 10);
    let _ = through_backend(n / 10);
    let mut base = Vec::new();
    let mut pvcm = Vec::new();
    let mut snap = None;
    for _ in 0..2 {
        base.push(baseline(n));
        let (r, s) = through_backend(n);
        pvcm.push(r);
        snap = Some(s);
    }
    let best = |v: &[Run]| {
        v.iter().copied().fold(
            Run {
                rate: 0.0,
                cpu_us: f64::MAX,
            },
            |a, r| Run {
                rate: a.rate.max(r.rate),
                cpu_us: a.cpu_us.min(r.cpu_us),
            },
        )
    };
    let (b, p) = (best(&base), best(&pvcm));
    println!("messages per run:                 {n} (best of 2 runs each)");
    println!(
        "raw sendmmsg/recvmmsg loopback:   {:>9.0} frames/s, {:>5.2} us CPU/frame (280 bytes, batches of {BATCH})",
        b.rate, b.cpu_us
    );
    println!(
        "through one pvcm-backend:         {:>9.0} MADs/s,   {:>5.2} us CPU/MAD (VM tx, mux, wire, mux, VM rx)",
        p.rate, p.cpu_us
    );
    println!(
        "ratio backend / raw:              {:>9.2} (rate); {:.2} (CPU per message, raw / backend)",
        p.rate / b.rate,
        b.cpu_us / p.cpu_us
    );
    if let Some(s) = snap {
        let f = &s.host;
        println!(
            "last run: cm_tx_msgs lap {}, cm_rx_msgs lap {}, drops {} (mux) {} (device)",
            f.cm("cm_tx_msgs", "lap"),
            f.cm("cm_rx_msgs", "lap"),
            f.drops.values().sum::<u64>(),
            f.device_drops.values().sum::<u64>()
        );
    }
}

//! `rate`: MAD forwarding throughput through two backends, next to a raw UDP baseline
//! measured in the same run.
//!
//! - Baseline: 280-byte RoCEv2 frames from one loopback UDP socket to another with
//!   `sendmmsg`/`recvmmsg` batches of 64 (the backends' own wire calls, via
//!   `pvcm_backend::port::soft::UdpPort`), a sender and a receiver thread.
//! - Through the backends: VM `a` on host 1 sends CM MADs (LAPs on established
//!   connections, which the mux rewrites and forwards without creating state) in
//!   batches of 64 per kick to VM `b` on host 2: a's tx queue, host 1's mux and
//!   `sendmmsg`, host 2's `recvmmsg` and mux, b's rx queue. The VMs are driven at the
//!   queue level ([`crate::vmm::LabVm`]: vhost-user frontend, memfd memory, pvcm-guest's
//!   split queues) with hand-built MADs, so the figure is the backends', not the CM
//!   agent's; the connections are set up by hand (REQ, REP, RTU through both muxes).
//!
//! Both keep at most 1024 messages in flight, so neither measures drops. Each is run
//! twice, interleaved, after a warm-up; the best of each is kept.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use pvcm_backend::mux::VmConfig;
use pvcm_backend::port::soft::{RecvBatch, UdpPort};
use pvcm_wire::abi::MsgType;
use pvcm_wire::mad::AttributeId;
use pvcm_wire::testing::{self as mads, Mad};

use crate::lab::opts::LabOptions;
use crate::lab::report::Report;
use crate::lab::world::{GATES, LabResult, Outcome, World};
use crate::vmm::{LabVm, VmOpts};

const BATCH: usize = 64;
const WINDOW: u64 = 1024;
const T: Duration = Duration::from_secs(5);

fn baseline(net: u8, n: u64) -> LabResult<f64> {
    let dt = raw_udp_baseline(
        Ipv4Addr::new(127, net, 250, 1),
        Ipv4Addr::new(127, net, 250, 2),
        n,
    )?;
    Ok(n as f64 / dt.as_secs_f64())
}

/// The raw baseline: `n` 280-byte RoCEv2 frames from a socket bound to `from` to one
/// bound to `to` (port 4791), `sendmmsg`/`recvmmsg` batches of 64 through the wire
/// port's own calls, at most 1024 in flight. Returns the wall time it took.
pub fn raw_udp_baseline(from: Ipv4Addr, to: Ipv4Addr, n: u64) -> LabResult<Duration> {
    let a = UdpPort::bind(from, 4791).map_err(|e| format!("baseline socket: {e}"))?;
    let b = UdpPort::bind(to, 4791).map_err(|e| format!("baseline socket: {e}"))?;
    let mad = mads::ids(AttributeId::Lap, 1, 2, 3);
    let frames: Vec<_> = (0..BATCH).map(|_| a.frame(b.local(), &mad)).collect();
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let t0 = Instant::now();
    let rx = std::thread::spawn(move || {
        let mut rb = RecvBatch::default();
        let mut total = 0u64;
        while total < n {
            let k = b.recv_batch(&mut rb).unwrap_or(0) as u64;
            if k == 0 {
                let mut pfd = libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(b.socket()),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd for the call.
                if unsafe { libc::poll(&mut pfd, 1, 1000) } == 0 {
                    break;
                }
                continue;
            }
            total += k;
            g.store(total, Ordering::Release);
        }
        total
    });
    let mut sent = 0u64;
    let give_up = Instant::now() + Duration::from_secs(60);
    while sent < n && Instant::now() < give_up {
        while sent - got.load(Ordering::Acquire) > WINDOW && Instant::now() < give_up {
            // As the VM's sender below: yield, do not spin (2 cores are shared).
            std::thread::yield_now();
        }
        let k = (n - sent).min(BATCH as u64) as usize;
        sent += a.send_batch(&frames[..k]) as u64;
    }
    let total = rx.join().map_err(|_| "baseline receiver panicked")?;
    let dt = t0.elapsed();
    if total != n {
        return Err(format!("baseline lost frames: {total}/{n}"));
    }
    Ok(dt)
}

fn recv_mad(vm: &mut LabVm) -> LabResult<Mad> {
    vm.recv_type(MsgType::Mad, T)
        .map(|m| m.mad())
        .ok_or_else(|| "no MAD within 5 s".to_string())
}

/// Establishes `conns` connections from `a` to `b` by hand; returns a LAP per connection.
fn handshakes(world: &World, a: &mut LabVm, b: &mut LabVm, conns: u32) -> LabResult<Vec<Mad>> {
    let (sa, sb) = (&world.slots[0], &world.slots[1]);
    let (ca, cb) = (
        VmConfig::new(sa.name.clone(), sa.gid()),
        VmConfig::new(sb.name.clone(), sb.gid()),
    );
    let mut laps = Vec::new();
    for i in 0..conns {
        let a_sl = 0x1000 + i;
        let tid = 0xAA00_0000_0000 | u64::from(i);
        let req = mads::req(sa.gid(), ca.ca_guid, a_sl, tid, sb.gid(), ca.qpn_base + i);
        a.send_mad(sb.gid(), &req).map_err(|e| e.to_string())?;
        let m = recv_mad(b)?;
        let v = mads::view(&m);
        let a_pv = v.local_comm_id().ok_or("REQ without a comm ID")?;
        let rep = mads::rep(cb.ca_guid, v.tid(), 0x2000 + i, a_pv, cb.qpn_base + i);
        b.send_mad(sa.gid(), &rep).map_err(|e| e.to_string())?;
        let m = recv_mad(a)?;
        let b_pv = mads::view(&m)
            .local_comm_id()
            .ok_or("REP without a comm ID")?;
        a.send_mad(sb.gid(), &mads::rtu(tid, a_sl, b_pv))
            .map_err(|e| e.to_string())?;
        recv_mad(b)?;
        laps.push(mads::ids(
            AttributeId::Lap,
            0x1A00_0000 | u64::from(i),
            a_sl,
            b_pv,
        ));
    }
    Ok(laps)
}

/// Sends `n` LAPs from `a` to `b`; returns (MADs/s, delivered, b back).
fn through(
    a: &mut LabVm,
    b: LabVm,
    laps: &[Mad],
    dst: pvcm_wire::Gid,
    n: u64,
) -> LabResult<(f64, u64, LabVm)> {
    let got = Arc::new(AtomicU64::new(0));
    let g = got.clone();
    let t0 = Instant::now();
    let rx = std::thread::spawn(move || {
        let mut b = b;
        let mut total = 0u64;
        while total < n {
            let k = b.recv_count(Duration::from_secs(2)) as u64;
            if k == 0 {
                break;
            }
            total += k;
            g.store(total, Ordering::Release);
        }
        (total, b)
    });
    let mut sent = 0u64;
    let give_up = Instant::now() + Duration::from_secs(120);
    while sent < n {
        while sent - got.load(Ordering::Acquire) > WINDOW {
            if rx.is_finished() || Instant::now() > give_up {
                break;
            }
            std::thread::yield_now();
        }
        if rx.is_finished() || Instant::now() > give_up {
            break;
        }
        let k = (n - sent).min(BATCH as u64);
        for j in 0..k {
            let lap = &laps[((sent + j) % laps.len() as u64) as usize];
            a.queue_mad(dst, lap).map_err(|e| e.to_string())?;
        }
        a.kick();
        a.reclaim_tx();
        sent += k;
    }
    let (total, b) = rx.join().map_err(|_| "receiver panicked")?;
    let dt = t0.elapsed();
    Ok((total as f64 / dt.as_secs_f64(), total, b))
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    let n = o.messages.max(1000);
    let world = World::start(o, &[1, 1], None)?;
    let opts = VmOpts {
        queue_size: 1024,
        ..VmOpts::default()
    };
    let mut a = LabVm::connect(&world.slots[0].socket, opts).map_err(|e| format!("VM a: {e}"))?;
    let mut b = LabVm::connect(&world.slots[1].socket, opts).map_err(|e| format!("VM b: {e}"))?;
    let laps = handshakes(&world, &mut a, &mut b, 64)?;
    let dst = world.slots[1].gid();
    // Warm up both paths, then measure each twice, interleaved.
    let _ = baseline(o.net, n / 10)?;
    let (_, _, bb) = through(&mut a, b, &laps, dst, n / 10)?;
    b = bb;
    let mut base = Vec::new();
    let mut pvcm = Vec::new();
    let mut delivered = 0;
    let mut attempted = 0;
    for _ in 0..2 {
        base.push(baseline(o.net, n)?);
        let (r, got, bb) = through(&mut a, b, &laps, dst, n)?;
        b = bb;
        pvcm.push(r);
        delivered += got;
        attempted += n;
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (bl, pv) = (best(&base), best(&pvcm));
    let mut rep = Report::new(o);
    let out: Outcome<()> = Outcome {
        vms: Vec::new(),
        snapshots: world.snapshots(),
        rss_end: world.hosts.iter().map(|h| h.rss_kib()).collect(),
        rss_mid: Vec::new(),
        workload: Duration::ZERO,
        quiesce: Duration::ZERO,
        quiesced: false,
        gates: [None; GATES],
        errors: Vec::new(),
    };
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    rep.figure("messages_per_run", n);
    rep.figure("raw_udp_frames_per_s", bl.round());
    rep.figure("through_backends_mads_per_s", pv.round());
    rep.figure("ratio_backends_to_raw", pv / bl.max(1e-9));
    rep.figure("delivered", delivered);
    rep.table = Some(format!(
        "raw sendmmsg/recvmmsg loopback:  {bl:>12.0} frames/s (280-byte frames, batches of {BATCH})\n\
         through two pvcm-backends:       {pv:>12.0} MADs/s (VM a tx -> mux h1 -> wire -> mux h2 -> VM b rx)\n\
         ratio backends / raw:            {:>12.3}",
        pv / bl.max(1e-9)
    ));
    rep.check(
        "every_mad_delivered",
        delivered == attempted || o.faults.loss > 0.0,
        format!("{delivered}/{attempted} LAPs delivered to VM b"),
    );
    drop(a);
    drop(b);
    world.shutdown();
    Ok(rep)
}

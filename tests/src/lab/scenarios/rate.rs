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
use crate::lab::world::{GATES, LabError, LabResult, Outcome, World};
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
    let a = UdpPort::bind(from.into(), 0, 4791).map_err(LabError::io("baseline socket"))?;
    let b = UdpPort::bind(to.into(), 0, 4791).map_err(LabError::io("baseline socket"))?;
    let mad = mads::ids(AttributeId::Lap, 1, 2, 3);
    let frames: Vec<_> = (0..BATCH)
        .filter_map(|_| a.frame(b.local(), &mad))
        .collect();
    let got = Arc::new(Progress::new());
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
            g.advance(total);
        }
        total
    });
    let mut sent = 0u64;
    let give_up = Instant::now() + Duration::from_secs(60);
    while sent < n && Instant::now() < give_up {
        while sent - got.get() > WINDOW && Instant::now() < give_up {
            got.wait();
        }
        let k = (n - sent).min(BATCH as u64) as usize;
        sent += a.send_batch(&frames[..k]) as u64;
    }
    let total = rx
        .join()
        .map_err(|_| LabError::Panicked("the baseline receiver".into()))?;
    let dt = t0.elapsed();
    if total != n {
        return Err(format!("baseline lost frames: {total}/{n}").into());
    }
    Ok(dt)
}

/// How many messages the receiving thread has counted, and the sending thread that
/// waits for it when its window is full. The sender sleeps (`park`) instead of yielding
/// in a loop: a spinning sender stays runnable and takes CPU time from the backends it
/// measures on a machine with few cores, as a guest driver waiting for its interrupt
/// does not.
struct Progress {
    got: AtomicU64,
    sender: std::thread::Thread,
}

impl Progress {
    /// Counted on the calling (sending) thread's behalf.
    fn new() -> Self {
        Progress {
            got: AtomicU64::new(0),
            sender: std::thread::current(),
        }
    }

    fn get(&self) -> u64 {
        self.got.load(Ordering::Acquire)
    }

    /// On the receiver: `total` counted so far; wakes the sender if it sleeps.
    fn advance(&self, total: u64) {
        self.got.store(total, Ordering::Release);
        self.sender.unpark();
    }

    /// On the sender: sleeps until the receiver advances (or 10 ms pass, so that a
    /// receiver that gave up is noticed).
    fn wait(&self) {
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

fn recv_mad(vm: &mut LabVm) -> LabResult<Mad> {
    vm.recv_type(MsgType::Mad, T)
        .map(|m| m.mad())
        .ok_or_else(|| LabError::Timeout("a MAD within 5 s".to_string()))
}

/// A connection set up by hand: A's comm ID and the comm ID A knows B by.
type Conn = (u32, u32);

/// The LAP of connection `i` (the mux forwards it without creating state).
fn lap(i: usize, c: Conn) -> Mad {
    mads::ids(AttributeId::Lap, 0x1A00_0000 | i as u64, c.0, c.1)
}

/// Connections set up by hand per round trip.
const HANDSHAKE_BATCH: u32 = 256;

/// Establishes connections `first..first + count` from `a` to `b` by hand (REQ, REP,
/// RTU through both muxes, `HANDSHAKE_BATCH` at a time).
fn handshakes(
    world: &World,
    a: &mut LabVm,
    b: &mut LabVm,
    first: u32,
    count: u32,
) -> LabResult<Vec<Conn>> {
    let (sa, sb) = (&world.slots[0], &world.slots[1]);
    let (ca, cb) = (
        VmConfig::new(sa.name.clone(), sa.gid()),
        VmConfig::new(sb.name.clone(), sb.gid()),
    );
    let err = |e: std::io::Error| e.to_string();
    let mut conns = Vec::with_capacity(count as usize);
    let end = first + count;
    let mut i = first;
    while i < end {
        let k = (end - i).min(HANDSHAKE_BATCH);
        for n in i..i + k {
            let tid = 0xAA00_0000_0000 | u64::from(n);
            let qpn = ca.qpn_base + n % ca.qpn_count;
            let req = mads::req(sa.gid(), ca.ca_guid, 0x1000 + n, tid, sb.gid(), qpn);
            a.queue_mad(sb.gid(), &req).map_err(err)?;
        }
        a.kick();
        for n in i..i + k {
            let m = recv_mad(b)?;
            let v = mads::view(&m);
            let a_pv = v.local_comm_id().ok_or("REQ without a comm ID")?;
            let qpn = cb.qpn_base + n % cb.qpn_count;
            let rep = mads::rep(cb.ca_guid, v.tid(), 0x2000 + n, a_pv, qpn);
            b.queue_mad(sa.gid(), &rep).map_err(err)?;
        }
        b.kick();
        for _ in 0..k {
            let m = recv_mad(a)?;
            let v = mads::view(&m);
            let b_pv = v.local_comm_id().ok_or("REP without a comm ID")?;
            let a_sl = v.remote_comm_id().ok_or("REP without a remote comm ID")?;
            a.queue_mad(sb.gid(), &mads::rtu(v.tid(), a_sl, b_pv))
                .map_err(err)?;
            conns.push((a_sl, b_pv));
        }
        a.kick();
        for _ in 0..k {
            recv_mad(b)?;
        }
        a.reclaim_tx();
        b.reclaim_tx();
        i += k;
    }
    Ok(conns)
}

/// Sends `n` LAPs from `a` to `b`, over `conns` in the order `stride` walks them
/// (1: in turn; a large prime: spread over the whole table); returns (MADs/s,
/// delivered, b back).
fn through(
    a: &mut LabVm,
    b: LabVm,
    conns: &[Conn],
    stride: usize,
    dst: pvcm_wire::Gid,
    n: u64,
) -> LabResult<(f64, u64, LabVm)> {
    let got = Arc::new(Progress::new());
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
            g.advance(total);
        }
        (total, b)
    });
    let mut sent = 0u64;
    let give_up = Instant::now() + Duration::from_secs(120);
    while sent < n {
        while sent - got.get() > WINDOW {
            if rx.is_finished() || Instant::now() > give_up {
                break;
            }
            got.wait();
        }
        if rx.is_finished() || Instant::now() > give_up {
            break;
        }
        let k = (n - sent).min(BATCH as u64);
        for j in 0..k {
            let c = ((sent + j) as usize).wrapping_mul(stride) % conns.len();
            a.queue_mad(dst, &lap(c, conns[c]))?;
        }
        a.kick();
        a.reclaim_tx();
        sent += k;
    }
    let (total, b) = rx
        .join()
        .map_err(|_| LabError::Panicked("the receiver".into()))?;
    let dt = t0.elapsed();
    Ok((total as f64 / dt.as_secs_f64(), total, b))
}

/// The better of two [`through`] runs over `conns` spread by a prime stride; returns
/// (MADs/s, delivered in both, b back).
fn best_of_two(
    a: &mut LabVm,
    b: LabVm,
    conns: &[Conn],
    dst: pvcm_wire::Gid,
    n: u64,
) -> LabResult<(f64, u64, LabVm)> {
    let (r1, got1, b) = through(a, b, conns, 7919, dst, n)?;
    let (r2, got2, b) = through(a, b, conns, 7919, dst, n)?;
    Ok((r1.max(r2), got1 + got2, b))
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    let n = o.messages.max(1000);
    let mut wo = o.clone();
    if o.live > 0 {
        // Room for the large table on both VMs.
        wo.quota = Some(o.live.saturating_add(4096));
    }
    let world = World::start(&wo, &[1, 1], None)?;
    let opts = VmOpts {
        queue_size: 1024,
        ..VmOpts::default()
    };
    let mut a = LabVm::connect(&world.slots[0].socket, opts).map_err(|e| format!("VM a: {e}"))?;
    let mut b = LabVm::connect(&world.slots[1].socket, opts).map_err(|e| format!("VM b: {e}"))?;
    let laps = handshakes(&world, &mut a, &mut b, 0, 64)?;
    let dst = world.slots[1].gid();
    // Warm up both paths, then measure each twice, interleaved.
    let _ = baseline(o.net, n / 10)?;
    let (_, _, bb) = through(&mut a, b, &laps, 1, dst, n / 10)?;
    b = bb;
    let mut base = Vec::new();
    let mut pvcm = Vec::new();
    let mut delivered = 0;
    let mut attempted = 0;
    for _ in 0..2 {
        base.push(baseline(o.net, n)?);
        let (r, got, bb) = through(&mut a, b, &laps, 1, dst, n)?;
        b = bb;
        pvcm.push(r);
        delivered += got;
        attempted += n;
    }
    let best = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (bl, pv) = (best(&base), best(&pvcm));
    // The large table: the rate with 1,024 live connections, then with `live`, LAPs
    // spread over every one of them (a prime stride), each the best of two.
    let mut live = None;
    if o.live > 1024 {
        let mut conns = laps.clone();
        conns.extend(handshakes(&world, &mut a, &mut b, 64, 1024 - 64)?);
        let (small, got, bb) = best_of_two(&mut a, b, &conns, dst, n)?;
        b = bb;
        delivered += got;
        attempted += 2 * n;
        let t0 = Instant::now();
        conns.extend(handshakes(&world, &mut a, &mut b, 1024, o.live - 1024)?);
        let setup = t0.elapsed();
        let (large, got, bb) = best_of_two(&mut a, b, &conns, dst, n)?;
        b = bb;
        delivered += got;
        attempted += 2 * n;
        live = Some((small, large, setup));
    }
    let mut rep = Report::new(o);
    let out: Outcome<()> = Outcome {
        vms: Vec::new(),
        snapshots: world.snapshots(),
        rss_end: world.hosts.iter().map(|h| h.rss_kib()).collect(),
        rss_mid: Vec::new(),
        threads_end: world.hosts.iter().map(|h| h.threads()).collect(),
        idle_cpu: Vec::new(),
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
    let mut live_table = String::new();
    if let Some((small, large, setup)) = live {
        rep.figure("live_1k_mads_per_s", small.round());
        rep.figure("live_large_mads_per_s", large.round());
        rep.figure("ratio_large_to_1k", large / small.max(1e-9));
        live_table = format!(
            "\nwith 1,024 live connections:     {small:>12.0} MADs/s (LAPs spread over all)\n\
             with {:>9} live connections: {large:>12.0} MADs/s (set up in {:.1} s)\n\
             ratio large / 1,024:             {:>12.3}",
            o.live,
            setup.as_secs_f64(),
            large / small.max(1e-9)
        );
    }
    rep.table = Some(
        format!(
            "raw sendmmsg/recvmmsg loopback:  {bl:>12.0} frames/s (280-byte frames, batches of {BATCH})\n\
         through two pvcm-backends:       {pv:>12.0} MADs/s (VM a tx -> mux h1 -> wire -> mux h2 -> VM b rx)\n\
         ratio backends / raw:            {:>12.3}",
            pv / bl.max(1e-9)
        ) + &live_table,
    );
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

//! `ipoib-cm` (seed 004): the IPoIB connected-mode pattern. Every pair of VMs on
//! different hosts opens two unidirectional RC connections, one each way: the sending
//! side connects to the service ID `0x1000000000000000 | peer UD QPN` (IPoIB's
//! `IPOIB_CM_IETF_ID`), with IPoIB's private data (its receive QPN and MTU, big-endian),
//! and the receiving side answers with its own. Then every VM of the last host vanishes
//! (its vhost-user session just closes, as when QEMU is killed) and the survivors must
//! get rid of their connections to it: with the default policy the host releases the
//! vanished VM's connections (DREQs on its behalf) at once; without VM cleanup (the
//! legacy policies) the survivors only clean up when their own stale-connection reaper
//! (`--stale-timeout`, as IPoIB's `ipoib_cm_stale_task`) gives up on the idle
//! connections, and the vanished VM's entries stay in its host's cache.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pvcm_guest::cm::{CmId, Event};
use pvcm_guest::device::Notice;
use serde::Serialize;

use crate::lab::guest::GuestVm;
use crate::lab::opts::LabOptions;
use crate::lab::report::Report;
use crate::lab::stamp::{STAMP_LEN, Stamp};
use crate::lab::world::{LabError, LabResult, VmEnv, World, dev_err, flush, run_vms};

/// IPoIB CM's service ID prefix (`IPOIB_CM_IETF_ID`).
pub const IPOIB_CM_IETF_ID: u64 = 0x1000_0000_0000_0000;
/// The MTU IPoIB CM announces (`IPOIB_CM_BUF_SIZE`: 64 KiB - 0x10).
pub const IPOIB_CM_MTU: u32 = 0x10000 - 0x10;

/// The UD QPN of a VM's IPoIB interface: the first QPN of its range.
fn ud_qpn(qpn_base: u32) -> u32 {
    qpn_base
}

/// IPoIB CM private data (`struct ipoib_cm_data`: be32 QPN, be32 MTU) + the lab stamp.
fn ipoib_pd(qpn: u32, s: &Stamp) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + STAMP_LEN);
    v.extend_from_slice(&qpn.to_be_bytes());
    v.extend_from_slice(&IPOIB_CM_MTU.to_be_bytes());
    v.extend_from_slice(&s.to_bytes());
    v
}

fn parse_pd(pd: &[u8]) -> Option<(u32, u32, Stamp)> {
    let q = u32::from_be_bytes(pd.get(0..4)?.try_into().ok()?);
    let m = u32::from_be_bytes(pd.get(4..8)?.try_into().ok()?);
    Some((q, m, Stamp::parse(pd.get(8..)?)?))
}

/// What one VM saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IpoibVm {
    /// Whether it vanished.
    pub vanished: bool,
    /// Connections it opened (tx side).
    pub tx_conns: u64,
    /// Connections it accepted (rx side).
    pub rx_conns: u64,
    /// Connections established (both sides).
    pub established: u64,
    /// Private data that did not carry the peer's QPN and MTU, or a wrong stamp.
    pub bad_private_data: u64,
    /// Survivor: connections ended by the peer's side (DREQ or REJ on behalf of the
    /// vanished VM).
    pub cleaned_by_host: u64,
    /// Survivor: connections its own stale reaper had to tear down.
    pub reaped: u64,
    /// Survivor: from the vanish to its last connection gone (ms).
    pub cleanup_ms: u64,
}

const ESTABLISHED: usize = 0;

fn program(vm: &mut Option<GuestVm>, env: &VmEnv<'_>) -> LabResult<IpoibVm> {
    let o = env.opts;
    let ctl = env.ctl;
    let me = env.slot;
    let last_host = o.hosts - 1;
    let vanishes = me.host == last_host;
    let mut r = IpoibVm::default();
    {
        let Some(g) = vm.as_mut() else {
            return Err("no VM".into());
        };
        let dev = &mut g.dev;
        let my_qpn = ud_qpn(dev.port_info().qpn_base);
        let listen = dev
            .listen(IPOIB_CM_IETF_ID | u64::from(my_qpn))
            .map_err(|e| format!("listen: {e}"))?;
        let peers: Vec<_> = env.slots.iter().filter(|s| s.host != me.host).collect();
        let copts = o.cm.connect_options();
        let mut conns: HashMap<CmId, (usize, bool)> = HashMap::new();
        // Peers' UD QPNs: every backend VM has the default range (0x10000..).
        let peer_qpn = ud_qpn(pvcm_backend::mux::VmConfig::new("x", me.gid()).qpn_base);
        for p in &peers {
            let s = crate::lab::scenarios::stamp(env, p.global, 0, 0, 0, p.global as u32);
            let id = dev
                .connect(
                    p.gid(),
                    IPOIB_CM_IETF_ID | u64::from(peer_qpn),
                    &ipoib_pd(my_qpn, &s),
                    &copts,
                )
                .map_err(|e| format!("connect: {e}"))?;
            conns.insert(id, (p.global, true));
            r.tx_conns += 1;
        }
        let want = 2 * peers.len() as u64;
        let until = Instant::now() + o.phase_timeout;
        let mut arrived = false;
        let mut early: Vec<Event> = Vec::new();
        // Phase 1: every connection established, everywhere.
        loop {
            if ctl.aborted() {
                return Err(LabError::Aborted);
            }
            if Instant::now() > until {
                return Err(LabError::Timeout(format!(
                    "{}: established ({r:?})",
                    me.name
                )));
            }
            dev.wait(Duration::from_millis(2)).map_err(dev_err)?;
            while let Some(n) = dev.pop_notice() {
                let Notice::Cm(ev) = n else { continue };
                match ev {
                    Event::ConnectRequest {
                        id,
                        listen_id,
                        private_data,
                        ..
                    } if listen_id == listen => match parse_pd(&private_data) {
                        Some((q, m, s))
                            if q == peer_qpn
                                && m == IPOIB_CM_MTU
                                && usize::from(s.dst_vm) == me.global =>
                        {
                            let back = crate::lab::scenarios::reply(&s);
                            dev.accept(id, &ipoib_pd(my_qpn, &back))
                                .map_err(|e| format!("accept: {e}"))?;
                            conns.insert(id, (usize::from(s.src_vm), false));
                            r.rx_conns += 1;
                        }
                        _ => {
                            r.bad_private_data += 1;
                            let _ = dev.reject(id, &[]);
                            let _ = dev.destroy(id);
                        }
                    },
                    Event::Established {
                        id, private_data, ..
                    } if conns.contains_key(&id) => {
                        if conns.get(&id).is_some_and(|c| c.1) {
                            // Active side: the REP carries the peer's QPN and MTU.
                            let ok = parse_pd(&private_data)
                                .is_some_and(|(q, m, _)| q == peer_qpn && m == IPOIB_CM_MTU);
                            if !ok {
                                r.bad_private_data += 1;
                            }
                        }
                        r.established += 1;
                        ctl.shared[ESTABLISHED].fetch_add(1, Ordering::AcqRel);
                        ctl.tick(1);
                    }
                    // The peers may vanish before this VM sees the gate open: their
                    // host's DREQs belong to the next phase.
                    e @ (Event::Disconnected { .. }
                    | Event::Rejected { .. }
                    | Event::Unreachable { .. })
                        if arrived =>
                    {
                        early.push(e)
                    }
                    Event::Rejected { id, .. } | Event::Unreachable { id } => {
                        return Err(format!(
                            "{}: connection {id} failed while connecting",
                            me.name
                        )
                        .into());
                    }
                    _ => {}
                }
            }
            if !arrived && r.established >= want {
                ctl.gates[0].arrive();
                arrived = true;
            }
            if arrived && ctl.open(0) {
                break;
            }
        }
        if !vanishes {
            // Survivors: wait for the peers' end (DREQ/REJ on their behalf), or reap.
            let t0 = Instant::now();
            let reap_at = t0 + o.stale_timeout;
            let mut reaping = false;
            let until = t0 + o.phase_timeout;
            while !conns.is_empty() {
                if ctl.aborted() {
                    return Err(LabError::Aborted);
                }
                if Instant::now() > until {
                    return Err(format!("{}: stale connections not gone ({r:?})", me.name).into());
                }
                if !reaping && Instant::now() >= reap_at {
                    reaping = true;
                    // IPoIB's stale task: tear down what saw no traffic since.
                    let ids: Vec<CmId> = conns.keys().copied().collect();
                    for id in ids {
                        if dev.disconnect(id).is_ok() {
                            r.reaped += 1;
                        }
                    }
                }
                dev.wait(Duration::from_millis(5)).map_err(dev_err)?;
                let mut evs: Vec<Event> = std::mem::take(&mut early);
                while let Some(n) = dev.pop_notice() {
                    if let Notice::Cm(ev) = n {
                        evs.push(ev);
                    }
                }
                for ev in evs {
                    let id = ev.id();
                    match ev {
                        Event::Disconnected { .. }
                        | Event::Rejected { .. }
                        | Event::Unreachable { .. } => {
                            if conns.remove(&id).is_some() && !reaping {
                                r.cleaned_by_host += 1;
                            }
                            let _ = dev.disconnect(id);
                            let _ = dev.destroy(id);
                            ctl.tick(1);
                        }
                        _ => {}
                    }
                }
            }
            r.cleanup_ms = t0.elapsed().as_millis() as u64;
            ctl.gates[1].arrive();
        } else {
            flush(dev);
        }
        let _ = dev.destroy(listen);
    }
    if vanishes {
        // The VM dies: no CM goodbye, the vhost-user session closes.
        ctl.members.fetch_sub(1, Ordering::AcqRel);
        r.vanished = true;
        if let Some(g) = vm.take() {
            g.vanish();
        }
    }
    Ok(r)
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("ipoib-cm needs at least 2 hosts".into());
    }
    let layout = vec![o.vms_per_host; o.hosts];
    let world = World::start(o, &layout, None)?;
    let v = o.vms_per_host as u64;
    let h = o.hosts as u64;
    // Connections: 2 per pair of VMs on different hosts.
    let pairs = h * (h - 1) / 2 * v * v;
    let survivors_conns = 2 * v * v * (h - 1);
    let out = run_vms(&world, o, 4 * pairs + survivors_conns, "ipoib-cm", program);
    let mut rep = Report::new(o);
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    let sum = |f: fn(&IpoibVm) -> u64| out.results().map(|(_, r)| f(r)).sum::<u64>();
    let est = sum(|r| r.established);
    let bad = sum(|r| r.bad_private_data);
    let cleaned = sum(|r| r.cleaned_by_host);
    let reaped = sum(|r| r.reaped);
    let vanished = sum(|r| u64::from(r.vanished));
    let cleanup = out
        .results()
        .filter(|(_, r)| !r.vanished)
        .map(|(_, r)| r.cleanup_ms)
        .max()
        .unwrap_or(0);
    let dreq_on_behalf: u64 = rep
        .hosts
        .last()
        .and_then(|hh| hh.backend.as_ref())
        .map_or(0, |s| s.host.cm("cm_tx_msgs", "dreq"));
    rep.time("setup", out.gate(0).unwrap_or_default());
    rep.time("survivor_cleanup", Duration::from_millis(cleanup));
    rep.figure("connections", 2 * pairs);
    rep.figure("established_ends", est);
    rep.figure("vanished_vms", vanished);
    rep.figure("survivor_connections_to_vanished", survivors_conns);
    rep.figure("cleaned_by_vanished_vms_host", cleaned);
    rep.figure("reaped_by_survivors", reaped);
    rep.figure("dreqs_sent_by_vanished_vms_host", dreq_on_behalf);
    rep.check(
        "all_established",
        est == 4 * pairs && bad == 0,
        format!(
            "{est}/{} connection ends established; {bad} with bad IPoIB private data",
            4 * pairs
        ),
    );
    rep.check(
        "host_cleans_up_for_vanished_vm",
        cleaned == survivors_conns && reaped == 0,
        format!(
            "{cleaned}/{survivors_conns} survivor connections ended by the vanished VMs' \
             host, {reaped} left for the survivors' reaper ({} ms)",
            o.stale_timeout.as_millis()
        ),
    );
    rep.check_leaks(&out);
    world.shutdown();
    Ok(rep)
}

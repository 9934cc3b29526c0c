//! `teardown` (seed 000): every process of every VM connects to the process of the same
//! number in every VM of the other hosts (active and passive sides spread evenly), all
//! connections are set up, then all are torn down at once: the active side calls
//! `disconnect()` (a retried DREQ), the passive side answers the DREQ with
//! `disconnect()` + `destroy()` — at once, or `--slow-guest MS` later (a busy guest
//! destroying thousands of QPs). Under the legacy 5 s policy a guest slower than 5 s
//! loses its cache entry before it answers: its DREP is dropped, every DREQ retry too,
//! and the peers retry until they give up (the retry storm). The default policy keeps
//! the entry while the peer may still retry.
//!
//! Full scale as in the seed: `--vms-per-host 16 --procs 64` (16 K connections per host).
//! `--peers N` connects each VM to about N VMs of each other host instead of all of them
//! (many VMs, few connections each).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pvcm_guest::cm::{CmId, Event};
use pvcm_guest::device::Notice;
use serde::Serialize;

use super::{Later, reply, service_id, stamp};
use crate::lab::guest::GuestVm;
use crate::lab::host::VmSlot;
use crate::lab::opts::LabOptions;
use crate::lab::report::Report;
use crate::lab::stamp::Stamp;
use crate::lab::world::{LabError, LabResult, VmEnv, World, dev_err, run_vms};

/// Shared counter: actives done (teardown finished at the active end), all VMs.
const ACTIVES_DONE: usize = 0;
/// Shared counter: actives, all VMs.
const ACTIVES: usize = 1;

/// Whether `a` is the active side of the connection between `a` and `b` for process `p`.
pub fn is_active(a: &VmSlot, b: &VmSlot, p: usize) -> bool {
    (a.host < b.host) == ((a.vm + b.vm + p) % 2 == 0)
}

/// What one VM saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TeardownVm {
    /// Connections this VM opened.
    pub actives: u64,
    /// ... that were established.
    pub established: u64,
    /// ... that failed (rejected, unreachable).
    pub failed: u64,
    /// ... whose teardown finished (DREP received or DREQ retries exhausted).
    pub disconnected: u64,
    /// Connections other VMs were expected to open to this one.
    pub passive_expected: u64,
    /// ... that reached this VM and were established.
    pub passive_established: u64,
    /// ... torn down (DREQ received, DREP sent).
    pub passive_disconnected: u64,
    /// Requests or replies whose stamp named another VM or process.
    pub wrong_vm: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Connecting,
    Established,
    Failed,
    Disconnecting,
    Done,
}

#[derive(Debug)]
struct Conn {
    id: Option<CmId>,
    peer: usize,
    proc: usize,
    serial: u32,
    st: St,
}

#[derive(Debug, Clone, Copy)]
enum Role {
    Active(usize),
    Passive(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Setup,
    SetupWait,
    Teardown,
    TeardownWait,
}

fn program(vm: &mut Option<GuestVm>, env: &VmEnv<'_>) -> LabResult<TeardownVm> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let me = env.slot;
    let ctl = env.ctl;
    let mut listeners: HashMap<CmId, usize> = HashMap::new();
    for p in 0..o.procs {
        let id = dev
            .listen(service_id(p))
            .map_err(|e| format!("listen: {e}"))?;
        listeners.insert(id, p);
    }
    let mut r = TeardownVm::default();
    let mut actives: Vec<Conn> = Vec::new();
    let mut passives: Vec<Conn> = Vec::new();
    let mut roles: HashMap<CmId, Role> = HashMap::new();
    for other in env
        .slots
        .iter()
        .filter(|s| s.host != me.host && o.peered(me.vm, s.vm))
    {
        for p in 0..o.procs {
            if is_active(me, other, p) {
                actives.push(Conn {
                    id: None,
                    peer: other.global,
                    proc: p,
                    serial: actives.len() as u32,
                    st: St::Connecting,
                });
            } else {
                r.passive_expected += 1;
            }
        }
    }
    r.actives = actives.len() as u64;
    ctl.shared[ACTIVES].fetch_add(r.actives, Ordering::AcqRel);
    let copts = o.cm.connect_options();
    for (i, c) in actives.iter_mut().enumerate() {
        let s = stamp(env, c.peer, c.proc, c.proc, 0, c.serial);
        let dst = env.slots[c.peer].gid();
        let id = dev
            .connect(dst, service_id(c.proc), &s.to_bytes(), &copts)
            .map_err(|e| format!("connect: {e}"))?;
        roles.insert(id, Role::Active(i));
        c.id = Some(id);
    }
    let slow = o.is_slow(me.vm);
    let mut later = Later::default();
    let mut phase = Phase::Setup;
    let until = Instant::now() + o.phase_timeout;
    let mut all_done_at: Option<Instant> = None;
    loop {
        if ctl.aborted() {
            return Err(LabError::Aborted);
        }
        if Instant::now() > until {
            return Err(format!(
                "{}: phase {phase:?} not done in {:?} ({r:?})",
                me.name, o.phase_timeout
            )
            .into());
        }
        let now = dev.now();
        let wait = later.wait(now, Duration::from_millis(5));
        dev.wait(wait).map_err(dev_err)?;
        while let Some(n) = dev.pop_notice() {
            let Notice::Cm(ev) = n else { continue };
            match ev {
                Event::ConnectRequest {
                    id,
                    listen_id,
                    remote_gid,
                    private_data,
                    ..
                } => {
                    let lp = listeners.get(&listen_id).copied();
                    let st = Stamp::parse(&private_data);
                    let ok = match (st, lp) {
                        (Some(s), Some(p)) => {
                            s.run == env.run_id
                                && usize::from(s.dst_vm) == me.global
                                && usize::from(s.dst_proc) == p
                                && env
                                    .slots
                                    .get(usize::from(s.src_vm))
                                    .is_some_and(|v| v.gid() == remote_gid)
                        }
                        _ => false,
                    };
                    match (ok, st) {
                        (true, Some(s)) => {
                            dev.accept(id, &reply(&s).to_bytes())
                                .map_err(|e| format!("accept: {e}"))?;
                            roles.insert(id, Role::Passive(passives.len()));
                            passives.push(Conn {
                                id: Some(id),
                                peer: usize::from(s.src_vm),
                                proc: usize::from(s.dst_proc),
                                serial: s.serial,
                                st: St::Connecting,
                            });
                        }
                        _ => {
                            r.wrong_vm += 1;
                            let _ = dev.reject(id, &[]);
                            let _ = dev.destroy(id);
                        }
                    }
                }
                Event::Established {
                    id, private_data, ..
                } => match roles.get(&id) {
                    Some(Role::Active(i)) => {
                        let c = &mut actives[*i];
                        let ok = Stamp::parse(&private_data).is_some_and(|s| {
                            usize::from(s.src_vm) == c.peer
                                && usize::from(s.dst_vm) == me.global
                                && s.serial == c.serial
                                && s.run == env.run_id
                        });
                        if !ok {
                            r.wrong_vm += 1;
                        }
                        if c.st == St::Connecting {
                            c.st = St::Established;
                            r.established += 1;
                            ctl.tick(1);
                        }
                    }
                    Some(Role::Passive(i)) => {
                        let c = &mut passives[*i];
                        if c.st == St::Connecting {
                            c.st = St::Established;
                            r.passive_established += 1;
                        }
                    }
                    None => {}
                },
                Event::Rejected { id, .. } | Event::Unreachable { id } => {
                    match roles.get(&id) {
                        Some(Role::Active(i)) => {
                            let c = &mut actives[*i];
                            if c.st == St::Connecting {
                                c.st = St::Failed;
                                r.failed += 1;
                                ctl.tick(2);
                                ctl.shared[ACTIVES_DONE].fetch_add(1, Ordering::AcqRel);
                            }
                        }
                        Some(Role::Passive(i)) => passives[*i].st = St::Failed,
                        None => {}
                    }
                    let _ = dev.destroy(id);
                }
                Event::Disconnected { id } => match roles.get(&id) {
                    Some(Role::Active(i)) => {
                        let c = &mut actives[*i];
                        if c.st == St::Disconnecting {
                            c.st = St::Done;
                            r.disconnected += 1;
                            ctl.tick(1);
                            ctl.shared[ACTIVES_DONE].fetch_add(1, Ordering::AcqRel);
                        }
                        let _ = dev.destroy(id);
                    }
                    Some(Role::Passive(_)) => {
                        if slow {
                            later.push(now.after(o.slow_guest), id);
                        } else {
                            answer(dev, id, &roles, &mut passives, &mut r);
                        }
                    }
                    None => {
                        let _ = dev.destroy(id);
                    }
                },
                _ => {}
            }
        }
        let now = dev.now();
        while let Some(id) = later.pop_due(now) {
            answer(dev, id, &roles, &mut passives, &mut r);
        }
        match phase {
            Phase::Setup => {
                if actives.iter().all(|c| c.st != St::Connecting) {
                    ctl.gates[0].arrive();
                    phase = Phase::SetupWait;
                }
            }
            Phase::SetupWait => {
                if ctl.open(0) {
                    for c in actives.iter_mut() {
                        if let (St::Established, Some(id)) = (c.st, c.id) {
                            dev.disconnect(id).map_err(|e| format!("disconnect: {e}"))?;
                            c.st = St::Disconnecting;
                        }
                    }
                    phase = Phase::Teardown;
                }
            }
            Phase::Teardown => {
                let mine = actives
                    .iter()
                    .all(|c| matches!(c.st, St::Done | St::Failed));
                let total = ctl.shared[ACTIVES].load(Ordering::Acquire);
                let done = ctl.shared[ACTIVES_DONE].load(Ordering::Acquire);
                if done >= total && all_done_at.is_none() {
                    all_done_at = Some(Instant::now());
                }
                // A passive connection whose every DREQ was lost never hears of the
                // teardown: stop waiting for it a while after every active end is done.
                let give_up = all_done_at.is_some_and(|t| t.elapsed() > o.cm.attempt() * 2);
                let passive_done = r.passive_disconnected >= r.passive_established;
                if mine && later.is_empty() && (passive_done || give_up) {
                    ctl.gates[1].arrive();
                    phase = Phase::TeardownWait;
                }
            }
            Phase::TeardownWait => {
                if ctl.open(1) && later.is_empty() {
                    break;
                }
            }
        }
    }
    for id in listeners.keys() {
        let _ = dev.destroy(*id);
    }
    Ok(r)
}

/// The passive application answers a DREQ: DREP, then destroy.
fn answer(
    dev: &mut crate::lab::guest::LabDevice,
    id: CmId,
    roles: &HashMap<CmId, Role>,
    passives: &mut [Conn],
    r: &mut TeardownVm,
) {
    let _ = dev.disconnect(id);
    let _ = dev.destroy(id);
    if let Some(Role::Passive(i)) = roles.get(&id) {
        let c = &mut passives[*i];
        if c.st == St::Established || c.st == St::Connecting {
            c.st = St::Done;
            r.passive_disconnected += 1;
        }
    }
}

/// Connections per run (each counted once).
pub fn total_connections(o: &LabOptions) -> u64 {
    let h = o.hosts as u64;
    let pairs = h * (h.saturating_sub(1)) / 2;
    let n = o.vms_per_host;
    let peered = (0..n)
        .flat_map(|a| (0..n).map(move |b| (a, b)))
        .filter(|&(a, b)| o.peered(a, b))
        .count() as u64;
    pairs * peered * o.procs as u64
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("teardown needs at least 2 hosts".into());
    }
    let layout = vec![o.vms_per_host; o.hosts];
    let world = World::start(o, &layout, None)?;
    let total = total_connections(o);
    let out = run_vms(&world, o, total * 2, "teardown", program);
    let mut rep = Report::new(o);
    let setup = out.gate(0).unwrap_or_default();
    let teardown = out
        .gate(1)
        .map(|t| t.saturating_sub(setup))
        .unwrap_or_default();
    let sum = |f: fn(&TeardownVm) -> u64| out.results().map(|(_, r)| f(r)).sum::<u64>();
    let (actives, established, failed, disconnected) = (
        sum(|r| r.actives),
        sum(|r| r.established),
        sum(|r| r.failed),
        sum(|r| r.disconnected),
    );
    let (p_exp, p_est, p_dis, wrong) = (
        sum(|r| r.passive_expected),
        sum(|r| r.passive_established),
        sum(|r| r.passive_disconnected),
        sum(|r| r.wrong_vm),
    );
    rep.time("setup", setup);
    rep.time("teardown", teardown);
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    rep.figure("connections", total);
    rep.figure("connections_per_host", total * 2 / o.hosts as u64);
    rep.figure("established", established);
    rep.figure("failed", failed);
    rep.figure("torn_down", disconnected);
    rep.figure(
        "dreq_retries_guests",
        rep.guest_sum("cm_tx_retries", "dreq"),
    );
    rep.figure(
        "dreq_retries_backend",
        rep.backend_sum("cm_tx_retries", "dreq"),
    );
    let dup_g: u64 = rep
        .hosts
        .iter()
        .map(|h| h.guests.total("cm_rx_duplicates"))
        .sum();
    let dup_b: u64 = rep
        .hosts
        .iter()
        .filter_map(|h| h.backend.as_ref())
        .map(|s| {
            s.host
                .cm
                .get("cm_rx_duplicates")
                .map_or(0, |m| m.values().sum::<u64>())
        })
        .sum();
    rep.figure("duplicates_guests", dup_g);
    rep.figure("duplicates_backend", dup_b);
    let drops_mux: u64 = rep
        .hosts
        .iter()
        .filter_map(|h| h.backend.as_ref())
        .map(|s| s.host.drops.values().sum::<u64>())
        .sum();
    let drops_dev: u64 = rep
        .hosts
        .iter()
        .filter_map(|h| h.backend.as_ref())
        .map(|s| s.host.device_drops.values().sum::<u64>())
        .sum();
    let drops_guest: u64 = rep
        .hosts
        .iter()
        .map(|h| h.guests.drops.values().sum::<u64>())
        .sum();
    rep.figure("drops_mux", drops_mux);
    rep.figure("drops_device", drops_dev);
    rep.figure("drops_guests", drops_guest);
    rep.check(
        "all_established",
        actives == total && established == actives && p_est == p_exp && p_exp == total,
        format!(
            "{established}/{actives} active ends established ({failed} failed), \
             {p_est}/{p_exp} passive ends"
        ),
    );
    rep.check(
        "all_torn_down",
        disconnected == established && p_dis == p_est,
        format!("{disconnected}/{established} active ends, {p_dis}/{p_est} passive ends"),
    );
    // DREQs whose DREP never came (the active end gave up after its retries).
    let dreps = rep.guest_sum("cm_rx_msgs", "drep")
        - rep
            .guest_sum("cm_rx_duplicates", "drep")
            .min(rep.guest_sum("cm_rx_msgs", "drep"));
    let unanswered = disconnected.saturating_sub(dreps);
    rep.figure("dreq_unanswered", unanswered);
    rep.check(
        "every_dreq_answered",
        unanswered == 0,
        format!("{unanswered} active ends gave up on their DREQ (no DREP came)"),
    );
    rep.check(
        "no_mad_at_wrong_vm",
        wrong == 0,
        format!("{wrong} requests or replies stamped for another VM or process"),
    );
    rep.check_leaks(&out);
    world.shutdown();
    Ok(rep)
}

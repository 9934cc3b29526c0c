//! `rej-timeout` (seed 002): a VM connects and destroys at once (`rdma_connect()` then
//! `rdma_destroy_id()`), so its CM sends REJ(TIMEOUT) with Remote Comm ID 0 and its CA
//! GUID in the ARI. The passive VM behind the other host must receive it and drop its
//! half-open connection.
//!
//! Layout: host 1 is the passive host with `--vms-per-host` VMs; hosts 2.. are active
//! hosts with one VM each. In round `r` the active VM of host `k` connects to passive VM
//! `(r + k) mod V`, all active VMs at once, then all destroy at once. With `collide` (the
//! default) the active hosts' muxes issue the same comm-ID sequence (the same `--seed`,
//! as mlx4's sequential allocators on two freshly booted hosts do), so in every round the
//! passive host sees the same Local Comm ID from two hosts for two different VMs: the
//! default policy keys REJ(TIMEOUT) by (CA GUID, comm ID) and routes each right; mlx4
//! after 2020 keys it by the comm ID alone (misroutes), before 2020 not at all (losses).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pvcm_guest::cm::{CmId, Event, RejReason};
use pvcm_guest::device::Notice;
use serde::Serialize;

use super::{Later, reply, service_id, stamp};
use crate::lab::guest::GuestVm;
use crate::lab::opts::LabOptions;
use crate::lab::report::Report;
use crate::lab::stamp::Stamp;
use crate::lab::world::{LabError, LabResult, VmEnv, World, dev_err, flush, run_vms};

const CONNECTED: usize = 0;
const DESTROYED: usize = 1;
const ACTIVES_FINISHED: usize = 2;
/// How long the passive application takes to accept.
const ACCEPT_DELAY: Duration = Duration::from_millis(30);

/// What one VM saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RejVm {
    /// Active: connect-and-destroy rounds done.
    pub connects: u64,
    /// Passive: requests expected.
    pub expected: u64,
    /// Passive: requests that arrived.
    pub requests: u64,
    /// Passive: REJ(TIMEOUT) received for its own half-open connection.
    pub delivered: u64,
    /// Passive: half-open connections that never got their REJ (REP retries ran out).
    pub lost: u64,
    /// Passive: other outcomes (a REJ of another reason, established).
    pub other: u64,
    /// Passive: requests whose stamp named another VM.
    pub wrong_vm: u64,
    /// Passive: (round, remote comm ID) of each request, for the collision count.
    pub seen: Vec<(u32, u32)>,
}

fn active(
    vm: &mut Option<GuestVm>,
    env: &VmEnv<'_>,
    k: usize,
    passive_vms: usize,
    n_active: u64,
) -> LabResult<RejVm> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let ctl = env.ctl;
    let copts = o.cm.connect_options();
    let mut r = RejVm::default();
    let wait_all = |dev: &mut crate::lab::guest::LabDevice, c: usize, want: u64| -> LabResult<()> {
        let until = Instant::now() + o.phase_timeout;
        while ctl.shared[c].load(Ordering::Acquire) < want {
            if ctl.aborted() {
                return Err(LabError::Aborted);
            }
            if Instant::now() > until {
                return Err(LabError::Timeout("the round barrier".into()));
            }
            dev.wait(Duration::from_millis(1)).map_err(dev_err)?;
            while dev.pop_notice().is_some() {}
        }
        Ok(())
    };
    for round in 0..o.rounds {
        let target = &env.slots[(round + k) % passive_vms];
        let s = stamp(env, target.global, 0, 0, 0, round as u32);
        let id = dev
            .connect(target.gid(), service_id(0), &s.to_bytes(), &copts)
            .map_err(|e| format!("connect: {e}"))?;
        flush(dev);
        ctl.shared[CONNECTED].fetch_add(1, Ordering::AcqRel);
        wait_all(dev, CONNECTED, (round as u64 + 1) * n_active)?;
        // Let every REQ of the round reach the passive host before any REJ leaves.
        let t = Instant::now() + Duration::from_millis(3);
        while Instant::now() < t {
            dev.wait(Duration::from_millis(1)).map_err(dev_err)?;
        }
        dev.destroy(id).map_err(|e| format!("destroy: {e}"))?;
        flush(dev);
        r.connects += 1;
        ctl.tick(1);
        ctl.shared[DESTROYED].fetch_add(1, Ordering::AcqRel);
        wait_all(dev, DESTROYED, (round as u64 + 1) * n_active)?;
    }
    ctl.shared[ACTIVES_FINISHED].fetch_add(1, Ordering::AcqRel);
    Ok(r)
}

fn passive(
    vm: &mut Option<GuestVm>,
    env: &VmEnv<'_>,
    expected: u64,
    n_active: u64,
) -> LabResult<RejVm> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let ctl = env.ctl;
    let me = env.slot;
    let listen = dev
        .listen(service_id(0))
        .map_err(|e| format!("listen: {e}"))?;
    let mut r = RejVm {
        expected,
        ..RejVm::default()
    };
    let mut mine: HashMap<CmId, u32> = HashMap::new();
    let mut replies: HashMap<CmId, Stamp> = HashMap::new();
    let mut later = Later::default();
    let until = Instant::now() + o.phase_timeout;
    let mut actives_done_at: Option<Instant> = None;
    let grace = o.cm.attempt() * (u32::from(o.cm.retries) + 2) + Duration::from_millis(500);
    loop {
        if ctl.aborted() {
            return Err(LabError::Aborted);
        }
        if Instant::now() > until {
            return Err(LabError::Timeout(format!("{} ({r:?})", me.name)));
        }
        let wait = later.wait(dev.now(), Duration::from_millis(5));
        dev.wait(wait).map_err(dev_err)?;
        while let Some(n) = dev.pop_notice() {
            let Notice::Cm(ev) = n else { continue };
            match ev {
                Event::ConnectRequest {
                    id,
                    listen_id,
                    private_data,
                    ..
                } if listen_id == listen => {
                    r.requests += 1;
                    match Stamp::parse(&private_data) {
                        Some(s) if usize::from(s.dst_vm) == me.global && s.run == env.run_id => {
                            let remote = dev.agent().info(id).map_or(0, |i| i.remote_comm_id);
                            r.seen.push((s.serial, remote));
                            mine.insert(id, s.serial);
                            // The application answers a little later than the active
                            // side destroys (a REJ that arrives first finds REQ_RCVD).
                            later.push(dev.now().after(ACCEPT_DELAY), id);
                            replies.insert(id, reply(&s));
                        }
                        _ => {
                            r.wrong_vm += 1;
                            let _ = dev.destroy(id);
                        }
                    }
                }
                Event::Rejected { id, reason, .. } => {
                    if mine.remove(&id).is_some() {
                        if reason == RejReason::Timeout {
                            r.delivered += 1;
                        } else {
                            r.other += 1;
                        }
                        ctl.tick(1);
                    }
                    let _ = dev.destroy(id);
                }
                Event::Unreachable { id } => {
                    if mine.remove(&id).is_some() {
                        r.lost += 1;
                        ctl.tick(1);
                    }
                    let _ = dev.destroy(id);
                }
                e => {
                    let id = e.id();
                    if mine.remove(&id).is_some() {
                        r.other += 1;
                        ctl.tick(1);
                    }
                    let _ = dev.destroy(id);
                }
            }
        }
        let now = dev.now();
        while let Some(id) = later.pop_due(now) {
            if let (true, Some(s)) = (mine.contains_key(&id), replies.remove(&id)) {
                // Still waiting: no REJ came (it was lost or misrouted).
                let _ = dev.accept(id, &s.to_bytes());
            }
        }
        let settled = r.delivered + r.lost + r.other;
        if ctl.shared[ACTIVES_FINISHED].load(Ordering::Acquire) >= n_active
            && actives_done_at.is_none()
        {
            actives_done_at = Some(Instant::now());
        }
        if settled >= expected && mine.is_empty() {
            break;
        }
        // Requests that never arrived (a lossy wire) are not waited for forever.
        if actives_done_at.is_some_and(|t| t.elapsed() > grace) && mine.is_empty() {
            break;
        }
    }
    let _ = dev.destroy(listen);
    Ok(r)
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("rej-timeout needs at least 2 hosts (1 passive, 1 or more active)".into());
    }
    let v = o.vms_per_host;
    let n_active = o.hosts - 1;
    let mut layout = vec![v];
    layout.extend(std::iter::repeat_n(1, n_active));
    let base = o.seed.wrapping_mul(0x9E37_79B9);
    let seeds: Vec<u64> = (0..o.hosts)
        .map(|h| {
            if h == 0 {
                base ^ 0xB
            } else if o.collide {
                base ^ 0xA
            } else {
                base ^ (0xA0 + h as u64)
            }
        })
        .collect();
    let world = World::start(o, &layout, Some(&seeds))?;
    // Requests each passive VM gets.
    let mut expected = vec![0u64; v];
    for round in 0..o.rounds {
        for k in 1..=n_active {
            expected[(round + k) % v] += 1;
        }
    }
    let total = (o.rounds * n_active) as u64;
    let out = run_vms(&world, o, total * 2, "rej-timeout", |vm, env| {
        if env.slot.host == 0 {
            passive(vm, env, expected[env.slot.vm], n_active as u64)
        } else {
            active(vm, env, env.slot.host, v, n_active as u64)
        }
    });
    let mut rep = Report::new(o);
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    let sum = |f: fn(&RejVm) -> u64| out.results().map(|(_, r)| f(r)).sum::<u64>();
    let connects = sum(|r| r.connects);
    let requests = sum(|r| r.requests);
    let delivered = sum(|r| r.delivered);
    let lost = sum(|r| r.lost);
    let other = sum(|r| r.other);
    let wrong = sum(|r| r.wrong_vm);
    // A REJ(TIMEOUT) that reached a passive VM without a matching connection.
    let misrouted: u64 = rep
        .hosts
        .first()
        .map_or(0, |h| h.guests.dropped("unknown_connection"));
    // Rounds in which two active hosts' REQs carried the same Local Comm ID.
    let mut by_round: HashMap<u32, Vec<u32>> = HashMap::new();
    for (_, r) in out.results() {
        for (round, remote) in &r.seen {
            by_round.entry(*round).or_default().push(*remote);
        }
    }
    let collisions = by_round
        .values()
        .filter(|ids| {
            let mut v: Vec<u32> = ids.to_vec();
            v.sort_unstable();
            v.windows(2).any(|w| w[0] == w[1])
        })
        .count();
    let unanswered = total.saturating_sub(delivered + lost + other);
    // Every half-open connection whose REJ(TIMEOUT) did not reach it: its REP retries
    // ran out, or a later REJ of another reason (the active's CM answering a REP for a
    // connection it no longer has) ended it.
    let not_delivered = total - delivered.min(total);
    rep.time("workload", out.workload);
    rep.figure("connect_destroy", connects);
    rep.figure("requests_at_passive_vms", requests);
    rep.figure("rounds_with_comm_id_collision", collisions as u64);
    rep.figure("rej_timeout_delivered", delivered);
    rep.figure("rej_timeout_lost", not_delivered);
    rep.figure("rej_timeout_misrouted", misrouted);
    rep.figure("other_outcomes", other);
    rep.figure("rej_routed_by_mux", rep.backend_sum("cm_rx_msgs", "rej"));
    // On a faulty wire a REQ or its REJ(TIMEOUT) may be lost for good (the active side
    // destroys at once, so nothing retries them): only misrouting and leaks count then.
    let faults = o.faults.any();
    let lossy = if faults {
        " (not required on a faulty wire)"
    } else {
        ""
    };
    rep.check(
        "all_requests_arrived",
        (connects == total && requests == total || faults) && wrong == 0,
        format!("{connects}/{total} connect+destroy, {requests} requests at the passive VMs, {wrong} at a wrong VM{lossy}"),
    );
    rep.check(
        "rej_timeout_reaches_passive",
        delivered == total && not_delivered == 0 || faults,
        format!(
            "{delivered}/{total} delivered; not delivered: {lost} ended by REP retries, \
             {other} by another REJ, {unanswered} never settled{lossy}"
        ),
    );
    rep.check(
        "no_rej_at_wrong_vm",
        misrouted == 0,
        format!("{misrouted} REJ(TIMEOUT) at a passive VM without that connection"),
    );
    rep.check_leaks(&out);
    world.shutdown();
    Ok(rep)
}

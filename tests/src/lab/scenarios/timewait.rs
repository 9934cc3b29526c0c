//! `timewait-reuse` (seed 001): QPs opened and closed at a high rate, so QPNs recur
//! while their old connections are still in TimeWait.
//!
//! Every VM of host `h` opens `--connections` connections, one after the other, to the
//! VM of the same number on host `h + 1`, cycling through `--qpns` local QPNs; the
//! passive side accepts with its own `--qpns` QPNs, cycled likewise. Each connection is
//! established, disconnected by the active side, and its handle kept until its TimeWait
//! ends (`TimewaitExit`), while the next connections already reuse the QPNs. A REQ or
//! REP that names a remote QPN whose old connection is only in TimeWait is *not* a stale
//! connection (IBTA 12.4.1; the Linux bug of seed 001): 0 REJ(STALE_CONN).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pvcm_guest::cm::{AcceptOptions, CmId, ConnectOptions, Event, RejReason, State};
use pvcm_guest::device::Notice;
use serde::Serialize;

use super::{reply, service_id, stamp};
use crate::lab::guest::GuestVm;
use crate::lab::opts::LabOptions;
use crate::lab::report::Report;
use crate::lab::stamp::Stamp;
use crate::lab::world::{LabError, LabResult, VmEnv, World, dev_err, run_vms};

/// What one VM saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TwVm {
    /// Connections opened.
    pub connects: u64,
    /// ... established.
    pub established: u64,
    /// ... torn down (DREP received).
    pub disconnected: u64,
    /// ... rejected with STALE_CONN.
    pub stale_rejects: u64,
    /// ... failed otherwise.
    pub failed: u64,
    /// Connects whose local QPN's previous connection was still in TimeWait.
    pub reuse_local_in_timewait: u64,
    /// Requests accepted (passive side).
    pub accepted: u64,
    /// Requests whose remote QPN's previous connection here was still in TimeWait.
    pub reuse_remote_in_timewait: u64,
    /// Passive connections torn down (DREQ answered).
    pub passive_disconnected: u64,
    /// Passive connections that ended otherwise (REJ, unreachable).
    pub passive_failed: u64,
    /// Requests stamped for another VM.
    pub wrong_vm: u64,
}

fn program(vm: &mut Option<GuestVm>, env: &VmEnv<'_>) -> LabResult<TwVm> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let me = env.slot;
    let n = o.connections;
    let q = o.qpns.max(1) as u32;
    let base = dev.port_info().qpn_base + 1;
    let listen = dev
        .listen(service_id(0))
        .map_err(|e| format!("listen: {e}"))?;
    let peer = env
        .slots
        .iter()
        .find(|s| s.host == (me.host + 1) % o.hosts && s.vm == me.vm)
        .ok_or("no peer VM")?;
    // Passive requests come from the VM of the same number on the previous host.
    let expected_passive = env
        .slots
        .iter()
        .filter(|s| (s.host + 1) % o.hosts == me.host && s.vm == me.vm)
        .count()
        * n;
    let mut r = TwVm::default();
    let mut cur: Option<(CmId, u32)> = None;
    let mut k = 0usize;
    // Handles kept through TimeWait, by local QPN (active) and remote QPN (passive).
    let mut held_local: HashMap<u32, Vec<CmId>> = HashMap::new();
    let mut held_remote: HashMap<u32, Vec<CmId>> = HashMap::new();
    let mut passive: HashMap<CmId, u32> = HashMap::new();
    let until = Instant::now() + o.phase_timeout;
    let in_timewait = |dev: &crate::lab::guest::LabDevice, ids: Option<&Vec<CmId>>| {
        ids.is_some_and(|v| {
            v.iter()
                .any(|id| dev.agent().state(*id) == Some(State::Timewait))
        })
    };
    loop {
        if env.ctl.aborted() {
            return Err(LabError::Aborted);
        }
        if Instant::now() > until {
            return Err(LabError::Timeout(format!("{} ({r:?})", me.name)));
        }
        if cur.is_none() && k < n {
            let qpn = base + (k as u32 % q);
            if in_timewait(dev, held_local.get(&qpn)) {
                r.reuse_local_in_timewait += 1;
            }
            let s = stamp(env, peer.global, 0, 0, 0, k as u32);
            let opts = ConnectOptions {
                qpn: Some(qpn),
                ..o.cm.connect_options()
            };
            let id = dev
                .connect(peer.gid(), service_id(0), &s.to_bytes(), &opts)
                .map_err(|e| format!("connect: {e}"))?;
            r.connects += 1;
            cur = Some((id, qpn));
        }
        dev.wait(Duration::from_millis(5)).map_err(dev_err)?;
        while let Some(nt) = dev.pop_notice() {
            let Notice::Cm(ev) = nt else { continue };
            let id = ev.id();
            let active = cur.is_some_and(|(c, _)| c == id);
            match ev {
                Event::ConnectRequest {
                    id,
                    listen_id,
                    remote_qpn,
                    private_data,
                    ..
                } if listen_id == listen => {
                    let s = Stamp::parse(&private_data)
                        .filter(|s| usize::from(s.dst_vm) == me.global && s.run == env.run_id);
                    let Some(s) = s else {
                        r.wrong_vm += 1;
                        let _ = dev.destroy(id);
                        continue;
                    };
                    if in_timewait(dev, held_remote.get(&remote_qpn)) {
                        r.reuse_remote_in_timewait += 1;
                    }
                    let local = base + q + (r.accepted as u32 % q);
                    let opts = AcceptOptions {
                        qpn: Some(local),
                        starting_psn: None,
                        ..AcceptOptions::default()
                    };
                    dev.accept_with(id, &reply(&s).to_bytes(), &opts)
                        .map_err(|e| format!("accept: {e}"))?;
                    r.accepted += 1;
                    passive.insert(id, remote_qpn);
                }
                Event::Established { id, .. } if active => {
                    r.established += 1;
                    dev.disconnect(id).map_err(|e| format!("disconnect: {e}"))?;
                }
                Event::Disconnected { id } if active => {
                    // DREP received: TimeWait; the handle is kept until it ends.
                    r.disconnected += 1;
                    let (_, qpn) = cur.take().unwrap_or((id, 0));
                    held_local.entry(qpn).or_default().push(id);
                    k += 1;
                    env.ctl.tick(1);
                }
                Event::Rejected { id, reason, .. } if active => {
                    if reason == RejReason::StaleConn {
                        r.stale_rejects += 1;
                    } else {
                        r.failed += 1;
                    }
                    let _ = dev.destroy(id);
                    cur = None;
                    k += 1;
                    env.ctl.tick(1);
                }
                Event::Unreachable { id } if active => {
                    r.failed += 1;
                    let _ = dev.destroy(id);
                    cur = None;
                    k += 1;
                    env.ctl.tick(1);
                }
                Event::Disconnected { id } if passive.contains_key(&id) => {
                    let _ = dev.disconnect(id);
                    r.passive_disconnected += 1;
                    if let Some(rq) = passive.remove(&id) {
                        held_remote.entry(rq).or_default().push(id);
                    }
                }
                Event::Rejected { id, .. } | Event::Unreachable { id }
                    if passive.contains_key(&id) =>
                {
                    r.passive_failed += 1;
                    passive.remove(&id);
                    let _ = dev.destroy(id);
                }
                Event::TimewaitExit { id } => {
                    let _ = dev.destroy(id);
                    for v in held_local.values_mut().chain(held_remote.values_mut()) {
                        v.retain(|h| *h != id);
                    }
                }
                _ => {}
            }
        }
        let passive_done = (r.passive_disconnected + r.passive_failed) as usize >= expected_passive;
        if k >= n && cur.is_none() && passive_done {
            break;
        }
    }
    let _ = dev.destroy(listen);
    Ok(r)
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("timewait-reuse needs at least 2 hosts".into());
    }
    let layout = vec![o.vms_per_host; o.hosts];
    let world = World::start(o, &layout, None)?;
    let total = (o.hosts * o.vms_per_host * o.connections) as u64;
    let out = run_vms(&world, o, total, "timewait-reuse", program);
    let mut rep = Report::new(o);
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    let sum = |f: fn(&TwVm) -> u64| out.results().map(|(_, r)| f(r)).sum::<u64>();
    let connects = sum(|r| r.connects);
    let est = sum(|r| r.established);
    let dis = sum(|r| r.disconnected);
    let stale = sum(|r| r.stale_rejects);
    let failed = sum(|r| r.failed);
    let reuse_l = sum(|r| r.reuse_local_in_timewait);
    let reuse_r = sum(|r| r.reuse_remote_in_timewait);
    let pdis = sum(|r| r.passive_disconnected);
    let wrong = sum(|r| r.wrong_vm);
    let stale_tx = rep.guest_sum("cm_tx_msgs", "rej");
    rep.time("workload", out.workload);
    rep.figure("connections", connects);
    rep.figure(
        "connections_per_s",
        connects as f64 / out.workload.as_secs_f64().max(1e-9),
    );
    rep.figure("qpns_cycled_per_side", o.qpns as u64);
    rep.figure("local_qpn_reused_in_timewait", reuse_l);
    rep.figure("remote_qpn_recurred_in_timewait", reuse_r);
    rep.figure("stale_conn_rejects", stale);
    rep.figure("rej_sent_by_guests", stale_tx);
    rep.figure("failed_otherwise", failed);
    rep.check(
        "no_stale_conn_reject",
        stale == 0,
        format!("{stale} REJ(STALE_CONN) for QPNs whose old connection was in TimeWait"),
    );
    rep.check(
        "timewait_reuse_exercised",
        reuse_l > 0 && reuse_r > 0,
        format!(
            "{reuse_l} connects reused a local QPN in TimeWait, {reuse_r} requests named a \
             remote QPN in TimeWait"
        ),
    );
    rep.check(
        "all_connected_and_torn_down",
        connects == total && est == total && dis == total && pdis == total && failed == 0,
        format!(
            "{est}/{total} established, {dis} torn down (active), {pdis} (passive), {failed} failed"
        ),
    );
    rep.check(
        "no_mad_at_wrong_vm",
        wrong == 0,
        format!("{wrong} requests stamped for another VM"),
    );
    rep.check_leaks(&out);
    world.shutdown();
    Ok(rep)
}

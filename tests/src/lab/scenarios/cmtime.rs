//! `cmtime`: connection-rate figures between VMs on two hosts, with the guest driver's
//! cmtime ([`pvcm_guest::device::cmtime`], modelled on rdma-core's `cmtime`): VM `i` of
//! host 1 serves, VM `i` of host 2 opens `--connections` connections to it at once,
//! then tears them all down.
//!
//! `server-exit` is the same run with each server exiting right after its last DREP,
//! as `pvcm-guest cmtime --server` does (its device is reset), while the wire loses
//! DREPs: a client whose DREP was lost retries its DREQ towards a VM whose CM is gone,
//! and must still get its DREP (from the server host's mux) instead of timing out.

use std::time::Duration;

use pvcm_guest::device::cmtime::{
    self, ClientOptions, CmtimeReport, DEFAULT_PORT, ServerOptions, ServerReport, Step,
};

use crate::lab::guest::GuestVm;
use crate::lab::opts::{LabOptions, ScenarioName};
use crate::lab::report::Report;
use crate::lab::world::{LabResult, VmEnv, World, dev_err, run_vms};

/// A VM's part.
#[derive(Debug, Clone)]
pub enum Side {
    /// The server's report.
    Server(ServerReport),
    /// The client's report.
    Client(Box<CmtimeReport>),
    /// Neither (a VM on a third host).
    Idle,
}

fn program(vm: &mut Option<GuestVm>, env: &VmEnv<'_>) -> LabResult<Side> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let me = env.slot;
    let n = o.connections as u32;
    match me.host {
        0 => {
            // Announce, then serve (the listen is the server's first call).
            env.ctl.gates[0].arrive();
            let r = cmtime::server(
                dev,
                &ServerOptions {
                    port: DEFAULT_PORT,
                    connections: n,
                    timeout: Some(o.phase_timeout),
                },
            )
            .map_err(dev_err)?;
            env.ctl.tick(u64::from(r.disconnected));
            if o.scenario == ScenarioName::ServerExit {
                // The program exits: its device is reset (the backend releases what the
                // VM held, and nothing in the VM answers any more).
                g.reset_device().map_err(|e| format!("device reset: {e}"))?;
            }
            Ok(Side::Server(r))
        }
        1 => {
            env.ctl.gates[0].arrive();
            env.wait_gate(dev, 0)?;
            // Give the servers a moment to post their listen.
            let _ = dev.run_until(Duration::from_millis(100), |_| false);
            let server = env
                .slots
                .iter()
                .find(|s| s.host == 0 && s.vm == me.vm)
                .ok_or("no server VM")?;
            let r = cmtime::client(
                dev,
                &ClientOptions {
                    dest: server.gid(),
                    port: DEFAULT_PORT,
                    connections: n,
                    timeout: o.phase_timeout,
                    hold: Duration::ZERO,
                    connect: o.cm.connect_options(),
                },
            )
            .map_err(dev_err)?;
            env.ctl.tick(u64::from(r.disconnected));
            Ok(Side::Client(Box::new(r)))
        }
        _ => {
            env.ctl.gates[0].arrive();
            Ok(Side::Idle)
        }
    }
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("cmtime needs 2 hosts".into());
    }
    if o.connections == 0 || o.connections > 60_000 {
        return Err("--connections must be 1 to 60000".into());
    }
    let layout = vec![o.vms_per_host; o.hosts];
    let world = World::start(o, &layout, None)?;
    let pairs = o.vms_per_host as u64;
    let total = pairs * o.connections as u64;
    let out = run_vms(&world, o, 2 * total, "cmtime", program);
    let mut rep = Report::new(o);
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    let clients: Vec<&CmtimeReport> = out
        .results()
        .filter_map(|(_, s)| match s {
            Side::Client(c) => Some(&**c),
            _ => None,
        })
        .collect();
    let servers: Vec<&ServerReport> = out
        .results()
        .filter_map(|(_, s)| match s {
            Side::Server(c) => Some(c),
            _ => None,
        })
        .collect();
    let est: u64 = clients.iter().map(|c| u64::from(c.established)).sum();
    let failed: u64 = clients.iter().map(|c| u64::from(c.failed)).sum();
    let dis: u64 = clients.iter().map(|c| u64::from(c.disconnected)).sum();
    let accepted: u64 = servers.iter().map(|s| u64::from(s.accepted)).sum();
    // Wall time of a step: the slowest client's.
    let step = |s: Step| {
        clients
            .iter()
            .map(|c| c.step(s).total)
            .max()
            .unwrap_or_default()
    };
    let (est_t, dis_t) = (step(Step::Establish), step(Step::Disconnect));
    for s in Step::ALL {
        rep.time(s.name(), step(s));
    }
    rep.figure("connections", total);
    rep.figure("established", est);
    rep.figure("failed", failed);
    rep.figure("disconnected", dis);
    rep.figure("accepted_by_servers", accepted);
    rep.figure(
        "connections_per_s_establish",
        est as f64 / est_t.as_secs_f64().max(1e-9),
    );
    rep.figure(
        "connections_per_s_disconnect",
        dis as f64 / dis_t.as_secs_f64().max(1e-9),
    );
    if let Some(c) = clients.first() {
        rep.table = Some(format!("cmtime (client {}):\n{c}", 1));
    }
    rep.check(
        "all_connected_and_torn_down",
        est == total && dis == total && failed == 0 && accepted == total,
        format!("{est}/{total} established, {dis} torn down, {failed} failed, {accepted} accepted"),
    );
    if o.scenario == ScenarioName::ServerExit {
        server_exit_checks(o, &mut rep, &clients);
    }
    rep.check_leaks(&out);
    world.shutdown();
    Ok(rep)
}

/// server-exit: every client's DREQ got its DREP before its retries ran out, though the
/// servers were gone when the retries of the lost DREPs came.
fn server_exit_checks(o: &LabOptions, rep: &mut Report, clients: &[&CmtimeReport]) {
    let lost = rep.relay.map_or(0, |r| r.lost);
    let retries = rep.guest_sum("cm_tx_retries", "dreq");
    let answered: u64 = rep
        .hosts
        .iter()
        .filter_map(|h| h.backend.as_ref())
        .map(|s| s.host.on_behalf)
        .sum();
    let slowest = clients
        .iter()
        .map(|c| c.step(Step::Disconnect).max)
        .max()
        .unwrap_or_default();
    // A DREQ that nobody answers ends after (retries + 1) attempts: one that took half
    // of that was answered late or not at all.
    let budget = o.cm.attempt() * (u32::from(o.cm.retries) + 1);
    rep.figure("dreps_lost_on_the_wire", lost);
    rep.figure("dreq_retries_guests", retries);
    rep.figure("answered_on_behalf_backends", answered);
    rep.figure("slowest_disconnect_ms", slowest.as_secs_f64() * 1e3);
    rep.figure("dreq_budget_ms", budget.as_secs_f64() * 1e3);
    rep.check(
        "no_dreq_timeout",
        slowest < budget / 2,
        format!(
            "slowest disconnect {:.0} ms of a {:.0} ms DREQ budget; {lost} DREPs lost, {retries} DREQ retries, {answered} MADs answered on the VMs' behalf",
            slowest.as_secs_f64() * 1e3,
            budget.as_secs_f64() * 1e3
        ),
    );
}

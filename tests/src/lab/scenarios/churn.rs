//! `churn` (seed 003): long connect/teardown churn with REJs and abandoned handshakes
//! mixed in. Every process of every VM runs `--rounds` connections one after the other,
//! each to the process of the same number in a VM of another host, each with a plan
//! drawn from the run's seed:
//!
//! | plan | active side | passive side |
//! |---|---|---|
//! | full | connect, established, `disconnect()`, DREP, destroy | accept; DREQ -> DREP |
//! | passive-teardown | connect, established; DREQ -> DREP | accept, established, `disconnect()` |
//! | reject | connect, REJ(CONSUMER_DEFINED) | `reject()` |
//! | abandon-early | connect, destroy at once (REJ(TIMEOUT)) | accept; REJ |
//! | abandon-late | connect without auto-RTU, REP, destroy (REJ) | accept; REJ |
//! | unreachable | connect to an address nobody serves; retries run out | - |
//!
//! After quiesce no mux may hold a live entry and no agent a connection, and the
//! backends' memory must stay flat between the middle and the end of the run.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use pvcm_guest::cm::{CmId, ConnectOptions, Event, RejReason, SplitMix64};
use pvcm_guest::device::Notice;
use pvcm_wire::Gid;
use serde::Serialize;

use super::{reply, service_id, stamp};
use crate::lab::guest::{GuestVm, LabDevice};
use crate::lab::opts::LabOptions;
use crate::lab::relay::Sink;
use crate::lab::report::Report;
use crate::lab::stamp::Stamp;
use crate::lab::world::{LabError, LabResult, VmEnv, World, dev_err, run_vms};

/// The plans, in stamp order.
pub const PLANS: [&str; 6] = [
    "full",
    "passive_teardown",
    "reject",
    "abandon_early",
    "abandon_late",
    "unreachable",
];
const FULL: u8 = 0;
const PASSIVE_TEARDOWN: u8 = 1;
const REJECT: u8 = 2;
const ABANDON_EARLY: u8 = 3;
const ABANDON_LATE: u8 = 4;
const UNREACHABLE: u8 = 5;
/// Weights of the plans (percent).
const WEIGHTS: [u64; 6] = [45, 10, 15, 10, 10, 10];

/// Shared counter: VMs whose processes finished their rounds.
const FINISHED: usize = 0;

/// What one VM saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ChurnVm {
    /// Connections started, per plan.
    pub planned: [u64; 6],
    /// ... that ended as planned at the active side.
    pub as_planned: [u64; 6],
    /// Passive ends finished, per plan.
    pub passive_done: [u64; 6],
    /// Passive ends that ended otherwise than planned.
    pub passive_unexpected: u64,
    /// Examples of unexpected outcomes.
    pub unexpected: Vec<String>,
    /// Requests or replies stamped for another VM or process.
    pub wrong_vm: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Connecting,
    Established,
    Disconnecting,
}

#[derive(Debug)]
struct Cur {
    id: CmId,
    plan: u8,
    serial: u32,
    peer: usize,
    st: St,
}

#[derive(Debug)]
struct Passive {
    plan: u8,
    established: bool,
}

fn pick(rng: &mut SplitMix64) -> u8 {
    let mut x = rng.below(WEIGHTS.iter().sum());
    for (i, w) in WEIGHTS.iter().enumerate() {
        if x < *w {
            return i as u8;
        }
        x -= w;
    }
    FULL
}

struct Vm<'a> {
    env: &'a VmEnv<'a>,
    r: ChurnVm,
    procs: Vec<Option<Cur>>,
    rounds_done: Vec<usize>,
    by_id: HashMap<CmId, usize>,
    passive: HashMap<CmId, Passive>,
    rngs: Vec<SplitMix64>,
    serial: u32,
    peers: Vec<usize>,
    dead: Gid,
}

impl Vm<'_> {
    fn unexpected(&mut self, what: String) {
        if self.r.unexpected.len() < 8 {
            self.r.unexpected.push(what);
        }
    }

    /// Starts process `p`'s next connection.
    fn start(&mut self, dev: &mut LabDevice, p: usize) -> LabResult<()> {
        let env = self.env;
        let round = self.rounds_done[p];
        let plan = pick(&mut self.rngs[p]);
        let peer = self.peers[(round + p + env.slot.vm) % self.peers.len()];
        self.serial += 1;
        let s = stamp(env, peer, p, p, plan, self.serial);
        let dst = if plan == UNREACHABLE {
            self.dead
        } else {
            env.slots[peer].gid()
        };
        let opts = ConnectOptions {
            auto_rtu: plan != ABANDON_LATE,
            ..env.opts.cm.connect_options()
        };
        let id = dev
            .connect(dst, service_id(p), &s.to_bytes(), &opts)
            .map_err(|e| format!("connect: {e}"))?;
        self.r.planned[plan as usize] += 1;
        if plan == ABANDON_EARLY {
            dev.destroy(id).map_err(|e| format!("destroy: {e}"))?;
            self.finish(p, plan, true);
            return Ok(());
        }
        self.by_id.insert(id, p);
        self.procs[p] = Some(Cur {
            id,
            plan,
            serial: self.serial,
            peer,
            st: St::Connecting,
        });
        Ok(())
    }

    fn finish(&mut self, p: usize, plan: u8, ok: bool) {
        if ok {
            self.r.as_planned[plan as usize] += 1;
        }
        self.procs[p] = None;
        self.rounds_done[p] += 1;
        self.env.ctl.tick(1);
    }

    fn end(&mut self, dev: &mut LabDevice, p: usize, ok: bool, what: &str) {
        let Some(c) = self.procs[p].take() else {
            return;
        };
        self.by_id.remove(&c.id);
        let _ = dev.destroy(c.id);
        if !ok {
            self.unexpected(format!(
                "active {} plan {}: {what}",
                c.id, PLANS[c.plan as usize]
            ));
        }
        self.finish(p, c.plan, ok);
    }

    fn active_event(&mut self, dev: &mut LabDevice, p: usize, ev: Event) -> LabResult<()> {
        let Some(c) = self.procs[p].as_mut() else {
            return Ok(());
        };
        let plan = c.plan;
        match (ev, c.st) {
            (Event::Established { private_data, .. }, St::Connecting)
                if plan == FULL || plan == PASSIVE_TEARDOWN =>
            {
                let ok = Stamp::parse(&private_data)
                    .is_some_and(|s| usize::from(s.src_vm) == c.peer && s.serial == c.serial);
                if !ok {
                    self.r.wrong_vm += 1;
                }
                c.st = St::Established;
                if plan == FULL {
                    dev.disconnect(c.id)
                        .map_err(|e| format!("disconnect: {e}"))?;
                    c.st = St::Disconnecting;
                }
            }
            (Event::Disconnected { .. }, St::Disconnecting) if plan == FULL => {
                self.end(dev, p, true, "");
            }
            (Event::Disconnected { id }, St::Established) if plan == PASSIVE_TEARDOWN => {
                let _ = dev.disconnect(id);
                self.end(dev, p, true, "");
            }
            (Event::Rejected { reason, .. }, St::Connecting) if plan == REJECT => {
                let ok = reason == RejReason::ConsumerDefined;
                self.end(dev, p, ok, &format!("rejected {reason}"));
            }
            (Event::ConnectResponse { .. }, St::Connecting) if plan == ABANDON_LATE => {
                self.end(dev, p, true, "");
            }
            (Event::Unreachable { .. }, St::Connecting) if plan == UNREACHABLE => {
                self.end(dev, p, true, "");
            }
            (Event::TimewaitExit { .. }, _) => {}
            (ev, st) => {
                let what = format!("{ev:?} in {st:?}");
                if let Event::Disconnected { id } = ev {
                    let _ = dev.disconnect(id);
                }
                self.end(dev, p, false, &what);
            }
        }
        Ok(())
    }

    fn passive_event(&mut self, dev: &mut LabDevice, ev: Event) -> LabResult<()> {
        let id = ev.id();
        let Some(pc) = self.passive.get_mut(&id) else {
            let _ = dev.destroy(id);
            return Ok(());
        };
        let plan = pc.plan;
        let done = match ev {
            Event::Established { .. } => {
                pc.established = true;
                if plan == PASSIVE_TEARDOWN {
                    dev.disconnect(id).map_err(|e| format!("disconnect: {e}"))?;
                }
                None
            }
            Event::Disconnected { .. } => {
                let _ = dev.disconnect(id);
                Some(plan == FULL || plan == PASSIVE_TEARDOWN)
            }
            Event::Rejected { .. } => Some(plan == ABANDON_EARLY || plan == ABANDON_LATE),
            Event::TimewaitExit { .. } => None,
            _ => Some(false),
        };
        if let Some(ok) = done {
            self.passive.remove(&id);
            let _ = dev.destroy(id);
            if ok {
                self.r.passive_done[plan as usize] += 1;
            } else {
                self.r.passive_unexpected += 1;
                self.unexpected(format!(
                    "passive {id} plan {}: {ev:?}",
                    PLANS[plan as usize]
                ));
            }
        }
        Ok(())
    }

    fn request(
        &mut self,
        dev: &mut LabDevice,
        id: CmId,
        listen_proc: Option<usize>,
        remote: Gid,
        pd: &[u8],
    ) -> LabResult<()> {
        let env = self.env;
        let st = Stamp::parse(pd);
        let ok = match (st, listen_proc) {
            (Some(s), Some(p)) => {
                s.run == env.run_id
                    && usize::from(s.dst_vm) == env.slot.global
                    && usize::from(s.dst_proc) == p
                    && env
                        .slots
                        .get(usize::from(s.src_vm))
                        .is_some_and(|v| v.gid() == remote)
            }
            _ => false,
        };
        let Some(s) = st.filter(|_| ok) else {
            self.r.wrong_vm += 1;
            let _ = dev.reject(id, &[]);
            let _ = dev.destroy(id);
            return Ok(());
        };
        if s.plan == REJECT {
            let _ = dev.reject(id, &reply(&s).to_bytes());
            let _ = dev.destroy(id);
            self.r.passive_done[REJECT as usize] += 1;
            return Ok(());
        }
        self.passive.insert(
            id,
            Passive {
                plan: s.plan,
                established: false,
            },
        );
        // The REJ of an abandoned handshake may already have come: accept then fails,
        // and the Rejected event follows.
        let _ = dev.accept(id, &reply(&s).to_bytes());
        Ok(())
    }
}

fn program(vm: &mut Option<GuestVm>, env: &VmEnv<'_>) -> LabResult<ChurnVm> {
    let Some(g) = vm.as_mut() else {
        return Err("no VM".into());
    };
    let dev = &mut g.dev;
    let o = env.opts;
    let ctl = env.ctl;
    let mut listeners: HashMap<CmId, usize> = HashMap::new();
    for p in 0..o.procs {
        let id = dev
            .listen(service_id(p))
            .map_err(|e| format!("listen: {e}"))?;
        listeners.insert(id, p);
    }
    let peers: Vec<usize> = env
        .slots
        .iter()
        .filter(|s| s.host != env.slot.host)
        .map(|s| s.global)
        .collect();
    let mut st = Vm {
        env,
        r: ChurnVm::default(),
        procs: (0..o.procs).map(|_| None).collect(),
        rounds_done: vec![0; o.procs],
        by_id: HashMap::new(),
        passive: HashMap::new(),
        rngs: (0..o.procs)
            .map(|p| SplitMix64::new(o.seed ^ ((env.slot.global as u64) << 20) ^ p as u64))
            .collect(),
        serial: 0,
        peers,
        dead: Gid::from_ipv4(dead_addr(o)),
    };
    let until = Instant::now() + o.phase_timeout;
    let mut finished = false;
    let mut open_at: Option<Instant> = None;
    let grace = o.cm.attempt() * (u32::from(o.cm.retries) + 2);
    loop {
        if ctl.aborted() {
            return Err(LabError::Aborted);
        }
        if Instant::now() > until {
            return Err(format!(
                "{}: not done in time: rounds {:?}, {} passive pending",
                env.slot.name,
                st.rounds_done,
                st.passive.len()
            )
            .into());
        }
        for p in 0..o.procs {
            if st.procs[p].is_none() && st.rounds_done[p] < o.rounds {
                st.start(dev, p)?;
            }
        }
        dev.wait(Duration::from_millis(5)).map_err(dev_err)?;
        while let Some(n) = dev.pop_notice() {
            let Notice::Cm(ev) = n else { continue };
            if let Event::ConnectRequest {
                id,
                listen_id,
                remote_gid,
                private_data,
                ..
            } = &ev
            {
                let lp = listeners.get(listen_id).copied();
                st.request(dev, *id, lp, *remote_gid, private_data)?;
                continue;
            }
            match st.by_id.get(&ev.id()).copied() {
                Some(p) => st.active_event(dev, p, ev)?,
                None => st.passive_event(dev, ev)?,
            }
        }
        if !finished && st.rounds_done.iter().all(|&n| n >= o.rounds) {
            finished = true;
            ctl.shared[FINISHED].fetch_add(1, Ordering::AcqRel);
        }
        if finished
            && open_at.is_none()
            && ctl.shared[FINISHED].load(Ordering::Acquire) >= ctl.vms as u64
        {
            open_at = Some(Instant::now());
        }
        // Every active end is done everywhere: wait for this VM's passive ends (a lossy
        // wire may leave one without its last MAD for a while).
        if let Some(t) = open_at {
            if st.passive.is_empty() || t.elapsed() > grace {
                break;
            }
        }
    }
    for id in listeners.keys() {
        let _ = dev.destroy(*id);
    }
    let pending = st.passive.len() as u64;
    st.r.passive_unexpected += pending;
    Ok(st.r)
}

/// The address of the host that is down.
fn dead_addr(o: &LabOptions) -> Ipv4Addr {
    Ipv4Addr::new(127, o.net, (o.hosts + 1) as u8, 200)
}

/// Runs the scenario.
pub fn run(o: &LabOptions) -> LabResult<Report> {
    if o.hosts < 2 {
        return Err("churn needs at least 2 hosts".into());
    }
    let layout = vec![o.vms_per_host; o.hosts];
    let world = World::start(o, &layout, None)?;
    // The "unreachable" plan's address: a host that is down (a sink counts its frames).
    let dead = dead_addr(o);
    let ports: Vec<u16> = world.hosts.iter().map(|h| h.spec.bind_port).collect();
    let sink = Sink::start(dead, &ports).map_err(|e| format!("sink {dead}: {e}"))?;
    let total = (o.hosts * o.vms_per_host * o.procs * o.rounds) as u64;
    let out = run_vms(&world, o, total, "churn", program);
    let mut rep = Report::new(o);
    rep.frames_to_down_host = Some(sink.stop());
    let relay = world.relay.as_ref().map(|r| r.stats());
    rep.add_hosts(&world, &out, relay);
    let mut planned = [0u64; 6];
    let mut ok = [0u64; 6];
    let mut pdone = [0u64; 6];
    let (mut punexp, mut wrong) = (0, 0);
    let mut examples = Vec::new();
    for (_, r) in out.results() {
        for i in 0..6 {
            planned[i] += r.planned[i];
            ok[i] += r.as_planned[i];
            pdone[i] += r.passive_done[i];
        }
        punexp += r.passive_unexpected;
        wrong += r.wrong_vm;
        examples.extend(r.unexpected.iter().take(2).cloned());
    }
    rep.time("workload", out.workload);
    rep.figure("connections", planned.iter().sum::<u64>());
    rep.figure(
        "connections_per_s",
        planned.iter().sum::<u64>() as f64 / out.workload.as_secs_f64().max(1e-9),
    );
    for (i, name) in PLANS.iter().enumerate() {
        rep.figure(
            &format!("plan_{name}"),
            format!("{}/{} as planned", ok[i], planned[i]),
        );
    }
    let unexpected_active: u64 = planned.iter().sum::<u64>() - ok.iter().sum::<u64>();
    rep.figure("unexpected_active_ends", unexpected_active);
    rep.figure("unexpected_passive_ends", punexp);
    for e in examples.iter().take(6) {
        rep.note(format!("unexpected: {e}"));
    }
    let faults = o.faults.any();
    rep.check(
        "expected_end_states",
        (unexpected_active == 0 && punexp == 0) || faults,
        format!(
            "{unexpected_active} active and {punexp} passive ends not as planned{}",
            if faults {
                " (not required on a faulty wire: a lost REQ may end a plan early)"
            } else {
                ""
            }
        ),
    );
    rep.check(
        "no_mad_at_wrong_vm",
        wrong == 0,
        format!("{wrong} requests or replies stamped for another VM or process"),
    );
    rep.check_leaks(&out);
    // Memory: the backends' RSS from the middle of the run to its end.
    let mut growth = Vec::new();
    let mut flat = true;
    for (h, host) in world.hosts.iter().enumerate() {
        let mid = out.rss_mid.get(h).copied().flatten();
        let end = out.rss_end.get(h).copied().flatten();
        if let (Some(m), Some(e)) = (mid, end) {
            // Allow 25% + 8 MiB (allocator slack, quarantine filling up in short runs).
            flat &= e <= m + m / 4 + 8 * 1024;
            growth.push(format!("{} {m}->{e} KiB", host.spec.name));
        }
    }
    rep.figure("backend_rss_mid_to_end", growth.join(", "));
    rep.check("memory_flat", flat, growth.join(", "));
    world.shutdown();
    Ok(rep)
}

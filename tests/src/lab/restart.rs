//! `pvcm-lab restart`: a backend killed (or stopped) and started again with the same
//! options under established connections loses none of them.
//!
//! Two hosts (real backend processes). Host 2 runs `--vms` VMs with `--state-dir`; host
//! 1 runs as many peer VMs. VM `i` opens `connections / vms` connections to peer `i`
//! (and, on VM 1, ten more to a service nobody listens on: their REJs leave IDs in
//! quarantine). Then host 2 is killed with SIGKILL (`--mode kill`, a crash) or stopped
//! with SIGTERM (`--mode term`, a clean stop or an upgrade) and started again with the
//! same command line; its VMs reconnect on new vhost-user sessions, as QEMU's
//! `reconnect-ms` does, resuming their rings at the used index in guest memory. While
//! host 2 is down, the last peer disconnects all its connections: those DREQs are lost
//! like any UD datagram and must be recovered by the peer's normal retries. After the
//! restart the connections are torn down from both sides: VM-side DREQs on even pairs,
//! peer-side on odd ones.
//!
//! It reports and checks: every connection established before and torn down after, with
//! every DREQ answered by a DREP (0 failed), the restored host's live and quarantined
//! entries equal to what it held before, 0 live entries on both hosts at the end, and
//! the backends' drops. With `--cost-connections N` it also measures what the journal
//! costs: cmtime rates of a VM on a backend with `--state-dir` and one without, against
//! the same server, alternating, in one run.
//!
//! ```text
//! cargo run --release -p pvcm-lab -- restart [--connections 1000] [--mode kill]
//! ```

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use pvcm_backend::stats::Snapshot;
use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_guest::cm::{CmId, ConnectOptions, Event, Group};
use pvcm_guest::device::Notice;
use pvcm_guest::device::cmtime::{self, ClientOptions, ServerOptions, Step};
use pvcm_wire::Gid;
use pvcm_wire::mad::AttributeId;

use super::error::{LabError, LabResult};
use super::guest::{GuestVm, LabDevice};
use super::host::{HostProc, HostSpec, VmSlot};
use super::standalone::{self, Phases, big_guest};

/// Drops by reason (only those that happened).
pub type Drops = Vec<(String, u64)>;

/// How the backend goes down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// SIGKILL: a crash; nothing is saved at the end.
    Kill,
    /// SIGTERM: a clean stop (or an upgrade: a new binary started over the same state).
    Term,
}

/// `pvcm-lab restart` options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-lab restart",
    about = "Kill (or stop) a backend under established connections, start it again, \
             tear the connections down"
)]
pub struct RestartCli {
    /// Connections, spread over the VMs.
    #[arg(long, default_value_t = 1000)]
    pub connections: u32,
    /// VMs on the restarted backend (and peers on the other).
    #[arg(long, default_value_t = 4)]
    pub vms: usize,
    /// How the backend goes down.
    #[arg(long, value_enum, default_value_t = Mode::Kill)]
    pub mode: Mode,
    /// Second octet of the hosts' loopback addresses (127.N.H.V).
    #[arg(long, default_value_t = 83)]
    pub net: u8,
    /// Also measure the journal's cost: cmtime with this many connections, on a backend
    /// with --state-dir and one without (0: skip).
    #[arg(long, default_value_t = 0)]
    pub cost_connections: u32,
    /// Runs of each kind for the cost measurement.
    #[arg(long, default_value_t = 3)]
    pub cost_rounds: u32,
}

/// One VM's (or peer's) figures.
#[derive(Debug, Clone, Default)]
pub struct Side {
    /// Connections established.
    pub established: u32,
    /// Connections reported disconnected.
    pub disconnected: u32,
    /// DREQs this side started (one per connection it tore down).
    pub dreqs: u32,
    /// DREPs it received (answers to its DREQs).
    pub dreps: u64,
    /// DREQ retries it sent.
    pub dreq_retries: u64,
    /// REJs received for the quarantine probes.
    pub rejected: u32,
}

/// What the run measured.
#[derive(Debug, Clone, Default)]
pub struct RestartReport {
    /// Options.
    pub connections: u32,
    /// VMs per host.
    pub vms: usize,
    /// How the backend went down.
    pub mode: Option<Mode>,
    /// The restarted host's (live, quarantined) entries before it went down.
    pub before: (u64, u64),
    /// ... and right after it came back (before its VMs reconnected).
    pub restored: (u64, u64),
    /// VMs the restarted host showed attached right after it came back.
    pub restored_attached: usize,
    /// Kill to ready again, ms.
    pub gap_ms: f64,
    /// Ready again to every VM reconnected, ms.
    pub reconnect_ms: f64,
    /// The restarted host's VMs.
    pub vm: Side,
    /// The peers.
    pub peer: Side,
    /// Live entries at the end on (restarted host, peer host).
    pub leaked: (u64, u64),
    /// Drops on the restarted host after the restart, and on the peer host.
    pub drops: (Drops, Drops),
    /// The journal's size at the end, bytes.
    pub journal_bytes: u64,
    /// The journal's cost: cmtime connections/s with --state-dir and without.
    pub cost: Option<(Vec<f64>, Vec<f64>)>,
}

fn sum(a: &mut Side, b: &Side) {
    a.established += b.established;
    a.disconnected += b.disconnected;
    a.dreqs += b.dreqs;
    a.dreps += b.dreps;
    a.dreq_retries += b.dreq_retries;
    a.rejected += b.rejected;
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

impl RestartReport {
    /// Every check, with its verdict: (name, passed, detail).
    pub fn checks(&self) -> Vec<(&'static str, bool, String)> {
        let n = self.connections;
        vec![
            (
                "all established before, torn down after",
                self.vm.established == n
                    && self.peer.established == n
                    && self.vm.disconnected == n
                    && self.peer.disconnected == n,
                format!(
                    "VMs {}/{} established, {} torn down; peers {}/{} established, {} torn down",
                    self.vm.established,
                    n,
                    self.vm.disconnected,
                    self.peer.established,
                    n,
                    self.peer.disconnected
                ),
            ),
            (
                "every DREQ answered (0 failed)",
                u64::from(self.vm.dreqs) == self.vm.dreps
                    && u64::from(self.peer.dreqs) == self.peer.dreps,
                format!(
                    "VMs {} DREQs {} DREPs; peers {} DREQs {} DREPs",
                    self.vm.dreqs, self.vm.dreps, self.peer.dreqs, self.peer.dreps
                ),
            ),
            (
                "state restored",
                self.restored.0 + self.restored.1 == self.before.0 + self.before.1
                    && self.restored.0 >= u64::from(n)
                    && self.restored_attached == self.vms,
                format!(
                    "live {} quarantined {} before; {} and {} restored, {} VMs attached",
                    self.before.0,
                    self.before.1,
                    self.restored.0,
                    self.restored.1,
                    self.restored_attached
                ),
            ),
            (
                "quarantine kept",
                self.before.1 >= 10 && self.restored.1 >= self.before.1,
                format!(
                    "{} quarantined before, {} after",
                    self.before.1, self.restored.1
                ),
            ),
            (
                "no entry leaked",
                self.leaked == (0, 0),
                format!("live at the end: {:?}", self.leaked),
            ),
            (
                "nothing dropped or misrouted by either backend",
                self.drops.0.is_empty() && self.drops.1.is_empty(),
                format!(
                    "restarted host {:?}, peer host {:?}",
                    self.drops.0, self.drops.1
                ),
            ),
        ]
    }

    /// True when every check passed.
    pub fn passed(&self) -> bool {
        self.checks().iter().all(|c| c.1)
    }

    /// The summary.
    pub fn render(&self) -> String {
        let mut o = format!(
            "restart ({:?}) of a backend with {} VMs and {} connections to {} peers on \
             another backend\n",
            self.mode.unwrap_or(Mode::Kill),
            self.vms,
            self.connections,
            self.vms
        );
        o.push_str(&format!(
            "down and up again in {:.0} ms; every VM reconnected {:.0} ms later\n",
            self.gap_ms, self.reconnect_ms
        ));
        o.push_str(&format!(
            "DREQ retries: VMs {}, peers {} (the peers' DREQs sent while the backend was \
             down are recovered by these)\n",
            self.vm.dreq_retries, self.peer.dreq_retries
        ));
        let d = |v: &[(String, u64)]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.iter()
                    .map(|(k, n)| format!("{k} {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        };
        o.push_str(&format!(
            "drops: restarted host {}; peer host {}\n",
            d(&self.drops.0),
            d(&self.drops.1)
        ));
        o.push_str(&format!(
            "journal at the end: {} bytes\n",
            self.journal_bytes
        ));
        if let Some((on, off)) = &self.cost {
            let (a, b) = (median(on), median(off));
            o.push_str(&format!(
                "journal cost: cmtime {a:.0} conn/s with --state-dir, {b:.0} without \
                 (medians of {} runs each, alternating): {:.2}x (bar: >= 0.8x)\n",
                on.len(),
                if b > 0.0 { a / b } else { 0.0 }
            ));
        }
        super::render_checks(&mut o, &self.checks());
        o
    }
}

/// Runs `pvcm-lab restart ARGS` (`args` after `restart`).
pub fn main<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    super::command_main(
        "pvcm-lab restart",
        args,
        run,
        RestartReport::render,
        |_: &RestartCli, r: &RestartReport| r.passed(),
        "a check failed",
    )
}

fn spec(dir: &Path, index: usize, vms: Vec<VmSlot>, state: Option<PathBuf>) -> HostSpec {
    let mut h = HostSpec::standalone(dir, index, vms, 0x5e57_a270 + index as u64);
    if let Some(s) = state {
        h.extra = vec!["--state-dir".to_string(), s.display().to_string()];
    }
    h
}

/// The run's phases (see [`Phases`]).
type RunPhases = Phases<6>;

const LISTENING: u32 = 0;
const ESTABLISHED: u32 = 1;
const DOWN: u32 = 2;
const UP: u32 = 3;
const RECONNECTED: u32 = 4;

const SERVICE_PORT: u16 = 18515;
/// A port nobody listens on: REQs to it are rejected, and their IDs go to quarantine.
const NOBODY_PORT: u16 = 18516;
const PROBES: u32 = 10;

/// Handles the notices every program handles the same way; returns what it saw.
fn drain(dev: &mut LabDevice, s: &mut Side, conns: &mut Vec<CmId>, listen: Option<CmId>) {
    while let Some(n) = dev.pop_notice() {
        match n {
            Notice::Cm(Event::ConnectRequest { id, listen_id, .. })
                if Some(listen_id) == listen =>
            {
                let _ = dev.accept(id, &[]);
            }
            Notice::Cm(Event::Established { id, .. }) => {
                s.established += 1;
                conns.push(id);
            }
            Notice::Cm(Event::Disconnected { id }) => {
                s.disconnected += 1;
                let _ = dev.destroy(id);
            }
            Notice::Cm(Event::Rejected { id, .. }) => {
                s.rejected += 1;
                let _ = dev.destroy(id);
            }
            Notice::Cm(Event::Unreachable { id }) => {
                let _ = dev.destroy(id);
            }
            _ => {}
        }
    }
}

/// A thread's result: its figures, and its VM, kept alive until the run's figures are
/// taken (a VM that went away would make its backend release things on its behalf).
type Done = (Side, GuestVm);

/// Disconnects every connection in `conns` (one DREQ each, counted in `s`).
fn disconnect_all(dev: &mut LabDevice, conns: &[CmId], s: &mut Side) -> LabResult<()> {
    for id in conns {
        dev.disconnect(*id)?;
        s.dreqs += 1;
    }
    Ok(())
}

fn finish(mut g: GuestVm, mut s: Side) -> Done {
    let _ = g.dev.flush(Duration::from_millis(200));
    let c = g.dev.agent().counters();
    s.dreps = c.get(Group::RxMsgs, AttributeId::Drep);
    s.dreq_retries = c.get(Group::TxRetries, AttributeId::Dreq);
    (s, g)
}

/// A peer: listens, accepts `n`, tears down when its role says so, until `n` are gone.
fn peer(
    socket: PathBuf,
    n: u32,
    role: Role,
    ph: Arc<RunPhases>,
    until: Instant,
) -> LabResult<Done> {
    let mut g = big_guest(&socket, 0x9e_e700 + n as u64)?;
    let dev = &mut g.dev;
    let listen = dev.listen(tcp_service_id(SERVICE_PORT))?;
    ph.arrive(LISTENING);
    let mut s = Side::default();
    let mut conns = Vec::new();
    dev.run_until(until.saturating_duration_since(Instant::now()), |d| {
        drain(d, &mut s, &mut conns, Some(listen));
        s.established >= n
    })?;
    ph.arrive(ESTABLISHED);
    ph.wait(dev, DOWN, until)?;
    if role == Role::PeerDuringGap {
        disconnect_all(dev, &conns, &mut s)?;
    }
    ph.wait(dev, RECONNECTED, until)?;
    if role == Role::Peer {
        disconnect_all(dev, &conns, &mut s)?;
    }
    dev.run_until(until.saturating_duration_since(Instant::now()), |d| {
        drain(d, &mut s, &mut conns, Some(listen));
        s.disconnected >= n
    })?;
    Ok(finish(g, s))
}

/// Which side tears a pair's connections down, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The VM, after the restart.
    Vm,
    /// The peer, after the restart.
    Peer,
    /// The peer, while the VM's backend is down.
    PeerDuringGap,
}

#[allow(clippy::too_many_arguments)]
fn vm(
    socket: PathBuf,
    dest: Gid,
    n: u32,
    role: Role,
    probes: bool,
    ph: Arc<RunPhases>,
    until: Instant,
    seed: u64,
) -> LabResult<Done> {
    let mut g = big_guest(&socket, seed)?;
    ph.wait(&mut g.dev, ESTABLISHED, until)?; // the peers listen
    let dev = &mut g.dev;
    let mut s = Side::default();
    let mut conns = Vec::new();
    let opts = ConnectOptions::default();
    for _ in 0..n {
        dev.connect(dest, tcp_service_id(SERVICE_PORT), &[], &opts)?;
    }
    let probes = if probes { PROBES } else { 0 };
    for _ in 0..probes {
        dev.connect(dest, tcp_service_id(NOBODY_PORT), &[], &opts)?;
    }
    dev.run_until(until.saturating_duration_since(Instant::now()), |d| {
        drain(d, &mut s, &mut conns, None);
        s.established >= n && s.rejected >= probes
    })?;
    if s.established < n {
        return Err(format!("only {} of {n} established", s.established).into());
    }
    ph.arrive(ESTABLISHED);
    ph.wait(dev, UP, until)?;
    // The backend is back: a new vhost-user session, as QEMU's reconnect-ms opens.
    loop {
        match g.reconnect(&socket) {
            Ok(()) => break,
            Err(e) if Instant::now() > until => return Err(format!("reconnect: {e}").into()),
            Err(_) => {
                let _ = g.dev.run_until(Duration::from_millis(20), |_| false);
            }
        }
    }
    let dev = &mut g.dev;
    ph.arrive(RECONNECTED);
    ph.wait(dev, RECONNECTED, until)?;
    if role == Role::Vm {
        disconnect_all(dev, &conns, &mut s)?;
    }
    dev.run_until(until.saturating_duration_since(Instant::now()), |d| {
        drain(d, &mut s, &mut conns, None);
        s.disconnected >= n
    })?;
    Ok(finish(g, s))
}

fn drops_of(s: &Snapshot) -> Vec<(String, u64)> {
    s.host
        .drops
        .iter()
        .chain(s.host.device_drops.iter())
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.clone(), *n))
        .collect()
}

/// Runs the scenario: backends under `exe __backend`, sockets and the state directory
/// in a temporary directory.
pub fn run(exe: &Path, a: &RestartCli) -> LabResult<RestartReport> {
    if a.vms == 0 || a.vms > 32 || a.connections < a.vms as u32 {
        return Err("--vms must be 1 to 32, with at least one connection each".into());
    }
    standalone::in_temp_dir("restart", a.net, |dir| run_in(exe, a, dir))
}

fn run_in(exe: &Path, a: &RestartCli, dir: &Path) -> LabResult<RestartReport> {
    let k = a.vms;
    let per = a.connections / k as u32;
    let n_total = per * k as u32;
    let peers: Vec<VmSlot> = (0..k)
        .map(|i| VmSlot::loopback(dir, 0, i, &format!("p{}", i + 1), a.net))
        .collect();
    let vms: Vec<VmSlot> = (0..k)
        .map(|i| VmSlot::loopback(dir, 1, i, &format!("v{}", i + 1), a.net))
        .collect();
    let state = dir.join("state");
    let ready = Duration::from_secs(10);
    let h1 = HostProc::spawn(exe, spec(dir, 0, peers.clone(), None), ready)?;
    let mut h2 = HostProc::spawn(exe, spec(dir, 1, vms.clone(), Some(state.clone())), ready)?;
    let until = Instant::now() + Duration::from_secs(120);
    let ph = Arc::new(RunPhases::default());
    let role = |i: usize| {
        if i + 1 == k && k > 1 {
            Role::PeerDuringGap
        } else if i % 2 == 0 {
            Role::Vm
        } else {
            Role::Peer
        }
    };
    let mut threads = Vec::new();
    for (i, p) in peers.iter().enumerate() {
        let (socket, ph, r) = (p.socket.clone(), ph.clone(), role(i));
        threads.push(std::thread::spawn(move || peer(socket, per, r, ph, until)));
    }
    for (i, v) in vms.iter().enumerate() {
        let (socket, dest, ph, r) = (v.socket.clone(), peers[i].gid(), ph.clone(), role(i));
        threads.push(std::thread::spawn(move || {
            vm(
                socket,
                dest,
                per,
                r,
                i == 0,
                ph,
                until,
                0x7e57_0000 + i as u64,
            )
        }));
    }
    let fail = |e: LabError, threads: Vec<std::thread::JoinHandle<LabResult<Done>>>| {
        ph.set(u32::MAX);
        let mut errors = vec![e];
        for t in threads {
            if let Ok(Err(e)) = t.join() {
                errors.push(e);
            }
        }
        Err::<RestartReport, _>(LabError::Several(errors))
    };
    if let Err(e) = ph.wait_arrived(LISTENING, k as u32, until) {
        return fail(e, threads);
    }
    ph.set(ESTABLISHED);
    if let Err(e) = ph.wait_arrived(ESTABLISHED, 2 * k as u32, until) {
        return fail(e, threads);
    }
    let mut rep = RestartReport {
        connections: n_total,
        vms: k,
        mode: Some(a.mode),
        ..RestartReport::default()
    };
    let st = h2.stat()?;
    rep.before = (st.host.live, st.host.quarantined);
    let t0 = Instant::now();
    match a.mode {
        Mode::Kill => h2.kill(),
        Mode::Term => h2.stop(),
    }
    ph.set(DOWN);
    // The peers' DREQs of the last pair go out now, into the gap.
    std::thread::sleep(Duration::from_millis(300));
    if let Err(e) = h2.respawn(exe, ready) {
        return fail(LabError::io("restarting the backend")(e), threads);
    }
    rep.gap_ms = t0.elapsed().as_secs_f64() * 1e3;
    let st = h2.stat()?;
    rep.restored = (st.host.live, st.host.quarantined);
    rep.restored_attached = st.vms.iter().filter(|v| v.attached).count();
    let t1 = Instant::now();
    ph.set(UP);
    if let Err(e) = ph.wait_arrived(RECONNECTED, k as u32, until) {
        return fail(e, threads);
    }
    rep.reconnect_ms = t1.elapsed().as_secs_f64() * 1e3;
    ph.set(RECONNECTED);
    let mut errors = Vec::new();
    let mut alive = Vec::new();
    for (i, t) in threads.into_iter().enumerate() {
        match t.join() {
            Ok(Ok((s, g))) => {
                sum(if i < k { &mut rep.peer } else { &mut rep.vm }, &s);
                alive.push(g);
            }
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push(LabError::Panicked("a VM thread".into())),
        }
    }
    if !errors.is_empty() {
        return Err(LabError::Several(errors));
    }
    // Quiesce: TimeWait ends, then nothing may stay live.
    let quiet = Instant::now() + Duration::from_secs(60);
    loop {
        let s2 = h2.stat()?;
        let s1 = h1.stat()?;
        rep.leaked = (s2.host.live, s1.host.live);
        rep.drops = (drops_of(&s2), drops_of(&s1));
        if rep.leaked == (0, 0) || Instant::now() > quiet {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    rep.journal_bytes = std::fs::metadata(state.join("mux.journal"))
        .map(|m| m.len())
        .unwrap_or(0);
    drop(alive);
    drop(h2);
    drop(h1);
    if a.cost_connections > 0 {
        rep.cost = Some(cost(exe, dir, a)?);
    }
    Ok(rep)
}

/// cmtime rates (connections set up and torn down per second) of a VM whose backend
/// keeps a journal and of one whose backend does not, against one server, alternating.
fn cost(exe: &Path, dir: &Path, a: &RestartCli) -> LabResult<(Vec<f64>, Vec<f64>)> {
    let n = a.cost_connections;
    let rounds = a.cost_rounds.max(1);
    let net = a.net.wrapping_add(1);
    let srv = VmSlot::loopback(dir, 0, 0, "srv", net);
    let on = VmSlot::loopback(dir, 1, 0, "on", net);
    let off = VmSlot::loopback(dir, 2, 0, "off", net);
    let ready = Duration::from_secs(10);
    let mk = |i: usize, v: &VmSlot, state: Option<PathBuf>| {
        let mut s = spec(dir, i, vec![v.clone()], state);
        s.control = dir.join(format!("cost{i}.ctl"));
        s.log = dir.join(format!("cost{i}.log"));
        s
    };
    let _h1 = HostProc::spawn(exe, mk(0, &srv, None), ready)?;
    let _h2 = HostProc::spawn(exe, mk(1, &on, Some(dir.join("cost-state"))), ready)?;
    let _h3 = HostProc::spawn(exe, mk(2, &off, None), ready)?;
    let timeout = Duration::from_secs(120);
    let srv_socket = srv.socket.clone();
    let server = std::thread::spawn(move || -> LabResult<()> {
        let mut g = big_guest(&srv_socket, 11)?;
        let listen = g.dev.listen(tcp_service_id(cmtime::DEFAULT_PORT))?;
        for _ in 0..2 * rounds {
            cmtime::serve(
                &mut g.dev,
                listen,
                &ServerOptions {
                    port: cmtime::DEFAULT_PORT,
                    connections: n,
                    timeout: Some(timeout),
                },
            )
            .map_err(|e| format!("server: {e}"))?;
        }
        Ok(())
    });
    let mut g_on = big_guest(&on.socket, 12)?;
    let mut g_off = big_guest(&off.socket, 13)?;
    let _ = g_on.dev.run_until(Duration::from_millis(300), |_| false);
    let run = |g: &mut GuestVm| -> LabResult<f64> {
        let r = cmtime::client(
            &mut g.dev,
            &ClientOptions {
                dest: srv.gid(),
                port: cmtime::DEFAULT_PORT,
                connections: n,
                timeout,
                hold: Duration::ZERO,
                connect: ConnectOptions::default(),
            },
        )?;
        if r.disconnected != n {
            return Err(format!("cost run: {} of {n} torn down", r.disconnected).into());
        }
        let t = r.step(Step::Establish).total + r.step(Step::Disconnect).total;
        Ok(f64::from(n) / t.as_secs_f64().max(1e-9))
    };
    let (mut a_on, mut a_off) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        // Alternate which goes first, so drift on the machine hits both alike.
        if i % 2 == 0 {
            a_on.push(run(&mut g_on)?);
            a_off.push(run(&mut g_off)?);
        } else {
            a_off.push(run(&mut g_off)?);
            a_on.push(run(&mut g_on)?);
        }
    }
    server
        .join()
        .map_err(|_| LabError::Panicked("the server".into()))??;
    Ok((a_on, a_off))
}

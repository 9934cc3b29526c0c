//! `pvcm-lab migrate`: a VM live-migrates between two backends in the middle of its
//! handshakes and keeps every connection.
//!
//! Three hosts (real backend processes): host 1 runs the peer VM `p`; host 2 runs VM
//! `m` with its own ID range (`id-range=`); host 3 has `m` as `incoming=yes`. `m` starts
//! `--connections` connections to `p`. The peer accepts the first half, then holds the
//! other half's REQs unanswered while `m` is moved: its rings stop on host 2, its state
//! (entries, quarantine, timers, rx backlog) is saved from host 2 and loaded into host
//! 3, and its rings start there at the saved bases, as QEMU moves a vhost-user device
//! (the lab plays QEMU; `qemu-scripts/e2e.sh` test 10 does it with QEMU). The guest does
//! not run meanwhile (stop-and-copy). Then the peer answers the held REQs: the REPs go
//! to `m`'s address, now host 3's. Afterwards half the connections are torn down by the
//! peer (DREQs to the IDs host 2 gave), half by `m`.
//!
//! It reports and checks: every connection established and torn down (0 failed), every
//! DREQ answered, host 2 holding nothing of `m` right after the move, 0 live entries on
//! every host at the end, 0 drops, and what the move cost the CM: the time `m` was
//! stopped, the state's size, and the REQ and DREQ retries it caused.
//!
//! ```text
//! cargo run --release -p pvcm-lab -- migrate [--connections 100]
//! ```

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use pvcm_backend::stats::Snapshot;
use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_guest::cm::{CmId, ConnectOptions, Event, Group};
use pvcm_guest::device::Notice;
use pvcm_wire::mad::AttributeId;

use super::error::{LabError, LabResult};
use super::guest::{GuestVm, LabDevice};
use super::host::{HostProc, HostSpec, VmSlot};
use super::standalone::{self, Phases, big_guest};

/// `pvcm-lab migrate` options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-lab migrate",
    about = "Live-migrate a VM between two backends in the middle of its handshakes"
)]
pub struct MigrateCli {
    /// Connections from the moving VM to the peer (half of them are still handshaking
    /// when it moves).
    #[arg(long, default_value_t = 100)]
    pub connections: u32,
    /// Second octet of the hosts' loopback addresses (127.N.H.V).
    #[arg(long, default_value_t = 85)]
    pub net: u8,
}

/// One side's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Side {
    /// Connections established.
    pub established: u32,
    /// Connections torn down.
    pub disconnected: u32,
    /// Connections rejected or unreachable.
    pub failed: u32,
    /// DREQs sent by the application.
    pub dreqs: u32,
    /// REQ retries of the agent.
    pub req_retries: u64,
    /// DREQ retries of the agent.
    pub dreq_retries: u64,
}

/// What `pvcm-lab migrate` saw.
#[derive(Debug, Clone, Default)]
pub struct MigrateReport {
    /// Connections.
    pub connections: u32,
    /// The moving VM.
    pub vm: Side,
    /// The peer.
    pub peer: Side,
    /// Handshakes unanswered when the VM moved.
    pub in_flight: u32,
    /// The time the VM's device was stopped (rings stopped on host 2 to rings started
    /// on host 3), ms.
    pub stopped_ms: f64,
    /// Bytes of device state moved.
    pub state_bytes: usize,
    /// Host 2's live and quarantined entries right after the move.
    pub source_after: (u64, u64),
    /// Host 3's live entries right after the move.
    pub dest_after: u64,
    /// Live entries at the end (hosts 1, 2, 3).
    pub leaked: (u64, u64, u64),
    /// Drops at the end (hosts 1, 2, 3).
    pub drops: Vec<(String, String, u64)>,
}

impl MigrateReport {
    /// Every check: name, passed, detail.
    pub fn checks(&self) -> Vec<(&'static str, bool, String)> {
        let n = self.connections;
        vec![
            (
                "every connection established",
                self.vm.established == n && self.peer.established == n,
                format!(
                    "vm {} peer {} of {n}",
                    self.vm.established, self.peer.established
                ),
            ),
            (
                "handshakes in flight during the move",
                self.in_flight > 0,
                format!("{} REQs unanswered when the VM moved", self.in_flight),
            ),
            (
                "every connection torn down, none failed",
                self.vm.disconnected == n
                    && self.peer.disconnected == n
                    && self.vm.failed == 0
                    && self.peer.failed == 0,
                format!(
                    "vm {} peer {} of {n}, failed {} {}",
                    self.vm.disconnected, self.peer.disconnected, self.vm.failed, self.peer.failed
                ),
            ),
            (
                "the source holds nothing of the VM right after",
                self.source_after == (0, 0),
                format!(
                    "host 2: {} live {} quarantined; host 3: {} live",
                    self.source_after.0, self.source_after.1, self.dest_after
                ),
            ),
            (
                "nothing left at the end",
                self.leaked == (0, 0, 0),
                format!("live {:?}", self.leaked),
            ),
            (
                "no drops",
                self.drops.is_empty(),
                format!("{:?}", self.drops),
            ),
        ]
    }

    /// True when every check passed.
    pub fn passed(&self) -> bool {
        self.checks().iter().all(|(_, ok, _)| *ok)
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let mut s = format!(
            "pvcm-lab migrate: {} connections, {} handshakes in flight at the move\n\
             move: VM stopped {:.1} ms, {} bytes of device state\n\
             retries caused: REQ vm {} peer {}, DREQ vm {} peer {}\n",
            self.connections,
            self.in_flight,
            self.stopped_ms,
            self.state_bytes,
            self.vm.req_retries,
            self.peer.req_retries,
            self.vm.dreq_retries,
            self.peer.dreq_retries,
        );
        super::render_checks(&mut s, &self.checks());
        s
    }
}

/// `pvcm-lab migrate`'s main.
pub fn main<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    super::command_main(
        "pvcm-lab migrate",
        args,
        run,
        MigrateReport::render,
        |_: &MigrateCli, r: &MigrateReport| r.passed(),
        "a check failed",
    )
}

const SERVICE_PORT: u16 = 18517;
const RANGE: &str = "0x80550000/16";

/// Phases the main thread moves on.
const LISTENING: u32 = 0;
const HALF: u32 = 1;
const MOVED: u32 = 2;

/// The run's phases (see [`Phases`]), and the REQs the peer held when the VM moved.
#[derive(Debug, Default)]
struct RunPhases {
    ph: Phases<3>,
    in_flight: AtomicU32,
}

impl std::ops::Deref for RunPhases {
    type Target = Phases<3>;
    fn deref(&self) -> &Phases<3> {
        &self.ph
    }
}

fn pump(dev: &mut LabDevice) -> LabResult<()> {
    dev.run_until(Duration::from_millis(2), |_| false)?;
    Ok(())
}

fn finish(dev: &mut LabDevice, s: &mut Side) {
    let _ = dev.flush(Duration::from_millis(200));
    let c = dev.agent().counters();
    s.req_retries = c.get(Group::TxRetries, AttributeId::Req);
    s.dreq_retries = c.get(Group::TxRetries, AttributeId::Dreq);
}

/// The peer: accepts half, holds the rest until the VM moved, then accepts them; tears
/// the odd connections down once all are up.
fn peer(mut g: GuestVm, n: u32, ph: Arc<RunPhases>, until: Instant) -> LabResult<(Side, GuestVm)> {
    let dev = &mut g.dev;
    let listen = dev.listen(tcp_service_id(SERVICE_PORT))?;
    ph.arrive(LISTENING);
    let mut s = Side::default();
    let mut conns: Vec<CmId> = Vec::new();
    let mut held: Vec<CmId> = Vec::new();
    let mut accepted = 0;
    let mut torn = false;
    while s.disconnected < n {
        if Instant::now() > until {
            return Err(format!(
                "peer: timed out (established {}, disconnected {})",
                s.established, s.disconnected
            )
            .into());
        }
        pump(dev)?;
        if ph.at(MOVED) && !held.is_empty() {
            for id in held.drain(..) {
                dev.accept(id, &[])?;
            }
        }
        while let Some(nt) = dev.pop_notice() {
            match nt {
                Notice::Cm(Event::ConnectRequest { id, listen_id, .. }) if listen_id == listen => {
                    if accepted < n / 2 || ph.at(MOVED) {
                        dev.accept(id, &[])?;
                    } else {
                        held.push(id);
                        ph.in_flight.store(held.len() as u32, Ordering::Release);
                    }
                    accepted += 1;
                }
                Notice::Cm(Event::Established { id, .. }) => {
                    s.established += 1;
                    conns.push(id);
                    if s.established == n / 2 {
                        ph.arrive(HALF);
                    }
                }
                Notice::Cm(Event::Disconnected { id }) => {
                    s.disconnected += 1;
                    let _ = dev.destroy(id);
                }
                Notice::Cm(Event::Rejected { id, .. } | Event::Unreachable { id }) => {
                    s.failed += 1;
                    let _ = dev.destroy(id);
                }
                _ => {}
            }
        }
        if s.established == n && !torn {
            // Every connection is up (the VM sent each RTU, so it is up there too):
            // tear the odd ones down.
            for id in conns.iter().skip(1).step_by(2) {
                dev.disconnect(*id)?;
                s.dreqs += 1;
            }
            torn = true;
        }
    }
    finish(&mut g.dev, &mut s);
    Ok((s, g))
}

/// The moving VM: starts every connection, is moved by the main thread (it does not
/// run meanwhile), then tears the even connections down once all are up.
#[allow(clippy::too_many_arguments)]
fn vm(
    mut g: GuestVm,
    dest_socket: &Path,
    peer: pvcm_wire::Gid,
    n: u32,
    ph: &RunPhases,
    until: Instant,
    hosts: (&HostProc, &HostProc),
    rep: &mut MigrateReport,
) -> LabResult<(Side, GuestVm)> {
    let mut s = Side::default();
    let mut conns: Vec<CmId> = Vec::new();
    let opts = ConnectOptions::default();
    for _ in 0..n {
        g.dev
            .connect(peer, tcp_service_id(SERVICE_PORT), &[], &opts)?;
    }
    let mut moved = false;
    let mut torn = false;
    while s.disconnected < n {
        if Instant::now() > until {
            return Err(format!(
                "vm: timed out (established {}, disconnected {})",
                s.established, s.disconnected
            )
            .into());
        }
        if !moved && ph.arrived(HALF) > 0 {
            // Stop-and-copy: the guest does not run while its device moves.
            let t = Instant::now();
            rep.state_bytes = g
                .migrate_to(dest_socket)
                .map_err(|e| format!("migrate: {e}"))?;
            rep.stopped_ms = t.elapsed().as_secs_f64() * 1e3;
            rep.in_flight = ph.in_flight.load(Ordering::Acquire);
            moved = true;
            ph.set(MOVED);
            let src = hosts.0.stat()?;
            let dst = hosts.1.stat()?;
            rep.source_after = (src.host.live, src.host.quarantined);
            rep.dest_after = dst.host.live;
        }
        pump(&mut g.dev)?;
        while let Some(nt) = g.dev.pop_notice() {
            match nt {
                Notice::Cm(Event::Established { id, .. }) => {
                    s.established += 1;
                    conns.push(id);
                }
                Notice::Cm(Event::Disconnected { id }) => {
                    s.disconnected += 1;
                    let _ = g.dev.destroy(id);
                }
                Notice::Cm(Event::Rejected { id, .. } | Event::Unreachable { id }) => {
                    s.failed += 1;
                    let _ = g.dev.destroy(id);
                }
                _ => {}
            }
        }
        if s.established == n && !torn {
            for id in conns.iter().step_by(2) {
                g.dev.disconnect(*id)?;
                s.dreqs += 1;
            }
            torn = true;
        }
        if s.failed > 0 && s.established + s.failed >= n && !torn {
            return Err(format!("vm: {} connections failed", s.failed).into());
        }
    }
    finish(&mut g.dev, &mut s);
    Ok((s, g))
}

fn drops_of(host: &str, s: &Snapshot, out: &mut Vec<(String, String, u64)>) {
    for (k, v) in s.host.drops.iter().chain(s.host.device_drops.iter()) {
        if *v > 0 {
            out.push((host.to_string(), k.clone(), *v));
        }
    }
}

/// Runs the scenario: backends under `exe __backend`, sockets in a temporary directory.
pub fn run(exe: &Path, a: &MigrateCli) -> LabResult<MigrateReport> {
    if a.connections < 2 || a.connections > 30_000 {
        return Err("--connections must be 2 to 30000".into());
    }
    standalone::in_temp_dir("migrate", a.net, |dir| run_in(exe, a, dir))
}

fn run_in(exe: &Path, a: &MigrateCli, dir: &Path) -> LabResult<MigrateReport> {
    let n = a.connections;
    let p = VmSlot::loopback(dir, 0, 0, "p", a.net);
    let m = VmSlot::loopback(dir, 1, 0, "m", a.net);
    // Host 3's socket for the same VM (same address).
    let m_dest = dir.join("m-dest.sock");
    let vm_arg = |socket: &Path, incoming: bool| {
        format!(
            "socket={},gid={},name=m,id-range={RANGE},quota=30000{}",
            socket.display(),
            m.addr,
            if incoming { ",incoming=yes" } else { "" }
        )
    };
    let ready = Duration::from_secs(10);
    let h1 = HostProc::spawn(
        exe,
        HostSpec::standalone(dir, 0, vec![p.clone()], 0x3161),
        ready,
    )?;
    let mut s2 = HostSpec::standalone(dir, 1, Vec::new(), 0x3162);
    s2.extra = vec!["--vm".into(), vm_arg(&m.socket, false)];
    let h2 = HostProc::spawn(exe, s2, ready)?;
    let mut s3 = HostSpec::standalone(dir, 2, Vec::new(), 0x3163);
    s3.extra = vec!["--vm".into(), vm_arg(&m_dest, true)];
    let h3 = HostProc::spawn(exe, s3, ready)?;

    let until = Instant::now() + Duration::from_secs(120);
    let ph = Arc::new(RunPhases::default());
    let pg = big_guest(&p.socket, 0x9e_e701)?;
    let mg = big_guest(&m.socket, 0x7e57_0101)?;
    let peer_thread = {
        let ph = ph.clone();
        std::thread::spawn(move || peer(pg, n, ph, until))
    };
    ph.wait_arrived(LISTENING, 1, until)?;
    // This thread plays the VM, and QEMU moving its device when half the connections
    // are up and the peer holds the other half's REQs.
    let mut rep = MigrateReport {
        connections: n,
        ..MigrateReport::default()
    };
    let r = vm(mg, &m_dest, p.gid(), n, &ph, until, (&h2, &h3), &mut rep);
    ph.set(MOVED); // release the peer's held REQs even if the VM failed early
    let peer_r = peer_thread
        .join()
        .map_err(|_| LabError::Panicked("the peer thread".into()))?;
    let (vm_side, mg) = r?;
    let (peer_side, pg) = peer_r?;
    rep.vm = vm_side;
    rep.peer = peer_side;
    // Quiesce: TimeWait ends, then nothing may stay live anywhere.
    let quiet = Instant::now() + Duration::from_secs(60);
    loop {
        let (a, b, c) = (h1.stat()?, h2.stat()?, h3.stat()?);
        rep.leaked = (a.host.live, b.host.live, c.host.live);
        rep.drops.clear();
        drops_of("h1", &a, &mut rep.drops);
        drops_of("h2", &b, &mut rep.drops);
        drops_of("h3", &c, &mut rep.drops);
        if rep.leaked == (0, 0, 0) || Instant::now() > quiet {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop((mg, pg));
    Ok(rep)
}

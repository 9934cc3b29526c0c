//! `pvcm-lab hostile`: what one hostile VM does to its neighbours.
//!
//! Two hosts (real backend processes). Host 1 has a server VM; host 2 has a neighbour VM
//! and a hostile VM on the same backend. The neighbour runs `cmtime` against the server
//! twice in one run: alone, then while the hostile VM floods its backend at full speed
//! with everything a guest can get wrong: chains that cannot be walked, descriptors
//! outside its memory, device-writable tx buffers, oversize, truncated and unknown
//! messages, non-CM MADs, REQs with a spoofed GID, a spoofed QPN or a spoofed CA GUID,
//! REQs beyond its quota (to an address nobody has), and it never posts an rx buffer, so
//! everything the backend sends it piles up against its backlog budget. Every few hundred
//! rounds it resets its device and opens a new session, in a loop.
//!
//! It reports the neighbour's connection rate alone and under the flood (the ratio is
//! the figure; the issue's bar is >= 0.9x, measured in one run), the backend's resident
//! memory before, during (maximum) and after, what the flood sent and what the backend
//! counted against the hostile VM, and the neighbour's own drops (which must stay 0).
//!
//! ```text
//! cargo run --release -p pvcm-lab -- hostile [--connections 2000]
//! ```

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use pvcm_backend::mux::VmConfig;
use pvcm_backend::stats::Snapshot;
use pvcm_guest::cm::rdma_cm::tcp_service_id;
use pvcm_guest::device::cmtime::{self, ClientOptions, CmtimeReport, ServerOptions, Step};
use pvcm_guest::virtq::Segment;
use pvcm_wire::Gid;
use pvcm_wire::mad;
use pvcm_wire::testing as mads;

use super::error::{LabError, LabResult};
use super::guest::{GuestOpts, GuestVm};
use super::host::{HostProc, HostSpec, VmSlot};
use super::standalone;
use crate::vmm::{LabVm, VmOpts};

/// `pvcm-lab hostile` options.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pvcm-lab hostile",
    about = "A neighbour VM's cmtime alone and while a hostile VM floods the same backend"
)]
pub struct HostileCli {
    /// Connections of each neighbour cmtime run.
    #[arg(long, default_value_t = 2000)]
    pub connections: u32,
    /// Second octet of the hosts' loopback addresses (127.N.H.V).
    #[arg(long, default_value_t = 79)]
    pub net: u8,
    /// Sessions the hostile VM opens and resets during the flood (at least 1).
    #[arg(long, default_value_t = 5)]
    pub resets: u32,
}

/// The neighbour's figures of one cmtime run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Run {
    /// Connections established.
    pub established: u32,
    /// Connections torn down.
    pub disconnected: u32,
    /// Establish step total, ms.
    pub establish_ms: f64,
    /// Disconnect step total, ms.
    pub disconnect_ms: f64,
}

impl Run {
    fn of(r: &CmtimeReport) -> Run {
        Run {
            established: r.established,
            disconnected: r.disconnected,
            establish_ms: r.step(Step::Establish).total.as_secs_f64() * 1e3,
            disconnect_ms: r.step(Step::Disconnect).total.as_secs_f64() * 1e3,
        }
    }

    /// Connections set up and torn down per second.
    pub fn rate(&self) -> f64 {
        let s = (self.establish_ms + self.disconnect_ms) / 1e3;
        if s > 0.0 {
            f64::from(self.established) / s
        } else {
            0.0
        }
    }
}

/// What the run measured.
#[derive(Debug, Clone, Default)]
pub struct HostileReport {
    /// Connections per neighbour run.
    pub connections: u32,
    /// The neighbour alone.
    pub solo: Run,
    /// The neighbour while the hostile VM floods.
    pub flooded: Run,
    /// Messages and chains the hostile VM queued.
    pub flood_sent: u64,
    /// Sessions it opened (each after a reset of the previous one).
    pub flood_sessions: u64,
    /// Backend RSS (KiB) before the flood, its maximum during, and after.
    pub rss_kib: (u64, u64, u64),
    /// Drops counted against the hostile VM, by reason (device and mux).
    pub hostile_drops: Vec<(String, u64)>,
    /// Drops counted against the neighbour.
    pub neighbour_drops: u64,
}

impl HostileReport {
    /// The neighbour's rate under the flood over its rate alone.
    pub fn ratio(&self) -> f64 {
        let s = self.solo.rate();
        if s > 0.0 {
            self.flooded.rate() / s
        } else {
            0.0
        }
    }

    /// The summary table.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let row = |name: &str, r: &Run| {
            format!(
                "{name:<26} {:>6} {:>6} {:>12.1} {:>14.1} {:>10.0}\n",
                r.established,
                r.disconnected,
                r.establish_ms,
                r.disconnect_ms,
                r.rate()
            )
        };
        o.push_str(&format!(
            "{:<26} {:>6} {:>6} {:>12} {:>14} {:>10}\n",
            "neighbour cmtime", "est", "disc", "establish ms", "disconnect ms", "conn/s"
        ));
        o.push_str(&row("alone", &self.solo));
        o.push_str(&row("while a VM floods", &self.flooded));
        o.push_str(&format!(
            "neighbour rate under the flood: {:.2}x of alone (bar: >= 0.9x)\n",
            self.ratio()
        ));
        o.push_str(&format!(
            "flood: {} messages/chains in {} sessions (a reset between each); backend RSS \
             {} KiB before, {} KiB at most during, {} KiB after\n",
            self.flood_sent, self.flood_sessions, self.rss_kib.0, self.rss_kib.1, self.rss_kib.2
        ));
        o.push_str("counted against the hostile VM:");
        for (r, n) in &self.hostile_drops {
            o.push_str(&format!(" {r} {n},"));
        }
        o.push_str(&format!(
            "\ncounted against the neighbour: {} drops\n",
            self.neighbour_drops
        ));
        o
    }
}

/// Runs `pvcm-lab hostile ARGS` (`args` after `hostile`).
pub fn main<I: IntoIterator<Item = OsString>>(args: I) -> ExitCode {
    super::command_main(
        "pvcm-lab hostile",
        args,
        run,
        HostileReport::render,
        |a: &HostileCli, r: &HostileReport| {
            r.neighbour_drops == 0
                && r.solo.disconnected == a.connections
                && r.flooded.disconnected == a.connections
        },
        "the neighbour lost connections or MADs",
    )
}

fn spec(dir: &Path, index: usize, vms: Vec<VmSlot>) -> HostSpec {
    HostSpec::standalone(dir, index, vms, 0x4057_11e0 + index as u64)
}

/// The hostile VM's quota of live entries.
pub const HOSTILE_QUOTA: u32 = 1024;

fn guest(socket: &Path, seed: u64) -> LabResult<GuestVm> {
    let opts = GuestOpts {
        seed,
        ..GuestOpts::default()
    };
    standalone::guest(socket, &opts)
}

/// Runs the measurement: backends under `exe __backend`, sockets in a temporary
/// directory.
pub fn run(exe: &Path, a: &HostileCli) -> LabResult<HostileReport> {
    standalone::in_temp_dir("hostile", a.net, |dir| run_in(exe, a, dir))
}

fn run_in(exe: &Path, a: &HostileCli, dir: &Path) -> LabResult<HostileReport> {
    let n = a.connections;
    let srv = VmSlot::loopback(dir, 0, 0, "srv", a.net);
    let nb = VmSlot::loopback(dir, 1, 0, "nb", a.net);
    let bad = VmSlot {
        // A small quota, so the flood's good REQs run into it.
        quota: Some(HOSTILE_QUOTA),
        ..VmSlot::loopback(dir, 1, 1, "bad", a.net)
    };
    let ready = Duration::from_secs(10);
    let mut h1 = HostProc::spawn(exe, spec(dir, 0, vec![srv.clone()]), ready)?;
    let mut h2 = HostProc::spawn(exe, spec(dir, 1, vec![nb.clone(), bad.clone()]), ready)?;
    let timeout = Duration::from_secs(120);

    // The server serves both runs.
    let srv_socket = srv.socket.clone();
    let server = std::thread::spawn(move || -> LabResult<()> {
        let mut vm = guest(&srv_socket, 1)?;
        let listen = vm
            .dev
            .listen(tcp_service_id(cmtime::DEFAULT_PORT))
            .map_err(|e| format!("server: {e}"))?;
        for _ in 0..2 {
            let r = cmtime::serve(
                &mut vm.dev,
                listen,
                &ServerOptions {
                    port: cmtime::DEFAULT_PORT,
                    connections: n,
                    timeout: Some(timeout * 2),
                },
            )
            .map_err(|e| format!("server: {e}"))?;
            if r.disconnected != n {
                return Err(format!("server: {r:?}").into());
            }
        }
        Ok(())
    });
    let mut nbvm = guest(&nb.socket, 2)?;
    // Give the server a moment to listen.
    let _ = nbvm.dev.run_until(Duration::from_millis(300), |_| false);
    let client = |vm: &mut GuestVm| -> LabResult<Run> {
        let r = cmtime::client(
            &mut vm.dev,
            &ClientOptions {
                dest: srv.gid(),
                port: cmtime::DEFAULT_PORT,
                connections: n,
                timeout,
                hold: Duration::ZERO,
                connect: pvcm_guest::cm::ConnectOptions::default(),
            },
        )
        .map_err(|e| format!("neighbour: {e}"))?;
        Ok(Run::of(&r))
    };
    let solo = client(&mut nbvm)?;
    let rss0 = h2.rss_kib().unwrap_or(0);

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let sessions = Arc::new(AtomicU64::new(0));
    let flooder = {
        let (stop, sent, sessions) = (stop.clone(), sent.clone(), sessions.clone());
        let (socket, me, victim) = (bad.socket.clone(), bad.gid(), nb.gid());
        let resets = a.resets.max(1);
        std::thread::spawn(move || flood(&socket, me, victim, resets, &stop, &sent, &sessions))
    };
    // Let the flood get going, then measure the neighbour under it, sampling memory.
    std::thread::sleep(Duration::from_millis(300));
    let rss_max = Arc::new(AtomicU64::new(rss0));
    let sampler = {
        let (stop, rss_max) = (stop.clone(), rss_max.clone());
        let pid = h2.pid();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(kib) = pid.and_then(rss_of) {
                    rss_max.fetch_max(kib, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let flooded = client(&mut nbvm);
    stop.store(true, Ordering::Relaxed);
    let flood_result = flooder
        .join()
        .map_err(|_| LabError::Panicked("the flooder".into()))?;
    let _ = sampler.join();
    let flooded = flooded?;
    let bad_vm = flood_result?;
    server
        .join()
        .map_err(|_| LabError::Panicked("the server".into()))??;
    let rss1 = h2.rss_kib().unwrap_or(0);
    let s: Snapshot = h2.stat()?;
    if std::env::var_os("PVCM_HOSTILE_DEBUG").is_some() {
        eprintln!("{}", s.render());
    }
    let nb_fig = s.vm("nb").map(|v| v.figures.clone()).unwrap_or_default();
    // The mux counts per session and moves a session's figures to the host's when it
    // ends: across the hostile VM's sessions, the host's sums are its drops minus the
    // neighbour's (which must be none).
    let hostile_drops = s
        .host
        .drops
        .iter()
        .chain(s.host.device_drops.iter())
        .map(|(k, v)| {
            let nb = nb_fig.drops.get(k).or(nb_fig.device_drops.get(k)).copied();
            (k.clone(), v.saturating_sub(nb.unwrap_or(0)))
        })
        .filter(|(_, v)| *v > 0)
        .collect();
    let neighbour_drops =
        nb_fig.drops.values().sum::<u64>() + nb_fig.device_drops.values().sum::<u64>();
    drop((nbvm, bad_vm));
    h1.stop();
    h2.stop();
    Ok(HostileReport {
        connections: n,
        solo,
        flooded,
        flood_sent: sent.load(Ordering::Relaxed),
        flood_sessions: sessions.load(Ordering::Relaxed),
        rss_kib: (rss0, rss_max.load(Ordering::Relaxed), rss1),
        hostile_drops,
        neighbour_drops,
    })
}

fn rss_of(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The hostile VM: sessions of bad input, a device reset between them, until `stop`.
fn flood(
    socket: &Path,
    me: Gid,
    victim: Gid,
    resets: u32,
    stop: &AtomicBool,
    sent: &AtomicU64,
    sessions: &AtomicU64,
) -> LabResult<LabVm> {
    // The hostile VM's vCPU is not the backend's to schedule: in a real host it is its
    // own thread, which the host's scheduler (and the operator's CPU limits) share out.
    // Here it is a thread of the lab process, on the same 2 cores as everything else,
    // so it runs at the lowest priority: it floods at full speed whenever a core is
    // free, and what the neighbour loses is what the backend's work for the flood costs.
    // SAFETY: setpriority(2) on this thread's own TID; no memory is passed.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19);
    }
    let opts = VmOpts {
        post_rx: false, // it never reads what it is sent
        indirect: false,
        ..VmOpts::default()
    };
    let nobody = Gid::from_ipv4(std::net::Ipv4Addr::new(127, 254, 254, 254));
    let mut comm = 1u32;
    let started = Instant::now();
    // Sessions are spread over the flood; the last runs until stop.
    let session_len = Duration::from_millis(100);
    let mut session = 0u32;
    loop {
        let mut vm = LabVm::connect(socket, opts).map_err(|e| format!("hostile VM: {e}"))?;
        sessions.fetch_add(1, Ordering::Relaxed);
        session += 1;
        // Its identity as the backend configured it (it reads nothing, not even
        // PORT_INFO).
        let cfg = VmConfig::new("bad", me);
        let (ca, qpn) = (cfg.ca_guid, cfg.qpn_base);
        let hdr = vm.scratch(0, &mads::raw_header(1, 0))?;
        let until = Instant::now() + session_len;
        // Good REQs this session got out to the device. The session that is read at the
        // end goes on until it has sent twice the quota, so its figures always show the
        // quota reached, however little CPU the flood got before the neighbour was done.
        let mut good = 0u64;
        let enough = 2 * u64::from(HOSTILE_QUOTA);
        while if stop.load(Ordering::Relaxed) {
            good < enough
        } else {
            session >= resets || Instant::now() < until
        } {
            vm.reclaim_tx();
            let mut batch: Vec<Result<(), std::io::Error>> = Vec::with_capacity(16);
            // Chains the device cannot use.
            batch.push(vm.queue_chain(&[Segment::new(0xdead_0000_0000, 48)], &[]));
            batch.push(vm.queue_chain(&[], &[Segment::new(hdr, 304)]));
            batch.push(vm.queue_chain(&[Segment::new(hdr, 400)], &[]));
            // Messages the device refuses.
            batch.push(vm.queue_raw(&mads::raw_header(1, 0)[..20], 1));
            batch.push(vm.queue_raw(&mads::raw_header(9, 0), 1));
            batch.push(vm.queue_raw(&mads::raw_header(1, 300), 1));
            let mut not_cm = mads::req(me, ca, comm, u64::from(comm), nobody, qpn);
            mad::field::MGMT_CLASS.set(&mut not_cm, 0x03);
            batch.push(vm.queue_mad(nobody, &not_cm));
            // Spoofed REQs: another VM's GID, a QPN outside its range, another CA GUID.
            batch.push(vm.queue_mad(nobody, &mads::req(victim, ca, comm, 1, nobody, qpn)));
            batch.push(vm.queue_mad(nobody, &mads::req(me, ca, comm, 2, nobody, 0x2)));
            batch.push(vm.queue_mad(nobody, &mads::req(me, ca ^ 1, comm, 3, nobody, qpn)));
            // REQs that are fine, to nobody: up to the quota they go out, then they
            // draw REJ(NO_RESOURCES), which pile up unread.
            for _ in 0..16 {
                comm = comm.wrapping_add(1).max(1);
                let r = vm.queue_mad(
                    nobody,
                    &mads::req(me, ca, comm, u64::from(comm), nobody, qpn),
                );
                good += u64::from(r.is_ok());
                batch.push(r);
            }
            vm.kick();
            let ok = batch.iter().filter(|r| r.is_ok()).count() as u64;
            sent.fetch_add(ok, Ordering::Relaxed);
            if ok == 0 {
                // The device has not used the previous chains yet.
                std::thread::sleep(Duration::from_micros(50));
            }
            if started.elapsed() > Duration::from_secs(600) {
                return Err("hostile VM: flood did not stop".into());
            }
        }
        if stop.load(Ordering::Relaxed) {
            // The last session stays attached until its figures are read.
            return Ok(vm);
        }
        // A reset, then a new session, as a guest that resets in a loop.
        let _ = vm.reset_device();
        drop(vm);
    }
}

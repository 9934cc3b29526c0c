//! The serve loop: one process, many VMs, one wire port (soft RoCE, umad or packet).
//!
//! - Per VM a thread ([`crate::session`]) listens on the VM's vhost-user socket and
//!   serves one connection at a time with a fresh vhost-user daemon and device, so the
//!   VM can reconnect
//!   (QEMU restart, `reconnect=`). On connect the VM is attached to the mux; on
//!   disconnect it is detached, which releases its connections (DREQs, REJs, DREPs on
//!   its behalf, see `docs/mux.md`). vhost-user-backend runs the VM's vring worker.
//!   VMs are added and removed while the daemon runs ([`crate::runtime`]): a removed
//!   VM's thread ends its session, which releases its connections the same way.
//! - One host thread runs an epoll loop over the wire port's descriptors (the soft
//!   port's sockets, the umad device or the packet socket, see [`crate::port`]), a
//!   timerfd armed at [`Mux::next_deadline`] that calls [`Mux::poll`] and sends
//!   [`Mux::drain_outbox`], the control socket and the metrics listener.
//! - The mux sits behind one mutex; no lock is held across socket I/O or guest memory
//!   writes of another VM. Deliveries to a VM go through its bounded rx backlog and its
//!   own worker thread.
//!
//! [`Daemon::start`] runs it in-process (tests); [`run`] is `main`'s entry, which also
//! reloads the config file's VMs on SIGHUP, waits for SIGTERM/SIGINT and shuts down
//! cleanly: VM sessions end, their connections are released on the wire, the capture is
//! flushed and the sockets removed.

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use pvcm_wire::Gid;

use vhost::vhost_user::Listener;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};
use vmm_sys_util::timerfd::TimerFd;

use crate::backlog::HostBudget;
use crate::config::Config;
pub use crate::error::Error;
use crate::files::SocketFile;
use crate::mux::{Clock, Mux, MuxConfig, Outgoing, SystemClock, WireVerdict};
use crate::pcap::Capture;
use crate::port::packet::PacketPort;
use crate::port::soft::SoftPort;
use crate::port::umad::UmadPort;
use crate::port::{Arrivals, PortSpec, TOKEN_LIMIT, WirePort};
use crate::runtime::{Overlay, Runtime, RuntimeState};
pub use crate::rx::RxMsg;
use crate::shared::Core;
pub use crate::shared::Shared;
use crate::state::{Journal, Recovery};
use crate::stats::{DevCounters, Snapshot};
pub use crate::vm_port::VmPort;
use crate::vm_port::{Lifecycle, VmSet, VmTable, lock};

/// The host loop's timer: vmm-sys-util's CLOCK_MONOTONIC timerfd, and the deadline it
/// is armed for, so that the loop, which asks for the mux's next deadline after every
/// batch, makes the `timerfd_settime` call only when that deadline changed.
#[derive(Debug)]
struct Timer {
    fd: TimerFd,
    /// The mux time it is armed for (`u64::MAX`: disarmed); `None` when unknown (new,
    /// or it fired).
    armed: Option<u64>,
}

impl Timer {
    fn new() -> io::Result<Timer> {
        let fd = TimerFd::new().map_err(io::Error::from)?;
        Ok(Timer { fd, armed: None })
    }

    /// Arms the timer for mux time `at` (`u64::MAX`: never), which is `d` from now (at
    /// least 1 µs: a zero duration would disarm it). Nothing to do when it is armed for
    /// `at` already.
    fn set(&mut self, at: u64, d: Option<Duration>) -> io::Result<()> {
        if self.armed == Some(at) {
            return Ok(());
        }
        self.armed = None;
        match d {
            Some(d) => self.fd.reset(d.max(Duration::from_micros(1)), None),
            None => self.fd.clear(),
        }
        .map_err(io::Error::from)?;
        self.armed = Some(at);
        Ok(())
    }

    /// Consumes the expiry. Called only when epoll reported the timer readable, and only
    /// this thread re-arms it (at the top of the loop, after this), so the read returns
    /// at once.
    fn clear(&mut self) {
        let _ = self.fd.wait();
        self.armed = None;
    }
}

/// Receive coalescing, the host loop's interrupt moderation (`--rx-coalesce-us`).
///
/// A reader that waits in `epoll_wait` as soon as its socket is empty is woken for
/// every few datagrams under load, and each wakeup costs the thread that queues the
/// datagram (on loopback, the peer backend's sender itself) a cross-CPU wakeup; the
/// woken loop may also be placed on that sender's CPU. After a wakeup that read a batch
/// ([`RxCoalesce::BUSY`] MADs or more) the loop sleeps `delay` first instead: frames
/// queue meanwhile with no reader waiting, the senders pay no wakeup, and the next read
/// takes a fuller batch. A wakeup that read fewer (an idle or lightly loaded wire)
/// waits at once, so a lone MAD is never delayed. The socket buffers hold far more than
/// a delay's worth of frames (at most 1 ms of them).
#[derive(Debug)]
struct RxCoalesce {
    delay: Duration,
}

impl RxCoalesce {
    /// MADs read in one wakeup that make it a busy one.
    const BUSY: usize = 8;

    /// On the host loop's thread: also lowers the thread's timer slack to 1 us, so that
    /// a sleep of tens of microseconds is not stretched by the default 50 us slack.
    fn new(delay: Duration) -> RxCoalesce {
        if !delay.is_zero() {
            // SAFETY: PR_SET_TIMERSLACK takes an integer argument and changes only the
            // calling thread's timer slack.
            let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
            if r != 0 {
                tracing::debug!(error = %io::Error::last_os_error(), "timer slack unchanged");
            }
        }
        RxCoalesce { delay }
    }

    /// How long to sleep after a wakeup that read `mads` MADs from the wire.
    fn pause_after(&self, mads: usize) -> Option<Duration> {
        (mads >= Self::BUSY && !self.delay.is_zero()).then_some(self.delay)
    }
}

const TOK_STOP: u64 = TOKEN_LIMIT;
const TOK_TIMER: u64 = TOK_STOP + 1;
const TOK_WAKE: u64 = TOK_STOP + 2;
const TOK_CONTROL: u64 = TOK_STOP + 3;
const TOK_METRICS: u64 = TOK_STOP + 4;

struct HostLoop {
    shared: Arc<Shared>,
    /// The VMs changed at runtime (the control socket's `vm` requests).
    runtime: Arc<Runtime>,
    epoll: Arc<Epoll>,
    timer: Timer,
    control: Option<UnixListener>,
    metrics: Option<TcpListener>,
    serving: Arc<crate::control::Serving>,
    rx_coalesce: Duration,
}

impl HostLoop {
    fn run(mut self) {
        let mut events = vec![EpollEvent::default(); 64];
        let coalesce = RxCoalesce::new(self.rx_coalesce);
        // MADs read from the wire since the last wait.
        let mut read = 0;
        loop {
            if let Some(d) = coalesce.pause_after(read) {
                std::thread::sleep(d);
            }
            read = 0;
            self.arm_timer();
            let n = match self.epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::error!(error = %e, "host loop epoll failed");
                    return;
                }
            };
            for ev in &events[..n] {
                match ev.data() {
                    TOK_STOP => {
                        tracing::debug!("host loop stopping");
                        return;
                    }
                    TOK_TIMER => {
                        self.timer.clear();
                        self.on_timer();
                    }
                    TOK_WAKE => {
                        let _ = self.shared.timer_wake.read();
                    }
                    TOK_CONTROL => self.accept_control(),
                    TOK_METRICS => self.accept_metrics(),
                    tok if tok < TOKEN_LIMIT => {
                        let shared = &self.shared;
                        let vms = shared.vms();
                        shared
                            .port
                            .receive(&shared.port_ctx(&vms), tok, &mut |batch| {
                                read += batch.iter().map(|(_, m)| m.len()).sum::<usize>();
                                self.route(&vms, batch)
                            });
                    }
                    _ => {}
                }
            }
        }
    }

    fn arm_timer(&mut self) {
        let (next, now) = {
            let core = self.shared.lock_core();
            (core.mux.next_deadline(), core.mux.clock().now())
        };
        let at = next.map_or(u64::MAX, |t| t.0);
        self.shared.armed.store(at, Ordering::Relaxed);
        let d = next.map(|t| t.since(now));
        if let Err(e) = self.timer.set(at, d) {
            tracing::error!(error = %e, "timerfd");
        }
    }

    fn on_timer(&self) {
        let out: Vec<Outgoing> = {
            let mut core = self.shared.lock_core();
            core.mux.poll();
            core.commit();
            core.mux.drain_outbox().collect()
        };
        if !out.is_empty() {
            self.shared.send_outgoing(out);
        }
    }

    /// Takes one receive batch (MADs for any number of this host's VMs) through the mux
    /// to VMs, and replies to the wire. The mux lock is taken once for the batch, each
    /// VM's share is written into its rx ring once (by this thread, or by the VM's
    /// worker before its session has a ring), and what goes back to the wire is sent
    /// once per sending VM. The MADs are rewritten where the port put them; a delivery
    /// copies its MAD once, into the VM's rx backlog.
    fn route(&self, vms: &VmSet, mut arrivals: Arrivals) {
        arrivals.retain(|(vm, mads)| !mads.is_empty() && vms.get(*vm).is_some());
        if arrivals.is_empty() {
            return;
        }
        // Per MAD of the batch, group after group: the verdict, and the index of the
        // port it goes to (`usize::MAX`: none). One allocation each for the whole batch.
        let total = arrivals.iter().map(|(_, m)| m.len()).sum();
        let mut verdicts = vec![WireVerdict::Reply; total];
        let mut to_port = vec![usize::MAX; total];
        let out: Vec<Outgoing>;
        {
            let mut core = self.shared.lock_core();
            let mut at = 0;
            for (vm, mads) in &mut arrivals {
                let n = mads.len();
                let (v, t) = (&mut verdicts[at..at + n], &mut to_port[at..at + n]);
                at += n;
                let Some(port) = vms.get(*vm) else {
                    continue;
                };
                // One call per VM's group: the mux prefetches every entry it names first.
                core.mux.from_wire_batch(mads, |_, f| (f.src, f.dst), v);
                for ((f, verdict), target) in mads.iter().zip(v.iter()).zip(t) {
                    match *verdict {
                        WireVerdict::ToVm(id) => {
                            if let Some(&p) = core.by_vm.get(&id) {
                                *target = p;
                            }
                        }
                        WireVerdict::Reply => {}
                        WireVerdict::Drop(r) => {
                            tracing::debug!(
                                parent: &port.span,
                                src = %f.src,
                                mad = %crate::rx::describe_mad(&f.mad),
                                reason = r.name(),
                                "wire MAD dropped by the mux"
                            );
                        }
                    }
                }
            }
            out = core.mux.drain_outbox().collect();
            core.commit();
        }
        let all = || {
            arrivals
                .iter()
                .flat_map(|(vm, mads)| mads.iter().map(move |f| (*vm, f)))
        };
        let mut woken: Vec<usize> = Vec::new();
        for ((_, f), &p) in all().zip(&to_port) {
            if let Some(vp) = vms.get(p)
                && vp.push_rx(RxMsg::from_wire(f, &f.mad))
                && !woken.contains(&p)
            {
                woken.push(p);
            }
        }
        for p in woken {
            if let Some(vp) = vms.get(p) {
                vp.deliver_rx();
            }
        }
        // To the sender's GID, from the VM's own address (the soft port: its RoCEv2
        // port; its UDP source port is entropy, as Linux rxe hashes the flow label into
        // it). Replies are rare (the mux answers for the VM): only a group that has one
        // collects them.
        let mut at = 0;
        for (vm, mads) in &arrivals {
            let v = &verdicts[at..at + mads.len()];
            at += mads.len();
            if !v.contains(&WireVerdict::Reply) {
                continue;
            }
            let replies: Vec<_> = mads
                .iter()
                .zip(v)
                .filter(|(_, v)| **v == WireVerdict::Reply)
                .map(|(f, _)| (f.src, &f.mad))
                .collect();
            if let Some(port) = vms.get(*vm) {
                self.shared.send_mads(port, &replies);
            }
        }
        if !out.is_empty() {
            self.shared.send_outgoing(out);
        }
    }

    fn accept_control(&self) {
        let Some(l) = &self.control else { return };
        while let Ok((s, _)) = l.accept() {
            let Some(slot) = self.serving.take() else {
                tracing::warn!("control: too many requests at once; connection closed");
                continue;
            };
            let runtime = self.runtime.clone();
            let _ = std::thread::Builder::new()
                .name("pvcm-control".into())
                .spawn(move || {
                    crate::control::serve_control(&runtime, s);
                    drop(slot);
                });
        }
    }

    fn accept_metrics(&self) {
        let Some(l) = &self.metrics else { return };
        while let Ok((s, _)) = l.accept() {
            let Some(slot) = self.serving.take() else {
                tracing::warn!("metrics: too many requests at once; connection closed");
                continue;
            };
            let shared = self.shared.clone();
            let _ = std::thread::Builder::new()
                .name("pvcm-metrics".into())
                .spawn(move || {
                    crate::control::serve_metrics(&shared, s);
                    drop(slot);
                });
        }
    }
}

/// The mux's clock: CLOCK_MONOTONIC (time since boot), so that deadlines in the state
/// journal mean the same in the next process.
fn boot_clock() -> SystemClock {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let now = std::time::Instant::now();
    // SAFETY: `ts` is a valid timespec for the call to fill.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } == 0;
    let since_boot = Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    );
    match now.checked_sub(since_boot) {
        Some(epoch) if ok => SystemClock::with_epoch(epoch),
        _ => SystemClock::new(),
    }
}

/// Gives each VM the journal had attached back to its port (same name and GID): its
/// connections stay, and its session is awaited. A VM no longer configured is detached:
/// the mux releases its connections on its behalf.
fn adopt_restored(shared: &Arc<Shared>, rec: &Recovery) {
    let mut gone = Vec::new();
    {
        let mut core = shared.lock_core();
        for (id, vcfg) in &rec.attached {
            let vms = shared.vms();
            let port = vms
                .iter()
                .find(|p| p.spec.vm.name == vcfg.name && p.spec.vm.gid == vcfg.gid);
            match port {
                Some(p) if shared.port.attach(p.index).is_ok() => {
                    let tx_resume = rec
                        .tx_progress
                        .iter()
                        .find(|(n, _)| *n == vcfg.name)
                        .map(|(_, i)| *i);
                    *p.lifecycle() = Lifecycle::Restored { vm: *id, tx_resume };
                    core.by_vm.insert(*id, p.index);
                }
                _ => {
                    core.mux.detach_vm(*id);
                    gone.push(vcfg.name.clone());
                }
            }
        }
        core.commit();
        let out: Vec<Outgoing> = core.mux.drain_outbox().collect();
        drop(core);
        shared.send_outgoing(out);
    }
    tracing::info!(
        frames = rec.frames,
        torn_bytes = rec.torn_bytes,
        live = rec.live,
        quarantined = rec.quarantined,
        vms = rec.attached.len() - gone.len(),
        "state restored"
    );
    for name in gone {
        tracing::warn!(vm = %name, "restored VM is no longer configured (or its GID changed): its connections are released");
    }
}

/// After the reconnect grace, releases the connections of restored VMs that did not
/// come back.
fn release_unreturned(shared: &Arc<Shared>, grace: Duration) {
    let end = std::time::Instant::now() + grace;
    while std::time::Instant::now() < end {
        if shared.stopping() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100).min(grace));
    }
    for p in shared.vms().iter() {
        if matches!(*p.lifecycle(), Lifecycle::Restored { .. }) {
            tracing::warn!(parent: &p.span, grace_s = grace.as_secs(), "restored VM did not reconnect: releasing its connections");
            shared.detach(p);
        }
    }
}

/// An I/O error's mapping to [`Error::Io`], saying what was being done.
fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// With a state directory, applies the VM changes made at runtime (kept there) over the
/// config file's VMs in `cfg`; returns those changes.
fn apply_overlay(cfg: &mut Config) -> Result<Overlay, Error> {
    let overlay = match &cfg.state_dir {
        Some(dir) => Overlay::load(dir)?,
        None => Overlay::default(),
    };
    if overlay != Overlay::default() {
        let (vms, warnings) = overlay.apply(&cfg.vms, cfg.control.as_deref(), false)?;
        for w in warnings {
            tracing::warn!("{w}");
        }
        tracing::info!(
            added = overlay.added.len(),
            removed = overlay.removed.len(),
            quotas = overlay.quotas.len(),
            "runtime VM changes kept in the state directory applied over the config"
        );
        cfg.vms = vms;
    }
    Ok(overlay)
}

/// Opens the wire port the configuration names, for its VMs.
fn open_port(cfg: &Config) -> Result<Box<dyn WirePort>, Error> {
    Ok(match &cfg.port {
        PortSpec::Soft => {
            let addrs: Vec<crate::port::soft::SoftVmAddrs> = cfg
                .vms
                .iter()
                .map(|v| {
                    let addrs = v.addrs().map(|(a, i)| (a, i.map(str::to_string)));
                    (v.vm.name.clone(), addrs.collect())
                })
                .collect();
            let incoming: Vec<bool> = cfg.vms.iter().map(|v| v.incoming).collect();
            Box::new(SoftPort::open(
                &addrs,
                &incoming,
                cfg.bind_port,
                cfg.wire_rx,
            )?)
        }
        PortSpec::Packet { dev, iface } => {
            let vms: Vec<(String, Vec<std::net::IpAddr>)> = cfg
                .vms
                .iter()
                .map(|v| (v.vm.name.clone(), v.addrs().map(|(a, _)| a).collect()))
                .collect();
            Box::new(PacketPort::open(
                dev,
                iface.as_deref(),
                &vms,
                cfg.bind_port,
            )?)
        }
        PortSpec::Umad { device, port } => {
            let vms: Vec<(String, Vec<Gid>)> = cfg
                .vms
                .iter()
                .map(|v| (v.vm.name.clone(), v.vm.gids().collect()))
                .collect();
            Box::new(UmadPort::open(
                std::path::Path::new(&cfg.sysfs),
                device,
                *port,
                &vms,
            )?)
        }
    })
}

/// The mux, with its state journal and what was recovered from it (none without a
/// state directory).
type OpenedMux = (Mux<SystemClock>, Option<Journal>, Option<Recovery>);

/// The mux: restored from the state directory's journal if there is one (with the
/// journal and what was recovered), else new.
fn open_mux(cfg: &Config) -> Result<OpenedMux, Error> {
    let seed = cfg.seed.unwrap_or_else(pvcm_wire::seed::os_seed);
    let mux_cfg = MuxConfig {
        policy: cfg.policy,
        seed,
        ..MuxConfig::default()
    };
    let clock = boot_clock();
    Ok(match &cfg.state_dir {
        Some(dir) => {
            let (j, mux, rec) = Journal::open(dir, mux_cfg, clock)?;
            if cfg.seed.is_some_and(|s| s != mux.config().seed) && rec.frames > 0 {
                tracing::warn!("--seed differs from the state journal's: keeping the journal's");
            }
            (mux, Some(j), Some(rec))
        }
        None => (Mux::new(mux_cfg, clock), None, None),
    })
}

/// The daemon's listening sockets, bound: each VM's vhost-user socket, the control
/// socket and the metrics endpoint. The socket files go with this (or with the daemon
/// they are handed to).
struct Sockets {
    vms: Vec<(SocketFile, Listener)>,
    control: Option<UnixListener>,
    control_file: Option<SocketFile>,
    metrics: Option<TcpListener>,
}

impl Sockets {
    fn bind(cfg: &Config) -> Result<Sockets, Error> {
        let mut vms = Vec::new();
        for spec in &cfg.vms {
            let (l, file) =
                crate::files::bind_socket(&spec.socket, &cfg.vm_sockets).map_err(|source| {
                    Error::Socket {
                        what: format!("VM {}: vhost-user socket", spec.vm.name),
                        source,
                    }
                })?;
            vms.push((file, Listener::from(l)));
        }
        let (control, control_file) = match &cfg.control {
            Some(p) => {
                let (l, file) =
                    crate::control::bind_control(p, &cfg.control_access).map_err(|source| {
                        Error::Socket {
                            what: "--control".into(),
                            source,
                        }
                    })?;
                l.set_nonblocking(true).map_err(io_err("control"))?;
                (Some(l), Some(file))
            }
            None => (None, None),
        };
        let metrics = match cfg.metrics {
            Some(a) => {
                let l = TcpListener::bind(a).map_err(io_err(format!("--metrics {a}")))?;
                l.set_nonblocking(true).map_err(io_err("metrics"))?;
                Some(l)
            }
            None => None,
        };
        Ok(Sockets {
            vms,
            control,
            control_file,
            metrics,
        })
    }

    /// Adds what the host loop waits on to `epoll`: the port's descriptors, the stop
    /// and wake events, the timer, the control and metrics sockets.
    fn watch(
        &self,
        epoll: &Epoll,
        shared: &Shared,
        stop: &EventFd,
        timer: &Timer,
    ) -> Result<(), Error> {
        let add = |fd: i32, tok: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, tok),
                )
                .map_err(io_err("epoll_ctl"))
        };
        for (fd, tok) in shared.port.poll_fds() {
            add(fd, tok)?;
        }
        add(stop.as_raw_fd(), TOK_STOP)?;
        add(timer.fd.as_raw_fd(), TOK_TIMER)?;
        add(shared.timer_wake.as_raw_fd(), TOK_WAKE)?;
        if let Some(l) = &self.control {
            add(l.as_raw_fd(), TOK_CONTROL)?;
        }
        if let Some(l) = &self.metrics {
            add(l.as_raw_fd(), TOK_METRICS)?;
        }
        Ok(())
    }
}

/// A running daemon (in-process).
#[derive(Debug)]
pub struct Daemon {
    shared: Arc<Shared>,
    /// The VMs' threads and the changes made to the VMs while running.
    runtime: Arc<Runtime>,
    stop: Arc<EventFd>,
    /// The thread that releases restored VMs that do not come back in time.
    grace: Option<JoinHandle<()>>,
    host: Option<JoinHandle<()>>,
    /// Removed when the daemon stops: the control socket (the VMs' go with their
    /// threads, [`crate::runtime`]).
    socket_files: Vec<SocketFile>,
    metrics: Option<SocketAddr>,
}

impl Daemon {
    /// Binds everything (wire sockets, vhost-user sockets, control, metrics, capture) and
    /// starts the threads. When this returns, every socket accepts.
    pub fn start(mut cfg: Config) -> Result<Daemon, Error> {
        cfg.validate()?;
        let file_vms = cfg.vms.clone();
        let overlay = apply_overlay(&mut cfg)?;
        let timer_wake = EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?;
        let mut ports = Vec::new();
        let host_budget = HostBudget::new(cfg.rx_host_backlog_bytes);
        let port = open_port(&cfg)?;
        for (i, spec) in cfg.vms.iter().enumerate() {
            let port = VmPort::new(i, spec.clone(), cfg.rx_backlog_bytes, host_budget.clone())
                .map_err(io_err("eventfd"))?;
            ports.push(Arc::new(port));
        }
        let capture = match &cfg.pcap {
            Some(p) => Some(Capture::create(p).map_err(io_err(format!("--pcap {}", p.display())))?),
            None => None,
        };
        let (mux, journal, recovery) = open_mux(&cfg)?;
        let default_quota = mux.config().default_quota;
        let epoll = Arc::new(Epoll::new().map_err(io_err("epoll"))?);
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                mux,
                by_vm: HashMap::new(),
                journal,
            }),
            vms: VmTable::new(VmSet::new(ports)),
            capture,
            timer_wake,
            armed: AtomicU64::new(u64::MAX),
            default_quota,
            path_mtu: cfg.path_mtu,
            ca_ack_delay: cfg.ca_ack_delay,
            policy: cfg.policy.name().to_string(),
            port,
            port_counters: DevCounters::default(),
            retired: DevCounters::default(),
            stop: AtomicBool::new(false),
            keeps_state: cfg.state_dir.is_some(),
            reloads: Mutex::default(),
        });
        let runtime = Arc::new(Runtime::new(
            shared.clone(),
            RuntimeState {
                rx_backlog_bytes: cfg.rx_backlog_bytes,
                host_budget,
                vm_sockets: cfg.vm_sockets,
                control: cfg.control.clone(),
                state_dir: cfg.state_dir.clone(),
                epoll: epoll.clone(),
                threads: HashMap::new(),
                file_vms,
                overlay,
            },
        ));
        if let Some(rec) = &recovery {
            adopt_restored(&shared, rec);
        }
        // The socket files go with the daemon (or with this function, if it fails).
        let sockets = Sockets::bind(&cfg)?;
        let metrics_addr = sockets.metrics.as_ref().and_then(|l| l.local_addr().ok());
        let stop = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(io_err("eventfd"))?);
        let timer = Timer::new().map_err(io_err("timerfd"))?;
        sockets.watch(&epoll, &shared, &stop, &timer)?;
        let host = HostLoop {
            shared: shared.clone(),
            runtime: runtime.clone(),
            epoll,
            timer,
            control: sockets.control,
            metrics: sockets.metrics,
            serving: Arc::default(),
            rx_coalesce: cfg.rx_coalesce,
        };
        let host = std::thread::Builder::new()
            .name("pvcm-host".into())
            .spawn(move || {
                let _s = tracing::info_span!("host").entered();
                host.run();
            })
            .map_err(io_err("spawn"))?;
        let mut grace_thread = None;
        if recovery.as_ref().is_some_and(|r| !r.attached.is_empty()) {
            let s = shared.clone();
            let grace = cfg.reconnect_grace;
            let t = std::thread::Builder::new()
                .name("pvcm-grace".into())
                .spawn(move || release_unreturned(&s, grace))
                .map_err(io_err("spawn"))?;
            grace_thread = Some(t);
        }
        {
            let mut rt = runtime.state();
            for (port, (file, l)) in shared.vms().iter().zip(sockets.vms) {
                rt.spawn(&shared, port.clone(), l, file)?;
            }
        }
        tracing::info!(
            vms = cfg.vms.len(),
            policy = cfg.policy.name(),
            port = %cfg.port,
            wire_rx = %shared.port.rx_mode(),
            "pvcm-backend started"
        );
        Ok(Daemon {
            shared,
            runtime,
            stop,
            grace: grace_thread,
            host: Some(host),
            socket_files: sockets.control_file.into_iter().collect(),
            metrics: metrics_addr,
        })
    }

    /// Every figure, per VM and summed.
    pub fn snapshot(&self) -> Snapshot {
        self.shared.snapshot()
    }

    /// Reads the configuration again (SIGHUP, as `pvcm-backend reload` does through the
    /// control socket) and logs the outcome ([`Runtime::reload`]): the VMs change by
    /// the difference; other options changed are named, and take effect at the next
    /// start only.
    pub fn reload(&self) {
        match self.runtime.reload() {
            Ok(r) if r.restart_needed.is_empty() => tracing::info!(
                applied = r.report.applied.len(),
                failed = r.report.failed.len(),
                "reload: the VMs changed by the difference"
            ),
            Ok(r) => tracing::warn!(
                applied = r.report.applied.len(),
                failed = r.report.failed.len(),
                restart_needed = %r.restart_needed.join(","),
                "reload: the VMs changed by the difference; the other options changed take effect at the next start only"
            ),
            Err(e) => tracing::error!(error = %e, "reload refused: nothing changed"),
        }
    }

    /// The metrics listener's address (useful with port 0).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// The shared state (for benches and tests in this crate).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Stops: ends every VM session (releasing their connections on the wire), stops
    /// the host loop, flushes the capture, removes the sockets.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        if self.host.is_none() {
            return;
        }
        tracing::info!("shutting down");
        self.shared.stop.store(true, Ordering::Release);
        // The threads are taken under the runtime lock (no VM is added or removed
        // meanwhile) and joined without it, so `vm list` and the like answer (or are
        // refused as the daemon stops) while the sessions end.
        let threads = {
            let mut rt = self.runtime.state();
            for port in self.shared.vms().iter() {
                if let Some(h) = lock(&port.session).as_ref() {
                    h.0.shutdown();
                }
                port.wake_accept();
            }
            rt.take_threads()
        };
        crate::runtime::join_threads(threads);
        if let Some(t) = self.grace.take() {
            let _ = t.join();
        }
        let _ = self.stop.write(1);
        if let Some(h) = self.host.take() {
            let _ = h.join();
        }
        if let Some(c) = &self.shared.capture {
            c.flush();
        }
        {
            let mut core = self.shared.lock_core();
            core.commit();
            let core = &mut *core;
            if let Some(j) = &mut core.journal {
                j.sync();
                tracing::info!(dir = %j.dir().display(), live = core.mux.live_entries(), "state kept for the next start");
            }
        }
        self.socket_files.clear();
        tracing::info!("stopped");
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// Runs the daemon until SIGTERM or SIGINT, then shuts down cleanly. SIGHUP reads the
/// configuration again from `args` (the config file and the command line) and applies
/// the difference in its VMs ([`Daemon::reload`]); a file that does not read or check
/// is logged and changes nothing.
pub fn run(cfg: Config, args: &crate::config::ServeArgs) -> Result<(), Error> {
    // Block the signals in this thread before any other starts (they inherit the mask),
    // then wait for them here.
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; the calls only modify it and this thread's mask.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let running = cfg.clone();
    let daemon = Daemon::start(cfg)?;
    daemon.runtime.set_reload_source(args.clone(), running);
    // Every socket listens: a VMM started after this finds its socket.
    let status = |d: &Daemon| format!("STATUS=serving {} VMs", d.shared.vms().len());
    crate::notify::notify(&format!("READY=1\n{}", status(&daemon)));
    loop {
        let mut sig: libc::c_int = 0;
        // SAFETY: `set` and `sig` are valid for the call; sigwait blocks until one of
        // the blocked signals is pending.
        let r = unsafe { libc::sigwait(&set, &mut sig) };
        if r == 0 && sig == libc::SIGHUP {
            crate::notify::notify(&format!(
                "RELOADING=1\nMONOTONIC_USEC={}",
                boot_clock_usec()
            ));
            tracing::info!("SIGHUP: reading the configuration again");
            daemon.reload();
            crate::notify::notify(&format!("READY=1\n{}", status(&daemon)));
            continue;
        }
        if r == 0 {
            tracing::info!(signal = sig, "signal received");
        }
        break;
    }
    crate::notify::notify("STOPPING=1");
    daemon.shutdown();
    Ok(())
}

/// CLOCK_MONOTONIC in microseconds, as sd_notify's `MONOTONIC_USEC` wants it.
fn boot_clock_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec.max(0) as u64) * 1_000_000 + (ts.tv_nsec.max(0) as u64) / 1_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_busy_wakeup_pauses_the_host_loop() {
        let c = RxCoalesce::new(Duration::from_micros(50));
        for mads in [0, 1, RxCoalesce::BUSY - 1] {
            assert_eq!(c.pause_after(mads), None, "{mads} MADs");
        }
        for mads in [RxCoalesce::BUSY, 64, 10_000] {
            assert_eq!(c.pause_after(mads), Some(Duration::from_micros(50)));
        }
        let off = RxCoalesce::new(Duration::ZERO);
        assert_eq!(off.pause_after(64), None);
    }
}

//! The service's loop: CUSE requests in, the rdma_cm layer, the pvcm device.
//!
//! One thread does everything, in this order, over and over: take every CUSE request
//! waiting (run commands, open and release files, arm poll handles, answer
//! interrupts), answer `stat` on the control socket, follow the VM's RDMA device (every
//! 500 ms: `Cma::update_port`), pump the device (MADs in and out,
//! the agent's timers), route the agent's events into the files' queues, fill the
//! GET_EVENTs blocked on those files and wake their pollers; try the address
//! resolutions that wait for a neighbour (`Cma::poll_addr`); then sleep until the
//! device notifies, a CUSE request or a control connection arrives, a neighbour changes
//! (the rtnetlink socket of the resolutions), or the agent's next timer, a
//! resolution's timeout or the next look at the device is due.
//!
//! A blocked GET_EVENT is a request left unanswered: the calling thread sleeps in the
//! kernel until the answer is written (an event), or an INTERRUPT comes (a signal):
//! EINTR for a fatal one, so the process exits at once, and otherwise the restart event,
//! which librdmacm answers with a new GET_EVENT once the thread has stopped, been
//! traced or run its handler (`signals.rs`). O_NONBLOCK files get EAGAIN.
//!
//! MIGRATE_ID names the old file by the caller's descriptor, which only the caller's
//! descriptor table resolves: the server duplicates that descriptor into itself
//! (`pidfd_getfd`) and asks it a private ioctl from a helper thread; the request comes
//! back with the file's handle, and the migration completes. A descriptor that is not
//! one of this device's files is EINVAL, a closed one ENOENT, as in the kernel.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use pvcm_wire::abi::PortInfo;
use serde_json::{Value, json};

use super::abi::{cmd, event};
use super::caller::ProcessMemory;
use super::cma::{Caller, Cma, Env, Fh, Outcome, errno};
use super::cuse::{self, CuseDev, READ_BUFFER, Reply, Request};
use super::signals::{self, Answer, Reason, ThreadSignals};
use super::verbs::PortWatch;
use crate::cm::Agent;
use crate::device::{Device, DeviceError, DeviceEvent, Transport};
use crate::report::{cm_counters_json, pacing_json};
use crate::time::SystemClock;

/// The longest sleep of the loop.
const MAX_SLEEP: Duration = Duration::from_secs(2);

/// The private ioctl of the MIGRATE_ID descriptor probe (`_IO('p', 0xC1)`).
pub const PROBE_IOCTL: u32 = (b'p' as u32) << 8 | 0xC1;

/// Errors that stop the service.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The device failed.
    #[error("{0}")]
    Device(#[from] DeviceError),
    /// An OS call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel's CUSE_INIT did not come or was not understood.
    #[error("CUSE handshake: {0}")]
    Handshake(String),
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServiceError {
    let what = what.into();
    move |source| ServiceError::Io { what, source }
}

/// What the loop counted.
#[derive(Debug, Clone, Default)]
pub struct ServerStats {
    /// CUSE requests taken.
    pub requests: u64,
    /// Requests that could not be read (counted, answered EINVAL when possible).
    pub bad_requests: u64,
    /// GET_EVENTs that blocked.
    pub blocked: u64,
    /// Blocked GET_EVENTs a fatal signal ended (answered EINTR).
    pub interrupted: u64,
    /// Blocked GET_EVENTs a signal interrupted and the restart event answered, by
    /// [`Reason`] (stop, handler, traced, unseen).
    pub restarted: [u64; 4],
    /// Poll wakeups sent.
    pub poll_wakeups: u64,
    /// Device resets survived.
    pub device_resets: u64,
    /// MIGRATE_IDs served.
    pub migrations: u64,
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    unique: u64,
    pid: u32,
    response: u64,
    out_len: u16,
    /// The write's size, for its answer.
    size: u32,
}

#[derive(Debug)]
struct Migration {
    unique: u64,
    pid: u32,
    size: u32,
    to: Fh,
    id: u32,
    response: u64,
    token: u64,
    from: Option<Fh>,
    /// The probe failed before asking (the descriptor could not be taken).
    failed: Option<i32>,
}

/// Options of the service.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// `/dev/cuse`.
    pub cuse: PathBuf,
    /// The node's name under /dev.
    pub devname: String,
    /// Mode of the node once it appears (the kernel's rdma_cm node is 0666).
    pub mode: u32,
    /// The control socket for `stat`.
    pub control: Option<PathBuf>,
    /// The VM's RDMA device to follow while serving (`None`: the port given at start
    /// stays as it is).
    pub watch: Option<PortWatch>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            cuse: PathBuf::from("/dev/cuse"),
            devname: "infiniband/rdma_cm".into(),
            mode: 0o666,
            control: Some(PathBuf::from("/run/pvcm-guestd.sock")),
            watch: None,
        }
    }
}

/// The guest CM service over a started pvcm device.
pub struct Server<'d, T: Transport> {
    dev: &'d mut Device<T, SystemClock>,
    cma: Cma,
    cuse: CuseDev,
    control: Option<UnixListener>,
    waiters: HashMap<Fh, VecDeque<Waiter>>,
    migrations: Vec<Migration>,
    stats: ServerStats,
    stop: &'static AtomicBool,
    seed: u64,
    /// The node's device number: a MIGRATE_ID descriptor must be one of its files.
    rdev: Option<u64>,
    /// The VM's RDMA device, followed.
    watch: Option<PortWatch>,
    /// When to read it next.
    next_watch: Instant,
}

impl<T: Transport> std::fmt::Debug for Server<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("cma", &self.cma)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl<'d, T: Transport> Server<'d, T> {
    /// Opens CUSE, answers its CUSE_INIT (the node appears) and sets the node's mode;
    /// `stop` ends [`Server::run`] when set.
    pub fn start(
        dev: &'d mut Device<T, SystemClock>,
        cma: Cma,
        opts: &ServerOptions,
        stop: &'static AtomicBool,
    ) -> Result<Server<'d, T>, ServiceError> {
        let cuse = CuseDev::open(&opts.cuse).map_err(io_err(format!(
            "opening {} (modprobe cuse)",
            opts.cuse.display()
        )))?;
        handshake(&cuse, &opts.devname)?;
        let node = Path::new("/dev").join(&opts.devname);
        let rdev = wait_for_node(&node, opts.mode);
        let control = match &opts.control {
            Some(p) => {
                let _ = std::fs::remove_file(p);
                let l = UnixListener::bind(p).map_err(io_err(format!(
                    "binding the control socket {}",
                    p.display()
                )))?;
                l.set_nonblocking(true)
                    .map_err(io_err("control socket non-blocking"))?;
                Some(l)
            }
            None => None,
        };
        let seed = dev.options().seed;
        Ok(Server {
            dev,
            cma,
            cuse,
            control,
            waiters: HashMap::new(),
            migrations: Vec::new(),
            stats: ServerStats::default(),
            stop,
            seed,
            rdev,
            watch: opts.watch.clone(),
            next_watch: Instant::now(),
        })
    }

    /// Serves until the stop flag is set or the device fails.
    pub fn run(&mut self) -> Result<(), ServiceError> {
        const CUSE: u64 = 1;
        const CONTROL: u64 = 2;
        let mut buf = vec![0u8; READ_BUFFER];
        let mut fds = vec![self.cuse.fd()];
        if let Some(c) = &self.control {
            fds.push(c.as_raw_fd());
        }
        let base = fds.len();
        // Readable descriptors after a sleep; a sleep cut short by device work (0)
        // still looks at CUSE, so a busy device never starves the processes.
        let mut ready = CUSE | CONTROL;
        while !self.stop.load(Ordering::Relaxed) {
            if ready & CUSE != 0 || ready == 0 {
                while let Some(n) = self
                    .cuse
                    .read(&mut buf)
                    .map_err(io_err("reading /dev/cuse"))?
                {
                    self.request(&buf[..n])?;
                }
            }
            if ready & CONTROL != 0 {
                self.serve_control();
            }
            // What following the device makes the agent send (a closed connection's DREQ)
            // leaves in the pump.
            self.follow_port()?;
            self.pump()?;
            self.poll_addr()?;
            // The neighbour socket is there from the first resolution on.
            fds.truncate(base);
            fds.extend(self.cma.addr_fd());
            // A stop signal cuts the sleep short (EINTR); the bound only covers one
            // that lands between the check above and the sleep.
            let now = self.dev.now();
            let mut sleep = self
                .cma
                .next_addr_deadline()
                .map_or(MAX_SLEEP, |d| d.since(now).min(MAX_SLEEP));
            if self.watch.is_some() {
                sleep = sleep.min(self.next_watch.saturating_duration_since(Instant::now()));
            }
            ready = self.dev.sleep_with(sleep, &fds)?;
        }
        self.shut_down();
        Ok(())
    }

    /// The service stops: its callers' files die with it (the kernel fails their
    /// pending and later calls), so every file is released here as at a close, and
    /// what that sends (DREQs, REJs) leaves before the device is dropped: the peers
    /// see the connections end now, not after their timeouts.
    fn shut_down(&mut self) {
        let now = self.dev.now();
        let mut env = Env {
            agent: self.dev.agent_mut(),
            now,
        };
        let files = self.cma.release_all(&mut env);
        let ids = self.cma.stats().released_ids;
        let flushed = self.dev.flush(Duration::from_secs(2));
        tracing::info!(files, released_ids = ids, flushed = ?flushed.ok(), "stopped serving: every file released");
    }

    /// The rdma_cm layer (for tests and `stat`).
    pub fn cma(&self) -> &Cma {
        &self.cma
    }

    /// The device.
    pub fn device(&self) -> &Device<T, SystemClock> {
        self.dev
    }

    fn pump(&mut self) -> Result<(), ServiceError> {
        loop {
            let p = self.dev.pump_now()?;
            let mut touched: HashSet<Fh> = HashSet::new();
            while let Some(e) = self.dev.pop_device_event() {
                if matches!(e, DeviceEvent::Reset) {
                    self.stats.device_resets += 1;
                    let now = self.dev.now();
                    let mut env = Env {
                        agent: self.dev.agent_mut(),
                        now,
                    };
                    touched.extend(self.cma.device_reset(&mut env));
                }
            }
            let now = self.dev.now();
            while let Some(ev) = self.dev.pop_cm_event() {
                let mut env = Env {
                    agent: self.dev.agent_mut(),
                    now,
                };
                if let Some(fh) = self.cma.on_agent_event(ev, &mut env) {
                    touched.insert(fh);
                }
            }
            for fh in touched {
                self.serve_waiters(fh)?;
            }
            // What the events made the agent send (a refused request's REJ) leaves
            // now; a full rx batch means more may be waiting.
            if self.dev.agent().outbox_len() == 0 && p.rx < self.dev.options().rx_batch {
                return Ok(());
            }
        }
    }

    /// The address resolutions that a neighbour's change or their timeout ends.
    fn poll_addr(&mut self) -> Result<(), ServiceError> {
        let now = self.dev.now();
        for fh in self.cma.poll_addr(now) {
            self.serve_waiters(fh)?;
        }
        Ok(())
    }

    /// Reads the VM's RDMA device again when it is time, and hands what it found to the
    /// rdma_cm layer ([`Cma::update_port`]): the files that got events are served.
    fn follow_port(&mut self) -> Result<(), ServiceError> {
        let Some(w) = &mut self.watch else {
            return Ok(());
        };
        if Instant::now() < self.next_watch {
            return Ok(());
        }
        self.next_watch = Instant::now() + w.every;
        let Some(view) = w.view(!self.cma.addr_present()) else {
            return Ok(());
        };
        let now = self.dev.now();
        let mut env = Env {
            agent: self.dev.agent_mut(),
            now,
        };
        let u = self.cma.update_port(&view, &mut env);
        let p = self.cma.port();
        if u.removed {
            tracing::warn!(device = %p.device, ids = u.removed_ids, "the RDMA device went: DEVICE_REMOVAL to the ids bound to it");
        }
        if u.arrived {
            tracing::info!(device = %p.device, port = p.port_num, gid_index = p.gid_index, netdev = %p.netdev, path_mtu = p.path_mtu, "an RDMA device holds the pvcm GID: new ids use it");
        }
        if u.changed {
            tracing::info!(device = %p.device, gid_index = p.gid_index, netdev = %p.netdev, path_mtu = p.path_mtu, "the RDMA port changed");
        }
        if u.addr_gone {
            tracing::warn!(addr = %p.addr, device = %p.device, "the pvcm GID's address left the RDMA device's GID table: binds to it fail until it is back");
        }
        if u.addr_back {
            tracing::info!(addr = %p.addr, device = %p.device, "the pvcm GID's address is back");
        }
        if u.addr_change_ids > 0 {
            tracing::info!(netdev = %p.netdev, ids = u.addr_change_ids, "the bond failed over: ADDR_CHANGE to the ids bound to it");
        }
        for fh in u.files {
            self.serve_waiters(fh)?;
        }
        Ok(())
    }

    fn reply(&self, r: &Reply) -> Result<(), ServiceError> {
        self.cuse
            .write(r.bytes())
            .map_err(io_err("answering on /dev/cuse"))
    }

    /// Answers one CUSE request. Longer than the other functions on purpose: it is the
    /// one dispatch table of the CUSE requests, one short arm per request, and reads
    /// best whole.
    fn request(&mut self, b: &[u8]) -> Result<(), ServiceError> {
        self.stats.requests += 1;
        let (h, r) = match Request::parse(b) {
            Ok(x) => x,
            Err(_) => {
                self.stats.bad_requests += 1;
                // Answer what can be answered, so no caller hangs on it.
                if b.len() >= 16 {
                    let mut u = [0u8; 8];
                    u.copy_from_slice(&b[8..16]);
                    return self.reply(&Reply::error(u64::from_le_bytes(u), errno::EINVAL));
                }
                return Ok(());
            }
        };
        match r {
            Request::Init { .. } => self.reply(&Reply::error(h.unique, errno::EINVAL)),
            Request::Open { .. } => {
                let fh = self.cma.open();
                self.reply(&Reply::open(h.unique, fh))
            }
            Request::Release { fh } => {
                self.waiters.remove(&fh);
                let now = self.dev.now();
                let mut env = Env {
                    agent: self.dev.agent_mut(),
                    now,
                };
                self.cma.release(fh, &mut env);
                self.reply(&Reply::empty(h.unique))
            }
            Request::Write {
                fh,
                offset,
                flags,
                data,
            } => {
                if offset != 0 {
                    return self.reply(&Reply::error(h.unique, errno::EINVAL));
                }
                let size = data.len() as u32;
                let mut mem = ProcessMemory::new(h.pid);
                let now = self.dev.now();
                let mut env = Env {
                    agent: self.dev.agent_mut(),
                    now,
                };
                let out = self
                    .cma
                    .write(fh, Caller { uid: h.uid }, data, &mut mem, &mut env);
                match out {
                    Outcome::Done(r) => {
                        match r {
                            Ok(()) => self.reply(&Reply::write(h.unique, size))?,
                            Err(e) => self.reply(&Reply::error(h.unique, e))?,
                        }
                        // A command may have queued an event of its own (ADDR_RESOLVED,
                        // ROUTE_RESOLVED) for another thread's blocked GET_EVENT.
                        self.serve_waiters(fh)
                    }
                    Outcome::WaitEvent { response, out_len } => {
                        if flags & libc::O_NONBLOCK as u32 != 0 {
                            return self.reply(&Reply::error(h.unique, errno::EAGAIN));
                        }
                        self.stats.blocked += 1;
                        self.waiters.entry(fh).or_default().push_back(Waiter {
                            unique: h.unique,
                            pid: h.pid,
                            response,
                            out_len,
                            size,
                        });
                        Ok(())
                    }
                    Outcome::Migrate {
                        id,
                        fd,
                        response,
                        out_len: _,
                    } => {
                        self.start_migration(h.unique, h.pid, size, fh, id, fd, response);
                        self.finish_migrations()
                    }
                }
            }
            Request::Read { .. } => self.reply(&Reply::error(h.unique, errno::EINVAL)),
            Request::Poll { fh, kh, flags, .. } => {
                if flags & cuse::FUSE_POLL_SCHEDULE_NOTIFY != 0 {
                    self.cma.set_poll_handle(fh, kh);
                }
                let ready = if self.cma.has_events(fh) {
                    (libc::POLLIN | libc::POLLRDNORM) as u32
                } else {
                    0
                };
                self.reply(&Reply::poll(h.unique, ready))
            }
            Request::Interrupt { unique } => self.interrupt(unique),
            Request::Ioctl { fh, cmd, arg } => {
                let m = self
                    .migrations
                    .iter_mut()
                    .find(|m| cmd == PROBE_IOCTL && m.token == arg && m.from.is_none());
                match m {
                    Some(m) => {
                        m.from = Some(fh);
                        self.reply(&Reply::ioctl(h.unique, 0))?;
                        self.finish_migrations()
                    }
                    None => self.reply(&Reply::error(h.unique, libc::ENOTTY)),
                }
            }
            Request::Other(_) => self.reply(&Reply::error(h.unique, errno::ENOSYS)),
        }
    }

    /// A signal came to the thread blocked in request `unique`: a GET_EVENT still
    /// waiting is answered at once (FUSE holds the thread until it is), with EINTR when
    /// the signal is fatal and with the restart event otherwise (`signals.rs`). A
    /// request already answered needs nothing (an INTERRUPT itself has no answer).
    fn interrupt(&mut self, unique: u64) -> Result<(), ServiceError> {
        let mut found = None;
        for q in self.waiters.values_mut() {
            if let Some(i) = q.iter().position(|w| w.unique == unique) {
                found = q.remove(i);
                break;
            }
        }
        let Some(w) = found else { return Ok(()) };
        let state = ThreadSignals::of_thread(w.pid);
        let restarted = match signals::answer(state.as_ref()) {
            Answer::Fatal => Err(errno::EINTR),
            Answer::Restart(reason) => {
                let mut mem = ProcessMemory::new(w.pid);
                self.cma
                    .restart(w.response, w.out_len, &mut mem)
                    .map(|()| reason)
                    // A caller whose memory is gone is exiting.
                    .map_err(|_| errno::EINTR)
            }
        };
        match restarted {
            Ok(reason) => {
                self.stats.restarted[reason as usize] += 1;
                self.reply(&Reply::write(w.unique, w.size))
            }
            Err(e) => {
                self.stats.interrupted += 1;
                self.reply(&Reply::error(w.unique, e))
            }
        }
    }

    /// Fills blocked GET_EVENTs of `fh` while it has events; wakes its poller if events
    /// remain.
    fn serve_waiters(&mut self, fh: Fh) -> Result<(), ServiceError> {
        while let Some(w) = self.waiters.get(&fh).and_then(|q| q.front()).copied() {
            let mut mem = ProcessMemory::new(w.pid);
            match self.cma.deliver(fh, w.response, w.out_len, &mut mem) {
                None => break,
                Some(r) => {
                    if let Some(q) = self.waiters.get_mut(&fh) {
                        q.pop_front();
                    }
                    match r {
                        Ok(()) => self.reply(&Reply::write(w.unique, w.size))?,
                        Err(e) => self.reply(&Reply::error(w.unique, e))?,
                    }
                }
            }
        }
        if self.cma.has_events(fh)
            && let Some(kh) = self.cma.take_poll_handle(fh)
        {
            self.stats.poll_wakeups += 1;
            self.reply(&Reply::notify_poll(kh))?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn start_migration(
        &mut self,
        unique: u64,
        pid: u32,
        size: u32,
        to: Fh,
        id: u32,
        fd: u32,
        response: u64,
    ) {
        self.seed = self
            .seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let token = self.seed ^ unique.rotate_left(17);
        let mut m = Migration {
            unique,
            pid,
            size,
            to,
            id,
            response,
            token,
            from: None,
            failed: None,
        };
        match take_fd(pid, fd, self.rdev) {
            Ok(dup) => {
                // The probe blocks in the kernel until this loop answers it, so it runs
                // on its own thread.
                let spawned =
                    std::thread::Builder::new()
                        .name("pvcm-probe".into())
                        .spawn(move || {
                            // SAFETY: an ioctl with an integer argument on a descriptor this
                            // thread owns; no memory is passed.
                            unsafe { libc::ioctl(dup.as_raw_fd(), PROBE_IOCTL as _, token) };
                            drop(dup);
                        });
                if spawned.is_err() {
                    m.failed = Some(errno::ENOMEM);
                }
            }
            Err(e) => m.failed = Some(e),
        }
        self.migrations.push(m);
    }

    fn finish_migrations(&mut self) -> Result<(), ServiceError> {
        let mut i = 0;
        while i < self.migrations.len() {
            let m = &self.migrations[i];
            let result = match (m.failed, m.from) {
                (Some(e), _) => Err(e),
                (None, Some(from)) => {
                    let mut mem = ProcessMemory::new(m.pid);
                    self.cma.migrate(m.to, from, m.id, m.response, &mut mem)
                }
                (None, None) => {
                    i += 1;
                    continue;
                }
            };
            let m = self.migrations.remove(i);
            self.stats.migrations += 1;
            match result {
                Ok(()) => self.reply(&Reply::write(m.unique, m.size))?,
                Err(e) => self.reply(&Reply::error(m.unique, e))?,
            }
            // The moved id's events may be waiting for a GET_EVENT of the new file.
            self.serve_waiters(m.to)?;
        }
        Ok(())
    }

    fn serve_control(&mut self) {
        let Some(l) = &self.control else { return };
        while let Ok((mut s, _)) = l.accept() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = writeln!(s, "{}", self.stat_json());
        }
    }

    /// What `pvcm-guestd stat` prints.
    pub fn stat_json(&self) -> Value {
        let c = self.cma.stats();
        let named = |v: &[u64], name: fn(u32) -> &'static str| -> Value {
            let m: serde_json::Map<String, Value> = v
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| (name(i as u32).to_string(), json!(n)))
                .collect();
            Value::Object(m)
        };
        let d = self.dev.stats();
        let p = self.cma.port();
        let mut v = json!({
            "port": {
                "device": p.device, "port": p.port_num, "gid": p.gid.to_string(),
                "gid_index": p.gid_index, "netdev": p.netdev, "path_mtu": p.path_mtu,
                "attached": self.cma.attached(), "addr_present": self.cma.addr_present(),
                "other_addrs": self.cma.other_addrs().iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            },
            "port_watch": {
                "looks": self.watch.as_ref().map_or(0, |w| w.looks),
                "reads": self.watch.as_ref().map_or(0, |w| w.reads),
            },
            "device_removals": c.device_removals,
            "device_arrivals": c.device_arrivals,
            "other_addr_binds": c.other_addr_binds,
            "files": self.cma.files(),
            "ids": self.cma.ids(),
            "resolving": self.cma.resolving(),
            "mcast_joins": self.cma.joins(),
            "mcast_joined": c.joins,
            "mcast_left": c.leaves,
            "igmp_groups": self.cma.igmp_groups().iter().map(|g| g.to_string()).collect::<Vec<_>>(),
            "commands": named(&c.commands, cmd::name),
            "command_errors": named(&c.errors, cmd::name),
            "events": named(&c.events, event::name),
            "events_reported": c.events_reported,
            "events_dropped": c.events_dropped,
            "backlog_full": c.backlog_full,
            "opens": c.opens,
            "releases": c.releases,
            "released_ids": c.released_ids,
            "requests": self.stats.requests,
            "bad_requests": self.stats.bad_requests,
            "blocked_get_event": self.stats.blocked,
            "interrupted": self.stats.interrupted,
            "restarted": {
                "stop": self.stats.restarted[Reason::Stop as usize],
                "handler": self.stats.restarted[Reason::Handler as usize],
                "traced": self.stats.restarted[Reason::Traced as usize],
                "unseen": self.stats.restarted[Reason::Unseen as usize],
            },
            "poll_wakeups": self.stats.poll_wakeups,
            "migrations": self.stats.migrations,
            "device_resets": self.stats.device_resets,
            "device": {
                "rx_mads": d.rx_mads, "tx_mads": d.tx_mads, "send_errors": d.send_errors,
                "rx_dropped": d.rx_dropped(),
            },
            "agent": {
                "connections": self.dev.agent().connection_count(),
                "listeners": self.dev.agent().listener_count(),
            },
        });
        if let (Value::Object(m), Value::Object(pvcm)) = (
            &mut v,
            pvcm_stat_json(self.dev.port_info(), self.dev.port_up(), self.dev.agent()),
        ) {
            m.extend(pvcm);
        }
        v
    }
}

/// The pvcm side of `stat`: `pvcm`, the device's port as PORT_INFO gives it (its GID;
/// the QPN range, from which clients without QPs, `pvcm-guest`'s commands, take their
/// simulated QPNs so the backend admits them), and the CM agent's `counters` (the
/// infiniband_cm table, `{group: {message: count}}`) and `pacing`.
pub fn pvcm_stat_json(p: &PortInfo, port_up: bool, agent: &Agent) -> Value {
    json!({
        "pvcm": {
            "name": p.name, "abi_version": p.abi_version, "port_up": port_up,
            "gid": p.gid.to_string(), "ca_guid": format!("{:#018x}", p.ca_guid),
            "lid": p.lid, "pkey": p.pkey, "qpn_base": p.qpn_base, "qpn_count": p.qpn_count,
            "max_entries": p.max_entries, "active_mtu": p.active_mtu,
            "ca_ack_delay": p.ca_ack_delay,
        },
        "counters": cm_counters_json(agent.counters()),
        "pacing": pacing_json(&agent.pacing()),
    })
}

/// Answers the kernel's CUSE_INIT (its first request), which creates the node.
fn handshake(cuse: &CuseDev, devname: &str) -> Result<(), ServiceError> {
    let mut buf = vec![0u8; READ_BUFFER];
    for _ in 0..500 {
        if let Some(n) = cuse.read(&mut buf).map_err(io_err("reading /dev/cuse"))? {
            let (h, r) =
                Request::parse(&buf[..n]).map_err(|e| ServiceError::Handshake(e.to_string()))?;
            let Request::Init { major, .. } = r else {
                return Err(ServiceError::Handshake(format!(
                    "first request was opcode {}",
                    h.opcode
                )));
            };
            if major != cuse::FUSE_MAJOR {
                return Err(ServiceError::Handshake(format!(
                    "kernel speaks FUSE {major}, this service {}",
                    cuse::FUSE_MAJOR
                )));
            }
            return cuse
                .write(&cuse::init_reply(h.unique, devname))
                .map_err(io_err("answering CUSE_INIT"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(ServiceError::Handshake("no CUSE_INIT in 5 s".into()))
}

/// Waits (up to 5 s) for the node to appear and gives it `mode`; its device number.
fn wait_for_node(node: &Path, mode: u32) -> Option<u64> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
    for _ in 0..500 {
        if let Ok(m) = std::fs::metadata(node)
            && m.file_type().is_char_device()
        {
            let _ = std::fs::set_permissions(node, std::fs::Permissions::from_mode(mode));
            return Some(m.rdev());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    None
}

/// The thread group of thread `tid` (`Tgid:` in /proc).
fn tgid_of(tid: u32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A duplicate of descriptor `fd` of thread `tid`'s process (`pidfd_getfd`), which
/// must be a file of the node `rdev`; the kernel's errors for MIGRATE_ID's descriptor:
/// ENOENT if it is not open, EINVAL if it is another file.
fn take_fd(tid: u32, fd: u32, rdev: Option<u64>) -> Result<OwnedFd, i32> {
    let tgid = tgid_of(tid).ok_or(errno::ENOENT)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, tgid, 0) };
    if pidfd < 0 {
        return Err(errno::ENOENT);
    }
    // SAFETY: `pidfd` was just returned by the kernel and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number and flags and returns a
    // new descriptor or -1.
    let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if dup < 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        return Err(if e == Some(libc::EBADF) {
            errno::ENOENT
        } else {
            errno::EINVAL
        });
    }
    // SAFETY: `dup` was just returned by the kernel and is owned by nobody else.
    let dup = unsafe { OwnedFd::from_raw_fd(dup as RawFd) };
    let f = std::fs::File::from(dup);
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    match (f.metadata(), rdev) {
        (Ok(m), Some(r)) if m.file_type().is_char_device() && m.rdev() == r => Ok(f.into()),
        _ => Err(errno::EINVAL),
    }
}

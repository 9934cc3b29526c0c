//! The service's threads: CUSE requests in, the rdma_cm layer, the pvcm device.
//!
//! The state (the rdma_cm layer, the device and its CM agent, the blocked GET_EVENTs,
//! the VM's RDMA device as last seen, the counters) is one `Core` under one lock.
//! Requests are served on `threads` threads ([`ServerOptions::threads`]):
//!
//! - With one, one thread does everything, in this order, over and over: take every
//!   CUSE request waiting, answer `stat` on the control socket, follow the VM's RDMA
//!   device (every 500 ms: `Cma::update_port`), pump the device (MADs in and out, the
//!   agent's timers, the agent's events into the files' queues, the GET_EVENTs blocked
//!   on those files filled, their pollers woken), try the address resolutions that
//!   wait for a neighbour (`Cma::poll_addr`); then sleep until the device notifies, a
//!   CUSE request or a control connection arrives, a neighbour changes (the rtnetlink
//!   socket of the resolutions), or the agent's next timer, a resolution's timeout or
//!   the next look at the device is due.
//! - With more, that many workers each read requests from the CUSE descriptor
//!   (blocking reads: the kernel hands each request to one of them) and the device
//!   thread does the rest. A worker whose command left MADs to send, an earlier timer
//!   or a resolution to wait for wakes the device thread.
//!
//! Each file's writes and its release run in arrival order, one at a time, as the
//! kernel's `file->mut` runs them ([`Lanes`]); other files' run beside them, and
//! opens, polls and interrupts are served at once. The lock is held while the rdma_cm
//! layer runs (which reads and writes the caller's memory), never across a read or
//! write of the CUSE descriptor, a sleep, or the read of a caller's signal state:
//! answers are collected under the lock and written after it.
//!
//! A blocked GET_EVENT is a request left unanswered: the calling thread sleeps in the
//! kernel until the answer is written (an event), or an INTERRUPT comes (a signal):
//! EINTR for a fatal one, so the process exits at once, and otherwise the restart event,
//! which librdmacm answers with a new GET_EVENT once the thread has stopped, been
//! traced or run its handler (`signals.rs`). O_NONBLOCK files get EAGAIN. The kernel
//! sends an INTERRUPT once a reader has taken the request, so with several workers it
//! can be served before its GET_EVENT blocks: it is kept and answered when the GET_EVENT
//! blocks; one kept too long is handed back to the kernel (EAGAIN), which sends it
//! again while its request waits and drops it otherwise.
//!
//! MIGRATE_ID names the old file by the caller's descriptor, which only the caller's
//! descriptor table resolves: the server duplicates that descriptor into itself
//! (`pidfd_getfd`) and asks it a private ioctl from a helper thread; the request comes
//! back with the file's handle, and the migration completes. A descriptor that is not
//! one of this device's files is EINVAL, a closed one ENOENT, as in the kernel.
//!
//! SIGTERM stops the device thread (the workers block SIGTERM and SIGINT, so the
//! signal ends the device thread's sleep); it stops the workers ([`WORKER_KICK`] ends
//! their reads) and then releases every file ([`Server::run`]), fails the blocked
//! GET_EVENTs, wakes the pollers and answers the files until they close
//! ([`Closing`]). A service killed outright leaves that to its [`Keeper`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pvcm_wire::abi::PortInfo;
use serde_json::{Value, json};

use super::abi::{cmd, event};
use super::caller::ProcessMemory;
use super::closing::{self, CLOSE_GRACE, Closing};
use super::cma::{Caller, Cma, Env, Fh, Outcome, errno};
use super::cuse::{self, CuseDev, READ_BUFFER, Reply, Request};
use super::keeper::Keeper;
use super::lanes::Lanes;
use super::signals::{self, Answer, Reason, ThreadSignals};
use super::verbs::PortWatch;
use crate::cm::Agent;
use crate::device::{Device, DeviceError, DeviceEvent, Transport};
use crate::report::{cm_counters_json, pacing_json};
use crate::time::{SystemClock, Time};
use crate::transport::poll_readable;

/// The longest sleep of the loop.
const MAX_SLEEP: Duration = Duration::from_secs(2);

/// The private ioctl of the MIGRATE_ID descriptor probe (`_IO('p', 0xC1)`).
pub const PROBE_IOCTL: u32 = (b'p' as u32) << 8 | 0xC1;

/// The most threads the default takes (one per CPU up to this).
pub const MAX_DEFAULT_THREADS: usize = 8;

/// The fewest threads the default takes, whatever the CPUs: more threads than CPUs
/// still serve more requests (`apps.sh --bench --procs 16 --vcpus 1`: 16 processes of
/// `cmtime -c 100` in a single-vCPU VM finish 1.8x sooner on 2 threads and 2.5x on 4
/// than on 1; docs/apps.md, Benchmark).
pub const MIN_DEFAULT_THREADS: usize = 4;

/// How many requests an INTERRUPT not yet matched is kept for before it goes back to
/// the kernel.
const EARLY_INTERRUPT_KEEP: u64 = 64;

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
    /// A service thread could not be started or ended badly.
    #[error("service thread: {0}")]
    Thread(String),
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
    /// INTERRUPTs served before their request blocked (kept, or handed back).
    pub early_interrupts: u64,
    /// Poll wakeups sent.
    pub poll_wakeups: u64,
    /// Device resets survived.
    pub device_resets: u64,
    /// MIGRATE_IDs served.
    pub migrations: u64,
    /// Requests that queued behind another request of their file.
    pub lane_waits: u64,
    /// Times a worker woke the device thread.
    pub device_wakes: u64,
    /// Requests taken by each reading thread.
    pub by_thread: Vec<u64>,
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

/// INTERRUPTs served before their request blocked, by the request's unique. FUSE
/// sends one once a reader has taken the request; another thread may serve it before
/// the request (a GET_EVENT) is run on its file's lane.
#[derive(Debug, Default)]
struct EarlyInterrupts {
    /// The request's unique -> (the INTERRUPT's own unique, the request count when it
    /// came).
    kept: HashMap<u64, (u64, u64)>,
}

impl EarlyInterrupts {
    /// Keeps the INTERRUPT `own` of request `of`, which came at request count `at`.
    fn keep(&mut self, of: u64, own: u64, at: u64) {
        self.kept.insert(of, (own, at));
    }

    /// Request `unique` blocks: was it interrupted already?
    fn take(&mut self, unique: u64) -> bool {
        !self.kept.is_empty() && self.kept.remove(&unique).is_some()
    }

    /// The INTERRUPTs kept for [`EARLY_INTERRUPT_KEEP`] requests or more at request
    /// count `now`, no longer kept: their own uniques, to hand back (EAGAIN).
    fn expire(&mut self, now: u64) -> Vec<u64> {
        if self.kept.is_empty() {
            return Vec::new();
        }
        let mut gone = Vec::new();
        self.kept.retain(|_, &mut (own, at)| {
            let keep = now.saturating_sub(at) < EARLY_INTERRUPT_KEEP;
            if !keep {
                gone.push(own);
            }
            keep
        });
        gone
    }
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
    /// Threads reading requests (1: one thread does everything).
    pub threads: usize,
    /// The executable to start as the device's keeper (`EXE keep`, [`Keeper`]);
    /// `None`: no keeper.
    pub keeper: Option<String>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            cuse: PathBuf::from("/dev/cuse"),
            devname: "infiniband/rdma_cm".into(),
            mode: 0o666,
            control: Some(PathBuf::from("/run/pvcm-guestd.sock")),
            keeper: None,
            watch: None,
            threads: default_threads(),
        }
    }
}

/// One thread per CPU this process may run on, at least [`MIN_DEFAULT_THREADS`] and
/// at most [`MAX_DEFAULT_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(MIN_DEFAULT_THREADS, MAX_DEFAULT_THREADS)
}

/// The signal that ends a worker's blocking read when the service stops (a real-time
/// signal, handled by a handler that does nothing, without SA_RESTART).
pub fn worker_kick() -> i32 {
    libc::SIGRTMIN() + 3
}
/// See [`worker_kick`].
pub const WORKER_KICK: &str = "SIGRTMIN+3";

/// The service's state, under [`Server`]'s lock.
struct Core<'d, T: Transport> {
    dev: &'d mut Device<T, SystemClock>,
    cma: Cma,
    waiters: HashMap<Fh, VecDeque<Waiter>>,
    migrations: Vec<Migration>,
    stats: ServerStats,
    seed: u64,
    /// The node's device number: a MIGRATE_ID descriptor must be one of its files.
    rdev: Option<u64>,
    /// The VM's RDMA device, followed.
    watch: Option<PortWatch>,
    /// When to read it next.
    next_watch: Instant,
    /// Each file's writes and release, one at a time ([`Lanes`]).
    lanes: Lanes<Fh, Vec<u8>>,
    /// INTERRUPTs whose request has not blocked (yet).
    early: EarlyInterrupts,
    /// The device thread sleeps until then (`None`: it is awake).
    sleeping_until: Option<Time>,
    /// The device's keeper, told the poll handles and the open files.
    keeper: Option<Keeper>,
    /// The device thread's sleep watches the resolutions' neighbour socket.
    sleep_watches_neigh: bool,
}

/// The guest CM service over a started pvcm device.
pub struct Server<'d, T: Transport> {
    core: Mutex<Core<'d, T>>,
    cuse: CuseDev,
    control: Option<UnixListener>,
    stop: &'static AtomicBool,
    /// A thread failed: every thread stops.
    halt: AtomicBool,
    /// The first error a worker met.
    failure: Mutex<Option<ServiceError>>,
    /// Wakes the device thread (an eventfd).
    wake: OwnedFd,
    threads: usize,
    /// The workers' pthreads, for [`worker_kick`].
    workers: Mutex<Vec<libc::pthread_t>>,
    live_workers: AtomicUsize,
}

impl<T: Transport> std::fmt::Debug for Server<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

/// What a request asks of the thread that took it, after the lock.
enum Then {
    /// Nothing more.
    Nothing,
    /// Run the file's lane from this job on.
    Lane(Fh, Vec<u8>),
    /// Answer this interrupted GET_EVENT (its signal state is read without the lock).
    Interrupted(Waiter),
}

impl<'d, T: Transport + Send> Server<'d, T> {
    /// Opens CUSE, answers its CUSE_INIT (the node appears) and sets the node's mode;
    /// `stop` ends [`Server::run`] when set.
    pub fn start(
        dev: &'d mut Device<T, SystemClock>,
        cma: Cma,
        opts: &ServerOptions,
        stop: &'static AtomicBool,
    ) -> Result<Server<'d, T>, ServiceError> {
        let cuse = register(opts)?;
        let keeper = opts.keeper.as_deref().and_then(|exe| {
            Keeper::spawn(exe, &cuse)
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "no keeper: if the service is killed outright, programs waiting in poll() are not woken")
                })
                .ok()
        });
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
        // SAFETY: eventfd takes an initial count and flags and returns a new
        // descriptor or -1.
        let wake = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake < 0 {
            return Err(io_err("eventfd")(std::io::Error::last_os_error()));
        }
        // SAFETY: `wake` was just returned by the kernel and is owned by nobody else.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        let seed = dev.options().seed;
        Ok(Server {
            core: Mutex::new(Core {
                dev,
                cma,
                waiters: HashMap::new(),
                migrations: Vec::new(),
                stats: ServerStats {
                    by_thread: vec![0; opts.threads.max(1)],
                    ..ServerStats::default()
                },
                seed,
                rdev,
                lanes: Lanes::default(),
                early: EarlyInterrupts::default(),
                sleeping_until: None,
                keeper,
                sleep_watches_neigh: false,
                watch: opts.watch.clone(),
                next_watch: Instant::now(),
            }),
            cuse,
            control,
            stop,
            halt: AtomicBool::new(false),
            failure: Mutex::new(None),
            wake,
            threads: opts.threads.max(1),
            workers: Mutex::new(Vec::new()),
            live_workers: AtomicUsize::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Core<'d, T>> {
        // A thread that panicked under the lock left the state as it was at the
        // panic; serving on is better than stopping every caller.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.halt.load(Ordering::Relaxed)
    }

    /// Serves until the stop flag is set or the device fails; then releases every file
    /// and answers the callers' files until they are closed ([`Closing`]).
    pub fn run(&mut self) -> Result<(), ServiceError> {
        let r = if self.threads == 1 {
            self.device_loop(true)
        } else {
            self.run_threads()
        };
        let mut out = Vec::new();
        let closing = self.lock().shut_down(&mut out);
        let closed = self.send(&out).and_then(|()| self.serve_closing(closing));
        // Ended cleanly: the keeper has nothing to do.
        drop(self.lock().keeper.take());
        r.and(closed)
    }

    /// Answers the callers' files of a stopped service until every one is released or
    /// the grace is over ([`Closing`]).
    fn serve_closing(&self, mut closing: Closing) -> Result<(), ServiceError> {
        closing::serve(&self.cuse, &mut closing)
            .map_err(io_err("answering /dev/cuse after the stop"))?;
        tracing::info!(
            answered = closing.answered,
            still_open = closing.still_open(),
            "stopped: the callers' files were answered until they closed"
        );
        Ok(())
    }

    fn run_threads(&self) -> Result<(), ServiceError> {
        install_kick_handler()?;
        self.cuse
            .set_blocking(true)
            .map_err(io_err("making /dev/cuse reads blocking"))?;
        let r = std::thread::scope(|s| {
            let mut spawned = Ok(());
            for i in 0..self.threads {
                let b = std::thread::Builder::new().name(format!("pvcm-serve-{i}"));
                if let Err(e) = b.spawn_scoped(s, move || self.worker(i)) {
                    spawned = Err(ServiceError::Thread(e.to_string()));
                    self.halt.store(true, Ordering::Relaxed);
                    break;
                }
                self.live_workers.fetch_add(1, Ordering::SeqCst);
            }
            let r = spawned.and_then(|()| self.device_loop(false));
            self.halt.store(true, Ordering::Relaxed);
            self.stop_workers();
            r
        });
        let failed = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match failed {
            Some(e) => Err(e),
            None => r,
        }
    }

    /// Ends the workers' reads until every worker has returned.
    fn stop_workers(&self) {
        while self.live_workers.load(Ordering::SeqCst) > 0 {
            for &t in self
                .workers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
            {
                // SAFETY: `t` is a worker's pthread, which lives until the scope that
                // runs this ends; the signal's handler does nothing.
                unsafe { libc::pthread_kill(t, worker_kick()) };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Worker `index`: reads requests and serves them until the service stops.
    fn worker(&self, index: usize) {
        // SAFETY: pthread_self has no arguments and cannot fail.
        let me = unsafe { libc::pthread_self() };
        self.workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(me);
        block_stop_signals();
        let mut buf = vec![0u8; READ_BUFFER];
        while !self.stopping() {
            let r = match self.cuse.read_or_interrupted(&mut buf) {
                Ok(Some(n)) => self.take(index, &buf[..n]),
                Ok(None) => Ok(()),
                Err(e) => Err(io_err("reading /dev/cuse")(e)),
            };
            if let Err(e) = r {
                self.fail(e);
            }
        }
        self.live_workers.fetch_sub(1, Ordering::SeqCst);
    }

    fn fail(&self, e: ServiceError) {
        tracing::error!(error = %e, "a service thread failed");
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
        self.halt.store(true, Ordering::Relaxed);
        self.wake_device_thread();
    }

    fn wake_device_thread(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this server owns.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// The device thread (with `serve_cuse`, the only thread: it reads the requests
    /// too).
    fn device_loop(&self, serve_cuse: bool) -> Result<(), ServiceError> {
        const CUSE: u64 = 1;
        const CONTROL: u64 = 2;
        const WAKE: u64 = 4;
        const NEIGH: u64 = 8;
        let mut buf = vec![0u8; if serve_cuse { READ_BUFFER } else { 0 }];
        // Readable descriptors after a sleep; a sleep cut short by device work (0)
        // still looks at CUSE, so a busy device never starves the processes.
        let mut ready = CUSE | CONTROL;
        while !self.stopping() {
            if serve_cuse && (ready & CUSE != 0 || ready == 0) {
                while let Some(n) = self
                    .cuse
                    .read(&mut buf)
                    .map_err(io_err("reading /dev/cuse"))?
                {
                    self.take(0, &buf[..n])?;
                }
            }
            if ready & CONTROL != 0 {
                self.serve_control();
            }
            if ready & WAKE != 0 {
                drain_eventfd(self.wake.as_raw_fd());
            }
            let mut out = Vec::new();
            let sleep = {
                let mut core = self.lock();
                // What following the device makes the agent send (a closed
                // connection's DREQ) leaves in the pump.
                core.follow_port(&mut out);
                core.pump(&mut out)?;
                core.poll_addr(&mut out);
                let most = core.most_sleep();
                let s = core.dev.sleep_begin(most);
                core.sleeping_until = s.as_ref().map(|s| core.dev.now().after(s.timeout));
                // The neighbour socket is there from the first resolution on.
                let neigh = core.cma.addr_fd();
                core.sleep_watches_neigh = neigh.is_some();
                s.map(|s| (s, neigh))
            };
            self.send(&out)?;
            let Some((s, neigh)) = sleep else {
                ready = 0;
                continue;
            };
            // Ours after the device's: CUSE (when this thread reads it), the control
            // socket, the wake eventfd, the resolutions' neighbour socket.
            let mut extra = Vec::with_capacity(4);
            let mut bits = Vec::with_capacity(4);
            if serve_cuse {
                extra.push(self.cuse.fd());
                bits.push(CUSE);
            }
            if let Some(c) = &self.control {
                extra.push(c.as_raw_fd());
                bits.push(CONTROL);
            }
            extra.push(self.wake.as_raw_fd());
            bits.push(WAKE);
            if let Some(fd) = neigh {
                extra.push(fd);
                bits.push(NEIGH);
            }
            // A stop signal cuts the sleep short (EINTR: nothing readable); the bound
            // only covers one that lands between the check above and the sleep.
            let polled = poll_readable(&s.fds, &extra, s.timeout);
            {
                let mut core = self.lock();
                core.sleeping_until = None;
                core.dev.sleep_end(s)?;
            }
            let (_, mask) = polled.map_err(io_err("waiting on the device and /dev/cuse"))?;
            ready = bits
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .fold(0, |r, (_, b)| r | b);
        }
        Ok(())
    }

    fn send(&self, out: &[Reply]) -> Result<(), ServiceError> {
        for r in out {
            self.cuse
                .write(r.bytes())
                .map_err(io_err("answering on /dev/cuse"))?;
        }
        Ok(())
    }

    /// Serves one request thread `thread` read from CUSE: at once, or on its file's
    /// lane.
    fn take(&self, thread: usize, b: &[u8]) -> Result<(), ServiceError> {
        let mut out = Vec::new();
        let then = {
            let mut core = self.lock();
            if let Some(n) = core.stats.by_thread.get_mut(thread) {
                *n += 1;
            }
            core.take(b, &mut out)
        };
        self.send(&out)?;
        out.clear();
        match then {
            Then::Nothing => Ok(()),
            Then::Lane(fh, job) => self.run_lane(fh, job, &mut out),
            Then::Interrupted(w) => self.answer_interrupt(w, &mut out),
        }
    }

    /// Runs `job` and then every job queued behind it on `fh`'s lane, each answered
    /// before the next runs.
    fn run_lane(&self, fh: Fh, job: Vec<u8>, out: &mut Vec<Reply>) -> Result<(), ServiceError> {
        let mut job = Some(job);
        while let Some(j) = job {
            let (then, wake) = {
                let mut core = self.lock();
                let then = core.run(&j, out);
                (then, core.device_thread_needed())
            };
            if wake {
                self.wake_device_thread();
            }
            self.send(out)?;
            out.clear();
            if let Then::Interrupted(w) = then {
                self.answer_interrupt(w, out)?;
            }
            job = self.lock().lanes.next(fh);
        }
        Ok(())
    }

    /// A signal came to the thread blocked in `w`, a GET_EVENT: answered at once (FUSE
    /// holds the thread until it is), with EINTR when the signal is fatal and with the
    /// restart event otherwise (`signals.rs`).
    fn answer_interrupt(&self, w: Waiter, out: &mut Vec<Reply>) -> Result<(), ServiceError> {
        let state = ThreadSignals::of_thread(w.pid);
        let answer = signals::answer(state.as_ref());
        let reply = {
            let mut core = self.lock();
            let restarted = match answer {
                Answer::Fatal => Err(errno::EINTR),
                Answer::Restart(reason) => {
                    let mut mem = ProcessMemory::new(w.pid);
                    core.cma
                        .restart(w.response, w.out_len, &mut mem)
                        .map(|()| reason)
                        // A caller whose memory is gone is exiting.
                        .map_err(|_| errno::EINTR)
                }
            };
            match restarted {
                Ok(reason) => {
                    core.stats.restarted[reason as usize] += 1;
                    Reply::write(w.unique, w.size)
                }
                Err(e) => {
                    core.stats.interrupted += 1;
                    Reply::error(w.unique, e)
                }
            }
        };
        out.push(reply);
        self.send(out)?;
        out.clear();
        Ok(())
    }

    fn serve_control(&self) {
        let Some(l) = &self.control else { return };
        while let Ok((mut s, _)) = l.accept() {
            let _ = s.set_nonblocking(false);
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let v = self.stat_json();
            let _ = writeln!(s, "{v}");
        }
    }

    /// What `pvcm-guestd stat` prints.
    pub fn stat_json(&self) -> Value {
        let mut v = self.lock().stat_json();
        if let Value::Object(m) = &mut v {
            m.insert("threads".into(), json!(self.threads));
        }
        v
    }

    /// Runs `f` on the rdma_cm layer (for tests and `stat`).
    pub fn with_cma<R>(&self, f: impl FnOnce(&Cma) -> R) -> R {
        f(&self.lock().cma)
    }
}

impl<T: Transport> Core<'_, T> {
    /// The service stops: its callers' files die with it, so every file is released
    /// here as at a close, and what that sends (DREQs, REJs) leaves before the device
    /// is dropped: the peers see the connections end now, not after their timeouts.
    /// Every blocked GET_EVENT and MIGRATE_ID fails with ENODEV and every armed poller
    /// is woken (into `out`); the files are then answered until they close
    /// ([`Closing`]).
    fn shut_down(&mut self, out: &mut Vec<Reply>) -> Closing {
        out.extend(
            self.cma
                .take_poll_handles()
                .into_iter()
                .map(Reply::notify_poll),
        );
        for w in self.waiters.drain().flat_map(|(_, q)| q) {
            out.push(Reply::error(w.unique, errno::ENODEV));
        }
        for m in self.migrations.drain(..) {
            out.push(Reply::error(m.unique, errno::ENODEV));
        }
        let now = self.dev.now();
        let mut env = Env {
            agent: self.dev.agent_mut(),
            now,
        };
        let files = self.cma.release_all(&mut env);
        let ids = self.cma.stats().released_ids;
        let flushed = self.dev.flush(Duration::from_secs(2));
        tracing::info!(files = files.len(), released_ids = ids, flushed = ?flushed.ok(), "stopped serving: every file released");
        Closing::new(files.len(), Instant::now(), CLOSE_GRACE)
    }

    /// The device thread sleeps past what the agent or a resolution needs now: MADs to
    /// send, a timer or a resolution's timeout due before its wake, a resolution whose
    /// neighbour socket the sleep does not watch. Clears the sleep so one wake is sent.
    fn device_thread_needed(&mut self) -> bool {
        let Some(until) = self.sleeping_until else {
            return false;
        };
        let resolving = self.cma.next_addr_deadline();
        let neigh_unwatched = self.cma.addr_fd().is_some() && !self.sleep_watches_neigh;
        let agent = self.dev.agent_mut();
        let needed = agent.outbox_len() > 0
            || agent.next_deadline().is_some_and(|d| d < until)
            || resolving.is_some_and(|d| d < until || neigh_unwatched);
        if needed {
            self.sleeping_until = None;
            self.stats.device_wakes += 1;
        }
        needed
    }

    fn pump(&mut self, out: &mut Vec<Reply>) -> Result<(), ServiceError> {
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
                self.serve_waiters(fh, out);
            }
            // What the events made the agent send (a refused request's REJ) leaves
            // now; a full rx batch means more may be waiting.
            if self.dev.agent().outbox_len() == 0 && p.rx < self.dev.options().rx_batch {
                return Ok(());
            }
        }
    }

    /// The address resolutions that a neighbour's change or their timeout ends.
    fn poll_addr(&mut self, out: &mut Vec<Reply>) {
        let now = self.dev.now();
        for fh in self.cma.poll_addr(now) {
            self.serve_waiters(fh, out);
        }
    }

    /// The longest the device thread may sleep: to the next resolution's timeout or
    /// the next look at the device, at most [`MAX_SLEEP`].
    fn most_sleep(&self) -> Duration {
        let now = self.dev.now();
        let mut sleep = self
            .cma
            .next_addr_deadline()
            .map_or(MAX_SLEEP, |d| d.since(now).min(MAX_SLEEP));
        if self.watch.is_some() {
            sleep = sleep.min(self.next_watch.saturating_duration_since(Instant::now()));
        }
        sleep
    }

    /// Reads the VM's RDMA device again when it is time, and hands what it found to the
    /// rdma_cm layer ([`Cma::update_port`]): the files that got events are served.
    fn follow_port(&mut self, out: &mut Vec<Reply>) {
        let Some(w) = &mut self.watch else {
            return;
        };
        if Instant::now() < self.next_watch {
            return;
        }
        self.next_watch = Instant::now() + w.every;
        let Some(view) = w.view(!self.cma.addr_present()) else {
            return;
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
            self.serve_waiters(fh, out);
        }
    }

    /// Takes one request: answers what is answered at once, queues a file's write or
    /// release on its lane, finds the GET_EVENT an INTERRUPT is for. Longer than the
    /// other functions on purpose: it is the dispatch table of the requests served
    /// outside the lanes, one short arm per request, and reads best whole.
    fn take(&mut self, b: &[u8], out: &mut Vec<Reply>) -> Then {
        self.stats.requests += 1;
        self.expire_early_interrupts(out);
        let (h, r) = match Request::parse(b) {
            Ok(x) => x,
            Err(_) => {
                self.stats.bad_requests += 1;
                out.extend(Reply::to_unreadable(b, errno::EINVAL));
                return Then::Nothing;
            }
        };
        match r {
            Request::Write { fh, .. } | Request::Release { fh } => {
                match self.lanes.admit(fh, b.to_vec()) {
                    Some(job) => return Then::Lane(fh, job),
                    None => self.stats.lane_waits += 1,
                }
            }
            Request::Init { .. } | Request::Read { .. } => {
                out.push(Reply::error(h.unique, errno::EINVAL))
            }
            Request::Open { .. } => {
                let fh = self.cma.open();
                if let Some(k) = &self.keeper {
                    k.set_open(self.cma.files());
                }
                out.push(Reply::open(h.unique, fh));
            }
            Request::Poll { fh, kh, flags, .. } => {
                if flags & cuse::FUSE_POLL_SCHEDULE_NOTIFY != 0 {
                    self.cma.set_poll_handle(fh, kh);
                    if let Some(k) = &self.keeper {
                        k.saw_poll(kh);
                    }
                }
                let ready = if self.cma.has_events(fh) {
                    (libc::POLLIN | libc::POLLRDNORM) as u32
                } else {
                    0
                };
                out.push(Reply::poll(h.unique, ready));
            }
            Request::Interrupt { unique } => {
                if let Some(w) = self.take_waiter(unique) {
                    return Then::Interrupted(w);
                }
                // Not blocked (yet): its GET_EVENT may still be on its way to a
                // lane; an answered request's INTERRUPT expires.
                self.stats.early_interrupts += 1;
                self.early.keep(unique, h.unique, self.stats.requests);
            }
            Request::Ioctl { fh, cmd, arg } => {
                let m = self
                    .migrations
                    .iter_mut()
                    .find(|m| cmd == PROBE_IOCTL && m.token == arg && m.from.is_none());
                match m {
                    Some(m) => {
                        m.from = Some(fh);
                        out.push(Reply::ioctl(h.unique, 0));
                        self.finish_migrations(out);
                    }
                    None => out.push(Reply::error(h.unique, libc::ENOTTY)),
                }
            }
            Request::Other(_) => out.push(Reply::error(h.unique, errno::ENOSYS)),
        }
        Then::Nothing
    }

    /// Hands INTERRUPTs kept too long back to the kernel (EAGAIN): it sends one again
    /// if its request still waits, and drops it if the request was answered.
    fn expire_early_interrupts(&mut self, out: &mut Vec<Reply>) {
        for own in self.early.expire(self.stats.requests) {
            out.push(Reply::error(own, errno::EAGAIN));
        }
    }

    /// Runs one job of a lane: a write or a release of its file.
    fn run(&mut self, b: &[u8], out: &mut Vec<Reply>) -> Then {
        let Ok((h, r)) = Request::parse(b) else {
            return Then::Nothing;
        };
        match r {
            Request::Release { fh } => {
                self.waiters.remove(&fh);
                let now = self.dev.now();
                let mut env = Env {
                    agent: self.dev.agent_mut(),
                    now,
                };
                self.cma.release(fh, &mut env);
                if let Some(k) = &self.keeper {
                    k.set_open(self.cma.files());
                }
                out.push(Reply::empty(h.unique));
                Then::Nothing
            }
            Request::Write {
                fh,
                offset,
                flags,
                data,
            } => {
                if offset != 0 {
                    out.push(Reply::error(h.unique, errno::EINVAL));
                    return Then::Nothing;
                }
                self.write(h.unique, h.pid, h.uid, fh, flags, data, out)
            }
            _ => Then::Nothing,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        unique: u64,
        pid: u32,
        uid: u32,
        fh: Fh,
        flags: u32,
        data: &[u8],
        out: &mut Vec<Reply>,
    ) -> Then {
        let size = data.len() as u32;
        let mut mem = ProcessMemory::new(pid);
        let now = self.dev.now();
        let mut env = Env {
            agent: self.dev.agent_mut(),
            now,
        };
        match self.cma.write(fh, Caller { uid }, data, &mut mem, &mut env) {
            Outcome::Done(r) => {
                out.push(match r {
                    Ok(()) => Reply::write(unique, size),
                    Err(e) => Reply::error(unique, e),
                });
                // A command may have queued an event of its own (ADDR_RESOLVED,
                // ROUTE_RESOLVED) for another thread's blocked GET_EVENT.
                self.serve_waiters(fh, out);
                Then::Nothing
            }
            Outcome::WaitEvent { response, out_len } => {
                if flags & libc::O_NONBLOCK as u32 != 0 {
                    out.push(Reply::error(unique, errno::EAGAIN));
                    return Then::Nothing;
                }
                self.stats.blocked += 1;
                let w = Waiter {
                    unique,
                    pid,
                    response,
                    out_len,
                    size,
                };
                if self.early.take(unique) {
                    return Then::Interrupted(w);
                }
                self.waiters.entry(fh).or_default().push_back(w);
                Then::Nothing
            }
            Outcome::Migrate {
                id,
                fd,
                response,
                out_len: _,
            } => {
                self.start_migration(unique, pid, size, fh, id, fd, response);
                self.finish_migrations(out);
                Then::Nothing
            }
        }
    }

    /// The blocked GET_EVENT of request `unique`, taken off its file.
    fn take_waiter(&mut self, unique: u64) -> Option<Waiter> {
        for q in self.waiters.values_mut() {
            if let Some(i) = q.iter().position(|w| w.unique == unique) {
                return q.remove(i);
            }
        }
        None
    }

    /// Fills blocked GET_EVENTs of `fh` while it has events; wakes its poller if events
    /// remain.
    fn serve_waiters(&mut self, fh: Fh, out: &mut Vec<Reply>) {
        while let Some(w) = self.waiters.get(&fh).and_then(|q| q.front()).copied() {
            let mut mem = ProcessMemory::new(w.pid);
            match self.cma.deliver(fh, w.response, w.out_len, &mut mem) {
                None => break,
                Some(r) => {
                    if let Some(q) = self.waiters.get_mut(&fh) {
                        q.pop_front();
                    }
                    out.push(match r {
                        Ok(()) => Reply::write(w.unique, w.size),
                        Err(e) => Reply::error(w.unique, e),
                    });
                }
            }
        }
        if self.cma.has_events(fh)
            && let Some(kh) = self.cma.take_poll_handle(fh)
        {
            self.stats.poll_wakeups += 1;
            out.push(Reply::notify_poll(kh));
        }
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
                // The probe blocks in the kernel until a service thread answers it, so
                // it runs on its own thread.
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

    fn finish_migrations(&mut self, out: &mut Vec<Reply>) {
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
            out.push(match result {
                Ok(()) => Reply::write(m.unique, m.size),
                Err(e) => Reply::error(m.unique, e),
            });
            // The moved id's events may be waiting for a GET_EVENT of the new file.
            self.serve_waiters(m.to, out);
        }
    }

    /// What `pvcm-guestd stat` prints (but the thread count).
    fn stat_json(&self) -> Value {
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
                "served": p.served().map(|s| json!({
                    "addr": s.addr.to_string(), "gid": s.gid.to_string(), "gid_index": s.gid_index,
                })).collect::<Vec<_>>(),
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
            "listening": self.cma.listening(),
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
            "early_interrupts": self.stats.early_interrupts,
            "poll_wakeups": self.stats.poll_wakeups,
            "lane_waits": self.stats.lane_waits,
            "device_wakes": self.stats.device_wakes,
            "requests_by_thread": self.stats.by_thread,
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

extern "C" fn on_kick(_: libc::c_int) {}

/// Installs [`worker_kick`]'s handler: it does nothing, and without SA_RESTART a read
/// it interrupts returns EINTR.
fn install_kick_handler() -> Result<(), ServiceError> {
    // SAFETY: a zeroed sigaction is a valid empty one; the handler does nothing (it is
    // async-signal-safe); sigaction copies the structure.
    let r = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_kick as *const () as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = 0;
        libc::sigaction(worker_kick(), &sa, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(io_err("installing the worker signal handler")(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// Blocks SIGTERM and SIGINT in the calling thread, so they reach the device thread.
fn block_stop_signals() {
    // SAFETY: sigset operations on a local set; pthread_sigmask on this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn drain_eventfd(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: reads 8 bytes into a live u64 from a non-blocking eventfd.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
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
/// How long the service waits for the node's name to be free (a dead service's
/// keeper holds it for up to [`CLOSE_GRACE`]).
const NAME_WAIT: Duration = Duration::from_secs(10);

/// Opens CUSE and creates the node: again while another device holds the name (the
/// kernel then ends the new connection at once), for up to [`NAME_WAIT`].
fn register(opts: &ServerOptions) -> Result<CuseDev, ServiceError> {
    let until = Instant::now() + NAME_WAIT;
    let mut told = false;
    loop {
        let cuse = CuseDev::open(&opts.cuse).map_err(io_err(format!(
            "opening {} (modprobe cuse)",
            opts.cuse.display()
        )))?;
        handshake(&cuse, &opts.devname)?;
        if !cuse.ended() {
            return Ok(cuse);
        }
        if Instant::now() >= until {
            return Err(ServiceError::Handshake(format!(
                "the kernel refused /dev/{}: another device has that name",
                opts.devname
            )));
        }
        if !told {
            tracing::info!(node = %format_args!("/dev/{}", opts.devname), "another device has the name (a stopped service's keeper?): waiting for it to go");
            told = true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// An INTERRUPT read before its GET_EVENT blocked answers the GET_EVENT when it
    /// blocks; one whose request never blocks goes back to the kernel after
    /// EARLY_INTERRUPT_KEEP further requests, once.
    #[test]
    fn an_early_interrupt_waits_for_its_request_then_expires() {
        let mut e = EarlyInterrupts::default();
        assert!(!e.take(10), "nothing kept");
        e.keep(10, 10 | 1, 100);
        e.keep(20, 20 | 1, 101);
        assert!(e.expire(100 + EARLY_INTERRUPT_KEEP - 1).is_empty());
        assert!(e.take(10), "the GET_EVENT that blocks finds its INTERRUPT");
        assert!(!e.take(10), "once");
        assert_eq!(e.expire(101 + EARLY_INTERRUPT_KEEP), vec![20 | 1]);
        assert!(!e.take(20), "handed back, no longer kept");
        assert!(e.expire(u64::MAX).is_empty());
    }
}

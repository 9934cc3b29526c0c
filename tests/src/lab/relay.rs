//! Wire fault injection: a UDP relay between hosts.
//!
//! `pvcm-backend` has no fault option, but each host can bind its own UDP port
//! (`--bind-port`): host `H` binds `4791 + H` on its VM addresses and sends every frame to
//! the destination VM's address on that same port. Nobody of host `G` listens there, so
//! the relay does: for every VM address `x` of host `H` and every other host `G` it binds
//! `x:port(G)`. A frame that host `G` sent from `y:port(G)` to `x:port(G)` is checked
//! (BTH, DETH, ICRC, as the backend checks it), then — after the faults — re-framed from
//! the relay's socket `y:port(H)` to `x:port(H)`, where host `H` receives it from `y`'s
//! address (so the mux sees the true source GID) with a fresh ICRC over the new UDP
//! ports. Answers that the mux sends to the frame's source address (its stateless DREP
//! or REJ(NO_RESOURCES)) land on `y:port(H)` and travel back the same way.
//!
//! Faults: `loss` drops a frame (only MADs of one attribute with `loss_only`), `dup`
//! forwards it twice, `reorder` holds it back by
//! [`REORDER_HOLD`] so later frames overtake it, `delay` holds every frame that long
//! (plus up to `jitter`). Each is a per-frame probability drawn from a seeded generator.

use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pvcm_backend::port::soft::{OutFrame, RecvBatch, UdpPort, check_frame};
use pvcm_guest::cm::SplitMix64;
use pvcm_wire::mad::MAD_LEN;
use serde::Serialize;

/// How long a reordered frame is held back.
pub const REORDER_HOLD: Duration = Duration::from_millis(3);

/// Faults on the wire between hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Faults {
    /// Probability that a frame is lost.
    pub loss: f64,
    /// Only MADs of this attribute (its ID) are lost (`None`: any frame).
    pub loss_only: Option<u16>,
    /// Probability that a frame is delivered twice.
    pub dup: f64,
    /// Probability that a frame is held back so later ones overtake it.
    pub reorder: f64,
    /// Delay of every frame.
    #[serde(serialize_with = "ser_ms")]
    pub delay: Duration,
    /// Extra random delay, uniform in `[0, jitter]`.
    #[serde(serialize_with = "ser_ms")]
    pub jitter: Duration,
}

fn ser_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl Faults {
    /// Whether any fault is asked for (the relay is only put in the path then).
    pub fn any(&self) -> bool {
        self.loss > 0.0
            || self.dup > 0.0
            || self.reorder > 0.0
            || !self.delay.is_zero()
            || !self.jitter.is_zero()
    }
}

/// What the relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RelayStats {
    /// Frames received from hosts.
    pub received: u64,
    /// Frames sent on to hosts (duplicates included).
    pub forwarded: u64,
    /// Frames dropped on purpose (`--loss`).
    pub lost: u64,
    /// Extra copies sent (`--dup`).
    pub duplicated: u64,
    /// Frames held back (`--reorder`).
    pub reordered: u64,
    /// Frames that failed the frame checks or came from an unknown address.
    pub bad: u64,
    /// Frames the kernel refused to send.
    pub send_errors: u64,
}

#[derive(Debug, Default)]
struct Counters {
    received: AtomicU64,
    forwarded: AtomicU64,
    lost: AtomicU64,
    duplicated: AtomicU64,
    reordered: AtomicU64,
    bad: AtomicU64,
    send_errors: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> RelayStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        RelayStats {
            received: l(&self.received),
            forwarded: l(&self.forwarded),
            lost: l(&self.lost),
            duplicated: l(&self.duplicated),
            reordered: l(&self.reordered),
            bad: l(&self.bad),
            send_errors: l(&self.send_errors),
        }
    }
}

/// One host as the relay sees it: its port and VM addresses.
#[derive(Debug, Clone)]
pub struct RelayHost {
    /// The UDP port the host binds and sends to.
    pub port: u16,
    /// Its VM addresses.
    pub addrs: Vec<Ipv4Addr>,
}

/// A running relay thread.
#[derive(Debug)]
pub struct Relay {
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

struct Held {
    due: Instant,
    seq: u64,
    out: usize,
    dst: SocketAddr,
    mad: [u8; MAD_LEN],
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    // Reversed: BinaryHeap is a max-heap, the earliest due comes first.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

impl Relay {
    /// Binds every relay socket and starts the thread.
    pub fn start(hosts: &[RelayHost], faults: Faults, seed: u64) -> io::Result<Relay> {
        let mut socks: Vec<UdpPort> = Vec::new();
        // (address, port) -> socket index; address -> host index.
        let mut by_addr: HashMap<SocketAddr, usize> = HashMap::new();
        let mut host_of: HashMap<IpAddr, usize> = HashMap::new();
        for (h, host) in hosts.iter().enumerate() {
            for a in &host.addrs {
                host_of.insert(IpAddr::V4(*a), h);
                for (g, other) in hosts.iter().enumerate() {
                    if g == h {
                        continue;
                    }
                    let p = UdpPort::bind(IpAddr::V4(*a), 0, other.port).map_err(|e| {
                        io::Error::new(e.kind(), format!("relay bind {a}:{}: {e}", other.port))
                    })?;
                    by_addr.insert(p.local(), socks.len());
                    socks.push(p);
                }
            }
        }
        let ports: Vec<u16> = hosts.iter().map(|h| h.port).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let (s, c) = (stop.clone(), counters.clone());
        let thread = std::thread::Builder::new()
            .name("pvcm-lab-relay".into())
            .spawn(move || {
                let mut r = Runner {
                    socks,
                    by_addr,
                    host_of,
                    ports,
                    faults,
                    rng: SplitMix64::new(seed ^ 0x0072_656c_6179),
                    held: BinaryHeap::new(),
                    seq: 0,
                    c,
                };
                r.run(&s);
            })?;
        Ok(Relay {
            stop,
            counters,
            thread: Some(thread),
        })
    }

    /// What the relay did so far.
    pub fn stats(&self) -> RelayStats {
        self.counters.snapshot()
    }

    /// Stops the thread (held frames are dropped) and returns the final figures.
    pub fn stop(mut self) -> RelayStats {
        self.halt();
        self.stats()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.halt();
    }
}

struct Runner {
    socks: Vec<UdpPort>,
    by_addr: HashMap<SocketAddr, usize>,
    host_of: HashMap<IpAddr, usize>,
    ports: Vec<u16>,
    faults: Faults,
    rng: SplitMix64,
    held: BinaryHeap<Held>,
    seq: u64,
    c: Arc<Counters>,
}

impl Runner {
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }

    fn run(&mut self, stop: &AtomicBool) {
        let mut rb = RecvBatch::default();
        let mut pfds: Vec<libc::pollfd> = self
            .socks
            .iter()
            .map(|s| libc::pollfd {
                fd: s.socket().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let mut now_out: Vec<Vec<OutFrame>> = vec![Vec::new(); self.socks.len()];
        while !stop.load(Ordering::Acquire) {
            let wait = self
                .held
                .peek()
                .map(|h| h.due.saturating_duration_since(Instant::now()))
                .unwrap_or(Duration::from_millis(20))
                .min(Duration::from_millis(20));
            let ms = if wait.is_zero() {
                0
            } else {
                wait.as_millis().max(1) as libc::c_int
            };
            for p in pfds.iter_mut() {
                p.revents = 0;
            }
            // SAFETY: `pfds` is a live array of pollfds of the length passed.
            unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            let ready: Vec<usize> = pfds
                .iter()
                .enumerate()
                .filter(|(_, p)| p.revents & libc::POLLIN != 0)
                .map(|(i, _)| i)
                .collect();
            for i in ready {
                while let Ok(n) = self.socks[i].recv_batch(&mut rb) {
                    for k in 0..n {
                        let (src, d, trunc) = rb.get(k);
                        self.c.received.fetch_add(1, Ordering::Relaxed);
                        match src {
                            Some(src) if !trunc => self.take(i, src, d, &mut now_out),
                            _ => {
                                self.c.bad.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    if n < pvcm_backend::port::soft::BATCH {
                        break;
                    }
                }
            }
            let now = Instant::now();
            while self.held.peek().is_some_and(|h| h.due <= now) {
                if let Some(h) = self.held.pop() {
                    if let Some(f) = self.socks[h.out].frame(h.dst, &h.mad) {
                        now_out[h.out].push(f);
                    }
                }
            }
            for (i, frames) in now_out.iter_mut().enumerate() {
                if frames.is_empty() {
                    continue;
                }
                let sent = self.socks[i].send_batch(frames) as u64;
                self.c.forwarded.fetch_add(sent, Ordering::Relaxed);
                self.c
                    .send_errors
                    .fetch_add(frames.len() as u64 - sent, Ordering::Relaxed);
                frames.clear();
            }
        }
    }

    /// A datagram that arrived on socket `i` from `src`.
    fn take(&mut self, i: usize, src: SocketAddr, d: &[u8], now_out: &mut [Vec<OutFrame>]) {
        let local = self.socks[i].local();
        let f = match check_frame(local, src, d) {
            Ok(f) => f,
            Err(_) => {
                self.c.bad.fetch_add(1, Ordering::Relaxed);
                return;
            }
        };
        // Destination host: the one owning the local address; its port.
        let (Some(&h), Some(_)) = (self.host_of.get(&local.ip()), self.host_of.get(&src.ip()))
        else {
            self.c.bad.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let port_h = self.ports[h];
        let Some(&out) = self.by_addr.get(&SocketAddr::new(src.ip(), port_h)) else {
            self.c.bad.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let dst = SocketAddr::new(local.ip(), port_h);
        let lossy = self
            .faults
            .loss_only
            .is_none_or(|a| a == pvcm_wire::mad::Packet::new_unchecked(&f.mad[..]).attr_id());
        if lossy && self.chance(self.faults.loss) {
            self.c.lost.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let copies = if self.chance(self.faults.dup) {
            self.c.duplicated.fetch_add(1, Ordering::Relaxed);
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut hold = self.faults.delay;
            if !self.faults.jitter.is_zero() {
                let j = self.rng.below(self.faults.jitter.as_micros().max(1) as u64);
                hold += Duration::from_micros(j);
            }
            if self.chance(self.faults.reorder) {
                self.c.reordered.fetch_add(1, Ordering::Relaxed);
                hold += REORDER_HOLD;
            }
            if hold.is_zero() && self.held.is_empty() {
                now_out[out].extend(self.socks[out].frame(dst, &f.mad));
            } else {
                self.seq += 1;
                self.held.push(Held {
                    due: Instant::now() + hold,
                    seq: self.seq,
                    out,
                    dst,
                    mad: f.mad,
                });
            }
        }
    }
}

/// A host that is down: UDP sockets on an address no backend serves, counting what
/// arrives (so frames sent there are accounted for in the wire checks).
#[derive(Debug)]
pub struct Sink {
    stop: Arc<AtomicBool>,
    frames: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl Sink {
    /// Binds `addr` on each of `ports` and counts datagrams until stopped.
    pub fn start(addr: Ipv4Addr, ports: &[u16]) -> io::Result<Sink> {
        let mut socks = Vec::new();
        for p in ports {
            if socks.iter().any(|s: &UdpPort| s.local().port() == *p) {
                continue;
            }
            socks.push(UdpPort::bind(IpAddr::V4(addr), 0, *p)?);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(AtomicU64::new(0));
        let (s, f) = (stop.clone(), frames.clone());
        let thread = std::thread::Builder::new()
            .name("pvcm-lab-sink".into())
            .spawn(move || {
                let mut rb = RecvBatch::default();
                let mut pfds: Vec<libc::pollfd> = socks
                    .iter()
                    .map(|s| libc::pollfd {
                        fd: s.socket().as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                loop {
                    let stopping = s.load(Ordering::Acquire);
                    // SAFETY: `pfds` is a live array of pollfds of the length passed.
                    unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, 20) };
                    for sock in &socks {
                        while let Ok(n) = sock.recv_batch(&mut rb) {
                            if n == 0 {
                                break;
                            }
                            f.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    }
                    for p in pfds.iter_mut() {
                        p.revents = 0;
                    }
                    if stopping {
                        break;
                    }
                }
            })?;
        Ok(Sink {
            stop,
            frames,
            thread: Some(thread),
        })
    }

    /// Frames received so far.
    pub fn frames(&self) -> u64 {
        self.frames.load(Ordering::Relaxed)
    }

    /// Stops (after one last drain) and returns the count.
    pub fn stop(mut self) -> u64 {
        self.halt();
        self.frames()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.halt();
    }
}

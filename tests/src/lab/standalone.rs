//! What the standalone lab commands (`pvcm-lab restart`, `migrate`, `hostile`) share:
//! their working directory, their guests and the phases their threads move through.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::error::{LabError, LabResult};
use super::guest::{GuestOpts, GuestVm, LabDevice};

/// Runs `f` in a fresh temporary directory `pvcm-NAME-PID-NET` (sockets, control
/// sockets, logs, state), removed afterwards whatever `f` returns.
pub fn in_temp_dir<R>(name: &str, net: u8, f: impl FnOnce(&Path) -> LabResult<R>) -> LabResult<R> {
    let dir = std::env::temp_dir().join(format!("pvcm-{name}-{}-{net}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(LabError::io(dir.display().to_string()))?;
    let r = f(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// A guest on the VM socket `socket` with these options.
pub fn guest(socket: &Path, opts: &GuestOpts) -> LabResult<GuestVm> {
    GuestVm::connect(socket, opts).map_err(LabError::io(socket.display().to_string()))
}

/// A guest that holds hundreds of connections at once: 1024-entry queues, 4 MiB of
/// memory, agent seed `seed`.
pub fn big_guest(socket: &Path, seed: u64) -> LabResult<GuestVm> {
    let opts = GuestOpts {
        seed,
        queue_size: 1024,
        mem_len: 4 << 20,
        ..GuestOpts::default()
    };
    guest(socket, &opts)
}

/// A run's `N` phases: the main thread moves `phase` on; each VM thread counts itself in
/// `arrived[phase]` when done with it. Threads keep pumping their device while they
/// wait, as a guest would.
#[derive(Debug)]
pub struct Phases<const N: usize> {
    phase: AtomicU32,
    arrived: [AtomicU32; N],
}

impl<const N: usize> Default for Phases<N> {
    fn default() -> Self {
        Phases {
            phase: AtomicU32::new(0),
            arrived: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

impl<const N: usize> Phases<N> {
    /// A thread is done with phase `p`.
    pub fn arrive(&self, p: u32) {
        if let Some(a) = self.arrived.get(p as usize) {
            a.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// How many threads are done with phase `p`.
    pub fn arrived(&self, p: u32) -> u32 {
        self.arrived
            .get(p as usize)
            .map_or(0, |a| a.load(Ordering::Acquire))
    }

    /// Whether the main thread has moved to phase `p` (or past it).
    pub fn at(&self, p: u32) -> bool {
        self.phase.load(Ordering::Acquire) >= p
    }

    /// The main thread moves to phase `p`.
    pub fn set(&self, p: u32) {
        self.phase.store(p, Ordering::Release);
    }

    /// A VM thread waits for the main thread to reach phase `p`, pumping its device.
    pub fn wait(&self, dev: &mut LabDevice, p: u32, until: Instant) -> LabResult<()> {
        while !self.at(p) {
            if Instant::now() > until {
                return Err(LabError::Timeout(format!("phase {p}")));
            }
            dev.run_until(Duration::from_millis(5), |_| false)?;
        }
        Ok(())
    }

    /// The main thread waits until `n` threads are done with phase `p`.
    pub fn wait_arrived(&self, p: u32, n: u32, until: Instant) -> LabResult<()> {
        while self.arrived(p) < n {
            if Instant::now() > until {
                return Err(LabError::Timeout(format!(
                    "{} of {n} threads done with phase {p}",
                    self.arrived(p)
                )));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }
}

/// What one end of a [`pair_connections`] run saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PairSide {
    /// Connections established.
    pub established: u32,
    /// Connections disconnected (and destroyed).
    pub disconnected: u32,
    /// Connections rejected or unreachable.
    pub failed: u32,
    /// The agent's REQ, REP and DREQ retries (after a final flush).
    pub retries: u64,
}

/// Pumps `g` once and handles its notices: accepts requests on `listen` (a server),
/// counts events into `side`; a client's established connections go to `up`.
pub fn pump_pair_side(
    g: &mut GuestVm,
    side: &mut PairSide,
    listen: Option<pvcm_guest::cm::CmId>,
    up: &mut Vec<pvcm_guest::cm::CmId>,
) -> LabResult<()> {
    use pvcm_guest::cm::Event;
    use pvcm_guest::device::Notice;
    g.dev
        .run_until(Duration::from_millis(2), |_| false)
        .map_err(super::world::dev_err)?;
    while let Some(nt) = g.dev.pop_notice() {
        match nt {
            Notice::Cm(Event::ConnectRequest { id, listen_id, .. })
                if Some(listen_id) == listen =>
            {
                g.dev.accept(id, &[]).map_err(|e| format!("accept: {e}"))?;
            }
            Notice::Cm(Event::Established { id, .. }) => {
                side.established += 1;
                if listen.is_none() {
                    up.push(id);
                }
            }
            Notice::Cm(Event::Disconnected { id }) => {
                side.disconnected += 1;
                let _ = g.dev.destroy(id);
            }
            Notice::Cm(Event::Rejected { id, .. } | Event::Unreachable { id }) => {
                side.failed += 1;
                let _ = g.dev.destroy(id);
            }
            _ => {}
        }
    }
    Ok(())
}

/// The agent's REQ, REP and DREQ retries, after flushing what it still sends.
pub fn pair_retries(g: &mut GuestVm) -> u64 {
    use pvcm_guest::cm::Group;
    use pvcm_wire::mad::AttributeId;
    let _ = g.dev.flush(Duration::from_millis(200));
    let k = g.dev.agent().counters();
    [AttributeId::Req, AttributeId::Rep, AttributeId::Dreq]
        .iter()
        .map(|a| k.get(Group::TxRetries, *a))
        .sum()
}

/// `n` connections from `client` to `server` (listening at `to`, TCP port `port`, with
/// private data `data`), both guests pumped in this thread. `tear_down(all_up)` is asked
/// after every round; once it says so, the client disconnects every connection it has
/// up. Fails when a connection fails, or when not all are down within `timeout`.
#[allow(clippy::too_many_arguments)]
pub fn pair_connections(
    client: &mut GuestVm,
    server: &mut GuestVm,
    to: pvcm_wire::Gid,
    port: u16,
    data: &[u8],
    n: u32,
    timeout: Duration,
    mut tear_down: impl FnMut(bool) -> bool,
) -> LabResult<(PairSide, PairSide)> {
    use pvcm_guest::cm::ConnectOptions;
    use pvcm_guest::cm::rdma_cm::tcp_service_id;
    let listen = server
        .dev
        .listen(tcp_service_id(port))
        .map_err(|e| format!("listen: {e}"))?;
    let opts = ConnectOptions::default();
    for _ in 0..n {
        client
            .dev
            .connect(to, tcp_service_id(port), data, &opts)
            .map_err(|e| format!("connect: {e}"))?;
    }
    let (mut c, mut s) = (PairSide::default(), PairSide::default());
    let mut up = Vec::new();
    let mut torn = false;
    let until = Instant::now() + timeout;
    while c.disconnected < n || s.disconnected < n {
        if Instant::now() >= until {
            return Err(format!("timed out: client {c:?}, server {s:?}").into());
        }
        pump_pair_side(server, &mut s, Some(listen), &mut Vec::new())?;
        pump_pair_side(client, &mut c, None, &mut up)?;
        if (c.failed, s.failed) != (0, 0) {
            return Err(format!("connections failed: client {c:?}, server {s:?}").into());
        }
        if !torn && tear_down(c.established == n && s.established == n) {
            for id in up.drain(..) {
                client
                    .dev
                    .disconnect(id)
                    .map_err(|e| format!("disconnect: {e}"))?;
            }
            torn = true;
        }
    }
    c.retries = pair_retries(client);
    s.retries = pair_retries(server);
    Ok((c, s))
}

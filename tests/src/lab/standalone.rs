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

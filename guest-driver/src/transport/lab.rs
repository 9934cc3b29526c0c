//! The lab transport: the pvcm device as the lab's mini-VMM (`pvcm-lab`) sets it up
//! with `pvcm-backend` over vhost-user — memfd guest memory shared with the backend, a
//! kick eventfd and a call eventfd per queue.
//!
//! [`LabTransport`] is a [`Transport`]: DMA memory is a window of the guest memory
//! ([`LinearDma`]; device address = guest-physical address), notifying queue `q` writes
//! 1 to its kick eventfd, and [`Transport::wait`] polls both call eventfds (`ppoll`
//! with the timeout) and drains the ones that fired.
//!
//! # How a VMM uses it
//!
//! ```ignore
//! // Guest memory shared with the backend (VHOST_USER_SET_MEM_TABLE done), and a DMA
//! // window in it for the driver: any page-aligned DmaRegion of that memory.
//! let window = guest_mem.dma().alloc(LabTransport::window_len(256), 4096)?;
//! let kicks = [EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?];
//! let calls = [EventFd::new(EFD_NONBLOCK)?, EventFd::new(EFD_NONBLOCK)?];
//! let lab = LabTransport::new(window, kicks, calls, negotiated_features);
//! let queues = lab.queues(256)?;
//! for (i, s) in queues.setups().iter().enumerate() {
//!     // s.desc / s.driver / s.device are guest-physical: translate to the VMM's
//!     // addresses for VHOST_USER_SET_VRING_ADDR; s.size for SET_VRING_NUM; base 0.
//!     frontend.set_vring_num(i, s.size)?;
//!     frontend.set_vring_base(i, 0)?;
//!     frontend.set_vring_addr(i, &vring_config(s))?;
//!     frontend.set_vring_kick(i, &lab.kick_fd(i as u16))?;   // or register them
//!     frontend.set_vring_call(i, &lab.call_fd(i as u16))?;   // before moving them in
//!     frontend.set_vring_enable(i, true)?;
//! }
//! let mut dev = Device::start(lab, queues, SystemClock::new(), DeviceOptions::default())?;
//! // dev.listen(...), dev.connect(...), dev.run_until(...), ...
//! ```
//!
//! The eventfds are any `AsRawFd` type (`vmm_sys_util::eventfd::EventFd`, `OwnedFd`);
//! [`eventfd`] makes one. Non-blocking eventfds are expected (only fds that `ppoll`
//! reported readable are read, so blocking ones work too). The transport never touches
//! the vhost-user session: the VMM keeps it.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use super::{Queues, Transport, TransportError};
use crate::virtq::VirtqError;
use crate::virtq::{DmaRegion, Keepalive, LinearDma, Notify};

/// The lab's device transport (see the [module documentation](self)).
pub struct LabTransport<F: AsRawFd = OwnedFd> {
    dma: LinearDma,
    kicks: [F; 2],
    calls: [F; 2],
    features: u64,
}

impl<F: AsRawFd> fmt::Debug for LabTransport<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LabTransport")
            .field("dma", &self.dma)
            .field(
                "kicks",
                &[self.kicks[0].as_raw_fd(), self.kicks[1].as_raw_fd()],
            )
            .field(
                "calls",
                &[self.calls[0].as_raw_fd(), self.calls[1].as_raw_fd()],
            )
            .field("features", &format_args!("{:#x}", self.features))
            .finish()
    }
}

/// A new non-blocking, close-on-exec eventfd.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd has no memory-safety preconditions; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl<F: AsRawFd> LabTransport<F> {
    /// A transport whose DMA memory is `window` (a page-aligned region of the guest
    /// memory the backend maps; its device address is guest-physical), with kick and
    /// call eventfds per queue (index 0 = tx, 1 = rx, as registered with
    /// `VHOST_USER_SET_VRING_KICK` / `_CALL`) and the features negotiated with
    /// `VHOST_USER_SET_FEATURES`.
    pub fn new(window: DmaRegion, kicks: [F; 2], calls: [F; 2], features: u64) -> LabTransport<F> {
        let host = NonNull::new(window.as_ptr()).unwrap_or(NonNull::dangling());
        let (gpa, len) = (window.dev_addr(), window.len());
        let keep: Keepalive = Arc::new(window);
        // SAFETY: a DmaRegion is valid for reads and writes of its `len` bytes while it
        // lives (its constructor's contract), the keepalive holds it (and through it the
        // mapping) as long as the allocator and its regions live, it was moved in so
        // nothing else on the driver side uses it, and the device sees it at its device
        // address.
        let dma = unsafe { LinearDma::new(host, gpa, len, Some(keep)) };
        LabTransport {
            dma,
            kicks,
            calls,
            features,
        }
    }

    /// [`LabTransport::new`] from raw parts: `len` bytes at host address `host` that the
    /// device sees at guest-physical `gpa_base`.
    ///
    /// # Safety
    ///
    /// `host .. host + len` must be valid for reads and writes as long as the transport
    /// and every queue allocated from it live (`keep` may hold what keeps it mapped),
    /// must be used by nothing else on the driver side, and the backend must see the
    /// same bytes at `gpa_base .. gpa_base + len`. `host` and `gpa_base` should be
    /// page-aligned alike.
    pub unsafe fn from_raw(
        host: NonNull<u8>,
        gpa_base: u64,
        len: usize,
        keep: Option<Keepalive>,
        kicks: [F; 2],
        calls: [F; 2],
        features: u64,
    ) -> LabTransport<F> {
        LabTransport {
            // SAFETY: the caller's contract is LinearDma::new's.
            dma: unsafe { LinearDma::new(host, gpa_base, len, keep) },
            kicks,
            calls,
            features,
        }
    }

    /// Bytes a window needs for queues of `queue_size` ([`Queues::dma_bytes`]).
    pub fn window_len(queue_size: u16) -> usize {
        Queues::dma_bytes(queue_size)
    }

    /// Allocates both queues (`queue_size` descriptors, a power of two up to 1024) in
    /// the window. Give their [`Queues::setups`] to the backend, then the queues to
    /// `Device::start` (`crate::device`).
    pub fn queues(&self, queue_size: u16) -> Result<Queues, VirtqError> {
        Queues::new(&self.dma, queue_size, self.features)
    }

    /// The window's allocator (for extra buffers).
    pub fn dma(&self) -> &LinearDma {
        &self.dma
    }

    /// Queue `q`'s kick eventfd (0 = tx, 1 = rx; others: rx).
    pub fn kick_fd(&self, q: u16) -> &F {
        &self.kicks[usize::from(q.min(1))]
    }

    /// Queue `q`'s call eventfd (0 = tx, 1 = rx; others: rx).
    pub fn call_fd(&self, q: u16) -> &F {
        &self.calls[usize::from(q.min(1))]
    }
}

/// Writes 1 to an eventfd (a full counter, EAGAIN, already means "signalled").
fn signal(fd: &impl AsRawFd) {
    let v: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64 to a descriptor we hold.
    let _ = unsafe { libc::write(fd.as_raw_fd(), (&v as *const u64).cast(), 8) };
}

/// Reads (resets) an eventfd's counter.
fn drain(fd: &impl AsRawFd) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into a live u64 from a descriptor we hold.
    let _ = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

impl<F: AsRawFd> Notify for LabTransport<F> {
    fn notify(&self, queue: u16) {
        if let Some(fd) = self.kicks.get(usize::from(queue)) {
            signal(fd);
        }
    }
}

impl<F: AsRawFd> Transport for LabTransport<F> {
    fn features(&self) -> u64 {
        self.features
    }

    /// `ppoll`s both call eventfds for up to `timeout` and drains those that fired.
    fn wait(&mut self, timeout: Duration) -> Result<(), TransportError> {
        let mut fds = [
            libc::pollfd {
                fd: self.calls[0].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.calls[1].as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Cap at a day: a timespec holds it, and callers re-wait anyway.
        let t = timeout.min(Duration::from_secs(86_400));
        let ts = libc::timespec {
            tv_sec: t.as_secs() as libc::time_t,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        };
        // SAFETY: two valid pollfds and a timespec that live across the call; no
        // signal mask.
        let r = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, core::ptr::null()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(TransportError {
                what: "ppoll on the call eventfds".into(),
                source: e,
            });
        }
        for (p, fd) in fds.iter().zip(&self.calls) {
            if p.revents & libc::POLLIN != 0 {
                drain(fd);
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        "lab".into()
    }

    fn wait_with(
        &mut self,
        timeout: Duration,
        extra: &[std::os::fd::RawFd],
    ) -> Result<u64, TransportError> {
        let own = [self.calls[0].as_raw_fd(), self.calls[1].as_raw_fd()];
        let (mine, theirs) =
            super::poll_readable(&own, extra, timeout).map_err(|source| TransportError {
                what: "ppoll on the call eventfds".into(),
                source,
            })?;
        for (i, fd) in self.calls.iter().enumerate() {
            if mine & (1 << i) != 0 {
                drain(fd);
            }
        }
        Ok(theirs)
    }
    fn wait_fds(&self, timeout: Duration) -> (Vec<std::os::fd::RawFd>, Duration) {
        (
            vec![self.calls[0].as_raw_fd(), self.calls[1].as_raw_fd()],
            timeout,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::pci::MmapBar;
    use crate::virtq::DmaMemory;
    use std::time::Instant;

    fn window(len: usize) -> LinearDma {
        let f = tempfile::tempfile().expect("tempfile");
        f.set_len(len as u64).expect("len");
        let m = Arc::new(MmapBar::map(&f, len).expect("map"));
        let p = NonNull::new(m.as_ptr()).expect("non-null");
        // SAFETY: `len` bytes of a mapping kept alive by the keepalive, used by nothing
        // else.
        unsafe { LinearDma::new(p, 0x4000_0000, len, Some(m)) }
    }

    fn counter(fd: &OwnedFd) -> u64 {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64.
        let n = unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        if n == 8 { v } else { 0 }
    }

    fn fds() -> [OwnedFd; 2] {
        [eventfd().expect("eventfd"), eventfd().expect("eventfd")]
    }

    #[test]
    fn queues_live_in_the_window() {
        let guest = window(4 << 20);
        // A window in the middle of guest memory, as a VMM would carve it.
        let _before = guest.alloc(12288, 4096).expect("before");
        let w = guest
            .alloc(LabTransport::<OwnedFd>::window_len(256), 4096)
            .expect("window");
        let (lo, hi) = (w.dev_addr(), w.dev_addr() + w.len() as u64);
        let lab = LabTransport::new(w, fds(), fds(), crate::virtq::features::PVCM);
        let q = lab.queues(256).expect("queues");
        for s in q.setups() {
            for a in [s.desc, s.driver, s.device] {
                assert!((lo..hi).contains(&a), "{a:#x} outside {lo:#x}..{hi:#x}");
            }
            assert_eq!(s.size, 256);
        }
        assert!(q.tx.virtq().event_idx());
        assert_eq!(q.tx.virtq().max_indirect(), 0, "one buffer per message");
        // A second set does not fit.
        assert!(lab.queues(256).is_err());
        assert!(format!("{lab:?}").contains("LabTransport"));
    }

    #[test]
    fn notify_writes_the_kick_eventfd() {
        let guest = window(1 << 20);
        let w = guest.alloc(64 << 10, 4096).expect("window");
        let lab = LabTransport::new(w, fds(), fds(), 0);
        lab.notify(1);
        lab.notify(1);
        lab.notify(7); // no such queue: ignored
        assert_eq!(counter(lab.kick_fd(1)), 2);
        assert_eq!(counter(lab.kick_fd(0)), 0);
        lab.notify(0);
        assert_eq!(counter(lab.kick_fd(0)), 1);
    }

    #[test]
    fn wait_returns_on_a_call_and_times_out_otherwise() {
        let guest = window(1 << 20);
        let w = guest.alloc(64 << 10, 4096).expect("window");
        let mut lab = LabTransport::new(w, fds(), fds(), 0);
        let t = Instant::now();
        lab.wait(Duration::from_millis(30)).expect("wait");
        assert!(
            t.elapsed() >= Duration::from_millis(25),
            "{:?}",
            t.elapsed()
        );
        signal(lab.call_fd(1));
        let t = Instant::now();
        lab.wait(Duration::from_secs(10)).expect("wait");
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(counter(lab.call_fd(1)), 0, "drained");
        // From another thread while waiting.
        // SAFETY: F = OwnedFd; dup of a live descriptor for the other thread.
        let dup = unsafe { libc::dup(lab.call_fd(0).as_raw_fd()) };
        assert!(dup >= 0);
        // SAFETY: a fresh descriptor owned by the thread below.
        let other = unsafe { OwnedFd::from_raw_fd(dup) };
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            signal(&other);
        });
        let t = Instant::now();
        lab.wait(Duration::from_secs(10)).expect("wait");
        assert!(t.elapsed() < Duration::from_secs(5));
        h.join().expect("join");
        lab.wait(Duration::ZERO).expect("zero timeout");
    }

    #[test]
    fn from_raw_parts() {
        let guest = window(1 << 20);
        let w = guest.alloc(512 << 10, 4096).expect("window");
        let (p, gpa, len) = (
            NonNull::new(w.as_ptr()).expect("non-null"),
            w.dev_addr(),
            w.len(),
        );
        let keep: Keepalive = Arc::new(w);
        // SAFETY: the region's bytes, kept alive by `keep`, used by nothing else.
        let lab = unsafe { LabTransport::from_raw(p, gpa, len, Some(keep), fds(), fds(), 0) };
        let q = lab.queues(64).expect("queues");
        assert!(q.setups()[0].desc >= gpa);
        assert!(!q.tx.virtq().event_idx());
        assert_eq!(lab.describe(), "lab");
    }
}

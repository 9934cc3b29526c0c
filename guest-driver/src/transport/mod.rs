//! Transports: how the guest driver reaches the pvcm device.
//!
//! - [`pci`]: a user-space virtio-pci (modern) driver, for a real VM.
//!   [`crate::device::pci::PciDevice`] puts its pieces together as a [`Transport`].
//! - [`lab`]: the lab's transport (shared memory and eventfds set up by the lab's
//!   mini-VMM in `pvcm-lab`): a [`crate::virtq::LinearDma`] window of the memfd guest
//!   memory, kicks written to the kick eventfds, waits on the call eventfds. The device
//!   addresses the queues report (`Queues::setups`) are guest-physical addresses; the
//!   mini-VMM translates them to its own virtual addresses for
//!   `VHOST_USER_SET_VRING_ADDR`, gives the queue size as the vring size and 0 as the
//!   vring base.

//!
//! The [`Transport`] trait and the [`Queues`] it carries live here, below the device
//! layer (`crate::device`), which uses them; nothing here imports the device layer.

pub mod lab;
pub mod pci;

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use pvcm_wire::abi::{RX_BUFFER_LEN, RX_QUEUE, TX_QUEUE};

use crate::virtq::{DmaMemory, MsgQueue, Notify, Virtq, VirtqConfig, VirtqError};
use pci::QueueSetup;

/// A transport's wait failed (an OS call); the device layer reports it as
/// `DeviceError::Io`.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct TransportError {
    /// What was being done.
    pub what: String,
    /// The error.
    #[source]
    pub source: io::Error,
}

/// What the device layer needs from a transport besides notifying queues
/// ([`Notify`]).
pub trait Transport: Notify {
    /// The virtio features negotiated with the device.
    fn features(&self) -> u64;

    /// Blocks until the device may have returned used buffers (a used-buffer
    /// notification on either queue) or `timeout` has passed, whichever is first.
    /// Spurious and early returns are allowed: the caller re-checks the rings.
    /// Transports without notifications sleep a short poll interval.
    fn wait(&mut self, timeout: Duration) -> Result<(), TransportError>;

    /// Messages moved on a queue: a transport that polls polls fast again (see
    /// `PciDevice`'s idle back-off). The default does nothing.
    fn note_activity(&mut self) {}

    /// A short description for logs and `info` ("lab", "pci 0000:00:04.0").
    fn describe(&self) -> String;

    /// As [`Transport::wait`], and returns as well when one of `extra` becomes readable
    /// (a caller that also serves other descriptors, e.g. the guest CM service's CUSE
    /// device); returns which of `extra` are readable, bit `i` for `extra[i]` (at most
    /// 64). The default, for transports without a notification descriptor, waits on
    /// `extra` for at most the 1 ms a polling transport sleeps.
    fn wait_with(&mut self, timeout: Duration, extra: &[RawFd]) -> Result<u64, TransportError> {
        let (_, mask) =
            poll_readable(&[], extra, timeout.min(Duration::from_millis(1))).map_err(|source| {
                TransportError {
                    what: "ppoll".into(),
                    source,
                }
            })?;
        Ok(mask)
    }

    /// For a caller that waits on the device's notifications without holding the
    /// transport (the guest CM service, whose other threads use the device meanwhile):
    /// the descriptors a used-buffer notification makes readable, and how long of
    /// `timeout` to wait on them. The caller then takes the notification with
    /// [`Transport::wait_with`] and a zero timeout. The default, for transports without
    /// a notification descriptor: none, and the 1 ms a polling transport sleeps.
    fn wait_fds(&self, timeout: Duration) -> (Vec<RawFd>, Duration) {
        (Vec::new(), timeout.min(Duration::from_millis(1)))
    }
}

/// `ppoll`s `own` and `extra` for readability for up to `timeout`; returns the readable
/// ones of each as bit masks (`EINTR` is no descriptor readable). At most 64 of each.
pub fn poll_readable(own: &[RawFd], extra: &[RawFd], timeout: Duration) -> io::Result<(u64, u64)> {
    let mut fds: Vec<libc::pollfd> = own
        .iter()
        .chain(extra)
        .take(128)
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // Cap at a day: a timespec holds it, and callers re-wait anyway.
    let t = timeout.min(Duration::from_secs(86_400));
    let ts = libc::timespec {
        tv_sec: t.as_secs() as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `fds` holds `fds.len()` valid pollfds and `ts` a valid timespec, both
    // live across the call; a null signal mask leaves the mask as it is.
    let r = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            &ts,
            core::ptr::null(),
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok((0, 0))
        } else {
            Err(e)
        };
    }
    let ready = |p: &libc::pollfd| p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP) != 0;
    let (mut a, mut b) = (0u64, 0u64);
    for (i, p) in fds.iter().enumerate() {
        if !ready(p) {
            continue;
        }
        if i < own.len() {
            a |= 1 << i.min(63);
        } else {
            b |= 1 << (i - own.len()).min(63);
        }
    }
    Ok((a, b))
}

impl<T: Transport + ?Sized> Transport for Box<T> {
    fn features(&self) -> u64 {
        (**self).features()
    }
    fn wait(&mut self, timeout: Duration) -> Result<(), TransportError> {
        (**self).wait(timeout)
    }
    fn note_activity(&mut self) {
        (**self).note_activity()
    }
    fn describe(&self) -> String {
        (**self).describe()
    }
    fn wait_with(&mut self, timeout: Duration, extra: &[RawFd]) -> Result<u64, TransportError> {
        (**self).wait_with(timeout, extra)
    }
    fn wait_fds(&self, timeout: Duration) -> (Vec<RawFd>, Duration) {
        (**self).wait_fds(timeout)
    }
}

impl<T: Notify + ?Sized> Notify for Box<T> {
    fn notify(&self, queue: u16) {
        (**self).notify(queue)
    }
}

/// The device's two queues: 0 = tx (driver -> device), 1 = rx (device -> driver), each
/// with one buffer of `abi::RX_BUFFER_LEN` bytes per descriptor.
#[derive(Debug)]
pub struct Queues {
    /// Queue 0: messages to the device.
    pub tx: MsgQueue,
    /// Queue 1: messages from the device.
    pub rx: MsgQueue,
}

impl Queues {
    /// Bytes of each buffer: a header and the largest payload.
    pub const SLOT_LEN: usize = RX_BUFFER_LEN;

    /// Allocates both queues of `size` descriptors (a power of two, at most 1024) from
    /// `dma`, using what the negotiated `features` allow (EVENT_IDX; indirect
    /// descriptors are never needed: every message is one buffer).
    pub fn new<D: DmaMemory + ?Sized>(
        dma: &D,
        size: u16,
        features: u64,
    ) -> Result<Queues, VirtqError> {
        let cfg = |q: u16| {
            VirtqConfig::new(q, size)
                .with_features(features)
                .with_indirect(0)
        };
        Ok(Queues {
            tx: MsgQueue::new(dma, cfg(TX_QUEUE), Self::SLOT_LEN)?,
            rx: MsgQueue::new(dma, cfg(RX_QUEUE), Self::SLOT_LEN)?,
        })
    }

    /// An upper bound of the DMA memory [`Queues::new`] takes for queues of `size`,
    /// alignment padding included (for sizing a DMA window).
    pub fn dma_bytes(size: u16) -> usize {
        let n = usize::from(size);
        let ring = Virtq::ring_bytes(size) + 4096;
        let pool = Self::SLOT_LEN.next_multiple_of(64) * n + 64;
        2 * (ring + pool)
    }

    /// Where the device finds each queue (index, size, ring addresses as device
    /// addresses): what a VMM gives `VHOST_USER_SET_VRING_*` (after translating the
    /// guest-physical addresses to its own) or a PCI driver writes to the common
    /// configuration.
    pub fn setups(&self) -> [QueueSetup; 2] {
        [
            QueueSetup::from(self.tx.virtq()),
            QueueSetup::from(self.rx.virtq()),
        ]
    }
}

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

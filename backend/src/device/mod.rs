//! The pvcm virtio device, served over vhost-user (one [`PvcmDevice`] per VM session).
//!
//! Two queues (ABI in `docs/device-abi.md`): 0 = tx (driver -> device), 1 = rx
//! (device -> driver). The device walks each tx chain defensively (bounded length, guest
//! addresses checked, direction checked, loops and broken links detected): a bad chain is
//! returned to the driver unread and counted; the queue keeps working. Messages:
//!
//! - MAD -> [`crate::mux::Mux::from_guest`] -> the wire port (or an in-band reply, or a
//!   SEND_ERROR back on rx carrying the MAD as sent, with a [`SendStatus`]);
//! - PORT_INFO_REQUEST -> PORT_INFO on rx.
//!
//! Everything for rx goes through the VM's bounded backlog (`--rx-backlog`). The host
//! loop writes what it routes from the wire straight into the session's rx buffers (the
//! ring the device publishes on its VM port), one batch at a time; what finds no buffer
//! waits in the backlog and is written by this VM's own vring worker thread when the
//! driver posts buffers (it kicks only then), or when woken by an eventfd. A VM that
//! posts no buffers only loses its own messages (counted) and never delays another VM
//! or the wire.
//!
//! Outside this module the device is [`PvcmDevice::new`] and vhost-user-backend's
//! [`VhostUserBackendMut`], here. Inside, one file per job:
//!
//! - `queue.rs`: the queue work, plain functions over a `virtio_queue::Queue` and guest
//!   memory (`take_tx_round`, `fill_rx`, `finish_rx`) with the vring lock and
//!   notifications around them, so the unit tests (`tests.rs`) drive them through
//!   virtio-queue's `MockSplitQueue`, and the fuzz target through [`fuzzing`];
//! - `tx.rs`: a round of tx messages checked and handled under one mux lock, then the
//!   I/O, and the throttle of a guest that floods bad input;
//! - `transfer.rs`: the device state of a live migration, and what a VM that starts
//!   running here without its state is.

use std::fs::File;
use std::io;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::Mutex;

use pvcm_wire::abi;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
};
use vhost_user_backend::{VhostUserBackendMut, VringRwLock};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::DescriptorChain;
use vm_memory::{GuestMemory, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::shared::Shared;
use crate::vm_port::VmPort;

mod queue;
#[cfg(test)]
mod tests;
mod transfer;
mod tx;

use transfer::Transfer;
pub use tx::{THROTTLE_BAD_PER_ROUND, TxThrottle};

/// Queues: tx and rx.
pub const NUM_QUEUES: usize = 2;
/// Largest queue size the device accepts (any size up to this works).
pub const MAX_QUEUE_SIZE: usize = 1024;
/// `handle_event` id of the VM's rx-wake eventfd (0, 1 are the queues; 2 is reserved for
/// the exit event by vhost-user-backend).
pub const RX_WAKE_EVENT: u16 = 3;
/// The `VHOST_USER_F_PROTOCOL_FEATURES` feature bit.
const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// `VHOST_F_LOG_ALL`: the device logs its writes to guest memory while the VMM
/// migrates (QEMU blocks migration of a vhost device without it).
const VHOST_F_LOG_ALL: u64 = 1 << 26;

/// Guest memory as the device maps it: with the dirty-page log vhost-user-backend keeps
/// during a live migration (`VHOST_F_LOG_ALL`), so every byte the device writes into
/// guest memory (rx messages, used rings) is copied again by the VMM.
pub type Mem = GuestMemoryMmap<crate::dirty_log::DirtyLog>;
/// A vring over [`Mem`].
pub type Vring = VringRwLock<GuestMemoryAtomic<Mem>>;

/// Virtio features the device offers.
pub fn device_features() -> u64 {
    (1 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | VHOST_USER_F_PROTOCOL_FEATURES
        | VHOST_F_LOG_ALL
}

/// vhost-user protocol features the device offers.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::DEVICE_STATE
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// The config space read at `offset`, `size` bytes: the 8-byte [`abi::config_space`],
/// zeros beyond it.
pub fn config_bytes(offset: u32, size: u32) -> Vec<u8> {
    let cfg = abi::config_space();
    let size = size.min(256) as usize;
    (0..size)
        .map(|i| cfg.get(offset as usize + i).copied().unwrap_or(0))
        .collect()
}

/// The device of one VM session. Created fresh for every vhost-user connection.
#[derive(Debug)]
pub struct PvcmDevice {
    shared: Arc<Shared>,
    port: Arc<VmPort>,
    mem: Option<GuestMemoryAtomic<Mem>>,
    event_idx: bool,
    exit_consumer: EventConsumer,
    exit_notifier: EventNotifier,
    throttle: TxThrottle,
    transfer: Mutex<Option<Transfer>>,
    /// Whether this session's rx ring is published on the VM port (see
    /// [`PvcmDevice::publish_rx_ring`]).
    rx_published: bool,
}

impl PvcmDevice {
    /// A device for `port`'s VM.
    pub fn new(shared: Arc<Shared>, port: Arc<VmPort>) -> io::Result<PvcmDevice> {
        let (exit_consumer, exit_notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
        Ok(PvcmDevice {
            shared,
            port,
            mem: None,
            event_idx: false,
            exit_consumer,
            exit_notifier,
            throttle: TxThrottle::default(),
            transfer: Mutex::new(None),
            rx_published: false,
        })
    }
}

impl PvcmDevice {
    /// Publishes this session's rx ring on the VM port, so the host loop writes what it
    /// routes to the VM straight into the ring. Done at the session's first event, once
    /// memory and features are set; undone when either changes and on a reset (the next
    /// event publishes again), and by the VM's thread when the session ends.
    fn publish_rx_ring(&mut self, rx: &Vring) {
        if let Some(ring) = self.rx_ring(rx) {
            self.port.publish_rx_ring(Some(Arc::new(ring)));
            self.rx_published = true;
        }
    }

    fn unpublish_rx_ring(&mut self) {
        if self.rx_published {
            self.port.publish_rx_ring(None);
            self.rx_published = false;
        }
    }
}

impl VhostUserBackendMut for PvcmDevice {
    type Bitmap = crate::dirty_log::DirtyLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        device_features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        protocol_features()
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
        self.unpublish_rx_ring();
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_bytes(offset, size)
    }

    fn update_memory(&mut self, mem: GuestMemoryAtomic<Mem>) -> io::Result<()> {
        self.mem = Some(mem);
        self.unpublish_rx_ring();
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) -> io::Result<Option<File>> {
        self.start_transfer(direction, phase, file);
        Ok(None)
    }

    fn check_device_state(&self) -> io::Result<()> {
        self.end_transfer()
    }

    fn reset_device(&mut self) {
        tracing::info!("device reset: releasing the VM's connections");
        self.unpublish_rx_ring();
        self.shared.reset_vm(&self.port);
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        Some((
            self.exit_consumer.try_clone().ok()?,
            self.exit_notifier.try_clone().ok()?,
        ))
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        let port = self.port.clone();
        let _span = port.span.enter();
        let [tx, rx] = vrings else {
            return Ok(());
        };
        if device_event <= 1 {
            self.vm_runs_here();
        }
        if !self.rx_published {
            self.publish_rx_ring(rx);
        }
        match device_event {
            0 => self.process_tx(tx, rx),
            1 => self.deliver_rx(rx),
            RX_WAKE_EVENT => {
                let _ = self.port.rx_wake.read();
                self.deliver_rx(rx);
            }
            _ => {}
        }
        // Errors of single messages are counted drops; the queue keeps working.
        Ok(())
    }
}

/// The device's descriptor-chain walks, for the fuzz targets in `fuzz/`. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    use super::queue::{read_chain, write_chain};
    use super::*;
    use crate::stats::DevDrop;

    /// Reads one tx chain as the device does: the message's bytes, or the counted drop.
    pub fn read_tx_chain<M>(mem: &Mem, chain: DescriptorChain<M>) -> Result<Vec<u8>, DevDrop>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        read_chain(mem, chain).map(|m| {
            let mut v = m.head.to_vec();
            v.extend_from_slice(&m.mad);
            v.truncate(m.len);
            v
        })
    }

    /// Writes `bytes` into one rx chain as the device does, or says why it could not.
    pub fn write_rx_chain<M>(
        mem: &Mem,
        chain: DescriptorChain<M>,
        bytes: &[u8],
    ) -> Result<(), DevDrop>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        write_chain(mem, chain, bytes)
    }
}

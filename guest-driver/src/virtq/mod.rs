//! The driver side of a virtio 1.x split virtqueue (virtio spec section 2.7).
//!
//! - [`Virtq`]: descriptor table, available ring, used ring, a shadow free list of
//!   descriptors, `VIRTIO_RING_F_EVENT_IDX` (the driver writes `used_event` and reads
//!   `avail_event`), batching (several chains, one available-index store, at most one
//!   notification) and optional indirect descriptors. Chains are lists of
//!   [`Segment`]s (device addresses) with a `u16` token.
//! - [`BufferPool`] and [`MsgQueue`]: a fixed pool of message buffers per queue
//!   (for pvcm: `pvcm_wire::abi::RX_BUFFER_LEN` bytes each) that the caller fills and
//!   reads in place, with the ownership of each slot tracked; no allocation per message.
//! - [`DmaMemory`]: where rings and buffers come from: a zeroed, aligned region with a
//!   host pointer and a device address. [`LinearDma`] covers one linear mapping (guest
//!   memory in the lab and tests); `transport::pci::HugeDma` covers hugetlbfs memory
//!   with physical addresses inside a VM.
//! - [`Notify`]: how a queue is kicked (an eventfd in the lab, the notify BAR on PCI).
//!
//! # Memory ordering
//!
//! Descriptors and available-ring entries are written first; [`Virtq::publish`] stores
//! the available index with `Release`, then a `SeqCst` fence orders that store before it
//! reads the device's suppression state (`avail_event` or the used ring's NO_NOTIFY
//! flag). [`Virtq::pop_used`] loads the used index with `Acquire` before it reads the
//! element and the buffer. [`Virtq::enable_notifications`] writes `used_event` (or clears
//! NO_INTERRUPT), fences, and re-checks the used index: a driver about to sleep must
//! drain the queue again when it returns `true` (rust-vmm notes, item 8). All 16-bit
//! indexes wrap; ring positions are `index & (size - 1)`.
//!
//! The tests (`guest-driver/tests/virtq*.rs`) run this queue against the device side
//! of the `virtio-queue` crate over `vm-memory` guest memory.

mod dma;
mod pool;
mod split;

pub use dma::{DmaError, DmaMemory, DmaRegion, Keepalive, LinearDma};
pub use pool::{BufferPool, MsgQueue, SlotState};
pub use split::{
    MAX_QUEUE_SIZE, Notify, Segment, Used, VIRTQ_AVAIL_F_NO_INTERRUPT, VIRTQ_DESC_F_INDIRECT,
    VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE, VIRTQ_USED_F_NO_NOTIFY, Virtq, VirtqConfig, VirtqStats,
    need_event,
};

pub(crate) use dma::align_up;

/// Virtio feature bits (as masks of the 64-bit feature word) this driver knows.
pub mod features {
    /// `VIRTIO_RING_F_INDIRECT_DESC` (bit 28).
    pub const INDIRECT_DESC: u64 = 1 << 28;
    /// `VIRTIO_RING_F_EVENT_IDX` (bit 29).
    pub const EVENT_IDX: u64 = 1 << 29;
    /// `VIRTIO_F_VERSION_1` (bit 32).
    pub const VERSION_1: u64 = 1 << 32;
    /// What the pvcm device offers and the driver wants.
    pub const PVCM: u64 = VERSION_1 | EVENT_IDX | INDIRECT_DESC;
}

/// Errors of the virtqueue and its buffer pool.
#[derive(Debug, thiserror::Error)]
pub enum VirtqError {
    /// Queue size not a power of two in 1 ..= [`MAX_QUEUE_SIZE`].
    #[error("bad queue size {0} (power of two, 1..=1024)")]
    BadSize(u16),
    /// `max_indirect` is larger than the queue size.
    #[error("bad indirect table length {max_indirect} for queue size {size}")]
    BadIndirect {
        /// Asked-for table length.
        max_indirect: u16,
        /// Queue size.
        size: u16,
    },
    /// The DMA allocator failed.
    #[error("DMA: {0}")]
    Dma(#[from] DmaError),
    /// The DMA allocator returned memory that is not page-aligned.
    #[error("DMA allocator returned misaligned ring memory")]
    Misaligned,
    /// A chain without buffers.
    #[error("empty descriptor chain")]
    EmptyChain,
    /// More buffers than the queue size, or more than 4 GiB in total.
    #[error("descriptor chain too long ({buffers} buffers)")]
    ChainTooLong {
        /// Buffers in the chain.
        buffers: usize,
    },
    /// Not enough free descriptors: take used chains first.
    #[error("virtqueue full")]
    Full,
    /// The device returned a used element that names no outstanding chain.
    #[error("device returned bad used element id {id}")]
    BadUsed {
        /// The id it returned.
        id: u32,
    },
    /// The device's used index ran ahead of the chains it was given.
    #[error("device used index {used_idx} ahead of {last_used} + {in_flight} in flight")]
    UsedIdxRunaway {
        /// Used index read.
        used_idx: u16,
        /// Driver's last used index.
        last_used: u16,
        /// Chains outstanding.
        in_flight: u16,
    },
    /// The queue is broken (the device broke the protocol); reset it.
    #[error("virtqueue broken")]
    Broken,
    /// Pool with no slots, empty slots or slots above 4 GiB.
    #[error("bad buffer pool: {count} slots of {slot_len} bytes")]
    BadPool {
        /// Slots asked for.
        count: u16,
        /// Bytes per slot.
        slot_len: usize,
    },
    /// No such slot.
    #[error("no buffer slot {0}")]
    BadSlot(u16),
    /// The slot is not in the state the operation needs.
    #[error("buffer slot {slot} is {state:?}, not {want:?}")]
    SlotState {
        /// The slot.
        slot: u16,
        /// Its state.
        state: SlotState,
        /// The state needed.
        want: SlotState,
    },
    /// A message length of 0 or beyond the slot.
    #[error("message length {len} does not fit a slot of {slot_len}")]
    BadLen {
        /// The length.
        len: usize,
        /// Bytes per slot.
        slot_len: usize,
    },
}

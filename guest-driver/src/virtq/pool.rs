//! Fixed pools of message buffers, and a queue that carries them.

use super::VirtqError;
use super::dma::{DmaMemory, DmaRegion};
use super::split::{Notify, Segment, Used, Virtq, VirtqConfig, VirtqStats};

/// Who owns a slot of a [`BufferPool`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// In the pool's free list.
    Free,
    /// Handed out to the driver ([`BufferPool::alloc`], or returned by the device):
    /// readable and writable by the caller.
    Owned,
    /// Given to the device; not accessible until it comes back.
    Posted,
}

/// Stride between slots: slot lengths rounded up to a cache line.
const SLOT_ALIGN: usize = 64;

/// `count` DMA buffers of `slot_len` bytes each, in one region, with their ownership.
///
/// The caller writes and reads messages in place ([`BufferPool::buf_mut`],
/// [`BufferPool::buf`]) while it owns a slot; a posted slot is the device's.
#[derive(Debug)]
pub struct BufferPool {
    region: DmaRegion,
    slot_len: usize,
    stride: usize,
    state: Box<[SlotState]>,
    /// Stack of free slots (capacity `count`, never grows).
    free: Vec<u16>,
}

impl BufferPool {
    /// Allocates `count` (1 ..= 65535) zeroed slots of `slot_len` (1 ..= 4 GiB) bytes.
    pub fn new<D: DmaMemory + ?Sized>(
        mem: &D,
        count: u16,
        slot_len: usize,
    ) -> Result<BufferPool, VirtqError> {
        if count == 0 || slot_len == 0 || u32::try_from(slot_len).is_err() {
            return Err(VirtqError::BadPool { count, slot_len });
        }
        let stride = slot_len.next_multiple_of(SLOT_ALIGN);
        let total = stride
            .checked_mul(usize::from(count))
            .ok_or(VirtqError::BadPool { count, slot_len })?;
        let region = mem.alloc(total, SLOT_ALIGN)?;
        Ok(BufferPool {
            region,
            slot_len,
            stride,
            state: vec![SlotState::Free; usize::from(count)].into_boxed_slice(),
            free: (0..count).rev().collect(),
        })
    }

    /// Number of slots.
    pub fn count(&self) -> u16 {
        self.state.len() as u16
    }

    /// Bytes per slot.
    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Free slots.
    pub fn num_free(&self) -> u16 {
        self.free.len() as u16
    }

    /// The state of `slot` (`None` if out of range).
    pub fn state(&self, slot: u16) -> Option<SlotState> {
        self.state.get(usize::from(slot)).copied()
    }

    /// Device address of `slot` (`None` if out of range).
    pub fn dev_addr(&self, slot: u16) -> Option<u64> {
        (slot < self.count())
            .then(|| self.region.dev_addr() + (usize::from(slot) * self.stride) as u64)
    }

    /// Takes a free slot; it is then [`SlotState::Owned`].
    pub fn alloc(&mut self) -> Option<u16> {
        let s = self.free.pop()?;
        self.state[usize::from(s)] = SlotState::Owned;
        Some(s)
    }

    /// Returns an owned slot to the free list.
    pub fn free(&mut self, slot: u16) -> Result<(), VirtqError> {
        self.transition(slot, SlotState::Owned, SlotState::Free)?;
        self.free.push(slot);
        Ok(())
    }

    fn transition(&mut self, slot: u16, from: SlotState, to: SlotState) -> Result<(), VirtqError> {
        match self.state.get_mut(usize::from(slot)) {
            Some(s) if *s == from => {
                *s = to;
                Ok(())
            }
            Some(s) => Err(VirtqError::SlotState {
                slot,
                state: *s,
                want: from,
            }),
            None => Err(VirtqError::BadSlot(slot)),
        }
    }

    fn owned(&self, slot: u16) -> Result<*mut u8, VirtqError> {
        match self.state.get(usize::from(slot)) {
            Some(SlotState::Owned) => {
                // SAFETY: slot < count, so the offset is inside the region
                // (count * stride bytes).
                Ok(unsafe { self.region.as_ptr().add(usize::from(slot) * self.stride) })
            }
            Some(s) => Err(VirtqError::SlotState {
                slot,
                state: *s,
                want: SlotState::Owned,
            }),
            None => Err(VirtqError::BadSlot(slot)),
        }
    }

    /// The bytes of an owned slot.
    pub fn buf(&self, slot: u16) -> Result<&[u8], VirtqError> {
        let p = self.owned(slot)?;
        // SAFETY: `p` points at `slot_len` bytes inside the region, valid while `self`
        // lives; the slot is owned by the driver, so the device does not access it, and
        // only `&mut self` methods hand out mutable access.
        Ok(unsafe { core::slice::from_raw_parts(p, self.slot_len) })
    }

    /// The bytes of an owned slot, writable.
    pub fn buf_mut(&mut self, slot: u16) -> Result<&mut [u8], VirtqError> {
        let p = self.owned(slot)?;
        // SAFETY: as in `buf`, and `&mut self` makes this the only access from Rust.
        Ok(unsafe { core::slice::from_raw_parts_mut(p, self.slot_len) })
    }

    /// Marks an owned slot posted and returns its first `len` bytes as a segment.
    fn post(&mut self, slot: u16, len: usize) -> Result<Segment, VirtqError> {
        if len == 0 || len > self.slot_len {
            return Err(VirtqError::BadLen {
                len,
                slot_len: self.slot_len,
            });
        }
        let addr = self.dev_addr(slot).ok_or(VirtqError::BadSlot(slot))?;
        self.transition(slot, SlotState::Owned, SlotState::Posted)?;
        Ok(Segment::new(addr, len as u32))
    }
}

/// A [`Virtq`] whose chains are the slots of its own [`BufferPool`], one slot per
/// message; tokens are slot numbers.
///
/// Send (tx):
/// ```ignore
/// let s = q.alloc().ok_or(Busy)?;          // an owned slot
/// let n = fill(q.buf_mut(s)?);             // header + payload, in place
/// q.send(s, n)?;                           // device-readable chain
/// if q.publish() { notifier.notify(q.virtq().queue_index()) }
/// // later: while let Some(u) = q.pop_used()? { q.free(u.token)? }
/// ```
/// Receive (rx):
/// ```ignore
/// q.post_all()?; q.kick(&notifier);        // every slot device-writable
/// while let Some(u) = q.pop_used()? {
///     handle(&q.buf(u.token)?[..u.len as usize]);
///     q.post(u.token)?;                    // give it back
/// }
/// ```
#[derive(Debug)]
pub struct MsgQueue {
    vq: Virtq,
    pool: BufferPool,
}

impl MsgQueue {
    /// A queue per `cfg` with one slot of `slot_len` bytes per descriptor.
    pub fn new<D: DmaMemory + ?Sized>(
        mem: &D,
        cfg: VirtqConfig,
        slot_len: usize,
    ) -> Result<MsgQueue, VirtqError> {
        Self::with_slots(mem, cfg, cfg.size, slot_len)
    }

    /// A queue per `cfg` with `slots` slots of `slot_len` bytes.
    pub fn with_slots<D: DmaMemory + ?Sized>(
        mem: &D,
        cfg: VirtqConfig,
        slots: u16,
        slot_len: usize,
    ) -> Result<MsgQueue, VirtqError> {
        Ok(MsgQueue {
            vq: Virtq::new(mem, cfg)?,
            pool: BufferPool::new(mem, slots, slot_len)?,
        })
    }

    /// The queue (addresses and size for the device, counters).
    pub fn virtq(&self) -> &Virtq {
        &self.vq
    }

    /// The pool.
    pub fn pool(&self) -> &BufferPool {
        &self.pool
    }

    /// Counters of the queue.
    pub fn stats(&self) -> VirtqStats {
        self.vq.stats()
    }

    /// Takes a free slot to fill.
    pub fn alloc(&mut self) -> Option<u16> {
        self.pool.alloc()
    }

    /// Returns an owned slot to the pool.
    pub fn free(&mut self, slot: u16) -> Result<(), VirtqError> {
        self.pool.free(slot)
    }

    /// The bytes of an owned slot.
    pub fn buf(&self, slot: u16) -> Result<&[u8], VirtqError> {
        self.pool.buf(slot)
    }

    /// The bytes of an owned slot, writable.
    pub fn buf_mut(&mut self, slot: u16) -> Result<&mut [u8], VirtqError> {
        self.pool.buf_mut(slot)
    }

    fn add(&mut self, slot: u16, len: usize, writable: bool) -> Result<(), VirtqError> {
        let seg = self.pool.post(slot, len)?;
        let r = if writable {
            self.vq.add_in(&[seg], slot)
        } else {
            self.vq.add_out(&[seg], slot)
        };
        if r.is_err() {
            // Not queued: the slot stays the caller's.
            self.pool
                .transition(slot, SlotState::Posted, SlotState::Owned)?;
        }
        r
    }

    /// Adds the first `len` bytes of owned `slot` as a device-readable chain (a message
    /// to send). Visible to the device after [`MsgQueue::publish`].
    pub fn send(&mut self, slot: u16, len: usize) -> Result<(), VirtqError> {
        self.add(slot, len, false)
    }

    /// Adds the whole of owned `slot` as a device-writable chain (a receive buffer).
    pub fn post(&mut self, slot: u16) -> Result<(), VirtqError> {
        self.add(slot, self.pool.slot_len, true)
    }

    /// Posts free slots as receive buffers until the pool or the queue runs out;
    /// returns how many.
    pub fn post_all(&mut self) -> Result<u16, VirtqError> {
        let mut n = 0;
        while self.vq.num_free() > 0 {
            let Some(s) = self.pool.alloc() else { break };
            self.post(s)?;
            n += 1;
        }
        Ok(n)
    }

    /// See [`Virtq::publish`].
    pub fn publish(&mut self) -> bool {
        self.vq.publish()
    }

    /// See [`Virtq::kick`].
    pub fn kick<N: Notify + ?Sized>(&mut self, n: &N) -> bool {
        self.vq.kick(n)
    }

    /// The next finished message: `token` is its slot, owned by the caller again (read
    /// it, then [`MsgQueue::post`] or [`MsgQueue::free`] it); `len` the bytes the device
    /// wrote (rx).
    pub fn pop_used(&mut self) -> Result<Option<Used>, VirtqError> {
        let Some(u) = self.vq.pop_used()? else {
            return Ok(None);
        };
        self.pool
            .transition(u.token, SlotState::Posted, SlotState::Owned)?;
        Ok(Some(u))
    }

    /// See [`Virtq::has_used`].
    pub fn has_used(&self) -> bool {
        self.vq.has_used()
    }

    /// See [`Virtq::enable_notifications`].
    pub fn enable_notifications(&mut self) -> bool {
        self.vq.enable_notifications()
    }

    /// See [`Virtq::disable_notifications`].
    pub fn disable_notifications(&mut self) {
        self.vq.disable_notifications()
    }

    /// Resets the queue after a device reset (see [`Virtq::reset`]): every posted slot
    /// becomes free; owned slots stay the caller's.
    pub fn reset(&mut self) {
        self.vq.reset();
        for (i, s) in self.pool.state.iter_mut().enumerate() {
            if *s == SlotState::Posted {
                *s = SlotState::Free;
                self.pool.free.push(i as u16);
            }
        }
    }
}

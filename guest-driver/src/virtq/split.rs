//! The driver side of a split virtqueue (virtio 1.x, section 2.7).

use core::sync::atomic::{AtomicU16, Ordering, fence};

use super::VirtqError;
use super::dma::{DmaMemory, DmaRegion};
use super::features;

/// Largest queue size this driver sets up.
pub const MAX_QUEUE_SIZE: u16 = 1024;

/// Descriptor flag: the chain continues in `next`.
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: device-writable buffer.
pub const VIRTQ_DESC_F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is a table of descriptors.
pub const VIRTQ_DESC_F_INDIRECT: u16 = 4;
/// Available-ring flag: the driver wants no used-buffer notifications (no EVENT_IDX).
pub const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// Used-ring flag: the device wants no available-buffer notifications (no EVENT_IDX).
pub const VIRTQ_USED_F_NO_NOTIFY: u16 = 1;

const DESC_LEN: usize = 16;
/// Alignment of the ring memory (one page: also what legacy devices would need).
const RING_ALIGN: usize = 4096;

/// One buffer of a descriptor chain: `len` bytes at device address `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Device address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u32,
}

impl Segment {
    /// A segment of `len` bytes at `addr`.
    pub fn new(addr: u64, len: u32) -> Segment {
        Segment { addr, len }
    }
}

/// A chain the device has finished with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// The token given when the chain was added.
    pub token: u16,
    /// Bytes the device wrote into the chain's device-writable buffers (clamped to their
    /// total length; 0 for an out-chain).
    pub len: u32,
}

/// Kicks a queue: tells the device that queue `queue` has new available buffers.
pub trait Notify {
    /// Notifies the device about queue `queue`.
    fn notify(&self, queue: u16);
}

impl<T: Notify + ?Sized> Notify for &T {
    fn notify(&self, queue: u16) {
        (**self).notify(queue)
    }
}

/// How to set up a [`Virtq`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtqConfig {
    /// The queue's index at the device (what a notification names).
    pub queue_index: u16,
    /// Number of descriptors: a power of two, 1 ..= [`MAX_QUEUE_SIZE`].
    pub size: u16,
    /// `VIRTIO_RING_F_EVENT_IDX` was negotiated.
    pub event_idx: bool,
    /// With `VIRTIO_RING_F_INDIRECT_DESC` negotiated: the longest chain put into an
    /// indirect table (each chain of 2 ..= `max_indirect` buffers then takes one ring
    /// descriptor). 0 (or 1): no indirect descriptors. At most `size`.
    pub max_indirect: u16,
}

impl VirtqConfig {
    /// Indirect table length [`VirtqConfig::with_features`] picks.
    pub const DEFAULT_MAX_INDIRECT: u16 = 8;

    /// Queue `queue_index` of `size` descriptors, no EVENT_IDX, no indirect descriptors.
    pub fn new(queue_index: u16, size: u16) -> VirtqConfig {
        VirtqConfig {
            queue_index,
            size,
            event_idx: false,
            max_indirect: 0,
        }
    }

    /// Uses what the negotiated `features` allow: EVENT_IDX, and indirect tables of up
    /// to [`Self::DEFAULT_MAX_INDIRECT`] (at most `size`) buffers.
    pub fn with_features(self, features: u64) -> VirtqConfig {
        VirtqConfig {
            event_idx: features & features::EVENT_IDX != 0,
            max_indirect: if features & features::INDIRECT_DESC != 0 && self.size >= 2 {
                Self::DEFAULT_MAX_INDIRECT.min(self.size)
            } else {
                0
            },
            ..self
        }
    }

    /// Sets whether EVENT_IDX is used.
    pub fn with_event_idx(self, on: bool) -> VirtqConfig {
        VirtqConfig {
            event_idx: on,
            ..self
        }
    }

    /// Sets the longest indirect chain (0: none).
    pub fn with_indirect(self, max_indirect: u16) -> VirtqConfig {
        VirtqConfig {
            max_indirect,
            ..self
        }
    }
}

/// Counters of a [`Virtq`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VirtqStats {
    /// Chains added.
    pub added: u64,
    /// `publish` calls that made chains available.
    pub published: u64,
    /// Publishes after which the device wanted a notification.
    pub notify: u64,
    /// Publishes after which the device did not want one.
    pub notify_suppressed: u64,
    /// Chains returned by `pop_used`.
    pub used: u64,
    /// Used elements whose length exceeded the chain's writable bytes.
    pub len_clamped: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Head {
    token: u16,
    /// Ring descriptors the chain holds (1 for an indirect chain).
    ndesc: u16,
    /// Total bytes of its device-writable buffers.
    in_cap: u32,
    busy: bool,
}

/// need_event of the virtio spec: whether moving an index from `old` to `new` passes
/// `event` (all wrapping).
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// The driver side of a split virtqueue.
///
/// Rings live in one [`DmaRegion`]: the descriptor table, the available ring (driver
/// area) and the used ring (device area), at [`Virtq::desc_table_addr`],
/// [`Virtq::avail_ring_addr`] and [`Virtq::used_ring_addr`]. Free descriptors are kept
/// in a shadow list that never trusts device-writable memory.
///
/// Usage: add chains ([`Virtq::add_out`], [`Virtq::add_in`], [`Virtq::add_chain`]),
/// make them available with one [`Virtq::publish`] (which says whether the device wants a
/// notification; [`Virtq::kick`] also sends it), take finished chains with
/// [`Virtq::pop_used`]. Before waiting for a used-buffer notification, call
/// [`Virtq::enable_notifications`] and keep polling while it returns `true`.
///
/// Nothing allocates after [`Virtq::new`].
#[derive(Debug)]
pub struct Virtq {
    ring: DmaRegion,
    indirect: Option<DmaRegion>,
    queue_index: u16,
    size: u16,
    event_idx: bool,
    max_indirect: u16,
    avail_off: usize,
    used_off: usize,
    free_head: u16,
    num_free: u16,
    in_flight: u16,
    next: Box<[u16]>,
    heads: Box<[Head]>,
    /// Next available index to fill.
    avail_shadow: u16,
    /// Available index the device has seen (last published).
    avail_published: u16,
    last_used: u16,
    notify_on_used: bool,
    broken: bool,
    stats: VirtqStats,
}

/// Writes one descriptor at `p`.
///
/// # Safety
///
/// `p` must be valid for writes of 16 bytes and 8-byte aligned.
unsafe fn write_desc(p: *mut u8, addr: u64, len: u32, flags: u16, next: u16) {
    // SAFETY: the caller guarantees 16 writable, 8-aligned bytes; the fields sit at
    // offsets 0 (u64), 8 (u32), 12 (u16) and 14 (u16), each naturally aligned.
    unsafe {
        p.cast::<u64>().write_volatile(addr.to_le());
        p.add(8).cast::<u32>().write_volatile(len.to_le());
        p.add(12).cast::<u16>().write_volatile(flags.to_le());
        p.add(14).cast::<u16>().write_volatile(next.to_le());
    }
}

impl Virtq {
    /// Allocates and zeroes the rings (and indirect tables) from `mem` and sets up an
    /// empty queue.
    pub fn new<D: DmaMemory + ?Sized>(mem: &D, cfg: VirtqConfig) -> Result<Virtq, VirtqError> {
        let size = cfg.size;
        if size == 0 || size > MAX_QUEUE_SIZE || !size.is_power_of_two() {
            return Err(VirtqError::BadSize(size));
        }
        if cfg.max_indirect > size {
            return Err(VirtqError::BadIndirect {
                max_indirect: cfg.max_indirect,
                size,
            });
        }
        // A one-buffer "indirect chain" is never made: 1 means none.
        let max_indirect = if cfg.max_indirect < 2 {
            0
        } else {
            cfg.max_indirect
        };
        let n = usize::from(size);
        let avail_off = DESC_LEN * n;
        let avail_len = 6 + 2 * n;
        let used_off = (avail_off + avail_len).next_multiple_of(64);
        let used_len = 6 + 8 * n;
        let ring = mem.alloc(used_off + used_len, RING_ALIGN)?;
        let indirect = if max_indirect > 0 {
            Some(mem.alloc(n * usize::from(max_indirect) * DESC_LEN, 64)?)
        } else {
            None
        };
        if ring.dev_addr() % RING_ALIGN as u64 != 0 || (ring.as_ptr() as usize) % RING_ALIGN != 0 {
            return Err(VirtqError::Misaligned);
        }
        let mut q = Virtq {
            ring,
            indirect,
            queue_index: cfg.queue_index,
            size,
            event_idx: cfg.event_idx,
            max_indirect,
            avail_off,
            used_off,
            free_head: 0,
            num_free: 0,
            in_flight: 0,
            next: vec![0u16; n].into_boxed_slice(),
            heads: vec![Head::default(); n].into_boxed_slice(),
            avail_shadow: 0,
            avail_published: 0,
            last_used: 0,
            notify_on_used: true,
            broken: false,
            stats: VirtqStats::default(),
        };
        q.reset();
        Ok(q)
    }

    /// Forgets every chain and zeroes the rings, as after a device reset. Only while
    /// the device does not use the queue (before it is enabled again).
    pub fn reset(&mut self) {
        let len = self.ring.len();
        // SAFETY: the ring region is valid for `len` bytes of writes and the device does
        // not use the queue (caller's contract, stated in the doc).
        unsafe { core::ptr::write_bytes(self.ring.as_ptr(), 0, len) };
        for (i, n) in self.next.iter_mut().enumerate() {
            *n = (i as u16).wrapping_add(1) & (self.size - 1);
        }
        self.heads.fill(Head::default());
        self.free_head = 0;
        self.num_free = self.size;
        self.in_flight = 0;
        self.avail_shadow = 0;
        self.avail_published = 0;
        self.last_used = 0;
        self.notify_on_used = true;
        self.broken = false;
    }

    /// The queue's index at the device.
    pub fn queue_index(&self) -> u16 {
        self.queue_index
    }

    /// Number of descriptors (the queue size to give the device).
    pub fn size(&self) -> u16 {
        self.size
    }

    /// Whether EVENT_IDX is used.
    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    /// Longest chain put into an indirect table (0: no indirect descriptors).
    pub fn max_indirect(&self) -> u16 {
        self.max_indirect
    }

    /// Device address of the descriptor table (`queue_desc`).
    pub fn desc_table_addr(&self) -> u64 {
        self.ring.dev_addr()
    }

    /// Device address of the available ring (driver area, `queue_driver`).
    pub fn avail_ring_addr(&self) -> u64 {
        self.ring.dev_addr() + self.avail_off as u64
    }

    /// Device address of the used ring (device area, `queue_device`).
    pub fn used_ring_addr(&self) -> u64 {
        self.ring.dev_addr() + self.used_off as u64
    }

    /// Free descriptors.
    pub fn num_free(&self) -> u16 {
        self.num_free
    }

    /// Chains added and not yet returned by [`Virtq::pop_used`] (published or not).
    pub fn in_flight(&self) -> u16 {
        self.in_flight
    }

    /// Chains added since the last [`Virtq::publish`].
    pub fn unpublished(&self) -> u16 {
        self.avail_shadow.wrapping_sub(self.avail_published)
    }

    /// The available index the device has been shown (last published).
    pub fn avail_idx(&self) -> u16 {
        self.avail_published
    }

    /// The used index up to which the driver has taken chains.
    pub fn last_used_idx(&self) -> u16 {
        self.last_used
    }

    /// Whether the device broke the protocol (a bad used element); the queue then
    /// refuses work until [`Virtq::reset`].
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Counters.
    pub fn stats(&self) -> VirtqStats {
        self.stats
    }

    /// The ring field (u16) at byte `off` of the ring region, as an atomic.
    fn field(&self, off: usize) -> &AtomicU16 {
        debug_assert!(off + 2 <= self.ring.len() && off % 2 == 0);
        // SAFETY: every caller passes an even offset inside the ring region (fixed
        // layout computed in `new`); the region is page-aligned, so the pointer is
        // 2-aligned; the memory lives as long as `self.ring` and therefore as `&self`.
        // The device accesses these fields with atomic (or naturally aligned single-copy
        // atomic) loads and stores, as virtio requires.
        unsafe { AtomicU16::from_ptr(self.ring.as_ptr().add(off).cast::<u16>()) }
    }

    fn avail_flags(&self) -> &AtomicU16 {
        self.field(self.avail_off)
    }

    fn avail_idx_field(&self) -> &AtomicU16 {
        self.field(self.avail_off + 2)
    }

    fn avail_entry(&self, i: u16) -> &AtomicU16 {
        self.field(self.avail_off + 4 + 2 * usize::from(i & (self.size - 1)))
    }

    fn used_event(&self) -> &AtomicU16 {
        self.field(self.avail_off + 4 + 2 * usize::from(self.size))
    }

    fn used_flags(&self) -> &AtomicU16 {
        self.field(self.used_off)
    }

    fn used_idx_field(&self) -> &AtomicU16 {
        self.field(self.used_off + 2)
    }

    fn avail_event(&self) -> &AtomicU16 {
        self.field(self.used_off + 4 + 8 * usize::from(self.size))
    }

    /// Adds a chain of device-readable buffers (a message to send).
    pub fn add_out(&mut self, out: &[Segment], token: u16) -> Result<(), VirtqError> {
        self.add_chain(out, &[], token)
    }

    /// Adds a chain of device-writable buffers (a buffer to receive into).
    pub fn add_in(&mut self, inp: &[Segment], token: u16) -> Result<(), VirtqError> {
        self.add_chain(&[], inp, token)
    }

    /// Adds a chain: the device-readable buffers `out`, then the device-writable `inp`.
    /// `token` comes back from [`Virtq::pop_used`]. The chain becomes visible to the
    /// device at the next [`Virtq::publish`].
    ///
    /// Chains of 2 ..= `max_indirect` buffers take one descriptor (an indirect table);
    /// others take one descriptor per buffer. Errors: [`VirtqError::Full`] when not
    /// enough descriptors are free (pop used chains first), [`VirtqError::EmptyChain`],
    /// [`VirtqError::ChainTooLong`] (more buffers than the queue size, or more than 4 GiB).
    pub fn add_chain(
        &mut self,
        out: &[Segment],
        inp: &[Segment],
        token: u16,
    ) -> Result<(), VirtqError> {
        if self.broken {
            return Err(VirtqError::Broken);
        }
        let n = out.len() + inp.len();
        if n == 0 {
            return Err(VirtqError::EmptyChain);
        }
        if n > usize::from(self.size) {
            return Err(VirtqError::ChainTooLong { buffers: n });
        }
        let mut total = 0u32;
        let mut in_cap = 0u32;
        for s in out {
            total = total
                .checked_add(s.len)
                .ok_or(VirtqError::ChainTooLong { buffers: n })?;
        }
        for s in inp {
            total = total
                .checked_add(s.len)
                .ok_or(VirtqError::ChainTooLong { buffers: n })?;
            in_cap += s.len;
        }
        // (host pointer, device address) of the indirect table space, if this chain
        // goes indirect.
        let table = match &self.indirect {
            Some(t) if n > 1 && n <= usize::from(self.max_indirect) => {
                Some((t.as_ptr(), t.dev_addr()))
            }
            _ => None,
        };
        let need = if table.is_some() { 1 } else { n as u16 };
        if need > self.num_free {
            return Err(VirtqError::Full);
        }
        let segs = out
            .iter()
            .map(|s| (s, 0))
            .chain(inp.iter().map(|s| (s, VIRTQ_DESC_F_WRITE)));
        let head = self.free_head;
        if let Some((table_ptr, table_dev)) = table {
            let table_off = usize::from(head) * usize::from(self.max_indirect) * DESC_LEN;
            for (i, (s, w)) in segs.enumerate() {
                let last = i + 1 == n;
                let flags = w | if last { 0 } else { VIRTQ_DESC_F_NEXT };
                let next = if last { 0 } else { i as u16 + 1 };
                // SAFETY: head < size and i < n <= max_indirect, so the 16 bytes lie
                // inside the indirect region (size * max_indirect * 16 bytes, 64-aligned);
                // the table of a free head is not in use by the device.
                unsafe {
                    write_desc(
                        table_ptr.add(table_off + i * DESC_LEN),
                        s.addr,
                        s.len,
                        flags,
                        next,
                    )
                };
            }
            let table_addr = table_dev + table_off as u64;
            // SAFETY: head < size: inside the descriptor table at the ring's start
            // (16-aligned); a free descriptor is not in use by the device.
            unsafe {
                write_desc(
                    self.ring.as_ptr().add(usize::from(head) * DESC_LEN),
                    table_addr,
                    (n * DESC_LEN) as u32,
                    VIRTQ_DESC_F_INDIRECT,
                    0,
                )
            };
            self.free_head = self.next[usize::from(head)];
        } else {
            let mut idx = head;
            for (i, (s, w)) in segs.enumerate() {
                let last = i + 1 == n;
                let nx = self.next[usize::from(idx)];
                let flags = w | if last { 0 } else { VIRTQ_DESC_F_NEXT };
                // SAFETY: idx < size (free-list entries are masked to the size): inside
                // the descriptor table; free descriptors are not in use by the device.
                unsafe {
                    write_desc(
                        self.ring.as_ptr().add(usize::from(idx) * DESC_LEN),
                        s.addr,
                        s.len,
                        flags,
                        nx,
                    )
                };
                idx = nx;
            }
            // `idx` is now the descriptor after the chain's tail: the new free head.
            self.free_head = idx;
        }
        self.num_free -= need;
        self.in_flight += 1;
        self.heads[usize::from(head)] = Head {
            token,
            ndesc: need,
            in_cap,
            busy: true,
        };
        self.avail_entry(self.avail_shadow)
            .store(head.to_le(), Ordering::Relaxed);
        self.avail_shadow = self.avail_shadow.wrapping_add(1);
        self.stats.added += 1;
        Ok(())
    }

    /// Makes every chain added since the last publish available to the device with one
    /// store of the available index, and returns whether the device wants to be
    /// notified (EVENT_IDX: `avail_event` was passed; otherwise: the used ring's
    /// NO_NOTIFY flag is clear). `false` if nothing was added.
    pub fn publish(&mut self) -> bool {
        let new = self.avail_shadow;
        let old = self.avail_published;
        if new == old || self.broken {
            return false;
        }
        // Release: descriptors and ring entries written before are visible to a device
        // that reads the index with Acquire.
        self.avail_idx_field().store(new.to_le(), Ordering::Release);
        self.avail_published = new;
        // The index store must be visible before we read the device's suppression state
        // (store -> load), or a device going to sleep could miss the batch.
        fence(Ordering::SeqCst);
        let kick = if self.event_idx {
            let event = u16::from_le(self.avail_event().load(Ordering::Relaxed));
            need_event(event, new, old)
        } else {
            u16::from_le(self.used_flags().load(Ordering::Relaxed)) & VIRTQ_USED_F_NO_NOTIFY == 0
        };
        self.stats.published += 1;
        if kick {
            self.stats.notify += 1;
        } else {
            self.stats.notify_suppressed += 1;
        }
        kick
    }

    /// [`Virtq::publish`], then notifies through `n` if the device wants it. Returns
    /// whether it notified.
    pub fn kick<N: Notify + ?Sized>(&mut self, n: &N) -> bool {
        let k = self.publish();
        if k {
            n.notify(self.queue_index);
        }
        k
    }

    /// Whether the device has returned chains not yet taken by [`Virtq::pop_used`].
    pub fn has_used(&self) -> bool {
        u16::from_le(self.used_idx_field().load(Ordering::Acquire)) != self.last_used
    }

    /// Takes the next chain the device has finished with: its token and the bytes it
    /// wrote. `Ok(None)` when there is none. A used element naming a descriptor that is
    /// not the head of an outstanding chain breaks the queue ([`VirtqError::BadUsed`]).
    pub fn pop_used(&mut self) -> Result<Option<Used>, VirtqError> {
        if self.broken {
            return Err(VirtqError::Broken);
        }
        // Acquire: the used element and the buffers' contents written by the device
        // before it published the index are visible below.
        let used_idx = u16::from_le(self.used_idx_field().load(Ordering::Acquire));
        if used_idx == self.last_used {
            return Ok(None);
        }
        if used_idx.wrapping_sub(self.last_used) > self.in_flight {
            self.broken = true;
            return Err(VirtqError::UsedIdxRunaway {
                used_idx,
                last_used: self.last_used,
                in_flight: self.in_flight,
            });
        }
        let off = self.used_off + 4 + 8 * usize::from(self.last_used & (self.size - 1));
        // SAFETY: the element lies inside the used ring (index masked to the size) at a
        // 4-aligned offset (used_off is 64-aligned); the device wrote it before the
        // index we loaded with Acquire and will not touch it until we return the slot.
        let (id, len) = unsafe {
            let p = self.ring.as_ptr().add(off);
            (
                u32::from_le(p.cast::<u32>().read_volatile()),
                u32::from_le(p.add(4).cast::<u32>().read_volatile()),
            )
        };
        let head = match u16::try_from(id) {
            Ok(h) if h < self.size && self.heads[usize::from(h)].busy => h,
            _ => {
                self.broken = true;
                return Err(VirtqError::BadUsed { id });
            }
        };
        self.last_used = self.last_used.wrapping_add(1);
        let h = self.heads[usize::from(head)];
        self.free_chain(head, h.ndesc);
        self.in_flight -= 1;
        self.stats.used += 1;
        if self.event_idx {
            if self.notify_on_used {
                // Ask for a notification when the next element arrives; the fence
                // orders this store before the next read of the used index.
                self.used_event()
                    .store(self.last_used.to_le(), Ordering::Relaxed);
                fence(Ordering::SeqCst);
            } else {
                // Keep the event index far away so a disabled queue gets no
                // notifications at all.
                self.used_event().store(
                    self.last_used.wrapping_add(0x8000).to_le(),
                    Ordering::Relaxed,
                );
            }
        }
        let len = if len > h.in_cap {
            self.stats.len_clamped += 1;
            h.in_cap
        } else {
            len
        };
        Ok(Some(Used {
            token: h.token,
            len,
        }))
    }

    fn free_chain(&mut self, head: u16, ndesc: u16) {
        self.heads[usize::from(head)].busy = false;
        let mut tail = head;
        for _ in 1..ndesc {
            tail = self.next[usize::from(tail)];
        }
        self.next[usize::from(tail)] = self.free_head;
        self.free_head = head;
        self.num_free += ndesc;
    }

    /// Asks the device for used-buffer notifications again (EVENT_IDX: writes
    /// `used_event` = the next used index; otherwise clears NO_INTERRUPT) and returns
    /// whether used chains arrived meanwhile. When it returns `true`, pop them before
    /// waiting, or a notification may never come.
    pub fn enable_notifications(&mut self) -> bool {
        self.notify_on_used = true;
        if self.event_idx {
            self.used_event()
                .store(self.last_used.to_le(), Ordering::Relaxed);
        } else {
            self.avail_flags().store(0, Ordering::Relaxed);
        }
        // Store -> load: the device must see the re-armed event before we check.
        fence(Ordering::SeqCst);
        self.has_used()
    }

    /// Asks the device not to send used-buffer notifications (for polling). A hint:
    /// without EVENT_IDX a device may still send some.
    pub fn disable_notifications(&mut self) {
        self.notify_on_used = false;
        if self.event_idx {
            self.used_event().store(
                self.last_used.wrapping_add(0x8000).to_le(),
                Ordering::Relaxed,
            );
        } else {
            self.avail_flags()
                .store(VIRTQ_AVAIL_F_NO_INTERRUPT.to_le(), Ordering::Relaxed);
        }
    }

    /// Whether used-buffer notifications are enabled.
    pub fn notifications_enabled(&self) -> bool {
        self.notify_on_used
    }

    /// Bytes of DMA memory the rings of a `size` queue take, without alignment padding
    /// and indirect tables (for sizing an allocator).
    pub fn ring_bytes(size: u16) -> usize {
        let n = usize::from(size);
        (DESC_LEN * n + 6 + 2 * n).next_multiple_of(64) + 6 + 8 * n
    }
}

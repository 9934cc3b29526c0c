//! DMA memory: regions the driver and the device both reach, each with a host pointer
//! (for the driver) and a device address (what goes into descriptors and queue
//! registers).

use core::fmt;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering};
use std::any::Any;
use std::sync::Arc;

/// Something that keeps the memory behind a [`DmaRegion`] mapped (a mapping, a guest
/// memory object). Held by the region; dropped with the last region that uses it.
pub type Keepalive = Arc<dyn Any + Send + Sync>;

/// Errors of DMA allocation.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// Not enough memory left in the allocator.
    #[error("DMA memory exhausted: {want} bytes wanted, {left} left")]
    Exhausted {
        /// Bytes asked for.
        want: usize,
        /// Bytes left (ignoring alignment).
        left: usize,
    },
    /// The allocation is larger than one physically contiguous chunk of the allocator.
    #[error("DMA allocation of {want} bytes exceeds the contiguous chunk of {chunk} bytes")]
    TooLarge {
        /// Bytes asked for.
        want: usize,
        /// Largest contiguous chunk.
        chunk: usize,
    },
    /// Alignment that is zero or not a power of two.
    #[error("bad DMA alignment {0}")]
    BadAlign(usize),
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The memory cannot be used for DMA (wrong file system, no physical address, ...).
    #[error("{0}")]
    Unusable(String),
}

/// Allocates zeroed memory a device can access.
///
/// Allocations live as long as the returned [`DmaRegion`]s; allocators are free to never
/// reuse memory (queues are set up once).
pub trait DmaMemory {
    /// A zeroed region of `len` bytes whose host pointer and device address are both
    /// aligned to `align` (a power of two).
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError>;
}

impl<T: DmaMemory + ?Sized> DmaMemory for &T {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        (**self).alloc(len, align)
    }
}

impl<T: DmaMemory + ?Sized> DmaMemory for Arc<T> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        (**self).alloc(len, align)
    }
}

/// A region of DMA memory: `len` bytes at host pointer `host`, seen by the device at
/// `dev_addr`.
///
/// The driver accesses a region only while the device does not own that part of it (the
/// virtio ownership rules); ring fields shared at all times are accessed atomically by
/// the queue.
pub struct DmaRegion {
    host: NonNull<u8>,
    dev_addr: u64,
    len: usize,
    _keep: Option<Keepalive>,
}

// SAFETY: a region is a pointer into memory that stays mapped as long as the region
// (or its keepalive) lives; nothing about it is tied to the thread that created it.
unsafe impl Send for DmaRegion {}
// SAFETY: `&DmaRegion` only allows reads through the pointer (`read_at`) and the
// address getters; writes need `&mut`. Concurrent reads are fine.
unsafe impl Sync for DmaRegion {}

impl fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaRegion")
            .field("host", &self.host)
            .field("dev_addr", &format_args!("{:#x}", self.dev_addr))
            .field("len", &self.len)
            .finish()
    }
}

impl DmaRegion {
    /// Makes a region from its parts.
    ///
    /// # Safety
    ///
    /// `host` must be valid for reads and writes of `len` bytes for as long as the
    /// region lives (`keep`, if given, is what keeps it mapped), must not overlap any
    /// other live `DmaRegion` or Rust object, and the device must see the same bytes at
    /// `dev_addr .. dev_addr + len`.
    pub unsafe fn from_raw_parts(
        host: NonNull<u8>,
        dev_addr: u64,
        len: usize,
        keep: Option<Keepalive>,
    ) -> DmaRegion {
        DmaRegion {
            host,
            dev_addr,
            len,
            _keep: keep,
        }
    }

    /// Host pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.host.as_ptr()
    }

    /// Device address of the first byte.
    pub fn dev_addr(&self) -> u64 {
        self.dev_addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, n: usize) -> Option<()> {
        (offset.checked_add(n)? <= self.len).then_some(())
    }

    /// Copies `buf.len()` bytes at `offset` out of the region; `None` if out of bounds.
    pub fn read_at(&self, offset: usize, buf: &mut [u8]) -> Option<()> {
        self.check(offset, buf.len())?;
        // SAFETY: in bounds (checked); the region is valid for reads (constructor
        // contract) and `buf` is a distinct Rust object.
        unsafe {
            core::ptr::copy_nonoverlapping(self.as_ptr().add(offset), buf.as_mut_ptr(), buf.len())
        };
        Some(())
    }

    /// Copies `buf` into the region at `offset`; `None` if out of bounds.
    pub fn write_at(&mut self, offset: usize, buf: &[u8]) -> Option<()> {
        self.check(offset, buf.len())?;
        // SAFETY: in bounds (checked); the region is valid for writes and we hold it
        // exclusively; `buf` is a distinct Rust object.
        unsafe {
            core::ptr::copy_nonoverlapping(buf.as_ptr(), self.as_ptr().add(offset), buf.len())
        };
        Some(())
    }
}

/// A bump allocator over one linear mapping: host `host .. host + len` is device
/// `dev_base .. dev_base + len`. Memory is never reused.
///
/// Fits guest memory in the lab (memfd-backed, device address = guest physical
/// address) and tests (a `vm_memory::GuestMemoryMmap` region).
pub struct LinearDma {
    host: NonNull<u8>,
    dev_base: u64,
    len: usize,
    next: AtomicUsize,
    keep: Option<Keepalive>,
}

// SAFETY: the allocator hands out disjoint regions of a mapping that lives as long as
// the keepalive; the bump offset is atomic.
unsafe impl Send for LinearDma {}
// SAFETY: as above; `alloc(&self)` only updates the atomic bump offset.
unsafe impl Sync for LinearDma {}

impl fmt::Debug for LinearDma {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LinearDma")
            .field("host", &self.host)
            .field("dev_base", &format_args!("{:#x}", self.dev_base))
            .field("len", &self.len)
            .field("used", &self.next.load(Ordering::Relaxed))
            .finish()
    }
}

impl LinearDma {
    /// An allocator over `len` bytes at `host`, device address `dev_base`.
    ///
    /// Alignment of allocations holds for both addresses only if `host` and `dev_base`
    /// are equally aligned (page-aligned both is the usual case).
    ///
    /// # Safety
    ///
    /// `host .. host + len` must be valid for reads and writes as long as the allocator
    /// and every region it hands out live (`keep` may hold what keeps it mapped), must
    /// be used by nothing else on the driver side, and the device must see it at
    /// `dev_base`.
    pub unsafe fn new(
        host: NonNull<u8>,
        dev_base: u64,
        len: usize,
        keep: Option<Keepalive>,
    ) -> LinearDma {
        LinearDma {
            host,
            dev_base,
            len,
            next: AtomicUsize::new(0),
            keep,
        }
    }

    /// Bytes handed out so far (including alignment padding).
    pub fn used(&self) -> usize {
        self.next.load(Ordering::Relaxed)
    }
}

/// Rounds `v` up to a multiple of `align` (a power of two); `None` on overflow.
pub(crate) fn align_up(v: u64, align: u64) -> Option<u64> {
    Some(v.checked_add(align - 1)? & !(align - 1))
}

impl DmaMemory for LinearDma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if align == 0 || !align.is_power_of_two() {
            return Err(DmaError::BadAlign(align));
        }
        let exhausted = |at: usize| DmaError::Exhausted {
            want: len,
            left: self.len.saturating_sub(at),
        };
        let mut start = 0usize;
        self.next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
                let dev = align_up(self.dev_base.checked_add(at as u64)?, align as u64)?;
                let s = usize::try_from(dev - self.dev_base).ok()?;
                let end = s.checked_add(len)?;
                (end <= self.len).then(|| {
                    start = s;
                    end
                })
            })
            .map_err(exhausted)?;
        // SAFETY: `start + len <= self.len`, so the pointer stays inside the mapping.
        let host = unsafe { self.host.add(start) };
        if (host.as_ptr() as usize) & (align - 1) != 0 {
            return Err(DmaError::Unusable(format!(
                "host mapping and device base are aligned differently (align {align})"
            )));
        }
        // SAFETY: the range is inside the mapping (valid per `new`'s contract), and the
        // bump offset never hands out a byte twice; zeroing makes it ready for use.
        unsafe { core::ptr::write_bytes(host.as_ptr(), 0, len) };
        // SAFETY: as above; the keepalive keeps the mapping.
        Ok(unsafe {
            DmaRegion::from_raw_parts(host, self.dev_base + start as u64, len, self.keep.clone())
        })
    }
}

//! The dirty-page log the device keeps for the VMM during a live migration
//! (`VHOST_F_LOG_ALL`, `VHOST_USER_SET_LOG_BASE`): every page of guest memory the device
//! writes is marked in the log QEMU shares, so QEMU copies it again.
//!
//! vhost-user-backend's own `BitmapMmapRegion` does this, but every guest-memory access
//! (reads too) clones an `Arc` and takes a lock for its bitmap slice: 15% of the
//! device's message rate in the `rate` lab. Here a slice borrows its region's bitmap
//! (vm-memory's `RefSlice`), and a write costs one relaxed load until a log is set.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use vhost_user_backend::bitmap::{AtomicBitmapMmap, BitmapReplace, MemRegionBitmap, MmapLogReg};
use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};
use vm_memory::mmap::NewBitmap;
use vm_memory::{Address, GuestMemoryRegion};

/// vhost-user's log page (`VHOST_LOG_PAGE`).
const LOG_PAGE: usize = 0x1000;

/// One memory region's dirty log: empty until the VMM sets a log base.
#[derive(Debug, Default, Clone)]
pub struct DirtyLog {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// A log is set: writes must be marked.
    on: AtomicBool,
    log: RwLock<Option<RegionLog>>,
}

/// The part of the VMM's log that covers one region.
#[derive(Debug)]
pub struct RegionLog {
    logmem: Arc<MmapLogReg>,
    /// Pages of guest-physical memory before the region.
    first_page: usize,
    /// Pages the region spans.
    pages: usize,
}

impl MemRegionBitmap for RegionLog {
    fn new<R: GuestMemoryRegion>(region: &R, logmem: Arc<MmapLogReg>) -> io::Result<Self> {
        // vhost-user-backend's own check that the log covers the whole region (so every
        // index below is inside the mapping).
        AtomicBitmapMmap::new(region, logmem.clone())?;
        let start = usize::try_from(region.start_addr().raw_value())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        let len = usize::try_from(region.len())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
        Ok(RegionLog {
            logmem,
            first_page: start / LOG_PAGE,
            pages: len / LOG_PAGE,
        })
    }
}

impl RegionLog {
    fn mark(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset / LOG_PAGE;
        let last = offset.saturating_add(len - 1) / LOG_PAGE;
        for page in first..=last.min(self.pages.saturating_sub(1)) {
            let p = self.first_page + page;
            self.logmem[p / 8].fetch_or(1 << (p % 8), Ordering::Relaxed);
        }
    }

    fn is_set(&self, offset: usize) -> bool {
        let page = offset / LOG_PAGE;
        if page >= self.pages {
            return false;
        }
        let p = self.first_page + page;
        self.logmem[p / 8].load(Ordering::Relaxed) & (1 << (p % 8)) != 0
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if !self.inner.on.load(Ordering::Relaxed) {
            return;
        }
        let log = self.inner.log.read().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = log.as_ref() {
            l.mark(offset, len);
        }
    }

    fn dirty_at(&self, offset: usize) -> bool {
        if !self.inner.on.load(Ordering::Relaxed) {
            return false;
        }
        let log = self.inner.log.read().unwrap_or_else(|p| p.into_inner());
        log.as_ref().is_some_and(|l| l.is_set(offset))
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

impl BitmapReplace for DirtyLog {
    type InnerBitmap = RegionLog;

    fn replace(&self, log: RegionLog) {
        *self.inner.log.write().unwrap_or_else(|p| p.into_inner()) = Some(log);
        self.inner.on.store(true, Ordering::Release);
    }
}

impl NewBitmap for DirtyLog {
    fn with_len(_len: usize) -> Self {
        DirtyLog::default()
    }
}

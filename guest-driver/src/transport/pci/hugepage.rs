//! DMA memory for a user-space driver inside a VM: a file on hugetlbfs, mapped shared,
//! populated and locked, whose physical (guest-physical) addresses come from
//! `/proc/self/pagemap`. Huge pages never move and are physically contiguous, so one
//! translation per huge page holds for the life of the mapping.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::PciError;
use crate::virtq::{DmaError, DmaMemory, DmaRegion, align_up};

/// Pagemap entry bit 63: the page is present in RAM.
pub const PAGEMAP_PRESENT: u64 = 1 << 63;
/// Pagemap entry bit 62: the page is swapped out.
pub const PAGEMAP_SWAPPED: u64 = 1 << 62;
/// Pagemap entry bits 0..=54: the page frame number.
pub const PAGEMAP_PFN_MASK: u64 = (1 << 55) - 1;
/// `statfs` magic of hugetlbfs.
pub const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// Why a pagemap entry gives no physical address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PagemapError {
    /// Bit 63 clear: the page is not in RAM.
    #[error("page not present")]
    NotPresent,
    /// Bit 62 set: the page is swapped out.
    #[error("page swapped out")]
    Swapped,
    /// Present, but the PFN reads as 0: the kernel hides PFNs from processes without
    /// CAP_SYS_ADMIN. Run the driver as root.
    #[error("PFN hidden (reads as 0): /proc/self/pagemap needs CAP_SYS_ADMIN")]
    PfnHidden,
    /// PFN times the page size does not fit 64 bits (a corrupt entry).
    #[error("PFN out of range")]
    PfnOverflow,
}

/// The physical address of `vaddr` from its pagemap entry: PFN (bits 0..=54) times the
/// base page size, plus the offset of `vaddr` in its page.
pub fn pagemap_phys(entry: u64, vaddr: u64, page_size: u64) -> Result<u64, PagemapError> {
    if entry & PAGEMAP_PRESENT == 0 {
        return Err(if entry & PAGEMAP_SWAPPED != 0 {
            PagemapError::Swapped
        } else {
            PagemapError::NotPresent
        });
    }
    let pfn = entry & PAGEMAP_PFN_MASK;
    if pfn == 0 {
        return Err(PagemapError::PfnHidden);
    }
    pfn.checked_mul(page_size)
        .map(|a| a + vaddr % page_size)
        .ok_or(PagemapError::PfnOverflow)
}

/// The base page size.
pub fn page_size() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(v).unwrap_or(4096)
}

/// Reads the pagemap entry of `vaddr` from an open pagemap file.
pub fn pagemap_entry(pagemap: &File, vaddr: u64, page_size: u64) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    pagemap.read_exact_at(&mut b, vaddr / page_size * 8)?;
    Ok(u64::from_le_bytes(b))
}

/// The physical address of `vaddr` in this process (via `/proc/self/pagemap`).
pub fn virt_to_phys(vaddr: usize) -> Result<u64, PciError> {
    let pm = File::open("/proc/self/pagemap").map_err(|source| PciError::Io {
        what: "opening /proc/self/pagemap".into(),
        source,
    })?;
    translate(&pm, vaddr as u64, page_size())
}

fn translate(pm: &File, vaddr: u64, page: u64) -> Result<u64, PciError> {
    let e = pagemap_entry(pm, vaddr, page).map_err(|source| PciError::Io {
        what: format!("reading the pagemap entry of {vaddr:#x}"),
        source,
    })?;
    pagemap_phys(e, vaddr, page).map_err(|error| PciError::Pagemap { vaddr, error })
}

/// A shared file mapping, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is process-wide memory owned by this value; it is only unmapped
// on drop, after every region holding it (as keepalive) is gone.
unsafe impl Send for Mapping {}
// SAFETY: `&Mapping` gives no access to the memory by itself.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `HugeDma::from_file`; the last
        // keepalive is being dropped, so no region points into it any more.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// DMA memory from hugetlbfs (or any file, for tests), device address = physical
/// address. A bump allocator: allocations never cross a chunk (huge page) and are never
/// freed.
#[derive(Debug)]
pub struct HugeDma {
    map: Arc<Mapping>,
    chunk: usize,
    /// Physical address of each chunk.
    phys: Vec<u64>,
    next: AtomicUsize,
}

static FILE_SEQ: AtomicUsize = AtomicUsize::new(0);

impl HugeDma {
    /// Maps `len` bytes (rounded up to huge pages) of a new file in `hugetlbfs_dir` (a
    /// hugetlbfs mount: the huge page size is its block size); the file is unlinked at
    /// once, the mapping stays. Needs free huge pages (`vm.nr_hugepages`) and root (for
    /// the physical addresses and `MAP_LOCKED`).
    pub fn new(hugetlbfs_dir: &Path, len: usize) -> Result<HugeDma, PciError> {
        let c = CString::new(hugetlbfs_dir.as_os_str().as_bytes())
            .map_err(|_| PciError::Parse(format!("path {}", hugetlbfs_dir.display())))?;
        // SAFETY: statfs writes into the zeroed struct we pass; `c` is a valid C string.
        let mut st: libc::statfs = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        let r = unsafe { libc::statfs(c.as_ptr(), &mut st) };
        if r != 0 {
            return Err(PciError::Io {
                what: format!("statfs {}", hugetlbfs_dir.display()),
                source: std::io::Error::last_os_error(),
            });
        }
        #[allow(clippy::unnecessary_cast)]
        let (ftype, bsize) = (st.f_type as u64, st.f_bsize as u64);
        if ftype != HUGETLBFS_MAGIC {
            return Err(PciError::NotHugetlbfs(hugetlbfs_dir.to_path_buf()));
        }
        let chunk =
            usize::try_from(bsize).map_err(|_| PciError::NotHugetlbfs(hugetlbfs_dir.into()))?;
        let name = hugetlbfs_dir.join(format!(
            "pvcm-dma-{}-{}",
            std::process::id(),
            FILE_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&name)
            .map_err(|source| PciError::Io {
                what: format!("creating {}", name.display()),
                source,
            })?;
        let r = Self::from_file(&f, len, chunk);
        let _ = std::fs::remove_file(&name);
        r
    }

    /// Maps `len` bytes (rounded up to `chunk`) of `f` shared, populated and locked, and
    /// translates each `chunk` (a power of two, at least the base page; the huge page
    /// size on hugetlbfs) to its physical address, checking that it is contiguous.
    /// Fails with [`PagemapError::PfnHidden`] without CAP_SYS_ADMIN.
    pub fn from_file(f: &File, len: usize, chunk: usize) -> Result<HugeDma, PciError> {
        let page = page_size();
        if !chunk.is_power_of_two() || (chunk as u64) < page || len == 0 {
            return Err(PciError::Parse(format!(
                "DMA chunk {chunk} for {len} bytes"
            )));
        }
        let len = len.next_multiple_of(chunk);
        let io = |what: &str| {
            let what = what.to_string();
            move |source| PciError::Io { what, source }
        };
        let flen = f.metadata().map_err(io("stat of the DMA file"))?.len();
        if flen < len as u64 {
            f.set_len(len as u64).map_err(io("sizing the DMA file"))?;
        }
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of a file we hold
        // open and that is at least `len` bytes long; no Rust object is affected. The
        // result is checked below.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE | libc::MAP_LOCKED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(PciError::Io {
                what: "mmap of the DMA file (MAP_LOCKED needs RLIMIT_MEMLOCK or root)".into(),
                source: std::io::Error::last_os_error(),
            });
        }
        let ptr =
            NonNull::new(p.cast::<u8>()).ok_or(PciError::Parse("mmap returned NULL".into()))?;
        let map = Arc::new(Mapping { ptr, len });
        let pm = File::open("/proc/self/pagemap").map_err(io("opening /proc/self/pagemap"))?;
        let mut phys = Vec::with_capacity(len / chunk);
        for i in 0..len / chunk {
            let va = ptr.as_ptr() as u64 + (i * chunk) as u64;
            let pa = translate(&pm, va, page)?;
            if chunk as u64 > page {
                let last = translate(&pm, va + chunk as u64 - page, page)?;
                if last != pa + chunk as u64 - page {
                    return Err(PciError::NotContiguous { chunk });
                }
            }
            phys.push(pa);
        }
        Ok(HugeDma {
            map,
            chunk,
            phys,
            next: AtomicUsize::new(0),
        })
    }

    /// The contiguous unit (huge page size).
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Whether nothing is mapped (never: constructors refuse 0).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    /// Physical address of each chunk.
    pub fn chunk_phys(&self) -> &[u64] {
        &self.phys
    }
}

impl DmaMemory for HugeDma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if align == 0 || !align.is_power_of_two() || align > self.chunk {
            return Err(DmaError::BadAlign(align));
        }
        if len > self.chunk {
            return Err(DmaError::TooLarge {
                want: len,
                chunk: self.chunk,
            });
        }
        let total = self.map.len;
        let mut start = 0usize;
        self.next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |at| {
                let mut s = usize::try_from(align_up(at as u64, align as u64)?).ok()?;
                if s / self.chunk != (s + len.max(1) - 1) / self.chunk {
                    s = s.next_multiple_of(self.chunk);
                }
                let end = s.checked_add(len)?;
                (end <= total).then(|| {
                    start = s;
                    end
                })
            })
            .map_err(|at| DmaError::Exhausted {
                want: len,
                left: total.saturating_sub(at),
            })?;
        let dev = self.phys[start / self.chunk] + (start % self.chunk) as u64;
        // SAFETY: `start + len <= total`: inside the mapping.
        let host = unsafe { self.map.ptr.add(start) };
        // SAFETY: the range is inside the live mapping and the bump offset never hands
        // it out twice.
        unsafe { core::ptr::write_bytes(host.as_ptr(), 0, len) };
        // SAFETY: valid for `len` bytes while the mapping lives (the keepalive holds it);
        // disjoint from every other region; the device reaches the same bytes at the
        // physical address `dev` (the chunk is physically contiguous and locked).
        Ok(unsafe { DmaRegion::from_raw_parts(host, dev, len, Some(self.map.clone())) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pagemap_entries_decode() {
        let pfn = 0x12_3456u64;
        let e = PAGEMAP_PRESENT | pfn;
        assert_eq!(
            pagemap_phys(e, 0x7f00_0000_0123, 4096),
            Ok(pfn * 4096 + 0x123)
        );
        // 16 KiB base pages (arm64).
        assert_eq!(
            pagemap_phys(e, 0x7f00_0000_3123, 16384),
            Ok(pfn * 16384 + 0x3123)
        );
        // Flag bits 55..=61 (soft-dirty, exclusive, uffd-wp, file/shared) are not PFN.
        let e2 = e | 1 << 55 | 1 << 56 | 1 << 57 | 1 << 61;
        assert_eq!(pagemap_phys(e2, 0x1000, 4096), Ok(pfn * 4096));
        // A PFN at 4 PiB still fits; the largest PFN does not.
        let e3 = PAGEMAP_PRESENT | 1 << 40;
        assert_eq!(pagemap_phys(e3, 0x10, 4096), Ok((1 << 52) + 0x10));
        let e4 = PAGEMAP_PRESENT | PAGEMAP_PFN_MASK;
        assert_eq!(pagemap_phys(e4, 0, 4096), Err(PagemapError::PfnOverflow));
        assert_eq!(pagemap_phys(pfn, 0, 4096), Err(PagemapError::NotPresent));
        assert_eq!(pagemap_phys(0, 0, 4096), Err(PagemapError::NotPresent));
        assert_eq!(
            pagemap_phys(PAGEMAP_SWAPPED | 0x55, 0, 4096),
            Err(PagemapError::Swapped)
        );
        // Present but PFN 0: what an unprivileged process reads.
        assert_eq!(
            pagemap_phys(PAGEMAP_PRESENT | 1 << 55, 0x42, 4096),
            Err(PagemapError::PfnHidden)
        );
    }

    #[test]
    fn real_pagemap_gives_an_address_or_says_why_not() {
        let v = vec![7u8; 8192];
        let va = v.as_ptr() as usize + 100;
        match virt_to_phys(va) {
            Ok(pa) => assert_eq!(pa % page_size(), va as u64 % page_size()),
            Err(PciError::Pagemap { error, .. }) => assert_eq!(error, PagemapError::PfnHidden),
            Err(e) => panic!("unexpected: {e}"),
        }
    }

    #[test]
    fn new_refuses_a_non_hugetlbfs_directory() {
        let t = tempfile::tempdir().expect("tempdir");
        assert!(matches!(
            HugeDma::new(t.path(), 1 << 21),
            Err(PciError::NotHugetlbfs(_))
        ));
        assert!(matches!(
            HugeDma::new(&t.path().join("missing"), 1 << 21),
            Err(PciError::Io { .. })
        ));
    }

    /// Runs only where a hugetlbfs mount with free huge pages exists (not in CI; in
    /// the QEMU test guests).
    #[test]
    fn hugetlbfs_if_available() {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let Some(dir) = mounts
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|w| w.len() > 2 && w[2] == "hugetlbfs")
            .map(|w| w[1].to_string())
        else {
            return;
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let free = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("HugePages_Free:"))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(0);
        if free == 0 {
            return;
        }
        let dma = HugeDma::new(Path::new(&dir), 1).expect("hugetlbfs DMA");
        assert!(dma.chunk_size() >= 1 << 21);
        let r = dma.alloc(4096, 4096).expect("alloc");
        assert_eq!(virt_to_phys(r.as_ptr() as usize).ok(), Some(r.dev_addr()));
    }

    #[test]
    fn file_backed_allocator() {
        let page = page_size() as usize;
        let f = tempfile::tempfile().expect("tempfile");
        let dma = match HugeDma::from_file(&f, 3 * page + 1, page) {
            Ok(d) => d,
            // Without CAP_SYS_ADMIN this is the documented error; nothing else to test.
            Err(PciError::Pagemap { error, .. }) => {
                assert_eq!(error, PagemapError::PfnHidden);
                return;
            }
            Err(e) => panic!("unexpected: {e}"),
        };
        assert_eq!(dma.len(), 4 * page);
        assert_eq!(dma.chunk_phys().len(), 4);
        let a = dma.alloc(100, 64).expect("a");
        assert_eq!(a.dev_addr(), dma.chunk_phys()[0]);
        let b = dma.alloc(100, 64).expect("b");
        assert_eq!(b.dev_addr(), dma.chunk_phys()[0] + 128);
        // Does not fit the rest of chunk 0: starts chunk 1.
        let c = dma.alloc(page - 64, 8).expect("c");
        assert_eq!(c.dev_addr(), dma.chunk_phys()[1]);
        assert_eq!(c.as_ptr() as usize, a.as_ptr() as usize + page);
        assert!(matches!(
            dma.alloc(page + 1, 8),
            Err(DmaError::TooLarge { .. })
        ));
        assert!(matches!(dma.alloc(8, 2 * page), Err(DmaError::BadAlign(_))));
        let d = dma.alloc(page, page).expect("d");
        assert_eq!(d.dev_addr(), dma.chunk_phys()[2]);
        // Every region's device address is the physical address of its host pointer.
        for r in [&a, &b, &c, &d] {
            assert_eq!(virt_to_phys(r.as_ptr() as usize).ok(), Some(r.dev_addr()));
        }
        let _e = dma.alloc(page, 8).expect("e");
        assert!(matches!(dma.alloc(1, 1), Err(DmaError::Exhausted { .. })));
        // Regions keep the mapping alive past the allocator.
        drop(dma);
        let mut buf = [0u8; 4];
        d.read_at(0, &mut buf).expect("read");
        assert_eq!(buf, [0; 4]);
    }
}

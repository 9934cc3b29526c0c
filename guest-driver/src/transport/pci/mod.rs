//! A user-space virtio-pci (modern, virtio 1.x) driver for the pvcm device inside a VM.
//!
//! The pieces, bottom up:
//! - [`sysfs`]: find the function by vendor `0x1af4` and device `0x1040 + virtio_id`
//!   under a sysfs root ([`find_virtio_pci`]), unbind its kernel driver, set memory
//!   enable + bus master in the command register, read `resource`, map a BAR from
//!   `resourceN` ([`MmapBar`]).
//! - [`caps`]: walk the capability list of the config space and pick the virtio
//!   structures (common, notify + `notify_off_multiplier`, ISR, device config).
//! - [`mmio`] and [`common`]: volatile register access ([`Mmio`]) and
//!   `struct virtio_pci_common_cfg` with the initialization sequence (reset,
//!   ACKNOWLEDGE, DRIVER, features, FEATURES_OK check, queue setup, DRIVER_OK) and
//!   queue notification ([`PciNotifier`], a [`crate::virtq::Notify`]).
//! - [`hugepage`]: [`HugeDma`], a [`crate::virtq::DmaMemory`] on hugetlbfs whose
//!   device addresses are physical addresses from `/proc/self/pagemap`.
//! - [`VirtioPciDevice`] ties them together; [`open_virtio_pci`] does it from sysfs.
//!
//! Use:
//! ```ignore
//! let f = &find_virtio_pci(Path::new("/sys"), abi::DEFAULT_VIRTIO_ID as u16)?[0];
//! let mut dev = open_virtio_pci(f)?;
//! let feats = dev.negotiate(features::PVCM)?;
//! let dma = HugeDma::new(Path::new("/dev/hugepages"), 2 << 20)?;
//! let size = dev.queue_max_size(abi::TX_QUEUE).min(256);
//! let tx = MsgQueue::new(&dma, VirtqConfig::new(abi::TX_QUEUE, size).with_features(feats), abi::RX_BUFFER_LEN)?;
//! let rx = MsgQueue::new(&dma, VirtqConfig::new(abi::RX_QUEUE, size).with_features(feats), abi::RX_BUFFER_LEN)?;
//! let notifier = dev.activate(&[tx.virtq(), rx.virtq()])?;   // DRIVER_OK
//! // poll: rx.pop_used(), tx.kick(&notifier), ...
//! ```
//!
//! # What is tested here and what only in QEMU
//!
//! Unit tests (no root, no huge pages, no PCI device) cover: capability parsing of
//! 256- and 4096-byte images, the common-config layout, the whole init sequence and
//! its error paths against a fake register file (the order of writes is asserted),
//! notify offsets, sysfs discovery / unbind / bus master / resource parsing on a fake
//! sysfs tree, BAR mapping of a regular `resourceN` file, pagemap decoding with
//! synthetic entries, and the hugetlbfs allocator's arithmetic over a regular file
//! (when the test process may read PFNs; otherwise the `PfnHidden` error path).
//!
//! Only a real VM exercises: mapping a real BAR (`resourceN` of a device, needs root),
//! MMIO side effects of a real virtio-pci device (QEMU's `vhost-user-*-pci` in front
//! of `pvcm-backend`), unbinding a real kernel driver, DMA by the device into guest
//! memory after bus mastering, hugetlbfs with reserved huge pages, and physical
//! addresses from pagemap (root / CAP_SYS_ADMIN). The driver assumes no vIOMMU
//! (guest-physical address = DMA address). Used buffers are found by polling
//! (`Virtq::pop_used`); the device's INTx wakes the driver through `uio_pci_generic`
//! when that is loaded ([`uio`]), and the driver polls otherwise (MSI-X vectors are set
//! to "none" and MSI-X stays off).

pub mod caps;
pub mod common;
pub mod hugepage;
pub mod mmio;
pub mod sysfs;
pub mod uio;

use std::path::PathBuf;
use std::sync::Arc;

pub use caps::{CapRegion, VirtioCaps, parse_virtio_caps};
pub use common::{CommonCfg, PciNotifier, QueueSetup};
pub use hugepage::{HugeDma, PagemapError, pagemap_phys, virt_to_phys};
pub use mmio::{Mmio, MmioWindow};
pub use sysfs::{MmapBar, PciFunction, find_virtio_pci};
pub use uio::UioIrq;

use crate::virtq::Virtq;

/// Errors of the PCI transport.
#[derive(Debug, thiserror::Error)]
pub enum PciError {
    /// A file or system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Unparsable sysfs content or a bad argument.
    #[error("cannot parse {0}")]
    Parse(String),
    /// The config-space image is too short (non-root sysfs reads give 64 bytes).
    #[error("config space of {0} bytes is too short (run as root for the full 256)")]
    ConfigTooShort(usize),
    /// The status register says there is no capability list.
    #[error("no PCI capability list")]
    NoCapabilities,
    /// A capability pointer outside 0x40..256 or the image.
    #[error("bad capability pointer {0:#x}")]
    BadCapPointer(usize),
    /// The capability list loops.
    #[error("capability list loops")]
    CapLoop,
    /// A malformed capability.
    #[error("bad capability at {at:#x}: {why}")]
    BadCap {
        /// Its offset.
        at: usize,
        /// What is wrong.
        why: &'static str,
    },
    /// A required virtio structure is missing.
    #[error("no virtio {0} capability")]
    MissingCap(&'static str),
    /// A virtio structure lies outside its BAR.
    #[error("capability region {offset:#x}+{length:#x} outside BAR {bar} ({bar_len:#x} bytes)")]
    CapOutsideBar {
        /// BAR.
        bar: u8,
        /// Offset in the BAR.
        offset: u32,
        /// Length.
        length: u32,
        /// The BAR's length.
        bar_len: usize,
    },
    /// A register window too short for its structure.
    #[error("{what} window of {len} bytes is too short")]
    WindowTooShort {
        /// Which structure.
        what: &'static str,
        /// Its length.
        len: usize,
    },
    /// Not a mappable memory BAR.
    #[error("BAR {0} is not a memory BAR")]
    NotMemoryBar(u8),
    /// The device did not read back status 0 after a reset.
    #[error("device did not complete reset")]
    ResetTimeout,
    /// The device does not offer VERSION_1.
    #[error("device is not a modern virtio device (features {offered:#x})")]
    NotModern {
        /// What it offers.
        offered: u64,
    },
    /// The device cleared FEATURES_OK.
    #[error("device rejected features {features:#x}")]
    FeaturesRejected {
        /// What the driver asked for.
        features: u64,
    },
    /// The device has no such queue.
    #[error("device has no queue {0}")]
    NoSuchQueue(u16),
    /// The queue is larger than the device allows.
    #[error("queue {queue} size {size} above the device maximum {max}")]
    QueueTooLarge {
        /// Queue index.
        queue: u16,
        /// Asked-for size.
        size: u16,
        /// Device maximum.
        max: u16,
    },
    /// The queue was already enabled (no reset since).
    #[error("queue {0} already enabled")]
    QueueAlreadyEnabled(u16),
    /// A queue's notify address lies outside the notify area.
    #[error("queue {queue} notify offset {offset:#x} outside the {len}-byte notify area")]
    NotifyOutOfRange {
        /// Queue index.
        queue: u16,
        /// Byte offset.
        offset: u64,
        /// Area length.
        len: usize,
    },
    /// No device-specific config structure, or a read past it.
    #[error("device config read {off}+{len} outside its {have} bytes")]
    DeviceConfigRange {
        /// Offset.
        off: usize,
        /// Length.
        len: usize,
        /// Bytes the device config has.
        have: usize,
    },
    /// The config generation kept changing.
    #[error("device config keeps changing")]
    ConfigUnstable,
    /// The directory is not a hugetlbfs mount.
    #[error("{0} is not a hugetlbfs mount")]
    NotHugetlbfs(PathBuf),
    /// No physical address for a page.
    #[error("pagemap for {vaddr:#x}: {error}")]
    Pagemap {
        /// The virtual address.
        vaddr: u64,
        /// Why.
        error: PagemapError,
    },
    /// The device's interrupt cannot be used (the driver polls instead).
    #[error("no interrupts: {0}")]
    NoInterrupts(String),
    /// A "huge page" that is not physically contiguous.
    #[error("DMA chunk of {chunk} bytes is not physically contiguous")]
    NotContiguous {
        /// Chunk size.
        chunk: usize,
    },
}

/// A modern virtio-pci device: its common configuration, notify area, ISR and device
/// configuration, over register regions of type `M` (mapped BARs, or fakes in tests).
#[derive(Debug)]
pub struct VirtioPciDevice<M> {
    common: CommonCfg<MmioWindow<M>>,
    notify: MmioWindow<M>,
    notify_off_multiplier: u32,
    isr: Option<MmioWindow<M>>,
    device_cfg: Option<MmioWindow<M>>,
    features: u64,
}

impl<M: Mmio + Clone> VirtioPciDevice<M> {
    /// The device whose structures `caps` describes; `bar(n)` gives BAR `n`'s registers
    /// (called once per structure; return clones of one handle per BAR).
    pub fn new(
        caps: &VirtioCaps,
        mut bar: impl FnMut(u8) -> Result<M, PciError>,
    ) -> Result<VirtioPciDevice<M>, PciError> {
        let mut window = |r: &CapRegion| -> Result<MmioWindow<M>, PciError> {
            let m = bar(r.bar)?;
            let bar_len = m.len();
            MmioWindow::new(m, r.offset as usize, r.length as usize).ok_or(
                PciError::CapOutsideBar {
                    bar: r.bar,
                    offset: r.offset,
                    length: r.length,
                    bar_len,
                },
            )
        };
        Ok(VirtioPciDevice {
            common: CommonCfg::new(window(&caps.common)?)?,
            notify: window(&caps.notify)?,
            notify_off_multiplier: caps.notify_off_multiplier,
            isr: caps.isr.as_ref().map(&mut window).transpose()?,
            device_cfg: caps.device.as_ref().map(&mut window).transpose()?,
            features: 0,
        })
    }

    /// The common configuration.
    pub fn common(&self) -> &CommonCfg<MmioWindow<M>> {
        &self.common
    }

    /// Resets the device and negotiates `wanted` (VERSION_1 is always required); see
    /// [`CommonCfg::negotiate`]. Returns the negotiated features.
    pub fn negotiate(&mut self, wanted: u64) -> Result<u64, PciError> {
        self.features = self.common.negotiate(wanted)?;
        Ok(self.features)
    }

    /// Features negotiated by the last [`VirtioPciDevice::negotiate`].
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The largest size queue `q` supports (0: no such queue).
    pub fn queue_max_size(&self, q: u16) -> u16 {
        self.common.queue_max_size(q)
    }

    /// Sets up `queues` (after [`VirtioPciDevice::negotiate`]) and sets DRIVER_OK;
    /// returns the notifier for them. On error the device gets FAILED.
    pub fn activate(&self, queues: &[&Virtq]) -> Result<PciNotifier<M>, PciError> {
        let r = (|| {
            let mut n = PciNotifier::new(self.notify.clone());
            for q in queues {
                let off = self.common.setup_queue(&QueueSetup::from(*q))?;
                n.add_queue(q.queue_index(), off, self.notify_off_multiplier)?;
            }
            self.common.driver_ok();
            Ok(n)
        })();
        if r.is_err() {
            self.common.fail();
        }
        r
    }

    /// Reads (and so clears) the ISR status; `None` without an ISR structure.
    pub fn isr_status(&self) -> Option<u8> {
        self.isr.as_ref().map(|w| w.read8(0))
    }

    /// Reads `buf.len()` bytes of the device-specific configuration at `off`,
    /// consistently (retries while `config_generation` changes).
    pub fn read_device_config(&self, off: usize, buf: &mut [u8]) -> Result<(), PciError> {
        let have = self.device_cfg.as_ref().map_or(0, |w| w.len());
        let w = match &self.device_cfg {
            Some(w) if off.checked_add(buf.len()).is_some_and(|e| e <= have) => w,
            _ => {
                return Err(PciError::DeviceConfigRange {
                    off,
                    len: buf.len(),
                    have,
                });
            }
        };
        for _ in 0..100 {
            let g = self.common.config_generation();
            for (i, b) in buf.iter_mut().enumerate() {
                *b = w.read8(off + i);
            }
            if self.common.config_generation() == g {
                return Ok(());
            }
        }
        Err(PciError::ConfigUnstable)
    }
}

/// Opens a virtio-pci function from sysfs: reads and parses its config space, unbinds
/// its kernel driver, enables memory decoding and bus mastering, and maps the BARs its
/// virtio structures live in. Needs root (full config space, `resourceN`, unbind).
pub fn open_virtio_pci(f: &PciFunction) -> Result<VirtioPciDevice<Arc<MmapBar>>, PciError> {
    let caps = parse_virtio_caps(&f.config()?)?;
    // uio_pci_generic only reports interrupts and leaves the device alone: keep it.
    if f.driver().as_deref() != Some(uio::UIO_PCI_GENERIC) {
        f.unbind_driver()?;
    }
    f.enable_bus_master()?;
    let mut bars: [Option<Arc<MmapBar>>; 6] = Default::default();
    VirtioPciDevice::new(&caps, |b| {
        let slot = bars
            .get_mut(usize::from(b))
            .ok_or(PciError::NotMemoryBar(b))?;
        match slot {
            Some(m) => Ok(m.clone()),
            None => {
                let m = Arc::new(f.map_bar(b)?);
                *slot = Some(m.clone());
                Ok(m)
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::common::tests::{FakeDevice, RegFile};
    use super::common::{STATUS_FAILED, offsets};
    use super::*;
    use crate::virtq::{LinearDma, MsgQueue, Notify, VirtqConfig, features};
    use std::ptr::NonNull;

    /// A BAR: the fake common configuration at 0..0x38, plain registers elsewhere.
    #[derive(Debug)]
    struct FakeBar {
        common: FakeDevice,
        rest: RegFile,
    }

    impl Mmio for FakeBar {
        fn len(&self) -> usize {
            self.rest.len()
        }
        fn read8(&self, off: usize) -> u8 {
            if off < 0x38 {
                self.common.read8(off)
            } else {
                self.rest.read8(off)
            }
        }
        fn read16(&self, off: usize) -> u16 {
            if off < 0x38 {
                self.common.read16(off)
            } else {
                self.rest.read16(off)
            }
        }
        fn read32(&self, off: usize) -> u32 {
            if off < 0x38 {
                self.common.read32(off)
            } else {
                self.rest.read32(off)
            }
        }
        fn write8(&self, off: usize, v: u8) {
            if off < 0x38 {
                self.common.write8(off, v)
            } else {
                self.rest.write8(off, v)
            }
        }
        fn write16(&self, off: usize, v: u16) {
            if off < 0x38 {
                self.common.write16(off, v)
            } else {
                self.rest.write16(off, v)
            }
        }
        fn write32(&self, off: usize, v: u32) {
            if off < 0x38 {
                self.common.write32(off, v)
            } else {
                self.rest.write32(off, v)
            }
        }
    }

    /// DMA memory over a mapped temporary file (device address = a fake GPA).
    fn dma(len: usize) -> LinearDma {
        let f = tempfile::tempfile().expect("tempfile");
        f.set_len(len as u64).expect("len");
        let m = Arc::new(MmapBar::map(&f, len).expect("map"));
        let p = NonNull::new(m.as_ptr()).expect("non-null");
        // SAFETY: the mapping is `len` bytes, kept alive by the keepalive, used by
        // nothing else.
        unsafe { LinearDma::new(p, 0x4000_0000, len, Some(m)) }
    }

    #[test]
    fn device_from_caps_end_to_end_with_fakes() {
        let bar = FakeBar {
            common: FakeDevice::new(features::PVCM, &[1024, 1024]),
            rest: RegFile::new(0x4000),
        };
        // pvcm config space in the device-config structure (BAR 4 at 0x2000).
        let cs = pvcm_wire::abi::config_space();
        bar.rest.bytes.borrow_mut()[0x2000..0x2008].copy_from_slice(&cs);
        let caps = parse_virtio_caps(&caps::tests::qemu_like(256)).expect("caps");
        let mut dev = VirtioPciDevice::new(&caps, |b| {
            assert_eq!(b, 4);
            Ok(&bar)
        })
        .expect("device");
        let f = dev.negotiate(features::PVCM).expect("negotiate");
        assert_eq!(dev.features(), f);
        let mut buf = [0u8; 8];
        dev.read_device_config(0, &mut buf).expect("config");
        assert_eq!(buf, cs);
        assert!(dev.read_device_config(0x1000 - 4, &mut buf).is_err());
        assert_eq!(dev.isr_status(), Some(0));

        let mem = dma(1 << 20);
        let size = dev.queue_max_size(0).min(256);
        let tx = MsgQueue::new(&mem, VirtqConfig::new(0, size).with_features(f), 304).expect("tx");
        let rx = MsgQueue::new(&mem, VirtqConfig::new(1, size).with_features(f), 304).expect("rx");
        assert!(tx.virtq().event_idx());
        let n = dev.activate(&[tx.virtq(), rx.virtq()]).expect("activate");
        {
            let s = bar.common.st.borrow();
            assert_eq!(s.status, 15);
            assert_eq!(s.queues[0].desc, tx.virtq().desc_table_addr());
            assert_eq!(s.queues[1].driver, rx.virtq().avail_ring_addr());
            assert_eq!(s.queues[1].device, rx.virtq().used_ring_addr());
            assert_eq!(s.queues[1].size, 256);
        }
        // Queue 1 has notify_off 1, multiplier 4: notify at BAR 0x3000 + 4.
        n.notify(1);
        assert_eq!(bar.rest.writes.borrow().last(), Some(&(0x3004, 1)));

        // Activating again fails (queues enabled) and leaves FAILED.
        assert!(dev.activate(&[tx.virtq()]).is_err());
        assert_eq!(bar.common.st.borrow().status & STATUS_FAILED, STATUS_FAILED);
    }

    #[test]
    fn caps_outside_their_bar_are_refused() {
        let bar = RegFile::new(0x2000);
        let caps = parse_virtio_caps(&caps::tests::qemu_like(256)).expect("caps");
        assert!(matches!(
            VirtioPciDevice::new(&caps, |_| Ok(&bar)),
            Err(PciError::CapOutsideBar { bar: 4, .. })
        ));
    }

    #[test]
    fn open_from_fake_sysfs_maps_the_bar() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = sysfs::tests::fake_function(
            t.path(),
            "0000:00:04.0",
            0x1af4,
            0x107f,
            Some("virtio-pci"),
        );
        let found =
            find_virtio_pci(t.path(), pvcm_wire::abi::DEFAULT_VIRTIO_ID as u16).expect("find");
        assert_eq!(found.len(), 1);
        let mut dev = open_virtio_pci(&found[0]).expect("open");
        assert_eq!(found[0].driver(), Some("virtio-pci".into()));
        let cfg = std::fs::read(d.join("config")).expect("config");
        assert_eq!(cfg[4] & 0x6, 0x6, "memory + bus master");
        // The "BAR" is a plain file: device features read 0, so negotiation stops at
        // NotModern and writes FAILED into the mapped common configuration.
        assert!(matches!(
            dev.negotiate(features::PVCM),
            Err(PciError::NotModern { offered: 0 })
        ));
        drop(dev);
        let bar = std::fs::read(d.join("resource4")).expect("bar");
        assert_eq!(bar[offsets::DEVICE_STATUS], 0x83);
        assert_eq!(bar[offsets::DEVICE_FEATURE_SELECT], 1);
    }
}

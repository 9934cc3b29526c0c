//! The in-VM transport: the pvcm device as a virtio-pci function, driven from user space
//! with the pieces of [`crate::transport::pci`].
//!
//! [`PciDevice::open`] finds the function under sysfs (vendor 0x1af4, device
//! 0x1040 + the virtio ID, default `abi::DEFAULT_VIRTIO_ID` = 63; optionally a given
//! address), maps hugetlbfs DMA memory (physical addresses from `/proc/self/pagemap`),
//! then unbinds the kernel driver, enables bus mastering, maps the BARs, runs the
//! virtio initialization sequence (reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK),
//! checks the config space (magic "PVCM", ABI version), sets up both queues and sets
//! DRIVER_OK. The returned [`Queues`] go to [`super::Device::start`].
//!
//! Notifications go through the notify BAR. The device's used-buffer notifications
//! arrive as INTx through `uio_pci_generic` when that driver is loaded
//! ([`crate::transport::pci::uio`]): [`Transport::wait`] then sleeps until the device
//! interrupts. Without it (or with [`PciOptions::interrupts`] off), `wait` sleeps a
//! short poll interval and the device layer polls the used rings. Dropping a `PciDevice` resets the device so it stops using the
//! queues before their memory goes away.
//!
//! # Where this runs
//!
//! Only inside a VM (QEMU with the pvcm device in front of `pvcm-backend`, see
//! `qemu-scripts/` and `docs/qemu.md`), as root, with huge pages reserved and no vIOMMU. Here it compiles and its
//! logic is unit-tested against fake register files (the init sequence, queue sizing,
//! the config-space check, notify offsets, reset on drop) and fake sysfs trees
//! (discovery errors without side effects).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pvcm_wire::abi::{self, RX_QUEUE, TX_QUEUE};

use super::{DeviceError, Queues, Transport, TransportError};
use crate::transport::pci::sysfs::{VIRTIO_PCI_MODERN_DEVICE_BASE, VIRTIO_PCI_VENDOR};
use crate::transport::pci::{
    HugeDma, MmapBar, Mmio, PciError, PciNotifier, UioIrq, VirtioPciDevice, find_virtio_pci,
    open_virtio_pci,
};
use crate::virtq::{DmaMemory, Notify, features};

/// Where to find the device and how to set it up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciOptions {
    /// The sysfs mount (`/sys`).
    pub sysfs_root: PathBuf,
    /// The virtio device ID (PCI device ID 0x1040 + ID).
    pub virtio_id: u32,
    /// A PCI address (`0000:00:04.0`) when several functions match; `None`: the first.
    pub bdf: Option<String>,
    /// A hugetlbfs mount for the DMA memory.
    pub hugetlbfs: PathBuf,
    /// Queue size wanted (rounded down to a power of two and to the device's maximum).
    pub queue_size: u16,
    /// How long [`Transport::wait`] sleeps between polls of the used rings, when it polls.
    pub poll_interval: Duration,
    /// Wait on the device's interrupt (INTx through `uio_pci_generic`) when the driver
    /// is loaded; off: always poll.
    pub interrupts: bool,
    /// Where the `uioN` device nodes are (`/dev`).
    pub dev_root: PathBuf,
}

impl Default for PciOptions {
    fn default() -> Self {
        PciOptions {
            sysfs_root: PathBuf::from("/sys"),
            virtio_id: abi::DEFAULT_VIRTIO_ID,
            bdf: None,
            hugetlbfs: PathBuf::from("/dev/hugepages"),
            queue_size: 1024,
            poll_interval: Duration::from_micros(100),
            interrupts: true,
            dev_root: PathBuf::from("/dev"),
        }
    }
}

/// The longest a wait on the interrupt lasts before the rings are looked at anyway,
/// while messages move: a guard against an interrupt that never comes (a VMM that does
/// not deliver INTx). Far below any CM timeout.
pub const INTERRUPT_WAIT_CAP: Duration = Duration::from_millis(100);
/// The cap once [`IDLE_INTERRUPT_WAITS`] waits passed without a message moving: an idle
/// driver wakes once a second instead of 10 times (each wake-up costs the VM a little
/// CPU, under TCG a lot), and a lost interrupt after a quiet spell still costs at most
/// this long, below the shortest CM retry window.
pub const IDLE_INTERRUPT_WAIT_CAP: Duration = Duration::from_secs(1);
/// Waits at [`INTERRUPT_WAIT_CAP`] after the last activity: one second of quiet.
pub const IDLE_INTERRUPT_WAITS: u32 = 10;

/// The cap of an interrupt wait after `idle_waits` waits without activity.
pub fn interrupt_wait_cap(idle_waits: u32) -> Duration {
    if idle_waits < IDLE_INTERRUPT_WAITS {
        INTERRUPT_WAIT_CAP
    } else {
        IDLE_INTERRUPT_WAIT_CAP
    }
}

/// The pvcm device behind a virtio-pci function, as a [`Transport`].
#[derive(Debug)]
pub struct PciDevice<M: Mmio + Clone = Arc<MmapBar>> {
    dev: VirtioPciDevice<M>,
    notifier: PciNotifier<M>,
    features: u64,
    poll_interval: Duration,
    /// Waits since messages last moved (see [`idle_poll_interval`]).
    idle_waits: u32,
    /// The device's interrupt, when the driver waits on it instead of polling.
    irq: Option<UioIrq>,
    name: String,
}

/// Waits at the fast poll interval after the last activity before backing off: with
/// the default 100 us, 100 ms of quiet.
pub const IDLE_WAITS_BEFORE_BACKOFF: u32 = 1000;
/// The poll interval once idle: an idle VM wakes 100 times a second instead of 10,000
/// (measured under TCG: a 100 us timed poll cost 31% of a host core, a 2 ms one 5%),
/// and the first MAD after a quiet spell waits at most this long, far below any CM
/// timeout (the shortest REQ wait is seconds).
pub const IDLE_POLL_INTERVAL: Duration = Duration::from_millis(10);

/// How long a polling transport sleeps after `idle_waits` waits without activity: the
/// fast `base` for [`IDLE_WAITS_BEFORE_BACKOFF`] waits, then [`IDLE_POLL_INTERVAL`]
/// (never below `base`).
pub fn idle_poll_interval(idle_waits: u32, base: Duration) -> Duration {
    if idle_waits < IDLE_WAITS_BEFORE_BACKOFF {
        base
    } else {
        IDLE_POLL_INTERVAL.max(base)
    }
}

/// The largest power of two not above `n` (0 for 0).
fn pow2_floor(n: u16) -> u16 {
    if n == 0 {
        0
    } else {
        1 << (15 - n.leading_zeros())
    }
}

impl PciDevice<Arc<MmapBar>> {
    /// Finds, opens and initializes the device (see the module documentation). Needs
    /// root. Discovery errors ([`DeviceError::NoDevice`]) and DMA-memory errors come
    /// before anything is changed on the system.
    pub fn open(o: &PciOptions) -> Result<(PciDevice, Queues), DeviceError> {
        let id = u16::try_from(o.virtio_id)
            .ok()
            .filter(|id| id.checked_add(VIRTIO_PCI_MODERN_DEVICE_BASE).is_some())
            .ok_or_else(|| DeviceError::Invalid(format!("virtio ID {} too large", o.virtio_id)))?;
        let found = find_virtio_pci(&o.sysfs_root, id)?;
        let f = match &o.bdf {
            Some(b) => found.into_iter().find(|f| f.bdf() == b),
            None => found.into_iter().next(),
        }
        .ok_or_else(|| DeviceError::NoDevice {
            vendor: VIRTIO_PCI_VENDOR,
            device: VIRTIO_PCI_MODERN_DEVICE_BASE + id,
            virtio_id: o.virtio_id,
            root: o.sysfs_root.display().to_string(),
            which: o.bdf.as_ref().map_or(String::new(), |b| format!(" at {b}")),
        })?;
        let dma = HugeDma::new(&o.hugetlbfs, Queues::dma_bytes(o.queue_size.max(1)))?;
        let dev = open_virtio_pci(&f)?;
        let (irq, wakes) = if o.interrupts {
            match UioIrq::attach(&o.sysfs_root, &o.dev_root, &f) {
                Ok(irq) => {
                    let w = format!("INTx via {}", irq.name());
                    (Some(irq), w)
                }
                Err(e) => (None, format!("polling ({e})")),
            }
        } else {
            (None, "polling (interrupts off)".to_string())
        };
        let (mut d, q) = Self::setup(
            dev,
            &dma,
            o.queue_size,
            format!("pci {}, {wakes}", f.bdf()),
            o.poll_interval,
        )?;
        d.irq = irq;
        Ok((d, q))
    }
}

impl<M: Mmio + Clone> PciDevice<M> {
    /// Initializes an opened device: negotiates the pvcm features, checks the config
    /// space, allocates both queues from `dma` (the smaller of `queue_size` and the
    /// device's maximum, rounded down to a power of two), gives them to the device and
    /// sets DRIVER_OK. On failure the device is left with FAILED set.
    pub fn setup<D: DmaMemory + ?Sized>(
        mut dev: VirtioPciDevice<M>,
        dma: &D,
        queue_size: u16,
        name: String,
        poll_interval: Duration,
    ) -> Result<(PciDevice<M>, Queues), DeviceError> {
        let features = dev.negotiate(features::PVCM)?;
        let queues = match Self::check_and_alloc(&dev, dma, queue_size, features) {
            Ok(q) => q,
            Err(e) => {
                dev.common().fail();
                return Err(e);
            }
        };
        let notifier = dev.activate(&[queues.tx.virtq(), queues.rx.virtq()])?;
        Ok((
            PciDevice {
                dev,
                notifier,
                features,
                poll_interval,
                idle_waits: 0,
                irq: None,
                name,
            },
            queues,
        ))
    }

    fn check_and_alloc<D: DmaMemory + ?Sized>(
        dev: &VirtioPciDevice<M>,
        dma: &D,
        queue_size: u16,
        features: u64,
    ) -> Result<Queues, DeviceError> {
        check_config_space(dev)?;
        let max = dev
            .queue_max_size(TX_QUEUE)
            .min(dev.queue_max_size(RX_QUEUE));
        if max == 0 {
            let q = if dev.queue_max_size(TX_QUEUE) == 0 {
                TX_QUEUE
            } else {
                RX_QUEUE
            };
            return Err(PciError::NoSuchQueue(q).into());
        }
        let size = pow2_floor(queue_size.min(max));
        if size == 0 {
            return Err(DeviceError::Invalid("queue size 0".into()));
        }
        Ok(Queues::new(dma, size, features)?)
    }

    /// The virtio-pci device.
    pub fn pci(&self) -> &VirtioPciDevice<M> {
        &self.dev
    }
}

/// Checks the device-specific config space when the device has one: the pvcm magic and
/// ABI version. A device without one (or reading all zeros) passes: PORT_INFO carries
/// the version too.
pub fn check_config_space<M: Mmio + Clone>(dev: &VirtioPciDevice<M>) -> Result<(), DeviceError> {
    let mut c = [0u8; abi::CONFIG_LEN];
    match dev.read_device_config(0, &mut c) {
        Ok(()) => {}
        Err(PciError::DeviceConfigRange { .. }) => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let magic = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    let version = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
    if magic == 0 && version == 0 {
        return Ok(());
    }
    if magic != abi::CONFIG_MAGIC {
        return Err(DeviceError::NotPvcm(magic));
    }
    if version != abi::ABI_VERSION {
        return Err(DeviceError::AbiMismatch {
            device: version,
            driver: abi::ABI_VERSION,
        });
    }
    Ok(())
}

impl<M: Mmio + Clone> Notify for PciDevice<M> {
    fn notify(&self, queue: u16) {
        self.notifier.notify(queue)
    }
}

impl<M: Mmio + Clone> Transport for PciDevice<M> {
    fn features(&self) -> u64 {
        self.features
    }

    /// With the interrupt: sleeps until the device interrupts (or `timeout`, at most
    /// [`interrupt_wait_cap`]), then clears the interrupt (reading the ISR lowers the
    /// line) and unmasks it. Without: sleeps the poll interval (or `timeout`, if shorter).
    fn wait(&mut self, timeout: Duration) -> Result<(), TransportError> {
        if let Some(irq) = &self.irq {
            let cap = interrupt_wait_cap(self.idle_waits);
            self.idle_waits = self.idle_waits.saturating_add(1);
            if irq.wait(timeout.min(cap))? {
                let _ = self.dev.isr_status();
                irq.unmask()?;
            }
            return Ok(());
        }
        let d = timeout.min(idle_poll_interval(self.idle_waits, self.poll_interval));
        self.idle_waits = self.idle_waits.saturating_add(1);
        if !d.is_zero() {
            std::thread::sleep(d);
        }
        Ok(())
    }

    fn note_activity(&mut self) {
        self.idle_waits = 0;
    }

    /// With the interrupt: waits on it and `extra` together; without: on `extra` for at
    /// most the poll interval.
    fn wait_with(
        &mut self,
        timeout: Duration,
        extra: &[std::os::fd::RawFd],
    ) -> Result<u64, TransportError> {
        let (own, t) = match &self.irq {
            Some(irq) => (
                vec![irq.fd()],
                timeout.min(interrupt_wait_cap(self.idle_waits)),
            ),
            None => (
                Vec::new(),
                timeout.min(idle_poll_interval(self.idle_waits, self.poll_interval)),
            ),
        };
        self.idle_waits = self.idle_waits.saturating_add(1);
        let (mine, theirs) =
            crate::transport::poll_readable(&own, extra, t).map_err(|source| TransportError {
                what: "ppoll on the device's interrupt".into(),
                source,
            })?;
        if let (Some(irq), true) = (&self.irq, mine & 1 != 0)
            && irq.consume()?
        {
            let _ = self.dev.isr_status();
            irq.unmask()?;
        }
        Ok(theirs)
    }

    /// With the interrupt: its descriptor, for at most the interrupt wait cap; without:
    /// none, for at most the poll interval.
    fn wait_fds(&self, timeout: Duration) -> (Vec<std::os::fd::RawFd>, Duration) {
        match &self.irq {
            Some(irq) => (
                vec![irq.fd()],
                timeout.min(interrupt_wait_cap(self.idle_waits)),
            ),
            None => (
                Vec::new(),
                timeout.min(idle_poll_interval(self.idle_waits, self.poll_interval)),
            ),
        }
    }

    fn describe(&self) -> String {
        self.name.clone()
    }
}

impl<M: Mmio + Clone> Drop for PciDevice<M> {
    /// Resets the device: it stops using the queues (whose memory is freed next).
    fn drop(&mut self) {
        let _ = self.dev.common().reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::pci::caps::tests::qemu_like;
    use crate::transport::pci::common::tests::{FakeDevice, RegFile};
    use crate::transport::pci::common::{STATUS_FAILED, offsets};
    use crate::transport::pci::parse_virtio_caps;
    use crate::virtq::LinearDma;
    use std::ptr::NonNull;

    /// A BAR: the fake common configuration at 0..0x38, plain registers elsewhere
    /// (device config at 0x2000, notify area at 0x3000, multiplier 4).
    #[derive(Debug)]
    struct FakeBar {
        common: FakeDevice,
        rest: RegFile,
    }

    macro_rules! route {
        ($self:ident, $off:ident, $f:ident $(, $v:ident)?) => {
            if $off < 0x38 {
                $self.common.$f($off $(, $v)?)
            } else {
                $self.rest.$f($off $(, $v)?)
            }
        };
    }

    impl Mmio for FakeBar {
        fn len(&self) -> usize {
            self.rest.len()
        }
        fn read8(&self, off: usize) -> u8 {
            route!(self, off, read8)
        }
        fn read16(&self, off: usize) -> u16 {
            route!(self, off, read16)
        }
        fn read32(&self, off: usize) -> u32 {
            route!(self, off, read32)
        }
        fn write8(&self, off: usize, v: u8) {
            route!(self, off, write8, v)
        }
        fn write16(&self, off: usize, v: u16) {
            route!(self, off, write16, v)
        }
        fn write32(&self, off: usize, v: u32) {
            route!(self, off, write32, v)
        }
    }

    fn bar(max: &[u16], config: &[u8]) -> FakeBar {
        let b = FakeBar {
            common: FakeDevice::new(features::PVCM, max),
            rest: RegFile::new(0x4000),
        };
        b.rest.bytes.borrow_mut()[0x2000..0x2000 + config.len()].copy_from_slice(config);
        b
    }

    fn dma(len: usize) -> LinearDma {
        let f = tempfile::tempfile().expect("tempfile");
        f.set_len(len as u64).expect("len");
        let m = Arc::new(MmapBar::map(&f, len).expect("map"));
        let p = NonNull::new(m.as_ptr()).expect("non-null");
        // SAFETY: the mapping is `len` bytes, kept alive by the keepalive, used by
        // nothing else.
        unsafe { LinearDma::new(p, 0x4000_0000, len, Some(m)) }
    }

    fn device(b: &FakeBar) -> VirtioPciDevice<&FakeBar> {
        let caps = parse_virtio_caps(&qemu_like(256)).expect("caps");
        VirtioPciDevice::new(&caps, |_| Ok(b)).expect("device")
    }

    #[test]
    fn setup_activates_both_queues_and_drop_resets() {
        let b = bar(&[128, 128], &abi::config_space());
        let mem = dma(1 << 20);
        let (t, q) = PciDevice::setup(
            device(&b),
            &mem,
            256,
            "pci test".into(),
            Duration::from_micros(10),
        )
        .expect("setup");
        assert_eq!(t.features(), features::PVCM);
        assert_eq!(t.describe(), "pci test");
        {
            let s = b.common.st.borrow();
            assert_eq!(s.status, 15, "DRIVER_OK");
            for (i, qs) in q.setups().iter().enumerate() {
                assert_eq!(qs.size, 128, "clamped to the device maximum");
                assert_eq!(s.queues[i].size, 128);
                assert_eq!(s.queues[i].desc, qs.desc);
                assert_eq!(s.queues[i].driver, qs.driver);
                assert_eq!(s.queues[i].device, qs.device);
                assert_eq!(s.queues[i].enable, 1);
            }
        }
        // Queue 1: notify_off 1 * multiplier 4 at the notify area (0x3000).
        t.notify(RX_QUEUE);
        assert_eq!(b.rest.writes.borrow().last(), Some(&(0x3004, 1)));
        let mut t = t;
        let start = std::time::Instant::now();
        t.wait(Duration::from_secs(5)).expect("wait");
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "polls, never blocks long"
        );
        drop(t);
        assert_eq!(b.common.st.borrow().status, 0, "reset on drop");
        assert_eq!(b.common.writes().last(), Some(&(offsets::DEVICE_STATUS, 0)));
        drop(q);
    }

    #[test]
    fn queue_size_rounds_down_to_a_power_of_two() {
        assert_eq!(pow2_floor(0), 0);
        assert_eq!(pow2_floor(1), 1);
        assert_eq!(pow2_floor(100), 64);
        assert_eq!(pow2_floor(1024), 1024);
        assert_eq!(pow2_floor(u16::MAX), 0x8000);
        let b = bar(&[1024, 1024], &abi::config_space());
        let mem = dma(1 << 20);
        let (_t, q) =
            PciDevice::setup(device(&b), &mem, 100, "t".into(), Duration::ZERO).expect("setup");
        assert_eq!(q.tx.virtq().size(), 64);
    }

    #[test]
    fn config_space_is_checked() {
        let mem = dma(1 << 20);
        let mut other = abi::config_space();
        other[4] = 2;
        let b = bar(&[256, 256], &other);
        let e =
            PciDevice::setup(device(&b), &mem, 256, "t".into(), Duration::ZERO).expect_err("ABI 2");
        assert!(
            matches!(
                e,
                DeviceError::AbiMismatch {
                    device: 2,
                    driver: 1
                }
            ),
            "{e}"
        );
        assert!(e.hint().is_some());
        assert_eq!(b.common.st.borrow().status & STATUS_FAILED, STATUS_FAILED);

        let b = bar(&[256, 256], b"GPIO\x01\0\0\0");
        let e = PciDevice::setup(device(&b), &mem, 256, "t".into(), Duration::ZERO)
            .expect_err("not pvcm");
        assert!(matches!(e, DeviceError::NotPvcm(_)), "{e}");

        // A device that offers no config (zeros) passes: PORT_INFO carries the version.
        let b = bar(&[256, 256], &[0; 8]);
        assert!(PciDevice::setup(device(&b), &mem, 256, "t".into(), Duration::ZERO).is_ok());
    }

    #[test]
    fn missing_queue_fails_the_device() {
        let b = bar(&[256, 0], &abi::config_space());
        let mem = dma(1 << 20);
        let e = PciDevice::setup(device(&b), &mem, 256, "t".into(), Duration::ZERO)
            .expect_err("no rx queue");
        assert!(
            matches!(e, DeviceError::Pci(PciError::NoSuchQueue(1))),
            "{e}"
        );
        assert_eq!(b.common.st.borrow().status & STATUS_FAILED, STATUS_FAILED);
    }

    #[test]
    fn open_reports_no_device_and_changes_nothing_without_hugepages() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        let d = crate::transport::pci::sysfs::tests::fake_function(
            root,
            "0000:00:04.0",
            0x1af4,
            0x1069,
            Some("virtio-pci"),
        );
        // Looking for ID 63: nothing there.
        let o = PciOptions {
            sysfs_root: root.to_path_buf(),
            ..PciOptions::default()
        };
        let e = PciDevice::open(&o).expect_err("no device");
        assert!(
            matches!(e, DeviceError::NoDevice { device: 0x107f, .. }),
            "{e}"
        );
        assert!(e.to_string().contains("1af4:107f"), "{e}");
        assert!(e.hint().is_some());
        // ID 41 at another address: nothing either.
        let o = PciOptions {
            virtio_id: 41,
            bdf: Some("0000:00:05.0".into()),
            ..o
        };
        let e = PciDevice::open(&o).expect_err("no device at that address");
        assert!(e.to_string().contains("at 0000:00:05.0"), "{e}");
        // The right ID and address, but the DMA directory is not hugetlbfs: the error
        // comes before the kernel driver is unbound or the command register touched.
        let cfg_before = std::fs::read(d.join("config")).expect("config");
        let o = PciOptions {
            bdf: Some("0000:00:04.0".into()),
            hugetlbfs: root.to_path_buf(),
            ..o
        };
        let e = PciDevice::open(&o).expect_err("not hugetlbfs");
        assert!(
            matches!(e, DeviceError::Pci(PciError::NotHugetlbfs(_))),
            "{e}"
        );
        assert!(e.hint().is_some());
        assert_eq!(std::fs::read(d.join("config")).expect("config"), cfg_before);
        let e = PciDevice::open(&PciOptions {
            virtio_id: 70_000,
            ..PciOptions::default()
        })
        .expect_err("bad id");
        assert!(matches!(e, DeviceError::Invalid(_)));
    }

    #[test]
    fn an_idle_poll_backs_off_and_activity_makes_it_fast_again() {
        let base = Duration::from_micros(100);
        assert_eq!(idle_poll_interval(0, base), base);
        assert_eq!(
            idle_poll_interval(IDLE_WAITS_BEFORE_BACKOFF - 1, base),
            base
        );
        assert_eq!(
            idle_poll_interval(IDLE_WAITS_BEFORE_BACKOFF, base),
            IDLE_POLL_INTERVAL
        );
        assert_eq!(idle_poll_interval(u32::MAX, base), IDLE_POLL_INTERVAL);
        // A configured interval above the idle one is kept.
        let slow = Duration::from_millis(20);
        assert_eq!(idle_poll_interval(u32::MAX, slow), slow);
    }

    #[test]
    fn an_idle_interrupt_wait_lasts_longer() {
        assert_eq!(interrupt_wait_cap(0), INTERRUPT_WAIT_CAP);
        assert_eq!(
            interrupt_wait_cap(IDLE_INTERRUPT_WAITS - 1),
            INTERRUPT_WAIT_CAP
        );
        assert_eq!(
            interrupt_wait_cap(IDLE_INTERRUPT_WAITS),
            IDLE_INTERRUPT_WAIT_CAP
        );
        assert_eq!(interrupt_wait_cap(u32::MAX), IDLE_INTERRUPT_WAIT_CAP);
    }
}

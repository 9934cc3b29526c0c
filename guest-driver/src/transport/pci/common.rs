//! `struct virtio_pci_common_cfg` (virtio spec 4.1.4.3), the device initialization
//! sequence (3.1.1) and queue notifications (4.1.4.4).

use std::time::{Duration, Instant};

use super::PciError;
use super::mmio::{Mmio, MmioWindow};
use crate::virtq::{Notify, Virtq, features};

/// Byte offsets of the fields of `struct virtio_pci_common_cfg`.
pub mod offsets {
    /// le32, RW: selects which 32 feature bits `DEVICE_FEATURE` shows.
    pub const DEVICE_FEATURE_SELECT: usize = 0x00;
    /// le32, RO: device feature bits (32 * select ..).
    pub const DEVICE_FEATURE: usize = 0x04;
    /// le32, RW: selects which 32 feature bits `DRIVER_FEATURE` takes.
    pub const DRIVER_FEATURE_SELECT: usize = 0x08;
    /// le32, RW: driver (accepted) feature bits.
    pub const DRIVER_FEATURE: usize = 0x0C;
    /// le16, RW: MSI-X vector for configuration changes.
    pub const MSIX_CONFIG: usize = 0x10;
    /// le16, RO: number of queues.
    pub const NUM_QUEUES: usize = 0x12;
    /// u8, RW: device status.
    pub const DEVICE_STATUS: usize = 0x14;
    /// u8, RO: configuration atomicity value.
    pub const CONFIG_GENERATION: usize = 0x15;
    /// le16, RW: queue the queue_* fields refer to.
    pub const QUEUE_SELECT: usize = 0x16;
    /// le16, RW: queue size (reads the maximum after reset; 0: no such queue).
    pub const QUEUE_SIZE: usize = 0x18;
    /// le16, RW: MSI-X vector of the queue.
    pub const QUEUE_MSIX_VECTOR: usize = 0x1A;
    /// le16, RW: 1 enables the queue.
    pub const QUEUE_ENABLE: usize = 0x1C;
    /// le16, RO: the queue's offset in the notify area, in multiplier units.
    pub const QUEUE_NOTIFY_OFF: usize = 0x1E;
    /// le64, RW: descriptor table address.
    pub const QUEUE_DESC: usize = 0x20;
    /// le64, RW: driver area (available ring) address.
    pub const QUEUE_DRIVER: usize = 0x28;
    /// le64, RW: device area (used ring) address.
    pub const QUEUE_DEVICE: usize = 0x30;
}

/// Device status: the guest noticed the device.
pub const STATUS_ACKNOWLEDGE: u8 = 1;
/// Device status: the guest knows how to drive it.
pub const STATUS_DRIVER: u8 = 2;
/// Device status: the driver is ready.
pub const STATUS_DRIVER_OK: u8 = 4;
/// Device status: feature negotiation is complete.
pub const STATUS_FEATURES_OK: u8 = 8;
/// Device status: the device hit an error and needs a reset.
pub const STATUS_DEVICE_NEEDS_RESET: u8 = 64;
/// Device status: the driver gave up.
pub const STATUS_FAILED: u8 = 128;
/// "No MSI-X vector".
pub const VIRTIO_MSI_NO_VECTOR: u16 = 0xFFFF;

/// How long [`CommonCfg::reset`] waits for the device to read back status 0.
pub const RESET_TIMEOUT: Duration = Duration::from_secs(1);

/// What a device needs to know about one queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSetup {
    /// Queue index.
    pub index: u16,
    /// Queue size.
    pub size: u16,
    /// Descriptor table address.
    pub desc: u64,
    /// Driver area (available ring) address.
    pub driver: u64,
    /// Device area (used ring) address.
    pub device: u64,
}

impl From<&Virtq> for QueueSetup {
    fn from(q: &Virtq) -> QueueSetup {
        QueueSetup {
            index: q.queue_index(),
            size: q.size(),
            desc: q.desc_table_addr(),
            driver: q.avail_ring_addr(),
            device: q.used_ring_addr(),
        }
    }
}

/// Typed access to the common configuration structure in `M`.
#[derive(Debug, Clone)]
pub struct CommonCfg<M> {
    r: M,
}

impl<M: Mmio> CommonCfg<M> {
    /// The structure in `r` (at least 0x38 bytes).
    pub fn new(r: M) -> Result<CommonCfg<M>, PciError> {
        if r.len() < offsets::QUEUE_DEVICE + 8 {
            return Err(PciError::WindowTooShort {
                what: "common configuration",
                len: r.len(),
            });
        }
        Ok(CommonCfg { r })
    }

    /// The register region.
    pub fn regs(&self) -> &M {
        &self.r
    }

    /// All 64 device feature bits.
    pub fn device_features(&self) -> u64 {
        self.r.write32(offsets::DEVICE_FEATURE_SELECT, 0);
        let lo = self.r.read32(offsets::DEVICE_FEATURE);
        self.r.write32(offsets::DEVICE_FEATURE_SELECT, 1);
        let hi = self.r.read32(offsets::DEVICE_FEATURE);
        u64::from(lo) | u64::from(hi) << 32
    }

    /// Writes all 64 driver feature bits.
    pub fn set_driver_features(&self, f: u64) {
        self.r.write32(offsets::DRIVER_FEATURE_SELECT, 0);
        self.r.write32(offsets::DRIVER_FEATURE, f as u32);
        self.r.write32(offsets::DRIVER_FEATURE_SELECT, 1);
        self.r.write32(offsets::DRIVER_FEATURE, (f >> 32) as u32);
    }

    /// Device status.
    pub fn status(&self) -> u8 {
        self.r.read8(offsets::DEVICE_STATUS)
    }

    /// Writes the device status.
    pub fn set_status(&self, s: u8) {
        self.r.write8(offsets::DEVICE_STATUS, s)
    }

    /// Sets status bits (read, or, write).
    pub fn add_status(&self, bits: u8) {
        self.set_status(self.status() | bits)
    }

    /// Number of queues the device has.
    pub fn num_queues(&self) -> u16 {
        self.r.read16(offsets::NUM_QUEUES)
    }

    /// Configuration generation.
    pub fn config_generation(&self) -> u8 {
        self.r.read8(offsets::CONFIG_GENERATION)
    }

    /// Sets the MSI-X vector for configuration changes.
    pub fn set_msix_config(&self, v: u16) {
        self.r.write16(offsets::MSIX_CONFIG, v)
    }

    /// Selects the queue the queue_* accessors refer to.
    pub fn select_queue(&self, q: u16) {
        self.r.write16(offsets::QUEUE_SELECT, q)
    }

    /// Selected queue's size (its maximum until written).
    pub fn queue_size(&self) -> u16 {
        self.r.read16(offsets::QUEUE_SIZE)
    }

    /// Sets the selected queue's size.
    pub fn set_queue_size(&self, n: u16) {
        self.r.write16(offsets::QUEUE_SIZE, n)
    }

    /// Sets the selected queue's MSI-X vector.
    pub fn set_queue_msix_vector(&self, v: u16) {
        self.r.write16(offsets::QUEUE_MSIX_VECTOR, v)
    }

    /// Whether the selected queue is enabled.
    pub fn queue_enable(&self) -> bool {
        self.r.read16(offsets::QUEUE_ENABLE) == 1
    }

    /// Enables the selected queue.
    pub fn enable_queue(&self) {
        self.r.write16(offsets::QUEUE_ENABLE, 1)
    }

    /// Selected queue's notify offset (in multiplier units).
    pub fn queue_notify_off(&self) -> u16 {
        self.r.read16(offsets::QUEUE_NOTIFY_OFF)
    }

    /// Sets the selected queue's ring addresses.
    pub fn set_queue_addrs(&self, desc: u64, driver: u64, device: u64) {
        self.r.write64(offsets::QUEUE_DESC, desc);
        self.r.write64(offsets::QUEUE_DRIVER, driver);
        self.r.write64(offsets::QUEUE_DEVICE, device);
    }

    /// Resets the device: writes status 0 and waits until it reads back 0.
    pub fn reset(&self) -> Result<(), PciError> {
        self.set_status(0);
        let start = Instant::now();
        while self.status() != 0 {
            if start.elapsed() > RESET_TIMEOUT {
                return Err(PciError::ResetTimeout);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Sets FAILED: the driver gave up on the device.
    pub fn fail(&self) {
        self.add_status(STATUS_FAILED)
    }

    /// Steps 1-6 of device initialization: reset, ACKNOWLEDGE, DRIVER, read the device
    /// features, write `device & wanted`, FEATURES_OK, and check the device kept it.
    /// Requires VERSION_1 (a modern device). Returns the negotiated features. On
    /// failure the device is left with FAILED set.
    pub fn negotiate(&self, wanted: u64) -> Result<u64, PciError> {
        self.reset()?;
        self.add_status(STATUS_ACKNOWLEDGE);
        self.add_status(STATUS_DRIVER);
        let offered = self.device_features();
        if offered & features::VERSION_1 == 0 {
            self.fail();
            return Err(PciError::NotModern { offered });
        }
        let f = offered & (wanted | features::VERSION_1);
        self.set_driver_features(f);
        self.add_status(STATUS_FEATURES_OK);
        if self.status() & STATUS_FEATURES_OK == 0 {
            self.fail();
            return Err(PciError::FeaturesRejected { features: f });
        }
        Ok(f)
    }

    /// The largest size queue `q` supports (0: none; also 0 past `num_queues`).
    pub fn queue_max_size(&self, q: u16) -> u16 {
        if q >= self.num_queues() {
            return 0;
        }
        self.select_queue(q);
        self.queue_size()
    }

    /// Step 7 for one queue: select it, check and write its size, no MSI-X vector, the
    /// ring addresses, read its notify offset, enable it. Returns the notify offset
    /// (in multiplier units).
    pub fn setup_queue(&self, q: &QueueSetup) -> Result<u16, PciError> {
        if q.index >= self.num_queues() {
            return Err(PciError::NoSuchQueue(q.index));
        }
        self.select_queue(q.index);
        let max = self.queue_size();
        if max == 0 {
            return Err(PciError::NoSuchQueue(q.index));
        }
        if q.size > max {
            return Err(PciError::QueueTooLarge {
                queue: q.index,
                size: q.size,
                max,
            });
        }
        if self.queue_enable() {
            return Err(PciError::QueueAlreadyEnabled(q.index));
        }
        self.set_queue_size(q.size);
        self.set_queue_msix_vector(VIRTIO_MSI_NO_VECTOR);
        self.set_queue_addrs(q.desc, q.driver, q.device);
        let off = self.queue_notify_off();
        self.enable_queue();
        Ok(off)
    }

    /// Step 8: DRIVER_OK.
    pub fn driver_ok(&self) {
        self.add_status(STATUS_DRIVER_OK)
    }
}

/// Kicks queues through the notify area: writes the queue index (16 bits) at
/// `queue_notify_off * notify_off_multiplier`.
#[derive(Debug, Clone)]
pub struct PciNotifier<M> {
    area: MmioWindow<M>,
    /// Byte offset per queue index (`None`: not set up).
    offs: Vec<Option<usize>>,
}

impl<M: Mmio> PciNotifier<M> {
    /// A notifier over the notify area.
    pub fn new(area: MmioWindow<M>) -> PciNotifier<M> {
        PciNotifier {
            area,
            offs: Vec::new(),
        }
    }

    /// Records queue `q`'s notify offset (`notify_off` units of `multiplier` bytes);
    /// checks it lies inside the area.
    pub fn add_queue(&mut self, q: u16, notify_off: u16, multiplier: u32) -> Result<(), PciError> {
        let off = u64::from(notify_off) * u64::from(multiplier);
        let fits = off + 2 <= self.area.len() as u64;
        if !fits {
            return Err(PciError::NotifyOutOfRange {
                queue: q,
                offset: off,
                len: self.area.len(),
            });
        }
        let i = usize::from(q);
        if self.offs.len() <= i {
            self.offs.resize(i + 1, None);
        }
        self.offs[i] = Some(off as usize);
        Ok(())
    }

    /// Byte offset of queue `q`'s notify register in the area.
    pub fn offset(&self, q: u16) -> Option<usize> {
        self.offs.get(usize::from(q)).copied().flatten()
    }
}

impl<M: Mmio> Notify for PciNotifier<M> {
    fn notify(&self, queue: u16) {
        if let Some(off) = self.offset(queue) {
            self.area.write16(off, queue);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::cell::RefCell;

    /// One register access, as the fake device saw it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum Access {
        R(usize, u32),
        W(usize, u32),
    }

    /// A fake modern virtio-pci device: a common configuration structure with the
    /// register semantics of the spec (selectors, reset, FEATURES_OK check, per-queue
    /// registers), and a log of every access.
    #[derive(Debug)]
    pub(crate) struct FakeDevice {
        pub(crate) st: RefCell<FakeState>,
    }

    #[derive(Debug, Default)]
    pub(crate) struct FakeState {
        pub(crate) log: Vec<Access>,
        pub(crate) offered: u64,
        pub(crate) dfsel: u32,
        pub(crate) drfsel: u32,
        pub(crate) driver: u64,
        pub(crate) status: u8,
        /// Refuse FEATURES_OK.
        pub(crate) refuse: bool,
        pub(crate) qsel: u16,
        pub(crate) queues: Vec<FakeQueue>,
        pub(crate) msix_config: u16,
    }

    #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
    pub(crate) struct FakeQueue {
        pub(crate) max: u16,
        pub(crate) size: u16,
        pub(crate) msix: u16,
        pub(crate) enable: u16,
        pub(crate) notify_off: u16,
        pub(crate) desc: u64,
        pub(crate) driver: u64,
        pub(crate) device: u64,
    }

    impl FakeDevice {
        pub(crate) fn new(offered: u64, max_sizes: &[u16]) -> FakeDevice {
            FakeDevice {
                st: RefCell::new(FakeState {
                    offered,
                    queues: max_sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &m)| FakeQueue {
                            max: m,
                            size: m,
                            notify_off: i as u16,
                            ..FakeQueue::default()
                        })
                        .collect(),
                    ..FakeState::default()
                }),
            }
        }

        fn read(&self, off: usize, width: usize) -> u32 {
            let mut s = self.st.borrow_mut();
            let q = usize::from(s.qsel);
            let qr = s.queues.get(q).copied().unwrap_or_default();
            let v = match (off, width) {
                (offsets::DEVICE_FEATURE_SELECT, 4) => s.dfsel,
                (offsets::DEVICE_FEATURE, 4) => match s.dfsel {
                    0 => s.offered as u32,
                    1 => (s.offered >> 32) as u32,
                    _ => 0,
                },
                (offsets::DRIVER_FEATURE_SELECT, 4) => s.drfsel,
                (offsets::DRIVER_FEATURE, 4) => (s.driver >> (32 * s.drfsel.min(1))) as u32,
                (offsets::MSIX_CONFIG, 2) => u32::from(s.msix_config),
                (offsets::NUM_QUEUES, 2) => s.queues.len() as u32,
                (offsets::DEVICE_STATUS, 1) => u32::from(s.status),
                (offsets::CONFIG_GENERATION, 1) => 0,
                (offsets::QUEUE_SELECT, 2) => u32::from(s.qsel),
                (offsets::QUEUE_SIZE, 2) => u32::from(qr.size),
                (offsets::QUEUE_MSIX_VECTOR, 2) => u32::from(qr.msix),
                (offsets::QUEUE_ENABLE, 2) => u32::from(qr.enable),
                (offsets::QUEUE_NOTIFY_OFF, 2) => u32::from(qr.notify_off),
                _ => panic!("unexpected read at {off:#x} width {width}"),
            };
            s.log.push(Access::R(off, v));
            v
        }

        fn write(&self, off: usize, width: usize, v: u32) {
            let mut s = self.st.borrow_mut();
            s.log.push(Access::W(off, v));
            let q = usize::from(s.qsel);
            let lo = |old: u64, v: u32| (old & !0xFFFF_FFFF) | u64::from(v);
            let hi = |old: u64, v: u32| (old & 0xFFFF_FFFF) | u64::from(v) << 32;
            match (off, width) {
                (offsets::DEVICE_FEATURE_SELECT, 4) => s.dfsel = v,
                (offsets::DRIVER_FEATURE_SELECT, 4) => s.drfsel = v,
                (offsets::DRIVER_FEATURE, 4) => {
                    s.driver = if s.drfsel == 0 {
                        lo(s.driver, v)
                    } else {
                        hi(s.driver, v)
                    }
                }
                (offsets::MSIX_CONFIG, 2) => s.msix_config = v as u16,
                (offsets::DEVICE_STATUS, 1) => {
                    let v = v as u8;
                    if v == 0 {
                        // Reset.
                        s.status = 0;
                        s.driver = 0;
                        for q in &mut s.queues {
                            *q = FakeQueue {
                                size: q.max,
                                max: q.max,
                                notify_off: q.notify_off,
                                ..FakeQueue::default()
                            };
                        }
                    } else if v & STATUS_FEATURES_OK != 0
                        && (s.refuse || s.driver & !s.offered != 0)
                    {
                        s.status = v & !STATUS_FEATURES_OK;
                    } else {
                        s.status = v;
                    }
                }
                (offsets::QUEUE_SELECT, 2) => s.qsel = v as u16,
                _ => {
                    let Some(qr) = s.queues.get_mut(q) else {
                        return;
                    };
                    match (off, width) {
                        (offsets::QUEUE_SIZE, 2) => qr.size = v as u16,
                        (offsets::QUEUE_MSIX_VECTOR, 2) => qr.msix = v as u16,
                        (offsets::QUEUE_ENABLE, 2) => qr.enable = v as u16,
                        (0x20, 4) => qr.desc = lo(qr.desc, v),
                        (0x24, 4) => qr.desc = hi(qr.desc, v),
                        (0x28, 4) => qr.driver = lo(qr.driver, v),
                        (0x2C, 4) => qr.driver = hi(qr.driver, v),
                        (0x30, 4) => qr.device = lo(qr.device, v),
                        (0x34, 4) => qr.device = hi(qr.device, v),
                        _ => panic!("unexpected write at {off:#x} width {width}"),
                    }
                }
            }
        }

        /// The writes, in order.
        pub(crate) fn writes(&self) -> Vec<(usize, u32)> {
            self.st
                .borrow()
                .log
                .iter()
                .filter_map(|a| match a {
                    Access::W(o, v) => Some((*o, *v)),
                    Access::R(..) => None,
                })
                .collect()
        }
    }

    impl Mmio for FakeDevice {
        fn len(&self) -> usize {
            0x38
        }
        fn read8(&self, off: usize) -> u8 {
            self.read(off, 1) as u8
        }
        fn read16(&self, off: usize) -> u16 {
            self.read(off, 2) as u16
        }
        fn read32(&self, off: usize) -> u32 {
            self.read(off, 4)
        }
        fn write8(&self, off: usize, v: u8) {
            self.write(off, 1, v.into())
        }
        fn write16(&self, off: usize, v: u16) {
            self.write(off, 2, v.into())
        }
        fn write32(&self, off: usize, v: u32) {
            self.write(off, 4, v)
        }
    }

    #[test]
    fn offsets_match_the_c_struct() {
        // struct virtio_pci_common_cfg, as in the spec and linux/virtio_pci.h.
        #[repr(C)]
        #[allow(dead_code)]
        struct VirtioPciCommonCfg {
            device_feature_select: u32,
            device_feature: u32,
            guest_feature_select: u32,
            guest_feature: u32,
            msix_config: u16,
            num_queues: u16,
            device_status: u8,
            config_generation: u8,
            queue_select: u16,
            queue_size: u16,
            queue_msix_vector: u16,
            queue_enable: u16,
            queue_notify_off: u16,
            queue_desc_lo: u32,
            queue_desc_hi: u32,
            queue_avail_lo: u32,
            queue_avail_hi: u32,
            queue_used_lo: u32,
            queue_used_hi: u32,
        }
        use core::mem::offset_of;
        type C = VirtioPciCommonCfg;
        assert_eq!(
            offset_of!(C, device_feature_select),
            offsets::DEVICE_FEATURE_SELECT
        );
        assert_eq!(offset_of!(C, device_feature), offsets::DEVICE_FEATURE);
        assert_eq!(
            offset_of!(C, guest_feature_select),
            offsets::DRIVER_FEATURE_SELECT
        );
        assert_eq!(offset_of!(C, guest_feature), offsets::DRIVER_FEATURE);
        assert_eq!(offset_of!(C, msix_config), offsets::MSIX_CONFIG);
        assert_eq!(offset_of!(C, num_queues), offsets::NUM_QUEUES);
        assert_eq!(offset_of!(C, device_status), offsets::DEVICE_STATUS);
        assert_eq!(offset_of!(C, config_generation), offsets::CONFIG_GENERATION);
        assert_eq!(offset_of!(C, queue_select), offsets::QUEUE_SELECT);
        assert_eq!(offset_of!(C, queue_size), offsets::QUEUE_SIZE);
        assert_eq!(offset_of!(C, queue_msix_vector), offsets::QUEUE_MSIX_VECTOR);
        assert_eq!(offset_of!(C, queue_enable), offsets::QUEUE_ENABLE);
        assert_eq!(offset_of!(C, queue_notify_off), offsets::QUEUE_NOTIFY_OFF);
        assert_eq!(offset_of!(C, queue_desc_lo), offsets::QUEUE_DESC);
        assert_eq!(offset_of!(C, queue_avail_lo), offsets::QUEUE_DRIVER);
        assert_eq!(offset_of!(C, queue_used_lo), offsets::QUEUE_DEVICE);
        assert_eq!(core::mem::size_of::<C>(), 0x38);
        use virtio_bindings::virtio_config as vc;
        assert_eq!(
            u32::from(STATUS_ACKNOWLEDGE),
            vc::VIRTIO_CONFIG_S_ACKNOWLEDGE
        );
        assert_eq!(u32::from(STATUS_DRIVER), vc::VIRTIO_CONFIG_S_DRIVER);
        assert_eq!(u32::from(STATUS_DRIVER_OK), vc::VIRTIO_CONFIG_S_DRIVER_OK);
        assert_eq!(
            u32::from(STATUS_FEATURES_OK),
            vc::VIRTIO_CONFIG_S_FEATURES_OK
        );
        assert_eq!(
            u32::from(STATUS_DEVICE_NEEDS_RESET),
            vc::VIRTIO_CONFIG_S_NEEDS_RESET
        );
        assert_eq!(u32::from(STATUS_FAILED), vc::VIRTIO_CONFIG_S_FAILED);
    }

    const Q0: QueueSetup = QueueSetup {
        index: 0,
        size: 256,
        desc: 0x1_2345_6000,
        driver: 0x1_2345_7000,
        device: 0x1_2345_8000,
    };

    #[test]
    fn init_sequence_writes_in_spec_order() {
        use offsets::*;
        let dev = FakeDevice::new(features::PVCM | 1 << 0 | 1 << 40, &[1024, 1024]);
        let cc = CommonCfg::new(&dev).expect("len");
        let f = cc.negotiate(features::PVCM).expect("negotiate");
        assert_eq!(f, features::PVCM);
        let q1 = QueueSetup {
            index: 1,
            size: 64,
            desc: 0x9000,
            driver: 0xA000,
            device: 0xB000,
        };
        assert_eq!(cc.setup_queue(&Q0).ok(), Some(0));
        assert_eq!(cc.setup_queue(&q1).ok(), Some(1));
        cc.driver_ok();
        let pvcm = features::PVCM;
        let want: Vec<(usize, u32)> = vec![
            (DEVICE_STATUS, 0),
            (DEVICE_STATUS, 1),
            (DEVICE_STATUS, 3),
            (DEVICE_FEATURE_SELECT, 0),
            (DEVICE_FEATURE_SELECT, 1),
            (DRIVER_FEATURE_SELECT, 0),
            (DRIVER_FEATURE, pvcm as u32),
            (DRIVER_FEATURE_SELECT, 1),
            (DRIVER_FEATURE, (pvcm >> 32) as u32),
            (DEVICE_STATUS, 11),
            (QUEUE_SELECT, 0),
            (QUEUE_SIZE, 256),
            (QUEUE_MSIX_VECTOR, 0xFFFF),
            (0x20, 0x2345_6000),
            (0x24, 1),
            (0x28, 0x2345_7000),
            (0x2C, 1),
            (0x30, 0x2345_8000),
            (0x34, 1),
            (QUEUE_ENABLE, 1),
            (QUEUE_SELECT, 1),
            (QUEUE_SIZE, 64),
            (QUEUE_MSIX_VECTOR, 0xFFFF),
            (0x20, 0x9000),
            (0x24, 0),
            (0x28, 0xA000),
            (0x2C, 0),
            (0x30, 0xB000),
            (0x34, 0),
            (QUEUE_ENABLE, 1),
            (DEVICE_STATUS, 15),
        ];
        assert_eq!(dev.writes(), want);
        let s = dev.st.borrow();
        assert_eq!(s.status, 15);
        assert_eq!(s.driver, pvcm);
        assert_eq!(s.queues[0].desc, Q0.desc);
        assert_eq!(s.queues[0].driver, Q0.driver);
        assert_eq!(s.queues[0].device, Q0.device);
        assert_eq!(s.queues[1].size, 64);
        assert_eq!(s.queues[1].enable, 1);
        // Reads: status is read back after FEATURES_OK (the check), device features
        // after each select.
        let reads = s
            .log
            .iter()
            .filter(|a| matches!(a, Access::R(DEVICE_FEATURE, _)))
            .count();
        assert_eq!(reads, 2);
    }

    #[test]
    fn negotiation_takes_the_intersection() {
        // A device without INDIRECT_DESC (like a minimal vhost-user backend).
        let dev = FakeDevice::new(features::VERSION_1 | features::EVENT_IDX, &[256]);
        let cc = CommonCfg::new(&dev).expect("len");
        let f = cc.negotiate(features::PVCM).expect("negotiate");
        assert_eq!(f, features::VERSION_1 | features::EVENT_IDX);
        // The driver asked for nothing but gets VERSION_1 (required).
        let f = cc.negotiate(0).expect("negotiate");
        assert_eq!(f, features::VERSION_1);
    }

    #[test]
    fn negotiation_failures_set_failed() {
        let dev = FakeDevice::new(features::EVENT_IDX, &[256]);
        let cc = CommonCfg::new(&dev).expect("len");
        assert!(matches!(
            cc.negotiate(features::PVCM),
            Err(PciError::NotModern { .. })
        ));
        assert_eq!(dev.st.borrow().status & STATUS_FAILED, STATUS_FAILED);

        let dev = FakeDevice::new(features::PVCM, &[256]);
        dev.st.borrow_mut().refuse = true;
        let cc = CommonCfg::new(&dev).expect("len");
        assert!(matches!(
            cc.negotiate(features::PVCM),
            Err(PciError::FeaturesRejected { .. })
        ));
        let st = dev.st.borrow().status;
        assert_eq!(st & STATUS_FAILED, STATUS_FAILED);
        assert_eq!(st & STATUS_FEATURES_OK, 0);
        assert_eq!(dev.writes().last(), Some(&(offsets::DEVICE_STATUS, 0x83)));
    }

    #[test]
    fn queue_setup_checks() {
        let dev = FakeDevice::new(features::PVCM, &[128, 0]);
        let cc = CommonCfg::new(&dev).expect("len");
        cc.negotiate(features::PVCM).expect("negotiate");
        assert_eq!(cc.num_queues(), 2);
        assert_eq!(cc.queue_max_size(0), 128);
        assert_eq!(cc.queue_max_size(1), 0);
        assert_eq!(cc.queue_max_size(7), 0);
        assert!(matches!(
            cc.setup_queue(&Q0),
            Err(PciError::QueueTooLarge {
                queue: 0,
                size: 256,
                max: 128
            })
        ));
        let q = QueueSetup { size: 128, ..Q0 };
        assert!(cc.setup_queue(&q).is_ok());
        assert!(matches!(
            cc.setup_queue(&q),
            Err(PciError::QueueAlreadyEnabled(0))
        ));
        assert!(matches!(
            cc.setup_queue(&QueueSetup { index: 1, ..q }),
            Err(PciError::NoSuchQueue(1))
        ));
        assert!(matches!(
            cc.setup_queue(&QueueSetup { index: 2, ..q }),
            Err(PciError::NoSuchQueue(2))
        ));
        // Reset clears the queues.
        cc.reset().expect("reset");
        cc.select_queue(0);
        assert!(!cc.queue_enable());
        assert_eq!(cc.queue_size(), 128);
    }

    /// A plain register file (for notify areas).
    #[derive(Debug, Default)]
    pub(crate) struct RegFile {
        pub(crate) bytes: RefCell<Vec<u8>>,
        pub(crate) writes: RefCell<Vec<(usize, u32)>>,
    }

    impl RegFile {
        pub(crate) fn new(len: usize) -> RegFile {
            RegFile {
                bytes: RefCell::new(vec![0; len]),
                writes: RefCell::new(Vec::new()),
            }
        }
        fn rd(&self, off: usize, n: usize) -> u32 {
            let b = self.bytes.borrow();
            let mut v = [0u8; 4];
            v[..n].copy_from_slice(&b[off..off + n]);
            u32::from_le_bytes(v)
        }
        fn wr(&self, off: usize, n: usize, v: u32) {
            self.bytes.borrow_mut()[off..off + n].copy_from_slice(&v.to_le_bytes()[..n]);
            self.writes.borrow_mut().push((off, v));
        }
    }

    impl Mmio for RegFile {
        fn len(&self) -> usize {
            self.bytes.borrow().len()
        }
        fn read8(&self, off: usize) -> u8 {
            self.rd(off, 1) as u8
        }
        fn read16(&self, off: usize) -> u16 {
            self.rd(off, 2) as u16
        }
        fn read32(&self, off: usize) -> u32 {
            self.rd(off, 4)
        }
        fn write8(&self, off: usize, v: u8) {
            self.wr(off, 1, v.into())
        }
        fn write16(&self, off: usize, v: u16) {
            self.wr(off, 2, v.into())
        }
        fn write32(&self, off: usize, v: u32) {
            self.wr(off, 4, v)
        }
    }

    #[test]
    fn notifier_writes_queue_index_at_scaled_offset() {
        let bar = RegFile::new(0x4000);
        let area = MmioWindow::new(&bar, 0x3000, 0x1000).expect("window");
        let mut n = PciNotifier::new(area);
        n.add_queue(0, 0, 4).expect("q0");
        n.add_queue(1, 1, 4).expect("q1");
        n.add_queue(5, 0x3FF, 4).expect("q5 at the end");
        assert!(matches!(
            n.add_queue(6, 0x400, 4),
            Err(PciError::NotifyOutOfRange { .. })
        ));
        n.notify(1);
        n.notify(0);
        n.notify(5);
        n.notify(3); // not set up: ignored
        assert_eq!(
            *bar.writes.borrow(),
            vec![(0x3004, 1), (0x3000, 0), (0x3FFC, 5)]
        );
        // Multiplier 0: every queue shares one register.
        let mut n = PciNotifier::new(MmioWindow::new(&bar, 0x3000, 2).expect("window"));
        n.add_queue(0, 0, 0).expect("q0");
        n.add_queue(1, 7, 0).expect("q1");
        assert_eq!(n.offset(1), Some(0));
    }

    #[test]
    fn windows_bound_accesses() {
        let bar = RegFile::new(0x100);
        assert!(MmioWindow::new(&bar, 0xF0, 0x20).is_none());
        let w = MmioWindow::new(&bar, 0x10, 0x8).expect("window");
        w.write32(4, 0xAABB_CCDD);
        assert_eq!(bar.read32(0x14), 0xAABB_CCDD);
        assert_eq!(w.read16(6), 0xAABB);
        // Outside the window: all ones, writes dropped.
        assert_eq!(w.read32(6), !0);
        w.write32(8, 1);
        assert_eq!(bar.writes.borrow().len(), 1);
        assert!(CommonCfg::new(&w).is_err());
    }
}

//! PCI configuration space: the header fields a driver needs and the virtio vendor
//! capabilities (virtio spec 4.1.4).

use super::PciError;

/// Offset of the vendor ID (u16).
pub const PCI_VENDOR_ID: usize = 0x00;
/// Offset of the device ID (u16).
pub const PCI_DEVICE_ID: usize = 0x02;
/// Offset of the command register (u16).
pub const PCI_COMMAND: usize = 0x04;
/// Offset of the status register (u16).
pub const PCI_STATUS: usize = 0x06;
/// Offset of the capabilities pointer (u8).
pub const PCI_CAPABILITY_LIST: usize = 0x34;
/// Command bit: respond to memory-space accesses.
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command bit: bus master (the device may DMA).
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Status bit: the capability list is present.
pub const PCI_STATUS_CAP_LIST: u16 = 1 << 4;
/// Capability ID of a vendor-specific capability (what virtio uses).
pub const PCI_CAP_ID_VNDR: u8 = 0x09;
/// Bytes of the standard header; capabilities start after it.
pub const PCI_STD_HEADER_LEN: usize = 0x40;
/// Capabilities live in the first 256 bytes (the rest is PCIe extended space).
pub const PCI_CFG_SPACE_LEN: usize = 256;

/// `cfg_type`: common configuration.
pub const VIRTIO_PCI_CAP_COMMON_CFG: u8 = 1;
/// `cfg_type`: notifications.
pub const VIRTIO_PCI_CAP_NOTIFY_CFG: u8 = 2;
/// `cfg_type`: ISR status.
pub const VIRTIO_PCI_CAP_ISR_CFG: u8 = 3;
/// `cfg_type`: device-specific configuration.
pub const VIRTIO_PCI_CAP_DEVICE_CFG: u8 = 4;
/// `cfg_type`: PCI configuration access window.
pub const VIRTIO_PCI_CAP_PCI_CFG: u8 = 5;

/// Length of `struct virtio_pci_cap`.
pub const VIRTIO_PCI_CAP_LEN: usize = 16;
/// Length of `struct virtio_pci_notify_cap` (cap + `notify_off_multiplier`).
pub const VIRTIO_PCI_NOTIFY_CAP_LEN: usize = 20;

/// Where a virtio structure lives: `length` bytes at `offset` in BAR `bar`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapRegion {
    /// BAR number (0..=5).
    pub bar: u8,
    /// Offset in the BAR.
    pub offset: u32,
    /// Length.
    pub length: u32,
}

/// One virtio vendor capability as found in the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCap {
    /// Its offset in config space.
    pub at: u8,
    /// `cfg_type`.
    pub cfg_type: u8,
    /// Where the structure lives.
    pub region: CapRegion,
    /// `id` (for shared-memory capabilities; 0 otherwise).
    pub id: u8,
    /// `notify_off_multiplier` of a notify capability.
    pub notify_off_multiplier: Option<u32>,
}

/// The structures a modern virtio-pci driver uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCaps {
    /// Common configuration (required).
    pub common: CapRegion,
    /// Notification area (required).
    pub notify: CapRegion,
    /// Queue `q`'s notify address is `notify.offset + queue_notify_off(q) * this`.
    pub notify_off_multiplier: u32,
    /// ISR status.
    pub isr: Option<CapRegion>,
    /// Device-specific configuration.
    pub device: Option<CapRegion>,
}

fn le16(cfg: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([cfg[at], cfg[at + 1]])
}

fn le32(cfg: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([cfg[at], cfg[at + 1], cfg[at + 2], cfg[at + 3]])
}

/// Vendor and device ID from a config-space image.
pub fn ids(cfg: &[u8]) -> Result<(u16, u16), PciError> {
    if cfg.len() < 4 {
        return Err(PciError::ConfigTooShort(cfg.len()));
    }
    Ok((le16(cfg, PCI_VENDOR_ID), le16(cfg, PCI_DEVICE_ID)))
}

/// Every virtio vendor capability in the list of a config-space image (256 or 4096
/// bytes; at least the 64-byte header and whatever the list points into), in list
/// order. Capabilities naming a reserved BAR (> 5) are skipped, as the spec requires.
pub fn virtio_caps(cfg: &[u8]) -> Result<Vec<VirtioCap>, PciError> {
    if cfg.len() < PCI_STD_HEADER_LEN {
        return Err(PciError::ConfigTooShort(cfg.len()));
    }
    if le16(cfg, PCI_STATUS) & PCI_STATUS_CAP_LIST == 0 {
        return Err(PciError::NoCapabilities);
    }
    let end = cfg.len().min(PCI_CFG_SPACE_LEN);
    let mut out = Vec::new();
    let mut ptr = usize::from(cfg[PCI_CAPABILITY_LIST] & 0xFC);
    // A list in 192 bytes has at most 48 entries; more means a loop.
    let mut budget = (PCI_CFG_SPACE_LEN - PCI_STD_HEADER_LEN) / 4;
    while ptr != 0 {
        if budget == 0 {
            return Err(PciError::CapLoop);
        }
        budget -= 1;
        if ptr < PCI_STD_HEADER_LEN || ptr + 2 > end {
            return Err(PciError::BadCapPointer(ptr));
        }
        let id = cfg[ptr];
        let next = usize::from(cfg[ptr + 1] & 0xFC);
        if id == PCI_CAP_ID_VNDR {
            if ptr + 3 > end {
                return Err(PciError::BadCapPointer(ptr));
            }
            let cap_len = usize::from(cfg[ptr + 2]);
            if cap_len < VIRTIO_PCI_CAP_LEN || ptr + cap_len > end {
                return Err(PciError::BadCap {
                    at: ptr,
                    why: "virtio capability shorter than 16 bytes or past the config space",
                });
            }
            let cfg_type = cfg[ptr + 3];
            let bar = cfg[ptr + 4];
            let notify_off_multiplier = if cfg_type == VIRTIO_PCI_CAP_NOTIFY_CFG {
                if cap_len < VIRTIO_PCI_NOTIFY_CAP_LEN {
                    return Err(PciError::BadCap {
                        at: ptr,
                        why: "notify capability shorter than 20 bytes",
                    });
                }
                Some(le32(cfg, ptr + 16))
            } else {
                None
            };
            if bar <= 5 {
                out.push(VirtioCap {
                    at: ptr as u8,
                    cfg_type,
                    region: CapRegion {
                        bar,
                        offset: le32(cfg, ptr + 8),
                        length: le32(cfg, ptr + 12),
                    },
                    id: cfg[ptr + 5],
                    notify_off_multiplier,
                });
            }
        }
        ptr = next;
    }
    Ok(out)
}

/// Minimum length of the common configuration structure (up to `queue_device`).
pub const COMMON_CFG_MIN_LEN: u32 = 0x38;

/// The structures a driver uses: the first capability of each type, per the spec's
/// "the driver SHOULD use the first one it can support". Requires common and notify
/// configuration of sufficient length.
pub fn parse_virtio_caps(cfg: &[u8]) -> Result<VirtioCaps, PciError> {
    let caps = virtio_caps(cfg)?;
    let first = |t: u8| caps.iter().find(|c| c.cfg_type == t);
    let common = first(VIRTIO_PCI_CAP_COMMON_CFG).ok_or(PciError::MissingCap("common"))?;
    if common.region.length < COMMON_CFG_MIN_LEN {
        return Err(PciError::BadCap {
            at: usize::from(common.at),
            why: "common configuration shorter than 0x38 bytes",
        });
    }
    let notify = first(VIRTIO_PCI_CAP_NOTIFY_CFG).ok_or(PciError::MissingCap("notify"))?;
    if notify.region.length < 2 {
        return Err(PciError::BadCap {
            at: usize::from(notify.at),
            why: "notify area shorter than 2 bytes",
        });
    }
    Ok(VirtioCaps {
        common: common.region,
        notify: notify.region,
        notify_off_multiplier: notify.notify_off_multiplier.unwrap_or(0),
        isr: first(VIRTIO_PCI_CAP_ISR_CFG).map(|c| c.region),
        device: first(VIRTIO_PCI_CAP_DEVICE_CFG).map(|c| c.region),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a config-space image: header with the IDs, then the given capabilities
    /// (each a full byte string, `next` filled in) from 0x40 on, 4-aligned.
    pub(crate) fn image(vendor: u16, device: u16, caps: &[Vec<u8>], len: usize) -> Vec<u8> {
        let mut c = vec![0u8; len];
        c[0..2].copy_from_slice(&vendor.to_le_bytes());
        c[2..4].copy_from_slice(&device.to_le_bytes());
        c[6..8].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
        let mut at = 0x40usize;
        let mut prev_next = PCI_CAPABILITY_LIST;
        for cap in caps {
            c[prev_next] = at as u8;
            c[at..at + cap.len()].copy_from_slice(cap);
            prev_next = at + 1;
            c[prev_next] = 0;
            at = (at + cap.len()).next_multiple_of(4);
        }
        c
    }

    /// A `virtio_pci_cap` (or notify cap with `mult`).
    pub(crate) fn vcap(
        cfg_type: u8,
        bar: u8,
        offset: u32,
        length: u32,
        mult: Option<u32>,
    ) -> Vec<u8> {
        let len = if mult.is_some() { 20 } else { 16 };
        let mut v = vec![PCI_CAP_ID_VNDR, 0, len as u8, cfg_type, bar, 0, 0, 0];
        v.extend(offset.to_le_bytes());
        v.extend(length.to_le_bytes());
        if let Some(m) = mult {
            v.extend(m.to_le_bytes());
        }
        v
    }

    /// What QEMU's virtio-pci (modern) offers: an MSI-X capability first, then the
    /// virtio structures in BAR 4.
    pub(crate) fn qemu_like(len: usize) -> Vec<u8> {
        let msix = vec![0x11, 0, 0x02, 0x00, 0x01, 0, 0, 0, 0x01, 0x08, 0, 0];
        image(
            0x1af4,
            0x107f,
            &[
                msix,
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 4, 0x0000, 0x1000, None),
                vcap(VIRTIO_PCI_CAP_ISR_CFG, 4, 0x1000, 0x1000, None),
                vcap(VIRTIO_PCI_CAP_DEVICE_CFG, 4, 0x2000, 0x1000, None),
                vcap(VIRTIO_PCI_CAP_NOTIFY_CFG, 4, 0x3000, 0x1000, Some(4)),
                vcap(VIRTIO_PCI_CAP_PCI_CFG, 0, 0, 0, None),
            ],
            len,
        )
    }

    #[test]
    fn parses_qemu_like_layout_256_and_4096() {
        for len in [256, 4096] {
            let cfg = qemu_like(len);
            assert_eq!(ids(&cfg).ok(), Some((0x1af4, 0x107f)));
            let all = virtio_caps(&cfg).expect("caps");
            assert_eq!(all.len(), 5);
            let c = parse_virtio_caps(&cfg).expect("parse");
            assert_eq!(
                c.common,
                CapRegion {
                    bar: 4,
                    offset: 0,
                    length: 0x1000
                }
            );
            assert_eq!(c.notify.offset, 0x3000);
            assert_eq!(c.notify_off_multiplier, 4);
            assert_eq!(c.isr.map(|r| r.offset), Some(0x1000));
            assert_eq!(c.device.map(|r| r.offset), Some(0x2000));
        }
    }

    #[test]
    fn first_of_each_type_wins_and_reserved_bars_are_skipped() {
        let cfg = image(
            0x1af4,
            0x1069,
            &[
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 7, 0, 0x100, None),
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 2, 0x100, 0x40, None),
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 3, 0x200, 0x40, None),
                vcap(VIRTIO_PCI_CAP_NOTIFY_CFG, 2, 0x400, 0x100, Some(0)),
            ],
            256,
        );
        let c = parse_virtio_caps(&cfg).expect("parse");
        assert_eq!(c.common.bar, 2);
        assert_eq!(c.common.offset, 0x100);
        assert_eq!(c.notify_off_multiplier, 0);
        assert_eq!(c.isr, None);
    }

    #[test]
    fn malformed_lists() {
        // No capability list.
        let mut cfg = qemu_like(256);
        cfg[6] = 0;
        assert!(matches!(virtio_caps(&cfg), Err(PciError::NoCapabilities)));
        // Too short for the header (non-root sysfs reads give 64 bytes; the list
        // points past them).
        assert!(matches!(
            virtio_caps(&cfg[..32]),
            Err(PciError::ConfigTooShort(32))
        ));
        let cfg = qemu_like(256);
        assert!(matches!(
            virtio_caps(&cfg[..64]),
            Err(PciError::BadCapPointer(0x40))
        ));
        // A pointer into the header.
        let mut cfg = qemu_like(256);
        cfg[PCI_CAPABILITY_LIST] = 0x20;
        assert!(matches!(
            virtio_caps(&cfg),
            Err(PciError::BadCapPointer(0x20))
        ));
        // A loop.
        let mut cfg = qemu_like(256);
        cfg[0x41] = 0x40;
        assert!(matches!(virtio_caps(&cfg), Err(PciError::CapLoop)));
        // A short virtio cap.
        let mut cfg = qemu_like(256);
        let at = usize::from(cfg[0x41]);
        cfg[at + 2] = 8;
        assert!(matches!(virtio_caps(&cfg), Err(PciError::BadCap { .. })));
        // A notify cap without the multiplier.
        let cfg = image(
            0x1af4,
            0x107f,
            &[
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 0, 0, 0x38, None),
                vcap(VIRTIO_PCI_CAP_NOTIFY_CFG, 0, 0x100, 4, None),
            ],
            256,
        );
        assert!(matches!(virtio_caps(&cfg), Err(PciError::BadCap { .. })));
        // Missing or short structures.
        let cfg = image(
            0x1af4,
            0x107f,
            &[vcap(VIRTIO_PCI_CAP_COMMON_CFG, 0, 0, 0x38, None)],
            256,
        );
        assert!(matches!(
            parse_virtio_caps(&cfg),
            Err(PciError::MissingCap("notify"))
        ));
        let cfg = image(
            0x1af4,
            0x107f,
            &[
                vcap(VIRTIO_PCI_CAP_COMMON_CFG, 0, 0, 0x30, None),
                vcap(VIRTIO_PCI_CAP_NOTIFY_CFG, 0, 0x100, 4, Some(2)),
            ],
            256,
        );
        assert!(matches!(
            parse_virtio_caps(&cfg),
            Err(PciError::BadCap { .. })
        ));
        // A cap running past 256 bytes.
        let mut cfg = qemu_like(256);
        cfg[PCI_CAPABILITY_LIST] = 0xF8;
        cfg[0xF8] = PCI_CAP_ID_VNDR;
        cfg[0xF9] = 0;
        cfg[0xFA] = 16;
        assert!(matches!(virtio_caps(&cfg), Err(PciError::BadCap { .. })));
    }
}

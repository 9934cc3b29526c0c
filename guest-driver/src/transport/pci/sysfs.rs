//! Finding and preparing a PCI function through sysfs: IDs, config space, driver
//! unbinding, bus mastering, BAR resources and mapping them.
//!
//! Every path is relative to a sysfs root given by the caller (`/sys` in a VM; a
//! temporary directory tree in tests).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use super::PciError;
use super::caps::{PCI_COMMAND, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY};
use super::mmio::Mmio;

/// PCI vendor ID of virtio devices.
pub const VIRTIO_PCI_VENDOR: u16 = 0x1af4;
/// PCI device ID of modern virtio device 0 (add the virtio device ID).
pub const VIRTIO_PCI_MODERN_DEVICE_BASE: u16 = 0x1040;

/// `IORESOURCE_IO` in a `resource` line's flags.
pub const IORESOURCE_IO: u64 = 0x100;
/// `IORESOURCE_MEM` in a `resource` line's flags.
pub const IORESOURCE_MEM: u64 = 0x200;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PciError {
    let what = what.into();
    move |source| PciError::Io { what, source }
}

/// Parses a sysfs ID file (`0x1af4\n`).
pub fn parse_hex_u16(s: &str) -> Option<u16> {
    let s = s.trim();
    u16::from_str_radix(s.strip_prefix("0x").unwrap_or(s), 16).ok()
}

/// One line of a sysfs `resource` file: a BAR (lines 0-5), the ROM (6), or bridge
/// windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    /// First address.
    pub start: u64,
    /// Last address (inclusive).
    pub end: u64,
    /// `IORESOURCE_*` flags.
    pub flags: u64,
}

impl Resource {
    /// Length (0 for an unused BAR).
    pub fn len(&self) -> u64 {
        if self.start == 0 && self.end == 0 {
            0
        } else {
            self.end.wrapping_sub(self.start).wrapping_add(1)
        }
    }

    /// Whether the BAR is unused.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Memory BAR.
    pub fn is_mem(&self) -> bool {
        self.flags & IORESOURCE_MEM != 0
    }

    /// I/O-port BAR.
    pub fn is_io(&self) -> bool {
        self.flags & IORESOURCE_IO != 0
    }
}

/// Parses a sysfs `resource` file: lines of three hex numbers (start, end, flags).
pub fn parse_resources(text: &str) -> Result<Vec<Resource>, PciError> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Vec<u64> = l
                .split_whitespace()
                .map(|w| u64::from_str_radix(w.strip_prefix("0x").unwrap_or(w), 16))
                .collect::<Result<_, _>>()
                .map_err(|_| PciError::Parse(format!("resource line {l:?}")))?;
            match v[..] {
                [start, end, flags] => Ok(Resource { start, end, flags }),
                _ => Err(PciError::Parse(format!("resource line {l:?}"))),
            }
        })
        .collect()
}

/// A PCI function under `<sysfs>/bus/pci/devices/<bdf>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciFunction {
    path: PathBuf,
    bdf: String,
}

/// The PCI functions whose vendor is virtio's and whose device ID is the modern one
/// for `virtio_id` (0x1040 + ID), sorted by address.
pub fn find_virtio_pci(sysfs_root: &Path, virtio_id: u16) -> Result<Vec<PciFunction>, PciError> {
    let want = VIRTIO_PCI_MODERN_DEVICE_BASE
        .checked_add(virtio_id)
        .ok_or(PciError::Parse(format!("virtio id {virtio_id}")))?;
    let dir = sysfs_root.join("bus/pci/devices");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).map_err(io(format!("listing {}", dir.display())))? {
        let e = e.map_err(io(format!("listing {}", dir.display())))?;
        let f = PciFunction::at(sysfs_root, &e.file_name().to_string_lossy());
        // Entries without readable IDs are not PCI functions we can use.
        if f.ids().ok() == Some((VIRTIO_PCI_VENDOR, want)) {
            out.push(f);
        }
    }
    out.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    Ok(out)
}

impl PciFunction {
    /// The function `bdf` (e.g. `0000:00:04.0`) under `sysfs_root`.
    pub fn at(sysfs_root: &Path, bdf: &str) -> PciFunction {
        PciFunction {
            path: sysfs_root.join("bus/pci/devices").join(bdf),
            bdf: bdf.to_string(),
        }
    }

    /// Its sysfs directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its address (domain:bus:device.function).
    pub fn bdf(&self) -> &str {
        &self.bdf
    }

    fn read_str(&self, name: &str) -> Result<String, PciError> {
        let p = self.path.join(name);
        std::fs::read_to_string(&p).map_err(io(format!("reading {}", p.display())))
    }

    /// Vendor and device ID (from the `vendor` and `device` files).
    pub fn ids(&self) -> Result<(u16, u16), PciError> {
        let id = |name: &str| {
            let s = self.read_str(name)?;
            parse_hex_u16(&s).ok_or(PciError::Parse(format!("{name} {s:?}")))
        };
        Ok((id("vendor")?, id("device")?))
    }

    /// The config space as sysfs gives it (256 or 4096 bytes as root; only the
    /// 64-byte header otherwise, which has no capabilities).
    pub fn config(&self) -> Result<Vec<u8>, PciError> {
        let p = self.path.join("config");
        std::fs::read(&p).map_err(io(format!("reading {}", p.display())))
    }

    /// The name of the bound kernel driver, if any.
    pub fn driver(&self) -> Option<String> {
        let link = std::fs::read_link(self.path.join("driver")).ok()?;
        Some(link.file_name()?.to_string_lossy().into_owned())
    }

    /// Unbinds the kernel driver (writes the address to `driver/unbind`); returns its
    /// name, or `None` if none was bound.
    pub fn unbind_driver(&self) -> Result<Option<String>, PciError> {
        let Some(name) = self.driver() else {
            return Ok(None);
        };
        let p = self.path.join("driver/unbind");
        std::fs::write(&p, &self.bdf).map_err(io(format!("writing {}", p.display())))?;
        Ok(Some(name))
    }

    /// Sets memory-space enable and bus master (command register bits 1 and 2) in config
    /// space, so the device decodes its BARs and may DMA into guest memory.
    pub fn enable_bus_master(&self) -> Result<(), PciError> {
        let p = self.path.join("config");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .map_err(io(format!("opening {}", p.display())))?;
        let mut b = [0u8; 2];
        f.read_exact_at(&mut b, PCI_COMMAND as u64)
            .map_err(io("reading the command register"))?;
        let cmd = u16::from_le_bytes(b) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        f.write_all_at(&cmd.to_le_bytes(), PCI_COMMAND as u64)
            .map_err(io("writing the command register"))
    }

    /// The `resource` file: BARs 0-5 first.
    pub fn resources(&self) -> Result<Vec<Resource>, PciError> {
        parse_resources(&self.read_str("resource")?)
    }

    /// Maps memory BAR `bar` from `resource<bar>` (shared, read-write).
    pub fn map_bar(&self, bar: u8) -> Result<MmapBar, PciError> {
        let res = self.resources()?;
        let r = res
            .get(usize::from(bar))
            .filter(|r| bar <= 5 && r.is_mem() && !r.is_empty())
            .ok_or(PciError::NotMemoryBar(bar))?;
        let len = usize::try_from(r.len()).map_err(|_| PciError::NotMemoryBar(bar))?;
        let p = self.path.join(format!("resource{bar}"));
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_SYNC | libc::O_CLOEXEC)
            .open(&p)
            .map_err(io(format!("opening {}", p.display())))?;
        let flen = f
            .metadata()
            .map_err(io(format!("stat {}", p.display())))?
            .len();
        if flen < len as u64 {
            return Err(PciError::Parse(format!(
                "{} is {flen} bytes, BAR {bar} is {len}",
                p.display()
            )));
        }
        MmapBar::map(&f, len).map_err(io(format!("mmap {}", p.display())))
    }
}

/// A BAR mapped from sysfs (or any file): volatile register access.
#[derive(Debug)]
pub struct MmapBar {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is process-wide memory owned by this value until drop; all
// accesses are volatile reads and writes of plain integers, which any thread may do.
unsafe impl Send for MmapBar {}
// SAFETY: as above; `&MmapBar` only allows volatile register accesses, which the
// device serializes.
unsafe impl Sync for MmapBar {}

impl MmapBar {
    /// Maps `len` bytes of `f` from offset 0, shared and read-write.
    pub fn map(f: &File, len: usize) -> std::io::Result<MmapBar> {
        if len == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of a file we hold
        // open; no existing Rust object is affected. The result is checked below.
        let p = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(std::io::ErrorKind::InvalidData)?;
        Ok(MmapBar { ptr, len })
    }

    /// Host pointer to the mapping's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn at(&self, off: usize, width: usize) -> Option<*mut u8> {
        let ok = off.checked_add(width)? <= self.len && off % width == 0;
        // SAFETY: `off + width <= len`, inside the mapping.
        ok.then(|| unsafe { self.ptr.as_ptr().add(off) })
    }
}

impl Drop for MmapBar {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`; no references into it
        // outlive `self` (accesses go through `&self` methods only).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

macro_rules! mmio_rw {
    ($read:ident, $write:ident, $t:ty) => {
        fn $read(&self, off: usize) -> $t {
            match self.at(off, size_of::<$t>()) {
                // SAFETY: in bounds and naturally aligned (checked by `at`); the
                // mapping is live while `self` is.
                Some(p) => <$t>::from_le(unsafe { p.cast::<$t>().read_volatile() }),
                None => !0,
            }
        }
        fn $write(&self, off: usize, v: $t) {
            if let Some(p) = self.at(off, size_of::<$t>()) {
                // SAFETY: in bounds and naturally aligned (checked by `at`); the
                // mapping is live while `self` is.
                unsafe { p.cast::<$t>().write_volatile(v.to_le()) }
            }
        }
    };
}

impl Mmio for MmapBar {
    fn len(&self) -> usize {
        self.len
    }
    mmio_rw!(read8, write8, u8);
    mmio_rw!(read16, write16, u16);
    mmio_rw!(read32, write32, u32);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::transport::pci::caps::tests::qemu_like;

    /// Builds `<root>/bus/pci/devices/<bdf>/{vendor,device,config,resource,resource4}`
    /// and, if `driver` is given, a `driver` symlink to `<root>/bus/pci/drivers/<driver>`
    /// with an `unbind` file.
    pub(crate) fn fake_function(
        root: &Path,
        bdf: &str,
        vendor: u16,
        device: u16,
        driver: Option<&str>,
    ) -> PathBuf {
        let d = root.join("bus/pci/devices").join(bdf);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("vendor"), format!("0x{vendor:04x}\n")).expect("vendor");
        std::fs::write(d.join("device"), format!("0x{device:04x}\n")).expect("device");
        let mut cfg = qemu_like(4096);
        cfg[0..2].copy_from_slice(&vendor.to_le_bytes());
        cfg[2..4].copy_from_slice(&device.to_le_bytes());
        cfg[4] = 0x01; // I/O space enabled, memory and master off
        std::fs::write(d.join("config"), &cfg).expect("config");
        let z = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        let mut res = String::new();
        res.push_str("0x000000000000c040 0x000000000000c07f 0x0000000000040101\n");
        res.push_str("0x00000000fe800000 0x00000000fe800fff 0x0000000000040200\n");
        res.push_str(z);
        res.push_str(z);
        res.push_str("0x0000000fe0000000 0x0000000fe0003fff 0x000000000014220c\n");
        res.push_str(z);
        res.push_str(z);
        std::fs::write(d.join("resource"), res).expect("resource");
        std::fs::write(d.join("resource4"), vec![0u8; 0x4000]).expect("resource4");
        if let Some(drv) = driver {
            let dd = root.join("bus/pci/drivers").join(drv);
            std::fs::create_dir_all(&dd).expect("mkdir driver");
            std::fs::write(dd.join("unbind"), "").expect("unbind");
            std::os::unix::fs::symlink(&dd, d.join("driver")).expect("symlink");
        }
        d
    }

    #[test]
    fn finds_by_vendor_and_modern_device_id() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        fake_function(root, "0000:00:05.0", 0x1af4, 0x107f, None);
        fake_function(root, "0000:00:04.0", 0x1af4, 0x107f, Some("virtio-pci"));
        fake_function(root, "0000:00:03.0", 0x1af4, 0x1041, None); // net
        fake_function(root, "0000:00:02.0", 0x8086, 0x107f, None); // not virtio
        fake_function(root, "0000:00:06.0", 0x1af4, 0x1069, None); // gpio stub (41)
        std::fs::create_dir_all(root.join("bus/pci/devices/junk")).expect("mkdir");
        let found = find_virtio_pci(root, 63).expect("find");
        let bdfs: Vec<&str> = found.iter().map(|f| f.bdf()).collect();
        assert_eq!(bdfs, vec!["0000:00:04.0", "0000:00:05.0"]);
        let found = find_virtio_pci(root, 41).expect("find");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].ids().ok(), Some((0x1af4, 0x1069)));
        assert!(find_virtio_pci(root, 7).expect("find").is_empty());
        assert!(find_virtio_pci(&root.join("nope"), 63).is_err());
    }

    #[test]
    fn unbind_and_bus_master() {
        let t = tempfile::tempdir().expect("tempdir");
        let root = t.path();
        let d = fake_function(root, "0000:00:04.0", 0x1af4, 0x107f, Some("virtio-pci"));
        let f = PciFunction::at(root, "0000:00:04.0");
        assert_eq!(f.driver().as_deref(), Some("virtio-pci"));
        assert_eq!(
            f.unbind_driver().expect("unbind").as_deref(),
            Some("virtio-pci")
        );
        let written = std::fs::read_to_string(root.join("bus/pci/drivers/virtio-pci/unbind"))
            .expect("read unbind");
        assert_eq!(written, "0000:00:04.0");
        // No driver: nothing to do.
        let g = PciFunction::at(root, "0000:00:09.0");
        fake_function(root, "0000:00:09.0", 0x1af4, 0x107f, None);
        assert_eq!(g.unbind_driver().expect("unbind"), None);

        f.enable_bus_master().expect("bus master");
        let cfg = std::fs::read(d.join("config")).expect("config");
        assert_eq!(cfg.len(), 4096);
        let cmd = u16::from_le_bytes([cfg[4], cfg[5]]);
        assert_eq!(cmd, 0x01 | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
        // Nothing else in config space changed.
        let mut want = qemu_like(4096);
        want[4] = cfg[4];
        assert_eq!(&cfg[6..], &want[6..]);
    }

    #[test]
    fn resources_parse() {
        let t = tempfile::tempdir().expect("tempdir");
        fake_function(t.path(), "0000:00:04.0", 0x1af4, 0x107f, None);
        let f = PciFunction::at(t.path(), "0000:00:04.0");
        let r = f.resources().expect("resources");
        assert_eq!(r.len(), 7);
        assert!(r[0].is_io() && !r[0].is_mem());
        assert_eq!(r[0].len(), 0x40);
        assert!(r[1].is_mem());
        assert_eq!(r[1].len(), 0x1000);
        assert!(r[2].is_empty());
        assert!(r[4].is_mem());
        assert_eq!(r[4].start, 0xf_e000_0000);
        assert_eq!(r[4].len(), 0x4000);
        assert!(parse_resources("0x1 0x2\n").is_err());
        assert!(parse_resources("0x1 zz 0x3\n").is_err());
        assert_eq!(parse_hex_u16("0x1af4\n"), Some(0x1af4));
        assert_eq!(parse_hex_u16("1040"), Some(0x1040));
        assert_eq!(parse_hex_u16("0xg"), None);
    }

    #[test]
    fn map_bar_from_a_resource_file() {
        let t = tempfile::tempdir().expect("tempdir");
        let d = fake_function(t.path(), "0000:00:04.0", 0x1af4, 0x107f, None);
        let f = PciFunction::at(t.path(), "0000:00:04.0");
        assert!(matches!(f.map_bar(0), Err(PciError::NotMemoryBar(0))));
        assert!(matches!(f.map_bar(2), Err(PciError::NotMemoryBar(2))));
        assert!(matches!(f.map_bar(9), Err(PciError::NotMemoryBar(9))));
        // BAR 1 is memory but its file is missing.
        assert!(matches!(f.map_bar(1), Err(PciError::Io { .. })));
        {
            let bar = f.map_bar(4).expect("map");
            assert_eq!(bar.len(), 0x4000);
            bar.write32(0x10, 0x1122_3344);
            bar.write16(0x3004, 1);
            bar.write8(0x3FFF, 0xAB);
            assert_eq!(bar.read32(0x10), 0x1122_3344);
            assert_eq!(bar.read16(0x12), 0x1122);
            assert_eq!(bar.read8(0x3FFF), 0xAB);
            // Out of range or misaligned: all ones, dropped.
            assert_eq!(bar.read32(0x3FFE), !0);
            assert_eq!(bar.read32(0x11), !0);
            bar.write32(0x4000, 5);
        }
        let bytes = std::fs::read(d.join("resource4")).expect("read");
        assert_eq!(&bytes[0x10..0x14], &[0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&bytes[0x3004..0x3006], &[1, 0]);
        assert_eq!(bytes[0x3FFF], 0xAB);
        // A resource file shorter than the BAR is refused (it would fault).
        std::fs::write(d.join("resource4"), [0u8; 16]).expect("truncate");
        assert!(matches!(f.map_bar(4), Err(PciError::Parse(_))));
    }
}

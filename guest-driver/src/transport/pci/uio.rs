//! The device's interrupt in user space: the function bound to Linux's `uio_pci_generic`,
//! whose `/dev/uioN` reports the device's legacy interrupt (INTx).
//!
//! Why INTx and uio: the driver cannot take MSI-X in user space without vfio-pci (which
//! needs an IOMMU, or the unsafe no-IOMMU mode), while `uio_pci_generic` works on any
//! device that supports INTx masking (PCI 2.3), which QEMU's virtio-pci does. With MSI-X
//! off, virtio-pci raises INTx and sets the ISR bit for every used-buffer notification
//! the device sends.
//!
//! The protocol, per interrupt:
//! 1. the kernel's handler sees the device's interrupt status, masks INTx (command
//!    register bit 10) and makes `/dev/uioN` readable (a 32-bit event count);
//! 2. the driver reads the count, then reads the virtio ISR register, which clears it
//!    and lowers the line;
//! 3. the driver clears INTx disable in the command register through the function's
//!    sysfs `config` file (`uio_pci_generic` has no `irqcontrol`: a write to
//!    `/dev/uioN` fails with ENOSYS). A notification sent after step 2 raises the line
//!    again and is delivered once unmasked: none is lost.
//!
//! The device only notifies when the driver asked for it (EVENT_IDX `used_event`, re-armed
//! by the device layer before it waits), so a busy driver takes few interrupts.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::PciError;
use super::sysfs::PciFunction;
use crate::transport::TransportError;

/// The kernel driver that exposes a PCI function's INTx as `/dev/uioN`.
pub const UIO_PCI_GENERIC: &str = "uio_pci_generic";

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PciError {
    let what = what.into();
    move |source| PciError::Io { what, source }
}

/// The function's interrupt, through `uio_pci_generic`.
#[derive(Debug)]
pub struct UioIrq {
    file: File,
    /// The function's config space (sysfs `config`), for the command register.
    config: File,
    name: String,
}

/// The command register's high byte (offset 5): bit 2 there is INTx disable (bit 10).
const COMMAND_HIGH: u64 = 5;
const INTX_DISABLE_HIGH: u8 = 1 << 2;

impl UioIrq {
    /// Binds `f` to `uio_pci_generic` (unless it already is) and opens its `/dev/uioN`
    /// under `dev_root`. Fails, changing nothing, when the driver is not loaded
    /// ([`PciError::NoInterrupts`]); fails too when the function has no interrupt line.
    /// Call it after the function's previous driver was unbound.
    pub fn attach(sysfs_root: &Path, dev_root: &Path, f: &PciFunction) -> Result<UioIrq, PciError> {
        let drv = sysfs_root.join("bus/pci/drivers").join(UIO_PCI_GENERIC);
        if f.driver().as_deref() != Some(UIO_PCI_GENERIC) {
            if !drv.is_dir() {
                return Err(PciError::NoInterrupts(format!(
                    "{UIO_PCI_GENERIC} is not loaded (modprobe {UIO_PCI_GENERIC})"
                )));
            }
            let irq = std::fs::read_to_string(f.path().join("irq")).unwrap_or_default();
            if irq.trim().parse::<u32>().unwrap_or(0) == 0 {
                return Err(PciError::NoInterrupts(format!(
                    "{} has no interrupt line",
                    f.bdf()
                )));
            }
            let o = f.path().join("driver_override");
            std::fs::write(&o, UIO_PCI_GENERIC).map_err(io(format!("writing {}", o.display())))?;
            let b = drv.join("bind");
            std::fs::write(&b, f.bdf()).map_err(io(format!("writing {}", b.display())))?;
        }
        let name = uio_name(&f.path().join("uio"))?;
        let path = dev_root.join(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(io(format!("opening {}", path.display())))?;
        set_nonblocking(&file).map_err(io(format!("O_NONBLOCK on {}", path.display())))?;
        let cp = f.path().join("config");
        let config = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&cp)
            .map_err(io(format!("opening {}", cp.display())))?;
        let irq = UioIrq { file, config, name };
        irq.unmask().map_err(|e| PciError::Io {
            what: e.what,
            source: e.source,
        })?;
        Ok(irq)
    }

    /// `uioN`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Unmasks INTx (after the interrupt's source was cleared): clears INTx disable in
    /// the command register, as the uio HOWTO does for `uio_pci_generic`.
    pub fn unmask(&self) -> Result<(), TransportError> {
        let err = |source| TransportError {
            what: format!("unmasking the interrupt of {}", self.name),
            source,
        };
        let mut b = [0u8; 1];
        self.config
            .read_exact_at(&mut b, COMMAND_HIGH)
            .map_err(err)?;
        if b[0] & INTX_DISABLE_HIGH != 0 {
            b[0] &= !INTX_DISABLE_HIGH;
            self.config.write_all_at(&b, COMMAND_HIGH).map_err(err)?;
        }
        Ok(())
    }

    /// The `/dev/uioN` descriptor: readable when the device interrupted.
    pub fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }

    /// Consumes a pending interrupt's count (after [`UioIrq::fd`] was readable); true if
    /// there was one. INTx is then masked until [`UioIrq::unmask`].
    pub fn consume(&self) -> Result<bool, TransportError> {
        let mut count = [0u8; 4];
        match (&self.file).read(&mut count) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(TransportError {
                what: format!("reading {}", self.name),
                source: e,
            }),
        }
    }

    /// Waits up to `timeout` for an interrupt; true if one came (its count consumed).
    /// INTx is then masked until [`UioIrq::unmask`].
    pub fn wait(&self, timeout: Duration) -> Result<bool, TransportError> {
        let mut pfd = libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
        };
        // SAFETY: `pfd` is one valid pollfd and `ts` a valid timespec, both live for the
        // call; a null signal mask leaves the mask unchanged.
        let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, core::ptr::null()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(TransportError {
                what: format!("waiting on {}", self.name),
                source: e,
            });
        }
        if n == 0 || pfd.revents & libc::POLLIN == 0 {
            return Ok(false);
        }
        let mut count = [0u8; 4];
        match (&self.file).read(&mut count) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(TransportError {
                what: format!("reading {}", self.name),
                source: e,
            }),
        }
    }
}

/// The `uioN` entry of a function's `uio` directory.
fn uio_name(dir: &Path) -> Result<String, PciError> {
    let entries = std::fs::read_dir(dir).map_err(io(format!("listing {}", dir.display())))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("uio"))
        .collect();
    names.sort();
    names
        .into_iter()
        .next()
        .ok_or_else(|| PciError::NoInterrupts(format!("no uio device in {}", dir.display())))
}

fn set_nonblocking(f: &File) -> std::io::Result<()> {
    let fd = f.as_raw_fd();
    // SAFETY: F_GETFL on an open descriptor has no memory effects.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: F_SETFL with the flags just read plus O_NONBLOCK, on an open descriptor.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Where `/dev/uioN` lives.
pub fn default_dev_root() -> PathBuf {
    PathBuf::from("/dev")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake sysfs function at `root`, optionally bound to a driver.
    fn function(root: &Path, bdf: &str, irq: &str, uio_loaded: bool) -> PciFunction {
        let dir = root.join("bus/pci/devices").join(bdf);
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("irq"), irq).expect("irq");
        std::fs::write(dir.join("driver_override"), "").expect("override");
        // A config space whose command register has INTx disable set (0x0406).
        let mut config = vec![0u8; 64];
        config[4] = 0x06;
        config[5] = 0x04;
        std::fs::write(dir.join("config"), config).expect("config");
        if uio_loaded {
            let d = root.join("bus/pci/drivers").join(UIO_PCI_GENERIC);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("bind"), "").expect("bind");
        }
        PciFunction::at(root, bdf)
    }

    #[test]
    fn without_the_driver_nothing_is_written_and_the_error_says_what_to_load() {
        let t = tempfile::tempdir().expect("tmp");
        let f = function(t.path(), "0000:00:04.0", "11\n", false);
        let e = UioIrq::attach(t.path(), t.path(), &f).expect_err("no driver");
        assert!(e.to_string().contains("modprobe uio_pci_generic"), "{e}");
        let o = std::fs::read_to_string(f.path().join("driver_override")).expect("read");
        assert_eq!(o, "");
    }

    #[test]
    fn a_function_without_an_interrupt_line_is_refused_before_binding() {
        let t = tempfile::tempdir().expect("tmp");
        let f = function(t.path(), "0000:00:04.0", "0\n", true);
        let e = UioIrq::attach(t.path(), t.path(), &f).expect_err("no irq");
        assert!(e.to_string().contains("no interrupt line"), "{e}");
        let b = t.path().join("bus/pci/drivers/uio_pci_generic/bind");
        assert_eq!(std::fs::read_to_string(b).expect("read"), "");
    }

    #[test]
    fn binding_sets_the_override_binds_and_opens_the_uio_device() {
        let t = tempfile::tempdir().expect("tmp");
        let f = function(t.path(), "0000:00:04.0", "11\n", true);
        // What the kernel would create once bound: the uio entry and its device node
        // (a regular file here: writes land in it, reads see them).
        std::fs::create_dir_all(f.path().join("uio/uio3")).expect("uio");
        let dev = t.path().join("dev");
        std::fs::create_dir_all(&dev).expect("dev");
        std::fs::write(dev.join("uio3"), "").expect("node");
        let irq = UioIrq::attach(t.path(), &dev, &f).expect("attach");
        assert_eq!(irq.name(), "uio3");
        let o = std::fs::read_to_string(f.path().join("driver_override")).expect("read");
        assert_eq!(o, UIO_PCI_GENERIC);
        let b = t.path().join("bus/pci/drivers/uio_pci_generic/bind");
        assert_eq!(std::fs::read_to_string(b).expect("read"), "0000:00:04.0");
        // attach unmasked the interrupt: INTx disable cleared, the rest kept.
        let c = std::fs::read(f.path().join("config")).expect("read");
        assert_eq!((c[4], c[5]), (0x06, 0x00));
    }

    #[test]
    fn no_uio_entry_after_binding_is_an_error_not_a_hang() {
        let t = tempfile::tempdir().expect("tmp");
        let f = function(t.path(), "0000:00:04.0", "11\n", true);
        std::fs::create_dir_all(f.path().join("uio")).expect("uio");
        let e = UioIrq::attach(t.path(), t.path(), &f).expect_err("no uio");
        assert!(e.to_string().contains("no uio device"), "{e}");
    }
}

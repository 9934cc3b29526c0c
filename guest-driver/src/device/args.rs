//! The pvcm device's command-line options, shared by `pvcm-guest` and `pvcm-guestd`.

use std::path::PathBuf;

use pvcm_wire::abi;

use super::pci::{PciDevice, PciOptions};
use super::{DEFAULT_RX_BATCH, Device, DeviceError, DeviceOptions, random_seed};
use crate::cm::{AgentConfig, Pacing};
use crate::time::SystemClock;

/// Which device to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A virtio-pci function with this virtio device ID.
    Pci {
        /// The virtio device ID.
        virtio_id: u32,
    },
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<DeviceSpec, String> {
        if s == "pci" {
            return Ok(DeviceSpec::Pci {
                virtio_id: abi::DEFAULT_VIRTIO_ID,
            });
        }
        if let Some(id) = s.strip_prefix("pci:") {
            let v = match id.strip_prefix("0x") {
                Some(h) => u32::from_str_radix(h, 16),
                None => id.parse(),
            }
            .map_err(|_| format!("bad virtio ID {id:?} (a number, e.g. pci:63)"))?;
            if v > u32::from(u16::MAX - 0x1040) {
                return Err(format!("virtio ID {v} too large"));
            }
            return Ok(DeviceSpec::Pci { virtio_id: v });
        }
        if s == "lab" || s.starts_with("lab:") {
            return Err(
                "a lab device cannot be named on the command line: the lab's \
                        mini-VMM (pvcm-lab) sets it up in its own process (memfd guest memory, \
                        eventfds) and drives pvcm_guest::device directly; use pci[:VIRTIO_ID]"
                    .into(),
            );
        }
        Err(format!("unknown device {s:?}: use pci or pci:VIRTIO_ID"))
    }
}

fn parse_rx_batch(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=32_768).contains(&n) => Ok(n),
        _ => Err(format!("{s:?}: a number of messages, 1 to 32768")),
    }
}

/// The pvcm device's options, shared by `pvcm-guest` and `pvcm-guestd`.
#[derive(Debug, Clone, clap::Args)]
pub struct DeviceArgs {
    /// The device: pci (virtio ID 63, PCI 1af4:107f) or pci:VIRTIO_ID (e.g. pci:41
    /// behind QEMU's vhost-user-gpio-pci).
    #[arg(long, global = true, default_value = "pci", value_name = "DEVICE")]
    pub device: DeviceSpec,
    /// The PCI address (0000:00:04.0) when several functions match.
    #[arg(long, global = true, value_name = "BDF")]
    pub pci_addr: Option<String>,
    /// hugetlbfs mount for DMA memory.
    #[arg(
        long,
        global = true,
        default_value = "/dev/hugepages",
        value_name = "DIR"
    )]
    pub hugepages: PathBuf,
    /// sysfs mount.
    #[arg(long, global = true, default_value = "/sys", value_name = "DIR")]
    pub sysfs: PathBuf,
    /// Queue size (power of two; the device's maximum caps it, so the default takes
    /// what the VMM allows, up to 1024).
    #[arg(long, global = true, default_value_t = 1024, value_name = "N")]
    pub queue_size: u16,
    /// Poll the device's rings with a timed sleep instead of waiting on its interrupt
    /// (INTx through uio_pci_generic, used when that module is loaded).
    #[arg(long, global = true)]
    pub no_interrupts: bool,
    /// Seed of comm IDs, TIDs and PSNs (default: random).
    #[arg(long, global = true, value_name = "N")]
    pub seed: Option<u64>,
    /// Messages the driver takes from rx before the application sees them and the
    /// answers go out (at most the queue size).
    #[arg(long, global = true, value_name = "N", default_value_t = DEFAULT_RX_BATCH,
          value_parser = parse_rx_batch)]
    pub rx_batch: usize,
}

impl DeviceArgs {
    /// Opens the pvcm PCI function and starts the device (PORT_INFO, the agent).
    pub fn open(
        &self,
        configure: Option<fn(&mut AgentConfig)>,
        pacing: Option<Option<Pacing>>,
    ) -> Result<Device<PciDevice>, DeviceError> {
        let DeviceSpec::Pci { virtio_id } = self.device;
        let o = PciOptions {
            sysfs_root: self.sysfs.clone(),
            virtio_id,
            bdf: self.pci_addr.clone(),
            hugetlbfs: self.hugepages.clone(),
            queue_size: self.queue_size,
            interrupts: !self.no_interrupts,
            ..PciOptions::default()
        };
        let (t, q) = PciDevice::open(&o)?;
        let opts = DeviceOptions {
            seed: self.seed.unwrap_or_else(random_seed),
            configure,
            pacing,
            rx_batch: self.rx_batch,
            ..DeviceOptions::default()
        };
        Device::start(t, q, SystemClock::new(), opts)
    }
}

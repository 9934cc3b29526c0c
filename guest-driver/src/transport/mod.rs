//! Transports: how the guest driver reaches the pvcm device.
//!
//! - [`pci`]: a user-space virtio-pci (modern) driver, for a real VM.
//!   [`crate::device::pci::PciDevice`] puts its pieces together as a
//!   [`crate::device::Transport`].
//! - [`lab`]: the lab's transport (shared memory and eventfds set up by the lab's
//!   mini-VMM in `pvcm-lab`): a [`crate::virtq::LinearDma`] window of the memfd guest
//!   memory, kicks written to the kick eventfds, waits on the call eventfds. The device
//!   addresses the queues report (`Queues::setups`) are guest-physical addresses; the
//!   mini-VMM translates them to its own virtual addresses for
//!   `VHOST_USER_SET_VRING_ADDR`, gives the queue size as the vring size and 0 as the
//!   vring base.

pub mod lab;
pub mod pci;

//! Transports: how the guest driver reaches the pvcm device.
//!
//! - [`pci`]: a user-space virtio-pci (modern) driver, for a real VM.
//! - The lab transport (shared memory and eventfds set up by the lab's mini-VMM) is a
//!   [`crate::virtq::DmaMemory`] over the lab's guest memory
//!   ([`crate::virtq::LinearDma`]) plus a [`crate::virtq::Notify`] that writes the kick
//!   eventfd; it lives with the mini-VMM in `pvcm-lab`. There the device addresses
//!   the queue reports (`Virtq::desc_table_addr` etc.) are guest-physical addresses;
//!   the mini-VMM translates them to its own virtual addresses for
//!   `VHOST_USER_SET_VRING_ADDR`, gives `Virtq::size` as the vring size and 0 as the
//!   vring base, and waits on the call eventfd after `Virtq::enable_notifications`
//!   returned `false`.

pub mod pci;

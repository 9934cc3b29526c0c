//! `pvcm-guest`: what runs inside the VM.
//!
//! - [`virtq`]: a driver-side split virtqueue (EVENT_IDX, batching, indirect
//!   descriptors) over a DMA-memory trait, with a fixed buffer pool per queue.
//! - [`transport`]: the user-space virtio-pci (modern) driver pieces: capability
//!   parsing, common config, init sequence, sysfs discovery, hugetlbfs DMA memory with
//!   physical addresses from `/proc/self/pagemap`.
//! - [`cm`]: a complete IBA chapter-12 CM agent (pure, virtual time) and an
//!   rdma_cm-style API on top.
//! - [`device`]: the agent joined to a pvcm device: PORT_INFO handshake, the pump
//!   (rx -> agent -> tx, one kick per batch), device events, blocking helpers, the
//!   in-VM virtio-pci transport ([`device::pci`]) and the cmtime benchmark.
//! - [`time`]: the injected clock.
//! - [`report`]: the JSON reports the commands and the service print.
//! - [`service`]: `pvcm-guestd`, the guest CM service: the kernel's rdma_cm device ABI
//!   served through CUSE on top of the agent, for the distribution's librdmacm programs.
//! - [`cli`]: the `pvcm-guest` command line on top: `info`, `listen`, `connect`,
//!   `connect-destroy`, `cmtime`, on any device (the binary, `src/bin/pvcm-guest.rs`,
//!   and `pvcm-lab attach` both run it).

#![warn(missing_docs)]

pub mod cli;
pub mod cm;
pub mod device;
pub mod report;
pub mod service;
pub mod time;
pub mod transport;
pub mod virtq;

//! `pvcm-guest`: what runs inside the VM.
//!
//! - [`virtq`]: a driver-side split virtqueue (EVENT_IDX, batching, indirect
//!   descriptors) over a DMA-memory trait, with a fixed buffer pool per queue.
//! - [`transport`]: the user-space virtio-pci (modern) driver pieces: capability
//!   parsing, common config, init sequence, sysfs discovery, hugetlbfs DMA memory with
//!   physical addresses from `/proc/self/pagemap`.
//! - [`cm`]: a complete IBA chapter-12 CM agent (pure, virtual time) and an
//!   rdma_cm-style API on top.
//! - [`time`]: the injected clock.
//!
//! Not built yet: the transport that joins the agent to a device queue, and the
//! `pvcm-guest` CLI (issue 5).

pub mod cm;
pub mod time;
pub mod transport;
pub mod virtq;

//! `pvcm-lab`: the multi-VM lab.
//!
//! The VMM side that drives `pvcm-backend` as QEMU would — memfd guest memory, the
//! `vhost` crate's vhost-user frontend, and the guest driver's split virtqueues
//! (`pvcm-guest`) over that memory ([`vmm::LabVm`]) — helpers to run backends in-process
//! ([`backend`]), and the lab itself ([`lab`]: hosts, VMs, the seed scenarios, `rate`,
//! `cmtime`, `attach`; see `docs/lab.md`). Hand-built CM MADs come from
//! `pvcm_wire::testing` (feature `test-util`).

#![warn(missing_docs)]
#![allow(clippy::missing_panics_doc)]

pub mod backend;
pub mod lab;
pub mod vmm;

pub use vmm::{LabVm, RxMsg, VmOpts};

//! `pvcm-lab`: the multi-VM lab.
//!
//! What exists so far (issue 4): the VMM side that drives `pvcm-backend` as QEMU would —
//! memfd guest memory, the `vhost` crate's vhost-user frontend, and the guest driver's
//! split virtqueues (`pvcm-guest`) over that memory ([`vmm::LabVm`]) — plus hand-built
//! CM MADs ([`mads`]) and helpers to run backends in-process ([`backend`]). The seed
//! scenarios (issue 6) will build on these.

#![warn(missing_docs)]
#![allow(clippy::missing_panics_doc)]

pub mod backend;
pub mod lab;
pub mod mads;
pub mod vmm;

pub use vmm::{LabVm, RxMsg, VmOpts};

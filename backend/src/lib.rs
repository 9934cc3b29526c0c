//! `pvcm-backend`: the host side of pvcm.
//!
//! - [`mux`]: the PF multiplexer, pure and I/O-free: comm-ID and TID remapping, demux,
//!   REJ(TIMEOUT) routing, protocol-aware entry lifetimes, VM cleanup, anti-spoofing.
//!
//! The vhost-user daemon and the RoCEv2 wire port (issue 4) will drive the mux.

#![warn(missing_docs)]

pub mod mux;

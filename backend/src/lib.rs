//! `pvcm-backend`: the host side of pvcm.
//!
//! - [`mux`]: the PF multiplexer, pure and I/O-free: comm-ID and TID remapping, demux,
//!   REJ(TIMEOUT) routing, protocol-aware entry lifetimes, VM cleanup, anti-spoofing.
//! - [`config`]: the daemon's command line and config file.
//! - [`device`]: the pvcm virtio device served over vhost-user (ABI: `docs/device-abi.md`).
//! - [`wire`]: the soft RoCE port (RoCEv2 over UDP, ICRC, `sendmmsg`/`recvmmsg`).
//! - [`daemon`]: the serve loop (per-VM vhost-user threads, the host event loop).
//! - [`control`]: the control socket, `pvcm-backend stat`, Prometheus metrics.
//! - [`stats`]: device and wire counters, the snapshot and its renderings.
//! - [`pcap`]: `--pcap` capture of every frame.
//!
//! The binary (`src/main.rs`) only parses the command line and calls [`daemon::run`] or
//! [`control::stat`].

#![warn(missing_docs)]

pub mod config;
pub mod control;
pub mod daemon;
pub mod device;
pub mod mux;
pub mod pcap;
pub mod stats;
pub mod wire;

pub use config::Config;
pub use daemon::Daemon;

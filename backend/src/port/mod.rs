//! The host's CM port: where the VMs' MADs meet the wire.
//!
//! One trait, [`WirePort`], with two implementations driven by the same host loop
//! (`daemon.rs`):
//!
//! - [`soft`]: pvcm's own RoCEv2 port: UDP sockets on the VMs' addresses, frames and
//!   ICRC built and checked in user space (`--port soft`, the default).
//! - [`umad`]: a real RDMA device's QP1 through the kernel's user MAD interface
//!   (`/dev/infiniband/umadN`), exactly as a real HCA carries CM MADs (`--port
//!   umad:DEVICE[:PORT]`, see `docs/umad.md`).
//!
//! A port knows the VMs by their index in the configuration (the daemon's `VmPort`
//! index). It counts its frames and drops on the VM's counters, or on the host's when no
//! VM owns what it received.

use std::fmt;
use std::os::fd::RawFd;
use std::sync::Arc;

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;

use crate::pcap::Capture;
use crate::stats::DevCounters;
use crate::vm_port::VmPort;

pub mod soft;
pub mod umad;

pub use crate::config::PortSpec;

pub use crate::rx::InMad;

/// A MAD to send: its destination GID and the MAD where it already is (the mux rewrote
/// it in place; sending copies it once, into the frame).
pub type OutMad<'a> = (Gid, &'a [u8; MAD_LEN]);

/// What a port may touch of the daemon while it sends or receives.
#[derive(Debug, Clone, Copy)]
pub struct PortCtx<'a> {
    /// The VMs, by index (their counters).
    pub vms: &'a [Arc<VmPort>],
    /// Counters for what no VM owns (a MAD for a GID index nobody has).
    pub host: &'a DevCounters,
    /// The capture, if `--pcap`.
    pub capture: Option<&'a Capture>,
}

/// Tokens below this are the port's own epoll tokens.
pub const TOKEN_LIMIT: u64 = 1 << 40;

/// The host's CM port (see the module docs).
pub trait WirePort: Send + Sync + fmt::Debug {
    /// How the port receives, as `stat` shows it (`raw`, `udp`, `umad rxe0:1`).
    fn rx_mode(&self) -> String;
    /// The descriptors the host loop polls for input, each with its token (below
    /// [`TOKEN_LIMIT`]).
    fn poll_fds(&self) -> Vec<(RawFd, u64)>;
    /// A session of VM `vm` begins: checks the VM can use the port (umad: its GID is in
    /// the port's GID table). An error refuses the attach and says why.
    fn attach(&self, vm: usize) -> Result<(), String>;
    /// VM `vm` arrived by migration: take over its address (bind it); true if it was
    /// bound now (false: it already was). The default refuses: only the soft port
    /// moves addresses.
    fn claim(&self, vm: usize) -> Result<bool, String> {
        let _ = vm;
        Err("this port cannot take over a VM's address (migration needs the soft port)".into())
    }
    /// VM `vm` left by migration: give its address up (unbind it), so the host it
    /// moved to can take it. What still arrives for it is not this host's any more.
    fn release(&self, vm: usize) {
        let _ = vm;
    }
    /// Sends MADs from VM `vm` to their GIDs; counts frames and drops on the VM.
    fn send(&self, ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]);
    /// Reads what is waiting on `token`'s descriptor, in batches, and hands every batch
    /// of checked MADs to `route` with the index of the VM they are addressed to.
    fn receive(&self, ctx: &PortCtx<'_>, token: u64, route: &mut dyn FnMut(usize, Vec<InMad>));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_spec_parses() {
        assert_eq!("soft".parse::<PortSpec>(), Ok(PortSpec::Soft));
        assert_eq!(
            "umad:rxe0".parse::<PortSpec>(),
            Ok(PortSpec::Umad {
                device: "rxe0".into(),
                port: 1
            })
        );
        assert_eq!(
            "umad:mlx4_0:2".parse::<PortSpec>(),
            Ok(PortSpec::Umad {
                device: "mlx4_0".into(),
                port: 2
            })
        );
        assert!("umad:".parse::<PortSpec>().is_err());
        assert!("umad:rxe0:0".parse::<PortSpec>().is_err());
        assert!("umad:rxe0:x".parse::<PortSpec>().is_err());
        assert!("umad:../x".parse::<PortSpec>().is_err());
        assert!("udp".parse::<PortSpec>().is_err());
        assert_eq!(
            PortSpec::Umad {
                device: "rxe0".into(),
                port: 1
            }
            .to_string(),
            "umad:rxe0:1"
        );
    }
}

//! The host's CM port: where the VMs' MADs meet the wire.
//!
//! One trait, [`WirePort`], with three implementations driven by the same host loop
//! (`daemon.rs`):
//!
//! - [`soft`]: pvcm's own RoCEv2 port: UDP sockets on the VMs' addresses, frames and
//!   ICRC built and checked in user space (`--port soft`, the default).
//! - [`umad`]: a real RDMA device's QP1 through the kernel's user MAD interface
//!   (`/dev/infiniband/umadN`), exactly as a real HCA carries CM MADs (`--port
//!   umad:DEVICE[:PORT]`, see `docs/umad.md`).
//! - [`packet`]: the host side of QP1 for VMs with their own NIC: their QP1 frames are
//!   diverted to a network device and read there (AF_PACKET), answers leave through the
//!   host's IP stack with the VM's address as source (`--port packet:DEV[:IFACE]`, see
//!   `docs/packet-port.md`).
//!
//! Every port takes IPv4-mapped and IPv6 GIDs (RoCEv2 over IPv4 and over IPv6) side by
//! side.
//!
//! What the ports share sits below them: [`sys`] (sockets, socket options, socket
//! addresses, interfaces, batched receives), `bpf` (classic BPF: opcodes, an assembler,
//! attaching a filter), [`frame`] (the checks every received CM frame passes) and
//! `error` ([`Error`], [`PortError`]). A port file holds only what makes it that port,
//! and no port imports another.
//!
//! A port knows the VMs by their index in the configuration (the daemon's `VmPort`
//! index). It counts its frames and drops on the VM's counters, or on the host's when no
//! VM owns what it received.

use std::fmt;
use std::io;
use std::os::fd::RawFd;

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;

use crate::pcap::Capture;
use crate::stats::DevCounters;
use crate::vm_port::VmSet;

mod bpf;
mod error;
pub mod frame;
pub mod packet;
pub mod soft;
pub mod sys;
pub mod umad;

pub use error::{Error, PortError, RAW_SOCKET_HOW};

pub use crate::config::PortSpec;

pub use crate::rx::InMad;

/// A MAD to send: its destination GID and the MAD where it already is (the mux rewrote
/// it in place; sending copies it once, into the frame).
pub type OutMad<'a> = (Gid, &'a [u8; MAD_LEN]);

/// What a port may touch of the daemon while it sends or receives.
#[derive(Debug, Clone, Copy)]
pub struct PortCtx<'a> {
    /// The VMs, by index (their counters).
    pub vms: &'a VmSet,
    /// Counters for what no VM owns (a MAD for a GID index nobody has).
    pub host: &'a DevCounters,
    /// The capture, if `--pcap`.
    pub capture: Option<&'a Capture>,
}

/// What a port knows of the link a VM's GID is on: what the VM's PORT_INFO reports as
/// the path values (`docs/device-abi.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Link {
    /// The active MTU (IBTA code) a VM on this link uses for its paths: Linux's
    /// `iboe_get_mtu()` of the network device's MTU, as rdma_cm takes it for a RoCE
    /// route. `None`: the port cannot say.
    pub mtu: Option<u8>,
    /// The CA's local ACK delay (5-bit exponent); `None`: the port cannot say.
    pub ca_ack_delay: Option<u8>,
}

pub use pvcm_wire::abi::iboe_mtu;

pub use sys::{if_mtu, iface_of};

/// Tokens below this are the port's own epoll tokens.
pub const TOKEN_LIMIT: u64 = 1 << 40;

/// The host's CM port (see the module docs).
pub trait WirePort: Send + Sync + fmt::Debug {
    /// How the port receives, as `stat` shows it (`raw`, `udp`, `umad rxe0:1`).
    fn rx_mode(&self) -> String;
    /// The receive mode the configuration asked for; the default: the one in effect
    /// (the port has no choice).
    fn rx_mode_configured(&self) -> String {
        self.rx_mode()
    }
    /// The buffer of the port's shared receive socket, if it has one.
    fn rx_buffer(&self) -> Option<crate::stats::RxBuffer> {
        None
    }
    /// The port's settings in effect in a lesser form than configured (each was logged
    /// at WARN when the port opened).
    fn degraded(&self) -> Vec<crate::stats::Degraded> {
        Vec::new()
    }
    /// The descriptors the host loop polls for input, each with its token (below
    /// [`TOKEN_LIMIT`]).
    fn poll_fds(&self) -> Vec<(RawFd, u64)>;
    /// A session of VM `vm` begins: checks the VM can use the port (umad: its GID is in
    /// the port's GID table). An error refuses the attach and says why.
    fn attach(&self, vm: usize) -> Result<(), PortError>;
    /// VM `vm` arrived by migration: take over its address (bind it); true if it was
    /// bound now (false: it already was). The default refuses: only the soft port
    /// moves addresses.
    fn claim(&self, vm: usize) -> Result<bool, PortError> {
        let _ = vm;
        Err(PortError::CannotClaim)
    }
    /// VM `vm` left by migration: give its address up (unbind it), so the host it
    /// moved to can take it. What still arrives for it is not this host's any more.
    fn release(&self, vm: usize) {
        let _ = vm;
    }
    /// Whether VMs can join and leave the running port ([`WirePort::add_vm`],
    /// [`WirePort::remove_vm`]). The default: no, its VM set is fixed when it opens.
    fn changes_vms(&self) -> bool {
        false
    }
    /// VM `vm` joins the running port (added at runtime): binds its address (unless it
    /// arrives by migration, `spec.incoming`) and hands each descriptor the host loop
    /// must poll for it to `poll`. The default refuses: the port's VM set is fixed.
    fn add_vm(
        &self,
        vm: usize,
        spec: &crate::config::VmSpec,
        poll: &mut dyn FnMut(RawFd, u64) -> io::Result<()>,
    ) -> Result<(), PortError> {
        let _ = (vm, spec, poll);
        Err(PortError::FixedVms(self.rx_mode()))
    }
    /// VM `vm` leaves the running port (removed at runtime): hands each descriptor
    /// polled for it to `unpoll` before closing it, and forgets its address.
    fn remove_vm(&self, vm: usize, unpoll: &mut dyn FnMut(RawFd)) {
        let _ = (vm, unpoll);
    }
    /// The link VM `vm`'s GID is on, as far as the port can tell (read when the VM's
    /// session starts, so a changed MTU is seen at the next one). The default: nothing.
    fn link(&self, vm: usize) -> Link {
        let _ = vm;
        Link::default()
    }
    /// Sends MADs from VM `vm` to their GIDs; counts frames and drops on the VM.
    fn send(&self, ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]);
    /// Reads what is waiting on `token`'s descriptor, in batches, and hands every batch
    /// of checked MADs to `route` at once, grouped by the VM they are addressed to: the
    /// host loop then takes the mux lock, wakes each VM and sends the replies once per
    /// batch, not once per VM, which matters when a batch spans hundreds of VMs.
    fn receive(&self, ctx: &PortCtx<'_>, token: u64, route: &mut dyn FnMut(Arrivals));
}

/// The checked MADs of one receive batch, grouped by the index of the VM they are
/// addressed to (each VM at most once).
pub type Arrivals = Vec<(usize, Vec<InMad>)>;

/// Network namespaces for the ports' tests with real sockets.
#[cfg(test)]
pub(crate) mod testnet {
    use std::process::Command;

    /// Runs `f` on a new thread in a fresh network namespace (loopback up), where it may
    /// add addresses and devices with [`ip`]; everything it opens lives there. `None`
    /// (after printing SKIP) when the test cannot have one: not root, no `unshare`, no
    /// `ip` command.
    pub(crate) fn in_netns<T: Send>(what: &str, f: impl FnOnce() -> T + Send) -> Option<T> {
        // SAFETY: geteuid(2) cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("SKIP {what}: not root (needs a network namespace)");
            return None;
        }
        if Command::new("ip").arg("-V").output().is_err() {
            eprintln!("SKIP {what}: no `ip` command (iproute2)");
            return None;
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                // SAFETY: unshare(2) moves only this thread into a new namespace.
                if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                    let e = std::io::Error::last_os_error();
                    eprintln!("SKIP {what}: unshare(CLONE_NEWNET): {e}");
                    return None;
                }
                ip(&["link", "set", "lo", "up"]);
                Some(f())
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }

    /// Adds an IPv6 address (`ADDR/LEN`, no DAD) to `dev` and waits until the kernel's
    /// local route for it is in place: the kernel adds it from a work queue after `ip`
    /// returns, and until then datagrams to the address are dropped as unroutable.
    pub(crate) fn add_addr(dev: &str, cidr: &str) {
        ip(&["addr", "add", cidr, "dev", dev, "nodad"]);
        let addr = cidr.split('/').next().unwrap_or(cidr);
        for _ in 0..500 {
            let out = Command::new("ip")
                .args(["-6", "route", "show", "table", "local", addr])
                .output()
                .unwrap_or_else(|e| panic!("ip route: {e}"));
            if !out.stdout.is_empty() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        panic!("no local route for {addr} on {dev}");
    }

    /// Runs `ip ARGS` in the calling thread's namespace; panics if it fails.
    pub(crate) fn ip(args: &[&str]) {
        let out = Command::new("ip")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("ip {args:?}: {e}"));
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loopback_interface_and_its_mtu_are_found() {
        let lo = super::iface_of("127.0.0.1".parse().unwrap());
        assert_eq!(lo.as_deref(), Some("lo"));
        assert!(super::if_mtu("lo").is_some_and(|m| m >= 1500));
        assert_eq!(super::if_mtu("no-such-if0"), None);
        assert_eq!(super::if_mtu(""), None);
        assert_eq!(super::iface_of("192.0.2.77".parse().unwrap()), None);
    }

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
        assert_eq!(
            "packet:pvcm-qp1".parse::<PortSpec>(),
            Ok(PortSpec::Packet {
                dev: "pvcm-qp1".into(),
                iface: None
            })
        );
        let p = "packet:pvcm-qp1:br0".parse::<PortSpec>().unwrap();
        assert_eq!(
            p,
            PortSpec::Packet {
                dev: "pvcm-qp1".into(),
                iface: Some("br0".into())
            }
        );
        assert_eq!(p.to_string(), "packet:pvcm-qp1:br0");
        for bad in [
            "packet:",
            "packet:a/b",
            "packet:x:",
            "packet:x:y:z",
            "packet:0123456789abcdef",
        ] {
            assert!(bad.parse::<PortSpec>().is_err(), "{bad}");
        }
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

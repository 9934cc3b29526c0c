//! The wire ports' errors: a port that could not open, a VM's address it could not
//! bind, and a VM a port refuses.

use std::io;
use std::net::IpAddr;
use std::path::PathBuf;

use pvcm_wire::Gid;

/// A port could not be opened, or could not bind a VM's address: what failed, for the
/// operator, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS call failed while setting a VM up on the port.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// `--wire-rx raw` was asked for and the raw receive socket could not be opened.
    #[error("--wire-rx raw: raw socket: {0}; {RAW_SOCKET_HOW}")]
    RawSocketRequired(#[source] io::Error),
    /// `--wire-rx auto`: the raw receive socket failed for a reason other than a missing
    /// privilege (which falls back to udp).
    #[error(
        "raw wire socket: {0}; --wire-rx udp receives without it (pvcm peers only, see \
         docs/daemon.md)"
    )]
    RawSocket(#[source] io::Error),
    /// The soft port's loss-audit timer could not be created.
    #[error("soft port: timerfd for the receive-loss audit: {0}")]
    AuditTimer(#[source] io::Error),
    /// A VM's address could not be bound for the soft port.
    #[error("VM {vm}: wire port {addr} port {port}: {source}{}", bind_hint(source))]
    WireBind {
        /// The VM's name.
        vm: String,
        /// The VM's address.
        addr: IpAddr,
        /// The UDP port (`--bind-port`).
        port: u16,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// An incoming VM (migration) on a port that receives in udp mode.
    #[error(
        "VM {0}: incoming=yes needs raw receive (--wire-rx raw, CAP_NET_RAW): a udp-mode \
         port cannot take an address over while running"
    )]
    IncomingNeedsRaw(String),
    /// An incoming VM (migration) with an IPv6 GID on the soft port.
    #[error(
        "VM {0}: incoming=yes needs an IPv4 GID on the soft port: an IPv6 VM is read \
         through its own socket, which cannot be added while the daemon runs (the packet \
         and umad ports take IPv6 VMs by migration)"
    )]
    IncomingIpv6(String),
    /// The packet port could not be opened (`reason` says why and what to do).
    #[error("--port {port}: {reason}")]
    Packet {
        /// The port as given (`packet:DEV[:IFACE]`).
        port: String,
        /// What went wrong, and what to do.
        reason: String,
    },
    /// A VM's UDP socket refused the drop-all filter raw receive puts on it.
    #[error("VM {vm}: wire socket filter: {source}; --wire-rx udp does not need it")]
    WireFilter {
        /// The VM's name.
        vm: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The umad port could not be opened (`reason` says why and, where it can, what to
    /// do: ib_umad, permissions, the kernel CM, the P_Key table).
    #[error("--port {port}: {reason}")]
    Umad {
        /// The port as given (`umad:DEV:PORT`).
        port: String,
        /// What went wrong, and what to do.
        reason: String,
    },
}

/// Why a port refused a VM ([`WirePort::attach`](super::WirePort::attach),
/// [`WirePort::claim`](super::WirePort::claim)).
#[derive(Debug, thiserror::Error)]
pub enum PortError {
    /// Only the soft port moves VM addresses between hosts.
    #[error("this port cannot take over a VM's address (migration needs the soft port)")]
    CannotClaim,
    /// The soft port takes an address over only where it receives through its raw
    /// socket, so for IPv4 VMs in raw mode.
    #[error("migration needs raw receive (--wire-rx raw) and an IPv4 GID on the soft port")]
    ClaimNeedsRaw,
    /// Binding the VM's address failed.
    #[error(transparent)]
    Bind(Error),
    /// The port's VMs are fixed when it opens (a port that does not implement
    /// [`WirePort::add_vm`](super::WirePort::add_vm)).
    #[error("the {0} port serves the VMs it was started with: restart the daemon to change them")]
    FixedVms(String),
    /// The port knows no VM of that index.
    #[error("no VM {0}")]
    NoVm(usize),
    /// umad: the port's GID table could not be read.
    #[error("{port}: GID table: {source}")]
    GidTable {
        /// The port (`rxe0:1`).
        port: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// umad: the VM's GID is not a RoCE v2 entry of the port's GID table.
    #[error(
        "VM {vm}: GID {gid} is not a RoCE v2 entry of {port}'s GID table ({}): add the VM's \
         address to the device's netdev (e.g. `ip addr add {} dev eth0`), see docs/umad.md",
        table.display(),
        address_with_prefix(gid)
    )]
    GidNotInTable {
        /// The VM's name.
        vm: String,
        /// Its GID.
        gid: Gid,
        /// The port (`rxe0:1`).
        port: String,
        /// The port's GID table in sysfs.
        table: PathBuf,
    },
}

/// A GID as `ip addr add` takes it: an IPv4 address with /32, else the GID with /128.
fn address_with_prefix(gid: &Gid) -> String {
    match gid.to_ipv4() {
        Some(a) => format!("{a}/32"),
        None => format!("{gid}/128"),
    }
}

/// What raw receive needs, and the alternative.
pub const RAW_SOCKET_HOW: &str = "it needs CAP_NET_RAW: run as root, or grant it with \
    `setcap cap_net_raw+ep pvcm-backend` (or AmbientCapabilities=CAP_NET_RAW in a systemd \
    unit); --wire-rx udp needs no privilege but accepts only pvcm peers (see docs/daemon.md)";

/// What to look at when a VM's address does not bind: the port taken, or the address
/// not on this host.
fn bind_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::AddrInUse => {
            " (another process, or another pvcm-backend, holds this address and port: \
             stop it, or give this daemon another --bind-port)"
        }
        io::ErrorKind::AddrNotAvailable => {
            " (the address is not on this host: add it to an interface, e.g. `ip addr add`)"
        }
        _ => "",
    }
}

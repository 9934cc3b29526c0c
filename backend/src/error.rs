//! The daemon's error type.

use std::io;
use std::net::IpAddr;

use crate::config::ConfigError;

/// A daemon error: what failed, for the operator, and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid (the message names the option).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `--state-dir` could not be used.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The VMs changed at runtime could not be restored or served.
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    /// An OS call failed while setting up (binding a socket, creating an fd).
    #[error("{what}: {source}")]
    Io {
        /// What was being done, naming the VM or option concerned.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A socket could not be put at its path (`what`: the VM's vhost-user socket, or
    /// the control socket).
    #[error("{what}: {source}")]
    Socket {
        /// Which socket: `VM NAME: vhost-user socket`, `--control`.
        what: String,
        /// Why.
        #[source]
        source: crate::files::SocketPathError,
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
    #[error("VM {vm}: wire port {addr} port {port} (is the address local?): {source}")]
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

/// What raw receive needs, and the alternative.
pub const RAW_SOCKET_HOW: &str = "it needs CAP_NET_RAW: run as root, or grant it with \
    `setcap cap_net_raw+ep pvcm-backend` (or AmbientCapabilities=CAP_NET_RAW in a systemd \
    unit); --wire-rx udp needs no privilege but accepts only pvcm peers (see docs/daemon.md)";

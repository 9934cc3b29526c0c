//! The IP side of a RoCE multicast join: the VM's IGMP membership of the group on the
//! netdev of its RDMA port, as the kernel's `cma_igmp_send()` takes it for
//! `rdma_join_multicast()` (an IPv4 group on a RoCE v2 port, not a send-only join).
//!
//! The membership is a socket that joined the group (`IP_ADD_MEMBERSHIP` with the
//! netdev's index) and is held open while any join of the group lasts; the kernel
//! reports it in IGMP and keeps the NIC's multicast filter. [`IgmpSockets`] holds them:
//! the one place of the rdma_cm layer ([`super::cma`]) that does I/O.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// Why a membership could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// The netdev is not there (the kernel's `cma_igmp_send`: ENODEV).
    #[error("no network device {0}")]
    NoDevice(String),
    /// The socket could not be made or could not join.
    #[error("joining {group} on {netdev}: {err}")]
    Join {
        /// The group.
        group: Ipv4Addr,
        /// The netdev.
        netdev: String,
        /// What the socket call said.
        err: io::Error,
    },
}

impl MembershipError {
    /// The errno a JOIN answers with.
    pub fn errno(&self) -> i32 {
        match self {
            MembershipError::NoDevice(_) => libc::ENODEV,
            MembershipError::Join { err, .. } => err.raw_os_error().unwrap_or(libc::ENOMEM),
        }
    }
}

/// Memberships as sockets on one netdev, one per group.
#[derive(Debug)]
pub struct IgmpSockets {
    netdev: String,
    held: BTreeMap<Ipv4Addr, OwnedFd>,
}

impl IgmpSockets {
    /// Memberships on `netdev` (looked up at each join, so a netdev that comes later
    /// is found).
    pub fn new(netdev: &str) -> IgmpSockets {
        IgmpSockets {
            netdev: netdev.to_string(),
            held: BTreeMap::new(),
        }
    }

    fn ifindex(&self) -> Result<u32, MembershipError> {
        let none = || MembershipError::NoDevice(self.netdev.clone());
        let name = CString::new(self.netdev.as_str()).map_err(|_| none())?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call, which only
        // reads it.
        let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if i == 0 { Err(none()) } else { Ok(i) }
    }

    fn open(&self, group: Ipv4Addr, ifindex: u32) -> Result<OwnedFd, io::Error> {
        // SAFETY: socket(2) takes no pointers; its result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                libc::IPPROTO_UDP,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by nothing else.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let mreq = libc::ip_mreqn {
            imr_multiaddr: libc::in_addr {
                s_addr: u32::from_ne_bytes(group.octets()),
            },
            imr_address: libc::in_addr { s_addr: 0 },
            imr_ifindex: ifindex as libc::c_int,
        };
        // SAFETY: `mreq` is a valid `ip_mreqn` that outlives the call and its size is
        // the length given; the kernel only reads it.
        let r = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::IPPROTO_IP,
                libc::IP_ADD_MEMBERSHIP,
                (&raw const mreq).cast(),
                size_of::<libc::ip_mreqn>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sock)
    }

    /// Joins `group` (once per group: the caller counts the joins).
    pub fn join(&mut self, group: Ipv4Addr) -> Result<(), MembershipError> {
        if self.held.contains_key(&group) {
            return Ok(());
        }
        let ifindex = self.ifindex()?;
        let sock = self
            .open(group, ifindex)
            .map_err(|err| MembershipError::Join {
                group,
                netdev: self.netdev.clone(),
                err,
            })?;
        self.held.insert(group, sock);
        Ok(())
    }

    /// Leaves `group` (once its last join ended).
    pub fn leave(&mut self, group: Ipv4Addr) {
        // Closing the socket drops its membership.
        self.held.remove(&group);
    }

    /// The netdev the memberships are taken on.
    pub fn netdev(&self) -> &str {
        &self.netdev
    }

    /// The groups held.
    pub fn groups(&self) -> Vec<Ipv4Addr> {
        self.held.keys().copied().collect()
    }
}

//! Either IP header: [`IpRepr`], and [`IpHeader`], what the ICRC and emit take.

use core::fmt;
use std::net::IpAddr;

use crate::error::{Error, Result, check_len};

use super::consts::*;
use super::ipv4::Ipv4Repr;
use super::ipv6::Ipv6Repr;

/// The IP header of a frame's datagram, either version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpRepr {
    /// RoCEv2 over IPv4 (IPv4-mapped GIDs).
    V4(Ipv4Repr),
    /// RoCEv2 over IPv6.
    V6(Ipv6Repr),
}

impl IpRepr {
    /// The header pvcm computes a frame's ICRC under, from the two GIDs: IPv4 when both
    /// are IPv4-mapped ([`Ipv4Repr::new`]), IPv6 when neither is ([`Ipv6Repr::new`]);
    /// `None` for one of each, which no datagram can carry.
    pub fn from_gids(src: crate::Gid, dst: crate::Gid) -> Option<IpRepr> {
        match (src.to_ipv4(), dst.to_ipv4()) {
            (Some(s), Some(d)) => Some(IpRepr::V4(Ipv4Repr::new(s, d))),
            (None, None) => Some(IpRepr::V6(Ipv6Repr::new(src.into(), dst.into()))),
            _ => None,
        }
    }

    /// The header for two addresses of one family (`None` for mixed families).
    pub fn from_addrs(src: IpAddr, dst: IpAddr) -> Option<IpRepr> {
        match (src, dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => Some(IpRepr::V4(Ipv4Repr::new(s, d))),
            (IpAddr::V6(s), IpAddr::V6(d)) => Some(IpRepr::V6(Ipv6Repr::new(s, d))),
            _ => None,
        }
    }

    /// Source address.
    pub fn src(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => IpAddr::V4(h.src),
            IpRepr::V6(h) => IpAddr::V6(h.src),
        }
    }

    /// Destination address.
    pub fn dst(&self) -> IpAddr {
        match self {
            IpRepr::V4(h) => IpAddr::V4(h.dst),
            IpRepr::V6(h) => IpAddr::V6(h.dst),
        }
    }

    /// The GID of an address: IPv4-mapped for IPv4, the address itself for IPv6.
    pub fn gid(addr: IpAddr) -> crate::Gid {
        match addr {
            IpAddr::V4(a) => crate::Gid::from_ipv4(a),
            IpAddr::V6(a) => crate::Gid::from(a),
        }
    }

    /// Length of the header: 20 or 40.
    pub fn header_len(&self) -> usize {
        match self {
            IpRepr::V4(_) => IPV4_HEADER_LEN,
            IpRepr::V6(_) => IPV6_HEADER_LEN,
        }
    }

    /// Length of a whole datagram carrying one frame: 308 or 328.
    pub fn datagram_len(&self) -> usize {
        self.header_len() + UDP_HEADER_LEN + FRAME_LEN
    }

    /// The same header with its length field set for one frame.
    pub fn for_frame(&self) -> IpRepr {
        match *self {
            IpRepr::V4(h) => IpRepr::V4(Ipv4Repr {
                total_len: DATAGRAM_LEN as u16,
                ..h
            }),
            IpRepr::V6(h) => IpRepr::V6(Ipv6Repr {
                payload_len: (UDP_HEADER_LEN + FRAME_LEN) as u16,
                ..h
            }),
        }
    }

    /// Writes the header (20 or 40 bytes) at the start of `buf`.
    pub fn emit_header(&self, buf: &mut [u8]) -> Result<()> {
        match self {
            IpRepr::V4(h) => h.emit(buf),
            IpRepr::V6(h) => h.emit(buf),
        }
    }

    /// Parses the IP header at the start of `buf`, by its version nibble.
    pub fn parse(buf: &[u8]) -> Result<IpRepr> {
        check_len(buf, 1)?;
        match buf[0] >> 4 {
            4 => Ipv4Repr::parse(buf).map(IpRepr::V4),
            6 => Ipv6Repr::parse(buf).map(IpRepr::V6),
            _ => Err(Error::Unsupported("IP version other than 4 or 6")),
        }
    }
}

impl From<Ipv4Repr> for IpRepr {
    fn from(h: Ipv4Repr) -> IpRepr {
        IpRepr::V4(h)
    }
}

impl From<Ipv6Repr> for IpRepr {
    fn from(h: Ipv6Repr) -> IpRepr {
        IpRepr::V6(h)
    }
}

impl fmt::Display for IpRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IpRepr::V4(h) => h.fmt(f),
            IpRepr::V6(h) => h.fmt(f),
        }
    }
}

/// An IP header a frame's ICRC can be computed under: [`Ipv4Repr`], [`Ipv6Repr`] or
/// [`IpRepr`].
pub trait IpHeader {
    /// The header as the enum of both versions.
    fn ip_repr(&self) -> IpRepr;
}

impl IpHeader for Ipv4Repr {
    fn ip_repr(&self) -> IpRepr {
        IpRepr::V4(*self)
    }
}

impl IpHeader for Ipv6Repr {
    fn ip_repr(&self) -> IpRepr {
        IpRepr::V6(*self)
    }
}

impl IpHeader for IpRepr {
    fn ip_repr(&self) -> IpRepr {
        *self
    }
}

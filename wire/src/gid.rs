//! Global identifiers (GIDs) and their RoCEv2 IPv4-mapped form.

use core::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};

/// A 128-bit InfiniBand GID, in wire (big-endian) byte order.
///
/// On RoCEv2 an IPv4 address is carried as the IPv4-mapped IPv6 address
/// `::ffff:a.b.c.d`; [`Gid::from_ipv4`] and [`Gid::to_ipv4`] convert.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID.
    pub const ZERO: Gid = Gid([0; 16]);

    /// Builds a GID from its 16 wire bytes. Fails with `None` unless exactly 16 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Option<Gid> {
        Some(Gid(bytes.try_into().ok()?))
    }

    /// The IPv4-mapped GID `::ffff:a.b.c.d` RoCEv2 uses for an IPv4 address.
    pub fn from_ipv4(addr: Ipv4Addr) -> Gid {
        Gid(addr.to_ipv6_mapped().octets())
    }

    /// The IPv4 address of an IPv4-mapped GID, or `None` for any other GID.
    pub fn to_ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// The subnet prefix (upper 64 bits).
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes([
            self.0[0], self.0[1], self.0[2], self.0[3], self.0[4], self.0[5], self.0[6], self.0[7],
        ])
    }

    /// The interface ID (lower 64 bits; a port GUID on InfiniBand).
    pub fn interface_id(&self) -> u64 {
        u64::from_be_bytes([
            self.0[8], self.0[9], self.0[10], self.0[11], self.0[12], self.0[13], self.0[14],
            self.0[15],
        ])
    }

    /// Why this GID cannot be the address of a RoCEv2 port (a VM's own GID, or the GID
    /// it sends to), or `None` if it can be: an IPv4-mapped GID of a unicast IPv4
    /// address, or a unicast IPv6 address. Refused: the unspecified address, multicast
    /// and broadcast, the IPv6 loopback `::1`, and IPv4-compatible `::a.b.c.d` (not
    /// IPv4-mapped: no RoCE stack uses it). IPv4 loopback (127/8) is accepted: local
    /// tests run on it.
    pub fn roce_unicast_problem(&self) -> Option<&'static str> {
        if let Some(v4) = self.to_ipv4() {
            return if v4.is_unspecified() {
                Some("the unspecified IPv4 address")
            } else if v4.is_broadcast() {
                Some("the IPv4 broadcast address")
            } else if v4.is_multicast() {
                Some("an IPv4 multicast address")
            } else {
                None
            };
        }
        let a = Ipv6Addr::from(self.0);
        if a.is_unspecified() {
            Some("the unspecified address")
        } else if a.is_loopback() {
            Some("the IPv6 loopback address")
        } else if a.is_multicast() {
            Some("an IPv6 multicast address")
        } else if self.0[..12] == [0; 12] {
            Some("an IPv4-compatible address (::a.b.c.d; RoCE uses ::ffff:a.b.c.d)")
        } else {
            None
        }
    }

    /// An IPv6 link-local GID (fe80::/10): reachable only through one interface, so a
    /// socket needs its scope (interface index).
    pub fn is_link_local(&self) -> bool {
        self.to_ipv4().is_none() && self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// A GID from a subnet prefix and an interface ID.
    pub fn from_parts(subnet_prefix: u64, interface_id: u64) -> Gid {
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(&subnet_prefix.to_be_bytes());
        g[8..].copy_from_slice(&interface_id.to_be_bytes());
        Gid(g)
    }
}

impl From<Ipv6Addr> for Gid {
    fn from(a: Ipv6Addr) -> Gid {
        Gid(a.octets())
    }
}

impl From<Gid> for Ipv6Addr {
    fn from(g: Gid) -> Ipv6Addr {
        Ipv6Addr::from(g.0)
    }
}

impl core::str::FromStr for Gid {
    type Err = std::net::AddrParseError;
    /// Accepts an IPv6 text form (`fe80::1`, `::ffff:10.0.0.1`) or a plain IPv4
    /// address, which becomes its IPv4-mapped GID.
    fn from_str(s: &str) -> Result<Gid, Self::Err> {
        match s.parse::<Ipv4Addr>() {
            Ok(v4) => Ok(Gid::from_ipv4(v4)),
            Err(_) => Ok(Gid::from(s.parse::<Ipv6Addr>()?)),
        }
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_round_trip() {
        let g = Gid::from_ipv4(Ipv4Addr::new(192, 0, 2, 7));
        assert_eq!(
            g.0,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 0, 2, 7]
        );
        assert_eq!(g.to_ipv4(), Some(Ipv4Addr::new(192, 0, 2, 7)));
        assert_eq!(g.to_string(), "::ffff:192.0.2.7");
        assert_eq!("192.0.2.7".parse::<Gid>().unwrap(), g);
        assert_eq!("::ffff:192.0.2.7".parse::<Gid>().unwrap(), g);
    }

    #[test]
    fn roce_unicast() {
        let g = |s: &str| s.parse::<Gid>().unwrap();
        for ok in ["10.0.0.1", "127.0.0.1", "2001:db8::1", "fe80::1", "fd00::5"] {
            assert_eq!(g(ok).roce_unicast_problem(), None, "{ok}");
        }
        for bad in [
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::",
            "::1",
            "ff02::1",
            "::10.0.0.1",
        ] {
            assert!(g(bad).roce_unicast_problem().is_some(), "{bad}");
        }
        assert!(g("fe80::1").is_link_local() && g("febf::1").is_link_local());
        assert!(!g("fec0::1").is_link_local() && !g("10.0.0.1").is_link_local());
    }

    #[test]
    fn non_mapped_is_not_ipv4() {
        let g = Gid::from_parts(0xfe80_0000_0000_0000, 0x0002_c903_0000_1234);
        assert_eq!(g.to_ipv4(), None);
        assert_eq!(g.subnet_prefix(), 0xfe80_0000_0000_0000);
        assert_eq!(g.interface_id(), 0x0002_c903_0000_1234);
        assert!("not a gid".parse::<Gid>().is_err());
    }
}

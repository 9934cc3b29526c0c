//! Compatibility with rdma_cm's IP port spaces, so a librdmacm peer can talk to us:
//! service IDs (`0x0000000001060000 | port` for TCP) and the `cma_hdr` that rdma_cm
//! puts in front of the application's private data in a REQ (and SIDR_REQ).
//!
//! The header, as Linux's `drivers/infiniband/core/cma.c` (`cma_format_hdr()`) writes
//! it, is 36 bytes: `cma_version` (0x00), `ip_version` (4 or 6 in the upper nibble),
//! the source port (be16), then the source and destination addresses as 16-byte
//! `union cma_ip_addr` fields. For IPv4 the kernel leaves the first 12 bytes of each
//! zero and puts the address in the last 4 (`ip4.pad[3]`, `ip4.addr`); that is what
//! [`CmaHdr::to_bytes`] emits. [`CmaHdr::parse`] reads the last 4 bytes whatever the
//! padding, so an IPv4-mapped (`::ffff:a.b.c.d`) field parses too.
//! A connection between two GIDs that are not IPv4-mapped (RoCEv2 over IPv6) carries
//! `ip_version` 6 and the two 16-byte addresses, as the kernel writes them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use pvcm_wire::Gid;

/// rdma_cm port space of IPoIB.
pub const RDMA_PS_IPOIB: u16 = 0x0002;
/// rdma_cm TCP port space (RC connections).
pub const RDMA_PS_TCP: u16 = 0x0106;
/// rdma_cm UDP port space (UD, resolved with SIDR).
pub const RDMA_PS_UDP: u16 = 0x0111;
/// rdma_cm IB port space.
pub const RDMA_PS_IB: u16 = 0x013F;
/// `cma_version` of the header.
pub const CMA_VERSION: u8 = 0x00;
/// Length of the header.
pub const CMA_HDR_LEN: usize = 36;
/// Private data an rdma_cm application may put in a REQ after the header (92 - 36).
pub const REQ_USER_PRIVATE_DATA_LEN: usize = pvcm_wire::cm::req::PRIVATE_DATA_LEN - CMA_HDR_LEN;

/// rdma_cm's service ID for a port in a port space: `0x01 << 24 | ps << 16 | port`
/// (e.g. TCP port 7471: `0x0000000001061d2f`).
pub fn service_id(ps: u16, port: u16) -> u64 {
    (u64::from(ps) << 16) | u64::from(port)
}

/// rdma_cm's service ID for a TCP port: `0x0000000001060000 | port`.
pub fn tcp_service_id(port: u16) -> u64 {
    service_id(RDMA_PS_TCP, port)
}

/// rdma_cm's service ID for a UDP port: `0x0000000001110000 | port`.
pub fn udp_service_id(port: u16) -> u64 {
    service_id(RDMA_PS_UDP, port)
}

/// The (port space, port) of an rdma_cm IP service ID (`RDMA_IB_IP_PREFIX`
/// 0x0000000001000000 under mask 0xFFFFFFFFFF000000); `None` for other service IDs.
pub fn parse_service_id(sid: u64) -> Option<(u16, u16)> {
    (sid & 0xFFFF_FFFF_FF00_0000 == 0x0000_0000_0100_0000)
        .then_some(((sid >> 16) as u16, sid as u16))
}

/// The flow label Linux's rdma_cm gives a RoCEv2 path (`cma_get_roce_udp_flow_label()`,
/// for IPv4 and for IPv6 without a flow label of its own): the source and destination
/// ports hashed as `source * 31 + destination`, cut to the 20-bit flow label. The RoCEv2
/// UDP source port is derived from it, so connections get per-connection entropy.
pub fn roce_flow_label(src_port: u16, dst_port: u16) -> u32 {
    (u32::from(src_port) * 31 + u32::from(dst_port)) & 0xF_FFFF
}

/// The flow label of a REQ as rdma_cm derives it ([`roce_flow_label`]): the destination
/// port from an rdma_cm IP service ID, the source port from the `cma_hdr` at the start
/// of the private data. `None` when the REQ is not an rdma_cm IP one.
pub fn req_flow_label(service_id: u64, private_data: &[u8]) -> Option<u32> {
    let (_, dst_port) = parse_service_id(service_id)?;
    let hdr = CmaHdr::parse(private_data).ok()?;
    Some(roce_flow_label(hdr.src_port, dst_port))
}

/// Linux's default `net.ipv4.ip_local_port_range`, where rdma_cm picks the source port
/// of an unbound id (`cma_alloc_any_port()`).
pub const EPHEMERAL_PORTS: core::ops::RangeInclusive<u16> = 32768..=60999;

/// Source ports for rdma_cm ids that were not bound to one, picked the way rdma_cm's
/// `cma_alloc_any_port()` does: from a random point of the ephemeral range, then the next
/// free port, never one still in use.
#[derive(Debug, Clone)]
pub struct EphemeralPorts {
    next: u16,
    used: super::FastSet<u16>,
}

impl EphemeralPorts {
    /// An allocator starting at a point of the range chosen by `seed`.
    pub fn new(seed: u64) -> EphemeralPorts {
        let (lo, hi) = (*EPHEMERAL_PORTS.start(), *EPHEMERAL_PORTS.end());
        let span = u64::from(hi - lo) + 1;
        let start = crate::cm::SplitMix64::new(seed).below(span) as u16;
        EphemeralPorts {
            next: lo + start,
            used: super::FastSet::default(),
        }
    }

    /// A free port, held until [`EphemeralPorts::release`]; `None` when all are in use.
    pub fn alloc(&mut self) -> Option<u16> {
        let (lo, hi) = (*EPHEMERAL_PORTS.start(), *EPHEMERAL_PORTS.end());
        let span = usize::from(hi - lo) + 1;
        for _ in 0..span {
            let p = self.next;
            self.next = if p >= hi { lo } else { p + 1 };
            if self.used.insert(p) {
                return Some(p);
            }
        }
        None
    }

    /// The next port of the range, whether held or not: for more ids than the range has
    /// ports (Linux would refuse the bind; a benchmark shares ports instead).
    pub fn shared(&mut self) -> u16 {
        let (lo, hi) = (*EPHEMERAL_PORTS.start(), *EPHEMERAL_PORTS.end());
        let p = self.next;
        self.next = if p >= hi { lo } else { p + 1 };
        p
    }

    /// Gives a port back.
    pub fn release(&mut self, port: u16) {
        self.used.remove(&port);
    }

    /// Ports in use.
    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

/// What is wrong with a `cma_hdr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CmaError {
    /// Fewer than 36 bytes.
    #[error("private data of {0} bytes cannot hold a 36-byte cma_hdr")]
    TooShort(usize),
    /// `cma_version` is not 0.
    #[error("cma_version {0:#04x} is not 0")]
    Version(u8),
    /// IP version neither 4 nor 6.
    #[error("ip_version {0} is neither 4 nor 6")]
    IpVersion(u8),
    /// Source and destination of different families.
    #[error("source and destination addresses of different families")]
    FamilyMismatch,
    /// Header and user data beyond the message's private data.
    #[error("{len} bytes of user private data, at most {max} after the header")]
    TooLong {
        /// Bytes given.
        len: usize,
        /// Room after the header.
        max: usize,
    },
}

/// rdma_cm's private-data header (`struct cma_hdr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CmaHdr {
    /// Source address (the connecting side).
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port.
    pub src_port: u16,
}

fn field(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(a) => {
            let mut f = [0u8; 16];
            f[12..].copy_from_slice(&a.octets());
            f
        }
        IpAddr::V6(a) => a.octets(),
    }
}

fn gid_addr(g: Gid) -> IpAddr {
    match g.to_ipv4() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(Ipv6Addr::from(g)),
    }
}

impl CmaHdr {
    /// The header for a connection between two RoCE GIDs: IPv4-mapped GIDs give IPv4
    /// addresses, others IPv6.
    pub fn from_gids(src: Gid, dst: Gid, src_port: u16) -> CmaHdr {
        let (s, d) = match (gid_addr(src), gid_addr(dst)) {
            (s @ IpAddr::V4(_), d @ IpAddr::V4(_)) | (s @ IpAddr::V6(_), d @ IpAddr::V6(_)) => {
                (s, d)
            }
            _ => (
                IpAddr::V6(Ipv6Addr::from(src)),
                IpAddr::V6(Ipv6Addr::from(dst)),
            ),
        };
        CmaHdr {
            src: s,
            dst: d,
            src_port,
        }
    }

    /// The 36 header bytes, as the kernel writes them.
    pub fn to_bytes(&self) -> Result<[u8; CMA_HDR_LEN], CmaError> {
        let ver = match (self.src, self.dst) {
            (IpAddr::V4(_), IpAddr::V4(_)) => 4u8,
            (IpAddr::V6(_), IpAddr::V6(_)) => 6u8,
            _ => return Err(CmaError::FamilyMismatch),
        };
        let mut b = [0u8; CMA_HDR_LEN];
        b[0] = CMA_VERSION;
        b[1] = ver << 4;
        b[2..4].copy_from_slice(&self.src_port.to_be_bytes());
        b[4..20].copy_from_slice(&field(self.src));
        b[20..36].copy_from_slice(&field(self.dst));
        Ok(b)
    }

    /// Parses the header at the start of a REQ's private data.
    pub fn parse(pd: &[u8]) -> Result<CmaHdr, CmaError> {
        let b: &[u8; CMA_HDR_LEN] = pd
            .get(..CMA_HDR_LEN)
            .and_then(|s| s.try_into().ok())
            .ok_or(CmaError::TooShort(pd.len()))?;
        if b[0] != CMA_VERSION {
            return Err(CmaError::Version(b[0]));
        }
        let addr = |f: &[u8]| -> Option<[u8; 16]> { f.try_into().ok() };
        let (s, d) = (
            addr(&b[4..20]).unwrap_or_default(),
            addr(&b[20..36]).unwrap_or_default(),
        );
        let (src, dst) = match b[1] >> 4 {
            4 => (
                IpAddr::V4(Ipv4Addr::new(s[12], s[13], s[14], s[15])),
                IpAddr::V4(Ipv4Addr::new(d[12], d[13], d[14], d[15])),
            ),
            6 => (IpAddr::V6(Ipv6Addr::from(s)), IpAddr::V6(Ipv6Addr::from(d))),
            v => return Err(CmaError::IpVersion(v)),
        };
        Ok(CmaHdr {
            src,
            dst,
            src_port: u16::from_be_bytes([b[2], b[3]]),
        })
    }
}

/// A REQ's private data as rdma_cm builds it: the header, then the user's bytes (at
/// most [`REQ_USER_PRIVATE_DATA_LEN`]).
pub fn req_private_data(hdr: &CmaHdr, user: &[u8]) -> Result<Vec<u8>, CmaError> {
    with_header(hdr, user, pvcm_wire::cm::req::PRIVATE_DATA_LEN)
}

/// A SIDR_REQ's private data as rdma_cm builds it (UDP port space).
pub fn sidr_req_private_data(hdr: &CmaHdr, user: &[u8]) -> Result<Vec<u8>, CmaError> {
    with_header(hdr, user, pvcm_wire::cm::sidr_req::PRIVATE_DATA_LEN)
}

fn with_header(hdr: &CmaHdr, user: &[u8], total: usize) -> Result<Vec<u8>, CmaError> {
    let max = total - CMA_HDR_LEN;
    if user.len() > max {
        return Err(CmaError::TooLong {
            len: user.len(),
            max,
        });
    }
    let mut v = Vec::with_capacity(CMA_HDR_LEN + user.len());
    v.extend_from_slice(&hdr.to_bytes()?);
    v.extend_from_slice(user);
    Ok(v)
}

/// Splits received REQ/SIDR_REQ private data into the rdma_cm header and the user's
/// bytes (the rest of the field, zero padding included).
pub fn split_private_data(pd: &[u8]) -> Result<(CmaHdr, &[u8]), CmaError> {
    let hdr = CmaHdr::parse(pd)?;
    Ok((hdr, &pd[CMA_HDR_LEN..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_ids() {
        assert_eq!(tcp_service_id(7471), 0x0000_0000_0106_1d2f);
        assert_eq!(udp_service_id(1), 0x0000_0000_0111_0001);
        assert_eq!(
            parse_service_id(0x0000_0000_0106_1d2f),
            Some((RDMA_PS_TCP, 7471))
        );
        assert_eq!(parse_service_id(0x1000_0000_0000_0001), None);
        assert_eq!(
            parse_service_id(service_id(RDMA_PS_IB, 9)),
            Some((RDMA_PS_IB, 9))
        );
    }

    #[test]
    fn flow_label_hashes_the_ports_like_rdma_cm() {
        // sport * 31 + dport, 20 bits.
        assert_eq!(roce_flow_label(0, 7471), 7471);
        assert_eq!(roce_flow_label(40000, 7471), (40000 * 31 + 7471) & 0xF_FFFF);
        assert_eq!(roce_flow_label(65535, 65535), (65535 * 32) & 0xF_FFFF);
        let a = Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1));
        let b = Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 2));
        let pd = req_private_data(&CmaHdr::from_gids(a, b, 33000), b"x").unwrap();
        assert_eq!(
            req_flow_label(tcp_service_id(7471), &pd),
            Some(roce_flow_label(33000, 7471))
        );
        // Not rdma_cm: no header, or not an IP service ID.
        assert_eq!(req_flow_label(tcp_service_id(7471), b"plain"), None);
        assert_eq!(req_flow_label(0x1000_0000_0000_0001, &pd), None);
    }

    #[test]
    fn ephemeral_ports_are_distinct_in_range_and_reused_after_release() {
        let mut p = EphemeralPorts::new(7);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let x = p.alloc().unwrap();
            assert!(EPHEMERAL_PORTS.contains(&x));
            assert!(seen.insert(x), "{x} twice");
        }
        assert_eq!(p.in_use(), 1000);
        let first = *seen.iter().next().unwrap();
        p.release(first);
        assert_eq!(p.in_use(), 999);
        // The whole range, then exhaustion.
        let left = EPHEMERAL_PORTS.len() - 999;
        for _ in 0..left {
            assert!(p.alloc().is_some());
        }
        assert_eq!(p.alloc(), None);
        assert!(EPHEMERAL_PORTS.contains(&p.shared()));
        // Different seeds start elsewhere.
        assert_ne!(
            EphemeralPorts::new(1).alloc(),
            EphemeralPorts::new(2).alloc()
        );
    }

    #[test]
    fn ipv4_header_is_the_kernels() {
        let h = CmaHdr {
            src: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
            dst: IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
            src_port: 0x1234,
        };
        let b = h.to_bytes().unwrap();
        let mut want = [0u8; 36];
        want[1] = 0x40;
        want[2] = 0x12;
        want[3] = 0x34;
        want[16..20].copy_from_slice(&[10, 0, 0, 1]);
        want[32..36].copy_from_slice(&[10, 0, 0, 2]);
        assert_eq!(b, want);
        assert_eq!(CmaHdr::parse(&b), Ok(h));
        // An IPv4-mapped padding parses the same.
        let mut m = b;
        m[14] = 0xff;
        m[15] = 0xff;
        assert_eq!(CmaHdr::parse(&m), Ok(h));
    }

    /// The header of a real IPv6 rdma_cm REQ: Linux 6.1's rdma_cm over rxe (ucmatose
    /// from fd99::3 to fd99::2, source port 0xa358), the first 36 bytes of the REQ's
    /// private data in wire/tests/roce.rs's captured IPv6 REQ.
    #[test]
    fn ipv6_header_is_the_kernels() {
        let kernel: [u8; 36] = [
            0x00, 0x60, 0xa3, 0x58, // version 0, IP version 6, source port
            0xfd, 0x99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x03, // fd99::3
            0xfd, 0x99, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x02, // fd99::2
        ];
        let h = CmaHdr::parse(&kernel).unwrap();
        let (a, b): (Ipv6Addr, Ipv6Addr) = ("fd99::3".parse().unwrap(), "fd99::2".parse().unwrap());
        assert_eq!(h.src, IpAddr::V6(a));
        assert_eq!(h.dst, IpAddr::V6(b));
        assert_eq!(h.src_port, 0xa358);
        // The header pvcm builds for the same connection is the kernel's, byte for byte.
        let mine = CmaHdr::from_gids(Gid::from(a), Gid::from(b), 0xa358);
        assert_eq!(mine.to_bytes().unwrap(), kernel);
        // And the flow label rdma_cm derives from it.
        assert_eq!(
            req_flow_label(tcp_service_id(7471), &kernel),
            Some(roce_flow_label(0xa358, 7471))
        );
    }

    #[test]
    fn errors() {
        assert_eq!(CmaHdr::parse(&[0; 35]), Err(CmaError::TooShort(35)));
        let mut b = [0u8; 36];
        b[0] = 1;
        assert_eq!(CmaHdr::parse(&b), Err(CmaError::Version(1)));
        b[0] = 0;
        b[1] = 0x50;
        assert_eq!(CmaHdr::parse(&b), Err(CmaError::IpVersion(5)));
        let mixed = CmaHdr {
            src: IpAddr::V4(Ipv4Addr::LOCALHOST),
            dst: IpAddr::V6(Ipv6Addr::LOCALHOST),
            src_port: 1,
        };
        assert_eq!(mixed.to_bytes(), Err(CmaError::FamilyMismatch));
        let h = CmaHdr::from_gids(Gid::ZERO, Gid::ZERO, 1);
        assert_eq!(
            req_private_data(&h, &[0; 57]),
            Err(CmaError::TooLong { len: 57, max: 56 })
        );
    }

    #[test]
    fn round_trip_through_private_data() {
        let a = Gid::from_ipv4(Ipv4Addr::new(192, 0, 2, 1));
        let b = Gid::from_ipv4(Ipv4Addr::new(192, 0, 2, 2));
        let h = CmaHdr::from_gids(a, b, 40000);
        assert_eq!(h.src, IpAddr::V4(Ipv4Addr::new(192, 0, 2, 1)));
        let pd = req_private_data(&h, b"hello").unwrap();
        assert_eq!(pd.len(), 41);
        let mut field = [0u8; 92];
        field[..pd.len()].copy_from_slice(&pd);
        let (h2, user) = split_private_data(&field).unwrap();
        assert_eq!(h2, h);
        assert_eq!(&user[..5], b"hello");
        assert_eq!(user.len(), 56);
        let v6 = CmaHdr::from_gids(Gid::from_parts(0xfe80 << 48, 1), b, 1);
        assert_eq!(v6.to_bytes().unwrap()[1], 0x60);
        assert_eq!(CmaHdr::parse(&v6.to_bytes().unwrap()), Ok(v6));
        assert_eq!(sidr_req_private_data(&h, &[1; 180]).unwrap().len(), 216);
    }
}

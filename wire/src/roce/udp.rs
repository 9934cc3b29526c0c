//! The UDP header of a frame's datagram (RFC 768).

use core::fmt;
use std::net::Ipv6Addr;

use crate::error::{Error, Result, check_len};

use super::consts::*;

/// A UDP header (RFC 768).
pub mod field {
    use crate::field::Bits;
    /// Source port, be16.
    pub const SRC_PORT: Bits = Bits::bytes(0, 2);
    /// Destination port, be16.
    pub const DST_PORT: Bits = Bits::bytes(2, 2);
    /// Length of header and payload, be16.
    pub const LENGTH: Bits = Bits::bytes(4, 2);
    /// Checksum, be16 (0: none, allowed over IPv4).
    pub const CHECKSUM: Bits = Bits::bytes(6, 2);
}

/// The UDP checksum over IPv6 (RFC 8200 section 8.1): the pseudo-header (addresses,
/// upper-layer length, next header 17) and `udp`, the UDP header (its checksum field
/// read as zero) and payload. A computed 0 is sent as 0xFFFF.
pub fn udp6_checksum(src: &Ipv6Addr, dst: &Ipv6Addr, udp: &[u8]) -> u16 {
    let mut sum: u64 = 0;
    let mut add = |bytes: &[u8]| {
        for c in bytes.chunks(2) {
            let hi = c.first().copied().unwrap_or(0);
            let lo = c.get(1).copied().unwrap_or(0);
            sum += u64::from(u16::from_be_bytes([hi, lo]));
        }
    };
    add(&src.octets());
    add(&dst.octets());
    add(&(udp.len() as u32).to_be_bytes());
    add(&[0, 0, 0, IP_PROTOCOL_UDP]);
    add(udp.get(..6).unwrap_or(udp));
    add(udp.get(8..).unwrap_or(&[]));
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    match !(sum as u16) {
        0 => 0xFFFF,
        c => c,
    }
}

/// The UDP header of a frame's datagram.
///
/// It is always emitted with checksum 0 ("no checksum", which RFC 768 allows over IPv4
/// and which `rdma_rxe` sends too); the ICRC masks the checksum, so a kernel-computed
/// checksum on the real packet changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UdpRepr {
    /// Source port.
    pub src_port: u16,
    /// Destination port ([`UDP_PORT`]).
    pub dst_port: u16,
    /// Length of header and payload (`8 + FRAME_LEN` = 288 for a frame).
    pub length: u16,
}

impl UdpRepr {
    /// The UDP header of a frame from `src_port` to port 4791.
    pub fn new(src_port: u16) -> UdpRepr {
        UdpRepr {
            src_port,
            dst_port: UDP_PORT,
            length: (UDP_HEADER_LEN + FRAME_LEN) as u16,
        }
    }

    /// Parses the 8-byte UDP header at the start of `buf` (the checksum is not checked:
    /// the ICRC covers the frame). Fails on a short buffer or a length below 8.
    pub fn parse(buf: &[u8]) -> Result<UdpRepr> {
        use self::field as f;
        check_len(buf, UDP_HEADER_LEN)?;
        let length = f::LENGTH.get(buf) as u16;
        if usize::from(length) < UDP_HEADER_LEN {
            return Err(Error::Reserved {
                field: "udp.length",
                value: length.into(),
            });
        }
        Ok(UdpRepr {
            src_port: f::SRC_PORT.get(buf) as u16,
            dst_port: f::DST_PORT.get(buf) as u16,
            length,
        })
    }

    /// Writes the 8-byte header, checksum 0, into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        use self::field as f;
        check_len(buf, UDP_HEADER_LEN)?;
        f::SRC_PORT.set(buf, self.src_port.into());
        f::DST_PORT.set(buf, self.dst_port.into());
        f::LENGTH.set(buf, self.length.into());
        f::CHECKSUM.set(buf, 0);
        Ok(())
    }
}

impl fmt::Display for UdpRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "UDP {} -> {} len={}",
            self.src_port, self.dst_port, self.length
        )
    }
}

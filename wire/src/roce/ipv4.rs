//! The IPv4 header of a frame's datagram (RFC 791, no options).

use core::fmt;
use std::net::Ipv4Addr;

use crate::error::{Error, Result, check_len};

use super::consts::*;

/// An IPv4 header without options (RFC 791).
pub mod field {
    use crate::field::Bits;
    /// Version, 4 bits.
    pub const VERSION: Bits = Bits::new(0, 1, 4, 4);
    /// Header length in 32-bit words, 4 bits.
    pub const IHL: Bits = Bits::new(0, 1, 0, 4);
    /// Type of service (DSCP and ECN), u8.
    pub const TOS: Bits = Bits::bytes(1, 1);
    /// Total length, be16.
    pub const TOTAL_LEN: Bits = Bits::bytes(2, 2);
    /// Identification, be16.
    pub const IDENT: Bits = Bits::bytes(4, 2);
    /// Don't Fragment, 1 bit.
    pub const DF: Bits = Bits::new(6, 1, 6, 1);
    /// More Fragments, 1 bit.
    pub const MF: Bits = Bits::new(6, 1, 5, 1);
    /// Fragment offset, 13 bits.
    pub const FRAG_OFFSET: Bits = Bits::new(6, 2, 0, 13);
    /// Time to live, u8.
    pub const TTL: Bits = Bits::bytes(8, 1);
    /// Protocol, u8.
    pub const PROTOCOL: Bits = Bits::bytes(9, 1);
    /// Header checksum, be16.
    pub const CHECKSUM: Bits = Bits::bytes(10, 2);
    /// Source address, be32.
    pub const SRC: Bits = Bits::bytes(12, 4);
    /// Destination address, be32.
    pub const DST: Bits = Bits::bytes(16, 4);
}

/// The IPv4 header of a frame's datagram, as far as the ICRC and a capture need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv4Repr {
    /// Source address.
    pub src: Ipv4Addr,
    /// Destination address.
    pub dst: Ipv4Addr,
    /// Identification (covered by the ICRC; 0 for pvcm, see the module docs).
    pub identification: u16,
    /// Don't Fragment (covered by the ICRC; set for pvcm).
    pub dont_fragment: bool,
    /// Time to live (masked out of the ICRC).
    pub ttl: u8,
    /// Type of service: DSCP << 2 | ECN (masked out of the ICRC).
    pub tos: u8,
    /// Protocol ([`IP_PROTOCOL_UDP`]).
    pub protocol: u8,
    /// Total length of the datagram, header included ([`DATAGRAM_LEN`] for a frame).
    pub total_len: u16,
}

/// The Internet checksum (RFC 1071) of a header whose checksum field reads zero.
pub fn internet_checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for c in bytes.chunks(2) {
        let hi = c.first().copied().unwrap_or(0);
        let lo = c.get(1).copied().unwrap_or(0);
        sum += u32::from(u16::from_be_bytes([hi, lo]));
    }
    while sum > 0xFFFF {
        sum = (sum & 0xFFFF) + (sum >> 16);
    }
    !(sum as u16)
}

impl Ipv4Repr {
    /// The header Linux writes for a pvcm frame sent from an unconnected UDP socket:
    /// identification 0, DF set, TTL 64, TOS 0, UDP, total length [`DATAGRAM_LEN`].
    pub fn new(src: Ipv4Addr, dst: Ipv4Addr) -> Ipv4Repr {
        Ipv4Repr {
            src,
            dst,
            identification: 0,
            dont_fragment: true,
            ttl: 64,
            tos: 0,
            protocol: IP_PROTOCOL_UDP,
            total_len: DATAGRAM_LEN as u16,
        }
    }

    /// Parses a 20-byte IPv4 header at the start of `buf`. Fails on a short buffer,
    /// another IP version, options, fragments ([`Error::Unsupported`]), a total length
    /// that is not at least the header's, or a bad header checksum
    /// ([`Error::Ipv4Checksum`]). Any protocol is accepted.
    pub fn parse(buf: &[u8]) -> Result<Ipv4Repr> {
        use self::field as f;
        check_len(buf, IPV4_HEADER_LEN)?;
        match f::VERSION.get(buf) {
            4 => {}
            6 => {
                return Err(Error::Unsupported(
                    "an IPv6 header where an IPv4 header was expected",
                ));
            }
            _ => return Err(Error::Unsupported("IP version other than 4")),
        }
        if f::IHL.get(buf) != 5 {
            return Err(Error::Unsupported("IPv4 options"));
        }
        if f::MF.get(buf) != 0 || f::FRAG_OFFSET.get(buf) != 0 {
            return Err(Error::Unsupported("IPv4 fragments"));
        }
        let total_len = f::TOTAL_LEN.get(buf) as u16;
        if usize::from(total_len) < IPV4_HEADER_LEN {
            return Err(Error::Reserved {
                field: "ipv4.total_length",
                value: total_len.into(),
            });
        }
        let found = f::CHECKSUM.get(buf) as u16;
        let mut h = [0u8; IPV4_HEADER_LEN];
        h.copy_from_slice(&buf[..IPV4_HEADER_LEN]);
        f::CHECKSUM.set(&mut h, 0);
        let computed = internet_checksum(&h);
        if found != computed {
            return Err(Error::Ipv4Checksum { found, computed });
        }
        Ok(Ipv4Repr {
            src: Ipv4Addr::from(f::SRC.get(buf) as u32),
            dst: Ipv4Addr::from(f::DST.get(buf) as u32),
            identification: f::IDENT.get(buf) as u16,
            dont_fragment: f::DF.get(buf) != 0,
            ttl: f::TTL.get(buf) as u8,
            tos: f::TOS.get(buf) as u8,
            protocol: f::PROTOCOL.get(buf) as u8,
            total_len,
        })
    }

    /// Writes the 20-byte header (no options, header checksum computed) into `buf`.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        use self::field as f;
        check_len(buf, IPV4_HEADER_LEN)?;
        let h = &mut buf[..IPV4_HEADER_LEN];
        h.fill(0);
        f::VERSION.set(h, 4);
        f::IHL.set(h, 5);
        f::TOS.set(h, self.tos.into());
        f::TOTAL_LEN.set(h, self.total_len.into());
        f::IDENT.set(h, self.identification.into());
        f::DF.set(h, self.dont_fragment.into());
        f::TTL.set(h, self.ttl.into());
        f::PROTOCOL.set(h, self.protocol.into());
        f::SRC.set(h, u32::from(self.src).into());
        f::DST.set(h, u32::from(self.dst).into());
        let sum = internet_checksum(h);
        f::CHECKSUM.set(h, sum.into());
        Ok(())
    }
}

impl fmt::Display for Ipv4Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IPv4 {} -> {} id={}{} ttl={} tos={:#04x} proto={} len={}",
            self.src,
            self.dst,
            self.identification,
            if self.dont_fragment { " DF" } else { "" },
            self.ttl,
            self.tos,
            self.protocol,
            self.total_len
        )
    }
}

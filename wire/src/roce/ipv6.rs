//! The IPv6 header of a frame's datagram (RFC 8200, next header UDP).

use core::fmt;
use std::net::Ipv6Addr;

use crate::error::{Error, Result, check_len};

use super::consts::*;

/// An IPv6 header (RFC 8200), without extension headers.
pub mod field {
    use crate::field::{Bits, Field};
    /// Version, 4 bits.
    pub const VERSION: Bits = Bits::new(0, 1, 4, 4);
    /// Traffic class (DSCP and ECN), 8 bits.
    pub const TRAFFIC_CLASS: Bits = Bits::new(0, 2, 4, 8);
    /// Flow label, 20 bits.
    pub const FLOW_LABEL: Bits = Bits::new(1, 3, 0, 20);
    /// Payload length (everything after the 40-byte header), be16.
    pub const PAYLOAD_LEN: Bits = Bits::bytes(4, 2);
    /// Next header, u8.
    pub const NEXT_HEADER: Bits = Bits::bytes(6, 1);
    /// Hop limit, u8.
    pub const HOP_LIMIT: Bits = Bits::bytes(7, 1);
    /// Source address, 16 bytes.
    pub const SRC: Field = 8..24;
    /// Destination address, 16 bytes.
    pub const DST: Field = 24..40;
}

/// A zero-copy view of an IPv6 header (40 bytes, RFC 8200).
#[derive(Debug, Clone)]
pub struct Ipv6Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Ipv6Packet<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`IPV6_HEADER_LEN`]. Use [`Ipv6Packet::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> Ipv6Packet<T> {
        Ipv6Packet { buffer }
    }

    /// Wraps a buffer after checking it holds a whole IPv6 header of version 6
    /// ([`Error::Truncated`], [`Error::Unsupported`]).
    pub fn new_checked(buffer: T) -> Result<Ipv6Packet<T>> {
        let b = buffer.as_ref();
        check_len(b, IPV6_HEADER_LEN)?;
        if field::VERSION.get(b) != 6 {
            return Err(Error::Unsupported("IP version other than 6"));
        }
        Ok(Ipv6Packet { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Version (6 for a checked view).
    pub fn version(&self) -> u8 {
        field::VERSION.get(self.buffer.as_ref()) as u8
    }
    /// Traffic class (DSCP << 2 | ECN).
    pub fn traffic_class(&self) -> u8 {
        field::TRAFFIC_CLASS.get(self.buffer.as_ref()) as u8
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        field::FLOW_LABEL.get(self.buffer.as_ref()) as u32
    }
    /// Payload length: the bytes after the 40-byte header.
    pub fn payload_len(&self) -> u16 {
        field::PAYLOAD_LEN.get(self.buffer.as_ref()) as u16
    }
    /// Next header.
    pub fn next_header(&self) -> u8 {
        field::NEXT_HEADER.get(self.buffer.as_ref()) as u8
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        field::HOP_LIMIT.get(self.buffer.as_ref()) as u8
    }
    /// Source address.
    pub fn src(&self) -> Ipv6Addr {
        addr16(&self.buffer.as_ref()[field::SRC])
    }
    /// Destination address.
    pub fn dst(&self) -> Ipv6Addr {
        addr16(&self.buffer.as_ref()[field::DST])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    /// Sets the version (4 bits).
    pub fn set_version(&mut self, v: u8) {
        field::VERSION.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the traffic class.
    pub fn set_traffic_class(&mut self, v: u8) {
        field::TRAFFIC_CLASS.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the flow label (20 bits).
    pub fn set_flow_label(&mut self, v: u32) {
        field::FLOW_LABEL.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        field::PAYLOAD_LEN.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the next header.
    pub fn set_next_header(&mut self, v: u8) {
        field::NEXT_HEADER.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        field::HOP_LIMIT.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the source address.
    pub fn set_src(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&a.octets())
    }
    /// Sets the destination address.
    pub fn set_dst(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&a.octets())
    }
}

/// Sixteen bytes as an IPv6 address (the caller passes exactly 16).
fn addr16(b: &[u8]) -> Ipv6Addr {
    let mut a = [0u8; 16];
    let n = b.len().min(16);
    a[..n].copy_from_slice(&b[..n]);
    Ipv6Addr::from(a)
}

/// The IPv6 header of a frame's datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ipv6Repr {
    /// Source address.
    pub src: Ipv6Addr,
    /// Destination address.
    pub dst: Ipv6Addr,
    /// Traffic class: DSCP << 2 | ECN (masked out of the ICRC).
    pub traffic_class: u8,
    /// Flow label, 20 bits (masked out of the ICRC).
    pub flow_label: u32,
    /// Hop limit (masked out of the ICRC).
    pub hop_limit: u8,
    /// Next header ([`IP_PROTOCOL_UDP`] for a frame).
    pub next_header: u8,
    /// Payload length: UDP header and payload (288 for a frame).
    pub payload_len: u16,
}

impl Ipv6Repr {
    /// The header of a pvcm frame from `src` to `dst`: traffic class 0, flow label 0,
    /// hop limit 64, next header UDP, payload length 288. Only the addresses, the
    /// payload length and the next header matter to the ICRC.
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr) -> Ipv6Repr {
        Ipv6Repr {
            src,
            dst,
            traffic_class: 0,
            flow_label: 0,
            hop_limit: DEFAULT_HOP_LIMIT,
            next_header: IP_PROTOCOL_UDP,
            payload_len: (UDP_HEADER_LEN + FRAME_LEN) as u16,
        }
    }

    /// Parses the 40-byte IPv6 header at the start of `buf`. Fails on a short buffer or
    /// another IP version; any next header is accepted (a datagram parse refuses all
    /// but UDP: [`Error::Ipv6NextHeader`]).
    pub fn parse(buf: &[u8]) -> Result<Ipv6Repr> {
        let p = Ipv6Packet::new_checked(buf)?;
        Ok(Ipv6Repr {
            src: p.src(),
            dst: p.dst(),
            traffic_class: p.traffic_class(),
            flow_label: p.flow_label(),
            hop_limit: p.hop_limit(),
            next_header: p.next_header(),
            payload_len: p.payload_len(),
        })
    }

    /// Writes the 40-byte header into `buf`. Bits of the flow label above 20 are
    /// dropped.
    pub fn emit(&self, buf: &mut [u8]) -> Result<()> {
        check_len(buf, IPV6_HEADER_LEN)?;
        let mut p = Ipv6Packet::new_unchecked(&mut buf[..IPV6_HEADER_LEN]);
        p.buffer.fill(0);
        p.set_version(6);
        p.set_traffic_class(self.traffic_class);
        p.set_flow_label(self.flow_label);
        p.set_payload_len(self.payload_len);
        p.set_next_header(self.next_header);
        p.set_hop_limit(self.hop_limit);
        p.set_src(self.src);
        p.set_dst(self.dst);
        Ok(())
    }
}

impl fmt::Display for Ipv6Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "IPv6 {} -> {} tc={:#04x} flow={:#07x} hop={} nh={} len={}",
            self.src,
            self.dst,
            self.traffic_class,
            self.flow_label,
            self.hop_limit,
            self.next_header,
            self.payload_len
        )
    }
}

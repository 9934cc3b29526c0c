//! The frame: the UDP payload of one CM datagram, BTH + DETH + MAD + ICRC.

use core::fmt;

use crate::error::{Error, Result, check_len};
use crate::mad::MAD_LEN;

use super::bth::{BthPacket, BthRepr};
use super::consts::*;
use super::deth::{DethPacket, DethRepr};
use super::icrc::icrc;
use super::ip::{IpHeader, IpRepr};
use super::udp::{UdpRepr, udp6_checksum};

/// The parts of a whole frame (the UDP payload).
pub mod field {
    use crate::field::Field;
    use crate::roce::consts::{BTH_LEN, DETH_LEN, FRAME_LEN, ICRC_LEN};
    /// The BTH.
    pub const BTH: Field = 0..BTH_LEN;
    /// The DETH.
    pub const DETH: Field = BTH_LEN..BTH_LEN + DETH_LEN;
    /// The 256-byte MAD.
    pub const MAD: Field = BTH_LEN + DETH_LEN..FRAME_LEN - ICRC_LEN;
    /// The ICRC, little-endian.
    pub const ICRC: Field = FRAME_LEN - ICRC_LEN..FRAME_LEN;
    /// Everything the ICRC covers of the payload: BTH, DETH and MAD.
    pub const COVERED: Field = 0..FRAME_LEN - ICRC_LEN;
}

/// A zero-copy view of a whole RoCEv2 CM frame: the 280-byte UDP payload
/// (BTH + DETH + MAD + ICRC).
#[derive(Debug, Clone)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`FRAME_LEN`]. Use [`Frame::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> Frame<T> {
        Frame { buffer }
    }

    /// Wraps a UDP payload after checking that it is one CM frame: a BTH of opcode
    /// 0x64 ([`Error::BthOpcode`]), version 0 ([`Error::BthVersion`]) and pad count 0,
    /// and exactly [`FRAME_LEN`] bytes. Shorter than BTH + DETH + ICRC is
    /// [`Error::Truncated`]; any other length, or padding, is [`Error::PayloadLength`]
    /// with the length of the payload the frame carries. The ICRC is not checked here
    /// (it needs the IP and UDP headers: [`Frame::check_icrc`]), nor the MAD.
    pub fn new_checked(buffer: T) -> Result<Frame<T>> {
        let b = buffer.as_ref();
        let truncated = Error::Truncated {
            need: FRAME_LEN,
            have: b.len(),
        };
        if b.len() < BTH_LEN {
            return Err(truncated);
        }
        let bth = BthPacket::new_unchecked(b);
        if bth.opcode() != OPCODE_UD_SEND_ONLY {
            return Err(Error::BthOpcode(bth.opcode()));
        }
        if bth.tver() != 0 {
            return Err(Error::BthVersion(bth.tver()));
        }
        if b.len() < BTH_LEN + DETH_LEN + ICRC_LEN {
            return Err(truncated);
        }
        let payload = b.len() - (BTH_LEN + DETH_LEN + ICRC_LEN);
        if payload != MAD_LEN || bth.pad_count() != 0 {
            return Err(Error::PayloadLength(
                payload.saturating_sub(bth.pad_count().into()),
            ));
        }
        Ok(Frame { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The whole frame.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The BTH.
    pub fn bth(&self) -> BthPacket<&[u8]> {
        BthPacket::new_unchecked(&self.buffer.as_ref()[field::BTH])
    }

    /// The DETH.
    pub fn deth(&self) -> DethPacket<&[u8]> {
        DethPacket::new_unchecked(&self.buffer.as_ref()[field::DETH])
    }

    /// The 256-byte MAD (unchecked: hand it to [`crate::cm::CmMad::new_checked`]).
    pub fn mad(&self) -> &[u8] {
        &self.buffer.as_ref()[field::MAD]
    }

    /// The ICRC the frame carries (its last 4 bytes, little-endian).
    pub fn icrc(&self) -> u32 {
        let b = &self.buffer.as_ref()[field::ICRC];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// The bytes the ICRC covers: BTH, DETH and MAD.
    pub fn covered(&self) -> &[u8] {
        &self.buffer.as_ref()[field::COVERED]
    }

    /// The ICRC this frame should carry under these IP and UDP headers.
    pub fn compute_icrc<H: IpHeader + ?Sized>(&self, ip: &H, udp: &UdpRepr) -> u32 {
        icrc(ip, udp, self.covered())
    }

    /// Checks the frame's ICRC against the one computed under these IP and UDP headers
    /// (for a pvcm peer: [`Ipv4Repr::new`](super::Ipv4Repr::new) or
    /// [`Ipv6Repr::new`](super::Ipv6Repr::new) and [`UdpRepr::new`],
    /// see the module docs).
    pub fn check_icrc<H: IpHeader + ?Sized>(&self, ip: &H, udp: &UdpRepr) -> Result<()> {
        let computed = self.compute_icrc(ip, udp);
        let found = self.icrc();
        if found == computed {
            Ok(())
        } else {
            Err(Error::Icrc { found, computed })
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// The BTH, mutable.
    pub fn bth_mut(&mut self) -> BthPacket<&mut [u8]> {
        BthPacket::new_unchecked(&mut self.buffer.as_mut()[field::BTH])
    }

    /// The DETH, mutable.
    pub fn deth_mut(&mut self) -> DethPacket<&mut [u8]> {
        DethPacket::new_unchecked(&mut self.buffer.as_mut()[field::DETH])
    }

    /// The MAD, mutable (a proxy rewrites comm IDs here, then calls [`Frame::fill_icrc`]).
    pub fn mad_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::MAD]
    }

    /// Stores an ICRC value (little-endian).
    pub fn set_icrc(&mut self, v: u32) {
        self.buffer.as_mut()[field::ICRC].copy_from_slice(&v.to_le_bytes())
    }

    /// Computes the ICRC under these IP and UDP headers and stores it.
    pub fn fill_icrc<H: IpHeader + ?Sized>(&mut self, ip: &H, udp: &UdpRepr) {
        let v = self.compute_icrc(ip, udp);
        self.set_icrc(v)
    }
}

/// A parsed frame: its two transport headers and its (unchecked) MAD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameRepr<'a> {
    /// The BTH.
    pub bth: BthRepr,
    /// The DETH.
    pub deth: DethRepr,
    /// The 256 MAD bytes.
    pub mad: &'a [u8],
}

impl<'a> FrameRepr<'a> {
    /// A CM MAD from GSI to GSI: [`BthRepr::gsi`] and [`DethRepr::gsi`].
    pub fn gsi(psn: u32, mad: &'a [u8]) -> FrameRepr<'a> {
        FrameRepr {
            bth: BthRepr::gsi(psn),
            deth: DethRepr::gsi(),
            mad,
        }
    }

    /// Parses a checked frame's headers (the ICRC is [`Frame::check_icrc`]'s business).
    pub fn parse(frame: &Frame<&'a [u8]>) -> Result<FrameRepr<'a>> {
        let b: &'a [u8] = frame.buffer;
        Ok(FrameRepr {
            bth: BthRepr::parse(&frame.bth())?,
            deth: DethRepr::parse(&frame.deth())?,
            mad: &b[field::MAD],
        })
    }

    /// Writes the 280-byte frame into `buf[..FRAME_LEN]`, ICRC computed under `ip` and
    /// `udp`, and returns [`FRAME_LEN`]. Fails if `buf` is short or the MAD is not
    /// 256 bytes.
    pub fn emit<H: IpHeader + ?Sized>(
        &self,
        buf: &mut [u8],
        ip: &H,
        udp: &UdpRepr,
    ) -> Result<usize> {
        if self.mad.len() != MAD_LEN {
            return Err(Error::PayloadLength(self.mad.len()));
        }
        check_len(buf, FRAME_LEN)?;
        let mut frame = Frame::new_unchecked(&mut buf[..FRAME_LEN]);
        self.bth.emit(&mut frame.bth_mut());
        self.deth.emit(&mut frame.deth_mut());
        frame.mad_mut().copy_from_slice(self.mad);
        frame.fill_icrc(ip, udp);
        Ok(FRAME_LEN)
    }

    /// Writes a whole datagram (IP header, UDP header, frame) into `buf` and returns
    /// its length ([`DATAGRAM_LEN`] over IPv4, [`IPV6_DATAGRAM_LEN`] over IPv6): what a
    /// capture of the frame shows, or what a raw socket sends. The length fields of `ip`
    /// and `udp` are replaced by the frame's, and the ICRC is computed over the headers
    /// as written. The UDP checksum is 0 over IPv4 (RFC 768 allows it, rxe sends it) and
    /// computed over IPv6, where a zero checksum is not allowed (RFC 8200).
    pub fn emit_datagram<H: IpHeader + ?Sized>(
        &self,
        buf: &mut [u8],
        ip: &H,
        udp: &UdpRepr,
    ) -> Result<usize> {
        let ip = ip.ip_repr().for_frame();
        let hl = ip.header_len();
        let total = hl + UDP_HEADER_LEN + FRAME_LEN;
        check_len(buf, total)?;
        let udp = UdpRepr {
            length: (UDP_HEADER_LEN + FRAME_LEN) as u16,
            ..*udp
        };
        let (iph, rest) = buf[..total].split_at_mut(hl);
        self.emit(&mut rest[UDP_HEADER_LEN..], &ip, &udp)?;
        ip.emit_header(iph)?;
        udp.emit(rest)?;
        if let IpRepr::V6(v6) = ip {
            let sum = udp6_checksum(&v6.src, &v6.dst, rest);
            super::udp::field::CHECKSUM.set(rest, sum.into());
        }
        Ok(total)
    }
}

impl fmt::Display for FrameRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} MAD[{}]", self.bth, self.deth, self.mad.len())
    }
}

/// Writes a 280-byte frame carrying `mad` into `buf` (see [`FrameRepr::emit`]).
pub fn emit_frame<H: IpHeader + ?Sized>(
    buf: &mut [u8],
    ip: &H,
    udp: &UdpRepr,
    bth: &BthRepr,
    deth: &DethRepr,
    mad: &[u8],
) -> Result<usize> {
    FrameRepr {
        bth: *bth,
        deth: *deth,
        mad,
    }
    .emit(buf, ip, udp)
}

/// Writes a whole IP + UDP + frame datagram into `buf` (see
/// [`FrameRepr::emit_datagram`]); for pcap captures and raw sockets.
pub fn emit_datagram<H: IpHeader + ?Sized>(
    buf: &mut [u8],
    ip: &H,
    udp: &UdpRepr,
    bth: &BthRepr,
    deth: &DethRepr,
    mad: &[u8],
) -> Result<usize> {
    FrameRepr {
        bth: *bth,
        deth: *deth,
        mad,
    }
    .emit_datagram(buf, ip, udp)
}

//! RoCEv2 framing of CM MADs: BTH + DETH + MAD + ICRC, sent UD to QP1 over UDP 4791.
//!
//! pvcm hosts exchange CM MADs the way a RoCEv2 HCA (or Linux `rdma_rxe`) would put them
//! on the wire, so that Wireshark's InfiniBand dissector decodes a capture and a real
//! RoCE peer could in principle take part. The UDP payload of one CM datagram is always
//! [`FRAME_LEN`] = 280 bytes:
//!
//! ```text
//!  0..12    BTH   opcode 0x64 (UD SEND only), P_Key, DestQP 1, PSN   (IBTA 9.2)
//! 12..20    DETH  Q_Key 0x8001_0000 (GSI), SrcQP 1                   (IBTA 9.3.3)
//! 20..276   MAD   the 256-byte CM MAD                                 (crate::mad, crate::cm)
//! 276..280  ICRC  CRC-32 over the invariant fields, little-endian     (IBTA Annex A17)
//! ```
//!
//! # The ICRC
//!
//! [`icrc`] computes the invariant CRC exactly as Linux's `rdma_rxe` does
//! (`drivers/infiniband/sw/rxe/rxe_icrc.c`, IBTA Annex A17): the ordinary IEEE 802.3
//! CRC-32 (zlib's `crc32`) over
//!
//! 1. 8 bytes of `0xFF` standing for the masked LRH (rxe starts from the CRC state
//!    `0xdebb20e3`, which is the state after those 8 bytes);
//! 2. the IP header with its variant fields set to all ones:
//!    - IPv4 (20 bytes): TOS, TTL and header checksum;
//!    - IPv6 (40 bytes): traffic class, flow label and hop limit (the version nibble,
//!      payload length, next header and both addresses stay as they are);
//! 3. the 8-byte UDP header with its checksum set to `0xFFFF`;
//! 4. the BTH with byte 4 (FECN, BECN, 6 reserved bits) set to `0xFF`;
//! 5. the DETH and the MAD (the rest of the UDP payload, the ICRC itself excluded).
//!
//! The result is stored in the last 4 bytes in little-endian order (rxe stores the
//! `u32` in CPU order; on x86 and on every RoCE HCA the wire bytes are LSB first).
//! Everything else of the IP and UDP headers is covered: for IPv4 version/IHL, total
//! length, identification, flags and fragment offset, protocol, both addresses; for
//! IPv6 the version, payload length, next header and both addresses; and both UDP
//! ports and the UDP length.
//!
//! The IP header is any [`IpHeader`]: [`Ipv4Repr`], [`Ipv6Repr`] or the enum of both,
//! [`IpRepr`]. A datagram is 308 bytes over IPv4 ([`DATAGRAM_LEN`]) and 328 over IPv6
//! ([`IPV6_DATAGRAM_LEN`]); an IPv6 header must be followed directly by UDP (an
//! extension header is [`Error::Ipv6NextHeader`]).
//!
//! # Sending through a UDP socket
//!
//! pvcm sends its frames through an ordinary UDP socket and never sees the IP header the
//! kernel writes, so it computes the ICRC over the header it *expects*: [`Ipv4Repr::new`]
//! gives identification 0 and Don't Fragment set. That is what Linux puts on the wire
//! for an **unconnected** UDP socket: `ip_select_ident_segs()` (include/net/ip.h) gives a
//! DF packet of a socket without a connected peer the ID 0 (a *connected* socket uses a
//! per-socket counter, and a non-DF packet a hashed ID, neither predictable). Linux UDP
//! sockets set DF by default (`IP_PMTUDISC_WANT`) on a 308-byte datagram. The receiver
//! rebuilds the same header from `recvfrom`'s source, its own address and port, and the
//! datagram length. TTL and TOS/DSCP are masked and may be anything.
//!
//! Over IPv6 there is nothing to expect: every field the ICRC covers (addresses,
//! payload length, next header, UDP ports and length) is one a UDP socket knows, and
//! every field it cannot know (traffic class, flow label, hop limit, UDP checksum) is
//! masked. [`Ipv6Repr::new`] gives the covered fields; the masked ones may be anything.
//!
//! `rdma_rxe` itself picks a hashed IPv4 ID (`__ip_select_ident`), so an IPv4 frame from
//! a real rxe or HCA peer can be verified only with the whole IP header at hand (a
//! capture, a raw or packet socket): [`check_datagram_icrc`] does that from the raw
//! bytes, for either IP version.

use core::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::error::{Error, Result, check_len};
use crate::field::Bits;
use crate::mad::MAD_LEN;

/// The RoCEv2 UDP destination port (IANA).
pub const UDP_PORT: u16 = 4791;
/// BTH opcode of a UD SEND only: the only opcode a CM MAD travels with.
pub const OPCODE_UD_SEND_ONLY: u8 = 0x64;
/// The well-known Q_Key of the GSI (QP1).
pub const GSI_QKEY: u32 = 0x8001_0000;
/// The QP number of the GSI, where CM MADs are sent and from which they come.
pub const GSI_QPN: u32 = 1;
/// The default (full-member) partition key.
pub const DEFAULT_PKEY: u16 = 0xFFFF;
/// Length of the Base Transport Header.
pub const BTH_LEN: usize = 12;
/// Length of the Datagram Extended Transport Header.
pub const DETH_LEN: usize = 8;
/// Length of the invariant CRC.
pub const ICRC_LEN: usize = 4;
/// Length of a whole frame, the UDP payload: BTH + DETH + MAD + ICRC = 280.
pub const FRAME_LEN: usize = BTH_LEN + DETH_LEN + MAD_LEN + ICRC_LEN;
/// Length of an IPv4 header without options.
pub const IPV4_HEADER_LEN: usize = 20;
/// Length of a UDP header.
pub const UDP_HEADER_LEN: usize = 8;
/// Length of a whole IPv4 datagram carrying one frame: 20 + 8 + 280 = 308.
pub const DATAGRAM_LEN: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN + FRAME_LEN;
/// IP protocol number of UDP (also its IPv6 next header value).
pub const IP_PROTOCOL_UDP: u8 = 17;
/// Length of an IPv6 header (no extension headers).
pub const IPV6_HEADER_LEN: usize = 40;
/// Length of a whole IPv6 datagram carrying one frame: 40 + 8 + 280 = 328.
pub const IPV6_DATAGRAM_LEN: usize = IPV6_HEADER_LEN + UDP_HEADER_LEN + FRAME_LEN;
/// Hop limit (IPv6) and TTL (IPv4) of the headers pvcm builds.
pub const DEFAULT_HOP_LIMIT: u8 = 64;

/// Byte ranges and bit fields of the RoCEv2 headers.
pub mod field {
    /// The Base Transport Header (IBTA 9.2), relative to its first byte.
    pub mod bth {
        use crate::field::Bits;
        /// Opcode, u8.
        pub const OPCODE: Bits = Bits::bytes(0, 1);
        /// Solicited Event, 1 bit.
        pub const SE: Bits = Bits::new(1, 1, 7, 1);
        /// MigReq, 1 bit.
        pub const MIG_REQ: Bits = Bits::new(1, 1, 6, 1);
        /// Pad count, 2 bits.
        pub const PAD_CNT: Bits = Bits::new(1, 1, 4, 2);
        /// Transport header version, 4 bits.
        pub const TVER: Bits = Bits::new(1, 1, 0, 4);
        /// Partition key, be16.
        pub const PKEY: Bits = Bits::bytes(2, 2);
        /// The variant byte the ICRC masks to ones: FECN, BECN and 6 reserved bits.
        pub const VARIANT: usize = 4;
        /// FECN, 1 bit.
        pub const FECN: Bits = Bits::new(4, 1, 7, 1);
        /// BECN, 1 bit.
        pub const BECN: Bits = Bits::new(4, 1, 6, 1);
        /// Reserved, 6 bits.
        pub const RESV6: Bits = Bits::new(4, 1, 0, 6);
        /// Destination QP, 24 bits.
        pub const DEST_QP: Bits = Bits::new(4, 4, 0, 24);
        /// AckReq, 1 bit.
        pub const ACK_REQ: Bits = Bits::new(8, 1, 7, 1);
        /// Reserved, 7 bits.
        pub const RESV7: Bits = Bits::new(8, 1, 0, 7);
        /// Packet sequence number, 24 bits.
        pub const PSN: Bits = Bits::new(8, 4, 0, 24);
    }

    /// The Datagram Extended Transport Header (IBTA 9.3.3), relative to its first byte.
    pub mod deth {
        use crate::field::Bits;
        /// Queue key, be32.
        pub const QKEY: Bits = Bits::bytes(0, 4);
        /// Reserved, u8.
        pub const RESERVED: Bits = Bits::bytes(4, 1);
        /// Source QP, 24 bits.
        pub const SRC_QP: Bits = Bits::new(4, 4, 0, 24);
    }

    /// The parts of a whole frame (the UDP payload).
    pub mod frame {
        use super::super::{BTH_LEN, DETH_LEN, FRAME_LEN, ICRC_LEN};
        use crate::field::Field;
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

    /// An IPv4 header without options (RFC 791).
    pub mod ipv4 {
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

    /// An IPv6 header (RFC 8200), without extension headers.
    pub mod ipv6 {
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

    /// A UDP header (RFC 768).
    pub mod udp {
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
}

/// A zero-copy view of a Base Transport Header.
#[derive(Debug, Clone)]
pub struct BthPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`BTH_LEN`]. Use [`BthPacket::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> BthPacket<T> {
        BthPacket { buffer }
    }

    /// Wraps a buffer after checking it holds at least a BTH (any opcode).
    pub fn new_checked(buffer: T) -> Result<BthPacket<T>> {
        check_len(buffer.as_ref(), BTH_LEN)?;
        Ok(BthPacket { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    #[inline]
    fn get(&self, f: Bits) -> u64 {
        f.get(self.buffer.as_ref())
    }

    /// Opcode.
    pub fn opcode(&self) -> u8 {
        self.get(field::bth::OPCODE) as u8
    }
    /// Solicited Event.
    pub fn solicited_event(&self) -> bool {
        self.get(field::bth::SE) != 0
    }
    /// MigReq.
    pub fn mig_req(&self) -> bool {
        self.get(field::bth::MIG_REQ) != 0
    }
    /// Pad count (bytes of padding after the payload, 0..=3).
    pub fn pad_count(&self) -> u8 {
        self.get(field::bth::PAD_CNT) as u8
    }
    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.get(field::bth::TVER) as u8
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        self.get(field::bth::PKEY) as u16
    }
    /// FECN (forward congestion notification).
    pub fn fecn(&self) -> bool {
        self.get(field::bth::FECN) != 0
    }
    /// BECN (backward congestion notification).
    pub fn becn(&self) -> bool {
        self.get(field::bth::BECN) != 0
    }
    /// Destination QP number.
    pub fn dest_qp(&self) -> u32 {
        self.get(field::bth::DEST_QP) as u32
    }
    /// AckReq.
    pub fn ack_req(&self) -> bool {
        self.get(field::bth::ACK_REQ) != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> u32 {
        self.get(field::bth::PSN) as u32
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthPacket<T> {
    #[inline]
    fn set(&mut self, f: Bits, v: u64) {
        f.set(self.buffer.as_mut(), v)
    }

    /// Sets the opcode.
    pub fn set_opcode(&mut self, v: u8) {
        self.set(field::bth::OPCODE, v.into())
    }
    /// Sets Solicited Event.
    pub fn set_solicited_event(&mut self, v: bool) {
        self.set(field::bth::SE, v.into())
    }
    /// Sets MigReq.
    pub fn set_mig_req(&mut self, v: bool) {
        self.set(field::bth::MIG_REQ, v.into())
    }
    /// Sets the pad count (2 bits).
    pub fn set_pad_count(&mut self, v: u8) {
        self.set(field::bth::PAD_CNT, v.into())
    }
    /// Sets the transport header version (4 bits).
    pub fn set_tver(&mut self, v: u8) {
        self.set(field::bth::TVER, v.into())
    }
    /// Sets the partition key.
    pub fn set_pkey(&mut self, v: u16) {
        self.set(field::bth::PKEY, v.into())
    }
    /// Sets FECN.
    pub fn set_fecn(&mut self, v: bool) {
        self.set(field::bth::FECN, v.into())
    }
    /// Sets BECN.
    pub fn set_becn(&mut self, v: bool) {
        self.set(field::bth::BECN, v.into())
    }
    /// Sets the destination QP (24 bits).
    pub fn set_dest_qp(&mut self, v: u32) {
        self.set(field::bth::DEST_QP, v.into())
    }
    /// Sets AckReq.
    pub fn set_ack_req(&mut self, v: bool) {
        self.set(field::bth::ACK_REQ, v.into())
    }
    /// Sets the PSN (24 bits).
    pub fn set_psn(&mut self, v: u32) {
        self.set(field::bth::PSN, v.into())
    }
}

/// A parsed BTH of a UD SEND only (the only kind this codec speaks): opcode 0x64,
/// transport header version 0, pad count 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// Solicited Event.
    pub solicited_event: bool,
    /// MigReq.
    pub mig_req: bool,
    /// Partition key.
    pub pkey: u16,
    /// FECN (set by the network; not covered by the ICRC).
    pub fecn: bool,
    /// BECN (set by the network; not covered by the ICRC).
    pub becn: bool,
    /// Destination QP (24 bits).
    pub dest_qp: u32,
    /// AckReq.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl BthRepr {
    /// The BTH of a CM MAD to the GSI: default P_Key, destination QP 1, flags clear.
    pub fn gsi(psn: u32) -> BthRepr {
        BthRepr {
            solicited_event: false,
            mig_req: false,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: GSI_QPN,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH; fails unless it is a UD SEND only of version 0 without padding
    /// (a padded frame's payload is not a whole 256-byte MAD: [`Error::PayloadLength`]).
    pub fn parse<T: AsRef<[u8]>>(p: &BthPacket<T>) -> Result<BthRepr> {
        if p.opcode() != OPCODE_UD_SEND_ONLY {
            return Err(Error::BthOpcode(p.opcode()));
        }
        if p.tver() != 0 {
            return Err(Error::BthVersion(p.tver()));
        }
        if p.pad_count() != 0 {
            return Err(Error::PayloadLength(MAD_LEN - usize::from(p.pad_count())));
        }
        Ok(BthRepr {
            solicited_event: p.solicited_event(),
            mig_req: p.mig_req(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qp: p.dest_qp(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Writes the BTH (opcode 0x64, version 0, pad 0, reserved bits zero). Bits of
    /// `dest_qp` and `psn` above 24 are dropped.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut BthPacket<T>) {
        p.buffer.as_mut()[..BTH_LEN].fill(0);
        p.set_opcode(OPCODE_UD_SEND_ONLY);
        p.set_solicited_event(self.solicited_event);
        p.set_mig_req(self.mig_req);
        p.set_pkey(self.pkey);
        p.set_fecn(self.fecn);
        p.set_becn(self.becn);
        p.set_dest_qp(self.dest_qp);
        p.set_ack_req(self.ack_req);
        p.set_psn(self.psn);
    }
}

impl fmt::Display for BthRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BTH UD_SEND_ONLY pkey={:#06x} dqpn={:#08x} psn={:#08x}",
            self.pkey, self.dest_qp, self.psn
        )?;
        for (on, name) in [
            (self.solicited_event, "se"),
            (self.mig_req, "mig"),
            (self.fecn, "fecn"),
            (self.becn, "becn"),
            (self.ack_req, "ackreq"),
        ] {
            if on {
                write!(f, " {name}")?;
            }
        }
        Ok(())
    }
}

/// A zero-copy view of a Datagram Extended Transport Header.
#[derive(Debug, Clone)]
pub struct DethPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> DethPacket<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`DETH_LEN`]. Use [`DethPacket::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> DethPacket<T> {
        DethPacket { buffer }
    }

    /// Wraps a buffer after checking it holds at least a DETH.
    pub fn new_checked(buffer: T) -> Result<DethPacket<T>> {
        check_len(buffer.as_ref(), DETH_LEN)?;
        Ok(DethPacket { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Queue key.
    pub fn qkey(&self) -> u32 {
        field::deth::QKEY.get(self.buffer.as_ref()) as u32
    }
    /// Source QP number.
    pub fn src_qp(&self) -> u32 {
        field::deth::SRC_QP.get(self.buffer.as_ref()) as u32
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DethPacket<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, v: u32) {
        field::deth::QKEY.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the source QP (24 bits).
    pub fn set_src_qp(&mut self, v: u32) {
        field::deth::SRC_QP.set(self.buffer.as_mut(), v.into())
    }
}

/// A parsed DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// Queue key ([`GSI_QKEY`] for CM MADs).
    pub qkey: u32,
    /// Source QP (24 bits; [`GSI_QPN`] for CM MADs).
    pub src_qp: u32,
}

impl DethRepr {
    /// The DETH of a MAD sent by the GSI: Q_Key 0x8001_0000, source QP 1.
    pub fn gsi() -> DethRepr {
        DethRepr {
            qkey: GSI_QKEY,
            src_qp: GSI_QPN,
        }
    }

    /// Parses a DETH (any Q_Key and source QP; the caller decides what it accepts).
    pub fn parse<T: AsRef<[u8]>>(p: &DethPacket<T>) -> Result<DethRepr> {
        Ok(DethRepr {
            qkey: p.qkey(),
            src_qp: p.src_qp(),
        })
    }

    /// Writes the DETH (reserved byte zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut DethPacket<T>) {
        field::deth::RESERVED.set(p.buffer.as_mut(), 0);
        p.set_qkey(self.qkey);
        p.set_src_qp(self.src_qp);
    }
}

impl fmt::Display for DethRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DETH qkey={:#010x} sqpn={:#08x}", self.qkey, self.src_qp)
    }
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
        BthPacket::new_unchecked(&self.buffer.as_ref()[field::frame::BTH])
    }

    /// The DETH.
    pub fn deth(&self) -> DethPacket<&[u8]> {
        DethPacket::new_unchecked(&self.buffer.as_ref()[field::frame::DETH])
    }

    /// The 256-byte MAD (unchecked: hand it to [`crate::cm::CmMad::new_checked`]).
    pub fn mad(&self) -> &[u8] {
        &self.buffer.as_ref()[field::frame::MAD]
    }

    /// The ICRC the frame carries (its last 4 bytes, little-endian).
    pub fn icrc(&self) -> u32 {
        let b = &self.buffer.as_ref()[field::frame::ICRC];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }

    /// The bytes the ICRC covers: BTH, DETH and MAD.
    pub fn covered(&self) -> &[u8] {
        &self.buffer.as_ref()[field::frame::COVERED]
    }

    /// The ICRC this frame should carry under these IP and UDP headers.
    pub fn compute_icrc<H: IpHeader + ?Sized>(&self, ip: &H, udp: &UdpRepr) -> u32 {
        icrc(ip, udp, self.covered())
    }

    /// Checks the frame's ICRC against the one computed under these IP and UDP headers
    /// (for a pvcm peer: [`Ipv4Repr::new`] or [`Ipv6Repr::new`] and [`UdpRepr::new`],
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
        BthPacket::new_unchecked(&mut self.buffer.as_mut()[field::frame::BTH])
    }

    /// The DETH, mutable.
    pub fn deth_mut(&mut self) -> DethPacket<&mut [u8]> {
        DethPacket::new_unchecked(&mut self.buffer.as_mut()[field::frame::DETH])
    }

    /// The MAD, mutable (a proxy rewrites comm IDs here, then calls [`Frame::fill_icrc`]).
    pub fn mad_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::frame::MAD]
    }

    /// Stores an ICRC value (little-endian).
    pub fn set_icrc(&mut self, v: u32) {
        self.buffer.as_mut()[field::frame::ICRC].copy_from_slice(&v.to_le_bytes())
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
            mad: &b[field::frame::MAD],
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
            field::udp::CHECKSUM.set(rest, sum.into());
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
        use field::ipv4 as f;
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
        use field::ipv4 as f;
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
        if field::ipv6::VERSION.get(b) != 6 {
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
        field::ipv6::VERSION.get(self.buffer.as_ref()) as u8
    }
    /// Traffic class (DSCP << 2 | ECN).
    pub fn traffic_class(&self) -> u8 {
        field::ipv6::TRAFFIC_CLASS.get(self.buffer.as_ref()) as u8
    }
    /// Flow label (20 bits).
    pub fn flow_label(&self) -> u32 {
        field::ipv6::FLOW_LABEL.get(self.buffer.as_ref()) as u32
    }
    /// Payload length: the bytes after the 40-byte header.
    pub fn payload_len(&self) -> u16 {
        field::ipv6::PAYLOAD_LEN.get(self.buffer.as_ref()) as u16
    }
    /// Next header.
    pub fn next_header(&self) -> u8 {
        field::ipv6::NEXT_HEADER.get(self.buffer.as_ref()) as u8
    }
    /// Hop limit.
    pub fn hop_limit(&self) -> u8 {
        field::ipv6::HOP_LIMIT.get(self.buffer.as_ref()) as u8
    }
    /// Source address.
    pub fn src(&self) -> Ipv6Addr {
        addr16(&self.buffer.as_ref()[field::ipv6::SRC])
    }
    /// Destination address.
    pub fn dst(&self) -> Ipv6Addr {
        addr16(&self.buffer.as_ref()[field::ipv6::DST])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Ipv6Packet<T> {
    /// Sets the version (4 bits).
    pub fn set_version(&mut self, v: u8) {
        field::ipv6::VERSION.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the traffic class.
    pub fn set_traffic_class(&mut self, v: u8) {
        field::ipv6::TRAFFIC_CLASS.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the flow label (20 bits).
    pub fn set_flow_label(&mut self, v: u32) {
        field::ipv6::FLOW_LABEL.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the payload length.
    pub fn set_payload_len(&mut self, v: u16) {
        field::ipv6::PAYLOAD_LEN.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the next header.
    pub fn set_next_header(&mut self, v: u8) {
        field::ipv6::NEXT_HEADER.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the hop limit.
    pub fn set_hop_limit(&mut self, v: u8) {
        field::ipv6::HOP_LIMIT.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the source address.
    pub fn set_src(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::ipv6::SRC].copy_from_slice(&a.octets())
    }
    /// Sets the destination address.
    pub fn set_dst(&mut self, a: Ipv6Addr) {
        self.buffer.as_mut()[field::ipv6::DST].copy_from_slice(&a.octets())
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
        use field::udp as f;
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
        use field::udp as f;
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

/// The CRC over the masked pseudo-packet, from raw header bytes (see the module docs).
/// `ip` is a 20-byte IPv4 or a 40-byte IPv6 header (told apart by length), `udp` the
/// 8-byte UDP header; only the first byte of BTH variant fields is masked, so `covered`
/// may be of any length.
fn icrc_masked(ip: &[u8], udp: &[u8; UDP_HEADER_LEN], covered: &[u8]) -> u32 {
    let mut iph = [0u8; IPV6_HEADER_LEN];
    let hl = ip.len().min(IPV6_HEADER_LEN);
    iph[..hl].copy_from_slice(&ip[..hl]);
    if hl == IPV6_HEADER_LEN {
        // Traffic class and flow label (the 28 bits after the version), hop limit.
        iph[0] |= 0x0F;
        iph[1..4].fill(0xFF);
        field::ipv6::HOP_LIMIT.set(&mut iph, 0xFF);
    } else if hl == IPV4_HEADER_LEN {
        field::ipv4::TOS.set(&mut iph, 0xFF);
        field::ipv4::TTL.set(&mut iph, 0xFF);
        field::ipv4::CHECKSUM.set(&mut iph, 0xFFFF);
    }
    let mut udp = *udp;
    field::udp::CHECKSUM.set(&mut udp, 0xFFFF);
    let split = covered.len().min(BTH_LEN);
    let (bth, rest) = covered.split_at(split);
    let mut bth_masked = [0u8; BTH_LEN];
    bth_masked[..bth.len()].copy_from_slice(bth);
    if let Some(b) = bth_masked[..bth.len()].get_mut(field::bth::VARIANT) {
        *b = 0xFF;
    }
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xFF; 8]);
    h.update(&iph[..hl]);
    h.update(&udp);
    h.update(&bth_masked[..bth.len()]);
    h.update(rest);
    h.finalize()
}

/// The ICRC of a RoCEv2 packet whose headers are `ip` (IPv4 or IPv6) and `udp` and
/// whose UDP payload, less the ICRC, is `payload_without_icrc` (BTH + DETH + MAD for a
/// CM frame). The value is stored little-endian in the frame's last 4 bytes.
pub fn icrc<H: IpHeader + ?Sized>(ip: &H, udp: &UdpRepr, payload_without_icrc: &[u8]) -> u32 {
    let ip = ip.ip_repr();
    let mut iph = [0u8; IPV6_HEADER_LEN];
    let mut udph = [0u8; UDP_HEADER_LEN];
    // Both buffers have at least the length emit checks for.
    let _ = ip.emit_header(&mut iph);
    let _ = udp.emit(&mut udph);
    icrc_masked(&iph[..ip.header_len()], &udph, payload_without_icrc)
}

/// A whole captured IPv4 datagram carrying a frame, parsed: the headers (IPv4 checksum
/// verified) and the checked frame view. The ICRC is not checked (use
/// [`Frame::check_icrc`] with the returned headers, or [`check_datagram_icrc`]). An
/// IPv6 datagram is an error here: [`parse_ip_datagram`] takes either.
pub fn parse_datagram(buf: &[u8]) -> Result<(Ipv4Repr, UdpRepr, Frame<&[u8]>)> {
    let ip = Ipv4Repr::parse(buf)?;
    if ip.protocol != IP_PROTOCOL_UDP {
        return Err(Error::Unsupported("IPv4 protocol other than UDP"));
    }
    let total = usize::from(ip.total_len);
    check_len(buf, total)?;
    let (udp, frame) = parse_udp(&buf[IPV4_HEADER_LEN..total])?;
    Ok((ip, udp, frame))
}

/// The UDP header and the frame it carries, from the bytes after the IP header.
fn parse_udp(udp_bytes: &[u8]) -> Result<(UdpRepr, Frame<&[u8]>)> {
    let udp = UdpRepr::parse(udp_bytes)?;
    let udp_len = usize::from(udp.length);
    check_len(udp_bytes, udp_len)?;
    let frame = Frame::new_checked(&udp_bytes[UDP_HEADER_LEN..udp_len])?;
    Ok((udp, frame))
}

/// A whole captured IPv6 datagram carrying a frame, parsed: the 40-byte header (its
/// next header must be UDP: an extension header is [`Error::Ipv6NextHeader`]), the
/// UDP header and the checked frame view. The ICRC is not checked.
pub fn parse_datagram6(buf: &[u8]) -> Result<(Ipv6Repr, UdpRepr, Frame<&[u8]>)> {
    let ip = Ipv6Repr::parse(buf)?;
    if ip.next_header != IP_PROTOCOL_UDP {
        return Err(Error::Ipv6NextHeader(ip.next_header));
    }
    let total = IPV6_HEADER_LEN + usize::from(ip.payload_len);
    check_len(buf, total)?;
    let (udp, frame) = parse_udp(&buf[IPV6_HEADER_LEN..total])?;
    Ok((ip, udp, frame))
}

/// A whole captured datagram of either IP version (by its version nibble), parsed as
/// [`parse_datagram`] or [`parse_datagram6`] does.
pub fn parse_ip_datagram(buf: &[u8]) -> Result<(IpRepr, UdpRepr, Frame<&[u8]>)> {
    check_len(buf, 1)?;
    match buf[0] >> 4 {
        4 => parse_datagram(buf).map(|(i, u, f)| (IpRepr::V4(i), u, f)),
        6 => parse_datagram6(buf).map(|(i, u, f)| (IpRepr::V6(i), u, f)),
        _ => Err(Error::Unsupported("IP version other than 4 or 6")),
    }
}

/// Checks the ICRC of a whole captured datagram (an IPv4 header without options or a
/// 40-byte IPv6 header followed by UDP, the UDP header, the frame) over its header
/// bytes as they are, the way a receiving HCA or rxe does. The IPv4 and UDP checksums
/// are not verified (the ICRC masks them).
pub fn check_datagram_icrc(buf: &[u8]) -> Result<()> {
    check_len(buf, 1)?;
    let hl = match buf[0] >> 4 {
        4 if buf[0] & 0x0F == 5 => IPV4_HEADER_LEN,
        6 => {
            check_len(buf, IPV6_HEADER_LEN)?;
            let nh = field::ipv6::NEXT_HEADER.get(buf) as u8;
            if nh != IP_PROTOCOL_UDP {
                return Err(Error::Ipv6NextHeader(nh));
            }
            IPV6_HEADER_LEN
        }
        _ => {
            return Err(Error::Unsupported(
                "IP header other than IPv4 without options or IPv6",
            ));
        }
    };
    check_len(buf, hl + UDP_HEADER_LEN)?;
    let mut udph = [0u8; UDP_HEADER_LEN];
    udph.copy_from_slice(&buf[hl..hl + UDP_HEADER_LEN]);
    let frame = Frame::new_checked(&buf[hl + UDP_HEADER_LEN..])?;
    let computed = icrc_masked(&buf[..hl], &udph, frame.covered());
    let found = frame.icrc();
    if found == computed {
        Ok(())
    } else {
        Err(Error::Icrc { found, computed })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths() {
        assert_eq!(FRAME_LEN, 280);
        assert_eq!(DATAGRAM_LEN, 308);
        assert_eq!(field::frame::MAD.len(), MAD_LEN);
    }

    #[test]
    fn masked_lrh_seed_matches_rxe() {
        // rxe_icrc.c seeds its (non-inverting) crc32_le with 0xdebb20e3: the CRC state
        // after 8 bytes of 0xFF. crc32fast's finalized value is the inverted state.
        let mut h = crc32fast::Hasher::new();
        h.update(&[0xFF; 8]);
        assert_eq!(!h.finalize(), 0xdebb_20e3);
    }

    #[test]
    fn ipv4_checksum_is_valid() {
        let ip = Ipv4Repr::new(Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let mut h = [0u8; 20];
        ip.emit(&mut h).unwrap();
        // Summing a header with its checksum gives 0xFFFF, i.e. a complement of 0.
        assert_eq!(internet_checksum(&h), 0);
        assert_eq!(Ipv4Repr::parse(&h).unwrap(), ip);
        h[8] ^= 1;
        assert!(matches!(
            Ipv4Repr::parse(&h),
            Err(Error::Ipv4Checksum { .. })
        ));
    }

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3 example words: 0001 f203 f4f5 f6f7 -> sum ddf2, checksum 220d.
        assert_eq!(
            internet_checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            0x220d
        );
    }
}

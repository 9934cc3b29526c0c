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
//! extension header is [`Error::Ipv6NextHeader`](crate::Error::Ipv6NextHeader)).
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
//!
//! # Layers
//!
//! One module per layer, each with its `field` byte ranges (gathered in [`field`]), its
//! checked view where one is needed, and its `Repr` with `parse` and `emit`: `bth`
//! ([`BthPacket`], [`BthRepr`]), `deth` ([`DethPacket`], [`DethRepr`]), `frame` ([`Frame`],
//! [`FrameRepr`]), `ipv4` ([`Ipv4Repr`]), `ipv6` ([`Ipv6Packet`], [`Ipv6Repr`]), `ip`
//! (either: [`IpRepr`], [`IpHeader`]), `udp` ([`UdpRepr`]), `icrc` ([`icrc()`]) and
//! `datagram` (whole captured datagrams). The constants are in `consts`, below them
//! all; everything is re-exported here. A layer imports only the layers below it:
//! `frame` the headers and `icrc`, `icrc` the IP and UDP headers, `datagram` all of
//! them.

mod bth;
mod consts;
mod datagram;
mod deth;
pub mod field;
mod frame;
mod icrc;
mod ip;
mod ipv4;
mod ipv6;
mod udp;

pub use bth::{BthPacket, BthRepr};
pub use consts::*;
pub use datagram::{check_datagram_icrc, parse_datagram, parse_datagram6, parse_ip_datagram};
pub use deth::{DethPacket, DethRepr};
pub use frame::{Frame, FrameRepr, emit_datagram, emit_frame};
pub use icrc::icrc;
pub use ip::{IpHeader, IpRepr};
pub use ipv4::{Ipv4Repr, internet_checksum};
pub use ipv6::{Ipv6Packet, Ipv6Repr};
pub use udp::{UdpRepr, udp6_checksum};

#[cfg(test)]
mod tests;

//! The RoCEv2 constants of a CM datagram: ports, QPs, keys, lengths.

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

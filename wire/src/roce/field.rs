//! Byte ranges and bit fields of the RoCEv2 headers (each layer's `field` module).

/// The Base Transport Header (IBTA 9.2), relative to its first byte.
pub use super::bth::field as bth;
/// The Datagram Extended Transport Header (IBTA 9.3.3), relative to its first byte.
pub use super::deth::field as deth;
/// The parts of a whole frame (the UDP payload).
pub use super::frame::field as frame;
/// An IPv4 header without options (RFC 791).
pub use super::ipv4::field as ipv4;
/// An IPv6 header (RFC 8200), without extension headers.
pub use super::ipv6::field as ipv6;
/// A UDP header (RFC 768).
pub use super::udp::field as udp;

//! Whole captured datagrams (IP + UDP + frame): parsed, and their ICRC checked over
//! the header bytes as they are.

use crate::error::{Error, Result, check_len};

use super::consts::*;
use super::frame::Frame;
use super::icrc::icrc_masked;
use super::ip::IpRepr;
use super::ipv4::Ipv4Repr;
use super::ipv6::Ipv6Repr;
use super::udp::UdpRepr;

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
            let nh = super::ipv6::field::NEXT_HEADER.get(buf) as u8;
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

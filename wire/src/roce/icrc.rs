//! The invariant CRC (IBTA Annex A17) over the masked headers and the payload.

use super::consts::*;
use super::ip::IpHeader;
use super::udp::UdpRepr;

/// The CRC over the masked pseudo-packet, from raw header bytes (see the module docs).
/// `ip` is a 20-byte IPv4 or a 40-byte IPv6 header (told apart by length), `udp` the
/// 8-byte UDP header; only the first byte of BTH variant fields is masked, so `covered`
/// may be of any length.
pub(super) fn icrc_masked(ip: &[u8], udp: &[u8; UDP_HEADER_LEN], covered: &[u8]) -> u32 {
    let mut iph = [0u8; IPV6_HEADER_LEN];
    let hl = ip.len().min(IPV6_HEADER_LEN);
    iph[..hl].copy_from_slice(&ip[..hl]);
    if hl == IPV6_HEADER_LEN {
        // Traffic class and flow label (the 28 bits after the version), hop limit.
        iph[0] |= 0x0F;
        iph[1..4].fill(0xFF);
        super::ipv6::field::HOP_LIMIT.set(&mut iph, 0xFF);
    } else if hl == IPV4_HEADER_LEN {
        super::ipv4::field::TOS.set(&mut iph, 0xFF);
        super::ipv4::field::TTL.set(&mut iph, 0xFF);
        super::ipv4::field::CHECKSUM.set(&mut iph, 0xFFFF);
    }
    let mut udp = *udp;
    super::udp::field::CHECKSUM.set(&mut udp, 0xFFFF);
    let split = covered.len().min(BTH_LEN);
    let (bth, rest) = covered.split_at(split);
    let mut bth_masked = [0u8; BTH_LEN];
    bth_masked[..bth.len()].copy_from_slice(bth);
    if let Some(b) = bth_masked[..bth.len()].get_mut(super::bth::field::VARIANT) {
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

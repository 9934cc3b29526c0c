//! The RoCEv2 framing's unit tests.

use std::net::Ipv4Addr;

use super::*;
use crate::error::Error;
use crate::mad::MAD_LEN;

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

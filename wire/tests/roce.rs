//! RoCEv2 framing: an ICRC vector computed outside the crate, hand-written golden
//! headers, which bytes the ICRC covers, typed errors, and no panics on random input.

// Tests may unwrap (clippy.toml allows it in #[test] fns; helpers here too).
#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;

use proptest::prelude::*;
use pvcm_wire::Error;
use pvcm_wire::roce::{
    self, BthPacket, BthRepr, DATAGRAM_LEN, DethPacket, DethRepr, FRAME_LEN, Frame, FrameRepr,
    Ipv4Repr, UdpRepr,
};

// Output of `python3 wire/tests/data/icrc_vector.py` (scapy 2.8.0's RoCE layer and a
// hand-masked zlib.crc32 agree on it): IPv4 192.0.2.1 -> 192.0.2.2 ID 0 DF TTL 64,
// UDP 49152 -> 4791 checksum 0, BTH UD SEND only P_Key 0xFFFF DestQP 1 PSN 0xABCD,
// DETH Q_Key 0x80010000 SrcQP 1, a 256-byte MAD (CM REQ header + byte pattern), ICRC.
const DATAGRAM_HEX: &str = concat!(
    "45000134000040004011b5b5c0000201c0000202c00012b7012000006400ffff",
    "000000010000abcd800100000000000101070203000000000000000100000001",
    "00100000000000000b30557a9fc4e90e33587da2c7ec11365b80a5caef14395e",
    "83a8cdf2173c6186abd0f51a3f6489aed3f81d42678cb1d6fb20456a8fb4d9fe",
    "23486d92b7dc01264b7095badf04294e7398bde2072c51769bc0e50a2f54799e",
    "c3e80d32577ca1c6eb10355a7fa4c9ee13385d82a7ccf1163b6085aacff4193e",
    "6388add2f71c41668bb0d5fa1f44698eb3d8fd22476c91b6db00254a6f94b9de",
    "03284d7297bce1062b50759abfe4092e53789dc2e70c31567ba0c5ea0f34597e",
    "a3c8ed12375c81a6cbf0153a5f84a9cef3183d6287acd1f61b40658aafd4f91e",
    "43688db2d7fc21466b90b5daff24496e08cc9ef2",
);
const ICRC: u32 = 0xf29ecc08;

/// Offsets in the datagram: IPv4 header 0..20, UDP 20..28, frame from 28.
const FRAME_AT: usize = 28;
const BTH_DEST_QP: std::ops::Range<usize> = FRAME_AT + 5..FRAME_AT + 8;
const BTH_PSN: std::ops::Range<usize> = FRAME_AT + 9..FRAME_AT + 12;
const MAD: std::ops::Range<usize> = FRAME_AT + 20..FRAME_AT + 276;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn vector() -> Vec<u8> {
    let v = hex(DATAGRAM_HEX);
    assert_eq!(v.len(), DATAGRAM_LEN);
    v
}

fn ip() -> Ipv4Repr {
    Ipv4Repr::new(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 2, 2))
}

fn udp() -> UdpRepr {
    UdpRepr::new(49152)
}

#[test]
fn independent_vector_icrc() {
    let v = vector();
    let (ip_p, udp_p, frame) = roce::parse_datagram(&v).unwrap();
    assert_eq!(ip_p, ip());
    assert_eq!(udp_p, udp());
    assert_eq!(frame.icrc(), ICRC);
    assert_eq!(frame.compute_icrc(&ip(), &udp()), ICRC);
    assert_eq!(roce::icrc(&ip(), &udp(), frame.covered()), ICRC);
    frame.check_icrc(&ip(), &udp()).unwrap();
    roce::check_datagram_icrc(&v).unwrap();
    // The ICRC goes on the wire LSB first.
    assert_eq!(&v[DATAGRAM_LEN - 4..], &ICRC.to_le_bytes());
}

#[test]
fn emit_reproduces_the_vector() {
    let v = vector();
    let mad = &v[MAD];
    let mut out = [0u8; DATAGRAM_LEN];
    let n = roce::emit_datagram(
        &mut out,
        &ip(),
        &udp(),
        &BthRepr::gsi(0xABCD),
        &DethRepr::gsi(),
        mad,
    )
    .unwrap();
    assert_eq!(n, DATAGRAM_LEN);
    assert_eq!(&out[..], &v[..]);

    let mut frame = [0u8; FRAME_LEN];
    let n = roce::emit_frame(
        &mut frame,
        &ip(),
        &udp(),
        &BthRepr::gsi(0xABCD),
        &DethRepr::gsi(),
        mad,
    )
    .unwrap();
    assert_eq!(n, FRAME_LEN);
    assert_eq!(&frame[..], &v[FRAME_AT..]);

    let f = Frame::new_checked(&frame[..]).unwrap();
    let r = FrameRepr::parse(&f).unwrap();
    assert_eq!(r, FrameRepr::gsi(0xABCD, mad));
    assert_eq!(
        r.to_string(),
        "BTH UD_SEND_ONLY pkey=0xffff dqpn=0x000001 psn=0x00abcd \
         DETH qkey=0x80010000 sqpn=0x000001 MAD[256]"
    );
}

#[test]
fn fill_icrc_after_a_rewrite() {
    let v = vector();
    let mut frame = v[FRAME_AT..].to_vec();
    let mut f = Frame::new_checked(&mut frame[..]).unwrap();
    f.mad_mut()[24] ^= 0x55; // a proxy rewrites the Local Comm ID
    assert!(matches!(
        f.check_icrc(&ip(), &udp()),
        Err(Error::Icrc { found: ICRC, .. })
    ));
    f.fill_icrc(&ip(), &udp());
    f.check_icrc(&ip(), &udp()).unwrap();
    assert_ne!(f.icrc(), ICRC);
}

fn assert_icrc_breaks(v: &[u8], at: usize) {
    let mut w = v.to_vec();
    w[at] ^= 0x01;
    assert!(
        matches!(
            roce::check_datagram_icrc(&w),
            Err(Error::Icrc { found: ICRC, .. })
        ),
        "flipping byte {at} must break the ICRC"
    );
    // Through the frame view with the (unchanged) header reprs too, when the byte is
    // in the frame.
    if at >= FRAME_AT {
        let f = Frame::new_checked(&w[FRAME_AT..]).unwrap();
        assert!(matches!(
            f.check_icrc(&ip(), &udp()),
            Err(Error::Icrc { .. })
        ));
    }
}

fn assert_icrc_holds(v: &[u8], at: usize, xor: u8) {
    let mut w = v.to_vec();
    w[at] ^= xor;
    assert_eq!(
        roce::check_datagram_icrc(&w),
        Ok(()),
        "byte {at} ^ {xor:#04x} must not change the ICRC"
    );
}

#[test]
fn covered_bytes_break_the_icrc() {
    let v = vector();
    for at in BTH_DEST_QP.chain(BTH_PSN).chain(MAD) {
        assert_icrc_breaks(&v, at);
    }
    // IP source and destination addresses.
    for at in 12..20 {
        assert_icrc_breaks(&v, at);
    }
    // Also covered: IP ID, flags, protocol, UDP ports and length, BTH opcode-flags and
    // P_Key, DETH. (Total length and opcode changes fail earlier, as typed errors.)
    for at in [4, 5, 6, 20, 21, 22, 23, 24, 25, 30, 31, 36, 40, 44, 47] {
        assert_icrc_breaks(&v, at);
    }
    // The same through the reprs: another address gives another ICRC.
    let f = Frame::new_checked(&v[FRAME_AT..]).unwrap();
    for (src, dst) in [
        (Ipv4Addr::new(192, 0, 2, 3), Ipv4Addr::new(192, 0, 2, 2)),
        (Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 3, 2)),
    ] {
        let ip = Ipv4Repr { src, dst, ..ip() };
        assert!(matches!(f.check_icrc(&ip, &udp()), Err(Error::Icrc { .. })));
    }
    let ip_id = Ipv4Repr {
        identification: 1,
        ..ip()
    };
    assert!(f.check_icrc(&ip_id, &udp()).is_err());
    let no_df = Ipv4Repr {
        dont_fragment: false,
        ..ip()
    };
    assert!(f.check_icrc(&no_df, &udp()).is_err());
}

#[test]
fn variant_fields_do_not() {
    let v = vector();
    assert_icrc_holds(&v, 8, 0x3F); // TTL
    assert_icrc_holds(&v, 1, 0xB8); // TOS: DSCP 46
    assert_icrc_holds(&v, 1, 0x03); // TOS: ECN CE
    assert_icrc_holds(&v, 10, 0x12); // IP header checksum
    assert_icrc_holds(&v, 11, 0x34);
    assert_icrc_holds(&v, 26, 0xAB); // UDP checksum
    assert_icrc_holds(&v, 27, 0xCD);
    assert_icrc_holds(&v, FRAME_AT + 4, 0x80); // FECN
    assert_icrc_holds(&v, FRAME_AT + 4, 0x40); // BECN
    assert_icrc_holds(&v, FRAME_AT + 4, 0xFF); // FECN, BECN, resv6
    let f = Frame::new_checked(&v[FRAME_AT..]).unwrap();
    let ip = Ipv4Repr {
        ttl: 1,
        tos: 0xB8,
        ..ip()
    };
    f.check_icrc(&ip, &udp()).unwrap();
}

#[test]
fn golden_bth_deth() {
    let bth = BthRepr {
        solicited_event: true,
        mig_req: false,
        pkey: 0x8001,
        fecn: false,
        becn: true,
        dest_qp: 0x12_3456,
        ack_req: true,
        psn: 0xAB_CDEF,
    };
    let deth = DethRepr {
        qkey: 0x8001_0000,
        src_qp: 0x00_0001,
    };
    let mut b = [0xEEu8; 12];
    bth.emit(&mut BthPacket::new_unchecked(&mut b[..]));
    let mut d = [0xEEu8; 8];
    deth.emit(&mut DethPacket::new_unchecked(&mut d[..]));
    #[rustfmt::skip]
    let expected_bth: [u8; 12] = [
        0x64,             // opcode: UD SEND only
        0x80,             // SE=1 M=0 PadCnt=0 TVer=0
        0x80, 0x01,       // P_Key
        0x40,             // FECN=0 BECN=1 resv6=0
        0x12, 0x34, 0x56, // DestQP
        0x80,             // AckReq=1 resv7=0
        0xAB, 0xCD, 0xEF, // PSN
    ];
    #[rustfmt::skip]
    let expected_deth: [u8; 8] = [
        0x80, 0x01, 0x00, 0x00, // Q_Key
        0x00,                   // reserved
        0x00, 0x00, 0x01,       // SrcQP
    ];
    assert_eq!(b, expected_bth);
    assert_eq!(d, expected_deth);
    let p = BthPacket::new_checked(&b[..]).unwrap();
    assert_eq!(BthRepr::parse(&p).unwrap(), bth);
    assert!(p.solicited_event() && p.becn() && p.ack_req());
    assert!(!p.fecn() && !p.mig_req());
    assert_eq!((p.opcode(), p.tver(), p.pad_count()), (0x64, 0, 0));
    let q = DethPacket::new_checked(&d[..]).unwrap();
    assert_eq!(DethRepr::parse(&q).unwrap(), deth);
    assert_eq!(
        bth.to_string(),
        "BTH UD_SEND_ONLY pkey=0x8001 dqpn=0x123456 psn=0xabcdef se becn ackreq"
    );
    assert_eq!(deth.to_string(), "DETH qkey=0x80010000 sqpn=0x000001");
    assert!(BthPacket::new_checked(&b[..11]).is_err());
    assert!(DethPacket::new_checked(&d[..7]).is_err());
}

#[test]
fn typed_errors() {
    let v = vector();
    let frame = &v[FRAME_AT..];
    for len in [0, 1, 11, 12, 23] {
        assert_eq!(
            Frame::new_checked(&frame[..len]).err(),
            Some(Error::Truncated {
                need: FRAME_LEN,
                have: len
            }),
            "len {len}"
        );
    }
    assert_eq!(
        Frame::new_checked(&frame[..FRAME_LEN - 1]).err(),
        Some(Error::PayloadLength(255))
    );
    let mut long = frame.to_vec();
    long.push(0);
    assert_eq!(
        Frame::new_checked(&long[..]).err(),
        Some(Error::PayloadLength(257))
    );
    let mut w = frame.to_vec();
    w[0] = 0x04; // RC SEND only
    assert_eq!(
        Frame::new_checked(&w[..]).err(),
        Some(Error::BthOpcode(0x04))
    );
    assert_eq!(
        Frame::new_checked(&w[..12]).err(),
        Some(Error::BthOpcode(0x04))
    );
    let mut w = frame.to_vec();
    w[1] = 0x01;
    assert_eq!(Frame::new_checked(&w[..]).err(), Some(Error::BthVersion(1)));
    let mut w = frame.to_vec();
    w[1] = 0x30; // pad count 3
    assert_eq!(
        Frame::new_checked(&w[..]).err(),
        Some(Error::PayloadLength(253))
    );
    let mut w = frame.to_vec();
    w[FRAME_LEN - 1] ^= 0xFF;
    let f = Frame::new_checked(&w[..]).unwrap();
    assert_eq!(
        f.check_icrc(&ip(), &udp()),
        Err(Error::Icrc {
            found: ICRC ^ 0xFF00_0000,
            computed: ICRC
        })
    );
    // Emit errors.
    let mut short = [0u8; FRAME_LEN - 1];
    assert!(matches!(
        roce::emit_frame(
            &mut short,
            &ip(),
            &udp(),
            &BthRepr::gsi(0),
            &DethRepr::gsi(),
            &v[MAD]
        ),
        Err(Error::Truncated { .. })
    ));
    let mut buf = [0u8; FRAME_LEN];
    assert_eq!(
        roce::emit_frame(
            &mut buf,
            &ip(),
            &udp(),
            &BthRepr::gsi(0),
            &DethRepr::gsi(),
            &v[MAD.start..MAD.end - 1]
        ),
        Err(Error::PayloadLength(255))
    );
    // Datagram errors.
    let mut w = v.clone();
    w[0] = 0x65;
    assert!(matches!(
        roce::parse_datagram(&w),
        Err(Error::Unsupported(_))
    ));
    let mut w = v.clone();
    w[0] = 0x46;
    assert!(matches!(
        roce::parse_datagram(&w),
        Err(Error::Unsupported(_))
    ));
    let mut w = v.clone();
    w[8] = 1; // TTL changed, checksum not updated
    assert!(matches!(
        roce::parse_datagram(&w),
        Err(Error::Ipv4Checksum { .. })
    ));
    assert!(matches!(
        roce::parse_datagram(&v[..100]),
        Err(Error::Truncated { .. })
    ));
}

#[test]
fn header_reprs_display() {
    assert_eq!(
        ip().to_string(),
        "IPv4 192.0.2.1 -> 192.0.2.2 id=0 DF ttl=64 tos=0x00 proto=17 len=308"
    );
    assert_eq!(udp().to_string(), "UDP 49152 -> 4791 len=288");
}

/// Touches every accessor of a frame that passed `new_checked`.
fn poke(f: &Frame<&[u8]>, ip: &Ipv4Repr, udp: &UdpRepr) {
    let b = f.bth();
    let _ = (b.opcode(), b.solicited_event(), b.mig_req(), b.pad_count());
    let _ = (
        b.tver(),
        b.pkey(),
        b.fecn(),
        b.becn(),
        b.dest_qp(),
        b.ack_req(),
    );
    let _ = b.psn();
    let d = f.deth();
    let _ = (d.qkey(), d.src_qp());
    assert_eq!(f.mad().len(), 256);
    let _ = (f.icrc(), f.covered().len(), f.check_icrc(ip, udp));
    if let Ok(r) = FrameRepr::parse(f) {
        let _ = r.to_string();
    }
}

proptest! {
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(f) = Frame::new_checked(&bytes[..]) {
            poke(&f, &ip(), &udp());
        }
        let _ = roce::parse_datagram(&bytes);
        let _ = roce::check_datagram_icrc(&bytes);
        let _ = Ipv4Repr::parse(&bytes);
        let _ = UdpRepr::parse(&bytes);
        let _ = roce::icrc(&ip(), &udp(), &bytes);
    }

    #[test]
    fn mutated_vector_never_panics(
        edits in proptest::collection::vec((0usize..DATAGRAM_LEN, any::<u8>()), 0..8),
        cut in 0usize..DATAGRAM_LEN + 8,
    ) {
        let mut v = vector();
        for (at, b) in edits {
            v[at] = b;
        }
        v.resize(cut, 0);
        let _ = roce::parse_datagram(&v);
        let _ = roce::check_datagram_icrc(&v);
        if v.len() > FRAME_AT {
            if let Ok(f) = Frame::new_checked(&v[FRAME_AT..]) {
                poke(&f, &ip(), &udp());
            }
        }
    }
}

// ---- RoCEv2 over IPv6 ----

use pvcm_wire::roce::{IPV6_DATAGRAM_LEN, IpRepr, Ipv6Packet, Ipv6Repr};
use std::net::Ipv6Addr;

fn ip6() -> Ipv6Repr {
    Ipv6Repr::new(
        "2001:db8::1".parse().unwrap(),
        "2001:db8::2".parse().unwrap(),
    )
}

/// A pvcm IPv6 datagram built by the crate, with masked fields set to non-defaults.
fn datagram6(psn: u32, mad: &[u8]) -> Vec<u8> {
    let ip = Ipv6Repr {
        traffic_class: 0x68,
        flow_label: 0xABCDE,
        hop_limit: 17,
        ..ip6()
    };
    let mut d = vec![0u8; IPV6_DATAGRAM_LEN];
    let n = roce::emit_datagram(
        &mut d,
        &ip,
        &UdpRepr::new(0xC0DE),
        &BthRepr::gsi(psn),
        &DethRepr::gsi(),
        mad,
    )
    .unwrap();
    assert_eq!(n, IPV6_DATAGRAM_LEN);
    d
}

/// Offsets in an IPv6 datagram: IPv6 header 0..40, UDP 40..48, frame from 48.
const FRAME6_AT: usize = 48;

#[test]
fn ipv6_header_layout() {
    let ip = Ipv6Repr {
        traffic_class: 0xB8,
        flow_label: 0x12345,
        hop_limit: 9,
        ..ip6()
    };
    let mut h = [0xEEu8; 40];
    ip.emit(&mut h).unwrap();
    #[rustfmt::skip]
    let want_head: [u8; 8] = [
        0x6B, 0x81, 0x23, 0x45, // version 6, TC 0xB8, flow label 0x12345
        0x01, 0x20,             // payload length 288
        17,                     // next header UDP
        9,                      // hop limit
    ];
    assert_eq!(&h[..8], &want_head);
    assert_eq!(&h[8..24], &ip.src.octets());
    assert_eq!(&h[24..40], &ip.dst.octets());
    assert_eq!(Ipv6Repr::parse(&h).unwrap(), ip);
    let p = Ipv6Packet::new_checked(&h[..]).unwrap();
    assert_eq!(
        (
            p.version(),
            p.traffic_class(),
            p.flow_label(),
            p.hop_limit()
        ),
        (6, 0xB8, 0x12345, 9)
    );
    assert_eq!((p.payload_len(), p.next_header()), (288, 17));
    assert_eq!(
        ip.to_string(),
        "IPv6 2001:db8::1 -> 2001:db8::2 tc=0xb8 flow=0x12345 hop=9 nh=17 len=288"
    );
    assert!(matches!(
        Ipv6Packet::new_checked(&h[..39]),
        Err(Error::Truncated { need: 40, have: 39 })
    ));
    let mut v4 = h;
    v4[0] = 0x45;
    assert!(matches!(Ipv6Repr::parse(&v4), Err(Error::Unsupported(_))));
    // Setters through the view.
    let mut b = [0u8; 40];
    let mut q = Ipv6Packet::new_unchecked(&mut b[..]);
    q.set_version(6);
    q.set_flow_label(0xFFFFF);
    q.set_traffic_class(0x01);
    assert_eq!(&b[..4], &[0x60, 0x1F, 0xFF, 0xFF]);
}

#[test]
fn ipv6_datagram_round_trip_and_icrc() {
    let v = vector();
    let mad = &v[MAD];
    let d = datagram6(0x1234, mad);
    let (got, udp, frame) = roce::parse_datagram6(&d).unwrap();
    let ip = got;
    assert_eq!((ip.src, ip.dst), (ip6().src, ip6().dst));
    assert_eq!(
        (ip.payload_len, ip.next_header, ip.hop_limit),
        (288, 17, 17)
    );
    assert_eq!(
        (udp.src_port, udp.dst_port, udp.length),
        (0xC0DE, 4791, 288)
    );
    assert_eq!(
        FrameRepr::parse(&frame).unwrap(),
        FrameRepr::gsi(0x1234, mad)
    );
    frame.check_icrc(&ip, &udp).unwrap();
    // The ICRC does not depend on the masked fields: ip6() has other ones.
    frame.check_icrc(&ip6(), &udp).unwrap();
    roce::check_datagram_icrc(&d).unwrap();
    let (any, _, _) = roce::parse_ip_datagram(&d).unwrap();
    assert_eq!(any, IpRepr::V6(ip));
    assert_eq!(
        roce::parse_ip_datagram(&v).unwrap().0,
        IpRepr::V4(self::ip())
    );
    // The UDP checksum is valid over IPv6 (a kernel UDP socket would take it).
    let sum = roce::udp6_checksum(&ip.src, &ip.dst, &d[40..]);
    assert_eq!(u16::from_be_bytes([d[46], d[47]]), sum);
    assert_ne!(sum, 0);
    // The same frame over IPv4 has another ICRC.
    assert!(frame.check_icrc(&self::ip(), &udp).is_err());
    // IpRepr::from_gids picks the family.
    let g6 = |s: &str| pvcm_wire::Gid::from(s.parse::<Ipv6Addr>().unwrap());
    let g4 = |a: [u8; 4]| pvcm_wire::Gid::from_ipv4(Ipv4Addr::from(a));
    assert_eq!(
        IpRepr::from_gids(g6("2001:db8::1"), g6("2001:db8::2")),
        Some(IpRepr::V6(ip6()))
    );
    assert_eq!(
        IpRepr::from_gids(g4([192, 0, 2, 1]), g4([192, 0, 2, 2])),
        Some(IpRepr::V4(self::ip()))
    );
    assert_eq!(
        IpRepr::from_gids(g4([192, 0, 2, 1]), g6("2001:db8::2")),
        None
    );
}

#[test]
fn ipv6_typed_errors() {
    let v = vector();
    let d = datagram6(1, &v[MAD]);
    for nh in [0u8, 43, 44, 60, 6, 58, 59] {
        // hop-by-hop, routing, fragment, destination options, TCP, ICMPv6, no next
        let mut w = d.clone();
        w[6] = nh;
        assert_eq!(
            roce::parse_datagram6(&w).err(),
            Some(Error::Ipv6NextHeader(nh))
        );
        assert_eq!(
            roce::check_datagram_icrc(&w),
            Err(Error::Ipv6NextHeader(nh))
        );
        assert_eq!(
            roce::parse_ip_datagram(&w).err(),
            Some(Error::Ipv6NextHeader(nh))
        );
    }
    for cut in [0, 1, 39, 40, 47, 48, 100, IPV6_DATAGRAM_LEN - 1] {
        assert!(
            matches!(
                roce::parse_datagram6(&d[..cut]),
                Err(Error::Truncated { .. } | Error::PayloadLength(_))
            ),
            "cut {cut}"
        );
    }
    // A payload length beyond the buffer is truncated; a short one cuts the frame.
    let mut w = d.clone();
    w[4..6].copy_from_slice(&300u16.to_be_bytes());
    assert!(matches!(
        roce::parse_datagram6(&w),
        Err(Error::Truncated { .. })
    ));
    let mut w = d.clone();
    w[4..6].copy_from_slice(&200u16.to_be_bytes());
    assert!(roce::parse_datagram6(&w).is_err());
    // IPv4 and IPv6 parsers refuse each other's headers.
    assert!(matches!(
        roce::parse_datagram(&d),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        roce::parse_datagram6(&v),
        Err(Error::Unsupported(_))
    ));
    let mut w = d.clone();
    w[0] = 0x50;
    assert!(roce::parse_ip_datagram(&w).is_err());
    assert!(roce::check_datagram_icrc(&w).is_err());
    // Emitting into a short buffer.
    let mut short = [0u8; IPV6_DATAGRAM_LEN - 1];
    assert!(matches!(
        roce::emit_datagram(
            &mut short,
            &ip6(),
            &udp(),
            &BthRepr::gsi(0),
            &DethRepr::gsi(),
            &v[MAD]
        ),
        Err(Error::Truncated { .. })
    ));
}

/// Every byte of an IPv6 datagram, by what the ICRC does with it: covered bytes break
/// it, masked bits never do.
#[test]
fn ipv6_covered_and_masked_bytes() {
    let v = vector();
    let d = datagram6(7, &v[MAD]);
    roce::check_datagram_icrc(&d).unwrap();
    // Masked: TC + flow label (bits 4..32), hop limit, UDP checksum, BTH byte 4.
    let masked: &[(usize, u8)] = &[
        (0, 0x0F),
        (1, 0xFF),
        (2, 0xFF),
        (3, 0xFF),
        (7, 0xFF),
        (46, 0xFF),
        (47, 0xFF),
        (FRAME6_AT + 4, 0xFF),
    ];
    for &(at, bits) in masked {
        for x in [bits, bits & 0x55, bits & 0xAA, bits & 0x01] {
            if x == 0 {
                continue;
            }
            let mut w = d.clone();
            w[at] ^= x;
            assert_eq!(
                roce::check_datagram_icrc(&w),
                Ok(()),
                "byte {at} ^ {x:#04x} must not change the ICRC"
            );
        }
    }
    // Covered: every other bit of the headers and the frame (payload length and next
    // header are covered too, but changing them fails earlier: next header 17 only).
    for at in 0..IPV6_DATAGRAM_LEN - 4 {
        let mask = masked
            .iter()
            .find(|(a, _)| *a == at)
            .map_or(0u8, |(_, m)| *m);
        for bit in 0..8 {
            let x = 1u8 << bit;
            if mask & x != 0 {
                continue;
            }
            let mut w = d.clone();
            w[at] ^= x;
            let r = roce::check_datagram_icrc(&w);
            assert!(
                matches!(
                    r,
                    Err(Error::Icrc { .. }
                        | Error::Ipv6NextHeader(_)
                        | Error::Unsupported(_)
                        | Error::BthOpcode(_)
                        | Error::BthVersion(_)
                        | Error::PayloadLength(_))
                ),
                "byte {at} bit {bit}: {r:?}"
            );
            if (8..40).contains(&at) || (40..46).contains(&at) || at >= FRAME6_AT + 12 {
                // Addresses, UDP ports and length, DETH and MAD: the ICRC itself.
                assert!(matches!(r, Err(Error::Icrc { .. })), "byte {at}: {r:?}");
            }
        }
    }
}

fn arb_ip6() -> impl Strategy<Value = Ipv6Repr> {
    (
        any::<u128>(),
        any::<u128>(),
        any::<u8>(),
        0u32..1 << 20,
        any::<u8>(),
    )
        .prop_map(|(s, d, tc, fl, hop)| Ipv6Repr {
            traffic_class: tc,
            flow_label: fl,
            hop_limit: hop,
            ..Ipv6Repr::new(Ipv6Addr::from(s), Ipv6Addr::from(d))
        })
}

proptest! {
    /// emit/parse round trip of whole IPv6 datagrams; the ICRC holds.
    #[test]
    fn ipv6_emit_parse_round_trip(
        ip in arb_ip6(),
        sport in any::<u16>(),
        psn in 0u32..1 << 24,
        mad in proptest::collection::vec(any::<u8>(), 256),
    ) {
        let mut d = vec![0u8; IPV6_DATAGRAM_LEN];
        roce::emit_datagram(&mut d, &ip, &UdpRepr::new(sport), &BthRepr::gsi(psn),
            &DethRepr::gsi(), &mad).unwrap();
        let (p, u, f) = roce::parse_datagram6(&d).unwrap();
        prop_assert_eq!(p, ip);
        prop_assert_eq!(u, UdpRepr::new(sport));
        prop_assert_eq!(FrameRepr::parse(&f).unwrap(), FrameRepr::gsi(psn, &mad));
        prop_assert_eq!(f.check_icrc(&ip, &u), Ok(()));
        prop_assert_eq!(roce::check_datagram_icrc(&d), Ok(()));
        let mut h = [0u8; 40];
        ip.emit(&mut h).unwrap();
        prop_assert_eq!(Ipv6Repr::parse(&h).unwrap(), ip);
    }

    /// Any change of one covered byte breaks the ICRC (or fails a header check first);
    /// any change of masked bits leaves it.
    #[test]
    fn ipv6_icrc_catches_covered_ignores_masked(
        ip in arb_ip6(),
        mad in proptest::collection::vec(any::<u8>(), 256),
        at in 0usize..IPV6_DATAGRAM_LEN - 4,
        x in 1u8..=255,
        tc in any::<u8>(), fl in 0u32..1 << 20, hop in any::<u8>(), csum in any::<u16>(),
        variant in any::<u8>(),
    ) {
        let mut d = vec![0u8; IPV6_DATAGRAM_LEN];
        roce::emit_datagram(&mut d, &ip, &UdpRepr::new(4791), &BthRepr::gsi(1),
            &DethRepr::gsi(), &mad).unwrap();
        // Masked fields to anything: still good.
        let mut m = d.clone();
        m[0] = 0x60 | (tc >> 4);
        m[1] = (tc << 4) | (fl >> 16) as u8;
        m[2..4].copy_from_slice(&(fl as u16).to_be_bytes());
        m[7] = hop;
        m[46..48].copy_from_slice(&csum.to_be_bytes());
        m[FRAME6_AT + 4] = variant;
        prop_assert_eq!(roce::check_datagram_icrc(&m), Ok(()));
        // One covered byte changed: bad.
        let masked_bits = match at {
            0 => 0x0F, 1..=3 | 7 | 46 | 47 => 0xFF,
            a if a == FRAME6_AT + 4 => 0xFF,
            _ => 0,
        };
        let x = x & !masked_bits;
        prop_assume!(x != 0);
        let mut w = d.clone();
        w[at] ^= x;
        prop_assert!(roce::check_datagram_icrc(&w).is_err());
    }

    #[test]
    fn ipv6_random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
        let _ = roce::parse_datagram6(&bytes);
        let _ = roce::parse_ip_datagram(&bytes);
        let _ = roce::check_datagram_icrc(&bytes);
        let _ = Ipv6Repr::parse(&bytes);
        let _ = IpRepr::parse(&bytes);
        let mut b = bytes.clone();
        if !b.is_empty() {
            b[0] = 0x60 | (b[0] & 0x0F);
        }
        if let Ok((h, u, f)) = roce::parse_datagram6(&b) {
            poke(&f, &ip(), &u);
            let _ = f.check_icrc(&h, &u);
        }
        let _ = roce::check_datagram_icrc(&b);
    }
}

/// A real RoCEv2-over-IPv6 CM REQ from Linux 6.1's rdma_rxe (rdma_cm, ucmatose), as it
/// crossed the wire. Captured between two TCG guests (Debian 12, kernel 6.1.0-57,
/// rdma-core 44) on one bridge with IPv6 on, `ip -6 addr add fd99::2/64` and `fd99::3/64` on their eth0, `ucmatose -b fd99::2 -c
/// 1 -C 2` on one and `ucmatose -s fd99::2 -b fd99::3 -c 1 -C 2` on the other; this is
/// the IPv6 datagram of the capture's first UDP 4791 frame (Ethernet header removed).
/// rxe sends traffic class 0, flow label 0, hop limit 64, UDP checksum 0 (which only a
/// socket with UDP_NO_CHECK6_RX accepts over IPv6) and AckReq set in the BTH.
const RXE_IPV6_REQ_HEX: &[&str] = &[
    "6000000001201140fd990000000000000000000000000003fd99000000000000",
    "0000000000000002d87212b7012000006400ffff000000018000000080010000",
    "000000010107020300000000000000023bcae6c20010000000000000c2e6ca3b",
    "000000000000000001061d2f505400fffe990003000000000000000000001101",
    "00000001000000a0ec4de8a5ffff30f0fffffffffd9900000000000000000000",
    "00000003fd9900000000000000000000000000023e4d70000040009800000000",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "00000000000000000060a358fd990000000000000000000000000003fd990000",
    "0000000000000000000000020000000000000000000000000000000000000000",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "00000000659e71fd",
];

fn rxe_ipv6_req() -> Vec<u8> {
    let v = hex(&RXE_IPV6_REQ_HEX.concat());
    assert_eq!(v.len(), IPV6_DATAGRAM_LEN);
    v
}

#[test]
fn rxe_ipv6_golden_vector() {
    let v = rxe_ipv6_req();
    roce::check_datagram_icrc(&v).unwrap();
    let (ip, udp, frame) = roce::parse_datagram6(&v).unwrap();
    let fd = |n: u16| Ipv6Addr::new(0xfd99, 0, 0, 0, 0, 0, 0, n);
    assert_eq!((ip.src, ip.dst), (fd(3), fd(2)));
    assert_eq!(
        (
            ip.traffic_class,
            ip.flow_label,
            ip.hop_limit,
            ip.payload_len
        ),
        (0, 0, 64, 288)
    );
    assert_eq!(
        (udp.src_port, udp.dst_port, udp.length),
        (0xd872, 4791, 288)
    );
    assert_eq!(frame.icrc(), 0xfd719e65);
    // The same ICRC from the reprs, under the header a UDP socket would rebuild: the
    // addresses, ports and lengths are all it needs (the rest is masked).
    frame
        .check_icrc(&Ipv6Repr::new(fd(3), fd(2)), &udp)
        .unwrap();
    let bth = FrameRepr::parse(&frame).unwrap().bth;
    assert!(bth.ack_req);
    assert_eq!((bth.dest_qp, bth.pkey), (1, 0xFFFF));
    let mad = pvcm_wire::cm::CmMad::new_checked(frame.mad()).unwrap();
    assert_eq!(mad.attr(), pvcm_wire::mad::AttributeId::Req);
    // Re-emitting the frame under the captured headers reproduces every byte but the
    // UDP checksum (rxe sends 0; pvcm computes it) and the BTH's AckReq bit (kept by
    // BthRepr, so equal too).
    let r = FrameRepr::parse(&frame).unwrap();
    let mut out = vec![0u8; IPV6_DATAGRAM_LEN];
    r.emit_datagram(&mut out, &ip, &udp).unwrap();
    assert_eq!(&out[..46], &v[..46]);
    assert_eq!(&out[48..], &v[48..]);
    // A flipped address bit, a changed UDP port: bad.
    for at in [8, 39, 40, 43, 48 + 30, 327 - 4] {
        let mut w = v.clone();
        w[at] ^= 0x10;
        assert!(matches!(
            roce::check_datagram_icrc(&w),
            Err(Error::Icrc { .. })
        ));
    }
}

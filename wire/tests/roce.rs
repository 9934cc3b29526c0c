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

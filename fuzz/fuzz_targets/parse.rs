//! Arbitrary bytes into every parser of pvcm-wire: none may panic.
//!
//! The input is tried as a RoCEv2 frame (UDP payload), as a whole IPv4 datagram, as a
//! whole IPv6 datagram (the same bytes with the IPv6 version nibble, so both parsers see
//! every input) and as a bare CM MAD; a frame that passes `new_checked` also has its MAD
//! decoded. An IPv6 datagram that parses must emit back to the same headers and frame,
//! with a good ICRC. Every
//! accessor of a checked view is called, the proxy's rewrites are applied to a copy,
//! and a CM message that parses must emit and parse back to the same value.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pvcm_wire::cm::{CmMad, CmRepr};
use pvcm_wire::roce::{self, Frame, FrameRepr, IpRepr, Ipv4Repr, Ipv6Packet, Ipv6Repr, UdpRepr};
use std::net::Ipv4Addr;

fuzz_target!(|data: &[u8]| {
    let ip = Ipv4Repr::new(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(192, 0, 2, 2));
    let udp = UdpRepr::new(roce::UDP_PORT);

    if let Ok(frame) = Frame::new_checked(data) {
        frame_accessors(&frame, &ip, &udp);
        mad(frame.mad());
    }
    if let Ok((ip, udp, frame)) = roce::parse_datagram(data) {
        frame_accessors(&frame, &ip, &udp);
        mad(frame.mad());
    }
    let _ = roce::check_datagram_icrc(data);
    let _ = Ipv4Repr::parse(data);
    let _ = UdpRepr::parse(data);
    ipv6(data);
    if let Some(first) = data.first() {
        let mut v6 = data.to_vec();
        v6[0] = 0x60 | (first & 0x0F);
        ipv6(&v6);
    }
    mad(data);
});

fn ipv6(data: &[u8]) {
    let _ = roce::check_datagram_icrc(data);
    let _ = IpRepr::parse(data);
    if let Ok(p) = Ipv6Packet::new_checked(data) {
        let _ = (p.version(), p.traffic_class(), p.flow_label(), p.payload_len());
        let _ = (p.next_header(), p.hop_limit(), p.src(), p.dst());
    }
    if let Ok((any, _, _)) = roce::parse_ip_datagram(data) {
        let _ = any.to_string();
    }
    let Ok((ip, udp, frame)) = roce::parse_datagram6(data) else {
        return;
    };
    let _ = ip.to_string();
    frame_accessors(&frame, &ip, &udp);
    mad(frame.mad());
    // A parsed datagram emits back to the same headers and frame (the UDP length and
    // the payload length set for one frame, the ICRC recomputed).
    if let Ok(r) = FrameRepr::parse(&frame) {
        let mut out = [0u8; roce::IPV6_DATAGRAM_LEN];
        let n = r
            .emit_datagram(&mut out, &ip, &udp)
            .expect("a parsed frame must emit");
        let (ip2, udp2, f2) = roce::parse_datagram6(&out[..n]).expect("emitted must parse");
        assert_eq!((ip2.src, ip2.dst, ip2.next_header), (ip.src, ip.dst, ip.next_header));
        assert_eq!((udp2.src_port, udp2.dst_port), (udp.src_port, udp.dst_port));
        assert_eq!(FrameRepr::parse(&f2).ok(), Some(r));
        assert_eq!(roce::check_datagram_icrc(&out[..n]), Ok(()));
        assert_eq!(
            f2.compute_icrc(&Ipv6Repr::new(ip.src, ip.dst), &udp2),
            f2.icrc(),
            "the masked fields are not covered"
        );
    }
}

fn frame_accessors<H: roce::IpHeader>(frame: &Frame<&[u8]>, ip: &H, udp: &UdpRepr) {
    let b = frame.bth();
    let _ = (
        b.opcode(),
        b.solicited_event(),
        b.mig_req(),
        b.pad_count(),
        b.tver(),
    );
    let _ = (
        b.pkey(),
        b.fecn(),
        b.becn(),
        b.dest_qp(),
        b.ack_req(),
        b.psn(),
    );
    let d = frame.deth();
    let _ = (d.qkey(), d.src_qp());
    assert_eq!(frame.mad().len(), pvcm_wire::mad::MAD_LEN);
    let _ = (frame.icrc(), frame.covered(), frame.check_icrc(ip, udp));
    if let Ok(r) = FrameRepr::parse(frame) {
        let _ = r.to_string();
        // Re-emitting a parsed frame gives back the same bytes (but the ICRC, which is
        // recomputed, and the reserved bits, which are zeroed).
        let mut out = [0u8; roce::FRAME_LEN];
        if r.emit(&mut out, ip, udp).is_ok() {
            let f2 = Frame::new_checked(&out[..]).expect("emitted frame must check");
            assert_eq!(FrameRepr::parse(&f2).ok(), Some(r));
            assert_eq!(f2.check_icrc(ip, udp), Ok(()));
        }
    }
}

fn mad(bytes: &[u8]) {
    if let Ok(m) = CmMad::new_checked(bytes) {
        let _ = (
            m.attr(),
            m.header().attr_id(),
            m.tid(),
            m.method(),
            m.as_bytes().len(),
        );
        let _ = (m.has_local_comm_id(), m.has_remote_comm_id());
        let _ = (m.local_comm_id(), m.remote_comm_id(), m.sidr_request_id());
        let _ = (m.req_primary_remote_gid(), m.req_primary_local_gid());
        let _ = (m.local_ca_guid(), m.local_qpn(), m.remote_qpn());
        let _ = (m.rej_reason(), m.rej_ari(), m.rej_timeout_ca_guid());
        let _ = (m.msg_response(), m.mra_service_timeout());

        // The proxy's rewrites, on a copy.
        let mut copy = bytes.to_vec();
        if let Ok(mut w) = CmMad::new_checked(&mut copy[..]) {
            w.set_tid(0x0123_4567_89ab_cdef);
            let _ = w.set_local_comm_id(0x1111_1111);
            let _ = w.set_remote_comm_id(0x2222_2222);
            let _ = w.set_sidr_request_id(0x3333_3333);
        }
        assert!(
            CmMad::new_checked(&copy[..]).is_ok(),
            "a rewrite broke the MAD"
        );
    }
    if let Ok((header, repr)) = CmRepr::parse(bytes) {
        let _ = repr.to_string();
        let _ = header.to_string();
        let mut out = [0u8; pvcm_wire::mad::MAD_LEN];
        repr.emit(&header, &mut out)
            .expect("a parsed CM message must emit");
        let again = CmRepr::parse(&out).expect("an emitted CM message must parse");
        assert_eq!(again, (header, repr), "CM parse/emit round trip");
    }
}

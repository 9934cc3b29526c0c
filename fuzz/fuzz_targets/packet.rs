//! Arbitrary bytes as an Ethernet frame read by the packet port (`backend/src/port/
//! packet.rs`): its check (Ethernet, IPv4 or IPv6, UDP, BTH, DETH, the ICRC over the
//! headers as received) must never panic, and a frame it accepts must be what it says:
//! its destination is the frame's, its ICRC verifies, its MAD is the frame's MAD and its
//! source GID the IP source. The same bytes as a frame transmitted on the device (a VM's
//! own, `check_egress_frame`) never panic either, and a whole RoCEv2 frame to QP1 from
//! a VM's address is `vm_qp1_egress` of that address.
//!
//! The first input byte picks how the rest is used: as it is, or written over a valid
//! IPv4 or IPv6 RoCEv2 frame (byte edits at fuzzer-chosen offsets), so the fuzzer gets
//! past the ICRC and reaches every later check.

#![no_main]

use libfuzzer_sys::fuzz_target;
use pvcm_backend::port::packet::{
    ETH_HLEN, check_egress_frame, check_ether_frame, frame_destination,
};
use pvcm_backend::stats::DevDrop;
use pvcm_wire::roce::{self, BthRepr, DethRepr, FrameRepr, IpRepr, Ipv4Repr, Ipv6Repr, UdpRepr};

const PORT: u16 = 4791;

fn valid(v6: bool) -> Vec<u8> {
    let ip = if v6 {
        IpRepr::V6(Ipv6Repr::new(
            "fd50::2".parse().expect("addr"),
            "fd50::11".parse().expect("addr"),
        ))
    } else {
        IpRepr::V4(Ipv4Repr {
            identification: 0x1234,
            ..Ipv4Repr::new([10, 50, 0, 2].into(), [10, 50, 0, 11].into())
        })
    };
    let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2];
    f.extend_from_slice(if v6 { &[0x86, 0xdd] } else { &[0x08, 0x00] });
    let mut d = vec![0u8; ip.datagram_len()];
    let mut mad = [0u8; 256];
    mad[1] = 0x07;
    FrameRepr {
        bth: BthRepr::gsi(1),
        deth: DethRepr::gsi(),
        mad: &mad,
    }
    .emit_datagram(&mut d, &ip, &UdpRepr::new(0xd872))
    .expect("emit");
    f.extend_from_slice(&d);
    f
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let frame = match mode % 3 {
        0 => rest.to_vec(),
        m => {
            // Pairs of (offset, byte) written over a valid frame; a last odd byte cuts it.
            let mut f = valid(m == 2);
            for e in rest.chunks(2) {
                match *e {
                    [at, b] => {
                        let i = usize::from(at) % f.len().max(1);
                        f[i] = b;
                    }
                    [cut] => f.truncate(usize::from(cut) * 2),
                    _ => {}
                }
            }
            f
        }
    };
    let _ = frame_destination(&frame);
    let (egress_src, egress) = check_egress_frame(&frame, PORT);
    let Ok((dst, f)) = check_ether_frame(&frame, PORT) else {
        return;
    };
    assert_eq!(frame_destination(&frame), Some(dst));
    let ip = &frame[ETH_HLEN..];
    let (h, udp, fr) = roce::parse_ip_datagram(ip).expect("accepted frames parse");
    assert_eq!(h.dst(), dst);
    assert_eq!(IpRepr::gid(h.src()), f.src);
    assert_eq!(udp.dst_port, PORT);
    assert_eq!(fr.mad(), &f.mad[..]);
    let len = h.datagram_len();
    assert_eq!(roce::check_datagram_icrc(&ip[..len]), Ok(()));
    assert_eq!((f.src_qp, f.qkey), (1, roce::GSI_QKEY));
    assert_eq!((egress_src, egress), (Some(h.src()), DevDrop::VmQp1Egress));
});

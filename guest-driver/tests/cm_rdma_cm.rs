//! rdma_cm compatibility end to end: TCP/UDP port-space service IDs and the `cma_hdr`
//! in front of the application's private data, through two agents.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use std::net::{IpAddr, Ipv4Addr};

use pvcm_guest::cm::rdma_cm::{
    self, CmaHdr, RDMA_PS_TCP, RDMA_PS_UDP, parse_service_id, req_private_data,
    sidr_req_private_data, split_private_data, tcp_service_id, udp_service_id,
};
use pvcm_guest::cm::{ConnectOptions, Event, SidrOptions, SidrStatus};
use pvcm_guest::time::Time;
use support::*;

#[test]
fn tcp_port_space_connect_carries_the_cma_header() {
    let mut p = Pair::new(3);
    let sid = tcp_service_id(7471);
    assert_eq!(sid, 0x0000_0000_0106_1d2f);
    p.agents[1].listen(sid).unwrap();
    let hdr = CmaHdr::from_gids(p.gids[0], p.gids[1], 40000);
    let pd = req_private_data(&hdr, b"user data").unwrap();
    let now = Time::ZERO;
    p.agents[0]
        .connect(p.gids[1], sid, &pd, &ConnectOptions::default(), now)
        .unwrap();
    let mut wire = Vec::new();
    p.collect(&mut wire);
    for (to, src, mad) in wire.drain(..) {
        p.deliver(to, src, &mad, now);
    }
    let ev = p.agents[1].pop_event().unwrap();
    let Event::ConnectRequest {
        service_id,
        private_data,
        ..
    } = ev
    else {
        panic!("{ev:?}")
    };
    assert_eq!(parse_service_id(service_id), Some((RDMA_PS_TCP, 7471)));
    let (got, user) = split_private_data(&private_data).unwrap();
    assert_eq!(got.src, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)));
    assert_eq!(got.dst, IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)));
    assert_eq!(got.src_port, 40000);
    assert_eq!(&user[..9], b"user data");
    assert_eq!(user.len(), rdma_cm::REQ_USER_PRIVATE_DATA_LEN);
    // On the wire: REQ private data starts at MAD byte 164 with version 0, IPv4.
    let m = support::req_mad(1, {
        let mut r = peer_req(1, 2);
        r.private_data = &pd;
        r
    });
    assert_eq!(&m[164..168], &[0x00, 0x40, 0x9c, 0x40]);
}

#[test]
fn udp_port_space_sidr_with_the_cma_header() {
    let mut p = Pair::new(4);
    let sid = udp_service_id(9000);
    let l = p.agents[1].listen(sid).unwrap();
    p.agents[1]
        .set_sidr_auto_reply(l, 0x1234, 0x0101_0101)
        .unwrap();
    let hdr = CmaHdr::from_gids(p.gids[0], p.gids[1], 5000);
    let pd = sidr_req_private_data(&hdr, b"q").unwrap();
    let now = Time::ZERO;
    let id = p.agents[0]
        .resolve_sidr(p.gids[1], sid, &pd, &SidrOptions::default(), now)
        .unwrap();
    let mut wire = Vec::new();
    for _ in 0..2 {
        p.collect(&mut wire);
        for (to, src, mad) in wire.drain(..) {
            p.deliver(to, src, &mad, now);
        }
    }
    assert_eq!(
        p.agents[0].pop_event(),
        Some(Event::SidrResolved {
            id,
            status: SidrStatus::Success,
            qpn: 0x1234,
            qkey: 0x0101_0101,
            private_data: vec![0; 136],
        })
    );
    assert_eq!(parse_service_id(sid), Some((RDMA_PS_UDP, 9000)));
}

//! The agent where it used to differ from Linux's kernel CM (`cm.c`, `cma.c`) and
//! librdmacm: one test per item of `docs/linux-conformance.md`, against a scripted peer
//! in virtual time.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use pvcm_guest::cm::rdma_cm::{CmaHdr, req_private_data, roce_flow_label, tcp_service_id};
use pvcm_guest::cm::{
    AcceptOptions, Agent, AgentConfig, ConnectOptions, DEFAULT_MAX_RD_ATOM, cm_ack_timeout,
};
use pvcm_wire::cm::CmRepr;
use support::*;

fn agent_with(f: impl FnOnce(&mut AgentConfig)) -> Agent {
    let mut c = config();
    f(&mut c);
    Agent::new(c)
}

/// The REQ the agent sends for `connect()` with these options.
fn req_of(
    a: &mut Agent,
    sid: u64,
    pd: &[u8],
    o: &ConnectOptions,
) -> pvcm_wire::cm::req::Repr<'static> {
    a.connect(peer_gid(), sid, pd, o, ms(0)).unwrap();
    let m = one(a);
    let (_, CmRepr::Req(r)) = parse(&m) else {
        panic!("not a REQ")
    };
    // Own the private data so the REQ outlives the MAD buffer.
    let pd: &'static [u8] = Box::leak(r.private_data.to_vec().into_boxed_slice());
    pvcm_wire::cm::req::Repr {
        private_data: pd,
        ..r
    }
}

/// The REP the agent sends accepting a peer REQ with these resources.
fn rep_of(a: &mut Agent, rr: u8, id: u8, o: &AcceptOptions) -> pvcm_wire::cm::rep::Repr<'static> {
    a.listen(SID).unwrap();
    let mut r = peer_req(0x10, 0x800);
    r.responder_resources = rr;
    r.initiator_depth = id;
    a.handle_mad(&req_mad(1, r), peer_gid(), ms(0));
    let ev = events(a);
    a.accept_with(ev[0].id(), &[], o, ms(1)).unwrap();
    let m = one(a);
    let (_, CmRepr::Rep(r)) = parse(&m) else {
        panic!("not a REP")
    };
    pvcm_wire::cm::rep::Repr {
        private_data: &[],
        ..r
    }
}

// ------------------------------------------------ #11 path MTU and flow label

#[test]
fn c11_req_path_mtu_is_the_ports_active_mtu() {
    // PORT_INFO said 4096 (code 5): the REQ carries it, as rdma_cm carries the link's.
    let mut a = agent_with(|c| c.active_mtu = 5);
    assert_eq!(
        req_of(&mut a, SID, &[], &ConnectOptions::default()).path_mtu,
        5
    );
    // An explicit MTU wins.
    let o = ConnectOptions {
        path_mtu: 4,
        ..Default::default()
    };
    assert_eq!(req_of(&mut a, SID, &[], &o).path_mtu, 4);
    // The default configuration (no PORT_INFO MTU): 1024.
    assert_eq!(
        req_of(&mut agent(), SID, &[], &ConnectOptions::default()).path_mtu,
        3
    );
}

#[test]
fn c11_req_flow_label_hashes_the_rdma_cm_ports() {
    let mut a = agent();
    let hdr = CmaHdr::from_gids(agent_gid(), peer_gid(), 40_123);
    let pd = req_private_data(&hdr, b"x").unwrap();
    let r = req_of(
        &mut a,
        tcp_service_id(7471),
        &pd,
        &ConnectOptions::default(),
    );
    // Linux cma_get_roce_udp_flow_label(): sport * 31 + dport, 20 bits.
    let want = (40_123u32 * 31 + 7471) & 0xF_FFFF;
    assert_eq!(r.primary_path.flow_label, want);
    assert_eq!(want, roce_flow_label(40_123, 7471));
    // Another source port, another label: per-connection entropy.
    let pd2 = req_private_data(&CmaHdr::from_gids(agent_gid(), peer_gid(), 40_124), &[]).unwrap();
    let r2 = req_of(
        &mut a,
        tcp_service_id(7471),
        &pd2,
        &ConnectOptions::default(),
    );
    assert_ne!(r2.primary_path.flow_label, want);
    // An explicit label wins; a REQ that is not rdma_cm's gets 0.
    let o = ConnectOptions {
        flow_label: 0x12345,
        ..Default::default()
    };
    let r3 = req_of(&mut a, tcp_service_id(7471), &pd, &o);
    assert_eq!(r3.primary_path.flow_label, 0x12345);
    let r4 = req_of(
        &mut a,
        SID | 0x1000_0000_0000_0000,
        b"raw",
        &ConnectOptions::default(),
    );
    assert_eq!(r4.primary_path.flow_label, 0);
}

// ------------------------------------------------------------- #12 ACK delay

#[test]
fn c12_ack_delay_goes_into_the_req_and_the_rep() {
    // An ACK delay that dominates the packet lifetime: Local ACK Timeout from
    // cm_ack_timeout(ack_delay, life), the REP's Target ACK Delay = ack_delay.
    let mut a = agent_with(|c| c.ack_delay = 20);
    let r = req_of(&mut a, SID, &[], &ConnectOptions::default());
    assert_eq!(r.primary_path.local_ack_timeout, cm_ack_timeout(20, 16));
    assert_eq!(r.primary_path.local_ack_timeout, 20);
    let mut p = agent_with(|c| c.ack_delay = 15);
    let rep = rep_of(&mut p, 1, 1, &AcceptOptions::default());
    assert_eq!(rep.target_ack_delay, 15);
    // rdma_rxe's 15 with rdma_cm's RoCE packet life: still 17, as Linux to Linux.
    let mut x = agent_with(|c| c.ack_delay = 15);
    let r = req_of(&mut x, SID, &[], &ConnectOptions::default());
    assert_eq!(r.primary_path.local_ack_timeout, 17);
}

// ------------------------------------------ #13 resources, RNR, flow control

#[test]
fn c13_req_defaults_are_librdmacms() {
    let mut a = agent();
    let r = req_of(&mut a, SID, &[], &ConnectOptions::default());
    // rdma_connect() without conn_param: the device maximum, flow control off, 7/7.
    assert_eq!(
        (r.responder_resources, r.initiator_depth),
        (DEFAULT_MAX_RD_ATOM, DEFAULT_MAX_RD_ATOM)
    );
    assert!(!r.end_to_end_flow_control);
    assert_eq!((r.retry_count, r.rnr_retry_count), (7, 7));
    // The device maximum is the configuration's.
    let mut b = agent_with(|c| {
        c.max_responder_resources = 16;
        c.max_initiator_depth = 8;
    });
    let r = req_of(&mut b, SID, &[], &ConnectOptions::default());
    assert_eq!((r.responder_resources, r.initiator_depth), (16, 8));
    // The application's values win.
    let o = ConnectOptions {
        responder_resources: 2,
        initiator_depth: 3,
        flow_control: true,
        rnr_retry_count: 6,
        retry_count: 5,
        ..Default::default()
    };
    let r = req_of(&mut b, SID, &[], &o);
    assert_eq!((r.responder_resources, r.initiator_depth), (2, 3));
    assert!(r.end_to_end_flow_control);
    assert_eq!((r.retry_count, r.rnr_retry_count), (5, 6));
}

#[test]
fn c13_rep_defaults_are_librdmacms_and_options_win() {
    // rdma_accept() without conn_param: the REQ's values swapped, capped at the device
    // maximum; flow control off; RNR retry 7.
    let mut a = agent_with(|c| {
        c.max_responder_resources = 16;
        c.max_initiator_depth = 4;
    });
    let rep = rep_of(&mut a, 8, 32, &AcceptOptions::default());
    // responder_resources = min(REQ initiator depth 32, 16); initiator_depth =
    // min(REQ responder resources 8, 4).
    assert_eq!((rep.responder_resources, rep.initiator_depth), (16, 4));
    assert!(!rep.end_to_end_flow_control);
    assert_eq!(rep.rnr_retry_count, 7);
    let mut b = agent();
    let o = AcceptOptions {
        responder_resources: 1,
        initiator_depth: 2,
        flow_control: true,
        rnr_retry_count: 3,
        ..AcceptOptions::default()
    };
    let rep = rep_of(&mut b, 8, 32, &o);
    assert_eq!((rep.responder_resources, rep.initiator_depth), (1, 2));
    assert!(rep.end_to_end_flow_control);
    assert_eq!(rep.rnr_retry_count, 3);
}

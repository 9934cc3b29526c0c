//! The agent beside Linux's kernel CM (`cm.c`, `cma.c`) and librdmacm where a CM could
//! reasonably behave otherwise: one test per item of `docs/linux-conformance.md`, against a scripted peer
//! in virtual time.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use pvcm_guest::cm::rdma_cm::{CmaHdr, req_private_data, roce_flow_label, tcp_service_id};
use pvcm_guest::cm::{
    AcceptOptions, Agent, AgentConfig, CM_MRA_SETTING, ConnectOptions, DEFAULT_MAX_RD_ATOM, Event,
    Group, State, cm_ack_timeout,
};
use pvcm_wire::cm::{CmRepr, MsgResponse};
use pvcm_wire::mad::AttributeId;
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

// ------------------------------------------------------ #3 no unsolicited MRA

/// A Linux peer's REQ timing (rdma_cm on RoCE): 2 x ms(16) + ms(20) per attempt.
const LINUX_ATTEMPT: u64 = 4608;

#[test]
fn c3_a_slow_application_never_causes_an_mra_on_a_timer() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let req = req_mad(0xABC, peer_req(0x10, 0x800));
    a.handle_mad(&req, peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    // The application sits on it: past mra_delay nothing goes out, the state moves.
    let (out, _) = poll_at(&mut a, ms(LINUX_ATTEMPT - 1));
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(a.state(id), Some(State::MraReqSent));
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Mra), 0);
    // The Linux peer's first retry (a duplicate) is what draws the MRA.
    a.handle_mad(&req, peer_gid(), ms(LINUX_ATTEMPT));
    let m = one(&mut a);
    let (h, CmRepr::Mra(mra)) = parse(&m) else {
        panic!("not an MRA")
    };
    assert_eq!(h.tid, 0xABC);
    assert_eq!(mra.message_mraed, MsgResponse::Req);
    assert_eq!(mra.service_timeout, CM_MRA_SETTING);
    // Answering after all still works.
    a.accept(id, &[], ms(LINUX_ATTEMPT + 1)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rep(_)));
}

#[test]
fn c3_an_answer_before_the_peers_retry_sends_no_mra_at_all() {
    // A slow application (3 s, past mra_delay) answering before the Linux peer's first
    // retry: the peer sees REQ -> REP, no MRA (none at mra_delay either). Without
    // mra_delay a duplicate is simply dropped, as in REQ_RCVD.
    for delay in [true, false] {
        let mut a = agent_with(|c| {
            if !delay {
                c.mra_delay = None;
            }
        });
        a.listen(SID).unwrap();
        a.handle_mad(&req_mad(0xABC, peer_req(0x10, 0x800)), peer_gid(), ms(0));
        let id = events(&mut a)[0].id();
        let (out, _) = poll_at(&mut a, ms(3000));
        assert!(out.is_empty());
        a.accept(id, &[], ms(3000)).unwrap();
        assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rep(_)));
        assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Mra), 0);
    }
    let mut a = agent_with(|c| c.mra_delay = None);
    a.listen(SID).unwrap();
    let req = req_mad(0xABC, peer_req(0x10, 0x800));
    for k in 0..16u64 {
        a.handle_mad(&req, peer_gid(), ms(k * LINUX_ATTEMPT));
        assert!(take(&mut a).is_empty(), "attempt {k}");
    }
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Req), 15);
}

#[test]
fn c3_an_unconfirmed_rep_enters_mra_rep_sent_silently() {
    let mut a = agent();
    let o = ConnectOptions {
        auto_rtu: false,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &o, ms(0)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let (local, tid) = (r.local_comm_id, h.tid);
    let rep = rep_mad(tid, peer_rep(0x44, local, 0x700));
    a.handle_mad(&rep, peer_gid(), ms(10));
    events(&mut a);
    let (out, _) = poll_at(&mut a, ms(4000));
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(a.state(id), Some(State::MraRepSent));
    a.handle_mad(&rep, peer_gid(), ms(4096));
    let m = one(&mut a);
    let (_, CmRepr::Mra(mra)) = parse(&m) else {
        panic!("not an MRA")
    };
    assert_eq!(mra.message_mraed, MsgResponse::Rep);
}

// --------------------------------------- #4 the MRA's wait for every retry

#[test]
fn c4_an_mra_stretches_every_remaining_req_retry() {
    let mut a = agent();
    let o = ConnectOptions {
        max_cm_retries: 3,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &o, ms(0)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let (local, tid) = (r.local_comm_id, h.tid);
    // A Linux server MRAs: service timeout 24 (ms 65536) + packet life (ms(17) = 512).
    let wait = 65_536 + 512;
    a.handle_mad(
        &mra_mad(tid, 0x99, local, MsgResponse::Req, 24),
        peer_gid(),
        ms(100),
    );
    let mut t = 100;
    for k in 1..=3 {
        t += wait;
        let (out, ev) = poll_at(&mut a, ms(t - 1));
        assert!(out.is_empty() && ev.is_empty(), "retry {k} early");
        let (out, _) = poll_at(&mut a, ms(t));
        assert_eq!(out.len(), 1, "retry {k}");
        // The server MRAs each duplicate: counted, no further change.
        a.handle_mad(
            &mra_mad(tid, 0x99, local, MsgResponse::Req, 24),
            peer_gid(),
            ms(t + 1),
        );
    }
    let (_, ev) = poll_at(&mut a, ms(t + wait));
    assert_eq!(ev, vec![Event::Unreachable { id }]);
    // Linux: 1 + 3 attempts of 66 s each after the MRA.
    assert_eq!(t + wait, 100 + 4 * wait);
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Mra), 3);
}

// ------------------------------------- an MRA owed on an early duplicate

#[test]
fn c3_a_duplicate_within_the_mra_delay_draws_the_mra() {
    // rdma_cm enters MRA_REQ_SENT (silently) as soon as its REQ handler returns without
    // an accept, so a duplicate REQ at any time draws the MRA: also one that arrives
    // before pvcm's mra_delay has passed (a peer with a short response timeout).
    let mut a = agent();
    a.listen(SID).unwrap();
    let req = req_mad(0xABC, peer_req(0x10, 0x800));
    a.handle_mad(&req, peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    a.handle_mad(&req, peer_gid(), ms(50));
    let m = one(&mut a);
    let (h, CmRepr::Mra(mra)) = parse(&m) else {
        panic!("not an MRA: {m:?}")
    };
    assert_eq!((h.tid, mra.message_mraed), (0xABC, MsgResponse::Req));
    assert_eq!(a.state(id), Some(State::MraReqSent));
    // The delay's timer has nothing left to do; the next duplicate re-sends the MRA.
    let (out, _) = poll_at(&mut a, ms(200));
    assert!(out.is_empty(), "{out:?}");
    a.handle_mad(&req, peer_gid(), ms(300));
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Mra(_)));
    a.accept(id, &[], ms(301)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rep(_)));

    // The same for a REP the application has not confirmed yet (MRA(REP)).
    let mut a = agent();
    let o = ConnectOptions {
        auto_rtu: false,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &o, ms(0)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let rep = rep_mad(h.tid, peer_rep(0x44, r.local_comm_id, 0x700));
    a.handle_mad(&rep, peer_gid(), ms(10));
    events(&mut a);
    a.handle_mad(&rep, peer_gid(), ms(60));
    let m = one(&mut a);
    let (_, CmRepr::Mra(mra)) = parse(&m) else {
        panic!("not an MRA: {m:?}")
    };
    assert_eq!(mra.message_mraed, MsgResponse::Rep);
    assert_eq!(a.state(id), Some(State::MraRepSent));
}

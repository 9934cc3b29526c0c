//! The CM agent against a scripted peer, in virtual time: every transition and timeout.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use pvcm_guest::cm::{
    AcceptOptions, CmError, ConnectOptions, DropReason, Event, Group, SidrOptions, State,
};
use pvcm_guest::time::Time;
use pvcm_wire::cm::{AprStatus, CmRepr, MsgResponse, RejReason, SidrStatus};
use pvcm_wire::mad::{AttributeId, Method};
use support::*;

/// Active side: 2 x ms(16) + ms(20) = 2 x 256 + 4096.
const ACTIVE_TIMEOUT: u64 = 4608;
/// Passive side: ms(REQ local CM response timeout 20).
const PASSIVE_TIMEOUT: u64 = 4096;
/// TimeWait: ms(17), the path's ACK timeout.
const TIMEWAIT: u64 = 512;

fn tid_of(a: &pvcm_guest::cm::Agent, local: u32) -> u64 {
    (u64::from(a.config().hi_tid) << 32) | u64::from(local)
}

// ------------------------------------------------------------------ active side

#[test]
fn active_connect_establish_disconnect_timewait() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, b"hello", &ConnectOptions::default(), ms(0))
        .unwrap();
    assert_eq!(a.state(id), Some(State::ReqSent));
    let m = one(&mut a);
    assert_eq!(m.dst, peer_gid());
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    assert_ne!(r.local_comm_id, 0);
    assert_eq!(h.tid, tid_of(&a, r.local_comm_id), "Linux cm_form_tid");
    assert_eq!(r.service_id, SID);
    assert_eq!(r.local_ca_guid, AGENT_GUID);
    assert!((QPN_BASE..QPN_BASE + QPN_COUNT).contains(&r.local_qpn));
    assert_eq!(r.primary_path.local_gid, agent_gid());
    assert_eq!(r.primary_path.remote_gid, peer_gid());
    assert_eq!(r.primary_path.local_ack_timeout, 17);
    assert_eq!(r.alternate_path.local_gid, pvcm_wire::Gid::ZERO);
    assert_eq!((r.max_cm_retries, r.remote_cm_response_timeout), (15, 20));
    assert_eq!(&r.private_data[..5], b"hello");
    assert_eq!(r.vendor_id, 0, "byte 28..32 of a REQ stays clear");
    let (local, qpn, tid) = (r.local_comm_id, r.local_qpn, h.tid);
    assert_eq!(a.next_deadline(), Some(ms(ACTIVE_TIMEOUT)));

    a.handle_mad(
        &rep_mad(tid, peer_rep(0x77, local, 0x500)),
        peer_gid(),
        ms(10),
    );
    let m = one(&mut a);
    let (h, CmRepr::Rtu(rtu)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, tid, "RTU echoes the TID");
    assert_eq!((rtu.local_comm_id, rtu.remote_comm_id), (local, 0x77));
    let ev = events(&mut a);
    assert_eq!(
        ev,
        vec![Event::Established {
            id,
            remote_qpn: 0x500,
            private_data: {
                let mut v = b"rep-pd".to_vec();
                v.resize(196, 0);
                v
            }
        }]
    );
    assert_eq!(a.next_deadline(), None, "no timer while connected");
    let info = a.info(id).unwrap();
    assert_eq!(
        (info.remote_comm_id, info.remote_qpn, info.local_qpn),
        (0x77, 0x500, qpn)
    );

    a.disconnect(id, ms(20)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Dreq(d)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, tid_of(&a, local));
    assert_eq!(
        (d.local_comm_id, d.remote_comm_id, d.remote_qpn_eecn),
        (local, 0x77, 0x500)
    );
    assert_eq!(a.state(id), Some(State::DreqSent));
    a.handle_mad(&drep_mad(h.tid, 0x77, local), peer_gid(), ms(30));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(a.comm_ids_held(), 1, "held through TimeWait");
    assert_eq!(a.next_deadline(), Some(ms(30 + TIMEWAIT)));
    let (out, ev) = poll_at(&mut a, ms(30 + TIMEWAIT - 1));
    assert!(out.is_empty() && ev.is_empty());
    let (out, ev) = poll_at(&mut a, ms(30 + TIMEWAIT));
    assert!(out.is_empty());
    assert_eq!(ev, vec![Event::TimewaitExit { id }]);
    assert_eq!(a.state(id), Some(State::Idle));
    assert_eq!(a.comm_ids_held(), 0);
    assert_eq!(a.qpns_in_use(), 0);
    a.destroy(id, ms(600)).unwrap();
    assert!(
        take(&mut a).is_empty(),
        "destroying an idle id sends nothing"
    );
    assert!(a.is_quiescent());
    assert_eq!(a.state(id), None);
    assert_eq!(a.destroy(id, ms(600)), Err(CmError::UnknownId));
    let tx = nonzero(&a, Group::TxMsgs);
    assert_eq!(tx.len(), 3);
    assert_eq!((tx["req"], tx["rtu"], tx["dreq"]), (1, 1, 1));
    let rx = nonzero(&a, Group::RxMsgs);
    assert_eq!((rx["rep"], rx["drep"]), (1, 1));
}

#[test]
fn req_retries_then_unreachable() {
    let mut a = agent();
    let opts = ConnectOptions {
        max_cm_retries: 2,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap();
    let first = one(&mut a);
    for k in 1..=2u64 {
        let (out, ev) = poll_at(&mut a, ms(k * ACTIVE_TIMEOUT - 1));
        assert!(out.is_empty() && ev.is_empty(), "not before the timeout");
        let (out, ev) = poll_at(&mut a, ms(k * ACTIVE_TIMEOUT));
        assert_eq!(out.len(), 1);
        assert!(ev.is_empty());
        assert_eq!(out[0].mad, first.mad, "a retry is the same REQ, same TID");
    }
    let (out, ev) = poll_at(&mut a, ms(3 * ACTIVE_TIMEOUT));
    assert!(out.is_empty(), "no REJ on giving up (Linux)");
    assert_eq!(ev, vec![Event::Unreachable { id }]);
    assert_eq!(a.state(id), Some(State::Idle));
    assert_eq!(
        (a.comm_ids_held(), a.qpns_in_use(), a.timers_armed()),
        (0, 0, 0)
    );
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Req), 3);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Req), 2);
    a.destroy(id, ms(20_000)).unwrap();
    assert!(take(&mut a).is_empty());
    assert!(a.is_quiescent());
}

#[test]
fn mra_extends_the_req_wait() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let (local, tid) = (r.local_comm_id, h.tid);
    a.handle_mad(
        &mra_mad(tid, 0x99, local, MsgResponse::Req, 24),
        peer_gid(),
        ms(100),
    );
    assert_eq!(a.state(id), Some(State::MraReqRcvd));
    // ms(24) + ms(17) = 65536 + 512 from the MRA.
    let extended = 100 + 65_536 + TIMEWAIT;
    assert_eq!(a.next_deadline(), Some(ms(extended)));
    let (out, _) = poll_at(&mut a, ms(ACTIVE_TIMEOUT * 2));
    assert!(out.is_empty(), "no retry while the MRA's wait runs");
    // A repeated MRA is a duplicate and does not extend again (Linux).
    a.handle_mad(
        &mra_mad(tid, 0x99, local, MsgResponse::Req, 24),
        peer_gid(),
        ms(20_000),
    );
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Mra), 1);
    assert_eq!(a.next_deadline(), Some(ms(extended)));
    let (out, _) = poll_at(&mut a, ms(extended));
    assert_eq!(out.len(), 1, "then the REQ is retried");
    // Every remaining retry waits as long, not the plain attempt timeout again (Linux
    // ib_modify_mad).
    assert_eq!(a.next_deadline(), Some(ms(extended + 65_536 + TIMEWAIT)));
    // The REP still completes the handshake from MRA_REQ_RCVD.
    a.handle_mad(
        &rep_mad(tid, peer_rep(0x99, local, 0x500)),
        peer_gid(),
        ms(extended + 1),
    );
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rtu(_)));
    assert_eq!(a.state(id), Some(State::Established));
}

#[test]
fn rej_in_req_sent_reports_rejected_with_private_data() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rej_mad(
            h.tid,
            0,
            r.local_comm_id,
            MsgResponse::Req,
            RejReason::ConsumerDefined,
            &[],
            b"go away",
        ),
        peer_gid(),
        ms(5),
    );
    let ev = events(&mut a);
    let [
        Event::Rejected {
            id: rid,
            reason,
            private_data,
            ..
        },
    ] = ev.as_slice()
    else {
        panic!("{ev:?}")
    };
    assert_eq!((*rid, *reason), (id, RejReason::ConsumerDefined));
    assert_eq!(&private_data[..7], b"go away");
    assert_eq!(a.state(id), Some(State::Idle));
    assert_eq!(a.comm_ids_held(), 0);
    assert_eq!(a.timers_armed(), 0);
    // A second copy finds nothing.
    a.handle_mad(
        &rej_mad(
            h.tid,
            0,
            r.local_comm_id,
            MsgResponse::Req,
            RejReason::ConsumerDefined,
            &[],
            &[],
        ),
        peer_gid(),
        ms(6),
    );
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 1);
    assert!(events(&mut a).is_empty());
}

#[test]
fn stale_conn_rej_in_req_sent_enters_timewait() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rej_mad(
            h.tid,
            0,
            r.local_comm_id,
            MsgResponse::Req,
            RejReason::StaleConn,
            &[],
            &[],
        ),
        peer_gid(),
        ms(5),
    );
    assert!(matches!(
        events(&mut a).as_slice(),
        [Event::Rejected {
            reason: RejReason::StaleConn,
            ..
        }]
    ));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(a.comm_ids_held(), 1);
}

#[test]
fn duplicate_rep_in_established_resends_rtu() {
    let mut a = agent();
    let (_, local, _, tid) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(
        &rep_mad(tid, peer_rep(0x55, local, 0x600)),
        peer_gid(),
        ms(50),
    );
    let m = one(&mut a);
    let (h, CmRepr::Rtu(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (h.tid, r.local_comm_id, r.remote_comm_id),
        (tid, local, 0x55)
    );
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Rep), 1);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Rtu), 1);
    assert!(events(&mut a).is_empty());
}

#[test]
fn rep_for_unknown_comm_id_is_dropped_and_counted() {
    // Linux drops it (cm_rep_handler finds no id): no REJ(INVALID_COMM_ID).
    let mut a = agent();
    a.handle_mad(
        &rep_mad(9, peer_rep(0x31, 0x1234_5678, 0x600)),
        peer_gid(),
        ms(0),
    );
    assert!(take(&mut a).is_empty());
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 1);
    assert_eq!(a.counters().get(Group::RxMsgs, AttributeId::Rep), 1);
    assert!(a.is_quiescent());
}

#[test]
fn manual_rtu_with_mra_rep() {
    let mut a = agent();
    let opts = ConnectOptions {
        auto_rtu: false,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let (local, tid) = (r.local_comm_id, h.tid);
    a.handle_mad(
        &rep_mad(tid, peer_rep(0x44, local, 0x700)),
        peer_gid(),
        ms(10),
    );
    assert!(take(&mut a).is_empty(), "the application confirms");
    assert!(matches!(
        events(&mut a).as_slice(),
        [Event::ConnectResponse {
            remote_qpn: 0x700,
            ..
        }]
    ));
    assert_eq!(a.state(id), Some(State::RepRcvd));
    // mra_delay (100 ms) later: MRA_REP_SENT, silently (no MRA(REP) on the timer;
    // Linux sends it only for a duplicate REP).
    let (out, _) = poll_at(&mut a, ms(110));
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(a.state(id), Some(State::MraRepSent));
    // A duplicate REP gets the MRA (Linux cm_dup_rep_handler).
    a.handle_mad(
        &rep_mad(tid, peer_rep(0x44, local, 0x700)),
        peer_gid(),
        ms(200),
    );
    let m = one(&mut a);
    let (h, CmRepr::Mra(mra)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, tid);
    assert_eq!(mra.message_mraed, MsgResponse::Rep);
    assert_eq!(mra.service_timeout, 24);
    assert_eq!((mra.local_comm_id, mra.remote_comm_id), (local, 0x44));
    a.accept(id, b"rtu!", ms(300)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rtu(rtu)) = parse(&m) else {
        panic!()
    };
    assert_eq!(&rtu.private_data[..4], b"rtu!");
    assert_eq!(a.state(id), Some(State::Established));
    assert!(
        events(&mut a).is_empty(),
        "rdma_establish() reports nothing"
    );
}

#[test]
fn reject_a_rep_in_manual_mode() {
    let mut a = agent();
    let opts = ConnectOptions {
        auto_rtu: false,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let local = r.local_comm_id;
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x44, local, 0x700)),
        peer_gid(),
        ms(10),
    );
    events(&mut a);
    a.reject(id, b"nope", ms(20)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(rej)) = parse(&m) else {
        panic!()
    };
    assert_eq!(rej.message_rejected, MsgResponse::Rep);
    assert_eq!(rej.reason, RejReason::ConsumerDefined);
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (local, 0x44));
    assert_eq!(a.state(id), Some(State::Idle));
}

// ----------------------------------------------------------------- passive side

#[test]
fn passive_accept_rep_rtu() {
    let mut a = agent();
    let lid = a.listen(SID).unwrap();
    assert_eq!(a.listen(SID), Err(CmError::ServiceIdInUse(SID)));
    a.handle_mad(&req_mad(0xABC, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    assert!(take(&mut a).is_empty());
    let ev = events(&mut a);
    let [
        Event::ConnectRequest {
            id,
            listen_id,
            remote_gid,
            service_id,
            remote_qpn,
            private_data,
        },
    ] = ev.as_slice()
    else {
        panic!("{ev:?}")
    };
    let id = *id;
    assert_eq!(
        (*listen_id, *remote_gid, *service_id, *remote_qpn),
        (lid, peer_gid(), SID, 0x800)
    );
    assert_eq!(private_data.len(), 92);
    assert_eq!(a.state(id), Some(State::ReqRcvd));
    a.accept(id, b"welcome", ms(50)).unwrap();
    let rep = one(&mut a);
    assert_eq!(rep.dst, peer_gid());
    let (h, CmRepr::Rep(r)) = parse(&rep) else {
        panic!()
    };
    assert_eq!(h.tid, 0xABC, "REP echoes the REQ's TID");
    assert_eq!(r.remote_comm_id, 0x10);
    assert_ne!(r.local_comm_id, 0);
    assert_eq!(r.local_ca_guid, AGENT_GUID);
    assert!((QPN_BASE..QPN_BASE + QPN_COUNT).contains(&r.local_qpn));
    assert_eq!(&r.private_data[..7], b"welcome");
    let local = r.local_comm_id;
    assert_eq!(a.state(id), Some(State::RepSent));
    // Retried every ms(REQ local CM response timeout).
    let (out, _) = poll_at(&mut a, ms(50 + PASSIVE_TIMEOUT));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].mad, rep.mad);
    a.handle_mad(&rtu_mad(0xABC, 0x10, local), peer_gid(), ms(5000));
    let ev = events(&mut a);
    assert!(matches!(
        ev.as_slice(),
        [Event::Established {
            remote_qpn: 0x800,
            ..
        }]
    ));
    assert_eq!(a.state(id), Some(State::Established));
    assert_eq!(a.timers_armed(), 0);
    // A late RTU is a duplicate.
    a.handle_mad(&rtu_mad(0xABC, 0x10, local), peer_gid(), ms(5001));
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Rtu), 1);
}

#[test]
fn passive_mra_when_the_application_is_slow_and_duplicate_req() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let req = req_mad(0xABC, peer_req(0x10, 0x800));
    a.handle_mad(&req, peer_gid(), ms(0));
    let ev = events(&mut a);
    let id = ev[0].id();
    let (out, _) = poll_at(&mut a, ms(99));
    assert!(out.is_empty());
    assert_eq!(a.state(id), Some(State::ReqRcvd));
    // mra_delay later: MRA_REQ_SENT, silently (Linux IB_CM_MRA_FLAG_DELAY: no MRA on a
    // timer). A duplicate before then draws the MRA too (cm_linux.rs).
    let (out, _) = poll_at(&mut a, ms(100));
    assert!(out.is_empty(), "no MRA on a timer: {out:?}");
    assert_eq!(a.state(id), Some(State::MraReqSent));
    // A duplicate REQ gets the MRA (Linux cm_dup_req_handler).
    a.handle_mad(&req, peer_gid(), ms(200));
    let m = one(&mut a);
    let (h, CmRepr::Mra(mra)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0xABC);
    assert_eq!(mra.message_mraed, MsgResponse::Req);
    assert_eq!(mra.service_timeout, 24);
    assert_eq!(mra.remote_comm_id, 0x10);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Mra), 0);
    // The next duplicate re-sends it.
    a.handle_mad(&req, peer_gid(), ms(250));
    let again = one(&mut a);
    assert_eq!(again.mad, m.mad);
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Req), 2);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Mra), 1);
    a.accept(id, &[], ms(300)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rep(_)));
    assert_eq!(a.state(id), Some(State::RepSent));
}

#[test]
fn no_mra_when_disabled() {
    let mut cfg = config();
    cfg.mra_delay = None;
    let mut a = pvcm_guest::cm::Agent::new(cfg);
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(1, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    assert_eq!(a.next_deadline(), None);
    let (out, _) = poll_at(&mut a, ms(1_000_000));
    assert!(out.is_empty());
}

#[test]
fn rep_retries_then_unreachable_and_mra_rep_extends() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let mut r = peer_req(0x10, 0x800);
    r.max_cm_retries = 1;
    a.handle_mad(&req_mad(0xABC, r), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    a.accept(id, &[], ms(0)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rep(rep)) = parse(&m) else {
        panic!()
    };
    let local = rep.local_comm_id;
    // MRA(REP) from the peer: wait ms(20) + ms(17).
    a.handle_mad(
        &mra_mad(0xABC, 0x10, local, MsgResponse::Rep, 20),
        peer_gid(),
        ms(10),
    );
    assert_eq!(a.state(id), Some(State::MraRepRcvd));
    assert_eq!(a.next_deadline(), Some(ms(10 + 4096 + TIMEWAIT)));
    let (out, _) = poll_at(&mut a, ms(10 + 4096 + TIMEWAIT));
    assert_eq!(out.len(), 1, "the one retry");
    // The retry waits as long as the MRA asked, not the plain passive timeout.
    let (out, ev) = poll_at(&mut a, ms(10 + 2 * (4096 + TIMEWAIT) - 1));
    assert!(out.is_empty() && ev.is_empty());
    let (out, ev) = poll_at(&mut a, ms(10 + 2 * (4096 + TIMEWAIT)));
    assert!(out.is_empty());
    assert_eq!(ev, vec![Event::Unreachable { id }]);
    assert_eq!(a.state(id), Some(State::Idle));
    assert_eq!((a.comm_ids_held(), a.qpns_in_use()), (0, 0));
}

#[test]
fn a_send_completion_restarts_only_the_timer_of_the_message_waited_on() {
    let mut a = agent();
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(0xABC, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    a.accept(id, &[], ms(0)).unwrap();
    let rep = one(&mut a);
    let (_, CmRepr::Rep(r)) = parse(&rep) else {
        panic!()
    };
    let local = r.local_comm_id;
    let due = a.next_deadline().unwrap();
    // Another message's completion (one byte differs) moves nothing.
    let mut other = rep.mad;
    other[100] ^= 1;
    a.mad_sent(&other, ms(1000));
    assert_eq!(a.next_deadline(), Some(due));
    // The REP's: its whole timeout from there.
    a.mad_sent(&rep.mad, ms(1000));
    assert_eq!(a.next_deadline(), Some(ms(1000 + due.as_millis())));
    // Once the RTU came, a late completion of the REP arms nothing.
    a.handle_mad(&rtu_mad(0xABC, 0x10, local), peer_gid(), ms(1100));
    assert_eq!(a.state(id), Some(State::Established));
    a.mad_sent(&rep.mad, ms(1200));
    assert_eq!(a.next_deadline(), None);
}

#[test]
fn reject_sends_consumer_defined_with_private_data() {
    let mut a = agent();
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(0xABC, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    assert_eq!(
        a.reject(id, &[0; 149], ms(1)),
        Err(CmError::PrivateDataTooLong { len: 149, max: 148 })
    );
    a.reject(id, b"busy", ms(1)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0xABC);
    assert_eq!(r.reason, RejReason::ConsumerDefined);
    assert_eq!(r.message_rejected, MsgResponse::Req);
    assert_eq!(
        (r.local_comm_id, r.remote_comm_id),
        (0, 0x10),
        "Linux: 0 from REQ_RCVD"
    );
    assert_eq!(&r.private_data[..4], b"busy");
    assert_eq!(a.state(id), Some(State::Idle));
    assert_eq!(a.comm_ids_held(), 0);
    // The same REQ again is a new request now.
    a.handle_mad(&req_mad(0xABC, peer_req(0x10, 0x800)), peer_gid(), ms(2));
    assert!(matches!(
        events(&mut a).as_slice(),
        [Event::ConnectRequest { .. }]
    ));
}

#[test]
fn no_listener_invalid_service_id() {
    let mut a = agent();
    a.handle_mad(&req_mad(0x5, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let m = one(&mut a);
    assert_eq!(m.dst, peer_gid());
    let (h, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0x5);
    assert_eq!(r.reason, RejReason::InvalidServiceId);
    assert_eq!(r.message_rejected, MsgResponse::Req);
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0, 0x10));
    assert_eq!(a.connection_count(), 0);
    assert!(events(&mut a).is_empty());
}

#[test]
fn over_quota_no_resources() {
    let mut cfg = config();
    cfg.max_connections = 1;
    let mut a = pvcm_guest::cm::Agent::new(cfg);
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(1, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    assert_eq!(events(&mut a).len(), 1);
    a.handle_mad(&req_mad(2, peer_req(0x11, 0x801)), peer_gid(), ms(0));
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(r.reason, RejReason::NoResources);
    assert_eq!(r.remote_comm_id, 0x11);
    assert_eq!(
        a.connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0)),
        Err(CmError::NoResources)
    );
}

#[test]
fn req_for_another_gid_gets_invalid_gid() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let mut r = peer_req(0x10, 0x800);
    r.primary_path.remote_gid = gid(9);
    a.handle_mad(&req_mad(1, r), peer_gid(), ms(0));
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(r.reason, RejReason::InvalidGid);
    assert_eq!(r.ari, &agent_gid().0);
}

// ------------------------------------------------------------ duplicates, DREQ

#[test]
fn req_reusing_a_remote_comm_id_in_timewait_is_a_new_request() {
    // Linux's cm_enter_timewait() unindexes the remote comm ID (cm_remove_remote), so
    // such a REQ is new, not a REJ(STALE_CONN).
    let mut a = agent();
    a.listen(SID).unwrap();
    let (id, local, _) = establish_passive(&mut a, 0x10, 0x800, ms(0));
    a.disconnect(id, ms(1)).unwrap();
    let m = one(&mut a);
    let (h, _) = parse(&m);
    a.handle_mad(&drep_mad(h.tid, 0x10, local), peer_gid(), ms(2));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    // The peer reuses its comm ID (same CA GUID, same QPN: not connected any more).
    a.handle_mad(&req_mad(7, peer_req(0x10, 0x800)), peer_gid(), ms(3));
    assert!(take(&mut a).is_empty(), "no REJ");
    let ev = events(&mut a);
    let [Event::ConnectRequest { id: new, .. }] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_ne!(*new, id);
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Req), 0);
    assert_eq!(a.state(id), Some(State::Timewait), "the old one waits on");
}

#[test]
fn dreq_for_unknown_connection_gets_stateless_drep() {
    let mut a = agent();
    a.handle_mad(&dreq_mad(0xD1, 0x1111, 0x2222, 0x900), peer_gid(), ms(0));
    let m = one(&mut a);
    assert_eq!(m.dst, peer_gid());
    let (h, CmRepr::Drep(d)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0xD1);
    assert_eq!((d.local_comm_id, d.remote_comm_id), (0x2222, 0x1111));
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Dreq), 1);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Drep), 1);
    assert!(a.is_quiescent(), "a stateless answer keeps no state");
    assert_eq!(a.connection_count(), 0);
}

#[test]
fn dreq_received_waits_for_the_application_then_timewait_redrep() {
    let mut a = linux_drep_agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    let dreq = dreq_mad(0xD2, 0x55, local, qpn);
    a.handle_mad(&dreq, peer_gid(), ms(10));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    assert_eq!(a.state(id), Some(State::DreqRcvd));
    assert!(
        take(&mut a).is_empty(),
        "rdma_cm: the DREP waits for disconnect()"
    );
    a.handle_mad(&dreq, peer_gid(), ms(11));
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Dreq), 1);
    assert!(take(&mut a).is_empty());
    a.disconnect(id, ms(20)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Drep(d)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0xD2, "DREP echoes the DREQ's TID");
    assert_eq!((d.local_comm_id, d.remote_comm_id), (local, 0x55));
    assert_eq!(a.state(id), Some(State::Timewait));
    // The DREP got lost: the retried DREQ gets it again.
    a.handle_mad(&dreq, peer_gid(), ms(30));
    let again = one(&mut a);
    assert_eq!(again.mad, m.mad);
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Dreq), 2);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Drep), 1);
    assert!(events(&mut a).is_empty(), "one Disconnected per connection");
    let (_, ev) = poll_at(&mut a, ms(20 + TIMEWAIT));
    assert_eq!(ev, vec![Event::TimewaitExit { id }]);
}

#[test]
fn auto_drep_answers_at_once() {
    let mut cfg = config();
    cfg.auto_drep = true;
    let mut a = pvcm_guest::cm::Agent::new(cfg);
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(&dreq_mad(0xD2, 0x55, local, qpn), peer_gid(), ms(10));
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
}

#[test]
fn dreq_with_wrong_remote_qpn_is_dropped() {
    let mut a = agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(&dreq_mad(0xD2, 0x55, local, qpn + 1), peer_gid(), ms(10));
    assert!(take(&mut a).is_empty());
    assert!(events(&mut a).is_empty());
    assert_eq!(a.state(id), Some(State::Established));
    assert_eq!(a.drops().get(DropReason::QpnMismatch), 1);
}

#[test]
fn dreq_retries_then_disconnected_and_timewait() {
    let mut a = agent();
    let (id, _, _, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    let mut now = 1000;
    a.disconnect(id, ms(now)).unwrap();
    let first = one(&mut a);
    for _ in 0..15 {
        now += ACTIVE_TIMEOUT;
        let (out, ev) = poll_at(&mut a, ms(now));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].mad, first.mad);
        assert!(ev.is_empty());
    }
    now += ACTIVE_TIMEOUT;
    let (out, ev) = poll_at(&mut a, ms(now));
    assert!(out.is_empty());
    assert_eq!(ev, vec![Event::Disconnected { id }]);
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Dreq), 15);
    let (_, ev) = poll_at(&mut a, ms(now + TIMEWAIT));
    assert_eq!(ev, vec![Event::TimewaitExit { id }]);
}

#[test]
fn simultaneous_disconnect() {
    let mut a = linux_drep_agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.disconnect(id, ms(1)).unwrap();
    let m = one(&mut a);
    let (h, _) = parse(&m);
    // The peer's DREQ crosses ours.
    a.handle_mad(&dreq_mad(0xEE, 0x55, local, qpn), peer_gid(), ms(2));
    assert_eq!(a.state(id), Some(State::DreqRcvd));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    assert_eq!(a.next_deadline(), None, "our DREQ's retries stop");
    a.disconnect(id, ms(3)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    // The peer's DREP for our DREQ arrives in TimeWait: ignored.
    a.handle_mad(&drep_mad(h.tid, 0x55, local), peer_gid(), ms(4));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert!(events(&mut a).is_empty());
}

#[test]
fn rej_while_established_enters_timewait() {
    let mut a = agent();
    let (id, local, _, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(
        &rej_mad(
            1,
            0x55,
            local,
            MsgResponse::Other,
            RejReason::ConsumerDefined,
            &[],
            &[],
        ),
        peer_gid(),
        ms(5),
    );
    assert!(matches!(
        events(&mut a).as_slice(),
        [Event::Rejected { .. }]
    ));
    assert_eq!(a.state(id), Some(State::Timewait));
}

// ------------------------------------------------------------- stale connections

#[test]
fn stale_req_for_a_connected_qpn_is_rejected_and_the_old_connection_dreqd() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let (old, old_local, old_qpn) = establish_passive(&mut a, 0x10, 0x800, ms(0));
    // The peer restarted and reuses its QPN 0x800 with a new comm ID.
    a.handle_mad(&req_mad(0x99, peer_req(0x20, 0x800)), peer_gid(), ms(10));
    let out = take(&mut a);
    assert_eq!(out.len(), 2, "{out:?}");
    let (h, CmRepr::Rej(r)) = parse(&out[0]) else {
        panic!()
    };
    assert_eq!(h.tid, 0x99);
    assert_eq!(r.reason, RejReason::StaleConn);
    assert_eq!(r.message_rejected, MsgResponse::Req);
    assert_eq!((r.local_comm_id, r.remote_comm_id), (0, 0x20));
    let (_, CmRepr::Dreq(d)) = parse(&out[1]) else {
        panic!()
    };
    assert_eq!(
        (d.local_comm_id, d.remote_comm_id, d.remote_qpn_eecn),
        (old_local, 0x10, 0x800)
    );
    assert_eq!(a.state(old), Some(State::DreqSent));
    assert!(
        events(&mut a).is_empty(),
        "no connect request for the stale REQ"
    );
    let _ = old_qpn;
}

#[test]
fn seed_001_a_qpn_in_timewait_is_not_stale() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let (old, old_local, _) = establish_passive(&mut a, 0x10, 0x800, ms(0));
    a.disconnect(old, ms(1)).unwrap();
    let m = one(&mut a);
    let (h, _) = parse(&m);
    a.handle_mad(&drep_mad(h.tid, 0x10, old_local), peer_gid(), ms(2));
    assert_eq!(a.state(old), Some(State::Timewait));
    events(&mut a);
    // A new connection from the same peer QP while the old one sits in TimeWait.
    a.handle_mad(&req_mad(0x99, peer_req(0x20, 0x800)), peer_gid(), ms(3));
    assert!(take(&mut a).is_empty(), "no REJ(STALE_CONN)");
    let ev = events(&mut a);
    let [Event::ConnectRequest { id, remote_qpn, .. }] = ev.as_slice() else {
        panic!("{ev:?}")
    };
    assert_eq!(*remote_qpn, 0x800);
    a.accept(*id, &[], ms(4)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rep(_)));
    assert_eq!(
        a.state(old),
        Some(State::Timewait),
        "the old one is left alone"
    );
    // And now the new one is connected: a third REQ naming 0x800 is stale.
    a.handle_mad(&req_mad(0x9A, peer_req(0x30, 0x800)), peer_gid(), ms(5));
    let out = take(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&out[0]) else {
        panic!()
    };
    assert_eq!(r.reason, RejReason::StaleConn);
}

#[test]
fn stale_rep_naming_a_connected_qpn() {
    let mut a = agent();
    let (old, old_local, _, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(10))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let local = r.local_comm_id;
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x66, local, 0x600)),
        peer_gid(),
        ms(11),
    );
    let out = take(&mut a);
    assert_eq!(out.len(), 2, "{out:?}");
    let (_, CmRepr::Rej(rej)) = parse(&out[0]) else {
        panic!()
    };
    assert_eq!(rej.reason, RejReason::StaleConn);
    assert_eq!(rej.message_rejected, MsgResponse::Rep);
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (local, 0x66));
    let (_, CmRepr::Dreq(d)) = parse(&out[1]) else {
        panic!()
    };
    assert_eq!(d.local_comm_id, old_local);
    assert_eq!(
        a.state(id),
        Some(State::ReqSent),
        "our REQ keeps waiting (Linux)"
    );
    assert_eq!(a.state(old), Some(State::DreqSent));
}

#[test]
fn seed_001_rep_naming_a_qpn_in_timewait_is_accepted() {
    let mut a = agent();
    let (old, old_local, _, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.disconnect(old, ms(1)).unwrap();
    let m = one(&mut a);
    let (h, _) = parse(&m);
    a.handle_mad(&drep_mad(h.tid, 0x55, old_local), peer_gid(), ms(2));
    assert_eq!(a.state(old), Some(State::Timewait));
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(3))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x66, r.local_comm_id, 0x600)),
        peer_gid(),
        ms(4),
    );
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Rtu(_)));
    assert_eq!(a.state(id), Some(State::Established));
}

// ----------------------------------------------------------------------- destroy

#[test]
fn seed_002_destroy_in_req_sent_sends_rej_timeout() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let req = one(&mut a);
    let (rh, CmRepr::Req(r)) = parse(&req) else {
        panic!()
    };
    a.destroy(id, ms(0)).unwrap();
    let m = one(&mut a);
    assert_eq!(m.dst, peer_gid());
    let (h, CmRepr::Rej(rej)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, rh.tid);
    assert_eq!(rej.reason, RejReason::Timeout);
    assert_eq!(rej.local_comm_id, r.local_comm_id);
    assert_eq!(rej.remote_comm_id, 0);
    assert_eq!(
        rej.ari,
        &AGENT_GUID.to_be_bytes(),
        "ARI = our CA GUID, 8 bytes BE"
    );
    assert_eq!(m.mad[33] >> 1, 8, "Rejected Info Length");
    assert_eq!(&m.mad[36..44], &AGENT_GUID.to_be_bytes());
    assert_eq!(&m.mad[28..32], &[0, 0, 0, 0]);
    assert_eq!(rej.timeout_ca_guid(), Some(AGENT_GUID));
    assert!(events(&mut a).is_empty());
    assert!(a.is_quiescent());
    let (out, _) = poll_at(&mut a, ms(100_000));
    assert!(out.is_empty(), "no REQ retries after destroy");
}

#[test]
fn destroy_in_mra_req_rcvd_sends_rej_timeout() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    let local = r.local_comm_id;
    a.handle_mad(
        &mra_mad(h.tid, 0x99, local, MsgResponse::Req, 24),
        peer_gid(),
        ms(1),
    );
    assert_eq!(a.state(id), Some(State::MraReqRcvd));
    a.destroy(id, ms(2)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(rej)) = parse(&m) else {
        panic!()
    };
    assert_eq!(rej.reason, RejReason::Timeout);
    assert_eq!((rej.local_comm_id, rej.remote_comm_id), (local, 0));
    assert_eq!(rej.ari, &AGENT_GUID.to_be_bytes());
    assert!(a.is_quiescent());
}

#[test]
fn rej_timeout_from_a_destroyed_peer_is_found_by_ari_guid() {
    let mut a = agent();
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(0x77, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    // The peer destroys right after connecting: REJ(TIMEOUT), Remote Comm ID 0.
    let guid = PEER_GUID.to_be_bytes();
    a.handle_mad(
        &rej_mad(
            0x77,
            0x10,
            0,
            MsgResponse::Other,
            RejReason::Timeout,
            &guid,
            &[],
        ),
        peer_gid(),
        ms(1),
    );
    let ev = events(&mut a);
    assert!(
        matches!(
            ev.as_slice(),
            [Event::Rejected {
                reason: RejReason::Timeout,
                ..
            }]
        ),
        "{ev:?}"
    );
    assert_eq!(a.state(id), Some(State::Idle));
    // Another host's REJ(TIMEOUT) with the same comm ID does not match.
    a.handle_mad(&req_mad(0x78, peer_req(0x11, 0x801)), peer_gid(), ms(2));
    let id2 = events(&mut a)[0].id();
    a.handle_mad(
        &rej_mad(
            1,
            0x11,
            0,
            MsgResponse::Other,
            RejReason::Timeout,
            &0xDEADu64.to_be_bytes(),
            &[],
        ),
        gid(3),
        ms(3),
    );
    assert_eq!(a.state(id2), Some(State::ReqRcvd));
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 1);
}

#[test]
fn destroy_in_each_handshake_state() {
    // REQ_RCVD: REJ(CONSUMER_DEFINED), Local Comm ID 0, rejected message REQ.
    let mut a = agent();
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(1, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    a.destroy(id, ms(1)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (
            r.reason,
            r.message_rejected,
            r.local_comm_id,
            r.remote_comm_id
        ),
        (RejReason::ConsumerDefined, MsgResponse::Req, 0, 0x10)
    );
    assert_eq!(a.connection_count(), 0);

    // MRA_REQ_SENT: the same with our comm ID.
    a.handle_mad(&req_mad(2, peer_req(0x11, 0x801)), peer_gid(), ms(0));
    let id = events(&mut a)[0].id();
    poll_at(&mut a, ms(100));
    assert_eq!(a.state(id), Some(State::MraReqSent));
    let local = a.info(id).unwrap().local_comm_id;
    a.destroy(id, ms(101)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (r.reason, r.message_rejected, r.local_comm_id),
        (RejReason::ConsumerDefined, MsgResponse::Req, local)
    );
    assert_eq!(a.connection_count(), 0);

    // REP_SENT: REJ(CONSUMER_DEFINED), then TimeWait holds the comm ID.
    a.handle_mad(&req_mad(3, peer_req(0x12, 0x802)), peer_gid(), ms(200));
    let id = events(&mut a)[0].id();
    a.accept(id, &[], ms(200)).unwrap();
    take(&mut a);
    a.destroy(id, ms(201)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (r.reason, r.message_rejected),
        (RejReason::ConsumerDefined, MsgResponse::Other)
    );
    assert_eq!(a.connection_count(), 1);
    assert_eq!(a.comm_ids_held(), 1);
    poll_at(&mut a, ms(201 + TIMEWAIT));
    assert!(a.is_quiescent());
    assert!(events(&mut a).is_empty(), "nothing for a destroyed id");

    // REP_RCVD (manual RTU): rejected message REP.
    let opts = ConnectOptions {
        auto_rtu: false,
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &opts, ms(1000)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x13, r.local_comm_id, 0x803)),
        peer_gid(),
        ms(1001),
    );
    events(&mut a);
    a.destroy(id, ms(1002)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (r.reason, r.message_rejected),
        (RejReason::ConsumerDefined, MsgResponse::Rep)
    );
    assert!(a.is_quiescent());
}

#[test]
fn destroy_established_sends_one_dreq_then_silence() {
    let mut a = agent();
    let (id, local, _, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.destroy(id, ms(10)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Dreq(d)) = parse(&m) else {
        panic!()
    };
    assert_eq!(d.local_comm_id, local);
    assert_eq!(a.connection_count(), 1, "TimeWait");
    let (out, ev) = poll_at(&mut a, ms(10 + ACTIVE_TIMEOUT));
    assert!(
        out.is_empty() && ev.is_empty(),
        "no DREQ retries after destroy"
    );
    assert!(a.is_quiescent());
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Dreq), 0);
}

#[test]
fn destroy_in_dreq_states() {
    let mut a = agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(&dreq_mad(0xD0, 0x55, local, qpn), peer_gid(), ms(1));
    events(&mut a);
    a.destroy(id, ms(2)).unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Drep(_)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0xD0);
    // A retried DREQ during the TimeWait of a destroyed id still gets the DREP.
    a.handle_mad(&dreq_mad(0xD0, 0x55, local, qpn), peer_gid(), ms(3));
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    poll_at(&mut a, ms(2 + TIMEWAIT));
    assert!(a.is_quiescent());

    let (id, _, _, _) = establish_active(&mut a, 0x56, 0x601, ms(1000));
    a.disconnect(id, ms(1001)).unwrap();
    take(&mut a);
    a.destroy(id, ms(1002)).unwrap();
    assert!(take(&mut a).is_empty());
    let (out, _) = poll_at(&mut a, ms(1002 + ACTIVE_TIMEOUT));
    assert!(out.is_empty());
    assert!(a.is_quiescent());
}

#[test]
fn destroy_listener() {
    let mut a = agent();
    let l = a.listen(SID).unwrap();
    a.destroy(l, ms(0)).unwrap();
    assert_eq!(a.listener_count(), 0);
    a.handle_mad(&req_mad(1, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let m = one(&mut a);
    let (_, CmRepr::Rej(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(r.reason, RejReason::InvalidServiceId);
    // Listening again works.
    a.listen(SID).unwrap();
}

// -------------------------------------------------------------- SIDR, LAP, CPI

#[test]
fn sidr_client_resolves_and_retries() {
    let mut a = agent();
    let opts = SidrOptions {
        timeout_ms: 100,
        max_cm_retries: 1,
    };
    let id = a
        .resolve_sidr(peer_gid(), SID, b"who", &opts, ms(0))
        .unwrap();
    assert_eq!(a.state(id), Some(State::SidrReqSent));
    let m = one(&mut a);
    let (h, CmRepr::SidrReq(r)) = parse(&m) else {
        panic!()
    };
    assert_ne!(r.request_id, 0);
    assert_eq!(h.tid, tid_of(&a, r.request_id));
    assert_eq!((r.service_id, r.partition_key), (SID, 0xFFFF));
    let (out, _) = poll_at(&mut a, ms(100));
    assert_eq!(out.len(), 1);
    a.handle_mad(
        &sidr_rep_mad(h.tid, r.request_id, SidrStatus::Success, 0x123, 0x1111_2222),
        peer_gid(),
        ms(150),
    );
    let ev = events(&mut a);
    let [
        Event::SidrResolved {
            id: rid,
            status,
            qpn,
            qkey,
            ..
        },
    ] = ev.as_slice()
    else {
        panic!("{ev:?}")
    };
    assert_eq!(
        (*rid, *status, *qpn, *qkey),
        (id, SidrStatus::Success, 0x123, 0x1111_2222)
    );
    assert_eq!(a.state(id), Some(State::Idle));
    a.destroy(id, ms(151)).unwrap();
    assert!(a.is_quiescent());

    let id = a
        .resolve_sidr(peer_gid(), SID, &[], &opts, ms(200))
        .unwrap();
    take(&mut a);
    poll_at(&mut a, ms(300));
    let (_, ev) = poll_at(&mut a, ms(400));
    assert_eq!(ev, vec![Event::Unreachable { id }]);
    a.destroy(id, ms(400)).unwrap();
    assert!(a.is_quiescent());
}

#[test]
fn sidr_server_event_auto_reply_and_unsupported() {
    let mut a = agent();
    // No listener: SIDR_REP(UNSUPPORTED).
    a.handle_mad(&sidr_req_mad(0x51, 0x1234, SID), peer_gid(), ms(0));
    let m = one(&mut a);
    let (h, CmRepr::SidrRep(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (h.tid, r.request_id, r.status),
        (0x51, 0x1234, SidrStatus::Unsupported)
    );

    // Listener asks the application.
    let l = a.listen(SID).unwrap();
    let req = sidr_req_mad(0x52, 0x1235, SID);
    a.handle_mad(&req, peer_gid(), ms(1));
    let ev = events(&mut a);
    let [
        Event::SidrRequest {
            id,
            listen_id,
            private_data,
            ..
        },
    ] = ev.as_slice()
    else {
        panic!("{ev:?}")
    };
    assert_eq!(*listen_id, l);
    assert_eq!(&private_data[..4], b"sidr");
    let id = *id;
    assert_eq!(a.state(id), Some(State::SidrReqRcvd));
    a.handle_mad(&req, peer_gid(), ms(2));
    assert_eq!(
        a.counters().get(Group::RxDuplicates, AttributeId::SidrReq),
        1
    );
    assert!(take(&mut a).is_empty());
    a.sidr_reply(id, SidrStatus::Success, 0x1800, 0x4242, b"ok")
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::SidrRep(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (h.tid, r.request_id, r.status, r.qpn, r.qkey),
        (0x52, 0x1235, SidrStatus::Success, 0x1800, 0x4242)
    );
    assert_eq!(r.service_id, SID);
    a.destroy(id, ms(3)).unwrap();
    assert_eq!(a.connection_count(), 0);

    // Destroying an unanswered request rejects it.
    a.handle_mad(&sidr_req_mad(0x53, 0x1236, SID), peer_gid(), ms(4));
    let id = events(&mut a)[0].id();
    a.destroy(id, ms(5)).unwrap();
    let m = one(&mut a);
    let (_, CmRepr::SidrRep(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(r.status, SidrStatus::Reject);

    // Automatic answer.
    a.set_sidr_auto_reply(l, 0x1801, 0x9999).unwrap();
    a.handle_mad(&sidr_req_mad(0x54, 0x1237, SID), peer_gid(), ms(6));
    let m = one(&mut a);
    let (_, CmRepr::SidrRep(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!(
        (r.status, r.qpn, r.qkey),
        (SidrStatus::Success, 0x1801, 0x9999)
    );
    assert!(events(&mut a).is_empty());
    assert!(a.is_quiescent());
}

#[test]
fn lap_is_dropped_on_roce() {
    // Linux drops LAPs on RoCE (cm_lap_handler: -EINVAL) and answers nothing, not even
    // APR(UNSUPPORTED).
    let mut a = agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    let lap = lap_mad(0x1A, 0x55, local, qpn);
    a.handle_mad(&lap, peer_gid(), ms(1));
    assert!(take(&mut a).is_empty());
    a.handle_mad(&lap, peer_gid(), ms(2));
    assert!(take(&mut a).is_empty());
    assert_eq!(a.drops().get(DropReason::LapOnRoce), 2);
    assert_eq!(a.counters().get(Group::RxMsgs, AttributeId::Lap), 2);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Apr), 0);
    assert_eq!(a.state(id), Some(State::Established));
    // LAP for an unknown connection: dropped too.
    a.handle_mad(&lap_mad(0x1B, 0x1, 0x2, 0x3), peer_gid(), ms(3));
    assert!(take(&mut a).is_empty());
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 1);
}

#[test]
fn class_port_info_get_is_answered() {
    let mut a = agent();
    a.handle_mad(&class_port_info_get(0xC0FFEE), peer_gid(), ms(0));
    let m = one(&mut a);
    assert_eq!(m.dst, peer_gid());
    let (h, CmRepr::ClassPortInfo(c)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.method, Method::GetResp);
    assert_eq!(h.tid, 0xC0FFEE);
    assert_eq!((c.base_version, c.class_version, c.resp_time), (1, 2, 20));
    assert_eq!(a.counters().class_port_info_rx, 1);
    assert_eq!(a.counters().class_port_info_tx, 1);
    assert_eq!(a.counters().total(Group::TxMsgs), 0);
    // A GETRESP nobody asked for is dropped.
    let resp = m.mad;
    a.handle_mad(&resp, peer_gid(), ms(1));
    assert!(take(&mut a).is_empty());
    assert_eq!(a.drops().get(DropReason::Unsolicited), 1);
}

// ------------------------------------------------------------------ identifiers

#[test]
fn comm_ids_distinct_nonzero_and_not_reused_in_timewait() {
    let mut a = agent();
    let mut seen = std::collections::HashSet::new();
    let mut ids = Vec::new();
    for _ in 0..200 {
        let id = a
            .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
            .unwrap();
        let info = a.info(id).unwrap();
        assert_ne!(info.local_comm_id, 0);
        assert!(seen.insert(info.local_comm_id));
        ids.push(id);
    }
    take(&mut a);
    // IDs look random (XOR operand), not 1, 2, 3...
    let mut sorted: Vec<u32> = seen.iter().copied().collect();
    sorted.sort_unstable();
    assert!(sorted.windows(2).filter(|w| w[1] == w[0] + 1).count() < 200);
    for id in ids {
        a.destroy(id, ms(1)).unwrap();
    }
    take(&mut a);
    assert!(a.is_quiescent());
    // Cyclic: freed IDs are not handed out again soon.
    for _ in 0..200 {
        let id = a
            .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(2))
            .unwrap();
        assert!(!seen.contains(&a.info(id).unwrap().local_comm_id));
    }
}

#[test]
fn qpns_real_and_simulated() {
    let mut a = agent();
    let opts = ConnectOptions {
        qpn: Some(QPN_BASE + 5),
        ..Default::default()
    };
    let id = a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap();
    assert_eq!(a.info(id).unwrap().local_qpn, QPN_BASE + 5);
    assert_eq!(a.qpns_in_use(), 0, "a real QPN is the caller's");
    let bad = ConnectOptions {
        qpn: Some(QPN_BASE - 1),
        ..Default::default()
    };
    assert_eq!(
        a.connect(peer_gid(), SID, &[], &bad, ms(0)),
        Err(CmError::QpnNotOwned(QPN_BASE - 1))
    );
    // Passive side with a real QPN.
    a.listen(SID).unwrap();
    a.handle_mad(&req_mad(1, peer_req(0x10, 0x800)), peer_gid(), ms(0));
    let pid = events(&mut a)[0].id();
    take(&mut a);
    a.accept_with(
        pid,
        &[],
        &AcceptOptions {
            qpn: Some(QPN_BASE + 9),
            starting_psn: Some(77),
            ..AcceptOptions::default()
        },
        ms(1),
    )
    .unwrap();
    let m = one(&mut a);
    let (_, CmRepr::Rep(r)) = parse(&m) else {
        panic!()
    };
    assert_eq!((r.local_qpn, r.starting_psn), (QPN_BASE + 9, 77));
    // A small pool runs out.
    let mut cfg = config();
    cfg.qpn_count = 2;
    let mut b = pvcm_guest::cm::Agent::new(cfg);
    b.connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    b.connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    assert_eq!(
        b.connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0)),
        Err(CmError::NoResources)
    );
    assert_eq!(
        b.connection_count(),
        2,
        "a failed call leaves nothing behind"
    );
    assert_eq!(b.comm_ids_held(), 2);
}

#[test]
fn api_errors_change_nothing() {
    let mut a = agent();
    assert_eq!(
        a.connect(peer_gid(), SID, &[0; 93], &ConnectOptions::default(), ms(0)),
        Err(CmError::PrivateDataTooLong { len: 93, max: 92 })
    );
    assert!(a.is_quiescent());
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    take(&mut a);
    assert_eq!(
        a.accept(id, &[], ms(0)),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        a.disconnect(id, ms(0)),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        a.reject(id, &[], ms(0)),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert_eq!(
        a.sidr_reply(id, SidrStatus::Success, 0, 0, &[]),
        Err(CmError::InvalidState(State::ReqSent))
    );
    let l = a.listen(SID).unwrap();
    assert_eq!(
        a.accept(l, &[], ms(0)),
        Err(CmError::InvalidState(State::Listen))
    );
    assert_eq!(
        a.set_sidr_auto_reply(id, 1, 1),
        Err(CmError::InvalidState(State::ReqSent))
    );
    assert!(take(&mut a).is_empty());
    assert_eq!(a.state(id), Some(State::ReqSent));
}

#[test]
fn handle_mad_runs_due_timers_first() {
    let mut a = agent();
    let id = a
        .connect(
            peer_gid(),
            SID,
            &[],
            &ConnectOptions {
                max_cm_retries: 0,
                ..Default::default()
            },
            ms(0),
        )
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    // The REP arrives after the REQ gave up: the timer fires first, the REP then
    // finds no connection.
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x1, r.local_comm_id, 0x2)),
        peer_gid(),
        ms(ACTIVE_TIMEOUT),
    );
    assert_eq!(events(&mut a), vec![Event::Unreachable { id }]);
    // ... and is dropped, without a REJ(INVALID_COMM_ID) (Linux).
    assert!(take(&mut a).is_empty());
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 1);
    let _ = Time::ZERO;
}

#[test]
fn destroy_withdraws_queued_events() {
    let mut a = agent();
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x5, r.local_comm_id, 0x6)),
        peer_gid(),
        ms(1),
    );
    take(&mut a);
    a.destroy(id, ms(2)).unwrap();
    assert!(
        events(&mut a).is_empty(),
        "the Established of a destroyed id is gone"
    );
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Dreq(_)));
}

/// Destroying a handle withdraws its own queued events, whether or not others' are
/// queued around them, and only its own: the per-slot count that lets destroy skip the
/// queue stays right through pops and slot reuse.
#[test]
fn destroy_withdraws_only_its_own_events_through_pops_and_slot_reuse() {
    let mut a = agent();
    let (x, xl, xq, _) = establish_active(&mut a, 0x51, 0x601, ms(0));
    let (y, yl, yq, _) = establish_active(&mut a, 0x52, 0x602, ms(0));
    events(&mut a);
    // The peer ends both: a Disconnected for each, x's first.
    a.handle_mad(&dreq_mad(0x71, 0x51, xl, xq), peer_gid(), ms(1));
    a.handle_mad(&dreq_mad(0x72, 0x52, yl, yq), peer_gid(), ms(1));
    take(&mut a);
    // x's event leaves by pop; destroying x then leaves y's in place.
    assert_eq!(a.pop_event(), Some(Event::Disconnected { id: x }));
    a.destroy(x, ms(2)).unwrap();
    assert_eq!(a.pop_event(), Some(Event::Disconnected { id: y }));
    assert_eq!(a.pop_event(), None);
    // y gets another event queued (its TimeWait ends), then z one behind it, and y is
    // destroyed with its event queued.
    let (z, zl, zq, _) = establish_active(&mut a, 0x53, 0x603, ms(2));
    a.poll(ms(60_000));
    a.handle_mad(&dreq_mad(0x73, 0x53, zl, zq), peer_gid(), ms(60_000));
    take(&mut a);
    a.destroy(y, ms(60_001)).unwrap();
    let left = events(&mut a);
    assert!(
        left.iter().all(|e| e.id() != y),
        "y's events are gone: {left:?}"
    );
    assert!(left.iter().any(|e| e.id() == z), "z's stay: {left:?}");
    // A handle on a reused slot gets and loses its events like any other.
    let w = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(60_002))
        .unwrap();
    let m = one(&mut a);
    let (h, CmRepr::Req(r)) = parse(&m) else {
        panic!()
    };
    a.handle_mad(
        &rep_mad(h.tid, peer_rep(0x54, r.local_comm_id, 0x604)),
        peer_gid(),
        ms(60_003),
    );
    a.destroy(w, ms(60_004)).unwrap();
    assert!(events(&mut a).iter().all(|e| e.id() != w));
}

#[test]
fn late_dreq_in_timewait_after_our_own_disconnect_gets_a_fresh_drep() {
    let mut a = agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.disconnect(id, ms(1)).unwrap();
    let m = one(&mut a);
    let (h, _) = parse(&m);
    a.handle_mad(&drep_mad(h.tid, 0x55, local), peer_gid(), ms(2));
    events(&mut a);
    a.handle_mad(&dreq_mad(0x7E, 0x55, local, qpn), peer_gid(), ms(3));
    let m = one(&mut a);
    let (h, CmRepr::Drep(d)) = parse(&m) else {
        panic!()
    };
    assert_eq!(h.tid, 0x7E);
    assert_eq!((d.local_comm_id, d.remote_comm_id), (local, 0x55));
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Dreq), 1);
    assert!(events(&mut a).is_empty());
}

#[test]
fn unsolicited_and_misplaced_messages_are_counted_drops() {
    let mut a = agent();
    // APR, MRA(OTHER): we never send a LAP.
    a.handle_mad(
        &pvcm_wire::testing::mad(
            1,
            CmRepr::Apr(pvcm_wire::cm::apr::Repr {
                local_comm_id: 1,
                remote_comm_id: 2,
                ar_status: AprStatus::Success,
                additional_info: &[],
                private_data: &[],
            }),
        ),
        peer_gid(),
        ms(0),
    );
    a.handle_mad(&mra_mad(1, 2, 3, MsgResponse::Other, 20), peer_gid(), ms(0));
    assert_eq!(a.drops().get(DropReason::Unsolicited), 2);
    // MRA, RTU, DREP, SIDR_REP for nothing.
    a.handle_mad(&mra_mad(1, 2, 3, MsgResponse::Req, 20), peer_gid(), ms(0));
    a.handle_mad(&rtu_mad(1, 2, 3), peer_gid(), ms(0));
    a.handle_mad(&drep_mad(1, 2, 3), peer_gid(), ms(0));
    a.handle_mad(
        &sidr_rep_mad(1, 2, SidrStatus::Success, 3, 4),
        peer_gid(),
        ms(0),
    );
    assert_eq!(a.drops().get(DropReason::UnknownConnection), 4);
    // LAP and MRA(REP) for a connection in the wrong state.
    let id = a
        .connect(peer_gid(), SID, &[], &ConnectOptions::default(), ms(0))
        .unwrap();
    take(&mut a);
    let local = a.info(id).unwrap().local_comm_id;
    a.handle_mad(&lap_mad(1, 0, local, 0), peer_gid(), ms(0));
    a.handle_mad(
        &mra_mad(1, 0, local, MsgResponse::Rep, 20),
        peer_gid(),
        ms(0),
    );
    assert_eq!(a.drops().get(DropReason::BadState), 2);
    assert!(take(&mut a).is_empty());
    assert!(events(&mut a).is_empty());
    assert_eq!(a.state(id), Some(State::ReqSent));
    assert_eq!(a.drops().malformed(), 0);
}

//! Scenario tests of the mux in virtual time: two hosts back to back, VMs played by
//! script. Each failure mode of the mlx4 proxy is run on the default policy (must hold)
//! and on the matching legacy policy (must show the failure, by mechanism).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::*;
use pvcm_backend::mux::{
    DropReason, Group, GuestVerdict, ManualClock, Mux, Policy, State, VmConfig, WireVerdict,
    records,
};
use pvcm_wire::cm::{self, MsgResponse, RejReason, field as f};
use pvcm_wire::mad::{AttributeId, Header, Method};

fn net2(policy: Policy) -> Net {
    let mut n = Net::new(policy);
    n.a.add_vm("a0", gid(1, 1));
    n.a.add_vm("a1", gid(1, 2));
    n.b.add_vm("b0", gid(2, 1));
    n.b.add_vm("b1", gid(2, 2));
    n
}

const S: fn(u64) -> Duration = Duration::from_secs;

#[test]
fn handshake_rewrites_ids_and_tids_and_restores_them() {
    let mut n = net2(Policy::Default);
    // Capture the REQ as it leaves host A.
    let mut m = req(
        n.a.cfg(0),
        7,
        0x1111_0000_0000_0007,
        n.b.gid(0),
        n.a.qpn(0, 0),
        &LINUX,
    );
    let before_28 = m[28..32].to_vec();
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    let w = view(&m);
    let pv = w.local_comm_id().unwrap();
    assert_ne!(pv, 7, "the VM's comm ID must not reach the wire");
    assert_ne!(pv, 0);
    assert_ne!(
        w.tid(),
        0x1111_0000_0000_0007,
        "the VM's TID must not reach the wire"
    );
    assert_eq!(
        &m[28..32],
        &before_28[..],
        "a REQ's byte 28..32 is never written"
    );
    assert_eq!(n.a.mux.pv_cm_id_of(n.a.id(0), 7), Some(pv));
    assert_eq!(n.a.mux.lookup(pv).map(|x| x.0), Some(State::ReqSent));

    let mut n = net2(Policy::Default);
    let c = n.connect(0, 0, 7, 9, 0);
    assert_ne!(c.b_pv, 9);
    assert_eq!(n.a.mux.lookup(c.a_pv).unwrap().0, State::Established);
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::Established);
    n.disconnect_from_a(&c);
    assert_eq!(n.a.mux.lookup(c.a_pv).unwrap().0, State::TimeWait);
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::TimeWait);
    let (a, b) = (n.a.mux.vm_stats(n.a.id(0)), n.b.mux.vm_stats(n.b.id(0)));
    for (attr, tx, rx) in [
        (AttributeId::Req, 1, 0),
        (AttributeId::Rep, 0, 1),
        (AttributeId::Rtu, 1, 0),
        (AttributeId::Dreq, 1, 0),
        (AttributeId::Drep, 0, 1),
    ] {
        assert_eq!(a.counters.get(Group::TxMsgs, attr), tx, "A tx {attr}");
        assert_eq!(a.counters.get(Group::RxMsgs, attr), rx, "A rx {attr}");
        assert_eq!(b.counters.get(Group::TxMsgs, attr), rx, "B tx {attr}");
        assert_eq!(b.counters.get(Group::RxMsgs, attr), tx, "B rx {attr}");
    }
    assert_eq!(n.a.mux.host_stats().drops.total(), 0);
    assert_eq!(n.b.mux.host_stats().drops.total(), 0);
    n.advance(S(10));
    assert_eq!(
        n.a.mux.vm_stats(n.a.id(0)).quarantined,
        1,
        "per-VM quarantine count"
    );
    n.quiesce();
    assert_eq!(n.live(), (0, 0));
    assert_eq!(n.quarantined(), (0, 0));
    assert_eq!(n.a.mux.vm_stats(n.a.id(0)).quarantined, 0);
}

#[test]
fn same_comm_id_in_two_vms_gets_two_host_unique_ids() {
    let mut n = net2(Policy::Default);
    let c0 = n.connect(0, 0, 5, 5, 0);
    let c1 = n.connect(1, 1, 5, 5, 0);
    assert_ne!(c0.a_pv, c1.a_pv);
    assert_ne!(c0.b_pv, c1.b_pv);
    // DREQ from b1 must reach a1 only, with a1's own comm ID.
    let mut m = dreq(1, 5, c1.a_pv, c1.a_qpn);
    let v = n.b_to_a(1, 1, &mut m);
    assert_eq!(v.1, Some(WireVerdict::ToVm(n.a.id(1))));
    assert_eq!(view(&m).remote_comm_id(), Some(5));
    // A MAD naming c1's ID but addressed to a0's GID is not delivered to anyone.
    let mut m = ids(AttributeId::Rtu, 1, 5, c1.a_pv);
    assert_eq!(
        n.a.mux.from_wire(&mut m, n.b.gid(1), n.a.gid(0)),
        WireVerdict::Drop(DropReason::WrongDestination)
    );
}

#[test]
fn mra_rej_lap_apr_sidr_and_class_port_info_are_rewritten() {
    let mut n = net2(Policy::Default);
    // MRA(REQ) from the passive VM: allocates its ID, extends the wait, restores the TID.
    let got = n.send_req(0, 0, 11, 0, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let mut m = mra(view(&got).tid(), 21, a_pv, MsgResponse::Req, 24);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let v = view(&m);
    assert_ne!(v.local_comm_id(), Some(21), "MRA's local comm ID rewritten");
    assert_eq!(v.remote_comm_id(), Some(11));
    assert_eq!(v.tid(), 0xAAAA_0000_0000_0000 | 11);
    let b_pv = v.local_comm_id().unwrap();
    // Plain REJ from the passive VM (mlx4 let these out unrewritten).
    let mut m = rej(view(&got).tid(), 21, a_pv, RejReason::ConsumerDefined, &[]);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    assert_eq!(view(&m).local_comm_id(), Some(b_pv), "same ID as its MRA");
    assert_eq!(view(&m).remote_comm_id(), Some(11));
    assert_eq!(n.a.mux.lookup(a_pv).unwrap().0, State::Quarantined);
    assert_eq!(n.b.mux.lookup(b_pv).unwrap().0, State::Quarantined);

    // LAP from A, APR from B.
    let c = n.connect(0, 0, 12, 22, 1);
    let mut m = ids(AttributeId::Lap, 0x1A9, 12, c.b_pv);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_ne!(view(&m).tid(), 0x1A9);
    let mut r = ids(AttributeId::Apr, view(&m).tid(), 22, c.a_pv);
    assert_eq!(n.b_to_a(0, 0, &mut r).1, Some(WireVerdict::ToVm(n.a.id(0))));
    assert_eq!(view(&r).tid(), 0x1A9, "APR gets the LAP's TID back");
    assert_eq!(view(&r).remote_comm_id(), Some(12));

    // SIDR: request ID and TID rewritten on the way out, restored on the way back.
    let mut m = ids(AttributeId::SidrReq, 0x51D, 0, 0);
    f::SIDR_REQUEST_ID.set(&mut m, 77);
    let (src, dst) = (n.a.gid(0), n.b.gid(1));
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, dst),
        GuestVerdict::ToWire
    );
    let rid = view(&m).sidr_request_id().unwrap();
    assert_ne!(rid, 77);
    assert_ne!(view(&m).tid(), 0x51D);
    // SIDR_REQ carries no GID: routed by the frame's destination.
    assert_eq!(
        n.b.mux.from_wire(&mut m, src, dst),
        WireVerdict::ToVm(n.b.id(1))
    );
    let mut r = ids(AttributeId::SidrRep, view(&m).tid(), 0, 0);
    f::SIDR_REQUEST_ID.set(&mut r, rid.into());
    f::SIDR_REP_QPN.set(&mut r, n.b.qpn(1, 3).into());
    assert_eq!(
        n.b.mux.from_guest(n.b.id(1), &mut r, src),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut r, dst, src),
        WireVerdict::ToVm(n.a.id(0))
    );
    assert_eq!(view(&r).sidr_request_id(), Some(77));
    assert_eq!(view(&r).tid(), 0x51D);
    // A SIDR_REP nobody asked that VM for is refused.
    let mut r = ids(AttributeId::SidrRep, 1, 0, 0);
    f::SIDR_REQUEST_ID.set(&mut r, 4242);
    f::SIDR_REP_QPN.set(&mut r, n.b.qpn(1, 3).into());
    assert_eq!(
        n.b.mux.from_guest(n.b.id(1), &mut r, src),
        GuestVerdict::Drop(DropReason::UnknownConnection)
    );

    // ClassPortInfo Get/GetResp.
    let mut g = [0u8; 256];
    let mut h = Header::cm_send(AttributeId::ClassPortInfo, 0xC91);
    h.method = Method::Get;
    h.emit(&mut pvcm_wire::mad::Packet::new_unchecked(&mut g[..]));
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut g, dst),
        GuestVerdict::ToWire
    );
    let host_tid = view(&g).tid();
    assert_ne!(host_tid, 0xC91);
    assert_eq!(
        n.b.mux.from_wire(&mut g, src, dst),
        WireVerdict::ToVm(n.b.id(1))
    );
    g[3] = Method::GetResp as u8;
    assert_eq!(
        n.b.mux.from_guest(n.b.id(1), &mut g, src),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.a.mux.from_wire(&mut g, dst, src),
        WireVerdict::ToVm(n.a.id(0))
    );
    assert_eq!(view(&g).tid(), 0xC91);
}

/// Seed 000: a busy guest answers a DREQ 10 s late. Returns whether the late DREP got
/// through and how many of the peer's DREQ retries were lost on the way.
fn slow_guest_dreq(policy: Policy) -> (bool, u32) {
    let mut n = net2(policy);
    let c = n.connect(0, 0, 1, 2, 0);
    let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    let mut lost = 0;
    // The peer's CM retries every ~5.4 s (response timeout 20 + ACK timeout 18).
    for _ in 0..2 {
        n.advance(Duration::from_millis(5_400));
        let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
        if n.a_to_b(0, 0, &mut m).1 != Some(WireVerdict::ToVm(n.b.id(0))) {
            lost += 1;
        }
    }
    n.advance(Duration::from_millis(200));
    // The slow guest finally answers, ~11 s after the first DREQ.
    let mut r = ids(AttributeId::Drep, 0xD, 2, c.a_pv);
    let ok = n.b_to_a(0, 0, &mut r).1 == Some(WireVerdict::ToVm(n.a.id(0)));
    (ok, lost)
}

#[test]
fn dreq_towards_a_slow_guest_keeps_its_entry() {
    assert_eq!(slow_guest_dreq(Policy::Default), (true, 0));
    // mlx4 before 2020: the 5 s timer evicts the entry; the DREP is dropped and the
    // peer's retries find nothing.
    assert_eq!(slow_guest_dreq(Policy::Mlx4Pre2020), (false, 2));
}

#[test]
fn dreq_window_is_bounded_by_the_peer_retries() {
    // A guest that never answers: the entry lives exactly as long as the peer retries.
    let mut n = net2(Policy::Default);
    let p = ReqParams {
        resp: 16,
        retries: 3,
        ack: 14,
    };
    let c = n.connect_with(0, 0, 1, 2, 0, &p);
    let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    // 4 attempts of (268 ms + 67 ms) + 1 s grace = ~2.34 s.
    n.advance(Duration::from_millis(2_300));
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::DreqRcvd);
    n.advance(Duration::from_millis(100));
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::TimeWait);
    n.advance(S(2));
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::Quarantined);
    n.quiesce();
    assert_eq!(n.live(), (0, 0));
}

/// Seed 002 with two remote hosts whose CMs use the same comm ID: each sends a REQ to
/// a different VM behind host B, then gives up with REJ(TIMEOUT). Returns where each
/// REJ went.
fn rej_timeout_collision(policy: Policy) -> [WireVerdict; 2] {
    let mut n = net2(policy);
    let r = [
        VmConfig::new("r1", gid(9, 1)),
        VmConfig::new("r2", gid(9, 2)),
    ];
    for (i, rc) in r.iter().enumerate() {
        let mut m = req(rc, 0x1234, 0x77, n.b.gid(i), 0x10000, &LINUX);
        assert_eq!(
            n.b.mux.from_wire(&mut m, rc.gid, n.b.gid(i)),
            WireVerdict::ToVm(n.b.id(i))
        );
    }
    let mut out = [WireVerdict::Reply; 2];
    for (i, rc) in r.iter().enumerate() {
        let mut m = rej(
            0x77,
            0x1234,
            0,
            RejReason::Timeout,
            &rc.ca_guid.to_be_bytes(),
        );
        out[i] = n.b.mux.from_wire(&mut m, rc.gid, n.b.gid(i));
    }
    out
}

#[test]
fn rej_timeout_is_routed_by_ca_guid_and_comm_id() {
    let mut n = net2(Policy::Default);
    let want = [WireVerdict::ToVm(n.b.id(0)), WireVerdict::ToVm(n.b.id(1))];
    assert_eq!(rej_timeout_collision(Policy::Default), want);
    // mlx4 since 2020 keys by comm ID alone: the second REQ overwrote the first.
    let legacy = rej_timeout_collision(Policy::Mlx4Post2020);
    assert_eq!(
        legacy,
        [WireVerdict::ToVm(n.b.id(1)), WireVerdict::ToVm(n.b.id(1))]
    );
    // mlx4 before 2020 does not route them at all.
    assert_eq!(
        rej_timeout_collision(Policy::Mlx4Pre2020),
        [WireVerdict::Drop(DropReason::NoRoute); 2]
    );
    // Another host naming r1's CA GUID cannot withdraw r1's request, nor can r1 send
    // its REJ(TIMEOUT) to another VM's address.
    let mut n2 = net2(Policy::Default);
    let r1 = VmConfig::new("r1", gid(9, 1));
    let mut m = req(&r1, 0x55, 1, n2.b.gid(0), 0x10000, &LINUX);
    assert_eq!(
        n2.b.mux.from_wire(&mut m, r1.gid, n2.b.gid(0)),
        WireVerdict::ToVm(n2.b.id(0))
    );
    let mut m = rej(1, 0x55, 0, RejReason::Timeout, &r1.ca_guid.to_be_bytes());
    assert_eq!(
        n2.b.mux.from_wire(&mut m, gid(9, 2), n2.b.gid(0)),
        WireVerdict::Drop(DropReason::WrongSource)
    );
    let mut m = rej(1, 0x55, 0, RejReason::Timeout, &r1.ca_guid.to_be_bytes());
    assert_eq!(
        n2.b.mux.from_wire(&mut m, r1.gid, n2.b.gid(1)),
        WireVerdict::Drop(DropReason::WrongDestination)
    );
    let mut m = rej(1, 0x55, 0, RejReason::Timeout, &r1.ca_guid.to_be_bytes());
    assert_eq!(
        n2.b.mux.from_wire(&mut m, r1.gid, n2.b.gid(0)),
        WireVerdict::ToVm(n2.b.id(0))
    );
    // And the passive entries are gone once rejected.
    let r = VmConfig::new("r", gid(9, 1));
    let mut m = req(&r, 5, 1, n.b.gid(0), 0x10000, &LINUX);
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
        WireVerdict::ToVm(n.b.id(0))
    );
    assert_eq!(n.b.mux.live_entries(), 1);
    let mut m = rej(1, 5, 0, RejReason::Timeout, &r.ca_guid.to_be_bytes());
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
        WireVerdict::ToVm(n.b.id(0))
    );
    assert_eq!(n.b.mux.live_entries(), 0);
}

#[test]
fn connect_then_destroy_end_to_end() {
    // rdma_connect() then rdma_destroy_id() on A: A's CM sends REJ(TIMEOUT) with its CA
    // GUID in the ARI and Remote Comm ID 0; B's VM must get it.
    let mut n = net2(Policy::Default);
    let got = n.send_req(0, 0, 3, 0, &LINUX);
    let ari = n.a.cfg(0).ca_guid.to_be_bytes();
    let mut m = rej(0xAAAA_0000_0000_0003, 3, 0, RejReason::Timeout, &ari);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(view(&m).local_comm_id(), view(&got).local_comm_id());
    assert_eq!(n.live(), (0, 0));
    // A spoofed ARI (another CA's GUID) is refused at the source.
    let _ = n.send_req(0, 0, 4, 1, &LINUX);
    let mut m = rej(1, 4, 0, RejReason::Timeout, &0xBAD_u64.to_be_bytes());
    assert_eq!(
        n.a_to_b(0, 0, &mut m).0,
        GuestVerdict::Drop(DropReason::SpoofedCaGuid)
    );
}

#[test]
fn withdraw_crossing_the_peers_rep_reaches_the_peer() {
    // rdma_connect() then rdma_destroy_id() on A while B's REP is on its way: A's mux
    // passes the REP, but A's CM withdraws first (REJ(TIMEOUT), Remote Comm ID 0). The
    // REJ must reach B under A's host comm ID, or B's id waits out its REP retries.
    let mut n = net2(Policy::Default);
    let got = n.send_req(0, 0, 3, 0, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let mut m = rep(n.b.cfg(0), view(&got).tid(), 8, a_pv, n.b.qpn(0, 1));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let ari = n.a.cfg(0).ca_guid.to_be_bytes();
    let mut m = rej(0xAAAA_0000_0000_0003, 3, 0, RejReason::Timeout, &ari);
    assert_eq!(
        n.a_to_b(0, 0, &mut m),
        (GuestVerdict::ToWire, Some(WireVerdict::ToVm(n.b.id(0))))
    );
    assert_eq!(view(&m).local_comm_id(), Some(a_pv));
    assert_eq!(n.a.mux.vm_stats(n.a.id(0)).drops.total(), 0);
    // The REJ ended the connection on both sides.
    assert_eq!(n.live(), (0, 0));
}

/// The peer ends a connection (its REJ after its REP: its server went away) while A's
/// CM answers the REP: A's RTU and A's REJ (its application destroyed the id) cross the
/// peer's REJ. Both are dropped as late MADs of an ended connection (`quarantined`),
/// never as a connection A does not own.
#[test]
fn answers_crossing_the_peers_rej_are_late_not_unknown() {
    let mut n = net2(Policy::Default);
    let got = n.send_req(0, 0, 3, 0, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let tid = view(&got).tid();
    let mut m = rep(n.b.cfg(0), tid, 8, a_pv, n.b.qpn(0, 1));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let mut m = rej(tid, 8, a_pv, RejReason::ConsumerDefined, &[]);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_pv = view(&m).local_comm_id().unwrap();
    let mut rtu = ids(AttributeId::Rtu, 0xAAAA_0000_0000_0003, 3, b_pv);
    let mut rej_a = rej(
        0xAAAA_0000_0000_0003,
        3,
        b_pv,
        RejReason::ConsumerDefined,
        &[],
    );
    for m in [&mut rtu, &mut rej_a] {
        assert_eq!(
            n.a.mux.from_guest(n.a.id(0), m, n.b.gid(0)),
            GuestVerdict::Drop(DropReason::Quarantined)
        );
    }
    let d = n.a.mux.vm_stats(n.a.id(0)).drops;
    assert_eq!(d.get(DropReason::Quarantined), 2);
    assert_eq!(d.get(DropReason::UnknownConnection), 0);
    // A comm ID the VM never used is still unknown.
    let mut m = ids(AttributeId::Rtu, 0xAAAA_0000_0000_0009, 9, b_pv);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::Drop(DropReason::UnknownConnection)
    );
}

#[test]
fn abandoned_handshakes_and_lost_rtu_end_in_quarantine_then_free() {
    for policy in Policy::ALL {
        let mut n = net2(policy);
        // 1. REQ nobody answers.
        let _ = n.send_req(0, 0, 1, 0, &LINUX);
        // 2. REP whose RTU is lost.
        let got = n.send_req(0, 1, 2, 1, &LINUX);
        let a_pv = view(&got).local_comm_id().unwrap();
        let mut m = rep(n.b.cfg(1), view(&got).tid(), 8, a_pv, n.b.qpn(1, 1));
        assert_eq!(n.b_to_a(1, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
        let b_pv = view(&m).local_comm_id().unwrap();
        let mut m = ids(AttributeId::Rtu, 1, 2, b_pv);
        assert_eq!(
            n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(1)),
            GuestVerdict::ToWire
        );
        // (dropped by the wire)
        // 3. Duplicate REP: counted, no second entry. The default answers it with the
        //    RTU itself (`rep_retry_after_the_rtu_gets_the_rtu_again`), and the wire
        //    drops that RTU too; mlx4 delivers it to the VM.
        let mut m = rep(n.b.cfg(1), view(&got).tid(), 8, a_pv, n.b.qpn(1, 1));
        let answer = if policy == Policy::Default {
            WireVerdict::Reply
        } else {
            WireVerdict::ToVm(n.a.id(0))
        };
        assert_eq!(n.b_to_a(1, 0, &mut m).1, Some(answer));
        let a = n.a.mux.vm_stats(n.a.id(0)).counters;
        assert_eq!(a.get(Group::RxDuplicates, AttributeId::Rep), 1);
        assert_eq!(a.get(Group::TxRetries, AttributeId::Rep), 0);
        let b = n.b.mux.vm_stats(n.b.id(1)).counters;
        assert_eq!(b.get(Group::TxRetries, AttributeId::Rep), 1);
        n.quiesce();
        if policy == Policy::Default {
            // B gave up on the REP; A's VM still believes in the connection (its RTU
            // left), so A keeps that one entry, as it must, and nothing else.
            assert_eq!(n.live(), (1, 0), "{policy}");
            assert_eq!(n.a.mux.lookup(a_pv).unwrap().0, State::Established);
            // When A's VM disconnects, B's mux answers for the forgotten connection.
            let mut m = dreq(2, 2, b_pv, n.b.qpn(1, 1));
            assert_eq!(
                n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(1)),
                GuestVerdict::ToWire
            );
            assert_eq!(
                n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(1)),
                WireVerdict::Reply
            );
            assert_eq!(
                n.a.mux.from_wire(&mut m, n.b.gid(1), n.a.gid(0)),
                WireVerdict::ToVm(n.a.id(0))
            );
            assert_eq!(view(&m).attr(), AttributeId::Drep);
            assert_eq!(view(&m).remote_comm_id(), Some(2));
            n.quiesce();
            assert_eq!(n.live(), (0, 0), "{policy}");
            assert_eq!(n.quarantined(), (0, 0), "{policy}");
        } else {
            // mlx4 only ever frees on DREQ/REJ: the abandoned REQ and B's half of the
            // lost-RTU connection leak forever.
            assert!(
                n.live().0 >= 2 && n.live().1 >= 1,
                "{policy}: {:?}",
                n.live()
            );
        }
    }
}

#[test]
fn mra_extends_the_wait() {
    let p = ReqParams {
        resp: 16,
        retries: 1,
        ack: 14,
    };
    for with_mra in [false, true] {
        let mut n = net2(Policy::Default);
        let got = n.send_req(0, 0, 1, 0, &p);
        let a_pv = view(&got).local_comm_id().unwrap();
        if with_mra {
            // Service timeout 22: ~17 s.
            let mut m = mra(view(&got).tid(), 5, a_pv, MsgResponse::Req, 22);
            assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
        }
        n.advance(S(10));
        let alive = n.a.mux.lookup(a_pv).map(|x| x.0) == Some(State::ReqSent);
        assert_eq!(alive, with_mra);
    }
}

/// Seed 001 for the proxy: the peer's DREQ retry after our DREP (which it lost) must
/// get the DREP again. Returns the verdict and the MAD as it leaves.
fn dreq_retry_after_drep(policy: Policy, vm_gone: bool) -> (WireVerdict, Mad) {
    let mut n = net2(policy);
    let c = n.connect(0, 0, 1, 2, 0);
    n.disconnect_from_a(&c);
    if vm_gone {
        n.b.mux.detach_vm(n.b.id(0));
    }
    n.advance(Duration::from_millis(500));
    let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
    (n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)), m)
}

#[test]
fn late_dreq_in_timewait_gets_the_drep_again_from_the_mux() {
    for vm_gone in [false, true] {
        let (v, m) = dreq_retry_after_drep(Policy::Default, vm_gone);
        assert_eq!(v, WireVerdict::Reply, "VM gone: {vm_gone}");
        let r = view(&m);
        assert_eq!(r.attr(), AttributeId::Drep);
        assert_eq!(r.tid(), 0xD, "the DREQ's TID");
        assert_eq!(r.remote_comm_id(), Some(1), "the peer's comm ID");
    }
    // mlx4 delivers it to the VM (whose CM may be gone) ...
    let n = net2(Policy::Mlx4Post2020);
    assert_eq!(
        dreq_retry_after_drep(Policy::Mlx4Post2020, false).0,
        WireVerdict::ToVm(n.b.id(0))
    );
    // ... and before 2020 deleted the entry on DREP: the retry is lost.
    assert_eq!(
        dreq_retry_after_drep(Policy::Mlx4Pre2020, false).0,
        WireVerdict::Drop(DropReason::NoRoute)
    );
}

#[test]
fn late_mad_for_a_quarantined_id_is_dropped_never_rerouted() {
    let mut n = net2(Policy::Default);
    let c = n.connect(0, 0, 1, 2, 0);
    n.disconnect_from_a(&c);
    n.advance(S(10)); // past TimeWait: quarantined
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::Quarantined);
    // Many new connections, from both VMs, reusing the VMs' comm IDs.
    let mut seen = Vec::new();
    for i in 0..2000u32 {
        let cc = n.connect((i % 2) as usize, (i % 2) as usize, 1 + i, 2 + i, i % 100);
        assert_ne!(cc.b_pv, c.b_pv);
        assert_ne!(cc.a_pv, c.a_pv);
        seen.push(cc);
    }
    let mut m = ids(AttributeId::Rtu, 1, 1, c.b_pv);
    assert_eq!(
        n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
        WireVerdict::Drop(DropReason::Quarantined)
    );
    // A late DREQ is answered statelessly (as Linux does for unknown connections), not routed.
    let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
    assert_eq!(
        n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
        WireVerdict::Reply
    );
    let r = view(&m);
    assert_eq!(r.attr(), AttributeId::Drep);
    assert_eq!(
        (r.local_comm_id(), r.remote_comm_id()),
        (Some(c.b_pv), Some(1))
    );
    // Counted as sent on the VM's behalf, not as a drop.
    assert_eq!(n.b.mux.host_stats().drops.get(DropReason::Quarantined), 1);
    assert_eq!(n.b.mux.host_stats().on_behalf, 1);
    // After the quarantine the ID is free; its slot comes back with a new generation.
    n.advance(S(31));
    assert_eq!(n.b.mux.lookup(c.b_pv), None);
}

/// VM reset with connections in every phase. Returns (MADs sent on its behalf,
/// live entries left on both hosts after quiesce).
fn detach_with_live_connections(policy: Policy) -> (usize, (u64, u64)) {
    let mut n = net2(policy);
    let est = n.connect(0, 0, 1, 2, 0); // established, A active
    let half = n.send_req(0, 0, 3, 1, &LINUX); // B's VM got a REQ, never answered
    let half_pv = view(&half).local_comm_id().unwrap();
    // B's VM is active towards A's VM, still waiting for the REP.
    let mut m = req(n.b.cfg(0), 9, 0x99, n.a.gid(0), n.b.qpn(0, 5), &LINUX);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_active_pv = view(&m).local_comm_id().unwrap();

    n.b.mux.detach_vm(n.b.id(0));
    let out: Vec<_> = n.b.mux.drain_outbox().collect();
    for o in &out {
        let mut mad = o.mad;
        let v = n.a.mux.from_wire(&mut mad, o.src, o.dst);
        assert_eq!(v, WireVerdict::ToVm(n.a.id(0)), "{:?}", view(&mad).attr());
        let got = view(&mad);
        match got.attr() {
            AttributeId::Dreq => {
                assert_eq!(got.remote_comm_id(), Some(est.a_sl));
                assert_eq!(got.remote_qpn(), Some(est.a_qpn));
                // A's VM answers; B absorbs it.
                let mut r = ids(AttributeId::Drep, got.tid(), est.a_sl, est.b_pv);
                assert_eq!(
                    n.a.mux.from_guest(n.a.id(0), &mut r, o.src),
                    GuestVerdict::ToWire
                );
                assert_eq!(
                    n.b.mux.from_wire(&mut r, o.dst, o.src),
                    WireVerdict::Drop(DropReason::Absorbed)
                );
            }
            AttributeId::Rej => {
                let reason = got.rej_reason().unwrap();
                if reason == RejReason::Timeout.code() {
                    assert_eq!(got.local_comm_id(), Some(b_active_pv));
                } else {
                    assert_eq!(got.remote_comm_id(), Some(3));
                    assert_eq!(got.local_comm_id().map(|x| x != 0), Some(true));
                    let _ = half_pv;
                }
            }
            a => panic!("unexpected {a}"),
        }
    }
    n.quiesce();
    (out.len(), n.live())
}

#[test]
fn detached_vm_connections_are_closed_on_its_behalf() {
    assert_eq!(detach_with_live_connections(Policy::Default), (3, (0, 0)));
    // mlx4: "TBD": nothing is sent, the entries stay.
    let (sent, live) = detach_with_live_connections(Policy::Mlx4Post2020);
    assert_eq!(sent, 0);
    assert!(live.1 > 0);
}

/// A VM lying about its GID, QPN or CA GUID. Returns the verdicts.
fn spoof(policy: Policy) -> Vec<GuestVerdict> {
    let mut n = net2(policy);
    let dst = n.b.gid(0);
    let me = n.a.cfg(0).clone();
    let other = n.a.cfg(1).clone();
    let mut out = Vec::new();
    // Another VM's GID as source.
    let mut m = req(&other, 1, 1, dst, me.qpn_base, &LINUX);
    f::REQ_LOCAL_CA_GUID.set(&mut m, me.ca_guid);
    out.push(n.a.mux.from_guest(n.a.id(0), &mut m, dst));
    // A QPN outside the VM's range (another VM's QP: a stale-conn attack on it).
    let mut m = req(&me, 2, 1, dst, me.qpn_base + me.qpn_count, &LINUX);
    out.push(n.a.mux.from_guest(n.a.id(0), &mut m, dst));
    // Another CA's GUID.
    let mut m = req(&me, 3, 1, dst, me.qpn_base, &LINUX);
    f::REQ_LOCAL_CA_GUID.set(&mut m, other.ca_guid);
    out.push(n.a.mux.from_guest(n.a.id(0), &mut m, dst));
    out
}

#[test]
fn spoofed_gid_qpn_and_guid_are_dropped() {
    use DropReason::*;
    assert_eq!(
        spoof(Policy::Default),
        vec![
            GuestVerdict::Drop(SpoofedGid),
            GuestVerdict::Drop(SpoofedQpn),
            GuestVerdict::Drop(SpoofedCaGuid)
        ]
    );
    assert_eq!(spoof(Policy::Mlx4Post2020), vec![GuestVerdict::ToWire; 3]);
}

fn quota(policy: Policy) -> (Vec<GuestVerdict>, Vec<u8>) {
    let mut n = Net::new(policy);
    let mut cfg = VmConfig::new("small", gid(1, 1));
    cfg.quota = Some(4);
    n.a.vms.push((n.a.mux.attach_vm(cfg.clone()).unwrap(), cfg));
    n.b.add_vm("b0", gid(2, 1));
    let mut verdicts = Vec::new();
    let mut last = [0u8; 256];
    for i in 0..5u32 {
        let mut m = req(
            n.a.cfg(0),
            100 + i,
            0xF00 + u64::from(i),
            n.b.gid(0),
            n.a.qpn(0, i),
            &LINUX,
        );
        verdicts.push(n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)));
        last = m;
    }
    (verdicts, last.to_vec())
}

#[test]
fn quota_rejects_with_no_resources() {
    let (v, last) = quota(Policy::Default);
    assert_eq!(&v[..4], &[GuestVerdict::ToWire; 4]);
    assert_eq!(v[4], GuestVerdict::Reply);
    let r = pvcm_wire::cm::CmMad::new_checked(&last[..]).unwrap();
    assert_eq!(r.attr(), AttributeId::Rej);
    assert_eq!(r.rej_reason(), Some(RejReason::NoResources.code()));
    assert_eq!(r.remote_comm_id(), Some(104), "names the VM's own comm ID");
    assert_eq!(r.tid(), 0xF04, "answers the VM's own TID");
    let (v, _) = quota(Policy::Mlx4Pre2020);
    assert_eq!(v, vec![GuestVerdict::ToWire; 5]);
}

#[test]
fn unknown_destinations_and_garbage_are_counted_drops() {
    let mut n = net2(Policy::Default);
    let r = VmConfig::new("r", gid(9, 1));
    let mut m = req(&r, 5, 1, gid(2, 99), 0x10000, &LINUX);
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, gid(2, 99)),
        WireVerdict::Drop(DropReason::UnknownGid)
    );
    let mut m = ids(AttributeId::Rtu, 1, 5, 0xDEAD_BEEF);
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
        WireVerdict::Drop(DropReason::NoRoute)
    );
    let mut m = [0u8; 256];
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
        WireVerdict::Drop(DropReason::Malformed)
    );
    let mut short = [1u8; 100];
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut short, r.gid),
        GuestVerdict::Drop(DropReason::Malformed)
    );
    // A VM naming a connection it does not have.
    let mut m = ids(AttributeId::Dreq, 1, 999, 5);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, r.gid),
        GuestVerdict::Drop(DropReason::UnknownConnection)
    );
    let d = n.b.mux.host_stats().drops;
    assert_eq!(d.get(DropReason::UnknownGid), 1);
    assert_eq!(d.get(DropReason::NoRoute), 1);
    assert_eq!(d.get(DropReason::Malformed), 2);
    assert_eq!(d.get(DropReason::UnknownConnection), 1);
}

#[test]
fn duplicate_req_refreshes_and_is_counted() {
    let mut n = net2(Policy::Default);
    let got = n.send_req(0, 0, 1, 0, &LINUX);
    n.advance(S(5));
    // The VM's CM retries the REQ with the same comm ID and TID.
    let mut m = req(
        n.a.cfg(0),
        1,
        0xAAAA_0000_0000_0001,
        n.b.gid(0),
        n.a.qpn(0, 0),
        &LINUX,
    );
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(
        view(&m).local_comm_id(),
        view(&got).local_comm_id(),
        "same pv_cm_id"
    );
    assert_eq!(
        n.a.mux
            .vm_stats(n.a.id(0))
            .counters
            .get(Group::TxRetries, AttributeId::Req),
        1
    );
    assert_eq!(
        n.b.mux
            .vm_stats(n.b.id(0))
            .counters
            .get(Group::RxDuplicates, AttributeId::Req),
        1
    );
    assert_eq!(n.live(), (1, 1));
    let _ = cm::RejReason::Timeout;
}

/// The VM's CM retries its REQ while the peer's REP is delayed on the wire, then again
/// just as the REP reaches it (its RTU comes later). Every retry must be the REQ the peer
/// already answered, byte for byte (same pv_cm_id, host TID, CA GUID, QPN): a Linux peer
/// matches duplicates by comm ID + CA GUID (`cm_match_req`) and would otherwise answer
/// REJ(STALE_CONN) or raise a second connection. A retry crossing the peer's REJ is
/// dropped.
#[test]
fn req_retry_after_the_rep_is_the_same_connection() {
    let mut n = net2(Policy::Default);
    let vm_tid = 0xAAAA_0000_0000_0001;
    let retry = |n: &Net| req(n.a.cfg(0), 1, vm_tid, n.b.gid(0), n.a.qpn(0, 0), &LINUX);
    let first = n.send_req(0, 0, 1, 0, &LINUX);
    let a_pv = view(&first).local_comm_id().unwrap();
    // 1. The REP is delayed: the VM's REQ timer fires.
    let mut m = retry(&n);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(m, first, "a retry in ReqSent is the same REQ on the wire");
    // 2. The REP reaches the VM; its retry was already queued behind.
    let mut m = rep(n.b.cfg(0), view(&first).tid(), 2, a_pv, n.b.qpn(0, 0));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_pv = view(&m).local_comm_id().unwrap();
    assert_eq!(n.a.mux.lookup(a_pv).unwrap().0, State::RepRcvd);
    let mut m = retry(&n);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    assert_eq!(m, first, "a retry in RepRcvd is the same REQ on the wire");
    // B sees a duplicate of the REQ it answered, not a second connection.
    assert_eq!(
        n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
        WireVerdict::ToVm(n.b.id(0))
    );
    assert_eq!(n.live(), (1, 1), "no new entry on either host");
    // 3. The delayed RTU establishes both sides.
    let mut m = ids(AttributeId::Rtu, vm_tid, 1, b_pv);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(n.a.mux.lookup(a_pv).unwrap().0, State::Established);
    assert_eq!(n.b.mux.lookup(b_pv).unwrap().0, State::Established);
    let (a, b) = (n.a.mux.vm_stats(n.a.id(0)), n.b.mux.vm_stats(n.b.id(0)));
    assert_eq!(a.counters.get(Group::TxMsgs, AttributeId::Req), 3);
    assert_eq!(a.counters.get(Group::TxRetries, AttributeId::Req), 2);
    assert_eq!(b.counters.get(Group::RxDuplicates, AttributeId::Req), 2);
    assert_eq!(n.a.mux.host_stats().drops.total(), 0);
    assert_eq!(n.b.mux.host_stats().drops.total(), 0);

    // A retry that crosses the peer's REJ is dropped (no second connection either).
    let first = n.send_req(0, 0, 5, 1, &LINUX);
    let a_pv = view(&first).local_comm_id().unwrap();
    let mut m = rej(view(&first).tid(), 6, a_pv, RejReason::ConsumerDefined, &[]);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let mut m = req(
        n.a.cfg(0),
        5,
        0xAAAA_0000_0000_0005,
        n.b.gid(0),
        n.a.qpn(0, 1),
        &LINUX,
    );
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::Drop(DropReason::BadState)
    );
    assert_eq!(n.live(), (1, 1), "only the established connection");
    assert_eq!(n.a.mux.pv_cm_id_of(n.a.id(0), 5), None);
    // The same comm ID under another TID is a new connection (the VM's CM reused it).
    let mut m = req(
        n.a.cfg(0),
        5,
        0xBBBB_0000_0000_0005,
        n.b.gid(0),
        n.a.qpn(0, 1),
        &LINUX,
    );
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_ne!(view(&m).local_comm_id(), Some(a_pv));
    assert_eq!(n.live(), (2, 2));
    n.quiesce();
    assert_eq!(n.live(), (1, 1), "only the established connection is left");
    assert_eq!(n.quarantined(), (0, 0));
}

/// The active VM's RTU, REJ and MRA(REP) reuse its REQ's TID, as Linux's do. They leave
/// with the host's REQ TID (the REQ's TID on the wire), never the VM's, whose low half is
/// the VM's comm ID. Other TIDs pass unchanged.
#[test]
fn active_vm_answers_carry_the_host_req_tid() {
    let mut n = net2(Policy::Default);
    let vm_tid = 0xAAAA_0000_0000_0003;
    let got = n.send_req(0, 0, 3, 0, &LINUX);
    let (a_pv, host_tid) = (view(&got).local_comm_id().unwrap(), view(&got).tid());
    assert_ne!(host_tid as u32, 3);
    let mut m = rep(n.b.cfg(0), host_tid, 4, a_pv, n.b.qpn(0, 0));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    assert_eq!(view(&m).tid(), vm_tid);
    let b_pv = view(&m).local_comm_id().unwrap();
    // MRA(REP), then RTU.
    let mut m = mra(vm_tid, 3, b_pv, MsgResponse::Rep, 20);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(view(&m).tid(), host_tid, "MRA(REP)");
    let mut m = ids(AttributeId::Rtu, vm_tid, 3, b_pv);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    assert_eq!(view(&m).tid(), host_tid, "RTU");
    // A re-sent RTU with another TID (a CM echoing the duplicate REP's) is left alone.
    let mut m = ids(AttributeId::Rtu, 0x1234, 3, b_pv);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    assert_eq!(view(&m).tid(), 0x1234);
    // REJ(TIMEOUT) (connect then destroy) and REJ of a REP.
    let got = n.send_req(0, 0, 7, 1, &LINUX);
    let ari = n.a.cfg(0).ca_guid.to_be_bytes();
    let mut m = rej(0xAAAA_0000_0000_0007, 7, 0, RejReason::Timeout, &ari);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(view(&m).tid(), view(&got).tid(), "REJ(TIMEOUT)");
    let got = n.send_req(0, 0, 8, 2, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let mut m = rep(n.b.cfg(0), view(&got).tid(), 9, a_pv, n.b.qpn(0, 2));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_pv = view(&m).local_comm_id().unwrap();
    let mut m = rej(
        0xAAAA_0000_0000_0008,
        8,
        b_pv,
        RejReason::ConsumerDefined,
        &[],
    );
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(view(&m).tid(), view(&got).tid(), "REJ(REP)");
    // The passive VM's answers echo the peer's TID: unchanged (restored on A's side).
    let got = n.send_req(0, 0, 10, 3, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let mut m = rej(view(&got).tid(), 11, a_pv, RejReason::ConsumerDefined, &[]);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, n.a.gid(0)),
        GuestVerdict::ToWire
    );
    assert_eq!(view(&m).tid(), view(&got).tid());
}

/// A REJ with Local Comm ID 0 from the VM (Linux `cm_issue_rej`: no listener, no
/// resources, ...) retires the entry the REQ it answers created: it must not pin the
/// VM's quota until the peer's REQ window closes. A REJ naming a REQ delivered to
/// another VM is refused and retires nothing.
#[test]
fn stateless_rej_from_the_vm_retires_the_req_entry() {
    let mut n = Net::new(Policy::Default);
    let mut cfg = VmConfig::new("small", gid(2, 1));
    cfg.quota = Some(1);
    n.b.vms.push((n.b.mux.attach_vm(cfg.clone()).unwrap(), cfg));
    n.b.add_vm("b1", gid(2, 2));
    let r = VmConfig::new("r", gid(9, 1));
    for comm in 1..=5u32 {
        let mut m = req(
            &r,
            comm,
            0x70 + u64::from(comm),
            n.b.gid(0),
            0x10000,
            &LINUX,
        );
        assert_eq!(
            n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
            WireVerdict::ToVm(n.b.id(0)),
            "REQ {comm}: the earlier rejects freed the quota"
        );
        assert_eq!(n.b.mux.vm_stats(n.b.id(0)).live, 1);
        let mut m = rej(
            0x70 + u64::from(comm),
            0,
            comm,
            RejReason::InvalidServiceId,
            &[],
        );
        assert_eq!(
            n.b.mux.from_guest(n.b.id(0), &mut m, r.gid),
            GuestVerdict::ToWire
        );
        assert_eq!(view(&m).remote_comm_id(), Some(comm), "passes unchanged");
        assert_eq!(n.b.mux.vm_stats(n.b.id(0)).live, 0);
        assert_eq!(n.b.mux.live_entries(), 0);
        // No ID of ours ever went on the wire: nothing to quarantine.
        assert_eq!(n.b.mux.quarantined_entries(), 0);
    }
    // b1 names the REQ that went to b0: dropped, b0's entry stays.
    let mut m = req(&r, 9, 0x79, n.b.gid(0), 0x10000, &LINUX);
    assert_eq!(
        n.b.mux.from_wire(&mut m, r.gid, n.b.gid(0)),
        WireVerdict::ToVm(n.b.id(0))
    );
    let mut m = rej(0x79, 0, 9, RejReason::NoResources, &[]);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(1), &mut m, r.gid),
        GuestVerdict::Drop(DropReason::UnknownConnection)
    );
    assert_eq!(n.b.mux.vm_stats(n.b.id(0)).live, 1);
    // b0 can still answer it (here with a stateful REJ: into quarantine).
    let mut m = rej(0x79, 0x42, 9, RejReason::ConsumerDefined, &[]);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(0), &mut m, r.gid),
        GuestVerdict::ToWire
    );
    assert_eq!(n.b.mux.live_entries(), 0);
    assert_eq!(n.b.mux.quarantined_entries(), 1);
    // A stateless REJ naming nothing pending passes, as before.
    let mut m = rej(1, 0, 0x999, RejReason::InvalidServiceId, &[]);
    assert_eq!(
        n.b.mux.from_guest(n.b.id(1), &mut m, r.gid),
        GuestVerdict::ToWire
    );
}

/// Seed 003: long churn of connect/teardown with REJs, abandoned handshakes and lost
/// RTUs mixed in. Returns (live, quarantined) on both hosts after quiesce.
fn churn(policy: Policy, cycles: u32) -> ((u64, u64), (u64, u64)) {
    let mut n = net2(policy);
    for i in 0..cycles {
        // The VMs' CMs allocate comm IDs cyclically, so they recur.
        let (a_sl, b_sl) = (1 + i % 50_000, 100_000 + i % 50_000);
        let (av, bv) = ((i % 2) as usize, ((i / 2) % 2) as usize);
        match i % 8 {
            0..=2 => {
                let c = n.connect(av, bv, a_sl, b_sl, i % 1000);
                n.disconnect_from_a(&c);
            }
            3 => {
                // Passive side disconnects.
                let c = n.connect(av, bv, a_sl, b_sl, i % 1000);
                let mut m = dreq(7, c.b_sl, c.a_pv, c.a_qpn);
                assert_eq!(
                    n.b_to_a(bv, av, &mut m).1,
                    Some(WireVerdict::ToVm(n.a.id(av)))
                );
                let mut r = ids(AttributeId::Drep, view(&m).tid(), c.a_sl, c.b_pv);
                assert_eq!(
                    n.a_to_b(av, bv, &mut r).1,
                    Some(WireVerdict::ToVm(n.b.id(bv)))
                );
            }
            4 => {
                // Passive VM rejects.
                let got = n.send_req(av, bv, a_sl, i % 1000, &LINUX);
                let a_pv = view(&got).local_comm_id().unwrap();
                let mut m = rej(
                    view(&got).tid(),
                    b_sl,
                    a_pv,
                    RejReason::ConsumerDefined,
                    &[],
                );
                assert_eq!(
                    n.b_to_a(bv, av, &mut m).1,
                    Some(WireVerdict::ToVm(n.a.id(av)))
                );
            }
            5 => {
                // rdma_connect() then rdma_destroy_id(): REJ(TIMEOUT).
                let _ = n.send_req(av, bv, a_sl, i % 1000, &LINUX);
                let ari = n.a.cfg(av).ca_guid.to_be_bytes();
                let mut m = rej(1, a_sl, 0, RejReason::Timeout, &ari);
                let v = n.a_to_b(av, bv, &mut m);
                assert_eq!(v.1, Some(WireVerdict::ToVm(n.b.id(bv))), "cycle {i}: {v:?}");
            }
            6 => {
                // Abandoned half way: the REQ is answered, then nobody speaks again.
                let got = n.send_req(av, bv, a_sl, i % 1000, &LINUX);
                let a_pv = view(&got).local_comm_id().unwrap();
                let mut m = rep(n.b.cfg(bv), view(&got).tid(), b_sl, a_pv, n.b.qpn(bv, 1));
                assert_eq!(
                    n.b_to_a(bv, av, &mut m).1,
                    Some(WireVerdict::ToVm(n.a.id(av)))
                );
            }
            _ => {
                // Lost RTU, then the active side disconnects; the passive host answers.
                let got = n.send_req(av, bv, a_sl, i % 1000, &LINUX);
                let a_pv = view(&got).local_comm_id().unwrap();
                let mut m = rep(n.b.cfg(bv), view(&got).tid(), b_sl, a_pv, n.b.qpn(bv, 1));
                let v = n.b_to_a(bv, av, &mut m);
                assert_eq!(v.1, Some(WireVerdict::ToVm(n.a.id(av))), "cycle {i}: {v:?}");
                let b_pv = view(&m).local_comm_id().unwrap();
                let mut m = ids(AttributeId::Rtu, 1, a_sl, b_pv);
                assert_eq!(
                    n.a.mux.from_guest(n.a.id(av), &mut m, n.b.gid(bv)),
                    GuestVerdict::ToWire
                );
                let mut m = dreq(2, a_sl, b_pv, 0);
                let _ = n.a_to_b(av, bv, &mut m);
            }
        }
        if i % 64 == 0 {
            n.advance(Duration::from_millis(64));
        }
    }
    n.quiesce();
    (n.live(), n.quarantined())
}

#[test]
fn churn_leaves_no_entry_behind() {
    // 1 M cycles (seed 003 scale); PVCM_CHURN_CYCLES overrides.
    let cycles = std::env::var("PVCM_CHURN_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000_000);
    assert_eq!(churn(Policy::Default, cycles), ((0, 0), (0, 0)));
    let ((a, b), _) = churn(Policy::Mlx4Post2020, 8_000);
    assert!(a + b >= 2_000, "mlx4 leaks abandoned handshakes: {a} + {b}");
}

#[test]
fn mra_for_a_lap_leaves_an_established_connection_without_deadline() {
    let mut n = net2(Policy::Default);
    let c = n.connect(0, 0, 1, 2, 0);
    let mut m = mra(5, 2, c.a_pv, MsgResponse::Other, 20);
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let mut m = mra(5, 1, c.b_pv, MsgResponse::Other, 20);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    n.quiesce();
    assert_eq!(n.a.mux.lookup(c.a_pv).unwrap().0, State::Established);
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::Established);
}

#[test]
fn batch_entry_points_match_single_calls() {
    // Two identical worlds (same seeds, same history): one takes MADs one by one, the
    // other in batches; verdicts and rewritten bytes must be the same.
    let mut one = net2(Policy::Default);
    let mut two = net2(Policy::Default);
    let conns: Vec<Conn> = (0..64)
        .map(|i| one.connect(0, 0, i + 1, i + 1, i))
        .collect();
    for i in 0..64 {
        two.connect(0, 0, i + 1, i + 1, i);
    }
    // Guest -> wire: LAPs (and one for an unknown comm ID).
    let mut mads: Vec<Mad> = conns
        .iter()
        .map(|c| ids(AttributeId::Lap, 7, c.a_sl, c.b_pv))
        .chain([ids(AttributeId::Lap, 7, 9999, 1)])
        .collect();
    let dsts = vec![one.b.gid(0); mads.len()];
    let mut singles = mads.clone();
    let single_v: Vec<GuestVerdict> = singles
        .iter_mut()
        .map(|m| one.a.mux.from_guest(one.a.id(0), m, dsts[0]))
        .collect();
    let mut batch_v = vec![GuestVerdict::ToWire; mads.len()];
    two.a
        .mux
        .from_guest_batch(two.a.id(0), &mut mads, |i, _| dsts[i], &mut batch_v);
    assert_eq!(single_v, batch_v);
    assert_eq!(singles, mads);
    // Wire -> guest: APRs (and garbage).
    let mut mads: Vec<Mad> = conns
        .iter()
        .map(|c| ids(AttributeId::Apr, 7, c.b_sl, c.a_pv))
        .chain([[0u8; 256]])
        .collect();
    let addrs = vec![(one.b.gid(0), one.a.gid(0)); mads.len()];
    let mut singles = mads.clone();
    let single_v: Vec<WireVerdict> = singles
        .iter_mut()
        .map(|m| one.a.mux.from_wire(m, addrs[0].0, addrs[0].1))
        .collect();
    let mut batch_v = vec![WireVerdict::Reply; mads.len()];
    two.a
        .mux
        .from_wire_batch(&mut mads, |i, _| addrs[i], &mut batch_v);
    assert_eq!(single_v, batch_v);
    assert_eq!(singles, mads);
    assert_eq!(
        *batch_v.last().unwrap(),
        WireVerdict::Drop(DropReason::Malformed)
    );
}

/// A SIDR_REQ whose (peer, request ID) was last delivered to another VM releases the
/// peer's reference once: released twice, the peer's reference count would fall below
/// the entries that name it, its index would go to the free list while an entry still
/// named it, and the next new peer would take that index over (the entry then naming the
/// wrong GID). A restored table counts the references afresh, so it must agree (the mux
/// fuzz target's restart check reaches this input).
#[test]
fn a_sidr_req_repeated_to_another_vm_keeps_the_peer_referenced() {
    let mut n = net2(Policy::Default);
    let src = n.a.gid(0);
    for (from, vm) in [(src, 0), (src, 1), (src, 0), (src, 1), (n.a.gid(1), 0)] {
        let mut m = ids(AttributeId::SidrReq, 0x51D, 0, 0);
        f::SIDR_REQUEST_ID.set(&mut m, 9);
        assert_eq!(
            n.b.mux.from_wire(&mut m, from, n.b.gid(vm)),
            WireVerdict::ToVm(n.b.id(vm))
        );
    }
    let mut j = Vec::new();
    n.b.mux.journal_snapshot(&mut j);
    let recs: Vec<_> = records(&j).collect::<Result<_, _>>().unwrap();
    let r = Mux::restore(n.b.mux.config().clone(), ManualClock::new(), recs).unwrap();
    n.b.mux.same_state_as(&r.mux).unwrap();
}

#[test]
fn a_quota_lowered_below_use_keeps_the_connections_and_refuses_new_ones() {
    let mut n = Net::new(Policy::Default);
    let cfg = VmConfig::new("a", gid(1, 1));
    n.a.vms.push((n.a.mux.attach_vm(cfg.clone()).unwrap(), cfg));
    n.b.add_vm("b0", gid(2, 1));
    let send = |n: &mut Net, i: u32| {
        let mut m = req(
            n.a.cfg(0),
            100 + i,
            0xF00 + u64::from(i),
            n.b.gid(0),
            n.a.qpn(0, i),
            &LINUX,
        );
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0))
    };
    for i in 0..4 {
        assert_eq!(send(&mut n, i), GuestVerdict::ToWire);
    }
    let a = n.a.id(0);
    assert_eq!(n.a.mux.set_quota(a, Some(2)), Ok(4), "4 live entries held");
    assert_eq!(n.a.mux.vm_stats(a).live, 4, "the connections stay");
    assert_eq!(send(&mut n, 4), GuestVerdict::Reply, "REJ(NO_RESOURCES)");
    assert_eq!(n.a.mux.set_quota(a, None), Ok(4), "back to the default");
    assert_eq!(send(&mut n, 5), GuestVerdict::ToWire);
    // An ID range holds a quota twice over, or the quota is refused.
    let mut r = VmConfig::new("r", gid(1, 2));
    r.id_range = Some("0x80000000/24".parse().unwrap());
    r.quota = Some(100);
    let rid = n.a.mux.attach_vm(r).unwrap();
    assert!(n.a.mux.set_quota(rid, Some(129)).is_err());
    assert_eq!(n.a.mux.set_quota(rid, Some(128)), Ok(0));
}

/// A REP retry after the active VM's RTU (lost on the wire) gets that RTU again from
/// the mux, as `cm_dup_rep_handler()` answers it: the passive side establishes without
/// waiting for the VM's CM, which may be gone. Returns A's verdict on the retry.
fn rep_retry_after_rtu(policy: Policy) -> (WireVerdict, Net, Mad, u32, u32) {
    let mut n = net2(policy);
    let got = n.send_req(0, 0, 4, 0, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let rep_tid = view(&got).tid();
    let mut m = rep(n.b.cfg(0), rep_tid, 8, a_pv, n.b.qpn(0, 0));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_pv = view(&m).local_comm_id().unwrap();
    let mut m = ids(AttributeId::Rtu, view(&m).tid(), 4, b_pv);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    // (the RTU is lost) B's CM retries its REP.
    let mut m = rep(n.b.cfg(0), rep_tid, 8, a_pv, n.b.qpn(0, 0));
    let (v, w) = n.b_to_a(0, 0, &mut m);
    assert_eq!(v, GuestVerdict::ToWire);
    (w.unwrap(), n, m, a_pv, b_pv)
}

/// The passive VM's REP retry crosses the active side's RTU, which the passive host's
/// mux has already passed (the VM's CM had queued the retry before it read the RTU):
/// the retry goes on, counted as a retry, and the active host's mux answers it with the
/// RTU again; nothing is dropped.
#[test]
fn a_rep_retry_crossing_the_rtu_goes_on_and_is_answered() {
    let mut n = net2(Policy::Default);
    let got = n.send_req(0, 0, 4, 0, &LINUX);
    let a_pv = view(&got).local_comm_id().unwrap();
    let rep_tid = view(&got).tid();
    let mut m = rep(n.b.cfg(0), rep_tid, 8, a_pv, n.b.qpn(0, 0));
    assert_eq!(n.b_to_a(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.a.id(0))));
    let b_pv = view(&m).local_comm_id().unwrap();
    let mut m = ids(AttributeId::Rtu, view(&m).tid(), 4, b_pv);
    assert_eq!(n.a_to_b(0, 0, &mut m).1, Some(WireVerdict::ToVm(n.b.id(0))));
    assert_eq!(n.b.mux.lookup(b_pv).unwrap().0, State::Established);
    let mut m = rep(n.b.cfg(0), rep_tid, 8, a_pv, n.b.qpn(0, 0));
    let (v, w) = n.b_to_a(0, 0, &mut m);
    assert_eq!(v, GuestVerdict::ToWire);
    assert_eq!(w, Some(WireVerdict::Reply));
    assert_eq!(view(&m).attr(), AttributeId::Rtu);
    let b = n.b.mux.vm_stats(n.b.id(0));
    assert_eq!(b.counters.get(Group::TxRetries, AttributeId::Rep), 1);
    assert_eq!(n.a.mux.host_stats().drops.total(), 0);
    assert_eq!(n.b.mux.host_stats().drops.total(), 0);
}

#[test]
fn rep_retry_after_the_rtu_gets_the_rtu_again() {
    let (v, mut n, mut m, a_pv, b_pv) = rep_retry_after_rtu(Policy::Default);
    assert_eq!(v, WireVerdict::Reply);
    let r = view(&m);
    assert_eq!(r.attr(), AttributeId::Rtu);
    assert_eq!(
        (r.local_comm_id(), r.remote_comm_id()),
        (Some(a_pv), Some(b_pv))
    );
    let host_req_tid = r.tid();
    assert_ne!(
        host_req_tid >> 32,
        0xAAAA_0000,
        "the host REQ TID, not the VM's"
    );
    // The answer reaches B's VM as its RTU: established.
    assert_eq!(
        n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
        WireVerdict::ToVm(n.b.id(0))
    );
    assert_eq!(n.b.mux.lookup(b_pv).unwrap().0, State::Established);
    let a = n.a.mux.vm_stats(n.a.id(0));
    assert_eq!(a.on_behalf, 1);
    assert_eq!(a.counters.get(Group::RxDuplicates, AttributeId::Rep), 1);
    assert_eq!(a.counters.get(Group::TxRetries, AttributeId::Rtu), 1);
    assert_eq!(a.drops.total(), 0);
    // mlx4 hands the retry to the VM, whose CM has to answer it.
    let (v, n, ..) = rep_retry_after_rtu(Policy::Mlx4Post2020);
    assert_eq!(v, WireVerdict::ToVm(n.a.id(0)));
}

#[test]
fn detached_vm_answers_a_crossing_dreq_and_stops_its_own() {
    let mut n = net2(Policy::Default);
    let c = n.connect(0, 0, 1, 2, 0);
    n.b.mux.detach_vm(n.b.id(0));
    let out: Vec<_> = n.b.mux.drain_outbox().collect();
    assert_eq!(out.len(), 1, "one DREQ on the VM's behalf");
    // A's VM disconnects at the same moment: its DREQ crosses B's.
    let mut m = dreq(0xD1, c.a_sl, c.b_pv, c.b_qpn);
    assert_eq!(
        n.a.mux.from_guest(n.a.id(0), &mut m, n.b.gid(0)),
        GuestVerdict::ToWire
    );
    assert_eq!(
        n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
        WireVerdict::Reply
    );
    assert_eq!(view(&m).attr(), AttributeId::Drep);
    assert_eq!(view(&m).local_comm_id(), Some(c.b_pv));
    assert_eq!(n.b.mux.lookup(c.b_pv).unwrap().0, State::TimeWait);
    // The DREP answers A's DREQ (A's VM gets it with its own TID back).
    assert_eq!(
        n.a.mux.from_wire(&mut m, n.b.gid(0), n.a.gid(0)),
        WireVerdict::ToVm(n.a.id(0))
    );
    assert_eq!(view(&m).tid(), 0xD1);
    // B retries no DREQ now: the peer has answered.
    for _ in 0..10 {
        n.advance(S(1));
        assert_eq!(n.b.mux.drain_outbox().count(), 0);
    }
    assert_eq!(n.b.mux.host_stats().on_behalf, 2, "the DREQ and the DREP");
    n.quiesce();
    assert_eq!(n.live(), (0, 0));
}

#[test]
fn req_retry_for_a_detached_vms_half_open_connection_gets_its_rej_again() {
    for replied in [false, true] {
        let mut n = net2(Policy::Default);
        let got = n.send_req(0, 0, 3, 0, &LINUX);
        let a_pv = view(&got).local_comm_id().unwrap();
        if replied {
            // B's VM sent its REP, which the wire lost.
            let mut m = rep(n.b.cfg(0), view(&got).tid(), 8, a_pv, n.b.qpn(0, 0));
            assert_eq!(
                n.b.mux.from_guest(n.b.id(0), &mut m, n.a.gid(0)),
                GuestVerdict::ToWire
            );
        }
        n.b.mux.detach_vm(n.b.id(0));
        let out: Vec<_> = n.b.mux.drain_outbox().collect();
        assert_eq!(out.len(), 1);
        let first = view(&out[0].mad);
        assert_eq!(first.attr(), AttributeId::Rej);
        let b_pv = first.local_comm_id().unwrap();
        // The VM comes back (a reset): a new session under the same GID.
        let cfg = n.b.cfg(0).clone();
        n.b.vms[0].0 = n.b.mux.attach_vm(cfg).unwrap();
        // That REJ was lost: A's CM retries its REQ, which gets the REJ again, and the
        // new session never sees the old REQ.
        let mut m = req(
            n.a.cfg(0),
            3,
            0xAAAA_0000_0000_0003,
            n.b.gid(0),
            n.a.qpn(0, 0),
            &LINUX,
        );
        let (v, w) = n.a_to_b(0, 0, &mut m);
        assert_eq!(v, GuestVerdict::ToWire);
        assert_eq!(w, Some(WireVerdict::Reply), "replied: {replied}");
        let r = view(&m);
        assert_eq!(r.attr(), AttributeId::Rej);
        assert_eq!(
            (r.local_comm_id(), r.remote_comm_id()),
            (Some(b_pv), Some(a_pv))
        );
        assert_eq!(r.rej_reason(), Some(RejReason::ConsumerDefined.code()));
        // A's VM gets the REJ: its connection ends.
        assert_eq!(
            n.a.mux.from_wire(&mut m, n.b.gid(0), n.a.gid(0)),
            WireVerdict::ToVm(n.a.id(0))
        );
        // The new session's connections meet nothing of the old ones, its same comm
        // ID included (A takes a new one: its own 3 is quarantined after the REJ).
        let c = n.connect(0, 0, 5, 8, 0);
        assert_ne!(c.b_pv, b_pv);
        n.disconnect_from_a(&c);
        let b = n.b.mux.host_stats();
        assert_eq!(b.on_behalf, 2, "the REJ and its re-send");
        assert_eq!(b.drops.total(), 0);
        n.quiesce();
        assert_eq!(n.live(), (0, 0), "replied: {replied}");
    }
}

#[test]
fn a_program_gone_without_a_reset_still_gets_its_peers_drep() {
    // The VM stays attached, but nothing in it answers any more (the program that owned
    // the device was killed): the retry is answered by the mux, not queued for it.
    let mut n = net2(Policy::Default);
    let c = n.connect(0, 0, 1, 2, 0);
    n.disconnect_from_a(&c);
    for k in 0..15u64 {
        n.advance(Duration::from_millis(300));
        let mut m = dreq(0xD, 1, c.b_pv, c.b_qpn);
        assert_eq!(
            n.b.mux.from_wire(&mut m, n.a.gid(0), n.b.gid(0)),
            WireVerdict::Reply,
            "retry {k}"
        );
    }
    let b = n.b.mux.vm_stats(n.b.id(0));
    assert_eq!(b.on_behalf, 15);
    assert_eq!(b.counters.get(Group::RxDuplicates, AttributeId::Dreq), 15);
    assert_eq!(b.counters.get(Group::TxRetries, AttributeId::Drep), 15);
    n.quiesce();
    assert_eq!(n.live(), (0, 0));
}

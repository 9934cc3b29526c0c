//! Per-destination pacing of REQs and DREQs (the agent's congestion window), against
//! scripted peers in virtual time: never more than the window outstanding, growth with
//! answers, halving on timeouts, separate windows per destination, order kept, queued
//! requests cancelled by destroy with no wire traffic, timers of queued requests idle.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use std::collections::{HashMap, VecDeque};

use pvcm_guest::cm::{Agent, CmId, ConnectOptions, Event, Group, OutMad, Pacing, State};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;
use pvcm_wire::cm::CmRepr;
use pvcm_wire::mad::AttributeId;
use support::*;

/// 2 x ms(16) + ms(20).
const ACTIVE_TIMEOUT: u64 = 4608;

fn pacing() -> Pacing {
    Pacing::default()
}

/// A REQ the agent sent: (TID, local comm ID, local QPN).
fn as_req(m: &OutMad) -> Option<(u64, u32, u32)> {
    match CmRepr::parse(&m.mad) {
        Ok((h, CmRepr::Req(r))) => Some((h.tid, r.local_comm_id, r.local_qpn)),
        _ => None,
    }
}

/// A DREQ the agent sent: (TID, local comm ID, remote comm ID).
fn as_dreq(m: &OutMad) -> Option<(u64, u32, u32)> {
    match CmRepr::parse(&m.mad) {
        Ok((h, CmRepr::Dreq(r))) => Some((h.tid, r.local_comm_id, r.remote_comm_id)),
        _ => None,
    }
}

/// The peer's REP for a REQ: peer comm ID derived from ours.
fn rep_for(tid: u64, local: u32, qpn: u32) -> [u8; pvcm_wire::mad::MAD_LEN] {
    rep_mad(
        tid,
        peer_rep(local ^ 0x5A5A_0000, local, 0x40_0000 | (qpn & 0xFFFF)),
    )
}

fn n_connects(a: &mut Agent, dst: Gid, n: usize, now: Time) -> Vec<CmId> {
    (0..n)
        .map(|_| {
            a.connect(dst, SID, &[], &ConnectOptions::default(), now)
                .unwrap()
        })
        .collect()
}

#[test]
fn a_thousand_connects_to_one_peer_never_exceed_the_window() {
    // The window's mechanism at a cap the 1,000 connects reach (the default cap is
    // higher than 1,000 answers of slow start take it).
    let mut c = config();
    c.pacing = Some(Pacing {
        max_window: 256,
        slow_start: 256,
        ..pacing()
    });
    let mut a = Agent::new(c);
    let ids = n_connects(&mut a, peer_gid(), 1000, ms(0));
    let order: Vec<u32> = ids
        .iter()
        .map(|id| a.info(*id).unwrap().local_comm_id)
        .collect();
    // The peer answers some of what is outstanding each round (oldest first, up to 40).
    let mut outstanding: VecDeque<(u64, u32, u32)> = VecDeque::new();
    let mut sent_order = Vec::new();
    let mut established = 0;
    let mut max_seen = 0;
    let mut t = 0;
    let mut windows = Vec::new();
    for round in 0..10_000 {
        for m in take(&mut a) {
            if let Some(r) = as_req(&m) {
                outstanding.push_back(r);
                sent_order.push(r.1);
            }
        }
        let w = a.window(peer_gid());
        let cap = w.map_or(0, |w| w.window) as usize;
        // The wire's view: REQs sent and not answered never exceed the window.
        assert!(
            outstanding.len() <= cap.max(1),
            "round {round}: {} outstanding, window {cap}",
            outstanding.len()
        );
        assert!(cap <= 256, "window {cap} beyond max_window");
        if let Some(w) = w {
            assert_eq!(w.outstanding as usize, outstanding.len());
            windows.push(w.window);
        }
        max_seen = max_seen.max(outstanding.len());
        if outstanding.is_empty() {
            break;
        }
        t += 1;
        for _ in 0..outstanding.len().min(40) {
            let (tid, local, qpn) = outstanding.pop_front().unwrap();
            a.handle_mad(&rep_for(tid, local, qpn), peer_gid(), ms(t));
        }
        established += events(&mut a)
            .iter()
            .filter(|e| matches!(e, Event::Established { .. }))
            .count();
    }
    assert_eq!(established, 1000);
    // Sent in the order of the connect() calls, every one of them.
    assert_eq!(sent_order, order);
    // It started at 32 and grew (slow start) to the cap.
    assert_eq!(windows[0], 32);
    assert_eq!(*windows.iter().max().unwrap(), 256);
    assert_eq!(max_seen, 256);
    let p = a.pacing();
    assert_eq!((p.sent, p.answered, p.cancelled), (1000, 1000, 0));
    assert_eq!(p.waited, 1000 - 32);
    assert_eq!(
        (p.max_outstanding, p.max_window, p.decreases),
        (256, 256, 0)
    );
    assert_eq!(p.max_queued, 1000 - 32);
    assert_eq!((p.outstanding, p.queued, p.destinations), (0, 0, 0));
    assert_eq!(a.counters().total(Group::TxRetries), 0);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Req), 1000);
}

#[test]
fn queued_reqs_run_no_timers_until_they_are_sent() {
    let mut a = agent();
    let ids = n_connects(&mut a, peer_gid(), 40, ms(0));
    let out = take(&mut a);
    assert_eq!(out.len(), 32, "the initial window");
    // Queued ones are REQ_SENT for the application, but no timer runs for them.
    let last = a.info(ids[39]).unwrap();
    assert_eq!(last.state, State::ReqSent);
    assert_eq!(last.deadline, Time::NEVER);
    assert_eq!(a.timers_armed(), 32);
    assert_eq!(
        a.window(peer_gid())
            .map(|w| (w.window, w.outstanding, w.queued)),
        Some((32, 32, 8))
    );
    // One answer at 1000 ms: slow start opens two slots, two queued REQs go out then,
    // their timers from 1000 ms.
    let (tid, local, qpn) = as_req(&out[0]).unwrap();
    a.handle_mad(&rep_for(tid, local, qpn), peer_gid(), ms(1000));
    let sent: Vec<_> = take(&mut a).iter().filter_map(as_req).collect();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[0].1, a.info(ids[32]).unwrap().local_comm_id);
    assert_eq!(a.info(ids[32]).unwrap().deadline, ms(1000 + ACTIVE_TIMEOUT));
    assert_eq!(a.info(ids[34]).unwrap().deadline, Time::NEVER);
}

#[test]
fn a_timeout_halves_the_window_once_per_window_and_answers_grow_it() {
    let mut a = agent();
    let opts = ConnectOptions {
        max_cm_retries: 5,
        ..ConnectOptions::default()
    };
    let ids: Vec<CmId> = (0..300)
        .map(|_| a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap())
        .collect();
    let first: Vec<_> = take(&mut a).iter().filter_map(as_req).collect();
    assert_eq!(first.len(), 32);
    // The peer is overrun: nothing comes back. All 32 time out together; the window
    // halves once (not 32 times), the 32 retries still go out (they hold their slots).
    let (out, _) = poll_at(&mut a, ms(ACTIVE_TIMEOUT));
    assert_eq!(out.len(), 32);
    assert!(out.iter().all(|m| as_req(m).is_some()));
    let w = a.window(peer_gid()).unwrap();
    assert_eq!((w.window, w.outstanding, w.queued), (16, 32, 268));
    assert_eq!(a.pacing().decreases, 1);
    // Their next timeout (sent after the decrease): halves again, once.
    let (out, _) = poll_at(&mut a, ms(2 * ACTIVE_TIMEOUT));
    assert_eq!(out.len(), 32);
    assert_eq!(a.window(peer_gid()).unwrap().window, 8);
    assert_eq!(a.pacing().decreases, 2);
    // The peer recovers and answers the 32: the window grows from 8 again (slow start up
    // to the threshold 8, then additively), and queued REQs go out as slots free up.
    for (tid, local, qpn) in &first {
        a.handle_mad(
            &rep_for(*tid, *local, *qpn),
            peer_gid(),
            ms(2 * ACTIVE_TIMEOUT + 1),
        );
    }
    let w = a.window(peer_gid()).unwrap();
    assert!(w.window > 8, "{w:?}");
    assert_eq!(w.outstanding, w.window.min(268));
    let sent: Vec<_> = take(&mut a).iter().filter_map(as_req).collect();
    assert_eq!(sent.len() as u32, w.outstanding);
    assert_eq!(
        sent[0].1,
        a.info(ids[32]).unwrap().local_comm_id,
        "in order"
    );
    // Never below min_window.
    let mut b = agent();
    n_connects(&mut b, peer_gid(), 64, ms(0));
    take(&mut b);
    for k in 1..=10 {
        b.poll(ms(k * ACTIVE_TIMEOUT));
    }
    assert_eq!(b.window(peer_gid()).unwrap().window, pacing().min_window);
}

#[test]
fn separate_destinations_have_separate_windows() {
    let (p1, p2) = (gid(2), gid(3));
    let mut a = agent();
    n_connects(&mut a, p1, 100, ms(0));
    n_connects(&mut a, p2, 100, ms(0));
    let out = take(&mut a);
    let to = |g: Gid| out.iter().filter(|m| m.dst == g).count();
    assert_eq!((to(p1), to(p2)), (32, 32));
    // p1 is dead: its timeout halves only its window.
    let to_p2: Vec<_> = out
        .iter()
        .filter(|m| m.dst == p2)
        .filter_map(as_req)
        .collect();
    for (tid, local, qpn) in &to_p2 {
        a.handle_mad(&rep_for(*tid, *local, *qpn), p2, ms(10));
    }
    a.poll(ms(ACTIVE_TIMEOUT));
    let (w1, w2) = (a.window(p1).unwrap(), a.window(p2).unwrap());
    assert_eq!(w1.window, 16);
    assert_eq!(w2.window, 64, "slow start: 32 + 32 answers");
    assert_eq!((w1.outstanding, w1.queued), (32, 68));
    assert_eq!((w2.outstanding, w2.queued), (64, 4));
    assert_eq!(a.pacing().destinations, 2);
}

#[test]
fn destroying_a_queued_connect_sends_nothing_and_keeps_the_rest_in_order() {
    let mut a = agent();
    let ids = n_connects(&mut a, peer_gid(), 40, ms(0));
    let out: Vec<_> = take(&mut a).iter().filter_map(as_req).collect();
    assert_eq!(out.len(), 32);
    let gone = a.info(ids[35]).unwrap().local_comm_id;
    a.destroy(ids[35], ms(1)).unwrap();
    assert!(take(&mut a).is_empty(), "no REQ, no REJ(TIMEOUT)");
    assert_eq!(a.state(ids[35]), None);
    assert_eq!(a.window(peer_gid()).unwrap().queued, 7);
    // Answers release the rest, in order, without the destroyed one.
    for (tid, local, qpn) in &out {
        a.handle_mad(&rep_for(*tid, *local, *qpn), peer_gid(), ms(2));
    }
    let rest: Vec<u32> = take(&mut a)
        .iter()
        .filter_map(as_req)
        .map(|r| r.1)
        .collect();
    let want: Vec<u32> = (32..40)
        .filter(|k| *k != 35)
        .map(|k| a.info(ids[k]).unwrap().local_comm_id)
        .collect();
    assert_eq!(rest, want);
    assert!(!rest.contains(&gone));
    assert_eq!(a.pacing().cancelled, 1);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Rej), 0);
    // Destroying an outstanding one still sends REJ(TIMEOUT) and frees its slot.
    a.destroy(ids[36], ms(3)).unwrap();
    let m = one(&mut a);
    assert!(matches!(parse(&m).1, CmRepr::Rej(_)));
}

/// Establishes `n` connections to the scripted peer through the window.
fn establish_many(a: &mut Agent, n: usize) -> (Vec<CmId>, HashMap<u32, (u32, u32)>) {
    let ids = n_connects(a, peer_gid(), n, ms(0));
    // local comm ID -> (peer comm ID, local QPN)
    let mut peer = HashMap::new();
    loop {
        let reqs: Vec<_> = take(a).iter().filter_map(as_req).collect();
        if reqs.is_empty() {
            break;
        }
        for (tid, local, qpn) in reqs {
            peer.insert(local, (local ^ 0x5A5A_0000, qpn));
            a.handle_mad(&rep_for(tid, local, qpn), peer_gid(), ms(1));
        }
    }
    let est = events(a)
        .iter()
        .filter(|e| matches!(e, Event::Established { .. }))
        .count();
    assert_eq!(est, n);
    (ids, peer)
}

#[test]
fn a_burst_of_disconnects_is_paced_too() {
    let mut a = agent();
    let (ids, peer) = establish_many(&mut a, 1000);
    assert!(
        a.window(peer_gid()).is_none(),
        "idle destinations are forgotten"
    );
    for id in &ids {
        a.disconnect(*id, ms(10)).unwrap();
    }
    let mut outstanding: VecDeque<(u64, u32, u32)> = VecDeque::new();
    let mut disconnected = 0;
    let mut t = 10;
    loop {
        for m in take(&mut a) {
            if let Some(d) = as_dreq(&m) {
                outstanding.push_back(d);
            }
        }
        let cap = a.window(peer_gid()).map_or(0, |w| w.window) as usize;
        assert!(
            outstanding.len() <= cap.max(1),
            "{} > {cap}",
            outstanding.len()
        );
        if outstanding.is_empty() {
            break;
        }
        t += 1;
        for _ in 0..outstanding.len().min(50) {
            let (tid, local, remote) = outstanding.pop_front().unwrap();
            a.handle_mad(&drep_mad(tid, remote, local), peer_gid(), ms(t));
        }
        disconnected += events(&mut a)
            .iter()
            .filter(|e| matches!(e, Event::Disconnected { .. }))
            .count();
    }
    assert_eq!(disconnected, 1000);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Dreq), 1000);
    assert!(a.pacing().max_queued > 0);
    let _ = peer;
}

#[test]
fn destroying_established_connections_paces_their_one_dreq_and_timewait_follows_it() {
    let mut a = agent();
    let (ids, _) = establish_many(&mut a, 100);
    for id in &ids {
        a.destroy(*id, ms(10)).unwrap();
    }
    let dreqs: Vec<_> = take(&mut a).iter().filter_map(as_dreq).collect();
    assert_eq!(dreqs.len(), 32, "one window of DREQs");
    assert_eq!(
        a.timers_armed(),
        32,
        "TimeWait runs only where the DREQ left"
    );
    // TimeWait (512 ms) ends for the 32 sent: their slots free without an answer, and
    // the queued DREQs go out in turn; nothing is dropped.
    let mut total = dreqs.len();
    let mut t = 10;
    while total < 100 {
        t += 512;
        a.poll(ms(t));
        let n = take(&mut a).iter().filter_map(as_dreq).count();
        assert!(n > 0, "stalled at {total}");
        total += n;
    }
    assert_eq!(total, 100);
    t += 512;
    a.poll(ms(t));
    assert!(a.is_quiescent(), "{:?}", a.state_histogram());
}

#[test]
fn without_pacing_everything_goes_at_once() {
    let mut c = config();
    c.pacing = None;
    let mut a = Agent::new(c);
    n_connects(&mut a, peer_gid(), 1000, ms(0));
    assert_eq!(take(&mut a).len(), 1000);
    assert!(a.window(peer_gid()).is_none());
    assert_eq!(a.pacing().sent, 0);
}

#[test]
fn a_dead_peer_fails_every_connect_after_its_own_full_retry_budget() {
    // 40 connects to nobody, 1 retry each: the first 32 give up at 2 x 4608 ms; their
    // slots free, the 8 queued go out then and give up 2 x 4608 ms later. Every connect
    // ends Unreachable; none is dropped.
    let mut a = agent();
    let opts = ConnectOptions {
        max_cm_retries: 1,
        ..ConnectOptions::default()
    };
    for _ in 0..40 {
        a.connect(peer_gid(), SID, &[], &opts, ms(0)).unwrap();
    }
    let mut unreachable = 0;
    let mut t = 0;
    while unreachable < 40 && t < 100_000 {
        t += 1;
        a.poll(ms(t));
        take(&mut a);
        unreachable += events(&mut a)
            .iter()
            .filter(|e| matches!(e, Event::Unreachable { .. }))
            .count();
    }
    assert_eq!(unreachable, 40);
    assert!(
        (4 * ACTIVE_TIMEOUT..4 * ACTIVE_TIMEOUT + 100).contains(&t),
        "{t}"
    );
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Req), 80);
}

/// A peer modelled on a Linux kernel CM over rdma_rxe, as measured against the real
/// one: QP1's receive queue holds 512 MADs and the MAD layer empties it quickly (here 16
/// a millisecond) into the CM's work queue, which the CM and its application serve one
/// REQ a millisecond. A burst that arrives faster than the receive queue empties loses
/// MADs (1,000 REQs at once: 488 lost, as the real peer lost them); REQs that wait in the
/// CM's queue are not lost, only late. It answers each REQ with a REP (again for a
/// retried one). Returns (ms until all established, MADs lost, REQ retries).
fn against_a_bounded_peer(pacing: Option<Pacing>, n: usize) -> (u64, u64, u64) {
    let mut c = config();
    c.pacing = pacing;
    let mut a = Agent::new(c);
    n_connects(&mut a, peer_gid(), n, ms(0));
    let mut rq: VecDeque<OutMad> = VecDeque::new();
    let mut cm_queue: VecDeque<OutMad> = VecDeque::new();
    let (mut lost, mut established) = (0u64, 0usize);
    let mut t = 0u64;
    while established < n {
        assert!(t < 600_000, "stuck at {established}");
        for m in take(&mut a) {
            if rq.len() < 512 {
                rq.push_back(m);
            } else {
                lost += 1;
            }
        }
        for _ in 0..16 {
            let Some(m) = rq.pop_front() else { break };
            cm_queue.push_back(m);
        }
        if let Some(m) = cm_queue.pop_front()
            && let Some((tid, local, qpn)) = as_req(&m)
        {
            a.handle_mad(&rep_for(tid, local, qpn), peer_gid(), ms(t));
        }
        t += 1;
        a.poll(ms(t));
        established += events(&mut a)
            .iter()
            .filter(|e| matches!(e, Event::Established { .. }))
            .count();
    }
    let retries = a.counters().get(Group::TxRetries, AttributeId::Req);
    (t, lost, retries)
}

#[test]
fn paced_connects_do_not_overrun_a_linux_peers_qp1_queue() {
    // The measured problem: 1000 REQs at once overrun the peer, and the lost ones wait
    // out a 4.6 s retry. Paced, nothing is lost or retried and it is over much sooner.
    // (This model: flood 5.1 s with 488 REQs lost and retried; paced 1.7 s.)
    let (t_flood, lost_flood, retries_flood) = against_a_bounded_peer(None, 1000);
    assert!(lost_flood > 0 && retries_flood > 0);
    assert!(t_flood > ACTIVE_TIMEOUT, "{t_flood}");
    let (t_paced, lost_paced, retries_paced) = against_a_bounded_peer(Some(pacing()), 1000);
    assert_eq!((lost_paced, retries_paced), (0, 0));
    assert!(
        t_paced < t_flood / 2,
        "paced {t_paced} ms, flood {t_flood} ms"
    );
}

/// A process dies with one REQ on the wire and others waiting for the window: destroying
/// them together sends the first's REJ(TIMEOUT) and nothing for the rest, where one by
/// one each destroy would let the next queued REQ out just before its own destroy.
#[test]
fn destroy_all_never_releases_a_queued_request_of_the_same_set() {
    let mut c = config();
    c.pacing = Some(Pacing {
        initial_window: 1,
        min_window: 1,
        ..pacing()
    });
    let mut a = Agent::new(c.clone());
    let ids = n_connects(&mut a, peer_gid(), 3, ms(0));
    let first = take(&mut a);
    assert_eq!(
        first.iter().filter_map(as_req).count(),
        1,
        "one REQ in the window"
    );
    a.destroy_all(&ids, ms(1));
    let after = take(&mut a);
    assert_eq!(
        after.iter().filter_map(as_req).count(),
        0,
        "no queued REQ went out"
    );
    assert_eq!(
        after.len(),
        1,
        "only the sent one's REJ(TIMEOUT): {after:?}"
    );
    assert_eq!(a.pacing().cancelled, 2);
    // The same handles destroyed one at a time: the next queued REQ leaves each time.
    let mut b = Agent::new(c);
    let ids = n_connects(&mut b, peer_gid(), 3, ms(0));
    take(&mut b);
    for id in &ids {
        b.destroy(*id, ms(1)).unwrap();
    }
    assert!(take(&mut b).iter().filter_map(as_req).count() > 0);
}

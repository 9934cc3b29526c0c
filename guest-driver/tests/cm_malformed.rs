//! Malformed MADs from the device: always a counted drop (or a well-formed answer),
//! never a panic, and never a leak.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use pvcm_guest::cm::{Agent, CmId, ConnectOptions, DropReason, Event, Group, SplitMix64};
use pvcm_guest::time::Time;
use pvcm_wire::cm::{CmRepr, MsgResponse, RejReason};
use pvcm_wire::mad::{AttributeId, MAD_LEN};
use support::*;

#[test]
fn random_bytes_are_counted_drops() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let mut rng = SplitMix64::new(1);
    const N: u64 = 50_000;
    for i in 0..N {
        let len = rng.below(400) as usize;
        let buf: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
        a.handle_mad(&buf, peer_gid(), ms(i));
    }
    assert_eq!(a.drops().total(), N);
    assert_eq!(a.drops().malformed(), N);
    assert!(a.drops().get(DropReason::Truncated) > 0);
    assert!(a.drops().get(DropReason::WrongClass) > 0);
    assert_eq!(a.counters().total(Group::RxMsgs), 0);
    assert!(take(&mut a).is_empty());
    assert!(events(&mut a).is_empty());
    assert!(a.is_quiescent());
}

#[test]
fn each_kind_of_malformation() {
    let mut a = agent();
    let good = req_mad(1, peer_req(0x10, 0x800));
    let mut check = |bytes: &[u8], reason: DropReason| {
        let before = a.drops().get(reason);
        a.handle_mad(bytes, peer_gid(), Time::ZERO);
        assert_eq!(a.drops().get(reason), before + 1, "{reason:?}");
        assert!(take(&mut a).is_empty());
    };
    check(&[], DropReason::Truncated);
    check(&good[..255], DropReason::Truncated);
    check(&good[..24], DropReason::Truncated);
    let mut b = good;
    b[0] = 2;
    check(&b, DropReason::WrongClass);
    let mut b = good;
    b[1] = 0x03;
    check(&b, DropReason::WrongClass);
    let mut b = good;
    b[2] = 1;
    check(&b, DropReason::WrongClass);
    let mut b = good;
    b[17] = 0x1B;
    check(&b, DropReason::UnknownAttribute);
    let mut b = good;
    b[3] = 0x01; // GET for a REQ
    check(&b, DropReason::WrongMethod);
    // A REQ with a reserved transport type.
    let mut b = good;
    b[67] |= 0x06;
    b[75] = (b[75] & !0x07) | 0x02;
    check(&b, DropReason::Malformed);
    // A REJ with a reason the specification does not define.
    let mut rej = rej_mad(1, 1, 2, MsgResponse::Req, RejReason::Timeout, &[], &[]);
    rej[34] = 0;
    rej[35] = 34;
    check(&rej, DropReason::Malformed);
    // An ARI length beyond the field.
    let mut rej = rej_mad(1, 1, 2, MsgResponse::Req, RejReason::Timeout, &[], &[]);
    rej[33] = 73 << 1;
    check(&rej, DropReason::Malformed);
    // Headers that parsed were counted as received, like Linux's cm_rx_msgs.
    assert_eq!(a.counters().get(Group::RxMsgs, AttributeId::Req), 1);
    assert_eq!(a.counters().get(Group::RxMsgs, AttributeId::Rej), 2);
    // A longer buffer (an rx buffer with room to spare) is cut to the MAD.
    let mut long = good.to_vec();
    long.extend_from_slice(&[0xEE; 48]);
    a.handle_mad(&long, peer_gid(), Time::ZERO);
    let m = one(&mut a);
    assert!(matches!(parse(&m).1, CmRepr::Rej(_)), "no listener: REJ");
}

/// Valid MADs of a whole exchange, then each with a few random bytes flipped, fed to
/// agents in the middle of their own connections. Whatever parses is handled; at the end
/// the application destroys what it holds and, once the timers ran out, nothing is left.
#[test]
fn mutated_mads_never_panic_or_leak() {
    let corpus = exchange_corpus();
    assert!(corpus.len() > 20);
    let mut rng = SplitMix64::new(99);
    for round in 0..40u64 {
        let mut a = agent();
        a.listen(SID).unwrap();
        let mut held: Vec<CmId> = Vec::new();
        let mut now = Time::ZERO;
        // Some live state for the garbage to hit.
        for k in 0..3 {
            held.push(
                a.connect(peer_gid(), SID, &[k], &ConnectOptions::default(), now)
                    .unwrap(),
            );
        }
        take(&mut a);
        for _ in 0..2000 {
            let mut m = corpus[rng.below(corpus.len() as u64) as usize];
            for _ in 0..1 + rng.below(4) {
                let at = if rng.below(2) == 0 {
                    24 + rng.below(40) as usize
                } else {
                    rng.below(MAD_LEN as u64) as usize
                };
                m[at] = rng.next_u64() as u8;
            }
            // Now and then a field that makes the MAD match our connections.
            if rng.below(4) == 0
                && let Some(id) = held.first()
                && let Some(info) = a.info(*id)
            {
                m[28..32].copy_from_slice(&info.local_comm_id.to_be_bytes());
            }
            let src = if rng.below(8) == 0 {
                gid(3)
            } else {
                peer_gid()
            };
            a.handle_mad(&m, src, now);
            now = now.after_ms(rng.below(50));
            take(&mut a);
            drain(&mut a, &mut held, now);
        }
        // Give every timer its time, destroying whatever the application still holds.
        for id in std::mem::take(&mut held) {
            let _ = a.destroy(id, now);
        }
        let mut guard = 0;
        while let Some(t) = a.next_deadline() {
            guard += 1;
            assert!(guard < 100_000, "round {round}: timers never end");
            now = t;
            a.poll(now);
            take(&mut a);
            drain(&mut a, &mut held, now);
            for id in std::mem::take(&mut held) {
                let _ = a.destroy(id, now);
            }
        }
        take(&mut a);
        assert!(
            a.is_quiescent(),
            "round {round}: left {:?}",
            a.state_histogram()
        );
        assert_eq!(a.listener_count(), 1);
    }
}

/// The application of the mutation test: keeps what it is given, destroys handles
/// whose connection is over.
fn drain(a: &mut Agent, held: &mut Vec<CmId>, now: Time) {
    while let Some(e) = a.pop_event() {
        match e {
            Event::ConnectRequest { id, .. } | Event::SidrRequest { id, .. } => held.push(id),
            Event::Rejected { id, .. }
            | Event::Unreachable { id }
            | Event::TimewaitExit { id }
            | Event::SidrResolved { id, .. } => {
                held.retain(|h| *h != id);
                a.destroy(id, now).unwrap();
            }
            Event::Established { .. }
            | Event::ConnectResponse { .. }
            | Event::Disconnected { .. } => {}
        }
    }
}

/// Every MAD two agents exchange over a few connections, a SIDR exchange, a LAP and a
/// ClassPortInfo query.
fn exchange_corpus() -> Vec<[u8; MAD_LEN]> {
    let mut p = Pair::new(5);
    let mut apps = [App::default(), App::default()];
    p.agents[1].listen(SID).unwrap();
    let mut corpus = Vec::new();
    let mut wire = Vec::new();
    let now = Time::ZERO;
    let mut run = |p: &mut Pair, apps: &mut [App; 2], corpus: &mut Vec<[u8; MAD_LEN]>| loop {
        for (app, a) in apps.iter_mut().zip(p.agents.iter_mut()) {
            app.handle(a, now);
        }
        wire.clear();
        p.collect(&mut wire);
        if wire.is_empty() {
            break;
        }
        for (to, src, mad) in wire.drain(..) {
            corpus.push(mad);
            p.deliver(to, src, &mad, now);
        }
    };
    for plan in [
        PLAN_CLIENT_DISCONNECTS,
        PLAN_SERVER_DISCONNECTS,
        PLAN_REJECT,
    ] {
        let id = p.agents[0]
            .connect(p.gids[1], SID, &[plan], &ConnectOptions::default(), now)
            .unwrap();
        apps[0].held.insert(id);
        run(&mut p, &mut apps, &mut corpus);
        if p.agents[0].state(id) == Some(pvcm_guest::cm::State::Established) {
            p.agents[0].disconnect(id, now).unwrap();
            run(&mut p, &mut apps, &mut corpus);
        }
    }
    let id = p.agents[0]
        .connect(p.gids[1], SID, &[1], &ConnectOptions::default(), now)
        .unwrap();
    p.agents[0].destroy(id, now).unwrap();
    run(&mut p, &mut apps, &mut corpus);
    corpus.push(sidr_req_mad(1, 2, SID));
    corpus.push(sidr_rep_mad(1, 2, pvcm_wire::cm::SidrStatus::Success, 3, 4));
    corpus.push(lap_mad(1, 2, 3, 4));
    corpus.push(mra_mad(1, 2, 3, MsgResponse::Req, 20));
    corpus.push(mra_mad(1, 2, 3, MsgResponse::Rep, 20));
    corpus.push(class_port_info_get(1));
    corpus.push(dreq_mad(1, 2, 3, 4));
    corpus
}

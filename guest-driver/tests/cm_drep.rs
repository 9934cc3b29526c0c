//! The DREQ is answered at once (pvcm's default, unlike Linux): the DREP goes out before
//! the application hears of the disconnect, so an application that reacts late never
//! makes the peer retry its DREQ (seed 000's retry storm). `auto_drep: false` keeps
//! Linux's behaviour, where the DREP waits for the application's `disconnect()`.

#![allow(clippy::unwrap_used)]

#[path = "cm_support.rs"]
mod support;

use pvcm_guest::cm::{Agent, AgentConfig, CmId, Event, Group, State};
use pvcm_guest::time::Time;
use pvcm_wire::cm::CmRepr;
use pvcm_wire::mad::AttributeId;
use support::*;

const TIMEWAIT: u64 = 512;
/// How late the application reacts: more than one DREQ attempt (~6.1 s).
const LATE_MS: u64 = 8000;

#[test]
fn a_dreq_is_answered_at_once_and_a_later_disconnect_sends_nothing() {
    let mut a = agent();
    assert!(a.config().auto_drep, "the default");
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    let dreq = dreq_mad(0xD2, 0x55, local, qpn);
    a.handle_mad(&dreq, peer_gid(), ms(10));
    // The DREP is out before the application did anything.
    let m = one(&mut a);
    let (h, CmRepr::Drep(d)) = parse(&m) else {
        panic!("not a DREP")
    };
    assert_eq!(h.tid, 0xD2, "DREP echoes the DREQ's TID");
    assert_eq!((d.local_comm_id, d.remote_comm_id), (local, 0x55));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Drep), 1);

    // A duplicate DREQ (our DREP was lost) gets the same DREP again.
    a.handle_mad(&dreq, peer_gid(), ms(20));
    assert_eq!(one(&mut a).mad, m.mad);
    assert_eq!(a.counters().get(Group::RxDuplicates, AttributeId::Dreq), 1);
    assert_eq!(a.counters().get(Group::TxRetries, AttributeId::Drep), 1);

    // The application reacts: disconnect() succeeds and sends nothing.
    a.disconnect(id, ms(30)).unwrap();
    assert!(take(&mut a).is_empty(), "no second DREQ or DREP");
    assert_eq!(a.state(id), Some(State::Timewait));

    let (out, ev) = poll_at(&mut a, ms(10 + TIMEWAIT));
    assert!(out.is_empty());
    assert_eq!(ev, vec![Event::TimewaitExit { id }]);
    // Even after the TimeWait, a (very) late disconnect() sends nothing and succeeds.
    a.disconnect(id, ms(LATE_MS)).unwrap();
    assert!(take(&mut a).is_empty());
    a.destroy(id, ms(LATE_MS)).unwrap();
    assert!(take(&mut a).is_empty(), "destroy sends nothing either");
    assert!(a.is_quiescent());
}

#[test]
fn destroy_after_an_answered_dreq_sends_nothing() {
    let mut a = agent();
    a.listen(SID).unwrap();
    let (id, local, qpn) = establish_passive(&mut a, 0x66, 0x700, ms(0));
    a.handle_mad(&dreq_mad(0xD3, 0x66, local, qpn), peer_gid(), ms(5));
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    a.destroy(id, ms(6)).unwrap();
    assert!(take(&mut a).is_empty());
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Dreq), 0);
    assert_eq!(a.counters().get(Group::TxMsgs, AttributeId::Drep), 1);
}

#[test]
fn crossing_dreqs_are_answered_at_once_too() {
    let mut a = agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.disconnect(id, ms(1)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Dreq(_)));
    a.handle_mad(&dreq_mad(0xEE, 0x55, local, qpn), peer_gid(), ms(2));
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    assert_eq!(a.state(id), Some(State::Timewait));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    a.disconnect(id, ms(3)).unwrap();
    assert!(take(&mut a).is_empty());
}

#[test]
fn linux_drep_waits_for_the_application() {
    let mut a = linux_drep_agent();
    let (id, local, qpn, _) = establish_active(&mut a, 0x55, 0x600, ms(0));
    a.handle_mad(&dreq_mad(0xD2, 0x55, local, qpn), peer_gid(), ms(10));
    assert!(take(&mut a).is_empty(), "rdma_cm: the DREP waits");
    assert_eq!(a.state(id), Some(State::DreqRcvd));
    assert_eq!(events(&mut a), vec![Event::Disconnected { id }]);
    a.disconnect(id, ms(LATE_MS)).unwrap();
    assert!(matches!(parse(&one(&mut a)).1, CmRepr::Drep(_)));
    assert_eq!(a.state(id), Some(State::Timewait));
}

// ------------------------------------------------------------- back to back

/// What a late application costs the peer that disconnects: agent 0 (the peer)
/// disconnects, agent 1's application calls `disconnect()` only `LATE_MS` after its
/// `Disconnected` event. Returns agent 0's DREQ retries.
fn late_application(configure: impl FnOnce(&mut AgentConfig)) -> u64 {
    let mut p = Pair::new(7);
    let mut cfg = p.agents[1].config().clone();
    configure(&mut cfg);
    p.agents[1] = Agent::new(cfg);
    let mut apps = [App::default(), App::default()];
    let listener = p.agents[1].listen(SID).unwrap();
    let mut now = Time::ZERO;
    let a0 = p.agents[0]
        .connect(
            p.gids[1],
            SID,
            &[PLAN_CLIENT_DISCONNECTS],
            &Default::default(),
            now,
        )
        .unwrap();
    settle(&mut p, &mut apps, now);
    assert_eq!(p.agents[0].state(a0), Some(State::Established));
    let [a1] = apps[1].newly_established[..] else {
        panic!("not established")
    };

    // From here on the applications are scripted: agent 0's disconnects at once, agent
    // 1's is late.
    p.agents[0].disconnect(a0, now).unwrap();
    let mut disconnected_at: Option<Time> = None;
    let mut late_done = false;
    let mut exits: Vec<CmId> = Vec::new();
    let end = now.after_ms(LATE_MS + 10 * TIMEWAIT);
    let mut wire = Vec::new();
    while now <= end {
        for a in &mut p.agents {
            a.poll(now);
        }
        loop {
            for (i, a) in p.agents.iter_mut().enumerate() {
                while let Some(e) = a.pop_event() {
                    match e {
                        Event::Disconnected { id } if i == 1 => {
                            assert_eq!(id, a1);
                            assert!(disconnected_at.is_none(), "one Disconnected");
                            disconnected_at = Some(now);
                        }
                        Event::Disconnected { id } => assert_eq!(id, a0),
                        Event::TimewaitExit { id } => exits.push(id),
                        e => panic!("unexpected {e:?}"),
                    }
                }
            }
            if let Some(t) = disconnected_at
                && !late_done
                && now >= t.after_ms(LATE_MS)
            {
                late_done = true;
                let before = p.agents[1].counters().get(Group::TxMsgs, AttributeId::Drep);
                p.agents[1].disconnect(a1, now).unwrap();
                let drep_now = p.agents[1].counters().get(Group::TxMsgs, AttributeId::Drep);
                if p.agents[1].config().auto_drep {
                    assert_eq!(drep_now, before, "the DREP went out long ago");
                } else {
                    assert_eq!(drep_now, before + 1, "Linux: the DREP goes out now");
                }
            }
            wire.clear();
            p.collect(&mut wire);
            if wire.is_empty() {
                break;
            }
            for (to, src, mad) in std::mem::take(&mut wire) {
                p.deliver(to, src, &mad, now);
            }
        }
        now = now.after_ms(10);
    }
    assert!(late_done, "the late application acted");
    assert_eq!(exits.len(), 2, "both sides left TimeWait: {exits:?}");
    for (id, a) in [a0, a1].into_iter().zip(p.agents.iter_mut()) {
        a.destroy(id, now).unwrap();
    }
    p.agents[1].destroy(listener, now).unwrap();
    wire.clear();
    p.collect(&mut wire);
    assert!(wire.is_empty(), "nothing more on the wire: {}", wire.len());
    assert!(p.agents.iter().all(|a| a.is_quiescent()));
    p.check_counters_match_wire();
    // Exactly one DREP, whoever's timing.
    assert_eq!(
        p.agents[1].counters().get(Group::TxMsgs, AttributeId::Drep),
        1
    );
    assert_eq!(
        p.agents[1]
            .counters()
            .get(Group::TxRetries, AttributeId::Drep),
        0
    );
    p.agents[0]
        .counters()
        .get(Group::TxRetries, AttributeId::Dreq)
}

#[test]
fn a_late_application_causes_no_dreq_retry_at_the_peer() {
    assert_eq!(late_application(|_| {}), 0);
}

#[test]
fn with_linux_drep_a_late_application_makes_the_peer_retry_its_dreq() {
    assert_eq!(late_application(|c| c.auto_drep = false), 1);
}

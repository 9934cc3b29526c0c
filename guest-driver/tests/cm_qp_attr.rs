//! QP attributes from a real exchange between two agents: each side's RTR takes the
//! peer's QPN and its own starting PSN, its RTS the peer's starting PSN, and the
//! resources cross over as Linux's cm.c crosses them.
#![allow(clippy::unwrap_used)]

use pvcm_guest::cm::qp_attr::mask;
use pvcm_guest::cm::{
    AcceptOptions, Agent, AgentConfig, CmId, ConnectOptions, Event, QpState, State,
};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;

fn gid(n: u8) -> Gid {
    Gid::from_ipv4([10, 0, 0, n].into())
}

fn deliver(from: &mut Agent, from_gid: Gid, to: &mut Agent, now: Time) {
    let mads: Vec<_> = from.drain_outbox().collect();
    for m in &mads {
        to.handle_mad(&m.mad, from_gid, now);
    }
}

#[test]
fn both_sides_get_the_peers_values() {
    let (cg, sg) = (gid(1), gid(2));
    let mut c = Agent::new(AgentConfig::new(cg, 0xc1, 0x10, 0x10000, 1));
    let mut s = Agent::new(AgentConfig::new(sg, 0x51, 0x10, 0x10000, 2));
    let sid = 0x0000_0000_0106_1d2f;
    let now = Time::from_millis(1);
    s.listen(sid).unwrap();
    let opts = ConnectOptions {
        qpn: Some(0x11),
        starting_psn: Some(0xaaaaaa),
        responder_resources: 4,
        initiator_depth: 2,
        retry_count: 6,
        rnr_retry_count: 5,
        traffic_class: 0x48,
        auto_rtu: false,
        ..ConnectOptions::default()
    };
    let cid = c.connect(sg, sid, &[0u8; 56], &opts, now).unwrap();
    // Before the REP the active side has no peer values: INIT only.
    assert!(c.qp_attr(cid, QpState::Init).is_ok());
    assert!(c.qp_attr(cid, QpState::Rtr).is_err());
    deliver(&mut c, cg, &mut s, now);
    let sid_conn: CmId = match s.pop_event() {
        Some(Event::ConnectRequest { id, .. }) => id,
        e => panic!("{e:?}"),
    };
    // The passive side can go to RTR/RTS before it answers (librdmacm's rdma_accept).
    let rtr = s.qp_attr(sid_conn, QpState::Rtr).unwrap();
    assert_eq!(rtr.dest_qpn, 0x11);
    assert_eq!(rtr.max_dest_rd_atomic, 2, "REQ's initiator depth");
    assert_eq!(rtr.av.remote_gid, cg);
    assert_eq!(rtr.av.local_gid, sg);
    assert_eq!(rtr.av.traffic_class, 0x48);
    let rts = s.qp_attr(sid_conn, QpState::Rts).unwrap();
    assert_eq!(
        rts.sq_psn, 0xaaaaaa,
        "the REQ's starting PSN is our send PSN"
    );
    assert_eq!((rts.max_rd_atomic, rts.retry_cnt, rts.rnr_retry), (4, 6, 5));
    s.accept_with(
        sid_conn,
        &[],
        &AcceptOptions {
            qpn: Some(0x22),
            starting_psn: Some(0xbbbbbb),
            responder_resources: 1,
            initiator_depth: 1,
            rnr_retry_count: 3,
            ..AcceptOptions::default()
        },
        now,
    )
    .unwrap();
    let rtr = s.qp_attr(sid_conn, QpState::Rtr).unwrap();
    assert_eq!(
        rtr.rq_psn, 0xbbbbbb,
        "our REP's starting PSN is our receive PSN"
    );
    assert_eq!(rtr.max_dest_rd_atomic, 1);
    deliver(&mut s, sg, &mut c, now);
    assert!(matches!(c.pop_event(), Some(Event::ConnectResponse { .. })));
    assert_eq!(c.state(cid), Some(State::RepRcvd));
    let rtr = c.qp_attr(cid, QpState::Rtr).unwrap();
    assert_eq!((rtr.dest_qpn, rtr.rq_psn), (0x22, 0xaaaaaa));
    assert_eq!(rtr.max_dest_rd_atomic, 1, "the REP's initiator depth");
    assert!(rtr.mask & mask::AV != 0);
    let rts = c.qp_attr(cid, QpState::Rts).unwrap();
    assert_eq!(rts.sq_psn, 0xbbbbbb);
    assert_eq!(rts.rnr_retry, 3, "the REP's RNR retry count");
    assert_eq!(rts.max_rd_atomic, 1, "the REP's responder resources");
    // The ACK timeout follows the REP's target ACK delay (Linux cm_ack_timeout).
    assert!(rts.timeout >= 17);
    let init = c.qp_attr(cid, QpState::Init).unwrap();
    assert_eq!(
        init.mask,
        mask::STATE | mask::ACCESS_FLAGS | mask::PKEY_INDEX | mask::PORT
    );
}

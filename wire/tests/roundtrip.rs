//! Property tests: every valid repr survives `emit` then `parse` unchanged, emitted
//! bytes survive `parse` then `emit` unchanged, and no byte pattern makes the parsers
//! or the generic `CmMad` accessors panic.

// Tests may unwrap (clippy.toml allows it in #[test] fns; helpers here too).
#![allow(clippy::unwrap_used)]

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use pvcm_wire::Gid;
use pvcm_wire::cm::{
    AprStatus, CmMad, CmRepr, FailoverAccepted, MsgResponse, PathRepr, RejReason, SidrStatus,
    TransportService, apr, class_port_info, drep, dreq, lap, mra, rej, rep, req, rtu, sidr_rep,
    sidr_req,
};
use pvcm_wire::mad::{AttributeId, Header, Method};

// ---------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------

fn gid() -> impl Strategy<Value = Gid> {
    any::<[u8; 16]>().prop_map(Gid)
}

fn u24() -> impl Strategy<Value = u32> {
    0u32..(1 << 24)
}

/// A value of `n` bits (n <= 8).
fn bits(n: u32) -> impl Strategy<Value = u8> {
    0u8..=((1u16 << n) - 1) as u8
}

fn data(len: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), len)
}

fn info() -> impl Strategy<Value = Vec<u8>> {
    vec(any::<u8>(), 0..=72)
}

fn path() -> impl Strategy<Value = PathRepr> {
    (
        any::<u16>(),
        any::<u16>(),
        gid(),
        gid(),
        0u32..(1 << 20),
        bits(6),
        any::<u8>(),
        any::<u8>(),
        bits(4),
        any::<bool>(),
        bits(5),
    )
        .prop_map(|(ll, rl, lg, rg, fl, rate, tc, hl, sl, sn, ack)| PathRepr {
            local_lid: ll,
            remote_lid: rl,
            local_gid: lg,
            remote_gid: rg,
            flow_label: fl,
            packet_rate: rate,
            traffic_class: tc,
            hop_limit: hl,
            sl,
            subnet_local: sn,
            local_ack_timeout: ack,
        })
}

/// A header with arbitrary TID, status, class-specific word and attribute modifier;
/// `emit` supplies the attribute ID, the caller the method.
fn header(method: impl Strategy<Value = Method>) -> impl Strategy<Value = Header> {
    (
        method,
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        any::<u32>(),
    )
        .prop_map(|(method, status, class_specific, tid, attr_mod)| Header {
            method,
            status,
            class_specific,
            tid,
            attr_id: AttributeId::Req,
            attr_mod,
        })
}

fn send() -> impl Strategy<Value = Header> {
    header(Just(Method::Send))
}

const TRANSPORTS: &[TransportService] = &[
    TransportService::Rc,
    TransportService::Uc,
    TransportService::Rd,
    TransportService::Xrc,
];

fn req_strategy() -> impl Strategy<Value = (req::Repr<'static>, Vec<u8>)> {
    let a = (
        any::<u32>(),
        u24(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        u24(),
        any::<u8>(),
        u24(),
        any::<u8>(),
        u24(),
        bits(5),
        select(TRANSPORTS),
    );
    let b = (
        any::<bool>(),
        u24(),
        bits(5),
        bits(3),
        any::<u16>(),
        bits(4),
        any::<bool>(),
        bits(3),
        bits(4),
        any::<bool>(),
        any::<bool>(),
    );
    (a, b, path(), path(), data(req::PRIVATE_DATA_LEN)).prop_map(
        |((lcid, vid, sid, guid, qkey, qpn, rr, leecn, id, reecn, rto, tr), b, pp, ap, pd)| {
            let (e2e, psn, lto, retry, pkey, mtu, rdc, rnr, max, srq, sap) = b;
            let r = req::Repr {
                local_comm_id: lcid,
                vendor_id: vid,
                service_id: sid,
                local_ca_guid: guid,
                local_qkey: qkey,
                local_qpn: qpn,
                responder_resources: rr,
                local_eecn: leecn,
                initiator_depth: id,
                remote_eecn: reecn,
                remote_cm_response_timeout: rto,
                transport: tr,
                end_to_end_flow_control: e2e,
                starting_psn: psn,
                local_cm_response_timeout: lto,
                retry_count: retry,
                partition_key: pkey,
                path_mtu: mtu,
                rdc_exists: rdc,
                rnr_retry_count: rnr,
                max_cm_retries: max,
                srq,
                primary_path: pp,
                alternate_path: ap,
                sap_supported: sap,
                private_data: &[],
            };
            (r, pd)
        },
    )
}

fn mra_strategy() -> impl Strategy<Value = (mra::Repr<'static>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u32>(),
        select(MsgResponse::ALL),
        bits(5),
        data(mra::PRIVATE_DATA_LEN),
    )
        .prop_map(|(l, r, m, t, pd)| {
            let repr = mra::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                message_mraed: m,
                service_timeout: t,
                private_data: &[],
            };
            (repr, pd)
        })
}

fn rej_strategy() -> impl Strategy<Value = (rej::Repr<'static>, Vec<u8>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u32>(),
        select(MsgResponse::ALL),
        select(RejReason::ALL),
        info(),
        data(rej::PRIVATE_DATA_LEN),
    )
        .prop_map(|(l, r, m, reason, ari, pd)| {
            let repr = rej::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                message_rejected: m,
                reason,
                ari: &[],
                private_data: &[],
            };
            (repr, ari, pd)
        })
}

fn rep_strategy() -> impl Strategy<Value = (rep::Repr<'static>, Vec<u8>)> {
    let a = (
        any::<u32>(),
        any::<u32>(),
        any::<u32>(),
        u24(),
        u24(),
        u24(),
        u24(),
        any::<u8>(),
    );
    let b = (
        any::<u8>(),
        bits(5),
        select(FailoverAccepted::ALL),
        any::<bool>(),
        bits(3),
        any::<bool>(),
        any::<u64>(),
    );
    (a, b, data(rep::PRIVATE_DATA_LEN)).prop_map(
        |((l, r, qkey, qpn, vid, eecn, psn, rr), (id, tad, fo, e2e, rnr, srq, guid), pd)| {
            let repr = rep::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                local_qkey: qkey,
                local_qpn: qpn,
                vendor_id: vid,
                local_eecn: eecn,
                starting_psn: psn,
                responder_resources: rr,
                initiator_depth: id,
                target_ack_delay: tad,
                failover_accepted: fo,
                end_to_end_flow_control: e2e,
                rnr_retry_count: rnr,
                srq,
                local_ca_guid: guid,
                private_data: &[],
            };
            (repr, pd)
        },
    )
}

fn rtu_strategy() -> impl Strategy<Value = (rtu::Repr<'static>, Vec<u8>)> {
    (any::<u32>(), any::<u32>(), data(rtu::PRIVATE_DATA_LEN)).prop_map(|(l, r, pd)| {
        let repr = rtu::Repr {
            local_comm_id: l,
            remote_comm_id: r,
            private_data: &[],
        };
        (repr, pd)
    })
}

fn dreq_strategy() -> impl Strategy<Value = (dreq::Repr<'static>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u32>(),
        u24(),
        data(dreq::PRIVATE_DATA_LEN),
    )
        .prop_map(|(l, r, qpn, pd)| {
            let repr = dreq::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                remote_qpn_eecn: qpn,
                private_data: &[],
            };
            (repr, pd)
        })
}

fn drep_strategy() -> impl Strategy<Value = (drep::Repr<'static>, Vec<u8>)> {
    (any::<u32>(), any::<u32>(), data(drep::PRIVATE_DATA_LEN)).prop_map(|(l, r, pd)| {
        let repr = drep::Repr {
            local_comm_id: l,
            remote_comm_id: r,
            private_data: &[],
        };
        (repr, pd)
    })
}

fn sidr_req_strategy() -> impl Strategy<Value = (sidr_req::Repr<'static>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u16>(),
        any::<u64>(),
        data(sidr_req::PRIVATE_DATA_LEN),
    )
        .prop_map(|(id, pkey, sid, pd)| {
            let repr = sidr_req::Repr {
                request_id: id,
                partition_key: pkey,
                service_id: sid,
                private_data: &[],
            };
            (repr, pd)
        })
}

fn sidr_rep_strategy() -> impl Strategy<Value = (sidr_rep::Repr<'static>, Vec<u8>, Vec<u8>)> {
    (
        any::<u32>(),
        select(SidrStatus::ALL),
        u24(),
        u24(),
        any::<u64>(),
        any::<u32>(),
        info(),
        data(sidr_rep::PRIVATE_DATA_LEN),
    )
        .prop_map(|(id, status, vid, qpn, sid, qkey, info, pd)| {
            let repr = sidr_rep::Repr {
                request_id: id,
                status,
                vendor_id: vid,
                qpn,
                service_id: sid,
                qkey,
                additional_info: &[],
                private_data: &[],
            };
            (repr, info, pd)
        })
}

fn lap_strategy() -> impl Strategy<Value = (lap::Repr<'static>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u32>(),
        u24(),
        bits(5),
        path(),
        data(lap::PRIVATE_DATA_LEN),
    )
        .prop_map(|(l, r, qpn, rto, ap, pd)| {
            let repr = lap::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                remote_qpn_eecn: qpn,
                remote_cm_response_timeout: rto,
                alternate_path: ap,
                private_data: &[],
            };
            (repr, pd)
        })
}

fn apr_strategy() -> impl Strategy<Value = (apr::Repr<'static>, Vec<u8>, Vec<u8>)> {
    (
        any::<u32>(),
        any::<u32>(),
        select(AprStatus::ALL),
        info(),
        data(apr::PRIVATE_DATA_LEN),
    )
        .prop_map(|(l, r, status, info, pd)| {
            let repr = apr::Repr {
                local_comm_id: l,
                remote_comm_id: r,
                ar_status: status,
                additional_info: &[],
                private_data: &[],
            };
            (repr, info, pd)
        })
}

fn cpi_strategy() -> impl Strategy<Value = class_port_info::Repr> {
    let a = (
        any::<u8>(),
        any::<u8>(),
        any::<u16>(),
        0u32..(1 << 27),
        bits(5),
        gid(),
        any::<u8>(),
        bits(4),
        0u32..(1 << 20),
        any::<u16>(),
        any::<u16>(),
    );
    let b = (
        u24(),
        any::<u32>(),
        gid(),
        any::<u8>(),
        bits(4),
        0u32..(1 << 20),
        any::<u16>(),
        any::<u16>(),
        any::<u8>(),
        u24(),
        any::<u32>(),
    );
    (a, b).prop_map(
        |(
            (bv, cv, cap, cap2, rt, rgid, rtc, rsl, rfl, rlid, rpkey),
            (rqp, rqkey, tgid, ttc, tsl, tfl, tlid, tpkey, thl, tqp, tqkey),
        )| class_port_info::Repr {
            base_version: bv,
            class_version: cv,
            capability_mask: cap,
            cap_mask2: cap2,
            resp_time: rt,
            redirect_gid: rgid,
            redirect_tc: rtc,
            redirect_sl: rsl,
            redirect_fl: rfl,
            redirect_lid: rlid,
            redirect_pkey: rpkey,
            redirect_qp: rqp,
            redirect_qkey: rqkey,
            trap_gid: tgid,
            trap_tc: ttc,
            trap_sl: tsl,
            trap_fl: tfl,
            trap_lid: tlid,
            trap_pkey: tpkey,
            trap_hop_limit: thl,
            trap_qp: tqp,
            trap_qkey: tqkey,
        },
    )
}

// ---------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------

/// parse(emit(r)) == r, and emit(parse(bytes)) == bytes for the emitted bytes. Emits
/// into a dirty buffer too, to show emit writes every byte.
fn roundtrip(mut h: Header, repr: CmRepr<'_>) -> Result<(), TestCaseError> {
    h.attr_id = repr.attr();
    let mut bytes = [0u8; 256];
    repr.emit(&h, &mut bytes).unwrap();
    let mut dirty = [0xA5u8; 256];
    repr.emit(&h, &mut dirty).unwrap();
    prop_assert_eq!(&bytes[..], &dirty[..]);

    let (h2, r2) = CmRepr::parse(&bytes).unwrap();
    prop_assert_eq!(h2, h);
    prop_assert_eq!(r2, repr);

    let mut again = [0x5Au8; 256];
    r2.emit(&h2, &mut again).unwrap();
    prop_assert_eq!(&again[..], &bytes[..]);

    let m = CmMad::new_checked(&bytes[..]).unwrap();
    prop_assert_eq!(m.attr(), h.attr_id);
    prop_assert_eq!(m.tid(), h.tid);
    Ok(())
}

proptest! {
    #[test]
    fn req_roundtrip((r, pd) in req_strategy(), h in send()) {
        roundtrip(h, CmRepr::Req(req::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn mra_roundtrip((r, pd) in mra_strategy(), h in send()) {
        roundtrip(h, CmRepr::Mra(mra::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn rej_roundtrip((r, ari, pd) in rej_strategy(), h in send()) {
        let r = rej::Repr { ari: &ari, private_data: &pd, ..r };
        roundtrip(h, CmRepr::Rej(r))?;
        let mut b = [0u8; 256];
        CmRepr::Rej(r).emit(&Header::cm_send(AttributeId::Rej, 0), &mut b).unwrap();
        let m = CmMad::new_checked(&b[..]).unwrap();
        prop_assert_eq!(m.rej_ari(), Some(&ari[..]));
        prop_assert_eq!(m.rej_reason(), Some(r.reason.code()));
        prop_assert_eq!(m.rej_timeout_ca_guid(), r.timeout_ca_guid());
    }

    #[test]
    fn rep_roundtrip((r, pd) in rep_strategy(), h in send()) {
        roundtrip(h, CmRepr::Rep(rep::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn rtu_roundtrip((r, pd) in rtu_strategy(), h in send()) {
        roundtrip(h, CmRepr::Rtu(rtu::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn dreq_roundtrip((r, pd) in dreq_strategy(), h in send()) {
        roundtrip(h, CmRepr::Dreq(dreq::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn drep_roundtrip((r, pd) in drep_strategy(), h in send()) {
        roundtrip(h, CmRepr::Drep(drep::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn sidr_req_roundtrip((r, pd) in sidr_req_strategy(), h in send()) {
        roundtrip(h, CmRepr::SidrReq(sidr_req::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn sidr_rep_roundtrip((r, info, pd) in sidr_rep_strategy(), h in send()) {
        let r = sidr_rep::Repr { additional_info: &info, private_data: &pd, ..r };
        roundtrip(h, CmRepr::SidrRep(r))?;
    }

    #[test]
    fn lap_roundtrip((r, pd) in lap_strategy(), h in send()) {
        roundtrip(h, CmRepr::Lap(lap::Repr { private_data: &pd, ..r }))?;
    }

    #[test]
    fn apr_roundtrip((r, info, pd) in apr_strategy(), h in send()) {
        let r = apr::Repr { additional_info: &info, private_data: &pd, ..r };
        roundtrip(h, CmRepr::Apr(r))?;
    }

    #[test]
    fn class_port_info_roundtrip(
        r in cpi_strategy(),
        h in header(select(&[Method::Get, Method::GetResp][..])),
    ) {
        roundtrip(h, CmRepr::ClassPortInfo(r))?;
    }
}

// ---------------------------------------------------------------------------------------
// Random bytes never panic
// ---------------------------------------------------------------------------------------

const ATTRS: &[(u8, u8)] = &[
    (0x01, 0x01),
    (0x01, 0x81),
    (0x10, 0x03),
    (0x11, 0x03),
    (0x12, 0x03),
    (0x13, 0x03),
    (0x14, 0x03),
    (0x15, 0x03),
    (0x16, 0x03),
    (0x17, 0x03),
    (0x18, 0x03),
    (0x19, 0x03),
    (0x1A, 0x03),
];

/// Runs every parser and accessor on `bytes`; whatever they answer, they must not panic,
/// and what parses must round-trip.
fn exercise(bytes: &mut [u8]) {
    if let Ok((h, r)) = CmRepr::parse(bytes) {
        let _ = r.to_string();
        let mut out = [0u8; 256];
        r.emit(&h, &mut out).unwrap();
        assert_eq!(CmRepr::parse(&out).unwrap(), (h, r));
    }
    if let Ok(m) = CmMad::new_checked(&*bytes) {
        let _ = (m.attr(), m.tid(), m.method(), m.header().attr_id());
        let _ = (m.has_local_comm_id(), m.has_remote_comm_id());
        let _ = (m.local_comm_id(), m.remote_comm_id(), m.sidr_request_id());
        let _ = (m.req_primary_local_gid(), m.req_primary_remote_gid());
        let _ = (m.local_ca_guid(), m.local_qpn(), m.remote_qpn());
        let _ = (m.rej_reason(), m.rej_ari(), m.rej_timeout_ca_guid());
        let _ = (m.msg_response(), m.mra_service_timeout());
    }
    if let Ok(mut m) = CmMad::new_checked(&mut *bytes) {
        let _ = m.set_local_comm_id(0x0102_0304);
        let _ = m.set_remote_comm_id(0x0506_0708);
        let _ = m.set_sidr_request_id(0x090A_0B0C);
        m.set_tid(7);
    }
    if let Ok(p) = rej::Packet::new_checked(&*bytes) {
        let _ = (p.ari(), p.reason(), p.message_rejected());
    }
    if let Ok(p) = apr::Packet::new_checked(&*bytes) {
        let _ = (p.additional_info(), p.ar_status());
    }
    if let Ok(p) = sidr_rep::Packet::new_checked(&*bytes) {
        let _ = (p.additional_info(), p.status(), p.vendor_id());
    }
    if let Ok(p) = rep::Packet::new_checked(&*bytes) {
        let _ = (p.failover_accepted(), p.vendor_id());
    }
    if let Ok(p) = mra::Packet::new_checked(&*bytes) {
        let _ = p.message_mraed();
    }
    if let Ok(p) = lap::Packet::new_checked(&*bytes) {
        let _ = p.alternate_path();
    }
}

proptest! {
    #[test]
    fn random_bytes_never_panic(mut bytes in vec(any::<u8>(), 256)) {
        exercise(&mut bytes);
    }

    #[test]
    fn random_bytes_with_a_cm_header_never_panic(
        mut bytes in vec(any::<u8>(), 256),
        (attr, method) in select(ATTRS),
    ) {
        bytes[0] = 0x01;
        bytes[1] = 0x07;
        bytes[2] = 0x02;
        bytes[3] = method;
        bytes[16] = 0x00;
        bytes[17] = attr;
        prop_assert!(CmMad::new_checked(&bytes[..]).is_ok());
        exercise(&mut bytes);
    }

    #[test]
    fn random_lengths_never_panic(mut bytes in vec(any::<u8>(), 0..300)) {
        if bytes.len() >= 18 {
            bytes[..3].copy_from_slice(&[0x01, 0x07, 0x02]);
            bytes[3] = 0x03;
            bytes[16] = 0x00;
        }
        exercise(&mut bytes);
    }
}

/// A message `Repr`'s `Default` is what an all-zero body holds: it emits zero bytes.
#[test]
fn default_reprs_emit_zero_bodies() {
    let reprs = [
        CmRepr::Req(req::Repr::default()),
        CmRepr::Mra(mra::Repr::default()),
        CmRepr::Rep(rep::Repr::default()),
        CmRepr::Rtu(rtu::Repr::default()),
        CmRepr::Dreq(dreq::Repr::default()),
        CmRepr::Drep(drep::Repr::default()),
        CmRepr::SidrReq(sidr_req::Repr::default()),
        CmRepr::SidrRep(sidr_rep::Repr::default()),
        CmRepr::Lap(lap::Repr::default()),
        CmRepr::Apr(apr::Repr::default()),
    ];
    for r in reprs {
        let mut b = [0xEEu8; 256];
        r.emit(&Header::cm_send(r.attr(), 1), &mut b).unwrap();
        assert!(b[24..].iter().all(|&x| x == 0), "{}", r.attr());
    }
}

//! Builders of CM MADs for tests, benchmarks and fuzz targets (cargo feature
//! `test-util`; never enabled by a normal build).
//!
//! Two kinds, as the tests need them:
//!
//! - **Through the codec.** [`req_repr`] fills a REQ the way Linux's CM (through
//!   rdma_cm) does; every other message's `Repr` implements `Default` (what an all-zero
//!   body parses to), so a test names only the fields it cares about. [`mad`] and
//!   [`encode`] emit one.
//! - **Field by field.** [`ids`] sets the MAD header and the two comm IDs and leaves
//!   every other byte zero; [`rep`], [`rtu`], [`dreq`], [`drep`], [`rej`] and [`mra`]
//!   add the fields a proxy reads. [`req`] is a whole REQ ([`req_repr`], emitted).
//!
//! And the device's messages ([`crate::abi`]): [`message`] is a header and its payload,
//! [`raw_header`] a header of any type and length, valid or not.
//!
//! Everything here panics on bad input: it is for tests.

use crate::Gid;
use crate::abi::{HEADER_LEN, MsgHeader};
use crate::cm::{self, CmMad, CmRepr, MsgResponse, PathRepr, RejReason, TransportService};
use crate::mad::{self, AttributeId, Header, MAD_LEN};

/// A 256-byte MAD.
pub type Mad = [u8; MAD_LEN];

/// Service ID of the test REQs: rdma_cm's TCP port space (0x0106), port 20001.
pub const SERVICE_ID: u64 = 0x0000_0000_0106_4E21;

/// The CM timeouts a REQ carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReqParams {
    /// Remote and local CM response timeouts (5-bit exponents of 4.096 us).
    pub resp: u8,
    /// Max CM retries.
    pub retries: u8,
    /// Local ACK timeout of the primary path.
    pub ack: u8,
}

/// What the Linux CM (via rdma_cm) sends: response timeouts 20, 15 retries, local ACK
/// timeout 18 (~1 s).
pub const LINUX: ReqParams = ReqParams {
    resp: 20,
    retries: 15,
    ack: 18,
};

impl ReqParams {
    /// `r` with these timeouts.
    pub fn apply<'a>(&self, r: cm::req::Repr<'a>) -> cm::req::Repr<'a> {
        cm::req::Repr {
            remote_cm_response_timeout: self.resp,
            local_cm_response_timeout: self.resp,
            max_cm_retries: self.retries,
            primary_path: PathRepr {
                local_ack_timeout: self.ack,
                ..r.primary_path
            },
            ..r
        }
    }
}

/// A RoCE path from `local` to `remote` as rdma_cm fills it: permissive LIDs, hop limit
/// 64, packet rate 3, the [`LINUX`] ACK timeout.
pub fn path(local: Gid, remote: Gid) -> PathRepr {
    PathRepr {
        local_lid: 0xFFFF,
        remote_lid: 0xFFFF,
        local_gid: local,
        remote_gid: remote,
        packet_rate: 3,
        hop_limit: 64,
        local_ack_timeout: LINUX.ack,
        ..PathRepr::default()
    }
}

/// A REQ from `src` (CA GUID `ca_guid`, comm ID `local`, QPN `qpn`) to `dst` on RC, as
/// the Linux CM sends it: [`SERVICE_ID`], the [`LINUX`] timeouts, 4 responder
/// resources and initiator depth, MTU 4096, [`path`], 56 bytes of private data.
pub fn req_repr(src: Gid, ca_guid: u64, local: u32, dst: Gid, qpn: u32) -> cm::req::Repr<'static> {
    LINUX.apply(cm::req::Repr {
        local_comm_id: local,
        service_id: SERVICE_ID,
        local_ca_guid: ca_guid,
        local_qpn: qpn,
        responder_resources: 4,
        initiator_depth: 4,
        transport: TransportService::Rc,
        end_to_end_flow_control: true,
        starting_psn: 0x1234,
        retry_count: 7,
        partition_key: 0xFFFF,
        path_mtu: 5,
        rnr_retry_count: 7,
        primary_path: path(src, dst),
        private_data: &[0xAB; 56],
        ..cm::req::Repr::default()
    })
}

/// [`req_repr`] emitted with TID `tid`.
pub fn req(src: Gid, ca_guid: u64, local: u32, tid: u64, dst: Gid, qpn: u32) -> Mad {
    req_with(src, ca_guid, local, tid, dst, qpn, &LINUX)
}

/// [`req`] with the timeouts `p`.
pub fn req_with(
    src: Gid,
    ca_guid: u64,
    local: u32,
    tid: u64,
    dst: Gid,
    qpn: u32,
    p: &ReqParams,
) -> Mad {
    mad(
        tid,
        CmRepr::Req(p.apply(req_repr(src, ca_guid, local, dst, qpn))),
    )
}

/// Emits `r` under the header `h` (panics if `r` does not encode).
pub fn encode(h: Header, r: CmRepr<'_>) -> Mad {
    let mut b = [0u8; MAD_LEN];
    if let Err(e) = r.emit(&h, &mut b) {
        panic!("test MAD {} does not encode: {e}", r.attr());
    }
    b
}

/// Emits `r` as a CM Send with TID `tid` (panics if `r` does not encode).
pub fn mad(tid: u64, r: CmRepr<'_>) -> Mad {
    encode(Header::cm_send(r.attr(), tid), r)
}

/// A CM MAD (Send) with only the header and the two comm IDs set.
pub fn ids(attr: AttributeId, tid: u64, local: u32, remote: u32) -> Mad {
    let mut b = [0u8; MAD_LEN];
    Header::cm_send(attr, tid).emit(&mut mad::Packet::new_unchecked(&mut b[..]));
    cm::field::LOCAL_COMM_ID.set(&mut b, local.into());
    cm::field::REMOTE_COMM_ID.set(&mut b, remote.into());
    b
}

/// A REP: [`ids`] plus the local QPN and CA GUID.
pub fn rep(ca_guid: u64, tid: u64, local: u32, remote: u32, qpn: u32) -> Mad {
    let mut b = ids(AttributeId::Rep, tid, local, remote);
    cm::field::REP_LOCAL_QPN.set(&mut b, qpn.into());
    cm::field::REP_LOCAL_CA_GUID.set(&mut b, ca_guid);
    b
}

/// An RTU: [`ids`].
pub fn rtu(tid: u64, local: u32, remote: u32) -> Mad {
    ids(AttributeId::Rtu, tid, local, remote)
}

/// A DREQ: [`ids`] plus the remote QPN.
pub fn dreq(tid: u64, local: u32, remote: u32, remote_qpn: u32) -> Mad {
    let mut b = ids(AttributeId::Dreq, tid, local, remote);
    cm::field::DREQ_REMOTE_QPN.set(&mut b, remote_qpn.into());
    b
}

/// A DREP: [`ids`].
pub fn drep(tid: u64, local: u32, remote: u32) -> Mad {
    ids(AttributeId::Drep, tid, local, remote)
}

/// A REJ: [`ids`] plus the reason and the ARI (Message REJected stays REQ, code 0).
pub fn rej(tid: u64, local: u32, remote: u32, reason: RejReason, ari: &[u8]) -> Mad {
    let mut b = ids(AttributeId::Rej, tid, local, remote);
    cm::field::REJ_REASON.set(&mut b, reason.code().into());
    cm::field::REJ_ARI_LENGTH.set(&mut b, ari.len() as u64);
    let at = cm::field::REJ_ARI.start;
    b[at..at + ari.len()].copy_from_slice(ari);
    b
}

/// An MRA: [`ids`] plus the message MRAed and the service timeout.
pub fn mra(tid: u64, local: u32, remote: u32, msg: MsgResponse, service_timeout: u8) -> Mad {
    let mut b = ids(AttributeId::Mra, tid, local, remote);
    cm::field::MRA_MESSAGE_MRAED.set(&mut b, msg.code().into());
    cm::field::MRA_SERVICE_TIMEOUT.set(&mut b, service_timeout.into());
    b
}

/// The CM view of a MAD (panics on a malformed one).
pub fn view(b: &Mad) -> CmMad<&[u8]> {
    match CmMad::new_checked(&b[..]) {
        Ok(m) => m,
        Err(e) => panic!("not a CM MAD: {e}"),
    }
}

/// The attribute of a MAD's header; `None` for one the CM class does not know or a
/// buffer too short to hold the field.
pub fn attr(b: &[u8]) -> Option<AttributeId> {
    b.get(mad::field::ATTR_ID.range())?;
    AttributeId::from_u16(mad::field::ATTR_ID.get(b) as u16)
}

/// A device message: `h`, then `payload`.
pub fn message(h: &MsgHeader, payload: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; HEADER_LEN + payload.len()];
    h.emit(&mut b)
        .expect("a buffer of a header's length at least");
    b[HEADER_LEN..].copy_from_slice(payload);
    b
}

/// A message header with any type and payload length, valid or not (an unknown type, a
/// type only the device sends, a length above the largest payload), for the device's
/// checks: a MAD header to [`Gid::ZERO`] with `msg_type` and `len` written over its own.
pub fn raw_header(msg_type: u16, len: u32) -> Vec<u8> {
    let mut h = vec![0u8; HEADER_LEN];
    MsgHeader::mad(Gid::ZERO)
        .emit(&mut h)
        .expect("a buffer of a header's length");
    h[0..2].copy_from_slice(&msg_type.to_le_bytes());
    h[4..8].copy_from_slice(&len.to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn builders_make_cm_mads() {
        let (a, b) = (
            Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 1)),
            Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 2)),
        );
        let m = req(a, 0xCA, 7, 0x99, b, 0x100);
        let Ok((_, CmRepr::Req(r))) = CmRepr::parse(&m) else {
            panic!("not a REQ")
        };
        let want = req_repr(a, 0xCA, 7, b, 0x100);
        assert_eq!(&r.private_data[..56], want.private_data);
        let no_pd = |r| cm::req::Repr {
            private_data: &[],
            ..r
        };
        assert_eq!(no_pd(r), no_pd(want));
        assert_eq!(view(&m).tid(), 0x99);
        assert_eq!(attr(&m), Some(AttributeId::Req));
        assert_eq!(attr(&m[..17]), None);
        let m = rej(1, 2, 3, RejReason::Timeout, &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(view(&m).rej_reason(), Some(RejReason::Timeout.code()));
        let m = rep(0xCA, 1, 2, 3, 0x100);
        assert_eq!(view(&m).local_qpn(), Some(0x100));
    }
}

//! Hand-built CM MADs (what a guest CM would send), for tests that drive the device
//! without the full CM agent.

use pvcm_wire::Gid;
use pvcm_wire::cm::{self, CmMad, CmRepr, PathRepr, TransportService, field as f};
use pvcm_wire::mad::{self, AttributeId, Header, MAD_LEN};

/// A 256-byte MAD.
pub type Mad = [u8; MAD_LEN];

/// A REQ from `src` (CA GUID `ca_guid`, comm ID `local`, QPN `qpn`) to `dst`, with the
/// Linux CM's timeouts (response 20, 15 retries, ACK timeout 18).
pub fn req(src: Gid, ca_guid: u64, local: u32, tid: u64, dst: Gid, qpn: u32) -> Mad {
    let mut b = [0u8; MAD_LEN];
    let r = cm::req::Repr {
        local_comm_id: local,
        vendor_id: 0,
        service_id: 0x0000_0000_0106_4E21,
        local_ca_guid: ca_guid,
        local_qkey: 0,
        local_qpn: qpn,
        responder_resources: 4,
        local_eecn: 0,
        initiator_depth: 4,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport: TransportService::Rc,
        end_to_end_flow_control: true,
        starting_psn: 0x1234,
        local_cm_response_timeout: 20,
        retry_count: 7,
        partition_key: 0xFFFF,
        path_mtu: 5,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        primary_path: PathRepr {
            local_lid: 0xFFFF,
            remote_lid: 0xFFFF,
            local_gid: src,
            remote_gid: dst,
            flow_label: 0,
            packet_rate: 3,
            traffic_class: 0,
            hop_limit: 64,
            sl: 0,
            subnet_local: false,
            local_ack_timeout: 18,
        },
        alternate_path: PathRepr::default(),
        sap_supported: false,
        private_data: &[0xAB; 56],
    };
    // The buffer is a whole MAD and the REQ valid: emit cannot fail.
    let _ = CmRepr::Req(r).emit(&Header::cm_send(AttributeId::Req, tid), &mut b);
    b
}

/// A CM MAD with only the header and the two comm IDs set.
pub fn ids(attr: AttributeId, tid: u64, local: u32, remote: u32) -> Mad {
    let mut b = [0u8; MAD_LEN];
    Header::cm_send(attr, tid).emit(&mut mad::Packet::new_unchecked(&mut b[..]));
    f::LOCAL_COMM_ID.set(&mut b, local.into());
    f::REMOTE_COMM_ID.set(&mut b, remote.into());
    b
}

/// A REP.
pub fn rep(ca_guid: u64, tid: u64, local: u32, remote: u32, qpn: u32) -> Mad {
    let mut b = ids(AttributeId::Rep, tid, local, remote);
    f::REP_LOCAL_QPN.set(&mut b, qpn.into());
    f::REP_LOCAL_CA_GUID.set(&mut b, ca_guid);
    b
}

/// An RTU.
pub fn rtu(tid: u64, local: u32, remote: u32) -> Mad {
    ids(AttributeId::Rtu, tid, local, remote)
}

/// A DREQ.
pub fn dreq(tid: u64, local: u32, remote: u32, remote_qpn: u32) -> Mad {
    let mut b = ids(AttributeId::Dreq, tid, local, remote);
    f::DREQ_REMOTE_QPN.set(&mut b, remote_qpn.into());
    b
}

/// A DREP.
pub fn drep(tid: u64, local: u32, remote: u32) -> Mad {
    ids(AttributeId::Drep, tid, local, remote)
}

/// The CM view of a MAD (panics on a malformed one: for tests).
pub fn view(b: &Mad) -> CmMad<&[u8]> {
    match CmMad::new_checked(&b[..]) {
        Ok(m) => m,
        Err(e) => panic!("not a CM MAD: {e}"),
    }
}

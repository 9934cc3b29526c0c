//! Golden vectors: every CM message written byte by byte from the IBTA layout
//! (IBTA Vol 1 chapter 12's tables, absolute offsets = data offset + 24), with
//! distinctive values in every field, independently of the codec's own constants.
//! `emit` must produce exactly these bytes and `parse` must give back the repr.

// Tests may unwrap (clippy.toml allows it in #[test] fns; helpers here too).
#![allow(clippy::unwrap_used)]

use pvcm_wire::cm::{
    AprStatus, CmMad, CmRepr, FailoverAccepted, MsgResponse, PathRepr, RejReason, SidrStatus,
    TransportService, apr, class_port_info, drep, dreq, lap, mra, rej, rep, req, rtu, sidr_rep,
    sidr_req,
};
use pvcm_wire::mad::{AttributeId, Header, Method};
use pvcm_wire::{Error, Gid};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Writes a CM MAD header by hand.
fn put_header(b: &mut [u8; 256], method: u8, attr: u8) {
    b[0] = 0x01; // base version
    b[1] = 0x07; // management class: CM
    b[2] = 0x02; // class version
    b[3] = method; // method
    b[4..6].copy_from_slice(&[0x0A, 0x0B]); // status
    b[6..8].copy_from_slice(&[0x0C, 0x0D]); // class specific
    b[8..16].copy_from_slice(&[0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80]); // TID
    b[16..18].copy_from_slice(&[0x00, attr]); // attribute ID
    // 18..20 reserved
    b[20..24].copy_from_slice(&[0x0E, 0x0F, 0x1A, 0x1B]); // attribute modifier
}

/// The header `put_header` writes.
fn header(method: Method, attr_id: AttributeId) -> Header {
    Header {
        method,
        status: 0x0A0B,
        class_specific: 0x0C0D,
        tid: 0x1020_3040_5060_7080,
        attr_id,
        attr_mod: 0x0E0F_1A1B,
    }
}

/// Private data / info pattern: distinct, mostly non-zero bytes.
fn pat(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| seed ^ (i as u8).wrapping_mul(7).wrapping_add(1))
        .collect()
}

fn assert_bytes(got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len());
    let diffs: Vec<String> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| g != w)
        .map(|(i, (g, w))| format!("byte {i}: got {g:#04x}, want {w:#04x}"))
        .collect();
    assert!(
        diffs.is_empty(),
        "{} bytes differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}

/// `CmRepr::emit` (into a dirty buffer) gives the golden bytes, `CmRepr::parse` of the
/// golden bytes gives the header and repr back.
fn check_golden(golden: &[u8; 256], h: Header, repr: CmRepr<'_>) {
    let mut out = [0xEEu8; 256];
    repr.emit(&h, &mut out).unwrap();
    assert_bytes(&out, golden);
    let (ph, pr) = CmRepr::parse(golden).unwrap();
    assert_eq!(ph, h);
    assert_eq!(pr, repr);
    let line = repr.to_string();
    assert!(!line.contains('\n'), "{line}");
    assert!(line.starts_with(&h.attr_id.to_string()), "{line}");
}

/// A message module's own `emit` writes bytes 24..256 and never the header.
macro_rules! module_emit {
    ($m:ident, $repr:expr, $golden:expr) => {{
        let mut out = [0xEEu8; 256];
        $repr
            .emit(&mut $m::Packet::new_unchecked(&mut out[..]))
            .unwrap();
        assert_eq!(&out[..24], &[0xEEu8; 24][..], "header touched");
        assert_bytes(&out[24..], &$golden[24..]);
        let p = $m::Packet::new_checked(&$golden[..]).unwrap();
        assert_eq!($m::Repr::parse(&p).unwrap(), $repr);
    }};
}

/// What the generic `CmMad` accessors must answer for one golden.
#[derive(Default)]
struct Accessors {
    local_comm_id: Option<u32>,
    remote_comm_id: Option<u32>,
    sidr_request_id: Option<u32>,
    req_primary_local_gid: Option<Gid>,
    req_primary_remote_gid: Option<Gid>,
    local_ca_guid: Option<u64>,
    local_qpn: Option<u32>,
    remote_qpn: Option<u32>,
    rej_reason: Option<u16>,
    rej_ari: Option<Vec<u8>>,
    rej_timeout_ca_guid: Option<u64>,
    msg_response: Option<u8>,
    mra_service_timeout: Option<u8>,
}

fn check_accessors(golden: &[u8; 256], attr: AttributeId, method: u8, e: Accessors) {
    let m = CmMad::new_checked(&golden[..]).unwrap();
    assert_eq!(m.attr(), attr);
    assert_eq!(m.tid(), 0x1020_3040_5060_7080);
    assert_eq!(m.method(), method);
    assert_eq!(m.local_comm_id(), e.local_comm_id, "local_comm_id");
    assert_eq!(m.remote_comm_id(), e.remote_comm_id, "remote_comm_id");
    assert_eq!(m.sidr_request_id(), e.sidr_request_id, "sidr_request_id");
    assert_eq!(
        m.req_primary_local_gid(),
        e.req_primary_local_gid,
        "req local gid"
    );
    assert_eq!(
        m.req_primary_remote_gid(),
        e.req_primary_remote_gid,
        "req remote gid"
    );
    assert_eq!(m.local_ca_guid(), e.local_ca_guid, "local_ca_guid");
    assert_eq!(m.local_qpn(), e.local_qpn, "local_qpn");
    assert_eq!(m.remote_qpn(), e.remote_qpn, "remote_qpn");
    assert_eq!(m.rej_reason(), e.rej_reason, "rej_reason");
    assert_eq!(m.rej_ari().map(<[u8]>::to_vec), e.rej_ari, "rej_ari");
    assert_eq!(
        m.rej_timeout_ca_guid(),
        e.rej_timeout_ca_guid,
        "rej_timeout_ca_guid"
    );
    assert_eq!(m.msg_response(), e.msg_response, "msg_response");
    assert_eq!(
        m.mra_service_timeout(),
        e.mra_service_timeout,
        "mra_service_timeout"
    );
}

/// Offsets at which two buffers differ.
fn changed(a: &[u8], b: &[u8]) -> Vec<usize> {
    (0..a.len()).filter(|&i| a[i] != b[i]).collect()
}

// Distinct GIDs, written as literal wire bytes.
const GID_A: [u8; 16] = [
    0xFE, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x02, 0xC9, 0x03, 0x00, 0xA1, 0xA2, 0xA3,
];
const GID_B: [u8; 16] = [
    0xFE, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x02, 0xC9, 0x03, 0x00, 0xB1, 0xB2, 0xB3,
];
const GID_C: [u8; 16] = [
    0x20, 0x01, 0x0D, 0xB8, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0xC1, 0xC2, 0xC3,
];
const GID_D: [u8; 16] = [
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xFF, 0xFF, 0xC0, 0x00, 0x02, 0x07,
];

// ---------------------------------------------------------------------------------------
// REQ
// ---------------------------------------------------------------------------------------

fn req_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x10);
    b[24..28].copy_from_slice(&[0x11, 0x22, 0x33, 0x44]); // Local Comm ID
    // 28 reserved
    b[29..32].copy_from_slice(&[0xA1, 0xB2, 0xC3]); // vendor ID (ECE)
    b[32..40].copy_from_slice(&[0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08]); // Service ID
    b[40..48].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0x00, 0xAB, 0xCD, 0xEF]); // Local CA GUID
    // 48..52 reserved
    b[52..56].copy_from_slice(&[0x5A, 0x5B, 0x5C, 0x5D]); // Local Q_Key
    b[56..59].copy_from_slice(&[0x12, 0x34, 0x56]); // Local QPN
    b[59] = 0x7E; // Responder Resources
    b[60..63].copy_from_slice(&[0x65, 0x43, 0x21]); // Local EECN
    b[63] = 0x3C; // Initiator Depth
    b[64..67].copy_from_slice(&[0xAB, 0xCD, 0xEF]); // Remote EECN
    // Remote CM Response Timeout 21 | Transport Service Type 3 (XRC) | E2E flow control 1
    b[67] = (0x15 << 3) | (3 << 1) | 1;
    b[68..71].copy_from_slice(&[0xFE, 0xDC, 0xBA]); // Starting PSN
    b[71] = (0x13 << 3) | 5; // Local CM Response Timeout 19 | Retry Count 5
    b[72..74].copy_from_slice(&[0x80, 0x01]); // Partition Key
    b[74] = (5 << 4) | (1 << 3) | 6; // Path MTU 5 | RDC exists | RNR Retry Count 6
    b[75] = (0xB << 4) | (1 << 3) | 1; // Max CM Retries 11 | SRQ | Extended Transport 1
    // Primary path
    b[76..78].copy_from_slice(&[0x13, 0x57]); // Primary Local Port LID
    b[78..80].copy_from_slice(&[0x24, 0x68]); // Primary Remote Port LID
    b[80..96].copy_from_slice(&GID_A); // Primary Local Port GID
    b[96..112].copy_from_slice(&GID_B); // Primary Remote Port GID
    b[112..115].copy_from_slice(&[0xAB, 0xCD, 0xE0]); // Primary Flow Label 0xABCDE (20 bits)
    b[115] = 0x2B; // Primary Packet Rate (6 bits)
    b[116] = 0x8C; // Primary Traffic Class
    b[117] = 0x40; // Primary Hop Limit
    b[118] = (0xD << 4) | (1 << 3); // Primary SL 13 | Subnet Local
    b[119] = 0x11 << 3; // Primary Local ACK Timeout 17
    // Alternate path
    b[120..122].copy_from_slice(&[0x9A, 0xBC]); // Alternate Local Port LID
    b[122..124].copy_from_slice(&[0xDE, 0xF0]); // Alternate Remote Port LID
    b[124..140].copy_from_slice(&GID_C); // Alternate Local Port GID
    b[140..156].copy_from_slice(&GID_D); // Alternate Remote Port GID
    b[156..159].copy_from_slice(&[0x12, 0x34, 0x50]); // Alternate Flow Label 0x12345
    b[159] = 0x07; // Alternate Packet Rate
    b[160] = 0x21; // Alternate Traffic Class
    b[161] = 0x05; // Alternate Hop Limit
    b[162] = 0x3 << 4; // Alternate SL 3 | not subnet local
    b[163] = (0x1F << 3) | (1 << 2); // Alternate Local ACK Timeout 31 | SAP Supported
    b[164..256].copy_from_slice(&pat(92, 0x10)); // Private Data (92)
    b
}

fn req_repr(pd: &[u8]) -> req::Repr<'_> {
    req::Repr {
        local_comm_id: 0x1122_3344,
        vendor_id: 0xA1_B2C3,
        service_id: 0x0102_0304_0506_0708,
        local_ca_guid: 0x0002_C903_00AB_CDEF,
        local_qkey: 0x5A5B_5C5D,
        local_qpn: 0x12_3456,
        responder_resources: 0x7E,
        local_eecn: 0x65_4321,
        initiator_depth: 0x3C,
        remote_eecn: 0xAB_CDEF,
        remote_cm_response_timeout: 21,
        transport: TransportService::Xrc,
        end_to_end_flow_control: true,
        starting_psn: 0xFE_DCBA,
        local_cm_response_timeout: 19,
        retry_count: 5,
        partition_key: 0x8001,
        path_mtu: 5,
        rdc_exists: true,
        rnr_retry_count: 6,
        max_cm_retries: 11,
        srq: true,
        primary_path: PathRepr {
            local_lid: 0x1357,
            remote_lid: 0x2468,
            local_gid: Gid(GID_A),
            remote_gid: Gid(GID_B),
            flow_label: 0xABCDE,
            packet_rate: 0x2B,
            traffic_class: 0x8C,
            hop_limit: 0x40,
            sl: 13,
            subnet_local: true,
            local_ack_timeout: 17,
        },
        alternate_path: PathRepr {
            local_lid: 0x9ABC,
            remote_lid: 0xDEF0,
            local_gid: Gid(GID_C),
            remote_gid: Gid(GID_D),
            flow_label: 0x12345,
            packet_rate: 0x07,
            traffic_class: 0x21,
            hop_limit: 0x05,
            sl: 3,
            subnet_local: false,
            local_ack_timeout: 31,
        },
        sap_supported: true,
        private_data: pd,
    }
}

#[test]
fn golden_req() {
    let g = req_golden();
    let pd = pat(92, 0x10);
    let r = req_repr(&pd);
    check_golden(&g, header(Method::Send, AttributeId::Req), CmRepr::Req(r));
    module_emit!(req, r, g);
    check_accessors(
        &g,
        AttributeId::Req,
        0x03,
        Accessors {
            local_comm_id: Some(0x1122_3344),
            req_primary_local_gid: Some(Gid(GID_A)),
            req_primary_remote_gid: Some(Gid(GID_B)),
            local_ca_guid: Some(0x0002_C903_00AB_CDEF),
            local_qpn: Some(0x12_3456),
            ..Default::default()
        },
    );
    let p = req::Packet::new_checked(&g[..]).unwrap();
    assert_eq!(
        p.primary_remote_port_gid().interface_id(),
        0x0002_C903_00B1_B2B3
    );
    assert_eq!(p.vendor_id(), 0xA1_B2C3);
}

#[test]
fn req_has_no_remote_comm_id() {
    let mut g = req_golden();
    let before = g;
    let mut m = CmMad::new_checked(&mut g[..]).unwrap();
    assert_eq!(
        m.set_remote_comm_id(0xDEAD_BEEF),
        Err(Error::NoField {
            attr: 0x0010,
            field: "remote_comm_id"
        })
    );
    assert_eq!(
        m.set_sidr_request_id(1),
        Err(Error::NoField {
            attr: 0x0010,
            field: "sidr_request_id"
        })
    );
    assert_eq!(g, before, "a failed setter wrote something");
    assert_eq!(&g[28..32], &[0x00, 0xA1, 0xB2, 0xC3]);
    let mut m = CmMad::new_checked(&mut g[..]).unwrap();
    m.set_local_comm_id(0x0102_0304).unwrap();
    m.set_tid(0x0A0B_0C0D_0E0F_1011);
    assert_eq!(
        changed(&before, &g),
        [8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27]
    );
    assert_eq!(&g[24..28], &[0x01, 0x02, 0x03, 0x04]);
    assert_eq!(&g[8..16], &[0x0A, 0x0B, 0x0C, 0x0D, 0x0E, 0x0F, 0x10, 0x11]);
}

// ---------------------------------------------------------------------------------------
// MRA
// ---------------------------------------------------------------------------------------

fn mra_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x11);
    b[24..28].copy_from_slice(&[0x1A, 0x2B, 0x3C, 0x4D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0x5E, 0x6F, 0x70, 0x81]); // Remote Comm ID
    b[32] = 2 << 6; // Message MRAed: OTHER (2)
    b[33] = 24 << 3; // Service Timeout 24
    b[34..256].copy_from_slice(&pat(222, 0x21)); // Private Data (222)
    b
}

#[test]
fn golden_mra() {
    let g = mra_golden();
    let pd = pat(222, 0x21);
    let r = mra::Repr {
        local_comm_id: 0x1A2B_3C4D,
        remote_comm_id: 0x5E6F_7081,
        message_mraed: MsgResponse::Other,
        service_timeout: 24,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Mra), CmRepr::Mra(r));
    module_emit!(mra, r, g);
    check_accessors(
        &g,
        AttributeId::Mra,
        0x03,
        Accessors {
            local_comm_id: Some(0x1A2B_3C4D),
            remote_comm_id: Some(0x5E6F_7081),
            msg_response: Some(2),
            mra_service_timeout: Some(24),
            ..Default::default()
        },
    );
}

#[test]
fn short_private_data_is_zero_padded() {
    let pd = [0xAA, 0xBB, 0xCC];
    let r = mra::Repr {
        local_comm_id: 1,
        remote_comm_id: 2,
        message_mraed: MsgResponse::Req,
        service_timeout: 3,
        private_data: &pd,
    };
    let mut out = [0xEEu8; 256];
    CmRepr::Mra(r)
        .emit(&Header::cm_send(AttributeId::Mra, 9), &mut out)
        .unwrap();
    assert_eq!(&out[34..37], &pd);
    assert!(out[37..].iter().all(|&x| x == 0));
    let (_, parsed) = CmRepr::parse(&out).unwrap();
    let CmRepr::Mra(p) = parsed else {
        panic!("not an MRA")
    };
    assert_eq!(p.private_data.len(), mra::PRIVATE_DATA_LEN);
    assert_eq!(&p.private_data[..3], &pd);
}

// ---------------------------------------------------------------------------------------
// REJ
// ---------------------------------------------------------------------------------------

/// REJ(TIMEOUT) as core CM sends it: Remote Comm ID 0, ARI = sender's CA GUID.
fn rej_timeout_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x12);
    b[24..28].copy_from_slice(&[0x2A, 0x3B, 0x4C, 0x5D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0x00, 0x00, 0x00, 0x00]); // Remote Comm ID 0
    b[32] = 1 << 6; // Message Rejected: REP (1)
    b[33] = 8 << 1; // Rejected Info Length 8
    b[34..36].copy_from_slice(&[0x00, 0x04]); // Reason: TIMEOUT (4)
    b[36..44].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0x00, 0x11, 0x22, 0x33]); // ARI: CA GUID
    b[108..256].copy_from_slice(&pat(148, 0x32)); // Private Data (148)
    b
}

/// REJ with a full 72-byte ARI and a high reason code.
fn rej_full_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x12);
    b[24..28].copy_from_slice(&[0x6A, 0x7B, 0x8C, 0x9D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0xA1, 0xB2, 0xC3, 0xD4]); // Remote Comm ID
    b[32] = 2 << 6; // Message Rejected: OTHER (2)
    b[33] = 72 << 1; // Rejected Info Length 72
    b[34..36].copy_from_slice(&[0x00, 0x23]); // Reason: VENDOR_OPTION_NOT_SUPPORTED (35)
    b[36..108].copy_from_slice(&pat(72, 0x43)); // ARI (72)
    b[108..256].copy_from_slice(&pat(148, 0x54)); // Private Data (148)
    b
}

#[test]
fn golden_rej_timeout() {
    let g = rej_timeout_golden();
    let pd = pat(148, 0x32);
    let ari = [0x00, 0x02, 0xC9, 0x03, 0x00, 0x11, 0x22, 0x33];
    let r = rej::Repr {
        local_comm_id: 0x2A3B_4C5D,
        remote_comm_id: 0,
        message_rejected: MsgResponse::Rep,
        reason: RejReason::Timeout,
        ari: &ari,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Rej), CmRepr::Rej(r));
    module_emit!(rej, r, g);
    assert_eq!(r.timeout_ca_guid(), Some(0x0002_C903_0011_2233));
    check_accessors(
        &g,
        AttributeId::Rej,
        0x03,
        Accessors {
            local_comm_id: Some(0x2A3B_4C5D),
            remote_comm_id: Some(0),
            rej_reason: Some(4),
            rej_ari: Some(ari.to_vec()),
            rej_timeout_ca_guid: Some(0x0002_C903_0011_2233),
            msg_response: Some(1),
            ..Default::default()
        },
    );
}

#[test]
fn golden_rej_full_ari() {
    let g = rej_full_golden();
    let pd = pat(148, 0x54);
    let ari = pat(72, 0x43);
    let r = rej::Repr {
        local_comm_id: 0x6A7B_8C9D,
        remote_comm_id: 0xA1B2_C3D4,
        message_rejected: MsgResponse::Other,
        reason: RejReason::VendorOptionNotSupported,
        ari: &ari,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Rej), CmRepr::Rej(r));
    module_emit!(rej, r, g);
    assert_eq!(r.timeout_ca_guid(), None);
    check_accessors(
        &g,
        AttributeId::Rej,
        0x03,
        Accessors {
            local_comm_id: Some(0x6A7B_8C9D),
            remote_comm_id: Some(0xA1B2_C3D4),
            rej_reason: Some(35),
            rej_ari: Some(ari.clone()),
            msg_response: Some(2),
            ..Default::default()
        },
    );
}

#[test]
fn rej_set_ari_rewrites_length_and_bytes() {
    let mut g = rej_full_golden();
    let before = g;
    let mut p = rej::Packet::new_checked(&mut g[..]).unwrap();
    assert_eq!(
        p.set_ari(&[0u8; 73]),
        Err(Error::TooLong {
            field: "ari",
            len: 73,
            max: 72
        })
    );
    p.set_ari(&[0x99, 0x88]).unwrap();
    assert_eq!(p.ari().unwrap(), &[0x99, 0x88]);
    assert!(
        changed(&before, &g)
            .iter()
            .all(|&i| i == 33 || (36..108).contains(&i))
    );
    assert_eq!(g[33], 2 << 1);
    assert!(g[38..108].iter().all(|&x| x == 0));
    assert_eq!(&g[108..], &before[108..]);
}

// ---------------------------------------------------------------------------------------
// REP
// ---------------------------------------------------------------------------------------

fn rep_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x13);
    b[24..28].copy_from_slice(&[0x3A, 0x4B, 0x5C, 0x6D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0x11, 0x22, 0x33, 0x44]); // Remote Comm ID
    b[32..36].copy_from_slice(&[0x9A, 0x8B, 0x7C, 0x6D]); // Local Q_Key
    b[36..39].copy_from_slice(&[0x0A, 0x0B, 0x0C]); // Local QPN
    b[39] = 0xE1; // Vendor ID H
    b[40..43].copy_from_slice(&[0x1D, 0x2E, 0x3F]); // Local EE Context Number
    b[43] = 0xE2; // Vendor ID M
    b[44..47].copy_from_slice(&[0x4A, 0x5B, 0x6C]); // Starting PSN
    b[47] = 0xE3; // Vendor ID L
    b[48] = 0x10; // Responder Resources
    b[49] = 0x20; // Initiator Depth
    b[50] = (0x12 << 3) | (2 << 1) | 1; // Target ACK Delay 18 | Failover REJECTED (2) | E2E
    b[51] = (5 << 5) | (1 << 4); // RNR Retry Count 5 | SRQ
    b[52..60].copy_from_slice(&[0x00, 0x02, 0xC9, 0x03, 0x00, 0x44, 0x55, 0x66]); // Local CA GUID
    b[60..256].copy_from_slice(&pat(196, 0x65)); // Private Data (196)
    b
}

#[test]
fn golden_rep() {
    let g = rep_golden();
    let pd = pat(196, 0x65);
    let r = rep::Repr {
        local_comm_id: 0x3A4B_5C6D,
        remote_comm_id: 0x1122_3344,
        local_qkey: 0x9A8B_7C6D,
        local_qpn: 0x0A_0B0C,
        vendor_id: 0xE1_E2E3,
        local_eecn: 0x1D_2E3F,
        starting_psn: 0x4A_5B6C,
        responder_resources: 0x10,
        initiator_depth: 0x20,
        target_ack_delay: 18,
        failover_accepted: FailoverAccepted::Rejected,
        end_to_end_flow_control: true,
        rnr_retry_count: 5,
        srq: true,
        local_ca_guid: 0x0002_C903_0044_5566,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Rep), CmRepr::Rep(r));
    module_emit!(rep, r, g);
    check_accessors(
        &g,
        AttributeId::Rep,
        0x03,
        Accessors {
            local_comm_id: Some(0x3A4B_5C6D),
            remote_comm_id: Some(0x1122_3344),
            local_ca_guid: Some(0x0002_C903_0044_5566),
            local_qpn: Some(0x0A_0B0C),
            ..Default::default()
        },
    );
    let p = rep::Packet::new_checked(&g[..]).unwrap();
    assert_eq!(
        (p.vendor_id_h(), p.vendor_id_m(), p.vendor_id_l()),
        (0xE1, 0xE2, 0xE3)
    );
}

#[test]
fn rep_setters_touch_only_their_bytes() {
    let mut g = rep_golden();
    let before = g;
    let mut p = rep::Packet::new_checked(&mut g[..]).unwrap();
    p.set_local_qpn(0x00FF_FFFF);
    assert_eq!(changed(&before, &g), [36, 37, 38]);
    let mut p = rep::Packet::new_checked(&mut g[..]).unwrap();
    p.set_local_ca_guid(0x0102_0304_0506_0708);
    p.set_local_comm_id(0xAAAA_AAAA);
    p.set_remote_comm_id(0xBBBB_BBBB);
    let c = changed(&before, &g);
    assert!(
        c.iter()
            .all(|&i| (24..32).contains(&i) || (36..39).contains(&i) || (52..60).contains(&i))
    );
    assert_eq!(g[39], 0xE1, "vendor ID H clobbered");
}

// ---------------------------------------------------------------------------------------
// RTU, DREQ, DREP
// ---------------------------------------------------------------------------------------

fn rtu_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x14);
    b[24..28].copy_from_slice(&[0x4A, 0x5B, 0x6C, 0x7D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0x8E, 0x9F, 0xA0, 0xB1]); // Remote Comm ID
    b[32..256].copy_from_slice(&pat(224, 0x76)); // Private Data (224)
    b
}

#[test]
fn golden_rtu() {
    let g = rtu_golden();
    let pd = pat(224, 0x76);
    let r = rtu::Repr {
        local_comm_id: 0x4A5B_6C7D,
        remote_comm_id: 0x8E9F_A0B1,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Rtu), CmRepr::Rtu(r));
    module_emit!(rtu, r, g);
    check_accessors(
        &g,
        AttributeId::Rtu,
        0x03,
        Accessors {
            local_comm_id: Some(0x4A5B_6C7D),
            remote_comm_id: Some(0x8E9F_A0B1),
            ..Default::default()
        },
    );
}

fn dreq_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x15);
    b[24..28].copy_from_slice(&[0x5A, 0x6B, 0x7C, 0x8D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0x9E, 0xAF, 0xB0, 0xC1]); // Remote Comm ID
    b[32..35].copy_from_slice(&[0x7A, 0x6B, 0x5C]); // Remote QPN/EECN
    // 35 reserved
    b[36..256].copy_from_slice(&pat(220, 0x87)); // Private Data (220)
    b
}

#[test]
fn golden_dreq() {
    let g = dreq_golden();
    let pd = pat(220, 0x87);
    let r = dreq::Repr {
        local_comm_id: 0x5A6B_7C8D,
        remote_comm_id: 0x9EAF_B0C1,
        remote_qpn_eecn: 0x7A_6B5C,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Dreq), CmRepr::Dreq(r));
    module_emit!(dreq, r, g);
    check_accessors(
        &g,
        AttributeId::Dreq,
        0x03,
        Accessors {
            local_comm_id: Some(0x5A6B_7C8D),
            remote_comm_id: Some(0x9EAF_B0C1),
            remote_qpn: Some(0x7A_6B5C),
            ..Default::default()
        },
    );
    let mut g2 = g;
    dreq::Packet::new_checked(&mut g2[..])
        .unwrap()
        .set_remote_qpn_eecn(0x01_0203);
    assert_eq!(changed(&g, &g2), [32, 33, 34]);
}

fn drep_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x16);
    b[24..28].copy_from_slice(&[0x6A, 0x7B, 0x8C, 0x9D]); // Local Comm ID
    b[28..32].copy_from_slice(&[0xAE, 0xBF, 0xC0, 0xD1]); // Remote Comm ID
    b[32..256].copy_from_slice(&pat(224, 0x98)); // Private Data (224)
    b
}

#[test]
fn golden_drep() {
    let g = drep_golden();
    let pd = pat(224, 0x98);
    let r = drep::Repr {
        local_comm_id: 0x6A7B_8C9D,
        remote_comm_id: 0xAEBF_C0D1,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Drep), CmRepr::Drep(r));
    module_emit!(drep, r, g);
    check_accessors(
        &g,
        AttributeId::Drep,
        0x03,
        Accessors {
            local_comm_id: Some(0x6A7B_8C9D),
            remote_comm_id: Some(0xAEBF_C0D1),
            ..Default::default()
        },
    );
}

// ---------------------------------------------------------------------------------------
// SIDR_REQ, SIDR_REP
// ---------------------------------------------------------------------------------------

fn sidr_req_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x17);
    b[24..28].copy_from_slice(&[0x7A, 0x8B, 0x9C, 0xAD]); // RequestID
    b[28..30].copy_from_slice(&[0x80, 0x05]); // Partition Key
    // 30..32 reserved
    b[32..40].copy_from_slice(&[0x00, 0x00, 0x00, 0x00, 0x01, 0x06, 0x12, 0x34]); // Service ID
    b[40..256].copy_from_slice(&pat(216, 0xA9)); // Private Data (216)
    b
}

#[test]
fn golden_sidr_req() {
    let g = sidr_req_golden();
    let pd = pat(216, 0xA9);
    let r = sidr_req::Repr {
        request_id: 0x7A8B_9CAD,
        partition_key: 0x8005,
        service_id: 0x0000_0000_0106_1234,
        private_data: &pd,
    };
    check_golden(
        &g,
        header(Method::Send, AttributeId::SidrReq),
        CmRepr::SidrReq(r),
    );
    module_emit!(sidr_req, r, g);
    check_accessors(
        &g,
        AttributeId::SidrReq,
        0x03,
        Accessors {
            sidr_request_id: Some(0x7A8B_9CAD),
            ..Default::default()
        },
    );
    let mut g2 = g;
    let mut m = CmMad::new_checked(&mut g2[..]).unwrap();
    assert_eq!(
        m.set_local_comm_id(5),
        Err(Error::NoField {
            attr: 0x0017,
            field: "local_comm_id"
        })
    );
    m.set_sidr_request_id(0x0102_0304).unwrap();
    assert_eq!(changed(&g, &g2), [24, 25, 26, 27]);
}

fn sidr_rep_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x18);
    b[24..28].copy_from_slice(&[0x8A, 0x9B, 0xAC, 0xBD]); // RequestID
    b[28] = 4; // Status: REDIRECT
    b[29] = 20; // Additional Information Length
    b[30..32].copy_from_slice(&[0xB1, 0xB2]); // Vendor ID H (16 bits)
    b[32..35].copy_from_slice(&[0xC1, 0xC2, 0xC3]); // QPN
    b[35] = 0xB3; // Vendor ID L
    b[36..44].copy_from_slice(&[0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0xAB, 0xCD]); // Service ID
    b[44..48].copy_from_slice(&[0x80, 0x01, 0x02, 0x03]); // Q_Key
    b[48..68].copy_from_slice(&pat(20, 0xBA)); // Additional Information (20 of 72)
    b[120..256].copy_from_slice(&pat(136, 0xCB)); // Private Data (136)
    b
}

#[test]
fn golden_sidr_rep() {
    let g = sidr_rep_golden();
    let pd = pat(136, 0xCB);
    let info = pat(20, 0xBA);
    let r = sidr_rep::Repr {
        request_id: 0x8A9B_ACBD,
        status: SidrStatus::Redirect,
        vendor_id: 0xB1_B2B3,
        qpn: 0xC1_C2C3,
        service_id: 0x1000_0000_0000_ABCD,
        qkey: 0x8001_0203,
        additional_info: &info,
        private_data: &pd,
    };
    check_golden(
        &g,
        header(Method::Send, AttributeId::SidrRep),
        CmRepr::SidrRep(r),
    );
    module_emit!(sidr_rep, r, g);
    check_accessors(
        &g,
        AttributeId::SidrRep,
        0x03,
        Accessors {
            sidr_request_id: Some(0x8A9B_ACBD),
            local_qpn: Some(0xC1_C2C3),
            ..Default::default()
        },
    );
    let mut g2 = g;
    sidr_rep::Packet::new_checked(&mut g2[..])
        .unwrap()
        .set_qpn(0x0F_0E0D);
    assert_eq!(changed(&g, &g2), [32, 33, 34]);
}

// ---------------------------------------------------------------------------------------
// LAP, APR
// ---------------------------------------------------------------------------------------

fn lap_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x19);
    b[24..28].copy_from_slice(&[0x9A, 0xAB, 0xBC, 0xCD]); // Local Comm ID
    b[28..32].copy_from_slice(&[0xDE, 0xEF, 0xF0, 0x01]); // Remote Comm ID
    // 32..36 reserved
    b[36..39].copy_from_slice(&[0x33, 0x44, 0x55]); // Remote QPN/EECN
    b[39] = 0x17 << 3; // Remote CM Response Timeout 23
    // 40..44 reserved
    b[44..46].copy_from_slice(&[0x01, 0x23]); // Alternate Local Port LID
    b[46..48].copy_from_slice(&[0x45, 0x67]); // Alternate Remote Port LID
    b[48..64].copy_from_slice(&GID_C); // Alternate Local Port GID
    b[64..80].copy_from_slice(&GID_A); // Alternate Remote Port GID
    b[80..83].copy_from_slice(&[0xFE, 0xDC, 0xB0]); // Alternate Flow Label 0xFEDCB
    b[83] = 0x64; // Alternate Traffic Class
    b[84] = 0x0F; // Alternate Hop Limit
    b[85] = 0x25; // Alternate Packet Rate (6 bits)
    b[86] = (0x9 << 4) | (1 << 3); // Alternate SL 9 | Subnet Local
    b[87] = 0x0E << 3; // Alternate Local ACK Timeout 14
    b[88..256].copy_from_slice(&pat(168, 0xDC)); // Private Data (168)
    b
}

#[test]
fn golden_lap() {
    let g = lap_golden();
    let pd = pat(168, 0xDC);
    let r = lap::Repr {
        local_comm_id: 0x9AAB_BCCD,
        remote_comm_id: 0xDEEF_F001,
        remote_qpn_eecn: 0x33_4455,
        remote_cm_response_timeout: 23,
        alternate_path: PathRepr {
            local_lid: 0x0123,
            remote_lid: 0x4567,
            local_gid: Gid(GID_C),
            remote_gid: Gid(GID_A),
            flow_label: 0xFEDCB,
            packet_rate: 0x25,
            traffic_class: 0x64,
            hop_limit: 0x0F,
            sl: 9,
            subnet_local: true,
            local_ack_timeout: 14,
        },
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Lap), CmRepr::Lap(r));
    module_emit!(lap, r, g);
    check_accessors(
        &g,
        AttributeId::Lap,
        0x03,
        Accessors {
            local_comm_id: Some(0x9AAB_BCCD),
            remote_comm_id: Some(0xDEEF_F001),
            remote_qpn: Some(0x33_4455),
            ..Default::default()
        },
    );
    // The per-field getters agree with the path reader.
    let p = lap::Packet::new_checked(&g[..]).unwrap();
    assert_eq!(p.alternate_local_port_lid(), 0x0123);
    assert_eq!(p.alternate_remote_port_lid(), 0x4567);
    assert_eq!(p.alternate_local_port_gid(), Gid(GID_C));
    assert_eq!(p.alternate_remote_port_gid(), Gid(GID_A));
    assert_eq!(p.alternate_flow_label(), 0xFEDCB);
    assert_eq!(p.alternate_traffic_class(), 0x64);
    assert_eq!(p.alternate_hop_limit(), 0x0F);
    assert_eq!(p.alternate_packet_rate(), 0x25);
    assert_eq!(p.alternate_sl(), 9);
    assert!(p.alternate_subnet_local());
    assert_eq!(p.alternate_local_ack_timeout(), 14);
    let mut g2 = g;
    let mut p = lap::Packet::new_checked(&mut g2[..]).unwrap();
    p.set_remote_qpn_eecn(0x0A_0B0C);
    p.set_alternate_local_port_gid(Gid(GID_D));
    p.set_alternate_remote_port_gid(Gid(GID_B));
    assert!(
        changed(&g, &g2)
            .iter()
            .all(|&i| (36..39).contains(&i) || (48..80).contains(&i))
    );
    assert_eq!(&g2[36..40], &[0x0A, 0x0B, 0x0C, 0x17 << 3]);
}

fn apr_golden() -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, 0x03, 0x1A);
    b[24..28].copy_from_slice(&[0xAA, 0xBB, 0xCC, 0xDD]); // Local Comm ID
    b[28..32].copy_from_slice(&[0xEE, 0xFF, 0x01, 0x12]); // Remote Comm ID
    b[32] = 72; // Additional Information Length
    b[33] = 13; // AR Status: INVALID_SL
    // 34..36 reserved
    b[36..108].copy_from_slice(&pat(72, 0xED)); // Additional Information (72)
    b[108..256].copy_from_slice(&pat(148, 0xFE)); // Private Data (148)
    b
}

#[test]
fn golden_apr() {
    let g = apr_golden();
    let pd = pat(148, 0xFE);
    let info = pat(72, 0xED);
    let r = apr::Repr {
        local_comm_id: 0xAABB_CCDD,
        remote_comm_id: 0xEEFF_0112,
        ar_status: AprStatus::InvalidSl,
        additional_info: &info,
        private_data: &pd,
    };
    check_golden(&g, header(Method::Send, AttributeId::Apr), CmRepr::Apr(r));
    module_emit!(apr, r, g);
    check_accessors(
        &g,
        AttributeId::Apr,
        0x03,
        Accessors {
            local_comm_id: Some(0xAABB_CCDD),
            remote_comm_id: Some(0xEEFF_0112),
            ..Default::default()
        },
    );
}

// ---------------------------------------------------------------------------------------
// ClassPortInfo
// ---------------------------------------------------------------------------------------

fn cpi_golden(method: u8) -> [u8; 256] {
    let mut b = [0u8; 256];
    put_header(&mut b, method, 0x01);
    b[24] = 0x01; // BaseVersion
    b[25] = 0x02; // ClassVersion
    b[26..28].copy_from_slice(&[0x01, 0x40]); // CapabilityMask
    // CapabilityMask2 0x2345678 (27 bits) << 5 | RespTimeValue 19 (5 bits)
    b[28..32].copy_from_slice(&[0x46, 0x8A, 0xCF, 0x13]);
    b[32..48].copy_from_slice(&GID_B); // RedirectGID
    // RedirectTC 0xB8 | RedirectSL 6 | RedirectFL 0x9ABCD
    b[48..52].copy_from_slice(&[0xB8, 0x69, 0xAB, 0xCD]);
    b[52..54].copy_from_slice(&[0x0C, 0x0D]); // RedirectLID
    b[54..56].copy_from_slice(&[0x7F, 0xFF]); // RedirectP_Key
    b[56..60].copy_from_slice(&[0x00, 0x0E, 0x0F, 0x10]); // reserved | RedirectQP
    b[60..64].copy_from_slice(&[0x80, 0x01, 0x00, 0x00]); // RedirectQ_Key
    b[64..80].copy_from_slice(&GID_D); // TrapGID
    // TrapTC 0x2C | TrapSL 10 | TrapFL 0x54321
    b[80..84].copy_from_slice(&[0x2C, 0xA5, 0x43, 0x21]);
    b[84..86].copy_from_slice(&[0x11, 0x12]); // TrapLID
    b[86..88].copy_from_slice(&[0x13, 0x14]); // TrapP_Key
    b[88..92].copy_from_slice(&[0x40, 0x15, 0x16, 0x17]); // TrapHL 0x40 | TrapQP
    b[92..96].copy_from_slice(&[0x18, 0x19, 0x1A, 0x1B]); // TrapQ_Key
    b
}

fn cpi_repr() -> class_port_info::Repr {
    class_port_info::Repr {
        base_version: 1,
        class_version: 2,
        capability_mask: 0x0140,
        cap_mask2: 0x234_5678,
        resp_time: 19,
        redirect_gid: Gid(GID_B),
        redirect_tc: 0xB8,
        redirect_sl: 6,
        redirect_fl: 0x9ABCD,
        redirect_lid: 0x0C0D,
        redirect_pkey: 0x7FFF,
        redirect_qp: 0x0E_0F10,
        redirect_qkey: 0x8001_0000,
        trap_gid: Gid(GID_D),
        trap_tc: 0x2C,
        trap_sl: 10,
        trap_fl: 0x54321,
        trap_lid: 0x1112,
        trap_pkey: 0x1314,
        trap_hop_limit: 0x40,
        trap_qp: 0x15_1617,
        trap_qkey: 0x1819_1A1B,
    }
}

#[test]
fn golden_class_port_info() {
    for (method, m) in [(Method::GetResp, 0x81), (Method::Get, 0x01)] {
        let g = cpi_golden(m);
        let r = cpi_repr();
        check_golden(
            &g,
            header(method, AttributeId::ClassPortInfo),
            CmRepr::ClassPortInfo(r),
        );
        module_emit!(class_port_info, r, g);
        check_accessors(&g, AttributeId::ClassPortInfo, m, Accessors::default());
    }
    // Not the CM protocol's SEND.
    let mut g = cpi_golden(0x81);
    g[3] = 0x03;
    assert_eq!(
        CmRepr::parse(&g),
        Err(Error::Method {
            method: 0x03,
            attr: 0x0001
        })
    );
    assert_eq!(
        class_port_info::Packet::new_checked(&g[..]).err(),
        Some(Error::Method {
            method: 0x03,
            attr: 0x0001
        })
    );
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

fn all_goldens() -> Vec<[u8; 256]> {
    vec![
        req_golden(),
        mra_golden(),
        rej_timeout_golden(),
        rep_golden(),
        rtu_golden(),
        dreq_golden(),
        drep_golden(),
        sidr_req_golden(),
        sidr_rep_golden(),
        lap_golden(),
        apr_golden(),
        cpi_golden(0x81),
    ]
}

#[test]
fn truncated_buffers() {
    let t = |have| Error::Truncated { need: 256, have };
    for g in all_goldens() {
        for len in [0, 24, 100, 255] {
            assert_eq!(CmRepr::parse(&g[..len]), Err(t(len)));
            assert_eq!(CmMad::new_checked(&g[..len]).err(), Some(t(len)));
        }
        let mut out = [0u8; 255];
        let (h, r) = CmRepr::parse(&g).unwrap();
        assert_eq!(r.emit(&h, &mut out), Err(t(255)));
    }
    let g = req_golden();
    assert_eq!(req::Packet::new_checked(&g[..255]).err(), Some(t(255)));
    let g = mra_golden();
    assert_eq!(mra::Packet::new_checked(&g[..200]).err(), Some(t(200)));
    let g = rej_full_golden();
    assert_eq!(rej::Packet::new_checked(&g[..107]).err(), Some(t(107)));
    let g = rep_golden();
    assert_eq!(rep::Packet::new_checked(&g[..59]).err(), Some(t(59)));
    let g = rtu_golden();
    assert_eq!(rtu::Packet::new_checked(&g[..31]).err(), Some(t(31)));
    let g = dreq_golden();
    assert_eq!(dreq::Packet::new_checked(&g[..35]).err(), Some(t(35)));
    let g = drep_golden();
    assert_eq!(drep::Packet::new_checked(&g[..1]).err(), Some(t(1)));
    let g = sidr_req_golden();
    assert_eq!(sidr_req::Packet::new_checked(&g[..40]).err(), Some(t(40)));
    let g = sidr_rep_golden();
    assert_eq!(sidr_rep::Packet::new_checked(&g[..120]).err(), Some(t(120)));
    let g = lap_golden();
    assert_eq!(lap::Packet::new_checked(&g[..88]).err(), Some(t(88)));
    let g = apr_golden();
    assert_eq!(apr::Packet::new_checked(&g[..108]).err(), Some(t(108)));
    let g = cpi_golden(0x81);
    assert_eq!(
        class_port_info::Packet::new_checked(&g[..96]).err(),
        Some(t(96))
    );
}

#[test]
fn wrong_attribute_for_a_view() {
    let w = |expected, found| Error::WrongAttribute { expected, found };
    let req = req_golden();
    let rep = rep_golden();
    assert_eq!(
        req::Packet::new_checked(&rep[..]).err(),
        Some(w(0x10, 0x13))
    );
    assert_eq!(
        mra::Packet::new_checked(&req[..]).err(),
        Some(w(0x11, 0x10))
    );
    assert_eq!(
        rej::Packet::new_checked(&req[..]).err(),
        Some(w(0x12, 0x10))
    );
    assert_eq!(
        rep::Packet::new_checked(&req[..]).err(),
        Some(w(0x13, 0x10))
    );
    assert_eq!(
        rtu::Packet::new_checked(&req[..]).err(),
        Some(w(0x14, 0x10))
    );
    assert_eq!(
        dreq::Packet::new_checked(&drep_golden()[..]).err(),
        Some(w(0x15, 0x16))
    );
    assert_eq!(
        drep::Packet::new_checked(&dreq_golden()[..]).err(),
        Some(w(0x16, 0x15))
    );
    assert_eq!(
        sidr_req::Packet::new_checked(&sidr_rep_golden()[..]).err(),
        Some(w(0x17, 0x18))
    );
    assert_eq!(
        sidr_rep::Packet::new_checked(&sidr_req_golden()[..]).err(),
        Some(w(0x18, 0x17))
    );
    assert_eq!(
        lap::Packet::new_checked(&apr_golden()[..]).err(),
        Some(w(0x19, 0x1A))
    );
    assert_eq!(
        apr::Packet::new_checked(&lap_golden()[..]).err(),
        Some(w(0x1A, 0x19))
    );
    assert_eq!(
        class_port_info::Packet::new_checked(&req[..]).err(),
        Some(w(0x01, 0x10))
    );
}

fn reserved(field: &'static str, value: u32) -> Result<(), Error> {
    Err(Error::Reserved { field, value })
}

fn parse_err(b: &[u8; 256]) -> Result<(), Error> {
    CmRepr::parse(b).map(|_| ())
}

#[test]
fn reserved_codes() {
    // REJ reason: 0, 34 and anything above 35 are not defined.
    for (hi, lo, v) in [
        (0x00, 0x00, 0),
        (0x00, 0x22, 34),
        (0x00, 0x24, 36),
        (0xFF, 0xFF, 65535),
    ] {
        let mut b = rej_full_golden();
        b[34..36].copy_from_slice(&[hi, lo]);
        assert_eq!(parse_err(&b), reserved("reason", v));
        assert_eq!(
            rej::Packet::new_checked(&b[..]).unwrap().reason(),
            Err(Error::Reserved {
                field: "reason",
                value: v
            })
        );
    }
    // Message Rejected / Message MRAed code 3.
    let mut b = rej_full_golden();
    b[32] = 3 << 6;
    assert_eq!(parse_err(&b), reserved("message_rejected", 3));
    let mut b = mra_golden();
    b[32] = 3 << 6;
    assert_eq!(parse_err(&b), reserved("message_mraed", 3));
    // ARI length above 72 (the field holds 7 bits).
    for len in [73u8, 127] {
        let mut b = rej_full_golden();
        b[33] = len << 1;
        assert_eq!(parse_err(&b), reserved("rejected_info_length", len.into()));
    }
    // REP failover 3.
    let mut b = rep_golden();
    b[50] = (0x12 << 3) | (3 << 1) | 1;
    assert_eq!(parse_err(&b), reserved("failover_accepted", 3));
    // SIDR_REP status above 5, additional info length above 72.
    for s in [6u8, 0xFF] {
        let mut b = sidr_rep_golden();
        b[28] = s;
        assert_eq!(parse_err(&b), reserved("status", s.into()));
    }
    let mut b = sidr_rep_golden();
    b[29] = 73;
    assert_eq!(parse_err(&b), reserved("additional_info_length", 73));
    // APR status above 13, additional info length above 72.
    for s in [14u8, 0xFF] {
        let mut b = apr_golden();
        b[33] = s;
        assert_eq!(parse_err(&b), reserved("ar_status", s.into()));
    }
    for len in [73u8, 0xFF] {
        let mut b = apr_golden();
        b[32] = len;
        assert_eq!(
            parse_err(&b),
            reserved("additional_info_length", len.into())
        );
    }
    // REQ transport type 3 with an extended type other than XRC.
    let mut b = req_golden();
    b[75] = (0xB << 4) | (1 << 3) | 2;
    assert_eq!(parse_err(&b), reserved("extended_transport_type", 2));
    // Unknown attribute, via the generic parser.
    let mut b = rtu_golden();
    b[17] = 0x1B;
    assert_eq!(parse_err(&b), Err(Error::UnknownAttribute(0x1B)));
}

#[test]
fn emit_rejects_overlong_parts() {
    let big = [0x55u8; 300];
    let h = Header::cm_send(AttributeId::Rej, 1);
    let too_long = |field, len, max| Err(Error::TooLong { field, len, max });
    let rej = rej::Repr {
        local_comm_id: 1,
        remote_comm_id: 2,
        message_rejected: MsgResponse::Req,
        reason: RejReason::ConsumerDefined,
        ari: &big[..73],
        private_data: &[],
    };
    let mut out = [0xEEu8; 256];
    assert_eq!(CmRepr::Rej(rej).emit(&h, &mut out), too_long("ari", 73, 72));
    assert_eq!(out, [0xEEu8; 256], "a failed emit wrote something");
    let rej = rej::Repr {
        ari: &big[..72],
        private_data: &big[..149],
        ..rej
    };
    assert_eq!(
        CmRepr::Rej(rej).emit(&h, &mut out),
        too_long("private_data", 149, 148)
    );
    let apr = apr::Repr {
        local_comm_id: 1,
        remote_comm_id: 2,
        ar_status: AprStatus::Success,
        additional_info: &big[..73],
        private_data: &[],
    };
    assert_eq!(
        CmRepr::Apr(apr).emit(&Header::cm_send(AttributeId::Apr, 1), &mut out),
        too_long("additional_info", 73, 72)
    );
    let sidr = sidr_rep::Repr {
        request_id: 1,
        status: SidrStatus::Success,
        vendor_id: 0,
        qpn: 2,
        service_id: 3,
        qkey: 4,
        additional_info: &big[..100],
        private_data: &[],
    };
    assert_eq!(
        CmRepr::SidrRep(sidr).emit(&Header::cm_send(AttributeId::SidrRep, 1), &mut out),
        too_long("additional_info", 100, 72)
    );
    let pd = pat(92, 0x10);
    let mut rq = req_repr(&pd);
    rq.private_data = &big[..93];
    assert_eq!(
        CmRepr::Req(rq).emit(&Header::cm_send(AttributeId::Req, 1), &mut out),
        too_long("private_data", 93, 92)
    );
    let dreq = dreq::Repr {
        local_comm_id: 1,
        remote_comm_id: 2,
        remote_qpn_eecn: 3,
        private_data: &big[..221],
    };
    assert_eq!(
        CmRepr::Dreq(dreq).emit(&Header::cm_send(AttributeId::Dreq, 1), &mut out),
        too_long("private_data", 221, 220)
    );
    assert_eq!(out, [0xEEu8; 256], "a failed emit wrote something");
}

#[test]
fn emit_checks_the_method() {
    let pd = pat(92, 0x10);
    let mut out = [0xEEu8; 256];
    let mut h = header(Method::Get, AttributeId::Req);
    assert_eq!(
        CmRepr::Req(req_repr(&pd)).emit(&h, &mut out),
        Err(Error::Method {
            method: 0x01,
            attr: 0x0010
        })
    );
    h.method = Method::GetResp;
    assert_eq!(
        CmRepr::Rtu(rtu::Repr {
            local_comm_id: 1,
            remote_comm_id: 2,
            private_data: &[],
        })
        .emit(&h, &mut out),
        Err(Error::Method {
            method: 0x81,
            attr: 0x0014
        })
    );
    for m in [Method::Send, Method::Set] {
        h.method = m;
        assert_eq!(
            CmRepr::ClassPortInfo(cpi_repr()).emit(&h, &mut out),
            Err(Error::Method {
                method: m as u8,
                attr: 0x0001
            })
        );
    }
    assert_eq!(out, [0xEEu8; 256], "a failed emit wrote something");
    // The attribute ID comes from the message, whatever the header says.
    h.method = Method::Get;
    CmRepr::ClassPortInfo(cpi_repr())
        .emit(&h, &mut out)
        .unwrap();
    assert_bytes(&out, &cpi_golden(0x01));
}

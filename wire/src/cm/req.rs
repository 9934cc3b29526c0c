//! REQ, the connection request (IBTA 12.6.5, attribute 0x0010).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! A REQ has no Remote Comm ID: absolute byte 28 is reserved and bytes 29..32 carry
//! Linux's ECE vendor ID, so nothing here ever writes byte 28.

use core::fmt;

use super::{PathRepr, TransportService, check_private_data, view};
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::gid::Gid;
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a REQ.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// ECE vendor ID, 24 bits at 29..32 (byte 28 reserved).
    pub const VENDOR_ID: Bits = Bits::new(28, 4, 0, 24);
    /// Service ID, be64.
    pub const SERVICE_ID: Bits = Bits::bytes(32, 8);
    /// Local CA GUID, be64.
    pub const LOCAL_CA_GUID: Bits = Bits::bytes(40, 8);
    /// Local Q_Key, be32.
    pub const LOCAL_Q_KEY: Bits = Bits::bytes(52, 4);
    /// Local QPN, 24 bits.
    pub const LOCAL_QPN: Bits = Bits::new(56, 4, 8, 24);
    /// Responder resources, u8.
    pub const RESPONDER_RESOURCES: Bits = Bits::bytes(59, 1);
    /// Local EECN, 24 bits.
    pub const LOCAL_EECN: Bits = Bits::new(60, 4, 8, 24);
    /// Initiator depth, u8.
    pub const INITIATOR_DEPTH: Bits = Bits::bytes(63, 1);
    /// Remote EECN, 24 bits.
    pub const REMOTE_EECN: Bits = Bits::new(64, 4, 8, 24);
    /// Remote CM response timeout, 5 bits.
    pub const REMOTE_CM_RESPONSE_TIMEOUT: Bits = Bits::new(67, 1, 3, 5);
    /// Transport service type, 2 bits.
    pub const TRANSPORT_SERVICE_TYPE: Bits = Bits::new(67, 1, 1, 2);
    /// End-to-end flow control, 1 bit.
    pub const END_TO_END_FLOW_CONTROL: Bits = Bits::new(67, 1, 0, 1);
    /// Starting PSN, 24 bits.
    pub const STARTING_PSN: Bits = Bits::new(68, 4, 8, 24);
    /// Local CM response timeout, 5 bits.
    pub const LOCAL_CM_RESPONSE_TIMEOUT: Bits = Bits::new(71, 1, 3, 5);
    /// Retry count, 3 bits.
    pub const RETRY_COUNT: Bits = Bits::new(71, 1, 0, 3);
    /// Partition key, be16.
    pub const PARTITION_KEY: Bits = Bits::bytes(72, 2);
    /// Path packet payload MTU, 4 bits.
    pub const PATH_MTU: Bits = Bits::new(74, 1, 4, 4);
    /// RDC exists, 1 bit.
    pub const RDC_EXISTS: Bits = Bits::new(74, 1, 3, 1);
    /// RNR retry count, 3 bits.
    pub const RNR_RETRY_COUNT: Bits = Bits::new(74, 1, 0, 3);
    /// Max CM retries, 4 bits.
    pub const MAX_CM_RETRIES: Bits = Bits::new(75, 1, 4, 4);
    /// SRQ, 1 bit.
    pub const SRQ: Bits = Bits::new(75, 1, 3, 1);
    /// Extended transport type, 3 bits.
    pub const EXTENDED_TRANSPORT_TYPE: Bits = Bits::new(75, 1, 0, 3);
    /// Primary path: starts at 76 (see [`crate::cm::PathRepr`]).
    pub const PRIMARY_PATH: usize = 76;
    /// Primary remote port GID (the passive side's GID), the REQ routing key.
    pub const PRIMARY_REMOTE_PORT_GID: Field = 96..112;
    /// Primary local port GID (the active side's GID).
    pub const PRIMARY_LOCAL_PORT_GID: Field = 80..96;
    /// Alternate path: starts at 120.
    pub const ALTERNATE_PATH: usize = 120;
    /// SAP supported, 1 bit.
    pub const SAP_SUPPORTED: Bits = Bits::new(163, 1, 2, 1);
    /// Private data, 92 bytes.
    pub const PRIVATE_DATA: Field = 164..256;
}

/// Maximum private data of a REQ.
pub const PRIVATE_DATA_LEN: usize = 92;

view!(Packet, AttributeId::Req, "A zero-copy view of a REQ MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// ECE vendor ID (24 bits).
    pub fn vendor_id(&self) -> u32 {
        self.get(field::VENDOR_ID) as u32
    }
    /// Service ID.
    pub fn service_id(&self) -> u64 {
        self.get(field::SERVICE_ID)
    }
    /// Local CA GUID of the sender.
    pub fn local_ca_guid(&self) -> u64 {
        self.get(field::LOCAL_CA_GUID)
    }
    /// Local Q_Key.
    pub fn local_qkey(&self) -> u32 {
        self.get(field::LOCAL_Q_KEY) as u32
    }
    /// Local QPN.
    pub fn local_qpn(&self) -> u32 {
        self.get(field::LOCAL_QPN) as u32
    }
    /// Responder resources.
    pub fn responder_resources(&self) -> u8 {
        self.get(field::RESPONDER_RESOURCES) as u8
    }
    /// Local EECN.
    pub fn local_eecn(&self) -> u32 {
        self.get(field::LOCAL_EECN) as u32
    }
    /// Initiator depth.
    pub fn initiator_depth(&self) -> u8 {
        self.get(field::INITIATOR_DEPTH) as u8
    }
    /// Remote EECN.
    pub fn remote_eecn(&self) -> u32 {
        self.get(field::REMOTE_EECN) as u32
    }
    /// Remote CM response timeout (5-bit exponent).
    pub fn remote_cm_response_timeout(&self) -> u8 {
        self.get(field::REMOTE_CM_RESPONSE_TIMEOUT) as u8
    }
    /// Raw transport service type (2 bits).
    pub fn transport_service_type(&self) -> u8 {
        self.get(field::TRANSPORT_SERVICE_TYPE) as u8
    }
    /// End-to-end flow control.
    pub fn end_to_end_flow_control(&self) -> bool {
        self.get(field::END_TO_END_FLOW_CONTROL) != 0
    }
    /// Starting PSN.
    pub fn starting_psn(&self) -> u32 {
        self.get(field::STARTING_PSN) as u32
    }
    /// Local CM response timeout (5-bit exponent).
    pub fn local_cm_response_timeout(&self) -> u8 {
        self.get(field::LOCAL_CM_RESPONSE_TIMEOUT) as u8
    }
    /// Retry count.
    pub fn retry_count(&self) -> u8 {
        self.get(field::RETRY_COUNT) as u8
    }
    /// Partition key.
    pub fn partition_key(&self) -> u16 {
        self.get(field::PARTITION_KEY) as u16
    }
    /// Path packet payload MTU (IBTA encoding, 1 = 256 .. 5 = 4096).
    pub fn path_mtu(&self) -> u8 {
        self.get(field::PATH_MTU) as u8
    }
    /// RDC exists.
    pub fn rdc_exists(&self) -> bool {
        self.get(field::RDC_EXISTS) != 0
    }
    /// RNR retry count.
    pub fn rnr_retry_count(&self) -> u8 {
        self.get(field::RNR_RETRY_COUNT) as u8
    }
    /// Max CM retries (0..15).
    pub fn max_cm_retries(&self) -> u8 {
        self.get(field::MAX_CM_RETRIES) as u8
    }
    /// SRQ.
    pub fn srq(&self) -> bool {
        self.get(field::SRQ) != 0
    }
    /// Raw extended transport type (3 bits).
    pub fn extended_transport_type(&self) -> u8 {
        self.get(field::EXTENDED_TRANSPORT_TYPE) as u8
    }
    /// Primary Local Port GID (the sender's GID).
    pub fn primary_local_port_gid(&self) -> Gid {
        self.gid(field::PRIMARY_LOCAL_PORT_GID)
    }
    /// Primary Remote Port GID (the receiver's GID): how a proxy routes a REQ.
    pub fn primary_remote_port_gid(&self) -> Gid {
        self.gid(field::PRIMARY_REMOTE_PORT_GID)
    }
    /// Primary path.
    pub fn primary_path(&self) -> PathRepr {
        PathRepr::read_req(self.bytes(), field::PRIMARY_PATH)
    }
    /// Alternate path (all zero when the REQ offers none).
    pub fn alternate_path(&self) -> PathRepr {
        PathRepr::read_req(self.bytes(), field::ALTERNATE_PATH)
    }
    /// SAP supported.
    pub fn sap_supported(&self) -> bool {
        self.get(field::SAP_SUPPORTED) != 0
    }
    /// Private data (all 92 bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.bytes()[field::PRIVATE_DATA]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the Local Communication ID.
    pub fn set_local_comm_id(&mut self, v: u32) {
        self.set(field::LOCAL_COMM_ID, v.into())
    }
    /// Sets the Local CA GUID.
    pub fn set_local_ca_guid(&mut self, v: u64) {
        self.set(field::LOCAL_CA_GUID, v)
    }
    /// Sets the Local QPN.
    pub fn set_local_qpn(&mut self, v: u32) {
        self.set(field::LOCAL_QPN, v.into())
    }
    /// Sets the Primary Local Port GID.
    pub fn set_primary_local_port_gid(&mut self, g: Gid) {
        self.set_gid(field::PRIMARY_LOCAL_PORT_GID, g)
    }
    /// Sets the Primary Remote Port GID.
    pub fn set_primary_remote_port_gid(&mut self, g: Gid) {
        self.set_gid(field::PRIMARY_REMOTE_PORT_GID, g)
    }
}

/// A parsed REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// ECE vendor ID (24 bits; 0 when unused).
    pub vendor_id: u32,
    /// Service ID.
    pub service_id: u64,
    /// Sender's CA GUID.
    pub local_ca_guid: u64,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Local EECN (24 bits).
    pub local_eecn: u32,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Remote EECN (24 bits).
    pub remote_eecn: u32,
    /// Remote CM response timeout (5-bit exponent).
    pub remote_cm_response_timeout: u8,
    /// Transport service (RC, UC, RD, XRC).
    pub transport: TransportService,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Local CM response timeout (5-bit exponent).
    pub local_cm_response_timeout: u8,
    /// Retry count (3 bits).
    pub retry_count: u8,
    /// Partition key.
    pub partition_key: u16,
    /// Path MTU (4-bit IBTA encoding).
    pub path_mtu: u8,
    /// RDC exists.
    pub rdc_exists: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// Max CM retries (4 bits).
    pub max_cm_retries: u8,
    /// SRQ.
    pub srq: bool,
    /// Primary path.
    pub primary_path: PathRepr,
    /// Alternate path; all zero when none is offered.
    pub alternate_path: PathRepr,
    /// SAP supported.
    pub sap_supported: bool,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a REQ. Reserved transport types are an error.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let transport =
            TransportService::from_fields(p.transport_service_type(), p.extended_transport_type())?;
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            vendor_id: p.vendor_id(),
            service_id: p.service_id(),
            local_ca_guid: p.local_ca_guid(),
            local_qkey: p.local_qkey(),
            local_qpn: p.local_qpn(),
            responder_resources: p.responder_resources(),
            local_eecn: p.local_eecn(),
            initiator_depth: p.initiator_depth(),
            remote_eecn: p.remote_eecn(),
            remote_cm_response_timeout: p.remote_cm_response_timeout(),
            transport,
            end_to_end_flow_control: p.end_to_end_flow_control(),
            starting_psn: p.starting_psn(),
            local_cm_response_timeout: p.local_cm_response_timeout(),
            retry_count: p.retry_count(),
            partition_key: p.partition_key(),
            path_mtu: p.path_mtu(),
            rdc_exists: p.rdc_exists(),
            rnr_retry_count: p.rnr_retry_count(),
            max_cm_retries: p.max_cm_retries(),
            srq: p.srq(),
            primary_path: p.primary_path(),
            alternate_path: p.alternate_path(),
            sap_supported: p.sap_supported(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the REQ's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        let b = &mut p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN];
        b.fill(0);
        let (tst, ett) = self.transport.to_fields();
        let p = &mut *p;
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::VENDOR_ID, self.vendor_id.into());
        p.set(field::SERVICE_ID, self.service_id);
        p.set(field::LOCAL_CA_GUID, self.local_ca_guid);
        p.set(field::LOCAL_Q_KEY, self.local_qkey.into());
        p.set(field::LOCAL_QPN, self.local_qpn.into());
        p.set(field::RESPONDER_RESOURCES, self.responder_resources.into());
        p.set(field::LOCAL_EECN, self.local_eecn.into());
        p.set(field::INITIATOR_DEPTH, self.initiator_depth.into());
        p.set(field::REMOTE_EECN, self.remote_eecn.into());
        p.set(
            field::REMOTE_CM_RESPONSE_TIMEOUT,
            self.remote_cm_response_timeout.into(),
        );
        p.set(field::TRANSPORT_SERVICE_TYPE, tst.into());
        p.set(
            field::END_TO_END_FLOW_CONTROL,
            self.end_to_end_flow_control.into(),
        );
        p.set(field::STARTING_PSN, self.starting_psn.into());
        p.set(
            field::LOCAL_CM_RESPONSE_TIMEOUT,
            self.local_cm_response_timeout.into(),
        );
        p.set(field::RETRY_COUNT, self.retry_count.into());
        p.set(field::PARTITION_KEY, self.partition_key.into());
        p.set(field::PATH_MTU, self.path_mtu.into());
        p.set(field::RDC_EXISTS, self.rdc_exists.into());
        p.set(field::RNR_RETRY_COUNT, self.rnr_retry_count.into());
        p.set(field::MAX_CM_RETRIES, self.max_cm_retries.into());
        p.set(field::SRQ, self.srq.into());
        p.set(field::EXTENDED_TRANSPORT_TYPE, ett.into());
        self.primary_path
            .write_req(p.buffer.as_mut(), field::PRIMARY_PATH);
        self.alternate_path
            .write_req(p.buffer.as_mut(), field::ALTERNATE_PATH);
        p.set(field::SAP_SUPPORTED, self.sap_supported.into());
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }

    /// True when the REQ offers an alternate path (Linux: alternate LID or GID non-zero).
    pub fn has_alternate_path(&self) -> bool {
        self.alternate_path.local_lid != 0 || self.alternate_path.local_gid != Gid::ZERO
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "REQ lcid={:#010x} sid={:#018x} ca_guid={:#018x} qpn={:#08x} {:?} psn={:#08x} \
             pkey={:#06x} {} -> {} resp_to(l/r)={}/{} max_retries={}",
            self.local_comm_id,
            self.service_id,
            self.local_ca_guid,
            self.local_qpn,
            self.transport,
            self.starting_psn,
            self.partition_key,
            self.primary_path.local_gid,
            self.primary_path.remote_gid,
            self.local_cm_response_timeout,
            self.remote_cm_response_timeout,
            self.max_cm_retries,
        )
    }
}

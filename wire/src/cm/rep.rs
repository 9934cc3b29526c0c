//! REP, the reply to a REQ (IBTA 12.6.8, attribute 0x0013).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! Linux's 24-bit ECE vendor ID is split over the low bytes of three words (abs 39,
//! 43, 47); [`Repr::vendor_id`] holds it whole (`H << 16 | M << 8 | L`).

use core::fmt;

use super::{FailoverAccepted, check_private_data, view};
use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a REP.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32.
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Local Q_Key, be32.
    pub const LOCAL_Q_KEY: Bits = Bits::bytes(32, 4);
    /// Local QPN, 24 bits.
    pub const LOCAL_QPN: Bits = Bits::new(36, 4, 8, 24);
    /// ECE vendor ID, high byte.
    pub const VENDOR_ID_H: Bits = Bits::bytes(39, 1);
    /// Local EE context number, 24 bits.
    pub const LOCAL_EECN: Bits = Bits::new(40, 4, 8, 24);
    /// ECE vendor ID, middle byte.
    pub const VENDOR_ID_M: Bits = Bits::bytes(43, 1);
    /// Starting PSN, 24 bits.
    pub const STARTING_PSN: Bits = Bits::new(44, 4, 8, 24);
    /// ECE vendor ID, low byte.
    pub const VENDOR_ID_L: Bits = Bits::bytes(47, 1);
    /// Responder resources, u8.
    pub const RESPONDER_RESOURCES: Bits = Bits::bytes(48, 1);
    /// Initiator depth, u8.
    pub const INITIATOR_DEPTH: Bits = Bits::bytes(49, 1);
    /// Target ACK delay, 5 bits.
    pub const TARGET_ACK_DELAY: Bits = Bits::new(50, 1, 3, 5);
    /// Failover accepted, 2 bits.
    pub const FAILOVER_ACCEPTED: Bits = Bits::new(50, 1, 1, 2);
    /// End-to-end flow control, 1 bit.
    pub const END_TO_END_FLOW_CONTROL: Bits = Bits::new(50, 1, 0, 1);
    /// RNR retry count, 3 bits.
    pub const RNR_RETRY_COUNT: Bits = Bits::new(51, 1, 5, 3);
    /// SRQ, 1 bit (the low 4 bits of byte 51 are reserved).
    pub const SRQ: Bits = Bits::new(51, 1, 4, 1);
    /// Local CA GUID, be64.
    pub const LOCAL_CA_GUID: Bits = Bits::bytes(52, 8);
    /// Private data, 196 bytes.
    pub const PRIVATE_DATA: Field = 60..256;
}

/// Maximum private data of a REP.
pub const PRIVATE_DATA_LEN: usize = 196;

view!(Packet, AttributeId::Rep, "A zero-copy view of a REP MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Local Q_Key.
    pub fn local_qkey(&self) -> u32 {
        self.get(field::LOCAL_Q_KEY) as u32
    }
    /// Local QPN.
    pub fn local_qpn(&self) -> u32 {
        self.get(field::LOCAL_QPN) as u32
    }
    /// ECE vendor ID, high byte.
    pub fn vendor_id_h(&self) -> u8 {
        self.get(field::VENDOR_ID_H) as u8
    }
    /// ECE vendor ID, middle byte.
    pub fn vendor_id_m(&self) -> u8 {
        self.get(field::VENDOR_ID_M) as u8
    }
    /// ECE vendor ID, low byte.
    pub fn vendor_id_l(&self) -> u8 {
        self.get(field::VENDOR_ID_L) as u8
    }
    /// ECE vendor ID, 24 bits (`H << 16 | M << 8 | L`).
    pub fn vendor_id(&self) -> u32 {
        u32::from(self.vendor_id_h()) << 16
            | u32::from(self.vendor_id_m()) << 8
            | u32::from(self.vendor_id_l())
    }
    /// Local EE context number.
    pub fn local_eecn(&self) -> u32 {
        self.get(field::LOCAL_EECN) as u32
    }
    /// Starting PSN.
    pub fn starting_psn(&self) -> u32 {
        self.get(field::STARTING_PSN) as u32
    }
    /// Responder resources.
    pub fn responder_resources(&self) -> u8 {
        self.get(field::RESPONDER_RESOURCES) as u8
    }
    /// Initiator depth.
    pub fn initiator_depth(&self) -> u8 {
        self.get(field::INITIATOR_DEPTH) as u8
    }
    /// Target ACK delay (5-bit exponent).
    pub fn target_ack_delay(&self) -> u8 {
        self.get(field::TARGET_ACK_DELAY) as u8
    }
    /// Raw failover accepted code (2 bits; 3 is reserved).
    pub fn failover_accepted_code(&self) -> u8 {
        self.get(field::FAILOVER_ACCEPTED) as u8
    }
    /// Failover accepted; fails with [`Error::Reserved`] on code 3.
    pub fn failover_accepted(&self) -> Result<FailoverAccepted> {
        let c = self.failover_accepted_code();
        FailoverAccepted::from_code(c).ok_or(Error::Reserved {
            field: "failover_accepted",
            value: c.into(),
        })
    }
    /// End-to-end flow control.
    pub fn end_to_end_flow_control(&self) -> bool {
        self.get(field::END_TO_END_FLOW_CONTROL) != 0
    }
    /// RNR retry count.
    pub fn rnr_retry_count(&self) -> u8 {
        self.get(field::RNR_RETRY_COUNT) as u8
    }
    /// SRQ.
    pub fn srq(&self) -> bool {
        self.get(field::SRQ) != 0
    }
    /// Local CA GUID of the sender.
    pub fn local_ca_guid(&self) -> u64 {
        self.get(field::LOCAL_CA_GUID)
    }
    /// Private data (all 196 bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.bytes()[field::PRIVATE_DATA]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the Local Communication ID.
    pub fn set_local_comm_id(&mut self, v: u32) {
        self.set(field::LOCAL_COMM_ID, v.into())
    }
    /// Sets the Remote Communication ID.
    pub fn set_remote_comm_id(&mut self, v: u32) {
        self.set(field::REMOTE_COMM_ID, v.into())
    }
    /// Sets the Local QPN (24 bits; the vendor ID byte after it is left alone).
    pub fn set_local_qpn(&mut self, v: u32) {
        self.set(field::LOCAL_QPN, v.into())
    }
    /// Sets the Local CA GUID.
    pub fn set_local_ca_guid(&mut self, v: u64) {
        self.set(field::LOCAL_CA_GUID, v)
    }
}

/// A parsed REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Local Q_Key.
    pub local_qkey: u32,
    /// Local QPN (24 bits).
    pub local_qpn: u32,
    /// ECE vendor ID (24 bits; 0 when unused).
    pub vendor_id: u32,
    /// Local EE context number (24 bits).
    pub local_eecn: u32,
    /// Starting PSN (24 bits).
    pub starting_psn: u32,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Target ACK delay (5-bit exponent).
    pub target_ack_delay: u8,
    /// Failover accepted.
    pub failover_accepted: FailoverAccepted,
    /// End-to-end flow control.
    pub end_to_end_flow_control: bool,
    /// RNR retry count (3 bits).
    pub rnr_retry_count: u8,
    /// SRQ.
    pub srq: bool,
    /// Sender's CA GUID.
    pub local_ca_guid: u64,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a REP. A reserved failover code is an error.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            local_qkey: p.local_qkey(),
            local_qpn: p.local_qpn(),
            vendor_id: p.vendor_id(),
            local_eecn: p.local_eecn(),
            starting_psn: p.starting_psn(),
            responder_resources: p.responder_resources(),
            initiator_depth: p.initiator_depth(),
            target_ack_delay: p.target_ack_delay(),
            failover_accepted: p.failover_accepted()?,
            end_to_end_flow_control: p.end_to_end_flow_control(),
            rnr_retry_count: p.rnr_retry_count(),
            srq: p.srq(),
            local_ca_guid: p.local_ca_guid(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the REP's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(field::LOCAL_Q_KEY, self.local_qkey.into());
        p.set(field::LOCAL_QPN, self.local_qpn.into());
        p.set(field::VENDOR_ID_H, (self.vendor_id >> 16).into());
        p.set(field::LOCAL_EECN, self.local_eecn.into());
        p.set(field::VENDOR_ID_M, (self.vendor_id >> 8).into());
        p.set(field::STARTING_PSN, self.starting_psn.into());
        p.set(field::VENDOR_ID_L, self.vendor_id.into());
        p.set(field::RESPONDER_RESOURCES, self.responder_resources.into());
        p.set(field::INITIATOR_DEPTH, self.initiator_depth.into());
        p.set(field::TARGET_ACK_DELAY, self.target_ack_delay.into());
        p.set(
            field::FAILOVER_ACCEPTED,
            self.failover_accepted.code().into(),
        );
        p.set(
            field::END_TO_END_FLOW_CONTROL,
            self.end_to_end_flow_control.into(),
        );
        p.set(field::RNR_RETRY_COUNT, self.rnr_retry_count.into());
        p.set(field::SRQ, self.srq.into());
        p.set(field::LOCAL_CA_GUID, self.local_ca_guid);
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "REP lcid={:#010x} rcid={:#010x} ca_guid={:#018x} qpn={:#08x} psn={:#08x} \
             rr={} id={} failover={} srq={}",
            self.local_comm_id,
            self.remote_comm_id,
            self.local_ca_guid,
            self.local_qpn,
            self.starting_psn,
            self.responder_resources,
            self.initiator_depth,
            self.failover_accepted,
            self.srq,
        )
    }
}

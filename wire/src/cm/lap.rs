//! LAP, load alternate path (IBTA chapter 12, attribute 0x0019).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! The alternate path starts at abs 44 in LAP layout (traffic class, hop limit and
//! packet rate in another order than a REQ's paths; see [`PathRepr`]).

use core::fmt;

use super::{PathRepr, check_private_data, view};
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::gid::Gid;
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a LAP.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32 (bytes 32..36 are reserved).
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Remote QPN/EECN, 24 bits.
    pub const REMOTE_QPN_EECN: Bits = Bits::new(36, 4, 8, 24);
    /// Remote CM response timeout, 5 bits (bytes 40..44 are reserved).
    pub const REMOTE_CM_RESPONSE_TIMEOUT: Bits = Bits::new(39, 1, 3, 5);
    /// Alternate path: starts at 44, in LAP layout.
    pub const ALTERNATE_PATH: usize = 44;
    /// Alternate local port LID, be16.
    pub const ALTERNATE_LOCAL_PORT_LID: Bits = Bits::bytes(44, 2);
    /// Alternate remote port LID, be16.
    pub const ALTERNATE_REMOTE_PORT_LID: Bits = Bits::bytes(46, 2);
    /// Alternate local port GID.
    pub const ALTERNATE_LOCAL_PORT_GID: Field = 48..64;
    /// Alternate remote port GID.
    pub const ALTERNATE_REMOTE_PORT_GID: Field = 64..80;
    /// Alternate flow label, 20 bits (the rest of byte 82 is reserved).
    pub const ALTERNATE_FLOW_LABEL: Bits = Bits::new(80, 4, 12, 20);
    /// Alternate traffic class, u8.
    pub const ALTERNATE_TRAFFIC_CLASS: Bits = Bits::bytes(83, 1);
    /// Alternate hop limit, u8.
    pub const ALTERNATE_HOP_LIMIT: Bits = Bits::bytes(84, 1);
    /// Alternate packet rate, 6 bits.
    pub const ALTERNATE_PACKET_RATE: Bits = Bits::new(85, 1, 0, 6);
    /// Alternate SL, 4 bits.
    pub const ALTERNATE_SL: Bits = Bits::new(86, 1, 4, 4);
    /// Alternate subnet local, 1 bit.
    pub const ALTERNATE_SUBNET_LOCAL: Bits = Bits::new(86, 1, 3, 1);
    /// Alternate local ACK timeout, 5 bits.
    pub const ALTERNATE_LOCAL_ACK_TIMEOUT: Bits = Bits::new(87, 1, 3, 5);
    /// Private data, 168 bytes.
    pub const PRIVATE_DATA: Field = 88..256;
}

/// Maximum private data of a LAP.
pub const PRIVATE_DATA_LEN: usize = 168;

view!(Packet, AttributeId::Lap, "A zero-copy view of a LAP MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Remote QPN/EECN: the receiver's QPN.
    pub fn remote_qpn_eecn(&self) -> u32 {
        self.get(field::REMOTE_QPN_EECN) as u32
    }
    /// Remote CM response timeout (5-bit exponent).
    pub fn remote_cm_response_timeout(&self) -> u8 {
        self.get(field::REMOTE_CM_RESPONSE_TIMEOUT) as u8
    }
    /// Alternate local port LID.
    pub fn alternate_local_port_lid(&self) -> u16 {
        self.get(field::ALTERNATE_LOCAL_PORT_LID) as u16
    }
    /// Alternate remote port LID.
    pub fn alternate_remote_port_lid(&self) -> u16 {
        self.get(field::ALTERNATE_REMOTE_PORT_LID) as u16
    }
    /// Alternate local port GID (the sender's).
    pub fn alternate_local_port_gid(&self) -> Gid {
        self.gid(field::ALTERNATE_LOCAL_PORT_GID)
    }
    /// Alternate remote port GID (the receiver's).
    pub fn alternate_remote_port_gid(&self) -> Gid {
        self.gid(field::ALTERNATE_REMOTE_PORT_GID)
    }
    /// Alternate flow label (20 bits).
    pub fn alternate_flow_label(&self) -> u32 {
        self.get(field::ALTERNATE_FLOW_LABEL) as u32
    }
    /// Alternate traffic class.
    pub fn alternate_traffic_class(&self) -> u8 {
        self.get(field::ALTERNATE_TRAFFIC_CLASS) as u8
    }
    /// Alternate hop limit.
    pub fn alternate_hop_limit(&self) -> u8 {
        self.get(field::ALTERNATE_HOP_LIMIT) as u8
    }
    /// Alternate packet rate (6 bits).
    pub fn alternate_packet_rate(&self) -> u8 {
        self.get(field::ALTERNATE_PACKET_RATE) as u8
    }
    /// Alternate SL (4 bits).
    pub fn alternate_sl(&self) -> u8 {
        self.get(field::ALTERNATE_SL) as u8
    }
    /// Alternate subnet local.
    pub fn alternate_subnet_local(&self) -> bool {
        self.get(field::ALTERNATE_SUBNET_LOCAL) != 0
    }
    /// Alternate local ACK timeout (5-bit exponent).
    pub fn alternate_local_ack_timeout(&self) -> u8 {
        self.get(field::ALTERNATE_LOCAL_ACK_TIMEOUT) as u8
    }
    /// The whole alternate path.
    pub fn alternate_path(&self) -> PathRepr {
        PathRepr::read_lap(self.bytes(), field::ALTERNATE_PATH)
    }
    /// Private data (all 168 bytes).
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
    /// Sets the Remote QPN/EECN (24 bits; the timeout byte after it is left alone).
    pub fn set_remote_qpn_eecn(&mut self, v: u32) {
        self.set(field::REMOTE_QPN_EECN, v.into())
    }
    /// Sets the alternate local port GID.
    pub fn set_alternate_local_port_gid(&mut self, g: Gid) {
        self.set_gid(field::ALTERNATE_LOCAL_PORT_GID, g)
    }
    /// Sets the alternate remote port GID.
    pub fn set_alternate_remote_port_gid(&mut self, g: Gid) {
        self.set_gid(field::ALTERNATE_REMOTE_PORT_GID, g)
    }
}

/// A parsed LAP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Remote QPN/EECN (24 bits): the receiver's QPN.
    pub remote_qpn_eecn: u32,
    /// Remote CM response timeout (5-bit exponent).
    pub remote_cm_response_timeout: u8,
    /// The alternate path to load.
    pub alternate_path: PathRepr,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a LAP.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            remote_qpn_eecn: p.remote_qpn_eecn(),
            remote_cm_response_timeout: p.remote_cm_response_timeout(),
            alternate_path: p.alternate_path(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the LAP's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(field::REMOTE_QPN_EECN, self.remote_qpn_eecn.into());
        p.set(
            field::REMOTE_CM_RESPONSE_TIMEOUT,
            self.remote_cm_response_timeout.into(),
        );
        self.alternate_path
            .write_lap(p.buffer.as_mut(), field::ALTERNATE_PATH);
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LAP lcid={:#010x} rcid={:#010x} remote_qpn={:#08x} alt {} -> {} resp_to={}",
            self.local_comm_id,
            self.remote_comm_id,
            self.remote_qpn_eecn,
            self.alternate_path.local_gid,
            self.alternate_path.remote_gid,
            self.remote_cm_response_timeout,
        )
    }
}

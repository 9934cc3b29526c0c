//! DREQ, the disconnect request (IBTA 12.6.10, attribute 0x0015).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! Its Remote QPN/EECN (abs 32..35, 24 bits; byte 35 reserved) must equal the
//! receiver's local QPN (Linux `cm_dreq_handler`).

use core::fmt;

use super::{check_private_data, view};
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a DREQ.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32.
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Remote QPN/EECN, 24 bits (byte 35 is reserved).
    pub const REMOTE_QPN_EECN: Bits = Bits::new(32, 4, 8, 24);
    /// Private data, 220 bytes.
    pub const PRIVATE_DATA: Field = 36..256;
}

/// Maximum private data of a DREQ.
pub const PRIVATE_DATA_LEN: usize = 220;

view!(Packet, AttributeId::Dreq, "A zero-copy view of a DREQ MAD.");

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
    /// Private data (all 220 bytes).
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
    /// Sets the Remote QPN/EECN (24 bits).
    pub fn set_remote_qpn_eecn(&mut self, v: u32) {
        self.set(field::REMOTE_QPN_EECN, v.into())
    }
}

/// A parsed DREQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Remote QPN/EECN (24 bits): the receiver's QPN.
    pub remote_qpn_eecn: u32,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a DREQ.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            remote_qpn_eecn: p.remote_qpn_eecn(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the DREQ's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(field::REMOTE_QPN_EECN, self.remote_qpn_eecn.into());
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DREQ lcid={:#010x} rcid={:#010x} remote_qpn={:#08x}",
            self.local_comm_id, self.remote_comm_id, self.remote_qpn_eecn,
        )
    }
}

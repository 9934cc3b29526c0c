//! MRA, message receipt acknowledgement (IBTA 12.6.6, attribute 0x0011).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! An MRA asks the peer to wait `4.096 us * 2^service_timeout` longer for the answer
//! to the message it names (REQ, REP or LAP).

use core::fmt;

use super::{MsgResponse, check_private_data, view};
use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of an MRA.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32.
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Message MRAed, 2 bits (upper bits of byte 32; the rest is reserved).
    pub const MESSAGE_MRAED: Bits = Bits::new(32, 1, 6, 2);
    /// Service timeout, 5 bits (upper bits of byte 33; the rest is reserved).
    pub const SERVICE_TIMEOUT: Bits = Bits::new(33, 1, 3, 5);
    /// Private data, 222 bytes.
    pub const PRIVATE_DATA: Field = 34..256;
}

/// Maximum private data of an MRA.
pub const PRIVATE_DATA_LEN: usize = 222;

view!(Packet, AttributeId::Mra, "A zero-copy view of an MRA MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Raw Message MRAed code (2 bits; 3 is reserved).
    pub fn message_mraed_code(&self) -> u8 {
        self.get(field::MESSAGE_MRAED) as u8
    }
    /// Message MRAed; fails with [`Error::Reserved`] on code 3.
    pub fn message_mraed(&self) -> Result<MsgResponse> {
        let c = self.message_mraed_code();
        MsgResponse::from_code(c).ok_or(Error::Reserved {
            field: "message_mraed",
            value: c.into(),
        })
    }
    /// Service timeout (5-bit exponent).
    pub fn service_timeout(&self) -> u8 {
        self.get(field::SERVICE_TIMEOUT) as u8
    }
    /// Private data (all 222 bytes).
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
    /// Sets the service timeout (5-bit exponent; higher bits are discarded).
    pub fn set_service_timeout(&mut self, v: u8) {
        self.set(field::SERVICE_TIMEOUT, v.into())
    }
}

/// A parsed MRA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// The message acknowledged (REQ, REP, or OTHER for a LAP).
    pub message_mraed: MsgResponse,
    /// Service timeout (5-bit exponent).
    pub service_timeout: u8,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses an MRA. A reserved Message MRAed code is an error.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            message_mraed: p.message_mraed()?,
            service_timeout: p.service_timeout(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the MRA's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(field::MESSAGE_MRAED, self.message_mraed.code().into());
        p.set(field::SERVICE_TIMEOUT, self.service_timeout.into());
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "MRA lcid={:#010x} rcid={:#010x} mraed={} service_timeout={}",
            self.local_comm_id, self.remote_comm_id, self.message_mraed, self.service_timeout,
        )
    }
}

//! RTU, ready to use (IBTA 12.6.9, attribute 0x0014).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! The active side's last handshake message: the connection is established.

use core::fmt;

use super::{check_private_data, view};
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a RTU.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32.
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Private data, 224 bytes.
    pub const PRIVATE_DATA: Field = 32..256;
}

/// Maximum private data of a RTU.
pub const PRIVATE_DATA_LEN: usize = 224;

view!(Packet, AttributeId::Rtu, "A zero-copy view of a RTU MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Private data (all 224 bytes).
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
}

/// A parsed RTU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a RTU.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the RTU's data (bytes 24..256; reserved bits zeroed). The MAD header is
    /// the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RTU lcid={:#010x} rcid={:#010x}",
            self.local_comm_id, self.remote_comm_id,
        )
    }
}

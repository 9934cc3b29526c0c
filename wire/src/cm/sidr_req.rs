//! SIDR_REQ, the service ID resolution request (IBTA chapter 12, attribute 0x0017).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! A SIDR_REQ carries no Comm IDs and no GID: only a RequestID, a P_Key and the
//! service ID asked about.

use core::fmt;

use super::{check_private_data, view};
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a SIDR_REQ.
pub mod field {
    use super::{Bits, Field};
    /// RequestID, be32.
    pub const REQUEST_ID: Bits = Bits::bytes(24, 4);
    /// Partition key, be16 (bytes 30..32 are reserved).
    pub const PARTITION_KEY: Bits = Bits::bytes(28, 2);
    /// Service ID, be64.
    pub const SERVICE_ID: Bits = Bits::bytes(32, 8);
    /// Private data, 216 bytes.
    pub const PRIVATE_DATA: Field = 40..256;
}

/// Maximum private data of a SIDR_REQ.
pub const PRIVATE_DATA_LEN: usize = 216;

view!(
    Packet,
    AttributeId::SidrReq,
    "A zero-copy view of a SIDR_REQ MAD."
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// RequestID.
    pub fn request_id(&self) -> u32 {
        self.get(field::REQUEST_ID) as u32
    }
    /// Partition key.
    pub fn partition_key(&self) -> u16 {
        self.get(field::PARTITION_KEY) as u16
    }
    /// Service ID.
    pub fn service_id(&self) -> u64 {
        self.get(field::SERVICE_ID)
    }
    /// Private data (all 216 bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.bytes()[field::PRIVATE_DATA]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the RequestID.
    pub fn set_request_id(&mut self, v: u32) {
        self.set(field::REQUEST_ID, v.into())
    }
    /// Sets the partition key.
    pub fn set_partition_key(&mut self, v: u16) {
        self.set(field::PARTITION_KEY, v.into())
    }
}

/// A parsed SIDR_REQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// RequestID.
    pub request_id: u32,
    /// Partition key.
    pub partition_key: u16,
    /// Service ID.
    pub service_id: u64,
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a SIDR_REQ.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            request_id: p.request_id(),
            partition_key: p.partition_key(),
            service_id: p.service_id(),
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the SIDR_REQ's data (bytes 24..256; reserved bits zeroed). The MAD header
    /// is the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::REQUEST_ID, self.request_id.into());
        p.set(field::PARTITION_KEY, self.partition_key.into());
        p.set(field::SERVICE_ID, self.service_id);
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "SIDR_REQ req_id={:#010x} pkey={:#06x} sid={:#018x}",
            self.request_id, self.partition_key, self.service_id,
        )
    }
}

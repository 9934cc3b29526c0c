//! APR, the alternate path response (IBTA chapter 12, attribute 0x001A).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! The additional information is as long as its 8-bit length field says, at most
//! [`ADDITIONAL_INFO_LEN`] bytes.

use core::fmt;

use super::{AprStatus, check_fits, check_private_data, var_part, view};
use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of an APR.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32.
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Additional information length, u8.
    pub const ADDITIONAL_INFO_LENGTH: Bits = Bits::bytes(32, 1);
    /// AR status, u8 (bytes 34..36 are reserved).
    pub const AR_STATUS: Bits = Bits::bytes(33, 1);
    /// Additional information, 72 bytes.
    pub const ADDITIONAL_INFO: Field = 36..108;
    /// Private data, 148 bytes.
    pub const PRIVATE_DATA: Field = 108..256;
}

/// Maximum private data of an APR.
pub const PRIVATE_DATA_LEN: usize = 148;
/// Maximum length of the additional information.
pub const ADDITIONAL_INFO_LEN: usize = 72;

view!(Packet, AttributeId::Apr, "A zero-copy view of an APR MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Additional information length in bytes (above 72 is invalid).
    pub fn additional_info_length(&self) -> u8 {
        self.get(field::ADDITIONAL_INFO_LENGTH) as u8
    }
    /// Raw AR status code.
    pub fn ar_status_code(&self) -> u8 {
        self.get(field::AR_STATUS) as u8
    }
    /// AR status; fails with [`Error::Reserved`] on codes above 13.
    pub fn ar_status(&self) -> Result<AprStatus> {
        let c = self.ar_status_code();
        AprStatus::from_code(c).ok_or(Error::Reserved {
            field: "ar_status",
            value: c.into(),
        })
    }
    /// Additional information, as long as its length field says; fails with
    /// [`Error::Reserved`] if that length exceeds 72.
    pub fn additional_info(&self) -> Result<&[u8]> {
        var_part(
            self.bytes(),
            field::ADDITIONAL_INFO,
            "additional_info_length",
            self.additional_info_length().into(),
        )
    }
    /// Private data (all 148 bytes).
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

/// A parsed APR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// AR status.
    pub ar_status: AprStatus,
    /// Additional information, exactly as long as its length field (at most
    /// [`ADDITIONAL_INFO_LEN`] bytes).
    pub additional_info: &'a [u8],
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses an APR. A reserved status and an additional information length above
    /// 72 are errors.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            ar_status: p.ar_status()?,
            additional_info: var_part(
                bytes,
                field::ADDITIONAL_INFO,
                "additional_info_length",
                p.additional_info_length().into(),
            )?,
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the APR's data (bytes 24..256; reserved bits zeroed), the length field
    /// being the additional information's length. The MAD header is the caller's (see
    /// [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_fits("additional_info", self.additional_info, ADDITIONAL_INFO_LEN)?;
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(
            field::ADDITIONAL_INFO_LENGTH,
            self.additional_info.len() as u64,
        );
        p.set(field::AR_STATUS, self.ar_status.code().into());
        p.buffer.as_mut()[field::ADDITIONAL_INFO][..self.additional_info.len()]
            .copy_from_slice(self.additional_info);
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "APR lcid={:#010x} rcid={:#010x} status={} info_len={}",
            self.local_comm_id,
            self.remote_comm_id,
            self.ar_status,
            self.additional_info.len(),
        )
    }
}

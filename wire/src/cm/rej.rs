//! REJ, the reject (IBTA 12.6.7, attribute 0x0012).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! The Additional Rejection Information (ARI) is as long as the 7-bit "Rejected Info
//! Length" says, at most [`ARI_LEN`] bytes. A REJ(TIMEOUT) sent when the active side
//! gives up carries Remote Comm ID 0 and the sender's CA GUID as its 8-byte ARI.

use core::fmt;

use super::{MsgResponse, RejReason, check_fits, check_private_data, var_part, view};
use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a REJ.
pub mod field {
    use super::{Bits, Field};
    /// Local Communication ID, be32.
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Communication ID, be32 (0 in a REJ(TIMEOUT) when no MRA was received).
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// Message Rejected, 2 bits (upper bits of byte 32; the rest is reserved).
    pub const MESSAGE_REJECTED: Bits = Bits::new(32, 1, 6, 2);
    /// Rejected Info Length (ARI length in bytes), 7 bits (byte 33 bits 7..1).
    pub const REJECTED_INFO_LENGTH: Bits = Bits::new(33, 1, 1, 7);
    /// Reason, be16.
    pub const REASON: Bits = Bits::bytes(34, 2);
    /// Additional Rejection Information, 72 bytes.
    pub const ARI: Field = 36..108;
    /// Private data, 148 bytes.
    pub const PRIVATE_DATA: Field = 108..256;
}

/// Maximum private data of a REJ.
pub const PRIVATE_DATA_LEN: usize = 148;
/// Maximum length of the Additional Rejection Information.
pub const ARI_LEN: usize = 72;

view!(Packet, AttributeId::Rej, "A zero-copy view of a REJ MAD.");

impl<T: AsRef<[u8]>> Packet<T> {
    /// Local Communication ID.
    pub fn local_comm_id(&self) -> u32 {
        self.get(field::LOCAL_COMM_ID) as u32
    }
    /// Remote Communication ID.
    pub fn remote_comm_id(&self) -> u32 {
        self.get(field::REMOTE_COMM_ID) as u32
    }
    /// Raw Message Rejected code (2 bits; 3 is reserved).
    pub fn message_rejected_code(&self) -> u8 {
        self.get(field::MESSAGE_REJECTED) as u8
    }
    /// Message Rejected; fails with [`Error::Reserved`] on code 3.
    pub fn message_rejected(&self) -> Result<MsgResponse> {
        let c = self.message_rejected_code();
        MsgResponse::from_code(c).ok_or(Error::Reserved {
            field: "message_rejected",
            value: c.into(),
        })
    }
    /// Rejected Info Length: the ARI's length in bytes (7 bits; above 72 is invalid).
    pub fn rejected_info_length(&self) -> u8 {
        self.get(field::REJECTED_INFO_LENGTH) as u8
    }
    /// Raw reason code.
    pub fn reason_code(&self) -> u16 {
        self.get(field::REASON) as u16
    }
    /// Reason; fails with [`Error::Reserved`] on 0, 34 and codes above 35.
    pub fn reason(&self) -> Result<RejReason> {
        let c = self.reason_code();
        RejReason::from_code(c).ok_or(Error::Reserved {
            field: "reason",
            value: c.into(),
        })
    }
    /// Additional Rejection Information, as long as its length field says; fails with
    /// [`Error::Reserved`] if that length exceeds 72.
    pub fn ari(&self) -> Result<&[u8]> {
        var_part(
            self.bytes(),
            field::ARI,
            "rejected_info_length",
            self.rejected_info_length().into(),
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
    /// Replaces the ARI and its length field (the rest of the ARI field is zeroed);
    /// fails with [`Error::TooLong`] beyond 72 bytes, leaving the MAD untouched.
    pub fn set_ari(&mut self, ari: &[u8]) -> Result<()> {
        check_fits("ari", ari, ARI_LEN)?;
        self.set(field::REJECTED_INFO_LENGTH, ari.len() as u64);
        let f = &mut self.buffer.as_mut()[field::ARI];
        f.fill(0);
        f[..ari.len()].copy_from_slice(ari);
        Ok(())
    }
}

/// A parsed REJ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr<'a> {
    /// Local Communication ID.
    pub local_comm_id: u32,
    /// Remote Communication ID.
    pub remote_comm_id: u32,
    /// The message rejected (REQ, REP or OTHER).
    pub message_rejected: MsgResponse,
    /// Reason.
    pub reason: RejReason,
    /// Additional Rejection Information, exactly as long as the Rejected Info Length
    /// field (at most [`ARI_LEN`] bytes).
    pub ari: &'a [u8],
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a REJ. Reserved message codes and reasons, and an ARI length above 72,
    /// are errors.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            local_comm_id: p.local_comm_id(),
            remote_comm_id: p.remote_comm_id(),
            message_rejected: p.message_rejected()?,
            reason: p.reason()?,
            ari: var_part(
                bytes,
                field::ARI,
                "rejected_info_length",
                p.rejected_info_length().into(),
            )?,
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the REJ's data (bytes 24..256; reserved bits zeroed), the Rejected Info
    /// Length being the ARI's length. The MAD header is the caller's (see
    /// [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_fits("ari", self.ari, ARI_LEN)?;
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
        p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
        p.set(field::MESSAGE_REJECTED, self.message_rejected.code().into());
        p.set(field::REJECTED_INFO_LENGTH, self.ari.len() as u64);
        p.set(field::REASON, self.reason.code().into());
        p.buffer.as_mut()[field::ARI][..self.ari.len()].copy_from_slice(self.ari);
        p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
            .copy_from_slice(self.private_data);
        Ok(())
    }

    /// The CA GUID a REJ(TIMEOUT) carries in its ARI, if this is one with 8 ARI bytes
    /// or more.
    pub fn timeout_ca_guid(&self) -> Option<u64> {
        if self.reason != RejReason::Timeout {
            return None;
        }
        let g: [u8; 8] = self.ari.get(..8)?.try_into().ok()?;
        Some(u64::from_be_bytes(g))
    }
}

impl fmt::Display for Repr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "REJ lcid={:#010x} rcid={:#010x} rejected={} reason={} ari_len={}",
            self.local_comm_id,
            self.remote_comm_id,
            self.message_rejected,
            self.reason,
            self.ari.len(),
        )
    }
}

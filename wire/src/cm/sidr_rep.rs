//! SIDR_REP, the service ID resolution response (IBTA chapter 12, attribute 0x0018).
//!
//! Offsets are absolute from the start of the 256-byte MAD (IBTA data offset + 24).
//! The additional information is as long as its 8-bit length field says, at most
//! [`ADDITIONAL_INFO_LEN`] bytes. Linux's ECE vendor ID is split into a be16 at abs 30
//! and a byte at abs 35; [`Repr::vendor_id`] holds it whole (`H << 8 | L`, 24 bits).

use core::fmt;

use super::{SidrStatus, check_fits, check_private_data, var_part, view};
use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a SIDR_REP.
pub mod field {
    use super::{Bits, Field};
    /// RequestID, be32.
    pub const REQUEST_ID: Bits = Bits::bytes(24, 4);
    /// Status, u8.
    pub const STATUS: Bits = Bits::bytes(28, 1);
    /// Additional information length, u8.
    pub const ADDITIONAL_INFO_LENGTH: Bits = Bits::bytes(29, 1);
    /// ECE vendor ID, high part, be16.
    pub const VENDOR_ID_H: Bits = Bits::bytes(30, 2);
    /// QPN, 24 bits.
    pub const QPN: Bits = Bits::new(32, 4, 8, 24);
    /// ECE vendor ID, low byte.
    pub const VENDOR_ID_L: Bits = Bits::bytes(35, 1);
    /// Service ID, be64.
    pub const SERVICE_ID: Bits = Bits::bytes(36, 8);
    /// Q_Key, be32.
    pub const Q_KEY: Bits = Bits::bytes(44, 4);
    /// Additional information, 72 bytes.
    pub const ADDITIONAL_INFO: Field = 48..120;
    /// Private data, 136 bytes.
    pub const PRIVATE_DATA: Field = 120..256;
}

/// Maximum private data of a SIDR_REP.
pub const PRIVATE_DATA_LEN: usize = 136;
/// Maximum length of the additional information.
pub const ADDITIONAL_INFO_LEN: usize = 72;

view!(
    Packet,
    AttributeId::SidrRep,
    "A zero-copy view of a SIDR_REP MAD."
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// RequestID.
    pub fn request_id(&self) -> u32 {
        self.get(field::REQUEST_ID) as u32
    }
    /// Raw status code.
    pub fn status_code(&self) -> u8 {
        self.get(field::STATUS) as u8
    }
    /// Status; fails with [`Error::Reserved`] on codes above 5.
    pub fn status(&self) -> Result<SidrStatus> {
        let c = self.status_code();
        SidrStatus::from_code(c).ok_or(Error::Reserved {
            field: "status",
            value: c.into(),
        })
    }
    /// Additional information length in bytes (above 72 is invalid).
    pub fn additional_info_length(&self) -> u8 {
        self.get(field::ADDITIONAL_INFO_LENGTH) as u8
    }
    /// ECE vendor ID, high part (16 bits).
    pub fn vendor_id_h(&self) -> u16 {
        self.get(field::VENDOR_ID_H) as u16
    }
    /// ECE vendor ID, low byte.
    pub fn vendor_id_l(&self) -> u8 {
        self.get(field::VENDOR_ID_L) as u8
    }
    /// ECE vendor ID, 24 bits (`H << 8 | L`).
    pub fn vendor_id(&self) -> u32 {
        u32::from(self.vendor_id_h()) << 8 | u32::from(self.vendor_id_l())
    }
    /// QPN of the service.
    pub fn qpn(&self) -> u32 {
        self.get(field::QPN) as u32
    }
    /// Service ID.
    pub fn service_id(&self) -> u64 {
        self.get(field::SERVICE_ID)
    }
    /// Q_Key of the service.
    pub fn qkey(&self) -> u32 {
        self.get(field::Q_KEY) as u32
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
    /// Private data (all 136 bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.bytes()[field::PRIVATE_DATA]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the RequestID.
    pub fn set_request_id(&mut self, v: u32) {
        self.set(field::REQUEST_ID, v.into())
    }
    /// Sets the QPN (24 bits; the vendor ID byte after it is left alone).
    pub fn set_qpn(&mut self, v: u32) {
        self.set(field::QPN, v.into())
    }
    /// Sets the Q_Key.
    pub fn set_qkey(&mut self, v: u32) {
        self.set(field::Q_KEY, v.into())
    }
}

/// A parsed SIDR_REP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr<'a> {
    /// RequestID (the SIDR_REQ's).
    pub request_id: u32,
    /// Status.
    pub status: SidrStatus,
    /// ECE vendor ID (24 bits; 0 when unused).
    pub vendor_id: u32,
    /// QPN of the service (24 bits).
    pub qpn: u32,
    /// Service ID.
    pub service_id: u64,
    /// Q_Key of the service.
    pub qkey: u32,
    /// Additional information, exactly as long as its length field (at most
    /// [`ADDITIONAL_INFO_LEN`] bytes).
    pub additional_info: &'a [u8],
    /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
    pub private_data: &'a [u8],
}

impl<'a> Repr<'a> {
    /// Parses a SIDR_REP. A reserved status and an additional information length
    /// above 72 are errors.
    pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
        let bytes: &'a [u8] = p.buffer;
        Ok(Repr {
            request_id: p.request_id(),
            status: p.status()?,
            vendor_id: p.vendor_id(),
            qpn: p.qpn(),
            service_id: p.service_id(),
            qkey: p.qkey(),
            additional_info: var_part(
                bytes,
                field::ADDITIONAL_INFO,
                "additional_info_length",
                p.additional_info_length().into(),
            )?,
            private_data: &bytes[field::PRIVATE_DATA],
        })
    }

    /// Writes the SIDR_REP's data (bytes 24..256; reserved bits zeroed), the length
    /// field being the additional information's length. The MAD header is the
    /// caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        check_fits("additional_info", self.additional_info, ADDITIONAL_INFO_LEN)?;
        check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::REQUEST_ID, self.request_id.into());
        p.set(field::STATUS, self.status.code().into());
        p.set(
            field::ADDITIONAL_INFO_LENGTH,
            self.additional_info.len() as u64,
        );
        p.set(field::VENDOR_ID_H, (self.vendor_id >> 8).into());
        p.set(field::QPN, self.qpn.into());
        p.set(field::VENDOR_ID_L, self.vendor_id.into());
        p.set(field::SERVICE_ID, self.service_id);
        p.set(field::Q_KEY, self.qkey.into());
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
            "SIDR_REP req_id={:#010x} status={} qpn={:#08x} qkey={:#010x} sid={:#018x} info_len={}",
            self.request_id,
            self.status,
            self.qpn,
            self.qkey,
            self.service_id,
            self.additional_info.len(),
        )
    }
}

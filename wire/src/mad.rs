//! The 24-byte MAD common header (IBTA 13.4.2) and the CM class's constants.
//!
//! A CM MAD is always [`MAD_LEN`] = 256 bytes: this header plus 232 data bytes.

use core::fmt;

use crate::error::{Error, Result, check_len};
use crate::field::Bits;

/// Length of every MAD handled here.
pub const MAD_LEN: usize = 256;
/// Length of the common MAD header.
pub const HEADER_LEN: usize = 24;
/// Length of the data that follows the header.
pub const DATA_LEN: usize = MAD_LEN - HEADER_LEN;

/// MAD base version (IBTA: 1).
pub const BASE_VERSION: u8 = 1;
/// Management class of the Communication Manager.
pub const MGMT_CLASS_CM: u8 = 0x07;
/// CM class version (`IB_CM_CLASS_VERSION`).
pub const CM_CLASS_VERSION: u8 = 2;

/// Byte ranges and bit fields of the header.
pub mod field {
    use super::Bits;
    /// Base version, u8.
    pub const BASE_VERSION: Bits = Bits::bytes(0, 1);
    /// Management class, u8.
    pub const MGMT_CLASS: Bits = Bits::bytes(1, 1);
    /// Class version, u8.
    pub const CLASS_VERSION: Bits = Bits::bytes(2, 1);
    /// Method, u8 (R bit is the MSB).
    pub const METHOD: Bits = Bits::bytes(3, 1);
    /// Status, be16.
    pub const STATUS: Bits = Bits::bytes(4, 2);
    /// Class-specific, be16.
    pub const CLASS_SPECIFIC: Bits = Bits::bytes(6, 2);
    /// Transaction ID, be64.
    pub const TID: Bits = Bits::bytes(8, 8);
    /// Attribute ID, be16.
    pub const ATTR_ID: Bits = Bits::bytes(16, 2);
    /// Reserved, be16.
    pub const RESERVED: Bits = Bits::bytes(18, 2);
    /// Attribute modifier, be32 (carries ECE for REQ/REP/SIDR_REP in Linux).
    pub const ATTR_MOD: Bits = Bits::bytes(20, 4);
}

/// MAD methods the CM class uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Method {
    /// Get (ClassPortInfo request).
    Get = 0x01,
    /// Set.
    Set = 0x02,
    /// Send: every CM protocol message.
    Send = 0x03,
    /// Response to a Get.
    GetResp = 0x81,
}

impl Method {
    /// The method of a raw method byte, if the CM class uses it.
    pub fn from_u8(v: u8) -> Option<Method> {
        Some(match v {
            0x01 => Method::Get,
            0x02 => Method::Set,
            0x03 => Method::Send,
            0x81 => Method::GetResp,
            _ => return None,
        })
    }

    /// True for the methods whose TID starts a new transaction (not a response).
    pub fn is_request(self) -> bool {
        matches!(self, Method::Get | Method::Set)
    }
}

/// Attribute IDs of the CM class (`include/rdma/ib_cm.h`), plus ClassPortInfo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u16)]
pub enum AttributeId {
    /// ClassPortInfo (Get/GetResp).
    ClassPortInfo = 0x0001,
    /// Connection request.
    Req = 0x0010,
    /// Message receipt acknowledgement.
    Mra = 0x0011,
    /// Reject.
    Rej = 0x0012,
    /// Reply to request.
    Rep = 0x0013,
    /// Ready to use.
    Rtu = 0x0014,
    /// Disconnect request.
    Dreq = 0x0015,
    /// Disconnect reply.
    Drep = 0x0016,
    /// Service ID resolution request.
    SidrReq = 0x0017,
    /// Service ID resolution response.
    SidrRep = 0x0018,
    /// Load alternate path.
    Lap = 0x0019,
    /// Alternate path response.
    Apr = 0x001A,
}

impl AttributeId {
    /// The 11 CM protocol messages, in attribute-ID order (the order of Linux's counters).
    pub const CM_MESSAGES: [AttributeId; 11] = [
        AttributeId::Req,
        AttributeId::Mra,
        AttributeId::Rej,
        AttributeId::Rep,
        AttributeId::Rtu,
        AttributeId::Dreq,
        AttributeId::Drep,
        AttributeId::SidrReq,
        AttributeId::SidrRep,
        AttributeId::Lap,
        AttributeId::Apr,
    ];

    /// The attribute of a raw ID, if the CM class defines it.
    pub fn from_u16(v: u16) -> Option<AttributeId> {
        Some(match v {
            0x0001 => AttributeId::ClassPortInfo,
            0x0010 => AttributeId::Req,
            0x0011 => AttributeId::Mra,
            0x0012 => AttributeId::Rej,
            0x0013 => AttributeId::Rep,
            0x0014 => AttributeId::Rtu,
            0x0015 => AttributeId::Dreq,
            0x0016 => AttributeId::Drep,
            0x0017 => AttributeId::SidrReq,
            0x0018 => AttributeId::SidrRep,
            0x0019 => AttributeId::Lap,
            0x001A => AttributeId::Apr,
            _ => return None,
        })
    }

    /// Index 0..11 of a CM protocol message (`attr_id - 0x10`, Linux's counter index);
    /// `None` for ClassPortInfo.
    pub fn counter_index(self) -> Option<usize> {
        (self as u16).checked_sub(0x10).map(usize::from)
    }

    /// Lower-case name as in Linux's infiniband_cm sysfs counters (`req`, `sidr_rep`, ...).
    pub fn name(self) -> &'static str {
        match self {
            AttributeId::ClassPortInfo => "class_port_info",
            AttributeId::Req => "req",
            AttributeId::Mra => "mra",
            AttributeId::Rej => "rej",
            AttributeId::Rep => "rep",
            AttributeId::Rtu => "rtu",
            AttributeId::Dreq => "dreq",
            AttributeId::Drep => "drep",
            AttributeId::SidrReq => "sidr_req",
            AttributeId::SidrRep => "sidr_rep",
            AttributeId::Lap => "lap",
            AttributeId::Apr => "apr",
        }
    }
}

impl fmt::Display for AttributeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name().to_ascii_uppercase())
    }
}

/// A zero-copy view of a MAD's common header.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it; accessors may panic on a short buffer.
    /// Use [`Packet::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole 256-byte MAD.
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        check_len(buffer.as_ref(), MAD_LEN)?;
        Ok(Packet { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The whole underlying buffer.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// Base version.
    pub fn base_version(&self) -> u8 {
        field::BASE_VERSION.get(self.buffer.as_ref()) as u8
    }
    /// Management class.
    pub fn mgmt_class(&self) -> u8 {
        field::MGMT_CLASS.get(self.buffer.as_ref()) as u8
    }
    /// Class version.
    pub fn class_version(&self) -> u8 {
        field::CLASS_VERSION.get(self.buffer.as_ref()) as u8
    }
    /// Raw method byte.
    pub fn method(&self) -> u8 {
        field::METHOD.get(self.buffer.as_ref()) as u8
    }
    /// Status.
    pub fn status(&self) -> u16 {
        field::STATUS.get(self.buffer.as_ref()) as u16
    }
    /// Class-specific word.
    pub fn class_specific(&self) -> u16 {
        field::CLASS_SPECIFIC.get(self.buffer.as_ref()) as u16
    }
    /// Transaction ID.
    pub fn tid(&self) -> u64 {
        field::TID.get(self.buffer.as_ref())
    }
    /// Raw attribute ID.
    pub fn attr_id(&self) -> u16 {
        field::ATTR_ID.get(self.buffer.as_ref()) as u16
    }
    /// Attribute modifier.
    pub fn attr_mod(&self) -> u32 {
        field::ATTR_MOD.get(self.buffer.as_ref()) as u32
    }

    /// Checks that this is a CM-class MAD this codec speaks: base version 1, class 0x07,
    /// class version 2, a known attribute, and the method that attribute travels with.
    pub fn check_cm(&self) -> Result<AttributeId> {
        if self.base_version() != BASE_VERSION {
            return Err(Error::BaseVersion(self.base_version()));
        }
        if self.mgmt_class() != MGMT_CLASS_CM {
            return Err(Error::MgmtClass(self.mgmt_class()));
        }
        if self.class_version() != CM_CLASS_VERSION {
            return Err(Error::ClassVersion(self.class_version()));
        }
        let attr =
            AttributeId::from_u16(self.attr_id()).ok_or(Error::UnknownAttribute(self.attr_id()))?;
        let method = self.method();
        let ok = match attr {
            AttributeId::ClassPortInfo => {
                matches!(Method::from_u8(method), Some(Method::Get | Method::GetResp))
            }
            _ => method == Method::Send as u8,
        };
        if !ok {
            return Err(Error::Method {
                method,
                attr: self.attr_id(),
            });
        }
        Ok(attr)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the transaction ID.
    pub fn set_tid(&mut self, tid: u64) {
        field::TID.set(self.buffer.as_mut(), tid)
    }
    /// Sets the status.
    pub fn set_status(&mut self, v: u16) {
        field::STATUS.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the attribute modifier.
    pub fn set_attr_mod(&mut self, v: u32) {
        field::ATTR_MOD.set(self.buffer.as_mut(), v.into())
    }
    /// The whole underlying buffer, mutable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }
}

/// A parsed MAD common header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Method byte.
    pub method: Method,
    /// Status.
    pub status: u16,
    /// Class-specific word.
    pub class_specific: u16,
    /// Transaction ID.
    pub tid: u64,
    /// Attribute ID.
    pub attr_id: AttributeId,
    /// Attribute modifier.
    pub attr_mod: u32,
}

impl Header {
    /// Parses and validates the header of a CM MAD.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Result<Header> {
        let attr_id = p.check_cm()?;
        let method = Method::from_u8(p.method()).ok_or(Error::Method {
            method: p.method(),
            attr: p.attr_id(),
        })?;
        Ok(Header {
            method,
            status: p.status(),
            class_specific: p.class_specific(),
            tid: p.tid(),
            attr_id,
            attr_mod: p.attr_mod(),
        })
    }

    /// A CM SEND header for `attr_id` with this TID, status 0, attribute modifier 0.
    pub fn cm_send(attr_id: AttributeId, tid: u64) -> Header {
        Header {
            method: Method::Send,
            status: 0,
            class_specific: 0,
            tid,
            attr_id,
            attr_mod: 0,
        }
    }

    /// Writes the header (base version 1, class CM, class version 2) into a MAD buffer.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        let b = p.buffer.as_mut();
        field::BASE_VERSION.set(b, BASE_VERSION.into());
        field::MGMT_CLASS.set(b, MGMT_CLASS_CM.into());
        field::CLASS_VERSION.set(b, CM_CLASS_VERSION.into());
        field::METHOD.set(b, (self.method as u8).into());
        field::STATUS.set(b, self.status.into());
        field::CLASS_SPECIFIC.set(b, self.class_specific.into());
        field::TID.set(b, self.tid);
        field::ATTR_ID.set(b, (self.attr_id as u16).into());
        field::RESERVED.set(b, 0);
        field::ATTR_MOD.set(b, self.attr_mod.into());
    }
}

impl fmt::Display for Header {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CM {} method={:#04x} tid={:#018x}",
            self.attr_id, self.method as u8, self.tid
        )?;
        if self.status != 0 {
            write!(f, " status={:#06x}", self.status)?;
        }
        if self.attr_mod != 0 {
            write!(f, " attr_mod={:#010x}", self.attr_mod)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_header() {
        let mut buf = [0u8; MAD_LEN];
        let h = Header {
            method: Method::Send,
            status: 0,
            class_specific: 0,
            tid: 0x1122_3344_5566_7788,
            attr_id: AttributeId::Dreq,
            attr_mod: 0xA0B0_C0D0,
        };
        h.emit(&mut Packet::new_checked(&mut buf[..]).unwrap());
        let expected: [u8; 24] = [
            0x01, 0x07, 0x02, 0x03, 0, 0, 0, 0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88,
            0x00, 0x15, 0, 0, 0xA0, 0xB0, 0xC0, 0xD0,
        ];
        assert_eq!(&buf[..24], &expected);
        assert_eq!(
            Header::parse(&Packet::new_checked(&buf[..]).unwrap()).unwrap(),
            h
        );
    }

    #[test]
    fn rejects_bad_headers() {
        let mut buf = [0u8; MAD_LEN];
        Header::cm_send(AttributeId::Req, 1).emit(&mut Packet::new_unchecked(&mut buf[..]));
        let check = |b: &[u8]| Packet::new_checked(b).and_then(|p| p.check_cm());
        assert_eq!(check(&buf), Ok(AttributeId::Req));
        assert_eq!(
            check(&buf[..255]),
            Err(Error::Truncated {
                need: 256,
                have: 255
            })
        );
        let mut b = buf;
        b[0] = 2;
        assert_eq!(check(&b), Err(Error::BaseVersion(2)));
        let mut b = buf;
        b[1] = 0x03;
        assert_eq!(check(&b), Err(Error::MgmtClass(0x03)));
        let mut b = buf;
        b[2] = 1;
        assert_eq!(check(&b), Err(Error::ClassVersion(1)));
        let mut b = buf;
        b[17] = 0x1B;
        assert_eq!(check(&b), Err(Error::UnknownAttribute(0x1B)));
        let mut b = buf;
        b[3] = 0x01;
        assert_eq!(
            check(&b),
            Err(Error::Method {
                method: 1,
                attr: 0x10
            })
        );
    }

    #[test]
    fn counter_indexes_follow_linux() {
        for (i, a) in AttributeId::CM_MESSAGES.iter().enumerate() {
            assert_eq!(a.counter_index(), Some(i));
            assert_eq!(AttributeId::from_u16(*a as u16), Some(*a));
        }
        assert_eq!(AttributeId::ClassPortInfo.counter_index(), None);
    }
}

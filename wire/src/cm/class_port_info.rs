//! ClassPortInfo of the CM class (IBTA 13.4.8.1, attribute 0x0001).
//!
//! Unlike the CM protocol messages it travels as GET (0x01) / GETRESP (0x81), and its
//! layout is Linux's `struct ib_class_port_info`, starting right after the MAD header
//! (abs 24). Offsets are absolute from the start of the 256-byte MAD; bytes 96..256 are
//! reserved. It has no private data.

use core::fmt;

use super::view;
use crate::error::Result;
use crate::field::{Bits, Field};
use crate::gid::Gid;
use crate::mad::AttributeId;

/// Byte ranges and bit fields of a ClassPortInfo.
pub mod field {
    use super::{Bits, Field};
    /// Base version, u8.
    pub const BASE_VERSION: Bits = Bits::bytes(24, 1);
    /// Class version, u8.
    pub const CLASS_VERSION: Bits = Bits::bytes(25, 1);
    /// Capability mask, be16.
    pub const CAPABILITY_MASK: Bits = Bits::bytes(26, 2);
    /// Capability mask 2, upper 27 bits of the be32 at 28.
    pub const CAP_MASK2: Bits = Bits::new(28, 4, 5, 27);
    /// Response time value, low 5 bits of the be32 at 28.
    pub const RESP_TIME: Bits = Bits::new(28, 4, 0, 5);
    /// Redirect GID.
    pub const REDIRECT_GID: Field = 32..48;
    /// Redirect traffic class, top 8 bits of the be32 at 48.
    pub const REDIRECT_TC: Bits = Bits::new(48, 4, 24, 8);
    /// Redirect SL, next 4 bits.
    pub const REDIRECT_SL: Bits = Bits::new(48, 4, 20, 4);
    /// Redirect flow label, low 20 bits.
    pub const REDIRECT_FL: Bits = Bits::new(48, 4, 0, 20);
    /// Redirect LID, be16.
    pub const REDIRECT_LID: Bits = Bits::bytes(52, 2);
    /// Redirect P_Key, be16.
    pub const REDIRECT_PKEY: Bits = Bits::bytes(54, 2);
    /// Redirect QP, low 24 bits of the be32 at 56 (top byte reserved).
    pub const REDIRECT_QP: Bits = Bits::new(56, 4, 0, 24);
    /// Redirect Q_Key, be32.
    pub const REDIRECT_QKEY: Bits = Bits::bytes(60, 4);
    /// Trap GID.
    pub const TRAP_GID: Field = 64..80;
    /// Trap traffic class, top 8 bits of the be32 at 80.
    pub const TRAP_TC: Bits = Bits::new(80, 4, 24, 8);
    /// Trap SL, next 4 bits.
    pub const TRAP_SL: Bits = Bits::new(80, 4, 20, 4);
    /// Trap flow label, low 20 bits.
    pub const TRAP_FL: Bits = Bits::new(80, 4, 0, 20);
    /// Trap LID, be16.
    pub const TRAP_LID: Bits = Bits::bytes(84, 2);
    /// Trap P_Key, be16.
    pub const TRAP_PKEY: Bits = Bits::bytes(86, 2);
    /// Trap hop limit, top 8 bits of the be32 at 88.
    pub const TRAP_HOP_LIMIT: Bits = Bits::new(88, 4, 24, 8);
    /// Trap QP, low 24 bits of the be32 at 88.
    pub const TRAP_QP: Bits = Bits::new(88, 4, 0, 24);
    /// Trap Q_Key, be32.
    pub const TRAP_QKEY: Bits = Bits::bytes(92, 4);
    /// Reserved to the end of the MAD.
    pub const RESERVED: Field = 96..256;
}

view!(
    Packet,
    AttributeId::ClassPortInfo,
    "A zero-copy view of a CM ClassPortInfo MAD (GET or GETRESP)."
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// Base version of the class's MADs.
    pub fn base_version(&self) -> u8 {
        self.get(field::BASE_VERSION) as u8
    }
    /// Class version.
    pub fn class_version(&self) -> u8 {
        self.get(field::CLASS_VERSION) as u8
    }
    /// Capability mask.
    pub fn capability_mask(&self) -> u16 {
        self.get(field::CAPABILITY_MASK) as u16
    }
    /// Capability mask 2 (27 bits).
    pub fn cap_mask2(&self) -> u32 {
        self.get(field::CAP_MASK2) as u32
    }
    /// Response time value (5-bit exponent).
    pub fn resp_time(&self) -> u8 {
        self.get(field::RESP_TIME) as u8
    }
    /// Redirect GID.
    pub fn redirect_gid(&self) -> Gid {
        self.gid(field::REDIRECT_GID)
    }
    /// Redirect traffic class.
    pub fn redirect_tc(&self) -> u8 {
        self.get(field::REDIRECT_TC) as u8
    }
    /// Redirect SL (4 bits).
    pub fn redirect_sl(&self) -> u8 {
        self.get(field::REDIRECT_SL) as u8
    }
    /// Redirect flow label (20 bits).
    pub fn redirect_fl(&self) -> u32 {
        self.get(field::REDIRECT_FL) as u32
    }
    /// Redirect LID.
    pub fn redirect_lid(&self) -> u16 {
        self.get(field::REDIRECT_LID) as u16
    }
    /// Redirect P_Key.
    pub fn redirect_pkey(&self) -> u16 {
        self.get(field::REDIRECT_PKEY) as u16
    }
    /// Redirect QP (24 bits).
    pub fn redirect_qp(&self) -> u32 {
        self.get(field::REDIRECT_QP) as u32
    }
    /// Redirect Q_Key.
    pub fn redirect_qkey(&self) -> u32 {
        self.get(field::REDIRECT_QKEY) as u32
    }
    /// Trap GID.
    pub fn trap_gid(&self) -> Gid {
        self.gid(field::TRAP_GID)
    }
    /// Trap traffic class.
    pub fn trap_tc(&self) -> u8 {
        self.get(field::TRAP_TC) as u8
    }
    /// Trap SL (4 bits).
    pub fn trap_sl(&self) -> u8 {
        self.get(field::TRAP_SL) as u8
    }
    /// Trap flow label (20 bits).
    pub fn trap_fl(&self) -> u32 {
        self.get(field::TRAP_FL) as u32
    }
    /// Trap LID.
    pub fn trap_lid(&self) -> u16 {
        self.get(field::TRAP_LID) as u16
    }
    /// Trap P_Key.
    pub fn trap_pkey(&self) -> u16 {
        self.get(field::TRAP_PKEY) as u16
    }
    /// Trap hop limit.
    pub fn trap_hop_limit(&self) -> u8 {
        self.get(field::TRAP_HOP_LIMIT) as u8
    }
    /// Trap QP (24 bits).
    pub fn trap_qp(&self) -> u32 {
        self.get(field::TRAP_QP) as u32
    }
    /// Trap Q_Key.
    pub fn trap_qkey(&self) -> u32 {
        self.get(field::TRAP_QKEY) as u32
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the response time value (5-bit exponent; capability mask 2 is left alone).
    pub fn set_resp_time(&mut self, v: u8) {
        self.set(field::RESP_TIME, v.into())
    }
    /// Sets the redirect GID.
    pub fn set_redirect_gid(&mut self, g: Gid) {
        self.set_gid(field::REDIRECT_GID, g)
    }
    /// Sets the redirect LID.
    pub fn set_redirect_lid(&mut self, v: u16) {
        self.set(field::REDIRECT_LID, v.into())
    }
    /// Sets the redirect QP (24 bits).
    pub fn set_redirect_qp(&mut self, v: u32) {
        self.set(field::REDIRECT_QP, v.into())
    }
    /// Sets the trap GID.
    pub fn set_trap_gid(&mut self, g: Gid) {
        self.set_gid(field::TRAP_GID, g)
    }
    /// Sets the trap LID.
    pub fn set_trap_lid(&mut self, v: u16) {
        self.set(field::TRAP_LID, v.into())
    }
    /// Sets the trap QP (24 bits; the hop limit is left alone).
    pub fn set_trap_qp(&mut self, v: u32) {
        self.set(field::TRAP_QP, v.into())
    }
}

/// A parsed ClassPortInfo. It borrows nothing (no private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Repr {
    /// Base version of the class's MADs.
    pub base_version: u8,
    /// Class version.
    pub class_version: u8,
    /// Capability mask.
    pub capability_mask: u16,
    /// Capability mask 2 (27 bits).
    pub cap_mask2: u32,
    /// Response time value (5-bit exponent).
    pub resp_time: u8,
    /// Redirect GID.
    pub redirect_gid: Gid,
    /// Redirect traffic class.
    pub redirect_tc: u8,
    /// Redirect SL (4 bits).
    pub redirect_sl: u8,
    /// Redirect flow label (20 bits).
    pub redirect_fl: u32,
    /// Redirect LID.
    pub redirect_lid: u16,
    /// Redirect P_Key.
    pub redirect_pkey: u16,
    /// Redirect QP (24 bits).
    pub redirect_qp: u32,
    /// Redirect Q_Key.
    pub redirect_qkey: u32,
    /// Trap GID.
    pub trap_gid: Gid,
    /// Trap traffic class.
    pub trap_tc: u8,
    /// Trap SL (4 bits).
    pub trap_sl: u8,
    /// Trap flow label (20 bits).
    pub trap_fl: u32,
    /// Trap LID.
    pub trap_lid: u16,
    /// Trap P_Key.
    pub trap_pkey: u16,
    /// Trap hop limit.
    pub trap_hop_limit: u8,
    /// Trap QP (24 bits).
    pub trap_qp: u32,
    /// Trap Q_Key.
    pub trap_qkey: u32,
}

impl Repr {
    /// Parses a ClassPortInfo (every bit pattern is valid).
    pub fn parse(p: &Packet<&[u8]>) -> Result<Repr> {
        Ok(Repr {
            base_version: p.base_version(),
            class_version: p.class_version(),
            capability_mask: p.capability_mask(),
            cap_mask2: p.cap_mask2(),
            resp_time: p.resp_time(),
            redirect_gid: p.redirect_gid(),
            redirect_tc: p.redirect_tc(),
            redirect_sl: p.redirect_sl(),
            redirect_fl: p.redirect_fl(),
            redirect_lid: p.redirect_lid(),
            redirect_pkey: p.redirect_pkey(),
            redirect_qp: p.redirect_qp(),
            redirect_qkey: p.redirect_qkey(),
            trap_gid: p.trap_gid(),
            trap_tc: p.trap_tc(),
            trap_sl: p.trap_sl(),
            trap_fl: p.trap_fl(),
            trap_lid: p.trap_lid(),
            trap_pkey: p.trap_pkey(),
            trap_hop_limit: p.trap_hop_limit(),
            trap_qp: p.trap_qp(),
            trap_qkey: p.trap_qkey(),
        })
    }

    /// Writes the ClassPortInfo (bytes 24..256; reserved bits zeroed). The MAD header,
    /// GET or GETRESP, is the caller's (see [`crate::cm::CmRepr::emit`]).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
        p.buffer.as_mut()[crate::mad::HEADER_LEN..crate::mad::MAD_LEN].fill(0);
        p.set(field::BASE_VERSION, self.base_version.into());
        p.set(field::CLASS_VERSION, self.class_version.into());
        p.set(field::CAPABILITY_MASK, self.capability_mask.into());
        p.set(field::CAP_MASK2, self.cap_mask2.into());
        p.set(field::RESP_TIME, self.resp_time.into());
        p.set_gid(field::REDIRECT_GID, self.redirect_gid);
        p.set(field::REDIRECT_TC, self.redirect_tc.into());
        p.set(field::REDIRECT_SL, self.redirect_sl.into());
        p.set(field::REDIRECT_FL, self.redirect_fl.into());
        p.set(field::REDIRECT_LID, self.redirect_lid.into());
        p.set(field::REDIRECT_PKEY, self.redirect_pkey.into());
        p.set(field::REDIRECT_QP, self.redirect_qp.into());
        p.set(field::REDIRECT_QKEY, self.redirect_qkey.into());
        p.set_gid(field::TRAP_GID, self.trap_gid);
        p.set(field::TRAP_TC, self.trap_tc.into());
        p.set(field::TRAP_SL, self.trap_sl.into());
        p.set(field::TRAP_FL, self.trap_fl.into());
        p.set(field::TRAP_LID, self.trap_lid.into());
        p.set(field::TRAP_PKEY, self.trap_pkey.into());
        p.set(field::TRAP_HOP_LIMIT, self.trap_hop_limit.into());
        p.set(field::TRAP_QP, self.trap_qp.into());
        p.set(field::TRAP_QKEY, self.trap_qkey.into());
        Ok(())
    }
}

impl fmt::Display for Repr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CLASS_PORT_INFO v{}/{} cap={:#06x} cap2={:#09x} resp_time={} redirect={}/{:#06x}/{:#08x} \
             trap={}/{:#06x}/{:#08x}",
            self.base_version,
            self.class_version,
            self.capability_mask,
            self.cap_mask2,
            self.resp_time,
            self.redirect_gid,
            self.redirect_lid,
            self.redirect_qp,
            self.trap_gid,
            self.trap_lid,
            self.trap_qp,
        )
    }
}

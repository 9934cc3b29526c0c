//! The Base Transport Header (IBTA 9.2): a UD SEND only to QP1.

use core::fmt;

use crate::error::{Error, Result, check_len};
use crate::field::Bits;
use crate::mad::MAD_LEN;

use super::consts::*;

/// The Base Transport Header (IBTA 9.2), relative to its first byte.
pub mod field {
    use crate::field::Bits;
    /// Opcode, u8.
    pub const OPCODE: Bits = Bits::bytes(0, 1);
    /// Solicited Event, 1 bit.
    pub const SE: Bits = Bits::new(1, 1, 7, 1);
    /// MigReq, 1 bit.
    pub const MIG_REQ: Bits = Bits::new(1, 1, 6, 1);
    /// Pad count, 2 bits.
    pub const PAD_CNT: Bits = Bits::new(1, 1, 4, 2);
    /// Transport header version, 4 bits.
    pub const TVER: Bits = Bits::new(1, 1, 0, 4);
    /// Partition key, be16.
    pub const PKEY: Bits = Bits::bytes(2, 2);
    /// The variant byte the ICRC masks to ones: FECN, BECN and 6 reserved bits.
    pub const VARIANT: usize = 4;
    /// FECN, 1 bit.
    pub const FECN: Bits = Bits::new(4, 1, 7, 1);
    /// BECN, 1 bit.
    pub const BECN: Bits = Bits::new(4, 1, 6, 1);
    /// Reserved, 6 bits.
    pub const RESV6: Bits = Bits::new(4, 1, 0, 6);
    /// Destination QP, 24 bits.
    pub const DEST_QP: Bits = Bits::new(4, 4, 0, 24);
    /// AckReq, 1 bit.
    pub const ACK_REQ: Bits = Bits::new(8, 1, 7, 1);
    /// Reserved, 7 bits.
    pub const RESV7: Bits = Bits::new(8, 1, 0, 7);
    /// Packet sequence number, 24 bits.
    pub const PSN: Bits = Bits::new(8, 4, 0, 24);
}

/// A zero-copy view of a Base Transport Header.
#[derive(Debug, Clone)]
pub struct BthPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> BthPacket<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`BTH_LEN`]. Use [`BthPacket::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> BthPacket<T> {
        BthPacket { buffer }
    }

    /// Wraps a buffer after checking it holds at least a BTH (any opcode).
    pub fn new_checked(buffer: T) -> Result<BthPacket<T>> {
        check_len(buffer.as_ref(), BTH_LEN)?;
        Ok(BthPacket { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    #[inline]
    fn get(&self, f: Bits) -> u64 {
        f.get(self.buffer.as_ref())
    }

    /// Opcode.
    pub fn opcode(&self) -> u8 {
        self.get(field::OPCODE) as u8
    }
    /// Solicited Event.
    pub fn solicited_event(&self) -> bool {
        self.get(field::SE) != 0
    }
    /// MigReq.
    pub fn mig_req(&self) -> bool {
        self.get(field::MIG_REQ) != 0
    }
    /// Pad count (bytes of padding after the payload, 0..=3).
    pub fn pad_count(&self) -> u8 {
        self.get(field::PAD_CNT) as u8
    }
    /// Transport header version.
    pub fn tver(&self) -> u8 {
        self.get(field::TVER) as u8
    }
    /// Partition key.
    pub fn pkey(&self) -> u16 {
        self.get(field::PKEY) as u16
    }
    /// FECN (forward congestion notification).
    pub fn fecn(&self) -> bool {
        self.get(field::FECN) != 0
    }
    /// BECN (backward congestion notification).
    pub fn becn(&self) -> bool {
        self.get(field::BECN) != 0
    }
    /// Destination QP number.
    pub fn dest_qp(&self) -> u32 {
        self.get(field::DEST_QP) as u32
    }
    /// AckReq.
    pub fn ack_req(&self) -> bool {
        self.get(field::ACK_REQ) != 0
    }
    /// Packet sequence number.
    pub fn psn(&self) -> u32 {
        self.get(field::PSN) as u32
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> BthPacket<T> {
    #[inline]
    fn set(&mut self, f: Bits, v: u64) {
        f.set(self.buffer.as_mut(), v)
    }

    /// Sets the opcode.
    pub fn set_opcode(&mut self, v: u8) {
        self.set(field::OPCODE, v.into())
    }
    /// Sets Solicited Event.
    pub fn set_solicited_event(&mut self, v: bool) {
        self.set(field::SE, v.into())
    }
    /// Sets MigReq.
    pub fn set_mig_req(&mut self, v: bool) {
        self.set(field::MIG_REQ, v.into())
    }
    /// Sets the pad count (2 bits).
    pub fn set_pad_count(&mut self, v: u8) {
        self.set(field::PAD_CNT, v.into())
    }
    /// Sets the transport header version (4 bits).
    pub fn set_tver(&mut self, v: u8) {
        self.set(field::TVER, v.into())
    }
    /// Sets the partition key.
    pub fn set_pkey(&mut self, v: u16) {
        self.set(field::PKEY, v.into())
    }
    /// Sets FECN.
    pub fn set_fecn(&mut self, v: bool) {
        self.set(field::FECN, v.into())
    }
    /// Sets BECN.
    pub fn set_becn(&mut self, v: bool) {
        self.set(field::BECN, v.into())
    }
    /// Sets the destination QP (24 bits).
    pub fn set_dest_qp(&mut self, v: u32) {
        self.set(field::DEST_QP, v.into())
    }
    /// Sets AckReq.
    pub fn set_ack_req(&mut self, v: bool) {
        self.set(field::ACK_REQ, v.into())
    }
    /// Sets the PSN (24 bits).
    pub fn set_psn(&mut self, v: u32) {
        self.set(field::PSN, v.into())
    }
}

/// A parsed BTH of a UD SEND only (the only kind this codec speaks): opcode 0x64,
/// transport header version 0, pad count 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BthRepr {
    /// Solicited Event.
    pub solicited_event: bool,
    /// MigReq.
    pub mig_req: bool,
    /// Partition key.
    pub pkey: u16,
    /// FECN (set by the network; not covered by the ICRC).
    pub fecn: bool,
    /// BECN (set by the network; not covered by the ICRC).
    pub becn: bool,
    /// Destination QP (24 bits).
    pub dest_qp: u32,
    /// AckReq.
    pub ack_req: bool,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl BthRepr {
    /// The BTH of a CM MAD to the GSI: default P_Key, destination QP 1, flags clear.
    pub fn gsi(psn: u32) -> BthRepr {
        BthRepr {
            solicited_event: false,
            mig_req: false,
            pkey: DEFAULT_PKEY,
            fecn: false,
            becn: false,
            dest_qp: GSI_QPN,
            ack_req: false,
            psn,
        }
    }

    /// Parses a BTH; fails unless it is a UD SEND only of version 0 without padding
    /// (a padded frame's payload is not a whole 256-byte MAD: [`Error::PayloadLength`]).
    pub fn parse<T: AsRef<[u8]>>(p: &BthPacket<T>) -> Result<BthRepr> {
        if p.opcode() != OPCODE_UD_SEND_ONLY {
            return Err(Error::BthOpcode(p.opcode()));
        }
        if p.tver() != 0 {
            return Err(Error::BthVersion(p.tver()));
        }
        if p.pad_count() != 0 {
            return Err(Error::PayloadLength(MAD_LEN - usize::from(p.pad_count())));
        }
        Ok(BthRepr {
            solicited_event: p.solicited_event(),
            mig_req: p.mig_req(),
            pkey: p.pkey(),
            fecn: p.fecn(),
            becn: p.becn(),
            dest_qp: p.dest_qp(),
            ack_req: p.ack_req(),
            psn: p.psn(),
        })
    }

    /// Writes the BTH (opcode 0x64, version 0, pad 0, reserved bits zero). Bits of
    /// `dest_qp` and `psn` above 24 are dropped.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut BthPacket<T>) {
        p.buffer.as_mut()[..BTH_LEN].fill(0);
        p.set_opcode(OPCODE_UD_SEND_ONLY);
        p.set_solicited_event(self.solicited_event);
        p.set_mig_req(self.mig_req);
        p.set_pkey(self.pkey);
        p.set_fecn(self.fecn);
        p.set_becn(self.becn);
        p.set_dest_qp(self.dest_qp);
        p.set_ack_req(self.ack_req);
        p.set_psn(self.psn);
    }
}

impl fmt::Display for BthRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BTH UD_SEND_ONLY pkey={:#06x} dqpn={:#08x} psn={:#08x}",
            self.pkey, self.dest_qp, self.psn
        )?;
        for (on, name) in [
            (self.solicited_event, "se"),
            (self.mig_req, "mig"),
            (self.fecn, "fecn"),
            (self.becn, "becn"),
            (self.ack_req, "ackreq"),
        ] {
            if on {
                write!(f, " {name}")?;
            }
        }
        Ok(())
    }
}

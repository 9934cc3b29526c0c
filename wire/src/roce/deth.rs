//! The Datagram Extended Transport Header (IBTA 9.3.3): the Q_Key and source QP.

use core::fmt;

use crate::error::{Result, check_len};

use super::consts::*;

/// The Datagram Extended Transport Header (IBTA 9.3.3), relative to its first byte.
pub mod field {
    use crate::field::Bits;
    /// Queue key, be32.
    pub const QKEY: Bits = Bits::bytes(0, 4);
    /// Reserved, u8.
    pub const RESERVED: Bits = Bits::bytes(4, 1);
    /// Source QP, 24 bits.
    pub const SRC_QP: Bits = Bits::new(4, 4, 0, 24);
}

/// A zero-copy view of a Datagram Extended Transport Header.
#[derive(Debug, Clone)]
pub struct DethPacket<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> DethPacket<T> {
    /// Wraps a buffer without checking it; accessors may panic if it is shorter than
    /// [`DETH_LEN`]. Use [`DethPacket::new_checked`] on untrusted input.
    pub const fn new_unchecked(buffer: T) -> DethPacket<T> {
        DethPacket { buffer }
    }

    /// Wraps a buffer after checking it holds at least a DETH.
    pub fn new_checked(buffer: T) -> Result<DethPacket<T>> {
        check_len(buffer.as_ref(), DETH_LEN)?;
        Ok(DethPacket { buffer })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Queue key.
    pub fn qkey(&self) -> u32 {
        field::QKEY.get(self.buffer.as_ref()) as u32
    }
    /// Source QP number.
    pub fn src_qp(&self) -> u32 {
        field::SRC_QP.get(self.buffer.as_ref()) as u32
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> DethPacket<T> {
    /// Sets the queue key.
    pub fn set_qkey(&mut self, v: u32) {
        field::QKEY.set(self.buffer.as_mut(), v.into())
    }
    /// Sets the source QP (24 bits).
    pub fn set_src_qp(&mut self, v: u32) {
        field::SRC_QP.set(self.buffer.as_mut(), v.into())
    }
}

/// A parsed DETH.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DethRepr {
    /// Queue key ([`GSI_QKEY`] for CM MADs).
    pub qkey: u32,
    /// Source QP (24 bits; [`GSI_QPN`] for CM MADs).
    pub src_qp: u32,
}

impl DethRepr {
    /// The DETH of a MAD sent by the GSI: Q_Key 0x8001_0000, source QP 1.
    pub fn gsi() -> DethRepr {
        DethRepr {
            qkey: GSI_QKEY,
            src_qp: GSI_QPN,
        }
    }

    /// Parses a DETH (any Q_Key and source QP; the caller decides what it accepts).
    pub fn parse<T: AsRef<[u8]>>(p: &DethPacket<T>) -> Result<DethRepr> {
        Ok(DethRepr {
            qkey: p.qkey(),
            src_qp: p.src_qp(),
        })
    }

    /// Writes the DETH (reserved byte zero).
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut DethPacket<T>) {
        field::RESERVED.set(p.buffer.as_mut(), 0);
        p.set_qkey(self.qkey);
        p.set_src_qp(self.src_qp);
    }
}

impl fmt::Display for DethRepr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DETH qkey={:#010x} sqpn={:#08x}", self.qkey, self.src_qp)
    }
}

//! Register access: the [`Mmio`] trait and windows into a BAR.

use std::rc::Rc;
use std::sync::Arc;

/// A region of device registers (a mapped BAR, a window into one, or a fake in tests).
///
/// Offsets are bytes from the region's start; accesses are naturally aligned and of the
/// given width (volatile on real memory). Out-of-range reads return all ones and
/// out-of-range writes are dropped, like a PCI master abort; [`MmioWindow::new`] and
/// the users in this module check lengths up front so that never happens in practice.
pub trait Mmio {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the region is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Reads a byte.
    fn read8(&self, off: usize) -> u8;
    /// Reads a little-endian u16.
    fn read16(&self, off: usize) -> u16;
    /// Reads a little-endian u32.
    fn read32(&self, off: usize) -> u32;
    /// Writes a byte.
    fn write8(&self, off: usize, v: u8);
    /// Writes a little-endian u16.
    fn write16(&self, off: usize, v: u16);
    /// Writes a little-endian u32.
    fn write32(&self, off: usize, v: u32);
    /// Writes a u64 as two u32 writes, low half first (what virtio allows for its
    /// 64-bit fields).
    fn write64(&self, off: usize, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
}

macro_rules! forward_mmio {
    ($($t:ty),*) => {$(
        impl<T: Mmio + ?Sized> Mmio for $t {
            fn len(&self) -> usize { (**self).len() }
            fn read8(&self, off: usize) -> u8 { (**self).read8(off) }
            fn read16(&self, off: usize) -> u16 { (**self).read16(off) }
            fn read32(&self, off: usize) -> u32 { (**self).read32(off) }
            fn write8(&self, off: usize, v: u8) { (**self).write8(off, v) }
            fn write16(&self, off: usize, v: u16) { (**self).write16(off, v) }
            fn write32(&self, off: usize, v: u32) { (**self).write32(off, v) }
            fn write64(&self, off: usize, v: u64) { (**self).write64(off, v) }
        }
    )*};
}

forward_mmio!(&T, Arc<T>, Rc<T>, Box<T>);

/// `len` bytes of `mmio` from `base`: one virtio capability's structure inside a BAR.
#[derive(Debug, Clone)]
pub struct MmioWindow<M> {
    mmio: M,
    base: usize,
    len: usize,
}

impl<M: Mmio> MmioWindow<M> {
    /// The window, or `None` if it does not fit inside `mmio`.
    pub fn new(mmio: M, base: usize, len: usize) -> Option<MmioWindow<M>> {
        (base.checked_add(len)? <= mmio.len()).then_some(MmioWindow { mmio, base, len })
    }

    /// Offset of the window in the underlying region.
    pub fn base(&self) -> usize {
        self.base
    }

    fn at(&self, off: usize, width: usize) -> Option<usize> {
        (off.checked_add(width)? <= self.len).then_some(self.base + off)
    }
}

impl<M: Mmio> Mmio for MmioWindow<M> {
    fn len(&self) -> usize {
        self.len
    }
    fn read8(&self, off: usize) -> u8 {
        self.at(off, 1).map_or(!0, |o| self.mmio.read8(o))
    }
    fn read16(&self, off: usize) -> u16 {
        self.at(off, 2).map_or(!0, |o| self.mmio.read16(o))
    }
    fn read32(&self, off: usize) -> u32 {
        self.at(off, 4).map_or(!0, |o| self.mmio.read32(o))
    }
    fn write8(&self, off: usize, v: u8) {
        if let Some(o) = self.at(off, 1) {
            self.mmio.write8(o, v)
        }
    }
    fn write16(&self, off: usize, v: u16) {
        if let Some(o) = self.at(off, 2) {
            self.mmio.write16(o, v)
        }
    }
    fn write32(&self, off: usize, v: u32) {
        if let Some(o) = self.at(off, 4) {
            self.mmio.write32(o, v)
        }
    }
}

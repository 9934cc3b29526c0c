//! Byte ranges and bit fields, in the IBTA's big-endian "Byte\[Bit\]" notation.
//!
//! Every CM field is described by a [`Bits`]: the bytes of the big-endian word that
//! holds it, plus the shift and width of the field inside that word. A 24-bit QPN at
//! absolute byte 56 is `Bits::new(56, 4, 8, 24)`: the be32 at 56..60, shifted right by 8.
//! Views check the buffer length once in `new_checked`, so the accessors below index
//! within bounds that are already proven.

use core::ops::Range;

/// A byte range inside a structure.
pub type Field = Range<usize>;

/// A bit field inside a big-endian word of 1 to 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bits {
    /// First byte of the containing big-endian word.
    pub start: usize,
    /// Length of the containing word, in bytes (1..=8).
    pub len: usize,
    /// Right shift of the field inside the word.
    pub shift: u32,
    /// Width of the field, in bits.
    pub width: u32,
}

impl Bits {
    /// A field of `width` bits, `shift` bits above the LSB of the `len`-byte word at `start`.
    pub const fn new(start: usize, len: usize, shift: u32, width: u32) -> Self {
        Bits {
            start,
            len,
            shift,
            width,
        }
    }

    /// A whole big-endian word of `len` bytes at `start`.
    pub const fn bytes(start: usize, len: usize) -> Self {
        Bits::new(start, len, 0, (len * 8) as u32)
    }

    /// The field's mask, already shifted down to bit 0.
    pub const fn mask(&self) -> u64 {
        if self.width >= 64 {
            u64::MAX
        } else {
            (1u64 << self.width) - 1
        }
    }

    /// Byte range covered by the containing word.
    pub const fn range(&self) -> Field {
        self.start..self.start + self.len
    }

    /// Reads the containing big-endian word. `buf` must cover [`Bits::range`].
    ///
    /// Whole loads for the word sizes the CM uses (1, 2, 3, 4 and 8 bytes): no per-byte
    /// loop, and a constant `Bits` folds to a single load and shift. Under an emulating
    /// VMM (TCG) a byte loop costs a translated block per byte.
    #[inline(always)]
    fn word(&self, buf: &[u8]) -> u64 {
        let b = &buf[self.range()];
        match *b {
            [a] => u64::from(a),
            [a, c] => u64::from(u16::from_be_bytes([a, c])),
            [a, c, d] => u64::from(u32::from_be_bytes([0, a, c, d])),
            [a, c, d, e] => u64::from(u32::from_be_bytes([a, c, d, e])),
            [a, c, d, e, f, g, h, i] => u64::from_be_bytes([a, c, d, e, f, g, h, i]),
            _ => b.iter().fold(0u64, |w, x| (w << 8) | u64::from(*x)),
        }
    }

    /// Stores `word` as the big-endian word of [`Bits::range`].
    #[inline(always)]
    fn put_word(&self, buf: &mut [u8], word: u64) {
        let b = &mut buf[self.range()];
        let all = word.to_be_bytes();
        // The low `len` bytes of the big-endian u64 are the word (a word is at most 8
        // bytes; any bytes before the last 8 of a longer range are zero).
        let n = b.len().min(8);
        let (high, low) = b.split_at_mut(b.len() - n);
        high.fill(0);
        low.copy_from_slice(&all[8 - n..]);
    }

    /// Reads the field. `buf` must cover [`Bits::range`] (views guarantee this).
    #[inline(always)]
    pub fn get(&self, buf: &[u8]) -> u64 {
        (self.word(buf) >> self.shift) & self.mask()
    }

    /// Writes the field, leaving the other bits of the word untouched. Bits of `value`
    /// above the field's width are discarded.
    #[inline(always)]
    pub fn set(&self, buf: &mut [u8], value: u64) {
        let mask = self.mask() << self.shift;
        let word = if mask == u64::MAX >> (64 - 8 * self.len.clamp(1, 8)) {
            // The field is the whole word: nothing of the old word survives.
            0
        } else {
            self.word(buf) & !mask
        };
        self.put_word(buf, word | ((value << self.shift) & mask));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qpn_24_bits_leave_the_low_byte_alone() {
        let mut buf = [0u8; 8];
        buf[3] = 0xAB;
        let qpn = Bits::new(0, 4, 8, 24);
        qpn.set(&mut buf, 0x0012_3456);
        assert_eq!(&buf[..4], &[0x12, 0x34, 0x56, 0xAB]);
        assert_eq!(qpn.get(&buf), 0x12_3456);
    }

    #[test]
    fn upper_bits_of_a_byte() {
        let mut buf = [0xFFu8; 1];
        let t = Bits::new(0, 1, 3, 5);
        t.set(&mut buf, 0);
        assert_eq!(buf[0], 0x07);
        t.set(&mut buf, 0x1F);
        assert_eq!(buf[0], 0xFF);
        // Values wider than the field are cut, not spilled into neighbours.
        let mut buf = [0u8; 1];
        t.set(&mut buf, 0xFF);
        assert_eq!(buf[0], 0xF8);
    }

    /// The byte-at-a-time definition the loads above must agree with.
    fn reference_get(f: &Bits, buf: &[u8]) -> u64 {
        let mut word = 0u64;
        for b in &buf[f.range()] {
            word = (word << 8) | u64::from(*b);
        }
        (word >> f.shift) & f.mask()
    }

    fn reference_set(f: &Bits, buf: &mut [u8], value: u64) {
        let bytes = &mut buf[f.range()];
        let mut word = 0u64;
        for b in bytes.iter() {
            word = (word << 8) | u64::from(*b);
        }
        let mask = f.mask() << f.shift;
        word = (word & !mask) | ((value << f.shift) & mask);
        for (i, b) in bytes.iter_mut().rev().enumerate() {
            *b = (word >> (8 * i)) as u8;
        }
    }

    proptest::proptest! {
        #[test]
        fn loads_and_stores_match_the_byte_definition(
            buf in proptest::collection::vec(proptest::prelude::any::<u8>(), 16),
            start in 0usize..8,
            len in 1usize..=8,
            shift_frac in 0u32..64,
            width_frac in 1u32..=64,
            value in proptest::prelude::any::<u64>(),
        ) {
            let bits = 8 * len as u32;
            let width = 1 + (width_frac - 1) % bits;
            let shift = shift_frac % (bits - width + 1);
            let f = Bits::new(start, len, shift, width);
            proptest::prop_assert_eq!(f.get(&buf), reference_get(&f, &buf));
            let (mut a, mut b) = (buf.clone(), buf.clone());
            f.set(&mut a, value);
            reference_set(&f, &mut b, value);
            proptest::prop_assert_eq!(a, b);
        }
    }

    #[test]
    fn whole_u64() {
        let mut buf = [0u8; 10];
        let f = Bits::bytes(2, 8);
        f.set(&mut buf, 0x0102_0304_0506_0708);
        assert_eq!(&buf[2..10], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(f.get(&buf), 0x0102_0304_0506_0708);
    }
}

//! Host-unique comm IDs (`pv_cm_id`) and transaction IDs.
//!
//! A `pv_cm_id` encodes the slot of its entry in the mux's table plus that slot's
//! generation, passed through a keyed bijection of the 32-bit space. So:
//! - the wire-side lookup is an array index, not a hash probe;
//! - IDs look random on the wire (like the Linux CM's random operand) and are spread
//!   over all 32 bits, yet two live or quarantined entries can never share one
//!   (a slot is not reused while its ID is quarantined, and its generation changes on
//!   every reuse);
//! - slots are reused first-freed-first (a FIFO free list), so ID reuse is cyclic.

/// A keyed bijection on `u32` (xor-multiply-xorshift rounds; every step is invertible).
#[derive(Debug, Clone, Copy)]
pub struct IdPermutation {
    k1: u32,
    k2: u32,
    m1: u32,
    m1_inv: u32,
    m2: u32,
    m2_inv: u32,
}

/// Multiplicative inverse of an odd `a` modulo 2^32 (Newton's iteration).
fn inverse_odd(a: u32) -> u32 {
    let mut x = a; // correct to 3 bits for odd a
    for _ in 0..5 {
        x = x.wrapping_mul(2u32.wrapping_sub(a.wrapping_mul(x)));
    }
    x
}

fn unxorshift(mut y: u32, s: u32) -> u32 {
    // Inverse of y = x ^ (x >> s).
    let mut x = y;
    loop {
        y >>= s;
        if y == 0 {
            return x;
        }
        x ^= y;
    }
}

impl IdPermutation {
    /// A permutation keyed by `seed`.
    pub fn new(seed: u64) -> IdPermutation {
        let mix = |x: u64| {
            // splitmix64 finalizer
            let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let a = mix(seed);
        let b = mix(a);
        let m1 = (b as u32) | 1;
        let m2 = ((b >> 32) as u32) | 1;
        IdPermutation {
            k1: a as u32,
            k2: (a >> 32) as u32,
            m1,
            m1_inv: inverse_odd(m1),
            m2,
            m2_inv: inverse_odd(m2),
        }
    }

    /// Forward map.
    pub fn apply(&self, x: u32) -> u32 {
        let mut x = x ^ self.k1;
        x = x.wrapping_mul(self.m1);
        x ^= x >> 16;
        x = x.wrapping_mul(self.m2);
        x ^= x >> 13;
        x ^ self.k2
    }

    /// Inverse map: `invert(apply(x)) == x`.
    pub fn invert(&self, y: u32) -> u32 {
        let mut x = y ^ self.k2;
        x = unxorshift(x, 13);
        x = x.wrapping_mul(self.m2_inv);
        x = unxorshift(x, 16);
        x = x.wrapping_mul(self.m1_inv);
        x ^ self.k1
    }
}

/// A keyed bijection on the low `bits` bits (1..=32) of `x` (the rest ignored): odd
/// multiplications and right xorshifts, each invertible modulo 2^bits. Gives a VM's
/// range IDs ([`super::IdRange`]) a random look while a counter walks the range.
pub fn permute_bits(x: u32, bits: u32, key: u32) -> u32 {
    let bits = bits.clamp(1, 32);
    let mask = (((1u64 << bits) - 1) & u64::from(u32::MAX)) as u32;
    let mut x = (x ^ key) & mask;
    x = x.wrapping_mul(0x9E37_79B1) & mask;
    x ^= x >> (bits / 2).max(1);
    x = x.wrapping_mul(0x85EB_CA6B) & mask;
    x ^= x >> (bits / 3).max(1);
    x ^ (key.rotate_right(11) & mask)
}

/// Which transaction a host TID belongs to; replies echo it, so the kind tells the mux
/// which of the VM's TIDs to restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum TidKind {
    /// REQ (answered by REP, MRA(REQ), REJ).
    Req = 0,
    /// DREQ (answered by DREP).
    Dreq = 1,
    /// LAP (answered by APR, MRA(OTHER)).
    Lap = 2,
    /// SIDR_REQ (answered by SIDR_REP).
    Sidr = 3,
}

/// Host TIDs: `(hi ^ kind) << 32 | pv_cm_id`, as Linux forms `hi_tid << 32 | local id`.
#[derive(Debug, Clone, Copy)]
pub struct TidSpace {
    hi: u32,
}

impl TidSpace {
    /// A TID space whose upper half is derived from `seed` (low 2 bits free for the kind).
    pub fn new(seed: u32) -> TidSpace {
        TidSpace { hi: seed & !3 }
    }

    /// The host TID for a transaction of `kind` on `pv_cm_id`.
    pub fn tid(&self, kind: TidKind, pv_cm_id: u32) -> u64 {
        (u64::from(self.hi | kind as u32) << 32) | u64::from(pv_cm_id)
    }

    /// A host TID for a ClassPortInfo Get: the top bit flipped keeps it apart from the
    /// per-connection TIDs.
    pub fn get_tid(&self, n: u32) -> u64 {
        (u64::from(self.hi ^ 0x8000_0000) << 32) | u64::from(n)
    }

    /// The kind of a TID this host issued for `pv_cm_id`, or `None` if it is not one.
    pub fn kind_of(&self, tid: u64, pv_cm_id: u32) -> Option<TidKind> {
        if tid as u32 != pv_cm_id || ((tid >> 32) as u32) & !3 != self.hi {
            return None;
        }
        Some(match (tid >> 32) as u32 & 3 {
            0 => TidKind::Req,
            1 => TidKind::Dreq,
            2 => TidKind::Lap,
            _ => TidKind::Sidr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_a_bijection() {
        for seed in [0u64, 1, 0xDEAD_BEEF, u64::MAX] {
            let p = IdPermutation::new(seed);
            for x in (0..2_000_000u32).chain([u32::MAX, u32::MAX - 1]) {
                assert_eq!(p.invert(p.apply(x)), x);
            }
        }
    }

    #[test]
    fn permutation_spreads_sequential_slots() {
        let p = IdPermutation::new(42);
        let ids: Vec<u32> = (0..1000).map(|x| p.apply(x)).collect();
        // Sequential inputs must not give sequential outputs.
        let sequential = ids
            .windows(2)
            .filter(|w| w[1] == w[0].wrapping_add(1))
            .count();
        assert!(sequential < 5, "{sequential}");
        // And the high byte takes many values.
        let mut hi: Vec<u8> = ids.iter().map(|x| (x >> 24) as u8).collect();
        hi.sort_unstable();
        hi.dedup();
        assert!(hi.len() > 200, "{}", hi.len());
    }

    #[test]
    fn permute_bits_is_a_bijection_of_every_width() {
        for bits in [1u32, 2, 3, 8, 12, 16] {
            for key in [0u32, 0xDEAD_BEEF] {
                let n = 1usize << bits;
                let mut seen = vec![false; n];
                for x in 0..n as u32 {
                    let y = permute_bits(x, bits, key) as usize;
                    assert!(y < n && !seen[y], "bits {bits} key {key:#x} x {x}");
                    seen[y] = true;
                }
            }
        }
    }

    #[test]
    fn tids_round_trip() {
        let t = TidSpace::new(0x1234_5678);
        for k in [TidKind::Req, TidKind::Dreq, TidKind::Lap, TidKind::Sidr] {
            let tid = t.tid(k, 0xCAFE);
            assert_eq!(t.kind_of(tid, 0xCAFE), Some(k));
            assert_eq!(t.kind_of(tid, 0xCAFF), None);
        }
        assert_eq!(t.kind_of(0x9999_0000_0000_CAFE, 0xCAFE), None);
    }
}

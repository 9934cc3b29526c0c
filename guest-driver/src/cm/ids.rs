//! Identifier allocation: comm IDs the Linux way (a cyclic index XORed with a random
//! operand), simulated QPNs from the port's range, and the small seeded PRNG both use.

use super::{FastMap, FastSet};

/// SplitMix64: a tiny, seedable, statistically sound PRNG (no I/O, reproducible).
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The next 32 random bits.
    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// A value in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }
}

/// Local comm IDs, allocated like Linux's `cm_alloc_id_priv()`: an index from a cyclic
/// allocator (`xa_alloc_cyclic`, which resumes after the last index it handed out)
/// XORed with a random operand chosen once. 0 is never issued, and an ID is not issued
/// again while it is held (a live connection, or one in TimeWait): the caller releases
/// it when the connection's TimeWait ends or it is reset to idle.
#[derive(Debug, Clone)]
pub struct CommIds {
    next: u32,
    operand: u32,
    /// Held IDs and the slot of the connection holding each.
    held: FastMap<u32, u32>,
}

impl CommIds {
    /// An allocator with this random operand.
    pub fn new(operand: u32) -> CommIds {
        CommIds {
            next: 0,
            operand,
            held: FastMap::default(),
        }
    }

    /// Allocates an ID for `slot`; `None` only if all 2^32 - 1 IDs are held.
    pub fn alloc(&mut self, slot: u32) -> Option<u32> {
        if self.held.len() >= u32::MAX as usize {
            return None;
        }
        loop {
            let idx = self.next;
            self.next = self.next.wrapping_add(1);
            let id = idx ^ self.operand;
            if id != 0 && !self.held.contains_key(&id) {
                self.held.insert(id, slot);
                return Some(id);
            }
        }
    }

    /// Makes room for `n` more held IDs.
    pub fn reserve(&mut self, n: usize) {
        self.held.reserve(n);
    }

    /// Releases a held ID.
    pub fn release(&mut self, id: u32) {
        self.held.remove(&id);
    }

    /// The slot holding `id`.
    pub fn get(&self, id: u32) -> Option<u32> {
        self.held.get(&id).copied()
    }

    /// IDs held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// True if no ID is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }
}

/// QPNs for simulated QPs (cmtime's no-QP mode), handed out cyclically from the port's
/// range `[base, base + count)` so a QPN is not reused sooner than necessary.
#[derive(Debug, Clone)]
pub struct QpnPool {
    base: u32,
    count: u32,
    next: u32,
    used: FastSet<u32>,
}

impl QpnPool {
    /// A pool over `[base, base + count)` (clamped to 24-bit QPNs).
    pub fn new(base: u32, count: u32) -> QpnPool {
        let base = base & 0x00FF_FFFF;
        let count = count.min(0x0100_0000 - base);
        QpnPool {
            base,
            count,
            next: 0,
            used: FastSet::default(),
        }
    }

    /// Makes room for `n` more QPNs in use.
    pub fn reserve(&mut self, n: usize) {
        self.used.reserve(n.min(self.count as usize));
    }

    /// True if `qpn` lies in the port's range.
    pub fn owns(&self, qpn: u32) -> bool {
        qpn >= self.base && qpn - self.base < self.count
    }

    /// A free QPN, or `None` if the whole range is in use.
    pub fn alloc(&mut self) -> Option<u32> {
        if self.used.len() >= self.count as usize {
            return None;
        }
        loop {
            let qpn = self.base + self.next;
            self.next = (self.next + 1) % self.count;
            if self.used.insert(qpn) {
                return Some(qpn);
            }
        }
    }

    /// Returns a QPN to the pool.
    pub fn release(&mut self, qpn: u32) {
        self.used.remove(&qpn);
    }

    /// QPNs in use.
    pub fn in_use(&self) -> usize {
        self.used.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_ids_are_cyclic_xored_and_never_zero() {
        let mut ids = CommIds::new(2);
        // Index 2 ^ 2 == 0 is skipped.
        let got: Vec<u32> = (0..4).map(|s| ids.alloc(s).unwrap()).collect();
        assert_eq!(got, vec![2, 3, 1, 6]);
        ids.release(3);
        // Cyclic: a released ID is not reused before the counter wraps.
        assert_eq!(ids.alloc(9).unwrap(), 7);
        assert_eq!(ids.get(7), Some(9));
        assert_eq!(ids.get(3), None);
        assert_eq!(ids.len(), 4);
    }

    #[test]
    fn comm_ids_skip_held_ids_after_wrap() {
        let mut ids = CommIds::new(0);
        ids.next = u32::MAX;
        assert_eq!(ids.alloc(0), Some(u32::MAX));
        // 0 is skipped, 1 follows.
        assert_eq!(ids.alloc(1), Some(1));
        ids.next = u32::MAX;
        // MAX is held, 0 is never issued, 1 is held: 2.
        assert_eq!(ids.alloc(2), Some(2));
    }

    #[test]
    fn qpn_pool_cycles_and_exhausts() {
        let mut p = QpnPool::new(100, 3);
        assert!(p.owns(100) && p.owns(102) && !p.owns(103) && !p.owns(99));
        assert_eq!(p.alloc(), Some(100));
        assert_eq!(p.alloc(), Some(101));
        p.release(100);
        assert_eq!(p.alloc(), Some(102));
        assert_eq!(p.alloc(), Some(100));
        assert_eq!(p.alloc(), None);
        assert_eq!(p.in_use(), 3);
        let mut empty = QpnPool::new(5, 0);
        assert_eq!(empty.alloc(), None);
    }

    #[test]
    fn splitmix_is_reproducible() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        for _ in 0..10 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        assert!(a.below(10) < 10);
        assert_eq!(a.below(0), 0);
    }
}

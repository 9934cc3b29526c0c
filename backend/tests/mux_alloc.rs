//! The mux's per-MAD paths do not allocate once an entry exists: a counting global
//! allocator watches 20 000 MADs of established connections go through in both
//! directions, plus DREQ/DREP teardown of half of them.
#![allow(clippy::unwrap_used)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use pvcm_backend::mux::{Policy, WireVerdict};
use pvcm_wire::mad::AttributeId;

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn established_traffic_does_not_allocate() {
    let mut n = Net::new(Policy::Default);
    n.a.add_vm("a0", gid(1, 1));
    n.b.add_vm("b0", gid(2, 1));
    let conns: Vec<Conn> = (0..1000)
        .map(|i| n.connect(0, 0, i + 1, i + 1, i))
        .collect();
    let mut bufs: Vec<Mad> = vec![[0; 256]; 4];
    let before = ALLOCS.load(Ordering::Relaxed);
    for round in 0..10 {
        for c in &conns {
            // LAP out of A, into B; APR back.
            bufs[0] = ids(AttributeId::Lap, round, c.a_sl, c.b_pv);
            let v = n.a_to_b(0, 0, &mut bufs[0]);
            assert_eq!(v.1, Some(WireVerdict::ToVm(n.b.id(0))));
            bufs[1] = ids(AttributeId::Apr, 1, c.b_sl, c.a_pv);
            let v = n.b_to_a(0, 0, &mut bufs[1]);
            assert_eq!(v.1, Some(WireVerdict::ToVm(n.a.id(0))));
        }
    }
    for c in conns.iter().step_by(2) {
        n.disconnect_from_a(c);
    }
    let after = ALLOCS.load(Ordering::Relaxed);
    assert_eq!(after - before, 0, "allocations on the per-MAD path");
}

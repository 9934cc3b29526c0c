//! The driver-side virtqueue (`pvcm_guest::virtq`) against a real device-side
//! implementation: `virtio_queue::Queue` over `vm_memory::GuestMemoryMmap`, whose
//! memory the driver allocates from (device address = guest physical address).
//!
//! - `sim_*`: a single-threaded simulation that interleaves driver and device steps at
//!   random (seeded) and checks payloads in both directions, FIFO completion, and that
//!   notification suppression in both directions is exactly what the virtio rules say
//!   (a kick iff the device sleeps, an interrupt iff the driver sleeps; never a lost
//!   wakeup), for queue sizes 1..1024, with and without EVENT_IDX and indirect
//!   descriptors, chains of 1..4 buffers, indexes wrapping many times.
//! - `prop_*`: the same simulation driven by proptest-generated interleavings.
//! - `threaded_echo_*`: a device thread echoing tx messages into rx buffers through two
//!   `MsgQueue`s, with condvar "eventfds" for kicks and interrupts: real concurrency,
//!   real memory ordering, the disable -> process -> enable loops of both sides.

// Tests may unwrap (clippy.toml allows it in #[test] fns; helpers here too).
#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use pvcm_guest::virtq::{
    DmaMemory, DmaRegion, LinearDma, MsgQueue, Notify, Segment, Used, VIRTQ_AVAIL_F_NO_INTERRUPT,
    VIRTQ_DESC_F_INDIRECT, Virtq, VirtqConfig, VirtqError, features, need_event,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

const GPA_BASE: u64 = 0x10_0000;
const SEG: usize = 64;

type Mem = GuestMemoryMmap<()>;

/// Guest memory and a DMA allocator over all of it.
fn guest(len: usize) -> (Arc<Mem>, LinearDma) {
    let mem = Arc::new(Mem::from_ranges(&[(GuestAddress(GPA_BASE), len)]).unwrap());
    let host = mem.get_host_address(GuestAddress(GPA_BASE)).unwrap();
    let keep: Arc<Mem> = mem.clone();
    // SAFETY: the region is `len` bytes of a mapping kept alive by `keep`; the device
    // side (virtio-queue) sees it at GPA_BASE; nothing else on the driver side uses it.
    let dma = unsafe { LinearDma::new(NonNull::new(host).unwrap(), GPA_BASE, len, Some(keep)) };
    (mem, dma)
}

/// The device side of one queue, set up from the driver's addresses.
fn device_queue(mem: &Mem, vq: &Virtq) -> Queue {
    let mut q = Queue::new(vq.size()).unwrap();
    q.try_set_desc_table_address(GuestAddress(vq.desc_table_addr()))
        .unwrap();
    q.try_set_avail_ring_address(GuestAddress(vq.avail_ring_addr()))
        .unwrap();
    q.try_set_used_ring_address(GuestAddress(vq.used_ring_addr()))
        .unwrap();
    q.set_event_idx(vq.event_idx());
    q.set_ready(true);
    assert!(q.is_valid(mem));
    q
}

/// Reads the avail ring's flags (virtio-queue ignores NO_INTERRUPT; the test checks it).
fn avail_flags(mem: &Mem, vq: &Virtq) -> u16 {
    u16::from_le(
        mem.load(GuestAddress(vq.avail_ring_addr()), Ordering::Acquire)
            .unwrap(),
    )
}

fn pattern(seq: u64, seg: usize, i: usize) -> u8 {
    (seq.wrapping_mul(31) as usize + seg * 7 + i) as u8
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone)]
struct Msg {
    seq: u64,
    token: u16,
    out: Vec<u32>,
    inp: Vec<u32>,
    /// Bytes the device wrote (set when the device completes it).
    written: Option<u32>,
}

/// Device state for the notification oracle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dev {
    /// Notifications enabled, everything consumed: waits for a kick.
    Sleeping,
    /// Processing; `armed`: the last notification call was an enable (kicks possible).
    Running { armed: bool },
}

/// Driver state for reaping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Drv {
    Sleeping,
    Awake { armed: bool },
}

/// One driver queue and its device, single-threaded, with oracles.
struct Sim {
    mem: Arc<Mem>,
    vq: Virtq,
    dq: Queue,
    /// Scratch buffers: per token 4 segments of SEG bytes.
    bufs: DmaRegion,
    free_tokens: Vec<u16>,
    /// Added, in avail order, not yet consumed by the device.
    to_device: VecDeque<Msg>,
    /// Consumed by the device, in used order, not yet popped by the driver.
    to_driver: VecDeque<Msg>,
    max_chain: usize,
    dev: Dev,
    drv: Drv,
    seq: u64,
    done: u64,
    kicks: u64,
    interrupts: u64,
    published_batches: u64,
}

impl Sim {
    fn new(size: u16, event_idx: bool, max_indirect: u16) -> Sim {
        let (mem, dma) = guest(8 << 20);
        let cfg = VirtqConfig::new(0, size)
            .with_event_idx(event_idx)
            .with_indirect(max_indirect);
        let vq = Virtq::new(&dma, cfg).unwrap();
        let bufs = dma.alloc(usize::from(size) * 4 * SEG, 64).unwrap();
        let dq = device_queue(&mem, &vq);
        Sim {
            mem,
            vq,
            dq,
            bufs,
            free_tokens: (0..size).rev().collect(),
            to_device: VecDeque::new(),
            to_driver: VecDeque::new(),
            max_chain: usize::from(size).min(4),
            dev: Dev::Sleeping,
            // used_event = 0 = last_used: armed for the first used element.
            drv: Drv::Sleeping,
            seq: 0,
            done: 0,
            kicks: 0,
            interrupts: 0,
            published_batches: 0,
        }
    }

    fn seg_addr(&self, token: u16, j: usize) -> u64 {
        self.bufs.dev_addr() + ((usize::from(token) * 4 + j) * SEG) as u64
    }
    fn seg_off(token: u16, j: usize) -> usize {
        (usize::from(token) * 4 + j) * SEG
    }

    /// Adds one chain of `n` buffers, `n_out` of them device-readable. False if full.
    fn add(&mut self, n: usize, n_out: usize, lens: &[u32]) -> bool {
        let n = n.clamp(1, self.max_chain);
        let n_out = n_out.min(n);
        let Some(&token) = self.free_tokens.last() else {
            return false;
        };
        let seq = self.seq;
        let mut out = Vec::new();
        let mut inp = Vec::new();
        for j in 0..n {
            let len = lens[j % lens.len()].clamp(1, SEG as u32);
            let seg = Segment::new(self.seg_addr(token, j), len);
            if j < n_out {
                let data: Vec<u8> = (0..len as usize).map(|i| pattern(seq, j, i)).collect();
                self.bufs.write_at(Self::seg_off(token, j), &data).unwrap();
                out.push(seg);
            } else {
                self.bufs
                    .write_at(Self::seg_off(token, j), &[0xEE; SEG][..len as usize])
                    .unwrap();
                inp.push(seg);
            }
        }
        let free_before = self.vq.num_free();
        match self.vq.add_chain(&out, &inp, token) {
            Ok(()) => {}
            Err(VirtqError::Full) => {
                let need = if n > 1 && n <= usize::from(self.vq.max_indirect()) {
                    1
                } else {
                    n
                };
                assert!(
                    usize::from(free_before) < need,
                    "Full with {free_before} free"
                );
                return false;
            }
            Err(e) => panic!("add_chain: {e}"),
        }
        let used_desc = free_before - self.vq.num_free();
        if n > 1 && n <= usize::from(self.vq.max_indirect()) {
            assert_eq!(used_desc, 1, "indirect chain takes one descriptor");
        } else {
            assert_eq!(usize::from(used_desc), n);
        }
        self.free_tokens.pop();
        self.seq += 1;
        self.to_device.push_back(Msg {
            seq,
            token,
            out: out.iter().map(|s| s.len).collect(),
            inp: inp.iter().map(|s| s.len).collect(),
            written: None,
        });
        true
    }

    fn publish(&mut self) {
        let pending = self.vq.unpublished();
        let expect = match self.dev {
            Dev::Sleeping => true,
            Dev::Running { armed } => !self.vq.event_idx() && armed,
        };
        let kick = self.vq.publish();
        if pending == 0 {
            assert!(!kick);
            return;
        }
        self.published_batches += 1;
        assert_eq!(kick, expect, "kick oracle, device {:?}", self.dev);
        if kick {
            self.kicks += 1;
            if self.dev == Dev::Sleeping {
                self.dev = Dev::Running { armed: true };
            }
        }
    }

    /// One device turn: disable, process up to `budget` chains, re-enable if empty;
    /// then interrupt the driver if the used-ring rules ask for it.
    fn device_step(&mut self, budget: usize, rng: &mut Rng) {
        let Dev::Running { .. } = self.dev else {
            return;
        };
        let mem = &*self.mem.clone();
        self.dq.disable_notification(mem).unwrap();
        self.dev = Dev::Running { armed: false };
        let mut added = 0;
        let mut emptied = false;
        for _ in 0..budget {
            let Some(chain) = self.dq.pop_descriptor_chain(mem) else {
                emptied = true;
                break;
            };
            let mut m = self
                .to_device
                .pop_front()
                .expect("device got a chain the driver did not publish");
            let head = chain.head_index();
            // Indirect chains show the INDIRECT flag on their head descriptor.
            let hd: Descriptor = mem
                .read_obj(GuestAddress(
                    self.vq.desc_table_addr() + u64::from(head) * 16,
                ))
                .unwrap();
            let n = m.out.len() + m.inp.len();
            let want_indirect = n > 1 && n <= usize::from(self.vq.max_indirect());
            assert_eq!(hd.flags() & VIRTQ_DESC_F_INDIRECT != 0, want_indirect);
            let descs: Vec<Descriptor> = chain.collect();
            assert_eq!(descs.len(), n, "chain length");
            let mut written = 0u32;
            let want: u32 = rng.below(u64::from(m.inp.iter().sum::<u32>()) + 1) as u32;
            for (j, d) in descs.iter().enumerate() {
                if j < m.out.len() {
                    assert!(!d.is_write_only());
                    assert_eq!(d.len(), m.out[j]);
                    let mut b = vec![0u8; d.len() as usize];
                    mem.read_slice(&mut b, d.addr()).unwrap();
                    for (i, v) in b.iter().enumerate() {
                        assert_eq!(*v, pattern(m.seq, j, i), "seq {} seg {j} byte {i}", m.seq);
                    }
                } else {
                    assert!(d.is_write_only());
                    assert_eq!(d.len(), m.inp[j - m.out.len()]);
                    let k = (want - written).min(d.len());
                    let b: Vec<u8> = (0..k as usize).map(|i| !pattern(m.seq, j, i)).collect();
                    mem.write_slice(&b, d.addr()).unwrap();
                    written += k;
                }
            }
            assert_eq!(written, want);
            m.written = Some(written);
            self.dq.add_used(mem, head, written).unwrap();
            self.to_driver.push_back(m);
            added += 1;
        }
        if emptied {
            if self.dq.enable_notification(mem).unwrap() {
                self.dev = Dev::Running { armed: true };
            } else {
                assert_eq!(
                    self.to_device.len(),
                    usize::from(self.vq.unpublished()),
                    "device sleeps with published chains pending"
                );
                self.dev = Dev::Sleeping;
            }
        }
        if added > 0 {
            let expect = match self.drv {
                Drv::Sleeping => true,
                Drv::Awake { armed } => !self.vq.event_idx() && armed,
            };
            let irq = if self.vq.event_idx() {
                self.dq.needs_notification(mem).unwrap()
            } else {
                avail_flags(mem, &self.vq) & VIRTQ_AVAIL_F_NO_INTERRUPT == 0
            };
            assert_eq!(irq, expect, "interrupt oracle, driver {:?}", self.drv);
            if irq {
                self.interrupts += 1;
                if self.drv == Drv::Sleeping {
                    self.drv = Drv::Awake { armed: true };
                }
            }
        }
    }

    /// One driver reaping turn.
    fn reap(&mut self, budget: usize) {
        let Drv::Awake { .. } = self.drv else {
            return;
        };
        self.vq.disable_notifications();
        self.drv = Drv::Awake { armed: false };
        for _ in 0..budget {
            match self.vq.pop_used().unwrap() {
                Some(u) => self.check_used(u),
                None => {
                    if self.vq.enable_notifications() {
                        self.drv = Drv::Awake { armed: true };
                    } else {
                        assert!(self.to_driver.is_empty(), "driver sleeps with used pending");
                        self.drv = Drv::Sleeping;
                    }
                    return;
                }
            }
        }
    }

    fn check_used(&mut self, u: Used) {
        let m = self
            .to_driver
            .pop_front()
            .expect("used without a completion");
        assert_eq!(u.token, m.token, "FIFO completion");
        let written = m.written.unwrap_or(0);
        assert_eq!(u.len, written);
        let mut left = written as usize;
        for (k, &len) in m.inp.iter().enumerate() {
            let j = m.out.len() + k;
            let mut b = vec![0u8; len as usize];
            self.bufs
                .read_at(Self::seg_off(m.token, j), &mut b)
                .unwrap();
            for (i, v) in b.iter().enumerate() {
                let want = if i < left {
                    !pattern(m.seq, j, i)
                } else {
                    0xEE
                };
                assert_eq!(*v, want, "rx seq {} seg {j} byte {i}", m.seq);
            }
            left = left.saturating_sub(len as usize);
        }
        self.free_tokens.push(m.token);
        self.done += 1;
    }

    /// Runs everything left to completion (publish, device, reap) and checks the
    /// queue is empty and idle.
    fn drain(&mut self, rng: &mut Rng) {
        let mut guard = 0;
        while self.done < self.seq {
            self.publish();
            self.device_step(usize::MAX, rng);
            self.reap(usize::MAX);
            if self.drv == Drv::Sleeping && self.dev == Dev::Sleeping && self.done < self.seq {
                panic!(
                    "both sides asleep with {} outstanding",
                    self.seq - self.done
                );
            }
            guard += 1;
            assert!(guard < 10, "drain does not converge");
        }
        assert_eq!(self.vq.num_free(), self.vq.size());
        assert_eq!(self.vq.in_flight(), 0);
    }
}

/// Random interleaving of everything; `total` messages.
fn run_sim(size: u16, event_idx: bool, max_indirect: u16, total: u64, seed: u64) -> Sim {
    let mut s = Sim::new(size, event_idx, max_indirect);
    let mut rng = Rng(seed | 1);
    let mut ticks = 0u64;
    while s.done < total {
        ticks += 1;
        assert!(ticks < total * 50 + 1000, "no progress");
        // Driver adds a batch (bounded by what is left and what fits).
        let batch = rng.below(9);
        for _ in 0..batch {
            if s.seq >= total {
                break;
            }
            let n = 1 + rng.below(4) as usize;
            let n_out = rng.below(n as u64 + 1) as usize;
            let lens = [
                1 + rng.below(SEG as u64) as u32,
                1 + rng.below(SEG as u64) as u32,
                1 + rng.below(SEG as u64) as u32,
                1 + rng.below(SEG as u64) as u32,
            ];
            if !s.add(n, n_out, &lens) {
                break;
            }
        }
        if rng.below(4) != 0 || s.seq >= total {
            s.publish();
        }
        // Device and driver turns in random order with random budgets.
        if rng.below(2) == 0 {
            let b = 1 + rng.below(u64::from(size) + 2) as usize;
            s.device_step(b, &mut rng);
            let b = 1 + rng.below(u64::from(size) + 2) as usize;
            s.reap(b);
        } else {
            let b = 1 + rng.below(u64::from(size) + 2) as usize;
            s.reap(b);
            let b = 1 + rng.below(u64::from(size) + 2) as usize;
            s.device_step(b, &mut rng);
        }
        if s.drv == Drv::Sleeping
            && s.dev == Dev::Sleeping
            && s.vq.unpublished() == 0
            && s.done < s.seq
        {
            panic!(
                "lost wakeup: both asleep with {} outstanding",
                s.seq - s.done
            );
        }
    }
    s.drain(&mut rng);
    s
}

fn indirect_for(size: u16) -> u16 {
    match size {
        1 => 0,
        2 => 2,
        _ => 4,
    }
}

#[test]
fn sim_all_sizes_both_modes() {
    let mut size = 1u16;
    while size <= 1024 {
        for event_idx in [false, true] {
            for indirect in [0, indirect_for(size)] {
                // Enough that ring positions wrap many times at every size.
                let total = (20 * u64::from(size)).max(5000);
                let s = run_sim(
                    size,
                    event_idx,
                    indirect,
                    total,
                    0x9E37_79B9 + u64::from(size),
                );
                assert_eq!(s.done, total);
                let st = s.vq.stats();
                assert_eq!(st.added, total);
                assert_eq!(st.used, total);
                assert_eq!(st.published, s.published_batches);
                assert_eq!(st.notify, s.kicks);
                assert!(s.kicks <= st.published);
            }
        }
        size *= 2;
    }
}

#[test]
fn sim_16bit_index_wraps() {
    // > 65536 chains: the 16-bit available and used indexes wrap several times.
    for (size, event_idx, indirect) in [
        (1u16, true, 0u16),
        (2, false, 2),
        (8, true, 4),
        (256, true, 0),
        (1024, false, 4),
    ] {
        let total = 140_000;
        let s = run_sim(size, event_idx, indirect, total, 7 + u64::from(size));
        assert_eq!(s.done, total);
        assert!(s.vq.stats().added > 2 * 65536);
        // Suppression works: far fewer kicks than messages once batches build up.
        if size >= 8 {
            assert!(
                s.kicks < total / 2,
                "size {size} event_idx {event_idx}: {} kicks for {total}",
                s.kicks
            );
        }
    }
}

#[test]
fn batching_one_publish_one_kick() {
    for event_idx in [false, true] {
        let mut s = Sim::new(64, event_idx, 0);
        for _ in 0..32 {
            assert!(s.add(1, 1, &[16]));
        }
        assert_eq!(s.vq.unpublished(), 32);
        // Nothing visible before the publish.
        assert_eq!(
            s.dq.avail_idx(&*s.mem, Ordering::Acquire).unwrap().0,
            0,
            "avail idx moved before publish"
        );
        s.publish();
        assert_eq!(s.kicks, 1);
        assert_eq!(s.dq.avail_idx(&*s.mem, Ordering::Acquire).unwrap().0, 32);
        // While the device runs (notifications disabled) more batches need no kick.
        let mut rng = Rng(5);
        s.device_step(10, &mut rng);
        for _ in 0..8 {
            assert!(s.add(1, 0, &[8]));
        }
        s.publish();
        assert_eq!(s.kicks, 1, "no kick while the device is running");
        s.drain(&mut rng);
        // Device asleep again: the next publish kicks.
        assert!(s.add(2, 1, &[8]));
        s.publish();
        assert_eq!(s.kicks, 2);
        s.drain(&mut rng);
        assert_eq!(s.vq.stats().notify, 2);
    }
}

#[test]
fn event_idx_formula() {
    // need_event(event, new, old): notify iff event in [old, new).
    assert!(need_event(0, 1, 0));
    assert!(!need_event(1, 1, 0));
    assert!(need_event(5, 8, 3));
    assert!(!need_event(8, 8, 3));
    assert!(need_event(65535, 2, 65534));
    assert!(need_event(0, 2, 65534));
    assert!(!need_event(2, 2, 65534));
    assert!(!need_event(65533, 2, 65534));
}

#[test]
fn driver_sleep_gets_interrupt_device_side_view() {
    // EVENT_IDX: disabled driver -> no interrupt; enabled + empty -> interrupt on the
    // next used element (checked through virtio-queue's needs_notification).
    let mut s = Sim::new(16, true, 0);
    let mem = s.mem.clone();
    s.vq.disable_notifications();
    for _ in 0..4 {
        assert!(s.add(1, 0, &[4]));
    }
    assert!(s.vq.publish());
    for _ in 0..4 {
        let c = s.dq.pop_descriptor_chain(&*mem).unwrap();
        s.dq.add_used(&*mem, c.head_index(), 0).unwrap();
    }
    assert!(!s.dq.needs_notification(&*mem).unwrap());
    // Driver re-enables without popping: more already arrived.
    assert!(s.vq.enable_notifications());
    for _ in 0..4 {
        assert!(s.vq.pop_used().unwrap().is_some());
    }
    assert!(!s.vq.enable_notifications());
    assert!(s.add(1, 0, &[4]));
    s.vq.publish();
    let c = s.dq.pop_descriptor_chain(&*mem).unwrap();
    s.dq.add_used(&*mem, c.head_index(), 0).unwrap();
    assert!(s.dq.needs_notification(&*mem).unwrap());
}

#[test]
fn enabled_driver_is_rearmed_by_each_pop() {
    // A driver that keeps notifications on while it pops: each pop moves used_event, so
    // each later used element is signalled (EVENT_IDX).
    let mut s = Sim::new(16, true, 0);
    let mem = s.mem.clone();
    for _ in 0..3 {
        assert!(s.add(1, 0, &[4]));
    }
    assert!(s.vq.publish());
    let heads: Vec<u16> = (0..3)
        .map(|_| s.dq.pop_descriptor_chain(&*mem).unwrap().head_index())
        .collect();
    for h in heads {
        s.dq.add_used(&*mem, h, 0).unwrap();
        assert!(s.dq.needs_notification(&*mem).unwrap());
        assert!(s.vq.pop_used().unwrap().is_some());
    }
    assert!(!s.vq.enable_notifications());
}

#[test]
fn errors_and_limits() {
    let (_mem, dma) = guest(4 << 20);
    for bad in [0u16, 3, 2048, 1025] {
        assert!(matches!(
            Virtq::new(&dma, VirtqConfig::new(0, bad)),
            Err(VirtqError::BadSize(_))
        ));
    }
    assert!(matches!(
        Virtq::new(&dma, VirtqConfig::new(0, 4).with_indirect(8)),
        Err(VirtqError::BadIndirect { .. })
    ));
    let mut vq = Virtq::new(&dma, VirtqConfig::new(0, 4)).unwrap();
    let seg = Segment::new(GPA_BASE, 8);
    assert!(matches!(
        vq.add_chain(&[], &[], 0),
        Err(VirtqError::EmptyChain)
    ));
    assert!(matches!(
        vq.add_out(&[seg; 5], 0),
        Err(VirtqError::ChainTooLong { .. })
    ));
    assert!(matches!(
        vq.add_out(&[Segment::new(0, u32::MAX), seg], 0),
        Err(VirtqError::ChainTooLong { .. })
    ));
    vq.add_out(&[seg; 3], 1).unwrap();
    assert!(matches!(vq.add_out(&[seg; 2], 2), Err(VirtqError::Full)));
    vq.add_out(&[seg], 3).unwrap();
    assert_eq!(vq.num_free(), 0);
    assert!(vq.pop_used().unwrap().is_none());
    // Features pick the queue options.
    let c = VirtqConfig::new(1, 64).with_features(features::PVCM);
    assert!(c.event_idx);
    assert_eq!(c.max_indirect, VirtqConfig::DEFAULT_MAX_INDIRECT);
    // A one-descriptor queue cannot use indirect tables.
    let c = VirtqConfig::new(1, 1).with_features(features::PVCM);
    assert_eq!(c.max_indirect, 0);
    assert!(Virtq::new(&dma, c).is_ok());
    assert!(Virtq::new(&dma, VirtqConfig::new(0, 8).with_indirect(1)).is_ok());
    let c = VirtqConfig::new(1, 4).with_features(features::VERSION_1);
    assert!(!c.event_idx);
    assert_eq!(c.max_indirect, 0);
    assert_eq!(
        features::EVENT_IDX,
        1u64 << virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX
    );
    assert_eq!(
        features::INDIRECT_DESC,
        1u64 << virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC
    );
    assert_eq!(
        features::VERSION_1,
        1u64 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1
    );
}

#[test]
fn broken_device_is_detected() {
    let (mem, dma) = guest(4 << 20);
    let mut vq = Virtq::new(&dma, VirtqConfig::new(0, 8)).unwrap();
    let mut dq = device_queue(&mem, &vq);
    vq.add_out(&[Segment::new(GPA_BASE, 8)], 42).unwrap();
    vq.publish();
    let c = dq.pop_descriptor_chain(&*mem).unwrap();
    assert_eq!(c.head_index(), 0);
    // The device returns a head that is not outstanding.
    dq.add_used(&*mem, 5, 0).unwrap();
    assert!(matches!(vq.pop_used(), Err(VirtqError::BadUsed { id: 5 })));
    assert!(vq.is_broken());
    assert!(matches!(vq.pop_used(), Err(VirtqError::Broken)));
    vq.reset();
    assert!(!vq.is_broken());
    assert_eq!(vq.num_free(), 8);

    // A used index that runs ahead of what was given.
    let mut vq = Virtq::new(&dma, VirtqConfig::new(0, 8)).unwrap();
    let mut dq = device_queue(&mem, &vq);
    vq.add_out(&[Segment::new(GPA_BASE, 8)], 1).unwrap();
    vq.publish();
    dq.add_used(&*mem, 0, 0).unwrap();
    dq.add_used(&*mem, 0, 0).unwrap();
    assert!(matches!(
        vq.pop_used(),
        Err(VirtqError::UsedIdxRunaway { .. })
    ));

    // An over-long used length is clamped to the chain's writable bytes.
    let mut vq = Virtq::new(&dma, VirtqConfig::new(0, 8)).unwrap();
    let mut dq = device_queue(&mem, &vq);
    vq.add_in(&[Segment::new(GPA_BASE, 8)], 9).unwrap();
    vq.publish();
    let c = dq.pop_descriptor_chain(&*mem).unwrap();
    dq.add_used(&*mem, c.head_index(), 4096).unwrap();
    assert_eq!(vq.pop_used().unwrap(), Some(Used { token: 9, len: 8 }));
    assert_eq!(vq.stats().len_clamped, 1);
}

#[test]
fn msg_queue_slots_and_ownership() {
    use pvcm_guest::virtq::SlotState;
    use pvcm_wire::abi::RX_BUFFER_LEN;
    let (mem, dma) = guest(4 << 20);
    let mut q = MsgQueue::new(&dma, VirtqConfig::new(1, 4), RX_BUFFER_LEN).unwrap();
    let mut dq = device_queue(&mem, q.virtq());
    assert_eq!(q.pool().count(), 4);
    assert_eq!(q.post_all().unwrap(), 4);
    assert!(q.alloc().is_none());
    assert!(q.buf(0).is_err(), "posted slots are not accessible");
    assert!(q.kick(&NoNotify));
    // The device fills two of them.
    for k in 0..2u8 {
        let c = dq.pop_descriptor_chain(&*mem).unwrap();
        let d: Vec<Descriptor> = c.clone().collect();
        assert_eq!(d.len(), 1);
        assert!(d[0].is_write_only());
        assert_eq!(d[0].len() as usize, RX_BUFFER_LEN);
        mem.write_slice(&[k + 1; 10], d[0].addr()).unwrap();
        dq.add_used(&*mem, c.head_index(), 10).unwrap();
    }
    let u = q.pop_used().unwrap().unwrap();
    assert_eq!(q.pool().state(u.token), Some(SlotState::Owned));
    assert_eq!(&q.buf(u.token).unwrap()[..u.len as usize], &[1u8; 10]);
    q.post(u.token).unwrap();
    let u = q.pop_used().unwrap().unwrap();
    assert_eq!(&q.buf(u.token).unwrap()[..u.len as usize], &[2u8; 10]);
    q.free(u.token).unwrap();
    assert!(q.free(u.token).is_err());
    let s = q.alloc().unwrap();
    assert!(matches!(
        q.send(s, RX_BUFFER_LEN + 1),
        Err(VirtqError::BadLen { .. })
    ));
    assert!(matches!(q.send(s, 0), Err(VirtqError::BadLen { .. })));
    q.buf_mut(s).unwrap()[..3].copy_from_slice(b"abc");
    q.send(s, 3).unwrap();
    // The queue is now full (4 descriptors: 3 posted + 1 sent).
    assert_eq!(q.virtq().num_free(), 0);
    q.publish();
    // Reset: posted slots come back free.
    q.reset();
    assert_eq!(q.pool().num_free(), 4);
    assert_eq!(q.virtq().num_free(), 4);
}

struct NoNotify;
impl Notify for NoNotify {
    fn notify(&self, _queue: u16) {}
}

// ---------- proptest: random interleavings ----------

#[derive(Debug, Clone)]
enum Op {
    Add { n: usize, n_out: usize, len: u32 },
    Publish,
    Device(usize),
    Reap(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1usize..=4, 0usize..=4, 1u32..=SEG as u32).prop_map(|(n, n_out, len)| Op::Add { n, n_out, len }),
        2 => Just(Op::Publish),
        2 => (1usize..=8).prop_map(Op::Device),
        2 => (1usize..=8).prop_map(Op::Reap),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn prop_interleavings(
        size_log in 0u32..=5,
        event_idx in any::<bool>(),
        indirect in any::<bool>(),
        seed in any::<u64>(),
        ops in proptest::collection::vec(op(), 1..300),
    ) {
        let size = 1u16 << size_log;
        let mut s = Sim::new(size, event_idx, if indirect { indirect_for(size) } else { 0 });
        let mut rng = Rng(seed | 1);
        for op in ops {
            match op {
                Op::Add { n, n_out, len } => {
                    s.add(n, n_out, &[len, len / 2 + 1, SEG as u32 - len + 1]);
                }
                Op::Publish => s.publish(),
                Op::Device(b) => s.device_step(b, &mut rng),
                Op::Reap(b) => s.reap(b),
            }
            // Never both asleep with published work outstanding.
            prop_assert!(!(s.drv == Drv::Sleeping && s.dev == Dev::Sleeping
                && s.done + u64::from(s.vq.unpublished()) < s.seq));
        }
        s.drain(&mut rng);
        prop_assert_eq!(s.done, s.seq);
    }
}

// ---------- threads: a device echoing tx into rx ----------

/// An eventfd stand-in.
#[derive(Default)]
struct Event {
    count: Mutex<u64>,
    cv: Condvar,
}

impl Event {
    fn signal(&self) {
        *self.count.lock().unwrap() += 1;
        self.cv.notify_one();
    }
    /// Waits for a signal; false on timeout.
    fn wait(&self, timeout: Duration) -> bool {
        let g = self.count.lock().unwrap();
        let (mut g, r) = self.cv.wait_timeout_while(g, timeout, |c| *c == 0).unwrap();
        if r.timed_out() {
            return false;
        }
        *g = 0;
        true
    }
}

impl Notify for Event {
    fn notify(&self, _queue: u16) {
        self.signal();
    }
}

#[derive(Default, Debug)]
struct Counts {
    kicks_tx: u64,
    kicks_rx: u64,
    irqs: u64,
    dev_wakeups: u64,
}

fn threaded_echo(size: u16, event_idx: bool, total: u64) -> Counts {
    const TIMEOUT: Duration = Duration::from_secs(10);
    let (mem, dma) = guest(8 << 20);
    let feats = features::VERSION_1 | if event_idx { features::EVENT_IDX } else { 0 };
    let mut tx = MsgQueue::new(&dma, VirtqConfig::new(0, size).with_features(feats), 304).unwrap();
    let mut rx = MsgQueue::new(&dma, VirtqConfig::new(1, size).with_features(feats), 304).unwrap();
    let mut dtx = device_queue(&mem, tx.virtq());
    let mut drx = device_queue(&mem, rx.virtq());
    let kick = Arc::new(Event::default());
    let irq = Arc::new(Event::default());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));

    let device = {
        let (mem, kick, irq, stop) = (mem.clone(), kick.clone(), irq.clone(), stop.clone());
        std::thread::spawn(move || {
            let mem = &*mem;
            let mut wakeups = 0u64;
            let mut pending: VecDeque<(u16, Vec<u8>)> = VecDeque::new();
            loop {
                if !kick.wait(Duration::from_millis(50)) {
                    if stop.load(Ordering::Acquire) {
                        return wakeups;
                    }
                    continue;
                }
                wakeups += 1;
                // Process both queues until neither has work (disable -> process ->
                // enable -> re-check), then interrupt if the driver asked for it.
                loop {
                    dtx.disable_notification(mem).unwrap();
                    drx.disable_notification(mem).unwrap();
                    let mut used_tx = false;
                    while let Some(c) = dtx.pop_descriptor_chain(mem) {
                        let head = c.head_index();
                        let mut msg = Vec::new();
                        for d in c {
                            let mut b = vec![0u8; d.len() as usize];
                            mem.read_slice(&mut b, d.addr()).unwrap();
                            msg.extend(b);
                        }
                        dtx.add_used(mem, head, 0).unwrap();
                        used_tx = true;
                        pending.push_back((head, msg));
                    }
                    let mut used_rx = false;
                    while let Some((_, msg)) = pending.front() {
                        let Some(c) = drx.pop_descriptor_chain(mem) else {
                            break;
                        };
                        let head = c.head_index();
                        let d: Vec<Descriptor> = c.collect();
                        mem.write_slice(msg, d[0].addr()).unwrap();
                        drx.add_used(mem, head, msg.len() as u32).unwrap();
                        used_rx = true;
                        pending.pop_front();
                    }
                    let notify = (used_tx && dtx.needs_notification(mem).unwrap())
                        | (used_rx && drx.needs_notification(mem).unwrap());
                    if notify {
                        irq.signal();
                    }
                    let more_tx = dtx.enable_notification(mem).unwrap();
                    let more_rx = drx.enable_notification(mem).unwrap();
                    // rx buffers only matter while messages wait for them.
                    let more = more_tx || (more_rx && !pending.is_empty());
                    if !more {
                        break;
                    }
                }
            }
        })
    };

    let mut c = Counts::default();
    assert_eq!(rx.post_all().unwrap(), size);
    if rx.kick(&*kick) {
        c.kicks_rx += 1;
    }
    let mut sent = 0u64;
    let mut received = 0u64;
    while received < total {
        // Send what fits.
        let mut n = 0;
        while sent < total {
            let Some(s) = tx.alloc() else { break };
            let len = 48 + (sent % 257) as usize;
            let b = tx.buf_mut(s).unwrap();
            b[..8].copy_from_slice(&sent.to_le_bytes());
            for (i, v) in b[8..len].iter_mut().enumerate() {
                *v = pattern(sent, 0, i);
            }
            match tx.send(s, len) {
                Ok(()) => {}
                Err(VirtqError::Full) => {
                    tx.free(s).unwrap();
                    break;
                }
                Err(e) => panic!("{e}"),
            }
            sent += 1;
            n += 1;
            if n == 16 {
                break;
            }
        }
        if tx.kick(&*kick) {
            c.kicks_tx += 1;
        }
        // Reap tx and rx.
        let mut progress = false;
        while let Some(u) = tx.pop_used().unwrap() {
            tx.free(u.token).unwrap();
            progress = true;
        }
        let mut reposted = false;
        while let Some(u) = rx.pop_used().unwrap() {
            let b = &rx.buf(u.token).unwrap()[..u.len as usize];
            let seq = u64::from_le_bytes(b[..8].try_into().unwrap());
            assert_eq!(seq, received, "echo order");
            assert_eq!(b.len(), 48 + (seq % 257) as usize);
            for (i, v) in b[8..].iter().enumerate() {
                assert_eq!(*v, pattern(seq, 0, i));
            }
            received += 1;
            rx.post(u.token).unwrap();
            reposted = true;
            progress = true;
        }
        if reposted && rx.kick(&*kick) {
            c.kicks_rx += 1;
        }
        if progress || (sent < total && tx.pool().num_free() > 0 && tx.virtq().num_free() > 0) {
            continue;
        }
        // Nothing to do: re-arm both queues, re-check, then sleep.
        let more = tx.enable_notifications() | rx.enable_notifications();
        if !more {
            assert!(
                irq.wait(TIMEOUT),
                "lost interrupt: sent {sent} received {received}"
            );
            c.irqs += 1;
        }
        tx.disable_notifications();
        rx.disable_notifications();
    }
    stop.store(true, Ordering::Release);
    c.dev_wakeups = device.join().unwrap();
    assert_eq!(tx.stats().added, total);
    c
}

#[test]
fn threaded_echo_event_idx() {
    for size in [1u16, 8, 256] {
        let c = threaded_echo(size, true, 30_000);
        assert!(c.kicks_tx + c.kicks_rx >= 1, "{c:?}");
    }
}

#[test]
fn threaded_echo_no_event_idx() {
    for size in [2u16, 64] {
        threaded_echo(size, false, 30_000);
    }
}

#[test]
fn linear_dma_alignment_and_exhaustion() {
    let (_mem, dma) = guest(1 << 16);
    let a = dma.alloc(10, 1).unwrap();
    let b = dma.alloc(10, 4096).unwrap();
    assert_eq!(a.dev_addr(), GPA_BASE);
    assert_eq!(b.dev_addr() % 4096, 0);
    assert_eq!(b.as_ptr() as usize % 4096, 0);
    assert!(b.dev_addr() >= a.dev_addr() + 10);
    assert!(dma.alloc(1 << 16, 1).is_err());
    assert!(dma.alloc(8, 3).is_err());
    let mut c = dma.alloc(16, 8).unwrap();
    let mut out = [0u8; 16];
    c.read_at(0, &mut out).unwrap();
    assert_eq!(out, [0u8; 16]);
    c.write_at(8, &[1, 2, 3]).unwrap();
    assert!(c.write_at(14, &[1, 2, 3]).is_none());
    c.read_at(8, &mut out[..3]).unwrap();
    assert_eq!(&out[..3], &[1, 2, 3]);
}

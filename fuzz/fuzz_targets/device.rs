//! The device's descriptor-chain handling (`backend/src/device/queue.rs`) on arbitrary
//! descriptor tables, avail rings and indirect tables, through virtio-queue's
//! `MockSplitQueue` and a `Queue` over real guest memory (two regions with a hole).
//!
//! The tx pass takes chains in rounds as `PvcmDevice::process_tx` does (`Queue::iter`,
//! at most 256 per round, `add_used` for every head) and reads each with the device's
//! own `read_chain` (`device::fuzzing::read_tx_chain`); the rx pass pops chains as
//! `deliver_rx` does and writes a message with `write_chain`. Every chain must end as a
//! message or a counted drop (a `DevDrop`), never a panic, and the walk is bounded:
//! no pass takes more chains than the ring can hold.

#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pvcm_backend::device::fuzzing::{read_tx_chain, write_rx_chain};
use pvcm_wire::abi::{HEADER_LEN, MsgHeader, RX_BUFFER_LEN};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use pvcm_backend::device::Mem;
use vm_memory::{Bytes, GuestAddress};

/// Guest memory: [0, 0x4000) and [0x5000, 0x6000); 0x4000..0x5000 is a hole.
const LOW_END: u64 = 0x4000;
const HIGH: u64 = 0x5000;
const HIGH_LEN: u64 = 0x1000;
/// Where message bytes and indirect tables are put.
const DATA: u64 = 0x2000;
const INDIRECT: u64 = 0x3000;
/// The device's tx round.
const TX_ROUND: usize = 256;

fn memory() -> &'static Mem {
    static MEM: OnceLock<Mem> = OnceLock::new();
    MEM.get_or_init(|| {
        Mem::from_ranges(&[
            (GuestAddress(0), LOW_END as usize),
            (GuestAddress(HIGH), HIGH_LEN as usize),
        ])
        .expect("guest memory")
    })
}

/// Where a descriptor points.
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Addr {
    /// Into the message bytes.
    Data(u16),
    /// Into the indirect tables (an indirect descriptor's table, usually).
    Indirect(u16),
    /// Near the end of the low region (crossing into the hole).
    LowEnd(u8),
    /// Into the high region, possibly past its end.
    High(u16),
    /// Anywhere.
    Raw(u64),
}

impl Addr {
    fn get(self) -> u64 {
        match self {
            Addr::Data(o) => DATA + u64::from(o % 0x1000),
            Addr::Indirect(o) => INDIRECT + u64::from(o % 0x1000) / 16 * 16,
            Addr::LowEnd(o) => LOW_END - u64::from(o),
            Addr::High(o) => HIGH + u64::from(o % 0x1100),
            Addr::Raw(a) => a,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct Desc {
    addr: Addr,
    len: u16,
    big_len: bool,
    /// NEXT = 1, WRITE = 2, INDIRECT = 4 (and any other bit).
    flags: u16,
    next: u16,
}

impl Desc {
    fn raw(self) -> RawDescriptor {
        let len = if self.big_len {
            u32::from(self.len) << 16 | u32::from(self.len)
        } else {
            u32::from(self.len % 0x200)
        };
        let flags = if self.flags & 0x8000 != 0 {
            self.flags
        } else {
            self.flags & 0x7
        };
        RawDescriptor::from(SplitDescriptor::new(self.addr.get(), len, flags, self.next))
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    /// Queue size: 1 << (size_exp % 9) (1..=256).
    size_exp: u8,
    event_idx: bool,
    descs: Vec<Desc>,
    /// Indirect tables, written at `INDIRECT`.
    indirect: Vec<Desc>,
    avail: Vec<u16>,
    /// Avail idx = next_avail + avail_ahead (may exceed the queue size).
    avail_ahead: u16,
    next_avail: u16,
    /// Message bytes at `DATA`; the rx pass writes a message of `rx_len` bytes.
    data: Vec<u8>,
    rx_len: u16,
}

fuzz_target!(|input: Input| {
    let mem = memory();
    // Fresh memory every run, so that a run depends on its input only.
    let zero = vec![0u8; LOW_END as usize];
    mem.write_slice(&zero, GuestAddress(0)).expect("low region");
    mem.write_slice(&zero[..HIGH_LEN as usize], GuestAddress(HIGH))
        .expect("high region");
    let n = input.data.len().min(0x1000);
    mem.write_slice(&input.data[..n], GuestAddress(DATA))
        .expect("data");

    let size: u16 = 1 << (input.size_exp % 9);
    let mock = MockSplitQueue::new(mem, size);
    for (i, d) in input.descs.iter().take(usize::from(size)).enumerate() {
        mock.desc_table()
            .store(i as u16, d.raw())
            .expect("descriptor in table");
    }
    for (i, d) in input.indirect.iter().take(256).enumerate() {
        mem.write_obj(d.raw(), GuestAddress(INDIRECT + 16 * i as u64))
            .expect("indirect descriptor");
    }
    for (i, a) in input.avail.iter().take(usize::from(size)).enumerate() {
        mock.avail()
            .ring()
            .ref_at(i)
            .expect("avail entry")
            .store(*a);
    }
    let avail_idx = input.next_avail.wrapping_add(input.avail_ahead);
    mock.avail().idx().store(avail_idx);

    // tx: rounds as process_tx takes them.
    let mut q: Queue = mock.create_queue().expect("queue");
    q.set_event_idx(input.event_idx);
    q.set_next_avail(input.next_avail);
    q.set_next_used(input.next_avail);
    let (mut taken, mut ok, mut dropped) = (0usize, 0usize, 0usize);
    let mut rounds = 0;
    loop {
        rounds += 1;
        assert!(rounds <= 2, "more rounds than the ring holds");
        if input.event_idx {
            let _ = q.disable_notification(mem);
        }
        let mut heads = Vec::new();
        match q.iter(mem) {
            Ok(iter) => {
                for chain in iter {
                    heads.push(chain.head_index());
                    match read_tx_chain(mem, chain) {
                        Ok(msg) => {
                            ok += 1;
                            assert!(msg.len() <= RX_BUFFER_LEN);
                            if msg.len() >= HEADER_LEN {
                                let _ = MsgHeader::parse(&msg[..HEADER_LEN]);
                            }
                        }
                        Err(r) => {
                            dropped += 1;
                            let _ = r.name();
                        }
                    }
                    if heads.len() >= TX_ROUND {
                        break;
                    }
                }
            }
            // An inconsistent avail ring: counted (bad_chain), nothing taken.
            Err(_) => dropped += 1,
        }
        for h in &heads {
            let _ = q.add_used(mem, *h, 0);
        }
        let _ = q.needs_notification(mem);
        taken += heads.len();
        if heads.len() < TX_ROUND {
            break;
        }
    }
    assert!(
        taken <= usize::from(size),
        "took {taken} chains from a ring of {size}"
    );
    assert_eq!(
        ok + dropped,
        taken + usize::from(taken == 0 && dropped == 1)
    );

    // rx: as deliver_rx fills buffers.
    let msg: Vec<u8> = (0..usize::from(input.rx_len) % (RX_BUFFER_LEN + 1))
        .map(|i| i as u8)
        .collect();
    let mut q: Queue = mock.create_queue().expect("queue");
    q.set_event_idx(input.event_idx);
    q.set_next_avail(input.next_avail);
    q.set_next_used(input.next_avail);
    let mut popped = 0usize;
    while let Some(chain) = q.pop_descriptor_chain(mem) {
        popped += 1;
        assert!(
            popped <= usize::from(size),
            "popped {popped} from a ring of {size}"
        );
        let head = chain.head_index();
        let len = match write_rx_chain(mem, chain, &msg) {
            Ok(()) => msg.len() as u32,
            Err(r) => {
                let _ = r.name();
                0
            }
        };
        let _ = q.add_used(mem, head, len);
    }
    let _ = q.enable_notification(mem);
});

//! Per-VM rx backlogs under a memory budget.
//!
//! A MAD for a VM that has no free rx buffer waits in the VM's backlog until the driver
//! posts buffers. A burst (a peer's 16,384 REQs, or the DREQs of a teardown) must not
//! be dropped while memory allows, so the backlog is bounded in bytes, not messages:
//! each VM has its own budget (`--rx-backlog-bytes`) and all VMs together share a
//! host-wide one (`--rx-host-backlog-bytes`). Past either, the message is dropped and
//! counted against the VM (`rx_backlog_full`, `rx_host_budget`); the peer's CM retry
//! recovers it. A VM that stops reading can hold at most its own budget, and pushing
//! onto a full backlog is O(1), so it slows nobody else. Memory a burst took is given
//! back once the backlog drains.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::rx::RxMsg;
use crate::stats::DevDrop;

/// What one backlogged message costs: its slot in the queue.
pub const MSG_COST: usize = std::mem::size_of::<RxMsg>();

/// Default per-VM budget: 32 MiB, about 100,000 MADs.
pub const DEFAULT_VM_BYTES: usize = 32 << 20;
/// Default host-wide budget: 512 MiB.
pub const DEFAULT_HOST_BYTES: usize = 512 << 20;

/// Past this many slots an empty backlog hands its memory back.
const KEEP_SLOTS: usize = 1024;

/// Bytes held by every backlog of a daemon, against the host-wide budget.
#[derive(Debug)]
pub struct HostBudget {
    used: AtomicUsize,
    cap: usize,
}

impl HostBudget {
    /// A budget of `cap` bytes.
    pub fn new(cap: usize) -> Arc<HostBudget> {
        Arc::new(HostBudget {
            used: AtomicUsize::new(0),
            cap,
        })
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    fn take(&self, n: usize) -> bool {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                (u + n <= self.cap).then_some(u + n)
            })
            .is_ok()
    }

    fn give(&self, n: usize) {
        self.used.fetch_sub(n, Ordering::AcqRel);
    }
}

/// One VM's backlog.
#[derive(Debug)]
pub struct RxBacklog {
    q: VecDeque<RxMsg>,
    cap_bytes: usize,
    host: Arc<HostBudget>,
}

impl RxBacklog {
    /// An empty backlog of at most `cap_bytes`, drawing on `host`.
    pub fn new(cap_bytes: usize, host: Arc<HostBudget>) -> RxBacklog {
        RxBacklog {
            q: VecDeque::new(),
            cap_bytes,
            host,
        }
    }

    /// Queues `m`, or says which budget it would exceed.
    pub fn push(&mut self, m: RxMsg) -> Result<(), DevDrop> {
        if (self.q.len() + 1) * MSG_COST > self.cap_bytes {
            return Err(DevDrop::RxBacklogFull);
        }
        if !self.host.take(MSG_COST) {
            return Err(DevDrop::RxHostBudget);
        }
        self.q.push_back(m);
        Ok(())
    }

    /// The oldest message.
    pub fn front(&self) -> Option<&RxMsg> {
        self.q.front()
    }

    /// Removes the oldest message.
    pub fn pop_front(&mut self) -> Option<RxMsg> {
        let m = self.q.pop_front()?;
        self.host.give(MSG_COST);
        if self.q.is_empty() && self.q.capacity() > KEEP_SLOTS {
            self.q.shrink_to(KEEP_SLOTS);
        }
        Some(m)
    }

    /// Drops everything (the VM reset its device or left); returns how many messages
    /// were waiting, for the caller to count.
    pub fn clear(&mut self) -> usize {
        let n = self.q.len();
        self.host.give(n * MSG_COST);
        self.q.clear();
        self.q.shrink_to(KEEP_SLOTS);
        n
    }

    /// Messages waiting.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Nothing waiting.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

impl Drop for RxBacklog {
    fn drop(&mut self) {
        self.host.give(self.q.len() * MSG_COST);
    }
}

/// Parses a byte size: a number with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(s: &str) -> Option<usize> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last()? {
        (i, 'k' | 'K') => (&t[..i], 1usize << 10),
        (i, 'm' | 'M') => (&t[..i], 1 << 20),
        (i, 'g' | 'G') => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rx::RxMsg;
    use pvcm_wire::Gid;

    fn msg() -> RxMsg {
        RxMsg::mad(Gid::from_ipv4([127, 0, 0, 1].into()), &[0; 256])
    }

    #[test]
    fn budgets_per_vm_and_host() {
        let host = HostBudget::new(5 * MSG_COST);
        let mut a = RxBacklog::new(3 * MSG_COST, host.clone());
        let mut b = RxBacklog::new(100 * MSG_COST, host.clone());
        for _ in 0..3 {
            a.push(msg()).unwrap();
        }
        assert_eq!(a.push(msg()), Err(DevDrop::RxBacklogFull));
        b.push(msg()).unwrap();
        b.push(msg()).unwrap();
        assert_eq!(b.push(msg()), Err(DevDrop::RxHostBudget));
        assert_eq!(host.used(), 5 * MSG_COST);
        a.pop_front().unwrap();
        b.push(msg()).unwrap();
        a.clear();
        assert_eq!(host.used(), 3 * MSG_COST);
        drop(b);
        assert_eq!(host.used(), 0);
    }

    #[test]
    fn memory_is_given_back_after_a_burst() {
        let host = HostBudget::new(usize::MAX);
        let mut a = RxBacklog::new(usize::MAX, host.clone());
        for _ in 0..50_000 {
            a.push(msg()).unwrap();
        }
        while a.pop_front().is_some() {}
        assert!(a.q.capacity() <= KEEP_SLOTS, "{}", a.q.capacity());
        assert_eq!(host.used(), 0);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("1g"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
    }
}

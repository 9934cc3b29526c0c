//! The virtqueue work: walking tx chains defensively into messages, returning them,
//! and writing backlogged messages into the driver's rx buffers. Plain functions over a
//! `virtio_queue::Queue` and guest memory, so the unit tests drive them through
//! virtio-queue's `MockSplitQueue` and the fuzz targets through `fuzzing`.

use std::ops::Deref;

use pvcm_wire::abi::{HEADER_LEN, RX_BUFFER_LEN};
use pvcm_wire::mad::MAD_LEN;
use vhost_user_backend::VringT;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryBackend};

use vm_memory::GuestMemoryAtomic;

use super::{Mem, PvcmDevice, Vring};
use crate::backlog::RxBacklog;
use crate::mux::MadSlot;
use crate::stats::{DevCounters, DevDrop, Io};
use crate::vm_port::VmPort;

/// Chains taken from the tx queue per round (then the used ring is published).
pub(super) const TX_ROUND: usize = 256;

/// A tx message as read from its chain: the header, then the payload (at most one
/// MAD), laid out so that the mux can rewrite the MAD where it was read ([`MadSlot`]).
pub(super) struct TxMsg {
    pub(super) head: [u8; HEADER_LEN],
    pub(super) mad: [u8; MAD_LEN],
    pub(super) len: usize,
}

// The payload part holds the largest payload the ABI allows.
const _: () = assert!(RX_BUFFER_LEN == HEADER_LEN + MAD_LEN);

impl TxMsg {
    /// The message's bytes `off..off + len` (within [`RX_BUFFER_LEN`]), as the part in
    /// the header and the part in the payload (either may be empty).
    pub(super) fn parts_mut(&mut self, off: usize, len: usize) -> (&mut [u8], &mut [u8]) {
        let end = (off + len).min(RX_BUFFER_LEN);
        let head: &mut [u8] = if off < HEADER_LEN {
            &mut self.head[off..end.min(HEADER_LEN)]
        } else {
            &mut []
        };
        let p = off.max(HEADER_LEN) - HEADER_LEN..end.max(HEADER_LEN) - HEADER_LEN;
        (head, &mut self.mad[p])
    }

    /// The first `n` payload bytes.
    pub(super) fn payload(&self, n: usize) -> &[u8] {
        &self.mad[..n.min(MAD_LEN)]
    }
}

impl MadSlot for TxMsg {
    fn mad(&self) -> &[u8; MAD_LEN] {
        &self.mad
    }
    fn mad_mut(&mut self) -> &mut [u8; MAD_LEN] {
        &mut self.mad
    }
}

/// Copies guest memory at `addr` into `buf`: one region lookup for a buffer within one
/// region (every buffer of a VM with one memory region), vm-memory's general path for
/// one that crosses regions. Either way an address outside guest memory is an error.
fn read_guest(
    mem: &Mem,
    buf: &mut [u8],
    addr: GuestAddress,
) -> Result<(), vm_memory::GuestMemoryError> {
    if buf.is_empty() {
        return Ok(());
    }
    match GuestMemoryBackend::get_slice(mem, addr, buf.len()) {
        Ok(s) => {
            s.copy_to(buf);
            Ok(())
        }
        Err(_) => mem.read_slice(buf, addr),
    }
}

/// [`read_guest`]'s counterpart: copies `buf` into guest memory at `addr` (the page is
/// marked in the dirty log, as every write of vm-memory's).
fn write_guest(
    mem: &Mem,
    buf: &[u8],
    addr: GuestAddress,
) -> Result<(), vm_memory::GuestMemoryError> {
    if buf.is_empty() {
        return Ok(());
    }
    match GuestMemoryBackend::get_slice(mem, addr, buf.len()) {
        Ok(s) => {
            s.copy_from(buf);
            Ok(())
        }
        Err(_) => mem.write_slice(buf, addr),
    }
}

/// Reads one tx chain into a buffer, checking it on the way.
pub(super) fn read_chain<M>(mem: &Mem, chain: DescriptorChain<M>) -> Result<TxMsg, DevDrop>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut msg = TxMsg {
        head: [0; HEADER_LEN],
        mad: [0; MAD_LEN],
        len: 0,
    };
    let mut n = 0usize;
    let mut last_has_next = false;
    for desc in chain {
        n += 1;
        if desc.is_write_only() {
            return Err(DevDrop::WrongDirection);
        }
        let dl = desc.len() as usize;
        if msg.len + dl > RX_BUFFER_LEN {
            return Err(DevDrop::ChainTooLong);
        }
        let at = msg.len;
        let (head, payload) = msg.parts_mut(at, dl);
        let in_head = head.len() as u64;
        read_guest(mem, head, desc.addr()).map_err(|_| DevDrop::BadAddress)?;
        if !payload.is_empty() {
            let addr = desc
                .addr()
                .checked_add(in_head)
                .ok_or(DevDrop::BadAddress)?;
            read_guest(mem, payload, addr).map_err(|_| DevDrop::BadAddress)?;
        }
        msg.len += dl;
        last_has_next = desc.has_next();
    }
    // No descriptor at all, or the walk stopped on a link it could not follow (an
    // index past the table, an unreadable or nested indirect table, a loop that ran out
    // the chain's budget of queue-size descriptors).
    if n == 0 || last_has_next {
        return Err(DevDrop::BadChain);
    }
    Ok(msg)
}

/// Writes `bytes` into one rx chain's device-writable descriptors.
pub(super) fn write_chain<M>(
    mem: &Mem,
    chain: DescriptorChain<M>,
    bytes: &[u8],
) -> Result<(), DevDrop>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut off = 0;
    let mut n = 0;
    for desc in chain {
        n += 1;
        if !desc.is_write_only() {
            return Err(DevDrop::RxBadBuffer);
        }
        let take = (desc.len() as usize).min(bytes.len() - off);
        if take > 0 {
            write_guest(mem, &bytes[off..off + take], desc.addr())
                .map_err(|_| DevDrop::RxBadBuffer)?;
            off += take;
        }
        if off == bytes.len() {
            break;
        }
    }
    if n == 0 || off < bytes.len() {
        return Err(DevDrop::RxBadBuffer);
    }
    Ok(())
}

/// One tx round on `q`: takes up to [`TX_ROUND`] chains and reads each
/// ([`read_chain`]). Returns the messages in order and the chains' heads, which
/// [`return_tx_round`] gives back once the messages were handled (so that a restart in
/// between finds them still in flight: see docs/restart.md).
pub(super) fn take_tx_round<M>(
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
    counters: &DevCounters,
) -> (Vec<Result<TxMsg, DevDrop>>, Vec<u16>)
where
    M: Deref<Target = Mem> + Clone,
{
    if event_idx {
        let _ = q.disable_notification(&**mem);
    }
    // Room for what the driver has made available (a capacity only: the walk below
    // stops where the ring does), so the round's messages are not moved as it grows.
    let ready = q
        .avail_idx(&**mem, std::sync::atomic::Ordering::Acquire)
        .map_or(0, |a| usize::from(a.0.wrapping_sub(q.next_avail())))
        .min(TX_ROUND);
    let mut msgs = Vec::with_capacity(ready);
    let mut heads = Vec::with_capacity(ready);
    match q.iter(mem.clone()) {
        Ok(iter) => {
            for chain in iter {
                heads.push(chain.head_index());
                msgs.push(read_chain(mem, chain));
                if heads.len() >= TX_ROUND {
                    break;
                }
            }
        }
        Err(e) => {
            // The avail ring itself is inconsistent: nothing to take now.
            tracing::debug!(error = %e, "tx avail ring unusable");
            counters.drop(DevDrop::BadChain);
        }
    }
    (msgs, heads)
}

/// Returns a round's heads to the used ring (length 0: the device writes nothing into
/// tx buffers). Returns whether the driver asked to be notified.
pub(super) fn return_tx_round<M>(q: &mut Queue, mem: &M, heads: &[u16]) -> bool
where
    M: Deref<Target = Mem>,
{
    for h in heads {
        if q.add_used(&**mem, *h, 0).is_err() {
            tracing::debug!(head = h, "tx head out of range");
        }
    }
    !heads.is_empty() && q.needs_notification(&**mem).unwrap_or(true)
}

/// After a restart: returns, unsent, the tx chains from the ring's current position up
/// to `resume` (the next avail index the journal recorded with the last batch whose
/// MADs left). QEMU resumes a ring at its used index, so those chains are offered again
/// though their MADs were sent; sending them twice is what this avoids. Returns how
/// many it returned (0 when `resume` is not ahead of the ring within one ring's size).
pub(super) fn skip_resumed<M>(q: &mut Queue, mem: &M, resume: u16) -> u16
where
    M: Deref<Target = Mem> + Clone,
{
    let ahead = resume.wrapping_sub(q.next_avail());
    if ahead == 0 || ahead > q.size() {
        return 0;
    }
    let mut heads = Vec::new();
    if let Ok(iter) = q.iter(mem.clone()) {
        for chain in iter.take(usize::from(ahead)) {
            heads.push(chain.head_index());
        }
    }
    return_tx_round(q, mem, &heads);
    heads.len() as u16
}

/// Writes messages from the front of `backlog` into `q`'s posted buffers until either
/// runs out; a buffer that cannot take a message is returned empty and counted
/// (`rx_bad_buffer`), the message waits for the next. Returns how many were delivered.
pub(super) fn fill_rx<M>(
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
    backlog: &mut RxBacklog,
    counters: &DevCounters,
) -> u64
where
    M: Deref<Target = Mem> + Clone,
{
    let mut delivered = 0u64;
    while let Some(msg) = backlog.front() {
        let Some(chain) = q.pop_descriptor_chain(mem.clone()) else {
            if event_idx && q.enable_notification(&**mem).unwrap_or(false) {
                continue;
            }
            break;
        };
        let head = chain.head_index();
        match write_chain(mem, chain, msg.bytes()) {
            Ok(()) => {
                let _ = q.add_used(&**mem, head, msg.len() as u32);
                backlog.pop_front();
                delivered += 1;
            }
            Err(r) => {
                counters.drop(r);
                let _ = q.add_used(&**mem, head, 0);
            }
        }
    }
    delivered
}

/// After [`fill_rx`]: whether the driver wants a used-buffer notification. A fill that
/// ran out of buffers has already asked for a kick when the driver posts more
/// ([`fill_rx`] with EVENT_IDX); one that emptied the backlog asks for none, so a driver
/// refilling its rx ring does not kick a device that has nothing to write.
pub(super) fn finish_rx<M>(q: &mut Queue, mem: &M) -> bool
where
    M: Deref<Target = Mem>,
{
    q.needs_notification(&**mem).unwrap_or(true)
}

/// A session's rx queue as any thread can fill it: the vring, the guest memory and
/// whether EVENT_IDX was negotiated. The device publishes it on its VM port
/// ([`VmPort::publish_rx_ring`]) once the session runs, so the host loop writes the MADs
/// it routes straight into the driver's buffers instead of waking the VM's worker for
/// each batch.
#[derive(Clone)]
pub(crate) struct RxRing {
    pub(super) vring: Vring,
    pub(super) mem: GuestMemoryAtomic<Mem>,
    pub(super) event_idx: bool,
}

impl std::fmt::Debug for RxRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RxRing")
            .field("event_idx", &self.event_idx)
            .finish_non_exhaustive()
    }
}

impl crate::vm_port::RxRingFill for RxRing {
    fn deliver(&self, port: &VmPort) -> u64 {
        RxRing::deliver(self, port)
    }
}

impl RxRing {
    /// Writes `port`'s backlogged messages into the driver's rx buffers (lock order: the
    /// backlog, then the vring), and signals the driver if it asks. A queue that is not
    /// running (stopped for a migration, reset) is left alone: the backlog keeps its
    /// messages. Returns how many were written.
    pub(crate) fn deliver(&self, port: &VmPort) -> u64 {
        let mem = self.mem.memory();
        let mut backlog = port.lock_rx();
        if backlog.is_empty() {
            return 0;
        }
        let mut st = self.vring.get_mut();
        if !st.is_enabled() || !st.get_queue().ready() {
            return 0;
        }
        let q = st.get_queue_mut();
        let delivered = fill_rx(q, &mem, self.event_idx, &mut backlog, &port.counters);
        drop(backlog);
        let notify = finish_rx(q, &mem);
        if delivered > 0 {
            port.counters.add(Io::RxMessages, delivered);
        }
        if notify && let Err(e) = st.signal_used_queue() {
            tracing::debug!(error = %e, "rx used signal failed");
        }
        delivered
    }
}

impl PvcmDevice {
    /// This session's rx ring (`None` before the guest memory is mapped).
    pub(super) fn rx_ring(&self, vring: &Vring) -> Option<RxRing> {
        Some(RxRing {
            vring: vring.clone(),
            mem: self.mem.clone()?,
            event_idx: self.event_idx,
        })
    }

    /// Writes backlogged messages into the driver's rx buffers.
    pub(super) fn deliver_rx(&mut self, vring: &Vring) {
        if let Some(ring) = self.rx_ring(vring) {
            ring.deliver(&self.port);
        }
    }
}

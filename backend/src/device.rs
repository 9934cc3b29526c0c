//! The pvcm virtio device, served over vhost-user (one [`PvcmDevice`] per VM session).
//!
//! Two queues (ABI in `docs/device-abi.md`): 0 = tx (driver -> device), 1 = rx
//! (device -> driver). The device walks each tx chain defensively (bounded length, guest
//! addresses checked, direction checked, loops and broken links detected): a bad chain is
//! returned to the driver unread and counted; the queue keeps working. Messages:
//!
//! - MAD -> [`crate::mux::Mux::from_guest`] -> the wire port (or an in-band reply, or a
//!   SEND_ERROR back on rx carrying the MAD as sent, with a [`SendStatus`]);
//! - PORT_INFO_REQUEST -> PORT_INFO on rx.
//!
//! Everything for rx goes through the VM's bounded backlog (`--rx-backlog`) and is
//! written into rx buffers by this VM's own vring worker thread, woken by an eventfd, so
//! a VM that posts no buffers only loses its own messages (counted) and never delays
//! another VM or the wire.
//!
//! Outside this module the device is [`PvcmDevice::new`] and vhost-user-backend's
//! [`VhostUserBackendMut`]. Inside, the queue work is plain functions over a
//! `virtio_queue::Queue` and guest memory (`take_tx_round`, `fill_rx`, `finish_rx`) with
//! the vring lock and notifications around them, so the unit tests below drive them
//! through virtio-queue's `MockSplitQueue`, and the fuzz target through [`fuzzing`].

use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::Deref;
use std::sync::Arc;
use std::sync::Mutex;

use pvcm_wire::abi::{
    self, HEADER_LEN, MsgHeader, MsgType, PORT_INFO_LEN, PortInfo, RX_BUFFER_LEN, SendStatus,
};
use pvcm_wire::mad::{MAD_LEN, MGMT_CLASS_CM};
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserProtocolFeatures,
};
use vhost_user_backend::{VhostUserBackendMut, VringRwLock, VringT};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{
    Address, Bytes, GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::backlog::RxBacklog;
use crate::migration::MigrationError;
use crate::mux::{DropReason, GuestVerdict, MadSlot};
use crate::port::OutMad;
use crate::rx::RxMsg;
use crate::shared::Shared;
use crate::stats::{DevCounters, DevDrop, Io};
use crate::vm_port::{Lifecycle, VmPort, lock};

/// Queues: tx and rx.
pub const NUM_QUEUES: usize = 2;
/// Largest queue size the device accepts (any size up to this works).
pub const MAX_QUEUE_SIZE: usize = 1024;
/// `handle_event` id of the VM's rx-wake eventfd (0, 1 are the queues; 2 is reserved for
/// the exit event by vhost-user-backend).
pub const RX_WAKE_EVENT: u16 = 3;
/// Chains taken from the tx queue per round (then the used ring is published).
const TX_ROUND: usize = 256;
/// The largest device state accepted on load: 64-byte entries and 256-byte backlog
/// messages, far above any VM's quota and backlog budget.
const MAX_STATE_BYTES: u64 = 1 << 30;
/// The `VHOST_USER_F_PROTOCOL_FEATURES` feature bit.
const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// `VHOST_F_LOG_ALL`: the device logs its writes to guest memory while the VMM
/// migrates (QEMU blocks migration of a vhost device without it).
const VHOST_F_LOG_ALL: u64 = 1 << 26;

/// Guest memory as the device maps it: with the dirty-page log vhost-user-backend keeps
/// during a live migration (`VHOST_F_LOG_ALL`), so every byte the device writes into
/// guest memory (rx messages, used rings) is copied again by the VMM.
pub type Mem = GuestMemoryMmap<crate::dirty_log::DirtyLog>;
/// A vring over [`Mem`].
pub type Vring = VringRwLock<GuestMemoryAtomic<Mem>>;

/// Virtio features the device offers.
pub fn device_features() -> u64 {
    (1 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | VHOST_USER_F_PROTOCOL_FEATURES
        | VHOST_F_LOG_ALL
}

/// vhost-user protocol features the device offers.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
        | VhostUserProtocolFeatures::DEVICE_STATE
        | VhostUserProtocolFeatures::LOG_SHMFD
}

/// A device-state transfer in progress (`SET_DEVICE_STATE_FD` started it; the pipe is
/// served on its own thread, as the protocol wants; `CHECK_DEVICE_STATE` ends it).
#[derive(Debug)]
enum Transfer {
    /// Writing the saved state to the front-end.
    Saving(std::thread::JoinHandle<io::Result<()>>),
    /// Reading the state to load.
    Loading(std::thread::JoinHandle<io::Result<Vec<u8>>>),
    /// Refused at the start; the check reports it.
    Failed(MigrationError),
}

/// The config space read at `offset`, `size` bytes: the 8-byte [`abi::config_space`],
/// zeros beyond it.
pub fn config_bytes(offset: u32, size: u32) -> Vec<u8> {
    let cfg = abi::config_space();
    let size = size.min(256) as usize;
    (0..size)
        .map(|i| cfg.get(offset as usize + i).copied().unwrap_or(0))
        .collect()
}

/// A tx message as read from its chain: the header, then the payload (at most one
/// MAD), laid out so that the mux can rewrite the MAD where it was read ([`MadSlot`]).
struct TxMsg {
    head: [u8; HEADER_LEN],
    mad: [u8; MAD_LEN],
    len: usize,
}

// The payload part holds the largest payload the ABI allows.
const _: () = assert!(RX_BUFFER_LEN == HEADER_LEN + MAD_LEN);

impl TxMsg {
    /// The message's bytes `off..off + len` (within [`RX_BUFFER_LEN`]), as the part in
    /// the header and the part in the payload (either may be empty).
    fn parts_mut(&mut self, off: usize, len: usize) -> (&mut [u8], &mut [u8]) {
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
    fn payload(&self, n: usize) -> &[u8] {
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

/// Reads one tx chain into a buffer, checking it on the way.
fn read_chain<M>(mem: &Mem, chain: DescriptorChain<M>) -> Result<TxMsg, DevDrop>
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
        mem.read_slice(head, desc.addr())
            .map_err(|_| DevDrop::BadAddress)?;
        let addr = desc
            .addr()
            .checked_add(in_head)
            .ok_or(DevDrop::BadAddress)?;
        mem.read_slice(payload, addr)
            .map_err(|_| DevDrop::BadAddress)?;
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
fn write_chain<M>(mem: &Mem, chain: DescriptorChain<M>, bytes: &[u8]) -> Result<(), DevDrop>
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
            mem.write_slice(&bytes[off..off + take], desc.addr())
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
fn take_tx_round<M>(
    q: &mut Queue,
    mem: &M,
    event_idx: bool,
    counters: &DevCounters,
) -> (Vec<Result<TxMsg, DevDrop>>, Vec<u16>)
where
    M: Deref<Target = Mem> + Clone,
{
    let mut msgs = Vec::new();
    if event_idx {
        let _ = q.disable_notification(&**mem);
    }
    let mut heads = Vec::new();
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
fn return_tx_round<M>(q: &mut Queue, mem: &M, heads: &[u16]) -> bool
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
fn skip_resumed<M>(q: &mut Queue, mem: &M, resume: u16) -> u16
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
fn fill_rx<M>(
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

/// After [`fill_rx`]: with EVENT_IDX, asks for a kick when the driver posts buffers (the
/// backlog may refill). Returns whether the driver wants a used-buffer notification.
fn finish_rx<M>(q: &mut Queue, mem: &M, event_idx: bool) -> bool
where
    M: Deref<Target = Mem>,
{
    if event_idx {
        let _ = q.enable_notification(&**mem);
    }
    q.needs_notification(&**mem).unwrap_or(true)
}

/// What a mux verdict on a tx MAD turns into.
fn send_status(r: DropReason) -> SendStatus {
    match r {
        DropReason::Malformed => SendStatus::Malformed,
        DropReason::UnknownConnection | DropReason::NoRoute | DropReason::Quarantined => {
            SendStatus::UnknownConnection
        }
        DropReason::SpoofedGid | DropReason::SpoofedQpn | DropReason::SpoofedCaGuid => {
            SendStatus::Spoofed
        }
        DropReason::OverQuota | DropReason::VmOverQuota | DropReason::TableFull => {
            SendStatus::NoResources
        }
        _ => SendStatus::BadState,
    }
}

/// The device of one VM session. Created fresh for every vhost-user connection.
#[derive(Debug)]
pub struct PvcmDevice {
    shared: Arc<Shared>,
    port: Arc<VmPort>,
    mem: Option<GuestMemoryAtomic<Mem>>,
    event_idx: bool,
    exit_consumer: EventConsumer,
    exit_notifier: EventNotifier,
    throttle: TxThrottle,
    transfer: Mutex<Option<Transfer>>,
}

/// Rounds of tx with at least this many dropped messages pause the VM's tx (a guest
/// that follows the ABI drops none; a MAD over quota or naming a closed connection is
/// one here and there).
pub const THROTTLE_BAD_PER_ROUND: usize = 32;

/// Slows a guest that floods bad input: after a round with [`THROTTLE_BAD_PER_ROUND`]
/// or more drops its tx waits 1 ms, doubling with each such round in a row up to 16 ms;
/// a clean round ends it. What the flood costs the host is then bounded per VM.
#[derive(Debug, Default, Clone, Copy)]
pub struct TxThrottle {
    pause: std::time::Duration,
}

impl TxThrottle {
    /// The pause after a round with `bad` drops, if any.
    pub fn after_round(&mut self, bad: usize) -> Option<std::time::Duration> {
        use std::time::Duration;
        if bad < THROTTLE_BAD_PER_ROUND {
            self.pause = Duration::ZERO;
            return None;
        }
        self.pause = (self.pause * 2).clamp(Duration::from_millis(1), Duration::from_millis(16));
        Some(self.pause)
    }
}

impl PvcmDevice {
    /// A device for `port`'s VM.
    pub fn new(shared: Arc<Shared>, port: Arc<VmPort>) -> io::Result<PvcmDevice> {
        let (exit_consumer, exit_notifier) = new_event_consumer_and_notifier(EventFlag::NONBLOCK)?;
        Ok(PvcmDevice {
            shared,
            port,
            mem: None,
            event_idx: false,
            exit_consumer,
            exit_notifier,
            throttle: TxThrottle::default(),
            transfer: Mutex::new(None),
        })
    }

    /// The guest kicked a ring, so the VM runs on this host: an incoming VM whose state
    /// never came is a fresh boot (attach it); one whose state left is back because the
    /// migration failed and the source resumed (load the saved state again).
    fn vm_runs_here(&self) {
        let mut life = self.port.lifecycle();
        match &mut *life {
            Lifecycle::Departed { state } => {
                let blob = std::mem::take(state);
                *life = Lifecycle::Detached;
                drop(life);
                match self.shared.migrate_in(&self.port, &blob) {
                    Ok(_) => {
                        tracing::warn!("the VM runs here again after leaving: its state is back")
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "the VM runs here again but its state cannot come back")
                    }
                }
            }
            Lifecycle::Awaiting => {
                *life = Lifecycle::Detached;
                drop(life);
                match self.shared.port.claim(self.port.index) {
                    Ok(_) => {
                        tracing::info!("incoming VM started without a state: a fresh boot here");
                        self.shared.attach(&self.port);
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "incoming VM started but its address cannot be taken")
                    }
                }
            }
            Lifecycle::Detached | Lifecycle::Restored { .. } | Lifecycle::Attached { .. } => {}
        }
    }

    /// Takes every available tx chain, handles the messages, publishes the used ring.
    fn process_tx(&mut self, vring: &Vring, rx: &Vring) {
        let Some(atomic) = self.mem.clone() else {
            return;
        };
        let mem = atomic.memory();
        let resume = self.port.lifecycle().take_tx_resume();
        if let Some(resume) = resume {
            let mut st = vring.get_mut();
            let n = skip_resumed(st.get_queue_mut(), &mem, resume);
            if n > 0 {
                tracing::info!(
                    chains = n,
                    "tx chains sent before the restart returned unsent"
                );
                self.port.counters.add(Io::TxResumeSkipped, u64::from(n));
                let _ = st.signal_used_queue();
            }
        }
        loop {
            let (msgs, heads, next_avail);
            {
                let mut st = vring.get_mut();
                let q = st.get_queue_mut();
                (msgs, heads) = take_tx_round(q, &mem, self.event_idx, &self.port.counters);
                next_avail = q.next_avail();
            }
            let full_round = msgs.len() >= TX_ROUND;
            if !msgs.is_empty() {
                let bad = self.handle_tx(msgs, next_avail);
                {
                    let mut st = vring.get_mut();
                    if return_tx_round(st.get_queue_mut(), &mem, &heads) {
                        if let Err(e) = st.signal_used_queue() {
                            tracing::debug!(error = %e, "tx used signal failed");
                        }
                    }
                }
                self.deliver_rx(rx);
                if let Some(pause) = self.throttle.after_round(bad) {
                    // A guest flooding bad input waits here, on its own worker thread:
                    // its queue is not walked, so the backend spends its CPU and the
                    // mux lock on the other VMs meanwhile.
                    self.port.counters.add(Io::TxThrottles, 1);
                    std::thread::sleep(pause);
                }
            }
            if full_round {
                continue;
            }
            if self.event_idx && vring.enable_notification().unwrap_or(false) {
                continue;
            }
            break;
        }
    }

    /// Handles a round of tx messages: one mux lock for all MADs, then I/O. Returns how
    /// many of them were dropped.
    fn handle_tx(&mut self, mut msgs: Vec<Result<TxMsg, DevDrop>>, next_avail: u16) -> usize {
        let port = &self.port;
        let c = &port.counters;
        c.add(Io::TxMessages, msgs.len() as u64);
        let vm = port.current_vm();
        // Messages of this round dropped (by the device or the mux).
        let mut bad = 0usize;
        // The MADs for the mux: each message where it was read (no copy), and its header.
        let mut mads: Vec<&mut TxMsg> = Vec::new();
        let mut hdrs: Vec<MsgHeader> = Vec::new();
        let mut own_rx: Vec<RxMsg> = Vec::new();
        for m in &mut msgs {
            let m = match m {
                Ok(m) => m,
                Err(r) => {
                    tracing::debug!(reason = r.name(), "tx chain dropped");
                    bad += 1;
                    c.drop(*r);
                    continue;
                }
            };
            if m.len < HEADER_LEN {
                bad += 1;
                c.drop(DevDrop::Truncated);
                continue;
            }
            let h = match MsgHeader::parse(&m.head) {
                Ok(h) => h,
                Err(pvcm_wire::Error::TooLong { .. }) => {
                    bad += 1;
                    c.drop(DevDrop::Oversize);
                    continue;
                }
                Err(_) => {
                    tracing::debug!("tx message of unknown type dropped");
                    bad += 1;
                    c.drop(DevDrop::UnknownType);
                    continue;
                }
            };
            let len = h.len as usize;
            if HEADER_LEN + len > m.len {
                bad += 1;
                c.drop(DevDrop::Truncated);
                continue;
            }
            match h.msg_type {
                MsgType::PortInfoRequest => own_rx.push(self.port_info()),
                MsgType::Mad => {
                    let payload = m.payload(len);
                    let reject = if len != MAD_LEN {
                        Some(DevDrop::BadMadLength)
                    } else if pvcm_wire::mad::field::MGMT_CLASS.get(payload)
                        != u64::from(MGMT_CLASS_CM)
                    {
                        Some(DevDrop::NotCm)
                    } else if h.remote_gid.roce_unicast_problem().is_some()
                        || h.remote_gid.to_ipv4().is_some() != port.spec.vm.gid.to_ipv4().is_some()
                    {
                        // Not a unicast RoCE address, or the other IP family: no
                        // datagram from the VM's address can carry it.
                        Some(DevDrop::BadRemoteGid)
                    } else if vm.is_none() {
                        Some(DevDrop::NotAttached)
                    } else {
                        None
                    };
                    if let Some(r) = reject {
                        tracing::debug!(reason = r.name(), "tx MAD dropped");
                        bad += 1;
                        c.drop(r);
                        let status = match r {
                            DevDrop::BadRemoteGid | DevDrop::NotAttached => SendStatus::WireError,
                            _ => SendStatus::Malformed,
                        };
                        own_rx.push(RxMsg::send_error(&h, status, payload));
                        continue;
                    }
                    hdrs.push(h);
                    mads.push(m);
                }
                _ => {
                    tracing::debug!(msg_type = ?h.msg_type, "device-to-driver message on tx dropped");
                    bad += 1;
                    c.drop(DevDrop::UnknownType);
                }
            }
        }
        let Some(vm) = vm else {
            self.finish_tx(&[], own_rx, Vec::new());
            return bad;
        };
        let mut verdicts = vec![GuestVerdict::ToWire; mads.len()];
        let outbox;
        {
            let mut core = self.shared.lock_core();
            // One call for the round: the mux prefetches the entries first, and rewrites
            // each MAD where it was read.
            core.mux
                .from_guest_batch(vm, &mut mads, |i, _| hdrs[i].remote_gid, &mut verdicts);
            outbox = core.mux.drain_outbox().collect::<Vec<_>>();
            // In the same journal frame as the batch's changes, before its MADs leave.
            core.note_tx_progress(&self.port.spec.vm.name, next_avail);
            core.commit();
            self.shared.note_deadline(core.mux.next_deadline());
        }
        let mut to_wire: Vec<OutMad<'_>> = Vec::with_capacity(mads.len());
        for ((m, h), verdict) in mads.iter().zip(&hdrs).zip(verdicts) {
            match verdict {
                GuestVerdict::ToWire => to_wire.push((h.remote_gid, &m.mad)),
                GuestVerdict::Reply => own_rx.push(RxMsg::mad(h.remote_gid, &m.mad)),
                GuestVerdict::Drop(r) => {
                    bad += 1;
                    tracing::debug!(reason = r.name(), "tx MAD dropped by the mux");
                    // The mux leaves a MAD it refuses untouched: echoed as the VM sent it.
                    own_rx.push(RxMsg::send_error(h, send_status(r), &m.mad));
                }
            }
        }
        self.finish_tx(&to_wire, own_rx, outbox);
        bad
    }

    fn finish_tx(
        &self,
        to_wire: &[OutMad<'_>],
        own_rx: Vec<RxMsg>,
        outbox: Vec<crate::mux::Outgoing>,
    ) {
        let errors = own_rx
            .iter()
            .filter(|m| m.msg_type() == Some(MsgType::SendError))
            .count();
        self.port.counters.add(Io::SendErrors, errors as u64);
        if !to_wire.is_empty() {
            self.shared.send_mads(&self.port, to_wire);
        }
        for m in own_rx {
            self.port.push_rx(m);
        }
        if !outbox.is_empty() {
            self.shared.send_outgoing(outbox);
        }
    }

    fn port_info(&self) -> RxMsg {
        let vm = &self.port.spec.vm;
        let quota = self.port.quota().unwrap_or(self.shared.default_quota());
        // The path values of the VM's own link (its MTU) where the port can tell them,
        // else the configured ones (--path-mtu, --ca-ack-delay).
        let link = self.shared.port.link(self.port.index);
        let info = PortInfo {
            abi_version: abi::ABI_VERSION,
            port_up: true,
            gid: vm.gid,
            ca_guid: vm.ca_guid,
            lid: 0xFFFF,
            pkey: pvcm_wire::roce::DEFAULT_PKEY,
            qpn_base: vm.qpn_base,
            qpn_count: vm.qpn_count,
            max_entries: quota,
            name: vm.name.clone(),
            active_mtu: link.mtu.unwrap_or(self.shared.path_mtu),
            ca_ack_delay: link.ca_ack_delay.unwrap_or(self.shared.ca_ack_delay),
        };
        let mut payload = [0u8; PORT_INFO_LEN];
        // The buffer has exactly the length emit checks for.
        let _ = info.emit(&mut payload);
        RxMsg::control(MsgType::PortInfo, 0, &payload)
    }

    /// Writes backlogged messages into the driver's rx buffers.
    fn deliver_rx(&mut self, vring: &Vring) {
        let Some(atomic) = self.mem.clone() else {
            return;
        };
        let mem = atomic.memory();
        let mut backlog = self.port.lock_rx();
        if backlog.is_empty() {
            return;
        }
        let mut st = vring.get_mut();
        if !st.is_enabled() || !st.get_queue().ready() {
            return;
        }
        let q = st.get_queue_mut();
        let delivered = fill_rx(q, &mem, self.event_idx, &mut backlog, &self.port.counters);
        drop(backlog);
        let notify = finish_rx(q, &mem, self.event_idx);
        if delivered > 0 {
            self.port.counters.add(Io::RxMessages, delivered);
        }
        if notify {
            if let Err(e) = st.signal_used_queue() {
                tracing::debug!(error = %e, "rx used signal failed");
            }
        }
    }
}

impl VhostUserBackendMut for PvcmDevice {
    type Bitmap = crate::dirty_log::DirtyLog;
    type Vring = Vring;

    fn num_queues(&self) -> usize {
        NUM_QUEUES
    }

    fn max_queue_size(&self) -> usize {
        MAX_QUEUE_SIZE
    }

    fn features(&self) -> u64 {
        device_features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        protocol_features()
    }

    fn set_event_idx(&mut self, enabled: bool) {
        self.event_idx = enabled;
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        config_bytes(offset, size)
    }

    fn update_memory(&mut self, mem: GuestMemoryAtomic<Mem>) -> io::Result<()> {
        self.mem = Some(mem);
        Ok(())
    }

    fn set_device_state_fd(
        &mut self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        file: File,
    ) -> io::Result<Option<File>> {
        let t = if phase != VhostTransferStatePhase::STOPPED {
            Transfer::Failed(MigrationError::Phase(format!("{phase:?}")))
        } else if direction == VhostTransferStateDirection::SAVE {
            match self.shared.migrate_out(&self.port) {
                Ok(blob) => Transfer::Saving(std::thread::spawn(move || {
                    let mut f = file;
                    f.write_all(&blob)
                })),
                Err(e) => Transfer::Failed(e),
            }
        } else {
            Transfer::Loading(std::thread::spawn(move || {
                let mut f = file;
                let mut b = Vec::new();
                // A state is a few MiB at most (64 bytes per entry); a front-end that
                // sends more is not sending pvcm state.
                (&mut f).take(MAX_STATE_BYTES + 1).read_to_end(&mut b)?;
                if b.len() as u64 > MAX_STATE_BYTES {
                    return Err(io::Error::other("device state larger than the limit"));
                }
                Ok(b)
            }))
        };
        if let Transfer::Failed(e) = &t {
            tracing::error!(error = %e, "device state transfer refused");
        }
        *lock(&self.transfer) = Some(t);
        Ok(None)
    }

    fn check_device_state(&self) -> io::Result<()> {
        let t = lock(&self.transfer).take();
        let r = match t {
            None => Err(MigrationError::NotStarted),
            Some(Transfer::Failed(e)) => Err(e),
            Some(Transfer::Saving(h)) => match h.join() {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(MigrationError::Write(e)),
                Err(_) => Err(MigrationError::WriterPanicked),
            },
            Some(Transfer::Loading(h)) => match h.join() {
                Ok(Ok(blob)) => self.shared.migrate_in(&self.port, &blob).map(|_| ()),
                Ok(Err(e)) => Err(MigrationError::Read(e)),
                Err(_) => Err(MigrationError::ReaderPanicked),
            },
        };
        r.map_err(|e| {
            tracing::error!(error = %e, "device state transfer failed");
            io::Error::other(e)
        })
    }

    fn reset_device(&mut self) {
        tracing::info!("device reset: releasing the VM's connections");
        self.shared.reset_vm(&self.port);
    }

    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        Some((
            self.exit_consumer.try_clone().ok()?,
            self.exit_notifier.try_clone().ok()?,
        ))
    }

    fn handle_event(
        &mut self,
        device_event: u16,
        _evset: EventSet,
        vrings: &[Vring],
        _thread_id: usize,
    ) -> io::Result<()> {
        let port = self.port.clone();
        let _span = port.span.enter();
        let [tx, rx] = vrings else {
            return Ok(());
        };
        if device_event <= 1 {
            self.vm_runs_here();
        }
        match device_event {
            0 => self.process_tx(tx, rx),
            1 => self.deliver_rx(rx),
            RX_WAKE_EVENT => {
                let _ = self.port.rx_wake.read();
                self.deliver_rx(rx);
            }
            _ => {}
        }
        // Errors of single messages are counted drops; the queue keeps working.
        Ok(())
    }
}

/// The device's descriptor-chain walks, for the fuzz targets in `fuzz/`. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;
    use crate::stats::DevDrop;

    /// Reads one tx chain as the device does: the message's bytes, or the counted drop.
    pub fn read_tx_chain<M>(mem: &Mem, chain: DescriptorChain<M>) -> Result<Vec<u8>, DevDrop>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        read_chain(mem, chain).map(|m| {
            let mut v = m.head.to_vec();
            v.extend_from_slice(&m.mad);
            v.truncate(m.len);
            v
        })
    }

    /// Writes `bytes` into one rx chain as the device does, or says why it could not.
    pub fn write_rx_chain<M>(
        mem: &Mem,
        chain: DescriptorChain<M>,
        bytes: &[u8],
    ) -> Result<(), DevDrop>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        write_chain(mem, chain, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_space_reads() {
        assert_eq!(config_bytes(0, 8), abi::config_space().to_vec());
        assert_eq!(config_bytes(4, 4), 1u32.to_le_bytes().to_vec());
        assert_eq!(config_bytes(6, 6), vec![0, 0, 0, 0, 0, 0]);
        assert_eq!(config_bytes(100, 4), vec![0; 4]);
        assert_eq!(config_bytes(0, 4096).len(), 256);
        let f = device_features();
        assert_ne!(f & (1 << VIRTIO_F_VERSION_1), 0);
        assert_ne!(f & (1 << VIRTIO_RING_F_EVENT_IDX), 0);
        assert_ne!(f & (1 << VIRTIO_RING_F_INDIRECT_DESC), 0);
    }

    #[test]
    fn status_mapping() {
        assert_eq!(send_status(DropReason::SpoofedQpn), SendStatus::Spoofed);
        assert_eq!(
            send_status(DropReason::NoRoute),
            SendStatus::UnknownConnection
        );
        assert_eq!(send_status(DropReason::OverQuota), SendStatus::NoResources);
    }
}

#[cfg(test)]
mod throttle_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_flooding_guest_is_paused_more_each_round_and_a_clean_round_ends_it() {
        let mut t = TxThrottle::default();
        assert_eq!(t.after_round(THROTTLE_BAD_PER_ROUND - 1), None);
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(t.after_round(THROTTLE_BAD_PER_ROUND), ms(1));
        assert_eq!(t.after_round(256), ms(2));
        assert_eq!(t.after_round(256), ms(4));
        for _ in 0..10 {
            t.after_round(256);
        }
        assert_eq!(t.after_round(256), ms(16));
        assert_eq!(t.after_round(0), None);
        assert_eq!(t.after_round(THROTTLE_BAD_PER_ROUND), ms(1));
    }
}

/// The device's queue handling against virtio-queue's mock split queues: the tx round
/// ([`take_tx_round`] + [`PvcmDevice::handle_tx`]) and the rx fill ([`fill_rx`]), with a
/// real mux behind a wire port that records what it is given.
#[cfg(test)]
mod queue_tests {
    use super::*;
    use std::collections::HashMap;
    use std::net::Ipv4Addr;
    use std::os::fd::RawFd;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    use pvcm_wire::Gid;
    use pvcm_wire::mad::AttributeId;
    use pvcm_wire::testing;
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;
    use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

    use crate::backlog::{self, HostBudget};
    use crate::config::VmSpec;
    use crate::mux::{Mux, MuxConfig, SystemClock, VmConfig};
    use crate::port::{PortCtx, WirePort};
    use crate::shared::Core;

    const QSIZE: u16 = 16;
    /// Message buffers start here (the queue's rings sit below).
    const DATA: u64 = 0x1000;
    const MEM_LEN: usize = 0x10000;

    type Sent = Arc<Mutex<Vec<(usize, Gid, [u8; MAD_LEN])>>>;

    /// A wire port that records what it is asked to send.
    #[derive(Debug)]
    struct Recorder(Sent);

    impl WirePort for Recorder {
        fn rx_mode(&self) -> String {
            "test".into()
        }
        fn poll_fds(&self) -> Vec<(RawFd, u64)> {
            Vec::new()
        }
        fn attach(&self, _vm: usize) -> Result<(), crate::port::PortError> {
            Ok(())
        }
        fn send(&self, _ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]) {
            let mut sent = self.0.lock().unwrap();
            sent.extend(mads.iter().map(|(g, m)| (vm, *g, **m)));
        }
        fn receive(
            &self,
            _ctx: &PortCtx<'_>,
            _token: u64,
            _route: &mut dyn FnMut(crate::port::Arrivals),
        ) {
        }
    }

    /// One attached VM's device over 64 KiB of guest memory.
    struct Rig {
        dev: PvcmDevice,
        port: Arc<VmPort>,
        vm: VmConfig,
        sent: Sent,
        mem: Mem,
    }

    fn rig() -> Rig {
        let vm = VmConfig::new("a", Gid::from_ipv4(Ipv4Addr::new(127, 40, 0, 1)));
        let host = HostBudget::new(backlog::DEFAULT_HOST_BYTES);
        let spec = VmSpec {
            socket: "/nonexistent/a.sock".into(),
            vm: vm.clone(),
            incoming: false,
            iface: None,
        };
        let port = Arc::new(VmPort::new(0, spec, backlog::DEFAULT_VM_BYTES, host).unwrap());
        let sent = Sent::default();
        let cfg = MuxConfig {
            seed: 1,
            ..MuxConfig::default()
        };
        let shared = Arc::new(Shared {
            default_quota: cfg.default_quota,
            path_mtu: abi::MTU_2048,
            ca_ack_delay: 7,
            core: Mutex::new(Core {
                mux: Mux::new(cfg, SystemClock::new()),
                by_vm: HashMap::new(),
                journal: None,
            }),
            vms: crate::vm_port::VmTable::new(crate::vm_port::VmSet::new(vec![port.clone()])),
            runtime: Mutex::new(crate::runtime::Runtime {
                rx_backlog_bytes: backlog::DEFAULT_VM_BYTES,
                host_budget: HostBudget::new(backlog::DEFAULT_HOST_BYTES),
                vm_sockets: crate::config::SocketAccess::VM_DEFAULT,
                control: None,
                state_dir: None,
                epoll: Arc::new(vmm_sys_util::epoll::Epoll::new().unwrap()),
                threads: HashMap::new(),
                file_vms: Vec::new(),
                overlay: Default::default(),
            }),
            capture: None,
            timer_wake: EventFd::new(EFD_NONBLOCK).unwrap(),
            armed: AtomicU64::new(u64::MAX),
            policy: "default".into(),
            port: Box::new(Recorder(sent.clone())),
            port_counters: DevCounters::default(),
            retired: DevCounters::default(),
            stop: AtomicBool::new(false),
            keeps_state: false,
        });
        assert!(shared.attach(&port).is_some());
        let dev = PvcmDevice::new(shared, port.clone()).unwrap();
        let mem = Mem::from_ranges(&[(GuestAddress(0), MEM_LEN)]).unwrap();
        Rig {
            dev,
            port,
            vm,
            sent,
            mem,
        }
    }

    /// One descriptor: guest address, length, device-writable.
    #[derive(Debug, Clone, Copy)]
    struct D(u64, u32, bool);

    /// Posts `chains` (descriptor table from index 0, one avail entry per chain).
    fn post(mock: &MockSplitQueue<'_, Mem>, chains: &[Vec<D>]) -> Queue {
        let mut raw = Vec::new();
        for chain in chains {
            for (i, &D(addr, len, write)) in chain.iter().enumerate() {
                let idx = raw.len() as u16;
                let last = i + 1 == chain.len();
                let mut flags = 0;
                if write {
                    flags |= VRING_DESC_F_WRITE as u16;
                }
                if !last {
                    flags |= VRING_DESC_F_NEXT as u16;
                }
                let next = if last { 0 } else { idx + 1 };
                raw.push(RawDescriptor::from(SplitDescriptor::new(
                    addr, len, flags, next,
                )));
            }
        }
        mock.add_desc_chains(&raw, 0).unwrap();
        mock.create_queue::<Queue>().unwrap()
    }

    /// Writes a tx message (header + payload) at `addr`; returns its length.
    fn put(mem: &Mem, addr: u64, h: &MsgHeader, payload: &[u8]) -> u32 {
        let b = pvcm_wire::testing::message(h, payload);
        mem.write_slice(&b, GuestAddress(addr)).unwrap();
        b.len() as u32
    }

    /// A chain of one readable descriptor holding `h` + `payload` in slot `slot`.
    fn msg_chain(mem: &Mem, slot: u64, h: &MsgHeader, payload: &[u8]) -> Vec<D> {
        let addr = DATA + slot * 0x200;
        vec![D(addr, put(mem, addr, h, payload), false)]
    }

    /// Runs one tx round over `chains`; checks every head came back; returns how many
    /// messages the round dropped.
    fn tx(r: &mut Rig, chains: &[Vec<D>]) -> usize {
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        let mut q = post(&mock, chains);
        let (msgs, heads) = take_tx_round(&mut q, &&r.mem, false, &r.port.counters);
        assert_eq!(msgs.len(), chains.len());
        // Nothing is returned before the messages were handled.
        assert_eq!(mock.used().idx().load(), 0);
        let bad = r.dev.handle_tx(msgs, q.next_avail());
        assert!(return_tx_round(&mut q, &&r.mem, &heads));
        assert_eq!(mock.used().idx().load(), chains.len() as u16);
        bad
    }

    #[test]
    fn after_a_restart_chains_whose_mads_left_are_returned_unsent() {
        let r = rig();
        let vm = r.vm.clone();
        let chains: Vec<Vec<D>> = (0..3u64)
            .map(|i| {
                let h = MsgHeader::mad(remote());
                msg_chain(&r.mem, i, &h, &good_req(&vm))
            })
            .collect();
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        let mut q = post(&mock, &chains);
        // The journal says the ring was consumed up to index 2: chains 0 and 1 left.
        assert_eq!(skip_resumed(&mut q, &&r.mem, 2), 2);
        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!(q.next_avail(), 2);
        // Only chain 2 is read and sent.
        let (msgs, _) = take_tx_round(&mut q, &&r.mem, false, &r.port.counters);
        assert_eq!(msgs.len(), 1);
        // A resume index behind the ring, or more than a ring ahead, skips nothing.
        assert_eq!(skip_resumed(&mut q, &&r.mem, 1), 0);
        assert_eq!(skip_resumed(&mut q, &&r.mem, 3 + QSIZE + 1), 0);
        assert_eq!(skip_resumed(&mut q, &&r.mem, 3), 0);
    }

    fn remote() -> Gid {
        Gid::from_ipv4(Ipv4Addr::new(127, 40, 0, 9))
    }

    fn good_req(vm: &VmConfig) -> [u8; MAD_LEN] {
        testing::req(vm.gid, vm.ca_guid, 0x1111, 7, remote(), vm.qpn_base + 1)
    }

    /// What the device queued for the VM's rx, in order.
    fn rx_queued(r: &Rig) -> Vec<(MsgHeader, Vec<u8>)> {
        let mut b = r.port.lock_rx();
        let mut out = Vec::new();
        while let Some(m) = b.pop_front() {
            let h = MsgHeader::parse(&m.bytes()[..HEADER_LEN]).unwrap();
            out.push((h, m.bytes()[HEADER_LEN..].to_vec()));
        }
        out
    }

    fn dropped(r: &Rig, d: DevDrop) -> u64 {
        r.port.counters.dropped(d)
    }

    #[test]
    fn a_good_mad_goes_to_the_wire_through_the_mux() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        let chain = msg_chain(&r.mem, 0, &MsgHeader::mad(remote()), &mad);
        assert_eq!(tx(&mut r, &[chain]), 0);
        let sent = r.sent.lock().unwrap().clone();
        assert_eq!(sent.len(), 1);
        let (vm, dst, out) = sent[0];
        assert_eq!((vm, dst), (0, remote()));
        assert_eq!(testing::attr(&out), Some(AttributeId::Req));
        // The mux rewrote the comm ID and the TID.
        assert_ne!(out, mad);
        assert_eq!(r.port.counters.io(Io::TxMessages), 1);
        assert_eq!(r.port.counters.io(Io::SendErrors), 0);
        assert!(rx_queued(&r).is_empty());
    }

    #[test]
    fn a_mad_split_over_descriptors_is_read_whole() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        let len = put(&r.mem, DATA, &MsgHeader::mad(remote()), &mad);
        let chain = vec![
            D(DATA, 10, false),
            D(DATA + 10, HEADER_LEN as u32, false),
            D(
                DATA + 10 + HEADER_LEN as u64,
                len - 10 - HEADER_LEN as u32,
                false,
            ),
        ];
        assert_eq!(tx(&mut r, &[chain]), 0);
        assert_eq!(r.sent.lock().unwrap().len(), 1);
    }

    #[test]
    fn truncated_messages_are_counted() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        // Shorter than a header.
        let short = vec![D(DATA, (HEADER_LEN - 1) as u32, false)];
        // A header that promises a whole MAD, and 100 bytes of it.
        let cut = {
            let addr = DATA + 0x200;
            put(&r.mem, addr, &MsgHeader::mad(remote()), &mad);
            vec![D(addr, (HEADER_LEN + 100) as u32, false)]
        };
        assert_eq!(tx(&mut r, &[short, cut]), 2);
        assert_eq!(dropped(&r, DevDrop::Truncated), 2);
        assert!(r.sent.lock().unwrap().is_empty());
        assert!(rx_queued(&r).is_empty());
    }

    #[test]
    fn oversize_messages_and_chains_are_counted() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        // A header whose length exceeds the largest payload.
        let h = MsgHeader {
            len: (pvcm_wire::abi::MAX_PAYLOAD + 1) as u32,
            ..MsgHeader::mad(remote())
        };
        let big_header = msg_chain(&r.mem, 0, &h, &mad);
        // A chain longer than any message.
        let long = vec![
            D(DATA + 0x400, RX_BUFFER_LEN as u32, false),
            D(DATA + 0x800, 1, false),
        ];
        assert_eq!(tx(&mut r, &[big_header, long]), 2);
        assert_eq!(dropped(&r, DevDrop::Oversize), 1);
        assert_eq!(dropped(&r, DevDrop::ChainTooLong), 1);
        assert!(r.sent.lock().unwrap().is_empty());
    }

    #[test]
    fn unknown_and_device_to_driver_types_are_counted() {
        let mut r = rig();
        let unknown = pvcm_wire::testing::raw_header(0xBEEF, MAD_LEN as u32);
        r.mem.write_slice(&unknown, GuestAddress(DATA)).unwrap();
        let unknown = vec![D(DATA, HEADER_LEN as u32, false)];
        let port_info = msg_chain(
            &r.mem,
            1,
            &MsgHeader::control(MsgType::PortInfo, PORT_INFO_LEN as u32),
            &[0; PORT_INFO_LEN],
        );
        assert_eq!(tx(&mut r, &[unknown, port_info]), 2);
        assert_eq!(dropped(&r, DevDrop::UnknownType), 2);
        assert!(rx_queued(&r).is_empty());
    }

    #[test]
    fn bad_addresses_and_device_writable_descriptors_are_counted() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        let outside = vec![D(MEM_LEN as u64 + 0x1000, 64, false)];
        let across_the_end = vec![D(MEM_LEN as u64 - 16, 64, false)];
        let mut writable = msg_chain(&r.mem, 0, &MsgHeader::mad(remote()), &mad);
        writable[0].2 = true;
        assert_eq!(tx(&mut r, &[outside, across_the_end, writable]), 3);
        assert_eq!(dropped(&r, DevDrop::BadAddress), 2);
        assert_eq!(dropped(&r, DevDrop::WrongDirection), 1);
        assert!(r.sent.lock().unwrap().is_empty());
    }

    #[test]
    fn bad_mads_come_back_as_send_errors_and_port_info_is_answered() {
        let mut r = rig();
        let mut not_cm = good_req(&r.vm);
        not_cm[1] = 0x04;
        let chains = [
            msg_chain(&r.mem, 0, &MsgHeader::mad(remote()), &not_cm),
            // A MAD message of 100 bytes.
            msg_chain(
                &r.mem,
                1,
                &MsgHeader {
                    len: 100,
                    ..MsgHeader::mad(remote())
                },
                &good_req(&r.vm)[..100],
            ),
            msg_chain(
                &r.mem,
                2,
                &MsgHeader::control(MsgType::PortInfoRequest, 0),
                &[],
            ),
        ];
        assert_eq!(tx(&mut r, &chains), 2);
        assert_eq!(dropped(&r, DevDrop::NotCm), 1);
        assert_eq!(dropped(&r, DevDrop::BadMadLength), 1);
        assert_eq!(r.port.counters.io(Io::SendErrors), 2);
        let rx = rx_queued(&r);
        assert_eq!(rx.len(), 3);
        assert_eq!(rx[0].0.msg_type, MsgType::SendError);
        assert_eq!(rx[0].0.status, SendStatus::Malformed as u16);
        assert_eq!(rx[0].1, not_cm.to_vec());
        assert_eq!(rx[1].0.msg_type, MsgType::SendError);
        assert_eq!(rx[2].0.msg_type, MsgType::PortInfo);
        let info = PortInfo::parse(&rx[2].1).unwrap();
        assert_eq!((info.gid, info.ca_guid), (r.vm.gid, r.vm.ca_guid));
        // A port that cannot tell the link's values: the configured ones.
        assert_eq!((info.active_mtu, info.ca_ack_delay), (abi::MTU_2048, 7));
    }

    #[test]
    fn one_round_of_every_kind_leaves_the_good_mad_through() {
        let mut r = rig();
        let mad = good_req(&r.vm);
        let mut writable = msg_chain(&r.mem, 1, &MsgHeader::mad(remote()), &mad);
        writable[0].2 = true;
        let chains = [
            vec![D(DATA + 0x400, 8, false)],
            writable,
            vec![D(1 << 40, 64, false)],
            msg_chain(&r.mem, 0, &MsgHeader::mad(remote()), &mad),
        ];
        assert_eq!(tx(&mut r, &chains), 3);
        assert_eq!(r.sent.lock().unwrap().len(), 1);
        assert_eq!(r.port.counters.io(Io::TxMessages), 4);
    }

    /// Runs the rx fill over `buffers`; returns how many messages were delivered.
    fn rx(r: &Rig, mock: &MockSplitQueue<'_, Mem>, buffers: &[Vec<D>]) -> u64 {
        let mut q = post(mock, buffers);
        let mut backlog = r.port.lock_rx();
        let n = fill_rx(&mut q, &&r.mem, false, &mut backlog, &r.port.counters);
        drop(backlog);
        assert!(finish_rx(&mut q, &&r.mem, false));
        n
    }

    #[test]
    fn rx_writes_a_backlogged_message_into_a_posted_buffer() {
        let r = rig();
        let mad = good_req(&r.vm);
        let msg = RxMsg::mad(remote(), &mad);
        assert!(r.port.push_rx(msg.clone()));
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        // Header and MAD in two device-writable descriptors.
        let buf = vec![
            D(DATA, HEADER_LEN as u32, true),
            D(DATA + 0x100, MAD_LEN as u32, true),
        ];
        assert_eq!(rx(&r, &mock, &[buf]), 1);
        let mut got = vec![0u8; RX_BUFFER_LEN];
        r.mem
            .read_slice(&mut got[..HEADER_LEN], GuestAddress(DATA))
            .unwrap();
        r.mem
            .read_slice(&mut got[HEADER_LEN..], GuestAddress(DATA + 0x100))
            .unwrap();
        assert_eq!(&got[..msg.len()], msg.bytes());
        let h = MsgHeader::parse(&got[..HEADER_LEN]).unwrap();
        assert_eq!((h.msg_type, h.remote_gid), (MsgType::Mad, remote()));
        assert_eq!(&got[HEADER_LEN..], &mad[..]);
        assert_eq!(mock.used().idx().load(), 1);
        let used = mock.used().ring().ref_at(0).unwrap().load();
        assert_eq!((used.id(), used.len()), (0, msg.len() as u32));
        assert!(r.port.lock_rx().is_empty());
    }

    #[test]
    fn rx_skips_a_bad_buffer_and_keeps_what_has_no_buffer() {
        let r = rig();
        for tid in 0..3 {
            let mad = testing::req(r.vm.gid, r.vm.ca_guid, 1, tid, remote(), 0x10001);
            assert!(r.port.push_rx(RxMsg::mad(remote(), &mad)));
        }
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        let buffers = [
            // Driver-readable: not a buffer the device may write.
            vec![D(DATA, RX_BUFFER_LEN as u32, false)],
            // Too small for the message.
            vec![D(DATA + 0x200, 64, true)],
            vec![D(DATA + 0x400, RX_BUFFER_LEN as u32, true)],
        ];
        assert_eq!(rx(&r, &mock, &buffers), 1);
        assert_eq!(dropped(&r, DevDrop::RxBadBuffer), 2);
        // Every buffer came back; the two bad ones empty.
        assert_eq!(mock.used().idx().load(), 3);
        let lens: Vec<u32> = (0..3)
            .map(|i| mock.used().ring().ref_at(i).unwrap().load().len())
            .collect();
        assert_eq!(lens, [0, 0, RX_BUFFER_LEN as u32]);
        // The first message went into the good buffer; two wait for more.
        assert_eq!(r.port.lock_rx().len(), 2);
    }
}

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

use std::io;
use std::ops::Deref;
use std::sync::Arc;

use pvcm_wire::Gid;
use pvcm_wire::abi::{
    self, HEADER_LEN, MsgHeader, MsgType, PORT_INFO_LEN, PortInfo, RX_BUFFER_LEN, SendStatus,
};
use pvcm_wire::mad::{MAD_LEN, MGMT_CLASS_CM};
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackendMut, VringRwLock, VringT};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddressSpace, GuestMemory, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    EventConsumer, EventFlag, EventNotifier, new_event_consumer_and_notifier,
};

use crate::mux::{DropReason, GuestVerdict};
use crate::rx::RxMsg;
use crate::shared::Shared;
use crate::stats::{DevDrop, Io};
use crate::vm_port::VmPort;

/// Queues: tx and rx.
pub const NUM_QUEUES: usize = 2;
/// Largest queue size the device accepts (any size up to this works).
pub const MAX_QUEUE_SIZE: usize = 1024;
/// `handle_event` id of the VM's rx-wake eventfd (0, 1 are the queues; 2 is reserved for
/// the exit event by vhost-user-backend).
pub const RX_WAKE_EVENT: u16 = 3;
/// Chains taken from the tx queue per round (then the used ring is published).
const TX_ROUND: usize = 256;
/// The active MTU PORT_INFO reports (IBTA code): 1024 bytes, rdma_cm's RoCE default, until
/// the daemon's configuration names the link's own (Linux takes it from the netdev).
pub const PORT_ACTIVE_MTU: u8 = abi::MTU_1024;
/// The local CA ACK delay PORT_INFO reports (5-bit exponent): 15, what rdma_rxe reports
/// (`RXE_LOCAL_CA_ACK_DELAY`), the software RoCE device the soft port stands in for.
pub const PORT_CA_ACK_DELAY: u8 = 15;
/// The `VHOST_USER_F_PROTOCOL_FEATURES` feature bit.
const VHOST_USER_F_PROTOCOL_FEATURES: u64 = 1 << 30;

type Mem = GuestMemoryMmap<()>;

/// Virtio features the device offers.
pub fn device_features() -> u64 {
    (1 << VIRTIO_F_VERSION_1)
        | (1 << VIRTIO_RING_F_EVENT_IDX)
        | (1 << VIRTIO_RING_F_INDIRECT_DESC)
        | VHOST_USER_F_PROTOCOL_FEATURES
}

/// vhost-user protocol features the device offers.
pub fn protocol_features() -> VhostUserProtocolFeatures {
    VhostUserProtocolFeatures::CONFIG
        | VhostUserProtocolFeatures::MQ
        | VhostUserProtocolFeatures::REPLY_ACK
        | VhostUserProtocolFeatures::RESET_DEVICE
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

/// A tx message as read from its chain.
struct TxMsg {
    buf: [u8; RX_BUFFER_LEN],
    len: usize,
}

/// Reads one tx chain into a buffer, checking it on the way.
fn read_chain<M>(mem: &Mem, chain: DescriptorChain<M>) -> Result<TxMsg, DevDrop>
where
    M: Deref,
    M::Target: GuestMemory,
{
    let mut msg = TxMsg {
        buf: [0; RX_BUFFER_LEN],
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
        mem.read_slice(&mut msg.buf[msg.len..msg.len + dl], desc.addr())
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
        })
    }

    /// Takes every available tx chain, handles the messages, publishes the used ring.
    fn process_tx(&mut self, vring: &VringRwLock, rx: &VringRwLock) {
        let Some(atomic) = self.mem.clone() else {
            return;
        };
        let mem = atomic.memory();
        loop {
            let mut msgs = Vec::new();
            {
                let mut st = vring.get_mut();
                let q = st.get_queue_mut();
                if self.event_idx {
                    let _ = q.disable_notification(&*mem);
                }
                let mut heads = Vec::new();
                match q.iter(mem.clone()) {
                    Ok(iter) => {
                        for chain in iter {
                            heads.push(chain.head_index());
                            msgs.push(read_chain(&mem, chain));
                            if heads.len() >= TX_ROUND {
                                break;
                            }
                        }
                    }
                    Err(e) => {
                        // The avail ring itself is inconsistent: nothing to take now.
                        tracing::debug!(error = %e, "tx avail ring unusable");
                        self.port.counters.drop(DevDrop::BadChain);
                    }
                }
                for h in &heads {
                    if q.add_used(&*mem, *h, 0).is_err() {
                        tracing::debug!(head = h, "tx head out of range");
                    }
                }
                let notify = !heads.is_empty() && q.needs_notification(&*mem).unwrap_or(true);
                if notify {
                    if let Err(e) = st.signal_used_queue() {
                        tracing::debug!(error = %e, "tx used signal failed");
                    }
                }
            }
            let full_round = msgs.len() >= TX_ROUND;
            if !msgs.is_empty() {
                let bad = self.handle_tx(msgs);
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

    /// Handles a round of tx messages: one mux lock for all MADs, then I/O.
    /// Handles a round of tx messages: one mux lock for all MADs, then I/O. Returns how
    /// many of them were dropped.
    fn handle_tx(&mut self, msgs: Vec<Result<TxMsg, DevDrop>>) -> usize {
        let port = &self.port;
        let c = &port.counters;
        c.add(Io::TxMessages, msgs.len() as u64);
        let vm = port.current_vm();
        // Messages of this round dropped (by the device or the mux).
        let mut bad = 0usize;
        // (header, MAD as the guest sent it, MAD to rewrite)
        let mut mads: Vec<(MsgHeader, [u8; MAD_LEN], [u8; MAD_LEN])> = Vec::new();
        let mut own_rx: Vec<RxMsg> = Vec::new();
        for m in msgs {
            let m = match m {
                Ok(m) => m,
                Err(r) => {
                    tracing::debug!(reason = r.name(), "tx chain dropped");
                    bad += 1;
                    c.drop(r);
                    continue;
                }
            };
            if m.len < HEADER_LEN {
                bad += 1;
                c.drop(DevDrop::Truncated);
                continue;
            }
            let h = match MsgHeader::parse(&m.buf[..HEADER_LEN]) {
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
                    let payload = &m.buf[HEADER_LEN..HEADER_LEN + len];
                    let reject = if len != MAD_LEN {
                        Some(DevDrop::BadMadLength)
                    } else if payload[1] != MGMT_CLASS_CM {
                        Some(DevDrop::NotCm)
                    } else if h.remote_gid.to_ipv4().is_none() {
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
                    let mut mad = [0u8; MAD_LEN];
                    mad.copy_from_slice(payload);
                    mads.push((h, mad, mad));
                }
                _ => {
                    tracing::debug!(msg_type = ?h.msg_type, "device-to-driver message on tx dropped");
                    bad += 1;
                    c.drop(DevDrop::UnknownType);
                }
            }
        }
        let Some(vm) = vm else {
            self.finish_tx(Vec::new(), own_rx, Vec::new());
            return bad;
        };
        let mut to_wire = Vec::new();
        let outbox;
        {
            let mut bufs: Vec<[u8; MAD_LEN]> = mads.iter().map(|(_, _, m)| *m).collect();
            let dsts: Vec<Gid> = mads.iter().map(|(h, _, _)| h.remote_gid).collect();
            let mut verdicts = vec![GuestVerdict::ToWire; mads.len()];
            let mut core = self.shared.lock_core();
            // One call for the round: the mux prefetches the entries first.
            core.mux
                .from_guest_batch(vm, &mut bufs, &dsts, &mut verdicts);
            for (((h, orig, _), mad), verdict) in mads.iter().zip(bufs).zip(verdicts) {
                match verdict {
                    GuestVerdict::ToWire => to_wire.push((h.remote_gid, mad)),
                    GuestVerdict::Reply => own_rx.push(RxMsg::mad(h.remote_gid, &mad)),
                    GuestVerdict::Drop(r) => {
                        bad += 1;
                        tracing::debug!(reason = r.name(), "tx MAD dropped by the mux");
                        own_rx.push(RxMsg::send_error(h, send_status(r), orig));
                    }
                }
            }
            outbox = core.mux.drain_outbox().collect::<Vec<_>>();
            self.shared.note_deadline(core.mux.next_deadline());
        }
        self.finish_tx(to_wire, own_rx, outbox);
        bad
    }

    fn finish_tx(
        &self,
        to_wire: Vec<(Gid, [u8; MAD_LEN])>,
        own_rx: Vec<RxMsg>,
        outbox: Vec<crate::mux::Outgoing>,
    ) {
        let errors = own_rx
            .iter()
            .filter(|m| m.msg_type() == Some(MsgType::SendError))
            .count();
        self.port.counters.add(Io::SendErrors, errors as u64);
        if !to_wire.is_empty() {
            self.shared.send_mads(&self.port, &to_wire);
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
        let quota = vm.quota.unwrap_or(self.shared.default_quota());
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
            active_mtu: PORT_ACTIVE_MTU,
            ca_ack_delay: PORT_CA_ACK_DELAY,
        };
        let mut payload = [0u8; PORT_INFO_LEN];
        // The buffer has exactly the length emit checks for.
        let _ = info.emit(&mut payload);
        RxMsg::control(MsgType::PortInfo, 0, &payload)
    }

    /// Writes backlogged messages into the driver's rx buffers.
    fn deliver_rx(&mut self, vring: &VringRwLock) {
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
        let mut delivered = 0u64;
        let q = st.get_queue_mut();
        while let Some(msg) = backlog.front() {
            let Some(chain) = q.pop_descriptor_chain(mem.clone()) else {
                if self.event_idx && q.enable_notification(&*mem).unwrap_or(false) {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            match write_chain(&mem, chain, msg.bytes()) {
                Ok(()) => {
                    let _ = q.add_used(&*mem, head, msg.len() as u32);
                    backlog.pop_front();
                    delivered += 1;
                }
                Err(r) => {
                    self.port.counters.drop(r);
                    let _ = q.add_used(&*mem, head, 0);
                }
            }
        }
        drop(backlog);
        if self.event_idx {
            // Ask for a kick when the driver posts buffers (the backlog may refill).
            let _ = q.enable_notification(&*mem);
        }
        let notify = q.needs_notification(&*mem).unwrap_or(true);
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
    type Bitmap = ();
    type Vring = VringRwLock;

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
        vrings: &[VringRwLock],
        _thread_id: usize,
    ) -> io::Result<()> {
        let port = self.port.clone();
        let _span = port.span.enter();
        let [tx, rx] = vrings else {
            return Ok(());
        };
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
        read_chain(mem, chain).map(|m| m.buf[..m.len].to_vec())
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

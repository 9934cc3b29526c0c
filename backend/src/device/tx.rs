//! Tx: a round of the driver's messages checked and handled under one mux lock (MADs to
//! the wire or back as send errors, port-info requests answered), then the I/O; and the
//! throttle that slows a guest flooding bad input.

use pvcm_wire::abi::{self, HEADER_LEN, MsgHeader, MsgType, PortInfo, SendStatus};
use pvcm_wire::mad::{MAD_LEN, MGMT_CLASS_CM};
use vhost_user_backend::VringT;
use virtio_queue::QueueT;
use vm_memory::GuestAddressSpace;

use super::queue::*;
use super::{PvcmDevice, Vring};
use crate::mux::{DropReason, GuestVerdict};
use crate::port::OutMad;
use crate::rx::RxMsg;
use crate::stats::{DevDrop, Io};

/// What a mux verdict on a tx MAD turns into.
pub(super) fn send_status(r: DropReason) -> SendStatus {
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
    /// Takes every available tx chain, handles the messages, publishes the used ring.
    pub(super) fn process_tx(&mut self, vring: &Vring, rx: &Vring) {
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
    pub(super) fn handle_tx(
        &mut self,
        mut msgs: Vec<Result<TxMsg, DevDrop>>,
        next_avail: u16,
    ) -> usize {
        let port = &self.port;
        let c = &port.counters;
        c.add(Io::TxMessages, msgs.len() as u64);
        let starts = msgs.iter().flatten().any(|m| {
            MsgHeader::parse(&m.head).is_ok_and(|h| h.msg_type == MsgType::PortInfoRequest)
        });
        if starts {
            self.shared.driver_started(port);
        }
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
                    if let Some(r) = mad_reject(&h, len, payload, &port.spec.vm, vm.is_some()) {
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
                    tracing::debug!(
                        dst = %h.remote_gid,
                        mad = %crate::rx::describe_mad(&m.mad),
                        reason = r.name(),
                        "tx MAD dropped by the mux"
                    );
                    // The mux leaves a MAD it refuses untouched: echoed as the VM sent it.
                    own_rx.push(RxMsg::send_error(h, send_status(r), &m.mad));
                }
            }
        }
        self.finish_tx(&to_wire, own_rx, outbox);
        bad
    }

    pub(super) fn finish_tx(
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

    pub(super) fn port_info(&self) -> RxMsg {
        let vm = &self.port.spec.vm;
        let quota = self.port.quota().unwrap_or(self.shared.default_quota());
        // The path values of the VM's own link (its MTU) where the port can tell them,
        // else the configured ones (--path-mtu, --ca-ack-delay).
        let link = self.shared.port.link(self.port.index);
        let info = PortInfo {
            abi_version: abi::ABI_VERSION,
            port_up: true,
            gid: vm.gid,
            more_gids: vm.more_gids.clone(),
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
        let mut payload = [0u8; abi::PORT_INFO_MAX_LEN];
        let len = info.record_len().min(payload.len());
        // The buffer holds the longest record, and a VM has at most MAX_GIDS GIDs (its
        // configuration is checked), so emit cannot fail.
        let _ = info.emit(&mut payload);
        RxMsg::control(MsgType::PortInfo, 0, &payload[..len])
    }
}

/// Why the device refuses a MAD the VM sent (`len` bytes, `payload`), before the mux
/// sees it: not a MAD's length, not the CM's class, a destination no datagram from the
/// VM's address (`own`) can reach, or no VM attached.
fn mad_reject(
    h: &MsgHeader,
    len: usize,
    payload: &[u8],
    own: &crate::mux::VmConfig,
    attached: bool,
) -> Option<DevDrop> {
    if len != MAD_LEN {
        Some(DevDrop::BadMadLength)
    } else if pvcm_wire::mad::field::MGMT_CLASS.get(payload) != u64::from(MGMT_CLASS_CM) {
        Some(DevDrop::NotCm)
    } else if h.remote_gid.roce_unicast_problem().is_some()
        || h.remote_gid.to_ipv4().is_some() != own.source_for(h.remote_gid).to_ipv4().is_some()
    {
        // Not a unicast RoCE address, or an IP family none of the VM's addresses has: no
        // datagram from the VM's addresses can carry it.
        Some(DevDrop::BadRemoteGid)
    } else if !attached {
        Some(DevDrop::NotAttached)
    } else {
        None
    }
}

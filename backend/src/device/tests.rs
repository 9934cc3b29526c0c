//! The device's unit tests: config space, send statuses, the tx throttle, and the
//! queue work through virtio-queue's `MockSplitQueue`.

use std::sync::Arc;

use pvcm_wire::abi::{
    self, HEADER_LEN, MsgHeader, MsgType, PORT_INFO_LEN, PortInfo, RX_BUFFER_LEN, SendStatus,
};
use pvcm_wire::mad::MAD_LEN;
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

use super::queue::*;
use super::tx::*;
use super::*;
use crate::mux::DropReason;
use crate::port::OutMad;
use crate::rx::RxMsg;
use crate::stats::{DevCounters, DevDrop, Io};

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
    use vhost_user_backend::VringT;
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
        fn claim(&self, _vm: usize) -> Result<bool, crate::port::PortError> {
            Ok(false)
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
        rig_with(VmConfig::new(
            "a",
            Gid::from_ipv4(Ipv4Addr::new(127, 40, 0, 1)),
        ))
    }

    /// A device for the VM `vm`, attached.
    fn rig_with(vm: VmConfig) -> Rig {
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
            capture: None,
            timer_wake: EventFd::new(EFD_NONBLOCK).unwrap(),
            armed: AtomicU64::new(u64::MAX),
            policy: "default".into(),
            port: Box::new(Recorder(sent.clone())),
            port_counters: DevCounters::default(),
            retired: DevCounters::default(),
            stop: AtomicBool::new(false),
            keeps_state: false,
            reloads: Default::default(),
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
        add_chains(mock, chains, 0);
        mock.create_queue::<Queue>().unwrap()
    }

    /// Writes `chains` into the mock's descriptor table from index `first` and makes
    /// them available.
    fn add_chains(mock: &MockSplitQueue<'_, Mem>, chains: &[Vec<D>], first: u16) {
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
                let next = if last { 0 } else { first + idx + 1 };
                raw.push(RawDescriptor::from(SplitDescriptor::new(
                    addr, len, flags, next,
                )));
            }
        }
        mock.add_desc_chains(&raw, first).unwrap();
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
    fn a_vm_with_two_gids_learns_both_and_speaks_as_either_only() {
        let v6: Gid = "2001:db8::40".parse().unwrap();
        let vm = VmConfig {
            more_gids: vec![v6],
            ..VmConfig::new("a", Gid::from_ipv4(Ipv4Addr::new(127, 40, 0, 1)))
        };
        let mut r = rig_with(vm);
        let peer6: Gid = "2001:db8::9".parse().unwrap();
        let (ca, q) = (r.vm.ca_guid, r.vm.qpn_base);
        let from_v6 = testing::req(v6, ca, 0x2222, 8, peer6, q + 2);
        let theirs: Gid = "2001:db8::41".parse().unwrap();
        let from_theirs = testing::req(theirs, ca, 0x3333, 9, peer6, q + 3);
        let chains = [
            msg_chain(
                &r.mem,
                0,
                &MsgHeader::control(MsgType::PortInfoRequest, 0),
                &[],
            ),
            msg_chain(&r.mem, 1, &MsgHeader::mad(peer6), &from_v6),
            msg_chain(&r.mem, 2, &MsgHeader::mad(peer6), &from_theirs),
        ];
        assert_eq!(tx(&mut r, &chains), 1);
        let sent = r.sent.lock().unwrap().clone();
        assert_eq!(sent.len(), 1);
        assert_eq!((sent[0].0, sent[0].1), (0, peer6));
        let rx = rx_queued(&r);
        assert_eq!(rx[0].0.msg_type, MsgType::PortInfo);
        assert_eq!(rx[0].1.len(), abi::PORT_INFO_LEN + 16);
        let info = PortInfo::parse(&rx[0].1).unwrap();
        assert_eq!((info.gid, info.more_gids.clone()), (r.vm.gid, vec![v6]));
        assert_eq!(rx[1].0.msg_type, MsgType::SendError);
        assert_eq!(rx[1].0.status, SendStatus::Spoofed as u16);
        // A one-GID IPv4 VM has no address to reach an IPv6 GID from.
        let mut one = rig();
        let m = good_req(&one.vm);
        let chain = msg_chain(&one.mem, 0, &MsgHeader::mad(peer6), &m);
        assert_eq!(tx(&mut one, &[chain]), 1);
        assert_eq!(dropped(&one, DevDrop::BadRemoteGid), 1);
    }

    /// A migration destination takes the state of a VM with its GID list only: another
    /// list (one GID fewer, or another second GID) is another VM's state, refused.
    #[test]
    fn a_migration_destination_whose_vm_has_other_gids_refuses_the_state() {
        let v6: Gid = "2001:db8::40".parse().unwrap();
        let moving = VmConfig {
            more_gids: vec![v6],
            id_range: Some("0x80010000/16".parse().unwrap()),
            quota: Some(1000),
            ..VmConfig::new("a", Gid::from_ipv4(Ipv4Addr::new(127, 40, 0, 1)))
        };
        let src = rig_with(moving.clone());
        let blob = src.dev.shared.migrate_out(&src.port).unwrap();
        let other: Gid = "2001:db8::41".parse().unwrap();
        for more in [vec![], vec![other]] {
            let dst = rig_with(VmConfig {
                more_gids: more.clone(),
                ..moving.clone()
            });
            dst.dev.shared.detach(&dst.port);
            let e = dst.dev.shared.migrate_in(&dst.port, &blob);
            assert!(
                matches!(e, Err(crate::migration::MigrationError::OtherVm { .. })),
                "{more:?}: {e:?}"
            );
        }
        let dst = rig_with(moving);
        dst.dev.shared.detach(&dst.port);
        dst.dev.shared.migrate_in(&dst.port, &blob).unwrap();
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
        assert!(finish_rx(&mut q, &&r.mem));
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

    /// A running rx queue over the mock's rings, as a vhost-user session sets one up:
    /// the vring, its call eventfd, and the ring to publish.
    fn running_rx(
        r: &Rig,
        mock: &MockSplitQueue<'_, Mem>,
        event_idx: bool,
    ) -> (Vring, EventFd, RxRing) {
        use std::os::fd::{FromRawFd, IntoRawFd};
        let mem = vm_memory::GuestMemoryAtomic::new(r.mem.clone());
        let vring = Vring::new(mem.clone(), QSIZE).unwrap();
        vring.set_queue_size(QSIZE);
        vring
            .set_queue_info(
                mock.desc_table_addr().0,
                mock.avail_addr().0,
                mock.used_addr().0,
            )
            .unwrap();
        vring.set_queue_event_idx(event_idx);
        vring.set_queue_ready(true);
        vring.set_enabled(true);
        let call = EventFd::new(EFD_NONBLOCK).unwrap();
        let fd = call.try_clone().unwrap().into_raw_fd();
        // SAFETY: `fd` was just duplicated for this File, which becomes its only owner.
        vring.set_call(Some(unsafe { std::fs::File::from_raw_fd(fd) }));
        let ring = RxRing {
            vring: vring.clone(),
            mem,
            event_idx,
        };
        (vring, call, ring)
    }

    fn push_mads(r: &Rig, n: u64) {
        for tid in 0..n {
            let mad = testing::req(r.vm.gid, r.vm.ca_guid, 1, tid, remote(), 0x10001);
            assert!(r.port.push_rx(RxMsg::mad(remote(), &mad)));
        }
    }

    fn buffers(n: u64) -> Vec<Vec<D>> {
        (0..n)
            .map(|i| vec![D(DATA + i * 0x200, RX_BUFFER_LEN as u32, true)])
            .collect()
    }

    #[test]
    fn routed_mads_go_straight_into_a_published_ring_and_wait_while_it_stops() {
        let r = rig();
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        add_chains(&mock, &buffers(4), 0);
        let (vring, call, ring) = running_rx(&r, &mock, false);
        let _ = r.port.rx_wake.read();
        // No ring published (no session running yet): the VM's worker is woken.
        push_mads(&r, 2);
        r.port.deliver_rx();
        assert_eq!(r.port.rx_wake.read().unwrap(), 1);
        assert_eq!(r.port.lock_rx().len(), 2);
        assert_eq!(mock.used().idx().load(), 0);
        // Published: written on the calling thread, the driver signalled, no wakeup.
        r.port.publish_rx_ring(Some(Arc::new(ring)));
        r.port.deliver_rx();
        assert!(r.port.lock_rx().is_empty());
        assert_eq!(mock.used().idx().load(), 2);
        assert_eq!(call.read().unwrap(), 1);
        assert_eq!(r.port.counters.io(Io::RxMessages), 2);
        assert!(r.port.rx_wake.read().is_err(), "the worker was woken");
        // A queue stopped (GET_VRING_BASE, reset) is not written: the MAD waits.
        vring.set_enabled(false);
        push_mads(&r, 1);
        r.port.deliver_rx();
        assert_eq!((r.port.lock_rx().len(), mock.used().idx().load()), (1, 2));
        vring.set_enabled(true);
        vring.set_queue_ready(false);
        r.port.deliver_rx();
        assert_eq!((r.port.lock_rx().len(), mock.used().idx().load()), (1, 2));
        // Unpublished (the session ended): back to waking the worker.
        r.port.publish_rx_ring(None);
        r.port.deliver_rx();
        assert_eq!(r.port.rx_wake.read().unwrap(), 1);
        assert_eq!(r.port.lock_rx().len(), 1);
    }

    /// The used ring's avail_event (EVENT_IDX): after the ring's entries.
    fn avail_event(r: &Rig, mock: &MockSplitQueue<'_, Mem>) -> u16 {
        let at = mock.used_addr().0 + 4 + 8 * u64::from(QSIZE);
        r.mem.read_obj::<u16>(GuestAddress(at)).unwrap()
    }

    #[test]
    fn with_event_idx_only_a_fill_that_runs_out_of_buffers_asks_for_a_kick() {
        let r = rig();
        let mock = MockSplitQueue::new(&r.mem, QSIZE);
        add_chains(&mock, &buffers(2), 0);
        let (_vring, _call, ring) = running_rx(&r, &mock, true);
        // Sentinel: a value no fill below would write.
        r.mem
            .write_obj(
                0xBEEFu16,
                GuestAddress(mock.used_addr().0 + 4 + 8 * u64::from(QSIZE)),
            )
            .unwrap();
        // Two buffers for one MAD: the backlog empties, no kick is asked for.
        push_mads(&r, 1);
        assert_eq!(ring.deliver(&r.port), 1);
        assert_eq!(avail_event(&r, &mock), 0xBEEF);
        // Three MADs for the one buffer left: the fill runs out and asks to be kicked
        // when the driver makes the next buffer available (avail index 2).
        push_mads(&r, 3);
        assert_eq!(ring.deliver(&r.port), 1);
        assert_eq!(r.port.lock_rx().len(), 2);
        assert_eq!(avail_event(&r, &mock), 2);
        // The driver posts two more: both waiting MADs go in.
        add_chains(&mock, &buffers(2), 2);
        assert_eq!(ring.deliver(&r.port), 2);
        assert!(r.port.lock_rx().is_empty());
        assert_eq!(mock.used().idx().load(), 4);
    }
}

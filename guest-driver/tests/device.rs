//! The device layer (`pvcm_guest::device`) against fake pvcm devices: the device side of
//! `virtio_queue::Queue` over each VM's `vm_memory` guest memory, and a fake host that
//! answers PORT_INFO and copies MADs between the VMs (no mux). Virtual time unless a
//! test says otherwise.
//!
//! - the PORT_INFO handshake (identity, quota, ABI mismatch, a silent device);
//! - two VMs' agents: listen / connect / accept / disconnect / TimeWait / destroy
//!   through the API, with nothing left behind;
//! - SEND_ERROR counted and surfaced; device reset drops every bit of CM state; port
//!   events; PORT_INFO changes after a reset; an ABI change stops the driver;
//! - malformed rx messages are counted drops and the device keeps working;
//! - batching (one kick per pump) and tx backpressure (MADs wait in the outbox);
//! - `run_until` sleeping to the agent's timers;
//! - cmtime client and server on two threads in real time.

#![allow(clippy::unwrap_used)]

#[path = "device_support.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use pvcm_guest::cm::rdma_cm::{
    CmaHdr, EPHEMERAL_PORTS, req_private_data, roce_flow_label, split_private_data, tcp_service_id,
};
use pvcm_guest::cm::{AgentConfig, CmId, ConnectOptions, Event, Group, RejReason, State};
use pvcm_guest::device::cmtime::{self, ClientOptions, Failure, ServerOptions, Step};
use pvcm_guest::device::{
    Device, DeviceError, DeviceEvent, DeviceOptions, Notice, RxDrop, Transport,
};
use pvcm_guest::time::{Clock, ManualClock, SystemClock, Time};
use pvcm_wire::abi::{self, Event as AbiEvent, MsgHeader, MsgType, PortInfo};
use pvcm_wire::mad::{AttributeId, MAD_LEN};
use support::*;
use virtio_queue::QueueT;

type Dev = Device<FakeTransport, ManualClock>;

const PORT: u16 = 7471;

fn opts(seed: u64) -> DeviceOptions {
    DeviceOptions {
        seed,
        ..DeviceOptions::default()
    }
}

fn start(host: &Arc<Mutex<FakeHost>>, clock: &ManualClock, info: PortInfo, size: u16) -> Dev {
    start_with(host, clock, info, size, None)
}

fn start_with(
    host: &Arc<Mutex<FakeHost>>,
    clock: &ManualClock,
    info: PortInfo,
    size: u16,
    configure: Option<fn(&mut AgentConfig)>,
) -> Dev {
    let (t, q) = vm(host, info, size, Some(clock.clone()));
    let o = DeviceOptions {
        configure,
        ..opts(u64::from(size))
    };
    Device::start(t, q, clock.clone(), o).unwrap()
}

/// Two VMs (10.0.0.1 and 10.0.0.2) on one fake host, in virtual time.
struct Net {
    host: Arc<Mutex<FakeHost>>,
    clock: ManualClock,
    a: Dev,
    b: Dev,
    /// Notices each side has seen.
    na: Vec<Notice>,
    nb: Vec<Notice>,
}

impl Net {
    fn new() -> Net {
        Self::with_sizes(64, 64)
    }

    /// Both agents with Linux's DREQ handling (the DREP waits for `disconnect()`).
    fn linux_drep() -> Net {
        Self::build(64, 64, Some(|c: &mut AgentConfig| c.auto_drep = false))
    }

    fn with_sizes(sa: u16, sb: u16) -> Net {
        Self::build(sa, sb, None)
    }

    fn build(sa: u16, sb: u16, configure: Option<fn(&mut AgentConfig)>) -> Net {
        let host = FakeHost::new();
        let clock = ManualClock::new();
        let a = start_with(&host, &clock, port(1), sa, configure);
        let b = start_with(&host, &clock, port(2), sb, configure);
        Net {
            host,
            clock,
            a,
            b,
            na: Vec::new(),
            nb: Vec::new(),
        }
    }

    /// One round: both drivers pump, the host moves messages, notices are collected.
    /// Returns the work done.
    fn round(&mut self) -> usize {
        let now = self.clock.now();
        let pa = self.a.pump(now).unwrap();
        let pb = self.b.pump(now).unwrap();
        let w = self.host.lock().unwrap().step();
        while let Some(n) = self.a.pop_notice() {
            self.na.push(n);
        }
        while let Some(n) = self.b.pop_notice() {
            self.nb.push(n);
        }
        w + pa.rx + pa.tx + pb.rx + pb.tx
    }

    /// Rounds until nothing moves (time stands still).
    fn settle(&mut self) {
        for _ in 0..10_000 {
            if self.round() == 0 && self.round() == 0 {
                return;
            }
        }
        panic!("no quiescence");
    }

    /// Advances virtual time by `ms`, then settles.
    fn advance(&mut self, ms: u64) {
        self.clock.advance_ms(ms);
        self.settle();
    }

    fn take_a(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.na)
    }

    fn take_b(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.nb)
    }

    fn dev(&self, i: usize) -> std::sync::MutexGuard<'_, FakeHost> {
        let _ = i;
        self.host.lock().unwrap()
    }

    /// A connects to B's port; B accepts; both established. Returns (A's id, B's id).
    fn connect(&mut self, listener: CmId, data: &[u8]) -> (CmId, CmId) {
        let hdr = CmaHdr::from_gids(gid(1), gid(2), 0);
        let pd = req_private_data(&hdr, data).unwrap();
        let ida = self
            .a
            .connect(
                gid(2),
                tcp_service_id(PORT),
                &pd,
                &ConnectOptions::default(),
            )
            .unwrap();
        self.settle();
        let idb = self
            .take_b()
            .into_iter()
            .find_map(|n| match n {
                Notice::Cm(Event::ConnectRequest {
                    id,
                    listen_id,
                    remote_gid,
                    private_data,
                    ..
                }) => {
                    assert_eq!(listen_id, listener);
                    assert_eq!(remote_gid, gid(1));
                    let (h, user) = split_private_data(&private_data).unwrap();
                    assert_eq!(h.src, hdr.src);
                    assert_eq!(&user[..data.len()], data);
                    Some(id)
                }
                _ => None,
            })
            .expect("connect request at B");
        self.b.accept(idb, b"welcome").unwrap();
        self.settle();
        assert!(self.take_a().iter().any(|n| matches!(n,
            Notice::Cm(Event::Established { id, private_data, .. })
                if *id == ida && private_data.starts_with(b"welcome"))));
        assert!(
            self.take_b()
                .iter()
                .any(|n| matches!(n, Notice::Cm(Event::Established { id, .. }) if *id == idb))
        );
        assert_eq!(self.a.agent().state(ida), Some(State::Established));
        assert_eq!(self.b.agent().state(idb), Some(State::Established));
        (ida, idb)
    }
}

// ----------------------------------------------------------------- handshake

#[test]
fn port_info_handshake_builds_the_agent() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let mut info = port(3);
    info.max_entries = 17;
    info.pkey = 0x7FFF;
    info.active_mtu = abi::MTU_4096;
    info.ca_ack_delay = 16;
    let dev = start(&host, &clock, info.clone(), 128);
    let c = dev.agent().config();
    assert_eq!(c.gid, info.gid);
    assert_eq!((c.active_mtu, c.ack_delay), (abi::MTU_4096, 16));
    assert_eq!(c.ca_guid, info.ca_guid);
    assert_eq!((c.qpn_base, c.qpn_count), (info.qpn_base, info.qpn_count));
    assert_eq!(c.max_connections, 17);
    assert_eq!(c.pkey, 0x7FFF);
    assert_eq!(dev.port_info(), &info);
    assert!(dev.port_up());
    assert_eq!(dev.stats().tx_control, 1);
    assert_eq!(dev.stats().rx_msgs, 1);
    assert_eq!(dev.stats().rx_dropped(), 0);
    {
        let h = host.lock().unwrap();
        let d = &h.devs[0];
        assert_eq!(d.log.len(), 1);
        let (hd, payload) = &d.log[0];
        assert_eq!(hd.msg_type, MsgType::PortInfoRequest);
        assert_eq!(hd.len, 0);
        assert!(payload.is_empty());
        assert_eq!(
            d.rxq.next_avail(),
            1u16,
            "device consumed one rx buffer only"
        );
        assert!(d.kicks[1] >= 1, "rx buffers were announced");
    }
    // Every rx buffer is posted (one came back and went out again).
    let (tx, rx) = dev.queues();
    assert_eq!(rx.virtq().in_flight(), 128);
    assert_eq!(tx.virtq().in_flight(), 0, "PORT_INFO_REQUEST reclaimed");
    assert_eq!(dev.transport().describe(), "fake #0");
    assert!(format!("{dev:?}").contains("Device"));
}

#[test]
fn abi_mismatch_is_a_clear_error() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let mut info = port(1);
    info.abi_version = 2;
    let (t, q) = vm(&host, info, 16, Some(clock.clone()));
    let e = Device::start(t, q, clock, opts(1)).unwrap_err();
    assert!(
        matches!(
            e,
            DeviceError::AbiMismatch {
                device: 2,
                driver: abi::ABI_VERSION
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("ABI version 2"), "{e}");
    assert!(e.hint().is_some());
}

#[test]
fn a_silent_device_times_out_in_virtual_time() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let (t, q) = vm(&host, port(1), 16, Some(clock.clone()));
    host.lock().unwrap().devs[0].answer_port_info = false;
    let o = DeviceOptions {
        port_info_timeout: Duration::from_secs(3),
        ..opts(1)
    };
    let e = Device::start(t, q, clock.clone(), o).unwrap_err();
    assert!(
        matches!(e, DeviceError::NoPortInfo(d) if d == Duration::from_secs(3)),
        "{e}"
    );
    assert!(clock.now() >= Time::from_millis(3000));
    assert!(e.hint().is_some());
}

#[test]
fn a_malformed_port_info_is_an_error_and_events_before_it_are_kept() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let (t, q) = vm(&host, port(1), 16, Some(clock.clone()));
    {
        let mut h = host.lock().unwrap();
        let d = &mut h.devs[0];
        d.backlog.push_back(event_msg(AbiEvent::PortDown));
        d.backlog
            .push_back(msg(&MsgHeader::mad(gid(2)), &[0u8; MAD_LEN]));
    }
    let mut dev = Device::start(t, q, clock.clone(), opts(1)).unwrap();
    assert_eq!(dev.pop_device_event(), Some(DeviceEvent::PortDown));
    assert_eq!(dev.stats().rx_drop(RxDrop::BeforeStart), 1);

    let (t, q) = vm(&host, port(2), 16, Some(clock.clone()));
    {
        let mut h = host.lock().unwrap();
        let d = &mut h.devs[1];
        d.answer_port_info = false;
        d.backlog
            .push_back(msg(&MsgHeader::control(MsgType::PortInfo, 10), &[0u8; 10]));
    }
    let e = Device::start(t, q, clock, opts(1)).unwrap_err();
    assert!(matches!(e, DeviceError::BadPortInfo(_)), "{e}");
}

#[test]
fn a_96_byte_port_info_from_an_older_device_is_taken_with_link_defaults() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let info = port(1);
    let (t, q) = vm(&host, info.clone(), 16, Some(clock.clone()));
    {
        let mut h = host.lock().unwrap();
        let d = &mut h.devs[0];
        d.answer_port_info = false;
        let mut b = [0u8; abi::PORT_INFO_LEN];
        info.emit(&mut b).unwrap();
        let short = &b[..abi::PORT_INFO_MIN_LEN];
        d.backlog.push_back(msg(
            &MsgHeader::control(MsgType::PortInfo, short.len() as u32),
            short,
        ));
    }
    let dev = Device::start(t, q, clock, opts(1)).unwrap();
    let c = dev.agent().config();
    assert_eq!(c.gid, info.gid);
    assert_eq!((c.active_mtu, c.ack_delay), (abi::MTU_1024, 0));
    assert_eq!(dev.port_info().active_mtu, 0, "not given");
}

// ----------------------------------------------------------------- two VMs

#[test]
fn two_vms_connect_accept_disconnect_and_leave_nothing() {
    let mut n = Net::linux_drep();
    let listener = n.b.listen(tcp_service_id(PORT)).unwrap();
    let (ida, idb) = n.connect(listener, b"hello");

    // A disconnects: B sees the DREQ, answers with disconnect() (DREP).
    n.a.disconnect(ida).unwrap();
    n.settle();
    assert!(
        n.take_b()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::Disconnected { id }) if *id == idb))
    );
    assert_eq!(n.b.agent().state(idb), Some(State::DreqRcvd));
    n.b.disconnect(idb).unwrap();
    n.settle();
    assert!(
        n.take_a()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::Disconnected { id }) if *id == ida))
    );
    assert_eq!(n.a.agent().state(ida), Some(State::Timewait));
    assert_eq!(n.b.agent().state(idb), Some(State::Timewait));

    // TimeWait (512 ms for rdma_cm's RoCE paths) ends in virtual time.
    n.advance(600);
    assert!(
        n.take_a()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::TimewaitExit { id }) if *id == ida))
    );
    assert!(
        n.take_b()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::TimewaitExit { id }) if *id == idb))
    );
    n.a.destroy(ida).unwrap();
    n.b.destroy(idb).unwrap();
    n.settle();
    assert!(
        n.a.agent().is_quiescent(),
        "{:?}",
        n.a.agent().state_histogram()
    );
    assert!(
        n.b.agent().is_quiescent(),
        "{:?}",
        n.b.agent().state_histogram()
    );
    assert_eq!(n.b.agent().listener_count(), 1);

    // What one driver sent, the other's agent received, message by message.
    for m in pvcm_guest::cm::MESSAGES {
        assert_eq!(
            n.a.agent().counters().get(Group::TxMsgs, m),
            n.b.agent().counters().get(Group::RxMsgs, m),
            "{m}"
        );
        assert_eq!(
            n.b.agent().counters().get(Group::TxMsgs, m),
            n.a.agent().counters().get(Group::RxMsgs, m),
            "{m}"
        );
    }
    let (sa, sb) = (*n.a.stats(), *n.b.stats());
    assert_eq!(sa.tx_mads, 3, "REQ RTU DREQ");
    assert_eq!(sb.tx_mads, 2, "REP DREP");
    assert_eq!(sa.tx_mads, sb.rx_mads);
    assert_eq!(sb.tx_mads, sa.rx_mads);
    assert_eq!(sa.rx_dropped() + sb.rx_dropped(), 0);
    assert_eq!(sa.send_errors + sb.send_errors, 0);
    assert_eq!(n.a.agent().drops().total() + n.b.agent().drops().total(), 0);
    {
        let h = n.dev(0);
        assert_eq!(h.devs[0].sent_mads(AttributeId::Req), 1);
        assert_eq!(h.devs[1].sent_mads(AttributeId::Rep), 1);
        // Every tx MAD went out with the destination in the header, QP1, GSI Q_Key.
        for (hd, p) in h.devs[0]
            .log
            .iter()
            .filter(|(h, _)| h.msg_type == MsgType::Mad)
        {
            assert_eq!(*hd, MsgHeader::mad(gid(2)));
            assert_eq!(p.len(), MAD_LEN);
        }
    }
    // Every tx buffer came back; every rx buffer is posted.
    let (tx, rx) = n.a.queues();
    assert_eq!(tx.virtq().in_flight(), 0);
    assert_eq!(rx.virtq().in_flight(), 64);
}

#[test]
fn reject_and_destroy_right_after_connect_reach_the_peer() {
    let mut n = Net::new();
    let listener = n.b.listen(tcp_service_id(PORT)).unwrap();
    // B rejects.
    let id =
        n.a.connect(
            gid(2),
            tcp_service_id(PORT),
            &[],
            &ConnectOptions::default(),
        )
        .unwrap();
    n.settle();
    let req = n
        .take_b()
        .into_iter()
        .find_map(|x| match x {
            Notice::Cm(Event::ConnectRequest { id, listen_id, .. }) if listen_id == listener => {
                Some(id)
            }
            _ => None,
        })
        .unwrap();
    n.b.reject(req, b"no").unwrap();
    n.settle();
    assert!(n.take_a().iter().any(|x| matches!(x,
        Notice::Cm(Event::Rejected { id: i, private_data, .. }) if *i == id && private_data.starts_with(b"no"))));
    n.a.destroy(id).unwrap();
    n.b.destroy(req).unwrap();
    // Seed 002: connect, then destroy at once: REQ then REJ(TIMEOUT) in one batch.
    let kicks = n.dev(0).devs[0].kicks[0];
    let id =
        n.a.connect(
            gid(2),
            tcp_service_id(PORT),
            &[],
            &ConnectOptions::default(),
        )
        .unwrap();
    n.a.destroy(id).unwrap();
    n.round();
    assert_eq!(n.dev(0).devs[0].kicks[0], kicks + 1, "one kick for both");
    n.settle();
    let h = n.dev(0);
    assert_eq!(h.devs[0].sent_mads(AttributeId::Req), 2);
    assert_eq!(h.devs[0].sent_mads(AttributeId::Rej), 1);
    drop(h);
    // B saw the REQ and then the REJ for it: its request is withdrawn.
    let nb = n.take_b();
    let req2 = nb
        .iter()
        .find_map(|x| match x {
            Notice::Cm(Event::ConnectRequest { id, .. }) => Some(*id),
            _ => None,
        })
        .unwrap();
    assert!(
        nb.iter()
            .any(|x| matches!(x, Notice::Cm(Event::Rejected { id, .. }) if *id == req2))
    );
}

// ----------------------------------------------------------------- device messages

#[test]
fn send_error_is_counted_and_surfaced() {
    let mut n = Net::new();
    let o = ConnectOptions {
        max_cm_retries: 0,
        ..ConnectOptions::default()
    };
    let id = n.a.connect(gid(9), 0x1234, &[], &o).unwrap();
    let tid = n.a.agent().info(id).unwrap().local_comm_id;
    n.settle();
    let s = n.a.stats();
    assert_eq!(s.send_errors, 1);
    assert_eq!(
        s.send_errors_by_status[abi::SendStatus::WireError as usize],
        1
    );
    let ev = n
        .take_a()
        .into_iter()
        .find_map(|x| match x {
            Notice::Device(e @ DeviceEvent::SendError { .. }) => Some(e),
            _ => None,
        })
        .unwrap();
    match ev {
        DeviceEvent::SendError {
            status,
            dest,
            attr,
            tid: t,
        } => {
            assert_eq!(status, abi::SendStatus::WireError as u16);
            assert_eq!(dest, gid(9));
            assert_eq!(attr, Some(AttributeId::Req));
            assert_eq!(t as u32, tid, "TID low half is the comm ID");
        }
        other => panic!("{other:?}"),
    }
    assert!(ev.to_string().contains("wire_error"));
    // The agent treats it as lost: the REQ times out (no retries) -> Unreachable.
    n.advance(5000);
    assert!(
        n.take_a()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::Unreachable { id: i }) if *i == id))
    );
}

#[test]
fn device_reset_drops_all_cm_state_and_the_driver_goes_on() {
    let mut n = Net::new();
    let listener = n.b.listen(tcp_service_id(PORT)).unwrap();
    let (ida, idb) = n.connect(listener, b"one");
    let _listener_a = n.a.listen(tcp_service_id(1)).unwrap();
    // Something pending in A too: a REQ nobody answers.
    let pending =
        n.a.connect(gid(9), 1, &[], &ConnectOptions::default())
            .unwrap();
    n.dev(0).devs[0]
        .backlog
        .push_back(event_msg(AbiEvent::DeviceReset));
    n.settle();
    let na = n.take_a();
    assert!(na.contains(&Notice::Device(DeviceEvent::Reset)), "{na:?}");
    assert!(!na.contains(&Notice::Device(DeviceEvent::PortChanged)));
    assert_eq!(n.a.stats().resets, 1);
    let a = n.a.agent();
    assert_eq!(a.connection_count(), 0);
    assert_eq!(a.listener_count(), 0);
    assert!(a.is_quiescent());
    assert_eq!(a.state(ida), None, "old handles are unknown");
    assert_eq!(a.state(pending), None);
    assert_eq!(n.a.disconnect(ida), Err(pvcm_guest::cm::CmError::UnknownId));
    // The identity stays (PORT_INFO was asked again and matched).
    assert_eq!(n.dev(0).devs[0].sent(MsgType::PortInfoRequest), 2);
    assert_eq!(n.a.agent().config().gid, gid(1));
    // B still thinks it is connected; its DREQ gets a stateless DREP from A's new agent.
    n.b.disconnect(idb).unwrap();
    n.settle();
    assert!(
        n.take_b()
            .iter()
            .any(|x| matches!(x, Notice::Cm(Event::Disconnected { id }) if *id == idb))
    );
    // And A connects again.
    n.advance(600);
    n.take_b();
    let (ida2, _) = n.connect(listener, b"two");
    assert_ne!(ida2, ida);
    assert_eq!(n.a.agent().state(ida), None, "still unknown");
    assert_eq!(n.a.agent().state(ida2), Some(State::Established));
}

#[test]
fn port_events_and_a_changed_port_after_reset() {
    let mut n = Net::new();
    n.dev(0).devs[0]
        .backlog
        .push_back(event_msg(AbiEvent::PortDown));
    n.settle();
    assert!(!n.a.port_up());
    n.dev(0).devs[0]
        .backlog
        .push_back(event_msg(AbiEvent::PortUp));
    n.settle();
    assert!(n.a.port_up());
    assert_eq!(
        n.take_a(),
        vec![
            Notice::Device(DeviceEvent::PortDown),
            Notice::Device(DeviceEvent::PortUp)
        ]
    );
    assert_eq!(
        (n.a.stats().port_down_events, n.a.stats().port_up_events),
        (1, 1)
    );

    // The host gives the VM another QPN range, then resets it.
    {
        let mut h = n.dev(0);
        h.devs[0].info.qpn_base = 0x9000;
        h.devs[0].info.max_entries = 8;
        h.devs[0]
            .backlog
            .push_back(event_msg(AbiEvent::DeviceReset));
    }
    n.settle();
    assert_eq!(
        n.take_a(),
        vec![
            Notice::Device(DeviceEvent::Reset),
            Notice::Device(DeviceEvent::PortChanged)
        ]
    );
    assert_eq!(n.a.agent().config().qpn_base, 0x9000);
    assert_eq!(n.a.agent().config().max_connections, 8);
    assert_eq!(n.a.port_info().qpn_base, 0x9000);
    // An unsolicited PORT_INFO is a counted drop and changes nothing.
    let mut other = port(1);
    other.qpn_base = 0x100;
    n.dev(0).devs[0].backlog.push_back(port_info_msg(&other));
    n.settle();
    assert_eq!(n.a.stats().rx_drop(RxDrop::UnsolicitedPortInfo), 1);
    assert_eq!(n.a.agent().config().qpn_base, 0x9000);

    // Now the device comes back speaking another ABI: the driver stops.
    {
        let mut h = n.dev(0);
        h.devs[0].info.abi_version = 7;
        h.devs[0]
            .backlog
            .push_back(event_msg(AbiEvent::DeviceReset));
    }
    n.host.lock().unwrap().step();
    let now = n.clock.now();
    let _ = n.a.pump(now); // takes the reset, sends PORT_INFO_REQUEST
    n.host.lock().unwrap().step();
    let _ = n.a.pump(now); // takes the PORT_INFO
    assert!(matches!(
        n.a.pump(now),
        Err(DeviceError::AbiMismatch { device: 7, .. })
    ));
    let mut evs = Vec::new();
    while let Some(e) = n.a.pop_device_event() {
        evs.push(e);
    }
    assert!(
        evs.contains(&DeviceEvent::AbiMismatch { device: 7 }),
        "{evs:?}"
    );
}

#[test]
fn malformed_rx_messages_are_counted_drops() {
    let mut n = Net::new();
    let listener = n.b.listen(tcp_service_id(PORT)).unwrap();
    let mad_hdr = |len: u32| MsgHeader {
        len,
        ..MsgHeader::mad(gid(2))
    };
    let mut bad: Vec<Vec<u8>> = vec![
        vec![1u8; 10],                              // truncated header
        Vec::new(),                                 // nothing written
        msg(&mad_hdr(MAD_LEN as u32), &[0u8; 100]), // payload shorter than len
        msg(&mad_hdr(100), &[0u8; 100]),            // a MAD of 100 bytes
        msg(
            &MsgHeader::control(MsgType::Event, 8),
            &[9, 0, 0, 0, 0, 0, 0, 0],
        ), // event 9
        msg(&MsgHeader::control(MsgType::Event, 4), &[1, 0, 0, 0]), // short event
        msg(&MsgHeader::control(MsgType::PortInfo, 10), &[0u8; 10]), // short info
        msg(&MsgHeader::control(MsgType::PortInfoRequest, 0), &[]), // wrong way
        msg(&MsgHeader::control(MsgType::SendError, 4), &[1, 2, 3, 4]), // short payload
        msg(&MsgHeader::mad(gid(2)), &[0x5Au8; MAD_LEN]), // garbage MAD
    ];
    // Header type 0, type 99, and a length beyond 256.
    for (t, len) in [(0u16, 0u32), (99, 0), (1, 300)] {
        let mut b = msg(&MsgHeader::mad(gid(2)), &[0u8; 8]);
        b[0..2].copy_from_slice(&t.to_le_bytes());
        b[4..8].copy_from_slice(&len.to_le_bytes());
        bad.push(b);
    }
    // More than an rx buffer: the device can write only 304 bytes, the rest is lost and
    // the header's length still fits, so it is handled as a (garbage) MAD.
    let mut long = msg(&MsgHeader::mad(gid(2)), &[0u8; MAD_LEN]);
    long.extend([0xEE; 100]);
    bad.push(long);
    let total = bad.len() as u64;
    n.dev(0).devs[0].backlog.extend(bad);
    n.settle();
    let s = *n.a.stats();
    assert_eq!(s.rx_msgs, 1 + total, "PORT_INFO + the bad ones");
    assert_eq!(s.rx_drop(RxDrop::Truncated), 3);
    assert_eq!(s.rx_drop(RxDrop::BadMadLength), 1);
    assert_eq!(s.rx_drop(RxDrop::BadEvent), 2);
    assert_eq!(s.rx_drop(RxDrop::BadPortInfo), 1);
    assert_eq!(s.rx_drop(RxDrop::UnexpectedType), 1);
    assert_eq!(s.rx_drop(RxDrop::BadHeader), 3);
    assert_eq!(s.rx_dropped(), 11);
    assert_eq!(s.send_errors, 1);
    assert_eq!(s.rx_mads, 2, "two 256-byte MADs reached the agent");
    assert_eq!(
        n.a.agent().drops().malformed(),
        2,
        "and the agent dropped both"
    );
    assert!(n.take_a().iter().any(|x| matches!(
        x,
        Notice::Device(DeviceEvent::SendError {
            attr: None,
            tid: 0,
            ..
        })
    )));
    // Every buffer went back to the device, and the device still works.
    assert_eq!(n.a.queues().1.virtq().in_flight(), 64);
    let _ = n.connect(listener, b"still fine");
}

// ----------------------------------------------------------------- batching

#[test]
fn one_publish_and_at_most_one_kick_per_pump() {
    let mut n = Net::new();
    let _l = n.b.listen(tcp_service_id(PORT)).unwrap();
    let before = (n.dev(0).devs[0].kicks[0], *n.a.stats());
    for _ in 0..8 {
        n.a.connect(
            gid(2),
            tcp_service_id(PORT),
            &[],
            &ConnectOptions::default(),
        )
        .unwrap();
    }
    let p = n.a.pump(n.clock.now()).unwrap();
    assert_eq!(p.tx, 8);
    assert_eq!(n.a.stats().tx_batches, before.1.tx_batches + 1);
    assert_eq!(n.a.stats().tx_mads, before.1.tx_mads + 8);
    assert_eq!(n.dev(0).devs[0].kicks[0], before.0 + 1);
    assert_eq!(
        n.a.queues().0.virtq().stats().published,
        before.1.tx_batches + 1
    );
    // The device takes all 8 in one round.
    assert_eq!(n.dev(0).devs[0].take_tx().len(), 8);
    // An idle pump publishes nothing and kicks nothing.
    let k = n.dev(0).devs[0].kicks;
    let p = n.a.pump(n.clock.now()).unwrap();
    assert_eq!(p, Default::default());
    assert_eq!(n.dev(0).devs[0].kicks, k);
}

#[test]
fn tx_backpressure_keeps_mads_in_the_outbox() {
    let mut n = Net::with_sizes(4, 64);
    let listener = n.b.listen(tcp_service_id(PORT)).unwrap();
    n.dev(0).devs[0].hold_tx = true;
    let ids: Vec<CmId> = (0..10)
        .map(|_| {
            n.a.connect(
                gid(2),
                tcp_service_id(PORT),
                &[],
                &ConnectOptions::default(),
            )
            .unwrap()
        })
        .collect();
    let now = n.clock.now();
    assert_eq!(n.a.pump(now).unwrap().tx, 4, "the ring is full after 4");
    assert_eq!(n.a.agent().outbox_len(), 6);
    assert!(n.a.tx_backlogged());
    assert_eq!(n.a.stats().tx_backpressure, 1);
    assert_eq!(n.a.pump(now).unwrap().tx, 0, "nothing came back yet");
    assert_eq!(n.a.stats().tx_backpressure, 2);
    // The device moves again: everything goes out in order, nothing lost or doubled.
    n.dev(0).devs[0].hold_tx = false;
    n.settle();
    let reqs: Vec<CmId> = n
        .take_b()
        .into_iter()
        .filter_map(|x| match x {
            Notice::Cm(Event::ConnectRequest { id, listen_id, .. }) if listen_id == listener => {
                Some(id)
            }
            _ => None,
        })
        .collect();
    assert_eq!(reqs.len(), 10);
    assert_eq!(n.dev(0).devs[0].sent_mads(AttributeId::Req), 10);
    for r in reqs {
        n.b.accept(r, &[]).unwrap();
    }
    n.settle();
    let est = n
        .take_a()
        .iter()
        .filter(|x| matches!(x, Notice::Cm(Event::Established { .. })))
        .count();
    assert_eq!(est, 10);
    for id in ids {
        assert_eq!(n.a.agent().state(id), Some(State::Established));
    }
    assert_eq!(n.a.agent().counters().total(Group::TxRetries), 0);
    assert!(!n.a.tx_backlogged());
}

#[test]
fn a_request_waits_its_timeout_from_when_the_device_takes_it() {
    // Linux's MAD layer starts a request's response timer when its send completes: a
    // REQ that waited behind others on a busy vCPU is not retried before the peer
    // could have answered it. B never pumps, so nothing answers the REQ.
    let mut n = Net::new();
    n.dev(0).devs[0].hold_tx = true;
    let id =
        n.a.connect(
            gid(2),
            tcp_service_id(PORT),
            &[],
            &ConnectOptions::default(),
        )
        .unwrap();
    let t0 = n.clock.now();
    assert_eq!(n.a.pump(t0).unwrap().tx, 1);
    let queued = n.a.agent_mut().next_deadline().unwrap();
    // The device takes it 3 s later.
    n.clock.advance_ms(3000);
    n.dev(0).devs[0].hold_tx = false;
    n.host.lock().unwrap().step();
    assert_eq!(n.dev(0).devs[0].sent_mads(AttributeId::Req), 1);
    let t1 = n.clock.now();
    n.a.pump(t1).unwrap();
    let sent = n.a.agent_mut().next_deadline().unwrap();
    assert_eq!(
        sent.since(t1),
        queued.since(t0),
        "the whole timeout, from the send"
    );
    // No retry at the deadline counted from the queueing...
    n.clock.advance_ms(queued.since(t1).as_millis() as u64);
    n.a.pump(n.clock.now()).unwrap();
    assert_eq!(n.a.agent().counters().total(Group::TxRetries), 0);
    assert_eq!(n.a.agent().state(id), Some(State::ReqSent));
    // ...but at the one counted from the send.
    n.clock
        .advance_ms(sent.since(n.clock.now()).as_millis() as u64);
    n.a.pump(n.clock.now()).unwrap();
    assert_eq!(n.a.agent().counters().total(Group::TxRetries), 1);
}

#[test]
fn a_request_to_nobody_is_retried_one_timeout_apart() {
    // A real backend takes a MAD at once and answers nothing for an address nobody
    // has; the driver learns of the send completion only from a notification. Each
    // attempt must last one timeout from the send, not until the driver next happens
    // to look at the used ring (its own timer: two timeouts per attempt).
    let host = FakeHost::new();
    host.lock().unwrap().silent_unknown = true;
    let clock = ManualClock::new();
    let (mut t, q) = vm(&host, port(1), 16, Some(clock.clone()));
    t.wake_on_signal_only = true;
    let mut a = Device::start(t, q, clock.clone(), opts(7)).unwrap();
    let o = ConnectOptions {
        max_cm_retries: 3,
        ..ConnectOptions::default()
    };
    let t0 = clock.now();
    let id = a.connect(gid(9), 5, &[], &o).unwrap();
    let ev = a.next_cm_event(Duration::from_secs(120)).unwrap();
    assert_eq!(ev, Some(Event::Unreachable { id }));
    let took = clock.now().since(t0);
    assert_eq!(took, Duration::from_millis(4 * 4608), "{took:?}");
    assert_eq!(
        host.lock().unwrap().devs[0].sent_mads(AttributeId::Req),
        4,
        "the REQ and its 3 retries"
    );
}

#[test]
fn a_thousand_connects_to_nobody_fail_within_linuxs_retry_budget() {
    // pvcm-guest cmtime to an address nobody has, through a device that takes every MAD
    // at once and answers none (a real backend towards a dead address), in virtual
    // time. Linux sends all 1,000 REQs at once and fails each after 16 attempts of
    // 4,608 ms (73.7 s); the agent's window holds back all but 32 until the first
    // timeout shows nobody is there, so the last fails one attempt later (78.3 s),
    // within 1.2x. More REQs than the tx ring (256) holds go out at that timeout.
    const N: u32 = 1000;
    let host = FakeHost::new();
    host.lock().unwrap().silent_unknown = true;
    let clock = ManualClock::new();
    let info = PortInfo {
        max_entries: 4096,
        ..port(1)
    };
    let (mut t, q) = vm(&host, info, 256, Some(clock.clone()));
    t.wake_on_signal_only = true;
    let mut a = Device::start(t, q, clock.clone(), opts(11)).unwrap();
    let t0 = clock.now();
    let r = cmtime::client(
        &mut a,
        &ClientOptions {
            dest: gid(9),
            port: PORT,
            connections: N,
            timeout: Duration::from_secs(600),
            hold: Duration::ZERO,
            connect: ConnectOptions::default(),
        },
    )
    .unwrap();
    let took = clock.now().since(t0);
    assert_eq!((r.established, r.failed), (0, N), "{r}");
    assert_eq!(r.failures_of("unreachable"), N, "{r}");
    let linux = Duration::from_millis(16 * 4608);
    assert!(
        took <= linux * 12 / 10,
        "{took:?} against Linux's {linux:?}"
    );
    assert_eq!(took, linux + Duration::from_millis(4608), "{took:?}");
    // With more REQs than the tx ring holds, the driver slept while the device had
    // them, it did not spin.
    assert!(a.transport().waits < 200, "waits {}", a.transport().waits);
}

// ----------------------------------------------------------------- blocking helpers

#[test]
fn run_until_sleeps_to_the_agents_timers() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let mut a = start(&host, &clock, port(1), 16);
    let o = ConnectOptions {
        max_cm_retries: 1,
        ..ConnectOptions::default()
    };
    let t0 = clock.now();
    let id = a.connect(gid(9), 5, &[], &o).unwrap();
    // Nobody at 10.0.0.9: two attempts of 2 * 256 + 4096 ms, then Unreachable.
    let ev = a.next_cm_event(Duration::from_secs(60)).unwrap();
    assert_eq!(ev, Some(Event::Unreachable { id }));
    let took = clock.now().since(t0);
    assert_eq!(took, Duration::from_millis(2 * 4608), "{took:?}");
    assert_eq!(a.stats().send_errors, 2, "the REQ and its retry");
    assert!(
        a.transport().waits < 20,
        "slept, did not spin: {}",
        a.transport().waits
    );
    // Nothing else comes: a timeout in virtual time.
    assert!(matches!(
        a.pop_notice(),
        Some(Notice::Device(DeviceEvent::SendError { .. }))
    ));
    while a.pop_notice().is_some() {}
    let t1 = clock.now();
    assert_eq!(a.next_cm_event(Duration::from_secs(7)).unwrap(), None);
    assert_eq!(clock.now().since(t1), Duration::from_secs(7));
    a.destroy(id).unwrap();
    assert!(a.flush(Duration::from_secs(1)).unwrap());
    assert!(a.wait(Duration::from_millis(5)).is_ok());
}

#[test]
fn cmtime_client_and_server_on_two_threads() {
    let host = FakeHost::new();
    let (ta, qa) = vm(&host, port(1), 64, None);
    let (tb, qb) = vm(&host, port(2), 64, None);
    let mut a = Device::start(ta, qa, SystemClock::new(), opts(1)).unwrap();
    let mut b = Device::start(tb, qb, SystemClock::new(), opts(2)).unwrap();
    const N: u32 = 40;
    // The listener exists before any REQ can arrive (a REQ to no listener is rejected).
    let listener = b.listen(tcp_service_id(9000)).unwrap();
    let server = std::thread::spawn(move || {
        let r = cmtime::serve(
            &mut b,
            listener,
            &ServerOptions {
                port: 9000,
                connections: N,
                timeout: Some(Duration::from_secs(60)),
            },
        )
        .unwrap();
        (r, b)
    });
    let r = cmtime::client(
        &mut a,
        &ClientOptions {
            dest: gid(2),
            port: 9000,
            connections: N,
            timeout: Duration::from_secs(30),
            hold: Duration::ZERO,
            connect: ConnectOptions::default(),
        },
    )
    .unwrap();
    let (s, b) = server.join().unwrap();
    assert_eq!((r.established, r.failed, r.disconnected), (N, 0, N), "{r}");
    for step in Step::ALL {
        let t = r.step(step);
        assert_eq!(t.count, N, "{step:?}");
        assert!(t.min <= t.avg() && t.avg() <= t.max, "{step:?}");
    }
    assert!(r.step(Step::Establish).total >= r.step(Step::Establish).max);
    let table = r.to_string();
    assert!(
        table.contains("establish") && table.contains("total ms"),
        "{table}"
    );
    assert_eq!(
        (s.accepted, s.established, s.disconnected, s.failed),
        (N, N, N, 0),
        "{s}"
    );
    // Both agents hold only TimeWait leftovers (and B its listener).
    assert_eq!(
        a.agent().counters().get(Group::TxMsgs, AttributeId::Req),
        u64::from(N)
    );
    assert_eq!(b.agent().listener_count(), 1);
    assert_eq!(a.stats().rx_dropped() + b.stats().rx_dropped(), 0);
}

// ----------------------------------------------------------------- honest reports

#[test]
fn cmtime_counts_timeouts_as_failures_and_never_reports_failed_0() {
    let host = FakeHost::new();
    let clock = ManualClock::new();
    let mut a = start(&host, &clock, port(1), 64);
    // Nobody at 10.0.0.9: the REQs draw SEND_ERRORs and are retried until the phase's
    // time is up; nothing is established.
    let r = cmtime::client(
        &mut a,
        &ClientOptions {
            dest: gid(9),
            port: PORT,
            connections: 40,
            timeout: Duration::from_secs(10),
            hold: Duration::ZERO,
            connect: ConnectOptions::default(),
        },
    )
    .unwrap();
    assert_eq!((r.established, r.failed, r.disconnected), (0, 40, 0), "{r}");
    assert_eq!(r.failures.get(&Failure::Timeout), Some(&40));
    assert_eq!(r.failures_of("timeout"), 40);
    assert!(!r.success());
    let text = r.to_string();
    assert!(
        text.contains("failed 40") && text.contains("timeout: 40"),
        "{text}"
    );
    assert!(!text.contains("failed 0"), "{text}");
    // Paced: one window went out and the rest waited; nothing answered that window by
    // its timeout, so the window opened and the rest went out too, as Linux sends them.
    assert_eq!((r.pacing.sent, r.pacing.waited), (40, 8), "{}", r.pacing);
    assert_eq!((r.pacing.cancelled, r.pacing.opened), (0, 1));
    assert!(text.contains("pacing"), "{text}");
    // Every REQ carried its own ephemeral source port in rdma_cm's header, and the flow
    // label rdma_cm derives from it.
    let h = host.lock().unwrap();
    let mut ports = std::collections::HashSet::new();
    for (hd, payload) in &h.devs[0].log {
        if hd.msg_type != MsgType::Mad {
            continue;
        }
        if let Ok((_, pvcm_wire::cm::CmRepr::Req(req))) = pvcm_wire::cm::CmRepr::parse(payload) {
            let (hdr, _) = split_private_data(req.private_data).unwrap();
            assert!(EPHEMERAL_PORTS.contains(&hdr.src_port), "{}", hdr.src_port);
            assert_eq!(
                req.primary_path.flow_label,
                roce_flow_label(hdr.src_port, PORT)
            );
            assert_eq!(req.path_mtu, abi::MTU_2048, "the port's MTU");
            ports.insert(hdr.src_port);
        }
    }
    assert_eq!(ports.len(), 40, "one port per connection sent");
}

#[test]
fn cmtime_counts_rejects_with_their_reason() {
    let host = FakeHost::new();
    let (ta, qa) = vm(&host, port(1), 64, None);
    let (tb, qb) = vm(&host, port(2), 64, None);
    let mut a = Device::start(ta, qa, SystemClock::new(), opts(1)).unwrap();
    let mut b = Device::start(tb, qb, SystemClock::new(), opts(2)).unwrap();
    // B listens on nothing: every REQ is answered REJ(INVALID_SERVICE_ID).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s = stop.clone();
    let peer = std::thread::spawn(move || {
        b.run_until(Duration::from_secs(60), |_| {
            s.load(std::sync::atomic::Ordering::Relaxed)
        })
        .unwrap();
    });
    const N: u32 = 50;
    let r = cmtime::client(
        &mut a,
        &ClientOptions {
            dest: gid(2),
            port: 9001,
            connections: N,
            timeout: Duration::from_secs(30),
            hold: Duration::ZERO,
            connect: ConnectOptions::default(),
        },
    )
    .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    peer.join().unwrap();
    assert_eq!((r.established, r.failed, r.disconnected), (0, N, 0), "{r}");
    let why = Failure::Rejected(RejReason::InvalidServiceId);
    assert_eq!(r.failures.get(&why), Some(&N));
    assert_eq!(why.to_string(), "rejected invalid_service_id(8)");
    assert!(
        r.to_string()
            .contains(&format!("rejected invalid_service_id(8): {N}")),
        "{r}"
    );
    assert!(!r.success());
    // The window let every REJ free a slot: nothing timed out, nothing was cancelled.
    assert_eq!(
        (r.pacing.sent, r.pacing.answered),
        (u64::from(N), u64::from(N))
    );
}

#[test]
fn an_attempt_ends_in_a_failure_with_its_reason() {
    let id = {
        let mut a =
            pvcm_guest::cm::Agent::new(pvcm_guest::cm::AgentConfig::new(gid(1), 1, 0x100, 16, 1));
        a.listen(1).unwrap()
    };
    assert_eq!(Failure::of_attempt(None), Some(Failure::Timeout));
    assert_eq!(
        Failure::of_attempt(Some(&Event::Unreachable { id })),
        Some(Failure::Unreachable)
    );
    let rej = Event::Rejected {
        id,
        reason: RejReason::ConsumerDefined,
        ari: vec![],
        private_data: vec![],
    };
    assert_eq!(
        Failure::of_attempt(Some(&rej)),
        Some(Failure::Rejected(RejReason::ConsumerDefined))
    );
    let est = Event::Established {
        id,
        remote_qpn: 1,
        private_data: vec![],
    };
    assert_eq!(Failure::of_attempt(Some(&est)), None);
    assert_eq!(Failure::DisconnectTimeout.to_string(), "disconnect_timeout");
}

//! Helpers for the device tests (included with `#[path]`): a fake pvcm device per VM —
//! the device side of `virtio_queue::Queue` over the VM's own
//! `vm_memory::GuestMemoryMmap` — and a fake host that answers PORT_INFO_REQUEST and
//! copies MADs between its devices by destination GID (no mux), answering MADs for
//! unknown GIDs with SEND_ERROR(WIRE_ERROR).
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::VecDeque;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pvcm_guest::device::{Queues, Transport};
use pvcm_guest::time::ManualClock;
use pvcm_guest::transport::TransportError;
use pvcm_guest::transport::pci::QueueSetup;
use pvcm_guest::virtq::{LinearDma, Notify, features};
use pvcm_wire::Gid;
use pvcm_wire::abi::{
    self, EVENT_LEN, Event, HEADER_LEN, MsgHeader, MsgType, PORT_INFO_LEN, PortInfo, SendStatus,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// Where each VM's memory starts (guest-physical).
pub const GPA: u64 = 0x4000_0000;
/// Each VM's memory.
pub const MEM_LEN: usize = 4 << 20;

pub type Mem = GuestMemoryMmap<()>;

pub fn gid(n: u8) -> Gid {
    Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, n))
}

/// The port a VM `n` gets.
pub fn port(n: u8) -> PortInfo {
    PortInfo {
        abi_version: abi::ABI_VERSION,
        port_up: true,
        gid: gid(n),
        more_gids: Vec::new(),
        ca_guid: 0x0002_c903_0000_0000 | u64::from(n),
        lid: 0xFFFF,
        pkey: 0xFFFF,
        qpn_base: 0x1000 * u32::from(n),
        qpn_count: 0x1000,
        max_entries: 256,
        name: format!("vm{n}"),
        active_mtu: abi::MTU_2048,
        ca_ack_delay: 0,
    }
}

/// A message: header + payload.
pub fn msg(h: &MsgHeader, payload: &[u8]) -> Vec<u8> {
    pvcm_wire::testing::message(h, payload)
}

pub fn port_info_msg(p: &PortInfo) -> Vec<u8> {
    let mut b = [0u8; PORT_INFO_LEN];
    p.emit(&mut b).unwrap();
    msg(
        &MsgHeader::control(MsgType::PortInfo, PORT_INFO_LEN as u32),
        &b,
    )
}

pub fn event_msg(e: Event) -> Vec<u8> {
    let mut b = [0u8; EVENT_LEN];
    e.emit(&mut b).unwrap();
    msg(&MsgHeader::control(MsgType::Event, EVENT_LEN as u32), &b)
}

fn device_queue(mem: &Mem, s: &QueueSetup, event_idx: bool) -> Queue {
    let mut q = Queue::new(s.size).unwrap();
    q.try_set_desc_table_address(GuestAddress(s.desc)).unwrap();
    q.try_set_avail_ring_address(GuestAddress(s.driver))
        .unwrap();
    q.try_set_used_ring_address(GuestAddress(s.device)).unwrap();
    q.set_event_idx(event_idx);
    q.set_ready(true);
    assert!(q.is_valid(mem));
    q
}

/// One VM's device.
#[derive(Debug)]
pub struct FakeDev {
    pub mem: Arc<Mem>,
    pub txq: Queue,
    pub rxq: Queue,
    /// What PORT_INFO answers.
    pub info: PortInfo,
    /// Messages waiting for rx buffers.
    pub backlog: VecDeque<Vec<u8>>,
    /// Every well-formed tx message, as received.
    pub log: Vec<(MsgHeader, Vec<u8>)>,
    /// Leave tx chains on the ring (a stalled device).
    pub hold_tx: bool,
    /// Answer PORT_INFO_REQUEST.
    pub answer_port_info: bool,
    /// Notifications the driver sent, per queue.
    pub kicks: [u64; 2],
    /// Used-buffer notifications the device sent, per queue.
    pub interrupts: [u64; 2],
    /// Eventfds to signal for used-buffer notifications (the lab's call eventfds).
    pub call_fds: Option<[OwnedFd; 2]>,
}

impl FakeDev {
    fn signal(&mut self, q: usize) {
        self.interrupts[q] += 1;
        if let Some(fds) = &self.call_fds {
            let v = 1u64;
            // SAFETY: writes 8 bytes from a live u64 to a descriptor we hold.
            unsafe { libc::write(fds[q].as_raw_fd(), (&v as *const u64).cast(), 8) };
        }
    }

    /// Takes every available tx chain (the device-readable bytes of each).
    pub fn take_tx(&mut self) -> Vec<Vec<u8>> {
        let mem = &*self.mem.clone();
        let mut out = Vec::new();
        loop {
            while let Some(chain) = self.txq.pop_descriptor_chain(mem) {
                let head = chain.head_index();
                let mut b = Vec::new();
                for d in chain {
                    if !d.is_write_only() {
                        let mut v = vec![0u8; d.len() as usize];
                        mem.read_slice(&mut v, d.addr()).unwrap();
                        b.extend(v);
                    }
                }
                self.txq.add_used(mem, head, 0).unwrap();
                out.push(b);
            }
            if !self.txq.enable_notification(mem).unwrap() {
                break;
            }
        }
        if !out.is_empty() && self.txq.needs_notification(mem).unwrap() {
            self.signal(0);
        }
        out
    }

    /// Writes backlogged messages into rx buffers; returns how many.
    pub fn deliver_rx(&mut self) -> usize {
        let mem = &*self.mem.clone();
        let mut n = 0;
        while let Some(m) = self.backlog.front() {
            let Some(chain) = self.rxq.pop_descriptor_chain(mem) else {
                // Out of buffers: ask for a kick when the driver posts more (and
                // re-check, as a device must).
                if self.rxq.enable_notification(mem).unwrap() {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            let mut off = 0usize;
            for d in chain {
                if d.is_write_only() && off < m.len() {
                    let k = (d.len() as usize).min(m.len() - off);
                    mem.write_slice(&m[off..off + k], d.addr()).unwrap();
                    off += k;
                }
            }
            self.rxq.add_used(mem, head, off as u32).unwrap();
            self.backlog.pop_front();
            n += 1;
        }
        if n > 0 && self.rxq.needs_notification(mem).unwrap() {
            self.signal(1);
        }
        n
    }

    /// Tx messages of one type seen so far.
    pub fn sent(&self, t: MsgType) -> usize {
        self.log.iter().filter(|(h, _)| h.msg_type == t).count()
    }

    /// MADs with attribute `attr` seen on tx.
    pub fn sent_mads(&self, attr: pvcm_wire::mad::AttributeId) -> usize {
        self.log
            .iter()
            .filter(|(h, p)| {
                h.msg_type == MsgType::Mad && pvcm_wire::testing::attr(p) == Some(attr)
            })
            .count()
    }
}

/// The host: every VM's device.
#[derive(Debug, Default)]
pub struct FakeHost {
    pub devs: Vec<FakeDev>,
    /// Drop MADs for GIDs no device has, as a real backend's wire does towards an
    /// address nobody answers (otherwise: SEND_ERROR(WIRE_ERROR) back).
    pub silent_unknown: bool,
}

impl FakeHost {
    pub fn new() -> Arc<Mutex<FakeHost>> {
        Arc::new(Mutex::new(FakeHost::default()))
    }

    /// One device round: every device's tx, routed; every device's rx delivered.
    /// Returns the messages moved.
    pub fn step(&mut self) -> usize {
        let mut work = 0;
        for i in 0..self.devs.len() {
            if self.devs[i].hold_tx {
                continue;
            }
            let msgs = self.devs[i].take_tx();
            work += msgs.len();
            for m in msgs {
                self.route(i, &m);
            }
        }
        for d in &mut self.devs {
            work += d.deliver_rx();
        }
        work
    }

    fn route(&mut self, from: usize, b: &[u8]) {
        let Ok(h) = MsgHeader::parse(b) else { return };
        let Some(payload) = b.get(HEADER_LEN..HEADER_LEN + h.len as usize) else {
            return;
        };
        self.devs[from].log.push((h, payload.to_vec()));
        match h.msg_type {
            MsgType::PortInfoRequest if self.devs[from].answer_port_info => {
                let m = port_info_msg(&self.devs[from].info);
                self.devs[from].backlog.push_back(m);
            }
            MsgType::Mad => {
                let src = self.devs[from].info.gid;
                match self.devs.iter().position(|d| d.info.gid == h.remote_gid) {
                    Some(j) => {
                        let m = msg(&MsgHeader::mad(src), payload);
                        self.devs[j].backlog.push_back(m);
                    }
                    None if self.silent_unknown => {}
                    None => {
                        let eh = MsgHeader {
                            msg_type: MsgType::SendError,
                            status: SendStatus::WireError as u16,
                            ..h
                        };
                        self.devs[from].backlog.push_back(msg(&eh, payload));
                    }
                }
            }
            _ => {}
        }
    }

    /// Adds a VM: its memory, the driver's queues in it (`size` descriptors), and the
    /// device side of those queues. Returns the device's index and the queues.
    pub fn add_vm(&mut self, info: PortInfo, size: u16, features: u64) -> (usize, Queues) {
        let (mem, dma) = guest();
        let queues = Queues::new(&dma, size, features).unwrap();
        let idx = self.attach(mem, info, &queues, features, None);
        (idx, queues)
    }

    /// Adds the device side of `queues` (allocated in `mem`); `call_fds` are signalled
    /// for used-buffer notifications. Returns the device's index.
    pub fn attach(
        &mut self,
        mem: Arc<Mem>,
        info: PortInfo,
        queues: &Queues,
        features: u64,
        call_fds: Option<[OwnedFd; 2]>,
    ) -> usize {
        let [t, r] = queues.setups();
        let ev = features & features::EVENT_IDX != 0;
        self.devs.push(FakeDev {
            txq: device_queue(&mem, &t, ev),
            rxq: device_queue(&mem, &r, ev),
            mem,
            info,
            backlog: VecDeque::new(),
            log: Vec::new(),
            hold_tx: false,
            answer_port_info: true,
            kicks: [0; 2],
            interrupts: [0; 2],
            call_fds,
        });
        self.devs.len() - 1
    }
}

/// A VM's memory and a DMA allocator over all of it.
pub fn guest() -> (Arc<Mem>, LinearDma) {
    let mem = Arc::new(Mem::from_ranges(&[(GuestAddress(GPA), MEM_LEN)]).unwrap());
    let host = mem.get_host_address(GuestAddress(GPA)).unwrap();
    let keep: Arc<Mem> = mem.clone();
    // SAFETY: `MEM_LEN` bytes of a mapping kept alive by `keep`; the device side
    // (virtio-queue) sees it at GPA; nothing else on the driver side uses it.
    let dma = unsafe { LinearDma::new(NonNull::new(host).unwrap(), GPA, MEM_LEN, Some(keep)) };
    (mem, dma)
}

/// The driver's view of one fake device: kicks are counted at the device, and
/// `wait()` runs one host round — in virtual time (a [`ManualClock`] advanced by the
/// whole timeout when nothing happened) or real time (a short sleep).
#[derive(Debug)]
pub struct FakeTransport {
    pub host: Arc<Mutex<FakeHost>>,
    pub idx: usize,
    pub clock: Option<ManualClock>,
    pub features: u64,
    pub waits: u64,
    /// `wait()` returns early only for a used-buffer notification the device sent, as
    /// a real transport (otherwise: whenever the host moved anything).
    pub wake_on_signal_only: bool,
}

impl Notify for FakeTransport {
    fn notify(&self, queue: u16) {
        self.host.lock().unwrap().devs[self.idx].kicks[usize::from(queue)] += 1;
    }
}

impl Transport for FakeTransport {
    fn features(&self) -> u64 {
        self.features
    }

    fn wait(&mut self, timeout: Duration) -> Result<(), TransportError> {
        self.waits += 1;
        let woke = {
            let mut h = self.host.lock().unwrap();
            let before = h.devs[self.idx].interrupts;
            let n = h.step();
            if self.wake_on_signal_only {
                h.devs[self.idx].interrupts != before
            } else {
                n > 0
            }
        };
        if !woke {
            match &self.clock {
                Some(c) => c.advance(timeout),
                None => std::thread::sleep(timeout.min(Duration::from_micros(200))),
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!("fake #{}", self.idx)
    }
}

/// Adds a VM to `host` and returns its transport and queues.
pub fn vm(
    host: &Arc<Mutex<FakeHost>>,
    info: PortInfo,
    size: u16,
    clock: Option<ManualClock>,
) -> (FakeTransport, Queues) {
    let features = features::PVCM;
    let (idx, q) = host.lock().unwrap().add_vm(info, size, features);
    (
        FakeTransport {
            host: host.clone(),
            idx,
            clock,
            features,
            waits: 0,
            wake_on_signal_only: false,
        },
        q,
    )
}

//! The soft RoCE port: RoCEv2 CM frames over UDP, one socket per VM address.
//!
//! A VM's GID is an IPv4-mapped GID (RoCEv2 over IPv4) or an IPv6 address (RoCEv2 over
//! IPv6); VMs of both families share one port, and frames are routed by GID. For an
//! IPv4 VM the port binds its address and the RoCEv2 port (4791 unless `--bind-port`),
//! unconnected, with Don't Fragment set, so the kernel writes identification 0 and DF
//! into the frames pvcm sends (the ICRC covers both). For an IPv6 VM it binds an
//! `AF_INET6` socket (`IPV6_V6ONLY`; a link-local GID in the scope of its interface,
//! `gid=fe80::1%IFACE`) that also accepts a zero UDP checksum (`UDP_NO_CHECK6_RX`):
//! Linux rxe sends its IPv6 RoCEv2 frames with checksum 0, which an IPv6 UDP socket
//! otherwise drops.
//! Frames are built with `pvcm_wire::roce` (ICRC computed on send) and checked on
//! receive (length, BTH, DETH, ICRC): anything else is a counted drop. Sends and
//! receives are batched with `sendmmsg`/`recvmmsg`.
//!
//! Receiving has two modes ([`RxMode`]):
//! - **raw** ([`RawRx`]): one `SOCK_RAW`/`IPPROTO_UDP` socket per daemon, with a
//!   classic BPF filter for the RoCEv2 port and the VMs' addresses, sees each datagram
//!   with its IPv4 header exactly as the sender wrote it, so the ICRC is checked over
//!   the real identification and flags. Linux rxe writes a hashed, non-zero IP ID
//!   (`__ip_select_ident`), so this is the mode that accepts every conformant sender.
//!   It needs `CAP_NET_RAW`. The per-VM UDP sockets stay bound (so the kernel never
//!   answers ICMP port unreachable) but carry a drop-all filter and are never read.
//! - **udp**: the per-VM UDP sockets are read; a UDP socket never sees the IP header,
//!   so the ICRC is checked under identification 0 with DF set. Frames from senders
//!   that write another identification (Linux rxe, most hardware) fail that check and
//!   are counted as `wire_bad_icrc`. Only pvcm peers and senders that write ID 0 get
//!   through. It needs no privilege.
//!
//! Both modes are about IPv4. The ICRC of an IPv6 frame covers nothing a UDP socket
//! cannot see: of the IPv6 header it covers the addresses, the payload length and the
//! next header (traffic class, flow label and hop limit are masked), of the UDP header
//! the ports and the length (the checksum is masked); `recvmsg` gives the source
//! address and port, the socket its own, and the datagram's length gives both lengths.
//! So an IPv6 VM is always read through its own UDP socket, and the ICRC is checked
//! exactly, from any sender: no raw socket, no privilege. (A raw IPv6 socket would not
//! even show the IPv6 header: Linux hands raw IPv6 sockets the payload only.)
//!
//! The kernel's own drops (a socket's receive queue full) are counted as
//! `wire_rx_overflow` on the VM's counters ([`SoftPort`]'s loss audit): a UDP socket's
//! drop count (`SO_RXQ_OVFL` with each datagram, `SO_MEMINFO` when the traffic pauses);
//! in raw mode, the datagrams that reached a VM's address (its UDP socket's filter
//! drops and counts each one) less those the raw socket delivered. The raw socket's own
//! drop count is not used: while its queue is full the kernel counts every UDP datagram
//! on the host against it, its filter notwithstanding.

use std::io;
use std::mem::MaybeUninit;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;
use pvcm_wire::roce::{self, FRAME_LEN, FrameRepr, IpRepr, UdpRepr};

use super::bpf::{
    self, BPF_ABS, BPF_ACCEPT, BPF_B, BPF_H, BPF_IND, BPF_JA, BPF_JEQ, BPF_JMP, BPF_JSET, BPF_K,
    BPF_LD, BPF_LDX, BPF_MSH, BPF_RET, BPF_W,
};
use super::sys::{
    SO_RXQ_OVFL, buffer_degraded, cvt, if_index, set_rx_buffer, setsockopt_int, sockaddr_of,
    socket_drops,
};
use crate::port::{Arrivals, InMad, OutMad, PortCtx, PortError};
use crate::port::{Error, RAW_SOCKET_HOW};

pub use super::frame::{InFrame, check_datagram, check_frame};
pub use super::sys::{BATCH, RECV_BUF, RecvBatch};
use crate::stats::{Degraded, DevDrop, Io, RxBuffer};

pub use crate::config::RxMode;

/// How long after traffic the loss audit runs.
const AUDIT_AFTER: std::time::Duration = std::time::Duration::from_millis(100);
/// `UDP_NO_CHECK6_RX` (linux/udp.h): accept IPv6 UDP datagrams with checksum 0.
const UDP_NO_CHECK6_RX: libc::c_int = 102;

/// A frame ready to send: 280 bytes to `dst`.
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// Destination address and port (with its scope, for a link-local IPv6 one).
    pub dst: SocketAddr,
    /// The UDP payload.
    pub frame: [u8; FRAME_LEN],
}

/// One UDP socket bound to a VM's address.
#[derive(Debug)]
pub struct UdpPort {
    sock: UdpSocket,
    local: SocketAddr,
    psn: AtomicU32,
    /// Datagrams to this address the kernel dropped, as last counted (see [`Lost`]).
    lost: Lost,
    /// Datagrams to this address the raw socket delivered (raw mode).
    raw_rx: AtomicU32,
}

/// A cumulative count of datagrams the kernel dropped, and how much of it was counted
/// already. The kernel's counts are 32-bit and wrap; the count only moves forward, so
/// an older or transiently low reading adds nothing.
#[derive(Debug, Default)]
struct Lost(AtomicU32);

impl Lost {
    /// The drops in `now` (a cumulative count) not counted before.
    fn new_since(&self, now: u32) -> u32 {
        let mut seen = self.0.load(Ordering::Relaxed);
        loop {
            let d = now.wrapping_sub(seen);
            if d == 0 || d > i32::MAX as u32 {
                return 0;
            }
            match self
                .0
                .compare_exchange_weak(seen, now, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return d,
                Err(s) => seen = s,
            }
        }
    }
}

impl UdpPort {
    /// Binds `addr:port` (`scope`: the interface index of a link-local IPv6 address,
    /// else 0): non-blocking, close-on-exec, large buffers, the kernel's drop count on
    /// every datagram (`SO_RXQ_OVFL`). IPv4: DF set (`IP_PMTUDISC_DO`). IPv6:
    /// `IPV6_V6ONLY`, and zero UDP checksums accepted (`UDP_NO_CHECK6_RX`, as rxe sends
    /// them). Fails if the address is not local or the port is taken.
    pub fn bind(addr: IpAddr, scope: u32, port: u16) -> io::Result<UdpPort> {
        let family = match addr {
            IpAddr::V4(_) => libc::AF_INET,
            IpAddr::V6(_) => libc::AF_INET6,
        };
        let fd = super::sys::socket(family, libc::SOCK_DGRAM, 0)?;
        let raw = fd.as_raw_fd();
        let local = match addr {
            IpAddr::V4(a) => {
                setsockopt_int(
                    raw,
                    libc::IPPROTO_IP,
                    libc::IP_MTU_DISCOVER,
                    libc::IP_PMTUDISC_DO,
                )?;
                SocketAddr::V4(SocketAddrV4::new(a, port))
            }
            IpAddr::V6(a) => {
                setsockopt_int(raw, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 1)?;
                setsockopt_int(raw, libc::IPPROTO_UDP, UDP_NO_CHECK6_RX, 1)?;
                SocketAddr::V6(SocketAddrV6::new(a, port, 0, scope))
            }
        };
        setsockopt_int(raw, libc::SOL_SOCKET, SO_RXQ_OVFL, 1)?;
        // Best effort: larger buffers absorb bursts (capped by net.core.[rw]mem_max).
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20);
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
        let (sa, len) = sockaddr_of(&local);
        // SAFETY: `sa` is a valid socket address of `len` bytes.
        cvt(unsafe { libc::bind(raw, (&sa as *const libc::sockaddr_storage).cast(), len) })
            .map_err(|e| io::Error::new(e.kind(), format!("bind {local}: {e}")))?;
        let sock = UdpSocket::from(fd);
        Ok(UdpPort {
            sock,
            local,
            psn: AtomicU32::new(0),
            lost: Lost::default(),
            raw_rx: AtomicU32::new(0),
        })
    }

    /// The bound address.
    pub fn local(&self) -> SocketAddr {
        self.local
    }

    /// The socket.
    pub fn socket(&self) -> &UdpSocket {
        &self.sock
    }

    /// Builds the frame carrying `mad` from this port to `dst` (ICRC computed under
    /// the header the kernel writes: see `pvcm_wire::roce`); `None` when `dst` is of the
    /// other IP family.
    pub fn frame(&self, dst: SocketAddr, mad: &[u8; MAD_LEN]) -> Option<OutFrame> {
        let mut f = OutFrame {
            dst,
            frame: [0u8; FRAME_LEN],
        };
        self.emit(&mut f, mad).then_some(f)
    }

    /// [`UdpPort::frame`], built where it is kept: at the end of `frames`. Returns
    /// whether it was (false: `dst` is of the other IP family).
    pub fn frame_into(
        &self,
        frames: &mut Vec<OutFrame>,
        dst: SocketAddr,
        mad: &[u8; MAD_LEN],
    ) -> bool {
        frames.push(OutFrame {
            dst,
            frame: [0u8; FRAME_LEN],
        });
        let built = frames.last_mut().is_some_and(|f| self.emit(f, mad));
        if !built {
            frames.pop();
        }
        built
    }

    /// Writes the frame carrying `mad` to `f.dst` into `f.frame`; false (nothing
    /// written, no PSN taken) when `f.dst` is of the other IP family.
    fn emit(&self, f: &mut OutFrame, mad: &[u8; MAD_LEN]) -> bool {
        let Some(ip) = IpRepr::from_addrs(self.local.ip(), f.dst.ip()) else {
            return false;
        };
        let psn = self.psn.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF;
        let udp = UdpRepr {
            dst_port: f.dst.port(),
            ..UdpRepr::new(self.local.port())
        };
        // The buffer is exactly a frame and the MAD exactly 256 bytes: emit cannot fail.
        let _ = FrameRepr::gsi(psn, mad).emit(&mut f.frame, &ip, &udp);
        true
    }

    /// Sends frames with `sendmmsg`; returns how many the kernel took (a full socket
    /// buffer is retried a few times, then the rest is reported as not sent).
    pub fn send_batch(&self, frames: &[OutFrame]) -> usize {
        let mut pos = 0;
        let mut sent = 0;
        let mut stalls = 0;
        while pos < frames.len() {
            let chunk = &frames[pos..frames.len().min(pos + BATCH)];
            let mut addrs: [MaybeUninit<libc::sockaddr_storage>; BATCH] =
                [const { MaybeUninit::uninit() }; BATCH];
            let mut iovs: [MaybeUninit<libc::iovec>; BATCH] =
                [const { MaybeUninit::uninit() }; BATCH];
            // SAFETY: mmsghdr is plain old data for which all-zero is a valid value.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            for (i, f) in chunk.iter().enumerate() {
                let (sa, len) = sockaddr_of(&f.dst);
                let a = addrs[i].write(sa);
                let iov = iovs[i].write(libc::iovec {
                    iov_base: f.frame.as_ptr() as *mut libc::c_void,
                    iov_len: FRAME_LEN,
                });
                msgs[i].msg_hdr.msg_name = (a as *mut libc::sockaddr_storage).cast();
                msgs[i].msg_hdr.msg_namelen = len;
                msgs[i].msg_hdr.msg_iov = iov;
                msgs[i].msg_hdr.msg_iovlen = 1;
            }
            // SAFETY: `msgs[..chunk.len()]` point at initialised addresses and iovecs that
            // live until the call returns; the frames are only read by the kernel.
            let r = unsafe {
                libc::sendmmsg(
                    self.sock.as_raw_fd(),
                    msgs.as_mut_ptr(),
                    chunk.len() as libc::c_uint,
                    0,
                )
            };
            if r > 0 {
                sent += r as usize;
                pos += r as usize;
                stalls = 0;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock if stalls < 100 => {
                    stalls += 1;
                    std::thread::yield_now();
                }
                io::ErrorKind::WouldBlock => return sent,
                _ => {
                    // A frame the kernel refuses (e.g. an unreachable destination): skip
                    // it so the rest of the batch still goes.
                    tracing::debug!(error = %e, dst = %chunk[0].dst, "wire send failed");
                    pos += 1;
                }
            }
        }
        sent
    }

    /// Receives up to [`BATCH`] datagrams with `recvmmsg` (non-blocking) into `rb`;
    /// returns how many (0 when none is waiting).
    pub fn recv_batch(&self, rb: &mut RecvBatch) -> io::Result<usize> {
        super::sys::recv_batch(self.sock.as_raw_fd(), rb)
    }

    /// The datagrams the kernel dropped on this socket and not counted yet, from the
    /// drop count the last batch carried (0 if it carried none).
    pub fn new_drops(&self, rb: &RecvBatch) -> u32 {
        rb.drop_count().map_or(0, |now| self.lost.new_since(now))
    }

    /// The datagrams the kernel dropped on this socket and not counted yet, asked of
    /// the socket (`SO_MEMINFO`): also those no later datagram reported.
    pub fn new_drops_now(&self) -> io::Result<u32> {
        socket_drops(self.sock.as_raw_fd()).map(|now| self.lost.new_since(now))
    }

    /// Makes the socket discard everything it receives (raw mode reads elsewhere): a
    /// filter that accepts nothing, so the socket stays bound but never queues.
    pub fn discard_rx(&self) -> io::Result<()> {
        bpf::attach(self.sock.as_raw_fd(), &[bpf::stmt(BPF_RET | BPF_K, 0)])?;
        // Anything queued before the filter went on is dropped too.
        let mut rb = RecvBatch::default();
        while self.recv_batch(&mut rb)? == BATCH {}
        Ok(())
    }
}

/// Addresses the kernel filter checks one by one (in chunks, as a classic BPF jump
/// reaches at most 255 instructions ahead); past this the filter checks only the port
/// and the receive path checks the address. The kernel takes up to 4,096 instructions.
const BPF_MAX_ADDRS: usize = 2000;
/// Addresses per chunk of compares: each chunk ends in its own accept, within reach.
const BPF_CHUNK: usize = 250;

/// The raw socket's filter: unfragmented UDP to `port` at one of `addrs` (all
/// addresses when there are more than [`BPF_MAX_ADDRS`]). A raw socket's data starts
/// at the IPv4 header. Every jump is short: the drops sit next to the checks, and the
/// address compares come in chunks of [`BPF_CHUNK`], each followed by its own accept.
fn raw_filter(port: u16, addrs: &[Ipv4Addr]) -> Vec<libc::sock_filter> {
    if addrs.is_empty() {
        // No IPv4 VM (yet): nothing is ours.
        return vec![bpf::stmt(BPF_RET | BPF_K, 0)];
    }
    let check_addrs = addrs.len() <= BPF_MAX_ADDRS;
    let mut p = Vec::with_capacity(10 + addrs.len() + 2 * addrs.len() / BPF_CHUNK);
    // Fragments (offset != 0) carry no UDP header: drop them. The kernel reassembles
    // before raw delivery, so this only guards the header load below.
    p.push(bpf::stmt(BPF_LD | BPF_H | BPF_ABS, 6));
    p.push(bpf::jump(BPF_JMP | BPF_JSET | BPF_K, 0x1FFF, 0, 1));
    p.push(bpf::stmt(BPF_RET | BPF_K, 0));
    // X = IHL * 4; A = UDP destination port.
    p.push(bpf::stmt(BPF_LDX | BPF_B | BPF_MSH, 0));
    p.push(bpf::stmt(BPF_LD | BPF_H | BPF_IND, 2));
    p.push(bpf::jump(BPF_JMP | BPF_JEQ | BPF_K, u32::from(port), 1, 0));
    p.push(bpf::stmt(BPF_RET | BPF_K, 0));
    if !check_addrs {
        p.push(bpf::stmt(BPF_RET | BPF_K, BPF_ACCEPT));
        return p;
    }
    p.push(bpf::stmt(BPF_LD | BPF_W | BPF_ABS, 16));
    let chunks = addrs.len().div_ceil(BPF_CHUNK);
    for (c, chunk) in addrs.chunks(BPF_CHUNK).enumerate() {
        let m = chunk.len();
        for (i, a) in chunk.iter().enumerate() {
            // On a match, on to this chunk's accept (after the chunk's last compare and
            // the instruction that follows it).
            p.push(bpf::jump(
                BPF_JMP | BPF_JEQ | BPF_K,
                u32::from(*a),
                (m - i) as u8,
                0,
            ));
        }
        if c + 1 < chunks {
            // No match in this chunk: over its accept, to the next chunk.
            p.push(bpf::stmt(BPF_JMP | BPF_JA, 1));
        } else {
            p.push(bpf::stmt(BPF_RET | BPF_K, 0));
        }
        p.push(bpf::stmt(BPF_RET | BPF_K, BPF_ACCEPT));
    }
    p
}

/// The raw receive socket: every RoCEv2 datagram to the daemon's VM addresses, IPv4
/// header included (see the module docs).
#[derive(Debug)]
pub struct RawRx {
    fd: OwnedFd,
    buffer: RxBuffer,
}

impl RawRx {
    /// Opens the raw socket for datagrams to `port` at `addrs`. Fails with
    /// `PermissionDenied` without `CAP_NET_RAW`.
    pub fn open(port: u16, addrs: &[Ipv4Addr]) -> io::Result<RawRx> {
        let fd = super::sys::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_UDP)?;
        let raw = fd.as_raw_fd();
        // A large buffer absorbs bursts; a smaller one is reported (stat, metrics).
        let buffer = set_rx_buffer(raw, "raw wire socket");
        // Raw sockets never send here: a zero-length send buffer is not possible, but
        // nothing is ever written.
        bpf::attach(raw, &raw_filter(port, addrs))?;
        let rx = RawRx { fd, buffer };
        // Datagrams that arrived between socket() and the filter: not filtered, drop.
        let mut rb = RecvBatch::default();
        while rx.recv_batch(&mut rb)? == BATCH {}
        Ok(rx)
    }

    /// Replaces the filter: datagrams to `port` at `addrs` (the VMs changed).
    pub fn set_filter(&self, port: u16, addrs: &[Ipv4Addr]) -> io::Result<()> {
        bpf::attach(self.fd.as_raw_fd(), &raw_filter(port, addrs))
    }

    /// The socket's fd, for epoll.
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Receives up to [`BATCH`] whole IPv4 datagrams (non-blocking) into `rb`.
    pub fn recv_batch(&self, rb: &mut RecvBatch) -> io::Result<usize> {
        super::sys::recv_batch(self.fd.as_raw_fd(), rb)
    }
}

/// The epoll token of the raw receive socket (the address sockets use their slot).
const TOK_RAW: u64 = 1 << 39;
/// The epoll token of the loss audit's timer.
const TOK_AUDIT: u64 = TOK_RAW + 1;
/// Times the audit reads the raw socket (up to `RX_ROUNDS` batches each) waiting for
/// its queue to empty. Still not empty: the audit is put off to its next turn, so the
/// loop's other work is not held up for long; the count is complete once traffic
/// pauses.
const AUDIT_DRAIN_ROUNDS: usize = 4;

/// Datagram batches taken from one socket before the loop looks at the others.
const RX_ROUNDS: usize = 16;

/// The soft RoCEv2 port: one UDP socket per VM address (a VM has one address per GID,
/// each in its own slot) and, in raw mode, the raw receive socket for the IPv4
/// addresses.
#[derive(Debug)]
pub struct SoftPort {
    /// The VMs' addresses and sockets (VMs come and go at runtime).
    vms: std::sync::RwLock<SoftVms>,
    raw: Option<RawRx>,
    /// The receive mode configured (`--wire-rx`).
    configured: RxMode,
    /// The receive mode's fallback, if `auto` fell back to udp.
    mode_degraded: Option<Degraded>,
    port_num: u16,
    /// The loss audit: a one-shot timer armed by traffic (see [`SoftPort::audit`]).
    audit_timer: std::sync::Mutex<vmm_sys_util::timerfd::TimerFd>,
    audit_armed: std::sync::atomic::AtomicBool,
}

/// One VM address the soft port serves.
#[derive(Debug, Clone)]
struct Slot {
    /// The VM's index.
    vm: usize,
    /// The VM's name (errors).
    name: String,
    /// The address.
    addr: IpAddr,
    /// Interface index of a link-local address, else 0.
    scope: u32,
}

/// The soft port's VM addresses, by slot (the epoll token of a socket the port reads is
/// its slot), and each VM's slots.
#[derive(Debug, Default)]
struct SoftVms {
    /// Per slot: its bound socket, `None` while the address is not this host's (an
    /// incoming VM not arrived yet, or one that left by migration).
    socks: Vec<Option<std::sync::Arc<UdpPort>>>,
    /// Per slot: its address; `None` for one of a VM removed at runtime.
    slots: Vec<Option<Slot>>,
    /// Every served address's slot.
    by_addr: std::collections::HashMap<IpAddr, usize>,
    /// Per VM index: its slots, the primary address's first (empty: no such VM).
    of_vm: Vec<Vec<usize>>,
}

impl SoftVms {
    /// Adds VM `vm`'s addresses (name, address, scope), each in a new slot.
    fn add(&mut self, vm: usize, name: &str, addrs: &[(IpAddr, u32)]) {
        if self.of_vm.len() <= vm {
            self.of_vm.resize(vm + 1, Vec::new());
        }
        for &(addr, scope) in addrs {
            let slot = self.slots.len();
            self.slots.push(Some(Slot {
                vm,
                name: name.to_string(),
                addr,
                scope,
            }));
            self.socks.push(None);
            self.by_addr.insert(addr, slot);
            self.of_vm[vm].push(slot);
        }
    }

    /// Forgets VM `vm`'s addresses; returns the sockets they had.
    fn remove(&mut self, vm: usize) -> Vec<(IpAddr, Option<std::sync::Arc<UdpPort>>)> {
        let slots = self
            .of_vm
            .get_mut(vm)
            .map(std::mem::take)
            .unwrap_or_default();
        let mut gone = Vec::with_capacity(slots.len());
        for s in slots {
            if let Some(slot) = self.slots.get_mut(s).and_then(Option::take) {
                self.by_addr.remove(&slot.addr);
                gone.push((slot.addr, self.socks[s].take()));
            }
        }
        gone
    }

    /// The slots of VM `vm`.
    fn slots_of(&self, vm: usize) -> &[usize] {
        self.of_vm.get(vm).map_or(&[], Vec::as_slice)
    }

    /// The IPv4 addresses served (the raw socket's filter).
    fn v4(&self) -> Vec<Ipv4Addr> {
        self.slots
            .iter()
            .flatten()
            .filter_map(|s| match s.addr {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => None,
            })
            .collect()
    }
}

/// Where a frame to `dst` goes from a VM whose address is `own` (in `scope`, the
/// interface of a link-local GID): its IPv4 or IPv6 address and the RoCEv2 port `port`;
/// `None` for a GID of the other family, or a link-local one a VM without a scope
/// cannot reach.
fn destination(own: IpAddr, scope: u32, port: u16, dst: Gid) -> Option<SocketAddr> {
    match (own, dst.to_ipv4()) {
        (IpAddr::V4(_), Some(a)) => Some(SocketAddr::V4(SocketAddrV4::new(a, port))),
        (IpAddr::V6(_), None) => {
            let scope = if dst.is_link_local() {
                (scope != 0).then_some(scope)?
            } else {
                0
            };
            Some(SocketAddr::V6(SocketAddrV6::new(
                dst.into(),
                port,
                0,
                scope,
            )))
        }
        _ => None,
    }
}

/// Opens the raw receive socket the mode asks for (None: udp mode), whether IPv4 VMs
/// are configured yet or not (IPv6 VMs are read through their UDP sockets in every
/// mode, and IPv4 VMs added at runtime get the mode configured). `auto` without the
/// privilege: udp, logged at WARN and returned as a degraded setting.
fn open_raw_rx(
    mode: RxMode,
    port: u16,
    addrs: &[Ipv4Addr],
) -> Result<(Option<RawRx>, Option<Degraded>), Error> {
    match mode {
        RxMode::Udp => Ok((None, None)),
        RxMode::Raw => RawRx::open(port, addrs)
            .map(|r| (Some(r), None))
            .map_err(Error::RawSocketRequired),
        RxMode::Auto => match RawRx::open(port, addrs) {
            Ok(r) => Ok((Some(r), None)),
            Err(err) if err.kind() == io::ErrorKind::PermissionDenied => {
                let why = format!(
                    "no raw socket ({err}): receiving in udp mode, which drops frames from \
                     Linux rxe and hardware RoCE peers as wire_bad_icrc (they write a \
                     non-zero IP ID the ICRC covers); {RAW_SOCKET_HOW}"
                );
                tracing::warn!("{why}");
                let d = Degraded {
                    setting: "wire_rx".into(),
                    configured: RxMode::Auto.name().into(),
                    effective: RxMode::Udp.name().into(),
                    why,
                };
                Ok((None, Some(d)))
            }
            Err(err) => Err(Error::RawSocket(err)),
        },
    }
}

/// The scope a VM's address binds in: the interface index of a link-local IPv6 GID's
/// `%IFACE`, else 0.
fn scope_of(name: &str, a: IpAddr, iface: Option<&str>, port: u16) -> Result<u32, Error> {
    match iface {
        Some(i) if a.is_ipv6() => if_index(i).map_err(|source| Error::WireBind {
            vm: name.to_string(),
            addr: a,
            port,
            source,
        }),
        _ => Ok(0),
    }
}

/// A VM's addresses with their scopes.
fn scoped(
    name: &str,
    addrs: &[(IpAddr, Option<String>)],
    port: u16,
) -> Result<Vec<(IpAddr, u32)>, Error> {
    addrs
        .iter()
        .map(|(a, iface)| Ok((*a, scope_of(name, *a, iface.as_deref(), port)?)))
        .collect()
}

/// The soft port's VMs as it opens: each VM's name and addresses (the primary first,
/// each with the interface of a link-local address).
pub type SoftVmAddrs = (String, Vec<(IpAddr, Option<String>)>);

impl SoftPort {
    /// Binds every VM address (`iface`: the interface of a link-local GID) but those
    /// of `incoming` VMs (bound by [`WirePort::claim`] when they arrive), and opens the
    /// receive path the mode asks for. Incoming VMs need raw receive (a udp-mode socket
    /// set is fixed) and IPv4 GIDs only (an IPv6 address is read through its own
    /// socket, which the host loop cannot add while it runs).
    ///
    /// [`WirePort::claim`]: crate::port::WirePort::claim
    pub fn open(
        vms: &[SoftVmAddrs],
        incoming: &[bool],
        port_num: u16,
        mode: RxMode,
    ) -> Result<SoftPort, Error> {
        let v4: Vec<Ipv4Addr> = vms
            .iter()
            .flat_map(|(_, addrs)| addrs)
            .filter_map(|(a, _)| match a {
                IpAddr::V4(a) => Some(*a),
                IpAddr::V6(_) => None,
            })
            .collect();
        for (i, (name, addrs)) in vms.iter().enumerate() {
            if incoming.get(i).copied().unwrap_or(false) && addrs.iter().any(|(a, _)| a.is_ipv6()) {
                return Err(Error::IncomingIpv6(name.clone()));
            }
        }
        let (raw, mode_degraded) = open_raw_rx(mode, port_num, &v4)?;
        if raw.is_none()
            && let Some(i) = incoming.iter().position(|&x| x)
        {
            return Err(Error::IncomingNeedsRaw(vms[i].0.clone()));
        }
        let mut table = SoftVms::default();
        for (vm, (name, addrs)) in vms.iter().enumerate() {
            table.add(vm, name, &scoped(name, addrs, port_num)?);
        }
        let audit_timer = vmm_sys_util::timerfd::TimerFd::new()
            .map_err(|e| Error::AuditTimer(io::Error::from(e)))?;
        // Non-blocking: reading an expiry that is not there must not stall the loop.
        // SAFETY: fcntl(2) on a descriptor the timer owns; the result is checked.
        cvt(unsafe { libc::fcntl(audit_timer.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) })
            .map_err(Error::AuditTimer)?;
        let port = SoftPort {
            vms: std::sync::RwLock::new(table),
            raw,
            configured: mode,
            mode_degraded,
            port_num,
            audit_timer: std::sync::Mutex::new(audit_timer),
            audit_armed: std::sync::atomic::AtomicBool::new(false),
        };
        for i in 0..vms.len() {
            if !incoming.get(i).copied().unwrap_or(false) {
                port.bind_vm(i)?;
            }
        }
        Ok(port)
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, SoftVms> {
        self.vms
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn table_mut(&self) -> std::sync::RwLockWriteGuard<'_, SoftVms> {
        self.vms
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The address in `slot`.
    fn slot(&self, slot: usize) -> Option<Slot> {
        self.table().slots.get(slot)?.clone()
    }

    /// The slots addresses have had (removed ones included).
    fn slot_indices(&self) -> std::ops::Range<usize> {
        0..self.table().slots.len()
    }

    /// Binds VM `vm`'s addresses (and, in raw mode, makes an IPv4 address's socket drop
    /// what it gets: the raw socket reads for it). Nothing is bound if one fails.
    fn bind_vm(&self, vm: usize) -> Result<(), Error> {
        let slots: Vec<(usize, Slot)> = {
            let t = self.table();
            t.slots_of(vm)
                .iter()
                .filter_map(|&s| Some((s, t.slots.get(s)?.clone()?)))
                .collect()
        };
        let mut bound = Vec::with_capacity(slots.len());
        for (s, slot) in slots {
            let sock = UdpPort::bind(slot.addr, slot.scope, self.port_num).map_err(|source| {
                Error::WireBind {
                    vm: slot.name.clone(),
                    addr: slot.addr,
                    port: self.port_num,
                    source,
                }
            })?;
            if self.raw.is_some() && slot.addr.is_ipv4() {
                sock.discard_rx().map_err(|source| Error::WireFilter {
                    vm: slot.name.clone(),
                    source,
                })?;
            }
            bound.push((s, std::sync::Arc::new(sock)));
        }
        let mut t = self.table_mut();
        for (s, sock) in bound {
            if let Some(at) = t.socks.get_mut(s) {
                *at = Some(sock);
            }
        }
        Ok(())
    }

    /// The socket of `slot`, if its address is this host's now.
    fn sock(&self, slot: usize) -> Option<std::sync::Arc<UdpPort>> {
        self.table().socks.get(slot)?.clone()
    }

    /// Whether `slot`'s address is read through its own UDP socket (udp mode, or an
    /// IPv6 address).
    fn reads_udp(&self, slot: usize) -> bool {
        self.raw.is_none() || self.slot(slot).is_some_and(|s| s.addr.is_ipv6())
    }

    /// Sends `frames` from `sock` (VM `port`'s) in one batch, captured first; what the
    /// kernel does not take is counted as `wire_send_error`.
    fn send_frames(
        ctx: &PortCtx<'_>,
        port: &crate::vm_port::VmPort,
        sock: &UdpPort,
        frames: &[OutFrame],
    ) {
        if frames.is_empty() {
            return;
        }
        // Captured before the send, so an answer never precedes its request in the file.
        if let Some(c) = ctx.capture {
            for f in frames {
                c.record(sock.local(), f.dst, &f.frame);
            }
            c.flush();
        }
        let sent = sock.send_batch(frames);
        port.counters.add(Io::WireTxFrames, sent as u64);
        for _ in sent..frames.len() {
            port.counters.drop(DevDrop::WireSendError);
        }
    }

    /// Takes datagrams from one VM address's socket (udp mode, and IPv6 addresses);
    /// returns how many it read.
    fn on_udp(
        &self,
        ctx: &PortCtx<'_>,
        slot: usize,
        rb: &mut RecvBatch,
        route: &mut dyn FnMut(Arrivals),
    ) -> usize {
        let (Some(sock), Some(s)) = (self.sock(slot), self.slot(slot)) else {
            return 0;
        };
        let (vm, Some(port)) = (s.vm, ctx.vms.get(s.vm)) else {
            return 0;
        };
        let local = sock.local();
        let mut read = 0;
        for _ in 0..RX_ROUNDS {
            let n = match sock.recv_batch(rb) {
                Ok(0) => return read,
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(parent: &port.span, error = %e, "wire receive failed");
                    return read;
                }
            };
            read += n;
            port.counters
                .drop_n(DevDrop::WireRxOverflow, sock.new_drops(rb).into());
            port.counters.add(Io::WireRxFrames, n as u64);
            let mut frames = Vec::with_capacity(n);
            for i in 0..n {
                let (src, dgram, truncated) = rb.get(i);
                let Some(src) = src else {
                    port.counters.drop(DevDrop::WireBadSource);
                    continue;
                };
                if let Some(c) = ctx.capture {
                    c.record(src, local, dgram);
                }
                if truncated {
                    port.counters.drop(DevDrop::WireBadLength);
                    continue;
                }
                match check_frame(local, src, dgram) {
                    Ok(f) => frames.push(InMad::from(f)),
                    Err(r) => {
                        tracing::debug!(parent: &port.span, %src, reason = r.name(), "wire frame dropped");
                        port.counters.drop(r);
                    }
                }
            }
            if let Some(c) = ctx.capture {
                c.flush();
            }
            if !frames.is_empty() {
                route(vec![(vm, frames)]);
            }
            if n < BATCH {
                return read;
            }
        }
        read
    }

    /// Takes datagrams from the raw socket (raw mode): each is checked over its IPv4
    /// header as received and routed to the VM of its destination address. Returns how
    /// many it read, and whether it left the socket's queue empty.
    fn on_raw(
        &self,
        ctx: &PortCtx<'_>,
        rb: &mut RecvBatch,
        route: &mut dyn FnMut(Arrivals),
    ) -> (usize, bool) {
        let Some(raw) = &self.raw else {
            return (0, true);
        };
        let mut read = 0;
        for _ in 0..RX_ROUNDS {
            let n = match raw.recv_batch(rb) {
                Ok(0) => return (read, true),
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "raw wire receive failed");
                    return (read, true);
                }
            };
            read += n;
            let mut per_vm: Vec<(usize, Vec<InMad>)> = Vec::new();
            // One look at the table for the batch (the lock is a read lock; VMs added
            // or removed meanwhile count from the next batch on).
            let table = self.table();
            let mut last: Option<(u32, usize, usize)> = None;
            for i in 0..n {
                let (_, dgram, truncated) = rb.get(i);
                // The destination decides whose counters a drop lands on; datagrams to
                // an address that is not one of ours are not ours to count.
                let ip_dst = roce::field::ipv4::DST;
                let Some(dst) = dgram.get(ip_dst.range()).map(|_| ip_dst.get(dgram) as u32) else {
                    continue;
                };
                // Datagrams of a batch mostly go to one address: its slot and VM are
                // remembered.
                let (slot, p) = match last {
                    Some((a, s, p)) if a == dst => (s, p),
                    _ => {
                        let addr = IpAddr::V4(Ipv4Addr::from(dst));
                        let Some(&s) = table.by_addr.get(&addr) else {
                            continue;
                        };
                        let Some(Some(slot)) = table.slots.get(s) else {
                            continue;
                        };
                        last = Some((dst, s, slot.vm));
                        (s, slot.vm)
                    }
                };
                // An address this host does not hold now (a VM not arrived yet, or
                // gone by migration) is not ours either: its frames are another host's.
                let Some(Some(sock)) = table.socks.get(slot) else {
                    continue;
                };
                let Some(port) = ctx.vms.get(p) else {
                    continue;
                };
                sock.raw_rx.fetch_add(1, Ordering::Relaxed);
                port.counters.add(Io::WireRxFrames, 1);
                if let Some(c) = ctx.capture {
                    c.record_datagram(dgram);
                }
                if truncated {
                    port.counters.drop(DevDrop::WireBadLength);
                    continue;
                }
                match check_datagram(dgram) {
                    Ok((to, f)) if to.port() == self.port_num => {
                        match per_vm.iter_mut().find(|(q, _)| *q == p) {
                            Some((_, v)) => v.push(InMad::from(f)),
                            None => {
                                let mut v = Vec::with_capacity(n - i);
                                v.push(InMad::from(f));
                                per_vm.push((p, v));
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(r) => {
                        tracing::debug!(parent: &port.span, reason = r.name(), "wire frame dropped");
                        port.counters.drop(r);
                    }
                }
            }
            drop(table);
            if let Some(c) = ctx.capture {
                c.flush();
            }
            if !per_vm.is_empty() {
                route(per_vm);
            }
            if n < BATCH {
                return (read, true);
            }
        }
        (read, false)
    }

    /// Arms the loss audit, unless it is armed already.
    fn arm_audit(&self) {
        if self.audit_armed.swap(true, Ordering::Relaxed) {
            return;
        }
        let mut t = self
            .audit_timer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = t.reset(AUDIT_AFTER, None) {
            tracing::warn!(error = %e, "loss audit timer");
            self.audit_armed.store(false, Ordering::Relaxed);
        }
    }

    /// Counts the datagrams the kernel dropped for each VM address and no datagram
    /// reported: `AUDIT_AFTER` after traffic, so the count is complete soon after a
    /// burst ends even when nothing follows it.
    ///
    /// - A socket the port reads (udp mode, IPv6 addresses): its drop count
    ///   (`SO_MEMINFO`).
    /// - An IPv4 address in raw mode: the datagrams that reached it (its UDP socket
    ///   drops each one with its filter and counts it) less those the raw socket
    ///   delivered for it. The arrivals are read first, then the raw queue is emptied:
    ///   every datagram counted in the arrivals is then either delivered or lost, and
    ///   one that arrives meanwhile can only make the difference smaller, never count
    ///   as lost (the next audit counts it right).
    ///
    /// It re-arms itself while traffic goes on.
    fn audit(&self, ctx: &PortCtx<'_>, rb: &mut RecvBatch, route: &mut dyn FnMut(Arrivals)) {
        {
            let mut t = self
                .audit_timer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Consumes the expiry: epoll reported it, so this does not block.
            let _ = t.wait();
        }
        self.audit_armed.store(false, Ordering::Relaxed);
        let vm_of = |slot: usize| self.slot(slot).and_then(|s| ctx.vms.get(s.vm));
        let mut read = 0;
        let mut drained = true;
        if self.raw.is_some() {
            let arrivals: Vec<(usize, std::sync::Arc<UdpPort>, u32)> = self
                .slot_indices()
                .filter(|&s| !self.reads_udp(s))
                .filter_map(|s| {
                    let sock = self.sock(s)?;
                    let a = socket_drops(sock.socket().as_raw_fd()).ok()?;
                    Some((s, sock, a))
                })
                .collect();
            drained = false;
            for _ in 0..AUDIT_DRAIN_ROUNDS {
                let (n, empty) = self.on_raw(ctx, rb, route);
                read += n;
                if empty {
                    drained = true;
                    break;
                }
            }
            if drained {
                for (slot, sock, arrived) in arrivals {
                    let lost = arrived.wrapping_sub(sock.raw_rx.load(Ordering::Relaxed));
                    let n = sock.lost.new_since(lost);
                    if let Some(port) = vm_of(slot) {
                        port.counters.drop_n(DevDrop::WireRxOverflow, n.into());
                    }
                }
            }
        }
        for slot in self.slot_indices().filter(|&s| self.reads_udp(s)) {
            let (Some(sock), Some(port)) = (self.sock(slot), vm_of(slot)) else {
                continue;
            };
            match sock.new_drops_now() {
                Ok(n) => port.counters.drop_n(DevDrop::WireRxOverflow, n.into()),
                Err(e) => tracing::debug!(parent: &port.span, error = %e, "SO_MEMINFO"),
            }
        }
        if read > 0 || !drained {
            self.arm_audit();
        }
    }
}

impl crate::port::WirePort for SoftPort {
    fn link(&self, vm: usize) -> crate::port::Link {
        // rdma_cm takes a RoCE route's MTU from the network device the address is on
        // (the primary address's).
        let primary = self.table().slots_of(vm).first().copied();
        let mtu = primary.and_then(|s| self.slot(s)).and_then(|s| {
            let iface = crate::port::iface_of(s.addr)?;
            crate::port::iboe_mtu(crate::port::if_mtu(&iface)?)
        });
        crate::port::Link {
            mtu,
            ca_ack_delay: None,
        }
    }

    fn rx_mode(&self) -> String {
        if self.raw.is_some() {
            RxMode::Raw.name().to_string()
        } else {
            RxMode::Udp.name().to_string()
        }
    }

    fn rx_mode_configured(&self) -> String {
        self.configured.name().to_string()
    }

    fn rx_buffer(&self) -> Option<RxBuffer> {
        self.raw.as_ref().map(|r| r.buffer)
    }

    fn degraded(&self) -> Vec<Degraded> {
        self.mode_degraded
            .iter()
            .cloned()
            .chain(self.rx_buffer().as_ref().and_then(buffer_degraded))
            .collect()
    }

    fn poll_fds(&self) -> Vec<(RawFd, u64)> {
        let mut fds: Vec<(RawFd, u64)> =
            self.raw.iter().map(|r| (r.as_raw_fd(), TOK_RAW)).collect();
        fds.push((
            self.audit_timer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .as_raw_fd(),
            TOK_AUDIT,
        ));
        fds.extend(
            self.slot_indices()
                .filter(|&s| self.reads_udp(s))
                .filter_map(|s| Some((self.sock(s)?.socket().as_raw_fd(), s as u64))),
        );
        fds
    }

    fn attach(&self, _vm: usize) -> Result<(), PortError> {
        Ok(())
    }

    fn changes_vms(&self) -> bool {
        true
    }

    fn add_vm(
        &self,
        vm: usize,
        spec: &crate::config::VmSpec,
        poll: &mut dyn FnMut(RawFd, u64) -> io::Result<()>,
    ) -> Result<(), PortError> {
        let name = &spec.vm.name;
        let bind_err = |e: Error| PortError::Bind(e);
        let addrs: Vec<(IpAddr, Option<String>)> = spec
            .addrs()
            .map(|(a, i)| (a, i.map(str::to_string)))
            .collect();
        let v6 = addrs.iter().any(|(a, _)| a.is_ipv6());
        if spec.incoming && (v6 || self.raw.is_none()) {
            return Err(bind_err(if v6 {
                Error::IncomingIpv6(name.clone())
            } else {
                Error::IncomingNeedsRaw(name.clone())
            }));
        }
        let addrs = scoped(name, &addrs, self.port_num).map_err(bind_err)?;
        {
            let mut t = self.table_mut();
            if let Some((a, _)) = addrs.iter().find(|(a, _)| t.by_addr.contains_key(a)) {
                return Err(bind_err(Error::WireBind {
                    vm: name.clone(),
                    addr: *a,
                    port: self.port_num,
                    source: io::Error::from(io::ErrorKind::AddrInUse),
                }));
            }
            t.add(vm, name, &addrs);
        }
        let undo = |e: PortError| {
            self.table_mut().remove(vm);
            e
        };
        if !spec.incoming {
            self.bind_vm(vm).map_err(|e| undo(bind_err(e)))?;
        }
        if let Some(raw) = &self.raw
            && addrs.iter().any(|(a, _)| a.is_ipv4())
        {
            let v4 = self.table().v4();
            raw.set_filter(self.port_num, &v4)
                .map_err(|e| undo(bind_err(Error::RawSocket(e))))?;
        }
        let slots = self.table().slots_of(vm).to_vec();
        for s in slots {
            if self.reads_udp(s)
                && let Some(sock) = self.sock(s)
            {
                poll(sock.socket().as_raw_fd(), s as u64).map_err(|source| {
                    undo(bind_err(Error::Io {
                        what: "epoll_ctl".into(),
                        source,
                    }))
                })?;
            }
        }
        Ok(())
    }

    fn remove_vm(&self, vm: usize, unpoll: &mut dyn FnMut(RawFd)) {
        let gone = self.table_mut().remove(vm);
        for (addr, sock) in &gone {
            if let Some(s) = sock
                && (self.raw.is_none() || addr.is_ipv6())
            {
                unpoll(s.socket().as_raw_fd());
            }
        }
        if let Some(raw) = &self.raw
            && gone.iter().any(|(a, _)| a.is_ipv4())
        {
            let v4 = self.table().v4();
            if let Err(e) = raw.set_filter(self.port_num, &v4) {
                tracing::warn!(error = %e, "raw socket filter not narrowed after a VM left");
            }
        }
    }

    fn claim(&self, vm: usize) -> Result<bool, PortError> {
        let slots = self.table().slots_of(vm).to_vec();
        if slots.iter().all(|&s| self.sock(s).is_some()) {
            return Ok(false);
        }
        if slots.iter().any(|&s| self.reads_udp(s)) {
            return Err(PortError::ClaimNeedsRaw);
        }
        self.bind_vm(vm).map_err(PortError::Bind)?;
        Ok(true)
    }

    fn release(&self, vm: usize) {
        let mut t = self.table_mut();
        for s in t.slots_of(vm).to_vec() {
            if let Some(at) = t.socks.get_mut(s) {
                *at = None;
            }
        }
    }

    fn send(&self, ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]) {
        let Some(port) = ctx.vms.get(vm) else {
            return;
        };
        // Each MAD leaves from the VM's address for its destination
        // (`VmConfig::source_for`): one batch per address used, the primary's first.
        let slots: Vec<(IpAddr, u32, std::sync::Arc<UdpPort>)> = {
            let t = self.table();
            t.slots_of(vm)
                .iter()
                .filter_map(|&s| {
                    let slot = t.slots.get(s)?.as_ref()?;
                    Some((slot.addr, slot.scope, t.socks.get(s)?.clone()?))
                })
                .collect()
        };
        if slots.is_empty() {
            return;
        }
        let mut frames: Vec<Vec<OutFrame>> = vec![Vec::new(); slots.len()];
        for (dst, mad) in mads {
            let own = crate::config::gid_addr(port.spec.vm.source_for(*dst));
            let built = slots
                .iter()
                .position(|(a, _, _)| *a == own)
                .is_some_and(|i| {
                    let (a, scope, sock) = &slots[i];
                    destination(*a, *scope, self.port_num, *dst)
                        .is_some_and(|to| sock.frame_into(&mut frames[i], to, mad))
                });
            if !built {
                tracing::debug!(parent: &port.span, %dst, "no route from this VM's addresses to the GID: dropped");
                port.counters.drop(DevDrop::BadRemoteGid);
            }
        }
        for ((_, _, sock), f) in slots.iter().zip(&frames) {
            Self::send_frames(ctx, port, sock, f);
        }
    }

    fn receive(&self, ctx: &PortCtx<'_>, token: u64, route: &mut dyn FnMut(Arrivals)) {
        thread_local! {
            static RB: std::cell::RefCell<Option<RecvBatch>> = const { std::cell::RefCell::new(None) };
        }
        RB.with(|rb| {
            let mut rb = rb.borrow_mut();
            let rb = rb.get_or_insert_with(RecvBatch::default);
            let read = match token {
                TOK_AUDIT => {
                    self.audit(ctx, rb, route);
                    0
                }
                TOK_RAW => self.on_raw(ctx, rb, route).0,
                slot => self.on_udp(ctx, slot as usize, rb, route),
            };
            if read > 0 {
                self.arm_audit();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvcm_wire::mad::{self, MGMT_CLASS_CM};
    use pvcm_wire::roce::Ipv4Repr;
    use std::net::Ipv6Addr;
    use std::os::fd::FromRawFd;

    fn v4(a: [u8; 4]) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(a))
    }

    fn sa4(a: Ipv4Addr, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(a, port))
    }

    #[test]
    fn loopback_batch_and_checks() {
        let a = UdpPort::bind(v4([127, 77, 0, 1]), 0, 4791).unwrap();
        let b = UdpPort::bind(v4([127, 77, 0, 2]), 0, 4791).unwrap();
        let mut mad = [0u8; MAD_LEN];
        mad::field::MGMT_CLASS.set(&mut mad, MGMT_CLASS_CM.into());
        let frames: Vec<_> = (0..100u8)
            .map(|i| {
                mad[255] = i;
                a.frame(b.local(), &mad).unwrap()
            })
            .collect();
        assert_eq!(a.send_batch(&frames), 100);
        let mut rb = RecvBatch::default();
        let mut got = 0;
        for _ in 0..1000 {
            let n = b.recv_batch(&mut rb).unwrap();
            for i in 0..n {
                let (src, d, trunc) = rb.get(i);
                assert!(!trunc);
                let f = check_frame(b.local(), src.unwrap(), d).unwrap();
                assert_eq!(f.mad[255] as usize, got);
                assert_eq!(f.src, Gid::from_ipv4(Ipv4Addr::new(127, 77, 0, 1)));
                got += 1;
            }
            if got == 100 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(got, 100);
        // Every corruption is caught with its reason.
        let good = frames[0].frame;
        let src = a.local();
        let mut f = good;
        f[279] ^= 1;
        assert_eq!(
            check_frame(b.local(), src, &f).unwrap_err(),
            DevDrop::WireBadIcrc
        );
        let mut f = good;
        f[0] = 0x04;
        assert_eq!(
            check_frame(b.local(), src, &f).unwrap_err(),
            DevDrop::WireBadBth
        );
        let mut f = good;
        f[7] = 2; // dest QP 2
        assert_eq!(
            check_frame(b.local(), src, &f).unwrap_err(),
            DevDrop::WireBadBth
        );
        let mut f = good;
        f[12] = 0; // Q_Key
        assert_eq!(
            check_frame(b.local(), src, &f).unwrap_err(),
            DevDrop::WireBadDeth
        );
        assert_eq!(
            check_frame(b.local(), src, &good[..200]).unwrap_err(),
            DevDrop::WireBadLength
        );
        // From another source port the ICRC no longer matches.
        let other = SocketAddr::new(src.ip(), 5000);
        assert_eq!(
            check_frame(b.local(), other, &good).unwrap_err(),
            DevDrop::WireBadIcrc
        );
    }

    /// Sends one whole IPv4 datagram with the header as given (IP_HDRINCL), the way a
    /// sender that writes its own IP ID (Linux rxe) puts it on the wire.
    fn send_hdrincl(datagram: &[u8], dst: Ipv4Addr) -> io::Result<()> {
        // SAFETY: plain socket(2) call; checked before use.
        let fd = cvt(unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) })?;
        // SAFETY: just returned by socket(2).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(dst).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: the buffer and address are live for the call.
        let r = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                datagram.as_ptr().cast(),
                datagram.len(),
                0,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// An rxe-style datagram: hashed IP ID, DF, a UDP source port from the flow label,
    /// ICRC over exactly that header.
    fn rxe_datagram(src: Ipv4Addr, dst: Ipv4Addr, dst_port: u16, id: u16, tag: u8) -> Vec<u8> {
        let mut mad = [0u8; MAD_LEN];
        mad::field::MGMT_CLASS.set(&mut mad, MGMT_CLASS_CM.into());
        mad[255] = tag;
        let ip = Ipv4Repr {
            identification: id,
            ..Ipv4Repr::new(src, dst)
        };
        let udp = UdpRepr {
            src_port: 0xC123,
            dst_port,
            length: (roce::UDP_HEADER_LEN + FRAME_LEN) as u16,
        };
        let mut d = vec![0u8; roce::DATAGRAM_LEN];
        FrameRepr::gsi(7, &mad)
            .emit_datagram(&mut d, &ip, &udp)
            .unwrap();
        d
    }

    fn recv_raw(rx: &RawRx, want: usize) -> Vec<Vec<u8>> {
        let mut rb = RecvBatch::default();
        let mut got = Vec::new();
        for _ in 0..500 {
            let n = rx.recv_batch(&mut rb).unwrap();
            for i in 0..n {
                got.push(rb.get(i).1.to_vec());
            }
            if got.len() >= want {
                // Anything more would be a filter leak: give it a moment to show.
                std::thread::sleep(std::time::Duration::from_millis(20));
                let n = rx.recv_batch(&mut rb).unwrap();
                for i in 0..n {
                    got.push(rb.get(i).1.to_vec());
                }
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        got
    }

    /// A port opened with no VM keeps the receive mode configured: an IPv4 VM added
    /// later is read through the raw socket, so a frame with a non-zero IP ID (Linux
    /// rxe's) passes its ICRC check. Needs CAP_NET_RAW, as CI has.
    #[test]
    fn a_port_with_no_vm_keeps_raw_receive_for_a_vm_added_later() {
        use crate::port::WirePort;
        let (ours, sender, port_num) = (
            Ipv4Addr::new(127, 81, 0, 1),
            Ipv4Addr::new(127, 81, 0, 9),
            4781,
        );
        for mode in [RxMode::Auto, RxMode::Raw] {
            let port = SoftPort::open(&[], &[], port_num, mode).unwrap();
            assert_eq!(port.rx_mode(), "raw", "{mode:?}");
            assert_eq!(port.rx_mode_configured(), mode.name());
            assert!(port.degraded().is_empty(), "{:?}", port.degraded());
            let spec: crate::config::VmSpec =
                format!("socket=/x/a,gid={ours},name=a").parse().unwrap();
            port.add_vm(0, &spec, &mut |_, _| Ok(())).unwrap();
            let vm = crate::vm_port::VmPort::for_test(0, spec);
            let host = crate::stats::DevCounters::default();
            let vms = crate::vm_port::VmSet::new(vec![vm.clone()]);
            let ctx = PortCtx {
                vms: &vms,
                host: &host,
                capture: None,
            };
            send_hdrincl(&rxe_datagram(sender, ours, port_num, 0x5a5a, 7), ours).unwrap();
            let mut got = Vec::new();
            for _ in 0..200 {
                port.receive(&ctx, TOK_RAW, &mut |batch| {
                    for (i, mads) in batch {
                        got.extend(mads.iter().map(|m| (i, m.mad[255])));
                    }
                });
                if !got.is_empty() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            assert_eq!(got, vec![(0, 7)], "{mode:?}");
            assert_eq!(vm.counters.dropped(DevDrop::WireBadIcrc), 0);
            port.remove_vm(0, &mut |_| {});
        }
    }

    /// Raw mode (needs CAP_NET_RAW, as CI has): a frame with a non-zero IP ID, which the
    /// udp mode must drop, passes with its ICRC checked over the header as received; a
    /// corrupted one is dropped; the filter passes only our port and addresses.
    #[test]
    fn raw_rx_accepts_a_nonzero_ip_id_and_filters() {
        let (ours, other, sender) = (
            Ipv4Addr::new(127, 78, 0, 1),
            Ipv4Addr::new(127, 78, 0, 2),
            Ipv4Addr::new(127, 78, 0, 9),
        );
        let port = 4799;
        let rx = match RawRx::open(port, &[ours]) {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied && !is_root() => {
                eprintln!("SKIP raw_rx test: no CAP_NET_RAW ({e})");
                return;
            }
            Err(e) => panic!("raw socket: {e}"),
        };
        // Bound like the daemon binds it, so the kernel never answers ICMP.
        let udp = UdpPort::bind(IpAddr::V4(ours), 0, port).unwrap();
        udp.discard_rx().unwrap();
        let good = rxe_datagram(sender, ours, port, 0x5a17, 1);
        let mut bad_icrc = rxe_datagram(sender, ours, port, 0x5a18, 2);
        let last = bad_icrc.len() - 1;
        bad_icrc[last] ^= 0x40;
        send_hdrincl(&good, ours).unwrap();
        send_hdrincl(&bad_icrc, ours).unwrap();
        // Filtered out by the kernel: another address, another port.
        send_hdrincl(&rxe_datagram(sender, other, port, 0x5a19, 3), other).unwrap();
        send_hdrincl(&rxe_datagram(sender, ours, port + 1, 0x5a1a, 4), ours).unwrap();
        let got = recv_raw(&rx, 2);
        assert_eq!(got.len(), 2, "exactly our two datagrams pass the filter");
        let (dst, f) = check_datagram(&got[0]).unwrap();
        assert_eq!(dst, sa4(ours, port));
        assert_eq!(f.src, Gid::from_ipv4(sender));
        assert_eq!(f.src_addr, sa4(sender, 0xC123));
        assert_eq!(f.mad[255], 1);
        assert_eq!(check_datagram(&got[1]).unwrap_err(), DevDrop::WireBadIcrc);
        // The same good frame seen through a UDP socket (no IP header) fails the ID-0
        // check: what udp mode cannot accept.
        assert_eq!(
            check_frame(
                sa4(ours, port),
                sa4(sender, 0xC123),
                &got[0][roce::IPV4_HEADER_LEN + roce::UDP_HEADER_LEN..]
            )
            .unwrap_err(),
            DevDrop::WireBadIcrc
        );
        // A pvcm peer's frame (ID 0, DF, from the UDP socket) passes raw mode too.
        let peer = UdpPort::bind(IpAddr::V4(sender), 0, port).unwrap();
        let mut mad = [0u8; MAD_LEN];
        mad::field::MGMT_CLASS.set(&mut mad, MGMT_CLASS_CM.into());
        mad[255] = 5;
        assert_eq!(
            peer.send_batch(&[peer.frame(udp.local(), &mad).unwrap()]),
            1
        );
        let got = recv_raw(&rx, 1);
        assert_eq!(got.len(), 1);
        let (_, f) = check_datagram(&got[0]).unwrap();
        assert_eq!(f.mad[255], 5);
        // Nothing queued on the discarding UDP socket.
        let mut rb = RecvBatch::default();
        assert_eq!(udp.recv_batch(&mut rb).unwrap(), 0);
    }

    #[test]
    fn check_datagram_rejects_bad_ip() {
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        let good = rxe_datagram(a, b, 4791, 77, 0);
        assert!(check_datagram(&good).is_ok());
        let mut f = good.clone();
        f[0] = 0x46; // IHL 6: options
        assert_eq!(check_datagram(&f).unwrap_err(), DevDrop::WireBadIp);
        let mut f = good.clone();
        f[8] ^= 1; // TTL changed, checksum now wrong
        assert_eq!(check_datagram(&f).unwrap_err(), DevDrop::WireBadIp);
        let mut f = good.clone();
        f[6] |= 0x20; // MF
        assert_eq!(check_datagram(&f).unwrap_err(), DevDrop::WireBadIp);
        assert_eq!(
            check_datagram(&good[..100]).unwrap_err(),
            DevDrop::WireBadLength
        );
        let mut f = good.clone();
        f.push(0);
        assert_eq!(check_datagram(&f).unwrap_err(), DevDrop::WireBadLength);
        // IP ID and flags are covered: a changed ID (checksum fixed) fails the ICRC.
        let mut f = good.clone();
        f[4] ^= 1;
        let mut ip = Ipv4Repr::parse(&good).unwrap();
        ip.identification ^= 0x0100;
        ip.emit(&mut f[..roce::IPV4_HEADER_LEN]).unwrap();
        assert_eq!(check_datagram(&f).unwrap_err(), DevDrop::WireBadIcrc);
    }

    fn cm_mad(tag: u8) -> [u8; MAD_LEN] {
        let mut mad = [0u8; MAD_LEN];
        mad::field::MGMT_CLASS.set(&mut mad, MGMT_CLASS_CM.into());
        mad[255] = tag;
        mad
    }

    fn v6(s: &str) -> IpAddr {
        IpAddr::V6(s.parse().unwrap())
    }

    /// Receives from a UDP port until `want` datagrams came (or ~1 s passed).
    fn recv_udp(p: &UdpPort, want: usize) -> Vec<(SocketAddr, Vec<u8>)> {
        let mut rb = RecvBatch::default();
        let mut got = Vec::new();
        for _ in 0..500 {
            let n = p.recv_batch(&mut rb).unwrap();
            for i in 0..n {
                let (src, d, _) = rb.get(i);
                got.push((src.unwrap(), d.to_vec()));
            }
            if got.len() >= want {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        got
    }

    /// IPv6 through UDP sockets on addresses added to lo in a network namespace: frames
    /// round-trip with their ICRC checked exactly; corruptions are caught; a link-local
    /// pair works in the scope of its interface.
    #[test]
    fn ipv6_udp_sockets_in_a_netns() {
        super::super::testnet::in_netns("soft port IPv6", || {
            use super::super::testnet::add_addr;
            add_addr("lo", "fd00:77::1/128");
            add_addr("lo", "fd00:77::2/128");
            add_addr("lo", "fe80::77:1/64");
            add_addr("lo", "fe80::77:2/64");
            let a = UdpPort::bind(v6("fd00:77::1"), 0, 4791).unwrap();
            let b = UdpPort::bind(v6("fd00:77::2"), 0, 4791).unwrap();
            let frames: Vec<OutFrame> = (0..10)
                .map(|i| a.frame(b.local(), &cm_mad(i)).unwrap())
                .collect();
            assert_eq!(a.send_batch(&frames), 10);
            let got = recv_udp(&b, 10);
            assert_eq!(got.len(), 10);
            for (i, (src, d)) in got.iter().enumerate() {
                assert_eq!(*src, a.local());
                let f = check_frame(b.local(), *src, d).unwrap();
                assert_eq!(f.src, Gid::from("fd00:77::1".parse::<Ipv6Addr>().unwrap()));
                assert_eq!(f.mad[255] as usize, i);
            }
            // An IPv4 destination from an IPv6 port: no frame.
            assert!(
                a.frame(sa4(Ipv4Addr::LOCALHOST, 4791), &cm_mad(0))
                    .is_none()
            );
            // Corruptions: the ICRC covers the addresses and ports.
            let good = &got[0].1;
            let mut f = good.clone();
            f[100] ^= 1;
            assert_eq!(
                check_frame(b.local(), a.local(), &f).unwrap_err(),
                DevDrop::WireBadIcrc
            );
            let other = SocketAddr::new(v6("fd00:77::3"), 4791);
            assert_eq!(
                check_frame(b.local(), other, good).unwrap_err(),
                DevDrop::WireBadIcrc
            );
            let port = SocketAddr::new(a.local().ip(), 4792);
            assert_eq!(
                check_frame(b.local(), port, good).unwrap_err(),
                DevDrop::WireBadIcrc
            );
            // A mixed pair cannot be checked at all.
            assert_eq!(
                check_frame(b.local(), sa4(Ipv4Addr::LOCALHOST, 4791), good).unwrap_err(),
                DevDrop::WireBadSource
            );
            // Link-local, in lo's scope.
            let lo = if_index("lo").unwrap();
            let c = UdpPort::bind(v6("fe80::77:1"), lo, 4791).unwrap();
            let d = UdpPort::bind(v6("fe80::77:2"), lo, 4791).unwrap();
            assert_eq!(c.send_batch(&[c.frame(d.local(), &cm_mad(9)).unwrap()]), 1);
            let got = recv_udp(&d, 1);
            assert_eq!(got.len(), 1);
            let f = check_frame(d.local(), got[0].0, &got[0].1).unwrap();
            assert_eq!(f.mad[255], 9);
            // Without a scope a link-local address cannot be bound.
            assert!(UdpPort::bind(v6("fe80::77:1"), 0, 4793).is_err());
        });
    }

    /// Sends one whole IPv6 datagram with its header as given (IPPROTO_RAW), as rxe puts
    /// it on the wire: UDP checksum 0, which an IPv6 UDP socket accepts only with
    /// UDP_NO_CHECK6_RX.
    fn send_hdrincl6(datagram: &[u8], dst: Ipv6Addr) -> io::Result<()> {
        // SAFETY: plain socket(2) call; checked before use.
        let fd = cvt(unsafe { libc::socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_RAW) })?;
        // SAFETY: just returned by socket(2).
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (sa, len) = sockaddr_of(&SocketAddr::new(IpAddr::V6(dst), 0));
        // SAFETY: the buffer and address are live for the call.
        let r = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                datagram.as_ptr().cast(),
                datagram.len(),
                0,
                (&sa as *const libc::sockaddr_storage).cast(),
                len,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    #[test]
    fn ipv6_zero_udp_checksum_is_accepted() {
        super::super::testnet::in_netns("soft port IPv6 checksum 0", || {
            use super::super::testnet::add_addr;
            add_addr("lo", "fd00:78::1/128");
            add_addr("lo", "fd00:78::2/128");
            let b = UdpPort::bind(v6("fd00:78::2"), 0, 4791).unwrap();
            let (src, dst): (Ipv6Addr, Ipv6Addr) =
                ("fd00:78::1".parse().unwrap(), "fd00:78::2".parse().unwrap());
            let ip6 = roce::Ipv6Repr {
                flow_label: 0x12345,
                traffic_class: 0x20,
                ..roce::Ipv6Repr::new(src, dst)
            };
            let udp = UdpRepr {
                src_port: 0xd872,
                ..UdpRepr::new(0xd872)
            };
            let mut d = vec![0u8; roce::IPV6_DATAGRAM_LEN];
            FrameRepr::gsi(3, &cm_mad(42))
                .emit_datagram(&mut d, &ip6, &udp)
                .unwrap();
            d[46] = 0; // UDP checksum 0, as rxe sends it
            d[47] = 0;
            roce::check_datagram_icrc(&d).unwrap();
            send_hdrincl6(&d, dst).unwrap();
            let got = recv_udp(&b, 1);
            assert_eq!(got.len(), 1, "the zero-checksum datagram must arrive");
            let f = check_frame(b.local(), got[0].0, &got[0].1).unwrap();
            assert_eq!(f.mad[255], 42);
            assert_eq!(f.src_addr, SocketAddr::new(IpAddr::V6(src), 0xd872));
        });
    }

    /// One port, IPv4 and IPv6 VMs, raw receive: the IPv4 VMs are read through the raw
    /// socket, the IPv6 ones through their own; MADs are routed by GID, the capture has
    /// both families, and nothing is dropped.
    #[test]
    fn mixed_families_on_one_port() {
        super::super::testnet::in_netns("soft port mixed families", || {
            use super::super::testnet::add_addr;
            use crate::config::VmSpec;
            use crate::port::WirePort;
            add_addr("lo", "fd00:79::1/128");
            add_addr("lo", "fd00:79::2/128");
            let spec = |name: &str, g: &str| -> SoftVmAddrs {
                let s: VmSpec = format!("socket=/x/{name},gid={g},name={name}")
                    .parse()
                    .unwrap();
                (name.to_string(), vec![(s.addr(), s.iface)])
            };
            let vms = vec![
                spec("a4", "127.79.0.1"),
                spec("b4", "127.79.0.2"),
                spec("a6", "fd00:79::1"),
                spec("b6", "fd00:79::2"),
            ];
            let port = SoftPort::open(&vms, &[false; 4], 4791, RxMode::Raw).unwrap();
            assert_eq!(port.rx_mode(), "raw");
            let toks: Vec<u64> = port.poll_fds().iter().map(|(_, t)| *t).collect();
            assert_eq!(toks, vec![TOK_RAW, TOK_AUDIT, 2, 3]);
            let ports: Vec<_> = vms
                .iter()
                .enumerate()
                .map(|(i, (n, _))| {
                    let s: VmSpec = format!("socket=/x/{n},gid={},name={n}", vms[i].1[0].0)
                        .parse()
                        .unwrap();
                    crate::vm_port::VmPort::for_test(i, s)
                })
                .collect();
            let host = crate::stats::DevCounters::default();
            let dir = tempfile::tempdir().unwrap();
            let cap = crate::pcap::Capture::create(&dir.path().join("c.pcap")).unwrap();
            let ctx = PortCtx {
                vms: &crate::vm_port::VmSet::new(ports.clone()),
                host: &host,
                capture: Some(&cap),
            };
            let g = |i: usize| ports[i].spec.vm.gid;
            let (m1, m2, m3) = (cm_mad(1), cm_mad(2), cm_mad(3));
            port.send(&ctx, 0, &[(g(1), &m1), (g(3), &m3)]); // a4 -> b4, a4 -> b6 (no)
            port.send(&ctx, 2, &[(g(3), &m2), (g(1), &m3)]); // a6 -> b6, a6 -> b4 (no)
            assert_eq!(ports[0].counters.dropped(DevDrop::BadRemoteGid), 1);
            assert_eq!(ports[2].counters.dropped(DevDrop::BadRemoteGid), 1);
            assert_eq!(ports[0].counters.io(Io::WireTxFrames), 1);
            assert_eq!(ports[2].counters.io(Io::WireTxFrames), 1);
            let mut got: Vec<(usize, Gid, u8)> = Vec::new();
            for _ in 0..200 {
                for tok in &toks {
                    port.receive(&ctx, *tok, &mut |batch| {
                        for (vm, mads) in batch {
                            for m in mads {
                                got.push((vm, m.src, m.mad[255]));
                            }
                        }
                    });
                }
                if got.len() >= 2 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            got.sort();
            assert_eq!(got, vec![(1, g(0), 1), (3, g(2), 2)]);
            for p in &ports {
                for r in DevDrop::ALL {
                    if *r != DevDrop::BadRemoteGid {
                        assert_eq!(p.counters.dropped(*r), 0, "{}", r.name());
                    }
                }
            }
            cap.flush();
            let mut r = pcap_file::pcap::PcapReader::new(
                std::fs::File::open(dir.path().join("c.pcap")).unwrap(),
            )
            .unwrap();
            let mut versions = Vec::new();
            while let Some(p) = r.next_packet() {
                let p = p.unwrap();
                versions.push(p.data[0] >> 4);
                roce::check_datagram_icrc(&p.data).unwrap();
            }
            versions.sort();
            assert_eq!(versions, vec![4, 4, 6, 6]);
            // An incoming IPv6 VM is refused on the soft port.
            let e = SoftPort::open(&vms[2..3], &[true], 4795, RxMode::Raw).unwrap_err();
            assert!(e.to_string().contains("IPv4 GID"), "{e}");
        });
    }

    /// A VM with an IPv4 and an IPv6 address on a raw-mode port: each address has its
    /// socket (the IPv6 one polled), frames to either reach the VM with that address as
    /// destination, it sends from its address of the destination's family, and removing
    /// it at runtime frees both addresses; added again, it is served at both again.
    #[test]
    fn a_vm_with_two_addresses_is_served_at_both() {
        super::super::testnet::in_netns("soft port two addresses", || {
            use super::super::testnet::add_addr;
            use crate::config::VmSpec;
            use crate::port::WirePort;
            add_addr("lo", "fd00:79::5/128");
            add_addr("lo", "fd00:79::6/128");
            let specs: Vec<VmSpec> = [
                "socket=/x/d,gid=127.79.0.5,gid=fd00:79::5,name=d",
                "socket=/x/b4,gid=127.79.0.6,name=b4",
                "socket=/x/b6,gid=fd00:79::6,name=b6",
            ]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
            let vms: Vec<SoftVmAddrs> = specs
                .iter()
                .map(|s| {
                    let a = s.addrs().map(|(a, i)| (a, i.map(str::to_string)));
                    (s.vm.name.clone(), a.collect())
                })
                .collect();
            let port = SoftPort::open(&vms, &[false; 3], 4791, RxMode::Raw).unwrap();
            // The raw socket, the audit, then the IPv6 addresses' sockets by slot.
            let toks: Vec<u64> = port.poll_fds().iter().map(|(_, t)| *t).collect();
            assert_eq!(toks, vec![TOK_RAW, TOK_AUDIT, 1, 3]);
            let ports: Vec<_> = specs
                .iter()
                .enumerate()
                .map(|(i, s)| crate::vm_port::VmPort::for_test(i, s.clone()))
                .collect();
            let host = crate::stats::DevCounters::default();
            let set = crate::vm_port::VmSet::new(ports.clone());
            let ctx = PortCtx {
                vms: &set,
                host: &host,
                capture: None,
            };
            let g = |s: &str| -> Gid { s.parse().unwrap() };
            let receive = |port: &SoftPort, toks: &[u64], want: usize| {
                let mut got: Vec<(usize, Gid, Gid, u8)> = Vec::new();
                for _ in 0..200 {
                    for tok in toks {
                        port.receive(&ctx, *tok, &mut |batch| {
                            for (vm, mads) in batch {
                                got.extend(mads.iter().map(|m| (vm, m.src, m.dst, m.mad[255])));
                            }
                        });
                    }
                    if got.len() >= want {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                got.sort_by_key(|x| x.3);
                got
            };
            let (m1, m2, m3, m4) = (cm_mad(1), cm_mad(2), cm_mad(3), cm_mad(4));
            port.send(&ctx, 0, &[(g("127.79.0.6"), &m1), (g("fd00:79::6"), &m2)]);
            port.send(&ctx, 1, &[(g("::ffff:127.79.0.5"), &m3)]);
            port.send(&ctx, 2, &[(g("fd00:79::5"), &m4)]);
            assert_eq!(ports[0].counters.io(Io::WireTxFrames), 2);
            assert_eq!(
                receive(&port, &toks, 4),
                vec![
                    (1, g("::ffff:127.79.0.5"), g("::ffff:127.79.0.6"), 1),
                    (2, g("fd00:79::5"), g("fd00:79::6"), 2),
                    (0, g("::ffff:127.79.0.6"), g("::ffff:127.79.0.5"), 3),
                    (0, g("fd00:79::6"), g("fd00:79::5"), 4),
                ]
            );
            // Removed: both addresses are free (bindable by anyone); added back (index
            // 3), served at both again.
            let mut unpolled = Vec::new();
            port.remove_vm(0, &mut |fd| unpolled.push(fd));
            assert_eq!(unpolled.len(), 1, "the IPv6 address's socket");
            for a in ["127.79.0.5", "fd00:79::5"] {
                UdpPort::bind(a.parse().unwrap(), 0, 4791).expect(a);
            }
            let mut polled = Vec::new();
            port.add_vm(3, &specs[0], &mut |_, t| {
                polled.push(t);
                Ok(())
            })
            .unwrap();
            assert_eq!(polled, vec![5]);
            let again = port.add_vm(4, &specs[0], &mut |_, _| Ok(()));
            assert!(matches!(again, Err(PortError::Bind(_))), "{again:?}");
        });
    }

    /// A soft port for one VM `a` at `gid`, its VmPort and the host counters.
    fn one_vm_port(
        gid: &str,
        mode: RxMode,
    ) -> (
        SoftPort,
        Vec<std::sync::Arc<crate::vm_port::VmPort>>,
        crate::stats::DevCounters,
    ) {
        let s: crate::config::VmSpec = format!("socket=/x/a,gid={gid},name=a").parse().unwrap();
        let vms = vec![("a".to_string(), vec![(s.addr(), None)])];
        let port = SoftPort::open(&vms, &[false], 4791, mode).unwrap();
        let ports = vec![crate::vm_port::VmPort::for_test(0, s)];
        (port, ports, crate::stats::DevCounters::default())
    }

    /// Runs a classic BPF program of the instructions [`raw_filter`] uses on `pkt`;
    /// panics on a jump out of the program or an unknown instruction.
    fn run_bpf(prog: &[libc::sock_filter], pkt: &[u8]) -> u32 {
        let (mut a, mut x, mut pc) = (0u32, 0u32, 0usize);
        let h = |off: usize| u32::from(u16::from_be_bytes([pkt[off], pkt[off + 1]]));
        loop {
            let i = prog[pc];
            pc += 1;
            match i.code {
                c if c == BPF_LD | BPF_H | BPF_ABS => a = h(i.k as usize),
                c if c == BPF_LD | BPF_W | BPF_ABS => {
                    let k = i.k as usize;
                    a = u32::from_be_bytes([pkt[k], pkt[k + 1], pkt[k + 2], pkt[k + 3]]);
                }
                c if c == BPF_LDX | BPF_B | BPF_MSH => x = u32::from(pkt[i.k as usize] & 0xf) * 4,
                c if c == BPF_LD | BPF_H | BPF_IND => a = h((x + i.k) as usize),
                c if c == BPF_JMP | BPF_JSET | BPF_K => {
                    pc += usize::from(if a & i.k != 0 { i.jt } else { i.jf })
                }
                c if c == BPF_JMP | BPF_JEQ | BPF_K => {
                    pc += usize::from(if a == i.k { i.jt } else { i.jf })
                }
                c if c == BPF_JMP | BPF_JA => pc += i.k as usize,
                c if c == BPF_RET | BPF_K => return i.k,
                c => panic!("instruction {c:#x}"),
            }
            assert!(pc < prog.len(), "jump out of the program");
        }
    }

    /// The raw filter takes exactly the datagrams to its port at its addresses, for any
    /// number of addresses: the compares past one jump's reach come in chunks.
    #[test]
    fn the_raw_filter_takes_its_addresses_however_many() {
        let pkt = |dst: Ipv4Addr, port: u16, frag: u16| {
            let mut p = vec![0u8; 28];
            p[0] = 0x45;
            p[6..8].copy_from_slice(&frag.to_be_bytes());
            p[16..20].copy_from_slice(&dst.octets());
            p[22..24].copy_from_slice(&port.to_be_bytes());
            p
        };
        for n in [1usize, 3, 249, 250, 251, 500, 777, BPF_MAX_ADDRS] {
            let addrs: Vec<Ipv4Addr> = (0..n as u32)
                .map(|i| Ipv4Addr::from(0x7f40_0000 + i * 7))
                .collect();
            let prog = raw_filter(4791, &addrs);
            assert!(
                prog.len() <= 4096,
                "{n} addresses: {} instructions",
                prog.len()
            );
            for a in &addrs {
                assert_eq!(run_bpf(&prog, &pkt(*a, 4791, 0)), BPF_ACCEPT, "{n}: {a}");
                assert_eq!(run_bpf(&prog, &pkt(*a, 4792, 0)), 0, "{n}: {a} other port");
                assert_eq!(
                    run_bpf(&prog, &pkt(*a, 4791, 0x0010)),
                    0,
                    "{n}: {a} fragment"
                );
            }
            let stranger = Ipv4Addr::from(0x7f40_0000 + 7 * n as u32 + 1);
            assert_eq!(
                run_bpf(&prog, &pkt(stranger, 4791, 0)),
                0,
                "{n}: a stranger"
            );
        }
        // Past the most it checks, the filter takes the port only.
        let many: Vec<Ipv4Addr> = (0..=BPF_MAX_ADDRS as u32).map(Ipv4Addr::from).collect();
        let prog = raw_filter(4791, &many);
        assert_eq!(
            run_bpf(&prog, &pkt(Ipv4Addr::new(10, 0, 0, 1), 4791, 0)),
            BPF_ACCEPT
        );
        assert_eq!(run_bpf(&prog, &pkt(Ipv4Addr::new(10, 0, 0, 1), 4790, 0)), 0);
    }

    /// Raw mode: one receive batch that spans several VMs reaches the host loop as one
    /// call, each VM's MADs grouped once and in arrival order, so the loop takes the mux
    /// lock and wakes each VM once per batch.
    #[test]
    fn raw_mode_routes_a_batch_for_many_vms_in_one_call() {
        if !is_root() {
            eprintln!("skipped: needs CAP_NET_RAW");
            return;
        }
        super::super::testnet::in_netns("soft port raw batch", || {
            use crate::port::WirePort;
            let specs: Vec<crate::config::VmSpec> = (1..=3)
                .map(|v| {
                    format!("socket=/x/v{v},gid=127.84.0.{v},name=v{v}")
                        .parse()
                        .unwrap()
                })
                .collect();
            let vms: Vec<_> = specs
                .iter()
                .map(|s| (s.vm.name.clone(), vec![(s.addr(), None)]))
                .collect();
            let port = SoftPort::open(&vms, &[false; 3], 4791, RxMode::Raw).unwrap();
            let ports: Vec<_> = specs
                .iter()
                .enumerate()
                .map(|(i, s)| crate::vm_port::VmPort::for_test(i, s.clone()))
                .collect();
            let host = crate::stats::DevCounters::default();
            let ctx = PortCtx {
                vms: &crate::vm_port::VmSet::new(ports.clone()),
                host: &host,
                capture: None,
            };
            let peer = UdpPort::bind(v4([127, 84, 0, 9]), 0, 4791).unwrap();
            let frames: Vec<OutFrame> = (0..30u8)
                .map(|i| {
                    let to = sa4(Ipv4Addr::new(127, 84, 0, 1 + i % 3), 4791);
                    peer.frame(to, &cm_mad(i)).unwrap()
                })
                .collect();
            assert_eq!(peer.send_batch(&frames), 30);
            std::thread::sleep(std::time::Duration::from_millis(20));
            let mut calls: Vec<Vec<(usize, Vec<u8>)>> = Vec::new();
            port.receive(&ctx, TOK_RAW, &mut |b: Arrivals| {
                calls.push(
                    b.into_iter()
                        .map(|(vm, m)| (vm, m.iter().map(|m| m.mad[255]).collect()))
                        .collect(),
                )
            });
            assert_eq!(calls.len(), 1, "one call for the batch: {calls:?}");
            let mut groups = calls.remove(0);
            groups.sort();
            let want: Vec<(usize, Vec<u8>)> = (0..3)
                .map(|v| (v, (0..30u8).filter(|i| usize::from(i % 3) == v).collect()))
                .collect();
            assert_eq!(groups, want);
        });
    }

    /// Raw mode: the frames the kernel drops for a VM are counted exactly, while frames
    /// to another address, dropped by the same full raw queue, are not counted as ours.
    #[test]
    fn raw_mode_counts_exactly_the_frames_lost_for_its_vms() {
        if !is_root() {
            eprintln!("skipped: needs CAP_NET_RAW");
            return;
        }
        super::super::testnet::in_netns("soft port raw loss audit", || {
            use crate::port::WirePort;
            let (port, ports, host) = one_vm_port("127.82.0.1", RxMode::Raw);
            let ctx = PortCtx {
                vms: &crate::vm_port::VmSet::new(ports.clone()),
                host: &host,
                capture: None,
            };
            let raw = port.raw.as_ref().unwrap().as_raw_fd();
            setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, 1).unwrap();
            let peer = UdpPort::bind(v4([127, 82, 0, 9]), 0, 4791).unwrap();
            let other = UdpPort::bind(v4([127, 82, 0, 2]), 0, 4791).unwrap();
            let ours = sa4(Ipv4Addr::new(127, 82, 0, 1), 4791);
            // Interleaved: 150 frames for the VM, 150 for an address that is not ours.
            let frames: Vec<OutFrame> = (0..300u16)
                .map(|i| {
                    let to = if i % 2 == 0 { ours } else { other.local() };
                    peer.frame(to, &cm_mad(i as u8)).unwrap()
                })
                .collect();
            assert_eq!(peer.send_batch(&frames), 300);
            let got = std::cell::Cell::new(0usize);
            let mut route =
                |b: Arrivals| got.set(got.get() + b.iter().map(|(_, m)| m.len()).sum::<usize>());
            for _ in 0..20 {
                port.receive(&ctx, TOK_RAW, &mut route);
            }
            std::thread::sleep(AUDIT_AFTER * 2);
            port.receive(&ctx, TOK_AUDIT, &mut route);
            let lost = ports[0].counters.dropped(DevDrop::WireRxOverflow);
            let rx = ports[0].counters.io(Io::WireRxFrames);
            assert!(
                lost > 0,
                "the raw queue must have overflowed ({rx} received)"
            );
            assert_eq!(rx as usize, got.get());
            assert_eq!(rx + lost, 150, "{rx} received, {lost} counted as lost");
            assert_eq!(host.dropped(DevDrop::WireRxOverflow), 0);
            // The kernel's own count for the raw socket includes the other address's.
            assert!(socket_drops(raw).unwrap() as u64 > lost);
            // Counted once: a later audit adds nothing.
            port.arm_audit();
            std::thread::sleep(AUDIT_AFTER * 2);
            port.receive(&ctx, TOK_AUDIT, &mut route);
            assert_eq!(ports[0].counters.dropped(DevDrop::WireRxOverflow), lost);
        });
    }

    /// Udp mode: drops at the end of a burst, which no later datagram reports, are
    /// counted by the audit (`SO_MEMINFO`), once.
    #[test]
    fn udp_mode_audit_counts_the_last_drops_of_a_burst() {
        super::super::testnet::in_netns("soft port udp loss audit", || {
            use crate::port::WirePort;
            let (port, ports, host) = one_vm_port("127.83.0.1", RxMode::Udp);
            let ctx = PortCtx {
                vms: &crate::vm_port::VmSet::new(ports.clone()),
                host: &host,
                capture: None,
            };
            let sock = port.sock(0).unwrap();
            setsockopt_int(
                sock.socket().as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                1,
            )
            .unwrap();
            let peer = UdpPort::bind(v4([127, 83, 0, 9]), 0, 4791).unwrap();
            let frames: Vec<OutFrame> = (0..200u8)
                .map(|i| peer.frame(sock.local(), &cm_mad(i)).unwrap())
                .collect();
            assert_eq!(peer.send_batch(&frames), 200);
            for _ in 0..20 {
                port.receive(&ctx, 0, &mut |_| {});
            }
            std::thread::sleep(AUDIT_AFTER * 2);
            port.receive(&ctx, TOK_AUDIT, &mut |_| {});
            let lost = ports[0].counters.dropped(DevDrop::WireRxOverflow);
            let rx = ports[0].counters.io(Io::WireRxFrames);
            assert!(lost > 0, "the queue must have overflowed ({rx} received)");
            assert_eq!(rx + lost, 200, "{rx} received, {lost} counted as lost");
            // One more datagram reports the same count: nothing is counted twice.
            assert_eq!(
                peer.send_batch(&[peer.frame(sock.local(), &cm_mad(0)).unwrap()]),
                1
            );
            for _ in 0..50 {
                port.receive(&ctx, 0, &mut |_| {});
                if ports[0].counters.io(Io::WireRxFrames) == rx + 1 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            assert_eq!(ports[0].counters.io(Io::WireRxFrames), rx + 1);
            assert_eq!(ports[0].counters.dropped(DevDrop::WireRxOverflow), lost);
        });
    }

    /// SO_RXQ_OVFL: datagrams the kernel drops on a full receive queue are counted.
    #[test]
    fn kernel_drops_are_counted() {
        super::super::testnet::in_netns("soft port rx overflow", || {
            let a = UdpPort::bind(v4([127, 80, 0, 1]), 0, 4791).unwrap();
            let b = UdpPort::bind(v4([127, 80, 0, 2]), 0, 4791).unwrap();
            // The smallest receive buffer: a few datagrams fill it.
            setsockopt_int(b.socket().as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVBUF, 1).unwrap();
            let frames: Vec<OutFrame> = (0..200u8)
                .map(|i| a.frame(b.local(), &cm_mad(i)).unwrap())
                .collect();
            assert_eq!(a.send_batch(&frames), 200);
            let mut rb = RecvBatch::default();
            let mut got = 0;
            let mut drops = 0u32;
            loop {
                let n = b.recv_batch(&mut rb).unwrap();
                if n == 0 {
                    break;
                }
                got += n;
                drops += b.new_drops(&rb);
            }
            assert!(got < 200, "the queue must have overflowed ({got} received)");
            // The kernel reports its drop count with the next datagram it queues.
            assert_eq!(a.send_batch(&[a.frame(b.local(), &cm_mad(0)).unwrap()]), 1);
            for _ in 0..100 {
                let n = b.recv_batch(&mut rb).unwrap();
                got += n;
                drops += b.new_drops(&rb);
                if n > 0 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            assert_eq!(
                got + drops as usize,
                201,
                "{got} received, {drops} counted as dropped"
            );
            // Counted once: the same count again adds nothing.
            assert_eq!(b.new_drops(&rb), 0);
        });
    }

    fn is_root() -> bool {
        // SAFETY: geteuid(2) cannot fail.
        unsafe { libc::geteuid() == 0 }
    }
}

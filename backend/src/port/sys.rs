//! The system calls the wire ports share: sockets and their options, socket addresses
//! as the kernel takes and gives them, interfaces, and batched receives
//! (`recvmmsg` with the kernel's drop count).

use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use crate::stats::{Degraded, RxBuffer};

/// Datagrams per `recvmmsg`/`sendmmsg` call.
pub const BATCH: usize = 64;
/// Receive buffer per datagram: larger than a frame, so oversize datagrams are seen whole
/// enough to be counted.
pub const RECV_BUF: usize = 512;

/// `SO_RXQ_OVFL` (asm-generic/socket.h): a control message with the socket's drop count.
pub(crate) const SO_RXQ_OVFL: libc::c_int = 40;
/// `SO_MEMINFO` (asm-generic/socket.h): the socket's memory counters, drops among them.
const SO_MEMINFO: libc::c_int = 55;
/// Index of the drop count in `SO_MEMINFO`'s array (`SK_MEMINFO_DROPS`, sock_diag.h).
const SK_MEMINFO_DROPS: usize = 8;
/// The kernel's drop count of socket `fd` (`SO_MEMINFO`).
pub(crate) fn socket_drops(fd: RawFd) -> io::Result<u32> {
    let mut info = [0u32; SK_MEMINFO_DROPS + 1];
    let mut len = std::mem::size_of_val(&info) as libc::socklen_t;
    // SAFETY: `info` is writable for `len` bytes; the kernel writes at most that many.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_MEMINFO,
            info.as_mut_ptr().cast(),
            &mut len,
        )
    })?;
    if (len as usize) < std::mem::size_of_val(&info) {
        return Err(io::Error::other("SO_MEMINFO without a drop count"));
    }
    Ok(info[SK_MEMINFO_DROPS])
}

/// A socket address as the kernel takes it: the storage and its length.
pub(crate) fn sockaddr_of(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data for which all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*a.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// The packet type (`PACKET_HOST`, `PACKET_OUTGOING`, ...) of a packet socket's source
/// address; `None` for another family.
pub(crate) fn packet_type_from(ss: &libc::sockaddr_storage) -> Option<u8> {
    if libc::c_int::from(ss.ss_family) != libc::AF_PACKET {
        return None;
    }
    // SAFETY: the family says the storage holds a sockaddr_ll; the storage is larger
    // than and aligned for it.
    let a: libc::sockaddr_ll =
        unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
    Some(a.sll_pkttype)
}

/// The IPv4 or IPv6 socket address in `ss` (`None` for another family).
pub(crate) fn socket_addr_from(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in; the storage is
            // larger than and aligned for it.
            let a: libc::sockaddr_in =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let a: libc::sockaddr_in6 =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                0,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The interface index of `name` (for a link-local scope), or an error saying so.
pub(crate) fn if_index(name: &str) -> io::Result<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "interface name with NUL"))?;
    // SAFETY: `c` is a NUL-terminated string that lives across the call.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("interface {name}: {e}")));
    }
    Ok(i)
}

/// A system call's result: the value, or the OS error when it is negative.
pub(crate) fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// An integer socket option of `fd`.
pub(crate) fn getsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket owned by the caller; `v` is a live c_int whose
    // size is passed alongside, and the kernel writes at most that many bytes.
    cvt(unsafe {
        libc::getsockopt(
            fd,
            level,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

/// Asks for a receive buffer of [`RAW_RCVBUF`] bytes on `fd` (`what` names the socket
/// in the log): `SO_RCVBUFFORCE`, which passes `net.core.rmem_max` with
/// `CAP_NET_ADMIN`, else `SO_RCVBUF`, which that sysctl caps. Returns the buffer asked
/// for and the one in effect (read back); a smaller one is logged at WARN.
pub(crate) fn set_rx_buffer(fd: RawFd, what: &str) -> RxBuffer {
    let forced = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, RAW_RCVBUF);
    if let Err(e) = &forced {
        tracing::debug!(error = %e, "{what}: SO_RCVBUFFORCE refused, asking SO_RCVBUF");
        let _ = setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, RAW_RCVBUF);
    }
    // The kernel reports twice what it grants the data: the other half is its
    // bookkeeping.
    let effective = getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUF)
        .map_or(0, |v| u64::try_from(v).unwrap_or(0) / 2);
    let b = RxBuffer {
        wanted: RAW_RCVBUF as u64,
        effective,
    };
    if let Some(d) = buffer_degraded(&b) {
        tracing::warn!(
            wanted = b.wanted,
            effective = b.effective,
            "{what}: receive buffer smaller than asked: {}",
            d.why
        );
    }
    b
}

/// The receive buffer as a degraded setting, if it is smaller than asked.
pub(crate) fn buffer_degraded(b: &RxBuffer) -> Option<Degraded> {
    (b.effective < b.wanted).then(|| Degraded {
        setting: "wire_rx_buffer".into(),
        configured: b.wanted.to_string(),
        effective: b.effective.to_string(),
        why: "SO_RCVBUFFORCE needs CAP_NET_ADMIN, and net.core.rmem_max caps SO_RCVBUF: \
              grant CAP_NET_ADMIN or raise net.core.rmem_max, else bursts overflow sooner \
              (wire_rx_overflow)"
            .into(),
    })
}

/// Sets an integer socket option of `fd`.
pub(crate) fn setsockopt_int(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> io::Result<()> {
    // SAFETY: `fd` is an open socket owned by the caller; the option value is a live
    // c_int whose size is passed alongside.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// A socket of `family`, `ty` and `proto`, non-blocking and close-on-exec.
pub(crate) fn socket(
    family: libc::c_int,
    ty: libc::c_int,
    proto: libc::c_int,
) -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd =
        cvt(unsafe { libc::socket(family, ty | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, proto) })?;
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The raw socket's receive buffer (the kernel doubles it for its bookkeeping): room
/// for ~100,000 queued frames (a loopback datagram takes ~1.3 KiB of it), so the host
/// loop can fall behind for a while without loss. What bounds the queue is the senders'
/// pacing: a guest keeps at most a VM-wide window of requests of each kind outstanding
/// (64 REQs and 64 DREQs by default), so 128 VMs behind one peer host put at most ~32 K
/// requests and answers in flight towards it. The buffer is not sized for unpaced
/// bursts: a queue deep enough to take hundreds of thousands of frames only turns loss
/// into delay past the CM's timeouts, and every late request is retried.
pub(crate) const RAW_RCVBUF: libc::c_int = 64 << 20;

/// Room for the control messages of one datagram (one `SO_RXQ_OVFL` u32).
const CTRL_LEN: usize = 64;

/// Receives up to [`BATCH`] datagrams or frames from `fd` (non-blocking) into `rb`,
/// with their sources and the kernel's drop count; 0 when nothing waits.
pub(crate) fn recv_batch(fd: RawFd, rb: &mut RecvBatch) -> io::Result<usize> {
    let mut iovs: [MaybeUninit<libc::iovec>; BATCH] = [const { MaybeUninit::uninit() }; BATCH];
    // SAFETY: mmsghdr is plain old data for which all-zero is a valid value.
    let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
    for i in 0..BATCH {
        let iov = iovs[i].write(libc::iovec {
            iov_base: rb.bufs[i].as_mut_ptr().cast(),
            iov_len: RECV_BUF,
        });
        msgs[i].msg_hdr.msg_name = (&mut rb.addrs[i] as *mut libc::sockaddr_storage).cast();
        msgs[i].msg_hdr.msg_namelen =
            std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        msgs[i].msg_hdr.msg_iov = iov;
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_control = rb.ctrl[i].0.as_mut_ptr().cast();
        msgs[i].msg_hdr.msg_controllen = CTRL_LEN as _;
    }
    rb.drop_count = None;
    loop {
        // SAFETY: every mmsghdr points at its own buffer, address and control storage
        // in `rb`, which outlives the call.
        let r = unsafe {
            libc::recvmmsg(
                fd,
                msgs.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if r >= 0 {
            let n = r as usize;
            for (i, m) in msgs.iter().enumerate().take(n) {
                rb.lens[i] = m.msg_len as usize;
                rb.truncated[i] = m.msg_hdr.msg_flags & libc::MSG_TRUNC != 0;
                if let Some(d) = drop_count(&m.msg_hdr) {
                    rb.drop_count = Some(rb.drop_count.map_or(d, |x: u32| x.max(d)));
                }
            }
            return Ok(n);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// The `SO_RXQ_OVFL` drop count among a received message's control messages.
fn drop_count(h: &libc::msghdr) -> Option<u32> {
    // SAFETY: `h` is a msghdr the kernel filled in: its control pointer and length
    // describe the control messages it wrote into our buffer (CMSG_* walk within them).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET
                && (*c).cmsg_type == SO_RXQ_OVFL
                && (*c).cmsg_len as usize >= libc::CMSG_LEN(4) as usize
            {
                return Some(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<u32>()));
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    None
}

/// Control message storage, aligned for `cmsghdr`.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
struct Ctrl([u8; CTRL_LEN]);

/// Buffers for one `recvmmsg` batch.
pub struct RecvBatch {
    bufs: Box<[[u8; RECV_BUF]; BATCH]>,
    addrs: Box<[libc::sockaddr_storage; BATCH]>,
    ctrl: Box<[Ctrl; BATCH]>,
    lens: [usize; BATCH],
    truncated: [bool; BATCH],
    /// The largest kernel drop count (`SO_RXQ_OVFL`) the batch's datagrams carried.
    drop_count: Option<u32>,
}

impl std::fmt::Debug for RecvBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvBatch").finish_non_exhaustive()
    }
}

impl Default for RecvBatch {
    fn default() -> Self {
        RecvBatch {
            bufs: Box::new([[0; RECV_BUF]; BATCH]),
            // SAFETY: sockaddr_storage is plain old data for which all-zero is valid.
            addrs: Box::new(unsafe { std::mem::zeroed() }),
            ctrl: Box::new([Ctrl([0; CTRL_LEN]); BATCH]),
            lens: [0; BATCH],
            truncated: [false; BATCH],
            drop_count: None,
        }
    }
}

impl RecvBatch {
    /// Datagram `i` of the last batch: its source (`None` if neither IPv4 nor IPv6),
    /// its bytes, and whether it was longer than the buffer.
    pub fn get(&self, i: usize) -> (Option<SocketAddr>, &[u8], bool) {
        let src = socket_addr_from(&self.addrs[i]);
        let len = self.lens[i].min(RECV_BUF);
        (src, &self.bufs[i][..len], self.truncated[i])
    }

    /// Frame `i`'s packet type when it came from a packet socket (`PACKET_OUTGOING`:
    /// transmitted on the device, not received).
    pub fn packet_type(&self, i: usize) -> Option<u8> {
        packet_type_from(&self.addrs[i])
    }

    /// The largest kernel drop count (`SO_RXQ_OVFL`) the last batch's datagrams
    /// carried.
    pub(crate) fn drop_count(&self) -> Option<u32> {
        self.drop_count
    }
}

/// The MTU of network interface `name` in this process's network namespace
/// (`SIOCGIFMTU`; sysfs may show another namespace's).
pub fn if_mtu(name: &str) -> Option<u32> {
    let bytes = name.as_bytes();
    // SAFETY: an all-zero ifreq is a valid value of the plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if bytes.is_empty() || bytes.len() >= req.ifr_name.len() || bytes.contains(&0) {
        return None;
    }
    for (d, b) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *b as libc::c_char;
    }
    // SAFETY: socket(2) with constant arguments; the result is checked.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd is a socket we own; req is a valid ifreq with a NUL-terminated name, and
    // SIOCGIFMTU writes only its ifru_mtu.
    let r = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU, &mut req) };
    // SAFETY: we own fd and close it once.
    unsafe { libc::close(fd) };
    if r < 0 {
        return None;
    }
    // SAFETY: after a successful SIOCGIFMTU the union holds the MTU.
    u32::try_from(unsafe { req.ifr_ifru.ifru_mtu }).ok()
}

/// The name of the interface that holds local address `addr` (`getifaddrs(3)`).
pub fn iface_of(addr: std::net::IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list we free below; the result is checked.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: cur is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr of the family it names, at least as
        // large as a sockaddr_in(6) for those families.
        let a = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(std::net::IpAddr::from(
                        u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                    ))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(std::net::IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if a == Some(addr) {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: list came from getifaddrs and is freed once; no reference into it lives on.
    unsafe { libc::freeifaddrs(list) };
    found
}

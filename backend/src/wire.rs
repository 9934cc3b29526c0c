//! The soft RoCE port: RoCEv2 CM frames over UDP, one socket per VM address.
//!
//! Each VM's GID is IPv4-mapped; the port binds that IPv4 address and the RoCEv2 port
//! (4791 unless `--bind-port`), unconnected, with Don't Fragment set, so the kernel
//! writes the IP header [`pvcm_wire::roce`] assumes for the ICRC (identification 0, DF).
//! Frames are built with `pvcm_wire::roce` (ICRC computed on send) and checked on
//! receive (length, BTH, DETH, ICRC): anything else is a counted drop. Sends and
//! receives are batched with `sendmmsg`/`recvmmsg`.

use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, Ordering};

use pvcm_wire::mad::MAD_LEN;
use pvcm_wire::roce::{
    self, BthRepr, DethRepr, FRAME_LEN, Frame, FrameRepr, GSI_QKEY, GSI_QPN, Ipv4Repr, UdpRepr,
};
use pvcm_wire::{Error as WireError, Gid};

use crate::stats::DevDrop;

/// Datagrams per `recvmmsg`/`sendmmsg` call.
pub const BATCH: usize = 64;
/// Receive buffer per datagram: larger than a frame, so oversize datagrams are seen whole
/// enough to be counted.
pub const RECV_BUF: usize = 512;

/// A frame ready to send: 280 bytes to `dst`.
#[derive(Debug, Clone)]
pub struct OutFrame {
    /// Destination address and port.
    pub dst: SocketAddrV4,
    /// The UDP payload.
    pub frame: [u8; FRAME_LEN],
}

/// One UDP socket bound to a VM's address.
#[derive(Debug)]
pub struct WirePort {
    sock: UdpSocket,
    local: SocketAddrV4,
    psn: AtomicU32,
}

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn setsockopt_int(
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

impl WirePort {
    /// Binds `addr:port`: non-blocking, close-on-exec, DF set (`IP_PMTUDISC_DO`), large
    /// buffers. Fails if the address is not local or the port is taken.
    pub fn bind(addr: Ipv4Addr, port: u16) -> io::Result<WirePort> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = cvt(unsafe {
            libc::socket(
                libc::AF_INET,
                libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                0,
            )
        })?;
        // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let raw = fd.as_raw_fd();
        setsockopt_int(
            raw,
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_DO,
        )?;
        // Best effort: larger buffers absorb bursts (capped by net.core.[rw]mem_max).
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_RCVBUF, 4 << 20);
        let _ = setsockopt_int(raw, libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(addr).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `sa` is a valid sockaddr_in and its size is passed.
        cvt(unsafe {
            libc::bind(
                raw,
                (&sa as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        })
        .map_err(|e| io::Error::new(e.kind(), format!("bind {addr}:{port}: {e}")))?;
        let sock = UdpSocket::from(fd);
        Ok(WirePort {
            sock,
            local: SocketAddrV4::new(addr, port),
            psn: AtomicU32::new(0),
        })
    }

    /// The bound address.
    pub fn local(&self) -> SocketAddrV4 {
        self.local
    }

    /// The socket.
    pub fn socket(&self) -> &UdpSocket {
        &self.sock
    }

    /// Builds the frame carrying `mad` from this port to `dst` (ICRC computed).
    pub fn frame(&self, dst: SocketAddrV4, mad: &[u8; MAD_LEN]) -> OutFrame {
        let psn = self.psn.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF;
        let mut frame = [0u8; FRAME_LEN];
        let ip = Ipv4Repr::new(*self.local.ip(), *dst.ip());
        let udp = UdpRepr::new(self.local.port());
        let udp = UdpRepr {
            dst_port: dst.port(),
            ..udp
        };
        // The buffer is exactly a frame and the MAD exactly 256 bytes: emit cannot fail.
        let _ = FrameRepr::gsi(psn, mad).emit(&mut frame, &ip, &udp);
        OutFrame { dst, frame }
    }

    /// Sends frames with `sendmmsg`; returns how many the kernel took (a full socket
    /// buffer is retried a few times, then the rest is reported as not sent).
    pub fn send_batch(&self, frames: &[OutFrame]) -> usize {
        let mut pos = 0;
        let mut sent = 0;
        let mut stalls = 0;
        while pos < frames.len() {
            let chunk = &frames[pos..frames.len().min(pos + BATCH)];
            let mut addrs: [MaybeUninit<libc::sockaddr_in>; BATCH] =
                [const { MaybeUninit::uninit() }; BATCH];
            let mut iovs: [MaybeUninit<libc::iovec>; BATCH] =
                [const { MaybeUninit::uninit() }; BATCH];
            // SAFETY: mmsghdr is plain old data for which all-zero is a valid value.
            let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
            for (i, f) in chunk.iter().enumerate() {
                let a = addrs[i].write(libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: f.dst.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(*f.dst.ip()).to_be(),
                    },
                    sin_zero: [0; 8],
                });
                let iov = iovs[i].write(libc::iovec {
                    iov_base: f.frame.as_ptr() as *mut libc::c_void,
                    iov_len: FRAME_LEN,
                });
                msgs[i].msg_hdr.msg_name = (a as *mut libc::sockaddr_in).cast();
                msgs[i].msg_hdr.msg_namelen =
                    std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
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
        let mut iovs: [MaybeUninit<libc::iovec>; BATCH] = [const { MaybeUninit::uninit() }; BATCH];
        // SAFETY: mmsghdr is plain old data for which all-zero is a valid value.
        let mut msgs: [libc::mmsghdr; BATCH] = unsafe { std::mem::zeroed() };
        for i in 0..BATCH {
            let iov = iovs[i].write(libc::iovec {
                iov_base: rb.bufs[i].as_mut_ptr().cast(),
                iov_len: RECV_BUF,
            });
            msgs[i].msg_hdr.msg_name = (&mut rb.addrs[i] as *mut libc::sockaddr_in).cast();
            msgs[i].msg_hdr.msg_namelen =
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            msgs[i].msg_hdr.msg_iov = iov;
            msgs[i].msg_hdr.msg_iovlen = 1;
        }
        loop {
            // SAFETY: every mmsghdr points at a live buffer of RECV_BUF bytes and a
            // sockaddr_in in `rb`, which outlives the call.
            let r = unsafe {
                libc::recvmmsg(
                    self.sock.as_raw_fd(),
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
}

/// Buffers for one `recvmmsg` batch.
pub struct RecvBatch {
    bufs: Box<[[u8; RECV_BUF]; BATCH]>,
    addrs: [libc::sockaddr_in; BATCH],
    lens: [usize; BATCH],
    truncated: [bool; BATCH],
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
            // SAFETY: sockaddr_in is plain old data for which all-zero is valid.
            addrs: unsafe { std::mem::zeroed() },
            lens: [0; BATCH],
            truncated: [false; BATCH],
        }
    }
}

impl RecvBatch {
    /// Datagram `i` of the last batch: its source and bytes (`None` source if not IPv4).
    pub fn get(&self, i: usize) -> (Option<SocketAddrV4>, &[u8], bool) {
        let a = &self.addrs[i];
        let src = (a.sin_family == libc::AF_INET as libc::sa_family_t).then(|| {
            SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )
        });
        let len = self.lens[i].min(RECV_BUF);
        (src, &self.bufs[i][..len], self.truncated[i])
    }
}

/// A received frame that passed every check: its MAD and addressing.
#[derive(Debug, Clone)]
pub struct InFrame {
    /// Sender's GID (IPv4-mapped source address).
    pub src: Gid,
    /// Sender's address.
    pub src_addr: SocketAddrV4,
    /// The DETH's source QP and Q_Key, for the rx header.
    pub src_qp: u32,
    /// Q_Key.
    pub qkey: u32,
    /// P_Key.
    pub pkey: u16,
    /// The MAD.
    pub mad: [u8; MAD_LEN],
}

/// Checks one datagram received on `local` from `src`: exactly one 280-byte frame, a UD
/// SEND only to QP1 with the default P_Key, the GSI DETH, and a good ICRC under the
/// header the sender's kernel wrote (see `pvcm_wire::roce`).
pub fn check_frame(
    local: SocketAddrV4,
    src: SocketAddrV4,
    dgram: &[u8],
) -> Result<InFrame, DevDrop> {
    let frame = Frame::new_checked(dgram).map_err(|e| match e {
        WireError::BthOpcode(_) | WireError::BthVersion(_) => DevDrop::WireBadBth,
        _ => DevDrop::WireBadLength,
    })?;
    let bth = BthRepr::parse(&frame.bth()).map_err(|_| DevDrop::WireBadBth)?;
    if bth.dest_qp != GSI_QPN || bth.pkey & 0x7FFF != 0x7FFF {
        return Err(DevDrop::WireBadBth);
    }
    let deth = DethRepr::parse(&frame.deth()).map_err(|_| DevDrop::WireBadDeth)?;
    if deth.qkey != GSI_QKEY || deth.src_qp != GSI_QPN {
        return Err(DevDrop::WireBadDeth);
    }
    let ip = Ipv4Repr::new(*src.ip(), *local.ip());
    let udp = UdpRepr {
        src_port: src.port(),
        dst_port: local.port(),
        length: (roce::UDP_HEADER_LEN + FRAME_LEN) as u16,
    };
    frame
        .check_icrc(&ip, &udp)
        .map_err(|_| DevDrop::WireBadIcrc)?;
    let mut mad = [0u8; MAD_LEN];
    mad.copy_from_slice(frame.mad());
    Ok(InFrame {
        src: Gid::from_ipv4(*src.ip()),
        src_addr: src,
        src_qp: deth.src_qp,
        qkey: deth.qkey,
        pkey: bth.pkey,
        mad,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_batch_and_checks() {
        let a = WirePort::bind(Ipv4Addr::new(127, 77, 0, 1), 4791).unwrap();
        let b = WirePort::bind(Ipv4Addr::new(127, 77, 0, 2), 4791).unwrap();
        let mut mad = [0u8; MAD_LEN];
        mad[1] = 7;
        let frames: Vec<_> = (0..100u8)
            .map(|i| {
                mad[255] = i;
                a.frame(b.local(), &mad)
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
        let other = SocketAddrV4::new(*src.ip(), 5000);
        assert_eq!(
            check_frame(b.local(), other, &good).unwrap_err(),
            DevDrop::WireBadIcrc
        );
    }
}

//! CUSE: a character device served from user space through `/dev/cuse` (Linux
//! `fs/fuse/cuse.c`, the FUSE protocol of `include/uapi/linux/fuse.h`).
//!
//! The server opens `/dev/cuse`; the kernel's first request is CUSE_INIT, whose answer
//! names the device (`DEVNAME=infiniband/rdma_cm` creates `/dev/infiniband/rdma_cm`).
//! Then every `open()`, `write()`, `read()`, `poll()` and last `close()` of the node by
//! any process arrives as a request (OPEN, WRITE, READ, POLL, RELEASE), each answered
//! by its `unique`; answers may come in any order, so a blocked request (a GET_EVENT
//! waiting for an event) is simply answered later. A signal to a process blocked in a
//! request sends INTERRUPT (answer the interrupted request, e.g. with EINTR); the
//! server wakes a process blocked in `poll()` with a POLL notification for the file's
//! poll handle.
//!
//! [`Request::parse`] reads one request from the bytes `read()` returned; the `reply_*`
//! functions build answers. Nothing here panics on what the kernel sends: a short or
//! unknown request is a [`CuseError`].

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// FUSE protocol major version (`FUSE_KERNEL_VERSION`).
pub const FUSE_MAJOR: u32 = 7;
/// The minor version this server speaks (the kernel needs at least 11; 31 has every
/// structure used here at its current size).
pub const FUSE_MINOR: u32 = 31;
/// The largest write the kernel hands over in one request (`max_write`); larger writes
/// arrive in pieces (see [`Request::Write`]'s `offset`).
pub const MAX_WRITE: u32 = 64 * 1024;
/// A read buffer that holds any request.
pub const READ_BUFFER: usize = MAX_WRITE as usize + 4096;
/// `CUSE_UNRESTRICTED_IOCTL`.
pub const CUSE_UNRESTRICTED_IOCTL: u32 = 1;
/// `FUSE_POLL_SCHEDULE_NOTIFY`: the caller sleeps; wake it with a notification.
pub const FUSE_POLL_SCHEDULE_NOTIFY: u32 = 1;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    /// OPEN.
    pub const OPEN: u32 = 14;
    /// READ.
    pub const READ: u32 = 15;
    /// WRITE.
    pub const WRITE: u32 = 16;
    /// RELEASE.
    pub const RELEASE: u32 = 18;
    /// FLUSH.
    pub const FLUSH: u32 = 25;
    /// INTERRUPT.
    pub const INTERRUPT: u32 = 36;
    /// DESTROY.
    pub const DESTROY: u32 = 38;
    /// IOCTL.
    pub const IOCTL: u32 = 39;
    /// POLL.
    pub const POLL: u32 = 40;
    /// CUSE_INIT.
    pub const CUSE_INIT: u32 = 4096;
}

/// `FUSE_NOTIFY_POLL` (a notification's code, in the error field).
const FUSE_NOTIFY_POLL: i32 = 1;

/// Length of `struct fuse_in_header`.
pub const IN_HEADER_LEN: usize = 40;
/// Length of `struct fuse_out_header`.
pub const OUT_HEADER_LEN: usize = 16;

/// Why a request could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CuseError {
    /// Fewer bytes than its header or arguments.
    #[error("request of {0} bytes is truncated")]
    Truncated(usize),
    /// The header's length disagrees with what was read.
    #[error("request length {said} but {got} bytes read")]
    Length {
        /// The header's length.
        said: u32,
        /// Bytes read.
        got: usize,
    },
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    /// Request length, header included.
    pub len: u32,
    /// Opcode.
    pub opcode: u32,
    /// The request's ID, for its answer.
    pub unique: u64,
    /// The caller's user ID.
    pub uid: u32,
    /// The caller's group ID.
    pub gid: u32,
    /// The caller's thread ID.
    pub pid: u32,
}

/// One request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    /// CUSE_INIT: the kernel's protocol version.
    Init {
        /// Major version.
        major: u32,
        /// Minor version.
        minor: u32,
    },
    /// `open()`.
    Open {
        /// The open flags.
        flags: u32,
    },
    /// The last `close()` of a file.
    Release {
        /// The file.
        fh: u64,
    },
    /// `write()`.
    Write {
        /// The file.
        fh: u64,
        /// Where in the write this piece starts (0 but for writes beyond
        /// [`MAX_WRITE`]).
        offset: u64,
        /// The file's flags now (O_NONBLOCK).
        flags: u32,
        /// The bytes.
        data: &'a [u8],
    },
    /// `read()`.
    Read {
        /// The file.
        fh: u64,
        /// Bytes asked for.
        size: u32,
    },
    /// `poll()`/`select()`/`epoll_wait()`.
    Poll {
        /// The file.
        fh: u64,
        /// Its poll handle, for the notification.
        kh: u64,
        /// [`FUSE_POLL_SCHEDULE_NOTIFY`] when the caller will sleep.
        flags: u32,
        /// Events asked for.
        events: u32,
    },
    /// A signal for the process blocked in request `unique`.
    Interrupt {
        /// The interrupted request.
        unique: u64,
    },
    /// `ioctl()`.
    Ioctl {
        /// The file.
        fh: u64,
        /// The command.
        cmd: u32,
        /// Its argument.
        arg: u64,
    },
    /// Anything else (answered ENOSYS).
    Other(u32),
}

impl<'a> Request<'a> {
    /// Reads the request in `b` (exactly what one `read()` of `/dev/cuse` returned).
    pub fn parse(b: &'a [u8]) -> Result<(InHeader, Request<'a>), CuseError> {
        if b.len() < IN_HEADER_LEN {
            return Err(CuseError::Truncated(b.len()));
        }
        let h = InHeader {
            len: u32_at(b, 0),
            opcode: u32_at(b, 4),
            unique: u64_at(b, 8),
            uid: u32_at(b, 24),
            gid: u32_at(b, 28),
            pid: u32_at(b, 32),
        };
        if h.len as usize != b.len() {
            return Err(CuseError::Length {
                said: h.len,
                got: b.len(),
            });
        }
        let a = &b[IN_HEADER_LEN..];
        let need = |n: usize| {
            if a.len() < n {
                Err(CuseError::Truncated(b.len()))
            } else {
                Ok(())
            }
        };
        let r = match h.opcode {
            op::CUSE_INIT => {
                need(8)?;
                Request::Init {
                    major: u32_at(a, 0),
                    minor: u32_at(a, 4),
                }
            }
            op::OPEN => {
                need(4)?;
                Request::Open {
                    flags: u32_at(a, 0),
                }
            }
            op::RELEASE => {
                need(8)?;
                Request::Release { fh: u64_at(a, 0) }
            }
            op::WRITE => {
                // struct fuse_write_in: fh, offset, size, write_flags, lock_owner,
                // flags, padding (40 bytes), then the data.
                need(40)?;
                let size = u32_at(a, 16) as usize;
                let data = a.get(40..40 + size).ok_or(CuseError::Truncated(b.len()))?;
                Request::Write {
                    fh: u64_at(a, 0),
                    offset: u64_at(a, 8),
                    flags: u32_at(a, 32),
                    data,
                }
            }
            op::READ => {
                need(20)?;
                Request::Read {
                    fh: u64_at(a, 0),
                    size: u32_at(a, 16),
                }
            }
            op::POLL => {
                need(24)?;
                Request::Poll {
                    fh: u64_at(a, 0),
                    kh: u64_at(a, 8),
                    flags: u32_at(a, 16),
                    events: u32_at(a, 20),
                }
            }
            op::INTERRUPT => {
                need(8)?;
                Request::Interrupt {
                    unique: u64_at(a, 0),
                }
            }
            op::IOCTL => {
                need(32)?;
                Request::Ioctl {
                    fh: u64_at(a, 0),
                    cmd: u32_at(a, 12),
                    arg: u64_at(a, 16),
                }
            }
            o => Request::Other(o),
        };
        Ok((h, r))
    }
}

/// An answer: the out header and up to 88 bytes of arguments, built in place.
#[derive(Clone)]
pub struct Reply {
    buf: [u8; OUT_HEADER_LEN + 128],
    len: usize,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reply({:?})", &self.buf[..self.len])
    }
}

impl Reply {
    fn new(unique: u64, error: i32, args: &[u8]) -> Reply {
        let mut buf = [0u8; OUT_HEADER_LEN + 128];
        let n = args.len().min(128);
        let len = OUT_HEADER_LEN + n;
        buf[0..4].copy_from_slice(&(len as u32).to_le_bytes());
        buf[4..8].copy_from_slice(&error.to_le_bytes());
        buf[8..16].copy_from_slice(&unique.to_le_bytes());
        buf[OUT_HEADER_LEN..len].copy_from_slice(&args[..n]);
        Reply { buf, len }
    }

    /// The bytes to write to `/dev/cuse`.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }

    /// A failed request: `-errno`.
    pub fn error(unique: u64, errno: i32) -> Reply {
        Reply::new(unique, -errno.abs(), &[])
    }

    /// The answer to a request that [`Request::parse`] refused: `-errno` when its header
    /// names the request (its `unique`), so no caller hangs on it; none otherwise.
    pub fn to_unreadable(b: &[u8], errno: i32) -> Option<Reply> {
        let u: [u8; 8] = b.get(8..16)?.try_into().ok()?;
        Some(Reply::error(u64::from_le_bytes(u), errno))
    }

    /// OPEN's answer: the file handle.
    pub fn open(unique: u64, fh: u64) -> Reply {
        let mut a = [0u8; 16];
        a[0..8].copy_from_slice(&fh.to_le_bytes());
        Reply::new(unique, 0, &a)
    }

    /// WRITE's answer: how many bytes were taken.
    pub fn write(unique: u64, size: u32) -> Reply {
        let mut a = [0u8; 8];
        a[0..4].copy_from_slice(&size.to_le_bytes());
        Reply::new(unique, 0, &a)
    }

    /// POLL's answer: the events ready now.
    pub fn poll(unique: u64, revents: u32) -> Reply {
        let mut a = [0u8; 8];
        a[0..4].copy_from_slice(&revents.to_le_bytes());
        Reply::new(unique, 0, &a)
    }

    /// IOCTL's answer: its result.
    pub fn ioctl(unique: u64, result: i32) -> Reply {
        let mut a = [0u8; 16];
        a[0..4].copy_from_slice(&result.to_le_bytes());
        Reply::new(unique, 0, &a)
    }

    /// A request answered without arguments (RELEASE).
    pub fn empty(unique: u64) -> Reply {
        Reply::new(unique, 0, &[])
    }

    /// The poll wakeup for handle `kh` (a notification, not an answer).
    pub fn notify_poll(kh: u64) -> Reply {
        Reply::new(0, FUSE_NOTIFY_POLL, &kh.to_le_bytes())
    }
}

/// CUSE_INIT's answer: protocol version, sizes, and the device info naming the node
/// (`devname` is relative to /dev: `infiniband/rdma_cm`).
pub fn init_reply(unique: u64, devname: &str) -> Vec<u8> {
    let info = format!("DEVNAME={devname}\0");
    let mut out = vec![0u8; OUT_HEADER_LEN + 72 + info.len()];
    let len = out.len() as u32;
    out[0..4].copy_from_slice(&len.to_le_bytes());
    out[8..16].copy_from_slice(&unique.to_le_bytes());
    let a = &mut out[OUT_HEADER_LEN..];
    a[0..4].copy_from_slice(&FUSE_MAJOR.to_le_bytes());
    a[4..8].copy_from_slice(&FUSE_MINOR.to_le_bytes());
    a[12..16].copy_from_slice(&CUSE_UNRESTRICTED_IOCTL.to_le_bytes());
    a[16..20].copy_from_slice(&MAX_WRITE.to_le_bytes()); // max_read
    a[20..24].copy_from_slice(&MAX_WRITE.to_le_bytes()); // max_write
    // dev_major, dev_minor 0: the kernel picks them.
    a[72..].copy_from_slice(info.as_bytes());
    out
}

/// `/dev/cuse`, opened: the server's end of the device.
#[derive(Debug)]
pub struct CuseDev {
    fd: OwnedFd,
}

impl CuseDev {
    /// Opens `path` (normally `/dev/cuse`) non-blocking.
    pub fn open(path: &Path) -> io::Result<CuseDev> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        Ok(CuseDev { fd: f.into() })
    }

    /// A `/dev/cuse` descriptor opened elsewhere (the keeper's, passed by the service).
    pub fn from_fd(fd: OwnedFd) -> CuseDev {
        CuseDev { fd }
    }

    /// The kernel has ended this connection (`poll()` gives POLLERR): the device is
    /// gone, or was refused at CUSE_INIT (its name taken).
    pub fn ended(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, live across the call; a zero timeout.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        r > 0 && p.revents & libc::POLLERR != 0
    }

    /// The descriptor, for poll.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Reads one request into `buf`: `Ok(None)` when none is waiting. `ENOENT` (a
    /// request withdrawn while being read) is retried; `ENODEV` (the device went away)
    /// is returned.
    pub fn read(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.read_one(buf, true)
    }

    /// Makes reads block (several threads reading, each woken for its own request) or
    /// return at once when nothing is waiting.
    pub fn set_blocking(&self, blocking: bool) -> io::Result<()> {
        // SAFETY: F_GETFL/F_SETFL on a descriptor this value owns; no memory passed.
        let flags = unsafe { libc::fcntl(self.fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(io::Error::last_os_error());
        }
        let flags = if blocking {
            flags & !libc::O_NONBLOCK
        } else {
            flags | libc::O_NONBLOCK
        };
        // SAFETY: as above.
        if unsafe { libc::fcntl(self.fd(), libc::F_SETFL, flags) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// As [`CuseDev::read`] on a blocking descriptor, but a signal (`EINTR`) ends the
    /// wait with `Ok(None)`, so a reading thread can look at its stop flag.
    pub fn read_or_interrupted(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.read_one(buf, false)
    }

    fn read_one(&self, buf: &mut [u8], retry_eintr: bool) -> io::Result<Option<usize>> {
        loop {
            // SAFETY: `buf` is writable for its whole length for the call.
            let n = unsafe { libc::read(self.fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(Some(n as usize));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENOENT) => continue,
                Some(libc::EINTR) if retry_eintr => continue,
                Some(libc::EINTR) | Some(libc::EAGAIN) => return Ok(None),
                _ => return Err(e),
            }
        }
    }

    /// Writes an answer or notification. An answer to a request the kernel no longer
    /// waits for (`ENOENT`: interrupted and given up) is not an error.
    pub fn write(&self, bytes: &[u8]) -> io::Result<()> {
        loop {
            // SAFETY: `bytes` is readable for its whole length for the call.
            let n = unsafe { libc::write(self.fd(), bytes.as_ptr().cast(), bytes.len()) };
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::ENOENT) => return Ok(()),
                _ => return Err(e),
            }
        }
    }
}

/// A request as the kernel writes it, from process 4242 (for tests).
#[cfg(test)]
pub(crate) fn request_bytes(opcode: u32, unique: u64, args: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; IN_HEADER_LEN + args.len()];
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_le_bytes());
    b[4..8].copy_from_slice(&opcode.to_le_bytes());
    b[8..16].copy_from_slice(&unique.to_le_bytes());
    b[32..36].copy_from_slice(&4242u32.to_le_bytes());
    b[IN_HEADER_LEN..].copy_from_slice(args);
    b
}

#[cfg(test)]
mod tests {
    use super::request_bytes as req;
    use super::*;

    #[test]
    fn parses_requests() {
        let mut w = vec![0u8; 40 + 5];
        w[0..8].copy_from_slice(&7u64.to_le_bytes());
        w[16..20].copy_from_slice(&5u32.to_le_bytes());
        w[32..36].copy_from_slice(&(libc::O_NONBLOCK as u32).to_le_bytes());
        w[40..].copy_from_slice(b"hello");
        let b = req(op::WRITE, 9, &w);
        let (h, r) = Request::parse(&b).expect("write");
        assert_eq!((h.unique, h.pid), (9, 4242));
        assert_eq!(
            r,
            Request::Write {
                fh: 7,
                offset: 0,
                flags: libc::O_NONBLOCK as u32,
                data: b"hello"
            }
        );
        let mut p = [0u8; 24];
        p[0..8].copy_from_slice(&3u64.to_le_bytes());
        p[8..16].copy_from_slice(&99u64.to_le_bytes());
        p[16..20].copy_from_slice(&FUSE_POLL_SCHEDULE_NOTIFY.to_le_bytes());
        let b = req(op::POLL, 1, &p);
        assert!(matches!(
            Request::parse(&b),
            Ok((_, Request::Poll { fh: 3, kh: 99, .. }))
        ));
        // A data length beyond the request, a short header, a lying length.
        w[16..20].copy_from_slice(&500u32.to_le_bytes());
        assert!(Request::parse(&req(op::WRITE, 1, &w)).is_err());
        assert!(Request::parse(&[0u8; 10]).is_err());
        let mut b = req(op::OPEN, 1, &[0; 8]);
        b[0] = 200;
        assert!(matches!(Request::parse(&b), Err(CuseError::Length { .. })));
        assert_eq!(
            Request::parse(&req(77, 1, &[])).map(|x| x.1),
            Ok(Request::Other(77))
        );
    }

    #[test]
    fn replies() {
        let r = Reply::error(5, libc::EAGAIN);
        assert_eq!(r.bytes().len(), 16);
        assert_eq!(
            i32::from_le_bytes(r.bytes()[4..8].try_into().unwrap_or_default()),
            -libc::EAGAIN
        );
        let n = Reply::notify_poll(77);
        assert_eq!(&n.bytes()[8..16], &[0; 8], "unique 0: a notification");
        assert_eq!(&n.bytes()[16..24], &77u64.to_le_bytes());
        let i = init_reply(1, "infiniband/rdma_cm");
        assert_eq!(i.len(), 16 + 72 + "DEVNAME=infiniband/rdma_cm\0".len());
        assert!(i.ends_with(b"DEVNAME=infiniband/rdma_cm\0"));
    }
}

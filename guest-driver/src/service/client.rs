//! A client of the rdma_cm character device ABI, as librdmacm speaks it (`cma.c`): the
//! other end of what `pvcm-guestd` serves, for programs of this crate that run beside
//! the service (`pvcm-guest` when the service owns the pvcm device).
//!
//! Every command is one write of a header and a structure ([`abi`]); a command that
//! answers carries the address of a buffer in this process's memory, which the server
//! fills before the write returns (the kernel's `copy_to_user`; pvcm-guestd's
//! `process_vm_writev`). Events are read with GET_EVENT on a non-blocking file: EAGAIN
//! when none is queued, then `poll()` until one is.
//!
//! The writes go through a [`Channel`]: [`DeviceFile`] is the device node; tests run the
//! same client against the service's rdma_cm layer in memory.
//!
//! The flows are librdmacm's:
//! - active: CREATE_ID, RESOLVE_IP, GET_EVENT (ADDR_RESOLVED), RESOLVE_ROUTE, GET_EVENT
//!   (ROUTE_RESOLVED), CONNECT, GET_EVENT (CONNECT_RESPONSE), ACCEPT without parameters
//!   (the RTU; the connection is then established), DISCONNECT, GET_EVENT
//!   (DISCONNECTED), DESTROY_ID;
//! - passive: CREATE_ID, BIND_IP, LISTEN, GET_EVENT (CONNECT_REQUEST, on a new id),
//!   ACCEPT or REJECT, GET_EVENT (ESTABLISHED), ..., DESTROY_ID.

use std::fs::File;
use std::io::Write as _;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::abi::{
    self, Accept, Bind, ConnParam, Connect, CreateId, DestroyId, Ece, EventResp, IdArg,
    QueryRouteResp, Reject, ResolveAddr, RespIdArg, cmd,
};

/// How commands reach an rdma_cm device.
pub trait Channel {
    /// Writes one command (header and structure), as `write(2)` on the device: `Ok` when
    /// it was served, else the errno it failed with (EAGAIN: a GET_EVENT with no event
    /// queued).
    fn execute(&mut self, command: &[u8]) -> Result<(), i32>;

    /// Waits until an event can be read or `timeout` passed: `Ok(true)` if one can.
    fn wait(&mut self, timeout: Duration) -> Result<bool, i32>;
}

/// The device node (`/dev/infiniband/rdma_cm`), opened non-blocking.
#[derive(Debug)]
pub struct DeviceFile {
    file: File,
    path: PathBuf,
}

impl DeviceFile {
    /// Opens the node (read-write, non-blocking, close-on-exec).
    pub fn open(path: &Path) -> std::io::Result<DeviceFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)?;
        Ok(DeviceFile {
            file,
            path: path.to_path_buf(),
        })
    }

    /// The node's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Channel for DeviceFile {
    fn execute(&mut self, command: &[u8]) -> Result<(), i32> {
        match (&self.file).write(command) {
            Ok(n) if n == command.len() => Ok(()),
            // The device takes a command whole or not at all.
            Ok(_) => Err(libc::EIO),
            Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
        }
    }

    fn wait(&mut self, timeout: Duration) -> Result<bool, i32> {
        let now = Instant::now();
        let until = now.checked_add(timeout).unwrap_or(now);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            let mut p = libc::pollfd {
                fd: self.file.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `p` is one valid pollfd, readable and writable for the call, and
            // the count says one.
            let n = unsafe { libc::poll(&mut p, 1, ms) };
            if n > 0 {
                if p.revents & (libc::POLLERR | libc::POLLNVAL) != 0 {
                    return Err(libc::EIO);
                }
                return Ok(p.revents & libc::POLLIN != 0);
            }
            if n == 0 {
                return Ok(false);
            }
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if e != libc::EINTR || left.is_zero() {
                return Err(e);
            }
        }
    }
}

/// A command that failed: the command's name and the errno the device gave, or an
/// answer this client cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmdError {
    /// The device refused the command.
    #[error("{cmd}: {}", errno_text(*.errno))]
    Errno {
        /// The command (`connect`, `get_event`, ...).
        cmd: &'static str,
        /// The errno.
        errno: i32,
    },
    /// The answer written into this process's buffer is not what the command answers.
    #[error("{cmd}: bad answer: {what}")]
    BadAnswer {
        /// The command.
        cmd: &'static str,
        /// What is wrong with it.
        what: String,
    },
}

impl CmdError {
    /// The errno, for a refused command.
    pub fn errno(&self) -> Option<i32> {
        match self {
            CmdError::Errno { errno, .. } => Some(*errno),
            CmdError::BadAnswer { .. } => None,
        }
    }
}

/// `strerror` text with the errno's name and number: "Invalid argument (EINVAL 22)".
pub fn errno_text(e: i32) -> String {
    let name = match e {
        libc::EPERM => "EPERM",
        libc::ENOENT => "ENOENT",
        libc::EINTR => "EINTR",
        libc::EIO => "EIO",
        libc::EAGAIN => "EAGAIN",
        libc::ENOMEM => "ENOMEM",
        libc::EACCES => "EACCES",
        libc::EFAULT => "EFAULT",
        libc::ENODEV => "ENODEV",
        libc::EINVAL => "EINVAL",
        libc::ENOSPC => "ENOSPC",
        libc::ENOSYS => "ENOSYS",
        libc::EADDRINUSE => "EADDRINUSE",
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
        libc::EAFNOSUPPORT => "EAFNOSUPPORT",
        libc::EISCONN => "EISCONN",
        libc::ETIMEDOUT => "ETIMEDOUT",
        libc::ECONNRESET => "ECONNRESET",
        libc::EHOSTUNREACH => "EHOSTUNREACH",
        _ => "errno",
    };
    format!("{} ({name} {e})", std::io::Error::from_raw_os_error(e))
}

/// What the client did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Commands written (GET_EVENTs included).
    pub commands: u64,
    /// Events read.
    pub events: u64,
    /// GET_EVENTs that found no event (EAGAIN).
    pub empty_reads: u64,
    /// Waits for an event.
    pub waits: u64,
}

/// An rdma_cm device's client over a [`Channel`]: one file, the ids it creates.
#[derive(Debug)]
pub struct RdmaCm<C: Channel> {
    chan: C,
    stats: ClientStats,
}

/// The address of a response buffer, as the command carries it. The `as` cast exposes
/// the buffer's provenance: the device writes it from outside this program, during the
/// write that carries the address.
fn addr_of(buf: &mut [u8]) -> u64 {
    buf.as_mut_ptr() as u64
}

impl<C: Channel> RdmaCm<C> {
    /// A client on `chan`.
    pub fn new(chan: C) -> RdmaCm<C> {
        RdmaCm {
            chan,
            stats: ClientStats::default(),
        }
    }

    /// The channel.
    pub fn channel(&self) -> &C {
        &self.chan
    }

    /// What the client did so far.
    pub fn stats(&self) -> ClientStats {
        self.stats
    }

    fn exec(&mut self, code: u32, body: &[u8], out_len: u16) -> Result<(), CmdError> {
        self.stats.commands += 1;
        self.chan
            .execute(&abi::command(code, body, out_len))
            .map_err(|errno| CmdError::Errno {
                cmd: cmd::name(code),
                errno,
            })
    }

    /// CREATE_ID: a new id in port space `ps` whose events carry `uid`; its number.
    pub fn create_id(&mut self, uid: u64, ps: u16) -> Result<u32, CmdError> {
        let mut resp = [0u8; 4];
        let c = CreateId {
            uid,
            response: addr_of(&mut resp),
            ps,
            qp_type: 0,
        };
        self.exec(cmd::CREATE_ID, &c.to_bytes(), 4)?;
        Ok(u32::from_le_bytes(resp))
    }

    /// DESTROY_ID: the id's `events_reported`.
    pub fn destroy_id(&mut self, id: u32) -> Result<u32, CmdError> {
        let mut resp = [0u8; 4];
        let d = DestroyId {
            response: addr_of(&mut resp),
            id,
        };
        self.exec(cmd::DESTROY_ID, &d.to_bytes(), 4)?;
        Ok(u32::from_le_bytes(resp))
    }

    /// BIND_IP.
    pub fn bind_ip(&mut self, id: u32, addr: SocketAddr) -> Result<(), CmdError> {
        self.exec(cmd::BIND_IP, &Bind { id, addr }.to_bytes_ip(), 0)
    }

    /// RESOLVE_IP (ADDR_RESOLVED or ADDR_ERROR follows).
    pub fn resolve_ip(
        &mut self,
        id: u32,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout_ms: u32,
    ) -> Result<(), CmdError> {
        let r = ResolveAddr {
            id,
            timeout_ms,
            src,
            dst,
        };
        self.exec(cmd::RESOLVE_IP, &r.to_bytes_ip(), 0)
    }

    /// RESOLVE_ROUTE (ROUTE_RESOLVED or ROUTE_ERROR follows).
    pub fn resolve_route(&mut self, id: u32, timeout_ms: u32) -> Result<(), CmdError> {
        let a = IdArg {
            id,
            arg: timeout_ms,
        };
        self.exec(cmd::RESOLVE_ROUTE, &a.to_bytes(), 0)
    }

    /// QUERY_ROUTE: the id's addresses, device and path.
    pub fn query_route(&mut self, id: u32) -> Result<QueryRouteResp, CmdError> {
        let mut resp = [0u8; QueryRouteResp::LEN];
        let q = RespIdArg {
            response: addr_of(&mut resp),
            id,
            arg: 0,
        };
        self.exec(cmd::QUERY_ROUTE, &q.to_bytes(), QueryRouteResp::LEN as u16)?;
        QueryRouteResp::parse(&resp).map_err(|e| CmdError::BadAnswer {
            cmd: cmd::name(cmd::QUERY_ROUTE),
            what: e.to_string(),
        })
    }

    /// CONNECT (`conn.valid` must be set).
    pub fn connect(&mut self, id: u32, conn: &ConnParam) -> Result<(), CmdError> {
        let c = Connect {
            conn: conn.clone(),
            id,
            ece: Ece::default(),
        };
        self.exec(cmd::CONNECT, &c.to_bytes(), 0)
    }

    /// LISTEN (`backlog` 0: the device's maximum).
    pub fn listen(&mut self, id: u32, backlog: u32) -> Result<(), CmdError> {
        let a = IdArg { id, arg: backlog };
        self.exec(cmd::LISTEN, &a.to_bytes(), 0)
    }

    /// ACCEPT of a connection request (the REP): later events of the id carry `uid`.
    pub fn accept(&mut self, id: u32, uid: u64, conn: &ConnParam) -> Result<(), CmdError> {
        let a = Accept {
            uid,
            conn: ConnParam {
                valid: true,
                ..conn.clone()
            },
            id,
        };
        self.exec(cmd::ACCEPT, &a.to_bytes(), 0)
    }

    /// ACCEPT without parameters on the active side after CONNECT_RESPONSE: the RTU, as
    /// librdmacm's `ucma_process_conn_resp` sends it; the connection is established.
    pub fn complete(&mut self, id: u32) -> Result<(), CmdError> {
        let a = Accept {
            uid: 0,
            conn: ConnParam::empty(),
            id,
        };
        self.exec(cmd::ACCEPT, &a.to_bytes(), 0)
    }

    /// REJECT (reason consumer-defined) with private data.
    pub fn reject(&mut self, id: u32, private_data: &[u8]) -> Result<(), CmdError> {
        let r = Reject {
            id,
            reason: 0,
            private_data: private_data.to_vec(),
        };
        self.exec(cmd::REJECT, &r.to_bytes(), 0)
    }

    /// DISCONNECT (the DREQ, or the DREP of a peer's DREQ).
    pub fn disconnect(&mut self, id: u32) -> Result<(), CmdError> {
        self.exec(cmd::DISCONNECT, &IdArg { id, arg: 0 }.to_bytes_id(), 0)
    }

    /// GET_EVENT without waiting: the next event of the file's ids (connected-mode
    /// parameters), or `None` when none is queued.
    pub fn get_event(&mut self) -> Result<Option<EventResp>, CmdError> {
        let mut resp = [0u8; EventResp::LEN];
        let body = abi::get_event_bytes(addr_of(&mut resp));
        match self.exec(cmd::GET_EVENT, &body, EventResp::LEN as u16) {
            Ok(()) => {}
            Err(CmdError::Errno { errno, .. }) if errno == libc::EAGAIN => {
                self.stats.empty_reads += 1;
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
        self.stats.events += 1;
        EventResp::parse(&resp, false)
            .map(Some)
            .map_err(|e| CmdError::BadAnswer {
                cmd: cmd::name(cmd::GET_EVENT),
                what: e.to_string(),
            })
    }

    /// The next event, waiting for it until `until` (`None`: time is up first).
    pub fn next_event(&mut self, until: Instant) -> Result<Option<EventResp>, CmdError> {
        loop {
            if let Some(e) = self.get_event()? {
                return Ok(Some(e));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.stats.waits += 1;
            self.chan
                .wait(left)
                .map_err(|errno| CmdError::Errno { cmd: "poll", errno })?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::abi::{EventParam, event, u32_at, u64_at};

    /// A channel that answers like a device: CREATE_ID writes id 7 into the caller's
    /// buffer, GET_EVENT writes one queued event then EAGAIN, the rest records.
    #[derive(Default)]
    struct Script {
        written: Vec<Vec<u8>>,
        events: Vec<EventResp>,
    }

    impl Channel for Script {
        fn execute(&mut self, c: &[u8]) -> Result<(), i32> {
            self.written.push(c.to_vec());
            let h = abi::CmdHdr::parse(c).map_err(|_| libc::EINVAL)?;
            let body = &c[abi::HDR_LEN..];
            let put = |addr: u64, data: &[u8]| {
                let mut mem = crate::service::caller::ProcessMemory::new(std::process::id());
                crate::service::caller::CallerMemory::write(&mut mem, addr, data)
            };
            match h.cmd {
                cmd::CREATE_ID => put(u64_at(body, 8), &7u32.to_le_bytes()),
                cmd::GET_EVENT => match self.events.pop() {
                    Some(e) => put(u64_at(body, 0), &e.to_bytes()[..usize::from(h.out_len)]),
                    None => Err(libc::EAGAIN),
                },
                cmd::CONNECT => Err(libc::EINVAL),
                _ => Ok(()),
            }
        }

        fn wait(&mut self, t: Duration) -> Result<bool, i32> {
            if self.events.is_empty() {
                std::thread::sleep(t);
            }
            Ok(!self.events.is_empty())
        }
    }

    #[test]
    fn answers_arrive_in_the_callers_buffers() {
        let mut cm = RdmaCm::new(Script {
            events: vec![EventResp {
                uid: 0x55,
                id: 7,
                event: event::ADDR_RESOLVED,
                status: 0,
                param: EventParam::Conn(ConnParam::empty()),
                ece: Ece::default(),
            }],
            ..Script::default()
        });
        assert_eq!(cm.create_id(0x55, abi::ps::TCP), Ok(7));
        let e = cm.get_event().unwrap();
        assert_eq!(e.map(|e| (e.uid, e.id, e.event)), Some((0x55, 7, 0)));
        assert_eq!(cm.get_event(), Ok(None), "EAGAIN is no event");
        let err = cm.connect(7, &ConnParam::empty()).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EINVAL));
        assert!(err.to_string().starts_with("connect: "), "{err}");
        assert!(err.to_string().contains("EINVAL 22"), "{err}");
        let until = Instant::now() + Duration::from_millis(50);
        assert_eq!(cm.next_event(until), Ok(None));
        let s = cm.stats();
        assert_eq!((s.events, s.empty_reads), (1, 3));
        // The commands as librdmacm writes them: header sizes, the id in place.
        let w = &cm.channel().written;
        assert_eq!(
            abi::CmdHdr::parse(&w[0]).map(|h| (h.cmd, h.in_len, h.out_len)),
            Ok((cmd::CREATE_ID, 24, 4))
        );
        assert_eq!(w[0].len(), 32);
        assert_eq!(
            abi::CmdHdr::parse(&w[1]).map(|h| (h.in_len, h.out_len)),
            Ok((8, 336))
        );
        let c = w.iter().find(|c| u32_at(c, 0) == cmd::CONNECT);
        assert_eq!(c.map(|c| (c.len(), u32_at(c, 8 + 272))), Some((296, 7)));
    }

    #[test]
    fn a_missing_node_is_an_open_error() {
        let e = DeviceFile::open(Path::new("/nonexistent/rdma_cm")).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn errno_text_names_the_errno() {
        assert!(errno_text(libc::EAGAIN).contains("EAGAIN 11"));
        assert!(errno_text(9999).contains("errno 9999"));
    }
}

//! Netlink for the service: the socket, the messages and their attributes, whatever
//! the protocol. [`Socket`] opens a socket of a protocol (joined to multicast groups
//! or not), sends a request under its next sequence number and walks the answer, one
//! datagram or several, until it ends: NLMSG_DONE after a dump, NLMSG_ERROR (an
//! acknowledgement, or the kernel's errno as an error), or the caller having read what
//! it wanted. [`messages`], [`walk`] and [`Attrs`] read what the kernel sends, checked:
//! a length past what is there is an error, never a panic.
//!
//! What a request asks and what its answer means belong to each protocol's module:
//! [`super::neigh`] (rtnetlink), [`super::nldev`] (RDMA netlink).

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Errors of netlink sockets and of what they receive.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// A socket call failed.
    #[error("netlink {what}: {err}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The error.
        err: io::Error,
    },
    /// The kernel answered with an error (a negative errno in NLMSG_ERROR).
    #[error("netlink: the kernel answered errno {0}")]
    Kernel(i32),
    /// An answer that could not be read.
    #[error("netlink: malformed answer: {0}")]
    Malformed(&'static str),
}

impl NetlinkError {
    /// The errno this error stands for (EIO for an answer that could not be read).
    pub fn errno(&self) -> i32 {
        match self {
            NetlinkError::Socket { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            NetlinkError::Kernel(e) => *e,
            NetlinkError::Malformed(_) => libc::EIO,
        }
    }
}

/// `NLMSG_HDRLEN`: the size of `struct nlmsghdr`.
pub const NLMSG_HDRLEN: usize = 16;
/// `NLMSG_ERROR`: an error, or an acknowledgement (errno 0); `NLMSG_DONE`: the end of
/// a multi-part answer.
const NLMSG_ERROR: u16 = libc::NLMSG_ERROR as u16;
const NLMSG_DONE: u16 = libc::NLMSG_DONE as u16;
/// `NLA_TYPE_MASK`: an attribute's type without the nested and byte-order bits.
const NLA_TYPE_MASK: u16 = 0x3FFF;
/// An attribute's header: length and type.
const NLA_HDRLEN: usize = 4;

/// The receive buffer's size: the most the kernel puts in one datagram of a dump
/// (it sizes them to the reader's buffer up to 32 KiB).
const RECV_BUFFER: usize = 32 * 1024;
/// How long a request socket waits for an answer (the kernel answers at once; the
/// bound only guards a lost one).
const ANSWER_TIMEOUT_S: libc::time_t = 1;

/// `NLMSG_ALIGN` / `NLA_ALIGN`: `n` rounded up to 4.
pub fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// The native-endian u16 at `at` in `b`, when `b` holds it.
pub fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        b.get(at..at.checked_add(2)?)?.try_into().ok()?,
    ))
}

/// The native-endian u32 at `at` in `b`, when `b` holds it.
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        b.get(at..at.checked_add(4)?)?.try_into().ok()?,
    ))
}

/// No attributes, for [`request`].
pub const NO_ATTRS: &[(u16, &[u8])] = &[];

/// A request: the header (`NLM_F_REQUEST` added to `flags`, the other `NLM_F_*`), the
/// family message `body`, then the attributes, each padded to 4 bytes.
pub fn request<A: AsRef<[u8]>>(
    kind: u16,
    flags: u16,
    seq: u32,
    body: &[u8],
    attrs: &[(u16, A)],
) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDRLEN];
    b.extend_from_slice(body);
    b.resize(align4(b.len()), 0);
    for (t, v) in attrs {
        let v = v.as_ref();
        let len = NLA_HDRLEN + v.len();
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&t.to_ne_bytes());
        b.extend_from_slice(v);
        b.resize(align4(b.len()), 0);
    }
    let total = b.len() as u32;
    b[0..4].copy_from_slice(&total.to_ne_bytes());
    b[4..6].copy_from_slice(&kind.to_ne_bytes());
    b[6..8].copy_from_slice(&(flags | libc::NLM_F_REQUEST as u16).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// One message of a netlink datagram: its type, sequence number and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg<'a> {
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_flags`.
    pub flags: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// What follows the header.
    pub payload: &'a [u8],
}

/// The messages of a datagram; a truncated one (a header cut short, a length under
/// the header's or past the datagram) makes the whole datagram an error.
pub fn messages(mut b: &[u8]) -> Result<Vec<Msg<'_>>, NetlinkError> {
    let mut out = Vec::new();
    while !b.is_empty() {
        if b.len() < NLMSG_HDRLEN {
            return Err(NetlinkError::Malformed("short message header"));
        }
        let len = u32_at(b, 0).map_or(0, |l| l as usize);
        if len < NLMSG_HDRLEN || len > b.len() {
            return Err(NetlinkError::Malformed("bad message length"));
        }
        out.push(Msg {
            kind: u16_at(b, 4).unwrap_or_default(),
            flags: u16_at(b, 6).unwrap_or_default(),
            seq: u32_at(b, 8).unwrap_or_default(),
            payload: &b[NLMSG_HDRLEN..len],
        });
        b = &b[align4(len).min(b.len())..];
    }
    Ok(out)
}

/// The errno of an NLMSG_ERROR payload (0 for an acknowledgement).
pub fn error_of(payload: &[u8]) -> Result<i32, NetlinkError> {
    let e = u32_at(payload, 0).ok_or(NetlinkError::Malformed("short NLMSG_ERROR"))? as i32;
    Ok(e.wrapping_neg())
}

/// What the reader of an answer's messages says after one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Go on with the next message.
    More,
    /// It has what it wanted: the answer ends here.
    Stop,
}

/// How an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// NLMSG_DONE (the end of a dump), or an empty datagram.
    Done,
    /// NLMSG_ERROR with errno 0: an acknowledgement.
    Ack,
    /// The reader said [`Step::Stop`].
    Stopped,
}

/// Walks one datagram of the answer to request `seq`: its messages of that sequence
/// number (others, late answers to earlier requests, are passed over) go to `each`
/// until the answer ends; `None` when it goes on in the next datagram. NLMSG_ERROR
/// with an errno is [`NetlinkError::Kernel`].
pub fn walk(
    datagram: &[u8],
    seq: u32,
    each: &mut dyn FnMut(Msg<'_>) -> Result<Step, NetlinkError>,
) -> Result<Option<End>, NetlinkError> {
    if datagram.is_empty() {
        return Ok(Some(End::Done));
    }
    for m in messages(datagram)? {
        if m.seq != seq {
            continue;
        }
        match m.kind {
            NLMSG_ERROR => {
                return match error_of(m.payload)? {
                    0 => Ok(Some(End::Ack)),
                    e => Err(NetlinkError::Kernel(e)),
                };
            }
            NLMSG_DONE => return Ok(Some(End::Done)),
            _ => {
                if each(m)? == Step::Stop {
                    return Ok(Some(End::Stopped));
                }
            }
        }
    }
    Ok(None)
}

/// One attribute (`struct nlattr` / `struct rtattr`): its type (without the nested
/// and byte-order bits) and its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attr<'a> {
    /// The type.
    pub kind: u16,
    /// The value, without the padding.
    pub value: &'a [u8],
}

impl Attr<'_> {
    /// The value as a u16, when it holds one.
    pub fn u16(&self) -> Option<u16> {
        u16_at(self.value, 0)
    }

    /// The value as a u32, when it holds one.
    pub fn u32(&self) -> Option<u32> {
        u32_at(self.value, 0)
    }
}

/// The attributes of a message, in order; one whose length is under its header's or
/// past what is left is an error, and ends the walk. Fewer than 4 bytes left over
/// are padding.
#[derive(Debug, Clone)]
pub struct Attrs<'a> {
    rest: &'a [u8],
}

impl<'a> Attrs<'a> {
    /// The attributes of `b`.
    pub fn new(b: &'a [u8]) -> Attrs<'a> {
        Attrs { rest: b }
    }

    /// The attributes after a family message of `skip` bytes (padded to 4) at the
    /// head of `payload`; an error when the payload is shorter than that message.
    pub fn after(payload: &'a [u8], skip: usize) -> Result<Attrs<'a>, NetlinkError> {
        if payload.len() < skip {
            return Err(NetlinkError::Malformed("short family message"));
        }
        Ok(Attrs::new(payload.get(align4(skip)..).unwrap_or_default()))
    }
}

impl<'a> Iterator for Attrs<'a> {
    type Item = Result<Attr<'a>, NetlinkError>;

    fn next(&mut self) -> Option<Self::Item> {
        let b = self.rest;
        if b.len() < NLA_HDRLEN {
            return None;
        }
        let len = usize::from(u16_at(b, 0).unwrap_or_default());
        if len < NLA_HDRLEN || len > b.len() {
            self.rest = &[];
            return Some(Err(NetlinkError::Malformed("bad attribute length")));
        }
        self.rest = &b[align4(len).min(b.len())..];
        Some(Ok(Attr {
            kind: u16_at(b, 2).unwrap_or_default() & NLA_TYPE_MASK,
            value: &b[NLA_HDRLEN..len],
        }))
    }
}

/// A netlink socket of one protocol, with the sequence numbers of its requests and
/// its receive buffer.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

impl Socket {
    /// A socket of `protocol` (`NETLINK_ROUTE`, `NETLINK_RDMA`, ...). With `groups`
    /// (a bit mask of multicast groups) it is joined to them and does not block: its
    /// owner polls it and drains it with [`Socket::recv`]. Without, it is a request
    /// socket, whose receive waits at most a second for the kernel's answer.
    pub fn open(protocol: i32, groups: u32) -> Result<Socket, NetlinkError> {
        let nonblock = if groups != 0 { libc::SOCK_NONBLOCK } else { 0 };
        // SAFETY: socket(2) takes no pointers; its result is checked before use.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | nonblock,
                protocol,
            )
        };
        if fd < 0 {
            return Err(last("socket"));
        }
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_nl is a valid value (family set below).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        sa.nl_groups = groups;
        // SAFETY: `sa` is a sockaddr_nl that outlives the call; the length is its size.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const sa).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if r < 0 {
            return Err(last("bind"));
        }
        if groups == 0 {
            let tv = libc::timeval {
                tv_sec: ANSWER_TIMEOUT_S,
                tv_usec: 0,
            };
            // SAFETY: `tv` is a timeval that outlives the call; the length is its size.
            let r = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&raw const tv).cast(),
                    size_of::<libc::timeval>() as libc::socklen_t,
                )
            };
            if r < 0 {
                return Err(last("setsockopt SO_RCVTIMEO"));
            }
        }
        Ok(Socket {
            fd,
            seq: 0,
            buf: Vec::new(),
        })
    }

    /// Sends the request `build(seq)` made under the next sequence number and walks
    /// its answer ([`walk`]) until it ends: how it ended, or the first error (the
    /// kernel's errno, a malformed datagram, a socket call, no answer in time).
    pub fn request(
        &mut self,
        build: impl FnOnce(u32) -> Vec<u8>,
        mut each: impl FnMut(Msg<'_>) -> Result<Step, NetlinkError>,
    ) -> Result<End, NetlinkError> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let req = build(seq);
        // SAFETY: `req` is readable for its length for the duration of the call; an
        // unconnected netlink socket's send goes to the kernel.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
        if n < 0 {
            return Err(last("send"));
        }
        loop {
            let datagram = self.recv()?;
            if let Some(end) = walk(datagram, seq, &mut each)? {
                return Ok(end);
            }
        }
    }

    /// The next datagram; a datagram longer than the buffer is malformed (its end
    /// is lost). On a group socket, EAGAIN when it is drained and ENOBUFS when
    /// notifications were lost come back as [`NetlinkError::Socket`].
    pub fn recv(&mut self) -> Result<&[u8], NetlinkError> {
        self.buf.resize(RECV_BUFFER, 0);
        // SAFETY: `buf` is writable for its length for the duration of the call;
        // MSG_TRUNC makes the result the datagram's whole length, unwritten past it.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_TRUNC,
            )
        };
        if n < 0 {
            return Err(last("recv"));
        }
        let n = n as usize;
        if n > self.buf.len() {
            return Err(NetlinkError::Malformed("datagram longer than the buffer"));
        }
        Ok(&self.buf[..n])
    }
}

fn last(what: &'static str) -> NetlinkError {
    NetlinkError::Socket {
        what,
        err: io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A message as the kernel lays it out: header, payload, padding to 4.
    fn msg(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDRLEN + payload.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(payload);
        m.resize(align4(m.len()), 0);
        m
    }

    fn error(seq: u32, errno: i32) -> Vec<u8> {
        let mut p = (-errno).to_ne_bytes().to_vec();
        p.extend_from_slice(&[0; NLMSG_HDRLEN]);
        msg(NLMSG_ERROR, seq, &p)
    }

    /// Walks `datagrams` as one answer to `seq`: the payloads read and how it ended
    /// (`None`: not yet).
    fn walk_all(
        datagrams: &[Vec<u8>],
        seq: u32,
    ) -> Result<(Vec<Vec<u8>>, Option<End>), NetlinkError> {
        let mut got = Vec::new();
        for d in datagrams {
            let mut each = |m: Msg<'_>| {
                got.push(m.payload.to_vec());
                Ok(Step::More)
            };
            if let Some(end) = walk(d, seq, &mut each)? {
                return Ok((got, Some(end)));
            }
        }
        Ok((got, None))
    }

    #[test]
    fn a_request_reads_back_as_one_message() {
        let ack = libc::NLM_F_ACK as u16;
        let r = request(30, ack, 9, &[1, 2, 3], &[(1u16, vec![10, 0, 0, 1])]);
        assert_eq!(r.len(), NLMSG_HDRLEN + 4 + 8);
        let ms = messages(&r).unwrap();
        assert_eq!(ms.len(), 1);
        assert_eq!((ms[0].kind, ms[0].flags, ms[0].seq), (30, ack | 1, 9));
        assert_eq!(&ms[0].payload[..4], &[1, 2, 3, 0], "the body padded to 4");
        let attrs: Vec<_> = Attrs::after(ms[0].payload, 3).unwrap().collect();
        assert_eq!(attrs.len(), 1);
        let a = attrs[0].as_ref().unwrap();
        assert_eq!((a.kind, a.value), (1, &[10, 0, 0, 1][..]));
    }

    #[test]
    fn truncated_messages_are_errors() {
        // A header cut short.
        let m = msg(24, 1, &[0; 8]);
        assert!(matches!(
            messages(&m[..10]),
            Err(NetlinkError::Malformed(_))
        ));
        // A length past the datagram, and one under the header's.
        let mut long = m.clone();
        long[0..4].copy_from_slice(&200u32.to_ne_bytes());
        assert!(matches!(messages(&long), Err(NetlinkError::Malformed(_))));
        let mut under = m.clone();
        under[0..4].copy_from_slice(&8u32.to_ne_bytes());
        assert!(matches!(messages(&under), Err(NetlinkError::Malformed(_))));
        // A good message followed by a cut one: the datagram is an error.
        let both = [m.clone(), m[..20].to_vec()].concat();
        assert!(messages(&both).is_err());
        let mut each = |_: Msg<'_>| Ok(Step::More);
        assert!(matches!(
            walk(&both, 1, &mut each),
            Err(NetlinkError::Malformed(_))
        ));
        // An NLMSG_ERROR too short for its errno.
        assert!(error_of(&[0, 0]).is_err());
        assert!(walk(&msg(NLMSG_ERROR, 1, &[0, 0]), 1, &mut each).is_err());
        // The readers stay inside the buffer.
        assert_eq!(u16_at(&[1], 0), None);
        assert_eq!(u32_at(&[1, 2, 3, 4], 1), None);
        assert_eq!(u32_at(&[1, 2, 3, 4], usize::MAX), None);
    }

    #[test]
    fn nlmsg_error_is_the_errno_or_an_ack() {
        assert_eq!(
            error_of(&(-libc::ENOENT).to_ne_bytes()).unwrap(),
            libc::ENOENT
        );
        assert_eq!(error_of(&i32::MIN.to_ne_bytes()).unwrap(), i32::MIN);
        let e = walk_all(&[error(4, libc::ENETUNREACH)], 4);
        assert!(matches!(e, Err(NetlinkError::Kernel(libc::ENETUNREACH))));
        assert_eq!(
            NetlinkError::Kernel(libc::ENETUNREACH).errno(),
            libc::ENETUNREACH
        );
        assert_eq!(NetlinkError::Malformed("x").errno(), libc::EIO);
        let (got, end) = walk_all(&[error(4, 0)], 4).unwrap();
        assert!(got.is_empty());
        assert_eq!(end, Some(End::Ack));
        // Another request's error is not this one's.
        let (_, end) = walk_all(&[error(3, libc::ENOENT)], 4).unwrap();
        assert_eq!(end, None);
    }

    #[test]
    fn a_multi_part_answer_runs_to_done() {
        let first = [msg(100, 5, b"a"), msg(100, 4, b"late"), msg(100, 5, b"b")].concat();
        let second = [msg(100, 5, b"c"), msg(NLMSG_DONE, 5, &[0; 4])].concat();
        let (got, end) = walk_all(std::slice::from_ref(&first), 5).unwrap();
        assert_eq!((got.len(), end), (2, None), "the answer goes on");
        let (got, end) = walk_all(&[first, second, msg(100, 5, b"after")], 5).unwrap();
        assert_eq!(end, Some(End::Done));
        let firsts: Vec<u8> = got.iter().map(|p| p[0]).collect();
        assert_eq!(firsts, b"abc", "in order, without the other request's");
        // A reader that has what it wants stops the walk; an empty datagram ends it.
        let mut n = 0;
        let mut each = |_: Msg<'_>| {
            n += 1;
            Ok(Step::Stop)
        };
        let two = [msg(100, 5, b"a"), msg(100, 5, b"b")].concat();
        assert_eq!(walk(&two, 5, &mut each).unwrap(), Some(End::Stopped));
        assert_eq!(n, 1);
        let mut each = |_: Msg<'_>| Ok(Step::More);
        assert_eq!(walk(&[], 5, &mut each).unwrap(), Some(End::Done));
        // The reader's error is the walk's.
        let mut each = |_: Msg<'_>| Err(NetlinkError::Malformed("reader"));
        assert!(matches!(
            walk(&two, 5, &mut each),
            Err(NetlinkError::Malformed("reader"))
        ));
    }

    #[test]
    fn attributes_walk_with_padding_and_refuse_short_ones() {
        // A 5-byte value padded to 8, a u32, a nested-flagged u16, 2 bytes of slack.
        let mut b = Vec::new();
        for (t, v) in [
            (2u16, &b"rxe0\0"[..]),
            (1, &7u32.to_ne_bytes()),
            (0x8003, &9u16.to_ne_bytes()),
        ] {
            b.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
            b.extend_from_slice(&t.to_ne_bytes());
            b.extend_from_slice(v);
            b.resize(align4(b.len()), 0);
        }
        b.extend_from_slice(&[0, 0]);
        let attrs: Vec<Attr<'_>> = Attrs::new(&b).map(Result::unwrap).collect();
        assert_eq!(attrs.len(), 3);
        assert_eq!((attrs[0].kind, attrs[0].value), (2, &b"rxe0\0"[..]));
        assert_eq!((attrs[1].kind, attrs[1].u32()), (1, Some(7)));
        assert_eq!((attrs[2].kind, attrs[2].u16()), (3, Some(9)));
        assert_eq!(attrs[2].u32(), None, "a u16 holds no u32");
        // A length past what is left, and one under the header's: an error, then
        // nothing more.
        let mut past = b.clone();
        past[12..14].copy_from_slice(&200u16.to_ne_bytes());
        let got: Vec<_> = Attrs::new(&past).collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].is_ok());
        assert!(matches!(got[1], Err(NetlinkError::Malformed(_))));
        let mut under = b.clone();
        under[0..2].copy_from_slice(&2u16.to_ne_bytes());
        let got: Vec<_> = Attrs::new(&under).collect();
        assert_eq!(got.len(), 1);
        assert!(got[0].is_err());
        // A family message longer than the payload.
        assert!(Attrs::after(&[0; 8], 12).is_err());
        assert_eq!(Attrs::after(&[0; 12], 12).unwrap().count(), 0);
    }

    /// This machine's kernel: a dump of the links over NETLINK_ROUTE runs to DONE and
    /// lists the loopback; a request the kernel refuses is its errno.
    #[test]
    fn the_kernel_answers_a_dump_and_an_error() {
        let mut s = Socket::open(libc::NETLINK_ROUTE, 0).unwrap();
        let mut links = 0;
        let end = s
            .request(
                |seq| request(18, libc::NLM_F_DUMP as u16, seq, &[0u8; 16], NO_ATTRS),
                |m| {
                    links += usize::from(m.kind == 16);
                    Ok(Step::More)
                },
            )
            .unwrap();
        assert_eq!(end, End::Done);
        assert!(links >= 1, "the loopback at least");
        // RTM_GETLINK of an interface that does not exist.
        let mut body = [0u8; 16];
        body[4..8].copy_from_slice(&i32::MAX.to_ne_bytes());
        let e = s.request(
            |seq| request(18, 0, seq, &body, NO_ATTRS),
            |_| Ok(Step::More),
        );
        assert!(
            matches!(e, Err(NetlinkError::Kernel(libc::ENODEV))),
            "{e:?}"
        );
    }
}

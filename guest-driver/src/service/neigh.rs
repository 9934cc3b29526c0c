//! The IP side of rdma_cm's address resolution, as the kernel's `addr_resolve()`
//! (drivers/infiniband/core/addr.c) does it for `rdma_resolve_ip()`: the route to the
//! destination (its interface, its gateway, the source address it picks), then the
//! neighbour of the next hop (the gateway when the route has one, else the destination)
//! on that interface.
//!
//! [`Lookup`] is what the resolution asks the network; [`Netlink`] answers through
//! rtnetlink: RTM_GETROUTE for the route, RTM_GETLINK for the interface's flags
//! (`IFF_LOOPBACK`: a local destination, its own neighbour; `IFF_NOARP`: none needed),
//! RTM_GETNEIGH for the neighbour, and RTM_NEWNEIGH with `NTF_USE` to start resolving one
//! that is not valid, which is the kernel's `neigh_event_send()` (ARP or neighbour
//! solicitation, with the interface's probes and timers). A second socket, joined to
//! RTNLGRP_NEIGH, tells when a neighbour becomes valid ([`Lookup::changed`]): the
//! kernel's NETEVENT_NEIGH_UPDATE, after which every waiting resolution is tried again.
//!
//! [`resolve`] is the kernel's rule over those answers. Waiting and timing out belong to
//! the rdma_cm layer ([`super::cma`]): it keeps the resolutions that wait and tries them
//! again on a change or at their deadline.

use std::io;
use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Errors of the netlink sockets.
#[derive(Debug, thiserror::Error)]
pub enum NeighError {
    /// A socket call failed.
    #[error("rtnetlink {what}: {err}")]
    Socket {
        /// What was being done.
        what: &'static str,
        /// The error.
        err: io::Error,
    },
    /// The kernel answered with an error (a negative errno in NLMSG_ERROR).
    #[error("rtnetlink: the kernel answered errno {0}")]
    Kernel(i32),
    /// An answer that could not be read.
    #[error("rtnetlink: malformed answer: {0}")]
    Malformed(&'static str),
}

impl NeighError {
    /// The errno a resolution fails with.
    pub fn errno(&self) -> i32 {
        match self {
            NeighError::Socket { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            NeighError::Kernel(e) => *e,
            NeighError::Malformed(_) => libc::EIO,
        }
    }
}

/// `NUD_*` neighbour states (linux/neighbour.h).
pub mod nud {
    /// Resolution under way.
    pub const INCOMPLETE: u16 = 0x01;
    /// Confirmed.
    pub const REACHABLE: u16 = 0x02;
    /// Known, unconfirmed.
    pub const STALE: u16 = 0x04;
    /// Waiting to probe.
    pub const DELAY: u16 = 0x08;
    /// Probing.
    pub const PROBE: u16 = 0x10;
    /// Resolution failed.
    pub const FAILED: u16 = 0x20;
    /// No resolution needed.
    pub const NOARP: u16 = 0x40;
    /// Static.
    pub const PERMANENT: u16 = 0x80;
    /// `NUD_VALID`: the states whose link-layer address may be used.
    pub const VALID: u16 = PERMANENT | NOARP | REACHABLE | PROBE | STALE | DELAY;
}

/// `RTN_LOCAL`: the route of a local address (through the loopback).
pub const RTN_LOCAL: u8 = 2;

/// `IFF_*` interface flags the resolution reads.
pub mod iff {
    /// The interface is up.
    pub const UP: u32 = libc::IFF_UP as u32;
    /// The loopback: its destinations are local, their own neighbours.
    pub const LOOPBACK: u32 = libc::IFF_LOOPBACK as u32;
    /// No ARP: no neighbour to resolve.
    pub const NOARP: u32 = libc::IFF_NOARP as u32;
}

/// The route to a destination, as RTM_GETROUTE answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// `rtm_type` (`RTN_UNICAST` 1, `RTN_LOCAL` 2, ...).
    pub kind: u8,
    /// The output interface.
    pub ifindex: u32,
    /// The gateway, when the destination is not on-link.
    pub gateway: Option<IpAddr>,
    /// The source address the route picks (`RTA_PREFSRC`; the source asked for when one
    /// was given).
    pub src: Option<IpAddr>,
}

impl Route {
    /// The neighbour to resolve: the gateway, or the destination itself.
    pub fn next_hop(&self, dst: IpAddr) -> IpAddr {
        self.gateway.unwrap_or(dst)
    }
}

/// A neighbour entry, as RTM_GETNEIGH answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    /// `NUD_*` state.
    pub state: u16,
    /// Its link-layer address, when known.
    pub lladdr: Option<Vec<u8>>,
}

impl Neighbour {
    /// Whether its address may be used (`NUD_VALID`).
    pub fn valid(&self) -> bool {
        self.state & nud::VALID != 0
    }
}

/// What the resolution asks the network.
pub trait Lookup: std::fmt::Debug + Send {
    /// The route from `src` (or from the address the route picks) to `dst`; the errno of
    /// the kernel's route lookup when there is none (ENETUNREACH, EHOSTUNREACH, ...).
    fn route(&mut self, dst: IpAddr, src: Option<IpAddr>) -> Result<Route, NeighError>;
    /// The `IFF_*` flags of an interface.
    fn link_flags(&mut self, ifindex: u32) -> Result<u32, NeighError>;
    /// The neighbour `addr` on `ifindex`; `None` when there is no entry.
    fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Option<Neighbour>, NeighError>;
    /// Starts resolving the neighbour (the kernel's `neigh_event_send()`).
    fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), NeighError>;
    /// The descriptor that becomes readable when neighbours change, once there is one.
    fn fd(&self) -> Option<RawFd>;
    /// Reads what changed; whether a neighbour became valid since the last call.
    fn changed(&mut self) -> bool;
}

/// Where one attempt of a resolution stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// The neighbour is valid (or none is needed): the source address the route gave.
    Resolved {
        /// The source address.
        src: IpAddr,
    },
    /// The neighbour is being resolved (the kernel's -ENODATA).
    Waiting,
    /// No route, or the lookup failed: the errno.
    Failed(i32),
}

/// One attempt of the kernel's `addr_resolve(.., resolve_neigh = true, ..)`: the route
/// from `src` (unbound: the route's own choice) to `dst`, then, unless the route's
/// interface is the loopback (a local destination) or does no ARP, the neighbour of the
/// next hop; one that is not valid is solicited, and the attempt waits unless that made
/// it valid.
pub fn resolve(net: &mut dyn Lookup, src: Option<IpAddr>, dst: IpAddr) -> Attempt {
    let route = match net.route(dst, src) {
        Ok(r) => r,
        Err(e) => return Attempt::Failed(e.errno()),
    };
    let Some(from) = route.src.or(src) else {
        return Attempt::Failed(libc::EADDRNOTAVAIL);
    };
    let flags = match net.link_flags(route.ifindex) {
        Ok(f) => f,
        Err(e) => return Attempt::Failed(e.errno()),
    };
    if flags & (iff::LOOPBACK | iff::NOARP) != 0 {
        return Attempt::Resolved { src: from };
    }
    let hop = route.next_hop(dst);
    match net.neighbour(route.ifindex, hop) {
        Ok(Some(n)) if n.valid() => return Attempt::Resolved { src: from },
        Ok(_) => {}
        Err(e) => return Attempt::Failed(e.errno()),
    }
    if let Err(e) = net.solicit(route.ifindex, hop) {
        return Attempt::Failed(e.errno());
    }
    // An entry the solicitation created may be valid at once (a multicast group's is
    // NOARP), and its creation is no notification.
    match net.neighbour(route.ifindex, hop) {
        Ok(Some(n)) if n.valid() => Attempt::Resolved { src: from },
        Ok(_) => Attempt::Waiting,
        Err(e) => Attempt::Failed(e.errno()),
    }
}

// ------------------------------------------------------------ the netlink messages

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_CREATE: u16 = 0x400;
/// rtnetlink message types.
pub mod rtm {
    /// RTM_NEWLINK.
    pub const NEWLINK: u16 = 16;
    /// RTM_GETLINK.
    pub const GETLINK: u16 = 18;
    /// RTM_NEWROUTE.
    pub const NEWROUTE: u16 = 24;
    /// RTM_GETROUTE.
    pub const GETROUTE: u16 = 26;
    /// RTM_NEWNEIGH.
    pub const NEWNEIGH: u16 = 28;
    /// RTM_GETNEIGH.
    pub const GETNEIGH: u16 = 30;
}
const RTA_DST: u16 = 1;
const RTA_SRC: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PREFSRC: u16 = 7;
const RTA_VIA: u16 = 18;
const NDA_DST: u16 = 1;
const NDA_LLADDR: u16 = 2;
const NTF_USE: u8 = 0x01;
/// `RTMGRP_NEIGH`: the neighbour notifications' group bit.
const RTMGRP_NEIGH: u32 = 0x4;
/// `struct rtmsg`, `struct ndmsg`: 12 bytes; `struct ifinfomsg`: 16.
const RTMSG_LEN: usize = 12;
const NDMSG_LEN: usize = 12;
const IFINFOMSG_LEN: usize = 16;

fn family(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn addr_bytes(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A request: the header, the family message `body`, then attributes.
fn message(kind: u16, flags: u16, seq: u32, body: &[u8], attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDRLEN];
    b.extend_from_slice(body);
    b.resize(align4(b.len()), 0);
    for (t, v) in attrs {
        let len = 4 + v.len();
        b.extend_from_slice(&(len as u16).to_ne_bytes());
        b.extend_from_slice(&t.to_ne_bytes());
        b.extend_from_slice(v);
        b.resize(align4(b.len()), 0);
    }
    let total = b.len() as u32;
    b[0..4].copy_from_slice(&total.to_ne_bytes());
    b[4..6].copy_from_slice(&kind.to_ne_bytes());
    b[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// RTM_GETROUTE for `dst` (from `src` when given).
pub fn route_request(seq: u32, dst: IpAddr, src: Option<IpAddr>) -> Vec<u8> {
    let bits = if dst.is_ipv4() { 32 } else { 128 };
    let mut body = [0u8; RTMSG_LEN];
    body[0] = family(dst);
    body[1] = bits;
    let mut attrs = vec![(RTA_DST, addr_bytes(dst))];
    if let Some(s) = src.filter(|s| !s.is_unspecified() && s.is_ipv4() == dst.is_ipv4()) {
        body[2] = bits;
        attrs.push((RTA_SRC, addr_bytes(s)));
    }
    message(rtm::GETROUTE, 0, seq, &body, &attrs)
}

/// RTM_GETNEIGH for `addr` on `ifindex`.
pub fn neigh_request(seq: u32, ifindex: u32, addr: IpAddr) -> Vec<u8> {
    message(
        rtm::GETNEIGH,
        0,
        seq,
        &ndmsg(family(addr), ifindex, 0, 0),
        &[(NDA_DST, addr_bytes(addr))],
    )
}

/// RTM_NEWNEIGH with `NTF_USE` for `addr` on `ifindex` (created when missing): the
/// kernel runs `neigh_event_send()` on it, the resolution `dst_fetch_ha()` starts.
pub fn solicit_request(seq: u32, ifindex: u32, addr: IpAddr) -> Vec<u8> {
    message(
        rtm::NEWNEIGH,
        NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK,
        seq,
        &ndmsg(family(addr), ifindex, 0, NTF_USE),
        &[(NDA_DST, addr_bytes(addr))],
    )
}

/// RTM_GETLINK for `ifindex`.
pub fn link_request(seq: u32, ifindex: u32) -> Vec<u8> {
    let mut body = [0u8; IFINFOMSG_LEN];
    body[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    message(rtm::GETLINK, 0, seq, &body, &[])
}

fn ndmsg(family: u8, ifindex: u32, state: u16, flags: u8) -> [u8; NDMSG_LEN] {
    let mut b = [0u8; NDMSG_LEN];
    b[0] = family;
    b[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    b[8..10].copy_from_slice(&state.to_ne_bytes());
    b[10] = flags;
    b
}

/// One message of a netlink datagram: its type, sequence number and payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Msg<'a> {
    /// `nlmsg_type`.
    pub kind: u16,
    /// `nlmsg_seq`.
    pub seq: u32,
    /// What follows the header.
    pub payload: &'a [u8],
}

fn ne_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn ne_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The messages of a datagram; a truncated one ends the list with an error.
pub fn messages(mut b: &[u8]) -> Result<Vec<Msg<'_>>, NeighError> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let len = ne_u32(b, 0).ok_or(NeighError::Malformed("short header"))? as usize;
        if len < NLMSG_HDRLEN || len > b.len() {
            return Err(NeighError::Malformed("bad message length"));
        }
        out.push(Msg {
            kind: ne_u16(b, 4).unwrap_or_default(),
            seq: ne_u32(b, 8).unwrap_or_default(),
            payload: &b[NLMSG_HDRLEN..len],
        });
        b = &b[align4(len).min(b.len())..];
    }
    Ok(out)
}

/// The errno of an NLMSG_ERROR payload (0 for an acknowledgement).
pub fn error_of(payload: &[u8]) -> Result<i32, NeighError> {
    let e = ne_u32(payload, 0).ok_or(NeighError::Malformed("short NLMSG_ERROR"))? as i32;
    Ok(-e)
}

/// The attributes after a family message of `skip` bytes.
fn attrs(payload: &[u8], skip: usize) -> Result<Vec<(u16, &[u8])>, NeighError> {
    let mut b = payload
        .get(align4(skip)..)
        .ok_or(NeighError::Malformed("short family message"))?;
    let mut out = Vec::new();
    while b.len() >= 4 {
        let len = usize::from(ne_u16(b, 0).unwrap_or_default());
        if len < 4 || len > b.len() {
            return Err(NeighError::Malformed("bad attribute length"));
        }
        out.push((ne_u16(b, 2).unwrap_or_default() & 0x3FFF, &b[4..len]));
        b = &b[align4(len).min(b.len())..];
    }
    Ok(out)
}

fn ip_of(family: u8, v: &[u8]) -> Option<IpAddr> {
    match (i32::from(family), v.len()) {
        (libc::AF_INET, 4) => Some(Ipv4Addr::new(v[0], v[1], v[2], v[3]).into()),
        (libc::AF_INET6, 16) => {
            let o: [u8; 16] = v.try_into().ok()?;
            Some(Ipv6Addr::from(o).into())
        }
        _ => None,
    }
}

/// `RTA_VIA`'s `struct rtvia`: a family, then the address.
fn via_of(v: &[u8]) -> Option<IpAddr> {
    let fam = ne_u16(v, 0)?;
    ip_of(fam as u8, v.get(2..)?)
}

/// An RTM_NEWROUTE payload.
pub fn parse_route(payload: &[u8]) -> Result<Route, NeighError> {
    let fam = *payload
        .first()
        .ok_or(NeighError::Malformed("short rtmsg"))?;
    let kind = *payload.get(7).ok_or(NeighError::Malformed("short rtmsg"))?;
    let mut r = Route {
        kind,
        ifindex: 0,
        gateway: None,
        src: None,
    };
    let mut asked_src = None;
    for (t, v) in attrs(payload, RTMSG_LEN)? {
        match t {
            RTA_OIF => r.ifindex = ne_u32(v, 0).unwrap_or_default(),
            RTA_GATEWAY => r.gateway = ip_of(fam, v),
            RTA_VIA => r.gateway = via_of(v),
            RTA_PREFSRC => r.src = ip_of(fam, v),
            RTA_SRC => asked_src = ip_of(fam, v),
            _ => {}
        }
    }
    r.src = r.src.or(asked_src);
    Ok(r)
}

/// An RTM_NEWNEIGH payload: its interface, its address and the entry.
pub fn parse_neigh(payload: &[u8]) -> Result<(u32, Option<IpAddr>, Neighbour), NeighError> {
    if payload.len() < NDMSG_LEN {
        return Err(NeighError::Malformed("short ndmsg"));
    }
    let fam = payload[0];
    let ifindex = ne_u32(payload, 4).unwrap_or_default();
    let state = ne_u16(payload, 8).unwrap_or_default();
    let mut dst = None;
    let mut lladdr = None;
    for (t, v) in attrs(payload, NDMSG_LEN)? {
        match t {
            NDA_DST => dst = ip_of(fam, v),
            NDA_LLADDR => lladdr = Some(v.to_vec()),
            _ => {}
        }
    }
    Ok((ifindex, dst, Neighbour { state, lladdr }))
}

/// An RTM_NEWLINK payload's `ifi_flags`.
pub fn parse_link_flags(payload: &[u8]) -> Result<u32, NeighError> {
    ne_u32(payload, 8).ok_or(NeighError::Malformed("short ifinfomsg"))
}

/// Whether a datagram of the neighbour group tells of a neighbour that became valid
/// (the kernel's NETEVENT_NEIGH_UPDATE with `NUD_VALID`).
pub fn any_valid(datagram: &[u8]) -> bool {
    messages(datagram).is_ok_and(|ms| {
        ms.iter().any(|m| {
            m.kind == rtm::NEWNEIGH && parse_neigh(m.payload).is_ok_and(|(_, _, n)| n.valid())
        })
    })
}

// ------------------------------------------------------------ the sockets

/// rtnetlink, for the service: a request socket and a socket on the neighbour group,
/// opened at the first lookup.
#[derive(Debug, Default)]
pub struct Netlink {
    socks: Option<(OwnedFd, OwnedFd)>,
    seq: u32,
    /// What the sockets read into (kept: the loop drains the group at every turn).
    buf: Vec<u8>,
}

/// The receive buffer's size (the kernel's answers to these requests are far smaller;
/// notifications come several to a datagram at most).
const RECV_BUFFER: usize = 16384;

fn socket(what: &'static str, groups: u32) -> Result<OwnedFd, NeighError> {
    let err = |err| NeighError::Socket { what, err };
    // SAFETY: socket(2) takes no pointers; its result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | if groups != 0 { libc::SOCK_NONBLOCK } else { 0 },
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(err(io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero sockaddr_nl is a valid value (family set below).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    sa.nl_groups = groups;
    // SAFETY: `sa` is a sockaddr_nl that outlives the call; the length is its size.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sa as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as u32,
        )
    };
    if r < 0 {
        return Err(err(io::Error::last_os_error()));
    }
    if groups == 0 {
        // The kernel answers requests at once; the bound only guards a lost answer.
        let tv = libc::timeval {
            tv_sec: 1,
            tv_usec: 0,
        };
        // SAFETY: `tv` is a timeval that outlives the call; the length is its size.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                size_of::<libc::timeval>() as u32,
            )
        };
        if r < 0 {
            return Err(err(io::Error::last_os_error()));
        }
    }
    Ok(fd)
}

fn recv(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is writable for its length for the duration of the call.
    let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl Netlink {
    /// Sockets opened at the first lookup.
    pub fn new() -> Netlink {
        Netlink::default()
    }

    fn request_fd(&mut self) -> Result<RawFd, NeighError> {
        if self.socks.is_none() {
            let req = socket("request socket", 0)?;
            let mon = socket("neighbour group socket", RTMGRP_NEIGH)?;
            self.socks = Some((req, mon));
        }
        match &self.socks {
            Some((req, _)) => Ok(req.as_raw_fd()),
            None => Err(NeighError::Malformed("no socket")),
        }
    }

    /// Sends a request built by `build(seq)` and returns the payload of its answer of
    /// type `want` (`None` for an acknowledgement).
    fn ask(
        &mut self,
        build: impl FnOnce(u32) -> Vec<u8>,
        want: Option<u16>,
    ) -> Result<Option<Vec<u8>>, NeighError> {
        let fd = self.request_fd()?;
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        let req = build(seq);
        // SAFETY: `req` is readable for its length for the duration of the call; a
        // netlink socket's send needs no address (it goes to the kernel).
        let n = unsafe { libc::send(fd, req.as_ptr().cast(), req.len(), 0) };
        if n < 0 {
            return Err(NeighError::Socket {
                what: "send",
                err: io::Error::last_os_error(),
            });
        }
        self.buf.resize(RECV_BUFFER, 0);
        answer(fd, seq, want, &mut self.buf)
    }
}

/// Reads from the request socket `fd` until the answer to request `seq`: the payload
/// of its message of type `want`, or its acknowledgement (`None`), or its error.
fn answer(
    fd: RawFd,
    seq: u32,
    want: Option<u16>,
    buf: &mut [u8],
) -> Result<Option<Vec<u8>>, NeighError> {
    loop {
        let n = recv(fd, buf).map_err(|err| NeighError::Socket { what: "recv", err })?;
        for m in messages(&buf[..n])? {
            if m.seq != seq {
                continue;
            }
            match m.kind {
                NLMSG_ERROR => {
                    let e = error_of(m.payload)?;
                    return if e == 0 {
                        Ok(None)
                    } else {
                        Err(NeighError::Kernel(e))
                    };
                }
                NLMSG_DONE => return Err(NeighError::Malformed("no answer")),
                k if Some(k) == want => return Ok(Some(m.payload.to_vec())),
                _ => {}
            }
        }
    }
}

impl Lookup for Netlink {
    fn route(&mut self, dst: IpAddr, src: Option<IpAddr>) -> Result<Route, NeighError> {
        let p = self.ask(|s| route_request(s, dst, src), Some(rtm::NEWROUTE))?;
        parse_route(&p.ok_or(NeighError::Malformed("route: no answer"))?)
    }

    fn link_flags(&mut self, ifindex: u32) -> Result<u32, NeighError> {
        let p = self.ask(|s| link_request(s, ifindex), Some(rtm::NEWLINK))?;
        parse_link_flags(&p.ok_or(NeighError::Malformed("link: no answer"))?)
    }

    fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Option<Neighbour>, NeighError> {
        match self.ask(|s| neigh_request(s, ifindex, addr), Some(rtm::NEWNEIGH)) {
            Ok(Some(p)) => Ok(Some(parse_neigh(&p)?.2)),
            Ok(None) | Err(NeighError::Kernel(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), NeighError> {
        self.ask(|s| solicit_request(s, ifindex, addr), None)
            .map(|_| ())
    }

    fn fd(&self) -> Option<RawFd> {
        self.socks.as_ref().map(|(_, mon)| mon.as_raw_fd())
    }

    fn changed(&mut self) -> bool {
        let Some((_, mon)) = &self.socks else {
            return false;
        };
        let buf = &mut self.buf;
        buf.resize(RECV_BUFFER, 0);
        let mut valid = false;
        loop {
            match recv(mon.as_raw_fd(), buf) {
                Ok(n) => valid |= any_valid(&buf[..n]),
                // Notifications were lost (the socket's queue overflowed): one of them
                // may have been the one awaited.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => valid = true,
                Err(_) => return valid,
            }
        }
    }
}

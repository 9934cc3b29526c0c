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
//! The sockets, the exchange and the reading of messages and attributes are
//! [`super::netlink`]'s; what the requests ask and what the answers mean are here.
//!
//! [`resolve`] is the kernel's rule over those answers. Waiting and timing out belong to
//! the rdma_cm layer ([`super::cma`]): it keeps the resolutions that wait and tries them
//! again on a change or at their deadline.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, RawFd};

use super::netlink::{
    Attrs, End, NO_ATTRS, NetlinkError, Socket, Step, messages, request, u16_at, u32_at,
};

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
    fn route(&mut self, dst: IpAddr, src: Option<IpAddr>) -> Result<Route, NetlinkError>;
    /// The `IFF_*` flags of an interface.
    fn link_flags(&mut self, ifindex: u32) -> Result<u32, NetlinkError>;
    /// The neighbour `addr` on `ifindex`; `None` when there is no entry.
    fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Option<Neighbour>, NetlinkError>;
    /// Starts resolving the neighbour (the kernel's `neigh_event_send()`).
    fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), NetlinkError>;
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

// ------------------------------------------------------------ the rtnetlink messages

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
    request(rtm::GETROUTE, 0, seq, &body, &attrs)
}

/// RTM_GETNEIGH for `addr` on `ifindex`.
pub fn neigh_request(seq: u32, ifindex: u32, addr: IpAddr) -> Vec<u8> {
    request(
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
    request(
        rtm::NEWNEIGH,
        (libc::NLM_F_CREATE | libc::NLM_F_REPLACE | libc::NLM_F_ACK) as u16,
        seq,
        &ndmsg(family(addr), ifindex, 0, NTF_USE),
        &[(NDA_DST, addr_bytes(addr))],
    )
}

/// RTM_GETLINK for `ifindex`.
pub fn link_request(seq: u32, ifindex: u32) -> Vec<u8> {
    let mut body = [0u8; IFINFOMSG_LEN];
    body[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    request(rtm::GETLINK, 0, seq, &body, NO_ATTRS)
}

fn ndmsg(family: u8, ifindex: u32, state: u16, flags: u8) -> [u8; NDMSG_LEN] {
    let mut b = [0u8; NDMSG_LEN];
    b[0] = family;
    b[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    b[8..10].copy_from_slice(&state.to_ne_bytes());
    b[10] = flags;
    b
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
    let fam = u16_at(v, 0)?;
    ip_of(fam as u8, v.get(2..)?)
}

/// An RTM_NEWROUTE payload.
pub fn parse_route(payload: &[u8]) -> Result<Route, NetlinkError> {
    let fam = *payload
        .first()
        .ok_or(NetlinkError::Malformed("short rtmsg"))?;
    let kind = *payload
        .get(7)
        .ok_or(NetlinkError::Malformed("short rtmsg"))?;
    let mut r = Route {
        kind,
        ifindex: 0,
        gateway: None,
        src: None,
    };
    let mut asked_src = None;
    for a in Attrs::after(payload, RTMSG_LEN)? {
        let a = a?;
        match a.kind {
            RTA_OIF => r.ifindex = a.u32().unwrap_or_default(),
            RTA_GATEWAY => r.gateway = ip_of(fam, a.value),
            RTA_VIA => r.gateway = via_of(a.value),
            RTA_PREFSRC => r.src = ip_of(fam, a.value),
            RTA_SRC => asked_src = ip_of(fam, a.value),
            _ => {}
        }
    }
    r.src = r.src.or(asked_src);
    Ok(r)
}

/// An RTM_NEWNEIGH payload: its interface, its address and the entry.
pub fn parse_neigh(payload: &[u8]) -> Result<(u32, Option<IpAddr>, Neighbour), NetlinkError> {
    if payload.len() < NDMSG_LEN {
        return Err(NetlinkError::Malformed("short ndmsg"));
    }
    let fam = payload[0];
    let ifindex = u32_at(payload, 4).unwrap_or_default();
    let state = u16_at(payload, 8).unwrap_or_default();
    let mut dst = None;
    let mut lladdr = None;
    for a in Attrs::after(payload, NDMSG_LEN)? {
        let a = a?;
        match a.kind {
            NDA_DST => dst = ip_of(fam, a.value),
            NDA_LLADDR => lladdr = Some(a.value.to_vec()),
            _ => {}
        }
    }
    Ok((ifindex, dst, Neighbour { state, lladdr }))
}

/// An RTM_NEWLINK payload's `ifi_flags`.
pub fn parse_link_flags(payload: &[u8]) -> Result<u32, NetlinkError> {
    u32_at(payload, 8).ok_or(NetlinkError::Malformed("short ifinfomsg"))
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
    socks: Option<(Socket, Socket)>,
}

impl Netlink {
    /// Sockets opened at the first lookup.
    pub fn new() -> Netlink {
        Netlink::default()
    }

    fn requests(&mut self) -> Result<&mut Socket, NetlinkError> {
        let socks = match self.socks.take() {
            Some(s) => s,
            None => (
                Socket::open(libc::NETLINK_ROUTE, 0)?,
                Socket::open(libc::NETLINK_ROUTE, RTMGRP_NEIGH)?,
            ),
        };
        Ok(&mut self.socks.insert(socks).0)
    }

    /// Sends a request built by `build(seq)` and returns the payload of its answer of
    /// type `want` (`None` for an acknowledgement).
    fn ask(
        &mut self,
        build: impl FnOnce(u32) -> Vec<u8>,
        want: Option<u16>,
    ) -> Result<Option<Vec<u8>>, NetlinkError> {
        let mut got = None;
        let end = self.requests()?.request(build, |m| {
            if Some(m.kind) != want {
                return Ok(Step::More);
            }
            got = Some(m.payload.to_vec());
            Ok(Step::Stop)
        })?;
        match end {
            End::Stopped | End::Ack => Ok(got),
            End::Done => Err(NetlinkError::Malformed("no answer")),
        }
    }
}

impl Lookup for Netlink {
    fn route(&mut self, dst: IpAddr, src: Option<IpAddr>) -> Result<Route, NetlinkError> {
        let p = self.ask(|s| route_request(s, dst, src), Some(rtm::NEWROUTE))?;
        parse_route(&p.ok_or(NetlinkError::Malformed("route: no answer"))?)
    }

    fn link_flags(&mut self, ifindex: u32) -> Result<u32, NetlinkError> {
        let p = self.ask(|s| link_request(s, ifindex), Some(rtm::NEWLINK))?;
        parse_link_flags(&p.ok_or(NetlinkError::Malformed("link: no answer"))?)
    }

    fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Option<Neighbour>, NetlinkError> {
        match self.ask(|s| neigh_request(s, ifindex, addr), Some(rtm::NEWNEIGH)) {
            Ok(Some(p)) => Ok(Some(parse_neigh(&p)?.2)),
            Ok(None) | Err(NetlinkError::Kernel(libc::ENOENT)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), NetlinkError> {
        self.ask(|s| solicit_request(s, ifindex, addr), None)
            .map(|_| ())
    }

    fn fd(&self) -> Option<RawFd> {
        self.socks.as_ref().map(|(_, mon)| mon.as_raw_fd())
    }

    fn changed(&mut self) -> bool {
        let Some((_, mon)) = &mut self.socks else {
            return false;
        };
        let mut valid = false;
        loop {
            match mon.recv() {
                Ok(d) => valid |= any_valid(d),
                // Notifications were lost (the socket's queue overflowed, or a
                // datagram outgrew the buffer): one of them may have been the one
                // awaited.
                Err(NetlinkError::Malformed(_)) => valid = true,
                Err(e) if e.errno() == libc::ENOBUFS => valid = true,
                Err(_) => return valid,
            }
        }
    }
}

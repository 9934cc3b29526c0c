//! The rtnetlink side of address resolution (`service/neigh.rs`): the answers as the
//! kernel lays them out, read back; bad ones refused with an error; the requests this
//! side builds; and this machine's kernel asked for real where the answer does not
//! depend on its network (the loopback).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use pvcm_guest::service::neigh::{
    self, Attempt, Lookup, Netlink, any_valid, nud, parse_link_flags, parse_neigh, parse_route, rtm,
};
use pvcm_guest::service::netlink::{NetlinkError, error_of, messages};

/// An rtattr: length, type, value, padding to 4.
fn attr(t: u16, v: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
    b.extend_from_slice(&t.to_ne_bytes());
    b.extend_from_slice(v);
    while b.len() % 4 != 0 {
        b.push(0);
    }
    b
}

/// A netlink message of `kind` around `payload`.
fn nlmsg(kind: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&((16 + payload.len()) as u32).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(&0u16.to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes());
    b.extend_from_slice(payload);
    b
}

/// `ip route get 10.98.0.2` on a VM routing 10.98.0.0/24 via 10.99.0.1: struct rtmsg
/// (AF_INET, dst_len 32, table main, RTN_UNICAST), RTA_TABLE, RTA_DST, RTA_OIF 2,
/// RTA_PREFSRC 10.99.0.11, RTA_GATEWAY 10.99.0.1, RTA_UID.
fn route_answer() -> Vec<u8> {
    let mut p = vec![libc::AF_INET as u8, 32, 0, 0, 254, 0, 0, 1];
    p.extend_from_slice(&0x200u32.to_ne_bytes()); // RTM_F_CLONED
    p.extend(attr(15, &254u32.to_ne_bytes()));
    p.extend(attr(1, &[10, 98, 0, 2]));
    p.extend(attr(4, &2u32.to_ne_bytes()));
    p.extend(attr(7, &[10, 99, 0, 11]));
    p.extend(attr(5, &[10, 99, 0, 1]));
    p.extend(attr(25, &0u32.to_ne_bytes()));
    p
}

fn ndmsg(family: u8, ifindex: i32, state: u16) -> Vec<u8> {
    let mut p = vec![family, 0, 0, 0];
    p.extend_from_slice(&ifindex.to_ne_bytes());
    p.extend_from_slice(&state.to_ne_bytes());
    p.extend_from_slice(&[0, 1]); // ndm_flags, ndm_type RTN_UNICAST
    p
}

#[test]
fn a_route_answer_gives_interface_gateway_and_source() {
    let r = parse_route(&route_answer()).unwrap();
    assert_eq!(r.kind, 1);
    assert_eq!(r.ifindex, 2);
    assert_eq!(r.gateway, Some(Ipv4Addr::new(10, 99, 0, 1).into()));
    assert_eq!(r.src, Some(Ipv4Addr::new(10, 99, 0, 11).into()));
    assert_eq!(
        r.next_hop(Ipv4Addr::new(10, 98, 0, 2).into()),
        IpAddr::from(Ipv4Addr::new(10, 99, 0, 1))
    );
}

#[test]
fn an_ipv6_route_with_rta_via_and_no_prefsrc_keeps_the_source_asked_for() {
    let mut p = vec![libc::AF_INET6 as u8, 128, 128, 0, 254, 0, 0, 1, 0, 0, 0, 0];
    let src: Ipv6Addr = "fd99::11".parse().unwrap();
    let via: Ipv6Addr = "fe80::1".parse().unwrap();
    p.extend(attr(2, &src.octets()));
    p.extend(attr(4, &3u32.to_ne_bytes()));
    let mut v = (libc::AF_INET6 as u16).to_ne_bytes().to_vec();
    v.extend_from_slice(&via.octets());
    p.extend(attr(18, &v));
    let r = parse_route(&p).unwrap();
    assert_eq!(
        (r.ifindex, r.gateway, r.src),
        (3, Some(via.into()), Some(src.into()))
    );
}

#[test]
fn neighbour_answers_and_their_states() {
    let mut p = ndmsg(libc::AF_INET as u8, 2, nud::STALE);
    p.extend(attr(1, &[10, 99, 0, 2]));
    p.extend(attr(2, &[0x52, 0x54, 0, 0x99, 0, 2]));
    let (ifindex, dst, n) = parse_neigh(&p).unwrap();
    assert_eq!(ifindex, 2);
    assert_eq!(dst, Some(Ipv4Addr::new(10, 99, 0, 2).into()));
    assert_eq!(n.lladdr.as_deref(), Some(&[0x52, 0x54, 0, 0x99, 0, 2][..]));
    assert!(n.valid(), "STALE is valid (NUD_VALID)");
    for (state, valid) in [
        (nud::INCOMPLETE, false),
        (nud::FAILED, false),
        (0, false),
        (nud::REACHABLE, true),
        (nud::DELAY, true),
        (nud::PROBE, true),
        (nud::PERMANENT, true),
        (nud::NOARP, true),
    ] {
        let (_, _, n) = parse_neigh(&ndmsg(libc::AF_INET as u8, 2, state)).unwrap();
        assert_eq!(n.valid(), valid, "state {state:#x}");
    }
}

#[test]
fn notifications_tell_when_a_neighbour_became_valid() {
    let incomplete = nlmsg(
        rtm::NEWNEIGH,
        0,
        &ndmsg(libc::AF_INET as u8, 2, nud::INCOMPLETE),
    );
    let failed = nlmsg(
        rtm::NEWNEIGH,
        0,
        &ndmsg(libc::AF_INET as u8, 2, nud::FAILED),
    );
    let reachable = nlmsg(
        rtm::NEWNEIGH,
        0,
        &ndmsg(libc::AF_INET as u8, 2, nud::REACHABLE),
    );
    // RTM_DELNEIGH (29) of a valid entry is no news of a valid one.
    let deleted = nlmsg(29, 0, &ndmsg(libc::AF_INET as u8, 2, nud::REACHABLE));
    assert!(!any_valid(&incomplete));
    assert!(!any_valid(&[failed.clone(), deleted].concat()));
    assert!(any_valid(&[incomplete, failed, reachable].concat()));
}

#[test]
fn bad_answers_are_errors() {
    // A message longer than the datagram, one shorter than its header.
    let mut m = nlmsg(rtm::NEWROUTE, 1, &route_answer());
    m.truncate(m.len() - 4);
    assert!(matches!(messages(&m), Err(NetlinkError::Malformed(_))));
    let mut short = nlmsg(rtm::NEWROUTE, 1, &[]);
    short[0..4].copy_from_slice(&8u32.to_ne_bytes());
    assert!(matches!(messages(&short), Err(NetlinkError::Malformed(_))));
    // An attribute longer than what is left; an rtmsg cut short.
    let mut p = route_answer();
    let n = p.len();
    p[12..14].copy_from_slice(&200u16.to_ne_bytes());
    assert!(parse_route(&p).is_err(), "{n}");
    assert!(parse_route(&[2, 32]).is_err());
    assert!(parse_neigh(&[2, 0, 0]).is_err());
    assert!(parse_link_flags(&[0; 8]).is_err());
    assert!(error_of(&[0, 0]).is_err());
    // A kernel error's errno, and an acknowledgement.
    assert_eq!(
        error_of(&(-libc::ENETUNREACH).to_ne_bytes()).unwrap(),
        libc::ENETUNREACH
    );
    assert_eq!(error_of(&0i32.to_ne_bytes()).unwrap(), 0);
    assert_eq!(
        NetlinkError::Kernel(libc::ENETUNREACH).errno(),
        libc::ENETUNREACH
    );
}

#[test]
fn requests_carry_what_the_kernel_reads() {
    let dst: IpAddr = Ipv4Addr::new(10, 98, 0, 2).into();
    let src: IpAddr = Ipv4Addr::new(10, 99, 0, 11).into();
    let r = neigh::route_request(7, dst, Some(src));
    let ms = messages(&r).unwrap();
    assert_eq!(ms.len(), 1);
    assert_eq!((ms[0].kind, ms[0].seq), (rtm::GETROUTE, 7));
    // struct rtmsg: AF_INET, dst_len 32, src_len 32; then RTA_DST and RTA_SRC.
    assert_eq!(&ms[0].payload[..3], &[libc::AF_INET as u8, 32, 32]);
    let back = parse_route(ms[0].payload).unwrap();
    assert_eq!(back.src, Some(src), "RTA_SRC read back as the source");
    // A wildcard source is no source.
    let r = neigh::route_request(8, dst, Some(Ipv4Addr::UNSPECIFIED.into()));
    assert_eq!(messages(&r).unwrap()[0].payload[2], 0);
    // NTF_USE with NLM_F_CREATE: the kernel creates the entry and solicits it.
    let s = neigh::solicit_request(9, 2, dst);
    let flags = u16::from_ne_bytes([s[6], s[7]]);
    assert_eq!(flags & 0x405, 0x405, "REQUEST | ACK | CREATE");
    let (ifindex, addr, n) = parse_neigh(messages(&s).unwrap()[0].payload).unwrap();
    assert_eq!((ifindex, addr, n.state), (2, Some(dst), 0));
    assert_eq!(messages(&s).unwrap()[0].payload[10], 0x01, "NTF_USE");
}

/// This machine's kernel: the loopback route and interface, and the resolution of a
/// local destination (no neighbour, resolved at once, the route's source).
#[test]
fn the_kernel_answers_for_the_loopback() {
    let mut nl = Netlink::new();
    let lo: IpAddr = Ipv4Addr::LOCALHOST.into();
    let r = nl.route(lo, None).unwrap();
    assert_eq!(r.kind, 2, "RTN_LOCAL");
    assert_eq!(r.gateway, None);
    assert_eq!(r.src, Some(lo));
    let flags = nl.link_flags(r.ifindex).unwrap();
    assert_ne!(flags & libc::IFF_LOOPBACK as u32, 0);
    assert!(
        nl.fd().is_some(),
        "the neighbour socket is open from the first lookup"
    );
    assert_eq!(
        neigh::resolve(&mut nl, None, lo),
        Attempt::Resolved { src: lo }
    );
    // An interface that does not exist.
    assert!(nl.link_flags(0x7FFF_FFF0).is_err());
}

fn ip(args: &[&str]) {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "ip {args:?}: {out:?}");
}

/// Runs `f` on a thread of its own in a fresh network namespace (where `ip` commands it
/// starts run too); `None`, after printing SKIP, where there can be none (not root, no
/// `ip`).
fn in_netns<T: Send>(what: &str, f: impl FnOnce() -> T + Send) -> Option<T> {
    // SAFETY: geteuid(2) cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP {what}: not root (needs a network namespace)");
        return None;
    }
    if std::process::Command::new("ip").arg("-V").output().is_err() {
        eprintln!("SKIP {what}: no `ip` command (iproute2)");
        return None;
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare(2) moves only this thread into a new namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                eprintln!("SKIP {what}: unshare: {}", std::io::Error::last_os_error());
                return None;
            }
            ip(&["link", "set", "lo", "up"]);
            Some(f())
        })
        .join()
        .unwrap()
    })
}

/// The kernel for real, in a namespace with a veth pair (v0 10.77.0.1/24, its peer v1):
/// an address nobody has is solicited and waits (the entry not valid); once v1 takes
/// the address, ARP's next probe is answered, the entry becomes valid with the peer's
/// MAC and the neighbour socket tells of it; a destination with no route fails with
/// ENETUNREACH; behind a gateway, the gateway is the neighbour solicited.
#[test]
fn the_kernel_solicits_and_tells_when_the_neighbour_is_valid() {
    in_netns("neighbour solicitation", || {
        ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
        ip(&["addr", "add", "10.77.0.1/24", "dev", "v0"]);
        ip(&["link", "set", "v0", "up"]);
        ip(&["link", "set", "v1", "up"]);
        // Both ends are in this namespace: v1 answers an ARP request from a local
        // source only with accept_local.
        let conf = "/proc/sys/net/ipv4/conf/v1/accept_local";
        std::fs::write(conf, "1").unwrap();
        let mut nl = Netlink::new();
        let dst: IpAddr = Ipv4Addr::new(10, 77, 0, 2).into();
        let src: IpAddr = Ipv4Addr::new(10, 77, 0, 1).into();
        assert_eq!(
            neigh::resolve(&mut nl, None, Ipv4Addr::new(10, 78, 0, 1).into()),
            Attempt::Failed(libc::ENETUNREACH)
        );
        let r = nl.route(dst, None).unwrap();
        assert_eq!((r.kind, r.gateway, r.src), (1, None, Some(src)));
        assert_eq!(neigh::resolve(&mut nl, None, dst), Attempt::Waiting);
        let n = nl
            .neighbour(r.ifindex, dst)
            .unwrap()
            .expect("the entry solicited");
        assert!(!n.valid(), "state {:#x}", n.state);
        // v1 takes the address: ARP is answered (v0 probes again each second).
        ip(&["addr", "add", "10.77.0.2/24", "dev", "v1"]);
        let fd = nl.fd().unwrap();
        let mut valid = false;
        for _ in 0..50 {
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd that outlives the call.
            unsafe { libc::poll(&mut p, 1, 100) };
            if nl.changed() {
                valid = true;
                break;
            }
        }
        assert!(valid, "a notification of the valid neighbour");
        let n = nl.neighbour(r.ifindex, dst).unwrap().unwrap();
        assert!(n.valid(), "state {:#x}", n.state);
        assert_eq!(n.lladdr.map(|l| l.len()), Some(6));
        // A gateway route: the gateway (10.77.0.3, nobody) is the neighbour solicited,
        // not the destination.
        ip(&["route", "add", "10.79.0.0/24", "via", "10.77.0.3"]);
        let far: IpAddr = Ipv4Addr::new(10, 79, 0, 5).into();
        let gw: IpAddr = Ipv4Addr::new(10, 77, 0, 3).into();
        let r = nl.route(far, Some(src)).unwrap();
        assert_eq!((r.gateway, r.src), (Some(gw), Some(src)));
        assert_eq!(neigh::resolve(&mut nl, Some(src), far), Attempt::Waiting);
        assert!(
            nl.neighbour(r.ifindex, gw)
                .unwrap()
                .is_some_and(|n| !n.valid())
        );
        assert_eq!(nl.neighbour(r.ifindex, far).unwrap(), None);
    });
}

//! Listeners of one port on several addresses of the VM, as the kernel's rdma_cm keeps
//! them: they share the CM agent's listener of the port's service ID, a REQ (or
//! SIDR_REQ) goes to the listener bound to its rdma_cm header's destination, else to a
//! wildcard one of its family, and none matching is rejected as the kernel's CM rejects
//! it (REJ(CONSUMER_DEFINED)); each listener keeps its own file, uid and backlog; the
//! agent listener stays while one of them listens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::IpAddr;

use pvcm_guest::service::abi::{self, cmd, event, opt, ps, u32_at, u64_at};
use pvcm_guest::service::caller::CallerMemory;
use pvcm_guest::service::cma::{Env, Fh, Outcome, errno};
use service_support::*;

/// `IB_CM_REJ_CONSUMER_DEFINED`: the kernel CM's REJ when no rdma_cm listener matches.
const REJ_CONSUMER_DEFINED: u32 = 28;
/// `IB_CM_REJ_INVALID_SERVICE_ID`: no listener of the service ID at all.
const REJ_INVALID_SERVICE_ID: u32 = 8;

/// A dual-stack client VM 11 (answering for fd99::12) and server VM 12.
fn pair() -> (Vm, Vm) {
    let (c, s) = (Vm::dual(11), Vm::dual(12));
    c.net.answer("fd99::12");
    (c, s)
}

fn set_int_option(vm: &mut Vm, fh: Fh, id: u32, name: u32, v: u32) {
    const OPT: u64 = 0x20_0000;
    vm.mem.write(OPT, &v.to_ne_bytes()).unwrap();
    let mut b = [0u8; 24];
    b[0..8].copy_from_slice(&OPT.to_ne_bytes());
    b[8..12].copy_from_slice(&id.to_ne_bytes());
    b[12..16].copy_from_slice(&opt::LEVEL_ID.to_ne_bytes());
    b[16..20].copy_from_slice(&name.to_ne_bytes());
    b[20..24].copy_from_slice(&4u32.to_ne_bytes());
    assert_eq!(vm.write(fh, cmd::SET_OPTION, &b, 0), Outcome::Done(Ok(())));
}

/// An id of `space` with uid `uid` in `fh`, bound to `addr` (AFONLY first when
/// `afonly`), listening with `backlog`.
fn listener(
    s: &mut Vm,
    fh: Fh,
    uid: u64,
    space: u16,
    addr: &str,
    afonly: bool,
    backlog: u32,
) -> u32 {
    let id = s.create_id(fh, uid, space);
    if afonly {
        set_int_option(s, fh, id, opt::ID_AFONLY, 1);
    }
    assert_eq!(
        s.bind_ip(fh, id, addr),
        Outcome::Done(Ok(())),
        "bind {addr}"
    );
    assert_eq!(
        s.id_arg(fh, cmd::LISTEN, id, backlog),
        Outcome::Done(Ok(())),
        "listen {addr}"
    );
    id
}

/// The CONNECT_REQUEST `fh` has next: (listener's uid, new id).
fn request(s: &mut Vm, fh: Fh) -> (u64, u32) {
    let e = s.expect_event(fh, event::CONNECT_REQUEST);
    (u64_at(&e, 0), u32_at(&e, 8))
}

/// The local address of the server's id `id`.
fn local_ip(s: &mut Vm, fh: Fh, id: u32) -> IpAddr {
    let r = s.query_route(fh, id);
    abi::parse_sockaddr(&r[136..164]).unwrap().ip()
}

/// The REJECTED the client's file has next: its reason.
fn rejected(c: &mut Vm, cf: Fh) -> u32 {
    u32_at(&c.expect_event(cf, event::REJECTED), 16)
}

#[test]
fn two_listeners_on_one_port_each_get_the_requests_for_their_address() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    listener(&mut s, f4, 0x4, ps::TCP, "10.99.0.12:7000", false, 4);
    listener(&mut s, f6, 0x6, ps::TCP, "[fd99::12]:7000", false, 4);
    assert_eq!(
        s.agent.listener_count(),
        1,
        "one agent listener for the port"
    );
    assert_eq!(s.cma.listening(), 2, "two rdma_cm listeners");
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x100);
    assert_eq!(s.get_event(f6), None, "not the IPv6 listener's");
    let (uid, child) = request(&mut s, f4);
    assert_eq!(uid, 0x4);
    assert_eq!(
        local_ip(&mut s, f4, child),
        "10.99.0.12".parse::<IpAddr>().unwrap()
    );
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x101);
    assert_eq!(s.get_event(f4), None, "not the IPv4 listener's");
    let (uid, child) = request(&mut s, f6);
    assert_eq!(uid, 0x6);
    assert_eq!(local_ip(&mut s, f6, child), IpAddr::from(v6_of(12)));
    assert_eq!(c.get_event(cf), None, "neither request was rejected");
}

#[test]
fn each_listener_keeps_its_own_backlog() {
    let (mut c, mut s) = pair();
    let (cf, sf) = (c.cma.open(), s.cma.open());
    listener(&mut s, sf, 0x4, ps::TCP, "10.99.0.12:7000", false, 1);
    listener(&mut s, sf, 0x6, ps::TCP, "[fd99::12]:7000", false, 1);
    // The IPv4 listener's one unreported request fills its backlog only.
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x100);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x101);
    assert_eq!(rejected(&mut c, cf), REJ_CONSUMER_DEFINED);
    assert_eq!(s.cma.stats().backlog_full, 1);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x102);
    assert_eq!(
        c.get_event(cf),
        None,
        "the IPv6 listener's backlog is its own"
    );
    assert_eq!(request(&mut s, sf).0, 0x4);
    assert_eq!(request(&mut s, sf).0, 0x6);
    assert_eq!(s.cma.stats().backlog_full, 1);
}

#[test]
fn sidr_requests_go_to_the_listener_of_their_address() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    listener(&mut s, f4, 0x4, ps::UDP, "10.99.0.12:7174", false, 4);
    listener(&mut s, f6, 0x6, ps::UDP, "[fd99::12]:7174", false, 4);
    assert_eq!(s.agent.listener_count(), 1);
    dial(&mut c, &mut s, cf, 0x77, ps::UDP, "[fd99::12]:7174", 0x33);
    assert_eq!(s.get_event(f4), None);
    let (uid, child) = request(&mut s, f6);
    assert_eq!(uid, 0x6);
    s.conn(f6, cmd::ACCEPT, child, 0x44, true, 16);
    exchange(&mut c, &mut s);
    let e = c.expect_event(cf, event::ESTABLISHED);
    assert_eq!(u32_at(&e, 20), 0x44, "the IPv6 listener's child answered");
    dial(&mut c, &mut s, cf, 0x77, ps::UDP, "10.99.0.12:7174", 0x34);
    assert_eq!(s.get_event(f6), None);
    assert_eq!(request(&mut s, f4).0, 0x4);
}

#[test]
fn afonly_wildcards_and_addresses_of_the_other_family_share_a_port() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    // The bind rules as before: a wildcard next to an address of the port refuses
    // unless both ids are AFONLY and of two families.
    listener(&mut s, f4, 0x4, ps::TCP, "10.99.0.12:7000", false, 4);
    let wild = s.create_id(f6, 0x6, ps::TCP);
    assert_eq!(
        s.bind_ip(f6, wild, "[::]:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    // Two AFONLY wildcards of the two families, on port 7001.
    listener(&mut s, f4, 0x40, ps::TCP, "0.0.0.0:7001", true, 4);
    listener(&mut s, f6, 0x60, ps::TCP, "[::]:7001", true, 4);
    // An AFONLY IPv4 address and an AFONLY IPv6 wildcard, on port 7002.
    listener(&mut s, f4, 0x41, ps::TCP, "10.99.0.12:7002", true, 4);
    listener(&mut s, f6, 0x61, ps::TCP, "[::]:7002", true, 4);
    assert_eq!(s.agent.listener_count(), 3);
    let mut qpn = 0x200;
    for port in [7001, 7002] {
        dial(
            &mut c,
            &mut s,
            cf,
            0x77,
            ps::TCP,
            &format!("10.99.0.12:{port}"),
            qpn,
        );
        dial(
            &mut c,
            &mut s,
            cf,
            0x77,
            ps::TCP,
            &format!("[fd99::12]:{port}"),
            qpn + 1,
        );
        qpn += 2;
        let (uid4, child4) = request(&mut s, f4);
        let (uid6, child6) = request(&mut s, f6);
        assert_eq!((uid4 & 0xf0, uid6 & 0xf0), (0x40, 0x60), "port {port}");
        assert_eq!(
            local_ip(&mut s, f4, child4),
            "10.99.0.12".parse::<IpAddr>().unwrap()
        );
        assert_eq!(local_ip(&mut s, f6, child6), IpAddr::from(v6_of(12)));
    }
    assert_eq!(c.get_event(cf), None);
}

#[test]
fn a_listener_on_a_reused_address_is_its_only_one() {
    let mut s = Vm::dual(12);
    let sf = s.cma.open();
    let reused = |s: &mut Vm| {
        let id = s.create_id(sf, 1, ps::TCP);
        set_int_option(s, sf, id, opt::ID_REUSEADDR, 1);
        id
    };
    let (a, b) = (reused(&mut s), reused(&mut s));
    assert_eq!(s.bind_ip(sf, a, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    assert_eq!(s.bind_ip(sf, b, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    // rdma_listen(): the address must be the listener's alone on the port.
    assert_eq!(
        s.id_arg(sf, cmd::LISTEN, a, 4),
        Outcome::Done(Err(errno::EADDRINUSE))
    );
    s.destroy(sf, b);
    assert_eq!(s.id_arg(sf, cmd::LISTEN, a, 4), Outcome::Done(Ok(())));
    // Listening, it is no longer reusable: another reusing id does not bind next to it.
    let c = reused(&mut s);
    assert_eq!(
        s.bind_ip(sf, c, "10.99.0.12:7000"),
        Outcome::Done(Err(errno::EADDRINUSE))
    );
    assert_eq!(s.bind_ip(sf, c, "[fd99::12]:7000"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, c, 4), Outcome::Done(Ok(())));
}

#[test]
fn the_agent_listener_lasts_as_long_as_one_of_the_listeners() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    let l4 = listener(&mut s, f4, 0x4, ps::TCP, "10.99.0.12:7000", false, 4);
    let l6 = listener(&mut s, f6, 0x6, ps::TCP, "[fd99::12]:7000", false, 4);
    // The first destroyed: the second still gets its requests; one for the first's
    // address matches no listener and is rejected as the kernel's CM rejects it.
    s.destroy(f4, l4);
    assert_eq!(s.cma.listening(), 1);
    assert_eq!(s.agent.listener_count(), 1);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x100);
    assert_eq!(request(&mut s, f6).0, 0x6);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x101);
    assert_eq!(rejected(&mut c, cf), REJ_CONSUMER_DEFINED);
    assert_eq!(s.get_event(f4), None);
    // The last destroyed: the agent listener is gone, and the CM finds no service.
    s.destroy(f6, l6);
    assert_eq!(s.cma.listening(), 0);
    assert_eq!(s.agent.listener_count(), 0);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x102);
    assert_eq!(rejected(&mut c, cf), REJ_INVALID_SERVICE_ID);
    // The port is free again for one listener on the wildcard.
    listener(&mut s, f4, 0x9, ps::TCP, "0.0.0.0:7000", false, 4);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x103);
    assert_eq!(request(&mut s, f4).0, 0x9);
}

#[test]
fn releasing_a_listeners_file_keeps_the_other_files_listener() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    listener(&mut s, f4, 0x4, ps::TCP, "10.99.0.12:7000", false, 4);
    listener(&mut s, f6, 0x6, ps::TCP, "[fd99::12]:7000", false, 4);
    let mut env = Env {
        agent: &mut s.agent,
        now: s.now,
    };
    s.cma.release(f6, &mut env);
    assert_eq!(s.agent.listener_count(), 1);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x100);
    assert_eq!(request(&mut s, f4).0, 0x4);
    let mut env = Env {
        agent: &mut s.agent,
        now: s.now,
    };
    s.cma.release(f4, &mut env);
    assert_eq!(s.agent.listener_count(), 0);
}

#[test]
fn a_device_reset_listens_again_once_for_the_shared_port() {
    let (mut c, mut s) = pair();
    let (cf, f4, f6) = (c.cma.open(), s.cma.open(), s.cma.open());
    listener(&mut s, f4, 0x4, ps::TCP, "10.99.0.12:7000", false, 4);
    listener(&mut s, f6, 0x6, ps::TCP, "[fd99::12]:7000", false, 4);
    // The agent starts afresh, as after the pvcm device's reset.
    s.agent = Vm::dual(12).agent;
    let mut env = Env {
        agent: &mut s.agent,
        now: s.now,
    };
    s.cma.device_reset(&mut env);
    assert_eq!(s.agent.listener_count(), 1);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "10.99.0.12:7000", 0x100);
    dial(&mut c, &mut s, cf, 0x77, ps::TCP, "[fd99::12]:7000", 0x101);
    assert_eq!(request(&mut s, f4).0, 0x4);
    assert_eq!(request(&mut s, f6).0, 0x6);
}

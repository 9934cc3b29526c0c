//! A VM with two served addresses (dual stack: 10.99.0.N, its primary GID, and
//! fd99::N, a further GID the backend serves): either binds, listens, resolves and
//! connects, the REQ and the QP attributes carry the GID of the address the id is
//! bound to, a request to the second address reaches a listener bound to it or to the
//! wildcard and no other, and an address the backend does not serve still refuses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::IpAddr;

use pvcm_guest::service::abi::{self, cmd, event, ps, u32_at};
use pvcm_guest::service::cma::{Outcome, errno};
use pvcm_wire::Gid;
use service_support::*;

fn gid6(n: u8) -> Gid {
    Gid(v6_of(n).octets())
}

/// A connection from `c`'s id to `dst` (resolved without a source), up to the
/// server's CONNECT_REQUEST: (client file, id; server file, child id).
fn connect_to(c: &mut Vm, s: &mut Vm, listen_on: &str, dst: &str) -> (u64, u32, u64, u32) {
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, listen_on), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    // The QPN after the destination's port: one connection per QP.
    let qpn = u32::from(dst.parse::<std::net::SocketAddr>().unwrap().port());
    let id = dial(c, s, cf, 5, ps::TCP, dst, qpn);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    (cf, id, sf, u32_at(&e, 8))
}

#[test]
fn the_second_address_resolves_connects_and_takes_its_own_gid() {
    let (mut c, mut s) = (Vm::dual(11), Vm::dual(12));
    c.net.answer("fd99::12");
    let (cf, id, sf, child) = connect_to(&mut c, &mut s, "[::]:7471", "[fd99::12]:7471");
    // The client's route: from its IPv6 address (the route's source), its GID's index.
    let r = c.query_route(cf, id);
    let src = abi::parse_sockaddr(&r[136..164]).unwrap();
    assert_eq!(src.ip(), IpAddr::from(v6_of(11)));
    assert_eq!(&r[8..24], &gid6(12).0, "dgid");
    assert_eq!(&r[24..40], &gid6(11).0, "sgid: the bound address's GID");
    // The REQ went out with the IPv6 GID as its primary local GID: the server's child
    // sees it as the peer, and is bound to the server's IPv6 address.
    let r = s.query_route(sf, child);
    let dst = abi::parse_sockaddr(&r[164..192]).unwrap();
    let local = abi::parse_sockaddr(&r[136..164]).unwrap();
    assert_eq!(dst.ip(), IpAddr::from(v6_of(11)));
    assert_eq!(local.ip(), IpAddr::from(v6_of(12)));
    let srtr = s.init_qp_attr(sf, child, 2);
    assert_eq!(srtr.ah_attr.sgid_index, 2);
    assert_eq!(srtr.ah_attr.dgid, gid6(11).0);
    // Accepted and established over the second address.
    s.init_qp_attr(sf, child, 3);
    s.conn(sf, cmd::ACCEPT, child, 0x22, true, 16);
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::CONNECT_RESPONSE);
    let rtr = c.init_qp_attr(cf, id, 2);
    assert_eq!(rtr.ah_attr.sgid_index, 2, "the second GID's table index");
    assert_eq!(rtr.ah_attr.dgid, gid6(12).0);
    c.conn(cf, cmd::ACCEPT, id, 0, false, 16);
    exchange(&mut c, &mut s);
    s.expect_event(sf, event::ESTABLISHED);
    // The primary address still works as before, from the same VMs.
    let (cf, id, sf, child) = connect_to(&mut c, &mut s, "0.0.0.0:7472", "10.99.0.12:7472");
    let r = c.query_route(cf, id);
    assert_eq!(&r[24..40], &Gid::from_ipv4([10, 99, 0, 11].into()).0);
    s.init_qp_attr(sf, child, 1);
    assert_eq!(s.init_qp_attr(sf, child, 2).ah_attr.sgid_index, 1);
}

#[test]
fn a_bind_to_the_second_address_takes_it_and_an_unserved_one_refuses() {
    let mut s = Vm::dual(12);
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, id, "[fd99::12]:7000"), Outcome::Done(Ok(())));
    let r = s.query_route(sf, id);
    assert_ne!(u32_at(&r, 0), 0, "bound to the device");
    // An address of the VM the backend does not serve: EADDRNOTAVAIL, counted.
    let mut v = pvcm_guest::service::verbs::PortView {
        port: Some(s.cma.port().clone()),
        devices: ["rxe0".to_string()].into(),
        ..Default::default()
    };
    v.other_addrs.insert("fd99::1:12".parse().unwrap());
    let mut env = pvcm_guest::service::cma::Env {
        agent: &mut s.agent,
        now: s.now,
    };
    s.cma.update_port(&v, &mut env);
    let other = s.create_id(sf, 2, ps::TCP);
    assert_eq!(
        s.bind_ip(sf, other, "[fd99::1:12]:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    assert_eq!(s.cma.stats().other_addr_binds, 1);
    // On a one-address VM the second address is not served.
    let mut one = Vm::new(12);
    let f = one.cma.open();
    let id = one.create_id(f, 1, ps::TCP);
    assert_eq!(
        one.bind_ip(f, id, "[fd99::12]:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
}

#[test]
fn a_request_to_the_second_address_reaches_a_listener_bound_to_it_only() {
    // Bound to the second address: the request for it arrives.
    let (mut c, mut s) = (Vm::dual(11), Vm::dual(12));
    c.net.answer("fd99::12");
    connect_to(&mut c, &mut s, "[fd99::12]:7471", "[fd99::12]:7471");
    // Bound to the primary address: a request for the second is not its; the client
    // is rejected.
    let (mut c, mut s) = (Vm::dual(11), Vm::dual(12));
    c.net.answer("fd99::12");
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "10.99.0.12:7471"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, id, "[fd99::12]:7471");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, id, 0x100, true, 8);
    exchange(&mut c, &mut s);
    assert_eq!(s.get_event(sf), None, "no request for the listener");
    c.expect_event(cf, event::REJECTED);
}

#[test]
fn a_vm_without_the_second_gid_rejects_a_request_for_it() {
    // The server serves one GID: its agent refuses a REQ to fd99::12 (INVALID_GID).
    let (mut c, mut s) = (Vm::dual(11), Vm::new(12));
    c.net.answer("fd99::12");
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7471"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, id, "[fd99::12]:7471");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, id, 0x100, true, 8);
    exchange(&mut c, &mut s);
    assert_eq!(s.get_event(sf), None);
    c.expect_event(cf, event::REJECTED);
}

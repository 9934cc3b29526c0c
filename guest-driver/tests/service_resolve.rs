//! Address resolution in the guest service's rdma_cm layer, as the kernel's
//! `rdma_resolve_ip()`: the route, the neighbour of its next hop, waiting for it
//! without blocking the service, the timeout, the errors, a destroy while waiting.
//! The network is the lab's as a VM sees it ([`LabNet`]); the rtnetlink side is
//! `service_neigh.rs`'s.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::IpAddr;

use pvcm_guest::service::abi::{cmd, event, ps, u32_at};
use pvcm_guest::service::cma::{Outcome, errno};
use service_support::*;

fn status(e: &[u8]) -> i32 {
    u32_at(e, 16) as i32
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn a_valid_neighbour_resolves_at_once_and_nothing_is_solicited() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    c.resolve_ip(f, id, "10.99.0.12:7174");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert!(c.net.state().solicited.is_empty());
    assert_eq!(c.net.state().routes, vec![(ip("10.99.0.12"), None)]);
    assert_eq!(c.cma.resolving(), 0);
}

#[test]
fn a_silent_neighbour_is_solicited_and_times_out_with_etimedout() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    c.resolve_ip(f, id, "10.99.0.99:7174");
    assert_eq!(c.get_event(f), None, "waits for the neighbour");
    assert_eq!(c.net.state().solicited, vec![(2, ip("10.99.0.99"))]);
    assert_eq!(c.cma.resolving(), 1);
    assert_eq!(c.cma.next_addr_deadline(), Some(c.now.after_ms(2000)));
    // The route is not resolved meanwhile.
    assert_eq!(
        c.id_arg(f, cmd::RESOLVE_ROUTE, id, 2000),
        Outcome::Done(Err(errno::EINVAL))
    );
    // Before the deadline nothing happens; at it, ADDR_ERROR with -ETIMEDOUT.
    assert!(c.cma.poll_addr(c.now.after_ms(1999)).is_empty());
    assert_eq!(c.get_event(f), None);
    assert_eq!(c.cma.poll_addr(c.now.after_ms(2000)), vec![f]);
    let e = c.expect_event(f, event::ADDR_ERROR);
    assert_eq!(status(&e), -errno::ETIMEDOUT);
    assert_eq!(c.cma.resolving(), 0);
    assert_eq!(c.cma.next_addr_deadline(), None);
    // Back in its bound state: the program may try again (perftest's and rsockets'
    // retry loops), and this time the neighbour answers.
    c.now = c.now.after_ms(2000);
    c.resolve_ip(f, id, "10.99.0.99:7174");
    assert_eq!(c.get_event(f), None);
    c.net.answer("10.99.0.99");
    assert_eq!(c.cma.poll_addr(c.now.after_ms(10)), vec![f]);
    c.expect_event(f, event::ADDR_RESOLVED);
    assert_eq!(
        c.id_arg(f, cmd::RESOLVE_ROUTE, id, 2000),
        Outcome::Done(Ok(()))
    );
    c.expect_event(f, event::ROUTE_RESOLVED);
}

#[test]
fn the_neighbour_answering_ends_the_wait_of_every_id_waiting() {
    let mut c = Vm::new(11);
    let (f, g) = (c.cma.open(), c.cma.open());
    let a = c.create_id(f, 1, ps::TCP);
    let b = c.create_id(g, 2, ps::UDP);
    c.resolve_ip(f, a, "10.99.0.77:1");
    c.resolve_ip(g, b, "10.99.0.77:2");
    // Nothing changed: still waiting.
    assert!(c.cma.poll_addr(c.now.after_ms(5)).is_empty());
    c.net.answer("10.99.0.77");
    let mut files = c.cma.poll_addr(c.now.after_ms(10));
    files.sort_unstable();
    assert_eq!(files, vec![f, g]);
    c.expect_event(f, event::ADDR_RESOLVED);
    c.expect_event(g, event::ADDR_RESOLVED);
}

#[test]
fn a_timeout_of_zero_fails_at_the_first_poll() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    assert_eq!(
        c.resolve_ip_within(f, id, "10.99.0.98:1", 0),
        Outcome::Done(Ok(()))
    );
    assert_eq!(c.cma.poll_addr(c.now), vec![f]);
    assert_eq!(
        status(&c.expect_event(f, event::ADDR_ERROR)),
        -errno::ETIMEDOUT
    );
}

#[test]
fn destroying_a_waiting_id_ends_its_resolution() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    c.resolve_ip(f, id, "10.99.0.99:7174");
    assert_eq!(c.cma.resolving(), 1);
    assert_eq!(c.destroy(f, id), 0);
    assert_eq!(c.cma.resolving(), 0);
    assert_eq!(c.cma.next_addr_deadline(), None);
    // The neighbour answering later, or the deadline passing, touches nothing; a new
    // id that takes the same number waits on its own.
    c.net.answer("10.99.0.99");
    assert!(c.cma.poll_addr(c.now.after_ms(5000)).is_empty());
    let again = c.create_id(f, 3, ps::TCP);
    assert_eq!(again, id, "the number is reused");
    assert_eq!(c.get_event(f), None);
    // A file released while its id waits.
    let g = c.cma.open();
    let w = c.create_id(g, 4, ps::TCP);
    c.resolve_ip(g, w, "10.99.0.97:1");
    assert_eq!(c.cma.resolving(), 1);
    let mut env = pvcm_guest::service::cma::Env {
        agent: &mut c.agent,
        now: c.now,
    };
    c.cma.release(g, &mut env);
    assert_eq!(c.cma.resolving(), 0);
    assert!(c.cma.poll_addr(c.now.after_ms(5000)).is_empty());
}

#[test]
fn no_route_fails_the_command_with_the_route_lookups_errno() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    assert_eq!(
        c.resolve_ip_within(f, id, "203.0.113.1:1", 2000),
        Outcome::Done(Err(errno::ENETUNREACH))
    );
    assert_eq!(c.get_event(f), None);
    // An `unreachable` route: EHOSTUNREACH; the id stays bound and may try again.
    c.net.state().unreachable.insert(ip("10.99.0.50"));
    assert_eq!(
        c.resolve_ip_within(f, id, "10.99.0.50:1", 2000),
        Outcome::Done(Err(errno::EHOSTUNREACH))
    );
    c.resolve_ip(f, id, "10.99.0.12:1");
    c.expect_event(f, event::ADDR_RESOLVED);
    // Another family than the VM's has no route either.
    let v6 = c.create_id(f, 2, ps::TCP);
    assert_eq!(
        c.resolve_ip_within(f, v6, "[fd99::2]:1", 2000),
        Outcome::Done(Err(errno::ENETUNREACH))
    );
}

#[test]
fn off_link_the_gateway_is_the_neighbour_resolved() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::TCP);
    // The gateway 10.99.0.1 answers: resolved at once, nothing asked of 10.98.0.2.
    c.resolve_ip(f, id, "10.98.0.2:7174");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert!(c.net.state().solicited.is_empty());
    // A gateway that does not answer: it is the one solicited.
    c.net.state().neigh.remove(&(2, ip("10.99.0.1")));
    let other = c.create_id(f, 2, ps::TCP);
    c.resolve_ip(f, other, "10.98.0.3:7174");
    assert_eq!(c.net.state().solicited, vec![(2, ip("10.99.0.1"))]);
    c.net.answer("10.99.0.1");
    assert_eq!(c.cma.poll_addr(c.now), vec![f]);
    c.expect_event(f, event::ADDR_RESOLVED);
}

#[test]
fn own_address_resolves_at_once_and_loopback_has_no_route() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let own = c.create_id(f, 1, ps::TCP);
    c.resolve_ip(f, own, "10.99.0.11:7174");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert!(c.net.state().solicited.is_empty());
    assert_eq!(
        c.id_arg(f, cmd::RESOLVE_ROUTE, own, 2000),
        Outcome::Done(Ok(()))
    );
    c.expect_event(f, event::ROUTE_RESOLVED);
    // 127.0.0.1 from an unbound id, as the kernel guest does it on rxe: the address
    // resolves (a local destination, the route's source 127.0.0.1), the route does
    // not (no RoCE netdev: ENODEV, the command's error).
    let lo = c.create_id(f, 2, ps::TCP);
    c.resolve_ip(f, lo, "127.0.0.1:7174");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert_eq!(
        c.id_arg(f, cmd::RESOLVE_ROUTE, lo, 2000),
        Outcome::Done(Err(errno::ENODEV))
    );
    // Bound to the VM's address, the route lookup carries it as the source.
    let bound = c.create_id(f, 3, ps::TCP);
    assert_eq!(c.bind_ip(f, bound, "10.99.0.11:0"), Outcome::Done(Ok(())));
    c.resolve_ip(f, bound, "10.99.0.12:7174");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert_eq!(
        c.net.state().routes.last(),
        Some(&(ip("10.99.0.12"), Some(ip("10.99.0.11"))))
    );
}

/// Binding to a local address that is not the VM's (127.0.0.1) succeeds, as the
/// kernel's `rdma_bind_addr()` on rxe; a listener there gets no request for the VM's
/// address (the REQ is refused), while one on the wildcard does. An address the VM
/// does not have is EADDRNOTAVAIL.
#[test]
fn a_loopback_listener_binds_and_gets_no_requests() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let other = s.create_id(sf, 9, ps::TCP);
    assert_eq!(
        s.bind_ip(sf, other, "10.99.0.13:7474"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "127.0.0.1:7474"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, id, "10.99.0.12:7474");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, id, 0x100, true, 8);
    exchange(&mut c, &mut s);
    assert_eq!(
        s.get_event(sf),
        None,
        "no CONNECT_REQUEST for a 127.0.0.1 listener"
    );
    c.expect_event(cf, event::REJECTED);
}

/// A multicast group (mckey resolves it before joining): its neighbour entry is
/// created NOARP by the solicitation, so the resolution does not wait.
#[test]
fn a_multicast_group_resolves_at_once() {
    let mut c = Vm::new(11);
    let f = c.cma.open();
    let id = c.create_id(f, 1, ps::UDP);
    c.resolve_ip(f, id, "239.1.2.3:0");
    c.expect_event(f, event::ADDR_RESOLVED);
    assert_eq!(c.net.state().solicited, vec![(2, ip("239.1.2.3"))]);
    assert_eq!(c.cma.resolving(), 0);
}

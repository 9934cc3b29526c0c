//! The guest service follows the VM's RDMA device while it runs (`Cma::update_port`):
//! a device that goes gives DEVICE_REMOVAL to the ids bound to it, one that comes back
//! serves new ids, an address taken off the netdev stops binds to it, a bond's failover
//! gives ADDR_CHANGE, and another address of the VM is refused with its own count.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "service_support.rs"]
mod service_support;

use std::collections::BTreeSet;

use pvcm_guest::service::abi::{cmd, event, ps, u32_at};
use pvcm_guest::service::cma::{Env, Outcome, PortUpdate, errno};
use pvcm_guest::service::verbs::{Link, PortView, RdmaPort};
use service_support::{Vm, exchange, port};

fn view(p: Option<RdmaPort>, devices: &[&str], mac: &str, bond: bool) -> PortView {
    PortView {
        devices: devices.iter().map(|d| d.to_string()).collect(),
        index: None,
        port: p,
        link: Some(Link {
            hw_addr: mac.into(),
            bond,
        }),
        other_addrs: BTreeSet::new(),
    }
}

fn update(vm: &mut Vm, v: &PortView) -> PortUpdate {
    let mut env = Env {
        agent: &mut vm.agent,
        now: vm.now,
    };
    vm.cma.update_port(v, &mut env)
}

const MAC: &str = "52:54:00:99:00:0c";

/// rxe removed under a bound listener, a wildcard listener and an established
/// connection, then added again.
#[test]
fn a_removed_device_gives_device_removal_and_a_new_one_serves() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let here = view(Some(port(12)), &["rxe0"], MAC, false);
    assert_eq!(update(&mut s, &here), PortUpdate::default(), "as at start");
    let sf = s.cma.open();
    let bound = s.create_id(sf, 0xB0, ps::TCP);
    assert_eq!(
        s.bind_ip(sf, bound, "10.99.0.12:7000"),
        Outcome::Done(Ok(()))
    );
    assert_eq!(s.id_arg(sf, cmd::LISTEN, bound, 4), Outcome::Done(Ok(())));
    let any = s.create_id(sf, 0xA0, ps::TCP);
    assert_eq!(s.bind_ip(sf, any, "0.0.0.0:7001"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, any, 4), Outcome::Done(Ok(())));
    let idle = s.create_id(sf, 0xC0, ps::TCP);

    // A connection to the bound listener, established.
    let cf = c.cma.open();
    let cid = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, cid, "10.99.0.12:7000");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, cid, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, cid, 0x100, true, 8);
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    let child = u32_at(&e, 8);
    s.conn(sf, cmd::ACCEPT, child, 0x200, true, 8);
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::CONNECT_RESPONSE);
    c.conn(cf, cmd::ACCEPT, cid, 0, false, 8);
    exchange(&mut c, &mut s);
    s.expect_event(sf, event::ESTABLISHED);

    // rxe0 leaves the registered devices (sysfs may still show it).
    let gone = view(None, &[], MAC, false);
    let u = update(&mut s, &gone);
    assert!(u.removed && !u.arrived);
    assert_eq!(u.removed_ids, 2, "the bound listener and the connection");
    assert_eq!(u.files, vec![sf]);
    let e = s.expect_event(sf, event::DEVICE_REMOVAL);
    assert_eq!((u32_at(&e, 8), u32_at(&e, 16)), (bound, 0));
    let e = s.expect_event(sf, event::DEVICE_REMOVAL);
    assert_eq!(u32_at(&e, 8), child);
    assert_eq!(s.get_event(sf), None, "none for the wildcard or idle ids");
    assert!(!s.cma.attached());
    assert_eq!(s.cma.stats().device_removals, 1);
    // The closed connection's DREQ reaches the peer.
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::DISCONNECTED);

    // Closed ids: ENXIO to all but DESTROY_ID, which answers their events.
    assert_eq!(
        s.id_arg(sf, cmd::LISTEN, bound, 4),
        Outcome::Done(Err(errno::ENXIO))
    );
    assert_eq!(
        s.resp_id_arg(sf, cmd::QUERY_ROUTE, child, 0, 208),
        Outcome::Done(Err(errno::ENXIO))
    );
    assert_eq!(
        s.destroy(sf, bound),
        2,
        "CONNECT_REQUEST and DEVICE_REMOVAL"
    );
    // No device: a bind to the VM's address is ENODEV; a wildcard still binds.
    assert_eq!(
        s.bind_ip(sf, idle, "10.99.0.12:7002"),
        Outcome::Done(Err(errno::ENODEV))
    );
    // An unbound id's resolution finds no device for the VM's address: ADDR_ERROR,
    // ENODEV, as `addr_handler()` reports `cma_acquire_dev_by_src_ip()` failing.
    let lone = s.create_id(sf, 0xD0, ps::TCP);
    s.resolve_ip(sf, lone, "10.99.0.11:7000");
    let e = s.expect_event(sf, event::ADDR_ERROR);
    assert_eq!(u32_at(&e, 16) as i32, -errno::ENODEV);
    // A request for the wildcard listener is refused: nothing carries it.
    let cid2 = c.create_id(cf, 6, ps::TCP);
    c.resolve_ip(cf, cid2, "10.99.0.12:7001");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, cid2, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, cid2, 0x101, true, 8);
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::REJECTED);
    assert_eq!(s.get_event(sf), None);

    // rxe0 added again (a new node GUID, another GID index, a larger MTU): new ids use
    // it, and the wildcard listener hears requests again.
    let mut again = port(12);
    again.node_guid ^= 0x100;
    again.gid_index = 3;
    again.path_mtu = 5;
    let u = update(&mut s, &view(Some(again.clone()), &["rxe0"], MAC, false));
    assert!(u.arrived && !u.removed);
    assert!(s.cma.attached());
    assert_eq!(s.cma.port().gid_index, 3);
    assert_eq!(
        s.bind_ip(sf, idle, "10.99.0.12:7002"),
        Outcome::Done(Ok(()))
    );
    let r = s.query_route(sf, idle);
    assert_eq!(
        u64::from_le_bytes(r[0..8].try_into().unwrap()).to_le_bytes(),
        again.node_guid.to_be_bytes(),
        "the new device's GUID"
    );
    let cid3 = c.create_id(cf, 7, ps::TCP);
    c.resolve_ip(cf, cid3, "10.99.0.12:7001");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, cid3, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, cid3, 0x102, true, 8);
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    let child3 = u32_at(&e, 8);
    s.init_qp_attr(sf, child3, 1);
    let rtr = s.init_qp_attr(sf, child3, 2);
    assert_eq!(rtr.ah_attr.sgid_index, 3, "the new GID index");
    assert_eq!(s.cma.stats().device_arrivals, 1);
}

/// Another device taking the GID is the old one's removal and the new one's arrival.
#[test]
fn another_device_with_the_gid_replaces_the_old_one() {
    let mut s = Vm::new(12);
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::UDP);
    assert_eq!(s.bind_ip(sf, id, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    let mut vf = port(12);
    vf.device = "mlx5_0".into();
    let u = update(&mut s, &view(Some(vf), &["rxe0", "mlx5_0"], MAC, false));
    assert!(u.removed && u.arrived);
    s.expect_event(sf, event::DEVICE_REMOVAL);
    assert_eq!(s.cma.port().device, "mlx5_0");
}

/// A port on another netdev takes the multicast memberships there: a join's IGMP
/// membership is taken on the new netdev (one that does not exist here: ENODEV, as
/// `cma_igmp_send()` without the device).
#[test]
fn memberships_follow_the_ports_netdev() {
    // At start on the loopback netdev, where a membership would be taken.
    let mut s = Vm::with_netdev(12, "lo");
    let mut vf = port(12);
    vf.netdev = "pvcm-no-such-netdev".into();
    update(&mut s, &view(Some(vf), &["rxe0"], MAC, false));
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::UDP);
    assert_eq!(s.bind_ip(sf, id, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    let mut b = [0u8; 48];
    pvcm_guest::service::abi::put_u64(&mut b, 0, service_support::RESP);
    pvcm_guest::service::abi::put_u64(&mut b, 8, 0x55);
    pvcm_guest::service::abi::emit_sockaddr(&"239.1.2.3:0".parse().unwrap(), &mut b[16..44]);
    pvcm_guest::service::abi::put_u32(&mut b, 44, id);
    assert_eq!(
        s.write(sf, cmd::JOIN_IP_MCAST, &b[..48], 4),
        Outcome::Done(Err(errno::ENODEV))
    );
}

/// The same device deleted and added again between two looks (another kernel index,
/// the same name and GUID) is a removal and an arrival.
#[test]
fn a_device_registered_again_is_a_removal() {
    let mut s = Vm::new(12);
    let mut v = view(Some(port(12)), &["rxe0"], MAC, false);
    v.index = Some(3);
    assert_eq!(update(&mut s, &v), PortUpdate::default());
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, id, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    assert_eq!(update(&mut s, &v), PortUpdate::default(), "the same index");
    v.index = Some(4);
    let u = update(&mut s, &v);
    assert!(u.removed && u.arrived);
    s.expect_event(sf, event::DEVICE_REMOVAL);
}

/// `ip addr del` and `add` of the VM's address: no event to a bound listener (the
/// kernel sends none either), binds fail while it is gone and work when it is back.
#[test]
fn an_address_taken_off_and_back_stops_binds_only() {
    let mut s = Vm::new(12);
    let sf = s.cma.open();
    let l = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, l, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, l, 4), Outcome::Done(Ok(())));
    let u = update(&mut s, &view(None, &["rxe0"], MAC, false));
    assert!(u.addr_gone && !u.removed && u.files.is_empty());
    assert_eq!(s.get_event(sf), None);
    let other = s.create_id(sf, 2, ps::TCP);
    assert_eq!(
        s.bind_ip(sf, other, "10.99.0.12:7001"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    let mut back = port(12);
    back.gid_index = 2;
    let u = update(&mut s, &view(Some(back), &["rxe0"], MAC, false));
    assert!(u.addr_back && u.changed && !u.arrived);
    assert_eq!(
        s.bind_ip(sf, other, "10.99.0.12:7001"),
        Outcome::Done(Ok(()))
    );
    assert_eq!(s.get_event(sf), None, "still no event");
    assert_eq!(s.cma.port().gid_index, 2);
}

/// A bond's failover (its hardware address changes) gives ADDR_CHANGE to the ids bound
/// to the device, as `cma_netdev_callback`; another netdev's address change does not.
#[test]
fn a_bond_failover_gives_addr_change() {
    let mut s = Vm::new(12);
    let sf = s.cma.open();
    let l = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, l, "10.99.0.12:7000"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, l, 4), Outcome::Done(Ok(())));
    let any = s.create_id(sf, 2, ps::TCP);
    assert_eq!(s.bind_ip(sf, any, "0.0.0.0:7001"), Outcome::Done(Ok(())));
    update(&mut s, &view(Some(port(12)), &["rxe0"], MAC, false));
    // Not a bond: a new hardware address is not an rdma_cm event.
    let u = update(
        &mut s,
        &view(Some(port(12)), &["rxe0"], "52:54:00:99:00:0d", false),
    );
    assert_eq!(u.addr_change_ids, 0);
    assert_eq!(s.get_event(sf), None);
    // It becomes a bond with the address it has: nothing either.
    let u = update(
        &mut s,
        &view(Some(port(12)), &["rxe0"], "52:54:00:99:00:0d", true),
    );
    assert_eq!(u.addr_change_ids, 0);
    let u = update(
        &mut s,
        &view(Some(port(12)), &["rxe0"], "52:54:00:99:00:0e", true),
    );
    assert_eq!((u.addr_change_ids, u.files.clone()), (1, vec![sf]));
    let e = s.expect_event(sf, event::ADDR_CHANGE);
    assert_eq!(u32_at(&e, 8), l);
    assert_eq!(s.get_event(sf), None, "not the wildcard id");
    // The listener goes on.
    assert_eq!(s.cma.stats().device_removals, 0);
}

/// A bind to another of the VM's addresses (a second NIC, a VLAN, dual stack) is
/// EADDRNOTAVAIL, counted apart from a bind to an address the VM does not have.
#[test]
fn another_address_of_the_vm_is_refused_and_counted() {
    let mut s = Vm::new(12);
    let mut v = view(Some(port(12)), &["rxe0"], MAC, false);
    v.other_addrs.insert("10.99.1.12".parse().unwrap());
    update(&mut s, &v);
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::TCP);
    assert_eq!(
        s.bind_ip(sf, id, "10.99.1.12:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    assert_eq!(
        s.bind_ip(sf, id, "10.99.2.12:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    assert_eq!(s.cma.stats().other_addr_binds, 1);
}

//! Multicast in the rdma_cm layer of the guest service: JOIN_IP_MCAST, JOIN_MCAST and
//! LEAVE_MCAST as the kernel's `ucma_process_join`/`cma_iboe_join_multicast` and
//! `ucma_leave_multicast` answer them on a RoCE v2 port. The VMs' ports are on the
//! loopback netdev, so the IGMP memberships are real and read back from
//! /proc/net/igmp; each test uses its own groups.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::{Ipv4Addr, SocketAddr};

use pvcm_guest::service::abi::{cmd, emit_sockaddr, event, ps, put_u16, put_u32, put_u64};
use pvcm_guest::service::abi::{u32_at, u64_at};
use pvcm_guest::service::cma::{Env, Fh};
use pvcm_guest::service::cma::{MAX_JOINS_PER_FILE, MCAST_QPN, Outcome, RDMA_UDP_QKEY, errno};
use pvcm_wire::Gid;
use service_support::*;

/// Where join answers go (apart from RESP, which GET_EVENT uses).
const JRESP: u64 = RESP + 0x800;

fn vm() -> Vm {
    Vm::with_netdev(11, "lo")
}

/// Whether the loopback netdev is an IGMP member of `group` (/proc/net/igmp lists each
/// device's groups, the address as a hex u32 in host order).
fn igmp_member(group: Ipv4Addr) -> bool {
    let hexed = format!("{:08X}", u32::from_ne_bytes(group.octets()));
    let t = std::fs::read_to_string("/proc/net/igmp").unwrap();
    let mut dev = "";
    for line in t.lines() {
        if !line.starts_with('\t') {
            dev = line.split_whitespace().nth(1).unwrap_or("");
        } else if dev == "lo" && line.split_whitespace().next() == Some(hexed.as_str()) {
            return true;
        }
    }
    false
}

fn join_ip(v: &mut Vm, fh: Fh, id: u32, uid: u64, group: &str, out: u16) -> Outcome {
    let mut b = [0u8; 48];
    put_u64(&mut b, 0, JRESP);
    put_u64(&mut b, 8, uid);
    emit_sockaddr(&group.parse::<SocketAddr>().unwrap(), &mut b[16..44]);
    put_u32(&mut b, 44, id);
    v.write(fh, cmd::JOIN_IP_MCAST, &b, out)
}

fn join(v: &mut Vm, fh: Fh, id: u32, uid: u64, group: &str, flags: u16) -> Outcome {
    let mut b = [0u8; 152];
    put_u64(&mut b, 0, JRESP);
    put_u64(&mut b, 8, uid);
    put_u32(&mut b, 16, id);
    let n = emit_sockaddr(&group.parse::<SocketAddr>().unwrap(), &mut b[24..]);
    put_u16(&mut b, 20, n as u16);
    put_u16(&mut b, 22, flags);
    v.write(fh, cmd::JOIN_MCAST, &b, 4)
}

fn joined(v: &Vm) -> u32 {
    u32_at(v.mem.get(JRESP, 4).unwrap(), 0)
}

fn leave(v: &mut Vm, fh: Fh, jid: u32, out: u16) -> Result<u32, i32> {
    let mut b = [0u8; 16];
    put_u64(&mut b, 0, JRESP);
    put_u32(&mut b, 8, jid);
    match v.write(fh, cmd::LEAVE_MCAST, &b, out) {
        Outcome::Done(Ok(())) => Ok(joined(v)),
        Outcome::Done(Err(e)) => Err(e),
        o => panic!("leave: {o:?}"),
    }
}

fn destroy(v: &mut Vm, fh: Fh, id: u32) -> u32 {
    let mut b = [0u8; 16];
    put_u64(&mut b, 0, JRESP);
    put_u32(&mut b, 8, id);
    v.ok(fh, cmd::DESTROY_ID, &b, 4);
    joined(v)
}

/// A UDP id bound to the VM's address (it has a device).
fn bound_udp(v: &mut Vm, fh: Fh, uid: u64) -> u32 {
    let id = v.create_id(fh, uid, ps::UDP);
    assert_eq!(v.bind_ip(fh, id, "10.99.0.11:0"), Outcome::Done(Ok(())));
    id
}

#[test]
fn join_ip_mcast_reports_the_group_and_holds_the_igmp_membership() {
    let mut v = vm();
    let f = v.cma.open();
    let id = bound_udp(&mut v, f, 0x1000);
    let g = Ipv4Addr::new(239, 77, 0, 1);
    assert!(!igmp_member(g));
    assert_eq!(
        join_ip(&mut v, f, id, 0x5151, "239.77.0.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let jid = joined(&v);
    assert!(igmp_member(g), "the VM's netdev joined {g}");
    assert_eq!(v.cma.igmp_groups(), vec![g]);

    let e = v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(u64_at(&e, 0), 0x5151, "the join's uid");
    assert_eq!(u32_at(&e, 8), jid, "the join's id");
    assert_eq!(u32_at(&e, 16), 0, "status");
    assert_eq!(u32_at(&e, 20), MCAST_QPN);
    assert_eq!(u32_at(&e, 24), RDMA_UDP_QKEY);
    assert_eq!(
        &e[28..44],
        &Gid::from_ipv4(g).0,
        "DGID: the IPv4-mapped group"
    );
    assert_eq!(u32_at(&e, 44), 0, "flow label");
    assert_eq!(e[48], 1, "sgid_index: the VM's GID's");
    assert_eq!(e[49], 64, "hop limit");
    assert_eq!(e[50], 0, "traffic class");
    assert_eq!(u16::from_le_bytes([e[52], e[53]]), 0, "dlid");
    assert_eq!(e[57], 1, "is_global");
    assert_eq!(e[58], 1, "port_num");
    assert_eq!(e[20 + 32 + 8 + 256], 0, "no private data");

    assert_eq!(leave(&mut v, f, jid, 4), Ok(1), "events_reported");
    assert!(!igmp_member(g), "left with the last join");
    assert_eq!(leave(&mut v, f, jid, 4), Err(errno::ENOENT), "gone");
    assert_eq!(v.cma.joins(), 0);
}

#[test]
fn join_mcast_after_resolving_the_group_as_mckey_does() {
    let mut v = vm();
    let f = v.cma.open();
    let id = v.create_id(f, 0x1000, ps::UDP);
    v.resolve_ip(f, id, "239.77.1.1:0");
    v.expect_event(f, event::ADDR_RESOLVED);
    assert_eq!(
        join(&mut v, f, id, 0x42, "239.77.1.1:0", 0),
        Outcome::Done(Ok(()))
    );
    let jid = joined(&v);
    assert!(igmp_member(Ipv4Addr::new(239, 77, 1, 1)));
    let e = v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(u32_at(&e, 8), jid);
    // Send-only: the event, no membership.
    assert_eq!(
        join(&mut v, f, id, 0x43, "239.77.1.2:0", 1),
        Outcome::Done(Ok(()))
    );
    let so = joined(&v);
    v.expect_event(f, event::MULTICAST_JOIN);
    assert!(!igmp_member(Ipv4Addr::new(239, 77, 1, 2)), "send-only");
    assert_eq!(leave(&mut v, f, so, 4), Ok(1));
    assert_eq!(leave(&mut v, f, jid, 4), Ok(1));
    assert!(!igmp_member(Ipv4Addr::new(239, 77, 1, 1)));
}

#[test]
fn bad_joins_fail_as_the_kernels() {
    let mut v = vm();
    let f = v.cma.open();
    let idle = v.create_id(f, 1, ps::UDP);
    assert_eq!(
        join_ip(&mut v, f, idle, 1, "239.77.2.1:0", 4),
        Outcome::Done(Err(errno::EINVAL)),
        "unbound: no device"
    );
    let wild = v.create_id(f, 1, ps::UDP);
    assert_eq!(v.bind_ip(f, wild, "0.0.0.0:0"), Outcome::Done(Ok(())));
    assert_eq!(
        join_ip(&mut v, f, wild, 1, "239.77.2.1:0", 4),
        Outcome::Done(Err(errno::EINVAL)),
        "bound to the wildcard: no device"
    );
    let tcp = v.create_id(f, 1, ps::TCP);
    assert_eq!(v.bind_ip(f, tcp, "10.99.0.11:0"), Outcome::Done(Ok(())));
    assert_eq!(
        join_ip(&mut v, f, tcp, 1, "239.77.2.1:0", 4),
        Outcome::Done(Err(errno::EINVAL)),
        "not a UD id"
    );
    let id = bound_udp(&mut v, f, 1);
    for (what, o) in [
        ("short answer", join_ip(&mut v, f, id, 1, "239.77.2.1:0", 3)),
        ("zero group", join_ip(&mut v, f, id, 1, "0.0.0.0:0", 4)),
        (
            "IPv6 group on RoCE v2",
            join_ip(&mut v, f, id, 1, "[ff0e::1]:0", 4),
        ),
        ("bad join flags", join(&mut v, f, id, 1, "239.77.2.1:0", 2)),
        ("unknown id", join_ip(&mut v, f, 999, 1, "239.77.2.1:0", 4)),
    ] {
        let want = match what {
            "short answer" => errno::ENOSPC,
            "IPv6 group on RoCE v2" => errno::EOPNOTSUPP,
            "unknown id" => errno::ENOENT,
            _ => errno::EINVAL,
        };
        assert_eq!(o, Outcome::Done(Err(want)), "{what}");
    }
    // A family that is no address: EINVAL; JOIN_MCAST's size must be the family's.
    let mut b = [0u8; 48];
    put_u64(&mut b, 0, JRESP);
    put_u16(&mut b, 16, 99);
    put_u32(&mut b, 44, id);
    assert_eq!(
        v.write(f, cmd::JOIN_IP_MCAST, &b, 4),
        Outcome::Done(Err(errno::EINVAL))
    );
    let mut b = [0u8; 152];
    put_u64(&mut b, 0, JRESP);
    put_u32(&mut b, 16, id);
    put_u16(&mut b, 20, 28);
    emit_sockaddr(&"239.77.2.1:0".parse().unwrap(), &mut b[24..]);
    assert_eq!(
        v.write(f, cmd::JOIN_MCAST, &b, 4),
        Outcome::Done(Err(errno::EINVAL)),
        "addr_size of another family"
    );
    // Another file's id.
    let g = v.cma.open();
    assert_eq!(
        join_ip(&mut v, g, id, 1, "239.77.2.1:0", 4),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(v.cma.joins(), 0);
    assert!(!igmp_member(Ipv4Addr::new(239, 77, 2, 1)));
    assert_eq!(v.get_event(f), None, "no event for a failed join");
}

#[test]
fn a_group_joined_twice_on_one_id_is_two_joins_of_one_membership() {
    // The kernel's rdma_join_multicast keeps each join (no EADDRINUSE); its IGMP
    // membership counts them.
    let mut v = vm();
    let f = v.cma.open();
    let id = bound_udp(&mut v, f, 1);
    let g = Ipv4Addr::new(239, 77, 3, 1);
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.3.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let j1 = joined(&v);
    assert_eq!(
        join_ip(&mut v, f, id, 2, "239.77.3.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let j2 = joined(&v);
    assert_ne!(j1, j2);
    assert_eq!(leave(&mut v, f, j1, 4), Ok(0), "its event not reported");
    assert!(igmp_member(g), "the other join holds it");
    let e = v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(u32_at(&e, 8), j2, "the left join's event was withdrawn");
    assert_eq!(v.get_event(f), None);
    assert_eq!(leave(&mut v, f, j2, 4), Ok(1));
    assert!(!igmp_member(g));
}

#[test]
fn leave_checks_the_caller_and_counts_its_events() {
    let mut v = vm();
    let (f, other) = (v.cma.open(), v.cma.open());
    let id = bound_udp(&mut v, f, 1);
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.4.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let jid = joined(&v);
    assert_eq!(leave(&mut v, f, jid, 3), Err(errno::ENOSPC));
    assert_eq!(leave(&mut v, f, jid + 100, 4), Err(errno::ENOENT));
    assert_eq!(
        leave(&mut v, other, jid, 4),
        Err(errno::EINVAL),
        "another file's (another process's) join"
    );
    assert!(igmp_member(Ipv4Addr::new(239, 77, 4, 1)), "still joined");
    v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(leave(&mut v, f, jid, 4), Ok(1));
}

#[test]
fn destroy_and_release_end_the_joins() {
    let mut v = vm();
    let f = v.cma.open();
    let id = bound_udp(&mut v, f, 1);
    let (g1, g2) = (Ipv4Addr::new(239, 77, 5, 1), Ipv4Addr::new(239, 77, 5, 2));
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.5.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let jid = joined(&v);
    v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(
        destroy(&mut v, f, id),
        1,
        "DESTROY_ID counts the join's event"
    );
    assert!(!igmp_member(g1));
    assert_eq!(leave(&mut v, f, jid, 4), Err(errno::ENOENT));

    let id = bound_udp(&mut v, f, 1);
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.5.2:0", 4),
        Outcome::Done(Ok(()))
    );
    assert!(igmp_member(g2));
    let mut env = Env {
        agent: &mut v.agent,
        now: v.now,
    };
    v.cma.release(f, &mut env);
    assert!(!igmp_member(g2), "the file's release left the group");
    assert_eq!(v.cma.joins(), 0);
    assert_eq!(v.cma.stats().joins, v.cma.stats().leaves);
}

#[test]
fn a_join_whose_answer_cannot_be_written_is_undone() {
    let mut v = vm();
    let f = v.cma.open();
    let id = bound_udp(&mut v, f, 1);
    let mut b = [0u8; 48];
    put_u64(&mut b, 0, 0xdead_0000);
    emit_sockaddr(&"239.77.6.1:0".parse().unwrap(), &mut b[16..44]);
    put_u32(&mut b, 44, id);
    assert_eq!(
        v.write(f, cmd::JOIN_IP_MCAST, &b, 4),
        Outcome::Done(Err(errno::EFAULT))
    );
    assert!(!igmp_member(Ipv4Addr::new(239, 77, 6, 1)));
    assert_eq!(v.cma.joins(), 0);
    assert_eq!(v.get_event(f), None);
}

#[test]
fn a_missing_netdev_is_enodev_and_a_file_has_a_join_limit() {
    let mut v = Vm::with_netdev(11, "pvcm-none0");
    let f = v.cma.open();
    let id = bound_udp(&mut v, f, 1);
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.7.1:0", 4),
        Outcome::Done(Err(errno::ENODEV)),
        "cma_igmp_send without the netdev"
    );
    // Send-only joins take no membership: the limit alone stops them.
    for _ in 0..MAX_JOINS_PER_FILE {
        assert_eq!(
            join(&mut v, f, id, 1, "239.77.7.2:0", 1),
            Outcome::Done(Ok(()))
        );
    }
    assert_eq!(
        join(&mut v, f, id, 1, "239.77.7.2:0", 1),
        Outcome::Done(Err(errno::ENOMEM))
    );
    let g = v.cma.open();
    let other = bound_udp(&mut v, g, 1);
    assert_eq!(
        join(&mut v, g, other, 1, "239.77.7.2:0", 1),
        Outcome::Done(Ok(())),
        "another file's joins are its own"
    );
}

#[test]
fn one_process_ending_its_joins_leaves_anothers_membership() {
    let mut v = vm();
    let (f, hostile) = (v.cma.open(), v.cma.open());
    let g = Ipv4Addr::new(239, 77, 8, 1);
    let id = bound_udp(&mut v, f, 1);
    assert_eq!(
        join_ip(&mut v, f, id, 1, "239.77.8.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let mine = joined(&v);
    let hid = bound_udp(&mut v, hostile, 2);
    for _ in 0..3 {
        assert_eq!(
            join_ip(&mut v, hostile, hid, 2, "239.77.8.1:0", 4),
            Outcome::Done(Ok(()))
        );
        let theirs = joined(&v);
        assert_eq!(leave(&mut v, hostile, theirs, 4), Ok(0));
        assert_eq!(leave(&mut v, hostile, mine, 4), Err(errno::EINVAL));
    }
    assert_eq!(
        join_ip(&mut v, hostile, hid, 2, "239.77.8.1:0", 4),
        Outcome::Done(Ok(()))
    );
    let mut env = Env {
        agent: &mut v.agent,
        now: v.now,
    };
    v.cma.release(hostile, &mut env);
    assert!(
        igmp_member(g),
        "the first process's join still holds the group"
    );
    let e = v.expect_event(f, event::MULTICAST_JOIN);
    assert_eq!(u32_at(&e, 8), mine);
    assert_eq!(leave(&mut v, f, mine, 4), Ok(1));
    assert!(!igmp_member(g));
}

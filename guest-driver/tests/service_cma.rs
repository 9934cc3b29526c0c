//! The rdma_cm layer of the guest service, driven with the command bytes librdmacm
//! writes (rping's and udaddy's sequences, as `librdmacm/cma.c` issues them), two
//! services over two CM agents in one process, MADs handed across in memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod service_support;

use std::net::Ipv4Addr;

use pvcm_guest::service::abi::{
    self, AhAttr, cmd, event, ps, put_u16, put_u32, put_u64, u32_at, u64_at,
};
use pvcm_guest::service::caller::CallerMemory;
use pvcm_guest::service::cma::{Env, Fh, Outcome, errno};
use pvcm_wire::Gid;
use service_support::*;

#[test]
fn rping_flow_both_sides() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());

    // Server: bind to the wildcard, listen; QUERY_ROUTE names no device yet.
    let lid = s.create_id(sf, 0x1000, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7174"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 3), Outcome::Done(Ok(())));
    let r = s.query_route(sf, lid);
    assert_eq!(u64_at(&r, 0), 0, "no device for a wildcard listener");
    assert_eq!(s.get_event(sf), None, "nothing yet: GET_EVENT would block");

    // Client: resolve address and route, each with its event.
    let cid = c.create_id(cf, 0x2000, ps::TCP);
    c.resolve_ip(cf, cid, "10.99.0.12:7174");
    let e = c.expect_event(cf, event::ADDR_RESOLVED);
    assert_eq!(u64_at(&e, 0), 0x2000, "uid");
    let r = c.query_route(cf, cid);
    assert_eq!(
        u64_at(&r, 0).to_le_bytes(),
        c.cma.port().node_guid.to_be_bytes(),
        "node GUID as the kernel gives it"
    );
    assert_eq!(r[196], 1, "port_num");
    assert_eq!(u32_at(&r, 192), 0, "no path before the route");
    assert_eq!(
        c.id_arg(cf, cmd::RESOLVE_ROUTE, cid, 2000),
        Outcome::Done(Ok(()))
    );
    c.expect_event(cf, event::ROUTE_RESOLVED);
    let r = c.query_route(cf, cid);
    assert_eq!(u32_at(&r, 192), 1, "one path");
    assert_eq!(
        &r[8..24],
        &Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, 12)).0,
        "dgid"
    );
    let init = c.init_qp_attr(cf, cid, 1);
    assert_eq!(init.qp_attr_mask, 1 | 8 | 16 | 32, "STATE|ACCESS|PKEY|PORT");
    assert_eq!(init.port_num, 1);
    c.conn(cf, cmd::CONNECT, cid, 0x11, true, 8);
    exchange(&mut c, &mut s);

    // Server: the request, on a new id carrying the listener's uid.
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    assert_eq!(u64_at(&e, 0), 0x1000);
    let child = u32_at(&e, 8);
    assert_ne!(child, lid);
    assert_eq!(u32_at(&e, 20), 0x11, "the client's QPN");
    assert_eq!(&e[28..36], &[0xab; 8], "private data after the cma_hdr");
    assert_eq!(e[20 + 264], 56, "REQ private data size less the header");
    let r = s.query_route(sf, child);
    assert_ne!(u64_at(&r, 0), 0, "the new id has the device");
    let dst = abi::parse_sockaddr(&r[164..192]).unwrap();
    assert_eq!(dst.ip(), "10.99.0.11".parse::<std::net::IpAddr>().unwrap());
    s.init_qp_attr(sf, child, 1);
    let rtr = s.init_qp_attr(sf, child, 2);
    assert_eq!(rtr.dest_qp_num, 0x11);
    assert_eq!(rtr.ah_attr.sgid_index, 1);
    assert!(rtr.ah_attr.is_global);
    let rts = s.init_qp_attr(sf, child, 3);
    s.conn(sf, cmd::ACCEPT, child, 0x22, true, 16);
    exchange(&mut c, &mut s);

    // Client: CONNECT_RESPONSE; its QP attributes; ACCEPT without parameters = RTU.
    let e = c.expect_event(cf, event::CONNECT_RESPONSE);
    assert_eq!(u32_at(&e, 20), 0x22, "the server's QPN");
    let crtr = c.init_qp_attr(cf, cid, 2);
    let crts = c.init_qp_attr(cf, cid, 3);
    assert_eq!(crtr.dest_qp_num, 0x22);
    assert_eq!(
        crtr.rq_psn, rts.sq_psn,
        "client receives what the server sends"
    );
    assert_eq!(
        crts.sq_psn, rtr.rq_psn,
        "client sends what the server receives"
    );
    c.conn(cf, cmd::ACCEPT, cid, 0, false, 16);
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::ESTABLISHED);
    assert_eq!(u64_at(&e, 0), 0x5eed, "the uid ACCEPT gave");

    // Disconnect from the client: both see DISCONNECTED once.
    assert_eq!(c.id_arg(cf, cmd::DISCONNECT, cid, 0), Outcome::Done(Ok(())));
    exchange(&mut c, &mut s);
    s.expect_event(sf, event::DISCONNECTED);
    assert_eq!(
        s.id_arg(sf, cmd::DISCONNECT, child, 0),
        Outcome::Done(Ok(()))
    );
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::DISCONNECTED);
    assert_eq!(c.get_event(cf), None);

    // events_reported: client 3 (addr, route, response... + disconnected = 4).
    assert_eq!(c.destroy(cf, cid), 4);
    assert_eq!(s.destroy(sf, child), 2, "established, disconnected");
    assert_eq!(s.destroy(sf, lid), 1, "the connect request");
    assert_eq!((c.cma.ids(), s.cma.ids()), (0, 0));
}

#[test]
fn errors_as_the_kernel_gives_them() {
    let mut v = Vm::new(11);
    let (f, g) = (v.cma.open(), v.cma.open());
    let id = v.create_id(f, 1, ps::TCP);
    // Another file's id: EINVAL; an unknown one: ENOENT.
    assert_eq!(
        v.id_arg(g, cmd::LISTEN, id, 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(
        v.id_arg(f, cmd::LISTEN, 99, 0),
        Outcome::Done(Err(errno::ENOENT))
    );
    // Not our address; then a good bind, and a second bind of the same port.
    assert_eq!(
        v.bind_ip(f, id, "10.99.0.99:7000"),
        Outcome::Done(Err(errno::EADDRNOTAVAIL))
    );
    assert_eq!(v.bind_ip(f, id, "10.99.0.11:7000"), Outcome::Done(Ok(())));
    let id2 = v.create_id(f, 2, ps::TCP);
    assert_eq!(
        v.bind_ip(f, id2, "10.99.0.11:7000"),
        Outcome::Done(Err(errno::EADDRINUSE))
    );
    // Route before address: EINVAL; connect without a route: EINVAL.
    assert_eq!(
        v.id_arg(f, cmd::RESOLVE_ROUTE, id, 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    // Small response buffers.
    assert_eq!(
        v.resp_id_arg(f, cmd::QUERY_ROUTE, id, 0, 100),
        Outcome::Done(Err(errno::ENOSPC))
    );
    assert_eq!(
        v.resp_id_arg(f, cmd::INIT_QP_ATTR, id, 9, 144),
        Outcome::Done(Err(errno::EINVAL)),
        "qp_state past ERR"
    );
    // A bad response address: EFAULT, nothing created.
    let ids = v.cma.ids();
    let mut b = [0u8; 24];
    put_u64(&mut b, 8, 0xdead_0000);
    put_u16(&mut b, 16, ps::TCP);
    assert_eq!(
        v.write(f, cmd::CREATE_ID, &b, 4),
        Outcome::Done(Err(errno::EFAULT))
    );
    assert_eq!(v.cma.ids(), ids);
    // Unknown and short commands, a bad port space, AF_IB.
    assert_eq!(v.write(f, 99, &[], 0), Outcome::Done(Err(errno::EINVAL)));
    assert_eq!(
        v.write(f, cmd::GET_OPTION, &[0; 8], 0),
        Outcome::Done(Err(errno::ENOSYS))
    );
    assert_eq!(
        v.write(f, cmd::CONNECT, &[0; 20], 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    put_u64(&mut b, 8, RESP);
    put_u16(&mut b, 16, 0x4242);
    assert_eq!(
        v.write(f, cmd::CREATE_ID, &b, 4),
        Outcome::Done(Err(errno::EINVAL))
    );
    let ib = v.create_id(f, 3, ps::IB);
    let mut bind = [0u8; 136];
    put_u32(&mut bind, 0, ib);
    put_u16(&mut bind, 4, 48);
    abi::emit_sockaddr_ib([0; 16], 0xffff, 0, &mut bind[8..]);
    assert_eq!(
        v.write(f, cmd::BIND, &bind, 0),
        Outcome::Done(Err(errno::EAFNOSUPPORT))
    );
    assert_eq!(
        v.write(f, cmd::JOIN_IP_MCAST, &[0; 48], 4),
        Outcome::Done(Err(errno::EINVAL)),
        "a group of no address family"
    );
    // The commands were counted, failures too.
    assert!(v.cma.stats().commands[cmd::CREATE_ID as usize] >= 4);
    assert!(v.cma.stats().errors[cmd::BIND_IP as usize] >= 2);
}

#[test]
fn release_destroys_and_the_peer_hears_it() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 0), Outcome::Done(Ok(())));
    let port = abi::parse_sockaddr(&s.query_route(sf, lid)[136..164])
        .unwrap()
        .port();
    // Three connections from the client; the server accepts all.
    let mut ids = Vec::new();
    for _ in 0..3 {
        let id = c.create_id(cf, 5, ps::TCP);
        c.resolve_ip(cf, id, &format!("10.99.0.12:{port}"));
        c.expect_event(cf, event::ADDR_RESOLVED);
        c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
        c.expect_event(cf, event::ROUTE_RESOLVED);
        c.conn(cf, cmd::CONNECT, id, 0x100 + id, true, 8);
        ids.push(id);
    }
    exchange(&mut c, &mut s);
    for _ in 0..3 {
        let e = s.expect_event(sf, event::CONNECT_REQUEST);
        let child = u32_at(&e, 8);
        s.conn(sf, cmd::ACCEPT, child, 0x200 + child, true, 16);
    }
    exchange(&mut c, &mut s);
    for &id in &ids {
        c.expect_event(cf, event::CONNECT_RESPONSE);
        c.conn(cf, cmd::ACCEPT, id, 0, false, 16);
    }
    exchange(&mut c, &mut s);
    for _ in 0..3 {
        s.expect_event(sf, event::ESTABLISHED);
    }
    // The client process dies: every connection gets its DREQ.
    let mut env = Env {
        agent: &mut c.agent,
        now: c.now,
    };
    c.cma.release(cf, &mut env);
    assert_eq!(c.cma.ids(), 0);
    exchange(&mut c, &mut s);
    for _ in 0..3 {
        s.expect_event(sf, event::DISCONNECTED);
    }
    assert_eq!(c.cma.stats().released_ids, 3);
    // The server's service stops: its files (the listener's) are released at once.
    let mut env = Env {
        agent: &mut s.agent,
        now: s.now,
    };
    assert_eq!(s.cma.release_all(&mut env).len(), 1);
    assert_eq!((s.cma.ids(), s.cma.files()), (0, 0));
}

#[test]
fn listener_destroy_rejects_unreported_requests_and_backlog_refuses() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7471"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 2), Outcome::Done(Ok(())));
    for _ in 0..3 {
        let id = c.create_id(cf, 5, ps::TCP);
        c.resolve_ip(cf, id, "10.99.0.12:7471");
        c.expect_event(cf, event::ADDR_RESOLVED);
        c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
        c.expect_event(cf, event::ROUTE_RESOLVED);
        c.conn(cf, cmd::CONNECT, id, 0x100 + id, true, 8);
    }
    exchange(&mut c, &mut s);
    // Backlog 2: the third request was refused (REJ consumer defined).
    assert_eq!(s.cma.stats().backlog_full, 1);
    assert_eq!(s.cma.ids(), 3, "listener + two announced connections");
    let e = c.expect_event(cf, event::REJECTED);
    assert_eq!(u32_at(&e, 16), 28);
    // Destroying the listener withdraws its unreported requests: rejected too.
    assert_eq!(s.destroy(sf, lid), 0);
    assert_eq!(s.cma.ids(), 0);
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::REJECTED);
    c.expect_event(cf, event::REJECTED);
}

#[test]
fn udaddy_flow_sidr() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::UDP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7174"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 0), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 2, ps::UDP);
    c.resolve_ip(cf, id, "10.99.0.12:7174");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    let init = c.init_qp_attr(cf, id, 1);
    assert_eq!(init.qp_attr_mask, 1 | 16 | 32 | 64, "STATE|PKEY|PORT|QKEY");
    assert_eq!(init.qkey, 0x0123_4567);
    c.conn(cf, cmd::CONNECT, id, 0x33, true, 8);
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    let child = u32_at(&e, 8);
    s.conn(sf, cmd::ACCEPT, child, 0x44, true, 16);
    exchange(&mut c, &mut s);
    let e = c.expect_event(cf, event::ESTABLISHED);
    assert_eq!(u32_at(&e, 20), 0x44, "remote UD QPN");
    assert_eq!(u32_at(&e, 24), 0x0123_4567, "its Q_Key");
    let ah = AhAttr::parse(&e[28..60]).unwrap();
    assert_eq!(ah.dgid, s.gid.0);
    assert!(ah.is_global);
    assert_eq!(ah.port_num, 1);
}

/// A GET_EVENT a signal interrupted is answered with the restart event, which
/// librdmacm's `rdma_get_cm_event` discards (uid 0, an id beyond its index map, read as a
/// positive `int`) before writing GET_EVENT again: no event is taken, the next real one
/// comes to the repeated GET_EVENT, and DESTROY_ID's events_reported counts real events
/// only.
#[test]
fn interrupted_get_event_restarts_without_losing_events() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 0x1000, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7174"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 3), Outcome::Done(Ok(())));
    let mut b = [0u8; 8];
    put_u64(&mut b, 0, RESP);
    let Outcome::WaitEvent { response, out_len } =
        s.write(sf, cmd::GET_EVENT, &b, abi::EventResp::LEN as u16)
    else {
        panic!("GET_EVENT should block");
    };
    let before = s.cma.stats().events_reported;
    // The caller's buffer holds stale bytes; the restart event overwrites all of it.
    s.mem
        .write(RESP, &[0x5a; abi::EventResp::LEN])
        .expect("mapped");
    assert_eq!(s.cma.restart(response, out_len, &mut s.mem), Ok(()));
    let e = s.resp(abi::EventResp::LEN);
    assert_eq!(u64_at(&e, 0), 0, "uid 0: librdmacm looks the id up");
    let id = u32_at(&e, 8) as i32;
    assert!(
        id > 0xFFFF,
        "beyond librdmacm's index map, positive: {id:#x}"
    );
    assert!(e[12..].iter().all(|&x| x == 0), "the rest is zero");
    assert_eq!(s.cma.stats().events_reported, before, "nothing reported");
    // An old caller's shorter buffer gets only its length; a bad address is EFAULT.
    s.mem
        .write(RESP, &[0x5a; abi::EventResp::LEN])
        .expect("mapped");
    let short = abi::EventResp::MIN_OUT as u16;
    assert_eq!(s.cma.restart(response, short, &mut s.mem), Ok(()));
    assert_eq!(s.resp(abi::EventResp::LEN)[usize::from(short)], 0x5a);
    assert_eq!(s.cma.restart(8, out_len, &mut s.mem), Err(errno::EFAULT));

    // The connection that comes afterwards reaches the repeated GET_EVENT.
    let cid = c.create_id(cf, 0x2000, ps::TCP);
    c.resolve_ip(cf, cid, "10.99.0.12:7174");
    c.expect_event(cf, event::ADDR_RESOLVED);
    assert_eq!(
        c.id_arg(cf, cmd::RESOLVE_ROUTE, cid, 2000),
        Outcome::Done(Ok(()))
    );
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, cid, 0x11, true, 8);
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    assert_eq!(u64_at(&e, 0), 0x1000);
    assert_eq!(s.get_event(sf), None);
    let child = u32_at(&e, 8);
    s.destroy(sf, child);
    assert_eq!(s.destroy(sf, lid), 1, "the request only, not the restart");
}

/// Sets an option on an id through the caller's memory, as librdmacm does.
fn set_option(vm: &mut Vm, fh: Fh, id: u32, level: u32, name: u32, v: &[u8]) -> Outcome {
    const OPT: u64 = 0x20_0000;
    vm.mem.map(OPT, v.len());
    vm.mem.write(OPT, v).unwrap();
    let mut b = [0u8; 24];
    b[0..8].copy_from_slice(&OPT.to_ne_bytes());
    b[8..12].copy_from_slice(&id.to_ne_bytes());
    b[12..16].copy_from_slice(&level.to_ne_bytes());
    b[16..20].copy_from_slice(&name.to_ne_bytes());
    b[20..24].copy_from_slice(&(v.len() as u32).to_ne_bytes());
    vm.write(fh, cmd::SET_OPTION, &b, 0)
}

fn set_int_option(vm: &mut Vm, fh: Fh, id: u32, level: u32, name: u32, v: u32) -> Outcome {
    set_option(vm, fh, id, level, name, &v.to_ne_bytes())
}

/// A new TCP id of `fh`, given an id-level u8 option if any, resolved to 10.99.0.12 and
/// routed: the first path of its QUERY_ROUTE (`struct ib_user_path_rec`, from byte 8 of
/// `struct rdma_ucm_query_route_resp`).
fn routed_path(c: &mut Vm, fh: Fh, option: Option<(u32, u8)>) -> Vec<u8> {
    let id = c.create_id(fh, 5, ps::TCP);
    if let Some((name, v)) = option {
        let level = abi::opt::LEVEL_ID;
        assert_eq!(
            set_option(c, fh, id, level, name, &[v]),
            Outcome::Done(Ok(()))
        );
    }
    c.resolve_ip(fh, id, "10.99.0.12:7471");
    c.expect_event(fh, event::ADDR_RESOLVED);
    c.id_arg(fh, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(fh, event::ROUTE_RESOLVED);
    c.query_route(fh, id)[8..].to_vec()
}

/// RDMA_OPTION_ID_ACK_TIMEOUT sets the route's packet lifetime to the timeout less one
/// (cma_resolve_iboe_route), seen in QUERY_ROUTE's path; without it, rdma_cm's 16.
#[test]
fn ack_timeout_sets_the_routes_packet_lifetime() {
    let mut c = Vm::new(11);
    let cf = c.cma.open();
    // The path's packet_life_time, at 62 in it.
    let mut lifetime =
        |ack: Option<u8>| routed_path(&mut c, cf, ack.map(|t| (abi::opt::ID_ACK_TIMEOUT, t)))[62];
    assert_eq!(lifetime(None), 16);
    assert_eq!(lifetime(Some(14)), 13);
    assert_eq!(lifetime(Some(0)), 16, "0 is not a timeout");
}

/// A connection request from `c` to a listener on `s`: (client file, id; server file,
/// the child id of the request).
fn one_request(c: &mut Vm, s: &mut Vm) -> (Fh, u32, Fh, u32) {
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7471"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, id, "10.99.0.12:7471");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, id, 0x100, true, 8);
    exchange(c, s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    (cf, id, sf, u32_at(&e, 8))
}

/// `rdma_reject_ece()`'s VENDOR_OPTION_NOT_SUPPORTED goes out as given (ucma_reject);
/// any other reason but CONSUMER_DEFINED is refused.
#[test]
fn reject_reasons_go_out_as_given() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, _, sf, child) = one_request(&mut c, &mut s);
    let reject = |vm: &mut Vm, reason: u8| {
        let mut b = [0u8; 264];
        b[0..4].copy_from_slice(&child.to_ne_bytes());
        b[5] = reason;
        vm.write(sf, cmd::REJECT, &b, 0)
    };
    assert_eq!(reject(&mut s, 1), Outcome::Done(Err(errno::EINVAL)));
    assert_eq!(reject(&mut s, 35), Outcome::Done(Ok(())));
    exchange(&mut c, &mut s);
    let e = c.expect_event(cf, event::REJECTED);
    assert_eq!(u32_at(&e, 16), 35, "VENDOR_OPTION_NOT_SUPPORTED");
}

/// An ACCEPT that fails past the state check rejects the connection, as rdma_accept()'s
/// `reject:` path: a second ACCEPT of the same request (the CM is in REP_SENT) gives
/// EINVAL and the peer gets REJ(CONSUMER_DEFINED).
#[test]
fn a_failed_accept_rejects() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, _, sf, child) = one_request(&mut c, &mut s);
    s.conn(sf, cmd::ACCEPT, child, 0x200, true, 16);
    assert_eq!(
        s.conn_with(sf, cmd::ACCEPT, child, 0x200, true, 16, (7, 7)),
        Outcome::Done(Err(errno::EINVAL))
    );
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::CONNECT_RESPONSE);
    let e = c.expect_event(cf, event::REJECTED);
    assert_eq!(u32_at(&e, 16), 28, "CONSUMER_DEFINED");
}

/// `rdma_set_option(RDMA_OPTION_ID_AFONLY)` is taken before bind and after it, refused
/// once the id listens (rdma_set_afonly(): IDLE or ADDR_BOUND).
#[test]
fn afonly_is_taken_until_the_id_goes_past_bound() {
    let mut s = Vm::new(12);
    let sf = s.cma.open();
    let id = s.create_id(sf, 1, ps::TCP);
    let (level, afonly) = (abi::opt::LEVEL_ID, abi::opt::ID_AFONLY);
    assert_eq!(
        set_int_option(&mut s, sf, id, level, afonly, 1),
        Outcome::Done(Ok(()))
    );
    assert_eq!(s.bind_ip(sf, id, "[::]:7471"), Outcome::Done(Ok(())));
    assert_eq!(
        set_int_option(&mut s, sf, id, level, afonly, 0),
        Outcome::Done(Ok(()))
    );
    assert_eq!(s.id_arg(sf, cmd::LISTEN, id, 4), Outcome::Done(Ok(())));
    assert_eq!(
        set_int_option(&mut s, sf, id, level, afonly, 1),
        Outcome::Done(Err(errno::EINVAL))
    );
}

/// CONNECT's retry counts are clamped to 7 as `cma_connect_ib()` clamps them (not cut to
/// their low bits): the peer's CONNECT_REQUEST shows 7 and 7 for 9 and 15.
#[test]
fn connect_clamps_retry_counts() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, sf) = (c.cma.open(), s.cma.open());
    let lid = s.create_id(sf, 1, ps::TCP);
    assert_eq!(s.bind_ip(sf, lid, "0.0.0.0:7471"), Outcome::Done(Ok(())));
    assert_eq!(s.id_arg(sf, cmd::LISTEN, lid, 4), Outcome::Done(Ok(())));
    let id = c.create_id(cf, 5, ps::TCP);
    c.resolve_ip(cf, id, "10.99.0.12:7471");
    c.expect_event(cf, event::ADDR_RESOLVED);
    c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0);
    c.expect_event(cf, event::ROUTE_RESOLVED);
    let o = c.conn_with(cf, cmd::CONNECT, id, 0x100, true, 8, (9, 15));
    assert_eq!(o, Outcome::Done(Ok(())));
    exchange(&mut c, &mut s);
    let e = s.expect_event(sf, event::CONNECT_REQUEST);
    // struct rdma_ucm_event_resp: the conn param from byte 20; retry counts at 269, 270.
    assert_eq!((e[20 + 269], e[20 + 270]), (7, 7));
}

/// A DISCONNECT whose DREQ is never answered ends in DISCONNECTED with -ETIMEDOUT once
/// its retries run out (cma_ib_handler: IB_CM_DREQ_ERROR); a DREQ answered gives 0.
#[test]
fn an_unanswered_dreq_disconnects_with_etimedout() {
    let (mut c, mut s) = (Vm::new(11), Vm::new(12));
    let (cf, id, sf, child) = one_request(&mut c, &mut s);
    s.conn(sf, cmd::ACCEPT, child, 0x200, true, 16);
    exchange(&mut c, &mut s);
    c.expect_event(cf, event::CONNECT_RESPONSE);
    c.conn(cf, cmd::ACCEPT, id, 0, false, 16);
    exchange(&mut c, &mut s);
    s.expect_event(sf, event::ESTABLISHED);
    // The client disconnects; the server's side never sees the DREQ.
    assert_eq!(c.id_arg(cf, cmd::DISCONNECT, id, 0), Outcome::Done(Ok(())));
    for _ in 0..20 {
        c.now = c.now.after_ms(5000);
        c.agent.poll(c.now);
        c.events_from_agent();
    }
    let e = c.expect_event(cf, event::DISCONNECTED);
    assert_eq!(u32_at(&e, 16) as i32, -errno::ETIMEDOUT);
}

/// An id whose program sets no TOS takes the port's `default_roce_tos` (configfs in the
/// kernel, `pvcm-guestd --default-roce-tos` here) as its route's traffic class; a TOS
/// the program sets wins.
#[test]
fn default_roce_tos_applies_to_ids_without_a_tos() {
    let mut c = Vm::new(11);
    c.cma = pvcm_guest::service::cma::Cma::with_lookup(
        pvcm_guest::service::verbs::RdmaPort {
            default_roce_tos: 0x60,
            ..port(11)
        },
        77,
        Box::new(c.net.clone()),
    );
    let cf = c.cma.open();
    // The path's traffic_class, at 55 in it.
    let mut traffic_class =
        |tos: Option<u8>| routed_path(&mut c, cf, tos.map(|t| (abi::opt::ID_TOS, t)))[55];
    assert_eq!(traffic_class(None), 0x60);
    assert_eq!(traffic_class(Some(0x20)), 0x20);
}

/// WRITE_CM_EVENT as librdmacm 60 and later writes it (`rdma_write_cm_event`).
fn write_cm_event(v: &mut Vm, fh: Fh, id: u32, ev: u32, status: i32, arg: u64) -> Outcome {
    let w = abi::WriteCmEvent {
        id,
        event: ev,
        status,
        arg,
    };
    v.write(fh, cmd::WRITE_CM_EVENT, &w.to_bytes(), 0)
}

#[test]
fn written_events_reach_a_waiting_get_event_as_the_kernel_reports_them() {
    let mut v = Vm::new(11);
    let (f, g) = (v.cma.open(), v.cma.open());
    let id = v.create_id(f, 0xabc0, ps::TCP);
    // Another thread waits in GET_EVENT on the file.
    let mut b = [0u8; 8];
    put_u64(&mut b, 0, RESP);
    let Outcome::WaitEvent { response, out_len } =
        v.write(f, cmd::GET_EVENT, &b, abi::EventResp::LEN as u16)
    else {
        panic!("GET_EVENT should block");
    };
    let arg = 0x1122_3344_5566_7788;
    assert_eq!(
        write_cm_event(&mut v, f, id, event::USER, -5, arg),
        Outcome::Done(Ok(()))
    );
    assert!(v.cma.has_events(f), "the waiting GET_EVENT is served");
    assert_eq!(
        v.cma.deliver(f, response, out_len, &mut v.mem),
        Some(Ok(()))
    );
    let e = v.resp(abi::EventResp::LEN);
    assert_eq!(u64_at(&e, 0), 0xabc0, "the id's uid");
    assert_eq!(u32_at(&e, 8), id);
    assert_eq!(u32_at(&e, 12), event::USER);
    assert_eq!(u32_at(&e, 16) as i32, -5);
    assert_eq!(u64_at(&e, 20), arg, "param.arg32 holds the argument");
    assert!(e[28..].iter().all(|&x| x == 0), "the rest is zero");
    // INTERNAL is taken too; the next GET_EVENT has it at once.
    assert_eq!(
        write_cm_event(&mut v, f, id, event::INTERNAL, 0, 16),
        Outcome::Done(Ok(()))
    );
    let e = v.expect_event(f, event::INTERNAL);
    assert_eq!(u64_at(&e, 20), 16);
    // Any other event is EINVAL, even for an id that does not exist; another file's id
    // is EINVAL, an unknown one ENOENT; the structure must reach the argument.
    for ev in [event::CONNECT_REQUEST, event::ADDRINFO_RESOLVED, 99] {
        assert_eq!(
            write_cm_event(&mut v, f, id, ev, 0, 0),
            Outcome::Done(Err(errno::EINVAL)),
            "event {ev}"
        );
    }
    assert_eq!(
        write_cm_event(&mut v, f, 9999, event::ESTABLISHED, 0, 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(
        write_cm_event(&mut v, g, id, event::USER, 0, 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(
        write_cm_event(&mut v, f, 9999, event::USER, 0, 0),
        Outcome::Done(Err(errno::ENOENT))
    );
    let w = abi::WriteCmEvent {
        id,
        event: event::USER,
        status: 0,
        arg: 7,
    }
    .to_bytes();
    assert_eq!(
        v.write(f, cmd::WRITE_CM_EVENT, &w[..20], 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(
        v.write(f, cmd::WRITE_CM_EVENT, &w[..24], 0),
        Outcome::Done(Ok(()))
    );
    assert_eq!(u64_at(&v.expect_event(f, event::USER), 20), 7);
    // One more stays queued: the destroy withdraws it and reports the three delivered.
    assert_eq!(
        write_cm_event(&mut v, f, id, event::USER, 0, 1),
        Outcome::Done(Ok(()))
    );
    assert_eq!(v.destroy(f, id), 3);
    assert!(!v.cma.has_events(f));
    let st = v.cma.stats();
    assert_eq!(st.events[event::USER as usize], 3);
    assert_eq!(st.events[event::INTERNAL as usize], 1);
    assert_eq!(st.errors[cmd::WRITE_CM_EVENT as usize], 7);
}

#[test]
fn resolve_ib_service_is_refused_as_on_a_roce_device() {
    let mut v = Vm::new(11);
    let f = v.cma.open();
    let ibs = |id: u32| {
        let mut b = [0u8; abi::ResolveIbService::LEN];
        put_u32(&mut b, 0, id);
        put_u64(&mut b, 8, 0x1_0000_0000_0001);
        b[16..20].copy_from_slice(b"svc\0");
        put_u32(&mut b, 80, 3);
        b
    };
    let id = v.create_id(f, 1, ps::TCP);
    // Not bound, or bound to the wildcard (no device): EINVAL.
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(id), 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(v.bind_ip(f, id, "0.0.0.0:7300"), Outcome::Done(Ok(())));
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(id), 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    // Bound to the VM's address: the device has no SA (rdma_cap_ib_sa): EOPNOTSUPP, and
    // the id stays bound (its address resolves afterwards).
    let id2 = v.create_id(f, 2, ps::TCP);
    assert_eq!(v.bind_ip(f, id2, "10.99.0.11:7301"), Outcome::Done(Ok(())));
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(id2), 0),
        Outcome::Done(Err(errno::EOPNOTSUPP))
    );
    v.resolve_ip(f, id2, "10.99.0.12:7174");
    v.expect_event(f, event::ADDR_RESOLVED);
    // After resolution, an unknown id, a short structure: EINVAL, ENOENT, EINVAL.
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(id2), 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(999), 0),
        Outcome::Done(Err(errno::ENOENT))
    );
    assert_eq!(
        v.write(f, cmd::RESOLVE_IB_SERVICE, &ibs(id2)[..80], 0),
        Outcome::Done(Err(errno::EINVAL))
    );
    assert_eq!(v.cma.stats().commands[cmd::RESOLVE_IB_SERVICE as usize], 6);
}

#[test]
fn a_stop_takes_every_armed_poll_handle_once() {
    let mut s = Vm::new(12);
    let (f1, _f2, f3) = (s.cma.open(), s.cma.open(), s.cma.open());
    s.cma.set_poll_handle(f1, 71);
    s.cma.set_poll_handle(f3, 73);
    let mut kh = s.cma.take_poll_handles();
    kh.sort_unstable();
    assert_eq!(kh, vec![71, 73]);
    assert!(s.cma.take_poll_handles().is_empty());
}

//! The rdma_cm layer of the guest service, driven with the command bytes librdmacm
//! writes (rping's and udaddy's sequences, as `librdmacm/cma.c` issues them), two
//! services over two CM agents in one process, MADs handed across in memory.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};

use pvcm_guest::cm::{Agent, AgentConfig};
use pvcm_guest::service::abi::{
    self, AhAttr, CmdHdr, ConnParam, EventResp, UverbsQpAttr, cmd, emit_sockaddr, event, ps,
    put_u16, put_u32, put_u64, u32_at, u64_at,
};
use pvcm_guest::service::caller::FakeMemory;
use pvcm_guest::service::cma::{Caller, Cma, Env, Fh, Outcome, errno};
use pvcm_guest::service::verbs::{NO_DEVICE_INDEX, RdmaPort};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;

const RESP: u64 = 0x10_0000;
const ROOT: Caller = Caller { uid: 0 };

fn port(n: u8) -> RdmaPort {
    let gid = Gid::from_ipv4(Ipv4Addr::new(10, 99, 0, n));
    RdmaPort {
        device: "rxe0".into(),
        port_num: 1,
        node_guid: 0x5054_00ff_fe99_0000 | u64::from(n),
        ibdev_index: NO_DEVICE_INDEX,
        gid,
        gid_index: 1,
        addr: Ipv4Addr::new(10, 99, 0, n).into(),
        netdev: "eth0".into(),
        path_mtu: 3,
        pkey: 0xFFFF,
        pkey_index: 0,
    }
}

/// One VM: its agent, its service, one process's memory.
struct Vm {
    agent: Agent,
    cma: Cma,
    mem: FakeMemory,
    gid: Gid,
    now: Time,
}

impl Vm {
    fn new(n: u8) -> Vm {
        let p = port(n);
        let gid = p.gid;
        let mut mem = FakeMemory::new();
        mem.map(RESP, 4096);
        mem.map(0x20_0000, 64);
        Vm {
            agent: Agent::new(AgentConfig::new(
                gid,
                p.node_guid,
                16,
                0x20000,
                u64::from(n),
            )),
            cma: Cma::new(p, u64::from(n) * 7),
            mem,
            gid,
            now: Time::from_millis(1),
        }
    }

    fn write(&mut self, fh: Fh, c: u32, body: &[u8], out: u16) -> Outcome {
        let mut b = vec![0u8; abi::HDR_LEN + body.len()];
        CmdHdr {
            cmd: c,
            in_len: body.len() as u16,
            out_len: out,
        }
        .emit(&mut b);
        b[abi::HDR_LEN..].copy_from_slice(body);
        let mut env = Env {
            agent: &mut self.agent,
            now: self.now,
        };
        self.cma.write(fh, ROOT, &b, &mut self.mem, &mut env)
    }

    fn ok(&mut self, fh: Fh, c: u32, body: &[u8], out: u16) {
        let o = self.write(fh, c, body, out);
        assert_eq!(o, Outcome::Done(Ok(())), "{}", cmd::name(c));
    }

    fn resp(&self, len: usize) -> Vec<u8> {
        self.mem.get(RESP, len).unwrap().to_vec()
    }

    fn create_id(&mut self, fh: Fh, uid: u64, space: u16) -> u32 {
        let mut b = [0u8; 24];
        put_u64(&mut b, 0, uid);
        put_u64(&mut b, 8, RESP);
        put_u16(&mut b, 16, space);
        self.ok(fh, cmd::CREATE_ID, &b, 4);
        u32_at(&self.resp(4), 0)
    }

    fn bind_ip(&mut self, fh: Fh, id: u32, addr: &str) -> Outcome {
        let mut b = [0u8; 40];
        emit_sockaddr(&addr.parse::<SocketAddr>().unwrap(), &mut b[8..36]);
        put_u32(&mut b, 36, id);
        self.write(fh, cmd::BIND_IP, &b, 0)
    }

    fn resolve_ip(&mut self, fh: Fh, id: u32, dst: &str) {
        let mut b = [0u8; 64];
        emit_sockaddr(&dst.parse::<SocketAddr>().unwrap(), &mut b[28..56]);
        put_u32(&mut b, 56, id);
        put_u32(&mut b, 60, 2000);
        self.ok(fh, cmd::RESOLVE_IP, &b, 0);
    }

    fn id_arg(&mut self, fh: Fh, c: u32, id: u32, arg: u32) -> Outcome {
        let mut b = [0u8; 8];
        put_u32(&mut b, 0, id);
        put_u32(&mut b, 4, arg);
        self.write(fh, c, &b, 0)
    }

    fn resp_id_arg(&mut self, fh: Fh, c: u32, id: u32, arg: u32, out: u16) -> Outcome {
        let mut b = [0u8; 16];
        put_u64(&mut b, 0, RESP);
        put_u32(&mut b, 8, id);
        put_u32(&mut b, 12, arg);
        self.write(fh, c, &b, out)
    }

    fn query_route(&mut self, fh: Fh, id: u32) -> Vec<u8> {
        assert_eq!(
            self.resp_id_arg(fh, cmd::QUERY_ROUTE, id, 0, 208),
            Outcome::Done(Ok(()))
        );
        self.resp(208)
    }

    fn init_qp_attr(&mut self, fh: Fh, id: u32, state: u32) -> UverbsQpAttr {
        assert_eq!(
            self.resp_id_arg(fh, cmd::INIT_QP_ATTR, id, state, 144),
            Outcome::Done(Ok(()))
        );
        UverbsQpAttr::parse(&self.resp(144)).unwrap()
    }

    /// GET_EVENT: the event, or None when it would block.
    fn get_event(&mut self, fh: Fh) -> Option<Vec<u8>> {
        let mut b = [0u8; 8];
        put_u64(&mut b, 0, RESP);
        match self.write(fh, cmd::GET_EVENT, &b, EventResp::LEN as u16) {
            Outcome::Done(Ok(())) => Some(self.resp(EventResp::LEN)),
            Outcome::WaitEvent { .. } => None,
            o => panic!("get_event: {o:?}"),
        }
    }

    fn expect_event(&mut self, fh: Fh, ev: u32) -> Vec<u8> {
        let e = self
            .get_event(fh)
            .unwrap_or_else(|| panic!("no event, want {}", event::name(ev)));
        assert_eq!(
            event::name(u32_at(&e, 12)),
            event::name(ev),
            "status {}",
            u32_at(&e, 16) as i32
        );
        e
    }

    fn conn(&mut self, fh: Fh, c: u32, id: u32, qpn: u32, valid: bool, extra: usize) {
        let mut b = vec![0u8; 280 + extra];
        let off = if c == cmd::ACCEPT { 8 } else { 0 };
        ConnParam {
            qp_num: qpn,
            qkey: 0,
            private_data: vec![0xab; 8],
            srq: false,
            responder_resources: 1,
            initiator_depth: 1,
            flow_control: false,
            retry_count: 7,
            rnr_retry_count: 7,
            valid,
        }
        .emit(&mut b[off..off + 272]);
        if c == cmd::ACCEPT {
            put_u64(&mut b, 0, 0x5eed);
            put_u32(&mut b, 280, id);
        } else {
            put_u32(&mut b, 272, id);
        }
        self.ok(fh, c, &b, 0);
    }

    fn destroy(&mut self, fh: Fh, id: u32) -> u32 {
        let mut b = [0u8; 16];
        put_u64(&mut b, 0, RESP);
        put_u32(&mut b, 8, id);
        self.ok(fh, cmd::DESTROY_ID, &b, 4);
        u32_at(&self.resp(4), 0)
    }

    fn events_from_agent(&mut self) -> Vec<Fh> {
        let mut env = Env {
            agent: &mut self.agent,
            now: self.now,
        };
        let evs: Vec<_> = std::iter::from_fn(|| env.agent.pop_event()).collect();
        evs.into_iter()
            .filter_map(|e| self.cma.on_agent_event(e, &mut env))
            .collect()
    }
}

/// Moves MADs both ways and routes the agents' events into the services.
fn exchange(a: &mut Vm, b: &mut Vm) {
    for _ in 0..4 {
        let ab: Vec<_> = a.agent.drain_outbox().collect();
        for m in &ab {
            b.agent.handle_mad(&m.mad, a.gid, b.now);
        }
        b.events_from_agent();
        let ba: Vec<_> = b.agent.drain_outbox().collect();
        for m in &ba {
            a.agent.handle_mad(&m.mad, b.gid, a.now);
        }
        a.events_from_agent();
    }
}

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
        Outcome::Done(Err(errno::ENOSYS))
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

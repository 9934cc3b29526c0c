//! Helpers shared by the guest service's tests and its fuzz target (included with
//! `#[path]`): a VM's service over its CM agent with one process's memory, commands
//! built as librdmacm writes them, and MADs handed between two VMs in memory.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{Ipv4Addr, SocketAddr};

use pvcm_guest::cm::{Agent, AgentConfig};
use pvcm_guest::service::abi::{
    self, CmdHdr, ConnParam, EventResp, UverbsQpAttr, cmd, emit_sockaddr, event, put_u16, put_u32,
    put_u64, u32_at,
};
use pvcm_guest::service::caller::FakeMemory;
use pvcm_guest::service::cma::{Caller, Cma, Env, Fh, Outcome};
use pvcm_guest::service::verbs::{NO_DEVICE_INDEX, RdmaPort};
use pvcm_guest::time::Time;
use pvcm_wire::Gid;

pub const RESP: u64 = 0x10_0000;
pub const ROOT: Caller = Caller { uid: 0 };

pub fn port(n: u8) -> RdmaPort {
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
        default_roce_tos: 0,
        pkey: 0xFFFF,
        pkey_index: 0,
    }
}

/// One VM: its agent, its service, one process's memory.
#[derive(Debug)]
pub struct Vm {
    pub agent: Agent,
    pub cma: Cma,
    pub mem: FakeMemory,
    pub gid: Gid,
    pub now: Time,
}

impl Vm {
    pub fn new(n: u8) -> Vm {
        Vm::on(port(n))
    }

    /// A VM whose RDMA port's netdev is `netdev` (multicast memberships go there).
    pub fn with_netdev(n: u8, netdev: &str) -> Vm {
        let mut p = port(n);
        p.netdev = netdev.into();
        Vm::on(p)
    }

    fn on(p: RdmaPort) -> Vm {
        // port() puts the VM number in the node GUID's low byte.
        let n = p.node_guid as u8;
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

    pub fn write(&mut self, fh: Fh, c: u32, body: &[u8], out: u16) -> Outcome {
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

    pub fn ok(&mut self, fh: Fh, c: u32, body: &[u8], out: u16) {
        let o = self.write(fh, c, body, out);
        assert_eq!(o, Outcome::Done(Ok(())), "{}", cmd::name(c));
    }

    /// The file that holds id `id` now.
    pub fn cma_owner(&self, id: u32) -> Option<Fh> {
        self.cma.file_of(id)
    }

    pub fn resp(&self, len: usize) -> Vec<u8> {
        self.mem.get(RESP, len).unwrap().to_vec()
    }

    pub fn create_id(&mut self, fh: Fh, uid: u64, space: u16) -> u32 {
        let mut b = [0u8; 24];
        put_u64(&mut b, 0, uid);
        put_u64(&mut b, 8, RESP);
        put_u16(&mut b, 16, space);
        self.ok(fh, cmd::CREATE_ID, &b, 4);
        u32_at(&self.resp(4), 0)
    }

    pub fn bind_ip(&mut self, fh: Fh, id: u32, addr: &str) -> Outcome {
        let mut b = [0u8; 40];
        emit_sockaddr(&addr.parse::<SocketAddr>().unwrap(), &mut b[8..36]);
        put_u32(&mut b, 36, id);
        self.write(fh, cmd::BIND_IP, &b, 0)
    }

    pub fn resolve_ip(&mut self, fh: Fh, id: u32, dst: &str) {
        let mut b = [0u8; 64];
        emit_sockaddr(&dst.parse::<SocketAddr>().unwrap(), &mut b[28..56]);
        put_u32(&mut b, 56, id);
        put_u32(&mut b, 60, 2000);
        self.ok(fh, cmd::RESOLVE_IP, &b, 0);
    }

    pub fn id_arg(&mut self, fh: Fh, c: u32, id: u32, arg: u32) -> Outcome {
        let mut b = [0u8; 8];
        put_u32(&mut b, 0, id);
        put_u32(&mut b, 4, arg);
        self.write(fh, c, &b, 0)
    }

    pub fn resp_id_arg(&mut self, fh: Fh, c: u32, id: u32, arg: u32, out: u16) -> Outcome {
        let mut b = [0u8; 16];
        put_u64(&mut b, 0, RESP);
        put_u32(&mut b, 8, id);
        put_u32(&mut b, 12, arg);
        self.write(fh, c, &b, out)
    }

    pub fn query_route(&mut self, fh: Fh, id: u32) -> Vec<u8> {
        assert_eq!(
            self.resp_id_arg(fh, cmd::QUERY_ROUTE, id, 0, 208),
            Outcome::Done(Ok(()))
        );
        self.resp(208)
    }

    pub fn init_qp_attr(&mut self, fh: Fh, id: u32, state: u32) -> UverbsQpAttr {
        assert_eq!(
            self.resp_id_arg(fh, cmd::INIT_QP_ATTR, id, state, 144),
            Outcome::Done(Ok(()))
        );
        UverbsQpAttr::parse(&self.resp(144)).unwrap()
    }

    /// GET_EVENT: the event, or None when it would block.
    pub fn get_event(&mut self, fh: Fh) -> Option<Vec<u8>> {
        let mut b = [0u8; 8];
        put_u64(&mut b, 0, RESP);
        match self.write(fh, cmd::GET_EVENT, &b, EventResp::LEN as u16) {
            Outcome::Done(Ok(())) => Some(self.resp(EventResp::LEN)),
            Outcome::WaitEvent { .. } => None,
            o => panic!("get_event: {o:?}"),
        }
    }

    pub fn expect_event(&mut self, fh: Fh, ev: u32) -> Vec<u8> {
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

    pub fn conn(&mut self, fh: Fh, c: u32, id: u32, qpn: u32, valid: bool, extra: usize) {
        let o = self.conn_with(fh, c, id, qpn, valid, extra, (7, 7));
        assert_eq!(o, Outcome::Done(Ok(())), "{}", cmd::name(c));
    }

    /// CONNECT or ACCEPT with a conn_param (`retries`: retry and RNR retry counts), its
    /// outcome as it is.
    #[allow(clippy::too_many_arguments)]
    pub fn conn_with(
        &mut self,
        fh: Fh,
        c: u32,
        id: u32,
        qpn: u32,
        valid: bool,
        extra: usize,
        retries: (u8, u8),
    ) -> Outcome {
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
            retry_count: retries.0,
            rnr_retry_count: retries.1,
            valid,
        }
        .emit(&mut b[off..off + 272]);
        if c == cmd::ACCEPT {
            put_u64(&mut b, 0, 0x5eed);
            put_u32(&mut b, 280, id);
        } else {
            put_u32(&mut b, 272, id);
        }
        self.write(fh, c, &b, 0)
    }

    pub fn destroy(&mut self, fh: Fh, id: u32) -> u32 {
        let mut b = [0u8; 16];
        put_u64(&mut b, 0, RESP);
        put_u32(&mut b, 8, id);
        self.ok(fh, cmd::DESTROY_ID, &b, 4);
        u32_at(&self.resp(4), 0)
    }

    pub fn events_from_agent(&mut self) -> Vec<Fh> {
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
pub fn exchange(a: &mut Vm, b: &mut Vm) {
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

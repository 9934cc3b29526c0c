//! Helpers shared by the guest service's tests and its fuzz target (included with
//! `#[path]`): a VM's service over its CM agent with one process's memory, commands
//! built as librdmacm writes them, and MADs handed between two VMs in memory.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use pvcm_guest::cm::{Agent, AgentConfig};
use pvcm_guest::service::abi::{
    self, CmdHdr, ConnParam, EventResp, UverbsQpAttr, cmd, emit_sockaddr, event, put_u16, put_u32,
    put_u64, u32_at,
};
use pvcm_guest::service::caller::FakeMemory;
use pvcm_guest::service::cma::errno;
use pvcm_guest::service::cma::{Caller, Cma, Env, Fh, Outcome};
use pvcm_guest::service::neigh::{Lookup, Neighbour, Route, iff, nud};
use pvcm_guest::service::netlink::NetlinkError;
use pvcm_guest::service::verbs::{NO_DEVICE_INDEX, RdmaPort, ServedGid};
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
        more: Vec::new(),
    }
}

/// The lab's network as a VM sees it, for the address resolution's rules: the loopback
/// (ifindex 1) with 127.0.0.0/8 and the VM's own address local; the VM's NIC (ifindex 2)
/// on 10.99.0.0/24 (and fd99::/64) with the VM's address as source, and IPv4 multicast
/// (whose neighbours are NOARP once solicited); 10.98.0.0/24 routed via the gateway
/// 10.99.0.1; nothing else routed (ENETUNREACH). Neighbours 10.99.0.1 to
/// .20 answer (valid); the others are solicited and stay incomplete until
/// [`LabNet::answer`]. Shared: the test keeps a handle while the service owns one.
#[derive(Debug, Clone)]
pub struct LabNet(pub Arc<Mutex<LabState>>);

/// What [`LabNet`] holds.
#[derive(Debug, Default)]
pub struct LabState {
    /// The VM's own address.
    pub own: Option<IpAddr>,
    /// The VM's further addresses (a dual-stack VM's IPv6 one).
    pub more_own: Vec<IpAddr>,
    /// Neighbour states by (interface, address).
    pub neigh: BTreeMap<(u32, IpAddr), u16>,
    /// Neighbours solicited, in order.
    pub solicited: Vec<(u32, IpAddr)>,
    /// A neighbour became valid since the service last asked.
    pub changed: bool,
    /// Route lookups asked (destination, source).
    pub routes: Vec<(IpAddr, Option<IpAddr>)>,
    /// Destinations whose route is `unreachable` (EHOSTUNREACH).
    pub unreachable: BTreeSet<IpAddr>,
}

const LO: u32 = 1;
const ETH0: u32 = 2;

impl LabNet {
    pub fn new(own: IpAddr) -> LabNet {
        let mut st = LabState {
            own: Some(own),
            ..LabState::default()
        };
        for n in 1..=20 {
            st.neigh
                .insert((ETH0, Ipv4Addr::new(10, 99, 0, n).into()), nud::REACHABLE);
        }
        LabNet(Arc::new(Mutex::new(st)))
    }

    /// The neighbour `addr` on the NIC answers (REACHABLE), as its ARP reply would
    /// make it.
    pub fn answer(&self, addr: &str) {
        let mut st = self.0.lock().unwrap();
        st.neigh
            .insert((ETH0, addr.parse().unwrap()), nud::REACHABLE);
        st.changed = true;
    }

    pub fn state(&self) -> std::sync::MutexGuard<'_, LabState> {
        self.0.lock().unwrap()
    }
}

impl Lookup for LabNet {
    fn route(&mut self, dst: IpAddr, src: Option<IpAddr>) -> Result<Route, NetlinkError> {
        let mut st = self.0.lock().unwrap();
        st.routes.push((dst, src));
        // The VM's address of the destination's family is the route's source.
        let own = st
            .own
            .into_iter()
            .chain(st.more_own.iter().copied())
            .find(|o| o.is_ipv4() == dst.is_ipv4());
        let is_own = st.own == Some(dst) || st.more_own.contains(&dst);
        if st.unreachable.contains(&dst) {
            return Err(NetlinkError::Kernel(errno::EHOSTUNREACH));
        }
        let local = |src| Route {
            kind: 2,
            ifindex: LO,
            gateway: None,
            src,
        };
        let nic = |gateway| Route {
            kind: 1,
            ifindex: ETH0,
            gateway,
            src: src.or(own),
        };
        match dst {
            _ if is_own => Ok(local(src.or(Some(dst)))),
            IpAddr::V4(v) if v.octets()[0] == 127 => Ok(local(src.or(Some(dst)))),
            // Multicast goes out of the NIC (a VM with a multicast or default route).
            IpAddr::V4(v) if v.is_multicast() && own.is_some_and(|o| o.is_ipv4()) => Ok(Route {
                kind: 5,
                ..nic(None)
            }),
            IpAddr::V4(v) if v.octets()[..3] == [10, 99, 0] && own.is_some_and(|o| o.is_ipv4()) => {
                Ok(nic(None))
            }
            IpAddr::V4(v) if v.octets()[..3] == [10, 98, 0] && own.is_some_and(|o| o.is_ipv4()) => {
                Ok(nic(Some(Ipv4Addr::new(10, 99, 0, 1).into())))
            }
            IpAddr::V6(v)
                if v.segments()[..4] == [0xfd99, 0, 0, 0] && own.is_some_and(|o| o.is_ipv6()) =>
            {
                Ok(nic(None))
            }
            _ => Err(NetlinkError::Kernel(errno::ENETUNREACH)),
        }
    }

    fn link_flags(&mut self, ifindex: u32) -> Result<u32, NetlinkError> {
        Ok(if ifindex == LO {
            iff::UP | iff::LOOPBACK
        } else {
            iff::UP
        })
    }

    fn neighbour(&mut self, ifindex: u32, addr: IpAddr) -> Result<Option<Neighbour>, NetlinkError> {
        let st = self.0.lock().unwrap();
        Ok(st.neigh.get(&(ifindex, addr)).map(|&state| Neighbour {
            state,
            lladdr: (state & nud::VALID != 0).then(|| vec![0x52, 0x54, 0, 0, 0, 1]),
        }))
    }

    fn solicit(&mut self, ifindex: u32, addr: IpAddr) -> Result<(), NetlinkError> {
        let mut st = self.0.lock().unwrap();
        st.solicited.push((ifindex, addr));
        // A multicast group's entry is created NOARP (arp_constructor).
        let state = if addr.is_multicast() {
            nud::NOARP
        } else {
            nud::INCOMPLETE
        };
        st.neigh.entry((ifindex, addr)).or_insert(state);
        Ok(())
    }

    fn fd(&self) -> Option<RawFd> {
        None
    }

    fn changed(&mut self) -> bool {
        std::mem::take(&mut self.0.lock().unwrap().changed)
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
    /// Its network, as its service's address resolution sees it.
    pub net: LabNet,
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

    /// A dual-stack VM: 10.99.0.N (its primary GID, table index 1) and fd99::N (a
    /// further GID the backend serves, table index 2).
    pub fn dual(n: u8) -> Vm {
        let v6 = v6_of(n);
        let mut p = port(n);
        p.more.push(ServedGid {
            gid: Gid(v6.octets()),
            gid_index: 2,
            addr: v6.into(),
        });
        let mut vm = Vm::on(p);
        vm.agent = Agent::new(AgentConfig {
            more_gids: vec![Gid(v6.octets())],
            ..AgentConfig::new(vm.gid, vm.cma.port().node_guid, 16, 0x20000, u64::from(n))
        });
        vm.net.state().more_own.push(v6.into());
        vm
    }

    fn on(p: RdmaPort) -> Vm {
        // port() puts the VM number in the node GUID's low byte.
        let n = p.node_guid as u8;
        let gid = p.gid;
        let net = LabNet::new(p.addr);
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
            cma: Cma::with_lookup(p, u64::from(n) * 7, Box::new(net.clone())),
            mem,
            gid,
            now: Time::from_millis(1),
            net,
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
        let o = self.resolve_ip_within(fh, id, dst, 2000);
        assert_eq!(o, Outcome::Done(Ok(())), "resolve_ip {dst}");
    }

    /// RESOLVE_IP to `dst` (no source) with `timeout_ms`.
    pub fn resolve_ip_within(&mut self, fh: Fh, id: u32, dst: &str, timeout_ms: u32) -> Outcome {
        let mut b = [0u8; 64];
        emit_sockaddr(&dst.parse::<SocketAddr>().unwrap(), &mut b[28..56]);
        put_u32(&mut b, 56, id);
        put_u32(&mut b, 60, timeout_ms);
        self.write(fh, cmd::RESOLVE_IP, &b, 0)
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

/// The fd99::N address of VM N (a dual-stack VM's second), N written in decimal as
/// 10.99.0.N is: fd99::12 for VM 12.
pub fn v6_of(n: u8) -> std::net::Ipv6Addr {
    format!("fd99::{n}").parse().unwrap()
}

/// The GID VM `v`'s MADs to `dst` come from: its served GID of `dst`'s family, as the
/// backend sends them (`VmConfig::source_for`).
fn src_for(v: &Vm, dst: Gid) -> Gid {
    v.cma
        .port()
        .served()
        .map(|s| s.gid)
        .find(|g| g.to_ipv4().is_some() == dst.to_ipv4().is_some())
        .unwrap_or(v.gid)
}

/// A connection of `space` from a new id (uid `uid`) in `c`'s file `cf` to `dst`: the
/// address and route resolved, CONNECT with QP `qpn`, its REQ or SIDR_REQ delivered to
/// `s` and the answers back; returns the client's id.
pub fn dial(c: &mut Vm, s: &mut Vm, cf: Fh, uid: u64, space: u16, dst: &str, qpn: u32) -> u32 {
    let id = c.create_id(cf, uid, space);
    c.resolve_ip(cf, id, dst);
    c.expect_event(cf, event::ADDR_RESOLVED);
    assert_eq!(
        c.id_arg(cf, cmd::RESOLVE_ROUTE, id, 0),
        Outcome::Done(Ok(()))
    );
    c.expect_event(cf, event::ROUTE_RESOLVED);
    c.conn(cf, cmd::CONNECT, id, qpn, true, 8);
    exchange(c, s);
    id
}

/// Moves MADs both ways and routes the agents' events into the services.
pub fn exchange(a: &mut Vm, b: &mut Vm) {
    for _ in 0..4 {
        let ab: Vec<_> = a.agent.drain_outbox().collect();
        for m in &ab {
            b.agent.handle_mad(&m.mad, src_for(a, m.dst), b.now);
        }
        b.events_from_agent();
        let ba: Vec<_> = b.agent.drain_outbox().collect();
        for m in &ba {
            a.agent.handle_mad(&m.mad, src_for(b, m.dst), a.now);
        }
        a.events_from_agent();
    }
}

//! The rdma_cm layer of the guest service: Linux's `ucma.c` (files, ids, event queues,
//! the command table) and the parts of `cma.c` an RoCE port needs (port spaces and
//! bindings, address and route resolution, the connection calls, event translation),
//! on top of the CM [`Agent`].
//!
//! Free of I/O, like the agent, but for the IGMP memberships of multicast joins
//! ([`IgmpSockets`]): a command is the bytes a process wrote plus its memory
//! ([`CallerMemory`]) and the agent; the answer is an [`Outcome`]. The server
//! (`server.rs`) does the rest of the I/O: it reads commands from CUSE, keeps blocked
//! GET_EVENTs until [`Cma::deliver`] can fill them, and feeds the agent's events to
//! [`Cma::on_agent_event`].
//!
//! What the kernel does and this layer does the same way:
//! - ids are per file; another file's id is EINVAL, an unknown one ENOENT;
//! - a file's events form one queue; GET_EVENT takes the head; an id counts the events
//!   it had reported (`events_reported`), which DESTROY_ID and MIGRATE_ID return, and
//!   destroying an id withdraws its unreported events (for a listener, with the
//!   connections they announced, which are rejected);
//! - CONNECT_REQUEST creates the new id in the listener's file, counts against the
//!   listener's backlog until reported, and carries the listener's uid; other events
//!   of an id that has no uid yet (a new connection before ACCEPT) are dropped;
//! - the listeners of one port space and port (on several addresses of the VM, or
//!   AFONLY wildcards of the two families, as the bind rules allow) share the agent's
//!   listener of its service ID, held while one of them listens; a REQ or SIDR_REQ
//!   goes to the listener bound to its rdma_cm header's destination, else to a
//!   wildcard one of its family (`cma_find_listener`), and one no listener matches is
//!   rejected (REJ(CONSUMER_DEFINED), SIDR_REP(REJECT)); a listener is no longer
//!   reusable (its address must be its own on the port);
//! - address resolution is the kernel's `rdma_resolve_ip()` ([`neigh`]): the route to
//!   the destination, then the neighbour of its next hop (the gateway, or the
//!   destination) on the route's interface. No route fails RESOLVE_IP/RESOLVE_ADDR
//!   itself with the lookup's errno (ENETUNREACH); a valid neighbour, or a local
//!   destination, gives ADDR_RESOLVED at once; otherwise the neighbour is solicited and
//!   the id waits (the server's loop goes on) until it becomes valid (ADDR_RESOLVED) or
//!   the command's `timeout_ms` is up (ADDR_ERROR, -ETIMEDOUT), and is back in its bound
//!   state after an error. A wildcard destination resolves to the id's own address
//!   (the kernel's `cma_resolve_loopback`). Destroying a waiting id ends its
//!   resolution;
//! - route resolution completes at once (the route is the VM's own RoCE port), with
//!   its event queued; an id whose address is another local one than the VM's
//!   (127.0.0.1, which it may bind or resolve, as the kernel on rdma_rxe allows) has no
//!   RoCE netdev: RESOLVE_ROUTE fails with ENODEV, and its listener gets no request
//!   (they come for the VM's address);
//! - releasing a file destroys all its ids, sending what the CM sends for each
//!   (REJ(TIMEOUT) for a pending REQ, DREQ for a connection, REJ for an unanswered
//!   request); the agent keeps their TimeWait.
//!
//! The VM's RDMA device is followed while the service runs ([`Cma::update_port`], fed
//! by the server's look at the device): a device that goes gives DEVICE_REMOVAL to the
//! ids bound to it and closes them (ENXIO to all but DESTROY_ID), one that comes back
//! serves new ids, an address gone from its GID table stops binds to it, a bond's
//! failover gives ADDR_CHANGE. Every address the backend serves for the VM (PORT_INFO's
//! GIDs found in the port's GID table) binds, listens, resolves and connects, with its
//! own GID and table index in the REQ and the QP attributes; a bind to another address
//! of the VM is EADDRNOTAVAIL, logged and counted.
//!
//! Multicast, as `cma_iboe_join_multicast()` on a RoCE v2 port: no MAD; a join of a
//! UD id with a device (bound to the VM's address or resolved) gets its MULTICAST_JOIN
//! event at once, with the IPv4-mapped group as DGID, hop limit 64, the id's Q_Key and
//! QPN 0xFFFFFF; an IPv4 group that is not joined send-only takes the VM's IGMP
//! membership on the port's netdev ([`IgmpSockets`]), held while a join of it lasts (its
//! LEAVE_MCAST, its id's destroy, its file's release). Joins have their own ids, one
//! table for the VM, as the kernel's `multicast_table`: another file's join is EINVAL to
//! LEAVE_MCAST, an unknown one ENOENT. IPv6 groups fail as the kernel fails them on RoCE
//! v2 (its ENOTSUPP, which CUSE cannot carry: EOPNOTSUPP here). A file holds at most
//! [`MAX_JOINS_PER_FILE`] joins (ENOMEM past it): the service is the VM's, and its
//! memberships are its sockets.
//!
//! Not served: AF_IB addresses (EAFNOSUPPORT, so librdmacm turns AF_IB off and
//! uses BIND_IP/RESOLVE_IP/QUERY_ROUTE), and SET_OPTION's RDMA_OPTION_IB_PATH (ENOSYS;
//! librdmacm sets it only with an ibacm service, and resolves the route itself
//! otherwise).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use pvcm_wire::Gid;
use pvcm_wire::cm::{RejReason, SidrStatus};

use super::abi::{
    self, AbiError, Accept, AhAttr, Bind, CmdHdr, ConnParam, Connect, CreateId, DestroyId, Ece,
    EventParam, EventResp, IdArg, JoinMcast, QueryAddrResp, QueryRouteResp, Reject, ResolveAddr,
    ResolveIbService, RespIdArg, SetOption, UdParam, UserPathRec, UverbsQpAttr, WriteCmEvent, cmd,
    event, opt, ps,
};
use super::caller::CallerMemory;
use super::mcast::IgmpSockets;
use super::neigh::{self, Attempt, Lookup, Netlink};
use super::verbs::{self, Link, PortView, RdmaPort};
use crate::cm::qp_attr::{PathAv, QpState, mask};
use crate::cm::rdma_cm::{self, CmaHdr, EphemeralPorts};
use crate::cm::{
    AcceptOptions, Agent, CMA_IBOE_PACKET_LIFETIME, CmError, CmId, ConnectOptions, Event,
    SidrOptions, SplitMix64, State,
};
use crate::time::Time;

/// A file handle (one open of the device).
pub type Fh = u64;

/// errno values the commands return.
pub mod errno {
    pub use libc::{
        EADDRINUSE, EADDRNOTAVAIL, EAFNOSUPPORT, EAGAIN, EFAULT, EHOSTUNREACH, EINTR, EINVAL,
        EISCONN, ENETUNREACH, ENODEV, ENOENT, ENOMEM, ENOSPC, ENOSYS, ENXIO, EOPNOTSUPP, ETIMEDOUT,
    };
}

/// The most multicast joins one file holds at a time.
pub const MAX_JOINS_PER_FILE: usize = 1024;
/// The QPN a MULTICAST_JOIN reports (`0xFFFFFF`, the multicast QPN).
pub const MCAST_QPN: u32 = 0x00FF_FFFF;
/// The hop limit of a RoCE v2 group's address handle (`IPV6_DEFAULT_HOPLIMIT`).
const MCAST_HOP_LIMIT: u8 = 64;

/// `RDMA_UDP_QKEY`: the Q_Key of rdma_cm's UDP port space.
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;
/// The kernel's `max_backlog` default: a listener's backlog past it (or 0) is this.
pub const MAX_BACKLOG: u32 = 1024;
/// `enum ib_qp_type` IB_QPT_UD (PS_IB ids give their QP type).
const IB_QPT_UD: u8 = 4;
/// `IB_EVENT_COMM_EST` (NOTIFY's only event with an effect).
const IB_EVENT_COMM_EST: u32 = 4;
/// `IB_CM_REJ_VENDOR_OPTION_NOT_SUPPORTED`, REJECT's other allowed reason.
const REJ_VENDOR_OPTION_NOT_SUPPORTED: u8 = 35;
/// Private data sizes of the messages (IBA): REQ, REP, REJ, SIDR_REQ, SIDR_REP.
const PD_REQ: usize = 92;
const PD_REP: usize = 196;
const PD_REJ: usize = 148;
const PD_SIDR_REQ: usize = 216;
const PD_SIDR_REP: usize = 136;
/// The largest SET_OPTION value the kernel copies (`KMALLOC_MAX_SIZE` on x86_64).
const MAX_OPTLEN: u32 = 4 << 20;

/// What a command comes to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Answered: 0, or the errno the write fails with.
    Done(Result<(), i32>),
    /// GET_EVENT with no event queued: the caller waits (or gets EAGAIN when its file
    /// is non-blocking) until [`Cma::deliver`] fills it.
    WaitEvent {
        /// Where the event goes.
        response: u64,
        /// The caller's buffer size.
        out_len: u16,
    },
    /// MIGRATE_ID: the caller's `fd` must be found to be one of the service's files
    /// first ([`Cma::migrate`]).
    Migrate {
        /// The id to move.
        id: u32,
        /// The caller's descriptor of the id's current file.
        fd: u32,
        /// Where `rdma_ucm_migrate_resp` goes.
        response: u64,
        /// The caller's buffer size.
        out_len: u16,
    },
}

fn done(r: Result<(), i32>) -> Outcome {
    Outcome::Done(r)
}

/// What [`Cma::update_port`] found changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortUpdate {
    /// Files that got events.
    pub files: Vec<Fh>,
    /// The device went.
    pub removed: bool,
    /// Ids that got DEVICE_REMOVAL.
    pub removed_ids: usize,
    /// A device holds the GID again.
    pub arrived: bool,
    /// The GID's index, the netdev or its MTU changed on the same device.
    pub changed: bool,
    /// The address left the GID table.
    pub addr_gone: bool,
    /// The address is back in the GID table.
    pub addr_back: bool,
    /// Ids that got ADDR_CHANGE.
    pub addr_change_ids: usize,
}

/// Who wrote a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// The caller's user ID (ports below 1024 need root, as CAP_NET_BIND_SERVICE).
    pub uid: u32,
}

/// The kernel cma states an id goes through here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    Idle,
    AddrBound,
    /// Address resolution waits for the neighbour.
    AddrQuery,
    AddrResolved,
    RouteResolved,
    Connect,
    Disconnect,
    Listen,
    /// Its device went: DEVICE_REMOVAL was queued and the id closed, as ucma's
    /// `close_work`; every command but DESTROY_ID is ENXIO.
    Removed,
}

#[derive(Debug)]
struct Ctx {
    file: Fh,
    uid: u64,
    ps: u16,
    ud: bool,
    st: St,
    /// Bound (and, after resolution, local) address; its port is the id's port.
    src: Option<SocketAddr>,
    dst: Option<SocketAddr>,
    /// Bound to the VM's address (not a wildcard): QUERY_ROUTE names the device.
    has_dev: bool,
    route: bool,
    /// The (port space, port) this id holds in the bind table.
    port: Option<(u16, u16)>,
    cm: Option<CmId>,
    events_reported: u32,
    backlog: u32,
    tos: u8,
    /// The program set the TOS (else the port's `default_roce_tos` applies).
    tos_set: bool,
    reuseaddr: bool,
    afonly: bool,
    ack_timeout: Option<u8>,
    seq_num: u32,
    qkey: u32,
    /// The connection was established (ESTABLISHED reported, or the RTU sent).
    established: bool,
    /// The multicast joins of the id, in join order.
    joins: Vec<u32>,
    /// While address resolution waits: when its `timeout_ms` is up.
    query_deadline: Option<Time>,
}

/// A multicast join (the kernel's `ucma_multicast`).
#[derive(Debug)]
struct Join {
    /// The id that joined.
    ctx: u32,
    /// The IGMP membership the join holds.
    igmp: Option<Ipv4Addr>,
    /// Events of the join reported by GET_EVENT.
    events_reported: u32,
}

#[derive(Debug)]
struct Queued {
    /// The id whose `events_reported` counts it (the listener for CONNECT_REQUEST).
    ctx: u32,
    /// The new id a CONNECT_REQUEST announces.
    child: Option<u32>,
    /// The multicast join a MULTICAST_JOIN concerns.
    join: Option<u32>,
    resp: EventResp,
}

#[derive(Debug, Default)]
struct File {
    events: VecDeque<Queued>,
    /// Ids in creation order.
    ctxs: Vec<u32>,
    /// The poll handle to notify when an event arrives.
    poll_kh: Option<u64>,
}

/// What the service did, for `stat`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CmaStats {
    /// Commands by code (index `cmd::TABLE_LEN` counts unknown codes).
    pub commands: [u64; cmd::TABLE_LEN as usize + 1],
    /// Commands that failed, by code.
    pub errors: [u64; cmd::TABLE_LEN as usize + 1],
    /// Events queued, by type.
    pub events: [u64; event::COUNT],
    /// Events reported by GET_EVENT.
    pub events_reported: u64,
    /// Events dropped: of ids without a uid yet, or withdrawn by a destroy or a leave.
    pub events_dropped: u64,
    /// Requests refused because the listener's backlog was full.
    pub backlog_full: u64,
    /// Files opened and released.
    pub opens: u64,
    /// Files released.
    pub releases: u64,
    /// Ids destroyed by a file's release (the process exited or closed it).
    pub released_ids: u64,
    /// Multicast joins made.
    pub joins: u64,
    /// Multicast joins ended (LEAVE_MCAST, or their id's destroy).
    pub leaves: u64,
    /// Times the VM's RDMA device went (DEVICE_REMOVAL to the ids bound to it).
    pub device_removals: u64,
    /// Times a device holding the pvcm GID came after one went.
    pub device_arrivals: u64,
    /// Binds to another address of the VM, one the pvcm device does not serve
    /// (EADDRNOTAVAIL).
    pub other_addr_binds: u64,
}

/// The service's rdma_cm state: files, ids, bindings.
#[derive(Debug)]
pub struct Cma {
    /// The port the pvcm GID is on (the last one seen, while `attached` is false).
    port: RdmaPort,
    /// A registered device holds the port.
    attached: bool,
    /// Its GID table holds the pvcm GID (the VM has the address).
    addr_present: bool,
    /// The kernel's index of the device, when known.
    dev_index: Option<u32>,
    /// The port's netdev's link.
    link: Option<Link>,
    /// The VM's other RoCE v2 addresses (none the backend serves).
    other_addrs: BTreeSet<IpAddr>,
    files: BTreeMap<Fh, File>,
    next_fh: Fh,
    ctxs: BTreeMap<u32, Ctx>,
    free_ids: BTreeSet<u32>,
    next_id: u32,
    /// Agent handles of connections (and SIDR queries) to their id.
    by_cm: std::collections::HashMap<CmId, u32>,
    /// Agent listeners to the listening ids that share them: the listeners of one port space and port share one agent listener (its service ID),
    /// as the kernel's rdma_cm ids share one ib_cm listener.
    listeners: std::collections::HashMap<CmId, Vec<u32>>,
    binds: BTreeMap<(u16, u16), Vec<u32>>,
    ephemeral: BTreeMap<u16, EphemeralPorts>,
    rng: SplitMix64,
    stats: CmaStats,
    /// Multicast joins by their id (one table for the VM, as the kernel's).
    joins: BTreeMap<u32, Join>,
    free_join_ids: BTreeSet<u32>,
    next_join_id: u32,
    /// Joins holding each IGMP membership.
    igmp_users: BTreeMap<Ipv4Addr, u32>,
    membership: IgmpSockets,
    /// The network address resolution asks ([`Netlink`] in the service).
    net: Box<dyn Lookup>,
    /// Ids whose address resolution waits.
    querying: BTreeSet<u32>,
}

/// The agent and the time a command runs at.
#[derive(Debug)]
pub struct Env<'a> {
    /// The CM agent.
    pub agent: &'a mut Agent,
    /// Now.
    pub now: Time,
}

fn cm_errno(e: CmError) -> i32 {
    match e {
        CmError::NoResources => errno::ENOMEM,
        CmError::ServiceIdInUse(_) => errno::EADDRINUSE,
        CmError::InvalidState(State::Established) => errno::EISCONN,
        _ => errno::EINVAL,
    }
}

/// A JOIN's group in a family the kernel's RoCE join refuses (AF_IB: `-ENOTSUPP`).
fn join_errno(e: AbiError) -> i32 {
    match e {
        AbiError::AfIb => errno::EOPNOTSUPP,
        e => abi_errno(e),
    }
}

fn abi_errno(e: AbiError) -> i32 {
    match e {
        AbiError::AfIb => errno::EAFNOSUPPORT,
        AbiError::Short { .. } | AbiError::BadAddr => errno::EINVAL,
    }
}

fn ip_gid(a: IpAddr) -> Gid {
    match a {
        IpAddr::V4(v) => Gid::from_ipv4(v),
        IpAddr::V6(v) => Gid(v.octets()),
    }
}

fn gid_ip(g: Gid) -> IpAddr {
    match g.to_ipv4() {
        Some(v) => IpAddr::V4(v),
        None => IpAddr::V6(Ipv6Addr::from(g.0)),
    }
}

fn unspecified(family_of: &SocketAddr) -> IpAddr {
    match family_of {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

impl Cma {
    /// The layer for the VM's RDMA port; `seed` seeds the starting PSNs and ephemeral
    /// ports. Multicast memberships are sockets on the port's netdev ([`IgmpSockets`]);
    /// address resolution asks the VM's network through rtnetlink ([`Netlink`]).
    pub fn new(port: RdmaPort, seed: u64) -> Cma {
        Cma::with_lookup(port, seed, Box::new(Netlink::new()))
    }

    /// [`Cma::new`] with address resolution asking `net`.
    pub fn with_lookup(port: RdmaPort, seed: u64, net: Box<dyn Lookup>) -> Cma {
        let membership = IgmpSockets::new(&port.netdev);
        Cma {
            port,
            attached: true,
            addr_present: true,
            dev_index: None,
            link: None,
            other_addrs: BTreeSet::new(),
            files: BTreeMap::new(),
            next_fh: 1,
            ctxs: BTreeMap::new(),
            free_ids: BTreeSet::new(),
            next_id: 0,
            by_cm: std::collections::HashMap::new(),
            listeners: std::collections::HashMap::new(),
            binds: BTreeMap::new(),
            ephemeral: BTreeMap::new(),
            rng: SplitMix64::new(seed),
            stats: CmaStats::default(),
            joins: BTreeMap::new(),
            free_join_ids: BTreeSet::new(),
            next_join_id: 0,
            igmp_users: BTreeMap::new(),
            membership,
            net,
            querying: BTreeSet::new(),
        }
    }

    /// Live multicast joins.
    pub fn joins(&self) -> usize {
        self.joins.len()
    }

    /// The IGMP memberships held.
    pub fn igmp_groups(&self) -> Vec<Ipv4Addr> {
        self.membership.groups()
    }

    /// The port it serves.
    pub fn port(&self) -> &RdmaPort {
        &self.port
    }

    /// Counters.
    pub fn stats(&self) -> &CmaStats {
        &self.stats
    }

    /// Open files.
    pub fn files(&self) -> usize {
        self.files.len()
    }

    /// Live ids.
    pub fn ids(&self) -> usize {
        self.ctxs.len()
    }

    /// Ids listening (LISTEN done, not destroyed); the listeners of one port share one
    /// agent listener.
    pub fn listening(&self) -> usize {
        self.ctxs.values().filter(|c| c.st == St::Listen).count()
    }

    /// Opens a file.
    pub fn open(&mut self) -> Fh {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.files.insert(fh, File::default());
        self.stats.opens += 1;
        fh
    }

    /// The file that holds id `id`.
    pub fn file_of(&self, id: u32) -> Option<Fh> {
        self.ctxs.get(&id).map(|c| c.file)
    }

    /// Whether `fh` is an open file.
    pub fn is_open(&self, fh: Fh) -> bool {
        self.files.contains_key(&fh)
    }

    /// Whether `fh` has events queued (`poll()`'s POLLIN).
    pub fn has_events(&self, fh: Fh) -> bool {
        self.files.get(&fh).is_some_and(|f| !f.events.is_empty())
    }

    /// Remembers the poll handle to wake when `fh` gets an event.
    pub fn set_poll_handle(&mut self, fh: Fh, kh: u64) {
        if let Some(f) = self.files.get_mut(&fh) {
            f.poll_kh = Some(kh);
        }
    }

    /// The poll handle of `fh`, taken (a wakeup is sent once; the next poll arms it).
    pub fn take_poll_handle(&mut self, fh: Fh) -> Option<u64> {
        self.files.get_mut(&fh).and_then(|f| f.poll_kh.take())
    }

    /// Every armed poll handle, taken (the service stops: every poller is woken).
    pub fn take_poll_handles(&mut self) -> Vec<u64> {
        self.files
            .values_mut()
            .filter_map(|f| f.poll_kh.take())
            .collect()
    }

    /// Releases a file: every id it holds is destroyed (see the module docs).
    pub fn release(&mut self, fh: Fh, env: &mut Env<'_>) {
        let Some(f) = self.files.get(&fh) else { return };
        let ids = f.ctxs.clone();
        // The agent destroys the file's handles together: a connect of this process
        // still queued for its destination's window must not go out because another
        // of its connections freed a slot a moment before its own destroy.
        let mut handles = Vec::new();
        for id in ids {
            if self.ctxs.contains_key(&id) {
                self.destroy_ctx_into(id, &mut handles);
                self.stats.released_ids += 1;
            }
        }
        env.agent.destroy_all(&handles, env.now);
        self.files.remove(&fh);
        self.stats.releases += 1;
    }

    /// Releases every open file, as the kernel's `ucma_close` would for each when the
    /// service stops: their connections get their DREQs (REJs for those not yet
    /// established) from the agent, not from a peer's timeout. Returns the files.
    pub fn release_all(&mut self, env: &mut Env<'_>) -> Vec<Fh> {
        let fhs: Vec<Fh> = self.files.keys().copied().collect();
        for &fh in &fhs {
            self.release(fh, env);
        }
        fhs
    }

    // ------------------------------------------------------------ ids

    fn alloc_id(&mut self) -> u32 {
        if let Some(id) = self.free_ids.pop_first() {
            return id;
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    fn new_ctx(&mut self, file: Fh, uid: u64, ps: u16, ud: bool) -> u32 {
        let id = self.alloc_id();
        let seq_num = self.rng.next_u32() & 0x00FF_FFFF;
        self.ctxs.insert(
            id,
            Ctx {
                file,
                uid,
                ps,
                ud,
                st: St::Idle,
                src: None,
                dst: None,
                has_dev: false,
                route: false,
                port: None,
                cm: None,
                events_reported: 0,
                backlog: 0,
                tos: 0,
                tos_set: false,
                reuseaddr: false,
                afonly: false,
                ack_timeout: None,
                seq_num,
                qkey: if ud { RDMA_UDP_QKEY } else { 0 },
                established: false,
                joins: Vec::new(),
                query_deadline: None,
            },
        );
        if let Some(f) = self.files.get_mut(&file) {
            f.ctxs.push(id);
        }
        id
    }

    /// The id `id` of file `fh` (kernel `ucma_get_ctx`): ENXIO once its device went.
    fn ctx_of(&self, fh: Fh, id: u32) -> Result<&Ctx, i32> {
        match self.ctx_in(fh, id)? {
            c if c.st == St::Removed => Err(errno::ENXIO),
            c => Ok(c),
        }
    }

    /// The id `id` of file `fh`, closed or not (DESTROY_ID's lookup).
    fn ctx_in(&self, fh: Fh, id: u32) -> Result<&Ctx, i32> {
        match self.ctxs.get(&id) {
            None => Err(errno::ENOENT),
            Some(c) if c.file != fh => Err(errno::EINVAL),
            Some(c) => Ok(c),
        }
    }

    /// As [`Cma::ctx_of`], and the id must have a device (`ucma_get_ctx_dev`).
    fn ctx_dev(&self, fh: Fh, id: u32) -> Result<&Ctx, i32> {
        let c = self.ctx_of(fh, id)?;
        if c.has_dev { Ok(c) } else { Err(errno::EINVAL) }
    }

    fn ctx_mut(&mut self, id: u32) -> Result<&mut Ctx, i32> {
        self.ctxs.get_mut(&id).ok_or(errno::ENOENT)
    }

    /// Destroys an id: its agent handle, its binding, its unreported events (and the
    /// unreported connections of a listener); returns its `events_reported`.
    fn destroy_ctx(&mut self, id: u32, env: &mut Env<'_>) -> u32 {
        let mut handles = Vec::new();
        let n = self.destroy_ctx_into(id, &mut handles);
        env.agent.destroy_all(&handles, env.now);
        n
    }

    /// [`Cma::destroy_ctx`], leaving the agent handles to destroy in `handles`.
    fn destroy_ctx_into(&mut self, id: u32, handles: &mut Vec<CmId>) -> u32 {
        let Some(c) = self.ctxs.remove(&id) else {
            return 0;
        };
        let mut children = Vec::new();
        if let Some(f) = self.files.get_mut(&c.file) {
            f.ctxs.retain(|&x| x != id);
            let before = f.events.len();
            f.events.retain(|q| {
                if q.ctx != id {
                    return true;
                }
                if let Some(ch) = q.child {
                    children.push(ch);
                }
                false
            });
            self.stats.events_dropped += (before - f.events.len()) as u64;
        }
        if let Some(cm) = c.cm {
            self.release_cm(id, cm, handles);
        }
        for j in &c.joins {
            self.end_join(*j);
        }
        self.querying.remove(&id);
        self.unbind(id, c.port);
        self.free_ids.insert(id);
        for ch in children {
            self.destroy_ctx_into(ch, handles);
        }
        c.events_reported
    }

    /// Lets go of id `id`'s agent handle `cm`: a connection's goes to `handles` to be
    /// destroyed; a shared agent listener only with the last id listening on it.
    fn release_cm(&mut self, id: u32, cm: CmId, handles: &mut Vec<CmId>) {
        if let Some(ids) = self.listeners.get_mut(&cm) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.listeners.remove(&cm);
                handles.push(cm);
            }
            return;
        }
        self.by_cm.remove(&cm);
        handles.push(cm);
    }

    /// The agent listener the ids listening on `key` (port space, port) share, if one
    /// listens.
    fn agent_listener(&self, key: (u16, u16)) -> Option<CmId> {
        self.binds
            .get(&key)?
            .iter()
            .filter_map(|o| self.ctxs.get(o))
            .filter(|c| c.st == St::Listen)
            .find_map(|c| c.cm)
    }

    // ------------------------------------------------------------ binding

    fn ephemeral(&mut self, ps: u16) -> &mut EphemeralPorts {
        let seed = self.rng.next_u64();
        self.ephemeral
            .entry(ps)
            .or_insert_with(|| EphemeralPorts::new(seed))
    }

    fn unbind(&mut self, id: u32, port: Option<(u16, u16)>) {
        let Some(key) = port else { return };
        if let Some(v) = self.binds.get_mut(&key) {
            v.retain(|&x| x != id);
            if v.is_empty() {
                self.binds.remove(&key);
                if let Some(e) = self.ephemeral.get_mut(&key.0) {
                    e.release(key.1);
                }
            }
        }
    }

    /// Kernel `cma_check_port`: may `id` (bound to `addr`) share `key` with its owners?
    fn check_port(&self, id: u32, key: (u16, u16), addr: IpAddr, reuse: bool) -> Result<(), i32> {
        let Some(owners) = self.binds.get(&key) else {
            return Ok(());
        };
        let me = self.ctxs.get(&id);
        for &o in owners {
            if o == id {
                continue;
            }
            let Some(cur) = self.ctxs.get(&o) else {
                continue;
            };
            if reuse && cur.reuseaddr {
                continue;
            }
            let cur_addr = cur.src.map(|s| s.ip()).unwrap_or(addr);
            if me.is_some_and(|m| m.afonly && cur.afonly) && addr.is_ipv4() != cur_addr.is_ipv4() {
                continue;
            }
            if addr.is_unspecified() || cur_addr.is_unspecified() {
                return Err(errno::EADDRNOTAVAIL);
            }
            if addr == cur_addr {
                return Err(errno::EADDRINUSE);
            }
        }
        Ok(())
    }

    /// Kernel `rdma_bind_addr` for an IDLE id: the address must be a wildcard or one of
    /// the VM's served addresses; port 0 takes an ephemeral one.
    fn bind_addr(&mut self, id: u32, addr: SocketAddr, caller: Caller) -> Result<(), i32> {
        let ip = addr.ip();
        let served = self.port.served_addr(ip);
        let own = served.is_some();
        let has_dev = if ip.is_unspecified() {
            false
        } else if own {
            self.check_device()?;
            true
        } else if ip.is_loopback() && self.is_local(ip) {
            // The kernel binds a loopback address to any device (`cma_bind_loopback`).
            true
        } else {
            if self.other_addrs.contains(&ip) {
                self.stats.other_addr_binds += 1;
                let served: Vec<String> = self.port.served().map(|s| s.addr.to_string()).collect();
                tracing::warn!(
                    addr = %ip,
                    served = %served.join(" "),
                    "bind to another address of the VM: the backend does not serve it for \
                     this VM (only the GIDs the pvcm device reports bind: EADDRNOTAVAIL; \
                     give the VM this GID too, gid= on the backend)"
                );
            }
            return Err(errno::EADDRNOTAVAIL);
        };
        let (ps, reuse) = {
            let c = self.ctxs.get(&id).ok_or(errno::ENOENT)?;
            if c.st != St::Idle {
                return Err(errno::EINVAL);
            }
            (c.ps, c.reuseaddr)
        };
        let port = match addr.port() {
            0 => {
                let mut tries = 0;
                loop {
                    let p = self.ephemeral(ps).alloc().ok_or(errno::EADDRNOTAVAIL)?;
                    if !self.binds.contains_key(&(ps, p)) {
                        break p;
                    }
                    tries += 1;
                    if tries > 64 {
                        return Err(errno::EADDRNOTAVAIL);
                    }
                }
            }
            p => {
                if p < 1024 && caller.uid != 0 {
                    return Err(libc::EACCES);
                }
                self.check_port(id, (ps, p), ip, reuse)?;
                p
            }
        };
        self.binds.entry((ps, port)).or_default().push(id);
        let c = self.ctx_mut(id)?;
        c.port = Some((ps, port));
        c.src = Some(SocketAddr::new(served.map_or(ip, |s| s.addr), port));
        c.has_dev = has_dev;
        c.st = St::AddrBound;
        Ok(())
    }

    /// Whether the VM's address has a device now: ENODEV while no registered device
    /// holds the port (the kernel's `cma_acquire_dev_by_src_ip` finding none),
    /// EADDRNOTAVAIL while its GID table lacks the address (the VM no longer has it).
    fn check_device(&self) -> Result<(), i32> {
        if !self.attached {
            Err(errno::ENODEV)
        } else if !self.addr_present {
            Err(errno::EADDRNOTAVAIL)
        } else {
            Ok(())
        }
    }

    // ------------------------------------------------------------ the device

    /// Follows the VM's RDMA device as `view` shows it now, as the kernel's cma follows
    /// its devices and netdevs:
    /// - the device that held the port is no longer registered, was registered again
    ///   (another index), or another device holds the GID now: every id bound to it
    ///   gets DEVICE_REMOVAL and is closed (`cma_process_remove`, ucma's
    ///   `close_work`); ids bound to a wildcard address stay (a listener's per-device
    ///   child goes silently in the kernel);
    /// - a device holds the GID again: new ids use it (`cma_add_one`);
    /// - the GID table no longer has the address (it was taken off the netdev): binds
    ///   to it are EADDRNOTAVAIL, requests are refused, bound ids stay, with no event,
    ///   as the kernel's;
    /// - the GID's table index, the netdev or its MTU changed: routes from now on use
    ///   the new values;
    /// - the netdev is a bond whose hardware address changed (a failover): the ids
    ///   bound to the device get ADDR_CHANGE (`cma_netdev_callback`,
    ///   `cma_ndev_work_handler`).
    ///
    /// Returns what changed, with the files that got events.
    pub fn update_port(&mut self, view: &PortView, env: &mut Env<'_>) -> PortUpdate {
        let mut u = PortUpdate::default();
        let gone = self.attached
            && (!view.devices.contains(&self.port.device)
                || view.port.as_ref().is_some_and(|p| {
                    p.device != self.port.device || p.node_guid != self.port.node_guid
                })
                || matches!((self.dev_index, view.index), (Some(a), Some(b)) if a != b));
        if gone {
            u.removed_ids = self.remove_device(&mut u.files, env);
            self.stats.device_removals += 1;
            self.attached = false;
            self.link = None;
            u.removed = true;
        }
        match &view.port {
            Some(p) => {
                let new = RdmaPort {
                    default_roce_tos: self.port.default_roce_tos,
                    ..p.clone()
                };
                if !self.attached {
                    self.attached = true;
                    self.stats.device_arrivals += 1;
                    u.arrived = true;
                } else if new != self.port {
                    u.changed = true;
                }
                u.addr_back = !self.addr_present;
                self.addr_present = true;
                self.port = new;
                self.dev_index = view.index;
                // Memberships follow the port's netdev once none is held there.
                if self.membership.netdev() != self.port.netdev && self.igmp_users.is_empty() {
                    self.membership = IgmpSockets::new(&self.port.netdev);
                }
            }
            None => {
                u.addr_gone = self.attached && self.addr_present;
                if self.attached {
                    self.addr_present = false;
                }
            }
        }
        if self.attached {
            let failover = matches!((&self.link, &view.link),
                (Some(old), Some(new)) if new.bond && old.hw_addr != new.hw_addr);
            if failover {
                u.addr_change_ids = self.addr_change(&mut u.files);
            }
            if view.link.is_some() {
                self.link.clone_from(&view.link);
            }
        }
        self.other_addrs.clone_from(&view.other_addrs);
        u.files.sort_unstable();
        u.files.dedup();
        u
    }

    /// The ids bound to the device, in id order.
    fn device_ids(&self) -> Vec<u32> {
        self.ctxs
            .iter()
            .filter(|(_, c)| c.has_dev && c.st != St::Removed)
            .map(|(&id, _)| id)
            .collect()
    }

    /// DEVICE_REMOVAL to each id bound to the device, which is then closed: its agent
    /// handle destroyed (a listener stops, a connection gets its DREQ or REJ), its
    /// joins and its port released. Returns how many.
    fn remove_device(&mut self, files: &mut Vec<Fh>, env: &mut Env<'_>) -> usize {
        let ids = self.device_ids();
        let mut handles = Vec::new();
        for &id in &ids {
            let p = self.empty_param(id);
            files.extend(self.emit(id, event::DEVICE_REMOVAL, 0, p));
            let Some(c) = self.ctxs.get_mut(&id) else {
                continue;
            };
            c.st = St::Removed;
            let (cm, joins, port) = (c.cm.take(), std::mem::take(&mut c.joins), c.port.take());
            if let Some(cm) = cm {
                self.release_cm(id, cm, &mut handles);
            }
            for j in joins {
                self.end_join(j);
            }
            self.unbind(id, port);
        }
        env.agent.destroy_all(&handles, env.now);
        ids.len()
    }

    /// ADDR_CHANGE to each id bound to the device; returns how many.
    fn addr_change(&mut self, files: &mut Vec<Fh>) -> usize {
        let ids = self.device_ids();
        for &id in &ids {
            let p = self.empty_param(id);
            files.extend(self.emit(id, event::ADDR_CHANGE, 0, p));
        }
        ids.len()
    }

    /// Whether a device holds the pvcm GID now.
    pub fn attached(&self) -> bool {
        self.attached
    }

    /// The VM's other RoCE v2 addresses, which do not bind.
    pub fn other_addrs(&self) -> &BTreeSet<IpAddr> {
        &self.other_addrs
    }

    /// Whether the device's GID table holds the pvcm GID's address now.
    pub fn addr_present(&self) -> bool {
        self.attached && self.addr_present
    }

    /// Whether `ip` is one of the VM's local addresses (its route is `RTN_LOCAL`: the
    /// loopback's, another NIC's), which the kernel's `rdma_translate_ip()` accepts.
    fn is_local(&mut self, ip: IpAddr) -> bool {
        self.net
            .route(ip, None)
            .is_ok_and(|r| r.kind == neigh::RTN_LOCAL)
    }

    // ------------------------------------------------------------ events

    fn queue(&mut self, ctx: u32, child: Option<u32>, resp: EventResp) -> Option<Fh> {
        let file = self.ctxs.get(&ctx)?.file;
        let f = self.files.get_mut(&file)?;
        if let Some(n) = self.stats.events.get_mut(resp.event as usize) {
            *n += 1;
        }
        f.events.push_back(Queued {
            ctx,
            child,
            join: None,
            resp,
        });
        Some(file)
    }

    /// Queues an event of id `ctx` (dropped while the id has no uid: a new connection
    /// before ACCEPT, as the kernel drops them); returns the file that got it.
    fn emit(&mut self, ctx: u32, ev: u32, status: i32, param: EventParam) -> Option<Fh> {
        let uid = self.ctxs.get(&ctx)?.uid;
        if uid == 0 {
            self.stats.events_dropped += 1;
            return None;
        }
        self.queue(
            ctx,
            None,
            EventResp {
                uid,
                id: ctx,
                event: ev,
                status,
                param,
                ece: Ece::default(),
            },
        )
    }

    fn empty_param(&self, ctx: u32) -> EventParam {
        if self.ctxs.get(&ctx).is_some_and(|c| c.ud) {
            EventParam::Ud(UdParam {
                qp_num: 0,
                qkey: 0,
                ah_attr: AhAttr::default(),
                private_data: Vec::new(),
            })
        } else {
            EventParam::Conn(ConnParam::empty())
        }
    }

    /// Fills a waiting GET_EVENT of file `fh` with its next event: `None` if it has none
    /// (the caller keeps waiting); `Some(Err(EFAULT))` if the caller's buffer could not
    /// be written (the event stays queued).
    pub fn deliver(
        &mut self,
        fh: Fh,
        response: u64,
        out_len: u16,
        mem: &mut dyn CallerMemory,
    ) -> Option<Result<(), i32>> {
        let f = self.files.get_mut(&fh)?;
        let head = f.events.front()?;
        let bytes = head.resp.to_bytes();
        let n = usize::from(out_len).min(EventResp::LEN);
        if let Err(e) = mem.write(response, &bytes[..n]) {
            return Some(Err(e));
        }
        let q = f.events.pop_front()?;
        self.stats.events_reported += 1;
        if let Some(c) = self.ctxs.get_mut(&q.ctx) {
            c.events_reported += 1;
            if q.child.is_some() {
                c.backlog += 1;
            }
        }
        if let Some(j) = q.join.and_then(|j| self.joins.get_mut(&j)) {
            j.events_reported += 1;
        }
        Some(Ok(()))
    }

    /// Answers a waiting GET_EVENT with the restart event ([`EventResp::restart`])
    /// instead of an event: a signal interrupted it and the caller will issue it again.
    /// No event is taken or counted as reported; an unwritable buffer is EFAULT.
    pub fn restart(
        &self,
        response: u64,
        out_len: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        let bytes = EventResp::restart().to_bytes();
        let n = usize::from(out_len).min(EventResp::LEN);
        mem.write(response, &bytes[..n])
    }

    /// Routes one of the agent's events to the id it concerns; returns the file that
    /// got an rdma_cm event, if one did.
    pub fn on_agent_event(&mut self, ev: Event, env: &mut Env<'_>) -> Option<Fh> {
        match ev {
            Event::ConnectRequest {
                id,
                listen_id,
                private_data,
                ..
            } => self.on_request(id, listen_id, &private_data, false, env),
            Event::SidrRequest {
                id,
                listen_id,
                private_data,
                ..
            } => self.on_request(id, listen_id, &private_data, true, env),
            Event::ConnectResponse {
                id,
                remote_qpn,
                private_data,
            } => {
                let ctx = *self.by_cm.get(&id)?;
                let qp = env.agent.qp_params(id).unwrap_or_default();
                let p = ConnParam {
                    qp_num: remote_qpn,
                    qkey: 0,
                    private_data: padded(&private_data, PD_REP),
                    srq: qp.peer_srq,
                    responder_resources: qp.responder_resources,
                    initiator_depth: qp.initiator_depth,
                    flow_control: qp.peer_flow_control,
                    retry_count: 0,
                    rnr_retry_count: qp.rnr_retry_count,
                    valid: false,
                };
                self.emit(ctx, event::CONNECT_RESPONSE, 0, EventParam::Conn(p))
            }
            Event::Established { id, .. } => {
                let ctx = *self.by_cm.get(&id)?;
                if let Some(c) = self.ctxs.get_mut(&ctx) {
                    c.established = true;
                }
                let p = self.empty_param(ctx);
                self.emit(ctx, event::ESTABLISHED, 0, p)
            }
            Event::Rejected {
                id,
                reason,
                private_data,
                ..
            } => {
                let ctx = *self.by_cm.get(&id)?;
                let p = ConnParam {
                    private_data: padded(&private_data, PD_REJ),
                    ..ConnParam::empty()
                };
                self.emit(
                    ctx,
                    event::REJECTED,
                    i32::from(rej_code(reason)),
                    EventParam::Conn(p),
                )
            }
            Event::Unreachable { id } => {
                let ctx = *self.by_cm.get(&id)?;
                let p = self.empty_param(ctx);
                self.emit(ctx, event::UNREACHABLE, -errno::ETIMEDOUT, p)
            }
            Event::Disconnected { id } => {
                let ctx = *self.by_cm.get(&id)?;
                let c = self.ctxs.get_mut(&ctx)?;
                // Once per connection, as cma.c's CONNECT -> DISCONNECT transition.
                if c.st != St::Connect {
                    return None;
                }
                c.st = St::Disconnect;
                let p = self.empty_param(ctx);
                // cma_ib_handler(): IB_CM_DREQ_ERROR is DISCONNECTED with -ETIMEDOUT.
                let status = if env.agent.disconnect_timed_out(id) {
                    -errno::ETIMEDOUT
                } else {
                    0
                };
                self.emit(ctx, event::DISCONNECTED, status, p)
            }
            Event::TimewaitExit { id } => {
                let ctx = *self.by_cm.get(&id)?;
                let p = self.empty_param(ctx);
                self.emit(ctx, event::TIMEWAIT_EXIT, 0, p)
            }
            Event::SidrResolved {
                id,
                status,
                qpn,
                qkey,
                private_data,
            } => {
                let ctx = *self.by_cm.get(&id)?;
                let c = self.ctxs.get(&ctx)?;
                if status != SidrStatus::Success {
                    let p = self.empty_param(ctx);
                    return self.emit(ctx, event::UNREACHABLE, sidr_code(status), p);
                }
                if qkey != c.qkey {
                    let p = self.empty_param(ctx);
                    return self.emit(ctx, event::ADDR_ERROR, -errno::EINVAL, p);
                }
                let p = UdParam {
                    qp_num: qpn,
                    qkey,
                    ah_attr: self.route_ah(c),
                    private_data: padded(&private_data, PD_SIDR_REP),
                };
                self.emit(ctx, event::ESTABLISHED, 0, EventParam::Ud(p))
            }
        }
    }

    /// A REQ or SIDR_REQ for an agent listener: the new id, in the file of the rdma_cm
    /// listener it is for ([`Cma::find_listener`]), and its CONNECT_REQUEST; refused
    /// (the CM rejects it: REJ(CONSUMER_DEFINED), SIDR_REP(REJECT), as the kernel's CM
    /// when `cma_req_handler` fails) when no listener of the port matches, its backlog
    /// is full, or the private data is not an rdma_cm header.
    fn on_request(
        &mut self,
        conn: CmId,
        listen: CmId,
        private_data: &[u8],
        ud: bool,
        env: &mut Env<'_>,
    ) -> Option<Fh> {
        let refuse = |env: &mut Env<'_>| {
            let _ = env.agent.destroy(conn, env.now);
            None
        };
        if !self.listeners.contains_key(&listen) {
            return refuse(env);
        }
        // No device, or no address on it: nothing could carry the connection.
        if self.check_device().is_err() {
            return refuse(env);
        }
        let Ok((hdr, user)) = rdma_cm::split_private_data(private_data) else {
            return refuse(env);
        };
        let qp = env.agent.qp_params(conn).unwrap_or_default();
        // The served address the request came for: its rdma_cm header's destination
        // (the kernel matches listeners by it), else the REQ's primary GID on this side
        // (which the agent admitted as one of the VM's), else the primary (a SIDR_REQ
        // names no GID).
        let local = self
            .port
            .served_addr(hdr.dst)
            .or_else(|| self.port.served().find(|s| s.gid == qp.path.local_gid))
            .unwrap_or_else(|| self.port.primary());
        let Some(lctx) = self.find_listener(listen, local.gid, hdr.dst.is_ipv4()) else {
            return refuse(env);
        };
        let (file, lps, luid, lport, backlog, ltos) = match self.ctxs.get(&lctx) {
            Some(l) => (
                l.file,
                l.ps,
                l.uid,
                l.src.map_or(0, |s| s.port()),
                l.backlog,
                self.tos(l),
            ),
            None => return refuse(env),
        };
        if backlog == 0 {
            self.stats.backlog_full += 1;
            return refuse(env);
        }
        let child = self.new_ctx(file, 0, lps, ud);
        {
            let c = self.ctxs.get_mut(&child)?;
            c.st = St::Connect;
            c.has_dev = true;
            c.route = true;
            c.cm = Some(conn);
            c.src = Some(SocketAddr::new(local.addr, lport));
            c.dst = Some(SocketAddr::new(hdr.src, hdr.src_port));
            // The request's path gives a connection's; a UD id takes its listener's.
            c.tos = if ud { ltos } else { qp.path.traffic_class };
            c.tos_set = true;
        }
        self.by_cm.insert(conn, child);
        if let Some(l) = self.ctxs.get_mut(&lctx) {
            l.backlog -= 1;
        }
        let param = if ud {
            EventParam::Ud(UdParam {
                qp_num: 0,
                qkey: 0,
                ah_attr: AhAttr::default(),
                private_data: padded(user, PD_SIDR_REQ - rdma_cm::CMA_HDR_LEN),
            })
        } else {
            EventParam::Conn(ConnParam {
                qp_num: qp.remote_qpn,
                qkey: 0,
                private_data: padded(user, PD_REQ - rdma_cm::CMA_HDR_LEN),
                srq: qp.peer_srq,
                responder_resources: qp.responder_resources,
                initiator_depth: qp.initiator_depth,
                flow_control: qp.peer_flow_control,
                retry_count: qp.retry_count,
                rnr_retry_count: qp.rnr_retry_count,
                valid: false,
            })
        };
        self.queue(
            lctx,
            Some(child),
            EventResp {
                uid: luid,
                id: child,
                event: event::CONNECT_REQUEST,
                status: 0,
                param,
                ece: Ece::default(),
            },
        )
    }

    /// The rdma_cm listener sharing agent listener `listen` that a request for the
    /// served address of GID `local` (IPv4 or not, as its rdma_cm header) is for, as the
    /// kernel's `cma_find_listener` matches the header's destination: one bound to that
    /// address, else one bound to a wildcard (an AFONLY one only for its own family).
    /// One bound to another address (another served one, 127.0.0.1) takes none.
    fn find_listener(&self, listen: CmId, local: Gid, ipv4: bool) -> Option<u32> {
        let ids = self.listeners.get(&listen)?;
        let listening = || {
            ids.iter()
                .filter_map(|&id| Some((id, self.ctxs.get(&id)?)))
                .filter(|(_, c)| c.st == St::Listen)
        };
        let bound = |c: &Ctx| c.src.map(|s| s.ip()).filter(|ip| !ip.is_unspecified());
        listening()
            .find(|(_, c)| {
                bound(c).is_some_and(|ip| {
                    ip.is_ipv4() == ipv4
                        && self.port.served_addr(ip).is_some_and(|b| b.gid == local)
                })
            })
            .or_else(|| {
                listening().find(|(_, c)| {
                    bound(c).is_none()
                        && (!c.afonly || c.src.is_none_or(|s| s.ip().is_ipv4() == ipv4))
                })
            })
            .map(|(id, _)| id)
    }

    // ------------------------------------------------------------ multicast

    /// JOIN_IP_MCAST and JOIN_MCAST (kernel `ucma_process_join`, `rdma_join_multicast`,
    /// `cma_iboe_join_multicast`): the join's id goes to the caller, its MULTICAST_JOIN
    /// event to the id's file.
    fn join(
        &mut self,
        fh: Fh,
        j: JoinMcast,
        out: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        if usize::from(out) < 4 {
            return Err(errno::ENOSPC);
        }
        // RDMA_MC_JOIN_FLAG_FULLMEMBER, RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER.
        let send_only = match j.join_flags {
            0 => false,
            1 => true,
            _ => return Err(errno::EINVAL),
        };
        let c = self.ctx_dev(fh, j.id)?;
        if !matches!(c.st, St::AddrBound | St::AddrResolved) || !c.ud {
            return Err(errno::EINVAL);
        }
        if j.addr.ip().is_unspecified() {
            return Err(errno::EINVAL);
        }
        let IpAddr::V4(group) = j.addr.ip() else {
            // A RoCE v2 port joins IPv4 groups only.
            return Err(errno::EOPNOTSUPP);
        };
        if self.port.path_mtu == 0 {
            return Err(errno::EINVAL);
        }
        let file = c.file;
        let sgid_index = self.port.index_of(self.src_gid(c.src));
        let held = self.files.get(&file).map_or(0, |f| {
            f.ctxs
                .iter()
                .filter_map(|i| self.ctxs.get(i))
                .map(|c| c.joins.len())
                .sum::<usize>()
        });
        if held >= MAX_JOINS_PER_FILE {
            return Err(errno::ENOMEM);
        }
        let igmp = if send_only {
            None
        } else {
            self.take_igmp(group)?;
            Some(group)
        };
        let jid = self.alloc_join_id();
        self.joins.insert(
            jid,
            Join {
                ctx: j.id,
                igmp,
                events_reported: 0,
            },
        );
        self.stats.joins += 1;
        if let Err(e) = mem.write(j.response, &jid.to_le_bytes()) {
            self.end_join(jid);
            return Err(e);
        }
        let c = self.ctx_mut(j.id)?;
        c.joins.push(jid);
        let (uid, qkey) = (c.uid, c.qkey);
        if uid == 0 {
            // The kernel drops the events of an id without a uid.
            self.stats.events_dropped += 1;
            return Ok(());
        }
        let param = UdParam {
            qp_num: MCAST_QPN,
            qkey,
            ah_attr: AhAttr {
                dgid: Gid::from_ipv4(group).0,
                flow_label: 0,
                sgid_index,
                hop_limit: MCAST_HOP_LIMIT,
                traffic_class: 0,
                dlid: 0,
                sl: 0,
                static_rate: 0,
                is_global: true,
                port_num: self.port.port_num,
            },
            private_data: Vec::new(),
        };
        let resp = EventResp {
            uid: j.uid,
            id: jid,
            event: event::MULTICAST_JOIN,
            status: 0,
            param: EventParam::Ud(param),
            ece: Ece::default(),
        };
        if let Some(n) = self.stats.events.get_mut(event::MULTICAST_JOIN as usize) {
            *n += 1;
        }
        if let Some(f) = self.files.get_mut(&file) {
            f.events.push_back(Queued {
                ctx: j.id,
                child: None,
                join: Some(jid),
                resp,
            });
        }
        Ok(())
    }

    /// LEAVE_MCAST (kernel `ucma_leave_multicast`): ends the join, withdraws its
    /// unreported events and answers its `events_reported`.
    fn leave(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        if usize::from(out) < 4 {
            return Err(errno::ENOSPC);
        }
        let d = DestroyId::parse(body).map_err(abi_errno)?;
        let j = self.joins.get(&d.id).ok_or(errno::ENOENT)?;
        if self.ctxs.get(&j.ctx).map(|c| c.file) != Some(fh) {
            return Err(errno::EINVAL);
        }
        let ctx = j.ctx;
        if let Some(c) = self.ctxs.get_mut(&ctx) {
            c.joins.retain(|&x| x != d.id);
        }
        if let Some(f) = self.files.get_mut(&fh) {
            let before = f.events.len();
            f.events.retain(|q| q.join != Some(d.id));
            self.stats.events_dropped += (before - f.events.len()) as u64;
        }
        let n = self.end_join(d.id);
        mem.write(d.response, &n.to_le_bytes())
    }

    fn alloc_join_id(&mut self) -> u32 {
        if let Some(id) = self.free_join_ids.pop_first() {
            return id;
        }
        let id = self.next_join_id;
        self.next_join_id = self.next_join_id.wrapping_add(1);
        id
    }

    /// Ends join `jid` (its membership, its id); returns its `events_reported`. Its id's
    /// list and queued events are the caller's to clean.
    fn end_join(&mut self, jid: u32) -> u32 {
        let Some(j) = self.joins.remove(&jid) else {
            return 0;
        };
        if let Some(g) = j.igmp {
            self.drop_igmp(g);
        }
        self.free_join_ids.insert(jid);
        self.stats.leaves += 1;
        j.events_reported
    }

    /// Counts a join of `group`, taking the membership for the first.
    fn take_igmp(&mut self, group: Ipv4Addr) -> Result<(), i32> {
        if let Some(n) = self.igmp_users.get_mut(&group) {
            *n += 1;
            return Ok(());
        }
        self.membership.join(group).map_err(|e| e.errno())?;
        self.igmp_users.insert(group, 1);
        Ok(())
    }

    /// Ends a join of `group`, leaving the membership with the last.
    fn drop_igmp(&mut self, group: Ipv4Addr) {
        let Some(n) = self.igmp_users.get_mut(&group) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.igmp_users.remove(&group);
            self.membership.leave(group);
        }
    }

    // ------------------------------------------------------------ routes

    /// An id's TOS: its own when the program set one, else the port's default
    /// (`cma_resolve_iboe_route`: `tos_set ? tos : default_roce_tos`).
    fn tos(&self, c: &Ctx) -> u8 {
        if c.tos_set {
            c.tos
        } else {
            self.port.default_roce_tos
        }
    }

    /// The route's path (kernel `cma_resolve_iboe_route`): the GID of the id's source
    /// address to the destination's, hop limit 64, the id's TOS as traffic class, the netdev's MTU, the
    /// rdma_cm flow label of the ports.
    fn route_path(&self, c: &Ctx) -> UserPathRec {
        let src = c.src.unwrap_or(SocketAddr::new(self.port.addr, 0));
        let dst = c.dst.unwrap_or(SocketAddr::new(unspecified(&src), 0));
        UserPathRec {
            dgid: ip_gid(dst.ip()).0,
            sgid: self.src_gid(c.src).0,
            flow_label: rdma_cm::roce_flow_label(src.port(), dst.port()),
            reversible: true,
            mtu: self.port.path_mtu,
            pkey: 0xFFFF,
            hop_limit: 64,
            traffic_class: self.tos(c),
            sl: verbs::tos_to_sl(&self.port.netdev, self.tos(c)),
            rate: 0,
            packet_life_time: path_lifetime(c.ack_timeout),
        }
    }

    /// The address handle attributes of the route (`ib_init_ah_attr_from_path`).
    fn route_ah(&self, c: &Ctx) -> AhAttr {
        let p = self.route_path(c);
        AhAttr {
            dgid: p.dgid,
            flow_label: p.flow_label,
            sgid_index: self.port.index_of(Gid(p.sgid)),
            hop_limit: p.hop_limit,
            traffic_class: p.traffic_class,
            dlid: 0,
            sl: p.sl,
            static_rate: p.rate,
            is_global: true,
            port_num: self.port.port_num,
        }
    }

    fn av_ah(&self, av: &PathAv) -> AhAttr {
        AhAttr {
            dgid: av.remote_gid.0,
            flow_label: av.flow_label,
            sgid_index: self.port.index_of(av.local_gid),
            hop_limit: av.hop_limit,
            traffic_class: av.traffic_class,
            dlid: 0,
            sl: av.sl,
            static_rate: 0,
            is_global: true,
            port_num: self.port.port_num,
        }
    }

    // ------------------------------------------------------------ commands

    /// Runs one write of file `fh`: the header, then the command (see the module docs
    /// and [`Outcome`]).
    pub fn write(
        &mut self,
        fh: Fh,
        caller: Caller,
        data: &[u8],
        mem: &mut dyn CallerMemory,
        env: &mut Env<'_>,
    ) -> Outcome {
        let Ok(hdr) = CmdHdr::parse(data) else {
            return done(Err(errno::EINVAL));
        };
        let code = hdr.cmd;
        let slot = (code.min(cmd::TABLE_LEN)) as usize;
        self.stats.commands[slot] += 1;
        let bad = code >= cmd::TABLE_LEN
            || usize::from(hdr.in_len) + abi::HDR_LEN > data.len()
            || !self.files.contains_key(&fh);
        let out = if bad {
            done(Err(errno::EINVAL))
        } else {
            let body = &data[abi::HDR_LEN..];
            self.command(fh, caller, code, hdr, body, mem, env)
        };
        if matches!(out, Outcome::Done(Err(_))) {
            self.stats.errors[slot] += 1;
        }
        out
    }

    #[allow(clippy::too_many_arguments)]
    fn command(
        &mut self,
        fh: Fh,
        caller: Caller,
        code: u32,
        hdr: CmdHdr,
        body: &[u8],
        mem: &mut dyn CallerMemory,
        env: &mut Env<'_>,
    ) -> Outcome {
        let out = hdr.out_len;
        match code {
            cmd::CREATE_ID => done(self.create_id(fh, body, out, mem)),
            cmd::DESTROY_ID => done(self.destroy_id(fh, body, out, mem, env)),
            cmd::BIND_IP => done(
                Bind::parse_ip(body)
                    .map_err(abi_errno)
                    .and_then(|b| self.bind(fh, b, caller)),
            ),
            cmd::BIND => done(
                Bind::parse(body)
                    .map_err(abi_errno)
                    .and_then(|b| self.bind(fh, b, caller)),
            ),
            cmd::RESOLVE_IP => done(
                ResolveAddr::parse_ip(body)
                    .map_err(abi_errno)
                    .and_then(|r| self.resolve_addr(fh, r, caller, env.now)),
            ),
            cmd::RESOLVE_ADDR => done(
                ResolveAddr::parse(body)
                    .map_err(abi_errno)
                    .and_then(|r| self.resolve_addr(fh, r, caller, env.now)),
            ),
            cmd::RESOLVE_ROUTE => done(
                IdArg::parse(body)
                    .map_err(abi_errno)
                    .and_then(|a| self.resolve_route(fh, a.id)),
            ),
            cmd::QUERY_ROUTE => done(self.query_route(fh, body, out, mem)),
            cmd::QUERY => done(self.query(fh, body, out, mem)),
            cmd::CONNECT => done(self.connect(fh, body, env)),
            cmd::LISTEN => done(
                IdArg::parse(body)
                    .map_err(abi_errno)
                    .and_then(|a| self.listen(fh, a.id, a.arg, caller, env)),
            ),
            cmd::ACCEPT => done(self.accept(fh, body, env)),
            cmd::REJECT => done(self.reject(fh, body, env)),
            cmd::DISCONNECT => done(
                IdArg::parse_id(body)
                    .map_err(abi_errno)
                    .and_then(|a| self.disconnect(fh, a.id, env)),
            ),
            cmd::INIT_QP_ATTR => done(self.init_qp_attr(fh, body, out, mem, env)),
            cmd::GET_EVENT => self.get_event(fh, body, out, mem),
            cmd::SET_OPTION => done(self.set_option(fh, body, mem)),
            cmd::NOTIFY => done(
                IdArg::parse(body)
                    .map_err(abi_errno)
                    .and_then(|a| self.notify(fh, a.id, a.arg, env)),
            ),
            cmd::MIGRATE_ID => match RespIdArg::parse(body) {
                Ok(a) => Outcome::Migrate {
                    id: a.id,
                    fd: a.arg,
                    response: a.response,
                    out_len: out,
                },
                Err(e) => done(Err(abi_errno(e))),
            },
            cmd::JOIN_IP_MCAST => done(
                JoinMcast::parse_ip(body)
                    .map_err(join_errno)
                    .and_then(|j| self.join(fh, j, out, mem)),
            ),
            cmd::JOIN_MCAST => done(
                JoinMcast::parse(body)
                    .map_err(join_errno)
                    .and_then(|j| self.join(fh, j, out, mem)),
            ),
            cmd::LEAVE_MCAST => done(self.leave(fh, body, out, mem)),
            cmd::RESOLVE_IB_SERVICE => done(
                ResolveIbService::parse(body)
                    .map_err(abi_errno)
                    .and_then(|r| self.resolve_ib_service(fh, r)),
            ),
            cmd::WRITE_CM_EVENT => done(
                WriteCmEvent::parse(body)
                    .map_err(abi_errno)
                    .and_then(|w| self.write_cm_event(fh, w)),
            ),
            // GET_OPTION has no handler in the kernel either.
            _ => done(Err(errno::ENOSYS)),
        }
    }

    /// Whether `ip` is one of the VM's served addresses (the RDMA port's GIDs the
    /// backend serves).
    fn is_ours(&self, ip: IpAddr) -> bool {
        self.port.served_addr(ip).is_some()
    }

    /// The served GID of an id's source address; the port's primary when it has none
    /// (unbound, a wildcard, another local address).
    fn src_gid(&self, src: Option<SocketAddr>) -> Gid {
        src.and_then(|s| self.port.served_addr(s.ip()))
            .map_or(self.port.gid, |s| s.gid)
    }

    fn create_id(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        if usize::from(out) < 4 {
            return Err(errno::ENOSPC);
        }
        let c = CreateId::parse(body).map_err(abi_errno)?;
        let ud = match c.ps {
            ps::TCP => false,
            ps::UDP | ps::IPOIB => true,
            ps::IB => c.qp_type == IB_QPT_UD,
            _ => return Err(errno::EINVAL),
        };
        let id = self.new_ctx(fh, c.uid, c.ps, ud);
        if let Err(e) = mem.write(c.response, &id.to_le_bytes()) {
            self.drop_unused(id);
            return Err(e);
        }
        Ok(())
    }

    /// Removes an id that never reached the agent (a CREATE_ID whose answer could not
    /// be written).
    fn drop_unused(&mut self, id: u32) {
        if let Some(c) = self.ctxs.remove(&id) {
            if let Some(f) = self.files.get_mut(&c.file) {
                f.ctxs.retain(|&x| x != id);
            }
            self.free_ids.insert(id);
        }
    }

    fn destroy_id(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
        env: &mut Env<'_>,
    ) -> Result<(), i32> {
        if usize::from(out) < 4 {
            return Err(errno::ENOSPC);
        }
        let d = DestroyId::parse(body).map_err(abi_errno)?;
        self.ctx_in(fh, d.id)?;
        let n = self.destroy_ctx(d.id, env);
        mem.write(d.response, &n.to_le_bytes())
    }

    /// RESOLVE_IB_SERVICE: a service record from the subnet administrator, which a RoCE
    /// port has none of. As the kernel answers: an id bound to the VM's address (it has
    /// a device) and in ADDR_BOUND gets EOPNOTSUPP (`rdma_cap_ib_sa` is false on RoCE),
    /// any other EINVAL.
    fn resolve_ib_service(&mut self, fh: Fh, r: ResolveIbService) -> Result<(), i32> {
        let c = self.ctx_of(fh, r.id)?;
        if c.st == St::AddrBound && c.has_dev {
            Err(errno::EOPNOTSUPP)
        } else {
            Err(errno::EINVAL)
        }
    }

    /// WRITE_CM_EVENT: the event, USER or INTERNAL (any other is EINVAL, before the id is
    /// looked up), queued on the id's file, which must be the writer's; GET_EVENT reports
    /// it with the id's uid and number, the status and the argument in `param`, and
    /// counts it in the id's `events_reported`.
    fn write_cm_event(&mut self, fh: Fh, w: WriteCmEvent) -> Result<(), i32> {
        if w.event != event::USER && w.event != event::INTERNAL {
            return Err(errno::EINVAL);
        }
        let uid = self.ctx_of(fh, w.id)?.uid;
        self.queue(
            w.id,
            None,
            EventResp {
                uid,
                id: w.id,
                event: w.event,
                status: w.status,
                param: EventParam::Arg(w.arg),
                ece: Ece::default(),
            },
        );
        Ok(())
    }

    fn bind(&mut self, fh: Fh, b: Bind, caller: Caller) -> Result<(), i32> {
        self.ctx_of(fh, b.id)?;
        self.bind_addr(b.id, b.addr, caller)
    }

    /// Kernel `rdma_resolve_addr()` (see the module docs): binds an idle id, then tries
    /// the resolution once; a route lookup that fails is the command's error.
    fn resolve_addr(
        &mut self,
        fh: Fh,
        r: ResolveAddr,
        caller: Caller,
        now: Time,
    ) -> Result<(), i32> {
        let st = self.ctx_of(fh, r.id)?.st;
        if st == St::Idle {
            let src = r
                .src
                .unwrap_or_else(|| SocketAddr::new(unspecified(&r.dst), 0));
            self.bind_addr(r.id, src, caller)?;
        }
        let (family_ok, st) = {
            let c = self.ctxs.get(&r.id).ok_or(errno::ENOENT)?;
            let bound = c.src.map(|s| s.ip());
            (
                bound.is_none_or(|b| b.is_ipv4() == r.dst.ip().is_ipv4() || b.is_unspecified()),
                c.st,
            )
        };
        if st != St::AddrBound {
            return Err(errno::EINVAL);
        }
        if !family_ok {
            return Err(errno::EINVAL);
        }
        // The id's own served address (the primary for a wildcard).
        let ours = self
            .ctxs
            .get(&r.id)
            .and_then(|c| c.src)
            .and_then(|s| self.port.served_addr(s.ip()))
            .unwrap_or_else(|| self.port.primary())
            .addr;
        let c = self.ctx_mut(r.id)?;
        if r.dst.ip().is_unspecified() {
            // Kernel `cma_resolve_loopback`: the id's own address is the destination.
            c.dst = Some(SocketAddr::new(ours, r.dst.port()));
            self.addr_done(r.id, Ok(ours));
            return Ok(());
        }
        c.dst = Some(r.dst);
        match self.attempt(r.id) {
            Attempt::Failed(e) => return Err(e),
            Attempt::Resolved { src } => {
                self.addr_done(r.id, Ok(src));
            }
            Attempt::Waiting => {
                let c = self.ctx_mut(r.id)?;
                c.st = St::AddrQuery;
                c.query_deadline = Some(now.after_ms(u64::from(r.timeout_ms)));
                self.querying.insert(r.id);
            }
        }
        Ok(())
    }

    /// One attempt of id `id`'s address resolution (`addr_resolve()`).
    fn attempt(&mut self, id: u32) -> Attempt {
        let Some(c) = self.ctxs.get(&id) else {
            return Attempt::Failed(errno::ENOENT);
        };
        let Some(dst) = c.dst.map(|d| d.ip()) else {
            return Attempt::Failed(errno::EINVAL);
        };
        let src = c.src.map(|s| s.ip()).filter(|a| !a.is_unspecified());
        neigh::resolve(self.net.as_mut(), src, dst)
    }

    /// Kernel `addr_handler()`: the resolution of id `id` ended, with the source the
    /// route gave or an errno. An unbound id takes the route's source: the VM's
    /// address, or another local one (127.0.0.1), whose route RESOLVE_ROUTE refuses.
    /// Returns the file that got the event.
    fn addr_done(&mut self, id: u32, r: Result<IpAddr, i32>) -> Option<Fh> {
        self.querying.remove(&id);
        let served = r.ok().and_then(|src| self.port.served_addr(src));
        let own = served.is_some();
        // No device holds the VM's address (removed): `cma_acquire_dev_by_src_ip()`
        // finds none, and the resolution fails with ENODEV.
        let r = if own && !self.attached {
            Err(errno::ENODEV)
        } else {
            r
        };
        let c = self.ctxs.get_mut(&id)?;
        c.query_deadline = None;
        let (ev, status) = match r {
            Ok(src) => {
                let port = c.src.map_or(0, |s| s.port());
                if !c.has_dev {
                    c.src = Some(SocketAddr::new(served.map_or(src, |s| s.addr), port));
                }
                c.has_dev = true;
                c.st = St::AddrResolved;
                (event::ADDR_RESOLVED, 0)
            }
            Err(e) => {
                c.st = St::AddrBound;
                (event::ADDR_ERROR, -e)
            }
        };
        let p = self.empty_param(id);
        self.emit(id, ev, status, p)
    }

    /// Tries the waiting resolutions again where the kernel's `process_one_req()`
    /// would: all of them when a neighbour became valid, and each at its deadline, when
    /// one still without its neighbour fails with ETIMEDOUT. Reads the neighbour
    /// notifications in any case. Returns the files that got events.
    pub fn poll_addr(&mut self, now: Time) -> Vec<Fh> {
        let changed = self.net.changed();
        let due: Vec<(u32, bool)> = self
            .querying
            .iter()
            .filter_map(|id| {
                let late = self.ctxs.get(id)?.query_deadline.is_none_or(|d| d <= now);
                (changed || late).then_some((*id, late))
            })
            .collect();
        let mut files = Vec::new();
        for (id, late) in due {
            let r = match self.attempt(id) {
                Attempt::Resolved { src } => Ok(src),
                _ if late => Err(errno::ETIMEDOUT),
                Attempt::Waiting => continue,
                Attempt::Failed(e) => Err(e),
            };
            files.extend(self.addr_done(id, r));
        }
        files
    }

    /// When the next waiting resolution times out.
    pub fn next_addr_deadline(&self) -> Option<Time> {
        self.querying
            .iter()
            .filter_map(|id| self.ctxs.get(id)?.query_deadline)
            .min()
    }

    /// The descriptor that becomes readable when a neighbour changes (once a
    /// resolution has asked the network).
    pub fn addr_fd(&self) -> Option<std::os::fd::RawFd> {
        self.net.fd()
    }

    /// Ids whose address resolution waits.
    pub fn resolving(&self) -> usize {
        self.querying.len()
    }

    /// Kernel `cma_resolve_iboe_route()`: the route is the VM's RoCE port; an id whose
    /// address is another local one (127.0.0.1) has no RoCE netdev (ENODEV).
    fn resolve_route(&mut self, fh: Fh, id: u32) -> Result<(), i32> {
        let c = self.ctx_dev(fh, id)?;
        if c.st != St::AddrResolved {
            return Err(errno::EINVAL);
        }
        if !c.src.is_some_and(|s| self.is_ours(s.ip())) {
            return Err(errno::ENODEV);
        }
        let c = self.ctx_mut(id)?;
        c.route = true;
        c.st = St::RouteResolved;
        let p = self.empty_param(id);
        self.emit(id, event::ROUTE_RESOLVED, 0, p);
        Ok(())
    }

    fn query_route(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        if usize::from(out) < QueryRouteResp::MIN_OUT {
            return Err(errno::ENOSPC);
        }
        let q = RespIdArg::parse(body).map_err(abi_errno)?;
        let c = self.ctx_of(fh, q.id)?;
        let mut r = QueryRouteResp {
            node_guid_be: 0,
            paths: [None, None],
            src: c.src,
            dst: c.dst,
            num_paths: 0,
            port_num: 0,
            ibdev_index: 0,
        };
        if c.has_dev {
            r.node_guid_be = self.port.node_guid_wire();
            r.ibdev_index = self.port.ibdev_index;
            r.port_num = self.port.port_num;
            if c.route {
                r.num_paths = 1;
                r.paths[0] = Some(self.conn_path(c));
            } else {
                let src = c.src.map(|s| ip_gid(s.ip()).0).unwrap_or_default();
                let dst = c.dst.map(|s| ip_gid(s.ip()).0).unwrap_or_default();
                r.paths[0] = Some(UserPathRec {
                    dgid: dst,
                    sgid: src,
                    pkey: 0xFFFF,
                    ..UserPathRec::default()
                });
            }
        }
        let bytes = r.to_bytes();
        mem.write(
            q.response,
            &bytes[..usize::from(out).min(QueryRouteResp::LEN)],
        )
    }

    /// The path QUERY_ROUTE reports: the CM's (a passive id's comes from the REQ) or the
    /// resolved route's.
    fn conn_path(&self, c: &Ctx) -> UserPathRec {
        let mut p = self.route_path(c);
        if let Some(d) = c.dst {
            p.dgid = ip_gid(d.ip()).0;
        }
        p
    }

    fn query(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        let q = RespIdArg::parse(body).map_err(abi_errno)?;
        let c = self.ctx_of(fh, q.id)?;
        match q.arg {
            abi::query::ADDR | abi::query::GID => {
                if usize::from(out) < QueryAddrResp::MIN_OUT {
                    return Err(errno::ENOSPC);
                }
                let mut r = QueryAddrResp {
                    node_guid_be: 0,
                    port_num: 0,
                    pkey_be: 0,
                    src: ([0; abi::SOCKADDR_STORAGE_LEN], 0),
                    dst: ([0; abi::SOCKADDR_STORAGE_LEN], 0),
                    ibdev_index: 0,
                };
                if c.has_dev {
                    r.node_guid_be = self.port.node_guid_wire();
                    r.port_num = self.port.port_num;
                    r.pkey_be = u16::from_le_bytes(0xFFFFu16.to_be_bytes());
                    r.ibdev_index = self.port.ibdev_index;
                }
                let sid = |a: &SocketAddr| rdma_cm::service_id(c.ps, a.port());
                if q.arg == abi::query::ADDR {
                    if let Some(a) = &c.src {
                        r.src.1 = abi::emit_sockaddr(a, &mut r.src.0) as u16;
                    }
                    if let Some(a) = &c.dst {
                        r.dst.1 = abi::emit_sockaddr(a, &mut r.dst.0) as u16;
                    }
                } else {
                    let sgid = c.src.map(|a| ip_gid(a.ip()).0).unwrap_or_default();
                    let dgid = c.dst.map(|a| ip_gid(a.ip()).0).unwrap_or_default();
                    r.src.1 = abi::emit_sockaddr_ib(
                        sgid,
                        0xFFFF,
                        c.src.as_ref().map_or(0, sid),
                        &mut r.src.0,
                    ) as u16;
                    r.dst.1 = abi::emit_sockaddr_ib(
                        dgid,
                        0xFFFF,
                        c.dst.as_ref().map_or(0, sid),
                        &mut r.dst.0,
                    ) as u16;
                }
                let bytes = r.to_bytes();
                mem.write(
                    q.response,
                    &bytes[..usize::from(out).min(QueryAddrResp::LEN)],
                )
            }
            abi::query::PATH => {
                if usize::from(out) < 8 {
                    return Err(errno::ENOSPC);
                }
                // Path records travel in the SA's packed format, which only AF_IB users
                // read; a RoCE route reports its path through QUERY_ROUTE.
                mem.write(q.response, &[0u8; 8])
            }
            _ => Err(errno::ENOSYS),
        }
    }

    fn connect(&mut self, fh: Fh, body: &[u8], env: &mut Env<'_>) -> Result<(), i32> {
        let c = Connect::parse(body).map_err(abi_errno)?;
        if !c.conn.valid {
            return Err(errno::EINVAL);
        }
        let ctx = self.ctx_dev(fh, c.id)?;
        if ctx.st != St::RouteResolved {
            return Err(errno::EINVAL);
        }
        let (Some(src), Some(dst)) = (ctx.src, ctx.dst) else {
            return Err(errno::EINVAL);
        };
        let hdr = CmaHdr {
            src: src.ip(),
            dst: dst.ip(),
            src_port: src.port(),
        };
        let sid = rdma_cm::service_id(ctx.ps, dst.port());
        let dest = ip_gid(dst.ip());
        let handle = if ctx.ud {
            let pd = rdma_cm::sidr_req_private_data(&hdr, &c.conn.private_data)
                .map_err(|_| errno::EINVAL)?;
            env.agent
                .resolve_sidr(dest, sid, &pd, &SidrOptions::default(), env.now)
                .map_err(cm_errno)?
        } else {
            let pd =
                rdma_cm::req_private_data(&hdr, &c.conn.private_data).map_err(|_| errno::EINVAL)?;
            let opts = ConnectOptions {
                qpn: Some(c.conn.qp_num & 0x00FF_FFFF),
                starting_psn: Some(ctx.seq_num),
                responder_resources: c.conn.responder_resources,
                initiator_depth: c.conn.initiator_depth,
                flow_control: c.conn.flow_control,
                // cma_connect_ib(): both clamped to 7 (a larger value is 7, not masked).
                retry_count: c.conn.retry_count.min(7),
                rnr_retry_count: c.conn.rnr_retry_count.min(7),
                srq: c.conn.srq,
                path_mtu: self.port.path_mtu,
                hop_limit: 64,
                traffic_class: self.tos(ctx),
                sl: verbs::tos_to_sl(&self.port.netdev, self.tos(ctx)),
                packet_life_time: path_lifetime(ctx.ack_timeout),
                auto_rtu: false,
                local_gid: Some(self.src_gid(Some(src))),
                ..ConnectOptions::default()
            };
            env.agent
                .connect(dest, sid, &pd, &opts, env.now)
                .map_err(cm_errno)?
        };
        self.by_cm.insert(handle, c.id);
        let ctx = self.ctx_mut(c.id)?;
        ctx.cm = Some(handle);
        ctx.st = St::Connect;
        Ok(())
    }

    fn listen(
        &mut self,
        fh: Fh,
        id: u32,
        backlog: u32,
        caller: Caller,
        env: &mut Env<'_>,
    ) -> Result<(), i32> {
        let st = self.ctx_of(fh, id)?.st;
        let backlog = if backlog == 0 || backlog as i32 <= 0 || backlog > MAX_BACKLOG {
            MAX_BACKLOG
        } else {
            backlog
        };
        if st == St::Idle {
            self.bind_addr(
                id,
                SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
                caller,
            )?;
        }
        let c = self.ctxs.get(&id).ok_or(errno::ENOENT)?;
        if c.st != St::AddrBound {
            return Err(errno::EINVAL);
        }
        let Some((ps, port)) = c.port else {
            return Err(errno::EINVAL);
        };
        // rdma_listen(): a listener is no longer reusable; its address must be its own
        // on the port, as a bind without SO_REUSEADDR would find it.
        if c.reuseaddr {
            let addr = c.src.map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |s| s.ip());
            self.check_port(id, (ps, port), addr, false)?;
        }
        // The listeners of one port share the agent's listener of its service ID; the
        // bind rules keep their addresses apart, and `on_request` picks by address.
        let listener = match self.agent_listener((ps, port)) {
            Some(l) => l,
            None => env
                .agent
                .listen(rdma_cm::service_id(ps, port))
                .map_err(cm_errno)?,
        };
        self.listeners.entry(listener).or_default().push(id);
        let c = self.ctx_mut(id)?;
        c.cm = Some(listener);
        c.reuseaddr = false;
        c.backlog = backlog;
        c.st = St::Listen;
        Ok(())
    }

    fn accept(&mut self, fh: Fh, body: &[u8], env: &mut Env<'_>) -> Result<(), i32> {
        let a = Accept::parse(body).map_err(abi_errno)?;
        let c = self.ctx_dev(fh, a.id)?;
        if c.st != St::Connect {
            return Err(errno::EINVAL);
        }
        let cm = c.cm.ok_or(errno::EINVAL)?;
        let (ud, qkey, seq_num) = (c.ud, c.qkey, c.seq_num);
        // rdma_accept(): an accept that fails past the state check rejects the
        // connection (REJ(CONSUMER_DEFINED), a SIDR_REP(REJECT) for UD), as the kernel's
        // `reject:` path does, so the peer is not left waiting for its timeout.
        if let Err(e) = Self::answer(cm, &a, ud, qkey, seq_num, env) {
            let _ = env.agent.reject(cm, &[], env.now);
            return Err(e);
        }
        let c = self.ctx_mut(a.id)?;
        if !ud && !a.conn.valid {
            c.established = true;
        } else if a.conn.valid {
            c.uid = a.uid;
        }
        Ok(())
    }

    /// ACCEPT's answer to the peer: a SIDR_REP for a UD id, a REP (with `conn_param`),
    /// or the active side's RTU after CONNECT_RESPONSE (`cma_rep_recv`).
    fn answer(
        cm: CmId,
        a: &Accept,
        ud: bool,
        qkey: u32,
        seq_num: u32,
        env: &mut Env<'_>,
    ) -> Result<(), i32> {
        if ud {
            let (qpn, pd) = if a.conn.valid {
                (a.conn.qp_num & 0x00FF_FFFF, a.conn.private_data.clone())
            } else {
                (0, Vec::new())
            };
            return env
                .agent
                .sidr_reply(cm, SidrStatus::Success, qpn, qkey, &pd)
                .map_err(cm_errno);
        }
        if a.conn.valid {
            if !matches!(
                env.agent.state(cm),
                Some(State::ReqRcvd | State::MraReqSent)
            ) {
                return Err(errno::EINVAL);
            }
            let opts = AcceptOptions {
                qpn: Some(a.conn.qp_num & 0x00FF_FFFF),
                starting_psn: Some(seq_num),
                responder_resources: a.conn.responder_resources,
                initiator_depth: a.conn.initiator_depth,
                flow_control: a.conn.flow_control,
                rnr_retry_count: a.conn.rnr_retry_count.min(7),
                srq: a.conn.srq,
            };
            return env
                .agent
                .accept_with(cm, &a.conn.private_data, &opts, env.now)
                .map_err(cm_errno);
        }
        if !matches!(
            env.agent.state(cm),
            Some(State::RepRcvd | State::MraRepSent)
        ) {
            return Err(errno::EINVAL);
        }
        env.agent.accept(cm, &[], env.now).map_err(cm_errno)
    }

    fn reject(&mut self, fh: Fh, body: &[u8], env: &mut Env<'_>) -> Result<(), i32> {
        let r = Reject::parse(body).map_err(abi_errno)?;
        // ucma_reject(): no reason is CONSUMER_DEFINED; only it and
        // VENDOR_OPTION_NOT_SUPPORTED (rdma_reject_ece) may be given, and go out as given.
        let reason = match r.reason {
            0 => RejReason::ConsumerDefined,
            REJ_VENDOR_OPTION_NOT_SUPPORTED => RejReason::VendorOptionNotSupported,
            x if u16::from(x) == RejReason::ConsumerDefined.code() => RejReason::ConsumerDefined,
            _ => return Err(errno::EINVAL),
        };
        let c = self.ctx_dev(fh, r.id)?;
        let cm = c.cm.ok_or(errno::EINVAL)?;
        env.agent
            .reject_with(cm, reason, &r.private_data, env.now)
            .map_err(cm_errno)
    }

    fn disconnect(&mut self, fh: Fh, id: u32, env: &mut Env<'_>) -> Result<(), i32> {
        let c = self.ctx_dev(fh, id)?;
        let cm = c.cm.ok_or(errno::EINVAL)?;
        // cma.c tries a DREQ, else a DREP, and succeeds either way.
        if !c.ud {
            let _ = env.agent.disconnect(cm, env.now);
        }
        Ok(())
    }

    fn init_qp_attr(
        &mut self,
        fh: Fh,
        body: &[u8],
        out: u16,
        mem: &mut dyn CallerMemory,
        env: &mut Env<'_>,
    ) -> Result<(), i32> {
        if usize::from(out) < UverbsQpAttr::LEN {
            return Err(errno::ENOSPC);
        }
        let q = RespIdArg::parse(body).map_err(abi_errno)?;
        let Some(target) = QpState::from_u32(q.arg) else {
            return Err(errno::EINVAL);
        };
        let c = self.ctx_dev(fh, q.id)?;
        let conn = c.cm.filter(|_| !c.ud && c.st != St::Listen);
        let mut r = UverbsQpAttr {
            qp_state: q.arg,
            ..UverbsQpAttr::default()
        };
        match conn {
            None => {
                // cma.c `cma_ib_init_qp_attr`: the port and P_Key, plus the Q_Key (UD)
                // or no remote access (RC) until the CM exchange gives more.
                r.qp_attr_mask = mask::STATE | mask::PKEY_INDEX | mask::PORT;
                r.pkey_index = self.port.pkey_index;
                r.port_num = self.port.port_num;
                if c.ud {
                    r.qp_attr_mask |= mask::QKEY;
                    r.qkey = c.qkey;
                } else {
                    r.qp_attr_mask |= mask::ACCESS_FLAGS;
                }
            }
            Some(cm) => {
                let a = env.agent.qp_attr(cm, target).map_err(cm_errno)?;
                r.qp_attr_mask = a.mask;
                r.qp_access_flags = a.access_flags;
                r.path_mtu = u32::from(a.path_mtu);
                r.dest_qp_num = a.dest_qpn;
                r.rq_psn = a.rq_psn;
                r.sq_psn = a.sq_psn;
                r.max_dest_rd_atomic = a.max_dest_rd_atomic;
                r.min_rnr_timer = a.min_rnr_timer;
                r.max_rd_atomic = a.max_rd_atomic;
                r.timeout = a.timeout;
                r.retry_cnt = a.retry_cnt;
                r.rnr_retry = a.rnr_retry;
                if a.mask & mask::PKEY_INDEX != 0 {
                    r.pkey_index = self.port.pkey_index;
                }
                if a.mask & mask::PORT != 0 {
                    r.port_num = self.port.port_num;
                }
                if a.mask & mask::AV != 0 {
                    r.ah_attr = self.av_ah(&a.av);
                }
                // cma.c: the receive PSN is the id's own sequence number, the one its
                // REQ or REP announced; a set ACK timeout overrides the path's.
                if target == QpState::Rtr {
                    r.rq_psn = c.seq_num;
                }
                if let (Some(t), true) = (c.ack_timeout, a.mask & mask::TIMEOUT != 0) {
                    r.timeout = t;
                }
            }
        }
        mem.write(q.response, &r.to_bytes())
    }

    fn get_event(&mut self, fh: Fh, body: &[u8], out: u16, mem: &mut dyn CallerMemory) -> Outcome {
        if usize::from(out) < EventResp::MIN_OUT {
            return done(Err(errno::ENOSPC));
        }
        let response = match abi::parse_get_event(body) {
            Ok(r) => r,
            Err(e) => return done(Err(abi_errno(e))),
        };
        match self.deliver(fh, response, out, mem) {
            Some(r) => done(r),
            None => Outcome::WaitEvent {
                response,
                out_len: out,
            },
        }
    }

    fn set_option(&mut self, fh: Fh, body: &[u8], mem: &mut dyn CallerMemory) -> Result<(), i32> {
        let o = SetOption::parse(body).map_err(abi_errno)?;
        if o.optlen > MAX_OPTLEN {
            return Err(errno::EINVAL);
        }
        self.ctx_of(fh, o.id)?;
        let mut val = vec![0u8; o.optlen as usize];
        mem.read(o.optval, &mut val)?;
        let c = self.ctx_mut(o.id)?;
        match (o.level, o.optname) {
            (opt::LEVEL_ID, opt::ID_TOS) => {
                if val.len() != 1 {
                    return Err(errno::EINVAL);
                }
                c.tos = val[0];
                c.tos_set = true;
                Ok(())
            }
            (opt::LEVEL_ID, opt::ID_REUSEADDR) => {
                if val.len() != 4 {
                    return Err(errno::EINVAL);
                }
                let reuse = abi::u32_at(&val, 0) != 0;
                if (reuse && c.st != St::Listen) || c.st == St::Idle {
                    c.reuseaddr = reuse;
                    Ok(())
                } else {
                    Err(errno::EINVAL)
                }
            }
            (opt::LEVEL_ID, opt::ID_AFONLY) => {
                if val.len() != 4 {
                    return Err(errno::EINVAL);
                }
                // rdma_set_afonly(): before the id is bound, or bound but no further.
                if !matches!(c.st, St::Idle | St::AddrBound) {
                    return Err(errno::EINVAL);
                }
                c.afonly = abi::u32_at(&val, 0) != 0;
                Ok(())
            }
            (opt::LEVEL_ID, opt::ID_ACK_TIMEOUT) => {
                if val.len() != 1 || c.ud {
                    return Err(errno::EINVAL);
                }
                c.ack_timeout = Some(val[0]);
                Ok(())
            }
            _ => Err(errno::ENOSYS),
        }
    }

    fn notify(&mut self, fh: Fh, id: u32, ev: u32, env: &mut Env<'_>) -> Result<(), i32> {
        let c = self.ctx_dev(fh, id)?;
        let cm = c.cm.ok_or(errno::EINVAL)?;
        if ev != IB_EVENT_COMM_EST {
            return Err(errno::EINVAL);
        }
        env.agent.establish(cm).map_err(cm_errno)
    }

    /// The pvcm device was reset: the host released every connection of this VM and the
    /// agent starts afresh, so every agent handle is gone. Listeners listen again;
    /// established connections report DISCONNECTED, connections being set up
    /// UNREACHABLE (status -ECONNRESET), as their peer saw them end. Returns the files
    /// that got events.
    pub fn device_reset(&mut self, env: &mut Env<'_>) -> Vec<Fh> {
        self.by_cm.clear();
        self.listeners.clear();
        let ids: Vec<u32> = self.ctxs.keys().copied().collect();
        let mut files = Vec::new();
        // The agent listener made again for each (port space, port), shared as before.
        let mut relistened: BTreeMap<(u16, u16), CmId> = BTreeMap::new();
        for id in ids {
            let Some(c) = self.ctxs.get_mut(&id) else {
                continue;
            };
            let Some(_) = c.cm.take() else { continue };
            match c.st {
                St::Listen => {
                    let Some((ps, port)) = c.port else { continue };
                    let l = match relistened.get(&(ps, port)) {
                        Some(&l) => l,
                        None => match env.agent.listen(rdma_cm::service_id(ps, port)) {
                            Ok(l) => l,
                            Err(_) => continue,
                        },
                    };
                    relistened.insert((ps, port), l);
                    c.cm = Some(l);
                    self.listeners.entry(l).or_default().push(id);
                }
                St::Connect => {
                    c.st = St::Disconnect;
                    let ev = if c.established {
                        event::DISCONNECTED
                    } else {
                        event::UNREACHABLE
                    };
                    let p = self.empty_param(id);
                    files.extend(self.emit(id, ev, -libc::ECONNRESET, p));
                }
                _ => {}
            }
        }
        files
    }

    /// MIGRATE_ID, once the caller's descriptor was found to be file `from`: the id and
    /// its queued events move to `to`; its `events_reported` goes to the caller.
    pub fn migrate(
        &mut self,
        to: Fh,
        from: Fh,
        id: u32,
        response: u64,
        mem: &mut dyn CallerMemory,
    ) -> Result<(), i32> {
        if !self.files.contains_key(&to) {
            return Err(errno::EINVAL);
        }
        self.ctx_of(from, id)?;
        let mut moved = Vec::new();
        if let Some(f) = self.files.get_mut(&from) {
            f.ctxs.retain(|&x| x != id);
            let mut keep = VecDeque::with_capacity(f.events.len());
            while let Some(q) = f.events.pop_front() {
                if q.ctx == id {
                    moved.push(q);
                } else {
                    keep.push_back(q);
                }
            }
            f.events = keep;
        }
        let reported = {
            let c = self.ctx_mut(id)?;
            c.file = to;
            c.events_reported
        };
        // Connections a moved listener announced but did not report move with it.
        let children: Vec<u32> = moved.iter().filter_map(|q| q.child).collect();
        for ch in children {
            if let Some(c) = self.ctxs.get_mut(&ch) {
                c.file = to;
            }
            if let Some(f) = self.files.get_mut(&from) {
                f.ctxs.retain(|&x| x != ch);
            }
            if let Some(f) = self.files.get_mut(&to) {
                f.ctxs.push(ch);
            }
        }
        if let Some(f) = self.files.get_mut(&to) {
            f.ctxs.push(id);
            f.events.extend(moved);
        }
        mem.write(response, &reported.to_le_bytes())
    }
}

/// Private data as an event reports it: the message's whole field (the kernel hands
/// the full size), zero-padded.
fn padded(pd: &[u8], size: usize) -> Vec<u8> {
    let mut v = pd[..pd.len().min(size)].to_vec();
    v.resize(size.min(abi::MAX_PRIVATE_DATA), 0);
    v
}

/// A route's packet lifetime (`cma_resolve_iboe_route`): the ACK_TIMEOUT option less one
/// when it is set and not 0, else rdma_cm's RoCE default.
fn path_lifetime(ack_timeout: Option<u8>) -> u8 {
    match ack_timeout {
        Some(t) if t > 0 => t - 1,
        _ => CMA_IBOE_PACKET_LIFETIME,
    }
}

fn rej_code(r: RejReason) -> u16 {
    r.code()
}

fn sidr_code(s: SidrStatus) -> i32 {
    i32::from(s.code())
}

/// The GID of the address of a socket, for tests and the server.
pub fn sockaddr_gid(a: &SocketAddr) -> Gid {
    ip_gid(a.ip())
}

/// The address of a GID.
pub fn gid_sockaddr(g: Gid, port: u16) -> SocketAddr {
    SocketAddr::new(gid_ip(g), port)
}

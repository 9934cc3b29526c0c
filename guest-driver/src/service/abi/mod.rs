//! The rdma_cm character device's command ABI (Linux `include/uapi/rdma/rdma_user_cm.h`,
//! ABI version 4), as the distribution's librdmacm writes it to `/dev/infiniband/rdma_cm`.
//!
//! Every command is one `write()`: an 8-byte header (`cmd`, `in`, `out`) and a command
//! structure; commands that answer carry a `response` address in the caller's memory,
//! which the service fills (the kernel's `copy_to_user`). Structures are in the host's
//! byte order (little-endian x86_64 here), except the network-order fields of socket
//! addresses and path records. Offsets below were checked against the header with a C
//! `offsetof` program (the `layouts` test holds them).
//!
//! Parsing never panics: a command shorter than its structure is
//! [`AbiError::Short`]; an address of a family or size the kernel would refuse is
//! [`AbiError::BadAddr`].

mod layout;

use core::mem::size_of;

use zerocopy::{FromBytes, FromZeros, IntoBytes};

use layout::{
    UcmAccept, UcmBind, UcmBindIp, UcmCmdHdr, UcmConnParam, UcmConnect, UcmCreateId, UcmDestroyId,
    UcmEce, UcmEventResp, UcmIdArg, UcmJoinIpMcast, UcmJoinMcast, UcmQueryAddrResp,
    UcmQueryRouteResp, UcmReject, UcmResolveAddr, UcmResolveIbService, UcmResolveIp, UcmRespIdArg,
    UcmSetOption, UcmUdParam, UcmWriteCmEvent, UverbsAhAttr,
};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// The ABI version librdmacm checks (`RDMA_USER_CM_ABI_VERSION`).
pub const ABI_VERSION: u32 = 4;
/// `RDMA_MAX_PRIVATE_DATA`.
pub const MAX_PRIVATE_DATA: usize = 256;

/// Command codes (`RDMA_USER_CM_CMD_*`).
pub mod cmd {
    /// CREATE_ID.
    pub const CREATE_ID: u32 = 0;
    /// DESTROY_ID.
    pub const DESTROY_ID: u32 = 1;
    /// BIND_IP.
    pub const BIND_IP: u32 = 2;
    /// RESOLVE_IP.
    pub const RESOLVE_IP: u32 = 3;
    /// RESOLVE_ROUTE.
    pub const RESOLVE_ROUTE: u32 = 4;
    /// QUERY_ROUTE.
    pub const QUERY_ROUTE: u32 = 5;
    /// CONNECT.
    pub const CONNECT: u32 = 6;
    /// LISTEN.
    pub const LISTEN: u32 = 7;
    /// ACCEPT.
    pub const ACCEPT: u32 = 8;
    /// REJECT.
    pub const REJECT: u32 = 9;
    /// DISCONNECT.
    pub const DISCONNECT: u32 = 10;
    /// INIT_QP_ATTR.
    pub const INIT_QP_ATTR: u32 = 11;
    /// GET_EVENT.
    pub const GET_EVENT: u32 = 12;
    /// GET_OPTION (no kernel serves it).
    pub const GET_OPTION: u32 = 13;
    /// SET_OPTION.
    pub const SET_OPTION: u32 = 14;
    /// NOTIFY.
    pub const NOTIFY: u32 = 15;
    /// JOIN_IP_MCAST.
    pub const JOIN_IP_MCAST: u32 = 16;
    /// LEAVE_MCAST.
    pub const LEAVE_MCAST: u32 = 17;
    /// MIGRATE_ID.
    pub const MIGRATE_ID: u32 = 18;
    /// QUERY.
    pub const QUERY: u32 = 19;
    /// BIND.
    pub const BIND: u32 = 20;
    /// RESOLVE_ADDR.
    pub const RESOLVE_ADDR: u32 = 21;
    /// JOIN_MCAST.
    pub const JOIN_MCAST: u32 = 22;
    /// RESOLVE_IB_SERVICE (an IB service record from the SA; librdmacm 60 and later).
    pub const RESOLVE_IB_SERVICE: u32 = 23;
    /// WRITE_CM_EVENT (an event a process queues on its own file; librdmacm 60 and
    /// later).
    pub const WRITE_CM_EVENT: u32 = 24;
    /// Commands the kernel's table has (`ARRAY_SIZE(ucma_cmd_table)`, Linux 6.17 and
    /// later; earlier kernels end at JOIN_MCAST): codes at or past this are EINVAL.
    pub const TABLE_LEN: u32 = 25;

    /// The command's name, for logs and counters.
    pub fn name(c: u32) -> &'static str {
        const NAMES: [&str; TABLE_LEN as usize] = [
            "create_id",
            "destroy_id",
            "bind_ip",
            "resolve_ip",
            "resolve_route",
            "query_route",
            "connect",
            "listen",
            "accept",
            "reject",
            "disconnect",
            "init_qp_attr",
            "get_event",
            "get_option",
            "set_option",
            "notify",
            "join_ip_mcast",
            "leave_mcast",
            "migrate_id",
            "query",
            "bind",
            "resolve_addr",
            "join_mcast",
            "resolve_ib_service",
            "write_cm_event",
        ];
        NAMES.get(c as usize).copied().unwrap_or("unknown")
    }
}

/// Port spaces (`enum rdma_ucm_port_space`).
pub mod ps {
    /// IPoIB.
    pub const IPOIB: u16 = 0x0002;
    /// IB (AF_IB only).
    pub const IB: u16 = 0x013F;
    /// TCP: RC connections.
    pub const TCP: u16 = 0x0106;
    /// UDP: UD, resolved with SIDR.
    pub const UDP: u16 = 0x0111;
}

/// Events (`enum rdma_cm_event_type`).
pub mod event {
    /// ADDR_RESOLVED.
    pub const ADDR_RESOLVED: u32 = 0;
    /// ADDR_ERROR.
    pub const ADDR_ERROR: u32 = 1;
    /// ROUTE_RESOLVED.
    pub const ROUTE_RESOLVED: u32 = 2;
    /// ROUTE_ERROR.
    pub const ROUTE_ERROR: u32 = 3;
    /// CONNECT_REQUEST.
    pub const CONNECT_REQUEST: u32 = 4;
    /// CONNECT_RESPONSE.
    pub const CONNECT_RESPONSE: u32 = 5;
    /// CONNECT_ERROR.
    pub const CONNECT_ERROR: u32 = 6;
    /// UNREACHABLE.
    pub const UNREACHABLE: u32 = 7;
    /// REJECTED.
    pub const REJECTED: u32 = 8;
    /// ESTABLISHED.
    pub const ESTABLISHED: u32 = 9;
    /// DISCONNECTED.
    pub const DISCONNECTED: u32 = 10;
    /// DEVICE_REMOVAL.
    pub const DEVICE_REMOVAL: u32 = 11;
    /// MULTICAST_JOIN.
    pub const MULTICAST_JOIN: u32 = 12;
    /// MULTICAST_ERROR.
    pub const MULTICAST_ERROR: u32 = 13;
    /// ADDR_CHANGE.
    pub const ADDR_CHANGE: u32 = 14;
    /// TIMEWAIT_EXIT.
    pub const TIMEWAIT_EXIT: u32 = 15;
    /// ADDRINFO_RESOLVED (RESOLVE_IB_SERVICE's answer).
    pub const ADDRINFO_RESOLVED: u32 = 16;
    /// ADDRINFO_ERROR.
    pub const ADDRINFO_ERROR: u32 = 17;
    /// USER: written by a process with WRITE_CM_EVENT.
    pub const USER: u32 = 18;
    /// INTERNAL: written by librdmacm itself with WRITE_CM_EVENT.
    pub const INTERNAL: u32 = 19;
    /// Event types there are.
    pub const COUNT: usize = 20;

    /// The event's name (librdmacm's `rdma_event_str` without the prefix).
    pub fn name(e: u32) -> &'static str {
        const NAMES: [&str; COUNT] = [
            "ADDR_RESOLVED",
            "ADDR_ERROR",
            "ROUTE_RESOLVED",
            "ROUTE_ERROR",
            "CONNECT_REQUEST",
            "CONNECT_RESPONSE",
            "CONNECT_ERROR",
            "UNREACHABLE",
            "REJECTED",
            "ESTABLISHED",
            "DISCONNECTED",
            "DEVICE_REMOVAL",
            "MULTICAST_JOIN",
            "MULTICAST_ERROR",
            "ADDR_CHANGE",
            "TIMEWAIT_EXIT",
            "ADDRINFO_RESOLVED",
            "ADDRINFO_ERROR",
            "USER",
            "INTERNAL",
        ];
        NAMES.get(e as usize).copied().unwrap_or("UNKNOWN")
    }
}

/// Option levels and names of SET_OPTION.
pub mod opt {
    /// `RDMA_OPTION_ID`.
    pub const LEVEL_ID: u32 = 0;
    /// `RDMA_OPTION_IB`.
    pub const LEVEL_IB: u32 = 1;
    /// `RDMA_OPTION_ID_TOS` (u8).
    pub const ID_TOS: u32 = 0;
    /// `RDMA_OPTION_ID_REUSEADDR` (int).
    pub const ID_REUSEADDR: u32 = 1;
    /// `RDMA_OPTION_ID_AFONLY` (int).
    pub const ID_AFONLY: u32 = 2;
    /// `RDMA_OPTION_ID_ACK_TIMEOUT` (u8).
    pub const ID_ACK_TIMEOUT: u32 = 3;
    /// `RDMA_OPTION_IB_PATH` (array of `ib_path_rec_data`).
    pub const IB_PATH: u32 = 1;
}

/// QUERY options (`RDMA_USER_CM_QUERY_*`).
pub mod query {
    /// Addresses and device.
    pub const ADDR: u32 = 0;
    /// Path records.
    pub const PATH: u32 = 1;
    /// Addresses as AF_IB GIDs.
    pub const GID: u32 = 2;
}

/// Socket address families.
pub mod af {
    /// AF_INET.
    pub const INET: u16 = 2;
    /// AF_INET6.
    pub const INET6: u16 = 10;
    /// AF_IB.
    pub const IB: u16 = 27;
}

/// Why a command could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AbiError {
    /// Fewer bytes than the structure.
    #[error("command of {got} bytes, its structure needs {need}")]
    Short {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// An address the kernel would refuse (family, size).
    #[error("bad socket address")]
    BadAddr,
    /// An AF_IB address (the port is RoCE: no AF_IB).
    #[error("AF_IB address")]
    AfIb,
}

/// Command header size.
pub const HDR_LEN: usize = 8;

/// `struct rdma_ucm_cmd_hdr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmdHdr {
    /// Command code.
    pub cmd: u32,
    /// Bytes of command after the header.
    pub in_len: u16,
    /// Bytes of response the caller's buffer holds.
    pub out_len: u16,
}

impl CmdHdr {
    /// Reads the header of a write.
    pub fn parse(b: &[u8]) -> Result<CmdHdr, AbiError> {
        let h: UcmCmdHdr = read(b)?;
        Ok(CmdHdr {
            cmd: h.cmd.get(),
            in_len: h.r#in.get(),
            out_len: h.out.get(),
        })
    }

    /// Writes the header (for clients and tests).
    pub fn emit(&self, b: &mut [u8]) {
        let h = UcmCmdHdr {
            cmd: self.cmd.into(),
            r#in: self.in_len.into(),
            out: self.out_len.into(),
        };
        put(b, 0, h.as_bytes());
    }
}

fn need(b: &[u8], n: usize) -> Result<(), AbiError> {
    if b.len() < n {
        Err(AbiError::Short {
            got: b.len(),
            need: n,
        })
    } else {
        Ok(())
    }
}

/// Reads a structure from the front of `b` ([`AbiError::Short`] when `b` is shorter).
fn read<T: FromBytes>(b: &[u8]) -> Result<T, AbiError> {
    T::read_from_prefix(b)
        .map(|(t, _)| t)
        .map_err(|_| AbiError::Short {
            got: b.len(),
            need: size_of::<T>(),
        })
}

/// Reads a structure from the front of `b`, which must hold at least `min` bytes;
/// the fields past its end read as zero.
fn read_min<T: FromBytes + IntoBytes>(b: &[u8], min: usize) -> Result<T, AbiError> {
    need(b, min)?;
    let mut t = T::new_zeroed();
    let n = b.len().min(size_of::<T>());
    t.as_mut_bytes()[..n].copy_from_slice(&b[..n]);
    Ok(t)
}

/// A structure's bytes as an array of its size.
fn bytes<T: IntoBytes + zerocopy::Immutable, const N: usize>(t: &T) -> [u8; N] {
    let mut b = [0u8; N];
    put(&mut b, 0, t.as_bytes());
    b
}

fn arr<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    if let Some(s) = b.get(at..at + N) {
        a.copy_from_slice(s);
    }
    a
}

/// A little-endian u16 at `at` (0 past the end; callers check lengths first).
pub fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(arr(b, at))
}
/// A little-endian u32 at `at`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(arr(b, at))
}
/// A little-endian u64 at `at`.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(arr(b, at))
}
fn put(b: &mut [u8], at: usize, v: &[u8]) {
    if let Some(d) = b.get_mut(at..at + v.len()) {
        d.copy_from_slice(v);
    }
}
/// Writes a little-endian u16 at `at` (nothing past the end).
pub fn put_u16(b: &mut [u8], at: usize, v: u16) {
    put(b, at, &v.to_le_bytes());
}
/// Writes a little-endian u32 at `at`.
pub fn put_u32(b: &mut [u8], at: usize, v: u32) {
    put(b, at, &v.to_le_bytes());
}
/// Writes a little-endian u64 at `at`.
pub fn put_u64(b: &mut [u8], at: usize, v: u64) {
    put(b, at, &v.to_le_bytes());
}

// ------------------------------------------------------------------ socket addresses

/// `sizeof(struct sockaddr_in)`.
pub const SOCKADDR_IN_LEN: usize = 16;
/// `sizeof(struct sockaddr_in6)`.
pub const SOCKADDR_IN6_LEN: usize = 28;
/// `sizeof(struct sockaddr_ib)`.
pub const SOCKADDR_IB_LEN: usize = 48;
/// `sizeof(struct __kernel_sockaddr_storage)`.
pub const SOCKADDR_STORAGE_LEN: usize = 128;

/// An address family's size (the kernel's `rdma_addr_size`); 0 for others.
pub fn family_len(family: u16) -> usize {
    match family {
        af::INET => SOCKADDR_IN_LEN,
        af::INET6 => SOCKADDR_IN6_LEN,
        af::IB => SOCKADDR_IB_LEN,
        _ => 0,
    }
}

/// Reads a socket address from the start of `b` (a `sockaddr_in6` field or a
/// `sockaddr_storage`): AF_INET or AF_INET6; AF_IB is [`AbiError::AfIb`].
pub fn parse_sockaddr(b: &[u8]) -> Result<SocketAddr, AbiError> {
    let family = u16_at(b, 0);
    let n = family_len(family);
    if n == 0 || b.len() < n {
        return Err(AbiError::BadAddr);
    }
    let port = u16::from_be_bytes(arr(b, 2));
    match family {
        af::INET => Ok(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(arr::<4>(b, 4)),
            port,
        ))),
        af::INET6 => Ok(SocketAddr::V6(SocketAddrV6::new(
            Ipv6Addr::from(arr::<16>(b, 8)),
            port,
            u32::from_be_bytes(arr(b, 4)),
            u32_at(b, 24),
        ))),
        _ => Err(AbiError::AfIb),
    }
}

/// Writes a socket address at the start of `b` (which holds at least its size; the
/// rest is left alone); returns its size.
pub fn emit_sockaddr(a: &SocketAddr, b: &mut [u8]) -> usize {
    match a {
        SocketAddr::V4(v) => {
            put_u16(b, 0, af::INET);
            put(b, 2, &v.port().to_be_bytes());
            put(b, 4, &v.ip().octets());
            put(b, 8, &[0u8; 8]);
            SOCKADDR_IN_LEN
        }
        SocketAddr::V6(v) => {
            put_u16(b, 0, af::INET6);
            put(b, 2, &v.port().to_be_bytes());
            put(b, 4, &v.flowinfo().to_be_bytes());
            put(b, 8, &v.ip().octets());
            put_u32(b, 24, v.scope_id());
            SOCKADDR_IN6_LEN
        }
    }
}

/// Writes an AF_IB address (`struct sockaddr_ib`) at the start of `b`: what QUERY's GID
/// option answers.
pub fn emit_sockaddr_ib(gid: [u8; 16], pkey: u16, service_id: u64, b: &mut [u8]) -> usize {
    put_u16(b, 0, af::IB);
    put(b, 2, &pkey.to_be_bytes());
    put(b, 4, &[0u8; 4]);
    put(b, 8, &gid);
    put(b, 24, &service_id.to_be_bytes());
    put(b, 32, &u64::MAX.to_be_bytes());
    put(b, 40, &[0u8; 8]);
    SOCKADDR_IB_LEN
}

// ------------------------------------------------------------------ commands

/// `struct rdma_ucm_create_id` (24 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateId {
    /// The caller's context, echoed in events.
    pub uid: u64,
    /// Where `rdma_ucm_create_id_resp` goes.
    pub response: u64,
    /// Port space.
    pub ps: u16,
    /// QP type (`enum ib_qp_type`; taken only for PS_IB).
    pub qp_type: u8,
}

impl CreateId {
    /// Size.
    pub const LEN: usize = size_of::<UcmCreateId>();
    /// Parses.
    pub fn parse(b: &[u8]) -> Result<CreateId, AbiError> {
        let c: UcmCreateId = read(b)?;
        Ok(CreateId {
            uid: c.uid.get(),
            response: c.response.get(),
            ps: c.ps.get(),
            qp_type: c.qp_type,
        })
    }
}

/// `struct rdma_ucm_destroy_id` (16 bytes), also LEAVE_MCAST's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DestroyId {
    /// Where `rdma_ucm_destroy_id_resp` goes.
    pub response: u64,
    /// The id.
    pub id: u32,
}

impl DestroyId {
    /// Size.
    pub const LEN: usize = size_of::<UcmDestroyId>();
    /// Parses.
    pub fn parse(b: &[u8]) -> Result<DestroyId, AbiError> {
        let d: UcmDestroyId = read(b)?;
        Ok(DestroyId {
            response: d.response.get(),
            id: d.id.get(),
        })
    }
}

/// BIND_IP (`struct rdma_ucm_bind_ip`, 40 bytes) and BIND (`struct rdma_ucm_bind`, 136).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bind {
    /// The id.
    pub id: u32,
    /// The address.
    pub addr: SocketAddr,
}

impl Bind {
    /// BIND_IP's size.
    pub const IP_LEN: usize = size_of::<UcmBindIp>();
    /// BIND's size.
    pub const LEN: usize = size_of::<UcmBind>();

    /// Parses BIND_IP.
    pub fn parse_ip(b: &[u8]) -> Result<Bind, AbiError> {
        let c: UcmBindIp = read(b)?;
        Ok(Bind {
            id: c.id.get(),
            addr: parse_sockaddr(&c.addr)?,
        })
    }

    /// Parses BIND (`addr_size` must be the family's size, `reserved` 0).
    pub fn parse(b: &[u8]) -> Result<Bind, AbiError> {
        let c: UcmBind = read(b)?;
        let (size, reserved) = (c.addr_size.get(), c.reserved.get());
        let kss = &c.addr;
        if reserved != 0 || size == 0 || usize::from(size) != family_len(u16_at(kss, 0)) {
            return Err(AbiError::BadAddr);
        }
        Ok(Bind {
            id: c.id.get(),
            addr: parse_sockaddr(kss)?,
        })
    }
}

/// RESOLVE_IP (64 bytes) and RESOLVE_ADDR (272).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolveAddr {
    /// The id.
    pub id: u32,
    /// How long address resolution may take.
    pub timeout_ms: u32,
    /// The source address, if given.
    pub src: Option<SocketAddr>,
    /// The destination.
    pub dst: SocketAddr,
}

impl ResolveAddr {
    /// RESOLVE_IP's size.
    pub const IP_LEN: usize = size_of::<UcmResolveIp>();
    /// RESOLVE_ADDR's size.
    pub const LEN: usize = size_of::<UcmResolveAddr>();

    /// Parses RESOLVE_IP (a zero source family means "no source").
    pub fn parse_ip(b: &[u8]) -> Result<ResolveAddr, AbiError> {
        let c: UcmResolveIp = read(b)?;
        let src = match u16_at(&c.src_addr, 0) {
            0 => None,
            _ => Some(parse_sockaddr(&c.src_addr)?),
        };
        Ok(ResolveAddr {
            id: c.id.get(),
            timeout_ms: c.timeout_ms.get(),
            src,
            dst: parse_sockaddr(&c.dst_addr)?,
        })
    }

    /// Parses RESOLVE_ADDR (sizes must match the families; a zero source size means no
    /// source).
    pub fn parse(b: &[u8]) -> Result<ResolveAddr, AbiError> {
        let c: UcmResolveAddr = read(b)?;
        let (src_size, dst_size, reserved) = (c.src_size.get(), c.dst_size.get(), c.reserved.get());
        let src_kss = &c.src_addr;
        let dst_kss = &c.dst_addr;
        if reserved != 0
            || (src_size != 0 && usize::from(src_size) != family_len(u16_at(src_kss, 0)))
            || dst_size == 0
            || usize::from(dst_size) != family_len(u16_at(dst_kss, 0))
        {
            return Err(AbiError::BadAddr);
        }
        let src = match src_size {
            0 => None,
            _ => Some(parse_sockaddr(src_kss)?),
        };
        Ok(ResolveAddr {
            id: c.id.get(),
            timeout_ms: c.timeout_ms.get(),
            src,
            dst: parse_sockaddr(dst_kss)?,
        })
    }
}

/// Two u32 fields: RESOLVE_ROUTE (`id`, `timeout_ms`), LISTEN (`id`, `backlog`), NOTIFY
/// (`id`, `event`); DISCONNECT has only the first (4 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdArg {
    /// The id.
    pub id: u32,
    /// The second field.
    pub arg: u32,
}

impl IdArg {
    /// Parses the 8-byte form.
    pub fn parse(b: &[u8]) -> Result<IdArg, AbiError> {
        let c: UcmIdArg = read(b)?;
        Ok(IdArg {
            id: c.id.get(),
            arg: c.arg.get(),
        })
    }

    /// Parses DISCONNECT's 4 bytes.
    pub fn parse_id(b: &[u8]) -> Result<IdArg, AbiError> {
        let c: UcmIdArg = read_min(b, 4)?;
        Ok(IdArg {
            id: c.id.get(),
            arg: 0,
        })
    }
}

/// `struct rdma_ucm_resolve_ib_service` (88 bytes): the id and the service asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolveIbService {
    /// The id.
    pub id: u32,
    /// The service id (`flags` bit 0).
    pub service_id: u64,
    /// The service name (`flags` bit 1), up to its first NUL.
    pub service_name: Vec<u8>,
    /// `RDMA_USER_CM_IB_SERVICE_FLAG_*`.
    pub flags: u32,
}

impl ResolveIbService {
    /// Size.
    pub const LEN: usize = size_of::<UcmResolveIbService>();
    /// Parses the whole structure (the kernel copies all of it).
    pub fn parse(b: &[u8]) -> Result<ResolveIbService, AbiError> {
        let c: UcmResolveIbService = read(b)?;
        let end = c.service_name.iter().position(|&x| x == 0).unwrap_or(64);
        Ok(ResolveIbService {
            id: c.id.get(),
            service_id: c.service_id.get(),
            service_name: c.service_name[..end].to_vec(),
            flags: c.flags.get(),
        })
    }
}

/// `struct rdma_ucm_write_cm_event` (320 bytes): an event for the id's own file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteCmEvent {
    /// The id.
    pub id: u32,
    /// The event type (USER or INTERNAL are taken).
    pub event: u32,
    /// The status GET_EVENT reports.
    pub status: i32,
    /// `param.arg`, which GET_EVENT reports in `param.arg32`.
    pub arg: u64,
}

impl WriteCmEvent {
    /// Size.
    pub const LEN: usize = size_of::<UcmWriteCmEvent>();
    /// What the kernel reads of it: up to and with `param.arg`.
    pub const MIN_LEN: usize = 24;

    /// Parses; the union past `arg` (the conn and UD parameters, which the kernel does
    /// not use) may be absent.
    pub fn parse(b: &[u8]) -> Result<WriteCmEvent, AbiError> {
        let c: UcmWriteCmEvent = read_min(b, Self::MIN_LEN)?;
        Ok(WriteCmEvent {
            id: c.id.get(),
            event: c.event.get(),
            status: c.status.get(),
            arg: u64_at(&c.param, 0),
        })
    }

    /// The structure's bytes, as librdmacm writes them.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut c = UcmWriteCmEvent::new_zeroed();
        c.id = self.id.into();
        c.event = self.event.into();
        c.status = self.status.into();
        put(&mut c.param, 0, &self.arg.to_le_bytes());
        bytes(&c)
    }
}

/// A command with a response address, an id and a u32: QUERY_ROUTE and QUERY
/// (`struct rdma_ucm_query`: option), INIT_QP_ATTR (qp_state), MIGRATE_ID (fd); all 16
/// bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RespIdArg {
    /// Where the response goes.
    pub response: u64,
    /// The id.
    pub id: u32,
    /// The third field.
    pub arg: u32,
}

impl RespIdArg {
    /// Size.
    pub const LEN: usize = size_of::<UcmRespIdArg>();
    /// Parses.
    pub fn parse(b: &[u8]) -> Result<RespIdArg, AbiError> {
        let c: UcmRespIdArg = read(b)?;
        Ok(RespIdArg {
            response: c.response.get(),
            id: c.id.get(),
            arg: c.arg.get(),
        })
    }
}

/// `struct rdma_ucm_conn_param` (272 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnParam {
    /// QPN (24 bits).
    pub qp_num: u32,
    /// Q_Key (AF_IB only).
    pub qkey: u32,
    /// Private data.
    pub private_data: Vec<u8>,
    /// SRQ.
    pub srq: bool,
    /// Responder resources.
    pub responder_resources: u8,
    /// Initiator depth.
    pub initiator_depth: u8,
    /// Flow control.
    pub flow_control: bool,
    /// Retry count.
    pub retry_count: u8,
    /// RNR retry count.
    pub rnr_retry_count: u8,
    /// Whether the structure was filled (`valid`).
    pub valid: bool,
}

impl ConnParam {
    /// Size.
    pub const LEN: usize = size_of::<UcmConnParam>();

    /// Parses (private data cut to its length, at most 256).
    pub fn parse(b: &[u8]) -> Result<ConnParam, AbiError> {
        Ok(ConnParam::of(&read(b)?))
    }

    /// From the kernel's structure.
    fn of(c: &UcmConnParam) -> ConnParam {
        let len = usize::from(c.private_data_len);
        ConnParam {
            qp_num: c.qp_num.get(),
            qkey: c.qkey.get(),
            private_data: c.private_data[..len].to_vec(),
            srq: c.srq != 0,
            responder_resources: c.responder_resources,
            initiator_depth: c.initiator_depth,
            flow_control: c.flow_control != 0,
            retry_count: c.retry_count,
            rnr_retry_count: c.rnr_retry_count,
            valid: c.valid != 0,
        }
    }

    /// The kernel's structure (private data cut to the 256 bytes the field holds).
    fn layout(&self) -> UcmConnParam {
        let n = self.private_data.len().min(MAX_PRIVATE_DATA);
        let mut private_data = [0u8; MAX_PRIVATE_DATA];
        private_data[..n].copy_from_slice(&self.private_data[..n]);
        UcmConnParam {
            qp_num: self.qp_num.into(),
            qkey: self.qkey.into(),
            private_data,
            private_data_len: n as u8,
            srq: u8::from(self.srq),
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: u8::from(self.flow_control),
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            valid: u8::from(self.valid),
        }
    }

    /// Writes the structure into `b` (272 bytes).
    pub fn emit(&self, b: &mut [u8]) {
        put(b, 0, self.layout().as_bytes());
    }

    /// An empty parameter set (what an event without one carries).
    pub fn empty() -> ConnParam {
        ConnParam {
            qp_num: 0,
            qkey: 0,
            private_data: Vec::new(),
            srq: false,
            responder_resources: 0,
            initiator_depth: 0,
            flow_control: false,
            retry_count: 0,
            rnr_retry_count: 0,
            valid: false,
        }
    }
}

/// `struct rdma_ucm_ece`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ece {
    /// Vendor ID.
    pub vendor_id: u32,
    /// Options.
    pub attr_mod: u32,
}

impl Ece {
    fn of(e: &UcmEce) -> Ece {
        Ece {
            vendor_id: e.vendor_id.get(),
            attr_mod: e.attr_mod.get(),
        }
    }

    fn layout(&self) -> UcmEce {
        UcmEce {
            vendor_id: self.vendor_id.into(),
            attr_mod: self.attr_mod.into(),
        }
    }
}

/// CONNECT (`struct rdma_ucm_connect`, 288 bytes; 280 without the ECE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// Parameters.
    pub conn: ConnParam,
    /// The id.
    pub id: u32,
    /// ECE, when given.
    pub ece: Ece,
}

impl Connect {
    /// Size with the ECE.
    pub const LEN: usize = size_of::<UcmConnect>();
    /// The least the kernel takes (up to `reserved`).
    pub const MIN_LEN: usize = Self::LEN - size_of::<UcmEce>();

    /// Parses (the ECE only when the whole structure is there).
    pub fn parse(b: &[u8]) -> Result<Connect, AbiError> {
        let c: UcmConnect = read_min(b, Self::MIN_LEN)?;
        Ok(Connect {
            conn: ConnParam::of(&c.conn_param),
            id: c.id.get(),
            ece: if b.len() >= Self::LEN {
                Ece::of(&c.ece)
            } else {
                Ece::default()
            },
        })
    }
}

/// ACCEPT (`struct rdma_ucm_accept`, 296 bytes; 288 without the ECE).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accept {
    /// The context for the id's later events.
    pub uid: u64,
    /// Parameters (`valid` 0: the active side's "send the RTU").
    pub conn: ConnParam,
    /// The id.
    pub id: u32,
}

impl Accept {
    /// Size with the ECE.
    pub const LEN: usize = size_of::<UcmAccept>();
    /// The least the kernel takes.
    pub const MIN_LEN: usize = Self::LEN - size_of::<UcmEce>();

    /// Parses.
    pub fn parse(b: &[u8]) -> Result<Accept, AbiError> {
        let c: UcmAccept = read_min(b, Self::MIN_LEN)?;
        Ok(Accept {
            uid: c.uid.get(),
            conn: ConnParam::of(&c.conn_param),
            id: c.id.get(),
        })
    }
}

/// REJECT (`struct rdma_ucm_reject`, 264 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// The id.
    pub id: u32,
    /// Reason (0: CONSUMER_DEFINED).
    pub reason: u8,
    /// Private data.
    pub private_data: Vec<u8>,
}

impl Reject {
    /// Size.
    pub const LEN: usize = size_of::<UcmReject>();
    /// Parses.
    pub fn parse(b: &[u8]) -> Result<Reject, AbiError> {
        let c: UcmReject = read(b)?;
        let len = usize::from(c.private_data_len);
        Ok(Reject {
            id: c.id.get(),
            reason: c.reason,
            private_data: c.private_data[..len].to_vec(),
        })
    }
}

/// GET_EVENT (`struct rdma_ucm_get_event`, 8 bytes).
pub fn parse_get_event(b: &[u8]) -> Result<u64, AbiError> {
    need(b, 8)?;
    Ok(u64_at(b, 0))
}

/// SET_OPTION (`struct rdma_ucm_set_option`, 24 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetOption {
    /// Where the value is in the caller's memory.
    pub optval: u64,
    /// The id.
    pub id: u32,
    /// Level.
    pub level: u32,
    /// Option.
    pub optname: u32,
    /// The value's size.
    pub optlen: u32,
}

impl SetOption {
    /// Size.
    pub const LEN: usize = size_of::<UcmSetOption>();
    /// Parses.
    pub fn parse(b: &[u8]) -> Result<SetOption, AbiError> {
        let c: UcmSetOption = read(b)?;
        Ok(SetOption {
            optval: c.optval.get(),
            id: c.id.get(),
            level: c.level.get(),
            optname: c.optname.get(),
            optlen: c.optlen.get(),
        })
    }
}

/// JOIN_IP_MCAST (48 bytes) and JOIN_MCAST (152).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JoinMcast {
    /// Where `rdma_ucm_create_id_resp` goes.
    pub response: u64,
    /// The caller's context for the join's events.
    pub uid: u64,
    /// The id.
    pub id: u32,
    /// The group.
    pub addr: SocketAddr,
    /// Join flags (0 full member, 1 send-only full member).
    pub join_flags: u16,
}

impl JoinMcast {
    /// JOIN_IP_MCAST's size.
    pub const IP_LEN: usize = size_of::<UcmJoinIpMcast>();
    /// JOIN_MCAST's size.
    pub const LEN: usize = size_of::<UcmJoinMcast>();

    /// Parses JOIN_IP_MCAST.
    pub fn parse_ip(b: &[u8]) -> Result<JoinMcast, AbiError> {
        let c: UcmJoinIpMcast = read(b)?;
        Ok(JoinMcast {
            response: c.response.get(),
            uid: c.uid.get(),
            id: c.id.get(),
            addr: parse_sockaddr(&c.addr)?,
            join_flags: 0,
        })
    }

    /// Parses JOIN_MCAST.
    pub fn parse(b: &[u8]) -> Result<JoinMcast, AbiError> {
        let c: UcmJoinMcast = read(b)?;
        let kss = &c.addr;
        if usize::from(c.addr_size.get()) != family_len(u16_at(kss, 0)) {
            return Err(AbiError::BadAddr);
        }
        Ok(JoinMcast {
            response: c.response.get(),
            uid: c.uid.get(),
            id: c.id.get(),
            addr: parse_sockaddr(kss)?,
            join_flags: c.join_flags.get(),
        })
    }
}

// ------------------------------------------------------------------ responses

/// `struct ib_uverbs_ah_attr` (32 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Flow label.
    pub flow_label: u32,
    /// Source GID table index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Destination LID (0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Static rate.
    pub static_rate: u8,
    /// A GRH is present (always on RoCE).
    pub is_global: bool,
    /// Port number (1-based).
    pub port_num: u8,
}

impl AhAttr {
    /// Size.
    pub const LEN: usize = size_of::<UverbsAhAttr>();

    fn layout(&self) -> UverbsAhAttr {
        UverbsAhAttr {
            dgid: self.dgid,
            flow_label: self.flow_label.into(),
            sgid_index: self.sgid_index,
            hop_limit: self.hop_limit,
            traffic_class: self.traffic_class,
            reserved: 0,
            dlid: self.dlid.into(),
            sl: self.sl,
            src_path_bits: 0,
            static_rate: self.static_rate,
            is_global: u8::from(self.is_global),
            port_num: self.port_num,
            reserved2: 0,
        }
    }

    fn of(a: &UverbsAhAttr) -> AhAttr {
        AhAttr {
            dgid: a.dgid,
            flow_label: a.flow_label.get(),
            sgid_index: a.sgid_index,
            hop_limit: a.hop_limit,
            traffic_class: a.traffic_class,
            dlid: a.dlid.get(),
            sl: a.sl,
            static_rate: a.static_rate,
            is_global: a.is_global != 0,
            port_num: a.port_num,
        }
    }

    /// Writes the structure into `b` (32 bytes).
    pub fn emit(&self, b: &mut [u8]) {
        put(b, 0, self.layout().as_bytes());
    }

    /// Reads the structure.
    pub fn parse(b: &[u8]) -> Result<AhAttr, AbiError> {
        Ok(AhAttr::of(&read(b)?))
    }
}

/// `struct rdma_ucm_ud_param` (304 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdParam {
    /// The remote UD QPN.
    pub qp_num: u32,
    /// Its Q_Key.
    pub qkey: u32,
    /// How to reach it.
    pub ah_attr: AhAttr,
    /// Private data.
    pub private_data: Vec<u8>,
}

impl UdParam {
    /// Size.
    pub const LEN: usize = size_of::<UcmUdParam>();

    fn layout(&self) -> UcmUdParam {
        let n = self.private_data.len().min(MAX_PRIVATE_DATA);
        let mut private_data = [0u8; MAX_PRIVATE_DATA];
        private_data[..n].copy_from_slice(&self.private_data[..n]);
        UcmUdParam {
            qp_num: self.qp_num.into(),
            qkey: self.qkey.into(),
            ah_attr: self.ah_attr.layout(),
            private_data,
            private_data_len: n as u8,
            reserved: [0; 7],
        }
    }

    /// Writes the structure into `b` (304 bytes).
    pub fn emit(&self, b: &mut [u8]) {
        put(b, 0, self.layout().as_bytes());
    }
}

/// An event's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventParam {
    /// A connected-mode id's.
    Conn(ConnParam),
    /// A UD id's.
    Ud(UdParam),
    /// A written event's (USER, INTERNAL) argument: the first 8 bytes, in the ABI's
    /// byte order (`param.arg32[2]` holds the `__u64` as the kernel copies it).
    Arg(u64),
}

/// `struct rdma_ucm_event_resp` (336 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventResp {
    /// The id's context (the listener's for CONNECT_REQUEST).
    pub uid: u64,
    /// The id (the new one for CONNECT_REQUEST).
    pub id: u32,
    /// Event type.
    pub event: u32,
    /// Status (a negative errno, or a REJ reason).
    pub status: i32,
    /// Parameters.
    pub param: EventParam,
    /// ECE.
    pub ece: Ece,
}

impl EventResp {
    /// The id the restart event names (see [`EventResp::restart`]).
    pub const RESTART_ID: u32 = 0x7FFF_FFFF;

    /// The restart event: what a GET_EVENT interrupted by a signal is answered (the
    /// kernel restarts it, which a CUSE server cannot ask for). librdmacm's
    /// `rdma_get_cm_event` (rdma-core 17 to 64 at least) discards an event of uid 0
    /// whose id its index map does not hold, and writes GET_EVENT again; its map holds
    /// ids up to 0xFFFF and reads the id as an `int`, so this id is positive and beyond
    /// it. Nothing is counted as reported.
    pub fn restart() -> EventResp {
        EventResp {
            uid: 0,
            id: Self::RESTART_ID,
            event: 0,
            status: 0,
            param: EventParam::Conn(ConnParam::empty()),
            ece: Ece::default(),
        }
    }

    /// Size.
    pub const LEN: usize = size_of::<UcmEventResp>();
    /// The least a caller's buffer must hold (the kernel takes old 32-bit callers
    /// without `reserved` and `ece`).
    pub const MIN_OUT: usize = Self::LEN - size_of::<u32>() - size_of::<UcmEce>();

    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut r = UcmEventResp::new_zeroed();
        r.uid = self.uid.into();
        r.id = self.id.into();
        r.event = self.event.into();
        r.status = self.status.into();
        match &self.param {
            EventParam::Conn(c) => put(&mut r.param, 0, c.layout().as_bytes()),
            EventParam::Ud(u) => put(&mut r.param, 0, u.layout().as_bytes()),
            EventParam::Arg(a) => put(&mut r.param, 0, &a.to_le_bytes()),
        }
        r.ece = self.ece.layout();
        bytes(&r)
    }
}

/// `struct ib_user_path_rec` (64 bytes): a RoCE route's path as QUERY_ROUTE reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UserPathRec {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Source GID.
    pub sgid: [u8; 16],
    /// Flow label (host order; written big-endian).
    pub flow_label: u32,
    /// Reversible.
    pub reversible: bool,
    /// MTU (IBTA code).
    pub mtu: u8,
    /// P_Key.
    pub pkey: u16,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Service level.
    pub sl: u8,
    /// Rate (IBTA code).
    pub rate: u8,
    /// Packet lifetime (5-bit exponent).
    pub packet_life_time: u8,
}

impl UserPathRec {
    /// Size.
    pub const LEN: usize = size_of::<layout::UserPathRec>();

    /// The kernel's structure; selectors are "exactly" (2).
    fn layout(&self) -> layout::UserPathRec {
        layout::UserPathRec {
            dgid: self.dgid,
            sgid: self.sgid,
            dlid: 0.into(),
            slid: 0.into(),
            raw_traffic: 0.into(),
            flow_label: self.flow_label.into(),
            reversible: u32::from(self.reversible).into(),
            mtu: u32::from(self.mtu).into(),
            pkey: self.pkey.into(),
            hop_limit: self.hop_limit,
            traffic_class: self.traffic_class,
            numb_path: 1,
            sl: self.sl,
            mtu_selector: 2,
            rate_selector: 2,
            rate: self.rate,
            packet_life_time_selector: 2,
            packet_life_time: self.packet_life_time,
            preference: 0,
        }
    }

    fn of(p: &layout::UserPathRec) -> UserPathRec {
        UserPathRec {
            dgid: p.dgid,
            sgid: p.sgid,
            flow_label: p.flow_label.get(),
            reversible: p.reversible.get() != 0,
            mtu: p.mtu.get() as u8,
            pkey: p.pkey.get(),
            hop_limit: p.hop_limit,
            traffic_class: p.traffic_class,
            sl: p.sl,
            rate: p.rate,
            packet_life_time: p.packet_life_time,
        }
    }

    /// Writes the structure into `b` (64 bytes); selectors are "exactly" (2).
    pub fn emit(&self, b: &mut [u8]) {
        put(b, 0, self.layout().as_bytes());
    }
}

/// `struct rdma_ucm_query_route_resp` (208 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryRouteResp {
    /// The device's node GUID (as the kernel stores it: the big-endian GUID's bytes).
    pub node_guid_be: u64,
    /// Paths (0 before route resolution on RoCE; then 1).
    pub paths: [Option<UserPathRec>; 2],
    /// Source address.
    pub src: Option<SocketAddr>,
    /// Destination address.
    pub dst: Option<SocketAddr>,
    /// Paths reported.
    pub num_paths: u32,
    /// Port number (0: no device).
    pub port_num: u8,
    /// The device's index.
    pub ibdev_index: u32,
}

impl QueryRouteResp {
    /// Size.
    pub const LEN: usize = size_of::<UcmQueryRouteResp>();
    /// The least a caller's buffer must hold (up to `ibdev_index`).
    pub const MIN_OUT: usize = Self::LEN - 2 * size_of::<u32>();

    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut r = UcmQueryRouteResp::new_zeroed();
        r.node_guid = self.node_guid_be.into();
        for (slot, p) in r.ib_route.iter_mut().zip(&self.paths) {
            if let Some(p) = p {
                *slot = p.layout();
            }
        }
        if let Some(a) = &self.src {
            emit_sockaddr(a, &mut r.src_addr);
        }
        if let Some(a) = &self.dst {
            emit_sockaddr(a, &mut r.dst_addr);
        }
        r.num_paths = self.num_paths.into();
        r.port_num = self.port_num;
        r.ibdev_index = self.ibdev_index.into();
        bytes(&r)
    }
}

/// `struct rdma_ucm_query_addr_resp` (280 bytes), for QUERY's ADDR and GID options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryAddrResp {
    /// The device's node GUID (big-endian GUID's bytes).
    pub node_guid_be: u64,
    /// Port number.
    pub port_num: u8,
    /// P_Key (big-endian value's bytes, as the kernel stores it).
    pub pkey_be: u16,
    /// The source address's bytes and size.
    pub src: ([u8; SOCKADDR_STORAGE_LEN], u16),
    /// The destination's.
    pub dst: ([u8; SOCKADDR_STORAGE_LEN], u16),
    /// The device's index.
    pub ibdev_index: u32,
}

impl QueryAddrResp {
    /// Size.
    pub const LEN: usize = size_of::<UcmQueryAddrResp>();
    /// The least a caller's buffer must hold.
    pub const MIN_OUT: usize = Self::LEN - 2 * size_of::<u32>();

    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let r = UcmQueryAddrResp {
            node_guid: self.node_guid_be.into(),
            port_num: self.port_num,
            reserved: 0,
            pkey: self.pkey_be.into(),
            src_size: self.src.1.into(),
            dst_size: self.dst.1.into(),
            src_addr: self.src.0,
            dst_addr: self.dst.0,
            ibdev_index: self.ibdev_index.into(),
            reserved1: 0.into(),
        };
        bytes(&r)
    }
}

/// `struct ib_uverbs_qp_attr` (144 bytes): INIT_QP_ATTR's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct UverbsQpAttr {
    /// Which fields are set.
    pub qp_attr_mask: u32,
    /// Target state.
    pub qp_state: u32,
    /// Path MTU.
    pub path_mtu: u32,
    /// Q_Key.
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Destination QPN.
    pub dest_qp_num: u32,
    /// Access flags.
    pub qp_access_flags: u32,
    /// Address vector.
    pub ah_attr: AhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Initiator depth.
    pub max_rd_atomic: u8,
    /// Responder resources.
    pub max_dest_rd_atomic: u8,
    /// Minimum RNR timer.
    pub min_rnr_timer: u8,
    /// Port.
    pub port_num: u8,
    /// Local ACK timeout.
    pub timeout: u8,
    /// Retry count.
    pub retry_cnt: u8,
    /// RNR retry count.
    pub rnr_retry: u8,
}

impl UverbsQpAttr {
    /// Size.
    pub const LEN: usize = size_of::<layout::UverbsQpAttr>();

    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut r = layout::UverbsQpAttr::new_zeroed();
        r.qp_attr_mask = self.qp_attr_mask.into();
        r.qp_state = self.qp_state.into();
        r.path_mtu = self.path_mtu.into();
        r.qkey = self.qkey.into();
        r.rq_psn = self.rq_psn.into();
        r.sq_psn = self.sq_psn.into();
        r.dest_qp_num = self.dest_qp_num.into();
        r.qp_access_flags = self.qp_access_flags.into();
        r.ah_attr = self.ah_attr.layout();
        r.pkey_index = self.pkey_index.into();
        r.max_rd_atomic = self.max_rd_atomic;
        r.max_dest_rd_atomic = self.max_dest_rd_atomic;
        r.min_rnr_timer = self.min_rnr_timer;
        r.port_num = self.port_num;
        r.timeout = self.timeout;
        r.retry_cnt = self.retry_cnt;
        r.rnr_retry = self.rnr_retry;
        bytes(&r)
    }

    /// Reads the structure (for clients and tests).
    pub fn parse(b: &[u8]) -> Result<UverbsQpAttr, AbiError> {
        let r: layout::UverbsQpAttr = read(b)?;
        Ok(UverbsQpAttr {
            qp_attr_mask: r.qp_attr_mask.get(),
            qp_state: r.qp_state.get(),
            path_mtu: r.path_mtu.get(),
            qkey: r.qkey.get(),
            rq_psn: r.rq_psn.get(),
            sq_psn: r.sq_psn.get(),
            dest_qp_num: r.dest_qp_num.get(),
            qp_access_flags: r.qp_access_flags.get(),
            ah_attr: AhAttr::of(&r.ah_attr),
            pkey_index: r.pkey_index.get(),
            max_rd_atomic: r.max_rd_atomic,
            max_dest_rd_atomic: r.max_dest_rd_atomic,
            min_rnr_timer: r.min_rnr_timer,
            port_num: r.port_num,
            timeout: r.timeout,
            retry_cnt: r.retry_cnt,
            rnr_retry: r.rnr_retry,
        })
    }
}

// ------------------------------------------------------------------ the client side

// A client of the device (`service::client`) writes the commands and reads the
// responses: the inverses of the parsers and writers above, at the same offsets.

/// A command's bytes: the header (`in` = the structure's size, `out` = `out_len`) and
/// the structure.
pub fn command(code: u32, body: &[u8], out_len: u16) -> Vec<u8> {
    let mut b = vec![0u8; HDR_LEN + body.len()];
    CmdHdr {
        cmd: code,
        in_len: body.len() as u16,
        out_len,
    }
    .emit(&mut b);
    b[HDR_LEN..].copy_from_slice(body);
    b
}

impl CreateId {
    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        bytes(&UcmCreateId {
            uid: self.uid.into(),
            response: self.response.into(),
            ps: self.ps.into(),
            qp_type: self.qp_type,
            reserved: [0; 5],
        })
    }
}

impl DestroyId {
    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        bytes(&UcmDestroyId {
            response: self.response.into(),
            id: self.id.into(),
            reserved: 0.into(),
        })
    }
}

impl Bind {
    /// BIND_IP's bytes.
    pub fn to_bytes_ip(&self) -> [u8; Self::IP_LEN] {
        let mut c = UcmBindIp::new_zeroed();
        emit_sockaddr(&self.addr, &mut c.addr);
        c.id = self.id.into();
        bytes(&c)
    }
}

impl ResolveAddr {
    /// RESOLVE_IP's bytes (no source: a zero family).
    pub fn to_bytes_ip(&self) -> [u8; Self::IP_LEN] {
        let mut c = UcmResolveIp::new_zeroed();
        if let Some(src) = &self.src {
            emit_sockaddr(src, &mut c.src_addr);
        }
        emit_sockaddr(&self.dst, &mut c.dst_addr);
        c.id = self.id.into();
        c.timeout_ms = self.timeout_ms.into();
        bytes(&c)
    }
}

impl IdArg {
    /// The 8-byte form's bytes.
    pub fn to_bytes(&self) -> [u8; 8] {
        bytes(&UcmIdArg {
            id: self.id.into(),
            arg: self.arg.into(),
        })
    }

    /// DISCONNECT's 4 bytes.
    pub fn to_bytes_id(&self) -> [u8; 4] {
        self.id.to_le_bytes()
    }
}

impl RespIdArg {
    /// The structure's bytes.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        bytes(&UcmRespIdArg {
            response: self.response.into(),
            id: self.id.into(),
            arg: self.arg.into(),
        })
    }
}

impl Connect {
    /// The structure's bytes, with the ECE.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        bytes(&UcmConnect {
            conn_param: self.conn.layout(),
            id: self.id.into(),
            reserved: 0.into(),
            ece: self.ece.layout(),
        })
    }
}

impl Accept {
    /// The structure's bytes (ECE zero).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        bytes(&UcmAccept {
            uid: self.uid.into(),
            conn_param: self.conn.layout(),
            id: self.id.into(),
            reserved: 0.into(),
            ece: Ece::default().layout(),
        })
    }
}

impl Reject {
    /// The structure's bytes (private data cut to the 256 bytes the field holds).
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let n = self.private_data.len().min(MAX_PRIVATE_DATA);
        let mut c = UcmReject::new_zeroed();
        c.id = self.id.into();
        c.private_data_len = n as u8;
        c.reason = self.reason;
        c.private_data[..n].copy_from_slice(&self.private_data[..n]);
        bytes(&c)
    }
}

/// GET_EVENT's bytes.
pub fn get_event_bytes(response: u64) -> [u8; 8] {
    response.to_le_bytes()
}

impl UdParam {
    /// Reads the structure (private data cut to its length).
    pub fn parse(b: &[u8]) -> Result<UdParam, AbiError> {
        let u: UcmUdParam = read(b)?;
        let len = usize::from(u.private_data_len).min(MAX_PRIVATE_DATA);
        Ok(UdParam {
            qp_num: u.qp_num.get(),
            qkey: u.qkey.get(),
            ah_attr: AhAttr::of(&u.ah_attr),
            private_data: u.private_data[..len].to_vec(),
        })
    }
}

impl EventResp {
    /// Reads an event a GET_EVENT answered: its parameters as a UD id's when `ud`, else
    /// as a connected-mode id's. The ECE is zero when the buffer ends before it.
    pub fn parse(b: &[u8], ud: bool) -> Result<EventResp, AbiError> {
        let r: UcmEventResp = read_min(b, Self::MIN_OUT)?;
        let param = if ud {
            EventParam::Ud(UdParam::parse(&r.param)?)
        } else {
            EventParam::Conn(ConnParam::parse(&r.param)?)
        };
        Ok(EventResp {
            uid: r.uid.get(),
            id: r.id.get(),
            event: r.event.get(),
            status: r.status.get(),
            param,
            ece: if b.len() >= Self::LEN {
                Ece::of(&r.ece)
            } else {
                Ece::default()
            },
        })
    }
}

impl UserPathRec {
    /// Reads the structure.
    pub fn parse(b: &[u8]) -> Result<UserPathRec, AbiError> {
        Ok(UserPathRec::of(&read(b)?))
    }
}

impl QueryRouteResp {
    /// Reads the structure: the paths it reports (`num_paths`, at most 2), the
    /// addresses that are set (a zero family is none).
    pub fn parse(b: &[u8]) -> Result<QueryRouteResp, AbiError> {
        let r: UcmQueryRouteResp = read_min(b, Self::MIN_OUT)?;
        let num_paths = r.num_paths.get();
        let mut paths = [None, None];
        for (i, (p, raw)) in paths.iter_mut().zip(&r.ib_route).enumerate() {
            if (i as u32) < num_paths {
                *p = Some(UserPathRec::of(raw));
            }
        }
        let addr = |a: &[u8]| match u16_at(a, 0) {
            0 => Ok(None),
            _ => parse_sockaddr(a).map(Some),
        };
        Ok(QueryRouteResp {
            node_guid_be: r.node_guid.get(),
            paths,
            src: addr(&r.src_addr)?,
            dst: addr(&r.dst_addr)?,
            num_paths,
            port_num: r.port_num,
            ibdev_index: if b.len() >= Self::MIN_OUT + size_of::<u32>() {
                r.ibdev_index.get()
            } else {
                0
            },
        })
    }
}

#[cfg(test)]
mod client_side_tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap_or_else(|_| unreachable!())
    }

    /// Every writer is the inverse of its parser.
    #[test]
    fn commands_round_trip() {
        let c = CreateId {
            uid: 0x1122_3344_5566_7788,
            response: 0x7fff_0000_1000,
            ps: ps::TCP,
            qp_type: 2,
        };
        assert_eq!(CreateId::parse(&c.to_bytes()), Ok(c));
        let d = DestroyId {
            response: 0x7fff_0000_2000,
            id: 9,
        };
        assert_eq!(DestroyId::parse(&d.to_bytes()), Ok(d));
        let b = Bind {
            id: 3,
            addr: sa("0.0.0.0:7471"),
        };
        assert_eq!(Bind::parse_ip(&b.to_bytes_ip()), Ok(b));
        for src in [None, Some(sa("10.99.0.11:4000"))] {
            let r = ResolveAddr {
                id: 4,
                timeout_ms: 2000,
                src,
                dst: sa("10.99.0.2:7471"),
            };
            assert_eq!(ResolveAddr::parse_ip(&r.to_bytes_ip()), Ok(r));
        }
        let r6 = ResolveAddr {
            id: 5,
            timeout_ms: 1,
            src: None,
            dst: sa("[fd99::2]:7471"),
        };
        assert_eq!(ResolveAddr::parse_ip(&r6.to_bytes_ip()), Ok(r6));
        let a = IdArg { id: 6, arg: 1024 };
        assert_eq!(IdArg::parse(&a.to_bytes()), Ok(a));
        assert_eq!(IdArg::parse_id(&a.to_bytes_id()).map(|x| x.id), Ok(6));
        let q = RespIdArg {
            response: 0x1000,
            id: 7,
            arg: 2,
        };
        assert_eq!(RespIdArg::parse(&q.to_bytes()), Ok(q));
        let conn = ConnParam {
            qp_num: 0x1234,
            qkey: 0,
            private_data: b"hello".to_vec(),
            srq: false,
            responder_resources: 0xFF,
            initiator_depth: 0xFF,
            flow_control: false,
            retry_count: 7,
            rnr_retry_count: 7,
            valid: true,
        };
        let k = Connect {
            conn: conn.clone(),
            id: 8,
            ece: Ece {
                vendor_id: 1,
                attr_mod: 2,
            },
        };
        assert_eq!(Connect::parse(&k.to_bytes()), Ok(k));
        let acc = Accept {
            uid: 0x99,
            conn,
            id: 10,
        };
        assert_eq!(Accept::parse(&acc.to_bytes()), Ok(acc));
        let rej = Reject {
            id: 11,
            reason: 0,
            private_data: b"no".to_vec(),
        };
        assert_eq!(Reject::parse(&rej.to_bytes()), Ok(rej));
        assert_eq!(parse_get_event(&get_event_bytes(0xabc)), Ok(0xabc));
        let cmd = command(cmd::LISTEN, &a.to_bytes(), 0);
        assert_eq!(
            CmdHdr::parse(&cmd),
            Ok(CmdHdr {
                cmd: cmd::LISTEN,
                in_len: 8,
                out_len: 0
            })
        );
        assert_eq!(cmd.len(), HDR_LEN + 8);
    }

    #[test]
    fn responses_round_trip() {
        let e = EventResp {
            uid: 5,
            id: 6,
            event: event::REJECTED,
            status: 28,
            param: EventParam::Conn(ConnParam {
                private_data: vec![1; 148],
                ..ConnParam::empty()
            }),
            ece: Ece::default(),
        };
        assert_eq!(EventResp::parse(&e.to_bytes(), false), Ok(e.clone()));
        assert!(matches!(
            EventResp::parse(&e.to_bytes()[..100], false),
            Err(AbiError::Short { need: 324, .. })
        ));
        let u = EventResp {
            param: EventParam::Ud(UdParam {
                qp_num: 0x44,
                qkey: 0x0123_4567,
                ah_attr: AhAttr {
                    dgid: [7; 16],
                    hop_limit: 64,
                    is_global: true,
                    port_num: 1,
                    ..AhAttr::default()
                },
                private_data: vec![2; 136],
            }),
            ..e
        };
        assert_eq!(EventResp::parse(&u.to_bytes(), true), Ok(u));
        let p = UserPathRec {
            dgid: [1; 16],
            sgid: [2; 16],
            flow_label: 0x12345,
            reversible: true,
            mtu: 3,
            pkey: 0xFFFF,
            hop_limit: 64,
            traffic_class: 0,
            sl: 0,
            rate: 0,
            packet_life_time: 18,
        };
        let r = QueryRouteResp {
            node_guid_be: 0x1122,
            paths: [Some(p), None],
            src: Some(sa("10.99.0.11:40000")),
            dst: Some(sa("10.99.0.2:7471")),
            num_paths: 1,
            port_num: 1,
            ibdev_index: 0,
        };
        assert_eq!(QueryRouteResp::parse(&r.to_bytes()), Ok(r));
        let none = QueryRouteResp {
            paths: [None, None],
            src: None,
            dst: None,
            num_paths: 0,
            ..r
        };
        assert_eq!(QueryRouteResp::parse(&none.to_bytes()), Ok(none));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes and offsets from `offsetof` on rdma-core v44's kernel headers.
    #[test]
    fn layouts() {
        assert_eq!(CreateId::LEN, 24);
        assert_eq!(DestroyId::LEN, 16);
        assert_eq!(Bind::IP_LEN, 40);
        assert_eq!(Bind::LEN, 136);
        assert_eq!(ResolveAddr::IP_LEN, 64);
        assert_eq!(ResolveAddr::LEN, 272);
        assert_eq!(QueryRouteResp::LEN, 208);
        assert_eq!(QueryAddrResp::LEN, 280);
        assert_eq!(ConnParam::LEN, 272);
        assert_eq!(UdParam::LEN, 304);
        assert_eq!(Connect::LEN, 288);
        assert_eq!(Accept::LEN, 296);
        assert_eq!(Reject::LEN, 264);
        assert_eq!(JoinMcast::IP_LEN, 48);
        assert_eq!(JoinMcast::LEN, 152);
        assert_eq!(EventResp::LEN, 336);
        assert_eq!(SetOption::LEN, 24);
        assert_eq!(UverbsQpAttr::LEN, 144);
        assert_eq!(AhAttr::LEN, 32);
        assert_eq!(UserPathRec::LEN, 64);
    }

    #[test]
    fn sockaddrs_round_trip() {
        let v4: SocketAddr = "10.99.0.11:7471".parse().unwrap_or_else(|_| unreachable!());
        let mut b = [0u8; 28];
        assert_eq!(emit_sockaddr(&v4, &mut b), 16);
        assert_eq!(&b[0..4], &[2, 0, 0x1d, 0x2f]);
        assert_eq!(parse_sockaddr(&b), Ok(v4));
        let v6 = SocketAddr::V6(SocketAddrV6::new(
            "fd99::11".parse().unwrap_or(Ipv6Addr::LOCALHOST),
            7174,
            0x12345,
            3,
        ));
        assert_eq!(emit_sockaddr(&v6, &mut b), 28);
        assert_eq!(parse_sockaddr(&b), Ok(v6));
        b[0] = 27;
        assert_eq!(
            parse_sockaddr(&b),
            Err(AbiError::BadAddr),
            "too short for AF_IB"
        );
        let mut ib = [0u8; 48];
        emit_sockaddr_ib([1; 16], 0xffff, 7, &mut ib);
        assert_eq!(parse_sockaddr(&ib), Err(AbiError::AfIb));
        assert_eq!(parse_sockaddr(&[9, 9, 0, 0]), Err(AbiError::BadAddr));
    }

    #[test]
    fn bind_checks_size_and_reserved() {
        let mut b = [0u8; 136];
        put_u32(&mut b, 0, 5);
        put_u16(&mut b, 4, 16);
        emit_sockaddr(
            &"0.0.0.0:0".parse().unwrap_or_else(|_| unreachable!()),
            &mut b[8..],
        );
        assert_eq!(Bind::parse(&b).map(|x| x.id), Ok(5));
        put_u16(&mut b, 4, 28);
        assert_eq!(Bind::parse(&b), Err(AbiError::BadAddr));
        put_u16(&mut b, 4, 16);
        put_u16(&mut b, 6, 1);
        assert_eq!(Bind::parse(&b), Err(AbiError::BadAddr));
        assert!(matches!(
            Bind::parse(&b[..100]),
            Err(AbiError::Short { need: 136, .. })
        ));
    }

    #[test]
    fn conn_param_round_trip_and_event_offsets() {
        let c = ConnParam {
            qp_num: 0x11,
            qkey: 0,
            private_data: vec![7; 56],
            srq: false,
            responder_resources: 1,
            initiator_depth: 2,
            flow_control: true,
            retry_count: 7,
            rnr_retry_count: 6,
            valid: true,
        };
        let mut b = [0u8; 272];
        c.emit(&mut b);
        assert_eq!(ConnParam::parse(&b), Ok(c.clone()));
        let e = EventResp {
            uid: 0xdead_beef,
            id: 3,
            event: event::CONNECT_REQUEST,
            status: -110,
            param: EventParam::Conn(c),
            ece: Ece {
                vendor_id: 1,
                attr_mod: 2,
            },
        };
        let b = e.to_bytes();
        assert_eq!(u64_at(&b, 0), 0xdead_beef);
        assert_eq!(u32_at(&b, 16) as i32, -110);
        assert_eq!(u32_at(&b, 20), 0x11, "param at 20");
        assert_eq!(b[20 + 264], 56, "private_data_len");
        assert_eq!((u32_at(&b, 328), u32_at(&b, 332)), (1, 2), "ece at 328");
    }
}

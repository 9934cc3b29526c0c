//! The kernel's rdma_cm structures (`include/uapi/rdma/rdma_user_cm.h`, and the
//! `ib_user_verbs.h` / `ib_user_sa.h` ones it embeds), declared field for field.
//!
//! Every field is a little-endian type of alignment 1 (the ABI is the x86-64 and
//! aarch64 kernels' native, little-endian one), so a structure has no padding the
//! compiler adds: what the kernel pads or reserves is a named `reserved` field, and each
//! size is checked against the kernel's at compile time. Byte conversion is derived
//! (zerocopy), for the server side (`mod.rs`'s parsers and writers) and the client side
//! alike. Socket addresses stay byte arrays (`sockaddr_in6`'s 28 bytes,
//! `__kernel_sockaddr_storage`'s 128): their layout depends on their family, which
//! `parse_sockaddr` and `emit_sockaddr` read.

use core::mem::size_of;

use zerocopy::byteorder::big_endian;
use zerocopy::byteorder::little_endian::{I32, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// A `struct sockaddr_in6` slot.
pub type SockaddrIn6 = [u8; 28];
/// A `struct __kernel_sockaddr_storage` slot.
pub type SockaddrStorage = [u8; 128];

/// `struct rdma_ucm_cmd_hdr`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmCmdHdr {
    pub cmd: U32,
    pub r#in: U16,
    pub out: U16,
}

/// `struct rdma_ucm_create_id`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmCreateId {
    pub uid: U64,
    pub response: U64,
    pub ps: U16,
    pub qp_type: u8,
    pub reserved: [u8; 5],
}

/// `struct rdma_ucm_destroy_id` (also `rdma_ucm_leave_mcast`'s layout).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmDestroyId {
    pub response: U64,
    pub id: U32,
    pub reserved: U32,
}

/// `struct rdma_ucm_bind_ip`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmBindIp {
    pub response: U64,
    pub addr: SockaddrIn6,
    pub id: U32,
}

/// `struct rdma_ucm_bind`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmBind {
    pub id: U32,
    pub addr_size: U16,
    pub reserved: U16,
    pub addr: SockaddrStorage,
}

/// `struct rdma_ucm_resolve_ip`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmResolveIp {
    pub src_addr: SockaddrIn6,
    pub dst_addr: SockaddrIn6,
    pub id: U32,
    pub timeout_ms: U32,
}

/// `struct rdma_ucm_resolve_addr`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmResolveAddr {
    pub id: U32,
    pub timeout_ms: U32,
    pub src_size: U16,
    pub dst_size: U16,
    pub reserved: U32,
    pub src_addr: SockaddrStorage,
    pub dst_addr: SockaddrStorage,
}

/// Two u32s: `struct rdma_ucm_resolve_route` (`id`, `timeout_ms`), `rdma_ucm_listen`
/// (`id`, `backlog`), `rdma_ucm_notify` (`id`, `event`).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmIdArg {
    pub id: U32,
    pub arg: U32,
}

/// A response address, an id and a u32: `struct rdma_ucm_query` (`option`),
/// `rdma_ucm_init_qp_attr` (`qp_state`), `rdma_ucm_migrate_id` (`fd`).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmRespIdArg {
    pub response: U64,
    pub id: U32,
    pub arg: U32,
}

/// `struct rdma_ucm_conn_param`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmConnParam {
    pub qp_num: U32,
    pub qkey: U32,
    pub private_data: [u8; 256],
    pub private_data_len: u8,
    pub srq: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub valid: u8,
}

/// `struct rdma_ucm_ece`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmEce {
    pub vendor_id: U32,
    pub attr_mod: U32,
}

/// `struct rdma_ucm_connect`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmConnect {
    pub conn_param: UcmConnParam,
    pub id: U32,
    pub reserved: U32,
    pub ece: UcmEce,
}

/// `struct rdma_ucm_accept`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmAccept {
    pub uid: U64,
    pub conn_param: UcmConnParam,
    pub id: U32,
    pub reserved: U32,
    pub ece: UcmEce,
}

/// `struct rdma_ucm_reject`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmReject {
    pub id: U32,
    pub private_data_len: u8,
    pub reason: u8,
    pub reserved: [u8; 2],
    pub private_data: [u8; 256],
}

/// `struct rdma_ucm_set_option`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmSetOption {
    pub optval: U64,
    pub id: U32,
    pub level: U32,
    pub optname: U32,
    pub optlen: U32,
}

/// `struct rdma_ucm_join_ip_mcast`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmJoinIpMcast {
    pub response: U64,
    pub uid: U64,
    pub addr: SockaddrIn6,
    pub id: U32,
}

/// `struct rdma_ucm_join_mcast`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmJoinMcast {
    pub response: U64,
    pub uid: U64,
    pub id: U32,
    pub addr_size: U16,
    pub join_flags: U16,
    pub addr: SockaddrStorage,
}

/// `struct ib_uverbs_ah_attr`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UverbsAhAttr {
    pub dgid: [u8; 16],
    pub flow_label: U32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
    pub dlid: U16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub reserved2: u8,
}

/// `struct rdma_ucm_ud_param`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmUdParam {
    pub qp_num: U32,
    pub qkey: U32,
    pub ah_attr: UverbsAhAttr,
    pub private_data: [u8; 256],
    pub private_data_len: u8,
    pub reserved: [u8; 7],
}

/// `struct rdma_ucm_event_resp`. `param` is the union of [`UcmConnParam`] (its first
/// 272 bytes) and [`UcmUdParam`], read as the id's kind says.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmEventResp {
    pub uid: U64,
    pub id: U32,
    pub event: U32,
    pub status: I32,
    pub param: [u8; size_of::<UcmUdParam>()],
    pub reserved: U32,
    pub ece: UcmEce,
}

/// `struct rdma_ucm_resolve_ib_service`: the id and `struct rdma_ucm_ib_service` (8-byte
/// aligned: 4 bytes of padding before it).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmResolveIbService {
    pub id: U32,
    pub pad: U32,
    pub service_id: U64,
    pub service_name: [u8; 64],
    pub flags: U32,
    pub reserved: U32,
}

/// `struct rdma_ucm_write_cm_event`: its parameters are a union of
/// `rdma_ucm_conn_param`, `rdma_ucm_ud_param` and a `__u64 arg` (the first 8 bytes).
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmWriteCmEvent {
    pub id: U32,
    pub reserved: U32,
    pub event: U32,
    pub status: I32,
    pub param: [u8; size_of::<UcmUdParam>()],
}

/// `struct ib_user_path_rec`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UserPathRec {
    pub dgid: [u8; 16],
    pub sgid: [u8; 16],
    pub dlid: big_endian::U16,
    pub slid: big_endian::U16,
    pub raw_traffic: U32,
    pub flow_label: big_endian::U32,
    pub reversible: U32,
    pub mtu: U32,
    pub pkey: big_endian::U16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub numb_path: u8,
    pub sl: u8,
    pub mtu_selector: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

/// `struct rdma_ucm_query_route_resp`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmQueryRouteResp {
    pub node_guid: U64,
    pub ib_route: [UserPathRec; 2],
    pub src_addr: SockaddrIn6,
    pub dst_addr: SockaddrIn6,
    pub num_paths: U32,
    pub port_num: u8,
    pub reserved: [u8; 3],
    pub ibdev_index: U32,
    pub reserved1: U32,
}

/// `struct rdma_ucm_query_addr_resp`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UcmQueryAddrResp {
    pub node_guid: U64,
    pub port_num: u8,
    pub reserved: u8,
    pub pkey: U16,
    pub src_size: U16,
    pub dst_size: U16,
    pub src_addr: SockaddrStorage,
    pub dst_addr: SockaddrStorage,
    pub ibdev_index: U32,
    pub reserved1: U32,
}

/// `struct ib_uverbs_qp_attr`.
#[derive(Debug, Clone, Copy, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
#[repr(C)]
pub struct UverbsQpAttr {
    pub qp_attr_mask: U32,
    pub qp_state: U32,
    pub cur_qp_state: U32,
    pub path_mtu: U32,
    pub path_mig_state: U32,
    pub qkey: U32,
    pub rq_psn: U32,
    pub sq_psn: U32,
    pub dest_qp_num: U32,
    pub qp_access_flags: U32,
    pub ah_attr: UverbsAhAttr,
    pub alt_ah_attr: UverbsAhAttr,
    pub max_send_wr: U32,
    pub max_recv_wr: U32,
    pub max_send_sge: U32,
    pub max_recv_sge: U32,
    pub max_inline_data: U32,
    pub pkey_index: U16,
    pub alt_pkey_index: U16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub reserved: [u8; 5],
}

// The kernel's sizes (`sizeof` of each structure in rdma_user_cm.h, ib_user_verbs.h and
// ib_user_sa.h).
const _: () = assert!(size_of::<UcmCmdHdr>() == 8);
const _: () = assert!(size_of::<UcmCreateId>() == 24);
const _: () = assert!(size_of::<UcmDestroyId>() == 16);
const _: () = assert!(size_of::<UcmBindIp>() == 40);
const _: () = assert!(size_of::<UcmBind>() == 136);
const _: () = assert!(size_of::<UcmResolveIp>() == 64);
const _: () = assert!(size_of::<UcmResolveAddr>() == 272);
const _: () = assert!(size_of::<UcmIdArg>() == 8);
const _: () = assert!(size_of::<UcmRespIdArg>() == 16);
const _: () = assert!(size_of::<UcmConnParam>() == 272);
const _: () = assert!(size_of::<UcmEce>() == 8);
const _: () = assert!(size_of::<UcmConnect>() == 288);
const _: () = assert!(size_of::<UcmAccept>() == 296);
const _: () = assert!(size_of::<UcmReject>() == 264);
const _: () = assert!(size_of::<UcmSetOption>() == 24);
const _: () = assert!(size_of::<UcmJoinIpMcast>() == 48);
const _: () = assert!(size_of::<UcmJoinMcast>() == 152);
const _: () = assert!(size_of::<UverbsAhAttr>() == 32);
const _: () = assert!(size_of::<UcmUdParam>() == 304);
const _: () = assert!(size_of::<UcmEventResp>() == 336);
const _: () = assert!(size_of::<UcmResolveIbService>() == 88);
const _: () = assert!(size_of::<UcmWriteCmEvent>() == 320);
const _: () = assert!(size_of::<UserPathRec>() == 64);
const _: () = assert!(size_of::<UcmQueryRouteResp>() == 208);
const _: () = assert!(size_of::<UcmQueryAddrResp>() == 280);
const _: () = assert!(size_of::<UverbsQpAttr>() == 144);

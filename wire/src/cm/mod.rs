//! The CM class (IBTA Vol 1 chapter 12): one module per message, plus what a proxy
//! needs without decoding a whole message ([`CmMad`]).
//!
//! Every message view (`req::Packet`, `rep::Packet`, ...) spans the whole 256-byte MAD,
//! so its field offsets are absolute: the IBTA table's data offset plus 24 (the MAD header).
//! `new_checked` verifies the length, the MAD header (base version 1, class 0x07,
//! class version 2, method SEND, or GET/GETRESP for ClassPortInfo) and the attribute
//! ID, so accessors never go out of bounds.

use core::fmt;

use crate::error::{Error, Result};
use crate::field::{Bits, Field};
use crate::gid::Gid;
use crate::mad::{self, AttributeId, Header};

pub mod apr;
pub mod class_port_info;
pub mod drep;
pub mod dreq;
pub mod lap;
pub mod mra;
pub mod rej;
pub mod rep;
pub mod req;
pub mod rtu;
pub mod sidr_rep;
pub mod sidr_req;

/// Defines a message's zero-copy view: `Packet<T>` with checked and unchecked
/// constructors and private typed field helpers.
macro_rules! view {
    ($name:ident, $attr:expr, $doc:expr) => {
        #[doc = $doc]
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            /// Wraps a buffer without checks; accessors may panic if it is shorter than
            /// a MAD. Use `new_checked` for untrusted input.
            pub const fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }

            /// Wraps a buffer after checking it holds a whole CM MAD of this attribute.
            pub fn new_checked(buffer: T) -> $crate::error::Result<Self> {
                let attr = $crate::mad::Packet::new_checked(buffer.as_ref())?.check_cm()?;
                if attr != $attr {
                    return Err($crate::error::Error::WrongAttribute {
                        expected: $attr as u16,
                        found: attr as u16,
                    });
                }
                Ok($name { buffer })
            }

            /// Releases the buffer.
            pub fn into_inner(self) -> T {
                self.buffer
            }

            /// The MAD header of this message.
            pub fn header(&self) -> $crate::mad::Packet<&[u8]> {
                $crate::mad::Packet::new_unchecked(self.buffer.as_ref())
            }

            #[inline]
            #[allow(dead_code)]
            fn bytes(&self) -> &[u8] {
                self.buffer.as_ref()
            }

            #[inline]
            fn get(&self, f: $crate::field::Bits) -> u64 {
                f.get(self.buffer.as_ref())
            }

            #[inline]
            #[allow(dead_code)]
            fn gid(&self, f: $crate::field::Field) -> $crate::gid::Gid {
                let mut g = [0u8; 16];
                g.copy_from_slice(&self.buffer.as_ref()[f]);
                $crate::gid::Gid(g)
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> $name<T> {
            #[inline]
            fn set(&mut self, f: $crate::field::Bits, v: u64) {
                f.set(self.buffer.as_mut(), v)
            }

            #[inline]
            #[allow(dead_code)]
            fn set_gid(&mut self, f: $crate::field::Field, g: $crate::gid::Gid) {
                self.buffer.as_mut()[f].copy_from_slice(&g.0)
            }

            /// The MAD header of this message, mutable (TID, attribute modifier).
            pub fn header_mut(&mut self) -> $crate::mad::Packet<&mut [u8]> {
                $crate::mad::Packet::new_unchecked(self.buffer.as_mut())
            }
        }
    };
}
pub(crate) use view;

/// Defines a message whose body is only the two comm IDs and 224 bytes of private data
/// (RTU and DREP share this layout): its `field` module, view, `Repr` and `Display`.
macro_rules! ids_message {
    ($attr:expr, $name:literal) => {
        use core::fmt;

        use $crate::cm::{check_private_data, view};
        use $crate::error::Result;
        use $crate::field::{Bits, Field};
        use $crate::mad::AttributeId;

        #[doc = concat!("Byte ranges and bit fields of a ", $name, ".")]
        pub mod field {
            use super::{Bits, Field};
            /// Local Communication ID, be32.
            pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
            /// Remote Communication ID, be32.
            pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
            /// Private data, 224 bytes.
            pub const PRIVATE_DATA: Field = 32..256;
        }

        #[doc = concat!("Maximum private data of a ", $name, ".")]
        pub const PRIVATE_DATA_LEN: usize = 224;

        view!(
            Packet,
            $attr,
            concat!("A zero-copy view of a ", $name, " MAD.")
        );

        impl<T: AsRef<[u8]>> Packet<T> {
            /// Local Communication ID.
            pub fn local_comm_id(&self) -> u32 {
                self.get(field::LOCAL_COMM_ID) as u32
            }
            /// Remote Communication ID.
            pub fn remote_comm_id(&self) -> u32 {
                self.get(field::REMOTE_COMM_ID) as u32
            }
            /// Private data (all 224 bytes).
            pub fn private_data(&self) -> &[u8] {
                &self.bytes()[field::PRIVATE_DATA]
            }
        }

        impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
            /// Sets the Local Communication ID.
            pub fn set_local_comm_id(&mut self, v: u32) {
                self.set(field::LOCAL_COMM_ID, v.into())
            }
            /// Sets the Remote Communication ID.
            pub fn set_remote_comm_id(&mut self, v: u32) {
                self.set(field::REMOTE_COMM_ID, v.into())
            }
        }

        #[doc = concat!("A parsed ", $name, ".")]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub struct Repr<'a> {
            /// Local Communication ID.
            pub local_comm_id: u32,
            /// Remote Communication ID.
            pub remote_comm_id: u32,
            /// Private data, at most [`PRIVATE_DATA_LEN`] bytes; emitted zero-padded.
            pub private_data: &'a [u8],
        }

        impl<'a> Repr<'a> {
            #[doc = concat!("Parses a ", $name, ".")]
            pub fn parse(p: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
                let bytes: &'a [u8] = p.buffer;
                Ok(Repr {
                    local_comm_id: p.local_comm_id(),
                    remote_comm_id: p.remote_comm_id(),
                    private_data: &bytes[field::PRIVATE_DATA],
                })
            }

            /// Writes the message's data (bytes 24..256; reserved bits zeroed). The MAD
            /// header is the caller's (see [`crate::cm::CmRepr::emit`]).
            pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) -> Result<()> {
                check_private_data(self.private_data, PRIVATE_DATA_LEN)?;
                p.buffer.as_mut()[$crate::mad::HEADER_LEN..$crate::mad::MAD_LEN].fill(0);
                p.set(field::LOCAL_COMM_ID, self.local_comm_id.into());
                p.set(field::REMOTE_COMM_ID, self.remote_comm_id.into());
                p.buffer.as_mut()[field::PRIVATE_DATA][..self.private_data.len()]
                    .copy_from_slice(self.private_data);
                Ok(())
            }
        }

        impl fmt::Display for Repr<'_> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    concat!($name, " lcid={:#010x} rcid={:#010x}"),
                    self.local_comm_id, self.remote_comm_id,
                )
            }
        }
    };
}
pub(crate) use ids_message;

/// Defines a fieldless enum of wire codes with `from_code`, `code`, `name` and `Display`.
macro_rules! code_enum {
    ($(#[$m:meta])* $name:ident : $ty:ty { $($(#[$vm:meta])* $var:ident = $val:expr => $s:expr,)* }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vm])* $var,)*
        }

        impl $name {
            /// Every value, in code order.
            pub const ALL: &'static [$name] = &[$($name::$var,)*];

            /// The value of a wire code; `None` for codes the specification reserves.
            pub fn from_code(v: $ty) -> Option<Self> {
                match v {
                    $($val => Some($name::$var),)*
                    _ => None,
                }
            }

            /// The wire code.
            pub fn code(self) -> $ty {
                match self {
                    $($name::$var => $val,)*
                }
            }

            /// Short lower-case name for logs.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$var => $s,)*
                }
            }
        }

        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{}({})", self.name(), self.code())
            }
        }
    };
}

code_enum! {
    /// REJ reasons (IBTA Table 112, `enum ib_cm_rej_reason`).
    RejReason: u16 {
        /// No QP available.
        NoQp = 1 => "no_qp",
        /// No EEC available.
        NoEec = 2 => "no_eec",
        /// No resources.
        NoResources = 3 => "no_resources",
        /// Timeout (REJ sent when a connection attempt is given up; Remote Comm ID 0).
        Timeout = 4 => "timeout",
        /// Unsupported request.
        Unsupported = 5 => "unsupported",
        /// Invalid Comm ID.
        InvalidCommId = 6 => "invalid_comm_id",
        /// Invalid Comm instance.
        InvalidCommInstance = 7 => "invalid_comm_instance",
        /// Invalid service ID.
        InvalidServiceId = 8 => "invalid_service_id",
        /// Invalid transport service type.
        InvalidTransportType = 9 => "invalid_transport_type",
        /// Stale connection.
        StaleConn = 10 => "stale_conn",
        /// RDC does not exist.
        RdcNotExist = 11 => "rdc_not_exist",
        /// Invalid GID.
        InvalidGid = 12 => "invalid_gid",
        /// Invalid LID.
        InvalidLid = 13 => "invalid_lid",
        /// Invalid SL.
        InvalidSl = 14 => "invalid_sl",
        /// Invalid traffic class.
        InvalidTrafficClass = 15 => "invalid_traffic_class",
        /// Invalid hop limit.
        InvalidHopLimit = 16 => "invalid_hop_limit",
        /// Invalid packet rate.
        InvalidPacketRate = 17 => "invalid_packet_rate",
        /// Invalid alternate GID.
        InvalidAltGid = 18 => "invalid_alt_gid",
        /// Invalid alternate LID.
        InvalidAltLid = 19 => "invalid_alt_lid",
        /// Invalid alternate SL.
        InvalidAltSl = 20 => "invalid_alt_sl",
        /// Invalid alternate traffic class.
        InvalidAltTrafficClass = 21 => "invalid_alt_traffic_class",
        /// Invalid alternate hop limit.
        InvalidAltHopLimit = 22 => "invalid_alt_hop_limit",
        /// Invalid alternate packet rate.
        InvalidAltPacketRate = 23 => "invalid_alt_packet_rate",
        /// Port CM redirect.
        PortCmRedirect = 24 => "port_cm_redirect",
        /// Port redirect.
        PortRedirect = 25 => "port_redirect",
        /// Invalid MTU.
        InvalidMtu = 26 => "invalid_mtu",
        /// Insufficient responder resources.
        InsufficientRespResources = 27 => "insufficient_resp_resources",
        /// Consumer defined.
        ConsumerDefined = 28 => "consumer_defined",
        /// Invalid RNR retry.
        InvalidRnrRetry = 29 => "invalid_rnr_retry",
        /// Duplicate local Comm ID.
        DuplicateLocalCommId = 30 => "duplicate_local_comm_id",
        /// Invalid class version.
        InvalidClassVersion = 31 => "invalid_class_version",
        /// Invalid flow label.
        InvalidFlowLabel = 32 => "invalid_flow_label",
        /// Invalid alternate flow label.
        InvalidAltFlowLabel = 33 => "invalid_alt_flow_label",
        /// Vendor option not supported (34 is not defined).
        VendorOptionNotSupported = 35 => "vendor_option_not_supported",
    }
}

code_enum! {
    /// Which message a REJ rejects or an MRA acknowledges (`enum cm_msg_response`).
    #[derive(Default)]
    MsgResponse: u8 {
        /// The REQ.
        #[default]
        Req = 0 => "req",
        /// The REP.
        Rep = 1 => "rep",
        /// Another message (LAP for an MRA).
        Other = 2 => "other",
    }
}

code_enum! {
    /// SIDR_REP status (`enum ib_cm_sidr_status`).
    #[derive(Default)]
    SidrStatus: u8 {
        /// Success.
        #[default]
        Success = 0 => "success",
        /// Service ID not supported.
        Unsupported = 1 => "unsupported",
        /// Rejected.
        Reject = 2 => "reject",
        /// No QP.
        NoQp = 3 => "no_qp",
        /// Redirect.
        Redirect = 4 => "redirect",
        /// Unsupported version.
        UnsupportedVersion = 5 => "unsupported_version",
    }
}

code_enum! {
    /// APR status (`enum ib_cm_apr_status`).
    #[derive(Default)]
    AprStatus: u8 {
        /// Alternate path loaded.
        #[default]
        Success = 0 => "success",
        /// Invalid Comm ID.
        InvalidCommId = 1 => "invalid_comm_id",
        /// LAP unsupported.
        Unsupported = 2 => "unsupported",
        /// Rejected.
        Reject = 3 => "reject",
        /// Redirect.
        Redirect = 4 => "redirect",
        /// The path is already the current one.
        IsCurrent = 5 => "is_current",
        /// Invalid QPN/EECN.
        InvalidQpnEecn = 6 => "invalid_qpn_eecn",
        /// Invalid LID.
        InvalidLid = 7 => "invalid_lid",
        /// Invalid GID.
        InvalidGid = 8 => "invalid_gid",
        /// Invalid flow label.
        InvalidFlowLabel = 9 => "invalid_flow_label",
        /// Invalid traffic class.
        InvalidTclass = 10 => "invalid_tclass",
        /// Invalid hop limit.
        InvalidHopLimit = 11 => "invalid_hop_limit",
        /// Invalid packet rate.
        InvalidPacketRate = 12 => "invalid_packet_rate",
        /// Invalid SL.
        InvalidSl = 13 => "invalid_sl",
    }
}

code_enum! {
    /// REP failover accepted (2 bits).
    #[derive(Default)]
    FailoverAccepted: u8 {
        /// Failover accepted.
        #[default]
        Accepted = 0 => "accepted",
        /// Failover not supported.
        NotSupported = 1 => "not_supported",
        /// Failover rejected.
        Rejected = 2 => "rejected",
    }
}

/// Transport service of a REQ: the 2-bit type, plus the 3-bit extended type for XRC.
///
/// This enum and the code enums a message's `Repr` holds default to their code-0 value,
/// so that a `Repr`'s `Default` is what an all-zero body parses to (`RejReason` has no
/// code 0, and `rej::Repr` no `Default`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportService {
    /// Reliable connected.
    #[default]
    Rc,
    /// Unreliable connected.
    Uc,
    /// Reliable datagram.
    Rd,
    /// Extended reliable connected (type 3, extended type 1).
    Xrc,
}

impl TransportService {
    /// From the REQ's transport service type and extended transport type fields.
    pub fn from_fields(tst: u8, ett: u8) -> Result<TransportService> {
        match (tst, ett) {
            (0, _) => Ok(TransportService::Rc),
            (1, _) => Ok(TransportService::Uc),
            (2, _) => Ok(TransportService::Rd),
            (3, 1) => Ok(TransportService::Xrc),
            (3, e) => Err(Error::Reserved {
                field: "extended_transport_type",
                value: e.into(),
            }),
            (t, _) => Err(Error::Reserved {
                field: "transport_service_type",
                value: t.into(),
            }),
        }
    }

    /// The (transport service type, extended transport type) fields.
    pub fn to_fields(self) -> (u8, u8) {
        match self {
            TransportService::Rc => (0, 0),
            TransportService::Uc => (1, 0),
            TransportService::Rd => (2, 0),
            TransportService::Xrc => (3, 1),
        }
    }
}

/// One path as the REQ (primary, alternate) and LAP (alternate) carry it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PathRepr {
    /// Local port LID.
    pub local_lid: u16,
    /// Remote port LID.
    pub remote_lid: u16,
    /// Local port GID.
    pub local_gid: Gid,
    /// Remote port GID.
    pub remote_gid: Gid,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Packet rate (6 bits).
    pub packet_rate: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Service level (4 bits).
    pub sl: u8,
    /// Subnet local.
    pub subnet_local: bool,
    /// Local ACK timeout (5-bit exponent).
    pub local_ack_timeout: u8,
}

/// Offsets of a path's fields relative to its first byte, for one message layout.
struct PathLayout {
    local_lid: Bits,
    remote_lid: Bits,
    local_gid: usize,
    remote_gid: usize,
    flow_label: Bits,
    packet_rate: Bits,
    traffic_class: Bits,
    hop_limit: Bits,
    sl: Bits,
    subnet_local: Bits,
    local_ack_timeout: Bits,
}

/// REQ paths: LIDs, GIDs, flow label, rate, TC, hop limit, SL/subnet local, ACK timeout.
const REQ_PATH: PathLayout = PathLayout {
    local_lid: Bits::bytes(0, 2),
    remote_lid: Bits::bytes(2, 2),
    local_gid: 4,
    remote_gid: 20,
    flow_label: Bits::new(36, 4, 12, 20),
    packet_rate: Bits::new(39, 1, 0, 6),
    traffic_class: Bits::bytes(40, 1),
    hop_limit: Bits::bytes(41, 1),
    sl: Bits::new(42, 1, 4, 4),
    subnet_local: Bits::new(42, 1, 3, 1),
    local_ack_timeout: Bits::new(43, 1, 3, 5),
};

/// LAP's alternate path: traffic class, hop limit and packet rate in another order.
const LAP_PATH: PathLayout = PathLayout {
    local_lid: Bits::bytes(0, 2),
    remote_lid: Bits::bytes(2, 2),
    local_gid: 4,
    remote_gid: 20,
    flow_label: Bits::new(36, 4, 12, 20),
    traffic_class: Bits::bytes(39, 1),
    hop_limit: Bits::bytes(40, 1),
    packet_rate: Bits::new(41, 1, 0, 6),
    sl: Bits::new(42, 1, 4, 4),
    subnet_local: Bits::new(42, 1, 3, 1),
    local_ack_timeout: Bits::new(43, 1, 3, 5),
};

/// Bytes a path occupies.
pub const PATH_LEN: usize = 44;

impl PathRepr {
    #[inline(always)]
    fn read(l: &PathLayout, buf: &[u8], base: usize) -> PathRepr {
        let b = &buf[base..base + PATH_LEN];
        let gid = |at: usize| {
            let mut g = [0u8; 16];
            g.copy_from_slice(&b[at..at + 16]);
            Gid(g)
        };
        PathRepr {
            local_lid: l.local_lid.get(b) as u16,
            remote_lid: l.remote_lid.get(b) as u16,
            local_gid: gid(l.local_gid),
            remote_gid: gid(l.remote_gid),
            flow_label: l.flow_label.get(b) as u32,
            packet_rate: l.packet_rate.get(b) as u8,
            traffic_class: l.traffic_class.get(b) as u8,
            hop_limit: l.hop_limit.get(b) as u8,
            sl: l.sl.get(b) as u8,
            subnet_local: l.subnet_local.get(b) != 0,
            local_ack_timeout: l.local_ack_timeout.get(b) as u8,
        }
    }

    #[inline(always)]
    fn write(&self, l: &PathLayout, buf: &mut [u8], base: usize) {
        let b = &mut buf[base..base + PATH_LEN];
        l.local_lid.set(b, self.local_lid.into());
        l.remote_lid.set(b, self.remote_lid.into());
        b[l.local_gid..l.local_gid + 16].copy_from_slice(&self.local_gid.0);
        b[l.remote_gid..l.remote_gid + 16].copy_from_slice(&self.remote_gid.0);
        l.flow_label.set(b, self.flow_label.into());
        l.packet_rate.set(b, self.packet_rate.into());
        l.traffic_class.set(b, self.traffic_class.into());
        l.hop_limit.set(b, self.hop_limit.into());
        l.sl.set(b, self.sl.into());
        l.subnet_local.set(b, self.subnet_local.into());
        l.local_ack_timeout.set(b, self.local_ack_timeout.into());
    }

    /// Reads a path in REQ layout starting at absolute byte `base`.
    pub(crate) fn read_req(buf: &[u8], base: usize) -> PathRepr {
        Self::read(&REQ_PATH, buf, base)
    }
    /// Writes a path in REQ layout at absolute byte `base`.
    pub(crate) fn write_req(&self, buf: &mut [u8], base: usize) {
        self.write(&REQ_PATH, buf, base)
    }
    /// Reads a path in LAP layout starting at absolute byte `base`.
    pub(crate) fn read_lap(buf: &[u8], base: usize) -> PathRepr {
        Self::read(&LAP_PATH, buf, base)
    }
    /// Writes a path in LAP layout at absolute byte `base`.
    pub(crate) fn write_lap(&self, buf: &mut [u8], base: usize) {
        self.write(&LAP_PATH, buf, base)
    }
}

/// Fails unless `data` fits a private-data field of `max` bytes.
pub(crate) fn check_private_data(data: &[u8], max: usize) -> Result<()> {
    check_fits("private_data", data, max)
}

/// Fails unless `data` fits a field of `max` bytes.
pub(crate) fn check_fits(field: &'static str, data: &[u8], max: usize) -> Result<()> {
    if data.len() > max {
        Err(Error::TooLong {
            field,
            len: data.len(),
            max,
        })
    } else {
        Ok(())
    }
}

/// The first `len` bytes of the variable-length part `part` (REJ ARI, APR or SIDR_REP
/// additional information); a length beyond the part is [`Error::Reserved`] of the
/// length field `length_field`.
pub(crate) fn var_part<'a>(
    buf: &'a [u8],
    part: Field,
    length_field: &'static str,
    len: usize,
) -> Result<&'a [u8]> {
    if len > part.len() {
        return Err(Error::Reserved {
            field: length_field,
            value: len as u32,
        });
    }
    Ok(&buf[part.start..part.start + len])
}

/// Absolute offsets a proxy reads and rewrites, common to several messages.
pub mod field {
    use super::{Bits, Field};
    /// Local Comm ID (REQ, MRA, REJ, REP, RTU, DREQ, DREP, LAP, APR).
    pub const LOCAL_COMM_ID: Bits = Bits::bytes(24, 4);
    /// Remote Comm ID (all of the above but REQ).
    pub const REMOTE_COMM_ID: Bits = Bits::bytes(28, 4);
    /// SIDR RequestID (SIDR_REQ, SIDR_REP).
    pub const SIDR_REQUEST_ID: Bits = Bits::bytes(24, 4);
    /// REQ Local CA GUID.
    pub const REQ_LOCAL_CA_GUID: Bits = Bits::bytes(40, 8);
    /// REQ Local QPN.
    pub const REQ_LOCAL_QPN: Bits = Bits::new(56, 4, 8, 24);
    /// REQ Primary Local Port GID.
    pub const REQ_PRIMARY_LOCAL_GID: Field = 80..96;
    /// REQ Primary Remote Port GID.
    pub const REQ_PRIMARY_REMOTE_GID: Field = 96..112;
    /// REP Local QPN.
    pub const REP_LOCAL_QPN: Bits = Bits::new(36, 4, 8, 24);
    /// REP Local CA GUID.
    pub const REP_LOCAL_CA_GUID: Bits = Bits::bytes(52, 8);
    /// REJ Message Rejected.
    pub const REJ_MESSAGE_REJECTED: Bits = Bits::new(32, 1, 6, 2);
    /// REJ Rejected Info Length.
    pub const REJ_ARI_LENGTH: Bits = Bits::new(33, 1, 1, 7);
    /// REJ reason.
    pub const REJ_REASON: Bits = Bits::bytes(34, 2);
    /// REJ Additional Rejection Information.
    pub const REJ_ARI: Field = 36..108;
    /// MRA Message MRAed.
    pub const MRA_MESSAGE_MRAED: Bits = Bits::new(32, 1, 6, 2);
    /// MRA Service Timeout.
    pub const MRA_SERVICE_TIMEOUT: Bits = Bits::new(33, 1, 3, 5);
    /// DREQ Remote QPN/EECN.
    pub const DREQ_REMOTE_QPN: Bits = Bits::new(32, 4, 8, 24);
    /// LAP Remote QPN/EECN.
    pub const LAP_REMOTE_QPN: Bits = Bits::new(36, 4, 8, 24);
    /// SIDR_REP QPN.
    pub const SIDR_REP_QPN: Bits = Bits::new(32, 4, 8, 24);
    /// SIDR_REP Status (0: the QPN is valid).
    pub const SIDR_REP_STATUS: Bits = Bits::bytes(28, 1);
}

/// A checked CM MAD of any attribute: what a proxy reads and rewrites without
/// decoding the whole message.
#[derive(Debug, Clone)]
pub struct CmMad<T: AsRef<[u8]>> {
    buffer: T,
    attr: AttributeId,
}

impl<T: AsRef<[u8]>> CmMad<T> {
    /// Checks the buffer holds a CM MAD of a known attribute with the right method.
    pub fn new_checked(buffer: T) -> Result<CmMad<T>> {
        let attr = mad::Packet::new_checked(buffer.as_ref())?.check_cm()?;
        Ok(CmMad { buffer, attr })
    }

    /// Releases the buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The whole MAD.
    pub fn as_bytes(&self) -> &[u8] {
        self.buffer.as_ref()
    }

    /// The attribute (message type).
    pub fn attr(&self) -> AttributeId {
        self.attr
    }

    /// The MAD header.
    pub fn header(&self) -> mad::Packet<&[u8]> {
        mad::Packet::new_unchecked(self.buffer.as_ref())
    }

    /// Transaction ID.
    pub fn tid(&self) -> u64 {
        mad::field::TID.get(self.buffer.as_ref())
    }

    /// Raw method byte.
    pub fn method(&self) -> u8 {
        mad::field::METHOD.get(self.buffer.as_ref()) as u8
    }

    /// True for the messages that carry a Local Comm ID at byte 24.
    pub fn has_local_comm_id(&self) -> bool {
        !matches!(
            self.attr,
            AttributeId::ClassPortInfo | AttributeId::SidrReq | AttributeId::SidrRep
        )
    }

    /// True for the messages that carry a Remote Comm ID at byte 28 (not REQ, not SIDR).
    pub fn has_remote_comm_id(&self) -> bool {
        self.has_local_comm_id() && self.attr != AttributeId::Req
    }

    /// Local Comm ID, for the messages that have one.
    pub fn local_comm_id(&self) -> Option<u32> {
        self.has_local_comm_id()
            .then(|| field::LOCAL_COMM_ID.get(self.buffer.as_ref()) as u32)
    }

    /// Remote Comm ID, for the messages that have one. `None` for a REQ: its byte 28
    /// is reserved and 29..32 carry the ECE vendor ID.
    pub fn remote_comm_id(&self) -> Option<u32> {
        self.has_remote_comm_id()
            .then(|| field::REMOTE_COMM_ID.get(self.buffer.as_ref()) as u32)
    }

    /// SIDR RequestID of a SIDR_REQ or SIDR_REP.
    pub fn sidr_request_id(&self) -> Option<u32> {
        matches!(self.attr, AttributeId::SidrReq | AttributeId::SidrRep)
            .then(|| field::SIDR_REQUEST_ID.get(self.buffer.as_ref()) as u32)
    }

    fn gid_at(&self, f: Field) -> Gid {
        let mut g = [0u8; 16];
        g.copy_from_slice(&self.buffer.as_ref()[f]);
        Gid(g)
    }

    /// A REQ's Primary Remote Port GID (the destination's GID: the demux key).
    pub fn req_primary_remote_gid(&self) -> Option<Gid> {
        (self.attr == AttributeId::Req).then(|| self.gid_at(field::REQ_PRIMARY_REMOTE_GID))
    }

    /// A REQ's Primary Local Port GID (the sender's GID).
    pub fn req_primary_local_gid(&self) -> Option<Gid> {
        (self.attr == AttributeId::Req).then(|| self.gid_at(field::REQ_PRIMARY_LOCAL_GID))
    }

    /// The sender's CA GUID: a REQ's or REP's Local CA GUID.
    pub fn local_ca_guid(&self) -> Option<u64> {
        let b = self.buffer.as_ref();
        match self.attr {
            AttributeId::Req => Some(field::REQ_LOCAL_CA_GUID.get(b)),
            AttributeId::Rep => Some(field::REP_LOCAL_CA_GUID.get(b)),
            _ => None,
        }
    }

    /// The sender's QPN: a REQ's or REP's Local QPN, a SIDR_REP's QPN.
    pub fn local_qpn(&self) -> Option<u32> {
        let b = self.buffer.as_ref();
        match self.attr {
            AttributeId::Req => Some(field::REQ_LOCAL_QPN.get(b) as u32),
            AttributeId::Rep => Some(field::REP_LOCAL_QPN.get(b) as u32),
            AttributeId::SidrRep => Some(field::SIDR_REP_QPN.get(b) as u32),
            _ => None,
        }
    }

    /// The receiver's QPN named by a DREQ or LAP (Remote QPN/EECN).
    pub fn remote_qpn(&self) -> Option<u32> {
        let b = self.buffer.as_ref();
        match self.attr {
            AttributeId::Dreq => Some(field::DREQ_REMOTE_QPN.get(b) as u32),
            AttributeId::Lap => Some(field::LAP_REMOTE_QPN.get(b) as u32),
            _ => None,
        }
    }

    /// A REJ's raw reason code.
    pub fn rej_reason(&self) -> Option<u16> {
        (self.attr == AttributeId::Rej).then(|| field::REJ_REASON.get(self.buffer.as_ref()) as u16)
    }

    /// A REJ's Additional Rejection Information, as long as its length field says
    /// (clamped to the 72-byte field).
    pub fn rej_ari(&self) -> Option<&[u8]> {
        if self.attr != AttributeId::Rej {
            return None;
        }
        let b = self.buffer.as_ref();
        let len = (field::REJ_ARI_LENGTH.get(b) as usize).min(field::REJ_ARI.len());
        Some(&b[field::REJ_ARI.start..field::REJ_ARI.start + len])
    }

    /// The CA GUID a REJ(TIMEOUT) carries in its ARI (the rejecting side's GUID), if the
    /// REJ is one and the ARI holds at least 8 bytes.
    pub fn rej_timeout_ca_guid(&self) -> Option<u64> {
        if self.rej_reason()? != RejReason::Timeout.code() {
            return None;
        }
        let ari = self.rej_ari()?;
        let g: [u8; 8] = ari.get(..8)?.try_into().ok()?;
        Some(u64::from_be_bytes(g))
    }

    /// Which message a REJ rejects or an MRA acknowledges (raw 2-bit code).
    pub fn msg_response(&self) -> Option<u8> {
        let b = self.buffer.as_ref();
        match self.attr {
            AttributeId::Rej => Some(field::REJ_MESSAGE_REJECTED.get(b) as u8),
            AttributeId::Mra => Some(field::MRA_MESSAGE_MRAED.get(b) as u8),
            _ => None,
        }
    }

    /// An MRA's service timeout (5-bit exponent).
    pub fn mra_service_timeout(&self) -> Option<u8> {
        (self.attr == AttributeId::Mra)
            .then(|| field::MRA_SERVICE_TIMEOUT.get(self.buffer.as_ref()) as u8)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> CmMad<T> {
    /// The whole MAD, mutable (for a proxy that rewrites it into its own answer).
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        self.buffer.as_mut()
    }

    /// Sets the transaction ID.
    pub fn set_tid(&mut self, tid: u64) {
        mad::field::TID.set(self.buffer.as_mut(), tid)
    }

    /// Rewrites the Local Comm ID. Fails for messages without one.
    pub fn set_local_comm_id(&mut self, id: u32) -> Result<()> {
        if !self.has_local_comm_id() {
            return Err(self.no_field("local_comm_id"));
        }
        field::LOCAL_COMM_ID.set(self.buffer.as_mut(), id.into());
        Ok(())
    }

    /// Rewrites the Remote Comm ID. Fails for messages without one; never touches a REQ.
    pub fn set_remote_comm_id(&mut self, id: u32) -> Result<()> {
        if !self.has_remote_comm_id() {
            return Err(self.no_field("remote_comm_id"));
        }
        field::REMOTE_COMM_ID.set(self.buffer.as_mut(), id.into());
        Ok(())
    }

    /// Rewrites a SIDR RequestID. Fails for non-SIDR messages.
    pub fn set_sidr_request_id(&mut self, id: u32) -> Result<()> {
        if self.sidr_request_id().is_none() {
            return Err(self.no_field("sidr_request_id"));
        }
        field::SIDR_REQUEST_ID.set(self.buffer.as_mut(), id.into());
        Ok(())
    }

    fn no_field(&self, field: &'static str) -> Error {
        Error::NoField {
            attr: self.attr as u16,
            field,
        }
    }
}

/// A parsed CM message of any attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmRepr<'a> {
    /// REQ.
    Req(req::Repr<'a>),
    /// MRA.
    Mra(mra::Repr<'a>),
    /// REJ.
    Rej(rej::Repr<'a>),
    /// REP.
    Rep(rep::Repr<'a>),
    /// RTU.
    Rtu(rtu::Repr<'a>),
    /// DREQ.
    Dreq(dreq::Repr<'a>),
    /// DREP.
    Drep(drep::Repr<'a>),
    /// SIDR_REQ.
    SidrReq(sidr_req::Repr<'a>),
    /// SIDR_REP.
    SidrRep(sidr_rep::Repr<'a>),
    /// LAP.
    Lap(lap::Repr<'a>),
    /// APR.
    Apr(apr::Repr<'a>),
    /// ClassPortInfo (GET or GETRESP).
    ClassPortInfo(class_port_info::Repr),
}

impl<'a> CmRepr<'a> {
    /// Parses a whole CM MAD: its header and its message.
    pub fn parse(bytes: &'a [u8]) -> Result<(Header, CmRepr<'a>)> {
        let header = Header::parse(&mad::Packet::new_checked(bytes)?)?;
        let repr = match header.attr_id {
            AttributeId::Req => CmRepr::Req(req::Repr::parse(&req::Packet::new_unchecked(bytes))?),
            AttributeId::Mra => CmRepr::Mra(mra::Repr::parse(&mra::Packet::new_unchecked(bytes))?),
            AttributeId::Rej => CmRepr::Rej(rej::Repr::parse(&rej::Packet::new_unchecked(bytes))?),
            AttributeId::Rep => CmRepr::Rep(rep::Repr::parse(&rep::Packet::new_unchecked(bytes))?),
            AttributeId::Rtu => CmRepr::Rtu(rtu::Repr::parse(&rtu::Packet::new_unchecked(bytes))?),
            AttributeId::Dreq => {
                CmRepr::Dreq(dreq::Repr::parse(&dreq::Packet::new_unchecked(bytes))?)
            }
            AttributeId::Drep => {
                CmRepr::Drep(drep::Repr::parse(&drep::Packet::new_unchecked(bytes))?)
            }
            AttributeId::SidrReq => CmRepr::SidrReq(sidr_req::Repr::parse(
                &sidr_req::Packet::new_unchecked(bytes),
            )?),
            AttributeId::SidrRep => CmRepr::SidrRep(sidr_rep::Repr::parse(
                &sidr_rep::Packet::new_unchecked(bytes),
            )?),
            AttributeId::Lap => CmRepr::Lap(lap::Repr::parse(&lap::Packet::new_unchecked(bytes))?),
            AttributeId::Apr => CmRepr::Apr(apr::Repr::parse(&apr::Packet::new_unchecked(bytes))?),
            AttributeId::ClassPortInfo => CmRepr::ClassPortInfo(class_port_info::Repr::parse(
                &class_port_info::Packet::new_unchecked(bytes),
            )?),
        };
        Ok((header, repr))
    }

    /// The attribute of this message.
    pub fn attr(&self) -> AttributeId {
        match self {
            CmRepr::Req(_) => AttributeId::Req,
            CmRepr::Mra(_) => AttributeId::Mra,
            CmRepr::Rej(_) => AttributeId::Rej,
            CmRepr::Rep(_) => AttributeId::Rep,
            CmRepr::Rtu(_) => AttributeId::Rtu,
            CmRepr::Dreq(_) => AttributeId::Dreq,
            CmRepr::Drep(_) => AttributeId::Drep,
            CmRepr::SidrReq(_) => AttributeId::SidrReq,
            CmRepr::SidrRep(_) => AttributeId::SidrRep,
            CmRepr::Lap(_) => AttributeId::Lap,
            CmRepr::Apr(_) => AttributeId::Apr,
            CmRepr::ClassPortInfo(_) => AttributeId::ClassPortInfo,
        }
    }

    /// Writes the header (its attribute ID taken from this message) and the message into
    /// `buf`, which must hold at least 256 bytes.
    ///
    /// The header's method is kept, and must fit the message: GET or GETRESP for a
    /// ClassPortInfo, SEND for every other message; anything else is
    /// [`Error::Method`]. Nothing is written when an error is returned.
    pub fn emit(&self, header: &Header, buf: &mut [u8]) -> Result<()> {
        crate::error::check_len(buf, mad::MAD_LEN)?;
        let attr = self.attr();
        let method_ok = match attr {
            AttributeId::ClassPortInfo => {
                matches!(header.method, mad::Method::Get | mad::Method::GetResp)
            }
            _ => header.method == mad::Method::Send,
        };
        if !method_ok {
            return Err(Error::Method {
                method: header.method as u8,
                attr: attr as u16,
            });
        }
        // The message first: its emit checks every length before writing anything.
        match self {
            CmRepr::Req(r) => r.emit(&mut req::Packet::new_unchecked(&mut *buf)),
            CmRepr::Mra(r) => r.emit(&mut mra::Packet::new_unchecked(&mut *buf)),
            CmRepr::Rej(r) => r.emit(&mut rej::Packet::new_unchecked(&mut *buf)),
            CmRepr::Rep(r) => r.emit(&mut rep::Packet::new_unchecked(&mut *buf)),
            CmRepr::Rtu(r) => r.emit(&mut rtu::Packet::new_unchecked(&mut *buf)),
            CmRepr::Dreq(r) => r.emit(&mut dreq::Packet::new_unchecked(&mut *buf)),
            CmRepr::Drep(r) => r.emit(&mut drep::Packet::new_unchecked(&mut *buf)),
            CmRepr::SidrReq(r) => r.emit(&mut sidr_req::Packet::new_unchecked(&mut *buf)),
            CmRepr::SidrRep(r) => r.emit(&mut sidr_rep::Packet::new_unchecked(&mut *buf)),
            CmRepr::Lap(r) => r.emit(&mut lap::Packet::new_unchecked(&mut *buf)),
            CmRepr::Apr(r) => r.emit(&mut apr::Packet::new_unchecked(&mut *buf)),
            CmRepr::ClassPortInfo(r) => {
                r.emit(&mut class_port_info::Packet::new_unchecked(&mut *buf))
            }
        }?;
        let mut h = *header;
        h.attr_id = attr;
        h.emit(&mut mad::Packet::new_unchecked(buf));
        Ok(())
    }
}

impl fmt::Display for CmRepr<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CmRepr::Req(r) => fmt::Display::fmt(r, f),
            CmRepr::Mra(r) => fmt::Display::fmt(r, f),
            CmRepr::Rej(r) => fmt::Display::fmt(r, f),
            CmRepr::Rep(r) => fmt::Display::fmt(r, f),
            CmRepr::Rtu(r) => fmt::Display::fmt(r, f),
            CmRepr::Dreq(r) => fmt::Display::fmt(r, f),
            CmRepr::Drep(r) => fmt::Display::fmt(r, f),
            CmRepr::SidrReq(r) => fmt::Display::fmt(r, f),
            CmRepr::SidrRep(r) => fmt::Display::fmt(r, f),
            CmRepr::Lap(r) => fmt::Display::fmt(r, f),
            CmRepr::Apr(r) => fmt::Display::fmt(r, f),
            CmRepr::ClassPortInfo(r) => fmt::Display::fmt(r, f),
        }
    }
}

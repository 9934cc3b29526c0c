//! Typed errors of the codec. Nothing in this crate panics on bad input: every
//! malformed buffer, unsupported version or reserved value ends up here.

/// Everything that can be wrong with bytes handed to the codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The buffer is shorter than the structure it must hold.
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes the structure needs.
        need: usize,
        /// Bytes the buffer has.
        have: usize,
    },
    /// MAD base version is not 1.
    #[error("unsupported MAD base version {0}")]
    BaseVersion(u8),
    /// Management class is not the one the view expects (CM is 0x07).
    #[error("management class {0:#04x} is not the CM class")]
    MgmtClass(u8),
    /// CM class version is not 2.
    #[error("unsupported CM class version {0}")]
    ClassVersion(u8),
    /// The attribute ID names no CM message.
    #[error("unknown CM attribute id {0:#06x}")]
    UnknownAttribute(u16),
    /// The method does not fit the attribute (CM messages travel as SEND).
    #[error("method {method:#04x} not valid for attribute {attr:#06x}")]
    Method {
        /// MAD method byte.
        method: u8,
        /// MAD attribute ID.
        attr: u16,
    },
    /// A field holds a value the specification reserves.
    #[error("reserved value {value} in field {field}")]
    Reserved {
        /// Name of the field.
        field: &'static str,
        /// The value found.
        value: u32,
    },
    /// A variable-length part (private data, ARI, additional info) does not fit its field.
    #[error("{field} is {len} bytes, at most {max} allowed")]
    TooLong {
        /// Name of the field.
        field: &'static str,
        /// Length given.
        len: usize,
        /// Maximum length of the field.
        max: usize,
    },
    /// The view's attribute is not the one asked for (e.g. a REP handed to `req::Packet`).
    #[error("attribute {found:#06x} where {expected:#06x} was expected")]
    WrongAttribute {
        /// Attribute the caller asked for.
        expected: u16,
        /// Attribute in the MAD.
        found: u16,
    },
    /// A RoCEv2 BTH with an opcode other than UD SEND only.
    #[error("BTH opcode {0:#04x} is not UD SEND only (0x64)")]
    BthOpcode(u8),
    /// A RoCEv2 BTH whose transport header version is not 0.
    #[error("BTH transport header version {0} is not 0")]
    BthVersion(u8),
    /// The invariant CRC of a RoCEv2 frame does not match its content.
    #[error("bad ICRC: frame says {found:#010x}, content gives {computed:#010x}")]
    Icrc {
        /// ICRC carried by the frame.
        found: u32,
        /// ICRC computed over the frame.
        computed: u32,
    },
    /// A RoCEv2 frame whose payload is not exactly one 256-byte MAD.
    #[error("RoCEv2 payload of {0} bytes is not one 256-byte MAD")]
    PayloadLength(usize),
    /// The message has no such field (e.g. a Remote Comm ID in a REQ).
    #[error("attribute {attr:#06x} has no field {field}")]
    NoField {
        /// MAD attribute ID.
        attr: u16,
        /// Name of the field.
        field: &'static str,
    },
    /// An IPv4 header whose header checksum does not match its content.
    #[error("bad IPv4 header checksum: header says {found:#06x}, content gives {computed:#06x}")]
    Ipv4Checksum {
        /// Checksum carried by the header.
        found: u16,
        /// Checksum computed over the header.
        computed: u16,
    },
    /// An IP header the codec does not frame: another IP version where one is expected,
    /// IPv4 options or fragments, an IPv4 protocol other than UDP.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// An IPv6 header whose next header is not UDP: an extension header (hop-by-hop,
    /// routing, fragment, destination options, ...) or another protocol. RoCEv2 frames
    /// travel in a 40-byte IPv6 header followed directly by UDP.
    #[error("IPv6 next header {0} is not UDP (17): extension headers are not supported")]
    Ipv6NextHeader(u8),
}

/// Result with the codec's error.
pub type Result<T> = core::result::Result<T, Error>;

/// Fails with [`Error::Truncated`] unless `buf` holds at least `need` bytes.
pub(crate) fn check_len(buf: &[u8], need: usize) -> Result<()> {
    if buf.len() < need {
        Err(Error::Truncated {
            need,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

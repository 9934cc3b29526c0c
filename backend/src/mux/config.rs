//! Configuration of the mux and of each VM, and the selectable policies.

use core::fmt;
use core::str::FromStr;
use std::time::Duration;

use pvcm_wire::Gid;

/// How the mux keeps its id cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// pvcm: lifetimes from protocol state and the timeouts the MADs carry, quarantine,
    /// REJ(TIMEOUT) keyed by (CA GUID, comm ID), VM-gone cleanup, anti-spoofing, quotas.
    #[default]
    Default,
    /// Linux mlx4 before 2020: entries deleted 5 s after a DREQ (either way), deleted at
    /// once on DREP/REJ, REJ(TIMEOUT) not routed, no quarantine, no VM cleanup, no checks.
    Mlx4Pre2020,
    /// Linux mlx4 since 2020: entries deleted 30 s after a DREQ or REJ (delayed only),
    /// REJ(TIMEOUT) routed by the peer's comm ID alone (kept 30 s), no quarantine, no
    /// VM cleanup, no checks.
    Mlx4Post2020,
}

impl Policy {
    /// Every policy.
    pub const ALL: [Policy; 3] = [Policy::Default, Policy::Mlx4Pre2020, Policy::Mlx4Post2020];

    /// True for the mlx4 comparison policies.
    pub fn is_legacy(self) -> bool {
        self != Policy::Default
    }

    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Default => "default",
            Policy::Mlx4Pre2020 => "mlx4-pre2020",
            Policy::Mlx4Post2020 => "mlx4-post2020",
        }
    }

    /// The legacy delayed-delete timer (`CM_CLEANUP_CACHE_TIMEOUT`).
    pub(crate) fn legacy_cleanup(self) -> Duration {
        match self {
            Policy::Mlx4Pre2020 => Duration::from_secs(5),
            _ => Duration::from_secs(30),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A policy name that is none of [`Policy::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy {0:?} (expected default, mlx4-pre2020 or mlx4-post2020)")]
pub struct UnknownPolicy(pub String);

impl FromStr for Policy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Policy, UnknownPolicy> {
        Policy::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// Configuration of a [`super::Mux`].
#[derive(Debug, Clone)]
pub struct MuxConfig {
    /// Cache policy.
    pub policy: Policy,
    /// How long a freed `pv_cm_id` stays unusable (TimeWait effect). Default 30 s.
    pub quarantine: Duration,
    /// Upper bound on any protocol wait the mux derives from MAD timeouts. Default 600 s.
    pub max_wait: Duration,
    /// Slack added to every protocol window (processing and queueing). Default 1 s.
    pub grace: Duration,
    /// How long a SIDR_REQ (which carries no timeout) waits for its SIDR_REP. Default 10 s.
    pub sidr_timeout: Duration,
    /// How long a ClassPortInfo Get waits for its GetResp. Default 10 s.
    pub class_port_info_timeout: Duration,
    /// log2 of the host's entry table size (live + quarantined). Default 22 (4 Mi entries).
    pub table_bits: u8,
    /// Live entries a VM may hold unless its own config says otherwise. Default 65536.
    pub default_quota: u32,
    /// DREQs sent on behalf of a detached VM before giving up on a peer. Default 3.
    pub detach_dreq_attempts: u8,
    /// Seeds the `pv_cm_id` permutation and the host TID space; random in production,
    /// fixed in tests.
    pub seed: u64,
}

/// Live entries a VM may hold when neither it nor the host says otherwise.
pub const DEFAULT_QUOTA: u32 = 65_536;

impl Default for MuxConfig {
    fn default() -> Self {
        MuxConfig {
            policy: Policy::Default,
            quarantine: Duration::from_secs(30),
            max_wait: Duration::from_secs(600),
            grace: Duration::from_secs(1),
            sidr_timeout: Duration::from_secs(10),
            class_port_info_timeout: Duration::from_secs(10),
            table_bits: 22,
            default_quota: DEFAULT_QUOTA,
            detach_dreq_attempts: 3,
            seed: 0x7076_636d,
        }
    }
}

/// One VM as the mux knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    /// Name for logs and tables.
    pub name: String,
    /// The VM's primary port GID (RoCEv2: IPv4-mapped for an IPv4 address).
    pub gid: Gid,
    /// The VM's further GIDs (its other addresses), after the primary; at most
    /// [`MAX_GIDS`]` - 1`, none twice, none the primary. Empty for most VMs.
    pub more_gids: Vec<Gid>,
    /// The VM's CA (node) GUID, which its CM puts in REQ/REP and REJ(TIMEOUT) ARIs.
    pub ca_guid: u64,
    /// First QPN the VM may name as its Local QPN.
    pub qpn_base: u32,
    /// How many QPNs from `qpn_base` the VM may use; 0 disables the QPN check.
    pub qpn_count: u32,
    /// Live entries the VM may hold; `None` takes [`MuxConfig::default_quota`].
    pub quota: Option<u32>,
    /// The VM's own `pv_cm_id` range, which makes it migratable: every `pv_cm_id` of the
    /// VM comes from it, on whichever host it runs, so IDs the peers know stay valid
    /// after a move (docs/migration.md). `None`: IDs from the host's shared space.
    pub id_range: Option<IdRange>,
}

/// A VM's `pv_cm_id` range in CIDR notation: the IDs whose top `prefix_len` bits equal
/// `base`'s. Ranges live in the upper half of the ID space (top bit set), which the
/// host's shared allocation never uses; the operator gives every migratable VM of a
/// cluster a range of its own, as it gives each a GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IdRange {
    /// The first ID (its low `32 - prefix_len` bits are 0).
    pub base: u32,
    /// Bits fixed by the range.
    pub prefix_len: u8,
}

/// Why a string is not an [`IdRange`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdRangeError {
    /// Not `BASE/LEN`.
    #[error("{0:?}: expected BASE/LEN, e.g. 0x80010000/16")]
    Syntax(String),
    /// The prefix length is outside 1..=24.
    #[error("prefix length {0}: must be 1..=24 (at least 256 IDs)")]
    PrefixLen(u32),
    /// The base has bits below the prefix.
    #[error("base {base:#010x} has bits set below /{len}")]
    Unaligned {
        /// The base.
        base: u32,
        /// The prefix length.
        len: u8,
    },
    /// The base lies in the host-shared lower half.
    #[error("base {0:#010x}: ranges must have the top bit set (0x80000000 and up)")]
    LowerHalf(u32),
}

impl IdRange {
    /// The longest prefix (smallest range, 256 IDs) allowed.
    pub const MAX_PREFIX_LEN: u8 = 24;

    /// A checked range.
    pub fn new(base: u32, prefix_len: u8) -> Result<IdRange, IdRangeError> {
        if !(1..=Self::MAX_PREFIX_LEN).contains(&prefix_len) {
            return Err(IdRangeError::PrefixLen(u32::from(prefix_len)));
        }
        let r = IdRange { base, prefix_len };
        if base & r.suffix_mask() != 0 {
            return Err(IdRangeError::Unaligned {
                base,
                len: prefix_len,
            });
        }
        if base & ID_RANGE_BIT == 0 {
            return Err(IdRangeError::LowerHalf(base));
        }
        Ok(r)
    }

    /// Bits below the prefix.
    pub fn suffix_bits(&self) -> u32 {
        32 - u32::from(self.prefix_len)
    }

    /// Mask of the bits below the prefix.
    pub fn suffix_mask(&self) -> u32 {
        (((1u64 << self.suffix_bits()) - 1) & u64::from(u32::MAX)) as u32
    }

    /// IDs in the range.
    pub fn size(&self) -> u64 {
        1u64 << self.suffix_bits()
    }

    /// True when `id` lies in the range.
    pub fn contains(&self, id: u32) -> bool {
        id & !self.suffix_mask() == self.base
    }

    /// True when the two ranges share an ID.
    pub fn overlaps(&self, o: &IdRange) -> bool {
        self.contains(o.base) || o.contains(self.base)
    }
}

impl std::fmt::Display for IdRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#010x}/{}", self.base, self.prefix_len)
    }
}

impl std::str::FromStr for IdRange {
    type Err = IdRangeError;

    fn from_str(s: &str) -> Result<IdRange, IdRangeError> {
        let syntax = || IdRangeError::Syntax(s.to_string());
        let (b, l) = s.split_once('/').ok_or_else(syntax)?;
        let b = b.trim();
        let base = match b.strip_prefix("0x").or_else(|| b.strip_prefix("0X")) {
            Some(h) => u32::from_str_radix(h, 16),
            None => b.parse::<u32>(),
        }
        .map_err(|_| syntax())?;
        let len: u32 = l.trim().parse().map_err(|_| syntax())?;
        let len = u8::try_from(len).map_err(|_| IdRangeError::PrefixLen(len))?;
        IdRange::new(base, len)
    }
}

/// The most GIDs a VM may have (its primary included): as many as its PORT_INFO
/// carries to the guest (the primary and `PORT_INFO_MAX_MORE_GIDS` more, one rx buffer).
pub const MAX_GIDS: usize = 1 + pvcm_wire::abi::PORT_INFO_MAX_MORE_GIDS;

/// The bit that marks a `pv_cm_id` from a VM's own range ([`IdRange`]): the host's
/// shared allocation never hands out an ID with it set.
pub const ID_RANGE_BIT: u32 = 0x8000_0000;

impl VmConfig {
    /// A VM with a GID, deriving the CA GUID from it and a 64 Ki QPN range at 0x10000.
    pub fn new(name: impl Into<String>, gid: Gid) -> VmConfig {
        VmConfig {
            name: name.into(),
            gid,
            more_gids: Vec::new(),
            ca_guid: gid.interface_id() | 0x0200_0000_0000_0000,
            qpn_base: 0x0001_0000,
            qpn_count: 0x0001_0000,
            quota: None,
            id_range: None,
        }
    }

    /// Every GID of the VM, the primary first.
    pub fn gids(&self) -> impl Iterator<Item = Gid> + '_ {
        core::iter::once(self.gid).chain(self.more_gids.iter().copied())
    }

    /// Whether `gid` is one of the VM's GIDs.
    #[inline]
    pub fn holds(&self, gid: Gid) -> bool {
        gid == self.gid || (!self.more_gids.is_empty() && self.more_gids.contains(&gid))
    }

    /// The VM's GID a MAD to `dst` leaves from: the first of its GIDs of `dst`'s family
    /// (IPv4-mapped or IPv6) and scope (link-local or not), else the first of its
    /// family, else the primary. A one-GID VM: always the primary.
    pub fn source_for(&self, dst: Gid) -> Gid {
        if self.more_gids.is_empty() {
            return self.gid;
        }
        let family = |g: Gid| g.to_ipv4().is_some();
        let same_family = |g: &Gid| family(*g) == family(dst);
        self.gids()
            .find(|g| same_family(g) && g.is_link_local() == dst.is_link_local())
            .or_else(|| self.gids().find(same_family))
            .unwrap_or(self.gid)
    }

    /// True when `qpn` lies in the VM's range (or the range check is off).
    pub fn owns_qpn(&self, qpn: u32) -> bool {
        self.qpn_count == 0
            || (qpn >= self.qpn_base
                && u64::from(qpn) < u64::from(self.qpn_base) + u64::from(self.qpn_count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_ranges_parse_in_cidr_notation_and_refuse_what_cannot_work() {
        let r: IdRange = "0x80010000/16".parse().expect("range");
        assert_eq!((r.base, r.prefix_len, r.size()), (0x8001_0000, 16, 65_536));
        assert!(r.contains(0x8001_ffff) && !r.contains(0x8002_0000));
        assert_eq!(r.to_string(), "0x80010000/16");
        assert_eq!(r.to_string().parse::<IdRange>(), Ok(r));
        let big: IdRange = "0x80000000/1".parse().expect("half");
        assert!(big.overlaps(&r) && r.overlaps(&big));
        let other: IdRange = "0x80020000/16".parse().expect("range");
        assert!(!other.overlaps(&r));
        assert_eq!(
            "0x80010001/16".parse::<IdRange>(),
            Err(IdRangeError::Unaligned {
                base: 0x8001_0001,
                len: 16
            })
        );
        assert_eq!(
            "0x00010000/16".parse::<IdRange>(),
            Err(IdRangeError::LowerHalf(0x0001_0000))
        );
        assert_eq!(
            "0x80000000/25".parse::<IdRange>(),
            Err(IdRangeError::PrefixLen(25))
        );
        assert_eq!(
            "0x80000000/0".parse::<IdRange>(),
            Err(IdRangeError::PrefixLen(0))
        );
        assert!(matches!(
            "80000000".parse::<IdRange>(),
            Err(IdRangeError::Syntax(_))
        ));
        assert!(matches!(
            "zz/16".parse::<IdRange>(),
            Err(IdRangeError::Syntax(_))
        ));
    }
}

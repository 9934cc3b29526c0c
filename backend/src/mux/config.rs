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
            default_quota: 65_536,
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
    /// The VM's port GID (RoCEv2: IPv4-mapped).
    pub gid: Gid,
    /// The VM's CA (node) GUID, which its CM puts in REQ/REP and REJ(TIMEOUT) ARIs.
    pub ca_guid: u64,
    /// First QPN the VM may name as its Local QPN.
    pub qpn_base: u32,
    /// How many QPNs from `qpn_base` the VM may use; 0 disables the QPN check.
    pub qpn_count: u32,
    /// Live entries the VM may hold; `None` takes [`MuxConfig::default_quota`].
    pub quota: Option<u32>,
}

impl VmConfig {
    /// A VM with a GID, deriving the CA GUID from it and a 64 Ki QPN range at 0x10000.
    pub fn new(name: impl Into<String>, gid: Gid) -> VmConfig {
        VmConfig {
            name: name.into(),
            gid,
            ca_guid: gid.interface_id() | 0x0200_0000_0000_0000,
            qpn_base: 0x0001_0000,
            qpn_count: 0x0001_0000,
            quota: None,
        }
    }

    /// True when `qpn` lies in the VM's range (or the range check is off).
    pub fn owns_qpn(&self, qpn: u32) -> bool {
        self.qpn_count == 0
            || (qpn >= self.qpn_base
                && u64::from(qpn) < u64::from(self.qpn_base) + u64::from(self.qpn_count))
    }
}

//! The mux's counters: the infiniband_cm groups (shared with the guest, in
//! [`pvcm_wire::counters`]) plus one counter per drop reason.

use core::fmt;
use core::ops::AddAssign;

pub use pvcm_wire::counters::{CmCounters, Group};

macro_rules! drop_reasons {
    ($($(#[$m:meta])* $v:ident => $s:expr,)*) => {
        /// Why the mux dropped a MAD. Every drop is counted under one of these.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum DropReason { $($(#[$m])* $v,)* }

        impl DropReason {
            /// Every reason, in counter order.
            pub const ALL: &'static [DropReason] = &[$(DropReason::$v,)*];
            /// Number of reasons.
            pub const COUNT: usize = DropReason::ALL.len();
            /// Snake-case name for tables and metrics.
            pub fn name(self) -> &'static str {
                match self { $(DropReason::$v => $s,)* }
            }
        }
    };
}

drop_reasons! {
    /// Not a well-formed CM MAD (length, versions, class, attribute, method).
    Malformed => "malformed",
    /// From a VM: a MAD for a connection the VM does not own or the mux never saw.
    UnknownConnection => "unknown_connection",
    /// From the wire: a remote comm ID / request ID / TID that maps to no entry.
    NoRoute => "no_route",
    /// From the wire: a REQ, SIDR_REQ or Get for a GID no attached VM has.
    UnknownGid => "unknown_gid",
    /// A MAD for a connection in quarantine: from the wire, a late MAD of a closed
    /// connection; from a VM, its CM's answer that crossed the peer's end of the
    /// connection (a REJ or RTU after the peer's REJ).
    Quarantined => "quarantined",
    /// From a VM: a REQ whose source GID is not the VM's.
    SpoofedGid => "spoofed_gid",
    /// From a VM: a Local QPN outside the VM's assigned range.
    SpoofedQpn => "spoofed_qpn",
    /// From a VM: a Local CA GUID (or REJ(TIMEOUT) ARI) that is not the VM's.
    SpoofedCaGuid => "spoofed_ca_guid",
    /// From a VM: a REQ over the VM's quota of live entries (answered with REJ NO_RESOURCES).
    OverQuota => "over_quota",
    /// From the wire: a REQ for a VM at its quota (answered with REJ NO_RESOURCES).
    VmOverQuota => "vm_over_quota",
    /// The host's table of entries is full.
    TableFull => "table_full",
    /// From the wire: a MAD for a connection of a detached VM, absorbed by the proxy.
    Absorbed => "absorbed",
    /// From the wire: a MAD whose destination GID is not its connection owner's.
    WrongDestination => "wrong_destination",
    /// From the wire: a REJ(TIMEOUT) from another port than the one that sent the REQ.
    WrongSource => "wrong_source",
    /// A message that is not valid in the connection's current state.
    BadState => "bad_state",
}

/// Drop counters, one per [`DropReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DropCounters(pub [u64; DropReason::COUNT]);

impl DropCounters {
    /// Counts one drop.
    #[inline]
    pub fn bump(&mut self, r: DropReason) {
        self.0[r as usize] += 1;
    }
    /// One value.
    pub fn get(&self, r: DropReason) -> u64 {
        self.0[r as usize]
    }
    /// Sum over all reasons.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }
}

impl AddAssign<&DropCounters> for DropCounters {
    fn add_assign(&mut self, o: &DropCounters) {
        for (d, s) in self.0.iter_mut().zip(o.0.iter()) {
            *d += s;
        }
    }
}

impl fmt::Display for DropCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "drops:")?;
        for r in DropReason::ALL {
            let v = self.get(*r);
            if v != 0 {
                writeln!(f, "  {:<20} {v}", r.name())?;
            }
        }
        Ok(())
    }
}

//! Counters in the shape of Linux's `/sys/class/infiniband_cm/<dev>/<port>/counters`:
//! four groups, one value per CM message type; plus one counter per drop reason.

use core::fmt;
use core::ops::AddAssign;

use pvcm_wire::mad::AttributeId;

/// The four infiniband_cm counter groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    /// Messages sent towards the wire (includes retries).
    TxMsgs,
    /// Retransmissions sent towards the wire.
    TxRetries,
    /// Messages received from the wire.
    RxMsgs,
    /// Received duplicates.
    RxDuplicates,
}

impl Group {
    /// All groups, in the order Linux lists its sysfs directories.
    pub const ALL: [Group; 4] = [
        Group::RxDuplicates,
        Group::RxMsgs,
        Group::TxMsgs,
        Group::TxRetries,
    ];

    /// The sysfs directory name.
    pub fn name(self) -> &'static str {
        match self {
            Group::TxMsgs => "cm_tx_msgs",
            Group::TxRetries => "cm_tx_retries",
            Group::RxMsgs => "cm_rx_msgs",
            Group::RxDuplicates => "cm_rx_duplicates",
        }
    }
}

/// Per-message-type counters of one group set (one VM, or a host sum).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CmCounters {
    /// `cm_tx_msgs`, indexed by [`AttributeId::counter_index`].
    pub tx_msgs: [u64; 11],
    /// `cm_tx_retries`.
    pub tx_retries: [u64; 11],
    /// `cm_rx_msgs`.
    pub rx_msgs: [u64; 11],
    /// `cm_rx_duplicates`.
    pub rx_duplicates: [u64; 11],
}

impl CmCounters {
    /// The array of one group.
    pub fn group(&self, g: Group) -> &[u64; 11] {
        match g {
            Group::TxMsgs => &self.tx_msgs,
            Group::TxRetries => &self.tx_retries,
            Group::RxMsgs => &self.rx_msgs,
            Group::RxDuplicates => &self.rx_duplicates,
        }
    }

    fn group_mut(&mut self, g: Group) -> &mut [u64; 11] {
        match g {
            Group::TxMsgs => &mut self.tx_msgs,
            Group::TxRetries => &mut self.tx_retries,
            Group::RxMsgs => &mut self.rx_msgs,
            Group::RxDuplicates => &mut self.rx_duplicates,
        }
    }

    /// Counts one message of `attr` in group `g` (ClassPortInfo is not counted, as in Linux).
    #[inline]
    pub fn bump(&mut self, g: Group, attr: AttributeId) {
        if let Some(i) = attr.counter_index() {
            self.group_mut(g)[i] += 1;
        }
    }

    /// One value.
    pub fn get(&self, g: Group, attr: AttributeId) -> u64 {
        attr.counter_index().map_or(0, |i| self.group(g)[i])
    }
}

impl AddAssign<&CmCounters> for CmCounters {
    fn add_assign(&mut self, o: &CmCounters) {
        for g in Group::ALL {
            let dst = self.group_mut(g);
            for (d, s) in dst.iter_mut().zip(o.group(g)) {
                *d += s;
            }
        }
    }
}

impl fmt::Display for CmCounters {
    /// The infiniband_cm table: per group, one line per non-zero message type.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for g in Group::ALL {
            writeln!(f, "{}:", g.name())?;
            for a in AttributeId::CM_MESSAGES {
                let v = self.get(g, a);
                if v != 0 {
                    writeln!(f, "  {:<10} {v}", a.name())?;
                }
            }
        }
        Ok(())
    }
}

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
    /// From the wire: a MAD for a `pv_cm_id` in quarantine (a late MAD of a closed connection).
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

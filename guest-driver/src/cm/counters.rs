//! Counters in the shape of Linux's `infiniband_cm` sysfs groups, plus counted drops.

use core::fmt;

use pvcm_wire::mad::AttributeId;

/// The 11 CM message types, in attribute-ID order (Linux's counter order).
pub const MESSAGES: [AttributeId; 11] = AttributeId::CM_MESSAGES;

/// One of Linux's four counter groups (`/sys/class/infiniband/*/ports/*/cm_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// `cm_tx_msgs`: every MAD sent, retries and answers to duplicates included.
    TxMsgs,
    /// `cm_tx_retries`: MADs sent again (a timer retry, or an answer re-sent because a
    /// duplicate arrived).
    TxRetries,
    /// `cm_rx_msgs`: every CM MAD received with a valid header.
    RxMsgs,
    /// `cm_rx_duplicates`: received MADs recognised as repeats.
    RxDuplicates,
}

impl Group {
    /// All four groups.
    pub const ALL: [Group; 4] = [
        Group::TxMsgs,
        Group::TxRetries,
        Group::RxMsgs,
        Group::RxDuplicates,
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

/// Per-agent CM counters: four groups, one value per message type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CmCounters {
    groups: [[u64; 11]; 4],
    /// ClassPortInfo GETs received (not a CM protocol message, so not in the groups).
    pub class_port_info_rx: u64,
    /// ClassPortInfo GETRESPs sent.
    pub class_port_info_tx: u64,
}

impl CmCounters {
    /// The value of one counter; 0 for ClassPortInfo (see its own fields).
    pub fn get(&self, g: Group, attr: AttributeId) -> u64 {
        attr.counter_index()
            .map_or(0, |i| self.groups[g as usize][i])
    }

    /// The 11 values of a group, in attribute order.
    pub fn group(&self, g: Group) -> [u64; 11] {
        self.groups[g as usize]
    }

    /// Sum of a group.
    pub fn total(&self, g: Group) -> u64 {
        self.groups[g as usize].iter().sum()
    }

    pub(crate) fn bump(&mut self, g: Group, attr: AttributeId) {
        if let Some(i) = attr.counter_index() {
            self.groups[g as usize][i] += 1;
        }
    }
}

impl fmt::Display for CmCounters {
    /// One line per group: `cm_tx_msgs req=.. mra=.. ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for g in Group::ALL {
            write!(f, "{}", g.name())?;
            for a in MESSAGES {
                write!(f, " {}={}", a.name(), self.get(g, a))?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// Why the agent dropped a MAD it received (or, for `EmitFailed`, one it built).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Shorter than a 256-byte MAD.
    Truncated,
    /// Not the CM class this agent speaks (base version, class or class version).
    WrongClass,
    /// An attribute ID the CM class does not define.
    UnknownAttribute,
    /// A method the attribute does not travel with.
    WrongMethod,
    /// A header that checks out but a message whose fields do not parse (reserved
    /// codes, lengths beyond their fields).
    Malformed,
    /// Names no connection the agent knows (and needs no answer).
    UnknownConnection,
    /// Known connection, but its state does not take this message.
    BadState,
    /// A DREQ whose Remote QPN is not the connection's local QPN.
    QpnMismatch,
    /// A reply to nothing the agent asked (APR, MRA of a LAP, ClassPortInfo GETRESP).
    Unsolicited,
    /// A message the agent built could not be encoded (never expected).
    EmitFailed,
}

impl DropReason {
    /// Every reason.
    pub const ALL: [DropReason; 10] = [
        DropReason::Truncated,
        DropReason::WrongClass,
        DropReason::UnknownAttribute,
        DropReason::WrongMethod,
        DropReason::Malformed,
        DropReason::UnknownConnection,
        DropReason::BadState,
        DropReason::QpnMismatch,
        DropReason::Unsolicited,
        DropReason::EmitFailed,
    ];

    /// Short name for logs.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Truncated => "truncated",
            DropReason::WrongClass => "wrong_class",
            DropReason::UnknownAttribute => "unknown_attribute",
            DropReason::WrongMethod => "wrong_method",
            DropReason::Malformed => "malformed",
            DropReason::UnknownConnection => "unknown_connection",
            DropReason::BadState => "bad_state",
            DropReason::QpnMismatch => "qpn_mismatch",
            DropReason::Unsolicited => "unsolicited",
            DropReason::EmitFailed => "emit_failed",
        }
    }

    /// True for the reasons that mean the bytes themselves were bad.
    pub fn is_malformed(self) -> bool {
        matches!(
            self,
            DropReason::Truncated
                | DropReason::WrongClass
                | DropReason::UnknownAttribute
                | DropReason::WrongMethod
                | DropReason::Malformed
        )
    }

    pub(crate) fn of_error(e: &pvcm_wire::Error) -> DropReason {
        use pvcm_wire::Error as E;
        match e {
            E::Truncated { .. } => DropReason::Truncated,
            E::BaseVersion(_) | E::MgmtClass(_) | E::ClassVersion(_) => DropReason::WrongClass,
            E::UnknownAttribute(_) => DropReason::UnknownAttribute,
            E::Method { .. } => DropReason::WrongMethod,
            _ => DropReason::Malformed,
        }
    }
}

/// Counted drops, one value per [`DropReason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Drops([u64; 10]);

impl Drops {
    /// Drops for one reason.
    pub fn get(&self, r: DropReason) -> u64 {
        self.0[r as usize]
    }

    /// All drops.
    pub fn total(&self) -> u64 {
        self.0.iter().sum()
    }

    /// Drops of malformed input (see [`DropReason::is_malformed`]).
    pub fn malformed(&self) -> u64 {
        DropReason::ALL
            .iter()
            .filter(|r| r.is_malformed())
            .map(|r| self.get(*r))
            .sum()
    }

    pub(crate) fn bump(&mut self, r: DropReason) {
        self.0[r as usize] += 1;
    }
}

impl fmt::Display for Drops {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "drops")?;
        for r in DropReason::ALL {
            write!(f, " {}={}", r.name(), self.get(r))?;
        }
        Ok(())
    }
}

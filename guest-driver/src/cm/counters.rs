//! Counters in the shape of Linux's `infiniband_cm` sysfs groups, plus counted drops.

use core::fmt;

use pvcm_wire::mad::AttributeId;

pub use pvcm_wire::counters::{CmCounters, Group};

/// The 11 CM message types, in attribute-ID order (Linux's counter order).
pub const MESSAGES: [AttributeId; 11] = AttributeId::CM_MESSAGES;

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
    /// A LAP for a connection: alternate paths are not supported on RoCE, and Linux
    /// drops LAPs there too (`cm_lap_handler` returns `-EINVAL`); nothing is answered.
    LapOnRoce,
}

impl DropReason {
    /// Every reason.
    pub const ALL: [DropReason; 11] = [
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
        DropReason::LapOnRoce,
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
            DropReason::LapOnRoce => "lap_on_roce",
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
pub struct Drops([u64; 11]);

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

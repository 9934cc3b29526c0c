//! CM counters in the shape of Linux's `/sys/class/infiniband_cm/<dev>/<port>/counters`:
//! four groups, one value per CM message type. The host mux (per VM and summed) and the
//! guest's CM agent (per device) count in this one shape.

use core::fmt;
use core::ops::AddAssign;

use crate::mad::AttributeId;

/// The four infiniband_cm counter groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Group {
    /// `cm_tx_msgs`: every MAD sent, retries included.
    TxMsgs,
    /// `cm_tx_retries`: MADs sent again (a timer retry, or an answer re-sent because a
    /// duplicate arrived).
    TxRetries,
    /// `cm_rx_msgs`: every CM MAD received.
    RxMsgs,
    /// `cm_rx_duplicates`: received MADs recognised as repeats.
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

/// Four groups of one value per CM message type (indexed like
/// [`AttributeId::counter_index`]), plus ClassPortInfo, which Linux does not count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CmCounters {
    groups: [[u64; 11]; 4],
    /// ClassPortInfo MADs received (not a CM protocol message, so not in the groups).
    pub class_port_info_rx: u64,
    /// ClassPortInfo MADs sent.
    pub class_port_info_tx: u64,
}

impl CmCounters {
    /// The 11 values of a group, in attribute order.
    pub fn group(&self, g: Group) -> &[u64; 11] {
        &self.groups[g as usize]
    }

    /// One value; 0 for ClassPortInfo (see its own fields).
    pub fn get(&self, g: Group, attr: AttributeId) -> u64 {
        attr.counter_index()
            .map_or(0, |i| self.groups[g as usize][i])
    }

    /// Sum of a group.
    pub fn total(&self, g: Group) -> u64 {
        self.groups[g as usize].iter().sum()
    }

    /// Counts one message of `attr` in group `g` (ClassPortInfo goes to its own fields
    /// for `RxMsgs`/`TxMsgs` and is not counted otherwise).
    #[inline]
    pub fn bump(&mut self, g: Group, attr: AttributeId) {
        match (attr.counter_index(), g) {
            (Some(i), _) => self.groups[g as usize][i] += 1,
            (None, Group::RxMsgs) => self.class_port_info_rx += 1,
            (None, Group::TxMsgs) => self.class_port_info_tx += 1,
            (None, _) => {}
        }
    }
}

impl AddAssign<&CmCounters> for CmCounters {
    fn add_assign(&mut self, o: &CmCounters) {
        for (dst, src) in self.groups.iter_mut().zip(o.groups.iter()) {
            for (d, s) in dst.iter_mut().zip(src) {
                *d += s;
            }
        }
        self.class_port_info_rx += o.class_port_info_rx;
        self.class_port_info_tx += o.class_port_info_tx;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_sum_and_skip_class_port_info() {
        let mut a = CmCounters::default();
        a.bump(Group::TxMsgs, AttributeId::Dreq);
        a.bump(Group::TxMsgs, AttributeId::Dreq);
        a.bump(Group::RxDuplicates, AttributeId::Req);
        a.bump(Group::RxMsgs, AttributeId::ClassPortInfo);
        a.bump(Group::TxRetries, AttributeId::ClassPortInfo);
        let mut b = a;
        b += &a;
        assert_eq!(b.get(Group::TxMsgs, AttributeId::Dreq), 4);
        assert_eq!(b.total(Group::RxDuplicates), 2);
        assert_eq!(b.get(Group::RxMsgs, AttributeId::ClassPortInfo), 0);
        assert_eq!((b.class_port_info_rx, b.class_port_info_tx), (2, 0));
        assert_eq!(
            a.to_string(),
            "cm_rx_duplicates:\n  req        1\ncm_rx_msgs:\ncm_tx_msgs:\n  dreq       2\ncm_tx_retries:\n"
        );
    }
}

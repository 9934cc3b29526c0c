//! The lab's stamp in CM private data: who meant a REQ (or REP) for whom, so the
//! receiving VM can tell a MAD delivered to the wrong VM from one meant for it.

/// Bytes of a stamp.
pub const STAMP_LEN: usize = 20;
const MAGIC: [u8; 4] = *b"PVLB";

/// Who sent a REQ/REP to whom, and what the receiver is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Run ID (differs between runs, so nothing stale is taken for ours).
    pub run: u32,
    /// Sender VM (global index).
    pub src_vm: u16,
    /// Receiver VM (global index).
    pub dst_vm: u16,
    /// Sender process.
    pub src_proc: u16,
    /// Receiver process.
    pub dst_proc: u16,
    /// Scenario-defined plan (what the receiver does with the request).
    pub plan: u8,
    /// Connection serial (unique per sender VM).
    pub serial: u32,
}

impl Stamp {
    /// The bytes (put at the start of the private data).
    pub fn to_bytes(&self) -> [u8; STAMP_LEN] {
        let mut b = [0u8; STAMP_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..8].copy_from_slice(&self.run.to_be_bytes());
        b[8..10].copy_from_slice(&self.src_vm.to_be_bytes());
        b[10..12].copy_from_slice(&self.dst_vm.to_be_bytes());
        b[12..14].copy_from_slice(&self.src_proc.to_be_bytes());
        b[14..16].copy_from_slice(&self.dst_proc.to_be_bytes());
        b[16] = self.plan;
        b[17..20].copy_from_slice(&self.serial.to_be_bytes()[1..4]);
        b
    }

    /// Parses a stamp at the start of private data (`None`: not a lab stamp).
    pub fn parse(pd: &[u8]) -> Option<Stamp> {
        let b = pd.get(..STAMP_LEN)?;
        if b[0..4] != MAGIC {
            return None;
        }
        let u16_at = |i: usize| u16::from_be_bytes([b[i], b[i + 1]]);
        Some(Stamp {
            run: u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            src_vm: u16_at(8),
            dst_vm: u16_at(10),
            src_proc: u16_at(12),
            dst_proc: u16_at(14),
            plan: b[16],
            serial: u32::from_be_bytes([0, b[17], b[18], b[19]]),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let s = Stamp {
            run: 0xdead_beef,
            src_vm: 3,
            dst_vm: 40,
            src_proc: 63,
            dst_proc: 1,
            plan: 2,
            serial: 0x00ab_cdef,
        };
        let mut pd = s.to_bytes().to_vec();
        pd.extend_from_slice(&[0; 30]);
        assert_eq!(Stamp::parse(&pd), Some(s));
        assert_eq!(Stamp::parse(&pd[..10]), None);
        pd[0] = b'x';
        assert_eq!(Stamp::parse(&pd), None);
    }
}

//! Messages for a VM's rx queue, and the MADs the wire port hands over.

use std::fmt;

use pvcm_wire::Gid;
use pvcm_wire::abi::{self, HEADER_LEN, MsgHeader, MsgType, RX_BUFFER_LEN, SendStatus};
use pvcm_wire::mad::MAD_LEN;

/// A MAD for a log line: its CM header (attribute, method, TID), or its raw attribute
/// ID when the header does not parse.
pub(crate) fn describe_mad(mad: &[u8]) -> String {
    use pvcm_wire::mad::{Header, Packet, field};
    match Packet::new_checked(mad).and_then(|p| Header::parse(&p)) {
        Ok(h) => h.to_string(),
        Err(_) if mad.len() >= MAD_LEN => {
            format!("attr_id={:#06x} (no CM header)", field::ATTR_ID.get(mad))
        }
        Err(_) => format!("{} bytes (no MAD)", mad.len()),
    }
}

/// A MAD received from the wire that passed the port's checks, with its addressing.
#[derive(Debug, Clone)]
pub struct InMad {
    /// Sender's GID.
    pub src: Gid,
    /// The GID it was addressed to (its destination address): one of its VM's GIDs.
    pub dst: Gid,
    /// The sender's QP (1) for the rx header.
    pub src_qp: u32,
    /// Q_Key.
    pub qkey: u32,
    /// P_Key.
    pub pkey: u16,
    /// The MAD.
    pub mad: [u8; MAD_LEN],
}

impl crate::mux::MadSlot for InMad {
    fn mad(&self) -> &[u8; MAD_LEN] {
        &self.mad
    }
    fn mad_mut(&mut self) -> &mut [u8; MAD_LEN] {
        &mut self.mad
    }
}

/// One message for a VM's rx queue: header + payload, ready to copy.
#[derive(Clone)]
pub struct RxMsg {
    buf: [u8; RX_BUFFER_LEN],
    len: u16,
}

impl fmt::Debug for RxMsg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RxMsg")
            .field("type", &self.msg_type())
            .field("len", &self.len)
            .finish()
    }
}

impl RxMsg {
    fn with(h: &MsgHeader, payload: &[u8]) -> RxMsg {
        let mut m = RxMsg {
            buf: [0; RX_BUFFER_LEN],
            len: 0,
        };
        let n = payload.len().min(RX_BUFFER_LEN - HEADER_LEN);
        let h = MsgHeader {
            len: n as u32,
            ..*h
        };
        // The buffer holds a header: emit cannot fail.
        let _ = h.emit(&mut m.buf);
        m.buf[HEADER_LEN..HEADER_LEN + n].copy_from_slice(&payload[..n]);
        m.len = (HEADER_LEN + n) as u16;
        m
    }

    /// A MAD from `remote` (CM defaults for the addressing).
    pub fn mad(remote: Gid, mad: &[u8; MAD_LEN]) -> RxMsg {
        RxMsg::with(&MsgHeader::mad(remote), mad)
    }

    /// A MAD received from the wire.
    pub fn from_wire(f: &InMad, mad: &[u8; MAD_LEN]) -> RxMsg {
        let h = MsgHeader {
            remote_qpn: f.src_qp,
            qkey: f.qkey,
            ..MsgHeader::mad(f.src)
        };
        RxMsg::with(&h, mad)
    }

    /// A SEND_ERROR echoing a tx MAD's header and payload.
    pub fn send_error(tx: &MsgHeader, status: SendStatus, payload: &[u8]) -> RxMsg {
        let h = MsgHeader {
            msg_type: MsgType::SendError,
            status: status as u16,
            ..*tx
        };
        RxMsg::with(&h, payload)
    }

    /// A control message.
    pub fn control(t: MsgType, status: u16, payload: &[u8]) -> RxMsg {
        let h = MsgHeader {
            status,
            ..MsgHeader::control(t, payload.len() as u32)
        };
        RxMsg::with(&h, payload)
    }

    /// An EVENT.
    pub fn event(e: abi::Event) -> RxMsg {
        let mut p = [0u8; abi::EVENT_LEN];
        let _ = e.emit(&mut p);
        RxMsg::control(MsgType::Event, 0, &p)
    }

    /// A message from the bytes [`RxMsg::bytes`] gave (a migrated backlog): `None` if
    /// they cannot be one (shorter than a header, longer than an rx buffer).
    pub fn from_bytes(b: &[u8]) -> Option<RxMsg> {
        if b.len() < HEADER_LEN || b.len() > RX_BUFFER_LEN {
            return None;
        }
        let mut m = RxMsg {
            buf: [0; RX_BUFFER_LEN],
            len: b.len() as u16,
        };
        m.buf[..b.len()].copy_from_slice(b);
        Some(m)
    }

    /// The bytes to write into an rx buffer.
    pub fn bytes(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// Never empty (a header at least); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The message type.
    pub fn msg_type(&self) -> Option<MsgType> {
        MsgType::from_u16(u16::from_le_bytes([self.buf[0], self.buf[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pvcm_wire::mad::AttributeId;

    #[test]
    fn a_dropped_mad_is_described_by_its_header_or_its_attribute() {
        let rep = pvcm_wire::testing::ids(AttributeId::Rep, 0x1234, 1, 2);
        let d = describe_mad(&rep);
        assert!(d.contains(&AttributeId::Rep.to_string()), "{d}");
        assert!(d.contains("tid=0x0000000000001234"), "{d}");
        let mut junk = [0u8; MAD_LEN];
        junk[16..18].copy_from_slice(&0x0013u16.to_be_bytes());
        assert_eq!(describe_mad(&junk), "attr_id=0x0013 (no CM header)");
        assert_eq!(describe_mad(&junk[..10]), "10 bytes (no MAD)");
    }
}

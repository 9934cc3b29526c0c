//! The pvcm device ABI (version 1): the messages the guest driver and the device
//! exchange on the two virtqueues. See `docs/device-abi.md` for the prose.
//!
//! Every buffer (descriptor chain) carries one message: a 48-byte little-endian
//! [`MsgHeader`] followed by `len` payload bytes — a 256-byte MAD, or a control payload.
//! The MAD addressing fields mirror Linux's `struct ib_user_mad_hdr`.

use core::fmt;

use crate::error::{Error, Result, check_len};
use crate::gid::Gid;
use crate::mad::MAD_LEN;

/// ABI version carried in the config space and in [`PortInfo`].
pub const ABI_VERSION: u32 = 1;
/// Config-space magic: "PVCM" little-endian.
pub const CONFIG_MAGIC: u32 = u32::from_le_bytes(*b"PVCM");
/// Bytes of config space the device offers (magic + ABI version).
pub const CONFIG_LEN: usize = 8;
/// Default virtio device ID the guest driver looks for (PCI device 0x1040 + 63 = 0x107f).
pub const DEFAULT_VIRTIO_ID: u32 = 63;
/// Virtqueue carrying driver -> device messages.
pub const TX_QUEUE: u16 = 0;
/// Virtqueue carrying device -> driver messages.
pub const RX_QUEUE: u16 = 1;
/// Length of the message header.
pub const HEADER_LEN: usize = 48;
/// Largest payload of any message (a MAD).
pub const MAX_PAYLOAD: usize = MAD_LEN;
/// Size of an rx buffer the driver must post: header + the largest payload.
pub const RX_BUFFER_LEN: usize = HEADER_LEN + MAX_PAYLOAD;

/// Message types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MsgType {
    /// A MAD: driver -> device to send it, device -> driver when one arrived.
    Mad = 1,
    /// Driver -> device: asks for [`PortInfo`].
    PortInfoRequest = 2,
    /// Device -> driver: the port's [`PortInfo`].
    PortInfo = 3,
    /// Device -> driver: an [`Event`].
    Event = 4,
    /// Device -> driver: a MAD the driver sent was not sent; the payload is that MAD,
    /// `status` says why (a [`SendStatus`]).
    SendError = 5,
}

impl MsgType {
    /// The type of a raw code.
    pub fn from_u16(v: u16) -> Option<MsgType> {
        Some(match v {
            1 => MsgType::Mad,
            2 => MsgType::PortInfoRequest,
            3 => MsgType::PortInfo,
            4 => MsgType::Event,
            5 => MsgType::SendError,
            _ => return None,
        })
    }
}

/// Why the device did not send a MAD (status of a [`MsgType::SendError`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum SendStatus {
    /// Sent.
    Ok = 0,
    /// Not a well-formed CM MAD.
    Malformed = 1,
    /// The MAD names a connection the device does not know for this VM.
    UnknownConnection = 2,
    /// The MAD's source GID, QPN or CA GUID is not the VM's.
    Spoofed = 3,
    /// Over the VM's quota or the host's table.
    NoResources = 4,
    /// Not valid in the connection's state.
    BadState = 5,
    /// The wire could not take it.
    WireError = 6,
}

/// Header fields (byte ranges, little-endian).
pub mod field {
    use crate::field::Field;
    /// u16 message type.
    pub const TYPE: Field = 0..2;
    /// u16 status.
    pub const STATUS: Field = 2..4;
    /// u32 payload length.
    pub const LEN: Field = 4..8;
    /// u32 remote QPN (QP1 for CM).
    pub const REMOTE_QPN: Field = 8..12;
    /// u32 Q_Key.
    pub const QKEY: Field = 12..16;
    /// u16 P_Key index.
    pub const PKEY_INDEX: Field = 16..18;
    /// u8 service level.
    pub const SL: usize = 18;
    /// u8 traffic class.
    pub const TRAFFIC_CLASS: usize = 19;
    /// u8 hop limit.
    pub const HOP_LIMIT: usize = 20;
    /// u8 flags (bit 0: GRH present).
    pub const FLAGS: usize = 21;
    /// u16 reserved.
    pub const RESERVED0: Field = 22..24;
    /// u32 flow label (20 bits).
    pub const FLOW_LABEL: Field = 24..28;
    /// u32 reserved.
    pub const RESERVED1: Field = 28..32;
    /// 16-byte GID: destination on tx, source on rx.
    pub const REMOTE_GID: Field = 32..48;
}

/// Flag: the MAD has (tx: needs) a GRH. Always set on RoCE.
pub const FLAG_GRH: u8 = 1;

fn le16(b: &[u8], f: core::ops::Range<usize>) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[f]);
    u16::from_le_bytes(a)
}

fn le32(b: &[u8], f: core::ops::Range<usize>) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[f]);
    u32::from_le_bytes(a)
}

/// A parsed message header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsgHeader {
    /// Message type.
    pub msg_type: MsgType,
    /// Status (0 = ok; [`SendStatus`] for a send error).
    pub status: u16,
    /// Payload length.
    pub len: u32,
    /// Remote QPN.
    pub remote_qpn: u32,
    /// Q_Key.
    pub qkey: u32,
    /// P_Key index.
    pub pkey_index: u16,
    /// Service level.
    pub sl: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Flags ([`FLAG_GRH`]).
    pub flags: u8,
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Remote GID: where a tx MAD goes, where an rx MAD came from.
    pub remote_gid: Gid,
}

impl MsgHeader {
    /// A header for a MAD to or from `remote_gid`, CM defaults (QP1, GSI Q_Key, hop
    /// limit 64, GRH).
    pub fn mad(remote_gid: Gid) -> MsgHeader {
        MsgHeader {
            msg_type: MsgType::Mad,
            status: 0,
            len: MAD_LEN as u32,
            remote_qpn: 1,
            qkey: crate::roce::GSI_QKEY,
            pkey_index: 0,
            sl: 0,
            traffic_class: 0,
            hop_limit: 64,
            flags: FLAG_GRH,
            flow_label: 0,
            remote_gid,
        }
    }

    /// A control message header with no addressing.
    pub fn control(msg_type: MsgType, len: u32) -> MsgHeader {
        MsgHeader {
            msg_type,
            len,
            remote_qpn: 0,
            qkey: 0,
            hop_limit: 0,
            flags: 0,
            remote_gid: Gid::ZERO,
            ..MsgHeader::mad(Gid::ZERO)
        }
    }

    /// Parses a header; checks the type and that `len` fits the largest payload.
    pub fn parse(b: &[u8]) -> Result<MsgHeader> {
        check_len(b, HEADER_LEN)?;
        let t = le16(b, field::TYPE);
        let msg_type = MsgType::from_u16(t).ok_or(Error::Reserved {
            field: "msg_type",
            value: t.into(),
        })?;
        let len = le32(b, field::LEN);
        if len as usize > MAX_PAYLOAD {
            return Err(Error::TooLong {
                field: "payload",
                len: len as usize,
                max: MAX_PAYLOAD,
            });
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[field::REMOTE_GID]);
        Ok(MsgHeader {
            msg_type,
            status: le16(b, field::STATUS),
            len,
            remote_qpn: le32(b, field::REMOTE_QPN),
            qkey: le32(b, field::QKEY),
            pkey_index: le16(b, field::PKEY_INDEX),
            sl: b[field::SL],
            traffic_class: b[field::TRAFFIC_CLASS],
            hop_limit: b[field::HOP_LIMIT],
            flags: b[field::FLAGS],
            flow_label: le32(b, field::FLOW_LABEL) & 0xF_FFFF,
            remote_gid: Gid(gid),
        })
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `b`.
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len(b, HEADER_LEN)?;
        let b = &mut b[..HEADER_LEN];
        b.fill(0);
        b[field::TYPE].copy_from_slice(&(self.msg_type as u16).to_le_bytes());
        b[field::STATUS].copy_from_slice(&self.status.to_le_bytes());
        b[field::LEN].copy_from_slice(&self.len.to_le_bytes());
        b[field::REMOTE_QPN].copy_from_slice(&self.remote_qpn.to_le_bytes());
        b[field::QKEY].copy_from_slice(&self.qkey.to_le_bytes());
        b[field::PKEY_INDEX].copy_from_slice(&self.pkey_index.to_le_bytes());
        b[field::SL] = self.sl;
        b[field::TRAFFIC_CLASS] = self.traffic_class;
        b[field::HOP_LIMIT] = self.hop_limit;
        b[field::FLAGS] = self.flags;
        b[field::FLOW_LABEL].copy_from_slice(&(self.flow_label & 0xF_FFFF).to_le_bytes());
        b[field::REMOTE_GID].copy_from_slice(&self.remote_gid.0);
        Ok(())
    }
}

impl fmt::Display for MsgHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} status={} len={} remote={} qpn={:#x}",
            self.msg_type, self.status, self.len, self.remote_gid, self.remote_qpn
        )
    }
}

/// Port events (payload of [`MsgType::Event`]: u32 event, u32 reserved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Event {
    /// The port is up: MADs flow.
    PortUp = 1,
    /// The port is down: MADs sent now fail with [`SendStatus::WireError`].
    PortDown = 2,
    /// The device reset: every connection of this VM is gone on the host side; the
    /// driver must drop its CM state.
    DeviceReset = 3,
}

/// Length of an event payload.
pub const EVENT_LEN: usize = 8;

impl Event {
    /// Parses an event payload.
    pub fn parse(b: &[u8]) -> Result<Event> {
        check_len(b, EVENT_LEN)?;
        match le32(b, 0..4) {
            1 => Ok(Event::PortUp),
            2 => Ok(Event::PortDown),
            3 => Ok(Event::DeviceReset),
            v => Err(Error::Reserved {
                field: "event",
                value: v,
            }),
        }
    }

    /// Writes an event payload.
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        check_len(b, EVENT_LEN)?;
        b[..4].copy_from_slice(&(*self as u32).to_le_bytes());
        b[4..8].fill(0);
        Ok(())
    }
}

/// Length of a [`PortInfo`] payload of a one-GID VM as this ABI writes it: the 96-byte
/// original record plus the appended link fields (`active_mtu`, `ca_ack_delay`) and the
/// count of further GIDs (0). Each further GID adds 16 bytes after it.
pub const PORT_INFO_LEN: usize = 112;
/// Shortest [`PortInfo`] payload a driver accepts: the original 96-byte record, as a
/// device that predates the appended fields writes it.
pub const PORT_INFO_MIN_LEN: usize = 96;
/// The most further GIDs a [`PortInfo`] carries: as many as fit one rx buffer's payload
/// ([`MAX_PAYLOAD`]) after the 112 bytes.
pub const PORT_INFO_MAX_MORE_GIDS: usize = (MAX_PAYLOAD - PORT_INFO_LEN) / 16;
/// Longest [`PortInfo`] payload: with [`PORT_INFO_MAX_MORE_GIDS`] further GIDs.
pub const PORT_INFO_MAX_LEN: usize = PORT_INFO_LEN + 16 * PORT_INFO_MAX_MORE_GIDS;

/// IBTA path MTU codes (`enum ib_mtu`): 1 = 256, 2 = 512, 3 = 1024, 4 = 2048,
/// 5 = 4096 bytes.
pub const MTU_256: u8 = 1;
/// 512 bytes.
pub const MTU_512: u8 = 2;
/// 1024 bytes: what a PORT_INFO without a valid `active_mtu` means.
pub const MTU_1024: u8 = 3;
/// 2048 bytes.
pub const MTU_2048: u8 = 4;
/// 4096 bytes.
pub const MTU_4096: u8 = 5;

/// Linux's `iboe_get_mtu()`: the IBTA MTU code for a RoCE network device's MTU, the
/// largest IB MTU that fits with the headers RoCE adds (GRH 40, UDP 8, BTH 12, XRC ext
/// 4, AtomicETH 28, ICRC 4: 96 bytes). `None` below 256 bytes.
pub fn iboe_mtu(netdev_mtu: u32) -> Option<u8> {
    let payload = netdev_mtu.checked_sub(96)?;
    [
        (4096, MTU_4096),
        (2048, MTU_2048),
        (1024, MTU_1024),
        (512, MTU_512),
        (256, MTU_256),
    ]
    .into_iter()
    .find(|(bytes, _)| payload >= *bytes)
    .map(|(_, code)| code)
}

/// The port as the device gives it to the guest (payload of [`MsgType::PortInfo`]).
///
/// Layout (little-endian): abi_version u32 @0, flags u32 @4 (bit 0: port up),
/// gid \[16\] @8, ca_guid u64 @24, lid u16 @32, pkey u16 @34, qpn_base u32 @36,
/// qpn_count u32 @40, max_entries u32 @44, name \[48\] @48 (UTF-8, NUL-padded), then the
/// appended fields: active_mtu u8 @96, ca_ack_delay u8 @97, more_gids u8 @98 (how many
/// further GIDs follow, at most [`PORT_INFO_MAX_MORE_GIDS`]), 13 reserved bytes (0),
/// and the further GIDs, 16 bytes each, from @112.
///
/// The appended fields are a compatible extension of ABI version 1: a device may send
/// the 96-byte record alone ([`PORT_INFO_MIN_LEN`]), and a driver that knows only that
/// record reads its first 96 bytes and ignores the rest. [`PortInfo::parse`] gives a
/// short record `active_mtu` 0 and `ca_ack_delay` 0 ("not given") and no further GIDs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// ABI version the device speaks.
    pub abi_version: u32,
    /// The port is up.
    pub port_up: bool,
    /// The VM's (primary) GID.
    pub gid: Gid,
    /// The VM's further GIDs (its other addresses the device serves), at most
    /// [`PORT_INFO_MAX_MORE_GIDS`]; empty for most VMs.
    pub more_gids: Vec<Gid>,
    /// The VM's CA GUID.
    pub ca_guid: u64,
    /// LID (0xFFFF on RoCE).
    pub lid: u16,
    /// P_Key.
    pub pkey: u16,
    /// First QPN the guest may use for its (simulated or real) QPs.
    pub qpn_base: u32,
    /// Number of QPNs from `qpn_base`.
    pub qpn_count: u32,
    /// Live connections the guest may hold at the device.
    pub max_entries: u32,
    /// VM name (at most 48 bytes).
    pub name: String,
    /// The port's active MTU as an IBTA code ([`MTU_256`]..[`MTU_4096`]); 0: not given
    /// (a 96-byte record), which a driver takes as [`MTU_1024`]. Linux's rdma_cm puts the
    /// link's MTU in the REQ's Path MTU.
    pub active_mtu: u8,
    /// The CA's local ACK delay (5-bit exponent, Linux `local_ca_ack_delay`): the
    /// REP's Target ACK Delay and an input of the REQ's Local ACK Timeout.
    pub ca_ack_delay: u8,
}

impl PortInfo {
    /// The active MTU code a driver should use: `active_mtu` if it is a valid code,
    /// else [`MTU_1024`].
    pub fn mtu_or_default(&self) -> u8 {
        if (MTU_256..=MTU_4096).contains(&self.active_mtu) {
            self.active_mtu
        } else {
            MTU_1024
        }
    }

    /// The payload length [`PortInfo::emit`] writes: [`PORT_INFO_LEN`] and 16 bytes per
    /// further GID.
    pub fn record_len(&self) -> usize {
        PORT_INFO_LEN + 16 * self.more_gids.len()
    }

    /// Every GID of the VM, the primary first.
    pub fn gids(&self) -> impl Iterator<Item = Gid> + '_ {
        core::iter::once(self.gid).chain(self.more_gids.iter().copied())
    }

    /// Parses a payload of at least [`PORT_INFO_MIN_LEN`] bytes (the appended fields are
    /// read when present). A count of further GIDs over [`PORT_INFO_MAX_MORE_GIDS`], or
    /// more than the payload holds, is an error.
    pub fn parse(b: &[u8]) -> Result<PortInfo> {
        check_len(b, PORT_INFO_MIN_LEN)?;
        let n = usize::from(b.get(98).copied().unwrap_or(0));
        if n > PORT_INFO_MAX_MORE_GIDS {
            return Err(Error::Reserved {
                field: "PORT_INFO more_gids",
                value: n as u32,
            });
        }
        if n > 0 {
            check_len(b, PORT_INFO_LEN + 16 * n)?;
        }
        let more_gids = (0..n)
            .map(|i| {
                let at = PORT_INFO_LEN + 16 * i;
                let mut g = [0u8; 16];
                g.copy_from_slice(&b[at..at + 16]);
                Gid(g)
            })
            .collect();
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let mut guid = [0u8; 8];
        guid.copy_from_slice(&b[24..32]);
        let name = &b[48..96];
        let end = name.iter().position(|c| *c == 0).unwrap_or(name.len());
        Ok(PortInfo {
            abi_version: le32(b, 0..4),
            port_up: le32(b, 4..8) & 1 != 0,
            gid: Gid(gid),
            more_gids,
            ca_guid: u64::from_le_bytes(guid),
            lid: le16(b, 32..34),
            pkey: le16(b, 34..36),
            qpn_base: le32(b, 36..40),
            qpn_count: le32(b, 40..44),
            max_entries: le32(b, 44..48),
            name: String::from_utf8_lossy(&name[..end]).into_owned(),
            active_mtu: b.get(96).copied().unwrap_or(0),
            ca_ack_delay: b.get(97).map_or(0, |d| d & 0x1F),
        })
    }

    /// Writes a payload of [`PortInfo::record_len`] bytes (the name is cut at 48 bytes,
    /// on a character boundary). More than [`PORT_INFO_MAX_MORE_GIDS`] further GIDs is
    /// an error.
    pub fn emit(&self, b: &mut [u8]) -> Result<()> {
        if self.more_gids.len() > PORT_INFO_MAX_MORE_GIDS {
            return Err(Error::TooLong {
                field: "PORT_INFO more_gids",
                len: self.more_gids.len(),
                max: PORT_INFO_MAX_MORE_GIDS,
            });
        }
        let len = self.record_len();
        check_len(b, len)?;
        let b = &mut b[..len];
        b.fill(0);
        b[0..4].copy_from_slice(&self.abi_version.to_le_bytes());
        b[4..8].copy_from_slice(&u32::from(self.port_up).to_le_bytes());
        b[8..24].copy_from_slice(&self.gid.0);
        b[24..32].copy_from_slice(&self.ca_guid.to_le_bytes());
        b[32..34].copy_from_slice(&self.lid.to_le_bytes());
        b[34..36].copy_from_slice(&self.pkey.to_le_bytes());
        b[36..40].copy_from_slice(&self.qpn_base.to_le_bytes());
        b[40..44].copy_from_slice(&self.qpn_count.to_le_bytes());
        b[44..48].copy_from_slice(&self.max_entries.to_le_bytes());
        let mut n = self.name.len().min(48);
        while !self.name.is_char_boundary(n) {
            n -= 1;
        }
        b[48..48 + n].copy_from_slice(&self.name.as_bytes()[..n]);
        b[96] = self.active_mtu;
        b[97] = self.ca_ack_delay & 0x1F;
        b[98] = self.more_gids.len() as u8;
        for (i, g) in self.more_gids.iter().enumerate() {
            b[PORT_INFO_LEN + 16 * i..PORT_INFO_LEN + 16 * (i + 1)].copy_from_slice(&g.0);
        }
        Ok(())
    }
}

/// The 8-byte config space: magic + ABI version.
pub fn config_space() -> [u8; CONFIG_LEN] {
    let mut c = [0u8; CONFIG_LEN];
    c[..4].copy_from_slice(&CONFIG_MAGIC.to_le_bytes());
    c[4..].copy_from_slice(&ABI_VERSION.to_le_bytes());
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iboe_mtu_is_linuxs() {
        assert_eq!(iboe_mtu(1500), Some(MTU_1024));
        assert_eq!(iboe_mtu(9000), Some(MTU_4096));
        assert_eq!(iboe_mtu(65536), Some(MTU_4096));
        assert_eq!(iboe_mtu(2144), Some(MTU_2048));
        assert_eq!(iboe_mtu(2143), Some(MTU_1024));
        assert_eq!(iboe_mtu(351), None);
        assert_eq!(iboe_mtu(0), None);
    }

    #[test]
    fn header_golden_and_round_trip() {
        let mut h = MsgHeader::mad("::ffff:127.0.2.1".parse().unwrap_or(Gid::ZERO));
        h.flow_label = 0xABCDE;
        h.sl = 3;
        let mut b = [0xEEu8; HEADER_LEN];
        h.emit(&mut b).unwrap();
        let mut want = [0u8; HEADER_LEN];
        want[0] = 1; // type MAD
        want[4] = 0x00; // len 256 = 0x100
        want[5] = 0x01;
        want[8] = 1; // QP1
        want[12..16].copy_from_slice(&[0x00, 0x00, 0x01, 0x80]); // 0x80010000 LE
        want[18] = 3;
        want[20] = 64;
        want[21] = 1;
        want[24..28].copy_from_slice(&[0xDE, 0xBC, 0x0A, 0x00]);
        want[42..48].copy_from_slice(&[0xFF, 0xFF, 127, 0, 2, 1]);
        assert_eq!(b, want);
        assert_eq!(MsgHeader::parse(&b).unwrap(), h);
    }

    #[test]
    fn bad_headers() {
        let mut b = [0u8; HEADER_LEN];
        assert!(matches!(MsgHeader::parse(&b), Err(Error::Reserved { .. })));
        b[0] = 1;
        b[4..8].copy_from_slice(&257u32.to_le_bytes());
        assert!(matches!(MsgHeader::parse(&b), Err(Error::TooLong { .. })));
        assert!(matches!(
            MsgHeader::parse(&b[..47]),
            Err(Error::Truncated { .. })
        ));
    }

    #[test]
    fn port_info_round_trip() {
        let p = PortInfo {
            abi_version: ABI_VERSION,
            port_up: true,
            gid: Gid::from_ipv4(std::net::Ipv4Addr::new(127, 0, 1, 1)),
            more_gids: Vec::new(),
            ca_guid: 0x0200_00ff_fe01_0101,
            lid: 0xFFFF,
            pkey: 0xFFFF,
            qpn_base: 0x10000,
            qpn_count: 0x10000,
            max_entries: 65536,
            name: "vm-é".repeat(20),
            active_mtu: MTU_4096,
            ca_ack_delay: 15,
        };
        let mut b = [0u8; PORT_INFO_LEN];
        p.emit(&mut b).unwrap();
        let q = PortInfo::parse(&b).unwrap();
        assert!(q.name.len() <= 48 && p.name.starts_with(&q.name));
        assert_eq!(
            PortInfo {
                name: p.name.clone(),
                ..q.clone()
            },
            p
        );
        assert_eq!(b[96..98], [5, 15]);
        assert!(b[98..].iter().all(|x| *x == 0));
        assert_eq!(q.mtu_or_default(), MTU_4096);
        // A 96-byte record (a device from before the appended fields) still parses: the
        // link fields read as "not given".
        let old = PortInfo::parse(&b[..PORT_INFO_MIN_LEN]).unwrap();
        assert_eq!((old.active_mtu, old.ca_ack_delay), (0, 0));
        assert_eq!(old.mtu_or_default(), MTU_1024);
        assert_eq!(old.gid, p.gid);
        assert!(PortInfo::parse(&b[..PORT_INFO_MIN_LEN - 1]).is_err());
        let mut e = [0u8; EVENT_LEN];
        Event::DeviceReset.emit(&mut e).unwrap();
        assert_eq!(Event::parse(&e).unwrap(), Event::DeviceReset);
        assert_eq!(&config_space()[..4], b"PVCM");
    }

    #[test]
    fn port_info_carries_further_gids_compatibly() {
        let g = |s: &str| -> Gid { s.parse().unwrap_or(Gid::ZERO) };
        let mut p = PortInfo {
            abi_version: ABI_VERSION,
            port_up: true,
            gid: g("::ffff:10.0.0.5"),
            more_gids: vec![g("2001:db8::5"), g("::ffff:10.0.1.5")],
            ca_guid: 7,
            lid: 0xFFFF,
            pkey: 0xFFFF,
            qpn_base: 0x10000,
            qpn_count: 0x10000,
            max_entries: 100,
            name: "dual".into(),
            active_mtu: MTU_1024,
            ca_ack_delay: 15,
        };
        assert_eq!(p.record_len(), PORT_INFO_LEN + 32);
        let mut b = [0u8; PORT_INFO_MAX_LEN];
        p.emit(&mut b).unwrap();
        assert_eq!(b[98], 2);
        assert_eq!(&b[112..128], &g("2001:db8::5").0);
        let q = PortInfo::parse(&b[..p.record_len()]).unwrap();
        assert_eq!(q, p);
        assert_eq!(q.gids().count(), 3);
        // A driver that knows only the 96- or 112-byte record reads the same primary
        // fields from the new one: the GIDs are past what it reads.
        let mut one = p.clone();
        one.more_gids.clear();
        let mut o = [0u8; PORT_INFO_LEN];
        one.emit(&mut o).unwrap();
        assert_eq!(b[..98], o[..98]);
        assert_eq!(PortInfo::parse(&b[..98]).unwrap(), one);
        // A new driver reading an old device's record: no further GIDs.
        assert_eq!(PortInfo::parse(&o).unwrap().more_gids, vec![]);
        assert_eq!(
            PortInfo::parse(&o[..PORT_INFO_MIN_LEN]).unwrap().more_gids,
            vec![]
        );
        // A count the payload does not hold, or over the most: errors, never a panic.
        assert!(matches!(
            PortInfo::parse(&b[..PORT_INFO_LEN + 16]),
            Err(Error::Truncated { .. })
        ));
        b[98] = PORT_INFO_MAX_MORE_GIDS as u8 + 1;
        assert!(matches!(PortInfo::parse(&b), Err(Error::Reserved { .. })));
        // The most fit one rx buffer exactly; one more does not encode.
        p.more_gids = (0..PORT_INFO_MAX_MORE_GIDS as u8)
            .map(|i| Gid::from_ipv4(std::net::Ipv4Addr::new(10, 9, 0, i)))
            .collect();
        assert_eq!(p.record_len(), MAX_PAYLOAD);
        p.emit(&mut b).unwrap();
        assert_eq!(PortInfo::parse(&b).unwrap(), p);
        p.more_gids
            .push(Gid::from_ipv4(std::net::Ipv4Addr::new(10, 9, 1, 1)));
        assert!(matches!(p.emit(&mut b), Err(Error::TooLong { .. })));
    }
}

//! The checks every received RoCEv2 CM frame passes, whichever port read it: one
//! 280-byte frame, a UD SEND only to QP1 with the default P_Key, the GSI DETH, and the
//! ICRC ([`check_frame`] for a UDP payload, [`check_datagram`] for a whole IPv4
//! datagram; the packet port checks its Ethernet and IP layers and then these).

use std::net::{IpAddr, SocketAddr, SocketAddrV4};

use pvcm_wire::mad::MAD_LEN;
use pvcm_wire::roce::{
    self, BthRepr, DethRepr, FRAME_LEN, Frame, GSI_QKEY, GSI_QPN, IpRepr, UdpRepr,
};
use pvcm_wire::{Error as WireError, Gid};

use crate::port::InMad;
use crate::stats::DevDrop;

/// A received frame that passed every check: its MAD and addressing.
#[derive(Debug, Clone)]
pub struct InFrame {
    /// Sender's GID (its source address; IPv4-mapped for IPv4).
    pub src: Gid,
    /// Sender's address.
    pub src_addr: SocketAddr,
    /// The GID it was addressed to (its destination address).
    pub dst: Gid,
    /// The DETH's source QP and Q_Key, for the rx header.
    pub src_qp: u32,
    /// Q_Key.
    pub qkey: u32,
    /// P_Key.
    pub pkey: u16,
    /// The MAD.
    pub mad: [u8; MAD_LEN],
}

/// The checks every frame gets before its ICRC: exactly one 280-byte frame, a UD SEND
/// only to QP1 with the default P_Key, and the GSI DETH.
pub(crate) fn check_headers(dgram: &[u8]) -> Result<(Frame<&[u8]>, BthRepr, DethRepr), DevDrop> {
    let frame = Frame::new_checked(dgram).map_err(|e| match e {
        WireError::BthOpcode(_) | WireError::BthVersion(_) => DevDrop::WireBadBth,
        _ => DevDrop::WireBadLength,
    })?;
    let bth = BthRepr::parse(&frame.bth()).map_err(|_| DevDrop::WireBadBth)?;
    if bth.dest_qp != GSI_QPN || bth.pkey & 0x7FFF != 0x7FFF {
        return Err(DevDrop::WireBadBth);
    }
    let deth = DethRepr::parse(&frame.deth()).map_err(|_| DevDrop::WireBadDeth)?;
    if deth.qkey != GSI_QKEY || deth.src_qp != GSI_QPN {
        return Err(DevDrop::WireBadDeth);
    }
    Ok((frame, bth, deth))
}

/// The checked frame `frame` from `src` to `dst` with its BTH and DETH, as the port
/// hands it on.
pub(crate) fn in_frame(
    src: SocketAddr,
    dst: IpAddr,
    frame: &Frame<&[u8]>,
    bth: &BthRepr,
    deth: &DethRepr,
) -> InFrame {
    let mut mad = [0u8; MAD_LEN];
    mad.copy_from_slice(frame.mad());
    InFrame {
        src: IpRepr::gid(src.ip()),
        src_addr: src,
        dst: IpRepr::gid(dst),
        src_qp: deth.src_qp,
        qkey: deth.qkey,
        pkey: bth.pkey,
        mad,
    }
}

/// Checks one UDP payload received on `local` from `src` (a UDP socket): the header
/// checks of `check_headers`, then the ICRC under the header rebuilt from the
/// addresses. Over IPv4 that header is the one a pvcm sender's kernel writes
/// (identification 0, DF; see `pvcm_wire::roce`), since a UDP socket does not see the
/// real one; over IPv6 it is exact (the ICRC covers nothing else).
pub fn check_frame(local: SocketAddr, src: SocketAddr, dgram: &[u8]) -> Result<InFrame, DevDrop> {
    let (frame, bth, deth) = check_headers(dgram)?;
    let ip = IpRepr::from_addrs(src.ip(), local.ip()).ok_or(DevDrop::WireBadSource)?;
    let udp = UdpRepr {
        src_port: src.port(),
        dst_port: local.port(),
        length: (roce::UDP_HEADER_LEN + FRAME_LEN) as u16,
    };
    frame
        .check_icrc(&ip, &udp)
        .map_err(|_| DevDrop::WireBadIcrc)?;
    Ok(in_frame(src, local.ip(), &frame, &bth, &deth))
}

/// Checks one whole IPv4 datagram from the raw socket (raw mode): a valid IPv4 header
/// without options or fragments, a UDP header whose length matches, the header checks
/// of `check_headers`, and the ICRC over the IPv4 and UDP headers exactly as
/// received. Returns the destination address with the frame.
pub fn check_datagram(dgram: &[u8]) -> Result<(SocketAddr, InFrame), DevDrop> {
    let (ip, udp, _) = roce::parse_datagram(dgram).map_err(|e| match e {
        WireError::BthOpcode(_) | WireError::BthVersion(_) => DevDrop::WireBadBth,
        WireError::Unsupported(_) | WireError::Ipv4Checksum { .. } => DevDrop::WireBadIp,
        _ => DevDrop::WireBadLength,
    })?;
    let total = usize::from(ip.total_len);
    if total != dgram.len() || usize::from(udp.length) != roce::UDP_HEADER_LEN + FRAME_LEN {
        // Trailing bytes, or a frame padded inside the UDP payload.
        return Err(DevDrop::WireBadLength);
    }
    let payload = &dgram[roce::IPV4_HEADER_LEN + roce::UDP_HEADER_LEN..];
    let (frame, bth, deth) = check_headers(payload)?;
    roce::check_datagram_icrc(dgram).map_err(|_| DevDrop::WireBadIcrc)?;
    let src = SocketAddr::V4(SocketAddrV4::new(ip.src, udp.src_port));
    let dst = SocketAddr::V4(SocketAddrV4::new(ip.dst, udp.dst_port));
    Ok((dst, in_frame(src, dst.ip(), &frame, &bth, &deth)))
}

impl From<InFrame> for InMad {
    fn from(f: InFrame) -> InMad {
        InMad {
            src: f.src,
            dst: f.dst,
            src_qp: f.src_qp,
            qkey: f.qkey,
            pkey: f.pkey,
            mad: f.mad,
        }
    }
}

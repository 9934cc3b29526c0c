//! The packet port: the host side of QP1 for VMs that have their own NIC.
//!
//! On the hardware pvcm models (ConnectX-3 with SR-IOV) a VM has its own function for
//! data: its QPs and their traffic use the VM's own GID, while QP1 (CM) traffic for that
//! GID is taken by the PF, which proxies it. This port is that split for VMs whose GID
//! is the address of their own (virtual) NIC: a filter outside pvcm (in tests, tc on the
//! VM's tap: `qemu-scripts/qp1-divert.sh add TAP DEV`) redirects every RoCEv2 frame to
//! QP1 addressed to a VM onto a network device DEV (a dummy, `pvcm-qp1` in tests); the
//! frames to other QPs still reach the VM. `--port packet:DEV[:IFACE]`.
//!
//! - **Receive**: one `AF_PACKET` socket on DEV (every protocol, the Ethernet header
//!   included) and no kernel filter: every frame on DEV is read, so whatever the divert
//!   could not have produced for a configured VM is counted with its reason, not
//!   dropped unseen by the kernel. Reads are batched (`recvmmsg`). Each frame received
//!   is checked as the soft port's raw mode checks a datagram (IPv4 or IPv6, UDP to the
//!   RoCEv2 port (`--bind-port`, 4791), headers, lengths, the ICRC over the IP header as
//!   received: [`check_ether_frame`], then [`super::frame`]'s checks: BTH destination
//!   QP 1, the GSI's DETH) and routed to the VM owning its destination address (any of
//!   a VM's addresses: a VM has one per GID).
//! - **Send**: the frames are built here (pvcm_wire, the ICRC over exactly the header
//!   sent) with the VM's address for the destination as source (its GID of the
//!   destination's family, `VmConfig::source_for`), and go through the host's IP
//!   stack, which
//!   picks the route and resolves the next hop: a raw IPv4 socket (`IPPROTO_RAW`, the
//!   header included) and a raw IPv6 socket (`IPPROTO_RAW`, header included). Linux
//!   keeps the header of such a send but for the IPv4 total length (which pvcm sets to
//!   the same value), the IPv4 header checksum (masked by the ICRC) and an IPv4
//!   identification of 0, which it replaces with its own: so pvcm writes a non-zero ID
//!   of its own choosing (a counter). IFACE is the interface link-local IPv6
//!   destinations are reached through (their scope); without it a link-local
//!   destination is `bad_remote_gid`.
//! - **A VM's own frames**: the divert also stops what a VM sends to QP1 itself (root
//!   in the VM can load the kernel CM) and forwards it to DEV, where it is transmitted:
//!   a frame the socket sees as outgoing is never routed, only counted on the VM whose
//!   address is its source ([`check_egress_frame`]: `vm_qp1_egress`,
//!   `vm_egress_unclassified`), or on the host's counters when no VM's address is its
//!   source (`wire_egress_unknown_source`).
//! - **Migration**: there is nothing to bind (the addresses belong to the VMs' NICs):
//!   claim and release are accepted as they are.
//! - **Privileges**: `CAP_NET_RAW` for the packet and raw sockets; without it the port
//!   does not open and says so.
//!
//! Bad input is a counted drop, never a panic. On the VM's counters when the frame's
//! destination is a VM's address, else on the host's: a frame for an address no VM
//! owns (`wire_unknown_gid`), a bad ICRC, truncated Ethernet, IPv4, IPv6 or UDP headers
//! (`wire_truncated`), IPv4 options, fragments or a bad header checksum (`wire_bad_ip`),
//! an IPv6 extension header (`wire_ipv6_ext_header`), a frame that is not RoCEv2 at all
//! (`wire_not_roce`), a source that cannot be a RoCE peer (`wire_bad_source`:
//! multicast, broadcast, unspecified, loopback, an IPv4-mapped or IPv4-compatible
//! address in an IPv6 header), the BTH and DETH checks of the soft port (`wire_bad_bth`,
//! `wire_bad_deth`: a DETH source QP other than 1). What the kernel drops before pvcm
//! reads it (the socket's queue full, `PACKET_STATISTICS`) is `wire_rx_overflow` on the
//! host's counters.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock};

use pvcm_wire::Gid;
use pvcm_wire::mad::MAD_LEN;
use pvcm_wire::roce::{
    self, FrameRepr, IP_PROTOCOL_UDP, IPV4_HEADER_LEN, IPV6_DATAGRAM_LEN, IPV6_HEADER_LEN, IpRepr,
    Ipv4Repr, Ipv6Repr, UDP_HEADER_LEN, UdpRepr,
};

use super::frame::{self, InFrame};
use super::sys::{self, RecvBatch, cvt, setsockopt_int, socket};
use crate::port::Error;
use crate::port::{Arrivals, InMad, OutMad, PortCtx, PortError, WirePort};
use crate::stats::{DevDrop, Io};

/// Length of an Ethernet header (no VLAN tag: the kernel hands tags to packet sockets
/// out of band).
pub const ETH_HLEN: usize = 14;
/// EtherType of IPv4.
pub const ETH_P_IP: u16 = 0x0800;
/// EtherType of IPv6.
pub const ETH_P_IPV6: u16 = 0x86DD;
/// Every protocol (linux/if_ether.h).
const ETH_P_ALL: u16 = 0x0003;
/// `SOL_PACKET` (linux/socket.h).
const SOL_PACKET: libc::c_int = 263;
/// `PACKET_STATISTICS` (linux/if_packet.h): `struct tpacket_stats`, reset on read.
const PACKET_STATISTICS: libc::c_int = 6;
/// `ARPHRD_ETHER` (linux/if_arp.h).
const ARPHRD_ETHER: u32 = 1;
/// Batches taken per readiness event before the host loop looks at its other
/// descriptors.
const RX_ROUNDS: usize = 16;

/// `struct tpacket_stats`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct TpacketStats {
    tp_packets: u32,
    tp_drops: u32,
}

/// IPv6 next-header values that are extension headers (RFC 8200 and the IANA list):
/// hop-by-hop, routing, fragment, ESP, AH, destination options, mobility, HIP, shim6,
/// and the two experimental ones.
const IPV6_EXT_HEADERS: [u8; 11] = [0, 43, 44, 50, 51, 60, 135, 139, 140, 253, 254];

/// Why an IPv4 source cannot be a RoCE peer on a wire.
fn bad_source_v4(a: Ipv4Addr) -> bool {
    a.is_unspecified()
        || a.is_broadcast()
        || a.is_multicast()
        || a.is_loopback()
        || a.octets()[0] == 0
}

/// Why an IPv6 source cannot be a RoCE peer on a wire: unspecified, loopback,
/// multicast, or an IPv4 address dressed as IPv6 (IPv4-mapped `::ffff:a.b.c.d` or
/// IPv4-compatible `::a.b.c.d`): RoCEv2 carries those GIDs in IPv4 headers.
fn bad_source_v6(a: Ipv6Addr) -> bool {
    a.is_unspecified()
        || a.is_loopback()
        || a.is_multicast()
        || a.to_ipv4_mapped().is_some()
        || a.octets()[..12] == [0; 12]
}

/// A frame's destination address, as far as its headers can be read (for whose
/// counters a drop lands on).
pub fn frame_destination(frame: &[u8]) -> Option<IpAddr> {
    frame_address(frame, 16, 24)
}

/// A frame's IP source address, as far as its headers can be read.
fn frame_source(frame: &[u8]) -> Option<IpAddr> {
    frame_address(frame, 12, 8)
}

/// The address `v4` bytes into the frame's IPv4 header, or `v6` into its IPv6 header.
fn frame_address(frame: &[u8], v4: usize, v6: usize) -> Option<IpAddr> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = frame.get(ETH_HLEN..)?;
    match ethertype {
        ETH_P_IP => {
            let a: [u8; 4] = ip.get(v4..v4 + 4)?.try_into().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(a)))
        }
        ETH_P_IPV6 => {
            let a: [u8; 16] = ip.get(v6..v6 + 16)?.try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(a)))
        }
        _ => None,
    }
}

/// Checks one Ethernet frame read from DEV and returns its destination address and the
/// checked frame: an IPv4 (no options, no fragment, a good header checksum) or IPv6
/// (next header UDP) datagram, within the frame (Ethernet padding after it is
/// ignored), a UDP header to `port` whose length is the datagram's, one CM frame (the
/// BTH and DETH checks of [`super::frame`]), a source that can be a RoCE peer, and the
/// ICRC over the IP and UDP headers exactly as received. A drop gives its reason and the
/// destination address when the headers showed it.
pub fn check_ether_frame(
    frame: &[u8],
    port: u16,
) -> Result<(IpAddr, InFrame), (Option<IpAddr>, DevDrop)> {
    if frame.len() < ETH_HLEN {
        return Err((None, DevDrop::WireTruncated));
    }
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[ETH_HLEN..];
    let (dgram, hl, src, dst) = match ethertype {
        ETH_P_IP => {
            if ip.len() < IPV4_HEADER_LEN {
                return Err((None, DevDrop::WireTruncated));
            }
            if ip[0] >> 4 != 4 {
                return Err((None, DevDrop::WireBadIp));
            }
            let f = roce::field::ipv4::DST;
            let dst = IpAddr::V4(Ipv4Addr::from(f.get(ip) as u32));
            let fail = |r: DevDrop| (Some(dst), r);
            if roce::field::ipv4::PROTOCOL.get(ip) != u64::from(IP_PROTOCOL_UDP) {
                return Err(fail(DevDrop::WireNotRoce));
            }
            let h = Ipv4Repr::parse(ip).map_err(|_| fail(DevDrop::WireBadIp))?;
            let total = usize::from(h.total_len);
            if total < IPV4_HEADER_LEN {
                return Err(fail(DevDrop::WireBadIp));
            }
            if total > ip.len() {
                return Err(fail(DevDrop::WireTruncated));
            }
            if bad_source_v4(h.src) {
                return Err(fail(DevDrop::WireBadSource));
            }
            (&ip[..total], IPV4_HEADER_LEN, IpAddr::V4(h.src), dst)
        }
        ETH_P_IPV6 => {
            if ip.len() < IPV6_HEADER_LEN {
                return Err((None, DevDrop::WireTruncated));
            }
            if ip[0] >> 4 != 6 {
                return Err((None, DevDrop::WireBadIp));
            }
            let h = Ipv6Repr::parse(ip).map_err(|_| (None, DevDrop::WireBadIp))?;
            let dst = IpAddr::V6(h.dst);
            let fail = |r: DevDrop| (Some(dst), r);
            if h.next_header != IP_PROTOCOL_UDP {
                return Err(fail(if IPV6_EXT_HEADERS.contains(&h.next_header) {
                    DevDrop::WireIpv6ExtHeader
                } else {
                    DevDrop::WireNotRoce
                }));
            }
            let total = IPV6_HEADER_LEN + usize::from(h.payload_len);
            if total > ip.len() {
                return Err(fail(DevDrop::WireTruncated));
            }
            if bad_source_v6(h.src) {
                return Err(fail(DevDrop::WireBadSource));
            }
            (&ip[..total], IPV6_HEADER_LEN, IpAddr::V6(h.src), dst)
        }
        _ => return Err((None, DevDrop::WireNotRoce)),
    };
    let fail = |r: DevDrop| (Some(dst), r);
    let udp_bytes = &dgram[hl..];
    let udp = UdpRepr::parse(udp_bytes).map_err(|e| {
        fail(match e {
            pvcm_wire::Error::Truncated { .. } => DevDrop::WireTruncated,
            _ => DevDrop::WireBadLength,
        })
    })?;
    if udp.dst_port != port {
        return Err(fail(DevDrop::WireNotRoce));
    }
    if usize::from(udp.length) != udp_bytes.len() {
        return Err(fail(if usize::from(udp.length) > udp_bytes.len() {
            DevDrop::WireTruncated
        } else {
            DevDrop::WireBadLength
        }));
    }
    let payload = &udp_bytes[UDP_HEADER_LEN..];
    let (f, bth, deth) = frame::check_headers(payload).map_err(fail)?;
    roce::check_datagram_icrc(dgram).map_err(|_| fail(DevDrop::WireBadIcrc))?;
    let from = SocketAddr::new(src, udp.src_port);
    Ok((dst, frame::in_frame(from, dst, &f, &bth, &deth)))
}

/// `PACKET_OUTGOING` (linux/if_packet.h): a frame transmitted on the device.
pub const PACKET_OUTGOING: u8 = 4;

/// A frame transmitted on DEV: what a VM's tap divert forwards there from the VM
/// (`qp1-divert.sh`'s nftables table), never a frame for a VM. Its IP source (the VM
/// it came from, when its headers show one) and its reason: `vm_qp1_egress` when its
/// UDP header is to `port` and its BTH to QP 1 (IPv4 with or without options, IPv6
/// after hop-by-hop, routing, destination options, AH and first-fragment headers),
/// else `vm_egress_unclassified`.
pub fn check_egress_frame(frame: &[u8], port: u16) -> (Option<IpAddr>, DevDrop) {
    let src = frame_source(frame);
    let qp1 = egress_udp(frame).is_some_and(|udp| {
        udp.get(2..4) == Some(&port.to_be_bytes()[..])
            && udp
                .get(UDP_HEADER_LEN + 5..UDP_HEADER_LEN + 8)
                .is_some_and(|qp| qp == [0, 0, 1])
    });
    let reason = if qp1 {
        DevDrop::VmQp1Egress
    } else {
        DevDrop::VmEgressUnclassified
    };
    (src, reason)
}

/// The UDP header and what follows it in an IPv4 or IPv6 frame that is not a fragment
/// after the first: past IPv4 options, and past the IPv6 extension headers a receiver
/// walks (at most 8 of them).
fn egress_udp(frame: &[u8]) -> Option<&[u8]> {
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    let ip = frame.get(ETH_HLEN..)?;
    match ethertype {
        ETH_P_IP => {
            let ihl = usize::from(ip.first()? & 0x0f) * 4;
            let frag = u16::from_be_bytes([*ip.get(6)?, *ip.get(7)?]) & 0x1FFF;
            (*ip.get(9)? == IP_PROTOCOL_UDP && frag == 0 && ihl >= IPV4_HEADER_LEN)
                .then(|| ip.get(ihl..))?
        }
        ETH_P_IPV6 => {
            let mut next = *ip.get(6)?;
            let mut at = IPV6_HEADER_LEN;
            for _ in 0..8 {
                let len = match next {
                    IP_PROTOCOL_UDP => return ip.get(at..),
                    // Hop-by-hop, routing, destination options: 8-byte units after 8.
                    0 | 43 | 60 => (usize::from(*ip.get(at + 1)?) + 1) * 8,
                    // Fragment: the first only (offset 0).
                    44 => {
                        let off = u16::from_be_bytes([*ip.get(at + 2)?, *ip.get(at + 3)?]);
                        if off & 0xFFF8 != 0 {
                            return None;
                        }
                        8
                    }
                    // AH: 4-byte units after 8.
                    51 => (usize::from(*ip.get(at + 1)?) + 2) * 4,
                    _ => return None,
                };
                next = *ip.get(at)?;
                at += len;
            }
            None
        }
        _ => None,
    }
}

/// Warns when DEV's own IP stack talks on it: with IPv6 on, the host sends router
/// solicitations and MLD reports there, which the port reads like any frame on DEV and
/// counts as dropped (`wire_egress_unknown_source`, and `wire_not_roce` for what comes
/// back). `qp1-divert.sh` turns it off when it makes DEV.
fn warn_noisy(name: &str, dev: &str) {
    let path = format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6");
    if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == "0") {
        tracing::warn!(port = %name, "{dev} has IPv6 on: the host's own IPv6 frames on it are read and counted as drops (`sysctl -w net.ipv6.conf.{dev}.disable_ipv6=1`)");
    }
}

/// The packet port (see the module docs).
#[derive(Debug)]
pub struct PacketPort {
    name: String,
    rx: OwnedFd,
    tx4: OwnedFd,
    tx6: OwnedFd,
    /// The scope of link-local destinations (IFACE's index), 0 without IFACE.
    scope: u32,
    port_num: u16,
    table: RwLock<VmTable>,
    ident: AtomicU16,
    /// The packet socket's receive buffer.
    buffer: crate::stats::RxBuffer,
}

/// The port's VMs by index (`None`: removed at runtime) with their addresses, by
/// address (every address of every VM), and each one's next PSN.
#[derive(Debug, Default)]
struct VmTable {
    vms: Vec<Option<(String, Vec<IpAddr>)>>,
    by_addr: HashMap<IpAddr, usize>,
    psn: Vec<AtomicU32>,
}

impl PacketPort {
    /// Opens the port on `dev` (`iface`: the interface of link-local destinations) for
    /// these VMs (name, addresses), with the RoCEv2 UDP port `port_num`.
    pub fn open(
        dev: &str,
        iface: Option<&str>,
        vms: &[(String, Vec<IpAddr>)],
        port_num: u16,
    ) -> Result<PacketPort, Error> {
        let name = match iface {
            Some(i) => format!("packet:{dev}:{i}"),
            None => format!("packet:{dev}"),
        };
        let fail = |reason: String| Error::Packet {
            port: name.clone(),
            reason,
        };
        let privilege = |what: &str, e: io::Error| {
            let hint = if e.kind() == io::ErrorKind::PermissionDenied {
                ": the packet port needs CAP_NET_RAW: run as root, or grant it with \
                 `setcap cap_net_raw+ep pvcm-backend` (or AmbientCapabilities=CAP_NET_RAW \
                 in a systemd unit)"
            } else {
                ""
            };
            fail(format!("{what}: {e}{hint}"))
        };
        let ifindex = sys::if_index(dev).map_err(|e| {
            fail(format!(
                "{e}: DEV is the device the VMs' QP1 frames are diverted to (e.g. `ip link \
                 add pvcm-qp1 type dummy && ip link set pvcm-qp1 up`, then \
                 qemu-scripts/qp1-divert.sh add TAP pvcm-qp1; see docs/packet-port.md)"
            ))
        })?;
        let sys = std::path::Path::new("/sys/class/net").join(dev);
        if let Ok(t) = std::fs::read_to_string(sys.join("type"))
            && t.trim().parse::<u32>().ok() != Some(ARPHRD_ETHER)
        {
            return Err(fail(format!(
                "{dev} is not an Ethernet device (link type {}): the port reads Ethernet \
                 frames",
                t.trim()
            )));
        }
        if let Ok(f) = std::fs::read_to_string(sys.join("flags"))
            && let Ok(flags) = u32::from_str_radix(f.trim().trim_start_matches("0x"), 16)
            && flags & 1 == 0
        {
            tracing::warn!(port = %name, "{dev} is down: nothing diverted to it arrives (`ip link set {dev} up`)");
        }
        let scope = match iface {
            Some(i) => sys::if_index(i).map_err(|e| fail(format!("IFACE: {e}")))?,
            None => 0,
        };
        // Unfiltered: everything on DEV is read and counted (only the divert should put
        // frames there). Bound to no protocol until the buffer is set; the bind below
        // starts the queue.
        let rx = socket(libc::AF_PACKET, libc::SOCK_RAW, 0)
            .map_err(|e| privilege("packet socket", e))?;
        warn_noisy(&name, dev);
        // A large buffer absorbs bursts, sized as the soft port's raw socket for the
        // same reasons; a smaller one is reported (stat, metrics).
        let buffer = sys::set_rx_buffer(rx.as_raw_fd(), "packet socket");
        // SAFETY: sockaddr_ll is plain old data for which all-zero is valid.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ALL.to_be();
        sll.sll_ifindex = ifindex as libc::c_int;
        // SAFETY: `sll` is a valid sockaddr_ll and its size is passed.
        cvt(unsafe {
            libc::bind(
                rx.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        })
        .map_err(|e| fail(format!("binding the packet socket to {dev}: {e}")))?;
        let tx4 = socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW)
            .map_err(|e| privilege("raw IPv4 socket", e))?;
        let tx6 = socket(libc::AF_INET6, libc::SOCK_RAW, libc::IPPROTO_RAW)
            .map_err(|e| privilege("raw IPv6 socket", e))?;
        let _ = setsockopt_int(tx4.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
        let _ = setsockopt_int(tx6.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, 4 << 20);
        let table = VmTable {
            vms: vms.iter().cloned().map(Some).collect(),
            by_addr: vms
                .iter()
                .enumerate()
                .flat_map(|(i, (_, addrs))| addrs.iter().map(move |a| (*a, i)))
                .collect(),
            psn: vms.iter().map(|_| AtomicU32::new(0)).collect(),
        };
        let seed = pvcm_wire::seed::os_seed();
        let p = PacketPort {
            name,
            rx,
            tx4,
            tx6,
            scope,
            port_num,
            table: RwLock::new(table),
            ident: AtomicU16::new(seed as u16),
            buffer,
        };
        // Whatever queued before the bind is not ours to count.
        p.stats();
        tracing::info!(port = %p.name, vms = vms.len(), "packet port open");
        Ok(p)
    }

    /// The next IPv4 identification: a counter, never 0 (which Linux would replace).
    fn next_ident(&self) -> u16 {
        loop {
            let id = self.ident.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
            if id != 0 {
                return id;
            }
        }
    }

    /// The datagram VM `vm` sends `mad` from its address `own` to `dst` in, and where to
    /// send it; `None` when `own` is not the VM's, or the GID is not reachable from it
    /// (the other family, or link-local without IFACE).
    pub fn datagram(
        &self,
        vm: usize,
        own: IpAddr,
        dst: Gid,
        mad: &[u8; MAD_LEN],
        buf: &mut [u8; IPV6_DATAGRAM_LEN],
    ) -> Option<(usize, SocketAddr)> {
        let psn = {
            let t = self.table();
            let (_, addrs) = t.vms.get(vm)?.as_ref()?;
            if !addrs.contains(&own) {
                return None;
            }
            t.psn.get(vm)?.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF
        };
        let udp = UdpRepr {
            dst_port: self.port_num,
            ..UdpRepr::new(self.port_num)
        };
        let (ip, to) = match (own, dst.to_ipv4()) {
            (IpAddr::V4(s), Some(d)) => (
                IpRepr::V4(Ipv4Repr {
                    identification: self.next_ident(),
                    ..Ipv4Repr::new(s, d)
                }),
                SocketAddr::new(IpAddr::V4(d), 0),
            ),
            (IpAddr::V6(s), None) => {
                let d: Ipv6Addr = dst.into();
                let scope = if dst.is_link_local() {
                    (self.scope != 0).then_some(self.scope)?
                } else {
                    0
                };
                (
                    IpRepr::V6(Ipv6Repr::new(s, d)),
                    SocketAddr::V6(SocketAddrV6::new(d, 0, 0, scope)),
                )
            }
            _ => return None,
        };
        let n = FrameRepr::gsi(psn, mad)
            .emit_datagram(&mut buf[..], &ip, &udp)
            .ok()?;
        Some((n, to))
    }

    fn send_one(&self, datagram: &[u8], to: &SocketAddr) -> io::Result<()> {
        let fd = match to {
            SocketAddr::V4(_) => self.tx4.as_raw_fd(),
            SocketAddr::V6(_) => self.tx6.as_raw_fd(),
        };
        let (sa, len) = sys::sockaddr_of(to);
        let mut stalls = 0;
        loop {
            // SAFETY: the datagram and the address are live for the call.
            let r = unsafe {
                libc::sendto(
                    fd,
                    datagram.as_ptr().cast(),
                    datagram.len(),
                    0,
                    (&sa as *const libc::sockaddr_storage).cast(),
                    len,
                )
            };
            if r >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock if stalls < 100 => {
                    stalls += 1;
                    std::thread::yield_now();
                }
                _ => return Err(e),
            }
        }
    }

    /// The kernel's drops on the packet socket since the last call (the counters reset
    /// on read).
    fn stats(&self) -> u32 {
        let mut st = TpacketStats::default();
        let mut len = std::mem::size_of::<TpacketStats>() as libc::socklen_t;
        // SAFETY: `st` is a live tpacket_stats and `len` its size.
        let r = unsafe {
            libc::getsockopt(
                self.rx.as_raw_fd(),
                SOL_PACKET,
                PACKET_STATISTICS,
                (&mut st as *mut TpacketStats).cast(),
                &mut len,
            )
        };
        if r < 0 { 0 } else { st.tp_drops }
    }

    /// Sets the packet socket's receive buffer (tests: a small one overflows).
    #[cfg(test)]
    fn set_rcvbuf(&self, bytes: libc::c_int) {
        setsockopt_int(
            self.rx.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            bytes,
        )
        .expect("SO_RCVBUF");
    }

    /// The VM owning `dst`, if any.
    fn vm_of(&self, dst: &IpAddr) -> Option<usize> {
        self.table().by_addr.get(dst).copied()
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, VmTable> {
        self.table.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn table_mut(&self) -> std::sync::RwLockWriteGuard<'_, VmTable> {
        self.table.write().unwrap_or_else(PoisonError::into_inner)
    }
}

impl WirePort for PacketPort {
    fn rx_mode(&self) -> String {
        format!("packet {}", self.name.trim_start_matches("packet:"))
    }

    fn rx_buffer(&self) -> Option<crate::stats::RxBuffer> {
        Some(self.buffer)
    }

    fn degraded(&self) -> Vec<crate::stats::Degraded> {
        sys::buffer_degraded(&self.buffer).into_iter().collect()
    }

    fn poll_fds(&self) -> Vec<(RawFd, u64)> {
        vec![(self.rx.as_raw_fd(), 0)]
    }

    fn attach(&self, _vm: usize) -> Result<(), PortError> {
        Ok(())
    }

    fn claim(&self, _vm: usize) -> Result<bool, PortError> {
        // The address is the VM's NIC's: nothing to bind here.
        Ok(false)
    }

    fn release(&self, _vm: usize) {}

    fn changes_vms(&self) -> bool {
        true
    }

    /// A VM added at runtime: its addresses join the table (nothing to bind: the
    /// addresses are the VM's NIC's).
    fn add_vm(
        &self,
        vm: usize,
        spec: &crate::config::VmSpec,
        _poll: &mut dyn FnMut(RawFd, u64) -> io::Result<()>,
    ) -> Result<(), PortError> {
        let addrs: Vec<IpAddr> = spec.addrs().map(|(a, _)| a).collect();
        {
            let mut t = self.table_mut();
            if let Some(a) = addrs.iter().find(|a| t.by_addr.contains_key(a)) {
                return Err(PortError::Bind(Error::WireBind {
                    vm: spec.vm.name.clone(),
                    addr: *a,
                    port: self.port_num,
                    source: io::Error::from(io::ErrorKind::AddrInUse),
                }));
            }
            while t.vms.len() <= vm {
                t.vms.push(None);
                t.psn.push(AtomicU32::new(0));
            }
            for a in &addrs {
                t.by_addr.insert(*a, vm);
            }
            t.vms[vm] = Some((spec.vm.name.clone(), addrs));
        }
        Ok(())
    }

    fn remove_vm(&self, vm: usize, _unpoll: &mut dyn FnMut(RawFd)) {
        {
            let mut t = self.table_mut();
            let Some(Some((_, addrs))) = t.vms.get_mut(vm).map(Option::take) else {
                return;
            };
            for a in &addrs {
                t.by_addr.remove(a);
            }
        }
    }

    fn send(&self, ctx: &PortCtx<'_>, vm: usize, mads: &[OutMad<'_>]) {
        let Some(p) = ctx.vms.get(vm) else { return };
        let mut buf = [0u8; IPV6_DATAGRAM_LEN];
        for (dst, mad) in mads {
            let own = crate::config::gid_addr(p.spec.vm.source_for(*dst));
            let Some((n, to)) = self.datagram(vm, own, *dst, mad, &mut buf) else {
                tracing::debug!(parent: &p.span, %dst, "no route from this VM's address to the GID: dropped");
                p.counters.drop(DevDrop::BadRemoteGid);
                continue;
            };
            let d = &buf[..n];
            if let Some(c) = ctx.capture {
                c.record_datagram(d);
            }
            match self.send_one(d, &to) {
                Ok(()) => p.counters.add(Io::WireTxFrames, 1),
                Err(e) => {
                    tracing::debug!(parent: &p.span, error = %e, %dst, "packet port send failed");
                    p.counters.drop(DevDrop::WireSendError);
                }
            }
        }
        if let Some(c) = ctx.capture {
            c.flush();
        }
    }

    fn receive(&self, ctx: &PortCtx<'_>, _token: u64, route: &mut dyn FnMut(Arrivals)) {
        thread_local! {
            static RB: std::cell::RefCell<Option<RecvBatch>> = const { std::cell::RefCell::new(None) };
        }
        RB.with(|rb| {
            let mut rb = rb.borrow_mut();
            let rb = rb.get_or_insert_with(RecvBatch::default);
            for _ in 0..RX_ROUNDS {
                let n = match sys::recv_batch(self.rx.as_raw_fd(), rb) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(port = %self.name, error = %e, "packet receive failed");
                        break;
                    }
                };
                let mut per_vm: Vec<(usize, Vec<InMad>)> = Vec::new();
                for i in 0..n {
                    let (_, frame, truncated) = rb.get(i);
                    if rb.packet_type(i) == Some(PACKET_OUTGOING) {
                        self.on_egress(ctx, frame);
                        continue;
                    }
                    self.on_frame(ctx, frame, truncated, &mut per_vm);
                }
                if let Some(c) = ctx.capture {
                    c.flush();
                }
                if !per_vm.is_empty() {
                    route(per_vm);
                }
                if n < sys::BATCH {
                    break;
                }
            }
            ctx.host
                .drop_n(DevDrop::WireRxOverflow, self.stats().into());
        });
    }
}

impl PacketPort {
    /// One frame transmitted on DEV: a VM's own frame its divert stopped, never routed;
    /// counted on the VM whose address is its source, else on the host's counters.
    fn on_egress(&self, ctx: &PortCtx<'_>, frame: &[u8]) {
        let (src, reason) = check_egress_frame(frame, self.port_num);
        let vm = src
            .and_then(|s| self.vm_of(&s))
            .and_then(|vm| ctx.vms.get(vm));
        match vm {
            Some(p) => {
                p.counters.drop(reason);
                tracing::debug!(parent: &p.span, src = ?src, dst = ?frame_destination(frame), reason = reason.name(), "the VM's own frame, stopped by its divert: dropped");
            }
            None => {
                ctx.host.drop(DevDrop::WireEgressUnknownSource);
                tracing::debug!(port = %self.name, src = ?src, "a frame transmitted on the divert device from no VM's address: dropped");
            }
        }
    }

    /// One frame from DEV: checked, counted, and queued for its VM.
    fn on_frame(
        &self,
        ctx: &PortCtx<'_>,
        frame: &[u8],
        truncated: bool,
        per_vm: &mut Vec<(usize, Vec<InMad>)>,
    ) {
        let owner = |dst: Option<IpAddr>| {
            dst.and_then(|d| self.vm_of(&d))
                .and_then(|vm| Some((vm, ctx.vms.get(vm)?)))
        };
        let result = if truncated {
            Err((frame_destination(frame), DevDrop::WireBadLength))
        } else {
            check_ether_frame(frame, self.port_num)
        };
        match result {
            Ok((dst, f)) => {
                let Some((vm, p)) = owner(Some(dst)) else {
                    ctx.host.add(Io::WireRxFrames, 1);
                    ctx.host.drop(DevDrop::WireUnknownGid);
                    tracing::debug!(port = %self.name, %dst, src = %f.src, "QP1 frame for an address no VM owns: dropped");
                    return;
                };
                p.counters.add(Io::WireRxFrames, 1);
                if let Some(c) = ctx.capture {
                    c.record_datagram(frame.get(ETH_HLEN..).unwrap_or(&[]));
                }
                let m = InMad::from(f);
                match per_vm.iter_mut().find(|(q, _)| *q == vm) {
                    Some((_, v)) => v.push(m),
                    None => per_vm.push((vm, vec![m])),
                }
            }
            Err((dst, reason)) => {
                let counters = match owner(dst) {
                    Some((_, p)) => &p.counters,
                    None => ctx.host,
                };
                counters.add(Io::WireRxFrames, 1);
                counters.drop(reason);
                if let (Some(c), Some(ip)) = (ctx.capture, frame.get(ETH_HLEN..))
                    && dst.is_some()
                {
                    c.record_datagram(ip);
                }
                tracing::debug!(port = %self.name, dst = ?dst, reason = reason.name(), "packet port frame dropped");
            }
        }
    }
}

#[cfg(test)]
mod tests;

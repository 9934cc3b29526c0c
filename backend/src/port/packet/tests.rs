//! The packet port: its frame check byte by byte, and real sockets in a network
//! namespace (veth pairs): frames written at the far end of one veth are read, checked
//! and routed; frames sent leave through the IP stack with the VM's address as source
//! and a valid ICRC, read at the far end of another.

use std::time::{Duration, Instant};

use pvcm_wire::mad::{self, MGMT_CLASS_CM};
use pvcm_wire::roce::{BthRepr, DethRepr, IPV4_HEADER_LEN};

use super::*;
use crate::config::VmSpec;
use crate::pcap::Capture;
use crate::port::testnet::{add_addr, in_netns, ip};
use crate::stats::DevCounters;
use crate::vm_port::VmPort;

const PORT: u16 = 4791;

fn cm_mad(tag: u8) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    mad::field::MGMT_CLASS.set(&mut m, MGMT_CLASS_CM.into());
    m[255] = tag;
    m
}

fn a(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A RoCEv2 datagram the way rxe writes it: IPv4 with a hashed ID, IPv6 with UDP
/// checksum 0; `deth` as given (the GSI's unless a test breaks it).
fn datagram(src: IpAddr, dst: IpAddr, tag: u8, deth: DethRepr) -> Vec<u8> {
    let ip = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => IpRepr::V4(Ipv4Repr {
            identification: 0x5a17,
            ..Ipv4Repr::new(s, d)
        }),
        (IpAddr::V6(s), IpAddr::V6(d)) => IpRepr::V6(Ipv6Repr::new(s, d)),
        _ => panic!("mixed families"),
    };
    let udp = UdpRepr {
        src_port: 0xd872,
        ..UdpRepr::new(PORT)
    };
    let mut d = vec![0u8; ip.datagram_len()];
    let m = cm_mad(tag);
    FrameRepr {
        bth: BthRepr::gsi(7),
        deth,
        mad: &m,
    }
    .emit_datagram(&mut d, &ip, &udp)
    .unwrap();
    if ip.header_len() == IPV6_HEADER_LEN {
        d[46] = 0;
        d[47] = 0;
    }
    d
}

fn good(src: &str, dst: &str, tag: u8) -> Vec<u8> {
    datagram(a(src), a(dst), tag, DethRepr::gsi())
}

/// An Ethernet frame around a datagram (the EtherType from its version nibble).
fn eth(d: &[u8]) -> Vec<u8> {
    let ty = if d.first().map(|b| b >> 4) == Some(6) {
        ETH_P_IPV6
    } else {
        ETH_P_IP
    };
    let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb];
    f.extend_from_slice(&ty.to_be_bytes());
    f.extend_from_slice(d);
    f
}

fn reason(f: &[u8]) -> DevDrop {
    check_ether_frame(f, PORT).unwrap_err().1
}

#[test]
fn the_frame_check() {
    let v4 = eth(&good("10.50.0.2", "10.50.0.11", 1));
    let v6 = eth(&good("fd50::2", "fd50::11", 2));
    let (dst, f) = check_ether_frame(&v4, PORT).unwrap();
    assert_eq!(dst, a("10.50.0.11"));
    assert_eq!(f.src, Gid::from_ipv4("10.50.0.2".parse().unwrap()));
    assert_eq!(f.src_addr, SocketAddr::new(a("10.50.0.2"), 0xd872));
    assert_eq!(f.mad[255], 1);
    let (dst, f) = check_ether_frame(&v6, PORT).unwrap();
    assert_eq!(dst, a("fd50::11"));
    assert_eq!(f.src, Gid::from("fd50::2".parse::<Ipv6Addr>().unwrap()));
    assert_eq!(f.mad[255], 2);
    // Ethernet padding after the datagram is not part of it.
    let mut padded = v4.clone();
    padded.extend_from_slice(&[0; 20]);
    assert!(check_ether_frame(&padded, PORT).is_ok());

    // Truncated: Ethernet, IP headers, the IP length, the UDP header.
    assert_eq!(reason(&v4[..13]), DevDrop::WireTruncated);
    assert_eq!(reason(&v4[..14 + 19]), DevDrop::WireTruncated);
    assert_eq!(reason(&v6[..14 + 39]), DevDrop::WireTruncated);
    assert_eq!(reason(&v4[..v4.len() - 1]), DevDrop::WireTruncated);
    assert_eq!(reason(&v6[..v6.len() - 1]), DevDrop::WireTruncated);
    assert_eq!(
        check_ether_frame(&v4[..v4.len() - 1], PORT).unwrap_err().0,
        Some(a("10.50.0.11"))
    );
    let mut w = v6.clone();
    w[14 + 4..14 + 6].copy_from_slice(&4u16.to_be_bytes()); // payload length 4
    assert_eq!(reason(&w[..14 + 44]), DevDrop::WireTruncated);
    // Not RoCEv2: another EtherType, protocol, next header or port.
    let mut w = v4.clone();
    w[12..14].copy_from_slice(&0x0806u16.to_be_bytes()); // ARP
    assert_eq!(reason(&w), DevDrop::WireNotRoce);
    let mut w = good("10.50.0.2", "10.50.0.11", 1);
    w[9] = 6; // TCP, header checksum fixed
    let h = Ipv4Repr::parse(&{
        let mut x = w.clone();
        x[10] = 0;
        x[11] = 0;
        let mut r = Ipv4Repr::parse(&good("10.50.0.2", "10.50.0.11", 1)).unwrap();
        r.protocol = 6;
        r.emit(&mut x).unwrap();
        x
    })
    .unwrap();
    h.emit(&mut w).unwrap();
    assert_eq!(reason(&eth(&w)), DevDrop::WireNotRoce);
    let mut w = v6.clone();
    w[14 + 6] = 58; // ICMPv6
    assert_eq!(reason(&w), DevDrop::WireNotRoce);
    for nh in [0u8, 43, 44, 60] {
        let mut w = v6.clone();
        w[14 + 6] = nh;
        assert_eq!(reason(&w), DevDrop::WireIpv6ExtHeader, "next header {nh}");
    }
    let mut w = v6.clone();
    w[14 + 42..14 + 44].copy_from_slice(&4792u16.to_be_bytes());
    assert_eq!(reason(&w), DevDrop::WireNotRoce);
    // IPv4 options, fragments, checksum; an IPv4 EtherType with another version.
    let mut w = v4.clone();
    w[14] = 0x46;
    assert_eq!(reason(&w), DevDrop::WireBadIp);
    let mut w = v4.clone();
    w[14 + 8] ^= 1; // TTL, checksum not fixed
    assert_eq!(reason(&w), DevDrop::WireBadIp);
    let mut w = v4.clone();
    w[14] = 0x65;
    assert_eq!(reason(&w), DevDrop::WireBadIp);
    let mut w = v6.clone();
    w[14] = 0x45;
    assert_eq!(reason(&w), DevDrop::WireBadIp);
    // Sources that cannot be a RoCE peer.
    for (s, d) in [
        ("0.0.0.0", "10.50.0.11"),
        ("255.255.255.255", "10.50.0.11"),
        ("224.0.0.5", "10.50.0.11"),
        ("127.0.0.1", "10.50.0.11"),
        ("::", "fd50::11"),
        ("::1", "fd50::11"),
        ("ff02::1", "fd50::11"),
        ("::ffff:10.50.0.2", "fd50::11"),
        ("::10.50.0.2", "fd50::11"),
    ] {
        assert_eq!(
            reason(&eth(&good(s, d, 0))),
            DevDrop::WireBadSource,
            "source {s}"
        );
    }
    // BTH and DETH: a source QP other than 1, another Q_Key, QP 2.
    let bad_qp = DethRepr {
        src_qp: 2,
        ..DethRepr::gsi()
    };
    for (s, d) in [("10.50.0.2", "10.50.0.11"), ("fd50::2", "fd50::11")] {
        assert_eq!(
            reason(&eth(&datagram(a(s), a(d), 0, bad_qp))),
            DevDrop::WireBadDeth
        );
    }
    let mut w = v6.clone();
    w[14 + 48 + 7] = 2; // destination QP 2
    assert_eq!(reason(&w), DevDrop::WireBadBth);
    // The ICRC, over the IP header as received: an address, the IPv4 ID, the MAD.
    for at in [14 + 12, 14 + 4, v4.len() - 10] {
        let mut w = v4.clone();
        w[at] ^= 0x01;
        if at < 14 + IPV4_HEADER_LEN {
            // Keep the header checksum right, so only the ICRC can tell.
            let mut h = Ipv4Repr::parse(&v4[14..]).unwrap();
            if at == 14 + 12 {
                h.src = "11.50.0.2".parse().unwrap();
            } else {
                h.identification ^= 0x0100;
            }
            h.emit(&mut w[14..]).unwrap();
        }
        assert_eq!(reason(&w), DevDrop::WireBadIcrc, "byte {at}");
    }
    for at in [14 + 8, 14 + 39, 14 + 40, v6.len() - 1] {
        let mut w = v6.clone();
        w[at] ^= 0x01;
        assert_eq!(reason(&w), DevDrop::WireBadIcrc, "byte {at}");
    }
    // Masked fields do not matter: TTL (checksum fixed), traffic class, flow label,
    // hop limit, the UDP checksum.
    let mut w = v6.clone();
    w[14 + 1] = 0xff;
    w[14 + 7] = 1;
    w[14 + 46] = 0x12;
    assert!(check_ether_frame(&w, PORT).is_ok());
    // UDP length other than the datagram's.
    let mut w = v6.clone();
    w[14 + 44..14 + 46].copy_from_slice(&200u16.to_be_bytes());
    assert_eq!(reason(&w), DevDrop::WireBadLength);
    assert_eq!(frame_destination(&v6), Some(a("fd50::11")));
    assert_eq!(frame_destination(&v4[..20]), None);
}

/// The veth pairs of a test: `pa` (DEV) with `pb` at its far end to write frames into;
/// `sa` (the route to the peers 10.50.0.2, fd50::2, fe80::2, static neighbours) with
/// `sb` at its far end to read what the port sends.
fn topology() {
    ip(&["link", "add", "pa", "type", "veth", "peer", "name", "pb"]);
    ip(&["link", "add", "sa", "type", "veth", "peer", "name", "sb"]);
    for d in ["pa", "pb", "sb"] {
        // No IPv6 (router solicitations, MLD) on the devices the test reads or writes.
        std::fs::write(format!("/proc/sys/net/ipv6/conf/{d}/disable_ipv6"), "1").unwrap();
    }
    for d in ["pa", "pb", "sa", "sb"] {
        ip(&["link", "set", d, "up"]);
    }
    ip(&["addr", "add", "10.50.0.1/24", "dev", "sa"]);
    add_addr("sa", "fd50::1/64");
    let mac = "02:00:00:00:50:02";
    ip(&[
        "neigh",
        "add",
        "10.50.0.2",
        "lladdr",
        mac,
        "dev",
        "sa",
        "nud",
        "permanent",
    ]);
    ip(&[
        "-6",
        "neigh",
        "add",
        "fd50::2",
        "lladdr",
        mac,
        "dev",
        "sa",
        "nud",
        "permanent",
    ]);
    ip(&[
        "-6",
        "neigh",
        "add",
        "fe80::2",
        "lladdr",
        mac,
        "dev",
        "sa",
        "nud",
        "permanent",
    ]);
}

/// A packet socket on `dev` (every protocol).
fn packet_socket(dev: &str) -> OwnedFd {
    let fd = socket(libc::AF_PACKET, libc::SOCK_RAW, 0).unwrap();
    // SAFETY: sockaddr_ll is plain old data for which all-zero is valid.
    let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    sll.sll_family = libc::AF_PACKET as u16;
    sll.sll_protocol = ETH_P_ALL.to_be();
    sll.sll_ifindex = sys::if_index(dev).unwrap() as libc::c_int;
    // SAFETY: `sll` is a valid sockaddr_ll.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0, "bind: {}", io::Error::last_os_error());
    fd
}

fn write_frame(fd: &OwnedFd, f: &[u8]) {
    // SAFETY: the buffer is live for the call.
    let r = unsafe { libc::send(fd.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
    assert_eq!(r, f.len() as isize, "send: {}", io::Error::last_os_error());
}

/// The RoCEv2 frames `fd` reads within `wait` (other traffic skipped).
fn read_roce(fd: &OwnedFd, want: usize, wait: Duration) -> Vec<Vec<u8>> {
    let end = Instant::now() + wait;
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    while got.len() < want && Instant::now() < end {
        // SAFETY: the buffer is live and writable for its length.
        let r = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if r <= 0 {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let f = &buf[..r as usize];
        if check_udp_port(f) {
            got.push(f.to_vec());
        }
    }
    got
}

fn check_udp_port(f: &[u8]) -> bool {
    let ty = u16::from_be_bytes([f[12], f[13]]);
    let at = match ty {
        ETH_P_IP => ETH_HLEN + usize::from(f[ETH_HLEN] & 0x0f) * 4 + 2,
        ETH_P_IPV6 if f.get(ETH_HLEN + 6) == Some(&IP_PROTOCOL_UDP) => {
            ETH_HLEN + IPV6_HEADER_LEN + 2
        }
        _ => return false,
    };
    f.get(at..at + 2) == Some(&PORT.to_be_bytes()[..])
}

struct Rig {
    vms: crate::vm_port::VmSet,
    host: DevCounters,
}

fn rig(specs: &[(&str, &str)]) -> Rig {
    let vms = specs
        .iter()
        .enumerate()
        .map(|(i, (n, g))| {
            let s: VmSpec = format!("socket=/x/{n},gid={g},name={n}").parse().unwrap();
            VmPort::for_test(i, s)
        })
        .collect();
    Rig {
        vms: crate::vm_port::VmSet::new(vms),
        host: DevCounters::default(),
    }
}

impl Rig {
    fn addrs(&self) -> Vec<(String, Vec<IpAddr>)> {
        self.vms
            .iter()
            .map(|v| {
                (
                    v.spec.vm.name.clone(),
                    v.spec.addrs().map(|(a, _)| a).collect(),
                )
            })
            .collect()
    }
    fn ctx<'a>(&'a self, cap: Option<&'a Capture>) -> PortCtx<'a> {
        PortCtx {
            vms: &self.vms,
            host: &self.host,
            capture: cap,
        }
    }
    /// What the port routes within `wait`: (VM, source GID, tag).
    fn receive(&self, p: &PacketPort, want: usize, wait: Duration) -> Vec<(usize, Gid, u8)> {
        let end = Instant::now() + wait;
        let mut got = Vec::new();
        while Instant::now() < end {
            p.receive(&self.ctx(None), 0, &mut |batch| {
                for (vm, mads) in batch {
                    got.extend(mads.iter().map(|m| (vm, m.src, m.mad[255])));
                }
            });
            if got.len() >= want {
                // Anything more would be a leak: give it a moment to show.
                std::thread::sleep(Duration::from_millis(20));
                p.receive(&self.ctx(None), 0, &mut |batch| {
                    for (vm, mads) in batch {
                        got.extend(mads.iter().map(|m| (vm, m.src, m.mad[255])));
                    }
                });
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        got
    }
    fn drops(&self, who: Option<usize>, r: DevDrop) -> u64 {
        match who {
            Some(v) => self.vms[v].counters.dropped(r),
            None => self.host.dropped(r),
        }
    }
}

const VMS: [(&str, &str); 3] = [("a4", "10.50.0.11"), ("a6", "fd50::11"), ("b6", "fd50::12")];

fn gid(s: &str) -> Gid {
    s.parse().unwrap()
}

/// Frames written at the far end of DEV's veth, IPv4 and IPv6, reach the VM of their
/// destination; frames for other addresses are counted on the host's counters
/// (`wire_unknown_gid`) and go nowhere.
#[test]
fn receives_and_routes_by_gid() {
    in_netns("packet port receive", || {
        topology();
        let r = rig(&VMS);
        let port = PacketPort::open("pa", None, &r.addrs(), PORT).unwrap();
        let pb = packet_socket("pb");
        // No VM's address: read first (the port reads in order), counted, not routed.
        write_frame(&pb, &eth(&good("fd50::2", "fd50::99", 4)));
        write_frame(&pb, &eth(&good("10.50.0.2", "10.50.0.99", 5)));
        write_frame(&pb, &eth(&good("10.50.0.2", "10.50.0.11", 1)));
        write_frame(&pb, &eth(&good("fd50::2", "fd50::11", 2)));
        write_frame(&pb, &eth(&good("fd50::2", "fd50::12", 3)));
        let mut got = r.receive(&port, 3, Duration::from_secs(2));
        got.sort_by_key(|g| g.2);
        assert_eq!(
            got,
            vec![
                (0, gid("10.50.0.2"), 1),
                (1, gid("fd50::2"), 2),
                (2, gid("fd50::2"), 3)
            ]
        );
        for v in 0..3 {
            assert_eq!(r.vms[v].counters.io(Io::WireRxFrames), 1);
        }
        assert_eq!(r.host.io(Io::WireRxFrames), 2);
        for d in DevDrop::ALL {
            let want = if *d == DevDrop::WireUnknownGid { 2 } else { 0 };
            assert_eq!(r.host.dropped(*d), want, "{}", d.name());
        }
        assert_eq!(port.rx_mode(), "packet pa");
    });
}

/// A frame transmitted on DEV (what a VM's divert forwards there from the VM) is never
/// routed, even a good QP1 frame to another VM's address: it is counted on the VM of
/// its source (`vm_qp1_egress`, `vm_egress_unclassified`), or on the host's counters
/// when no VM owns its source; frames received on DEV are routed as before.
#[test]
fn frames_transmitted_on_dev_are_counted_never_routed() {
    in_netns("packet port egress", || {
        topology();
        let r = rig(&VMS);
        let port = PacketPort::open("pa", None, &r.addrs(), PORT).unwrap();
        let pa = packet_socket("pa");
        let pb = packet_socket("pb");
        // a6 to b6's address, a4 to a peer, a later IPv4 fragment, a stranger's frame.
        write_frame(&pa, &eth(&good("fd50::11", "fd50::12", 1)));
        write_frame(&pa, &eth(&good("10.50.0.11", "10.50.0.2", 2)));
        let mut frag = eth(&good("10.50.0.11", "10.50.0.2", 3));
        frag[14 + 6..14 + 8].copy_from_slice(&0x0009u16.to_be_bytes());
        write_frame(&pa, &frag);
        write_frame(&pa, &eth(&good("10.50.0.99", "10.50.0.11", 4)));
        // Received on DEV: routed.
        write_frame(&pb, &eth(&good("fd50::2", "fd50::12", 5)));
        let got = r.receive(&port, 1, Duration::from_secs(2));
        assert_eq!(got, vec![(2, gid("fd50::2"), 5)]);
        std::thread::sleep(Duration::from_millis(50));
        r.receive(&port, 0, Duration::from_millis(50));
        assert_eq!(r.drops(Some(1), DevDrop::VmQp1Egress), 1);
        assert_eq!(r.drops(Some(0), DevDrop::VmQp1Egress), 1);
        assert_eq!(r.drops(Some(0), DevDrop::VmEgressUnclassified), 1);
        assert_eq!(r.drops(None, DevDrop::WireEgressUnknownSource), 1);
        assert_eq!(r.drops(None, DevDrop::WireUnknownGid), 0);
        assert_eq!(r.vms[2].counters.io(Io::WireRxFrames), 1);
        assert_eq!(r.vms[0].counters.io(Io::WireRxFrames), 0);
    });
}

/// A VM added at runtime joins the receive filter and the routing table, and one
/// removed leaves both; an address already served is refused.
#[test]
fn vms_added_and_removed_at_runtime_join_and_leave_the_filter() {
    in_netns("packet port runtime VMs", || {
        topology();
        let mut specs = VMS.to_vec();
        specs.push(("d4", "10.50.0.12"));
        let r = rig(&specs);
        let addrs = r.addrs();
        let port = PacketPort::open("pa", None, &addrs[..3], PORT).unwrap();
        assert!(port.changes_vms());
        let pb = packet_socket("pb");
        let to_d = |tag| write_frame(&pb, &eth(&good("10.50.0.2", "10.50.0.12", tag)));
        let mut buf = [0u8; IPV6_DATAGRAM_LEN];
        let mad = [0u8; MAD_LEN];
        let d4 = r.vms[3].spec.addr();
        to_d(1);
        assert_eq!(r.receive(&port, 1, Duration::from_millis(300)), vec![]);
        assert!(
            port.datagram(3, d4, gid("10.50.0.2"), &mad, &mut buf)
                .is_none()
        );
        port.add_vm(3, &r.vms[3].spec, &mut |_, _| Ok(())).unwrap();
        to_d(2);
        assert_eq!(
            r.receive(&port, 1, Duration::from_secs(2)),
            vec![(3, gid("10.50.0.2"), 2)]
        );
        assert!(
            port.datagram(3, d4, gid("10.50.0.2"), &mad, &mut buf)
                .is_some()
        );
        let again = port.add_vm(4, &r.vms[3].spec, &mut |_, _| Ok(()));
        assert!(matches!(again, Err(PortError::Bind(_))), "{again:?}");
        port.remove_vm(3, &mut |_| {});
        to_d(3);
        assert_eq!(r.receive(&port, 1, Duration::from_millis(300)), vec![]);
        assert!(
            port.datagram(3, d4, gid("10.50.0.2"), &mad, &mut buf)
                .is_none()
        );
        // The VMs it opened with are served throughout.
        write_frame(&pb, &eth(&good("10.50.0.2", "10.50.0.11", 4)));
        assert_eq!(
            r.receive(&port, 1, Duration::from_secs(2)),
            vec![(0, gid("10.50.0.2"), 4)]
        );
    });
}

/// Every frame on DEV reaches the port (no kernel filter): what the divert could not
/// have produced for a configured VM (bad frames, another protocol, another UDP port,
/// a data QP, an IPv4 fragment, another address) is dropped with its reason, on the
/// VM's counters when the destination is a VM's, else on the host's; nothing is routed.
#[test]
fn drops_bad_frames_with_reasons() {
    in_netns("packet port drops", || {
        topology();
        let r = rig(&VMS);
        let port = PacketPort::open("pa", None, &r.addrs(), PORT).unwrap();
        let pb = packet_socket("pb");
        let mut bad_icrc4 = eth(&good("10.50.0.2", "10.50.0.11", 1));
        let n = bad_icrc4.len();
        bad_icrc4[n - 1] ^= 0x40;
        let mut bad_icrc6 = eth(&good("fd50::2", "fd50::11", 2));
        bad_icrc6[n] ^= 0x40; // the IPv6 frame is 20 bytes longer: a MAD byte
        let mut ext = eth(&good("fd50::2", "fd50::12", 3));
        ext[14 + 6] = 0; // hop-by-hop
        let mut trunc = eth(&good("10.50.0.2", "10.50.0.11", 4));
        trunc.truncate(n - 10);
        let bad_qp = DethRepr {
            src_qp: 5,
            ..DethRepr::gsi()
        };
        let mut tcp = eth(&good("fd50::2", "fd50::12", 5));
        tcp[14 + 6] = 6;
        let mut arp = eth(&good("10.50.0.2", "10.50.0.11", 12));
        arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        arp.truncate(14 + 28);
        let data_qp = {
            let mut d = good("fd50::2", "fd50::12", 13);
            d[IPV6_HEADER_LEN + UDP_HEADER_LEN + 7] = 0x11; // BTH destination QP 0x11
            eth(&d)
        };
        let other_port = {
            let mut d = good("fd50::2", "fd50::11", 14);
            d[IPV6_HEADER_LEN + 2..IPV6_HEADER_LEN + 4].copy_from_slice(&4792u16.to_be_bytes());
            eth(&d)
        };
        let fragment = {
            let mut d = good("10.50.0.2", "10.50.0.11", 15);
            d[6] = 0x20; // more fragments, header checksum fixed below
            d[10..12].copy_from_slice(&[0, 0]);
            let sum = pvcm_wire::roce::internet_checksum(&d[..IPV4_HEADER_LEN]);
            d[10..12].copy_from_slice(&sum.to_be_bytes());
            eth(&d)
        };
        let frames: Vec<(Vec<u8>, Option<usize>, DevDrop)> = vec![
            (bad_icrc4, Some(0), DevDrop::WireBadIcrc),
            (bad_icrc6, Some(1), DevDrop::WireBadIcrc),
            (ext, Some(2), DevDrop::WireIpv6ExtHeader),
            (trunc, Some(0), DevDrop::WireTruncated),
            (
                eth(&datagram(a("fd50::2"), a("fd50::11"), 6, bad_qp)),
                Some(1),
                DevDrop::WireBadDeth,
            ),
            (
                eth(&good("::ffff:10.50.0.2", "fd50::12", 7)),
                Some(2),
                DevDrop::WireBadSource,
            ),
            (
                eth(&good("ff02::1", "fd50::11", 8)),
                Some(1),
                DevDrop::WireBadSource,
            ),
            (
                eth(&good("fd50::2", "fd50::99", 9)),
                None,
                DevDrop::WireUnknownGid,
            ),
            (
                eth(&good("10.50.0.2", "10.50.0.98", 10)),
                None,
                DevDrop::WireUnknownGid,
            ),
            (tcp, Some(2), DevDrop::WireNotRoce),
            (arp, None, DevDrop::WireNotRoce),
            (data_qp, Some(2), DevDrop::WireBadBth),
            (other_port, Some(1), DevDrop::WireNotRoce),
            (fragment, Some(0), DevDrop::WireBadIp),
        ];
        for (f, _, _) in &frames {
            write_frame(&pb, f);
        }
        // One good frame last: when it is routed, everything before it was read.
        write_frame(&pb, &eth(&good("fd50::2", "fd50::12", 11)));
        let got = r.receive(&port, 1, Duration::from_secs(2));
        assert_eq!(got, vec![(2, gid("fd50::2"), 11)]);
        let mut want: HashMap<(Option<usize>, &str), u64> = HashMap::new();
        for (_, who, why) in &frames {
            *want.entry((*who, why.name())).or_default() += 1;
        }
        for who in [None, Some(0), Some(1), Some(2)] {
            for d in DevDrop::ALL {
                let n = want.get(&(who, d.name())).copied().unwrap_or(0);
                assert_eq!(r.drops(who, *d), n, "{who:?} {}", d.name());
            }
        }
    });
}

/// What the port sends leaves through the IP stack with the VM's address as source,
/// IPv4 and IPv6 (a link-local destination through IFACE), and arrives at the far end
/// with a valid ICRC over exactly the header the kernel sent, byte for byte what pvcm
/// built and captured; a GID of the other family is bad_remote_gid.
#[test]
fn sends_with_the_vms_source_address() {
    in_netns("packet port send", || {
        topology();
        let r = rig(&VMS);
        let port = PacketPort::open("pa", Some("sa"), &r.addrs(), PORT).unwrap();
        let sb = packet_socket("sb");
        let dir = tempfile::tempdir().unwrap();
        let cap = Capture::create(&dir.path().join("tx.pcap")).unwrap();
        let ctx = r.ctx(Some(&cap));
        let (m1, m2, m3, m4) = (cm_mad(1), cm_mad(2), cm_mad(3), cm_mad(4));
        port.send(&ctx, 0, &[(gid("10.50.0.2"), &m1), (gid("fd50::2"), &m4)]);
        port.send(&ctx, 1, &[(gid("fd50::2"), &m2), (gid("fe80::2"), &m3)]);
        cap.flush();
        assert_eq!(r.vms[0].counters.io(Io::WireTxFrames), 1);
        assert_eq!(r.vms[0].counters.dropped(DevDrop::BadRemoteGid), 1);
        assert_eq!(r.vms[1].counters.io(Io::WireTxFrames), 2);
        let got = read_roce(&sb, 3, Duration::from_secs(2));
        assert_eq!(got.len(), 3, "three frames at the far end");
        let mut rd = pcap_file::pcap::PcapReader::new(
            std::fs::File::open(dir.path().join("tx.pcap")).unwrap(),
        )
        .unwrap();
        let mut captured = Vec::new();
        while let Some(p) = rd.next_packet() {
            captured.push(p.unwrap().data.to_vec());
        }
        assert_eq!(captured.len(), 3);
        let mut seen = Vec::new();
        for f in &got {
            let d = &f[ETH_HLEN..];
            roce::check_datagram_icrc(d).unwrap();
            let (ip, udp, fr) = roce::parse_ip_datagram(d).unwrap();
            assert_eq!((udp.src_port, udp.dst_port), (PORT, PORT));
            if let IpRepr::V4(h) = ip {
                assert_ne!(h.identification, 0);
                assert!(h.dont_fragment);
            }
            // Byte for byte what pvcm built: the kernel rewrote nothing.
            assert!(captured.iter().any(|c| c[..] == d[..c.len()]), "{ip}");
            seen.push((ip.src(), ip.dst(), fr.mad()[255]));
        }
        seen.sort_by_key(|s| s.2);
        assert_eq!(
            seen,
            vec![
                (a("10.50.0.11"), a("10.50.0.2"), 1),
                (a("fd50::11"), a("fd50::2"), 2),
                (a("fd50::11"), a("fe80::2"), 3),
            ]
        );
        // Without IFACE a link-local destination has no route.
        let port = PacketPort::open("pa", None, &r.addrs(), PORT).unwrap();
        port.send(&r.ctx(None), 1, &[(gid("fe80::2"), &m3)]);
        assert_eq!(r.vms[1].counters.dropped(DevDrop::BadRemoteGid), 1);
    });
}

/// A VM with two addresses (IPv4 and IPv6): a frame to either reaches it with that
/// address as its destination GID; it sends from its address of the destination's
/// family; a one-address VM has no route to the other family.
#[test]
fn a_vm_with_two_addresses_is_served_at_both() {
    in_netns("packet port two addresses", || {
        topology();
        let r = rig(&[("d", "10.50.0.21,gid=fd50::21"), ("e", "10.50.0.22")]);
        let port = PacketPort::open("pa", Some("sa"), &r.addrs(), PORT).unwrap();
        let pb = packet_socket("pb");
        write_frame(&pb, &eth(&good("10.50.0.2", "10.50.0.21", 1)));
        write_frame(&pb, &eth(&good("fd50::2", "fd50::21", 2)));
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(2);
        while got.len() < 2 && Instant::now() < end {
            port.receive(&r.ctx(None), 0, &mut |batch| {
                for (vm, mads) in batch {
                    got.extend(mads.iter().map(|m| (vm, m.src, m.dst, m.mad[255])));
                }
            });
            std::thread::sleep(Duration::from_millis(2));
        }
        got.sort_by_key(|g| g.3);
        assert_eq!(
            got,
            vec![
                (0, gid("10.50.0.2"), gid("10.50.0.21"), 1),
                (0, gid("fd50::2"), gid("fd50::21"), 2),
            ]
        );
        let sb = packet_socket("sb");
        let (m3, m4, m5) = (cm_mad(3), cm_mad(4), cm_mad(5));
        port.send(
            &r.ctx(None),
            0,
            &[(gid("10.50.0.2"), &m3), (gid("fd50::2"), &m4)],
        );
        port.send(&r.ctx(None), 1, &[(gid("fd50::2"), &m5)]);
        assert_eq!(r.vms[0].counters.io(Io::WireTxFrames), 2);
        assert_eq!(r.vms[1].counters.dropped(DevDrop::BadRemoteGid), 1);
        let mut seen: Vec<_> = read_roce(&sb, 2, Duration::from_secs(2))
            .iter()
            .map(|f| {
                let (ip, _, fr) = roce::parse_ip_datagram(&f[ETH_HLEN..]).unwrap();
                (ip.src(), ip.dst(), fr.mad()[255])
            })
            .collect();
        seen.sort_by_key(|s| s.2);
        assert_eq!(
            seen,
            vec![
                (a("10.50.0.21"), a("10.50.0.2"), 3),
                (a("fd50::21"), a("fd50::2"), 4),
            ]
        );
        // Another VM's address is not this VM's to send from.
        let mut buf = [0u8; IPV6_DATAGRAM_LEN];
        assert!(
            port.datagram(0, a("10.50.0.22"), gid("10.50.0.2"), &m3, &mut buf)
                .is_none()
        );
    });
}

/// What the kernel drops on the packet socket (its queue full) is counted on the host.
#[test]
fn kernel_drops_are_counted() {
    in_netns("packet port rx overflow", || {
        topology();
        let r = rig(&VMS);
        let port = PacketPort::open("pa", None, &r.addrs(), PORT).unwrap();
        port.set_rcvbuf(1);
        let pb = packet_socket("pb");
        for i in 0..200u8 {
            write_frame(&pb, &eth(&good("fd50::2", "fd50::11", i)));
        }
        let got = r.receive(&port, 200, Duration::from_millis(300));
        let dropped = r.host.dropped(DevDrop::WireRxOverflow);
        assert!(got.len() < 200, "the queue must have overflowed");
        assert_eq!(
            got.len() as u64 + dropped,
            200,
            "{} routed, {dropped} dropped",
            got.len()
        );
        assert_eq!(r.vms[1].counters.io(Io::WireRxFrames), got.len() as u64);
    });
}

/// Opening needs an Ethernet DEV that exists, and CAP_NET_RAW.
#[test]
fn open_errors_are_clear() {
    in_netns("packet port errors", || {
        let r = rig(&VMS);
        let e = PacketPort::open("nope0", None, &r.addrs(), PORT).unwrap_err();
        assert!(e.to_string().contains("nope0"), "{e}");
        assert!(e.to_string().contains("packet-port.md"), "{e}");
        ip(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
        let e = PacketPort::open("d0", Some("nope1"), &r.addrs(), PORT).unwrap_err();
        assert!(e.to_string().contains("IFACE"), "{e}");
        let e = PacketPort::open("lo", None, &r.addrs(), PORT).unwrap_err();
        assert!(e.to_string().contains("not an Ethernet device"), "{e}");
        // Without CAP_NET_RAW (dropped for this thread only).
        drop_net_raw();
        let e = PacketPort::open("d0", None, &r.addrs(), PORT).unwrap_err();
        assert!(e.to_string().contains("CAP_NET_RAW"), "{e}");
    });
}

/// Drops CAP_NET_RAW from the calling thread's effective set (capabilities are per
/// thread).
fn drop_net_raw() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: libc::c_int,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_NET_RAW: u32 = 13;
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget(2) with a v3 header and room for its two data words.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
    assert_eq!(r, 0, "capget: {}", io::Error::last_os_error());
    d[0].effective &= !(1 << CAP_NET_RAW);
    // SAFETY: capset(2) with the same header and data, less one effective bit.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) };
    assert_eq!(r, 0, "capset: {}", io::Error::last_os_error());
}

mod divert;

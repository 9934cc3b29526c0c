//! What a VM transmits, through its tap's divert (`qemu-scripts/qp1-divert.sh add`,
//! its nftables table on the tap's ingress) and the packet port on the divert device:
//! frames are crafted and written from inside the "VM" (the far end of a veth pair
//! whose near end stands in for the tap, a port of a bridge); what passes arrives at
//! the far end of another bridge port (the fabric), what the divert stops arrives on
//! the divert device, where the port counts it on the VM's counters.

use std::process::Command;

use super::*;

const VM_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x99, 0x00, 0x11];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0x50, 0x02];
const A4: &str = "10.50.0.11";
const A6: &str = "fd50::11";

/// UDP to `dport` with a BTH to `qp` (UD SEND only), a DETH and 40 bytes.
fn udp_bth(dport: u16, qp: u32) -> Vec<u8> {
    let mut p = vec![0x64, 0, 0xFF, 0xFF, 0];
    p.extend_from_slice(&qp.to_be_bytes()[1..]);
    p.extend_from_slice(&[0, 0, 0, 1]);
    p.extend_from_slice(&[0x80, 1, 0, 0, 0, 0, 0, 1]);
    p.extend_from_slice(&[b'x'; 40]);
    let mut u = 0xd872u16.to_be_bytes().to_vec();
    u.extend_from_slice(&dport.to_be_bytes());
    u.extend_from_slice(&((UDP_HEADER_LEN + p.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(&p);
    u
}

fn roce(qp: u32) -> Vec<u8> {
    udp_bth(PORT, qp)
}

fn ether(src: [u8; 6], ty: u16, body: &[u8]) -> Vec<u8> {
    let mut f = PEER_MAC.to_vec();
    f.extend_from_slice(&src);
    f.extend_from_slice(&ty.to_be_bytes());
    f.extend_from_slice(body);
    f
}

/// An IPv4 frame from the VM's MAC: `ihl` words of header (options of NOPs), the
/// fragment field as given (DF unless a fragment), `proto` and `l4`.
fn v4(src: &str, ihl: u8, frag: u16, proto: u8, l4: &[u8]) -> Vec<u8> {
    let hl = usize::from(ihl) * 4;
    let mut h = vec![0x40 | ihl, 0];
    h.extend_from_slice(&((hl + l4.len()) as u16).to_be_bytes());
    h.extend_from_slice(&[0x12, 0x34]);
    h.extend_from_slice(&frag.to_be_bytes());
    h.extend_from_slice(&[64, proto, 0, 0]);
    h.extend_from_slice(&src.parse::<Ipv4Addr>().unwrap().octets());
    h.extend_from_slice(&[10, 50, 0, 2]);
    h.resize(hl, 1);
    let sum = roce::internet_checksum(&h);
    h[10..12].copy_from_slice(&sum.to_be_bytes());
    h.extend_from_slice(l4);
    ether(VM_MAC, ETH_P_IP, &h)
}

/// An IPv6 frame from the VM's MAC: next header `nh`, then `rest` (extension headers
/// and the transport header).
fn v6(src: &str, nh: u8, rest: &[u8]) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(rest.len() as u16).to_be_bytes());
    h.extend_from_slice(&[nh, 64]);
    h.extend_from_slice(&src.parse::<Ipv6Addr>().unwrap().octets());
    h.extend_from_slice(&"fd50::2".parse::<Ipv6Addr>().unwrap().octets());
    h.extend_from_slice(rest);
    ether(VM_MAC, ETH_P_IPV6, &h)
}

/// An IPv6 extension header of `len8` 8-byte units (hop-by-hop, routing, destination
/// options: PadN inside) followed by next header `nh`.
fn ext(nh: u8, len8: usize) -> Vec<u8> {
    let mut e = vec![nh, (len8 - 1) as u8, 1, (len8 * 8 - 4) as u8];
    e.resize(len8 * 8, 0);
    e
}

/// An IPv6 fragment header: next header `nh`, offset in 8-byte units, more fragments.
fn frag6(nh: u8, offset: u16, more: bool) -> Vec<u8> {
    let mut e = vec![nh, 0];
    e.extend_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
    e.extend_from_slice(&[0, 0, 0x42, 0x42]);
    e
}

/// The frame with an 802.1Q tag (VLAN 7) after its MAC addresses.
fn tagged(f: &[u8]) -> Vec<u8> {
    let mut t = f[..12].to_vec();
    t.extend_from_slice(&[0x81, 0x00, 0x00, 0x07]);
    t.extend_from_slice(&f[12..]);
    t
}

fn arp(sender_mac: [u8; 6], sender_ip: [u8; 4]) -> Vec<u8> {
    let mut b = vec![0, 1, 8, 0, 6, 4, 0, 1];
    b.extend_from_slice(&sender_mac);
    b.extend_from_slice(&sender_ip);
    b.extend_from_slice(&[0; 6]);
    b.extend_from_slice(&[10, 50, 0, 2]);
    ether(sender_mac, 0x0806, &b)
}

#[test]
fn the_egress_check() {
    let is = |f: &[u8], src: Option<&str>, r: DevDrop| {
        assert_eq!(check_egress_frame(f, PORT), (src.map(a), r));
    };
    let q = DevDrop::VmQp1Egress;
    let u = DevDrop::VmEgressUnclassified;
    is(&v4(A4, 5, 0x4000, 17, &roce(1)), Some(A4), q);
    is(&v4(A4, 7, 0x4000, 17, &roce(1)), Some(A4), q);
    is(&v4(A4, 5, 0x2000, 17, &roce(1)), Some(A4), q); // first fragment
    is(&v4(A4, 5, 0x0001, 17, &roce(1)), Some(A4), u); // a later one
    is(&v4(A4, 5, 0x4000, 17, &roce(0x11)), Some(A4), u);
    is(&v4(A4, 5, 0x4000, 17, &udp_bth(4792, 1)), Some(A4), u);
    is(&v4(A4, 5, 0x4000, 6, &roce(1)), Some(A4), u);
    is(&v6(A6, 17, &roce(1)), Some(A6), q);
    let mut hop_dst = ext(60, 1);
    hop_dst.extend(ext(17, 2));
    hop_dst.extend(roce(1));
    is(&v6(A6, 0, &hop_dst), Some(A6), q);
    let mut first = frag6(17, 0, true);
    first.extend(roce(1));
    is(&v6(A6, 44, &first), Some(A6), q);
    let mut later = frag6(17, 9, false);
    later.extend(roce(1));
    is(&v6(A6, 44, &later), Some(A6), u);
    let mut odd = ext(253, 1);
    odd.extend(roce(1));
    is(&v6(A6, 0, &odd), Some(A6), u);
    let mut cut = ext(17, 4); // longer than the frame
    cut.truncate(8);
    is(&v6(A6, 0, &cut), Some(A6), u);
    is(&ether(VM_MAC, 0x8915, &[0; 64]), None, u);
    is(&arp(VM_MAC, [10, 50, 0, 11]), None, u);
    is(&v4(A4, 5, 0, 17, &roce(1))[..24], None, u);
}

/// Where a frame landed: on the fabric side, on the divert device, both or neither.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
enum Landed {
    Fabric,
    Divert,
    Nowhere,
}

/// Reads `fd` for `wait` and says whether a frame ending in `mark` arrived.
fn saw(fd: &OwnedFd, mark: &[u8; 4], wait: Duration) -> bool {
    let end = Instant::now() + wait;
    let mut buf = [0u8; 2048];
    let mut seen = false;
    while Instant::now() < end {
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
        seen |= buf[..r as usize].ends_with(mark);
    }
    seen
}

fn divert_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../qemu-scripts/qp1-divert.sh")
}

fn divert(args: &[&str]) -> std::process::Output {
    let out = Command::new("bash")
        .arg(divert_script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("qp1-divert.sh: {e}"));
    assert!(
        out.status.success(),
        "qp1-divert.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Every kind of frame a VM can send: its QP1 frames (IPv4 with and without options,
/// IPv6 with and without extension headers, VLAN-tagged, first fragments) and what
/// the divert cannot classify (later UDP fragments, an extension-header chain it
/// cannot walk, a second VLAN tag, RoCEv1) land on the divert device only, where the
/// packet port counts them on the VM's counters (or the host's, without an IP source);
/// frames from another MAC or address land nowhere; the rest (data QPs, ARP, DAD,
/// later fragments of TCP) reach the fabric. A flood of QP1 frames reaches DEV at the
/// table's rate at most. After `del`, everything passes.
#[test]
fn a_vms_own_qp1_frames_and_spoofs_never_reach_the_fabric() {
    if Command::new("nft").arg("--version").output().is_err() {
        eprintln!("SKIP the egress divert: no `nft` command (apt-get install nftables)");
        return;
    }
    in_netns("the egress divert", || {
        ip(&["link", "add", "br0", "type", "bridge"]);
        ip(&["link", "add", "tapx", "type", "veth", "peer", "name", "vm"]);
        ip(&["link", "add", "fab", "type", "veth", "peer", "name", "fabx"]);
        for d in ["br0", "tapx", "vm", "fab", "fabx"] {
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{d}/disable_ipv6"), "1").unwrap();
        }
        ip(&["link", "set", "tapx", "master", "br0"]);
        ip(&["link", "set", "fab", "master", "br0"]);
        for d in ["br0", "tapx", "vm", "fab", "fabx"] {
            ip(&["link", "set", d, "up"]);
        }
        divert(&[
            "add",
            "tapx",
            "pvcm-qp1",
            "52:54:00:99:00:11",
            A4,
            A6,
            "fe80::/64",
        ]);
        let r = rig(&[("a4", A4), ("a6", A6)]);
        let port = PacketPort::open("pvcm-qp1", None, &r.addrs(), PORT).unwrap();
        let vm = packet_socket("vm");
        let fabric = packet_socket("fabx");
        let dev = packet_socket("pvcm-qp1");

        let chain = |parts: &[Vec<u8>]| parts.concat();
        let other_mac = [0x52, 0x54, 0x00, 0x99, 0x00, 0x12];
        let mut spoofed_mac = v4(A4, 5, 0x4000, 17, &roce(0x11));
        spoofed_mac[6..12].copy_from_slice(&other_mac);
        let qinq = tagged(&tagged(&v4(A4, 5, 0x4000, 17, &roce(1))));
        let cases: Vec<(&str, Vec<u8>, Landed)> = vec![
            (
                "IPv4 to QP1",
                v4(A4, 5, 0x4000, 17, &roce(1)),
                Landed::Divert,
            ),
            (
                "IPv4 to QP 0x11",
                v4(A4, 5, 0x4000, 17, &roce(0x11)),
                Landed::Fabric,
            ),
            (
                "IPv4 with options to QP1",
                v4(A4, 8, 0x4000, 17, &roce(1)),
                Landed::Divert,
            ),
            (
                "IPv4 with options to QP 0x11",
                v4(A4, 8, 0x4000, 17, &roce(0x11)),
                Landed::Fabric,
            ),
            (
                "IPv4 VLAN-tagged to QP1",
                tagged(&v4(A4, 5, 0x4000, 17, &roce(1))),
                Landed::Divert,
            ),
            (
                "IPv4 VLAN-tagged to QP 0x11",
                tagged(&v4(A4, 5, 0x4000, 17, &roce(0x11))),
                Landed::Fabric,
            ),
            (
                "IPv4 first fragment to QP1",
                v4(A4, 5, 0x2000, 17, &roce(1)),
                Landed::Divert,
            ),
            (
                "IPv4 later UDP fragment",
                v4(A4, 5, 0x0009, 17, &roce(0x11)),
                Landed::Divert,
            ),
            (
                "IPv4 later TCP fragment",
                v4(A4, 5, 0x0009, 6, &roce(1)),
                Landed::Fabric,
            ),
            (
                "IPv4 UDP to another port, QP1 bytes",
                v4(A4, 5, 0x4000, 17, &udp_bth(4792, 1)),
                Landed::Fabric,
            ),
            (
                "IPv4 from another address",
                v4("10.50.0.99", 5, 0x4000, 17, &roce(0x11)),
                Landed::Nowhere,
            ),
            ("IPv4 from another MAC", spoofed_mac, Landed::Nowhere),
            ("IPv4 under two VLAN tags", qinq, Landed::Divert),
            (
                "ARP from the VM",
                arp(VM_MAC, [10, 50, 0, 11]),
                Landed::Fabric,
            ),
            ("ARP probe", arp(VM_MAC, [0, 0, 0, 0]), Landed::Fabric),
            (
                "ARP for another address",
                arp(VM_MAC, [10, 50, 0, 99]),
                Landed::Nowhere,
            ),
            (
                "ARP from another MAC",
                arp(other_mac, [10, 50, 0, 11]),
                Landed::Nowhere,
            ),
            (
                "RoCEv1",
                ether(VM_MAC, 0x8915, &[0x60; 120]),
                Landed::Divert,
            ),
            ("IPv6 to QP1", v6(A6, 17, &roce(1)), Landed::Divert),
            ("IPv6 to QP 0x11", v6(A6, 17, &roce(0x11)), Landed::Fabric),
            (
                "IPv6 hop-by-hop to QP1",
                v6(A6, 0, &chain(&[ext(17, 1), roce(1)])),
                Landed::Divert,
            ),
            (
                "IPv6 hop-by-hop to QP 0x11",
                v6(A6, 0, &chain(&[ext(17, 1), roce(0x11)])),
                Landed::Fabric,
            ),
            (
                "IPv6 hop-by-hop, routing, destination options to QP1",
                v6(
                    A6,
                    0,
                    &chain(&[ext(43, 1), ext(60, 2), ext(17, 3), roce(1)]),
                ),
                Landed::Divert,
            ),
            (
                "IPv6 VLAN-tagged to QP1",
                tagged(&v6(A6, 17, &roce(1))),
                Landed::Divert,
            ),
            (
                "IPv6 VLAN-tagged to QP 0x11",
                tagged(&v6(A6, 17, &roce(0x11))),
                Landed::Fabric,
            ),
            (
                "IPv6 first fragment to QP1",
                v6(A6, 44, &chain(&[frag6(17, 0, true), roce(1)])),
                Landed::Divert,
            ),
            (
                "IPv6 later UDP fragment",
                v6(A6, 44, &chain(&[frag6(17, 9, false), roce(0x11)])),
                Landed::Divert,
            ),
            (
                "IPv6 chain ending in header 253",
                v6(A6, 0, &chain(&[ext(253, 1), roce(1)])),
                Landed::Divert,
            ),
            (
                "IPv6 chain cut short",
                v6(A6, 0, &ext(17, 4)[..8]),
                Landed::Divert,
            ),
            (
                "IPv6 from another address",
                v6("fd50::99", 17, &roce(0x11)),
                Landed::Nowhere,
            ),
            (
                "IPv6 link-local to QP 0x11",
                v6("fe80::5054:ff:fe99:11", 17, &roce(0x11)),
                Landed::Fabric,
            ),
            (
                "IPv6 DAD from ::",
                v6("::", 58, &[135, 0, 0, 0, 0, 0, 0, 0]),
                Landed::Fabric,
            ),
            (
                "IPv6 UDP from :: to QP 0x11",
                v6("::", 17, &roce(0x11)),
                Landed::Nowhere,
            ),
        ];
        let wait = Duration::from_millis(150);
        let mut bad = Vec::new();
        for (i, (what, frame, want)) in cases.iter().enumerate() {
            let mark = [0xC0, 0xDE, 0x5A, i as u8];
            // The mark is the frame's last bytes, inside its IP length (the bridge may
            // trim what lies past it).
            let mut f = frame.clone();
            let n = f.len();
            f[n - 4..].copy_from_slice(&mark);
            write_frame(&vm, &f);
            let on_fabric = saw(&fabric, &mark, wait);
            let on_dev = saw(&dev, &mark, Duration::from_millis(1));
            let got = match (on_fabric, on_dev) {
                (true, false) => Landed::Fabric,
                (false, true) => Landed::Divert,
                (false, false) => Landed::Nowhere,
                (true, true) => {
                    bad.push(format!("{what}: landed on both"));
                    continue;
                }
            };
            if got != *want {
                bad.push(format!("{what}: landed {got:?}, want {want:?}"));
            }
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));

        // The port counted what the divert stopped, on the VM of its source.
        r.receive(&port, 0, Duration::from_millis(100));
        let count = |vm: Option<usize>, d: DevDrop| r.drops(vm, d);
        assert_eq!(count(Some(0), DevDrop::VmQp1Egress), 4);
        assert_eq!(count(Some(0), DevDrop::VmEgressUnclassified), 1);
        assert_eq!(count(Some(1), DevDrop::VmQp1Egress), 5);
        assert_eq!(count(Some(1), DevDrop::VmEgressUnclassified), 3);
        assert_eq!(count(None, DevDrop::WireEgressUnknownSource), 2);
        for v in 0..2 {
            assert_eq!(r.vms[v].counters.io(Io::WireRxFrames), 0);
        }
        // And the table its own: 6 spoofed, 9 QP1, 6 unclassified.
        let show = String::from_utf8_lossy(&divert(&["show", "tapx"]).stdout).into_owned();
        for (name, n) in [("spoofed", 6), ("qp1", 9), ("unclassified", 6)] {
            let want = format!("counter {name} {{\n\t\tpackets {n} ");
            assert!(show.contains(&want), "counter {name}: want {n}:\n{show}");
        }

        // A flood of its own QP1 frames: past the table's rate (1000 a second, burst
        // 1000) they are dropped on the tap, counted over_rate, and never reach DEV.
        let before = count(Some(0), DevDrop::VmQp1Egress);
        let flood = v4(A4, 5, 0x4000, 17, &roce(1));
        let start = Instant::now();
        for _ in 0..40 {
            for _ in 0..100 {
                write_frame(&vm, &flood);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let secs = start.elapsed().as_secs_f64();
        std::thread::sleep(Duration::from_millis(100));
        r.receive(&port, 0, Duration::from_millis(100));
        let through = count(Some(0), DevDrop::VmQp1Egress) - before;
        let most = 1000 + (1000.0 * secs) as u64 + 50;
        assert!(
            through <= most,
            "{through} of 4000 reached DEV in {secs:.3} s (at most {most})"
        );
        let show = String::from_utf8_lossy(&divert(&["show", "tapx"]).stdout).into_owned();
        assert!(
            !show.contains("counter over_rate {\n\t\tpackets 0 "),
            "nothing over the rate:\n{show}"
        );

        // del removes it all: everything passes again, and the table is gone.
        divert(&["del", "tapx", "pvcm-qp1"]);
        let mark = [0xC0, 0xDE, 0x5B, 0];
        let mut f = v4(A4, 5, 0x4000, 17, &roce(1));
        let n = f.len();
        f[n - 4..].copy_from_slice(&mark);
        write_frame(&vm, &f);
        assert!(
            saw(&fabric, &mark, wait),
            "after del: QP1 from the VM passes"
        );
        let tables = Command::new("nft")
            .args(["list", "tables"])
            .output()
            .unwrap();
        assert!(
            !String::from_utf8_lossy(&tables.stdout).contains("pvcm-tapx"),
            "after del: no table left"
        );
    });
}

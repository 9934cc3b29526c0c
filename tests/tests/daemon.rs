//! The backend daemon driven as QEMU would: vhost-user frontends over its sockets,
//! memfd guest memory, the guest driver's split queues; CM MADs built by hand.
//!
//! Each test owns its loopback addresses (127.11.x.x to 127.24.x.x, one second octet per
//! test), so the tests run in parallel with each other and with the lab (127.10.x.x).

#![allow(clippy::unwrap_used)]

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use pvcm_backend::Daemon;
use pvcm_backend::control;
use pvcm_backend::stats::Snapshot;
use pvcm_lab::backend::{self, LabVmSpec};
use pvcm_lab::{LabVm, VmOpts};
use pvcm_wire::Gid;
use pvcm_wire::abi::{self, MsgHeader, MsgType, SendStatus};
use pvcm_wire::mad::AttributeId;
use pvcm_wire::testing::{self as mads, Mad, view};

const T: Duration = Duration::from_secs(5);

fn ip(a: u8, b: u8, c: u8) -> Ipv4Addr {
    Ipv4Addr::new(127, a, b, c)
}

fn connect(dir: &Path, name: &str) -> LabVm {
    LabVm::connect(&backend::socket(dir, name), VmOpts::default()).unwrap()
}

fn stats(dir: &Path, host: &str) -> Snapshot {
    control::query(&dir.join(format!("{host}.ctl"))).unwrap()
}

/// Receives the next MAD (skipping nothing: anything else fails the test).
fn recv_mad(vm: &mut LabVm) -> (MsgHeader, Mad) {
    let m = vm.recv(T).expect("a MAD");
    assert_eq!(m.header.msg_type, MsgType::Mad, "{m:?}");
    (m.header, m.mad())
}

/// The IDs a handshake ends with.
#[derive(Debug, Clone, Copy)]
struct Conn {
    a_sl: u32,
    b_sl: u32,
    a_pv: u32,
    b_pv: u32,
    b_qpn: u32,
}

/// REQ / REP / RTU between VM `a` (active) and VM `b`, checking the rewriting and
/// routing at every step.
fn handshake(
    a: &mut LabVm,
    sa: &LabVmSpec,
    b: &mut LabVm,
    sb: &LabVmSpec,
    a_sl: u32,
    b_sl: u32,
) -> Conn {
    let (ca, cb) = (sa.vm_config(), sb.vm_config());
    let tid = 0xAAAA_0000_0000_0000 | u64::from(a_sl);
    let a_qpn = ca.qpn_base + 1;
    let b_qpn = cb.qpn_base + 7;
    a.send_mad(
        sb.gid(),
        &mads::req(sa.gid(), ca.ca_guid, a_sl, tid, sb.gid(), a_qpn),
    )
    .unwrap();
    let (h, m) = recv_mad(b);
    assert_eq!(h.remote_gid, sa.gid(), "REQ arrives from A's GID");
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Req);
    let a_pv = v.local_comm_id().unwrap();
    assert_ne!(a_pv, a_sl, "REQ's Local Comm ID rewritten");
    assert_ne!(v.tid(), tid, "REQ's TID rewritten");
    b.send_mad(sa.gid(), &mads::rep(cb.ca_guid, v.tid(), b_sl, a_pv, b_qpn))
        .unwrap();
    let (h, m) = recv_mad(a);
    assert_eq!(h.remote_gid, sb.gid());
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Rep);
    assert_eq!(
        v.remote_comm_id(),
        Some(a_sl),
        "REP's Remote Comm ID restored"
    );
    assert_eq!(v.tid(), tid, "REQ's TID restored");
    let b_pv = v.local_comm_id().unwrap();
    assert_ne!(b_pv, b_sl);
    a.send_mad(sb.gid(), &mads::rtu(tid, a_sl, b_pv)).unwrap();
    let (_, m) = recv_mad(b);
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Rtu);
    assert_eq!(v.remote_comm_id(), Some(b_sl));
    assert_eq!(v.local_comm_id(), Some(a_pv));
    Conn {
        a_sl,
        b_sl,
        a_pv,
        b_pv,
        b_qpn,
    }
}

/// DREQ from `a`, DREP from `b`.
fn disconnect(a: &mut LabVm, sa: &LabVmSpec, b: &mut LabVm, sb: &LabVmSpec, c: &Conn) {
    let tid = 0xD0D0_0000_0000_0000 | u64::from(c.a_sl);
    a.send_mad(sb.gid(), &mads::dreq(tid, c.a_sl, c.b_pv, c.b_qpn))
        .unwrap();
    let (_, m) = recv_mad(b);
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Dreq);
    assert_eq!(v.remote_comm_id(), Some(c.b_sl));
    assert_eq!(v.local_comm_id(), Some(c.a_pv));
    b.send_mad(sa.gid(), &mads::drep(v.tid(), c.b_sl, c.a_pv))
        .unwrap();
    let (_, m) = recv_mad(a);
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Drep);
    assert_eq!(v.remote_comm_id(), Some(c.a_sl));
    assert_eq!(v.tid(), tid, "DREQ's TID restored");
}

fn check_port_info(vm: &mut LabVm, s: &LabVmSpec) {
    let p = vm.port_info().unwrap();
    let c = s.vm_config();
    assert_eq!(p.abi_version, abi::ABI_VERSION);
    assert!(p.port_up);
    assert_eq!(p.gid, s.gid());
    assert_eq!(p.ca_guid, c.ca_guid);
    assert_eq!((p.qpn_base, p.qpn_count), (c.qpn_base, c.qpn_count));
    assert_eq!(p.name, s.name);
    assert!(p.max_entries > 0);
}

#[test]
fn two_vms_one_backend() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(11, 1, 1));
    let sb = LabVmSpec::new("b", ip(11, 1, 2));
    let d: Daemon = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let mut a = connect(dir.path(), "a");
    // B without EVENT_IDX and indirect descriptors: both ways work.
    let mut b = LabVm::connect(
        &backend::socket(dir.path(), "b"),
        VmOpts {
            event_idx: false,
            indirect: false,
            ..VmOpts::default()
        },
    )
    .unwrap();
    assert_eq!(
        a.config_abi().unwrap(),
        (abi::CONFIG_MAGIC, abi::ABI_VERSION)
    );
    assert_eq!(a.get_config(4, 8).unwrap(), vec![1, 0, 0, 0, 0, 0, 0, 0]);
    check_port_info(&mut a, &sa);
    check_port_info(&mut b, &sb);
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    // And the other way round.
    let c = handshake(&mut b, &sb, &mut a, &sa, 0x33, 0x44);
    disconnect(&mut b, &sb, &mut a, &sa, &c);

    // The sender counts a frame after sendmmsg returns, maybe after it was delivered.
    let s = wait_stats(dir.path(), "h", "frames counted", |s| {
        s.host.io("wire_tx_frames") == 10
    });
    let fa = &s.vm("a").unwrap().figures;
    let fb = &s.vm("b").unwrap().figures;
    assert_eq!(fa.cm("cm_tx_msgs", "req"), 1);
    assert_eq!(fa.cm("cm_tx_msgs", "rtu"), 1);
    assert_eq!(fa.cm("cm_tx_msgs", "dreq"), 1);
    assert_eq!(fa.cm("cm_rx_msgs", "rep"), 1);
    assert_eq!(fa.cm("cm_rx_msgs", "drep"), 1);
    assert_eq!(fb.cm("cm_rx_msgs", "req"), 1);
    assert_eq!(fb.cm("cm_tx_msgs", "rep"), 1);
    assert_eq!(s.host.cm("cm_tx_msgs", "req"), 2);
    assert_eq!(s.host.cm("cm_rx_msgs", "req"), 2);
    assert_eq!(s.host.io("wire_tx_frames"), 10);
    assert_eq!(s.host.io("wire_rx_frames"), 10);
    assert_eq!(s.host.drops.values().sum::<u64>(), 0, "{:?}", s.host.drops);
    assert_eq!(
        s.host.device_drops.values().sum::<u64>(),
        0,
        "{:?}",
        s.host.device_drops
    );
    let table = control::stat(&dir.path().join("h.ctl"), false).unwrap();
    assert!(table.contains("cm_tx_msgs:\n    drep"), "{table}");
    d.shutdown();
    assert!(!backend::socket(dir.path(), "a").exists());
    let _ = (b, a);
}

#[test]
fn two_vms_two_backends() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(20, 1, 1));
    let sa2 = LabVmSpec::new("a2", ip(20, 1, 2));
    let sb = LabVmSpec::new("b", ip(20, 2, 1));
    let h1 = backend::start(backend::config(dir.path(), "h1", &[&sa, &sa2], 1));
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let mut a = connect(dir.path(), "a");
    let mut a2 = connect(dir.path(), "a2");
    let mut b = connect(dir.path(), "b");
    check_port_info(&mut b, &sb);
    // Both of host 1's VMs connect to host 2's VM, with the same comm IDs: the IDs on the
    // wire differ, and each answer reaches the right VM.
    let c1 = handshake(&mut a, &sa, &mut b, &sb, 0x100, 0x200);
    let c2 = handshake(&mut a2, &sa2, &mut b, &sb, 0x100, 0x201);
    assert_ne!(c1.a_pv, c2.a_pv);
    disconnect(
        &mut b,
        &sb,
        &mut a2,
        &sa2,
        &Conn {
            a_sl: c2.b_sl,
            b_sl: c2.a_sl,
            a_pv: c2.b_pv,
            b_pv: c2.a_pv,
            b_qpn: sa2.vm_config().qpn_base + 1,
        },
    );
    disconnect(&mut a, &sa, &mut b, &sb, &c1);
    let s1 = stats(dir.path(), "h1");
    let s2 = stats(dir.path(), "h2");
    assert_eq!(s1.host.cm("cm_tx_msgs", "req"), 2);
    assert_eq!(s2.host.cm("cm_rx_msgs", "req"), 2);
    assert_eq!(s2.vm("b").unwrap().figures.cm("cm_tx_msgs", "rep"), 2);
    assert_eq!(s1.vm("a2").unwrap().figures.cm("cm_rx_msgs", "dreq"), 1);
    assert_eq!(s1.host.drops.values().sum::<u64>(), 0);
    assert_eq!(s2.host.drops.values().sum::<u64>(), 0);
    drop((a, a2, b));
    h1.shutdown();
    h2.shutdown();
}

#[test]
fn reattach_after_disconnect() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(12, 1, 1));
    let sb = LabVmSpec::new("b", ip(12, 2, 1));
    let h1 = backend::start(backend::config(dir.path(), "h1", &[&sa], 1));
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    // A's VMM goes away: the backend detaches the VM and disconnects on its behalf.
    a.disconnect();
    let (_, m) = recv_mad(&mut b);
    let v = view(&m);
    assert_eq!(v.attr(), AttributeId::Dreq, "DREQ on A's behalf");
    assert_eq!(v.remote_comm_id(), Some(c.b_sl));
    assert_eq!(v.local_comm_id(), Some(c.a_pv));
    // B answers; host 1 absorbs the DREP.
    b.send_mad(sa.gid(), &mads::drep(v.tid(), c.b_sl, c.a_pv))
        .unwrap();
    let deadline = std::time::Instant::now() + T;
    loop {
        let s = stats(dir.path(), "h1");
        if s.host.dropped("absorbed") == 1 {
            assert!(!s.vm("a").unwrap().attached);
            assert_eq!(s.host.cm("cm_tx_msgs", "dreq"), 1);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "DREP not absorbed: {s:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The VM comes back on the same socket and works again.
    let mut a = connect(dir.path(), "a");
    check_port_info(&mut a, &sa);
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x23);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    let s = stats(dir.path(), "h1");
    assert!(s.vm("a").unwrap().attached);
    assert_eq!(s.vm("a").unwrap().figures.io("sessions"), 2);
    drop((a, b));
    h1.shutdown();
    h2.shutdown();
}

#[test]
fn reset_device_releases_connections() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(13, 1, 1));
    let sb = LabVmSpec::new("b", ip(13, 1, 2));
    let h = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    a.reset_device().unwrap();
    let (_, m) = recv_mad(&mut b);
    assert_eq!(view(&m).attr(), AttributeId::Dreq);
    assert_eq!(view(&m).remote_comm_id(), Some(c.b_sl));
    drop((a, b));
    h.shutdown();
}

/// A driver that starts on a device whose VM holds connections (the guest's CM service
/// restarted, the guest rebooted: QEMU passes neither on as a device reset) asks for
/// the port first: the backend releases the old connections on the VM's behalf at once
/// and answers; the new driver connects as usual. Asking again with nothing held
/// releases nothing.
#[test]
fn a_new_driver_releases_the_connections_of_the_one_before() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(13, 2, 1));
    let sb = LabVmSpec::new("b", ip(13, 2, 2));
    let h = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    check_port_info(&mut b, &sb);
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    check_port_info(&mut a, &sa);
    let (_, m) = recv_mad(&mut b);
    assert_eq!(view(&m).attr(), AttributeId::Dreq, "DREQ on A's behalf");
    assert_eq!(view(&m).remote_comm_id(), Some(c.b_sl));
    assert_eq!(view(&m).local_comm_id(), Some(c.a_pv));
    let s = stats(dir.path(), "h");
    assert!(s.vm("a").unwrap().attached);
    assert_eq!(
        s.vm("a").unwrap().figures.io("sessions"),
        1,
        "the same vhost-user session"
    );
    // The new driver holds nothing: asking again releases nothing; it connects as usual.
    check_port_info(&mut a, &sa);
    assert!(
        a.recv(Duration::from_millis(300)).is_none(),
        "nothing more for A"
    );
    assert!(
        b.recv(Duration::from_millis(300)).is_none(),
        "nothing more for B"
    );
    let c2 = handshake(&mut a, &sa, &mut b, &sb, 0x31, 0x32);
    disconnect(&mut a, &sa, &mut b, &sb, &c2);
    drop((a, b));
    h.shutdown();
}

/// Waits until the backend's figures satisfy `f`.
fn wait_stats(dir: &Path, host: &str, what: &str, f: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let deadline = std::time::Instant::now() + T;
    loop {
        let s = stats(dir, host);
        if f(&s) {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {}",
            s.render()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Every bad input is a counted drop (device, wire or mux), with a SEND_ERROR for MADs
/// the device did not send; the queues and the VM keep working throughout.
#[test]
fn bad_inputs_are_counted_drops() {
    use pvcm_guest::virtq::Segment;
    use pvcm_wire::roce::{FrameRepr, Ipv4Repr, UdpRepr};
    use std::net::UdpSocket;

    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(14, 1, 1));
    let sb = LabVmSpec::new("b", ip(14, 1, 2));
    let h = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let opts = VmOpts {
        indirect: false,
        ..VmOpts::default()
    };
    let mut a = LabVm::connect(&backend::socket(dir.path(), "a"), opts).unwrap();
    let mut b = connect(dir.path(), "b");
    let ca = sa.vm_config();
    let still_works = |a: &mut LabVm| check_port_info(a, &sa);

    // Descriptor chains.
    let hdr = a.scratch(0, &mads::raw_header(2, 0)).unwrap();
    a.queue_chain(&[Segment::new(0xdead_0000_0000, 48)], &[])
        .unwrap(); // outside memory
    a.queue_chain(&[Segment::new(hdr, 24), Segment::new(0x10, 24)], &[])
        .unwrap(); // partly outside
    a.queue_chain(&[], &[Segment::new(hdr, 304)]).unwrap(); // device-writable
    a.queue_chain(&[Segment::new(hdr, 400)], &[]).unwrap(); // too long
    a.kick();
    still_works(&mut a);
    // A loop: a two-descriptor chain whose last descriptor links back to the head.
    a.reclaim_tx();
    let avail = a.tx.avail_ring_addr();
    let size = a.tx.size();
    a.queue_chain(&[Segment::new(hdr, 1), Segment::new(hdr + 1, 1)], &[])
        .unwrap();
    let pos = u64::from(a.tx.avail_idx() % size);
    let head = a.mem.read_u16(avail + 4 + 2 * pos).unwrap();
    let desc = |i: u16| a.tx.desc_table_addr() + 16 * u64::from(i);
    let second = a.mem.read_u16(desc(head) + 14).unwrap();
    let flags = pvcm_guest::virtq::VIRTQ_DESC_F_NEXT;
    a.mem
        .write(desc(second) + 12, &flags.to_le_bytes())
        .unwrap();
    a.mem.write(desc(second) + 14, &head.to_le_bytes()).unwrap();
    a.kick();
    still_works(&mut a);

    // Messages.
    a.queue_raw(&mads::raw_header(2, 0)[..20], 1).unwrap(); // shorter than a header
    a.queue_raw(&mads::raw_header(9, 0), 1).unwrap(); // unknown type
    a.queue_raw(&mads::raw_header(3, 0), 1).unwrap(); // PORT_INFO is device -> driver
    a.queue_raw(&mads::raw_header(1, 300), 1).unwrap(); // len above 256
    a.queue_raw(&mads::raw_header(1, 256), 1).unwrap(); // header says 256, chain has none
    let mut short = mads::raw_header(1, 100);
    short.extend_from_slice(&[0; 100]);
    a.queue_raw(&short, 3).unwrap(); // a MAD of 100 bytes
    a.kick();
    let e = a.recv_type(MsgType::SendError, T).unwrap();
    assert_eq!(e.header.status, SendStatus::Malformed as u16);
    assert_eq!(e.payload.len(), 100);
    let mut sa_mad = mads::req(sa.gid(), ca.ca_guid, 1, 1, sb.gid(), ca.qpn_base);
    sa_mad[1] = 0x03; // SA class, not CM
    a.send_mad(sb.gid(), &sa_mad).unwrap();
    let e = a.recv_type(MsgType::SendError, T).unwrap();
    assert_eq!(e.header.status, SendStatus::Malformed as u16);
    assert_eq!(e.mad(), sa_mad, "SEND_ERROR carries the MAD as sent");
    let fe80: Gid = "fe80::1".parse().unwrap();
    let good = mads::req(sa.gid(), ca.ca_guid, 2, 2, fe80, ca.qpn_base);
    a.send_mad(fe80, &good).unwrap();
    let e = a.recv_type(MsgType::SendError, T).unwrap();
    assert_eq!(e.header.status, SendStatus::WireError as u16);
    // The mux's checks: a DREQ for no connection, a REQ from someone else's GID.
    a.send_mad(sb.gid(), &mads::dreq(5, 0x77, 0x1234_5678, 9))
        .unwrap();
    let e = a.recv_type(MsgType::SendError, T).unwrap();
    assert_eq!(e.header.status, SendStatus::UnknownConnection as u16);
    let spoof = mads::req(sb.gid(), ca.ca_guid, 3, 3, sb.gid(), ca.qpn_base);
    a.send_mad(sb.gid(), &spoof).unwrap();
    let e = a.recv_type(MsgType::SendError, T).unwrap();
    assert_eq!(e.header.status, SendStatus::Spoofed as u16);
    assert_eq!(e.mad(), spoof);
    still_works(&mut a);

    // The wire: frames from a foreign socket to A's address.
    let sock = UdpSocket::bind((ip(14, 9, 9), 0)).unwrap();
    // Like a pvcm peer: DF set, so the kernel writes IP ID 0, the header these frames'
    // ICRCs are computed under (a socket left at the default writes a hashed ID, which
    // the raw receive path rightly refuses).
    let df: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: a live socket and a c_int option whose size is passed.
    let r = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&df as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(r, 0);
    let src = match sock.local_addr().unwrap() {
        std::net::SocketAddr::V4(v) => v,
        _ => unreachable!(),
    };
    let to = (sa.addr, pvcm_wire::roce::UDP_PORT);
    let frame = |mad: &Mad| {
        let mut f = [0u8; pvcm_wire::roce::FRAME_LEN];
        let ipr = Ipv4Repr::new(*src.ip(), sa.addr);
        let udp = UdpRepr {
            src_port: src.port(),
            ..UdpRepr::new(src.port())
        };
        FrameRepr::gsi(1, mad).emit(&mut f, &ipr, &udp).unwrap();
        f
    };
    let peer = Gid::from_ipv4(*src.ip());
    let req_to_a = mads::req(peer, 0x42, 0x99, 0x99, sa.gid(), 0x100);
    let ok = frame(&req_to_a);
    let mut bad = ok;
    bad[279] ^= 0xFF; // ICRC
    sock.send_to(&bad, to).unwrap();
    let mut bad = ok;
    bad[0] = 0x04; // RC SEND only
    sock.send_to(&bad, to).unwrap();
    let mut bad = frame(&req_to_a);
    bad[7] = 2; // to QP 2
    sock.send_to(&bad, to).unwrap();
    let mut q = req_to_a;
    let mut bad = frame(&q);
    bad[12..16].copy_from_slice(&[0, 0, 0, 1]); // Q_Key
    sock.send_to(&bad, to).unwrap();
    sock.send_to(&ok[..100], to).unwrap(); // short
    let mut long = ok.to_vec();
    long.extend_from_slice(&[0; 120]);
    sock.send_to(&long, to).unwrap(); // long
    q = mads::req(peer, 0x42, 0x98, 0x98, Gid::from_ipv4(ip(14, 7, 7)), 0x100);
    sock.send_to(&frame(&q), to).unwrap(); // a REQ for a GID nobody has
    q[1] = 0x03;
    sock.send_to(&frame(&q), to).unwrap(); // not CM
    // And a good one is delivered, from the foreign peer.
    sock.send_to(&ok, to).unwrap();
    let (hd, m) = recv_mad(&mut a);
    assert_eq!(hd.remote_gid, peer);
    assert_eq!(view(&m).attr(), AttributeId::Req);
    // B is unaffected, A still works.
    let c = handshake(&mut b, &sb, &mut a, &sa, 0x10, 0x20);
    disconnect(&mut b, &sb, &mut a, &sa, &c);

    let s = wait_stats(dir.path(), "h", "drops counted", |s| {
        s.host.dropped("malformed") >= 1
    });
    let f = &s.vm("a").unwrap().figures;
    for (reason, n) in [
        ("bad_address", 2),
        ("wrong_direction", 1),
        ("chain_too_long", 1),
        ("bad_chain", 1),
        ("truncated", 2),
        ("unknown_type", 2),
        ("oversize", 1),
        ("bad_mad_length", 1),
        ("not_cm", 1),
        ("bad_remote_gid", 1),
        ("wire_bad_icrc", 1),
        ("wire_bad_bth", 2),
        ("wire_bad_deth", 1),
        ("wire_bad_length", 2),
    ] {
        assert_eq!(f.dropped(reason), n, "{reason}: {}", s.render());
    }
    assert_eq!(f.dropped("unknown_connection"), 1);
    assert_eq!(f.dropped("spoofed_gid"), 1);
    assert_eq!(s.host.dropped("unknown_gid"), 1);
    assert_eq!(s.host.dropped("malformed"), 1);
    assert_eq!(f.io("send_errors"), 5);
    assert_eq!(
        s.vm("b")
            .unwrap()
            .figures
            .device_drops
            .values()
            .sum::<u64>(),
        0
    );
    drop((a, b));
    h.shutdown();
}

/// A VM that posts no rx buffers loses its own messages beyond the backlog (counted),
/// and nobody else notices.
#[test]
fn stuck_vm_backlog_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(15, 1, 1));
    let sb = LabVmSpec::new("b", ip(15, 1, 2));
    let sc = LabVmSpec::new("stuck", ip(15, 1, 3));
    let mut cfg = backend::config(dir.path(), "h", &[&sa, &sb, &sc], 1);
    cfg.rx_backlog_bytes = 4 * pvcm_backend::backlog::MSG_COST;
    let h = backend::start(cfg);
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let opts = VmOpts {
        post_rx: false,
        ..VmOpts::default()
    };
    let mut stuck = LabVm::connect(&backend::socket(dir.path(), "stuck"), opts).unwrap();
    let ca = sa.vm_config();
    for i in 0..10u32 {
        let m = mads::req(
            sa.gid(),
            ca.ca_guid,
            0x500 + i,
            u64::from(i),
            sc.gid(),
            ca.qpn_base + i,
        );
        a.queue_mad(sc.gid(), &m).unwrap();
    }
    a.kick();
    let s = wait_stats(dir.path(), "h", "backlog drops", |s| {
        s.vm("stuck").unwrap().figures.dropped("rx_backlog_full") == 6
    });
    assert_eq!(s.vm("stuck").unwrap().figures.cm("cm_rx_msgs", "req"), 10);
    // Meanwhile A and B carry on.
    let c = handshake(&mut a, &sa, &mut b, &sb, 1, 2);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    // The stuck VM posts buffers and gets what was kept.
    stuck.post_rx().unwrap();
    let got = stuck.recv_all(Duration::from_millis(300));
    assert_eq!(got.len(), 4, "{got:?}");
    for m in &got {
        assert_eq!(m.header.msg_type, MsgType::Mad);
        let mad = m.mad();
        assert_eq!(view(&mad).attr(), AttributeId::Req);
    }
    check_port_info(&mut stuck, &sc);
    drop((a, b, stuck));
    h.shutdown();
}

/// `--pcap`: every frame, as IPv4/UDP with correct lengths, checksums and ICRCs.
#[test]
fn pcap_has_every_frame() {
    use pcap_file::pcap::PcapReader;
    use pvcm_wire::roce;

    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(16, 1, 1));
    let sb = LabVmSpec::new("b", ip(16, 2, 1));
    let pcap = dir.path().join("cm.pcap");
    let mut cfg = backend::config(dir.path(), "h1", &[&sa], 1);
    cfg.pcap = Some(pcap.clone());
    let h1 = backend::start(cfg);
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    // One corrupted frame into host 1: captured as received, bad ICRC and all.
    let sock = std::net::UdpSocket::bind((ip(16, 9, 9), 0)).unwrap();
    let mut f = [0u8; roce::FRAME_LEN];
    let req = mads::req(sb.gid(), 1, 1, 1, sa.gid(), 0x10000);
    roce::FrameRepr::gsi(0, &req)
        .emit(
            &mut f,
            &roce::Ipv4Repr::new(ip(16, 9, 9), sa.addr),
            &roce::UdpRepr::new(9),
        )
        .unwrap();
    sock.send_to(&f, (sa.addr, roce::UDP_PORT)).unwrap();
    wait_stats(dir.path(), "h1", "wire drop", |s| {
        s.host.dropped("wire_bad_icrc") == 1
    });
    h1.shutdown();

    let mut r = PcapReader::new(std::fs::File::open(&pcap).unwrap()).unwrap();
    assert_eq!(r.header().datalink, pcap_file::DataLink::RAW);
    let mut seen = Vec::new();
    while let Some(p) = r.next_packet() {
        let p = p.unwrap();
        assert_eq!(p.orig_len as usize, p.data.len());
        let (ipr, udp, frame) = roce::parse_datagram(&p.data).unwrap();
        assert_eq!(usize::from(ipr.total_len), p.data.len());
        assert_eq!(usize::from(udp.length), p.data.len() - 20);
        assert_eq!(udp.dst_port, roce::UDP_PORT);
        let icrc_ok = roce::check_datagram_icrc(&p.data).is_ok();
        let dir_ = if ipr.src == sa.addr { "tx" } else { "rx" };
        let mad: Mad = frame.mad().try_into().unwrap();
        let attr = mads::view(&mad).attr();
        seen.push((dir_, attr, icrc_ok));
    }
    use AttributeId::*;
    assert_eq!(
        seen,
        vec![
            ("tx", Req, true),
            ("rx", Rep, true),
            ("tx", Rtu, true),
            ("tx", Dreq, true),
            ("rx", Drep, true),
            ("rx", Req, false),
        ],
        "{seen:?}"
    );
    drop((a, b));
    h2.shutdown();
}

/// `--metrics`: Prometheus text over HTTP, the same figures as the control socket.
#[test]
fn metrics_endpoint() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(17, 1, 1));
    let sb = LabVmSpec::new("b", ip(17, 1, 2));
    let mut cfg = backend::config(dir.path(), "h", &[&sa, &sb], 1);
    cfg.metrics = Some("127.0.0.1:0".parse().unwrap());
    let h = backend::start(cfg);
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c = handshake(&mut a, &sa, &mut b, &sb, 5, 6);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    wait_stats(dir.path(), "h", "frames counted", |s| {
        s.host.io("wire_tx_frames") == 5
    });
    let mut s = std::net::TcpStream::connect(h.metrics_addr().unwrap()).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200 OK\r\n"), "{resp}");
    for line in [
        "pvcm_cm_messages_total{vm=\"a\",group=\"cm_tx_msgs\",msg=\"req\"} 1",
        "pvcm_host_cm_messages_total{group=\"cm_rx_msgs\",msg=\"drep\"} 1",
        "pvcm_drops_total{vm=\"b\",layer=\"device\",reason=\"wire_bad_icrc\"} 0",
        "pvcm_vm_attached{vm=\"a\"} 1",
        "pvcm_host_io_total{kind=\"wire_tx_frames\"} 5",
    ] {
        assert!(resp.contains(line), "{line} missing:\n{resp}");
    }
    // The same figures on the control socket; the process's own (CPU time, memory)
    // move between the two requests.
    let figures = |t: &str| {
        t.lines()
            .filter(|l| !l.starts_with("process_") && !l.contains(" process_"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let body = resp.split("\r\n\r\n").nth(1).unwrap();
    let ctl = dir.path().join("h.ctl");
    assert_eq!(
        figures(body),
        figures(&control::request(&ctl, "metrics").unwrap())
    );
    // The VMs' sessions end: their counters stay (a counter never goes back).
    drop((a, b));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let after = loop {
        let t = control::request(&ctl, "metrics").unwrap();
        if t.contains("pvcm_vm_attached{vm=\"a\"} 0") {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a never detached:\n{t}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    for line in [
        "pvcm_cm_messages_total{vm=\"a\",group=\"cm_tx_msgs\",msg=\"req\"} 1",
        "pvcm_cm_messages_total{vm=\"a\",group=\"cm_tx_msgs\",msg=\"dreq\"} 1",
        "pvcm_entries{vm=\"a\",state=\"live\"} 0",
    ] {
        assert!(
            after.contains(line),
            "{line} missing after detach:\n{after}"
        );
    }
    h.shutdown();
}

/// A vhost-user protocol error ends only that VM's session; it can connect again.
#[test]
fn protocol_error_ends_only_that_session() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(18, 1, 1));
    let sb = LabVmSpec::new("b", ip(18, 1, 2));
    let h = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let mut b = connect(dir.path(), "b");
    // Garbage instead of vhost-user messages.
    let mut s = std::os::unix::net::UnixStream::connect(backend::socket(dir.path(), "a")).unwrap();
    s.write_all(&[0xFF; 64]).unwrap();
    wait_stats(dir.path(), "h", "session ended", |s| {
        let a = s.vm("a").unwrap();
        a.figures.io("sessions") == 1 && !a.attached
    });
    drop(s);
    check_port_info(&mut b, &sb);
    let mut a = connect(dir.path(), "a");
    let c = handshake(&mut a, &sa, &mut b, &sb, 1, 2);
    disconnect(&mut a, &sa, &mut b, &sb, &c);
    // Queue sizes: the largest the device takes.
    drop(a);
    let big = VmOpts {
        queue_size: 1024,
        ..VmOpts::default()
    };
    let mut a = LabVm::connect(&backend::socket(dir.path(), "a"), big).unwrap();
    check_port_info(&mut a, &sa);
    drop((a, b));
    h.shutdown();
}

/// Stopping a backend releases its VMs' connections on the wire: the peer's VM gets a
/// DREQ for each established connection.
#[test]
fn shutdown_releases_connections() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(19, 1, 1));
    let sb = LabVmSpec::new("b", ip(19, 2, 1));
    let h1 = backend::start(backend::config(dir.path(), "h1", &[&sa], 1));
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c1 = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    let c2 = handshake(&mut a, &sa, &mut b, &sb, 0x12, 0x23);
    h1.shutdown();
    let mut got = Vec::new();
    for _ in 0..2 {
        let (_, m) = recv_mad(&mut b);
        assert_eq!(view(&m).attr(), AttributeId::Dreq);
        got.push(view(&m).remote_comm_id().unwrap());
    }
    got.sort_unstable();
    assert_eq!(got, vec![c1.b_sl, c2.b_sl]);
    drop((a, b));
    h2.shutdown();
}

/// What waited for a VM's rx buffers when its session ended is discarded with the
/// session and counted (`rx_discarded`), not delivered to the next session.
#[test]
fn a_backlog_left_by_an_ended_session_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(21, 1, 1));
    let sc = LabVmSpec::new("late", ip(21, 1, 3));
    let h = backend::start(backend::config(dir.path(), "h", &[&sa, &sc], 1));
    let mut a = connect(dir.path(), "a");
    let opts = VmOpts {
        post_rx: false,
        ..VmOpts::default()
    };
    let late = LabVm::connect(&backend::socket(dir.path(), "late"), opts).unwrap();
    let ca = sa.vm_config();
    for i in 0..5u32 {
        let m = mads::req(
            sa.gid(),
            ca.ca_guid,
            0x700 + i,
            u64::from(i),
            sc.gid(),
            ca.qpn_base + i,
        );
        a.queue_mad(sc.gid(), &m).unwrap();
    }
    a.kick();
    wait_stats(dir.path(), "h", "REQs backlogged", |s| {
        s.vm("late").unwrap().figures.cm("cm_rx_msgs", "req") == 5
    });
    drop(late);
    let s = wait_stats(dir.path(), "h", "discarded", |s| {
        s.vm("late").unwrap().figures.dropped("rx_discarded") == 5
    });
    assert!(!s.vm("late").unwrap().attached);
    // A new session starts empty.
    let mut again = connect(dir.path(), "late");
    check_port_info(&mut again, &sc);
    assert!(again.recv_all(Duration::from_millis(200)).is_empty());
    drop((a, again));
    h.shutdown();
}

/// With `--state-dir`, a clean stop keeps the connections (no DREQ on the VM's behalf);
/// the next daemon restores them, and a restored VM that never reconnects has them
/// released on its behalf once `--reconnect-grace` has passed.
#[test]
fn a_stop_with_state_keeps_connections_and_the_grace_releases_a_vm_that_stays_away() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(22, 1, 1));
    let sb = LabVmSpec::new("b", ip(22, 2, 1));
    let state = dir.path().join("state");
    let cfg_a = || {
        let mut c = backend::config(dir.path(), "h1", &[&sa], 1);
        c.state_dir = Some(state.clone());
        c.reconnect_grace = Duration::from_secs(1);
        c
    };
    let h1 = backend::start(cfg_a());
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let c1 = handshake(&mut a, &sa, &mut b, &sb, 0x11, 0x22);
    h1.shutdown();
    assert!(
        b.recv(Duration::from_millis(500)).is_none(),
        "a stop with --state-dir sends nothing on the VM's behalf"
    );
    drop(a); // the VM's QEMU is gone too: it will not reconnect
    let h1 = backend::start(cfg_a());
    let s = stats(dir.path(), "h1");
    assert_eq!(s.host.live, 1, "{}", s.render());
    assert!(s.vms[0].attached, "restored, waiting for its session");
    // The grace ends: the connection is released on the VM's behalf.
    let (_, m) = recv_mad(&mut b);
    assert_eq!(view(&m).attr(), AttributeId::Dreq);
    assert_eq!(view(&m).remote_comm_id(), Some(c1.b_sl));
    assert_eq!(
        view(&m).local_comm_id(),
        Some(c1.a_pv),
        "under its old pv_cm_id"
    );
    assert!(!stats(dir.path(), "h1").vms[0].attached);
    drop(b);
    h1.shutdown();
    h2.shutdown();
}

/// A VM added at runtime (`vm add` on the control socket) comes back after a restart
/// over `--state-dir` with its connection, and `vm remove` then releases it on the VM's
/// behalf under its old pv_cm_id.
#[test]
fn a_vm_added_at_runtime_keeps_its_connections_across_a_restart_with_state() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(24, 1, 1));
    let sx = LabVmSpec::new("x", ip(24, 1, 2));
    let sb = LabVmSpec::new("b", ip(24, 2, 1));
    let state = dir.path().join("state");
    let cfg_a = || {
        let mut c = backend::config(dir.path(), "h1", &[&sa], 1);
        c.state_dir = Some(state.clone());
        c
    };
    let ctl = dir.path().join("h1.ctl");
    let h1 = backend::start(cfg_a());
    let h2 = backend::start(backend::config(dir.path(), "h2", &[&sb], 2));
    let add = format!(
        "vm add name=x,socket={},gid={}",
        backend::socket(dir.path(), "x").display(),
        sx.addr
    );
    let answer = control::request(&ctl, &add).unwrap();
    assert!(answer.starts_with("ok: "), "{answer}");
    let mut x = connect(dir.path(), "x");
    let mut b = connect(dir.path(), "b");
    let c1 = handshake(&mut x, &sx, &mut b, &sb, 0x31, 0x42);
    h1.shutdown();
    drop(x);
    let h1 = backend::start(cfg_a());
    let s = stats(dir.path(), "h1");
    assert_eq!(s.host.live, 1, "{}", s.render());
    let vx = s.vms.iter().find(|v| v.name == "x").unwrap();
    assert!(vx.attached, "restored, waiting for its session");
    let answer = control::request(&ctl, "vm remove x").unwrap();
    assert!(answer.contains("its 1 live connections"), "{answer}");
    let (_, m) = recv_mad(&mut b);
    assert_eq!(view(&m).attr(), AttributeId::Dreq);
    assert_eq!(view(&m).remote_comm_id(), Some(c1.b_sl));
    assert_eq!(
        view(&m).local_comm_id(),
        Some(c1.a_pv),
        "under its old pv_cm_id"
    );
    drop(b);
    h1.shutdown();
    h2.shutdown();
}

/// Live migration through vhost-user's device-state transfer: VM `m` holds connections
/// to VM `p` on a third backend and moves from backend A to backend B (which has it as
/// `incoming`) as QEMU moves a device: rings stopped on A, state saved from A and loaded
/// into B, rings started on B. Afterwards a handshake begun before the move completes,
/// the peer's DREQs (to the pv_cm_ids A gave) reach `m` on B, `m`'s own DREQs reach the
/// peer, A holds nothing of `m`, and nothing is dropped anywhere.
#[test]
fn a_vm_live_migrates_between_backends_with_its_connections() {
    let (da, db, dp) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let sm = LabVmSpec::new("m", ip(23, 1, 1));
    let sp = LabVmSpec::new("p", ip(23, 2, 1));
    let range: pvcm_backend::mux::IdRange = "0x80230000/16".parse().unwrap();
    let with_range = |mut c: pvcm_backend::config::Config, incoming: bool| {
        c.vms[0].vm.id_range = Some(range);
        c.vms[0].vm.quota = Some(1000);
        c.vms[0].incoming = incoming;
        c
    };
    let _a = backend::start(with_range(
        backend::config(da.path(), "a", &[&sm], 0xA),
        false,
    ));
    let _b = backend::start(with_range(
        backend::config(db.path(), "b", &[&sm], 0xB),
        true,
    ));
    let _p = backend::start(backend::config(dp.path(), "p", &[&sp], 0xC));
    let mut m = connect(da.path(), "m");
    let mut p = connect(dp.path(), "p");

    let conns: Vec<Conn> = (0..20)
        .map(|i| handshake(&mut m, &sm, &mut p, &sp, 100 + i, 500 + i))
        .collect();
    for c in &conns {
        assert!(range.contains(c.a_pv), "{:#x} from the VM's range", c.a_pv);
    }
    // A handshake in flight across the move: the REQ reached the peer, no REP yet.
    let (cm, cp) = (sm.vm_config(), sp.vm_config());
    let tid = 0xAAAA_0000_0000_0999;
    m.send_mad(
        sp.gid(),
        &mads::req(sm.gid(), cm.ca_guid, 999, tid, sp.gid(), cm.qpn_base + 1),
    )
    .unwrap();
    let (_, req) = recv_mad(&mut p);
    let pending_pv = view(&req).local_comm_id().unwrap();
    assert_eq!(
        stats(db.path(), "b").host.live,
        0,
        "B has nothing before the move"
    );

    let bytes = m.migrate_to(&backend::socket(db.path(), "m")).unwrap();
    assert!(bytes > 21 * 64, "{bytes} bytes of state");
    let (sa, sb) = (stats(da.path(), "a"), stats(db.path(), "b"));
    assert_eq!(
        (sa.host.live, sa.host.quarantined),
        (0, 0),
        "A let m go: {}",
        sa.render()
    );
    assert_eq!(sb.host.live, 21, "B has m's entries: {}", sb.render());
    // `vm list` tells a departed VM (the libvirt hook removes it on A) from one here.
    for (dir, host, want) in [(da.path(), "a", "departed"), (db.path(), "b", "attached")] {
        let list = control::request(&dir.join(format!("{host}.ctl")), "vm list").unwrap();
        let vms: serde_json::Value = serde_json::from_str(&list).unwrap();
        assert_eq!(vms[0]["state"], want, "{host}: {list}");
    }

    // The pending handshake completes through B.
    p.send_mad(
        sm.gid(),
        &mads::rep(
            cp.ca_guid,
            view(&req).tid(),
            1999,
            pending_pv,
            cp.qpn_base + 9,
        ),
    )
    .unwrap();
    let (h, rep) = recv_mad(&mut m);
    assert_eq!(h.remote_gid, sp.gid());
    assert_eq!(
        view(&rep).remote_comm_id(),
        Some(999),
        "routed by the pv_cm_id A gave"
    );
    assert_eq!(view(&rep).tid(), tid, "the REQ's TID restored on B");
    let p_pv = view(&rep).local_comm_id().unwrap();
    m.send_mad(sp.gid(), &mads::rtu(tid, 999, p_pv)).unwrap();
    let (_, rtu) = recv_mad(&mut p);
    assert_eq!(view(&rtu).remote_comm_id(), Some(1999));

    // Half the connections end from the peer (DREQs to A's IDs), half from m.
    for c in &conns[..10] {
        let back = Conn {
            a_sl: c.b_sl,
            b_sl: c.a_sl,
            a_pv: c.b_pv,
            b_pv: c.a_pv,
            b_qpn: cm.qpn_base + 1,
        };
        disconnect(&mut p, &sp, &mut m, &sm, &back);
    }
    for c in &conns[10..] {
        disconnect(&mut m, &sm, &mut p, &sp, c);
    }
    disconnect(
        &mut m,
        &sm,
        &mut p,
        &sp,
        &Conn {
            a_sl: 999,
            b_sl: 1999,
            a_pv: pending_pv,
            b_pv: p_pv,
            b_qpn: cp.qpn_base + 9,
        },
    );
    for (dir, host) in [(da.path(), "a"), (db.path(), "b"), (dp.path(), "p")] {
        let s = stats(dir, host);
        let d: u64 = s
            .host
            .drops
            .values()
            .chain(s.host.device_drops.values())
            .sum();
        assert_eq!(d, 0, "{host}: {}", s.render());
    }
    let sa = stats(da.path(), "a");
    assert_eq!(
        sa.host.cm("cm_tx_msgs", "dreq"),
        0,
        "A sent nothing on m's behalf"
    );
    let sb = stats(db.path(), "b");
    assert_eq!(sb.host.cm("cm_rx_msgs", "dreq"), 10);
    assert_eq!(sb.host.cm("cm_tx_msgs", "dreq"), 11);
}

/// While the VMM migrates (`VHOST_F_LOG_ALL` and a log base set), every page the device
/// writes (the rx message, the used ring) is marked in the VMM's dirty log.
#[test]
fn device_writes_are_in_the_dirty_log_while_migrating() {
    let dir = tempfile::tempdir().unwrap();
    let sa = LabVmSpec::new("a", ip(23, 3, 1));
    let sb = LabVmSpec::new("b", ip(23, 3, 2));
    let _d = backend::start(backend::config(dir.path(), "h", &[&sa, &sb], 1));
    let mut a = connect(dir.path(), "a");
    let mut b = connect(dir.path(), "b");
    let log = b.start_dirty_log().unwrap();
    // The backend may still be finishing its start-up work on B's rings (re-arming a
    // notification writes the used ring's avail_event, which is logged as it must be):
    // wait for a quiet log before the handshake, so what follows is the handshake's.
    let quiet = (0..100).any(|_| {
        log.clear();
        std::thread::sleep(Duration::from_millis(20));
        log.dirty_pages() == 0
    });
    assert!(
        quiet,
        "the log never went quiet: {} pages",
        log.dirty_pages()
    );
    let _ = handshake(&mut a, &sa, &mut b, &sb, 0x31, 0x32);
    let used = pvcm_guest::transport::pci::QueueSetup::from(b.rx.virtq()).device;
    assert!(log.is_dirty(used), "B's rx used ring is logged");
    assert!(
        log.dirty_pages() >= 2,
        "the rx buffers too: {} pages",
        log.dirty_pages()
    );
}

/// A real backend process (`pvcm-lab __backend ARGS`, the `pvcm-backend` command line),
/// its log in a file; killed if the test ends before it stopped.
struct BackendProc {
    child: Option<std::process::Child>,
    log: std::path::PathBuf,
}

impl BackendProc {
    /// Starts it and waits (10 s at most) until its control socket `ctl` answers.
    fn spawn(args: &[String], ctl: &Path, log: &Path) -> BackendProc {
        let file = std::fs::File::create(log).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_pvcm-lab"))
            .arg("__backend")
            .args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        let p = BackendProc {
            child: Some(child),
            log: log.to_path_buf(),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while control::query(ctl).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "backend did not come up"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    /// Sends SIGTERM; returns how long the process took to exit (it is killed at
    /// `limit`) and its log. It must have exited with status 0.
    fn sigterm(&mut self, limit: Duration) -> (Duration, String) {
        let mut c = self.child.take().unwrap();
        // SAFETY: signals our own child process.
        unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = c.try_wait().unwrap() {
                break Some(s);
            }
            if t0.elapsed() > limit {
                let _ = c.kill();
                let _ = c.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let took = t0.elapsed();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        match status {
            Some(s) => assert!(s.success(), "{s:?}\n{log}"),
            None => panic!("no exit {limit:?} after SIGTERM\n{log}"),
        }
        (took, log)
    }
}

impl Drop for BackendProc {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `--vm` for a lab VM with its socket in `dir`, plus `extra` keys.
fn vm_arg(dir: &Path, s: &LabVmSpec, extra: &str) -> [String; 2] {
    [
        "--vm".into(),
        format!(
            "name={},socket={},gid={}{extra}",
            s.name,
            backend::socket(dir, &s.name).display(),
            s.addr
        ),
    ]
}

const STOP_LIMIT: Duration = Duration::from_secs(2);

/// SIGTERM stops a backend process within 2 s while VMs are attached with live
/// connections, and while another VM's socket file was removed under it.
#[test]
fn sigterm_stops_within_2s_with_vms_attached_and_a_socket_removed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (sa, sb, sc) = (
        LabVmSpec::new("a", ip(25, 1, 1)),
        LabVmSpec::new("b", ip(25, 1, 2)),
        LabVmSpec::new("c", ip(25, 1, 3)),
    );
    let ctl = d.join("h.ctl");
    let mut args: Vec<String> = [&sa, &sb, &sc]
        .into_iter()
        .flat_map(|s| vm_arg(d, s, ""))
        .collect();
    args.extend([
        "--control".into(),
        ctl.display().to_string(),
        "--seed".into(),
        "1".into(),
    ]);
    let mut h = BackendProc::spawn(&args, &ctl, &d.join("h.log"));
    let mut a = connect(d, "a");
    let mut b = connect(d, "b");
    let _ = handshake(&mut a, &sa, &mut b, &sb, 0x41, 0x42);
    assert_eq!(control::query(&ctl).unwrap().host.live, 2);
    std::fs::remove_file(backend::socket(d, "c")).unwrap();
    let (took, log) = h.sigterm(STOP_LIMIT);
    assert!(log.contains("stopped"), "{took:?}\n{log}");
}

/// SIGTERM stops both ends of a live migration within 2 s: the source while the VMM
/// logs the device's writes (VHOST_F_LOG_ALL, a log base set), the destination while
/// its incoming VM waits for its state, its socket file removed.
#[test]
fn sigterm_stops_within_2s_mid_migration() {
    let (ds, dt) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (s, t) = (ds.path(), dt.path());
    let sm = LabVmSpec::new("m", ip(26, 1, 1));
    let sp = LabVmSpec::new("p", ip(26, 2, 1));
    let migratable = ",id-range=0x80260000/16,quota=1000";
    let common = |ctl: &Path| {
        vec![
            "--control".to_string(),
            ctl.display().to_string(),
            "--wire-rx".into(),
            "raw".into(),
        ]
    };
    let (sctl, tctl) = (s.join("s.ctl"), t.join("t.ctl"));
    let mut args: Vec<String> = vm_arg(s, &sm, migratable).into();
    args.extend(vm_arg(s, &sp, ""));
    args.extend(common(&sctl));
    let mut src = BackendProc::spawn(&args, &sctl, &s.join("s.log"));
    let mut args: Vec<String> = vm_arg(t, &sm, &format!("{migratable},incoming=yes")).into();
    args.extend(common(&tctl));
    let mut dst = BackendProc::spawn(&args, &tctl, &t.join("t.log"));
    let mut m = connect(s, "m");
    let mut p = connect(s, "p");
    let _ = handshake(&mut m, &sm, &mut p, &sp, 0x51, 0x52);
    let _log = m.start_dirty_log().unwrap();
    std::fs::remove_file(backend::socket(t, "m")).unwrap();
    let (took, log) = dst.sigterm(STOP_LIMIT);
    assert!(log.contains("stopped"), "{took:?}\n{log}");
    let (took, log) = src.sigterm(STOP_LIMIT);
    assert!(log.contains("stopped"), "{took:?}\n{log}");
}

//! RoCEv2 over IPv6 end to end: two backends in a network namespace of their own, each
//! with VMs whose GIDs are IPv6 addresses on its loopback (a global pair and a
//! link-local pair, `gid=fe80::...%lo`), and the guest driver's CM agent in every VM.
//! Connections are established and torn down both ways with no drop and no retry.
//!
//! Needs root (the namespace); without it the test prints SKIP and passes.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use pvcm_backend::config::{Config, VmSpec};
use pvcm_backend::control;
use pvcm_backend::stats::Snapshot;
use pvcm_lab::backend;
use pvcm_lab::lab::guest::{GuestOpts, GuestVm};
use pvcm_lab::lab::standalone::{PairSide, pair_connections};
use pvcm_wire::Gid;

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Adds an IPv6 address to lo and waits for its local route (the kernel adds it from a
/// work queue after `ip` returns).
fn add_addr(cidr: &str) {
    ip(&["addr", "add", cidr, "dev", "lo", "nodad"]);
    let addr = cidr.split('/').next().unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let out = Command::new("ip")
            .args(["-6", "route", "show", "table", "local", addr])
            .output()
            .unwrap();
        if !out.stdout.is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    panic!("no local route for {addr}");
}

/// Runs `f` on a thread moved into a new network namespace (loopback up); `None` when
/// this process cannot have one.
fn in_netns<T: Send>(f: impl FnOnce() -> T + Send) -> Option<T> {
    // SAFETY: geteuid(2) cannot fail.
    if unsafe { libc::geteuid() } != 0 || Command::new("ip").arg("-V").output().is_err() {
        eprintln!("SKIP ipv6 lab test: needs root and iproute2 (a network namespace)");
        return None;
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            // SAFETY: unshare(2) moves only this thread (and what it starts) into a new
            // network namespace.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                eprintln!(
                    "SKIP ipv6 lab test: unshare: {}",
                    std::io::Error::last_os_error()
                );
                return None;
            }
            ip(&["link", "set", "lo", "up"]);
            Some(f())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

fn config(dir: &Path, host: &str, vms: &[(&str, &str)], seed: u64) -> Config {
    let specs = vms
        .iter()
        .map(|(name, gid)| {
            format!(
                "socket={},gid={gid},name={name}",
                backend::socket(dir, name).display()
            )
            .parse::<VmSpec>()
            .unwrap()
        })
        .collect();
    let mut c = Config::new(specs);
    c.control = Some(dir.join(format!("{host}.ctl")));
    c.seed = Some(seed);
    c.pcap = Some(dir.join(format!("{host}.pcap")));
    c
}

fn guest(dir: &Path, name: &str, seed: u64) -> GuestVm {
    let opts = GuestOpts {
        seed,
        ..GuestOpts::default()
    };
    GuestVm::connect(&backend::socket(dir, name), &opts).unwrap()
}

/// `n` connections from `client` to `server`, each established, then torn down from
/// the client; both guests are pumped in this thread.
fn connections(
    client: &mut GuestVm,
    server: &mut GuestVm,
    to: Gid,
    n: u32,
) -> (PairSide, PairSide) {
    pair_connections(
        client,
        server,
        to,
        7471,
        b"v6",
        n,
        Duration::from_secs(60),
        |all_up| all_up,
    )
    .unwrap()
}

fn no_drops(host: &str, s: &Snapshot) {
    for (k, v) in s.host.drops.iter().chain(s.host.device_drops.iter()) {
        assert_eq!(*v, 0, "{host}: {k}");
    }
}

#[test]
fn ipv6_vms_on_two_backends() {
    in_netns(|| {
        for a in [
            "fd00:6::1/128",
            "fd00:6::2/128",
            "fe80::6:1/64",
            "fe80::6:2/64",
        ] {
            add_addr(a);
        }
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let h1 = backend::start(config(
            d,
            "h1",
            &[("a", "fd00:6::1"), ("l1", "fe80::6:1%lo")],
            1,
        ));
        let h2 = backend::start(config(
            d,
            "h2",
            &[("b", "fd00:6::2"), ("l2", "fe80::6:2%lo")],
            2,
        ));
        let (mut a, mut b) = (guest(d, "a", 11), guest(d, "b", 12));
        let (mut l1, mut l2) = (guest(d, "l1", 13), guest(d, "l2", 14));
        assert_eq!(a.dev.agent().config().gid, "fd00:6::1".parse().unwrap());
        // Global addresses, h1's VM to h2's; link-local ones, h2's VM to h1's.
        let (c, s) = connections(&mut a, &mut b, "fd00:6::2".parse().unwrap(), 40);
        assert_eq!(
            (c.established, s.established, c.disconnected, s.disconnected),
            (40, 40, 40, 40)
        );
        assert_eq!((c.retries, s.retries), (0, 0));
        let (c, s) = connections(&mut l2, &mut l1, "fe80::6:1".parse().unwrap(), 20);
        assert_eq!(
            (c.established, s.established, c.disconnected, s.disconnected),
            (20, 20, 20, 20)
        );
        assert_eq!((c.retries, s.retries), (0, 0));
        let s1 = control::query(&d.join("h1.ctl")).unwrap();
        let s2 = control::query(&d.join("h2.ctl")).unwrap();
        no_drops("h1", &s1);
        no_drops("h2", &s2);
        // Every frame crossed the wire as IPv6: each backend sent what the other took.
        let (tx1, rx1) = (s1.host.io("wire_tx_frames"), s1.host.io("wire_rx_frames"));
        let (tx2, rx2) = (s2.host.io("wire_tx_frames"), s2.host.io("wire_rx_frames"));
        assert_eq!((tx1, rx1), (rx2, tx2));
        // 60 connections: REQ, REP, RTU, DREQ, DREP each.
        assert_eq!(tx1 + tx2, 5 * 60);
        drop((a, b, l1, l2));
        h1.shutdown();
        h2.shutdown();
        let mut r = datagrams(&d.join("h1.pcap"));
        assert_eq!(r.len() as u64, tx1 + rx1);
        r.retain(|p| p.first().map(|b| b >> 4) != Some(6));
        assert!(r.is_empty(), "every captured datagram is IPv6");
    });
}

/// The datagrams of a pcap file.
fn datagrams(p: &Path) -> Vec<Vec<u8>> {
    let mut r = pcap_file::pcap::PcapReader::new(std::fs::File::open(p).unwrap()).unwrap();
    let mut out = Vec::new();
    while let Some(pkt) = r.next_packet() {
        out.push(pkt.unwrap().data.to_vec());
    }
    out
}
